//! The emulator's counters ([`tpfuse::emulator::counters`]) on the crate's ops, through
//! cudarc and the emulated driver: bytes of global memory, bytes read from and written to
//! other ranks,
//! cross-rank barriers and ldmatrix bank conflicts, per launch and per block.
//!
//! Asserted where the kernels already do exactly what the op must do:
//! - one-shot all-reduce: every rank reads each peer's n elements once ((W-1)·n peer bytes),
//!   its own input and the W stagings (n + W·n), writes its staging and its output (2n), and
//!   passes 1 barrier per block (none closes a launch: a rank's next launch waits for its
//!   peers' finished launches instead); the peer reads are balanced across blocks;
//! - two-shot: 2·(W-1)/W·n peer bytes per rank (the lower bound of an all-reduce in which
//!   every rank ends with the whole sum), with or without a residual, 2 barriers per block;
//! - all-gather and reduce-scatter: (W-1)·len peer bytes per rank, 1 barrier per block;
//! - GEMM + all-reduce: one-shot reads the W-1 other partials whole ((W-1)·m·n peer bytes),
//!   two-shot the others' partials of its m/W rows, then the other slices' results
//!   (2·(W-1)/W·m·n);
//! - all-gather + GEMM: each rank's rows cross to each peer once (pushed: (W-1)·(m/W)·k peer
//!   bytes written, none read), and the tiles read the gathered rows locally, as the GEMM
//!   alone reads its A;
//! - GEMM: every configuration reads each A row once per column tile and each B row once
//!   per row tile (no more), the bias and residual once per output element, writes m·n
//!   elements once, each block moves what the plan (`tpfuse::plan::gemm_block_bytes`) says
//!   it moves, and its ldmatrix loads have no bank conflicts (the swizzled shared-memory
//!   layout);
//! - reduce_ranks: W·n read, n written, no peer bytes (its stream has no rank);
//! - the all-reduce (one-shot, its epilogue, rows of one RMSNorm segment and of several;
//!   two-shot) moves block by block what the plan's `CollectiveLaunch` says;
//! - a late rank shows in the other ranks' wait phase of the fused kernels' phase records;
//! - the grid follows the message: a block per 512 16-byte vectors, at most the budget (a
//!   decode step's 8 KB: one block), and one-shot with RMSNorm splits rows across blocks
//!   (balanced peer reads at m = 1).
#![cfg(feature = "emulator")]

mod common;
use common::emu::session_with;
use common::gpu::{download, random_vec, splitmix64, upload};
use common::ranks::{gpu, poisoned_ranks, round, upload_ranks, virtual_group};

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use tpfuse::emulator::counters::{self, LaunchCounters};
use tpfuse::emulator::{self, Fault};
use tpfuse::ops::gemm::{
    gemm_with_config, gemm_with_scratch, split_parts_on, GemmConfig, GemmShape,
};
use tpfuse::ops::gemm_all_reduce::{facts_of, FusedPlan};
use tpfuse::ops::{self, gemm_all_reduce_with, Algorithm, Epilogue, RmsNorm};
use tpfuse::plan::{
    fused_block_bytes, fused_norm_bytes, gemm_block_bytes, gemm_split_block_bytes, CollectiveLaunch,
};
use tpfuse::topology::AllReduceAlgo;
use tpfuse::{GroupOptions, TpGroup};

const FILE: &str = "emu_counters";
/// Bytes of a bf16 element.
const S: u64 = 2;
/// SMs of the emulated device (a W = 8 group needs W x blocks of them).
const SMS: u32 = 16;

/// `n` random bf16 values per rank.
fn inputs(seed: u64, world: usize, n: usize) -> Vec<Vec<bf16>> {
    (0..world)
        .map(|r| random_vec(splitmix64(seed ^ r as u64), n, -4.0, 4.0))
        .collect()
}

/// The grid of a collective whose message is `bytes` per rank (cuda/all_reduce.cu): a block
/// per 512 16-byte vectors, 1 ..= the group's budget.
fn grid(bytes: usize, budget: usize) -> usize {
    bytes.div_ceil(16).div_ceil(512).clamp(1, budget)
}

/// One counted round of `op` on every rank (rank, its x of `x_rows` rows, its weight, its
/// out), on fresh inputs of `shape`: the plans and the records.
fn counted_round(
    groups: &[TpGroup],
    shape: GemmShape,
    x_rows: usize,
    seed: u64,
    label: &str,
    mut op: impl FnMut(
        usize,
        &CudaSlice<bf16>,
        &CudaSlice<bf16>,
        &mut CudaSlice<bf16>,
    ) -> tpfuse::Result<FusedPlan>,
) -> (Vec<FusedPlan>, Vec<LaunchCounters>) {
    let GemmShape { m, n, k } = shape;
    let world = groups.len();
    let xs: Vec<CudaSlice<bf16>> = upload_ranks(groups, &inputs(seed, world, x_rows * k));
    let ws: Vec<CudaSlice<bf16>> = upload_ranks(groups, &inputs(seed ^ 0x30, world, n * k));
    let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(groups, m * n);
    let mut plans = Vec::new();
    let ((), recs) = counters::count(|| {
        plans = round(groups, label, |r| op(r, &xs[r], &ws[r], &mut outs[r]));
    });
    (plans, recs)
}

/// One counted round of the fused one-shot GEMM + all-reduce (no epilogue) on every rank.
fn fused_one_shot_counted(
    groups: &[TpGroup],
    shape: GemmShape,
    seed: u64,
    label: &str,
) -> (Vec<FusedPlan>, Vec<LaunchCounters>) {
    counted_round(groups, shape, shape.m, seed, label, |r, x, w, out| {
        let epilogue = Epilogue::default();
        gemm_all_reduce_with(&groups[r], x, w, epilogue, out, shape, Algorithm::OneShot)
    })
}

/// One counted round of all-gather + GEMM on every rank (each rank's m / W rows).
fn all_gather_gemm_counted(
    groups: &[TpGroup],
    shape: GemmShape,
    seed: u64,
    label: &str,
) -> (Vec<FusedPlan>, Vec<LaunchCounters>) {
    let rows = shape.m / groups.len();
    counted_round(groups, shape, rows, seed, label, |r, x, w, out| {
        ops::all_gather_gemm(&groups[r], x, w, None, out, shape)
    })
}

/// The records of one round of `op` on every rank: one launch per rank, of `kernel`, with
/// `blocks` blocks, tagged with its rank (in any order of completion).
fn count_round(
    groups: &[TpGroup],
    label: &str,
    kernel: &str,
    blocks: usize,
    op: impl FnMut(usize) -> tpfuse::Result<()>,
) -> Vec<LaunchCounters> {
    let ((), records) = counters::count(|| {
        round(groups, label, op);
    });
    assert_eq!(
        records.len(),
        groups.len(),
        "{label}: launches {records:#?}"
    );
    let mut by_rank: Vec<Option<LaunchCounters>> = vec![None; groups.len()];
    for rec in records {
        assert!(rec.kernel.contains(kernel), "{label}: ran {}", rec.kernel);
        assert_eq!(rec.blocks.len(), blocks, "{label}: blocks");
        let r = rec
            .rank
            .unwrap_or_else(|| panic!("{label}: a launch without a rank tag"));
        assert!(by_rank[r].is_none(), "{label}: rank {r} launched twice");
        by_rank[r] = Some(rec);
    }
    by_rank
        .into_iter()
        .map(|r| r.expect("every rank launched"))
        .collect()
}

