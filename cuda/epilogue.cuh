// epilogue.cuh: what follows the reduction in a transformer layer's row-parallel output:
// + bias, + residual (written back as the new residual), RMSNorm. Shared by the fused
// all-reduce kernels and the standalone kernels of epilogue.cu, so fused and unfused paths
// run the same arithmetic and give the same bits.
#pragma once

#include "common.cuh"
#include "failure.cuh"

namespace tpfuse {

constexpr int kThreads = TPFUSE_ALL_REDUCE_THREADS;

// The element-wise part of the epilogue. The reduction's f32 sum is first rounded to T
// (the all-reduce's own result, exactly what the unfused sequence hands to its next
// kernel), then h = s (+ bias[col]) (+ residual) in f32, rounded once; residual := h when
// given. So the fused kernels and all-reduce-then-epilogue give the same bits.
template <typename T> struct Epilogue {
  const T *bias;
  T *residual;
  size_t hidden;

  __device__ __forceinline__ T apply(float acc, size_t i) const {
    const T sum = Elem<T>::from_f32(acc);
    if (bias == nullptr && residual == nullptr) return sum;
    float h = Elem<T>::to_f32(sum);
    if (bias != nullptr) h += Elem<T>::to_f32(ld_global(bias + i % hidden));
    if (residual != nullptr) h += Elem<T>::to_f32(ld_global(residual + i));
    const T out = Elem<T>::from_f32(h);
    if (residual != nullptr) st_global(residual + i, out);
    return out;
  }

  // apply() of the kLen elements i .. i + kLen - 1 of one 16-byte vector (i a multiple of
  // kLen; with a bias hidden is one too, so the vector lies in one row): the column is
  // computed once, bias and residual move in 16-byte accesses, and each element gets the
  // same arithmetic as apply(), so the same bits.
  __device__ __forceinline__ Vec16<T> apply_vec(const float (&acc)[Vec16<T>::kLen], size_t i) const {
    return apply_loaded(acc, i, operands(i));
  }

  // The bias and residual vectors of vector i, loaded (a reduction issues these loads with its
  // peers' loads, so that they wait one latency together, not one after the other), kept raw
  // until they are used (vec_of: unpacked in the branch that loads them, the first would wait
  // for its load before the second load issues).
  struct Operands {
    uint4 b, r;
  };
  __device__ __forceinline__ Operands operands(size_t i) const {
    Operands o;
    if (bias != nullptr) o.b = ld_global(reinterpret_cast<const uint4 *>(bias + i % hidden));
    if (residual != nullptr) o.r = ld_global(reinterpret_cast<const uint4 *>(residual + i));
    return o;
  }

  // apply_vec with the operands already loaded.
  __device__ __forceinline__ Vec16<T> apply_loaded(const float (&acc)[Vec16<T>::kLen], size_t i,
                                                   const Operands &o) const {
    constexpr int kVec = Vec16<T>::kLen;
    Vec16<T> y = rounded<T>(acc);
    if (bias == nullptr && residual == nullptr) return y;
    const Vec16<T> b = vec_of<T>(o.b), r = vec_of<T>(o.r);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float h = Elem<T>::to_f32(y.v[j]);
      if (bias != nullptr) h += Elem<T>::to_f32(b.v[j]);
      if (residual != nullptr) h += Elem<T>::to_f32(r.v[j]);
      y.v[j] = Elem<T>::from_f32(h);
    }
    if (residual != nullptr) store16(residual + i, y);
    return y;
  }
};

