//! Loading a merged column-parallel layer one section at a time, as an engine reads a
//! checkpoint tensor by tensor (`q_proj`, then `k_proj`, then `v_proj`; `gate_proj`, then
//! `up_proj`): the rank's device shard is allocated once and each section's rows are copied
//! from the host tensor straight into their rows of it.

use super::{check_spec, MergedColumnParallelLinear};
use crate::device::cuda;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::group::TpGroup;
use crate::ops::gemm::GemmElement;
use crate::shard::{HostWeight, MergedColumnSpec};
use cudarc::driver::{CudaSlice, ValidAsZeroBits};

impl<T: GemmElement + NcclType + ValidAsZeroBits> MergedColumnParallelLinear<T> {
    /// A loader of this rank's shard of layer `spec`, one section at a time: see
    /// [`SectionLoader`]. Allocates the weight shard `[out_per_rank, in_features]` on the
    /// group's device (zeroed, on the group's stream). Errors (naming the layer): as
    /// [`from_shard`](Self::from_shard), a spec for another world size than the group's or a
    /// shard the GEMM cannot take; a failed allocation.
    pub fn loader(group: &TpGroup, spec: MergedColumnSpec) -> Result<SectionLoader<'_, T>> {
        check_spec(group, &spec)?;
        let weight = group
            .stream()
            .alloc_zeros(spec.out_per_rank() * spec.in_features())
            .map_err(cuda("allocating a layer's weight shard"))?;
        let loaded = vec![false; spec.sections().len()];
        Ok(SectionLoader {
            group,
            spec,
            weight,
            bias: None,
            loaded,
        })
    }
}

/// One rank's [`MergedColumnParallelLinear`] under construction, loaded one host tensor per
/// section, in any order, each exactly once; made by
/// [`MergedColumnParallelLinear::loader`].
///
/// [`load_section`](Self::load_section) takes one section's full host weight
/// `[heads · head_dim, in_features]` as the checkpoint stores it (e.g. Hugging Face's
/// `k_proj`, see [`HostWeight`]) and optionally its bias `[heads · head_dim]`, cuts this
/// rank's rows ([`MergedColumnSpec::section_shard_weight`]) and copies them, on the group's
/// stream, into their rows of the device shard ([`MergedColumnSpec::section_columns`]);
/// nothing of the host tensor is kept, so the caller may drop it at once. The result is bit
/// for bit what [`from_host`](MergedColumnParallelLinear::from_host) and
/// [`from_host_parts`](MergedColumnParallelLinear::from_host_parts) build from all the parts.
///
/// Biases are per section and optional: the first section given a bias allocates the bias
/// shard `[out_per_rank]`, zeroed, so a section loaded without one (a model with q and v
/// biases but none on k) adds zero; when no section has a bias the layer has none.
/// [`finish`](Self::finish) checks that every section was loaded.
///
/// ```no_run
/// use half::bf16;
/// use tpfuse::ops::linear::MergedColumnParallelLinear;
/// use tpfuse::shard::{HostWeight, MergedColumnSpec};
/// use tpfuse::{GroupOptions, TpGroup};
///
/// # fn read_tensor(_: &str) -> (Vec<bf16>, usize, usize) { unimplemented!() }
/// # fn main() -> tpfuse::Result<()> {
/// let ctx = tpfuse::device::open(0)?;
/// let groups = TpGroup::virtual_ranks(&ctx, 2, GroupOptions::default())?;
/// let group = &groups[0];
/// // Qwen2-7B: 28 query heads, 4 KV heads of 128, hidden 3584; q, k and v have biases.
/// let spec = MergedColumnSpec::qkv("layers.0.self_attn.qkv_proj", 3584, 128, 28, 4, 2)?;
/// let mut loader = MergedColumnParallelLinear::<bf16>::loader(group, spec)?;
/// for section in ["q", "k", "v"] {
///     let prefix = format!("model.layers.0.self_attn.{section}_proj");
///     let (w, rows, cols) = read_tensor(&format!("{prefix}.weight")); // safetensors [out, in]
///     let (b, _, _) = read_tensor(&format!("{prefix}.bias"));
///     loader.load_section(section, HostWeight::new(&w, rows, cols), Some(&b))?;
/// } // each tensor is dropped here, before the next is read
/// let qkv = loader.finish()?;
/// # Ok(()) }
/// ```
pub struct SectionLoader<'g, T> {
    group: &'g TpGroup,
    spec: MergedColumnSpec,
    /// `[out_per_rank, in_features]`, allocated once.
    weight: CudaSlice<T>,
    /// `[out_per_rank]`, allocated (zeroed) by the first section with a bias.
    bias: Option<CudaSlice<T>>,
    /// Whether each section was loaded.
    loaded: Vec<bool>,
}

