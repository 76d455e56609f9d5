//! All-reduce over a [`TpGroup`]: tpfuse's one-shot and two-shot kernels over symmetric
//! memory, or NCCL, chosen by the topology policy and the message size (or by the caller),
//! with the epilogue of a transformer layer's row-parallel output fused in.
//!
//! Every rank of the group makes the same calls in the same order with the same shapes (as
//! with NCCL). Shapes: `partial`/`input` and `out` are `[rows, hidden]` row-major (a flat
//! all-reduce is one row), `bias` and `gamma` are `[hidden]`, `residual` is `[rows, hidden]`.
//! The custom kernels add the ranks' partial sums in rank order in f32 and round once, so
//! every rank, and one-shot, two-shot and fused paths alike, hold the same bits. NCCL
//! reduces in its own order: its results agree with the reference, not bit for bit with
//! the custom kernels.
//!
//! Everything is checked before anything is launched: lengths, 16-byte alignment, devices,
//! capacity, aliasing. A kernel that waited past the group's deadline surfaces at
//! [`TpGroup::check`] as [`Error::PeerTimeout`] and poisons the group.

use crate::device::bind;
use crate::dtype::{Element, NcclType};
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::group::TpGroup;
use crate::topology::{AllReduceAlgo, AllReduceRule, Verdict};
use crate::validate::{launched, owner, BufferInfo};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// Which all-reduce runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// The policy chooses by topology and message size.
    Auto,
    /// tpfuse's one-shot kernel (every rank reads every peer).
    OneShot,
    /// tpfuse's two-shot kernel (reduce-scatter, then all-gather).
    TwoShot,
    /// NCCL (needs a group with a communicator).
    Nccl,
}

/// RMSNorm after the reduction: `out = h * rsqrt(mean(h^2) + eps) * gamma`.
pub struct RmsNorm<'a, T> {
    /// `[hidden]` weights.
    pub gamma: &'a dyn DevicePtr<T>,
    /// Added to the mean of squares.
    pub eps: f32,
}

/// What follows the reduction, fused into the kernel: `h = sum (+ bias) (+ residual)`,
/// `residual := h`, then `out = rmsnorm(h)` with `norm`, else `out = h`.
pub struct Epilogue<'a, T> {
    /// `[hidden]`, added to every row.
    pub bias: Option<&'a dyn DevicePtr<T>>,
    /// `[rows, hidden]`, added, then overwritten with the sum (the new residual stream).
    pub residual: Option<&'a mut dyn DevicePtrMut<T>>,
    /// RMSNorm of the sum.
    pub norm: Option<RmsNorm<'a, T>>,
}

impl<T> Default for Epilogue<'_, T> {
    fn default() -> Self {
        Epilogue {
            bias: None,
            residual: None,
            norm: None,
        }
    }
}

/// `out = sum over ranks of input` (same length on every rank). Returns the algorithm
/// that ran. `input` and `out` may be the same buffer only through
/// [`all_reduce_in_place`].
pub fn all_reduce<T: Element + NcclType>(
    group: &TpGroup,
    input: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
    algorithm: Algorithm,
) -> Result<AllReduceAlgo> {
    all_reduce_fused(group, input, Epilogue::default(), out, algorithm)
}

/// `buf = sum over ranks of buf`.
pub fn all_reduce_in_place<T: Element + NcclType>(
    group: &TpGroup,
    buf: &mut impl DevicePtrMut<T>,
    algorithm: Algorithm,
) -> Result<AllReduceAlgo> {
    let (len, device) = (buf.len(), owner(&*buf));
    let (ptr, _guard) = buf.device_ptr_mut(group.stream());
    let (desc, plan) = plan_in_place::<T>(group, BufferInfo::new(ptr, len, device), algorithm)?;
    execute::<T>(group, &desc, &plan)
}