// RMSNorm, out[i] = x[i] * rsqrt(mean(x^2) + eps) * gamma[i] over a row of `hidden` elements
// (a multiple of the vector length), in one fixed order that the fused one-shot kernel and
// the standalone kernel share, so they give the same bits however the work is split:
//
//   - the row is cut into segments of kSegment elements (one 16-byte vector per thread of a
//     block), the last one shorter;
//   - a segment's partial sum of squares: each of kThreads virtual threads takes one vector
//     (fmaf, in element order), the 32 lanes of each virtual warp add with an xor-shuffle
//     tree, and the kThreads / 32 warp sums are added in warp order;
//   - the row's sum: the partials added in segment order from 0 (f32);
//   - then rstd = rsqrt(sum / hidden + eps) and y = x * rstd * gamma per element.
//
// The standalone kernel runs a row's segments in one block; the fused one-shot kernel
// spreads a message's segments over its blocks and adds the partials across blocks; the fused
// GEMM + all-reduce runs whole rows in blocks of fewer threads. A block of kThreads threads
// is one virtual thread per thread; a smaller one (a multiple of 32 threads) runs the
// virtual warps in turns, warp w taking virtual warps w, w + warps, ...: a virtual warp is
// always one real warp's 32 lanes, so the shuffle tree, and so the bits, are the same. The
// turns go in rounds of up to eight whose loads are issued together (kInFlight), so a
// 64- or 128-thread block reads a segment in one load latency, a 32-thread block (the
// small-m-16x16 tile's, which normalises a decode row alone) in two (four with rounds of four).
// A row of few segments is held in registers instead (rms_norm_held_row: kHeldSegments).
template <typename T> constexpr size_t kSegment = static_cast<size_t>(kThreads) * Vec16<T>::kLen;

// Segments of a row of `hidden` elements.
template <typename T> __host__ __device__ __forceinline__ size_t segments_per_row(size_t hidden) {
  return (hidden + kSegment<T> - 1) / kSegment<T>;
}

// One vector's sum of squares, as a virtual thread adds it (fmaf, in element order).
template <typename T> __device__ __forceinline__ float squares_of(const Vec16<T> &v) {
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < Vec16<T>::kLen; ++j) {
    const float f = Elem<T>::to_f32(v.v[j]);
    ss = fmaf(f, f, ss);
  }
  return ss;
}

// A virtual warp's sum: its 32 lanes' values added with the xor-shuffle tree (every lane
// gets it).
__device__ __forceinline__ float warp_tree(float ss) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, offset);
  return ss;
}

// The warp sums of one segment (warp_sums[w], w < kThreads / 32) added in warp order, the
// same value in every thread; the __syncthreads before orders the stores, the one after
// frees warp_sums for the next segment.
__device__ __forceinline__ float warp_sums_total(const float *warp_sums) {
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  __syncthreads();
  return total;
}

// The virtual warps a thread of a block of kBlock threads runs (kBlock a multiple of 32
// dividing kThreads), and how many of them issue their loads together: a block's loads of a
// segment go out in rounds of kInFlight turns (registers: kInFlight vectors, two in
// normalize_segment), not one turn after another. Eight: a 32-thread block's 16 turns in two
// rounds (four took four rounds, each a dependent L2 latency, twice over: the sum of squares,
// then the normalisation); the 16 x 16 fused kernel held 176-188 registers for it on sm_90a
// (138 with four), 178-207 with the staged row, under what its 64 KiB of shared memory lets
// an SM hold anyway. (It now stages its rows in shared memory: these rounds run for rows past
// its stage.)
template <int kBlock> constexpr int kTurns = kThreads / kBlock;
// (The plan's NORM_TURNS_IN_FLIGHT.)
template <int kBlock> constexpr int kInFlight = kTurns<kBlock> < 8 ? kTurns<kBlock> : 8;
static_assert((kThreads & (kThreads - 1)) == 0, "whole rounds of turns for every block size dividing kThreads");

// Element offset, from a segment's start, of the vector of turn t of the calling thread in a
// block of kBlock threads: virtual thread threadIdx.x + t * kBlock (warp w runs virtual warps
// w, w + kBlock / 32, ...).
template <typename T, int kBlock> __device__ __forceinline__ size_t turn_offset(int t) {
  return (static_cast<size_t>(threadIdx.x) + static_cast<size_t>(t) * kBlock) * Vec16<T>::kLen;
}

