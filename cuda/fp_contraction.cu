// fp_contraction.cu: how the kernels' floating point is compiled, the same in both builds. A
// multiply and an add written apart stay two roundings (nvcc --fmad=false, build.rs; the
// emulator's g++ -ffp-contract=off), and fmaf is one fused rounding in both (FFMA; the host's
// fmaf). tests/gpu_arithmetic.rs runs this kernel on either: it computes both forms of one
// product-plus-addend whose two results differ.

#include "backend.cuh"
#include "kernel_list.cuh"
#include "tpfuse.h"

namespace {

__global__ void fp_contraction_kernel(const float *abc, float *out) {
  if (threadIdx.x != 0) return;
  const float a = abc[0], b = abc[1], c = abc[2]; // loaded: nothing folds at compile time
  const float product = a * b;
  out[0] = product + c; // contracted, this would be out[1]
  out[1] = fmaf(a, b, c);
}

} // namespace

namespace tpfuse {
void fp_contraction_kernels(KernelList &list) { list.add(fp_contraction_kernel); }
} // namespace tpfuse

extern "C" int tpfuse_fp_contraction_probe(const float *abc, float *out, void *stream) {
  if (abc == nullptr || out == nullptr) return cudaErrorInvalidValue;
  TPFUSE_LAUNCH(fp_contraction_kernel, 1, 32, 0, static_cast<cudaStream_t>(stream))(abc, out);
  return cudaGetLastError();
}
