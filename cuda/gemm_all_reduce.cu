// gemm_all_reduce.cu: the row-parallel layer's GEMM, its all-reduce and its epilogue (+ bias,
// + residual written back, RMSNorm) in one launch per rank (tpfuse.h, tpfuse_gemm_all_reduce);
// and GEMM + reduce-scatter, the same kernel where each rank reduces only its slice of the
// rows (tpfuse_gemm_reduce_scatter). docs/fused-gemm.md explains the design and its numbers;
// this is the protocol.
//
// Work. The output [m, n] is cut into the GEMM configuration's tiles, numbered in
// tile_of_block's order. Every rank runs a persistent grid of G blocks (G = min(tiles,
// blocks)); block b owns tiles b, b + G, b + 2G, ... on every rank, and for its i-th tile:
//
//   produce t_i   gemm_tile computes this rank's partial x·wᵀ of the tile and stores it,
//                 rounded to T (as tpfuse_gemm rounds it), into this rank's exchange area;
//                 __syncthreads; thread p (p < W) stores the tile's flag (the launch's epoch
//                 and descriptor) into tile_flags[t_i][rank] of rank p's pad with st.release.sys
//                 (everything the block stored before the __syncthreads is visible, at system
//                 scope, to whoever acquires that flag: the pattern of barrier.cuh);
//   consume t_i-1 thread q (q < W) waits until tile_flags[t_i-1][q] of this rank's pad holds
//                 this launch's epoch or the next one (ld.relaxed.sys spin, then one
//                 ld.acquire.sys), __syncthreads, then the block adds the W ranks' partials
//                 of the tile in rank order in f32 and applies the epilogue (reduce.cuh:
//                 the one-shot all-reduce's arithmetic, so its bits).
//
// and consumes its last tile at the end. So a tile's reduction starts as soon as the
// corresponding blocks of every rank have produced it, while they compute their next tile.
// The reduce-scatter consumes only the tiles that hold rows of the rank's slice, and only
// those rows (it waits for nothing else).
//
// No deadlock: block b waits only for block b of the other ranks, for a tile that block
// produces before it waits for anything (t_i is published before t_i-1 is awaited, and
// t_i-1 was published before t_i-2 was awaited, ...). So the waits follow the tile order and
// no cycle can form, provided block b of every rank runs: G never exceeds `blocks`, which the
// host keeps within what the device holds at once (for virtual ranks, divided among the
// ranks that share it). Within a rank no block ever waits for another.
//
// Epochs. fused_epoch (this rank's pad, 64 bits) counts this rank's fused launches; every
// block reads it when it starts and uses E = fused_epoch + 1. The block that ends last
// (fused_done, an atom.acq_rel counter: every block adds 1 once it is done, after it read the
// epoch) stores E and sets the counter back to 0. A rank's fused launches run one after the
// other (one stream, or the edges of a graph; no programmatic dependent launch), and every
// rank makes the same fused launches, so every rank uses the same E. Nothing is reset, and a
// replayed CUDA graph works.
// A flag is E's low 40 bits << 24 | the descriptor's low 24 bits (kind, sizes, configuration,
// grid, epilogue, eps). A producer is at most one launch ahead of a consumer (to start E+2 it
// must have seen the consumer's flags of E+1), so a consumer in launch E accepts exactly the
// epochs E and E+1 (mod 2^40): a flag of any older launch, however old (a tile index unused
// for a long time keeps its flag), is not ready. A flag of E with another descriptor is
// TPFUSE_ERROR_PEER_MISMATCH (the ranks launched different things) instead of wrong data. A
// flag of E+1 means the producer finished launch E, which needed our flags of E, checked
// against its descriptor (a mismatch would have poisoned it before it made E+1 flags): it is
// accepted as is. 2^40 launches, at 10^4 a second, are three years.
//
// Exchange areas. Launch E writes the half (E & 1) of the result half of this rank's
// symmetric buffer (offset capacity + (E & 1) * capacity / 2). When a rank starts launch E+2,
// which rewrites that area, it has finished launch E+1, so it has seen every peer's flags of
// launch E+1 (for every tile; the reduce-scatter for the tiles of its rows, at least one,
// from every peer), so every peer had finished launch E (stream order), reads of the area
// included. No closing barrier is needed. The other custom kernels stage in the staging
// half and write their result half only after their first barrier (when every peer is in
// that launch, hence done with this one), and end with a closing barrier, so they and this
// kernel never overlap on an area either. (Both rest on the sticky error word: after a
// failure no launch of the group produces anything.)
//
// RMSNorm. It needs whole rows, and a tile covers part of a row. After a block reduced a tile
// of row strip s (the tile's BM rows), thread 0 adds 1 to strip_counts[s] (atom.acq_rel.gpu:
// the release of the block's stores, ordered by __syncthreads; the adds of one counter form
// a release sequence, so the last adder acquires every earlier tile's stores). The block that
// brings the count to the strip's tile count normalises the strip's rows (rms_norm_row:
// the standalone kernel's order, so the bits do not depend on which block does it) and sets
// the count back to 0.
//
// Failures. A wait ends at the launch's deadline (barrier.cuh, Deadline: from the block's
// start, so it covers the block's whole share of the GEMM too) or when the rank's
// error word is set; a missing rank is TPFUSE_ERROR_PEER_TIMEOUT | peer, reported to every
// rank. A block that fails, or finds the group poisoned when it starts, stops producing and
// consuming. The block that ends last reads the error word: when it is set, it marks every
// element of out and residual failed (failure.cuh) and copies the word to the host, after
// every block of the rank has ended (the done counter orders their stores before), so no
// partial result survives.

