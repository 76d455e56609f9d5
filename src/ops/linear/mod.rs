//! Tensor-parallel linear layers over a [`TpGroup`]: a rank's weight shard on its device,
//! the GEMM, and the collective that joins the ranks.
//!
//! | layer | a rank holds | `forward` | then |
//! |---|---|---|---|
//! | [`ColumnParallelLinear`] | weight rows `r·out/W .. (r+1)·out/W` (and that bias slice) | `[m, in] -> [m, out/W]` | optionally [`all_gather`](crate::ops::all_gather) to `[m, out]` ([`forward_gather`](ColumnParallelLinear::forward_gather)); from a sequence-parallel input `[m/W, in]`, all-gather + GEMM ([`forward_all_gather`](ColumnParallelLinear::forward_all_gather)) |
//! | [`MergedColumnParallelLinear`] | its heads of q, k, v (or its part of gate and up) | `[m, in] -> [m, out_per_rank]` | the caller reads the sections ([`QkvSplit`](crate::shard::QkvSplit), [`GateUpSplit`](crate::shard::GateUpSplit)); all-gather + GEMM as the column-parallel layer ([`forward_all_gather`](MergedColumnParallelLinear::forward_all_gather)) |
//! | [`RowParallelLinear`] | weight columns `r·in/W .. (r+1)·in/W`, and the whole bias | `[m, in/W] -> partial [m, out]` | [`all_reduce_fused`](crate::ops::all_reduce_fused): `out = Σ partials + bias`, bias added once, in f32; or with residual add and RMSNorm ([`forward_residual_rmsnorm`](RowParallelLinear::forward_residual_rmsnorm)); or GEMM + reduce-scatter, each rank its `[m/W, out]` rows ([`forward_reduce_scatter`](RowParallelLinear::forward_reduce_scatter)) |
//! | [`VocabParallelEmbedding`] | rows `r·P .. (r+1)·P` of the `[vocab, hidden]` table, the vocabulary padded ([`VocabParallelSpec`](crate::shard::VocabParallelSpec)) | token ids `[m] -> [m, hidden]`: the rank's rows, -0.0 for other ranks' tokens | [`all_reduce`](crate::ops::all_reduce()) in place: the table's rows on every rank, bit for bit (NaN payloads aside) |
//! | [`ParallelLMHead`] | the same rows of the LM head's weight (or the embedding's table, [`tied`](ParallelLMHead::tied)) | `[m, hidden] -> [m, P]` logits, padding columns zero | optionally [`all_gather`](crate::ops::all_gather) to `[m, vocab]`, padding dropped ([`forward_gather`](ParallelLMHead::forward_gather)) |
//!
//! The shard math (which rows, columns and heads a rank takes, and the checks that name the
//! layer) is host-only, in [`crate::shard`]; a layer is built from a spec of that module and
//! either the rank's shard already on the device (`from_shard`) or the full host weight
//! `[out_features, in_features]` it cuts and uploads (`from_host`), given as a
//! [`HostWeight`] with the shape the checkpoint stores (safetensors / Hugging Face
//! `[out_features, in_features]`), checked against the layer's. A merged layer also loads
//! section by section, one checkpoint tensor at a time
//! ([`MergedColumnParallelLinear::loader`]).
//!
//! # Calls
//!
//! Every rank of the group builds the same layers and calls `forward` with the same `m` in
//! the same order (as for any collective). A layer is built for one rank of one group:
//! `forward` refuses a group of another rank or world size. Activations are row-major; `m`
//! (tokens) is read from the input's length. Outputs and workspaces are the caller's: no
//! `forward` allocates, so a layer's calls can be captured into a CUDA graph (with the
//! collectives' own conditions, see [`mod@crate::ops::all_reduce`]).
//!
//! # Fusion
//!
//! A layer whose GEMM meets a collective (row-parallel, and column-parallel or merged in a
//! sequence-parallel region) runs both as one kernel or as two launches through the caller's
//! workspace, by its [`Fusion`] (`with_fusion`; the same bits either way): see
//! `docs/fused-gemm.md`.
//!
//! # Errors
//!
//! Before anything is launched, every length is checked against the layer's shape and a
//! wrong one is an [`Error::InvalidArgument`] whose `arg` is the layer's description (e.g.
//! `row-parallel 'layers.0.mlp.down_proj'`) and whose reason names the buffer. The checks of
//! the GEMM and the collectives (alignment, devices, aliasing, capacity) keep their reasons
//! and are renamed after the layer the same way.
//!
//! # Example: a tensor-parallel MLP on one rank
//!
//! ```no_run
//! use half::bf16;
//! use tpfuse::ops::linear::{MergedColumnParallelLinear, RowParallelLinear};
//! use tpfuse::shard::{HostWeight, MergedColumnSpec, RowParallelSpec};
//! use tpfuse::{GroupOptions, TpGroup};
//!
//! # fn main() -> tpfuse::Result<()> {
//! let ctx = tpfuse::device::open(0)?;
//! let groups = TpGroup::virtual_ranks(&ctx, 2, GroupOptions::default())?;
//! let (hidden, inter, m) = (1024, 4096, 4);
//! let gate_up_w = vec![bf16::ZERO; 2 * inter * hidden]; // [2·inter, hidden], from safetensors
//! let down_w = vec![bf16::ZERO; hidden * inter]; // [hidden, inter]
//! let group = &groups[0];
//! let w = group.world();
//! let gate_up = MergedColumnParallelLinear::from_host(
//!     group,
//!     MergedColumnSpec::gate_up("mlp.gate_up_proj", hidden, inter, w)?,
//!     HostWeight::new(&gate_up_w, 2 * inter, hidden),
//!     None,
//! )?;
//! let down = RowParallelLinear::from_host(
//!     group,
//!     RowParallelSpec::new("mlp.down_proj", inter, hidden, w)?,
//!     HostWeight::new(&down_w, hidden, inter),
//!     None,
//! )?;
//! let alloc = |n| group.stream().alloc_zeros::<bf16>(n)
//!     .map_err(|e| tpfuse::Error::Cuda { context: "alloc", source: e });
//! let x = alloc(m * hidden)?;
//! let mut h = alloc(m * gate_up.spec().out_per_rank())?; // [m, gate_r | up_r]
//! gate_up.forward(group, &x, &mut h)?;
//! let act = alloc(m * inter / w)?; // SiLU(gate_r) · up_r, by the engine's own kernel
//! let (mut partial, mut y) = (alloc(m * hidden)?, alloc(m * hidden)?);
//! down.forward(group, &act, Some(&mut partial), &mut y)?; // every other rank makes the same calls
//! # Ok(()) }
//! ```

