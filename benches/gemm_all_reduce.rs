//! The fused GEMM + collective kernels against their unfused sequences and against the GEMM
//! alone, in one run (bf16).
//!
//! Criterion groups `{op}_bf16_{virtual,virtual-packed,gpus}_w{W}_{layer}`:
//!
//! - `gemm_all_reduce`: the DESIGN.md reference shapes of the row-parallel layers of
//!   Llama-3-70B at TP 8 (o_proj n 8192, k 1024; down n 8192, k 3584), residual + RMSNorm
//!   epilogue, m in {1, 16, 64, 256};
//! - `gemm_reduce_scatter` (sequence parallelism): o_proj, each rank keeping m / W rows of the
//!   sum, m in {16, 64, 256};
//! - `all_gather_gemm`: Llama-3-70B's QKV projection at TP 8 (n 1280, k 8192) on rows gathered
//!   from every rank (m / W each), m in {16, 64, 256};
//!
//! three ways per shape:
//!
//! - `gemm`: every rank's `[m, k]` GEMM alone, as the layers run it (at m <= 64
//!   [`gemm_with_scratch`], so that a split k runs its parts in parallel; else [`ops::gemm`]):
//!   the floor the fusion aims at, the goal `fused` within 1.05x of it for m <= 64;
//! - `unfused`: that GEMM into a workspace, then [`ops::all_reduce_fused`] with the epilogue
//!   (`Algorithm::Auto`) or [`ops::reduce_scatter`]; or [`ops::all_gather`], then the GEMM;
//! - `fused`: [`ops::gemm_all_reduce`] (`Algorithm::Auto`: one-shot or two-shot by size),
//!   [`ops::gemm_reduce_scatter`] or [`ops::all_gather_gemm`], one kernel;
//!
//! and for the all-reduce where m is a multiple of W, `fusedoneshot` and `fusedtwoshot`
//! ([`ops::gemm_all_reduce_with`] forced each way: where the two cross is what sets `Auto`).
//!
//! `virtual`: W = 2 virtual ranks on GPU 0 (each rank's kernels share the GPU with the other's:
//! a rehearsal, not a TP-2 machine); `virtual-packed`: the same for `all_gather_gemm` alone with
//! `GroupOptions::fused_blocks_per_sm: Some(32)` (as many blocks an SM as its occupancy allows,
//! where the default runs one). `gpus`: one GPU per rank ([`TpGroup::single_process`],
//! W = 2, 4, 8 as far as the machine has GPUs with peer access). Every way runs from per-rank
//! CUDA graphs of 16 rounds (launch overhead does not favour the fused path), timed with CUDA
//! events across all ranks' streams (`time_rounds`). After the groups the bench prints the
//! ratios fused/gemm and fused/unfused from its own event-timed medians, then, for every
//! fused way, where the blocks of its last launch spent their time
//! ([`TpGroup::fused_phases`]: per block, µs computing a tile, publishing, waiting, reducing).
//!
//! Without a CUDA driver the bench prints one line and registers nothing. Quick run:
//! `cargo bench --bench gemm_all_reduce -- --warm-up-time 0.5 --measurement-time 1`.

#[path = "common/mod.rs"]
mod common;
use common::{capture_rounds, check_all, dim, full_or_smoke, random_device, smoke, time_rounds};

use criterion::{BenchmarkId, Criterion};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, CudaView, CudaViewMut};
use half::bf16;
use std::sync::Arc;
use std::time::Duration;
use tpfuse::group::{BlockPhases, SPLIT_SCRATCH_BYTES};
use tpfuse::ops::gemm::{gemm_with_scratch, SPLIT_PARALLEL_M_MAX};
use tpfuse::ops::{self, Algorithm, Epilogue, GemmShape, RmsNorm};
use tpfuse::{GroupOptions, TpGroup};

type T = bf16;

