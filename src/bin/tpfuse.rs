//! `tpfuse`: the command-line face of the crate.
//!
//! - `tpfuse doctor [--build]`: what was built, what this machine has, what is missing.
//! - `tpfuse selftest`: checks that run here (NCCL, unique ids) and, with a GPU, the kernels
//!   against the CPU reference and a one-rank NCCL communicator.
//! - `tpfuse bench`: a quick reduce_ranks bandwidth figure (needs a GPU; the criterion
//!   benches are the real measurement).

use std::process::ExitCode;
use tpfuse::build_info;
use tpfuse::comm::{nccl_info, UniqueId};

const USAGE: &str = "usage: tpfuse <command>

commands:
  doctor [--build]   build facts, NCCL, CUDA driver and GPUs; --build adds the ptxas
                     resource report of every kernel on every architecture
  selftest           run the checks this machine can run
  bench              quick reduce_ranks bandwidth on GPU 0
  help               this text";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["doctor"] => doctor(false),
        ["doctor", "--build"] => doctor(true),
        ["selftest"] => selftest::run(),
        ["bench"] => bench::run(),
        [] | ["help"] | ["--help"] | ["-h"] => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("tpfuse: unknown arguments {args:?}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn doctor(with_report: bool) -> ExitCode {
    println!("tpfuse {} doctor\n", env!("CARGO_PKG_VERSION"));
    let mut missing: Vec<String> = Vec::new();

    println!("Build");
    println!(
        "  CUDA architectures  {}",
        build_info::architectures().join(", ")
    );
    let (rt_major, rt_minor) = build_info::cudart_version();
    println!(
        "  nvcc                {} ({})",
        build_info::NVCC_RELEASE,
        build_info::NVCC
    );
    println!("  CUDA runtime        {rt_major}.{rt_minor}, linked statically");
    let resources = build_info::kernel_resources();
    let kernels = build_info::kernels();
    let spilling: Vec<_> = resources.iter().filter(|k| k.spills()).collect();
    println!(
        "  kernels             {} ({} kernel x architecture builds, {} with spills)",
        kernels.len(),
        resources.len(),
        spilling.len()
    );
    for k in &kernels {
        println!("    {k}");
    }
    for k in &spilling {
        missing.push(format!(
            "kernel {} spills on {} ({} B stores, {} B loads): a defect",
            k.kernel, k.arch, k.spill_stores, k.spill_loads
        ));
    }
    println!("  nccl.h              {}", build_info::NCCL_HEADER);
    if with_report {
        print_ptxas_report(&resources);
    } else {
        println!("  (tpfuse doctor --build shows registers, spills and memory per kernel)");
    }

    println!("\nNCCL");
    match nccl_info() {
        Ok(info) => {
            let (a, b, c) = info.version;
            println!("  found               {a}.{b}.{c} at {}", info.path);
            println!("  bindings from       nccl.h {}", info.header_version);
            match UniqueId::new() {
                Ok(_) => println!("  unique ids          ok (ncclGetUniqueId works)"),
                Err(e) => {
                    println!("  unique ids          FAILED: {e}");
                    missing.push(format!("ncclGetUniqueId fails: {e}"));
                }
            }
        }
        Err(e) => {
            println!("  not found           {e}");
            missing.push("NCCL (pip install nvidia-nccl-cu13, or set TPFUSE_NCCL_LIB)".into());
        }
    }

    println!("\nCUDA driver");
    if !tpfuse::device::driver_present() {
        println!("  not found           libcuda.so could not be loaded");
        println!(
            "  This machine has no NVIDIA driver, so no GPU work can run here: the kernels,\n  \
             Comm::init_* and the gpu-tests need one. Building, the CPU tests and NCCL's\n  \
             version and unique ids work without it."
        );
        missing.push("an NVIDIA driver and GPU (only needed to run kernels)".into());
    } else {
        describe_gpus(&mut missing);
    }

    println!();
    if missing.is_empty() {
        println!("Verdict: nothing missing.");
    } else {
        println!("Verdict: missing on this machine:");
        for m in &missing {
            println!("  - {m}");
        }
    }
    ExitCode::SUCCESS
}

