//! GEMM benchmarks: tpfuse's `gemm` beside cuBLASLt at the DESIGN reference shapes
//! (Llama-3-70B at TP = 8: qkv, o_proj, gate_up, down) for m in {1, 16, 64, 256, 1024, 4096,
//! 8192}.
//!
//! Method (DESIGN, performance): CUDA-event timing of CUDA graphs, after warm-up, on random
//! inputs. Each graph holds one call per copy of the weight, rotating through enough copies
//! (at least 256 MiB) that the weight is read from HBM, not from L2; the time of one call is
//! the graph's time over its calls, so host-side costs (validation, cuBLASLt's heuristic
//! query) are not counted for either side. Criterion's throughput is in FLOPs (`elem/s` reads
//! as FLOP/s). After criterion, a table gives for every case the median time of one call,
//! TFLOP/s, weight bandwidth and the ratio to cuBLASLt; a second table times every tile
//! configuration at m in {16, 64, 256} with a split scratch (what [`select_config`] could pick
//! instead), outside criterion.
//!
//! `TPFUSE_BENCH_DTYPES` picks the element types (`bf16`, `f16`, or `bf16,f16`; default
//! `bf16`). cuBLASLt runs when libcublasLt can be loaded (put the nvidia-cublas wheel's lib/
//! on LD_LIBRARY_PATH), else only tpfuse is measured. Without a CUDA driver nothing runs.

//!
//! `TPFUSE_BENCH_SMOKE=1` (`benches/common`: e.g. on the CPU emulator, where cuBLASLt does not
//! run) divides the shapes by 8 and runs m = 1 and 64 (and 64 in the table of every
//! configuration), two weight copies and one sample: every path once.

#[path = "common/mod.rs"]
mod common;
use common::{dim, event_time, full_or_smoke, random_device};

use criterion::{BenchmarkId, Criterion, Throughput};
use cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::Duration;
use tpfuse::ops::gemm::{
    gemm, gemm_with_config_and_scratch, gemm_with_scratch, select_config, split_parts,
    split_scratch_bytes, GemmConfig, GemmElement, GemmShape,
};

const SHAPES: [(&str, usize, usize); 4] = [
    ("qkv", 1280, 8192),
    ("o_proj", 8192, 1024),
    ("gate_up", 7168, 8192),
    ("down", 8192, 3584),
];
const MS: [usize; 7] = [1, 16, 64, 256, 1024, 4096, 8192];
/// The m of the table of every configuration.
const SWEEP_MS: [usize; 3] = [16, 64, 256];
/// The sweep's scratch: enough for any configuration's parts at m <= 64 of these shapes.
const SWEEP_SCRATCH_BYTES: usize = 64 << 20;
/// Weight copies rotate through at least this many bytes (L2 is 40-60 MiB on sm_80/sm_90).
const ROTATE_BYTES: usize = 256 << 20;
/// Median of this many graph launches for the summary table.
const TABLE_SAMPLES: usize = 30;

/// The m of the main table, of the table of every configuration, the weight copies and the
/// samples: all of them, or in a smoke run (`common::smoke`) the least that runs every path.
fn ms() -> &'static [usize] {
    full_or_smoke(&MS, &[1, 64])
}
fn sweep_ms() -> &'static [usize] {
    full_or_smoke(&SWEEP_MS, &SWEEP_MS[1..2])
}
fn copies(weight_bytes: usize) -> usize {
    full_or_smoke(ROTATE_BYTES.div_ceil(weight_bytes).clamp(1, 16), 2)
}
fn table_samples() -> usize {
    full_or_smoke(TABLE_SAMPLES, 1)
}

fn main() {
    if !common::driver_present("gemm") {
        return;
    }
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    // Every buffer below is allocated, used and freed on this one stream.
    let (name, stream) = common::one_stream("gemm");
    let blas = if cfg!(feature = "emulator") {
        println!("the emulator runs no cuBLASLt: measuring tpfuse only");
        None
    } else if cublaslt_present() {
        Some(CudaBlasLT::new(stream.clone()).expect("creating a cuBLASLt handle"))
    } else {
        println!("libcublasLt could not be loaded: measuring tpfuse only");
        None
    };
    let dtypes = std::env::var("TPFUSE_BENCH_DTYPES").unwrap_or_else(|_| "bf16".into());
    let mut table = Vec::new();
    let mut sweep = Vec::new();
    for dtype in dtypes.split(',').map(str::trim) {
        for &(shape_name, n, k) in &SHAPES {
            let (n, k) = (dim(n), dim(k));
            match dtype {
                "bf16" => {
                    table.extend(bench_shape::<bf16>(
                        &mut c,
                        &stream,
                        blas.as_ref(),
                        shape_name,
                        n,
                        k,
                    ));
                    sweep.extend(sweep_configs::<bf16>(&stream, shape_name, n, k));
                }
                "f16" => table.extend(bench_shape::<f16>(
                    &mut c,
                    &stream,
                    blas.as_ref(),
                    shape_name,
                    n,
                    k,
                )),
                other => panic!("TPFUSE_BENCH_DTYPES: unknown type {other:?} (bf16 or f16)"),
            }
        }
    }
    c.final_summary();
    print_table(&name, &table);
    print_sweep(&sweep);
}

