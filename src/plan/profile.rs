//! Device profiles: what the plan's model needs to know of a GPU, each figure with where it
//! comes from (`docs/performance.md` lists them).

/// How the GPUs of a group are joined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Link {
    /// NVLink through NVSwitches (every pair at full bandwidth): the custom kernels run.
    NvSwitch,
    /// PCIe only: the custom all-reduce runs for two ranks at most, NCCL beyond.
    Pcie,
}

/// What the plan's model needs of a GPU.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DeviceProfile {
    /// The name `tpfuse plan --device` takes, e.g. `"h100-sxm"`.
    pub name: String,
    /// Streaming multiprocessors.
    pub sms: usize,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
    /// The architecture whose ptxas report gives the kernels' registers, e.g. `"sm_90a"`.
    pub arch: &'static str,
    /// Peak DRAM bandwidth, bytes per second (the datasheet's).
    pub dram_bytes_per_s: f64,
    /// Peer bandwidth per direction per GPU, bytes per second.
    pub link_bytes_per_s: f64,
    /// How the GPUs are joined.
    pub link: Link,
    /// SM clock under load, Hz (the boost clock).
    pub clock_hz: f64,
    /// Shared memory per SM, bytes (what blocks can take together).
    pub smem_per_sm: usize,
    /// 32-bit registers per SM.
    pub registers_per_sm: usize,
    /// Resident threads per SM.
    pub threads_per_sm: usize,
    /// Resident blocks per SM.
    pub blocks_per_sm: usize,
    /// Latency of a global load that misses the caches, seconds (an idle GPU's: a pointer
    /// chase).
    pub dram_latency_s: f64,
    /// Latency of a weight load while the SMs stream weights together (the DRAM loaded),
    /// seconds: what a GEMM's loads in flight wait, fitted to measured GEMMs (a model
    /// parameter).
    pub streaming_latency_s: f64,
    /// Latency of a load from a peer GPU's memory, seconds.
    pub peer_latency_s: f64,
    /// Latency of one dependent `mma.sync.m16n8k16` (f32 accumulate), cycles.
    pub mma_latency_cycles: f64,
    /// Cost of one kernel launch on a busy stream, seconds (a model parameter).
    pub launch_s: f64,
    /// One cross-GPU synchronisation round (a flag stored with release, seen by a peer's
    /// acquire), seconds (a model parameter).
    pub round_s: f64,
    /// Where each figure comes from.
    pub sources: Vec<&'static str>,
}

/// The names [`DeviceProfile::builtin`] knows.
pub const BUILTIN_DEVICES: [&str; 5] = ["h100-sxm", "h200", "a100-sxm", "l40s", "b200"];

const KIB: usize = 1024;
const G: f64 = 1e9;
const T: f64 = 1e12;
const NS: f64 = 1e-9;
const US: f64 = 1e-6;

/// The model parameters no datasheet gives, shared by every profile.
const LAUNCH: &str = "launch_s 2 µs: assumed; round_s 1.4 µs: fitted, SGLang's custom \
                      all-reduce of 512 B on H100 (3.7/4.8/5.9 µs at TP 2/4/8, mean 4.8) less one \
                      launch, over its 2 rounds (docs/performance.md)";

/// The H100 / H200 idle DRAM latency (a pointer chase) and the loaded latency fitted on the
/// H200 (`STREAMING`), seconds.
const IDLE_LATENCY_S: f64 = 420.0 * NS;
const LOADED_LATENCY_S: f64 = 1.8 * US;

/// The loaded latency: the value of `streaming_latency_s` that puts the model's streaming
/// term on tpfuse's GEMMs measured on an H200 (docs/performance.md).
const STREAMING: &str = "streaming_latency 1.8 µs: fitted to tpfuse's GEMMs on an H200 \
     (docs/gpu-runs/2026-11-26-*: Llama-3-70B TP-8 qkv at m = 1 and 64, gate_up at m = 64, \
     less one launch, each over its busiest SM's bytes per byte in flight: 1.5-1.9 µs), \
     4.3x the idle pointer chase; other GPUs: 4.3x their dram_latency, unverified";

/// The latencies, where each profile's list does not say otherwise.
const LATENCIES: &str = "dram_latency 420 ns: about 834 cycles at 1.98 GHz, the H100 pointer \
     chase of caps-tum/mt4g (700 cycles in markdewing/AI_kernels); peer_latency 1.2 µs: an \
     estimate, the 8xH100 p2pBandwidthLatencyTest NVLink write (2.7-2.9 µs) less the same \
     GPU's (2.0-2.3 µs) plus the DRAM latency; mma 33 cycles: unverified (35 measured for \
     HMMA.16816.F32 on sm_120, florianmattana/sass-king #28)";

