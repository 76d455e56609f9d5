//! GPU tests of the tensor-parallel linear layers ([`tpfuse::ops::linear`]; feature
//! `gpu-tests`, or `emulator` on the CPU; with neither every test here is listed as
//! ignored), on virtual ranks
//! ([`TpGroup::virtual_ranks`]) W = 2, 4, 8 of GPU 0.
//!
//! Every case builds each rank's layer from the full host weights (the shard cut on the host,
//! as a loader does), uploads fresh random inputs (seeded per case from `TPFUSE_TEST_SEED`, a
//! fixed default when unset), fills every output and workspace with NaN first (an element
//! never written fails the bitwise checks), enqueues the op on rank 0, 1, .., W-1 from one
//! thread, calls `check()` on every rank, and asserts
//!
//! - **a two-layer TP MLP** (merged column-parallel gate_up, SiLU·mul on the host between
//!   the layers — tpfuse has no activation kernel and the tests add none — then row-parallel
//!   down with a bias, plain or with the fused residual add + RMSNorm) equals the unsharded
//!   f64 MLP ([`gated_mlp_f64`]) within the bound below, and every rank holds the same bits;
//! - the row-parallel output is bit for bit the kernels' rank-ordered f32 sum of the ranks'
//!   partials plus the bias, added once ([`all_reduce_epilogue_exact`] of the downloaded
//!   partial workspaces), with one-shot, two-shot and `Auto`;
//! - column-parallel with and without the gather, and QKV with grouped-query heads (KV heads
//!   split and replicated), against the f64 reference of the full layer;
//! - bad calls on real buffers are typed errors naming the layer, and nothing is written.
//!
//! # Tolerances
//!
//! One layer: the DESIGN bounds, relative Frobenius error below 1e-2 (bf16) and 2e-3 (f16).
//!
//! Two layers, bf16: below 2e-2. The inputs and weights are exact in both computations (the
//! f64 reference reads the same bf16 values), so the error is the roundings in between. A
//! bf16 rounding has unit roundoff u = 2^-8 ≈ 3.9e-3 and, on values spread over binades, a
//! relative RMS error of about 2e-3. The device path rounds (1) gate and up (the GEMM output),
//! (2) SiLU(gate)·up (the host activation; its sensitivity to gate is at most about 1.3
//! where it matters, so with (1) about 4e-3), (3) each rank's partial of the down projection
//! (W roundings of partials of size |y|/√W: about 2e-3 of |y| together) and (4) the
//! all-reduce result (2e-3). The down GEMM carries the activation's relative error through
//! (random weights neither amplify nor cancel it in the Frobenius norm), so the total is
//! at most about √(4² + 2² + 2²)·1e-3 ≈ 5e-3. A CPU emulation of exactly these roundings
//! (f32 accumulation, bf16 results, this test's shapes and value ranges, m = 64, W = 2, 4, 8)
//! gives 3.0e-3, so 2e-2 leaves a margin of 4× over the estimate and 6× over the emulation,
//! and still catches any real fault (a missing or doubled bias, a wrong shard or a lost
//! rank moves the error to O(1e-1) or more). f16 has u = 2^-11, eight times smaller: the
//! estimate is about 6e-4, the emulation 3.7e-4, the bound 4e-3. After the RMSNorm (one
//! more rounding and `rsqrtf`) the same bounds hold.
//!
//! Run one test at a time on the GPU (a process-wide lock does that) with enough hardware
//! queues for the virtual ranks (`CUDA_DEVICE_MAX_CONNECTIONS=32`, set by the first test
//! before the first CUDA call when unset); see `tests/common/ranks.rs`.

mod common;
use common::gpu::{
    self, assert_close, assert_poisoned, base_seed, expect_invalid_saying, mix_seed, random_vec,
    splitmix64,
};
use common::ranks::{
    download, download_ranks, gpu, poisoned, poisoned_ranks, round, upload, upload_copies,
    virtual_group,
};
use common::{assert_same_bits, reduced_copy};

use cudarc::driver::{CudaContext, CudaSlice};
use half::{bf16, f16};
use std::sync::Arc;
use tpfuse::ops::gemm::GemmElement;
use tpfuse::ops::linear::{
    ColumnParallelLinear, Fusion, MergedColumnParallelLinear, RowParallelLinear, RowParallelPath,
    Workspace,
};
use tpfuse::ops::{Algorithm, RmsNorm};
use tpfuse::reference::{all_reduce_epilogue_exact, gated_mlp_f64, gemm_f64, rms_norm_f64};
use tpfuse::shard::{ColumnParallelSpec, HostWeight, MergedColumnSpec, RowParallelSpec};
use tpfuse::topology::AllReduceAlgo;
use tpfuse::{GroupOptions, NcclType, TpGroup};

