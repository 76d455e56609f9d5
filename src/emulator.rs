//! The CPU emulator (feature `emulator`): tpfuse's CUDA kernels compiled as host C++ and run
//! on an emulated device, so that every kernel executes, on fresh inputs, on a machine with no
//! GPU. How it works and what it cannot show: `docs/emulator.md`.
//!
//! With the feature on, the kernel launchers ([`abi`]) take the emulator's streams
//! ([`Stream`]) and its device memory ([`DeviceBuffer`], host memory underneath), exactly as
//! they take a `CUstream` and device pointers on a GPU. Device work runs on one device thread,
//! and only while a host thread waits for it ([`Stream::synchronize`]), so a run is
//! deterministic for a given [`Schedule`] and seed.

/// The C ABI of the kernel launchers (`cuda/tpfuse.h`), for tests that drive kernels
/// directly on the emulator's streams and memory.
pub use crate::ffi::kernels as abi;

pub mod counters;
pub mod litmus;

use crate::error::{Error, Result};
use crate::ffi::emu as sys;
use std::ffi::c_void;
use std::marker::PhantomData;

/// The order in which each scheduling pass resumes the runnable threads of all resident
/// blocks of all streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Blocks in the order they became resident, threads ascending.
    Forward,
    /// Both descending.
    Reverse,
    /// A fresh permutation every pass, drawn from the seed.
    Random(u64),
    /// Random block priorities with change points, drawn from the seed (probabilistic
    /// concurrency testing): the highest-priority block that can go on runs alone while
    /// every other stands still, so one block, or one rank, is held back while the rest run
    /// ahead, across launches too.
    Pct(u64),
}

/// How the emulated device's global memory orders the kernels' accesses (docs/emulator.md,
/// "Weak memory").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Sequentially consistent: every load reads the newest value.
    Sc,
    /// The PTX memory model: a weak load reads the oldest value the model allows it (the
    /// newest one its thread has synchronised with), so a missing release, acquire, barrier
    /// or scope shows as stale data.
    Weak,
    /// The PTX memory model, each weak load reading any value the model allows, drawn from
    /// the schedule's seed.
    WeakRandom,
}

/// The emulated device: how many SMs it has (each holds up to 2048 threads, 32 blocks and
/// 228 KiB of shared memory, like an H100's), the scheduling order, and the virtual time
/// without progress after which it reports a deadlock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// SMs (TPFUSE_EMU_SMS, default 132, an H100's).
    pub sms: u32,
    /// Scheduling order (TPFUSE_EMU_SCHEDULE=forward|reverse|random|pct, TPFUSE_EMU_SEED).
    pub schedule: Schedule,
    /// Nanoseconds of virtual time without progress before a deadlock is reported
    /// (TPFUSE_EMU_DEADLOCK_NS, default 60 s).
    pub deadlock_ns: u64,
    /// The SMs' compute capability, major · 10 + minor (TPFUSE_EMU_ARCH: 80, 86, 89, 90, 100
    /// or 120; default 90, an H100): their threads, blocks and shared memory, and what the
    /// device reports. Registers per kernel are sm_90a's on every architecture.
    pub arch: u32,
    /// Global memory's ordering (TPFUSE_EMU_MEMORY=sc|weak|weak-random, default sc).
    pub memory: Memory,
}

/// The configuration in force (the environment's, until [`set_config`]).
pub fn config() -> Config {
    let mut c = sys::tpfuse_emu_config::default();
    // SAFETY: writes one plain struct.
    unsafe { sys::tpfuse_emu_get_config(&mut c) };
    let schedule = match c.schedule as u32 {
        sys::TPFUSE_EMU_SCHEDULE_REVERSE => Schedule::Reverse,
        sys::TPFUSE_EMU_SCHEDULE_RANDOM => Schedule::Random(c.seed),
        sys::TPFUSE_EMU_SCHEDULE_PCT => Schedule::Pct(c.seed),
        _ => Schedule::Forward,
    };
    let memory = match c.memory as u32 {
        sys::TPFUSE_EMU_MEMORY_WEAK => Memory::Weak,
        sys::TPFUSE_EMU_MEMORY_WEAK_RANDOM => Memory::WeakRandom,
        _ => Memory::Sc,
    };
    Config {
        sms: c.sms as u32,
        schedule,
        deadlock_ns: c.deadlock_ns,
        arch: c.arch as u32,
        memory,
    }
}

