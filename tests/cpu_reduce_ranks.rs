//! reduce_ranks without a GPU: the validation that runs before any launch, and the CPU
//! references the GPU tests compare against.

use half::{bf16, f16};
use tpfuse::ops::reduce_ranks::{check_reduce_ranks, MAX_REDUCE_INPUTS};
use tpfuse::reference::{reduce_ranks_exact, reduce_ranks_f64, relative_error};
use tpfuse::validate::BufferInfo;
use tpfuse::Error;

const MB: u64 = 1 << 20;

fn buffers(count: usize, len: usize) -> Vec<BufferInfo> {
    (0..count)
        .map(|r| BufferInfo::new(0x7000_0000 + r as u64 * MB, len, 0))
        .collect()
}

fn out(len: usize) -> BufferInfo {
    BufferInfo::new(0x1000_0000, len, 0)
}

fn invalid_arg(e: Error) -> (String, String) {
    match e {
        Error::InvalidArgument { arg, reason } => (arg, reason),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn valid_inputs_pass() {
    for w in [1, 2, 8, MAX_REDUCE_INPUTS] {
        check_reduce_ranks::<bf16>(&buffers(w, 100), &out(100), 0).unwrap();
    }
    // Zero length is valid (nothing is launched).
    check_reduce_ranks::<f32>(&buffers(2, 0), &out(0), 0).unwrap();
}

#[test]
fn no_inputs_and_too_many_are_errors() {
    let (arg, reason) = invalid_arg(check_reduce_ranks::<f32>(&[], &out(4), 0).unwrap_err());
    assert_eq!(arg, "inputs");
    assert!(reason.contains("0 buffers"), "{reason}");
    let (arg, reason) = invalid_arg(
        check_reduce_ranks::<f32>(&buffers(MAX_REDUCE_INPUTS + 1, 4), &out(4), 0).unwrap_err(),
    );
    assert_eq!(arg, "inputs");
    assert!(reason.contains("17 buffers"), "{reason}");
}

#[test]
fn a_length_mismatch_names_the_input() {
    let mut ins = buffers(4, 100);
    ins[2].len = 99;
    let (arg, reason) = invalid_arg(check_reduce_ranks::<f16>(&ins, &out(100), 0).unwrap_err());
    assert_eq!(arg, "inputs[2]");
    assert!(reason.contains("99") && reason.contains("100"), "{reason}");
}

#[test]
fn a_buffer_on_another_device_is_an_error() {
    let mut ins = buffers(3, 10);
    ins[1].device = 1;
    let (arg, reason) = invalid_arg(check_reduce_ranks::<f32>(&ins, &out(10), 0).unwrap_err());
    assert_eq!(arg, "inputs[1]");
    assert!(reason.contains("device 1"), "{reason}");
    let mut o = out(10);
    o.device = 3;
    let (arg, _) = invalid_arg(check_reduce_ranks::<f32>(&buffers(2, 10), &o, 0).unwrap_err());
    assert_eq!(arg, "out");
}

#[test]
fn out_overlapping_an_input_is_an_error() {
    let ins = buffers(2, 256);
    // out starts inside inputs[1] (4 bytes per f32 element).
    let o = BufferInfo::new(ins[1].addr + 4 * 255, 256, 0);
    let (arg, reason) = invalid_arg(check_reduce_ranks::<f32>(&ins, &o, 0).unwrap_err());
    assert_eq!(arg, "out");
    assert!(reason.contains("inputs[1]"), "{reason}");
    // Directly adjacent is fine.
    let o = BufferInfo::new(ins[1].addr + 4 * 256, 256, 0);
    check_reduce_ranks::<f32>(&ins, &o, 0).unwrap();
    // The element size matters: 2-byte elements end earlier.
    let o = BufferInfo::new(ins[1].addr + 2 * 256, 256, 0);
    check_reduce_ranks::<bf16>(&ins, &o, 0).unwrap();
    assert!(check_reduce_ranks::<f32>(&ins, &o, 0).is_err());
}

#[test]
fn the_exact_reference_adds_in_rank_order_in_f32() {
    // (1e8 + 1) - 1e8 in f32 is 0 (1 is below half an ulp of 1e8); any other order gives 1.
    let a = [1.0e8f32];
    let b = [1.0f32];
    let c = [-1.0e8f32];
    assert_eq!(reduce_ranks_exact(&[&a[..], &b[..], &c[..]]), vec![0.0]);
    assert_eq!(reduce_ranks_exact(&[&a[..], &c[..], &b[..]]), vec![1.0]);
    // The f64 reference is order-free here.
    assert_eq!(reduce_ranks_f64(&[&a[..], &b[..], &c[..]]), vec![1.0]);
}

#[test]
fn the_exact_reference_rounds_once_to_the_element_type() {
    // bf16 has an ulp of 2^-7 at 1. 1 + 0.625 ulp + 0.625 ulp = 1 + 1.25 ulp, which rounds
    // once to 1 + 1 ulp; rounding after every add would give 1 + 1 ulp, then 1 + 2 ulp.
    let ulp = 2f32.powi(-7);
    let a = [bf16::from_f32(1.0)];
    let b = [bf16::from_f32(0.625 * ulp)];
    assert_eq!(b[0].to_f32(), 0.625 * ulp, "0.625 ulp is representable");
    let got = reduce_ranks_exact(&[&a[..], &b[..], &b[..]]);
    assert_eq!(got[0], bf16::from_f32(1.0 + ulp));
    let stepwise = bf16::from_f32(bf16::from_f32(1.0 + 0.625 * ulp).to_f32() + 0.625 * ulp);
    assert_eq!(
        stepwise,
        bf16::from_f32(1.0 + 2.0 * ulp),
        "the two orders differ"
    );
}

#[test]
fn sharded_sums_match_the_unsharded_f64_reference() {
    // A vector split into W partial sums (as TP ranks hold them) reduces to the full sum.
    let n = 4096;
    let full: Vec<f64> = (0..n)
        .map(|i| ((i * 37) % 101) as f64 / 7.0 - 5.0)
        .collect();
    for w in [2usize, 4, 8] {
        let parts: Vec<Vec<bf16>> = (0..w)
            .map(|r| {
                full.iter()
                    .enumerate()
                    .map(|(i, x)| bf16::from_f64(if (i + r) % w == 0 { *x } else { 0.0 }))
                    .collect()
            })
            .collect();
        let slices: Vec<&[bf16]> = parts.iter().map(Vec::as_slice).collect();
        let got = reduce_ranks_exact(&slices);
        let err = relative_error(&got, &full);
        assert!(err < 1e-2, "W={w}: relative error {err}");
        assert!(err > 0.0, "bf16 rounding must show up in the error");
    }
}
