//! GPU tests of [`tpfuse::ops::reduce_ranks`] (feature `gpu-tests`; without it every test
//! here is listed as ignored).
//!
//! Every case uploads fresh random inputs (uniform in (-4, 4), seeded per case and per rank,
//! so that no two cases see the same data), poisons the output with NaN so that an element
//! the kernel never writes fails the check, and asserts
//!
//! - bitwise equality with [`reduce_ranks_exact`] (the kernel's arithmetic, emulated), and
//! - relative Frobenius error against the f64 reference [`reduce_ranks_f64`] below 1e-2
//!   (bf16), 2e-3 (f16) or 1e-6 (f32).
//!
//! The seed of every case derives from `TPFUSE_TEST_SEED` (a fixed default when unset), so a
//! failure names the seed that reproduces it.
//!
//! [`reduce_ranks_exact`]: tpfuse::reference::reduce_ranks_exact
//! [`reduce_ranks_f64`]: tpfuse::reference::reduce_ranks_f64

mod common;
use common::gpu::{
    assert_close, base_seed, download, expect_invalid, gpu_stream, mix_seed, poisoned,
    random_ranks, splitmix64, sum_references_of, upload, TestElement,
};
use common::{assert_same_bits, shape};

use cudarc::driver::{CudaSlice, CudaStream, CudaView};
use half::{bf16, f16};
use std::sync::Arc;
use tpfuse::ops::reduce_ranks;

/// World sizes (number of input buffers) of the main matrix.
const WORLDS: [usize; 6] = [1, 2, 3, 4, 8, 16];
/// Lengths of the main matrix: below, at and around one 16-byte vector (4 f32 or 8 f16/bf16
/// elements) and its multiples, then sizes that need several grid strides.
const LENGTHS: [usize; 11] = [
    1,
    2,
    7,
    8,
    9,
    15,
    16,
    17,
    1000,
    4097,
    shape(1 << 20, 1 << 14),
];
/// About 16M elements (32 MiB and a bit per buffer in bf16, 64 MiB in f32), with a scalar
/// tail of 3 after the vectorised part.
const HUGE_LEN: usize = shape(1 << 24, 1 << 16) + 3;
/// World sizes of the huge cases (every W costs W x HUGE_LEN random elements on the host).
const HUGE_WORLDS: [usize; 4] = [1, 2, 3, 16];
/// Lengths of the unaligned cases.
const UNALIGNED_LENGTHS: [usize; 10] = [1, 2, 7, 8, 9, 16, 17, 1000, 4097, 65_537];

/// Distinguishes the data of the different kinds of case.
#[derive(Clone, Copy)]
enum Variant {
    Matrix = 1,
    Huge = 2,
    Unaligned = 3,
    Validation = 4,
    ZeroLength = 5,
}

/// One seed per (dtype, variant, world, length): different for every case.
fn case_seed<T: TestElement>(variant: Variant, world: usize, n: usize) -> u64 {
    mix_seed(
        splitmix64(base_seed(0x7470_6675_7365_0001)),
        &[T::ID, variant as u64, world as u64, n as u64],
    )
}

/// `world` buffers of `n` elements, uniform in (-4, 4), rank r seeded from (seed, r).
fn random_inputs<T: TestElement>(seed: u64, world: usize, n: usize) -> Vec<Vec<T>> {
    random_ranks(world, n, |r| {
        splitmix64(seed ^ (r as u64).wrapping_mul(0x51))
    })
}

/// Bitwise against the exact emulation, then the error bound against the f64 reference.
fn check<T: TestElement>(label: &str, got: &[T], exact: &[T], wide: &[f64]) {
    assert_same_bits(label, got, exact);
    assert_close(label, got, wide, T::TOLERANCE);
}

/// Uploads `inputs`, runs reduce_ranks into a poisoned output, returns the output.
fn run_aligned<T: TestElement>(stream: &Arc<CudaStream>, label: &str, inputs: &[Vec<T>]) -> Vec<T> {
    let n = inputs[0].len();
    let dev: Vec<CudaSlice<T>> = inputs.iter().map(|x| upload(stream, x)).collect();
    let refs: Vec<&CudaSlice<T>> = dev.iter().collect();
    let mut out = poisoned::<T>(stream, n);
    reduce_ranks(stream, &refs, &mut out).unwrap_or_else(|e| panic!("{label}: {e}"));
    download(stream, &out)
}

fn run_case<T: TestElement>(stream: &Arc<CudaStream>, variant: Variant, world: usize, n: usize) {
    let seed = case_seed::<T>(variant, world, n);
    let label = format!("reduce_ranks {} W={world} n={n} seed={seed:#x}", T::NAME);
    let inputs = random_inputs::<T>(seed, world, n);
    let (exact, wide) = sum_references_of(&inputs, 0..n);
    let got = run_aligned(stream, &label, &inputs);
    check(&label, &got, &exact, &wide);
}

