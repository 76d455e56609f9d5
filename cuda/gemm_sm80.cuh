// gemm_sm80.cuh: the sm80 GEMM mainloop, C[m,n] = A[m,k] · B[n,k]^T, for every architecture
// from sm_80 on (sm_80, 86, 89, 90a, 100a, 120a and the compute_80 PTX).
//
// One kernel template, several tile configurations (gemm.cu picks one per call):
//
//   - a block computes a BM x BN tile of C; its warps are laid out WARPS_M x WARPS_N and each
//     owns a (BM/WARPS_M) x (BN/WARPS_N) sub-tile made of m16n8 accumulators;
//   - A and B stream through shared memory in k-slices of BK elements with cp.async (16-byte
//     copies, L2 only), in a ring of STAGES slices: while the warps multiply slice t, the
//     copies of slices t+1 .. t+STAGES-1 are in flight;
//   - warps read their operands from shared memory with ldmatrix.x4 and multiply with
//     mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} (f32 accumulators in registers);
//   - shared rows are BK*2 bytes; the 16-byte chunks of a row are XOR-swizzled by the row
//     (see swizzle()), so that the 8 row addresses of every ldmatrix phase and the 8 chunks of
//     every cp.async phase fall in 8 different bank groups: no bank conflicts on either side;
//   - the accumulators go through shared memory (f32, rows padded by 4 floats) so that the
//     epilogue reads, adds and writes 16 contiguous output bytes per thread.
//
// Edges: rows of A past m and rows of B past n are zeroed once in every stage at the start and
// never loaded; k-chunks past k (k is a multiple of 8, so a 16-byte chunk is either inside or
// outside) are zero-filled by cp.async (src-size 0). Outputs past m or n are never stored.
//
// ---------------------------------------------------------------------------------------------
// Batch invariance (the guarantee every configuration, and the small-m path, keeps):
//
//   k is cut into S parts (S = split_parts(n, k, sms) in gemm.cu: a function of n, k and the
//   device's SM count only, never of m). Part p covers k in [kb(p), kb(p+1)) with
//   kb(p) = 64 * floor(ceil(k/64) * p / S) (and kb(S) clipped to k): boundaries at multiples of
//   64, so whole k-slices of every configuration. Every output C[r, c] is, in f32:
//       chain_p = 0;  for each k16-step s of part p, ascending:  chain_p = mma(A[r, s], B[c, s], chain_p)
//       total = chain_0;  total = total + chain_1;  ...;  total = total + chain_{S-1}
//   each chain one sequence of mma.sync m16n8k16 in one thread's accumulator registers
//   starting from +0.0 (the last step's k-chunk past k holds zeros in both A and B, in every
//   configuration; no configuration runs a step that lies wholly past k), and the parts added
//   in ascending order by plain f32 additions. S = 1 is one chain over all of k. A block runs
//   the parts of its tile one after another (KSplit{S, 0, S}: the running total in a second
//   set of registers), or each part is a block of its own and the parts' f32 partials are
//   folded in the same order (gemm_split.cuh): the same operations on the same
//   values, so the same bits. There is no other reduction across warps or blocks, and no
//   atomics on values, so the value depends only on row r of A, row c of B, k and S: not on
//   m, not on the row's position in its tile, not on the tile shape, not on the grid. The
//   epilogue (GemmEpilogue::store8) then adds bias and residual in f32 in a fixed order and
//   rounds once, the same code for every configuration.
//   Hence a row of C has the same bits whatever m is and whichever path or tile configuration
//   computes it (m = 1 decode, m = 16 / 17 across the small-m boundary, m = 4096 prefill).
//
//   Assumptions, checked by tests/gpu_gemm.rs on a GPU: that the hardware computes an element
//   of an mma the same way whatever its row and column inside the m16n8 fragment, and that
//   the same SASS instruction (HMMA.16816.F32[.BF16]) runs for every configuration of one
//   architecture. Results may differ between architectures (different tensor cores).
// ---------------------------------------------------------------------------------------------
#pragma once

