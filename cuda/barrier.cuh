// barrier.cuh: the cross-rank, per-block barrier of the custom collectives.
//
// Protocol. Block b of every rank runs the same sequence of barriers (all ranks launch the
// same kernels with the same grid). Block b of rank r keeps its epoch in its own pad,
// counters[b]; the k-th barrier of a launch has the value counters[b] + k. To pass it:
//
//   1. __syncthreads(): every thread of the block has finished its memory operations
//      (staging writes, reads of peers' buffers);
//   2. thread p (p < world) stores, at the first barrier of a launch, the launch's
//      descriptor into descriptors[b][r] of rank p's pad, then the value into flags[b][r]
//      of rank p's pad with st.release.sys: everything the block did before (the
//      descriptor included: same thread, program order) is visible, at system scope, to
//      whoever acquires that flag;
//   3. thread p spins on flags[b][p] of this rank's own pad with ld.relaxed.sys until it
//      holds the value or more (wrap-safe), then loads it once more with ld.acquire.sys:
//      that load reads the value or a later one (coherence order of one location), so it
//      synchronises with a release of the peer that is at or after the one of step 2
//      (PTX ISA, "Memory Consistency Model": release and acquire patterns). At the first
//      barrier it then compares descriptors[b][p] with its own descriptor;
//   4. __syncthreads(): the whole block proceeds, ordered after the acquires.
//
// Flags only grow, so they are never reset and a replayed CUDA graph works.
//
// Finished launches (no closing barrier). A rank's staging and result area are read by its
// peers during a collective launch, and its next launch rewrites them. Instead of a barrier
// at the end of every launch (each rank waiting for the slowest before its launch may end: a
// round across GPUs on the critical path), a rank announces that it finished, and its next
// launch waits for every peer's announcement before it writes anything a peer reads. The
// announcement travels while the stream runs other work (attention, the next GEMM), so the
// wait normally finds it there.
//
//   1. The end of a collective launch (finish): every thread of the block has done its memory
//      operations, reads of peers' buffers included (__syncthreads); thread 0 adds 1 to this
//      rank's `finishing` with atom.acq_rel.gpu (it releases the block's operations, ordered
//      before it by the barrier; the adds to one location form a release sequence, so the add
//      that completes the count acquires every earlier block's). That block sets `finishing`
//      back to 0 (no block of the launch adds again) and `finished_count` to F + 1 (F, its
//      value, is what the launch read: the previous launch wrote it and has ended), and after
//      a __syncthreads, thread p (p < world) stores F + 1 into finished[rank] of rank p's pad
//      with st.release.sys (cumulative: it carries what thread 0 acquired).
//   2. The start of every custom launch, collective (BlockBarrier) or fused (fused::begin),
//      before its first store to any buffer a peer reads: thread p (p < world) waits until
//      finished[p] of this rank's pad holds F or more (wrap-safe), then loads it once more
//      with ld.acquire.sys. So every rank has finished every collective launch this rank has,
//      and its reads of this rank's buffers there are ordered before this launch's writes
//      (causality order is transitive across the .gpu and .sys pairs; a read that precedes a
//      write in causality order cannot read it: PTX ISA, "Memory Consistency Model", the
//      Causality axiom). Every rank makes the same collective launches (the first barrier
//      compares descriptors), so the counts agree; a rank that made fewer is a timeout.
//
// A block that gives up does not count: the error word is then set for good, and every later
// launch of the group gives up at its start (poisoned()), or, when the word arrives while it
// waits, at its next look at the word, bounded by the deadline either way.
//
// A rank in a fused kernel (fused_flags.cuh) where its peer runs a collective. The two wait for
// things the other never sends (barrier flags against tiles or packets), and no descriptor is
// compared between them. So a barrier's wait that stalls also looks at the peer's started
// flag in this rank's pad (fused_flags.cuh, "Started flags"): one of a fused launch this rank
// has not started (an epoch past this rank's fused_epoch) says that the peer went on to a
// fused kernel. That is TPFUSE_ERROR_PEER_MISMATCH, unless the peer had passed this barrier
// first (its flag still on the way): the started flag is loaded with ld.acquire.sys and the
// barrier's flag once more after it. The peer stored that flag in an earlier launch on its
// stream, complete before the next launch starts (CUDA's stream order: the PTX ISA has no
// kernel boundaries; begin's started flags rest on the same), so before its started flag's
// st.release.sys, whose cumulativity carries it: the acquire orders it before the second load,
// which therefore reads it or a later value (PTX ISA, "Memory Consistency Model": causality
// order, the coherence axiom). The report reaches the peer's error word, which ends its wait
// too. This rests on a rank's custom launches running one after another (one stream, or the
// edges of a graph: "Finished launches" and the fused epochs assume it too), so that this rank's
// fused_epoch counts every fused launch it started. Not caught by the emulator: its strong
// loads read the newest value, so no flag is ever on the way there, and the second look,
// left out, would pass the suite (docs/emulator.md, "Weak memory", limits).
//
// Deadlines. Every wait of a launch ends by start + timeout_ns of %globaltimer, with a
// %clock64 backstop of backstop_cycles (tpfuse.h): Deadline below.
//
// Failures. A peer that does not arrive in time, or a descriptor that differs (the ranks
// launched different sizes, grids or kernels, which would pair the wrong ranges; or a fused
// kernel: "A rank in a fused kernel"), is
// recorded as TPFUSE_ERROR_PEER_TIMEOUT | peer or TPFUSE_ERROR_PEER_MISMATCH (tpfuse.h) in this
// rank's error word and in every peer's, the missing one included (so every rank stops
// waiting at once, and a late rank does not wait for ranks that left). A block that fails,
// or that finds the error word set when it starts, copies the error word to the rank's
// host-mapped word and the kernel marks its outputs failed (tpfuse.h). The per-block
// decision "poisoned or not" is taken once, by thread 0, into shared memory, so the whole
// block takes the same branch before any __syncthreads (a peer's store to the error word
// may land between two warps' reads).
#pragma once

