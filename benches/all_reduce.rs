//! Latency and bus bandwidth of tpfuse's all-reduce, the fused residual + RMSNorm epilogue
//! against the unfused sequence, and a device-to-device copy as the memory baseline, all in
//! one run (bf16 throughout).
//!
//! Criterion groups:
//!
//! - `all_reduce_bf16_virtual_w{2,4,8}`: W virtual ranks on GPU 0 ([`TpGroup::virtual_ranks`],
//!   capacity 256 MiB), messages of 8 KB to 256 MB per rank, one-shot and two-shot. `*_eager`
//!   enqueues every call from the host (what a caller without CUDA graphs gets: for small
//!   messages and W = 8 the host's launch rate is part of the time); `*_graph` (messages up to
//!   4 MB) replays per-rank CUDA graphs of 32 rounds, so the GPU time is what is measured.
//!   Throughput is the bus bandwidth of nccl-tests, `busbw = bytes * 2 (W-1) / W / time`.
//! - `all_reduce_bf16_gpus_w{2,4,8}`: one GPU per rank ([`TpGroup::single_process`]): NCCL,
//!   and the custom kernels where the group has peer access. Needs at least W GPUs; with fewer
//!   the bench says that NCCL could not be measured.
//! - `fused_residual_rmsnorm_bf16_w{2,4,8}`: hidden 8192, m in {1, 16, 64, 256} rows:
//!   `fused` is [`ops::all_reduce_residual_rmsnorm`], `unfused` is [`ops::all_reduce`] then
//!   [`ops::add_bias_residual`] then [`ops::rms_norm`] (both `Algorithm::Auto`), both from
//!   per-rank CUDA graphs of 32 rounds (so launch overhead does not favour the fused path).
//!   `fused_residual_rmsnorm_bf16_w{2,4,8}_packets`: the same on groups with
//!   [`GroupOptions::all_reduce_packets`] (the one-shot by packets where they fit: m ≤ 4 at
//!   W = 8, 2 · W · m · 8192 · 2 bytes ≤ 1 MiB).
//! - `memcpy_dtod_bf16`: cudarc's device-to-device copy of the same sizes; throughput counts
//!   read and write, 2 x bytes.
//!
//! Every time comes from CUDA events, never the host clock: rank 0's stream records the start,
//! every other rank's stream waits for it, all ranks run the round(s), rank 0's stream waits
//! for every other rank's, then records the end. Inputs are random (one random buffer per rank
//! sliced per size); from 64 MB per rank the W inputs no longer fit in L2.
//!
//! After the criterion groups the bench prints a summary from its own event-timed medians:
//! one-shot on W virtual ranks against the copy from 8 MB up (one-shot moves about
//! W (W + 3) x size bytes of memory per round: W stagings read and written, W x W peer reads,
//! W outputs; a copy moves 2 x size), and the fused/unfused ratio.
//!
//! `CUDA_DEVICE_MAX_CONNECTIONS` is set to 32 (when unset) before the CUDA context exists, so
//! that every virtual rank's stream gets its own hardware queue.
//!
//! Without a CUDA driver the bench prints one line and registers nothing. The defaults (0.5 s
//! warm-up, 2 s measurement, 20 samples; about 100 benchmarks) keep the whole run under five
//! minutes; criterion's command line overrides them. Quick run:
//! `cargo bench --bench all_reduce -- --warm-up-time 0.5 --measurement-time 1`; one group:
//! `cargo bench --bench all_reduce -- fused`.
//!
//! `TPFUSE_BENCH_SMOKE=1` (`benches/common`: e.g. on the CPU emulator) runs W = 2, the two
//! smallest sizes (both in the summary), hidden 1024 and m = 1, two rounds per graph and one
//! sample: every path once.

#[path = "common/mod.rs"]
mod common;
use common::{check_all, dim, full_or_smoke, human, random_device, time_rounds, KB, MB};

use criterion::{BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput};
use cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream, CudaView, CudaViewMut};
use half::bf16;
use std::sync::Arc;
use std::time::Duration;
use tpfuse::comm::Comm;
use tpfuse::ops::{self, Algorithm};
use tpfuse::{GroupOptions, TpGroup};

