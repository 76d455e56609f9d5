// residency.cpp: what a resident block holds of its SM, counted as an H100 (compute capability
// 9.0) counts it, and so how many blocks of a kernel an SM holds at once (the occupancy API, and
// the bound of a cooperative launch).
//
// A block holds (an H100's limits below; sm_limits() has the other architectures'):
//   - its warps (64 an SM; a partial warp holds a whole one) and a block slot (32 an SM);
//   - registers: the kernel's registers per thread on sm_90a (ptxas, kernel_resources.inc),
//     allocated per warp in units of 256 (so a warp holds 32 x the count rounded up to 8), in
//     the register file of the SM sub-partition the warp lands on: 4 of 16384 registers each,
//     warp i of a block on sub-partition i % 4 (so a warp's registers cannot straddle two, as
//     the CUDA occupancy calculator counts them);
//   - shared memory: its dynamic size plus the kernel's static size (ptxas), rounded up to
//     128 bytes, plus the 1 KiB the CUDA runtime reserves per block; 228 KiB an SM.
// A kernel missing from the table (the emulator's own probes) counts 32 registers a thread and
// no static shared memory; tests/cpu_build.rs checks that the table holds every kernel of the
// GPU build at no fewer registers and no less static shared memory than ptxas reports.
#include <algorithm>
#include <array>
#include <string>

#include "scheduler.hpp"

namespace tpfuse_emu {
namespace {

struct KernelResources {
  const char *kernel;  // the name without namespaces and template arguments
  int registers;       // per thread, the most of any instantiation (sm_90a)
  int static_smem;     // bytes, the most of any instantiation (sm_90a)
};

constexpr KernelResources kKernels[] = {
#include "kernel_resources.inc"
};

constexpr int kSubPartitions = 4;
constexpr int kRegistersPerSubPartition = 65536 / kSubPartitions;
constexpr int kRegisterUnit = 256;  // per warp
constexpr int kUnknownRegisters = 32;
constexpr size_t kSmemUnit = 128;
constexpr size_t kSmemReservedPerBlock = 1024;

// "tpfuse::gemm::gemm_all_reduce<T, Cfg>" -> "gemm_all_reduce".
std::string base_name(const char *name) {
  std::string s = name != nullptr ? name : "";
  s = s.substr(0, s.find('<'));
  const size_t colon = s.rfind("::");
  return colon == std::string::npos ? s : s.substr(colon + 2);
}

// A launch site may name the kernel without its `_kernel` suffix (a local pointer, e.g.
// gemm_all_reduce for gemm_all_reduce_kernel<T, Cfg>).
const KernelResources *resources_of(const std::string &kernel) {
  for (const KernelResources &k : kKernels)
    if (kernel == k.kernel || kernel + "_kernel" == k.kernel) return &k;
  return nullptr;
}

} // namespace

// Per compute capability (CUDA programming guide, "Compute capabilities" table): threads, blocks
// and shared memory per SM, and the most shared memory one block may opt in to. Registers are
// 65536 an SM on all of them; the kernels' registers are sm_90a's everywhere (an approximation
// for the other architectures, whose ptxas counts differ by a few).
const SmLimits &sm_limits() {
  static const SmLimits kLimits[] = {
      {80, 2048, 32, 164 * 1024, 163 * 1024},  {86, 1536, 16, 100 * 1024, 99 * 1024},
      {89, 1536, 24, 100 * 1024, 99 * 1024},   {90, 2048, 32, 228 * 1024, 227 * 1024},
      {100, 2048, 32, 228 * 1024, 227 * 1024}, {120, 1536, 32, 100 * 1024, 99 * 1024},
  };
  const int arch = device().config.arch;
  for (const SmLimits &l : kLimits)
    if (l.arch == arch) return l;
  return kLimits[3];
}

bool known_arch(int arch) {
  for (int a : {80, 86, 89, 90, 100, 120})
    if (a == arch) return true;
  return false;
}

Footprint footprint_of(const char *kernel_name, unsigned threads, size_t dynamic_smem) {
  const KernelResources *k = resources_of(base_name(kernel_name));
  const int registers = k != nullptr ? k->registers : kUnknownRegisters;
  const size_t smem = dynamic_smem + (k != nullptr ? static_cast<size_t>(k->static_smem) : 0);
  Footprint f;
  f.warps = static_cast<int>((threads + 31) / 32);
  f.warp_registers = (registers * 32 + kRegisterUnit - 1) / kRegisterUnit * kRegisterUnit;
  f.smem = (smem + kSmemUnit - 1) / kSmemUnit * kSmemUnit + kSmemReservedPerBlock;
  return f;
}

namespace {
// Registers the block's warps take from sub-partition `p` when its warp 0 lands on `first`.
int registers_on(const Footprint &f, int first, int p) {
  const int offset = (p - first + kSubPartitions) % kSubPartitions;
  return (f.warps / kSubPartitions + (offset < f.warps % kSubPartitions ? 1 : 0)) * f.warp_registers;
}
} // namespace

int place(const Device &dev, int sm, const Footprint &f) {
  const SmLimits &limits = sm_limits();
  if (dev.sm_blocks[sm] >= limits.blocks || dev.sm_threads[sm] + 32 * f.warps > limits.threads ||
      dev.sm_smem[sm] + f.smem > limits.smem) {
    return -1;
  }
  // Warp 0 on the sub-partition with the most registers free, the next warps round from it.
  const std::array<int, 4> &used = dev.sm_registers[sm];
  const int first = static_cast<int>(std::min_element(used.begin(), used.end()) - used.begin());
  for (int p = 0; p < kSubPartitions; ++p)
    if (used[p] + registers_on(f, first, p) > kRegistersPerSubPartition) return -1;
  return first;
}

void hold(Device &dev, int sm, const Footprint &f, int first, int sign) {
  dev.sm_blocks[sm] += sign;
  dev.sm_threads[sm] += sign * 32 * f.warps;
  for (int p = 0; p < kSubPartitions; ++p) dev.sm_registers[sm][p] += sign * registers_on(f, first, p);
  dev.sm_smem[sm] = sign > 0 ? dev.sm_smem[sm] + f.smem : dev.sm_smem[sm] - f.smem;
}

int blocks_per_sm(const Footprint &f) {
  if (f.warps <= 0) return 0;
  const SmLimits &limits = sm_limits();
  int n = std::min(limits.blocks, limits.threads / (32 * f.warps));
  n = std::min(n, static_cast<int>(limits.smem / f.smem));
  if (f.warp_registers > 0) {
    // Whole warps a sub-partition holds, shared out over the block's warps (the occupancy
    // calculator's cudaOccMaxBlocksPerSMRegsLimit).
    const int warps_per_sm = kRegistersPerSubPartition / f.warp_registers * kSubPartitions;
    n = std::min(n, warps_per_sm / f.warps);
  }
  return n;
}

} // namespace tpfuse_emu
