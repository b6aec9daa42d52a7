// Tests of the CPU FP8 reference (moerail/reference/quant.h): every e4m3 code decoded, every finite code round-
// tripped, rounding ties, saturation, NaN, the scale rules, the three recipes on tensors, and the argument errors.
// The encoder is checked against an oracle built here from the OCP definition alone (nearest of the 127
// non-negative finite values, ties to the even code), over every bf16 value and a million random fp32 patterns.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "moerail/error.h"
#include "moerail/quant.h"
#include "moerail/reference/host.h"
#include "moerail/reference/quant.h"

namespace moerail {
namespace {

using ref::e4m3_to_float;
using ref::e8m0_to_float;
using ref::float_to_e4m3;
using ref::HostTensor;
using ref::Rng;

// ---- the oracle: OCP E4M3FN from its definition -----------------------------------------------------------------

// Value of a non-NaN code: exponent bias 7, subnormals m * 2^-9.
double definition_value(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -v : v;
}

std::uint8_t oracle_encode(float x) {
  if (std::isnan(x)) return 0x7f;
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (int c = 0; c <= 0x7e; ++c) t.push_back(definition_value(c));  // increasing
    return t;
  }();
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(double(x));
  if (a >= 448.0) return sign | 0x7e;  // saturate (no inf in e4m3)
  const int hi = int(std::upper_bound(table.begin(), table.end(), a) - table.begin());  // first value > a
  const int lo = hi - 1;
  if (table[std::size_t(lo)] == a) return std::uint8_t(sign | lo);
  const double dlo = a - table[std::size_t(lo)], dhi = table[std::size_t(hi)] - a;
  const int code = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return std::uint8_t(sign | code);
}

float f32_of_bits(std::uint32_t u) { return std::bit_cast<float>(u); }
bool finite_code(int c) { return (c & 0x7f) != 0x7f; }

std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%02x", v);
  return buf;
}

// ---- single values ----------------------------------------------------------------------------------------------

TEST(QuantE4M3, DecodesAll256Codes) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_float(std::uint8_t(c));
    if (!finite_code(c)) {
      EXPECT_TRUE(std::isnan(v)) << "code " << hex(c);
      EXPECT_EQ(std::bit_cast<std::uint32_t>(v), 0x7fffffffu) << "code " << hex(c);
      continue;
    }
    EXPECT_EQ(double(v), definition_value(c)) << "code " << hex(c);
    EXPECT_EQ(std::signbit(v), c >= 0x80) << "code " << hex(c);
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(e4m3_to_float(0x07), 7 * 0x1p-9f);  // largest subnormal
  EXPECT_EQ(e4m3_to_float(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
}

TEST(QuantE4M3, EncodeRoundTripsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if (!finite_code(c)) continue;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(std::uint8_t(c))), c) << "code " << hex(c);
  }
}

TEST(QuantE4M3, RoundsTiesToEven) {
  for (int c = 0; c < 0x7e; ++c) {
    for (int sign : {0x00, 0x80}) {
      const float lo = e4m3_to_float(std::uint8_t(sign | c)), hi = e4m3_to_float(std::uint8_t(sign | (c + 1)));
      const float mid = (lo + hi) / 2;  // exact: at most 5 significant bits
      ASSERT_EQ(double(mid), (double(lo) + double(hi)) / 2);
      const int even = (c & 1) ? c + 1 : c;
      EXPECT_EQ(float_to_e4m3(mid), sign | even) << "tie between " << hex(sign | c) << " and " << hex(sign | (c + 1));
      EXPECT_EQ(float_to_e4m3(std::nextafter(mid, lo)), sign | c) << "just inside " << hex(sign | c);
      EXPECT_EQ(float_to_e4m3(std::nextafter(mid, hi)), sign | (c + 1)) << "just inside " << hex(sign | (c + 1));
    }
  }
  // Half the smallest subnormal is a tie with zero: even is zero, the sign stays.
  EXPECT_EQ(float_to_e4m3(0x1p-10f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0x1p-10f), 0x80);
  EXPECT_EQ(float_to_e4m3(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3(1e-30f), 0x00);
  EXPECT_EQ(float_to_e4m3(-1e-30f), 0x80);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
}

TEST(QuantE4M3, SaturatesToMaxFinite) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {448.0f, std::nextafter(448.0f, 0.0f), 449.0f, 463.99f, 464.0f, 465.0f, 480.0f, 1e6f,
                  std::numeric_limits<float>::max(), inf}) {
    EXPECT_EQ(float_to_e4m3(v), 0x7e) << v;
    EXPECT_EQ(float_to_e4m3(-v), 0xfe) << -v;
  }
  // Just below the tie between 416 and 448 goes down, the tie goes to 448 (code 0x7e is even).
  EXPECT_EQ(float_to_e4m3(432.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(std::nextafter(432.0f, 0.0f)), 0x7d);
}

TEST(QuantE4M3, NanBecomesTheCanonicalNan) {
  for (std::uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu})
    EXPECT_EQ(float_to_e4m3(f32_of_bits(bits)), 0x7f) << "fp32 bits " << std::hex << bits;
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
}

TEST(QuantE4M3, MatchesTheOracleOnEveryBf16AndRandomFloats) {
  int bad = 0;
  auto check = [&](float x) {
    const std::uint8_t got = float_to_e4m3(x), want = oracle_encode(x);
    if (got != want && bad++ < 10)
      ADD_FAILURE() << "float_to_e4m3(" << x << ", bits " << std::hex << std::bit_cast<std::uint32_t>(x)
                    << ") = " << hex(got) << " but the definition gives " << hex(want);
  };
  for (std::uint32_t b = 0; b < 0x10000; ++b) check(bf16_bits_to_float(std::uint16_t(b)));
  Rng rng(7);
  for (int i = 0; i < 1000000; ++i) check(f32_of_bits(std::uint32_t(rng.next())));
  // Dense around the e4m3 range: random mantissas at every exponent from 2^-12 to 2^9.
  for (int e = -12; e <= 9; ++e)
    for (int i = 0; i < 20000; ++i) {
      const float v = std::ldexp(float(rng.uniform(1.0, 2.0)), e);
      check(v);
      check(-v);
    }
  EXPECT_EQ(bad, 0);
}

