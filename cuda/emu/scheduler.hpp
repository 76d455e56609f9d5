// scheduler.hpp: the emulated device's state (streams, launches, resident blocks, fibers)
// shared by scheduler.cpp (the device thread), device_ops.cpp and warp.cpp (what a fiber
// calls) and runtime.cpp (the host API).
//
// Threads of the host enqueue work on streams under `mu`. One device thread runs it: each
// pass resumes every runnable fiber of every resident block once, in the configured order;
// a fiber runs until its next scheduling point. Only the device thread touches launches,
// blocks and fibers once they have left a stream's queue, so they need no lock.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "device.hpp"
#include "memory_model.hpp"
#include "tpfuse_emu.h"

namespace tpfuse_emu {

struct Block;
struct Launch;
struct Stream;

enum class FiberState { Ready, AtBarrier, AtCollective, Exited };

struct Copy {  // one cp.async
  uint32_t dst;
  const void *src;
  int bytes;
  bool read = false;           // weak memory: the source was read at the issue, into data
  unsigned char data[16] = {};
};

struct Fiber {
  void *context = nullptr;  // boost fcontext of the suspended fiber
  void *stack = nullptr;
  size_t stack_bytes = 0;
  Block *block = nullptr;
  uint3 tid{0, 0, 0};
  FiberState state = FiberState::Ready;
  // The most recent addresses polled, newest first, and what each returned (note_poll).
  static constexpr int kPolled = 8;
  const void *polled[kPolled] = {};
  uint64_t polled_value[kPolled] = {};
  std::vector<Copy> open_group;
  std::vector<std::vector<Copy>> committed;  // oldest first (few: a vector allocates nothing empty)
  void *asan_fake_stack = nullptr;
  std::unique_ptr<ThreadMemory> memory;  // weak memory only (weak_memory.cpp)
  int load_passes = 0;  // random schedule: passes this thread still sits out at a load (preempt_at_load)
};

// The exchange area of one warp's collective: each lane's operands, then each lane's result.
struct Warp {
  int arrived = 0;
  int exited = 0;
  int lanes = 32;
  int kind = -1;
  alignas(16) unsigned char in[32][48];
  alignas(16) unsigned char out[32][16];
};

// Memory tagged with a rank (tpfuse_emu_tag_memory).
struct Tag {
  uintptr_t begin, end;
  int rank;
};
using Tags = std::vector<Tag>;

// What a finished launch leaves while counting (counters.cpp).
struct LaunchRecord {
  std::string name;
  std::vector<tpfuse_emu_block_counters> blocks;
};

struct Block {
  Launch *launch = nullptr;
  tpfuse_emu_block_counters counters{};
  uint3 idx{0, 0, 0};
  int sm = 0;
  int first_subpartition = 0;  // where its warp 0 holds registers (residency.cpp)
  uint64_t order = 0;  // residency order
  std::vector<std::unique_ptr<Fiber>> fibers;
  std::vector<Fiber *> runnable;  // rebuilt when `dirty`
  bool dirty = true;
  int live = 0;
  int at_barrier = 0;
  std::vector<Warp> warps;
  // Shared memory: the dynamic part (dynamic_bytes of it, then kSharedRedZone poisoned bytes)
  // and each static one (its tag, its storage, where it starts and its size, the same red zone
  // after it). A red zone written is a write past the memory (shared_overrun).
  std::vector<unsigned char> dynamic_smem;
  size_t dynamic_bytes = 0;
  struct Static {
    const void *tag;
    std::unique_ptr<unsigned char[]> storage;
    unsigned char *start;
    size_t bytes;
  };
  std::vector<Static> statics;
  size_t static_bytes = 0;  // the statics' sizes: with the dynamic size, within the limit
  bool gone = false;  // finished or failed; its SM resources are free
  // The pct schedule (schedules.cpp): blocks run by (demoted ascending, priority descending).
  uint64_t priority = 0;
  uint64_t demoted = 0;
  std::unique_ptr<BlockMemory> memory;  // weak memory only (weak_memory.cpp)
};

// What one block of a launch holds of its SM while resident (residency.cpp).
struct Footprint {
  int warps = 0;
  int warp_registers = 0;  // per warp, allocated
  size_t smem = 0;         // dynamic + static + the runtime's reservation
};

// One operation of a stream: a kernel launch (`body` set), or host work the device thread does
// when the operation reaches the head of its stream (copies, memsets, event records,
// frees), or a wait that starts only once `ready` holds (an event of another stream).
struct Launch {
  Stream *stream = nullptr;
  const void *func = nullptr;
  std::string name;
  dim3 grid, block;
  size_t smem = 0;
  Footprint footprint;       // per block
  bool cooperative = false;  // every block resident at once, or none yet
  std::function<void()> body;
  std::function<void()> host_work;
  std::function<bool()> ready;
  uint64_t seq = 0;
  // Counting (set when the launch starts): the stream's rank, the tags then, per-block records.
  bool counting = false;
  int rank = -1;
  std::shared_ptr<const Tags> tags;
  std::vector<tpfuse_emu_block_counters> block_counters;
  unsigned next_block = 0;
  unsigned done_blocks = 0;
  unsigned resident = 0;
  uint64_t ordinal = 0;  // the kernel launches its stream started before it (schedules.cpp)
  bool failed = false;
  std::string error;
  cudaError_t code = cudaSuccess;
  uint64_t memory_id = 0;  // weak memory: its id once it started (weak_memory.cpp)
  // Weak memory, what is ordered before the operation: `after`, what the host had synchronised
  // with when it enqueued it; `joins`, an event's record it waits for; `records`, the event
  // record it makes (filled when it runs) (these three under mu); `start`, a kernel's frontier
  // when it started; `end`, what its threads had seen when they ended (the device thread's).
  Frontier after;
  std::shared_ptr<Frontier> joins, records;
  Frontier start, end;
};

struct Stream {
  std::deque<std::unique_ptr<Launch>> queue;  // under mu
  bool capturing = false;                     // under mu: operations go to `captured`
  std::vector<std::unique_ptr<Launch>> captured;
  std::unique_ptr<Launch> running;            // device thread
  uint64_t enqueued = 0, completed = 0;       // under mu
  cudaError_t error = cudaSuccess;            // sticky, under mu
  std::string message;
  uint64_t not_before = 0;
  bool stop = false;
  bool frozen = false;
  uint64_t frozen_at = 0;
  uint32_t clock_divisor = 1;  // %clock64 runs this many times slower than the peak (fault)
  int rank = -1;  // tpfuse_emu_tag_stream, under mu
  uint64_t kernels_started = 0;  // device thread
  int device = 0;  // the emulated device whose SMs run its blocks (set at creation)
  uint32_t slot = 0;  // its index in Device::streams (a Frontier's key)
  Frontier known;     // weak memory: what is ordered before its next operation (under mu)
};

struct KernelStats {
  std::string name;
  uint64_t launches = 0, blocks = 0;
};

struct Device {
  std::mutex mu;
  std::condition_variable wake_device, work_done;
  int waiters = 0;
  // Queries (run_query_slice): of the waiters, those that let the device run only until the
  // virtual clock reaches a bound; run_until_ns is the latest bound of those waiting.
  int bounded_waiters = 0;
  uint64_t run_until_ns = 0;
  bool parked = false;  // the device thread waits for work (under mu)
  tpfuse_emu_config config{};
  std::vector<std::unique_ptr<Stream>> streams;  // owned; destroyed streams stay (cheap)
  Stream *default_stream = nullptr;
  uint64_t launch_seq = 0;
  std::map<const void *, int> max_dynamic_smem;  // cudaFuncAttributeMaxDynamicSharedMemorySize
  std::map<const void *, KernelStats> stats;     // under mu
  std::string last_failure;                      // under mu
  bool counting = false;                         // under mu, like the two below
  std::shared_ptr<const Tags> tags = std::make_shared<Tags>();  // replaced, never changed
  // Weak memory: the launches the host has synchronised with (stream, event or device
  // synchronisation; a query that found them done), under mu.
  Frontier host_known;
  // Weak memory: device memory freed since the last kernel started ([begin, end)), under mu:
  // its words' versions go before a kernel may read a new allocation there.
  std::vector<std::pair<uintptr_t, uintptr_t>> freed;
  std::vector<LaunchRecord> records;