impl DeviceProfile {
    /// A built-in profile by name ([`BUILTIN_DEVICES`]).
    pub fn builtin(name: &str) -> Option<DeviceProfile> {
        let base = |sms, cc, arch, dram, link_bytes, link, clock_mhz: f64| DeviceProfile {
            name: name.to_string(),
            sms,
            compute_capability: cc,
            arch,
            dram_bytes_per_s: dram,
            link_bytes_per_s: link_bytes,
            link,
            clock_hz: clock_mhz * 1e6,
            smem_per_sm: 228 * KIB,
            registers_per_sm: 65536,
            threads_per_sm: 2048,
            blocks_per_sm: 32,
            dram_latency_s: IDLE_LATENCY_S,
            streaming_latency_s: LOADED_LATENCY_S,
            peer_latency_s: 1.2 * US,
            mma_latency_cycles: 33.0,
            launch_s: 2.0 * US,
            round_s: 1.4 * US,
            sources: vec![LATENCIES, STREAMING, LAUNCH],
        };
        // Other GPUs: the H200's ratio of loaded to idle latency.
        let loaded = |idle: f64| idle * (LOADED_LATENCY_S / IDLE_LATENCY_S);
        let p = match name {
            "h100-sxm" => DeviceProfile {
                sources: vec![
                    "132 SMs, 3.35 TB/s HBM3, NVLink 900 GB/s (450 per direction): NVIDIA H100 datasheet (SXM5)",
                    "1980 MHz boost: NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 3",
                    "228 KiB shared memory, 64K registers, 2048 threads, 32 blocks per SM: CUDA C++ Programming Guide, compute capability 9.0",
                    LATENCIES,
                    STREAMING,
                    LAUNCH,
                ],
                ..base(132, (9, 0), "sm_90a", 3.35 * T, 450.0 * G, Link::NvSwitch, 1980.0)
            },
            "h200" => DeviceProfile {
                sources: vec![
                    "132 SMs (the H100 SXM5 die), 4.8 TB/s HBM3e, NVLink 900 GB/s (450 per direction): NVIDIA H200 datasheet",
                    "1980 MHz boost (nvidia-smi max clocks, awslabs/amazon-eks-ami #1985), per-SM limits: compute capability 9.0",
                    LATENCIES,
                    STREAMING,
                    LAUNCH,
                ],
                ..base(132, (9, 0), "sm_90a", 4.8 * T, 450.0 * G, Link::NvSwitch, 1980.0)
            },
            "a100-sxm" => DeviceProfile {
                smem_per_sm: 164 * KIB,
                sources: vec![
                    "108 SMs, 2.039 TB/s HBM2e (80 GB), NVLink 600 GB/s (300 per direction): NVIDIA A100 datasheet",
                    "1410 MHz boost: NVIDIA A100 Tensor Core GPU Architecture whitepaper, table 3",
                    "164 KiB shared memory, 64K registers, 2048 threads, 32 blocks per SM: CUDA C++ Programming Guide, compute capability 8.0",
                    "dram_latency 400 ns: about 566 cycles at 1.395 GHz (A100 PCIe, the raw data of Luo et al., HPMLL/NVIDIA-Hopper-Benchmark); peer_latency and mma as h100-sxm",
                    STREAMING,
                    LAUNCH,
                ],
                dram_latency_s: 400.0 * NS,
                streaming_latency_s: loaded(400.0 * NS),
                ..base(108, (8, 0), "sm_80", 2.039 * T, 300.0 * G, Link::NvSwitch, 1410.0)
            },
            "l40s" => DeviceProfile {
                smem_per_sm: 100 * KIB,
                threads_per_sm: 1536,
                blocks_per_sm: 24,
                sources: vec![
                    "142 SMs, 864 GB/s GDDR6, PCIe Gen4 x16 (32 GB/s per direction), no NVLink: NVIDIA L40S datasheet",
                    "2520 MHz boost: NVIDIA L40S datasheet",
                    "100 KiB shared memory, 64K registers, 1536 threads, 24 blocks per SM: CUDA C++ Programming Guide, compute capability 8.9",
                    "dram_latency 260 ns: unverified (the RTX 4090, the same die with GDDR6X: about 572 cycles at 2.235 GHz, HPMLL/NVIDIA-Hopper-Benchmark); peer_latency 2 µs over PCIe: an assumption",
                    STREAMING,
                    LAUNCH,
                ],
                dram_latency_s: 260.0 * NS,
                streaming_latency_s: loaded(260.0 * NS),
                peer_latency_s: 2.0 * US,
                ..base(142, (8, 9), "sm_89", 864.0 * G, 32.0 * G, Link::Pcie, 2520.0)
            },
            "b200" => DeviceProfile {
                sources: vec![
                    "148 SMs, 8 TB/s HBM3e, NVLink 5 1.8 TB/s (900 GB/s per direction): NVIDIA DGX B200 / HGX B200 datasheet",
                    "1965 MHz boost: unverified (Chips and Cheese: clocks similar to the H100 SXM5)",
                    "228 KiB shared memory, 64K registers, 2048 threads, 32 blocks per SM: CUDA C++ Programming Guide, compute capability 10.0",
                    "dram_latency 440 ns: 860 cycles (markdewing/AI_kernels, clock not stated) at 1.965 GHz, unverified; peer_latency and mma as h100-sxm",
                    STREAMING,
                    LAUNCH,
                ],
                dram_latency_s: 440.0 * NS,
                streaming_latency_s: loaded(440.0 * NS),
                ..base(148, (10, 0), "sm_100a", 8.0 * T, 900.0 * G, Link::NvSwitch, 1965.0)
            },
            _ => return None,
        };
        Some(p)
    }

