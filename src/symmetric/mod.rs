//! Symmetric memory: buffers mapped on every rank of a group, plus signal pads.
//!
//! A custom collective kernel sees a table of W device pointers to data buffers and W
//! pointers to signal pads, one of each per rank, all addressable by every rank
//! (`tpfuse_peers` in `cuda/tpfuse.h`). Per rank:
//!
//! - one data allocation of `2 * capacity` bytes: staging at offset 0 (each rank's input is
//!   copied there by its own kernel), results at offset `capacity` (two-shot's reduced
//!   slices, one-shot's RMSNorm partials, the fused kernels' two exchange halves);
//! - one signal pad of [`SIGNAL_PAD_BYTES`] (per-block barrier flags, per-block epochs, the
//!   error word, the fused kernels' flags and their packet area: about 2.4 MiB), zeroed once
//!   at creation and never reset: the barriers count up, the fused kernels' counts go back
//!   to 0 within the launch that raised them, and the packets are cleared by the kernel that
//!   reads them.
//!
//! Three ways fill the table, and the kernels cannot tell them apart:
//!
//! 1. [`virtual_ranks`]: W ranks on one device; every rank's table holds all W buffers;
//! 2. [`peer_access`]: one process, one GPU per rank, peer access enabled between every
//!    pair, the table holds unified (UVA) addresses;
//! 3. [`ipc`]: one rank per process; CUDA IPC handles of every rank's buffers are exchanged
//!    over the group's NCCL communicator and opened by every peer.
//!
//! Memory comes from the plain driver allocator (`cuMemAlloc`), never from cudarc's
//! stream-ordered pools: pool memory cannot be exported with `cuIpcGetMemHandle`. Every
//! capacity is rounded up to a multiple of [`CAPACITY_ALIGN`] bytes, so every buffer, and
//! the result half of every buffer, is 256-byte aligned.
//!
//! Memory is freed (or, for a peer's buffer opened through IPC, closed) when the last
//! workspace that references it is dropped. Nothing here waits for kernels: the owner (a
//! [`TpGroup`](crate::TpGroup)) drains its stream before it drops its workspace. That is not
//! enough on its own: a peer's kernel may still read this rank's buffers after this rank's
//! stream drained (no barrier closes a launch), so with one rank per process the group frees
//! its own allocations only once every peer has passed a host barrier after draining (and
//! leaks them otherwise); with one process, every rank's workspace holds every rank's buffers,
//! which are freed after the last group drained its stream.

use crate::comm::Comm;
use crate::device::{cuda, require_driver};
use crate::error::{Error, Result};
use crate::ffi::kernels;
use cudarc::driver::{sys, CudaContext, CudaStream, DriverError};
use std::ffi::{c_char, c_void};
use std::sync::Arc;

mod cross_process;
pub use cross_process::ipc;
pub(crate) use cross_process::{exchange, ipc_outcome, IpcOutcome};

/// The most ranks of a group (`TPFUSE_MAX_RANKS`).
pub const MAX_RANKS: usize = kernels::TPFUSE_MAX_RANKS as usize;

/// Bytes of one rank's signal pad (`TPFUSE_SIGNAL_PAD_BYTES`).
pub const SIGNAL_PAD_BYTES: usize = kernels::TPFUSE_SIGNAL_PAD_BYTES as usize;

/// Every capacity is rounded up to a multiple of this many bytes.
pub const CAPACITY_ALIGN: usize = 256;

/// Bytes of a `CUipcMemHandle`.
const IPC_HANDLE_BYTES: usize = 64;

/// Offset of the error word in a signal pad.
const ERROR_OFFSET: usize = kernels::TPFUSE_SIGNAL_ERROR_OFFSET as usize;

// The pad layout the Rust side relies on (flags[MAX_BLOCKS][MAX_RANKS] u32, then
// counters[MAX_BLOCKS] u32, then the error word), checked at compile time against the header.
const _: () = {
    let blocks = kernels::TPFUSE_MAX_BLOCKS as usize;
    assert!(kernels::TPFUSE_SIGNAL_FLAGS_OFFSET == 0);
    assert!(kernels::TPFUSE_SIGNAL_COUNTERS_OFFSET as usize == 4 * blocks * MAX_RANKS);
    assert!(ERROR_OFFSET == kernels::TPFUSE_SIGNAL_COUNTERS_OFFSET as usize + 4 * blocks);
    assert!(ERROR_OFFSET + 4 <= SIGNAL_PAD_BYTES);
    assert!(CAPACITY_ALIGN % 16 == 0);
};

