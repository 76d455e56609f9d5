//! The CUDA driver, guarded: cudarc panics when libcuda is missing, tpfuse returns
//! [`Error::NoCudaDriver`] instead.

use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaContext, CudaStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether the CUDA driver library can be loaded in this process.
///
/// Asked of the dynamic loader, not of cudarc: cudarc's own check exists only when it loads
/// the driver at run time, and an engine may link it instead (cudarc's `dynamic-linking`, as
/// candle does). A library already in the process (linked, or the emulator's) answers first:
/// `libcuda.so` is the name it is linked by, `libcuda.so.1` the driver's file.
pub fn driver_present() -> bool {
    ["libcuda.so", "libcuda.so.1"].iter().any(|name| {
        // SAFETY: loading the driver library runs its initialisers, which have no
        // preconditions; nothing is called, and the handle is closed again.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
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

/// Loads every tpfuse kernel into `ctx` now, so that no later launch of one loads it.
///
/// Since CUDA 12.2 a kernel is loaded into a context when it is first used, and that load may
/// wait for every kernel running in the context (CUDA's lazy loading). A rank's collective
/// kernel waits for its peers' kernels; when one host thread enqueues the ranks one after
/// another ([`TpGroup::virtual_ranks`](crate::TpGroup::virtual_ranks), or one process driving
/// several GPUs), a first use on rank 0's context between rank 0's collective and rank 1's
/// (an unfused epilogue, a GEMM) waits until rank 0's kernel fails at its deadline. Every
/// group constructor calls this for each rank's context. An engine that launches kernels of
/// its own between two ranks' launches should load those too (`CUDA_MODULE_LOADING=EAGER` in
/// the environment before CUDA starts does it for every module of the process).
///
/// Build every group before the first collective runs on its contexts: the loading itself may
/// wait for what runs there.
///
/// Returns the number of kernels in the build's list ([`crate::build_info::kernel_count`]),
/// every one of them loaded now or before; 0 on a driver older than CUDA 12.4, which has no
/// `cuFuncLoad` (there the hazard stays).
pub fn load_kernels(ctx: &Arc<CudaContext>) -> Result<usize> {
    if driver_version()? < (12, 4) {
        return Ok(0);
    }
    ctx.bind_to_thread().map_err(cuda("binding the context"))?;
    let count = crate::build_info::kernel_count();
    let mut functions = vec![std::ptr::null_mut::<std::ffi::c_void>(); count];
    // SAFETY: `functions` holds `count` pointers; the context is current on this thread.
    let code = unsafe {
        crate::ffi::kernels::tpfuse_kernel_functions(functions.as_mut_ptr(), count as i32)
    };
    crate::validate::launched("tpfuse_kernel_functions", code)?;
    for f in functions {
        // SAFETY: `f` is a handle cudaGetFuncBySymbol returned for the current context.
        unsafe { sys::cuFuncLoad(f.cast()) }
            .result()
            .map_err(cuda("loading a kernel (cuFuncLoad)"))?;
    }
    Ok(count)
}

/// Errors when `stream` is one of CUDA's special handles (the legacy default stream, null or
/// `CU_STREAM_LEGACY`, or `CU_STREAM_PER_THREAD`), which cannot carry a rank: the legacy
/// stream waits for every other blocking stream of the context (virtual ranks would wait for
/// each other until the deadline), and the per-thread handle means another stream on every
/// thread (a group shared between threads would lose its order).
pub(crate) fn check_rank_stream(arg: &str, stream: &CudaStream) -> Result<()> {
    let handle = stream.cu_stream() as usize;
    let name = match handle {
        0 => "the legacy default stream (null)",
        1 => "the legacy default stream (CU_STREAM_LEGACY)",
        2 => "the per-thread default stream (CU_STREAM_PER_THREAD)",
        _ => return Ok(()),
    };
    Err(Error::invalid(
        arg,
        format!(
            "{name} cannot carry a rank: give a stream the engine created (cuStreamCreate, \
             CudaContext::new_stream)"
        ),
    ))
}

/// Makes the context of `stream` current on this thread (the launchers use the runtime API,
/// which works on the current context).
pub(crate) fn bind(stream: &CudaStream) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(cuda("binding the context"))
}

/// Polls `stream` (cuStreamQuery, then short sleeps) until it is idle (`Ok(true)`) or
/// `bound` has passed (`Ok(false)`), calling `between` after every query that found work
/// still running (its error ends the wait). A CUDA error of the stream is returned as
/// [`Error::Cuda`] with `context`. Never an unbounded synchronize.
pub(crate) fn poll_stream(
    stream: &CudaStream,
    bound: Duration,
    context: &'static str,
    mut between: impl FnMut() -> Result<()>,
) -> Result<bool> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(5);
    loop {
        // SAFETY: queries a live stream.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS => return Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => {}
            other => {
                return Err(Error::Cuda {
                    context,
                    source: cudarc::driver::DriverError(other),
                })
            }
        }
        between()?;
        if start.elapsed() >= bound {
            return Ok(false);
        }
        if pause < Duration::from_micros(50) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(pause);
        }
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}
