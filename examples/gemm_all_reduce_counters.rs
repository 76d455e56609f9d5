//! The counters tables of docs/fused-gemm.md, from the CPU emulator, bf16, W = 8 virtual ranks
//! with 128 SMs each (about an H100's 132), for m = 1 and 64 (or the m given as arguments):
//! the GEMM alone, the unfused sequence and the fused kernel (the GEMM, alone and unfused, as
//! the layers run it: with a scratch at m <= 64, so that a split k runs its parts in parallel),
//! for one of
//!
//! - `all-reduce` (the default): the row-parallel o_proj of Llama-3-70B at TP 8 (n = hidden =
//!   8192, k = 8192 / 8 = 1024) with the residual + RMSNorm epilogue; unfused: the GEMM into a
//!   workspace, then the one-shot all-reduce;
//! - `reduce-scatter`: the same GEMM, each rank keeping its m / W rows of the sum; unfused: the
//!   GEMM, then `reduce_scatter`;
//! - `all-gather`: Llama-3-70B's QKV projection at TP 8 (n = (64 + 2·8)·128 / 8 = 1280,
//!   k = 8192) on the rows gathered from every rank (m / W each); unfused: `all_gather`, then
//!   the GEMM.
//!
//! m must be a multiple of W for the last two.
//!
//! ```sh
//! eval "$(scripts/setup.sh)" && cargo run --features emulator --example gemm_all_reduce_counters [all-reduce|reduce-scatter|all-gather] [m ...]
//! ```
//!
//! Per rank (the worst one): kernel launches, blocks per launch, cross-rank synchronisation
//! rounds of the busiest block (barriers; for the fused kernels, flag waits), global bytes
//! read and written, of which peer bytes (read from or written to another rank's memory).
//! The minimum a rank must move: its weight shard (n·k) and its input (m·k), then for the
//! all-reduce the other ranks' partials ((W-1)·m·n one-shot; two-shot, the others' partials of
//! its slice and the other slices' results, 2·(W-1)/W·m·n), the residual read and written and
//! out written (3·m·n); for the reduce-scatter the other ranks' partials of its rows
//! ((W-1)·(m/W)·n) and its rows written ((m/W)·n); for the all-gather (input m·k counted as its
//! own m/W rows and the others' (W-1)·(m/W) rows) out written (m·n); for the GEMM alone out
//! written (m·n). The all-reduce runs one-shot, and two-shot where m is a multiple of W. The
//! last column is a model, not a measurement: local bytes over 3.0 TB/s (HBM copy bandwidth
//! measured on an H100) scaled by the share of the 132 SMs the launch's blocks occupy (an
//! assumption: an SM streams no more than its share), plus peer bytes over 450 GB/s (NVLink,
//! one direction), plus 2 µs per synchronisation round on the critical path, plus 4 µs per
//! extra kernel launch. The fused GEMM + all-reduce waits once per block for the other ranks'
//! flags, after its GEMM (one round; one-shot's strip flags or two-shot's slices one more);
//! all-gather + GEMM's part waits overlap its GEMM but one, so it is charged one round.

use cudarc::driver::CudaSlice;
use half::bf16;
use tpfuse::emulator::counters::{self, LaunchCounters};
use tpfuse::group::SPLIT_SCRATCH_BYTES;
use tpfuse::ops::gemm::{gemm_with_scratch, SPLIT_PARALLEL_M_MAX};
use tpfuse::ops::{
    self, all_gather_gemm, gemm, gemm_all_reduce_with, gemm_reduce_scatter, Algorithm, Epilogue,
    GemmShape, RmsNorm,
};
use tpfuse::{GroupOptions, TpGroup};

type T = bf16;
const WORLD: usize = 8;
const SIZE: u64 = 2;
const HBM_BYTES_PER_S: f64 = 3.0e12;
const LINK_BYTES_PER_S: f64 = 450e9;
const ROUND_S: f64 = 2e-6;
const LAUNCH_S: f64 = 4e-6;
const SMS_PER_RANK: usize = 128;

/// Which collective follows (or precedes) the GEMM.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Op {
    /// The GEMM's (n, k).
    fn nk(self) -> (usize, usize) {
        match self {
            Op::AllReduce | Op::ReduceScatter => (8192, 1024),
            Op::AllGather => (1280, 8192),
        }
    }
}

/// How a round runs: the GEMM alone, or with its collective unfused or fused; for the
/// all-reduce, one-shot or two-shot (the reduce-scatter and the all-gather have one way).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Way {
    GemmAlone,
    Unfused(Algorithm),
    Fused(Algorithm),
}

impl Way {
    /// The ways of `op` at `m` rows: the all-reduce's two-shot only where m splits into W.
    fn all(op: Op, m: usize) -> Vec<Way> {
        let mut algos = vec![Algorithm::Auto];
        if op == Op::AllReduce {
            algos = vec![Algorithm::OneShot];
            if m % WORLD == 0 {
                algos.push(Algorithm::TwoShot);
            }
        }
        let mut ways = vec![Way::GemmAlone];
        ways.extend(algos.iter().map(|&a| Way::Unfused(a)));
        ways.extend(algos.iter().map(|&a| Way::Fused(a)));
        ways
    }

