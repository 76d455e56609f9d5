//! A rank's rows of a vocabulary-parallel table on the device: what the embedding and the LM
//! head hold (the same one when the head is tied).

use super::{check_device, check_group, check_shard, upload};
use crate::error::Result;
use crate::group::TpGroup;
use crate::ops::gemm::GemmElement;
use crate::shard::{HostWeight, VocabParallelSpec};
use crate::validate::owner;
use cudarc::driver::{CudaSlice, DevicePtr, DeviceSlice};
use std::sync::Arc;

/// Rank `rank`'s table `[P, hidden]` of a layer `spec`, shared (`Arc`) so that a tied LM head
/// reads the embedding's table without a copy. `W` holds it: an owned `CudaSlice`, or a view
/// of the engine's buffer (borrowed).
pub(super) struct VocabShard<T, W = CudaSlice<T>> {
    pub(super) spec: VocabParallelSpec,
    pub(super) label: String,
    pub(super) rank: usize,
    pub(super) table: Arc<W>,
    pub(super) element: std::marker::PhantomData<T>,
}

impl<T: GemmElement, W: DevicePtr<T>> VocabShard<T, W> {
    /// A layer's `from_shard`: the spec is for the group's world, the table `[P, hidden]` on
    /// its device; `what` names the table in errors (e.g. `the table shard`).
    pub(super) fn new(
        group: &TpGroup,
        spec: VocabParallelSpec,
        table: W,
        what: &str,
    ) -> Result<Self> {
        let label = spec.label();
        check_group(&label, group, group.rank(), spec.world())?;
        let (p, hidden) = (spec.rows_per_rank(), spec.hidden());
        let shape = format!("[rows per rank, hidden] = [{p}, {hidden}]");
        check_shard(&label, what, &table, p * hidden, &shape, group)?;
        Ok(VocabShard {
            spec,
            label,
            rank: group.rank(),
            table: Arc::new(table),
            element: std::marker::PhantomData,
        })
    }

    /// Errors unless `group` is the layer's rank and world, on the device of its table.
    pub(super) fn check_call(&self, group: &TpGroup, what: &str) -> Result<()> {
        check_group(&self.label, group, self.rank, self.spec.world())?;
        check_device(&self.label, what, owner(&*self.table), group)
    }
}

impl<T: GemmElement> VocabShard<T> {
    /// A layer's `from_host`: this rank's rows of the full `[vocab, hidden]` table, padded
    /// ([`VocabParallelSpec::shard_table`]), uploaded on the group's stream, then [`new`].
    ///
    /// [`new`]: Self::new
    pub(super) fn from_host(
        group: &TpGroup,
        spec: VocabParallelSpec,
        full: HostWeight<'_, T>,
        what: &str,
    ) -> Result<Self>
    where
        T: Default,
    {
        check_group(&spec.label(), group, group.rank(), spec.world())?;
        let shard = spec.shard_table(group.rank(), full)?;
        let table = upload(group, &shard)?;
        Self::new(group, spec, table, what)
    }
}

impl<T, W: DeviceSlice<T>> VocabShard<T, W> {
    /// What a layer's `Debug` shows: its shape, rank and table length (not the device buffer).
    pub(super) fn debug(&self, f: &mut std::fmt::Formatter<'_>, kind: &str) -> std::fmt::Result {
        f.debug_struct(kind)
            .field("spec", &self.spec)
            .field("rank", &self.rank)
            .field("table_len", &self.table.len())
            .finish()
    }
}
