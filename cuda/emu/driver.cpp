// driver.cpp: the CUDA driver API on the emulated device, for cudarc and tpfuse's Rust side.
//
// The emulator library carries the soname libcuda.so: a test binary links it, and cudarc's
// dlopen("libcuda.so") then finds it already loaded and resolves its cu* symbols here (one
// emulator instance serves the driver calls and the kernels' launches). Device memory is host
// memory (a CUdeviceptr is a host address); contexts, streams, events and graphs are the
// emulator's. What a GPU refuses during stream capture is refused here too. Every entry point
// cudarc resolves that is not implemented here is a weak stub (driver_stubs.cpp) that logs its
// name and returns CUDA_ERROR_NOT_SUPPORTED.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "scheduler.hpp"

namespace tpfuse_emu {
namespace {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;

constexpr CUresult kSuccess = 0;
constexpr CUresult kInvalidValue = 1;
constexpr CUresult kOutOfMemory = 2;
constexpr CUresult kInvalidDevice = 101;
constexpr CUresult kInvalidContext = 201;
constexpr CUresult kPeerAccessAlreadyEnabled = 704;
constexpr CUresult kPeerAccessNotEnabled = 705;
constexpr CUresult kInvalidHandle = 400;
constexpr CUresult kNotSupported = 801;
constexpr CUresult kCaptureUnsupported = 900;
constexpr CUresult kNotReady = 600;
constexpr CUresult kCaptureInvalidated = 901;
constexpr CUresult kCapturedEvent = 907;  // CUDA_ERROR_CAPTURED_EVENT

struct Context {
  CUdevice device = 0;
};

struct Event {
  uint64_t recorded = 0;  // records enqueued (under mu)
  bool captured = false;  // the last record was made in a capturing stream (under mu)
  std::atomic<uint64_t> completed{0};
  std::atomic<uint64_t> time_ns{0};
  // Weak memory: what its last record orders (the recording stream's frontier when the record
  // ran), under mu.
  std::shared_ptr<Frontier> last = std::make_shared<Frontier>();
};

struct Graph {
  std::vector<std::unique_ptr<Launch>> ops;
};

// One primary context per emulated device.
Context primary_contexts[kMaxDevices];
// Peer access enabled from a context's device to another's: enabled[from][to] (under mu).
bool peer_enabled[kMaxDevices][kMaxDevices];
thread_local std::vector<Context *> context_stack;

int device_count() { return emulated_devices(); }

} // namespace

int current_device() { return context_stack.empty() ? 0 : context_stack.back()->device; }

bool any_stream_capturing() {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  for (auto &s : dev.streams)
    if (s->capturing) return true;
  return false;
}

namespace {

bool capturing(Stream *s) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  return s->capturing;
}

// An operation that is host work on `stream`, in stream order (an event's record: `records`,
// the frontier it keeps, Launch::records).
void enqueue_host_work(Stream *stream, const char *name, std::function<void()> work,
                       std::shared_ptr<Frontier> records = nullptr) {
  auto op = std::make_unique<Launch>();
  op->stream = stream;
  op->name = name;
  op->host_work = std::move(work);
  op->records = std::move(records);
  enqueue_op(std::move(op));
}


void *host_ptr(CUdeviceptr p) { return reinterpret_cast<void *>(static_cast<uintptr_t>(p)); }

} // namespace
} // namespace tpfuse_emu

using namespace tpfuse_emu;

