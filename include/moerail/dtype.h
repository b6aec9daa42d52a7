// moerail/dtype.h — element types and host-side conversions.
//
// DType names the element type of a TensorView. F64 exists for the CPU reference and its finite-difference
// checks; GPU ops take F32, BF16 and F16 activations. F8E4M3 and F8E5M2 hold FP8 codes, F8E8M0 the MXFP8 recipe's
// scale codes (a power of two 2^(c - 127) per byte, 0xff NaN; not a value type of any op). I32/I64 hold indices and
// counts, Bool routing masks and byte buffers (one byte per element).
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace moerail {

enum class DType : std::uint8_t { F32, BF16, F16, F64, F8E4M3, F8E5M2, I32, I64, Bool, F8E8M0 };

// Size of one element in bytes.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::F8E4M3: case DType::F8E5M2: case DType::F8E8M0: case DType::Bool: return 1;
  }
  return 0;
}

// Lower-case name as used in messages and on the command line ("bf16", "f32", ...).
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::F64: return "f64";
    case DType::F8E4M3: return "fp8_e4m3";
    case DType::F8E5M2: return "fp8_e5m2";
    case DType::F8E8M0: return "fp8_e8m0";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::Bool: return "bool";
  }
  return "?";
}

constexpr bool is_floating(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16 || t == DType::F64 || t == DType::F8E4M3 ||
         t == DType::F8E5M2;
}

// ---- host conversions (round to nearest even), usable without the CUDA headers -------------------------------

inline float bf16_bits_to_float(std::uint16_t b) {
  std::uint32_t u = std::uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t float_to_bf16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return std::uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return std::uint16_t(u >> 16);
}

inline float f16_bits_to_float(std::uint16_t h) {
  std::uint32_t sign = std::uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t float_to_f16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  std::uint32_t sign = (u >> 16) & 0x8000, exp = (u >> 23) & 0xff, man = u & 0x7fffff;
  if (exp == 0xff) return std::uint16_t(sign | 0x7c00 | (man ? 0x200 : 0));
  int e = int(exp) - 127 + 15;
  if (e >= 0x1f) return std::uint16_t(sign | 0x7c00);
  if (e <= 0) {  // subnormal or zero
    if (e < -10) return std::uint16_t(sign);
    man |= 0x800000;
    int shift = 14 - e;
    std::uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return std::uint16_t(sign | half);
  }
  std::uint32_t half = sign | (std::uint32_t(e) << 10) | (man >> 13), rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;  // may carry into the exponent: still correct
  return std::uint16_t(half);
}

// Rounds a float to the nearest bf16 value and back: what storing in bf16 does to it.
inline float round_to_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }

}  // namespace moerail
