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

/* How many kernels (instantiations) this build holds. */
int32_t tpfuse_kernel_count(void);

/*
 * The handles (CUfunction, from cudaGetFuncBySymbol) of every kernel in the context current on
 * this thread, in functions[0 .. tpfuse_kernel_count()). Under CUDA's lazy loading (the default
 * since CUDA 12.2) a handle may be partly loaded, and a kernel's first use may then wait for
 * everything running in the context: cuFuncLoad on each handle loads them all now (what the
 * Rust side does when it builds a group; kernel_list.cuh says why). Returns a cudaError_t:
 * cudaErrorInvalidValue when `functions` is NULL or `capacity` is smaller than the count.
 */
int tpfuse_kernel_functions(void **functions, int32_t capacity);

/* out[0] = abc[0] * abc[1] + abc[2] as written (a multiply, then an add: two roundings),
 * out[1] = fmaf(abc[0], abc[1], abc[2]) (one rounding), on `stream`: how the kernels' floating
 * point is compiled (no implicit contraction; fp_contraction.cu). abc: 3 floats, out: 2, device
 * memory. */
int tpfuse_fp_contraction_probe(const float *abc, float *out, void *stream);


/* ---------------------------------------------------------------------------------------
 * Custom all-reduce over symmetric memory (cuda/all_reduce.cu).
 *
 * Every rank of a group owns, in memory every other rank can address (CUDA IPC, peer
 * access, or one GPU for virtual ranks):
 *   - a data buffer of 2 * capacity bytes: staging at offset 0 (each rank's input is copied
 *     there by its own kernel), result at offset capacity (two-shot's reduced slices, the
 *     one-shot's RMSNorm partials);
 *   - a signal pad of TPFUSE_SIGNAL_PAD_BYTES, zeroed once at creation:
 *       uint32 flags[TPFUSE_MAX_BLOCKS][TPFUSE_MAX_RANKS]  flag[b][src]: the last barrier
 *                                                         value block b of rank src reached
 *       uint32 counters[TPFUSE_MAX_BLOCKS]                 barriers block b of this rank has
 *                                                         passed (its epoch)
 *       uint32 error                                       0, or TPFUSE_ERROR_* | peer
 *       uint32 grid_count, grid_generation                 the barrier of one rank's blocks
 *                                                         (one-shot RMSNorm), barrier.cuh
 *       uint32 finishing (at +12)                          blocks of this rank's collective
 *                                                         launch that finished (back to 0 once
 *                                                         all have)
 *       uint32 finished_count (at +16)                     collective launches this rank finished
 *       uint32 finished[TPFUSE_MAX_RANKS] (at +32)         finished[src]: collective launches
 *                                                         rank src finished (barrier.cuh,
 *                                                         "Finished launches")
 *       (padding to 256 bytes)
 *       uint32 descriptors[TPFUSE_MAX_BLOCKS][TPFUSE_MAX_RANKS]  descriptors[b][src]: what
 *                                                         block b of rank src launched last
 *                                                         (a hash of the kernel, its sizes
 *                                                         and its grid), compared at the
 *                                                         first barrier of every launch
 *       uint64 fused_epoch; uint32 fused_done             the fused GEMM kernels' launch epoch
 *                                                         (one count for every fused kind) and
 *                                                         their blocks' end count
 *       uint32 slice_count (at +16)                       two-shot GEMM + all-reduce: tiles of
 *                                                         the rank's rows reduced
 *       uint32 gather_count (at +20)                      all-gather + GEMM: this rank's blocks
 *                                                         that pushed their part (back to 0 once
 *                                                         all have)
 *       uint64 slice_flags[TPFUSE_MAX_RANKS] (at +64)     slice_flags[src]: rank src's reduced
 *                                                         rows are ready (a flag as tile_flags')
 *       uint64 gather_flags[TPFUSE_MAX_RANKS] (at +128)   gather_flags[src]: every part of rank
 *                                                         src's all-gather + GEMM input is here
 *                                                         (a flag as tile_flags')
 *       (padding to 256 bytes)
 *       uint32 strip_counts[TPFUSE_MAX_FUSED_TILES]       tiles of a row strip reduced (RMSNorm)
 *       uint64 tile_flags[TPFUSE_MAX_FUSED_TILES][TPFUSE_MAX_RANKS]  tile_flags[s][src]: rank
 *                                                         src's unit s is ready (block s's
 *                                                         partial tiles of GEMM + all-reduce /
 *                                                         reduce-scatter, or its tile s when
 *                                                         k splits in parallel):
 *                                                         epoch (40 bits) << 24 |
 *                                                         descriptor (24 bits)
 *       uint64 strip_flags[TPFUSE_MAX_FUSED_TILES]        strip_flags[s]: row strip s of this
 *                                                         rank's GEMM + all-reduce output is
 *                                                         reduced (RMSNorm; a flag as
 *                                                         tile_flags')
 *       uint64 phases[TPFUSE_MAX_PHASE_BLOCKS][TPFUSE_PHASE_FIELDS]  phases[b]: where block b
 *                                                         of this rank's last fused GEMM launch
 *                                                         spent its time (diagnostics, below)
 *       uint32 part_counts[TPFUSE_MAX_FUSED_TILES]        the fused kernels' split of k in
 *                                                         parallel: tile t's parts stored and
 *                                                         folded (gemm_split.cuh; back to 0
 *                                                         once the tile's parts are folded)
 *       uint64 started[TPFUSE_MAX_RANKS] (256-aligned)    started[src]: the last fused launch
 *                                                         rank src started (a flag as
 *                                                         tile_flags')
 *       uint64 packets[2][TPFUSE_PACKET_HALF_BYTES / 8]   (256-aligned) the one-shot GEMM +
 *                                                         all-reduce's and the one-shot
 *                                                         all-reduce's packets at decode sizes,
 *                                                         half (epoch & 1): [src][bytes / 4],
 *                                                         each 4 bytes of data and a tag, 0
 *                                                         when consumed (packets.cuh)
 *   (cuda/fused_flags.cuh explains the fused words)
 * The kernels never reset flags: every barrier waits for a larger value (epochs), so the
 * same launch can be replayed from a CUDA graph.
 *
 * A launch that does not complete (a peer timed out, the ranks launched different things,
 * or the group was poisoned before it started) writes TPFUSE_FAILED_OUTPUT_BITS16 into
 * every 16 bits of every output element its failed blocks were responsible for (`out`, and
 * `residual` when given), and its error word into this rank's host-mapped error word
 * (tpfuse_group_args.host_error), which the host can read at any time without waiting.
 * --------------------------------------------------------------------------------------- */

