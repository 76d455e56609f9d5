//! [`TpGroup`]: one rank of a tensor-parallel group — its rank, world size, stream, NCCL
//! communicator, symmetric workspace and topology policy.
//!
//! # Three ways to build a group
//!
//! | constructor | ranks | symmetric memory | NCCL |
//! |---|---|---|---|
//! | [`TpGroup::virtual_ranks`] | W ranks on one GPU, one new stream each | W buffers on that GPU | none |
//! | [`TpGroup::single_process`] | one GPU per rank, one process | peer access between the process's contexts | [`Comm::init_all`] |
//! | [`TpGroup::from_comm`] | one rank per process | CUDA IPC handles exchanged over the communicator | the given [`Comm`] |
//!
//! # Streams
//!
//! Every op of a rank is enqueued on its group's stream ([`TpGroup::stream`]), and only
//! there: tpfuse makes no stream of its own for an op, and waits for nothing else. To run on
//! the engine's streams, build the group on them: [`TpGroup::virtual_ranks_on`] and
//! [`TpGroup::single_process_on`] take one stream per rank; [`TpGroup::from_comm`] takes the
//! communicator's, which [`Comm::init_rank`] (a new communicator on the engine's stream) or
//! [`Comm::from_raw`] (the engine's own `ncclComm_t`) set. The constructors without `_on`
//! make new streams. The engine orders its own work against the group's stream (the same
//! stream, or events).
//!
//! The custom kernels cannot tell the three apart. Virtual ranks are how every multi-rank
//! kernel is tested on one GPU: the kernels of all W ranks must be resident at once, so each
//! rank's grid is capped (the CTA budget, [`cta_budget`]).
//!
//! World sizes are 2 ..= 8 (`TPFUSE_MAX_RANKS`); a one-rank group has nothing to exchange
//! and is refused with [`Error::InvalidArgument`] naming the argument that carried the size.
//!
//! # The protocol every rank keeps
//!
//! Block `b` of every rank meets block `b` of its peers at every barrier, so every rank must
//! launch the same custom collectives, in the same order, with the same grid ([`blocks`]),
//! the same capacity and the same deadline. Groups built in one process get this by
//! construction; [`TpGroup::from_comm`] exchanges every rank's options and refuses ranks
//! that disagree.
//!
//! # Poisoning
//!
//! Every launch's waits share one deadline, the launch's start plus the group's
//! [`timeout`] (with a `%clock64` backstop at 4 x the timeout). A wait that expires records
//! `TPFUSE_ERROR_PEER_TIMEOUT | peer` in the rank's error word and in every peer's (so
//! everyone stops waiting); ranks whose launches differ (kernel, size, epilogue or grid)
//! record `TPFUSE_ERROR_PEER_MISMATCH` at the first barrier. A launch that fails marks its
//! outputs with [`Element::failed_output`](crate::Element::failed_output) (a NaN of
//! tpfuse's own payload) and copies the error word to the rank's word in mapped host
//! memory. The host reads that word before every launch, without synchronising: the op
//! returns [`Error::PeerTimeout`] / [`Error::PeerMismatch`] (or [`Error::Timeout`] when the
//! blocks of a launch could not all meet) and *poisons* the group, which
//! then refuses every further custom launch ([`Error::GroupPoisoned`]): the barriers' epochs
//! of the ranks no longer agree, so the group must be dropped and rebuilt.
//!
//! A CUDA graph captured earlier is not stopped by the host's refusal, but every replay of
//! it on a poisoned group fails at once and marks its outputs again. An engine that replays
//! graphs calls [`TpGroup::failure`] (no synchronisation) once per step, after it has
//! synchronised with the step's results and before it uses them. [`TpGroup::check`] waits
//! for the stream first (bounded by five times the timeout plus one second): a stream that does
//! not drain in time, or that reports a CUDA error, poisons the group too. Groups built
//! together in one process ([`TpGroup::virtual_ranks`], [`TpGroup::single_process`]) share
//! one poison flag: a failure seen by one rank poisons all of them. Ranks in other processes
//! find out through their own error words and deadlines.
//!
//! Dropping a group frees its symmetric memory only when no kernel can still touch it: a
//! rank's launch may end while its peers still read its buffers (no barrier closes a launch),
//! so with one rank per process ([`TpGroup::from_comm`] over CUDA IPC) the drop
//! waits at a host barrier for every peer to drain its stream first; a poisoned group, whose
//! peers may be gone, leaks its buffers instead (about `2 × capacity` plus 2.4 MiB a rank),
//! as does a group whose stream does not drain in time.
//!
//! [`blocks`]: TpGroup::blocks
//! [`timeout`]: TpGroup::timeout