/// A case's device buffers: the weight's copies (rotated through, so that they come from
/// HBM), `A` of `rows` rows and the output, random but for the output.
struct Operands<T> {
    weights: Vec<CudaSlice<T>>,
    a: CudaSlice<T>,
    out: CudaSlice<T>,
}

impl<T: GemmElement + ValidAsZeroBits + DeviceRepr> Operands<T> {
    /// `seed` picks the random values (`seed + 0x10 + i` the weight's copy `i`).
    fn new(stream: &Arc<CudaStream>, n: usize, k: usize, rows: usize, seed: u64) -> Self {
        let copies = copies(n * k * std::mem::size_of::<T>());
        let w = 1.0 / (k as f32).sqrt();
        let operands = Operands {
            weights: (0..copies)
                .map(|i| random_device::<T>(stream, n * k, w, seed + 0x10 + i as u64))
                .collect(),
            a: random_device::<T>(stream, rows * k, 1.0, seed),
            out: stream
                .alloc_zeros::<T>(rows * n)
                .expect("allocating the output"),
        };
        stream.synchronize().expect("uploading the inputs");
        operands
    }
}

/// The stream's device: its compute capability and SM count (what `select_config` takes).
fn device_facts(stream: &CudaStream) -> ((u32, u32), usize) {
    use cudarc::driver::sys::CUdevice_attribute as A;
    let ctx = stream.context();
    let attr = |x| ctx.attribute(x).expect("device attribute");
    let cc = (
        attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) as u32,
        attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) as u32,
    );
    (
        cc,
        attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) as usize,
    )
}

/// One shape's times under every configuration ([`sweep_configs`]).
struct SweepRow {
    shape: &'static str,
    gemm: GemmShape,
    /// Per [`GemmConfig::ALL`]; `None` where the configuration cannot run the shape's split.
    times: Vec<Option<Duration>>,
    chosen: &'static str,
}

/// Times every configuration at the m of [`sweep_ms`], each with a split scratch
/// ([`gemm_with_config_and_scratch`]), weights rotated as in [`bench_shape`].
fn sweep_configs<T: GemmElement + ValidAsZeroBits + DeviceRepr>(
    stream: &Arc<CudaStream>,
    shape_name: &'static str,
    n: usize,
    k: usize,
) -> Vec<SweepRow> {
    let max_m = sweep_ms()[sweep_ms().len() - 1];
    let Operands {
        weights,
        a,
        mut out,
    } = Operands::<T>::new(stream, n, k, max_m, 0xb1);
    let copies = weights.len();
    let mut scratch = stream
        .alloc_zeros::<u8>(full_or_smoke(SWEEP_SCRATCH_BYTES, SWEEP_SCRATCH_BYTES / 16))
        .expect("the sweep's scratch");
    let (cc, sms) = device_facts(stream);
    let splits = split_parts(n, k, sms) > 1;
    sweep_ms()
        .iter()
        .map(|&m| {
            let s = GemmShape { m, n, k };
            let a_m = a.slice(0..m * k);
            let times = GemmConfig::ALL
                .iter()
                .map(|&config| {
                    if splits && !config.splits_k() {
                        return None;
                    }
                    let mut call = |i: usize| {
                        let mut o = out.slice_mut(0..m * n);
                        gemm_with_config_and_scratch(
                            stream,
                            &a_m,
                            &weights[i],
                            None,
                            None,
                            &mut o,
                            s,
                            config,
                            &mut scratch,
                        )
                        .expect("gemm_with_config_and_scratch");
                    };
                    call(0);
                    stream.synchronize().expect("a configuration's warm-up");
                    let graph = capture(stream, copies, call);
                    Some(median_call(stream, &graph, copies))
                })
                .collect();
            SweepRow {
                shape: shape_name,
                gemm: s,
                times,
                chosen: select_config(s, cc, sms).map_or("none", |c| c.name()),
            }
        })
        .collect()
}

