// reduce.cuh: one 16-byte vector of the ranks' sum, the arithmetic every custom reduction
// shares (the all-reduce kernels and the fused GEMM + all-reduce), so that they give the
// same bits: every rank's elements added in rank order 0..W-1 in f32, then the epilogue.
#pragma once

#include "epilogue.cuh"

namespace tpfuse {

// Elements i .. i + kLen - 1 (i a multiple of kLen) of the sum over the `world` ranks of
// peers.data[p] + offset (elements), through `epi` (which rounds once and, with a residual,
// writes it). kMaxWorld >= world bounds the unrolled loops: all the 16-byte loads of a vector
// are issued before the first add (the loops keep them in registers), the peers' through L2
// only (peers' buffers change between launches), the epilogue's bias and residual with them,
// so that the vector waits one load latency. With kMaxWorld == world (the all-reduce kernels,
// one instantiation per world) the predicates fold away; with kMaxWorld = TPFUSE_MAX_RANKS
// (the fused GEMM, one code path for every world) they are per-thread predicates. The adds
// are the same either way. sum_ranks is the arithmetic on vectors already loaded (raw[p]:
// rank p's 16 bytes), through the epilogue whose operands were loaded before them; add_rank is
// one step of it (the fused kernel's packets, packets.cuh, add the ranks as they arrive).
// acc += rank p's raw vector (acc = it, for rank 0): one step of the rank-ordered sum.
template <typename T>
__device__ __forceinline__ void add_rank(float (&acc)[Vec16<T>::kLen], const uint4 &raw, int p) {
  const Vec16<T> x = vec_of<T>(raw);
#pragma unroll
  for (int j = 0; j < Vec16<T>::kLen; ++j) acc[j] = p == 0 ? Elem<T>::to_f32(x.v[j]) : acc[j] + Elem<T>::to_f32(x.v[j]);
}

template <typename T, int kMaxWorld>
__device__ __forceinline__ Vec16<T> sum_ranks(const uint4 (&raw)[kMaxWorld], int world, size_t i,
                                              const Epilogue<T> &epi,
                                              const typename Epilogue<T>::Operands &operands) {
  float acc[Vec16<T>::kLen];
#pragma unroll
  for (int p = 0; p < kMaxWorld; ++p)
    if (p < world) add_rank<T>(acc, raw[p], p);
  return epi.apply_loaded(acc, i, operands);
}

template <typename T, int kMaxWorld>
__device__ __forceinline__ Vec16<T> reduce_vector(const tpfuse_peers &peers, int world, size_t offset, size_t i,
                                                  const Epilogue<T> &epi) {
  // The epilogue's operands first (issued after the peers' loads, ptxas scheduled them after
  // the first adds), and every vector kept as raw 16 bytes until the adds (unpacked where it
  // is loaded, the first waited for its load before the next load issued):
  // scripts/sass_reductions.py checks the SASS.
  const typename Epilogue<T>::Operands operands = epi.operands(i);
  uint4 raw[kMaxWorld];
#pragma unroll
  for (int p = 0; p < kMaxWorld; ++p) {
    if (p < world) {
      const T *rank_p = static_cast<const T *>(peers.data[p]) + offset + i;
      raw[p] = ld_global_cg(reinterpret_cast<const uint4 *>(rank_p));
    }
  }
  return sum_ranks<T, kMaxWorld>(raw, world, i, epi, operands);
}

} // namespace tpfuse
