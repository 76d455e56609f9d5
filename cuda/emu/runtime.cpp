// runtime.cpp: the host side of the CPU emulator: the CUDA runtime calls that tpfuse's
// launchers make, launch validation and enqueue, and the C ABI of tpfuse_emu.h.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#include "scheduler.hpp"

namespace tpfuse_emu {
namespace {

thread_local cudaError_t last_error = cudaSuccess;

uint64_t env_u64(const char *name, uint64_t fallback) {
  const char *v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char *end = nullptr;
  const unsigned long long x = std::strtoull(v, &end, 10);
  if (end == v || *end != '\0') {
    std::fprintf(stderr, "tpfuse emulator: %s=%s is not a number; using %llu\n", name, v,
                 static_cast<unsigned long long>(fallback));
    return fallback;
  }
  return x;
}

int schedule_from_env() {
  const char *v = std::getenv("TPFUSE_EMU_SCHEDULE");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "forward") == 0) return TPFUSE_EMU_SCHEDULE_FORWARD;
  if (std::strcmp(v, "reverse") == 0) return TPFUSE_EMU_SCHEDULE_REVERSE;
  if (std::strcmp(v, "random") == 0) return TPFUSE_EMU_SCHEDULE_RANDOM;
  if (std::strcmp(v, "pct") == 0) return TPFUSE_EMU_SCHEDULE_PCT;
  std::fprintf(stderr, "tpfuse emulator: TPFUSE_EMU_SCHEDULE=%s is not forward, reverse, random or pct; using forward\n",
               v);
  return TPFUSE_EMU_SCHEDULE_FORWARD;
}

// "one_shot_kernel<T>" launched from "... launch_all_reduce(...) [with T = float; ...]" ->
// "one_shot_kernel<T> [T = float]": the instantiation, for the report.
std::string instantiation_name(const char *name, const char *context) {
  std::string ctx = context ? context : "";
  std::string out = name;
  const size_t with = ctx.find("[with ");
  if (with != std::string::npos) {
    std::string args = ctx.substr(with + 6);
    if (!args.empty() && args.back() == ']') args.pop_back();
    // Drop namespaces, and the typedefs that say nothing about the instantiation
    // ("size_t = long unsigned int", "tpfuse_peers = tpfuse_peers").
    for (const char *noise : {"tpfuse::gemm::", "tpfuse::", "{anonymous}::"}) {
      for (size_t at; (at = args.find(noise)) != std::string::npos;) args.erase(at, std::strlen(noise));
    }
    std::string kept;
    size_t begin = 0;
    while (begin < args.size()) {
      size_t end = args.find("; ", begin);
      if (end == std::string::npos) end = args.size();
      const std::string item = args.substr(begin, end - begin);
      const size_t eq = item.find(" = ");
      const std::string name = eq == std::string::npos ? item : item.substr(0, eq);
      const std::string value = eq == std::string::npos ? "" : item.substr(eq + 3);
      if (name != value && name != "size_t" && name != "cudaStream_t") kept += (kept.empty() ? "" : "; ") + item;
      begin = end + 2;
    }
    args = kept;
    out += " [" + args + "]";
  }
  return out;
}


std::string report_text() {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  std::ostringstream s;
  for (auto &entry : dev.stats) s << entry.second.launches << "\t" << entry.second.blocks << "\t" << entry.second.name << "\n";
  return s.str();
}

void append_report_at_exit() {
  const char *path = std::getenv("TPFUSE_EMU_REPORT");
  if (path == nullptr || *path == '\0') return;
  const std::string text = report_text();
  // One write(2) with O_APPEND: test processes that run at once (scripts/run-tests.sh) append
  // whole reports, never interleaved lines.
  const int fd = ::open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
  if (fd < 0) return;
  if (::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    std::fprintf(stderr, "tpfuse emulator: TPFUSE_EMU_REPORT=%s: short write\n", path);
  }
  ::close(fd);
}