use crate::device::cuda;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::group::TpGroup;
use crate::ops::gemm::{gemm, gemm_with_scratch, GemmElement, GemmShape, SPLIT_PARALLEL_M_MAX};
use crate::shard::{ColumnParallelSpec, HostWeight, MergedColumnSpec, RowParallelSpec};
use crate::validate::owner;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceSlice};
use std::borrow::Cow;

mod column;
mod embedding;
mod fusion;
mod gather;
mod lm_head;
mod loader;
mod merged;
mod row;
mod sequence;
mod vocab_shard;
mod workspace;

pub use column::ColumnParallelLinear;
pub use embedding::VocabParallelEmbedding;
pub use fusion::{Fusion, SequenceParallelPath};
pub use lm_head::ParallelLMHead;
pub use loader::SectionLoader;
pub use merged::MergedColumnParallelLinear;
pub use row::{RowParallelLinear, RowParallelPath};
pub use workspace::Workspace;

/// The names the GEMM's errors use for its arguments, and what a layer calls them.
const GEMM_NAMES: [(&str, &str); 5] = [
    ("a", "x"),
    ("b", "the weight shard"),
    ("bias", "the bias shard"),
    ("c", "out"),
    ("residual", "residual"),
];

/// Turns an inner op's [`Error::InvalidArgument`] into one naming the layer (`arg`) and, in
/// the reason, the layer's name for the argument the op named.
fn in_layer<'a>(label: &'a str, names: &'a [(&'a str, &'a str)]) -> impl Fn(Error) -> Error + 'a {
    move |e| match e {
        Error::InvalidArgument { arg, reason } => {
            let what = names
                .iter()
                .find(|(inner, _)| *inner == arg)
                .map_or(arg.as_str(), |(_, outer)| outer);
            Error::InvalidArgument {
                arg: label.to_string(),
                reason: format!("{what}: {reason}"),
            }
        }
        other => other,
    }
}