#include <initializer_list>

#include "common.cuh"
#include "ptx.cuh"

namespace tpfuse {

static_assert(TPFUSE_SIGNAL_GRID_GENERATION_OFFSET + 4 <= TPFUSE_SIGNAL_FINISHING_OFFSET &&
                  TPFUSE_SIGNAL_FINISHING_OFFSET + 4 <= TPFUSE_SIGNAL_FINISHED_COUNT_OFFSET &&
                  TPFUSE_SIGNAL_FINISHED_COUNT_OFFSET + 4 <= TPFUSE_SIGNAL_FINISHED_OFFSET &&
                  TPFUSE_SIGNAL_FINISHED_OFFSET + 4 * TPFUSE_MAX_RANKS <= TPFUSE_SIGNAL_DESCRIPTORS_OFFSET,
              "the words after the error word fit before the descriptors");
static_assert(TPFUSE_SIGNAL_SLICE_COUNT_OFFSET + 4 <= TPFUSE_SIGNAL_GATHER_COUNT_OFFSET &&
                  TPFUSE_SIGNAL_GATHER_COUNT_OFFSET + 4 <= TPFUSE_SIGNAL_SLICE_FLAGS_OFFSET &&
                  TPFUSE_SIGNAL_SLICE_FLAGS_OFFSET + 8 * TPFUSE_MAX_RANKS <= TPFUSE_SIGNAL_GATHER_FLAGS_OFFSET &&
                  TPFUSE_SIGNAL_GATHER_FLAGS_OFFSET + 8 * TPFUSE_MAX_RANKS <= TPFUSE_SIGNAL_STRIP_COUNTS_OFFSET,
              "the fused words after the epoch fit before the strip counts");

namespace fused {
// A fused flag or started flag (fused_flags.cuh, "Epochs"): the epoch's low 40 bits, then 24
// descriptor bits.
constexpr int kDescriptorBits = 24;
constexpr uint64_t kDescriptorMask = (uint64_t{1} << kDescriptorBits) - 1;
constexpr uint64_t kEpochMask = (uint64_t{1} << (64 - kDescriptorBits)) - 1;
} // namespace fused

struct Pad {
  uint32_t *base;
  __device__ uint32_t *flag(int block, int src) const {
    return base + TPFUSE_SIGNAL_FLAGS_OFFSET / 4 + block * TPFUSE_MAX_RANKS + src;
  }
  __device__ uint32_t *counter(int block) const {
    return base + TPFUSE_SIGNAL_COUNTERS_OFFSET / 4 + block;
  }
  __host__ __device__ uint32_t *error() const { return base + TPFUSE_SIGNAL_ERROR_OFFSET / 4; }
  __device__ uint32_t *grid_count() const { return base + TPFUSE_SIGNAL_GRID_COUNT_OFFSET / 4; }
  __device__ uint32_t *grid_generation() const { return base + TPFUSE_SIGNAL_GRID_GENERATION_OFFSET / 4; }
  // Finished launches (above).
  __device__ uint32_t *finishing() const { return base + TPFUSE_SIGNAL_FINISHING_OFFSET / 4; }
  __device__ uint32_t *finished_count() const { return base + TPFUSE_SIGNAL_FINISHED_COUNT_OFFSET / 4; }
  __device__ uint32_t *finished(int src) const { return base + TPFUSE_SIGNAL_FINISHED_OFFSET / 4 + src; }
  __device__ uint32_t *descriptor(int block, int src) const {
    return base + TPFUSE_SIGNAL_DESCRIPTORS_OFFSET / 4 + block * TPFUSE_MAX_RANKS + src;
  }
  // The fused GEMM kernels' words (fused_flags.cuh).
  __device__ uint64_t *fused_epoch() const {
    return reinterpret_cast<uint64_t *>(reinterpret_cast<char *>(base) + TPFUSE_SIGNAL_FUSED_EPOCH_OFFSET);
  }
  __device__ uint32_t *fused_done() const { return base + TPFUSE_SIGNAL_FUSED_DONE_OFFSET / 4; }
  __device__ uint32_t *strip_count(int strip) const {
    return base + TPFUSE_SIGNAL_STRIP_COUNTS_OFFSET / 4 + strip;
  }
  __device__ uint64_t *tile_flag(int tile, int src) const {
    return reinterpret_cast<uint64_t *>(reinterpret_cast<char *>(base) + TPFUSE_SIGNAL_TILE_FLAGS_OFFSET) +
           static_cast<size_t>(tile) * TPFUSE_MAX_RANKS + src;
  }
  __device__ uint64_t *strip_flag(int strip) const {
    return reinterpret_cast<uint64_t *>(reinterpret_cast<char *>(base) + TPFUSE_SIGNAL_STRIP_FLAGS_OFFSET) + strip;
  }
  __device__ uint32_t *slice_count() const { return base + TPFUSE_SIGNAL_SLICE_COUNT_OFFSET / 4; }
  // All-gather + GEMM: this rank's blocks that pushed their part, and each rank's flag.
  __device__ uint32_t *gather_count() const { return base + TPFUSE_SIGNAL_GATHER_COUNT_OFFSET / 4; }
  __device__ uint64_t *gather_flag(int src) const {
    return reinterpret_cast<uint64_t *>(reinterpret_cast<char *>(base) + TPFUSE_SIGNAL_GATHER_FLAGS_OFFSET) + src;
  }
  // The fused GEMM + all-reduce's parts of k finished per tile (gemm_split.cuh's counts).
  __device__ uint32_t *part_count(int tile) const { return base + TPFUSE_SIGNAL_PART_COUNTS_OFFSET / 4 + tile; }
  __device__ uint64_t *phase_record(int block) const {
    return reinterpret_cast<uint64_t *>(reinterpret_cast<char *>(base) + TPFUSE_SIGNAL_PHASES_OFFSET) +
           static_cast<size_t>(block) * TPFUSE_PHASE_FIELDS;
  }
  __device__ uint64_t *slice_flag(int src) const {
    return reinterpret_cast<uint64_t *>(reinterpret_cast<char *>(base) + TPFUSE_SIGNAL_SLICE_FLAGS_OFFSET) + src;
  }
  __device__ uint64_t *started(int src) const {
    return reinterpret_cast<uint64_t *>(reinterpret_cast<char *>(base) + TPFUSE_SIGNAL_STARTED_OFFSET) + src;
  }
  // Half `half` of the packet area (gemm_all_reduce.cu, "Packets").
  __device__ uint64_t *packets(int half) const {
    return reinterpret_cast<uint64_t *>(reinterpret_cast<char *>(base) + TPFUSE_SIGNAL_PACKETS_OFFSET +
                                        static_cast<size_t>(half) * TPFUSE_PACKET_HALF_BYTES);
  }
};

// The deadline of one launch, for all its waits: %globaltimer past start + timeout_ns (a
// signed difference: a timer that jumps backwards does not make a wait endless), or the
// %clock64 backstop past start + backstop_cycles should %globaltimer stall (the PTX ISA
// promises neither monotonicity nor progress for it). Spin counts are no bound.
class Deadline {
public:
  __device__ explicit Deadline(const tpfuse_group_args &g)
      : timeout_ns_(g.timeout_ns), backstop_cycles_(g.backstop_cycles), start_ns_(global_timer_ns()),
        start_cycles_(clock_cycles()) {}

