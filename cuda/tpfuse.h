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

#ifdef __cplusplus
}
#endif

#endif /* TPFUSE_H */
