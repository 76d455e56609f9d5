// failure.cuh: what a launch that did not complete leaves behind (tpfuse.h): every 16 bits of
// every output element it was responsible for hold TPFUSE_FAILED_OUTPUT_BITS16, a quiet NaN
// no arithmetic produces, so a result of a failed launch cannot pass for a result, also
// inside a replayed CUDA graph where no host call sees the launch.
#pragma once

#include "common.cuh"
#include "ptx.cuh"

namespace tpfuse {

// Marks elements [begin, end) of p failed, p may be NULL; element `begin` is 16-byte aligned
// (the ranges of the kernels are). The marker is stored through 16-bit integer views, so it
// never passes through a float register. The block's threads share the work.
template <typename T> __device__ __forceinline__ void mark_failed(T *p, size_t begin, size_t end) {
  if (p == nullptr) return;
  constexpr size_t kHalves = sizeof(T) / 2;
  uint16_t *q = reinterpret_cast<uint16_t *>(p);
  begin *= kHalves;
  end *= kHalves;
  constexpr size_t kVec = Vec16<uint16_t>::kLen;
  Vec16<uint16_t> v;
#pragma unroll
  for (int j = 0; j < kVec; ++j) v.v[j] = TPFUSE_FAILED_OUTPUT_BITS16;
  const size_t full_end = begin + (end - begin) / kVec * kVec;
  for (size_t i = begin + threadIdx.x * kVec; i < full_end; i += blockDim.x * kVec) store16(q + i, v);
  for (size_t i = full_end + threadIdx.x; i < end; i += blockDim.x) {
    st_global(q + i, static_cast<uint16_t>(TPFUSE_FAILED_OUTPUT_BITS16));
  }
}

// The error words a kernel that follows a collective consults (the two-shot all-reduce's
// RMSNorm): this rank's word in its signal pad and its host-mapped copy. A kernel given
// them marks its outputs failed instead of computing when the pad's word is set, and copies
// the word to the host. Both NULL for a standalone launch.
struct FailureWords {
  const uint32_t *pad;
  uint32_t *host;
};

// Whether the group failed, read once by thread 0 and shared with the block (`shared` is a
// __shared__ uint32_t of the kernel), so every thread takes the same branch. Copies the word
// to the host-mapped one when set.
__device__ __forceinline__ bool group_failed(const FailureWords &w, uint32_t *shared) {
  if (w.pad == nullptr) return false;
  if (threadIdx.x == 0) {
    *shared = ld_relaxed_sys(w.pad);
    if (*shared != 0 && w.host != nullptr) st_release_sys(w.host, *shared);
  }
  __syncthreads();
  return *shared != 0;
}

} // namespace tpfuse