#include <climits>

#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "ptx.cuh"

namespace tpfuse {
namespace gemm {

// ---- Shared-memory layout -------------------------------------------------------------------

// The physical 16-byte chunk of logical chunk `chunk` in row `row` of a tile with kChunks
// chunks per row (BK = 8 * kChunks elements).
//   kChunks = 8 (128-byte rows): chunk ^ (row % 8). Eight consecutive rows at one logical
//     chunk land in 8 distinct chunk slots, i.e. 8 distinct groups of 4 banks.
//   kChunks = 4 (64-byte rows, two rows per 128 bytes): chunk ^ ((row / 2) % 4). Rows 2j and
//     2j+1 use the two halves of a 128-byte line, and the XOR spreads the 4 pairs of eight
//     consecutive rows over the 4 slots of each half: again 8 distinct bank groups.
// Tiles start at multiples of 16 rows, so the XOR term depends only on the row within the
// tile's 8-row group, i.e. on the lane (see the ldmatrix address setup in the kernel).
template <int kChunks> __host__ __device__ constexpr int swizzle_term(int row) {
  static_assert(kChunks == 4 || kChunks == 8, "BK must be 32 or 64");
  return kChunks == 8 ? (row & 7) : ((row >> 1) & 3);
}

// ---- Tile configurations --------------------------------------------------------------------

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, int MIN_BLOCKS, bool SPLITTABLE = true>
struct TileConfig {
  static constexpr int kBlockM = BM;
  static constexpr int kBlockN = BN;
  static constexpr int kBlockK = BK;
  static constexpr int kWarpsM = WARPS_M;
  static constexpr int kWarpsN = WARPS_N;
  static constexpr int kStages = STAGES;
  static constexpr int kMinBlocks = MIN_BLOCKS;
  // Whether the configuration runs a split of k (a second set of accumulators: the running
  // total of the parts). Tile128x128 does not: 64 more registers a thread would spill under
  // its launch bounds; gemm.cu never picks it for a split shape.
  static constexpr bool kSplittable = SPLITTABLE;
  static constexpr int kThreads = WARPS_M * WARPS_N * 32;
  static constexpr int kWarpM = BM / WARPS_M;  // rows of C per warp
  static constexpr int kWarpN = BN / WARPS_N;  // columns of C per warp
  static constexpr int kMTiles = kWarpM / 16;  // m16 fragments per warp
  static constexpr int kNTiles = kWarpN / 8;   // n8 fragments per warp
  static constexpr int kSteps = BK / 16;       // mma k-steps per k-slice
  static constexpr int kChunks = BK / 8;       // 16-byte chunks per shared row
  static constexpr int kRowBytes = BK * 2;
  static constexpr int kTileABytes = BM * kRowBytes;
  static constexpr int kTileBBytes = BN * kRowBytes;
  static constexpr int kStageBytes = kTileABytes + kTileBBytes;
  static constexpr int kPipeBytes = STAGES * kStageBytes;
  static constexpr int kOutPitch = BN + 4;  // floats per staged output row (see the epilogue)
  static constexpr int kOutBytes = BM * kOutPitch * 4;
  static constexpr int kSmemBytes = kPipeBytes > kOutBytes ? kPipeBytes : kOutBytes;
  static constexpr int kRowsPerPass = kThreads / kChunks;  // rows one cp.async pass covers
  static constexpr int kALoads = BM / kRowsPerPass;        // cp.async per thread per slice, A
  static constexpr int kBLoads = BN / kRowsPerPass;        // ... B
  static constexpr int kOutChunks = BM * BN / 8;
  static constexpr int kOutIters = kOutChunks / kThreads;

