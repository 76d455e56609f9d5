// reduce_ranks.cu: element-wise sum of W buffers in rank order, f32 accumulation.
//
// The core every all-reduce in tpfuse builds on: out[i] = ((in0[i] + in1[i]) + in2[i]) + ...
// The order of the additions is fixed (rank 0 first), so whichever kernel or rank computes
// an element, it gets the same bits.

#include "common.cuh"
#include "kernel_list.cuh"

namespace tpfuse {
namespace {

struct InputPtrs {
  const void *ptr[TPFUSE_MAX_REDUCE_INPUTS];
};

constexpr unsigned kThreads = 256;

// `inputs` is a __grid_constant__ so that indexing it by rank reads the parameter bank
// directly instead of copying the table to local memory.
// Vectorised over [0, vec_len * Vec16<T>::kLen) when `vec_len` > 0, then scalar over the
// rest. Both parts add in the same order, so the split never changes a result.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    reduce_ranks_kernel(const __grid_constant__ InputPtrs inputs, int num_inputs, T *__restrict__ out, size_t len,
                        size_t vec_len) {
  constexpr int kVec = Vec16<T>::kLen;
  const size_t first = global_thread_index();
  const size_t stride = global_thread_count();

  for (size_t v = first; v < vec_len; v += stride) {
    const size_t base = v * kVec;
    float acc[kVec];
    Vec16<T> x = load16(static_cast<const T *>(inputs.ptr[0]) + base);
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] = Elem<T>::to_f32(x.v[j]);
    for (int r = 1; r < num_inputs; ++r) {
      x = load16(static_cast<const T *>(inputs.ptr[r]) + base);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] += Elem<T>::to_f32(x.v[j]);
    }
    store16(out + base, rounded<T>(acc));
  }

  for (size_t i = vec_len * kVec + first; i < len; i += stride) {
    float acc = Elem<T>::to_f32(ld_global(static_cast<const T *>(inputs.ptr[0]) + i));
    for (int r = 1; r < num_inputs; ++r) acc += Elem<T>::to_f32(ld_global(static_cast<const T *>(inputs.ptr[r]) + i));
    st_global(out + i, Elem<T>::from_f32(acc));
  }
}

template <typename T>
int launch(const void *const *inputs, int num_inputs, void *out, size_t len, cudaStream_t stream) {
  if (num_inputs < 1 || num_inputs > TPFUSE_MAX_REDUCE_INPUTS) return cudaErrorInvalidValue;
  if (len == 0) return cudaSuccess;
  InputPtrs ptrs = {};
  bool aligned = is_aligned16(out);
  for (int r = 0; r < num_inputs; ++r) {
    ptrs.ptr[r] = inputs[r];
    aligned = aligned && is_aligned16(inputs[r]);
  }
  constexpr int kVec = Vec16<T>::kLen;
  const size_t vec_len = aligned ? len / kVec : 0;
  const size_t tail = len - vec_len * kVec;
  const size_t work = vec_len > tail ? vec_len : tail;
  TPFUSE_LAUNCH(reduce_ranks_kernel<T>, grid_for(work, kThreads), kThreads, 0, stream)(
      ptrs, num_inputs, static_cast<T *>(out), len, vec_len);
  return cudaGetLastError();
}

} // namespace

void reduce_ranks_kernels(KernelList &list) {
  list.add(reduce_ranks_kernel<float>);
  list.add(reduce_ranks_kernel<__half>);
  list.add(reduce_ranks_kernel<__nv_bfloat16>);
}

} // namespace tpfuse

extern "C" int tpfuse_reduce_ranks(tpfuse_dtype dtype, const void *const *inputs,
                                   int32_t num_inputs, void *out, size_t len, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
  case TPFUSE_DTYPE_F32: return tpfuse::launch<float>(inputs, num_inputs, out, len, s);
  case TPFUSE_DTYPE_F16: return tpfuse::launch<__half>(inputs, num_inputs, out, len, s);
  case TPFUSE_DTYPE_BF16: return tpfuse::launch<__nv_bfloat16>(inputs, num_inputs, out, len, s);
  default: return cudaErrorInvalidValue;
  }
}