mod agreement;
mod build;
mod failure;
mod phases;

use build::backstop_cycles;
pub(crate) use build::{sm_count, DeviceFacts};

use crate::comm::Comm;
use crate::device::{cuda, poll_stream};
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::symmetric::{self, SymmetricWorkspace};
use crate::topology::{AllReduceRule, Verdict};
use cudarc::driver::{sys, CudaStream};
use failure::{error_of_word, HostErrorWord, Poison};
use std::sync::Arc;
use std::time::Duration;

pub use phases::BlockPhases;

/// The most thread blocks a custom kernel launches per rank (`TPFUSE_MAX_BLOCKS`).
pub const MAX_BLOCKS: usize = kernels::TPFUSE_MAX_BLOCKS as usize;

/// Bytes of device memory each group (each virtual rank) allocates for its layers' GEMMs:
/// the scratch of the parallel split of `k` ([`crate::ops::gemm::gemm_with_scratch`]), enough
/// for the decode steps (m ≤ 64) of the built-in models' layers at TP 2 to 8. A shape that
/// needs more runs its parts one after another (the same bits).
pub const SPLIT_SCRATCH_BYTES: usize = 8 << 20;

/// The largest group the custom kernels serve (`TPFUSE_MAX_RANKS`).
pub const MAX_WORLD: usize = symmetric::MAX_RANKS;

/// How a group is sized and how long it waits.
///
/// Every rank of a group must use the same options ([`TpGroup::from_comm`] checks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupOptions {
    /// Bytes per rank of the largest message the custom kernels take (rounded up to a
    /// multiple of 256). Each rank allocates twice this (staging and results). Default:
    /// 8 MiB.
    pub capacity_bytes: usize,
    /// Bound on every wait of a custom kernel for a peer (and, five times plus one second, on
    /// [`TpGroup::check`]'s wait for the stream). Default: 10 s.
    pub timeout: Duration,
    /// Thread blocks per custom kernel launch (1 ..= [`MAX_BLOCKS`]), instead of
    /// [`cta_budget`]'s choice. For virtual ranks, `world * blocks` must not exceed the
    /// device's SM count. Default: `None`.
    pub blocks: Option<usize>,
    /// At most this many blocks of the fused GEMM + all-reduce (and GEMM + reduce-scatter) on
    /// each SM (1 ..= 32), and of the fused all-gather + GEMM. Default `None`: GEMM +
    /// all-reduce as many as one SM holds (the occupancy API, per tile configuration), so that
    /// every SM streams several blocks' weights; all-gather + GEMM, which
    /// [`Fusion::Auto`](crate::ops::linear::Fusion::Auto) runs, one (the grid its rule was
    /// measured with; `Some(n)` gives it up to `n`, as many as one SM holds). A grid of several
    /// blocks an SM needs the room of every SM it is given: a kernel of another stream holding
    /// part of an SM delays it, and one that meanwhile waits for another GPU (another
    /// communicator's collective) can hold it until the deadline (`Error::PeerTimeout`).
    /// `Some(1)` leaves room beside it (one block an SM, as tpfuse ran it before).
    pub fused_blocks_per_sm: Option<usize>,
    /// Whether the fused GEMM + all-reduce (one-shot) may exchange its partial tiles as
    /// packets, each 4 bytes of data with a 4-byte tag stored into every rank's signal pad, so
    /// that a peer's partial crosses the link once with its readiness (no flag, then a read
    /// across the link): where `world · m · n · 4` bytes fit [`PACKET_HALF_BYTES`]. The bits
    /// are the same either way. Default: `true`.
    pub fused_packets: bool,
    /// Whether the one-shot all-reduce (with its epilogue) exchanges its input as packets
    /// where every rank's packets fit [`PACKET_HALF_BYTES`] (`2 · world · bytes`, whole
    /// 16-byte vectors, with RMSNorm rows of at most two segments: 8192 16-bit elements):
    /// each rank stores its input, 4 bytes and a tag in 8, into every rank's signal pad and
    /// reduces from its own, no barrier and no read across the link, the same bits as by
    /// flags. Default: `false`: never measured on a GPU, and the plan's model puts it behind
    /// the flags at 8 ranks and m = 1 (each row's packets, 2 · 8 times its bytes, go through
    /// one SM: `docs/performance.md`, "The one-shot all-reduce by packets").
    pub all_reduce_packets: bool,
}