  static_assert(BM % WARPS_M == 0 && kWarpM % 16 == 0, "warp rows: a multiple of 16");
  static_assert(BN % WARPS_N == 0 && kWarpN % 16 == 0, "warp columns: a multiple of 16 (ldmatrix.x4 loads n16)");
  static_assert(BK == 32 || BK == 64, "BK: 32 or 64 (the swizzle)");
  static_assert(kThreads % kChunks == 0, "cp.async passes cover whole rows");
  static_assert(BM % kRowsPerPass == 0 && BN % kRowsPerPass == 0, "whole cp.async passes");
  static_assert(kOutChunks % kThreads == 0, "whole epilogue passes");
  static_assert(STAGES >= 2, "a pipeline needs two stages");
};

// Configurations, named for the kernel names in the ptxas report. gemm.cu maps them to the
// TPFUSE_GEMM_CONFIG_* ids and picks one per call.
//
// Small m (decode, m <= 16): one m16 row of fragments, warps spread across N, a deep
// pipeline so that each block keeps several KiB of its slice of B in flight. Each warp owns
// 16 columns (two independent n8 accumulator chains).
struct SmallM16x16 : TileConfig<16, 16, 64, 1, 1, 16, 1> {};  // 32 threads, 64 KiB
struct SmallM16x32 : TileConfig<16, 32, 64, 1, 2, 8, 1> {};   // 64 threads, 48 KiB
struct SmallM16x64 : TileConfig<16, 64, 64, 1, 4, 6, 1> {};   // 128 threads, 60 KiB
// Tiled (m > 16): 64x64 when 128x128 tiles would leave over 10% of the SMs idle. Tile64x64's
// k-slices are 32 deep: 64-deep slices (twice the weight bytes in flight per block, 96 KiB)
// were tried and measured on an H200 (docs/gpu-runs/2026-11-27-h200-suite): no faster at
// m = 64, and up to 1.7x slower from m = 1024 (two blocks per SM instead of three).
struct Tile64x64 : TileConfig<64, 64, 32, 2, 2, 6, 2> {};     // 128 threads, 48 KiB
struct Tile128x128 : TileConfig<128, 128, 32, 2, 4, 4, 2, false> {}; // 256 threads, 66 KiB, no split
// The fused kernels' Tile64x64 (gemm_all_reduce.cu, all_gather_gemm.cu): 64-deep k-slices, the
// same tiles and bits. Their persistent grids run one block per SM (all-gather + GEMM, by
// default) or two (GEMM + all-reduce, on an H100), so a block's bytes in flight are much of
// its SM's: on an H200, all-gather + GEMM at m = 64 took 1.06-1.08x the unfused sequence's
// time with 32-deep slices (docs/gpu-runs/2026-11-27-h200-bk32, -select) and 0.93x with these
// (-fused-deep, the unfused GEMM 32-deep). MIN_BLOCKS 1, as the fused kernels' own launch
// bounds (unused here).
struct FusedTile64x64 : TileConfig<64, 64, 64, 2, 2, 6, 1> {}; // 128 threads, 96 KiB

// The configuration a fused kernel runs for the configuration Cfg that tpfuse_gemm_select
// chose (the same tiles, so the same bits).
template <typename Cfg> struct Fused {
  using type = Cfg;
};
template <> struct Fused<Tile64x64> {
  using type = FusedTile64x64;
};

// Host: f(Cfg{}) for every configuration above (the kernel lists of kernel_list.cuh).
template <typename F> void for_each_config(F &&f) {
  f(SmallM16x16{});
  f(SmallM16x32{});
  f(SmallM16x64{});
  f(Tile64x64{});
  f(Tile128x128{});
}

// Host: f(Cfg{}) for the configuration of TPFUSE_GEMM_CONFIG_* id `config`, its result; or
// cudaErrorInvalidValue for any other id.
template <typename F> int visit_config(int32_t config, F &&f) {
  switch (config) {
  case TPFUSE_GEMM_CONFIG_SMALL_16X16: return f(SmallM16x16{});
  case TPFUSE_GEMM_CONFIG_SMALL_16X32: return f(SmallM16x32{});
  case TPFUSE_GEMM_CONFIG_SMALL_16X64: return f(SmallM16x64{});
  case TPFUSE_GEMM_CONFIG_TILE_64X64: return f(Tile64x64{});
  case TPFUSE_GEMM_CONFIG_TILE_128X128: return f(Tile128x128{});
  default: return cudaErrorInvalidValue;
  }
}

// Host: f(Fused<Cfg>::type{}) for every configuration above (the fused kernels' lists).
template <typename F> void for_each_fused_config(F &&f) {
  for_each_config([&](auto cfg) { f(typename Fused<decltype(cfg)>::type{}); });
}

// Host: opts `kernel` in to `bytes` of dynamic shared memory when that is more than the
// default 48 KiB. The attribute belongs to the function in the current context; it is set on
// every call rather than cached: a context can be destroyed and recreated under the same
// device (cudarc releases the primary context with its last handle), and the new one starts
// without it. Setting a function attribute is host-side work, no stream operation, so it is
// allowed during stream capture.
template <typename Kernel> cudaError_t allow_dynamic_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// ---- The kernel -----------------------------------------------------------------------------

// Block index -> tile, in groups of 8 tile rows: consecutive blocks walk down a group's rows
// before moving right, so the blocks in flight share rows of A and columns of B in L2.
__device__ __forceinline__ void tile_of_block(int block, int tiles_m, int tiles_n, int &tile_m, int &tile_n) {
  constexpr int kGroup = 8;
  const int per_group = kGroup * tiles_n;
  const int group = block / per_group;
  const int first = group * kGroup;
  const int rows = min(tiles_m - first, kGroup);
  const int within = block - group * per_group;
  tile_m = first + within % rows;
  tile_n = within / rows;
}

// One BM x BN tile of C = A · B^T, (tile_m, tile_n), through `epi`, by the whole block (A's rows
// from `a`, an ARows such as DenseRows), with
// `smem` (Cfg::kSmemBytes of dynamic shared memory). The block must not touch `smem` while a
// call runs; the call's last accesses to it are the epilogue's reads, so a block that runs
// another tile afterwards passes a __syncthreads first (the first thing a call does is write
// `smem`). m, n, k < 2^30; n and k multiples of 8; every pointer 16-byte aligned.
// Where the rows of A live: one [m, k] row-major matrix (row(r) is all gemm_tile asks of an
// ARows; all_gather_gemm.cu's is the rank's exchange area, where the ranks pushed their rows).
template <typename T> struct DenseRows {
  const T *a;
  int k;
  __device__ __forceinline__ const T *row(int r) const { return a + static_cast<size_t>(r) * static_cast<size_t>(k); }
};

// The parts of k (the batch-invariance contract above): a call computes parts [first, last)
// of `parts` and hands the epilogue their sum (chain_first + ... in ascending order).
struct KSplit {
  int parts; // S >= 1
  int first;
  int last;  // first < last <= parts
};

// The first k (a multiple of 64) of part p of `parts`; part_begin(k, parts, parts) >= k.
// Parts are never empty when parts <= ceil(k / 64) (gemm.cu keeps it so).
__host__ __device__ __forceinline__ int part_begin(int k, int parts, int p) {
  const long long k64 = (k + 63) / 64;
  return static_cast<int>(64 * (k64 * p / parts));
}

template <typename T, typename Cfg, typename ARows, typename Epi>
__device__ __forceinline__ void gemm_tile(const ARows &a, const T *__restrict__ b, int m, int n, int k, int tile_m,
                                          int tile_n, const Epi &epi, unsigned char *smem,
                                          const KSplit split = KSplit{1, 0, 1}) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, BK = Cfg::kBlockK, STAGES = Cfg::kStages;
  constexpr int MT = Cfg::kMTiles, NT = Cfg::kNTiles;
  const int m0 = tile_m * BM;
  const int n0 = tile_n * BN;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int warp_m = warp / Cfg::kWarpsN;
  const int warp_n = warp % Cfg::kWarpsN;
  const uint32_t smem_base = smem_u32(smem);

