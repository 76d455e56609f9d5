//! The product: kernels as safe, validated operations.

pub mod reduce_ranks;

pub use reduce_ranks::reduce_ranks;
