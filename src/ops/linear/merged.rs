//! Merged column-parallel: QKV or gate_up, a rank holds its part of every section.

use super::fusion::{Fusion, SequenceParallelPath};
use super::{check_spec, host_shard, upload_shard, Shard};
use crate::dtype::NcclType;
use crate::error::Result;
use crate::group::TpGroup;
use crate::ops::gemm::GemmElement;
use crate::shard::{GateUpSplit, HostWeight, MergedColumnSpec, QkvSplit};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceSlice};

/// A merged column-parallel layer, one rank of it: QKV with grouped-query heads or gate_up
/// (see [`MergedColumnSpec`]). Rank `r`'s weight is its part of each section, stacked, so
/// its output row `[m, out_per_rank]` is `[q_r | k_r | v_r]` or `[gate_r | up_r]`;
/// [`qkv_split`](Self::qkv_split) and [`gate_up_split`](Self::gate_up_split) say where.
pub struct MergedColumnParallelLinear<T, W = CudaSlice<T>> {
    spec: MergedColumnSpec,
    shard: Shard<T, W>,
    fusion: Fusion,
}

impl<T, W: DeviceSlice<T>> std::fmt::Debug for MergedColumnParallelLinear<T, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shard
            .debug(f, "MergedColumnParallelLinear", &self.spec)
    }
}

impl<T: GemmElement + NcclType> MergedColumnParallelLinear<T> {
    /// The layer from the full host weight, `[out_features, in_features]` with the sections
    /// stacked along the rows (see [`HostWeight`]), and bias `[out_features]`, cut by
    /// [`MergedColumnSpec::shard_weight`] and uploaded on the group's stream. Errors (naming
    /// the layer, before anything is uploaded): as [`from_shard`](Self::from_shard), a weight
    /// of another shape (a transposed one says so), host slices of the wrong length.
    pub fn from_host(
        group: &TpGroup,
        spec: MergedColumnSpec,
        weight: HostWeight<'_, T>,
        bias: Option<&[T]>,
    ) -> Result<Self> {
        let (w, b) = host_shard(group, &spec, weight, bias)?;
        Self::from_shard(group, spec, w, b)
    }

    /// The layer from one host weight per section, in section order (e.g. Hugging Face's
    /// `q_proj`, `k_proj`, `v_proj`, each `[heads·head_dim, in_features]` as stored), and
    /// optionally one bias per section, cut by [`MergedColumnSpec::shard_weight_parts`] and
    /// uploaded on the group's stream. All parts are held at once; to load them one at a
    /// time, as a checkpoint is read, use [`loader`](Self::loader). Errors: as
    /// [`from_host`](Self::from_host), for each part.
    pub fn from_host_parts(
        group: &TpGroup,
        spec: MergedColumnSpec,
        weights: &[HostWeight<'_, T>],
        biases: Option<&[&[T]]>,
    ) -> Result<Self> {
        check_spec(group, &spec)?;
        let w = spec.shard_weight_parts(group.rank(), weights)?;
        let b = biases
            .map(|b| spec.shard_bias_parts(group.rank(), b))
            .transpose()?;
        let (w, b) = upload_shard(group, &w, b.as_deref())?;
        Self::from_shard(group, spec, w, b)
    }
}

impl<T: GemmElement + NcclType, W: DevicePtr<T>> MergedColumnParallelLinear<T, W> {
    /// The layer from this rank's shard, already on the group's device: `weight`
    /// `[out_per_rank, in]` (its part of each section, stacked), `bias` `[out_per_rank]`.
    /// Errors (naming the layer): a spec for another world size than the group's, a shard
    /// the GEMM cannot take (`out_per_rank` or `in` not a multiple of 8), a shard of the
    /// wrong length or on another device.
    pub fn from_shard(
        group: &TpGroup,
        spec: MergedColumnSpec,
        weight: W,
        bias: Option<W>,
    ) -> Result<Self> {
        let shard = Shard::new(group, &spec, weight, bias)?;
        Ok(MergedColumnParallelLinear {
            spec,
            shard,
            fusion: Fusion::Auto,
        })
    }

    /// The layer's shape.
    pub fn spec(&self) -> &MergedColumnSpec {
        &self.spec
    }

    /// The layer's name.
    pub fn name(&self) -> &str {
        self.spec.name()
    }

    /// The rank whose shard the layer holds.
    pub fn rank(&self) -> usize {
        self.shard.rank
    }

    /// The weight shard, `[out_per_rank, in]`.
    pub fn weight(&self) -> &W {
        &self.shard.weight
    }

    /// The bias shard, `[out_per_rank]`.
    pub fn bias(&self) -> Option<&W> {
        self.shard.bias.as_ref()
    }

    /// The same layer with another [`Fusion`] for
    /// [`forward_all_gather`](Self::forward_all_gather) (every rank must choose the same).
    pub fn with_fusion(mut self, fusion: Fusion) -> Self {
        self.fusion = fusion;
        self
    }

    /// How [`forward_all_gather`](Self::forward_all_gather) joins the all-gather and the GEMM.
    pub fn fusion(&self) -> Fusion {
        self.fusion
    }

    /// Megatron's sequence parallelism: each rank holds `x` `[m / W, in]`, its rows
    /// `r·m/W .. (r+1)·m/W` of the input, and gets `out` `[m, out_per_rank]` = `all_gather(x) · W_rᵀ
    /// (+ b_r)`, out_per_rank the rank's columns as in [`forward`](Self::forward). Unfused,
    /// [`all_gather`](crate::ops::all_gather) into the workspace `gathered` `[m, in]`, then
    /// the GEMM; fused ([`Fusion`]), one kernel
    /// ([`all_gather_gemm`](crate::ops::all_gather_gemm()), `gathered` untouched, the same
    /// bits). `m` is `W · x.len() / in`. Returns what ran. A collective: every rank calls it
    /// with the same `m`. Errors (naming the layer), before anything is launched.
    pub fn forward_all_gather(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        gathered: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<SequenceParallelPath> {
        self.shard
            .forward_all_gather(group, self.fusion, x, gathered, out)
    }

    /// For a QKV layer: the columns of q, k and v in a rank's output row.
    pub fn qkv_split(&self) -> Option<QkvSplit> {
        self.spec.qkv_split()
    }

    /// For a gate_up layer: the columns of gate and up in a rank's output row.
    pub fn gate_up_split(&self) -> Option<GateUpSplit> {
        self.spec.gate_up_split()
    }

    /// `out` `[m, out_per_rank]` = `x` `[m, in]` · `W_rᵀ` (+ `b_r`), enqueued on the group's
    /// stream; `m` is `x.len() / in`, 0 enqueues nothing. No collective: each rank's
    /// sections are what its attention heads (or its MLP slice) need.
    pub fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.shard.forward(group, x, out).map(|_| ())
    }
}