/// Bytes of each half of a rank's packet area (`TPFUSE_PACKET_HALF_BYTES`): the fused
/// GEMM + all-reduce exchanges packets where `world · m · n · 4` fit it (1 MiB: m ≤ 4 rows
/// of 8192 at 8 ranks, m ≤ 32 rows of 4096 at 2). Each rank's signal pad holds two halves.
pub const PACKET_HALF_BYTES: usize = kernels::TPFUSE_PACKET_HALF_BYTES as usize;

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            capacity_bytes: 8 << 20,
            timeout: Duration::from_secs(10),
            blocks: None,
            fused_blocks_per_sm: None,
            fused_packets: true,
            all_reduce_packets: false,
        }
    }
}

impl GroupOptions {
    /// Checks every field: a capacity of at least one byte (whose doubled, rounded size is
    /// addressable), a positive timeout of at most `u64::MAX` nanoseconds, and a block count
    /// in 1 ..= [`MAX_BLOCKS`], fused blocks per SM in 1 ..= 32. The error names the field
    /// (`options.capacity_bytes`, …).
    pub fn validate(&self) -> Result<()> {
        if symmetric::round_capacity(self.capacity_bytes).is_none() {
            return Err(Error::invalid(
                "options.capacity_bytes",
                format!(
                    "{} bytes: the capacity must be at least 1 byte, and twice it (rounded up \
                     to {} bytes) must be addressable",
                    self.capacity_bytes,
                    symmetric::CAPACITY_ALIGN
                ),
            ));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid(
                "options.timeout",
                "0: every wait needs a positive bound",
            ));
        }
        if u64::try_from(self.timeout.as_nanos()).is_err() {
            return Err(Error::invalid(
                "options.timeout",
                format!("{:?} does not fit in 64-bit nanoseconds", self.timeout),
            ));
        }
        if let Some(b) = self.blocks {
            if !(1..=MAX_BLOCKS).contains(&b) {
                return Err(Error::invalid(
                    "options.blocks",
                    format!("{b}: a custom kernel launches 1 to {MAX_BLOCKS} blocks"),
                ));
            }
        }
        if let Some(b) = self.fused_blocks_per_sm {
            if !(1..=32).contains(&b) {
                return Err(Error::invalid(
                    "options.fused_blocks_per_sm",
                    format!("{b}: an SM holds 1 to 32 blocks"),
                ));
            }
        }
        Ok(())
    }

    /// The bytes of each half of the packet area the fused kernels may use.
    fn packet_bytes(&self) -> usize {
        if self.fused_packets {
            PACKET_HALF_BYTES
        } else {
            0
        }
    }

    /// The bytes of each half of the packet area the one-shot all-reduce may use.
    fn all_reduce_packet_bytes(&self) -> usize {
        if self.all_reduce_packets {
            PACKET_HALF_BYTES
        } else {
            0
        }
    }

    fn timeout_ns(&self) -> u64 {
        u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX)
    }
}

