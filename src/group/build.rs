//! Building a [`TpGroup`]: virtual ranks, one process with several GPUs, or one rank per process
//! over a communicator; on new streams or the engine's.

use super::agreement::{agree, agreed_verdict, RankRecord};
use super::failure::{HostErrorWord, Poison};
use super::{cta_budget, GroupOptions, Mode, TpGroup, MAX_BLOCKS};
use crate::comm::{Comm, CommOptions};
use crate::device::{check_rank_stream, cuda, load_kernels, require_driver};
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::ops::gemm::GemmConfig;
use crate::symmetric::{self, IpcOutcome, SymmetricWorkspace};
use crate::topology::{self, AllReduceRule, Discovery, Refusal};
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
use std::sync::Arc;

/// What the fused GEMM kernels' planning needs of a rank's device, read once when the group
/// is built (no driver query on an op's path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceFacts {
    /// (major, minor).
    pub(crate) compute_capability: (u32, u32),
    pub(crate) sms: usize,
    /// Blocks of the fused GEMM + all-reduce kernel one SM holds at once, per tile
    /// configuration (in the order of `GemmConfig::ALL`).
    pub(crate) fused_blocks_per_sm: [usize; 5],
    /// The same for the fused all-gather + GEMM kernel (1 unless the options ask for more).
    pub(crate) gather_blocks_per_sm: [usize; 5],
}

fn device_facts(ctx: &CudaContext, options: &GroupOptions) -> Result<DeviceFacts> {
    let attr = |a| {
        ctx.attribute(a)
            .map(|v| v.max(0) as u32)
            .map_err(cuda("reading the compute capability"))
    };
    use sys::CUdevice_attribute::*;
    Ok(DeviceFacts {
        compute_capability: (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        sms: sm_count(ctx)?,
        fused_blocks_per_sm: fused_blocks_per_sm(
            ctx,
            kernels::tpfuse_gemm_all_reduce_blocks_per_sm,
        )?
        .map(|b| b.min(options.fused_blocks_per_sm.unwrap_or(usize::MAX))),
        // One block an SM unless the options ask for more (GroupOptions::fused_blocks_per_sm).
        gather_blocks_per_sm: match options.fused_blocks_per_sm {
            None => [1; 5],
            Some(most) => fused_blocks_per_sm(ctx, kernels::tpfuse_all_gather_gemm_blocks_per_sm)?
                .map(|b| b.min(most)),
        },
    })
}

/// A fused kernel's occupancy `query` for each configuration, the fewer of the f16 and bf16
/// kernels' ([`DeviceFacts::fused_blocks_per_sm`] and `gather_blocks_per_sm` before
/// `options.fused_blocks_per_sm`); 1 where the device runs no such kernel (a compute
/// capability below 8.0: the fused path refuses it by name anyway).
fn fused_blocks_per_sm(
    ctx: &CudaContext,
    query: unsafe extern "C" fn(kernels::tpfuse_dtype, i32, *mut i32) -> i32,
) -> Result<[usize; 5]> {
    ctx.bind_to_thread().map_err(cuda("binding the context"))?;
    let mut out = [1; 5];
    for (slot, config) in out.iter_mut().zip(GemmConfig::ALL) {
        let mut fewest = i32::MAX;
        for dtype in [kernels::TPFUSE_DTYPE_F16, kernels::TPFUSE_DTYPE_BF16]
            .map(|d| d as kernels::tpfuse_dtype)
        {
            let mut blocks = 0i32;
            // SAFETY: `blocks` is a valid out-pointer; the context is current on this thread.
            let code = unsafe { query(dtype, config.abi(), &mut blocks) };
            fewest = if code == 0 { fewest.min(blocks) } else { 1 };
        }
        *slot = usize::try_from(fewest).unwrap_or(1).max(1);
    }
    Ok(out)
}

/// The layers' GEMM scratch ([`super::SPLIT_SCRATCH_BYTES`], zeroed: the split's counts
/// start at 0) on the group's stream.
fn split_scratch(stream: &Arc<CudaStream>) -> Result<std::sync::Mutex<Option<CudaSlice<u8>>>> {
    let scratch = stream
        .alloc_zeros::<u8>(super::SPLIT_SCRATCH_BYTES)
        .map_err(cuda("allocating the GEMM's split scratch"))?;
    Ok(std::sync::Mutex::new(Some(scratch)))
}

pub(crate) fn sm_count(ctx: &CudaContext) -> Result<usize> {
    let sms = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(cuda("reading the SM count"))?;
    Ok(sms.max(1) as usize)
}

/// The peak SM clock of `ctx`'s device in kHz; 4 GHz (above any GPU's) when the driver does
/// not say, so the backstop never ends a wait early.
fn peak_clock_khz(ctx: &CudaContext) -> u64 {
    match ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE) {
        Ok(khz) if khz > 0 => khz as u64,
        _ => 4_000_000,
    }
}

