//! CUDA graphs in the GPU tests: capture what a closure enqueues on a stream, and launch a
//! graph per virtual rank.
#![allow(dead_code)]

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};
use std::sync::Arc;

/// Captures what `enqueue` puts on `stream` into an uploaded graph (thread-local capture
/// mode, so that other threads' CUDA calls are not affected). `enqueue` may fail: its result
/// is returned beside the graph, after the capture has ended.
pub fn capture_on<R>(
    stream: &Arc<CudaStream>,
    label: &str,
    enqueue: impl FnOnce() -> R,
) -> (CudaGraph, R) {
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap_or_else(|e| panic!("{label}: beginning a capture: {e}"));
    let enqueued = enqueue();
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap_or_else(|e| panic!("{label}: ending the capture: {e}"))
        .unwrap_or_else(|| panic!("{label}: the capture recorded nothing"));
    graph
        .upload()
        .unwrap_or_else(|e| panic!("{label}: uploading the graph: {e}"));
    (graph, enqueued)
}

/// Launches every rank's graph, rank 0 first (each on its own stream).
pub fn launch_all(graphs: &[CudaGraph], label: &str) {
    for (r, g) in graphs.iter().enumerate() {
        g.launch()
            .unwrap_or_else(|e| panic!("{label}: launching rank {r}'s graph: {e}"));
    }
}
