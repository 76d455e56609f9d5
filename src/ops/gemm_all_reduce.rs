//! The row-parallel layer's GEMM, all-reduce and epilogue as one kernel launch per rank
//! ([`gemm_all_reduce`]), and GEMM + reduce-scatter for sequence parallelism
//! ([`gemm_reduce_scatter`]), from `cuda/gemm_all_reduce.cu`; design and numbers in
//! `docs/fused-gemm.md`.
//!
//! `out = epilogue(Σ_r x_r · W_rᵀ)` on every rank of a [`TpGroup`], where rank `r` passes its
//! `x_r` `[m, k]` and `W_r` `[n, k]`: each rank's partial product is rounded to `T` (as
//! [`gemm`](crate::ops::gemm()) rounds it), the partials are added in rank order `0..W` in f32
//! and rounded once, then the [`Epilogue`] runs (bias added once, residual added and written
//! back, RMSNorm over rows of `n`). The bits are those of [`gemm`](crate::ops::gemm()) into a
//! workspace followed by [`all_reduce_fused`](crate::ops::all_reduce_fused) with the same
//! epilogue (either custom algorithm), on every rank; the tests check exactly that.
//!
//! The ranks' tiles meet through the group's symmetric memory: a tile's reduction starts as
//! soon as every rank has computed it, while the GEMM goes on with the next tiles. The
//! same deadlines and failure semantics as the custom all-reduce: a missing rank is
//! [`crate::Error::PeerTimeout`] on every survivor, a failed launch marks
//! `out` and the residual failed ([`Element::failed_output`](crate::dtype::Element::failed_output)),
//! and the call is CUDA-graph capturable.

use crate::device::bind;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::group::TpGroup;
use crate::ops::all_reduce::{Algorithm, Epilogue};
use crate::ops::gemm::{
    check_gemm, check_gemm_shapes, select_config, split_parts, GemmBuffers, GemmConfig,
    GemmElement, GemmShape, SPLIT_PARALLEL_M_MAX,
};
use crate::topology::{AllReduceAlgo, FusedKernel};
use crate::validate::{check_disjoint, owner, BufferInfo};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// The most output tiles one fused launch takes (`TPFUSE_MAX_FUSED_TILES`).
pub const MAX_TILES: usize = kernels::TPFUSE_MAX_FUSED_TILES as usize;

/// The buffers of one fused call, as the checks see them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FusedBuffers {
    /// `x` `[m, k]`, the weight `[n, k]`, the bias `[n]`, the residual `[m, n]` and `out`
    /// `[m, n]` (as `a`, `b`, `bias`, `residual`, `c`).
    pub gemm: GemmBuffers,
    /// RMSNorm weights `[n]`.
    pub gamma: Option<BufferInfo>,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// What the group offers a fused launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedFacts {
    /// The group's device.
    pub device: usize,
    /// Ranks.
    pub world: usize,
    /// The group's symmetric capacity per rank, in bytes (a fused launch exchanges its
    /// partials in half of the result area: `m · n · size_of::<T>()` at most `capacity / 2`).
    pub capacity: usize,
    /// The device's compute capability and SM count (the tile configuration's choice).
    pub compute_capability: (u32, u32),
    /// SMs of the device.
    pub sms: usize,
    /// The SMs the persistent grid may use ([`TpGroup::fused_blocks`]).
    pub blocks: usize,
    /// The smallest and the largest SM count of the group's GPUs: where they differ, the
    /// fused kernels refuse ([`mixed_gpus`]).
    pub group_sms: (usize, usize),
    /// Blocks of the GEMM + all-reduce kernel one SM holds at once, per tile configuration
    /// (in the order of [`GemmConfig::ALL`]; the occupancy API when the group was built).
    pub blocks_per_sm: [usize; 5],
    /// The same for the all-gather + GEMM kernel (1 unless the group's options ask for more:
    /// [`GroupOptions::fused_blocks_per_sm`](crate::group::GroupOptions::fused_blocks_per_sm)).
    pub gather_blocks_per_sm: [usize; 5],
    /// The group's all-reduce rule's bound for one-shot, in bytes per rank (`None`: the
    /// custom all-reduce may not run): under [`Algorithm::Auto`] the fused GEMM + all-reduce
    /// reduces in two shots from there.
    pub one_shot_below: Option<usize>,
    /// Bytes of each half of the packet area the group offers the one-shot GEMM + all-reduce
    /// ([`GroupOptions::fused_packets`](crate::group::GroupOptions::fused_packets): 0 or
    /// [`PACKET_HALF_BYTES`](crate::group::PACKET_HALF_BYTES)).
    pub packet_bytes: usize,
}

