// CPU reference of FP8 e4m3 quantization. Contract: include/moerail/reference/quant.h, formats: moerail/quant.h.
//
// The conversions work on the bits of the fp32 value: e4m3 keeps 3 of fp32's 23 mantissa bits, so rounding is a
// look at the 20 (normal range) or more (subnormal range) bits that are dropped. Everything else is one fp32
// operation at a time, in the order the GPU kernels (src/quant/quant_kernels.cuh) use.
#include "moerail/reference/quant.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

#include "moerail/error.h"
#include "moerail/reference/host.h"

namespace moerail::ref {
namespace {

constexpr std::uint32_t kF32Nan = 0x7fffffffu;      // CUDA's canonical NaN
constexpr std::uint32_t kF32MinE4M3Normal = 0x3c800000u;  // 2^-6, the smallest normal e4m3 value
constexpr std::uint32_t kF32MinE5M2Normal = 0x38800000u;  // 2^-14, the smallest normal e5m2 value

std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }
float float_of(std::uint32_t u) { return std::bit_cast<float>(u); }

// Rounds the unsigned integer v / 2^shift to the nearest integer, ties to even (shift >= 1).
std::uint32_t shift_round_even(std::uint32_t v, int shift) {
  if (shift >= 32) return 0;  // v < 2^24 here: far below one half
  const std::uint32_t kept = v >> shift, rest = v & ((1u << shift) - 1u), half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

}  // namespace

// ---- single values --------------------------------------------------------------------------------------------

std::uint8_t float_to_e4m3(float x) {
  const std::uint32_t u = bits_of(x);
  const std::uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return kE4M3NaN;
  // Every |x| >= 448 rounds to 448 or beyond (464 is the tie between 448 and the would-be 480: even is 448).
  if (float_of(a) >= kE4M3Max) return std::uint8_t(sign | 0x7eu);
  if (a >= kF32MinE4M3Normal) {
    // Normal: e4m3 exponent E + 7 with E the fp32 exponent in [-6, 8]; the top 3 mantissa bits stay. A carry out of
    // the mantissa lands in the exponent, which is the right next value; |x| < 448 never rounds beyond 0x7e.
    const std::uint32_t e = (a >> 23) - 127u + 7u;
    const std::uint32_t code = (e << 3) | ((a >> 20) & 7u);
    const std::uint32_t rest = a & 0xfffffu, half = 0x80000u;
    return std::uint8_t(sign | (code + ((rest > half || (rest == half && (code & 1u))) ? 1u : 0u)));
  }
  if ((a >> 23) == 0) return std::uint8_t(sign);  // fp32 zero or subnormal: below 2^-126, rounds to zero
  // Subnormal e4m3: value = m * 2^-9, m in [0, 8] (8 is the smallest normal, code 0x08). With the significand
  // s = 1.mantissa * 2^23 and fp32 exponent E <= -7: m = round(s * 2^(E - 23 + 9)) = round(s / 2^(14 - E)).
  const int E = int(a >> 23) - 127;
  const std::uint32_t s = (a & 0x7fffffu) | 0x800000u;
  return std::uint8_t(sign | shift_round_even(s, 14 - E));
}

float e4m3_to_float(std::uint8_t code) {
  if ((code & 0x7fu) == 0x7fu) return float_of(kF32Nan);
  const std::uint32_t sign = std::uint32_t(code & 0x80u) << 24, e = (code >> 3) & 0xfu, m = code & 7u;
  if (e == 0) {
    const float v = float(m) * 0x1p-9f;  // exact
    return sign ? -v : v;
  }
  return float_of(sign | ((e - 7u + 127u) << 23) | (m << 20));
}

std::uint8_t float_to_e5m2(float x) {
  const std::uint32_t u = bits_of(x);
  const std::uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;
  if (float_of(a) >= kE5M2Max) return std::uint8_t(sign | 0x7bu);  // satfinite: 61440 would round up to inf
  if (a >= kF32MinE5M2Normal) {
    // Normal: e5m2 exponent E + 15 with E the fp32 exponent in [-14, 15]; the top 2 mantissa bits stay. A carry out
    // of the mantissa lands in the exponent; |x| < 57344 never rounds beyond 0x7b.
    const std::uint32_t e = (a >> 23) - 127u + 15u;
    const std::uint32_t code = (e << 2) | ((a >> 21) & 3u);
    const std::uint32_t rest = a & 0x1fffffu, half = 0x100000u;
    return std::uint8_t(sign | (code + ((rest > half || (rest == half && (code & 1u))) ? 1u : 0u)));
  }
  if ((a >> 23) == 0) return std::uint8_t(sign);  // fp32 zero or subnormal: rounds to zero
  // Subnormal e5m2: value = m * 2^-16, m in [0, 4] (4 is the smallest normal, code 0x04): m = round(s / 2^(7 - E)).
  const int E = int(a >> 23) - 127;
  const std::uint32_t s = (a & 0x7fffffu) | 0x800000u;
  return std::uint8_t(sign | shift_round_even(s, 7 - E));
}

float e5m2_to_float(std::uint8_t code) {
  const std::uint32_t mag = code & 0x7fu;
  if (mag > 0x7cu) return float_of(kF32Nan);
  const std::uint32_t sign = std::uint32_t(code & 0x80u) << 24;
  if (mag == 0x7cu) return float_of(sign | 0x7f800000u);
  const std::uint32_t e = mag >> 2, m = mag & 3u;
  if (e == 0) {
    const float v = float(m) * 0x1p-16f;  // exact
    return sign ? -v : v;
  }
  return float_of(sign | ((e - 15u + 127u) << 23) | (m << 21));
}

float e8m0_to_float(std::uint8_t code) {
  if (code == kE8M0NaN) return float_of(kF32Nan);
  if (code == 0) return float_of(0x00400000u);  // 2^-127: an fp32 subnormal
  return float_of(std::uint32_t(code) << 23);
}

// ---- scale rules ------------------------------------------------------------------------------------------------

float block_scale_from_amax(float amax) {
  const float s = amax / kE4M3Max;
  return s >= std::numeric_limits<float>::min() ? s : 1.0f;  // 1 / s stays finite
}

float tensor_scale_from_amax(float amax, float fp8_max) {
  const float s = amax / fp8_max;
  return s >= std::numeric_limits<float>::min() ? s : 1.0f;
}

std::uint8_t mx_scale_from_amax(float amax) {
  const float t = amax / kE4M3Max;
  if (!(t <= std::numeric_limits<float>::max())) return kE8M0NaN;  // inf (or NaN)
  const std::uint32_t u = bits_of(t), exp = u >> 23, man = u & 0x7fffffu;  // t >= 0: no sign bit
  if (exp == 0) return man > 0x400000u ? 1 : 0;  // t <= 2^-127 (= man 0x400000 in the subnormal range): code 0
  const std::uint32_t code = exp + (man != 0 ? 1u : 0u);
  return std::uint8_t(code < 254u ? code : 254u);
}

// ---- tensors ----------------------------------------------------------------------------------------------------

namespace {

struct Shape {
  std::int64_t rows, H, block;  // block: columns per scale, 0 for PerTensor
};

std::int64_t block_cols_of(std::string_view op, Fp8Scaling scaling) {
  switch (scaling) {
    case Fp8Scaling::PerTensor: case Fp8Scaling::Block1x128: case Fp8Scaling::Mx1x32:
      return fp8_scale_block_cols(scaling);
  }
  fail(op, "scaling = ", int(scaling), " is not one of {PerTensor, Block1x128, Mx1x32}");
}

// Checks the data view (name, dtypes) and the scale view against it; returns the shape.
Shape check_common(std::string_view op, Fp8Scaling scaling, std::string_view data_name, const TensorView& data,
                   std::initializer_list<DType> data_dtypes, const TensorView& scale) {
  const std::int64_t block = block_cols_of(op, scaling);
  check_device(op, data_name, data, Device::host());
  check_shape(op, data_name, data, {-1, -1});
  check_dtype(op, data_name, data, data_dtypes);
  const Shape s{data.size(0), data.size(1), block};
  if (block > 0 && s.H % block != 0)
    fail(op, data_name, " has ", s.H, " columns but ", fp8_scaling_name(scaling), " scaling needs a multiple of ",
         block, " (H % ", block, " == 0)");
  check_device(op, "scale", scale, Device::host());
  if (block == 0)
    check_shape(op, "scale", scale, {1});
  else
    check_shape(op, "scale", scale, {s.rows, s.H / block});
  check_dtype(op, "scale", scale, {fp8_scale_dtype(scaling)});
  return s;
}

// Scale number `index` of the scale tensor, decoded to fp32.
float scale_at(Fp8Scaling scaling, const void* scales, std::int64_t index) {
  if (scaling == Fp8Scaling::Mx1x32) return e8m0_to_float(static_cast<const std::uint8_t*>(scales)[index]);
  return static_cast<const float*>(scales)[index];
}

}  // namespace

void quantize_fp8(Fp8Scaling scaling, const TensorView& x, const TensorView& q, const TensorView& scale) {
  constexpr std::string_view op = "quantize_fp8";
  const Shape s = check_common(op, scaling, "x", x, {DType::BF16, DType::F32}, scale);
  check_device(op, "q", q, Device::host());
  check_shape(op, "q", q, {s.rows, s.H});
  check_dtype(op, "q", q, {DType::F8E4M3});
  if (scaling == Fp8Scaling::PerTensor) {
    const float v = scale.as<const float>()[0];
    if (!(std::isfinite(v) && v > 0.0f))
      fail(op, "scale = ", v, " but a finite scale > 0 was expected (x is approximately q * scale)");
  }

  const bool bf16 = x.dtype() == DType::BF16;
  auto load = [&](std::int64_t i) {
    return bf16 ? bf16_bits_to_float(x.as<const std::uint16_t>()[i]) : x.as<const float>()[i];
  };
  std::uint8_t* out = q.as<std::uint8_t>();
  const std::int64_t block = s.block > 0 ? s.block : s.H;  // PerTensor: one pass per row, the given scale
  for (std::int64_t r = 0; r < s.rows; ++r) {
    for (std::int64_t c0 = 0; c0 < s.H; c0 += block) {
      const std::int64_t base = r * s.H + c0;
      float sc = 1.0f;
      if (scaling == Fp8Scaling::PerTensor) {
        sc = scale.as<const float>()[0];
      } else {
        float amax = 0.0f;
        for (std::int64_t j = 0; j < block; ++j) amax = std::fmax(amax, std::fabs(load(base + j)));  // skips NaN
        const std::int64_t si = base / block;  // [rows, H / block] row-major
        if (scaling == Fp8Scaling::Block1x128) {
          sc = block_scale_from_amax(amax);
          scale.as<float>()[si] = sc;
        } else {
          const std::uint8_t code = mx_scale_from_amax(amax);
          scale.as<std::uint8_t>()[si] = code;
          sc = e8m0_to_float(code);
        }
      }
      const float inv = 1.0f / sc;  // one reciprocal per scale group, then a product per element
      for (std::int64_t j = 0; j < block; ++j) out[base + j] = float_to_e4m3(load(base + j) * inv);
    }
  }
}

void dequantize_fp8(Fp8Scaling scaling, const TensorView& q, const TensorView& scale, const TensorView& out) {
  constexpr std::string_view op = "dequantize_fp8";
  const Shape s = check_common(op, scaling, "q", q, {DType::F8E4M3}, scale);
  check_device(op, "out", out, Device::host());
  check_shape(op, "out", out, {s.rows, s.H});
  check_dtype(op, "out", out, {DType::BF16, DType::F32});

  const std::uint8_t* codes = q.as<const std::uint8_t>();
  const bool bf16 = out.dtype() == DType::BF16;
  for (std::int64_t i = 0; i < s.rows * s.H; ++i) {
    const float sc = scale_at(scaling, scale.data(), s.block > 0 ? i / s.block : 0);
    const float v = e4m3_to_float(codes[i]) * sc;
    if (bf16)
      out.as<std::uint16_t>()[i] = float_to_bf16_bits(v);
    else
      out.as<float>()[i] = v;
  }
}

// ---- weights: 128x128 blocks -------------------------------------------------------------------------------------

void quantize_weights_fp8(const QuantizeWeightsArgs& a) {
  constexpr std::string_view op = "quantize_weights_fp8";
  constexpr std::int64_t B = kWeightScaleBlock;
  const Device host = Device::host();
  if (!a.w.defined()) fail(op, "w is absent but required");
  check_device(op, "w", a.w, host);
  check_shape(op, "w", a.w, {-1, -1, -1});
  check_dtype(op, "w", a.w, {DType::BF16, DType::F32});
  const std::int64_t L = a.w.size(0), N = a.w.size(1), K = a.w.size(2);
  if (K % B != 0)
    fail(op, "w has shape ", a.w.shape_str(), " but K = ", K, " is not a multiple of ", B,
         " (the 128x128 scale blocks tile K exactly)");
  const bool tensor = a.scaling == Fp8Scaling::PerTensor;
  if (!tensor && a.scaling != Fp8Scaling::Block1x128)
    fail(op, "scaling = ", int(a.scaling), " but Block1x128 or PerTensor is supported");
  const std::int64_t nb = (N + B - 1) / B, kb = K / B;
  check_device(op, "q", a.q, host);
  check_shape(op, "q", a.q, {L, N, K});
  check_dtype(op, "q", a.q, {DType::F8E4M3});
  check_device(op, "q_scales", a.q_scales, host);
  if (tensor) check_shape(op, "q_scales", a.q_scales, {L});
  else check_shape(op, "q_scales", a.q_scales, {L, nb, kb});
  check_dtype(op, "q_scales", a.q_scales, {DType::F32});
  const bool transposed = a.qt.defined();
  if (transposed) {
    if (N % B != 0)
      fail(op, "qt is given but N = ", N, " (w ", a.w.shape_str(), ") is not a multiple of ", B,
           " (N is the reduction dimension of the dgrad GEMM that reads qt)");
    check_device(op, "qt", a.qt, host);
    check_shape(op, "qt", a.qt, {L, K, N});
    check_dtype(op, "qt", a.qt, {DType::F8E4M3});
    check_device(op, "qt_scales", a.qt_scales, host);
    if (tensor) check_shape(op, "qt_scales", a.qt_scales, {L});
    else check_shape(op, "qt_scales", a.qt_scales, {L, kb, nb});
    check_dtype(op, "qt_scales", a.qt_scales, {DType::F32});
  } else if (a.qt_scales.defined()) {
    fail(op, "qt_scales is given but qt is not (both or neither)");
  }

  const bool bf16 = a.w.dtype() == DType::BF16;
  auto load = [&](std::int64_t i) {
    return bf16 ? bf16_bits_to_float(a.w.as<const std::uint16_t>()[i]) : a.w.as<const float>()[i];
  };
  std::uint8_t* q = a.q.as<std::uint8_t>();
  std::uint8_t* qt = transposed ? a.qt.as<std::uint8_t>() : nullptr;
  if (tensor) {  // one scale per expert's matrix
    for (std::int64_t e = 0; e < L; ++e) {
      float amax = 0.0f;
      for (std::int64_t i = e * N * K; i < (e + 1) * N * K; ++i) amax = std::fmax(amax, std::fabs(load(i)));
      const float sc = tensor_scale_from_amax(amax, kE4M3Max), inv = 1.0f / sc;
      a.q_scales.as<float>()[e] = sc;
      if (transposed) a.qt_scales.as<float>()[e] = sc;
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t k = 0; k < K; ++k) {
          const std::uint8_t code = float_to_e4m3(load((e * N + n) * K + k) * inv);
          q[(e * N + n) * K + k] = code;
          if (transposed) qt[(e * K + k) * N + n] = code;
        }
    }
    return;
  }
  for (std::int64_t e = 0; e < L; ++e)
    for (std::int64_t bn = 0; bn < nb; ++bn)
      for (std::int64_t bk = 0; bk < kb; ++bk) {
        const std::int64_t n0 = bn * B, n1 = std::min(N, n0 + B), k0 = bk * B;
        float amax = 0.0f;
        for (std::int64_t n = n0; n < n1; ++n)
          for (std::int64_t k = k0; k < k0 + B; ++k)
            amax = std::fmax(amax, std::fabs(load((e * N + n) * K + k)));  // skips NaN
        const float sc = block_scale_from_amax(amax);
        a.q_scales.as<float>()[(e * nb + bn) * kb + bk] = sc;
        if (transposed) a.qt_scales.as<float>()[(e * kb + bk) * nb + bn] = sc;
        const float inv = 1.0f / sc;  // one reciprocal per block, then a product per element
        for (std::int64_t n = n0; n < n1; ++n)
          for (std::int64_t k = k0; k < k0 + B; ++k) {
            const std::uint8_t code = float_to_e4m3(load((e * N + n) * K + k) * inv);
            q[(e * N + n) * K + k] = code;
            if (transposed) qt[(e * K + k) * N + n] = code;
          }
      }
}

