//! Vocabulary-parallel token embedding: a rank holds its rows of the padded table, looks up
//! the tokens it holds (the others give -0.0), and the all-reduce sums the ranks' rows.

use super::{check_device, check_group, check_len, check_shard, in_layer, upload};
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
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use std::ffi::c_void;
use std::sync::Arc;

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
pub struct VocabParallelEmbedding<T> {
    spec: VocabParallelSpec,
    label: String,
    rank: usize,
    table: Arc<CudaSlice<T>>,
}

impl<T> std::fmt::Debug for VocabParallelEmbedding<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VocabParallelEmbedding")
            .field("spec", &self.spec)
            .field("rank", &self.rank)
            .field("table_len", &self.table.len())
            .finish()
    }
}

impl<T: GemmElement + NcclType> VocabParallelEmbedding<T> {
    /// The layer from this rank's table `[P, hidden]` (its rows of the padded table, zeros
    /// past `vocab`; see [`VocabParallelSpec::shard_table`]), already on the group's device.
    /// Errors (naming the layer): a spec for another world size than the group's, a table of
    /// the wrong length or on another device.
    pub fn from_shard(
        group: &TpGroup,
        spec: VocabParallelSpec,
        table: CudaSlice<T>,
    ) -> Result<Self> {
        let label = spec.label();
        check_group(&label, group, group.rank(), spec.world())?;
        let (p, hidden) = (spec.rows_per_rank(), spec.hidden());
        let shape = format!("[rows per rank, hidden] = [{p}, {hidden}]");
        check_shard(&label, "the table shard", &table, p * hidden, &shape, group)?;
        Ok(VocabParallelEmbedding {
            spec,
            label,
            rank: group.rank(),
            table: Arc::new(table),
        })
    }

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
        check_group(&spec.label(), group, group.rank(), spec.world())?;
        let shard = spec.shard_table(group.rank(), table)?;
        let table = upload(group, &shard)?;
        Self::from_shard(group, spec, table)
    }

    /// The table's shape and split.
    pub fn spec(&self) -> &VocabParallelSpec {
        &self.spec
    }

    /// The layer's name.
    pub fn name(&self) -> &str {
        self.spec.name()
    }

    /// The rank whose rows the layer holds.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// This rank's table, `[P, hidden]`.
    pub fn table(&self) -> &CudaSlice<T> {
        &self.table
    }

    /// The shared table (for [`ParallelLMHead::tied`](super::ParallelLMHead::tied)).
    pub(super) fn shared_table(&self) -> Arc<CudaSlice<T>> {
        Arc::clone(&self.table)
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
        self.check_call(group)?;
        let vocab = self.spec.vocab();
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(Error::invalid(
                &self.label,
                format!(
                    "token id {id} at position {i} is out of range: the vocabulary has {vocab} \
                     tokens"
                ),
            ));
        }
        check_len(&self.label, "ids_dev", ids_dev.len(), ids.len(), 1)?;
        check_device(&self.label, "ids_dev", owner(&*ids_dev), group)?;
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
        self.check_call(group)?;
        check_device(&self.label, "ids", owner(ids), group)?;
        let planned = self.plan(group, ids.len(), out)?;
        self.lookup_and_reduce(group, ids, out, planned)
    }

    /// Errors unless `group` is the layer's rank and world, on the device of its table.
    fn check_call(&self, group: &TpGroup) -> Result<()> {
        check_group(&self.label, group, self.rank, self.spec.world())?;
        check_device(&self.label, "the table shard", owner(&*self.table), group)
    }

    /// What is checked of `out` `[m, hidden]` before anything runs, with the all-reduce's own
    /// checks and plan.
    fn plan(
        &self,
        group: &TpGroup,
        m: usize,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<(Desc, Plan)> {
        check_len(&self.label, "out", out.len(), m, self.spec.hidden())?;
        check_device(&self.label, "out", owner(&*out), group)?;
        let len = out.len();
        let (op, _guard) = out.device_ptr_mut(group.stream());
        let buf = BufferInfo::new(op, len, group.device());
        plan_in_place::<T>(group, buf, Algorithm::Auto)
            .map_err(in_layer(&self.label, &[("partial", "out")]))
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
        let (m, hidden) = (ids.len(), self.spec.hidden());
        let rows = self.spec.rows(self.rank)?;
        let (tp, _g1) = self.table.device_ptr(stream);
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
                self.spec.vocab() as u64,
                stream.cu_stream() as *mut c_void,
            )
        };
        launched("tpfuse_vocab_embedding", code)?;
        execute::<T>(group, &desc, &plan).map_err(in_layer(&self.label, &[("partial", "out")]))
    }
}