/* The phase records of the fused GEMM kernels (cuda/phase_clock.cuh): every block b <
 * TPFUSE_MAX_PHASE_BLOCKS of a fused launch stores, at its end, uint64 fields at these indices
 * of phases[b] in its rank's pad: the launch's epoch (fused_epoch + 1), %globaltimer at the
 * block's start and end (ns), the tiles it computed (the parts of tiles, with a split of k in
 * parallel), and the nanoseconds it spent computing them (GEMM), publishing its flags (the
 * all-gather: pushing its rows and counting them), waiting for other ranks' flags, reducing
 * its tiles (and their epilogue, strip or slice counts), and after that (the dealt RMSNorm
 * rows, the two-shot's gather). Plain stores, for the host to read once the launch is done; a
 * later launch overwrites them. */
#define TPFUSE_MAX_PHASE_BLOCKS 1024
#define TPFUSE_PHASE_FIELDS 9
#define TPFUSE_PHASE_EPOCH 0
#define TPFUSE_PHASE_START_NS 1
#define TPFUSE_PHASE_END_NS 2
#define TPFUSE_PHASE_TILES 3
#define TPFUSE_PHASE_GEMM_NS 4
#define TPFUSE_PHASE_PUBLISH_NS 5
#define TPFUSE_PHASE_WAIT_NS 6
#define TPFUSE_PHASE_REDUCE_NS 7
#define TPFUSE_PHASE_TAIL_NS 8

