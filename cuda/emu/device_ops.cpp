// device_ops.cpp: block-level operations of the emulated device: the running thread's
// indices, __syncthreads, shared memory, flags and atomics, cp.async, %globaltimer.
#include <cstdio>
#include <cstring>

#include "scheduler.hpp"

namespace tpfuse_emu {
namespace {

Block &current_block() { return *current_fiber().block; }

// `bytes` of dynamic shared memory at shared-window address `addr`, checked.
unsigned char *shared_at(uint32_t addr, size_t bytes) {
  Block &b = current_block();
  if (static_cast<size_t>(addr) + bytes > b.dynamic_bytes) {
    fail_launch(cudaErrorIllegalAddress, "shared memory access at " + std::to_string(addr) + " (+" +
                                             std::to_string(bytes) + " bytes) past the block's " +
                                             std::to_string(b.launch->smem) + " bytes of dynamic shared memory");
  }
  return b.dynamic_smem.data() + addr;
}

// Whether thread f polled address p recently (one of its Fiber::kPolled newest addresses).
bool polled_recently(const Fiber &f, const void *p) {
  for (int i = 0; i < Fiber::kPolled; ++i)
    if (f.polled[i] == p) return true;
  return false;
}

// A poll that returns what this thread saw last time at the same address is no progress. A
// thread remembers its Fiber::kPolled most recent addresses: a barrier's wait polls two (its
// flag and the error word), a wait for a vector's packets six (its four packets, the error
// word and the peer's started flag: gemm_all_reduce.cu's packets). With fewer, such a wait
// would count as progress at every poll, and a schedule that runs the waiting thread first
// would starve the others (a GPU runs every resident block).
void note_poll(Fiber &f, const void *p, uint64_t v) {
  for (int i = 0; i < Fiber::kPolled; ++i) {
    if (f.polled[i] == p) {
      if (f.polled_value[i] != v) device().progress = true;
      f.polled_value[i] = v;
      return;
    }
  }
  device().progress = true;
  for (int i = Fiber::kPolled - 1; i > 0; --i) {
    f.polled[i] = f.polled[i - 1];
    f.polled_value[i] = f.polled_value[i - 1];
  }
  f.polled[0] = p;
  f.polled_value[0] = v;
}

// An operation other threads can observe: counts as progress, and lets them run.
void observable_step() {
  device().progress = true;
  yield_to_scheduler();
}

} // namespace

const uint3 &thread_idx() { return current_fiber().tid; }
const uint3 &block_idx() { return current_block().idx; }
const dim3 &block_dim() { return current_block().launch->block; }
const dim3 &grid_dim() { return current_block().launch->grid; }

// bar.sync is .aligned (PTX ISA, "bar, barrier"): in conditionally executed code every thread
// of the block must take the same branch, so a barrier reached after some threads of the
// block exited is undefined behaviour on a GPU, and a launch failure here.
void syncthreads() {
  Fiber &f = current_fiber();
  Block &b = *f.block;
  const int threads = static_cast<int>(b.fibers.size());
  if (b.live < threads) {
    fail_launch(cudaErrorLaunchFailure, "__syncthreads reached after " + std::to_string(threads - b.live) + " of " +
                                            std::to_string(threads) + " threads of the block exited");
  }
  f.state = FiberState::AtBarrier;
  ++b.at_barrier;
  b.dirty = true;
  release_barrier_if_complete(b);
  observable_step();
}

void *block_shared_bytes(const void *tag, size_t bytes, size_t align) {
  Block &b = current_block();
  for (auto &entry : b.statics)
    if (entry.tag == tag) return entry.start;
  // A kernel's static shared memory counts toward the block's limit with its dynamic shared
  // memory: 48 KiB in all unless the kernel opted in to more dynamic shared memory
  // (cudaFuncAttributeMaxDynamicSharedMemorySize, whose default is 48 KiB less the static
  // size). A GPU refuses such a launch; here it fails when the block declares the static.
  b.static_bytes += bytes;
  if (b.dynamic_bytes + b.static_bytes > kSmemPerBlockDefault) {
    Device &dev = device();
    bool opted_in;
    {
      std::lock_guard<std::mutex> lk(dev.mu);
      opted_in = dev.max_dynamic_smem.count(b.launch->func) != 0;
    }
    if (!opted_in) {
      fail_launch(cudaErrorInvalidValue,
                  std::to_string(b.dynamic_bytes) + " B of dynamic and " + std::to_string(b.static_bytes) +
                      " B of static shared memory exceed 48 KiB without the kernel's opt-in "
                      "(cudaFuncAttributeMaxDynamicSharedMemorySize)");
    }
  }
  const size_t total = bytes + align + kSharedRedZone;
  std::unique_ptr<unsigned char[]> storage(new unsigned char[total]);
  std::memset(storage.get(), 0xFF, total);
  const uintptr_t raw = reinterpret_cast<uintptr_t>(storage.get());
  unsigned char *start = reinterpret_cast<unsigned char *>((raw + align - 1) / align * align);
  b.statics.push_back(Block::Static{tag, std::move(storage), start, bytes});
  return start;
}

// Whether the kSharedRedZone bytes at p still hold the poison they started with.
static bool red_zone_intact(const unsigned char *p) {
  for (size_t i = 0; i < kSharedRedZone; ++i)
    if (p[i] != 0xFF) return false;
  return true;
}

std::string shared_overrun(const Block &b) {
  if (!b.dynamic_smem.empty() && !red_zone_intact(b.dynamic_smem.data() + b.dynamic_bytes)) {
    return "shared memory written past the block's " + std::to_string(b.dynamic_bytes) +
           " bytes of dynamic shared memory (through a plain pointer)";
  }
  for (const Block::Static &s : b.statics) {
    if (!red_zone_intact(s.start + s.bytes)) {
      return "shared memory written past a " + std::to_string(s.bytes) +
             "-byte __shared__ variable (through a plain pointer)";
    }
  }
  return "";
}

unsigned char *dynamic_shared() { return current_block().dynamic_smem.data(); }

uint32_t cvta_shared(const void *p) {
  Block &b = current_block();
  const unsigned char *c = static_cast<const unsigned char *>(p);
  if (c < b.dynamic_smem.data() || c > b.dynamic_smem.data() + b.dynamic_bytes) {
    fail_launch(cudaErrorIllegalAddress, "__cvta_generic_to_shared of a pointer outside dynamic shared memory");
  }
  return static_cast<uint32_t>(c - b.dynamic_smem.data());
}

void shared_zero16(uint32_t dst) { std::memset(shared_at(dst, 16), 0, 16); }

namespace {

// A flag's load (32 or 64 bits), polled: others run first, so the value read is the freshest.
template <typename U> U poll_flag(const U *p, Order o, Scope s) {
  Fiber &f = current_fiber();
  if (!polled_recently(f, p)) device().progress = true;  // a new wait begins
  yield_to_scheduler();
  const U v = __atomic_load_n(p, o == Order::Relaxed ? __ATOMIC_RELAXED : __ATOMIC_ACQUIRE);
  note_poll(f, p, v);
  if (weak_memory && is_global(p)) memory_strong_read(p, sizeof(U), o, s);
  return v;
}

template <typename U> void store_flag(U *p, U v, Order o, Scope s) {
  if (weak_memory && is_global(p)) {
    memory_strong_write(p, &v, sizeof(U), o, s);
  } else {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
  }
  observable_step();
}

template <typename U, typename Op> U read_modify_write(U *p, Order o, Scope s, Op op) {
  static_assert(sizeof(U) == 4, "32-bit atomics");
  U old;
  if (weak_memory && is_global(p)) {
    const uint32_t was = memory_rmw(reinterpret_cast<uint32_t *>(p), o, s, [&](uint32_t x) {
      U u;
      std::memcpy(&u, &x, 4);
      const U r = op(u);
      uint32_t y;
      std::memcpy(&y, &r, 4);
      return y;
    });
    std::memcpy(&old, &was, 4);
  } else {
    // One device thread performs every atomic: a load and a store are one indivisible step.
    old = __atomic_load_n(p, __ATOMIC_ACQUIRE);
    __atomic_store_n(p, op(old), __ATOMIC_RELEASE);
  }
  observable_step();
  return old;
}

} // namespace

uint32_t strong_load(const uint32_t *p, Order o, Scope s) { return poll_flag(p, o, s); }
uint64_t strong_load(const uint64_t *p, Order o, Scope s) { return poll_flag(p, o, s); }
void strong_store(uint32_t *p, uint32_t v, Order o, Scope s) { store_flag(p, v, o, s); }
void strong_store(uint64_t *p, uint64_t v, Order o, Scope s) { store_flag(p, v, o, s); }

int atomic_add(int *p, int v, Order o, Scope s) {
  return read_modify_write(p, o, s, [v](int x) { return static_cast<int>(static_cast<unsigned>(x) + static_cast<unsigned>(v)); });
}
unsigned atomic_add(unsigned *p, unsigned v, Order o, Scope s) {
  return read_modify_write(p, o, s, [v](unsigned x) { return x + v; });
}
int atomic_cas(int *p, int expected, int desired, Order o, Scope s) {
  return read_modify_write(p, o, s, [=](int x) { return x == expected ? desired : x; });
}
unsigned atomic_cas(unsigned *p, unsigned expected, unsigned desired, Order o, Scope s) {
  return read_modify_write(p, o, s, [=](unsigned x) { return x == expected ? desired : x; });
}

void fence(Order o, Scope s) {
  if (weak_memory) memory_fence(o, s);
  observable_step();
}

uint64_t global_timer_ns() {
  const Stream &s = *current_block().launch->stream;
  return s.frozen ? s.frozen_at : now_ns();
}

uint64_t clock_cycles() {
  const Stream &s = *current_block().launch->stream;
  return static_cast<uint64_t>(static_cast<unsigned __int128>(now_ns()) * kClockKhz / 1000000 / s.clock_divisor);
}

// cp.async copies of a thread form its open group until a commit; wait_group(n) lands
// committed groups, oldest first, until at most n are pending (PTX ISA, cp.async.wait_group).
// The source is read when the copy lands (sc), or at the issue (weak memory).
// The destination is undefined from the issue until the wait that completes the copy (PTX
// ISA: cp.async is a weak operation, unordered until waited for): it reads as 0xFF (NaN)
// meanwhile, so a stage overwritten while another warp still reads it shows.
void misaligned_access(const void *p, size_t bytes) {
  char why[96];
  std::snprintf(why, sizeof why, "a %zu-byte global access at %p, not %zu-byte aligned", bytes, p, bytes);
  fail_launch(cudaErrorMisalignedAddress, why);
}

void cp_async(uint32_t dst, const void *src, int src_bytes) {
  if (dst % 16 != 0) fail_launch(cudaErrorMisalignedAddress, "cp.async to a shared address not 16-byte aligned");
  // cp.async.cg of 16 bytes: the global source too (even when src-size is 0, the address is
  // an operand of the instruction).
  check_aligned(src, 16);
  std::memset(shared_at(dst, 16), 0xFF, 16);
  if (src_bytes > 0) count_load(src, static_cast<size_t>(src_bytes));
  Copy c{dst, src, src_bytes};
  // Weak memory: the source is read now, under this thread's view (when between the issue and
  // the wait a cp.async reads is unspecified; the issue is the earliest).
  if (weak_memory && src_bytes > 0) {
    weak_load(src, c.data, 16);
    c.read = true;
  }
  current_fiber().open_group.push_back(c);
}

void cp_async_commit() {
  Fiber &f = current_fiber();
  f.committed.push_back(std::move(f.open_group));
  f.open_group.clear();
}

void cp_async_wait(int pending) {
  Fiber &f = current_fiber();
  while (f.committed.size() > static_cast<size_t>(pending)) {
    for (const Copy &c : f.committed.front()) {
      unsigned char *d = shared_at(c.dst, 16);
      std::memcpy(d, c.read ? c.data : c.src, static_cast<size_t>(c.bytes));
      std::memset(d + c.bytes, 0, 16 - static_cast<size_t>(c.bytes));  // src-size < 16: zero fill
    }
    f.committed.erase(f.committed.begin());
  }
}

} // namespace tpfuse_emu
