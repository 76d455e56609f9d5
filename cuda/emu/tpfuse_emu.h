/*
 * tpfuse_emu.h: the C ABI of the CPU emulator (cuda/emu), for the Rust side
 * (src/emulator.rs, tests/emu_*.rs). build.rs runs bindgen on it with the `emulator` feature.
 *
 * The emulated device: `sms` SMs, each holding up to 2048 threads, 32 blocks and 228 KiB of
 * shared memory (an H100's limits, compute capability 9.0); blocks of a launch become resident
 * as those allow and the rest start as earlier ones finish. Device memory is host memory.
 * Device work runs on one device thread, and only while some host thread waits for it
 * (a synchronize): so a run is deterministic for a given schedule and seed.
 */
#ifndef TPFUSE_EMU_H
#define TPFUSE_EMU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The order in which each pass resumes the runnable threads of all resident blocks. */
#define TPFUSE_EMU_SCHEDULE_FORWARD 0 /* blocks in order of residency, threads ascending */
#define TPFUSE_EMU_SCHEDULE_REVERSE 1 /* both descending */
#define TPFUSE_EMU_SCHEDULE_RANDOM 2  /* a fresh permutation per pass, from `seed` */
#define TPFUSE_EMU_SCHEDULE_PCT 3     /* random block priorities with change points, from
                                         `seed`: the highest-priority block that can go on
                                         runs alone (every other stands still) */

typedef struct tpfuse_emu_config {
  int32_t sms;          /* SMs of the emulated device (TPFUSE_EMU_SMS, default 132: an H100) */
  int32_t schedule;     /* TPFUSE_EMU_SCHEDULE_* (TPFUSE_EMU_SCHEDULE=forward|reverse|random|pct) */
  uint64_t seed;        /* for RANDOM and PCT (TPFUSE_EMU_SEED, default 1) */
  uint64_t deadlock_ns; /* virtual time without progress after which the device reports a
                           deadlock (TPFUSE_EMU_DEADLOCK_NS, default 60 s) */
  int32_t arch;         /* the SMs' compute capability, major * 10 + minor: their limits
                           (threads, blocks, shared memory) and what the device reports
                           (TPFUSE_EMU_ARCH=80|86|89|90|100|120, default 90: an H100) */
  int32_t memory;       /* TPFUSE_EMU_MEMORY_* (TPFUSE_EMU_MEMORY=sc|weak|weak-random, default sc):
                           global memory sequentially consistent, or under the PTX memory model
                           with each weak load reading the oldest value the model allows
                           (weak) or a random one of those (weak-random, drawn from seed) */
} tpfuse_emu_config;

#define TPFUSE_EMU_MEMORY_SC 0
#define TPFUSE_EMU_MEMORY_WEAK 1
#define TPFUSE_EMU_MEMORY_WEAK_RANDOM 2

/* The configuration in force (read from the environment on first use). */
void tpfuse_emu_get_config(tpfuse_emu_config *out);
/* Replaces it; cudaErrorNotReady while any work is in flight, cudaErrorInvalidValue when a
 * field is out of range. */
int32_t tpfuse_emu_set_config(const tpfuse_emu_config *config);

/* Streams. A stream's first failure (a launch that failed on the device) sticks to it and is
 * returned by every later synchronize. */
void *tpfuse_emu_stream_create(void);
void tpfuse_emu_stream_destroy(void *stream);
/* Runs the device until everything enqueued on `stream` so far has completed; returns 0 or
 * the stream's sticky error. */
int32_t tpfuse_emu_stream_synchronize(void *stream);
/* Runs the device until everything enqueued on every stream so far has completed (frees
 * included); errors stay with their streams. */
void tpfuse_emu_device_synchronize(void);
/* The message of the stream's sticky error ("" when none), copied into buf (NUL-terminated,
 * truncated to cap); returns its full length. */
size_t tpfuse_emu_stream_error(void *stream, char *buf, size_t cap);

/* The message of the most recent launch that was refused or failed on the device, on any
 * stream ("" when none), copied like tpfuse_emu_stream_error. */
size_t tpfuse_emu_last_failure(char *buf, size_t cap);

/* Fault hooks, per stream (a virtual rank). delay_ns: work enqueued from now on starts only
 * once virtual time has advanced by delay_ns. stop: launches are dropped without running (a
 * rank that never arrives). freeze_timer: %globaltimer of this stream's kernels stays at its
 * value now. */
int32_t tpfuse_emu_stream_set_fault(void *stream, uint64_t delay_ns, int32_t stop, int32_t freeze_timer);

