//! The fused row-parallel layer's row of the plan (`cuda/gemm_all_reduce.cu`: GEMM +
//! all-reduce + residual + RMSNorm in one persistent launch): whether a layer fuses, the
//! bytes each block of the launch moves, and its model.

use super::model::LayerGemm;
use super::profile::DeviceProfile;
use super::rows::{
    chain_seconds, fused_blocks_per_sm, gemm_block_bytes, gemm_in_flight, gemm_split_block_bytes,
    held_segments, limits, per_sm, split_choice, tile_extent, us, Model, PlanRow,
    COLLECTIVE_THREADS, ELEMENT_BYTES,
};
use crate::ops::all_reduce::Algorithm;
use crate::ops::gemm::{GemmConfig, GemmConfigInfo, GemmShape};
use crate::ops::gemm_all_reduce::{
    fused_all_reduce_algo, planned, unfusable, FusedFacts, FusedPlan, MAX_TILES,
};
use crate::ops::linear::Fusion;
use crate::topology::{AllReduceAlgo, FusedKernel, FusionRule};
use half::bf16;

/// Whether a fused block of configuration `info` normalises a row of `n` through its shared
/// memory (`rms_norm_row_staged` in `cuda/epilogue.cuh`): the row's x and gamma fit what the
/// GEMM leaves after count_strips' names (`kNamesBytes` in `cuda/gemm_all_reduce.cu`).
fn norm_staged(info: &GemmConfigInfo, n: usize) -> bool {
    let names = MAX_TILES * std::mem::size_of::<i32>();
    2 * n * ELEMENT_BYTES as usize <= info.smem_bytes.saturating_sub(names)
}

/// Bytes a fused block's RMSNorm of one row moves per element (`rms_norm_row` in
/// `cuda/epilogue.cuh`, blocks of `info.threads`): the row read for its sum of squares, read
/// again with gamma and written (4), or, a row the block holds in registers
/// ([`held_segments`]) or stages in shared memory ([`norm_staged`]), read once with gamma and
/// normalised from there (3: `rms_norm_held_row`, `rms_norm_row_staged`).
fn norm_bytes_per_element(info: &GemmConfigInfo, n: usize) -> u64 {
    let segment = COLLECTIVE_THREADS * (16 / ELEMENT_BYTES as usize);
    if n <= held_segments(info.threads, ELEMENT_BYTES) * segment || norm_staged(info, n) {
        3
    } else {
        4
    }
}

/// Bytes per element the fused GEMM + all-reduce's RMSNorm moves for one row of `n` on the
/// blocks of `config` (its fused variant, [`GemmConfig::fused_info`]), as [`fused_row`] counts
/// them:
/// - one-shot, a row of out normalised in place: read with gamma, then written (3), where the
///   block holds the row in registers or stages it in its shared memory (`cuda/epilogue.cuh`,
///   `rms_norm_row`); else read twice (4);
/// - two-shot, a row gathered from its owner and normalised, its copy included: 3 where it
///   stages, else 2 + the in-place norm's.
///
/// `tests/emu_counters.rs` checks both against the kernel's counters.
pub fn fused_norm_bytes(config: GemmConfig, n: usize) -> (u64, u64) {
    let info = config.fused_info();
    let norm = norm_bytes_per_element(&info, n);
    let gathered = if norm_staged(&info, n) { 3 } else { 2 + norm };
    (norm, gathered)
}

