//! # tpfuse
//!
//! Hand-written CUDA kernels for tensor-parallel LLM inference, over the raw device buffers
//! and streams an engine already owns (cudarc [`CudaSlice`](cudarc::driver::CudaSlice)s and
//! [`CudaStream`](cudarc::driver::CudaStream)s), with NCCL for everything else.
//!
//! - [`ops::reduce_ranks()`]: the element-wise, rank-ordered f32-accumulated sum that every
//!   all-reduce in tpfuse builds on (same inputs, same bits).
//! - [`comm::Comm`]: a safe NCCL communicator (non-blocking, every wait bounded), and
//!   [`comm::bootstrap`], which carries its unique id to every rank (bytes, hex, a shared
//!   file, TCP, or the torchrun / Slurm / Open MPI environment).
//! - [`build_info`]: what was compiled, and the ptxas resource report of every kernel.
//!
//! Every entry point returns [`Error::NoCudaDriver`] on a machine without an NVIDIA driver;
//! nothing panics.
//!
//! ## Example: sum four buffers
//!
//! ```no_run
//! use tpfuse::ops::reduce_ranks;
//! use half::bf16;
//!
//! # fn main() -> tpfuse::Result<()> {
//! let ctx = tpfuse::device::open(0)?;
//! let stream = ctx.default_stream();
//! let n = 4096;
//! let inputs: Vec<_> = (0..4)
//!     .map(|r| stream.clone_htod(&vec![bf16::from_f32(r as f32); n]))
//!     .collect::<Result<_, _>>()
//!     .map_err(|e| tpfuse::Error::Cuda { context: "upload", source: e })?;
//! let mut out = stream
//!     .alloc_zeros::<bf16>(n)
//!     .map_err(|e| tpfuse::Error::Cuda { context: "alloc", source: e })?;
//! let refs: Vec<_> = inputs.iter().collect();
//! reduce_ranks(&stream, &refs, &mut out)?; // out[i] = 0 + 1 + 2 + 3
//! # Ok(()) }
//! ```
//!
//! ## Example: an NCCL communicator from a torchrun launch
//!
//! ```no_run
//! use std::time::Duration;
//! use tpfuse::comm::{bootstrap, Comm, CommOptions, UniqueId};
//!
//! # fn main() -> tpfuse::Result<()> {
//! let env = bootstrap::LaunchEnv::from_env()?;
//! let id = bootstrap::unique_id_from_env(&env, UniqueId::new, Duration::from_secs(60))?;
//! let comm = Comm::init_rank_on_device(
//!     &id, env.rank, env.world, env.local_rank, CommOptions::default())?;
//! comm.sanity_check()?; // all-reduce of 1.0 on every rank gives the world size
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod build_info;
#[cfg(feature = "candle")]
pub mod candle;
pub mod comm;
pub mod device;
pub mod dtype;
#[cfg(feature = "emulator")]
pub mod emulator;
pub mod error;
mod ffi;
pub mod group;
pub mod ops;
pub mod plan;
pub mod reference;
pub mod shard;
pub mod symmetric;
pub mod topology;
pub mod validate;

/// The README's code blocks, compiled (and run, unless marked `no_run`) by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub use dtype::{Element, NcclType};
pub use error::{Error, Result};
pub use group::{GroupOptions, TpGroup};