type T = bf16;

const WORLDS: [usize; 3] = [2, 4, 8];
/// Bytes per rank.
const SIZES: [usize; 7] = [8 * KB, 64 * KB, 512 * KB, 4 * MB, 8 * MB, 64 * MB, 256 * MB];
/// Sizes up to this one also run from CUDA graphs.
const GRAPH_MAX: usize = 4 * MB;
/// From this size on, flat sampling (one sample is already milliseconds).
const LARGE: usize = 32 * MB;
/// From this size on, the summary compares one-shot with the copy.
const TABLE_FROM: usize = 8 * MB;
/// Rounds per captured graph.
const ROUNDS: u64 = 32;
/// Event-timed samples behind every number of the summary.
const TABLE_SAMPLES: usize = 9;
/// The fused epilogue's row length and row counts.
const HIDDEN: usize = 8192;
const MS: [usize; 4] = [1, 16, 64, 256];
const EPS: f32 = 1e-5;

/// What a run covers: everything, or in a smoke run (`common::smoke`) the least that runs every
/// path.
fn worlds() -> &'static [usize] {
    full_or_smoke(&WORLDS, &WORLDS[..1])
}
fn sizes() -> &'static [usize] {
    full_or_smoke(&SIZES, &SIZES[..2])
}
/// The largest size of the run, and the capacity of the groups.
fn max_size() -> usize {
    sizes()[sizes().len() - 1]
}
fn table_from() -> usize {
    full_or_smoke(TABLE_FROM, 0)
}
fn hidden() -> usize {
    dim(HIDDEN)
}
fn ms() -> &'static [usize] {
    full_or_smoke(&MS, &MS[..1])
}
fn rounds() -> u64 {
    full_or_smoke(ROUNDS, 2)
}
fn samples() -> usize {
    full_or_smoke(TABLE_SAMPLES, 1)
}

/// One line of the summary.
enum Row {
    /// (world, bytes, one-shot round time)
    OneShot(usize, usize, Duration),
    /// (bytes, copy time)
    Copy(usize, Duration),
    /// (world, m, by packets, fused, unfused)
    Fused(usize, usize, bool, Duration, Duration),
}

fn main() {
    if !common::driver_present("all_reduce") {
        return;
    }
    // Read when the context is created: before the first CUDA call.
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    }
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .configure_from_args();
    let ctx = tpfuse::device::open(0).unwrap_or_else(|e| panic!("opening GPU 0: {e}"));
    let sms = ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .unwrap_or(0);
    println!(
        "all_reduce benches on GPU 0: {} ({sms} SMs), driver {:?}, CUDA_DEVICE_MAX_CONNECTIONS={}",
        ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
        tpfuse::device::driver_version().ok(),
        std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").unwrap_or_default()
    );
    // Every buffer of this context lives on one stream (its rank's, or the copy's), so
    // cudarc's cross-stream event tracking is not needed; turning it off keeps its event
    // records out of the enqueue path and out of the captured graphs.
    // SAFETY: nothing below uses a buffer of this context on a stream other than its own.
    unsafe { ctx.disable_event_tracking() };

    let mut rows = Vec::new();
    for &world in worlds() {
        bench_virtual(&mut c, &ctx, world, &mut rows);
    }
    bench_copy(&mut c, &ctx, &mut rows);
    for packets in [false, true] {
        for &world in worlds() {
            bench_fused(&mut c, &ctx, world, packets, &mut rows);
        }
    }
    bench_gpus(&mut c);
    c.final_summary();
    print_summary(&rows);
}

// ---------------------------------------------------------------------------------------
// Timing.
// ---------------------------------------------------------------------------------------

/// GPU time of `wanted` rounds replayed from `graphs` (one per stream, each holding
/// [`rounds()`] rounds): whole graphs are launched, the time is scaled to `wanted`.
fn time_graphs(streams: &[Arc<CudaStream>], graphs: &[CudaGraph], wanted: u64) -> Duration {
    let launches = wanted.div_ceil(rounds()).max(1);
    let total = time_rounds(streams, launches, || {
        for g in graphs {
            g.launch().expect("launching a graph");
        }
    });
    total.mul_f64(wanted as f64 / (launches * rounds()) as f64)
}

