//! The workspace a layer's unfused path writes and reads back (the row-parallel partial
//! product): any cudarc buffer that is both readable and writable, passed as
//! `Option<&mut dyn Workspace<T>>` so that a call that fuses needs none.

use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use std::sync::Arc;

/// A buffer a layer may write and read back: `CudaSlice<T>` and `CudaViewMut<T>` (any
/// cudarc buffer that is both [`DevicePtr`] and [`DevicePtrMut`]).
pub trait Workspace<T>: DevicePtr<T> + DevicePtrMut<T> {}

impl<T, B: DevicePtr<T> + DevicePtrMut<T>> Workspace<T> for B {}

/// A `&mut dyn Workspace<T>` as a sized cudarc buffer, for the ops that take `impl
/// DevicePtr<T> + DevicePtrMut<T>`.
pub(super) struct Borrowed<'a, T>(pub(super) &'a mut dyn Workspace<T>);

impl<T> DeviceSlice<T> for Borrowed<'_, T> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.0.stream()
    }
}

impl<T> DevicePtr<T> for Borrowed<'_, T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.0.device_ptr(stream)
    }
}

impl<T> DevicePtrMut<T> for Borrowed<'_, T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.0.device_ptr_mut(stream)
    }
}