fn describe_gpus(missing: &mut Vec<String>) {
    use cudarc::driver::sys::CUdevice_attribute as A;
    match tpfuse::device::driver_version() {
        Ok((a, b)) => println!("  driver              CUDA {a}.{b}"),
        Err(e) => println!("  driver              version unknown: {e}"),
    }
    let count = match tpfuse::device::device_count() {
        Ok(n) => n,
        Err(e) => {
            println!("  devices             error: {e}");
            missing.push(format!("a working CUDA driver ({e})"));
            return;
        }
    };
    println!("  devices             {count}");
    if count == 0 {
        missing.push("a visible GPU (check CUDA_VISIBLE_DEVICES)".into());
    }
    let built = build_info::architectures();
    for i in 0..count {
        let ctx = match tpfuse::device::open(i) {
            Ok(c) => c,
            Err(e) => {
                println!("    {i}: cannot open: {e}");
                continue;
            }
        };
        let name = ctx.name().unwrap_or_else(|_| "?".into());
        let major = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .unwrap_or(0);
        let minor = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .unwrap_or(0);
        let sms = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap_or(0);
        let code = format!("sm_{major}{minor}");
        let native = built.iter().any(|a| a.trim_end_matches(['a', 'f']) == code);
        let ptx = built.iter().any(|a| {
            a.strip_prefix("compute_")
                .and_then(|n| n.parse::<i32>().ok())
                .is_some_and(|n| n <= major * 10 + minor)
        });
        let how = if native {
            "native code"
        } else if ptx {
            "PTX, JIT-compiled at first use"
        } else {
            missing.push(format!(
                "kernels for {code} (GPU {i}): rebuild with TPFUSE_CUDA_ARCHS including {code}"
            ));
            "NO kernels for this GPU"
        };
        println!("    {i}: {name}, {code}, {sms} SMs: {how}");
    }
}

fn print_ptxas_report(resources: &[build_info::KernelResources]) {
    println!("\n  ptxas resource report (per kernel and architecture)");
    println!(
        "  {:<8} {:>5} {:>12} {:>11} {:>6} {:>6}  kernel",
        "arch", "regs", "spill stores", "spill loads", "stack", "smem"
    );
    for k in resources {
        println!(
            "  {:<8} {:>5} {:>12} {:>11} {:>6} {:>6}  {}",
            k.arch, k.registers, k.spill_stores, k.spill_loads, k.stack, k.shared, k.kernel
        );
    }
}

mod selftest {
    use super::*;

