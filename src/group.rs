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
//! [`timeout`]. A wait that expires records `TPFUSE_ERROR_PEER_TIMEOUT | peer` in the rank's
//! error word and in every other peer's (so the survivors stop waiting too) and the kernel
//! returns; [`TpGroup::check`] turns that into [`Error::PeerTimeout`] and *poisons* the
//! group. A poisoned group refuses every further custom launch ([`Error::GroupPoisoned`]):
//! the barriers' epochs of the ranks no longer agree, so the group must be dropped and
//! rebuilt. (A CUDA graph captured earlier is not stopped by the host's refusal: its
//! replays return at once on a rank whose error word is set, but a rank that never learned
//! of the timeout waits out its deadline on each replay. Stop replaying once `check`
//! fails.) A stream that does not drain within the host's bound
//! (twice the timeout plus one second) or that reports a CUDA error poisons the group too.
//! Groups built together in one process ([`TpGroup::virtual_ranks`],
//! [`TpGroup::single_process`]) share one poison flag: a timeout seen by one rank poisons
//! all of them. Ranks in other processes find out through their own deadlines.
//!
//! [`blocks`]: TpGroup::blocks
//! [`timeout`]: TpGroup::timeout

use crate::comm::{Comm, CommOptions};
use crate::device::{cuda, poll_stream, require_driver};
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::symmetric::{self, IpcOutcome, SymmetricWorkspace};
use crate::topology::{self, AllReduceRule, Discovery, RankPlace, Refusal, Topology, Verdict};
use cudarc::driver::{sys, CudaContext, CudaStream};
use std::ffi::c_char;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The most thread blocks a custom kernel launches per rank (`TPFUSE_MAX_BLOCKS`).
pub const MAX_BLOCKS: usize = kernels::TPFUSE_MAX_BLOCKS as usize;

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
    /// Bound on every wait of a custom kernel for a peer (and, doubled plus one second, on
    /// [`TpGroup::check`]'s wait for the stream). Default: 10 s.
    pub timeout: Duration,
    /// Thread blocks per custom kernel launch (1 ..= [`MAX_BLOCKS`]), instead of
    /// [`cta_budget`]'s choice. For virtual ranks, `world * blocks` must not exceed the
    /// device's SM count. Default: `None`.
    pub blocks: Option<usize>,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            capacity_bytes: 8 << 20,
            timeout: Duration::from_secs(10),
            blocks: None,
        }
    }
}

impl GroupOptions {
    /// Checks every field: a capacity of at least one byte (whose doubled, rounded size is
    /// addressable), a positive timeout of at most `u64::MAX` nanoseconds, and a block count
    /// in 1 ..= [`MAX_BLOCKS`]. The error names the field (`options.capacity_bytes`, …).
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
        Ok(())
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
///   (512 threads, about 100 registers a thread, `__launch_bounds__(512, 1)`) fills one SM.
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

/// How long [`TpGroup::check`] (and Drop) wait for a rank's stream: twice the kernels'
/// deadline plus one second.
fn wait_bound(timeout: Duration) -> Duration {
    timeout
        .saturating_mul(2)
        .saturating_add(Duration::from_secs(1))
}

fn wait_stream(stream: &CudaStream, bound: Duration) -> Result<bool> {
    poll_stream(stream, bound, "waiting for the group's stream", || Ok(()))
}

/// The poison flag, shared by the groups built together in one process.
#[derive(Debug, Default)]
struct Poison {
    flag: AtomicBool,
    reason: OnceLock<String>,
}

impl Poison {
    fn set(&self, reason: String) {
        let _ = self.reason.set(reason);
        self.flag.store(true, Ordering::Release);
    }