  // ---- cp.async assignment: thread tid copies chunk tid % kChunks of rows
  // tid / kChunks + i * kRowsPerPass, for A (kALoads rows) and B (kBLoads rows).
  const int chunk = tid % Cfg::kChunks;
  const int row0 = tid / Cfg::kChunks;
  const T *a_src[Cfg::kALoads];
  uint32_t a_dst[Cfg::kALoads];
  bool a_live[Cfg::kALoads];
#pragma unroll
  for (int i = 0; i < Cfg::kALoads; ++i) {
    const int r = row0 + i * Cfg::kRowsPerPass;
    a_live[i] = m0 + r < m;
    a_src[i] = a_live[i] ? a.row(m0 + r) + chunk * 8 : a.row(0);
    a_dst[i] = r * Cfg::kRowBytes + ((chunk ^ swizzle_term<Cfg::kChunks>(r)) << 4);
  }
  const T *b_src[Cfg::kBLoads];
  uint32_t b_dst[Cfg::kBLoads];
  bool b_live[Cfg::kBLoads];
#pragma unroll
  for (int i = 0; i < Cfg::kBLoads; ++i) {
    const int r = row0 + i * Cfg::kRowsPerPass;
    b_live[i] = n0 + r < n;
    b_src[i] = b + (b_live[i] ? static_cast<size_t>(n0 + r) * k + chunk * 8 : 0);
    b_dst[i] = Cfg::kTileABytes + r * Cfg::kRowBytes + ((chunk ^ swizzle_term<Cfg::kChunks>(r)) << 4);
  }

