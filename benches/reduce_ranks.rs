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
//! one dtype: `cargo bench --bench reduce_ranks -- bf16`.

use criterion::{BenchmarkId, Criterion, Throughput};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;
use tpfuse::ops::reduce_ranks;
use tpfuse::Element;

const WORLDS: [usize; 3] = [2, 4, 8];
const KB: usize = 1 << 10;
const MB: usize = 1 << 20;
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
/// From this size per buffer on, fewer samples (one sample at 256 MB x 9 buffers is
/// already about a millisecond).
const LARGE: usize = 32 * MB;

fn main() {
    if !tpfuse::device::driver_present() {
        println!(
            "reduce_ranks benches need a CUDA GPU and driver (libcuda.so not found): nothing run"
        );
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    let ctx = tpfuse::device::open(0).unwrap_or_else(|e| panic!("opening GPU 0: {e}"));
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    println!("reduce_ranks benches on GPU 0: {name}");
    // One stream carries everything, so cudarc's cross-stream event tracking is not needed;
    // turning it off keeps its event records out of the enqueue path.
    // SAFETY: every buffer below is allocated, used and freed on the one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().expect("creating a stream");
    for &world in &WORLDS {
        bench_group::<bf16>(&mut c, &stream, world);
    }
    for &world in &WORLDS {
        bench_group::<f32>(&mut c, &stream, world);
    }
    c.final_summary();
}

/// Fills `n` elements on the device with random values in (-4, 4) by uploading one random
/// host block (at most 1M elements) repeatedly at shifting offsets.
fn random_device<T: Element + DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
    seed: u64,
) -> CudaSlice<T> {
    let block = n.clamp(1, 1 << 20);
    let mut rng = StdRng::seed_from_u64(seed);
    let host: Vec<T> = (0..block + 997)
        .map(|_| T::from_f32(rng.random_range(-4.0f32..4.0)))
        .collect();
    let mut dev = stream.alloc_zeros::<T>(n).expect("allocating an input");
    let mut start = 0;
    let mut shift = 0;
    while start < n {
        let len = block.min(n - start);
        let mut view = dev.slice_mut(start..start + len);
        stream
            .memcpy_htod(&host[shift..shift + len], &mut view)
            .expect("uploading an input");
        start += len;
        shift = (shift + 331) % 997;
    }
    dev
}

/// GPU time of `iters` runs of `f`, from events recorded on `stream`.
fn event_time(stream: &Arc<CudaStream>, iters: u64, mut f: impl FnMut()) -> Duration {
    let ctx = stream.context();
    let start = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("creating an event");
    let end = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("creating an event");
    start.record(stream).expect("recording an event");
    for _ in 0..iters {
        f();
    }
    end.record(stream).expect("recording an event");
    let ms = start.elapsed_ms(&end).expect("reading the event timer");
    Duration::from_secs_f64(f64::from(ms) * 1e-3)
}

fn bench_group<T: Element + DeviceRepr + ValidAsZeroBits>(
    c: &mut Criterion,
    stream: &Arc<CudaStream>,
    world: usize,
) {
    let elem = std::mem::size_of::<T>();
    let max_n = SIZES[SIZES.len() - 1] / elem;
    let inputs: Vec<CudaSlice<T>> = (0..world)
        .map(|r| random_device::<T>(stream, max_n, 0x5eed ^ ((r as u64) << 20) ^ elem as u64))
        .collect();
    let mut out = stream
        .alloc_zeros::<T>(max_n)
        .expect("allocating the output");
    let copy_src = random_device::<T>(stream, world * max_n, 0xc0b1 ^ world as u64);
    let mut copy_dst = stream
        .alloc_zeros::<T>(world * max_n)
        .expect("allocating the copy target");
    stream.synchronize().expect("uploading the inputs");

    let mut group = c.benchmark_group(format!("reduce_ranks_{}_w{world}", T::NAME));
    for &bytes in &SIZES {
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

fn human(bytes: usize) -> String {
    if bytes >= MB {
        format!("{}MB", bytes / MB)
    } else {
        format!("{}KB", bytes / KB)
    }
}
