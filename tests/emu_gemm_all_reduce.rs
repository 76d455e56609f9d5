//! The fused row-parallel GEMM + all-reduce (`tpfuse_gemm_all_reduce`) on the CPU emulator
//! (feature `emulator`), through the C ABI, on virtual ranks W = 2, 3, 4, 8 (one emulated
//! stream each, the ranks' kernels running at once and waiting on each other's tile flags).
//!
//! The contract (one-shot by packets and by flags, and two-shot where m is a multiple of W):
//! bitwise equal, on every rank, to the unfused sequence — `tpfuse_gemm` of each
//! rank's partial into a workspace, then the one-shot `tpfuse_all_reduce` with the same
//! epilogue — for every epilogue (none, bias, residual, RMSNorm and their combinations), m in
//! {1, 3, 16, 17, 64, 130}, n and k with tails past the tiles and the k-slices, every tile
//! configuration the shapes select, grids of one block per rank (every tile of a rank on one
//! block, waiting in turn) up to several. Also checked: the DESIGN.md tolerance against the
//! f64 reference, many launches in a row with fresh inputs each (epochs, the two exchange
//! areas), GEMM + reduce-scatter and all-gather + GEMM against their unfused sequences.
//! Failures, mismatches and co-residency: tests/emu_fused_failures.rs.
//!
//! Fresh random inputs per case (seeded; `TPFUSE_TEST_SEED` changes them); outputs poisoned
//! (NaN) first, so an element never written fails the bitwise checks.
#![cfg(feature = "emulator")]

mod common;
use common::assert_same_bits;
use common::emu::{deadlock_ns_from_env, launched, session, session_with, Ranks};
use common::fused::*;
use common::gpu::{assert_close, base_seed, mix_seed, random_vec, TestElement};
use half::{bf16, f16};
use tpfuse::emulator::{abi, DeviceBuffer};
use tpfuse::reference::{all_reduce_fused_f64, gemm_f64};

/// (world, blocks, shape, epilogue): every m of the issue, tails of n past 16, 32, 64 and
/// 128 columns and of k past 16, 32 and 64, grids of 1 block per rank (a block with many
/// tiles) and more, every epilogue; the two-shot too where m is a multiple of W (slices of
/// 1, 4, 3, 32 and 65 rows, within a tile row and across them); RMSNorm over strips of 64,
/// 64 and 1 rows (a last strip of one row has no strip flag); one block with more tiles than
/// threads (n = 8256 at m = 2: its strip counts take several passes of its threads). On the
/// session's 32 SMs, k of 800 and 1040 splits (6 and 8 parts): the parts run in parallel as
/// the grid's units (several a block; a block that reduces several tiles, waiting for each;
/// m = 16 with a two-shot, m = 17 with dealt RMSNorm rows), and one after another where their
/// f32 partials pass the capacity (m = 64).
const CASES: [(usize, i32, Shape, Epi); 16] = [
    (2, 2, (1, 264, 136), ALL),
    (3, 2, (3, 136, 40), NONE),
    (4, 1, (16, 72, 72), BIAS),
    (8, 2, (17, 72, 40), RESIDUAL_NORM),
    (2, 3, (64, 136, 40), ALL),
    (4, 2, (130, 72, 24), BIAS_RESIDUAL),
    (2, 1, (130, 136, 40), RESIDUAL_NORM),
    (8, 1, (3, 264, 56), ALL),
    (8, 2, (24, 136, 40), ALL),
    (2, 3, (129, 136, 40), RESIDUAL_NORM),
    (2, 1, (2, 8256, 8), RESIDUAL_NORM),
    (2, 8, (1, 264, 800), ALL),
    (2, 2, (1, 264, 800), BIAS),
    (2, 4, (16, 136, 1040), ALL),
    (3, 8, (17, 136, 1040), RESIDUAL_NORM),
    (2, 2, (64, 136, 1040), BIAS),
];

fn every_case<T: TestElement>(seed: u64) {
    for (i, &(world, blocks, shape, epi)) in CASES.iter().enumerate() {
        case::<T>(world, blocks, shape, epi, mix_seed(seed, &[i as u64]));
    }
}

#[test]
fn fused_equals_gemm_then_all_reduce_bf16() {
    let _s = session(
        "emu_gemm_all_reduce",
        "fused_equals_gemm_then_all_reduce_bf16",
    );
    every_case::<bf16>(base_seed(0xf05e_0001));
}

