// gemm.cu: C[m,n] = A[m,k] · B[n,k]^T (+ bias[n]) (+ residual[m,n]), f16 / bf16 in, f32
// accumulation, C rounded once to the input type. Row-major everything; B is a PyTorch weight
// [out_features, in_features].
//
// The entry point picks a path by compute capability, then a tile configuration by shape:
//
//   compute capability < 8.0     no path (cudaErrorNoKernelImageForDevice, nothing launched)
//   8.0 and later, m <= 16       sm80 small-m path (decode): SmallM16x{16,32,64}
//   8.0 and later, m > 16        sm80 tiled path: Tile64x64 or Tile128x128
//   (9.0 with sm_90a SASS        the place for a future wgmma/TMA path: see select_config)
//
// and the split of k, S = split_parts(n, k, sms): from n, k and the SM count only, so the same
// for every m. With S > 1 the configuration is SmallM16x64 (m <= 16) or Tile64x64, and the
// parts run in parallel (gemm_split.cuh: a block per part of a tile) when m <= 64 and the
// caller gave a scratch large enough, else one after another in each tile's block.
//
// Every configuration that runs the shape's split (all but Tile128x128 when S > 1), and either
// way of running the parts, gives the same bits for the same row (gemm_sm80.cuh explains why),
// so the choice is free to follow performance only. (Prefill thus runs 64x64 tiles where k
// splits: a 128x128 tile has no registers left for the parts' running total. Unmeasured.)

#include <climits>

#include "gemm_split.cuh"
#include "kernel_list.cuh"

