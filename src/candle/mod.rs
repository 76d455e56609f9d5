//! candle custom ops over tpfuse (feature `candle`): the all-reduce of a
//! [`Tensor`](candle_core::Tensor) (in place or into a new tensor), the all-reduce with the
//! residual add and RMSNorm fused in, and the row-parallel linear with its fused GEMM +
//! all-reduce, on candle 0.11's CUDA tensors.
//!
//! ```text
//! all_reduce(&group, &x)?                          -> Tensor  x summed over the ranks
//! all_reduce_in_place(&group, &x)?                            x := sum over the ranks
//! all_reduce_residual_rmsnorm(&group, &partial, &residual, &gamma, eps)?
//!                                                  -> Tensor  rmsnorm(h) * gamma; residual := h
//! row_parallel(&group, &layer, &x)?                -> Tensor  x · Wᵀ (+ b) summed over the ranks
//! row_parallel_residual_rmsnorm(&group, &layer, &x, &residual, &gamma, eps)?
//!                                                  -> Tensor  the same, then as above
//! Weight::new(&group, &tensor)?                    a candle tensor as a layer's weight, borrowed
//! ```
//!
//! Shapes: `x`, `partial`, `residual` are `[.., hidden]` (any leading dimensions, flattened to
//! rows), `gamma` is `[hidden]`; a row-parallel `x` is `[.., in_features / W]` and its output
//! `[.., out_features]`. Every tensor is a contiguous CUDA tensor (any offset) of the layer's or
//! the op's dtype (bf16, f16 or f32) on the group's device, starting 16 bytes or a multiple
//! into its storage; anything else is a candle error that names the op and what was wrong,
//! returned before anything is enqueued. What tpfuse itself refuses (a row not a multiple of 16
//! bytes, a message past the group's capacity, a poisoned group) comes back as
//! [`candle_core::Error::Cuda`] holding the [`crate::Error`] (downcast it to match on it),
//! before any kernel is launched (after the event wait on candle's stream). Each op is a collective, as with [`crate::ops`]: every rank calls it, in the same order.
//!
//! **Streams.** tpfuse's kernels run on the group's stream G; candle's work runs on the tensor's
//! device stream C. When they differ, each op makes G wait for all the work candle has queued
//! on C, enqueues on G, then makes C wait for G (an event each way), so candle's later kernels
//! and its frees (`cuMemFreeAsync` on C) come after tpfuse's. Both joins run in the calling
//! thread, inside the op: C may be the calling thread's per-thread stream (candle's
//! `Device::new_cuda`). A group built on candle's stream (`Device::new_cuda_with_stream`, then
//! [`TpGroup::virtual_ranks_on`] or a [`crate::comm::Comm`] on that stream) needs no join.
//! Virtual ranks of one GPU each need a candle stream of their own
//! (`Device::new_cuda_with_stream` per rank, or a thread per rank with `Device::new_cuda`): if the ranks shared one candle stream, rank 0's
//! join back would make that stream, and so rank 1's launch, wait for rank 0's kernel, which
//! waits for rank 1 (the group's deadline turns that into [`crate::Error::PeerTimeout`]).
//!
//! candle's CUDA backend is not on the emulator (its kernels, cuBLAS and cuRAND need a GPU):
//! `tests/gpu_candle.rs` runs these ops under `gpu-tests`; CI type-checks them and the example
//! against candle-core with a check-only candle-kernels (`scripts/candle-check.sh`).
//!
//! The README's "candle" section shows an MLP in the shape of candle's `llama_multiprocess`;
//! `examples/candle_tp_mlp.rs` runs it (virtual ranks, or one process per GPU under torchrun).

mod all_reduce;
mod row_parallel;
mod weight;

pub use all_reduce::{all_reduce, all_reduce_in_place, all_reduce_residual_rmsnorm};
pub use row_parallel::{row_parallel, row_parallel_residual_rmsnorm};
pub use weight::Weight;

use crate::group::TpGroup;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Result};
use std::ops::Range;
use std::sync::Arc;

/// A tpfuse error as a candle error: [`candle_core::Error::Cuda`] holding the [`crate::Error`]
/// (no backtrace wrapper, so that it can be matched and downcast).
pub fn error(e: crate::Error) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e))
}

fn driver_error(
    context: &'static str,
) -> impl Fn(cudarc::driver::DriverError) -> candle_core::Error {
    move |source| error(crate::device::cuda(context)(source))
}

/// The element range `[start, end)` of a contiguous layout, or candle's error naming `op`.
fn contiguous(op: &'static str, layout: &Layout) -> Result<(usize, usize)> {
    layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::RequiresContiguous { op }.bt())
}