/// Everything [`all_reduce_in_place`] of `buf` checks before it launches (shapes, alignment,
/// capacity, the algorithm, and for tpfuse's kernels a usable, unpoisoned group), for a
/// caller that must refuse before launching work of its own; then
/// [`execute`] runs it (the caller holds the buffer's stream-ordering guard across both).
pub(crate) fn plan_in_place<T: Element>(
    group: &TpGroup,
    buf: BufferInfo,
    algorithm: Algorithm,
) -> Result<(Desc, Plan)> {
    let desc = Desc {
        input: buf,
        out: buf,
        bias: None,
        residual: None,
        gamma: None,
        eps: 0.0,
    };
    let plan = plan::<T>(&desc, &GroupFacts::of(group), algorithm)?;
    if plan.algo != AllReduceAlgo::Nccl && buf.len > 0 {
        group.kernel_args()?;
    }
    Ok((desc, plan))
}

/// The decode hot path of a transformer layer: `h = sum over ranks of partial + residual`,
/// `residual := h`, `out = rmsnorm(h) * gamma`. Shapes: `partial`, `residual`, `out`
/// `[rows, hidden]`, `gamma` `[hidden]`.
pub fn all_reduce_residual_rmsnorm<T: Element + NcclType>(
    group: &TpGroup,
    partial: &impl DevicePtr<T>,
    residual: &mut impl DevicePtrMut<T>,
    gamma: &impl DevicePtr<T>,
    eps: f32,
    out: &mut impl DevicePtrMut<T>,
) -> Result<AllReduceAlgo> {
    let epilogue = Epilogue {
        bias: None,
        residual: Some(residual),
        norm: Some(RmsNorm { gamma, eps }),
    };
    all_reduce_fused(group, partial, epilogue, out, Algorithm::Auto)
}

/// The general form: the reduction, then `epilogue`, fused where the algorithm allows
/// (one-shot fuses everything; two-shot fuses bias and residual and runs RMSNorm as a
/// second kernel; NCCL runs the epilogue as kernels after the collective).
pub fn all_reduce_fused<T: Element + NcclType>(
    group: &TpGroup,
    partial: &impl DevicePtr<T>,
    mut epilogue: Epilogue<'_, T>,
    out: &mut impl DevicePtrMut<T>,
    algorithm: Algorithm,
) -> Result<AllReduceAlgo> {
    with_plan(
        group,
        partial,
        &mut epilogue,
        out,
        algorithm,
        |desc, plan| execute::<T>(group, desc, plan),
    )
}

/// Everything [`all_reduce_fused`] checks before it launches (shapes, alignment, aliasing,
/// capacity, the algorithm), for a caller that must refuse before launching work of its own:
/// the unfused row-parallel layer, before its GEMM writes the partial sums this reduces.
/// Launches nothing. It takes the buffers' pointers as the call does, `partial`'s for reading:
/// a caller about to write `partial` takes its pointer for writing first (cudarc's read guard
/// would re-record the buffer's read event on the group's stream, and the writer's wait would
/// then miss an earlier reader on another stream).
pub(crate) fn check_fused<T: Element>(
    group: &TpGroup,
    partial: &impl DevicePtr<T>,
    epilogue: &mut Epilogue<'_, T>,
    out: &mut impl DevicePtrMut<T>,
    algorithm: Algorithm,
) -> Result<()> {
    with_plan(group, partial, epilogue, out, algorithm, |desc, plan| {
        if plan.algo != AllReduceAlgo::Nccl && desc.input.len > 0 {
            group.kernel_args()?; // a usable, unpoisoned group, as the launch needs
        }
        Ok(plan.algo)
    })
    .map(|_| ())
}

