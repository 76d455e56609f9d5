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
//      holds the value or more (wrap-safe), bounded by the launch's timeout;
//   4. __syncthreads(): the whole block proceeds, ordered after the acquires.
//
// Flags only grow, so they are never reset and a replayed CUDA graph works. When a peer
// does not arrive in time, the block records TPFUSE_ERROR_PEER_TIMEOUT | peer in this
// rank's error word and the kernel returns; the host turns that into Error::PeerTimeout
// and refuses further work on the group. A kernel that finds the error word set returns
// at once (a poisoned group never waits again).
#pragma once

#include "common.cuh"

namespace tpfuse {

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

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
    if (threadIdx.x == 0) *failures_ = 0;
    __syncthreads();
  }

  // Whether the group was poisoned by an earlier timeout.
  __device__ bool poisoned() const { return ld_relaxed_sys(own_.error()) != 0; }

  // Passes the next barrier; false when a peer did not arrive in time.
  __device__ bool arrive_and_wait() {
    const uint32_t value = ++epoch_;
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < g_.world) {
      st_release_sys(Pad{peers_.signals[peer]}.flag(blockIdx.x, g_.rank), value);
      const uint32_t *flag = own_.flag(blockIdx.x, peer);
      const uint64_t start = global_timer_ns();
      while (static_cast<int32_t>(ld_acquire_sys(flag) - value) < 0) {
        if (global_timer_ns() - start > g_.timeout_ns) {
          atomicCAS(own_.error(), 0u, TPFUSE_ERROR_PEER_TIMEOUT | static_cast<uint32_t>(peer));
          atomicAdd(failures_, 1);
          break;
        }
      }
    }
    __syncthreads();
    return *failures_ == 0;
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
};

} // namespace tpfuse