  // Device thread only.
  std::vector<Stream *> active;  // streams with a running launch, refreshed every pass
  std::vector<std::unique_ptr<Block>> resident;
  std::vector<int> sm_threads, sm_blocks;
  std::vector<std::array<int, 4>> sm_registers;  // per SM sub-partition (residency.cpp)
  std::vector<size_t> sm_smem;
  uint64_t residency_seq = 0;
  uint64_t demotions = 0;  // the pct schedule's change points so far
  uint64_t pct_steps = 0;  // and its steps
  std::mt19937_64 rng;
  int at_long_loads = 0;  // threads with Fiber::load_passes > 0 (the random schedule's long loads)
  uint64_t clock_ns = 0;  // virtual time (atomic reads from the host: now_ns)
  uint64_t idle_ns = 0, idle_jump_ns = 0;
  bool progress = false;
  void *scheduler_context = nullptr;
  std::vector<void *> free_stacks;
};

Device &device();
// Emulated devices (TPFUSE_EMU_DEVICES, 1..16, default 1); each has config.sms SMs of its own,
// SM indices [d * sms, (d + 1) * sms) of the scheduler's tables. The null stream runs on
// device 0.
constexpr int kMaxDevices = 16;
int emulated_devices();
// The configuration the environment asks for (TPFUSE_EMU_*), read when the device starts.
tpfuse_emu_config config_from_env();
// The fiber the device thread is running; null between fibers. Read on every global access
// (counters, thread indices): a plain global, not a member of device() behind its guard.
extern Fiber *running_fiber;
[[noreturn]] void called_outside_a_kernel();
inline Fiber &current_fiber() {
  Fiber *f = running_fiber;
  if (__builtin_expect(f == nullptr, 0)) called_outside_a_kernel();
  return *f;
}
// ---- Weak memory (weak_memory.cpp; `weak_memory` and the device-code side are in device.hpp).
// Sets the mode (TPFUSE_EMU_MEMORY_*) and drops every version: only while nothing runs.
void configure_memory(int32_t mode, uint64_t seed);
// Whether p, accessed by the running thread, is global memory (not its block's shared memory).
bool is_global(const void *p);
void memory_block_start(Block &b);   // a block became resident
void memory_barrier(Block &b);       // its bar.sync completed
// Under mu, from the device thread: stream s starts operation l (a kernel when l.body is set):
// what is ordered before it.
void memory_operation_starts(Stream &s, Launch &l);
void memory_block_done(Block &b);    // a block ended: what its threads saw, for its launch's end
void memory_launch_done(Stream &s, Launch &l);  // under mu: l completed (s's next work sees it)
// Host work on the device thread wrote [p, p + bytes) (a copy or memset in stream order), or
// the memory was freed: the words' versions go, memory holds what everyone reads.
void memory_host_write(const void *p, size_t bytes);
// The bookkeeping of the strong operations (device_ops.cpp performs their scheduling).
void memory_strong_read(const void *p, size_t bytes, Order o, Scope s);
void memory_strong_write(void *p, const void *v, size_t bytes, Order o, Scope s);
uint32_t memory_rmw(uint32_t *p, Order o, Scope s, const std::function<uint32_t(uint32_t)> &op);
void memory_fence(Order o, Scope s);

// Leaves the fiber for the scheduler; returns when the scheduler resumes it.
void yield_to_scheduler();
// Ends the current launch with an error (reported at the stream's synchronize); the fiber is
// never resumed.
[[noreturn]] void fail_launch(cudaError_t code, const std::string &why);
// Enqueues an operation on `launch->stream` (or records it, while the stream captures);
// takes mu.
void enqueue_op(std::unique_ptr<Launch> launch);
// CUDA's lazy loading (loading.cpp): the first use of `func` on device `dev_index` (a launch,
// cudaFuncSetAttribute, cuFuncLoad) waits for everything enqueued on that device's streams.
void load_function(const void *func, int dev_index);
// The device of the context current on this thread (0 when none, as the runtime's calls
// assume).
int current_device();
// A copy of an operation, for a CUDA graph's replay.
std::unique_ptr<Launch> clone_op(const Launch &op);
// With mu held through `lk`: runs the device until each stream has completed the count of
// operations paired with it.
void run_until_completed(std::unique_lock<std::mutex> &lk, const std::vector<std::pair<Stream *, uint64_t>> &targets);
// Runs the device until everything enqueued on `stream` so far has completed (every stream
// when null); the stream's sticky error.
// `learn`: the host synchronised with what it waited for (weak memory: host_known grows); not
// where it only runs the device until something else happened (an event's record).
cudaError_t synchronize_stream(Stream *stream, bool learn = true);
// Whether any stream is capturing a CUDA graph (synchronising is then refused).
bool any_stream_capturing();
// A query's slice of device time (cuStreamQuery, cuEventQuery): the device runs only while a
// host thread waits, so a query lets it run until `done` (evaluated under mu) holds, or until
// the virtual clock has advanced by TPFUSE_EMU_QUERY_SLICE_NS (default 1 ms) since the query
// began and the device has stopped at the end of its pass (the same pass on every run: the
// device, not the host's timing, decides where it stops). Returns whether `done` held. A
// device that cannot advance its clock (every stream waits for an event no stream records)
// keeps the query waiting, as it keeps a synchronize.
bool run_query_slice(const std::function<bool()> &done);
// Whether a waiting host thread wants the device to run now (mu held): a synchronize, or a
// query whose slice has not run out.
bool device_wanted(const Device &dev);
// The stream a cudaStream_t / CUstream names (null: the default stream).
Stream *stream_of(cudaStream_t s);
// The device thread's steps that the schedules (schedules.cpp) use: resumes one fiber until
// its next scheduling point; after a turn that may have finished a block, frees it and starts
// what may start now, returning the new blocks; drops the blocks marked gone.
void resume(Device &dev, Fiber *f);
std::vector<Block *> start_freed_slots(Device &dev);
void sweep(Device &dev);
// Schedules (schedules.cpp): a block that just became resident gets its place in the
// schedule; one pass over the resident blocks in the configured schedule returns the number
// of resumes and leaves dev.progress set when any thread made progress.
void place_in_schedule(Device &dev, Block &block);
int run_pass(Device &dev, std::vector<Fiber *> &scratch);
// A kernel's global load is about to read (count_load): under the random schedule, now and
// then a scheduling point (schedules.cpp).
void preempt_at_load();
// The bytes after each of a block's shared memories that it must not write.
constexpr size_t kSharedRedZone = 256;
// "" when block b wrote no shared memory past its end, else what it wrote past (device_ops.cpp).
std::string shared_overrun(const Block &b);
// Re-checks a block's barrier after a thread arrived at it or exited.
void release_barrier_if_complete(Block &block);
// Counters (counters.cpp). A launch leaving its stream's queue (mu held); a block that
// finished or failed; a launch that completed (mu held).
void counters_launch_starts(Device &dev, Stream &s, Launch &l);
void counters_block_done(Block &b);
void counters_launch_done(Device &dev, Launch &l);
// Copies `text` into buf (NUL-terminated, truncated to cap); returns its full length.
size_t copy_out(const std::string &text, char *buf, size_t cap);
// Frees device memory (and drops its rank tags).
void free_device_memory(void *ptr);
// Virtual time, readable from any thread.
uint64_t now_ns();
// A description of a block for error messages: "kernel K, block B (stream S)".
std::string describe(const Block &block);
// Residency (residency.cpp): a block of kernel `kernel_name` (the launch site's spelling; its
// registers and static shared memory from kernel_resources.inc) with `threads` threads and
// `dynamic_smem` bytes; where on SM `sm` it would go (the sub-partition of its warp 0), or -1
// when the SM has no room for it; takes (sign 1) or gives back (-1) what it holds there; how
// many such blocks an empty SM holds (0: none, the launch cannot run).
Footprint footprint_of(const char *kernel_name, unsigned threads, size_t dynamic_smem);
int place(const Device &dev, int sm, const Footprint &f);
void hold(Device &dev, int sm, const Footprint &f, int first, int sign);
int blocks_per_sm(const Footprint &f);
// The SMs' limits for the configured architecture (config.arch; residency.cpp).
struct SmLimits {
  int arch;          // compute capability, major * 10 + minor
  int threads;       // per SM
  int blocks;        // per SM
  size_t smem;       // shared memory per SM
  size_t smem_opt_in;  // the most one block may opt in to
};
const SmLimits &sm_limits();
bool known_arch(int arch);
constexpr size_t kSmemPerBlockDefault = 48 * 1024;

} // namespace tpfuse_emu
