//! All-gather + GEMM (Megatron sequence parallelism) in one kernel launch per rank
//! (`cuda/all_gather_gemm.cu`; design in `docs/fused-gemm.md`): rank `r` holds rows
//! `r·m/W .. (r+1)·m/W` of the input, and every rank gets `out` `[m, n]` =
//! `all_gather(x) · weightᵀ (+ bias)` with its own weight shard `[n, k]` (the column-parallel
//! layer after a sequence-parallel region). Each rank pushes its rows once into every rank's
//! symmetric buffer, and the GEMM starts on the local rows while the peers' rows arrive; the
//! tiles read the gathered `[m, k]` from local memory, so it must fit in half the group's
//! capacity (`m · k · size_of::<T>() ≤ capacity / 2`: m ≤ 256 at k = 8192 in bf16 with the
//! default 8 MiB). The bits are those of
//! [`all_gather`](crate::ops::all_gather) into `[m, k]` followed by
//! [`gemm`](crate::ops::gemm()) with the bias; the tests compare them bit for bit. The same
//! deadlines and failure semantics as the other custom kernels (a failed launch marks `out`
//! failed); CUDA-graph capturable.

use crate::device::bind;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::group::TpGroup;
use crate::ops::gemm::{check_gemm_shapes, GemmBuffers, GemmElement, GemmShape};
use crate::ops::gemm_all_reduce::{
    facts_of, fused_config, mixed_gpus, planned, renamed, FusedFacts, FusedPlan,
};
use crate::topology::FusedKernel;
use crate::validate::{check_disjoint, owner, BufferInfo};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// Why a shape cannot take the fused all-gather + GEMM on a group, or `None` when it can: a
/// world of one, GPUs of different SM counts ([`mixed_gpus`]), a gathered input `[m, k]`
/// larger than half the symmetric capacity, or a device without a GEMM path. The layers fall
/// back to the unfused path on these. (`m` not a multiple of the world size is an error on
/// either path.)
pub fn unfusable_all_gather<T>(shape: GemmShape, facts: &FusedFacts) -> Option<String> {
    if facts.world < 2 {
        return Some("the fused path needs a group of 2 or more ranks".into());
    }
    if let Some(reason) = mixed_gpus(facts) {
        return Some(reason);
    }
    let bytes = shape
        .m
        .saturating_mul(shape.k)
        .saturating_mul(std::mem::size_of::<T>());
    if bytes > facts.capacity / 2 {
        return Some(gathered_too_large(shape, bytes, facts));
    }
    fused_config(shape, facts).err()
}

fn gathered_too_large(shape: GemmShape, bytes: usize, facts: &FusedFacts) -> String {
    format!(
        "the gathered input [m, k] = [{}, {}] ({bytes} bytes) exceeds half the group's \
         symmetric capacity ({} of {} bytes), where the fused kernel gathers it",
        shape.m,
        shape.k,
        facts.capacity / 2,
        facts.capacity
    )
}

/// Every check of [`all_gather_gemm`] on buffer descriptions (no GPU needed): `m` a multiple
/// of the world size; `x` `[m / W, k]`, `weight` `[n, k]`, `bias` `[n]`, `out` `[m, n]` on the
/// device and 16-byte aligned; `out` disjoint from the inputs; the gathered input `[m, k]`
/// within half the group's capacity; a GEMM path on the device.
pub fn plan_all_gather_gemm<T: GemmElement>(
    x: &BufferInfo,
    weight: &BufferInfo,
    bias: Option<&BufferInfo>,
    out: &BufferInfo,
    shape: GemmShape,
    facts: &FusedFacts,
) -> Result<FusedPlan> {
    let world = facts.world.max(1);
    if facts.world < 2 {
        return Err(Error::invalid(
            "out",
            "the fused all-gather + GEMM needs a group of 2 or more ranks",
        ));
    }
    if let Some(reason) = mixed_gpus(facts) {
        return Err(Error::invalid("out", reason));
    }
    if shape.m % world != 0 {
        return Err(Error::invalid(
            "m",
            format!(
                "m = {} rows do not split into {world} equal slices (one per rank)",
                shape.m
            ),
        ));
    }
    let rows = shape.m / world;
    // The GEMM's view: A is the gathered [m, k]; this rank's x holds its [m / W, k] slice.
    let gathered = BufferInfo::new(0, shape.m.saturating_mul(shape.k), x.device);
    let lengths = GemmBuffers {
        a: gathered,
        b: *weight,
        bias: bias.copied(),
        residual: None,
        c: *out,
    };
    check_gemm_shapes(&lengths, shape, facts.device).map_err(renamed)?;
    x.check_device("x", facts.device)?;
    if x.len != rows * shape.k {
        return Err(Error::invalid(
            "x",
            format!(
                "holds {} elements but this rank's slice [m / world, k] = [{rows}, {}] needs {}",
                x.len,
                shape.k,
                rows * shape.k
            ),
        ));
    }
    let bytes = shape
        .m
        .saturating_mul(shape.k)
        .saturating_mul(std::mem::size_of::<T>());
    if bytes > facts.capacity / 2 {
        return Err(Error::invalid("x", gathered_too_large(shape, bytes, facts)));
    }
    if shape.m == 0 {
        return planned(shape, facts, FusedKernel::AllGather);
    }
    let mut named = vec![("x", x), ("weight", weight), ("out", out)];
    if let Some(b) = bias {
        named.push(("bias", b));
    }
    for (name, b) in &named {
        b.check_aligned16(name)?;
    }
    for (name, b) in &named[..2] {
        check_disjoint::<T>(name, b, "out", out)?;
    }
    if let Some(b) = bias {
        check_disjoint::<T>("bias", b, "out", out)?;
    }
    planned(shape, facts, FusedKernel::AllGather)
}