/// Errors unless `group` is rank `rank` of a group of `world` ranks.
fn check_group(label: &str, group: &TpGroup, rank: usize, world: usize) -> Result<()> {
    if group.world() != world {
        return Err(Error::invalid(
            label,
            format!(
                "the layer is sharded for world {world} but the group has {} ranks",
                group.world()
            ),
        ));
    }
    if group.rank() != rank {
        return Err(Error::invalid(
            label,
            format!(
                "the layer holds rank {rank}'s shard but the group is rank {}",
                group.rank()
            ),
        ));
    }
    Ok(())
}

/// The rows `m` of an activation of `len` elements, `k` per row.
fn rows_of(label: &str, what: &str, len: usize, k: usize) -> Result<usize> {
    if len % k != 0 {
        return Err(Error::invalid(
            label,
            format!("{what} holds {len} elements: not whole rows of {k}"),
        ));
    }
    Ok(len / k)
}

/// Errors unless a buffer holds `[rows, cols]` elements.
fn check_len(label: &str, what: &str, len: usize, rows: usize, cols: usize) -> Result<()> {
    let want = rows * cols;
    if len != want {
        return Err(Error::invalid(
            label,
            format!("{what} holds {len} elements but [{rows}, {cols}] needs {want}"),
        ));
    }
    Ok(())
}

/// Errors unless a buffer that lives on device `device` is on the group's device.
fn check_device(label: &str, what: &str, device: usize, group: &TpGroup) -> Result<()> {
    if device != group.device() {
        return Err(Error::invalid(
            label,
            format!(
                "{what} lives on device {device} but the group's rank {} is on device {}",
                group.rank(),
                group.device()
            ),
        ));
    }
    Ok(())
}

/// Errors unless a device shard holds `want` elements on the group's device.
fn check_shard<T>(
    label: &str,
    what: &str,
    shard: &impl DeviceSlice<T>,
    want: usize,
    shape: &str,
    group: &TpGroup,
) -> Result<()> {
    if shard.len() != want {
        return Err(Error::invalid(
            label,
            format!(
                "{what} holds {} elements but {shape} needs {want}",
                shard.len()
            ),
        ));
    }
    check_device(label, what, owner(shard), group)
}

fn upload<T: GemmElement>(group: &TpGroup, host: &[T]) -> Result<CudaSlice<T>> {
    group
        .stream()
        .clone_htod(host)
        .map_err(cuda("uploading a layer's shard"))
}

fn as_dyn<T, W: DevicePtr<T>>(bias: &Option<W>) -> Option<&dyn DevicePtr<T>> {
    bias.as_ref().map(|b| b as &dyn DevicePtr<T>)
}

/// How a layer's shard errors name its dimensions: the weight shard is `[n, k]`, the bias
/// `[n]`.
struct ShardNames {
    /// The weight's rows, e.g. `out_per_rank`.
    n: &'static str,
    /// The weight's columns, e.g. `in_features`.
    k: &'static str,
    /// The bias, e.g. `the bias shard`.
    bias: &'static str,
    /// Said after the bias's shape.
    bias_note: &'static str,
}

/// What a layer needs of its spec (from [`crate::shard`]); each method is the spec's own.
trait LayerSpec {
    /// How the layer's shard errors name its dimensions.
    const NAMES: ShardNames;
    fn label(&self) -> String;
    fn world(&self) -> usize;
    fn check_gemm_dims(&self) -> Result<()>;
    /// A rank's weight shard is `[n, k]`.
    fn shard_dims(&self) -> (usize, usize);
    /// Rank `rank`'s weight, cut from the full host weight.
    fn shard_weight<T: Copy>(&self, rank: usize, full: HostWeight<'_, T>) -> Result<Vec<T>>;
    /// Rank `rank`'s bias from the full host bias: cut, or (row-parallel) checked and whole.
    fn shard_bias<'a, T: Copy>(&self, rank: usize, full: &'a [T]) -> Result<Cow<'a, [T]>>;
}

