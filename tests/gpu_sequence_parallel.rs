//! GPU tests of the layers' sequence-parallel forwards (feature `gpu-tests`, or `emulator` on
//! the CPU; with neither every test here is listed as ignored), on virtual ranks of GPU 0:
//! [`RowParallelLinear::forward_reduce_scatter`] (each rank gets its rows of the sum) and
//! [`ColumnParallelLinear::forward_all_gather`] /
//! [`MergedColumnParallelLinear::forward_all_gather`] (each rank holds its rows of the input),
//! fused and unfused ([`Fusion`]).
//!
//! - Row-parallel: rank r's `[m / W, out]` is bit for bit rows `r·m/W ..` of the plain
//!   `forward` (the same partials, the same rank-ordered f32 sum, one rounding), on every
//!   path; the fused path leaves `partial` untouched.
//! - Column-parallel (with a bias) and QKV: `[m, out / W]` is bit for bit `forward` on the
//!   whole input, on every path; the fused path leaves `gathered` untouched.
//! - `Fusion::Auto` fuses the all-gather + GEMM at these small `m` on virtual ranks and falls
//!   back to the unfused path when the gathered input does not fit the group's capacity; it
//!   never fuses the row-parallel GEMM + reduce-scatter (`FusionRule`: measured slower fused); `Fusion::Fused` on that shape,
//!   `m` not a multiple of W, a row-parallel layer with a bias and wrong lengths are errors
//!   naming the layer, with nothing written.
//!
//! Fresh random inputs per case, seeded from `TPFUSE_TEST_SEED` (a fixed default when unset);
//! outputs and workspaces are NaN first.

mod common;
use common::assert_same_bits;
use common::gpu::{
    assert_poisoned, base_seed, expect_invalid_saying, mix_seed, random_vec, splitmix64,
};
use common::ranks::{
    download, download_ranks, gpu, poisoned, poisoned_ranks, round, upload, upload_copies,
    virtual_group,
};

use cudarc::driver::{CudaContext, CudaSlice};
use half::{bf16, f16};
use std::sync::Arc;
use tpfuse::ops::gemm::GemmElement;
use tpfuse::ops::linear::{
    ColumnParallelLinear, Fusion, MergedColumnParallelLinear, RowParallelLinear,
    SequenceParallelPath,
};
use tpfuse::shard::{ColumnParallelSpec, HostWeight, MergedColumnSpec, RowParallelSpec};
use tpfuse::topology::FusedKernel;
use tpfuse::{GroupOptions, NcclType, TpGroup};

trait TestElement: common::gpu::TestElement + GemmElement + NcclType {}
impl TestElement for bf16 {}
impl TestElement for f16 {}

const FUSIONS: [Fusion; 3] = [Fusion::Unfused, Fusion::Fused, Fusion::Auto];

fn seed_of<T: TestElement>(parts: &[u64]) -> u64 {
    mix_seed(splitmix64(base_seed(0x5e9_0012) ^ T::ID), parts)
}

/// What a forward of `kernel` under `fusion` must have run for a shape the fused kernel
/// takes, at the small `m` of these tests (`Fusion::Auto` fuses the all-gather + GEMM on
/// virtual ranks, never the row-parallel GEMM + reduce-scatter).
fn expected_path(kernel: FusedKernel, fusion: Fusion) -> SequenceParallelPath {
    match (kernel, fusion) {
        (_, Fusion::Fused) | (FusedKernel::AllGather, Fusion::Auto) => SequenceParallelPath::Fused,
        _ => SequenceParallelPath::Unfused,
    }
}

/// Rows `r·m/W .. (r+1)·m/W` of a row-major `[m, n]`.
fn rows_of_rank<X: Copy>(y: &[X], world: usize, r: usize) -> Vec<X> {
    let per = y.len() / world;
    y[r * per..(r + 1) * per].to_vec()
}