/// Replaces the configuration. Fails while work is in flight on any stream.
pub fn set_config(config: &Config) -> Result<()> {
    let (schedule, seed) = match config.schedule {
        Schedule::Forward => (sys::TPFUSE_EMU_SCHEDULE_FORWARD, 0),
        Schedule::Reverse => (sys::TPFUSE_EMU_SCHEDULE_REVERSE, 0),
        Schedule::Random(seed) => (sys::TPFUSE_EMU_SCHEDULE_RANDOM, seed),
        Schedule::Pct(seed) => (sys::TPFUSE_EMU_SCHEDULE_PCT, seed),
    };
    let c = sys::tpfuse_emu_config {
        sms: i32::try_from(config.sms).unwrap_or(i32::MAX),
        schedule: schedule as i32,
        seed,
        deadlock_ns: config.deadlock_ns,
        arch: i32::try_from(config.arch).unwrap_or(0),
        memory: match config.memory {
            Memory::Sc => sys::TPFUSE_EMU_MEMORY_SC,
            Memory::Weak => sys::TPFUSE_EMU_MEMORY_WEAK,
            Memory::WeakRandom => sys::TPFUSE_EMU_MEMORY_WEAK_RANDOM,
        } as i32,
    };
    // SAFETY: reads one plain struct.
    let code = unsafe { sys::tpfuse_emu_set_config(&c) };
    emulator_result("tpfuse_emu_set_config", code, String::new())
}

/// Virtual time in nanoseconds: what `%globaltimer` reads in a kernel. It advances with
/// executed work, and jumps ahead while every thread only waits.
pub fn now_ns() -> u64 {
    // SAFETY: no arguments.
    unsafe { sys::tpfuse_emu_now_ns() }
}

/// How many kernels are loaded on emulated device `device`: by `cuFuncLoad`
/// ([`device::load_kernels`](crate::device::load_kernels)) or by a first use. The emulator
/// models CUDA's lazy loading strictly: a kernel's first use on a device waits for everything
/// enqueued on that device's streams (cuda/emu/loading.cpp).
pub fn loaded_kernels(device: usize) -> usize {
    let device = i32::try_from(device).unwrap_or(i32::MAX);
    // SAFETY: no pointers.
    unsafe { sys::tpfuse_emu_loaded_kernels(device) }
}

/// Runs the device until everything enqueued on every stream so far has completed (frees
/// that cudarc enqueued when its buffers dropped included); errors stay with their streams.
pub fn drain() {
    // SAFETY: no arguments.
    unsafe { sys::tpfuse_emu_device_synchronize() }
}

/// One line per kernel instantiation that ran in this process: launches, blocks, name.
pub fn report() -> String {
    read_text(|buf, cap| unsafe { sys::tpfuse_emu_report(buf, cap) })
}

fn read_text(fill: impl Fn(*mut std::ffi::c_char, usize) -> usize) -> String {
    let len = fill(std::ptr::null_mut(), 0);
    let mut buf = vec![0u8; len + 1];
    fill(buf.as_mut_ptr().cast(), buf.len());
    buf.truncate(len);
    String::from_utf8_lossy(&buf).into_owned()
}

fn emulator_result(context: &'static str, code: i32, message: String) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: returns a static string for any code.
    let name = unsafe { std::ffi::CStr::from_ptr(crate::ffi::kernels::tpfuse_error_string(code)) };
    Err(Error::Emulator {
        context,
        code,
        message: if message.is_empty() {
            name.to_string_lossy().into_owned()
        } else {
            format!("{}: {message}", name.to_string_lossy())
        },
    })
}