#define TPFUSE_MAX_RANKS 8
#define TPFUSE_MAX_BLOCKS 64
#define TPFUSE_MAX_FUSED_TILES 4096
#define TPFUSE_SIGNAL_FLAGS_OFFSET 0
#define TPFUSE_SIGNAL_COUNTERS_OFFSET (4 * TPFUSE_MAX_BLOCKS * TPFUSE_MAX_RANKS)
#define TPFUSE_SIGNAL_ERROR_OFFSET (TPFUSE_SIGNAL_COUNTERS_OFFSET + 4 * TPFUSE_MAX_BLOCKS)
#define TPFUSE_SIGNAL_GRID_COUNT_OFFSET (TPFUSE_SIGNAL_ERROR_OFFSET + 4)
#define TPFUSE_SIGNAL_GRID_GENERATION_OFFSET (TPFUSE_SIGNAL_ERROR_OFFSET + 8)
#define TPFUSE_SIGNAL_FINISHING_OFFSET (TPFUSE_SIGNAL_ERROR_OFFSET + 12)
#define TPFUSE_SIGNAL_FINISHED_COUNT_OFFSET (TPFUSE_SIGNAL_ERROR_OFFSET + 16)
#define TPFUSE_SIGNAL_FINISHED_OFFSET (TPFUSE_SIGNAL_ERROR_OFFSET + 32)
#define TPFUSE_SIGNAL_DESCRIPTORS_OFFSET (TPFUSE_SIGNAL_ERROR_OFFSET + 256)
#define TPFUSE_SIGNAL_FUSED_EPOCH_OFFSET (TPFUSE_SIGNAL_DESCRIPTORS_OFFSET + 4 * TPFUSE_MAX_BLOCKS * TPFUSE_MAX_RANKS)
#define TPFUSE_SIGNAL_FUSED_DONE_OFFSET (TPFUSE_SIGNAL_FUSED_EPOCH_OFFSET + 8)
#define TPFUSE_SIGNAL_SLICE_COUNT_OFFSET (TPFUSE_SIGNAL_FUSED_EPOCH_OFFSET + 16)
#define TPFUSE_SIGNAL_GATHER_COUNT_OFFSET (TPFUSE_SIGNAL_FUSED_EPOCH_OFFSET + 20)
#define TPFUSE_SIGNAL_SLICE_FLAGS_OFFSET (TPFUSE_SIGNAL_FUSED_EPOCH_OFFSET + 64)
#define TPFUSE_SIGNAL_GATHER_FLAGS_OFFSET (TPFUSE_SIGNAL_FUSED_EPOCH_OFFSET + 128)
#define TPFUSE_SIGNAL_STRIP_COUNTS_OFFSET (TPFUSE_SIGNAL_FUSED_EPOCH_OFFSET + 256)
#define TPFUSE_SIGNAL_TILE_FLAGS_OFFSET (TPFUSE_SIGNAL_STRIP_COUNTS_OFFSET + 4 * TPFUSE_MAX_FUSED_TILES)
#define TPFUSE_SIGNAL_STRIP_FLAGS_OFFSET (TPFUSE_SIGNAL_TILE_FLAGS_OFFSET + 8 * TPFUSE_MAX_FUSED_TILES * TPFUSE_MAX_RANKS)
#define TPFUSE_SIGNAL_PHASES_OFFSET (TPFUSE_SIGNAL_STRIP_FLAGS_OFFSET + 8 * TPFUSE_MAX_FUSED_TILES)
#define TPFUSE_SIGNAL_PART_COUNTS_OFFSET (TPFUSE_SIGNAL_PHASES_OFFSET + 8 * TPFUSE_PHASE_FIELDS * TPFUSE_MAX_PHASE_BLOCKS)
#define TPFUSE_SIGNAL_STARTED_OFFSET \
  ((TPFUSE_SIGNAL_PART_COUNTS_OFFSET + 4 * TPFUSE_MAX_FUSED_TILES + 255) / 256 * 256)
#define TPFUSE_SIGNAL_PACKETS_OFFSET (TPFUSE_SIGNAL_STARTED_OFFSET + 256)
/* Bytes of each half of the packet area: the most tpfuse_group_args.packet_bytes offers. */
#define TPFUSE_PACKET_HALF_BYTES (1024 * 1024)
#define TPFUSE_SIGNAL_PAD_BYTES (TPFUSE_SIGNAL_PACKETS_OFFSET + 2 * TPFUSE_PACKET_HALF_BYTES)


/* Error word values. TIMEOUT | p: rank p did not arrive before the deadline. MISMATCH | p |
 * (q << 16): ranks p and q launched different kernels, sizes, epilogues or grids (q noticed).
 * GRID_TIMEOUT | r: the blocks of rank r's launch did not all meet before the deadline (they
 * were not all resident at once). The pad's error word is sticky: nothing clears it, and the
 * barriers' epochs, descriptors, grid count, the fused kernel's epoch, end count, strip
 * counts, slice count, part counts and gather count are only consistent while it is 0 (a
 * launch that fails leaves them as they are); a group whose word is set is rebuilt, never
 * reset. */
#define TPFUSE_ERROR_PEER_TIMEOUT 0x100
#define TPFUSE_ERROR_PEER_MISMATCH 0x200
#define TPFUSE_ERROR_GRID_TIMEOUT 0x400