const WORLDS: [usize; 3] = [2, 4, 8];
const EPS: f32 = 1e-5;

/// The layers' element types; `TOLERANCE` (one layer against the f64 reference) and the
/// seeds' `ID` come from [`gpu::TestElement`].
trait TestElement: gpu::TestElement + GemmElement + NcclType {
    /// Two layers (see the module docs).
    const MLP_TOLERANCE: f64;
}

impl TestElement for bf16 {
    const MLP_TOLERANCE: f64 = 2e-2;
}

impl TestElement for f16 {
    const MLP_TOLERANCE: f64 = 4e-3;
}

// ---------------------------------------------------------------------------------------
// Seeds, data, checks.
// ---------------------------------------------------------------------------------------

fn case_seed<T: TestElement>(parts: &[u64]) -> u64 {
    mix_seed(splitmix64(base_seed(0x7470_6675_7365_11a7) ^ T::ID), parts)
}

/// `n` values uniform in (-scale, scale).
fn random<T: TestElement>(seed: u64, n: usize, scale: f32) -> Vec<T> {
    random_vec(seed, n, -scale, scale)
}

/// A weight `[out, in]` scaled like a trained layer (outputs of order 1 for inputs of order 1).
fn weight<T: TestElement>(seed: u64, out: usize, k: usize) -> Vec<T> {
    random(seed, out * k, 2.0 / (k as f32).sqrt())
}

/// Every rank's result has rank 0's bits.
fn assert_ranks_agree<T: TestElement>(label: &str, per_rank: &[Vec<T>]) {
    for (r, got) in per_rank.iter().enumerate().skip(1) {
        assert_same_bits(&format!("{label}: rank {r} vs rank 0"), got, &per_rank[0]);
    }
}

/// Columns `cols` of a row-major `[m, n]` matrix.
fn columns<X: Copy>(y: &[X], n: usize, cols: std::ops::Range<usize>) -> Vec<X> {
    y.chunks_exact(n)
        .flat_map(|row| row[cols.clone()].to_vec())
        .collect()
}