    fn reason(&self) -> Option<String> {
        if !self.flag.load(Ordering::Acquire) {
            return None;
        }
        Some(
            self.reason
                .get()
                .cloned()
                .unwrap_or_else(|| "an earlier failure".to_string()),
        )
    }
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
/// A `TpGroup` is `Send` (move each rank to its own thread) but not `Sync`.
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
    unavailable: Option<String>,
    verdict: Option<Verdict>,
    rule: AllReduceRule,
    blocks: usize,
    timeout: Duration,
    poison: Arc<Poison>,
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

fn sm_count(ctx: &CudaContext) -> Result<usize> {
    let sms = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(cuda("reading the SM count"))?;
    Ok(sms.max(1) as usize)
}

impl TpGroup {
    /// `world` ranks on the device of `ctx`, rank `r` at index `r`, each with its own new
    /// stream of `ctx`; how multi-rank kernels are tested on one GPU, and how a TP-8 layout
    /// is rehearsed on one card. No communicator ([`TpGroup::comm`] is `None`), no verdict.
    ///
    /// The CTA budget is `options.blocks` or [`cta_budget`]`(sms, world, true)`; the
    /// kernels of all ranks must fit on the device together, so `world * blocks` may not
    /// exceed the SM count. They must also run concurrently, on `world` streams: set
    /// `CUDA_DEVICE_MAX_CONNECTIONS` to at least the number of streams the process uses (32
    /// is safe) before the first CUDA call, or two ranks may share a hardware queue and one
    /// waits behind the other until the deadline turns it into [`Error::PeerTimeout`].
    ///
    /// Errors: [`Error::InvalidArgument`] for `world` outside 2 ..= 8, invalid `options`,
    /// or more blocks than the device can hold at once; [`Error::Cuda`] when an allocation
    /// or a stream fails.
    pub fn virtual_ranks(
        ctx: &Arc<CudaContext>,
        world: usize,
        options: GroupOptions,
    ) -> Result<Vec<TpGroup>> {
        symmetric::check_world("world", world)?;
        options.validate()?;
        require_driver()?;
        let sms = sm_count(ctx)?;
        let blocks = options
            .blocks
            .unwrap_or_else(|| cta_budget(sms, world, true));
        if blocks * world > sms {
            let arg = if options.blocks.is_some() {
                "options.blocks"
            } else {
                "world"
            };
            return Err(Error::invalid(
                arg,
                format!(
                    "{world} virtual ranks x {blocks} blocks = {} blocks, but device {} has \
                     {sms} SMs: the kernels of every rank must be resident at once (one block \
                     per SM)",
                    world * blocks,
                    ctx.ordinal()
                ),
            ));
        }
        let workspaces = symmetric::virtual_ranks(ctx, world, options.capacity_bytes)?;
        let poison = Arc::new(Poison::default());
        let mut groups = Vec::with_capacity(world);
        for (rank, ws) in workspaces.into_iter().enumerate() {
            let stream = ctx
                .new_stream()
                .map_err(cuda("creating a virtual rank's stream"))?;
            #[cfg(feature = "emulator")]
            crate::emulator::counters::tag_stream(&stream, rank);
            groups.push(TpGroup {
                rank,
                world,
                mode: Mode::Virtual,
                stream,
                workspace: Some(ws),
                unavailable: None,
                verdict: None,
                rule: AllReduceRule::default(),
                blocks,
                timeout: options.timeout,
                poison: poison.clone(),
                comm: None,
            });
        }
        Ok(groups)
    }