/// The median of [`samples`] timings.
fn median(mut f: impl FnMut() -> Duration) -> Duration {
    let mut t: Vec<Duration> = (0..samples()).map(|_| f()).collect();
    t.sort();
    t[t.len() / 2]
}

/// Per-rank graphs of [`rounds`] calls of `enqueue(rank)`.
fn capture_rounds<R>(
    groups: &[TpGroup],
    enqueue: impl FnMut(usize) -> tpfuse::Result<R>,
) -> Vec<CudaGraph> {
    common::capture_rounds(groups, rounds(), enqueue)
}

// ---------------------------------------------------------------------------------------
// Data.
// ---------------------------------------------------------------------------------------

/// Random inputs and zeroed outputs of `n` elements, one of each per group, on its stream.
fn rank_buffers(groups: &[TpGroup], n: usize, seed: u64) -> (Vec<CudaSlice<T>>, Vec<CudaSlice<T>>) {
    let inputs = groups
        .iter()
        .map(|g| random_device(g.stream(), n, 4.0, seed ^ ((g.rank() as u64 + 1) << 24)))
        .collect();
    let outs = groups
        .iter()
        .map(|g| {
            g.stream()
                .alloc_zeros::<T>(n)
                .expect("allocating an output")
        })
        .collect();
    for g in groups {
        g.stream().synchronize().expect("uploading the inputs");
    }
    (inputs, outs)
}

/// nccl-tests' bus bandwidth numerator: `bytes * 2 (W-1) / W`.
fn busbw_bytes(bytes: usize, world: usize) -> u64 {
    (bytes as u64) * 2 * (world as u64 - 1) / world as u64
}

fn set_sampling(group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>, bytes: usize) {
    group.sampling_mode(if bytes >= LARGE {
        SamplingMode::Flat
    } else {
        SamplingMode::Auto
    });
}

// ---------------------------------------------------------------------------------------
// Virtual ranks: one-shot and two-shot.
// ---------------------------------------------------------------------------------------

fn bench_virtual(c: &mut Criterion, ctx: &Arc<CudaContext>, world: usize, rows: &mut Vec<Row>) {
    let options = GroupOptions {
        capacity_bytes: max_size(),
        ..GroupOptions::default()
    };
    let groups = match TpGroup::virtual_ranks(ctx, world, options) {
        Ok(g) => g,
        Err(e) => {
            println!("{world} virtual ranks not measured: {e}");
            return;
        }
    };
    let streams: Vec<Arc<CudaStream>> = groups.iter().map(|g| g.stream().clone()).collect();
    let elem = std::mem::size_of::<T>();
    let (inputs, mut outs) = rank_buffers(&groups, max_size() / elem, 0xa11 ^ world as u64);
    println!(
        "{world} virtual ranks: {} blocks per rank, capacity {} MB",
        groups[0].blocks(),
        groups[0].capacity() / MB
    );

    let mut group = c.benchmark_group(format!("all_reduce_bf16_virtual_w{world}"));
    for &bytes in sizes() {
        if bytes > groups[0].capacity() {
            println!("  {}: above the capacity, skipped", human(bytes));
            continue;
        }
        let n = bytes / elem;
        let label = human(bytes);
        group.throughput(Throughput::Bytes(busbw_bytes(bytes, world)));
        set_sampling(&mut group, bytes);
        let ins: Vec<CudaView<T>> = inputs.iter().map(|x| x.slice(0..n)).collect();
        let mut os: Vec<CudaViewMut<T>> = outs.iter_mut().map(|x| x.slice_mut(0..n)).collect();
        for (name, algo) in [
            ("one_shot", Algorithm::OneShot),
            ("two_shot", Algorithm::TwoShot),
        ] {
            let mut round = || {
                for r in 0..world {
                    ops::all_reduce(&groups[r], &ins[r], &mut os[r], algo).expect("all_reduce");
                }
            };
            // Validate and warm up outside the timed loop.
            round();
            check_all(&groups, name);
            group.bench_function(BenchmarkId::new(format!("{name}_eager"), &label), |b| {
                b.iter_custom(|iters| time_rounds(&streams, iters, &mut round))
            });
            if algo == Algorithm::OneShot && bytes >= table_from() {
                let t = median(|| time_rounds(&streams, 1, &mut round));
                rows.push(Row::OneShot(world, bytes, t));
            }
            check_all(&groups, name);
            if bytes <= GRAPH_MAX {
                let graphs = capture_rounds(&groups, |r| {
                    ops::all_reduce(&groups[r], &ins[r], &mut os[r], algo)
                });
                group.bench_function(BenchmarkId::new(format!("{name}_graph"), &label), |b| {
                    b.iter_custom(|iters| time_graphs(&streams, &graphs, iters))
                });
                check_all(&groups, name);
            }
        }
    }
    group.finish();
}

