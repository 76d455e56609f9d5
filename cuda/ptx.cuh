// ptx.cuh: every inline-asm wrapper of tpfuse, the one hardware layer. Each wrapper has its
// emulated twin beside it (TPFUSE_EMULATOR: the CPU emulator of cuda/emu, see
// docs/emulator.md); the kernels call only these functions, never asm directly.
//
// The emulated twins follow the PTX ISA's definition of each instruction (sections cited
// below); what the emulator cannot reproduce is listed in docs/emulator.md. Every twin of a
// strong operation names the instruction's order and scope (tpfuse_emu::Order, Scope: no
// defaults), which the weak-memory mode (TPFUSE_EMU_MEMORY=weak) honours and the default
// sequentially consistent mode ignores; the arithmetic inside one mma is a documented model.
#pragma once

#include <stdint.h>

#include "backend.cuh"

namespace tpfuse {

// ---- Memory order at system scope (PTX ISA: "Data Movement and Conversion Instructions:
// ld / st" and "Memory Consistency Model"). acquire/release pair across ranks; relaxed is a plain atomic read of a flag.

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *p) {
#ifdef TPFUSE_EMULATOR
  return ::tpfuse_emu::strong_load(p, ::tpfuse_emu::Order::Acquire, ::tpfuse_emu::Scope::Sys);
#else
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

__device__ __forceinline__ void st_release_sys(uint32_t *p, uint32_t v) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::strong_store(p, v, ::tpfuse_emu::Order::Release, ::tpfuse_emu::Scope::Sys);
#else
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

__device__ __forceinline__ void st_relaxed_sys(uint32_t *p, uint32_t v) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::strong_store(p, v, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Sys);
#else
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t *p) {
#ifdef TPFUSE_EMULATOR
  return ::tpfuse_emu::strong_load(p, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Sys);
#else
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

// The same three on a naturally aligned 64-bit word: the fused GEMM's tile flags, whose epoch
// and descriptor halves must be seen together. A scalar .u64 access is one memory operation
// on its 8 bytes (PTX ISA, "Memory Consistency Model": only vector accesses are split into
// one operation per element), so a load sees one store's whole value.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p) {
#ifdef TPFUSE_EMULATOR
  return ::tpfuse_emu::strong_load(p, ::tpfuse_emu::Order::Acquire, ::tpfuse_emu::Scope::Sys);
#else
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t *p) {
#ifdef TPFUSE_EMULATOR
  return ::tpfuse_emu::strong_load(p, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Sys);
#else
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

__device__ __forceinline__ void st_release_sys(uint64_t *p, uint64_t v) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::strong_store(p, v, ::tpfuse_emu::Order::Release, ::tpfuse_emu::Scope::Sys);
#else
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// ---- Release at GPU scope: a flag only this GPU's threads read (the one-shot's strip flags,
// the meeting of a rank's blocks). Its scope includes every reader, so a reader's acquire,
// .gpu or .sys, synchronises with it (PTX ISA, "Memory Consistency Model: Scope" and
// "Morally strong operations"); what the writer releases is its own stores and, by
// cumulativity, those it acquired, wherever they came from (causality order is transitive).
// It compiles to MEMBAR.GPU where .sys is MEMBAR.SYS, which also waits for the thread's
// earlier memory operations to be visible to the host and the peers. A flag a peer reads
// stays .sys.
__device__ __forceinline__ void st_release_gpu(uint32_t *p, uint32_t v) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::strong_store(p, v, ::tpfuse_emu::Order::Release, ::tpfuse_emu::Scope::Gpu);
#else
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

__device__ __forceinline__ void st_release_gpu(uint64_t *p, uint64_t v) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::strong_store(p, v, ::tpfuse_emu::Order::Release, ::tpfuse_emu::Scope::Gpu);
#else
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Two naturally aligned 64-bit words of a 16-byte aligned pair, relaxed at system scope in one
// vector instruction: the fused GEMM + all-reduce's packets (gemm_all_reduce.cu, "Packets").
// A vector access is one memory operation per element, in an unspecified order (PTX ISA,
// "Memory Consistency Model: Vector Data-types"): each word is seen whole, the two
// independently. Emulated: the two words in element order, counted as 16 bytes of data.
struct Words2 {
  uint64_t lo, hi;
};

__device__ __forceinline__ Words2 ld_relaxed_sys_v2(const uint64_t *p) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::check_aligned(p, 16);
  ::tpfuse_emu::count_load(p, 16);
  const uint64_t lo = ::tpfuse_emu::strong_load(p, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Sys);
  return Words2{lo, ::tpfuse_emu::strong_load(p + 1, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Sys)};
#else
  Words2 v;
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.lo), "=l"(v.hi) : "l"(p) : "memory");
  return v;
#endif
}

__device__ __forceinline__ void st_relaxed_sys_v2(uint64_t *p, Words2 v) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::check_aligned(p, 16);
  ::tpfuse_emu::count_store(p, 16);
  ::tpfuse_emu::strong_store(p, v.lo, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Sys);
  ::tpfuse_emu::strong_store(p + 1, v.hi, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Sys);