    /// One process, one GPU per rank: rank `i` on CUDA device `ordinals[i]`, on the stream
    /// of an NCCL communicator built with [`Comm::init_all`] (default [`CommOptions`]).
    /// Symmetric memory uses peer access between the devices; the verdict comes from NVML
    /// ([`topology::discover`] and [`topology::assess`]), `None` when NVML is unavailable.
    ///
    /// Where the driver reports no peer access between two of the devices, the group is
    /// still built, without symmetric memory: [`TpGroup::capacity`] is 0,
    /// [`TpGroup::custom_kernels_refused`] says why, and the ops use NCCL.
    ///
    /// The CTA budget is `options.blocks` or the smallest [`cta_budget`]`(sms, world,
    /// false)` over the devices.
    ///
    /// Errors: [`Error::InvalidArgument`] for a number of ordinals outside 2 ..= 8, an
    /// ordinal listed twice, or invalid `options`; NCCL's and CUDA's errors.
    pub fn single_process(ordinals: &[usize], options: GroupOptions) -> Result<Vec<TpGroup>> {
        symmetric::check_world("ordinals", ordinals.len())?;
        for (i, a) in ordinals.iter().enumerate() {
            if let Some(j) = ordinals[..i].iter().position(|b| b == a) {
                return Err(Error::invalid(
                    "ordinals",
                    format!(
                        "device {a} is listed for ranks {j} and {i}: one GPU per rank (use \
                         virtual ranks to put several ranks on one GPU)"
                    ),
                ));
            }
        }
        options.validate()?;
        require_driver()?;
        let world = ordinals.len();
        let comms = Comm::init_all(ordinals, CommOptions::default())?;
        let ctxs: Vec<Arc<CudaContext>> =
            comms.iter().map(|c| c.stream().context().clone()).collect();
        let mut budget = MAX_BLOCKS;
        for ctx in &ctxs {
            budget = budget.min(cta_budget(sm_count(ctx)?, world, false));
        }
        let blocks = options.blocks.unwrap_or(budget);
        let verdict = match topology::discover() {
            Discovery::Found(topo) => {
                let ordinals: Vec<u32> = ordinals.iter().map(|&o| o as u32).collect();
                Some(topology::assess(&topo, &ordinals))
            }
            Discovery::NoDriver | Discovery::Broken(_) => None,
        };
        let (workspaces, unavailable): (Vec<Option<SymmetricWorkspace>>, Option<String>) =
            match symmetric::peer_access_outcome(&ctxs, options.capacity_bytes)? {
                Ok(ws) => (ws.into_iter().map(Some).collect(), None),
                Err(reason) => ((0..world).map(|_| None).collect(), Some(reason)),
            };
        let poison = Arc::new(Poison::default());
        Ok(comms
            .into_iter()
            .zip(workspaces)
            .enumerate()
            .map(|(rank, (comm, workspace))| TpGroup {
                rank,
                world,
                mode: Mode::SingleProcess,
                stream: comm.stream().clone(),
                workspace,
                unavailable: unavailable.clone(),
                verdict: verdict.clone(),
                rule: AllReduceRule::default(),
                blocks,
                timeout: options.timeout,
                poison: poison.clone(),
                comm: Some(comm),
            })
            .collect())
    }