/// Checks one fused all-reduce and plans it, then hands the call's buffers and plan to `run`
/// while their stream-ordering guards are held (an empty call is checked and planned only).
fn with_plan<T: Element>(
    group: &TpGroup,
    partial: &impl DevicePtr<T>,
    epilogue: &mut Epilogue<'_, T>,
    out: &mut impl DevicePtrMut<T>,
    algorithm: Algorithm,
    run: impl FnOnce(&Desc, &Plan) -> Result<AllReduceAlgo>,
) -> Result<AllReduceAlgo> {
    let facts = GroupFacts::of(group);
    let stream = group.stream();
    let info = |buf: &dyn DevicePtr<T>| (buf.len(), owner(buf));
    // Devices and lengths are read before any pointer is taken (a buffer of another device
    // must not order its events on this stream); every pointer is then taken once.
    let (in_len, in_dev) = info(partial);
    let (out_len, out_dev) = (out.len(), owner(&*out));
    let bias_info = epilogue.bias.map(info);
    let gamma_info = epilogue.norm.as_ref().map(|n| info(n.gamma));
    let residual_info = epilogue.residual.as_deref().map(|r| (r.len(), owner(r)));
    let shapes = Desc {
        input: BufferInfo::new(0, in_len, in_dev),
        out: BufferInfo::new(0, out_len, out_dev),
        bias: bias_info.map(|(l, d)| BufferInfo::new(0, l, d)),
        residual: residual_info.map(|(l, d)| BufferInfo::new(0, l, d)),
        gamma: gamma_info.map(|(l, d)| BufferInfo::new(0, l, d)),
        eps: epilogue.norm.as_ref().map_or(0.0, |n| n.eps),
    };
    check_shapes::<T>(&shapes, facts.device)?;
    if in_len == 0 {
        // Nothing to move, but the call is still checked (and its algorithm chosen).
        return plan::<T>(&shapes, &facts, algorithm).map(|p| p.algo);
    }
    let (input_ptr, _g1) = partial.device_ptr(stream);
    let bias = epilogue.bias.map(|b| b.device_ptr(stream));
    let gamma = epilogue.norm.as_ref().map(|n| n.gamma.device_ptr(stream));
    let residual = epilogue
        .residual
        .as_deref_mut()
        .map(|r| r.device_ptr_mut(stream));
    let (out_ptr, _g2) = out.device_ptr_mut(stream);
    let with = |info: Option<BufferInfo>, ptr: Option<u64>| {
        info.zip(ptr)
            .map(|(i, p)| BufferInfo::new(p, i.len, i.device))
    };
    let desc = Desc {
        input: BufferInfo::new(input_ptr, in_len, in_dev),
        out: BufferInfo::new(out_ptr, out_len, out_dev),
        bias: with(shapes.bias, bias.as_ref().map(|(p, _)| *p)),
        residual: with(shapes.residual, residual.as_ref().map(|(p, _)| *p)),
        gamma: with(shapes.gamma, gamma.as_ref().map(|(p, _)| *p)),
        eps: shapes.eps,
    };
    let plan = plan::<T>(&desc, &facts, algorithm)?;
    run(&desc, &plan)
}

/// The buffers of one call, as the checks see them.
#[derive(Clone, Debug)]
pub struct Desc {
    /// The partial sums of this rank.
    pub input: BufferInfo,
    /// Where the result goes.
    pub out: BufferInfo,
    /// `[hidden]` bias.
    pub bias: Option<BufferInfo>,
    /// `[rows, hidden]` residual (read and written).
    pub residual: Option<BufferInfo>,
    /// `[hidden]` RMSNorm weights.
    pub gamma: Option<BufferInfo>,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// What the checks need to know of a group (borrowed: nothing is copied per call).
#[derive(Clone, Copy, Debug)]
pub struct GroupFacts<'a> {
    /// CUDA ordinal of the group's device.
    pub device: usize,
    /// Ranks.
    pub world: usize,
    /// Bytes one message may take in the custom kernels.
    pub capacity: usize,
    /// Virtual ranks on one GPU (no NCCL).
    pub virtual_ranks: bool,
    /// Whether the group has an NCCL communicator.
    pub has_comm: bool,
    /// The topology policy's verdict for the group, when known.
    pub verdict: Option<&'a Verdict>,
    /// The size rule.
    pub rule: &'a AllReduceRule,
}

