// warp.cpp: warp-collective operations. All 32 lanes of a warp must arrive at the same
// collective; the last one to arrive computes every lane's result from every lane's operands,
// as the PTX ISA defines the instruction, and releases them. A collective reached by only part
// of a warp (the rest exited), or lanes at different collectives, fails the launch.
#include <algorithm>
#include <cstring>

#include <cuda_bf16.h>

#include "scheduler.hpp"

namespace tpfuse_emu {
namespace {

enum Kind { kShfl = 1, kLdmatrix = 2, kMma = 3 };

// Arrives at collective `kind` with operands `in`; returns this lane's result.
template <typename In, typename Out, typename Compute> Out collective(Kind kind, const In &in, Compute compute) {
  static_assert(sizeof(In) <= sizeof(Warp::in[0]) && sizeof(Out) <= sizeof(Warp::out[0]), "exchange area");
  Fiber &f = current_fiber();
  Block &b = *f.block;
  const int lane = static_cast<int>(f.tid.x % 32);
  Warp &w = b.warps[f.tid.x / 32];
  if (w.lanes != 32) fail_launch(cudaErrorLaunchFailure, "a warp collective in a warp of fewer than 32 threads");
  if (w.arrived == 0) {
    w.kind = kind;
  } else if (w.kind != kind) {
    fail_launch(cudaErrorLaunchFailure, "lanes of one warp reached different warp collectives");
  }
  std::memcpy(w.in[lane], &in, sizeof(In));
  ++w.arrived;
  f.state = FiberState::AtCollective;
  b.dirty = true;
  device().progress = true;
  if (w.arrived + w.exited == 32) {
    if (w.exited > 0) {
      fail_launch(cudaErrorLaunchFailure, "a warp collective was reached by " + std::to_string(w.arrived) +
                                              " of 32 lanes; the others exited");
    }
    In ins[32];
    Out outs[32];
    for (int l = 0; l < 32; ++l) std::memcpy(&ins[l], w.in[l], sizeof(In));
    compute(ins, outs, b);
    for (int l = 0; l < 32; ++l) std::memcpy(w.out[l], &outs[l], sizeof(Out));
    const int first = static_cast<int>(f.tid.x) - lane;
    for (int l = 0; l < 32; ++l) b.fibers[first + l]->state = FiberState::Ready;
    w.arrived = 0;
  }
  yield_to_scheduler();
  Out out;
  std::memcpy(&out, w.out[lane], sizeof(Out));
  return out;
}

struct ShflIn {
  unsigned mask;
  int lane_mask;
  float v;
};

struct LdmatrixIn {
  uint32_t addr;
};
struct LdmatrixOut {
  uint32_t r[4];
};

struct MmaIn {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
};
struct MmaOut {
  float d[4];
};

float element(MmaType type, uint16_t bits) {
  return type == MmaType::F16 ? f16_bits_to_f32(bits) : bf16_bits_to_f32(bits);
}

} // namespace

// shfl.sync.bfly.b32 (PTX ISA "shfl.sync"): lane l reads lane l ^ lane_mask. tpfuse uses the
// full mask and width 32 only; anything else fails the launch rather than guess.
float shfl_xor(unsigned mask, float v, int lane_mask, int width) {
  if (mask != 0xffffffffu || width != 32) {
    fail_launch(cudaErrorNotSupported, "__shfl_xor_sync with a partial mask or width is not emulated");
  }
  return collective<ShflIn, float>(kShfl, ShflIn{mask, lane_mask, v}, [](const ShflIn *in, float *out, Block &) {
    for (int l = 0; l < 32; ++l) out[l] = in[(l ^ in[l].lane_mask) & 31].v;
  });
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (PTX ISA "Warp-level matrix load instruction:
// ldmatrix"): lanes 8i..8i+7 hold the addresses of rows 0..7 of matrix i (16 bytes each,
// 16-byte aligned); lane l receives, in its register i, the two b16 elements of row l/4,
// columns 2*(l%4) and 2*(l%4)+1 of matrix i (the lower column in the low half).
void ldmatrix_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
  const LdmatrixOut out = collective<LdmatrixIn, LdmatrixOut>(
      kLdmatrix, LdmatrixIn{addr}, [](const LdmatrixIn *in, LdmatrixOut *out, Block &b) {
        for (int l = 0; l < 32; ++l) {
          if (in[l].addr % 16 != 0 || static_cast<size_t>(in[l].addr) + 16 > b.dynamic_bytes) {
            fail_launch(cudaErrorMisalignedAddress,
                        "ldmatrix row address " + std::to_string(in[l].addr) + " of lane " + std::to_string(l) +
                            " is not a 16-byte aligned row inside dynamic shared memory");
          }
        }
        if (b.launch->counting) {
          // Bank conflicts: shared memory has 32 banks of 4 bytes, so a 16-byte aligned row
          // covers the 4 banks of quad (addr / 16) % 8. Each matrix's 8 rows are one phase;
          // rows of a phase in the same quad are serialised: conflicts = most rows in one
          // quad, less one (0 when the 8 rows cover the 8 quads).
          for (int i = 0; i < 4; ++i) {
            int rows_in_quad[8] = {};
            int most = 0;
            for (int r = 0; r < 8; ++r) most = std::max(most, ++rows_in_quad[(in[8 * i + r].addr >> 4) & 7]);
            b.counters.ldmatrix_conflicts += static_cast<uint64_t>(most - 1);
          }
        }
        for (int l = 0; l < 32; ++l) {
          for (int i = 0; i < 4; ++i) {
            const uint32_t row = in[8 * i + l / 4].addr;
            std::memcpy(&out[l].r[i], b.dynamic_smem.data() + row + 4 * (l % 4), 4);
          }
        }
      });
  r0 = out.r[0];
  r1 = out.r[1];
  r2 = out.r[2];
  r3 = out.r[3];
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, fragments as in the PTX ISA
// section "Matrix Fragments for mma.m16n8k16 with floating point type"; with g = lane / 4 and
// t = lane % 4:
//   A (16x16): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1], a2 = A[g][2t+8..2t+9],
//              a3 = A[g+8][2t+8..2t+9] (lower column in the low half of each register);
//   B (16x8, k x n): b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g] (lower k in the low half);
//   C, D (16x8): c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1].
// Arithmetic (PTX leaves it unspecified; this is the emulator's model, docs/emulator.md):
// every product is exact, the 16 products are added in ascending k in f64, the accumulator
// last, and the result is rounded once to f32.
void mma_m16n8k16(MmaType type, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  MmaIn in{};
  std::memcpy(in.a, a, sizeof(in.a));
  std::memcpy(in.b, b, sizeof(in.b));
  std::memcpy(in.c, d, sizeof(in.c));
  const MmaOut out = collective<MmaIn, MmaOut>(kMma, in, [type](const MmaIn *in, MmaOut *out, Block &) {
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      const int a_row[4] = {g, g + 8, g, g + 8};
      const int a_col[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
      for (int r = 0; r < 4; ++r) {
        A[a_row[r]][a_col[r]] = element(type, static_cast<uint16_t>(in[l].a[r] & 0xffffu));
        A[a_row[r]][a_col[r] + 1] = element(type, static_cast<uint16_t>(in[l].a[r] >> 16));
      }
      for (int r = 0; r < 2; ++r) {
        B[2 * t + 8 * r][g] = element(type, static_cast<uint16_t>(in[l].b[r] & 0xffffu));
        B[2 * t + 8 * r + 1][g] = element(type, static_cast<uint16_t>(in[l].b[r] >> 16));
      }
      C[g][2 * t] = in[l].c[0];
      C[g][2 * t + 1] = in[l].c[1];
      C[g + 8][2 * t] = in[l].c[2];
      C[g + 8][2 * t + 1] = in[l].c[3];
    }
    // Row by row, the 8 columns' sums side by side: each sum still adds its products in
    // ascending k (the same bits as one column at a time), and the 8 independent chains keep
    // the host's floating-point units busy instead of waiting on one addition at a time.
    float D[16][8];
    for (int row = 0; row < 16; ++row) {
      double s[8] = {};
      for (int k = 0; k < 16; ++k) {
        const double a = static_cast<double>(A[row][k]);
        for (int col = 0; col < 8; ++col) s[col] += a * static_cast<double>(B[k][col]);
      }
      for (int col = 0; col < 8; ++col) D[row][col] = static_cast<float>(s[col] + static_cast<double>(C[row][col]));
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      out[l].d[0] = D[g][2 * t];
      out[l].d[1] = D[g][2 * t + 1];
      out[l].d[2] = D[g + 8][2 * t];
      out[l].d[3] = D[g + 8][2 * t + 1];
    }
  });
  std::memcpy(d, out.d, sizeof(out.d));
}

} // namespace tpfuse_emu