/// What a fused launch will run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FusedPlan {
    /// The GEMM tile configuration (the same choice as [`gemm`](crate::ops::gemm())).
    pub config: GemmConfig,
    /// Output tiles.
    pub tiles: usize,
    /// Blocks of the persistent grid: `min(units, blocks x blocks_per_sm)` (GEMM + all-reduce
    /// and GEMM + reduce-scatter; all-gather + GEMM: `gather_blocks_per_sm`), its units the
    /// tiles, or the parts of the tiles when [`parts_in_parallel`](Self::parts_in_parallel).
    pub grid: usize,
    /// The split of `k` ([`split_parts`] on the group's device: the GEMM's, so the same bits).
    pub parts: usize,
    /// `parts` > 1 on a configuration that splits in parallel (64 columns), `m` ≤
    /// [`SPLIT_PARALLEL_M_MAX`], at most [`MAX_TILES`] tiles and the parts' f32 partials
    /// (`parts · m · n · 4` bytes) within the group's capacity: each part of each tile is a
    /// unit of the grid, its partial in the rank's staging half, folded in order as
    /// [`gemm_with_scratch`](crate::ops::gemm::gemm_with_scratch) folds them (every fused
    /// kernel: a narrow layer's weight then streams on `tiles · parts` blocks). Otherwise
    /// each tile's block runs its parts one after another.
    pub parts_in_parallel: bool,
    /// GEMM + all-reduce: how it reduced, [`AllReduceAlgo::OneShot`] (every rank reduces
    /// every tile) or [`AllReduceAlgo::TwoShot`] (each rank its slice of rows, then every rank
    /// gathers the slices); `None` for the other fused ops.
    pub all_reduce: Option<AllReduceAlgo>,
    /// One-shot GEMM + all-reduce where every rank's partial fits half the group's packet
    /// area (`world · m · n · 4` bytes ≤ [`FusedFacts::packet_bytes`]): each rank stores its
    /// partial tiles as packets (2 elements and a tag in 8 bytes) into every rank's memory, and
    /// the reduction waits in its own loads (one crossing of the link, no flag), the same
    /// bits. Otherwise the tiles meet by flags.
    pub packets: bool,
}

impl FusedPlan {
    /// This plan reducing by `algo`: [`FusedPlan::all_reduce`], and [`FusedPlan::packets`]
    /// as `cuda/gemm_all_reduce.cu` decides it (launch_config).
    pub(crate) fn reducing(
        self,
        algo: AllReduceAlgo,
        shape: GemmShape,
        facts: &FusedFacts,
    ) -> FusedPlan {
        let packet_bytes = facts
            .world
            .saturating_mul(shape.m)
            .saturating_mul(shape.n)
            .saturating_mul(4);
        FusedPlan {
            all_reduce: Some(algo),
            packets: algo == AllReduceAlgo::OneShot
                && facts.packet_bytes != 0
                && packet_bytes <= facts.packet_bytes,
            ..self
        }
    }
}

/// Why the fused kernels cannot run on a group whose GPUs have different SM counts, or `None`:
/// each rank runs the tile configuration and the split of k that its own SM count gives
/// (those of its unfused GEMM: the same bits), and every rank of a fused launch must run the
/// same (its descriptor says which; ranks that differ would meet a mismatch, and the group
/// would be poisoned). The layers fall back to the unfused path.
pub fn mixed_gpus(facts: &FusedFacts) -> Option<String> {
    let (fewest, most) = facts.group_sms;
    (fewest != most).then(|| {
        format!(
            "the group's GPUs have {fewest} to {most} SMs: the fused kernels need the same \
             tiles and split of k on every rank, which each rank chooses from its own SM count"
        )
    })
}