/// Rows of `n` (m rows, k = 40, bf16, residual and RMSNorm, W = 2, `blocks` blocks a rank) on
/// `sms` SMs of an H100-class device, which selects `config` for them (asserted: the RMSNorm
/// path under test is that block size's), fused against the unfused sequence (the two-shot
/// too where m is even).
fn rows_normalised_by(
    test: &'static str,
    sms: u32,
    config: u32,
    (m, n): (usize, usize),
    blocks: i32,
    seed: u64,
) {
    let _s = session_with("emu_gemm_all_reduce", test, sms, deadlock_ns_from_env());
    let k = 40;
    // SAFETY: a pure function of its arguments.
    let selected = unsafe { abi::tpfuse_gemm_select(m, n, k, 9, 0, sms as i32) };
    assert_eq!(
        selected, config as i32,
        "the shape selects the block size under test"
    );
    case::<bf16>(2, blocks, (m, n, k), RESIDUAL_NORM, seed);
}

/// On 132 SMs (an H100's), n = 4096 without a split of k selects small-m-16x16: blocks of 32
/// threads, which hold no row in registers and stage it in shared memory (epilogue.cuh,
/// rms_norm_row_staged); the two-shot's gather stages its rows too (gather_rows). The
/// session's 32 SMs never select a block that small for a row that long.
#[test]
fn small_blocks_normalise_rows_from_shared_memory() {
    rows_normalised_by(
        "small_blocks_normalise_rows_from_shared_memory",
        132,
        abi::TPFUSE_GEMM_CONFIG_SMALL_16X16,
        (2, 4096),
        4,
        base_seed(0xf05e_0010),
    );
}

/// On 400 SMs, n = 12296 selects small-m-16x16, whose 48 KiB of stage hold 12288 elements of
/// x and gamma: the row goes segment by segment, each segment's 16 turns in two rounds of
/// eight (epilogue.cuh, kInFlight).
#[test]
fn rows_past_the_stage_normalise_in_rounds() {
    rows_normalised_by(
        "rows_past_the_stage_normalise_in_rounds",
        400,
        abi::TPFUSE_GEMM_CONFIG_SMALL_16X16,
        (2, 12296),
        4,
        base_seed(0xf05e_0013),
    );
}

/// On 132 SMs, n = 8192 (Llama-3-70B's hidden size) selects small-m-16x32: blocks of 64
/// threads (two warps), whose 32 KiB of stage hold a row of 8192 and its gamma exactly. One
/// block a rank: it normalises the strip's four rows through the stage one after another, and
/// the two-shot's gather stages them one after another too.
#[test]
fn rows_of_two_segments_normalise_from_shared_memory() {
    rows_normalised_by(
        "rows_of_two_segments_normalise_from_shared_memory",
        132,
        abi::TPFUSE_GEMM_CONFIG_SMALL_16X32,
        (4, 8192),
        1,
        base_seed(0xf05e_0014),
    );
}

/// Small-m-16x16 forced at m = 34 (three strips of 16 rows) on one block a rank: the block
/// completes every strip, naming their first rows in shared memory (count_strips), and
/// normalises each row through the stage that follows those names; the two-shot's gather stages
/// the block's 34 rows one after another.
#[test]
fn a_block_of_three_strips_normalises_them_from_shared_memory() {
    let _s = session(
        "emu_gemm_all_reduce",
        "a_block_of_three_strips_normalises_them_from_shared_memory",
    );
    case_in::<bf16>(
        Some(abi::TPFUSE_GEMM_CONFIG_SMALL_16X16 as i32),
        2,
        1,
        (34, 264, 40),
        RESIDUAL_NORM,
        base_seed(0xf05e_0015),
    );
}

/// The tiled blocks, forced at m = 2 on rows past what their threads hold in registers:
/// tile-128x128 (256 threads, 50 KiB of stage) on a row of 4104 and tile-64x64 (128 threads,
/// its fused variant's 80 KiB) on a row of 12296, both through the stage.
#[test]
fn tiled_blocks_normalise_long_rows_from_shared_memory() {
    let _s = session(
        "emu_gemm_all_reduce",
        "tiled_blocks_normalise_long_rows_from_shared_memory",
    );
    for (i, (config, n)) in [
        (abi::TPFUSE_GEMM_CONFIG_TILE_128X128, 4104),
        (abi::TPFUSE_GEMM_CONFIG_TILE_64X64, 12296),
    ]
    .into_iter()
    .enumerate()
    {
        case_in::<bf16>(
            Some(config as i32),
            2,
            2,
            (2, n, 40),
            RESIDUAL_NORM,
            mix_seed(base_seed(0xf05e_0016), &[i as u64]),
        );
    }
}

/// On 32 SMs, n = 4096 without a split of k selects small-m-16x64: blocks of 128 threads,
/// which hold a row of 4096 in registers, four turns of 1024 elements (epilogue.cuh,
/// rms_norm_held_row), and normalise it from them.
#[test]
fn blocks_that_hold_a_row_normalise_it_from_registers() {
    rows_normalised_by(
        "blocks_that_hold_a_row_normalise_it_from_registers",
        32,
        abi::TPFUSE_GEMM_CONFIG_SMALL_16X64,
        (2, 4096),
        4,
        base_seed(0xf05e_0012),
    );
}