    /// One rank per process, over an NCCL communicator of 2 ..= 8 ranks: the group's rank,
    /// world and stream are the communicator's. A collective: every rank of `comm` must call
    /// it, with the same `options`.
    ///
    /// Over the communicator, the ranks exchange their options, SM counts, hosts and GPUs
    /// (and refuse to proceed if their options differ), agree on the CTA budget
    /// (`options.blocks`, or the smallest [`cta_budget`]`(sms, world, false)` of all
    /// ranks), take rank 0's topology verdict (GPUs named as rank 0's process numbers them),
    /// and map every rank's buffers into every other rank with CUDA IPC.
    ///
    /// Where CUDA IPC is not possible (ranks on several hosts, or a handle that cannot be
    /// exported or opened — the reason names the ranks), every rank still gets its group,
    /// without symmetric memory: [`TpGroup::capacity`] is 0,
    /// [`TpGroup::custom_kernels_refused`] says why, and the ops use NCCL.
    ///
    /// Errors: [`Error::InvalidArgument`] for a communicator of fewer than 2 or more than 8
    /// ranks, invalid `options`, or ranks whose options differ; the communicator's and
    /// CUDA's errors. A rank that fails alone (before the exchange) leaves its peers waiting
    /// up to the communicator's timeout.
    pub fn from_comm(comm: Comm, options: GroupOptions) -> Result<TpGroup> {
        symmetric::check_world("comm", comm.world())?;
        options.validate()?;
        require_driver()?;
        let (rank, world) = (comm.rank(), comm.world());
        let stream = comm.stream().clone();
        let ctx = stream.context().clone();
        let mine = RankRecord::local(&ctx, &options)?;
        let records = symmetric::exchange(&comm, &mine.encode())?
            .iter()
            .enumerate()
            .map(|(r, b)| RankRecord::decode(r, b))
            .collect::<Result<Vec<_>>>()?;
        let agreed = agree(&records)?;
        let verdict = agreed_verdict(&comm, &records, &agreed)?;
        // Every rank takes the same branch: the verdict is rank 0's, broadcast.
        let shared_gpu = verdict
            .as_ref()
            .and_then(|v| v.custom_all_reduce_refused.as_ref())
            .filter(|r| matches!(r, Refusal::DuplicateGpu { .. }));
        let (workspace, unavailable) = if let Some(hosts) = &agreed.several_hosts {
            (
                None,
                Some(format!(
                    "the ranks span several hosts ({hosts}); CUDA IPC needs every rank on one host"
                )),
            )
        } else if let Some(refusal) = shared_gpu {
            // Kernels of two processes cannot be resident on one GPU at once (without MPS):
            // the custom kernels would only time out.
            (None, Some(refusal.describe()))
        } else {
            match symmetric::ipc_outcome(&comm, options.capacity_bytes)? {
                IpcOutcome::Ready(ws) => (Some(ws), None),
                IpcOutcome::Unavailable(reason) => (None, Some(reason)),
            }
        };
        Ok(TpGroup {
            rank,
            world,
            mode: Mode::Ipc,
            stream,
            workspace,
            unavailable,
            verdict,
            rule: AllReduceRule::default(),
            blocks: agreed.blocks,
            timeout: options.timeout,
            poison: Arc::new(Poison::default()),
            comm: Some(comm),
        })
    }

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

    /// The arguments of a custom kernel launch: the peer table and this rank's group
    /// arguments. [`Error::GroupPoisoned`] once the group is poisoned;
    /// [`Error::InvalidArgument`] when the group has no symmetric memory.
    pub(crate) fn kernel_args(
        &self,
    ) -> Result<(kernels::tpfuse_peers, kernels::tpfuse_group_args)> {
        if let Some(reason) = self.poison.reason() {
            return Err(Error::GroupPoisoned(reason));
        }
        let ws = self.workspace.as_ref().ok_or_else(|| {
            Error::invalid(
                "group",
                format!(
                    "the custom kernels cannot run on this group: {}",
                    self.unavailable.as_deref().unwrap_or("no symmetric memory")
                ),
            )
        })?;
        let args = kernels::tpfuse_group_args {
            rank: self.rank as i32,
            world: self.world as i32,
            blocks: self.blocks as i32,
            capacity: ws.capacity() as u64,
            timeout_ns: u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX),
        };
        Ok((ws.table(), args))
    }

    /// Waits until everything enqueued on this rank's stream has finished (polling, bounded
    /// by twice the timeout plus one second, never an unbounded synchronize), then reads this
    /// rank's error word.
    ///
    /// - `Ok(())`: the stream drained and no kernel of this rank timed out.
    /// - [`Error::PeerTimeout`] (`rank` = this rank, `peer` = the rank that did not arrive,
    ///   `after` = the timeout): a kernel gave up on a peer; the group is now poisoned.
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
        if word == 0 {
            return Ok(());
        }
        if word & kernels::TPFUSE_ERROR_PEER_TIMEOUT != 0 {
            let peer = (word & 0xff) as usize;
            self.poison.set(format!(
                "rank {}: peer rank {peer} did not arrive within {:?}",
                self.rank, self.timeout
            ));
            return Err(Error::PeerTimeout {
                rank: self.rank,
                peer,
                after: self.timeout,
            });
        }
        let reason = format!(
            "rank {}: the kernels recorded error word {word:#x}",
            self.rank
        );
        self.poison.set(reason.clone());
        Err(Error::GroupPoisoned(reason))
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
            return;
        }
        let own = ws.release_imports();
        if self.mode == Mode::Ipc && !self.is_poisoned() {
            if let Some(comm) = &self.comm {
                // Every peer has closed its mapping of our buffers once it passes this.
                let _ = comm.barrier();
            }
        }
        drop(own);
    }
}

