//! `tpfuse_reduce_ranks` on the CPU emulator (feature `emulator`), through the C ABI: f32,
//! f16 and bf16, 1 to 16 inputs, lengths from 1 up, aligned (vector path) and misaligned
//! (scalar path) pointers. Fresh random inputs per case (seeded; `TPFUSE_TEST_SEED` changes
//! them), outputs poisoned first; results bitwise equal to the kernel's arithmetic done on the
//! host ([`reduce_ranks_exact`]) and within the DESIGN.md tolerance of the f64 sum.
//!
//! [`reduce_ranks_exact`]: tpfuse::reference::reduce_ranks_exact
#![cfg(feature = "emulator")]

mod common;
use common::assert_same_bits;
use common::emu::{launched, session};
use common::gpu::{assert_close, base_seed, mix_seed, random_ranks, sum_references, TestElement};
use half::{bf16, f16};
use std::ffi::c_void;
use tpfuse::emulator::{abi, DeviceBuffer, Stream};

const LENGTHS: [usize; 8] = [1, 3, 8, 9, 31, 64, 257, 1031];

struct Case<T: TestElement> {
    label: String,
    inputs: Vec<Vec<T>>,
    _buffers: Vec<DeviceBuffer<T>>,
    out: DeviceBuffer<T>,
}

/// Enqueues one reduction of `world` random inputs of `len` elements; with `misalign`, every
/// input starts one element past a 16-byte boundary (the scalar path).
fn enqueue<T: TestElement>(
    stream: &Stream,
    world: usize,
    len: usize,
    misalign: bool,
    seed: u64,
) -> Case<T> {
    let inputs: Vec<Vec<T>> = random_ranks(world, len, |r| mix_seed(seed, &[r as u64]));
    let skip = usize::from(misalign);
    let buffers: Vec<DeviceBuffer<T>> = inputs
        .iter()
        .map(|x| {
            let mut padded = vec![T::poison(); skip];
            padded.extend_from_slice(x);
            DeviceBuffer::from_slice(&padded)
        })
        .collect();
    // SAFETY (below): each pointer stays inside its buffer (skip + len elements).
    let ptrs: Vec<*const c_void> = buffers
        .iter()
        .map(|b| unsafe { b.ptr().add(skip) } as *const c_void)
        .collect();
    let out = DeviceBuffer::<T>::new(len);
    let label = format!(
        "{} world {world} len {len} misaligned {misalign} seed {seed}",
        T::NAME
    );
    // SAFETY: device buffers of the right sizes, alive until the case is checked.
    let code = unsafe {
        abi::tpfuse_reduce_ranks(
            T::DTYPE,
            ptrs.as_ptr(),
            world as i32,
            out.ptr().cast(),
            len,
            stream.raw(),
        )
    };
    launched(&label, code);
    Case {
        label,
        inputs,
        _buffers: buffers,
        out,
    }
}

fn check<T: TestElement>(case: &Case<T>) {
    let (exact, wide) = sum_references(&case.inputs);
    let got = case.out.to_vec();
    assert_same_bits(&case.label, &got, &exact);
    assert_close(&case.label, &got, &wide, T::TOLERANCE);
}

/// Every world and length, all enqueued on one stream before one synchronize.
fn run<T: TestElement>(seed: u64) {
    let stream = Stream::new();
    let mut cases = Vec::new();
    for world in 1..=16 {
        for (i, &len) in LENGTHS.iter().enumerate() {
            for misalign in [false, true] {
                let case_seed =
                    mix_seed(seed, &[T::ID, world as u64, i as u64, u64::from(misalign)]);
                cases.push(enqueue::<T>(&stream, world, len, misalign, case_seed));
            }
        }
    }
    stream.synchronize().expect("reduce_ranks on the emulator");
    for case in &cases {
        check(case);
    }
}

#[test]
fn reduce_ranks_f32_every_world_and_length() {
    let _s = session(
        "emu_reduce_ranks",
        "reduce_ranks_f32_every_world_and_length",
    );
    run::<f32>(base_seed(0x5eed_0001));
}

#[test]
fn reduce_ranks_f16_every_world_and_length() {
    let _s = session(
        "emu_reduce_ranks",
        "reduce_ranks_f16_every_world_and_length",
    );
    run::<f16>(base_seed(0x5eed_0002));
}

#[test]
fn reduce_ranks_bf16_every_world_and_length() {
    let _s = session(
        "emu_reduce_ranks",
        "reduce_ranks_bf16_every_world_and_length",
    );
    run::<bf16>(base_seed(0x5eed_0003));
}

#[test]
fn reduce_ranks_spreads_a_long_input_over_many_blocks() {
    // 8 SMs x 8 blocks per SM caps the grid at 64 blocks of 256 threads: 100k f32 elements in
    // 25k vectors make every thread loop; the grid-stride split must cover every element.
    let _s = session(
        "emu_reduce_ranks",
        "reduce_ranks_spreads_a_long_input_over_many_blocks",
    );
    let stream = Stream::new();
    let case = enqueue::<f32>(&stream, 3, 100_003, false, base_seed(0x5eed_0004));
    stream.synchronize().expect("long reduce_ranks");
    check(&case);
}