/// How a stream (a virtual rank) misbehaves, for fault tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fault {
    /// Work enqueued from now on starts only after this much virtual time.
    pub delay_ns: u64,
    /// Launches are dropped without running: a rank that never arrives.
    pub stop: bool,
    /// `%globaltimer` of this stream's kernels stays where it is now.
    pub freeze_timer: bool,
    /// `%clock64` of this stream's kernels advances this many times slower than at the
    /// emulated peak clock (0 and 1: at the peak): an SM at a low clock, on which the kernels'
    /// `%clock64` backstop ends a wait later than the host expects.
    pub clock_divisor: u32,
}

/// Sets the fault hooks of a stream the emulated CUDA driver created (through cudarc): a
/// [`TpGroup`](crate::TpGroup)'s stream, for instance.
pub fn set_cuda_stream_fault(stream: &cudarc::driver::CudaStream, fault: Fault) {
    set_fault_of(stream.cu_stream().cast(), fault);
}

fn set_fault_of(raw: *mut c_void, fault: Fault) {
    // SAFETY: a live stream of the emulator (every CUstream it hands out is one).
    unsafe {
        sys::tpfuse_emu_stream_set_fault(
            raw,
            fault.delay_ns,
            i32::from(fault.stop),
            i32::from(fault.freeze_timer),
        );
        sys::tpfuse_emu_stream_set_clock_divisor(raw, fault.clock_divisor);
    }
}

/// A stream of the emulated device. Its first device-side failure sticks to it.
#[derive(Debug)]
pub struct Stream {
    raw: *mut c_void,
}

// SAFETY: the emulator's streams are used from any host thread under its own lock.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new stream.
    pub fn new() -> Stream {
        // SAFETY: no arguments; the stream lives as long as the process.
        Stream {
            raw: unsafe { sys::tpfuse_emu_stream_create() },
        }
    }

    /// The handle a kernel launcher takes (`void *stream`).
    pub fn raw(&self) -> *mut c_void {
        self.raw
    }

    /// Makes this stream virtual rank `rank`'s: its launches are that rank's (the counters'
    /// peer bytes) and its own GPU (the scope `.gpu` of the weak memory model).
    pub fn set_rank(&self, rank: usize) {
        // SAFETY: a stream of this emulator.
        unsafe { sys::tpfuse_emu_tag_stream(self.raw, rank as i32) }
    }

    /// Runs the device until everything enqueued on this stream has completed; the stream's
    /// sticky error, with the emulator's explanation (a deadlock names its blocks).
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream.
        let code = unsafe { sys::tpfuse_emu_stream_synchronize(self.raw) };
        let message = if code == 0 {
            String::new()
        } else {
            read_text(|buf, cap| unsafe { sys::tpfuse_emu_stream_error(self.raw, buf, cap) })
        };
        emulator_result("stream synchronize", code, message)
    }

    /// Enqueues another stream's kernel on this stream: `sms` blocks that each hold a whole
    /// SM for `ns` of virtual time from when they start, so that launches made meanwhile find
    /// `sms` fewer SMs (an engine's kernel, NCCL's, or an MPS neighbour's on a GPU).
    pub fn occupy_sms(&self, sms: u32, ns: u64) -> Result<()> {
        let sms = i32::try_from(sms).unwrap_or(i32::MAX);
        // SAFETY: a live stream; no pointers.
        let code = unsafe { sys::tpfuse_emu_occupy_sms(self.raw, sms, ns) };
        emulator_result("tpfuse_emu_occupy_sms", code, String::new())
    }

    /// Sets this stream's fault hooks.
    pub fn set_fault(&self, fault: Fault) {
        set_fault_of(self.raw, fault);
    }
}

impl Default for Stream {
    fn default() -> Self {
        Stream::new()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: a live stream; its work finishes first.
        unsafe { sys::tpfuse_emu_stream_destroy(self.raw) };
    }
}

