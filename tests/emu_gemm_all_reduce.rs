//! The fused row-parallel GEMM + all-reduce (`tpfuse_gemm_all_reduce`) on the CPU emulator
//! (feature `emulator`), through the C ABI, on virtual ranks W = 2, 3, 4, 8 (one emulated
//! stream each, the ranks' kernels running at once and waiting on each other's tile flags).
//!
//! The contract (one-shot, and two-shot where m is a multiple of W): bitwise equal, on every
//! rank, to the unfused sequence — `tpfuse_gemm` of each
//! rank's partial into a workspace, then the one-shot `tpfuse_all_reduce` with the same
//! epilogue — for every epilogue (none, bias, residual, RMSNorm and their combinations), m in
//! {1, 3, 16, 17, 64, 130}, n and k with tails past the tiles and the k-slices, every tile
//! configuration the shapes select, grids of one block per rank (every tile of a rank on one
//! block, waiting in turn) up to several. Also checked: the DESIGN.md tolerance against the
//! f64 reference, many launches in a row with fresh inputs each (epochs, the two exchange
//! areas), a missing rank (a timeout on every survivor, every output marked failed) and ranks
//! that launch different shapes (a mismatch, not wrong data).
//!
//! Fresh random inputs per case (seeded; `TPFUSE_TEST_SEED` changes them); outputs poisoned
//! (NaN) first, so an element never written fails the bitwise checks.
#![cfg(feature = "emulator")]

mod common;
use common::assert_same_bits;
use common::emu::{launched, session, session_with, Ranks};
use common::gpu::{assert_close, base_seed, mix_seed, random_vec, TestElement};
use half::{bf16, f16};
use std::ffi::c_void;
use tpfuse::emulator::{self, abi, DeviceBuffer, Fault};
use tpfuse::ops::gemm::{select_config, GemmShape};
use tpfuse::reference::{all_reduce_fused_f64, gemm_f64};
use tpfuse::Element;

const EPS: f32 = 1e-5;
/// cudaErrorCooperativeLaunchTooLarge.
const COOPERATIVE_LAUNCH_TOO_LARGE: i32 = 720;
const LONG_TIMEOUT_NS: u64 = 60_000_000_000;
/// Staging per rank: the fused kernel exchanges m·n elements in half of the result area.
const CAPACITY: usize = 256 * 1024;

/// Which parts of the epilogue a case uses.
#[derive(Clone, Copy, Debug)]
struct Epi {
    bias: bool,
    residual: bool,
    norm: bool,
}

const NONE: Epi = Epi {
    bias: false,
    residual: false,
    norm: false,
};
const BIAS: Epi = Epi { bias: true, ..NONE };
const BIAS_RESIDUAL: Epi = Epi {
    residual: true,
    ..BIAS
};
const RESIDUAL_NORM: Epi = Epi {
    residual: true,
    norm: true,
    ..NONE
};
const ALL: Epi = Epi {
    norm: true,
    ..BIAS_RESIDUAL
};

/// One case's host data: per rank x_r [m, k] and w_r [n, k]; shared bias, residual, gamma.
struct Problem<T> {
    m: usize,
    n: usize,
    k: usize,
    x: Vec<Vec<T>>,
    w: Vec<Vec<T>>,
    bias: Option<Vec<T>>,
    residual: Option<Vec<T>>,
    gamma: Option<Vec<T>>,
}

fn problem<T: TestElement>(
    world: usize,
    (m, n, k): (usize, usize, usize),
    epi: Epi,
    seed: u64,
) -> Problem<T> {
    let scale = 2.0 / (k as f32).sqrt();
    Problem {
        m,
        n,
        k,
        x: (0..world)
            .map(|r| random_vec(mix_seed(seed, &[1, r as u64]), m * k, -1.0, 1.0))
            .collect(),
        w: (0..world)
            .map(|r| random_vec(mix_seed(seed, &[2, r as u64]), n * k, -scale, scale))
            .collect(),
        bias: epi
            .bias
            .then(|| random_vec(mix_seed(seed, &[3]), n, -1.0, 1.0)),
        residual: epi
            .residual
            .then(|| random_vec(mix_seed(seed, &[4]), m * n, -2.0, 2.0)),
        gamma: epi
            .norm
            .then(|| random_vec(mix_seed(seed, &[5]), n, 0.5, 1.5)),
    }
}

/// One rank's device buffers of one launch, kept until it is checked.
struct Buffers<T: Copy> {
    out: DeviceBuffer<T>,
    partial: DeviceBuffer<T>,
    _inputs: Vec<DeviceBuffer<T>>,
}

/// Every rank's residual, holding p.residual, when the case has one.
fn residuals<T: TestElement>(world: usize, p: &Problem<T>) -> Vec<Option<DeviceBuffer<T>>> {
    (0..world)
        .map(|_| p.residual.as_deref().map(DeviceBuffer::from_slice))
        .collect()
}