  // Past the deadline; with `scale`, past `scale` times the timeout. The %clock64 backstop
  // is never scaled: the host's wait for a stream (TpGroup's wait_bound) is sized to cover
  // it as it is.
  __device__ bool expired(uint64_t scale = 1) const {
    const int64_t waited_ns = static_cast<int64_t>(global_timer_ns() - start_ns_);
    const int64_t waited_cycles = static_cast<int64_t>(clock_cycles() - start_cycles_);
    return (waited_ns > 0 && static_cast<uint64_t>(waited_ns) > scaled(timeout_ns_, scale)) ||
           (waited_cycles > 0 && static_cast<uint64_t>(waited_cycles) > backstop_cycles_);
  }

private:
  __device__ static uint64_t scaled(uint64_t bound, uint64_t scale) {
    return bound > UINT64_MAX / scale ? UINT64_MAX : bound * scale;
  }

  uint64_t timeout_ns_, backstop_cycles_;
  uint64_t start_ns_, start_cycles_;
};

// Records `word` in this rank's error word (unless one is there already) and in every
// peer's (so that they stop waiting at once instead of each running out its deadline).
// Peers store unconditionally, so a word may be replaced by another failure's; it never
// returns to 0, and any nonzero word is a failure.
__device__ __forceinline__ void report_failure(const tpfuse_peers &peers, const tpfuse_group_args &g,
                                               uint32_t word) {
  atomic_cas_sys(Pad{peers.signals[g.rank]}.error(), 0u, word);
  for (int p = 0; p < g.world; ++p) {
    if (p != g.rank) st_release_sys(Pad{peers.signals[p]}.error(), word);
  }
}

// Copies this rank's error word to its host-mapped word (when there is one), where the host
// sees it without synchronising. One thread calls it.
__device__ __forceinline__ void publish_error_to_host(const tpfuse_peers &peers, const tpfuse_group_args &g) {
  if (g.host_error != nullptr) st_release_sys(g.host_error, ld_relaxed_sys(Pad{peers.signals[g.rank]}.error()));
}

// Whether the count at `flag` holds `value` or more (wrap-safe).
__device__ __forceinline__ bool count_reached(const uint32_t *flag, uint32_t value) {
  return static_cast<int32_t>(ld_relaxed_sys(flag) - value) >= 0;
}

// Whether rank `peer` started a fused launch this rank has not (its started flag in this rank's
// pad, acquired, names fused_epoch + 1: "A rank in a fused kernel" above). This rank's last
// fused launch wrote fused_epoch and has ended (stream order). Never + 2: to start it, the peer
// finished + 1, which needed this rank's blocks of + 1, so this rank, now in a collective, had
// started and finished it. Out of line: only a stalled wait comes here, and inlined it cost
// the collectives registers (all_gather_kernel 62 -> 66 on sm_90a).
static __device__ TPFUSE_NOINLINE bool started_fused_beyond(const Pad own, int peer) {
  const uint64_t ahead = ((ld_acquire_sys(own.started(peer)) >> fused::kDescriptorBits) - *own.fused_epoch()) &
                         fused::kEpochMask;
  return ahead == 1;
}

// How a wait for a count ended.
enum class CountWait { Arrived, GaveUp, PeerElsewhere };

// Waits until the count at `flag` (this rank's pad) holds `value` or more (wrap-safe):
// ld.relaxed.sys spins, then one ld.acquire.sys, which reads the value or a later one
// (coherence order of one location), so it synchronises with a release at or after the one
// that stored it: the acquire of step 3 above, and of step 2 of "Finished launches". Ends
// without it, acquiring nothing, once this rank's error word is set or the deadline passed
// (GaveUp), or once rank `elsewhere` (>= 0) is in a fused launch instead (PeerElsewhere);
// looked at every 1024 spins.
__device__ __forceinline__ CountWait await_count_from(const uint32_t *flag, uint32_t value, const Pad &own,
                                                    const Deadline &deadline, int elsewhere) {
  for (uint32_t spins = 0; !count_reached(flag, value); ++spins) {
    if ((spins & 1023u) != 1023u) continue;
    if (ld_relaxed_sys(own.error()) != 0 || deadline.expired()) return CountWait::GaveUp;
    // The second look at the flag comes after the started flag's acquire.
    if (elsewhere >= 0 && started_fused_beyond(own, elsewhere) && !count_reached(flag, value)) {
      return CountWait::PeerElsewhere;
    }
  }
  (void)ld_acquire_sys(flag); // the acquire: orders what follows
  return CountWait::Arrived;
}

// The same without the look for a peer in a fused launch (the finished launches' wait, step 2
// above): true once reached.
__device__ __forceinline__ bool await_count(const uint32_t *flag, uint32_t value, const Pad &own,
                                            const Deadline &deadline) {
  return await_count_from(flag, value, own, deadline, -1) == CountWait::Arrived;
}

// Step 2 of "Finished launches", for thread `peer` (< world) of a block: true once rank `peer`
// has finished every collective launch this rank finished (acquired); false, reported as
// TPFUSE_ERROR_PEER_TIMEOUT | peer unless the error word holds a failure already, at the
// deadline or once the error word is set. The caller's block passes a __syncthreads after.
__device__ __forceinline__ bool await_peer_finished(const tpfuse_peers &peers, const tpfuse_group_args &g,
                                                    const Deadline &deadline, int peer) {
  const Pad own{peers.signals[g.rank]};
  // This rank's previous collective launch wrote it, and has ended (stream order).
  if (await_count(own.finished(peer), *own.finished_count(), own, deadline)) return true;
  if (ld_relaxed_sys(own.error()) == 0) report_failure(peers, g, TPFUSE_ERROR_PEER_TIMEOUT | static_cast<uint32_t>(peer));
  return false;
}

// Host: a 32-bit digest of what a launch is (kernel, element type, sizes, grid), equal on
// every rank exactly when the ranks launched the same thing.
inline uint32_t launch_descriptor(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0xcbf29ce484222325ull; // FNV-1a over the parts' bytes
  for (uint64_t part : parts) {
    for (int byte = 0; byte < 8; ++byte) {
      h ^= (part >> (8 * byte)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  }
  return static_cast<uint32_t>(h ^ (h >> 32));
}

// A block's barrier state, in the kernel's shared memory: `failures` counts the block's failed
// waits (1 from the start when the group was already poisoned) and is never reset within a
// launch, so no thread can read a stale value; `last` says the block finished the launch last.
struct BarrierState {
  int failures;
  int last;
};

// One launch's view of the barriers of its block (`state`: a __shared__ BarrierState of the
// kernel). Constructing it also waits for the peers' finished launches (step 2 above): a
// kernel stores nothing before.
class BlockBarrier {
public:
  __device__ BlockBarrier(const tpfuse_peers &peers, const tpfuse_group_args &g, uint32_t descriptor,
                          BarrierState *state)
      : peers_(peers), g_(g), own_{peers.signals[g.rank]}, failures_(&state->failures), last_(&state->last),
        descriptor_(descriptor), deadline_(g) {
    // Only this block of this rank touches counters[b]; the previous launch on the stream
    // wrote it and has finished.
    epoch_ = *own_.counter(blockIdx.x);
    first_ = epoch_;
    if (threadIdx.x == 0) *failures_ = ld_relaxed_sys(own_.error()) != 0 ? 1 : 0;
    __syncthreads();
    // No barrier inside: a waiter that reads a failure counted by another skips its wait.
    const int peer = threadIdx.x;
    if (peer < g.world && *failures_ == 0 && !await_peer_finished(peers, g, deadline_, peer)) atomicAdd(failures_, 1);
    __syncthreads();
  }

  // Whether the group was poisoned when this block started, or its wait for the peers'
  // finished launches failed (the same answer in every thread).
  __device__ bool poisoned() const { return *failures_ != 0; }

  // Passes the next barrier; false when a peer did not arrive before the launch's deadline,
  // launched something else, or another rank reported a failure.
  __device__ bool arrive_and_wait() {
    const uint32_t value = ++epoch_;
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < g_.world) {
      const Pad theirs{peers_.signals[peer]};
      const bool first = value == first_ + 1;
      // Relaxed: the flag's release just below orders it (same thread, program order).
      if (first) st_relaxed_sys(theirs.descriptor(blockIdx.x, g_.rank), descriptor_);
      st_release_sys(theirs.flag(blockIdx.x, g_.rank), value);
      const CountWait awaited = await_count_from(own_.flag(blockIdx.x, peer), value, own_, deadline_, peer);
      if (awaited == CountWait::PeerElsewhere ||
          (awaited == CountWait::Arrived && first && ld_relaxed_sys(own_.descriptor(blockIdx.x, peer)) != descriptor_)) {
        report(TPFUSE_ERROR_PEER_MISMATCH | static_cast<uint32_t>(peer) | static_cast<uint32_t>(g_.rank) << 16);
        atomicAdd(failures_, 1);
      } else if (awaited == CountWait::GaveUp) {
        if (ld_relaxed_sys(own_.error()) == 0) report(TPFUSE_ERROR_PEER_TIMEOUT | static_cast<uint32_t>(peer));
        atomicAdd(failures_, 1);
      }
    }
    __syncthreads();
    const bool passed = *failures_ == 0;
    if (passed && threadIdx.x == 0) note_barrier_passed();
    return passed;
  }

  // The blocks of this rank's launch meet (the one-shot RMSNorm's cross-block sum of
  // squares); false when the launch failed meanwhile. Every block of the grid is resident
  // at once (a cooperative launch: backend.cuh), so the wait ends.
  //
  // Protocol, thread 0 of each block, on grid_count and grid_generation of this rank's pad:
  // read the generation (ld.acquire: it cannot be satisfied after the add below), then add
  // 1 to the count with atom.acq_rel.gpu (it releases the block's writes, ordered before it
  // by __syncthreads; the adds of one location form a release sequence, so the last adder
  // acquires every earlier block's writes). The last arriver sets the count back to 0 (no
  // block of this launch adds again, and the next launch on the stream starts after this
  // one ends) and stores generation + 1 with st.release.gpu (only this rank's blocks read
  // either: ptx.cuh); the others spin on the generation (relaxed), then acquire it once,
  // under the launch's deadline like every wait.
  // A __syncthreads then orders the whole block after thread 0's acquire.
  __device__ bool meet_rank_blocks() {
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t *count = own_.grid_count();
      uint32_t *generation = own_.grid_generation();
      const uint32_t seen = ld_acquire_sys(generation);
      if (atomic_add_acq_rel_gpu(count, 1u) + 1u == gridDim.x) {
        st_release_gpu(count, 0u);
        st_release_gpu(generation, seen + 1u);
      } else {
        bool met = true;
        for (uint32_t spins = 0; ld_relaxed_sys(generation) == seen; ++spins) {
          if ((spins & 1023u) != 1023u) continue;
          if (ld_relaxed_sys(own_.error()) != 0 || deadline_.expired()) {
            met = false;
            break;
          }
        }
        if (met) {
          (void)ld_acquire_sys(generation);
        } else {
          // A block of this rank gave up (it set the error word) or, without it, the
          // deadline passed: not every block was resident at once.
          if (ld_relaxed_sys(own_.error()) == 0) report(TPFUSE_ERROR_GRID_TIMEOUT | static_cast<uint32_t>(g_.rank));
          atomicAdd(failures_, 1);
        }
      }
    }
    __syncthreads();
    return *failures_ == 0;
  }

  // The end of a block that passed all its waits, from every thread, after its last memory
  // operation: stores the epoch for the next launch, and counts the block finished; the
  // rank's last block announces the launch to every rank (step 1 of "Finished launches").
  __device__ void finish() const {
    __syncthreads();
    if (threadIdx.x == 0) {
      *own_.counter(blockIdx.x) = epoch_;
      *last_ = atomic_add_acq_rel_gpu(own_.finishing(), 1u) + 1u == gridDim.x;
      if (*last_) {
        *own_.finishing() = 0;
        *own_.finished_count() += 1;
      }
    }
    __syncthreads(); // thread 0's acquire, before the releases below
    if (*last_ && static_cast<int>(threadIdx.x) < g_.world) {
      st_release_sys(Pad{peers_.signals[threadIdx.x]}.finished(g_.rank), *own_.finished_count());
    }
  }

  // Call once per block when the block gives up (poisoned() or a barrier failed), from every
  // thread: copies this rank's error word to its host-mapped word, where the host sees it
  // without synchronising.
  __device__ void publish_failure() const {
    if (threadIdx.x == 0) publish_error_to_host(peers_, g_);
  }

private:
  __device__ void report(uint32_t word) const { report_failure(peers_, g_, word); }

  const tpfuse_peers &peers_;
  const tpfuse_group_args &g_;
  Pad own_;
  int *failures_;
  int *last_;
  uint32_t descriptor_;
  uint32_t epoch_;
  uint32_t first_;          // the epoch at the start of the launch
  Deadline deadline_;       // one for all the launch's waits
};

} // namespace tpfuse
