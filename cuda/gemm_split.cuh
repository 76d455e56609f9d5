// gemm_split.cuh: the split of k in parallel (gemm_sm80.cuh's contract, "Batch invariance").
// Each block computes one part of one tile and stores the part's f32 chain; the last block of
// a tile to finish adds the tile's parts in ascending order and runs the epilogue. The bits are
// those of one block running the parts one after another (gemm_tile with KSplit{S, 0, S}): the
// same chains, added in the same order by the same f32 additions, then the same store8.
//
// Scratch (the caller's, 16-byte aligned, zeroed once before its first use):
//   uint32 counts[kSplitMaxTiles]   how many parts of tile t have finished (a fixed region,
//                                   whatever the shape: calls of different shapes share it)
//   float  partials[S][m][n]        part p's chains (written before they are read)
// A launch leaves every count at 0 again, so launches of any shape on one stream can reuse the
// scratch. Only the counts matter between launches; a launch that failed part-way may leave
// counts behind, and the scratch must then be zeroed again.
//
// Protocol (PTX ISA memory model). A block stores its part's partials (weak st.global), then
// __syncthreads orders every thread's stores before thread 0's atom.acq_rel.gpu add on the
// tile's count (bar.sync is a CTA-scope fence-like synchronisation, and the release is
// cumulative: it releases what thread 0 observed through the barrier). The adds of one count
// form a release sequence, so the block whose add brings the count to S acquires every other
// part's release: their partial stores happen before its reads. Thread 0 then sets the count
// back to 0 (no other block of this launch adds to it any more; the next launch on the stream
// starts after this one ends), and a second __syncthreads orders thread 0's acquire before
// the other threads' loads of the partials (ld.global.cg: L2, never a stale L1 line). No
// block waits for another: nothing here can hang.
#pragma once

#include "gemm_epilogue.cuh"
#include "gemm_sm80.cuh"