  // Rows past m or n: zero in every stage, once; they are never loaded, so they stay zero.
#pragma unroll
  for (int s = 0; s < STAGES; ++s) {
#pragma unroll
    for (int i = 0; i < Cfg::kALoads; ++i)
      if (!a_live[i]) zero_16(smem_base + s * Cfg::kStageBytes + a_dst[i]);
#pragma unroll
    for (int i = 0; i < Cfg::kBLoads; ++i)
      if (!b_live[i]) zero_16(smem_base + s * Cfg::kStageBytes + b_dst[i]);
  }

  // Copies k-slice `slice` into stage `stage`. A chunk past k is zero-filled: its source is
  // the chunk's place in the row's first k-slice (a valid address; with src-size 0 nothing
  // is read).
  auto load_slice = [&](int stage, int slice) {
    const int k0 = slice * BK;
    const bool k_live = k0 + chunk * 8 < k;
    const int k_off = k_live ? k0 : 0;
    const uint32_t base = smem_base + stage * Cfg::kStageBytes;
#pragma unroll
    for (int i = 0; i < Cfg::kALoads; ++i)
      if (a_live[i]) cp_async_16(base + a_dst[i], a_src[i] + k_off, k_live);
#pragma unroll
    for (int i = 0; i < Cfg::kBLoads; ++i)
      if (b_live[i]) cp_async_16(base + b_dst[i], b_src[i] + k_off, k_live);
  };

