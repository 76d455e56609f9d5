//! Whether a layer runs its GEMM and its collective as one kernel: the layer's choice
//! ([`Fusion`]), the rule that applies it, and what a sequence-parallel forward ran
//! ([`SequenceParallelPath`]).

use crate::error::{Error, Result};
use crate::group::TpGroup;
use crate::ops::gemm::GemmShape;
use crate::ops::gemm_all_reduce::{facts_of, planned, FusedFacts};
use crate::topology::{FusedKernel, FusionRule};

/// How a layer joins its GEMM and its collective: a row-parallel layer's GEMM + all-reduce
/// ([`crate::ops::gemm_all_reduce()`]) or GEMM + reduce-scatter
/// ([`crate::ops::gemm_reduce_scatter`]), a column-parallel layer's all-gather + GEMM
/// ([`crate::ops::all_gather_gemm()`]). Every rank must choose the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fusion {
    /// [`FusionRule`]'s choice, from what one GPU measured: a column-parallel layer's
    /// all-gather + GEMM fuses for small `m` on groups whose custom kernels run, when the
    /// shape fits the fused kernel and its `k` does not split
    /// ([`split_parts`](crate::ops::gemm::split_parts) = 1) or the fused kernel runs the parts
    /// in parallel as the unfused GEMM does
    /// ([`FusedPlan::parts_in_parallel`](crate::ops::gemm_all_reduce::FusedPlan::parts_in_parallel));
    /// a row-parallel layer's GEMM +
    /// all-reduce or GEMM + reduce-scatter runs unfused (measured 1.6-2.6x slower fused on an
    /// H200, `docs/performance.md`; [`Fusion::Fused`] still runs it).
    Auto,
    /// Always one kernel; a shape it cannot take (an exchange over half the group's
    /// capacity, too many tiles, a group without custom kernels) is an error naming the
    /// layer.
    Fused,
    /// Always the GEMM and the collective as separate launches, through the caller's
    /// workspace.
    Unfused,
}

/// What a sequence-parallel forward ran
/// ([`RowParallelLinear::forward_reduce_scatter`](super::RowParallelLinear::forward_reduce_scatter),
/// [`ColumnParallelLinear::forward_all_gather`](super::ColumnParallelLinear::forward_all_gather)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SequenceParallelPath {
    /// One fused kernel; the workspace was not touched.
    Fused,
    /// The GEMM and the collective, through the workspace.
    Unfused,
}

/// The fused forms of a layer's call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FusedOp {
    GemmAllReduce,
    GemmReduceScatter,
    AllGatherGemm,
}

impl FusedOp {
    /// The name errors give it.
    fn name(self) -> &'static str {
        match self {
            FusedOp::GemmAllReduce => "GEMM + all-reduce",
            FusedOp::GemmReduceScatter => "GEMM + reduce-scatter",
            FusedOp::AllGatherGemm => "all-gather + GEMM",
        }
    }

    /// The kernel [`FusionRule`] decides for.
    fn kernel(self) -> FusedKernel {
        match self {
            FusedOp::GemmAllReduce | FusedOp::GemmReduceScatter => FusedKernel::RowParallel,
            FusedOp::AllGatherGemm => FusedKernel::AllGather,
        }
    }
}

/// Whether a layer's call of `shape` (its GEMM's, `m` rows) runs `op` fused, by its `fusion`: `auto_allowed` is what the layer adds to
/// [`Fusion::Auto`]'s rule, `unfusable` says why the fused kernel cannot take the shape on the
/// group. [`Fusion::Auto`] also leaves a shape whose `k` splits
/// ([`split_parts`](crate::ops::gemm::split_parts) > 1) unfused where the fused kernel runs a
/// tile's parts one after another on as many SMs as there are tiles
/// ([`FusedPlan::parts_in_parallel`](crate::ops::gemm_all_reduce::FusedPlan::parts_in_parallel)
/// false), where the unfused GEMM runs them in parallel (the same bits either way). Forced
/// fusion that cannot run is an error naming the layer (`label`).
pub(super) fn fuses(
    fusion: Fusion,
    label: &str,
    op: FusedOp,
    group: &TpGroup,
    shape: GemmShape,
    auto_allowed: bool,
    unfusable: impl FnOnce(&FusedFacts) -> Option<String>,
) -> Result<bool> {
    let m = shape.m;
    let refusal = || -> Option<String> {
        if let Some(reason) = group.custom_kernels_refused() {
            return Some(format!("the group has no custom kernels: {reason}"));
        }
        unfusable(&facts_of(group))
    };
    match fusion {
        Fusion::Unfused => Ok(false),
        Fusion::Fused => match refusal() {
            None => Ok(true),
            Some(reason) => Err(Error::invalid(
                label,
                format!("the layer forces the fused {}, but {reason}", op.name()),
            )),
        },
        Fusion::Auto => Ok(auto_allowed
            && FusionRule::default().fuse(op.kernel(), group.verdict(), m)
            && planned(shape, &facts_of(group), op.kernel())
                .is_ok_and(|plan| plan.parts == 1 || plan.parts_in_parallel)
            && refusal().is_none()),
    }
}
