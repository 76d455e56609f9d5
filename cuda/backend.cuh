// backend.cuh: what differs between compiling cuda/ with nvcc for a GPU and as host C++ for
// the CPU emulator (TPFUSE_EMULATOR, cuda/emu/): the runtime headers, how a kernel is
// launched, and how a kernel declares shared memory. Kernels use only these spellings.
//
//   TPFUSE_LAUNCH(kernel, grid, block, smem, stream)(args...)
//       kernel<<<grid, block, smem, stream>>>(args...) on a GPU; an enqueue on the
//       emulator's stream otherwise (arguments copied at the call, as CUDA does).
//   TPFUSE_SHARED(type, name);
//       `__shared__ type name;` (type may be an array type, e.g. float[16]). The emulator
//       gives every resident block its own instance, poisoned when the block starts.
//   TPFUSE_DYNAMIC_SHARED(name);
//       `extern __shared__ __align__(128) unsigned char name[];`
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace tpfuse {
// Lets an array type be spelled as one macro argument (`float[16]`).
template <typename T> using shared_type = T;
} // namespace tpfuse

#ifdef TPFUSE_EMULATOR
#define TPFUSE_LAUNCH(kernel, grid, block, smem, stream)                                        \
  ::tpfuse_emu::Launcher(kernel, #kernel, __PRETTY_FUNCTION__, grid, block, smem, stream)
#define TPFUSE_SHARED(type, name)                                                               \
  static char name##_tag_;                                                                      \
  ::tpfuse::shared_type<type> &name = ::tpfuse_emu::block_shared<::tpfuse::shared_type<type>>(&name##_tag_)
#define TPFUSE_DYNAMIC_SHARED(name) unsigned char *const name = ::tpfuse_emu::dynamic_shared()
#else
#define TPFUSE_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#define TPFUSE_SHARED(type, name) __shared__ ::tpfuse::shared_type<type> name
#define TPFUSE_DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#endif
