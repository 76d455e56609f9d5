//! Where the blocks of a rank's last fused GEMM launch spent their time: the records the fused
//! kernels store in the rank's signal pad (`cuda/phase_clock.cuh`), for a GPU run to show why
//! a fused kernel is as fast as it is. A profiler cannot replay a kernel that waits for another
//! rank's kernel; these come from the kernel's own `%globaltimer` reads (nanoseconds, one timer
//! per device). Diagnostics: nothing in tpfuse decides from them.

use super::TpGroup;
use crate::error::{Error, Result};
use crate::ffi::kernels;

const FIELDS: usize = kernels::TPFUSE_PHASE_FIELDS as usize;
const MAX_BLOCKS: usize = kernels::TPFUSE_MAX_PHASE_BLOCKS as usize;
const OFFSET: usize = kernels::TPFUSE_SIGNAL_PHASES_OFFSET as usize;

/// One block of a fused launch ([`crate::ops::gemm_all_reduce()`],
/// [`crate::ops::gemm_reduce_scatter`], [`crate::ops::all_gather_gemm()`]): the device's
/// `%globaltimer` at its start and end, and the nanoseconds it spent in each phase (the
/// phases need not add up to `end_ns - start_ns`: the rest is the block's start and end
/// bookkeeping).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockPhases {
    /// `blockIdx.x`.
    pub block: usize,
    /// The launch's epoch (the rank's count of fused launches).
    pub epoch: u64,
    /// `%globaltimer` at the block's start, ns.
    pub start_ns: u64,
    /// `%globaltimer` at the block's end, ns.
    pub end_ns: u64,
    /// The tiles the block computed (with the split of k in parallel: the parts of tiles,
    /// [`FusedPlan::parts_in_parallel`](crate::ops::gemm_all_reduce::FusedPlan::parts_in_parallel)).
    pub tiles: u64,
    /// Computing them (the GEMM's mainloop and epilogue).
    pub gemm_ns: u64,
    /// Publishing its flags (thread 0's store into rank 0's pad; the all-gather + GEMM:
    /// pushing its rows and counting them, the last one's block publishing the rank's flag; a
    /// split of k in parallel: marking each part stored, and the parts it folds).
    pub publish_ns: u64,
    /// Waiting for other ranks' flags.
    pub wait_ns: u64,
    /// Reducing its tiles of the ranks' partials (and their epilogue, strip and slice counts).
    pub reduce_ns: u64,
    /// After its reduction: the dealt RMSNorm rows, the two-shot's gather (their waits too).
    pub tail_ns: u64,
}

impl BlockPhases {
    fn from_record(block: usize, r: &[u64]) -> Self {
        let at = |i: u32| r[i as usize];
        BlockPhases {
            block,
            epoch: at(kernels::TPFUSE_PHASE_EPOCH),
            start_ns: at(kernels::TPFUSE_PHASE_START_NS),
            end_ns: at(kernels::TPFUSE_PHASE_END_NS),
            tiles: at(kernels::TPFUSE_PHASE_TILES),
            gemm_ns: at(kernels::TPFUSE_PHASE_GEMM_NS),
            publish_ns: at(kernels::TPFUSE_PHASE_PUBLISH_NS),
            wait_ns: at(kernels::TPFUSE_PHASE_WAIT_NS),
            reduce_ns: at(kernels::TPFUSE_PHASE_REDUCE_NS),
            tail_ns: at(kernels::TPFUSE_PHASE_TAIL_NS),
        }
    }
}

impl TpGroup {
    /// The phase records of the last fused GEMM launch that ran on this rank, one per block
    /// (at most the first 1024 blocks: a grid of as many blocks as an SM holds, times the
    /// SMs), index = block; empty before the first fused launch. A
    /// launch refused before it ran (a grid past what the device holds) leaves the previous
    /// launch's records: compare [`BlockPhases::epoch`] across calls. Waits for the rank's
    /// stream first, through [`check`](Self::check): so it fails once a launch failed (its
    /// records stay unread), during a capture, and a stream that does not drain poisons the
    /// group as `check` does. Diagnostics for a GPU run (`benches/gemm_all_reduce.rs` prints
    /// them); the records of a graph replay are its last fused launch's.
    ///
    /// Errors: [`Error::InvalidArgument`] on a group without custom kernels (no signal pad),
    /// and what [`check`](Self::check) returns.
    pub fn fused_phases(&self) -> Result<Vec<BlockPhases>> {
        let ws = self.workspace().ok_or_else(|| {
            Error::invalid(
                "group",
                "has no custom kernels, hence no fused launches to time",
            )
        })?;
        self.check()?;
        let mut bytes = vec![0u8; MAX_BLOCKS * FIELDS * 8];
        ws.read_own_pad(&self.stream, OFFSET, &mut bytes)?;
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
            .collect();
        let records: Vec<BlockPhases> = words
            .chunks_exact(FIELDS)
            .enumerate()
            .map(|(b, r)| BlockPhases::from_record(b, r))
            .collect();
        // The last launch's blocks: its epoch is the largest; an earlier launch with a larger
        // grid leaves older records past them.
        let last = records.iter().map(|r| r.epoch).max().unwrap_or(0);
        if last == 0 {
            return Ok(Vec::new());
        }
        Ok(records
            .into_iter()
            .take_while(|r| r.epoch == last)
            .collect())
    }
}
