// epilogue.cu: the epilogue as standalone kernels: the unfused baseline, and the tail of
// paths that cannot fuse it (two-shot RMSNorm, NCCL).

#include "epilogue.cuh"
#include "kernel_list.cuh"

namespace tpfuse {
namespace {

// Two blocks an SM at least: with the thread count alone, ptxas packed the kernel for four
// (32 registers on sm_90a) and on sm_120a spilled the f32 row it holds in registers
// (then a row of one segment) to a 16-byte stack frame; with two, 56-64 registers (a row of
// two segments held: rms_norm_held_row) and no stack on every architecture built.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    rms_norm_kernel(const T *x, const T *gamma, float eps, T *out, size_t rows, size_t hidden,
                    FailureWords failure) {
  TPFUSE_SHARED(uint32_t, error_word);
  const bool failed = group_failed(failure, &error_word);
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
    if (failed) {
      mark_failed(out, row * hidden, (row + 1) * hidden);
    } else {
      rms_norm_row(x + row * hidden, gamma, eps, out + row * hidden, hidden);
    }
  }
}

// h = x (+ bias[col]) (+ residual), rounded once; residual := h; out := h.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    bias_residual_kernel(const T *x, const T *bias, T *residual, T *out, size_t n,
                         size_t hidden) {
  const Epilogue<T> epi{bias, residual, hidden};
  for (size_t i = global_thread_index(); i < n; i += global_thread_count()) {
    st_global(out + i, epi.apply(Elem<T>::to_f32(ld_global(x + i)), i));
  }
}

} // namespace

// One block per row, at most kMaxRmsNormBlocks of them; beyond that the blocks loop over the
// rows (row += gridDim.x). 4096 blocks are several waves on any current GPU (an SM holds at
// most 2048 threads: 4 blocks of kThreads = 512, so 132 SMs hold 528), so the cap costs no
// parallelism,
// and a row is still normalised by one block alone: the same bits for any grid.
constexpr size_t kMaxRmsNormBlocks = 4096;

template <typename T>
int launch_rms_norm(const T *x, const T *gamma, float eps, T *out, size_t rows, size_t hidden,
                    cudaStream_t stream, FailureWords failure) {
  if (rows == 0 || hidden == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(rows < kMaxRmsNormBlocks ? rows : kMaxRmsNormBlocks);
  TPFUSE_LAUNCH(rms_norm_kernel<T>, grid, kThreads, 0, stream)(x, gamma, eps, out, rows, hidden,
                                                               failure);
  return cudaGetLastError();
}

template int launch_rms_norm<float>(const float *, const float *, float, float *, size_t,
                                    size_t, cudaStream_t, FailureWords);
template int launch_rms_norm<__half>(const __half *, const __half *, float, __half *, size_t,
                                     size_t, cudaStream_t, FailureWords);
template int launch_rms_norm<__nv_bfloat16>(const __nv_bfloat16 *, const __nv_bfloat16 *, float,
                                            __nv_bfloat16 *, size_t, size_t, cudaStream_t, FailureWords);

template <typename T>
int launch_bias_residual(const void *x, const void *bias, void *residual, void *out, size_t rows,
                         size_t hidden, cudaStream_t stream) {
  const size_t n = rows * hidden;
  if (n == 0) return cudaSuccess;
  TPFUSE_LAUNCH(bias_residual_kernel<T>, grid_for(n, kThreads), kThreads, 0, stream)(
      static_cast<const T *>(x), static_cast<const T *>(bias), static_cast<T *>(residual),
      static_cast<T *>(out), n, hidden);
  return cudaGetLastError();
}

void epilogue_kernels(KernelList &list) {
  list.add(rms_norm_kernel<float>);
  list.add(rms_norm_kernel<__half>);
  list.add(rms_norm_kernel<__nv_bfloat16>);
  list.add(bias_residual_kernel<float>);
  list.add(bias_residual_kernel<__half>);
  list.add(bias_residual_kernel<__nv_bfloat16>);
}

} // namespace tpfuse

extern "C" int tpfuse_rms_norm(tpfuse_dtype dtype, const void *x, const void *gamma, float eps,
                               void *out, size_t rows, size_t hidden, void *stream) {
  using namespace tpfuse;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The kernel moves 16-byte vectors (the Rust side validates first).
  if ((hidden * dtype_size(dtype)) % 16 != 0 || !is_aligned16(x) || !is_aligned16(gamma) || !is_aligned16(out)) {
    return cudaErrorInvalidValue;
  }
  switch (dtype) {
  case TPFUSE_DTYPE_F32:
    return launch_rms_norm(static_cast<const float *>(x), static_cast<const float *>(gamma), eps,
                           static_cast<float *>(out), rows, hidden, s);
  case TPFUSE_DTYPE_F16:
    return launch_rms_norm(static_cast<const __half *>(x), static_cast<const __half *>(gamma),
                           eps, static_cast<__half *>(out), rows, hidden, s);
  case TPFUSE_DTYPE_BF16:
    return launch_rms_norm(static_cast<const __nv_bfloat16 *>(x),
                           static_cast<const __nv_bfloat16 *>(gamma), eps,
                           static_cast<__nv_bfloat16 *>(out), rows, hidden, s);
  default: return cudaErrorInvalidValue;
  }
}

extern "C" int tpfuse_bias_residual(tpfuse_dtype dtype, const void *x, const void *bias,
                                    void *residual, void *out, size_t rows, size_t hidden,
                                    void *stream) {
  using namespace tpfuse;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
  case TPFUSE_DTYPE_F32: return launch_bias_residual<float>(x, bias, residual, out, rows, hidden, s);
  case TPFUSE_DTYPE_F16: return launch_bias_residual<__half>(x, bias, residual, out, rows, hidden, s);
  case TPFUSE_DTYPE_BF16:
    return launch_bias_residual<__nv_bfloat16>(x, bias, residual, out, rows, hidden, s);
  default: return cudaErrorInvalidValue;
  }
}