/// `SiLU(gate) · up` per row of `[m, gate | up]` (widths `inter`), in f32, rounded once: what
/// an engine's activation kernel computes between the layers.
fn silu_mul<T: TestElement>(gate_up: &[T], inter: usize) -> Vec<T> {
    gate_up
        .chunks_exact(2 * inter)
        .flat_map(|row| {
            let (gate, up) = row.split_at(inter);
            gate.iter()
                .zip(up)
                .map(|(g, u)| {
                    let g = g.to_f32();
                    T::from_f32(g / (1.0 + (-g).exp()) * u.to_f32())
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// The MLP.
// ---------------------------------------------------------------------------------------

/// The full host weights of an MLP.
struct Mlp<T> {
    hidden: usize,
    inter: usize,
    gate_up: Vec<T>,
    down: Vec<T>,
    bias: Vec<T>,
}

impl<T: TestElement> Mlp<T> {
    fn new(seed: u64, hidden: usize, inter: usize) -> Self {
        Mlp {
            hidden,
            inter,
            gate_up: weight(splitmix64(seed ^ 1), 2 * inter, hidden),
            down: weight(splitmix64(seed ^ 2), hidden, inter),
            bias: random(splitmix64(seed ^ 3), hidden, 0.5),
        }
    }

    fn layers(
        &self,
        groups: &[TpGroup],
    ) -> Vec<(MergedColumnParallelLinear<T>, RowParallelLinear<T>)> {
        groups
            .iter()
            .map(|g| {
                let w = g.world();
                let gu = MergedColumnSpec::gate_up("mlp.gate_up_proj", self.hidden, self.inter, w)
                    .expect("gate_up spec");
                let dn = RowParallelSpec::new("mlp.down_proj", self.inter, self.hidden, w)
                    .expect("down spec");
                (
                    MergedColumnParallelLinear::from_host(g, gu, self.gate_up_weight(), None)
                        .expect("gate_up layer"),
                    RowParallelLinear::from_host(g, dn, self.down_weight(), Some(&self.bias))
                        .expect("down layer"),
                )
            })
            .collect()
    }

    /// gate_up as stored, `[2·inter, hidden]`.
    fn gate_up_weight(&self) -> HostWeight<'_, T> {
        HostWeight::new(&self.gate_up, 2 * self.inter, self.hidden)
    }

    /// down as stored, `[hidden, inter]`.
    fn down_weight(&self) -> HostWeight<'_, T> {
        HostWeight::new(&self.down, self.hidden, self.inter)
    }

    /// The unsharded f64 MLP of `x` (`[m, hidden]`).
    fn reference(&self, x: &[T]) -> Vec<f64> {
        let m = x.len() / self.hidden;
        let bias = Some(&self.bias[..]);
        gated_mlp_f64(
            x,
            &self.gate_up,
            &self.down,
            bias,
            m,
            self.hidden,
            self.inter,
        )
    }
}

/// What the first layer and the activation leave on every rank.
struct FirstLayer<T> {
    /// `[m, inter / W]` per rank, on the device.
    act: Vec<CudaSlice<T>>,
}

/// gate_up on every rank, checked against the f64 reference of its columns; then SiLU·mul
/// on the host and the activation uploaded.
fn first_layer<T: TestElement>(
    label: &str,
    groups: &[TpGroup],
    layers: &[(MergedColumnParallelLinear<T>, RowParallelLinear<T>)],
    mlp: &Mlp<T>,
    x: &[T],
) -> FirstLayer<T> {
    let world = groups.len();
    let (hidden, inter) = (mlp.hidden, mlp.inter);
    let m = x.len() / hidden;
    let per = inter / world;
    let full = gemm_f64(x, &mlp.gate_up, None, None, m, 2 * inter, hidden);
    let xs: Vec<CudaSlice<T>> = upload_copies(groups, x);
    let mut hs: Vec<CudaSlice<T>> = poisoned_ranks(groups, m * 2 * per);
    round(groups, &format!("{label} gate_up"), |r| {
        layers[r].0.forward(&groups[r], &xs[r], &mut hs[r])
    });
    let mut act = Vec::new();
    for (r, g) in groups.iter().enumerate() {
        let h = download(g, &hs[r]);
        let split = layers[r].0.gate_up_split().expect("a gate_up layer");
        assert_eq!(split.gate, 0..per);
        let want_gate = columns(&full, 2 * inter, r * per..(r + 1) * per);
        let want_up = columns(&full, 2 * inter, inter + r * per..inter + (r + 1) * per);
        assert_close(
            &format!("{label} rank {r} gate"),
            &columns(&h, 2 * per, split.gate),
            &want_gate,
            T::TOLERANCE,
        );
        assert_close(
            &format!("{label} rank {r} up"),
            &columns(&h, 2 * per, split.up),
            &want_up,
            T::TOLERANCE,
        );
        act.push(upload(g, &silu_mul(&h, per)));
        g.stream().synchronize().expect("uploading the activation");
    }
    FirstLayer { act }
}

/// The MLP with the plain row-parallel forward: every algorithm, the same bits, the exact
/// rank-ordered sum plus the bias once, and the f64 MLP.
fn mlp_case<T: TestElement>(ctx: &Arc<CudaContext>, world: usize, m: usize) {
    let (hidden, inter) = (512, 1536);
    let seed = case_seed::<T>(&[1, world as u64, m as u64]);
    let label = format!("MLP {} W={world} m={m} seed={seed:#x}", T::NAME);
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let mlp = Mlp::<T>::new(seed, hidden, inter);
    let mut layers = mlp.layers(&groups);
    let x = random::<T>(splitmix64(seed ^ 4), m * hidden, 1.0);
    let want = mlp.reference(&x);
    let first = first_layer(&label, &groups, &layers, &mlp, &x);

    let mut first_bits: Option<Vec<T>> = None;
    let mut ways = vec![
        (Fusion::Unfused, Algorithm::Auto),
        (Fusion::Unfused, Algorithm::OneShot),
        (Fusion::Unfused, Algorithm::TwoShot),
        (Fusion::Fused, Algorithm::Auto),
        (Fusion::Auto, Algorithm::Auto),
        (Fusion::Fused, Algorithm::OneShot),
        (Fusion::Auto, Algorithm::TwoShot),
    ];
    let even = m % world == 0;
    if even {
        ways.push((Fusion::Fused, Algorithm::TwoShot));
    }
    for (fusion, algo) in ways {
        layers = layers
            .into_iter()
            .map(|(gu, dn)| (gu, dn.with_algorithm(algo).with_fusion(fusion)))
            .collect();
        let label = format!("{label} {fusion:?} {algo:?}");
        let mut partials: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * hidden);
        let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * hidden);
        // A fused call is given no workspace: it needs none.
        let needs = layers[0]
            .1
            .needs_partial(&groups[0], m)
            .expect("needs_partial");
        let ran = round(&groups, &label, |r| {
            let partial = needs.then_some(&mut partials[r] as &mut dyn Workspace<T>);
            layers[r]
                .1
                .forward(&groups[r], &first.act[r], partial, &mut outs[r])
        });
        assert!(ran.iter().all(|a| *a == ran[0]), "{label}: {ran:?}");
        assert_eq!(
            needs,
            matches!(ran[0], RowParallelPath::Unfused(_)),
            "{label}"
        );
        match (fusion, algo) {
            (Fusion::Unfused, Algorithm::OneShot) => {
                assert_eq!(
                    ran[0],
                    RowParallelPath::Unfused(AllReduceAlgo::OneShot),
                    "{label}"
                )
            }
            (Fusion::Unfused, Algorithm::TwoShot) => {
                assert_eq!(
                    ran[0],
                    RowParallelPath::Unfused(AllReduceAlgo::TwoShot),
                    "{label}"
                )
            }
            // Auto never fuses a row-parallel layer (FusionRule: measured slower fused).
            (Fusion::Auto, _) => {
                assert!(
                    matches!(ran[0], RowParallelPath::Unfused(_)),
                    "{label}: {ran:?}"
                )
            }
            // The two-shot fuses only where m splits into W slices.
            (Fusion::Fused, Algorithm::TwoShot) => {
                let want = if even {
                    RowParallelPath::Fused(AllReduceAlgo::TwoShot)
                } else {
                    RowParallelPath::Unfused(AllReduceAlgo::TwoShot)
                };
                assert_eq!(ran[0], want, "{label}")
            }
            // Auto: at most 64 KB here, below the one-shot bound.
            (Fusion::Fused, _) => {
                assert_eq!(
                    ran[0],
                    RowParallelPath::Fused(AllReduceAlgo::OneShot),
                    "{label}"
                )
            }
            _ => {}
        }
        let got: Vec<Vec<T>> = download_ranks(&groups, &outs);
        assert_ranks_agree(&label, &got);
        assert_close(&label, &got[0], &want, T::MLP_TOLERANCE);
        if matches!(ran[0], RowParallelPath::Fused(_)) {
            // The partials were not written: the bits are the unfused paths' (below).
            let bits = first_bits.as_ref().expect("an unfused way ran first");
            assert_same_bits(&format!("{label} vs unfused"), &got[0], bits);
            continue;
        }
        // The bits: Σ partials in rank order in f32, + bias once, rounded once.
        let parts: Vec<Vec<T>> = download_ranks(&groups, &partials);
        let refs: Vec<&[T]> = parts.iter().map(|p| p.as_slice()).collect();
        let exact = all_reduce_epilogue_exact(&refs, Some(&mlp.bias), None, hidden);
        assert_same_bits(
            &format!("{label}: vs Σ partials + bias once"),
            &got[0],
            &exact,
        );
        // Without the bias the bits differ: the check above sees the bias.
        let unbiased = all_reduce_epilogue_exact(&refs, None, None, hidden);
        assert!(unbiased
            .iter()
            .zip(&exact)
            .any(|(a, b)| a.bits() != b.bits()));
        match &first_bits {
            None => first_bits = Some(got[0].clone()),
            Some(bits) => assert_same_bits(&format!("{label} vs Auto"), &got[0], bits),
        }
    }
}

/// The MLP with the fused residual add + RMSNorm after the down projection.
fn mlp_rmsnorm_case<T: TestElement>(ctx: &Arc<CudaContext>, world: usize, m: usize) {
    let (hidden, inter) = (512, 1536);
    let seed = case_seed::<T>(&[2, world as u64, m as u64]);
    let label = format!("MLP+RMSNorm {} W={world} m={m} seed={seed:#x}", T::NAME);
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let mlp = Mlp::<T>::new(seed, hidden, inter);
    let mut layers = mlp.layers(&groups);
    let x = random::<T>(splitmix64(seed ^ 4), m * hidden, 1.0);
    let residual_in = random::<T>(splitmix64(seed ^ 5), m * hidden, 1.0);
    let gamma = random::<T>(splitmix64(seed ^ 6), hidden, 1.0);
    let y = mlp.reference(&x);
    let h_want: Vec<f64> = y
        .iter()
        .zip(&residual_in)
        .map(|(a, b)| a + b.to_f64())
        .collect();
    let out_want = rms_norm_f64(&h_want, &gamma, f64::from(EPS));
    let first = first_layer(&label, &groups, &layers, &mlp, &x);

    let gammas: Vec<CudaSlice<T>> = upload_copies(&groups, &gamma);
    // Unfused first (its partials give the exact bits), then fused: the same bits.
    // Every rank's (residual, out) of the unfused run.
    type PerRank<T> = Vec<Vec<T>>;
    let mut unfused: Option<(PerRank<T>, PerRank<T>)> = None;
    let mut ways = vec![
        (Fusion::Unfused, Algorithm::Auto),
        (Fusion::Fused, Algorithm::Auto),
    ];
    if m % world == 0 {
        ways.push((Fusion::Fused, Algorithm::TwoShot));
    }
    for (fusion, algo) in ways {
        let label = format!("{label} {fusion:?} {algo:?}");
        let mut residuals: Vec<CudaSlice<T>> = upload_copies(&groups, &residual_in);
        let mut partials: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * hidden);
        let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * hidden);
        for g in &groups {
            g.stream().synchronize().expect("uploading");
        }
        layers = layers
            .into_iter()
            .map(|(gu, dn)| (gu, dn.with_fusion(fusion).with_algorithm(algo)))
            .collect();
        let ran = round(&groups, &label, |r| {
            let norm = RmsNorm {
                gamma: &gammas[r],
                eps: EPS,
            };
            let (x, p, res, o) = (
                &first.act[r],
                &mut partials[r],
                &mut residuals[r],
                &mut outs[r],
            );
            layers[r]
                .1
                .forward_residual_rmsnorm(&groups[r], x, Some(p), res, norm, o)
        });
        let h: Vec<Vec<T>> = download_ranks(&groups, &residuals);
        let out: Vec<Vec<T>> = download_ranks(&groups, &outs);
        assert_ranks_agree(&format!("{label} residual"), &h);
        assert_ranks_agree(&format!("{label} out"), &out);
        assert_close(
            &format!("{label} residual"),
            &h[0],
            &h_want,
            T::MLP_TOLERANCE,
        );
        assert_close(
            &format!("{label} out"),
            &out[0],
            &out_want,
            T::MLP_TOLERANCE,
        );
        match &unfused {
            None => {
                assert!(
                    matches!(ran[0], RowParallelPath::Unfused(_)),
                    "{label}: {ran:?}"
                );
                // The new residual: Σ partials + bias + old residual, in f32 in that order,
                // rounded once.
                let parts: Vec<Vec<T>> = download_ranks(&groups, &partials);
                let refs: Vec<&[T]> = parts.iter().map(|p| p.as_slice()).collect();
                let exact =
                    all_reduce_epilogue_exact(&refs, Some(&mlp.bias), Some(&residual_in), hidden);
                assert_same_bits(&format!("{label}: residual vs exact"), &h[0], &exact);
                unfused = Some((h, out));
            }
            Some((h_u, out_u)) => {
                let want = match algo {
                    Algorithm::TwoShot => AllReduceAlgo::TwoShot,
                    _ => AllReduceAlgo::OneShot,
                };
                assert_eq!(ran[0], RowParallelPath::Fused(want), "{label}");
                assert_same_bits(&format!("{label}: residual vs unfused"), &h[0], &h_u[0]);
                assert_same_bits(&format!("{label}: out vs unfused"), &out[0], &out_u[0]);
            }
        }
    }
}

