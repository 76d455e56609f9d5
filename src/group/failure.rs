//! How a group learns that a custom kernel failed, and remembers it.
//!
//! - [`HostErrorWord`]: each rank's error word in mapped host memory. A launch that does not
//!   complete (a peer timed out, the ranks launched different things, or the group was
//!   poisoned before it started) copies its error word there, so the host can read it at any
//!   time without waiting for the stream: every launch path checks it first, and
//!   [`TpGroup::failure`](super::TpGroup::failure) reports it (also for launches replayed
//!   from a CUDA graph, which no host call sees).
//! - [`Poison`]: the flag (with its first reason) that makes a group refuse further work,
//!   shared by the groups built together in one process.
//! - [`error_of_word`]: what an error word means, as an [`Error`].

use crate::device::cuda;
use crate::error::{Error, Result};
use crate::ffi::kernels;
use cudarc::driver::{sys, CudaContext};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The poison flag, shared by the groups built together in one process.
#[derive(Debug, Default)]
pub(super) struct Poison {
    flag: AtomicBool,
    reason: OnceLock<String>,
}

impl Poison {
    pub(super) fn set(&self, reason: String) {
        let _ = self.reason.set(reason);
        self.flag.store(true, Ordering::Release);
    }

    pub(super) fn reason(&self) -> Option<String> {
        if !self.flag.load(Ordering::Acquire) {
            return None;
        }
        Some(
            self.reason
                .get()
                .cloned()
                .unwrap_or_else(|| "an earlier failure".to_string()),
        )
    }
}

/// One rank's error word in mapped, pinned host memory (`cuMemHostAlloc` with
/// `DEVICEMAP | PORTABLE`): the kernels store to it through its device address with
/// `st.release.sys`, the host reads it with an atomic load, never through the stream.
pub(crate) struct HostErrorWord {
    host: *mut u32,
    device: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is owned by this value and freed once, in Drop (with its context
// bound); the word is only accessed atomically (through `&self` too), so sharing is sound.
unsafe impl Send for HostErrorWord {}
unsafe impl Sync for HostErrorWord {}

impl HostErrorWord {
    /// A zeroed word, mapped into the address space of `ctx`'s device.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<HostErrorWord> {
        ctx.bind_to_thread().map_err(cuda("binding the context"))?;
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: allocates 4 bytes of pinned host memory into `host`.
        unsafe { sys::cuMemHostAlloc(&mut host, std::mem::size_of::<u32>(), flags) }
            .result()
            .map_err(cuda("allocating the host-mapped error word"))?;
        let mut word = HostErrorWord {
            host: host.cast(),
            device: 0,
            ctx: ctx.clone(),
        };
        word.atomic().store(0, Ordering::Release);
        // SAFETY: `host` is a live DEVICEMAP allocation; flags must be 0. On failure `word`
        // frees it.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut word.device, host, 0) }
            .result()
            .map_err(cuda("mapping the host error word into the device"))?;
        Ok(word)
    }

    fn atomic(&self) -> &AtomicU32 {
        // SAFETY: `host` is a live, 4-byte aligned allocation owned by self, accessed only
        // atomically by the host (the device's accesses are system-scope atomics).
        unsafe { AtomicU32::from_ptr(self.host) }
    }

    /// The word as the kernels last left it: 0, or `TPFUSE_ERROR_* | peer`. Never waits.
    pub(crate) fn read(&self) -> u32 {
        self.atomic().load(Ordering::Acquire)
    }

    /// The word's device address, for `tpfuse_group_args.host_error`.
    pub(crate) fn device_ptr(&self) -> *mut u32 {
        self.device as *mut u32
    }
}

impl Drop for HostErrorWord {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once; the owner drops it only
        // after its stream drained (or leaks it).
        let _ = unsafe { sys::cuMemFreeHost(self.host.cast()) };
    }
}

/// The error an error word stands for, seen by `rank` of a group whose deadline is
/// `timeout`; `None` for 0.
pub(crate) fn error_of_word(word: u32, rank: usize, timeout: Duration) -> Option<Error> {
    let peer = (word & 0xff) as usize;
    if word == 0 {
        None
    } else if word & kernels::TPFUSE_ERROR_PEER_TIMEOUT != 0 {
        Some(Error::PeerTimeout {
            rank,
            peer,
            after: timeout,
        })
    } else if word & kernels::TPFUSE_ERROR_GRID_TIMEOUT != 0 {
        Some(Error::Timeout {
            what: format!(
                "the blocks of one launch of rank {peer} to meet (they were not all resident \
                 at once: other work holding SMs, or more blocks than the GPU runs together); \
                 the group is poisoned, rebuild it"
            ),
            after: timeout,
        })
    } else if word & kernels::TPFUSE_ERROR_PEER_MISMATCH != 0 {
        let noticed = ((word >> 16) & 0xff) as usize;
        Some(Error::PeerMismatch {
            rank,
            ranks: [peer.min(noticed), peer.max(noticed)],
        })
    } else {
        Some(Error::GroupPoisoned(format!(
            "rank {rank}: the kernels recorded error word {word:#x}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poison_keeps_the_first_reason() {
        let p = Poison::default();
        assert_eq!(p.reason(), None);
        p.set("first".to_string());
        p.set("second".to_string());
        assert_eq!(p.reason().as_deref(), Some("first"));
    }

    #[test]
    fn error_words_name_the_peer() {
        let t = Duration::from_secs(3);
        assert!(error_of_word(0, 1, t).is_none());
        let timeout = error_of_word(kernels::TPFUSE_ERROR_PEER_TIMEOUT | 5, 1, t).unwrap();
        assert!(matches!(
            timeout,
            Error::PeerTimeout { rank: 1, peer: 5, after } if after == t
        ));
        let word = kernels::TPFUSE_ERROR_PEER_MISMATCH | 2 | 1 << 16;
        let mismatch = error_of_word(word, 0, t).unwrap();
        assert!(matches!(
            mismatch,
            Error::PeerMismatch {
                rank: 0,
                ranks: [1, 2]
            }
        ));
        let grid = error_of_word(kernels::TPFUSE_ERROR_GRID_TIMEOUT | 3, 3, t).unwrap();
        assert!(
            matches!(&grid, Error::Timeout { what, after } if what.contains("rank 3") && *after == t),
            "{grid}"
        );
        let other = error_of_word(0x4000, 3, t).unwrap().to_string();
        assert!(
            other.contains("0x4000") && other.contains("rank 3"),
            "{other}"
        );
    }
}