/// Why a shape cannot take the fused path on a group, or `None` when it can: a message
/// larger than half the symmetric capacity, more than [`MAX_TILES`] tiles, a world of one,
/// GPUs of different SM counts ([`mixed_gpus`]), or a device without a GEMM path. The layers
/// fall back to the unfused path on these.
pub fn unfusable<T>(shape: GemmShape, facts: &FusedFacts) -> Option<String> {
    if facts.world < 2 {
        return Some("the fused path needs a group of 2 or more ranks".into());
    }
    if let Some(reason) = mixed_gpus(facts) {
        return Some(reason);
    }
    let bytes = shape
        .m
        .saturating_mul(shape.n)
        .saturating_mul(std::mem::size_of::<T>());
    if bytes > facts.capacity / 2 {
        return Some(format!(
            "m x n = {} x {} elements ({bytes} bytes) exceed half the group's symmetric \
             capacity ({} of {} bytes), where the fused kernel exchanges its partials",
            shape.m,
            shape.n,
            facts.capacity / 2,
            facts.capacity
        ));
    }
    let config = match fused_config(shape, facts) {
        Ok(config) => config,
        Err(reason) => return Some(reason),
    };
    let tiles = tiles_of(config, shape);
    if tiles > MAX_TILES {
        return Some(format!(
            "{tiles} tiles of {} exceed the {MAX_TILES} one fused launch takes",
            config.name()
        ));
    }
    None
}

/// The GEMM's tile configuration for `shape` on the group's device (the fused kernels run
/// the GEMM's tiles), or why the device has none.
pub(crate) fn fused_config(
    shape: GemmShape,
    facts: &FusedFacts,
) -> std::result::Result<GemmConfig, String> {
    select_config(shape, facts.compute_capability, facts.sms).ok_or_else(|| {
        let (major, minor) = facts.compute_capability;
        format!("compute capability {major}.{minor} has no GEMM path (8.0 or later needed)")
    })
}

/// The plan of a shape that passed the checks: the GEMM's tile configuration for it, its
/// tiles, and the persistent grid of `kernel`: GEMM + all-reduce (and + reduce-scatter) as
/// many blocks as the SMs hold at once, so that an SM streams several blocks' weights;
/// all-gather + GEMM one block per SM unless the group's options ask for more (every block is
/// resident: a cooperative launch). Its units are the parts of the tiles where the split runs
/// in parallel ([`FusedPlan::parts_in_parallel`]), else the tiles.
pub(crate) fn planned(
    shape: GemmShape,
    facts: &FusedFacts,
    kernel: FusedKernel,
) -> Result<FusedPlan> {
    let config = fused_config(shape, facts).map_err(|reason| Error::invalid("out", reason))?;
    let tiles = tiles_of(config, shape);
    let parts = split_parts(shape.n, shape.k, facts.sms);
    // cuda/fused_split.cuh's rule (split_in_parallel): the configurations a split selects (64
    // columns; gemm_split.cuh's kParallelSplit), a word for every tile, the partials within the
    // staging half.
    let parts_in_parallel = parts > 1
        && config.splits_k()
        && config.info().block_n == 64
        && shape.m <= SPLIT_PARALLEL_M_MAX
        && tiles <= MAX_TILES
        && parts
            .saturating_mul(shape.m)
            .saturating_mul(shape.n)
            .saturating_mul(4)
            <= facts.capacity;
    let per_sm = match kernel {
        FusedKernel::RowParallel => facts.blocks_per_sm[config.abi() as usize],
        FusedKernel::AllGather => facts.gather_blocks_per_sm[config.abi() as usize],
    };
    let units = if parts_in_parallel {
        tiles * parts
    } else {
        tiles
    };
    Ok(FusedPlan {
        config,
        tiles,
        grid: units.min(facts.blocks.max(1) * per_sm.max(1)),
        parts,
        parts_in_parallel,
        all_reduce: None,
        packets: false,
    })
}

fn tiles_of(config: GemmConfig, shape: GemmShape) -> usize {
    let info = config.info();
    shape.m.div_ceil(info.block_m) * shape.n.div_ceil(info.block_n)
}

/// `tpfuse_gemm_all_reduce` and `tpfuse_gemm_all_reduce_two_shot`: one signature.
type GemmAllReduceLauncher = unsafe extern "C" fn(
    kernels::tpfuse_dtype,
    i32,
    *const kernels::tpfuse_peers,
    *const kernels::tpfuse_group_args,
    i32,
    *const c_void,
    *const c_void,
    *const c_void,
    *mut c_void,
    *const c_void,
    f32,
    *mut c_void,
    usize,
    usize,
    usize,
    *mut c_void,
) -> i32;