impl<'a> GroupFacts<'a> {
    /// The facts of `group`.
    pub fn of(group: &'a TpGroup) -> GroupFacts<'a> {
        GroupFacts {
            device: group.device(),
            world: group.world(),
            capacity: group.capacity(),
            virtual_ranks: group.is_virtual(),
            has_comm: group.comm().is_some(),
            verdict: group.verdict(),
            rule: group.rule(),
        }
    }
}

/// What will run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The algorithm.
    pub algo: AllReduceAlgo,
    /// Rows of the `[rows, hidden]` view.
    pub rows: usize,
    /// Row length.
    pub hidden: usize,
}

/// The row length of the call: bias's or gamma's length, else the whole buffer.
fn hidden_of(desc: &Desc) -> usize {
    desc.gamma.or(desc.bias).map_or(desc.input.len, |b| b.len)
}

/// Lengths, devices and divisibility (no addresses needed).
fn check_shapes<T: Element>(desc: &Desc, device: usize) -> Result<()> {
    let n = desc.input.len;
    desc.input.check_device("partial", device)?;
    desc.out.check_device("out", device)?;
    if desc.out.len != n {
        return Err(Error::invalid(
            "out",
            format!("holds {} elements but partial holds {n}", desc.out.len),
        ));
    }
    if let Some(r) = &desc.residual {
        r.check_device("residual", device)?;
        if r.len != n {
            return Err(Error::invalid(
                "residual",
                format!("holds {} elements but partial holds {n}", r.len),
            ));
        }
    }
    if let (Some(b), Some(g)) = (&desc.bias, &desc.gamma) {
        if b.len != g.len {
            return Err(Error::invalid(
                "bias",
                format!("holds {} elements but gamma holds {}", b.len, g.len),
            ));
        }
    }
    for (name, b) in [("bias", &desc.bias), ("gamma", &desc.gamma)] {
        let Some(b) = b else { continue };
        b.check_device(name, device)?;
        let vec = 16 / std::mem::size_of::<T>();
        if b.len == 0 || b.len % vec != 0 {
            return Err(Error::invalid(
                name,
                format!(
                    "hidden size {} must be a positive multiple of {vec} {} elements",
                    b.len,
                    T::NAME
                ),
            ));
        }
        if n % b.len != 0 {
            return Err(Error::invalid(
                "partial",
                format!(
                    "{n} elements are not whole rows of hidden size {} ({name})",
                    b.len
                ),
            ));
        }
    }
    if let Some(r) = &desc.gamma {
        let _ = r;
        if !(desc.eps.is_finite() && desc.eps >= 0.0) {
            return Err(Error::invalid(
                "eps",
                format!("{} is not a finite non-negative number", desc.eps),
            ));
        }
    }
    Ok(())
}

/// Everything before a launch: shapes, alignment, aliasing, and the algorithm.
pub fn plan<T: Element>(desc: &Desc, facts: &GroupFacts, algorithm: Algorithm) -> Result<Plan> {
    check_shapes::<T>(desc, facts.device)?;
    let named = [
        ("partial", Some(desc.input)),
        ("out", Some(desc.out)),
        ("bias", desc.bias),
        ("residual", desc.residual),
        ("gamma", desc.gamma),
    ];
    for (name, b) in named {
        if let Some(b) = b {
            b.check_aligned16(name)?;
        }
    }
    // Aliasing: out may be partial itself (in place); nothing else may overlap out or the
    // residual, which are written.
    let overlaps = |a: &BufferInfo, b: &BufferInfo| a.overlaps::<T>(b);
    let same = |a: &BufferInfo, b: &BufferInfo| a.addr == b.addr && a.len == b.len;
    if overlaps(&desc.input, &desc.out) && !same(&desc.input, &desc.out) {
        return Err(Error::invalid(
            "out",
            "overlaps partial without being the same buffer (in place)",
        ));
    }
    for (name, b) in [("bias", desc.bias), ("gamma", desc.gamma)] {
        if let Some(b) = b {
            if overlaps(&b, &desc.out) || desc.residual.is_some_and(|r| overlaps(&b, &r)) {
                return Err(Error::invalid(
                    name,
                    "overlaps out or residual, which are written",
                ));
            }
        }
    }
    if let Some(r) = desc.residual {
        if overlaps(&r, &desc.out) || overlaps(&r, &desc.input) {
            return Err(Error::invalid("residual", "overlaps partial or out"));
        }
    }
    let hidden = hidden_of(desc);
    let rows = desc.input.len.checked_div(hidden).unwrap_or(0);
    let algo = choose::<T>(desc, facts, algorithm)?;
    Ok(Plan { algo, rows, hidden })
}