namespace {

// Segment starts as every moerail op clips them: count < 0 reads as 0, segments end at `rows`; start[L] = rows used.
std::vector<std::int64_t> clipped_starts(const TensorView& counts, std::int64_t rows) {
  const std::int64_t L = counts.size(0);
  std::vector<std::int64_t> start(static_cast<std::size_t>(L + 1), 0);
  for (std::int64_t e = 0; e < L; ++e) {
    const std::int64_t c = counts.dtype() == DType::I64 ? counts.as<const std::int64_t>()[e]
                                                        : std::int64_t(counts.as<const std::int32_t>()[e]);
    start[std::size_t(e + 1)] = std::min(rows, start[std::size_t(e)] + std::clamp<std::int64_t>(c, 0, rows));
  }
  return start;
}

}  // namespace

namespace {

// The per-tensor form of quantize_fp8_transposed (tensor_scales given; checked by the caller but for them).
void quantize_transposed_per_tensor(const QuantizeTransposedArgs& a, const std::vector<std::int64_t>& start) {
  constexpr std::string_view op = "quantize_fp8_transposed";
  const std::int64_t rows = a.x.size(0), C = a.x.size(1), L = a.counts.size(0);
  check_device(op, "tensor_scales", a.tensor_scales, Device::host());
  check_shape(op, "tensor_scales", a.tensor_scales, {L});
  check_dtype(op, "tensor_scales", a.tensor_scales, {DType::F32});
  if (a.q_scales.defined()) fail(op, "q_scales with tensor_scales (the per-tensor form's row codes use them)");
  const float* ts = a.tensor_scales.as<const float>();
  const DType t = a.x.dtype();
  const bool e5m2 = a.qt.dtype() == DType::F8E5M2;  // the hybrid recipe's gradients (bf16 or f32 x only)
  auto encode = [e5m2](float v) { return e5m2 ? float_to_e5m2(v) : float_to_e4m3(v); };
  auto value = [&](std::int64_t r, std::int64_t c, float inv) {  // what is encoded: x / s, or (e4m3 x) the code
    const std::int64_t i = r * C + c;
    if (t == DType::F8E4M3) return e4m3_to_float(a.x.as<const std::uint8_t>()[i]);
    return (t == DType::BF16 ? bf16_bits_to_float(a.x.as<const std::uint16_t>()[i]) : a.x.as<const float>()[i]) * inv;
  };
  constexpr std::int64_t B = kBlockScaleCols;
  std::uint8_t* qt = a.qt.as<std::uint8_t>();
  float* qs = a.qt_scales.as<float>();
  std::int64_t padded = 0;  // P_e
  for (std::int64_t e = 0; e < L; ++e) {
    const std::int64_t first = start[std::size_t(e)], n = start[std::size_t(e + 1)] - first;
    const std::int64_t R = (n + B - 1) / B * B;
    const float inv = 1.0f / ts[e];
    for (std::int64_t c = 0; c < C; ++c) {
      for (std::int64_t b = 0; b < R; b += B) qs[C * padded / B + c * (R / B) + b / B] = ts[e];
      for (std::int64_t i = 0; i < R; ++i)
        qt[C * padded + c * R + i] = encode(i < n ? value(first + i, c, inv) : 0.0f);
    }
    if (a.q.defined())
      for (std::int64_t r = first; r < first + n; ++r)
        for (std::int64_t c = 0; c < C; ++c) a.q.as<std::uint8_t>()[r * C + c] = encode(value(r, c, inv));
    padded += R;
  }
  (void)rows;
}

// The expert counts of a segment quantizer's reference: [L] i32 or i64 on the host, L >= 1. Returns L.
std::int64_t check_expert_counts(std::string_view op, const TensorView& counts) {
  if (!counts.defined()) fail(op, "counts is absent but required");
  check_device(op, "counts", counts, Device::host());
  check_shape(op, "counts", counts, {-1});
  check_dtype(op, "counts", counts, {DType::I32, DType::I64});
  if (counts.size(0) < 1) fail(op, "counts has shape ", counts.shape_str(), " but at least one expert is needed");
  return counts.size(0);
}

}  // namespace

