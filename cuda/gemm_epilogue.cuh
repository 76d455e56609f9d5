// gemm_epilogue.cuh: what a GEMM tile does with its f32 accumulators.
//
// The mainloop (gemm_sm80.cuh) ends with every output of the tile as an f32 value in shared
// memory; it then hands the epilogue one run of 8 consecutive columns of one row at a time
// (16 bytes of output), and calls nothing else that writes memory. So an epilogue is the one
// place that decides what happens to a result:
//
//   GemmEpilogue (here):  c[row, col..col+8) = round(acc + bias[col..] + residual[row, col..])
//
// and other epilogues plug in without touching the mainloop: the fused GEMM + all-reduce
// (gemm_all_reduce.cu) stores the rounded partial into the rank's symmetric buffer
// (StagingEpilogue) and signals finished tiles itself, between gemm_tile calls.
#pragma once

#include "common.cuh"

namespace tpfuse {
namespace gemm {

// c = acc (+ bias[col]) (+ residual[row, col]), added in that order in f32 and rounded once to
// T (round to nearest even), like the element-wise epilogue of the all-reduce (epilogue.cuh).
//
// residual may be c itself (in-place accumulate): every output element is read and then
// written by the same thread in the same store8 call, and no other thread touches it. Any
// other overlap between c and an input is the caller's bug (the Rust side rejects it).
template <typename T> struct GemmEpilogue {
  T *c;               // [m, n] row-major
  const T *bias;      // [n] or nullptr
  const T *residual;  // [m, n] row-major, or nullptr; may equal c
  int n;              // row length of c and residual

  // Columns col..col+8 of row `row`; `col` is a multiple of 8 (16-byte aligned, as every
  // pointer is), and the whole run lies inside the matrix.
  __device__ __forceinline__ void store8(int row, int col, const float (&acc)[8]) const {
    const size_t at = static_cast<size_t>(row) * static_cast<size_t>(n) + static_cast<size_t>(col);
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = acc[j];
    if (bias != nullptr) {
      const Vec16<T> b = load16(bias + col);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] += Elem<T>::to_f32(b.v[j]);
    }
    if (residual != nullptr) {
      // A plain (coherent) load: residual may be c, which this kernel writes.
      const Vec16<T> r = load16(residual + at);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] += Elem<T>::to_f32(r.v[j]);
    }
    Vec16<T> out;
#pragma unroll
    for (int j = 0; j < 8; ++j) out.v[j] = Elem<T>::from_f32(v[j]);
    store16(c + at, out);
  }
};

} // namespace gemm
} // namespace tpfuse