/* What a failed launch leaves in its outputs: every 16 bits of an element hold this. It is a
 * quiet NaN with the sign set and a payload of tpfuse's own in f32 (0xFFD5FFD5), f16 and
 * bf16 (0xFFD5), distinct from the NaN a GPU's arithmetic and conversions produce (the
 * canonical 0x7FFFFFFF, 0x7FFF) and from a CPU's default NaN (0x7FC00000, 0x7E00, 0x7FC0). */
#define TPFUSE_FAILED_OUTPUT_BITS16 0xFFD5

/* Algorithms. ONE_SHOT_PACKETS: the one-shot by packets where they fit (tpfuse_all_reduce),
 * else the one-shot by flags (ONE_SHOT). */
#define TPFUSE_ALGO_ONE_SHOT 0
#define TPFUSE_ALGO_TWO_SHOT 1
#define TPFUSE_ALGO_ONE_SHOT_PACKETS 2

/* The buffers of every rank, as this rank addresses them. */
typedef struct tpfuse_peers {
  void *data[TPFUSE_MAX_RANKS];
  uint32_t *signals[TPFUSE_MAX_RANKS];
} tpfuse_peers;

/* Who this rank is and how long it waits. A rank's custom launches on one group (collectives
 * and fused kernels alike) run one after another: one stream, or a chain of a CUDA graph's
 * edges, never two at once (the pad's epochs and counts assume it; barrier.cuh). */
typedef struct tpfuse_group_args {
  int32_t rank;
  int32_t world;       /* 2 ..= TPFUSE_MAX_RANKS */
  int32_t blocks;      /* grid size, 1 ..= TPFUSE_MAX_BLOCKS, the same on every rank */
  uint64_t capacity;   /* bytes of staging (and of result) per rank; equal on every rank */
  uint64_t timeout_ns; /* one deadline per launch: launch start + timeout_ns bounds its waits
                          (the two-shot GEMM + all-reduce's slice waits: twice that) */
  /* The backstop of the deadline in SM clock cycles (clock64), in case %globaltimer stalls
   * or jumps: 4 x timeout_ns at the device's peak clock, so it never ends a wait before the
   * timer's deadline would have at any clock up to the peak. */
  uint64_t backstop_cycles;
  /* This rank's error word in mapped host memory (device address), or NULL: a failed launch
   * stores its error word there, where the host reads it without synchronising. */
  uint32_t *host_error;
  /* Bytes of each half of the packet area the one-shot kernels may use (0 ..=
   * TPFUSE_PACKET_HALF_BYTES, else cudaErrorInvalidValue; 0: never): the GEMM + all-reduce
   * exchanges its partial tiles as packets when world * m * n * 4 <= packet_bytes
   * (tpfuse_gemm_all_reduce), the all-reduce asked for TPFUSE_ALGO_ONE_SHOT_PACKETS its input
   * when 2 * world * its bytes <= packet_bytes (tpfuse_all_reduce). Equal on every rank. */
  uint64_t packet_bytes;
} tpfuse_group_args;

/*
 * out = sum over ranks of input (rank order, f32, rounded to the element type), then
 *   h = out + bias[col] + residual  (in f32, rounded once), residual := h when given,
 *   out = rmsnorm(h) * gamma          when gamma is given (h stays in residual/out first).
 * rows x hidden elements (hidden is the row length; rows = 1 and hidden = len for a flat
 * all-reduce). bias, residual, gamma may be NULL. Checked before anything is launched
 * (cudaErrorInvalidValue, nothing launched, nothing written): rows, hidden >= 1; the input
 * fits in capacity (rows * hidden * sizeof(T) <= capacity, computed without overflow); input,
 * out and the non-NULL bias, residual, gamma are 16-byte aligned; with bias or gamma, hidden
 * is a multiple of 16 / sizeof(T). bias, residual and gamma must hold the same values on
 * every rank (two-shot computes each slice with its owner's copy), and so must eps when
 * gamma is given (checked: eps's bits are part of the descriptor the first barrier compares,
 * so ranks with different eps get TPFUSE_ERROR_PEER_MISMATCH). TPFUSE_ALGO_ONE_SHOT_PACKETS
 * goes by packets (no barrier: each rank stores its input, 4 bytes and a tag in 8, into every
 * rank's signal pad, and reduces from its own) where the message is whole 16-byte vectors,
 * 2 * world * rows * hidden * sizeof(T) <= group->packet_bytes and, with gamma, hidden <=
 * 1024 * 16 / sizeof(T) (two RMSNorm segments); else it is TPFUSE_ALGO_ONE_SHOT (by flags).
 * The same bits either way. Every rank must ask for the same: a rank by packets and one by
 * flags wait for what the other never sends, until the one by flags, whose barrier stalls,
 * finds the other's fused launch started: TPFUSE_ERROR_PEER_MISMATCH on both, as for any
 * custom collective one rank launched where another launched a fused kernel.
 * One-shot by packets, and by flags with gamma, is a cooperative launch (every block resident
 * at once, or cudaErrorCooperativeLaunchTooLarge before anything runs). Returns a cudaError_t;
 * the outcome of the waits is in this rank's error word.
 */