fn matrix<T: TestElement>() {
    let stream = gpu_stream();
    for &world in &WORLDS {
        for &n in &LENGTHS {
            run_case::<T>(&stream, Variant::Matrix, world, n);
        }
    }
}

fn huge<T: TestElement>() {
    let stream = gpu_stream();
    for &world in &HUGE_WORLDS {
        run_case::<T>(&stream, Variant::Huge, world, HUGE_LEN);
    }
}

/// Three layouts of the same inputs must give the same bits: every buffer 16-byte aligned
/// (vector path), every buffer at element offset 1 (scalar path), and only the last input
/// at offset 1 (so the alignment test must look at every pointer, not only the first).
fn unaligned<T: TestElement>() {
    let stream = gpu_stream();
    for &world in &[1usize, 2, 3, 8, 16] {
        for &n in &UNALIGNED_LENGTHS {
            let seed = case_seed::<T>(Variant::Unaligned, world, n);
            let label = format!("reduce_ranks {} W={world} n={n} seed={seed:#x}", T::NAME);
            // One element more than needed: the sub-views start at element 1.
            let inputs = random_inputs::<T>(seed, world, n + 1);
            let (exact, wide) = sum_references_of(&inputs, 1..n + 1);

            // Aligned: fresh allocations of elements 1..=n (allocations are 256-byte aligned).
            let shifted: Vec<Vec<T>> = inputs.iter().map(|x| x[1..].to_vec()).collect();
            let aligned = run_aligned(&stream, &format!("{label} aligned"), &shifted);
            check(&format!("{label} aligned"), &aligned, &exact, &wide);

            // Every input and the output at element offset 1.
            let dev: Vec<CudaSlice<T>> = inputs.iter().map(|x| upload(&stream, x)).collect();
            let views: Vec<CudaView<T>> = dev.iter().map(|d| d.slice(1..)).collect();
            let refs: Vec<&CudaView<T>> = views.iter().collect();
            let mut out = poisoned::<T>(&stream, n + 1);
            {
                let mut out_view = out.slice_mut(1..);
                reduce_ranks(&stream, &refs, &mut out_view)
                    .unwrap_or_else(|e| panic!("{label} offset 1: {e}"));
            }
            let got = download(&stream, &out);
            assert_eq!(
                got[0].bits(),
                T::poison().bits(),
                "{label} offset 1: the element before the output view was written"
            );
            check(&format!("{label} offset 1"), &got[1..], &exact, &wide);
            assert_same_bits(
                &format!("{label}: offset-1 (scalar) path vs aligned (vector) path"),
                &got[1..],
                &aligned,
            );

            // Only the last input unaligned; the others and the output aligned.
            let aligned_dev: Vec<CudaSlice<T>> =
                shifted.iter().map(|x| upload(&stream, x)).collect();
            let mut mixed: Vec<CudaView<T>> = aligned_dev.iter().map(|d| d.slice(..)).collect();
            mixed[world - 1] = dev[world - 1].slice(1..);
            let refs: Vec<&CudaView<T>> = mixed.iter().collect();
            let mut out = poisoned::<T>(&stream, n);
            reduce_ranks(&stream, &refs, &mut out)
                .unwrap_or_else(|e| panic!("{label} last input at offset 1: {e}"));
            let got = download(&stream, &out);
            assert_same_bits(
                &format!("{label}: last input at offset 1 vs aligned path"),
                &got,
                &aligned,
            );
        }
    }
}

/// n = 0 returns Ok and writes nothing (the surrounding buffer keeps its poison).
fn zero_length<T: TestElement>() {
    let stream = gpu_stream();
    for &world in &WORLDS {
        let seed = case_seed::<T>(Variant::ZeroLength, world, 0);
        let inputs = random_inputs::<T>(seed, world, 8);
        let dev: Vec<CudaSlice<T>> = inputs.iter().map(|x| upload(&stream, x)).collect();
        let views: Vec<CudaView<T>> = dev.iter().map(|d| d.slice(3..3)).collect();
        let refs: Vec<&CudaView<T>> = views.iter().collect();
        let mut out = poisoned::<T>(&stream, 8);
        {
            let mut empty = out.slice_mut(5..5);
            reduce_ranks(&stream, &refs, &mut empty).unwrap_or_else(|e| {
                panic!(
                    "reduce_ranks {} W={world} n=0 must be a no-op: {e}",
                    T::NAME
                )
            });
        }
        let got = download(&stream, &out);
        assert_same_bits(
            &format!(
                "reduce_ranks {} W={world} n=0 (the output must be untouched)",
                T::NAME
            ),
            &got,
            &[T::poison(); 8],
        );
    }
}