cudaError_t fail(cudaError_t code, const char *why, const LaunchSpec &spec) {
  const std::string text = std::string("launch of ") + spec.name + " refused: " + why;
  std::fprintf(stderr, "tpfuse emulator: %s\n", text.c_str());
  {
    Device &dev = device();
    std::lock_guard<std::mutex> lk(dev.mu);
    dev.last_failure = text;
  }
  last_error = code;
  return code;
}

// Whether `spec` asks for more dynamic shared memory than its kernel may have.
bool exceeds_shared_memory_limit(Device &dev, const LaunchSpec &spec) {
  if (spec.smem <= kSmemPerBlockDefault) return false;
  std::lock_guard<std::mutex> lk(dev.mu);
  auto it = dev.max_dynamic_smem.find(spec.func);
  return it == dev.max_dynamic_smem.end() || static_cast<size_t>(it->second) < spec.smem;
}

} // namespace

size_t copy_out(const std::string &text, char *buf, size_t cap) {
  if (buf != nullptr && cap > 0) {
    const size_t n = text.size() < cap - 1 ? text.size() : cap - 1;
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

Stream *stream_of(cudaStream_t s) {
  return s == nullptr ? device().default_stream : reinterpret_cast<Stream *>(s);
}

void enqueue_op(std::unique_ptr<Launch> launch) {
  Device &dev = device();
  {
    std::lock_guard<std::mutex> lk(dev.mu);
    Stream *s = launch->stream;
    launch->seq = dev.launch_seq++;
    if (weak_memory) launch->after = dev.host_known;  // the host's order before it
    if (s->capturing) {
      s->captured.push_back(std::move(launch));
    } else {
      s->queue.push_back(std::move(launch));
      ++s->enqueued;
    }
  }
  dev.wake_device.notify_one();
}

std::unique_ptr<Launch> clone_op(const Launch &op) {
  auto copy = std::make_unique<Launch>();
  copy->stream = op.stream;
  copy->func = op.func;
  copy->name = op.name;
  copy->grid = op.grid;
  copy->block = op.block;
  copy->smem = op.smem;
  copy->footprint = op.footprint;
  copy->cooperative = op.cooperative;
  copy->body = op.body;
  copy->host_work = op.host_work;
  copy->ready = op.ready;
  copy->joins = op.joins;
  copy->records = op.records;
  return copy;
}

void run_until_completed(std::unique_lock<std::mutex> &lk, const std::vector<std::pair<Stream *, uint64_t>> &targets) {
  Device &dev = device();
  ++dev.waiters;
  dev.wake_device.notify_one();
  dev.work_done.wait(lk, [&] {
    for (auto &t : targets)
      if (t.first->completed < t.second) return false;
    return true;
  });
  --dev.waiters;
}

cudaError_t synchronize_stream(Stream *only, bool learn) {
  Device &dev = device();
  std::unique_lock<std::mutex> lk(dev.mu);
  std::vector<std::pair<Stream *, uint64_t>> targets;
  for (auto &s : dev.streams)
    if (only == nullptr || s.get() == only) targets.emplace_back(s.get(), s->enqueued);
  run_until_completed(lk, targets);
  if (learn)
    for (auto &t : targets) dev.host_known.join(t.first->known);  // what the host waited for
  cudaError_t error = cudaSuccess;
  for (auto &t : targets)
    if (error == cudaSuccess) error = t.first->error;
  return error;
}

bool device_wanted(const Device &dev) {
  return dev.waiters > dev.bounded_waiters || (dev.bounded_waiters > 0 && dev.clock_ns < dev.run_until_ns);
}

bool run_query_slice(const std::function<bool()> &done) {
  static const uint64_t slice_ns = env_u64("TPFUSE_EMU_QUERY_SLICE_NS", 1000 * 1000);
  Device &dev = device();
  std::unique_lock<std::mutex> lk(dev.mu);
  if (done()) return true;
  const uint64_t bound = now_ns() + slice_ns;
  ++dev.waiters;
  ++dev.bounded_waiters;
  dev.run_until_ns = std::max(dev.run_until_ns, bound);
  dev.wake_device.notify_one();
  // Past the bound, wait for the device to park at the end of its pass (unless a synchronize
  // keeps it running): the host goes on only from that deterministic point.
  dev.work_done.wait(lk, [&] {
    return done() || (now_ns() >= bound && (dev.parked || dev.waiters > dev.bounded_waiters));
  });
  --dev.waiters;
  if (--dev.bounded_waiters == 0) dev.run_until_ns = 0;
  return done();
}

int emulated_devices() {
  static const int count = [] {
    const char *v = std::getenv("TPFUSE_EMU_DEVICES");
    const int n = v ? std::atoi(v) : 1;
    return n >= 1 && n <= kMaxDevices ? n : 1;
  }();
  return count;
}

int32_t memory_from_env() {
  const char *v = std::getenv("TPFUSE_EMU_MEMORY");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "sc") == 0) return TPFUSE_EMU_MEMORY_SC;
  if (std::strcmp(v, "weak") == 0) return TPFUSE_EMU_MEMORY_WEAK;
  if (std::strcmp(v, "weak-random") == 0) return TPFUSE_EMU_MEMORY_WEAK_RANDOM;
  std::fprintf(stderr, "tpfuse emulator: TPFUSE_EMU_MEMORY=%s is not sc, weak or weak-random; using sc\n", v);
  return TPFUSE_EMU_MEMORY_SC;
}