fn assert_barriers(label: &str, rec: &LaunchCounters, per_block: u64) {
    for (b, c) in rec.blocks.iter().enumerate() {
        assert_eq!(
            c.barriers, per_block,
            "{label}: block {b} passed {} barriers",
            c.barriers
        );
    }
}

#[test]
fn one_shot_reads_each_peer_once_and_balances_the_blocks() {
    let _session = session_with(
        FILE,
        "one_shot_reads_each_peer_once_and_balances_the_blocks",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    for world in [2usize, 4, 8] {
        let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
        let n = 8 * 4096 + 3; // vectors and a scalar tail
        let label = format!("one-shot W={world} n={n}");
        let ins: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0x1e, world, n));
        let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(&groups, n);
        let blocks = grid(n * 2, groups[0].blocks());
        assert!(blocks > 1, "{label}: several blocks share the message");
        let recs = count_round(&groups, &label, "one_shot", blocks, |r| {
            ops::all_reduce(&groups[r], &ins[r], &mut outs[r], Algorithm::OneShot).map(|_| ())
        });
        let (n, w) = (n as u64, world as u64);
        for (r, rec) in recs.iter().enumerate() {
            let t = rec.total();
            let l = format!("{label} rank {r}");
            assert_eq!(t.peer_read_bytes, (w - 1) * n * S, "{l}: peer bytes");
            assert_eq!(t.global_read_bytes, (1 + w) * n * S, "{l}: bytes read");
            assert_eq!(t.global_write_bytes, 2 * n * S, "{l}: bytes written");
            assert_barriers(&l, rec, 1);
            let balance = rec.peer_read_balance().expect("peer reads");
            assert!(
                balance < 1.01,
                "{l}: the busiest block reads {balance}x the mean"
            );
        }
    }
}

#[test]
fn two_shot_reads_twice_the_peers_share() {
    let _session = session_with(
        FILE,
        "two_shot_reads_twice_the_peers_share",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    for world in [2usize, 4, 8] {
        let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
        let n = 8 * world * 1000; // slices of whole vectors
        let ins: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0x2e, world, n));
        let mut residuals: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0x2f, world, n));
        let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(&groups, n);
        for with_residual in [false, true] {
            let label = format!("two-shot W={world} n={n} residual={with_residual}");
            let blocks = grid(n * 2, groups[0].blocks());
            let recs = count_round(&groups, &label, "two_shot", blocks, |r| {
                let epilogue = Epilogue {
                    residual: with_residual
                        .then_some(&mut residuals[r] as &mut dyn DevicePtrMut<bf16>),
                    ..Epilogue::default()
                };
                ops::all_reduce_fused(
                    &groups[r],
                    &ins[r],
                    epilogue,
                    &mut outs[r],
                    Algorithm::TwoShot,
                )
                .map(|_| ())
            });
            let (n, w) = (n as u64, world as u64);
            let slice = n / w;
            // The residual: its own slice read and written by the epilogue; the W-1 gathered
            // slices written from the values loaded for out (not read again, locally or over
            // the link).
            let res = u64::from(with_residual);
            for (r, rec) in recs.iter().enumerate() {
                let t = rec.total();
                let l = format!("{label} rank {r}");
                // Reduce: its slice from W-1 peers; gather: the W-1 other slices.
                assert_eq!(
                    t.peer_read_bytes,
                    2 * (w - 1) * slice * S,
                    "{l}: peer bytes"
                );
                // Input, W slices to reduce, W-1 slices to gather.
                assert_eq!(
                    t.global_read_bytes,
                    (n + w * slice + (w - 1) * slice + res * slice) * S,
                    "{l}: bytes read"
                );
                // Staging, the slice to out and to the published result, W-1 slices to out.
                assert_eq!(
                    t.global_write_bytes,
                    (n + 2 * slice + (w - 1) * slice + res * w * slice) * S,
                    "{l}: bytes written"
                );
                assert_barriers(&l, rec, 2);
            }
        }
    }
}

#[test]
fn all_gather_and_reduce_scatter_read_each_peer_once() {
    let _session = session_with(
        FILE,
        "all_gather_and_reduce_scatter_read_each_peer_once",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    for world in [2usize, 4, 8] {
        let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
        let len = 8 * 1001;
        let w = world as u64;
        let l64 = len as u64;

        let label = format!("all-gather W={world} len={len}");
        let ins: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0x3e, world, len));
        let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(&groups, world * len);
        let blocks = grid(len * 2, groups[0].blocks());
        let recs = count_round(&groups, &label, "all_gather", blocks, |r| {
            ops::all_gather(&groups[r], &ins[r], &mut outs[r])
        });
        for (r, rec) in recs.iter().enumerate() {
            let t = rec.total();
            let l = format!("{label} rank {r}");
            assert_eq!(t.peer_read_bytes, (w - 1) * l64 * S, "{l}: peer bytes");
            assert_eq!(t.global_read_bytes, (1 + w) * l64 * S, "{l}: bytes read");
            assert_eq!(
                t.global_write_bytes,
                (1 + w) * l64 * S,
                "{l}: bytes written"
            );
            assert_barriers(&l, rec, 1);
        }

        let label = format!("reduce-scatter W={world} len={len}");
        let ins: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0x4e, world, world * len));
        let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(&groups, len);
        let recs = count_round(&groups, &label, "reduce_scatter", blocks, |r| {
            ops::reduce_scatter(&groups[r], &ins[r], &mut outs[r])
        });
        for (r, rec) in recs.iter().enumerate() {
            let t = rec.total();
            let l = format!("{label} rank {r}");
            assert_eq!(t.peer_read_bytes, (w - 1) * l64 * S, "{l}: peer bytes");
            // Its W slices to staging, then slice r of the W stagings.
            assert_eq!(t.global_read_bytes, 2 * w * l64 * S, "{l}: bytes read");
            assert_eq!(
                t.global_write_bytes,
                (w + 1) * l64 * S,
                "{l}: bytes written"
            );
            assert_barriers(&l, rec, 1);
        }
    }
}

