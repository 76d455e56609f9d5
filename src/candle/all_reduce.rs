//! The all-reduce of a candle tensor, in place ([`InplaceOp1`]) or into a new tensor
//! ([`CustomOp1`]), and the all-reduce with the residual add and RMSNorm fused in
//! ([`InplaceOp3`] on the residual; the normalised rows come back as a new tensor).

use super::{by_dtype, check_eps, cuda_only, operand, ordered};
use crate::dtype::{Element, NcclType};
use crate::group::TpGroup;
use crate::ops::{self, Algorithm};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{
    CpuStorage, CustomOp1, InplaceOp1, InplaceOp3, Layout, Result, Shape, Storage, Tensor,
};
use std::ops::Range;
use std::sync::Mutex;

const ALL_REDUCE: &str = "tpfuse::candle::all_reduce";
const RESIDUAL_RMSNORM: &str = "tpfuse::candle::all_reduce_residual_rmsnorm";

/// `x` summed over the ranks, as a new tensor of `x`'s shape. A collective.
pub fn all_reduce(group: &TpGroup, x: &Tensor) -> Result<Tensor> {
    x.apply_op1_no_bwd(&AllReduce { group })
}

/// `x := x` summed over the ranks, in place (candle's in-place op: every tensor sharing `x`'s
/// storage sees it). A collective.
pub fn all_reduce_in_place(group: &TpGroup, x: &Tensor) -> Result<()> {
    x.inplace_op1(&AllReduce { group })
}

/// The decode hot path: `h = Σ_ranks partial + residual`, `residual := h` in place, and the
/// returned tensor is `rmsnorm(h) · gamma` (`h · rsqrt(mean(h²) + eps) · gamma`, per row).
/// `partial` and `residual` `[.., hidden]`, `gamma` `[hidden]`, all of one dtype. A collective;
/// [`crate::ops::all_reduce_residual_rmsnorm`] on the tensors.
pub fn all_reduce_residual_rmsnorm(
    group: &TpGroup,
    partial: &Tensor,
    residual: &Tensor,
    gamma: &Tensor,
    eps: f32,
) -> Result<Tensor> {
    let op = ResidualRmsNorm {
        group,
        eps,
        normed: Normed::new(),
    };
    residual.inplace_op3(partial, gamma, &op)?;
    op.normed.take(residual)
}

struct AllReduce<'g> {
    group: &'g TpGroup,
}

impl InplaceOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        ALL_REDUCE
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        cuda_only(ALL_REDUCE)
    }

    fn cuda_fwd(&self, x: &mut CudaStorage, layout: &Layout) -> Result<()> {
        by_dtype!(ALL_REDUCE, x.dtype(), in_place(self.group, x, layout))
    }
}

fn in_place<T: Element + NcclType + CudaDType>(
    group: &TpGroup,
    x: &mut CudaStorage,
    layout: &Layout,
) -> Result<()> {
    let candle = x.device.cuda_stream();
    let range = operand(ALL_REDUCE, "x", group, (&*x, layout), &candle)?;
    let mut x = x.as_cuda_slice_mut::<T>()?.slice_mut(range);
    ordered(group, &candle, || {
        ops::all_reduce_in_place(group, &mut x, Algorithm::Auto)
    })?;
    Ok(())
}

impl CustomOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        ALL_REDUCE
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cuda_only(ALL_REDUCE)
    }

    fn cuda_fwd(&self, x: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        by_dtype!(ALL_REDUCE, x.dtype(), into_new(self.group, x, layout))
    }
}

fn into_new<T: Element + NcclType + CudaDType>(
    group: &TpGroup,
    x: &CudaStorage,
    layout: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let candle = x.device.cuda_stream();
    let range = operand(ALL_REDUCE, "x", group, (x, layout), &candle)?;
    // SAFETY: every element is written by the all-reduce before candle can read it (the
    // tensor exists only once this op returns Ok).
    let mut out = unsafe { x.device.alloc::<T>(range.len())? };
    let input = x.as_cuda_slice::<T>()?.slice(range);
    ordered(group, &candle, || {
        ops::all_reduce(group, &input, &mut out, Algorithm::Auto)
    })?;
    let out = CudaStorage::wrap_cuda_slice(out, x.device.clone());
    Ok((out, layout.shape().clone()))
}

/// The normalised rows an in-place op wrote besides its destination, handed back as a tensor
/// of the destination's shape (candle's in-place ops return nothing).
pub(super) struct Normed(Mutex<Option<CudaStorage>>);

impl Normed {
    pub(super) fn new() -> Normed {
        Normed(Mutex::new(None))
    }