// ---- e5m2 (the hybrid per-tensor recipe's gradients) ---------------------------------------------------------------

// Value of a finite non-negative e5m2 code: exponent bias 15, subnormals m * 2^-16.
double e5m2_definition_value(int code) {
  const int e = (code >> 2) & 31, m = code & 3;
  return e == 0 ? std::ldexp(m, -16) : std::ldexp(1.0 + m / 4.0, e - 15);
}

std::uint8_t e5m2_oracle_encode(float x) {
  if (std::isnan(x)) return 0x7f;
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (int c = 0; c <= 0x7b; ++c) t.push_back(e5m2_definition_value(c));  // increasing
    return t;
  }();
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(double(x));
  if (a >= 57344.0) return sign | 0x7b;  // satfinite
  const int hi = int(std::upper_bound(table.begin(), table.end(), a) - table.begin());
  const int lo = hi - 1;
  if (table[std::size_t(lo)] == a) return std::uint8_t(sign | lo);
  const double dlo = a - table[std::size_t(lo)], dhi = table[std::size_t(hi)] - a;
  return std::uint8_t(sign | (dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo)));
}

TEST(QuantE5M2, DecodesEveryCodeAndRoundTripsTheFiniteOnes) {
  for (int c = 0; c < 256; ++c) {
    const float v = ref::e5m2_to_float(std::uint8_t(c));
    const int mag = c & 0x7f;
    if (mag > 0x7c) {
      EXPECT_TRUE(std::isnan(v)) << hex(unsigned(c));
    } else if (mag == 0x7c) {
      EXPECT_TRUE(std::isinf(v) && std::signbit(v) == bool(c & 0x80)) << hex(unsigned(c));
    } else {
      const double want = (c & 0x80) ? -e5m2_definition_value(mag) : e5m2_definition_value(mag);
      EXPECT_EQ(double(v), want) << hex(unsigned(c));
      EXPECT_EQ(std::signbit(v), bool(c & 0x80)) << hex(unsigned(c));
      EXPECT_EQ(ref::float_to_e5m2(v), std::uint8_t(c)) << hex(unsigned(c));
    }
  }
  EXPECT_EQ(ref::e5m2_to_float(0x7b), 57344.0f);
  EXPECT_EQ(ref::e5m2_to_float(0x01), std::ldexp(1.0f, -16));
}

TEST(QuantE5M2, SaturatesRoundsTiesToEvenAndCanonicalizesNan) {
  EXPECT_EQ(ref::float_to_e5m2(57344.0f), 0x7b);
  EXPECT_EQ(ref::float_to_e5m2(61440.0f), 0x7b);  // the tie with the would-be 65536 (inf): satfinite
  EXPECT_EQ(ref::float_to_e5m2(1e30f), 0x7b);
  EXPECT_EQ(ref::float_to_e5m2(-std::numeric_limits<float>::infinity()), 0xfb);
  EXPECT_EQ(ref::float_to_e5m2(std::nanf("")), 0x7f);
  EXPECT_EQ(ref::float_to_e5m2(-std::nanf("")), 0x7f);
  EXPECT_EQ(ref::float_to_e5m2(1.125f), 0x3c);  // between 1 (0x3c) and 1.25 (0x3d), the tie goes to the even code
  EXPECT_EQ(ref::float_to_e5m2(1.375f), 0x3e);  // between 1.25 (0x3d) and 1.5 (0x3e): even
  EXPECT_EQ(ref::float_to_e5m2(std::ldexp(1.0f, -17)), 0x00);  // half the smallest subnormal: ties to zero
  EXPECT_EQ(ref::float_to_e5m2(-std::ldexp(1.0f, -30)), 0x80);  // rounds to -0
}

TEST(QuantE5M2, MatchesTheOracleOnEveryBf16AndRandomFloats) {
  int bad = 0;
  auto check = [&](float x) {
    const std::uint8_t got = ref::float_to_e5m2(x), want = e5m2_oracle_encode(x);
    if (got != want && bad++ < 10)
      ADD_FAILURE() << "float_to_e5m2(" << x << ") = " << hex(got) << " but the definition gives " << hex(want);
  };
  for (std::uint32_t b = 0; b < 0x10000; ++b) check(bf16_bits_to_float(std::uint16_t(b)));
  Rng rng(8);
  for (int i = 0; i < 300000; ++i) check(f32_of_bits(std::uint32_t(rng.next())));
  for (int e = -20; e <= 16; ++e)
    for (int i = 0; i < 5000; ++i) {
      const float v = std::ldexp(float(rng.uniform(1.0, 2.0)), e);
      check(v);
      check(-v);
    }
  EXPECT_EQ(bad, 0);
}

TEST(QuantScales, TensorScaleIsAmaxOverTheFormatsMax) {
  EXPECT_EQ(ref::tensor_scale_from_amax(448.0f, kE4M3Max), 1.0f);
  EXPECT_EQ(ref::tensor_scale_from_amax(57344.0f, kE5M2Max), 1.0f);
  EXPECT_EQ(ref::tensor_scale_from_amax(3.0f, kE5M2Max), 3.0f / 57344.0f);
  EXPECT_EQ(ref::tensor_scale_from_amax(0.0f, kE5M2Max), 1.0f);
  EXPECT_EQ(ref::tensor_scale_from_amax(1e-36f, kE5M2Max), 1.0f);  // amax / 57344 subnormal
}

// ---- scale rules --------------------------------------------------------------------------------------------------