    /// The largest number of blocks of `threads` threads, `smem` bytes of shared memory and
    /// `registers` registers per thread (0: unknown, not limiting) one SM holds at once.
    pub fn blocks_per_sm_for(&self, threads: usize, smem: usize, registers: usize) -> usize {
        // The driver reserves 1 KiB of shared memory per block (compute capability 8.0 on).
        let by_smem = self.smem_per_sm / (smem + KIB).max(1);
        let by_threads = self.threads_per_sm / threads.max(1);
        let by_registers = if registers == 0 {
            usize::MAX
        } else {
            // Registers are allocated per warp in units of 256.
            let per_warp = (registers * 32).div_ceil(256) * 256;
            self.registers_per_sm / (per_warp * threads.div_ceil(32)).max(1)
        };
        by_smem
            .min(by_threads)
            .min(by_registers)
            .min(self.blocks_per_sm)
    }
}

impl DeviceProfile {
    /// The profile of GPU `ordinal` of this machine: its SM count, compute capability, clock,
    /// per-SM limits and (where the driver reports the memory clock and bus width) its DRAM
    /// bandwidth, over the built-in profile of the same compute capability (H100 for 9.x,
    /// A100 for 8.0 and 8.6, L40S for 8.9, B200 for 10.x and later), whose link and latencies
    /// it keeps.
    pub fn local(ordinal: usize) -> crate::Result<DeviceProfile> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let ctx = crate::device::open(ordinal)?;
        let attr = |a: A| -> crate::Result<usize> {
            let v = ctx.attribute(a).map_err(|source| crate::Error::Cuda {
                context: "cuDeviceGetAttribute",
                source,
            })?;
            Ok(usize::try_from(v).unwrap_or(0))
        };
        let cc = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
        );
        let base = match cc {
            (9, _) => "h100-sxm",
            (8, 9) => "l40s",
            (8, _) | (0..=7, _) => "a100-sxm",
            _ => "b200",
        };
        let mut p = DeviceProfile::builtin(base).expect("a built-in profile");
        let gpu = ctx.name().unwrap_or_else(|_| "unknown".into());
        p.name = format!("local GPU {ordinal} ({gpu})");
        p.compute_capability = cc;
        let set = |field: &mut usize, value: usize| {
            if value > 0 {
                *field = value;
            }
        };
        set(
            &mut p.sms,
            attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        );
        set(
            &mut p.smem_per_sm,
            attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
        );
        set(
            &mut p.threads_per_sm,
            attr(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?,
        );
        set(
            &mut p.blocks_per_sm,
            attr(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR)?,
        );
        let clock_khz = attr(A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?;
        if clock_khz > 0 {
            p.clock_hz = clock_khz as f64 * 1e3;
        }
        let memory_khz = attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)?;
        let bus_bits = attr(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?;
        let mut sources = vec!["SMs, compute capability, clock and per-SM limits: the driver"];
        if memory_khz > 0 && bus_bits > 0 {
            // Double data rate: two transfers per memory clock.
            p.dram_bytes_per_s = memory_khz as f64 * 1e3 * 2.0 * bus_bits as f64 / 8.0;
            sources.push("DRAM bandwidth: the driver's memory clock x bus width x 2");
        } else {
            sources.push(
                "DRAM bandwidth: the built-in profile's (the driver reports no memory clock)",
            );
        }
        sources.push("link, latencies and model parameters: the built-in profile of the same compute capability");
        p.sources = sources;
        Ok(p)
    }
}