/// Every world and m = 1, 7, 64; on the emulator the f16 copy leaves out m = 64
/// ([`reduced_copy`]).
fn mlp_matrix<T: TestElement>() {
    let gpu = gpu();
    let ms: &[usize] = if reduced_copy::<T>() {
        &[1, 7]
    } else {
        &[1, 7, 64]
    };
    for world in WORLDS {
        for &m in ms {
            mlp_case::<T>(&gpu.ctx, world, m);
            mlp_rmsnorm_case::<T>(&gpu.ctx, world, m);
        }
    }
}

gpu_tests! {
    tp_mlp_equals_the_unsharded_mlp_bf16 => mlp_matrix::<bf16>();
    tp_mlp_equals_the_unsharded_mlp_f16 => mlp_matrix::<f16>();
}

// ---------------------------------------------------------------------------------------
// Column-parallel, gathered or not.
// ---------------------------------------------------------------------------------------

fn column_case<T: TestElement>(ctx: &Arc<CudaContext>, world: usize, m: usize) {
    let (k, n) = (256, 1024);
    let seed = case_seed::<T>(&[3, world as u64, m as u64]);
    let label = format!("column {} W={world} m={m} seed={seed:#x}", T::NAME);
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let w = weight::<T>(splitmix64(seed ^ 1), n, k);
    let b = random::<T>(splitmix64(seed ^ 2), n, 0.5);
    let x = random::<T>(splitmix64(seed ^ 3), m * k, 1.0);
    let want = gemm_f64(&x, &w, Some(&b), None, m, n, k);
    let per = n / world;
    let layers: Vec<ColumnParallelLinear<T>> = groups
        .iter()
        .map(|g| {
            let spec = ColumnParallelSpec::new("lm_head", k, n, world).expect("spec");
            ColumnParallelLinear::from_host(g, spec, HostWeight::new(&w, n, k), Some(&b))
                .expect("layer")
        })
        .collect();
    let xs: Vec<CudaSlice<T>> = upload_copies(&groups, &x);
    let mut plain: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * per);
    let mut local: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * per);
    let mut gathered: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
    for g in &groups {
        g.stream().synchronize().expect("uploading");
    }
    round(&groups, &format!("{label} sharded"), |r| {
        layers[r].forward(&groups[r], &xs[r], &mut plain[r])
    });
    round(&groups, &format!("{label} gathered"), |r| {
        layers[r].forward_gather(
            &groups[r],
            &xs[r],
            &mut local[r],
            &mut gathered[r],
            &mut outs[r],
        )
    });
    let mut shards = Vec::new();
    for (r, g) in groups.iter().enumerate() {
        let p = download(g, &plain[r]);
        assert_close(
            &format!("{label} rank {r}"),
            &p,
            &columns(&want, n, r * per..(r + 1) * per),
            T::TOLERANCE,
        );
        assert_same_bits(
            &format!("{label} rank {r}: local vs forward"),
            &download(g, &local[r]),
            &p,
        );
        shards.push(p);
    }
    // The gathered output is the shards side by side, on every rank.
    let mut side_by_side = Vec::with_capacity(m * n);
    for i in 0..m {
        for s in &shards {
            side_by_side.extend_from_slice(&s[i * per..(i + 1) * per]);
        }
    }
    let got: Vec<Vec<T>> = download_ranks(&groups, &outs);
    assert_ranks_agree(&format!("{label} gathered"), &got);
    assert_same_bits(
        &format!("{label}: gathered vs shards"),
        &got[0],
        &side_by_side,
    );
    assert_close(&format!("{label} gathered"), &got[0], &want, T::TOLERANCE);
}

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn column_parallel_gathers_the_full_output() {
    let gpu = gpu();
    for world in WORLDS {
        for m in [1, 5, 64] {
            column_case::<bf16>(&gpu.ctx, world, m);
            column_case::<f16>(&gpu.ctx, world, m);
        }
    }
}