int tpfuse_all_reduce(tpfuse_dtype dtype, int32_t algo, const tpfuse_peers *peers,
                      const tpfuse_group_args *group, const void *input, const void *bias,
                      void *residual, const void *gamma, float eps, void *out, size_t rows,
                      size_t hidden, void *stream);

/* out[r * len .. (r + 1) * len] = input of rank r (bytes). Checked before anything is
 * launched (cudaErrorInvalidValue): len a multiple of 16, len <= capacity, input and out
 * 16-byte aligned. */
int tpfuse_all_gather(const tpfuse_peers *peers, const tpfuse_group_args *group,
                      const void *input, void *out, size_t len_bytes, void *stream);

/* out = (sum over ranks of input)[rank * len .. (rank + 1) * len], input of world * len.
 * Checked before anything is launched (cudaErrorInvalidValue): a valid dtype; the staging
 * holds the whole input (world * len * sizeof(T) <= capacity, computed without overflow);
 * len a multiple of 16 / sizeof(T); input and out 16-byte aligned. */
int tpfuse_reduce_scatter(tpfuse_dtype dtype, const tpfuse_peers *peers,
                          const tpfuse_group_args *group, const void *input, void *out,
                          size_t len, void *stream);

/* Standalone RMSNorm of rows x hidden, in place allowed (x == out): the same arithmetic as
 * the fused epilogue, so fused and unfused give the same bits. hidden is a multiple of
 * 16 / sizeof(T) and x, gamma, out are 16-byte aligned (cudaErrorInvalidValue otherwise). */
int tpfuse_rms_norm(tpfuse_dtype dtype, const void *x, const void *gamma, float eps, void *out,
                    size_t rows, size_t hidden, void *stream);

/* out = h = x (+ bias[col]) (+ residual), in f32 rounded once; residual := h when given.
 * The element-wise epilogue of the fused all-reduce, standalone (same bits). */
int tpfuse_bias_residual(tpfuse_dtype dtype, const void *x, const void *bias, void *residual,
                         void *out, size_t rows, size_t hidden, void *stream);

/* One rank's masked lookup of the vocabulary-parallel embedding (f16, bf16): for each of the
 * m tokens, out[i, :] = table[ids[i] - row_begin, :] when ids[i] < vocab and row_begin <=
 * ids[i] < row_begin + rows; -0.0 (the additive identity, so the ranks' sum is the owner's
 * row bit for bit, NaN entries aside) when ids[i] < vocab is another rank's; NaN when ids[i] >= vocab.
 * table [rows, hidden], ids [m], out [m, hidden]; hidden a multiple of 8, table and out
 * 16-byte aligned, ids 4-byte aligned (cudaErrorInvalidValue otherwise, and for f32). */
int tpfuse_vocab_embedding(tpfuse_dtype dtype, const void *table, const uint32_t *ids, void *out,
                           size_t m, size_t hidden, uint64_t row_begin, uint64_t rows,
                           uint64_t vocab, void *stream);

/* Threads per block of every all-reduce and RMSNorm kernel (fixed: it fixes the order of
 * the RMSNorm sum of squares). */
#define TPFUSE_ALL_REDUCE_THREADS 512

/* ---------------------------------------------------------------------------------------
 * GEMM (cuda/gemm.cu, cuda/gemm_sm80.cuh, cuda/gemm_epilogue.cuh).
 *
 * C[m,n] = A[m,k] * B[n,k]^T (+ bias[n]) (+ residual[m,n]), row-major, f16 or bf16 (A, B,
 * bias, residual and C of one type), f32 accumulation, rounded once to the type. B is a
 * PyTorch weight [out_features, in_features].
 *
 * Batch invariance: k is cut into S parts, S = tpfuse_gemm_split_parts(n, k, SMs) (never a
 * function of m); every configuration accumulates each output with one chain of
 * mma.sync.m16n8k16 per part, over the part's k in ascending steps of 16 from zero, adds the
 * parts' chains in ascending order in f32, then runs the same epilogue, so a row of C has the
 * same bits whatever m is and whichever path or configuration runs (gemm_sm80.cuh).
 * --------------------------------------------------------------------------------------- */