namespace tpfuse {
namespace gemm {
namespace {

// The device's compute capability (major * 10 + minor) and SM count, queried once per device.
struct DeviceFacts {
  int cc;
  int sms;
};

bool device_facts(DeviceFacts &facts) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cc_cache[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return false;
  int cc = cc_cache[device].load(std::memory_order_relaxed);
  if (cc <= 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      return false;
    }
    cc = major * 10 + minor;
    cc_cache[device].store(cc, std::memory_order_relaxed);
  }
  facts.cc = cc;
  return current_sm_count_checked(facts.sms); // no guess: the split of k follows the SM count
}

size_t ceil_div(size_t x, size_t y) { return (x + y - 1) / y; }

// The configuration a call runs, or -1 when the device has no path.
int select_config(size_t m, size_t n, size_t k, int cc, int sms) {
  if (cc < 80) return -1;
  if (split_parts(n, k, sms) > 1) {
    // A split: the 64-column tiles split_parts counted (Tile128x128 runs no split).
    return m <= TPFUSE_GEMM_SMALL_M_MAX ? TPFUSE_GEMM_CONFIG_SMALL_16X64 : TPFUSE_GEMM_CONFIG_TILE_64X64;
  }
  // A future sm90a path (wgmma + TMA, built only for sm_90a) goes here, for cc == 90 and
  // m > TPFUSE_GEMM_SMALL_M_MAX, behind the same entry point. It must keep the batch-invariance
  // contract of gemm_sm80.cuh with the small-m path (same per-element accumulation order and
  // instruction semantics), or the small-m path must move to it as well.
  if (m <= TPFUSE_GEMM_SMALL_M_MAX) {
    // The widest block that still gives every SM a block: fewer, wider blocks read each
    // k-slice of A once for more columns; narrow N (e.g. qkv at TP=8) needs narrow blocks.
    if (ceil_div(n, SmallM16x64::kBlockN) >= static_cast<size_t>(sms)) return TPFUSE_GEMM_CONFIG_SMALL_16X64;
    if (ceil_div(n, SmallM16x32::kBlockN) >= static_cast<size_t>(sms)) return TPFUSE_GEMM_CONFIG_SMALL_16X32;
    return TPFUSE_GEMM_CONFIG_SMALL_16X16;
  }
  // 128x128 once its tiles give at least 90% of the SMs a block: on an H200, m = 256 of
  // n = 8192 (128 tiles on 132 SMs) ran 1.36-1.38x faster in them than in 64x64 tiles
  // (docs/performance.md, "Second H200 run").
  const size_t big_tiles = ceil_div(m, Tile128x128::kBlockM) * ceil_div(n, Tile128x128::kBlockN);
  return big_tiles * 10 >= static_cast<size_t>(sms) * 9 ? TPFUSE_GEMM_CONFIG_TILE_128X128
                                                         : TPFUSE_GEMM_CONFIG_TILE_64X64;
}

template <typename Cfg> void describe(int32_t path, tpfuse_gemm_config_info &info) {
  info.path = path;
  info.block_m = Cfg::kBlockM;
  info.block_n = Cfg::kBlockN;
  info.block_k = Cfg::kBlockK;
  info.stages = Cfg::kStages;
  info.threads = Cfg::kThreads;
  info.smem_bytes = Cfg::kSmemBytes;
}

// What tpfuse_gemm runs for a configuration: itself (Fused<Cfg> is what the fused kernels run).
template <typename Cfg> struct Plain {
  using type = Cfg;
};

// Fills `info` for configuration `config` as `Map` maps it (Plain or Fused).
// The small-m path is the configurations of one m16 row of fragments.
template <template <typename> class Map> int describe_as(int32_t config, tpfuse_gemm_config_info *info) {
  if (info == nullptr) return cudaErrorInvalidValue;
  return visit_config(config, [&](auto selected) {
    using Cfg = decltype(selected);
    describe<typename Map<Cfg>::type>(
        Cfg::kBlockM == 16 ? TPFUSE_GEMM_PATH_SM80_SMALL_M : TPFUSE_GEMM_PATH_SM80_TILED, *info);
    return 0;
  });
}

// The scratch a parallel split of `parts` needs for [m, n]: the counts, then the partials
// (gemm_split.cuh).
size_t split_scratch_bytes(size_t m, size_t n, int parts) {
  return kSplitCountsBytes + static_cast<size_t>(parts) * m * n * sizeof(float);
}

template <typename T, typename Cfg>
int launch_config(const T *a, const T *b, const T *bias, const T *residual, T *c, int m, int n, int k, int parts,
                  void *scratch, size_t scratch_bytes, cudaStream_t stream) {
  const long long tiles_m = (m + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const long long tiles_n = (n + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const long long tiles = tiles_m * tiles_n;
  if (tiles * parts > INT_MAX) return cudaErrorInvalidConfiguration;
  const GemmEpilogue<T> epi{c, bias, residual, n};
  if constexpr (kParallelSplit<Cfg>) {
    const size_t needed = split_scratch_bytes(m, n, parts);
    if (parts > 1 && m <= TPFUSE_GEMM_SPLIT_PARALLEL_M_MAX && tiles <= static_cast<long long>(kSplitMaxTiles) &&
        scratch != nullptr && needed <= scratch_bytes) {
      auto gemm_split = gemm_split_kernel<T, Cfg>;
      // Always opted in: its static shared memory (`last`) counts with the dynamic size toward
      // the default 48 KiB (SmallM16x32 and Tile64x64 take exactly that).
      const cudaError_t err =
          cudaFuncSetAttribute(gemm_split, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
      if (err != cudaSuccess) return err;
      char *base = static_cast<char *>(scratch);
      TPFUSE_LAUNCH(gemm_split, static_cast<unsigned>(tiles * parts), Cfg::kThreads, Cfg::kSmemBytes, stream)(
          a, b, m, n, k, static_cast<int>(tiles_m), static_cast<int>(tiles_n), parts,
          reinterpret_cast<uint32_t *>(base), reinterpret_cast<float *>(base + kSplitCountsBytes), epi);
      return cudaGetLastError();
    }
  } else if constexpr (!Cfg::kSplittable) {
    if (parts != 1) return cudaErrorInvalidValue; // a configuration without the split
  }
  auto gemm_sm80 = gemm_sm80_kernel<T, Cfg, GemmEpilogue<T>>;
  const cudaError_t err = allow_dynamic_smem(gemm_sm80, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  TPFUSE_LAUNCH(gemm_sm80, static_cast<unsigned>(tiles), Cfg::kThreads, Cfg::kSmemBytes, stream)(
      a, b, m, n, k, static_cast<int>(tiles_m), static_cast<int>(tiles_n), parts, epi);
  return cudaGetLastError();
}

template <typename T>
int launch(int config, const void *a, const void *b, const void *bias, const void *residual, void *c, int m,
           int n, int k, int parts, void *scratch, size_t scratch_bytes, cudaStream_t stream) {
  const T *ta = static_cast<const T *>(a);
  const T *tb = static_cast<const T *>(b);
  const T *tbias = static_cast<const T *>(bias);
  const T *tres = static_cast<const T *>(residual);
  T *tc = static_cast<T *>(c);
  return visit_config(config, [&](auto cfg) {
    return launch_config<T, decltype(cfg)>(ta, tb, tbias, tres, tc, m, n, k, parts, scratch, scratch_bytes, stream);
  });
}

constexpr size_t kMaxDim = size_t{1} << 30;

template <typename T, typename Cfg> void add_gemm_kernels(KernelList &list) {
  list.add(gemm_sm80_kernel<T, Cfg, GemmEpilogue<T>>);
  if constexpr (kParallelSplit<Cfg>) list.add(gemm_split_kernel<T, Cfg>);
}

} // namespace
} // namespace gemm

void gemm_kernels(KernelList &list) {
  gemm::for_each_config([&](auto cfg) {
    gemm::add_gemm_kernels<__half, decltype(cfg)>(list);
    gemm::add_gemm_kernels<__nv_bfloat16, decltype(cfg)>(list);
  });
}

} // namespace tpfuse

extern "C" int tpfuse_gemm_scratch(tpfuse_dtype dtype, int32_t config, const void *a, const void *b,
                                   const void *bias, const void *residual, void *c, size_t m, size_t n, size_t k,
                                   void *scratch, size_t scratch_bytes, void *stream) {
  using namespace tpfuse::gemm;
  if (m == 0) return cudaSuccess;
  if (n == 0 || k == 0 || n % 8 != 0 || k % 8 != 0 || m > kMaxDim || n > kMaxDim || k > kMaxDim)
    return cudaErrorInvalidValue;
  if (a == nullptr || b == nullptr || c == nullptr) return cudaErrorInvalidValue;
  for (const void *p : {a, b, bias, residual, static_cast<const void *>(c), static_cast<const void *>(scratch)})
    if (!tpfuse::is_aligned16(p)) return cudaErrorMisalignedAddress;
  DeviceFacts facts{};
  if (!device_facts(facts)) return cudaErrorInvalidDevice;
  if (config == TPFUSE_GEMM_CONFIG_AUTO) config = select_config(m, n, k, facts.cc, facts.sms);
  if (config < 0 || facts.cc < 80) return cudaErrorNoKernelImageForDevice;
  const int parts = split_parts(n, k, facts.sms);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  switch (dtype) {
  case TPFUSE_DTYPE_F16: return launch<__half>(config, a, b, bias, residual, c, im, in, ik, parts, scratch, scratch_bytes, s);
  case TPFUSE_DTYPE_BF16:
    return launch<__nv_bfloat16>(config, a, b, bias, residual, c, im, in, ik, parts, scratch, scratch_bytes, s);
  default: return cudaErrorInvalidValue;
  }
}

extern "C" int tpfuse_gemm(tpfuse_dtype dtype, int32_t config, const void *a, const void *b, const void *bias,
                           const void *residual, void *c, size_t m, size_t n, size_t k, void *stream) {
  return tpfuse_gemm_scratch(dtype, config, a, b, bias, residual, c, m, n, k, nullptr, 0, stream);
}

extern "C" int32_t tpfuse_gemm_select(size_t m, size_t n, size_t k, int32_t cc_major, int32_t cc_minor,
                                      int32_t sm_count) {
  return tpfuse::gemm::select_config(m, n, k, cc_major * 10 + cc_minor, sm_count > 0 ? sm_count : 1);
}

extern "C" int32_t tpfuse_gemm_split_parts(size_t n, size_t k, int32_t sm_count) {
  return tpfuse::gemm::split_parts(n, k, sm_count > 0 ? sm_count : 1);
}

extern "C" size_t tpfuse_gemm_scratch_bytes(size_t m, size_t n, size_t k, int32_t sm_count) {
  using namespace tpfuse::gemm;
  const int sms = sm_count > 0 ? sm_count : 1;
  const int parts = split_parts(n, k, sms);
  if (parts < 2 || m == 0 || m > TPFUSE_GEMM_SPLIT_PARALLEL_M_MAX) return 0;
  // The split's configuration: 16 x 64 or 64 x 64 tiles, one row of them at m <= 64.
  if (ceil_div(n, 64) > kSplitMaxTiles) return 0;
  return split_scratch_bytes(m, n, parts);
}

extern "C" int tpfuse_gemm_describe(int32_t config, tpfuse_gemm_config_info *info) {
  return tpfuse::gemm::describe_as<tpfuse::gemm::Plain>(config, info);
}

extern "C" int tpfuse_gemm_describe_fused(int32_t config, tpfuse_gemm_config_info *info) {
  return tpfuse::gemm::describe_as<tpfuse::gemm::Fused>(config, info);
}