// ---------------------------------------------------------------------------------------
// The copy baseline.
// ---------------------------------------------------------------------------------------

fn bench_copy(c: &mut Criterion, ctx: &Arc<CudaContext>, rows: &mut Vec<Row>) {
    let stream = ctx.new_stream().expect("creating a stream");
    let elem = std::mem::size_of::<T>();
    let src = random_device::<T>(&stream, max_size() / elem, 4.0, 0xc0b1);
    let mut dst = stream
        .alloc_zeros::<T>(max_size() / elem)
        .expect("allocating the copy target");
    stream.synchronize().expect("uploading the copy source");
    let streams = [stream.clone()];
    let mut group = c.benchmark_group("memcpy_dtod_bf16");
    for &bytes in sizes() {
        let n = bytes / elem;
        let s = src.slice(0..n);
        let mut d = dst.slice_mut(0..n);
        let mut copy = || stream.memcpy_dtod(&s, &mut d).expect("memcpy_dtod");
        group.throughput(Throughput::Bytes(2 * bytes as u64));
        set_sampling(&mut group, bytes);
        group.bench_function(BenchmarkId::new("memcpy_dtod", human(bytes)), |b| {
            b.iter_custom(|iters| time_rounds(&streams, iters, &mut copy))
        });
        if bytes >= table_from() {
            rows.push(Row::Copy(
                bytes,
                median(|| time_rounds(&streams, 1, &mut copy)),
            ));
        }
    }
    group.finish();
}

// ---------------------------------------------------------------------------------------
// Fused residual + RMSNorm against the unfused sequence.
// ---------------------------------------------------------------------------------------