/* Fault hook: %clock64 of this stream's kernels advances `divisor` times slower than at the
 * emulated peak clock (0 and 1: at the peak), an SM at a low clock. Set it before the stream's
 * kernels run (a change while one runs makes its %clock64 jump). */
int32_t tpfuse_emu_stream_set_clock_divisor(void *stream, uint32_t divisor);

/* Device memory (host memory, 256-byte aligned, filled with 0xFF bytes). */
void *tpfuse_emu_malloc(size_t bytes);
void tpfuse_emu_free(void *ptr);

/* How many kernels are loaded on emulated device `device` (cuFuncLoad, or a first use:
 * loading.cpp, CUDA's lazy loading). */
size_t tpfuse_emu_loaded_kernels(int32_t device);

/* Virtual time in nanoseconds (what %globaltimer reads). */
uint64_t tpfuse_emu_now_ns(void);

/* One line per kernel instantiation that ran in this process: "launches\tblocks\tname",
 * copied into buf (NUL-terminated, truncated to cap); returns the full length. At exit the
 * same lines are appended to the file named by TPFUSE_EMU_REPORT, when set. */
size_t tpfuse_emu_report(char *buf, size_t cap);

/* ---- Counters: the performance evidence a CPU can give (docs/emulator.md, "Counters").
 * Between counters_start and counters_stop every launch that completes leaves one record per
 * block. Bytes are those of the kernels' data accesses through the load and store helpers of
 * cuda/common.cuh and cp.async; the barriers' flags and epochs are counted as barriers, not
 * bytes. */
typedef struct tpfuse_emu_block_counters {
  uint64_t launch;             /* the launch's index among the records (completion order) */
  uint32_t block;              /* blockIdx.x */
  int32_t rank;                /* the rank tag of the launch's stream; -1 when untagged */
  uint64_t global_read_bytes;  /* loads from global memory, peers' buffers included */
  uint64_t global_write_bytes; /* stores to global memory */
  uint64_t peer_read_bytes;    /* loads from memory tagged with a rank other than `rank` */
  uint64_t peer_write_bytes;   /* stores to memory tagged with a rank other than `rank` */
  uint64_t barriers;           /* cross-rank barriers passed */
  uint64_t ldmatrix_conflicts; /* per 8-row phase of an ldmatrix: the most rows in one
                                  shared-memory bank, less one */
} tpfuse_emu_block_counters;

/* Tags [ptr, ptr + bytes) as rank `rank`'s memory (virtual ranks share one device); freeing
 * the allocation drops its tags. */
void tpfuse_emu_tag_memory(const void *ptr, size_t bytes, int32_t rank);
/* Tags a stream with the rank whose work it runs. */
void tpfuse_emu_tag_stream(void *stream, int32_t rank);
/* Clears the records and starts recording; launches already running are not recorded. */
void tpfuse_emu_counters_start(void);
/* Stops recording (the records stay). */
void tpfuse_emu_counters_stop(void);
/* Copies up to cap block records (ordered by launch, then block) into out; returns how many
 * there are. */
size_t tpfuse_emu_counters_blocks(tpfuse_emu_block_counters *out, size_t cap);
/* The kernel instantiation of record `launch`, copied like tpfuse_emu_stream_error; returns
 * its full length (0 when there is no such record). */
size_t tpfuse_emu_counters_launch_name(uint64_t launch, char *buf, size_t cap);

/* ---- Probes: one warp runs one emulated operation; for the emulator's own tests. Each
 * returns 0 or the launch's error. */

/* mma.sync.m16n8k16.row.col.f32.{f16|bf16}: per lane a[4], b[2], c[4] -> d[4]. */
int32_t tpfuse_emu_probe_mma(int32_t bf16, const uint32_t *a, const uint32_t *b, const float *c,
                             float *d);
/* ldmatrix.x4 from `smem` (smem_bytes copied into shared memory at offset 0); lane l passes
 * addr[l] (a byte offset) and receives out[4 * l .. 4 * l + 4]. */
int32_t tpfuse_emu_probe_ldmatrix_x4(const void *smem, size_t smem_bytes, const uint32_t *addr,
                                     uint32_t *out);
/* out[l] = __shfl_xor_sync(full, in[l], lane_mask). */
int32_t tpfuse_emu_probe_shfl_xor(const float *in, int32_t lane_mask, float *out);
/* Lane 0 copies src (48 bytes) into shared memory in three cp.async groups of 16 bytes, the
 * third with src-size 0, over 0xFF bytes; snapshots the 48 shared bytes after wait_group 2,
 * 1 and 0 into out[0..48), out[48..96), out[96..144). */