fn poisoned<T: TestElement>(len: usize) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(&vec![T::from_f32(f32::NAN); len])
}

fn opt_ptr<T: Copy>(b: &Option<DeviceBuffer<T>>) -> *mut c_void {
    b.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr().cast())
}

/// How one rank computes the case.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    /// tpfuse_gemm_all_reduce.
    Fused,
    /// tpfuse_gemm_all_reduce_two_shot (m a multiple of W).
    TwoShot,
    /// tpfuse_gemm into the workspace, then the one-shot tpfuse_all_reduce.
    Unfused,
}

/// The configuration tpfuse_gemm(AUTO) runs for the shape on the emulated device (9.0, its
/// SM count): what the Rust layer passes.
fn auto_config(m: usize, n: usize, k: usize) -> i32 {
    let sms = emulator::config().sms as i32;
    // SAFETY: a pure function of its arguments.
    unsafe { abi::tpfuse_gemm_select(m, n, k, 9, 0, sms) }
}

/// tpfuse_gemm of `x` [m, k] and `w` [n, k] into `c` [m, n] on `stream` (no bias, no residual).
fn enqueue_gemm<T: TestElement>(
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    c: &DeviceBuffer<T>,
    (m, n, k): Shape,
    stream: *mut c_void,
    what: &str,
) {
    // SAFETY: the caller's buffers hold [m, k], [n, k] and [m, n] elements and outlive the
    // launch (they are kept until the synchronize).
    let code = unsafe {
        abi::tpfuse_gemm(
            T::DTYPE,
            abi::TPFUSE_GEMM_CONFIG_AUTO,
            x.ptr().cast(),
            w.ptr().cast(),
            std::ptr::null(),
            std::ptr::null(),
            c.ptr().cast(),
            m,
            n,
            k,
            stream,
        )
    };
    launched(what, code);
}

/// Enqueues rank `rank`'s launch of `p` on its stream, with `residual` (read, then written).
fn enqueue<T: TestElement>(
    ranks: &Ranks,
    rank: usize,
    p: &Problem<T>,
    path: Path,
    residual: &Option<DeviceBuffer<T>>,
) -> Buffers<T> {
    let (buffers, code) = try_enqueue(ranks, rank, p, path, residual);
    launched(&format!("{path:?} rank {rank}"), code);
    buffers
}

/// [`enqueue`], returning the code of the fused launch (of the all-reduce, unfused) instead of
/// asserting it.
fn try_enqueue<T: TestElement>(
    ranks: &Ranks,
    rank: usize,
    p: &Problem<T>,
    path: Path,
    residual: &Option<DeviceBuffer<T>>,
) -> (Buffers<T>, i32) {
    let (m, n, k) = (p.m, p.n, p.k);
    let x = DeviceBuffer::from_slice(&p.x[rank]);
    let w = DeviceBuffer::from_slice(&p.w[rank]);
    let bias = p.bias.as_deref().map(DeviceBuffer::from_slice);
    let gamma = p.gamma.as_deref().map(DeviceBuffer::from_slice);
    let out = poisoned::<T>(m * n);
    let partial = poisoned::<T>(m * n);
    let stream = ranks.stream(rank);
    let args = ranks.args(rank);
    let peers = ranks.peers();
    // SAFETY: every buffer holds the elements the shapes need and lives until the caller
    // synchronizes (Buffers keeps them).
    let code = match path {
        Path::Fused | Path::TwoShot => {
            let launcher = if path == Path::Fused {
                abi::tpfuse_gemm_all_reduce
            } else {
                abi::tpfuse_gemm_all_reduce_two_shot
            };
            unsafe {
                launcher(
                    T::DTYPE,
                    auto_config(m, n, k),
                    &peers,
                    &args,
                    ranks.blocks,
                    x.ptr().cast(),
                    w.ptr().cast(),
                    opt_ptr(&bias),
                    opt_ptr(residual),
                    opt_ptr(&gamma),
                    EPS,
                    out.ptr().cast(),
                    m,
                    n,
                    k,
                    stream,
                )
            }
        }
        Path::Unfused => {
            enqueue_gemm(
                &x,
                &w,
                &partial,
                (m, n, k),
                stream,
                &format!("gemm rank {rank}"),
            );
            unsafe {
                abi::tpfuse_all_reduce(
                    T::DTYPE,
                    abi::TPFUSE_ALGO_ONE_SHOT as i32,
                    &peers,
                    &args,
                    partial.ptr().cast(),
                    opt_ptr(&bias),
                    opt_ptr(residual),
                    opt_ptr(&gamma),
                    EPS,
                    out.ptr().cast(),
                    m,
                    n,
                    stream,
                )
            }
        }
    };
    let mut inputs = vec![x, w];
    inputs.extend(bias);
    inputs.extend(gamma);
    let buffers = Buffers {
        out,
        partial,
        _inputs: inputs,
    };
    (buffers, code)
}