/// Which collective the GEMM is fused with.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// (op, layer, n, k, m values) of the reference layers at TP 8. The sequence-parallel ops
/// take m a multiple of W (at most 8).
const CASES: [(Op, &str, usize, usize, &[usize]); 4] = [
    (Op::AllReduce, "o_proj", 8192, 1024, &[1, 16, 64, 256]),
    (Op::AllReduce, "down", 8192, 3584, &[1, 16, 64, 256]),
    (Op::ReduceScatter, "o_proj", 8192, 1024, &[16, 64, 256]),
    (Op::AllGather, "qkv", 1280, 8192, &[16, 64, 256]),
];
/// The largest m of any case (the buffers' size).
const MAX_M: usize = 256;
const ROUNDS: u64 = 16;
const SAMPLES: usize = 9;

/// The calls per graph and the timed samples (fewer in a smoke run: `common::smoke`).
fn rounds() -> u64 {
    full_or_smoke(ROUNDS, 2)
}
fn samples() -> usize {
    full_or_smoke(SAMPLES, 1)
}
const EPS: f32 = 1e-5;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Way {
    Gemm,
    Unfused,
    Fused,
    FusedOneShot,
    FusedTwoShot,
}

/// Every rank's buffers for the largest m of one layer.
struct Buffers {
    x: Vec<CudaSlice<T>>,
    w: Vec<CudaSlice<T>>,
    partial: Vec<CudaSlice<T>>,
    out: Vec<CudaSlice<T>>,
    residual: Vec<CudaSlice<T>>,
    gamma: Vec<CudaSlice<T>>,
    /// A rank's rows of the input (all-gather) and of the output (reduce-scatter).
    own_x: Vec<CudaSlice<T>>,
    own_out: Vec<CudaSlice<T>>,
    /// A rank's GEMM scratch (the layers': a split k's parts run in parallel at m <= 64).
    scratch: Vec<CudaSlice<u8>>,
}

fn buffers(groups: &[TpGroup], n: usize, k: usize) -> Buffers {
    let m = MAX_M;
    let each = |len: usize, scale: f32, seed: u64| -> Vec<CudaSlice<T>> {
        groups
            .iter()
            .enumerate()
            .map(|(r, g)| random_device(g.stream(), len, scale, seed ^ (r as u64) << 8))
            .collect()
    };
    Buffers {
        x: each(m * k, 1.0, 1),
        w: each(n * k, 2.0 / (k as f32).sqrt(), 2),
        partial: each(m * n, 1.0, 3),
        out: each(m * n, 1.0, 4),
        residual: each(m * n, 1.0, 5),
        gamma: each(n, 1.0, 6),
        own_x: each(m * k / groups.len(), 1.0, 7),
        own_out: each(m * n / groups.len(), 1.0, 8),
        scratch: groups
            .iter()
            .map(|g| {
                g.stream()
                    .alloc_zeros::<u8>(SPLIT_SCRATCH_BYTES)
                    .expect("a GEMM scratch")
            })
            .collect(),
    }
}

/// `out` `[m, n]` = `x` `[m, k]` · `wᵀ` on the rank's stream, as the layers run the GEMM: with
/// the scratch at m <= 64, so that a split k runs its parts in parallel.
fn layer_gemm(
    g: &TpGroup,
    scratch: &mut CudaSlice<u8>,
    x: &CudaView<T>,
    w: &CudaSlice<T>,
    out: &mut CudaViewMut<T>,
    shape: GemmShape,
) -> tpfuse::Result<()> {
    let GemmShape { m, n, k } = shape;
    if m <= SPLIT_PARALLEL_M_MAX {
        return gemm_with_scratch(g.stream(), x, w, None, None, out, shape, scratch);
    }
    ops::gemm(g.stream(), x, w, None, None, out, m, n, k)
}