/* Paths (what tpfuse_gemm_describe reports). Values are part of the ABI. */
#define TPFUSE_GEMM_PATH_NONE 0
#define TPFUSE_GEMM_PATH_SM80_SMALL_M 1 /* mma.sync, m <= TPFUSE_GEMM_SMALL_M_MAX, sm_80+ */
#define TPFUSE_GEMM_PATH_SM80_TILED 2   /* mma.sync, cp.async multistage tiles, sm_80+ */
/* 3 is reserved for a future sm_90a wgmma/TMA path behind the same entry point. */

/* The largest m the automatic choice sends to the small-m path. */
#define TPFUSE_GEMM_SMALL_M_MAX 16

/* The largest m whose parts of k run in parallel (a block per part of a tile, through the
 * caller's scratch: tpfuse_gemm_scratch); larger m runs a tile's parts in its own block. */
#define TPFUSE_GEMM_SPLIT_PARALLEL_M_MAX 64

/* Tile configurations (block_m x block_n). AUTO lets tpfuse_gemm choose by device and shape;
 * the others force one (for tests and benchmarks). Every one is valid for every shape, except
 * TILE_128X128 where k splits (tpfuse_gemm_split_parts > 1): cudaErrorInvalidValue. */
#define TPFUSE_GEMM_CONFIG_AUTO (-1)
#define TPFUSE_GEMM_CONFIG_SMALL_16X16 0
#define TPFUSE_GEMM_CONFIG_SMALL_16X32 1
#define TPFUSE_GEMM_CONFIG_SMALL_16X64 2
#define TPFUSE_GEMM_CONFIG_TILE_64X64 3
#define TPFUSE_GEMM_CONFIG_TILE_128X128 4
#define TPFUSE_GEMM_CONFIG_COUNT 5

/* What a configuration is. */
typedef struct tpfuse_gemm_config_info {
  int32_t path; /* TPFUSE_GEMM_PATH_* */
  int32_t block_m;
  int32_t block_n;
  int32_t block_k;
  int32_t stages;     /* cp.async pipeline depth (k-slices of block_k in shared memory) */
  int32_t threads;    /* per block */
  int32_t smem_bytes; /* dynamic shared memory per block */
} tpfuse_gemm_config_info;

/*
 * dtype:    TPFUSE_DTYPE_F16 or TPFUSE_DTYPE_BF16 (f32: cudaErrorInvalidValue)
 * config:   TPFUSE_GEMM_CONFIG_AUTO, or a TPFUSE_GEMM_CONFIG_* to force
 * a:        [m, k];  b: [n, k];  bias: [n] or NULL;  residual: [m, n] or NULL;  c: [m, n]
 * m:        any (0 launches nothing);  n, k: positive multiples of 8;  m, n, k <= 2^30
 * Every pointer 16-byte aligned. c must not overlap a, b or bias; residual may be c exactly
 * (c += a * b^T (+ bias)) and must not otherwise overlap c.
 * Returns a cudaError_t: cudaErrorNoKernelImageForDevice on compute capability < 8.0 (nothing
 * launched); invalid shapes or pointers are rejected without a launch as a backstop (the Rust
 * side validates first).
 */
int tpfuse_gemm(tpfuse_dtype dtype, int32_t config, const void *a, const void *b, const void *bias,
                const void *residual, void *c, size_t m, size_t n, size_t k, void *stream);

/* tpfuse_gemm, with a scratch for the parallel split of k: when the shape's split has S > 1
 * parts, m <= TPFUSE_GEMM_SPLIT_PARALLEL_M_MAX and scratch_bytes >= tpfuse_gemm_scratch_bytes,
 * a block runs each part of each tile and the parts are folded in order, each by the block
 * that finds it ready, normally its own (more SMs stream the weight; the same bits), with the
 * configurations AUTO chooses where k splits (SMALL_16X64, TILE_64X64; a forced SMALL_16X16 or
 * SMALL_16X32 runs each tile's parts in its block). scratch: 16-byte aligned, zeroed before its
 * first use, used by one stream at a time (not by two branches of one CUDA graph either). Calls
 * of any shape may share it: every launch leaves its tiles' words (its first 16 KiB) back at
 * zero; zero it again after a launch that failed. NULL, or too small: each tile's block runs
 * its parts one after another. */
