//! GPU tests of the fused row-parallel GEMM + all-reduce through the Rust API
//! ([`tpfuse::ops::gemm_all_reduce`]; feature `gpu-tests`, or `emulator` on the CPU; with
//! neither every test here is listed as ignored), on virtual ranks W = 2, 4, 8 of GPU 0.
//!
//! - The fused op is bit for bit [`gemm`] into a workspace followed by
//!   [`all_reduce_fused`] with the same epilogue, on every rank, at the DESIGN.md reference
//!   shapes of the row-parallel layers (o_proj and down at TP 8, scaled down on the emulator),
//!   and within the DESIGN.md tolerance of the f64 reference.
//! - A CUDA graph of the fused op replayed 100 times (the residual carried from replay to
//!   replay) ends with the bits of 100 eager unfused calls.
//! - Bad calls are typed errors naming the argument, before anything runs.
//! - Every fused launch leaves a phase record per block ([`TpGroup::fused_phases`]): the
//!   block's tiles, its phases inside its start and end.
//! - GEMM + reduce-scatter ([`tpfuse::ops::gemm_reduce_scatter`]) is bit for bit [`gemm`] then
//!   [`tpfuse::ops::reduce_scatter`], every rank's slice; all-gather + GEMM
//!   ([`tpfuse::ops::all_gather_gemm`]) is bit for bit [`tpfuse::ops::all_gather`] then [`gemm`].
//!
//! Fresh random inputs per case (seeded from `TPFUSE_TEST_SEED`), outputs poisoned first.

mod common;
use common::gpu::{
    self, assert_close, base_seed, expect_invalid_saying, mix_seed, random_vec, splitmix64,
};
use common::graphs::{capture_on, launch_all};
use common::ranks::{
    check_all, download, download_ranks, gpu, poisoned, poisoned_ranks, round, upload_copies,
    upload_ranks, virtual_group,
};
use common::shape;
use common::{assert_same_bits, Bits};

use cudarc::driver::{CudaSlice, DevicePtrMut};
use half::{bf16, f16};
use tpfuse::ops::gemm::GemmElement;
use tpfuse::ops::gemm_all_reduce::{facts_of, fused_all_reduce_algo, FusedPlan};
use tpfuse::ops::linear::{Fusion, RowParallelLinear, RowParallelPath};
use tpfuse::ops::{
    self, all_gather_gemm, gemm, gemm_all_reduce, gemm_all_reduce_with, gemm_reduce_scatter,
    Algorithm, Epilogue, GemmShape, RmsNorm,
};
use tpfuse::reference::{gemm_f64, rms_norm_f64};
use tpfuse::shard::{HostWeight, RowParallelSpec};
use tpfuse::{GroupOptions, NcclType, TpGroup};

const EPS: f32 = 1e-5;

trait TestElement: gpu::TestElement + GemmElement + NcclType {}
impl TestElement for bf16 {}
impl TestElement for f16 {}

fn case_seed<T: TestElement>(parts: &[u64]) -> u64 {
    mix_seed(splitmix64(base_seed(0x7470_6675_7365_f05e) ^ T::ID), parts)
}

/// Every rank's inputs of one case: x_r `[m, k]`, w_r `[n, k]`; the shared bias, residual and
/// gamma.
struct Case<T> {
    m: usize,
    n: usize,
    k: usize,
    x: Vec<Vec<T>>,
    w: Vec<Vec<T>>,
    bias: Vec<T>,
    residual: Vec<T>,
    gamma: Vec<T>,
}

fn case<T: TestElement>(world: usize, (m, n, k): (usize, usize, usize), seed: u64) -> Case<T> {
    let scale = 2.0 / (k as f32).sqrt();
    let rand =
        |part: u64, len: usize, lo: f32, hi: f32| random_vec(mix_seed(seed, &[part]), len, lo, hi);
    Case {
        m,
        n,
        k,
        x: (0..world)
            .map(|r| rand(10 + r as u64, m * k, -1.0, 1.0))
            .collect(),
        w: (0..world)
            .map(|r| rand(20 + r as u64, n * k, -scale, scale))
            .collect(),
        bias: rand(1, n, -1.0, 1.0),
        residual: rand(2, m * n, -2.0, 2.0),
        gamma: rand(3, n, 0.5, 1.5),
    }
}