    pub(super) fn set(&self, storage: CudaStorage) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(storage);
    }

    /// The tensor, once the op has run.
    pub(super) fn take(&self, like: &Tensor) -> Result<Tensor> {
        let storage = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        let storage = storage.ok_or_else(|| {
            candle_core::Error::Msg("the op returned without its normalised rows".into()).bt()
        })?;
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            like.shape().clone(),
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }
}

/// Checks the operands of a residual-and-norm op (see [`operand`]; all on the residual's candle
/// stream): `other` (the partial sums, `None` for the row-parallel op, whose input `x` is
/// checked against its layer) of the residual's shape, `gamma` `[hidden]`, both of the
/// residual's dtype; `eps` finite and not negative. Returns the element ranges of the
/// residual, `other` (empty without one) and `gamma`.
pub(super) fn check_norm_operands(
    op: &'static str,
    group: &TpGroup,
    residual: (&CudaStorage, &Layout),
    other: Option<(&str, &CudaStorage, &Layout)>,
    gamma: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<[Range<usize>; 3]> {
    let stream = residual.0.device.cuda_stream();
    let dims = residual.1.dims();
    let range = operand(op, "residual", group, residual, &stream)?;
    let Some(&hidden) = dims.last() else {
        candle_core::bail!("{op}: residual is a scalar; it must be [.., hidden]")
    };
    if gamma.1.dims() != [hidden] {
        candle_core::bail!(
            "{op}: gamma is {:?}; it must be [hidden] = [{hidden}] (residual is {dims:?})",
            gamma.1.dims()
        )
    }
    let mut operands = vec![("gamma", gamma.0, gamma.1)];
    if let Some((name, s, l)) = other {
        if l.dims() != dims {
            candle_core::bail!("{op}: {name} is {:?} but residual is {dims:?}", l.dims())
        }
        operands.push((name, s, l));
    }
    for (name, s, _) in &operands {
        if s.dtype() != residual.0.dtype() {
            let (got, want) = (s.dtype(), residual.0.dtype());
            candle_core::bail!("{op}: {name} is {got:?} but residual is {want:?}")
        }
    }
    check_eps(op, eps)?;
    let gamma_range = operand(op, "gamma", group, (gamma.0, gamma.1), &stream)?;
    let other_range = match other {
        Some((name, s, l)) => operand(op, name, group, (s, l), &stream)?,
        None => 0..0,
    };
    Ok([range, other_range, gamma_range])
}

struct ResidualRmsNorm<'g> {
    group: &'g TpGroup,
    eps: f32,
    normed: Normed,
}

impl InplaceOp3 for ResidualRmsNorm<'_> {
    fn name(&self) -> &'static str {
        RESIDUAL_RMSNORM
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        cuda_only(RESIDUAL_RMSNORM)
    }

    fn cuda_fwd(
        &self,
        residual: &mut CudaStorage,
        residual_layout: &Layout,
        partial: &CudaStorage,
        partial_layout: &Layout,
        gamma: &CudaStorage,
        gamma_layout: &Layout,
    ) -> Result<()> {
        let ranges = check_norm_operands(
            RESIDUAL_RMSNORM,
            self.group,
            (&*residual, residual_layout),
            Some(("partial", partial, partial_layout)),
            (gamma, gamma_layout),
            self.eps,
        )?;
        let dtype = residual.dtype();
        by_dtype!(
            RESIDUAL_RMSNORM,
            dtype,
            residual_rmsnorm(self, residual, partial, gamma, ranges)
        )
    }
}

fn residual_rmsnorm<T: Element + NcclType + CudaDType>(
    op: &ResidualRmsNorm<'_>,
    residual: &mut CudaStorage,
    partial: &CudaStorage,
    gamma: &CudaStorage,
    [range, partial_range, gamma_range]: [Range<usize>; 3],
) -> Result<()> {
    let device = residual.device.clone();
    let candle = device.cuda_stream();
    let partial = partial.as_cuda_slice::<T>()?.slice(partial_range);
    let gamma = gamma.as_cuda_slice::<T>()?.slice(gamma_range);
    // SAFETY: every element is written by the kernel before the tensor exists (Ok only).
    let mut normed = unsafe { device.alloc::<T>(range.len())? };
    let mut residual = residual.as_cuda_slice_mut::<T>()?.slice_mut(range);
    ordered(op.group, &candle, || {
        ops::all_reduce_residual_rmsnorm(
            op.group,
            &partial,
            &mut residual,
            &gamma,
            op.eps,
            &mut normed,
        )
    })?;
    op.normed
        .set(CudaStorage::wrap_cuda_slice(normed, device.clone()));
    Ok(())
}
