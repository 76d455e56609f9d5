//! `tpfuse selftest`'s kernel checks: every kernel family on GPU 0, the collectives on
//! virtual ranks W = 2, 4, 8 of it (on the CPU emulator with `--features emulator`), against
//! the crate's references. Per op: the cases run, how many agree bit for bit with the exact
//! emulation of the kernels' arithmetic (and across ranks, and across GEMM configurations),
//! and the largest relative Frobenius error against the f64 reference. bf16 throughout (the
//! inference type; the test suites cover f16 and f32). Inputs are fresh from `seed`.

use crate::traffic::Traffic;
use half::bf16;
use std::sync::Arc;
use tpfuse::ops::gemm::{gemm_with_config, GemmConfig, GemmShape};
use tpfuse::ops::linear::Fusion;
use tpfuse::ops::{self, Algorithm, Epilogue, RmsNorm, RowParallelLinear};
use tpfuse::reference::{
    all_reduce_epilogue_exact, all_reduce_fused_f64, gemm_f64, reduce_ranks_exact,
    reduce_ranks_f64, relative_error,
};
use tpfuse::shard::{HostWeight, RowParallelSpec};
use tpfuse::{Error, GroupOptions, Result, TpGroup};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

type T = bf16;
const WORLDS: [usize; 3] = [2, 4, 8];
const EPS: f32 = 1e-5;

/// What one op's cases found.
pub struct OpReport {
    pub name: &'static str,
    pub cases: usize,
    pub bitwise: usize,
    pub max_error: f64,
    pub traffic: Traffic,
}

impl OpReport {
    fn new(name: &'static str) -> Self {
        OpReport {
            name,
            cases: 0,
            bitwise: 0,
            max_error: 0.0,
            traffic: Traffic::default(),
        }
    }

    fn case(&mut self, bitwise: bool, error: f64) {
        self.cases += 1;
        self.bitwise += usize::from(bitwise);
        self.max_error = self.max_error.max(error);
    }

    /// Every case bitwise and within `tolerance` of f64.
    pub fn passed(&self, tolerance: f64) -> bool {
        self.cases > 0 && self.bitwise == self.cases && self.max_error < tolerance
    }
}

/// Relative Frobenius error of a bf16 result (DESIGN.md's bound).
pub const TOLERANCE: f64 = 1e-2;

fn cuda(context: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |source| Error::Cuda { context, source }
}

