// packets.cuh: the one-shot exchange at decode sizes, flags in the data: the GEMM +
// all-reduce's partial tiles (gemm_all_reduce.cu, where world * m * n * 4 <=
// tpfuse_group_args.packet_bytes) and the one-shot all-reduce's input (all_reduce_packets.cu,
// where 2 * world * its bytes fit it).
//
// Why. With flags, a consumer waits for a peer's flag (the flag crosses the link after the
// producer's release, which waits for its stores), then loads the peer's partial across the
// link: a round trip after the flag's arrival, on the critical path. A packet carries its
// own readiness: the producer stores its partial straight into every rank's memory, and the
// consumer polls its own memory until the data is there: one crossing.
//
// Packets. A packet is one 64-bit word: 32 bits of the source's data (the partial rounded to
// T, or the all-reduce's input: bytes 4j .. 4j + 3, two 16-bit elements or one f32) in the low
// half, the launch's tag in the high half. tag = 1 << 31 | (E mod 128) << 24 | the launch's 24
// descriptor bits: never 0 (a packet is 0 when nobody wrote it or its consumer cleared it).
// Rank src's packets of launch E lie in half (E & 1) of every rank's packet area (tpfuse.h,
// the pad), at [src][j] (a source's bytes / 4 packets: `part`). A 16-byte vector is four
// packets, 32 bytes.
//
// Producer (store_packets: PacketEpilogue::store8, in place of the exchange area's store, or
// the all-reduce's copy of its input): each thread stores the four packets of a vector into
// every rank's half with st.relaxed.sys.v2.u64
// (two single-copy-atomic 64-bit words each: the PTX ISA models a vector access as one access
// per element). No flag, no fence.
//
// Consumer (sum_packet_vector): for its vector of every rank src, a thread loads the four
// packets from its own pad (ld.relaxed.sys.v2.u64) until each holds the launch's tag, adds the
// ranks' elements in rank order (reduce.cuh's sum_ranks, so the bits of the flag path), stores
// out (or holds the sum), then clears the 32 bytes (weak stores of 0). A word is seen whole (single-copy atomic,
// morally strong: both .sys), so a packet with the tag holds the producer's data: the data
// and its readiness are one write, and nothing needs ordering before it (relaxed suffices).
//
// Why a nonzero packet is this launch's. Every packet written is read and cleared by its
// consumer in the same launch (every rank reduces all of out, and the all-reduce's block b
// reads exactly the vectors block b of every rank stores). A producer writes half
// (E & 1) in launch E only after every rank started launch E - 1 (fused_flags.cuh, "Started
// flags"), so after every rank finished launch E - 2 and its clears of that half; the
// acquire of that flag orders the clears before the new packets. So in launch E the half holds
// 0 or packets of launch E. A nonzero packet with another tag is then a peer that launched
// something else: TPFUSE_ERROR_PEER_MISMATCH at once (the epoch bits also turn a broken
// invariant into that error rather than stale data). The tags need no wide epoch: a stale
// packet never survives its launch.
//
// Failures. A consumer's wait ends at the launch's deadline (TPFUSE_ERROR_PEER_TIMEOUT | src),
// when the rank's error word is set, or when src started this launch with another descriptor
// (a fused peer that exchanges by flags: TPFUSE_ERROR_PEER_MISMATCH; a peer in a collective
// by flags finds this launch's started flag while its barrier stalls and reports the same to
// every rank: barrier.cuh, "A rank in a fused kernel"). It then stores nothing more;
// the launch's end marks the outputs failed (fused_flags.cuh). Packets a failed launch leaves
// uncleared are harmless: the sticky error word stops every later launch of the group.
#pragma once

#include "fused_flags.cuh"
#include "reduce.cuh"

