//! What every op checks before it launches, on plain descriptions of device buffers.

use crate::dtype::Element;
use crate::error::{Error, Result};
use cudarc::driver::DeviceSlice;

/// A device buffer as the checks see it: where it starts, how many elements it holds,
/// and which device it lives on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferInfo {
    /// Device address of the first element.
    pub addr: u64,
    /// Length in elements.
    pub len: usize,
    /// The CUDA ordinal of the device that owns it.
    pub device: usize,
}

impl BufferInfo {
    /// A description from its parts.
    pub fn new(addr: u64, len: usize, device: usize) -> BufferInfo {
        BufferInfo { addr, len, device }
    }

    /// Errors unless the buffer lives on `device`.
    pub fn check_device(&self, name: &str, device: usize) -> Result<()> {
        if self.device != device {
            return Err(Error::invalid(
                name,
                format!(
                    "lives on device {} but the stream is on device {device}",
                    self.device
                ),
            ));
        }
        Ok(())
    }
}

impl BufferInfo {
    /// Errors unless the buffer starts on a 16-byte boundary (the kernels move 16-byte
    /// vectors).
    pub fn check_aligned16(&self, name: &str) -> Result<()> {
        if self.addr % 16 != 0 {
            return Err(Error::invalid(
                name,
                format!(
                    "device address {:#x} is not 16-byte aligned (the kernels move 16-byte vectors)",
                    self.addr
                ),
            ));
        }
        Ok(())
    }

    /// Whether two non-empty buffers of `T` on one device share a byte.
    pub fn overlaps<T>(&self, other: &BufferInfo) -> bool {
        let size = std::mem::size_of::<T>() as u64;
        let (a0, a1) = (self.addr, self.addr + self.len as u64 * size);
        let (b0, b1) = (other.addr, other.addr + other.len as u64 * size);
        self.len > 0 && other.len > 0 && self.device == other.device && a0 < b1 && b0 < a1
    }
}

/// The CUDA ordinal of the device a cudarc buffer lives on.
pub(crate) fn owner<T>(buf: &(impl DeviceSlice<T> + ?Sized)) -> usize {
    buf.stream().context().ordinal()
}

/// Errors when the byte ranges of `a` and `b` overlap.
pub fn check_disjoint<T: Element>(
    a_name: &str,
    a: &BufferInfo,
    b_name: &str,
    b: &BufferInfo,
) -> Result<()> {
    if a.overlaps::<T>(b) {
        return Err(Error::invalid(
            b_name,
            format!("overlaps {a_name}; this op is not in-place"),
        ));
    }
    Ok(())
}

/// Turns a launcher's `cudaError_t` into `Ok` or [`Error::KernelLaunch`].
pub(crate) fn launched(kernel: &'static str, code: i32) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: returns a static string for any code.
    let message =
        unsafe { std::ffi::CStr::from_ptr(crate::ffi::kernels::tpfuse_error_string(code)) };
    Err(Error::KernelLaunch {
        kernel,
        code,
        message: message.to_string_lossy().into_owned(),
    })
}