/// `capacity` rounded up to a multiple of [`CAPACITY_ALIGN`]; `None` when it is 0 or when
/// the data allocation (`2 *` the rounded capacity) would not fit in a `usize`.
///
/// ```
/// use tpfuse::symmetric::round_capacity;
/// assert_eq!(round_capacity(1), Some(256));
/// assert_eq!(round_capacity(8 << 20), Some(8 << 20));
/// assert_eq!(round_capacity(0), None);
/// ```
pub fn round_capacity(capacity: usize) -> Option<usize> {
    if capacity == 0 {
        return None;
    }
    let rounded = capacity.checked_next_multiple_of(CAPACITY_ALIGN)?;
    rounded.checked_mul(2)?;
    Some(rounded)
}

/// Checks a world size against the kernels' limits: 2 ..= [`MAX_RANKS`]; `arg` names the
/// argument the size came from.
pub(crate) fn check_world(arg: &str, world: usize) -> Result<()> {
    if !(2..=MAX_RANKS).contains(&world) {
        return Err(Error::invalid(
            arg,
            format!(
                "world size {world}: the custom kernels take 2 to {MAX_RANKS} ranks \
                 (a single rank has nothing to exchange)"
            ),
        ));
    }
    Ok(())
}

fn checked_capacity(arg: &str, capacity: usize) -> Result<usize> {
    round_capacity(capacity).ok_or_else(|| {
        Error::invalid(
            arg,
            format!(
                "{capacity} bytes: the capacity must be at least 1 byte and twice it, rounded \
                 up to {CAPACITY_ALIGN} bytes, must be addressable"
            ),
        )
    })
}

/// One device allocation of this process, or a peer's allocation opened through CUDA IPC.
/// Drop frees it (`cuMemFree`) or closes it (`cuIpcCloseMemHandle`) with its context
/// current.
#[derive(Debug)]
pub(crate) struct DeviceMemory {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
    imported: bool,
}

impl DeviceMemory {
    /// `bytes` of device memory on `ctx`'s device, from `cuMemAlloc` (exportable by IPC).
    fn allocate(ctx: &Arc<CudaContext>, bytes: usize, what: &'static str) -> Result<Self> {
        ctx.bind_to_thread().map_err(cuda("binding the context"))?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is current on this thread; writes one device pointer.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }
            .result()
            .map_err(cuda(what))?;
        Ok(DeviceMemory {
            ctx: ctx.clone(),
            ptr,
            bytes,
            imported: false,
        })
    }

    /// Enqueues zeroes over the whole allocation on the context's null stream; the caller
    /// synchronizes the context before anyone reads it.
    fn enqueue_zero(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda("binding the context"))?;
        // SAFETY: `ptr` is a live allocation of `bytes` bytes of this context.
        unsafe { sys::cuMemsetD8_v2(self.ptr, 0, self.bytes) }
            .result()
            .map_err(cuda("zeroing a signal pad (cuMemsetD8)"))
    }

    /// The IPC handle of this allocation.
    fn export(&self) -> std::result::Result<[u8; IPC_HANDLE_BYTES], DriverError> {
        self.ctx.bind_to_thread()?;
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: `ptr` is the base of a cuMemAlloc allocation of the current context;
        // writes one handle.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, self.ptr) }.result()?;
        Ok(handle.reserved.map(|c| c as u8))
    }

    /// Opens a peer's allocation of `bytes` bytes from its IPC handle, in `ctx`.
    fn open(
        ctx: &Arc<CudaContext>,
        handle: &[u8],
        bytes: usize,
    ) -> std::result::Result<Self, DriverError> {
        ctx.bind_to_thread()?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        for (dst, src) in raw.reserved.iter_mut().zip(handle) {
            *dst = *src as c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: the context is current; the handle came from cuIpcGetMemHandle in another
        // process (the driver rejects anything else); writes one device pointer.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, raw, flags) }.result()?;
        Ok(DeviceMemory {
            ctx: ctx.clone(),
            ptr,
            bytes,
            imported: true,
        })
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated (or opened) in `ctx`, which the Arc keeps alive, and is
        // released exactly once. The context is pushed and popped so that the thread's
        // current context is what it was. Errors cannot be reported from Drop.
        unsafe {
            let pushed = sys::cuCtxPushCurrent_v2(self.ctx.cu_ctx()) == sys::CUresult::CUDA_SUCCESS;
            let _ = if self.imported {
                sys::cuIpcCloseMemHandle(self.ptr)
            } else {
                sys::cuMemFree_v2(self.ptr)
            };
            if pushed {
                let mut previous: sys::CUcontext = std::ptr::null_mut();
                let _ = sys::cuCtxPopCurrent_v2(&mut previous);
            }
        }
    }
}

