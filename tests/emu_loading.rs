//! CUDA's lazy loading, which the emulator models strictly (cuda/emu/loading.cpp): a kernel's
//! first use on a device waits for everything enqueued on the device, and
//! [`device::load_kernels`], which every group constructor calls, loads all of tpfuse's kernels
//! so that no launch waits so. On an H200 the unfused sequence below (rank 0's all-reduce,
//! rank 0's first epilogue kernel, then rank 1's all-reduce) waited out rank 0's deadline
//! before the groups loaded their kernels (docs/gpu-runs/2026-11-26-h200-suite).
//!
//! One test, steps in order: every step depends on which kernels the process has loaded.
#![cfg(feature = "emulator")]

mod common;
use common::gpu::{random_ranks, splitmix64};
use common::ranks::{check_all, poisoned_ranks, upload, upload_ranks, virtual_group};

use half::{bf16, f16};
use std::time::Duration;
use tpfuse::emulator::{self, Stream};
use tpfuse::ops::{self, Algorithm};
use tpfuse::{build_info, device, GroupOptions};

/// Virtual time a busy kernel holds one SM.
const BUSY_NS: u64 = 2_000_000;

#[test]
fn a_first_use_waits_for_the_device_and_groups_load_every_kernel_first() {
    let ctx = device::open(0).expect("device 0");
    let stream = ctx.new_stream().expect("a stream");
    let busy = Stream::new();
    assert_eq!(
        emulator::loaded_kernels(0),
        0,
        "no kernel is loaded before any use"
    );

    // 1. The first use of rms_norm::<f16> waits for the busy kernel: the enqueue returns only
    //    once the device has run it.
    let hidden = 64;
    let x = stream
        .clone_htod(&vec![f16::from_f32(0.5); hidden])
        .expect("x");
    let gamma = stream
        .clone_htod(&vec![f16::from_f32(1.0); hidden])
        .expect("gamma");
    let mut out = stream.alloc_zeros::<f16>(hidden).expect("out");
    stream.synchronize().expect("uploads");
    busy.occupy_sms(1, BUSY_NS).expect("a busy kernel");
    let before = emulator::now_ns();
    ops::rms_norm(&stream, &x, &gamma, 1e-6, &mut out).expect("rms_norm");
    let waited = emulator::now_ns() - before;
    assert!(
        waited >= BUSY_NS,
        "a first use returned after {waited} ns of virtual time, before the busy kernel's \
         {BUSY_NS} ns: the emulator does not model lazy loading"
    );
    stream.synchronize().expect("rms_norm");

    // 2. Building a group loads every kernel of the build (device::load_kernels); a first
    //    launch afterwards waits for nothing.
    let world = 2;
    let options = GroupOptions {
        timeout: Duration::from_millis(200),
        ..GroupOptions::default()
    };
    let groups = virtual_group(&ctx, world, options);
    let count = build_info::kernel_count();
    assert_eq!(
        emulator::loaded_kernels(0),
        count + 1,
        "every listed kernel once, and the emulator's busy kernel"
    );
    assert_eq!(device::load_kernels(&ctx).expect("load_kernels"), count);
    assert_eq!(
        emulator::loaded_kernels(0),
        count + 1,
        "loading twice loads nothing more"
    );
    let mut residual = stream
        .clone_htod(&vec![f16::from_f32(1.0); hidden])
        .expect("residual");
    let mut sum = stream.alloc_zeros::<f16>(hidden).expect("sum");
    stream.synchronize().expect("uploads");
    busy.occupy_sms(1, BUSY_NS).expect("a busy kernel");
    let before = emulator::now_ns();
    ops::rms_norm(&stream, &x, &gamma, 1e-6, &mut out).expect("rms_norm again");
    ops::add_bias_residual(&stream, &x, None, &mut residual, &mut sum).expect("add_bias_residual");
    assert_eq!(
        emulator::now_ns(),
        before,
        "a loaded kernel's launch waited for the device"
    );
    busy.synchronize().expect("busy");
    stream.synchronize().expect("ops");

    // 3. The unfused sequence of the H200 run on those ranks: rank 0's one-shot waits for
    //    rank 1's, which this thread enqueues after rank 0's bias_residual::<bf16> (loaded
    //    with the group, never launched before in this process).
    let n = 4 * hidden;
    let partials = random_ranks::<bf16>(world, n, |r| splitmix64(0x10ad ^ r as u64));
    let inputs = upload_ranks(&groups, &partials);
    let mut sums = poisoned_ranks::<bf16>(&groups, n);
    let mut outs = poisoned_ranks::<bf16>(&groups, n);
    let mut residuals: Vec<_> = groups
        .iter()
        .map(|g| upload(g, &vec![bf16::from_f32(0.25); n]))
        .collect();
    for r in 0..world {
        let g = &groups[r];
        ops::all_reduce(g, &inputs[r], &mut sums[r], Algorithm::OneShot).expect("all_reduce");
        ops::add_bias_residual(g.stream(), &sums[r], None, &mut residuals[r], &mut outs[r])
            .expect("add_bias_residual");
    }
    check_all(&groups, "the unfused sequence on virtual ranks");
}
