// gemm_all_reduce.cu: the row-parallel layer's GEMM, its all-reduce and its epilogue (+ bias,
// + residual written back, RMSNorm) in one launch per rank (tpfuse.h, tpfuse_gemm_all_reduce);
// GEMM + reduce-scatter, the same kernel where each rank reduces only its slice of the rows
// (tpfuse_gemm_reduce_scatter); and the two-shot GEMM + all-reduce, the reduce-scatter
// followed by a gather of the slices (tpfuse_gemm_all_reduce_two_shot). docs/fused-gemm.md
// explains the design and its numbers; this is the protocol.
//
// Work. The output [m, n] is cut into the GEMM configuration's tiles, numbered in
// tile_of_block's order. Every rank runs a persistent grid of G blocks (G = min(tiles,
// blocks)); block b owns tiles b, b + G, b + 2G, ... on every rank, and
//
//   produces them gemm_tile computes this rank's partial x·wᵀ of each tile, back to back, and
//                 stores it, rounded to T (as tpfuse_gemm rounds it), into this rank's
//                 exchange area; after the last, __syncthreads; thread p (p < W) stores the
//                 block's flag (the launch's epoch and descriptor) into tile_flags[b][rank] of
//                 rank p's pad with st.release.sys (everything the block stored before the
//                 __syncthreads is visible, at system scope, to whoever acquires that flag:
//                 the pattern of barrier.cuh). One flag per block and source rank: a flag
//                 says all of block b's tiles are stored;
//   consumes them thread q (q < W) waits until tile_flags[b][q] of this rank's pad holds this
//                 launch's epoch or the next one (ld.relaxed.sys spin, then one
//                 ld.acquire.sys), __syncthreads, then the block adds the W ranks' partials of
//                 all its tiles in rank order in f32 and applies the epilogue (reduce.cuh: the
//                 one-shot all-reduce's arithmetic, so its bits), the tiles' vectors dealt
//                 over its threads as one sequence (reduce_tiles).
//
// Packets. Where every rank's partial fits half the packet area the group offers (world * m *
// n * 4 <= tpfuse_group_args.packet_bytes; the all-reduce, one-shot), the tiles travel as
// packets instead (packets.cuh): the GEMM's epilogue stores each tile's partial, two elements
// and a tag a 64-bit word, into every rank's packet half (PacketEpilogue), no flag is
// published, and the reduction's loads of every rank's packets are the wait (a vector's four
// packets from each rank, loaded until they carry the launch's tag, then cleared). The sums
// and the epilogue are the flags' (sum_ranks), so the bits. The strip counts, the RMSNorm and
// the end follow as below.
//
// So a block waits once, not once per tile: measured on an H200, a block that published,
// awaited and reduced each tile between its GEMM tiles spent about 3.7 us per tile on them,
// one after another (docs/performance.md, "Second H200 run"). The reduce-scatter consumes
// only the tiles that hold rows of the rank's slice, and only those rows; a block with none
// waits for nothing.
//
// The split of k in parallel (S parts: tpfuse_gemm's, tpfuse.h says when). The grid's units are
// then the parts of the tiles, unit u = part u / tiles of tile u % tiles, block b computing
// units b, b + G, ...: each stores its part's f32 chains into this rank's staging half and
// marks it in the tile's word, part_count[tile] (gemm_split.cuh: stored_part, fold_parts, the
// protocol and the bits of tpfuse_gemm's parallel split). The parts are folded in ascending
// order into part 0's partials; the block that folds the last part stores the sum rounded to
// T into the exchange area, and publishes the tile: after a __syncthreads, thread p stores the
// flag into tile_flags[tile][rank] of rank p's pad (st.release.sys, as above; cumulative over
// the block's stores of the tile). A flag then says one tile is stored, and a
// consuming block waits (thread q) for rank q's flag of each of its tiles b, b + G, ... that
// holds rows it reduces, in turn, then reduces them all as above. Blocks b >= tiles reduce
// nothing. Whichever block folds a tile's last part, the tile's flag slot is the same on every
// rank. No deadlock: a block folds and publishes inside its unit loop, before any wait, so
// every tile's parts and flag need only blocks that have not waited yet.
//
// Grid. G is at most the SMs the group gives the rank (TpGroup::fused_blocks) times the blocks
// of this kernel one SM holds at once (tpfuse_gemm_all_reduce_blocks_per_sm, the occupancy
// API), so that every SM streams weights for several blocks (the Rust plan decides it).
//
// No deadlock: block b waits only for block b of the other ranks, whose flag it publishes
// before it waits for anything (by packets: for the blocks that produce its tiles' packets,
// which they store before they wait for anything; with the split, any block of every rank). So no cycle can form, provided block b of every rank runs
// (with the split in parallel, a tile's flag comes from whichever block folds its last part:
// then every block of every rank must run, which the same cooperative launch gives).
// Every rank's grid is a cooperative launch (backend.cuh): all its G blocks are resident at
// once, or the launch is refused before anything runs (G past what the device holds at once:
// the occupancy API's bound), so block b of every rank runs, however many SMs other kernels
// hold meanwhile (they can delay the launch, not strand part of it). For virtual ranks sharing
// one device, the SMs are divided among them, so the W grids fit together (that cooperative
// grids of different streams then run at once is assumed, not documented: backend.cuh). A rank's blocks
// also wait for one another: the two-shot's gather for its own rank's slice flag, the
// one-shot's dealt RMSNorm rows for their strip's flag; that is why the co-residency of a
// rank's own blocks matters (issue 21).
//
// Epochs, the flags' encoding and why a launch needs no closing barrier (two exchange areas,
// by the epoch's parity): fused_flags.cuh. Here every rank consumes the flags of every peer in
// every launch (the reduce-scatter: those of the blocks of its rows, at least one), as that
// argument needs.
//
// RMSNorm. It needs whole rows, and a tile covers part of a row. After a block reduced its
// tiles and passed a __syncthreads, thread j mod blockDim.x adds 1 to strip_counts[s] for the
// block's j-th tile (of strip s, the tile's BM rows; count_strips: atom.acq_rel.gpu, the release of the
// block's stores, ordered before it by the __syncthreads; the adds of one counter form a
// release sequence, so the last adder acquires every earlier tile's stores). The thread whose
// add brings the count to the strip's tile count sets the count back to 0 and names the strip;
// after every add and a __syncthreads the block normalises the strip's first row (rms_norm_row: the
// standalone kernel's order, so the bits do not depend on which block does it). The strip's
// other rows are spread over the grid: when the strip has more than one row, that thread also
// stores the launch's flag into strip_flags[s] of this rank's pad (st.release.gpu: only this
// rank's blocks read it; after its acquire in program order: cumulative over every tile's
// stores it acquired, ptx.cuh), and once a block has counted its tiles, it normalises rows
// b, b + G, ... that are not a strip's first, each after thread 0 waited for its strip's flag
// (await_flag: ld.relaxed spin, ld.acquire, then the __syncthreads of passed(): the rows' loads
// come after). So a block normalises its share of the rows (m / G rounded up) and the first
// rows of the strips it completes. No deadlock:
// a strip flag needs only reductions, which wait only for block flags published before any
// wait, and the strip waits come after a block's publish and reduction; the cooperative launch
// keeps every block of the rank resident. A strip wait is consequent (a stall is some block
// wait's stall, which names the missing rank). A row the block cannot hold in registers is
// normalised through the GEMM's shared memory, past the names (rms_norm_row_staged: x and
// gamma copied in with cp.async, every vector in flight at once, then the same trees read from
// there): one load round where the segment loop takes two a segment. The copies are weak loads
// of the issuing threads, after the acquire and __syncthreads above, as the loop's loads are.
//
// Two-shot. Rank r reduces the tiles of its slice of rows, as the reduce-scatter does, and
// writes the reduced rows h (through the bias and the residual, whose rows of the slice it
// writes back) into its own exchange area, over its partials of those rows (no peer reads
// them: a peer reduces its own rows). After its tiles, thread 0 adds the block's count of
// them to slice_count (count_slice_tiles: atom.acq_rel.gpu, as the strip counts); the block
// that brings it to the slice's tile count sets it back to 0 and, after a __syncthreads,
// publishes the slice flag to every rank (st.release.sys by thread p: cumulative over the
// stores the counter's release sequence made visible to thread 0, ordered before it by the
// barrier). Then every block waits for every rank's slice flag (thread q: rank q's) and
// copies whole rows b, b + G, ... of out from their owner's area (ld.global.cg), the residual
// rows of the peers' slices too, and normalises each row with rms_norm_row (the same order as
// above, so the same bits); with RMSNorm, a row that fits the stage is copied into shared
// memory instead, gamma beside it, and normalised from there into out (gather_rows). No
// deadlock: a slice flag needs only the rank's reductions, which
// wait only for block flags published before any wait; the gather waits come after a block's
// publish. The cooperative launch (every block of every rank resident) suffices. A launch that
// fails leaves slice_count (and the strip counts) short of their reset: harmless, because a
// block of that rank failed or found the group poisoned, so its error word is set, and it
// never returns to 0: no later launch of the group produces anything.
//
// Failures: fused_flags.cuh. The last block marks out and residual (this rank's slice of out,
// for the reduce-scatter).

