//! `reduce_ranks`: the element-wise, rank-ordered sum every all-reduce builds on.

use crate::device::cuda;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::validate::{check_disjoint, owner, BufferInfo};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

/// The most input buffers one call takes.
pub const MAX_REDUCE_INPUTS: usize = kernels::TPFUSE_MAX_REDUCE_INPUTS as usize;

/// `out[i] = inputs[0][i] + inputs[1][i] + ... + inputs[W-1][i]`, enqueued on `stream`.
///
/// Shapes: W = `inputs.len()` buffers (1 ..= [`MAX_REDUCE_INPUTS`]) of `n` elements each and
/// `out` of `n` elements, all on `stream`'s device. The sum is accumulated in f32 strictly
/// in input order and rounded once to `T` (round to nearest even), so the result does not
/// depend on the launch shape, the alignment or the caller: the same inputs give the same
/// bits. Any `n` works (`n = 0` enqueues nothing); 16-byte aligned buffers take the
/// vectorised path.
///
/// Errors, before anything is launched: no inputs or too many, a length that differs from
/// `out`'s, a buffer on another device, or `out` overlapping an input.
pub fn reduce_ranks<T: Element, I: DevicePtr<T>>(
    stream: &CudaStream,
    inputs: &[&I],
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let device = stream.context().ordinal();
    // Count, devices and lengths first, before any pointer is taken: taking the pointer of a
    // buffer on another device would order that device's events on this stream.
    let mut infos: Vec<BufferInfo> = inputs
        .iter()
        .map(|input| BufferInfo::new(0, input.len(), owner(*input)))
        .collect();
    let mut out_info = BufferInfo::new(0, out.len(), owner(&*out));
    check_shapes(&infos, &out_info, device)?;
    if out_info.len == 0 {
        return Ok(());
    }
    let mut guards = Vec::with_capacity(inputs.len());
    let mut ptrs = Vec::with_capacity(inputs.len());
    for (input, info) in inputs.iter().zip(&mut infos) {
        let (ptr, guard) = input.device_ptr(stream);
        info.addr = ptr;
        ptrs.push(ptr as *const std::ffi::c_void);
        guards.push(guard);
    }
    let (out_ptr, _out_guard) = out.device_ptr_mut(stream);
    out_info.addr = out_ptr;
    check_overlaps::<T>(&infos, &out_info)?;
    stream
        .context()
        .bind_to_thread()
        .map_err(cuda("binding the context"))?;
    // SAFETY: validated above: 1..=16 inputs of `len` elements of T, `out` of `len` elements,
    // all on this stream's device, `out` disjoint from the inputs; the guards keep cudarc's
    // stream ordering until the kernel is enqueued.
    let code = unsafe {
        kernels::tpfuse_reduce_ranks(
            T::DTYPE,
            ptrs.as_ptr(),
            ptrs.len() as i32,
            out_ptr as *mut std::ffi::c_void,
            out_info.len,
            stream.cu_stream() as *mut std::ffi::c_void,
        )
    };
    crate::validate::launched("tpfuse_reduce_ranks", code)
}

/// The checks of [`reduce_ranks`], on buffer descriptions (so they run without a GPU).
pub fn check_reduce_ranks<T: Element>(
    inputs: &[BufferInfo],
    out: &BufferInfo,
    device: usize,
) -> Result<()> {
    check_shapes(inputs, out, device)?;
    check_overlaps::<T>(inputs, out)
}

/// The number of inputs, their devices and lengths.
fn check_shapes(inputs: &[BufferInfo], out: &BufferInfo, device: usize) -> Result<()> {
    if inputs.is_empty() || inputs.len() > MAX_REDUCE_INPUTS {
        return Err(Error::invalid(
            "inputs",
            format!(
                "{} buffers given, reduce_ranks takes 1 to {MAX_REDUCE_INPUTS}",
                inputs.len()
            ),
        ));
    }
    out.check_device("out", device)?;
    for (r, input) in inputs.iter().enumerate() {
        let name = format!("inputs[{r}]");
        input.check_device(&name, device)?;
        if input.len != out.len {
            return Err(Error::invalid(
                name,
                format!("holds {} elements but out holds {}", input.len, out.len),
            ));
        }
    }
    Ok(())
}

/// `out` shares no byte with any input.
fn check_overlaps<T: Element>(inputs: &[BufferInfo], out: &BufferInfo) -> Result<()> {
    for (r, input) in inputs.iter().enumerate() {
        check_disjoint::<T>(&format!("inputs[{r}]"), input, "out", out)?;
    }
    Ok(())
}