/// The layer's output on every rank, fused (by the algorithm) or unfused: `(out, residual)`
/// per rank.
fn forward<T: TestElement>(
    groups: &[TpGroup],
    c: &Case<T>,
    fused: Option<Algorithm>,
    label: &str,
) -> (Vec<Vec<T>>, Vec<Vec<T>>) {
    let (m, n, k) = (c.m, c.n, c.k);
    let xs = upload_ranks(groups, &c.x);
    let ws = upload_ranks(groups, &c.w);
    let biases = upload_copies(groups, &c.bias);
    let gammas = upload_copies(groups, &c.gamma);
    let mut residuals = upload_copies(groups, &c.residual);
    let mut partials: Vec<CudaSlice<T>> = poisoned_ranks(groups, m * n);
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(groups, m * n);
    let before = last_epoch(groups);
    let plans = round(groups, label, |r| {
        let epilogue = Epilogue {
            bias: Some(&biases[r]),
            residual: Some(&mut residuals[r]),
            norm: Some(RmsNorm {
                gamma: &gammas[r],
                eps: EPS,
            }),
        };
        let shape = GemmShape { m, n, k };
        if let Some(algo) = fused {
            let (x, w, out) = (&xs[r], &ws[r], &mut outs[r]);
            let plan = gemm_all_reduce_with(&groups[r], x, w, epilogue, out, shape, algo)?;
            // The op reduces as the group's rule says (tests/cpu_gemm.rs checks the rule);
            // under Auto that depends on the device: one-shot at the emulator's shrunk shapes,
            // two-shot for W = 8, m = 64 of o_proj on an H200 (docs/gpu-runs/2026-11-26-*).
            let want = fused_all_reduce_algo::<T>(shape, &facts_of(&groups[r]), algo)?;
            assert_eq!(plan.all_reduce, Some(want), "{label}: the reduction");
            Ok(Some(plan))
        } else {
            gemm(
                groups[r].stream(),
                &xs[r],
                &ws[r],
                None,
                None,
                &mut partials[r],
                m,
                n,
                k,
            )?;
            ops::all_reduce_fused(
                &groups[r],
                &partials[r],
                epilogue,
                &mut outs[r],
                Algorithm::Auto,
            )
            .map(|_| None)
        }
    });
    if let Some(plan) = &plans[0] {
        check_phases(groups, plan, before, label);
    }
    (
        download_ranks(groups, &outs),
        download_ranks(groups, &residuals),
    )
}

/// The epoch of the ranks' last fused launch (0 before the first), from their phase records.
fn last_epoch(groups: &[TpGroup]) -> u64 {
    let epochs: Vec<u64> = groups
        .iter()
        .map(|g| {
            g.fused_phases()
                .expect("phase records")
                .first()
                .map_or(0, |p| p.epoch)
        })
        .collect();
    assert!(
        epochs.iter().all(|&e| e == epochs[0]),
        "ranks' epochs {epochs:?}"
    );
    epochs[0]
}

/// The phase records of every rank's last fused launch ([`TpGroup::fused_phases`]): one per
/// block of `plan`'s grid, every block of every rank at one launch epoch past `before` (the
/// launch just made, not a stale one; the one-shot all-reduce by packets, a launch of the
/// fused family too, advances the epoch without a record), each block's units (tiles, or with the split in parallel parts of
/// tiles) those of its turn (b, b + grid, ...), its phases inside its start and end, and time
/// spent computing every unit.
fn check_phases(groups: &[TpGroup], plan: &FusedPlan, before: u64, label: &str) {
    let epoch = last_epoch(groups);
    assert!(
        epoch > before,
        "{label}: a stale epoch {epoch}, {before} before"
    );
    for (r, g) in groups.iter().enumerate() {
        let at = format!("{label} rank {r}: phases");
        let phases = g.fused_phases().unwrap_or_else(|e| panic!("{at}: {e}"));
        assert_eq!(
            phases.len(),
            plan.grid.min(1024), // the records of the first 1024 blocks (TpGroup::fused_phases)
            "{at}: one record per block"
        );
        for p in &phases {
            assert_eq!(p.epoch, epoch, "{at}: {p:?}");
            let units = plan.tiles
                * if plan.parts_in_parallel {
                    plan.parts
                } else {
                    1
                };
            let turn = (units - p.block).div_ceil(plan.grid) as u64;
            assert_eq!(p.tiles, turn, "{at}: {p:?}");
            let spent = p.gemm_ns + p.publish_ns + p.wait_ns + p.reduce_ns + p.tail_ns;
            assert!(p.start_ns <= p.end_ns, "{at}: {p:?}");
            assert!(spent <= p.end_ns - p.start_ns, "{at}: {p:?}");
            assert!(p.gemm_ns > 0, "{at}: {p:?}");
        }
    }
}

