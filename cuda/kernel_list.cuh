// kernel_list.cuh: every kernel of the build, listed by the file that defines it, for
// tpfuse_kernel_functions (kernel_list.cu).
//
// Why: since CUDA 12.2 the runtime loads a kernel into a context when it is first used (a
// launch, cudaFuncSetAttribute), and that load "might require context synchronization" (the
// CUDA programming guide, lazy loading, potential hazards): it can wait for every kernel
// running in the context. When one host thread enqueues the ranks of a collective one after
// another (virtual ranks, or one process driving several GPUs), rank 0's kernel waits for rank
// 1's, so a first use on rank 0's context between the two (a separate epilogue kernel, say)
// waits out rank 0's deadline: seen on an H200 (docs/gpu-runs/2026-11-26-h200-suite). So
// tpfuse loads every kernel (cuFuncLoad on each handle) when it builds a group.
#pragma once

#include "backend.cuh"

namespace tpfuse {

// A fixed-capacity list of kernels (host stubs: what cudaGetFuncBySymbol takes).
class KernelList {
public:
  static constexpr int kCapacity = 128;
  template <typename... P> void add(void (*kernel)(P...)) {
    if (count_ < kCapacity) funcs_[count_] = reinterpret_cast<const void *>(kernel);
    ++count_;  // past the capacity too: tpfuse_kernel_count reports it, the table refuses it
  }
  int count() const { return count_; }
  const void *at(int i) const { return funcs_[i]; }

private:
  const void *funcs_[kCapacity] = {};
  int count_ = 0;
};

// Each adds every instantiation its file launches (the same template arguments as its
// dispatcher).
void all_gather_gemm_kernels(KernelList &list);
void all_reduce_kernels(KernelList &list);
void all_reduce_packet_kernels(KernelList &list);
void epilogue_kernels(KernelList &list);
void fp_contraction_kernels(KernelList &list);
void gemm_kernels(KernelList &list);
void gemm_all_reduce_kernels(KernelList &list);
void reduce_ranks_kernels(KernelList &list);
void vocab_embedding_kernels(KernelList &list);

} // namespace tpfuse