/// The thread blocks per custom kernel launch that a group of `world` ranks uses by
/// default, on devices of `sms` streaming multiprocessors.
///
/// - Virtual ranks (`virtual_ranks = true`): `sms / world`, at least 1, at most
///   [`MAX_BLOCKS`]. The kernels of all W ranks must be resident together, and each block
///   (512 threads, up to 128 registers a thread, `__launch_bounds__(512, 1)`) fills one SM.
/// - Real groups: `sms / 2`, at least 1, at most [`MAX_BLOCKS`] (half the GPU, leaving room
///   for the work the collective overlaps with). Every rank must use the same value: block
///   `b` of each rank meets block `b` of its peers.
///
/// ```
/// use tpfuse::group::cta_budget;
/// assert_eq!(cta_budget(132, 8, true), 16); // H100, TP-8 rehearsed on one card
/// assert_eq!(cta_budget(132, 2, true), 64); // capped
/// assert_eq!(cta_budget(132, 8, false), 64);
/// assert_eq!(cta_budget(1, 8, true), 1);
/// ```
pub fn cta_budget(sms: usize, world: usize, virtual_ranks: bool) -> usize {
    let per_rank = if virtual_ranks {
        sms / world.max(1)
    } else {
        sms / 2
    };
    per_rank.clamp(1, MAX_BLOCKS)
}

/// How long [`TpGroup::check`] (and Drop) wait for a rank's stream: five times the kernels'
/// deadline plus one second (the two-shot fused kernel's slice waits run to twice it). Should `%globaltimer` stall, that is past the kernels' `%clock64`
/// backstop (4 x the deadline in peak-clock cycles) while the SMs run at 80% of their peak
/// clock or more; slower, the host gives up first (`Error::Timeout`, the group poisoned,
/// and Drop leaks the buffers rather than free them under a running kernel).
fn wait_bound(timeout: Duration) -> Duration {
    timeout
        .saturating_mul(5)
        .saturating_add(Duration::from_secs(1))
}

fn wait_stream(stream: &CudaStream, bound: Duration) -> Result<bool> {
    poll_stream(stream, bound, "waiting for the group's stream", || Ok(()))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Virtual,
    SingleProcess,
    Ipc,
}

/// One rank of a tensor-parallel group.
///
/// Holds the rank's stream (every op of the rank is enqueued there), its NCCL
/// communicator (none for virtual ranks), its view of the group's symmetric memory, the
/// CTA budget and the deadline of the custom kernels, and the topology verdict that the
/// ops consult to choose between the custom kernels and NCCL.
///
/// A `TpGroup` is `Send` and `Sync`: an engine's ops may share a rank's group (`&TpGroup` or
/// `Arc<TpGroup>` from several threads; candle's custom ops need both). Sharing is
/// memory-safe; the protocol is the engine's to keep, as with NCCL: every rank enqueues the
/// same collectives in the same order, so a rank's ops are issued from one thread at a time,
/// or in an order every rank repeats. tpfuse's barriers catch ranks whose launches differ in
/// kernel, size, epilogue or grid ([`Error::PeerMismatch`]) and peers that never come
/// ([`Error::PeerTimeout`]); two same-shaped collectives issued in different orders on
/// different ranks are not caught (their results are wrong), and collectives that diverge on
/// the NCCL path hang in NCCL as they would without tpfuse. A CUDA graph captured on the
/// group's stream by another thread captures tpfuse's launches too.
///
/// Dropping a group waits (bounded) for its stream. An IPC group ([`TpGroup::from_comm`])
/// then closes the peers' buffers and meets its peers at a barrier before it frees its own,
/// so every rank should drop its group at about the same time; a rank whose peers do not
/// come waits up to the communicator's timeout.
pub struct TpGroup {
    rank: usize,
    world: usize,
    mode: Mode,
    stream: Arc<CudaStream>,
    workspace: Option<SymmetricWorkspace>,
    /// The layers' GEMM scratch for the parallel split of k ([`SPLIT_SCRATCH_BYTES`], on the
    /// group's stream only).
    split_scratch: std::sync::Mutex<Option<cudarc::driver::CudaSlice<u8>>>,
    unavailable: Option<String>,
    verdict: Option<Verdict>,
    rule: AllReduceRule,
    blocks: usize,
    /// The fused GEMM + all-reduce's persistent grid bound ([`TpGroup::fused_blocks`]).
    fused_blocks: usize,
    /// The smallest and the largest SM count of the group's GPUs.
    group_sms: (usize, usize),
    /// The rank's device, for the fused kernels' plans.
    device_facts: DeviceFacts,
    timeout: Duration,
    /// The packet area's half the fused GEMM + all-reduce may use (0: none).
    packet_bytes: usize,
    /// The packet area's half the one-shot all-reduce may use (0: none).
    all_reduce_packet_bytes: usize,
    poison: Arc<Poison>,
    /// This rank's host-mapped error word; `None` without symmetric memory.
    host_error: Option<HostErrorWord>,
    /// The peak SM clock of the rank's device, for the deadline's backstop in cycles.
    clock_khz: u64,
    comm: Option<Comm>,
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpGroup")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("mode", &self.mode)
            .field("device", &self.device())
            .field("capacity", &self.capacity())
            .field("blocks", &self.blocks)
            .field("timeout", &self.timeout)
            .field("custom_kernels_refused", &self.unavailable)
            .field("poisoned", &self.poison.reason())
            .finish()
    }
}