extern "C" {

CUresult cuInit(unsigned) {
  device();
  return kSuccess;
}

CUresult cuDriverGetVersion(int *version) {
  if (version == nullptr) return kInvalidValue;
  *version = 13000;
  return kSuccess;
}

CUresult cuGetErrorString(CUresult error, const char **str) {
  if (str == nullptr) return kInvalidValue;
  *str = cudaGetErrorString(static_cast<cudaError_t>(error));
  return kSuccess;
}

CUresult cuGetErrorName(CUresult error, const char **str) {
  if (str == nullptr) return kInvalidValue;
  static thread_local char name[48];
  std::snprintf(name, sizeof(name), "CUDA_ERROR_%d", error);
  *str = error == 0 ? "CUDA_SUCCESS" : name;
  return kSuccess;
}

// ---- Devices.

CUresult cuDeviceGetCount(int *count) {
  if (count == nullptr) return kInvalidValue;
  *count = device_count();
  return kSuccess;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  if (d == nullptr) return kInvalidValue;
  if (ordinal < 0 || ordinal >= device_count()) return kInvalidDevice;
  *d = ordinal;
  return kSuccess;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  if (name == nullptr || len <= 0) return kInvalidValue;
  std::snprintf(name, static_cast<size_t>(len), "tpfuse CPU emulator %d (sm_90, %d SMs)", d, device().config.sms);
  return kSuccess;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice) {
  if (bytes == nullptr) return kInvalidValue;
  *bytes = size_t{80} << 30;
  return kSuccess;
}

CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice d) {
  if (uuid == nullptr) return kInvalidValue;
  for (int i = 0; i < 16; ++i) uuid[i] = static_cast<unsigned char>(0xE0 + (i == 15 ? d : i));
  return kSuccess;
}
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }

CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice d) {
  if (bus == nullptr || len <= 0) return kInvalidValue;
  std::snprintf(bus, static_cast<size_t>(len), "00000000:%02X:00.0", 0xE0 + d);
  return kSuccess;
}

// The attributes of an H100 SXM (compute capability 9.0), with the configured SM count, or the
// configured architecture's SM limits (config.arch).
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice d) {
  if (value == nullptr) return kInvalidValue;
  if (d < 0 || d >= device_count()) return kInvalidDevice;
  switch (attribute) {
  case 1: *value = 1024; break;                                    // MAX_THREADS_PER_BLOCK
  case 2: case 3: *value = 1024; break;                            // MAX_BLOCK_DIM_X/Y
  case 4: *value = 64; break;                                      // MAX_BLOCK_DIM_Z
  case 5: *value = 2147483647; break;                              // MAX_GRID_DIM_X
  case 6: case 7: *value = 65535; break;                           // MAX_GRID_DIM_Y/Z
  case 8: *value = static_cast<int>(kSmemPerBlockDefault); break;  // MAX_SHARED_MEMORY_PER_BLOCK
  case 10: *value = 32; break;                                     // WARP_SIZE
  case 13: *value = static_cast<int>(kClockKhz); break;             // CLOCK_RATE (kHz)
  case 16: *value = device().config.sms; break;                    // MULTIPROCESSOR_COUNT
  case 31: *value = 1; break;                                      // CONCURRENT_KERNELS
  case 33: *value = 0xE0 + d; break;                               // PCI_BUS_ID
  case 39: *value = sm_limits().threads; break;                    // MAX_THREADS_PER_MULTIPROCESSOR
  case 41: *value = 1; break;                                      // UNIFIED_ADDRESSING
  case 75: *value = sm_limits().arch / 10; break;                  // COMPUTE_CAPABILITY_MAJOR
  case 76: *value = sm_limits().arch % 10; break;                  // COMPUTE_CAPABILITY_MINOR
  case 81: *value = static_cast<int>(sm_limits().smem); break;        // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
  case 95: *value = 1; break;                                          // COOPERATIVE_LAUNCH
  case 97: *value = static_cast<int>(sm_limits().smem_opt_in); break; // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
  case 106: *value = sm_limits().blocks; break;                        // MAX_BLOCKS_PER_MULTIPROCESSOR
  case 115: *value = 1; break;                                     // MEMORY_POOLS_SUPPORTED
  default: *value = 0; break;  // not modelled: reads as absent
  }
  return kSuccess;
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice d, CUdevice peer) {
  if (can == nullptr) return kInvalidValue;
  *can = d != peer && d < device_count() && peer < device_count() ? 1 : 0;
  return kSuccess;
}