fn print_sweep(rows: &[SweepRow]) {
    if rows.is_empty() {
        return;
    }
    println!(
        "\nevery configuration with a split scratch (bf16), median of {} graph launches, us per \
         call:",
        table_samples()
    );
    print!("{:<8} {:>5} {:>5} {:>5}", "layer", "m", "n", "k");
    for config in GemmConfig::ALL {
        print!("  {:>13}", config.name());
    }
    println!("  chosen");
    for r in rows {
        let s = r.gemm;
        print!("{:<8} {:>5} {:>5} {:>5}", r.shape, s.m, s.n, s.k);
        for t in &r.times {
            match t {
                Some(t) => print!("  {:>13.1}", t.as_secs_f64() * 1e6),
                None => print!("  {:>13}", "-"),
            }
        }
        println!("  {}", r.chosen);
    }
    println!("('-': runs no split of k, and this shape splits)");
}

/// One measured case for the summary table.
struct Row {
    dtype: &'static str,
    shape: &'static str,
    gemm: GemmShape,
    config: &'static str,
    ours: Duration,
    /// With a split scratch ([`gemm_with_scratch`]: k's parts in parallel blocks, what a
    /// group's decode GEMMs run), where the shape splits.
    split: Option<Duration>,
    theirs: Option<Duration>,
}

/// Captures `calls` enqueues of `f(i)` (i = 0..calls) into one CUDA graph.
fn capture(stream: &Arc<CudaStream>, calls: usize, mut f: impl FnMut(usize)) -> CudaGraph {
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("beginning a capture");
    for i in 0..calls {
        f(i);
    }
    let graph = stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .expect("ending a capture")
        .expect("the capture recorded work");
    graph.upload().expect("uploading the graph");
    graph
}

/// GPU time of `launches` launches of `graph`, from events on `stream`.
fn time_graph(stream: &Arc<CudaStream>, graph: &CudaGraph, launches: u64) -> Duration {
    event_time(stream, launches, || {
        graph.launch().expect("launching the graph");
    })
}

/// Median time of one call: `samples` single launches of a graph of `calls` calls.
fn median_call(stream: &Arc<CudaStream>, graph: &CudaGraph, calls: usize) -> Duration {
    let mut t: Vec<Duration> = (0..table_samples())
        .map(|_| time_graph(stream, graph, 1) / calls as u32)
        .collect();
    t.sort();
    t[t.len() / 2]
}

