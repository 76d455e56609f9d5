// residency.cpp: what a resident block holds of its SM, counted as an H100 (compute capability
// 9.0) counts it, and so how many blocks of a kernel an SM holds at once (the occupancy API, and
// the bound of a cooperative launch).
//
// A block holds:
//   - its threads (2048 an SM) and a block slot (32 an SM);
//   - registers: the kernel's registers per thread on sm_90a (ptxas, kernel_resources.inc),
//     allocated per warp in units of 256 (so a warp holds 32 x the count rounded up to 8);
//     65536 an SM, and at most 255 a thread;
//   - shared memory: its dynamic size plus the kernel's static size (ptxas), rounded up to
//     128 bytes, plus the 1 KiB the CUDA runtime reserves per block; 228 KiB an SM.
// A kernel missing from the table (the emulator's own probes) counts 32 registers a thread and
// no static shared memory; tests/cpu_build.rs checks that the table holds every kernel of the
// GPU build at no fewer registers and no less static shared memory than ptxas reports.
#include <algorithm>
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

constexpr int kRegistersPerSm = 65536;
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

Footprint footprint_of(const char *kernel_name, unsigned threads, size_t dynamic_smem) {
  const KernelResources *k = resources_of(base_name(kernel_name));
  const int registers = k != nullptr ? k->registers : kUnknownRegisters;
  const int warps = static_cast<int>((threads + 31) / 32);
  const int per_warp = (registers * 32 + kRegisterUnit - 1) / kRegisterUnit * kRegisterUnit;
  const size_t smem = dynamic_smem + (k != nullptr ? static_cast<size_t>(k->static_smem) : 0);
  Footprint f;
  f.threads = static_cast<int>(threads);
  f.registers = warps * per_warp;
  f.smem = (smem + kSmemUnit - 1) / kSmemUnit * kSmemUnit + kSmemReservedPerBlock;
  return f;
}

bool fits(const Device &dev, int sm, const Footprint &f) {
  return dev.sm_blocks[sm] < kBlocksPerSm && dev.sm_threads[sm] + f.threads <= kThreadsPerSm &&
         dev.sm_registers[sm] + f.registers <= kRegistersPerSm && dev.sm_smem[sm] + f.smem <= kSmemPerSm;
}

void hold(Device &dev, int sm, const Footprint &f, int sign) {
  dev.sm_blocks[sm] += sign;
  dev.sm_threads[sm] += sign * f.threads;
  dev.sm_registers[sm] += sign * f.registers;
  dev.sm_smem[sm] = sign > 0 ? dev.sm_smem[sm] + f.smem : dev.sm_smem[sm] - f.smem;
}

int blocks_per_sm(const Footprint &f) {
  if (f.threads <= 0) return 0;
  int n = kBlocksPerSm;
  n = std::min(n, kThreadsPerSm / f.threads);
  if (f.registers > 0) n = std::min(n, kRegistersPerSm / f.registers);
  n = std::min(n, static_cast<int>(kSmemPerSm / f.smem));
  return n;
}

} // namespace tpfuse_emu
