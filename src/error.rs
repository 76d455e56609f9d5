//! The one error type of the crate.
//!
//! Every failure is a variant that names what went wrong; nothing in the crate panics on bad
//! input or on a missing driver or library.

use std::time::Duration;

/// Everything that can go wrong in tpfuse.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No CUDA driver (`libcuda.so`) could be loaded on this machine.
    #[error("no CUDA driver: libcuda.so could not be loaded (is an NVIDIA driver installed?)")]
    NoCudaDriver,

    /// A CUDA driver call failed.
    #[error("CUDA driver error in {context}: {source}")]
    Cuda {
        /// What tpfuse was doing.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },

    /// A kernel launcher returned a CUDA runtime error.
    #[error("launching {kernel} failed: CUDA error {code} ({message})")]
    KernelLaunch {
        /// The launcher's name.
        kernel: &'static str,
        /// The `cudaError_t` value.
        code: i32,
        /// `cudaGetErrorString` of the code.
        message: String,
    },

    /// The CPU emulator (feature `emulator`) reported a failure: a launch it refused, or a
    /// kernel that failed on the emulated device (a deadlock names the blocks involved).
    #[error("emulator: {context} failed: CUDA error {code} ({message})")]
    Emulator {
        /// What was being done.
        context: &'static str,
        /// The `cudaError_t` value.
        code: i32,
        /// What the emulator said.
        message: String,
    },

    /// The NCCL library could not be loaded.
    #[error("NCCL not found: {reason} (tried {tried}); install nvidia-nccl-cu13 or set TPFUSE_NCCL_LIB to the path of libnccl.so.2")]
    NcclNotFound {
        /// The names and paths that were tried, comma-separated.
        tried: String,
        /// The loader's last error.
        reason: String,
    },

    /// The loaded NCCL is older than tpfuse supports.
    #[error("NCCL {found} at {path} is too old: tpfuse needs {required} or newer")]
    NcclTooOld {
        /// Version found, e.g. "2.18.5".
        found: String,
        /// Where it was loaded from.
        path: String,
        /// The oldest supported version.
        required: &'static str,
    },

    /// An engine's communicator cannot be used: it is only valid in the NCCL library that
    /// made it, and the NCCL libraries in this process do not say which one that is.
    #[error("the engine's NCCL communicator cannot be used: {0}")]
    NcclLibraryMismatch(String),

    /// An NCCL call failed.
    #[error("{call} failed: {result} ({message}){}", last_error_suffix(.last))]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// The `ncclResult_t` value.
        result: u32,
        /// `ncclGetErrorString` of the result.
        message: String,
        /// `ncclGetLastError` at the time of failure (may be empty).
        last: String,
    },

    /// A wait ran past its deadline.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The bound that expired.
        after: Duration,
    },

    /// A unique id that is not 128 bytes, or not 256 hex digits.
    #[error("malformed NCCL unique id: {0}")]
    MalformedUniqueId(String),

    /// A rank and world size that do not fit together.
    #[error("rank {rank} is out of range for world size {world}")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world: usize,
    },

    /// Two participants of a rendezvous disagree on the world size.
    #[error("world size mismatch: {expected} expected, rank {rank} says {got}")]
    WorldSizeMismatch {
        /// The world size of the side that detected it.
        expected: usize,
        /// The rank that disagrees.
        rank: usize,
        /// What that rank believes.
        got: usize,
    },

    /// Two participants of a rendezvous claim the same rank.
    #[error("duplicate rank {0} in the rendezvous")]
    DuplicateRank(usize),

    /// A rendezvous peer sent something that is not the tpfuse protocol, or reported a failure.
    #[error("rendezvous with {peer} failed: {reason}")]
    Rendezvous {
        /// The peer (an address, a rank or a path).
        peer: String,
        /// What was wrong.
        reason: String,
    },

    /// Rank 0 could not listen for the TCP rendezvous (the port is taken, most often).
    #[error("rank 0 cannot listen for the TCP rendezvous on {addr}: {source}; {advice}")]
    RendezvousListen {
        /// The address and port that could not be bound.
        addr: String,
        /// Where the port came from and what to check.
        advice: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A launcher environment variable is missing or malformed.
    #[error("launcher environment: {0}")]
    LaunchEnv(String),

    /// An I/O error, with what tpfuse was doing.
    #[error("{context}: {source}")]
    Io {
        /// What tpfuse was doing.
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// An argument of an op is invalid; `arg` names it.
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The argument (or layer) that is wrong.
        arg: String,
        /// Why.
        reason: String,
    },

    /// A peer of a custom collective did not arrive before the group's deadline. The group
    /// is poisoned: rebuild it.
    #[error("rank {rank}: peer rank {peer} did not arrive within {after:?}; the group is poisoned, rebuild it")]
    PeerTimeout {
        /// The rank that waited.
        rank: usize,
        /// The rank that did not arrive.
        peer: usize,
        /// The deadline.
        after: Duration,
    },

    /// The ranks of a group launched different custom collectives (another kernel, element
    /// count, epilogue or grid) where they must launch the same: the first barrier compares
    /// every launch's descriptor, the fused kernels their flags' and packets' descriptors, and
    /// a collective whose barrier stalls finds a peer that started a fused kernel instead. No
    /// data was used; the group is poisoned: rebuild it.
    #[error("rank {rank}: ranks {} and {} launched different collectives (kernel, size, epilogue or grid) where every rank must launch the same; the group is poisoned, rebuild it", .ranks[0], .ranks[1])]
    PeerMismatch {
        /// The rank that reports it.
        rank: usize,
        /// The two ranks whose launches differ, ascending.
        ranks: [usize; 2],
    },

    /// The group saw a timeout or a failure earlier and refuses work until it is rebuilt.
    #[error("the group is poisoned ({0}); rebuild it")]
    GroupPoisoned(String),

    /// A computed result differs from its reference (used by `tpfuse selftest`).
    #[error("result mismatch: {0}")]
    Mismatch(String),

    /// An NCCL communicator reported an asynchronous error or was aborted; it cannot be used.
    #[error("the communicator is unusable: {0}")]
    CommUnusable(String),
}

fn last_error_suffix(last: &str) -> String {
    if last.is_empty() {
        String::new()
    } else {
        format!("; NCCL says: {last}")
    }
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub(crate) fn invalid(arg: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            arg: arg.into(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::Io`].
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