/// The GEMM's names for its buffers, and this op's.
const NAMES: [(&str, &str); 3] = [("a", "x"), ("b", "weight"), ("c", "out")];

/// An [`Error::InvalidArgument`] of the GEMM's checks, renamed after this op's arguments.
pub(crate) fn renamed(e: Error) -> Error {
    match e {
        Error::InvalidArgument { arg, reason } => {
            let arg = NAMES
                .iter()
                .find(|(inner, _)| *inner == arg)
                .map_or(arg, |(_, outer)| (*outer).to_string());
            Error::InvalidArgument { arg, reason }
        }
        other => other,
    }
}

/// Every check of [`gemm_all_reduce`], on buffer descriptions (so it runs without a GPU):
/// the GEMM's (shapes, lengths, devices, alignment, `out` disjoint from the inputs), the
/// epilogue's (gamma `[n]` on the device and aligned, `eps` finite and non-negative, the
/// residual disjoint from everything else), then [`unfusable`].
pub fn plan<T: GemmElement>(
    buffers: &FusedBuffers,
    shape: GemmShape,
    facts: &FusedFacts,
) -> Result<FusedPlan> {
    let g = &buffers.gemm;
    check_gemm::<T>(g, shape, facts.device).map_err(renamed)?;
    if let Some(gamma) = &buffers.gamma {
        gamma.check_device("gamma", facts.device)?;
        if gamma.len != shape.n {
            return Err(Error::invalid(
                "gamma",
                format!(
                    "holds {} elements but a row of n = {} needs {}",
                    gamma.len, shape.n, shape.n
                ),
            ));
        }
        gamma.check_aligned16("gamma")?;
        check_disjoint::<T>("out", &g.c, "gamma", gamma)?;
        if !(buffers.eps.is_finite() && buffers.eps >= 0.0) {
            return Err(Error::invalid(
                "eps",
                format!("{} is not a finite non-negative number", buffers.eps),
            ));
        }
    }
    if let Some(residual) = &g.residual {
        // The GEMM allows residual == c (in-place accumulation); here out holds the
        // normalised rows and the residual the sum, so they are two buffers.
        check_disjoint::<T>("out", &g.c, "residual", residual)?;
        check_disjoint::<T>("x", &g.a, "residual", residual)?;
        check_disjoint::<T>("weight", &g.b, "residual", residual)?;
        if let Some(bias) = &g.bias {
            check_disjoint::<T>("bias", bias, "residual", residual)?;
        }
        if let Some(gamma) = &buffers.gamma {
            check_disjoint::<T>("gamma", gamma, "residual", residual)?;
        }
    }
    if let Some(reason) = unfusable::<T>(shape, facts) {
        return Err(Error::invalid("out", reason));
    }
    planned(shape, facts, FusedKernel::RowParallel)
}

/// How the fused GEMM + all-reduce reduces a call of `shape` under `algorithm`:
/// [`AllReduceAlgo::OneShot`] (every rank reduces every tile: least latency, (W-1)·m·n peer
/// reads per rank) or [`AllReduceAlgo::TwoShot`] (each rank its `m / W` rows, then every rank
/// gathers them: 2·(W-1)/W·m·n, for larger messages; `m` a multiple of W). Under
/// [`Algorithm::Auto`], two-shot from the group's one-shot bound
/// ([`FusedFacts::one_shot_below`], the all-reduce's own rule) when `m` splits evenly.
/// Errors: [`Algorithm::Nccl`], and [`Algorithm::TwoShot`] with `m` not a multiple of W,
/// naming `algorithm`.
pub fn fused_all_reduce_algo<T>(
    shape: GemmShape,
    facts: &FusedFacts,
    algorithm: Algorithm,
) -> Result<AllReduceAlgo> {
    let world = facts.world.max(1);
    let even = shape.m % world == 0;
    match algorithm {
        Algorithm::OneShot => Ok(AllReduceAlgo::OneShot),
        Algorithm::TwoShot if even => Ok(AllReduceAlgo::TwoShot),
        Algorithm::TwoShot => Err(Error::invalid(
            "algorithm",
            format!(
                "the fused two-shot splits the m = {} rows into {world} equal slices (one per \
                 rank), which they do not",
                shape.m
            ),
        )),
        Algorithm::Nccl => Err(Error::invalid(
            "algorithm",
            "NCCL does not run fused with the GEMM",
        )),
        Algorithm::Auto => {
            let bytes = shape
                .m
                .saturating_mul(shape.n)
                .saturating_mul(std::mem::size_of::<T>());
            let large = facts.one_shot_below.is_some_and(|b| bytes >= b);
            Ok(if even && large {
                AllReduceAlgo::TwoShot
            } else {
                AllReduceAlgo::OneShot
            })
        }
    }
}