/// `len` elements of emulated device memory (host memory, 256-byte aligned), filled with
/// 0xFF bytes when allocated.
#[derive(Debug)]
pub struct DeviceBuffer<T: Copy> {
    ptr: *mut T,
    len: usize,
    _owns: PhantomData<T>,
}

// SAFETY: plain memory; the kernels that write it run only while the host waits.
unsafe impl<T: Copy + Send> Send for DeviceBuffer<T> {}
// SAFETY: as above.
unsafe impl<T: Copy + Sync> Sync for DeviceBuffer<T> {}

impl<T: Copy> DeviceBuffer<T> {
    /// `len` elements of poison (0xFF bytes: NaN for f32, f16 and bf16).
    pub fn new(len: usize) -> DeviceBuffer<T> {
        let bytes = len.max(1) * std::mem::size_of::<T>();
        // SAFETY: returns 256-byte aligned memory or null.
        let ptr = unsafe { sys::tpfuse_emu_malloc(bytes) }.cast::<T>();
        assert!(!ptr.is_null(), "emulator: out of memory for {bytes} bytes");
        DeviceBuffer {
            ptr,
            len,
            _owns: PhantomData,
        }
    }

    /// A copy of `data`.
    pub fn from_slice(data: &[T]) -> DeviceBuffer<T> {
        let mut b = DeviceBuffer::new(data.len());
        b.copy_from(data);
        b
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of the first element.
    pub fn ptr(&self) -> *mut T {
        self.ptr
    }

    /// Overwrites the contents (no kernel may be running on it: synchronize first).
    pub fn copy_from(&mut self, data: &[T]) {
        assert_eq!(data.len(), self.len, "copy_from: length");
        // SAFETY: both hold len elements and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr, self.len) };
    }

    /// The contents (no kernel may be running on it: synchronize first).
    pub fn to_vec(&self) -> Vec<T> {
        // SAFETY: len initialised elements (poison counts as initialised bytes).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

/// Frees the memory after every launch on the device completed, as `cudaFree` does (an
/// implicit device synchronisation), unless a stream is capturing a graph.
impl<T: Copy> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by tpfuse_emu_malloc.
        unsafe { sys::tpfuse_emu_free(self.ptr.cast()) };
    }
}

/// Each of the emulator's warp-level operations run by one warp of 32 lanes, for tests that
/// check the emulator itself against the PTX ISA.
pub mod probe {
    use super::{read_text, sys};
    use crate::error::Result;

    /// A probe's result; a failure carries the emulator's message of the failed launch.
    fn probe_result(context: &'static str, code: i32) -> Result<()> {
        let message = if code == 0 {
            String::new()
        } else {
            read_text(|buf, cap| unsafe { sys::tpfuse_emu_last_failure(buf, cap) })
        };
        super::emulator_result(context, code, message)
    }

    /// `mma.sync.m16n8k16.row.col.f32.{f16|bf16}` with per-lane registers: `a` 32 x 4,
    /// `b` 32 x 2, `c` 32 x 4 (lane-major); returns `d`, 32 x 4.
    pub fn mma(bf16: bool, a: &[u32; 128], b: &[u32; 64], c: &[f32; 128]) -> Result<[f32; 128]> {
        let mut d = [0f32; 128];
        // SAFETY: the arrays have the sizes the probe reads and writes.
        let code = unsafe {
            sys::tpfuse_emu_probe_mma(
                i32::from(bf16),
                a.as_ptr(),
                b.as_ptr(),
                c.as_ptr(),
                d.as_mut_ptr(),
            )
        };
        probe_result("probe mma", code).map(|_| d)
    }