// ---- Contexts: one primary context per process; the current one is per host thread.

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
  if (ctx == nullptr) return kInvalidValue;
  if (d < 0 || d >= device_count()) return kInvalidDevice;
  primary_contexts[d].device = d;
  *ctx = &primary_contexts[d];
  return kSuccess;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return kSuccess; }

CUresult cuCtxSetCurrent(void *ctx) {
  if (ctx == nullptr) {
    if (!context_stack.empty()) context_stack.pop_back();
    return kSuccess;
  }
  if (context_stack.empty()) {
    context_stack.push_back(static_cast<Context *>(ctx));
  } else {
    context_stack.back() = static_cast<Context *>(ctx);
  }
  return kSuccess;
}

CUresult cuCtxGetCurrent(void **ctx) {
  if (ctx == nullptr) return kInvalidValue;
  *ctx = context_stack.empty() ? nullptr : context_stack.back();
  return kSuccess;
}

CUresult cuCtxPushCurrent_v2(void *ctx) {
  if (ctx == nullptr) return kInvalidContext;
  context_stack.push_back(static_cast<Context *>(ctx));
  return kSuccess;
}

CUresult cuCtxPopCurrent_v2(void **ctx) {
  if (context_stack.empty()) return kInvalidContext;
  if (ctx != nullptr) *ctx = context_stack.back();
  context_stack.pop_back();
  return kSuccess;
}

CUresult cuCtxGetDevice(CUdevice *d) {
  if (d == nullptr) return kInvalidValue;
  if (context_stack.empty()) return kInvalidContext;
  *d = context_stack.back()->device;
  return kSuccess;
}

CUresult cuCtxSynchronize(void) {
  if (any_stream_capturing()) return kCaptureUnsupported;
  return synchronize_stream(nullptr);
}

CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = 0;
  return kSuccess;
}

CUresult cuCtxSetLimit(int, size_t) { return kSuccess; }
CUresult cuCtxGetLimit(size_t *value, int) {
  if (value) *value = 0;
  return kSuccess;
}
CUresult cuCtxSetFlags(unsigned) { return kSuccess; }

// Peer access: every device's memory is host memory, so a kernel can read any of it; these
// calls keep CUDA's bookkeeping (an access enabled twice, or disabled when it was not, is an
// error) so that the code that enables it runs as on a GPU.
CUresult cuCtxEnablePeerAccess(void *peer, unsigned flags) {
  if (peer == nullptr) return kInvalidContext;
  if (flags != 0) return kInvalidValue;
  if (context_stack.empty()) return kInvalidContext;
  const int from = context_stack.back()->device, to = static_cast<Context *>(peer)->device;
  if (from == to) return kInvalidDevice;
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  if (peer_enabled[from][to]) return kPeerAccessAlreadyEnabled;
  peer_enabled[from][to] = true;
  return kSuccess;
}

CUresult cuCtxDisablePeerAccess(void *peer) {
  if (peer == nullptr) return kInvalidContext;
  if (context_stack.empty()) return kInvalidContext;
  const int from = context_stack.back()->device, to = static_cast<Context *>(peer)->device;
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  if (!peer_enabled[from][to]) return kPeerAccessNotEnabled;
  peer_enabled[from][to] = false;
  return kSuccess;
}

