//! Pieces the benches share: the driver check, GPU 0 with one stream, random device data,
//! CUDA-event timing and size labels. Each bench includes this file with
//! `#[path = "common/mod.rs"] mod common;`.
#![allow(dead_code)]

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, ValidAsZeroBits};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;
use tpfuse::{Element, TpGroup};

pub const KB: usize = 1 << 10;
pub const MB: usize = 1 << 20;

/// Whether the bench runs as a smoke test (`TPFUSE_BENCH_SMOKE` set, e.g. on the CPU
/// emulator): its code paths once, at shapes divided by 8, one `m` per case, few rounds. The
/// numbers then mean nothing; what it shows is that the bench runs to its end (a driver call
/// it needs, a shape it cannot take), before a GPU's time is spent on it.
pub fn smoke() -> bool {
    std::env::var_os("TPFUSE_BENCH_SMOKE").is_some()
}

/// `full`, or `small` in a smoke run.
pub fn full_or_smoke<T>(full: T, small: T) -> T {
    if smoke() {
        small
    } else {
        full
    }
}

/// A dimension of a bench's shape: itself, or divided by 8 (at least 64) in a smoke run.
pub fn dim(full: usize) -> usize {
    if smoke() {
        (full / 8).max(64)
    } else {
        full
    }
}

/// Whether a CUDA driver is present; without one, prints the bench's one line (so that
/// `cargo bench` exits 0 on a machine with no GPU, having registered nothing).
pub fn driver_present(bench: &str) -> bool {
    let present = tpfuse::device::driver_present();
    if !present {
        println!("{bench} benches need a CUDA GPU and driver (libcuda.so not found): nothing run");
    }
    present
}

/// GPU 0's name and one stream on it that carries everything, after printing
/// `{bench} benches on GPU 0: {name}`. cudarc's cross-stream event tracking is turned off
/// (it is not needed with one stream, and keeps its event records out of the enqueue path
/// and out of captured graphs): every buffer of the bench must live on this stream.
pub fn one_stream(bench: &str) -> (String, Arc<CudaStream>) {
    let ctx = tpfuse::device::open(0).unwrap_or_else(|e| panic!("opening GPU 0: {e}"));
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    println!("{bench} benches on GPU 0: {name}");
    // SAFETY: every buffer of the bench is allocated, used and freed on the one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().expect("creating a stream");
    (name, stream)
}

/// Fills `n` elements with values uniform in (-scale, scale) by uploading one random host
/// block (at most 1M elements) repeatedly at shifting offsets.
pub fn random_device<T: Element + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
    scale: f32,
    seed: u64,
) -> CudaSlice<T> {
    let block = n.clamp(1, 1 << 20);
    let mut rng = StdRng::seed_from_u64(seed);
    let host: Vec<T> = (0..block + 997)
        .map(|_| T::from_f32(rng.random_range(-scale..scale)))
        .collect();
    let mut dev = stream.alloc_zeros::<T>(n).expect("allocating an input");
    let (mut start, mut shift) = (0, 0);
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

/// GPU time of `rounds` calls of `round` (which enqueues work on every stream): the first
/// stream records the start, the others wait for it; at the end the first stream waits for
/// the others and records the end. The streams may live on several devices.
pub fn time_rounds(streams: &[Arc<CudaStream>], rounds: u64, mut round: impl FnMut()) -> Duration {
    let s0 = &streams[0];
    let ctx = s0.context();
    let start = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("creating an event");
    let end = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("creating an event");
    start.record(s0).expect("recording an event");
    for s in &streams[1..] {
        s.wait(&start).expect("waiting for the start");
    }
    for _ in 0..rounds {
        round();
    }
    for s in &streams[1..] {
        let done = s.record_event(None).expect("recording an event");
        s0.wait(&done).expect("joining the streams");
    }
    end.record(s0).expect("recording an event");
    let ms = start.elapsed_ms(&end).expect("reading the event timer");
    Duration::from_secs_f64(f64::from(ms) * 1e-3)
}

/// GPU time of `iters` calls of `f`, from events recorded on `stream`.
pub fn event_time(stream: &Arc<CudaStream>, iters: u64, f: impl FnMut()) -> Duration {
    time_rounds(std::slice::from_ref(stream), iters, f)
}

/// `8KB`, `4MB`, ...
pub fn human(bytes: usize) -> String {
    if bytes >= MB {
        format!("{}MB", bytes / MB)
    } else {
        format!("{}KB", bytes / KB)
    }
}

/// Captures, per group, `rounds` calls of `enqueue(rank)` on the group's stream into one
/// uploaded graph (thread-local capture mode).
pub fn capture_rounds<R>(
    groups: &[TpGroup],
    rounds: u64,
    mut enqueue: impl FnMut(usize) -> tpfuse::Result<R>,
) -> Vec<CudaGraph> {
    (0..groups.len())
        .map(|r| {
            let stream = groups[r].stream();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .expect("beginning a capture");
            let mut result = Ok(());
            for _ in 0..rounds {
                if let Err(e) = enqueue(r) {
                    result = Err(e);
                    break;
                }
            }
            let graph = stream.end_capture(CUgraphInstantiate_flags(0));
            result.unwrap_or_else(|e| panic!("rank {r}: enqueue during the capture: {e}"));
            let graph = graph
                .expect("ending a capture")
                .expect("the capture recorded work");
            graph.upload().expect("uploading a graph");
            graph
        })
        .collect()
}

/// `check()` on every rank; panics naming `what` and the rank.
pub fn check_all(groups: &[TpGroup], what: &str) {
    for g in groups {
        g.check()
            .unwrap_or_else(|e| panic!("{what}: check() on rank {}: {e}", g.rank()));
    }
}