#include <cstring>

#include "copy.cuh"
#include "fused_flags.cuh"
#include "fused_split.cuh"
#include "packets.cuh"
#include "reduce.cuh"
#include "kernel_list.cuh"

namespace tpfuse {
namespace {

using gemm::DenseRows;
using gemm::gemm_tile;
using gemm::KSplit;
using gemm::split_parts_here;
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
    store16(exchange + static_cast<size_t>(row) * static_cast<size_t>(n) + static_cast<size_t>(col), rounded<T>(acc));
  }
};

// The epilogue a launch's GEMM stores its partials through: the exchange area (by flags) or
// packets (packets.cuh), chosen at run time. One type: one copy of the GEMM's main loop in the
// kernel (a copy per exchange doubled the file's compile time).
template <typename T> struct ExchangeEpilogue {
  StagingEpilogue<T> staging;
  packets::PacketEpilogue<T> packets;
  bool by_packets;

  __device__ __forceinline__ void store8(int row, int col, const float (&acc)[8]) const {
    if (by_packets) {
      packets.store8(row, col, acc);
    } else {
      staging.store8(row, col, acc);
    }
  }
};

// What every block of a launch shares.
template <typename T> struct Launch {
  const tpfuse_peers &peers;
  const tpfuse_group_args &g;
  const T *x, *w, *bias, *gamma;
  T *residual, *out;
  float eps;
  int m, n, k, tiles_m, tiles_n;
  // The rows this rank reduces into out (row row_begin is out's first): all of them for the
  // all-reduce, the rank's slice for the reduce-scatter and the two-shot.
  int row_begin, row_end;
  uint64_t descriptor; // the flags' descriptor bits (fused::descriptor_of)
  int slice_tiles;     // two-shot: the tiles of the rank's slice (else 0)
};