impl TpGroup {
    /// This rank, in `0..world`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks, 2 ..= 8.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The stream every op of this rank is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// CUDA ordinal of this rank's device.
    pub fn device(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// The NCCL communicator; `None` for virtual ranks.
    pub fn comm(&self) -> Option<&Comm> {
        self.comm.as_ref()
    }

    /// Bytes per rank of the largest message the custom kernels take (the options'
    /// capacity rounded up to a multiple of 256); 0 when the group has no symmetric memory
    /// (see [`TpGroup::custom_kernels_refused`]).
    pub fn capacity(&self) -> usize {
        self.workspace.as_ref().map_or(0, |w| w.capacity())
    }

    /// Whether the ranks are virtual ranks on one GPU.
    pub fn is_virtual(&self) -> bool {
        self.mode == Mode::Virtual
    }

    /// The topology policy's verdict for the group's GPUs; `None` for virtual ranks and when
    /// NVML is unavailable. The same on every rank.
    pub fn verdict(&self) -> Option<&Verdict> {
        self.verdict.as_ref()
    }

    /// The rule that chooses between the custom kernels and NCCL by message size
    /// ([`AllReduceRule::default`]).
    pub fn rule(&self) -> &AllReduceRule {
        &self.rule
    }

    /// The layers' GEMM scratch (locked for one call on the group's stream).
    pub(crate) fn split_scratch(
        &self,
    ) -> std::sync::MutexGuard<'_, Option<cudarc::driver::CudaSlice<u8>>> {
        self.split_scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The SMs the fused kernels' persistent grids may use ([`crate::ops::gemm_all_reduce()`],
    /// [`crate::ops::all_gather_gemm()`]), the same on every rank: every SM of the group's
    /// smallest GPU for real groups (the kernel is the layer's GEMM: it streams the weights and
    /// needs every SM, where the all-reduce's budget leaves half the GPU to the work it
    /// overlaps with); for virtual ranks, which share one device, its SMs divided among the
    /// ranks. The fused kernels run as many blocks on each as it holds at once (the occupancy
    /// API, per kernel and tile configuration, read when the group was built; at most
    /// [`GroupOptions::fused_blocks_per_sm`]).
    pub fn fused_blocks(&self) -> usize {
        self.fused_blocks
    }

    /// The smallest and the largest SM count of the group's GPUs (one device's twice for
    /// virtual ranks).
    pub(crate) fn group_sms(&self) -> (usize, usize) {
        self.group_sms
    }

    /// The rank's device: compute capability and SM count, read when the group was built.
    pub(crate) fn device_facts(&self) -> DeviceFacts {
        self.device_facts
    }

    /// Thread blocks per custom kernel launch (the CTA budget), the same on every rank.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// The bound on every wait of a custom kernel for a peer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// This rank's view of the symmetric memory; `None` when the group has none.
    pub fn workspace(&self) -> Option<&SymmetricWorkspace> {
        self.workspace.as_ref()
    }

    /// Why the custom kernels cannot run on this group (no peer access, CUDA IPC refused,
    /// several hosts), or `None` when they can. The ops then use NCCL.
    pub fn custom_kernels_refused(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    /// Bytes of each half of the packet area the fused GEMM + all-reduce may use
    /// ([`GroupOptions::fused_packets`]: [`PACKET_HALF_BYTES`], or 0).
    pub fn packet_bytes(&self) -> usize {
        self.packet_bytes
    }

    /// Bytes of each half of the packet area the one-shot all-reduce may use
    /// ([`GroupOptions::all_reduce_packets`]: [`PACKET_HALF_BYTES`], or 0).
    pub fn all_reduce_packet_bytes(&self) -> usize {
        self.all_reduce_packet_bytes
    }

    /// The arguments of a custom kernel launch: the peer table and this rank's group
    /// arguments. [`Error::GroupPoisoned`] once the group is poisoned;
    /// [`Error::InvalidArgument`] when the group has no symmetric memory.
    pub(crate) fn kernel_args(
        &self,
    ) -> Result<(kernels::tpfuse_peers, kernels::tpfuse_group_args)> {
        self.failure()?;
        let ws = self.workspace.as_ref().ok_or_else(|| {
            Error::invalid(
                "group",
                format!(
                    "the custom kernels cannot run on this group: {}",
                    self.unavailable.as_deref().unwrap_or("no symmetric memory")
                ),
            )
        })?;
        let timeout_ns = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX);
        let args = kernels::tpfuse_group_args {
            rank: self.rank as i32,
            world: self.world as i32,
            blocks: self.blocks as i32,
            capacity: ws.capacity() as u64,
            timeout_ns,
            backstop_cycles: backstop_cycles(timeout_ns, self.clock_khz),
            host_error: self
                .host_error
                .as_ref()
                .map_or(std::ptr::null_mut(), HostErrorWord::device_ptr),
            packet_bytes: self.packet_bytes as u64,
        };
        Ok((ws.table(), args))
    }

    /// Waits until everything enqueued on this rank's stream has finished (polling, bounded
    /// by five times the timeout plus one second, never an unbounded synchronize), then reads this
    /// rank's error word.
    ///
    /// - `Ok(())`: the stream drained and no kernel of this rank timed out.
    /// - [`Error::PeerTimeout`] (`rank` = this rank, `peer` = the rank that did not arrive,
    ///   `after` = the timeout): a kernel gave up on a peer; the group is now poisoned.
    /// - [`Error::PeerMismatch`]: two ranks launched different collectives; poisoned.
    /// - [`Error::Timeout`] naming the blocks of a launch: they did not all meet (not all
    ///   resident at once); poisoned.
    /// - [`Error::Timeout`]: the stream did not drain within the bound; poisoned.
    /// - [`Error::Cuda`]: the stream failed; poisoned.
    /// - [`Error::GroupPoisoned`]: the group (or a group built with it) was poisoned before.
    /// - [`Error::InvalidArgument`] (`stream`): the stream is being captured into a CUDA
    ///   graph; nothing was waited for and the group is not poisoned.
    pub fn check(&self) -> Result<()> {
        if let Some(reason) = self.poison.reason() {
            return Err(Error::GroupPoisoned(reason));
        }
        let mut capture = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: queries a live stream; legal (and harmless) during a capture.
        unsafe { sys::cuStreamIsCapturing(self.stream.cu_stream(), &mut capture) }
            .result()
            .map_err(cuda("asking whether the group's stream is capturing"))?;
        if capture != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(Error::invalid(
                "stream",
                "check() waits for the stream, which is being captured into a CUDA graph: \
                 call it after the capture, once the graph has been launched",
            ));
        }
        let bound = wait_bound(self.timeout);
        match wait_stream(&self.stream, bound) {
            Ok(true) => {}
            Ok(false) => {
                let what = format!(
                    "rank {} of {}: the group's stream to drain (a kernel may be waiting for a \
                     peer that never launched, or earlier work runs long)",
                    self.rank, self.world
                );
                self.poison.set(format!(
                    "rank {}: timed out waiting for its stream",
                    self.rank
                ));
                return Err(Error::Timeout { what, after: bound });
            }
            Err(e) => {
                self.poison
                    .set(format!("rank {}: its stream failed: {e}", self.rank));
                return Err(e);
            }
        }
        let Some(ws) = &self.workspace else {
            return Ok(());
        };
        let word = ws.read_error_word(&self.stream).inspect_err(|e| {
            self.poison.set(format!(
                "rank {}: reading its error word failed: {e}",
                self.rank
            ));
        })?;
        self.fail_on_word(word)
    }

