//! GPU tests of the standalone epilogue ([`ops::rms_norm`], [`ops::rms_norm_in_place`],
//! [`ops::add_bias_residual`]; feature `gpu-tests`, or `emulator` on the CPU; with neither
//! every test here is listed as ignored): the unfused baseline the fused all-reduce is
//! measured against, and the tail of the paths that cannot fuse (two-shot RMSNorm, NCCL).
//!
//! Every case uploads fresh random inputs (seeded per case from `TPFUSE_TEST_SEED`, a fixed
//! default when unset) and poisons every output with NaN first, then asserts
//! - RMSNorm within the bound of the fused tests against the f64 reference
//!   ([`rms_norm_f64`]): 2e-6 (f32; `rsqrtf` is accurate to 2 ulp), 2e-3 (f16), 1e-2 (bf16);
//!   in place gives the bits of out of place; more rows than one launch has blocks (4096)
//!   are all normalised (one dtype);
//! - bias + residual bit for bit equal to the exact emulation of its arithmetic (one rank of
//!   [`all_reduce_epilogue_exact`]: `x (+ bias[col]) + residual` in f32, rounded once), with
//!   the new residual written back;
//! - bad calls are typed errors naming the argument, and nothing is written.

mod common;
use common::gpu::{
    self, assert_close, assert_poisoned, base_seed, download, expect_invalid_saying, gpu_stream,
    mix_seed, poisoned, random_vec, upload,
};
use common::{assert_same_bits, shape};

use cudarc::driver::DevicePtr;
use half::{bf16, f16};
use tpfuse::ops;
use tpfuse::reference::{all_reduce_epilogue_exact, rms_norm_f64};

const EPS: f32 = 1e-5;
/// (rows, hidden) of the cases: one row, a few, a batch; hidden at one vector, off every
/// power of two, and a model's.
const SHAPES: [(usize, usize); 7] = [
    (1, 8),
    (1, 4104),
    (3, 1000),
    (7, 64),
    (64, 512),
    (5, 8192),
    (2, 24),
];
/// More rows than one RMSNorm launch has blocks (4096, one row each, `kMaxRmsNormBlocks` in
/// cuda/epilogue.cu): the blocks loop, some twice or more.
const MANY_ROWS: usize = shape(70_000, 2 * 4096 + 3);

use gpu::TestElement;

fn case_seed<T: TestElement>(parts: &[u64]) -> u64 {
    mix_seed(base_seed(0x7470_6675_7365_e91c) ^ T::ID, parts)
}

fn rms_norm_cases<T: TestElement>() {
    let stream = gpu_stream();
    for (rows, hidden) in SHAPES {
        let seed = case_seed::<T>(&[1, rows as u64, hidden as u64]);
        let label = format!(
            "rms_norm {} rows={rows} hidden={hidden} seed={seed:#x}",
            T::NAME
        );
        let n = rows * hidden;
        let x: Vec<T> = random_vec(seed, n, -4.0, 4.0);
        let gamma: Vec<T> = random_vec(seed ^ 1, hidden, 0.5, 1.5);
        let (dx, dg) = (upload(&stream, &x), upload(&stream, &gamma));
        let mut out = poisoned::<T>(&stream, n);
        ops::rms_norm(&stream, &dx, &dg, EPS, &mut out).unwrap_or_else(|e| panic!("{label}: {e}"));
        let got = download(&stream, &out);
        let wide: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        assert_close(
            &label,
            &got,
            &rms_norm_f64(&wide, &gamma, f64::from(EPS)),
            T::NORM_TOLERANCE,
        );
        let mut inplace = upload(&stream, &x);
        ops::rms_norm_in_place(&stream, &mut inplace, &dg, EPS)
            .unwrap_or_else(|e| panic!("{label} in place: {e}"));
        assert_same_bits(
            &format!("{label}: in place vs out of place"),
            &download(&stream, &inplace),
            &got,
        );
    }
}

fn many_rows() {
    type T = bf16;
    let stream = gpu_stream();
    let (rows, hidden) = (MANY_ROWS, 8);
    let seed = case_seed::<T>(&[4, rows as u64]);
    let label = format!("rms_norm bf16 rows={rows} hidden={hidden} seed={seed:#x}");
    let x: Vec<T> = random_vec(seed, rows * hidden, -4.0, 4.0);
    let gamma: Vec<T> = random_vec(seed ^ 1, hidden, 0.5, 1.5);
    let (dx, dg) = (upload(&stream, &x), upload(&stream, &gamma));
    let mut out = poisoned::<T>(&stream, rows * hidden);
    ops::rms_norm(&stream, &dx, &dg, EPS, &mut out).unwrap_or_else(|e| panic!("{label}: {e}"));
    let got = download(&stream, &out);
    let unwritten = got.iter().filter(|v| v.is_nan()).count();
    assert_eq!(unwritten, 0, "{label}: {unwritten} outputs never written");
    let wide: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    let want = rms_norm_f64(&wide, &gamma, f64::from(EPS));
    assert_close(&label, &got, &want, T::NORM_TOLERANCE);
}