/// The facts of `group` (its device's compute capability and SM count were read when the
/// group was built: no driver query per call).
pub fn facts_of(group: &TpGroup) -> FusedFacts {
    let device = group.device_facts();
    let limits = match group.verdict() {
        Some(verdict) => group.rule().limits_for(verdict),
        None => group.rule().nvlink_limits(group.world()),
    };
    FusedFacts {
        device: group.device(),
        world: group.world(),
        capacity: group.capacity(),
        compute_capability: device.compute_capability,
        sms: device.sms,
        blocks: group.fused_blocks(),
        group_sms: group.group_sms(),
        blocks_per_sm: device.fused_blocks_per_sm,
        gather_blocks_per_sm: device.gather_blocks_per_sm,
        one_shot_below: limits.map(|l| l.one_shot_below),
        packet_bytes: group.packet_bytes(),
    }
}

/// `out` `[m, n]` = `epilogue(Σ_r x_r · W_rᵀ)` on every rank, one kernel launch on the
/// group's stream (see the [module docs](self)). Shapes: `x` `[m, k]` (this rank's input
/// columns), `weight` `[n, k]` (this rank's weight shard, `[out_features, in/W]`), the
/// epilogue's bias and gamma `[n]`, its residual `[m, n]`. `n` and `k` positive multiples
/// of 8; every buffer on the group's device and 16-byte aligned; `out` and the residual
/// overlap nothing. `m = 0` enqueues nothing. A collective: every rank calls it with the same
/// shapes and epilogue in the same order. Returns the plan that ran.
///
/// Errors, before anything is launched: [`Error::InvalidArgument`] naming the buffer or
/// dimension that is wrong (as [`gemm`](crate::ops::gemm()) and
/// [`all_reduce_fused`](crate::ops::all_reduce_fused) name them), or `out` with the reason
/// the shape cannot be fused ([`unfusable`]); a poisoned group's error; a group without
/// symmetric memory.
pub fn gemm_all_reduce<T: GemmElement + NcclType>(
    group: &TpGroup,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    epilogue: Epilogue<'_, T>,
    out: &mut impl DevicePtrMut<T>,
    shape: GemmShape,
) -> Result<FusedPlan> {
    gemm_all_reduce_with(group, x, weight, epilogue, out, shape, Algorithm::Auto)
}