/// Global bytes (read and written, L2 hits included) that each block of rank `rank` moves in
/// the fused GEMM + all-reduce of `shape` on `world` ranks, as `cuda/gemm_all_reduce.cu` runs
/// `plan` (its `all_reduce` algorithm, `OneShot` when `None`, and its `packets`), with a
/// residual, no bias, and RMSNorm where `norm`:
/// - per unit (block u mod G): a tile's GEMM (its A rows and B rows, its partial stored:
///   [`gemm_block_bytes`]); or, with the parts in parallel, a part of a tile
///   ([`gemm_split_block_bytes`]: its f32 chains stored, folded, the last fold storing the
///   tile's partial);
/// - per tile (block t mod G), what the rank reduces of it: one-shot by flags, every rank's
///   partial read, the residual read and written, out written (W + 3 an element); by packets
///   the W ranks' packets read and cleared (4W + 3), and the tile's producer (the block of its
///   last part) stores W ranks' packets where the exchange took one partial (2W - 1 more);
///   two-shot, the rows of the rank's slice only (W + 3: the reduced rows go to its exchange
///   area);
/// - one-shot with RMSNorm, a row normalised ([`fused_norm_bytes`]' first figure an element):
///   a strip's first row on the block of the strip's last column tile (in the kernel,
///   whichever block completes the strip), its other rows dealt (row r to block r mod G);
/// - two-shot, rows b, b + G, ... gathered from their owner into out (read and written; with
///   RMSNorm, [`fused_norm_bytes`]' second figure), and a row of a peer's slice also into the
///   residual.
///
/// `tests/emu_counters.rs` checks it block by block against the kernel's counters, by flags.
///
/// # Panics
///
/// When `world` is 0 (a plan's group has at least one rank).
pub fn fused_block_bytes(
    plan: &FusedPlan,
    shape: GemmShape,
    world: usize,
    rank: usize,
    norm: bool,
) -> Vec<u64> {
    let (config, tiles, grid, parts) = (plan.config, plan.tiles, plan.grid, plan.parts);
    let algo = plan.all_reduce.unwrap_or(AllReduceAlgo::OneShot);
    let info = config.info();
    let (m, n) = (shape.m, shape.n);
    let tiles_n = n.div_ceil(info.block_n);
    let (s, w) = (ELEMENT_BYTES, world as u64);
    let (row_norm, gathered) = fused_norm_bytes(config, n);
    let row_bytes = n as u64 * s;
    let unit_bytes = if plan.parts_in_parallel {
        gemm_split_block_bytes(config, shape, parts, false, false)
    } else {
        gemm_block_bytes(config, shape, false, false)
    };
    let mut per_block = vec![0u64; grid];
    for (unit, bytes) in unit_bytes.iter().enumerate() {
        per_block[unit % grid] += bytes;
    }
    let slice = m / world;
    let (slice_begin, slice_end) = (rank * slice, (rank + 1) * slice);
    for tile in 0..tiles {
        let (rows, cols, tm, tn) = tile_extent(config, shape, tile);
        let out = rows * cols * s;
        let reduce = match algo {
            AllReduceAlgo::OneShot if plan.packets => {
                let producer = if plan.parts_in_parallel {
                    (parts - 1) * tiles + tile
                } else {
                    tile
                };
                per_block[producer % grid] += (2 * w - 1) * out;
                (4 * w + 3) * out
            }
            AllReduceAlgo::TwoShot => {
                let first = tm * info.block_m;
                let end = (first + rows as usize).min(slice_end);
                let mine = end.saturating_sub(first.max(slice_begin)) as u64;
                (w + 3) * mine * cols * s
            }
            _ => (w + 3) * out,
        };
        per_block[tile % grid] += reduce;
        if norm && tn + 1 == tiles_n && algo == AllReduceAlgo::OneShot {
            per_block[tile % grid] += row_norm * row_bytes;
        }
    }
    match algo {
        AllReduceAlgo::OneShot if norm => {
            for row in (0..m).filter(|row| row % info.block_m != 0) {
                per_block[row % grid] += row_norm * row_bytes;
            }
        }
        AllReduceAlgo::TwoShot => {
            for row in 0..m {
                let copied = if norm { gathered } else { 2 };
                let peers = u64::from(row / slice != rank);
                per_block[row % grid] += (copied + peers) * row_bytes;
            }
        }
        _ => {}
    }
    per_block
}

fn fused_facts(tp: usize, p: &DeviceProfile) -> FusedFacts {
    let blocks_per_sm = GemmConfig::ALL.map(|config| fused_blocks_per_sm(config, p));
    FusedFacts {
        device: 0,
        world: tp,
        capacity: crate::group::GroupOptions::default().capacity_bytes,
        compute_capability: p.compute_capability,
        sms: p.sms,
        blocks: p.sms,
        group_sms: (p.sms, p.sms),
        blocks_per_sm,
        // The default options: one block an SM (TpGroup's).
        gather_blocks_per_sm: [1; 5],
        one_shot_below: limits(tp, p).map(|l| l.one_shot_below),
        packet_bytes: crate::group::PACKET_HALF_BYTES,
    }
}

/// Why a row-parallel layer at `m` on `tp` ranks of `p` does not fuse under `fusion` (None:
/// it fuses), by [`FusionRule`] and what the fused kernel takes (a layer that forces fusion
/// on a shape the kernel cannot take gets an error; its row says why).
pub(super) fn not_fused(
    g: &LayerGemm,
    m: usize,
    tp: usize,
    p: &DeviceProfile,
    fusion: Fusion,
) -> Option<String> {
    if tp < 2 {
        return Some("one rank: nothing to reduce".into());
    }
    let refused = || {
        if limits(tp, p).is_none() {
            return Some(format!("no custom kernels for {tp} ranks over PCIe"));
        }
        unfusable::<bf16>(GemmShape { m, n: g.n, k: g.k }, &fused_facts(tp, p))
    };
    match fusion {
        Fusion::Unfused => Some("Fusion::Unfused".into()),
        Fusion::Fused => refused().map(|why| format!("Fusion::Fused refused: {why}")),
        Fusion::Auto => {
            let max_m = FusionRule::default().max_m(FusedKernel::RowParallel);
            if max_m == 0 {
                return Some("Fusion::Auto: slower fused on an H200, docs/performance.md".into());
            }
            if m > max_m {
                return Some(format!("Fusion::Auto: m = {m} is past the rule's {max_m}"));
            }
            let shape = GemmShape { m, n: g.n, k: g.k };
            if planned(shape, &fused_facts(tp, p), FusedKernel::RowParallel)
                .is_ok_and(|plan| plan.parts > 1 && !plan.parts_in_parallel)
            {
                return Some("Fusion::Auto: fused, the parts would run one after another".into());
            }
            refused()
        }
    }
}