/// Every rank's launch of `p` along `path`, then a synchronize; the buffers and every rank's
/// residual afterwards.
fn run<T: TestElement>(
    ranks: &Ranks,
    p: &Problem<T>,
    path: Path,
) -> (Vec<Buffers<T>>, Vec<Option<Vec<T>>>) {
    let residuals = residuals(ranks.world, p);
    let launches: Vec<Buffers<T>> = (0..ranks.world)
        .map(|r| enqueue(ranks, r, p, path, &residuals[r]))
        .collect();
    ranks.synchronize();
    for r in 0..ranks.world {
        assert_eq!(ranks.error_word(r), 0, "rank {r}: the launch failed");
    }
    (
        launches,
        residuals
            .iter()
            .map(|b| b.as_ref().map(DeviceBuffer::to_vec))
            .collect(),
    )
}

/// Fused against unfused, bitwise on every rank (out and residual), and against f64.
fn case<T: TestElement>(
    world: usize,
    blocks: i32,
    shape: (usize, usize, usize),
    epi: Epi,
    seed: u64,
) {
    let label = format!(
        "{} W={world} blocks={blocks} (m, n, k)={shape:?} {epi:?} seed={seed:#x}",
        T::NAME
    );
    let p = problem::<T>(world, shape, epi, seed);
    let ranks = Ranks::with_capacity(world, blocks, LONG_TIMEOUT_NS, CAPACITY);
    let (fused, fused_residuals) = run(&ranks, &p, Path::Fused);
    let (unfused, unfused_residuals) = run(&ranks, &p, Path::Unfused);
    let mut paths = vec![(Path::Fused, fused, fused_residuals)];
    if p.m % world == 0 {
        let (two_shot, two_shot_residuals) = run(&ranks, &p, Path::TwoShot);
        paths.push((Path::TwoShot, two_shot, two_shot_residuals));
    }
    for (path, outs, residuals) in &paths {
        for r in 0..world {
            let at = format!("{label} rank {r} {path:?}");
            assert_same_bits(
                &format!("{at}: out, fused vs unfused"),
                &outs[r].out.to_vec(),
                &unfused[r].out.to_vec(),
            );
            if let (Some(f), Some(u)) = (&residuals[r], &unfused_residuals[r]) {
                assert_same_bits(&format!("{at}: residual, fused vs unfused"), f, u);
            }
        }
    }
    let (_, fused, fused_residuals) = paths.swap_remove(0);
    // The unfused sequence against f64, from its own partials (the GEMM is checked elsewhere).
    let partials: Vec<Vec<T>> = unfused.iter().map(|b| b.partial.to_vec()).collect();
    let refs: Vec<&[T]> = partials.iter().map(Vec::as_slice).collect();
    let (h, out) = all_reduce_fused_f64(
        &refs,
        p.bias.as_deref(),
        p.residual.as_deref(),
        p.gamma.as_deref(),
        f64::from(EPS),
        p.n,
    );
    let tolerance = if epi.norm {
        T::NORM_TOLERANCE
    } else {
        T::TOLERANCE
    };
    assert_close(
        &format!("{label}: out vs f64"),
        &fused[0].out.to_vec(),
        &out,
        tolerance,
    );
    if let Some(res) = &fused_residuals[0] {
        assert_close(&format!("{label}: residual vs f64"), res, &h, T::TOLERANCE);
    }
}

/// (m, n, k).
type Shape = (usize, usize, usize);

