//! All-gather and reduce-scatter over a [`TpGroup`]: the custom kernels on symmetric
//! memory (always for virtual ranks), NCCL when the message exceeds the group's capacity
//! or the topology refuses the custom kernels.

use crate::device::bind;
use crate::dtype::{Element, NcclType};
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::group::TpGroup;
use crate::validate::{check_disjoint, owner, BufferInfo};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// Whether the custom kernels serve a message of `bytes` staged bytes on `group`.
fn use_custom(group: &TpGroup, bytes: usize) -> Result<bool> {
    let allowed = group.is_virtual() || group.verdict().map_or(true, |v| v.custom_all_reduce());
    match (allowed && bytes <= group.capacity(), group.comm().is_some()) {
        (true, _) => Ok(true),
        (false, true) => Ok(false),
        (false, false) => Err(Error::invalid(
            "input",
            format!(
                "{bytes} bytes exceed the group's capacity of {} bytes and there is no NCCL \
                 communicator to fall back on",
                group.capacity()
            ),
        )),
    }
}

fn check_common<T: Element>(
    group: &TpGroup,
    input: (&str, usize, usize, u64),
    out: (&str, usize, usize, u64),
) -> Result<()> {
    let device = group.device();
    let info = |(_, len, dev, addr): (&str, usize, usize, u64)| BufferInfo::new(addr, len, dev);
    for b in [input, out] {
        info(b).check_device(b.0, device)?;
        info(b).check_aligned16(b.0)?;
    }
    check_disjoint::<T>(input.0, &info(input), out.0, &info(out))
}

/// `out[r * n .. (r + 1) * n] = input` of rank r, n = `input.len()`; `out` holds
/// `world * n` elements. The staged bytes (n elements) must be a multiple of 16.
pub fn all_gather<T: Element + NcclType>(
    group: &TpGroup,
    input: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let n = input.len();
    let custom = check_all_gather::<T>(group, (n, owner(input)), (out.len(), owner(&*out)))?;
    if n == 0 {
        return Ok(());
    }
    if !custom {
        let comm = group
            .comm()
            .ok_or_else(|| Error::invalid("group", "no communicator"))?;
        return comm.all_gather(input, out);
    }
    let bytes = n * std::mem::size_of::<T>();
    // SAFETY (closure): lengths, devices and capacity checked above, alignment and aliasing
    // by launch_custom.
    launch_custom(
        group,
        input,
        out,
        "tpfuse_all_gather",
        |peers, args, ip, op, stream| unsafe {
            kernels::tpfuse_all_gather(peers, args, ip, op, bytes, stream)
        },
    )
}

/// What [`all_gather`] checks of an `input` (length, device) and an `out` before it launches
/// (lengths, devices, capacity, and for tpfuse's kernel a usable, unpoisoned group), for a
/// layer that must refuse before launching its own work; whether tpfuse's kernel runs (else
/// NCCL). Alignment and aliasing are checked at the launch.
pub(crate) fn check_all_gather<T: Element>(
    group: &TpGroup,
    (n, in_dev): (usize, usize),
    (out_len, out_dev): (usize, usize),
) -> Result<bool> {
    let world = group.world();
    if out_len != n * world {
        return Err(Error::invalid(
            "out",
            format!("holds {out_len} elements, must hold world ({world}) x {n}"),
        ));
    }
    let bytes = n * std::mem::size_of::<T>();
    if bytes % 16 != 0 {
        return Err(Error::invalid(
            "input",
            format!("{bytes} bytes is not a multiple of 16"),
        ));
    }
    BufferInfo::new(0, n, in_dev).check_device("input", group.device())?;
    BufferInfo::new(0, out_len, out_dev).check_device("out", group.device())?;
    if n == 0 {
        return Ok(true);
    }
    custom_ready(group, bytes)
}

/// [`use_custom`], and when tpfuse's kernel is to run, a group that can launch it (usable,
/// unpoisoned): the last of the checks before a layer launches its own work.
fn custom_ready(group: &TpGroup, bytes: usize) -> Result<bool> {
    let custom = use_custom(group, bytes)?;
    if custom {
        group.kernel_args()?;
    }
    Ok(custom)
}

/// `out = (sum over ranks of input)[rank * n .. (rank + 1) * n]`, n = `out.len()`; `input`
/// holds `world * n` elements (rank order sum in f32, as the all-reduce).
pub fn reduce_scatter<T: Element + NcclType>(
    group: &TpGroup,
    input: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let n = out.len();
    let custom = check_reduce_scatter::<T>(group, (input.len(), owner(input)), (n, owner(&*out)))?;
    if n == 0 {
        return Ok(());
    }
    if !custom {
        let comm = group
            .comm()
            .ok_or_else(|| Error::invalid("group", "no communicator"))?;
        return comm.reduce_scatter(input, out, crate::comm::ReduceOp::Sum);
    }
    // SAFETY (closure): lengths, devices and capacity checked above, alignment and aliasing
    // by launch_custom.
    launch_custom(
        group,
        input,
        out,
        "tpfuse_reduce_scatter",
        |peers, args, ip, op, stream| unsafe {
            kernels::tpfuse_reduce_scatter(T::DTYPE, peers, args, ip, op, n, stream)
        },
    )
}

/// What [`reduce_scatter`] checks of an `input` (length, device) and an `out` (`n` elements
/// per rank) before it launches (lengths, devices, capacity, and for tpfuse's kernel a usable,
/// unpoisoned group), for a layer that must refuse before launching its own work; whether
/// tpfuse's kernel runs (else NCCL). Alignment and aliasing are checked at the launch.
pub(crate) fn check_reduce_scatter<T: Element>(
    group: &TpGroup,
    (in_len, in_dev): (usize, usize),
    (n, out_dev): (usize, usize),
) -> Result<bool> {
    let world = group.world();
    if in_len != n * world {
        return Err(Error::invalid(
            "input",
            format!("holds {in_len} elements, must hold world ({world}) x {n}"),
        ));
    }
    BufferInfo::new(0, in_len, in_dev).check_device("input", group.device())?;
    BufferInfo::new(0, n, out_dev).check_device("out", group.device())?;
    if n == 0 {
        return Ok(true);
    }
    let vec = 16 / std::mem::size_of::<T>();
    if n % vec != 0 {
        return Err(Error::invalid(
            "out",
            format!("{n} elements per rank is not a multiple of {vec} (16 bytes)"),
        ));
    }
    custom_ready(group, in_len * std::mem::size_of::<T>())
}

/// Takes the buffers' pointers (ordering them on the group's stream), checks alignment and
/// aliasing, and launches `launch` with the group's kernel arguments on its stream.
fn launch_custom<T: Element>(
    group: &TpGroup,
    input: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
    kernel: &'static str,
    launch: impl FnOnce(
        &kernels::tpfuse_peers,
        &kernels::tpfuse_group_args,
        *const c_void,
        *mut c_void,
        *mut c_void,
    ) -> i32,
) -> Result<()> {
    let stream = group.stream();
    let (in_len, in_dev) = (input.len(), owner(input));
    let (out_len, out_dev) = (out.len(), owner(&*out));
    let (ip, _g1) = input.device_ptr(stream);
    let (op, _g2) = out.device_ptr_mut(stream);
    check_common::<T>(
        group,
        ("input", in_len, in_dev, ip),
        ("out", out_len, out_dev, op),
    )?;
    let (peers, args) = group.kernel_args()?;
    bind(stream)?;
    let code = launch(
        &peers,
        &args,
        ip as *const c_void,
        op as *mut c_void,
        stream.cu_stream() as *mut c_void,
    );
    group.launched(kernel, code)
}