using fused::BlockState;

// Shared memory of count_strips' names: one int per tile of a block (at most every tile).
constexpr size_t kNamesBytes = TPFUSE_MAX_FUSED_TILES * sizeof(int);

// The rows of tile row tm that this rank reduces: [first, end), empty when none.
template <typename T, int BM> __device__ __forceinline__ Range2 rows_to_reduce(const Launch<T> &L, int tm) {
  return Range2{max(tm * BM, L.row_begin), min(min((tm + 1) * BM, L.m), L.row_end)};
}

// What this rank reduces of one tile, in 16-byte vectors: `rows` rows from row `first` (none
// for another rank's rows), `runs` vectors of each from column n0.
struct TileSpan {
  int tm, first, rows, n0, runs;
  __device__ __forceinline__ int vectors() const { return rows * runs; }
};

template <typename T, typename Cfg> __device__ __forceinline__ TileSpan span_of(const Launch<T> &L, int tile) {
  int tm, tn;
  tile_of_block(tile, L.tiles_m, L.tiles_n, tm, tn);
  const Range2 rows = rows_to_reduce<T, Cfg::kBlockM>(L, tm);
  const int n0 = tn * Cfg::kBlockN;
  // n and n0 are multiples of 8 = the vector's elements
  return TileSpan{tm, rows.first, max(rows.end - rows.first, 0), n0, min(Cfg::kBlockN, L.n - n0) / Vec16<T>::kLen};
}

// The block's tiles (b, b + G, ...) that hold rows this rank reduces.
template <typename T, typename Cfg> __device__ __forceinline__ int tiles_to_reduce(const Launch<T> &L) {
  int count = 0;
  for (int tile = blockIdx.x; tile < L.tiles_m * L.tiles_n; tile += gridDim.x)
    count += span_of<T, Cfg>(L, tile).rows > 0 ? 1 : 0;
  return count;
}

// out (and residual) of this rank's rows of every tile of the block, vector by vector:
// reduce_at(i) reduces elements i .. i + 7 (the W ranks' partials added in rank order, through
// the epilogue) and stores them, or says the block gives up. The vectors of all the block's
// tiles form one sequence dealt over its threads: a thread's next vector may lie in the next tile, so a narrow tile (one row at
// m = 1: BN / 8 vectors) still gives every thread work, and no tile waits for another's loads.
// Each vector's W loads are issued before the first add (reduce_vector). One code path for
// every world (reduce_vector's predicated form): an instantiation per world, inlined side by
// side, pushed the kernel past 255 registers into spills. Indices in 32 bits but the element
// offset (a block's vectors are at most TPFUSE_MAX_FUSED_TILES tiles of 128 x 128 / 8).
template <typename T, typename Cfg, typename ReduceAt>
__device__ __forceinline__ void for_each_vector(const Launch<T> &L, ReduceAt reduce_at) {
  constexpr int kVec = Vec16<T>::kLen;
  const int tiles = L.tiles_m * L.tiles_n;
  int tile = blockIdx.x;
  TileSpan span = span_of<T, Cfg>(L, tile);
  int before = 0; // the vectors of the block's tiles before `tile`
#pragma unroll 1
  for (int u = threadIdx.x;; u += blockDim.x) {
    while (u - before >= span.vectors()) { // past `tile`: the block's next tile
      before += span.vectors();
      tile += gridDim.x;
      if (tile >= tiles) return;
      span = span_of<T, Cfg>(L, tile);
    }
    const int v = u - before;
    const size_t i = static_cast<size_t>(span.first - L.row_begin + v / span.runs) * L.n + span.n0 +
                     (v % span.runs) * kVec;
    if (!reduce_at(i)) return;
  }
}

// By flags: the exchange areas (element offset `exchange`, laid out [m, n]).
template <typename T, typename Cfg> __device__ __forceinline__ void reduce_tiles(const Launch<T> &L, size_t exchange) {
  const Epilogue<T> epi{L.bias, L.residual, static_cast<size_t>(L.n)};
  // Element i of out (and of the residual) is element i + row_begin·n of the exchange areas.
  const size_t shifted = exchange + static_cast<size_t>(L.row_begin) * L.n;
  for_each_vector<T, Cfg>(L, [&](size_t i) {
    store16(L.out + i, reduce_vector<T, TPFUSE_MAX_RANKS>(L.peers, L.g.world, shifted, i, epi));
    return true;
  });
}