/// Checks operand `name` of `op` and returns its element range: contiguous, on the group's
/// device, made on the candle stream `stream` (the one the op joins: the destination's), and
/// starting 16 bytes into its storage or a multiple of that (tpfuse's alignment), so that
/// these errors come before anything is enqueued.
fn operand(
    op: &'static str,
    name: &str,
    group: &TpGroup,
    (storage, layout): (&CudaStorage, &Layout),
    stream: &CudaStream,
) -> Result<Range<usize>> {
    let (start, end) = contiguous(op, layout)?;
    on_group_device(op, name, group, storage)?;
    if storage.device.cuda_stream().cu_stream() != stream.cu_stream() {
        candle_core::bail!(
            "{op}: {name} was made on another candle stream than the op's destination (a \
             different candle Device of the GPU): tpfuse orders its work after the \
             destination's stream only; make the operands on one Device"
        )
    }
    let bytes = start * storage.dtype().size_in_bytes();
    if bytes % 16 != 0 {
        candle_core::bail!(
            "{op}: {name} starts {start} elements ({bytes} bytes) into its storage; tpfuse \
             needs buffers aligned to 16 bytes"
        )
    }
    Ok(start..end)
}

/// Errors unless `eps` is finite and not negative (before anything is enqueued).
fn check_eps(op: &str, eps: f32) -> Result<()> {
    if !(eps.is_finite() && eps >= 0.0) {
        candle_core::bail!("{op}: eps = {eps}; it must be finite and not negative")
    }
    Ok(())
}

/// Errors unless `storage` is on the group's device.
fn on_group_device(op: &str, what: &str, group: &TpGroup, storage: &CudaStorage) -> Result<()> {
    let ordinal = storage.device.cuda_stream().context().ordinal();
    if ordinal != group.device() {
        candle_core::bail!(
            "{op}: {what} is on cuda:{ordinal}, but rank {} of the group is on cuda:{}",
            group.rank(),
            group.device()
        )
    }
    Ok(())
}

/// Runs `enqueue` (tpfuse's launches on the group's stream G) after everything queued on
/// candle's stream `candle` (C), and orders C's later work after it. G waits for an event
/// recorded on C, so tpfuse reads what candle wrote; C then waits for an event recorded on G
/// (even when `enqueue` failed after launching), so candle's later reads, writes and
/// `cuMemFreeAsync` of these buffers come after tpfuse's last access. Should that join fail,
/// the host waits for G instead (the kernels' deadlines bound it) before the caller frees
/// anything. cudarc's own event tracking orders the buffers only when candle's context runs
/// several streams; the joins order them in every case. Both are issued here, in the calling
/// thread, since C may be that thread's per-thread stream.
fn ordered<R>(
    group: &TpGroup,
    candle: &Arc<CudaStream>,
    enqueue: impl FnOnce() -> crate::Result<R>,
) -> Result<R> {
    let g = group.stream();
    if g.cu_stream() == candle.cu_stream() {
        return enqueue().map_err(error);
    }
    g.join(candle)
        .map_err(driver_error("ordering tpfuse's stream after candle's"))?;
    let out = {
        let unwinding = WaitOnUnwind(group);
        let out = enqueue();
        std::mem::forget(unwinding);
        out
    };
    if let Err(join) = candle.join(g) {
        // The bounded wait for the group's stream; should it fail too, the context is in an
        // error state (or capturing), and nothing enqueued after this runs under tpfuse's work.
        let _ = group.check();
        out.map_err(error)?;
        return Err(driver_error("ordering candle's stream after tpfuse's")(
            join,
        ));
    }
    out.map_err(error)
}

/// Waits (bounded, [`TpGroup::check`]) for the group's stream if tpfuse panics between its
/// launches and the join back, so that the buffers the unwinding frees are no longer in use.
struct WaitOnUnwind<'g>(&'g TpGroup);

impl Drop for WaitOnUnwind<'_> {
    fn drop(&mut self) {
        let _ = self.0.check();
    }
}

/// Calls `$f::<T>` for the storage's dtype (bf16, f16, f32), or errors naming `$op` and the
/// dtype.
macro_rules! by_dtype {
    ($op:expr, $dtype:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            candle_core::DType::BF16 => $f::<half::bf16>($($arg),*),
            candle_core::DType::F16 => $f::<half::f16>($($arg),*),
            candle_core::DType::F32 => $f::<f32>($($arg),*),
            other => candle_core::bail!("{}: dtype {other:?}; tpfuse takes bf16, f16 and f32", $op),
        }
    };
}
use by_dtype;

/// A CUDA-only op called on CPU storage.
fn cuda_only<R>(op: &str) -> Result<R> {
    candle_core::bail!("{op}: CUDA tensors only (this tensor is on the CPU)")
}