    /// Whether a custom kernel of this rank has failed, without waiting for anything (no
    /// stream synchronisation, no copy): reads the rank's host-mapped error word, which
    /// every launch that does not complete sets before it returns.
    ///
    /// - `Ok(())`: no launch of this rank has failed so far (launches still running may).
    /// - [`Error::PeerTimeout`] / [`Error::PeerMismatch`] / [`Error::Timeout`] (the blocks of
    ///   a launch did not all meet): a launch failed; the group is now poisoned. Its outputs hold
    ///   [`Element::failed_output`](crate::Element::failed_output).
    /// - [`Error::GroupPoisoned`]: the group (or a group built with it) was poisoned before.
    ///
    /// Every op calls it before it launches, so a failure stops the next eager call. Work
    /// replayed from a CUDA graph passes no host call: an engine that replays graphs calls
    /// `failure()` once per step, after it has synchronised with the step's results (as it
    /// must before it samples from the logits) and before it uses them; a failed step's
    /// outputs are never plausible numbers (they are NaN of tpfuse's payload), and every
    /// later replay's collectives fail at once without waiting.
    pub fn failure(&self) -> Result<()> {
        if let Some(reason) = self.poison.reason() {
            return Err(Error::GroupPoisoned(reason));
        }
        match &self.host_error {
            Some(w) => self.fail_on_word(w.read()),
            None => Ok(()),
        }
    }

