// all_reduce.cu: one-shot and two-shot all-reduce over symmetric memory, with the fused
// epilogue of a transformer layer's row-parallel output (+ bias, + residual, RMSNorm), and
// the all-gather and reduce-scatter built on the same machinery.
//
// Every kernel follows the same shape, with the barriers of barrier.cuh between phases:
//
//   one-shot    stage -> | -> reduce all ranks' staging, epilogue -> (RMSNorm: sums of
//               squares of the block's row segments -> the rank's blocks meet -> normalise;
//               rows of one segment: each normalised from registers; a block of one segment
//               of a longer row keeps it and its sum of squares in registers across the
//               meeting) -> finished
//   two-shot    stage -> | -> reduce own slice, epilogue, publish -> | -> gather slices -> finished
//   all-gather  stage -> | -> copy every rank's staging -> finished
//   reduce-sc.  stage -> | -> reduce own slice -> finished
//
// The one-shot goes by packets instead where they fit (all_reduce_packets.cu: no barrier, no
// read across the link; the same bits).
//
// "stage" copies this rank's input into its own staging buffer; every other rank reads it
// only after the next barrier. There is no closing barrier: "finished" announces the launch
// to every rank, and a rank's next launch stores nothing before every peer has finished this
// one (barrier.cuh, "Finished launches"), so no peer still reads a staging buffer or a result
// area when its owner's next launch overwrites it.
//
// Block b of every rank handles the same part of the data, so the barrier of block b with
// block b of the peers is all the ordering that part needs. Reductions add in rank order
// 0..W-1 in f32 and round once, so every rank, and both algorithms, produce the same bits.
//
// A block that gives up (the group was poisoned before it started, or a barrier failed:
// barrier.cuh) publishes the error word to the host and marks every output element it was
// responsible for failed (failure.cuh), then returns; it never leaves plausible output.
// Every launch carries a descriptor (launch_descriptor: the kernel, element type, sizes
// and grid) that the first barrier compares across ranks.

#include <cstring>
#include <type_traits>

#include "all_reduce_packets.cuh"
#include "barrier.cuh"
#include "copy.cuh"
#include "reduce.cuh"
#include "kernel_list.cuh"