/// What a rank's Drop keeps until it may free: its own allocations, once it has closed the
/// peers' buffers it had opened (see [`SymmetricWorkspace::release_imports`]).
pub(crate) struct OwnMemory {
    _held: Vec<Arc<DeviceMemory>>,
}

/// One rank's view of a group's symmetric memory: the data buffer and signal pad of every
/// rank, as this rank addresses them.
///
/// Shapes: `world()` entries in each table, index = rank; data buffers of
/// `2 * capacity()` bytes (staging `[0, capacity)`, results `[capacity, 2 * capacity)`),
/// signal pads of [`SIGNAL_PAD_BYTES`] bytes.
pub struct SymmetricWorkspace {
    rank: usize,
    capacity: usize,
    data: Vec<Arc<DeviceMemory>>,
    signals: Vec<Arc<DeviceMemory>>,
}

impl std::fmt::Debug for SymmetricWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex = |v: Vec<u64>| v.iter().map(|p| format!("{p:#x}")).collect::<Vec<_>>();
        f.debug_struct("SymmetricWorkspace")
            .field("rank", &self.rank)
            .field("world", &self.world())
            .field("capacity", &self.capacity)
            .field("data", &hex(self.data_pointers()))
            .field("signals", &hex(self.signal_pointers()))
            .finish()
    }
}

impl SymmetricWorkspace {
    /// This rank's index in the tables.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks (entries in each table).
    pub fn world(&self) -> usize {
        self.data.len()
    }

    /// Bytes of staging (and of results) per rank: the largest message, in bytes, a custom
    /// kernel takes. A multiple of [`CAPACITY_ALIGN`].
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// CUDA ordinal of the device this rank's own buffers live on.
    pub fn device(&self) -> usize {
        self.signals[self.rank].ctx.ordinal()
    }

    /// The data buffers of ranks `0..world`, as device addresses in this rank's address
    /// space (for diagnostics and tests; the kernels get them through the crate).
    pub fn data_pointers(&self) -> Vec<u64> {
        self.data.iter().map(|m| m.ptr).collect()
    }

    /// The signal pads of ranks `0..world`, as device addresses in this rank's address space.
    pub fn signal_pointers(&self) -> Vec<u64> {
        self.signals.iter().map(|m| m.ptr).collect()
    }

    /// The table the kernels take: entries `0..world` filled, the rest null.
    pub(crate) fn table(&self) -> kernels::tpfuse_peers {
        let mut table = kernels::tpfuse_peers {
            data: [std::ptr::null_mut(); MAX_RANKS],
            signals: [std::ptr::null_mut(); MAX_RANKS],
        };
        for (r, (d, s)) in self.data.iter().zip(&self.signals).enumerate() {
            table.data[r] = d.ptr as *mut c_void;
            table.signals[r] = s.ptr as *mut u32;
        }
        table
    }

    /// This rank's error word (0, or `TPFUSE_ERROR_* | peer`): a 4-byte copy from its own
    /// pad to the host on `stream`, which is then synchronized. `stream` must belong to the
    /// device of this rank's pad. Call it once the kernels on `stream` are known to be done
    /// (the synchronization is not bounded).
    pub(crate) fn read_error_word(&self, stream: &CudaStream) -> Result<u32> {
        let mut word = [0u8; 4];
        self.read_own_pad(stream, ERROR_OFFSET, &mut word)?;
        Ok(u32::from_ne_bytes(word))
    }

