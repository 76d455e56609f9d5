// runtime_info.cu: facts about the CUDA runtime the kernels were built with.

#include <cuda_runtime.h>

#include "tpfuse.h"

extern "C" const char *tpfuse_error_string(int32_t code) {
  const char *s = cudaGetErrorString(static_cast<cudaError_t>(code));
  return s ? s : "unknown CUDA error";
}

extern "C" int32_t tpfuse_cudart_version(void) { return CUDART_VERSION; }