int32_t tpfuse_emu_probe_cp_async(const void *src, uint8_t *out);
/* A warp whose lanes >= active_lanes have exited before a __shfl_xor_sync: must fail. */
int32_t tpfuse_emu_probe_partial_warp(int32_t active_lanes);
/* One thread makes one 16-byte global access `offset` bytes into a 256-byte-aligned buffer:
 * a load (kind 0), a store (1) or a cp.async source (2). Must fail with
 * cudaErrorMisalignedAddress unless offset is a multiple of 16. */
int32_t tpfuse_emu_probe_global_access(int32_t kind, int32_t offset);
/* Thread 0 writes one element through a plain pointer at `index` of 64 bytes of dynamic shared
 * memory (kind 0) or of a 16-float __shared__ array (kind 1): past the end, the launch fails
 * (cudaErrorIllegalAddress) when the block ends. */
int32_t tpfuse_emu_probe_shared_write(int32_t kind, int32_t index);
/* A launch of `threads` threads asking for `smem_bytes` of dynamic shared memory, with the
 * opt-in attribute set first when `opt_in`: returns what the launch returned. */
int32_t tpfuse_emu_probe_smem_launch(int32_t threads, size_t smem_bytes, int32_t opt_in);
/* `blocks` blocks of 1024 threads; every block but the last spins, without a deadline, until
 * the last block has set a flag: a deadlock when the last block cannot become resident. */
int32_t tpfuse_emu_probe_wait_for_last_block(int32_t blocks, void *stream);

/* Another stream's kernel: enqueues on `stream` a launch of `sms` blocks, each holding a whole
 * SM (all its shared memory) for `ns` of virtual time from when it starts, so that launches
 * made meanwhile find `sms` fewer SMs (what an engine's kernel, NCCL's, or an MPS neighbour's
 * does to a GPU). Returns the launch's error. */
int32_t tpfuse_emu_occupy_sms(void *stream, int32_t sms, uint64_t ns);

/* Litmus tests of the PTX memory model (cuda/emu/litmus.cpp), for the weak-memory modes. */
#define TPFUSE_EMU_LITMUS_MP 0   /* T0: x = 1; flag = 1.  T1: r0 = flag; r1 = x */
#define TPFUSE_EMU_LITMUS_SB 1   /* T0: x = 1; r0 = y.  T1: y = 1; r1 = x (fence.sc between) */
#define TPFUSE_EMU_LITMUS_LB 2   /* T0: r0 = x; y = 1.  T1: r1 = y; x = 1 */
#define TPFUSE_EMU_LITMUS_CORR 3 /* T0: x = 1.  T1: r0 = x; r1 = x (strong) */
#define TPFUSE_EMU_LITMUS_WRC 4  /* T0: x = 1.  T1: r0 = x; y = 1.  T2: r1 = y; r2 = x */
#define TPFUSE_EMU_LITMUS_IRIW 5 /* T0: x = 1.  T1: y = 1.  T2: r0 = x; r1 = y.  T3: r2 = y; r3 = x */
/* Kernel boundary, two launches on two streams, T1's starting after T0's completed (ordered by an
 * event in variant 0, by nothing in variant 1; placement 1 only), on x's 16-bit halves lo and hi.
 * T0: lo = 1.  T1: r0 = lo; hi = 2; lo = 2.  Then r1 = (lo == 1): T0's write landed last. */
#define TPFUSE_EMU_LITMUS_KB 6
/* Runs litmus test `test` `runs` times; outcomes[k] (16 counters) counts the runs whose
 * registers r_i were non-zero exactly for the bits i of k. variant 0: synchronised as the model
 * requires (release/acquire, fence.sc); 1: not (relaxed, no fence); 2: synchronised at a scope
 * that does not include the other thread. placement 0: each thread a block of one launch on
 * one GPU (scopes .gpu, narrow .cta); 1: each thread its own launch on its own virtual GPU
 * (scopes .sys, narrow .gpu). Returns 0, or the first failed launch's error with its message
 * in `error` (NUL-terminated, truncated to error_cap). */
int32_t tpfuse_emu_litmus(int32_t test, int32_t variant, int32_t placement, uint32_t runs, uint32_t *outcomes,
                          char *error, size_t error_cap);

#ifdef __cplusplus
}
#endif

#endif /* TPFUSE_EMU_H */