/// Bad calls on real buffers fail before the launch: the output keeps its poison.
fn validation<T: TestElement>() {
    let stream = gpu_stream();
    let n = 1000;
    let seed = case_seed::<T>(Variant::Validation, 17, n);
    let inputs = random_inputs::<T>(seed, 17, n);
    let dev: Vec<CudaSlice<T>> = inputs.iter().map(|x| upload(&stream, x)).collect();
    let short = upload(&stream, &inputs[0][..n - 1]);
    let mut out = poisoned::<T>(&stream, n);
    let name = T::NAME;

    // One input shorter than the output.
    let refs = [&dev[0], &dev[1], &short];
    expect_invalid(
        &format!("{name} length mismatch"),
        reduce_ranks(&stream, &refs, &mut out),
        "inputs[2]",
    );
    // 17 inputs: one more than MAX_REDUCE_INPUTS.
    assert_eq!(tpfuse::ops::reduce_ranks::MAX_REDUCE_INPUTS, 16);
    let refs: Vec<&CudaSlice<T>> = dev.iter().collect();
    assert_eq!(refs.len(), 17);
    expect_invalid(
        &format!("{name} 17 inputs"),
        reduce_ranks(&stream, &refs, &mut out),
        "inputs",
    );
    // No inputs.
    let none: [&CudaSlice<T>; 0] = [];
    expect_invalid(
        &format!("{name} no inputs"),
        reduce_ranks(&stream, &none, &mut out),
        "inputs",
    );
    let got = download(&stream, &out);
    assert_same_bits(
        &format!("{name}: output after rejected calls (nothing may be launched)"),
        &got,
        &vec![T::poison(); n],
    );

    // An output shorter than the inputs.
    let mut short_out = poisoned::<T>(&stream, n - 1);
    expect_invalid(
        &format!("{name} short output"),
        reduce_ranks(&stream, &[&dev[0], &dev[1]], &mut short_out),
        "inputs[0]",
    );
    let got = download(&stream, &short_out);
    assert_same_bits(
        &format!("{name}: short output after a rejected call"),
        &got,
        &vec![T::poison(); n - 1],
    );

    // An input on another device, where the machine has one.
    let devices = tpfuse::device::device_count().expect("counting devices");
    if devices >= 2 {
        let other = tpfuse::device::open(1)
            .expect("opening device 1")
            .new_stream()
            .expect("creating a stream on device 1");
        let remote = upload(&other, &inputs[1]);
        let remote_local = upload(&stream, &inputs[0]);
        // Mixed owners need one input type: views of both.
        let a = remote_local.slice(..);
        let b = remote.slice(..);
        expect_invalid(
            &format!("{name} input on device 1"),
            reduce_ranks(&stream, &[&a, &b], &mut out),
            "inputs[1]",
        );
        // A rejected call must leave no sticky error behind in the caller's context.
        stream.context().check_err().unwrap_or_else(|e| {
            panic!(
                "{name}: the rejected cross-device call left a CUDA error in the context \
                 ({e}): the op touched the foreign buffer before validating it"
            )
        });
        let got = download(&stream, &out);
        assert_same_bits(
            &format!("{name}: output after a rejected cross-device call"),
            &got,
            &vec![T::poison(); n],
        );
    } else {
        println!("{name}: one GPU, so the cross-device check did not run");
    }

    // The stream is healthy: a valid call on the same buffers works afterwards.
    let refs = [&dev[0], &dev[1]];
    reduce_ranks(&stream, &refs, &mut out).expect("a valid call after the rejected ones");
    let got = download(&stream, &out);
    let (exact, wide) = sum_references_of(&inputs[..2], 0..n);
    check(&format!("{name} after rejected calls"), &got, &exact, &wide);
}

gpu_tests! {
    f32_every_world_and_length => matrix::<f32>();
    f16_every_world_and_length => matrix::<f16>();
    bf16_every_world_and_length => matrix::<bf16>();
    f32_16m_elements => huge::<f32>();
    f16_16m_elements => huge::<f16>();
    bf16_16m_elements => huge::<bf16>();
    f32_unaligned_views_match_aligned_bits => unaligned::<f32>();
    f16_unaligned_views_match_aligned_bits => unaligned::<f16>();
    bf16_unaligned_views_match_aligned_bits => unaligned::<bf16>();
    zero_length_is_a_no_op => {
        zero_length::<f32>();
        zero_length::<f16>();
        zero_length::<bf16>();
    };
    bad_arguments_are_rejected_before_launch => {
        validation::<f32>();
        validation::<f16>();
        validation::<bf16>();
    };
}