int tpfuse_gemm_scratch(tpfuse_dtype dtype, int32_t config, const void *a, const void *b, const void *bias,
                        const void *residual, void *c, size_t m, size_t n, size_t k, void *scratch,
                        size_t scratch_bytes, void *stream);

/* The configuration tpfuse_gemm(AUTO) runs for this shape on a device of compute capability
 * cc_major.cc_minor with sm_count SMs, or -1 when that device has no GEMM path. */
int32_t tpfuse_gemm_select(size_t m, size_t n, size_t k, int32_t cc_major, int32_t cc_minor,
                           int32_t sm_count);

/* The parts S of k for an [n, k] weight on a device of sm_count SMs (1: no split). */
int32_t tpfuse_gemm_split_parts(size_t n, size_t k, int32_t sm_count);

/* The scratch tpfuse_gemm_scratch needs to run the parts of this shape in parallel on a device
 * of sm_count SMs, in bytes; 0 when it would not (S = 1, or m past
 * TPFUSE_GEMM_SPLIT_PARALLEL_M_MAX). */
size_t tpfuse_gemm_scratch_bytes(size_t m, size_t n, size_t k, int32_t sm_count);

/* Fills *info for a TPFUSE_GEMM_CONFIG_* (not AUTO). Returns 0, or cudaErrorInvalidValue. */
int tpfuse_gemm_describe(int32_t config, tpfuse_gemm_config_info *info);

/* The same for what the fused kernels (tpfuse_gemm_all_reduce, tpfuse_all_gather_gemm, ...) run
 * when given that configuration: the same tiles (so the same bits), TPFUSE_GEMM_CONFIG_TILE_64X64
 * with 64-deep k-slices. */
int tpfuse_gemm_describe_fused(int32_t config, tpfuse_gemm_config_info *info);

/* ---------------------------------------------------------------------------------------
 * The row-parallel layer in one launch per rank (cuda/gemm_all_reduce.cu): this rank's partial
 * p = x * w^T ([m, k] x [n, k]^T, f32 accumulation, rounded to T as tpfuse_gemm rounds it),
 * then out = tpfuse_all_reduce's one-shot result of every rank's p with the epilogue (bias,
 * residual, gamma, eps; rows = m, hidden = n): the same bits as tpfuse_gemm followed by
 * tpfuse_all_reduce (either algorithm), on every rank.
 *
 * dtype:   TPFUSE_DTYPE_F16 or TPFUSE_DTYPE_BF16
 * config:  a TPFUSE_GEMM_CONFIG_* tile configuration (not AUTO: the caller resolves it with
 *          tpfuse_gemm_select, so that every rank runs the same one)
 * blocks:  the persistent grid's size bound (1 ..= the blocks that fit on the device at once,
 *          tpfuse_gemm_all_reduce_blocks_per_sm x the SMs, divided among the virtual ranks
 *          sharing it); the same on every rank. The launch is
 *          cooperative (every block resident at once): it starts once the whole grid fits,
 *          however many SMs other kernels hold meanwhile, and a grid past what the device
 *          holds at once is refused, cudaErrorCooperativeLaunchTooLarge, before anything runs
 * x [m, k], w [n, k], bias [n] or NULL, residual [m, n] or NULL, gamma [n] or NULL, out [m, n]
 * m >= 1; n, k positive multiples of 8; m * n * sizeof(T) <= capacity / 2; at most
 * TPFUSE_MAX_FUSED_TILES tiles of the configuration. Every pointer 16-byte aligned; out and
 * residual overlap nothing. Returns a cudaError_t; the outcome of the waits is in this rank's
 * error word, and a launch that does not complete marks out and residual failed, as
 * tpfuse_all_reduce does.
 * The split of k is tpfuse_gemm's (tpfuse_gemm_split_parts on the current device, S parts).
 * When S > 1, m <= TPFUSE_GEMM_SPLIT_PARALLEL_M_MAX, S * m * n * 4 <= capacity and the
 * configuration is one that tpfuse_gemm_select gives a split (SMALL_16X64, TILE_64X64), the
 * grid's units are the parts of the tiles (min(tiles * S, blocks) blocks), each part's f32 partial in
 * this rank's staging half (the first S * m * n * 4 bytes: its contents are lost; no argument
 * may lie there, cudaErrorInvalidValue), folded in order as tpfuse_gemm_scratch folds them;
 * otherwise each tile's block runs its parts one after another (min(tiles, blocks) blocks).
 * The same bits either way.
 * Where world * m * n * 4 <= group->packet_bytes (<= TPFUSE_PACKET_HALF_BYTES, else
 * cudaErrorInvalidValue), the ranks' partial tiles travel as packets through the signal pads'
 * packet areas (two elements and a tag in 64 bits, stored into every rank's pad, awaited in
 * the reduction's own loads): one crossing of the link and no flag; otherwise by flags
 * through the exchange areas. The same bits either way.
 */
