// all_gather_gemm.cu: all-gather + GEMM (Megatron sequence parallelism) in one launch per rank
// (tpfuse.h, tpfuse_all_gather_gemm): out [m, n] = all_gather(x) · w^T (+ bias), where rank r
// holds rows r·m/W .. (r+1)·m/W of the input (x_r [m/W, k]) and its weight shard w [n, k]. The
// bits of tpfuse_all_gather followed by tpfuse_gemm: the GEMM reads the same rows and runs the
// same tiles and epilogue.
//
// Protocol (the flags, epochs, exchange areas and failures are fused_flags.cuh's):
//
//   push     block b copies its part of x_r (an even share of its 16-byte vectors) into every
//            rank's exchange area, at this rank's rows (so each rank's area gathers the whole
//            input [m, k], each part crossing a link once), __syncthreads, and counts it in
//            this rank's gather_count; the block whose add completes the count (all G parts
//            pushed) publishes this rank's gather flag to every rank;
//   compute  for each of its tiles t = b, b + G, ...: thread p waits for rank p's gather flag,
//            for every rank p whose rows the tile needs (one flag a rank, where it used to be G
//            part flags; ranks already complete for this block are skipped), __syncthreads,
//            then gemm_tile reads A's rows from this rank's own exchange area (local memory,
//            however many column tiles read them) and the epilogue writes out (+ bias).
//
// The split of k in parallel (S parts, tpfuse_gemm's; tpfuse.h says when): the grid's units are
// then the parts of the tiles, unit u = part u / tiles of tile u % tiles, block b computing
// units b, b + G, ... (so a narrow layer's weight streams on tiles x S blocks, not on its
// tiles' few). A unit waits for its tile's ranks as a tile does, stores its part's f32 chains
// into this rank's staging half, and the parts are folded in order, the block that folds the
// last one writing out (+ bias): fused_split.cuh, gemm_split.cuh (the protocol and the bits of
// tpfuse_gemm's parallel split). The fold waits for nothing.
//
// Tile rows are visited from this rank's own rows on (a rotation of the tile order), so the
// first tiles need only the local part and the peers' parts arrive meanwhile. (A first version
// had the tiles read the peers' rows from the peers' areas: every column tile read them again
// over the link, 80 times the gather's bytes for Llama-3-70B's QKV at TP 8, docs/fused-gemm.md.)
//
// Ordering: the part's weak stores into rank p's area, by every thread, then __syncthreads,
// then thread 0's atom.acq_rel.sys on the count, which releases them (the model already makes
// a .gpu release cumulative over them, causality order being transitive; .sys so that
// correctness does not rest on the hardware honouring that for stores bound for a peer over
// NVLink or PCIe, which little code exercises); the add that completes the count acquires
// every earlier add's release (one chain of read-modify-writes), and its
// block's thread p, after a __syncthreads, stores the flag into rank p's pad with
// st.release.sys, which carries them all (fused_flags.cuh, "Flags": a counted unit); on rank
// p, the flag's ld.acquire.sys, then the __syncthreads of fused::passed, orders its block's
// reads of the rows after them. No peer memory is touched by an atomic (a pair of GPUs over
// PCIe need not have native peer atomics).
//
// No deadlock: every block pushes and counts its part before it waits for anything, the
// block that completes the count publishes before it waits (and the split's
// fold waits for nothing), so every wait ends once the publishing blocks have run; a block
// waits for every block of the ranks it needs, its own rank's included, so each rank's G blocks
// must be resident together: the launch is cooperative (backend.cuh: all G blocks resident at
// once, or refused before anything runs; the grid is at most the blocks the SMs it is given
// hold at once, TpGroup::fused_blocks x tpfuse_all_gather_gemm_blocks_per_sm: every SM, or the
// SMs divided among virtual ranks). Every rank awaits every peer's gather flag in every
// launch, as fused_flags.cuh's exchange-area argument needs: it is also why a push of launch
// E+2 into a peer's area finds that peer done with launch E.

#include <climits>

#include "copy.cuh"
#include "fused_flags.cuh"
#include "fused_split.cuh"
#include "kernel_list.cuh"