TEST(QuantScales, BlockScaleIsAmaxOver448) {
  EXPECT_EQ(ref::block_scale_from_amax(448.0f), 1.0f);
  EXPECT_EQ(ref::block_scale_from_amax(896.0f), 2.0f);
  EXPECT_EQ(ref::block_scale_from_amax(3.0f), 3.0f / 448.0f);
  EXPECT_EQ(ref::block_scale_from_amax(0.0f), 1.0f);   // zero block
  EXPECT_EQ(ref::block_scale_from_amax(1e-44f), 1.0f);  // amax / 448 underflows to 0
  EXPECT_EQ(ref::block_scale_from_amax(1e-37f), 1.0f);  // amax / 448 subnormal: 1 / s would overflow
  EXPECT_EQ(ref::block_scale_from_amax(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
}

TEST(QuantScales, MxScaleIsThePowerOfTwoAtOrAboveAmaxOver448) {
  EXPECT_EQ(ref::mx_scale_from_amax(448.0f), 127);  // amax / 448 = 1
  EXPECT_EQ(ref::mx_scale_from_amax(449.0f), 128);
  EXPECT_EQ(ref::mx_scale_from_amax(224.0f), 126);
  EXPECT_EQ(ref::mx_scale_from_amax(300.0f), 127);
  EXPECT_EQ(ref::mx_scale_from_amax(1.0f), 127 - 8);  // 1/448 -> 2^-8
  EXPECT_EQ(ref::mx_scale_from_amax(0.0f), 0);
  EXPECT_EQ(ref::mx_scale_from_amax(std::numeric_limits<float>::infinity()), 0xff);
  EXPECT_EQ(ref::mx_scale_from_amax(std::numeric_limits<float>::max()), 127 + 120);
  // Around 2^-127 (an fp32 subnormal quotient): at or below it code 0, above it code 1.
  EXPECT_EQ(ref::mx_scale_from_amax(448.0f * 0x1p-127f), 0);
  EXPECT_EQ(ref::mx_scale_from_amax(448.0f * 0x1p-126f), 1);
  EXPECT_EQ(ref::mx_scale_from_amax(448.0f * 0x1.8p-127f), 1);
  // Definition over many amax: 2^(code-127) >= amax/448 > 2^(code-128).
  Rng rng(3);
  for (int i = 0; i < 100000; ++i) {
    const float amax = std::ldexp(float(rng.uniform(1.0, 2.0)), int(rng.below(200)) - 100);
    const int code = ref::mx_scale_from_amax(amax);
    const double t = double(amax / 448.0f);
    ASSERT_GE(std::ldexp(1.0, code - 127), t) << amax;
    ASSERT_LT(std::ldexp(1.0, code - 128), t) << amax;
  }
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_to_float(0), 0x1p-127f);
  EXPECT_EQ(e8m0_to_float(1), 0x1p-126f);
  EXPECT_EQ(e8m0_to_float(254), 0x1p127f);
  EXPECT_TRUE(std::isnan(e8m0_to_float(0xff)));
}

// ---- tensors --------------------------------------------------------------------------------------------------------

std::uint8_t* codes(const HostTensor& t) { return static_cast<std::uint8_t*>(t.view().data()); }
float* f32(const HostTensor& t) { return static_cast<float*>(t.view().data()); }

// x [rows, H] with a different magnitude per row (2^-20 .. 2^20), normal values.
HostTensor random_rows(DType dtype, std::int64_t rows, std::int64_t H, std::uint64_t seed) {
  HostTensor x(dtype, {rows, H});
  Rng rng(seed);
  for (std::int64_t r = 0; r < rows; ++r) {
    const double mag = std::ldexp(1.0, int(rng.below(41)) - 20);
    for (std::int64_t j = 0; j < H; ++j) x.set_f(r * H + j, rng.normal() * mag);
  }
  return x;
}

TEST(QuantTensors, Block1x128FollowsTheDefinition) {
  const std::int64_t rows = 5, H = 384, nb = H / 128;
  HostTensor x = random_rows(DType::BF16, rows, H, 11);
  for (std::int64_t j = 0; j < 128; ++j) x.set_f(1 * H + 128 + j, j % 2 ? 0.0 : -0.0);  // a zero block (row 1, block 1)
  HostTensor q(DType::F8E4M3, {rows, H}), scale(DType::F32, {rows, nb});
  ref::quantize_fp8(Fp8Scaling::Block1x128, x, q, scale);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t b = 0; b < nb; ++b) {
      float amax = 0;
      for (std::int64_t j = 0; j < 128; ++j) amax = std::max(amax, std::fabs(float(x.f(r * H + b * 128 + j))));
      const float sc = f32(scale)[r * nb + b];
      if (amax == 0) {
        EXPECT_EQ(sc, 1.0f);
      } else {
        EXPECT_EQ(sc, amax / 448.0f) << "row " << r << " block " << b;
      }
      bool saw_max = amax == 0;
      for (std::int64_t j = 0; j < 128; ++j) {
        const std::int64_t i = r * H + b * 128 + j;
        const float xv = float(x.f(i));
        ASSERT_EQ(codes(q)[i], oracle_encode(xv * (1.0f / sc))) << "x[" << r << "," << b * 128 + j << "] = " << xv;
        if (std::fabs(xv) == amax && amax > 0) {
          EXPECT_EQ(codes(q)[i] & 0x7f, 0x7e);  // the block's largest element lands on ±448
          saw_max = true;
        }
      }
      EXPECT_TRUE(saw_max);
    }
  // The zero block keeps the signs of its zeros.
  EXPECT_EQ(codes(q)[1 * H + 128], 0x80);
  EXPECT_EQ(codes(q)[1 * H + 129], 0x00);

  // Dequantize: float(q) * scale in fp32, rounded once; the zero block gives zeros exactly; normal-range codes are
  // within half an e4m3 ulp (2^-4 relative) of x.
  HostTensor y32(DType::F32, {rows, H}), y16(DType::BF16, {rows, H});
  ref::dequantize_fp8(Fp8Scaling::Block1x128, q, scale, y32);
  ref::dequantize_fp8(Fp8Scaling::Block1x128, q, scale, y16);
  for (std::int64_t i = 0; i < rows * H; ++i) {
    const float sc = f32(scale)[i / 128];
    const float want = e4m3_to_float(codes(q)[i]) * sc;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f32(y32)[i]), std::bit_cast<std::uint32_t>(want)) << i;
    ASSERT_EQ(static_cast<std::uint16_t*>(y16.view().data())[i], float_to_bf16_bits(want)) << i;
    const double xv = x.f(i);
    if (std::fabs(xv / sc) >= 0x1p-6)
      EXPECT_LE(std::fabs(f32(y32)[i] - xv), std::fabs(xv) * 0x1p-4 * 1.001) << i;
    else
      EXPECT_LE(std::fabs(f32(y32)[i] - xv), 0x1p-10 * sc * 1.001) << i;
  }
  for (std::int64_t j = 0; j < 128; ++j) EXPECT_EQ(f32(y32)[1 * H + 128 + j], 0.0f);
}

