// cuda_bf16.h of the CPU emulator: __nv_bfloat16 as 16 bits, conversions rounding to nearest
// even.
#pragma once

#ifdef __cplusplus  // C (bindgen through nccl.h) needs nothing from here

#include "cuda_fp16.h"

struct __nv_bfloat16 {
  uint16_t __x;
};

namespace tpfuse_emu {
inline uint16_t f32_to_bf16_bits(float f) {
  const uint32_t x = f32_bits(f);
  // NaN: the canonical 0x7FFF, as CUDA's conversion gives (cuda_bf16.hpp,
  // __internal_float2bfloat16): a payload never survives the round to bf16.
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_bits_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }
} // namespace tpfuse_emu

inline float __bfloat162float(__nv_bfloat16 b) { return ::tpfuse_emu::bf16_bits_to_f32(b.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __nv_bfloat16{::tpfuse_emu::f32_to_bf16_bits(f)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

#endif // __cplusplus
