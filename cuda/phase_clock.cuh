// phase_clock.cuh: where a fused GEMM kernel's blocks spend their time (diagnostics; the
// Rust side reads it with TpGroup::fused_phases). A profiler cannot replay a kernel that waits
// for another rank's kernel, so the kernels time themselves: thread 0 of every block reads
// %globaltimer at the block's phase boundaries, adds each interval to its phase's total, and
// at the block's end stores one record into this rank's signal pad (phase_record(b), layout in
// tpfuse.h: TPFUSE_PHASE_*), overwriting the previous launch's.
//
// Thread 0 marks a boundary where the whole block has passed it (after a __syncthreads), or
// where thread 0's own work is the phase: a publish is thread 0's st.release.sys into rank
// 0's pad (threads 1 .. W-1 store to the other ranks' pads meanwhile; the all-gather's publish
// includes the block's pushed rows, behind its __syncthreads). The totals live in shared
// memory, written and read by thread 0 only. The record is diagnostics, not a result:
// plain stores, read by the host only after the launch completed (stream order), never by
// another kernel; the emulator's counters leave them out (they count the kernels' data, not
// their bookkeeping).
// %globaltimer is the device's timer in nanoseconds (the PTX ISA gives its unit, not how
// often it updates, nor that it never steps back), one per device: records of one device
// compare across its blocks and its (virtual) ranks. An interval shorter than the timer's
// update period may read 0 (a publish, a wait that found its flag), so sums over many tiles
// and blocks say more than one record; a step back counts as 0 (a signed difference, as
// Deadline's). The instrumentation's own cost (the timer reads, the barrier before a
// reduction's mark, the record's stores) is in every fused time measured since it landed.
#pragma once

#include "barrier.cuh"

namespace tpfuse {
namespace fused {

enum Phase {
  kPhaseGemm,    // gemm_tile of the block's tiles (its mainloop and epilogue)
  kPhasePublish, // a unit's flags stored to every rank (the all-gather: its rows pushed too;
                 // a split of k in parallel: marking a part stored, and folding parts)
  kPhaseWait,    // waiting for other ranks' flags, to the __syncthreads after them
  kPhaseReduce,  // the W partials of the block's tiles reduced, their epilogue, strip or slice counts
  kPhaseTail,    // after the reduction: the dealt RMSNorm rows, the two-shot's gather
  kPhases
};

struct PhaseClock {
  uint64_t start; // %globaltimer at the block's start
  uint64_t last;  // at the last mark
  uint64_t spent[kPhases];
  uint32_t tiles; // the tiles the block computed

  // Thread 0, at the block's start.
  __device__ __forceinline__ void begin() {
    if (threadIdx.x != 0) return;
    start = last = global_timer_ns();
    for (int p = 0; p < kPhases; ++p) spent[p] = 0;
    tiles = 0;
  }

  // Thread 0: the time since the last mark was spent in `phase`.
  __device__ __forceinline__ void mark(Phase phase) {
    if (threadIdx.x != 0) return;
    const uint64_t now = global_timer_ns();
    const int64_t elapsed = static_cast<int64_t>(now - last);
    if (elapsed > 0) spent[phase] += static_cast<uint64_t>(elapsed);
    last = now;
  }

  // Thread 0: a tile computed since the last mark.
  __device__ __forceinline__ void tile_computed() {
    mark(kPhaseGemm);
    if (threadIdx.x == 0) ++tiles;
  }

  // Thread 0, at the block's end: the record of launch `epoch` into this rank's pad.
  __device__ __forceinline__ void store(const Pad &own, uint64_t epoch) const {
    if (threadIdx.x != 0 || blockIdx.x >= TPFUSE_MAX_PHASE_BLOCKS) return;
    uint64_t *r = own.phase_record(blockIdx.x);
    r[TPFUSE_PHASE_EPOCH] = epoch;
    r[TPFUSE_PHASE_START_NS] = start;
    r[TPFUSE_PHASE_END_NS] = global_timer_ns();
    r[TPFUSE_PHASE_TILES] = tiles;
    r[TPFUSE_PHASE_GEMM_NS] = spent[kPhaseGemm];
    r[TPFUSE_PHASE_PUBLISH_NS] = spent[kPhasePublish];
    r[TPFUSE_PHASE_WAIT_NS] = spent[kPhaseWait];
    r[TPFUSE_PHASE_REDUCE_NS] = spent[kPhaseReduce];
    r[TPFUSE_PHASE_TAIL_NS] = spent[kPhaseTail];
  }
};

} // namespace fused
} // namespace tpfuse
