//! A candle tensor borrowed as a layer's weight or bias: a cudarc buffer ([`DevicePtr`]) over
//! the tensor's device memory, no copy. It keeps the tensor (and so its allocation) alive.

use super::{cuda_only, driver_error, operand};
use crate::group::TpGroup;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaStream, DevicePtr, DeviceSlice, SyncOnDrop,
};
use candle_core::cuda_backend::CudaDType;
use candle_core::{Result, Storage, Tensor, WithDType};
use std::marker::PhantomData;
use std::sync::Arc;

const WEIGHT: &str = "tpfuse::candle::Weight";

/// A contiguous CUDA tensor of the group's device, read by tpfuse's layers in place
/// (`RowParallelLinear::from_shard(group, spec, Weight::new(group, &w)?, ..)`, any layer's
/// `from_shard`). The tensor must not change while a layer holds it (candle's in-place ops
/// would change the layer's weights too).
///
/// Ordering: [`Weight::new`] waits (on the host, once) for the device's queued work (a context
/// synchronisation: the upload may have been issued on another thread's per-thread stream),
/// so the upload is complete before any stream reads it: any group of the device may use the
/// weight, a group rebuilt after a failure included. Dropping it waits for the device's work
/// again before the tensor is released, so that candle's `cuMemFreeAsync` of its last
/// reference comes after every read a layer enqueued, on whichever stream; should that wait
/// fail, the tensor's memory is leaked rather than freed under a kernel. Both waits are for
/// the whole device: create and drop weights when loading and unloading a model, not while
/// collectives are in flight (a collective waiting for a peer holds the wait until the peer
/// comes or, for tpfuse's kernels, the deadline passes).
pub struct Weight<T> {
    /// Keeps the allocation alive; never read through.
    tensor: Tensor,
    ptr: sys::CUdeviceptr,
    len: usize,
    group: Arc<CudaStream>,
    candle: Arc<CudaStream>,
    element: PhantomData<T>,
}

impl<T: CudaDType + WithDType> Weight<T> {
    /// Borrows `tensor` for a layer of `group` (its rank's device). Errors, naming what is
    /// wrong: a CPU tensor, another device, a non-contiguous layout, a dtype other than `T`.
    pub fn new(group: &TpGroup, tensor: &Tensor) -> Result<Weight<T>> {
        if tensor.dtype() != T::DTYPE {
            candle_core::bail!(
                "{WEIGHT}: the tensor is {:?}, not {:?}",
                tensor.dtype(),
                T::DTYPE
            )
        }
        let (storage, layout) = tensor.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            return cuda_only(WEIGHT);
        };
        let candle = storage.device.cuda_stream();
        let range = operand(WEIGHT, "the tensor", group, (storage, layout), &candle)?;
        let len = range.len();
        let view = storage.as_cuda_slice::<T>()?.slice(range);
        let ptr = {
            let (ptr, _read) = view.device_ptr(&candle);
            ptr
        };
        candle
            .context()
            .synchronize()
            .map_err(driver_error("waiting for candle's writes of a weight"))?;
        Ok(Weight {
            tensor: tensor.clone(),
            ptr,
            len,
            group: group.stream().clone(),
            candle,
            element: PhantomData,
        })
    }

    /// The borrowed tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }
}

impl<T> DeviceSlice<T> for Weight<T> {
    fn len(&self) -> usize {
        self.len
    }

    /// The group's stream (where the layers read it).
    fn stream(&self) -> &Arc<CudaStream> {
        &self.group
    }
}

impl<T> DevicePtr<T> for Weight<T> {
    /// The tensor's device address. Nothing to wait for or record: the tensor is never written
    /// while borrowed, [`Weight::new`] waited for its upload, and Drop for every read.
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> Drop for Weight<T> {
    /// Every stream's reads of the tensor end before it is released (then `tensor` drops).
    fn drop(&mut self) {
        if self.candle.context().synchronize().is_err() {
            std::mem::forget(self.tensor.clone());
        }
    }
}

impl<T> std::fmt::Debug for Weight<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weight")
            .field("shape", self.tensor.shape())
            .field("len", &self.len)
            .finish()
    }
}
