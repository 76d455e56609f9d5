// all_reduce_packets.cu: the one-shot all-reduce by packets, for decode-sized messages: no
// barrier, no flag, no read across the link.
//
// The one-shot by flags (all_reduce.cu) stages its input, meets every peer at a barrier (a
// round across GPUs), then reads the peers' stagings across the link (a round trip after the
// barrier). Here block b of each rank stores its share of the input as packets (packets.cuh:
// 32 bits of data and the launch's tag in one 64-bit word) straight into every rank's packet
// half, then reduces the same share from its own pad, each packet awaited in its load: the
// data crosses once and carries its own readiness. The sums are the flag path's (every rank's
// vector added in rank order in f32, then the epilogue: reduce.cuh), and so are the RMSNorm's
// trees and orders (epilogue.cuh): the same bits.
//
// Work. Without RMSNorm a block takes an even share of the message's 16-byte vectors, a
// thread every kThreads-th. With RMSNorm a block takes whole rows (a row is at most two
// segments: one_shot_by_packets) and thread t holds vector t of each segment of a row, so
// the row's sum of squares is the segments' trees from what the threads hold
// (held_sum_of_squares, as the flag path's blocks of whole rows or of one segment do) and no
// block waits for another: no meeting. A thread sends all its vectors before it awaits any.
//
// The launch is of the fused family (fused_flags.cuh): its epoch, the started flags that
// order a half's clears of launch E - 2 before launch E's packets into it, the wait for the
// peers' finished collective launches (fused::begin), and fused::end, which marks the rank's
// out and residual failed when the launch failed anywhere. It touches no staging and no
// result area, only packet halves, so the flag collectives before and after it need nothing
// more from it; it announces no finished collective launch.
#include "all_reduce_packets.cuh"

#include <cstring>

#include "kernel_list.cuh"
#include "packets.cuh"