/// `out` `[m, n]` = `all_gather(x) · weightᵀ (+ bias)` on every rank, one kernel launch on the
/// group's stream (see the [module docs](self)). Shapes: `x` `[m / W, k]` (this rank's rows,
/// rank order), `weight` `[n, k]`, `bias` `[n]`; `m` a multiple of the world size, `n` and `k`
/// positive multiples of 8; every buffer on the group's device and 16-byte aligned; `out`
/// overlaps nothing. A collective: every rank calls it with the same shapes. Returns the plan
/// that ran. Errors, before anything is launched: [`Error::InvalidArgument`] naming `m`, `x`,
/// `weight`, `bias` or `out`; a poisoned group's error; a group without symmetric memory.
pub fn all_gather_gemm<T: GemmElement + NcclType>(
    group: &TpGroup,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    bias: Option<&dyn DevicePtr<T>>,
    out: &mut impl DevicePtrMut<T>,
    shape: GemmShape,
) -> Result<FusedPlan> {
    let facts = facts_of(group);
    let stream = group.stream();
    let mut xi = BufferInfo::new(0, x.len(), owner(x));
    let mut wi = BufferInfo::new(0, weight.len(), owner(weight));
    let mut bi = bias.map(|b| BufferInfo::new(0, b.len(), owner(b)));
    let mut oi = BufferInfo::new(0, out.len(), owner(&*out));
    // Devices first, before any pointer is taken.
    for (name, b) in [
        ("x", Some(&xi)),
        ("weight", Some(&wi)),
        ("bias", bi.as_ref()),
        ("out", Some(&oi)),
    ] {
        if let Some(b) = b {
            b.check_device(name, facts.device)?;
        }
    }
    if shape.m == 0 {
        return plan_all_gather_gemm::<T>(&xi, &wi, bi.as_ref(), &oi, shape, &facts);
    }
    let (x_ptr, _x) = x.device_ptr(stream);
    let (w_ptr, _w) = weight.device_ptr(stream);
    let bias_ptr = bias.map(|b| b.device_ptr(stream));
    let (out_ptr, _out) = out.device_ptr_mut(stream);
    (xi.addr, wi.addr, oi.addr) = (x_ptr, w_ptr, out_ptr);
    if let (Some(info), Some((ptr, _))) = (bi.as_mut(), bias_ptr.as_ref()) {
        info.addr = *ptr;
    }
    let plan = plan_all_gather_gemm::<T>(&xi, &wi, bi.as_ref(), &oi, shape, &facts)?;
    let (peers, args) = group.kernel_args()?;
    bind(stream)?;
    // SAFETY: `plan_all_gather_gemm` checked every length against m, n, k and the world, the
    // devices, the alignment and the capacity, and that out overlaps no input; the symmetric
    // workspace lives as long as `group`; the guards keep cudarc's stream ordering until the
    // kernel is enqueued.
    let code = unsafe {
        kernels::tpfuse_all_gather_gemm(
            T::DTYPE,
            plan.config.abi(),
            &peers,
            &args,
            i32::try_from(plan.grid).unwrap_or(i32::MAX),
            x_ptr as *const c_void,
            w_ptr as *const c_void,
            bi.map_or(std::ptr::null(), |b| b.addr as *const c_void),
            out_ptr as *mut c_void,
            shape.m,
            shape.n,
            shape.k,
            stream.cu_stream() as *mut c_void,
        )
    };
    group.launched("tpfuse_all_gather_gemm", code)?;
    Ok(plan)
}