/// The custom all-reduce (one-shot with and without its epilogue, over rows of one RMSNorm
/// segment and of several; two-shot with a residual) moves, block by block, what the plan's
/// [`CollectiveLaunch::block_bytes`] says: the plan's `all_reduce` rows count these bytes.
#[test]
fn the_all_reduce_moves_what_the_plan_says_block_by_block() {
    let _session = session_with(
        FILE,
        "the_all_reduce_moves_what_the_plan_says_block_by_block",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    // (algorithm, rows, hidden, bias, residual, RMSNorm)
    let cases = [
        (AllReduceAlgo::OneShot, 1, 8 * 4096 + 3, false, false, false),
        (AllReduceAlgo::OneShot, 3, 4096, true, true, true),
        (AllReduceAlgo::OneShot, 5, 1024, false, true, true),
        (AllReduceAlgo::OneShot, 2, 8200, false, true, true),
        (AllReduceAlgo::OneShot, 1, 8192, true, true, true),
        // 4096 + 2048: a block per segment (4), where 512-vector blocks would be 3.
        (AllReduceAlgo::OneShot, 2, 6144, false, true, true),
        (AllReduceAlgo::TwoShot, 4, 2048, true, true, false),
        (AllReduceAlgo::TwoShot, 3, 1000, false, false, false),
    ];
    // A group whose one-shot all-reduce goes by packets where they fit, and the default one
    // (by flags).
    let with_packets = [true, false].map(|all_reduce_packets| GroupOptions {
        all_reduce_packets,
        ..GroupOptions::default()
    });
    for (world, options) in [2usize, 4]
        .into_iter()
        .flat_map(|w| with_packets.clone().map(|o| (w, o)))
    {
        let groups = virtual_group(&gpu.ctx, world, options);
        for (ci, &(algo, rows, hidden, bias, residual, rmsnorm)) in cases.iter().enumerate() {
            let n = rows * hidden;
            let launch = |rank| CollectiveLaunch {
                algo,
                rows,
                hidden,
                world,
                rank,
                budget: groups[0].blocks(),
                element_bytes: S,
                bias,
                residual,
                rmsnorm,
                packet_bytes: groups[0].all_reduce_packet_bytes(),
            };
            let label = format!("{:?}", launch(0));
            let seed = 0x7a00 + ci as u64;
            let ins: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(seed, world, n));
            let biases: Vec<CudaSlice<bf16>> =
                upload_ranks(&groups, &inputs(seed ^ 1, world, hidden));
            let gammas: Vec<CudaSlice<bf16>> =
                upload_ranks(&groups, &inputs(seed ^ 2, world, hidden));
            let mut residuals: Vec<CudaSlice<bf16>> =
                upload_ranks(&groups, &inputs(seed ^ 3, world, n));
            let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(&groups, n);
            let (kernel, algorithm) = match algo {
                AllReduceAlgo::OneShot if launch(0).packets() => {
                    ("one_shot_packets", Algorithm::OneShot)
                }
                AllReduceAlgo::OneShot => ("one_shot_kernel", Algorithm::OneShot),
                _ => ("two_shot", Algorithm::TwoShot),
            };
            let recs = count_round(&groups, &label, kernel, launch(0).grid(), |r| {
                let epilogue = Epilogue {
                    bias: bias.then_some(&biases[r] as &dyn DevicePtr<bf16>),
                    residual: residual.then_some(&mut residuals[r] as &mut dyn DevicePtrMut<bf16>),
                    norm: rmsnorm.then(|| RmsNorm {
                        gamma: &gammas[r],
                        eps: 1e-5,
                    }),
                };
                ops::all_reduce_fused(&groups[r], &ins[r], epilogue, &mut outs[r], algorithm)
                    .map(|_| ())
            });
            for (r, rec) in recs.iter().enumerate() {
                let planned = launch(r).block_bytes();
                let moved: Vec<u64> = rec
                    .blocks
                    .iter()
                    .map(|c| c.global_read_bytes + c.global_write_bytes)
                    .collect();
                if !launch(r).packets() {
                    assert_eq!(
                        moved, planned,
                        "W={world} {label} rank {r}: bytes per block"
                    );
                    continue;
                }
                // By packets: a packet read before it arrived is read again (32 bytes, a
                // vector's four packets), as often as the schedule makes it; no barrier.
                for (b, (&got, &want)) in moved.iter().zip(&planned).enumerate() {
                    assert!(
                        got >= want && (got - want) % 32 == 0,
                        "W={world} {label} rank {r} block {b}: {got} bytes, the plan {want} \
                         and polls"
                    );
                }
                assert_eq!(moved.len(), planned.len(), "{label}: blocks");
                assert_barriers(&format!("W={world} {label} rank {r}"), rec, 0);
            }
        }
    }
}

/// The two-shot's RMSNorm, its own launch after the two-shot (a block a row), moves per block
/// what the plan's [`CollectiveLaunch::norm_launch_block_bytes`] says: a row of up to two
/// segments held in registers (x read once, gamma read, out written), a longer one read twice.
#[test]
fn the_two_shots_rmsnorm_moves_what_the_plan_says_block_by_block() {
    let _session = session_with(
        FILE,
        "the_two_shots_rmsnorm_moves_what_the_plan_says_block_by_block",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    let world = 2usize;
    let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
    // (rows, hidden): one segment, two (held), three (read twice, the last one short).
    for (ci, (rows, hidden)) in [(2usize, 4096usize), (2, 8192), (2, 8200)]
        .into_iter()
        .enumerate()
    {
        let n = rows * hidden;
        let launch = CollectiveLaunch {
            algo: AllReduceAlgo::TwoShot,
            rows,
            hidden,
            world,
            rank: 0,
            budget: groups[0].blocks(),
            element_bytes: S,
            bias: false,
            residual: true,
            rmsnorm: true,
            packet_bytes: groups[0].all_reduce_packet_bytes(),
        };
        let label = format!("{rows} x {hidden}");
        let seed = 0x7b00 + ci as u64;
        let ins: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(seed, world, n));
        let gammas: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(seed ^ 2, world, hidden));
        let mut residuals: Vec<CudaSlice<bf16>> =
            upload_ranks(&groups, &inputs(seed ^ 3, world, n));
        let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(&groups, n);
        let ((), records) = counters::count(|| {
            round(&groups, &label, |r| {
                let epilogue = Epilogue {
                    bias: None,
                    residual: Some(&mut residuals[r] as &mut dyn DevicePtrMut<bf16>),
                    norm: Some(RmsNorm {
                        gamma: &gammas[r],
                        eps: 1e-5,
                    }),
                };
                ops::all_reduce_fused(
                    &groups[r],
                    &ins[r],
                    epilogue,
                    &mut outs[r],
                    Algorithm::TwoShot,
                )
                .map(|_| ())
            });
        });
        let norms: Vec<&LaunchCounters> = records
            .iter()
            .filter(|rec| rec.kernel.contains("rms_norm"))
            .collect();
        assert_eq!(norms.len(), world, "{label}: a RMSNorm launch a rank");
        for rec in norms {
            let moved: Vec<u64> = rec
                .blocks
                .iter()
                .map(|c| c.global_read_bytes + c.global_write_bytes)
                .collect();
            assert_eq!(
                moved,
                launch.norm_launch_block_bytes(),
                "{label}: bytes per block (held: {})",
                launch.norm_held()
            );
        }
    }
}

