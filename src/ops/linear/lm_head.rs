//! The vocabulary-parallel LM head: column-parallel over the padded vocabulary, with the
//! logits gathered into `[m, vocab]` without the padding.

use super::embedding::VocabParallelEmbedding;
use super::gather::rank_major_to_rows;
use super::vocab_shard::VocabShard;
use super::{check_device, check_len, in_layer, rows_of};
use crate::dtype::NcclType;
use crate::error::Result;
use crate::group::TpGroup;
use crate::ops::collectives::{all_gather, check_all_gather};
use crate::ops::gemm::{gemm, GemmElement};
use crate::shard::{HostWeight, VocabParallelSpec};
use crate::validate::owner;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceSlice};
use std::sync::Arc;

/// How the LM head's errors name the GEMM's arguments.
const LM_HEAD_NAMES: [(&str, &str); 3] = [("a", "x"), ("b", "the weight shard"), ("c", "local")];

/// A vocabulary-parallel LM head, one rank of it: the logits `x · Wᵀ` of a `[vocab, hidden]`
/// weight split by rows as [`VocabParallelSpec`] says (rank `r` holds the rows
/// `r·P .. (r+1)·P` of the padded vocabulary, zeros past `vocab`). No bias.
///
/// [`forward`](Self::forward) leaves the rank's logits `[m, P]`, whose columns past
/// `spec().valid_rows(rank).len()` are padding (zeros, not logits: an engine that samples
/// from sharded logits must ignore them). [`forward_gather`](Self::forward_gather) gives every
/// rank the logits `[m, vocab]`, with the padding dropped.
pub struct ParallelLMHead<T, W = CudaSlice<T>> {
    shard: VocabShard<T, W>,
}

impl<T, W: DeviceSlice<T>> std::fmt::Debug for ParallelLMHead<T, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shard.debug(f, "ParallelLMHead")
    }
}

/// How the LM head's errors name its weight.
const WEIGHT: &str = "the weight shard";

impl<T: GemmElement + NcclType> ParallelLMHead<T> {
    /// The layer from the full host weight `[vocab, hidden]`, as the checkpoint stores it
    /// (`lm_head.weight`): this rank's rows are cut and padded
    /// ([`VocabParallelSpec::shard_table`]) and uploaded on the group's stream. Errors
    /// (naming the layer, before anything is uploaded): as [`from_shard`](Self::from_shard),
    /// a weight of another shape (a transposed one says so).
    pub fn from_host(
        group: &TpGroup,
        spec: VocabParallelSpec,
        weight: HostWeight<'_, T>,
    ) -> Result<Self>
    where
        T: Default,
    {
        let shard = VocabShard::from_host(group, spec, weight, WEIGHT)?;
        Ok(ParallelLMHead { shard })
    }
}

impl<T: GemmElement + NcclType, W: DevicePtr<T>> ParallelLMHead<T, W> {
    /// The layer from this rank's weight `[P, hidden]` (its rows of the padded weight, zeros
    /// past `vocab`; see [`VocabParallelSpec::shard_table`]), already on the group's device.
    /// Errors (naming the layer): a spec for another world size than the group's, a weight of
    /// the wrong length or on another device.
    pub fn from_shard(group: &TpGroup, spec: VocabParallelSpec, weight: W) -> Result<Self> {
        let shard = VocabShard::new(group, spec, weight, WEIGHT)?;
        Ok(ParallelLMHead { shard })
    }

    /// The LM head of a model with tied embeddings: it shares `embedding`'s device table (no
    /// copy, no second upload) under the name `name` (the `arg` of its errors), with the
    /// embedding's vocabulary, hidden size and split.
    pub fn tied(name: impl Into<String>, embedding: &VocabParallelEmbedding<T, W>) -> Result<Self> {
        let e = embedding.shard();
        let spec = VocabParallelSpec::new(name, e.spec.vocab(), e.spec.hidden(), e.spec.world())?;
        let shard = VocabShard {
            label: spec.label(),
            spec,
            rank: e.rank,
            table: Arc::clone(&e.table),
            element: std::marker::PhantomData,
        };
        Ok(ParallelLMHead { shard })
    }