    fn name(self) -> String {
        let algo = |a: Algorithm| match a {
            Algorithm::OneShot => " one-shot",
            Algorithm::TwoShot => " two-shot",
            _ => "",
        };
        match self {
            Way::GemmAlone => "GemmAlone".into(),
            Way::Unfused(a) => format!("Unfused{}", algo(a)),
            Way::Fused(a) => format!("Fused{}", algo(a)),
        }
    }
}

fn main() -> tpfuse::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let op = match args.first().map(String::as_str) {
        Some("reduce-scatter") => Op::ReduceScatter,
        Some("all-gather") => Op::AllGather,
        _ => Op::AllReduce,
    };
    let ms: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let default = if op == Op::AllReduce { 1 } else { WORLD };
    let ms = if ms.is_empty() { vec![default, 64] } else { ms };
    let (n, k) = op.nk();
    // Every virtual rank gets 128 SMs (the emulator holds 1024 at most; an H100 has 132), so
    // its persistent grid is about a real TP-8 group's (TpGroup::fused_blocks).
    let mut config = tpfuse::emulator::config();
    config.sms = (SMS_PER_RANK * WORLD) as u32;
    tpfuse::emulator::set_config(&config)?;
    let ctx = tpfuse::device::open(0)?;
    let groups = TpGroup::virtual_ranks(&ctx, WORLD, GroupOptions::default())?;
    println!(
        "{op:?}: W = {WORLD}, bf16, n = {n}, k = {k}{}, {SMS_PER_RANK} SMs per rank, the fused grids' SMs {}\n",
        if op == Op::AllReduce { ", residual + RMSNorm" } else { "" },
        groups[0].fused_blocks()
    );
    println!("| m | way | launches/rank | blocks | sync rounds | global bytes/rank (x minimum) | of which peer | model µs |");
    println!("|---|---|---|---|---|---|---|---|");
    for m in ms {
        for way in Way::all(op, m) {
            let launches = run(&groups, op, m, way)?;
            row(op, m, way, &launches);
        }
    }
    Ok(())
}

/// One round of the layer on every rank, counted; the launches of the round.
fn run(groups: &[TpGroup], op: Op, m: usize, way: Way) -> tpfuse::Result<Vec<LaunchCounters>> {
    let (n, k) = op.nk();
    let rows = m / WORLD; // a rank's rows for the reduce-scatter and the all-gather
    let cuda = |e| tpfuse::Error::Cuda {
        context: "upload",
        source: e,
    };
    let fill = |g: &TpGroup, len: usize, seed: usize| {
        let host: Vec<T> = (0..len)
            .map(|i| T::from_f32((((i * 7 + seed * 13) % 29) as f32 - 14.0) / 64.0))
            .collect();
        g.stream().clone_htod(&host).map_err(cuda)
    };
    let (mut xs, mut ws, mut parts, mut outs, mut residuals, mut gammas) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let (mut own_rows, mut slices, mut scratches) = (vec![], vec![], vec![]);
    for (r, g) in groups.iter().enumerate() {
        scratches.push(
            g.stream()
                .alloc_zeros::<u8>(SPLIT_SCRATCH_BYTES)
                .map_err(cuda)?,
        );
        xs.push(fill(g, m * k, r)?);
        ws.push(fill(g, n * k, r + 8)?);
        parts.push(fill(g, m * n, 0)?);
        outs.push(fill(g, m * n, 0)?);
        residuals.push(fill(g, m * n, 1)?);
        gammas.push(fill(g, n, 2)?);
        // (Unused by the all-reduce, whose m need not be a multiple of W: never empty.)
        own_rows.push(fill(g, (rows * k).max(8), r)?);
        slices.push(fill(g, (rows * n).max(8), 0)?);
    }
    let shape = GemmShape { m, n, k };
    let (result, launches) = counters::count(|| -> tpfuse::Result<()> {
        for r in 0..groups.len() {
            let g = &groups[r];
            let epilogue = Epilogue {
                bias: None,
                residual: Some(&mut residuals[r]),
                norm: Some(RmsNorm {
                    gamma: &gammas[r],
                    eps: 1e-5,
                }),
            };
            match (op, way) {
                (_, Way::GemmAlone) => {
                    plain_gemm(g, &mut scratches[r], &xs[r], &ws[r], &mut outs[r], shape)?
                }
                (Op::AllReduce, Way::Unfused(algo)) => {
                    plain_gemm(g, &mut scratches[r], &xs[r], &ws[r], &mut parts[r], shape)?;
                    ops::all_reduce_fused(g, &parts[r], epilogue, &mut outs[r], algo)?;
                }
                (Op::AllReduce, Way::Fused(algo)) => {
                    let (x, w, out) = (&xs[r], &ws[r], &mut outs[r]);
                    gemm_all_reduce_with(g, x, w, epilogue, out, shape, algo)?;
                }
                (Op::ReduceScatter, Way::Unfused(_)) => {
                    plain_gemm(g, &mut scratches[r], &xs[r], &ws[r], &mut parts[r], shape)?;
                    ops::reduce_scatter(g, &parts[r], &mut slices[r])?;
                }
                (Op::ReduceScatter, Way::Fused(_)) => {
                    gemm_reduce_scatter(g, &xs[r], &ws[r], &mut slices[r], shape)?;
                }
                (Op::AllGather, Way::Unfused(_)) => {
                    ops::all_gather(g, &own_rows[r], &mut xs[r])?;
                    plain_gemm(g, &mut scratches[r], &xs[r], &ws[r], &mut outs[r], shape)?;
                }
                (Op::AllGather, Way::Fused(_)) => {
                    all_gather_gemm(g, &own_rows[r], &ws[r], None, &mut outs[r], shape)?;
                }
            }
        }
        groups.iter().try_for_each(TpGroup::check)
    });
    result?;
    Ok(launches)
}