/// The row of a fused row-parallel layer: GEMM + all-reduce + residual + RMSNorm in one
/// persistent launch (`cuda/gemm_all_reduce.cu`).
pub fn fused_row(g: &LayerGemm, m: usize, tp: usize, p: &DeviceProfile) -> Option<PlanRow> {
    let shape = GemmShape { m, n: g.n, k: g.k };
    let facts = fused_facts(tp, p);
    // The launch's plan: the GEMM's tiles, and a persistent grid of as many blocks as the SMs
    // hold at once.
    let plan = planned(shape, &facts, FusedKernel::RowParallel).ok()?;
    let (config, tiles, grid, parts) = (plan.config, plan.tiles, plan.grid, plan.parts);
    let s = ELEMENT_BYTES;
    let w = tp as u64;
    let bytes = (m * g.n) as u64 * s;
    let algo = fused_all_reduce_algo::<bf16>(shape, &facts, Algorithm::Auto).ok()?;
    let reducing = plan.reducing(algo, shape, &facts);
    let packets = reducing.packets;
    // What each block moves, with the layer's residual and RMSNorm.
    let per_block = fused_block_bytes(&reducing, shape, tp, 0, true);
    let (max, mean, streaming) = per_sm(&per_block, p.sms);
    // The block's ring runs through every part of k without draining; with the parts in
    // parallel, through its part.
    let block_k = if plan.parts_in_parallel {
        g.k.div_ceil(parts)
    } else {
        g.k
    };
    let flight = gemm_in_flight(
        config,
        (m, block_k),
        grid,
        p,
        "gemm_all_reduce_kernel",
        true,
    );
    let peer_bytes = match algo {
        AllReduceAlgo::OneShot if packets => 2.0 * (w - 1) as f64 * bytes as f64,
        AllReduceAlgo::OneShot => (w - 1) as f64 * bytes as f64,
        _ => 2.0 * (w - 1) as f64 / w as f64 * bytes as f64,
    };
    let total: u64 = per_block.iter().sum();
    // A block computes its units back to back, publishes one flag (with the parts in
    // parallel: the block folding a tile's last part publishes the tile), waits once for every
    // rank's (per tile), then reduces all its tiles with their loads dealt over its threads
    // (cuda/gemm_all_reduce.cu): one round, one peer read (the reduction's loads issued once
    // the GEMM is done: exposed; by packets none, the partials come with the round), and a
    // pipeline fill for each unit after the first (each
    // unit's ring starts empty; the first fill is every GEMM's, which the streaming term
    // leaves out for the GEMM alone too); then, one-shot, the strip's flag for the dealt rows
    // (a strip of more than one row), two-shot the slices'. (The kernel measured on an H200,
    // which published, awaited and reduced each tile between its GEMM tiles, spent about
    // 3.7 us per tile on them: docs/performance.md, "Second H200 run".) Folding the parts, as
    // in the GEMM alone's row, counts in the busiest SM's bytes only.
    let units = tiles * if plan.parts_in_parallel { parts } else { 1 };
    let units_per_block = units.div_ceil(grid);
    let rounds = 1 + match algo {
        AllReduceAlgo::OneShot if m == 1 => 0,
        _ => 1,
    };
    // Two-shot: the gather's peer read too, after the slice flags (a thread keeps its
    // vectors of a row in flight together: cuda/copy.cuh). Packets: none, the partials
    // arrive with the round (cuda/packets.cuh).
    let peer_reads = match algo {
        AllReduceAlgo::TwoShot => 2,
        _ if packets => 0,
        _ => 1,
    };
    let serial_s =
        (units_per_block - 1) as f64 * p.streaming_latency_s + peer_reads as f64 * p.peer_latency_s;
    let minimum = ((g.n * g.k + m * g.k + 3 * m * g.n) as u64 * s) as f64;
    let floor = (minimum / p.dram_bytes_per_s).max(peer_bytes / p.link_bytes_per_s) + p.round_s;
    let model = Model {
        launches: 1,
        dram_bytes: minimum,
        peer_bytes,
        busiest_sm_bytes: max as f64,
        peer_share: peer_bytes / total as f64,
        streams_weights: true,
        in_flight: flight.bytes as f64,
        chain_s: chain_seconds(block_k, units_per_block, p),
        rounds,
        serial_s,
    };
    let name = if algo == AllReduceAlgo::OneShot {
        "one-shot"
    } else {
        "two-shot"
    };
    Some(PlanRow {
        layer: g.layer.to_string(),
        op: "gemm_all_reduce".into(),
        m,
        n: g.n,
        k: g.k,
        tp,
        config: format!("{} {name}", config.name()),
        split_k: parts,
        blocks: grid,
        sms: p.sms,
        sms_streaming: streaming,
        bytes_per_sm_max: max,
        bytes_per_sm_mean: mean,
        bytes_in_flight_per_sm: flight.bytes,
        sync_rounds: rounds,
        floor_us: us(floor),
        model_us: us(model.seconds(p)),
        choice: format!(
            "fused{}{}",
            if packets { ", packets" } else { "" },
            split_choice(parts, plan.parts_in_parallel)
        ),
    })
}
