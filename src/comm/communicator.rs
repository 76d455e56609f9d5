//! `Comm`: a safe NCCL communicator over cudarc buffers.
//!
//! Every communicator is created non-blocking (`config.blocking = 0`), so no NCCL call can
//! hold the host forever: a call that answers `ncclInProgress` is polled with
//! `ncclCommGetAsyncError` until it settles or the communicator's timeout expires, and then
//! the communicator is aborted and the call returns [`Error::Timeout`]. A peer that dies
//! mid-run therefore surfaces as an error on the survivors, within the timeout.

use super::call_lock::{CallGuard, CallLock};
use super::group::{group_end, group_start};
use super::{ReduceOp, UniqueId};
use crate::device::{check_rank_stream, cuda, open, poll_stream, require_driver};
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::ffi::nccl::{nccl, Nccl};
use crate::ffi::nccl_sys as sys;
use crate::validate::owner;
use cudarc::driver::{CudaSlice, CudaStream, DeviceSlice};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a communicator waits before it gives up on its peers.
#[derive(Clone, Copy, Debug)]
pub struct CommOptions {
    /// Bound on initialisation, on every call that NCCL answers "in progress", and on
    /// [`Comm::synchronize`] and [`Comm::barrier`]. Default: 120 s.
    pub timeout: Duration,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_secs(120),
        }
    }
}

/// One rank of an NCCL communicator, bound to one CUDA stream.
///
/// All collectives are enqueued on that stream. Buffers are cudarc slices (or views) of
/// the communicator's device; lengths are counted in elements and checked against the
/// world size before anything is enqueued.
pub struct Comm {
    nccl: &'static Nccl,
    raw: sys::ncclComm_t,
    rank: usize,
    world: usize,
    stream: Arc<CudaStream>,
    timeout: Duration,
    /// Set by an asynchronous error, a timeout or [`Comm::abort`]: the communicator refuses
    /// further work and Drop aborts instead of finalizing.
    broken: AtomicBool,
    /// One f32 for [`Comm::barrier`] and [`Comm::sanity_check`].
    scratch: Mutex<CudaSlice<f32>>,
    /// Held from a call's issue through its settling, around every poll of the
    /// communicator's state, and around the abort (see [`CallLock`]).
    calls: CallLock,
    /// Whether tpfuse made the communicator (and so finalizes, destroys or aborts it), or
    /// borrows the engine's ([`Comm::from_raw`]).
    owned: bool,
}

// SAFETY: an ncclComm_t may be used from any thread as long as calls on it do not overlap and
// none follows its abort. Every use of `raw` through `&self` holds `calls` (a call from its
// issue through its settling, each poll of the state, the abort) and checks `broken` after
// taking it, so no call overlaps another and none reaches a freed communicator; `group` holds
// the locks of all its communicators until the group has settled. So `&Comm` may be shared.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.stream.context().ordinal())
            .field("broken", &self.broken.load(Ordering::Relaxed))
            .finish()
    }
}

impl UniqueId {
    /// A fresh id from `ncclGetUniqueId` (rank 0 makes it, the bootstrap carries it to the
    /// others). Needs NCCL but no GPU.
    pub fn new() -> Result<UniqueId> {
        let n = nccl()?;
        let f = n.func("ncclGetUniqueId", &n.lib.ncclGetUniqueId)?;
        let mut raw = sys::ncclUniqueId::default();
        // SAFETY: writes one ncclUniqueId.
        n.check(
            "ncclGetUniqueId",
            unsafe { f(&mut raw) },
            std::ptr::null_mut(),
        )?;
        let bytes: Vec<u8> = raw.internal.iter().map(|&c| c as u8).collect();
        UniqueId::from_bytes(&bytes)
    }

    fn to_raw(self) -> sys::ncclUniqueId {
        let mut raw = sys::ncclUniqueId::default();
        for (dst, src) in raw.internal.iter_mut().zip(self.as_bytes()) {
            *dst = *src as std::ffi::c_char;
        }
        raw
    }
}

/// The version of the NCCL that tpfuse loads, and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclInfo {
    /// (major, minor, patch).
    pub version: (u32, u32, u32),
    /// The file the dynamic loader opened.
    pub path: String,
    /// The nccl.h tpfuse was compiled against, as "major.minor.patch".
    pub header_version: String,
}