TEST(QuantTensors, Mx1x32FollowsTheDefinition) {
  const std::int64_t rows = 4, H = 96, nb = H / 32;
  HostTensor x = random_rows(DType::F32, rows, H, 12);
  for (std::int64_t j = 0; j < 32; ++j) x.set_f(2 * H + j, 0.0);                   // zero block
  x.set_f(3 * H + 40, std::numeric_limits<double>::infinity());                      // inf block (row 3, block 1)
  x.set_f(3 * H + 70, std::numeric_limits<double>::quiet_NaN());                     // NaN element (row 3, block 2)
  HostTensor q(DType::F8E4M3, {rows, H}), scale(kE8M0ScaleDType, {rows, nb});
  ref::quantize_fp8(Fp8Scaling::Mx1x32, x, q, scale);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t b = 0; b < nb; ++b) {
      float amax = 0;
      for (std::int64_t j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(float(x.f(r * H + b * 32 + j))));
      const int code = codes(scale)[r * nb + b];
      EXPECT_EQ(code, ref::mx_scale_from_amax(amax));
      if (std::isinf(amax) || amax == 0) continue;
      const float sc = e8m0_to_float(std::uint8_t(code));
      EXPECT_GT(amax / sc, 224.0f);  // the smallest power of two that fits: the block max lands in (224, 448]
      EXPECT_LE(amax / sc, 448.0f);
      for (std::int64_t j = 0; j < 32; ++j) {
        const std::int64_t i = r * H + b * 32 + j;
        EXPECT_EQ(codes(q)[i], oracle_encode(float(x.f(i)) * (1.0f / sc))) << "x[" << r << "," << b * 32 + j << "]";
      }
    }
  EXPECT_EQ(codes(scale)[2 * nb + 0], 0);     // zero block: 2^-127
  EXPECT_EQ(codes(q)[2 * H + 5], 0x00);
  EXPECT_EQ(codes(scale)[3 * nb + 1], 0xff);  // inf block: NaN scale
  EXPECT_EQ(codes(q)[3 * H + 70], 0x7f);      // the NaN element; its block's scale ignores it
  EXPECT_NE(codes(scale)[3 * nb + 2], 0xff);

  HostTensor y(DType::F32, {rows, H});
  ref::dequantize_fp8(Fp8Scaling::Mx1x32, q, scale, y);
  for (std::int64_t j = 0; j < 32; ++j) {
    EXPECT_EQ(f32(y)[2 * H + j], 0.0f);
    EXPECT_TRUE(std::isnan(f32(y)[3 * H + 32 + j]));
  }
  EXPECT_TRUE(std::isnan(f32(y)[3 * H + 70]));
  EXPECT_FALSE(std::isnan(f32(y)[3 * H + 71]));
}

TEST(QuantTensors, PerTensorDividesByTheGivenScaleAndSaturates) {
  const std::int64_t rows = 3, H = 40;  // any H
  HostTensor x = random_rows(DType::BF16, rows, H, 13);
  HostTensor scale(DType::F32, {1}), q(DType::F8E4M3, {rows, H});
  f32(scale)[0] = 0.01f;
  x.set_f(7, 1e4);
  x.set_f(8, -1e4);
  ref::quantize_fp8(Fp8Scaling::PerTensor, x, q, scale);
  for (std::int64_t i = 0; i < rows * H; ++i) ASSERT_EQ(codes(q)[i], oracle_encode(float(x.f(i)) / 0.01f)) << i;
  EXPECT_EQ(codes(q)[7], 0x7e);
  EXPECT_EQ(codes(q)[8], 0xfe);
  HostTensor y(DType::BF16, {rows, H});
  ref::dequantize_fp8(Fp8Scaling::PerTensor, q, scale, y);
  EXPECT_EQ(y.f(7), double(round_to_bf16(448.0f * 0.01f)));

  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    f32(scale)[0] = bad;
    try {
      ref::quantize_fp8(Fp8Scaling::PerTensor, x, q, scale);
      ADD_FAILURE() << "scale " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find("quantize_fp8: scale = "), std::string::npos) << e.what();
    }
  }
}