    /// `dst.len()` bytes of this rank's own pad from byte `offset`, copied
    /// to the host on `stream`, which is then synchronized. `stream` must belong to the
    /// device of this rank's pad. Call it once the kernels on `stream` are known to be done
    /// (the synchronization is not bounded).
    pub(crate) fn read_own_pad(
        &self,
        stream: &CudaStream,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        let pad = &self.signals[self.rank];
        let device = stream.context().ordinal();
        if device != pad.ctx.ordinal() {
            return Err(Error::invalid(
                "stream",
                format!(
                    "lives on device {device}, the signal pad of rank {} on device {}",
                    self.rank,
                    pad.ctx.ordinal()
                ),
            ));
        }
        assert!(offset + dst.len() <= SIGNAL_PAD_BYTES, "inside the pad");
        stream
            .context()
            .bind_to_thread()
            .map_err(cuda("binding the context"))?;
        // SAFETY: reads dst.len() bytes inside this rank's live pad into `dst`. A
        // device-to-pageable host copy returns only once the copy is complete, and the stream
        // is synchronized before `dst` is read, so nothing writes `dst` after this returns.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr() as *mut c_void,
                pad.ptr + offset as u64,
                dst.len(),
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(cuda("reading this rank's signal pad"))?;
        // SAFETY: a live stream of the current context.
        unsafe { sys::cuStreamSynchronize(stream.cu_stream()) }
            .result()
            .map_err(cuda("waiting for the copy of this rank's signal pad"))?;
        Ok(())
    }

    /// Closes the peers' buffers this rank opened through IPC (now) and returns its own
    /// allocations, to be freed when the result is dropped. The workspace is gone: a group
    /// calls this in its Drop, then waits for its peers, then drops the result, so that no
    /// allocation is freed while a peer still maps it.
    pub(crate) fn release_imports(self) -> OwnMemory {
        let held = self
            .data
            .into_iter()
            .chain(self.signals)
            .filter(|m| !m.imported)
            .collect();
        OwnMemory { _held: held }
    }
}

/// One data buffer and one zeroed pad per rank, all on one device.
fn allocate_rank(ctx: &Arc<CudaContext>, capacity: usize) -> Result<(DeviceMemory, DeviceMemory)> {
    let data = DeviceMemory::allocate(
        ctx,
        2 * capacity,
        "allocating a symmetric data buffer (cuMemAlloc)",
    )?;
    let pad = DeviceMemory::allocate(
        ctx,
        SIGNAL_PAD_BYTES,
        "allocating a signal pad (cuMemAlloc)",
    )?;
    pad.enqueue_zero()?;
    Ok((data, pad))
}

fn workspaces(
    capacity: usize,
    data: Vec<Arc<DeviceMemory>>,
    signals: Vec<Arc<DeviceMemory>>,
) -> Vec<SymmetricWorkspace> {
    (0..data.len())
        .map(|rank| SymmetricWorkspace {
            rank,
            capacity,
            data: data.clone(),
            signals: signals.clone(),
        })
        .collect()
}

/// Virtual ranks: `world` data buffers of `2 * capacity` bytes (capacity rounded up to
/// [`CAPACITY_ALIGN`]) and `world` zeroed signal pads, all on `ctx`'s device. Returns one
/// workspace per rank, index = rank; all hold the same table and share the allocations,
/// which are freed when the last of them is dropped.
///
/// Errors: [`Error::InvalidArgument`] for `world` outside 2 ..= [`MAX_RANKS`] or a zero
/// `capacity`; [`Error::Cuda`] when an allocation fails.
pub fn virtual_ranks(
    ctx: &Arc<CudaContext>,
    world: usize,
    capacity: usize,
) -> Result<Vec<SymmetricWorkspace>> {
    check_world("world", world)?;
    let capacity = checked_capacity("capacity", capacity)?;
    require_driver()?;
    let mut data = Vec::with_capacity(world);
    let mut signals = Vec::with_capacity(world);
    for _rank in 0..world {
        let (d, s) = allocate_rank(ctx, capacity)?;
        // The ranks share one device: the emulator's counters tell their memory apart.
        #[cfg(feature = "emulator")]
        for m in [&d, &s] {
            crate::emulator::counters::tag_memory(m.ptr, m.bytes, _rank);
        }
        data.push(Arc::new(d));
        signals.push(Arc::new(s));
    }
    ctx.synchronize()
        .map_err(cuda("waiting for the signal pads to be zeroed"))?;
    Ok(workspaces(capacity, data, signals))
}