/// Loads NCCL (if not yet loaded) and reports its version. Needs no GPU.
pub fn nccl_info() -> Result<NcclInfo> {
    let n = nccl()?;
    Ok(NcclInfo {
        version: n.version,
        path: n.path.clone(),
        header_version: format!(
            "{}.{}.{}",
            sys::NCCL_MAJOR,
            sys::NCCL_MINOR,
            sys::NCCL_PATCH
        ),
    })
}

impl Comm {
    /// Joins rank `rank` of a `world`-rank communicator identified by `id`, on the device and
    /// stream the engine already owns. Every rank must call this with the same `id` and
    /// `world`; it returns when all have joined, or fails after `options.timeout`.
    pub fn init_rank(
        id: &UniqueId,
        rank: usize,
        world: usize,
        stream: Arc<CudaStream>,
        options: CommOptions,
    ) -> Result<Comm> {
        require_driver()?;
        check_rank(rank, world)?;
        check_rank_stream("stream", &stream)?;
        let n = nccl()?;
        let raw = start_rank(n, id, rank, world, &stream)?;
        Self::finish_init(n, raw, rank, world, stream, options.timeout)
    }

    /// Creates a device context and stream for `ordinal` and joins as in [`Comm::init_rank`].
    pub fn init_rank_on_device(
        id: &UniqueId,
        rank: usize,
        world: usize,
        ordinal: usize,
        options: CommOptions,
    ) -> Result<Comm> {
        require_driver()?;
        check_rank(rank, world)?;
        let stream = open(ordinal)?
            .new_stream()
            .map_err(cuda("creating a stream"))?;
        Self::init_rank(id, rank, world, stream, options)
    }

    /// One communicator per listed device, all in this process (rank i on `ordinals[i]`),
    /// each on a new stream of its device.
    pub fn init_all(ordinals: &[usize], options: CommOptions) -> Result<Vec<Comm>> {
        require_driver()?;
        check_distinct_devices("ordinals", ordinals)?;
        let streams = ordinals
            .iter()
            .map(|&o| open(o)?.new_stream().map_err(cuda("creating a stream")))
            .collect::<Result<Vec<_>>>()?;
        Self::init_all_on(&streams, options)
    }