TEST(QuantTensors, ZeroRowsIsANoOp) {
  for (Fp8Scaling s : {Fp8Scaling::PerTensor, Fp8Scaling::Block1x128, Fp8Scaling::Mx1x32}) {
    HostTensor x(DType::BF16, {0, 256}), q(DType::F8E4M3, {0, 256}), y(DType::BF16, {0, 256});
    HostTensor scale = s == Fp8Scaling::PerTensor ? HostTensor(DType::F32, {1})
                                                  : HostTensor(fp8_scale_dtype(s), {0, 256 / fp8_scale_block_cols(s)});
    if (s == Fp8Scaling::PerTensor) f32(scale)[0] = 1.0f;
    ref::quantize_fp8(s, x, q, scale);
    ref::dequantize_fp8(s, q, scale, y);
  }
}

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(QuantTensors, ErrorsNameTheArgument) {
  HostTensor x(DType::BF16, {2, 100}), q(DType::F8E4M3, {2, 100});
  HostTensor s128(DType::F32, {2, 1}), s32(kE8M0ScaleDType, {2, 3});
  EXPECT_EQ(error_of([&] { ref::quantize_fp8(Fp8Scaling::Block1x128, x, q, s128); }),
            "quantize_fp8: x has 100 columns but 1x128 blockwise scaling needs a multiple of 128 (H % 128 == 0)");
  EXPECT_EQ(error_of([&] { ref::quantize_fp8(Fp8Scaling::Mx1x32, x, q, s32); }),
            "quantize_fp8: x has 100 columns but MXFP8 1x32 scaling needs a multiple of 32 (H % 32 == 0)");
  EXPECT_EQ(error_of([&] { ref::dequantize_fp8(Fp8Scaling::Mx1x32, q, s32, x); }),
            "dequantize_fp8: q has 100 columns but MXFP8 1x32 scaling needs a multiple of 32 (H % 32 == 0)");

  HostTensor x2(DType::BF16, {2, 256}), q2(DType::F8E4M3, {2, 256}), s2(DType::F32, {2, 2});
  HostTensor wrong_scale(DType::F32, {2, 8}), e8m0_scale(kE8M0ScaleDType, {2, 2}), q_f32(DType::F32, {2, 256});
  HostTensor q_short(DType::F8E4M3, {1, 256}), x_i32(DType::I32, {2, 256});
  EXPECT_EQ(error_of([&] { ref::quantize_fp8(Fp8Scaling::Block1x128, x2, q2, wrong_scale); }),
            "quantize_fp8: scale has shape [2, 8] but [2, 2] was expected");
  EXPECT_EQ(error_of([&] { ref::quantize_fp8(Fp8Scaling::Block1x128, x2, q2, e8m0_scale); }),
            "quantize_fp8: scale has dtype fp8_e8m0 but one of {f32} was expected");
  EXPECT_EQ(error_of([&] { ref::quantize_fp8(Fp8Scaling::Block1x128, x2, q_f32, s2); }),
            "quantize_fp8: q has dtype f32 but one of {fp8_e4m3} was expected");
  EXPECT_EQ(error_of([&] { ref::quantize_fp8(Fp8Scaling::Block1x128, x2, q_short, s2); }),
            "quantize_fp8: q has shape [1, 256] but [2, 256] was expected");
  EXPECT_EQ(error_of([&] { ref::quantize_fp8(Fp8Scaling::Block1x128, x_i32, q2, s2); }),
            "quantize_fp8: x has dtype i32 but one of {bf16, f32} was expected");
  EXPECT_EQ(error_of([&] { ref::dequantize_fp8(Fp8Scaling::Block1x128, q2, s2, x_i32); }),
            "dequantize_fp8: out has dtype i32 but one of {bf16, f32} was expected");
  EXPECT_EQ(error_of([&] { ref::quantize_fp8(static_cast<Fp8Scaling>(9), x2, q2, s2); }),
            "quantize_fp8: scaling = 9 is not one of {PerTensor, Block1x128, Mx1x32}");
  const TensorView on_gpu(x2.view().data(), DType::BF16, {2, 256}, Device::cuda(0));
  EXPECT_NE(error_of([&] { ref::quantize_fp8(Fp8Scaling::Block1x128, on_gpu, q2, s2); }).find("quantize_fp8: x"),
            std::string::npos);
}

// ---- segment-transposed 1x128 copies ------------------------------------------------------------------------------

// ref::quantize_fp8_transposed against its definition: per expert, Block1x128 quantization (ref::quantize_fp8) of
// the segment's transpose with its rows padded by zeros to a multiple of 128, placed at C * P_e / C * P_e / 128.
void check_transposed(std::int64_t rows, std::int64_t C, const std::vector<std::int64_t>& counts, std::uint64_t seed) {
  const std::int64_t L = std::int64_t(counts.size()), rows_t = fp8_transposed_rows(rows, L);
  HostTensor x(DType::BF16, {rows, C});
  Rng rng(seed);
  for (std::int64_t r = 0; r < rows; ++r) {
    const double m = std::ldexp(1.0, int(rng.below(16)) - 8);  // rows binades apart: a block's amax matters
    for (std::int64_t c = 0; c < C; ++c) x.set_f(r * C + c, rng.normal() * m);
  }
  HostTensor cnt(DType::I64, {L});
  for (std::int64_t e = 0; e < L; ++e) cnt.set_i(e, counts[std::size_t(e)]);
  HostTensor qt(DType::F8E4M3, {C * rows_t}), qs(DType::F32, {C * rows_t / 128});
  std::memset(qt.view().data(), 0xee, std::size_t(C * rows_t));
  qs.fill_nan();
  QuantizeTransposedArgs a;
  a.x = x.view();
  a.counts = cnt.view();
  a.qt = qt.view();
  a.qt_scales = qs.view();
  ref::quantize_fp8_transposed(a);

  std::int64_t start = 0, padded = 0;
  for (std::int64_t e = 0; e < L; ++e) {
    const std::int64_t n = std::min(rows - start, std::max<std::int64_t>(counts[std::size_t(e)], 0));
    const std::int64_t R = (n + 127) / 128 * 128;
    SCOPED_TRACE("expert " + std::to_string(e) + " rows " + std::to_string(n));
    if (R > 0) {
      HostTensor t(DType::F32, {C, R}), tq(DType::F8E4M3, {C, R}), ts(DType::F32, {C, R / 128});
      for (std::int64_t c = 0; c < C; ++c)
        for (std::int64_t i = 0; i < R; ++i) t.set_f(c * R + i, i < n ? x.f((start + i) * C + c) : 0.0);
      ref::quantize_fp8(Fp8Scaling::Block1x128, t.view(), tq.view(), ts.view());
      EXPECT_EQ(std::memcmp(static_cast<const std::uint8_t*>(qt.view().data()) + C * padded, tq.view().data(),
                            std::size_t(C * R)),
                0);
      EXPECT_EQ(std::memcmp(static_cast<const float*>(qs.view().data()) + C * padded / 128, ts.view().data(),
                            std::size_t(C * R / 128) * 4),
                0);
    }
    start += n;
    padded += R;
  }
  // nothing past the last block is written
  const auto* q = static_cast<const std::uint8_t*>(qt.view().data());
  for (std::int64_t i = C * padded; i < C * rows_t; ++i) ASSERT_EQ(q[i], 0xee) << "qt[" << i << "] written";
  for (std::int64_t i = C * padded / 128; i < C * rows_t / 128; ++i) ASSERT_TRUE(std::isnan(qs.f(i)));
}