fn reference_shapes<T: TestElement>() {
    let gpu = gpu();
    // (world, m, n, k): o_proj (N 8192, K 1024) and down (N 8192, K 3584) at TP 8, divided by 8
    // on the emulator, at decode and small-prefill m.
    let o_proj = (shape(8192, 1024), shape(1024, 128));
    let down = (shape(8192, 1024), shape(3584, 448));
    let cases = [(2, 1, o_proj), (4, 16, down), (8, 64, o_proj), (8, 3, down)];
    for (world, m, (n, k)) in cases {
        let seed = case_seed::<T>(&[world as u64, m as u64, n as u64, k as u64]);
        let label = format!("{} W={world} m={m} n={n} k={k} seed={seed:#x}", T::NAME);
        let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
        let c = case::<T>(world, (m, n, k), seed);
        let (out_u, res_u) = forward(&groups, &c, None, &format!("{label} unfused"));
        // Auto, and the two-shot where m splits into W slices.
        let mut algos = vec![Algorithm::Auto];
        if m % world == 0 {
            algos.push(Algorithm::TwoShot);
        }
        let mut fused = Vec::new();
        for algo in algos {
            let (out, res) = forward(&groups, &c, Some(algo), &format!("{label} fused {algo:?}"));
            for r in 0..world {
                assert_same_bits(
                    &format!("{label} rank {r}: out, fused {algo:?} vs unfused"),
                    &out[r],
                    &out_u[r],
                );
                assert_same_bits(
                    &format!("{label} rank {r}: residual, fused {algo:?} vs unfused"),
                    &res[r],
                    &res_u[r],
                );
            }
            fused.push((out, res));
        }
        let (out, res) = fused.swap_remove(0);
        let mut h: Vec<f64> = c.residual.iter().map(|v| v.to_f64()).collect();
        for r in 0..world {
            let y = gemm_f64(&c.x[r], &c.w[r], None, None, m, n, k);
            h.iter_mut().zip(y).for_each(|(h, y)| *h += y);
        }
        h.iter_mut()
            .enumerate()
            .for_each(|(i, h)| *h += c.bias[i % n].to_f64());
        assert_close(
            &format!("{label}: residual vs f64"),
            &res[0],
            &h,
            T::TOLERANCE,
        );
        let want = rms_norm_f64(&h, &c.gamma, f64::from(EPS));
        assert_close(
            &format!("{label}: out vs f64"),
            &out[0],
            &want,
            T::NORM_TOLERANCE,
        );
    }
}

gpu_tests! {
    /// bf16 at the reference shapes: fused == unfused bitwise, and close to f64.
    fused_equals_unfused_at_the_reference_shapes_bf16 => reference_shapes::<bf16>();
    /// f16, the same.
    fused_equals_unfused_at_the_reference_shapes_f16 => reference_shapes::<f16>();
    /// A graph of the fused op, replayed 100 times, against 100 eager unfused calls.
    a_graph_of_the_fused_op_replays_100_times => graph_replays();
    /// Bad calls: typed errors naming the argument, nothing launched.
    bad_calls_are_refused_before_anything_runs => bad_calls();
    /// GEMM + reduce-scatter against the GEMM then the reduce-scatter, every rank's slice.
    fused_reduce_scatter_equals_gemm_then_reduce_scatter => reduce_scatter_shapes();
    /// All-gather + GEMM against the all-gather then the GEMM, on every rank.
    fused_all_gather_gemm_equals_all_gather_then_gemm => all_gather_gemm_shapes();
}