// ---------------------------------------------------------------------------------------
// QKV with grouped-query heads.
// ---------------------------------------------------------------------------------------

fn qkv_case<T: TestElement>(ctx: &Arc<CudaContext>, world: usize, q_heads: usize, kv_heads: usize) {
    let (hidden, head_dim, m) = (256, 64, 5);
    let seed = case_seed::<T>(&[4, world as u64, q_heads as u64, kv_heads as u64]);
    let label = format!(
        "qkv {} {q_heads}/{kv_heads} W={world} seed={seed:#x}",
        T::NAME
    );
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let (q_rows, kv_rows) = (q_heads * head_dim, kv_heads * head_dim);
    let out = q_rows + 2 * kv_rows;
    let w = weight::<T>(splitmix64(seed ^ 1), out, hidden);
    let b = random::<T>(splitmix64(seed ^ 2), out, 0.5);
    let x = random::<T>(splitmix64(seed ^ 3), m * hidden, 1.0);
    let want = gemm_f64(&x, &w, Some(&b), None, m, out, hidden);
    let spec = |g: &TpGroup| {
        MergedColumnSpec::qkv(
            "attn.qkv_proj",
            hidden,
            head_dim,
            q_heads,
            kv_heads,
            g.world(),
        )
        .expect("spec")
    };
    let (wq, rest) = w.split_at(q_rows * hidden);
    let (wk, wv) = rest.split_at(kv_rows * hidden);
    let wq = HostWeight::new(wq, q_rows, hidden);
    let (wk, wv) = (
        HostWeight::new(wk, kv_rows, hidden),
        HostWeight::new(wv, kv_rows, hidden),
    );
    let (bq, rest) = b.split_at(q_rows);
    let (bk, bv) = rest.split_at(kv_rows);
    let merged: Vec<MergedColumnParallelLinear<T>> = groups
        .iter()
        .map(|g| {
            MergedColumnParallelLinear::from_host(
                g,
                spec(g),
                HostWeight::new(&w, out, hidden),
                Some(&b),
            )
            .expect("layer")
        })
        .collect();
    let parts: Vec<MergedColumnParallelLinear<T>> = groups
        .iter()
        .map(|g| {
            MergedColumnParallelLinear::from_host_parts(
                g,
                spec(g),
                &[wq, wk, wv],
                Some(&[bq, bk, bv]),
            )
            .expect("layer from parts")
        })
        .collect();
    let n = merged[0].spec().out_per_rank();
    let xs: Vec<CudaSlice<T>> = upload_copies(&groups, &x);
    let mut ys: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
    let mut ys2: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
    round(&groups, &label, |r| {
        merged[r].forward(&groups[r], &xs[r], &mut ys[r])
    });
    round(&groups, &label, |r| {
        parts[r].forward(&groups[r], &xs[r], &mut ys2[r])
    });
    let split = merged[0].qkv_split().expect("a QKV layer");
    for (r, g) in groups.iter().enumerate() {
        let y = download(g, &ys[r]);
        assert_same_bits(
            &format!("{label} rank {r}: parts vs merged"),
            &download(g, &ys2[r]),
            &y,
        );
        let spec = merged[r].spec();
        for (s, cols, offset) in [
            (0, split.q.clone(), 0),
            (1, split.k.clone(), q_rows),
            (2, split.v.clone(), q_rows + kv_rows),
        ] {
            let heads = spec.heads_of(s, r).expect("heads");
            if s > 0 && kv_heads < world {
                assert_eq!(heads.start, r / (world / kv_heads), "{label} rank {r}");
            }
            let want_cols = columns(
                &want,
                out,
                offset + heads.start * head_dim..offset + heads.end * head_dim,
            );
            assert_close(
                &format!("{label} rank {r} section {s}"),
                &columns(&y, n, cols),
                &want_cols,
                T::TOLERANCE,
            );
        }
    }
}

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn qkv_sections_hold_the_ranks_heads() {
    let gpu = gpu();
    for world in WORLDS {
        qkv_case::<bf16>(&gpu.ctx, world, 32, 8);
        qkv_case::<f16>(&gpu.ctx, world, 32, 8);
    }
    for world in [4, 8] {
        // Fewer KV heads than ranks: replicated.
        qkv_case::<bf16>(&gpu.ctx, world, 8, 2);
        qkv_case::<f16>(&gpu.ctx, world, 8, 2);
    }
    qkv_case::<bf16>(&gpu.ctx, 8, 64, 8);
}