/// What one rank of an IPC group tells the others before the group is built.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RankRecord {
    sms: u32,
    /// The CUDA ordinal of the rank's device, as its own process numbers it.
    ordinal: u32,
    /// `options.blocks`, 0 for none.
    blocks: u32,
    capacity: u64,
    timeout_ns: u64,
    bus_id: String,
    boot_id: String,
    hostname: String,
}

const RANK_MAGIC: [u8; 4] = *b"TPG1";
const RANK_RECORD_BYTES: usize = 256;
const BUS_ID: std::ops::Range<usize> = 32..64;
const BOOT_ID: std::ops::Range<usize> = 64..128;
const HOSTNAME: std::ops::Range<usize> = 128..256;

fn put_str(buf: &mut [u8], range: std::ops::Range<usize>, s: &str) {
    let field = &mut buf[range];
    let n = s.len().min(field.len());
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

fn get_str(buf: &[u8], range: std::ops::Range<usize>) -> String {
    let field = &buf[range];
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

impl RankRecord {
    fn local(ctx: &CudaContext, options: &GroupOptions) -> Result<RankRecord> {
        let mut bus = [0 as c_char; 32];
        // SAFETY: writes at most 32 bytes, NUL-terminated, for a valid device.
        unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, ctx.cu_device()) }
            .result()
            .map_err(cuda("reading the PCI bus id"))?;
        let bus: Vec<u8> = bus.iter().map(|&c| c as u8).collect();
        let mut hostname = read_trimmed("/proc/sys/kernel/hostname");
        if hostname.is_empty() {
            hostname = std::env::var("HOSTNAME").unwrap_or_default();
        }
        Ok(RankRecord {
            sms: sm_count(ctx)? as u32,
            ordinal: ctx.ordinal() as u32,
            blocks: options.blocks.unwrap_or(0) as u32,
            capacity: options.capacity_bytes as u64,
            timeout_ns: options.timeout_ns(),
            bus_id: get_str(&bus, 0..bus.len()),
            boot_id: read_trimmed("/proc/sys/kernel/random/boot_id"),
            hostname,
        })
    }

    fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; RANK_RECORD_BYTES];
        b[0..4].copy_from_slice(&RANK_MAGIC);
        b[4..8].copy_from_slice(&self.sms.to_le_bytes());
        b[8..12].copy_from_slice(&self.blocks.to_le_bytes());
        b[12..16].copy_from_slice(&self.ordinal.to_le_bytes());
        b[16..24].copy_from_slice(&self.capacity.to_le_bytes());
        b[24..32].copy_from_slice(&self.timeout_ns.to_le_bytes());
        put_str(&mut b, BUS_ID, &self.bus_id);
        put_str(&mut b, BOOT_ID, &self.boot_id);
        put_str(&mut b, HOSTNAME, &self.hostname);
        b
    }

    fn decode(rank: usize, b: &[u8]) -> Result<RankRecord> {
        if b.len() != RANK_RECORD_BYTES || b[0..4] != RANK_MAGIC {
            return Err(Error::Rendezvous {
                peer: format!("rank {rank}"),
                reason: "sent something that is not a tpfuse group record".to_string(),
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(v)
        };
        Ok(RankRecord {
            sms: u32_at(4),
            blocks: u32_at(8),
            ordinal: u32_at(12),
            capacity: u64_at(16),
            timeout_ns: u64_at(24),
            bus_id: get_str(b, BUS_ID),
            boot_id: get_str(b, BOOT_ID),
            hostname: get_str(b, HOSTNAME),
        })
    }

    /// Whether this rank runs on the same host (same kernel boot) as `other`.
    fn same_host(&self, other: &RankRecord) -> bool {
        if !self.boot_id.is_empty() && !other.boot_id.is_empty() {
            self.boot_id == other.boot_id
        } else {
            self.hostname == other.hostname
        }
    }
}

/// What the ranks of an IPC group agree on, computed identically on every rank.
#[derive(Debug, PartialEq, Eq)]
struct Agreement {
    blocks: usize,
    /// `Some(hosts)` when the ranks are not all on rank 0's host.
    several_hosts: Option<String>,
}

fn agree(records: &[RankRecord]) -> Result<Agreement> {
    let first = &records[0];
    for (r, rec) in records.iter().enumerate().skip(1) {
        let mismatch = |field: &str, a: String, b: String| {
            Error::invalid(
                format!("options.{field}"),
                format!("rank 0 passed {a}, rank {r} {b}: every rank must pass the same options"),
            )
        };
        if rec.capacity != first.capacity {
            return Err(mismatch(
                "capacity_bytes",
                first.capacity.to_string(),
                rec.capacity.to_string(),
            ));
        }
        if rec.timeout_ns != first.timeout_ns {
            return Err(mismatch(
                "timeout",
                format!("{:?}", Duration::from_nanos(first.timeout_ns)),
                format!("{:?}", Duration::from_nanos(rec.timeout_ns)),
            ));
        }
        if rec.blocks != first.blocks {
            let show = |b: u32| {
                if b == 0 {
                    "None".to_string()
                } else {
                    format!("Some({b})")
                }
            };
            return Err(mismatch("blocks", show(first.blocks), show(rec.blocks)));
        }
    }
    let world = records.len();
    let blocks = if first.blocks > 0 {
        first.blocks as usize
    } else {
        records
            .iter()
            .map(|r| cta_budget(r.sms as usize, world, false))
            .min()
            .unwrap_or(1)
    };
    let several_hosts = records
        .iter()
        .any(|r| !r.same_host(first))
        .then(|| host_list(records));
    Ok(Agreement {
        blocks,
        several_hosts,
    })
}

/// The ranks' hosts in rank order, deduplicated; two machines with one host name are told
/// apart by their boot ids.
fn host_list(records: &[RankRecord]) -> String {
    let mut hosts: Vec<String> = Vec::new();
    for r in records {
        let twin = records
            .iter()
            .any(|o| o.hostname == r.hostname && !o.same_host(r));
        let name = if twin {
            let boot: String = r.boot_id.chars().take(8).collect();
            format!("{} (boot {boot})", r.hostname)
        } else {
            r.hostname.clone()
        };
        if !hosts.contains(&name) {
            hosts.push(name);
        }
    }
    hosts.join(", ")
}

/// Rank 0's verdict for the group described by `records`, from its own NVML view.
fn verdict_of(topo: &Topology, records: &[RankRecord], agreed: &Agreement) -> Option<Verdict> {
    let first = &records[0];
    if agreed.several_hosts.is_some() {
        let places: Vec<RankPlace> = records
            .iter()
            .map(|r| RankPlace {
                host: if r.same_host(first) {
                    topo.hostname.clone()
                } else if r.hostname == topo.hostname {
                    format!("{} (another machine)", r.hostname)
                } else {
                    r.hostname.clone()
                },
                ordinal: r.ordinal,
            })
            .collect();
        return Some(topology::assess_places(topo, &places));
    }
    let mut gpus = Vec::with_capacity(records.len());
    for r in records {
        gpus.push(
            topo.gpus
                .iter()
                .find(|g| topology::same_bus_id(&g.pci_bus_id, &r.bus_id))?,
        );
    }
    let ordinals: Option<Vec<u32>> = gpus.iter().map(|g| g.cuda_ordinal).collect();
    if let Some(ordinals) = ordinals {
        return Some(topology::assess(topo, &ordinals));
    }
    // Rank 0's process does not see every GPU of the group: name them by NVML index.
    let mut by_index = topo.clone();
    for g in &mut by_index.gpus {
        g.cuda_ordinal = Some(g.nvml_index);
    }
    let indices: Vec<u32> = gpus.iter().map(|g| g.nvml_index).collect();
    Some(topology::assess(&by_index, &indices))
}

/// Rank 0 computes the verdict and broadcasts it (as JSON) so that every rank holds the
/// same one and chooses the same algorithm for every message.
fn agreed_verdict(
    comm: &Comm,
    records: &[RankRecord],
    agreed: &Agreement,
) -> Result<Option<Verdict>> {
    const BYTES: usize = 16 << 10;
    let mut host = vec![0u8; BYTES];
    if comm.rank() == 0 {
        let verdict = match topology::discover() {
            Discovery::Found(topo) => verdict_of(&topo, records, agreed),
            Discovery::NoDriver | Discovery::Broken(_) => None,
        };
        let mut json = serde_json::to_vec(&verdict).unwrap_or_else(|_| b"null".to_vec());
        if json.len() > BYTES - 4 {
            json = b"null".to_vec();
        }
        host[0..4].copy_from_slice(&(json.len() as u32).to_le_bytes());
        host[4..4 + json.len()].copy_from_slice(&json);
    }
    let stream = comm.stream();
    let mut buf = stream
        .clone_htod(&host)
        .map_err(cuda("uploading the verdict"))?;
    comm.broadcast(&mut buf, 0)?;
    comm.synchronize()?;
    let got = stream
        .clone_dtoh(&buf)
        .map_err(cuda("downloading the verdict"))?;
    stream
        .synchronize()
        .map_err(cuda("waiting for the verdict"))?;
    let len = u32::from_le_bytes([got[0], got[1], got[2], got[3]]) as usize;
    if len > BYTES - 4 {
        return Err(Error::Rendezvous {
            peer: "rank 0".to_string(),
            reason: format!("sent a verdict of {len} bytes"),
        });
    }
    Ok(serde_json::from_slice::<Option<Verdict>>(&got[4..4 + len]).unwrap_or(None))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(host: &str, boot: &str) -> RankRecord {
        RankRecord {
            sms: 132,
            ordinal: 3,
            blocks: 0,
            capacity: 8 << 20,
            timeout_ns: 10_000_000_000,
            bus_id: "00000000:18:00.0".to_string(),
            boot_id: boot.to_string(),
            hostname: host.to_string(),
        }
    }

    #[test]
    fn rank_records_round_trip() {
        let mut r = record("node-1", "0b1f7c1e-8f7e-4c55-9a3a-1f2e3d4c5b6a");
        r.blocks = 17;
        let b = r.encode();
        assert_eq!(b.len(), RANK_RECORD_BYTES);
        assert_eq!(RankRecord::decode(0, &b).unwrap(), r);
        let long = "h".repeat(300);
        let r2 = record(&long, "");
        let back = RankRecord::decode(1, &r2.encode()).unwrap();
        assert_eq!(back.hostname.len(), HOSTNAME.len());
        let mut bad = b.clone();
        bad[0] = b'X';
        let e = RankRecord::decode(5, &bad).unwrap_err().to_string();
        assert!(e.contains("rank 5"), "{e}");
    }

    #[test]
    fn ranks_agree_on_blocks_and_hosts() {
        let mut records = vec![record("a", "boot"), record("a", "boot")];
        records[1].sms = 78;
        let agreed = agree(&records).unwrap();
        assert_eq!(agreed.blocks, 39);
        assert_eq!(agreed.several_hosts, None);

        records[0].blocks = 8;
        records[1].blocks = 8;
        assert_eq!(agree(&records).unwrap().blocks, 8);

        // Same hostname, other boot: another machine.
        records[1].boot_id = "other".to_string();
        assert_eq!(
            agree(&records).unwrap().several_hosts.as_deref(),
            Some("a (boot boot), a (boot other)")
        );
        // No boot ids: hostnames decide.
        records[0].boot_id.clear();
        records[1].boot_id.clear();
        assert!(agree(&records).unwrap().several_hosts.is_none());
        records[1].hostname = "b".to_string();
        assert_eq!(
            agree(&records).unwrap().several_hosts.as_deref(),
            Some("a, b")
        );
    }

    #[test]
    fn ranks_with_different_options_are_refused() {
        let base = vec![record("a", "x"), record("a", "x"), record("a", "x")];
        let mut r = base.clone();
        r[2].capacity = 1 << 20;
        let e = agree(&r).unwrap_err().to_string();
        assert!(
            e.contains("options.capacity_bytes") && e.contains("rank 2"),
            "{e}"
        );
        let mut r = base.clone();
        r[1].timeout_ns = 1;
        let e = agree(&r).unwrap_err().to_string();
        assert!(e.contains("options.timeout"), "{e}");
        let mut r = base;
        r[1].blocks = 4;
        let e = agree(&r).unwrap_err().to_string();
        assert!(e.contains("options.blocks") && e.contains("Some(4)"), "{e}");
    }

    fn fixture(name: &str) -> Topology {
        let path = format!(
            "{}/tests/fixtures/topology/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        Topology::from_json(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn on_gpus(topo: &Topology, nvml: &[u32]) -> Vec<RankRecord> {
        nvml.iter()
            .map(|&i| RankRecord {
                bus_id: topo.gpu(i).unwrap().pci_bus_id.clone(),
                ..record(&topo.hostname, "boot")
            })
            .collect()
    }

    #[test]
    fn rank_0_names_the_gpus_by_bus_id() {
        let topo = fixture("h100_sxm_8x_nvswitch");
        let records = on_gpus(&topo, &[5, 2]);
        let agreed = agree(&records).unwrap();
        let v = verdict_of(&topo, &records, &agreed).unwrap();
        let want: Vec<u32> = [5, 2]
            .iter()
            .map(|&i| topo.gpu(i).unwrap().cuda_ordinal.unwrap())
            .collect();
        assert_eq!(v.ordinals, want);
        assert!(v.custom_all_reduce(), "{}", v.describe());

        // Rank 0 does not see every GPU: NVML indices, same policy.
        let mut hidden = topo.clone();
        hidden.gpus[2].cuda_ordinal = None;
        let v = verdict_of(&hidden, &records, &agreed).unwrap();
        assert_eq!(v.ordinals, vec![5, 2]);
        assert!(v.custom_all_reduce(), "{}", v.describe());

        // A bus id NVML does not show: no verdict.
        let mut stranger = records.clone();
        stranger[1].bus_id = "0000:ff:00.0".to_string();
        assert_eq!(verdict_of(&topo, &stranger, &agreed), None);
    }

    #[test]
    fn rank_0_refuses_what_the_policy_refuses() {
        let topo = fixture("rtx4090_2x_no_p2p");
        let records = on_gpus(&topo, &[0, 1]);
        let v = verdict_of(&topo, &records, &agree(&records).unwrap()).unwrap();
        assert!(!v.custom_all_reduce(), "{}", v.describe());

        let topo = fixture("h100_sxm_8x_nvswitch");
        let mut records = on_gpus(&topo, &[0, 1]);
        records[1].boot_id = "elsewhere".to_string();
        records[1].hostname = "node-b".to_string();
        let agreed = agree(&records).unwrap();
        assert!(agreed.several_hosts.is_some());
        let v = verdict_of(&topo, &records, &agreed).unwrap();
        assert!(
            v.describe().contains("hosts") && !v.single_host,
            "{}",
            v.describe()
        );
    }

    #[test]
    fn the_wait_bound_covers_the_kernel_deadline() {
        assert_eq!(wait_bound(Duration::from_secs(10)), Duration::from_secs(21));
        assert_eq!(wait_bound(Duration::MAX), Duration::MAX);
    }

    #[test]
    fn poison_keeps_the_first_reason() {
        let p = Poison::default();
        assert_eq!(p.reason(), None);
        p.set("first".to_string());
        p.set("second".to_string());
        assert_eq!(p.reason().as_deref(), Some("first"));
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
