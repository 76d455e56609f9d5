// gemm_split.cuh: the split of k in parallel (gemm_sm80.cuh's contract, "Batch invariance").
// Each block computes one part of one tile and stores the part's f32 chain; the parts are then
// folded into part 0's partials in ascending order (P0 := P0 + Pj, j = 1, 2, ...), the last
// fold handing its sum to the epilogue instead. The bits are those of one block running the
// parts one after another (gemm_tile with KSplit{S, 0, S}): the same chains, added in the same
// order by the same f32 additions, then the same store8.
//
// Who folds. A block that stores part j folds when every part before it is folded: then it
// folds the run of parts stored from j on in one pass (the running sum read once, each part's
// chains once, the sum written once, or the last part's handed to the epilogue), then, in
// further rounds, each run stored meanwhile (the sum kept in registers, but written back each
// round for whichever block folds next); it stops where the next part is not stored yet,
// which that part's block then folds. When each part is stored after the fold of the one
// before, each block folds its own (part j > 0: the sum and its chains read, the sum written):
// the plan's case, 3S - 4 partials read or written over the tile's blocks. When part 0 is
// stored last, part 0's block folds all S in one pass, as a single adder would (the least
// traffic in all). The most on one block: every part stored while the one before is being
// folded, so one block folds them one round each (2S - 2 partials read or written, S - 1
// rounds of two barriers and an L2 atomic). Which block folds what depends on the order the
// parts finish: on a GPU, unmeasured (their blocks start within one wave, so it may be close
// to chance).
//
// Scratch (the caller's, 16-byte aligned, zeroed once before its first use):
//   uint32 counts[kSplitMaxTiles]   tile t's word: bit j set once part j is stored, and the
//                                   parts folded so far at kFoldedShift (a fixed region,
//                                   whatever the shape: calls of different shapes share it)
//   float  partials[S][m][n]        part p's chains (written before they are read); part 0's
//                                   become the running sum
// A launch leaves every word at 0 again, so launches of any shape on one stream can reuse the
// scratch. Only the words matter between launches; a launch that failed part-way may leave
// words behind, and the scratch must then be zeroed again.
//
// Protocol (PTX ISA memory model). Every change of a tile's word but its reset is thread 0's
// atom.acq_rel.gpu add, after a __syncthreads that orders the block's stores before it
// (bar.sync is a CTA-scope fence-like synchronisation, and the release is cumulative: it
// releases what thread 0 observed through the barrier), and before a second __syncthreads
// that orders its acquire before the block's loads (ld.global.cg: L2, never a stale L1
// line). The adds of one word form a total order and each reads the value of the one before,
// so each acquires what every earlier add released: the partials of every part stored before
// it and the running sum of every fold before it. The adds:
//   stored_part  adds 1 << j once part j's chains are stored (the bits never carry: each is
//                added once); the block folds from part j on when the old word says exactly j
//                parts are folded (every earlier part; j itself cannot be, since only j's
//                block sets bit j), the run of parts whose bits the old word holds from j on;
//   fold_parts   after folding parts [f, e), adds (e - f) << kFoldedShift (e folded) and goes
//                on with the run from part e when the old word has e's bit set (its block
//                found fewer than e parts folded and left it), else stops (e's block will find
//                exactly e folded).
// Of the two adds that concern part e (its block's, and the fold's that brings the count to e),
// the one later in the word's order sees the other: exactly one block folds each part, after
// every part before it. The block that folds part S - 1 runs the epilogue and sets the word
// back to 0 (every part stored and folded: no other block of this launch touches it any more;
// the next launch on the stream starts after this one ends). No block waits for another:
// nothing here can hang.
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

// The parts in parallel only for the configurations select_config gives a split (64 columns:
// 16 x 64, 64 x 64, and the fused kernels' variants); a forced 16 x 16 or 16 x 32 runs its
// parts one after another (the same bits), and its kernels carry no fold code (registers).
template <typename Cfg> constexpr bool kParallelSplit = Cfg::kSplittable && Cfg::kBlockN == 64;

// A tile's word: the stored parts' bits below kFoldedShift, the parts folded from it on.
constexpr int kFoldedShift = 16;
static_assert(kMaxParts <= kFoldedShift, "a bit for every part below the folded count");

// The end of the run of stored parts from part `first` (itself stored) in a word's bits.
__device__ __forceinline__ int stored_run_end(uint32_t word, int first, int parts) {
  int end = first + 1;
  while (end < parts && (word >> end & 1u) != 0) ++end;
  return end;
}