fn choose<T: Element>(
    desc: &Desc,
    facts: &GroupFacts,
    algorithm: Algorithm,
) -> Result<AllReduceAlgo> {
    let bytes = desc.input.len * std::mem::size_of::<T>();
    let fits = bytes <= facts.capacity;
    let custom = |algo: AllReduceAlgo| {
        if fits {
            Ok(algo)
        } else {
            Err(Error::invalid(
                "partial",
                format!(
                    "{bytes} bytes exceed the group's capacity of {} bytes for the custom kernels",
                    facts.capacity
                ),
            ))
        }
    };
    match algorithm {
        Algorithm::OneShot => custom(AllReduceAlgo::OneShot),
        Algorithm::TwoShot => custom(AllReduceAlgo::TwoShot),
        Algorithm::Nccl if facts.has_comm => Ok(AllReduceAlgo::Nccl),
        Algorithm::Nccl => Err(Error::invalid(
            "algorithm",
            "NCCL was asked for but the group has no communicator (virtual ranks)",
        )),
        Algorithm::Auto if facts.virtual_ranks || facts.verdict.is_none() => {
            // Without a verdict (virtual ranks, or a group whose topology NVML could not
            // show) the NVLink limits apply; past the capacity NCCL takes over if there is one.
            match facts.rule.nvlink_limits(facts.world) {
                Some(l) if bytes < l.one_shot_below && fits => Ok(AllReduceAlgo::OneShot),
                _ if fits => Ok(AllReduceAlgo::TwoShot),
                _ if facts.has_comm => Ok(AllReduceAlgo::Nccl),
                _ => custom(AllReduceAlgo::TwoShot),
            }
        }
        Algorithm::Auto => {
            let verdict = facts
                .verdict
                .ok_or_else(|| Error::invalid("algorithm", "no topology verdict for the group"))?;
            match facts.rule.choose(verdict, bytes) {
                AllReduceAlgo::Nccl if !facts.has_comm => custom(AllReduceAlgo::TwoShot),
                algo @ (AllReduceAlgo::OneShot | AllReduceAlgo::TwoShot) if !fits => {
                    if facts.has_comm {
                        Ok(AllReduceAlgo::Nccl)
                    } else {
                        custom(algo)
                    }
                }
                algo => Ok(algo),
            }
        }
    }
}

fn ptr(b: Option<BufferInfo>) -> *const c_void {
    b.map_or(std::ptr::null(), |b| b.addr as *const c_void)
}

