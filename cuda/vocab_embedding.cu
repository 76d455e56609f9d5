// vocab_embedding.cu: one rank's masked lookup of the vocabulary-parallel embedding
// (ops::linear::VocabParallelEmbedding sums the ranks' outputs with the all-reduce).
//
//   out[i, :] = table[ids[i] - row_begin, :]  when ids[i] < vocab and row_begin <= ids[i] <
//                                             row_begin + rows (the rank holds the token)
//             = -0.0                          when ids[i] < vocab is another rank's token
//             = NaN                           when ids[i] >= vocab (no rank holds it)
//
// -0.0, not +0.0, for the tokens of other ranks: it is the additive identity of IEEE
// arithmetic (x + -0.0 == x under round-to-nearest for every x but NaN, -0.0, infinities and
// subnormals included; the build does not flush subnormals), so the all-reduce's rank-order
// sum (or NCCL's, in any order) returns the owner's row bit for bit, signs of zero included.
// A NaN entry stays a NaN, its payload not kept (GPU arithmetic returns the canonical NaN). An
// id past the vocabulary gives NaN on every rank, so its row sums to NaN, never to a
// plausible embedding (the Rust layer refuses such ids on the host before launching; this
// is the device-side answer for ids that never passed through the host).
// A copy of 16-bit patterns (f16 and bf16 alike), in 16-byte vectors: no arithmetic, no
// synchronisation.

#include "common.cuh"
#include "kernel_list.cuh"

namespace tpfuse {
namespace {

constexpr unsigned kEmbeddingThreads = 128;

__global__ void __launch_bounds__(kEmbeddingThreads)
    vocab_embedding_kernel(const uint16_t *__restrict__ table, const uint32_t *__restrict__ ids,
                           uint16_t *__restrict__ out, size_t m, size_t hidden, uint64_t row_begin,
                           uint64_t rows, uint64_t vocab, uint16_t nan_bits) {
  const size_t vectors = hidden / Vec16<uint16_t>::kLen;
  for (size_t token = blockIdx.x; token < m; token += gridDim.x) {
    const uint64_t id = ld_global(ids + token);
    uint16_t *dst = out + token * hidden;
    // Unsigned: an id below row_begin wraps to a huge offset, outside [0, rows).
    const uint64_t offset = id - row_begin;
    if (id < vocab && offset < rows) {
      const uint16_t *src = table + offset * hidden;
      for (size_t v = threadIdx.x; v < vectors; v += blockDim.x) {
        store16(dst + v * Vec16<uint16_t>::kLen, load16(src + v * Vec16<uint16_t>::kLen));
      }
    } else {
      Vec16<uint16_t> fill;
      const uint16_t bits = id < vocab ? uint16_t{0x8000} : nan_bits;
#pragma unroll
      for (int j = 0; j < Vec16<uint16_t>::kLen; ++j) fill.v[j] = bits;
      for (size_t v = threadIdx.x; v < vectors; v += blockDim.x) {
        store16(dst + v * Vec16<uint16_t>::kLen, fill);
      }
    }
  }
}

} // namespace

void vocab_embedding_kernels(KernelList &list) { list.add(vocab_embedding_kernel); }

} // namespace tpfuse

extern "C" int tpfuse_vocab_embedding(tpfuse_dtype dtype, const void *table, const uint32_t *ids,
                                      void *out, size_t m, size_t hidden, uint64_t row_begin,
                                      uint64_t rows, uint64_t vocab, void *stream) {
  using namespace tpfuse;
  // A quiet NaN of each 16-bit type (sign 0, exponent all ones, top mantissa bit).
  uint16_t nan_bits = 0;
  switch (dtype) {
  case TPFUSE_DTYPE_F16: nan_bits = 0x7e00; break;
  case TPFUSE_DTYPE_BF16: nan_bits = 0x7fc0; break;
  default: return cudaErrorInvalidValue;
  }
  // 16-byte vectors of the table and out (the Rust side validates first).
  if (hidden % 8 != 0 || !is_aligned16(table) || !is_aligned16(out) ||
      (reinterpret_cast<uintptr_t>(ids) & 3u) != 0) {
    return cudaErrorInvalidValue;
  }
  if (m == 0 || hidden == 0) return cudaSuccess;
  const size_t cap = static_cast<size_t>(current_sm_count()) * 8;
  const unsigned grid = static_cast<unsigned>(m < cap ? m : cap);
  TPFUSE_LAUNCH(vocab_embedding_kernel, grid, kEmbeddingThreads, 0,
                static_cast<cudaStream_t>(stream))(
      static_cast<const uint16_t *>(table), ids, static_cast<uint16_t *>(out), m, hidden, row_begin,
      rows, vocab, nan_bits);
  return cudaGetLastError();
}
