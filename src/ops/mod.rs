//! The product: kernels as safe, validated operations.

pub mod all_gather_gemm;
pub mod all_reduce;
pub mod collectives;
pub mod epilogue;
pub mod gemm;
pub mod gemm_all_reduce;
pub mod linear;
pub mod reduce_ranks;

pub use all_gather_gemm::all_gather_gemm;
pub use all_reduce::{
    all_reduce, all_reduce_fused, all_reduce_in_place, all_reduce_residual_rmsnorm, Algorithm,
    Epilogue, RmsNorm,
};
pub use collectives::{all_gather, reduce_scatter};
pub use epilogue::{add_bias_residual, rms_norm, rms_norm_in_place};
pub use gemm::{gemm, gemm_accumulate, gemm_with_scratch, GemmShape};
pub use gemm_all_reduce::{gemm_all_reduce, gemm_all_reduce_with, gemm_reduce_scatter};
pub use linear::{ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear};
pub use reduce_ranks::reduce_ranks;