// Turn `turn`'s part of a segment's sum of squares: the virtual warp's tree of its lanes'
// vectors (`in`: the vector lies in the segment, else 0), stored by lane 0 at the virtual
// warp's index (warp w of turn t is virtual warp w + t * kBlock / 32), which
// warp_sums_total adds in order: the one place that fixes the tree, so every path's bits.
template <typename T, int kBlock>
__device__ __forceinline__ void turn_squares(float *warp_sums, int turn, const uint4 &raw, bool in) {
  const float ss = warp_tree(in ? squares_of(vec_of<T>(raw)) : 0.f);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32 + turn * (kBlock / 32)] = ss;
}

// The partial sum of squares of elements [begin, end) of x (one segment: at most kSegment,
// begin vector-aligned), the same value in every thread of the block, which has kBlock threads
// (blockDim.x == kBlock). Each round of turns issues its loads before its first tree.
template <typename T, int kBlock = kThreads>
__device__ __forceinline__ float segment_sum_of_squares(const T *x, size_t begin, size_t end) {
  static_assert(kBlock % 32 == 0 && kThreads % kBlock == 0, "whole virtual warps a warp");
  constexpr int kWarps = kThreads / 32, kRound = kInFlight<kBlock>;
  TPFUSE_SHARED(float[kWarps], warp_sums);
#pragma unroll
  for (int first = 0; first < kTurns<kBlock>; first += kRound) {
    uint4 raw[kRound];
#pragma unroll
    for (int t = 0; t < kRound; ++t) {
      const size_t i = begin + turn_offset<T, kBlock>(first + t);
      if (i < end) raw[t] = ld_global(reinterpret_cast<const uint4 *>(x + i));
    }
#pragma unroll
    for (int t = 0; t < kRound; ++t)
      turn_squares<T, kBlock>(warp_sums, first + t, raw[t], begin + turn_offset<T, kBlock>(first + t) < end);
  }
  return warp_sums_total(warp_sums);
}

// segment_sum_of_squares of a segment whose vectors the threads hold in registers, in a
// block of kThreads threads: thread t (virtual thread t) holds vector t, `held` when that
// vector lies in the segment. The same tree, so the same bits, without reading the segment
// again.
template <typename T> __device__ __forceinline__ float held_sum_of_squares(const Vec16<T> &v, bool held) {
  TPFUSE_SHARED(float[kThreads / 32], warp_sums);
  const float ss = warp_tree(held ? squares_of(v) : 0.f);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = ss;
  return warp_sums_total(warp_sums);
}

// The row's rstd from the sum of its segments' partials (added in segment order from 0).
__device__ __forceinline__ float rstd_of(float sum_of_squares, size_t hidden, float eps) {
  return rsqrtf(sum_of_squares / static_cast<float>(hidden) + eps);
}

// y = x * rstd * gamma of one vector (gamma's vector of the same columns).
template <typename T>
__device__ __forceinline__ Vec16<T> normalize_vector(const Vec16<T> &v, const Vec16<T> &g, float rstd) {
  Vec16<T> y;
#pragma unroll
  for (int j = 0; j < Vec16<T>::kLen; ++j) {
    y.v[j] = Elem<T>::from_f32(Elem<T>::to_f32(v.v[j]) * rstd * Elem<T>::to_f32(g.v[j]));
  }
  return y;
}

