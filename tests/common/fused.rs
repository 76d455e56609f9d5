//! The fused GEMM kernels' tests on the CPU emulator (tests/emu_gemm_all_reduce.rs, the
//! bitwise contract; tests/emu_fused_failures.rs, failures and co-residency): one case's host
//! data, every rank's launch of it through the C ABI on virtual ranks ([`Ranks`]), and the
//! unfused sequence it must equal.

use super::assert_same_bits;
use super::emu::{launched, Ranks};
use super::gpu::{assert_close, mix_seed, random_vec, TestElement};
use std::ffi::c_void;
use tpfuse::emulator::{self, abi, DeviceBuffer};
use tpfuse::reference::all_reduce_fused_f64;

pub const EPS: f32 = 1e-5;
/// cudaErrorCooperativeLaunchTooLarge.
pub const COOPERATIVE_LAUNCH_TOO_LARGE: i32 = 720;
pub const LONG_TIMEOUT_NS: u64 = 60_000_000_000;
/// Staging per rank: the fused kernel exchanges m·n elements in half of the result area.
pub const CAPACITY: usize = 256 * 1024;

/// Which parts of the epilogue a case uses.
#[derive(Clone, Copy, Debug)]
pub struct Epi {
    pub bias: bool,
    pub residual: bool,
    pub norm: bool,
}

pub const NONE: Epi = Epi {
    bias: false,
    residual: false,
    norm: false,
};
pub const BIAS: Epi = Epi { bias: true, ..NONE };
pub const BIAS_RESIDUAL: Epi = Epi {
    residual: true,
    ..BIAS
};
pub const RESIDUAL_NORM: Epi = Epi {
    residual: true,
    norm: true,
    ..NONE
};
pub const ALL: Epi = Epi {
    norm: true,
    ..BIAS_RESIDUAL
};

/// One case's host data: per rank x_r [m, k] and w_r [n, k]; shared bias, residual, gamma.
pub struct Problem<T> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub x: Vec<Vec<T>>,
    pub w: Vec<Vec<T>>,
    pub bias: Option<Vec<T>>,
    pub residual: Option<Vec<T>>,
    pub gamma: Option<Vec<T>>,
    /// The fused launches' tile configuration: None for `auto_config`'s (what the layers run).
    pub config: Option<i32>,
}

pub fn problem<T: TestElement>(
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
        config: None,
    }
}

/// One rank's device buffers of one launch, kept until it is checked.
pub struct Buffers<T: Copy> {
    pub out: DeviceBuffer<T>,
    pub partial: DeviceBuffer<T>,
    _inputs: Vec<DeviceBuffer<T>>,
}

/// Every rank's residual, holding p.residual, when the case has one.
pub fn residuals<T: TestElement>(world: usize, p: &Problem<T>) -> Vec<Option<DeviceBuffer<T>>> {
    (0..world)
        .map(|_| p.residual.as_deref().map(DeviceBuffer::from_slice))
        .collect()
}

pub fn poisoned<T: TestElement>(len: usize) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(&vec![T::from_f32(f32::NAN); len])
}

pub fn opt_ptr<T: Copy>(b: &Option<DeviceBuffer<T>>) -> *mut c_void {
    b.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr().cast())
}

/// How one rank computes the case.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Path {
    /// tpfuse_gemm_all_reduce.
    Fused,
    /// tpfuse_gemm_all_reduce_two_shot (m a multiple of W).
    TwoShot,
    /// tpfuse_gemm into the workspace, then the one-shot tpfuse_all_reduce.
    Unfused,
}

/// The configuration tpfuse_gemm(AUTO) runs for the shape on the emulated device (9.0, its
/// SM count): what the Rust layer passes.
pub fn auto_config(m: usize, n: usize, k: usize) -> i32 {
    let sms = emulator::config().sms as i32;
    // SAFETY: a pure function of its arguments.
    unsafe { abi::tpfuse_gemm_select(m, n, k, 9, 0, sms) }
}

