// scheduler.cpp: the device thread of the CPU emulator.
//
// Host threads enqueue launches on streams and wait in a synchronize. While at least one
// waits, the device thread loops:
//   1. starts the head launch of every idle stream (a launch runs only after the previous
//      one on its stream has completed, as on a GPU);
//   2. makes blocks resident, in launch order, on the first SM with room for their threads,
//      shared memory and block slot; the rest wait for a block to finish (co-residency is
//      real: a block that waits for a non-resident one waits until its deadline, or is a
//      reported deadlock);
//   3. runs one pass: every runnable fiber (thread) of every resident block is resumed once,
//      in the configured order, and runs to its next scheduling point;
//   4. retires finished blocks and launches, and wakes the host threads waiting for them;
//   5. when a pass made no progress (every runnable thread only polled flags that did not
//      change), advances virtual time by a jump that grows slowly (x1.0001 a pass), so that
//      deadlines expire, overshooting a deadline checked every 1024 polls by ~10%; past the
//      configured horizon it reports a deadlock that names the waiting and the non-resident
//      blocks. A pass that could resume nobody while blocks are resident is a deadlock at once
//      (barrier or warp collective that can never complete).
// Virtual time also advances by 1 ns for every resume, so it moves with executed work.
#include "scheduler.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <atomic>
#include <cstdio>
#include <sstream>
#include <thread>

#include <boost/context/detail/fcontext.hpp>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define TPFUSE_EMU_ASAN 1
#endif

namespace ctx = boost::context::detail;