// y = x * rstd * gamma[col] for the elements [begin, end) of one segment (at most kSegment)
// of a row that starts at element `row_begin`, by a block of kBlock threads (x == out allowed:
// each thread reads its vectors, then writes them). Each round of turns issues its loads of x
// and gamma before its first store.
template <typename T, int kBlock = kThreads>
__device__ __forceinline__ void normalize_segment(const T *x, const T *gamma, float rstd, T *out, size_t row_begin,
                                                  size_t begin, size_t end) {
  constexpr int kRound = kInFlight<kBlock>;
#pragma unroll
  for (int first = 0; first < kTurns<kBlock>; first += kRound) {
    uint4 xs[kRound], gs[kRound];
#pragma unroll
    for (int t = 0; t < kRound; ++t) {
      const size_t i = begin + turn_offset<T, kBlock>(first + t);
      if (i < end) {
        xs[t] = ld_global(reinterpret_cast<const uint4 *>(x + i));
        gs[t] = ld_global(reinterpret_cast<const uint4 *>(gamma + (i - row_begin)));
      }
    }
#pragma unroll
    for (int t = 0; t < kRound; ++t) {
      const size_t i = begin + turn_offset<T, kBlock>(first + t);
      if (i < end) store16(out + i, normalize_vector(vec_of<T>(xs[t]), vec_of<T>(gs[t]), rstd));
    }
  }
}

// The segments of a row of T a block of kBlock threads normalises from registers
// (rms_norm_held_row): two of 16-bit elements in the standalone kernel's kThreads (a row of
// 8192 in four vectors a thread, under the 64 registers that two blocks an SM leave it; f32's
// two, and four of 16-bit elements, spilled there); one where a segment's turns fit a round
// of kInFlight (f32 in kThreads, and blocks of 64 to 256 threads: the fused GEMM +
// all-reduce's tiles, where two segments took the 16 x 64 kernel from 140 to 176 registers on
// sm_90a, from three blocks an SM to two); none in a block of 32 threads.
template <typename T, int kBlock>
constexpr int kHeldSegments = kBlock >= kThreads && sizeof(T) == 2 ? 2 : kTurns<kBlock> <= kInFlight<kBlock> ? 1 : 0;

