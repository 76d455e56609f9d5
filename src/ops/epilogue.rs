//! The epilogue of a row-parallel layer as standalone kernels: the unfused baseline that
//! the fused all-reduce is measured against, with the same arithmetic (same bits).

use crate::device::bind;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::validate::{check_disjoint, launched, owner, BufferInfo};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// `out = x * rsqrt(mean(x^2) + eps) * gamma` per row. Shapes: `x`, `out` `[rows, hidden]`,
/// `gamma` `[hidden]`, with `hidden` a multiple of 16 bytes (8 f16/bf16, 4 f32) and every
/// buffer 16-byte aligned (the kernel moves 16-byte vectors). `x` and `out` are separate
/// buffers (for in place, use [`rms_norm_in_place`]).
pub fn rms_norm<T: Element>(
    stream: &CudaStream,
    x: &impl DevicePtr<T>,
    gamma: &impl DevicePtr<T>,
    eps: f32,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let device = check_rms(stream, x.len(), owner(x), gamma, eps)?;
    check_out(device, x.len(), out.len(), owner(&*out))?;
    let (xp, _g1) = x.device_ptr(stream);
    let (gp, _g2) = gamma.device_ptr(stream);
    let (op, _g3) = out.device_ptr_mut(stream);
    let span = |p, len| BufferInfo::new(p, len, device);
    span(xp, x.len()).check_aligned16("x")?;
    span(gp, gamma.len()).check_aligned16("gamma")?;
    span(op, x.len()).check_aligned16("out")?;
    check_disjoint::<T>("x", &span(xp, x.len()), "out", &span(op, x.len()))?;
    check_disjoint::<T>("gamma", &span(gp, gamma.len()), "out", &span(op, x.len()))?;
    launch_rms::<T>(stream, xp, gp, eps, op, x.len(), gamma.len())
}

/// [`rms_norm`] in place on `x`.
pub fn rms_norm_in_place<T: Element>(
    stream: &CudaStream,
    x: &mut impl DevicePtrMut<T>,
    gamma: &impl DevicePtr<T>,
    eps: f32,
) -> Result<()> {
    let device = check_rms(stream, x.len(), owner(&*x), gamma, eps)?;
    let len = x.len();
    let (gp, _g2) = gamma.device_ptr(stream);
    let (xp, _g1) = x.device_ptr_mut(stream);
    BufferInfo::new(xp, len, device).check_aligned16("x")?;
    BufferInfo::new(gp, gamma.len(), device).check_aligned16("gamma")?;
    launch_rms::<T>(stream, xp, gp, eps, xp, len, gamma.len())
}

/// `h = x (+ bias) + residual`, `residual := h`, `out := h`, in f32 rounded once. Shapes:
/// `x`, `residual`, `out` `[rows, hidden]`, `bias` `[hidden]`.
pub fn add_bias_residual<T: Element>(
    stream: &CudaStream,
    x: &impl DevicePtr<T>,
    bias: Option<&dyn DevicePtr<T>>,
    residual: &mut impl DevicePtrMut<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let device = stream.context().ordinal();
    let n = x.len();
    let hidden = bias.map_or(n, |b| b.len());
    if let Some(b) = bias {
        check(device, "x", n, owner(x), b.len(), owner(b), 0.0)?;
    } else if owner(x) != device {
        return Err(Error::invalid(
            "x",
            "lives on another device than the stream",
        ));
    }
    check_out(device, n, out.len(), owner(&*out))?;
    if residual.len() != n || owner(&*residual) != device {
        return Err(Error::invalid(
            "residual",
            format!("must hold {n} elements on device {device}"),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let (xp, _g1) = x.device_ptr(stream);
    let bp = bias.map(|b| b.device_ptr(stream));
    let (rp, _g3) = residual.device_ptr_mut(stream);
    let (op, _g4) = out.device_ptr_mut(stream);
    bind(stream)?;
    // SAFETY: lengths and devices checked above; element-wise.
    let code = unsafe {
        kernels::tpfuse_bias_residual(
            T::DTYPE,
            xp as *const c_void,
            bp.as_ref()
                .map_or(std::ptr::null(), |(p, _)| *p as *const c_void),
            rp as *mut c_void,
            op as *mut c_void,
            n / hidden.max(1),
            hidden.max(1),
            stream.cu_stream() as *mut c_void,
        )
    };
    launched("tpfuse_bias_residual", code)
}

/// The checks of both RMSNorm entry points: `x` (`x_len` elements on device `x_device`) and
/// `gamma` on `stream`'s device, `x` whole rows of `gamma`, rows of whole 16-byte vectors,
/// `eps`. Returns the device.
fn check_rms<T: Element>(
    stream: &CudaStream,
    x_len: usize,
    x_device: usize,
    gamma: &impl DevicePtr<T>,
    eps: f32,
) -> Result<usize> {
    let device = stream.context().ordinal();
    check(device, "x", x_len, x_device, gamma.len(), owner(gamma), eps)?;
    let per_vector = 16 / std::mem::size_of::<T>();
    if gamma.len() % per_vector != 0 {
        return Err(Error::invalid(
            "gamma",
            format!(
                "hidden = {} {} elements is not a multiple of {per_vector} (16 bytes): the \
                 kernel moves 16-byte vectors",
                gamma.len(),
                T::NAME
            ),
        ));
    }
    Ok(device)
}

fn check(
    device: usize,
    x_name: &str,
    n: usize,
    x_device: usize,
    hidden: usize,
    row_device: usize,
    eps: f32,
) -> Result<()> {
    if x_device != device {
        return Err(Error::invalid(
            x_name,
            "lives on another device than the stream",
        ));
    }
    if row_device != device {
        return Err(Error::invalid(
            "gamma/bias",
            "lives on another device than the stream",
        ));
    }
    if hidden == 0 || n % hidden != 0 {
        return Err(Error::invalid(
            x_name,
            format!("{n} elements are not whole rows of {hidden}"),
        ));
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::invalid(
            "eps",
            format!("{eps} is not finite and non-negative"),
        ));
    }
    Ok(())
}

fn check_out(device: usize, n: usize, out_len: usize, out_device: usize) -> Result<()> {
    if out_len != n || out_device != device {
        return Err(Error::invalid(
            "out",
            format!("must hold {n} elements on device {device}, holds {out_len} on {out_device}"),
        ));
    }
    Ok(())
}

fn launch_rms<T: Element>(
    stream: &CudaStream,
    x: u64,
    gamma: u64,
    eps: f32,
    out: u64,
    n: usize,
    hidden: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    bind(stream)?;
    // SAFETY: checked by the callers: whole rows, same device, out of n elements.
    let code = unsafe {
        kernels::tpfuse_rms_norm(
            T::DTYPE,
            x as *const c_void,
            gamma as *const c_void,
            eps,
            out as *mut c_void,
            n / hidden,
            hidden,
            stream.cu_stream() as *mut c_void,
        )
    };
    launched("tpfuse_rms_norm", code)
}
