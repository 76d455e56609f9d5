// probes.cpp: tiny kernels that run one emulated operation through the same wrappers the
// kernels use (cuda/ptx.cuh), so that tests/emu_ops.rs can check the emulator itself against
// vectors written by hand from the PTX ISA.
#include "common.cuh"
#include "ptx.cuh"
#include "tpfuse_emu.h"

namespace {

using namespace tpfuse;

template <typename T>
__global__ void mma_probe(const uint32_t *a, const uint32_t *b, const float *c, float *d) {
  const int l = threadIdx.x;
  const uint32_t fa[4] = {a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]};
  const uint32_t fb[2] = {b[2 * l], b[2 * l + 1]};
  float acc[4] = {c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3]};
  Mma<T>::run(acc, fa, fb);
  for (int i = 0; i < 4; ++i) d[4 * l + i] = acc[i];
}

__global__ void ldmatrix_probe(const unsigned char *src, size_t bytes, const uint32_t *addr, uint32_t *out) {
  TPFUSE_DYNAMIC_SHARED(smem);
  const int l = threadIdx.x;
  for (size_t i = l; i < bytes; i += 32) smem[i] = src[i];
  __syncthreads();
  const uint32_t base = smem_u32(smem);
  ldmatrix_x4(base + addr[l], out[4 * l], out[4 * l + 1], out[4 * l + 2], out[4 * l + 3]);
}

__global__ void shfl_probe(const float *in, int lane_mask, float *out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, in[threadIdx.x], lane_mask);
}

__global__ void cp_async_probe(const unsigned char *src, unsigned char *out) {
  TPFUSE_DYNAMIC_SHARED(smem);
  if (threadIdx.x != 0) return;
  const uint32_t base = smem_u32(smem);
  for (int g = 0; g < 3; ++g) {
    cp_async_16(base + 16 * g, src + 16 * g, g != 2);
    cp_async_commit();
  }
  cp_async_wait<2>();
  for (int i = 0; i < 48; ++i) out[i] = smem[i];
  cp_async_wait<1>();
  for (int i = 0; i < 48; ++i) out[48 + i] = smem[i];
  cp_async_wait<0>();
  for (int i = 0; i < 48; ++i) out[96 + i] = smem[i];
}

__global__ void partial_warp_probe(int active, float *out) {
  if (static_cast<int>(threadIdx.x) >= active) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

// One 16-byte global access at `at`: a load (kind 0), a store (1) or a cp.async source (2).
__global__ void global_access_probe(int kind, unsigned char *at) {
  TPFUSE_DYNAMIC_SHARED(smem);
  if (threadIdx.x != 0) return;
  if (kind == 0) {
    (void)load16(reinterpret_cast<const float *>(at));
  } else if (kind == 1) {
    store16(reinterpret_cast<float *>(at), Vec16<float>{});
  } else {
    cp_async_16(smem_u32(smem), at, true);
    cp_async_commit();
    cp_async_wait<0>();
  }
}

// Thread 0 writes through a plain pointer at `index` of 64 bytes of dynamic shared memory
// (kind 0) or of a 16-float __shared__ array (kind 1): in range for index < 64 (16).
__global__ void shared_write_probe(int kind, int index) {
  TPFUSE_DYNAMIC_SHARED(smem);
  TPFUSE_SHARED(float[16], floats);
  if (threadIdx.x != 0) return;
  if (kind == 0) {
    smem[index] = 1;
  } else {
    floats[index] = 1.0f;
  }
}

__global__ void smem_probe(unsigned char *out) {
  TPFUSE_DYNAMIC_SHARED(smem);
  if (threadIdx.x == 0) out[0] = smem[0];
}

// Every block but the last waits for the last block's flag, with no deadline.
__global__ void wait_for_last_block_probe(uint32_t *flag) {
  if (blockIdx.x + 1 == gridDim.x && threadIdx.x == 0) st_release_sys(flag, 1);
  if (blockIdx.x + 1 < gridDim.x && threadIdx.x == 0) {
    while (ld_acquire_sys(flag) == 0) {
    }
  }
}

// Holds one SM per block for `ns` of virtual time: its dynamic shared memory (the opt-in
// maximum, with the runtime's 1 KiB reservation all of an SM's 228 KiB) leaves no room for any
// other block. Thread 0 polls an unchanging word until the time is up (no progress, so
// virtual time runs on), the others end at once.
__global__ void occupy_sm_probe(const uint32_t *unchanging, uint64_t ns) {
  if (threadIdx.x != 0) return;
  const uint64_t until = global_timer_ns() + ns;
  while (global_timer_ns() < until) (void)ld_relaxed_sys(unchanging);
}

// Runs `launch` on a fresh stream with device copies of the listed buffers and waits.
struct ProbeStream {
  void *stream = tpfuse_emu_stream_create();
  ~ProbeStream() { tpfuse_emu_stream_destroy(stream); }
  cudaStream_t get() const { return static_cast<cudaStream_t>(stream); }
  int32_t finish() {
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) return launched;
    return tpfuse_emu_stream_synchronize(stream);
  }
};

} // namespace

