// fused_flags.cuh: the flags, epochs and end of launch of the fused GEMM kernels
// (gemm_all_reduce.cu: GEMM + all-reduce / reduce-scatter, tiles of the output; and
// all_gather_gemm.cu: all-gather + GEMM, a rank's input). One protocol, written out here.
//
// Flags. A producer publishes a unit of work (a block's tiles) with:
// every thread stores its share (weak stores), __syncthreads, then thread p (p < W) stores the
// flag into slot `slot` / source `rank` of rank p's pad (tile_flags, tpfuse.h) with st.release.sys:
// everything the block stored before the __syncthreads is visible, at system scope, to
// whoever acquires that flag (the pattern of barrier.cuh). A consumer thread spins on the
// flag with ld.relaxed.sys, loads it once more with ld.acquire.sys when it is ready (same
// location, coherence: that load reads the ready value or a later one), and the consumer
// block passes a __syncthreads before it reads the unit.
//
// A unit stored by several blocks (the two-shot's slice, the all-gather's whole input) is
// counted first: each block, after its __syncthreads, adds 1 to a count in its own rank's pad
// with atom.acq_rel (thread 0; .gpu for the slice, whose stores stay on this GPU; .sys for the
// all-gather's, which went to every GPU, though the model's transitivity covers them at .gpu
// too: all_gather_gemm.cu, "Ordering"); the add that completes the count sets it back to 0 (no
// other block of the launch adds to it again) and, after a __syncthreads, that block publishes
// the flag (publish_counted). Each add releases its block's stores (cumulative, after the barrier), the
// completing add acquires every earlier one (the adds to one count are a chain of
// read-modify-writes: observation order through atomic operations), and the flag's
// st.release.sys after the barrier carries them all on, wherever they went (causality order
// is transitive; each synchronising pair is morally strong at its scope).
//
// Epochs. A flag is the launch's epoch (its low 40 bits) << 24 | 24 descriptor bits (the
// fused kind in the low 4, 20 bits of the launch's digest above: descriptor_of), in one
// 64-bit store. fused_epoch (this rank's pad, 64 bits) counts the rank's fused
// launches, of every fused kind; every block reads it when it starts and uses E =
// fused_epoch + 1. The block that ends last (fused_done, an atom.acq_rel counter: every block
// adds 1 once it is done, after it read the epoch) stores E and sets the counter back to 0.
// A rank's fused launches run one after the other (one stream, or the edges of a graph; no
// programmatic dependent launch), and every rank makes the same fused launches, so every rank
// uses the same E. Nothing is reset, and a replayed CUDA graph works.
//
// Every fused kernel has each rank consume something of every peer in every launch (its
// tiles, its input; by flags or by packets). So a producer is at most one launch ahead of a
// consumer (to start E+2 it must have finished E+1, which needed the consumer's flags or
// packets of E+1), and a consumer in launch E accepts exactly the epochs E and E+1 (mod
// 2^40): a flag of any older launch, however old (a slot unused for a long time keeps its
// flag), is not ready. A flag of E with another descriptor is TPFUSE_ERROR_PEER_MISMATCH (the
// ranks launched different things) instead of wrong data; so is a peer's started flag of E
// with another descriptor, which a stalled wait checks (a rank by packets and one by flags
// wait for things the other never sends; a custom collective's stalled barrier looks for a
// peer in a fused launch: barrier.cuh, "A rank in a fused kernel"). A flag of E+1 means the
// producer finished launch E, which needed our flags of E, checked against its descriptor (a
// mismatch would have poisoned it before it made E+1 flags): it is accepted as is. 2^40
// launches, at 10^4 a second, are three years. The started flags (begin) use the same window.
//
// Exchange areas. Launch E writes the half (E & 1) of the result half of the symmetric
// buffers (offset capacity + (E & 1) * capacity / 2): its own rank's (GEMM + all-reduce, the
// peers read it; the two-shot also writes its reduced rows there and the peers gather them)
// or every rank's (all-gather + GEMM pushes its part into each, and each reads only its own);
// the one-shot GEMM + all-reduce by packets writes the half (E & 1) of every rank's packet
// area instead (packets.cuh). Before a block of launch E writes any of them, every rank has
// started launch E - 1 (begin's started flags, acquired), so every rank had finished launch
// E - 2 (stream order), its reads (and packet clears) of every area of E's parity included.
// No closing barrier is needed. The other
// custom kernels (all_reduce.cu) write no other rank's data buffer, and touch their own result
// area only after their first barrier (when every peer is in that launch, hence done with the
// fused one before). Their peers read a rank's staging and result area until they finish the
// collective launch, and begin waits, before a fused block stores anything, until every peer
// has finished every collective launch this rank has (barrier.cuh, "Finished launches"). So
// neither a fused kernel's pushes into a peer's result half nor its parallel split of k,
// which writes its own rank's staging half (the parts' f32 partials, fused_split.cuh),
// overlaps a collective's reads; and no fused kernel reads another rank's staging. (Both
// rest on the sticky error word: after a failure no launch of the group produces anything.)
//
// Failures. A wait ends at the launch's deadline (barrier.cuh, Deadline: from the block's
// start, so it covers the block's whole share of the GEMM too) or when the rank's error word
// is set; a missing rank is TPFUSE_ERROR_PEER_TIMEOUT | peer, reported to every rank. A block
// that fails, or finds the group poisoned when it starts, stops producing and consuming. The
// block that ends last reads the error word: when it is set, it marks every output of the
// rank failed (failure.cuh) and copies the word to the host, after every block of the rank
// has ended (the done counter orders their stores before), so no partial result survives.
#pragma once