tpfuse_emu_config config_from_env() {
  tpfuse_emu_config c{};
  c.sms = static_cast<int32_t>(env_u64("TPFUSE_EMU_SMS", 132));
  c.schedule = schedule_from_env();
  c.seed = env_u64("TPFUSE_EMU_SEED", 1);
  c.deadlock_ns = env_u64("TPFUSE_EMU_DEADLOCK_NS", 60ull * 1000 * 1000 * 1000);
  c.arch = static_cast<int32_t>(env_u64("TPFUSE_EMU_ARCH", 90));
  if (!known_arch(c.arch)) {
    std::fprintf(stderr, "tpfuse emulator: TPFUSE_EMU_ARCH=%d is not 80, 86, 89, 90, 100 or 120; using 90\n", c.arch);
    c.arch = 90;
  }
  if (c.sms < 1 || c.sms > 1024) c.sms = 132;
  c.memory = memory_from_env();
  std::atexit(append_report_at_exit);
  return c;
}

cudaError_t max_active_blocks(int *blocks, const void *func, const char *name, int threads, size_t smem) {
  if (blocks == nullptr || threads <= 0) return cudaErrorInvalidValue;
  LaunchSpec spec{};
  spec.func = func;
  spec.smem = smem;
  *blocks = exceeds_shared_memory_limit(device(), spec)
                ? 0
                : blocks_per_sm(footprint_of(name, static_cast<unsigned>(threads), smem));
  return cudaSuccess;
}

