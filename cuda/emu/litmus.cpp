// litmus.cpp: the litmus tests of the PTX ISA's memory consistency model (MP, SB, LB, CoRR
// from the chapter; IRIW and WRC derived from its axioms) as kernels of the emulator, each
// thread of a test the only thread of its block. tests/emu_litmus.rs runs them many times in
// the weak-memory modes and counts the outcomes.
//
// Weak accesses go through cuda/common.cuh (what the kernels use); strong ones call the twins
// of cuda/ptx.cuh's instructions with the order and scope the test needs.
#include <cstring>

#include "common.cuh"
#include "ptx.cuh"
#include "tpfuse_emu.h"

// The emulated driver's events (driver.cpp).
extern "C" {
int cuEventCreate(void **event, unsigned flags);
int cuEventRecord(void *event, void *stream);
int cuStreamWaitEvent(void *stream, void *event, unsigned flags);
int cuEventDestroy_v2(void *event);
}

namespace {

using namespace tpfuse;
using tpfuse_emu::Order;
using tpfuse_emu::Scope;

// Words 64 bytes apart (separate 4-byte words and 16-byte lines).
struct Mem {
  uint32_t x, pad0[15];
  uint32_t y, pad1[15];
  uint32_t regs[4], pad2[12];
  uint32_t done, pad3[15];
};

constexpr int kSpins = 4096;  // a bounded wait: a thread that never sees the flag records 0

uint32_t load(const uint32_t *p, Order o, Scope s) { return tpfuse_emu::strong_load(p, o, s); }
void store(uint32_t *p, uint32_t v, Order o, Scope s) { tpfuse_emu::strong_store(p, v, o, s); }

// Waits (bounded) until *p is non-zero, polling relaxed at scope s; then reads it with `o`.
uint32_t await(const uint32_t *p, Order o, Scope s) {
  for (int i = 0; i < kSpins && load(p, Order::Relaxed, s) == 0; ++i) {
  }
  return load(p, o, s);
}

// fence.sc at scope s (PTX ISA: "membar / fence"; __threadfence at .gpu,
// __threadfence_system at .sys). tpfuse's kernels synchronise with release and acquire
// operations instead, so only these tests use fences.
void fence_sc(Scope s) { tpfuse_emu::fence(Order::SeqCst, s); }

// variant 0: synchronised as the model requires; 1: not (relaxed, no fence); 2: at a scope
// that does not include the other thread (`narrow`). `wide` is the scope that includes every
// thread of the placement (.gpu for CTAs of one GPU, .sys across GPUs).
__global__ void litmus_kernel(int test, int variant, Scope wide, Scope narrow, int first, int threads, Mem *m) {
  const int t = first + static_cast<int>(blockIdx.x);
  const bool sync = variant != 1;
  const Scope s = variant == 2 ? narrow : wide;
  uint32_t *r = m->regs;
  switch (test) {
  case TPFUSE_EMU_LITMUS_MP:  // data, then the flag; the flag, then data
    if (t == 0) {
      st_global(&m->x, 1u);
      store(&m->y, 1, sync ? Order::Release : Order::Relaxed, s);
    } else {
      st_global(&r[0], await(&m->y, sync ? Order::Acquire : Order::Relaxed, s));
      st_global(&r[1], ld_global(&m->x));
    }
    break;
  case TPFUSE_EMU_LITMUS_SB:  // each stores its word, then loads the other's
    st_global(t == 0 ? &m->x : &m->y, 1u);
    if (sync) fence_sc(s);
    st_global(&r[t], ld_global(t == 0 ? &m->y : &m->x));
    break;
  case TPFUSE_EMU_LITMUS_LB:  // each loads the other's word, then stores its own
    st_global(&r[t], ld_global(t == 0 ? &m->x : &m->y));
    st_global(t == 0 ? &m->y : &m->x, 1u);
    break;
  case TPFUSE_EMU_LITMUS_CORR:  // one strong store; two strong loads of it
    if (t == 0) {
      store(&m->x, 1, Order::Relaxed, s);
    } else {
      st_global(&r[0], load(&m->x, Order::Relaxed, s));
      st_global(&r[1], load(&m->x, Order::Relaxed, s));
    }
    break;
  case TPFUSE_EMU_LITMUS_WRC:  // x; x then y; y then x
    if (t == 0) {
      store(&m->x, 1, Order::Relaxed, wide);
    } else if (t == 1) {
      st_global(&r[0], await(&m->x, Order::Relaxed, wide));
      store(&m->y, 1, sync ? Order::Release : Order::Relaxed, s);
    } else {
      st_global(&r[1], await(&m->y, sync ? Order::Acquire : Order::Relaxed, s));
      st_global(&r[2], ld_global(&m->x));
    }
    break;
  case TPFUSE_EMU_LITMUS_IRIW:  // two writers; two readers in opposite orders
    if (t < 2) {
      store(t == 0 ? &m->x : &m->y, 1, Order::Relaxed, wide);
    } else {
      const uint32_t *first_word = t == 2 ? &m->x : &m->y, *second_word = t == 2 ? &m->y : &m->x;
      // Synchronised: strong loads with fence.sc between; else weak loads.
      const uint32_t a = sync ? load(first_word, Order::Relaxed, wide) : ld_global(first_word);
      if (sync) fence_sc(s);
      const uint32_t b = sync ? load(second_word, Order::Relaxed, wide) : ld_global(second_word);
      st_global(&r[2 * (t - 2)], a);
      st_global(&r[2 * (t - 2) + 1], b);
    }
    break;
  case TPFUSE_EMU_LITMUS_KB: {  // launch T1 starts after launch T0 completed; x's 16-bit halves
    uint16_t *half = reinterpret_cast<uint16_t *>(&m->x);
    if (t == 0) {
      st_global(&half[0], uint16_t{1});
    } else {
      st_global(&r[0], static_cast<uint32_t>(ld_global(&half[0])));
      st_global(&half[1], uint16_t{2});  // the other half: no race, and seen by T1's next write
      st_global(&half[0], uint16_t{2});
    }
    return;  // T1 starts only once T0 is done: nobody waits for the other
  }
  default: break;
  }
  // Every thread stays until all have finished: no launch completes (a kernel boundary, which
  // makes its writes everyone's) while another thread of the test still reads.
  tpfuse_emu::atomic_add(&m->done, 1u, Order::Relaxed, wide);
  for (int i = 0; i < kSpins && load(&m->done, Order::Relaxed, wide) < static_cast<uint32_t>(threads); ++i) {
  }
}

int threads_of(int test) {
  return test == TPFUSE_EMU_LITMUS_WRC ? 3 : test == TPFUSE_EMU_LITMUS_IRIW ? 4 : 2;
}

// One run: a launch of one-thread blocks on one stream (placement 0), or one launch per
// thread, each on its own stream tagged as its own rank (placement 1). Returns the outcome
// (register i in bit i) or -1 with `err` set.
int run_once(int test, int variant, int placement, Mem *m, void *const *streams, int32_t &err, char *error,
             size_t cap) {
  std::memset(m, 0, sizeof(Mem));
  const int n = threads_of(test);
  const Scope wide = placement == 0 ? Scope::Gpu : Scope::Sys;
  const Scope narrow = placement == 0 ? Scope::Cta : Scope::Gpu;
  if (test == TPFUSE_EMU_LITMUS_KB) {
    // T1's stream starts its launch 1 ms of virtual time later, after T0's completed; with the
    // synchronisation, it also waits for an event recorded after T0.
    cudaStream_t first = static_cast<cudaStream_t>(streams[0]), second = static_cast<cudaStream_t>(streams[1]);
    TPFUSE_LAUNCH(litmus_kernel, 1, 1, 0, first)(test, variant, wide, narrow, 0, n, m);
    if (variant == 0) {
      void *done = nullptr;
      cuEventCreate(&done, 0);
      cuEventRecord(done, first);
      cuStreamWaitEvent(second, done, 0);
      cuEventDestroy_v2(done);
    }
    tpfuse_emu_stream_set_fault(streams[1], 1000 * 1000, 0, 0);
    TPFUSE_LAUNCH(litmus_kernel, 1, 1, 0, second)(test, variant, wide, narrow, 1, n, m);
  } else if (placement == 0) {
    TPFUSE_LAUNCH(litmus_kernel, n, 1, 0, static_cast<cudaStream_t>(streams[0]))(test, variant, wide, narrow, 0, n, m);
  } else {
    for (int t = 0; t < n; ++t) {
      TPFUSE_LAUNCH(litmus_kernel, 1, 1, 0, static_cast<cudaStream_t>(streams[t]))(test, variant, wide, narrow, t, n, m);
    }
  }
  for (int t = 0; t < (placement == 0 ? 1 : n); ++t) {
    const int32_t e = tpfuse_emu_stream_synchronize(streams[t]);
    if (e != 0 && err == 0) {
      err = e;
      tpfuse_emu_stream_error(streams[t], error, cap);
    }
  }
  if (err != 0) return -1;
  if (test == TPFUSE_EMU_LITMUS_KB) m->regs[1] = (m->x & 0xffffu) == 1 ? 1 : 0;
  int outcome = 0;
  for (int i = 0; i < 4; ++i)
    if (m->regs[i] != 0) outcome |= 1 << i;
  return outcome;
}

} // namespace