  // ---- ldmatrix addresses (offsets inside a stage; step s XORs 2s into the chunk).
  // A, m16 fragment i: lanes 0-15 give rows 0-15 at the step's first 8 k, lanes 16-31 the same
  // rows at the next 8 k: registers = a0..a3 of mma's A fragment.
  const int a_row = warp_m * Cfg::kWarpM + (lane & 15);
  const int a_xor = (lane >> 4) ^ swizzle_term<Cfg::kChunks>(lane & 15);
  const uint32_t a_frag_base = a_row * Cfg::kRowBytes;
  // B, n16 pair p (fragments 2p, 2p+1): lanes 0-7 rows n 0-7 / first 8 k, lanes 8-15 rows 0-7 /
  // next 8 k, lanes 16-23 rows 8-15 / first 8 k, lanes 24-31 rows 8-15 / next 8 k: registers
  // = b0, b1 of fragment 2p, then b0, b1 of fragment 2p+1.
  const int b_lane_row = (lane & 7) + ((lane >> 4) << 3);
  const int b_row = warp_n * Cfg::kWarpN + b_lane_row;
  const int b_xor = ((lane >> 3) & 1) ^ swizzle_term<Cfg::kChunks>(b_lane_row);
  const uint32_t b_frag_base = Cfg::kTileABytes + b_row * Cfg::kRowBytes;

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
  // The running total of the parts finished so far (splittable configurations only).
  constexpr int TM = Cfg::kSplittable ? MT : 1, TN = Cfg::kSplittable ? NT : 1;
  float total[TM][TN][4];
  // A part ends: total = chain (the call's first part) or total + chain, then a new chain
  // from +0.0.
  auto end_part = [&](bool first_part) {
    if constexpr (Cfg::kSplittable) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            total[i][j][q] = first_part ? acc[i][j][q] : total[i][j][q] + acc[i][j][q];
            acc[i][j][q] = 0.0f;
          }
    }
  };

  // The first `steps` k16-steps of the slice in `stage`, in ascending k.
  auto multiply_slice = [&](int stage, int steps) {
    const uint32_t base = smem_base + stage * Cfg::kStageBytes;
#pragma unroll
    for (int s = 0; s < Cfg::kSteps; ++s) {
      if (s < steps) {
        uint32_t af[MT][4];
        uint32_t bf[NT][2];
        const uint32_t a_chunk = static_cast<uint32_t>((2 * s) ^ a_xor) << 4;
        const uint32_t b_chunk = static_cast<uint32_t>((2 * s) ^ b_xor) << 4;
#pragma unroll
        for (int i = 0; i < MT; ++i)
          ldmatrix_x4(base + a_frag_base + i * 16 * Cfg::kRowBytes + a_chunk, af[i][0], af[i][1], af[i][2],
                      af[i][3]);
#pragma unroll
        for (int p = 0; p < NT / 2; ++p)
          ldmatrix_x4(base + b_frag_base + p * 16 * Cfg::kRowBytes + b_chunk, bf[2 * p][0], bf[2 * p][1],
                      bf[2 * p + 1][0], bf[2 * p + 1][1]);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int j = 0; j < NT; ++j) Mma<T>::run(acc[i][j], af[i], bf[j]);
      }
    }
  };

  // ---- The pipeline. Before iteration t, slices 0 .. t+STAGES-2 have been issued, one
  // commit group each (empty groups past the end keep the count uniform), so waiting until
  // STAGES-2 groups are pending means slice t has landed for this thread; the barrier makes
  // it visible to every warp and guarantees that every warp has finished slice t-1, whose
  // stage the copy issued next (slice t+STAGES-1) overwrites.
  // The call's k: [k_begin, k_end), whole k-slices from slice `first_slice` on. A part's
  // boundary slice: the slice a part after the first starts with.
  const int k_begin = part_begin(k, split.parts, split.first);
  const int k_end = min(part_begin(k, split.parts, split.last), k);
  const int first_slice = k_begin / BK;
  const int slices = (k_end - k_begin + BK - 1) / BK;
  const int last_steps = (k_end - (first_slice + slices - 1) * BK + 15) / 16;
  int next_part = split.first + 1; // the part whose first slice comes next
  int boundary = next_part < split.last ? part_begin(k, split.parts, next_part) / BK : INT_MAX;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < slices) load_slice(s, first_slice + s);
    cp_async_commit();
  }
  int read_stage = 0;
  int write_stage = STAGES - 1;
  // Every slice but the last runs all its k16-steps (a constant count: no branch between the
  // steps, so the compiler can overlap one step's ldmatrix with the previous step's mma).
  for (int t = 0; t + 1 < slices; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (t + STAGES - 1 < slices) load_slice(write_stage, first_slice + t + STAGES - 1);
    cp_async_commit();
    multiply_slice(read_stage, Cfg::kSteps);
    if (first_slice + t + 1 == boundary) { // slice t ended part next_part - 1
      end_part(next_part - 1 == split.first);
      ++next_part;
      boundary = next_part < split.last ? part_begin(k, split.parts, next_part) / BK : INT_MAX;
    }
    read_stage = read_stage + 1 == STAGES ? 0 : read_stage + 1;
    write_stage = write_stage + 1 == STAGES ? 0 : write_stage + 1;
  }
  // The last slice: only the steps that start before k_end (nothing is left to load).
  cp_async_wait<0>();
  __syncthreads();
  multiply_slice(read_stage, last_steps);
  // Several parts: the sum is total + the last chain.
  if constexpr (Cfg::kSplittable) {
    if (split.last - split.first > 1) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[i][j][q] = total[i][j][q] + acc[i][j][q];
    }
  }
  __syncthreads();  // every warp is done with the stages: reuse them for the output

  // ---- Epilogue. Fragment element q of acc[i][j] is (row g + 8*(q/2), column 2*t4 + q%2) of
  // the warp's m16n8 fragment (i, j), g = lane/4, t4 = lane%4. Stage as f32 rows of
  // kOutPitch = BN + 4 floats: the float2 writes of a warp then take the minimum two
  // wavefronts.
  float *out = reinterpret_cast<float *>(smem);
  {
    const int g = lane >> 2;
    const int t4 = lane & 3;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const int r = warp_m * Cfg::kWarpM + i * 16 + g;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int c = warp_n * Cfg::kWarpN + j * 8 + 2 * t4;
        *reinterpret_cast<float2 *>(out + r * Cfg::kOutPitch + c) = make_float2(acc[i][j][0], acc[i][j][1]);
        *reinterpret_cast<float2 *>(out + (r + 8) * Cfg::kOutPitch + c) = make_float2(acc[i][j][2], acc[i][j][3]);
      }
    }
  }
  __syncthreads();
  // Each thread takes runs of 8 columns. The two float4 halves of a run are read in an order
  // that alternates every 4 runs, so that the 8 threads of a phase read 8 distinct bank groups.
  constexpr int kRuns = BN / 8;
