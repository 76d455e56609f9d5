//! Megatron-LM's interleaved QKV layout, converted on the host to the stacked `[Q; K; V]`
//! layout every loader of tpfuse takes.
//!
//! Megatron-LM (Megatron-Core's `linear_qkv`, and the `query_key_value` of Megatron
//! checkpoints) stores the fused QKV weight grouped by KV head: for each KV head `g` in
//! `0..kv_heads`, the `q_heads / kv_heads` query heads of its group, then `k_g`, then `v_g`:
//!
//! ```text
//! Megatron  [q_0 .. q_{G-1} | k_0 | v_0 | q_G .. q_{2G-1} | k_1 | v_1 | ...]   (G = q_heads / kv_heads)
//! tpfuse    [q_0 .. q_{q_heads-1} | k_0 .. k_{kv_heads-1} | v_0 .. v_{kv_heads-1}]
//! ```
//!
//! (rows; each query and key head `head_dim` rows, each value head `v_head_dim`). Both have
//! the same shape and element count, so only the layer's head structure tells them apart:
//! a Megatron weight given as stacked passes every shape check and gives wrong shards.
//! Convert it first.

use super::{check_host_bias, check_weight_shape, describe, HostWeight, LayerKind};
use super::{MergedColumnSpec, Section};
use crate::error::{Error, Result};

/// The head structure of a QKV layer, from its spec.
struct Heads {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    v_head_dim: usize,
}

impl Heads {
    /// Errors (naming the layer) unless `spec` is a QKV layer whose query heads are whole
    /// groups of its KV heads.
    fn of(spec: &MergedColumnSpec) -> Result<Self> {
        let label = describe(LayerKind::MergedColumnParallel, spec.name());
        let (q, k, v): (&Section, &Section, &Section) = match (spec.qkv_split(), spec.sections()) {
            (Some(_), [q, k, v]) => (q, k, v),
            _ => {
                return Err(Error::invalid(
                    &label,
                    "not a QKV layer (sections q, k, v): the Megatron conversion regroups \
                     query, key and value heads",
                ))
            }
        };
        if q.heads % k.heads != 0 {
            return Err(Error::invalid(
                &label,
                format!(
                    "q heads {} are not whole groups of kv heads {}: Megatron's layout groups \
                     the query heads by KV head",
                    q.heads, k.heads
                ),
            ));
        }
        Ok(Heads {
            q_heads: q.heads,
            kv_heads: k.heads,
            head_dim: q.head_dim,
            v_head_dim: v.head_dim,
        })
    }

    /// The stacked layout's rows taken from `src` (each `cols` wide), in Megatron's row
    /// order: the rows of group `g` are its query heads, then `k_g`, then `v_g`.
    fn regroup<T: Copy>(&self, src: &[T], cols: usize) -> Vec<T> {
        let group = self.q_heads / self.kv_heads;
        let q_rows = group * self.head_dim;
        let group_rows = q_rows + self.head_dim + self.v_head_dim;
        let rows = |g: usize, start: usize, len: usize| {
            let first = g * group_rows + start;
            &src[first * cols..(first + len) * cols]
        };
        let mut out = Vec::with_capacity(src.len());
        for g in 0..self.kv_heads {
            out.extend_from_slice(rows(g, 0, q_rows));
        }
        for g in 0..self.kv_heads {
            out.extend_from_slice(rows(g, q_rows, self.head_dim));
        }
        for g in 0..self.kv_heads {
            out.extend_from_slice(rows(g, q_rows + self.head_dim, self.v_head_dim));
        }
        out
    }
}

/// The full QKV weight of a QKV layer `spec` (built by [`MergedColumnSpec::qkv`] or
/// [`MergedColumnSpec::qkv_with_v_head_dim`]) in tpfuse's stacked layout
/// `[out_features, in_features]` = `[Q; K; V]`, from the same weight in Megatron-LM's
/// interleaved layout, also `[out_features, in_features]`.
///
/// Megatron-LM (Megatron-Core's `linear_qkv`, the `query_key_value` of Megatron checkpoints)
/// groups the rows by KV head: for each KV head `g`, the `G = q_heads / kv_heads` query heads
/// of its group, then `k_g`, then `v_g`; tpfuse, Hugging Face and vLLM stack all query heads,
/// then all key heads, then all value heads:
///
/// ```text
/// Megatron  [q_0 .. q_{G-1} | k_0 | v_0 | q_G .. q_{2G-1} | k_1 | v_1 | ...]
/// tpfuse    [q_0 .. q_{q_heads-1} | k_0 .. k_{kv_heads-1} | v_0 .. v_{kv_heads-1}]
/// ```
///
/// (each query and key head `head_dim` rows, each value head `v_head_dim`). The two have the
/// same shape, so a Megatron weight passes every shape check and gives wrong shards unless
/// it is converted first. The result is what [`MergedColumnSpec::shard_weight`] and the layers' `from_host` take (as
/// `HostWeight::new(&stacked, spec.out_features(), spec.in_features())`).
///
/// For a Megatron checkpoint already split for tensor parallelism (one file per rank),
/// convert each rank's part with a spec of that rank's heads on one rank
/// (`MergedColumnSpec::qkv(name, hidden, head_dim, q_heads / W, kv_heads / W, 1)`): the
/// result is the rank's shard as [`from_shard`](crate::ops::linear::MergedColumnParallelLinear::from_shard)
/// takes it.
///
/// ```
/// use tpfuse::shard::{qkv_from_megatron, MergedColumnSpec, HostWeight};
/// # fn main() -> tpfuse::Result<()> {
/// // 4 query heads and 2 KV heads of one row each, hidden 1, on 1 rank.
/// let spec = MergedColumnSpec::qkv("qkv", 1, 1, 4, 2, 1)?;
/// //             group 0: q0 q1 k0 v0 | group 1: q2 q3 k1 v1
/// let megatron = [10, 11, 20, 30, 12, 13, 21, 31];
/// let stacked = qkv_from_megatron(&spec, HostWeight::new(&megatron, 8, 1))?;
/// assert_eq!(stacked, [10, 11, 12, 13, 20, 21, 30, 31]);
/// # Ok(()) }
/// ```
///
/// Errors (naming the layer): `spec` is not a QKV layer, or its query heads are not whole
/// groups of its KV heads; a weight of another shape than `[out_features, in_features]` (a
/// transposed one says so), or whose data does not fill its shape.
pub fn qkv_from_megatron<T: Copy>(
    spec: &MergedColumnSpec,
    weight: HostWeight<'_, T>,
) -> Result<Vec<T>> {
    let heads = Heads::of(spec)?;
    check_weight_shape(
        &spec.label(),
        "the Megatron QKV weight",
        &weight,
        (spec.out_features(), spec.in_features()),
        "[out_features, in_features]",
    )?;
    Ok(heads.regroup(weight.data(), spec.in_features()))
}

/// The full QKV bias `[out_features]` of a QKV layer `spec` in tpfuse's stacked layout
/// `[q; k; v]`, from the same bias in Megatron-LM's interleaved layout, as
/// [`qkv_from_megatron`] converts the weight.
///
/// Errors (naming the layer): as [`qkv_from_megatron`], and a bias of another length than
/// `out_features`.
pub fn qkv_bias_from_megatron<T: Copy>(spec: &MergedColumnSpec, bias: &[T]) -> Result<Vec<T>> {
    let heads = Heads::of(spec)?;
    check_host_bias(
        &spec.label(),
        bias.len(),
        spec.out_features(),
        "out_features",
    )?;
    Ok(heads.regroup(bias, 1))
}
