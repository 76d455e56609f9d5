// copy.cuh: copies of 16-byte vectors that keep several loads in flight per thread. A thread
// issues the loads of its next kCopyInFlight vectors before it stores any of them, so a copy
// of L vectors a thread waits ceil(L / kCopyInFlight) load latencies, not L (a peer's is over
// a microsecond, and a store's operand holds the next load back: ptxas cannot move a load
// above a store that may alias it). A thread copies the same vectors, in the same order, as
// the one-at-a-time loop `for (i = first; i < end; i += stride)` would, so a caller that
// reads back what a thread itself wrote keeps its program-order argument.
// scripts/sass_reductions.py checks the runs of loads in the SASS.
#pragma once

#include "common.cuh"

namespace tpfuse {

constexpr int kCopyInFlight = 4;

// store(i, load(i)) for i = first, first + stride, ... below end; load returns the 16 bytes
// at index i, store writes them.
template <typename Load, typename Store>
__device__ __forceinline__ void copy_vectors(size_t first, size_t end, size_t stride, Load load, Store store) {
#pragma unroll 1
  for (size_t i = first; i < end; i += kCopyInFlight * stride) {
    uint4 v[kCopyInFlight];
#pragma unroll
    for (int j = 0; j < kCopyInFlight; ++j)
      if (i + j * stride < end) v[j] = load(i + j * stride);
#pragma unroll
    for (int j = 0; j < kCopyInFlight; ++j)
      if (i + j * stride < end) store(i + j * stride, v[j]);
  }
}

} // namespace tpfuse