// ---- Memory.

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
  if (dptr == nullptr) return kInvalidValue;
  if (any_stream_capturing()) return kCaptureUnsupported;
  void *p = tpfuse_emu_malloc(bytes);
  if (p == nullptr) return kOutOfMemory;
  *dptr = reinterpret_cast<uintptr_t>(p);
  return kSuccess;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, void *) {
  if (dptr == nullptr) return kInvalidValue;
  void *p = tpfuse_emu_malloc(bytes);
  if (p == nullptr) return kOutOfMemory;
  *dptr = reinterpret_cast<uintptr_t>(p);
  return kSuccess;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
  if (any_stream_capturing()) return kCaptureUnsupported;
  synchronize_stream(nullptr);  // cuMemFree waits for the work that may use it
  free_device_memory(host_ptr(dptr));
  return kSuccess;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, void *stream) {
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  // A free recorded in a graph would run at every replay: leave it to the process's end.
  if (capturing(s)) return kSuccess;
  enqueue_host_work(s, "cuMemFreeAsync", [dptr] { free_device_memory(host_ptr(dptr)); });
  return kSuccess;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
  if (free_bytes) *free_bytes = size_t{64} << 30;
  if (total) *total = size_t{80} << 30;
  return kSuccess;
}

CUresult cuMemHostAlloc(void **pp, size_t bytes, unsigned) {
  if (pp == nullptr) return kInvalidValue;
  *pp = tpfuse_emu_malloc(bytes);
  return *pp ? kSuccess : kOutOfMemory;
}
// Mapped pinned memory: host and device share one address space here, so the device
// address of a host allocation is the allocation itself.
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *dptr, void *p, unsigned flags) {
  if (dptr == nullptr || p == nullptr || flags != 0) return kInvalidValue;
  *dptr = reinterpret_cast<uintptr_t>(p);
  return kSuccess;
}
CUresult cuMemFreeHost(void *p) {
  free_device_memory(p);  // kernels write mapped host memory too: its versions go with it
  return kSuccess;
}

// Synchronous copies and memsets wait for all work first, as the legacy default stream does.
static CUresult sync_then(std::function<void()> work) {
  if (any_stream_capturing()) return kCaptureUnsupported;
  const CUresult r = synchronize_stream(nullptr);
  work();
  return r;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  return sync_then([=] { std::memcpy(host_ptr(dst), src, n); });
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  return sync_then([=] { std::memcpy(dst, host_ptr(src), n); });
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  return sync_then([=] { std::memmove(host_ptr(dst), host_ptr(src), n); });
}
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
  return sync_then([=] { std::memset(host_ptr(dst), value, n); });
}

static CUresult async_copy(void *stream, const char *name, void *dst, const void *src, size_t n) {
  enqueue_host_work(stream_of(static_cast<cudaStream_t>(stream)), name, [=] {
    std::memmove(dst, src, n);
    if (weak_memory) memory_host_write(dst, n);
  });
  return kSuccess;
}
// From pageable host memory CUDA copies the source before it returns (the caller may free or
// reuse it at once): so does the emulator, and the device copy happens in stream order.
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
  auto staged = std::make_shared<std::vector<unsigned char>>(static_cast<const unsigned char *>(src),
                                                             static_cast<const unsigned char *>(src) + n);
  void *d = host_ptr(dst);
  enqueue_host_work(stream_of(static_cast<cudaStream_t>(stream)), "cuMemcpyHtoDAsync",
                    [d, staged] {
                      std::memcpy(d, staged->data(), staged->size());
                      if (weak_memory) memory_host_write(d, staged->size());
                    });
  return kSuccess;
}
// To pageable host memory CUDA returns only once the copy is done (cudarc relies on it: its
// dtoh copies do not synchronize): the emulator waits for the stream and copies. While the
// stream captures, the copy is recorded like any other.
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  if (capturing(s)) return async_copy(stream, "cuMemcpyDtoHAsync", dst, host_ptr(src), n);
  const CUresult r = synchronize_stream(s);
  if (r == kSuccess) std::memcpy(dst, host_ptr(src), n);
  return r;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
  return async_copy(stream, "cuMemcpyDtoDAsync", host_ptr(dst), host_ptr(src), n);
}
CUresult cuMemcpyPeerAsync(CUdeviceptr dst, void *, CUdeviceptr src, void *, size_t n, void *stream) {
  return async_copy(stream, "cuMemcpyPeerAsync", host_ptr(dst), host_ptr(src), n);
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, void *stream) {
  enqueue_host_work(stream_of(static_cast<cudaStream_t>(stream)), "cuMemsetD8Async",
                    [=] {
                      std::memset(host_ptr(dst), value, n);
                      if (weak_memory) memory_host_write(host_ptr(dst), n);
                    });
  return kSuccess;
}

