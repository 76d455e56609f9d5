//! Virtual ranks on GPU 0 ([`TpGroup::virtual_ranks`]) for the tests of the collectives and
//! the layers: one test at a time on the GPU, transfers on a rank's stream, and rounds that
//! enqueue one op per rank from one thread.
//!
//! # One test at a time, and `CUDA_DEVICE_MAX_CONNECTIONS`
//!
//! Every test holds one process-wide lock while it uses the GPU: the kernels of all W virtual
//! ranks must be resident at once, and a concurrent test's kernels would take the SMs the
//! CTA budget counted on (a deadlock that only the deadline ends).
//!
//! The driver maps streams onto `CUDA_DEVICE_MAX_CONNECTIONS` hardware queues (8 by
//! default). Two ranks whose streams share a queue are serialised: the later rank's kernel
//! waits behind the earlier one, which waits at a barrier for it — a hang until the deadline.
//! The variable is read when the CUDA context is created, so the first test of the binary to
//! take the lock sets it (when unset) before it opens the device.
#![allow(dead_code)]

use super::gpu::open_gpu0;
use super::Bits;
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr, DeviceRepr};
use std::sync::{Arc, Mutex, MutexGuard, Once};
use tpfuse::{GroupOptions, TpGroup};

/// One test at a time on the GPU (see the module docs).
static GPU_LOCK: Mutex<()> = Mutex::new(());
static MAX_CONNECTIONS: Once = Once::new();

/// GPU 0 for one test. Field order matters: the context drops before the lock is released.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    _lock: MutexGuard<'static, ()>,
}

/// The GPU lock, with `CUDA_DEVICE_MAX_CONNECTIONS` set (when unset) the first time.
pub fn gpu_lock() -> MutexGuard<'static, ()> {
    let lock = GPU_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    MAX_CONNECTIONS.call_once(|| {
        // Before the first CUDA call of this process (every test takes this lock before it
        // touches the driver), so that the context gets one hardware queue per stream.
        if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
            std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
        }
    });
    lock
}

/// GPU 0, with the lock held. A missing driver or GPU fails the test (it never skips).
pub fn gpu() -> Gpu {
    let lock = gpu_lock();
    let ctx = open_gpu0();
    Gpu { ctx, _lock: lock }
}

/// `world` virtual ranks on `ctx`.
pub fn virtual_group(ctx: &Arc<CudaContext>, world: usize, options: GroupOptions) -> Vec<TpGroup> {
    TpGroup::virtual_ranks(ctx, world, options)
        .unwrap_or_else(|e| panic!("building {world} virtual ranks: {e}"))
}

// ---------------------------------------------------------------------------------------
// Transfers on a rank's stream.
// ---------------------------------------------------------------------------------------

pub fn upload<T: DeviceRepr>(group: &TpGroup, host: &[T]) -> CudaSlice<T> {
    super::gpu::upload(group.stream(), host)
}

/// `n` elements holding [`Bits::poison`].
pub fn poisoned<T: Bits + DeviceRepr>(group: &TpGroup, n: usize) -> CudaSlice<T> {
    super::gpu::poisoned(group.stream(), n)
}

/// Overwrites `buf` with `host`.
pub fn refill<T: DeviceRepr>(group: &TpGroup, buf: &mut CudaSlice<T>, host: &[T]) {
    super::gpu::refill(group.stream(), buf, host);
}

/// Copies `buf` to the host on the group's stream. Call `check()` first: it bounds the wait
/// for kernels that might wait on a peer.
pub fn download<T: DeviceRepr>(group: &TpGroup, buf: &impl DevicePtr<T>) -> Vec<T> {
    group
        .stream()
        .clone_dtoh(buf)
        .expect("downloading from the GPU")
}

/// `hosts[r]` uploaded to rank r.
pub fn upload_ranks<T: DeviceRepr>(groups: &[TpGroup], hosts: &[Vec<T>]) -> Vec<CudaSlice<T>> {
    groups
        .iter()
        .zip(hosts)
        .map(|(g, x)| upload(g, x))
        .collect()
}

/// `host` uploaded to every rank.
pub fn upload_copies<T: DeviceRepr>(groups: &[TpGroup], host: &[T]) -> Vec<CudaSlice<T>> {
    groups.iter().map(|g| upload(g, host)).collect()
}

/// `n` poisoned elements on every rank.
pub fn poisoned_ranks<T: Bits + DeviceRepr>(groups: &[TpGroup], n: usize) -> Vec<CudaSlice<T>> {
    groups.iter().map(|g| poisoned(g, n)).collect()
}

/// `bufs[r]` downloaded from rank r (call `check()` first, see [`download`]).
pub fn download_ranks<T: DeviceRepr>(groups: &[TpGroup], bufs: &[CudaSlice<T>]) -> Vec<Vec<T>> {
    groups
        .iter()
        .zip(bufs)
        .map(|(g, b)| download(g, b))
        .collect()
}

// ---------------------------------------------------------------------------------------
// Rounds.
// ---------------------------------------------------------------------------------------

/// `check()` on every rank.
pub fn check_all(groups: &[TpGroup], label: &str) {
    for g in groups {
        g.check()
            .unwrap_or_else(|e| panic!("{label}: check() on rank {}: {e}", g.rank()));
    }
}

/// One virtual-rank round: `op(r)` enqueued for r = 0, 1, .., W-1 from this thread, then
/// `check()` on every rank. Returns what each rank's op returned.
pub fn round<R>(
    groups: &[TpGroup],
    label: &str,
    mut op: impl FnMut(usize) -> tpfuse::Result<R>,
) -> Vec<R> {
    let results: Vec<R> = (0..groups.len())
        .map(|r| op(r).unwrap_or_else(|e| panic!("{label}: rank {r}: {e}")))
        .collect();
    check_all(groups, label);
    results
}