fn row_case<T: TestElement>(ctx: &Arc<CudaContext>, world: usize, m: usize) {
    let (inp, out) = (64 * world, 136);
    let seed = seed_of::<T>(&[1, world as u64, m as u64]);
    let label = format!("row-parallel {} W={world} m={m} seed={seed:#x}", T::NAME);
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let scale = 2.0 / (inp as f32).sqrt();
    let weight: Vec<T> = random_vec(mix_seed(seed, &[1]), out * inp, -scale, scale);
    let x: Vec<T> = random_vec(mix_seed(seed, &[2]), m * inp, -1.0, 1.0);
    let mut layers: Vec<RowParallelLinear<T>> = groups
        .iter()
        .map(|g| {
            let spec = RowParallelSpec::new("attn.o_proj", inp, out, world).expect("spec");
            RowParallelLinear::from_host(g, spec, HostWeight::new(&weight, out, inp), None)
                .expect("layer")
        })
        .collect();
    // Rank r's columns of x.
    let per = inp / world;
    let xs: Vec<CudaSlice<T>> = groups
        .iter()
        .enumerate()
        .map(|(r, g)| {
            let cols: Vec<T> = x
                .chunks_exact(inp)
                .flat_map(|row| row[r * per..(r + 1) * per].to_vec())
                .collect();
            upload(g, &cols)
        })
        .collect();
    let mut partials: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out);
    let mut whole: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out);
    round(&groups, &format!("{label} forward"), |r| {
        layers[r].forward(&groups[r], &xs[r], Some(&mut partials[r]), &mut whole[r])
    });
    let whole = download_ranks(&groups, &whole);
    for fusion in FUSIONS {
        let label = format!("{label} {fusion:?}");
        layers = layers.into_iter().map(|l| l.with_fusion(fusion)).collect();
        let mut partials: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out);
        let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m / world * out);
        let ran = round(&groups, &label, |r| {
            layers[r].forward_reduce_scatter(
                &groups[r],
                &xs[r],
                Some(&mut partials[r]),
                &mut outs[r],
            )
        });
        for (r, g) in groups.iter().enumerate() {
            let at = format!("{label} rank {r}");
            assert_eq!(
                ran[r],
                expected_path(FusedKernel::RowParallel, fusion),
                "{at}: what ran"
            );
            assert_same_bits(
                &format!("{at}: its rows of forward"),
                &download(g, &outs[r]),
                &rows_of_rank(&whole[r], world, r),
            );
            if ran[r] == SequenceParallelPath::Fused {
                assert_poisoned(&format!("{at}: partial"), &download(g, &partials[r]));
            }
        }
    }
}

/// Each rank's rows of `x` `[m, inp]`, on its device.
fn own_rows<T: TestElement>(groups: &[TpGroup], x: &[T]) -> Vec<CudaSlice<T>> {
    let world = groups.len();
    groups
        .iter()
        .enumerate()
        .map(|(r, g)| upload(g, &rows_of_rank(x, world, r)))
        .collect()
}

/// A column-parallel layer with a bias and a QKV layer: `forward_all_gather` on each rank's
/// rows against `forward` on the whole input, every fusion.
fn column_case<T: TestElement>(ctx: &Arc<CudaContext>, world: usize, m: usize) {
    let (hidden, out, head_dim) = (128, 96 * world, 16);
    let (q_heads, kv_heads) = (2 * world, world);
    let qkv_out = (q_heads + 2 * kv_heads) * head_dim;
    let seed = seed_of::<T>(&[2, world as u64, m as u64]);
    let label = format!("column-parallel {} W={world} m={m} seed={seed:#x}", T::NAME);
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let scale = 2.0 / (hidden as f32).sqrt();
    let w: Vec<T> = random_vec(mix_seed(seed, &[1]), out * hidden, -scale, scale);
    let bias: Vec<T> = random_vec(mix_seed(seed, &[2]), out, -1.0, 1.0);
    let w_qkv: Vec<T> = random_vec(mix_seed(seed, &[3]), qkv_out * hidden, -scale, scale);
    let x: Vec<T> = random_vec(mix_seed(seed, &[4]), m * hidden, -1.0, 1.0);
    let mut columns: Vec<ColumnParallelLinear<T>> = groups
        .iter()
        .map(|g| {
            let spec = ColumnParallelSpec::new("mlp.up_proj", hidden, out, world).expect("spec");
            let weight = HostWeight::new(&w, out, hidden);
            ColumnParallelLinear::from_host(g, spec, weight, Some(&bias)).expect("layer")
        })
        .collect();
    let mut qkvs: Vec<MergedColumnParallelLinear<T>> = groups
        .iter()
        .map(|g| {
            let spec =
                MergedColumnSpec::qkv("attn.qkv_proj", hidden, head_dim, q_heads, kv_heads, world)
                    .expect("spec");
            let weight = HostWeight::new(&w_qkv, qkv_out, hidden);
            MergedColumnParallelLinear::from_host(g, spec, weight, None).expect("layer")
        })
        .collect();
    let whole_x: Vec<CudaSlice<T>> = upload_copies(&groups, &x);
    let xs = own_rows(&groups, &x);
    let (n_col, n_qkv) = (out / world, qkv_out / world);
    let mut want_col: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n_col);
    let mut want_qkv: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n_qkv);
    round(&groups, &format!("{label} forward"), |r| {
        columns[r].forward(&groups[r], &whole_x[r], &mut want_col[r])?;
        qkvs[r].forward(&groups[r], &whole_x[r], &mut want_qkv[r])
    });
    let (want_col, want_qkv) = (
        download_ranks(&groups, &want_col),
        download_ranks(&groups, &want_qkv),
    );
    for fusion in FUSIONS {
        let label = format!("{label} {fusion:?}");
        columns = columns.into_iter().map(|l| l.with_fusion(fusion)).collect();
        qkvs = qkvs.into_iter().map(|l| l.with_fusion(fusion)).collect();
        let mut gathered: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * hidden);
        let mut col: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n_col);
        let mut qkv: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * n_qkv);
        let ran = round(&groups, &label, |r| {
            let a =
                columns[r].forward_all_gather(&groups[r], &xs[r], &mut gathered[r], &mut col[r])?;
            let b =
                qkvs[r].forward_all_gather(&groups[r], &xs[r], &mut gathered[r], &mut qkv[r])?;
            Ok((a, b))
        });
        for (r, g) in groups.iter().enumerate() {
            let at = format!("{label} rank {r}");
            assert_eq!(
                ran[r],
                (
                    expected_path(FusedKernel::AllGather, fusion),
                    expected_path(FusedKernel::AllGather, fusion)
                ),
                "{at}"
            );
            assert_same_bits(
                &format!("{at}: column-parallel"),
                &download(g, &col[r]),
                &want_col[r],
            );
            assert_same_bits(&format!("{at}: qkv"), &download(g, &qkv[r]), &want_qkv[r]);
            if fusion != Fusion::Unfused {
                assert_poisoned(&format!("{at}: gathered"), &download(g, &gathered[r]));
            }
        }
    }
}