/// One process, one GPU per rank: rank `i` allocates on `ctxs[i]`, peer access is enabled
/// between every pair of contexts (and stays enabled), and every rank's table holds the
/// same unified addresses. Returns one workspace per rank, index = rank.
///
/// Errors: [`Error::InvalidArgument`] for a number of contexts outside 2 ..=
/// [`MAX_RANKS`], a device listed twice, a zero `capacity`, or a pair of devices without
/// peer access (`cuDeviceCanAccessPeer`; the message names both ranks and devices);
/// [`Error::Cuda`] when enabling peer access or an allocation fails.
pub fn peer_access(ctxs: &[Arc<CudaContext>], capacity: usize) -> Result<Vec<SymmetricWorkspace>> {
    match peer_access_outcome(ctxs, capacity)? {
        Ok(ws) => Ok(ws),
        Err(reason) => Err(Error::invalid("ctxs", reason)),
    }
}

/// [`peer_access`], with "peer access is not possible between these devices" as the inner
/// `Err(reason)` so that a group can fall back to NCCL instead of failing.
pub(crate) fn peer_access_outcome(
    ctxs: &[Arc<CudaContext>],
    capacity: usize,
) -> Result<std::result::Result<Vec<SymmetricWorkspace>, String>> {
    check_world("ctxs", ctxs.len())?;
    let capacity = checked_capacity("capacity", capacity)?;
    require_driver()?;
    for (i, a) in ctxs.iter().enumerate() {
        if let Some(j) = ctxs[..i]
            .iter()
            .position(|b| b.cu_device() == a.cu_device())
        {
            return Err(Error::invalid(
                "ctxs",
                format!(
                    "ranks {j} and {i} are both on device {}: one GPU per rank (use virtual \
                     ranks to put several ranks on one GPU)",
                    a.ordinal()
                ),
            ));
        }
    }
    for (i, a) in ctxs.iter().enumerate() {
        for (j, b) in ctxs.iter().enumerate() {
            if i == j {
                continue;
            }
            let mut can = 0;
            // SAFETY: two valid devices; writes one int.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
                .result()
                .map_err(cuda("cuDeviceCanAccessPeer"))?;
            if can == 0 {
                return Ok(Err(format!(
                    "rank {i} (device {}) cannot access the memory of rank {j} (device {}): \
                     the driver reports no peer access between them (cuDeviceCanAccessPeer)",
                    a.ordinal(),
                    b.ordinal()
                )));
            }
        }
    }
    for (i, a) in ctxs.iter().enumerate() {
        a.bind_to_thread().map_err(cuda("binding the context"))?;
        for (j, b) in ctxs.iter().enumerate() {
            if i == j {
                continue;
            }
            // SAFETY: `a` is current; `b` is a live context of another device.
            let rc = unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) };
            match rc {
                sys::CUresult::CUDA_SUCCESS
                | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                sys::CUresult::CUDA_ERROR_TOO_MANY_PEERS
                | sys::CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED => {
                    return Ok(Err(format!(
                        "enabling peer access from rank {i} (device {}) to rank {j} (device \
                         {}) failed: {}",
                        a.ordinal(),
                        b.ordinal(),
                        DriverError(rc)
                    )));
                }
                other => {
                    return Err(Error::Cuda {
                        context: "enabling peer access (cuCtxEnablePeerAccess)",
                        source: DriverError(other),
                    })
                }
            }
        }
    }
    let mut data = Vec::with_capacity(ctxs.len());
    let mut signals = Vec::with_capacity(ctxs.len());
    for ctx in ctxs {
        let (d, s) = allocate_rank(ctx, capacity)?;
        data.push(Arc::new(d));
        signals.push(Arc::new(s));
    }
    for ctx in ctxs {
        ctx.synchronize()
            .map_err(cuda("waiting for the signal pads to be zeroed"))?;
    }
    Ok(Ok(workspaces(capacity, data, signals)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_round_up_to_256_bytes() {
        assert_eq!(round_capacity(0), None);
        assert_eq!(round_capacity(1), Some(256));
        assert_eq!(round_capacity(256), Some(256));
        assert_eq!(round_capacity(257), Some(512));
        assert_eq!(round_capacity(usize::MAX), None);
        assert_eq!(round_capacity(usize::MAX / 2 + 1), None);
        assert_eq!(
            round_capacity(usize::MAX / 2 - 1000),
            Some(usize::MAX / 2 - 767)
        );
    }

    #[test]
    fn world_sizes_outside_two_to_eight_are_refused() {
        for w in [0, 1, 9, 100] {
            let e = check_world("world", w).unwrap_err().to_string();
            assert!(e.contains("`world`") && e.contains(&format!("{w}")), "{e}");
        }
        for w in 2..=8 {
            assert!(check_world("world", w).is_ok());
        }
    }
}