// By packets (the all-reduce: row_begin is 0): each vector's wait is in its loads; a thread
// stops at the first it cannot complete.
template <typename T, typename Cfg>
__device__ __forceinline__ void reduce_packet_tiles(const Launch<T> &L, const Deadline &deadline, BlockState &st) {
  const Epilogue<T> epi{L.bias, L.residual, static_cast<size_t>(L.n)};
  const size_t part = static_cast<size_t>(L.m) * static_cast<size_t>(L.n) / 2;
  const uint32_t tag = packets::tag_of(st.epoch, L.descriptor);
  for_each_vector<T, Cfg>(L, [&](size_t i) {
    return packets::reduce_packet_vector<T>(L.peers, L.g, deadline, st, part, tag, L.descriptor, epi, L.out, i);
  });
}

// Two-shot, after the block reduced its `reduced` tiles of the slice (at least one): counts
// them, and the block that completes the slice publishes the slice flag to every rank.
template <typename T> __device__ __forceinline__ void count_slice_tiles(const Launch<T> &L, BlockState &st, int reduced) {
  __syncthreads(); // the tiles' stores, before thread 0's release
  fused::publish_counted<false>(L.peers, L.g, st, Pad{L.peers.signals[L.g.rank]}.slice_count(),
                                static_cast<uint32_t>(reduced), static_cast<uint32_t>(L.slice_tiles),
                                fused::kSliceSlot, L.descriptor);
}

// One-shot with RMSNorm, after the block reduced its tiles: counts each toward its strip (the
// tile's BM rows), the block's j-th tile by thread j mod blockDim.x, so the counters' round
// trips overlap. The thread whose add completes a strip sets its count back to 0, publishes
// its flag for the strip's other rows (dealt over the grid: normalize_dealt_rows) and names
// the strip's first row in completed[j] (shared memory: one int per tile of the block, -1 for
// none); once every add is done, the whole block normalises each named row.
template <typename T, typename Cfg>
__device__ __forceinline__ void count_strips(const Launch<T> &L, BlockState &st, int *completed, NormStage stage) {
  const int grid = static_cast<int>(gridDim.x);
  const int mine = (L.tiles_m * L.tiles_n - static_cast<int>(blockIdx.x) + grid - 1) / grid; // the block's tiles
  __syncthreads(); // the block's reduced stores, before the releases
#pragma unroll 1
  for (int j = threadIdx.x; j < mine; j += blockDim.x) {
    const TileSpan span = span_of<T, Cfg>(L, blockIdx.x + j * grid);
    const Pad own{L.peers.signals[L.g.rank]};
    uint32_t *count = own.strip_count(span.tm);
    int named = -1;
    if (atomic_add_acq_rel_gpu(count, 1u) + 1u == static_cast<uint32_t>(L.tiles_n)) {
      *count = 0; // no other block of this launch adds to it again
      // The strip's other rows, for the blocks they are dealt to (after the acquire above).
      if (span.rows > 1) st_release_gpu(own.strip_flag(span.tm), fused::flag_of(st.epoch, L.descriptor));
      named = span.first;
    }
    completed[j] = named;
  }
  __syncthreads(); // the acquires and the names, before the whole block reads the rows
#pragma unroll 1
  for (int j = 0; j < mine; ++j) {
    const int row = completed[j];
    if (row < 0) continue;
    T *h = L.out + static_cast<size_t>(row) * L.n;
    rms_norm_row<T, Cfg::kThreads>(h, L.gamma, L.eps, h, static_cast<size_t>(L.n), stage);
  }
}

// One-shot with RMSNorm, after the block's strip counts: rows b, b + G, ... that are not a
// strip's first (the block completing a strip normalised that one), each once its strip's
// flag says every tile of the strip is reduced. False when the block gave up.
template <typename T, int BM, int kBlock>
__device__ __forceinline__ bool normalize_dealt_rows(const Launch<T> &L, const Deadline &deadline, BlockState &st,
                                                     NormStage stage) {
  int awaited = -1; // the strip whose flag this block has acquired
#pragma unroll 1
  for (int row = blockIdx.x; row < L.m; row += gridDim.x) {
    const int strip = row / BM;
    if (row == strip * BM) continue;
    if (strip != awaited) {
      if (threadIdx.x == 0) {
        const uint64_t *flag = Pad{L.peers.signals[L.g.rank]}.strip_flag(strip);
        fused::await_flag(L.peers, L.g, deadline, st, flag, L.g.rank, L.descriptor, true);
      }
      if (!fused::passed(st)) return false;
      awaited = strip;
    }
    T *h = L.out + static_cast<size_t>(row) * L.n;
    rms_norm_row<T, kBlock>(h, L.gamma, L.eps, h, static_cast<size_t>(L.n), stage);
  }
  return true;
}