#[test]
fn gemm_reads_each_tile_once_without_bank_conflicts() {
    let _session = session_with(
        FILE,
        "gemm_reads_each_tile_once_without_bank_conflicts",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    let stream = gpu.ctx.default_stream();
    let shape = GemmShape {
        m: 130,
        n: 136,
        k: 264,
    };
    let GemmShape { m, n, k } = shape;
    let a = upload(&stream, &random_vec::<bf16>(0x5e, m * k, -1.0, 1.0));
    let b_weights = upload(&stream, &random_vec::<bf16>(0x6e, n * k, -0.1, 0.1));
    let mut c = upload(&stream, &vec![bf16::NAN; m * n]);
    let bias = upload(&stream, &random_vec::<bf16>(0x7e, n, -1.0, 1.0));
    let residual = upload(&stream, &random_vec::<bf16>(0x8e, m * n, -1.0, 1.0));
    let parts = tpfuse::ops::gemm::split_parts_on(&stream, n, k).expect("the SM count");
    for config in GemmConfig::ALL
        .into_iter()
        .filter(|c| c.splits_k() || parts == 1)
    {
        let info = config.info();
        for epilogue in [false, true] {
            let label = format!(
                "gemm {} m={m} n={n} k={k} epilogue {epilogue}",
                config.name()
            );
            let (b, r): (Option<&dyn DevicePtr<bf16>>, Option<&dyn DevicePtr<bf16>>) = if epilogue {
                (Some(&bias), Some(&residual))
            } else {
                (None, None)
            };
            let ((), recs) = counters::count(|| {
                gemm_with_config(&stream, &a, &b_weights, b, r, &mut c, shape, config)
                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                stream.synchronize().expect("the GEMM runs");
            });
            assert_eq!(recs.len(), 1, "{label}: launches");
            // Block by block, what the plan (tpfuse::plan) says each block moves.
            let planned = gemm_block_bytes(config, shape, epilogue, epilogue);
            assert_eq!(recs[0].blocks.len(), planned.len(), "{label}: blocks");
            for (i, (got, want)) in recs[0].blocks.iter().zip(&planned).enumerate() {
                assert_eq!(
                    got.global_read_bytes + got.global_write_bytes,
                    *want,
                    "{label}: block {i}'s bytes against the plan's"
                );
            }
            let t = recs[0].total();
            let tiles_m = m.div_ceil(info.block_m) as u64;
            let tiles_n = n.div_ceil(info.block_n) as u64;
            let (m, n, k) = (m as u64, n as u64, k as u64);
            println!(
                "{label}: read {} bytes, {:.2}x the {} of A and B once",
                t.global_read_bytes,
                t.global_read_bytes as f64 / ((m + n) * k * S) as f64,
                (m + n) * k * S
            );
            let epilogue_reads = if epilogue { 2 * m * n * S } else { 0 };
            assert_eq!(
                t.global_read_bytes,
                (tiles_n * m + tiles_m * n) * k * S + epilogue_reads,
                "{label}: bytes read"
            );
            assert_eq!(t.global_write_bytes, m * n * S, "{label}: bytes written");
            assert_eq!(t.ldmatrix_conflicts, 0, "{label}: ldmatrix bank conflicts");
            assert_eq!(t.peer_read_bytes, 0, "{label}: peer bytes");
            assert_eq!(t.barriers, 0, "{label}: barriers");
        }
    }
}

#[test]
fn a_split_gemm_moves_what_the_plan_says_block_by_block() {
    let _session = session_with(
        FILE,
        "a_split_gemm_moves_what_the_plan_says_block_by_block",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    let stream = gpu.ctx.default_stream();
    // 3 tiles of 64 columns (the last one 8 wide) x 5 parts on 16 SMs; k off every boundary.
    let shape = GemmShape {
        m: 5,
        n: 136,
        k: 1000,
    };
    let GemmShape { m, n, k } = shape;
    let parts = split_parts_on(&stream, n, k).expect("the SM count");
    assert_eq!(parts, 5, "the split this test was written for");
    let a = upload(&stream, &random_vec::<bf16>(0x9e, m * k, -1.0, 1.0));
    let b = upload(&stream, &random_vec::<bf16>(0xae, n * k, -0.1, 0.1));
    let bias = upload(&stream, &random_vec::<bf16>(0xbe, n, -1.0, 1.0));
    let mut c = upload(&stream, &vec![bf16::NAN; m * n]);
    let mut scratch = stream.alloc_zeros::<u8>(1 << 20).expect("scratch");
    let ((), recs) = counters::count(|| {
        gemm_with_scratch(
            &stream,
            &a,
            &b,
            Some(&bias),
            None,
            &mut c,
            shape,
            &mut scratch,
        )
        .expect("the split GEMM");
        stream.synchronize().expect("the GEMM runs");
    });
    assert_eq!(recs.len(), 1, "launches");
    assert!(
        recs[0].kernel.contains("gemm_split"),
        "ran {}",
        recs[0].kernel
    );
    let config = GemmConfig::SmallM16x64;
    let planned = gemm_split_block_bytes(config, shape, parts, true, false);
    let tiles = n.div_ceil(64);
    assert_eq!(recs[0].blocks.len(), planned.len(), "blocks");
    let bytes =
        |b: usize| recs[0].blocks[b].global_read_bytes + recs[0].blocks[b].global_write_bytes;
    split_blocks_move_the_plans_bytes(
        "the split GEMM",
        _session.schedule(),
        (tiles, parts),
        &planned,
        bytes,
        |_| 0,
        |tile| (m * 64.min(n - tile * 64)) as u64,
    );
}

/// The blocks of a parallel split (block `p * tiles + t`: part `p` of tile `t`) against the
/// plan's bytes (`planned`, each part folded by its own block), `bytes` what each moved,
/// `extra` what a block moves beyond its share of the split (the fused kernel's reductions),
/// `outputs` a tile's elements. Which block folds which parts is a matter of timing, and a
/// block that folds a run of parts reads the running sum once for all of them: a tile's total
/// lies between one block folding every part in one pass (S partials read, no running sum
/// stored: 2S - 4 partials of the tile fewer than the plan) and the plan's. In the forward
/// schedule these small parts each run to their end in their block's first turn, in block
/// order: each block folds its own part, exactly the plan.
fn split_blocks_move_the_plans_bytes(
    label: &str,
    schedule: emulator::Schedule,
    (tiles, parts): (usize, usize),
    planned: &[u64],
    bytes: impl Fn(usize) -> u64,
    extra: impl Fn(usize) -> u64,
    outputs: impl Fn(usize) -> u64,
) {
    assert_eq!(planned.len(), tiles * parts, "{label}: the plan's blocks");
    for tile in 0..tiles {
        let blocks: Vec<usize> = (0..parts).map(|p| p * tiles + tile).collect();
        let got: u64 = blocks.iter().map(|&b| bytes(b) - extra(b)).sum();
        let most: u64 = blocks.iter().map(|&b| planned[b]).sum();
        let least = most - (2 * parts as u64 - 4) * outputs(tile) * 4;
        assert!(
            (least..=most).contains(&got),
            "{label}: tile {tile}'s blocks moved {got} bytes, the plan {most} (at least {least})"
        );
        if schedule == emulator::Schedule::Forward {
            for &b in &blocks {
                let own = bytes(b) - extra(b);
                assert_eq!(
                    own, planned[b],
                    "{label}: tile {tile} block {b}, folds in order"
                );
            }
        }
    }
}

#[test]
fn one_scratch_serves_splits_of_every_shape() {
    // 132 SMs (an H100's): shapes of 100 and 10 tiles of 64 columns both split, so calls of
    // both shapes share the scratch's counts (the review's case: counts whose place moved with
    // the tile count left 36 tiles unfinished, silently).
    let _session = session_with(
        FILE,
        "one_scratch_serves_splits_of_every_shape",
        132,
        60_000_000_000,
    );
    let gpu = gpu();
    let stream = gpu.ctx.default_stream();
    let mut scratch = stream.alloc_zeros::<u8>(4 << 20).expect("scratch");
    for (round, (n, k)) in [(6400, 640), (640, 1536), (6400, 640)]
        .into_iter()
        .enumerate()
    {
        let shape = GemmShape { m: 2, n, k };
        let parts = split_parts_on(&stream, n, k).expect("the SM count");
        assert!(parts > 1, "n = {n}, k = {k}: {parts} parts");
        let label = format!("round {round}: n = {n}, k = {k}, {parts} parts");
        let a = upload(
            &stream,
            &random_vec::<bf16>(0xc0 + round as u64, 2 * k, -1.0, 1.0),
        );
        let b = upload(
            &stream,
            &random_vec::<bf16>(0xd0 + round as u64, n * k, -0.1, 0.1),
        );
        let mut alone = upload(&stream, &vec![bf16::NAN; 2 * n]);
        let mut shared = upload(&stream, &vec![bf16::NAN; 2 * n]);
        tpfuse::ops::gemm(&stream, &a, &b, None, None, &mut alone, 2, n, k).expect(&label);
        let ((), recs) = counters::count(|| {
            gemm_with_scratch(
                &stream,
                &a,
                &b,
                None,
                None,
                &mut shared,
                shape,
                &mut scratch,
            )
            .expect(&label);
            stream.synchronize().expect("the GEMM runs");
        });
        assert!(
            recs.iter().any(|r| r.kernel.contains("gemm_split")),
            "{label}: {recs:?}"
        );
        common::assert_same_bits(
            &label,
            &download(&stream, &shared),
            &download(&stream, &alone),
        );
    }
}

#[test]
fn reduce_ranks_moves_its_inputs_and_output_once() {
    let _session = session_with(
        FILE,
        "reduce_ranks_moves_its_inputs_and_output_once",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    let stream = gpu.ctx.default_stream();
    let (world, n) = (5usize, 8 * 777 + 5);
    let hosts = inputs(0x7e, world, n);
    let ins: Vec<CudaSlice<bf16>> = hosts.iter().map(|h| upload(&stream, h)).collect();
    let mut out = upload(&stream, &vec![bf16::NAN; n]);
    let ((), recs) = counters::count(|| {
        let refs: Vec<&CudaSlice<bf16>> = ins.iter().collect();
        ops::reduce_ranks(&stream, &refs, &mut out).expect("reduce_ranks");
        stream.synchronize().expect("reduce_ranks runs");
    });
    assert_eq!(recs.len(), 1);
    let t = recs[0].total();
    assert_eq!(recs[0].rank, None, "the default stream has no rank");
    assert_eq!(t.global_read_bytes, (world * n) as u64 * S);
    assert_eq!(t.global_write_bytes, n as u64 * S);
    assert_eq!(t.peer_read_bytes, 0);
}

#[test]
fn a_decode_message_launches_only_the_blocks_it_needs() {
    let _session = session_with(
        FILE,
        "a_decode_message_launches_only_the_blocks_it_needs",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    let world = 2;
    // By flags (the default group), then by packets.
    let flags = virtual_group(&gpu.ctx, world, GroupOptions::default());
    let packets = virtual_group(
        &gpu.ctx,
        world,
        GroupOptions {
            all_reduce_packets: true,
            ..GroupOptions::default()
        },
    );
    assert!(
        flags[0].blocks() > 6,
        "the budget is larger than the grids below"
    );
    let hidden = 8192; // 16 KB of bf16 per row
                       // 16 KB rows: 2 blocks of 512 vectors; with RMSNorm by flags the row's 2 segments go to 2
                       // blocks, by packets a block holds a row.
    let cases = [
        (false, 1, false, 2),
        (false, 1, true, 2),
        (false, 2, true, 4),
        (false, 3, false, 6),
        (true, 1, false, 2),
        (true, 1, true, 1),
        (true, 2, true, 2),
        (true, 3, false, 6),
    ];
    for (by_packets, rows, norm, blocks) in cases {
        let groups = if by_packets { &packets } else { &flags };
        let gammas: Vec<CudaSlice<bf16>> = upload_ranks(groups, &inputs(0x5f, world, hidden));
        let n = rows * hidden;
        let label = format!("one-shot rows={rows} rmsnorm={norm} packets={by_packets}");
        let ins: Vec<CudaSlice<bf16>> = upload_ranks(groups, &inputs(0x5e, world, n));
        let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(groups, n);
        let kernel = if by_packets {
            "one_shot_packets"
        } else {
            "one_shot_kernel"
        };
        let recs = count_round(groups, &label, kernel, blocks, |r| {
            let epilogue = Epilogue {
                norm: norm.then(|| RmsNorm {
                    gamma: &gammas[r],
                    eps: 1e-5,
                }),
                ..Epilogue::default()
            };
            ops::all_reduce_fused(
                &groups[r],
                &ins[r],
                epilogue,
                &mut outs[r],
                Algorithm::OneShot,
            )
            .map(|_| ())
        });
        for rec in &recs {
            if by_packets {
                // No barrier, nothing read across the link.
                assert_barriers(&label, rec, 0);
                assert_eq!(rec.total().peer_read_bytes, 0, "{label}: peer bytes read");
                continue;
            }
            assert_barriers(&label, rec, 1);
            // Every block pulls the same share from the peers, RMSNorm or not (a row is split
            // across blocks, not handed whole to one).
            let balance = rec.peer_read_balance().expect("peer reads");
            assert!(
                balance < 1.01,
                "{label}: the busiest block reads {balance}x the mean"
            );
        }
    }
}

#[test]
fn all_gather_gemm_moves_each_rows_part_across_once() {
    let _session = session_with(
        FILE,
        "all_gather_gemm_moves_each_rows_part_across_once",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    // The first shape's k splits in 2 (2 tiles of 64 x 64), the last's in 5 (3 tiles of
    // 16 x 64) on 16 SMs: their tiles' parts are the grid's units.
    for (world, m, n, k) in [
        (2usize, 34usize, 136usize, 264usize),
        (4, 16, 72, 136),
        (8, 24, 264, 40),
        (2, 4, 136, 1000),
    ] {
        let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
        let rows = m / world;
        let shape = GemmShape { m, n, k };
        let label = format!("all-gather + GEMM W={world} (m, n, k)=({m}, {n}, {k})");
        let (plans, recs) = all_gather_gemm_counted(&groups, shape, 0x7e, &label);
        assert_eq!(recs.len(), world, "{label}: launches {recs:#?}");
        for rec in &recs {
            let r = rec.rank.expect("a rank tag");
            let l = format!("{label} rank {r}");
            let plan = plans[r];
            assert!(
                rec.kernel.contains("all_gather_gemm"),
                "{l}: ran {}",
                rec.kernel
            );
            assert_eq!(rec.blocks.len(), plan.grid, "{l}: blocks");
            let info = plan.config.info();
            let t = rec.total();
            let (tiles_m, tiles_n) = (
                m.div_ceil(info.block_m) as u64,
                n.div_ceil(info.block_n) as u64,
            );
            let parts = split_parts_on(&gpu.ctx.default_stream(), n, k).expect("the SM count");
            assert_eq!(
                plan.parts_in_parallel,
                parts > 1,
                "{l}: {parts} parts, in parallel where they split"
            );
            let units =
                (tiles_m * tiles_n) as usize * if plan.parts_in_parallel { parts } else { 1 };
            // The group's share of the SMs, as many blocks each as one holds.
            let slot = GemmConfig::ALL.iter().position(|&c| c == plan.config);
            let per_sm = facts_of(&groups[r]).gather_blocks_per_sm[slot.expect("a config")];
            let blocks = SMS as usize / world * per_sm;
            assert_eq!(plan.grid, units.min(blocks), "{l}: the plan's grid");
            let (w, m64, n64, k64, rows) =
                (world as u64, m as u64, n as u64, k as u64, rows as u64);
            let part = rows * k64 * S;
            assert_eq!(t.peer_read_bytes, 0, "{l}: the tiles read only local rows");
            assert_eq!(
                t.peer_write_bytes,
                (w - 1) * part,
                "{l}: peer bytes written"
            );
            if plan.parts_in_parallel {
                // Its part read once and pushed to every rank, then the split GEMM's units: what
                // the plan says of them, less what folding runs of parts in one pass saves.
                let moved = t.global_read_bytes + t.global_write_bytes - (1 + w) * part;
                let planned: u64 = gemm_split_block_bytes(plan.config, shape, parts, false, false)
                    .iter()
                    .sum();
                let saved = (2 * parts as u64 - 4) * m64 * n64 * 4;
                assert!(
                    (planned - saved..=planned).contains(&moved),
                    "{l}: the split GEMM moved {moved} bytes, the plan {planned} (at least {})",
                    planned - saved
                );
            } else {
                assert_eq!(
                    t.global_read_bytes,
                    part + (tiles_n * m64 + tiles_m * n64) * k64 * S,
                    "{l}: its part once, then the GEMM's reads"
                );
                assert_eq!(
                    t.global_write_bytes,
                    w * part + m64 * n64 * S,
                    "{l}: bytes written"
                );
            }
            for (b, c) in rec.blocks.iter().enumerate() {
                assert!(
                    (1..=w).contains(&c.barriers),
                    "{l}: block {b} waited {} times (once per new rank at most)",
                    c.barriers
                );
            }
        }
    }
}

#[test]
fn fused_gemm_all_reduce_reads_the_peers_once_or_twice_by_slices() {
    let _session = session_with(
        FILE,
        "fused_gemm_all_reduce_reads_the_peers_once_or_twice_by_slices",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    for (world, m, n, k) in [
        (2usize, 34usize, 136usize, 40usize),
        (4, 16, 264, 24),
        (8, 24, 136, 16),
    ] {
        for fused_packets in [false, true] {
            let options = GroupOptions {
                fused_packets,
                ..GroupOptions::default()
            };
            let groups = virtual_group(&gpu.ctx, world, options);
            let shape = GemmShape { m, n, k };
            let xs: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0x9e, world, m * k));
            let ws: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0xae, world, n * k));
            let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(&groups, m * n);
            let (w, mn) = (world as u64, (m * n) as u64);
            // (peer bytes read, written): by flags the peers' partials read across; by packets
            // (one-shot, these shapes fit) each rank's partial pushed to the W - 1 others as
            // packets (4 bytes an element), nothing read across.
            for (algo, peer) in [
                (
                    Algorithm::OneShot,
                    if fused_packets {
                        (0, (w - 1) * mn * 4)
                    } else {
                        ((w - 1) * mn * S, 0)
                    },
                ),
                (Algorithm::TwoShot, (2 * (w - 1) * mn / w * S, 0)),
            ] {
                let label = format!(
                    "GEMM + all-reduce {algo:?} W={world} (m, n, k)=({m}, {n}, {k}) packets \
                     {fused_packets}"
                );
                let mut plans = Vec::new();
                let ((), recs) = counters::count(|| {
                    plans = round(&groups, &label, |r| {
                        let epilogue = Epilogue::default();
                        let (x, wt, out) = (&xs[r], &ws[r], &mut outs[r]);
                        gemm_all_reduce_with(&groups[r], x, wt, epilogue, out, shape, algo)
                    });
                });
                assert_eq!(
                    plans[0].packets,
                    fused_packets && algo == Algorithm::OneShot,
                    "{label}: the plan's exchange"
                );
                assert_eq!(recs.len(), world, "{label}: launches");
                for rec in &recs {
                    let l = format!("{label} rank {:?}", rec.rank);
                    let t = rec.total();
                    assert_eq!(t.peer_read_bytes, peer.0, "{l}: peer bytes read");
                    assert_eq!(t.peer_write_bytes, peer.1, "{l}: peer bytes written");
                }
            }
        }
    }
}

/// The fused GEMM + all-reduce's persistent grid: as many blocks as the SMs the group gives a
/// rank hold at once (each SM then streams several blocks' weights), the blocks of its plan;
/// all-gather + GEMM's when the options ask for it. The emulator counts an H100's SM with its register table
/// (`cuda/emu/kernel_resources.inc`: per kernel, ptxas's most over its instantiations, 231 and
/// 209 a thread, FusedTile64x64's): FusedTile64x64 (96 KiB of shared memory, 128 threads) and
/// SmallM16x64 (60 KiB, 128 threads) fit two blocks an SM (a real H100 holds three of the
/// latter: ptxas gives GEMM + all-reduce's 140 registers). `GroupOptions::fused_blocks_per_sm`
/// bounds it.
#[test]
fn the_fused_grid_fills_the_sms_it_is_given() {
    let _session = session_with(
        FILE,
        "the_fused_grid_fills_the_sms_it_is_given",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    let world = 2;
    let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
    let sms_per_rank = SMS as usize / world;
    assert_eq!(groups[0].fused_blocks(), sms_per_rank);
    // 28 tiles of 64x64 (not 128x128: 14 of those leave over 10% of 16 SMs idle); 20 of
    // 16x64. Both more than the 16 blocks two an SM give.
    for (m, n, k, config) in [
        (64usize, 1792usize, 40usize, GemmConfig::Tile64x64),
        (1, 1280, 40, GemmConfig::SmallM16x64),
    ] {
        let shape = GemmShape { m, n, k };
        let label = format!("GEMM + all-reduce W={world} (m, n, k)=({m}, {n}, {k})");
        let (plans, recs) = fused_one_shot_counted(&groups, shape, 0x9d, &label);
        let plan: FusedPlan = plans[0];
        assert_eq!(plan.config, config, "{label}");
        assert_eq!(plan.grid, 2 * sms_per_rank, "{label}: two blocks an SM");
        for rec in &recs {
            assert_eq!(rec.blocks.len(), plan.grid, "{label}: blocks");
        }
        // GroupOptions::fused_blocks_per_sm bounds it: one block an SM leaves room beside.
        let options = GroupOptions {
            fused_blocks_per_sm: Some(1),
            ..GroupOptions::default()
        };
        let roomy = virtual_group(&gpu.ctx, world, options);
        let (plans, _) = fused_one_shot_counted(&roomy, shape, 0x9e, &label);
        assert_eq!(plans[0].grid, sms_per_rank, "{label}: one block an SM");
    }
    // All-gather + GEMM: one block an SM by default (the grid Fusion::Auto's rule was measured
    // with), as many as its own kernel's occupancy gives when the options ask for more. 20
    // tiles of 16x64 (m = 2, one row a rank), more than the 16 blocks two an SM give.
    let shape = GemmShape {
        m: 2,
        n: 1280,
        k: 40,
    };
    let label = "all-gather + GEMM W=2 (m, n, k)=(2, 1280, 40)";
    let (plans, recs) = all_gather_gemm_counted(&groups, shape, 0x9f, label);
    assert_eq!(plans[0].config, GemmConfig::SmallM16x64, "{label}");
    assert_eq!(plans[0].grid, sms_per_rank, "{label}: one block an SM");
    for rec in &recs {
        assert_eq!(rec.blocks.len(), plans[0].grid, "{label}: blocks");
    }
    let options = GroupOptions {
        fused_blocks_per_sm: Some(4),
        ..GroupOptions::default()
    };
    let packed = virtual_group(&gpu.ctx, world, options);
    let (plans, recs) = all_gather_gemm_counted(&packed, shape, 0xa0, label);
    assert_eq!(
        plans[0].grid,
        2 * sms_per_rank,
        "{label}: two blocks an SM hold"
    );
    for rec in &recs {
        assert_eq!(rec.blocks.len(), plans[0].grid, "{label}: blocks");
    }
}

/// The fused launches' epilogue here: no bias, `residual` where given, RMSNorm by `gamma`
/// where `norm`.
fn norm_epilogue<'a>(
    residual: Option<&'a mut CudaSlice<bf16>>,
    gamma: &'a CudaSlice<bf16>,
    norm: bool,
) -> Epilogue<'a, bf16> {
    Epilogue {
        residual: residual.map(|r| r as &mut dyn DevicePtrMut<bf16>),
        norm: norm.then_some(RmsNorm { gamma, eps: 1e-5 }),
        ..Epilogue::default()
    }
}

/// The fused GEMM + all-reduce moves, block by block, what the plan says
/// (`tpfuse::plan::fused_block_bytes`: its GEMM units, its reduction of each tile, the
/// two-shot's gathered rows), by flags, with a residual: one-shot and two-shot, with and
/// without RMSNorm, on tiles of 16 x 64 (one strip), 64 x 64 (three strips, the last of one
/// row, and edge tiles) and 16 x 16. With RMSNorm the one-shot's strips' first rows go to
/// whichever block completes the strip (the plan: the block of its last column's tile), so
/// there each rank's total is checked (the rows block by block:
/// `the_fused_rmsnorm_moves_what_the_plan_says_row_by_row`). Not k split in parallel: the
/// fused kernel's folds of a tile's parts move bytes in the order its parts finish (the plan
/// counts the forward schedule's), in total too.
#[test]
fn the_fused_gemm_all_reduce_moves_what_the_plan_says_block_by_block() {
    let _session = session_with(
        FILE,
        "the_fused_gemm_all_reduce_moves_what_the_plan_says_block_by_block",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    let by_flags = GroupOptions {
        fused_packets: false,
        ..GroupOptions::default()
    };
    for (world, m, n, k) in [
        (2usize, 16usize, 264usize, 40usize),
        (3, 129, 136, 40),
        (4, 16, 72, 24),
    ] {
        let groups = virtual_group(&gpu.ctx, world, by_flags.clone());
        let shape = GemmShape { m, n, k };
        let xs: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0x9c, world, m * k));
        let ws: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0xac, world, n * k));
        let gammas: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0xbc, world, n));
        let mut residuals: Vec<CudaSlice<bf16>> =
            upload_ranks(&groups, &inputs(0xcc, world, m * n));
        let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(&groups, m * n);
        for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
            if algorithm == Algorithm::TwoShot && m % world != 0 {
                continue;
            }
            for norm in [false, true] {
                let label = format!(
                    "GEMM + all-reduce {algorithm:?} W={world} (m, n, k)=({m}, {n}, {k}) \
                     RMSNorm {norm}"
                );
                let mut plans = Vec::new();
                let ((), recs) = counters::count(|| {
                    plans = round(&groups, &label, |r| {
                        let epilogue = norm_epilogue(Some(&mut residuals[r]), &gammas[r], norm);
                        let (x, wt, out) = (&xs[r], &ws[r], &mut outs[r]);
                        gemm_all_reduce_with(&groups[r], x, wt, epilogue, out, shape, algorithm)
                    });
                });
                let plan: FusedPlan = plans[0];
                assert!(!plan.packets, "{label}: by flags");
                assert!(!plan.parts_in_parallel, "{label}: no split in parallel");
                assert_eq!(recs.len(), world, "{label}: launches");
                for rec in &recs {
                    let rank = rec.rank.expect("a group's launch");
                    let l = format!(
                        "{label} rank {rank} ({:?}, {} parts)",
                        plan.config, plan.parts
                    );
                    let want = fused_block_bytes(&plan, shape, world, rank, norm);
                    let got: Vec<u64> = rec
                        .blocks
                        .iter()
                        .map(|c| c.global_read_bytes + c.global_write_bytes)
                        .collect();
                    if norm && algorithm == Algorithm::OneShot {
                        assert_eq!(
                            got.iter().sum::<u64>(),
                            want.iter().sum::<u64>(),
                            "{l}: the blocks' bytes together"
                        );
                    } else {
                        assert_eq!(got, want, "{l}: bytes block by block");
                    }
                }
            }
        }
    }
}