fn bench_fused(
    c: &mut Criterion,
    ctx: &Arc<CudaContext>,
    world: usize,
    packets: bool,
    rows: &mut Vec<Row>,
) {
    let (ms, hidden) = (ms(), hidden());
    let max_m = ms[ms.len() - 1];
    let options = GroupOptions {
        capacity_bytes: max_m * hidden * std::mem::size_of::<T>(),
        all_reduce_packets: packets,
        ..GroupOptions::default()
    };
    let groups = match TpGroup::virtual_ranks(ctx, world, options) {
        Ok(g) => g,
        Err(e) => {
            println!("fused, {world} virtual ranks not measured: {e}");
            return;
        }
    };
    let streams: Vec<Arc<CudaStream>> = groups.iter().map(|g| g.stream().clone()).collect();
    let seed = 0xf5ed ^ world as u64;
    let n_max = max_m * hidden;
    let (partials, mut outs) = rank_buffers(&groups, n_max, seed);
    let (mut residuals, mut tmps) = rank_buffers(&groups, n_max, seed ^ 1);
    let (gammas, mut hs) = rank_buffers(&groups, n_max, seed ^ 2);

    let suffix = if packets { "_packets" } else { "" };
    let mut group = c.benchmark_group(format!("fused_residual_rmsnorm_bf16_w{world}{suffix}"));
    for &m in ms {
        let n = m * hidden;
        let p: Vec<CudaView<T>> = partials.iter().map(|x| x.slice(0..n)).collect();
        let mut res: Vec<CudaViewMut<T>> =
            residuals.iter_mut().map(|x| x.slice_mut(0..n)).collect();
        let mut out: Vec<CudaViewMut<T>> = outs.iter_mut().map(|x| x.slice_mut(0..n)).collect();
        let mut tmp: Vec<CudaViewMut<T>> = tmps.iter_mut().map(|x| x.slice_mut(0..n)).collect();
        let mut h: Vec<CudaViewMut<T>> = hs.iter_mut().map(|x| x.slice_mut(0..n)).collect();
        // Each sequence runs one eager round first (validation, kernel loading outside the
        // capture), then is captured.
        let mut fused_op = |r: usize| {
            let gamma = gammas[r].slice(0..hidden);
            ops::all_reduce_residual_rmsnorm(
                &groups[r],
                &p[r],
                &mut res[r],
                &gamma,
                EPS,
                &mut out[r],
            )
        };
        for r in 0..world {
            fused_op(r).expect("fused all_reduce");
        }
        check_all(&groups, "fused warm-up");
        let fused = capture_rounds(&groups, &mut fused_op);
        let mut unfused_op = |r: usize| {
            let g = &groups[r];
            ops::all_reduce(g, &p[r], &mut tmp[r], Algorithm::Auto)?;
            ops::add_bias_residual(g.stream(), &tmp[r], None, &mut res[r], &mut h[r])?;
            ops::rms_norm(
                g.stream(),
                &h[r],
                &gammas[r].slice(0..hidden),
                EPS,
                &mut out[r],
            )
        };
        for r in 0..world {
            unfused_op(r).expect("unfused sequence");
        }
        check_all(&groups, "unfused warm-up");
        let unfused = capture_rounds(&groups, &mut unfused_op);
        let label = format!("m{m}");
        group.bench_function(BenchmarkId::new("fused", &label), |b| {
            b.iter_custom(|iters| time_graphs(&streams, &fused, iters))
        });
        check_all(&groups, "fused");
        group.bench_function(BenchmarkId::new("unfused", &label), |b| {
            b.iter_custom(|iters| time_graphs(&streams, &unfused, iters))
        });
        check_all(&groups, "unfused");
        // Per round: one launch of every rank's graph of rounds() rounds.
        let tf = median(|| time_graphs(&streams, &fused, rounds()) / rounds() as u32);
        let tu = median(|| time_graphs(&streams, &unfused, rounds()) / rounds() as u32);
        check_all(&groups, "fused summary");
        rows.push(Row::Fused(world, m, packets, tf, tu));
    }
    group.finish();
}

// ---------------------------------------------------------------------------------------
// One GPU per rank: NCCL, and the custom kernels over peer access.
// ---------------------------------------------------------------------------------------

