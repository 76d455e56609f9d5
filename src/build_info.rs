//! Facts about this build: the CUDA architectures compiled, the toolchain, and the ptxas
//! resource report of every kernel (registers, spills, stack, shared memory).

/// The architectures the kernels were compiled for, e.g. `["sm_80", ..., "compute_80"]`
/// (`compute_*` entries are PTX, JIT-compiled by the driver for GPUs not listed).
pub fn architectures() -> Vec<&'static str> {
    env!("TPFUSE_BUILD_ARCHS").split(',').collect()
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

/// The distinct kernel names, sorted.
pub fn kernels() -> Vec<String> {
    let mut names: Vec<String> = kernel_resources().into_iter().map(|k| k.kernel).collect();
    names.sort();
    names.dedup();
    names
}

/// The CUDA runtime version the kernels were built against, as (major, minor).
pub fn cudart_version() -> (u32, u32) {
    // SAFETY: returns a compile-time constant; needs no GPU.
    let v = unsafe { crate::ffi::kernels::tpfuse_cudart_version() }.max(0) as u32;
    (v / 1000, (v % 1000) / 10)
}
