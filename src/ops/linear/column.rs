//! Column-parallel: a rank holds rows of the weight and computes columns of the output,
//! optionally gathered.

use super::fusion::{Fusion, SequenceParallelPath};
use super::gather::rank_major_to_rows;
use super::{check_device, check_len, host_shard, in_layer, Shard};
use crate::dtype::NcclType;
use crate::error::Result;
use crate::group::TpGroup;
use crate::ops::collectives::{all_gather, check_all_gather};
use crate::ops::gemm::GemmElement;
use crate::shard::{ColumnParallelSpec, HostWeight};
use crate::validate::owner;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceSlice};

/// A column-parallel linear layer, one rank of it: `y[:, r·out/W .. (r+1)·out/W] = x · W_rᵀ
/// (+ b_r)`, where `W_r` `[out/W, in]` are rows `r·out/W .. (r+1)·out/W` of the full weight
/// and `b_r` the same slice of the bias. The output stays sharded ([`forward`](Self::forward))
/// or is gathered to the full `[m, out]` on every rank
/// ([`forward_gather`](Self::forward_gather)).
pub struct ColumnParallelLinear<T, W = CudaSlice<T>> {
    spec: ColumnParallelSpec,
    shard: Shard<T, W>,
    fusion: Fusion,
}

impl<T, W: DeviceSlice<T>> std::fmt::Debug for ColumnParallelLinear<T, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shard.debug(f, "ColumnParallelLinear", &self.spec)
    }
}

impl<T: GemmElement + NcclType> ColumnParallelLinear<T> {
    /// The layer from the full host weight, `[out_features, in_features]` as the checkpoint
    /// stores it (see [`HostWeight`]), and bias `[out_features]`: this rank's rows are cut
    /// ([`ColumnParallelSpec::shard_weight`]) and uploaded on the group's stream. Errors
    /// (naming the layer, before anything is uploaded): as [`from_shard`](Self::from_shard),
    /// a weight of another shape (a transposed one says so), host slices of the wrong
    /// length.
    pub fn from_host(
        group: &TpGroup,
        spec: ColumnParallelSpec,
        weight: HostWeight<'_, T>,
        bias: Option<&[T]>,
    ) -> Result<Self> {
        let (w, b) = host_shard(group, &spec, weight, bias)?;
        Self::from_shard(group, spec, w, b)
    }
}

impl<T: GemmElement + NcclType, W: DevicePtr<T>> ColumnParallelLinear<T, W> {
    /// The layer from this rank's shard, already on the group's device: `weight`
    /// `[out/W, in]`, `bias` `[out/W]`. Errors (naming the layer): a spec for another world
    /// size than the group's, a shard the GEMM cannot take (`out/W` or `in` not a multiple of
    /// 8), a shard of the wrong length or on another device.
    pub fn from_shard(
        group: &TpGroup,
        spec: ColumnParallelSpec,
        weight: W,
        bias: Option<W>,
    ) -> Result<Self> {
        let shard = Shard::new(group, &spec, weight, bias)?;
        Ok(ColumnParallelLinear {
            spec,
            shard,
            fusion: Fusion::Auto,
        })
    }

    /// The layer's shape.
    pub fn spec(&self) -> &ColumnParallelSpec {
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

    /// The weight shard, `[out/W, in]`.
    pub fn weight(&self) -> &W {
        &self.shard.weight
    }

    /// The bias shard, `[out/W]`.
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
    /// `r·m/W .. (r+1)·m/W` of the input, and gets `out` `[m, out/W]` = `all_gather(x) · W_rᵀ
    /// (+ b_r)`, out/W the rank's columns as in [`forward`](Self::forward). Unfused,
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

    /// This rank's columns of the output: `out` `[m, out/W]` = `x` `[m, in]` · `W_rᵀ`
    /// (+ `b_r`), enqueued on the group's stream. `m` is `x.len() / in`; 0 enqueues nothing.
    pub fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.shard.forward(group, x, out).map(|_| ())
    }

    /// The whole output on every rank: [`forward`](Self::forward) into `local` `[m, out/W]`,
    /// [`all_gather`] of every rank's `local` into `gathered` `[W, m, out/W]` (rank-major),
    /// then `W` strided device-to-device copies (`cuMemcpy2DAsync`, no kernel) into `out`
    /// `[m, out]`, where rank `r`'s columns are `r·out/W .. (r+1)·out/W`. For `m = 1` the two
    /// layouts are the same: the gather writes `out` directly and `gathered` is not touched
    /// (its length is still checked). A collective: every rank calls it with the same `m`.
    pub fn forward_gather(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        local: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        gathered: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let label = self.shard.label.as_str();
        let m = self.shard.rows(group, x.len())?;
        let (n, world) = (self.shard.n, self.shard.world);
        check_len(label, "local", local.len(), m, n)?;
        check_len(label, "gathered", gathered.len(), world * m, n)?;
        check_len(label, "out", out.len(), m, self.spec.out_features())?;
        check_device(label, "out", owner(&*out), group)?;
        // Every check of the gather before the GEMM runs (m = 1 gathers straight into out).
        let names = [
            ("input", "local"),
            ("out", if m == 1 { "out" } else { "gathered" }),
        ];
        let target = if m == 1 {
            (out.len(), owner(&*out))
        } else {
            (gathered.len(), owner(&*gathered))
        };
        check_all_gather::<T>(group, (local.len(), owner(&*local)), target)
            .map_err(in_layer(label, &names))?;
        self.shard.forward(group, x, local)?;
        if m == 0 {
            return Ok(());
        }
        if m == 1 {
            return all_gather(group, &*local, out).map_err(in_layer(label, &names));
        }
        all_gather(group, &*local, gathered).map_err(in_layer(label, &names))?;
        rank_major_to_rows(
            group.stream(),
            &*gathered,
            out,
            m,
            n,
            world * n,
            &vec![n; world],
        )
    }
}
