//! What the kernels move and how often they synchronise, counted by the emulator per launch
//! and per block: the performance evidence a machine without a GPU can give (load balance
//! across blocks, global-memory bytes against the minimum an op must move, bytes read from
//! and written to other ranks, cross-rank barriers, ldmatrix bank conflicts). Nothing here is
//! a time.
//!
//! Virtual ranks share one device, so a [`TpGroup::virtual_ranks`](crate::TpGroup::virtual_ranks)
//! group tags each rank's symmetric memory and stream with its rank ([`tag_memory`],
//! [`tag_stream`]); a load (a store) is a peer read (write) when the memory's rank and the
//! launching stream's rank are both known and differ.
//!
//! Counting covers the kernels' data accesses (the load and store helpers of
//! `cuda/common.cuh` and `cp.async`); the barriers' flags and epochs count as barriers, not
//! bytes. Only launches that complete while counting leave records: synchronise before
//! reading them.

use crate::ffi::emu as sys;
use std::ffi::c_void;
use std::ops::AddAssign;

/// One block's counts (or a sum of them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCounters {
    /// Bytes loaded from global memory (peers' buffers included).
    pub global_read_bytes: u64,
    /// Bytes stored to global memory.
    pub global_write_bytes: u64,
    /// Bytes loaded from memory tagged with another rank than the launching stream's.
    pub peer_read_bytes: u64,
    /// Bytes stored to memory tagged with another rank than the launching stream's.
    pub peer_write_bytes: u64,
    /// Cross-rank barriers passed.
    pub barriers: u64,
    /// ldmatrix shared-memory bank conflicts: per 8-row phase, the most rows in one bank,
    /// less one.
    pub ldmatrix_conflicts: u64,
}

impl BlockCounters {
    /// Bytes that crossed to or from another rank's memory: peer reads and peer writes.
    pub fn peer_bytes(&self) -> u64 {
        self.peer_read_bytes + self.peer_write_bytes
    }
}

impl AddAssign for BlockCounters {
    fn add_assign(&mut self, o: Self) {
        self.global_read_bytes += o.global_read_bytes;
        self.global_write_bytes += o.global_write_bytes;
        self.peer_read_bytes += o.peer_read_bytes;
        self.peer_write_bytes += o.peer_write_bytes;
        self.barriers += o.barriers;
        self.ldmatrix_conflicts += o.ldmatrix_conflicts;
    }
}

/// One completed launch.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchCounters {
    /// The kernel instantiation, as the emulator's report names it (e.g.
    /// `one_shot_kernel<T> [T = __half]`).
    pub kernel: String,
    /// The rank tag of the launching stream.
    pub rank: Option<usize>,
    /// Index = `blockIdx.x`.
    pub blocks: Vec<BlockCounters>,
}

impl LaunchCounters {
    /// The sum over the blocks.
    pub fn total(&self) -> BlockCounters {
        let mut t = BlockCounters::default();
        for b in &self.blocks {
            t += *b;
        }
        t
    }

    /// Load balance of the peer reads: the largest block's bytes over the mean (1.0 is
    /// perfect balance); `None` when no block read a peer's memory.
    pub fn peer_read_balance(&self) -> Option<f64> {
        let total = self.total().peer_read_bytes;
        if total == 0 || self.blocks.is_empty() {
            return None;
        }
        let max = self.blocks.iter().map(|b| b.peer_read_bytes).max()?;
        Some(max as f64 * self.blocks.len() as f64 / total as f64)
    }
}

/// Clears the records and starts counting (launches already running are not counted).
pub fn start() {
    // SAFETY: no arguments.
    unsafe { sys::tpfuse_emu_counters_start() }
}

/// Stops counting; the records stay until the next [`start`].
pub fn stop() {
    // SAFETY: no arguments.
    unsafe { sys::tpfuse_emu_counters_stop() }
}

/// The records since the last [`start`], in completion order.
pub fn records() -> Vec<LaunchCounters> {
    // SAFETY: a null buffer of capacity 0 only asks for the count.
    let n = unsafe { sys::tpfuse_emu_counters_blocks(std::ptr::null_mut(), 0) };
    let mut raw = vec![sys::tpfuse_emu_block_counters::default(); n];
    // SAFETY: `raw` holds `n` records; the call writes at most that many.
    let n = unsafe { sys::tpfuse_emu_counters_blocks(raw.as_mut_ptr(), raw.len()) }.min(raw.len());
    let mut launches: Vec<LaunchCounters> = Vec::new();
    for b in &raw[..n] {
        if launches.len() as u64 <= b.launch {
            launches.push(LaunchCounters {
                kernel: launch_name(b.launch),
                rank: usize::try_from(b.rank).ok(),
                blocks: Vec::new(),
            });
        }
        if let Some(l) = launches.last_mut() {
            l.blocks.push(BlockCounters {
                global_read_bytes: b.global_read_bytes,
                global_write_bytes: b.global_write_bytes,
                peer_read_bytes: b.peer_read_bytes,
                peer_write_bytes: b.peer_write_bytes,
                barriers: b.barriers,
                ldmatrix_conflicts: b.ldmatrix_conflicts,
            });
        }
    }
    launches
}

/// Counts the launches that `f` runs to completion (it must synchronise what it launches):
/// [`start`], `f`, [`stop`], [`records`].
pub fn count<R>(f: impl FnOnce() -> R) -> (R, Vec<LaunchCounters>) {
    start();
    let r = f();
    stop();
    (r, records())
}

fn launch_name(launch: u64) -> String {
    super::read_text(|buf, cap| {
        // SAFETY: `buf` holds `cap` bytes (or is null with cap 0).
        unsafe { sys::tpfuse_emu_counters_launch_name(launch, buf, cap) }
    })
}

/// Tags `bytes` bytes of device memory at `ptr` as rank `rank`'s (until freed).
pub fn tag_memory(ptr: u64, bytes: usize, rank: usize) {
    // SAFETY: only records the range; nothing is dereferenced.
    unsafe { sys::tpfuse_emu_tag_memory(ptr as *const c_void, bytes, rank as i32) }
}

/// Tags a stream of the emulated driver as rank `rank`'s.
pub fn tag_stream(stream: &cudarc::driver::CudaStream, rank: usize) {
    // SAFETY: a live stream of the emulated driver (its CUstream is the emulator's stream).
    unsafe { sys::tpfuse_emu_tag_stream(stream.cu_stream().cast(), rank as i32) }
}
