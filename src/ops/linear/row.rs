//! Row-parallel: a rank holds columns of the weight, computes a partial of the whole
//! output, and the all-reduce (with its fused epilogue) joins the ranks; or, in a
//! sequence-parallel region, the reduce-scatter gives each rank its rows of the sum.

use super::fusion::{fuses, FusedOp, Fusion, SequenceParallelPath};
use super::workspace::{Borrowed, Workspace};
use super::{as_dyn, check_group, check_len, host_shard, in_layer, Shard};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::group::TpGroup;
use crate::ops::all_reduce::{all_reduce_fused, check_fused, Algorithm, Epilogue, RmsNorm};
use crate::ops::collectives::{check_reduce_scatter, reduce_scatter};
use crate::ops::gemm::{GemmElement, GemmShape};
use crate::ops::gemm_all_reduce::{gemm_all_reduce_with, gemm_reduce_scatter, unfusable};
use crate::shard::{HostWeight, RowParallelSpec};
use crate::topology::AllReduceAlgo;
use crate::validate::owner;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceSlice};

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
const FUSED_NAMES: [(&str, &str); 8] = [
    ("algorithm", "the layer's algorithm"),
    ("x", "x"),
    ("weight", "the weight shard"),
    ("out", "out"),
    ("bias", "the bias"),
    ("residual", "residual"),
    ("gamma", "norm.gamma"),
    ("eps", "norm.eps"),
];

/// The names the fused GEMM + reduce-scatter's errors use, and what a row-parallel layer
/// calls them.
const SCATTER_NAMES: [(&str, &str); 4] = [
    ("m", "m"),
    ("x", "x"),
    ("weight", "the weight shard"),
    ("out", "out"),
];

/// What a row-parallel `forward` ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowParallelPath {
    /// The fused GEMM + all-reduce kernel ([`gemm_all_reduce_with`]), one-shot or two-shot;
    /// `partial` was not touched.
    Fused(AllReduceAlgo),
    /// The GEMM into `partial`, then this all-reduce.
    Unfused(AllReduceAlgo),
}

/// A row-parallel linear layer, one rank of it: a partial `x_r · W_rᵀ`, where `W_r`
/// `[out, in/W]` are columns `r·in/W .. (r+1)·in/W` of the full weight and `x_r` the same
/// columns of the input, then the all-reduce `y = Σ_r partial_r + b`. The bias is whole on
/// every rank and is the all-reduce epilogue's bias: added exactly once, in f32, to the
/// rank-ordered f32 sum, before the single rounding. Every rank ends with the same bits.
pub struct RowParallelLinear<T, W = CudaSlice<T>> {
    spec: RowParallelSpec,
    shard: Shard<T, W>,
    algorithm: Algorithm,
    fusion: Fusion,
}

impl<T, W: DeviceSlice<T>> std::fmt::Debug for RowParallelLinear<T, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shard.debug(f, "RowParallelLinear", &self.spec)
    }
}

impl<T: GemmElement + NcclType> RowParallelLinear<T> {
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
}