void quantize_fp8_transposed(const QuantizeTransposedArgs& a) {
  constexpr std::string_view op = "quantize_fp8_transposed";
  const Device host = Device::host();
  const bool tensor = a.tensor_scales.defined();
  const bool fp8_source = a.x_scales.defined() || (tensor && a.x.defined() && a.x.dtype() == DType::F8E4M3);
  const bool row_q = a.q.defined() || a.q_scales.defined();
  if (!a.x.defined()) fail(op, "x is absent but required");
  check_device(op, "x", a.x, host);
  check_shape(op, "x", a.x, {-1, -1});
  if (tensor && a.x_scales.defined()) fail(op, "x_scales with tensor_scales (an e4m3 x's scales are tensor_scales)");
  if (fp8_source) check_dtype(op, "x", a.x, {DType::F8E4M3});
  else check_dtype(op, "x", a.x, {DType::BF16, DType::F32});
  const std::int64_t L = check_expert_counts(op, a.counts);
  const std::int64_t rows = a.x.size(0), C = a.x.size(1);
  if ((fp8_source || row_q) && C % kBlockScaleCols != 0)
    fail(op, "x has shape ", a.x.shape_str(), " but its columns C = ", C, " must be a multiple of 128 (",
         fp8_source ? "x_scales" : "q", ": 1x128 blocks along the columns)");
  const std::int64_t rows_t = fp8_transposed_rows(rows, L);
  if (fp8_source && row_q) fail(op, "q / q_scales with an FP8 x: the row-wise codes are x itself");
  if (!a.qt.defined()) fail(op, "qt is absent but required");
  // The codes' format: qt's dtype, e5m2 only in the per-tensor form from a bf16 or f32 x (q, when given, the same).
  const bool e5m2 = a.qt.dtype() == DType::F8E5M2;
  if (e5m2 && (!tensor || fp8_source))
    fail_with(ErrorCode::Unsupported, op,
              "qt is fp8_e5m2, which the per-tensor form from a bf16 or f32 x writes only (tensor_scales given)");
  const DType codes = e5m2 ? DType::F8E5M2 : DType::F8E4M3;
  if (fp8_source && !tensor) {
    check_device(op, "x_scales", a.x_scales, host);
    check_shape(op, "x_scales", a.x_scales, {rows, C / kBlockScaleCols});
    check_dtype(op, "x_scales", a.x_scales, {DType::F32});
  }
  if (row_q) {
    if (!a.q.defined()) fail(op, "q_scales is given but q is absent (both or neither)");
    if (!tensor && !a.q_scales.defined()) fail(op, "q is given but q_scales is absent (both or neither)");
    if (a.x.dtype() != DType::BF16) fail(op, "q with an f32 x (the row-wise form takes bf16, as the GPU op)");
    check_device(op, "q", a.q, host);
    check_shape(op, "q", a.q, {rows, C});
    check_dtype(op, "q", a.q, {codes});
  }
  if (row_q && !tensor) {
    check_device(op, "q_scales", a.q_scales, host);
    check_shape(op, "q_scales", a.q_scales, {rows, C / kBlockScaleCols});
    check_dtype(op, "q_scales", a.q_scales, {DType::F32});
  }
  if (!a.qt_scales.defined()) fail(op, "qt_scales is absent but required");
  check_device(op, "qt", a.qt, host);
  check_shape(op, "qt", a.qt, {C * rows_t});
  check_dtype(op, "qt", a.qt, {codes});
  check_device(op, "qt_scales", a.qt_scales, host);
  check_shape(op, "qt_scales", a.qt_scales, {C * rows_t / kBlockScaleCols});
  check_dtype(op, "qt_scales", a.qt_scales, {DType::F32});

  const std::vector<std::int64_t> start = clipped_starts(a.counts, rows);
  if (tensor) {
    quantize_transposed_per_tensor(a, start);
    return;
  }
  if (fp8_source) {  // x's FP8 value rounded to bf16 (dequantize_fp8), then the bf16 form
    HostTensor xd(DType::BF16, {rows, C});
    dequantize_fp8(Fp8Scaling::Block1x128, a.x, a.x_scales, xd.view());
    QuantizeTransposedArgs b = a;
    b.x = xd.view();
    b.x_scales = TensorView();
    quantize_fp8_transposed(b);
    return;
  }
  if (row_q) {  // quantize_fp8 of the segment rows [0, end of the last segment)
    const std::int64_t n = start.back();
    auto first_rows = [n](const TensorView& t) {
      return TensorView(t.data(), t.dtype(), {n, t.size(1)}, t.device());
    };
    quantize_fp8(Fp8Scaling::Block1x128, first_rows(a.x), first_rows(a.q), first_rows(a.q_scales));
  }
  const bool bf16 = a.x.dtype() == DType::BF16;
  auto load = [&](std::int64_t r, std::int64_t c) {
    const std::int64_t i = r * C + c;
    return bf16 ? bf16_bits_to_float(a.x.as<const std::uint16_t>()[i]) : a.x.as<const float>()[i];
  };
  std::uint8_t* qt = a.qt.as<std::uint8_t>();
  float* qs = a.qt_scales.as<float>();
  constexpr std::int64_t B = kBlockScaleCols;
  std::int64_t padded = 0;  // P_e
  for (std::int64_t e = 0; e < L; ++e) {
    const std::int64_t first = start[std::size_t(e)], n = start[std::size_t(e + 1)] - first;
    const std::int64_t R = (n + B - 1) / B * B;
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t b = 0; b < R; b += B) {
        const std::int64_t valid = std::min(B, n - b);  // rows past the segment read as zeros
        float amax = 0.0f;
        for (std::int64_t i = 0; i < valid; ++i) amax = std::fmax(amax, std::fabs(load(first + b + i, c)));
        const float sc = block_scale_from_amax(amax);
        qs[C * padded / B + c * (R / B) + b / B] = sc;
        const float inv = 1.0f / sc;
        for (std::int64_t i = 0; i < B; ++i)
          qt[C * padded + c * R + b + i] = float_to_e4m3((i < valid ? load(first + b + i, c) : 0.0f) * inv);
      }
    padded += R;
  }
}

