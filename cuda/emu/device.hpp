// device.hpp: what device code calls in the CPU emulator (through cuda_runtime.h and the
// twins in cuda/ptx.cuh), and the launch helper behind TPFUSE_LAUNCH.
//
// Every function here runs on a fiber of the device thread (scheduler.cpp): one CUDA
// thread = one fiber. The functions that name a synchronisation point (barriers, warp
// collectives, flag loads and stores, atomics) switch to the next fiber, so the threads of
// all resident blocks of all streams interleave at exactly those points.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

struct uint3;
struct dim3;
typedef struct CUstream_st *cudaStream_t;

namespace tpfuse_emu {

// ---- The running thread.
const uint3 &thread_idx();
const uint3 &block_idx();
const dim3 &block_dim();
const dim3 &grid_dim();

// ---- Block-level synchronisation and memory.
void syncthreads();
// Per-block storage for a __shared__ variable, identified by `tag` (one per declaration),
// poisoned with 0xFF bytes when first touched in the block.
void *block_shared_bytes(const void *tag, size_t bytes, size_t align);
template <typename T> T &block_shared(const void *tag) {
  return *static_cast<T *>(block_shared_bytes(tag, sizeof(T), alignof(T)));
}
unsigned char *dynamic_shared();
uint32_t cvta_shared(const void *p);
void shared_zero16(uint32_t dst);

// ---- Global memory. Loads of other ranks' buffers are plain host loads. The counters
// (counters.cpp) see every access the kernels make through cuda/common.cuh and cp.async.
// A global access of `bytes` (1, 2, 4, 8 or 16: one instruction's width) at p fails the
// launch with cudaErrorMisalignedAddress unless p is aligned to it, as on a GPU (inline: every
// load and store of the kernels passes here).
[[noreturn]] void misaligned_access(const void *p, size_t bytes);
inline void check_aligned(const void *p, size_t bytes) {
  if ((bytes & (bytes - 1)) == 0 && bytes <= 16 && reinterpret_cast<uintptr_t>(p) % bytes != 0) {
    misaligned_access(p, bytes);
  }
}
void count_load(const void *p, size_t bytes);
void count_store(const void *p, size_t bytes);
void count_barrier();

// ---- The PTX memory model's qualifiers: every twin of a strong operation in cuda/ptx.cuh
// names its order and scope (no defaults: a twin without them does not compile).
enum class Order { Relaxed, Acquire, Release, AcqRel, SeqCst };
enum class Scope { Cta, Gpu, Sys };

// ---- Weak memory (TPFUSE_EMU_MEMORY=weak|weak-random; weak_memory.cpp): the kernels' weak
// global accesses (cuda/common.cuh) go through these while it is on.
extern bool weak_memory;
void weak_load(const void *p, void *out, size_t bytes);
void weak_store(void *p, const void *v, size_t bytes);
// A kernel's weak global load and store (cuda/common.cuh, __ldcg).
template <typename T> inline T load_global(const T *p) {
  T v;
  if (weak_memory) {
    weak_load(p, &v, sizeof(T));
  } else {
    memcpy(static_cast<void *>(&v), static_cast<const void *>(p), sizeof(T));
  }
  return v;
}
template <typename T> inline void store_global(T *p, const T &v) {
  if (weak_memory) {
    weak_store(p, &v, sizeof(T));
  } else {
    memcpy(static_cast<void *>(p), static_cast<const void *>(&v), sizeof(T));
  }
}

// ---- Strong operations: flags and atomics, each a scheduling point (loads let the others
// run first, so a poll reads the freshest value).
uint32_t strong_load(const uint32_t *p, Order o, Scope s);
uint64_t strong_load(const uint64_t *p, Order o, Scope s);
void strong_store(uint32_t *p, uint32_t v, Order o, Scope s);
void strong_store(uint64_t *p, uint64_t v, Order o, Scope s);
int atomic_add(int *p, int v, Order o, Scope s);
unsigned atomic_add(unsigned *p, unsigned v, Order o, Scope s);
int atomic_cas(int *p, int expected, int desired, Order o, Scope s);
unsigned atomic_cas(unsigned *p, unsigned expected, unsigned desired, Order o, Scope s);
void fence(Order o, Scope s);
uint64_t global_timer_ns();
// The emulated SM clock: virtual time at kClockKhz (an H100 SXM's peak, what
// CU_DEVICE_ATTRIBUTE_CLOCK_RATE reports). It runs on when a stream's %globaltimer is frozen.
constexpr uint64_t kClockKhz = 1980000;
uint64_t clock_cycles();

// ---- cp.async: recorded per thread, landed at the wait_group that completes it.
void cp_async(uint32_t dst, const void *src, int src_bytes);
void cp_async_commit();
void cp_async_wait(int pending);

// ---- Warp collectives: every lane of the warp must arrive (warp.cpp).
float shfl_xor(unsigned mask, float v, int lane_mask, int width);
void ldmatrix_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3);
enum class MmaType { F16, BF16 };
void mma_m16n8k16(MmaType type, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

// ---- Launches.
struct LaunchSpec {
  const void *func;
  const char *name;     // the kernel expression at the launch site
  const char *context;  // __PRETTY_FUNCTION__ of the launching function (its template args)
  unsigned grid, grid_y, grid_z, block, block_y, block_z;
  size_t smem;
  cudaStream_t stream;
  bool cooperative;  // TPFUSE_LAUNCH_COOPERATIVE: every block resident at once
};
// Validates and enqueues; the result is what cudaGetLastError returns next on this thread.
cudaError_t enqueue_launch(const LaunchSpec &spec, std::function<void()> body);
// TPFUSE_MAX_ACTIVE_BLOCKS: cudaOccupancyMaxActiveBlocksPerMultiprocessor for kernel `func`,
// named `name` at the call site, as residency.cpp counts a block (0 when `smem` is past the
// 48 KiB default and the kernel was not opted in to it, as a launch would be refused).
cudaError_t max_active_blocks(int *blocks, const void *func, const char *name, int threads, size_t smem);

// TPFUSE_LAUNCH(kernel, grid, block, smem, stream)(args...): the arguments are converted to
// the kernel's parameter types and copied now, as a CUDA launch copies them; every thread
// of the launch calls the kernel with its own copy.
template <typename... P> class Launcher {
public:
  template <typename G, typename B>
  Launcher(void (*kernel)(P...), const char *name, const char *context, G grid, B block, size_t smem,
           cudaStream_t stream, bool cooperative = false)
      : kernel_(kernel) {
    const dim3 g = dim_of(grid), b = dim_of(block);
    spec_ = LaunchSpec{reinterpret_cast<const void *>(kernel), name, context, g.x, g.y, g.z, b.x, b.y,
                       b.z, smem, stream, cooperative};
  }

  // Returns what cudaGetLastError returns next on this thread (as cudaLaunchKernelEx does).
  template <typename... A> cudaError_t operator()(A &&...args) const {
    auto frozen = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(args)...);
    void (*kernel)(P...) = kernel_;
    return enqueue_launch(spec_, [kernel, frozen]() { std::apply(kernel, *frozen); });
  }

private:
  template <typename D> static dim3 dim_of(D d) {
    if constexpr (std::is_arithmetic_v<D>) {
      return dim3(static_cast<unsigned>(d));
    } else {
      return d;
    }
  }
  void (*kernel_)(P...);
  LaunchSpec spec_{};
};

} // namespace tpfuse_emu
