//! Megatron sharding of linear layers, on the host: which rows or columns of a full weight
//! each rank of a tensor-parallel group holds, and the rank's shard cut out of a full host
//! weight. Pure functions of shapes and slices, with no GPU, so that the shard math is
//! tested on the CPU against the f64 reference; the device layers of
//! [`ops::linear`](crate::ops::linear) build on them.
//!
//! # Conventions (DESIGN.md)
//!
//! A weight is row-major `[out_features, in_features]`, as in PyTorch and safetensors, and a
//! layer computes `y = x · Wᵀ (+ b)` on activations `x` `[m, in_features]`. With W ranks:
//!
//! - **column-parallel** ([`ColumnParallelSpec`]): rank `r` takes the rows
//!   `r·out/W .. (r+1)·out/W` of the weight (and of the bias) and computes the columns
//!   `r·out/W .. (r+1)·out/W` of `y`; concatenating the ranks' outputs along the columns
//!   gives `y`.
//! - **row-parallel** ([`RowParallelSpec`]): rank `r` takes the columns
//!   `r·in/W .. (r+1)·in/W` of the weight and the same columns of `x`, and computes a partial
//!   `[m, out]`; the sum of the partials over the ranks, plus the bias once, gives `y`. The
//!   bias is not sharded: every rank holds all of it and the all-reduce adds it once, after
//!   the reduction.
//! - **merged column-parallel** ([`MergedColumnSpec`]): several column-parallel layers with
//!   one input stacked along the rows of one weight, each *section* split on its own: QKV
//!   (`q`, `k`, `v`, split by attention heads, with grouped-query attention) and gate_up
//!   (`gate`, `up`). Rank `r`'s weight is its part of each section, in section order, so its
//!   output row is `[q_r | k_r | v_r]` (or `[gate_r | up_r]`).
//!
//! # Host weights: the checkpoint's shape, checked
//!
//! Every function here that takes a full host weight takes a [`HostWeight`]: the data with
//! the `(rows, cols)` the checkpoint gives it. safetensors and Hugging Face store a linear
//! weight as `[out_features, in_features]`: pass that shape as stored. It is checked against
//! the layer's before anything is cut, so a transposed weight (same element count) is an
//! error that names the layer, the expected and the given shape, and says `transposed?`.
//! Merged layers take their full weight stacked (`[Q; K; V]`, `[gate; up]`), one host weight
//! per section ([`MergedColumnSpec::shard_weight_parts`]), or one section at a time
//! ([`MergedColumnSpec::section_shard_weight`], and on the device
//! [`MergedColumnParallelLinear::loader`](crate::ops::linear::MergedColumnParallelLinear::loader)).
//! A Megatron-LM checkpoint's interleaved QKV (`[q_g | k_g | v_g]` per KV group) has the same
//! shape as the stacked one: convert it with [`qkv_from_megatron`] first.
//!
//! # Grouped-query attention
//!
//! `q_heads` must be divisible by W. KV heads are split like query heads when `kv_heads` is
//! a multiple of W; when there are fewer KV heads than ranks and W is a multiple of
//! `kv_heads`, each KV head is *replicated* on `W / kv_heads` consecutive ranks: rank `r`
//! holds KV head `r / (W / kv_heads)`, which is the KV head of all its query heads. Any other
//! `kv_heads` is an error.
//!
//! # Errors
//!
//! Every error is an [`Error::InvalidArgument`] whose `arg` is the layer's description
//! ([`describe`]), e.g. `row-parallel 'layers.0.mlp.down_proj'`, and whose reason says what
//! does not fit, e.g. `in_features 14336 is not divisible by world 6`.

use crate::error::{Error, Result};
use host::check_weight_shape;
use std::ops::Range;

mod column;
mod host;
mod megatron;
mod merged;
mod row;
mod vocab;

pub use column::ColumnParallelSpec;
pub use host::HostWeight;
pub use megatron::{qkv_bias_from_megatron, qkv_from_megatron};
pub use merged::{GateUpSplit, MergedColumnSpec, QkvSplit, Section};
pub use row::RowParallelSpec;
pub use vocab::{VocabParallelSpec, VOCAB_PADDING};

/// The largest `m`, `n` or `k` the GEMM takes (2^30), checked by the `check_gemm_dims`
/// methods.
const MAX_DIM: usize = 1 << 30;

/// The kind of a sharded linear layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Output features split across the ranks.
    ColumnParallel,
    /// Input features split across the ranks; partial outputs summed.
    RowParallel,
    /// Several column-parallel sections in one weight (QKV, gate_up).
    MergedColumnParallel,
    /// A `[vocab, hidden]` table split by rows, the vocabulary padded (token embedding, LM
    /// head).
    VocabParallel,
}

impl LayerKind {
    /// The kind as errors name it: `"column-parallel"`, `"row-parallel"`,
    /// `"merged-column-parallel"` or `"vocab-parallel"`.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::ColumnParallel => "column-parallel",
            LayerKind::RowParallel => "row-parallel",
            LayerKind::MergedColumnParallel => "merged-column-parallel",
            LayerKind::VocabParallel => "vocab-parallel",
        }
    }
}