/// [`LayerSpec`] for the column-parallel specs: `[out_per_rank, in_features]` shards, and a
/// bias cut like the weight's rows.
macro_rules! column_layer_spec {
    ($($spec:ty),*) => {$(
        impl LayerSpec for $spec {
            const NAMES: ShardNames = ShardNames {
                n: "out_per_rank",
                k: "in_features",
                bias: "the bias shard",
                bias_note: "",
            };
            fn label(&self) -> String {
                <$spec>::label(self)
            }
            fn world(&self) -> usize {
                <$spec>::world(self)
            }
            fn check_gemm_dims(&self) -> Result<()> {
                <$spec>::check_gemm_dims(self)
            }
            fn shard_dims(&self) -> (usize, usize) {
                (self.out_per_rank(), self.in_features())
            }
            fn shard_weight<T: Copy>(&self, rank: usize, full: HostWeight<'_, T>) -> Result<Vec<T>> {
                <$spec>::shard_weight(self, rank, full)
            }
            fn shard_bias<'a, T: Copy>(&self, rank: usize, full: &'a [T]) -> Result<Cow<'a, [T]>> {
                <$spec>::shard_bias(self, rank, full).map(Cow::Owned)
            }
        }
    )*};
}

column_layer_spec!(ColumnParallelSpec, MergedColumnSpec);

impl LayerSpec for RowParallelSpec {
    const NAMES: ShardNames = ShardNames {
        n: "out_features",
        k: "in_features / world",
        bias: "the bias",
        bias_note: " (a row-parallel bias is whole on every rank)",
    };
    fn label(&self) -> String {
        RowParallelSpec::label(self)
    }
    fn world(&self) -> usize {
        RowParallelSpec::world(self)
    }
    fn check_gemm_dims(&self) -> Result<()> {
        RowParallelSpec::check_gemm_dims(self)
    }
    fn shard_dims(&self) -> (usize, usize) {
        (self.out_features(), self.in_per_rank())
    }
    fn shard_weight<T: Copy>(&self, rank: usize, full: HostWeight<'_, T>) -> Result<Vec<T>> {
        RowParallelSpec::shard_weight(self, rank, full)
    }
    fn shard_bias<'a, T: Copy>(&self, _rank: usize, full: &'a [T]) -> Result<Cow<'a, [T]>> {
        self.check_bias(full)?;
        Ok(Cow::Borrowed(full))
    }
}

/// What every constructor checks first: the spec is for the group's world size, and the GEMM
/// can take its shard.
fn check_spec(group: &TpGroup, spec: &impl LayerSpec) -> Result<()> {
    check_group(&spec.label(), group, group.rank(), spec.world())?;
    spec.check_gemm_dims()
}

/// Uploads a rank's host weight, then its bias, on the group's stream.
fn upload_shard<T: GemmElement>(
    group: &TpGroup,
    weight: &[T],
    bias: Option<&[T]>,
) -> Result<(CudaSlice<T>, Option<CudaSlice<T>>)> {
    let w = upload(group, weight)?;
    let b = bias.map(|b| upload(group, b)).transpose()?;
    Ok((w, b))
}

/// What a `from_host` does before `from_shard`: [`check_spec`], this rank's weight and bias
/// from the full host ones ([`LayerSpec::shard_weight`], [`LayerSpec::shard_bias`]), uploaded.
fn host_shard<T: GemmElement>(
    group: &TpGroup,
    spec: &impl LayerSpec,
    weight: HostWeight<'_, T>,
    bias: Option<&[T]>,
) -> Result<(CudaSlice<T>, Option<CudaSlice<T>>)> {
    check_spec(group, spec)?;
    let w = spec.shard_weight(group.rank(), weight)?;
    let b = bias.map(|b| spec.shard_bias(group.rank(), b)).transpose()?;
    upload_shard(group, &w, b.as_deref())
}

