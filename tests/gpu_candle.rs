//! The candle adapter on two virtual ranks of GPU 0. Built only with the `candle` feature
//! (`required-features`): `cargo test --release --features candle,gpu-tests --test gpu_candle`
//! on a machine with candle's CUDA build (CUDA_COMPUTE_CAP set where nvidia-smi is missing).
//! The GPU bundle (scripts/gpu-bundle.sh) does not carry it: candle's kernels take tens of
//! minutes to build here and candle links CUDA libraries the bundle does not ship.
//!
//! - the all-reduce of candle tensors, into a new tensor and in place, at an offset inside a
//!   larger storage, with the group on tpfuse's streams (the op joins candle's) and on candle's
//!   own streams (no join), and from one thread per rank on candle's per-thread streams
//!   (`Device::new_cuda`): exact sums of small integers;
//! - the all-reduce + residual + RMSNorm and both row-parallel forwards give the bits of the
//!   same tpfuse ops on cudarc buffers (the residual updated in place, leading dimensions kept),
//!   fused and unfused, every operand at an offset in its storage, the weight borrowed from a
//!   candle tensor (`Weight`);
//! - bad input is a candle error naming the op and what is wrong, before anything runs.
//!
//! candle's devices here have cudarc's event tracking turned off (as candle's
//! `Device::new_cuda` has it in effect): the adapter's joins, not cudarc's events, are then
//! what orders candle's stream and the group's, so a missing join shows.
//!
//! Not on the emulator: candle's CUDA backend (its nvcc-built kernels, cuBLAS, cuRAND and
//! NVRTC, linked by candle-core) needs a GPU.

mod common;

use candle_core::{DType, Device, Tensor};
use common::gpu::{base_seed, mix_seed, random_vec, splitmix64};
use common::ranks::{download, gpu, upload};
use half::bf16;
use std::sync::{Arc, Barrier};
use tpfuse::candle::{
    all_reduce, all_reduce_in_place, all_reduce_residual_rmsnorm, row_parallel,
    row_parallel_residual_rmsnorm, Weight,
};
use tpfuse::ops::linear::{Fusion, RowParallelLinear};
use tpfuse::ops::RmsNorm;
use tpfuse::shard::{HostWeight, RowParallelSpec};
use tpfuse::{GroupOptions, TpGroup};

type T = bf16;
const WORLD: usize = 2;

/// One candle device per rank, each on a stream of its own, event tracking off.
fn candle_devices() -> Vec<Device> {
    (0..WORLD)
        .map(|_| {
            let device = Device::new_cuda_with_stream(0).expect("a candle device");
            // SAFETY: before any tensor of the device exists; the adapter orders the streams.
            unsafe {
                device
                    .as_cuda_device()
                    .expect("CUDA")
                    .disable_event_tracking()
            };
            device
        })
        .collect()
}

fn candle_stream(device: &Device) -> Arc<cudarc::driver::CudaStream> {
    device
        .as_cuda_device()
        .expect("a CUDA device")
        .cuda_stream()
}

/// Small integers in [-8, 8]: their sums are exact in bf16 whatever the order.
fn integers(seed: u64, rank: usize, n: usize) -> Vec<T> {
    (0..n)
        .map(|i| T::from_f32((splitmix64(seed ^ (rank * n + i) as u64) % 17) as f32 - 8.0))
        .collect()
}

/// The sum over ranks as the kernels make it (f32 in rank order, rounded once).
fn exact_sum(inputs: &[Vec<T>]) -> Vec<T> {
    let refs: Vec<&[T]> = inputs.iter().map(Vec::as_slice).collect();
    tpfuse::reference::reduce_ranks_exact(&refs)
}

fn host(t: &Tensor) -> Vec<T> {
    t.flatten_all().and_then(|t| t.to_vec1()).expect("download")
}

fn expect_error(result: candle_core::Result<impl std::fmt::Debug>, says: &[&str]) {
    let message = format!("{}", result.expect_err("an error"));
    for s in says {
        assert!(message.contains(s), "{message:?} does not say {s:?}");
    }
}

/// `host` (`lead` rows of `row` elements after one extra leading block) as a tensor of shape
/// `[lead.., row]` that starts one block into its storage, and the values it holds.
fn at_offset(device: &Device, host: &[T], shape: &[usize]) -> (Tensor, Vec<T>) {
    let block: usize = shape.iter().product();
    assert_eq!(host.len(), 2 * block);
    let mut full = vec![2];
    full.extend_from_slice(shape);
    let t = Tensor::from_vec(host.to_vec(), full, device).expect("upload");
    let t = t
        .narrow(0, 1, 1)
        .and_then(|t| t.squeeze(0))
        .expect("narrow");
    assert_eq!(
        t.layout().start_offset(),
        block,
        "the tensor starts inside its storage"
    );
    (t, host[block..].to_vec())
}