/// The fused GEMM + all-reduce's RMSNorm, against the same launch without it, block by block:
/// one-shot, a block normalises the rows dealt to it and the first rows of the strips it
/// completes, each moving what the plan says a row moves (`tpfuse::plan::fused_norm_bytes`:
/// read once from registers or shared memory, or twice segment by segment); two-shot, a
/// block's gathered rows b, b + G, ... move the plan's gathered bytes instead of a copy's.
/// The shapes run the 16 x 16 block (32 threads: a row through its stage), 64 x 64 (held in
/// registers), and 16 x 64 on rows of 11264 (its 44 KiB of stage, exactly) and 11272 (past it:
/// segment by segment).
#[test]
fn the_fused_rmsnorm_moves_what_the_plan_says_row_by_row() {
    let _session = session_with(
        FILE,
        "the_fused_rmsnorm_moves_what_the_plan_says_row_by_row",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    // One strip of 16 rows (17 tiles of 16 rows); three strips of 64, 64 and 1 rows (64-row
    // tiles: 9 tiles; a strip of one row has no flag); strips of two rows of 11264 and 11272.
    // A rank's grid is at most 8 SMs' worth.
    let shapes = [
        (2usize, 16usize, 264usize, 40usize),
        (2, 129, 136, 40),
        (2, 2, 11264, 40),
        (2, 2, 11272, 40),
    ];
    // By flags: a packet's wait is in its loads, which a schedule repeats as it likes.
    let by_flags = GroupOptions {
        fused_packets: false,
        ..GroupOptions::default()
    };
    for (world, m, n, k) in shapes {
        let groups = virtual_group(&gpu.ctx, world, by_flags.clone());
        let shape = GemmShape { m, n, k };
        let xs: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0x9f, world, m * k));
        let ws: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0xaf, world, n * k));
        let gammas: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0xbf, world, n));
        let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(&groups, m * n);
        let mut run = |algorithm: Algorithm, norm: bool, label: &str| {
            let mut plans = Vec::new();
            let ((), recs) = counters::count(|| {
                plans = round(&groups, label, |r| {
                    let epilogue = norm_epilogue(None, &gammas[r], norm);
                    let (x, wt, out) = (&xs[r], &ws[r], &mut outs[r]);
                    gemm_all_reduce_with(&groups[r], x, wt, epilogue, out, shape, algorithm)
                });
            });
            assert_eq!(recs.len(), world, "{label}: launches");
            assert!(
                recs.iter()
                    .all(|rec| rec.kernel.contains("gemm_all_reduce")),
                "{label}: {recs:#?}"
            );
            (plans[0], recs)
        };
        let block_of = |recs: &[LaunchCounters], rank: usize, label: &str| {
            recs.iter()
                .find(|rec| rec.rank == Some(rank))
                .unwrap_or_else(|| panic!("{label}: no launch of rank {rank}"))
                .blocks
                .clone()
        };
        let moved = |c: &tpfuse::emulator::counters::BlockCounters| {
            c.global_read_bytes + c.global_write_bytes
        };
        let label = format!("GEMM + all-reduce W={world} (m, n, k)=({m}, {n}, {k})");
        let row_bytes = n as u64 * S;

        let one_shot = format!("{label} one-shot");
        let (plan, plain) = run(Algorithm::OneShot, false, &one_shot);
        let (_, normed) = run(Algorithm::OneShot, true, &one_shot);
        let (norm, gathered) = fused_norm_bytes(plan.config, n);
        let (grid, block_m) = (plan.grid, plan.config.info().block_m);
        let strips = m.div_ceil(block_m);
        for rank in 0..world {
            let (without, with) = (
                block_of(&plain, rank, &one_shot),
                block_of(&normed, rank, &one_shot),
            );
            assert_eq!(with.len(), grid, "{one_shot}: blocks");
            let mut completed = 0;
            for b in 0..grid {
                let extra = with[b].global_write_bytes - without[b].global_write_bytes;
                let rows = ((extra + row_bytes / 2) / row_bytes) as usize;
                let dealt = (0..m).filter(|r| r % grid == b && r % block_m != 0).count();
                assert!(
                    rows >= dealt && rows - dealt <= strips,
                    "{one_shot} rank {rank} block {b}: normalised {rows} rows, dealt {dealt}"
                );
                assert_eq!(
                    moved(&with[b]) - moved(&without[b]),
                    rows as u64 * norm * row_bytes,
                    "{one_shot} rank {rank} block {b}: {rows} rows of {norm} bytes an element"
                );
                completed += rows - dealt;
            }
            assert_eq!(
                completed, strips,
                "{one_shot} rank {rank}: strips' first rows"
            );
        }

        if m % world != 0 {
            continue;
        }
        // Two-shot: without RMSNorm a gathered row is copied (2 bytes an element).
        let two_shot = format!("{label} two-shot");
        let (plan, plain) = run(Algorithm::TwoShot, false, &two_shot);
        let (_, normed) = run(Algorithm::TwoShot, true, &two_shot);
        for rank in 0..world {
            let (without, with) = (
                block_of(&plain, rank, &two_shot),
                block_of(&normed, rank, &two_shot),
            );
            for b in 0..plan.grid {
                let rows = (0..m).filter(|r| r % plan.grid == b).count() as u64;
                assert_eq!(
                    moved(&with[b]) - moved(&without[b]),
                    rows * (gathered - 2) * row_bytes,
                    "{two_shot} rank {rank} block {b}: {rows} gathered rows of {gathered} bytes an element"
                );
            }
        }
    }
}