/// The %clock64 backstop of a kernel deadline of `timeout_ns` (tpfuse.h): four times the
/// timeout at the peak clock, so at any real clock it ends a wait no earlier than 4 x the
/// timeout, and still ends it when %globaltimer stalls.
pub(super) fn backstop_cycles(timeout_ns: u64, clock_khz: u64) -> u64 {
    let cycles = u128::from(timeout_ns) * u128::from(clock_khz) * 4 / 1_000_000;
    u64::try_from(cycles).unwrap_or(u64::MAX)
}

/// The host-mapped error word of a rank that has symmetric memory.
fn host_error_word(
    ctx: &Arc<CudaContext>,
    workspace: Option<&SymmetricWorkspace>,
) -> Result<Option<HostErrorWord>> {
    workspace.map(|_| HostErrorWord::new(ctx)).transpose()
}

/// Errors unless every rank has its own device.
fn check_one_gpu_per_rank(arg: &str, ordinals: &[usize]) -> Result<()> {
    for (i, a) in ordinals.iter().enumerate() {
        if let Some(j) = ordinals[..i].iter().position(|b| b == a) {
            return Err(Error::invalid(
                arg,
                format!(
                    "device {a} is listed for ranks {j} and {i}: one GPU per rank (use \
                     virtual ranks to put several ranks on one GPU)"
                ),
            ));
        }
    }
    Ok(())
}