TEST(RefQuantTransposed, IsBlockQuantizationOfEachPaddedTransposedSegment) {
  check_transposed(300, 192, {130, 0, 100, 70}, 1);  // unaligned segments, an empty expert
  check_transposed(256, 64, {128, 128}, 2);          // aligned
  check_transposed(200, 128, {300, -4, 50}, 3);      // clipped past the rows, a negative count
  check_transposed(0, 64, {0, 0}, 4);                // no rows
  check_transposed(129, 64, {0, 0, 129}, 5);         // one row past a block
}

// The two fused forms against their compositions: an FP8 x (codes and 1x128 scales) gives the copy of its
// dequantized bf16 value; q / q_scales are quantize_fp8 of the segment rows, the rows past them untouched, and the
// copy is the plain form's.
TEST(RefQuantTransposed, FusedFormsEqualTheirCompositions) {
  const std::int64_t rows = 420, C = 256;
  const std::vector<std::int64_t> counts = {130, 0, 150, 70};  // 350 of 420 rows routed
  const std::int64_t L = std::int64_t(counts.size()), rows_t = fp8_transposed_rows(rows, L), routed = 350;
  HostTensor x(DType::BF16, {rows, C});
  Rng rng(11);
  for (std::int64_t r = 0; r < rows; ++r) {
    const double m = std::ldexp(1.0, int(rng.below(16)) - 8);
    for (std::int64_t c = 0; c < C; ++c) x.set_f(r * C + c, rng.normal() * m);
  }
  HostTensor cnt(DType::I32, {L});
  for (std::int64_t e = 0; e < L; ++e) cnt.set_i(e, counts[std::size_t(e)]);
  auto copy_of = [&](const QuantizeTransposedArgs& base, HostTensor& qt, HostTensor& qs) {
    QuantizeTransposedArgs a = base;
    a.counts = cnt.view();
    a.qt = qt.view();
    a.qt_scales = qs.view();
    ref::quantize_fp8_transposed(a);
  };
  auto bytes_equal = [](const HostTensor& a, const HostTensor& b) {
    return std::memcmp(a.view().data(), b.view().data(), a.view().nbytes()) == 0;
  };

  // FP8 source
  HostTensor xq(DType::F8E4M3, {rows, C}), xs(DType::F32, {rows, C / 128}), xd(DType::BF16, {rows, C});
  ref::quantize_fp8(Fp8Scaling::Block1x128, x.view(), xq.view(), xs.view());
  ref::dequantize_fp8(Fp8Scaling::Block1x128, xq.view(), xs.view(), xd.view());
  HostTensor want_qt(DType::F8E4M3, {C * rows_t}), want_qs(DType::F32, {C * rows_t / 128});
  HostTensor got_qt(DType::F8E4M3, {C * rows_t}), got_qs(DType::F32, {C * rows_t / 128});
  for (HostTensor* t : {&want_qt, &got_qt}) std::memset(t->view().data(), 0xee, t->view().nbytes());
  for (HostTensor* t : {&want_qs, &got_qs}) t->fill_nan();
  QuantizeTransposedArgs plain;
  plain.x = xd.view();
  copy_of(plain, want_qt, want_qs);
  QuantizeTransposedArgs from_fp8;
  from_fp8.x = xq.view();
  from_fp8.x_scales = xs.view();
  copy_of(from_fp8, got_qt, got_qs);
  EXPECT_TRUE(bytes_equal(got_qt, want_qt));
  EXPECT_TRUE(bytes_equal(got_qs, want_qs));
  EXPECT_FALSE(bytes_equal(xd, x)) << "the FP8 value differs from x: the test must see which one was copied";

  // row-wise codes too
  HostTensor q(DType::F8E4M3, {rows, C}), qsc(DType::F32, {rows, C / 128});
  std::memset(q.view().data(), 0xee, q.view().nbytes());
  qsc.fill_nan();
  for (HostTensor* t : {&want_qt, &got_qt}) std::memset(t->view().data(), 0xee, t->view().nbytes());
  for (HostTensor* t : {&want_qs, &got_qs}) t->fill_nan();
  plain.x = x.view();
  copy_of(plain, want_qt, want_qs);
  QuantizeTransposedArgs both;
  both.x = x.view();
  both.q = q.view();
  both.q_scales = qsc.view();
  copy_of(both, got_qt, got_qs);
  EXPECT_TRUE(bytes_equal(got_qt, want_qt));
  EXPECT_TRUE(bytes_equal(got_qs, want_qs));
  const std::size_t routed_codes = std::size_t(routed * C), routed_scales = std::size_t(routed * C / 128);
  EXPECT_EQ(std::memcmp(q.view().data(), xq.view().data(), routed_codes), 0);
  EXPECT_EQ(std::memcmp(qsc.view().data(), xs.view().data(), routed_scales * 4), 0);
  for (std::size_t i = routed_codes; i < std::size_t(rows * C); ++i)
    ASSERT_EQ(static_cast<const std::uint8_t*>(q.view().data())[i], 0xee) << "q[" << i << "] past the segments";
  for (std::int64_t i = std::int64_t(routed_scales); i < rows * C / 128; ++i) ASSERT_TRUE(std::isnan(qsc.f(i)));

  // refusals
  QuantizeTransposedArgs bad = from_fp8;
  bad.q = q.view();
  bad.q_scales = qsc.view();
  EXPECT_THROW(copy_of(bad, got_qt, got_qs), Error);
  bad = both;
  bad.q_scales = TensorView();
  try {
    copy_of(bad, got_qt, got_qs);
    ADD_FAILURE() << "q without q_scales was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q_scales is absent"), std::string::npos) << e.what();
  }
}

TEST(RefQuantTransposed, RejectsWrongSizes) {
  HostTensor x(DType::BF16, {10, 64}), cnt(DType::I32, {2});
  HostTensor qt(DType::F8E4M3, {64 * 128}), qs(DType::F32, {64});  // fp8_transposed_rows(10, 2) = 384, not 128
  QuantizeTransposedArgs a;
  a.x = x.view();
  a.counts = cnt.view();
  a.qt = qt.view();
  a.qt_scales = qs.view();
  try {
    ref::quantize_fp8_transposed(a);
    ADD_FAILURE() << "a too small qt was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qt"), std::string::npos) << e.what();
  }
}