gpu_tests! {
    /// Row-parallel GEMM + reduce-scatter: W 2, 4, 8; one row per rank and more.
    row_parallel_reduce_scatter_gives_each_rank_its_rows_of_forward => {
        let gpu = gpu();
        for (world, m) in [(2, 2), (2, 34), (4, 16), (8, 8), (8, 64)] {
            row_case::<bf16>(&gpu.ctx, world, m);
        }
        row_case::<f16>(&gpu.ctx, 4, 12);
    };
    /// All-gather + GEMM of the column-parallel and QKV layers: W 2, 4, 8.
    column_parallel_all_gather_equals_forward_on_the_whole_input => {
        let gpu = gpu();
        for (world, m) in [(2, 2), (2, 34), (4, 16), (8, 64)] {
            column_case::<bf16>(&gpu.ctx, world, m);
        }
        column_case::<f16>(&gpu.ctx, 4, 12);
    };
    /// Fallback, forced fusion that cannot run, and bad calls.
    sequence_parallel_bad_calls_are_refused_before_anything_runs => bad_calls();
}

fn bad_calls() {
    type T = bf16;
    let gpu = gpu();
    // A capacity of 64 KiB: the fused all-gather + GEMM takes a gathered [m, 128] of at most
    // 32 KiB (m ≤ 128).
    let options = GroupOptions {
        capacity_bytes: 64 << 10,
        ..GroupOptions::default()
    };
    let world = 2;
    let groups = virtual_group(&gpu.ctx, world, options);
    let (hidden, out) = (128, 64);
    let w: Vec<T> = random_vec(7, out * hidden, -0.1, 0.1);
    let columns: Vec<ColumnParallelLinear<T>> = groups
        .iter()
        .map(|g| {
            let spec = ColumnParallelSpec::new("mlp.up_proj", hidden, out, world).expect("spec");
            ColumnParallelLinear::from_host(g, spec, HostWeight::new(&w, out, hidden), None)
                .expect("layer")
        })
        .collect();
    let name = "column-parallel 'mlp.up_proj'";

    // m = 130 does not fit: Auto falls back (the same bits as forward), Fused is refused.
    let m = 130;
    let x: Vec<T> = random_vec(8, m * hidden, -1.0, 1.0);
    let xs = own_rows(&groups, &x);
    let whole_x: Vec<CudaSlice<T>> = upload_copies(&groups, &x);
    let mut want: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out / world);
    round(&groups, "forward", |r| {
        columns[r].forward(&groups[r], &whole_x[r], &mut want[r])
    });
    let mut gathered: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * hidden);
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * out / world);
    let ran = round(&groups, "Auto over capacity", |r| {
        columns[r].forward_all_gather(&groups[r], &xs[r], &mut gathered[r], &mut outs[r])
    });
    for (r, g) in groups.iter().enumerate() {
        assert_eq!(
            ran[r],
            SequenceParallelPath::Unfused,
            "rank {r}: the fallback"
        );
        assert_same_bits(
            &format!("fallback rank {r}"),
            &download(g, &outs[r]),
            &download(g, &want[r]),
        );
    }
    let spec = ColumnParallelSpec::new("mlp.up_proj", hidden, out, world).expect("spec");
    let forced =
        ColumnParallelLinear::from_host(&groups[0], spec, HostWeight::new(&w, out, hidden), None)
            .expect("layer")
            .with_fusion(Fusion::Fused);
    let mut out0 = poisoned::<T>(&groups[0], m * out / world);
    let mut g0 = poisoned::<T>(&groups[0], m * hidden);
    let err = forced.forward_all_gather(&groups[0], &xs[0], &mut g0, &mut out0);
    expect_invalid_saying(
        "forced fusion over capacity",
        err,
        name,
        &["forces the fused all-gather + GEMM", "[130, 128]"],
    );
    assert_poisoned("forced: out", &download(&groups[0], &out0));
    assert_poisoned("forced: gathered", &download(&groups[0], &g0));

    // A wrong gathered workspace, on either path.
    let mut short = poisoned::<T>(&groups[0], m * hidden - 8);
    let err = columns[0].forward_all_gather(&groups[0], &xs[0], &mut short, &mut out0);
    expect_invalid_saying("short gathered", err, name, &["gathered", "[130, 128]"]);
    assert_poisoned("short gathered: out", &download(&groups[0], &out0));

    // Row-parallel: m not a multiple of W, and a bias.
    let (inp, n) = (128, 64);
    let wr: Vec<T> = random_vec(9, n * inp, -0.1, 0.1);
    let bias: Vec<T> = random_vec(10, n, -0.1, 0.1);
    let spec = RowParallelSpec::new("attn.o_proj", inp, n, world).expect("spec");
    let row =
        RowParallelLinear::from_host(&groups[0], spec.clone(), HostWeight::new(&wr, n, inp), None)
            .expect("layer");
    let row_name = "row-parallel 'attn.o_proj'";
    let x3 = poisoned::<T>(&groups[0], 3 * inp / world);
    let mut partial = poisoned::<T>(&groups[0], 3 * n);
    let mut out3 = poisoned::<T>(&groups[0], n);
    let err = row.forward_reduce_scatter(&groups[0], &x3, Some(&mut partial), &mut out3);
    expect_invalid_saying(
        "m = 3 on 2 ranks",
        err,
        row_name,
        &["m = 3", "2 equal slices"],
    );
    let biased =
        RowParallelLinear::from_host(&groups[0], spec, HostWeight::new(&wr, n, inp), Some(&bias))
            .expect("layer");
    let x2 = poisoned::<T>(&groups[0], 2 * inp / world);
    let mut partial2 = poisoned::<T>(&groups[0], 2 * n);
    let err = biased.forward_reduce_scatter(&groups[0], &x2, Some(&mut partial2), &mut out3);
    expect_invalid_saying("a bias", err, row_name, &["has a bias"]);
    assert_poisoned("row: out", &download(&groups[0], &out3));
    assert_poisoned("row: partial", &download(&groups[0], &partial2));

    // An unfused call whose reduce-scatter cannot run (m = 520 rows of 64 stage 65 KiB, past
    // the 64 KiB capacity, and virtual ranks have no NCCL): refused before its GEMM writes the
    // partial workspace.
    let m = 520;
    let unfused = row.with_fusion(Fusion::Unfused);
    let xm = poisoned::<T>(&groups[0], m * inp / world);
    let mut partial_m = poisoned::<T>(&groups[0], m * n);
    let mut out_m = poisoned::<T>(&groups[0], m / world * n);
    let err = unfused.forward_reduce_scatter(&groups[0], &xm, Some(&mut partial_m), &mut out_m);
    expect_invalid_saying(
        "reduce-scatter over capacity",
        err,
        row_name,
        &["partial:", "capacity"],
    );
    assert_poisoned("over capacity: partial", &download(&groups[0], &partial_m));
    assert_poisoned("over capacity: out", &download(&groups[0], &out_m));
}