/// [`gemm_all_reduce`] reducing by `algorithm` ([`fused_all_reduce_algo`]: one-shot or
/// two-shot, the same bits); its errors, before anything is launched, include that function's.
pub fn gemm_all_reduce_with<T: GemmElement + NcclType>(
    group: &TpGroup,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    epilogue: Epilogue<'_, T>,
    out: &mut impl DevicePtrMut<T>,
    shape: GemmShape,
    algorithm: Algorithm,
) -> Result<FusedPlan> {
    let facts = facts_of(group);
    let stream = group.stream();
    let info = |b: &dyn DevicePtr<T>| BufferInfo::new(0, b.len(), owner(b));
    // Lengths and devices first, before any pointer is taken (a buffer of another device
    // must not order its events on this stream).
    let mut buffers = FusedBuffers {
        gemm: GemmBuffers {
            a: info(x),
            b: info(weight),
            bias: epilogue.bias.map(info),
            residual: epilogue
                .residual
                .as_deref()
                .map(|r| BufferInfo::new(0, r.len(), owner(r))),
            c: BufferInfo::new(0, out.len(), owner(&*out)),
        },
        gamma: epilogue.norm.as_ref().map(|n| info(n.gamma)),
        eps: epilogue.norm.as_ref().map_or(0.0, |n| n.eps),
    };
    check_gemm_shapes(&buffers.gemm, shape, facts.device).map_err(renamed)?;
    if let Some(gamma) = &buffers.gamma {
        gamma.check_device("gamma", facts.device)?;
    }
    let algo = fused_all_reduce_algo::<T>(shape, &facts, algorithm)?;
    if shape.m == 0 {
        return plan::<T>(&buffers, shape, &facts).map(|p| p.reducing(algo, shape, &facts));
    }
    let (x_ptr, _x) = x.device_ptr(stream);
    let (w_ptr, _w) = weight.device_ptr(stream);
    let bias = epilogue.bias.map(|b| b.device_ptr(stream));
    let gamma = epilogue.norm.as_ref().map(|n| n.gamma.device_ptr(stream));
    let residual = epilogue.residual.map(|r| r.device_ptr_mut(stream));
    let (out_ptr, _out) = out.device_ptr_mut(stream);
    let g = &mut buffers.gemm;
    g.a.addr = x_ptr;
    g.b.addr = w_ptr;
    g.c.addr = out_ptr;
    if let (Some(info), Some((ptr, _))) = (g.bias.as_mut(), bias.as_ref()) {
        info.addr = *ptr;
    }
    if let (Some(info), Some((ptr, _))) = (g.residual.as_mut(), residual.as_ref()) {
        info.addr = *ptr;
    }
    if let (Some(info), Some((ptr, _))) = (buffers.gamma.as_mut(), gamma.as_ref()) {
        info.addr = *ptr;
    }
    let plan = plan::<T>(&buffers, shape, &facts)?.reducing(algo, shape, &facts);
    let (peers, args) = group.kernel_args()?;
    bind(stream)?;
    let addr = |b: Option<BufferInfo>| b.map_or(std::ptr::null(), |b| b.addr as *const c_void);
    let g = &buffers.gemm;
    let (launch, name) = if algo == AllReduceAlgo::TwoShot {
        (
            kernels::tpfuse_gemm_all_reduce_two_shot as GemmAllReduceLauncher,
            "tpfuse_gemm_all_reduce_two_shot",
        )
    } else {
        (
            kernels::tpfuse_gemm_all_reduce as GemmAllReduceLauncher,
            "tpfuse_gemm_all_reduce",
        )
    };
    // SAFETY: `plan` checked every length against m, n, k, every device, the alignment, the
    // capacity and tile count, and that out and the residual overlap nothing (and
    // `fused_all_reduce_algo` that m splits into W slices for the two-shot); the symmetric
    // workspace behind `peers` lives as long as `group`; the guards keep cudarc's stream
    // ordering until the kernel is enqueued.
    let code = unsafe {
        launch(
            T::DTYPE,
            plan.config.abi(),
            &peers,
            &args,
            i32::try_from(plan.grid).unwrap_or(i32::MAX),
            g.a.addr as *const c_void,
            g.b.addr as *const c_void,
            addr(g.bias),
            addr(g.residual) as *mut c_void,
            addr(buffers.gamma),
            buffers.eps,
            g.c.addr as *mut c_void,
            shape.m,
            shape.n,
            shape.k,
            stream.cu_stream() as *mut c_void,
        )
    };
    group.launched(name, code)?;
    Ok(plan)
}

