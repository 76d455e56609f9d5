//! The row-parallel linear on candle tensors: [`RowParallelLinear::forward`] as a
//! [`CustomOp1`] (a new output tensor), and
//! [`RowParallelLinear::forward_residual_rmsnorm`] as an [`InplaceOp3`] on the residual (the
//! normalised rows come back as a new tensor). The layer fuses its GEMM and all-reduce where
//! its plan says so; an unfused call's `partial` workspace is allocated on candle's stream for
//! the call and freed after it.

use super::all_reduce::{check_norm_operands, Normed};
use super::{cuda_only, operand, ordered};
use crate::dtype::NcclType;
use crate::group::TpGroup;
use crate::ops::gemm::GemmElement;
use crate::ops::linear::{RowParallelLinear, Workspace};
use crate::ops::RmsNorm;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{CpuStorage, CustomOp1, InplaceOp3, Layout, Result, Shape, Tensor, WithDType};
use std::ops::Range;

const ROW_PARALLEL: &str = "tpfuse::candle::row_parallel";
const ROW_RESIDUAL_RMSNORM: &str = "tpfuse::candle::row_parallel_residual_rmsnorm";

/// `x · Wᵀ (+ b)` summed over the ranks: `x` `[.., in_features / W]` (this rank's input
/// columns), the result `[.., out_features]`, a new tensor. A collective; the layer's
/// [`forward`](RowParallelLinear::forward) on the tensors.
pub fn row_parallel<T, W>(
    group: &TpGroup,
    layer: &RowParallelLinear<T, W>,
    x: &Tensor,
) -> Result<Tensor>
where
    T: GemmElement + NcclType + CudaDType + WithDType,
    W: DevicePtr<T>,
{
    x.apply_op1_no_bwd(&Forward { group, layer })
}

/// `h = Σ_ranks x · Wᵀ (+ b) + residual`, `residual := h` in place, and the returned tensor is
/// `rmsnorm(h) · gamma`. `x` `[.., in_features / W]`, `residual` `[.., out_features]` (the
/// same rows), `gamma` `[out_features]`. A collective; the layer's
/// [`forward_residual_rmsnorm`](RowParallelLinear::forward_residual_rmsnorm) on the tensors.
pub fn row_parallel_residual_rmsnorm<T, W>(
    group: &TpGroup,
    layer: &RowParallelLinear<T, W>,
    x: &Tensor,
    residual: &Tensor,
    gamma: &Tensor,
    eps: f32,
) -> Result<Tensor>
where
    T: GemmElement + NcclType + CudaDType + WithDType,
    W: DevicePtr<T>,
{
    let op = ResidualRmsNorm {
        group,
        layer,
        eps,
        normed: Normed::new(),
    };
    residual.inplace_op3(x, gamma, &op)?;
    op.normed.take(residual)
}

struct Forward<'a, T, W> {
    group: &'a TpGroup,
    layer: &'a RowParallelLinear<T, W>,
}

/// Checks `x` against the layer (dtype, `[.., in_features / W]`, and as an [`operand`] on the
/// candle stream `stream`) and returns its element range and its rows.
fn check_x<T: GemmElement + NcclType + WithDType, W: DevicePtr<T>>(
    op: &'static str,
    group: &TpGroup,
    layer: &RowParallelLinear<T, W>,
    x: (&CudaStorage, &Layout),
    stream: &CudaStream,
) -> Result<(Range<usize>, usize)> {
    check_dtype(op, "x", layer, x.0)?;
    let (name, cols) = (layer.name(), layer.spec().in_per_rank());
    if x.1.dims().last() != Some(&cols) {
        candle_core::bail!(
            "{op}: x is {:?}; layer {name} takes [.., in_features / W] = [.., {cols}]",
            x.1.dims()
        )
    }
    let range = operand(op, "x", group, x, stream)?;
    let rows = range.len() / cols;
    Ok((range, rows))
}

/// Errors unless `storage` holds the layer's dtype.
fn check_dtype<T: GemmElement + NcclType + WithDType, W: DevicePtr<T>>(
    op: &str,
    name: &str,
    layer: &RowParallelLinear<T, W>,
    storage: &CudaStorage,
) -> Result<()> {
    let want = <T as WithDType>::DTYPE;
    if storage.dtype() != want {
        let layer = layer.name();
        candle_core::bail!(
            "{op}: {name} is {:?} but layer {layer} is {want:?}",
            storage.dtype()
        )
    }
    Ok(())
}