namespace tpfuse_emu {
namespace {

#ifdef TPFUSE_EMU_ASAN
constexpr size_t kStackBytes = 512 * 1024;
const void *scheduler_stack_bottom = nullptr;
size_t scheduler_stack_size = 0;
#else
constexpr size_t kStackBytes = 128 * 1024;
#endif

// Stack colouring: thread t's stack top sits (t * 17 mod kColours) * kColourStep bytes above
// kStackBytes into its mapping, so the tops of a block's fibers (where each keeps its saved
// registers and innermost frames, touched at every switch) fall into different sets of the
// host's caches. Uncoloured, every top lay at the same offset of a 128 KiB-aligned mapping:
// one L1 set and one L2 set for all of them, and most switches missed both.
constexpr size_t kColours = 1024;
constexpr size_t kColourStep = 64; // a cache line
constexpr size_t kMapBytes = kStackBytes + kColours * kColourStep;

size_t stack_colour(int thread) { return static_cast<size_t>(thread) * 17 % kColours * kColourStep; }

std::atomic<uint64_t> clock_now{0};

void *take_stack(Device &dev) {
  if (!dev.free_stacks.empty()) {
    void *s = dev.free_stacks.back();
    dev.free_stacks.pop_back();
    return s;  // unpoisoned by release_block under AddressSanitizer
  }
  void *s = mmap(nullptr, kMapBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (s == MAP_FAILED) {
    std::fprintf(stderr, "tpfuse emulator: out of memory for fiber stacks\n");
    std::abort();
  }
  return s;
}

[[noreturn]] void switch_out_forever();

void fiber_entry(ctx::transfer_t t) {
  Device &dev = device();
  Fiber *f = static_cast<Fiber *>(t.data);
  dev.scheduler_context = t.fctx;
#ifdef TPFUSE_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &scheduler_stack_bottom, &scheduler_stack_size);
#endif
  f->block->launch->body();
  // The thread exits: it no longer counts for its block's barrier, nor for its warp.
  Block &b = *f->block;
  f->state = FiberState::Exited;
  --b.live;
  b.dirty = true;
  dev.progress = true;
  Warp &w = b.warps[f->tid.x / 32];
  ++w.exited;
  if (w.arrived > 0 && w.arrived + w.exited == w.lanes) {
    fail_launch(cudaErrorLaunchFailure,
                "a warp collective was reached by " + std::to_string(w.arrived) + " of " +
                    std::to_string(w.lanes) + " lanes; the others exited");
  }
  if (b.at_barrier > 0) {  // see syncthreads(): a barrier must be reached by all or none
    fail_launch(cudaErrorLaunchFailure, "a thread exited while " + std::to_string(b.at_barrier) +
                                            " threads of its block wait at __syncthreads");
  }
  switch_out_forever();
}

[[noreturn]] void switch_out_forever() {
  Device &dev = device();
#ifdef TPFUSE_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, scheduler_stack_bottom, scheduler_stack_size);
#endif
  ctx::jump_fcontext(dev.scheduler_context, nullptr);
  std::abort();  // the scheduler never resumes an exited or failed fiber
}

void set_clock(Device &dev, uint64_t ns) {
  dev.clock_ns = ns;
  clock_now.store(ns, std::memory_order_relaxed);
}

} // namespace

void resume(Device &dev, Fiber *f) {
  running_fiber = f;
#ifdef TPFUSE_EMU_ASAN
  void *fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f->stack, f->stack_bytes);
#endif
  ctx::transfer_t t = ctx::jump_fcontext(f->context, f);
#ifdef TPFUSE_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  f->context = t.fctx;
  running_fiber = nullptr;
  set_clock(dev, dev.clock_ns + 1);
}

namespace {

unsigned total_blocks(const Launch &l) { return l.grid.x * l.grid.y * l.grid.z; }

// TPFUSE_EMU_TRACE=1: one line on stderr per block that becomes resident or finishes.
bool tracing() {
  static const bool on = [] {
    const char *v = std::getenv("TPFUSE_EMU_TRACE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  return on;
}

void trace(const Device &dev, const Block &b, const char *what) {
  if (tracing())
    std::fprintf(stderr, "tpfuse emulator trace: t=%llu ns %s %s\n", static_cast<unsigned long long>(dev.clock_ns),
                 what, describe(b).c_str());
}

void make_resident(Device &dev, Launch &l, int sm, int first_subpartition) {
  auto b = std::make_unique<Block>();
  b->launch = &l;
  b->idx = uint3{l.next_block++, 0, 0};
  b->sm = sm;
  b->first_subpartition = first_subpartition;
  b->order = dev.residency_seq++;
  const int threads = static_cast<int>(l.block.x);
  b->live = threads;
  b->dynamic_bytes = l.smem > 0 ? l.smem : 16;
  b->dynamic_smem.assign(b->dynamic_bytes + kSharedRedZone, 0xFF);  // poison: NaN in f32, f16 and bf16
  b->warps.resize((threads + 31) / 32);
  for (size_t w = 0; w < b->warps.size(); ++w) b->warps[w].lanes = std::min(32, threads - 32 * static_cast<int>(w));
  b->fibers.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    auto f = std::make_unique<Fiber>();
    f->block = b.get();
    f->tid = uint3{static_cast<unsigned>(t), 0, 0};
    f->stack = take_stack(dev);
    f->stack_bytes = kStackBytes + stack_colour(t);
    f->context = ctx::make_fcontext(static_cast<char *>(f->stack) + f->stack_bytes, f->stack_bytes, fiber_entry);
    b->fibers.push_back(std::move(f));
  }
  if (weak_memory) memory_block_start(*b);
  hold(dev, sm, l.footprint, first_subpartition, 1);
  ++l.resident;
  place_in_schedule(dev, *b);
  trace(dev, *b, "resident");
  dev.resident.push_back(std::move(b));
}

// The first SM of launch `l`'s device with room for one of its blocks, and where on it the
// block goes; {-1, -1} when none has room.
std::pair<int, int> room_for(const Device &dev, const Launch &l) {
  const int first = l.stream->device * dev.config.sms, end = first + dev.config.sms;
  for (int sm = first; sm < end; ++sm) {
    const int sub = place(dev, sm, l.footprint);
    if (sub >= 0) return {sm, sub};
  }
  return {-1, -1};
}

// Whether every block of cooperative launch `l` fits on its device's SMs now (placed as admit
// would place them, then taken back).
bool all_blocks_fit(Device &dev, const Launch &l) {
  std::vector<std::pair<int, int>> placed;
  for (unsigned b = 0; b < total_blocks(l); ++b) {
    const std::pair<int, int> at = room_for(dev, l);
    if (at.first < 0) break;
    hold(dev, at.first, l.footprint, at.second, 1);
    placed.push_back(at);
  }
  for (const auto &at : placed) hold(dev, at.first, l.footprint, at.second, -1);
  return placed.size() == total_blocks(l);
}

// Makes waiting blocks resident, in launch order, on the first SM of their device with room.
// A cooperative launch's blocks become resident all at once, when they all fit (the CUDA
// guarantee: every block of the grid is resident together); until then it waits, and later
// launches may take the room (a modelling choice: NVIDIA does not say whether a waiting
// cooperative grid holds back the grids launched after it).
void admit(Device &dev) {
  std::vector<Launch *> launches;
  for (Stream *s : dev.active)
    if (s->running && !s->running->failed) launches.push_back(s->running.get());
  std::sort(launches.begin(), launches.end(), [](Launch *a, Launch *b) { return a->seq < b->seq; });
  for (Launch *l : launches) {
    if (l->cooperative && l->next_block == 0 && !all_blocks_fit(dev, *l)) continue;
    while (l->next_block < total_blocks(*l)) {
      const std::pair<int, int> at = room_for(dev, *l);  // the SMs of the launch's device only
      if (at.first < 0) break;
      make_resident(dev, *l, at.first, at.second);
    }
  }
}

// Frees a finished (or failed) block's SM resources, stacks and per-thread state at once.
// The Block itself stays until sweep() (a pass may hold a pointer to it and checks `gone`):
// in the forward schedule one pass can run a whole large grid, block after block, and
// keeping every finished block's fibers until the pass ends costs ~200 KB a block.
void release_block(Device &dev, Block &b) {
#ifdef TPFUSE_EMU_ASAN
  // The redzones of a fiber's frames that never returned stay poisoned: clear them before
  // another fiber takes the stack. (A fiber that exits calls [[noreturn]] functions, before
  // which ASan's __asan_handle_no_return already clears its stack; this is for the fibers a
  // failed or deadlocked launch left suspended.) They lie between its last saved stack
  // pointer (its context) and its top: the frames below returned, and every instrumented
  // function clears its frame's shadow on return. (Unpoisoning the whole mapping instead,
  // 72 KiB of shadow per fiber, was 44% of the all-reduce tests' time.)
  for (auto &f : b.fibers) {
    char *const bottom = static_cast<char *>(f->stack), *const top = bottom + f->stack_bytes;
    char *low = static_cast<char *>(f->context);
    if (low < bottom || low > top) low = bottom;
    ASAN_UNPOISON_MEMORY_REGION(low, static_cast<size_t>(top - low));
  }
#endif
  for (auto &f : b.fibers) dev.free_stacks.push_back(f->stack);
  std::vector<std::unique_ptr<Fiber>>().swap(b.fibers);
  std::vector<Fiber *>().swap(b.runnable);
  std::vector<Warp>().swap(b.warps);
  std::vector<unsigned char>().swap(b.dynamic_smem);
  b.statics.clear();
  hold(dev, b.sm, b.launch->footprint, b.first_subpartition, -1);
  --b.launch->resident;
}

void complete(Device &dev, Stream &s) {
  std::lock_guard<std::mutex> lk(dev.mu);
  std::unique_ptr<Launch> l = std::move(s.running);
  if (weak_memory) memory_launch_done(s, *l);  // a kernel boundary
  if (l->failed) dev.last_failure = l->error;
  counters_launch_done(dev, *l);
  if (l->failed && s.error == cudaSuccess) {
    s.error = l->code;
    s.message = l->error;
  }
  ++s.completed;
  dev.work_done.notify_all();
}

// Frees the SM resources of finished blocks and of every block of a failed launch, and
// completes the launches that are done (their streams move on). Blocks stay in `resident`,
// marked gone, until sweep(): a pass may still hold them.
void retire(Device &dev) {
  for (auto &b : dev.resident) {
    if (b->gone) continue;
    if (b->launch->failed) {
      for (auto &f : b->fibers) {  // threads at a long load never resume (schedules.cpp)
        if (f->load_passes > 0) --dev.at_long_loads;
        f->load_passes = 0;
      }
      b->gone = true;
      counters_block_done(*b);
      if (weak_memory) memory_block_done(*b);
      release_block(dev, *b);
    } else if (b->live == 0) {
      trace(dev, *b, "finished");
      const std::string overrun = shared_overrun(*b);
      if (!overrun.empty() && !b->launch->failed) {
        // A GPU may fault at the access, or corrupt its neighbour's shared memory: a failure.
        Launch &l = *b->launch;
        l.failed = true;
        l.code = cudaErrorIllegalAddress;
        l.error = overrun + " (" + describe(*b) + ")";
        std::fprintf(stderr, "tpfuse emulator: launch failed: %s\n", l.error.c_str());
      }
      b->gone = true;
      counters_block_done(*b);
      if (weak_memory) memory_block_done(*b);
      release_block(dev, *b);
      ++b->launch->done_blocks;
    }
  }
  for (Stream *s : dev.active) {
    Launch *l = s->running.get();
    if (l == nullptr) continue;
    if ((l->failed && l->resident == 0) || l->done_blocks == total_blocks(*l)) complete(dev, *s);
  }
}

} // namespace

void sweep(Device &dev) {
  dev.resident.erase(std::remove_if(dev.resident.begin(), dev.resident.end(),
                                    [](const std::unique_ptr<Block> &b) { return b->gone; }),
                     dev.resident.end());
}

namespace {

void start_heads(Device &dev, std::unique_lock<std::mutex> &lk);

// Starts the next operation of every stream that has none running and lists the streams
// with a running launch.
void refresh_active(Device &dev) {
  std::unique_lock<std::mutex> lk(dev.mu);
  start_heads(dev, lk);
  dev.active.clear();
  for (auto &s : dev.streams)
    if (s->running) dev.active.push_back(s.get());
}

} // namespace

// After a turn that may have finished a block: frees it and starts what may start now
// (the next blocks of its launch, or its stream's next launch); returns the new blocks.
std::vector<Block *> start_freed_slots(Device &dev) {
  retire(dev);
  refresh_active(dev);
  const size_t before = dev.resident.size();
  admit(dev);
  std::vector<Block *> started;
  for (size_t j = before; j < dev.resident.size(); ++j) started.push_back(dev.resident[j].get());
  return started;
}

namespace {

// Starts the head operation of every stream that has none running; called and returns with
// `lk` (on mu) held, which it releases while host work runs.
void start_heads(Device &dev, std::unique_lock<std::mutex> &lk) {
  for (size_t i = 0; i < dev.streams.size(); ++i) {
    Stream *s = dev.streams[i].get();
    while (!s->running && !s->queue.empty() && dev.clock_ns >= s->not_before) {
      Launch &head = *s->queue.front();
      if (head.ready && !head.ready()) break;  // waits for an event of another stream
      std::unique_ptr<Launch> l = std::move(s->queue.front());
      s->queue.pop_front();
      if (!l->body || s->stop) {  // host work or a wait; or a rank that never arrives
        if (weak_memory && !s->stop) memory_operation_starts(*s, *l);
        if (l->host_work && !s->stop) {
          lk.unlock();
          l->host_work();
          lk.lock();
        }
        ++s->completed;
        dev.work_done.notify_all();
        continue;
      }
      KernelStats &st = dev.stats[l->func];
      if (st.name.empty()) st.name = l->name;
      st.launches += 1;
      st.blocks += total_blocks(*l);
      counters_launch_starts(dev, *s, *l);
      l->ordinal = s->kernels_started++;
      if (weak_memory) memory_operation_starts(*s, *l);
      s->running = std::move(l);
    }
  }
}

bool has_work(const Device &dev) {
  for (auto &s : dev.streams)
    if (s->running || !s->queue.empty()) return true;
  return false;
}

// The earliest virtual time at which a delayed stream may start its next launch, or 0.
uint64_t next_delayed_start(Device &dev) {
  std::lock_guard<std::mutex> lk(dev.mu);
  uint64_t next = 0;
  for (auto &s : dev.streams)
    if (!s->running && !s->queue.empty() && s->not_before > dev.clock_ns && (next == 0 || s->not_before < next))
      next = s->not_before;
  return next;
}

const char *state_name(FiberState s) {
  switch (s) {
  case FiberState::Ready: return "polling";
  case FiberState::AtBarrier: return "at __syncthreads";
  case FiberState::AtCollective: return "at a warp collective";
  default: return "exited";
  }
}

// Fails every running launch with a message naming what waits and what is not resident.
void report_deadlock(Device &dev, const std::string &why) {
  std::ostringstream msg;
  msg << "deadlock: " << why << ";";
  for (auto &b : dev.resident) {
    if (b->gone) continue;
    std::map<std::string, int> counts;
    for (auto &f : b->fibers)
      if (f->state != FiberState::Exited) counts[state_name(f->state)] += 1;
    msg << " " << describe(*b) << ":";
    for (auto &c : counts) msg << " " << c.second << " thread(s) " << c.first;
    msg << ";";
  }
  for (Stream *s : dev.active) {
    Launch *l = s->running.get();
    if (l && l->next_block < total_blocks(*l))
      msg << " kernel " << l->name << " blocks " << l->next_block << ".." << total_blocks(*l) - 1
          << " not resident (no SM has room);";
  }
  const std::string text = msg.str();
  std::fprintf(stderr, "tpfuse emulator: %s\n", text.c_str());
  for (Stream *s : dev.active) {
    Launch *l = s->running.get();
    if (l && !l->failed) {
      l->failed = true;
      l->code = cudaErrorLaunchTimeout;
      l->error = text;
    }
  }
  retire(dev);
  sweep(dev);
}

// A pass in which every runnable thread only polled: the clock steps on (1 µs, growing by
// 0.01% a pass). Towards a delayed rank's start too, never past it: on a GPU its peers poll
// all the while (a poll is about a microsecond), so their waits' checks every 1024 polls run
// as they would there (a late rank is no failure); that wait is no deadlock either.
void idle_step(Device &dev) {
  dev.idle_jump_ns = std::max<uint64_t>(1000, dev.idle_jump_ns + dev.idle_jump_ns / 10000);
  if (uint64_t next = next_delayed_start(dev)) {
    set_clock(dev, std::min(next, dev.clock_ns + dev.idle_jump_ns));
    return;
  }
  set_clock(dev, dev.clock_ns + dev.idle_jump_ns);
  dev.idle_ns += dev.idle_jump_ns;
  if (dev.idle_ns > dev.config.deadlock_ns) {
    report_deadlock(dev, "no thread made progress for " + std::to_string(dev.idle_ns) +
                             " ns of virtual time (every runnable thread polls a flag that does not change)");
    dev.idle_ns = dev.idle_jump_ns = 0;
  }
}

void device_loop(Device &dev) {
#ifdef TPFUSE_EMU_ASAN
  pthread_attr_t attr;
  pthread_getattr_np(pthread_self(), &attr);
  void *addr = nullptr;
  size_t size = 0;
  pthread_attr_getstack(&attr, &addr, &size);
  pthread_attr_destroy(&attr);
  scheduler_stack_bottom = addr;
  scheduler_stack_size = size;
#endif
  std::vector<Fiber *> order;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(dev.mu);
      dev.parked = true;
      dev.work_done.notify_all();
      dev.wake_device.wait(lk, [&] { return device_wanted(dev) && has_work(dev); });
      dev.parked = false;
    }
    refresh_active(dev);
    admit(dev);
    if (dev.resident.empty()) {
      if (uint64_t next = next_delayed_start(dev)) {
        set_clock(dev, next);
      } else {  // every stream with work waits for an event no stream will record yet
        std::unique_lock<std::mutex> lk(dev.mu);
        dev.wake_device.wait_for(lk, std::chrono::milliseconds(1));
      }
      continue;
    }
    dev.progress = false;
    const int ran = run_pass(dev, order);
    retire(dev);
    sweep(dev);
    if (ran == 0 && !dev.resident.empty()) {
      report_deadlock(dev, "every resident thread waits at a barrier or warp collective that cannot complete");
    } else if (!dev.progress && ran > 0) {
      idle_step(dev);
    } else {
      dev.idle_ns = dev.idle_jump_ns = 0;
    }
  }
}

} // namespace