extern "C" int32_t tpfuse_emu_litmus(int32_t test, int32_t variant, int32_t placement, uint32_t runs,
                                     uint32_t *outcomes, char *error, size_t error_cap) {
  if (test < TPFUSE_EMU_LITMUS_MP || test > TPFUSE_EMU_LITMUS_KB || variant < 0 || variant > 2 || placement < 0 ||
      placement > 1 || outcomes == nullptr ||
      (test == TPFUSE_EMU_LITMUS_KB && (variant == 2 || placement != 1))) {
    return cudaErrorInvalidValue;
  }
  std::memset(outcomes, 0, 16 * sizeof(uint32_t));
  Mem *m = static_cast<Mem *>(tpfuse_emu_malloc(sizeof(Mem)));
  void *streams[4];
  for (int t = 0; t < 4; ++t) {
    streams[t] = tpfuse_emu_stream_create();
    tpfuse_emu_tag_stream(streams[t], t);
  }
  int32_t err = 0;
  for (uint32_t i = 0; i < runs && err == 0; ++i) {
    const int outcome = run_once(test, variant, placement, m, streams, err, error, error_cap);
    if (outcome >= 0) ++outcomes[outcome];
  }
  for (void *s : streams) tpfuse_emu_stream_destroy(s);
  tpfuse_emu_free(m);
  return err;
}