impl<T> std::fmt::Debug for SectionLoader<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SectionLoader")
            .field("spec", &self.spec)
            .field("rank", &self.group.rank())
            .field("loaded", &self.loaded)
            .field("has_bias", &self.bias.is_some())
            .finish()
    }
}

impl<T: GemmElement + NcclType + ValidAsZeroBits> SectionLoader<'_, T> {
    /// The layer's shape.
    pub fn spec(&self) -> &MergedColumnSpec {
        &self.spec
    }

    /// The names of the sections not loaded yet, in section order.
    pub fn missing(&self) -> Vec<&str> {
        self.spec
            .sections()
            .iter()
            .zip(&self.loaded)
            .filter(|(_, &loaded)| !loaded)
            .map(|(s, _)| s.name.as_str())
            .collect()
    }

    /// Loads section `section` (its name, e.g. `"k"` or `"up"`) from its full host weight
    /// `weight`, `[heads · head_dim, in_features]` as stored, and optionally its full bias
    /// `[heads · head_dim]`: this rank's rows are copied on the group's stream into their
    /// rows of the device shard. The host slices may be dropped as soon as this returns.
    ///
    /// Errors (naming the layer, and the section where it applies, before anything is
    /// copied): no section of that name; a section already loaded; a weight of another
    /// shape (a transposed one says so) or whose data does not fill its shape; a bias of
    /// another length; a failed copy.
    pub fn load_section(
        &mut self,
        section: &str,
        weight: HostWeight<'_, T>,
        bias: Option<&[T]>,
    ) -> Result<()> {
        let index = self.spec.section_index(section)?;
        if self.loaded[index] {
            return Err(Error::invalid(
                self.spec.label(),
                format!("section '{section}' is already loaded: each section is loaded once"),
            ));
        }
        let rank = self.group.rank();
        let rows = self.spec.section_shard_weight(rank, index, weight)?;
        let bias_rows = bias
            .map(|b| self.spec.section_shard_bias(rank, index, b))
            .transpose()?;
        let columns = self.spec.section_columns(index);
        let k = self.spec.in_features();
        let stream = self.group.stream();
        stream
            .memcpy_htod(
                rows,
                &mut self.weight.slice_mut(columns.start * k..columns.end * k),
            )
            .map_err(cuda("copying a section into a layer's weight shard"))?;
        if let Some(b) = bias_rows {
            let shard = match &mut self.bias {
                Some(shard) => shard,
                none => none.insert(
                    stream
                        .alloc_zeros(self.spec.out_per_rank())
                        .map_err(cuda("allocating a layer's bias shard"))?,
                ),
            };
            stream
                .memcpy_htod(b, &mut shard.slice_mut(columns))
                .map_err(cuda("copying a section into a layer's bias shard"))?;
        }
        self.loaded[index] = true;
        Ok(())
    }

    /// The layer, once every section is loaded. Errors (naming the layer): the sections
    /// never loaded, by name.
    pub fn finish(self) -> Result<MergedColumnParallelLinear<T>> {
        let missing = self.missing();
        if !missing.is_empty() {
            let names: Vec<String> = missing.iter().map(|s| format!("'{s}'")).collect();
            let what = if missing.len() == 1 {
                "section"
            } else {
                "sections"
            };
            return Err(Error::invalid(
                self.spec.label(),
                format!(
                    "{what} {} never loaded: load_section each section once before finish",
                    names.join(", ")
                ),
            ));
        }
        MergedColumnParallelLinear::from_shard(self.group, self.spec, self.weight, self.bias)
    }
}
