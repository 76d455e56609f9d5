//! Vocabulary-parallel token embedding: a rank holds its rows of the padded table, looks up
//! the tokens it holds (the others give -0.0), and the all-reduce sums the ranks' rows.

use super::vocab_shard::VocabShard;
use super::{check_device, check_len, in_layer};
use crate::device::{bind, cuda};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::group::TpGroup;
use crate::ops::all_reduce::{execute, plan_in_place, Algorithm, Desc, Plan};
use crate::ops::gemm::GemmElement;
use crate::shard::{HostWeight, VocabParallelSpec};
use crate::topology::AllReduceAlgo;
use crate::validate::{launched, owner, BufferInfo};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceSlice};
use std::ffi::c_void;

/// A vocabulary-parallel token embedding, one rank of it: `out[i, :] = table[ids[i], :]` for
/// a `[vocab, hidden]` table split by rows as [`VocabParallelSpec`] says (the vocabulary
/// padded to a multiple of `64 · W`; rank `r` holds the rows `r·P .. (r+1)·P`, zeros past
/// `vocab`). Each rank writes the rows of the tokens it holds and -0.0 for the others, then
/// the group's all-reduce sums them: the result is the table's row bit for bit on every rank
/// (-0.0 is the additive identity, so the sum changes no bit, zeros' signs included), except
/// that a NaN in the table comes out as a NaN with another payload.
///
/// The table may be shared with the LM head ([`ParallelLMHead::tied`]), as in models with tied
/// embeddings.
///
/// [`ParallelLMHead::tied`]: super::ParallelLMHead::tied
pub struct VocabParallelEmbedding<T, W = CudaSlice<T>> {
    shard: VocabShard<T, W>,
}

impl<T, W: DeviceSlice<T>> std::fmt::Debug for VocabParallelEmbedding<T, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shard.debug(f, "VocabParallelEmbedding")
    }
}

/// How the embedding's errors name its table.
const TABLE: &str = "the table shard";

impl<T: GemmElement + NcclType> VocabParallelEmbedding<T> {
    /// The layer from the full host table `[vocab, hidden]`, as the checkpoint stores it (e.g.
    /// `model.embed_tokens.weight`): this rank's rows are cut and padded
    /// ([`VocabParallelSpec::shard_table`]) and uploaded on the group's stream. Errors (naming
    /// the layer, before anything is uploaded): as [`from_shard`](Self::from_shard), a table
    /// of another shape (a transposed one says so).
    pub fn from_host(
        group: &TpGroup,
        spec: VocabParallelSpec,
        table: HostWeight<'_, T>,
    ) -> Result<Self>
    where
        T: Default,
    {
        let shard = VocabShard::from_host(group, spec, table, TABLE)?;
        Ok(VocabParallelEmbedding { shard })
    }
}

impl<T: GemmElement + NcclType, W: DevicePtr<T>> VocabParallelEmbedding<T, W> {
    /// The layer from this rank's table `[P, hidden]` (its rows of the padded table, zeros
    /// past `vocab`; see [`VocabParallelSpec::shard_table`]), already on the group's device.
    /// Errors (naming the layer): a spec for another world size than the group's, a table of
    /// the wrong length or on another device.
    pub fn from_shard(group: &TpGroup, spec: VocabParallelSpec, table: W) -> Result<Self> {
        let shard = VocabShard::new(group, spec, table, TABLE)?;
        Ok(VocabParallelEmbedding { shard })
    }

    /// The table's shape and split.
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

    /// This rank's table, `[P, hidden]`.
    pub fn table(&self) -> &W {
        &self.shard.table
    }

    /// The rank's shard (for [`ParallelLMHead::tied`](super::ParallelLMHead::tied)).
    pub(super) fn shard(&self) -> &VocabShard<T, W> {
        &self.shard
    }