// ---------------------------------------------------------------------------------------
// Validation on real buffers.
// ---------------------------------------------------------------------------------------

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn bad_calls_are_refused_before_anything_runs() {
    type T = bf16;
    let gpu = gpu();
    let groups = virtual_group(&gpu.ctx, 2, GroupOptions::default());
    let (hidden, inter, m) = (64, 128, 3);
    let seed = case_seed::<T>(&[5]);
    let mlp = Mlp::<T>::new(seed, hidden, inter);
    let layers = mlp.layers(&groups);
    let (g0, g1) = (&groups[0], &groups[1]);
    let down = "row-parallel 'mlp.down_proj'";
    let gate_up = "merged-column-parallel 'mlp.gate_up_proj'";

    // Construction: a spec for another world; a shard of the wrong length; a host weight of
    // the wrong length; a shard the GEMM cannot take.
    let spec4 = RowParallelSpec::new("mlp.down_proj", inter, hidden, 4).unwrap();
    expect_invalid_saying(
        "spec of world 4",
        RowParallelLinear::from_host(g0, spec4, mlp.down_weight(), None),
        down,
        &["world 4", "2 ranks"],
    );
    let spec = RowParallelSpec::new("mlp.down_proj", inter, hidden, 2).unwrap();
    expect_invalid_saying(
        "short shard",
        RowParallelLinear::<T>::from_shard(g0, spec.clone(), poisoned(g0, 8), None),
        down,
        &["the weight shard holds 8"],
    );
    expect_invalid_saying(
        "short host weight",
        RowParallelLinear::from_host(
            g0,
            spec.clone(),
            HostWeight::new(&mlp.down[1..], hidden, inter),
            None,
        ),
        down,
        &["the host weight"],
    );
    expect_invalid_saying(
        "transposed host weight",
        RowParallelLinear::from_host(
            g0,
            spec.clone(),
            HostWeight::new(&mlp.down, inter, hidden),
            None,
        ),
        down,
        &["expected [out_features, in_features] = [64, 128], got [128, 64] (transposed?)"],
    );
    expect_invalid_saying(
        "sharded bias",
        RowParallelLinear::from_host(g0, spec, mlp.down_weight(), Some(&mlp.bias[..hidden / 2])),
        down,
        &["the host bias", "whole on every rank"],
    );
    let odd = ColumnParallelSpec::new("lm_head", hidden, 12, 2).unwrap();
    expect_invalid_saying(
        "6 rows a rank",
        ColumnParallelLinear::from_host(
            g0,
            odd,
            HostWeight::new(&vec![T::ZERO; 12 * hidden], 12, hidden),
            None,
        ),
        "column-parallel 'lm_head'",
        &["multiple of 8"],
    );

    // Calls: the wrong rank, and buffers of the wrong length. Nothing may be written.
    let x = upload(g0, &random::<T>(seed, m * hidden, 1.0));
    let act = upload(g0, &random::<T>(seed ^ 9, m * inter / 2, 1.0));
    let mut h = poisoned::<T>(g0, m * inter);
    let mut partial = poisoned::<T>(g0, m * hidden);
    let mut out = poisoned::<T>(g0, m * hidden);
    let x1 = upload(g1, &random::<T>(seed, m * hidden, 1.0));
    let mut h1 = poisoned::<T>(g1, m * inter);
    expect_invalid_saying(
        "rank 0's layer on rank 1",
        layers[0].0.forward(g1, &x1, &mut h1),
        gate_up,
        &["rank 0", "rank 1"],
    );
    {
        let short = x.slice(0..m * hidden - 1);
        expect_invalid_saying(
            "x not whole rows",
            layers[0].0.forward(g0, &short, &mut h),
            gate_up,
            &["x holds", "whole rows of 64"],
        );
        let mut short_out = h.slice_mut(0..m * inter - 8);
        expect_invalid_saying(
            "out too short",
            layers[0].0.forward(g0, &x, &mut short_out),
            gate_up,
            &["out holds"],
        );
    }
    {
        let mut short = partial.slice_mut(0..(m - 1) * hidden);
        expect_invalid_saying(
            "partial too short",
            layers[0].1.forward(g0, &act, Some(&mut short), &mut out),
            down,
            &["partial holds"],
        );
    }
    {
        // An unfused call without the workspace it needs: named before anything runs.
        let unfused = RowParallelLinear::from_shard(
            g0,
            layers[0].1.spec().clone(),
            layers[0].1.weight().clone(),
            None,
        )
        .expect("the same layer")
        .with_fusion(Fusion::Unfused);
        assert!(unfused.needs_partial(g0, m).unwrap());
        expect_invalid_saying(
            "no partial for an unfused call",
            unfused.forward(g0, &act, None, &mut out),
            down,
            &["partial:", "none was given", "needs_partial"],
        );
        // The all-reduce's own checks come before the GEMM: the partial workspace, which the
        // GEMM would write first, stays untouched.
        let gamma = upload(g0, &vec![T::ONE; hidden]);
        let mut residual = upload(g0, &vec![T::ONE; m * hidden]);
        expect_invalid_saying(
            "an unfused call with a NaN eps",
            unfused.forward_residual_rmsnorm(
                g0,
                &act,
                Some(&mut partial),
                &mut residual,
                RmsNorm {
                    gamma: &gamma,
                    eps: f32::NAN,
                },
                &mut out,
            ),
            down,
            &["norm.eps:", "finite"],
        );
        let mut wide_out = poisoned::<T>(g0, m * hidden + 8);
        let mut off = wide_out.slice_mut(1..1 + m * hidden);
        expect_invalid_saying(
            "an unfused call with a misaligned out",
            unfused.forward(g0, &act, Some(&mut partial), &mut off),
            down,
            &["out:", "16"],
        );
        assert_poisoned("misaligned out", &download(g0, &wide_out));
    }
    let gamma_short = upload(g0, &vec![T::ONE; hidden / 2]);
    let mut residual = upload(g0, &vec![T::ONE; m * hidden]);
    expect_invalid_saying(
        "gamma of half the row",
        layers[0].1.forward_residual_rmsnorm(
            g0,
            &act,
            Some(&mut partial),
            &mut residual,
            RmsNorm {
                gamma: &gamma_short,
                eps: EPS,
            },
            &mut out,
        ),
        down,
        &["norm.gamma holds 32"],
    );
    // A misaligned input (one element off): the GEMM's check, renamed after the layer.
    let wide = upload(g0, &random::<T>(seed, m * inter / 2 + 8, 1.0));
    {
        let off = wide.slice(1..1 + m * inter / 2);
        expect_invalid_saying(
            "misaligned x",
            layers[0].1.forward(g0, &off, Some(&mut partial), &mut out),
            down,
            &["x:", "16-byte aligned"],
        );
    }
    g0.check().expect("rank 0 is healthy");
    g1.check().expect("rank 1 is healthy");
    assert_poisoned("h", &download(g0, &h));
    assert_poisoned("h on rank 1", &download(g1, &h1));
    assert_poisoned("partial", &download(g0, &partial));
    assert_poisoned("out", &download(g0, &out));
}
