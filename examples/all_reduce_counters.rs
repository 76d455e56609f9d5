//! The decode-size all-reduce table of docs/all-reduce.md, from the CPU emulator's counters:
//! W = 8 virtual ranks on an emulated H100 (132 SMs), bf16, hidden 8192, m = 1, 16, 64, for
//! each algorithm, plain and with the fused residual + RMSNorm epilogue.
//!
//! ```sh
//! eval "$(scripts/setup.sh)" && cargo run --features emulator --example all_reduce_counters
//! ```
//!
//! Per launch (the worst rank): the collective's blocks, cross-rank barriers per block, the busiest block's
//! peer bytes over the mean, peer bytes per rank against the lower bound of the algorithm
//! ((W-1)·n·size for one-shot, 2·(W-1)/W·n·size for two-shot), and global bytes per rank
//! against reading the inputs and writing the outputs once. The last column is a model, not a
//! measurement: peer bytes at 450 GB/s (H100 NVLink, one direction) plus 2 µs per barrier
//! round.

use half::bf16;
use tpfuse::emulator::counters::{self, LaunchCounters};
use tpfuse::ops::{self, Algorithm, Epilogue, RmsNorm};
use tpfuse::{GroupOptions, TpGroup};

type T = bf16;
const WORLD: usize = 8;
const HIDDEN: usize = 8192;
const SIZE: f64 = 2.0;
const LINK_BYTES_PER_S: f64 = 450e9;
const ROUND_S: f64 = 2e-6;

fn main() -> tpfuse::Result<()> {
    let ctx = tpfuse::device::open(0)?;
    let groups = TpGroup::virtual_ranks(&ctx, WORLD, GroupOptions::default())?;
    println!(
        "W = {WORLD}, bf16, hidden {HIDDEN}, a budget of {} blocks per rank (emulated H100, 132 SMs)\n",
        groups[0].blocks()
    );
    println!(
        "| m | algorithm | epilogue | blocks | barriers/block | peer max/mean | peer bytes/rank (x bound) | global bytes/rank (x inputs+outputs) | model µs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for m in [1usize, 16, 64] {
        for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
            for fused in [false, true] {
                let launches = run(&groups, m, algo, fused)?;
                row(m, algo, fused, &launches);
            }
        }
    }
    Ok(())
}

/// One round of the op on every rank, counted; the launches of the round.
fn run(
    groups: &[TpGroup],
    m: usize,
    algo: Algorithm,
    fused: bool,
) -> tpfuse::Result<Vec<LaunchCounters>> {
    let n = m * HIDDEN;
    let s = |g: &TpGroup, v: f32, len: usize| g.stream().clone_htod(&vec![T::from_f32(v); len]);
    let cuda = |e| tpfuse::Error::Cuda {
        context: "upload",
        source: e,
    };
    let mut ins = Vec::new();
    let mut outs = Vec::new();
    let mut residuals = Vec::new();
    let mut gammas = Vec::new();
    for (r, g) in groups.iter().enumerate() {
        ins.push(s(g, r as f32 * 0.25 - 1.0, n).map_err(cuda)?);
        outs.push(s(g, 0.0, n).map_err(cuda)?);
        residuals.push(s(g, 0.5, n).map_err(cuda)?);
        gammas.push(s(g, 1.0, HIDDEN).map_err(cuda)?);
    }
    let (result, launches) = counters::count(|| -> tpfuse::Result<()> {
        for r in 0..groups.len() {
            let epilogue = if fused {
                Epilogue {
                    bias: None,
                    residual: Some(&mut residuals[r]),
                    norm: Some(RmsNorm {
                        gamma: &gammas[r],
                        eps: 1e-5,
                    }),
                }
            } else {
                Epilogue::default()
            };
            ops::all_reduce_fused(&groups[r], &ins[r], epilogue, &mut outs[r], algo)?;
        }
        groups.iter().try_for_each(TpGroup::check)
    });
    result?;
    Ok(launches)
}

fn row(m: usize, algo: Algorithm, fused: bool, launches: &[LaunchCounters]) {
    let n = (m * HIDDEN) as f64;
    let w = WORLD as f64;
    // Per rank: every launch of that rank in the round (two-shot + RMSNorm is two kernels).
    let mut worst_peer = 0u64;
    let mut worst_global = 0u64;
    let mut rounds = 0u64;
    let mut blocks = 0usize;
    let mut balance: f64 = 0.0;
    for r in 0..WORLD {
        let mine: Vec<&LaunchCounters> = launches.iter().filter(|l| l.rank == Some(r)).collect();
        let peer: u64 = mine.iter().map(|l| l.total().peer_bytes()).sum();
        let global: u64 = mine
            .iter()
            .map(|l| l.total().global_read_bytes + l.total().global_write_bytes)
            .sum();
        worst_peer = worst_peer.max(peer);
        worst_global = worst_global.max(global);
        for l in &mine {
            if !l.kernel.contains("rms_norm") {
                blocks = blocks.max(l.blocks.len());
            }
            rounds = rounds.max(l.blocks.iter().map(|b| b.barriers).max().unwrap_or(0));
            balance = balance.max(l.peer_read_balance().unwrap_or(0.0));
        }
    }
    let bound = match algo {
        Algorithm::OneShot => (w - 1.0) * n * SIZE,
        _ => 2.0 * (w - 1.0) / w * n * SIZE,
    };
    // Inputs read and outputs written once: partial and out (+ residual read and written).
    let io = if fused { 4.0 } else { 2.0 } * n * SIZE;
    let model_us = (worst_peer as f64 / LINK_BYTES_PER_S + rounds as f64 * ROUND_S) * 1e6;
    println!(
        "| {m} | {algo:?} | {} | {blocks} | {rounds} | {balance:.2} | {worst_peer} ({:.2}x) | {worst_global} ({:.2}x) | {model_us:.1} |",
        if fused { "residual + RMSNorm" } else { "none" },
        worst_peer as f64 / bound,
        worst_global as f64 / io,
    );
}