cudaError_t enqueue_launch(const LaunchSpec &spec, std::function<void()> body) {
  Device &dev = device();
  if (spec.grid == 0 || spec.block == 0) return fail(cudaErrorInvalidConfiguration, "an empty grid or block", spec);
  if (spec.grid_y != 1 || spec.grid_z != 1 || spec.block_y != 1 || spec.block_z != 1) {
    return fail(cudaErrorNotSupported, "only one-dimensional grids and blocks are emulated", spec);
  }
  if (spec.block > 1024) return fail(cudaErrorInvalidConfiguration, "more than 1024 threads per block", spec);
  if (exceeds_shared_memory_limit(dev, spec)) {
    return fail(cudaErrorInvalidValue,
                "more than 48 KiB of dynamic shared memory without cudaFuncAttributeMaxDynamicSharedMemorySize", spec);
  }
  // Residency (residency.cpp): a block no SM can hold is refused, as a GPU refuses it; a
  // cooperative grid larger than the device holds at once is refused as cudaLaunchKernelEx
  // refuses it (the occupancy API's blocks per SM times the SMs).
  const Footprint footprint = footprint_of(spec.name, spec.block, spec.smem);
  const int per_sm = blocks_per_sm(footprint);
  if (per_sm == 0) {
    return fail(cudaErrorLaunchOutOfResources,
                "a block's threads, registers or shared memory exceed what one SM holds", spec);
  }
  if (spec.cooperative && static_cast<uint64_t>(spec.grid) > static_cast<uint64_t>(per_sm) * dev.config.sms) {
    const std::string why = "a cooperative grid of " + std::to_string(spec.grid) + " blocks, but the device holds " +
                            std::to_string(per_sm) + " a SM x " + std::to_string(dev.config.sms) + " SMs at once";
    return fail(cudaErrorCooperativeLaunchTooLarge, why.c_str(), spec);
  }
  Stream *stream = stream_of(spec.stream);
  load_function(spec.func, stream->device);  // a first use: CUDA's lazy loading (loading.cpp)
  auto launch = std::make_unique<Launch>();
  launch->stream = stream;
  launch->func = spec.func;
  launch->name = instantiation_name(spec.name, spec.context);
  launch->grid = dim3(spec.grid);
  launch->block = dim3(spec.block);
  launch->smem = spec.smem;
  launch->footprint = footprint;
  launch->cooperative = spec.cooperative;
  launch->body = std::move(body);
  enqueue_op(std::move(launch));
  last_error = cudaSuccess;
  return cudaSuccess;
}

} // namespace tpfuse_emu

using namespace tpfuse_emu;

extern "C" {

cudaError_t cudaGetDevice(int *d) {
  if (d == nullptr) return cudaErrorInvalidValue;
  *d = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int d) {
  if (value == nullptr || d != 0) return cudaErrorInvalidDevice;
  switch (attr) {
  case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
  case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(kSmemPerBlockDefault); break;
  case cudaDevAttrWarpSize: *value = 32; break;
  case cudaDevAttrMultiProcessorCount: *value = device().config.sms; break;
  case cudaDevAttrMaxThreadsPerMultiProcessor: *value = sm_limits().threads; break;
  case cudaDevAttrComputeCapabilityMajor: *value = sm_limits().arch / 10; break;
  case cudaDevAttrComputeCapabilityMinor: *value = sm_limits().arch % 10; break;
  case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = static_cast<int>(sm_limits().smem); break;
  case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(sm_limits().smem_opt_in); break;
  default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return last_error; }

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return "no error";
  case cudaErrorInvalidValue: return "invalid argument";
  case cudaErrorMemoryAllocation: return "out of memory";
  case cudaErrorInvalidConfiguration: return "invalid configuration argument";
  case cudaErrorInvalidDevice: return "invalid device ordinal";
  case cudaErrorNoKernelImageForDevice: return "no kernel image is available for execution on the device";
  case cudaErrorNotReady: return "device not ready";
  case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
  case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
  case cudaErrorLaunchTimeout: return "the launch timed out and was terminated";
  case cudaErrorMisalignedAddress: return "misaligned address";
  case cudaErrorLaunchFailure: return "unspecified launch failure";
  case cudaErrorCooperativeLaunchTooLarge: return "too many blocks in cooperative launch";
  case cudaErrorNotSupported: return "operation not supported";
  default: return "unknown error";
  }
}

cudaError_t tpfuse_emu_func_set_attribute(const void *func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<size_t>(value) > sm_limits().smem_opt_in) {
    return cudaErrorInvalidValue;
  }
  load_function(func, current_device());  // a first use: CUDA's lazy loading (loading.cpp)
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  dev.max_dynamic_smem[func] = value;
  return cudaSuccess;
}

void tpfuse_emu_get_config(tpfuse_emu_config *out) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  *out = dev.config;
}