#[test]
fn fused_equals_gemm_then_all_reduce_f16() {
    let _s = session(
        "emu_gemm_all_reduce",
        "fused_equals_gemm_then_all_reduce_f16",
    );
    every_case::<f16>(base_seed(0xf05e_0002));
}

/// Every rank's launch along each path (fused first, then unfused): `launch(fused, rank, out)`
/// enqueues on the rank's stream and returns the launcher's code and what must outlive the
/// launch; then a synchronize, no error word. Returns each path's outputs per rank and what
/// the unfused launches kept.
fn on_both_paths<T: TestElement, K>(
    ranks: &Ranks,
    label: &str,
    out_len: usize,
    mut launch: impl FnMut(bool, usize, &DeviceBuffer<T>) -> (i32, K),
) -> ([Vec<Vec<T>>; 2], Vec<K>) {
    let mut results: [Vec<Vec<T>>; 2] = Default::default();
    let mut kept = Vec::new();
    for (path, fused) in [true, false].into_iter().enumerate() {
        kept.clear();
        let outs: Vec<DeviceBuffer<T>> = (0..ranks.world).map(|_| poisoned::<T>(out_len)).collect();
        for (r, out) in outs.iter().enumerate() {
            let (code, keep) = launch(fused, r, out);
            launched(&format!("{label}: rank {r} (fused: {fused})"), code);
            kept.push(keep);
        }
        ranks.synchronize();
        for r in 0..ranks.world {
            assert_eq!(ranks.error_word(r), 0, "{label}: rank {r} failed");
        }
        results[path] = outs.iter().map(DeviceBuffer::to_vec).collect();
    }
    (results, kept)
}

/// GEMM + reduce-scatter on every rank against tpfuse_gemm then tpfuse_reduce_scatter: rank r's
/// slice of m / W rows, bitwise, and against f64.
fn reduce_scatter_case<T: TestElement>(world: usize, blocks: i32, shape: Shape, seed: u64) {
    let (m, n, k) = shape;
    let label = format!(
        "reduce-scatter {} W={world} blocks={blocks} (m, n, k)={shape:?} seed={seed:#x}",
        T::NAME
    );
    let p = problem::<T>(world, shape, NONE, seed);
    let ranks = Ranks::with_capacity(world, blocks, LONG_TIMEOUT_NS, CAPACITY);
    let rows = m / world;
    let (results, kept) = on_both_paths(
        &ranks,
        &label,
        rows * n,
        |fused, r, out: &DeviceBuffer<T>| {
            let x = DeviceBuffer::from_slice(&p.x[r]);
            let w = DeviceBuffer::from_slice(&p.w[r]);
            let partial = poisoned::<T>(m * n);
            let (peers, args, stream) = (ranks.peers(), ranks.args(r), ranks.stream(r));
            let config = auto_config(m, n, k);
            let code = if fused {
                enqueue_gemm_reduce_scatter(&ranks, r, (&x, &w, out), shape, config, blocks)
            } else {
                let what = format!("{label}: gemm rank {r}");
                enqueue_gemm(&x, &w, &partial, shape, stream, &what);
                // SAFETY: every buffer holds what the shapes need and is kept until the
                // synchronize.
                unsafe {
                    abi::tpfuse_reduce_scatter(
                        T::DTYPE,
                        &peers,
                        &args,
                        partial.ptr().cast(),
                        out.ptr().cast(),
                        rows * n,
                        stream,
                    )
                }
            };
            (code, (x, w, partial))
        },
    );
    let partials: Vec<Vec<T>> = kept.iter().map(|(_, _, p)| p.to_vec()).collect();
    let refs: Vec<&[T]> = partials.iter().map(Vec::as_slice).collect();
    let (sum, _) = all_reduce_fused_f64(&refs, None, None, None, 0.0, n);
    for r in 0..world {
        let at = format!("{label} rank {r}");
        assert_same_bits(
            &format!("{at}: fused vs unfused"),
            &results[0][r],
            &results[1][r],
        );
        assert_close(
            &format!("{at}: vs f64"),
            &results[0][r],
            &sum[r * rows * n..(r + 1) * rows * n],
            T::TOLERANCE,
        );
    }
}

