//! `reduce_ranks`: the element-wise, rank-ordered sum every all-reduce builds on.

use crate::device::bind;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::validate::{check_disjoint, owner, BufferInfo};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

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
    let count = inputs.len();
    check_count(count)?;
    // Devices and lengths next, before any pointer is taken: taking the pointer of a buffer
    // on another device would order that device's events on this stream. Fixed-size tables:
    // nothing is allocated on the launch path.
    let mut infos = [BufferInfo::new(0, 0, 0); MAX_REDUCE_INPUTS];
    for (info, input) in infos.iter_mut().zip(inputs) {
        *info = BufferInfo::new(0, input.len(), owner(*input));
    }
    let infos = &mut infos[..count];
    let mut out_info = BufferInfo::new(0, out.len(), owner(&*out));
    check_shapes(infos, &out_info, device)?;
    if out_info.len == 0 {
        return Ok(());
    }
    let mut guards: [Option<SyncOnDrop<'_>>; MAX_REDUCE_INPUTS] =
        [const { None }; MAX_REDUCE_INPUTS];
    let mut ptrs = [std::ptr::null::<std::ffi::c_void>(); MAX_REDUCE_INPUTS];
    for (r, input) in inputs.iter().enumerate() {
        let (ptr, guard) = input.device_ptr(stream);
        infos[r].addr = ptr;
        ptrs[r] = ptr as *const std::ffi::c_void;
        guards[r] = Some(guard);
    }
    let (out_ptr, _out_guard) = out.device_ptr_mut(stream);
    out_info.addr = out_ptr;
    check_overlaps::<T>(infos, &out_info)?;
    bind(stream)?;
    // SAFETY: validated above: 1..=16 inputs of `len` elements of T, `out` of `len` elements,
    // all on this stream's device, `out` disjoint from the inputs; the guards keep cudarc's
    // stream ordering until the kernel is enqueued.
    let code = unsafe {
        kernels::tpfuse_reduce_ranks(
            T::DTYPE,
            ptrs.as_ptr(),
            count as i32,
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

/// 1 ..= MAX_REDUCE_INPUTS inputs.
fn check_count(count: usize) -> Result<()> {
    if count == 0 || count > MAX_REDUCE_INPUTS {
        return Err(Error::invalid(
            "inputs",
            format!("{count} buffers given, reduce_ranks takes 1 to {MAX_REDUCE_INPUTS}"),
        ));
    }
    Ok(())
}

/// The number of inputs, their devices and lengths.
fn check_shapes(inputs: &[BufferInfo], out: &BufferInfo, device: usize) -> Result<()> {
    check_count(inputs.len())?;
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