#else
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(v.lo), "l"(v.hi) : "memory");
#endif
}

// %globaltimer (PTX ISA: "Special Registers: %globaltimer"): nanoseconds. Emulated: virtual
// time (docs/emulator.md).
__device__ __forceinline__ uint64_t global_timer_ns() {
#ifdef TPFUSE_EMULATOR
  return ::tpfuse_emu::global_timer_ns();
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// %clock64 (PTX ISA: "Special Registers: %clock64"): the SM's cycle counter, 64 bits (no
// wrap in practice). It is per SM: differences are meaningful only within one thread (a
// block never migrates between SMs). Emulated: virtual time at the emulated device's peak
// clock (tpfuse_emu::kClockKhz, reported as CU_DEVICE_ATTRIBUTE_CLOCK_RATE).
__device__ __forceinline__ uint64_t clock_cycles() {
#ifdef TPFUSE_EMULATOR
  return ::tpfuse_emu::clock_cycles();
#else
  uint64_t c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c));
  return c;
#endif
}

// atom.cas.sys.global.b32 (PTX ISA: "Parallel Synchronization and Communication
// Instructions: atom"): compare-and-swap at system scope (relaxed), the scope of the peers'
// st.release.sys to the same word. Returns the old value.
__device__ __forceinline__ uint32_t atomic_cas_sys(uint32_t *p, uint32_t expected, uint32_t desired) {
#ifdef TPFUSE_EMULATOR
  return ::tpfuse_emu::atomic_cas(p, expected, desired, ::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Sys);
#else
  uint32_t old;
  asm volatile("atom.relaxed.sys.global.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(expected), "r"(desired) : "memory");
  return old;
#endif
}

// atom.acq_rel.gpu.global.add.u32 (PTX ISA: "atom"): adds v, returns the old value; a release
// of what this thread ordered before it and an acquire of what the values it reads from
// released (the read-modify-writes of one location form a release sequence).
__device__ __forceinline__ uint32_t atomic_add_acq_rel_gpu(uint32_t *p, uint32_t v) {
#ifdef TPFUSE_EMULATOR
  return ::tpfuse_emu::atomic_add(p, v, ::tpfuse_emu::Order::AcqRel, ::tpfuse_emu::Scope::Gpu);
#else
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
#endif
}

// atom.acq_rel.sys.global.add.u32: atomic_add_acq_rel_gpu at system scope, for a count whose
// adds release stores that went to other GPUs (all-gather + GEMM's gather_count: the PTX
// model makes a .gpu release cumulative over them too; .sys so that correctness does not rest
// on the hardware honouring that for stores bound for a peer). The count itself lies in this
// GPU's memory: no peer atomics.
__device__ __forceinline__ uint32_t atomic_add_acq_rel_sys(uint32_t *p, uint32_t v) {
#ifdef TPFUSE_EMULATOR
  return ::tpfuse_emu::atomic_add(p, v, ::tpfuse_emu::Order::AcqRel, ::tpfuse_emu::Scope::Sys);
#else
  uint32_t old;
  asm volatile("atom.acq_rel.sys.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
#endif
}

// ---- Shared memory and the sm80 GEMM's data movement.

// The shared-window address of a pointer into (dynamic) shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async (PTX ISA: "Data Movement and Conversion Instructions: cp.async"): 16 bytes
// global -> shared, cached in L2 only. With fill == false nothing is read and the 16
// destination bytes are zeroed (src must still be a valid address; callers pass one). Emulated: the copy is recorded in this thread's open
// group and lands only at the cp.async.wait_group that must complete it.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, bool fill) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::cp_async(dst, src, fill ? 16 : 0);
#else
  const int src_bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still pending.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ldmatrix (PTX ISA: "Warp-level matrix load instruction: ldmatrix"): four 8x8 b16
// matrices; lanes 8i..8i+7 give the row addresses of matrix i, and each lane gets
// (row lane/4, columns 2*(lane%4), +1) of matrix i in r[i].
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                            uint32_t &r3) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::ldmatrix_x4(addr, r0, r1, r2, r3);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
#endif
}

// 16 zero bytes to shared memory.
__device__ __forceinline__ void zero_16(uint32_t dst) {
#ifdef TPFUSE_EMULATOR
  ::tpfuse_emu::shared_zero16(dst);
#else
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0) : "memory");
#endif
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (PTX ISA: "Warp-level
// matrix multiply-accumulate instructions: mma"; fragments in "Matrix Fragments for
// mma.m16n8k16 with floating point type"):
// d = a (16x16, row-major) * b (16x8, column-major) + d. The one instruction every GEMM path
// of tpfuse accumulates with (see the batch-invariance note in gemm_sm80.cuh).
template <typename T> struct Mma;

template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef TPFUSE_EMULATOR
    ::tpfuse_emu::mma_m16n8k16(::tpfuse_emu::MmaType::F16, d, a, b);
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
  }
};

template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef TPFUSE_EMULATOR
    ::tpfuse_emu::mma_m16n8k16(::tpfuse_emu::MmaType::BF16, d, a, b);
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
  }
};

} // namespace tpfuse