fn bias_residual_cases<T: TestElement>() {
    let stream = gpu_stream();
    for (rows, hidden) in SHAPES {
        for with_bias in [false, true] {
            let seed = case_seed::<T>(&[2, rows as u64, hidden as u64, u64::from(with_bias)]);
            let label = format!(
                "add_bias_residual {} rows={rows} hidden={hidden} bias={with_bias} seed={seed:#x}",
                T::NAME
            );
            let n = rows * hidden;
            let x: Vec<T> = random_vec(seed, n, -4.0, 4.0);
            let residual: Vec<T> = random_vec(seed ^ 1, n, -4.0, 4.0);
            let bias: Vec<T> = random_vec(seed ^ 2, hidden, -0.5, 0.5);
            let dx = upload(&stream, &x);
            let db = upload(&stream, &bias);
            let mut dr = upload(&stream, &residual);
            let mut out = poisoned::<T>(&stream, n);
            let b = with_bias.then_some(&db as &dyn DevicePtr<T>);
            ops::add_bias_residual(&stream, &dx, b, &mut dr, &mut out)
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            let want = all_reduce_epilogue_exact(
                &[&x[..]],
                with_bias.then_some(&bias[..]),
                Some(&residual),
                hidden,
            );
            assert_same_bits(&format!("{label}: out"), &download(&stream, &out), &want);
            assert_same_bits(
                &format!("{label}: residual"),
                &download(&stream, &dr),
                &want,
            );
        }
    }
}

gpu_tests! {
    rms_norm_f32 => rms_norm_cases::<f32>();
    rms_norm_f16 => rms_norm_cases::<f16>();
    rms_norm_bf16 => rms_norm_cases::<bf16>();
    rms_norm_loops_over_more_rows_than_a_launch_has_blocks => many_rows();
    add_bias_residual_f32 => bias_residual_cases::<f32>();
    add_bias_residual_f16 => bias_residual_cases::<f16>();
    add_bias_residual_bf16 => bias_residual_cases::<bf16>();
    bad_calls_are_refused_before_anything_runs => bad_calls();
}

fn bad_calls() {
    type T = bf16;
    let stream = gpu_stream();
    let (rows, hidden) = (4usize, 64usize);
    let n = rows * hidden;
    let seed = case_seed::<T>(&[3]);
    let x = upload(&stream, &random_vec::<T>(seed, n, -4.0, 4.0));
    let gamma = upload(&stream, &random_vec::<T>(seed ^ 1, 2 * hidden, 0.5, 1.5));
    let mut residual = poisoned::<T>(&stream, n);
    let mut out = poisoned::<T>(&stream, n + 8);
    {
        let g = gamma.slice(0..48); // 256 elements are not whole rows of 48
        let r = ops::rms_norm(&stream, &x, &g, EPS, &mut out.slice_mut(0..n));
        expect_invalid_saying("rows of 48", r, "x", &["rows of 48"]);
        let g = gamma.slice(0..hidden);
        for eps in [f32::NAN, -1.0, f32::INFINITY] {
            let r = ops::rms_norm(&stream, &x, &g, eps, &mut out.slice_mut(0..n));
            expect_invalid_saying(&format!("eps {eps}"), r, "eps", &["finite"]);
        }
        let r = ops::rms_norm(&stream, &x, &g, EPS, &mut out.slice_mut(0..n + 8));
        expect_invalid_saying("long out", r, "out", &["must hold 256"]);
        // Rows of 4 bf16 (8 bytes) are not whole 16-byte vectors.
        let r = ops::rms_norm(
            &stream,
            &x,
            &gamma.slice(0..4),
            EPS,
            &mut out.slice_mut(0..n),
        );
        expect_invalid_saying("rows of 4", r, "gamma", &["multiple of 8"]);
        // A view that starts 8 elements in (16 bytes: aligned) is taken; 4 in (8 bytes) is not.
        let r = ops::rms_norm(&stream, &x, &g, EPS, &mut out.slice_mut(4..n + 4));
        expect_invalid_saying("misaligned out", r, "out", &["16-byte aligned"]);
        let r = ops::rms_norm_in_place(&stream, &mut residual.slice_mut(4..n - 60), &g, EPS);
        expect_invalid_saying("misaligned x", r, "x", &["16-byte aligned"]);
        let r = ops::rms_norm_in_place(&stream, &mut residual, &gamma.slice(0..0), EPS);
        expect_invalid_saying("empty gamma", r, "x", &["rows of 0"]);
        let b = gamma.slice(0..48);
        let r = ops::add_bias_residual(
            &stream,
            &x,
            Some(&b as &dyn DevicePtr<T>),
            &mut residual,
            &mut out.slice_mut(0..n),
        );
        expect_invalid_saying("bias of 48", r, "x", &["rows of 48"]);
        let r = ops::add_bias_residual(
            &stream,
            &x,
            None,
            &mut residual.slice_mut(0..n - 8),
            &mut out.slice_mut(0..n),
        );
        expect_invalid_saying("short residual", r, "residual", &["must hold 256"]);
    }
    assert_poisoned("out after the refused calls", &download(&stream, &out));
    assert_poisoned(
        "residual after the refused calls",
        &download(&stream, &residual),
    );
}
