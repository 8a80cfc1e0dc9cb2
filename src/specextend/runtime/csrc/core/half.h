// IEEE half and bfloat16 conversions in plain C++ (no PyTorch), the same on every path.
#pragma once

#include <cstdint>
#include <cstring>

namespace spx {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Exact: every half is a float.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000 | (man << 13));  // inf, nan
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  if (man == 0) return bits_to_float(sign);
  // subnormal half: man * 2^-24, exact in float
  const float v = static_cast<float>(man) * bits_to_float(0x33800000u);  // 2^-24
  return sign ? -v : v;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, as VCVTNE2PS2BF16 does (no NaNs reach here).
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// BF16D's activation rounding (Rows::xb): nearest even as above, a subnormal to a zero of its sign
// (VDPBF16PS reads one as zero), a NaN kept a quiet NaN.
inline uint16_t bf16_round(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7F800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return float_to_bf16(f);
}

// A bfloat16 value as VDPBF16PS multiplies it: a subnormal as a zero of its sign.
inline float bf16_daz(uint16_t h) { return (h & 0x7F80) == 0 ? bits_to_float(static_cast<uint32_t>(h & 0x8000) << 16) : bf16_to_float(h); }

}  // namespace spx