#pragma unroll
  for (int it = 0; it < Cfg::kOutIters; ++it) {
    const int idx = tid + it * Cfg::kThreads;
    const int r = idx / kRuns;
    const int run = idx % kRuns;
    const int row = m0 + r;
    const int col = n0 + run * 8;
    if (row < m && col < n) {
      const float *src = out + r * Cfg::kOutPitch + run * 8;
      const int first = (run >> 2) & 1;
      const float4 x = *reinterpret_cast<const float4 *>(src + 4 * first);
      const float4 y = *reinterpret_cast<const float4 *>(src + 4 * (first ^ 1));
      const float4 lo = first ? y : x;
      const float4 hi = first ? x : y;
      const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      epi.store8(row, col, v);
    }
  }
}

// C = A · B^T through `epi`, one tile per block, k in `parts` parts one after another (1 for
// a configuration that is not kSplittable). m, n, k < 2^30; n and k multiples of 8;
// every pointer 16-byte aligned; grid = tiles_m * tiles_n blocks of Cfg::kThreads,
// Cfg::kSmemBytes of dynamic shared memory.
template <typename T, typename Cfg, typename Epi>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    gemm_sm80_kernel(const T *__restrict__ a, const T *__restrict__ b, int m, int n, int k, int tiles_m,
                     int tiles_n, int parts, const Epi epi) {
  TPFUSE_DYNAMIC_SHARED(smem);
  int tile_m, tile_n;
  tile_of_block(blockIdx.x, tiles_m, tiles_n, tile_m, tile_n);
  gemm_tile<T, Cfg>(DenseRows<T>{a, k}, b, m, n, k, tile_m, tile_n, epi, smem, KSplit{parts, 0, parts});
}

} // namespace gemm
} // namespace tpfuse