    /// The weight's shape and split.
    pub fn spec(&self) -> &VocabParallelSpec {
        &self.shard.spec
    }

    /// The layer's name.
    pub fn name(&self) -> &str {
        self.shard.spec.name()
    }

    /// The rank whose rows the layer holds.
    pub fn rank(&self) -> usize {
        self.shard.rank
    }

    /// This rank's weight, `[P, hidden]` (the embedding's table when tied).
    pub fn weight(&self) -> &W {
        &self.shard.table
    }

    /// This rank's logits: `local` `[m, P]` = `x` `[m, hidden]` · `W_rᵀ`, enqueued on the
    /// group's stream; the columns past `spec().valid_rows(rank).len()` are padding (zeros).
    /// `m` is `x.len() / hidden`; 0 enqueues nothing. Errors (naming the layer): the GEMM's,
    /// with the layer's names for the buffers.
    pub fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        local: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let m = self.rows(group, x.len())?;
        check_len(
            &self.shard.label,
            "local",
            local.len(),
            m,
            self.shard.spec.rows_per_rank(),
        )?;
        let (p, hidden) = (self.shard.spec.rows_per_rank(), self.shard.spec.hidden());
        gemm(
            group.stream(),
            x,
            &*self.shard.table,
            None,
            None,
            local,
            m,
            p,
            hidden,
        )
        .map_err(in_layer(&self.shard.label, &LM_HEAD_NAMES))
    }

    /// The logits of the whole vocabulary on every rank: [`forward`](Self::forward) into
    /// `local` `[m, P]`, the all-gather of every rank's `local` into `gathered` `[W, m, P]`
    /// (rank-major), then `out` `[m, vocab]` from the real columns of each rank (strided
    /// device-to-device copies, no kernel): `out[i, t]` is token `t`'s logit, and no padding
    /// column reaches `out`. A collective: every rank calls it with the same `m`.
    /// Errors, before anything is launched (naming the layer): `local`, `gathered` or `out` of
    /// the wrong length or on another device, the GEMM's and the all-gather's own (capacity,
    /// a poisoned group, ...).
    pub fn forward_gather(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        local: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        gathered: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let m = self.rows(group, x.len())?;
        let (p, world, vocab) = (
            self.shard.spec.rows_per_rank(),
            self.shard.spec.world(),
            self.shard.spec.vocab(),
        );
        check_len(&self.shard.label, "gathered", gathered.len(), world * m, p)?;
        check_len(&self.shard.label, "out", out.len(), m, vocab)?;
        check_device(&self.shard.label, "out", owner(&*out), group)?;
        let names = [("input", "local"), ("out", "gathered")];
        let staged = (local.len(), owner(&*local));
        check_all_gather::<T>(group, staged, (gathered.len(), owner(&*gathered)))
            .map_err(in_layer(&self.shard.label, &names))?;
        self.forward(group, x, local)?;
        if m == 0 {
            return Ok(());
        }
        all_gather(group, &*local, gathered).map_err(in_layer(&self.shard.label, &names))?;
        let widths = (0..world)
            .map(|r| self.shard.spec.valid_rows(r).map(|v| v.len()))
            .collect::<Result<Vec<_>>>()?;
        rank_major_to_rows(group.stream(), &*gathered, out, m, p, vocab, &widths)
    }

    /// Errors unless `group` is the layer's rank and world, on the device of its weight; `m`
    /// from the length of `x`, `[m, hidden]`.
    fn rows(&self, group: &TpGroup, x: usize) -> Result<usize> {
        self.shard.check_call(group, WEIGHT)?;
        rows_of(&self.shard.label, "x", x, self.shard.spec.hidden())
    }
}