namespace tpfuse {
namespace {

// The kind a descriptor carries (all_reduce.cu's are 1..9, the fused GEMM kernels' 16..19;
// fused::descriptor_of keeps the low 4 bits: 4, which no other fused kind has).
constexpr uint64_t kKindAllReducePackets = 20;

// What a block exchanges: its vectors sent, and every rank's summed through the epilogue.
template <typename T> struct Exchange {
  const tpfuse_peers &peers;
  const tpfuse_group_args &g;
  const Deadline &deadline;
  fused::BlockState &st;
  size_t part; // packets a source
  uint32_t tag;
  uint64_t descriptor;
  Epilogue<T> epi;

  // Elements i .. i + kLen - 1 of this rank's input, as packets into every rank's half.
  __device__ __forceinline__ void send(const T *input, size_t i) const {
    packets::store_packets<T>(peers, g.world, g.rank, st.epoch, part, tag, i,
                              ld_global(reinterpret_cast<const uint4 *>(input + i)));
  }
  // Their sum over the ranks, through the epilogue, into y; false when the block gives up.
  __device__ __forceinline__ bool sum(size_t i, Vec16<T> &y) const {
    return packets::sum_packet_vector<T>(peers, g, deadline, st, part, tag, descriptor, epi, i, y);
  }
};

// Without RMSNorm: the block's vectors, a thread's every kThreads-th (out may be input: a
// thread reads its vectors before it writes them).
template <typename T> __device__ __forceinline__ void reduce_vectors(const Exchange<T> &x, const T *input, T *out, size_t n) {
  constexpr size_t kVec = Vec16<T>::kLen;
  const Range mine = share(n / kVec, blockIdx.x, gridDim.x);
  for (size_t v = mine.begin + threadIdx.x; v < mine.end; v += kThreads) x.send(input, v * kVec);
  for (size_t v = mine.begin + threadIdx.x; v < mine.end; v += kThreads) {
    Vec16<T> y;
    if (!x.sum(v * kVec, y)) return;
    store16(out + v * kVec, y);
  }
}

// With RMSNorm: the block's rows, thread t holding vector t of each segment (column col(s) =
// s * kSegment + t * kLen, when it lies in the row). The row's sum of squares is 0
// plus each segment's tree in segment order (the flag path's partials, added in that order),
// then the row normalised from what the thread holds. Every thread runs every tree (their
// barriers), a thread that gave up too: its stores are skipped, and fused::end marks the
// outputs failed. A thread parks its sums in shared memory (its own slots: no barrier), so
// that one copy of the packets' loop serves both segments: inlined twice, with the first sum
// held across the second, the kernel took all 128 registers its 512 threads allow, and spilled.
template <typename T>
__device__ __forceinline__ void reduce_rows(const Exchange<T> &x, const T *input, const T *gamma, float eps, T *out,
                                            size_t rows, size_t hidden) {
  constexpr int kSegments = 2;
  TPFUSE_SHARED(Vec16<T>[kSegments * kThreads], parked); // [s * kThreads + t]
  const Range mine = share(rows, blockIdx.x, gridDim.x);
  const auto col = [](int s) { return static_cast<size_t>(s) * kSegment<T> + threadIdx.x * Vec16<T>::kLen; };
  const int segments = static_cast<int>(segments_per_row<T>(hidden));
  for (size_t r = mine.begin; r < mine.end; ++r) {
    for (int s = 0; s < segments; ++s)
      if (col(s) < hidden) x.send(input, r * hidden + col(s));
  }
  bool ok = true;
  for (size_t r = mine.begin; r < mine.end; ++r) {
#pragma unroll 1
    for (int s = 0; s < segments; ++s)
      if (ok && col(s) < hidden) ok = x.sum(r * hidden + col(s), parked[s * kThreads + threadIdx.x]);
    // gamma's vectors issued before the trees, whose barriers hide the load.
    Vec16<T> gam[kSegments];
#pragma unroll
    for (int s = 0; s < kSegments; ++s)
      if (col(s) < hidden) gam[s] = load16(gamma + col(s));
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < kSegments; ++s)
      if (s < segments) sum += held_sum_of_squares(parked[s * kThreads + threadIdx.x], col(s) < hidden);
    const float rstd = rstd_of(sum, hidden, eps);
#pragma unroll
    for (int s = 0; s < kSegments; ++s)
      if (ok && col(s) < hidden)
        store16(out + r * hidden + col(s), normalize_vector(parked[s * kThreads + threadIdx.x], gam[s], rstd));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    one_shot_packets_kernel(const __grid_constant__ tpfuse_peers peers, const __grid_constant__ tpfuse_group_args g,
                            uint64_t descriptor, const T *input, const T *bias, T *residual, const T *gamma,
                            float eps, T *out, size_t rows, size_t hidden) {
  TPFUSE_SHARED(fused::BlockState, st);
  const Deadline deadline(g);
  fused::begin(peers, g, deadline, descriptor, st);
  const size_t n = rows * hidden;
  if (st.failed == 0) {
    const Exchange<T> x{peers, g, deadline, st, n * sizeof(T) / 4, packets::tag_of(st.epoch, descriptor), descriptor,
                        Epilogue<T>{bias, residual, hidden}};
    if (gamma == nullptr) reduce_vectors(x, input, out, n);
    else reduce_rows(x, input, gamma, eps, out, rows, hidden);
  }
  if (fused::end(peers, g, st, false)) {
    mark_failed(out, 0, n);
    mark_failed(residual, 0, n);
  }
}

} // namespace

bool one_shot_by_packets(const tpfuse_group_args &g, size_t element_bytes, size_t rows, size_t hidden, bool norm) {
  const size_t bytes = rows * hidden * element_bytes; // within the staging: the dispatcher checked
  const size_t segment = static_cast<size_t>(kThreads) * (16 / element_bytes);
  return g.packet_bytes != 0 && bytes % 16 == 0 && (!norm || hidden <= 2 * segment) &&
         2 * static_cast<uint64_t>(g.world) * bytes <= g.packet_bytes;
}

template <typename T>
int launch_one_shot_packets(const tpfuse_peers &peers, const tpfuse_group_args &g, int grid, const T *input,
                            const T *bias, T *residual, const T *gamma, float eps, T *out, size_t rows,
                            size_t hidden, cudaStream_t stream) {
  uint32_t eps_bits = 0;
  std::memcpy(&eps_bits, &eps, sizeof eps_bits);
  const uint64_t descriptor = fused::descriptor_of(
      kKindAllReducePackets,
      launch_descriptor({kKindAllReducePackets, Elem<T>::kDtype, rows, hidden, static_cast<uint64_t>(grid),
                         bias != nullptr, residual != nullptr, gamma != nullptr, gamma != nullptr ? eps_bits : 0u}));
  // Cooperative, as every launch whose blocks wait for other blocks (here the peers'): it starts
  // once all its blocks fit, never with some resident and waiting for blocks that cannot start
  // while another kernel holds the SMs (tests/emu_fused_failures.rs).
  return launch_result(TPFUSE_LAUNCH_COOPERATIVE(one_shot_packets_kernel<T>, grid, kThreads, 0, stream)(
      peers, g, descriptor, input, bias, residual, gamma, eps, out, rows, hidden));
}

template int launch_one_shot_packets<float>(const tpfuse_peers &, const tpfuse_group_args &, int, const float *,
                                            const float *, float *, const float *, float, float *, size_t, size_t,
                                            cudaStream_t);
template int launch_one_shot_packets<__half>(const tpfuse_peers &, const tpfuse_group_args &, int, const __half *,
                                             const __half *, __half *, const __half *, float, __half *, size_t,
                                             size_t, cudaStream_t);
template int launch_one_shot_packets<__nv_bfloat16>(const tpfuse_peers &, const tpfuse_group_args &, int,
                                                    const __nv_bfloat16 *, const __nv_bfloat16 *, __nv_bfloat16 *,
                                                    const __nv_bfloat16 *, float, __nv_bfloat16 *, size_t, size_t,
                                                    cudaStream_t);

void all_reduce_packet_kernels(KernelList &list) {
  list.add(one_shot_packets_kernel<float>);
  list.add(one_shot_packets_kernel<__half>);
  list.add(one_shot_packets_kernel<__nv_bfloat16>);
}

} // namespace tpfuse
