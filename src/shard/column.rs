//! Column-parallel: a full weight's rows split evenly across the ranks.

use super::HostWeight;
use super::{
    check_dense, check_gemm, check_host_bias, check_host_weight, describe, even_part, take_rows,
    LayerKind,
};
use crate::error::Result;
use std::ops::Range;

/// The shape of a column-parallel layer: a full weight `[out_features, in_features]` whose
/// rows are split evenly across `world` ranks. Rank `r` holds the weight rows (and bias
/// elements) `r·out/W .. (r+1)·out/W` and computes `y[:, r·out/W .. (r+1)·out/W]` from the
/// whole input `[m, in_features]`.
///
/// ```
/// use tpfuse::shard::{ColumnParallelSpec, HostWeight};
/// # fn main() -> tpfuse::Result<()> {
/// let spec = ColumnParallelSpec::new("lm_head", 4, 6, 3)?; // [out 6, in 4] on 3 ranks
/// assert_eq!(spec.out_per_rank(), 2);
/// assert_eq!(spec.rows(1)?, 2..4);
/// let full: Vec<u32> = (0..24).collect();
/// let full = HostWeight::new(&full, 6, 4); // [out_features, in_features], as stored
/// assert_eq!(spec.shard_weight(1, full)?, (8..16).collect::<Vec<_>>());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ColumnParallelSpec {
    name: String,
    in_features: usize,
    out_features: usize,
    world: usize,
}

impl ColumnParallelSpec {
    /// Checks and describes a layer `name` with a full weight `[out_features, in_features]`
    /// on `world` ranks. Errors: a zero dimension or world, `out_features` not divisible by
    /// `world`, a weight too large to address.
    pub fn new(
        name: impl Into<String>,
        in_features: usize,
        out_features: usize,
        world: usize,
    ) -> Result<Self> {
        let name = name.into();
        check_dense(
            LayerKind::ColumnParallel,
            &name,
            in_features,
            out_features,
            world,
            ("out_features", out_features),
        )?;
        Ok(ColumnParallelSpec {
            name,
            in_features,
            out_features,
            world,
        })
    }

    /// The layer's name, e.g. `lm_head`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layer's description, e.g. `column-parallel 'lm_head'` (the `arg` of its errors).
    pub fn label(&self) -> String {
        describe(LayerKind::ColumnParallel, &self.name)
    }

    /// Input features (every rank reads all of them).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features of the full layer.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Output features of one rank, `out_features / world`.
    pub fn out_per_rank(&self) -> usize {
        self.out_features / self.world
    }

    /// The weight rows (= output columns) rank `rank` holds.
    pub fn rows(&self, rank: usize) -> Result<Range<usize>> {
        even_part(&self.label(), rank, self.world, self.out_per_rank())
    }

    /// Rank `rank`'s weight `[out / W, in]`, cut from the full host weight `full`, which
    /// must be `[out_features, in_features]` (the checkpoint's layout, see [`HostWeight`]).
    /// Errors (naming the layer): a rank out of range, a weight of another shape (a
    /// transposed one says so), a weight whose data does not fill its shape.
    pub fn shard_weight<T: Copy>(&self, rank: usize, full: HostWeight<'_, T>) -> Result<Vec<T>> {
        let rows = self.rows(rank)?;
        check_host_weight(&self.label(), &full, self.out_features, self.in_features)?;
        Ok(take_rows(full.data(), self.in_features, &[rows]))
    }

    /// Rank `rank`'s bias `[out / W]`, cut from the full host bias `full` `[out_features]`.
    pub fn shard_bias<T: Copy>(&self, rank: usize, full: &[T]) -> Result<Vec<T>> {
        let rows = self.rows(rank)?;
        check_host_bias(&self.label(), full.len(), self.out_features, "out_features")?;
        Ok(full[rows].to_vec())
    }

    /// What the GEMM needs of a rank's shard `[out / W, in]`: both positive multiples of 8.
    pub fn check_gemm_dims(&self) -> Result<()> {
        check_gemm(
            &self.label(),
            ("out_features / world", self.out_per_rank()),
            ("in_features", self.in_features),
        )
    }
}