// quantize_fp8_experts is quantize_fp8(PerTensor) applied to each segment with the scale tensor_scale_from_amax of
// that segment alone; an empty segment gets scale 1; rows past the segments are not written.
TEST(RefQuantExperts, IsThePerTensorQuantizerPerSegment) {
  const std::int64_t rows = 50, C = 32;
  HostTensor x(DType::BF16, {rows, C}), cnt(DType::I64, {4});
  Rng rng(3);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < C; ++c) x.set_f(r * C + c, rng.normal() * std::ldexp(1.0, int(r / 10) * 3 - 4));
  const std::vector<std::int64_t> counts = {12, 0, 25, 8};  // 45 of 50 rows routed
  for (std::int64_t e = 0; e < 4; ++e) cnt.set_i(e, counts[std::size_t(e)]);
  HostTensor q(DType::F8E4M3, {rows, C}), s(DType::F32, {4});
  std::memset(q.view().data(), 0xee, std::size_t(rows * C));
  ref::quantize_fp8_experts({x.view(), cnt.view(), q.view(), s.view()});
  std::int64_t row = 0;
  for (std::int64_t e = 0; e < 4; ++e) {
    const std::int64_t n = counts[std::size_t(e)];
    float amax = 0.0f;
    for (std::int64_t i = row * C; i < (row + n) * C; ++i) amax = std::max(amax, float(std::fabs(x.f(i))));
    EXPECT_EQ(s.f(e), n == 0 ? 1.0 : double(ref::tensor_scale_from_amax(amax, kE4M3Max))) << "expert " << e;
    if (n > 0) {
      const HostTensor seg = [&] {
        HostTensor t(DType::BF16, {n, C});
        std::memcpy(t.view().data(), static_cast<const char*>(x.view().data()) + row * C * 2, std::size_t(n * C) * 2);
        return t;
      }();
      HostTensor want(DType::F8E4M3, {n, C}), sc(DType::F32, {1});
      sc.set_f(0, s.f(e));
      ref::quantize_fp8(Fp8Scaling::PerTensor, seg.view(), want.view(), sc.view());
      EXPECT_EQ(std::memcmp(want.view().data(), static_cast<const std::uint8_t*>(q.view().data()) + row * C,
                            std::size_t(n * C)), 0) << "expert " << e;
    }
    row += n;
  }
  for (std::int64_t i = row * C; i < rows * C; ++i)
    ASSERT_EQ(static_cast<const std::uint8_t*>(q.view().data())[i], 0xee) << "q[" << i << "] past the segments";
}

// The per-tensor copies: the row codes of quantize_fp8_experts transposed segment by segment (bf16 x, and an e4m3 x
// holding those codes), every block scale the expert's; the per-tensor weights: the per-tensor quantizer of each
// matrix, the transposed copy its transpose with the same scale.
TEST(RefQuantExperts, TransposedCopiesAndWeightsKeepTheTensorsScale) {
  const std::int64_t rows = 300, C = 128, L = 3;
  HostTensor x(DType::BF16, {rows, C}), cnt(DType::I32, {L});
  Rng rng(4);
  for (std::int64_t i = 0; i < rows * C; ++i) x.set_f(i, rng.normal() * 0.3);
  const std::vector<std::int64_t> counts = {130, 0, 150};
  for (std::int64_t e = 0; e < L; ++e) cnt.set_i(e, counts[std::size_t(e)]);
  HostTensor q(DType::F8E4M3, {rows, C}), s(DType::F32, {L});
  ref::quantize_fp8_experts({x.view(), cnt.view(), q.view(), s.view()});
  const std::int64_t rows_t = fp8_transposed_rows(rows, L);
  for (const bool fp8_x : {false, true}) {
    HostTensor qt(DType::F8E4M3, {C * rows_t}), qs(DType::F32, {C * rows_t / 128}), rq(DType::F8E4M3, {rows, C});
    QuantizeTransposedArgs a;
    a.x = fp8_x ? q.view() : x.view();
    a.counts = cnt.view();
    a.qt = qt.view();
    a.qt_scales = qs.view();
    a.tensor_scales = s.view();
    if (!fp8_x) a.q = rq.view();
    ref::quantize_fp8_transposed(a);
    const std::uint8_t* codes = static_cast<const std::uint8_t*>(q.view().data());
    const std::uint8_t* t = static_cast<const std::uint8_t*>(qt.view().data());
    std::int64_t start = 0, padded = 0;
    for (std::int64_t e = 0; e < L; ++e) {
      const std::int64_t n = counts[std::size_t(e)], R = (n + 127) / 128 * 128;
      for (std::int64_t c = 0; c < C; ++c) {
        for (std::int64_t i = 0; i < R; ++i)
          ASSERT_EQ(t[C * padded + c * R + i], i < n ? codes[(start + i) * C + c] : 0) << e << " " << c << " " << i;
        for (std::int64_t b = 0; b < R / 128; ++b) ASSERT_EQ(qs.f(C * padded / 128 + c * (R / 128) + b), s.f(e));
      }
      start += n;
      padded += R;
    }
    if (!fp8_x) EXPECT_EQ(std::memcmp(rq.view().data(), q.view().data(), std::size_t(280 * C)), 0);
  }

  const std::int64_t N = 256, K = 128;
  HostTensor w(DType::BF16, {L, N, K}), wq(DType::F8E4M3, {L, N, K}), ws(DType::F32, {L}),
      wqt(DType::F8E4M3, {L, K, N}), wts(DType::F32, {L});
  for (std::int64_t i = 0; i < L * N * K; ++i) w.set_f(i, rng.normal() * std::ldexp(1.0, int(i / (N * K)) * 4 - 6));
  ref::quantize_weights_fp8({w.view(), wq.view(), ws.view(), wqt.view(), wts.view(), Fp8Scaling::PerTensor});
  for (std::int64_t e = 0; e < L; ++e) {
    HostTensor one(DType::BF16, {N, K}), want(DType::F8E4M3, {N, K}), sc(DType::F32, {1});
    std::memcpy(one.view().data(), static_cast<const char*>(w.view().data()) + e * N * K * 2, std::size_t(N * K) * 2);
    float amax = 0.0f;
    for (std::int64_t i = 0; i < N * K; ++i) amax = std::max(amax, float(std::fabs(one.f(i))));
    EXPECT_EQ(ws.f(e), double(ref::tensor_scale_from_amax(amax, kE4M3Max)));
    sc.set_f(0, ws.f(e));
    ref::quantize_fp8(Fp8Scaling::PerTensor, one.view(), want.view(), sc.view());
    const std::uint8_t* got = static_cast<const std::uint8_t*>(wq.view().data()) + e * N * K;
    const std::uint8_t* got_t = static_cast<const std::uint8_t*>(wqt.view().data()) + e * K * N;
    EXPECT_EQ(std::memcmp(want.view().data(), got, std::size_t(N * K)), 0) << "expert " << e;
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t k = 0; k < K; ++k) ASSERT_EQ(got_t[k * N + n], got[n * K + k]);
    EXPECT_EQ(wts.f(e), ws.f(e));
  }
}