    /// `ldmatrix.x4` from shared memory holding `smem`, lane `l` giving row address `addr[l]`
    /// (bytes); returns the four registers of each lane, 32 x 4.
    pub fn ldmatrix_x4(smem: &[u8], addr: &[u32; 32]) -> Result<[u32; 128]> {
        let mut out = [0u32; 128];
        // SAFETY: sizes as documented in tpfuse_emu.h.
        let code = unsafe {
            sys::tpfuse_emu_probe_ldmatrix_x4(
                smem.as_ptr().cast(),
                smem.len(),
                addr.as_ptr(),
                out.as_mut_ptr(),
            )
        };
        probe_result("probe ldmatrix", code).map(|_| out)
    }

    /// `__shfl_xor_sync(0xffffffff, input[l], lane_mask)` in every lane.
    pub fn shfl_xor(input: &[f32; 32], lane_mask: i32) -> Result<[f32; 32]> {
        let mut out = [0f32; 32];
        // SAFETY: 32 floats in and out.
        let code =
            unsafe { sys::tpfuse_emu_probe_shfl_xor(input.as_ptr(), lane_mask, out.as_mut_ptr()) };
        probe_result("probe shfl", code).map(|_| out)
    }

    /// Three cp.async groups of 16 bytes from `src` (the third with src-size 0) into
    /// poisoned shared memory; the 48 shared bytes after wait_group 2, 1 and 0.
    pub fn cp_async(src: &[u8; 48]) -> Result<[[u8; 48]; 3]> {
        let mut out = [0u8; 144];
        // SAFETY: 48 bytes in, 144 out.
        let code = unsafe { sys::tpfuse_emu_probe_cp_async(src.as_ptr().cast(), out.as_mut_ptr()) };
        probe_result("probe cp.async", code)?;
        let mut snaps = [[0u8; 48]; 3];
        for (i, snap) in snaps.iter_mut().enumerate() {
            snap.copy_from_slice(&out[48 * i..48 * (i + 1)]);
        }
        Ok(snaps)
    }

    /// A warp whose lanes from `active_lanes` on exit before a shuffle.
    pub fn partial_warp(active_lanes: i32) -> Result<()> {
        // SAFETY: no pointers.
        let code = unsafe { sys::tpfuse_emu_probe_partial_warp(active_lanes) };
        probe_result("probe partial warp", code)
    }

    /// One 16-byte global access `offset` bytes into an aligned buffer: a load (`kind` 0), a
    /// store (1) or a cp.async source (2).
    pub fn global_access(kind: i32, offset: i32) -> Result<()> {
        // SAFETY: no pointers.
        let code = unsafe { sys::tpfuse_emu_probe_global_access(kind, offset) };
        probe_result("probe global access", code)
    }

    /// One write through a plain pointer at `index` of 64 bytes of dynamic shared memory
    /// (`kind` 0) or of a 16-float `__shared__` array (1).
    pub fn shared_write(kind: i32, index: i32) -> Result<()> {
        // SAFETY: no pointers.
        let code = unsafe { sys::tpfuse_emu_probe_shared_write(kind, index) };
        probe_result("probe shared write", code)
    }

    /// A launch of `threads` threads with `smem_bytes` of dynamic shared memory, opted in
    /// first when `opt_in`.
    pub fn smem_launch(threads: i32, smem_bytes: usize, opt_in: bool) -> Result<()> {
        // SAFETY: no pointers.
        let code =
            unsafe { sys::tpfuse_emu_probe_smem_launch(threads, smem_bytes, i32::from(opt_in)) };
        probe_result("probe shared-memory launch", code)
    }

    /// `blocks` blocks of 1024 threads on `stream`, every block but the last waiting without
    /// a deadline for the last block's flag; the stream's error, with the emulator's message.
    pub fn wait_for_last_block(blocks: i32, stream: &super::Stream) -> Result<()> {
        // SAFETY: a live stream.
        let code = unsafe { sys::tpfuse_emu_probe_wait_for_last_block(blocks, stream.raw()) };
        if code != 0 {
            return stream
                .synchronize()
                .and(probe_result("probe wait for last block", code));
        }
        Ok(())
    }
}