    /// A custom collective's launcher code: `Ok` for 0; otherwise the launch error, and the
    /// group is poisoned. A rank whose launch did not happen is out of step with its peers
    /// (the fused kernels' launch epoch did not advance on it), so it must not launch again
    /// on this group.
    pub(crate) fn launched(&self, kernel: &'static str, code: i32) -> Result<()> {
        crate::validate::launched(kernel, code).inspect_err(|e| {
            self.poison.set(format!(
                "rank {}: a custom kernel did not launch: {e}",
                self.rank
            ));
        })
    }

    /// Poisons the group for a nonzero error word and returns its error.
    fn fail_on_word(&self, word: u32) -> Result<()> {
        let Some(error) = error_of_word(word, self.rank, self.timeout) else {
            return Ok(());
        };
        self.poison.set(format!("rank {}: {error}", self.rank));
        Err(error)
    }

    /// Whether the group (or a group built together with it) is poisoned.
    pub fn is_poisoned(&self) -> bool {
        self.poison.reason().is_some()
    }
}

impl Drop for TpGroup {
    fn drop(&mut self) {
        let Some(ws) = self.workspace.take() else {
            return;
        };
        if !matches!(
            wait_stream(&self.stream, wait_bound(self.timeout)),
            Ok(true)
        ) {
            // A kernel may still read or write the buffers: leak them rather than free them
            // under it.
            std::mem::forget(ws);
            if let Ok(mut scratch) = self.split_scratch.lock() {
                std::mem::forget(scratch.take());
            }
            std::mem::forget(self.host_error.take());
            return;
        }
        let own = ws.release_imports();
        if self.mode == Mode::Ipc {
            // This rank's stream drained, but its peers may still read its buffers and write
            // its pad: no barrier closes a launch (cuda/barrier.cuh, "Finished launches").
            // Every peer has drained its stream and closed its mapping of our buffers once
            // it passes this barrier; without it (a poisoned group, whose peers may be gone,
            // or a barrier that failed) this rank's memory is leaked rather than freed under
            // a peer's kernel.
            let closed =
                !self.is_poisoned() && self.comm.as_ref().is_some_and(|c| c.barrier().is_ok());
            if !closed {
                std::mem::forget(own);
                return;
            }
        }
        drop(own);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_bound_covers_the_kernel_deadline() {
        assert_eq!(wait_bound(Duration::from_secs(10)), Duration::from_secs(51));
        assert_eq!(wait_bound(Duration::MAX), Duration::MAX);
    }

    #[test]
    fn the_backstop_is_four_timeouts_at_the_peak_clock() {
        assert_eq!(backstop_cycles(1_000_000, 2_000_000), 8_000_000);
        assert_eq!(backstop_cycles(u64::MAX, 4_000_000), u64::MAX);
    }
}

/// Kernel-level checks of the group's host side that need the crate's private launcher
/// bindings: a completed exchange leaves the group healthy; a peer that never launches
/// turns into `Error::PeerTimeout` and poisons every rank.
#[cfg(test)]
mod gpu_tests {
    use super::*;
    use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
    use std::ffi::c_void;

