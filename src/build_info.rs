//! Facts about this build: the CUDA architectures compiled, the toolchain, and the ptxas
//! resource report of every kernel (registers, spills, stack, shared memory).

/// The architectures the kernels were compiled for, e.g. `["sm_80", ..., "compute_80"]`
/// (`compute_*` entries are PTX, JIT-compiled by the driver for GPUs not listed); none for
/// the emulator ([`EMULATED`]).
pub fn architectures() -> Vec<&'static str> {
    env!("TPFUSE_BUILD_ARCHS")
        .split(',')
        .filter(|a| !a.is_empty())
        .collect()
}

/// The nvcc that compiled the kernels.
pub const NVCC: &str = env!("TPFUSE_BUILD_NVCC");
/// Its release, e.g. "13.0".
pub const NVCC_RELEASE: &str = env!("TPFUSE_BUILD_NVCC_VERSION");
/// The nccl.h the bindings were generated from.
pub const NCCL_HEADER: &str = env!("TPFUSE_BUILD_NCCL_HEADER");

const PTXAS_REPORT: &str = include_str!(concat!(env!("OUT_DIR"), "/ptxas_report.tsv"));

/// One kernel on one architecture, as ptxas reported it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KernelResources {
    /// e.g. "sm_90a".
    pub arch: String,
    /// Demangled kernel name, e.g. `tpfuse::reduce_ranks_kernel<float>`.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of register spill stores.
    pub spill_stores: u32,
    /// Bytes of register spill loads.
    pub spill_loads: u32,
    /// Bytes of stack frame per thread.
    pub stack: u32,
    /// Bytes of static shared memory per block.
    pub shared: u32,
    /// The .cu file.
    pub source: String,
}

impl KernelResources {
    /// Whether ptxas spilled registers for this kernel.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// The ptxas report of every kernel on every compiled (non-PTX) architecture.
pub fn kernel_resources() -> Vec<KernelResources> {
    PTXAS_REPORT
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split('\t').collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse().ok()).unwrap_or(0);
            (f.len() == 8).then(|| KernelResources {
                arch: f[0].to_string(),
                kernel: f[1].to_string(),
                registers: num(2),
                spill_stores: num(3),
                spill_loads: num(4),
                stack: num(5),
                shared: num(6),
                source: f[7].to_string(),
            })
        })
        .collect()
}

/// How many kernels (instantiations) this build holds: the ones
/// [`device::load_kernels`](crate::device::load_kernels) loads.
pub fn kernel_count() -> usize {
    // SAFETY: no arguments; counts a static list.
    unsafe { crate::ffi::kernels::tpfuse_kernel_count() }.max(0) as usize
}

/// The distinct kernel names, sorted.
pub fn kernels() -> Vec<String> {
    let mut names: Vec<String> = kernel_resources().into_iter().map(|k| k.kernel).collect();
    names.sort();
    names.dedup();
    names
}

/// Whether this build runs its kernels on the crate's CPU emulator (cargo feature `emulator`):
/// then no GPU code was compiled, [`architectures`] and [`kernel_resources`] are empty, and
/// the "CUDA driver" is the emulator (docs/emulator.md).
pub const EMULATED: bool = cfg!(feature = "emulator");

/// The oldest CUDA driver this build's kernels launch on, as the driver's CUDA version
/// (major, 0), with the Linux driver branch that first provides it: the CUDA runtime the
/// kernels link statically works on any driver of its major version or newer (NVIDIA's minor
/// version compatibility: CUDA 13.x needs R580 or newer, 12.x R525 or newer). `None` for the
/// emulator, which is its own driver.
///
/// Within the major version, a driver older than the runtime's minor version runs the
/// compiled architectures but cannot JIT the build's PTX (`compute_*`) for other GPUs.
pub fn minimum_driver() -> Option<((u32, u32), &'static str)> {
    if EMULATED {
        return None;
    }
    let (major, _) = cudart_version();
    let branch = match major {
        13 => "R580",
        12 => "R525",
        _ => "the driver of that CUDA release",
    };
    Some(((major, 0), branch))
}

/// The CUDA runtime version the kernels were built against, as (major, minor).
pub fn cudart_version() -> (u32, u32) {
    // SAFETY: returns a compile-time constant; needs no GPU.
    let v = unsafe { crate::ffi::kernels::tpfuse_cudart_version() }.max(0) as u32;
    (v / 1000, (v % 1000) / 10)
}

/// How the kernels' floating point was compiled, run on `stream`'s device: `(a * b + c, fmaf(a,
/// b, c))` for one `a, b, c` whose product-plus-addend differs when rounded once or twice. The
/// kernels contract no multiply and add that they write apart (nvcc `--fmad=false`; the
/// emulator's `-ffp-contract=off`), so the first is the twice-rounded 0.0 and the second the
/// fused 2^-24: the bits the host references and the emulator compute.
pub fn fp_contraction(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
) -> crate::Result<(f32, f32)> {
    let error = |context| move |e| crate::Error::Cuda { context, source: e };
    // a = b = 1 + 2^-12, c = -(1 + 2^-11): a·b = 1 + 2^-11 + 2^-24 exactly, which rounds (to
    // even) to 1 + 2^-11, so a·b + c is 0 rounded twice and 2^-24 fused.
    let a = 1.0 + 2f32.powi(-12);
    let abc = stream
        .clone_htod(&[a, a, -(1.0 + 2f32.powi(-11))])
        .map_err(error("copying the contraction probe's inputs"))?;
    let mut out = stream
        .alloc_zeros::<f32>(2)
        .map_err(error("allocating the contraction probe's output"))?;
    {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (abc_ptr, _g1) = abc.device_ptr(stream);
        let (out_ptr, _g2) = out.device_ptr_mut(stream);
        crate::device::bind(stream)?;
        // SAFETY: abc holds 3 floats and out 2, on this stream's device; the guards keep
        // cudarc's stream order until the kernel is enqueued.
        let code = unsafe {
            crate::ffi::kernels::tpfuse_fp_contraction_probe(
                abc_ptr as *const f32,
                out_ptr as *mut f32,
                stream.cu_stream() as *mut std::ffi::c_void,
            )
        };
        crate::validate::launched("tpfuse_fp_contraction_probe", code)?;
    }
    let host = stream
        .clone_dtoh(&out)
        .map_err(error("copying the contraction probe's output"))?;
    Ok((host[0], host[1]))
}
