//! Row-parallel: a rank holds columns of the weight, computes a partial of the whole
//! output, and the all-reduce (with its fused epilogue) joins the ranks.

use super::{as_dyn, check_len, host_shard, in_layer, Shard};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::group::TpGroup;
use crate::ops::all_reduce::{all_reduce_fused, Algorithm, Epilogue, RmsNorm};
use crate::ops::gemm::{GemmElement, GemmShape};
use crate::ops::gemm_all_reduce::{facts_of, gemm_all_reduce, unfusable};
use crate::shard::{HostWeight, RowParallelSpec};
use crate::topology::{AllReduceAlgo, FusionRule};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

/// The names the all-reduce's errors use, and what a row-parallel layer calls them.
const ALL_REDUCE_NAMES: [(&str, &str); 7] = [
    ("partial", "partial"),
    ("out", "out"),
    ("bias", "the bias"),
    ("residual", "residual"),
    ("gamma", "norm.gamma"),
    ("eps", "norm.eps"),
    ("algorithm", "the layer's algorithm"),
];

/// The names the fused kernel's errors use, and what a row-parallel layer calls them.
const FUSED_NAMES: [(&str, &str); 7] = [
    ("x", "x"),
    ("weight", "the weight shard"),
    ("out", "out"),
    ("bias", "the bias"),
    ("residual", "residual"),
    ("gamma", "norm.gamma"),
    ("eps", "norm.eps"),
];

/// How a row-parallel layer joins its GEMM and its all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fusion {
    /// [`FusionRule`]'s choice (placeholder thresholds until measured): fused for small `m`
    /// on groups whose custom kernels run, when the layer's algorithm is
    /// [`Algorithm::Auto`] and the shape fits ([`unfusable`]); unfused otherwise.
    Auto,
    /// Always one kernel ([`gemm_all_reduce`]); a shape it cannot take (a message over half
    /// the group's capacity, too many tiles, a group without custom kernels) is an error
    /// naming the layer.
    Fused,
    /// Always the GEMM into `partial`, then [`all_reduce_fused`] with the layer's algorithm.
    Unfused,
}

/// What a row-parallel `forward` ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowParallelPath {
    /// The fused GEMM + all-reduce kernel ([`gemm_all_reduce`]); `partial` was not touched.
    Fused,
    /// The GEMM into `partial`, then this all-reduce.
    Unfused(AllReduceAlgo),
}

/// A row-parallel linear layer, one rank of it: a partial `x_r · W_rᵀ`, where `W_r`
/// `[out, in/W]` are columns `r·in/W .. (r+1)·in/W` of the full weight and `x_r` the same
/// columns of the input, then the all-reduce `y = Σ_r partial_r + b`. The bias is whole on
/// every rank and is the all-reduce epilogue's bias: added exactly once, in f32, to the
/// rank-ordered f32 sum, before the single rounding. Every rank ends with the same bits.
pub struct RowParallelLinear<T> {
    spec: RowParallelSpec,
    shard: Shard<T>,
    algorithm: Algorithm,
    fusion: Fusion,
}

impl<T> std::fmt::Debug for RowParallelLinear<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shard.debug(f, "RowParallelLinear", &self.spec)
    }
}

impl<T: GemmElement + NcclType> RowParallelLinear<T> {
    /// The layer from this rank's shard, already on the group's device: `weight`
    /// `[out, in/W]` and the whole `bias` `[out]`. The all-reduce algorithm is
    /// [`Algorithm::Auto`] ([`with_algorithm`](Self::with_algorithm) changes it). Errors
    /// (naming the layer): a spec for another world size than the group's, a shard the GEMM
    /// cannot take (`out` or `in/W` not a multiple of 8), a shard of the wrong length or on
    /// another device.
    pub fn from_shard(
        group: &TpGroup,
        spec: RowParallelSpec,
        weight: CudaSlice<T>,
        bias: Option<CudaSlice<T>>,
    ) -> Result<Self> {
        let shard = Shard::new(group, &spec, weight, bias)?;
        Ok(RowParallelLinear {
            spec,
            shard,
            algorithm: Algorithm::Auto,
            fusion: Fusion::Auto,
        })
    }

    /// The layer from the full host weight, `[out_features, in_features]` as the checkpoint
    /// stores it (see [`HostWeight`]; this rank's columns are cut by
    /// [`RowParallelSpec::shard_weight`]), and the full bias `[out_features]` (uploaded
    /// whole), on the group's stream. Errors (naming the layer, before anything is
    /// uploaded): as [`from_shard`](Self::from_shard), a weight of another shape (a
    /// transposed one says so), host slices of the wrong length.
    pub fn from_host(
        group: &TpGroup,
        spec: RowParallelSpec,
        weight: HostWeight<'_, T>,
        bias: Option<&[T]>,
    ) -> Result<Self> {
        let (w, b) = host_shard(group, &spec, weight, bias)?;
        Self::from_shard(group, spec, w, b)
    }

    /// The same layer with another all-reduce algorithm (every rank must choose the same).
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// The all-reduce algorithm the layer asks for.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The same layer with another [`Fusion`] (every rank must choose the same).
    pub fn with_fusion(mut self, fusion: Fusion) -> Self {
        self.fusion = fusion;
        self
    }

    /// How the layer joins its GEMM and all-reduce.
    pub fn fusion(&self) -> Fusion {
        self.fusion
    }