namespace tpfuse {
namespace gemm {

// Host: the split of k, at most kMaxParts parts of at least kMinPartK elements.
constexpr size_t kMaxParts = 16;
constexpr size_t kMinPartK = 128;

// Whether `items` equal work items dealt in turn to `sms` SMs keep them busy: at least 90% of
// the SMs get one, and the busiest SM has at most 1.25x the mean.
inline bool spreads(size_t items, size_t sms) {
  const size_t per_sm = (items + sms - 1) / sms;
  return 10 * items >= 9 * sms && 4 * per_sm * sms <= 5 * items;
}

// The parts k is split into for a weight of n rows and k columns on a device of `sms` SMs:
// the fewest that give a decode step's tiles (one row of 64-column tiles) x parts enough work
// items to spread over the SMs (1 when the tiles alone do), at most kMaxParts and k /
// kMinPartK. It does not depend on m: the batch-invariance contract (gemm_sm80.cuh).
inline int split_parts(size_t n, size_t k, int sms) {
  const size_t tiles = (n + 63) / 64;
  const size_t by_k = k / kMinPartK;
  const size_t most = by_k < 1 ? 1 : by_k > kMaxParts ? kMaxParts : by_k;
  const size_t s_count = sms > 0 ? static_cast<size_t>(sms) : 1;
  for (size_t parts = 1; parts <= most; ++parts)
    if (spreads(tiles * parts, s_count)) return static_cast<int>(parts);
  return static_cast<int>(most);
}

// Host: split_parts on the current device, or 0 when its SM count cannot be read (never a
// guess: another S would give other bits than the launches that read it).
inline int split_parts_here(size_t n, size_t k) {
  int sms = 0;
  return current_sm_count_checked(sms) ? split_parts(n, k, sms) : 0;
}

// The most tiles a parallel split takes, and the bytes of the counts at the start of the
// scratch (the same for every shape).
constexpr size_t kSplitMaxTiles = 4096;
constexpr size_t kSplitCountsBytes = kSplitMaxTiles * 4;

// Stores a part's f32 chains: partials[row, col..col+8) (two 16-byte stores).
struct PartialEpilogue {
  float *partials; // [m, n] of this part
  int n;
  __device__ __forceinline__ void store8(int row, int col, const float (&acc)[8]) const {
    float *at = partials + static_cast<size_t>(row) * static_cast<size_t>(n) + static_cast<size_t>(col);
    Vec16<float> lo, hi;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lo.v[j] = acc[j];
      hi.v[j] = acc[4 + j];
    }
    store16(at, lo);
    store16(at + 4, hi);
  }
};

// After a block stored its part of a tile (every thread, weak stores): whether it was the
// tile's last part to finish, in every thread (`last`: a shared int). The __syncthreads
// before thread 0's acq_rel add on the tile's count (`count`, S parts in all) orders every
// thread's stores before its release; the second orders thread 0's acquire before the
// block's loads of the other parts. The last block sets the count back to 0 (no other block
// of the launch adds to it any more).
__device__ __forceinline__ bool finished_last(uint32_t *count, int parts, int &last) {
  __syncthreads(); // every thread's partial stores, before thread 0's release
  if (threadIdx.x == 0) {
    last = atomic_add_acq_rel_gpu(count, 1u) + 1u == static_cast<uint32_t>(parts);
    if (last) *count = 0;
  }
  __syncthreads(); // thread 0's acquire, before the block's loads of the other parts
  return last != 0;
}

// Tile (tile_m, tile_n)'s outputs in runs of 8 columns: the `parts` f32 partials ([parts][m]
// [n] from `partials`) added in ascending order, then `epi.store8` (the bits of gemm_tile with
// KSplit{parts, 0, parts}). Call after finished_last returned true.
template <typename Cfg, typename Epi>
__device__ __forceinline__ void add_parts(const float *partials, int parts, int m, int n, int tile_m, int tile_n,
                                          const Epi &epi) {
  constexpr int kRuns = Cfg::kBlockN / 8;
  const size_t mn = static_cast<size_t>(m) * static_cast<size_t>(n);
  const int m0 = tile_m * Cfg::kBlockM, n0 = tile_n * Cfg::kBlockN;
  for (int idx = threadIdx.x; idx < Cfg::kBlockM * kRuns; idx += Cfg::kThreads) {
    const int row = m0 + idx / kRuns;
    const int col = n0 + idx % kRuns * 8;
    if (row >= m || col >= n) continue;
    const float *at = partials + static_cast<size_t>(row) * static_cast<size_t>(n) + static_cast<size_t>(col);
    float v[8];
    for (int p = 0; p < parts; ++p) {
      const Vec16<float> lo = load16_peer(at + p * mn);
      const Vec16<float> hi = load16_peer(at + p * mn + 4);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[j] = p == 0 ? lo.v[j] : v[j] + lo.v[j];
        v[4 + j] = p == 0 ? hi.v[j] : v[4 + j] + hi.v[j];
      }
    }
    epi.store8(row, col, v);
  }
}

// Block b: part b / tiles of tile b % tiles (tile_of_block's order within a part, so the
// blocks of one part cover the tiles as the unsplit kernel does).
template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    gemm_split_kernel(const T *__restrict__ a, const T *__restrict__ b, int m, int n, int k, int tiles_m, int tiles_n,
                      int parts, uint32_t *counts, float *partials, const GemmEpilogue<T> epi) {
  static_assert(Cfg::kSplittable, "a split runs on splittable configurations only");
  TPFUSE_DYNAMIC_SHARED(smem);
  TPFUSE_SHARED(int, last);
  const int tiles = tiles_m * tiles_n;
  const int tile = static_cast<int>(blockIdx.x) % tiles;
  const int part = static_cast<int>(blockIdx.x) / tiles;
  const size_t mn = static_cast<size_t>(m) * static_cast<size_t>(n);
  int tile_m, tile_n;
  tile_of_block(tile, tiles_m, tiles_n, tile_m, tile_n);
  gemm_tile<T, Cfg>(DenseRows<T>{a, k}, b, m, n, k, tile_m, tile_n, PartialEpilogue{partials + part * mn, n}, smem,
                    KSplit{parts, part, part + 1});
  if (finished_last(counts + tile, parts, last)) add_parts<Cfg>(partials, parts, m, n, tile_m, tile_n, epi);
}

} // namespace gemm
} // namespace tpfuse