impl<T: GemmElement + NcclType, W: DevicePtr<T>> RowParallelLinear<T, W> {
    /// The layer from this rank's shard, already on the group's device: `weight`
    /// `[out, in/W]` and the whole `bias` `[out]`. The all-reduce algorithm is
    /// [`Algorithm::Auto`] ([`with_algorithm`](Self::with_algorithm) changes it). Errors
    /// (naming the layer): a spec for another world size than the group's, a shard the GEMM
    /// cannot take (`out` or `in/W` not a multiple of 8), a shard of the wrong length or on
    /// another device.
    pub fn from_shard(
        group: &TpGroup,
        spec: RowParallelSpec,
        weight: W,
        bias: Option<W>,
    ) -> Result<Self> {
        let shard = Shard::new(group, &spec, weight, bias)?;
        Ok(RowParallelLinear {
            spec,
            shard,
            algorithm: Algorithm::Auto,
            fusion: Fusion::Auto,
        })
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

    /// The call's shape, `[m, out]` from `[m, in/W]`.
    fn shape(&self, m: usize) -> GemmShape {
        GemmShape {
            m,
            n: self.shard.n,
            k: self.shard.k,
        }
    }

    /// Whether a call of `m` rows runs the fused GEMM + all-reduce: [`Fusion`]'s rule
    /// ([`Fusion::Auto`] never fuses a row-parallel layer today: `FusionRule`). The layer's
    /// algorithm picks the fused kernel's reduction (`Auto` by size, `OneShot`, `TwoShot`);
    /// [`Algorithm::Nccl`], and `TwoShot` with `m` not a multiple of the world size, would
    /// stay unfused under an `Auto` rule that fuses. Forced fusion on a shape the kernel
    /// cannot take ([`unfusable`]) is an error naming the layer.
    fn fuses(&self, group: &TpGroup, m: usize) -> Result<bool> {
        let shape = self.shape(m);
        let auto_allowed = match self.algorithm {
            Algorithm::Auto | Algorithm::OneShot => true,
            Algorithm::TwoShot => m % self.shard.world == 0,
            Algorithm::Nccl => false,
        };
        fuses(
            self.fusion,
            &self.shard.label,
            FusedOp::GemmAllReduce,
            group,
            shape,
            auto_allowed,
            |facts| unfusable::<T>(shape, facts),
        )
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
    pub fn weight(&self) -> &W {
        &self.shard.weight
    }

    /// The bias, `[out]`, whole.
    pub fn bias(&self) -> Option<&W> {
        self.shard.bias.as_ref()
    }

    /// `m` from `x`, and the lengths of `partial` (if given) and `out` (`[m, out]`).
    fn check_call(
        &self,
        group: &TpGroup,
        x: usize,
        partial: Option<usize>,
        out: usize,
    ) -> Result<usize> {
        let (label, n) = (self.shard.label.as_str(), self.shard.n);
        let m = self.shard.rows(group, x)?;
        if let Some(partial) = partial {
            check_len(label, "partial", partial, m, n)?;
        }
        check_len(label, "out", out, m, n)?;
        Ok(m)
    }

    /// Whether a [`forward`](Self::forward) or
    /// [`forward_residual_rmsnorm`](Self::forward_residual_rmsnorm) of `m` rows needs the
    /// `partial` workspace: `false` when it runs the fused kernel ([`Fusion`]; then `partial`
    /// may be `None`), `true` when it runs the GEMM and the all-reduce as two launches through
    /// it. The same answer on every rank. (For
    /// [`forward_reduce_scatter`](Self::forward_reduce_scatter), whose rule differs, `true` is
    /// conservative.) Errors as `forward` does for forced fusion on a shape the kernel cannot
    /// take.
    pub fn needs_partial(&self, group: &TpGroup, m: usize) -> Result<bool> {
        check_group(&self.shard.label, group, self.shard.rank, self.shard.world)?;
        Ok(!self.fuses(group, m)?)
    }

    /// The workspace of an unfused call, or the error that names it missing.
    fn partial<'p>(
        &self,
        partial: Option<&'p mut dyn Workspace<T>>,
        m: usize,
        path: &str,
    ) -> Result<Borrowed<'p, T>> {
        partial.map(Borrowed).ok_or_else(|| {
            Error::invalid(
                &self.shard.label,
                format!(
                    "partial: a call of m = {m} rows runs {path} in two launches, through the \
                     workspace partial [m, out] = [{m}, {}], and none was given (needs_partial \
                     says when one is needed)",
                    self.shard.n
                ),
            )
        })
    }