/// A layer's description as errors name it, e.g. `row-parallel 'layers.0.mlp.down_proj'`.
///
/// ```
/// use tpfuse::shard::{describe, LayerKind};
/// assert_eq!(
///     describe(LayerKind::RowParallel, "layers.0.mlp.down_proj"),
///     "row-parallel 'layers.0.mlp.down_proj'"
/// );
/// ```
pub fn describe(kind: LayerKind, name: &str) -> String {
    format!("{} '{name}'", kind.name())
}

fn check_world(label: &str, world: usize) -> Result<()> {
    if world == 0 {
        return Err(Error::invalid(
            label,
            "world 0: a group has at least one rank",
        ));
    }
    Ok(())
}

fn check_rank(label: &str, rank: usize, world: usize) -> Result<()> {
    if rank >= world {
        return Err(Error::invalid(
            label,
            format!("rank {rank} is out of range for world {world}"),
        ));
    }
    Ok(())
}

fn check_positive(label: &str, what: &str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(Error::invalid(
            label,
            format!("{what} is 0: must be positive"),
        ));
    }
    Ok(())
}

fn check_divisible(label: &str, what: &str, value: usize, world: usize) -> Result<()> {
    if value % world != 0 {
        return Err(Error::invalid(
            label,
            format!("{what} {value} is not divisible by world {world}"),
        ));
    }
    Ok(())
}

/// `rows · cols`, or an error when the product overflows.
fn elements(label: &str, rows: usize, cols: usize) -> Result<usize> {
    rows.checked_mul(cols).ok_or_else(|| {
        Error::invalid(
            label,
            format!("a [{rows}, {cols}] weight overflows the address space"),
        )
    })
}

/// Errors unless a host slice holds `want` elements; `shape` says where `want` comes from.
fn check_len(label: &str, what: &str, got: usize, want: usize, shape: &str) -> Result<()> {
    if got != want {
        return Err(Error::invalid(
            label,
            format!("{what} holds {got} elements but {shape} needs {want}"),
        ));
    }
    Ok(())
}

/// The GEMM's requirements on a rank's shard `[n, k]`: both positive multiples of 8, at most
/// 2^30.
fn check_gemm(label: &str, n: (&str, usize), k: (&str, usize)) -> Result<()> {
    for (what, value) in [n, k] {
        if value == 0 || value % 8 != 0 {
            return Err(Error::invalid(
                label,
                format!(
                    "{what} {value} of a rank's shard is not a positive multiple of 8, which \
                     the GEMM needs"
                ),
            ));
        }
        if value > MAX_DIM {
            return Err(Error::invalid(
                label,
                format!("{what} {value} exceeds the GEMM's largest dimension, 2^30"),
            ));
        }
    }
    Ok(())
}

/// The checks of a column- or row-parallel spec, errors naming layer `name` of kind `kind`:
/// a positive world and dimensions, the dimension `split` (`(name, value)`) divisible by the
/// world, a weight that can be addressed.
fn check_dense(
    kind: LayerKind,
    name: &str,
    in_features: usize,
    out_features: usize,
    world: usize,
    split: (&str, usize),
) -> Result<()> {
    let label = &describe(kind, name);
    check_world(label, world)?;
    check_positive(label, "in_features", in_features)?;
    check_positive(label, "out_features", out_features)?;
    check_divisible(label, split.0, split.1, world)?;
    elements(label, out_features, in_features)?;
    Ok(())
}

/// Rank `rank`'s part `rank·per .. (rank+1)·per` of a dimension split evenly across `world`
/// ranks.
fn even_part(label: &str, rank: usize, world: usize, per: usize) -> Result<Range<usize>> {
    check_rank(label, rank, world)?;
    Ok(rank * per..(rank + 1) * per)
}

/// Errors unless a full host weight is `[out_features, in_features]` and holds that many
/// elements.
fn check_host_weight<T>(
    label: &str,
    weight: &HostWeight<'_, T>,
    out_features: usize,
    in_features: usize,
) -> Result<()> {
    check_weight_shape(
        label,
        "the host weight",
        weight,
        (out_features, in_features),
        "[out_features, in_features]",
    )
}

/// Errors unless a full host bias holds `out_features` elements; `shape` says so in the error.
fn check_host_bias(label: &str, got: usize, out_features: usize, shape: &str) -> Result<()> {
    check_len(label, "the host bias", got, out_features, shape)
}

/// The rows `rows` (each `cols` wide) of a row-major matrix, in order.
fn take_rows<T: Copy>(full: &[T], cols: usize, rows: &[Range<usize>]) -> Vec<T> {
    let total: usize = rows.iter().map(|r| r.len()).sum();
    let mut out = Vec::with_capacity(total * cols);
    for r in rows {
        out.extend_from_slice(&full[r.start * cols..r.end * cols]);
    }
    out
}
