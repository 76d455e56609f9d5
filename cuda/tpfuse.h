/*
 * tpfuse.h: the C ABI of every kernel launcher in tpfuse.
 *
 * This header is the single source of truth: build.rs runs bindgen on it, so the Rust
 * declarations in src/ffi cannot drift from the CUDA side. Keep it plain C (no CUDA types):
 * streams travel as `void*` (a CUstream / cudaStream_t), element types as tpfuse_dtype.
 *
 * Every launcher only enqueues work on `stream` and returns a cudaError_t value
 * (0 = success); it never synchronises, allocates or touches host-visible state, so it is
 * CUDA-graph capturable. Arguments are validated on the Rust side before any launch.
 */
#ifndef TPFUSE_H
#define TPFUSE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. Values are part of the ABI. */
typedef int32_t tpfuse_dtype;
#define TPFUSE_DTYPE_F32 0
#define TPFUSE_DTYPE_F16 1
#define TPFUSE_DTYPE_BF16 2

/* The most input buffers one reduce_ranks launch takes. */
#define TPFUSE_MAX_REDUCE_INPUTS 16

/*
 * out[i] = in[0][i] + in[1][i] + ... + in[num_inputs-1][i] for i in [0, len),
 * accumulated in f32 strictly in input order (so every caller that passes the same inputs
 * gets the same bits), then rounded once to the element type (round to nearest even).
 *
 * inputs:     host array of num_inputs device pointers (1 <= num_inputs <= 16)
 * out:        device pointer to len elements; must not overlap any input
 * len:        elements per buffer; 0 launches nothing
 * Uses 16-byte vector loads when every pointer is 16-byte aligned, scalar loads otherwise;
 * both give the same bits.
 */
int tpfuse_reduce_ranks(tpfuse_dtype dtype, const void *const *inputs, int32_t num_inputs,
                        void *out, size_t len, void *stream);

/*
 * Writes NCCL_CONFIG_INITIALIZER of the nccl.h tpfuse was built with into `config` when
 * `size` equals sizeof(ncclConfig_t); returns sizeof(ncclConfig_t) either way.
 */
size_t tpfuse_nccl_config_init(void *config, size_t size);

/* cudaGetErrorString of a code returned by a launcher. Never NULL. */
const char *tpfuse_error_string(int32_t code);

/* CUDART_VERSION the kernels were compiled against, e.g. 13000. */
int32_t tpfuse_cudart_version(void);


/* ---------------------------------------------------------------------------------------
 * Custom all-reduce over symmetric memory (cuda/all_reduce.cu).
 *
 * Every rank of a group owns, in memory every other rank can address (CUDA IPC, peer
 * access, or one GPU for virtual ranks):
 *   - a data buffer of 2 * capacity bytes: staging at offset 0 (each rank's input is copied
 *     there by its own kernel), result at offset capacity (two-shot's reduced slices);
 *   - a signal pad of TPFUSE_SIGNAL_PAD_BYTES, zeroed once at creation:
 *       uint32 flags[TPFUSE_MAX_BLOCKS][TPFUSE_MAX_RANKS]  flag[b][src]: the last barrier
 *                                                         value block b of rank src reached
 *       uint32 counters[TPFUSE_MAX_BLOCKS]                 barriers block b of this rank has
 *                                                         passed (its epoch)
 *       uint32 error                                       0, or TPFUSE_ERROR_* | peer
 * The kernels never reset flags: every barrier waits for a larger value (epochs), so the
 * same launch can be replayed from a CUDA graph.
 * --------------------------------------------------------------------------------------- */

#define TPFUSE_MAX_RANKS 8
#define TPFUSE_MAX_BLOCKS 64
#define TPFUSE_SIGNAL_FLAGS_OFFSET 0
#define TPFUSE_SIGNAL_COUNTERS_OFFSET (4 * TPFUSE_MAX_BLOCKS * TPFUSE_MAX_RANKS)
#define TPFUSE_SIGNAL_ERROR_OFFSET (TPFUSE_SIGNAL_COUNTERS_OFFSET + 4 * TPFUSE_MAX_BLOCKS)
#define TPFUSE_SIGNAL_PAD_BYTES (TPFUSE_SIGNAL_ERROR_OFFSET + 256)

/* Error word values (the low 8 bits name the peer that did not arrive). */
#define TPFUSE_ERROR_PEER_TIMEOUT 0x100

/* Algorithms. */
#define TPFUSE_ALGO_ONE_SHOT 0
#define TPFUSE_ALGO_TWO_SHOT 1

/* The buffers of every rank, as this rank addresses them. */
typedef struct tpfuse_peers {
  void *data[TPFUSE_MAX_RANKS];
  uint32_t *signals[TPFUSE_MAX_RANKS];
} tpfuse_peers;

/* Who this rank is and how long it waits. */
typedef struct tpfuse_group_args {
  int32_t rank;
  int32_t world;       /* 2 ..= TPFUSE_MAX_RANKS */
  int32_t blocks;      /* grid size, 1 ..= TPFUSE_MAX_BLOCKS, the same on every rank */
  uint64_t capacity;   /* bytes of staging (and of result) per rank */
  uint64_t timeout_ns; /* bound on every wait */
} tpfuse_group_args;

/*
 * out = sum over ranks of input (rank order, f32), then optionally
 *   h = out + bias[col] + residual  (in f32, rounded once), residual := h when given,
 *   out = rmsnorm(h) * gamma          when gamma is given (h stays in residual/out first).
 * rows x hidden elements (hidden is the row length; rows = 1 and hidden = len for a flat
 * all-reduce). bias, residual, gamma may be NULL. Every pointer is 16-byte aligned, the
 * input fits in capacity, and with bias or gamma hidden is a multiple of 16 / sizeof(T).
 * Returns a cudaError_t; the outcome of the waits is in this rank's error word.
 */
int tpfuse_all_reduce(tpfuse_dtype dtype, int32_t algo, const tpfuse_peers *peers,
                      const tpfuse_group_args *group, const void *input, const void *bias,
                      void *residual, const void *gamma, float eps, void *out, size_t rows,
                      size_t hidden, void *stream);

/* out[r * len .. (r + 1) * len] = input of rank r (bytes; len a multiple of 16). */
int tpfuse_all_gather(const tpfuse_peers *peers, const tpfuse_group_args *group,
                      const void *input, void *out, size_t len_bytes, void *stream);

/* out = (sum over ranks of input)[rank * len .. (rank + 1) * len], input of world * len. */
int tpfuse_reduce_scatter(tpfuse_dtype dtype, const tpfuse_peers *peers,
                          const tpfuse_group_args *group, const void *input, void *out,
                          size_t len, void *stream);

/* Standalone RMSNorm of rows x hidden, in place allowed (x == out): the same arithmetic as
 * the fused epilogue, so fused and unfused give the same bits. */
int tpfuse_rms_norm(tpfuse_dtype dtype, const void *x, const void *gamma, float eps, void *out,
                    size_t rows, size_t hidden, void *stream);

/* out = h = x (+ bias[col]) (+ residual), in f32 rounded once; residual := h when given.
 * The element-wise epilogue of the fused all-reduce, standalone (same bits). */
int tpfuse_bias_residual(tpfuse_dtype dtype, const void *x, const void *bias, void *residual,
                         void *out, size_t rows, size_t hidden, void *stream);

/* Threads per block of every all-reduce and RMSNorm kernel (fixed: it fixes the order of
 * the RMSNorm sum of squares). */
#define TPFUSE_ALL_REDUCE_THREADS 512

#ifdef __cplusplus
}
#endif

#endif /* TPFUSE_H */