/// The fused kernels' phase records ([`TpGroup::fused_phases`]) put a late rank's time in the
/// others' wait phase: rank 1's stream starts its work `DELAY` of virtual time late, so every
/// block of rank 0, which waits for rank 1's tiles, waits about that long, and rank 1's
/// blocks, which find rank 0's tiles ready, wait far less.
#[test]
fn a_late_rank_shows_in_the_others_wait_phase() {
    let _session = session_with(
        FILE,
        "a_late_rank_shows_in_the_others_wait_phase",
        SMS,
        60_000_000_000,
    );
    const DELAY: u64 = 2_000_000;
    let gpu = gpu();
    let (world, m, n, k) = (2, 16, 264, 40);
    let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
    let shape = GemmShape { m, n, k };
    let xs: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0x1a7e, world, m * k));
    let ws: Vec<CudaSlice<bf16>> = upload_ranks(&groups, &inputs(0x2a7e, world, n * k));
    let mut outs: Vec<CudaSlice<bf16>> = poisoned_ranks(&groups, m * n);
    for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
        let label = format!("GEMM + all-reduce {algo:?}, rank 1 late by {DELAY} ns");
        emulator::set_cuda_stream_fault(
            groups[1].stream(),
            Fault {
                delay_ns: DELAY,
                ..Fault::default()
            },
        );
        round(&groups, &label, |r| {
            let (x, wt, out) = (&xs[r], &ws[r], &mut outs[r]);
            gemm_all_reduce_with(&groups[r], x, wt, Epilogue::default(), out, shape, algo)
                .map(|_| ())
        });
        emulator::set_cuda_stream_fault(groups[1].stream(), Fault::default());
        let early = groups[0].fused_phases().expect("rank 0's records");
        let late = groups[1].fused_phases().expect("rank 1's records");
        assert!(!early.is_empty() && early.len() == late.len(), "{label}");
        for (e, l) in early.iter().zip(&late) {
            assert!(e.wait_ns >= DELAY / 2, "{label}: rank 0 {e:?}");
            assert!(l.wait_ns < DELAY / 10, "{label}: rank 1 {l:?}");
            assert!(l.start_ns >= e.start_ns + DELAY / 2, "{label}: {e:?} {l:?}");
        }
    }
}