extern "C" int32_t tpfuse_emu_probe_mma(int32_t bf16, const uint32_t *a, const uint32_t *b, const float *c,
                                        float *d) {
  ProbeStream s;
  if (bf16) {
    TPFUSE_LAUNCH(mma_probe<__nv_bfloat16>, 1, 32, 0, s.get())(a, b, c, d);
  } else {
    TPFUSE_LAUNCH(mma_probe<__half>, 1, 32, 0, s.get())(a, b, c, d);
  }
  return s.finish();
}

extern "C" int32_t tpfuse_emu_probe_ldmatrix_x4(const void *smem, size_t smem_bytes, const uint32_t *addr,
                                                uint32_t *out) {
  ProbeStream s;
  TPFUSE_LAUNCH(ldmatrix_probe, 1, 32, smem_bytes, s.get())
  (static_cast<const unsigned char *>(smem), smem_bytes, addr, out);
  return s.finish();
}

extern "C" int32_t tpfuse_emu_probe_shfl_xor(const float *in, int32_t lane_mask, float *out) {
  ProbeStream s;
  TPFUSE_LAUNCH(shfl_probe, 1, 32, 0, s.get())(in, lane_mask, out);
  return s.finish();
}

extern "C" int32_t tpfuse_emu_probe_cp_async(const void *src, uint8_t *out) {
  ProbeStream s;
  TPFUSE_LAUNCH(cp_async_probe, 1, 32, 48, s.get())(static_cast<const unsigned char *>(src), out);
  return s.finish();
}

extern "C" int32_t tpfuse_emu_probe_partial_warp(int32_t active_lanes) {
  ProbeStream s;
  float out[32];
  TPFUSE_LAUNCH(partial_warp_probe, 1, 32, 0, s.get())(active_lanes, out);
  return s.finish();
}

extern "C" int32_t tpfuse_emu_probe_global_access(int32_t kind, int32_t offset) {
  void *buffer = tpfuse_emu_malloc(64);
  int32_t result;
  {
    ProbeStream s;
    TPFUSE_LAUNCH(global_access_probe, 1, 32, 16, s.get())(kind, static_cast<unsigned char *>(buffer) + offset);
    result = s.finish();
  }
  tpfuse_emu_free(buffer);
  return result;
}

extern "C" int32_t tpfuse_emu_probe_shared_write(int32_t kind, int32_t index) {
  ProbeStream s;
  TPFUSE_LAUNCH(shared_write_probe, 1, 32, 64, s.get())(kind, index);
  return s.finish();
}

extern "C" int32_t tpfuse_emu_probe_smem_launch(int32_t threads, size_t smem_bytes, int32_t opt_in) {
  if (opt_in) {
    const cudaError_t e = cudaFuncSetAttribute(smem_probe, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem_bytes));
    if (e != cudaSuccess) return e;
  }
  ProbeStream s;
  unsigned char out[1024];
  TPFUSE_LAUNCH(smem_probe, 1, threads, smem_bytes, s.get())(out);
  return s.finish();
}

extern "C" int32_t tpfuse_emu_probe_wait_for_last_block(int32_t blocks, void *stream) {
  uint32_t *flag = static_cast<uint32_t *>(tpfuse_emu_malloc(sizeof(uint32_t)));
  *flag = 0;
  TPFUSE_LAUNCH(wait_for_last_block_probe, blocks, 1024, 0, static_cast<cudaStream_t>(stream))(flag);
  const cudaError_t launched = cudaGetLastError();
  const int32_t result = launched != cudaSuccess ? launched : tpfuse_emu_stream_synchronize(stream);
  tpfuse_emu_free(flag);
  return result;
}

extern "C" int32_t tpfuse_emu_occupy_sms(void *stream, int32_t sms, uint64_t ns) {
  static uint32_t unchanging = 0;
  int opt_in = 0;  // the most a block may have: with the runtime's 1 KiB, the SM's all
  cudaError_t e = cudaDeviceGetAttribute(&opt_in, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(occupy_sm_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, opt_in);
  if (e != cudaSuccess) return e;
  TPFUSE_LAUNCH(occupy_sm_probe, sms, 32, static_cast<size_t>(opt_in), static_cast<cudaStream_t>(stream))(
      &unchanging, ns);
  return cudaGetLastError();
}