/// The checks of [`gemm_reduce_scatter`], on buffer descriptions (no GPU needed): `m` a
/// multiple of the world size, `x` `[m, k]`, `weight` `[n, k]`, `out` `[m / W, n]` on the
/// device, 16-byte aligned, `out` disjoint from `x` and `weight`, then [`unfusable`].
pub fn plan_reduce_scatter<T: GemmElement>(
    x: &BufferInfo,
    weight: &BufferInfo,
    out: &BufferInfo,
    shape: GemmShape,
    facts: &FusedFacts,
) -> Result<FusedPlan> {
    let world = facts.world.max(1);
    if shape.m % world != 0 {
        return Err(Error::invalid(
            "m",
            format!(
                "m = {} rows do not split into {world} equal slices (one per rank)",
                shape.m
            ),
        ));
    }
    // x and the weight as the GEMM sees them; `c` stands for the [m, n] partial (lengths only).
    let partial = BufferInfo::new(0, shape.m * shape.n, out.device);
    let lengths = GemmBuffers {
        a: *x,
        b: *weight,
        bias: None,
        residual: None,
        c: partial,
    };
    check_gemm_shapes(&lengths, shape, facts.device).map_err(renamed)?;
    out.check_device("out", facts.device)?;
    let rows = shape.m / world;
    if out.len != rows * shape.n {
        return Err(Error::invalid(
            "out",
            format!(
                "holds {} elements but this rank's slice [m / world, n] = [{rows}, {}] needs {}",
                out.len,
                shape.n,
                rows * shape.n
            ),
        ));
    }
    if shape.m == 0 {
        return planned(shape, facts, FusedKernel::RowParallel);
    }
    for (name, b) in [("x", x), ("weight", weight), ("out", out)] {
        b.check_aligned16(name)?;
    }
    check_disjoint::<T>("x", x, "out", out)?;
    check_disjoint::<T>("weight", weight, "out", out)?;
    if let Some(reason) = unfusable::<T>(shape, facts) {
        return Err(Error::invalid("out", reason));
    }
    planned(shape, facts, FusedKernel::RowParallel)
}

/// GEMM + reduce-scatter (Megatron sequence parallelism), one kernel launch on the group's
/// stream: rank `r` gets `out` `[m / W, n]` = rows `r·m/W .. (r+1)·m/W` of `Σ_q x_q · W_qᵀ`
/// (each rank's partial rounded to `T`, the partials added in rank order in f32, rounded
/// once): the bits of [`gemm`](crate::ops::gemm()) into a workspace followed by
/// [`reduce_scatter`](crate::ops::reduce_scatter) of it. Shapes: `x` `[m, k]`, `weight`
/// `[n, k]`; `m` a multiple of the world size; `n`, `k` positive multiples of 8; the partial
/// `[m, n]` must fit in half the group's capacity. A collective: every rank calls it with the
/// same shapes. Errors, before anything is launched: [`Error::InvalidArgument`] naming `m`,
/// `x`, `weight` or `out`; a poisoned group's error; a group without symmetric memory.
pub fn gemm_reduce_scatter<T: GemmElement + NcclType>(
    group: &TpGroup,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
    shape: GemmShape,
) -> Result<FusedPlan> {
    let facts = facts_of(group);
    let stream = group.stream();
    let mut xi = BufferInfo::new(0, x.len(), owner(x));
    let mut wi = BufferInfo::new(0, weight.len(), owner(weight));
    let mut oi = BufferInfo::new(0, out.len(), owner(&*out));
    // Lengths and devices first, before any pointer is taken.
    for (name, b) in [("x", &xi), ("weight", &wi), ("out", &oi)] {
        b.check_device(name, facts.device)?;
    }
    if shape.m == 0 {
        return plan_reduce_scatter::<T>(&xi, &wi, &oi, shape, &facts);
    }
    let (x_ptr, _x) = x.device_ptr(stream);
    let (w_ptr, _w) = weight.device_ptr(stream);
    let (out_ptr, _out) = out.device_ptr_mut(stream);
    (xi.addr, wi.addr, oi.addr) = (x_ptr, w_ptr, out_ptr);
    let plan = plan_reduce_scatter::<T>(&xi, &wi, &oi, shape, &facts)?;
    let (peers, args) = group.kernel_args()?;
    bind(stream)?;
    // SAFETY: `plan_reduce_scatter` checked every length against m, n, k and the world, the
    // devices, the alignment, the capacity and tile count, and that out overlaps no input;
    // the symmetric workspace lives as long as `group`; the guards keep cudarc's stream
    // ordering until the kernel is enqueued.
    let code = unsafe {
        kernels::tpfuse_gemm_reduce_scatter(
            T::DTYPE,
            plan.config.abi(),
            &peers,
            &args,
            i32::try_from(plan.grid).unwrap_or(i32::MAX),
            x_ptr as *const c_void,
            w_ptr as *const c_void,
            out_ptr as *mut c_void,
            shape.m,
            shape.n,
            shape.k,
            stream.cu_stream() as *mut c_void,
        )
    };
    group.launched("tpfuse_gemm_reduce_scatter", code)?;
    Ok(plan)
}