Device &device() {
  static Device *dev = [] {
    Device *d = new Device();  // never destroyed: the device thread outlives main's statics
    d->config = config_from_env();
    d->rng.seed(d->config.seed);
    configure_memory(d->config.memory, d->config.seed);
    const size_t sms = static_cast<size_t>(d->config.sms) * emulated_devices();
    d->sm_threads.assign(sms, 0);
    d->sm_blocks.assign(sms, 0);
    d->sm_registers.assign(sms, {0, 0, 0, 0});
    d->sm_smem.assign(sms, 0);
    d->streams.push_back(std::make_unique<Stream>());
    d->default_stream = d->streams.back().get();
    d->default_stream->slot = 0;
    std::thread(device_loop, std::ref(*d)).detach();
    return d;
  }();
  return *dev;
}

Fiber *running_fiber = nullptr;

void called_outside_a_kernel() {
  std::fprintf(stderr, "tpfuse emulator: device code called outside a kernel\n");
  std::abort();
}

void yield_to_scheduler() {
  Device &dev = device();
  Fiber *f = running_fiber;
#ifdef TPFUSE_EMU_ASAN
  __sanitizer_start_switch_fiber(&f->asan_fake_stack, scheduler_stack_bottom, scheduler_stack_size);
#endif
  ctx::transfer_t t = ctx::jump_fcontext(dev.scheduler_context, nullptr);
  dev.scheduler_context = t.fctx;
#ifdef TPFUSE_EMU_ASAN
  __sanitizer_finish_switch_fiber(f->asan_fake_stack, &scheduler_stack_bottom, &scheduler_stack_size);
#endif
  (void)f;
}

void fail_launch(cudaError_t code, const std::string &why) {
  Fiber &f = current_fiber();
  Launch &l = *f.block->launch;
  if (!l.failed) {
    l.failed = true;
    l.code = code;
    l.error = why + " (" + describe(*f.block) + ", thread " + std::to_string(f.tid.x) + ")";
    std::fprintf(stderr, "tpfuse emulator: launch failed: %s\n", l.error.c_str());
  }
  f.state = FiberState::Exited;
  switch_out_forever();
}

void release_barrier_if_complete(Block &b) {
  if (b.at_barrier == 0 || b.at_barrier != b.live) return;
  if (weak_memory) memory_barrier(b);  // bar.sync: each thread's writes before it, everyone's
  for (auto &f : b.fibers)
    if (f->state == FiberState::AtBarrier) f->state = FiberState::Ready;
  b.at_barrier = 0;
  b.dirty = true;
}

std::string describe(const Block &b) {
  std::ostringstream s;
  s << "kernel " << b.launch->name << ", block " << b.idx.x << " (stream " << b.launch->stream << ")";
  return s.str();
}

uint64_t now_ns() { return clock_now.load(std::memory_order_relaxed); }

} // namespace tpfuse_emu
