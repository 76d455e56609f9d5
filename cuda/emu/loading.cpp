// loading.cpp: CUDA's lazy loading, as strict as a GPU may be. Since CUDA 12.2 a kernel is
// loaded into a context when it is first used (a launch, cudaFuncSetAttribute) unless
// cuFuncLoad loaded it before, and such a load "might require context synchronization" (the
// CUDA programming guide, lazy loading, potential hazards). Here it always does: the first use
// of a kernel on a device waits until everything enqueued on that device's streams so far has
// completed. A kernel that waits for a peer whose launch the same host thread enqueues later
// then waits out its deadline, as it did on an H200 (docs/gpu-runs/2026-11-26-h200-suite);
// tpfuse loads its kernels when it builds a group (cuda/kernel_list.cuh).
#include <set>
#include <utility>

#include "scheduler.hpp"

namespace tpfuse_emu {
namespace {

using CUresult = int;
constexpr CUresult kSuccess = 0;
constexpr CUresult kInvalidValue = 1;
constexpr int kFunctionLoaded = 1, kFunctionNotLoaded = 0;  // CUfunctionLoadingState

// (device, kernel) pairs loaded so far, under device().mu.
std::set<std::pair<int, const void *>> &loaded() {
  static std::set<std::pair<int, const void *>> set;
  return set;
}

} // namespace

// Marked loaded only once the wait is over: another thread's first use meanwhile waits too,
// and cuFuncIsLoaded says "not loaded" until then.
void load_function(const void *func, int dev_index) {
  Device &dev = device();
  std::unique_lock<std::mutex> lk(dev.mu);
  if (loaded().count({dev_index, func})) return;
  std::vector<std::pair<Stream *, uint64_t>> targets;
  for (auto &s : dev.streams)
    if (s->device == dev_index && s->completed < s->enqueued) targets.emplace_back(s.get(), s->enqueued);
  if (!targets.empty()) run_until_completed(lk, targets);
  loaded().emplace(dev_index, func);
}

} // namespace tpfuse_emu

using namespace tpfuse_emu;

extern "C" {

cudaError_t cudaGetFuncBySymbol(cudaFunction_t *function, const void *symbol) {
  if (function == nullptr || symbol == nullptr) return cudaErrorInvalidValue;
  *function = reinterpret_cast<cudaFunction_t>(const_cast<void *>(symbol));
  return cudaSuccess;
}

CUresult cuFuncLoad(void *function) {
  if (function == nullptr) return kInvalidValue;
  load_function(function, current_device());
  return kSuccess;
}

CUresult cuFuncIsLoaded(int *state, void *function) {
  if (state == nullptr || function == nullptr) return kInvalidValue;
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  *state = loaded().count({current_device(), function}) ? kFunctionLoaded : kFunctionNotLoaded;
  return kSuccess;
}

size_t tpfuse_emu_loaded_kernels(int32_t dev_index) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  size_t n = 0;
  for (const auto &entry : loaded()) n += entry.first == dev_index;
  return n;
}

} // extern "C"
