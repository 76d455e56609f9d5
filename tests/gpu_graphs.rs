//! GPU tests of CUDA-graph capture of what an engine captures for a decode step, beyond the
//! bare all-reduce that `gpu_all_reduce` replays (feature `gpu-tests`, or `emulator` on the
//! CPU; with neither every test here is listed as ignored): the GEMM in every configuration,
//! a row-parallel layer with the fused residual add + RMSNorm, and a column-parallel layer
//! with its all-gather and strided copies, on virtual ranks W = 2, 4.
//!
//! cudarc's event tracking is off for every buffer here, as in an engine that captures graphs:
//! with it, a buffer used in a capture carries events last recorded in the capture, and CUDA
//! refuses to wait for those outside it (CUDA_ERROR_CAPTURED_EVENT; the emulator refuses as
//! well). Each op runs eagerly once (modules load outside the capture), is captured on every rank,
//! and is then replayed with fresh inputs written into the captured buffers at every
//! checkpoint (outputs poisoned first); after each replay the outputs must equal, bit for
//! bit, an eager call on the same inputs into other buffers. The last checkpoint replays
//! [`REPLAYS`] times on the same inputs first.

mod common;
use common::gpu::{
    assert_failed, assert_poisoned, base_seed, mix_seed, random_vec, splitmix64, upload,
};
use common::graphs::{capture_on, launch_all};
use common::ranks::{
    check_all, download, download_ranks, gpu, poisoned, poisoned_ranks, refill, round,
    upload_copies, upload_ranks, virtual_group,
};
use common::{assert_same_bits, device_clock, shape, Bits};