/// The all-reduces on every rank: a `[3, 256]` slice at row 1 of a `[5, 256]` tensor, summed
/// into a new tensor and in place.
fn check_all_reduce(groups: &[TpGroup], devices: &[Device], seed: u64) {
    let (rows, hidden) = (3, 256);
    let inputs: Vec<Vec<T>> = (0..WORLD).map(|r| integers(seed, r, 5 * hidden)).collect();
    let want = exact_sum(&inputs)[hidden..4 * hidden].to_vec();
    let xs: Vec<Tensor> = devices
        .iter()
        .zip(&inputs)
        .map(|(d, h)| Tensor::from_vec(h.clone(), (5, hidden), d).expect("upload"))
        .map(|t| t.narrow(0, 1, rows).expect("narrow"))
        .collect();
    let summed: Vec<Tensor> = groups
        .iter()
        .zip(&xs)
        .map(|(g, x)| all_reduce(g, x).expect("all_reduce"))
        .collect();
    for (g, x) in groups.iter().zip(&xs) {
        all_reduce_in_place(g, x).expect("all_reduce_in_place");
    }
    for r in 0..WORLD {
        // Read on candle's stream, with no synchronisation of the group's: the op's join orders it.
        assert_eq!(summed[r].dims(), &[rows, hidden]);
        assert_eq!(host(&summed[r]), want, "rank {r}: all_reduce");
        assert_eq!(host(&xs[r]), want, "rank {r}: all_reduce_in_place");
        groups[r].check().expect("check");
    }
}