/// The workspace of an unfused call of `m` rows, on candle's stream; `None` when the call
/// fuses.
fn workspace<T: GemmElement + NcclType, W: DevicePtr<T>>(
    group: &TpGroup,
    layer: &RowParallelLinear<T, W>,
    device: &CudaDevice,
    m: usize,
) -> Result<Option<CudaSlice<T>>> {
    if !layer.needs_partial(group, m).map_err(super::error)? {
        return Ok(None);
    }
    // SAFETY: the GEMM writes every element before the all-reduce reads it.
    Ok(Some(unsafe {
        device.alloc::<T>(m * layer.spec().out_features())?
    }))
}

impl<T, W> CustomOp1 for Forward<'_, T, W>
where
    T: GemmElement + NcclType + CudaDType + WithDType,
    W: DevicePtr<T>,
{
    fn name(&self) -> &'static str {
        ROW_PARALLEL
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cuda_only(ROW_PARALLEL)
    }

    fn cuda_fwd(&self, x: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let (group, layer) = (self.group, self.layer);
        let (device, candle) = (&x.device, x.device.cuda_stream());
        let (range, m) = check_x(ROW_PARALLEL, group, layer, (x, layout), &candle)?;
        let n = layer.spec().out_features();
        let mut dims = layout.dims().to_vec();
        *dims.last_mut().expect("checked: x is [.., in / W]") = n;
        let input = x.as_cuda_slice::<T>()?.slice(range);
        let mut partial = workspace(group, layer, device, m)?;
        // SAFETY: every element is written by the layer before the tensor exists (Ok only).
        let mut out = unsafe { device.alloc::<T>(m * n)? };
        ordered(group, &candle, || {
            let partial = partial.as_mut().map(|p| p as &mut dyn Workspace<T>);
            layer.forward(group, &input, partial, &mut out)
        })?;
        // `partial` is freed here, on candle's stream, after its join with the group's.
        Ok((
            CudaStorage::wrap_cuda_slice(out, device.clone()),
            Shape::from(dims),
        ))
    }
}

struct ResidualRmsNorm<'a, T, W> {
    group: &'a TpGroup,
    layer: &'a RowParallelLinear<T, W>,
    eps: f32,
    normed: Normed,
}

impl<T, W> InplaceOp3 for ResidualRmsNorm<'_, T, W>
where
    T: GemmElement + NcclType + CudaDType + WithDType,
    W: DevicePtr<T>,
{
    fn name(&self) -> &'static str {
        ROW_RESIDUAL_RMSNORM
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
        cuda_only(ROW_RESIDUAL_RMSNORM)
    }

    fn cuda_fwd(
        &self,
        residual: &mut CudaStorage,
        residual_layout: &Layout,
        x: &CudaStorage,
        x_layout: &Layout,
        gamma: &CudaStorage,
        gamma_layout: &Layout,
    ) -> Result<()> {
        let (op, group, layer) = (ROW_RESIDUAL_RMSNORM, self.group, self.layer);
        let device = residual.device.clone();
        let candle = device.cuda_stream();
        check_dtype(op, "residual", layer, residual)?;
        let (x_range, m) = check_x(op, group, layer, (x, x_layout), &candle)?;
        let (r, g) = ((&*residual, residual_layout), (gamma, gamma_layout));
        let [range, _, gamma_range] = check_norm_operands(op, group, r, None, g, self.eps)?;
        let (dims, n) = (residual_layout.dims(), layer.spec().out_features());
        let x_rows = &x_layout.dims()[..x_layout.dims().len() - 1];
        if dims.last() != Some(&n) || &dims[..dims.len() - 1] != x_rows {
            candle_core::bail!(
                "{op}: residual is {dims:?}; layer {} with x {:?} needs x's leading dimensions \
                 {x_rows:?}, then out_features = {n}",
                layer.name(),
                x_layout.dims()
            )
        }
        let input = x.as_cuda_slice::<T>()?.slice(x_range);
        let gamma = gamma.as_cuda_slice::<T>()?.slice(gamma_range);
        let mut partial = workspace(group, layer, &device, m)?;
        // SAFETY: every element is written by the layer before the tensor exists (Ok only).
        let mut normed = unsafe { device.alloc::<T>(m * n)? };
        let mut residual = residual.as_cuda_slice_mut::<T>()?.slice_mut(range);
        ordered(group, &candle, || {
            let partial = partial.as_mut().map(|p| p as &mut dyn Workspace<T>);
            let norm = RmsNorm {
                gamma: &gamma,
                eps: self.eps,
            };
            layer.forward_residual_rmsnorm(group, &input, partial, &mut residual, norm, &mut normed)
        })?;
        self.normed
            .set(CudaStorage::wrap_cuda_slice(normed, device.clone()));
        Ok(())
    }
}
