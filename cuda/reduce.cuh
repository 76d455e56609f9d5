// reduce.cuh: one 16-byte vector of the ranks' sum, the arithmetic every custom reduction
// shares (the all-reduce kernels and the fused GEMM + all-reduce), so that they give the
// same bits: every rank's elements added in rank order 0..W-1 in f32, then the epilogue.
#pragma once

#include "epilogue.cuh"

namespace tpfuse {

// Elements i .. i + kLen - 1 (i a multiple of kLen) of the sum over the `world` ranks of
// peers.data[p] + offset (elements), through `epi` (which rounds once and, with a residual,
// writes it). kMaxWorld >= world bounds the unrolled loops: all the 16-byte loads of a vector
// are issued before the first add (the loops keep them in registers), through L2 only
// (peers' buffers change between launches). With kMaxWorld == world (the all-reduce kernels,
// one instantiation per world) the predicates fold away; with kMaxWorld = TPFUSE_MAX_RANKS
// (the fused GEMM, one code path for every world) they are per-thread predicates. The adds
// are the same either way.
template <typename T, int kMaxWorld>
__device__ __forceinline__ Vec16<T> reduce_vector(const tpfuse_peers &peers, int world, size_t offset, size_t i,
                                                  const Epilogue<T> &epi) {
  constexpr int kVec = Vec16<T>::kLen;
  Vec16<T> x[kMaxWorld];
#pragma unroll
  for (int p = 0; p < kMaxWorld; ++p) {
    if (p < world) x[p] = load16_peer(static_cast<const T *>(peers.data[p]) + offset + i);
  }
  float acc[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) acc[j] = Elem<T>::to_f32(x[0].v[j]);
#pragma unroll
  for (int p = 1; p < kMaxWorld; ++p) {
    if (p < world) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] += Elem<T>::to_f32(x[p].v[j]);
    }
  }
  return epi.apply_vec(acc, i);
}

} // namespace tpfuse