use cudarc::driver::{CudaGraph, CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use tpfuse::ops::gemm::{gemm_with_config, GemmConfig, GemmShape};
use tpfuse::ops::{self, Algorithm, ColumnParallelLinear, Epilogue, RmsNorm, RowParallelLinear};
use tpfuse::shard::{ColumnParallelSpec, HostWeight, RowParallelSpec};
use tpfuse::{Error, GroupOptions, TpGroup};

type T = bf16;
const WORLDS: [usize; 2] = [2, 4];
/// Checkpoints: fresh inputs, one replay, compared with an eager call.
const CHECKPOINTS: usize = 3;
/// Replays before the last comparison.
const REPLAYS: usize = shape(200, 20);
const EPS: f32 = 1e-5;

fn seed(parts: &[u64]) -> u64 {
    mix_seed(splitmix64(base_seed(0x7470_6675_7365_96a9)), parts)
}

fn random(seed: u64, n: usize, scale: f32) -> Vec<T> {
    random_vec(seed, n, -scale, scale)
}

/// Replays per checkpoint: once, except `REPLAYS` times at the last.
fn replays(checkpoint: usize) -> usize {
    if checkpoint + 1 == CHECKPOINTS {
        REPLAYS
    } else {
        1
    }
}

/// Every rank's graph launched `times` times, then `check()` on every rank.
fn replay(groups: &[TpGroup], graphs: &[CudaGraph], times: usize, label: &str) {
    for _ in 0..times {
        launch_all(graphs, label);
    }
    check_all(groups, label);
}

fn poison_all(groups: &[TpGroup], bufs: &mut [CudaSlice<T>], n: usize) {
    let poison = vec![T::poison(); n];
    for (g, b) in groups.iter().zip(bufs.iter_mut()) {
        refill(g, b, &poison);
    }
}

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn gemm_configurations_replay_in_a_cuda_graph() {
    // The GPU lock: a capture open while another test of this binary synchronises the context
    // (building virtual ranks does) fails that test with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED.
    let gpu = gpu();
    let ctx = &gpu.ctx;
    // SAFETY: every buffer is used on this test's one stream (module docs).
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().expect("a stream");
    let shape = GemmShape {
        m: 17,
        n: 136,
        k: 264,
    };
    let GemmShape { m, n, k } = shape;
    let s = seed(&[1]);
    let mut a = upload(&stream, &random(s, m * k, 1.0));
    let b = upload(&stream, &random(s ^ 1, n * k, 0.1));
    let bias = upload(&stream, &random(s ^ 2, n, 0.5));
    let mut residual = upload(&stream, &random(s ^ 3, m * n, 1.0));
    let mut c = upload(&stream, &vec![T::poison(); m * n]);
    let mut eager = upload(&stream, &vec![T::poison(); m * n]);
    let parts = tpfuse::ops::gemm::split_parts_on(&stream, n, k).expect("the SM count");
    for config in GemmConfig::ALL
        .into_iter()
        .filter(|c| c.splits_k() || parts == 1)
    {
        let label = format!("graph gemm {} m={m} n={n} k={k}", config.name());
        let run = |out: &mut CudaSlice<T>, a: &CudaSlice<T>, residual: &CudaSlice<T>| {
            let bias = Some(&bias as &dyn DevicePtr<T>);
            let residual = Some(residual as &dyn DevicePtr<T>);
            gemm_with_config(&stream, a, &b, bias, residual, out, shape, config)
        };
        run(&mut eager, &a, &residual).unwrap_or_else(|e| panic!("{label}: eager: {e}"));
        let (graph, enqueued) = capture_on(&stream, &label, || run(&mut c, &a, &residual));
        enqueued.unwrap_or_else(|e| panic!("{label}: during the capture: {e}"));
        for checkpoint in 0..CHECKPOINTS {
            let cs = s ^ (checkpoint as u64 + 10) << 8;
            stream
                .memcpy_htod(&random(cs, m * k, 1.0), &mut a)
                .expect("new inputs");
            stream
                .memcpy_htod(&random(cs ^ 1, m * n, 1.0), &mut residual)
                .expect("new residual");
            stream
                .memcpy_htod(&vec![T::poison(); m * n], &mut c)
                .expect("poison");
            for _ in 0..replays(checkpoint) {
                graph
                    .launch()
                    .unwrap_or_else(|e| panic!("{label}: replay: {e}"));
            }
            run(&mut eager, &a, &residual).unwrap_or_else(|e| panic!("{label}: eager: {e}"));
            stream.synchronize().expect("the replays run");
            let got = stream.clone_dtoh(&c).expect("download");
            let want = stream.clone_dtoh(&eager).expect("download");
            assert_same_bits(&format!("{label} checkpoint {checkpoint}"), &got, &want);
        }
    }
}

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn row_parallel_layer_with_residual_rmsnorm_replays_in_a_cuda_graph() {
    let gpu = gpu();
    // SAFETY: every buffer is used on its rank's stream only (module docs).
    unsafe { gpu.ctx.disable_event_tracking() };
    let (inp, out, m) = (256usize, 128usize, 3usize);
    for world in WORLDS {
        let label = format!("graph row-parallel W={world}");
        let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
        let s = seed(&[2, world as u64]);
        let weight = random(s, out * inp, 0.1);
        let bias = random(s ^ 1, out, 0.5);
        let layers: Vec<RowParallelLinear<T>> = groups
            .iter()
            .map(|g| {
                let spec = RowParallelSpec::new("layers.0.o_proj", inp, out, world).expect("spec");
                RowParallelLinear::from_host(
                    g,
                    spec,
                    HostWeight::new(&weight, out, inp),
                    Some(&bias),
                )
                .expect("layer")
            })
            .collect();
        let per = inp / world;
        let gammas = upload_copies(&groups, &random(s ^ 2, out, 1.0));
        // The captured buffers, and the eager call's.
        let mut xs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * per);
        let mut residuals: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out);
        let mut partials: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out);
        let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out);
        let mut e_residuals: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out);
        let mut e_partials: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out);
        let mut e_outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out);
        let new_inputs = |xs: &mut [CudaSlice<T>], res: &mut [CudaSlice<T>], k: u64| {
            let cs = s ^ (k + 10) << 8;
            for (r, g) in groups.iter().enumerate() {
                refill(g, &mut xs[r], &random(cs ^ r as u64, m * per, 1.0));
                refill(g, &mut res[r], &random(cs ^ 0xff, m * out, 1.0));
            }
        };
        let forward = |r: usize,
                       x: &CudaSlice<T>,
                       partial: &mut CudaSlice<T>,
                       residual: &mut CudaSlice<T>,
                       out: &mut CudaSlice<T>| {
            let norm = RmsNorm {
                gamma: &gammas[r],
                eps: EPS,
            };
            layers[r].forward_residual_rmsnorm(&groups[r], x, Some(partial), residual, norm, out)
        };
        new_inputs(&mut xs, &mut residuals, 0);
        round(&groups, &format!("{label} eager warm-up"), |r| {
            forward(r, &xs[r], &mut partials[r], &mut residuals[r], &mut outs[r])
        });
        let graphs: Vec<CudaGraph> = (0..world)
            .map(|r| {
                let l = format!("{label} rank {r}");
                let (x, p, res, o) = (&xs[r], &mut partials[r], &mut residuals[r], &mut outs[r]);
                let (graph, enqueued) =
                    capture_on(groups[r].stream(), &l, || forward(r, x, p, res, o));
                enqueued.unwrap_or_else(|e| panic!("{l}: during the capture: {e}"));
                graph
            })
            .collect();
        for checkpoint in 0..CHECKPOINTS {
            let l = format!("{label} checkpoint {checkpoint}");
            let times = replays(checkpoint);
            // The residual is updated in place by every replay: the eager call starts from
            // what the last replay started from.
            new_inputs(&mut xs, &mut residuals, checkpoint as u64);
            if times > 1 {
                replay(&groups, &graphs, times - 1, &l);
            }
            for (r, g) in groups.iter().enumerate() {
                let before = download(g, &residuals[r]);
                refill(g, &mut e_residuals[r], &before);
            }
            poison_all(&groups, &mut outs, m * out);
            replay(&groups, &graphs, 1, &l);
            round(&groups, &format!("{l} eager"), |r| {
                forward(
                    r,
                    &xs[r],
                    &mut e_partials[r],
                    &mut e_residuals[r],
                    &mut e_outs[r],
                )
            });
            let got = download_ranks(&groups, &outs);
            let want = download_ranks(&groups, &e_outs);
            let got_res = download_ranks(&groups, &residuals);
            let want_res = download_ranks(&groups, &e_residuals);
            for r in 0..world {
                assert_same_bits(&format!("{l} rank {r} out"), &got[r], &want[r]);
                assert_same_bits(&format!("{l} rank {r} residual"), &got_res[r], &want_res[r]);
            }
        }
    }
}

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn column_parallel_gather_replays_in_a_cuda_graph() {
    let gpu = gpu();
    // SAFETY: every buffer is used on its rank's stream only (module docs).
    unsafe { gpu.ctx.disable_event_tracking() };
    let (k, n, m) = (128usize, 256usize, 5usize);
    for world in WORLDS {
        let label = format!("graph column-parallel gather W={world}");
        let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
        let s = seed(&[3, world as u64]);
        let weight = random(s, n * k, 0.1);
        let bias = random(s ^ 1, n, 0.5);
        let layers: Vec<ColumnParallelLinear<T>> = groups
            .iter()
            .map(|g| {
                let spec = ColumnParallelSpec::new("lm_head", k, n, world).expect("spec");
                ColumnParallelLinear::from_host(
                    g,
                    spec,
                    HostWeight::new(&weight, n, k),
                    Some(&bias),
                )
                .expect("layer")
            })
            .collect();
        let per = n / world;
        let mut xs: Vec<CudaSlice<T>> =
            upload_ranks(&groups, &vec![random(s ^ 2, m * k, 1.0); world]);
        let mut locals: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * per);
        let mut gathered: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
        let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
        let mut e_locals: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * per);
        let mut e_gathered: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
        let mut e_outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n);
        round(&groups, &format!("{label} eager warm-up"), |r| {
            layers[r].forward_gather(
                &groups[r],
                &xs[r],
                &mut locals[r],
                &mut gathered[r],
                &mut outs[r],
            )
        });
        let graphs: Vec<CudaGraph> = (0..world)
            .map(|r| {
                let l = format!("{label} rank {r}");
                let (x, lo, ga, o) = (&xs[r], &mut locals[r], &mut gathered[r], &mut outs[r]);
                let (graph, enqueued) = capture_on(groups[r].stream(), &l, || {
                    layers[r].forward_gather(&groups[r], x, lo, ga, o)
                });
                enqueued.unwrap_or_else(|e| panic!("{l}: during the capture: {e}"));
                graph
            })
            .collect();
        for checkpoint in 0..CHECKPOINTS {
            let l = format!("{label} checkpoint {checkpoint}");
            let x = random(s ^ (checkpoint as u64 + 10) << 8, m * k, 1.0);
            for (g, buf) in groups.iter().zip(xs.iter_mut()) {
                refill(g, buf, &x);
            }
            poison_all(&groups, &mut outs, m * n);
            replay(&groups, &graphs, replays(checkpoint), &l);
            round(&groups, &format!("{l} eager"), |r| {
                layers[r].forward_gather(
                    &groups[r],
                    &xs[r],
                    &mut e_locals[r],
                    &mut e_gathered[r],
                    &mut e_outs[r],
                )
            });
            let got = download_ranks(&groups, &outs);
            let want = download_ranks(&groups, &e_outs);
            for r in 0..world {
                assert_same_bits(&format!("{l} rank {r}"), &got[r], &want[r]);
                assert_same_bits(&format!("{l} rank {r} vs rank 0"), &got[r], &got[0]);
            }
        }
    }
}

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn a_group_poisoned_mid_graph_never_replays_a_stale_result() {
    let gpu = gpu();
    // SAFETY: every buffer is used on its rank's stream only (module docs).
    unsafe { gpu.ctx.disable_event_tracking() };
    let (world, m, hidden) = (2usize, 2usize, 256usize);
    let n = m * hidden;
    let timeout = std::time::Duration::from_millis(100);
    for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
        let label = format!("poisoned mid-graph {algo:?}");
        let options = GroupOptions {
            timeout,
            ..GroupOptions::default()
        };
        let groups = virtual_group(&gpu.ctx, world, options);
        let s = seed(&[4, algo as u64]);
        let xs = upload_ranks(
            &groups,
            &(0..world)
                .map(|r| random(s ^ r as u64, n, 1.0))
                .collect::<Vec<_>>(),
        );
        let gammas = upload_copies(&groups, &random(s ^ 0x10, hidden, 1.0));
        let mut residuals = upload_copies(&groups, &random(s ^ 0x20, n, 1.0));
        let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, n);
        let mut graphs = Vec::new();
        for r in 0..world {
            let l = format!("{label} rank {r}");
            let (res, out) = (&mut residuals[r], &mut outs[r]);
            let mut run = || {
                let epilogue = Epilogue {
                    bias: None,
                    residual: Some(&mut *res as &mut dyn DevicePtrMut<T>),
                    norm: Some(RmsNorm {
                        gamma: &gammas[r],
                        eps: EPS,
                    }),
                };
                ops::all_reduce_fused(&groups[r], &xs[r], epilogue, &mut *out, algo)
            };
            if r == 0 {
                // Modules load outside the capture: one eager call on every rank first.
                round(&groups, &format!("{l} warm-up"), |q| {
                    ops::all_reduce(&groups[q], &xs[q], &mut poisoned(&groups[q], n), algo)
                });
            }
            let (graph, enqueued) = capture_on(groups[r].stream(), &l, &mut run);
            enqueued.unwrap_or_else(|e| panic!("{l}: during the capture: {e}"));
            graphs.push(graph);
        }
        replay(&groups, &graphs, 1, &label);
        let good = download(&groups[0], &outs[0]);
        assert!(
            good.iter().all(|x| x.to_f32().is_finite()),
            "{label}: a healthy replay"
        );

        // Rank 1 stops replaying: rank 0's next replay times out. Its outputs are marked
        // failed (before the fix they kept the last replay's plausible values), and the host
        // learns of it from failure() without synchronising.
        graphs[0]
            .launch()
            .unwrap_or_else(|e| panic!("{label}: replay: {e}"));
        groups[0]
            .stream()
            .synchronize()
            .expect("rank 0's replay ends");
        match groups[0].failure() {
            Err(Error::PeerTimeout {
                rank: 0, peer: 1, ..
            }) => {}
            other => panic!("{label}: failure() on rank 0: expected PeerTimeout, got {other:?}"),
        }
        assert_failed(&format!("{label}: out"), &download(&groups[0], &outs[0]));
        assert_failed(
            &format!("{label}: residual"),
            &download(&groups[0], &residuals[0]),
        );
        // An eager call is refused before it launches.
        let mut spare = poisoned(&groups[0], n);
        match ops::all_reduce(&groups[0], &xs[0], &mut spare, algo) {
            Err(Error::GroupPoisoned(_)) => {}
            other => panic!("{label}: an eager call after the failure: {other:?}"),
        }
        assert_poisoned(
            &format!("{label}: the refused call's output"),
            &download(&groups[0], &spare),
        );
        // Every later replay, on either rank, fails at once and marks its outputs again.
        for r in 0..world {
            refill(&groups[r], &mut outs[r], &vec![T::poison(); n]);
            let start = device_clock();
            graphs[r]
                .launch()
                .unwrap_or_else(|e| panic!("{label}: replay on rank {r}: {e}"));
            groups[r].stream().synchronize().expect("the replay ends");
            assert!(
                device_clock() - start < timeout,
                "{label}: rank {r}: a replay on a poisoned group waited"
            );
            assert_failed(
                &format!("{label}: rank {r}'s later replay"),
                &download(&groups[r], &outs[r]),
            );
            assert!(groups[r].failure().is_err(), "{label}: rank {r}");
        }
    }
}