// Two-shot, the end: waits for every rank's slice flag, then copies rows b, b + G, ... of out
// from their owner's exchange area (element offset `exchange`), the peers' rows into the
// residual too, and normalises them. With RMSNorm, a row that fits `stage` is copied there
// instead of into out, gamma beside it (rms_norm_through_stage: gamma's cp.async issued first,
// its loads wait with the peer's), and normalised from there into out: the owner's row read
// once, and no load round after the copy's; a longer row goes through out (rms_norm_row).
// False when the block gave up.
template <typename T, int kBlock>
__device__ __forceinline__ bool gather_rows(const tpfuse_peers &peers, const tpfuse_group_args &g,
                                            const Deadline &deadline, BlockState &st, uint64_t descriptor,
                                            size_t exchange, T *out, T *residual, const T *gamma, float eps, int m,
                                            int n, NormStage stage) {
  // Consequent waits: a stalled slice is some tile wait's stall, which names the missing rank.
  if (static_cast<int>(threadIdx.x) < g.world)
    fused::await(peers, g, deadline, st, fused::kSliceSlot, threadIdx.x, descriptor, true);
  if (!fused::passed(st)) return false;
  constexpr int kVec = Vec16<T>::kLen;
  const int slice = m / g.world;
  const size_t hidden = static_cast<size_t>(n);
  const bool staged = gamma != nullptr && staged_row_bytes<T>(hidden) <= stage.bytes;
#pragma unroll 1
  for (int row = blockIdx.x; row < m; row += gridDim.x) {
    const int owner = row / slice;
    const size_t at = static_cast<size_t>(row) * n;
    const T *h = static_cast<const T *>(peers.data[owner]) + exchange + at;
    T *peer_residual = residual != nullptr && owner != g.rank ? residual + at : nullptr;
    // The row into `into` (the stage, or out), the peers' rows into the residual too. Several
    // vectors in flight per thread (copy.cuh): a row waits about one peer latency. A thread
    // stores the vectors stage_async would give it, so it reads back only its own.
    const auto copy_row = [&](T *into) {
      copy_vectors(
          threadIdx.x * kVec, hidden, blockDim.x * kVec,
          [&](size_t v) { return ld_global_cg(reinterpret_cast<const uint4 *>(h + v)); },
          [&](size_t v, const uint4 &x) {
            if (staged) {
              *reinterpret_cast<uint4 *>(into + v) = x;
            } else {
              st_global(reinterpret_cast<uint4 *>(into + v), x);
            }
            if (peer_residual != nullptr) st_global(reinterpret_cast<uint4 *>(peer_residual + v), x);
          });
    };
    if (staged) {
      rms_norm_through_stage<T, kBlock>(stage, gamma, eps, out + at, hidden, copy_row);
    } else {
      copy_row(out + at);
      if (gamma != nullptr) {
        __syncthreads(); // the row's stores, before the norm reads it whole
        rms_norm_row<T, kBlock>(out + at, gamma, eps, out + at, hidden);
      }
    }
  }
  return true;
}