/// (world, blocks, shape): slices of 1, 3, 16, 65 rows (tiles of 16 and 64 rows cut across
/// slices), tails of n and k; a split of k in parallel (6 parts of 800 on 32 SMs).
const REDUCE_SCATTER_CASES: [(usize, i32, Shape); 7] = [
    (2, 2, (2, 136, 40)),
    (3, 1, (9, 72, 72)),
    (4, 2, (64, 72, 40)),
    (8, 2, (24, 264, 24)),
    (2, 3, (130, 136, 40)),
    (4, 1, (68, 72, 56)),
    (4, 6, (16, 264, 800)),
];

#[test]
fn gemm_reduce_scatter_equals_gemm_then_reduce_scatter() {
    let _s = session(
        "emu_gemm_all_reduce",
        "gemm_reduce_scatter_equals_gemm_then_reduce_scatter",
    );
    let seed = base_seed(0xf05e_0007);
    for (i, &(world, blocks, shape)) in REDUCE_SCATTER_CASES.iter().enumerate() {
        reduce_scatter_case::<bf16>(world, blocks, shape, mix_seed(seed, &[i as u64, 1]));
        reduce_scatter_case::<f16>(world, blocks, shape, mix_seed(seed, &[i as u64, 2]));
    }
}

/// Reduce-scatters and one-shot all-reduces (by packets) back to back on every rank, nothing
/// synchronised between them. In a reduce-scatter a rank needs only the peers' blocks that
/// hold rows of its slice, so it may finish launch E and start E + 1 while a peer's block of
/// other rows has not started E yet: that block must take the rank's started flag of E + 1
/// (cuda/fused_flags.cuh, "Started flags"), not wait for one of E - 1 or E to the deadline.
/// The reduce-scatters on small 16-row tiles (slices of 16 rows: tiles of one rank's rows
/// only) and 6 blocks a rank; the all-reduces on the configuration tpfuse_gemm_select gives.
/// Every launch completes and every output is close to f64.
#[test]
fn reduce_scatters_and_all_reduces_back_to_back_complete() {
    let _s = session(
        "emu_gemm_all_reduce",
        "reduce_scatters_and_all_reduces_back_to_back_complete",
    );
    let (world, blocks, (m, n, k)) = (2, 6, (32usize, 136usize, 40usize));
    let config = abi::TPFUSE_GEMM_CONFIG_SMALL_16X64 as i32;
    let seed = base_seed(0xf05e_0011);
    let ranks = Ranks::with_capacity(world, blocks, LONG_TIMEOUT_NS, CAPACITY);
    let steps = "ssaasaa";
    let problems: Vec<Problem<bf16>> = (0..steps.len())
        .map(|step| problem::<bf16>(world, (m, n, k), NONE, mix_seed(seed, &[step as u64])))
        .collect();
    let mut kept = Vec::new();
    for (step, kind) in steps.chars().enumerate() {
        let p = &problems[step];
        for r in 0..world {
            // What the launch writes and reads, kept until the synchronize.
            let launch = if kind == 's' {
                let x = DeviceBuffer::from_slice(&p.x[r]);
                let w = DeviceBuffer::from_slice(&p.w[r]);
                let out = poisoned::<bf16>(m / world * n);
                let buffers = (&x, &w, &out);
                let code =
                    enqueue_gemm_reduce_scatter(&ranks, r, buffers, (m, n, k), config, blocks);
                launched(&format!("step {step} ({kind}) rank {r}"), code);
                Ok((out, [x, w]))
            } else {
                Err(enqueue(&ranks, r, p, Path::Fused, &None))
            };
            kept.push((step, kind, r, launch));
        }
    }
    ranks.synchronize();
    for r in 0..world {
        assert_eq!(ranks.error_word(r), 0, "rank {r}: a launch failed");
    }
    for (step, kind, r, launch) in &kept {
        let out = match launch {
            Ok((out, _)) => out,
            Err(fused) => &fused.out,
        };
        let p = &problems[*step];
        // Each rank's partial rounded to bf16, as the kernels round it.
        let partials: Vec<Vec<f64>> = (0..world)
            .map(|q| {
                gemm_f64(&p.x[q], &p.w[q], None, None, m, n, k)
                    .into_iter()
                    .map(|v| bf16::from_f64(v).to_f64())
                    .collect()
            })
            .collect();
        let rows = if *kind == 's' { m / world } else { m };
        let first = if *kind == 's' { r * rows * n } else { 0 };
        let sum: Vec<f64> = (first..first + rows * n)
            .map(|e| partials.iter().map(|q| q[e]).sum())
            .collect();
        assert_close(
            &format!("step {step} ({kind}) rank {r}: out vs f64"),
            &out.to_vec(),
            &sum,
            bf16::TOLERANCE,
        );
    }
}

