// fused_split.cuh: the split of k in parallel inside the fused kernels (GEMM + all-reduce and
// its forms, all-gather + GEMM). The grid's units are then the parts of the tiles: a unit
// stores its part's f32 chains into this rank's staging half ([S][m][n], the first S * m * n * 4
// bytes) and marks it in its tile's word, part_counts[tile] of this rank's signal pad, and the
// parts are folded in order by gemm_split.cuh's protocol, so the bits of tpfuse_gemm's parallel
// split. Only this rank's blocks touch its staging half and its part counts during a fused
// launch (fused_flags.cuh, "Exchange areas"), and a launch that succeeds leaves every word it
// used at 0 for the next (a failed one poisons the group: nothing is produced after it).
#pragma once

#include <initializer_list>

#include "barrier.cuh"
#include "gemm_split.cuh"
#include "phase_clock.cuh"

namespace tpfuse {
namespace fused {

// Host: whether a fused launch of `tiles` tiles runs their `parts` parts as units of its grid
// (tpfuse.h says when): a configuration that folds in parallel (64 columns), at most
// TPFUSE_GEMM_SPLIT_PARALLEL_M_MAX rows, a word for every tile, and the partials within the
// staging half (`capacity` bytes).
template <typename Cfg>
inline bool split_in_parallel(int parts, int m, int n, long long tiles, uint64_t capacity) {
  return gemm::kParallelSplit<Cfg> && parts > 1 && m <= TPFUSE_GEMM_SPLIT_PARALLEL_M_MAX &&
         tiles <= TPFUSE_MAX_FUSED_TILES &&
         static_cast<uint64_t>(parts) * static_cast<uint64_t>(m) * static_cast<uint64_t>(n) * sizeof(float) <=
             capacity;
}

// Host: an argument's bytes, [p, p + bytes) (p null: no argument).
struct Extent {
  const void *p;
  size_t bytes;
};

// Host: whether an argument lies in the parts' partials, the first `bytes` of `staging` (the
// launch would overwrite it).
inline bool overlaps_partials(const void *staging, size_t bytes, std::initializer_list<Extent> args) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(staging), end = begin + bytes;
  for (const Extent &a : args) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(a.p);
    if (p != 0 && p < end && begin < p + a.bytes) return true;
  }
  return false;
}

// Unit (part, tile) of the split, tile (tm, tn) of A's `rows` and the weight w: the part's chains
// into the staging half, then its fold (gemm_split.cuh). True when this block folded the last
// part: the tile's outputs are stored through `epi`, before fold_parts' last __syncthreads (so
// ordered before any release the block makes next). The __syncthreads of stored_part also order
// the GEMM epilogue's reads of smem before the next unit's writes. `last`: a shared int. The
// part counts as a tile computed in `clock` (the fold as what follows).
template <typename T, typename Cfg, typename Epi>
__device__ __forceinline__ bool split_unit(const tpfuse_peers &peers, int rank, gemm::DenseRows<T> rows, const T *w,
                                           int m, int n, int k, int tile, int tm, int tn, int part, int parts,
                                           const Epi &epi, unsigned char *smem, int &last,
                                           PhaseClock &clock) {
  float *partials = static_cast<float *>(peers.data[rank]);
  const size_t mn = static_cast<size_t>(m) * static_cast<size_t>(n);
  gemm::gemm_tile<T, Cfg>(rows, w, m, n, k, tm, tn, gemm::PartialEpilogue{partials + part * mn, n}, smem,
                          gemm::KSplit{parts, part, part + 1});
  clock.tile_computed();
  uint32_t *word = Pad{peers.signals[rank]}.part_count(tile);
  return gemm::stored_part(word, part, parts, last) &&
         gemm::fold_parts<Cfg>(partials, word, part, parts, m, n, tm, tn, epi, last);
}

} // namespace fused
} // namespace tpfuse