// The block's share of the GEMM: its tiles b, b + G, ... back to back, or with the split of k
// in parallel the parts of the tiles (units b, b + G, ...), each tile's partial (rounded to T)
// stored through `epi` (the exchange area, or packets). By flags, the block then publishes its
// flag to every rank (slot b), or, with the split, the block that folds a tile's last part
// publishes the tile (slot = tile).
template <typename T, typename Cfg, typename Epi>
__device__ __forceinline__ void produce(const Launch<T> &L, BlockState &st, unsigned char *smem, int parts,
                                        bool split_parallel, const Epi &epi, bool flags) {
  const tpfuse_peers &peers = L.peers;
  const tpfuse_group_args &g = L.g;
  const int tiles = L.tiles_m * L.tiles_n;
  const uint64_t flag_value = fused::flag_of(st.epoch, L.descriptor);
  if (split_parallel) {
    if constexpr (gemm::kParallelSplit<Cfg>) {
#pragma unroll 1
      for (int unit = blockIdx.x; unit < tiles * parts; unit += gridDim.x) {
        const int tile = unit % tiles;
        int tm, tn;
        tile_of_block(tile, L.tiles_m, L.tiles_n, tm, tn);
        // The block that folds the tile's last part publishes it, after fold_parts'
        // __syncthreads (every thread's stores of the tile, before the flags' releases).
        // (st.last is free until the reduction's counts.)
        if (fused::split_unit<T, Cfg>(peers, g.rank, DenseRows<T>{L.x, L.k}, L.w, L.m, L.n, L.k, tile, tm, tn,
                                      unit / tiles, parts, epi, smem, st.last, st.clock) &&
            flags)
          fused::publish(peers, g, tile, flag_value);
        st.clock.mark(fused::kPhasePublish);
      }
    }
    return;
  }
#pragma unroll 1
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int tm, tn;
    tile_of_block(tile, L.tiles_m, L.tiles_n, tm, tn);
    gemm_tile<T, Cfg>(DenseRows<T>{L.x, L.k}, L.w, L.m, L.n, L.k, tm, tn, epi, smem, KSplit{parts, 0, parts});
    __syncthreads(); // the tile's stores and the epilogue's reads of smem, before the next
                     // tile's writes to it and (after the last) the flags
    st.clock.tile_computed();
  }
  if (flags) fused::publish(peers, g, blockIdx.x, flag_value);
  st.clock.mark(fused::kPhasePublish);
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gemm_all_reduce_kernel(const __grid_constant__ tpfuse_peers peers,
                                                                          const __grid_constant__ tpfuse_group_args g,
                                                                          uint64_t descriptor, const T *x, const T *w,
                                                                          const T *bias, T *residual, const T *gamma,
                                                                          float eps, T *out, int m, int n, int k,
                                                                          int tiles_m, int tiles_n, int row_begin,
                                                                          int row_end, int two_shot, int parts,
                                                                          int split_parallel, int packets) {
  TPFUSE_DYNAMIC_SHARED(smem);
  TPFUSE_SHARED(BlockState, st);
  const Deadline deadline(g);
  fused::begin(peers, g, deadline, descriptor, st);
  const size_t exchange_bytes = fused::exchange_offset(g, st.epoch);
  T *mine = reinterpret_cast<T *>(static_cast<char *>(peers.data[g.rank]) + exchange_bytes);
  // Two-shot reduces its slice into its own area and the slice's residual rows; the norm
  // comes with the gather.
  const size_t slice_at = static_cast<size_t>(row_begin) * n;
  const int slice_tiles =
      two_shot ? ((row_end - 1) / Cfg::kBlockM - row_begin / Cfg::kBlockM + 1) * tiles_n : 0;
  const Launch<T> L{peers,
                    g,
                    x,
                    w,
                    bias,
                    two_shot ? nullptr : gamma,
                    two_shot && residual != nullptr ? residual + slice_at : residual,
                    two_shot ? mine + slice_at : out,
                    eps,
                    m,
                    n,
                    k,
                    tiles_m,
                    tiles_n,
                    row_begin,
                    row_end,
                    descriptor,
                    slice_tiles};
  const size_t exchange = exchange_bytes / sizeof(T);
  // The GEMM's shared memory once its work is done (its last epilogue read it before the tile
  // loop's last __syncthreads, and no cp.async is pending: gemm_tile waits for all of them):
  // the names of count_strips (an int per tile of the block), then the RMSNorm's stage
  // (rms_norm_row, gather_rows).
  static_assert(kNamesBytes % 16 == 0 && kNamesBytes < Cfg::kSmemBytes, "names, then a stage");
  const NormStage stage{smem + kNamesBytes, static_cast<size_t>(Cfg::kSmemBytes) - kNamesBytes};

  // Produce: the block's tiles back to back, then (by flags) one flag to every rank (slot b:
  // "block b's tiles are stored"). Consume: one wait for every rank's flag of slot b, then the
  // tiles' reduction; by packets, the reduction's loads wait. A parallel split produces the
  // parts of the tiles instead, and the block that folds a tile's last part publishes the tile
  // (slot = tile), so the consumers wait for every rank's flag of each of their tiles. (Nothing
  // writes st.failed between begin()'s __syncthreads and the waits.)
  const int tiles = tiles_m * tiles_n;
  const bool producing = st.failed == 0;
  if (producing) {
    const ExchangeEpilogue<T> epi{StagingEpilogue<T>{mine, n},
                                  packets::PacketEpilogue<T>{&peers, g.world, g.rank, n, st.epoch,
                                                             static_cast<size_t>(m) * static_cast<size_t>(n) / 2,
                                                             packets::tag_of(st.epoch, descriptor)},
                                  packets != 0};
    produce<T, Cfg>(L, st, smem, parts, split_parallel != 0, epi, packets == 0);
  }
  // The reduce-scatter's and the two-shot's blocks reduce only the tiles of the rank's slice:
  // a block with none waits for nothing.
  const int reducing = producing ? tiles_to_reduce<T, Cfg>(L) : 0;
  if (reducing > 0) {
    if (packets) {
      // The waits are the reduction's loads: the phase records count both as the wait.
      reduce_packet_tiles<T, Cfg>(L, deadline, st);
    } else if (static_cast<int>(threadIdx.x) < g.world) {
      if (gemm::kParallelSplit<Cfg> && split_parallel) {
#pragma unroll 1
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x)
          if (span_of<T, Cfg>(L, tile).rows > 0) fused::await(peers, g, deadline, st, tile, threadIdx.x, descriptor);
      } else {
        fused::await(peers, g, deadline, st, blockIdx.x, threadIdx.x, descriptor);
      }
    }
    const bool arrived = fused::passed(st);
    st.clock.mark(fused::kPhaseWait);
    if (arrived) {
      if (!packets) reduce_tiles<T, Cfg>(L, exchange);
      if (L.slice_tiles > 0) {
        count_slice_tiles(L, st, reducing);
      } else if (L.gamma != nullptr) {
        count_strips<T, Cfg>(L, st, reinterpret_cast<int *>(smem), stage);
      }
      __syncthreads(); // every warp's share of the reduction, before thread 0 times it
      st.clock.mark(fused::kPhaseReduce);
    }
  }
  // The same rule before the strip waits.
  const bool norming = L.gamma != nullptr && st.failed == 0;
  __syncthreads();
  if (norming) normalize_dealt_rows<T, Cfg::kBlockM, Cfg::kThreads>(L, deadline, st, stage);
  // The same rule before the gather's waits.
  const bool gathering = two_shot && st.failed == 0;
  __syncthreads();
  if (gathering)
    gather_rows<T, Cfg::kThreads>(peers, g, deadline, st, descriptor, exchange, out, residual, gamma, eps, m, n,
                                  stage);
  __syncthreads(); // every warp's rows, before thread 0 times them
  st.clock.mark(fused::kPhaseTail);

  if (fused::end(peers, g, st)) {
    const size_t len = static_cast<size_t>(two_shot ? m : row_end - row_begin) * n;
    mark_failed(out, 0, len);
    mark_failed(residual, 0, len);
  }
}