/// All-gather + GEMM on every rank against tpfuse_all_gather then tpfuse_gemm: every rank's
/// out [m, n] from the rows of every rank's x [m / W, k] and its own weight, bitwise, and
/// against f64.
fn all_gather_gemm_case<T: TestElement>(
    world: usize,
    blocks: i32,
    shape: Shape,
    bias: bool,
    forced: Option<i32>,
    seed: u64,
) {
    let (m, n, k) = shape;
    let config = forced.unwrap_or_else(|| auto_config(m, n, k));
    let label = format!("all-gather + GEMM {} W={world} blocks={blocks} (m, n, k)={shape:?} bias={bias} config {config} seed={seed:#x}", T::NAME);
    let rows = m / world;
    let xs: Vec<Vec<T>> = (0..world)
        .map(|r| random_vec(mix_seed(seed, &[1, r as u64]), rows * k, -1.0, 1.0))
        .collect();
    let scale = 2.0 / (k as f32).sqrt();
    let ws: Vec<Vec<T>> = (0..world)
        .map(|r| random_vec(mix_seed(seed, &[2, r as u64]), n * k, -scale, scale))
        .collect();
    let b: Option<Vec<T>> = bias.then(|| random_vec(mix_seed(seed, &[3]), n, -1.0, 1.0));
    let ranks = Ranks::with_capacity(world, blocks, LONG_TIMEOUT_NS, CAPACITY);
    let (results, _kept) =
        on_both_paths(&ranks, &label, m * n, |fused, r, out: &DeviceBuffer<T>| {
            let x = DeviceBuffer::from_slice(&xs[r]);
            let w = DeviceBuffer::from_slice(&ws[r]);
            let bias = b.as_deref().map(DeviceBuffer::from_slice);
            let gathered = poisoned::<T>(m * k);
            let (peers, args, stream) = (ranks.peers(), ranks.args(r), ranks.stream(r));
            // SAFETY: every buffer holds what the shapes need and is kept until the synchronize.
            let code = unsafe {
                if fused {
                    enqueue_all_gather_gemm(config, &ranks, r, &x, &w, &bias, out, shape, blocks)
                } else {
                    let bytes = rows * k * std::mem::size_of::<T>();
                    let code = abi::tpfuse_all_gather(
                        &peers,
                        &args,
                        x.ptr().cast(),
                        gathered.ptr().cast(),
                        bytes,
                        stream,
                    );
                    launched(&format!("{label}: all_gather rank {r}"), code);
                    abi::tpfuse_gemm(
                        T::DTYPE,
                        abi::TPFUSE_GEMM_CONFIG_AUTO,
                        gathered.ptr().cast(),
                        w.ptr().cast(),
                        opt_ptr(&bias),
                        std::ptr::null(),
                        out.ptr().cast(),
                        m,
                        n,
                        k,
                        stream,
                    )
                }
            };
            (code, (x, w, bias, gathered))
        });
    let x_all: Vec<T> = xs.concat();
    for r in 0..world {
        let at = format!("{label} rank {r}");
        assert_same_bits(
            &format!("{at}: fused vs unfused"),
            &results[0][r],
            &results[1][r],
        );
        let want = gemm_f64(&x_all, &ws[r], b.as_deref(), None, m, n, k);
        assert_close(
            &format!("{at}: vs f64"),
            &results[0][r],
            &want,
            T::TOLERANCE,
        );
    }
}

/// (world, blocks, shape, bias, forced configuration): slices of 1, 3, 16, 17, 65 rows (tiles
/// of 16 and 64 rows that span several ranks' rows), tails of n and k; and k = 800 or 1000,
/// which split into parts run in parallel (6, 6 and 7 parts on the session's 32 SMs), a block
/// computing one part (12 blocks for 12 units) or several (5 for 18, 3 for 14) and folding what
/// it finds stored; in forced 16 x 64 tiles at m = 32, where the split's units visit two tile
/// rows from the rank's own on (the configurations tpfuse_gemm chooses give a split one tile
/// row); and in forced 16 x 16 tiles (32 threads) of 4 ranks' rows, 17 tiles on 9 blocks:
/// four ranks' gather flags a tile, one a thread; and k = 8, a rank's one row one 16-byte
/// vector on 2 blocks: a block with no share of it still counts its (empty) part.
const ALL_GATHER_GEMM_CASES: [(usize, i32, Shape, bool, Option<i32>); 12] = [
    (2, 2, (2, 136, 40), true, None),
    (2, 2, (2, 72, 8), false, None),
    (3, 1, (9, 72, 72), false, None),
    (4, 2, (64, 72, 40), true, None),
    (8, 2, (24, 264, 24), true, None),
    (2, 3, (130, 136, 40), false, None),
    (4, 1, (68, 72, 56), true, None),
    (2, 12, (4, 72, 800), true, None),
    (3, 5, (9, 136, 800), false, None),
    (4, 3, (64, 72, 1000), true, None),
    (
        2,
        5,
        (32, 72, 800),
        true,
        Some(abi::TPFUSE_GEMM_CONFIG_SMALL_16X64 as i32),
    ),
    (
        4,
        9,
        (16, 264, 40),
        true,
        Some(abi::TPFUSE_GEMM_CONFIG_SMALL_16X16 as i32),
    ),
];