namespace tpfuse {
namespace {

// Elements [vec units of a range], clipped to n.
template <typename T> __device__ __forceinline__ Range element_range(Range units, size_t n) {
  constexpr size_t kVec = Vec16<T>::kLen;
  return Range{min(units.begin * kVec, n), min(units.end * kVec, n)};
}

// Copies elements [r.begin, r.end) of src to dst (same offsets), several vectors in flight per
// thread (copy.cuh). r.begin is vector-aligned.
template <typename T> __device__ __forceinline__ void copy_range(const T *src, T *dst, Range r) {
  constexpr size_t kVec = Vec16<T>::kLen;
  const size_t full_end = r.begin + (r.end - r.begin) / kVec * kVec;
  copy_vectors(
      r.begin + threadIdx.x * kVec, full_end, kThreads * kVec,
      [&](size_t i) { return ld_global(reinterpret_cast<const uint4 *>(src + i)); },
      [&](size_t i, const uint4 &v) { st_global(reinterpret_cast<uint4 *>(dst + i), v); });
  for (size_t i = full_end + threadIdx.x; i < r.end; i += kThreads) st_global(dst + i, ld_global(src + i));
}

// The 16-byte vectors of [begin, end) (vector-aligned) of reduce_range, for a world of W
// (reduce.cuh).
template <typename T, int W>
__device__ __forceinline__ void reduce_vectors(const tpfuse_peers &peers, size_t peer_offset, size_t begin,
                                               size_t end, const Epilogue<T> &epi, T *out, T *publish) {
  constexpr size_t kVec = Vec16<T>::kLen;
  for (size_t i = begin + threadIdx.x * kVec; i < end; i += kThreads * kVec) {
    const Vec16<T> y = reduce_vector<T, W>(peers, W, peer_offset, i, epi);
    store16(out + i, y);
    if (publish != nullptr) store16(publish + i, y);
  }
}

// Calls f(std::integral_constant<int, world>{}): the reductions' loops unrolled for the
// group's world (2 ..= TPFUSE_MAX_RANKS, checked by valid()).
template <typename F> __device__ __forceinline__ void with_world(int world, F &&f) {
  static_assert(TPFUSE_MAX_RANKS == 8, "with_world dispatches worlds 2..8");
  switch (world) {
  case 2: f(std::integral_constant<int, 2>{}); break;
  case 3: f(std::integral_constant<int, 3>{}); break;
  case 4: f(std::integral_constant<int, 4>{}); break;
  case 5: f(std::integral_constant<int, 5>{}); break;
  case 6: f(std::integral_constant<int, 6>{}); break;
  case 7: f(std::integral_constant<int, 7>{}); break;
  default: f(std::integral_constant<int, 8>{}); break;
  }
}

// For elements [r.begin, r.end): the rank-ordered sum of every rank's staging, through the
// epilogue, into out (and, when `publish` is set, into this rank's result buffer too).
// `peer_offset` (elements) is added to every rank's staging pointer (reduce-scatter reads
// the slice of this rank at that offset).
template <typename T>
__device__ __forceinline__ void reduce_range(const tpfuse_peers &peers, int world, size_t peer_offset, Range r,
                             const Epilogue<T> &epi, T *out, T *publish) {
  constexpr size_t kVec = Vec16<T>::kLen;
  const size_t full_end = r.begin + (r.end - r.begin) / kVec * kVec;
  with_world(world, [&](auto w) {
    reduce_vectors<T, decltype(w)::value>(peers, peer_offset, r.begin, full_end, epi, out, publish);
  });
  for (size_t i = full_end + threadIdx.x; i < r.end; i += kThreads) {
    float acc = Elem<T>::to_f32(ld_global_cg(static_cast<const T *>(peers.data[0]) + peer_offset + i));
    for (int p = 1; p < world; ++p) {
      acc += Elem<T>::to_f32(ld_global_cg(static_cast<const T *>(peers.data[p]) + peer_offset + i));
    }
    const T y = epi.apply(acc, i);
    st_global(out + i, y);
    if (publish != nullptr) st_global(publish + i, y);
  }
}

// A block gives up: publishes the error and marks its share r of out and residual failed.
template <typename T>
__device__ __forceinline__ void give_up(const BlockBarrier &barrier, T *out, T *residual, Range r) {
  barrier.publish_failure();
  mark_failed(out, r.begin, r.end);
  mark_failed(residual, r.begin, r.end);
}

// One segment of a row (epilogue.cuh, kSegment): with RMSNorm, the unit of work one-shot
// hands to its blocks, so a row is split across blocks. Unit u is segment u % per_row of
// row u / per_row; consecutive units are consecutive in memory.
template <typename T> struct Segments {
  size_t hidden, per_row;
  __device__ size_t row(size_t u) const { return u / per_row; }
  __device__ size_t begin(size_t u) const { return row(u) * hidden + u % per_row * kSegment<T>; }
  __device__ size_t end(size_t u) const { return min(begin(u) + kSegment<T>, (row(u) + 1) * hidden); }
  // Elements of units [units.begin, units.end).
  __device__ Range elements(Range units) const {
    return units.begin < units.end ? Range{begin(units.begin), end(units.end - 1)} : Range{0, 0};
  }
};

// One-shot RMSNorm of the block's units, after the reduction wrote h into out: each unit's
// partial sum of squares into float u of this rank's result area (`partials`), the blocks of
// the rank meet, then each unit's row sum is the row's partials added in segment order (the
// standalone kernel's order: the same bits), and the unit is normalised.
//
// Where the partials live. Not in the staging, which peers may still be reading in this
// launch (there is no closing barrier). The result area: the one-shot's peers never read it,
// and no other launch touches it meanwhile. A peer's earlier launch that read or wrote it
// (a two-shot's gather, a fused kernel's exchange half) has ended: this block passed the first
// barrier with every peer, which that peer reached in this launch. A peer's later launch
// writes it only after this rank finished this one (barrier.cuh, "Finished launches";
// fused_flags.cuh, "Exchange areas"). Each partial is written by the block of its unit
// only, and read by the rank's blocks after meet_rank_blocks, which orders every block's
// partial stores before (barrier.cuh). A unit is at least one 16-byte vector, so the units'
// floats fit in the result area (capacity bytes, as the staging).
__device__ __forceinline__ float *partials_of(const tpfuse_peers &peers, const tpfuse_group_args &g) {
  return reinterpret_cast<float *>(static_cast<char *>(peers.data[g.rank]) + g.capacity);
}

// The sum of squares of unit u's row: its segments' partials added in segment order from 0
// (the standalone kernel's order), read after the rank's blocks met.
template <typename T>
__device__ __forceinline__ float row_sum_of_partials(const Segments<T> &seg, const float *partials, size_t u) {
  const size_t first = seg.row(u) * seg.per_row;
  float sum = 0.f;
  for (size_t s = 0; s < seg.per_row; ++s) sum += ld_global(partials + first + s);
  return sum;
}

template <typename T>
__device__ __forceinline__ bool normalize_units(BlockBarrier &barrier, const Segments<T> &seg, Range units,
                                                float *partials, const T *gamma, float eps, T *out) {
  // A unit's elements were written in reduce_range by other threads of the block where the
  // range crosses a short last segment: this barrier orders those writes before the reads.
  __syncthreads();
  for (size_t u = units.begin; u < units.end; ++u) {
    const float partial = segment_sum_of_squares(out, seg.begin(u), seg.end(u));
    if (threadIdx.x == 0) st_global(partials + u, partial);
  }
  if (!barrier.meet_rank_blocks()) return false;
  for (size_t u = units.begin; u < units.end; ++u) {
    const float rstd = rstd_of(row_sum_of_partials(seg, partials, u), seg.hidden, eps);
    normalize_segment(out, gamma, rstd, out, seg.row(u) * seg.hidden, seg.begin(u), seg.end(u));
  }
  return true;
}

// One-shot with RMSNorm where a row is one segment (hidden <= kSegment): the block's units are
// whole rows, so it normalises each alone, from registers. Thread t holds vector t of the row
// (segment_sum_of_squares's virtual thread t: the kernel runs kThreads threads), reduced
// through the epilogue, its squares added by the segment's tree (held_sum_of_squares), then
// normalised and stored once, with `gamma_held`, the thread's vector of gamma (the same in
// every row, loaded before the first barrier). No partial is stored and the rank's blocks do
// not meet. The same bits as normalize_units: the same reduction, tree, sum (0 + the one
// partial), rstd and element arithmetic.
template <typename T, int W>
__device__ __forceinline__ void reduce_and_normalize_rows(const tpfuse_peers &peers, const Segments<T> &seg,
                                                          Range units, const Epilogue<T> &epi, bool held,
                                                          const Vec16<T> &gamma_held, float eps, T *out) {
  for (size_t u = units.begin; u < units.end; ++u) {
    const size_t i = u * seg.hidden + threadIdx.x * Vec16<T>::kLen;
    Vec16<T> h;
    if (held) h = reduce_vector<T, W>(peers, W, 0, i, epi);
    float sum = 0.f;
    sum += held_sum_of_squares(h, held);
    const float rstd = rstd_of(sum, seg.hidden, eps);
    if (held) store16(out + i, normalize_vector(h, gamma_held, rstd));
  }
}

// One-shot with RMSNorm over rows of several segments, for a block whose share is one segment
// u: thread t reduces vector t of it into `h` (`held` when the vector lies in the segment) and
// the block adds their squares with the segment's tree into `partial`; normalize_held_segment
// finishes. The same bits as normalize_units.
template <typename T, int W>
__device__ __forceinline__ void reduce_held_segment(const tpfuse_peers &peers, const Segments<T> &seg, size_t u,
                                                    const Epilogue<T> &epi, bool held, Vec16<T> &h,
                                                    float &partial) {
  if (held) h = reduce_vector<T, W>(peers, W, 0, seg.begin(u) + threadIdx.x * Vec16<T>::kLen, epi);
  partial = held_sum_of_squares(h, held);
}

// After reduce_held_segment: the segment's partial into the result area (partials_of says why
// that is safe), the rank's blocks meet, then the row's partials added in segment order and
// the held vector normalised and stored (out written once). False when the meeting failed.
template <typename T>
__device__ __forceinline__ bool normalize_held_segment(BlockBarrier &barrier, const Segments<T> &seg, size_t u,
                                                       float *partials, bool held, const Vec16<T> &h, float partial,
                                                       const Vec16<T> &gamma_held, float eps, T *out) {
  if (threadIdx.x == 0) st_global(partials + u, partial);
  const bool met = barrier.meet_rank_blocks(); // the other segments' partials, stored before
  if (!met) return false;
  const float rstd = rstd_of(row_sum_of_partials(seg, partials, u), seg.hidden, eps);
  if (held) store16(out + seg.begin(u) + threadIdx.x * Vec16<T>::kLen, normalize_vector(h, gamma_held, rstd));
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    one_shot_kernel(const __grid_constant__ tpfuse_peers peers,
                    const __grid_constant__ tpfuse_group_args g, uint32_t descriptor, const T *input,
                    const T *bias, T *residual, const T *gamma, float eps, T *out, size_t rows,
                    size_t hidden) {
  TPFUSE_SHARED(BarrierState, state);
  BlockBarrier barrier(peers, g, descriptor, &state);
  const size_t n = rows * hidden;
  // An even share of 16-byte vectors; with RMSNorm an even share of row segments.
  const Segments<T> seg{hidden, segments_per_row<T>(hidden)};
  const Range units = share(gamma != nullptr ? rows * seg.per_row : (n + Vec16<T>::kLen - 1) / Vec16<T>::kLen,
                            blockIdx.x, gridDim.x);
  const Range r = gamma != nullptr ? seg.elements(units) : element_range<T>(units, n);
  if (barrier.poisoned()) return give_up(barrier, out, residual, r);
  const Epilogue<T> epi{bias, residual, hidden};
  // With RMSNorm the reduced vectors stay in registers where the block holds whole rows of one
  // segment (whole_rows) or one segment of longer rows (one_segment); the thread's gamma
  // vector (its column's: the same in every row of a whole-rows block) is loaded now, before
  // the barrier.
  const bool whole_rows = gamma != nullptr && seg.per_row == 1;
  const bool one_segment = gamma != nullptr && seg.per_row > 1 && units.end - units.begin == 1;
  const size_t gamma_col = units.begin % seg.per_row * kSegment<T> + threadIdx.x * Vec16<T>::kLen;
  // (The grid has no more blocks than segments: every block has a unit.)
  const bool held = (whole_rows || one_segment) &&
                    seg.begin(units.begin) + threadIdx.x * Vec16<T>::kLen < seg.end(units.begin);
  Vec16<T> gamma_held, h;
  float partial = 0.f;
  if (held) gamma_held = load16(gamma + gamma_col);
  copy_range(input, static_cast<T *>(peers.data[g.rank]), r);
  if (!barrier.arrive_and_wait()) return give_up(barrier, out, residual, r);
  if (whole_rows) {
    with_world(g.world, [&](auto w) {
      reduce_and_normalize_rows<T, decltype(w)::value>(peers, seg, units, epi, held, gamma_held, eps, out);
    });
  } else if (one_segment) {
    with_world(g.world, [&](auto w) {
      reduce_held_segment<T, decltype(w)::value>(peers, seg, units.begin, epi, held, h, partial);
    });
  } else {
    reduce_range(peers, g.world, 0, r, epi, out, static_cast<T *>(nullptr));
  }
  if (gamma != nullptr && !whole_rows) {
    float *partials = partials_of(peers, g);
    const bool normalized = one_segment ? normalize_held_segment(barrier, seg, units.begin, partials, held, h,
                                                                 partial, gamma_held, eps, out)
                                        : normalize_units(barrier, seg, units, partials, gamma, eps, out);
    if (!normalized) return give_up(barrier, out, residual, r);
  }
  barrier.finish();
}

// Slice p of the data (rank p reduces it), and block b's chunk of it, in elements.
template <typename T>
__device__ __forceinline__ Range chunk(size_t n, int p, int world, size_t b, size_t blocks) {
  const size_t units = (n + Vec16<T>::kLen - 1) / Vec16<T>::kLen;
  const Range slice = share(units, p, world);
  const Range part = share(slice.end - slice.begin, b, blocks);
  return element_range<T>(Range{slice.begin + part.begin, slice.begin + part.end}, n);
}

// The two-shot's gather: block b's chunk of every other rank's slice, from that rank's
// published result (element offset `result_offset` of its buffer), into out and the
// residual. A thread's j-th vector of the chunks of a wave of up to four ranks is loaded before
// any of them is stored (the chunks of a block are about equally long, so a thread waits a peer
// latency per vector of one chunk and wave: two at W = 8, where it waited seven one rank after
// another). Four, not W: eight ranks' chunk bounds and vectors held at once took the kernel
// past the 128 registers its 512 threads allow (a stack frame on sm_100a). The residual takes
// the loaded values, not a second read of out or of the link.
template <typename T, int W>
__device__ __forceinline__ void gather_chunks(const tpfuse_peers &peers, int rank, size_t result_offset, size_t n,
                                              T *out, T *residual) {
  constexpr size_t kVec = Vec16<T>::kLen;
  constexpr int kWave = W < 4 ? W : 4;
#pragma unroll
  for (int first = 0; first < W; first += kWave) {
    Range r[kWave]; // the wave's chunks (empty past the last rank)
    size_t longest = 0; // elements of the wave's longest chunk
#pragma unroll
    for (int j = 0; j < kWave; ++j) {
      const int p = first + j;
      r[j] = p < W ? chunk<T>(n, p, W, blockIdx.x, gridDim.x) : Range{0, 0};
      if (p != rank) longest = max(longest, r[j].end - r[j].begin);
    }
    // Whether rank first + j's chunk holds a whole vector at element i of it.
    const auto has = [&](int j, size_t i) { return first + j != rank && r[j].begin + i + kVec <= r[j].end; };
    for (size_t i = threadIdx.x * kVec; i < longest; i += kThreads * kVec) {
      uint4 v[kWave];
#pragma unroll
      for (int j = 0; j < kWave; ++j) {
        const T *result_p = static_cast<const T *>(peers.data[first + j]) + result_offset + r[j].begin + i;
        if (has(j, i)) v[j] = ld_global_cg(reinterpret_cast<const uint4 *>(result_p));
      }
#pragma unroll
      for (int j = 0; j < kWave; ++j) {
        const size_t at = r[j].begin + i;
        if (!has(j, i)) continue;
        st_global(reinterpret_cast<uint4 *>(out + at), v[j]);
        if (residual != nullptr) st_global(reinterpret_cast<uint4 *>(residual + at), v[j]);
      }
    }
    // The elements past the last whole vector (only the last chunk of the data has any).
    for (int j = 0; j < kWave; ++j) {
      if (first + j == rank) continue;
      const size_t tail = r[j].begin + (r[j].end - r[j].begin) / kVec * kVec;
      const T *result_p = static_cast<const T *>(peers.data[first + j < W ? first + j : 0]) + result_offset;
      for (size_t i = tail + threadIdx.x; i < r[j].end; i += kThreads) {
        const T x = ld_global_cg(result_p + i);
        st_global(out + i, x);
        if (residual != nullptr) st_global(residual + i, x);
      }
    }
  }
}

// A two-shot block gives up: its chunk of every slice of out and residual.
template <typename T>
__device__ __forceinline__ void give_up_chunks(const BlockBarrier &barrier, int world, T *out,
                                               T *residual, size_t n) {
  for (int p = 0; p < world; ++p) {
    const Range r = chunk<T>(n, p, world, blockIdx.x, gridDim.x);
    if (p == 0) barrier.publish_failure();
    mark_failed(out, r.begin, r.end);
    mark_failed(residual, r.begin, r.end);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    two_shot_kernel(const __grid_constant__ tpfuse_peers peers,
                    const __grid_constant__ tpfuse_group_args g, uint32_t descriptor, const T *input,
                    const T *bias, T *residual, T *out, size_t rows, size_t hidden) {
  TPFUSE_SHARED(BarrierState, state);
  BlockBarrier barrier(peers, g, descriptor, &state);
  const size_t n = rows * hidden;
  if (barrier.poisoned()) return give_up_chunks(barrier, g.world, out, residual, n);
  T *staging = static_cast<T *>(peers.data[g.rank]);
  for (int p = 0; p < g.world; ++p) {
    copy_range(input, staging, chunk<T>(n, p, g.world, blockIdx.x, gridDim.x));
  }
  if (!barrier.arrive_and_wait()) return give_up_chunks(barrier, g.world, out, residual, n);
  const size_t result_offset = g.capacity / sizeof(T);
  reduce_range(peers, g.world, 0, chunk<T>(n, g.rank, g.world, blockIdx.x, gridDim.x),
               Epilogue<T>{bias, residual, hidden}, out, staging + result_offset);
  if (!barrier.arrive_and_wait()) return give_up_chunks(barrier, g.world, out, residual, n);
  with_world(g.world, [&](auto w) {
    gather_chunks<T, decltype(w)::value>(peers, g.rank, result_offset, n, out, residual);
  });
  barrier.finish();
}

__global__ void __launch_bounds__(kThreads, 1)
    all_gather_kernel(const __grid_constant__ tpfuse_peers peers,
                      const __grid_constant__ tpfuse_group_args g, uint32_t descriptor,
                      const uint4 *input, uint4 *out, size_t len_vectors) {
  TPFUSE_SHARED(BarrierState, state);
  BlockBarrier barrier(peers, g, descriptor, &state);
  const Range r = share(len_vectors, blockIdx.x, gridDim.x);
  // Gives up: this block's range of every rank's part of out.
  const auto give_up_gather = [&] {
    barrier.publish_failure();
    for (int p = 0; p < g.world; ++p) {
      mark_failed(reinterpret_cast<uint16_t *>(out + p * len_vectors), r.begin * 8, r.end * 8);
    }
  };
  if (barrier.poisoned()) return give_up_gather();
  uint4 *staging = static_cast<uint4 *>(peers.data[g.rank]);
  copy_vectors(
      r.begin + threadIdx.x, r.end, kThreads, [&](size_t i) { return ld_global(input + i); },
      [&](size_t i, const uint4 &v) { st_global(staging + i, v); });
  if (!barrier.arrive_and_wait()) return give_up_gather();
  // Every rank's vector i is loaded before any is stored (W loads in flight, through L2).
  for (size_t i = r.begin + threadIdx.x; i < r.end; i += kThreads) {
    uint4 v[TPFUSE_MAX_RANKS];
#pragma unroll
    for (int p = 0; p < TPFUSE_MAX_RANKS; ++p)
      if (p < g.world) v[p] = ld_global_cg(static_cast<const uint4 *>(peers.data[p]) + i);
#pragma unroll
    for (int p = 0; p < TPFUSE_MAX_RANKS; ++p) {
      uint4 *dst = out + p * len_vectors;
      if (p < g.world) st_global(dst + i, v[p]);
    }
  }
  barrier.finish();
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    reduce_scatter_kernel(const __grid_constant__ tpfuse_peers peers,
                          const __grid_constant__ tpfuse_group_args g, uint32_t descriptor,
                          const T *input, T *out, size_t len) {
  TPFUSE_SHARED(BarrierState, state);
  BlockBarrier barrier(peers, g, descriptor, &state);
  T *staging = static_cast<T *>(peers.data[g.rank]);
  const size_t units = (len + Vec16<T>::kLen - 1) / Vec16<T>::kLen;
  const Range part = element_range<T>(share(units, blockIdx.x, gridDim.x), len);
  if (barrier.poisoned()) return give_up(barrier, out, static_cast<T *>(nullptr), part);
  for (int p = 0; p < g.world; ++p) {
    copy_range(input + p * len, staging + p * len, part);
  }
  if (!barrier.arrive_and_wait()) return give_up(barrier, out, static_cast<T *>(nullptr), part);
  // Reduce slice `rank` (offset rank * len in every staging buffer) into out[0, len).
  reduce_range(peers, g.world, static_cast<size_t>(g.rank) * len, part,
               Epilogue<T>{nullptr, nullptr, 1}, out, static_cast<T *>(nullptr));
  barrier.finish();
}

// The kinds of launch a descriptor tells apart.
constexpr uint64_t kKindAllReduce = 1; // + algo
constexpr uint64_t kKindAllGather = 8;
constexpr uint64_t kKindReduceScatter = 9;

// Host: the grid of a collective whose message is `vectors` 16-byte vectors per rank (the
// all-reduce's and the all-gather's input, the reduce-scatter's output): a block per
// kThreads vectors (one vector per thread), at least 1, at most the group's budget, so an
// 8 KB message does not pay a full budget of blocks' barriers. It depends only on the
// message and the budget, so every rank computes the same grid (and the first barrier
// checks it: the grid is part of the descriptor).
int grid_for_message(size_t vectors, int budget) {
  const size_t wanted = (vectors + kThreads - 1) / kThreads;
  return wanted < 1 ? 1 : wanted > static_cast<size_t>(budget) ? budget : static_cast<int>(wanted);
}

bool valid(const tpfuse_group_args *g) {
  return g != nullptr && g->world >= 2 && g->world <= TPFUSE_MAX_RANKS && g->rank >= 0 &&
         g->rank < g->world && g->blocks >= 1 && g->blocks <= TPFUSE_MAX_BLOCKS;
}

// Host: whether rows x cols elements of `elem` bytes fit in `capacity` bytes, without forming
// the product (sizes near SIZE_MAX would wrap it to something small). The entry points check
// every message against the staging this way before they launch: past the staging lie the
// result area and a peer's memory, which the kernel would write and the peers would read.
bool fits2(size_t rows, size_t cols, size_t elem, uint64_t capacity) {
  const uint64_t elems = capacity / elem;
  return cols == 0 || (cols <= elems && rows <= elems / cols);
}

// Host: a float's bit pattern (what the descriptor compares: -0.0 and 0.0 differ, as they
// could in the result).
uint64_t float_bits(float x) {
  uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

template <typename T>
int launch_all_reduce(int algo, const tpfuse_peers &peers, const tpfuse_group_args &g,
                      const void *input, const void *bias, void *residual, const void *gamma,
                      float eps, void *out, size_t rows, size_t hidden, cudaStream_t stream) {
  const T *in = static_cast<const T *>(input);
  const T *b = static_cast<const T *>(bias);
  T *res = static_cast<T *>(residual);
  const T *gam = static_cast<const T *>(gamma);
  T *o = static_cast<T *>(out);
  // Refused before any launch (cudaErrorInvalidValue): a message larger than the staging, a
  // pointer the kernels' 16-byte vector accesses would fault on, or rows that a per-column
  // operand (bias, gamma) cannot be read along in whole vectors.
  if (!fits2(rows, hidden, sizeof(T), g.capacity)) return cudaErrorInvalidValue;
  if (!is_aligned16(input) || !is_aligned16(out) || !is_aligned16(bias) || !is_aligned16(residual) ||
      !is_aligned16(gamma)) {
    return cudaErrorInvalidValue;
  }
  if ((bias != nullptr || gamma != nullptr) && hidden % Vec16<T>::kLen != 0) return cudaErrorInvalidValue;
  if (g.packet_bytes > TPFUSE_PACKET_HALF_BYTES) return cudaErrorInvalidValue;
  int grid = grid_for_message((rows * hidden * sizeof(T) + 15) / 16, g.blocks);
  // The one-shot by packets where asked and they fit (all_reduce_packets.cu): a block per 512
  // vectors as here, with RMSNorm whole rows a block; else by flags.
  if (algo == TPFUSE_ALGO_ONE_SHOT_PACKETS) {
    if (one_shot_by_packets(g, sizeof(T), rows, hidden, gamma != nullptr)) {
      if (gamma != nullptr && rows < static_cast<size_t>(grid)) grid = static_cast<int>(rows);
      return launch_one_shot_packets<T>(peers, g, grid, in, b, res, gam, eps, o, rows, hidden, stream);
    }
    algo = TPFUSE_ALGO_ONE_SHOT;
  }
  // One-shot with RMSNorm hands row segments to blocks: no more blocks than segments (a
  // guard: a message's segments are never fewer than its 512-vector blocks), and over rows of
  // several segments a block per segment up to the budget, so that each holds its segment in
  // registers (a short last segment makes them more than the 512-vector blocks: 6144 = 4096
  // + 2048).
  const size_t per_row = segments_per_row<T>(hidden);
  const size_t units = rows * per_row;
  if (algo == TPFUSE_ALGO_ONE_SHOT && gamma != nullptr) {
    if (per_row > 1) grid = static_cast<int>(units < static_cast<size_t>(g.blocks) ? units : g.blocks);
    else if (units < static_cast<size_t>(grid)) grid = static_cast<int>(units);
  }
  // eps (its bits) is part of what the ranks must agree on when there is an RMSNorm: ranks
  // with different eps would give different bits. The two-shot's RMSNorm runs in a kernel of
  // its own after, so the two-shot kernel's descriptor carries it for that kernel's sake.
  const uint32_t descriptor =
      launch_descriptor({kKindAllReduce + static_cast<uint64_t>(algo), Elem<T>::kDtype, rows, hidden,
                         static_cast<uint64_t>(grid), bias != nullptr, residual != nullptr,
                         gamma != nullptr, gamma != nullptr ? float_bits(eps) : 0});
  if (algo == TPFUSE_ALGO_ONE_SHOT && gamma != nullptr) {
    // Cooperative: the RMSNorm's blocks meet (meet_rank_blocks, for rows of several segments),
    // so they must all be resident.
    return launch_result(TPFUSE_LAUNCH_COOPERATIVE(one_shot_kernel<T>, grid, kThreads, 0, stream)(
        peers, g, descriptor, in, b, res, gam, eps, o, rows, hidden));
  } else if (algo == TPFUSE_ALGO_ONE_SHOT) {
    TPFUSE_LAUNCH(one_shot_kernel<T>, grid, kThreads, 0, stream)(peers, g, descriptor, in, b, res, gam,
                                                                 eps, o, rows, hidden);
  } else if (algo == TPFUSE_ALGO_TWO_SHOT) {
    TPFUSE_LAUNCH(two_shot_kernel<T>, grid, kThreads, 0, stream)(peers, g, descriptor, in, b, res, o,
                                                                 rows, hidden);
    if (gam != nullptr) {
      const FailureWords failure{Pad{peers.signals[g.rank]}.error(), g.host_error};
      const int code = launch_rms_norm<T>(o, gam, eps, o, rows, hidden, stream, failure);
      if (code != cudaSuccess) return code;
    }
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T> void add_all_reduce_kernels(KernelList &list) {
  list.add(one_shot_kernel<T>);
  list.add(two_shot_kernel<T>);
  list.add(reduce_scatter_kernel<T>);
}

} // namespace

void all_reduce_kernels(KernelList &list) {
  add_all_reduce_kernels<float>(list);
  add_all_reduce_kernels<__half>(list);
  add_all_reduce_kernels<__nv_bfloat16>(list);
  list.add(all_gather_kernel);
}

} // namespace tpfuse

extern "C" int tpfuse_all_reduce(tpfuse_dtype dtype, int32_t algo, const tpfuse_peers *peers,
                                 const tpfuse_group_args *group, const void *input,
                                 const void *bias, void *residual, const void *gamma, float eps,
                                 void *out, size_t rows, size_t hidden, void *stream) {
  using namespace tpfuse;
  if (peers == nullptr || !valid(group) || rows == 0 || hidden == 0) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
  case TPFUSE_DTYPE_F32:
    return launch_all_reduce<float>(algo, *peers, *group, input, bias, residual, gamma, eps,
                                    out, rows, hidden, s);
  case TPFUSE_DTYPE_F16:
    return launch_all_reduce<__half>(algo, *peers, *group, input, bias, residual, gamma, eps,
                                     out, rows, hidden, s);
  case TPFUSE_DTYPE_BF16:
    return launch_all_reduce<__nv_bfloat16>(algo, *peers, *group, input, bias, residual, gamma,
                                            eps, out, rows, hidden, s);
  default: return cudaErrorInvalidValue;
  }
}

extern "C" int tpfuse_all_gather(const tpfuse_peers *peers, const tpfuse_group_args *group,
                                 const void *input, void *out, size_t len_bytes, void *stream) {
  using namespace tpfuse;
  if (peers == nullptr || !valid(group) || len_bytes % 16 != 0) return cudaErrorInvalidValue;
  // The staging holds this rank's len_bytes; both pointers take 16-byte vectors.
  if (len_bytes > group->capacity || !is_aligned16(input) || !is_aligned16(out)) return cudaErrorInvalidValue;
  if (len_bytes == 0) return cudaSuccess;
  const int grid = grid_for_message(len_bytes / 16, group->blocks);
  const uint32_t descriptor = launch_descriptor({kKindAllGather, len_bytes, static_cast<uint64_t>(grid)});
  TPFUSE_LAUNCH(all_gather_kernel, grid, kThreads, 0, static_cast<cudaStream_t>(stream))(
      *peers, *group, descriptor, static_cast<const uint4 *>(input), static_cast<uint4 *>(out),
      len_bytes / 16);
  return cudaGetLastError();
}

extern "C" int tpfuse_reduce_scatter(tpfuse_dtype dtype, const tpfuse_peers *peers,
                                     const tpfuse_group_args *group, const void *input,
                                     void *out, size_t len, void *stream) {
  using namespace tpfuse;
  if (peers == nullptr || !valid(group)) return cudaErrorInvalidValue;
  if (dtype != TPFUSE_DTYPE_F32 && dtype != TPFUSE_DTYPE_F16 && dtype != TPFUSE_DTYPE_BF16) return cudaErrorInvalidValue;
  // The staging holds the whole input (world x len elements); both pointers, and every
  // rank's slice of the input (len a multiple of a vector), take 16-byte vectors.
  const size_t size = dtype_size(dtype);
  if (!fits2(static_cast<size_t>(group->world), len, size, group->capacity) || (len * size) % 16 != 0 ||
      !is_aligned16(input) || !is_aligned16(out)) {
    return cudaErrorInvalidValue;
  }
  if (len == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int grid = grid_for_message((len * dtype_size(dtype) + 15) / 16, group->blocks);
  const uint32_t d = launch_descriptor({kKindReduceScatter, static_cast<uint64_t>(dtype), len,
                                        static_cast<uint64_t>(grid)});
  switch (dtype) {
  case TPFUSE_DTYPE_F32:
    TPFUSE_LAUNCH(reduce_scatter_kernel<float>, grid, kThreads, 0, s)(
        *peers, *group, d, static_cast<const float *>(input), static_cast<float *>(out), len);
    break;
  case TPFUSE_DTYPE_F16:
    TPFUSE_LAUNCH(reduce_scatter_kernel<__half>, grid, kThreads, 0, s)(
        *peers, *group, d, static_cast<const __half *>(input), static_cast<__half *>(out), len);
    break;
  case TPFUSE_DTYPE_BF16:
    TPFUSE_LAUNCH(reduce_scatter_kernel<__nv_bfloat16>, grid, kThreads, 0, s)(
        *peers, *group, d, static_cast<const __nv_bfloat16 *>(input),
        static_cast<__nv_bfloat16 *>(out), len);
    break;
  default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