// The kinds of launch a descriptor tells apart (all_reduce.cu's are 1..9, all_gather_gemm.cu's
// 18).
constexpr uint64_t kKindGemmAllReduce = 16;
constexpr uint64_t kKindGemmReduceScatter = 17;
constexpr uint64_t kKindGemmAllReduceTwoShot = 19;

// What a launch reduces: all of out (all-reduce), or this rank's slice of m / world rows
// (the reduce-scatter; the two-shot, which then gathers every slice).
struct Reduction {
  uint64_t kind;
  bool scatter;
  bool two_shot;
};

template <typename T, typename Cfg>
int launch_config(Reduction reduction, const tpfuse_peers &peers, const tpfuse_group_args &g, int config,
                  int blocks, const T *x, const T *w, const T *bias, T *residual, const T *gamma, float eps, T *out,
                  int m, int n, int k, cudaStream_t stream) {
  const long long tiles_m = (m + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const long long tiles_n = (n + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if (tiles_m * tiles_n > TPFUSE_MAX_FUSED_TILES) return cudaErrorInvalidValue;
  // The GEMM's split of k (tpfuse_gemm's, so the same bits): the parts of every tile as the
  // grid's units where the staging half holds their f32 partials (tpfuse.h), else each tile's
  // parts in its block.
  const int parts = split_parts_here(n, k);
  if (parts == 0) return cudaErrorInvalidDevice;
  if (!Cfg::kSplittable && parts != 1) return cudaErrorInvalidValue;
  const bool split_parallel = fused::split_in_parallel<Cfg>(parts, m, n, tiles_m * tiles_n, g.capacity);
  // The parts' partials overwrite the start of the staging half: no argument may lie there.
  const size_t mn = static_cast<size_t>(m) * n;
  const size_t out_rows = reduction.scatter && !reduction.two_shot ? m / g.world : m;
  if (split_parallel &&
      fused::overlaps_partials(peers.data[g.rank], static_cast<size_t>(parts) * mn * sizeof(float),
                               {{x, static_cast<size_t>(m) * k * sizeof(T)},
                                {w, static_cast<size_t>(n) * k * sizeof(T)},
                                {bias, n * sizeof(T)},
                                {residual, mn * sizeof(T)},
                                {gamma, n * sizeof(T)},
                                {out, out_rows * n * sizeof(T)}}))
    return cudaErrorInvalidValue;
  // Packets (packets.cuh) for the all-reduce where every rank's partial fits a half of the
  // packet area the group offers: 4 bytes a packet element, from every rank.
  const bool packets = !reduction.scatter && g.packet_bytes != 0 &&
                       static_cast<uint64_t>(g.world) * m * n * 4 <= g.packet_bytes;
  const long long units = tiles_m * tiles_n * (split_parallel ? parts : 1);
  const int grid = static_cast<int>(units < blocks ? units : blocks);
  auto gemm_all_reduce = gemm_all_reduce_kernel<T, Cfg>; // the name the emulator suite reports
  // Always opted in (not only past 48 KiB, as gemm.cu does): the kernel's static shared
  // memory (BlockState, the RMSNorm's warp sums) counts with the dynamic size toward the
  // default 48 KiB, SmallM16x32 takes exactly 48 KiB of dynamic shared memory, and
  // FusedTile64x64 96 KiB.
  const cudaError_t err =
      cudaFuncSetAttribute(gemm_all_reduce, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  uint32_t eps_bits;
  std::memcpy(&eps_bits, &eps, sizeof eps_bits);
  const uint64_t descriptor = fused::descriptor_of(
      reduction.kind,
      launch_descriptor({reduction.kind, Elem<T>::kDtype, static_cast<uint64_t>(m), static_cast<uint64_t>(n),
                         static_cast<uint64_t>(k), static_cast<uint64_t>(config), static_cast<uint64_t>(grid),
                         bias != nullptr, residual != nullptr, gamma != nullptr, eps_bits,
                         static_cast<uint64_t>(parts), split_parallel ? 1u : 0u, packets ? 1u : 0u}));
  const int slice = m / g.world;
  const int row_begin = reduction.scatter ? g.rank * slice : 0;
  const int row_end = reduction.scatter ? row_begin + slice : m;
  // Cooperative: the two-shot's blocks wait for their own rank's slice (see above).
  return launch_result(TPFUSE_LAUNCH_COOPERATIVE(gemm_all_reduce, grid, Cfg::kThreads, Cfg::kSmemBytes, stream)(
      peers, g, descriptor, x, w, bias, residual, gamma, eps, out, m, n, k, static_cast<int>(tiles_m),
      static_cast<int>(tiles_n), row_begin, row_end, reduction.two_shot ? 1 : 0, parts, split_parallel ? 1 : 0,
      packets ? 1 : 0));
}

template <typename T>
int launch(Reduction reduction, int config, const tpfuse_peers &peers, const tpfuse_group_args &g, int blocks, const void *x,
           const void *w, const void *bias, void *residual, const void *gamma, float eps, void *out, int m, int n,
           int k, cudaStream_t s) {
  // The fused kernels' variant (gemm::Fused) of tpfuse_gemm_select's configuration: the same
  // tiles, so the same bits.
  return gemm::visit_config(config, [&](auto selected) {
    using Cfg = typename gemm::Fused<decltype(selected)>::type;
    return launch_config<T, Cfg>(reduction, peers, g, config, blocks, static_cast<const T *>(x),
                                 static_cast<const T *>(w), static_cast<const T *>(bias), static_cast<T *>(residual),
                                 static_cast<const T *>(gamma), eps, static_cast<T *>(out), m, n, k, s);
  });
}

// The blocks of configuration `config`'s kernel one SM of the current device holds at once,
// into *blocks (the occupancy API, after the kernel is opted in to its shared memory).
template <typename T> int blocks_per_sm(int config, int *blocks) {
  return gemm::visit_config(config, [&](auto selected) {
    using Cfg = typename gemm::Fused<decltype(selected)>::type;
    auto gemm_all_reduce = gemm_all_reduce_kernel<T, Cfg>; // the name the emulator knows
    const cudaError_t err =
        cudaFuncSetAttribute(gemm_all_reduce, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    return static_cast<int>(TPFUSE_MAX_ACTIVE_BLOCKS(blocks, gemm_all_reduce, Cfg::kThreads, Cfg::kSmemBytes));
  });
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
  // The two exchange areas: halves of the result half, each 16-byte aligned; the packet
  // area's halves are what the pad holds.
  if (group->capacity % 32 != 0 || m * n * dtype_size(dtype) > group->capacity / 2) return cudaErrorInvalidValue;
  if (group->packet_bytes > TPFUSE_PACKET_HALF_BYTES) return cudaErrorInvalidValue;
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

void gemm_all_reduce_kernels(KernelList &list) {
  gemm::for_each_fused_config([&](auto cfg) {
    list.add(gemm_all_reduce_kernel<__half, decltype(cfg)>);
    list.add(gemm_all_reduce_kernel<__nv_bfloat16, decltype(cfg)>);
  });
}

} // namespace tpfuse

extern "C" int tpfuse_gemm_all_reduce(tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                                      const tpfuse_group_args *group, int32_t blocks, const void *x, const void *w,
                                      const void *bias, void *residual, const void *gamma, float eps, void *out,
                                      size_t m, size_t n, size_t k, void *stream) {
  using namespace tpfuse;
  return checked_launch(Reduction{kKindGemmAllReduce, false, false}, dtype, config, peers, group, blocks, x, w,
                        bias, residual, gamma, eps, out, m, n, k, stream);
}

extern "C" int tpfuse_gemm_all_reduce_two_shot(tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                                               const tpfuse_group_args *group, int32_t blocks, const void *x,
                                               const void *w, const void *bias, void *residual,
                                               const void *gamma, float eps, void *out, size_t m, size_t n,
                                               size_t k, void *stream) {
  using namespace tpfuse;
  return checked_launch(Reduction{kKindGemmAllReduceTwoShot, true, true}, dtype, config, peers, group, blocks, x,
                        w, bias, residual, gamma, eps, out, m, n, k, stream);
}

extern "C" int tpfuse_gemm_reduce_scatter(tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                                          const tpfuse_group_args *group, int32_t blocks, const void *x,
                                          const void *w, void *out, size_t m, size_t n, size_t k, void *stream) {
  using namespace tpfuse;
  return checked_launch(Reduction{kKindGemmReduceScatter, true, false}, dtype, config, peers, group, blocks, x, w,
                        nullptr, nullptr, nullptr, 0.f, out, m, n, k, stream);
}

extern "C" int tpfuse_gemm_all_reduce_blocks_per_sm(tpfuse_dtype dtype, int32_t config, int32_t *blocks) {
  using namespace tpfuse;
  return fused::report_blocks_per_sm(dtype, blocks, [&](auto t, int *n) { return blocks_per_sm<decltype(t)>(config, n); });
}