int tpfuse_gemm_all_reduce(tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                           const tpfuse_group_args *group, int32_t blocks, const void *x, const void *w,
                           const void *bias, void *residual, const void *gamma, float eps, void *out,
                           size_t m, size_t n, size_t k, void *stream);

/*
 * The blocks of tpfuse_gemm_all_reduce's kernel (also the two-shot's and
 * tpfuse_gemm_reduce_scatter's) for dtype and a TPFUSE_GEMM_CONFIG_* (not AUTO) that one idle
 * SM of the current device holds at once, into *blocks (the occupancy API; 0 when none fits).
 * It opts the kernel in to its shared memory first (a first use of the kernel, which lazy
 * loading may make wait for the context's running kernels: call it when nothing of the group
 * is in flight, as TpGroup does when it is built). A grid of this many blocks on every SM
 * leaves no room for any other kernel: it starts once they are gone. Returns a cudaError_t.
 */
int tpfuse_gemm_all_reduce_blocks_per_sm(tpfuse_dtype dtype, int32_t config, int32_t *blocks);

/*
 * The same contract and bits, two-shot (for larger m): rank r reduces only rows
 * r*m/W .. (r+1)*m/W (its slice, through the bias and residual), then every rank copies every
 * slice's reduced rows into out (and residual) and normalises its rows. Each rank reads
 * (W-1)/W of the peers' partials and (W-1)/W of the reduced rows, where one-shot reads all
 * W-1 partials. m a multiple of world; otherwise as tpfuse_gemm_all_reduce.
 */
int tpfuse_gemm_all_reduce_two_shot(tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                                    const tpfuse_group_args *group, int32_t blocks, const void *x,
                                    const void *w, const void *bias, void *residual, const void *gamma,
                                    float eps, void *out, size_t m, size_t n, size_t k, void *stream);

/*
 * GEMM + reduce-scatter (sequence parallelism), the same kernel: every rank computes its
 * partial p = x * w^T of all m rows, and rank r gets rows r*m/W .. (r+1)*m/W of the sum:
 * out [m / world, n] = (sum over ranks of p, rank order, f32, rounded once)[rank's rows], the
 * bits of tpfuse_gemm followed by tpfuse_reduce_scatter. m a multiple of world; the other
 * arguments and the failure semantics as tpfuse_gemm_all_reduce (no epilogue).
 */
int tpfuse_gemm_reduce_scatter(tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                               const tpfuse_group_args *group, int32_t blocks, const void *x, const void *w,
                               void *out, size_t m, size_t n, size_t k, void *stream);

/*
 * All-gather + GEMM (sequence parallelism): rank r holds x [m / world, k], rows
 * r*m/W .. (r+1)*m/W of the input; out [m, n] = all_gather(x) * w^T (+ bias [n]), the bits of
 * tpfuse_all_gather followed by tpfuse_gemm (same rows, same tiles and epilogue). The GEMM
 * starts on the local rows while the peers' rows arrive. m a multiple of world; the gathered
 * input [m, k] must fit in capacity / 2; the other arguments and the failure semantics as
 * tpfuse_gemm_all_reduce (out is marked failed). The split of k as tpfuse_gemm_all_reduce's:
 * where it runs in parallel (the same rule, and at most TPFUSE_MAX_FUSED_TILES tiles), the
 * grid's units are the parts of the tiles (min(tiles * S, blocks) blocks), their f32 partials
 * in this rank's staging half (no argument may lie there), folded in order; otherwise
 * min(tiles, blocks) blocks. The same bits either way. blocks bounds the grid as there, with
 * tpfuse_all_gather_gemm_blocks_per_sm x the SMs.
 */
int tpfuse_all_gather_gemm(tpfuse_dtype dtype, int32_t config, const tpfuse_peers *peers,
                           const tpfuse_group_args *group, int32_t blocks, const void *x, const void *w,
                           const void *bias, void *out, size_t m, size_t n, size_t k, void *stream);

/* tpfuse_gemm_all_reduce_blocks_per_sm for tpfuse_all_gather_gemm's kernel. */
int tpfuse_all_gather_gemm_blocks_per_sm(tpfuse_dtype dtype, int32_t config, int32_t *blocks);

#ifdef __cplusplus
}
#endif

#endif /* TPFUSE_H */