// CUDA_MEMCPY2D (cuda.h): every memory type is host memory here.
struct Memcpy2D {
  size_t srcXInBytes, srcY;
  int srcMemoryType;
  const void *srcHost;
  CUdeviceptr srcDevice;
  void *srcArray;
  size_t srcPitch;
  size_t dstXInBytes, dstY;
  int dstMemoryType;
  void *dstHost;
  CUdeviceptr dstDevice;
  void *dstArray;
  size_t dstPitch;
  size_t WidthInBytes, Height;
};

CUresult cuMemcpy2DAsync_v2(const Memcpy2D *c, void *stream) {
  if (c == nullptr) return kInvalidValue;
  constexpr int kHost = 1, kDevice = 2;
  auto base = [](int type, const void *host, CUdeviceptr dev) -> const unsigned char * {
    return static_cast<const unsigned char *>(type == kHost ? host : type == kDevice ? host_ptr(dev) : nullptr);
  };
  const unsigned char *src = base(c->srcMemoryType, c->srcHost, c->srcDevice);
  unsigned char *dst = const_cast<unsigned char *>(base(c->dstMemoryType, c->dstHost, c->dstDevice));
  if (src == nullptr || dst == nullptr) return kNotSupported;  // arrays are not emulated
  const Memcpy2D copy = *c;
  enqueue_host_work(stream_of(static_cast<cudaStream_t>(stream)), "cuMemcpy2DAsync", [=] {
    for (size_t row = 0; row < copy.Height; ++row) {
      unsigned char *to = dst + (copy.dstY + row) * copy.dstPitch + copy.dstXInBytes;
      std::memmove(to, src + (copy.srcY + row) * copy.srcPitch + copy.srcXInBytes, copy.WidthInBytes);
      if (weak_memory) memory_host_write(to, copy.WidthInBytes);
    }
  });
  return kSuccess;
}

// ---- Streams.

// A stream belongs to the device of the current context: its blocks take that device's SMs.
CUresult cuStreamCreate(void **stream, unsigned) {
  if (stream == nullptr) return kInvalidValue;
  *stream = tpfuse_emu_stream_create();
  const int d = context_stack.empty() ? 0 : context_stack.back()->device;
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  static_cast<Stream *>(*stream)->device = d;
  return kSuccess;
}
CUresult cuStreamCreateWithPriority(void **stream, unsigned flags, int) { return cuStreamCreate(stream, flags); }
CUresult cuStreamDestroy_v2(void *) { return kSuccess; }  // its work still completes

CUresult cuStreamSynchronize(void *stream) {
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  if (capturing(s)) return kCaptureUnsupported;
  return synchronize_stream(s);
}

// The device runs only while a host thread waits, so a query lets it run for one slice
// (run_query_slice: until the stream is idle, or 1 ms of virtual time): CUDA_SUCCESS when
// everything enqueued on the stream has completed, its sticky error when it has one, and
// otherwise CUDA_ERROR_NOT_READY, so a host that polls with a bound of its own (poll_stream)
// reaches that bound while a kernel still waits.
CUresult cuStreamQuery(void *stream) {
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  if (capturing(s)) return kCaptureUnsupported;
  Device &dev = device();
  uint64_t target;
  {
    std::lock_guard<std::mutex> lk(dev.mu);
    target = s->enqueued;
  }
  const bool done = run_query_slice([s, target] { return s->completed >= target; });
  std::lock_guard<std::mutex> lk(dev.mu);
  if (done) dev.host_known.join(s->known);  // the host saw its work done
  if (s->error != cudaSuccess) return s->error;
  return done ? kSuccess : kNotReady;
}