// The hybrid recipe's e5m2 forms: quantize_fp8_experts with format e5m2 is amax / 57344 per segment and
// float_to_e5m2 of each element times the scale's reciprocal; the per-tensor copies (bf16 x, with the row codes)
// are those codes transposed; e5m2 is refused where the forms have no e5m2 (an e4m3 x, the 1x128 form), naming qt.
TEST(RefQuantExperts, E5m2FormsAreTheHybridRecipesGradients) {
  const std::int64_t rows = 300, C = 128, L = 3;
  HostTensor x(DType::BF16, {rows, C}), cnt(DType::I32, {L});
  Rng rng(9);
  for (std::int64_t i = 0; i < rows * C; ++i) x.set_f(i, rng.normal() * std::ldexp(1.0, int(i / (100 * C)) * 5 - 8));
  const std::vector<std::int64_t> counts = {130, 0, 150};
  for (std::int64_t e = 0; e < L; ++e) cnt.set_i(e, counts[std::size_t(e)]);
  HostTensor q(DType::F8E5M2, {rows, C}), s(DType::F32, {L});
  ref::quantize_fp8_experts({x.view(), cnt.view(), q.view(), s.view(), DType::F8E5M2});
  const std::uint8_t* codes = static_cast<const std::uint8_t*>(q.view().data());
  std::int64_t start = 0;
  for (std::int64_t e = 0; e < L; ++e) {
    const std::int64_t n = counts[std::size_t(e)];
    float amax = 0.0f;
    for (std::int64_t i = start * C; i < (start + n) * C; ++i) amax = std::max(amax, float(std::fabs(x.f(i))));
    const float sc = n == 0 ? 1.0f : amax / kE5M2Max;
    ASSERT_EQ(s.f(e), double(sc)) << "expert " << e;
    for (std::int64_t i = start * C; i < (start + n) * C; ++i)
      ASSERT_EQ(codes[i], ref::float_to_e5m2(float(x.f(i)) * (1.0f / sc))) << "expert " << e << " element " << i;
    start += n;
  }
  bool saturated = false;  // the largest element of a segment lands on the top of e5m2's range
  for (std::int64_t i = 0; i < 280 * C; ++i) saturated |= (codes[i] & 0x7f) == 0x7b;
  EXPECT_TRUE(saturated);

  const std::int64_t rows_t = fp8_transposed_rows(rows, L);
  HostTensor qt(DType::F8E5M2, {C * rows_t}), qs(DType::F32, {C * rows_t / 128}), rq(DType::F8E5M2, {rows, C});
  QuantizeTransposedArgs a;
  a.x = x.view();
  a.counts = cnt.view();
  a.qt = qt.view();
  a.qt_scales = qs.view();
  a.tensor_scales = s.view();
  a.q = rq.view();
  ref::quantize_fp8_transposed(a);
  EXPECT_EQ(std::memcmp(rq.view().data(), q.view().data(), std::size_t(280 * C)), 0);
  const std::uint8_t* t = static_cast<const std::uint8_t*>(qt.view().data());
  start = 0;
  std::int64_t padded = 0;
  for (std::int64_t e = 0; e < L; ++e) {
    const std::int64_t n = counts[std::size_t(e)], R = (n + 127) / 128 * 128;
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t i = 0; i < R; ++i)
        ASSERT_EQ(t[C * padded + c * R + i], i < n ? codes[(start + i) * C + c] : 0) << e << " " << c << " " << i;
    start += n;
    padded += R;
  }

  // e5m2 copies where the form has none: refused, naming qt
  auto expect_e5m2_refused = [](const QuantizeTransposedArgs& args) {
    EXPECT_THROW(
        {
          try {
            ref::quantize_fp8_transposed(args);
          } catch (const Error& err) {
            EXPECT_NE(std::string(err.what()).find("qt is fp8_e5m2"), std::string::npos) << err.what();
            throw;
          }
        },
        Error);
  };
  QuantizeTransposedArgs block = a;  // the 1x128 form has no e5m2
  block.tensor_scales = TensorView();
  block.q = TensorView();
  expect_e5m2_refused(block);
  QuantizeExpertsArgs bad{x.view(), cnt.view(), q.view(), s.view(), DType::F8E4M3};  // q's dtype is not the format
  EXPECT_THROW(ref::quantize_fp8_experts(bad), Error);
  HostTensor q4(DType::F8E4M3, {rows, C}), s4(DType::F32, {L});  // an e4m3 x's copy is its codes: e4m3 only
  ref::quantize_fp8_experts({x.view(), cnt.view(), q4.view(), s4.view()});
  QuantizeTransposedArgs from_codes;
  from_codes.x = q4.view();
  from_codes.counts = cnt.view();
  from_codes.qt = qt.view();
  from_codes.qt_scales = qs.view();
  from_codes.tensor_scales = s4.view();
  expect_e5m2_refused(from_codes);
}

}  // namespace
}  // namespace moerail
