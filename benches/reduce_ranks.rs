//! Bandwidth of [`tpfuse::ops::reduce_ranks`] against a device-to-device copy.
//!
//! For bf16 and f32, W in {2, 4, 8} input buffers of 8 KB to 256 MB each (from about 64 MB
//! per buffer the inputs no longer fit in L2), one criterion group per (dtype, W) with two
//! benchmarks per size:
//!
//! - `reduce_ranks/<bytes>`: `out = in[0] + ... + in[W-1]`; throughput counts the bytes read
//!   and written, (W + 1) x bytes per buffer.
//! - `memcpy_dtod/<bytes>`: cudarc's device-to-device copy of W x bytes (the bytes
//!   reduce_ranks reads); throughput counts read and write, 2 x W x bytes. Its GB/s is what
//!   the memory system gives a plain stream, so the ratio of the two rates shows how close
//!   reduce_ranks gets to copy bandwidth.
//!
//! Times come from CUDA events recorded on the stream around `iters` back-to-back launches
//! (criterion's `iter_custom`), never from the host clock. Small sizes stay in L2 across
//! iterations and are bound by launch rate: that is the decode regime, and what is measured.
//! The inputs are views of one large random buffer per rank, allocated once per group.
//!
//! Without a CUDA driver the bench prints one line and registers nothing, so
//! `cargo bench` exits 0 on a machine with no GPU.
//!
//! Quick run: `cargo bench --bench reduce_ranks -- --warm-up-time 1 --measurement-time 3`;
//! one dtype: `cargo bench --bench reduce_ranks -- bf16`. On the emulator, once, the two
//! smallest sizes: `TPFUSE_BENCH_SMOKE=1 cargo test --features emulator --bench reduce_ranks`.

#[path = "common/mod.rs"]
mod common;
use common::{event_time, human, random_device, smoke, KB, MB};

use criterion::{BenchmarkId, Criterion, Throughput};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, ValidAsZeroBits};
use half::bf16;
use std::sync::Arc;
use tpfuse::ops::reduce_ranks;
use tpfuse::Element;

const WORLDS: [usize; 3] = [2, 4, 8];
/// Bytes per input buffer.
const SIZES: [usize; 8] = [
    8 * KB,
    64 * KB,
    512 * KB,
    4 * MB,
    32 * MB,
    64 * MB,
    128 * MB,
    256 * MB,
];
/// The sizes of this run: the two smallest in a smoke run (`common::smoke`).
fn sizes() -> &'static [usize] {
    if smoke() {
        &SIZES[..2]
    } else {
        &SIZES
    }
}
/// From this size per buffer on, fewer samples (one sample at 256 MB x 9 buffers is
/// already about a millisecond).
const LARGE: usize = 32 * MB;

fn main() {
    if !common::driver_present("reduce_ranks") {
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    // Every buffer below is allocated, used and freed on this one stream.
    let (_, stream) = common::one_stream("reduce_ranks");
    for &world in &WORLDS {
        bench_group::<bf16>(&mut c, &stream, world);
    }
    for &world in &WORLDS {
        bench_group::<f32>(&mut c, &stream, world);
    }
    c.final_summary();
}

fn bench_group<T: Element + ValidAsZeroBits>(
    c: &mut Criterion,
    stream: &Arc<CudaStream>,
    world: usize,
) {
    let elem = std::mem::size_of::<T>();
    let max_n = sizes().last().expect("at least one size") / elem;
    let inputs: Vec<CudaSlice<T>> = (0..world)
        .map(|r| {
            random_device::<T>(
                stream,
                max_n,
                4.0,
                0x5eed ^ ((r as u64) << 20) ^ elem as u64,
            )
        })
        .collect();
    let mut out = stream
        .alloc_zeros::<T>(max_n)
        .expect("allocating the output");
    let copy_src = random_device::<T>(stream, world * max_n, 4.0, 0xc0b1 ^ world as u64);
    let mut copy_dst = stream
        .alloc_zeros::<T>(world * max_n)
        .expect("allocating the copy target");
    stream.synchronize().expect("uploading the inputs");

    let mut group = c.benchmark_group(format!("reduce_ranks_{}_w{world}", T::NAME));
    for &bytes in sizes() {
        let n = bytes / elem;
        let label = human(bytes);
        if bytes >= LARGE {
            group.sample_size(20);
        } else {
            group.sample_size(100);
        }

        let views: Vec<CudaView<T>> = inputs.iter().map(|x| x.slice(0..n)).collect();
        let refs: Vec<&CudaView<T>> = views.iter().collect();
        let mut out_view = out.slice_mut(0..n);
        // Validate once outside the timed loop, and warm the kernel up.
        reduce_ranks(stream, &refs, &mut out_view).expect("reduce_ranks");
        stream.synchronize().expect("reduce_ranks warm-up");
        group.throughput(Throughput::Bytes(((world + 1) * bytes) as u64));
        group.bench_function(BenchmarkId::new("reduce_ranks", &label), |b| {
            b.iter_custom(|iters| {
                event_time(stream, iters, || {
                    reduce_ranks(stream, &refs, &mut out_view).expect("reduce_ranks")
                })
            })
        });

        let src = copy_src.slice(0..world * n);
        let mut dst = copy_dst.slice_mut(0..world * n);
        group.throughput(Throughput::Bytes((2 * world * bytes) as u64));
        group.bench_function(BenchmarkId::new("memcpy_dtod", &label), |b| {
            b.iter_custom(|iters| {
                event_time(stream, iters, || {
                    stream.memcpy_dtod(&src, &mut dst).expect("memcpy_dtod")
                })
            })
        });
    }
    group.finish();
}