fn all_gather_gemm_shapes() {
    type T = bf16;
    let gpu = gpu();
    // The column-parallel gate_up at TP 8 after a sequence-parallel region: n = 2·28672 / 8,
    // k = hidden 8192 (divided by 8 on the emulator).
    let (n, k) = (shape(7168, 896), shape(8192, 1024));
    for (world, m) in [(2, 2), (4, 64), (8, 16)] {
        let seed = case_seed::<T>(&[300, world as u64, m as u64]);
        let label = format!("all-gather + GEMM W={world} m={m} n={n} k={k} seed={seed:#x}");
        let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
        let rows = m / world;
        let scale = 2.0 / (k as f32).sqrt();
        let xs_host: Vec<Vec<T>> = (0..world)
            .map(|r| random_vec(mix_seed(seed, &[1, r as u64]), rows * k, -1.0, 1.0))
            .collect();
        let ws_host: Vec<Vec<T>> = (0..world)
            .map(|r| random_vec(mix_seed(seed, &[2, r as u64]), n * k, -scale, scale))
            .collect();
        let bias_host: Vec<T> = random_vec(mix_seed(seed, &[3]), n, -1.0, 1.0);
        let xs = upload_ranks(&groups, &xs_host);
        let ws = upload_ranks(&groups, &ws_host);
        let biases = upload_copies(&groups, &bias_host);
        let mut fused: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
        let mut unfused: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
        let mut gathered: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * k);
        let shape = GemmShape { m, n, k };
        let before = last_epoch(&groups);
        let plans = round(&groups, &format!("{label} fused"), |r| {
            all_gather_gemm(
                &groups[r],
                &xs[r],
                &ws[r],
                Some(&biases[r]),
                &mut fused[r],
                shape,
            )
        });
        check_phases(&groups, &plans[0], before, &label);
        round(&groups, &format!("{label} unfused"), |r| {
            ops::all_gather(&groups[r], &xs[r], &mut gathered[r])?;
            gemm(
                groups[r].stream(),
                &gathered[r],
                &ws[r],
                Some(&biases[r]),
                None,
                &mut unfused[r],
                m,
                n,
                k,
            )
        });
        let x_all: Vec<T> = xs_host.concat();
        for r in 0..world {
            let got = download(&groups[r], &fused[r]);
            let want = download(&groups[r], &unfused[r]);
            assert_same_bits(&format!("{label} rank {r}: fused vs unfused"), &got, &want);
            let reference = gemm_f64(&x_all, &ws_host[r], Some(&bias_host), None, m, n, k);
            let tolerance = <T as gpu::TestElement>::TOLERANCE;
            assert_close(
                &format!("{label} rank {r}: vs f64"),
                &got,
                &reference,
                tolerance,
            );
        }
    }
    // x must be this rank's slice of whole rows: an error naming it, before anything runs.
    let groups = virtual_group(&gpu.ctx, 2, GroupOptions::default());
    let (n, k) = (64, 32);
    let x = poisoned::<T>(&groups[0], 4 * k);
    let w = poisoned::<T>(&groups[0], n * k);
    let mut out = poisoned::<T>(&groups[0], 4 * n);
    let wrong = all_gather_gemm(&groups[0], &x, &w, None, &mut out, GemmShape { m: 4, n, k });
    expect_invalid_saying("whole x", wrong, "x", &["[2, 32]", "64"]);
    // Every rank's area holds the gathered [m, k]: a rank's own rows fitting is not enough.
    let options = GroupOptions {
        capacity_bytes: 64 << 10,
        ..GroupOptions::default()
    };
    let groups = virtual_group(&gpu.ctx, 2, options);
    // Rows of 2 KiB: a rank's 16 rows are 32 KiB, half the capacity; the gathered 32 are 64.
    let (m, n, k) = (32, 64, 1024);
    let x = poisoned::<T>(&groups[0], m / 2 * k);
    let w = poisoned::<T>(&groups[0], n * k);
    let mut out = poisoned::<T>(&groups[0], m * n);
    let big = all_gather_gemm(&groups[0], &x, &w, None, &mut out, GemmShape { m, n, k });
    expect_invalid_saying("gathered input", big, "x", &["[32, 1024]", "65536 bytes"]);
    assert!(
        download(&groups[0], &out)
            .iter()
            .all(|v| v.bits() == T::poison().bits()),
        "out untouched"
    );
}