    /// Runs what this machine can run; fails (exit 1) on any failed check.
    pub fn run() -> ExitCode {
        let mut failed = 0;
        let mut passed = 0;
        let mut check = |name: &str, result: tpfuse::Result<()>| match result {
            Ok(()) => {
                passed += 1;
                println!("ok      {name}");
            }
            Err(e) => {
                failed += 1;
                println!("FAILED  {name}: {e}");
            }
        };
        check("NCCL loads", nccl_info().map(|_| ()));
        check("unique ids are distinct and round-trip", unique_ids());
        if tpfuse::device::driver_present() {
            check(
                "reduce_ranks matches the CPU reference",
                gpu::reduce_ranks(),
            );
            check("one-rank NCCL communicator", gpu::one_rank_comm());
        } else {
            println!("skipped GPU checks: no CUDA driver on this machine");
        }
        println!("{passed} passed, {failed} failed");
        if failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    fn unique_ids() -> tpfuse::Result<()> {
        let a = UniqueId::new()?;
        let b = UniqueId::new()?;
        if a == b {
            return Err(tpfuse::Error::Mismatch("two unique ids are equal".into()));
        }
        if UniqueId::from_hex(&a.to_hex())? != a || UniqueId::from_bytes(a.as_bytes())? != a {
            return Err(tpfuse::Error::Mismatch(
                "unique id round trip changed it".into(),
            ));
        }
        Ok(())
    }

    mod gpu {
        use half::bf16;
        use tpfuse::comm::{Comm, CommOptions};
        use tpfuse::reference::reduce_ranks_exact;
        use tpfuse::{Error, Result};

        fn cuda(context: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
            move |source| Error::Cuda { context, source }
        }

        pub fn reduce_ranks() -> Result<()> {
            let stream = tpfuse::device::open(0)?.default_stream();
            for &n in &[1usize, 7, 8, 1000, 65_537] {
                let host: Vec<Vec<bf16>> = (0..4)
                    .map(|r| {
                        (0..n)
                            .map(|i| bf16::from_f32(((i * 7 + r * 13) % 97) as f32 * 0.37 - 17.0))
                            .collect()
                    })
                    .collect();
                let dev = host
                    .iter()
                    .map(|h| stream.clone_htod(h))
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(cuda("upload"))?;
                let mut out = stream
                    .clone_htod(&vec![bf16::NAN; n])
                    .map_err(cuda("upload"))?;
                let refs: Vec<_> = dev.iter().collect();
                tpfuse::ops::reduce_ranks(&stream, &refs, &mut out)?;
                let got = stream.clone_dtoh(&out).map_err(cuda("download"))?;
                let slices: Vec<&[bf16]> = host.iter().map(Vec::as_slice).collect();
                let want = reduce_ranks_exact(&slices);
                if got
                    .iter()
                    .map(|x| x.to_bits())
                    .ne(want.iter().map(|x| x.to_bits()))
                {
                    return Err(Error::Mismatch(format!(
                        "reduce_ranks of 4 x {n} bf16 differs from the reference"
                    )));
                }
            }
            Ok(())
        }

        pub fn one_rank_comm() -> Result<()> {
            let id = tpfuse::comm::UniqueId::new()?;
            let comm = Comm::init_rank_on_device(&id, 0, 1, 0, CommOptions::default())?;
            comm.sanity_check()
        }
    }
}

mod bench {
    use super::*;

    pub fn run() -> ExitCode {
        if !tpfuse::device::driver_present() {
            println!("tpfuse bench needs a GPU: no CUDA driver on this machine.");
            return ExitCode::SUCCESS;
        }
        match measure() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tpfuse bench: {e}");
                ExitCode::FAILURE
            }
        }
    }

    fn measure() -> tpfuse::Result<()> {
        use half::bf16;
        use std::time::Instant;
        let cuda = |context: &'static str| move |source| tpfuse::Error::Cuda { context, source };
        let stream = tpfuse::device::open(0)?.default_stream();
        println!("reduce_ranks, bf16, GPU 0 (wall clock around stream sync; criterion benches are the reference)");
        println!(
            "{:>6} {:>12} {:>10} {:>10}",
            "inputs", "elements", "us", "GB/s"
        );
        for &w in &[2usize, 4, 8] {
            for &n in &[1usize << 16, 1 << 20, 1 << 24] {
                let inputs = (0..w)
                    .map(|_| stream.alloc_zeros::<bf16>(n))
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(cuda("alloc"))?;
                let mut out = stream.alloc_zeros::<bf16>(n).map_err(cuda("alloc"))?;
                let refs: Vec<_> = inputs.iter().collect();
                for _ in 0..3 {
                    tpfuse::ops::reduce_ranks(&stream, &refs, &mut out)?;
                }
                stream.synchronize().map_err(cuda("sync"))?;
                let iters = 20;
                let t = Instant::now();
                for _ in 0..iters {
                    tpfuse::ops::reduce_ranks(&stream, &refs, &mut out)?;
                }
                stream.synchronize().map_err(cuda("sync"))?;
                let secs = t.elapsed().as_secs_f64() / iters as f64;
                let bytes = ((w + 1) * n * 2) as f64;
                println!(
                    "{w:>6} {n:>12} {:>10.1} {:>10.1}",
                    secs * 1e6,
                    bytes / secs / 1e9
                );
            }
        }
        Ok(())
    }
}