    /// One communicator per given stream, all in this process: rank i on `streams[i]` (the
    /// engine's streams, one per device), where its collectives are enqueued.
    pub fn init_all_on(streams: &[Arc<CudaStream>], options: CommOptions) -> Result<Vec<Comm>> {
        require_driver()?;
        for s in streams {
            check_rank_stream("streams", s)?;
        }
        let ordinals: Vec<usize> = streams.iter().map(|s| s.context().ordinal()).collect();
        check_distinct_devices("streams", &ordinals)?;
        let n = nccl()?;
        let streams = streams.to_vec();
        let id = UniqueId::new()?;
        let world = streams.len();
        let mut raws = vec![std::ptr::null_mut(); world];
        let started = Self::start_all(n, &id, &streams, &mut raws);
        if let Err(e) = started {
            raws.iter().for_each(|&raw| abort_raw(n, raw));
            return Err(e);
        }
        raws.into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (raw, stream))| {
                Self::finish_init(n, raw, rank, world, stream, options.timeout)
            })
            .collect()
    }

    /// Wraps a communicator the engine made (an `ncclComm_t`, e.g. the handle of its own NCCL
    /// binding), whose collectives tpfuse then enqueues on `stream`, the engine's stream of
    /// the communicator's device. Rank and world are the communicator's.
    ///
    /// The communicator stays the engine's: tpfuse never finalizes, destroys or aborts it.
    /// Where tpfuse would abort its own (a wait past `options.timeout`, an NCCL error,
    /// [`Comm::abort`]), it marks this `Comm` unusable, returns the error, and leaves the
    /// abort (`ncclCommAbort`) to the engine: NCCL work stuck on a dead peer ends no other way.
    ///
    /// A communicator is only valid in the NCCL library that made it. tpfuse calls the NCCL
    /// already in the process (see [`nccl_info`]), and refuses with
    /// [`Error::NcclLibraryMismatch`] when it sees several NCCL libraries mapped in the
    /// process, or none. That check is best-effort (it reads `/proc/self/maps` for
    /// `libnccl.so*` files): it cannot see an NCCL linked statically into the engine, or one
    /// under another file name, hence the first condition below.
    ///
    /// The timeouts hold for a communicator made non-blocking (`ncclConfig_t.blocking = 0`):
    /// tpfuse polls every call. On a blocking one (cudarc's, candle's), a call on a dead peer
    /// may block the calling thread inside NCCL until the engine aborts the communicator.
    ///
    /// # Safety
    ///
    /// - `raw` is a live NCCL communicator (`ncclComm_t`) made in this process by the NCCL
    ///   shared library tpfuse uses ([`nccl_info`]'s path);
    /// - it outlives the returned `Comm` and every group built from it;
    /// - the engine issues no call on it while tpfuse does (NCCL's calls on one communicator
    ///   must not overlap), has settled its own calls (none still `ncclInProgress`), and has no
    ///   NCCL group open on the thread that calls tpfuse (groups are per thread: tpfuse's
    ///   calls would join it).
    ///
    /// Once this `Comm` is unusable ([`Comm::is_broken`]), tpfuse never touches `raw` again:
    /// the engine may abort it, then drop the groups built from it.
    ///
    /// Errors: [`Error::InvalidArgument`] for a null `raw`, a communicator of another device
    /// than `stream`'s, or one NCCL reports an error for; [`Error::NcclLibraryMismatch`].
    pub unsafe fn from_raw(
        raw: *mut std::ffi::c_void,
        stream: Arc<CudaStream>,
        options: CommOptions,
    ) -> Result<Comm> {
        require_driver()?;
        if raw.is_null() {
            return Err(Error::invalid("raw", "a null communicator"));
        }
        check_rank_stream("stream", &stream)?;
        let n = crate::ffi::nccl::nccl_of_the_process()?;
        let mut comm = Comm::holding(
            n,
            raw as sys::ncclComm_t,
            (0, 0),
            stream,
            options.timeout,
            false,
        )?;
        // An engine's non-blocking init may still be joining; NCCL refuses every other call on
        // the communicator until it has.
        comm.settle("ncclCommInitRank (the engine's)", "the other ranks to join")?;
        type Query = unsafe extern "C" fn(sys::ncclComm_t, *mut i32) -> sys::ncclResult_t;
        let query = |name: &'static str, f: &std::result::Result<Query, libloading::Error>| {
            let f = n.func(name, f)?;
            let mut v = -1i32;
            // SAFETY: the caller vouches for `raw`, which has settled; the query writes one
            // int.
            let rc = unsafe { f(comm.raw, &mut v) };
            n.check(name, rc, comm.raw).map_err(|e| {
                Error::invalid("raw", format!("{name} on the communicator failed: {e}"))
            })?;
            Ok::<usize, Error>(v.max(0) as usize)
        };
        let world = query("ncclCommCount", &n.lib.ncclCommCount)?;
        let rank = query("ncclCommUserRank", &n.lib.ncclCommUserRank)?;
        let device = query("ncclCommCuDevice", &n.lib.ncclCommCuDevice)?;
        check_rank(rank, world)?;
        let ordinal = comm.stream.context().ordinal();
        if device != ordinal {
            return Err(Error::invalid(
                "stream",
                format!("the communicator is on device {device}, the stream on device {ordinal}"),
            ));
        }
        (comm.rank, comm.world) = (rank, world);
        Ok(comm)
    }

    /// Whether tpfuse made this communicator (and will finalize and destroy it), or borrows
    /// the engine's ([`Comm::from_raw`]).
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// The raw `ncclComm_t`, for an engine that issues its own NCCL calls on a communicator
    /// tpfuse made (through the same NCCL library, [`nccl_info`]'s path; never overlapping
    /// tpfuse's calls). The communicator is non-blocking: a call may return `ncclInProgress`,
    /// to be polled with `ncclCommGetAsyncError` until it succeeds. The handle is valid while
    /// this `Comm` lives and is not [`broken`](Comm::is_broken): an abort (a timeout, an NCCL
    /// error, [`Comm::abort`]) frees an owned communicator.
    pub fn as_raw(&self) -> *mut std::ffi::c_void {
        self.raw as *mut std::ffi::c_void
    }

    /// Whether the communicator is unusable: aborted, or it saw an error or a timeout.
    /// Every call then returns [`Error::CommUnusable`], and tpfuse no longer touches the
    /// NCCL handle.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Issues every rank's non-blocking init inside one group, from this thread.
    fn start_all(
        n: &Nccl,
        id: &UniqueId,
        streams: &[Arc<CudaStream>],
        raws: &mut [sys::ncclComm_t],
    ) -> Result<()> {
        group_start(n)?;
        let mut started = Ok(());
        for (rank, stream) in streams.iter().enumerate() {
            match start_rank(n, id, rank, streams.len(), stream) {
                Ok(raw) => raws[rank] = raw,
                Err(e) => {
                    started = Err(e);
                    break;
                }
            }
        }
        // The group is closed on every path.
        let ended = group_end(n);
        started.and(ended)
    }

    fn finish_init(
        n: &'static Nccl,
        raw: sys::ncclComm_t,
        rank: usize,
        world: usize,
        stream: Arc<CudaStream>,
        timeout: Duration,
    ) -> Result<Comm> {
        let comm =
            Comm::holding(n, raw, (rank, world), stream, timeout, true).inspect_err(|_| {
                abort_raw(n, raw);
            })?;
        comm.settle("ncclCommInitRankConfig", "the other ranks to join")?;
        Ok(comm)
    }

    /// The `Comm` around `raw` (healthy, its one-float scratch allocated on `stream`), made by
    /// tpfuse (`owned`) or borrowed from the engine.
    fn holding(
        nccl: &'static Nccl,
        raw: sys::ncclComm_t,
        (rank, world): (usize, usize),
        stream: Arc<CudaStream>,
        timeout: Duration,
        owned: bool,
    ) -> Result<Comm> {
        let scratch = stream
            .alloc_zeros::<f32>(1)
            .map_err(cuda("allocating the communicator's scratch"))?;
        Ok(Comm {
            nccl,
            raw,
            rank,
            world,
            stream,
            timeout,
            broken: AtomicBool::new(false),
            scratch: Mutex::new(scratch),
            calls: CallLock::default(),
            owned,
        })
    }

    /// This communicator's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The loaded NCCL.
    pub(super) fn nccl(&self) -> &'static Nccl {
        self.nccl
    }

    /// The stream every operation is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The raw NCCL handle, for the crate's own calls (collectives, registration).
    pub(crate) fn raw(&self) -> sys::ncclComm_t {
        self.raw
    }

    /// Polls `ncclCommGetAsyncError`: `Ok` while the communicator is healthy; the error
    /// (and a broken communicator) once NCCL reports one.
    pub fn check_async(&self) -> Result<()> {
        self.usable()?;
        match self.async_state()? {
            sys::ncclResult_t_ncclSuccess | sys::ncclResult_t_ncclInProgress => Ok(()),
            rc => self.fail("ncclCommGetAsyncError", rc),
        }
    }

    /// Tears the communicator down without waiting for peers (`ncclCommAbort`): the way out
    /// when a peer is gone. Every later call returns [`Error::CommUnusable`]. A borrowed
    /// communicator ([`Comm::from_raw`]) is only marked unusable: the engine aborts it.
    pub fn abort(&self) {
        if self.broken.swap(true, Ordering::AcqRel) {
            return;
        }
        // A call in flight on another thread sees `broken` at its next poll and lets go.
        let _calls = self.calls.lock();
        if self.owned {
            abort_raw(self.nccl, self.raw);
        }
    }

    /// Waits until everything enqueued on the stream has finished, polling the stream and
    /// NCCL's asynchronous error; past the timeout the communicator is aborted and this
    /// returns [`Error::Timeout`].
    pub fn synchronize(&self) -> Result<()> {
        self.usable()?;
        let drained = poll_stream(
            &self.stream,
            self.timeout,
            "waiting for the communicator's stream",
            || self.check_async(),
        );
        match drained {
            Ok(true) => Ok(()),
            Ok(false) => {
                self.abort();
                Err(Error::Timeout {
                    what: format!(
                        "rank {} of {}: the stream's NCCL work to finish (a peer may be gone)",
                        self.rank, self.world
                    ),
                    after: self.timeout,
                })
            }
            Err(e @ Error::Cuda { .. }) => {
                // A failed stream leaves the context unusable: so is the communicator.
                self.abort();
                Err(e)
            }
            // check_async's errors have aborted the communicator already.
            Err(e) => Err(e),
        }
    }

    /// Blocks until every rank has reached the barrier (an all-reduce of one value followed
    /// by [`Comm::synchronize`]), bounded by the timeout.
    pub fn barrier(&self) -> Result<()> {
        let _calls = self.issuing()?; // before the scratch: one lock order, calls then scratch
        self.all_reduce_in_place(&mut *self.scratch(), ReduceOp::Sum)?;
        self.synchronize()
    }

    /// Every rank all-reduces 1.0 and expects the world size back: proves that the ranks
    /// can reach each other and that NCCL computes.
    pub fn sanity_check(&self) -> Result<()> {
        let _calls = self.issuing()?; // before the scratch: one lock order, calls then scratch
        let mut scratch = self.scratch();
        self.stream
            .memcpy_htod(&[1.0f32], &mut *scratch)
            .map_err(cuda("sanity check upload"))?;
        self.all_reduce_in_place(&mut *scratch, ReduceOp::Sum)?;
        self.synchronize()?;
        let mut got = [0f32];
        self.stream
            .memcpy_dtoh(&*scratch, &mut got)
            .map_err(cuda("sanity check download"))?;
        if got[0] != self.world as f32 {
            return Err(Error::CommUnusable(format!(
                "sanity all-reduce of 1.0 gave {} on rank {}, expected {}",
                got[0], self.rank, self.world
            )));
        }
        Ok(())
    }

    fn scratch(&self) -> std::sync::MutexGuard<'_, CudaSlice<f32>> {
        // A panic while it was held left a valid f32 behind.
        self.scratch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lock around the calls on `raw` ([`super::group`] takes it for a whole group).
    pub(super) fn calls(&self) -> &CallLock {
        &self.calls
    }

    /// Takes `calls` for a call: then the communicator is still usable, and, inside
    /// [`group`], one of the group's.
    pub(super) fn issuing(&self) -> Result<CallGuard<'_>> {
        let calls = self.calls.lock();
        super::group::check_member(self)?;
        self.usable()?;
        Ok(calls)
    }

    /// Errors unless both buffers live on the communicator's device.
    pub(super) fn on_device<T>(
        &self,
        op: &str,
        a: &impl DeviceSlice<T>,
        b: &impl DeviceSlice<T>,
    ) -> Result<()> {
        let device = self.stream.context().ordinal();
        for buf in [owner(a), owner(b)] {
            if buf != device {
                return Err(Error::invalid(
                    op,
                    format!("a buffer lives on device {buf}, the communicator on {device}"),
                ));
            }
        }
        Ok(())
    }

    pub(super) fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    pub(super) fn func<'a, F>(
        &self,
        name: &'static str,
        f: &'a std::result::Result<F, libloading::Error>,
    ) -> Result<&'a F> {
        self.usable()?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(cuda("binding the context"))?;
        self.nccl.func(name, f)
    }

    fn usable(&self) -> Result<()> {
        if self.broken.load(Ordering::Acquire) {
            Err(Error::CommUnusable(format!(
                "rank {} of {} was aborted or saw an error; build a new communicator",
                self.rank, self.world
            )))
        } else {
            Ok(())
        }
    }

    fn async_state(&self) -> Result<sys::ncclResult_t> {
        let _calls = self.calls.lock();
        self.usable()?;
        let f = self.nccl.func(
            "ncclCommGetAsyncError",
            &self.nccl.lib.ncclCommGetAsyncError,
        )?;
        let mut state = sys::ncclResult_t_ncclSuccess;
        // SAFETY: reads the state of a live communicator.
        let rc = unsafe { f(self.raw, &mut state) };
        self.nccl.check("ncclCommGetAsyncError", rc, self.raw)?;
        Ok(state)
    }

    /// Marks the communicator broken, aborts it, and returns the NCCL error.
    fn fail<R>(&self, call: &'static str, rc: sys::ncclResult_t) -> Result<R> {
        // Read NCCL's last error before the abort frees the communicator.
        let err = self
            .nccl
            .check(call, rc, self.raw)
            .err()
            .unwrap_or_else(|| Error::CommUnusable(format!("{call} failed")));
        self.abort();
        Err(err)
    }

    /// Handles a call's result: success, an error, or "in progress", which is polled.
    pub(super) fn after(&self, call: &'static str, rc: sys::ncclResult_t) -> Result<()> {
        match rc {
            sys::ncclResult_t_ncclSuccess => Ok(()),
            sys::ncclResult_t_ncclInProgress => self.settle(call, "NCCL to accept the call"),
            rc => self.fail(call, rc),
        }
    }

    /// Polls the asynchronous state until it leaves "in progress" (bounded by the timeout).
    pub(super) fn settle(&self, call: &'static str, what: &str) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let mut pause = Duration::from_micros(20);
        loop {
            match self.async_state()? {
                sys::ncclResult_t_ncclSuccess => return Ok(()),
                sys::ncclResult_t_ncclInProgress => {}
                rc => return self.fail(call, rc),
            }
            if Instant::now() >= deadline {
                self.abort();
                return Err(Error::Timeout {
                    what: format!("rank {} of {}: {what} ({call})", self.rank, self.world),
                    after: self.timeout,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }
}

impl Drop for Comm {
    /// Finalizes (flushing outstanding work, bounded by the timeout) and destroys; a broken
    /// communicator, or one whose finalize does not settle, is aborted instead.
    fn drop(&mut self) {
        if self.broken.load(Ordering::Acquire) || !self.owned {
            return;
        }
        let _ = self.stream.context().bind_to_thread();
        let finalized = match self.nccl.lib.ncclCommFinalize.as_ref() {
            // SAFETY: finalizes a live communicator once.
            Ok(f) => match unsafe { f(self.raw) } {
                sys::ncclResult_t_ncclSuccess => true,
                sys::ncclResult_t_ncclInProgress => self
                    .settle("ncclCommFinalize", "outstanding work to flush")
                    .is_ok(),
                _ => false,
            },
            Err(_) => false,
        };
        if !finalized {
            self.abort();
            return;
        }
        if let Ok(destroy) = self.nccl.lib.ncclCommDestroy.as_ref() {
            // SAFETY: destroys a finalized communicator once.
            unsafe { destroy(self.raw) };
        }
    }
}

/// Starts rank `rank`'s non-blocking init on `stream`'s device; the returned communicator
/// is still joining (see [`Comm::finish_init`]).
fn start_rank(
    n: &Nccl,
    id: &UniqueId,
    rank: usize,
    world: usize,
    stream: &CudaStream,
) -> Result<sys::ncclComm_t> {
    let init = n.func("ncclCommInitRankConfig", &n.lib.ncclCommInitRankConfig)?;
    stream
        .context()
        .bind_to_thread()
        .map_err(cuda("binding the context"))?;
    let mut config = default_config()?;
    config.blocking = 0;
    let mut raw: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: `raw` receives the communicator; `config` lives across the call.
    let rc = unsafe {
        init(
            &mut raw,
            world as i32,
            id.to_raw(),
            rank as i32,
            &mut config,
        )
    };
    if rc != sys::ncclResult_t_ncclInProgress {
        n.check("ncclCommInitRankConfig", rc, raw)?;
    }
    Ok(raw)
}

/// Errors unless every device is listed once (NCCL needs one rank per GPU).
fn check_distinct_devices(arg: &str, ordinals: &[usize]) -> Result<()> {
    if ordinals.is_empty() {
        return Err(Error::invalid(arg, "no devices given"));
    }
    for (i, a) in ordinals.iter().enumerate() {
        if ordinals[..i].contains(a) {
            return Err(Error::invalid(
                arg,
                format!("device {a} is listed twice; NCCL needs one rank per GPU"),
            ));
        }
    }
    Ok(())
}

fn abort_raw(n: &Nccl, raw: sys::ncclComm_t) {
    if raw.is_null() {
        return;
    }
    if let Ok(f) = n.lib.ncclCommAbort.as_ref() {
        // SAFETY: aborts a communicator that is not used again.
        unsafe { f(raw) };
    }
}

fn default_config() -> Result<sys::ncclConfig_t> {
    let mut config = sys::ncclConfig_t::default();
    let size = std::mem::size_of::<sys::ncclConfig_t>();
    // SAFETY: writes exactly `size` bytes when the C side's ncclConfig_t has that size.
    let c_size = unsafe {
        kernels::tpfuse_nccl_config_init(&mut config as *mut _ as *mut std::ffi::c_void, size)
    };
    if c_size != size {
        return Err(Error::CommUnusable(format!(
            "ncclConfig_t is {c_size} bytes in C but {size} in the bindings"
        )));
    }
    Ok(config)
}

fn check_rank(rank: usize, world: usize) -> Result<()> {
    if world == 0 || rank >= world {
        return Err(Error::RankOutOfRange { rank, world });
    }
    if world > i32::MAX as usize {
        return Err(Error::invalid("world", "larger than NCCL supports"));
    }
    Ok(())
}
