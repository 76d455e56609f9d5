//! tpfuse: hand-written CUDA kernels for tensor-parallel LLM inference.
#![warn(missing_docs)]

pub mod error;
mod ffi;
pub use error::{Error, Result};