/// (world, blocks, shape, epilogue): every m of the issue, tails of n past 16, 32, 64 and
/// 128 columns and of k past 16, 32 and 64, grids of 1 block per rank (a block with many
/// tiles) and more, every epilogue; the two-shot too where m is a multiple of W (slices of
/// 1, 4, 3, 32 and 65 rows, within a tile row and across them).
const CASES: [(usize, i32, Shape, Epi); 9] = [
    (2, 2, (1, 264, 136), ALL),
    (3, 2, (3, 136, 40), NONE),
    (4, 1, (16, 72, 72), BIAS),
    (8, 2, (17, 72, 40), RESIDUAL_NORM),
    (2, 3, (64, 136, 40), ALL),
    (4, 2, (130, 72, 24), BIAS_RESIDUAL),
    (2, 1, (130, 136, 40), RESIDUAL_NORM),
    (8, 1, (3, 264, 56), ALL),
    (8, 2, (24, 136, 40), ALL),
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
            // SAFETY: every buffer holds what the shapes need and is kept until the synchronize.
            let code = unsafe {
                if fused {
                    abi::tpfuse_gemm_reduce_scatter(
                        T::DTYPE,
                        auto_config(m, n, k),
                        &peers,
                        &args,
                        blocks,
                        x.ptr().cast(),
                        w.ptr().cast(),
                        out.ptr().cast(),
                        m,
                        n,
                        k,
                        stream,
                    )
                } else {
                    let what = format!("{label}: gemm rank {r}");
                    enqueue_gemm(&x, &w, &partial, shape, stream, &what);
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
/// slices), tails of n and k.
const REDUCE_SCATTER_CASES: [(usize, i32, Shape); 6] = [
    (2, 2, (2, 136, 40)),
    (3, 1, (9, 72, 72)),
    (4, 2, (64, 72, 40)),
    (8, 2, (24, 264, 24)),
    (2, 3, (130, 136, 40)),
    (4, 1, (68, 72, 56)),
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

/// All-gather + GEMM on every rank against tpfuse_all_gather then tpfuse_gemm: every rank's
/// Rank `r`'s tpfuse_all_gather_gemm of its rows `x` [m / W, k] and weight `w` [n, k] (+ bias)
/// into `out` [m, n]; the code it returned.
#[allow(clippy::too_many_arguments)]
fn enqueue_all_gather_gemm<T: TestElement>(
    ranks: &Ranks,
    r: usize,
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    bias: &Option<DeviceBuffer<T>>,
    out: &DeviceBuffer<T>,
    (m, n, k): Shape,
    blocks: i32,
) -> i32 {
    let (peers, args) = (ranks.peers(), ranks.args(r));
    // SAFETY: the caller's buffers hold what the shapes need and are kept until the
    // synchronize.
    unsafe {
        abi::tpfuse_all_gather_gemm(
            T::DTYPE,
            auto_config(m, n, k),
            &peers,
            &args,
            blocks,
            x.ptr().cast(),
            w.ptr().cast(),
            opt_ptr(bias),
            out.ptr().cast(),
            m,
            n,
            k,
            ranks.stream(r),
        )
    }
}

/// out [m, n] from the rows of every rank's x [m / W, k] and its own weight, bitwise, and
/// against f64.
fn all_gather_gemm_case<T: TestElement>(
    world: usize,
    blocks: i32,
    shape: Shape,
    bias: bool,
    seed: u64,
) {
    let (m, n, k) = shape;
    let label = format!("all-gather + GEMM {} W={world} blocks={blocks} (m, n, k)={shape:?} bias={bias} seed={seed:#x}", T::NAME);
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
                    enqueue_all_gather_gemm(&ranks, r, &x, &w, &bias, out, shape, blocks)
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

/// (world, blocks, shape, bias): slices of 1, 3, 16, 17, 65 rows (tiles of 16 and 64 rows that
/// span several ranks' rows), tails of n and k.
const ALL_GATHER_GEMM_CASES: [(usize, i32, Shape, bool); 6] = [
    (2, 2, (2, 136, 40), true),
    (3, 1, (9, 72, 72), false),
    (4, 2, (64, 72, 40), true),
    (8, 2, (24, 264, 24), true),
    (2, 3, (130, 136, 40), false),
    (4, 1, (68, 72, 56), true),
];

#[test]
fn all_gather_gemm_equals_all_gather_then_gemm() {
    let _s = session(
        "emu_gemm_all_reduce",
        "all_gather_gemm_equals_all_gather_then_gemm",
    );
    let seed = base_seed(0xf05e_0008);
    for (i, &(world, blocks, shape, bias)) in ALL_GATHER_GEMM_CASES.iter().enumerate() {
        all_gather_gemm_case::<bf16>(world, blocks, shape, bias, mix_seed(seed, &[i as u64, 1]));
        all_gather_gemm_case::<f16>(world, blocks, shape, bias, mix_seed(seed, &[i as u64, 2]));
    }
}

/// Launches in a row on every stream, all in flight before one synchronize, each with fresh
/// inputs and the residual carried from one to the next (a decode loop): every launch's
/// epoch and exchange area must be its own.
#[test]
fn launches_in_a_row_each_get_their_own_inputs() {
    let _s = session(
        "emu_gemm_all_reduce",
        "launches_in_a_row_each_get_their_own_inputs",
    );
    let (world, steps) = (3, 12);
    let shape = (2, 72, 40);
    let seed = base_seed(0xf05e_0003);
    let ranks = Ranks::with_capacity(world, 2, LONG_TIMEOUT_NS, CAPACITY);
    let problems: Vec<Problem<bf16>> = (0..steps)
        .map(|step| problem::<bf16>(world, shape, ALL, mix_seed(seed, &[step])))
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

/// A one-shot all-reduce with RMSNorm, then all-gather + GEMM, in a row on every rank: a rank
/// that passed the all-reduce's closing barrier pushes its rows into the peers' result halves
/// while they may still normalise, so the all-reduce must keep nothing there (its partials
/// once lived at the start of the result half, where rank 0's rows land at even epochs).
/// Every launch's bits against the same launch run alone.
#[test]
fn an_all_gather_gemm_right_after_a_one_shot_rmsnorm_overlaps_nothing() {
    let _s = session(
        "emu_gemm_all_reduce",
        "an_all_gather_gemm_right_after_a_one_shot_rmsnorm_overlaps_nothing",
    );
    let (world, steps, blocks) = (2, 6, 2);
    let seed = base_seed(0xf05e_0009);
    let ranks = Ranks::with_capacity(world, blocks, LONG_TIMEOUT_NS, CAPACITY);
    // 16 rows of 4096: 16 segments, one partial each, 8 per block.
    let norm = Epi { norm: true, ..NONE };
    let p = problem::<bf16>(world, (16, 4096, 16), norm, mix_seed(seed, &[1]));
    let gather: Shape = (4, 72, 64);
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
        let code = enqueue_all_gather_gemm(&ranks, r, &xs[r], &ws[r], &None, &out, gather, blocks);
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

/// Every rank's launch counter set to `start` and every tile flag set to a launch long past
/// (`stale` launches before the next one), in the pads' layout (tpfuse.h).
fn age_pads(ranks: &mut Ranks, start: u64, stale: u64) {
    let epoch_word = abi::TPFUSE_SIGNAL_FUSED_EPOCH_OFFSET as usize / 4;
    let flags_word = abi::TPFUSE_SIGNAL_TILE_FLAGS_OFFSET as usize / 4;
    let flags = (abi::TPFUSE_MAX_FUSED_TILES * abi::TPFUSE_MAX_RANKS) as usize;
    let old_epoch = (start + 1).wrapping_sub(stale) & ((1 << 40) - 1);
    let flag = old_epoch << 24 | 0x00ab_cdef;
    for pad in ranks.signals.iter_mut() {
        let mut words = pad.to_vec();
        words[epoch_word] = start as u32;
        words[epoch_word + 1] = (start >> 32) as u32;
        for f in 0..flags {
            words[flags_word + 2 * f] = flag as u32;
            words[flags_word + 2 * f + 1] = (flag >> 32) as u32;
        }
        pad.copy_from(&words);
    }
}

/// Launch counters past 32 bits, and tile flags left by a launch 2^39 + 7 launches ago (a tile
/// index unused that long): such a flag is not ready (a window of "at or after this launch"
/// would take it for this launch's and read the peer's tile before it is there).
#[test]
fn a_flag_of_a_long_past_launch_is_not_ready() {
    let _s = session(
        "emu_gemm_all_reduce",
        "a_flag_of_a_long_past_launch_is_not_ready",
    );
    let world = 3;
    let mut ranks = Ranks::with_capacity(world, 2, LONG_TIMEOUT_NS, CAPACITY);
    age_pads(&mut ranks, (1 << 33) + 5, (1 << 39) + 7);
    let seed = base_seed(0xf05e_0006);
    for step in 0..3 {
        let p = problem::<bf16>(world, (16, 136, 40), ALL, mix_seed(seed, &[step]));
        let (fused, fused_res) = run(&ranks, &p, Path::Fused);
        let (unfused, unfused_res) = run(&ranks, &p, Path::Unfused);
        for r in 0..world {
            let at = format!("step {step} rank {r}");
            assert_same_bits(
                &format!("{at}: out"),
                &fused[r].out.to_vec(),
                &unfused[r].out.to_vec(),
            );
            assert_same_bits(
                &format!("{at}: residual"),
                fused_res[r].as_ref().expect("residual"),
                unfused_res[r].as_ref().expect("residual"),
            );
        }
    }
}

/// Ranks `0..launching` each launch the fused `p` (a residual and RMSNorm) along `path`, then
/// synchronize: each must report `word` (its error word and the host's copy) and mark `out`
/// and the residual failed, not before the deadline. Returns the residuals and the virtual
/// time the launches took.
fn fused_launches_fail(
    ranks: &Ranks,
    p: &Problem<bf16>,
    path: Path,
    launching: usize,
    word: u32,
) -> (Vec<Option<DeviceBuffer<bf16>>>, u64) {
    let res = residuals(ranks.world, p);
    let start = emulator::now_ns();
    let launches: Vec<Buffers<bf16>> = (0..launching)
        .map(|r| enqueue(ranks, r, p, path, &res[r]))
        .collect();
    for r in 0..launching {
        ranks.streams[r]
            .synchronize()
            .unwrap_or_else(|e| panic!("rank {r}: {e} (the emulator's deadlock report?)"));
    }
    let elapsed = emulator::now_ns() - start;
    let timeout = ranks.timeout_ns;
    assert!(
        elapsed >= timeout,
        "gave up after {elapsed} ns, before the {timeout} ns deadline"
    );
    for (r, b) in launches.iter().enumerate() {
        assert_eq!(ranks.error_word(r), word, "rank {r}: the error word");
        assert_eq!(
            ranks.host_error_word(r),
            word,
            "rank {r}: published to the host"
        );
        assert!(
            b.out.to_vec().iter().all(|x| x.is_failed_output()),
            "rank {r}: out marked failed"
        );
        let residual = res[r].as_ref().expect("residual").to_vec();
        assert!(
            residual.iter().all(|x| x.is_failed_output()),
            "rank {r}: residual marked failed"
        );
    }
    (res, elapsed)
}

/// Co-residency on a device of 2 SMs, 2 virtual ranks. Block b of a rank waits for block b of
/// the other ranks, and the two-shot's blocks for their own rank's slice, so every fused launch
/// is cooperative: a rank's blocks are all resident at once, or the launch is refused before
/// anything runs. At the grid bound (`TpGroup::fused_blocks`: the SMs divided among the ranks,
/// one block a rank here) every path gives the unfused bits. A grid past what the device holds
/// at once (32 blocks a rank; the SM holds 2 or 3 such blocks, by registers and shared memory)
/// is refused with cudaErrorCooperativeLaunchTooLarge on every rank: out keeps its poison and
/// no error word is set (before issue 21 the blocks that fit started, waited for blocks that
/// could not, and every rank timed out).
#[test]
fn on_a_small_device_the_grid_bound_completes_and_a_grid_past_it_is_refused() {
    let _s = session_with(
        "emu_gemm_all_reduce",
        "on_a_small_device_the_grid_bound_completes_and_a_grid_past_it_is_refused",
        2,
        60_000_000_000,
    );
    let seed = base_seed(0xf05e_000a);
    case::<bf16>(2, 1, (16, 264, 40), ALL, mix_seed(seed, &[1]));

    let ranks = Ranks::with_capacity(2, 32, 2_000_000, CAPACITY);
    // At least 32 tiles in every configuration (4096 columns: 32 tiles of 128).
    let p = problem::<bf16>(2, (16, 4096, 16), ALL, mix_seed(seed, &[2]));
    let res = residuals(2, &p);
    for path in [Path::Fused, Path::TwoShot] {
        let launches: Vec<(Buffers<bf16>, i32)> = (0..2)
            .map(|r| try_enqueue(&ranks, r, &p, path, &res[r]))
            .collect();
        ranks.synchronize();
        for (r, (b, code)) in launches.iter().enumerate() {
            assert_eq!(
                *code, COOPERATIVE_LAUNCH_TOO_LARGE,
                "{path:?} rank {r}: the launch's code"
            );
            assert!(
                b.out
                    .to_vec()
                    .iter()
                    .all(|x| x.is_nan() && !x.is_failed_output()),
                "{path:?} rank {r}: out keeps its poison (nothing ran)"
            );
            assert_eq!(ranks.error_word(r), 0, "{path:?} rank {r}: the error word");
        }
    }
}

/// Another stream's kernel (an engine's, NCCL's, an MPS neighbour's) holds 15 of the device's
/// 16 SMs for ten times the kernels' deadline while both ranks launch grids of 8 blocks, which
/// the free SM cannot hold. The launches whose blocks wait for one another are cooperative:
/// each starts once all its blocks fit, after that kernel, and gives the bits of the same
/// launch on an idle device. (As plain launches, the blocks that fit started at once and
/// waited for blocks that could not start, past the deadline: a timeout and a poisoned group;
/// issue 21, defect 2.)
#[test]
fn launches_wait_for_the_sms_another_kernel_holds() {
    let _s = session_with(
        "emu_gemm_all_reduce",
        "launches_wait_for_the_sms_another_kernel_holds",
        16,
        60_000_000_000,
    );
    let seed = base_seed(0xf05e_000b);
    let timeout = 2_000_000;
    let held_ns = 10 * timeout;
    // 16 tiles of the 16x64 configuration; the one-shot all-reduce of the unfused path takes
    // 4 blocks (one SM each).
    let shape = (16, 1024, 40);
    let p = problem::<bf16>(2, shape, ALL, mix_seed(seed, &[1]));
    for path in [Path::Fused, Path::TwoShot, Path::Unfused] {
        let idle = Ranks::with_capacity(2, 8, timeout, CAPACITY);
        let (expected, expected_res) = run(&idle, &p, path);
        let ranks = Ranks::with_capacity(2, 8, timeout, CAPACITY);
        let other = emulator::Stream::new();
        other.occupy_sms(15, held_ns).expect("the other kernel");
        let start = emulator::now_ns();
        let (got, got_res) = run(&ranks, &p, path);
        other.synchronize().expect("the other kernel");
        assert!(
            emulator::now_ns() - start >= held_ns,
            "{path:?}: ran before the other kernel ended"
        );
        for r in 0..2 {
            assert_same_bits(
                &format!("{path:?} rank {r}: out, held vs idle"),
                &got[r].out.to_vec(),
                &expected[r].out.to_vec(),
            );
            if let (Some(g), Some(e)) = (&got_res[r], &expected_res[r]) {
                assert_same_bits(&format!("{path:?} rank {r}: residual, held vs idle"), g, e);
            }
        }
    }
    // All-gather + GEMM: its blocks wait for their own rank's parts.
    let (m, n, k) = shape;
    let xs: Vec<DeviceBuffer<bf16>> = (0..2)
        .map(|r| DeviceBuffer::from_slice(&p.x[r][r * m / 2 * k..(r + 1) * m / 2 * k]))
        .collect();
    let ws: Vec<DeviceBuffer<bf16>> = (0..2).map(|r| DeviceBuffer::from_slice(&p.w[r])).collect();
    let gather = |ranks: &Ranks| -> Vec<Vec<bf16>> {
        let outs: Vec<DeviceBuffer<bf16>> = (0..2)
            .map(|r| {
                let out = poisoned::<bf16>(m * n);
                let code = enqueue_all_gather_gemm(ranks, r, &xs[r], &ws[r], &None, &out, shape, 8);
                launched(&format!("all_gather_gemm rank {r}"), code);
                out
            })
            .collect();
        ranks.synchronize();
        (0..2).for_each(|r| assert_eq!(ranks.error_word(r), 0, "all-gather + GEMM rank {r}"));
        outs.iter().map(DeviceBuffer::to_vec).collect()
    };
    let expected = gather(&Ranks::with_capacity(2, 8, timeout, CAPACITY));
    let ranks = Ranks::with_capacity(2, 8, timeout, CAPACITY);
    let other = emulator::Stream::new();
    other.occupy_sms(15, held_ns).expect("the other kernel");
    let start = emulator::now_ns();
    let got = gather(&ranks);
    assert!(
        emulator::now_ns() - start >= held_ns,
        "all-gather + GEMM ran early"
    );
    for r in 0..2 {
        assert_same_bits(
            &format!("all-gather + GEMM rank {r}: out, held vs idle"),
            &got[r],
            &expected[r],
        );
    }
}

/// A rank that never launches: every survivor times out within its deadline, names the
/// missing rank, publishes the error word and marks out and residual failed.
#[test]
fn a_missing_rank_times_out_and_every_output_is_marked() {
    let _s = session(
        "emu_gemm_all_reduce",
        "a_missing_rank_times_out_and_every_output_is_marked",
    );
    let timeout = 2_000_000;
    let world = 3;
    let ranks = Ranks::with_capacity(world, 2, timeout, CAPACITY);
    ranks.streams[2].set_fault(Fault {
        stop: true,
        ..Fault::default()
    });
    let p = problem::<bf16>(world, (5, 136, 40), ALL, base_seed(0xf05e_0004));
    let word = abi::TPFUSE_ERROR_PEER_TIMEOUT | 2;
    let (res, elapsed) = fused_launches_fail(&ranks, &p, Path::Fused, 2, word);
    assert!(
        elapsed <= timeout * 3 / 2,
        "gave up after {elapsed} ns, deadline {timeout} ns"
    );

    // The group is poisoned now: a launch gives up at once and marks its outputs.
    let start = emulator::now_ns();
    let again = enqueue(&ranks, 0, &p, Path::Fused, &res[0]);
    ranks.streams[0].synchronize().expect("rank 0");
    assert!(
        emulator::now_ns() - start < timeout / 10,
        "a poisoned group waited"
    );
    assert!(
        again.out.to_vec().iter().all(|x| x.is_failed_output()),
        "out marked on a poisoned group"
    );
}

/// The two-shot with a rank that never launches names it too. Three tile rows, one per rank's
/// slice, and three blocks per rank: block b computes tile row b only (tile_of_block), so on a
/// survivor the blocks of the other rows consume nothing and wait only for the slice flags,
/// which stall because the survivor's own slice needs the missing rank's tiles. Those waits
/// must not name the survivor (a grid timeout) or a live peer: the tile waits name rank 2.
/// (On a GPU the slice waits could time out first, so they wait twice the deadline; the
/// emulator's schedules, forward, reverse and random, always let the tile wait report
/// first, even with the plain deadline: this checks the outcome, not that race.)
#[test]
fn a_missing_rank_is_named_by_the_two_shot_too() {
    let _s = session(
        "emu_gemm_all_reduce",
        "a_missing_rank_is_named_by_the_two_shot_too",
    );
    let (world, n, k) = (3, 136, 40);
    let m = [16, 64, 128]
        .into_iter()
        .map(|bm| 3 * bm)
        .find(|&m| {
            // auto_config's choice, as a GemmConfig.
            let sms = emulator::config().sms as usize;
            let config = select_config(GemmShape { m, n, k }, (9, 0), sms);
            config.is_some_and(|c| 3 * c.info().block_m == m)
        })
        .expect("a shape of three tile rows");
    let timeout = 2_000_000;
    let ranks = Ranks::with_capacity(world, 3, timeout, CAPACITY);
    ranks.streams[2].set_fault(Fault {
        stop: true,
        ..Fault::default()
    });
    let p = problem::<bf16>(world, (m, n, k), ALL, base_seed(0xf05e_000b));
    let word = abi::TPFUSE_ERROR_PEER_TIMEOUT | 2;
    fused_launches_fail(&ranks, &p, Path::TwoShot, 2, word);
}

/// GEMM + reduce-scatter and all-gather + GEMM with a rank that never launches: every
/// survivor times out naming it, and marks its whole output failed (random schedules included:
/// every warp takes the same branch when the wait fails).
#[test]
fn the_sequence_parallel_kernels_time_out_on_a_missing_rank() {
    let _s = session(
        "emu_gemm_all_reduce",
        "the_sequence_parallel_kernels_time_out_on_a_missing_rank",
    );
    let (world, timeout) = (3, 2_000_000);
    let (m, n, k) = (12, 136, 40);
    let rows = m / world;
    for gather in [false, true] {
        let ranks = Ranks::with_capacity(world, 2, timeout, CAPACITY);
        ranks.streams[2].set_fault(Fault {
            stop: true,
            ..Fault::default()
        });
        let p = problem::<bf16>(world, (m, n, k), NONE, base_seed(0xf05e_0009));
        let out_len = if gather { m * n } else { rows * n };
        let mut kept = Vec::new();
        for r in 0..2 {
            let x_len = if gather { rows * k } else { m * k };
            let x = DeviceBuffer::from_slice(&p.x[r][..x_len]);
            let w = DeviceBuffer::from_slice(&p.w[r]);
            let out = poisoned::<bf16>(out_len);
            let (peers, args, stream) = (ranks.peers(), ranks.args(r), ranks.stream(r));
            let config = auto_config(m, n, k);
            // SAFETY: the buffers hold what the shapes need and are kept until the synchronize.
            let code = unsafe {
                if gather {
                    abi::tpfuse_all_gather_gemm(
                        bf16::DTYPE,
                        config,
                        &peers,
                        &args,
                        2,
                        x.ptr().cast(),
                        w.ptr().cast(),
                        std::ptr::null(),
                        out.ptr().cast(),
                        m,
                        n,
                        k,
                        stream,
                    )
                } else {
                    abi::tpfuse_gemm_reduce_scatter(
                        bf16::DTYPE,
                        config,
                        &peers,
                        &args,
                        2,
                        x.ptr().cast(),
                        w.ptr().cast(),
                        out.ptr().cast(),
                        m,
                        n,
                        k,
                        stream,
                    )
                }
            };
            launched(&format!("gather={gather} rank {r}"), code);
            kept.push((x, w, out));
        }
        for (r, (_, _, out)) in kept.iter().enumerate() {
            ranks.streams[r]
                .synchronize()
                .unwrap_or_else(|e| panic!("gather={gather} rank {r}: {e}"));
            let word = abi::TPFUSE_ERROR_PEER_TIMEOUT | 2;
            assert_eq!(
                ranks.error_word(r),
                word,
                "gather={gather} rank {r}: names rank 2"
            );
            assert_eq!(
                ranks.host_error_word(r),
                word,
                "gather={gather} rank {r}: published"
            );
            assert!(
                out.to_vec().iter().all(|x| x.is_failed_output()),
                "gather={gather} rank {r}: out marked"
            );
        }
    }
}

/// Ranks that launch different shapes (here m = 16 and m = 17: other tiles, another
/// configuration) get TPFUSE_ERROR_PEER_MISMATCH, and their outputs are marked failed.
#[test]
fn ranks_that_launch_different_shapes_get_a_mismatch() {
    let _s = session(
        "emu_gemm_all_reduce",
        "ranks_that_launch_different_shapes_get_a_mismatch",
    );
    // Another m; the same shape one-shot on rank 0 and two-shot on rank 1.
    for (m1, path1) in [(17, Path::Fused), (16, Path::TwoShot)] {
        let ranks = Ranks::with_capacity(2, 2, 1_000_000_000, CAPACITY);
        let p0 = problem::<bf16>(2, (16, 72, 40), BIAS_RESIDUAL, base_seed(0xf05e_0005));
        let p1 = problem::<bf16>(2, (m1, 72, 40), BIAS_RESIDUAL, base_seed(0xf05e_0005));
        let (r0, r1) = (residuals(2, &p0), residuals(2, &p1));
        let b0 = enqueue(&ranks, 0, &p0, Path::Fused, &r0[0]);
        let b1 = enqueue(&ranks, 1, &p1, path1, &r1[1]);
        let start = emulator::now_ns();
        ranks.synchronize();
        assert!(
            emulator::now_ns() - start < ranks.timeout_ns / 100,
            "rank 1 with m {m1} {path1:?}: the mismatch was noticed at once"
        );
        for (r, b) in [b0, b1].iter().enumerate() {
            let word = ranks.error_word(r);
            assert_eq!(
                word & 0xff00,
                abi::TPFUSE_ERROR_PEER_MISMATCH,
                "rank 1 with m {m1} {path1:?}, rank {r}: error word {word:#x}"
            );
            assert!(
                b.out.to_vec().iter().all(|x| x.is_failed_output()),
                "rank {r}: out marked failed"
            );
        }
    }
}