// After a block stored part `part` of a tile (every thread, weak stores): whether it folds from
// that part on (every part before it folded), in every thread; if so, `run_end` (a shared int)
// is the end of the run of stored parts from it, else -1.
__device__ __forceinline__ bool stored_part(uint32_t *word, int part, int parts, int &run_end) {
  __syncthreads(); // every thread's partial stores, before thread 0's release
  if (threadIdx.x == 0) {
    const uint32_t old = atomic_add_acq_rel_gpu(word, 1u << part);
    run_end = old >> kFoldedShift == static_cast<uint32_t>(part) ? stored_run_end(old, part, parts) : -1;
  }
  __syncthreads(); // thread 0's acquire, before the block's loads of the running sum
  return run_end >= 0;
}

// After stored_part gave this block the parts from `first` to fold (the run up to `run_end`):
// folds that run, then, in further rounds, each run of parts stored meanwhile. True when it
// folded the last part, so the tile's outputs are stored (through `epi`, before the last
// round's __syncthreads); false when the next part is not stored yet (its block folds it).
// `run_end` is stored_part's shared int.
//
// The running sum is part 0's partials. A round folds parts [first, end) over tile (tile_m,
// tile_n), in runs of 8 columns, each thread the same runs every round: the sum (read in the
// block's first fold, then kept in registers), then each part in ascending order (part 0 is
// the sum's start); stored back for the block that may fold next, or, when `end` is the last
// part's end, handed to `epi.store8` (the bits of gemm_tile with KSplit{parts, 0, parts}).
template <typename Cfg, typename Epi>
__device__ __forceinline__ bool fold_parts(float *partials, uint32_t *word, int first, int parts, int m, int n,
                                           int tile_m, int tile_n, const Epi &epi, int &run_end) {
  constexpr int kRuns = Cfg::kBlockN / 8;
  constexpr int kPerThread = (Cfg::kBlockM * kRuns + Cfg::kThreads - 1) / Cfg::kThreads;
  const size_t mn = static_cast<size_t>(m) * static_cast<size_t>(n);
  const int m0 = tile_m * Cfg::kBlockM, n0 = tile_n * Cfg::kBlockN;
  float v[kPerThread][8];
  bool loaded = false; // whether v holds the sum (uniform over the block)
  for (;;) {
    const int end = run_end;
    if (end == parts || end > (first > 0 ? first : 1)) {
#pragma unroll
      for (int r = 0; r < kPerThread; ++r) {
        const int idx = static_cast<int>(threadIdx.x) + r * Cfg::kThreads;
        const int row = m0 + idx / kRuns;
        const int col = n0 + idx % kRuns * 8;
        if (idx >= Cfg::kBlockM * kRuns || row >= m || col >= n) continue;
        float *sum = partials + static_cast<size_t>(row) * static_cast<size_t>(n) + static_cast<size_t>(col);
        if (!loaded) {
          const Vec16<float> lo = load16_peer(sum), hi = load16_peer(sum + 4);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            v[r][i] = lo.v[i];
            v[r][4 + i] = hi.v[i];
          }
        }
        for (int j = first > 0 ? first : 1; j < end; ++j) {
          const Vec16<float> lo = load16_peer(sum + j * mn), hi = load16_peer(sum + j * mn + 4);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            v[r][i] += lo.v[i];
            v[r][4 + i] += hi.v[i];
          }
        }
        if (end == parts) {
          epi.store8(row, col, v[r]);
        } else {
          PartialEpilogue{partials, n}.store8(row, col, v[r]); // for the block that folds next
        }
      }
      loaded = true;
    }
    __syncthreads(); // every thread's fold (and read of run_end), before thread 0's release
    if (threadIdx.x == 0) {
      if (end == parts) {
        *word = 0; // every part folded: no other block touches the word in this launch
      } else {
        const uint32_t old = atomic_add_acq_rel_gpu(word, static_cast<uint32_t>(end - first) << kFoldedShift);
        run_end = (old >> end & 1u) != 0 ? stored_run_end(old, end, parts) : -1;
      }
    }
    __syncthreads(); // thread 0's acquire, before the block's loads of the next run
    if (end == parts) return true;
    if (run_end < 0) return false;
    first = end;
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
  if (stored_part(counts + tile, part, parts, last))
    fold_parts<Cfg>(partials, counts + tile, part, parts, m, n, tile_m, tile_n, epi, last);
}

} // namespace gemm
} // namespace tpfuse
