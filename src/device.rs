//! The CUDA driver, guarded: cudarc panics when libcuda is missing, tpfuse returns
//! [`Error::NoCudaDriver`] instead.

use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaContext};
use std::sync::Arc;

/// Whether `libcuda.so` can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library; nothing is called.
    unsafe { sys::is_culib_present() }
}

/// Returns [`Error::NoCudaDriver`] unless the driver library loads.
pub fn require_driver() -> Result<()> {
    if driver_present() {
        Ok(())
    } else {
        Err(Error::NoCudaDriver)
    }
}

/// Wraps a cudarc driver error with what tpfuse was doing.
pub(crate) fn cuda(context: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |source| Error::Cuda { context, source }
}

/// The CUDA driver version as (major, minor), e.g. (13, 0).
pub fn driver_version() -> Result<(u32, u32)> {
    require_driver()?;
    let mut v = 0i32;
    // SAFETY: the driver is present; cuDriverGetVersion writes one int and needs no init.
    let code = unsafe { sys::cuDriverGetVersion(&mut v) };
    code.result().map_err(cuda("cuDriverGetVersion"))?;
    Ok(((v / 1000) as u32, ((v % 1000) / 10) as u32))
}

/// How many CUDA devices the driver sees (honours `CUDA_VISIBLE_DEVICES`).
pub fn device_count() -> Result<usize> {
    require_driver()?;
    let n = CudaContext::device_count().map_err(cuda("counting devices"))?;
    Ok(n.max(0) as usize)
}

/// The primary context of device `ordinal`, as cudarc gives it.
pub fn open(ordinal: usize) -> Result<Arc<CudaContext>> {
    require_driver()?;
    CudaContext::new(ordinal).map_err(cuda("opening the device"))
}
