// common.cuh: element-type traits and 16-byte vector access shared by every kernel.
#pragma once

#include <stdint.h>

#include <atomic>

#include "backend.cuh"
#include "tpfuse.h"

namespace tpfuse {

// Conversions to and from the f32 accumulator. Narrowing rounds to nearest even, like the
// `half` crate's from_f32 that the CPU reference uses.
template <typename T> struct Elem;

// kDtype: the element type's TPFUSE_DTYPE_*, which the launch descriptors carry (f16 and bf16
// have one size: ranks that launch one each must mismatch, not exchange each other's bits).
template <> struct Elem<float> {
  static constexpr uint64_t kDtype = TPFUSE_DTYPE_F32;
  static __device__ __forceinline__ float to_f32(float x) { return x; }
  static __device__ __forceinline__ float from_f32(float x) { return x; }
};
template <> struct Elem<__half> {
  static constexpr uint64_t kDtype = TPFUSE_DTYPE_F16;
  static __device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_f32(float x) { return __float2half_rn(x); }
};
template <> struct Elem<__nv_bfloat16> {
  static constexpr uint64_t kDtype = TPFUSE_DTYPE_BF16;
  static __device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_f32(float x) {
    return __float2bfloat16_rn(x);
  }
};

// ---- Global memory. Every load and store of the kernels' data goes through these helpers
// (or cp.async, cuda/ptx.cuh): the emulator counts their bytes there (tpfuse_emu.h,
// "Counters"); on a GPU they are the plain accesses. ld_global_cg reads through L2 only
// (a peer's buffer, which changes between launches).
// (The emulator also faults, as a GPU does, on an access not aligned to its size.)
template <typename T> __device__ __forceinline__ T ld_global(const T *p) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::check_aligned(p, sizeof(T));
  ::tpfuse_emu::count_load(p, sizeof(T));
  return ::tpfuse_emu::load_global(p);
#else
  return *p;
#endif
}

template <typename T> __device__ __forceinline__ T ld_global_cg(const T *p) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::check_aligned(p, sizeof(T));
  ::tpfuse_emu::count_load(p, sizeof(T));
#endif
  return __ldcg(p);
}

template <typename T> __device__ __forceinline__ void st_global(T *p, const T &v) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::check_aligned(p, sizeof(T));
  ::tpfuse_emu::count_store(p, sizeof(T));
  ::tpfuse_emu::store_global(p, v);
#else
  *p = v;
#endif
}

// A cross-rank barrier passed (cuda/barrier.cuh): counted by the emulator, nothing on a GPU.
__device__ __forceinline__ void note_barrier_passed() {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::count_barrier();
#endif
}

// The contiguous share [begin, end) of `n` items that block `b` of `blocks` handles (the
// collectives' even split of a message).
struct Range {
  size_t begin, end;
};
__device__ __forceinline__ Range share(size_t n, size_t b, size_t blocks) {
  return Range{n * b / blocks, n * (b + 1) / blocks};
}

// 16 bytes of elements, moved with one 128-bit load or store.
template <typename T> struct alignas(16) Vec16 {
  static constexpr int kLen = 16 / sizeof(T);
  T v[kLen];
};

// A vector from its raw 16 bytes (loads kept raw until they are used: unpacked where they are
// loaded, a vector makes the warp wait for its load before the next load issues).
template <typename T> __device__ __forceinline__ Vec16<T> vec_of(const uint4 &raw) {
  Vec16<T> out;
  *reinterpret_cast<uint4 *>(&out) = raw;
  return out;
}

// A vector's f32 values, each rounded once to T.
template <typename T> __device__ __forceinline__ Vec16<T> rounded(const float (&acc)[Vec16<T>::kLen]) {
  Vec16<T> out;
#pragma unroll
  for (int j = 0; j < Vec16<T>::kLen; ++j) out.v[j] = Elem<T>::from_f32(acc[j]);
  return out;
}

template <typename T> __device__ __forceinline__ Vec16<T> load16(const T *p) {
  return vec_of<T>(ld_global(reinterpret_cast<const uint4 *>(p)));
}

// 16 bytes of a peer's buffer, through L2 only.
template <typename T> __device__ __forceinline__ Vec16<T> load16_peer(const T *p) {
  return vec_of<T>(ld_global_cg(reinterpret_cast<const uint4 *>(p)));
}

template <typename T> __device__ __forceinline__ void store16(T *p, const Vec16<T> &x) {
  st_global(reinterpret_cast<uint4 *>(p), *reinterpret_cast<const uint4 *>(&x));
}

// Host: bytes of an element of `dtype` (a valid TPFUSE_DTYPE_*).
inline size_t dtype_size(tpfuse_dtype dtype) { return dtype == TPFUSE_DTYPE_F32 ? 4 : 2; }

__host__ __device__ __forceinline__ bool is_aligned16(const void *p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Grid-stride loop helpers.
__device__ __forceinline__ size_t global_thread_index() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t global_thread_count() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

// Host: the SM count of the current device into `sms`, queried once per device and cached
// (the launch path stays free of repeated driver queries); false, with the runtime's last
// error cleared, when the driver cannot say (the launchers read the last error after their
// launch: the launch's own outcome, not this query's, is what they report).
inline bool current_sm_count_checked(int &sms) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    (void)cudaGetLastError();
    return false;
  }
  sms = cache[device].load(std::memory_order_relaxed);
  if (sms <= 0) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        sms <= 0) {
      (void)cudaGetLastError();
      return false;
    }
    cache[device].store(sms, std::memory_order_relaxed);
  }
  return true;
}

// Host: the SM count of the current device for sizing a grid: 1 when the driver cannot say.
inline int current_sm_count() {
  int sms = 0;
  return current_sm_count_checked(sms) ? sms : 1;
}

// Host: launch config for a grid-stride kernel over `work` items, at most 8 blocks per SM.
inline unsigned grid_for(size_t work, unsigned threads) {
  size_t blocks = (work + threads - 1) / threads;
  size_t cap = static_cast<size_t>(current_sm_count()) * 8;
  if (blocks > cap) blocks = cap;
  return blocks == 0 ? 1u : static_cast<unsigned>(blocks);
}

} // namespace tpfuse