namespace tpfuse {
namespace {

using fused::BlockState;
using gemm::GemmEpilogue;
using gemm::DenseRows;
using gemm::gemm_tile;
using gemm::KSplit;
using gemm::split_parts_here;
using gemm::tile_of_block;

// The block's parts of x_r: an even share of its 16-byte vectors.
__device__ __forceinline__ void share_of(size_t vectors, size_t b, size_t blocks, size_t &begin, size_t &end) {
  begin = vectors * b / blocks;
  end = vectors * (b + 1) / blocks;
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    all_gather_gemm_kernel(const __grid_constant__ tpfuse_peers peers, const __grid_constant__ tpfuse_group_args g,
                           uint64_t descriptor, const T *x, const T *w, const T *bias, T *out, int m, int n, int k,
                           int tiles_m, int tiles_n, int parts, int split_parallel) {
  TPFUSE_DYNAMIC_SHARED(smem);
  TPFUSE_SHARED(BlockState, st);
  TPFUSE_SHARED(uint32_t, complete); // bit p: every part of rank p acquired by this block
  const Deadline deadline(g);
  if (threadIdx.x == 0) complete = 0; // ordered before every read by begin's __syncthreads
  fused::begin(peers, g, deadline, descriptor, st);
  const size_t exchange_bytes = fused::exchange_offset(g, st.epoch);
  const size_t exchange = exchange_bytes / sizeof(T);
  const int rows_per_rank = m / g.world;

  // Push: this block's part of x_r into every rank's area at this rank's rows, then counted
  // (the last part's block publishes the flag). The ranks are visited from the next one on,
  // so the W pushes of a moment spread over the W destinations.
  if (st.failed == 0) {
    const uint4 *src = reinterpret_cast<const uint4 *>(x);
    const size_t part_vectors = static_cast<size_t>(rows_per_rank) * k * sizeof(T) / 16;
    const size_t at = exchange_bytes + static_cast<size_t>(g.rank) * part_vectors * 16; // this rank's rows, in bytes
    size_t begin, end;
    share_of(part_vectors, blockIdx.x, gridDim.x, begin, end);
    // Several vectors in flight per thread (copy.cuh), each stored into every rank's area.
    copy_vectors(
        begin + threadIdx.x, end, blockDim.x, [&](size_t i) { return ld_global(src + i); },
        [&](size_t i, const uint4 &v) {
          for (int j = 1; j <= g.world; ++j) {
            const int p = (g.rank + j) % g.world;
            st_global(reinterpret_cast<uint4 *>(static_cast<char *>(peers.data[p]) + at) + i, v);
          }
        });
    __syncthreads(); // every thread's stores, before the count
    // The part counted in this rank's pad (at .sys: its stores went to every GPU); the block
    // whose add completes the count publishes this rank's gather flag to every rank.
    fused::publish_counted<true>(peers, g, st, Pad{peers.signals[g.rank]}.gather_count(), 1u, gridDim.x,
                                 fused::kGatherSlot, descriptor);
  }
  st.clock.mark(fused::kPhasePublish);

  // Compute: the block's units (tiles, or with the split in parallel parts of tiles), from
  // this rank's rows on, reading A [m, k] from this rank's area.
  const DenseRows<T> rows{static_cast<const T *>(peers.data[g.rank]) + exchange, k};
  const GemmEpilogue<T> epi{out, bias, nullptr, n};
  const int shift = g.rank * rows_per_rank / Cfg::kBlockM;
  const int tiles = tiles_m * tiles_n;
  const int units = split_parallel ? tiles * parts : tiles;
#pragma unroll 1
  for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
    // st.failed is read by every thread, then a __syncthreads, before this unit's waits can
    // write it: a warp that raced ahead into the waits must not change another warp's branch.
    const bool failed = st.failed != 0;
    __syncthreads();
    if (failed) break;
    const int tile = unit % tiles; // every part of a tile: the same rows, the same word
    int tm, tn;
    tile_of_block(tile, tiles_m, tiles_n, tm, tn);
    tm = (tm + shift) % tiles_m;
    const int first = tm * Cfg::kBlockM / rows_per_rank;
    const int last = (min((tm + 1) * Cfg::kBlockM, m) - 1) / rows_per_rank;
    uint32_t needed = 0;
    for (int p = first; p <= last; ++p) needed |= 1u << p;
    needed &= ~complete; // read by every thread; written only after the __syncthreads below
    if (needed != 0) {
      // Thread p awaits rank p's gather flag when the unit needs rank p's rows.
      const int src = static_cast<int>(threadIdx.x);
      if (src < g.world && (needed >> src & 1u) != 0) fused::await(peers, g, deadline, st, fused::kGatherSlot, src, descriptor);
      const bool arrived = fused::passed(st);
      st.clock.mark(fused::kPhaseWait);
      if (!arrived) break;
      if (threadIdx.x == 0) complete |= needed;
    }
    if constexpr (gemm::kParallelSplit<Cfg>) {
      if (split_parallel) {
        // The part's chains into the staging half, folded in order (fused_split.cuh); the block
        // that folds the last part stores the tile's outputs (+ bias). st.last is free until
        // fused::end.
        fused::split_unit<T, Cfg>(peers, g.rank, rows, w, m, n, k, tile, tm, tn, unit / tiles, parts, epi, smem,
                                  st.last, st.clock);
        continue;
      }
    }
    gemm_tile<T, Cfg>(rows, w, m, n, k, tm, tn, epi, smem, KSplit{parts, 0, parts});
    __syncthreads(); // the epilogue's reads of smem, before the next tile's writes
    st.clock.tile_computed();
  }

  if (fused::end(peers, g, st)) mark_failed(out, 0, static_cast<size_t>(m) * n);
}

constexpr uint64_t kKindAllGatherGemm = 18; // after gemm_all_reduce.cu's 16 and 17

template <typename T, typename Cfg>
int launch_config(const tpfuse_peers &peers, const tpfuse_group_args &g, int config, int blocks, const T *x,
                  const T *w, const T *bias, T *out, int m, int n, int k, cudaStream_t stream) {
  const long long tiles_m = (m + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const long long tiles_n = (n + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if (tiles_m * tiles_n > INT_MAX / 2 || blocks > TPFUSE_MAX_FUSED_TILES) return cudaErrorInvalidValue;
  // The GEMM's split of k (tpfuse_gemm's, so the same bits): the parts of every tile as the
  // grid's units where the staging half holds their f32 partials (tpfuse.h), else each tile's
  // parts in its block.
  const int parts = split_parts_here(n, k);
  if (parts == 0) return cudaErrorInvalidDevice;
  if (!Cfg::kSplittable && parts != 1) return cudaErrorInvalidValue;
  const bool split_parallel = fused::split_in_parallel<Cfg>(parts, m, n, tiles_m * tiles_n, g.capacity);
  // The parts' partials overwrite the start of the staging half: no argument may lie there.
  if (split_parallel &&
      fused::overlaps_partials(peers.data[g.rank], static_cast<size_t>(parts) * m * n * sizeof(float),
                               {{x, static_cast<size_t>(m / g.world) * k * sizeof(T)},
                                {w, static_cast<size_t>(n) * k * sizeof(T)},
                                {bias, n * sizeof(T)},
                                {out, static_cast<size_t>(m) * n * sizeof(T)}}))
    return cudaErrorInvalidValue;
  const long long units = tiles_m * tiles_n * (split_parallel ? parts : 1);
  const int grid = static_cast<int>(units < blocks ? units : blocks);
  auto all_gather_gemm = all_gather_gemm_kernel<T, Cfg>; // the name the emulator suite reports
  // Always opted in: the static shared memory counts toward the default 48 KiB (as in
  // gemm_all_reduce.cu).
  const cudaError_t err = cudaFuncSetAttribute(all_gather_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  const uint64_t descriptor = fused::descriptor_of(
      kKindAllGatherGemm,
      launch_descriptor({kKindAllGatherGemm, Elem<T>::kDtype, static_cast<uint64_t>(m), static_cast<uint64_t>(n),
                         static_cast<uint64_t>(k), static_cast<uint64_t>(config), static_cast<uint64_t>(grid),
                         bias != nullptr, static_cast<uint64_t>(parts), split_parallel ? 1u : 0u}));
  return launch_result(TPFUSE_LAUNCH_COOPERATIVE(all_gather_gemm, grid, Cfg::kThreads, Cfg::kSmemBytes, stream)(
      peers, g, descriptor, x, w, bias, out, m, n, k, static_cast<int>(tiles_m), static_cast<int>(tiles_n), parts,
      split_parallel ? 1 : 0));
}

template <typename T>
int launch(int config, const tpfuse_peers &peers, const tpfuse_group_args &g, int blocks, const void *x,
           const void *w, const void *bias, void *out, int m, int n, int k, cudaStream_t s) {
  const T *tx = static_cast<const T *>(x);
  const T *tw = static_cast<const T *>(w);
  const T *tb = static_cast<const T *>(bias);
  T *to = static_cast<T *>(out);
  // The fused kernels' variant (gemm::Fused) of tpfuse_gemm_select's configuration: the same
  // tiles, so the same bits.
  return gemm::visit_config(config, [&](auto selected) {
    using Cfg = typename gemm::Fused<decltype(selected)>::type;
    return launch_config<T, Cfg>(peers, g, config, blocks, tx, tw, tb, to, m, n, k, s);
  });
}

// The blocks of configuration `config`'s kernel one SM of the current device holds at once,
// into *blocks (the occupancy API, after the kernel is opted in to its shared memory).
template <typename T> int blocks_per_sm(int config, int *blocks) {
  return gemm::visit_config(config, [&](auto selected) {
    using Cfg = typename gemm::Fused<decltype(selected)>::type;
    auto all_gather_gemm = all_gather_gemm_kernel<T, Cfg>; // the name the emulator knows
    const cudaError_t err =
        cudaFuncSetAttribute(all_gather_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    return static_cast<int>(TPFUSE_MAX_ACTIVE_BLOCKS(blocks, all_gather_gemm, Cfg::kThreads, Cfg::kSmemBytes));
  });
}

constexpr size_t kMaxDim = size_t{1} << 30;

} // namespace

void all_gather_gemm_kernels(KernelList &list) {
  gemm::for_each_fused_config([&](auto cfg) {
    list.add(all_gather_gemm_kernel<__half, decltype(cfg)>);
    list.add(all_gather_gemm_kernel<__nv_bfloat16, decltype(cfg)>);
  });
}

} // namespace tpfuse

extern "C" int tpfuse_all_gather_gemm(tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                                      const tpfuse_group_args *group, int32_t blocks, const void *x, const void *w,
                                      const void *bias, void *out, size_t m, size_t n, size_t k, void *stream) {
  using namespace tpfuse;
  if (peers == nullptr || group == nullptr || group->world < 2 || group->world > TPFUSE_MAX_RANKS ||
      group->rank < 0 || group->rank >= group->world || blocks < 1) {
    return cudaErrorInvalidValue;
  }
  if (m == 0 || n == 0 || k == 0 || n % 8 != 0 || k % 8 != 0 || m > kMaxDim || n > kMaxDim || k > kMaxDim ||
      m % static_cast<size_t>(group->world) != 0) {
    return cudaErrorInvalidValue;
  }
  if (x == nullptr || w == nullptr || out == nullptr) return cudaErrorInvalidValue;
  // The gathered input [m, k] in one of each rank's two exchange areas (halves of the result
  // half, 16-byte aligned).
  if (group->capacity % 32 != 0 || m * k * dtype_size(dtype) > group->capacity / 2)
    return cudaErrorInvalidValue;
  for (const void *p : {x, w, bias, static_cast<const void *>(out)})
    if (!is_aligned16(p)) return cudaErrorMisalignedAddress;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  switch (dtype) {
  case TPFUSE_DTYPE_F16: return launch<__half>(config, *peers, *group, blocks, x, w, bias, out, im, in, ik, s);
  case TPFUSE_DTYPE_BF16: return launch<__nv_bfloat16>(config, *peers, *group, blocks, x, w, bias, out, im, in, ik, s);
  default: return cudaErrorInvalidValue;
  }
}

extern "C" int tpfuse_all_gather_gemm_blocks_per_sm(tpfuse_dtype dtype, int32_t config, int32_t *blocks) {
  using namespace tpfuse;
  return fused::report_blocks_per_sm(dtype, blocks, [&](auto t, int *n) { return blocks_per_sm<decltype(t)>(config, n); });
}