#include <cstring>

#include "barrier.cuh"
#include "gemm_sm80.cuh"
#include "reduce.cuh"

namespace tpfuse {
namespace {

using gemm::gemm_tile;
using gemm::tile_of_block;

// Rows [first, end).
struct Range2 {
  int first, end;
};

// The GEMM's epilogue here: the tile's partial, rounded once to T (GemmEpilogue without bias
// or residual: the same bits as the unfused GEMM's output), into the exchange area.
template <typename T> struct StagingEpilogue {
  T *exchange; // [m, n] row-major
  int n;

  __device__ __forceinline__ void store8(int row, int col, const float (&acc)[8]) const {
    Vec16<T> out;
#pragma unroll
    for (int j = 0; j < 8; ++j) out.v[j] = Elem<T>::from_f32(acc[j]);
    store16(exchange + static_cast<size_t>(row) * static_cast<size_t>(n) + static_cast<size_t>(col), out);
  }
};

// A tile flag: the epoch's low 40 bits, then the descriptor's low 24 bits.
constexpr int kDescriptorBits = 24;
constexpr uint64_t kDescriptorMask = (uint64_t{1} << kDescriptorBits) - 1;
constexpr uint64_t kEpochMask = (uint64_t{1} << (64 - kDescriptorBits)) - 1;

// What every block of a launch shares.
template <typename T> struct Launch {
  const tpfuse_peers &peers;
  const tpfuse_group_args &g;
  const T *x, *w, *bias, *gamma;
  T *residual, *out;
  float eps;
  int m, n, k, tiles_m, tiles_n;
  // The rows this rank reduces into out (row row_begin is out's first): all of them for the
  // all-reduce, the rank's slice for the reduce-scatter.
  int row_begin, row_end;
  uint64_t descriptor; // the launch descriptor's low kDescriptorBits
};

// The block's state, in shared memory: one decision for all its threads.
struct BlockState {
  uint64_t epoch;  // E
  int failed;      // nonzero once the block gave up (or the group was poisoned at its start)
  int last;        // scratch for "this block was the last" decisions
};

// Thread q (< world) waits for tile t's flag from rank q; false when the block gave up.
template <typename T>
__device__ __forceinline__ bool wait_for_tile(const Launch<T> &L, const Deadline &deadline, BlockState &st,
                                              int tile) {
  const Pad own{L.peers.signals[L.g.rank]};
  const int q = threadIdx.x;
  if (q < L.g.world) {
    const uint64_t *flag = own.tile_flag(tile, q);
    bool arrived = true;
    // The flag's launch, relative to this one: 0 (this launch), 1 (the next), else older.
    const auto ahead = [&](uint64_t v) { return ((v >> kDescriptorBits) - st.epoch) & kEpochMask; };
    const auto ready = [&](uint64_t v) { return ahead(v) <= 1; };
    for (uint32_t spins = 0; !ready(ld_relaxed_sys(flag)); ++spins) {
      if ((spins & 1023u) != 1023u) continue;
      if (ld_relaxed_sys(own.error()) != 0 || deadline.expired()) {
        arrived = false;
        break;
      }
    }
    if (arrived) {
      const uint64_t v = ld_acquire_sys(flag); // the acquire: orders the tile's loads below
      if (ahead(v) == 0 && (v & kDescriptorMask) != L.descriptor) {
        report_failure(L.peers, L.g,
                       TPFUSE_ERROR_PEER_MISMATCH | static_cast<uint32_t>(q) | static_cast<uint32_t>(L.g.rank) << 16);
        atomicAdd(&st.failed, 1);
      }
    } else {
      if (ld_relaxed_sys(own.error()) == 0) report_failure(L.peers, L.g, TPFUSE_ERROR_PEER_TIMEOUT | static_cast<uint32_t>(q));
      atomicAdd(&st.failed, 1);
    }
  }
  __syncthreads();
  const bool passed = st.failed == 0;
  if (passed && threadIdx.x == 0) note_barrier_passed(); // the counters' synchronisation rounds
  return passed;
}

// The rows of tile row tm that this rank reduces: [first, end), empty when none.
template <typename T, int BM> __device__ __forceinline__ Range2 rows_to_reduce(const Launch<T> &L, int tm) {
  return Range2{max(tm * BM, L.row_begin), min(min((tm + 1) * BM, L.m), L.row_end)};
}

// out (and residual) of this rank's rows of tile (tm, tn): the W ranks' partials in the
// exchange areas (element offset `exchange`, laid out [m, n]), added in rank order, through
// the epilogue, in 16-byte vectors. One code path for every world (reduce_vector's predicated
// form): an instantiation per world, inlined side by side, pushed the kernel past 255
// registers into spills.
template <typename T, int BM, int BN>
__device__ __forceinline__ void reduce_tile(const Launch<T> &L, size_t exchange, int tm, int tn) {
  constexpr int kVec = Vec16<T>::kLen;
  const Range2 rows = rows_to_reduce<T, BM>(L, tm);
  const int n0 = tn * BN;
  const int runs = min(BN, L.n - n0) / kVec; // n and n0 are multiples of 8 = kVec
  const Epilogue<T> epi{L.bias, L.residual, static_cast<size_t>(L.n)};
  // Element i of out (and of the residual) is element i + row_begin·n of the exchange areas.
  const size_t shifted = exchange + static_cast<size_t>(L.row_begin) * L.n;
#pragma unroll 1 // one vector's loads in flight per thread: the registers stay few
  for (int u = threadIdx.x; u < (rows.end - rows.first) * runs; u += blockDim.x) {
    const size_t i = static_cast<size_t>(rows.first - L.row_begin + u / runs) * L.n + n0 + (u % runs) * kVec;
    store16(L.out + i, reduce_vector<T, TPFUSE_MAX_RANKS>(L.peers, L.g.world, shifted, i, epi));
  }
}

// Consumes tile `tile`: waits for every rank's partial, reduces it, and with RMSNorm, when it
// completes its strip, normalises the strip's rows. False when the block gave up.
template <typename T, typename Cfg>
__device__ __forceinline__ bool consume(const Launch<T> &L, const Deadline &deadline, BlockState &st,
                                        size_t exchange, int tile) {
  int tm, tn;
  tile_of_block(tile, L.tiles_m, L.tiles_n, tm, tn);
  const Range2 rows = rows_to_reduce<T, Cfg::kBlockM>(L, tm);
  if (rows.first >= rows.end) return true; // another rank's rows (reduce-scatter): no wait
  if (!wait_for_tile(L, deadline, st, tile)) return false;
  reduce_tile<T, Cfg::kBlockM, Cfg::kBlockN>(L, exchange, tm, tn);
  if (L.gamma == nullptr) return true;
  __syncthreads(); // the tile's stores, before thread 0's release
  if (threadIdx.x == 0) {
    uint32_t *count = Pad{L.peers.signals[L.g.rank]}.strip_count(tm);
    st.last = atomic_add_acq_rel_gpu(count, 1u) + 1u == static_cast<uint32_t>(L.tiles_n);
    if (st.last) *count = 0; // no other block of this launch adds to it again
  }
  __syncthreads(); // the whole block after thread 0's acquire
  if (st.last) {
    const int row_end = min(L.m, (tm + 1) * Cfg::kBlockM);
    for (int row = tm * Cfg::kBlockM; row < row_end; ++row) {
      T *h = L.out + static_cast<size_t>(row) * L.n;
      rms_norm_row(h, L.gamma, L.eps, h, static_cast<size_t>(L.n));
    }
  }
  return true;
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gemm_all_reduce_kernel(const __grid_constant__ tpfuse_peers peers,
                                                                          const __grid_constant__ tpfuse_group_args g,
                                                                          uint64_t descriptor, const T *x, const T *w,
                                                                          const T *bias, T *residual, const T *gamma,
                                                                          float eps, T *out, int m, int n, int k,
                                                                          int tiles_m, int tiles_n, int row_begin,
                                                                          int row_end) {
  TPFUSE_DYNAMIC_SHARED(smem);
  TPFUSE_SHARED(BlockState, st);
  const Launch<T> L{peers,   g,       x,       w,         bias,      gamma,   residual, out,       eps,
                    m,       n,       k,       tiles_m,   tiles_n,   row_begin, row_end, descriptor};
  const Pad own{peers.signals[g.rank]};
  const Deadline deadline(g);
  if (threadIdx.x == 0) {
    // fused_epoch changes only when every block of this launch has read it (see above).
    st.epoch = *own.fused_epoch() + 1;
    st.failed = ld_relaxed_sys(own.error()) != 0 ? 1 : 0;
  }
  __syncthreads();
  const uint64_t epoch = st.epoch;
  const size_t exchange_bytes = g.capacity + (epoch & 1u) * (g.capacity / 2);
  T *mine = reinterpret_cast<T *>(static_cast<char *>(peers.data[g.rank]) + exchange_bytes);
  const StagingEpilogue<T> staging{mine, n};
  const size_t exchange = exchange_bytes / sizeof(T);
  const uint64_t flag_value = (epoch & kEpochMask) << kDescriptorBits | descriptor;

  const int tiles = tiles_m * tiles_n;
  int previous = -1;
#pragma unroll 1
  for (int tile = blockIdx.x; tile < tiles && st.failed == 0; tile += gridDim.x) {
    int tm, tn;
    tile_of_block(tile, tiles_m, tiles_n, tm, tn);
    gemm_tile<T, Cfg>(x, w, m, n, k, tm, tn, staging, smem);
    __syncthreads(); // the tile's stores (and the epilogue's reads of smem), before the flags
    if (threadIdx.x < g.world) st_release_sys(Pad{peers.signals[threadIdx.x]}.tile_flag(tile, g.rank), flag_value);
    if (previous >= 0 && !consume<T, Cfg>(L, deadline, st, exchange, previous)) break;
    previous = tile;
  }
  if (previous >= 0 && st.failed == 0) consume<T, Cfg>(L, deadline, st, exchange, previous);

  // The end: the last block to get here advances the epoch and, when the launch failed on
  // this rank or anywhere, marks every output failed.
  __syncthreads();
  if (threadIdx.x == 0) {
    st.last = atomic_add_acq_rel_gpu(own.fused_done(), 1u) + 1u == gridDim.x;
    if (st.last) {
      *own.fused_done() = 0;
      *own.fused_epoch() = epoch;
      st.failed = ld_relaxed_sys(own.error()) != 0 ? 1 : 0;
      if (st.failed) publish_error_to_host(peers, g);
    }
  }
  __syncthreads();
  if (st.last && st.failed) {
    const size_t len = static_cast<size_t>(row_end - row_begin) * n;
    mark_failed(out, 0, len);
    mark_failed(residual, 0, len);
  }
}

// The kinds of launch a descriptor tells apart (all_reduce.cu's are 1..9).
constexpr uint64_t kKindGemmAllReduce = 16;
constexpr uint64_t kKindGemmReduceScatter = 17;

// What a launch reduces: all of out (all-reduce), or this rank's slice of m / world rows.
struct Reduction {
  uint64_t kind;
  bool scatter;
};

template <typename T, typename Cfg>
int launch_config(Reduction reduction, const tpfuse_peers &peers, const tpfuse_group_args &g, int config,
                  int blocks, const T *x, const T *w, const T *bias, T *residual, const T *gamma, float eps, T *out,
                  int m, int n, int k, cudaStream_t stream) {
  const long long tiles_m = (m + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const long long tiles_n = (n + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if (tiles_m * tiles_n > TPFUSE_MAX_FUSED_TILES) return cudaErrorInvalidValue;
  const int grid = static_cast<int>(tiles_m * tiles_n < blocks ? tiles_m * tiles_n : blocks);
  auto kernel = gemm_all_reduce_kernel<T, Cfg>;
  // Always opted in (not only past 48 KiB, as gemm.cu does): the kernel's static shared
  // memory (BlockState, the RMSNorm's warp sums) counts with the dynamic size toward the
  // default 48 KiB, and two configurations take exactly 48 KiB of dynamic shared memory.
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  uint32_t eps_bits;
  std::memcpy(&eps_bits, &eps, sizeof eps_bits);
  const uint64_t descriptor =
      launch_descriptor({reduction.kind, sizeof(T), static_cast<uint64_t>(m), static_cast<uint64_t>(n),
                         static_cast<uint64_t>(k), static_cast<uint64_t>(config), static_cast<uint64_t>(grid),
                         bias != nullptr, residual != nullptr, gamma != nullptr, eps_bits}) &
      kDescriptorMask;
  const int slice = m / g.world;
  const int row_begin = reduction.scatter ? g.rank * slice : 0;
  const int row_end = reduction.scatter ? row_begin + slice : m;
  TPFUSE_LAUNCH(kernel, grid, Cfg::kThreads, Cfg::kSmemBytes, stream)(
      peers, g, descriptor, x, w, bias, residual, gamma, eps, out, m, n, k, static_cast<int>(tiles_m),
      static_cast<int>(tiles_n), row_begin, row_end);
  return cudaGetLastError();
}

template <typename T>
int launch(Reduction reduction, int config, const tpfuse_peers &peers, const tpfuse_group_args &g, int blocks, const void *x,
           const void *w, const void *bias, void *residual, const void *gamma, float eps, void *out, int m, int n,
           int k, cudaStream_t s) {
  const T *tx = static_cast<const T *>(x);
  const T *tw = static_cast<const T *>(w);
  const T *tb = static_cast<const T *>(bias);
  T *tr = static_cast<T *>(residual);
  const T *tg = static_cast<const T *>(gamma);
  T *to = static_cast<T *>(out);
  using namespace gemm;
  switch (config) {
  case TPFUSE_GEMM_CONFIG_SMALL_16X16:
    return launch_config<T, SmallM16x16>(reduction, peers, g, config, blocks, tx, tw, tb, tr, tg, eps, to, m, n, k, s);
  case TPFUSE_GEMM_CONFIG_SMALL_16X32:
    return launch_config<T, SmallM16x32>(reduction, peers, g, config, blocks, tx, tw, tb, tr, tg, eps, to, m, n, k, s);
  case TPFUSE_GEMM_CONFIG_SMALL_16X64:
    return launch_config<T, SmallM16x64>(reduction, peers, g, config, blocks, tx, tw, tb, tr, tg, eps, to, m, n, k, s);
  case TPFUSE_GEMM_CONFIG_TILE_64X64:
    return launch_config<T, Tile64x64>(reduction, peers, g, config, blocks, tx, tw, tb, tr, tg, eps, to, m, n, k, s);
  case TPFUSE_GEMM_CONFIG_TILE_128X128:
    return launch_config<T, Tile128x128>(reduction, peers, g, config, blocks, tx, tw, tb, tr, tg, eps, to, m, n, k, s);
  default: return cudaErrorInvalidValue;
  }
}

constexpr size_t kMaxDim = size_t{1} << 30;

// The checks both entry points share, then the launch.
int checked_launch(Reduction reduction, tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                   const tpfuse_group_args *group, int32_t blocks, const void *x, const void *w, const void *bias,
                   void *residual, const void *gamma, float eps, void *out, size_t m, size_t n, size_t k,
                   void *stream) {
  if (peers == nullptr || group == nullptr || group->world < 2 || group->world > TPFUSE_MAX_RANKS ||
      group->rank < 0 || group->rank >= group->world || blocks < 1) {
    return cudaErrorInvalidValue;
  }
  if (m == 0 || n == 0 || k == 0 || n % 8 != 0 || k % 8 != 0 || m > kMaxDim || n > kMaxDim || k > kMaxDim)
    return cudaErrorInvalidValue;
  if (reduction.scatter && m % static_cast<size_t>(group->world) != 0) return cudaErrorInvalidValue;
  if (x == nullptr || w == nullptr || out == nullptr) return cudaErrorInvalidValue;
  // The two exchange areas: halves of the result half, each 16-byte aligned.
  if (group->capacity % 32 != 0 || m * n * dtype_size(dtype) > group->capacity / 2) return cudaErrorInvalidValue;
  for (const void *p : {x, w, bias, gamma, static_cast<const void *>(residual), static_cast<const void *>(out)})
    if (!is_aligned16(p)) return cudaErrorMisalignedAddress;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  switch (dtype) {
  case TPFUSE_DTYPE_F16:
    return launch<__half>(reduction, config, *peers, *group, blocks, x, w, bias, residual, gamma, eps, out, im, in,
                          ik, s);
  case TPFUSE_DTYPE_BF16:
    return launch<__nv_bfloat16>(reduction, config, *peers, *group, blocks, x, w, bias, residual, gamma, eps, out,
                                 im, in, ik, s);
  default: return cudaErrorInvalidValue;
  }
}

} // namespace
} // namespace tpfuse

extern "C" int tpfuse_gemm_all_reduce(tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                                      const tpfuse_group_args *group, int32_t blocks, const void *x, const void *w,
                                      const void *bias, void *residual, const void *gamma, float eps, void *out,
                                      size_t m, size_t n, size_t k, void *stream) {
  using namespace tpfuse;
  return checked_launch(Reduction{kKindGemmAllReduce, false}, dtype, config, peers, group, blocks, x, w, bias,
                        residual, gamma, eps, out, m, n, k, stream);
}

extern "C" int tpfuse_gemm_reduce_scatter(tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                                          const tpfuse_group_args *group, int32_t blocks, const void *x,
                                          const void *w, void *out, size_t m, size_t n, size_t k, void *stream) {
  using namespace tpfuse;
  return checked_launch(Reduction{kKindGemmReduceScatter, true}, dtype, config, peers, group, blocks, x, w, nullptr,
                        nullptr, nullptr, 0.f, out, m, n, k, stream);
}