pub(crate) fn execute<T: Element + NcclType>(
    group: &TpGroup,
    desc: &Desc,
    plan: &Plan,
) -> Result<AllReduceAlgo> {
    if desc.input.len == 0 {
        return Ok(plan.algo);
    }
    let stream = group.stream();
    bind(stream)?;
    let raw_stream = stream.cu_stream() as *mut c_void;
    match plan.algo {
        AllReduceAlgo::OneShot | AllReduceAlgo::TwoShot => {
            let (peers, args) = group.kernel_args()?;
            // The one-shot goes by packets where the group offers them to the all-reduce
            // (GroupOptions::all_reduce_packets) and the message fits them.
            let packet_bytes = group.all_reduce_packet_bytes();
            let args = kernels::tpfuse_group_args {
                packet_bytes: packet_bytes as u64,
                ..args
            };
            let algo = match plan.algo {
                AllReduceAlgo::OneShot if packet_bytes != 0 => {
                    kernels::TPFUSE_ALGO_ONE_SHOT_PACKETS
                }
                AllReduceAlgo::OneShot => kernels::TPFUSE_ALGO_ONE_SHOT,
                _ => kernels::TPFUSE_ALGO_TWO_SHOT,
            } as i32;
            // SAFETY: `plan` checked lengths, devices, alignment, capacity and aliasing of
            // every buffer; the symmetric workspace behind `peers` lives as long as `group`.
            let code = unsafe {
                kernels::tpfuse_all_reduce(
                    T::DTYPE,
                    algo,
                    &peers,
                    &args,
                    ptr(Some(desc.input)),
                    ptr(desc.bias),
                    ptr(desc.residual) as *mut c_void,
                    ptr(desc.gamma),
                    desc.eps,
                    desc.out.addr as *mut c_void,
                    plan.rows,
                    plan.hidden,
                    raw_stream,
                )
            };
            group.launched("tpfuse_all_reduce", code)?;
        }
        AllReduceAlgo::Nccl => {
            let comm = group
                .comm()
                .ok_or_else(|| Error::invalid("algorithm", "the group has no communicator"))?;
            let view = |b: BufferInfo| RawDeviceBuffer::<T>::new(b, group);
            let input = view(desc.input);
            let mut out = view(desc.out);
            comm.all_reduce(&input, &mut out, crate::comm::ReduceOp::Sum)?;
            run_epilogue::<T>(desc, plan, raw_stream)?;
        }
    }
    Ok(plan.algo)
}

/// The epilogue after an NCCL all-reduce: bias and residual, then RMSNorm, in place on out.
fn run_epilogue<T: Element>(desc: &Desc, plan: &Plan, stream: *mut c_void) -> Result<()> {
    let out = desc.out.addr as *mut c_void;
    if desc.bias.is_some() || desc.residual.is_some() {
        // SAFETY: checked by `plan`; element-wise, in place on out.
        let code = unsafe {
            kernels::tpfuse_bias_residual(
                T::DTYPE,
                out,
                ptr(desc.bias),
                ptr(desc.residual) as *mut c_void,
                out,
                plan.rows,
                plan.hidden,
                stream,
            )
        };
        launched("tpfuse_bias_residual", code)?;
    }
    if desc.gamma.is_some() {
        // SAFETY: checked by `plan`; row-wise, in place on out.
        let code = unsafe {
            kernels::tpfuse_rms_norm(
                T::DTYPE,
                out,
                ptr(desc.gamma),
                desc.eps,
                out,
                plan.rows,
                plan.hidden,
                stream,
            )
        };
        launched("tpfuse_rms_norm", code)?;
    }
    Ok(())
}

/// A checked device range handed to NCCL (which takes cudarc buffers): the caller's
/// buffers were already ordered on the group's stream when their pointers were taken.
struct RawDeviceBuffer<'a, T> {
    info: BufferInfo,
    group: &'a TpGroup,
    _t: std::marker::PhantomData<T>,
}

impl<'a, T> RawDeviceBuffer<'a, T> {
    fn new(info: BufferInfo, group: &'a TpGroup) -> Self {
        RawDeviceBuffer {
            info,
            group,
            _t: std::marker::PhantomData,
        }
    }
}

impl<T> cudarc::driver::DeviceSlice<T> for RawDeviceBuffer<'_, T> {
    fn len(&self) -> usize {
        self.info.len
    }
    fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        self.group.stream()
    }
}

impl<T> DevicePtr<T> for RawDeviceBuffer<'_, T> {
    fn device_ptr<'b>(
        &'b self,
        _stream: &'b cudarc::driver::CudaStream,
    ) -> (
        cudarc::driver::sys::CUdeviceptr,
        cudarc::driver::SyncOnDrop<'b>,
    ) {
        (self.info.addr, cudarc::driver::SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for RawDeviceBuffer<'_, T> {
    fn device_ptr_mut<'b>(
        &'b mut self,
        _stream: &'b cudarc::driver::CudaStream,
    ) -> (
        cudarc::driver::sys::CUdeviceptr,
        cudarc::driver::SyncOnDrop<'b>,
    ) {
        (self.info.addr, cudarc::driver::SyncOnDrop::Sync(None))
    }
}