/// `out` `[m, n]` = `x` `[m, k]` · `wᵀ` on the rank's stream: the GEMM alone, as the layers
/// run it (a decode-sized call with a scratch, so that a split k runs its parts in parallel).
fn plain_gemm(
    g: &TpGroup,
    scratch: &mut CudaSlice<u8>,
    x: &CudaSlice<T>,
    w: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
    shape: GemmShape,
) -> tpfuse::Result<()> {
    let GemmShape { m, n, k } = shape;
    if m <= SPLIT_PARALLEL_M_MAX {
        return gemm_with_scratch(g.stream(), x, w, None, None, out, shape, scratch);
    }
    gemm(g.stream(), x, w, None, None, out, m, n, k)
}

fn row(op: Op, m: usize, way: Way, launches: &[LaunchCounters]) {
    let (n, k) = op.nk();
    let (m64, n, k, w) = (m as u64, n as u64, k as u64, WORLD as u64);
    let mut worst = (0usize, 0usize, 0u64, 0u64, 0u64); // launches, blocks, rounds, global, peer
    for r in 0..WORLD {
        let mine: Vec<&LaunchCounters> = launches.iter().filter(|l| l.rank == Some(r)).collect();
        let global: u64 = mine
            .iter()
            .map(|l| l.total().global_read_bytes + l.total().global_write_bytes)
            .sum();
        let peer: u64 = mine.iter().map(|l| l.total().peer_bytes()).sum();
        let rounds: u64 = mine
            .iter()
            .map(|l| l.blocks.iter().map(|b| b.barriers).max().unwrap_or(0))
            .sum();
        let blocks = mine.iter().map(|l| l.blocks.len()).max().unwrap_or(0);
        worst = (
            worst.0.max(mine.len()),
            worst.1.max(blocks),
            worst.2.max(rounds),
            worst.3.max(global),
            worst.4.max(peer),
        );
    }
    let (count, blocks, rounds, global, peer) = worst;
    let rows = m64 / w;
    // The all-reduce's peer part: one-shot reads the W-1 other partials whole; two-shot the
    // other ranks' partials of its slice, then the other slices' results.
    let peer_minimum = match way {
        Way::Unfused(Algorithm::TwoShot) | Way::Fused(Algorithm::TwoShot) => {
            2 * (w - 1) * m64 * n / w
        }
        _ => (w - 1) * m64 * n,
    };
    let minimum = match (op, way) {
        (_, Way::GemmAlone) | (Op::AllGather, _) => (n * k + m64 * k + m64 * n) * SIZE,
        (Op::AllReduce, _) => (n * k + m64 * k + peer_minimum + 3 * m64 * n) * SIZE,
        (Op::ReduceScatter, _) => (n * k + m64 * k + (w - 1) * rows * n + rows * n) * SIZE,
    };
    // The rounds on the critical path: the fused GEMM + all-reduce's are the waits it passes
    // (its block flags, then one-shot's strip flags or two-shot's slices); all-gather + GEMM's
    // part waits overlap its GEMM but one.
    let critical_rounds = match (op, way) {
        (Op::AllGather, Way::Fused(_)) => rounds.min(1),
        _ => rounds,
    };
    let share = (blocks as f64 / 132.0).min(1.0);
    let model_us = ((global - peer) as f64 / (HBM_BYTES_PER_S * share)
        + peer as f64 / LINK_BYTES_PER_S
        + critical_rounds as f64 * ROUND_S
        + (count.saturating_sub(1)) as f64 * LAUNCH_S)
        * 1e6;
    println!(
        "| {m} | {} | {count} | {blocks} | {rounds} | {global} ({:.3}x) | {peer} | {model_us:.1} |",
        way.name(),
        global as f64 / minimum as f64,
    );
}