/// `n` values uniform in (lo, hi), from a splitmix64 stream of `seed`.
fn random(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<T> {
    (0..n as u64)
        .map(|i| {
            let mut z = seed.wrapping_add((i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let u = (z >> 11) as f64 / (1u64 << 53) as f64;
            T::from_f64(lo + (hi - lo) * u)
        })
        .collect()
}

fn same_bits(a: &[T], b: &[T]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn up(stream: &Arc<CudaStream>, host: &[T]) -> Result<CudaSlice<T>> {
    stream.clone_htod(host).map_err(cuda("upload"))
}

fn down(stream: &Arc<CudaStream>, dev: &CudaSlice<T>) -> Result<Vec<T>> {
    stream.clone_dtoh(dev).map_err(cuda("download"))
}

fn nan(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>> {
    up(stream, &vec![T::NAN; n])
}

/// One op on every rank (enqueued from this thread), then `check()` on every rank.
fn round(groups: &[TpGroup], mut op: impl FnMut(usize) -> Result<()>) -> Result<()> {
    for r in 0..groups.len() {
        op(r)?;
    }
    groups.iter().try_for_each(TpGroup::check)
}

/// Every rank's download of `bufs`.
fn download_all(groups: &[TpGroup], bufs: &[CudaSlice<T>]) -> Result<Vec<Vec<T>>> {
    groups
        .iter()
        .zip(bufs)
        .map(|(g, b)| down(g.stream(), b))
        .collect()
}

fn all_equal(outs: &[Vec<T>]) -> bool {
    outs.iter().all(|o| same_bits(o, &outs[0]))
}

/// Runs every family; `counting` records the emulator's counters per op.
pub fn run(seed: u64, counting: bool) -> Result<Vec<OpReport>> {
    let ctx = tpfuse::device::open(0)?;
    let mut reports = vec![reduce_ranks(&ctx, seed, counting)?];
    reports.extend(collectives(&ctx, seed, counting)?);
    reports.push(gemm(&ctx, seed, counting)?);
    reports.push(row_parallel(&ctx, seed, counting)?);
    Ok(reports)
}

fn reduce_ranks(ctx: &Arc<CudaContext>, seed: u64, counting: bool) -> Result<OpReport> {
    let mut rep = OpReport::new("reduce_ranks");
    let stream = ctx.default_stream();
    for world in WORLDS {
        for n in [1usize, 7, 8, 1000, 65_537] {
            let hosts: Vec<Vec<T>> = (0..world)
                .map(|r| random(seed ^ (r as u64) << 8 ^ n as u64, n, -4.0, 4.0))
                .collect();
            let dev = hosts
                .iter()
                .map(|h| up(&stream, h))
                .collect::<Result<Vec<_>>>()?;
            let mut out = nan(&stream, n)?;
            let min = ((world + 1) * n * 2) as u64;
            rep.traffic.measure(counting, min, || {
                let refs: Vec<&CudaSlice<T>> = dev.iter().collect();
                ops::reduce_ranks(&stream, &refs, &mut out)?;
                stream.synchronize().map_err(cuda("reduce_ranks"))
            })?;
            let got = down(&stream, &out)?;
            let slices: Vec<&[T]> = hosts.iter().map(Vec::as_slice).collect();
            rep.case(
                same_bits(&got, &reduce_ranks_exact(&slices)),
                relative_error(&got, &reduce_ranks_f64(&slices)),
            );
        }
    }
    Ok(rep)
}

/// One-shot, two-shot, the fused epilogue, all-gather and reduce-scatter on W virtual ranks.
fn collectives(ctx: &Arc<CudaContext>, seed: u64, counting: bool) -> Result<Vec<OpReport>> {
    let mut one = OpReport::new("all_reduce one-shot");
    let mut two = OpReport::new("all_reduce two-shot");
    let mut fused = OpReport::new("all_reduce + bias + residual + RMSNorm");
    let mut gather = OpReport::new("all_gather");
    let mut scatter = OpReport::new("reduce_scatter");
    for world in WORLDS {
        let groups = TpGroup::virtual_ranks(ctx, world, GroupOptions::default())?;
        for n in [1usize, 9, 4096 * 3 + 5, 1 << 15] {
            let s = seed ^ (world as u64) << 32 ^ n as u64;
            for (rep, algo) in [
                (&mut one, Algorithm::OneShot),
                (&mut two, Algorithm::TwoShot),
            ] {
                all_reduce_case(&groups, s, n, algo, counting, rep)?;
            }
            // Whole 16-byte vectors per rank, as the two collectives require.
            let vectors = n.div_ceil(8) * 8;
            gather_case(&groups, s, vectors, counting, &mut gather)?;
            scatter_case(&groups, s, vectors, counting, &mut scatter)?;
        }
        for rows in [1usize, 7] {
            for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
                let s = seed ^ (world as u64) << 32 ^ rows as u64 ^ algo as u64;
                fused_case(&groups, s, rows, 512, algo, counting, &mut fused)?;
            }
        }
    }
    Ok(vec![one, two, fused, gather, scatter])
}

fn rank_inputs(world: usize, seed: u64, n: usize) -> Vec<Vec<T>> {
    (0..world)
        .map(|r| random(seed.rotate_left(r as u32 * 7 + 1), n, -4.0, 4.0))
        .collect()
}

fn upload_all(groups: &[TpGroup], hosts: &[Vec<T>]) -> Result<Vec<CudaSlice<T>>> {
    groups
        .iter()
        .zip(hosts)
        .map(|(g, h)| up(g.stream(), h))
        .collect()
}

fn nan_all(groups: &[TpGroup], n: usize) -> Result<Vec<CudaSlice<T>>> {
    groups.iter().map(|g| nan(g.stream(), n)).collect()
}

/// One out-of-place collective on every rank: `hosts` uploaded, outputs of `out_len` NaNs,
/// `op` enqueued on each rank and counted against `min` bytes; every rank's output.
fn collective_round(
    groups: &[TpGroup],
    hosts: &[Vec<T>],
    out_len: usize,
    min: u64,
    counting: bool,
    traffic: &mut Traffic,
    op: impl Fn(&TpGroup, &CudaSlice<T>, &mut CudaSlice<T>) -> Result<()>,
) -> Result<Vec<Vec<T>>> {
    let ins = upload_all(groups, hosts)?;
    let mut outs = nan_all(groups, out_len)?;
    traffic.measure(counting, min, || {
        round(groups, |r| op(&groups[r], &ins[r], &mut outs[r]))
    })?;
    download_all(groups, &outs)
}

fn all_reduce_case(
    groups: &[TpGroup],
    seed: u64,
    n: usize,
    algo: Algorithm,
    counting: bool,
    rep: &mut OpReport,
) -> Result<()> {
    let world = groups.len();
    let hosts = rank_inputs(world, seed, n);
    // Per rank: its input read and its output written once.
    let min = (world * 2 * n * 2) as u64;
    let got = collective_round(
        groups,
        &hosts,
        n,
        min,
        counting,
        &mut rep.traffic,
        |g, i, o| ops::all_reduce(g, i, o, algo).map(|_| ()),
    )?;
    let slices: Vec<&[T]> = hosts.iter().map(Vec::as_slice).collect();
    rep.case(
        all_equal(&got) && same_bits(&got[0], &reduce_ranks_exact(&slices)),
        relative_error(&got[0], &reduce_ranks_f64(&slices)),
    );
    Ok(())
}

fn fused_case(
    groups: &[TpGroup],
    seed: u64,
    rows: usize,
    hidden: usize,
    algo: Algorithm,
    counting: bool,
    rep: &mut OpReport,
) -> Result<()> {
    let world = groups.len();
    let n = rows * hidden;
    let hosts = rank_inputs(world, seed, n);
    let bias = random(seed ^ 1, hidden, -0.5, 0.5);
    let residual = random(seed ^ 2, n, -1.0, 1.0);
    let gamma = random(seed ^ 3, hidden, 0.5, 1.5);
    let ins = upload_all(groups, &hosts)?;
    let copies = |h: &[T]| -> Result<Vec<CudaSlice<T>>> {
        groups.iter().map(|g| up(g.stream(), h)).collect()
    };
    let (biases, gammas, mut residuals) = (copies(&bias)?, copies(&gamma)?, copies(&residual)?);
    let mut outs = nan_all(groups, n)?;
    // Per rank: input, residual read and written, output; bias and gamma once.
    let min = (world * (4 * n + 2 * hidden) * 2) as u64;
    rep.traffic.measure(counting, min, || {
        round(groups, |r| {
            let epilogue = Epilogue {
                bias: Some(&biases[r] as &dyn DevicePtr<T>),
                residual: Some(&mut residuals[r]),
                norm: Some(RmsNorm {
                    gamma: &gammas[r],
                    eps: EPS,
                }),
            };
            ops::all_reduce_fused(&groups[r], &ins[r], epilogue, &mut outs[r], algo).map(|_| ())
        })
    })?;
    let got = download_all(groups, &outs)?;
    let h = download_all(groups, &residuals)?;
    let slices: Vec<&[T]> = hosts.iter().map(Vec::as_slice).collect();
    let h_exact = all_reduce_epilogue_exact(&slices, Some(&bias), Some(&residual), hidden);
    let (_, want) = all_reduce_fused_f64(
        &slices,
        Some(&bias),
        Some(&residual),
        Some(&gamma),
        f64::from(EPS),
        hidden,
    );
    rep.case(
        all_equal(&got) && all_equal(&h) && same_bits(&h[0], &h_exact),
        relative_error(&got[0], &want),
    );
    Ok(())
}

fn gather_case(
    groups: &[TpGroup],
    seed: u64,
    n: usize,
    counting: bool,
    rep: &mut OpReport,
) -> Result<()> {
    let world = groups.len();
    let hosts = rank_inputs(world, seed ^ 0x6a, n);
    let min = (world * (n + world * n) * 2) as u64;
    let got = collective_round(
        groups,
        &hosts,
        world * n,
        min,
        counting,
        &mut rep.traffic,
        ops::all_gather,
    )?;
    rep.case(all_equal(&got) && same_bits(&got[0], &hosts.concat()), 0.0);
    Ok(())
}

fn scatter_case(
    groups: &[TpGroup],
    seed: u64,
    n: usize,
    counting: bool,
    rep: &mut OpReport,
) -> Result<()> {
    let world = groups.len();
    let hosts = rank_inputs(world, seed ^ 0x5c, world * n);
    let min = (world * (world * n + n) * 2) as u64;
    let got = collective_round(
        groups,
        &hosts,
        n,
        min,
        counting,
        &mut rep.traffic,
        ops::reduce_scatter,
    )?;
    let slices: Vec<&[T]> = hosts.iter().map(Vec::as_slice).collect();
    let (exact, wide) = (reduce_ranks_exact(&slices), reduce_ranks_f64(&slices));
    let mut bitwise = true;
    let mut error: f64 = 0.0;
    for (r, g) in got.iter().enumerate() {
        bitwise &= same_bits(g, &exact[r * n..(r + 1) * n]);
        error = error.max(relative_error(g, &wide[r * n..(r + 1) * n]));
    }
    rep.case(bitwise, error);
    Ok(())
}

/// Every configuration on awkward shapes: each bitwise equal to the others, and to the
/// same rows of a larger batch (batch invariance).
fn gemm(ctx: &Arc<CudaContext>, seed: u64, counting: bool) -> Result<OpReport> {
    let mut rep = OpReport::new("gemm (every configuration)");
    let stream = ctx.default_stream();
    for (m, n, k) in [
        (1usize, 256usize, 512usize),
        (17, 136, 264),
        (130, 520, 136),
    ] {
        let s = seed ^ (m * n * k) as u64;
        let a = random(s ^ 1, (m + 3) * k, -1.0, 1.0);
        let b = random(s ^ 2, n * k, -0.1, 0.1);
        let (da, db) = (up(&stream, &a)?, up(&stream, &b)?);
        let want = gemm_f64(&a[..m * k], &b, None, None, m, n, k);
        let shape = GemmShape { m, n, k };
        let mut first: Option<Vec<T>> = None;
        let parts = tpfuse::ops::gemm::split_parts_on(&stream, n, k)?;
        for config in GemmConfig::ALL
            .into_iter()
            .filter(|c| c.splits_k() || parts == 1)
        {
            let mut c = nan(&stream, m * n)?;
            let min = ((m * k + n * k + m * n) * 2) as u64;
            rep.traffic.measure(counting, min, || {
                let a_rows = da.slice(0..m * k);
                gemm_with_config(&stream, &a_rows, &db, None, None, &mut c, shape, config)?;
                stream.synchronize().map_err(cuda("gemm"))
            })?;
            let got = down(&stream, &c)?;
            let same = first.as_ref().map_or(true, |f| same_bits(f, &got));
            rep.case(same, relative_error(&got, &want));
            first.get_or_insert(got);
        }
        // The same rows inside a batch of m + 3.
        let mut c = nan(&stream, (m + 3) * n)?;
        ops::gemm(&stream, &da, &db, None, None, &mut c, m + 3, n, k)?;
        let batch = down(&stream, &c)?;
        let rows_match = first
            .as_ref()
            .is_some_and(|f| same_bits(f, &batch[..m * n]));
        rep.case(rows_match, relative_error(&batch[..m * n], &want));
    }
    Ok(rep)
}

/// A row-parallel layer built from host weights: unfused (the GEMM of every rank's shard,
/// then the all-reduce + bias), the output is the exact rank-ordered sum of the downloaded
/// partials; fused (one kernel), the output has the unfused bits.
fn row_parallel(ctx: &Arc<CudaContext>, seed: u64, counting: bool) -> Result<OpReport> {
    let mut rep = OpReport::new("row-parallel linear (GEMM + all-reduce)");
    let (inp, out) = (512usize, 256usize);
    for world in WORLDS {
        let groups = TpGroup::virtual_ranks(ctx, world, GroupOptions::default())?;
        let s = seed ^ (world as u64) << 40;
        let weight = random(s ^ 1, out * inp, -0.05, 0.05);
        let bias = random(s ^ 2, out, -0.5, 0.5);
        let layers_with = |fusion: Fusion| {
            groups
                .iter()
                .map(|g| {
                    let spec = RowParallelSpec::new("selftest.down_proj", inp, out, world)?;
                    let layer = RowParallelLinear::from_host(
                        g,
                        spec,
                        HostWeight::new(&weight, out, inp),
                        Some(&bias),
                    )?;
                    Ok(layer.with_fusion(fusion))
                })
                .collect::<Result<Vec<_>>>()
        };
        let layers = layers_with(Fusion::Unfused)?;
        let fused_layers = layers_with(Fusion::Fused)?;
        for m in [1usize, 7] {
            let x = random(s ^ 3 ^ m as u64, m * inp, -1.0, 1.0);
            let per = inp / world;
            let shards: Vec<Vec<T>> = (0..world)
                .map(|r| {
                    x.chunks(inp)
                        .flat_map(|row| row[r * per..(r + 1) * per].iter().copied())
                        .collect()
                })
                .collect();
            let xs = upload_all(&groups, &shards)?;
            let mut partials = nan_all(&groups, m * out)?;
            let mut outs = nan_all(&groups, m * out)?;
            let min = (world * (m * per + per * out + 2 * m * out) * 2) as u64;
            rep.traffic.measure(counting, min, || {
                round(&groups, |r| {
                    layers[r]
                        .forward(&groups[r], &xs[r], Some(&mut partials[r]), &mut outs[r])
                        .map(|_| ())
                })
            })?;
            let got = download_all(&groups, &outs)?;
            let parts = download_all(&groups, &partials)?;
            let refs: Vec<&[T]> = parts.iter().map(Vec::as_slice).collect();
            let exact = all_reduce_epilogue_exact(&refs, Some(&bias), None, out);
            let want = gemm_f64(&x, &weight, Some(&bias), None, m, out, inp);
            let mut fused = nan_all(&groups, m * out)?;
            round(&groups, |r| {
                fused_layers[r]
                    .forward(&groups[r], &xs[r], Some(&mut partials[r]), &mut fused[r])
                    .map(|_| ())
            })?;
            let fused = download_all(&groups, &fused)?;
            rep.case(
                all_equal(&got)
                    && same_bits(&got[0], &exact)
                    && all_equal(&fused)
                    && same_bits(&fused[0], &got[0]),
                relative_error(&got[0], &want),
            );
        }
    }
    Ok(rep)
}