    /// `out` `[m, hidden]` = the rows of the `m` tokens `ids` (host), on every rank. The ids
    /// are checked on the host, then copied into `ids_dev` (`[m]`, the caller's device
    /// buffer) on the group's stream; the lookup and the all-reduce follow on it. Returns the
    /// all-reduce that ran. A collective: every rank calls it with the same ids.
    ///
    /// Errors, before anything is copied or launched (naming the layer): an id at or past
    /// `vocab` (with its position), `ids_dev` or `out` of the wrong length or on another
    /// device, `out` not 16-byte aligned, the all-reduce's own (capacity, a poisoned group).
    /// The copy from pageable host memory cannot be captured into a CUDA graph: a graph uses
    /// [`forward_device_ids`](Self::forward_device_ids).
    pub fn forward(
        &self,
        group: &TpGroup,
        ids: &[u32],
        ids_dev: &mut (impl DevicePtr<u32> + DevicePtrMut<u32>),
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<AllReduceAlgo> {
        self.shard.check_call(group, TABLE)?;
        let vocab = self.shard.spec.vocab();
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(Error::invalid(
                &self.shard.label,
                format!(
                    "token id {id} at position {i} is out of range: the vocabulary has {vocab} \
                     tokens"
                ),
            ));
        }
        check_len(&self.shard.label, "ids_dev", ids_dev.len(), ids.len(), 1)?;
        check_device(&self.shard.label, "ids_dev", owner(&*ids_dev), group)?;
        let planned = self.plan(group, ids.len(), out)?;
        if !ids.is_empty() {
            group
                .stream()
                .memcpy_htod(ids, ids_dev)
                .map_err(cuda("copying the token ids to the device"))?;
        }
        self.lookup_and_reduce(group, &*ids_dev, out, planned)
    }

    /// [`forward`](Self::forward) with the ids already on the device (`ids` `[m]`, e.g. the
    /// sampler's output, or inside a CUDA graph). They cannot be checked before the launch:
    /// an id at or past `vocab` gives a row of NaN on every rank (never a plausible
    /// embedding). Errors as for `forward`, less the ids' values.
    pub fn forward_device_ids(
        &self,
        group: &TpGroup,
        ids: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<AllReduceAlgo> {
        self.shard.check_call(group, TABLE)?;
        check_device(&self.shard.label, "ids", owner(ids), group)?;
        let planned = self.plan(group, ids.len(), out)?;
        self.lookup_and_reduce(group, ids, out, planned)
    }

    /// What is checked of `out` `[m, hidden]` before anything runs, with the all-reduce's own
    /// checks and plan.
    fn plan(
        &self,
        group: &TpGroup,
        m: usize,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<(Desc, Plan)> {
        check_len(
            &self.shard.label,
            "out",
            out.len(),
            m,
            self.shard.spec.hidden(),
        )?;
        check_device(&self.shard.label, "out", owner(&*out), group)?;
        let len = out.len();
        let (op, _guard) = out.device_ptr_mut(group.stream());
        let buf = BufferInfo::new(op, len, group.device());
        plan_in_place::<T>(group, buf, Algorithm::Auto)
            .map_err(in_layer(&self.shard.label, &[("partial", "out")]))
    }

    /// The masked lookup into `out`, then the all-reduce `planned` of `out` in place.
    fn lookup_and_reduce(
        &self,
        group: &TpGroup,
        ids: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<T>,
        (desc, plan): (Desc, Plan),
    ) -> Result<AllReduceAlgo> {
        let stream = group.stream();
        let (m, hidden) = (ids.len(), self.shard.spec.hidden());
        let rows = self.shard.spec.rows(self.shard.rank)?;
        let (tp, _g1) = self.shard.table.device_ptr(stream);
        let (ip, _g2) = ids.device_ptr(stream);
        let (op, _g3) = out.device_ptr_mut(stream);
        debug_assert_eq!(
            op, desc.out.addr,
            "the buffer planned is the buffer written"
        );
        bind(stream)?;
        // SAFETY: the table holds [P, hidden] (checked when built), ids m and out m·hidden
        // elements, on the group's device; out is 16-byte aligned (planned), the table is a
        // whole allocation, ids are u32 (4-byte aligned).
        let code = unsafe {
            kernels::tpfuse_vocab_embedding(
                T::DTYPE,
                tp as *const c_void,
                ip as *const u32,
                op as *mut c_void,
                m,
                hidden,
                rows.start as u64,
                rows.len() as u64,
                self.shard.spec.vocab() as u64,
                stream.cu_stream() as *mut c_void,
            )
        };
        launched("tpfuse_vocab_embedding", code)?;
        execute::<T>(group, &desc, &plan)
            .map_err(in_layer(&self.shard.label, &[("partial", "out")]))
    }
}