fn reduce_scatter_shapes() {
    type T = bf16;
    let gpu = gpu();
    let o_proj = (shape(8192, 1024), shape(1024, 128));
    for (world, m) in [(2, 2), (4, 64), (8, 16)] {
        let (n, k) = o_proj;
        let seed = case_seed::<T>(&[200, world as u64, m as u64]);
        let label = format!("reduce-scatter W={world} m={m} n={n} k={k} seed={seed:#x}");
        let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
        let c = case::<T>(world, (m, n, k), seed);
        let xs = upload_ranks(&groups, &c.x);
        let ws = upload_ranks(&groups, &c.w);
        let rows = m / world;
        let mut fused: Vec<CudaSlice<T>> = poisoned_ranks(&groups, rows * n);
        let mut unfused: Vec<CudaSlice<T>> = poisoned_ranks(&groups, rows * n);
        let mut partials: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
        let shape = GemmShape { m, n, k };
        let before = last_epoch(&groups);
        let plans = round(&groups, &format!("{label} fused"), |r| {
            gemm_reduce_scatter(&groups[r], &xs[r], &ws[r], &mut fused[r], shape)
        });
        check_phases(&groups, &plans[0], before, &label);
        round(&groups, &format!("{label} unfused"), |r| {
            gemm(
                groups[r].stream(),
                &xs[r],
                &ws[r],
                None,
                None,
                &mut partials[r],
                m,
                n,
                k,
            )?;
            ops::reduce_scatter(&groups[r], &partials[r], &mut unfused[r])
        });
        let mut sum = vec![0f64; m * n];
        for r in 0..world {
            let y = gemm_f64(&c.x[r], &c.w[r], None, None, m, n, k);
            sum.iter_mut().zip(y).for_each(|(s, y)| *s += y);
        }
        for r in 0..world {
            let got = download(&groups[r], &fused[r]);
            let want = download(&groups[r], &unfused[r]);
            assert_same_bits(&format!("{label} rank {r}: fused vs unfused"), &got, &want);
            let slice = &sum[r * rows * n..(r + 1) * rows * n];
            assert_close(
                &format!("{label} rank {r}: vs f64"),
                &got,
                slice,
                <T as gpu::TestElement>::TOLERANCE,
            );
        }
    }
    // m must split into equal slices: an error naming m, before anything runs.
    let groups = virtual_group(&gpu.ctx, 2, GroupOptions::default());
    let (n, k) = (64, 32);
    let x = poisoned::<T>(&groups[0], 3 * k);
    let w = poisoned::<T>(&groups[0], n * k);
    let mut out = poisoned::<T>(&groups[0], n);
    let odd = gemm_reduce_scatter(&groups[0], &x, &w, &mut out, GemmShape { m: 3, n, k });
    expect_invalid_saying("odd m", odd, "m", &["3 rows", "2 equal slices"]);
}

fn graph_replays() {
    type T = bf16;
    let gpu = gpu();
    // SAFETY: every buffer is used on its rank's stream only.
    unsafe { gpu.ctx.disable_event_tracking() };
    let (world, replays) = (2, 100);
    let c = case::<T>(world, (2, 64, 32), case_seed::<T>(&[100]));
    let (m, n, k) = (c.m, c.n, c.k);
    let label = "100 replays";
    let mut finals = Vec::new();
    for fused in [true, false] {
        let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
        let xs = upload_ranks(&groups, &c.x);
        let ws = upload_ranks(&groups, &c.w);
        let gammas = upload_copies(&groups, &c.gamma);
        let mut residuals = upload_copies(&groups, &c.residual);
        let mut partials: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
        let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
        let shape = GemmShape { m, n, k };
        if fused {
            // Modules load outside the capture: one eager call on every rank first (its
            // residual update is undone below by a fresh upload).
            round(&groups, &format!("{label} warm-up"), |r| {
                let mut out = poisoned(&groups[r], m * n);
                gemm_all_reduce(
                    &groups[r],
                    &xs[r],
                    &ws[r],
                    Epilogue::default(),
                    &mut out,
                    shape,
                )
                .map(|_| ())
            });
            let mut graphs = Vec::new();
            for r in 0..world {
                let (res, out) = (&mut residuals[r], &mut outs[r]);
                let (graph, enqueued) = capture_on(groups[r].stream(), label, || {
                    let epilogue = Epilogue {
                        bias: None,
                        residual: Some(&mut *res as &mut dyn DevicePtrMut<T>),
                        norm: Some(RmsNorm {
                            gamma: &gammas[r],
                            eps: EPS,
                        }),
                    };
                    gemm_all_reduce(&groups[r], &xs[r], &ws[r], epilogue, &mut *out, shape)
                });
                enqueued.unwrap_or_else(|e| panic!("{label}: rank {r} during the capture: {e}"));
                graphs.push(graph);
            }
            for _ in 0..replays {
                launch_all(&graphs, label);
            }
            check_all(&groups, label);
        } else {
            for i in 0..replays {
                round(&groups, &format!("{label}: eager call {i}"), |r| {
                    gemm(
                        groups[r].stream(),
                        &xs[r],
                        &ws[r],
                        None,
                        None,
                        &mut partials[r],
                        m,
                        n,
                        k,
                    )?;
                    let epilogue = Epilogue {
                        bias: None,
                        residual: Some(&mut residuals[r]),
                        norm: Some(RmsNorm {
                            gamma: &gammas[r],
                            eps: EPS,
                        }),
                    };
                    ops::all_reduce_fused(
                        &groups[r],
                        &partials[r],
                        epilogue,
                        &mut outs[r],
                        Algorithm::OneShot,
                    )
                    .map(|_| ())
                });
            }
        }
        let out: Vec<Vec<T>> = (0..world).map(|r| download(&groups[r], &outs[r])).collect();
        let res: Vec<Vec<T>> = (0..world)
            .map(|r| download(&groups[r], &residuals[r]))
            .collect();
        finals.push((out, res));
    }
    for r in 0..world {
        assert_same_bits(
            &format!("{label} rank {r}: out"),
            &finals[0].0[r],
            &finals[1].0[r],
        );
        assert_same_bits(
            &format!("{label} rank {r}: residual"),
            &finals[0].1[r],
            &finals[1].1[r],
        );
    }
    // The residual grew by 100 sums: it moved from where it started.
    assert!(finals[0].1[0]
        .iter()
        .zip(&c.residual)
        .any(|(a, b)| a.to_bits() != b.to_bits()));
}

