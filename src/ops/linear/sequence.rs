//! The column-parallel layers' sequence-parallel input: every rank holds `m / W` rows of the
//! activation, and the layer's GEMM runs on all `m` of them (Megatron's all-gather before a
//! column-parallel layer), as one fused kernel or as the all-gather into a workspace and the
//! GEMM.

use super::fusion::{fuses, FusedOp, Fusion, SequenceParallelPath};
use super::{as_dyn, check_group, check_len, in_layer, rows_of, Shard};
use crate::dtype::NcclType;
use crate::error::Result;
use crate::group::TpGroup;
use crate::ops::all_gather_gemm::{all_gather_gemm, unfusable_all_gather};
use crate::ops::collectives::all_gather;
use crate::ops::gemm::{check_gemm, GemmBuffers, GemmElement, GemmShape};
use crate::validate::{owner, BufferInfo};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// The names the fused all-gather + GEMM's errors use, and what a layer calls them.
const FUSED_NAMES: [(&str, &str); 5] = [
    ("m", "m"),
    ("x", "x"),
    ("weight", "the weight shard"),
    ("bias", "the bias shard"),
    ("out", "out"),
];

/// The names the GEMM's errors use on the unfused path.
const GEMM_NAMES: [(&str, &str); 4] = [
    ("a", "gathered"),
    ("b", "the weight shard"),
    ("bias", "the bias shard"),
    ("c", "out"),
];

impl<T: GemmElement + NcclType, W: DevicePtr<T>> Shard<T, W> {
    /// `out` `[m, n]` = `all_gather(x) · weightᵀ (+ bias)`, `x` `[m / W, k]` this rank's
    /// rows: fused by `fusion` ([`all_gather_gemm`], `gathered` untouched), else
    /// [`all_gather`] into `gathered` `[m, k]` and the GEMM. Every check of both steps runs
    /// before the first launches.
    pub(super) fn forward_all_gather(
        &self,
        group: &TpGroup,
        fusion: Fusion,
        x: &impl DevicePtr<T>,
        gathered: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<SequenceParallelPath> {
        let label = self.label.as_str();
        check_group(label, group, self.rank, self.world)?;
        let m = rows_of(label, "x", x.len(), self.k)? * self.world;
        check_len(label, "gathered", gathered.len(), m, self.k)?;
        check_len(label, "out", out.len(), m, self.n)?;
        let shape = GemmShape {
            m,
            n: self.n,
            k: self.k,
        };
        if fuses(
            fusion,
            label,
            FusedOp::AllGatherGemm,
            group,
            shape,
            true,
            |facts| unfusable_all_gather::<T>(shape, facts),
        )? {
            all_gather_gemm(group, x, &self.weight, as_dyn(&self.bias), out, shape)
                .map_err(in_layer(label, &FUSED_NAMES))?;
            return Ok(SequenceParallelPath::Fused);
        }
        if m == 0 {
            return Ok(SequenceParallelPath::Unfused);
        }
        self.check_gathered_gemm(group, &*gathered, out, shape)?;
        all_gather(group, x, gathered)
            .map_err(in_layer(label, &[("input", "x"), ("out", "gathered")]))?;
        self.gemm(group, &*gathered, as_dyn(&self.bias), out, m, &GEMM_NAMES)?;
        Ok(SequenceParallelPath::Unfused)
    }

    /// The GEMM's checks of the unfused path (alignment, overlaps of `out`), before the
    /// all-gather runs: a bad `out` must not be found after the ranks exchanged.
    fn check_gathered_gemm(
        &self,
        group: &TpGroup,
        gathered: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
        shape: GemmShape,
    ) -> Result<()> {
        let stream = group.stream();
        let info = |p: &dyn DevicePtr<T>| {
            let (addr, _guard) = p.device_ptr(stream);
            BufferInfo::new(addr, p.len(), owner(p))
        };
        let buffers = GemmBuffers {
            a: info(gathered),
            b: info(&self.weight),
            bias: self.bias.as_ref().map(|b| info(b)),
            residual: None,
            c: {
                let (len, device) = (out.len(), owner(&*out));
                let (addr, _guard) = out.device_ptr_mut(stream);
                BufferInfo::new(addr, len, device)
            },
        };
        check_gemm::<T>(&buffers, shape, group.device()).map_err(in_layer(&self.label, &GEMM_NAMES))
    }
}