int32_t tpfuse_emu_set_config(const tpfuse_emu_config *config) {
  if (config == nullptr || config->sms < 1 || config->sms > 1024 || config->schedule < 0 || config->schedule > TPFUSE_EMU_SCHEDULE_PCT ||
      config->deadlock_ns == 0 || !known_arch(config->arch) || config->memory < TPFUSE_EMU_MEMORY_SC ||
      config->memory > TPFUSE_EMU_MEMORY_WEAK_RANDOM) {
    return cudaErrorInvalidValue;
  }
  Device &dev = device();
  std::unique_lock<std::mutex> lk(dev.mu);
  for (auto &s : dev.streams)
    if (s->running || !s->queue.empty()) return cudaErrorNotReady;
  // Nothing is in flight: the device thread parks after its current pass, if it is in one.
  dev.work_done.wait(lk, [&] { return dev.parked; });
  dev.config = *config;
  dev.rng.seed(config->seed);
  configure_memory(config->memory, config->seed);
  dev.pct_steps = dev.demotions = 0;
  const size_t sms = static_cast<size_t>(config->sms) * emulated_devices();
  dev.sm_threads.assign(sms, 0);
  dev.sm_blocks.assign(sms, 0);
  dev.sm_smem.assign(sms, 0);
  dev.sm_registers.assign(sms, {0, 0, 0, 0});
  return cudaSuccess;
}

void *tpfuse_emu_stream_create(void) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  dev.streams.push_back(std::make_unique<Stream>());
  dev.streams.back()->slot = static_cast<uint32_t>(dev.streams.size() - 1);
  return dev.streams.back().get();
}

void tpfuse_emu_stream_destroy(void *stream) {
  // Streams stay allocated (their launches may still name them in reports); the work on one
  // is finished first, as cudaStreamDestroy lets it finish.
  if (stream != nullptr) tpfuse_emu_stream_synchronize(stream);
}

int32_t tpfuse_emu_stream_synchronize(void *stream) {
  return synchronize_stream(stream_of(static_cast<cudaStream_t>(stream)));
}

void tpfuse_emu_device_synchronize(void) { synchronize_stream(nullptr); }

size_t tpfuse_emu_stream_error(void *stream, char *buf, size_t cap) {
  Device &dev = device();
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  std::lock_guard<std::mutex> lk(dev.mu);
  return copy_out(s->message, buf, cap);
}

size_t tpfuse_emu_last_failure(char *buf, size_t cap) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  return copy_out(dev.last_failure, buf, cap);
}

int32_t tpfuse_emu_stream_set_fault(void *stream, uint64_t delay_ns, int32_t stop, int32_t freeze_timer) {
  Device &dev = device();
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  std::lock_guard<std::mutex> lk(dev.mu);
  const uint64_t now = now_ns();
  s->not_before = now + delay_ns;
  s->stop = stop != 0;
  s->frozen = freeze_timer != 0;
  s->frozen_at = now;
  return cudaSuccess;
}

int32_t tpfuse_emu_stream_set_clock_divisor(void *stream, uint32_t divisor) {
  Device &dev = device();
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  std::lock_guard<std::mutex> lk(dev.mu);
  s->clock_divisor = divisor > 1 ? divisor : 1;
  return cudaSuccess;
}

void *tpfuse_emu_malloc(size_t bytes) {
  void *p = nullptr;
  if (posix_memalign(&p, 256, bytes > 0 ? bytes : 1) != 0) return nullptr;
  std::memset(p, 0xFF, bytes);
  return p;
}

// As cudaFree and cuMemFree: after the work that may use it (an implicit device
// synchronisation; not while a stream captures, where CUDA refuses to synchronise). A test
// that panics while its ranks' launches still run frees its buffers as it unwinds: freed at
// once, they were read and written by those launches after free.
void tpfuse_emu_free(void *ptr) {
  if (!any_stream_capturing()) synchronize_stream(nullptr);
  free_device_memory(ptr);
}

uint64_t tpfuse_emu_now_ns(void) { return now_ns(); }

size_t tpfuse_emu_report(char *buf, size_t cap) { return copy_out(report_text(), buf, cap); }

} // extern "C"