#[test]
fn all_gather_gemm_equals_all_gather_then_gemm() {
    let _s = session(
        "emu_gemm_all_reduce",
        "all_gather_gemm_equals_all_gather_then_gemm",
    );
    let seed = base_seed(0xf05e_0008);
    for (i, &(world, blocks, shape, bias, forced)) in ALL_GATHER_GEMM_CASES.iter().enumerate() {
        let seed = |dtype| mix_seed(seed, &[i as u64, dtype]);
        all_gather_gemm_case::<bf16>(world, blocks, shape, bias, forced, seed(1));
        all_gather_gemm_case::<f16>(world, blocks, shape, bias, forced, seed(2));
    }
}

/// Launches in a row on every stream, all in flight before one synchronize, each with fresh
/// inputs and the residual carried from one to the next (a decode loop): every launch's
/// epoch and exchange area must be its own. Every other launch splits k in parallel (6 parts
/// of 800 on 32 SMs: its flags per tile, where the others' are per block).
#[test]
fn launches_in_a_row_each_get_their_own_inputs() {
    let _s = session(
        "emu_gemm_all_reduce",
        "launches_in_a_row_each_get_their_own_inputs",
    );
    let (world, steps) = (3, 12);
    let seed = base_seed(0xf05e_0003);
    let ranks = Ranks::with_capacity(world, 2, LONG_TIMEOUT_NS, CAPACITY);
    let problems: Vec<Problem<bf16>> = (0..steps)
        .map(|step| {
            let k = if step % 2 == 0 { 40 } else { 800 };
            problem::<bf16>(world, (2, 72, k), ALL, mix_seed(seed, &[step]))
        })
        .collect();
    let mut finals = Vec::new();
    for path in [Path::Fused, Path::Unfused] {
        let residuals = residuals(world, &problems[0]);
        let kept: Vec<Vec<Buffers<bf16>>> = problems
            .iter()
            .map(|p| {
                (0..world)
                    .map(|r| enqueue(&ranks, r, p, path, &residuals[r]))
                    .collect()
            })
            .collect();
        ranks.synchronize();
        let outs: Vec<Vec<Vec<bf16>>> = kept
            .iter()
            .map(|step| step.iter().map(|b| b.out.to_vec()).collect())
            .collect();
        let res: Vec<Vec<bf16>> = residuals
            .iter()
            .map(|b| b.as_ref().expect("residual").to_vec())
            .collect();
        finals.push((outs, res));
    }
    for step in 0..steps as usize {
        for r in 0..world {
            let at = format!("step {step} rank {r}");
            assert_same_bits(
                &format!("{at}: out, fused vs unfused"),
                &finals[0].0[step][r],
                &finals[1].0[step][r],
            );
        }
    }
    for r in 0..world {
        assert_same_bits(
            &format!("rank {r}: final residual"),
            &finals[0].1[r],
            &finals[1].1[r],
        );
    }
}