/// The fused GEMM + all-reduce with its split of k in parallel: the plan's units (3 parts of
/// 5 tiles on 16 SMs, one block each), and each block moves what the plan says
/// (`gemm_split_block_bytes`: its part, and the folds; the last fold stores the tile's partial
/// into the exchange area); block t < 5 also reduces tile t.
#[test]
fn the_fused_split_runs_its_parts_as_the_grids_units() {
    let _session = session_with(
        FILE,
        "the_fused_split_runs_its_parts_as_the_grids_units",
        SMS,
        60_000_000_000,
    );
    let gpu = gpu();
    let world = 2;
    // By flags: the peers' partials read across (packets: emu_gemm_all_reduce).
    let options = GroupOptions {
        fused_packets: false,
        ..GroupOptions::default()
    };
    let groups = virtual_group(&gpu.ctx, world, options);
    let (m, n, k) = (1usize, 264usize, 520usize);
    let shape = GemmShape { m, n, k };
    let label = format!("GEMM + all-reduce W={world} (m, n, k)=({m}, {n}, {k})");
    let (plans, recs) = fused_one_shot_counted(&groups, shape, 0x9f, &label);
    let plan: FusedPlan = plans[0];
    let (parts, tiles) = (3, 5);
    assert_eq!(plan.config, GemmConfig::SmallM16x64, "{label}");
    assert_eq!((plan.parts, plan.tiles), (parts, tiles), "{label}");
    assert!(plan.parts_in_parallel, "{label}: the parts in parallel");
    assert_eq!(plan.grid, parts * tiles, "{label}: a block a unit");
    let planned = gemm_split_block_bytes(plan.config, shape, parts, false, false);
    let w = world as u64;
    for rec in &recs {
        let l = format!("{label} rank {:?}", rec.rank);
        assert_eq!(rec.blocks.len(), plan.grid, "{l}: blocks");
        let bytes = |b: usize| rec.blocks[b].global_read_bytes + rec.blocks[b].global_write_bytes;
        // Block t < tiles also reduces tile t: the W ranks' partials read (W - 1 a peer's), out
        // written.
        let outputs = |tile: usize| (m * 64.min(n - tile * 64)) as u64;
        let reduce_of = |tile: usize| (w + 1) * outputs(tile) * S;
        for tile in 0..tiles {
            assert_eq!(
                rec.blocks[tile].peer_read_bytes,
                (w - 1) * outputs(tile) * S,
                "{l}: tile {tile}'s peer partials"
            );
        }
        split_blocks_move_the_plans_bytes(
            &l,
            _session.schedule(),
            (tiles, parts),
            &planned,
            bytes,
            |b| if b < tiles { reduce_of(b) } else { 0 },
            outputs,
        );
    }
}