fn cublaslt<T>(
    blas: &CudaBlasLT,
    a: &CudaSlice<T>,
    b: &CudaSlice<T>,
    c: &mut CudaSlice<T>,
    s: GemmShape,
) where
    CudaBlasLT: Matmul<T>,
{
    // Row-major C[m, n] = A[m, k] · B[n, k]^T is column-major C^T[n, m] = B^T · A.
    let cfg = MatmulConfig {
        transa: true,
        transb: false,
        transc: false,
        m: s.n as u64,
        n: s.m as u64,
        k: s.k as u64,
        alpha: 1.0,
        lda: s.k as i64,
        ldb: s.k as i64,
        beta: 0.0,
        ldc: s.n as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    // SAFETY: a holds at least m*k, b n*k and c m*n elements, all on blas's stream.
    unsafe { blas.matmul(cfg, b, a, c, None, None) }.expect("cuBLASLt matmul");
}

fn bench_shape<T: GemmElement + ValidAsZeroBits + DeviceRepr>(
    c: &mut Criterion,
    stream: &Arc<CudaStream>,
    blas: Option<&CudaBlasLT>,
    shape_name: &'static str,
    n: usize,
    k: usize,
) -> Vec<Row>
where
    CudaBlasLT: Matmul<T>,
{
    let max_m = ms()[ms().len() - 1];
    let Operands {
        weights,
        a,
        mut out,
    } = Operands::<T>::new(stream, n, k, max_m, 0xa0);
    let copies = weights.len();

    let (cc, sms) = device_facts(stream);

    let mut rows = Vec::new();
    let mut group = c.benchmark_group(format!("gemm_{}_{shape_name}_n{n}_k{k}", T::NAME));
    for &m in ms() {
        let s = GemmShape { m, n, k };
        let config = select_config(s, cc, sms).map_or("none", |c| c.name());
        let a_m = a.slice(0..m * k);
        // Warm up outside the capture (the first call sets kernel attributes).
        {
            let mut o = out.slice_mut(0..m * n);
            gemm(stream, &a_m, &weights[0], None, None, &mut o, m, n, k).expect("gemm");
        }
        stream.synchronize().expect("gemm warm-up");
        let ours = capture(stream, copies, |i| {
            let mut o = out.slice_mut(0..m * n);
            gemm(stream, &a_m, &weights[i], None, None, &mut o, m, n, k).expect("gemm");
        });
        group.throughput(Throughput::Elements(s.flops() as u64));
        group.sample_size(if s.flops() > 1e12 { 20 } else { 50 });
        group.bench_function(BenchmarkId::new("tpfuse", m), |bench| {
            bench.iter_custom(|iters| time_graph(stream, &ours, iters) / copies as u32)
        });
        let ours_median = median_call(stream, &ours, copies);
        let split_median = match split_scratch_bytes(s, sms) {
            0 => None,
            bytes => {
                let mut scratch = stream.alloc_zeros::<u8>(bytes).expect("a split scratch");
                let mut call = |i: usize| {
                    let mut o = out.slice_mut(0..m * n);
                    gemm_with_scratch(
                        stream,
                        &a_m,
                        &weights[i],
                        None,
                        None,
                        &mut o,
                        s,
                        &mut scratch,
                    )
                    .expect("gemm_with_scratch");
                };
                call(0);
                stream.synchronize().expect("gemm_with_scratch warm-up");
                let split = capture(stream, copies, call);
                Some(median_call(stream, &split, copies))
            }
        };

        let theirs_median = blas.map(|blas| {
            cublaslt(blas, &a, &weights[0], &mut out, s);
            stream.synchronize().expect("cuBLASLt warm-up");
            let theirs = capture(stream, copies, |i| {
                cublaslt(blas, &a, &weights[i], &mut out, s)
            });
            group.bench_function(BenchmarkId::new("cublaslt", m), |bench| {
                bench.iter_custom(|iters| time_graph(stream, &theirs, iters) / copies as u32)
            });
            median_call(stream, &theirs, copies)
        });
        rows.push(Row {
            dtype: T::NAME,
            shape: shape_name,
            gemm: s,
            config,
            ours: ours_median,
            split: split_median,
            theirs: theirs_median,
        });
    }
    group.finish();
    rows
}

fn print_table(gpu: &str, rows: &[Row]) {
    println!(
        "\ngemm on {gpu}: median of {} graph launches, time of one call",
        table_samples()
    );
    println!(
        "{:<5} {:<8} {:>5} {:>5} {:>5}  {:<14} {:>10} {:>8} {:>8}  {:>9} {:>8}  {:>10} {:>8}  {:>6}",
        "dtype",
        "layer",
        "m",
        "n",
        "k",
        "config",
        "tpfuse us",
        "TFLOP/s",
        "W GB/s",
        "split us",
        "W GB/s",
        "cuBLASLt",
        "TFLOP/s",
        "ratio"
    );
    for r in rows {
        let s = r.gemm;
        let tflops = |t: Duration| s.flops() / t.as_secs_f64() / 1e12;
        let weight_gbs = (s.n * s.k * 2) as f64 / r.ours.as_secs_f64() / 1e9;
        let (theirs_us, theirs_tf, ratio) = match r.theirs {
            Some(t) => (
                format!("{:.1}", t.as_secs_f64() * 1e6),
                format!("{:.1}", tflops(t)),
                format!("{:.2}", t.as_secs_f64() / r.ours.as_secs_f64()),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        let (split_us, split_gbs) = match r.split {
            Some(t) => (
                format!("{:.1}", t.as_secs_f64() * 1e6),
                format!("{:.0}", (s.n * s.k * 2) as f64 / t.as_secs_f64() / 1e9),
            ),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:<5} {:<8} {:>5} {:>5} {:>5}  {:<14} {:>10.1} {:>8.1} {:>8.0}  {:>9} {:>8}  {:>10} {:>8}  {:>6}",
            r.dtype,
            r.shape,
            s.m,
            s.n,
            s.k,
            r.config,
            r.ours.as_secs_f64() * 1e6,
            tflops(r.ours),
            weight_gbs,
            split_us,
            split_gbs,
            theirs_us,
            theirs_tf,
            ratio
        );
    }
    println!(
        "split = gemm_with_scratch (k's parts in parallel blocks, as a group's decode GEMMs run; \
         '-' where the shape does not split); ratio = cuBLASLt time / tpfuse time (above 1: \
         tpfuse is faster)"
    );
}

/// Whether cuBLASLt can be loaded. With the `candle` feature cudarc links it instead
/// (candle-core asks for `dynamic-linking`): this binary would not have started without it.
fn cublaslt_present() -> bool {
    #[cfg(feature = "candle")]
    return true;
    // SAFETY: only tries to load the library.
    #[cfg(not(feature = "candle"))]
    return unsafe { cudarc::cublaslt::sys::is_culib_present() };
}
