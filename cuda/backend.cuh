// backend.cuh: what differs between compiling cuda/ with nvcc for a GPU and as host C++ for
// the CPU emulator (TPFUSE_EMULATOR, cuda/emu/): the runtime headers, how a kernel is
// launched, and how a kernel declares shared memory. Kernels use only these spellings.
//
//   TPFUSE_LAUNCH(kernel, grid, block, smem, stream)(args...)
//       kernel<<<grid, block, smem, stream>>>(args...) on a GPU; an enqueue on the
//       emulator's stream otherwise (arguments copied at the call, as CUDA does).
//   TPFUSE_LAUNCH_COOPERATIVE(kernel, grid, block, smem, stream)(args...)
//       The same as a cooperative launch (cudaLaunchKernelEx with cudaLaunchAttributeCooperative):
//       every block of the grid is resident at once, and a grid larger than the device holds at
//       once (the occupancy API's blocks per SM times the SMs) is refused with
//       cudaErrorCooperativeLaunchTooLarge, before anything runs (both documented for
//       cudaLaunchCooperativeKernel). That the launch waits for room while other kernels hold
//       SMs is how co-residency can hold at all, but NVIDIA does not describe it, nor whether
//       cooperative grids of different streams run at once (virtual ranks on one GPU need
//       that): unverified on a GPU; the emulator models both as such. For the kernels whose
//       blocks wait for other blocks of their own launch. Returns the launch's cudaError_t:
//       pass it to launch_result().
//   TPFUSE_MAX_ACTIVE_BLOCKS(blocks, kernel, threads, smem)
//       cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, threads, smem): the
//       blocks of `kernel` one SM holds at once (set the kernel's dynamic shared memory
//       attribute first where `smem` is past 48 KiB). Returns a cudaError_t.
//   TPFUSE_SHARED(type, name);
//       `__shared__ type name;` (type may be an array type, e.g. float[16]). The emulator
//       gives every resident block its own instance, poisoned when the block starts.
//   TPFUSE_DYNAMIC_SHARED(name);
//       `extern __shared__ __align__(128) unsigned char name[];`
//   TPFUSE_NOINLINE
//       `__noinline__` (a function called out of line, as a slow path).
#pragma once

#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace tpfuse {
// Lets an array type be spelled as one macro argument (`float[16]`).
template <typename T> using shared_type = T;

// What a launcher returns after TPFUSE_LAUNCH_COOPERATIVE returned `launched`: that error, or
// else the thread's last error; either way the last error is cleared (a refused launch also
// recorded it there).
inline int launch_result(cudaError_t launched) {
  const cudaError_t last = cudaGetLastError();
  return launched != cudaSuccess ? launched : last;
}
} // namespace tpfuse

#ifndef TPFUSE_EMULATOR
namespace tpfuse {
// TPFUSE_LAUNCH_COOPERATIVE on a GPU: cudaLaunchKernelEx with the cooperative attribute (CUDA
// 12+; capturable in a CUDA graph, where the kernel node keeps the attribute).
template <typename... P> class CooperativeLaunch {
public:
  CooperativeLaunch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream)
      : kernel_(kernel) {
    config_.gridDim = grid;
    config_.blockDim = block;
    config_.dynamicSmemBytes = smem;
    config_.stream = stream;
    attribute_[0].id = cudaLaunchAttributeCooperative;
    attribute_[0].val.cooperative = 1;
  }
  template <typename... A> cudaError_t operator()(A &&...args) {
    config_.attrs = attribute_;
    config_.numAttrs = 1;
    return cudaLaunchKernelEx(&config_, kernel_, std::forward<A>(args)...);
  }

private:
  void (*kernel_)(P...);
  cudaLaunchConfig_t config_{};
  cudaLaunchAttribute attribute_[1]{};
};
} // namespace tpfuse
#endif

#ifdef TPFUSE_EMULATOR
#define TPFUSE_LAUNCH(kernel, grid, block, smem, stream)                                        \
  ::tpfuse_emu::Launcher(kernel, #kernel, __PRETTY_FUNCTION__, grid, block, smem, stream)
#define TPFUSE_MAX_ACTIVE_BLOCKS(blocks, kernel, threads, smem)                                 \
  ::tpfuse_emu::max_active_blocks(blocks, reinterpret_cast<const void *>(kernel), #kernel, threads, smem)
#define TPFUSE_SHARED(type, name)                                                               \
  static char name##_tag_;                                                                      \
  ::tpfuse::shared_type<type> &name = ::tpfuse_emu::block_shared<::tpfuse::shared_type<type>>(&name##_tag_)
#define TPFUSE_DYNAMIC_SHARED(name) unsigned char *const name = ::tpfuse_emu::dynamic_shared()
#define TPFUSE_LAUNCH_COOPERATIVE(kernel, grid, block, smem, stream)                            \
  ::tpfuse_emu::Launcher(kernel, #kernel, __PRETTY_FUNCTION__, grid, block, smem, stream, true)
#define TPFUSE_NOINLINE __attribute__((noinline))
#else
#define TPFUSE_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#define TPFUSE_LAUNCH_COOPERATIVE(kernel, grid, block, smem, stream)                            \
  ::tpfuse::CooperativeLaunch(kernel, grid, block, smem, stream)
#define TPFUSE_MAX_ACTIVE_BLOCKS(blocks, kernel, threads, smem)                                 \
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, threads, smem)
#define TPFUSE_SHARED(type, name) __shared__ ::tpfuse::shared_type<type> name
#define TPFUSE_DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#define TPFUSE_NOINLINE __noinline__
#endif