/// Rank r's call of `way` of `op` at `m`.
fn enqueue(
    groups: &[TpGroup],
    b: &mut Buffers,
    r: usize,
    (op, way): (Op, Way),
    shape: GemmShape,
) -> tpfuse::Result<()> {
    let GemmShape { m, n, k } = shape;
    let g = &groups[r];
    let rows = m / groups.len();
    match (op, way) {
        (Op::AllReduce, _) | (_, Way::Gemm) => {}
        (_, Way::FusedOneShot | Way::FusedTwoShot) => {
            unreachable!("one-shot and two-shot are the all-reduce's ways (bench_groups)")
        }
        (Op::ReduceScatter, Way::Unfused) => {
            let mut partial = b.partial[r].slice_mut(0..m * n);
            let x = b.x[r].slice(0..m * k);
            layer_gemm(g, &mut b.scratch[r], &x, &b.w[r], &mut partial, shape)?;
            let mut own = b.own_out[r].slice_mut(0..rows * n);
            return ops::reduce_scatter(g, &partial, &mut own);
        }
        (Op::ReduceScatter, Way::Fused) => {
            let x = b.x[r].slice(0..m * k);
            let mut own = b.own_out[r].slice_mut(0..rows * n);
            return ops::gemm_reduce_scatter(g, &x, &b.w[r], &mut own, shape).map(|_| ());
        }
        (Op::AllGather, Way::Unfused) => {
            let own = b.own_x[r].slice(0..rows * k);
            ops::all_gather(g, &own, &mut b.x[r].slice_mut(0..m * k))?;
            let x = b.x[r].slice(0..m * k);
            let mut out = b.out[r].slice_mut(0..m * n);
            return layer_gemm(g, &mut b.scratch[r], &x, &b.w[r], &mut out, shape);
        }
        (Op::AllGather, Way::Fused) => {
            let own = b.own_x[r].slice(0..rows * k);
            let mut out = b.out[r].slice_mut(0..m * n);
            return ops::all_gather_gemm(g, &own, &b.w[r], None, &mut out, shape).map(|_| ());
        }
    }
    let x = b.x[r].slice(0..m * k);
    let mut out = b.out[r].slice_mut(0..m * n);
    let mut partial = b.partial[r].slice_mut(0..m * n);
    let mut residual = b.residual[r].slice_mut(0..m * n);
    let epilogue = Epilogue {
        bias: None,
        residual: Some(&mut residual),
        norm: Some(RmsNorm {
            gamma: &b.gamma[r],
            eps: EPS,
        }),
    };
    match way {
        Way::Gemm => layer_gemm(g, &mut b.scratch[r], &x, &b.w[r], &mut out, shape),
        Way::Unfused => {
            layer_gemm(g, &mut b.scratch[r], &x, &b.w[r], &mut partial, shape)?;
            ops::all_reduce_fused(g, &partial, epilogue, &mut out, Algorithm::Auto).map(|_| ())
        }
        Way::Fused => ops::gemm_all_reduce(g, &x, &b.w[r], epilogue, &mut out, shape).map(|_| ()),
        Way::FusedOneShot | Way::FusedTwoShot => {
            let algo = if way == Way::FusedOneShot {
                Algorithm::OneShot
            } else {
                Algorithm::TwoShot
            };
            ops::gemm_all_reduce_with(g, &x, &b.w[r], epilogue, &mut out, shape, algo).map(|_| ())
        }
    }
}

/// Per-rank graphs of ROUNDS calls (after one eager round: validation and module loading
/// stay outside the capture).
fn graphs(groups: &[TpGroup], b: &mut Buffers, way: (Op, Way), shape: GemmShape) -> Vec<CudaGraph> {
    for r in 0..groups.len() {
        enqueue(groups, b, r, way, shape).unwrap_or_else(|e| panic!("{way:?} rank {r}: {e}"));
    }
    check_all(groups, "warm-up");
    capture_rounds(groups, rounds(), |r| enqueue(groups, b, r, way, shape))
}

/// GPU time of `iters` launches of every rank's graph (ROUNDS calls each).
fn time_graphs(streams: &[Arc<CudaStream>], graphs: &[CudaGraph], iters: u64) -> Duration {
    time_rounds(streams, iters, || {
        for g in graphs {
            g.launch().expect("launching a graph");
        }
    })
}

/// The median of SAMPLES event-timed launches, per call.
fn per_call(streams: &[Arc<CudaStream>], graphs: &[CudaGraph]) -> Duration {
    let mut times: Vec<Duration> = (0..samples())
        .map(|_| time_graphs(streams, graphs, 1) / rounds() as u32)
        .collect();
    times.sort();
    times[times.len() / 2]
}