fn bad_calls() {
    type T = bf16;
    let gpu = gpu();
    // A capacity of 4 KiB: messages past 2 KiB cannot be fused.
    let options = GroupOptions {
        capacity_bytes: 4096,
        ..GroupOptions::default()
    };
    let groups = virtual_group(&gpu.ctx, 2, options);
    let g = &groups[0];
    let (m, n, k) = (4, 512, 64);
    let shape = GemmShape { m, n, k };
    let x = poisoned::<T>(g, m * k);
    let w = poisoned::<T>(g, n * k);
    let mut out = poisoned::<T>(g, m * n);
    let too_big = gemm_all_reduce(g, &x, &w, Epilogue::default(), &mut out, shape);
    expect_invalid_saying("capacity", too_big, "out", &["capacity"]);

    let small = GemmShape { m: 1, n, k };
    let x1 = poisoned::<T>(g, k);
    let mut out1 = poisoned::<T>(g, n);
    let gamma = poisoned::<T>(g, n - 8);
    let epilogue = Epilogue {
        bias: None,
        residual: None,
        norm: Some(RmsNorm {
            gamma: &gamma,
            eps: EPS,
        }),
    };
    let bad_gamma = gemm_all_reduce(g, &x1, &w, epilogue, &mut out1, small);
    expect_invalid_saying("gamma", bad_gamma, "gamma", &["504", "512"]);

    // A layer: forced fusion of a message over half the capacity is an error naming the
    // layer; Auto falls back to the GEMM and the all-reduce (NCCL-less virtual ranks: the
    // custom kernels, which take up to the whole capacity).
    let spec = RowParallelSpec::new("o_proj", 2 * k, n, 2).expect("spec");
    let full = random_vec::<T>(7, n * 2 * k, -0.1, 0.1);
    let layers: Vec<RowParallelLinear<T>> = groups
        .iter()
        .map(|g| {
            RowParallelLinear::from_host(g, spec.clone(), HostWeight::new(&full, n, 2 * k), None)
                .expect("layer")
        })
        .collect();
    let m2 = 3; // 3 x 512 x 2 bytes = 3 KiB: over 2 KiB, within 4 KiB
    let xs: Vec<CudaSlice<T>> = groups.iter().map(|g| poisoned(g, m2 * k)).collect();
    let mut parts: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m2 * n);
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m2 * n);
    let forced =
        RowParallelLinear::from_host(g, spec.clone(), HostWeight::new(&full, n, 2 * k), None)
            .expect("layer")
            .with_fusion(Fusion::Fused)
            .forward(g, &xs[0], Some(&mut parts[0]), &mut outs[0]);
    expect_invalid_saying(
        "forced",
        forced,
        "row-parallel 'o_proj'",
        &["forces the fused", "capacity"],
    );
    let ran = round(&groups, "auto falls back", |r| {
        layers[r].forward(&groups[r], &xs[r], Some(&mut parts[r]), &mut outs[r])
    });
    assert!(matches!(ran[0], RowParallelPath::Unfused(_)), "{ran:?}");

    let wrong_x = gemm_all_reduce(g, &x, &w, Epilogue::default(), &mut out1, small);
    expect_invalid_saying("x", wrong_x, "x", &["m * k"]);
    // Nothing was written.
    check_all(&groups[..1], "bad calls");
    assert!(download(g, &out1)
        .iter()
        .all(|v| v.bits() == T::poison().bits()));
}
