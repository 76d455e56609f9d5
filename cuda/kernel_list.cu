// kernel_list.cu: the handles of every kernel of the build (kernel_list.cuh says why).

#include "kernel_list.cuh"
#include "tpfuse.h"

namespace {
tpfuse::KernelList all_kernels() {
  tpfuse::KernelList list;
  tpfuse::all_gather_gemm_kernels(list);
  tpfuse::all_reduce_kernels(list);
  tpfuse::all_reduce_packet_kernels(list);
  tpfuse::epilogue_kernels(list);
  tpfuse::fp_contraction_kernels(list);
  tpfuse::gemm_kernels(list);
  tpfuse::gemm_all_reduce_kernels(list);
  tpfuse::reduce_ranks_kernels(list);
  tpfuse::vocab_embedding_kernels(list);
  return list;
}
} // namespace

extern "C" int32_t tpfuse_kernel_count(void) { return all_kernels().count(); }

extern "C" int tpfuse_kernel_functions(void **functions, int32_t capacity) {
  const tpfuse::KernelList list = all_kernels();
  if (list.count() > tpfuse::KernelList::kCapacity) return cudaErrorInvalidValue;
  if (functions == nullptr || capacity < list.count()) return cudaErrorInvalidValue;
  for (int i = 0; i < list.count(); ++i) {
    cudaFunction_t f = nullptr;
    const cudaError_t err = cudaGetFuncBySymbol(&f, list.at(i));
    if (err != cudaSuccess) return err;
    functions[i] = reinterpret_cast<void *>(f);
  }
  return cudaSuccess;
}