/// Where the blocks of every rank's last fused launch spent their time
/// ([`TpGroup::fused_phases`], the kernels' own `%globaltimer` reads): the longest rank's span
/// (its first block's start to its last block's end) and the widest spread of one rank's
/// block starts, how far apart the ranks started (virtual ranks only: one timer), and per
/// block the mean µs computing a tile, publishing, waiting, reducing, after the last tile,
/// and the rest (start and end), and the longest wait of a block.
fn phases_line(groups: &[TpGroup]) -> String {
    let mut ranks = Vec::new();
    for g in groups {
        match g.fused_phases() {
            Ok(p) if !p.is_empty() => ranks.push(p),
            Ok(_) => return "no phase records".into(),
            Err(e) => return format!("no phase records: {e}"),
        }
    }
    let us = |ns: u64| ns as f64 / 1e3;
    let first = |r: &[BlockPhases]| r.iter().map(|b| b.start_ns).min().unwrap_or(0);
    // The widest of the ranks' `last(block) - first start` (one timer per rank).
    let widest = |last: &dyn Fn(&BlockPhases) -> u64| {
        ranks
            .iter()
            .map(|r| {
                us(r.iter()
                    .map(last)
                    .max()
                    .unwrap_or(0)
                    .saturating_sub(first(r)))
            })
            .fold(0.0, f64::max)
    };
    let span = widest(&|b| b.end_ns);
    let spread = widest(&|b| b.start_ns);
    let skew = if groups.iter().all(TpGroup::is_virtual) {
        let firsts: Vec<u64> = ranks.iter().map(|r| first(r)).collect();
        let (lo, hi) = (firsts.iter().min(), firsts.iter().max());
        format!(
            ", ranks' starts within {:.1} us",
            us(hi.unwrap_or(&0) - lo.unwrap_or(&0))
        )
    } else {
        String::new()
    };
    let blocks: Vec<&BlockPhases> = ranks.iter().flatten().collect();
    let n = blocks.len() as f64;
    let mean = |f: &dyn Fn(&BlockPhases) -> u64| blocks.iter().map(|b| us(f(b))).sum::<f64>() / n;
    let tiles: u64 = blocks.iter().map(|b| b.tiles).sum();
    let gemm_per_tile = blocks.iter().map(|b| us(b.gemm_ns)).sum::<f64>() / tiles.max(1) as f64;
    let rest = mean(&|b| {
        (b.end_ns.saturating_sub(b.start_ns))
            .saturating_sub(b.gemm_ns + b.publish_ns + b.wait_ns + b.reduce_ns + b.tail_ns)
    });
    let longest_wait = blocks.iter().map(|b| us(b.wait_ns)).fold(0.0, f64::max);
    format!(
        "span {span:.1} us, block starts within {spread:.1} us{skew}; {} blocks, {tiles} tiles; per block: gemm {gemm_per_tile:.2} us/tile, publish {:.2}, wait {:.2} (longest {longest_wait:.2}), reduce {:.2}, tail {:.2}, rest {rest:.2}",
        blocks.len(),
        mean(&|b| b.publish_ns),
        mean(&|b| b.wait_ns),
        mean(&|b| b.reduce_ns),
        mean(&|b| b.tail_ns),
    )
}