/// tpfuse_gemm of `x` [m, k] and `w` [n, k] into `c` [m, n] on `stream` (no bias, no residual).
pub fn enqueue_gemm<T: TestElement>(
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
pub fn enqueue<T: TestElement>(
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
pub fn try_enqueue<T: TestElement>(
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
                    p.config.unwrap_or_else(|| auto_config(m, n, k)),
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
pub fn run<T: TestElement>(
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
pub fn case<T: TestElement>(
    world: usize,
    blocks: i32,
    shape: (usize, usize, usize),
    epi: Epi,
    seed: u64,
) {
    case_in::<T>(None, world, blocks, shape, epi, seed);
}

/// [`case`] with the fused launches in tile configuration `config` (None: `auto_config`'s).
/// Any configuration gives the unfused GEMM's bits: a tile's elements each add all of k in
/// one order, whatever the tile (tpfuse_gemm's contract).
pub fn case_in<T: TestElement>(
    config: Option<i32>,
    world: usize,
    blocks: i32,
    shape: (usize, usize, usize),
    epi: Epi,
    seed: u64,
) {
    let label = format!(
        "{} W={world} blocks={blocks} (m, n, k)={shape:?} {epi:?} config={config:?} seed={seed:#x}",
        T::NAME
    );
    let mut p = problem::<T>(world, shape, epi, seed);
    p.config = config;
    let mut ranks = Ranks::with_capacity(world, blocks, LONG_TIMEOUT_NS, CAPACITY);
    // The one-shot by packets (these shapes fit the packet area), then by flags.
    let (fused, fused_residuals) = run(&ranks, &p, Path::Fused);
    let packet_bytes = std::mem::replace(&mut ranks.packet_bytes, 0);
    let (by_flags, by_flags_residuals) = run(&ranks, &p, Path::Fused);
    ranks.packet_bytes = packet_bytes;
    let (unfused, unfused_residuals) = run(&ranks, &p, Path::Unfused);
    let mut paths = vec![
        ("one-shot, packets", fused, fused_residuals),
        ("one-shot, flags", by_flags, by_flags_residuals),
    ];
    if p.m % world == 0 {
        let (two_shot, two_shot_residuals) = run(&ranks, &p, Path::TwoShot);
        paths.push(("two-shot", two_shot, two_shot_residuals));
    }
    for (path, outs, residuals) in &paths {
        for r in 0..world {
            let at = format!("{label} rank {r} {path}");
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
pub type Shape = (usize, usize, usize);

/// Rank `r`'s tpfuse_gemm_reduce_scatter of `x` [m, k] and `w` [n, k] in tile configuration
/// `config` into `out` (its m / W rows of n); the code it returned.
pub fn enqueue_gemm_reduce_scatter<T: TestElement>(
    ranks: &Ranks,
    r: usize,
    (x, w, out): (&DeviceBuffer<T>, &DeviceBuffer<T>, &DeviceBuffer<T>),
    (m, n, k): Shape,
    config: i32,
    blocks: i32,
) -> i32 {
    let (peers, args) = (ranks.peers(), ranks.args(r));
    // SAFETY: the caller's buffers hold what the shapes need and are kept until the
    // synchronize.
    unsafe {
        abi::tpfuse_gemm_reduce_scatter(
            T::DTYPE,
            config,
            &peers,
            &args,
            blocks,
            x.ptr().cast(),
            w.ptr().cast(),
            out.ptr().cast(),
            m,
            n,
            k,
            ranks.stream(r),
        )
    }
}

/// Rank `r`'s tpfuse_all_gather_gemm of its rows `x` [m / W, k] and weight `w` [n, k] (+ bias)
/// into `out` [m, n] in configuration `config` (a `TPFUSE_GEMM_CONFIG_*`, e.g. `auto_config`'s);
/// the code it returned.
#[allow(clippy::too_many_arguments)]
pub fn enqueue_all_gather_gemm<T: TestElement>(
    config: i32,
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
            config,
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
