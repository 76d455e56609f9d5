//! `tpfuse bench`: a quick reduce_ranks bandwidth figure on GPU 0 (the criterion benches
//! are the measurement).

use std::process::ExitCode;

pub fn run() -> ExitCode {
    if !tpfuse::device::driver_present() {
        eprintln!("tpfuse bench: needs a GPU: no CUDA driver on this machine (libcuda.so could not be loaded)");
        return ExitCode::FAILURE;
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
