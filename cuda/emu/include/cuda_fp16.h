// cuda_fp16.h of the CPU emulator: __half as 16 bits, conversions rounding to nearest even.
#pragma once

#ifdef __cplusplus  // C (bindgen through nccl.h) needs nothing from here

#include <stdint.h>
#include <string.h>

struct __half {
  uint16_t __x;
};

namespace tpfuse_emu {
inline uint32_t f32_bits(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  return x;
}
inline float bits_f32(uint32_t x) {
  float f;
  memcpy(&f, &x, 4);
  return f;
}
// IEEE binary32 -> binary16, round to nearest even, subnormals, overflow to infinity, NaN
// to the canonical 0x7FFF, as CUDA's conversion gives (cuda_fp16.hpp, __internal_float2half).
inline uint16_t f32_to_f16_bits(float f) {
  const uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t exp = (x >> 23) & 0xffu;
  uint32_t man = x & 0x7fffffu;
  if (exp == 0xffu) return static_cast<uint16_t>(man ? 0x7fffu : sign | 0x7c00u);
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {  // a subnormal half (or zero): the mantissa with its leading one, shifted
    if (e < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    const int shift = 14 - e;
    uint32_t h = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = sign | (static_cast<uint32_t>(e) << 10) | (man >> 13);
  const uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry rounds up the exponent
  return static_cast<uint16_t>(h);
}
inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in f32
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}
} // namespace tpfuse_emu

inline float __half2float(__half h) { return ::tpfuse_emu::f16_bits_to_f32(h.__x); }
inline __half __float2half_rn(float f) { return __half{::tpfuse_emu::f32_to_f16_bits(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }

#endif // __cplusplus