// ---- per-tensor scales per expert -----------------------------------------------------------------------------------

void quantize_fp8_experts(const QuantizeExpertsArgs& a) {
  constexpr std::string_view op = "quantize_fp8_experts";
  const Device host = Device::host();
  if (!a.x.defined()) fail(op, "x is absent but required");
  check_device(op, "x", a.x, host);
  check_shape(op, "x", a.x, {-1, -1});
  check_dtype(op, "x", a.x, {DType::BF16, DType::F32});
  const std::int64_t L = check_expert_counts(op, a.counts);
  const std::int64_t rows = a.x.size(0), C = a.x.size(1);
  if (!a.scales.defined()) fail(op, "scales is absent but required");
  check_device(op, "scales", a.scales, host);
  check_shape(op, "scales", a.scales, {L});
  check_dtype(op, "scales", a.scales, {DType::F32});
  if (a.format != DType::F8E4M3 && a.format != DType::F8E5M2)
    fail(op, "format = ", dtype_name(a.format), " but fp8_e4m3 or fp8_e5m2 is expected");
  if (a.q.defined()) {
    check_device(op, "q", a.q, host);
    check_shape(op, "q", a.q, {rows, C});
    check_dtype(op, "q", a.q, {a.format});
  }
  const bool e5m2 = a.format == DType::F8E5M2;
  const bool bf16 = a.x.dtype() == DType::BF16;
  auto load = [&](std::int64_t i) {
    return bf16 ? bf16_bits_to_float(a.x.as<const std::uint16_t>()[i]) : a.x.as<const float>()[i];
  };
  const std::vector<std::int64_t> start = clipped_starts(a.counts, rows);
  for (std::int64_t e = 0; e < L; ++e) {
    const std::int64_t i0 = start[std::size_t(e)] * C, i1 = start[std::size_t(e + 1)] * C;
    float amax = 0.0f;
    for (std::int64_t i = i0; i < i1; ++i) amax = std::fmax(amax, std::fabs(load(i)));  // skips NaN
    const float sc = tensor_scale_from_amax(amax, fp8_max(a.format)), inv = 1.0f / sc;
    a.scales.as<float>()[e] = sc;
    if (a.q.defined())
      for (std::int64_t i = i0; i < i1; ++i)
        a.q.as<std::uint8_t>()[i] = e5m2 ? float_to_e5m2(load(i) * inv) : float_to_e4m3(load(i) * inv);
  }
}

}  // namespace moerail::ref
