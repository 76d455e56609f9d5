// cuda_runtime.h of the CPU emulator: what tpfuse's kernels and launchers use of CUDA, for a
// host C++ compiler. Device code compiles unchanged against it; every device-side operation
// calls into the emulator (cuda/emu/device.hpp). Only what cuda/ uses is here.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define CUDART_VERSION 13000

#define __global__
#define __device__
#define __host__
// TPFUSE_EMU_INLINE_AS_ASKED (scripts/mutants.sh, scripts/emulator-asan.sh): the compiler
// inlines what it chooses, as nvcc may; at -O0 that halves the kernel units' compile time (no
// code is copied into every caller). The meaning of the code is the same.
#ifdef TPFUSE_EMU_INLINE_AS_ASKED
#define __forceinline__ inline
#else
#define __forceinline__ inline __attribute__((always_inline))
#endif
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) alignas(n)

// cudaError_t values (the CUDA runtime's numbers, which the Rust side reports).
typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoKernelImageForDevice = 209,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchTimeout = 702,
  cudaErrorMisalignedAddress = 716,
  cudaErrorLaunchFailure = 719,
  cudaErrorCooperativeLaunchTooLarge = 720,
  cudaErrorNotSupported = 801,
  cudaErrorUnknown = 999,
} cudaError_t;

typedef struct CUstream_st *cudaStream_t;
typedef struct CUfunc_st *cudaFunction_t;

typedef enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxThreadsPerMultiProcessor = 39,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
} cudaDeviceAttr;

typedef enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
} cudaFuncAttribute;

#ifdef __cplusplus  // the rest is device code's, in C++ (bindgen reads the C part via nccl.h)

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }

extern "C" {
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t error);
cudaError_t tpfuse_emu_func_set_attribute(const void *func, cudaFuncAttribute attr, int value);
// The kernel's handle: the kernel itself (loading.cpp); it loads nothing (cuFuncLoad does).
cudaError_t cudaGetFuncBySymbol(cudaFunction_t *function, const void *symbol);
}

#include "../device.hpp"

template <typename F> cudaError_t cudaFuncSetAttribute(F *func, cudaFuncAttribute attr, int value) {
  return tpfuse_emu_func_set_attribute(reinterpret_cast<const void *>(func), attr, value);
}

// Built-in variables of the running thread (a fiber of the emulator).
#define threadIdx (::tpfuse_emu::thread_idx())
#define blockIdx (::tpfuse_emu::block_idx())
#define blockDim (::tpfuse_emu::block_dim())
#define gridDim (::tpfuse_emu::grid_dim())

inline void __syncthreads() { ::tpfuse_emu::syncthreads(); }

inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32) {
  return ::tpfuse_emu::shfl_xor(mask, v, lane_mask, width);
}

// CUDA's atomicAdd and atomicCAS: atom.relaxed.gpu (the CUDA C++ guide's atomic functions are
// relaxed, device scope).
inline int atomicAdd(int *p, int v) {
  return ::tpfuse_emu::atomic_add(p, v, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Gpu);
}
inline unsigned atomicAdd(unsigned *p, unsigned v) {
  return ::tpfuse_emu::atomic_add(p, v, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Gpu);
}
inline int atomicCAS(int *p, int expected, int desired) {
  return ::tpfuse_emu::atomic_cas(p, expected, desired, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Gpu);
}
inline unsigned atomicCAS(unsigned *p, unsigned expected, unsigned desired) {
  return ::tpfuse_emu::atomic_cas(p, expected, desired, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Gpu);
}

// A load "cached globally" (L2 only): a plain load here; peers' data is host memory.
template <typename T> inline T __ldcg(const T *p) { return ::tpfuse_emu::load_global(p); }

template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }

// MUFU.RSQ is an approximation on a GPU; the emulator computes 1/sqrt correctly rounded
// through f32 sqrt and division (a documented difference, docs/emulator.md).
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

inline size_t __cvta_generic_to_shared(const void *p) { return ::tpfuse_emu::cvta_shared(p); }

#endif // __cplusplus