    /// Whether a call of `m` rows runs fused: [`Fusion`]'s rule. Forced fusion on a shape
    /// the kernel cannot take is an error naming the layer.
    fn fuses(&self, group: &TpGroup, m: usize) -> Result<bool> {
        let label = self.shard.label.as_str();
        let shape = GemmShape {
            m,
            n: self.shard.n,
            k: self.shard.k,
        };
        let refusal = |group: &TpGroup| -> Result<Option<String>> {
            if let Some(reason) = group.custom_kernels_refused() {
                return Ok(Some(format!("the group has no custom kernels: {reason}")));
            }
            Ok(unfusable::<T>(shape, &facts_of(group)))
        };
        match self.fusion {
            Fusion::Unfused => Ok(false),
            Fusion::Fused => match refusal(group)? {
                None => Ok(true),
                Some(reason) => Err(Error::invalid(
                    label,
                    format!("the layer forces the fused GEMM + all-reduce, but {reason}"),
                )),
            },
            Fusion::Auto => Ok(self.algorithm == Algorithm::Auto
                && m > 0
                && FusionRule::default().fuse(group.verdict(), m)
                && refusal(group)?.is_none()),
        }
    }

    /// The layer's shape.
    pub fn spec(&self) -> &RowParallelSpec {
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

    /// The weight shard, `[out, in/W]`.
    pub fn weight(&self) -> &CudaSlice<T> {
        &self.shard.weight
    }

    /// The bias, `[out]`, whole.
    pub fn bias(&self) -> Option<&CudaSlice<T>> {
        self.shard.bias.as_ref()
    }

    /// `m` from `x`, and the lengths of `partial` and `out` (`[m, out]`).
    fn check_call(&self, group: &TpGroup, x: usize, partial: usize, out: usize) -> Result<usize> {
        let (label, n) = (self.shard.label.as_str(), self.shard.n);
        let m = self.shard.rows(group, x)?;
        check_len(label, "partial", partial, m, n)?;
        check_len(label, "out", out, m, n)?;
        Ok(m)
    }

    /// What both forwards enqueue once their buffers are checked: fused
    /// ([`Fusion`]), one [`gemm_all_reduce`] with the bias and the given residual and norm
    /// as its epilogue; unfused, the partial product into the caller's workspace,
    /// `partial = x · W_rᵀ` (no bias), then [`all_reduce_fused`] of the partials with that
    /// epilogue. Both give the same bits.
    #[allow(clippy::too_many_arguments)]
    fn gemm_all_reduce<'e>(
        &'e self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        partial: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        m: usize,
        residual: Option<&'e mut dyn DevicePtrMut<T>>,
        norm: Option<RmsNorm<'e, T>>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<RowParallelPath> {
        let epilogue = Epilogue {
            bias: as_dyn(&self.shard.bias),
            residual,
            norm,
        };
        if self.fuses(group, m)? {
            let shape = GemmShape {
                m,
                n: self.shard.n,
                k: self.shard.k,
            };
            gemm_all_reduce(group, x, &self.shard.weight, epilogue, out, shape)
                .map_err(in_layer(&self.shard.label, &FUSED_NAMES))?;
            return Ok(RowParallelPath::Fused);
        }
        let names = [("a", "x"), ("b", "the weight shard"), ("c", "partial")];
        self.shard.gemm(group, x, None, partial, m, &names)?;
        all_reduce_fused(group, &*partial, epilogue, out, self.algorithm)
            .map(RowParallelPath::Unfused)
            .map_err(in_layer(&self.shard.label, &ALL_REDUCE_NAMES))
    }

    /// `out` `[m, out]` = `Σ_r x_r · W_rᵀ + b` on every rank: the GEMM of this rank's input
    /// columns `x` `[m, in/W]` into the workspace `partial` `[m, out]`, then
    /// [`all_reduce_fused`] of the partials with the bias as its epilogue (added once, in
    /// f32); or, when the layer fuses ([`Fusion`]), both in one kernel
    /// ([`gemm_all_reduce`], `partial` untouched, the same bits). Enqueued on the group's
    /// stream; returns what ran. A collective: every rank calls it with the same `m`. `m` is
    /// `x.len() / (in/W)`.
    pub fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        partial: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<RowParallelPath> {
        let m = self.check_call(group, x.len(), partial.len(), out.len())?;
        self.gemm_all_reduce(group, x, partial, m, None, None, out)
    }

    /// The decode hot path of a transformer block: `h = Σ_r x_r · W_rᵀ + b + residual`,
    /// `residual := h`, `out = rmsnorm(h) · norm.gamma`, on every rank. Fused
    /// ([`Fusion`]), all of it is one kernel ([`gemm_all_reduce`]); unfused, the GEMM writes
    /// the workspace `partial` `[m, out]` and the reduction, bias, residual add and RMSNorm
    /// are one [`all_reduce_fused`] (fully fused on the one-shot path). The same bits either
    /// way. Shapes: `x` `[m, in/W]`, `partial`, `residual` and `out` `[m, out]`, `norm.gamma`
    /// `[out]`. Returns what ran. A collective, as [`forward`](Self::forward).
    ///
    /// Without a bias and with [`Algorithm::Auto`] this is the GEMM followed by
    /// [`all_reduce_residual_rmsnorm`](crate::ops::all_reduce_residual_rmsnorm); with a
    /// bias, the bias is the epilogue's, added once after the reduction and before the
    /// residual.
    pub fn forward_residual_rmsnorm(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        partial: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        residual: &mut impl DevicePtrMut<T>,
        norm: RmsNorm<'_, T>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<RowParallelPath> {
        let m = self.check_call(group, x.len(), partial.len(), out.len())?;
        let (label, n) = (self.shard.label.as_str(), self.shard.n);
        check_len(label, "residual", residual.len(), m, n)?;
        if norm.gamma.len() != n {
            return Err(Error::invalid(
                label,
                format!(
                    "norm.gamma holds {} elements but a row of out_features needs {n}",
                    norm.gamma.len()
                ),
            ));
        }
        self.gemm_all_reduce(group, x, partial, m, Some(residual), Some(norm), out)
    }
}