// The RMSNorm of a row of at most kHeldSegments segments by a block of kBlock threads, x == out
// allowed: every vector of x and gamma the thread's turns cover loaded together once, each
// segment's squares summed from the registers (its tree, stored and added in warp order),
// the partials added in segment order from 0, then the row normalised from the registers and
// stored. One load latency, where segment_sum_of_squares then normalize_segment take two per
// segment (x read twice). The same bits as the loop: the same vectors, trees, orders.
// Registers: two vectors a turn of each held segment.
template <typename T, int kBlock>
__device__ __forceinline__ void rms_norm_held_row(const T *x, const T *gamma, float eps, T *out, size_t hidden) {
  constexpr int kTurnsOf = kTurns<kBlock>, kHeld = kHeldSegments<T, kBlock> * kTurnsOf;
  static_assert(kTurnsOf <= kInFlight<kBlock>, "a segment's turns in one round");
  TPFUSE_SHARED(float[kThreads / 32], warp_sums);
  // Vector h: segment h / kTurnsOf, turn h % kTurnsOf.
  const auto at = [](int h) {
    return static_cast<size_t>(h / kTurnsOf) * kSegment<T> + turn_offset<T, kBlock>(h % kTurnsOf);
  };
  uint4 xs[kHeld], gs[kHeld];
#pragma unroll
  for (int h = 0; h < kHeld; ++h) {
    if (at(h) < hidden) {
      xs[h] = ld_global(reinterpret_cast<const uint4 *>(x + at(h)));
      gs[h] = ld_global(reinterpret_cast<const uint4 *>(gamma + at(h)));
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < kHeldSegments<T, kBlock>; ++s) {
    if (static_cast<size_t>(s) * kSegment<T> >= hidden) break; // the same for every thread
#pragma unroll
    for (int t = 0; t < kTurnsOf; ++t) {
      const int h = s * kTurnsOf + t;
      turn_squares<T, kBlock>(warp_sums, t, xs[h], at(h) < hidden);
    }
    sum += warp_sums_total(warp_sums);
  }
  const float rstd = rstd_of(sum, hidden, eps);
#pragma unroll
  for (int h = 0; h < kHeld; ++h) {
    if (at(h) < hidden) store16(out + at(h), normalize_vector(vec_of<T>(xs[h]), vec_of<T>(gs[h]), rstd));
  }
}

// Shared memory a block lends its RMSNorm (the fused GEMM + all-reduce's, once its GEMM is
// done): `bytes` from `at`, 16-byte aligned. A row of hidden elements is staged there when
// its x and gamma fit (staged_row_bytes); none by default (the standalone kernel).
struct NormStage {
  unsigned char *at = nullptr;
  size_t bytes = 0;
};

// Bytes of a staged row: its x, then its gamma.
template <typename T> __host__ __device__ constexpr size_t staged_row_bytes(size_t hidden) {
  return 2 * hidden * sizeof(T);
}

// cp.async of the vectors of elements [0, hidden) of src (global, this GPU's) into dst (shared),
// thread t copying vectors t, t + kBlock, ...: the vectors rms_norm_staged has thread t read
// (virtual thread t + j·kBlock's, kSegment a multiple of kBlock vectors), so a thread reads back
// only its own copies, which its cp.async.wait_group makes visible to it: no barrier between.
template <typename T, int kBlock> __device__ __forceinline__ void stage_async(T *dst, const T *src, size_t hidden) {
  constexpr int kVec = Vec16<T>::kLen;
#pragma unroll 1
  for (size_t i = static_cast<size_t>(threadIdx.x) * kVec; i < hidden; i += static_cast<size_t>(kBlock) * kVec)
    cp_async_16(smem_u32(dst + i), src + i, true);
}

// The RMSNorm of a row staged in shared memory (xs and gs: its x and gamma, hidden elements
// each; thread t reads vectors t, t + kBlock, ..., which it must have copied or stored itself),
// into out (global; may be x's row). The segment loop's vectors, trees and orders
// (segment_sum_of_squares, then normalize_segment), read from shared memory: the same bits,
// in no load round of its own.
template <typename T, int kBlock>
__device__ __forceinline__ void rms_norm_staged(const T *xs, const T *gs, float eps, T *out, size_t hidden) {
  constexpr int kVec = Vec16<T>::kLen;
  TPFUSE_SHARED(float[kThreads / 32], warp_sums);
  const size_t segments = segments_per_row<T>(hidden);
  float sum = 0.f;
#pragma unroll 1
  for (size_t s = 0; s < segments; ++s) {
#pragma unroll
    for (int t = 0; t < kTurns<kBlock>; ++t) {
      const size_t i = s * kSegment<T> + turn_offset<T, kBlock>(t);
      const bool in = i < hidden;
      turn_squares<T, kBlock>(warp_sums, t, in ? *reinterpret_cast<const uint4 *>(xs + i) : uint4{}, in);
    }
    sum += warp_sums_total(warp_sums);
  }
  const float rstd = rstd_of(sum, hidden, eps);
#pragma unroll 1
  for (size_t i = static_cast<size_t>(threadIdx.x) * kVec; i < hidden; i += static_cast<size_t>(kBlock) * kVec)
    store16(out + i, normalize_vector(vec_of<T>(*reinterpret_cast<const uint4 *>(xs + i)),
                                      vec_of<T>(*reinterpret_cast<const uint4 *>(gs + i)), rstd));
}

// The RMSNorm of one row through `stage` (staged_row_bytes(hidden) fit), into out: gamma
// copied in (cp.async), the row put beside it by fill(xs) (each thread the vectors stage_async
// gives it: cp.async of them, or its own stores), then rms_norm_staged. Every vector in
// flight at once, no register holding them: one load round, x read once, for a row of any
// number of segments that fits, where the segment loop takes two rounds a segment (turns
// past kInFlight more).
// Ordering: each cp.async reads its source as a weak load of the issuing thread, after
// everything before it in program order: whatever made x's stores visible to the block before
// the call (an acquire, then a __syncthreads) orders them before these reads, as it does the
// loop's ld.global. A thread reads back only its own copies (stage_async), visible to it once
// its cp.async.wait_group returns. The leading __syncthreads orders this row's copies, whose
// writes land asynchronously, after every earlier access to the stage (the GEMM's, and the
// previous row's reads, a thread's own vectors again): bar.sync completes only once the
// thread's earlier memory accesses are performed, and the thread requests none after it
// before it completes (PTX ISA, bar.sync).
template <typename T, int kBlock, typename Fill>
__device__ __forceinline__ void rms_norm_through_stage(NormStage stage, const T *gamma, float eps, T *out,
                                                       size_t hidden, Fill fill) {
  T *xs = reinterpret_cast<T *>(stage.at);
  T *gs = xs + hidden; // hidden is a multiple of the vector: gs is 16-byte aligned
  __syncthreads();
  stage_async<T, kBlock>(gs, gamma, hidden);
  fill(xs);
  cp_async_commit();
  cp_async_wait<0>(); // this thread's copies, the vectors it reads
  rms_norm_staged<T, kBlock>(xs, gs, eps, out, hidden);
}

// The RMSNorm of one row of this GPU's memory through `stage`: x copied in with gamma.
template <typename T, int kBlock>
__device__ __forceinline__ void rms_norm_row_staged(const T *x, const T *gamma, float eps, T *out, size_t hidden,
                                                    NormStage stage) {
  rms_norm_through_stage<T, kBlock>(stage, gamma, eps, out, hidden,
                                    [&](T *xs) { stage_async<T, kBlock>(xs, x, hidden); });
}

// The RMSNorm of one row, by one block of kBlock threads (x == out allowed): the standalone
// kernel's, and the fused GEMM + all-reduce's for each row it normalises. A row of at most
// kHeldSegments segments: from registers (rms_norm_held_row); else one that fits `stage`
// through it (rms_norm_row_staged); else segment by segment, each segment's loads in rounds of
// kInFlight turns. Every path gives the same bits.
template <typename T, int kBlock = kThreads>
__device__ __forceinline__ void rms_norm_row(const T *x, const T *gamma, float eps, T *out, size_t hidden,
                                             NormStage stage = NormStage{}) {
  if constexpr (kHeldSegments<T, kBlock> >= 1) {
    if (hidden <= static_cast<size_t>(kHeldSegments<T, kBlock>) * kSegment<T>) {
      rms_norm_held_row<T, kBlock>(x, gamma, eps, out, hidden);
      return;
    }
  }
  if constexpr (kBlock < kThreads) { // the fused kernels' blocks (the standalone kernel lends none)
    if (staged_row_bytes<T>(hidden) <= stage.bytes) {
      rms_norm_row_staged<T, kBlock>(x, gamma, eps, out, hidden, stage);
      return;
    }
  }
  const size_t segments = segments_per_row<T>(hidden);
  float sum = 0.f;
  for (size_t s = 0; s < segments; ++s) {
    sum += segment_sum_of_squares<T, kBlock>(x, s * kSegment<T>, min((s + 1) * kSegment<T>, hidden));
  }
  const float rstd = rstd_of(sum, hidden, eps);
  for (size_t s = 0; s < segments; ++s) {
    normalize_segment<T, kBlock>(x, gamma, rstd, out, 0, s * kSegment<T>, min((s + 1) * kSegment<T>, hidden));
  }
}

// The standalone RMSNorm over rows (one block per row), defined in epilogue.cu. With
// `failure` words (the two-shot all-reduce's RMSNorm) it marks its rows failed instead when
// the group failed (failure.cuh).
template <typename T>
int launch_rms_norm(const T *x, const T *gamma, float eps, T *out, size_t rows, size_t hidden,
                    cudaStream_t stream, FailureWords failure = FailureWords{nullptr, nullptr});

} // namespace tpfuse