fn bench_gpus(c: &mut Criterion) {
    let count = tpfuse::device::device_count().unwrap_or(0);
    if count < 2 {
        println!(
            "NCCL could not be measured: {count} GPU here. NCCL refuses two ranks of one \
             communicator on one GPU, so its baseline needs a TpGroup::single_process group of \
             at least 2 GPUs"
        );
        return;
    }
    for &world in worlds().iter().filter(|&&w| w <= count) {
        let ordinals: Vec<usize> = (0..world).collect();
        let options = GroupOptions {
            capacity_bytes: max_size(),
            ..GroupOptions::default()
        };
        let groups = match TpGroup::single_process(&ordinals, options) {
            Ok(g) => g,
            Err(e) => {
                println!("NCCL could not be measured on GPUs {ordinals:?}: {e}");
                continue;
            }
        };
        let custom = groups[0].custom_kernels_refused().map(str::to_string);
        match &custom {
            Some(reason) => {
                println!("GPUs {ordinals:?}: custom kernels refused ({reason}); NCCL only")
            }
            None => println!("GPUs {ordinals:?}: NCCL and the custom kernels"),
        }
        let streams: Vec<Arc<CudaStream>> = groups.iter().map(|g| g.stream().clone()).collect();
        let comms: Vec<&Comm> = groups
            .iter()
            .map(|g| g.comm().expect("a single_process group has a communicator"))
            .collect();
        let elem = std::mem::size_of::<T>();
        let (inputs, mut outs) = rank_buffers(&groups, max_size() / elem, 0x6c1 ^ world as u64);
        let mut group = c.benchmark_group(format!("all_reduce_bf16_gpus_w{world}"));
        for &bytes in sizes() {
            let n = bytes / elem;
            let label = human(bytes);
            group.throughput(Throughput::Bytes(busbw_bytes(bytes, world)));
            set_sampling(&mut group, bytes);
            let ins: Vec<CudaView<T>> = inputs.iter().map(|x| x.slice(0..n)).collect();
            let mut os: Vec<CudaViewMut<T>> = outs.iter_mut().map(|x| x.slice_mut(0..n)).collect();
            let mut nccl = || {
                tpfuse::comm::group(&comms, || {
                    for r in 0..world {
                        ops::all_reduce(&groups[r], &ins[r], &mut os[r], Algorithm::Nccl)?;
                    }
                    Ok(())
                })
                .expect("NCCL all_reduce")
            };
            nccl();
            group.bench_function(BenchmarkId::new("nccl_eager", &label), |b| {
                b.iter_custom(|iters| time_rounds(&streams, iters, &mut nccl))
            });
            if custom.is_some() || bytes > groups[0].capacity() {
                continue;
            }
            for (name, algo) in [
                ("one_shot", Algorithm::OneShot),
                ("two_shot", Algorithm::TwoShot),
            ] {
                let mut round = || {
                    for r in 0..world {
                        ops::all_reduce(&groups[r], &ins[r], &mut os[r], algo).expect("all_reduce");
                    }
                };
                round();
                check_all(&groups, name);
                group.bench_function(BenchmarkId::new(format!("{name}_eager"), &label), |b| {
                    b.iter_custom(|iters| time_rounds(&streams, iters, &mut round))
                });
                check_all(&groups, name);
            }
        }
        group.finish();
    }
}

// ---------------------------------------------------------------------------------------
// Summary.
// ---------------------------------------------------------------------------------------

fn gbps(bytes: f64, t: Duration) -> f64 {
    bytes / t.as_secs_f64() / 1e9
}

fn print_summary(rows: &[Row]) {
    println!();
    println!(
        "summary (medians of {} event-timed runs; bf16; GB = 1e9 bytes)",
        samples()
    );
    println!("one-shot on W virtual ranks vs device-to-device copy:");
    println!(
        "  {:>2} {:>6} {:>11} {:>9} {:>14} {:>10} {:>7}",
        "W", "size", "one-shot", "busbw", "moved GB/s", "copy GB/s", "ratio"
    );
    for row in rows {
        let Row::OneShot(world, bytes, t) = *row else {
            continue;
        };
        let moved = (world * (world + 3) * bytes) as f64;
        let copy = rows.iter().find_map(|r| match *r {
            Row::Copy(b, tc) if b == bytes => Some(gbps(2.0 * bytes as f64, tc)),
            _ => None,
        });
        let mine = gbps(moved, t);
        println!(
            "  {:>2} {:>6} {:>9.1}us {:>9.1} {:>14.1} {:>10} {:>7}",
            world,
            human(bytes),
            t.as_secs_f64() * 1e6,
            gbps(busbw_bytes(bytes, world) as f64, t),
            mine,
            copy.map_or("-".into(), |c| format!("{c:.1}")),
            copy.map_or("-".into(), |c| format!("{:.2}", mine / c)),
        );
    }
    println!(
        "fused all-reduce + residual + RMSNorm vs the unfused sequence (hidden {}, graphs):",
        hidden()
    );
    println!(
        "  {:>2} {:>4} {:>8} {:>10} {:>10} {:>15}",
        "W", "m", "packets", "fused", "unfused", "unfused/fused"
    );
    for row in rows {
        if let Row::Fused(world, m, packets, tf, tu) = *row {
            println!(
                "  {:>2} {:>4} {:>8} {:>8.1}us {:>8.1}us {:>15.2}",
                world,
                m,
                packets,
                tf.as_secs_f64() * 1e6,
                tu.as_secs_f64() * 1e6,
                tu.as_secs_f64() / tf.as_secs_f64()
            );
        }
    }
}