    /// What both forwards enqueue once their buffers are checked: fused
    /// ([`Fusion`]), one [`gemm_all_reduce_with`] with the bias and the given residual and norm
    /// as its epilogue; unfused, the partial product into the caller's workspace,
    /// `partial = x · W_rᵀ` (no bias), then [`all_reduce_fused`] of the partials with that
    /// epilogue. Both give the same bits.
    #[allow(clippy::too_many_arguments)]
    fn gemm_all_reduce<'e>(
        &'e self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        partial: Option<&mut dyn Workspace<T>>,
        m: usize,
        residual: Option<&'e mut dyn DevicePtrMut<T>>,
        norm: Option<RmsNorm<'e, T>>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<RowParallelPath> {
        let mut epilogue = Epilogue {
            bias: as_dyn(&self.shard.bias),
            residual,
            norm,
        };
        if self.fuses(group, m)? {
            let (w, shape, algo) = (&self.shard.weight, self.shape(m), self.algorithm);
            let plan = gemm_all_reduce_with(group, x, w, epilogue, out, shape, algo)
                .map_err(in_layer(&self.shard.label, &FUSED_NAMES))?;
            let ran = plan.all_reduce.unwrap_or(AllReduceAlgo::OneShot);
            return Ok(RowParallelPath::Fused(ran));
        }
        let mut partial = self.partial(partial, m, "the GEMM and the all-reduce")?;
        // The all-reduce is checked before the GEMM is launched: bad input is refused before
        // anything runs. The GEMM will write `partial`: its write intent (waits for every
        // earlier reader and writer) comes before the check's read.
        drop(partial.device_ptr_mut(group.stream()));
        check_fused(group, &partial, &mut epilogue, out, self.algorithm)
            .map_err(in_layer(&self.shard.label, &ALL_REDUCE_NAMES))?;
        let names = [("a", "x"), ("b", "the weight shard"), ("c", "partial")];
        self.shard.gemm(group, x, None, &mut partial, m, &names)?;
        all_reduce_fused(group, &partial, epilogue, out, self.algorithm)
            .map(RowParallelPath::Unfused)
            .map_err(in_layer(&self.shard.label, &ALL_REDUCE_NAMES))
    }

    /// `out` `[m, out]` = `Σ_r x_r · W_rᵀ + b` on every rank: the GEMM of this rank's input
    /// columns `x` `[m, in/W]` into the workspace `partial` `[m, out]`, then
    /// [`all_reduce_fused`] of the partials with the bias as its epilogue (added once, in
    /// f32); or, when the layer fuses ([`Fusion`]), both in one kernel
    /// ([`gemm_all_reduce_with`], `partial` untouched, the same bits). Enqueued on the group's
    /// stream; returns what ran. A collective: every rank calls it with the same `m`. `m` is
    /// `x.len() / (in/W)`.
    pub fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        partial: Option<&mut dyn Workspace<T>>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<RowParallelPath> {
        let m = self.check_call(group, x.len(), partial.as_ref().map(|p| p.len()), out.len())?;
        self.gemm_all_reduce(group, x, partial, m, None, None, out)
    }

    /// The decode hot path of a transformer block: `h = Σ_r x_r · W_rᵀ + b + residual`,
    /// `residual := h`, `out = rmsnorm(h) · norm.gamma`, on every rank. Fused
    /// ([`Fusion`]), all of it is one kernel ([`gemm_all_reduce_with`]); unfused, the GEMM writes
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
        partial: Option<&mut dyn Workspace<T>>,
        residual: &mut impl DevicePtrMut<T>,
        norm: RmsNorm<'_, T>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<RowParallelPath> {
        let m = self.check_call(group, x.len(), partial.as_ref().map(|p| p.len()), out.len())?;
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

    /// Megatron's sequence parallelism: `out` `[m / W, out]` = rows `r·m/W .. (r+1)·m/W` of
    /// `Σ_q x_q · W_qᵀ` on rank `r` (each rank's partial rounded to `T`, the partials added in
    /// rank order in f32, rounded once). Unfused, the GEMM writes the workspace `partial`
    /// `[m, out]`, then [`reduce_scatter`]; fused ([`Fusion::Fused`], whatever the layer's
    /// all-reduce algorithm; [`Fusion::Auto`] does not fuse it today: `FusionRule`), one
    /// kernel ([`gemm_reduce_scatter`], `partial` untouched). The same bits either way. Shapes: `x`
    /// `[m, in/W]`, `m` a multiple of the world size. Returns what ran. A collective, as
    /// [`forward`](Self::forward). Errors (naming the layer), before anything is launched:
    /// `m` not a multiple of the world size, wrong lengths, and a layer with a bias: this
    /// forward adds none (add it to the rows after, as Megatron does).
    pub fn forward_reduce_scatter(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        partial: Option<&mut dyn Workspace<T>>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<SequenceParallelPath> {
        let (label, n, world) = (self.shard.label.as_str(), self.shard.n, self.shard.world);
        let m = self.shard.rows(group, x.len())?;
        if self.shard.bias.is_some() {
            return Err(Error::invalid(
                label,
                "the layer has a bias, which forward_reduce_scatter does not add (add it to \
                 the rank's rows after the reduce-scatter)",
            ));
        }
        if m % world != 0 {
            return Err(Error::invalid(
                label,
                format!("m = {m} rows of x do not split into {world} equal slices (one per rank)"),
            ));
        }
        if let Some(partial) = &partial {
            check_len(label, "partial", partial.len(), m, n)?;
        }
        check_len(label, "out", out.len(), m / world, n)?;
        let shape = self.shape(m);
        let fused = fuses(
            self.fusion,
            label,
            FusedOp::GemmReduceScatter,
            group,
            shape,
            true,
            |facts| unfusable::<T>(shape, facts),
        )?;
        if fused {
            gemm_reduce_scatter(group, x, &self.shard.weight, out, shape)
                .map_err(in_layer(label, &SCATTER_NAMES))?;
            return Ok(SequenceParallelPath::Fused);
        }
        let mut partial = self.partial(partial, m, "the GEMM and the reduce-scatter")?;
        // The reduce-scatter is checked before the GEMM is launched.
        check_reduce_scatter::<T>(
            group,
            (partial.len(), owner(&partial)),
            (out.len(), owner(&*out)),
        )
        .map_err(in_layer(label, &[("input", "partial"), ("out", "out")]))?;
        let names = [("a", "x"), ("b", "the weight shard"), ("c", "partial")];
        self.shard.gemm(group, x, None, &mut partial, m, &names)?;
        reduce_scatter(group, &partial, out)
            .map_err(in_layer(label, &[("input", "partial"), ("out", "out")]))?;
        Ok(SequenceParallelPath::Unfused)
    }
}