CUresult cuLaunchHostFunc(void *stream, void (*fn)(void *), void *data) {
  if (fn == nullptr) return kInvalidValue;
  enqueue_host_work(stream_of(static_cast<cudaStream_t>(stream)), "cuLaunchHostFunc", [fn, data] { fn(data); });
  return kSuccess;
}

// ---- Events.

CUresult cuEventCreate(void **event, unsigned) {
  if (event == nullptr) return kInvalidValue;
  *event = new Event();
  return kSuccess;
}
CUresult cuEventDestroy_v2(void *) { return kSuccess; }  // may still be recorded or waited on

CUresult cuEventRecord(void *event, void *stream) {
  if (event == nullptr) return kInvalidHandle;
  Event *e = static_cast<Event *>(event);
  uint64_t generation;
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  auto records = std::make_shared<Frontier>();
  {
    Device &dev = device();
    std::lock_guard<std::mutex> lk(dev.mu);
    generation = ++e->recorded;
    e->captured = s->capturing;
    e->last = records;
  }
  enqueue_host_work(
      s, "cuEventRecord",
      [e, generation] {
        e->time_ns.store(now_ns());
        uint64_t seen = e->completed.load();
        while (seen < generation && !e->completed.compare_exchange_weak(seen, generation)) {
        }
      },
      records);
  return kSuccess;
}
CUresult cuEventRecordWithFlags(void *event, void *stream, unsigned) { return cuEventRecord(event, stream); }

// The host synchronised with e's last record: what it orders is ordered before the host's
// later work (weak memory).
static void host_saw(const Event &e) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  dev.host_known.join(*e.last);
}

// An event whose last record was made in a capturing stream stands for captured work, not
// for work that will run: outside a capture CUDA refuses to wait for it, query it or
// synchronise on it (CUDA_ERROR_CAPTURED_EVENT). So does the emulator, with a log line,
// instead of waiting for a record that only a replay would make.
static bool refuse_captured(const Event &e, const char *call) {
  if (!e.captured) return false;
  std::fprintf(stderr, "tpfuse emulator: %s: the event was last recorded in a capturing stream "
               "(CUDA_ERROR_CAPTURED_EVENT)\n", call);
  return true;
}

CUresult cuStreamWaitEvent(void *stream, void *event, unsigned) {
  if (event == nullptr) return kInvalidHandle;
  Event *e = static_cast<Event *>(event);
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  uint64_t generation;
  std::shared_ptr<Frontier> joins;
  {
    Device &dev = device();
    std::lock_guard<std::mutex> lk(dev.mu);
    if (!s->capturing && refuse_captured(*e, "cuStreamWaitEvent")) return kCapturedEvent;
    generation = e->recorded;
    joins = e->last;
  }
  if (generation == 0) return kSuccess;  // nothing to wait for
  // Even a record that already happened orders what it recorded before the stream's next
  // work (weak memory: the op joins its frontier).
  auto op = std::make_unique<Launch>();
  op->stream = s;
  op->name = "cuStreamWaitEvent";
  op->joins = joins;
  op->ready = [e, generation] { return e->completed.load() >= generation; };
  enqueue_op(std::move(op));
  return kSuccess;
}