namespace tpfuse {
namespace packets {

// The tag of launch `epoch` with `descriptor` (fused::descriptor_of's 24 bits).
__device__ __forceinline__ uint32_t tag_of(uint64_t epoch, uint64_t descriptor) {
  return 0x80000000u | static_cast<uint32_t>(epoch & 0x7f) << 24 |
         static_cast<uint32_t>(descriptor & fused::kDescriptorMask);
}

// Rank src's packets of the launch in `pad`: the half of `epoch`, m * n / 2 (`part`) a source.
__device__ __forceinline__ uint64_t *source(const Pad &pad, uint64_t epoch, int src, size_t part) {
  return pad.packets(static_cast<int>(epoch & 1)) + static_cast<size_t>(src) * part;
}

// The packet index of element i (a multiple of the vector's length) of a source: 32 bits of
// data a packet (two 16-bit elements, or one f32).
template <typename T> __device__ __forceinline__ size_t packet_index(size_t i) { return i * sizeof(T) / 4; }

// Stores the 16 bytes `raw` (elements i .. i + 7 of this rank's source: four packets) with
// `tag` into every rank's half of launch `epoch`, from the next rank on, so that the ranks'
// stores of a moment spread over the links.
template <typename T>
__device__ __forceinline__ void store_packets(const tpfuse_peers &peers, int world, int rank, uint64_t epoch,
                                              size_t part, uint32_t tag, size_t i, const uint4 &raw) {
  const uint64_t t = static_cast<uint64_t>(tag) << 32;
  const Words2 first{t | raw.x, t | raw.y}, second{t | raw.z, t | raw.w};
  const size_t at = packet_index<T>(i);
  for (int j = 1; j <= world; ++j) {
    const int p = (rank + j) % world;
    uint64_t *dst = source(Pad{peers.signals[p]}, epoch, rank, part) + at;
    st_relaxed_sys_v2(dst, first);
    st_relaxed_sys_v2(dst + 2, second);
  }
}

// The GEMM's epilogue in a packet launch: the tile's partial, rounded once to T (the flag
// path's StagingEpilogue bits), as packets into every rank's half, this rank's source.
template <typename T> struct PacketEpilogue {
  const tpfuse_peers *peers;
  int world, rank, n;
  uint64_t epoch;
  size_t part;
  uint32_t tag;

  __device__ __forceinline__ void store8(int row, int col, const float (&acc)[8]) const {
    const Vec16<T> out = rounded<T>(acc);
    const size_t i = static_cast<size_t>(row) * static_cast<size_t>(n) + static_cast<size_t>(col);
    store_packets<T>(*peers, world, rank, epoch, part, tag, i, *reinterpret_cast<const uint4 *>(&out));
  }
};

// Whether packet x holds `tag`; whether it holds another launch's (nonzero, another tag).
__device__ __forceinline__ bool tagged(uint64_t x, uint32_t tag) { return static_cast<uint32_t>(x >> 32) == tag; }
__device__ __forceinline__ bool foreign(uint64_t x, uint32_t tag) { return (x >> 32) != 0 && !tagged(x, tag); }

// Whether all four packets of a vector hold `tag` (evaluated whole: no branch between the
// loads of a wave and their use, which let ptxas issue the wave's later loads after it).
__device__ __forceinline__ bool all_tagged(const Words2 &first, const Words2 &second, uint32_t tag) {
  return tagged(first.lo, tag) & tagged(first.hi, tag) & tagged(second.lo, tag) & tagged(second.hi, tag);
}

// The four packets of a vector, and whether they hold the tag.
struct Awaited {
  Words2 first, second;
  bool ok;
};

// Waits until the four packets at `at` (of rank src) hold `tag`, loading them again and again;
// not ok (the failure reported, st.failed counted) when they cannot. Out of line: only a
// packet not there at the first load comes here, and eight inlined copies of the loop cost the
// kernel registers in its GEMM. Arguments and result by value (the .param space: registers),
// never by address, which would put the caller's packets on the stack.
static __device__ TPFUSE_NOINLINE Awaited await_packets(const tpfuse_peers &peers, const tpfuse_group_args &g,
                                                        const Deadline deadline, fused::BlockState &st,
                                                        const uint64_t *at, int src, uint32_t tag,
                                                        uint64_t descriptor) {
  const Pad own{peers.signals[g.rank]};
  for (uint32_t spins = 1;; ++spins) {
    const Words2 first = ld_relaxed_sys_v2(at), second = ld_relaxed_sys_v2(at + 2);
    if (all_tagged(first, second, tag)) return Awaited{first, second, true};
    const bool other = foreign(first.lo, tag) || foreign(first.hi, tag) || foreign(second.lo, tag) ||
                       foreign(second.hi, tag);
    // Every 256 spins: a spin is four polls, so the deadline is checked every 1024 polls as
    // the flags' waits check it.
    const bool check = (spins & 255u) == 0;
    const bool mismatch = other || (check && fused::started_otherwise(own, src, st.epoch, descriptor));
    if (mismatch || (check && (ld_relaxed_sys(own.error()) != 0 || deadline.expired()))) {
      fused::give_up_wait(peers, g, st, src, mismatch);
      return Awaited{first, second, false};
    }
  }
}

// Elements i .. i + 7 of the sum (i a multiple of the vector's length; element i of the
// sources' data): every rank's packets, awaited, added in rank order through `epi` (which
// writes the residual) into `y`, then cleared. The ranks go in waves of kWave: a wave's
// packets are loaded together (4 x 32 bytes in flight with the epilogue's operands; the
// packets are in this rank's own memory) and added to the running sum in rank order (the same
// additions as sum_ranks, so its bits). A wider wave held 8 x 32 bytes of packets in registers
// and cost the GEMM + all-reduce kernel a block per SM in its GEMM. False when the block must
// give up (y unset, nothing cleared). reduce_packet_vector, below, stores y into out.
template <typename T>
__device__ __forceinline__ bool sum_packet_vector(const tpfuse_peers &peers, const tpfuse_group_args &g,
                                                  const Deadline &deadline, fused::BlockState &st, size_t part,
                                                  uint32_t tag, uint64_t descriptor, const Epilogue<T> &epi,
                                                  size_t i, Vec16<T> &y) {
  constexpr int kWave = 4;
  static_assert(TPFUSE_MAX_RANKS % kWave == 0, "whole waves");
  const Pad own{peers.signals[g.rank]};
  const typename Epilogue<T>::Operands operands = epi.operands(i);
  float acc[Vec16<T>::kLen];
#pragma unroll
  for (int first = 0; first < TPFUSE_MAX_RANKS; first += kWave) {
    if (first >= g.world) break;
    Words2 w[kWave][2];
#pragma unroll
    for (int j = 0; j < kWave; ++j) {
      if (first + j < g.world) {
        const uint64_t *at = source(own, st.epoch, first + j, part) + packet_index<T>(i);
        w[j][0] = ld_relaxed_sys_v2(at);
        w[j][1] = ld_relaxed_sys_v2(at + 2);
      }
    }
#pragma unroll
    for (int j = 0; j < kWave; ++j) {
      const int p = first + j;
      if (p < g.world) {
        if (!all_tagged(w[j][0], w[j][1], tag)) {
          const Awaited a = await_packets(peers, g, deadline, st, source(own, st.epoch, p, part) + packet_index<T>(i), p, tag,
                                          descriptor);
          if (!a.ok) return false;
          w[j][0] = a.first;
          w[j][1] = a.second;
        }
        const uint4 raw{static_cast<uint32_t>(w[j][0].lo), static_cast<uint32_t>(w[j][0].hi),
                        static_cast<uint32_t>(w[j][1].lo), static_cast<uint32_t>(w[j][1].hi)};
        add_rank<T>(acc, raw, p);
      }
    }
  }
  y = epi.apply_loaded(acc, i, operands);
  // Consumed: back to 0, for launch E + 2's packets (ordered before them by the started flags).
  const uint4 zero{0, 0, 0, 0};
#pragma unroll
  for (int p = 0; p < TPFUSE_MAX_RANKS; ++p) {
    if (p < g.world) {
      uint4 *at = reinterpret_cast<uint4 *>(source(own, st.epoch, p, part) + packet_index<T>(i));
      st_global(at, zero);
      st_global(at + 1, zero);
    }
  }
  return true;
}

template <typename T>
__device__ __forceinline__ bool reduce_packet_vector(const tpfuse_peers &peers, const tpfuse_group_args &g,
                                                     const Deadline &deadline, fused::BlockState &st, size_t part,
                                                     uint32_t tag, uint64_t descriptor, const Epilogue<T> &epi,
                                                     T *out, size_t i) {
  Vec16<T> y;
  if (!sum_packet_vector<T>(peers, g, deadline, st, part, tag, descriptor, epi, i, y)) return false;
  store16(out + i, y);
  return true;
}

} // namespace packets
} // namespace tpfuse