/// All-gather + GEMM launches in a row on every rank, all in flight before one synchronize,
/// each with fresh inputs: a rank counts its blocks' pushed parts in one word of its pad, which
/// the block that completes the count sets back to 0 before it publishes the rank's gather
/// flag, so each launch's flag must wait for that launch's parts (a flag of the launch before,
/// or a count left full, would let a tile read the rows before they arrive). Every other launch
/// splits k in parallel (6 parts of 800 on 32 SMs). Each launch's out bitwise against
/// all_gather then gemm of the same inputs, and every count back at 0.
#[test]
fn all_gather_gemm_launches_in_a_row_each_get_their_own_inputs() {
    let _s = session(
        "emu_gemm_all_reduce",
        "all_gather_gemm_launches_in_a_row_each_get_their_own_inputs",
    );
    let (world, steps, blocks, n) = (3, 6, 3, 72);
    let seed = base_seed(0xf05e_000b);
    let ranks = Ranks::with_capacity(world, blocks, LONG_TIMEOUT_NS, CAPACITY);
    // (shape, every rank's x, every rank's w) of each step.
    type Step = (Shape, Vec<DeviceBuffer<bf16>>, Vec<DeviceBuffer<bf16>>);
    let inputs: Vec<Step> = (0..steps)
        .map(|step| {
            let (m, k) = if step % 2 == 0 { (9, 40) } else { (6, 800) };
            let data = |what: u64, r: usize, len: usize, bound: f32| {
                let values =
                    random_vec(mix_seed(seed, &[step, what, r as u64]), len, -bound, bound);
                DeviceBuffer::from_slice(&values)
            };
            let xs = (0..world).map(|r| data(1, r, m / world * k, 1.0)).collect();
            let ws = (0..world).map(|r| data(2, r, n * k, 0.2)).collect();
            ((m, n, k), xs, ws)
        })
        .collect();
    // Every step's fused launches in flight together.
    let fused: Vec<Vec<DeviceBuffer<bf16>>> = inputs
        .iter()
        .map(|((m, n, k), xs, ws)| {
            (0..world)
                .map(|r| {
                    let out = poisoned::<bf16>(m * n);
                    let config = auto_config(*m, *n, *k);
                    let code = enqueue_all_gather_gemm(
                        config,
                        &ranks,
                        r,
                        &xs[r],
                        &ws[r],
                        &None,
                        &out,
                        (*m, *n, *k),
                        blocks,
                    );
                    launched(&format!("all_gather_gemm rank {r}"), code);
                    out
                })
                .collect()
        })
        .collect();
    ranks.synchronize();
    // The same steps unfused: all_gather, then gemm.
    let unfused: Vec<Vec<(DeviceBuffer<bf16>, DeviceBuffer<bf16>)>> = inputs
        .iter()
        .map(|((m, n, k), xs, ws)| {
            (0..world)
                .map(|r| {
                    let gathered = poisoned::<bf16>(m * k);
                    let out = poisoned::<bf16>(m * n);
                    let bytes = m / world * k * std::mem::size_of::<bf16>();
                    let (peers, args, stream) = (ranks.peers(), ranks.args(r), ranks.stream(r));
                    // SAFETY: the buffers hold what the shapes need and are kept until the
                    // synchronize.
                    let code = unsafe {
                        abi::tpfuse_all_gather(
                            &peers,
                            &args,
                            xs[r].ptr().cast(),
                            gathered.ptr().cast(),
                            bytes,
                            stream,
                        )
                    };
                    launched(&format!("all_gather rank {r}"), code);
                    // SAFETY: as above.
                    let code = unsafe {
                        abi::tpfuse_gemm(
                            <bf16 as tpfuse::Element>::DTYPE,
                            abi::TPFUSE_GEMM_CONFIG_AUTO,
                            gathered.ptr().cast(),
                            ws[r].ptr().cast(),
                            std::ptr::null(),
                            std::ptr::null(),
                            out.ptr().cast(),
                            *m,
                            *n,
                            *k,
                            stream,
                        )
                    };
                    launched(&format!("gemm rank {r}"), code);
                    (gathered, out)
                })
                .collect()
        })
        .collect();
    ranks.synchronize();
    let count_word = abi::TPFUSE_SIGNAL_GATHER_COUNT_OFFSET as usize / 4;
    for (r, pad) in ranks.signals.iter().enumerate() {
        assert_eq!(pad.to_vec()[count_word], 0, "rank {r}: the gather count");
    }
    for step in 0..steps as usize {
        for r in 0..world {
            let at = format!("step {step} rank {r}");
            assert_eq!(ranks.error_word(r), 0, "{at}: a launch failed");
            assert_same_bits(
                &format!("{at}: out, fused vs unfused"),
                &fused[step][r].to_vec(),
                &unfused[step][r].1.to_vec(),
            );
        }
    }
}