/// A rank's shard of a layer on the device, `[n, k]` weight and `[n]` bias, with what its
/// calls are checked against; shared by the three layers. `W` holds the weight: an owned
/// `CudaSlice`, or a view of the engine's buffer (the layer borrows it).
struct Shard<T, W = CudaSlice<T>> {
    label: String,
    rank: usize,
    world: usize,
    n: usize,
    k: usize,
    weight: W,
    bias: Option<W>,
    element: std::marker::PhantomData<T>,
}

impl<T: GemmElement + NcclType, W: DevicePtr<T>> Shard<T, W> {
    /// A layer's `from_shard`: [`check_spec`], then the shards' lengths and devices.
    fn new<S: LayerSpec>(group: &TpGroup, spec: &S, weight: W, bias: Option<W>) -> Result<Self> {
        check_spec(group, spec)?;
        let label = spec.label();
        let (n, k) = spec.shard_dims();
        let names = &S::NAMES;
        check_shard(
            &label,
            "the weight shard",
            &weight,
            n * k,
            &format!("[{}, {}] = [{n}, {k}]", names.n, names.k),
            group,
        )?;
        if let Some(b) = &bias {
            check_shard(
                &label,
                names.bias,
                b,
                n,
                &format!("[{}] = [{n}]{}", names.n, names.bias_note),
                group,
            )?;
        }
        Ok(Shard {
            label,
            rank: group.rank(),
            world: spec.world(),
            n,
            k,
            weight,
            bias,
            element: std::marker::PhantomData,
        })
    }

    /// Errors unless `group` is the layer's; `m` from the length of `x`, `[m, k]`.
    fn rows(&self, group: &TpGroup, x: usize) -> Result<usize> {
        check_group(&self.label, group, self.rank, self.world)?;
        rows_of(&self.label, "x", x, self.k)
    }

    /// `out [m, n] = x [m, k] · weightᵀ (+ bias)`, the GEMM's errors renamed by `names`.
    fn gemm(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        bias: Option<&dyn DevicePtr<T>>,
        out: &mut impl DevicePtrMut<T>,
        m: usize,
        names: &[(&str, &str)],
    ) -> Result<()> {
        // Decode-sized calls take the group's scratch: the parts of a split k run in parallel
        // (the same bits as one after another, which larger m and plain `gemm` run).
        let shape = GemmShape {
            m,
            n: self.n,
            k: self.k,
        };
        if m <= SPLIT_PARALLEL_M_MAX {
            let mut scratch = group.split_scratch();
            if let Some(scratch) = scratch.as_mut() {
                return gemm_with_scratch(
                    group.stream(),
                    x,
                    &self.weight,
                    bias,
                    None,
                    out,
                    shape,
                    scratch,
                )
                .map_err(in_layer(&self.label, names));
            }
        }
        gemm(
            group.stream(),
            x,
            &self.weight,
            bias,
            None,
            out,
            m,
            self.n,
            self.k,
        )
        .map_err(in_layer(&self.label, names))
    }

    /// A column-parallel `forward`: `out [m, n] = x [m, k] · weightᵀ (+ bias)`; returns `m`.
    fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<usize> {
        let m = self.rows(group, x.len())?;
        check_len(&self.label, "out", out.len(), m, self.n)?;
        self.gemm(group, x, as_dyn(&self.bias), out, m, &GEMM_NAMES)?;
        Ok(m)
    }
}

impl<T, W: DeviceSlice<T>> Shard<T, W> {
    /// What a layer's `Debug` shows: its shape, rank and shard lengths (not the device
    /// buffers).
    fn debug(
        &self,
        f: &mut std::fmt::Formatter<'_>,
        kind: &str,
        spec: &dyn std::fmt::Debug,
    ) -> std::fmt::Result {
        f.debug_struct(kind)
            .field("spec", spec)
            .field("rank", &self.rank)
            .field("weight_len", &self.weight.len())
            .field("bias_len", &self.bias.as_ref().map(|b| b.len()))
            .finish()
    }
}