    const LEN: usize = 4096;

    /// Enqueues `tpfuse_all_gather` of `input` into `out` on `group`'s stream.
    fn all_gather(group: &TpGroup, input: &CudaSlice<u8>, out: &mut CudaSlice<u8>) -> Result<()> {
        let (peers, args) = group.kernel_args()?;
        let stream = group.stream();
        let (i, _gi) = input.device_ptr(stream);
        let (o, _go) = out.device_ptr_mut(stream);
        // SAFETY: `input` holds LEN bytes and `out` world * LEN, both on the group's device;
        // the workspace lives as long as `group`.
        let code = unsafe {
            kernels::tpfuse_all_gather(
                &peers,
                &args,
                i as *const c_void,
                o as *mut c_void,
                LEN,
                stream.cu_stream() as *mut c_void,
            )
        };
        crate::validate::launched("tpfuse_all_gather", code)
    }

    fn buffers(group: &TpGroup) -> (CudaSlice<u8>, CudaSlice<u8>) {
        let s = group.stream();
        let input = s.clone_htod(&vec![group.rank() as u8 + 1; LEN]).unwrap();
        let out = s.alloc_zeros::<u8>(LEN * group.world()).unwrap();
        (input, out)
    }

    #[test]
    #[cfg_attr(
        not(any(feature = "gpu-tests", feature = "emulator")),
        ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
    )]
    fn an_all_gather_leaves_every_rank_healthy() {
        let ctx = crate::device::open(0).unwrap();
        for world in [2, 4, 8] {
            let groups = TpGroup::virtual_ranks(&ctx, world, GroupOptions::default()).unwrap();
            let mut bufs: Vec<_> = groups.iter().map(buffers).collect();
            for _ in 0..3 {
                for (g, (input, out)) in groups.iter().zip(&mut bufs) {
                    all_gather(g, input, out).unwrap();
                }
            }
            for (g, (_, out)) in groups.iter().zip(&bufs) {
                g.check().unwrap();
                let got = g.stream().clone_dtoh(out).unwrap();
                for r in 0..world {
                    assert!(
                        got[r * LEN..(r + 1) * LEN]
                            .iter()
                            .all(|&b| b == r as u8 + 1),
                        "world {world}, rank {}: slice {r} is wrong",
                        g.rank()
                    );
                }
            }
        }
    }

    #[test]
    #[cfg_attr(
        not(any(feature = "gpu-tests", feature = "emulator")),
        ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
    )]
    fn a_peer_that_never_launches_poisons_the_group() {
        let ctx = crate::device::open(0).unwrap();
        let options = GroupOptions {
            timeout: Duration::from_millis(200),
            ..GroupOptions::default()
        };
        let groups = TpGroup::virtual_ranks(&ctx, 2, options).unwrap();
        let (input, mut out) = buffers(&groups[0]);
        let start = std::time::Instant::now();
        all_gather(&groups[0], &input, &mut out).unwrap();
        match groups[0].check() {
            Err(Error::PeerTimeout {
                rank: 0,
                peer: 1,
                after,
            }) => {
                assert_eq!(after, Duration::from_millis(200));
            }
            other => panic!("expected PeerTimeout from rank 0 waiting for rank 1, got {other:?}"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        for g in &groups {
            assert!(g.is_poisoned());
            assert!(matches!(g.kernel_args(), Err(Error::GroupPoisoned(_))));
            assert!(matches!(g.check(), Err(Error::GroupPoisoned(_))));
        }
    }
}

// A group is shared by an engine's ops (candle's custom ops need Send + Sync).
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    shared::<TpGroup>();
};
