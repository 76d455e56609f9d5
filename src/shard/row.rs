//! Row-parallel: a full weight's columns split evenly across the ranks.

use super::HostWeight;
use super::{
    check_dense, check_gemm, check_host_bias, check_host_weight, describe, even_part, LayerKind,
};
use crate::error::Result;
use std::ops::Range;

/// The shape of a row-parallel layer: a full weight `[out_features, in_features]` whose
/// columns are split evenly across `world` ranks. Rank `r` holds the weight columns
/// `r·in/W .. (r+1)·in/W`, reads the same columns of the input, and computes a partial
/// `[m, out_features]`; the sum over the ranks plus the bias (all of it, on every rank, added
/// once after the reduction) is the layer's output.
///
/// ```
/// use tpfuse::shard::{HostWeight, RowParallelSpec};
/// # fn main() -> tpfuse::Result<()> {
/// let spec = RowParallelSpec::new("down_proj", 4, 2, 2)?; // [out 2, in 4] on 2 ranks
/// assert_eq!(spec.columns(1)?, 2..4);
/// let full = [0, 1, 2, 3, 10, 11, 12, 13];
/// assert_eq!(spec.shard_weight(1, HostWeight::new(&full, 2, 4))?, vec![2, 3, 12, 13]);
/// let err = RowParallelSpec::new("layers.0.mlp.down_proj", 14336, 4096, 6).unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "invalid argument `row-parallel 'layers.0.mlp.down_proj'`: in_features 14336 is not \
///      divisible by world 6"
/// );
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RowParallelSpec {
    name: String,
    in_features: usize,
    out_features: usize,
    world: usize,
}

impl RowParallelSpec {
    /// Checks and describes a layer `name` with a full weight `[out_features, in_features]`
    /// on `world` ranks. Errors: a zero dimension or world, `in_features` not divisible by
    /// `world`, a weight too large to address.
    pub fn new(
        name: impl Into<String>,
        in_features: usize,
        out_features: usize,
        world: usize,
    ) -> Result<Self> {
        let name = name.into();
        check_dense(
            LayerKind::RowParallel,
            &name,
            in_features,
            out_features,
            world,
            ("in_features", in_features),
        )?;
        Ok(RowParallelSpec {
            name,
            in_features,
            out_features,
            world,
        })
    }

    /// The layer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layer's description, e.g. `row-parallel 'layers.0.mlp.down_proj'`.
    pub fn label(&self) -> String {
        describe(LayerKind::RowParallel, &self.name)
    }

    /// Input features of the full layer.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features (every rank produces a partial of all of them).
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Input features of one rank, `in_features / world`.
    pub fn in_per_rank(&self) -> usize {
        self.in_features / self.world
    }

    /// The weight columns (= input columns) rank `rank` holds.
    pub fn columns(&self, rank: usize) -> Result<Range<usize>> {
        even_part(&self.label(), rank, self.world, self.in_per_rank())
    }

    /// Rank `rank`'s weight `[out, in / W]`, cut from the full host weight `full`, which
    /// must be `[out_features, in_features]` (the checkpoint's layout, see [`HostWeight`]).
    /// Errors (naming the layer): a rank out of range, a weight of another shape (a
    /// transposed one says so), a weight whose data does not fill its shape.
    pub fn shard_weight<T: Copy>(&self, rank: usize, full: HostWeight<'_, T>) -> Result<Vec<T>> {
        let cols = self.columns(rank)?;
        check_host_weight(&self.label(), &full, self.out_features, self.in_features)?;
        let mut out = Vec::with_capacity(self.out_features * cols.len());
        for row in full.data().chunks_exact(self.in_features) {
            out.extend_from_slice(&row[cols.clone()]);
        }
        Ok(out)
    }

    /// Errors unless `full` is a bias of `out_features` elements. A row-parallel bias is not
    /// sharded: every rank holds all of it, and the all-reduce adds it once.
    pub fn check_bias<T>(&self, full: &[T]) -> Result<()> {
        check_host_bias(
            &self.label(),
            full.len(),
            self.out_features,
            "out_features (a row-parallel bias is whole on every rank)",
        )
    }

    /// What the GEMM needs of a rank's shard `[out, in / W]`: both positive multiples of 8.
    pub fn check_gemm_dims(&self) -> Result<()> {
        check_gemm(
            &self.label(),
            ("out_features", self.out_features),
            ("in_features / world", self.in_per_rank()),
        )
    }
}