CUresult cuEventSynchronize(void *event) {
  if (event == nullptr) return kInvalidHandle;
  Event *e = static_cast<Event *>(event);
  // Runs the device until the last record has happened: every stream, as the record may sit
  // behind work on any of them.
  while (true) {
    uint64_t want;
    {
      Device &dev = device();
      std::lock_guard<std::mutex> lk(dev.mu);
      if (refuse_captured(*e, "cuEventSynchronize / cuEventQuery")) return kCapturedEvent;
      want = e->recorded;
    }
    if (e->completed.load() >= want) {
      host_saw(*e);
      return kSuccess;
    }
    // Runs the device only: the host synchronises with the event's record, not every stream.
    const CUresult r = synchronize_stream(nullptr, false);
    if (r != kSuccess) return r;
  }
}
// One slice of device time (as cuStreamQuery): CUDA_SUCCESS once the last record happened,
// CUDA_ERROR_NOT_READY before.
CUresult cuEventQuery(void *event) {
  if (event == nullptr) return kInvalidHandle;
  Event *e = static_cast<Event *>(event);
  uint64_t want;
  {
    Device &dev = device();
    std::lock_guard<std::mutex> lk(dev.mu);
    if (refuse_captured(*e, "cuEventQuery")) return kCapturedEvent;
    want = e->recorded;
  }
  if (!run_query_slice([e, want] { return e->completed.load() >= want; })) return kNotReady;
  host_saw(*e);
  return kSuccess;
}

CUresult cuEventElapsedTime(float *ms, void *start, void *end) {
  if (ms == nullptr || start == nullptr || end == nullptr) return kInvalidValue;
  const uint64_t a = static_cast<Event *>(start)->time_ns.load();
  const uint64_t b = static_cast<Event *>(end)->time_ns.load();
  *ms = static_cast<float>(static_cast<double>(b - a) / 1e6);  // virtual time
  return kSuccess;
}
CUresult cuEventElapsedTime_v2(float *ms, void *start, void *end) { return cuEventElapsedTime(ms, start, end); }

// ---- Graphs: a capture records what the stream enqueues (launches with their arguments as
// they were at capture, copies, memsets, event records); a replay enqueues it again in order.

CUresult cuStreamBeginCapture_v2(void *stream, int) {
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  if (s->capturing || s == dev.default_stream) return kCaptureUnsupported;
  s->capturing = true;
  s->captured.clear();
  return kSuccess;
}

CUresult cuStreamEndCapture(void *stream, void **graph) {
  if (graph == nullptr) return kInvalidValue;
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  if (!s->capturing) return kCaptureInvalidated;
  auto *g = new Graph();
  g->ops = std::move(s->captured);
  s->captured.clear();
  s->capturing = false;
  *graph = g;
  return kSuccess;
}

CUresult cuStreamIsCapturing(void *stream, int *status) {
  if (status == nullptr) return kInvalidValue;
  *status = capturing(stream_of(static_cast<cudaStream_t>(stream))) ? 1 : 0;
  return kSuccess;
}

CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long) {
  if (exec == nullptr || graph == nullptr) return kInvalidValue;
  auto *copy = new Graph();
  for (auto &op : static_cast<Graph *>(graph)->ops) copy->ops.push_back(clone_op(*op));
  *exec = copy;
  return kSuccess;
}

CUresult cuGraphLaunch(void *exec, void *stream) {
  if (exec == nullptr) return kInvalidValue;
  Stream *s = stream_of(static_cast<cudaStream_t>(stream));
  // Weak memory: each replay's event records are its own, and its waits on them join the
  // replay's records (a wait on a record outside the graph keeps the record it captured).
  std::map<const Frontier *, std::shared_ptr<Frontier>> fresh;
  for (auto &op : static_cast<Graph *>(exec)->ops) {
    auto replay = clone_op(*op);
    replay->stream = s;
    if (op->records) replay->records = fresh[op->records.get()] = std::make_shared<Frontier>();
    if (op->joins) {
      auto own = fresh.find(op->joins.get());
      if (own != fresh.end()) replay->joins = own->second;
    }
    enqueue_op(std::move(replay));
  }
  return kSuccess;
}

CUresult cuGraphUpload(void *, void *) { return kSuccess; }
CUresult cuGraphDestroy(void *graph) {
  delete static_cast<Graph *>(graph);
  return kSuccess;
}
CUresult cuGraphExecDestroy(void *exec) {
  delete static_cast<Graph *>(exec);
  return kSuccess;
}

} // extern "C"