/// Errors unless the streams are distinct streams the engine created (ranks sharing a stream
/// would run one after the other, and wait for each other until the deadline; see
/// [`check_rank_stream`] for CUDA's special handles).
fn check_distinct_streams(streams: &[Arc<CudaStream>]) -> Result<()> {
    for (i, a) in streams.iter().enumerate() {
        check_rank_stream("streams", a)?;
        if let Some(j) = streams[..i]
            .iter()
            .position(|b| b.cu_stream() == a.cu_stream())
        {
            return Err(Error::invalid(
                "streams",
                format!("ranks {j} and {i} are given the same stream: one stream per rank"),
            ));
        }
    }
    Ok(())
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
        let streams = (0..world)
            .map(|_| {
                ctx.new_stream()
                    .map_err(cuda("creating a virtual rank's stream"))
            })
            .collect::<Result<Vec<_>>>()?;
        Self::virtual_ranks_on(&streams, options)
    }

    /// As [`TpGroup::virtual_ranks`], on the engine's streams: rank `r` enqueues every op on
    /// `streams[r]`. The streams are distinct streams of one device (ranks on one stream
    /// would wait for each other until the deadline), and the world is their number.
    ///
    /// Errors: as [`TpGroup::virtual_ranks`]; [`Error::InvalidArgument`] (`streams`) for
    /// streams of several devices, or a stream given twice.
    pub fn virtual_ranks_on(
        streams: &[Arc<CudaStream>],
        options: GroupOptions,
    ) -> Result<Vec<TpGroup>> {
        let world = streams.len();
        symmetric::check_world("streams", world)?;
        check_distinct_streams(streams)?;
        options.validate()?;
        require_driver()?;
        let ctx = streams[0].context().clone();
        if let Some(other) = streams
            .iter()
            .find(|s| s.context().ordinal() != ctx.ordinal())
        {
            return Err(Error::invalid(
                "streams",
                format!(
                    "virtual ranks share one device: streams of devices {} and {}",
                    ctx.ordinal(),
                    other.context().ordinal()
                ),
            ));
        }
        let ctx = &ctx;
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
        // Before any rank's kernel can run: a first use between two ranks' launches could
        // wait for the earlier rank's kernel (device::load_kernels).
        load_kernels(ctx)?;
        let workspaces = symmetric::virtual_ranks(ctx, world, options.capacity_bytes)?;
        let poison = Arc::new(Poison::default());
        let facts = device_facts(ctx, &options)?; // one device for every rank
        let mut groups = Vec::with_capacity(world);
        for (rank, (ws, stream)) in workspaces.into_iter().zip(streams).enumerate() {
            let stream = stream.clone();
            #[cfg(feature = "emulator")]
            crate::emulator::counters::tag_stream(&stream, rank);
            groups.push(TpGroup {
                rank,
                world,
                mode: Mode::Virtual,
                split_scratch: split_scratch(&stream)?,
                stream,
                host_error: Some(HostErrorWord::new(ctx)?),
                workspace: Some(ws),
                unavailable: None,
                verdict: None,
                rule: AllReduceRule::default(),
                blocks,
                fused_blocks: (sms / world).max(1),
                group_sms: (sms, sms),
                timeout: options.timeout,
                packet_bytes: options.packet_bytes(),
                all_reduce_packet_bytes: options.all_reduce_packet_bytes(),
                poison: poison.clone(),
                clock_khz: peak_clock_khz(ctx),
                device_facts: facts,
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
    /// ordinal listed twice, invalid `options`, or `options.blocks` above a device's SM count
    /// (every block of a custom kernel must be resident at once); NCCL's and CUDA's errors.
    pub fn single_process(ordinals: &[usize], options: GroupOptions) -> Result<Vec<TpGroup>> {
        symmetric::check_world("ordinals", ordinals.len())?;
        check_one_gpu_per_rank("ordinals", ordinals)?;
        options.validate()?;
        require_driver()?;
        let streams = ordinals
            .iter()
            .map(|&o| {
                crate::device::open(o)?
                    .new_stream()
                    .map_err(cuda("creating a rank's stream"))
            })
            .collect::<Result<Vec<_>>>()?;
        Self::single_process_on(&streams, options)
    }

    /// As [`TpGroup::single_process`], on the engine's streams: rank `i` on `streams[i]`'s
    /// device, every op of it (and its NCCL communicator's collectives) enqueued on
    /// `streams[i]`. One stream per device.
    ///
    /// Errors: as [`TpGroup::single_process`], for `streams`.
    pub fn single_process_on(
        streams: &[Arc<CudaStream>],
        options: GroupOptions,
    ) -> Result<Vec<TpGroup>> {
        symmetric::check_world("streams", streams.len())?;
        check_distinct_streams(streams)?;
        let ordinals: Vec<usize> = streams.iter().map(|s| s.context().ordinal()).collect();
        check_one_gpu_per_rank("streams", &ordinals)?;
        options.validate()?;
        require_driver()?;
        let ordinals = &ordinals[..];
        let world = ordinals.len();
        let comms = Comm::init_all_on(streams, CommOptions::default())?;
        let ctxs: Vec<Arc<CudaContext>> =
            comms.iter().map(|c| c.stream().context().clone()).collect();
        let mut budget = MAX_BLOCKS;
        let (mut fewest_sms, mut most_sms) = (usize::MAX, 0);
        for ctx in &ctxs {
            load_kernels(ctx)?; // see virtual_ranks_on
            let sms = sm_count(ctx)?;
            fewest_sms = fewest_sms.min(sms);
            most_sms = most_sms.max(sms);
            budget = budget.min(cta_budget(sms, world, false));
        }
        let blocks = options.blocks.unwrap_or(budget);
        if blocks > fewest_sms {
            return Err(Error::invalid(
                "options.blocks",
                format!(
                    "{blocks} blocks, but a device of the group has {fewest_sms} SMs: every \
                     block of a custom kernel must be resident at once (one block per SM)"
                ),
            ));
        }
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
        comms
            .into_iter()
            .zip(workspaces)
            .enumerate()
            .map(|(rank, (comm, workspace))| {
                let ctx = comm.stream().context().clone();
                Ok(TpGroup {
                    rank,
                    world,
                    mode: Mode::SingleProcess,
                    split_scratch: split_scratch(comm.stream())?,
                    stream: comm.stream().clone(),
                    host_error: host_error_word(&ctx, workspace.as_ref())?,
                    workspace,
                    unavailable: unavailable.clone(),
                    verdict: verdict.clone(),
                    rule: AllReduceRule::default(),
                    blocks,
                    fused_blocks: fewest_sms,
                    group_sms: (fewest_sms, most_sms),
                    timeout: options.timeout,
                    packet_bytes: options.packet_bytes(),
                    all_reduce_packet_bytes: options.all_reduce_packet_bytes(),
                    poison: poison.clone(),
                    clock_khz: peak_clock_khz(&ctx),
                    device_facts: device_facts(&ctx, &options)?,
                    comm: Some(comm),
                })
            })
            .collect()
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
    /// ranks, invalid `options`, ranks whose options differ, or `options.blocks` above a
    /// rank's SM count; the communicator's and
    /// CUDA's errors. A rank that fails alone (before the exchange) leaves its peers waiting
    /// up to the communicator's timeout.
    pub fn from_comm(comm: Comm, options: GroupOptions) -> Result<TpGroup> {
        symmetric::check_world("comm", comm.world())?;
        options.validate()?;
        require_driver()?;
        let (rank, world) = (comm.rank(), comm.world());
        let stream = comm.stream().clone();
        let ctx = stream.context().clone();
        load_kernels(&ctx)?; // see virtual_ranks_on
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
            split_scratch: split_scratch(&stream)?,
            stream,
            host_error: host_error_word(&ctx, workspace.as_ref())?,
            clock_khz: peak_clock_khz(&ctx),
            device_facts: device_facts(&ctx, &options)?,
            workspace,
            unavailable,
            verdict,
            rule: AllReduceRule::default(),
            blocks: agreed.blocks,
            fused_blocks: agreed.fewest_sms,
            group_sms: (agreed.fewest_sms, agreed.most_sms),
            timeout: options.timeout,
            packet_bytes: options.packet_bytes(),
            all_reduce_packet_bytes: options.all_reduce_packet_bytes(),
            poison: Arc::new(Poison::default()),
            comm: Some(comm),
        })
    }
}