#include "barrier.cuh"
#include "failure.cuh"
#include "phase_clock.cuh"

namespace tpfuse {
namespace fused {

// Host: a flag's descriptor bits for a launch of fused kind `kind` (16..20) and `digest`
// (launch_descriptor of its shape): the kind in the low 4 bits, so that launches of two kinds
// never pass for one another (a 24-bit digest alone would collide for one shape in 2^24),
// and 20 bits of the digest above.
constexpr uint64_t kKindBits = 4;
inline uint64_t descriptor_of(uint64_t kind, uint64_t digest) {
  constexpr uint64_t kind_mask = (uint64_t{1} << kKindBits) - 1;
  return (digest & kDescriptorMask & ~kind_mask) | (kind & kind_mask);
}

// Host: a fused kernel's blocks one SM holds at once, `count(T{}, &n)` for dtype's element type
// (f16 or bf16: the occupancy API), into *blocks; a failure is cleared, not left for a later
// launch to report.
template <typename Count> int report_blocks_per_sm(tpfuse_dtype dtype, int32_t *blocks, Count count) {
  if (blocks == nullptr) return cudaErrorInvalidValue;
  int n = 0;
  const int err = dtype == TPFUSE_DTYPE_F16    ? count(__half{}, &n)
                  : dtype == TPFUSE_DTYPE_BF16 ? count(__nv_bfloat16{}, &n)
                                               : static_cast<int>(cudaErrorInvalidValue);
  if (err == 0) *blocks = n;
  else (void)cudaGetLastError();
  return err;
}

// The block's state, in shared memory: one decision for all its threads.
struct BlockState {
  uint64_t epoch; // E
  int failed;     // nonzero once the block gave up (or the group was poisoned at its start)
  int last;       // scratch for "this block was the last" decisions
  PhaseClock clock; // thread 0's: where the block spends its time (phase_clock.cuh)
};

// The slots of a rank's slice flag (two-shot GEMM + all-reduce) and of its gather flag
// (all-gather + GEMM: its whole input pushed), beside the tile slots.
constexpr int kSliceSlot = -1;
constexpr int kGatherSlot = -2;

// Where the flag of slot `slot` from rank `src` lives in `pad`.
__device__ __forceinline__ uint64_t *flag_at(const Pad &pad, int slot, int src) {
  if (slot == kSliceSlot) return pad.slice_flag(src);
  if (slot == kGatherSlot) return pad.gather_flag(src);
  return pad.tile_flag(slot, src);
}

// The launch's flag value.
__device__ __forceinline__ uint64_t flag_of(uint64_t epoch, uint64_t descriptor) {
  return (epoch & kEpochMask) << kDescriptorBits | descriptor;
}

// Whether flag value v is of launch `epoch` or the one after it (a consumer in launch E
// accepts E and E+1: see "Epochs").
__device__ __forceinline__ bool of_launch_or_next(uint64_t v, uint64_t epoch) {
  return (((v >> kDescriptorBits) - epoch) & kEpochMask) <= 1;
}

// Whether flag value v is of launch `epoch` with another descriptor than this launch's: the
// ranks launched different things.
__device__ __forceinline__ bool of_launch_otherwise(uint64_t v, uint64_t epoch, uint64_t descriptor) {
  return (((v >> kDescriptorBits) - epoch) & kEpochMask) == 0 && (v & kDescriptorMask) != descriptor;
}

// Whether rank src has started launch `epoch` with another descriptor (its started flag in
// this rank's pad): the ranks launched different things. A wait that stalls checks it, so that
// ranks that launched different kinds (one waits for flags, the other for packets) find out
// at once rather than at the deadline.
__device__ __forceinline__ bool started_otherwise(const Pad &own, int src, uint64_t epoch, uint64_t descriptor) {
  const uint64_t v = ld_relaxed_sys(own.started(src));
  return (v >> kDescriptorBits) == (epoch & kEpochMask) && (v & kDescriptorMask) != descriptor;
}

// The start of a block: E and whether the group was poisoned, read once by thread 0, then
// the whole block. fused_epoch changes only when every block of this launch has read it.
//
// Started flags. Block 0's thread p stores flag_of(E, descriptor) into started[rank] of rank
// p's pad (st.release.sys), and every block waits, thread q for rank q, until started[q] of this
// rank's pad holds E - 1 or later (ld.acquire.sys, then the __syncthreads below) before the
// block writes anything a peer reads: rank q started launch E - 1, so it finished launch E - 2
// (stream order), every read and clear of the areas of E's parity (exchange halves, packet
// halves) included, and the release carries them. So a rank never rewrites an area a peer may
// still read, whatever the launches in between consumed (the packets are relaxed stores: their
// reading orders nothing). Later means E or E + 1: a rank is at most one launch ahead of any
// block of another (to start E + 2, q finished E + 1, which needed this rank's contributions
// to E + 1, so this rank finished E); E + 1 happens where q needs only some of this rank's
// blocks (the reduce-scatter and the two-shot: those of q's rows), and a block of the others
// may start after q finished E. q's started[] of E - 1 was stored before q waited for anything in E - 1, so the
// wait needs nothing that waits for it; it was stored at least one launch ago, so it has
// usually arrived, and its first load is issued with the epoch's.
//
// The same waiters then wait for rank q's finished collective launches (barrier.cuh,
// "Finished launches": q no longer reads this rank's staging and result area, which this
// launch may write). q announced them before it could start anything after them, so this wait
// too needs nothing that waits for it.
__device__ __forceinline__ bool started_since(uint64_t v, uint64_t epoch) {
  return (((v >> kDescriptorBits) - epoch) & kEpochMask) <= 2;
}

// A wait for rank src that ends without what it waited for: a mismatch is reported as one; a
// timeout only where nothing is in the error word yet (TPFUSE_ERROR_GRID_TIMEOUT for this
// rank's own blocks: they were not all resident); st.failed counts it either way.
__device__ __forceinline__ void give_up_wait(const tpfuse_peers &peers, const tpfuse_group_args &g, BlockState &st,
                                             int src, bool mismatch) {
  if (mismatch) {
    report_failure(peers, g, TPFUSE_ERROR_PEER_MISMATCH | static_cast<uint32_t>(src) | static_cast<uint32_t>(g.rank) << 16);
  } else if (ld_relaxed_sys(Pad{peers.signals[g.rank]}.error()) == 0) {
    report_failure(peers, g, src == g.rank ? TPFUSE_ERROR_GRID_TIMEOUT | static_cast<uint32_t>(g.rank)
                                           : TPFUSE_ERROR_PEER_TIMEOUT | static_cast<uint32_t>(src));
  }
  atomicAdd(&st.failed, 1);
}

__device__ __forceinline__ void begin(const tpfuse_peers &peers, const tpfuse_group_args &g,
                                      const Deadline &deadline, uint64_t descriptor, BlockState &st) {
  st.clock.begin();
  const Pad own{peers.signals[g.rank]};
  const bool waiter = static_cast<int>(threadIdx.x) < g.world;
  uint64_t seen = 0;
  if (waiter) seen = ld_acquire_sys(own.started(threadIdx.x));
  if (threadIdx.x == 0) {
    st.epoch = *own.fused_epoch() + 1;
    st.failed = ld_relaxed_sys(own.error()) != 0 ? 1 : 0;
  }
  __syncthreads();
  // No barrier inside (the waiters may part: one that reads st.failed after another waiter
  // gave up skips), and one after it for every thread.
  if (waiter && st.failed == 0) {
    if (blockIdx.x == 0) st_release_sys(Pad{peers.signals[threadIdx.x]}.started(g.rank), flag_of(st.epoch, descriptor));
    for (uint32_t spins = 1; !started_since(seen, st.epoch - 1); ++spins) {
      if ((spins & 1023u) == 0 && (ld_relaxed_sys(own.error()) != 0 || deadline.expired())) {
        give_up_wait(peers, g, st, threadIdx.x, false);
        break;
      }
      seen = ld_acquire_sys(own.started(threadIdx.x));
    }
    if (st.failed == 0 && !await_peer_finished(peers, g, deadline, threadIdx.x)) atomicAdd(&st.failed, 1);
  }
  __syncthreads();
}

// The calling thread publishes `value` into slot `slot`, source g.rank, of rank p's pad, for
// p = threadIdx.x < world. Call after the __syncthreads that follows the unit's stores.
__device__ __forceinline__ void publish(const tpfuse_peers &peers, const tpfuse_group_args &g, int slot,
                                        uint64_t value) {
  if (threadIdx.x < g.world) st_release_sys(flag_at(Pad{peers.signals[threadIdx.x]}, slot, g.rank), value);
}

// A counted unit ("Flags"), after the __syncthreads that follows the block's stores: thread 0
// adds `add` to `count` (this rank's pad; atom.acq_rel at .sys when kSystem, else .gpu); the
// block whose add brings it to `total` sets it back to 0 (no other block of this launch adds to
// it again) and, after a __syncthreads (thread 0's acquire, before the releases of the flag),
// publishes the flag of slot `slot` to every rank. Every thread of the block calls it.
template <bool kSystem>
__device__ __forceinline__ void publish_counted(const tpfuse_peers &peers, const tpfuse_group_args &g, BlockState &st,
                                                uint32_t *count, uint32_t add, uint32_t total, int slot,
                                                uint64_t descriptor) {
  if (threadIdx.x == 0) {
    uint32_t before;
    if constexpr (kSystem) before = atomic_add_acq_rel_sys(count, add);
    else before = atomic_add_acq_rel_gpu(count, add);
    st.last = before + add == total;
    if (st.last) *count = 0; // no other block of this launch adds to it again
  }
  __syncthreads(); // thread 0's acquire, before the releases of the flag
  if (st.last) publish(peers, g, slot, flag_of(st.epoch, descriptor));
}

// The calling thread waits for the flag of slot `slot` from rank `src` in this rank's pad:
// ready, acquired and its descriptor checked; otherwise it reports the failure (unless one is
// there already) and counts it in st.failed. The block passes a __syncthreads afterwards. A
// wait for this rank's own flags (the all-gather's own gather flag, published by the rank's
// block that completed the count) that times out is TPFUSE_ERROR_GRID_TIMEOUT: the rank's
// blocks were not all resident. Once the error word is set, a wait gives up at once.
//
// A `consequent` wait (the two-shot's slice flags, the one-shot's strip flags) is for a flag whose producer itself waits
// for other flags: when it stalls, a wait of some block for a tile flag stalls too, and that
// one names the rank that is really missing. So a consequent wait runs to twice the deadline
// (%globaltimer; the %clock64 backstop stays as it is), by which the cause is in the error
// word (it then gives up without reporting), and reports only if nothing else did.
//
// await_flag is the same wait for any flag of this rank's pad whose writer is rank `src` (the
// one-shot's strip flags: this rank's own blocks).
__device__ __forceinline__ void await_flag(const tpfuse_peers &peers, const tpfuse_group_args &g,
                                           const Deadline &deadline, BlockState &st, const uint64_t *flag, int src,
                                           uint64_t descriptor, bool consequent) {
  const Pad own{peers.signals[g.rank]};
  if (ld_relaxed_sys(own.error()) != 0) {
    atomicAdd(&st.failed, 1);
    return;
  }
  bool arrived = true, mismatch = false;
  for (uint32_t spins = 0; !of_launch_or_next(ld_relaxed_sys(flag), st.epoch); ++spins) {
    if ((spins & 1023u) != 1023u) continue;
    mismatch = started_otherwise(own, src, st.epoch, descriptor);
    if (mismatch || ld_relaxed_sys(own.error()) != 0 || deadline.expired(consequent ? 2 : 1)) {
      arrived = false;
      break;
    }
  }
  if (arrived) {
    const uint64_t v = ld_acquire_sys(flag); // the acquire: orders the unit's loads after it
    mismatch = of_launch_otherwise(v, st.epoch, descriptor);
  }
  if (mismatch || !arrived) give_up_wait(peers, g, st, src, mismatch);
}

__device__ __forceinline__ void await(const tpfuse_peers &peers, const tpfuse_group_args &g, const Deadline &deadline,
                                      BlockState &st, int slot, int src, uint64_t descriptor,
                                      bool consequent = false) {
  await_flag(peers, g, deadline, st, flag_at(Pad{peers.signals[g.rank]}, slot, src), src, descriptor, consequent);
}

// After the waits of one unit (every thread): whether the block may go on; a pass counts as
// one synchronisation round in the emulator's counters.
__device__ __forceinline__ bool passed(BlockState &st) {
  __syncthreads();
  const bool ok = st.failed == 0;
  if (ok && threadIdx.x == 0) note_barrier_passed();
  return ok;
}

// The end of a block (every thread): the last block of the rank to get here advances the
// epoch and, when the launch failed on this rank or anywhere, publishes the error word to the
// host; true in every thread of that block then: it must mark the rank's outputs failed.
// Every block then stores its phase record (the GEMM kernels': `record`; the all-reduce by
// packets leaves the last GEMM kernel's records, which TpGroup::fused_phases reads).
__device__ __forceinline__ bool end(const tpfuse_peers &peers, const tpfuse_group_args &g, BlockState &st,
                                    bool record = true) {
  const Pad own{peers.signals[g.rank]};
  __syncthreads();
  if (threadIdx.x == 0) {
    st.last = atomic_add_acq_rel_gpu(own.fused_done(), 1u) + 1u == gridDim.x;
    if (st.last) {
      *own.fused_done() = 0;
      *own.fused_epoch() = st.epoch;
      st.failed = ld_relaxed_sys(own.error()) != 0 ? 1 : 0;
      if (st.failed) publish_error_to_host(peers, g);
    }
  }
  __syncthreads();
  if (record) st.clock.store(own, st.epoch);
  return st.last && st.failed;
}

// Bytes into a rank's symmetric buffer of launch `epoch`'s exchange area.
__device__ __forceinline__ size_t exchange_offset(const tpfuse_group_args &g, uint64_t epoch) {
  return g.capacity + (epoch & 1u) * (g.capacity / 2);
}

} // namespace fused
} // namespace tpfuse