/// A one-shot all-reduce with RMSNorm, then all-gather + GEMM, in a row on every rank: the
/// all-reduce keeps its RMSNorm partials at the start of the rank's result area, where rank 0's
/// rows land at even epochs, and its peers read its staging, where the all-gather + GEMM's
/// split keeps its f32 partials, until they finish: a rank that finished the all-reduce must
/// wait for every peer's announcement before it pushes or stages (barrier.cuh, "Finished
/// launches"). Every launch's bits against the same launch run alone.
#[test]
fn an_all_gather_gemm_right_after_a_one_shot_rmsnorm_overlaps_nothing() {
    let _s = session(
        "emu_gemm_all_reduce",
        "an_all_gather_gemm_right_after_a_one_shot_rmsnorm_overlaps_nothing",
    );
    let (world, steps, blocks) = (2, 6, 2);
    let seed = base_seed(0xf05e_0009);
    let ranks = Ranks::with_capacity(world, blocks, LONG_TIMEOUT_NS, CAPACITY);
    // 16 rows of 8192: 32 segments, one partial each, 16 per block (a row of one segment
    // keeps no partial: it is normalised in registers).
    let norm = Epi { norm: true, ..NONE };
    let p = problem::<bf16>(world, (16, 8192, 16), norm, mix_seed(seed, &[1]));
    // k splits in parallel (6 parts on 32 SMs): the all-gather + GEMM's f32 partials in the
    // rank's staging half, where the one-shot stages its input.
    let gather: Shape = (4, 72, 800);
    let (m, n, k) = gather;
    let xs: Vec<DeviceBuffer<bf16>> = (0..world)
        .map(|r| {
            DeviceBuffer::from_slice(&random_vec(
                mix_seed(seed, &[2, r as u64]),
                m / world * k,
                -1.0,
                1.0,
            ))
        })
        .collect();
    let ws: Vec<DeviceBuffer<bf16>> = (0..world)
        .map(|r| {
            DeviceBuffer::from_slice(&random_vec(
                mix_seed(seed, &[3, r as u64]),
                n * k,
                -0.2,
                0.2,
            ))
        })
        .collect();
    let gathered_gemm = |r: usize| {
        let out = poisoned::<bf16>(m * n);
        let config = auto_config(m, n, k);
        let code = enqueue_all_gather_gemm(
            config, &ranks, r, &xs[r], &ws[r], &None, &out, gather, blocks,
        );
        launched(&format!("all_gather_gemm rank {r}"), code);
        out
    };
    // Alone: the all-reduce, then (another synchronize) the all-gather + GEMM.
    let (alone, _) = run(&ranks, &p, Path::Unfused);
    let gathered_alone: Vec<DeviceBuffer<bf16>> = (0..world).map(gathered_gemm).collect();
    ranks.synchronize();
    // In a row, every step's launches in flight together.
    let kept: Vec<Vec<(Buffers<bf16>, DeviceBuffer<bf16>)>> = (0..steps)
        .map(|_| {
            (0..world)
                .map(|r| {
                    (
                        enqueue(&ranks, r, &p, Path::Unfused, &None),
                        gathered_gemm(r),
                    )
                })
                .collect()
        })
        .collect();
    ranks.synchronize();
    for (step, launches) in kept.iter().enumerate() {
        for (r, (reduced, gathered)) in launches.iter().enumerate() {
            let at = format!("step {step} rank {r}");
            assert_eq!(ranks.error_word(r), 0, "{at}: a launch failed");
            assert_same_bits(
                &format!("{at}: the all-reduce's out"),
                &reduced.out.to_vec(),
                &alone[r].out.to_vec(),
            );
            assert_same_bits(
                &format!("{at}: the all-gather + GEMM's out"),
                &gathered.to_vec(),
                &gathered_alone[r].to_vec(),
            );
        }
    }
}

/// With k split in parallel, the parts' f32 partials overwrite the start of the rank's staging
/// half: an argument there (x, or out) is refused before anything is launched, on the rank
/// that passes it.
#[test]
fn an_argument_in_the_staging_half_is_refused_when_k_splits_in_parallel() {
    let _s = session(
        "emu_gemm_all_reduce",
        "an_argument_in_the_staging_half_is_refused_when_k_splits_in_parallel",
    );
    let (m, n, k) = (1usize, 264usize, 800usize);
    let ranks = Ranks::with_capacity(2, 2, LONG_TIMEOUT_NS, CAPACITY);
    let peers = ranks.peers();
    let args = ranks.args(0);
    let x = DeviceBuffer::from_slice(&random_vec::<bf16>(0x51, m * k, -1.0, 1.0));
    let w = DeviceBuffer::from_slice(&random_vec::<bf16>(0x52, n * k, -1.0, 1.0));
    let out = poisoned::<bf16>(m * n);
    // The staging half's first bytes, then just past the 6 parts' 6 x 1 x 264 x 4 bytes.
    let staging = peers.data[0].cast::<u8>();
    let partials = 6 * m * n * 4;
    for (what, x_at, out_at) in [
        ("x at the staging's start", staging.cast(), out.ptr().cast()),
        (
            "out in the partials",
            x.ptr().cast(),
            staging.wrapping_add(partials - 16).cast(),
        ),
    ] {
        // SAFETY: the call is refused before it launches anything (what this test asserts).
        let code = unsafe {
            abi::tpfuse_gemm_all_reduce(
                <bf16 as tpfuse::dtype::Element>::DTYPE,
                auto_config(m, n, k),
                &peers,
                &args,
                ranks.blocks,
                x_at,
                w.ptr().cast(),
                std::ptr::null(),
                std::ptr::null_mut(),
                std::ptr::null(),
                EPS,
                out_at,
                m,
                n,
                k,
                ranks.stream(0),
            )
        };
        assert_eq!(code, 1, "{what}: cudaErrorInvalidValue");
    }
    ranks.synchronize();
    assert_eq!(ranks.error_word(0), 0, "nothing ran");
    assert!(out.to_vec().iter().all(|v| v.is_nan()), "out untouched");
}