fn bench_groups(
    c: &mut Criterion,
    kind: &str,
    groups: &[TpGroup],
    only: Option<Op>,
    summary: &mut Vec<String>,
    phases: &mut Vec<String>,
) {
    let world = groups.len();
    let streams: Vec<Arc<CudaStream>> = groups.iter().map(|g| g.stream().clone()).collect();
    for (op, layer, n, k, ms) in CASES
        .into_iter()
        .filter(|c| only.map_or(true, |o| o == c.0))
    {
        let (n, k) = (dim(n), dim(k));
        let ms = if smoke() { &ms[..1] } else { ms };
        let mut b = buffers(groups, n, k);
        let op_name = match op {
            Op::AllReduce => "gemm_all_reduce",
            Op::ReduceScatter => "gemm_reduce_scatter",
            Op::AllGather => "all_gather_gemm",
        };
        let mut group = c.benchmark_group(format!("{op_name}_bf16_{kind}_w{world}_{layer}"));
        for &m in ms {
            let shape = GemmShape { m, n, k };
            let mut medians = Vec::new();
            let mut ways = vec![Way::Gemm, Way::Unfused, Way::Fused];
            if op == Op::AllReduce && m % world == 0 {
                ways.extend([Way::FusedOneShot, Way::FusedTwoShot]);
            }
            for way in ways {
                let gs = graphs(groups, &mut b, (op, way), shape);
                let name = format!("{way:?}").to_lowercase();
                group.bench_function(BenchmarkId::new(name, format!("m{m}")), |bench| {
                    bench.iter_custom(|iters| time_graphs(&streams, &gs, iters))
                });
                medians.push(per_call(&streams, &gs));
                check_all(groups, "timed rounds");
                if way != Way::Gemm && way != Way::Unfused {
                    phases.push(format!(
                        "{op_name} {kind} W={world} {layer} m={m} {way:?}: {}",
                        phases_line(groups)
                    ));
                }
            }
            let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
            let forced = match medians[..] {
                [.., one, two] if medians.len() == 5 => format!(
                    "; one-shot {one:?}, two-shot {two:?}, two-shot/one-shot {:.3}",
                    ratio(two, one)
                ),
                _ => String::new(),
            };
            summary.push(format!(
                "{op_name} {kind} W={world} {layer} m={m}: gemm {:?}, unfused {:?}, fused {:?}; fused/gemm {:.3}, fused/unfused {:.3}{forced}",
                medians[0],
                medians[1],
                medians[2],
                ratio(medians[2], medians[0]),
                ratio(medians[2], medians[1]),
            ));
        }
        group.finish();
    }
}

fn main() {
    if !common::driver_present("gemm_all_reduce") {
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
    let options = GroupOptions {
        capacity_bytes: 64 << 20,
        ..GroupOptions::default()
    };
    let mut summary = Vec::new();
    let mut phases = Vec::new();
    let ctx = tpfuse::device::open(0).unwrap_or_else(|e| panic!("opening GPU 0: {e}"));
    // SAFETY: every buffer lives on its rank's stream.
    unsafe { ctx.disable_event_tracking() };
    match TpGroup::virtual_ranks(&ctx, 2, options.clone()) {
        Ok(groups) => bench_groups(&mut c, "virtual", &groups, None, &mut summary, &mut phases),
        Err(e) => println!("virtual ranks could not be built: {e}"),
    }
    // All-gather + GEMM with as many blocks an SM as its occupancy allows (the default is one:
    // GroupOptions::fused_blocks_per_sm), against the same GEMM and unfused sequence.
    let packed = GroupOptions {
        fused_blocks_per_sm: Some(32),
        ..options.clone()
    };
    match TpGroup::virtual_ranks(&ctx, 2, packed) {
        Ok(groups) => {
            let kind = "virtual-packed";
            bench_groups(
                &mut c,
                kind,
                &groups,
                Some(Op::AllGather),
                &mut summary,
                &mut phases,
            )
        }
        Err(e) => println!("virtual ranks could not be built: {e}"),
    }
    let count = tpfuse::device::device_count().unwrap_or(0);
    for world in [2, 4, 8].into_iter().filter(|&w| w <= count) {
        let ordinals: Vec<usize> = (0..world).collect();
        match TpGroup::single_process(&ordinals, options.clone()) {
            Ok(groups) if groups[0].custom_kernels_refused().is_none() => {
                bench_groups(&mut c, "gpus", &groups, None, &mut summary, &mut phases)
            }
            Ok(groups) => println!(
                "GPUs {ordinals:?}: no custom kernels ({}): the fused path cannot run",
                groups[0].custom_kernels_refused().unwrap_or("?")
            ),
            Err(e) => println!("GPUs {ordinals:?}: {e}"),
        }
    }
    c.final_summary();
    println!(
        "\nmedian per call, {} samples of {}-call graphs:",
        samples(),
        rounds()
    );
    for line in summary {
        println!("  {line}");
    }
    println!("\nwhere the last fused launch's blocks spent their time (TpGroup::fused_phases):");
    for line in phases {
        println!("  {line}");
    }
}