gpu_only_tests! {
    "needs a CUDA GPU: candle's CUDA backend (kernels, cuBLAS, cuRAND) is not on the emulator" => {
    all_reduce_of_candle_tensors_joins_or_shares_candles_stream => {
        let gpu = gpu();
        let seed = mix_seed(base_seed(0xca11), &[1]);
        // The group on tpfuse's own streams: each op joins candle's stream.
        let devices = candle_devices();
        let groups = TpGroup::virtual_ranks(&gpu.ctx, WORLD, GroupOptions::default()).expect("group");
        check_all_reduce(&groups, &devices, seed);
        // The group on candle's streams: nothing to join.
        let devices = candle_devices();
        let streams: Vec<_> = devices.iter().map(candle_stream).collect();
        let groups = TpGroup::virtual_ranks_on(&streams, GroupOptions::default()).expect("group");
        check_all_reduce(&groups, &devices, seed ^ 1);
    };

    all_reduce_from_one_thread_per_rank_on_candles_per_thread_streams => {
        let gpu = gpu();
        let seed = mix_seed(base_seed(0xca12), &[2]);
        let groups = TpGroup::virtual_ranks(&gpu.ctx, WORLD, GroupOptions::default()).expect("group");
        let n = 4096;
        let inputs: Vec<Vec<T>> = (0..WORLD).map(|r| integers(seed, r, n)).collect();
        let want = exact_sum(&inputs);
        // Every thread's candle setup (device, upload) is done before any rank's collective
        // spins: a first-time load there could otherwise wait for a peer's running kernel.
        let ready = Barrier::new(WORLD);
        std::thread::scope(|s| {
            for (g, input) in groups.iter().zip(&inputs) {
                let (want, ready) = (&want, &ready);
                s.spawn(move || {
                    let device = Device::new_cuda(0).expect("candle's per-thread device");
                    let x = Tensor::from_vec(input.clone(), n, &device).expect("upload");
                    assert_eq!(&host(&x), input, "the upload");
                    ready.wait();
                    all_reduce_in_place(g, &x).expect("all_reduce_in_place");
                    // Read back on candle's stream: ordered after the group's by the op.
                    assert_eq!(&host(&x), want, "rank {}", g.rank());
                });
            }
        });
        for g in &groups {
            g.check().expect("check");
        }
    };

    residual_rmsnorm_gives_the_bits_of_the_cudarc_op => {
        let gpu = gpu();
        let seed = mix_seed(base_seed(0xca13), &[3]);
        let hidden = 512;
        let devices = candle_devices();
        let groups = TpGroup::virtual_ranks(&gpu.ctx, WORLD, GroupOptions::default()).expect("group");
        let gamma_h: Vec<T> = random_vec(seed ^ 7, 2 * hidden, 0.5, 1.5);
        let (shape, len) = ([2, 3, hidden], 6 * hidden);
        let ranks: Vec<_> = (0..WORLD)
            .map(|r| {
                let d = &devices[r];
                let partial = at_offset(d, &random_vec(seed ^ r as u64, 2 * len, -1.0, 1.0), &shape);
                let residual = at_offset(d, &random_vec(seed ^ 99, 2 * len, -1.0, 1.0), &shape);
                let gamma = at_offset(d, &gamma_h, &[hidden]);
                (partial, residual, gamma)
            })
            .collect();
        // The same op on cudarc buffers, every buffer uploaded first.
        let mut want: Vec<_> = groups
            .iter()
            .zip(&ranks)
            .map(|(g, ((_, p), (_, res), (_, gam)))| {
                (upload(g, p), upload(g, res), upload(g, gam), upload(g, &vec![T::ZERO; len]))
            })
            .collect();
        let normed: Vec<Tensor> = groups
            .iter()
            .zip(&ranks)
            .map(|(g, ((partial, _), (residual, _), (gamma, _)))| {
                all_reduce_residual_rmsnorm(g, partial, residual, gamma, 1e-5).expect("op")
            })
            .collect();
        for (g, (partial, residual, gamma, out)) in groups.iter().zip(&mut want) {
            tpfuse::ops::all_reduce_residual_rmsnorm(g, &*partial, residual, &*gamma, 1e-5, out)
                .expect("cudarc op");
        }
        for (r, g) in groups.iter().enumerate() {
            assert_eq!(normed[r].dims(), &shape);
            assert_eq!(host(&normed[r]), download(g, &want[r].3), "rank {r}: normed");
            assert_eq!(host(&ranks[r].1 .0), download(g, &want[r].1), "rank {r}: residual");
            g.check().expect("check");
        }
    };

    row_parallel_forwards_give_the_bits_of_the_layer_fused_and_unfused => {
        let gpu = gpu();
        let seed = mix_seed(base_seed(0xca14), &[4]);
        let (inf, outf) = (1024, 512);
        let cols = inf / WORLD;
        let devices = candle_devices();
        let groups = TpGroup::virtual_ranks(&gpu.ctx, WORLD, GroupOptions::default()).expect("group");
        let full: Vec<T> = random_vec(seed, outf * inf, -0.05, 0.05);
        let gamma_h: Vec<T> = random_vec(seed ^ 5, 2 * outf, 0.5, 1.5);
        for fusion in [Fusion::Fused, Fusion::Unfused] {
            let mut per_rank = Vec::new();
            for (r, g) in groups.iter().enumerate() {
                let d = &devices[r];
                let spec = RowParallelSpec::new("down", inf, outf, WORLD).expect("spec");
                let shard = spec.shard_weight(r, HostWeight::new(&full, outf, inf)).expect("shard");
                let (w, _) = at_offset(d, &[shard.clone(), shard].concat(), &[outf, cols]);
                let borrowed = RowParallelLinear::from_shard(
                    g,
                    spec.clone(),
                    Weight::<T>::new(g, &w).expect("weight"),
                    None,
                )
                .expect("layer over the candle tensor")
                .with_fusion(fusion);
                let owned = RowParallelLinear::from_host(g, spec, HostWeight::new(&full, outf, inf), None)
                    .expect("layer")
                    .with_fusion(fusion);
                let x = at_offset(d, &random_vec(seed ^ 11 ^ r as u64, 12 * cols, -1.0, 1.0), &[2, 3, cols]);
                let residual = at_offset(d, &random_vec(seed ^ 13, 12 * outf, -1.0, 1.0), &[2, 3, outf]);
                let gamma = at_offset(d, &gamma_h, &[outf]);
                per_rank.push((borrowed, owned, x, residual, gamma));
            }
            // The reference's buffers, uploaded before any collective is enqueued.
            let m = 6;
            let mut refs: Vec<_> = groups
                .iter()
                .zip(&per_rank)
                .map(|(g, (_, _, (_, xh), (_, res), (_, gam)))| {
                    let zeros = vec![T::ZERO; m * outf];
                    let bufs = [upload(g, xh), upload(g, res), upload(g, gam)];
                    (bufs, [upload(g, &zeros), upload(g, &zeros), upload(g, &zeros)])
                })
                .collect();
            let outs: Vec<Tensor> = groups
                .iter()
                .zip(&per_rank)
                .map(|(g, (layer, _, (x, _), ..))| row_parallel(g, layer, x).expect("row_parallel"))
                .collect();
            let normed: Vec<Tensor> = groups
                .iter()
                .zip(&per_rank)
                .map(|(g, (layer, _, (x, _), (residual, _), (gamma, _)))| {
                    row_parallel_residual_rmsnorm(g, layer, x, residual, gamma, 1e-5).expect("op")
                })
                .collect();
            for (g, ((_, owned, ..), ([x, residual, gamma], [partial, out, n]))) in
                groups.iter().zip(per_rank.iter().zip(&mut refs))
            {
                owned.forward(g, &*x, Some(&mut *partial), out).expect("forward");
                let norm = RmsNorm { gamma: &*gamma, eps: 1e-5 };
                owned
                    .forward_residual_rmsnorm(g, &*x, Some(&mut *partial), residual, norm, n)
                    .expect("forward_residual_rmsnorm");
            }
            for (r, g) in groups.iter().enumerate() {
                let label = format!("rank {r}, {fusion:?}");
                let ([_, residual, _], [_, out, n]) = &refs[r];
                assert_eq!(outs[r].dims(), &[2, 3, outf], "{label}");
                assert_eq!(host(&outs[r]), download(g, out), "{label}: row_parallel");
                assert_eq!(host(&per_rank[r].3 .0), download(g, residual), "{label}: residual");
                assert_eq!(host(&normed[r]), download(g, n), "{label}: normed");
                g.check().expect("check");
            }
        }
    };

    bad_candle_input_is_an_error_naming_the_op => {
        let gpu = gpu();
        let devices = candle_devices();
        let groups = TpGroup::virtual_ranks(&gpu.ctx, WORLD, GroupOptions::default()).expect("group");
        let (g, d) = (&groups[0], &devices[0]);
        let zeros = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, d).expect("zeros");
        let op = "tpfuse::candle::all_reduce";
        let cpu = Tensor::zeros((4, 256), DType::BF16, &Device::Cpu).expect("cpu");
        expect_error(all_reduce(g, &cpu), &[op, "CUDA tensors only"]);
        expect_error(all_reduce(g, &zeros(&[4, 256], DType::U32)), &[op, "U32"]);
        let t = zeros(&[8, 256], DType::BF16).t().expect("t");
        expect_error(all_reduce(g, &t), &[op, "contiguous"]);
        let odd = zeros(&[1024], DType::BF16).narrow(0, 1, 256).expect("narrow");
        expect_error(all_reduce(g, &odd), &[op, "x", "2 bytes", "16 bytes"]);

        let op = "all_reduce_residual_rmsnorm";
        let x = zeros(&[4, 256], DType::BF16);
        let res = x.copy().expect("copy");
        let gamma = zeros(&[256], DType::BF16);
        expect_error(
            all_reduce_residual_rmsnorm(g, &x, &res, &zeros(&[128], DType::BF16), 1e-5),
            &[op, "gamma", "[128]", "[256]"],
        );
        expect_error(all_reduce_residual_rmsnorm(g, &x, &res, &gamma, f32::NAN), &[op, "eps"]);
        let f16x = zeros(&[4, 256], DType::F16);
        expect_error(all_reduce_residual_rmsnorm(g, &f16x, &res, &gamma, 1e-5), &[op, "partial", "F16"]);
        // A partial of another candle device (another stream) of the same GPU.
        let other = Tensor::zeros((4, 256), DType::BF16, &devices[1]).expect("other");
        expect_error(all_reduce_residual_rmsnorm(g, &other, &res, &gamma, 1e-5), &[op, "partial", "stream"]);

        let spec = RowParallelSpec::new("down", 512, 256, WORLD).expect("spec");
        let w = zeros(&[256, 256], DType::BF16);
        let layer = RowParallelLinear::from_shard(g, spec, Weight::<T>::new(g, &w).expect("weight"), None)
            .expect("layer");
        let narrow_x = x.narrow(1, 0, 200).and_then(|t| t.contiguous()).expect("x");
        expect_error(row_parallel(g, &layer, &narrow_x), &["row_parallel", "down", "[.., 256]"]);
        let f32x = zeros(&[4, 256], DType::F32);
        expect_error(row_parallel(g, &layer, &f32x), &["row_parallel", "F32", "BF16"]);
        let op = "row_parallel_residual_rmsnorm";
        let f32res = zeros(&[4, 256], DType::F32);
        expect_error(
            row_parallel_residual_rmsnorm(g, &layer, &x, &f32res, &gamma, 1e-5),
            &[op, "residual", "F32", "down"],
        );
        let res3 = zeros(&[2, 2, 256], DType::BF16);
        expect_error(row_parallel_residual_rmsnorm(g, &layer, &x, &res3, &gamma, 1e-5), &[op, "residual", "[2, 2, 256]"]);
        expect_error(row_parallel_residual_rmsnorm(g, &layer, &x, &res, &gamma, -1.0), &[op, "eps"]);
        expect_error(Weight::<T>::new(g, &f32x), &["Weight", "F32"]);
        // The residual was never written: nothing ran.
        assert!(host(&res).iter().all(|v| *v == T::ZERO));
        g.check().expect("check");
    };
    }
}
