// barrier.cuh: the cross-rank, per-block barrier of the custom collectives.
//
// Protocol. Block b of every rank runs the same sequence of barriers (all ranks launch the
// same kernels with the same grid). Block b of rank r keeps its epoch in its own pad,
// counters[b]; the k-th barrier of a launch has the value counters[b] + k. To pass it:
//
//   1. __syncthreads(): every thread of the block has finished its memory operations
//      (staging writes, reads of peers' buffers);
//   2. thread p (p < world) stores the value into flags[b][r] of rank p's pad with
//      st.release.sys: everything the block did before is visible, at system scope, to
//      whoever acquires that flag;
//   3. thread p spins on flags[b][p] of this rank's own pad with ld.acquire.sys until it
//      holds the value or more (wrap-safe), bounded by one deadline per launch (start of
//      the launch + timeout), and gives up early when its error word turns nonzero;
//   4. __syncthreads(): the whole block proceeds, ordered after the acquires.
//
// Flags only grow, so they are never reset and a replayed CUDA graph works. When a peer
// does not arrive in time, the block records TPFUSE_ERROR_PEER_TIMEOUT | peer in this
// rank's error word and in every other peer's (so they stop waiting too) and the kernel
// returns; the host turns that into Error::PeerTimeout
// and refuses further work on the group. A kernel that finds the error word set returns
// at once (a poisoned group never waits again).
#pragma once

#include "common.cuh"
#include "ptx.cuh"

namespace tpfuse {

struct Pad {
  uint32_t *base;
  __device__ uint32_t *flag(int block, int src) const {
    return base + TPFUSE_SIGNAL_FLAGS_OFFSET / 4 + block * TPFUSE_MAX_RANKS + src;
  }
  __device__ uint32_t *counter(int block) const {
    return base + TPFUSE_SIGNAL_COUNTERS_OFFSET / 4 + block;
  }
  __device__ uint32_t *error() const { return base + TPFUSE_SIGNAL_ERROR_OFFSET / 4; }
};

// One launch's view of the barriers of its block. `failures` is a __shared__ int of the
// kernel: it counts this block's failed waits and is never reset within a launch, so no
// thread can read a stale value.
class BlockBarrier {
public:
  __device__ BlockBarrier(const tpfuse_peers &peers, const tpfuse_group_args &g, int *failures)
      : peers_(peers), g_(g), own_{peers.signals[g.rank]}, failures_(failures) {
    // Only this block of this rank touches counters[b]; the previous launch on the stream
    // wrote it and has finished.
    epoch_ = *own_.counter(blockIdx.x);
    start_ns_ = global_timer_ns();
    if (threadIdx.x == 0) *failures_ = 0;
    __syncthreads();
  }

  // Whether the group was poisoned by an earlier timeout.
  __device__ bool poisoned() const { return ld_relaxed_sys(own_.error()) != 0; }

  // Passes the next barrier; false when a peer did not arrive before the launch's deadline
  // or another rank reported a timeout.
  __device__ bool arrive_and_wait() {
    const uint32_t value = ++epoch_;
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < g_.world) {
      st_release_sys(Pad{peers_.signals[peer]}.flag(blockIdx.x, g_.rank), value);
      const uint32_t *flag = own_.flag(blockIdx.x, peer);
      for (uint32_t spins = 0; static_cast<int32_t>(ld_acquire_sys(flag) - value) < 0; ++spins) {
        if ((spins & 1023u) != 1023u) continue;
        if (ld_relaxed_sys(own_.error()) != 0) { // a peer gave up: so do we
          atomicAdd(failures_, 1);
          break;
        }
        if (global_timer_ns() - start_ns_ > g_.timeout_ns) {
          report_timeout(peer);
          atomicAdd(failures_, 1);
          break;
        }
      }
    }
    __syncthreads();
    const bool passed = *failures_ == 0;
    if (passed && threadIdx.x == 0) note_barrier_passed();
    return passed;
  }

  // Records "rank `missing` did not arrive" in this rank's error word and in every peer's,
  // so that the survivors stop waiting at once instead of each running out its deadline.
  __device__ void report_timeout(int missing) const {
    const uint32_t word = TPFUSE_ERROR_PEER_TIMEOUT | static_cast<uint32_t>(missing);
    atomicCAS(own_.error(), 0u, word);
    for (int p = 0; p < g_.world; ++p) {
      if (p != g_.rank && p != missing) st_release_sys(Pad{peers_.signals[p]}.error(), word);
    }
  }

  // Stores the epoch for the next launch; call once, after the last barrier passed.
  __device__ void commit() const {
    if (threadIdx.x == 0) *own_.counter(blockIdx.x) = epoch_;
  }

private:
  const tpfuse_peers &peers_;
  const tpfuse_group_args &g_;
  Pad own_;
  int *failures_;
  uint32_t epoch_;
  uint64_t start_ns_; // the launch's deadline is start_ns_ + timeout_ns, for all its waits
};

} // namespace tpfuse
