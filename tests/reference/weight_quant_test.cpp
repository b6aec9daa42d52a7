// Tests of the CPU reference weight quantizer (ref::quantize_weights_fp8, contract in moerail/quant.h): 128x128
// block scales are amax / 448 over exactly the block's elements (a partial last block of rows when N % 128 != 0),
// codes are e4m3(w * (1 / scale)), zero and tiny blocks get scale 1, NaN is skipped by amax and coded 0x7f, the
// transposed copy is the transpose of the codes and of the scale grid bit for bit and equals quantizing w^T, and
// the argument errors name the argument and write nothing.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
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

using ref::HostTensor;
using ref::Rng;

constexpr std::int64_t B = kWeightScaleBlock;

std::uint8_t* codes(const HostTensor& t) { return static_cast<std::uint8_t*>(t.view().data()); }
float* f32(const HostTensor& t) { return static_cast<float*>(t.view().data()); }

// w [L, N, K] with one magnitude per 128x128 block (2^-20 .. 2^20): a scale read from a neighbouring block is off
// by binades, not by a rounding.
HostTensor random_weights(DType dtype, std::int64_t L, std::int64_t N, std::int64_t K, std::uint64_t seed) {
  HostTensor w(dtype, {L, N, K});
  Rng rng(seed);
  const std::int64_t nb = (N + B - 1) / B, kb = K / B;
  std::vector<double> mag(std::size_t(L * nb * kb));
  for (double& m : mag) m = std::ldexp(1.0, int(rng.below(41)) - 20);
  for (std::int64_t e = 0; e < L; ++e)
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t k = 0; k < K; ++k)
        w.set_f((e * N + n) * K + k, rng.normal() * mag[std::size_t((e * nb + n / B) * kb + k / B)]);
  return w;
}

struct Quantized {
  HostTensor q, s, qt, st;
  Quantized(std::int64_t L, std::int64_t N, std::int64_t K, bool transposed)
      : q(DType::F8E4M3, {L, N, K}), s(DType::F32, {L, (N + B - 1) / B, K / B}),
        qt(DType::F8E4M3, transposed ? std::vector<std::int64_t>{L, K, N} : std::vector<std::int64_t>{0}),
        st(DType::F32, transposed ? std::vector<std::int64_t>{L, K / B, (N + B - 1) / B} : std::vector<std::int64_t>{0}) {}
  QuantizeWeightsArgs args(const HostTensor& w, bool transposed) const {
    QuantizeWeightsArgs a;
    a.w = w.view();
    a.q = q.view();
    a.q_scales = s.view();
    if (transposed) {
      a.qt = qt.view();
      a.qt_scales = st.view();
    }
    return a;
  }
};

// Checks q and s against the definition, block by block: the scale from the amax of exactly the block's elements,
// the codes from one reciprocal per block.
void expect_definition(const HostTensor& w, const Quantized& r) {
  const std::int64_t L = w.view().size(0), N = w.view().size(1), K = w.view().size(2);
  const std::int64_t nb = (N + B - 1) / B, kb = K / B;
  for (std::int64_t e = 0; e < L; ++e)
    for (std::int64_t bn = 0; bn < nb; ++bn)
      for (std::int64_t bk = 0; bk < kb; ++bk) {
        float amax = 0.0f;
        for (std::int64_t n = bn * B; n < std::min(N, bn * B + B); ++n)
          for (std::int64_t k = bk * B; k < bk * B + B; ++k)
            amax = std::fmax(amax, std::fabs(float(w.f((e * N + n) * K + k))));
        const float sc = f32(r.s)[(e * nb + bn) * kb + bk];
        ASSERT_EQ(std::bit_cast<std::uint32_t>(sc), std::bit_cast<std::uint32_t>(ref::block_scale_from_amax(amax)))
            << "q_scales[" << e << ", " << bn << ", " << bk << "] amax " << amax;
        if (amax / 448.0f >= std::numeric_limits<float>::min()) EXPECT_EQ(sc, amax / 448.0f);
        const float inv = 1.0f / sc;
        bool saw_max = !(amax > 0);
        for (std::int64_t n = bn * B; n < std::min(N, bn * B + B); ++n)
          for (std::int64_t k = bk * B; k < bk * B + B; ++k) {
            const std::int64_t i = (e * N + n) * K + k;
            const float x = float(w.f(i));
            ASSERT_EQ(codes(r.q)[i], ref::float_to_e4m3(x * inv)) << "w[" << e << ", " << n << ", " << k << "] = " << x;
            if (std::fabs(x) == amax && amax > 0 && amax / 448.0f >= std::numeric_limits<float>::min()) {
              EXPECT_EQ(codes(r.q)[i] & 0x7f, 0x7e) << "the block's largest element lands on ±448";
              saw_max = true;
            }
          }
        if (amax / 448.0f >= std::numeric_limits<float>::min()) EXPECT_TRUE(saw_max);
      }
}

// qt and st against the transpose of q and s, bit for bit.
void expect_transpose(const Quantized& r, std::int64_t L, std::int64_t N, std::int64_t K) {
  const std::int64_t nb = N / B, kb = K / B;
  for (std::int64_t e = 0; e < L; ++e) {
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t k = 0; k < K; ++k)
        ASSERT_EQ(codes(r.qt)[(e * K + k) * N + n], codes(r.q)[(e * N + n) * K + k])
            << "qt[" << e << ", " << k << ", " << n << "] != q[" << e << ", " << n << ", " << k << "]";
    for (std::int64_t bn = 0; bn < nb; ++bn)
      for (std::int64_t bk = 0; bk < kb; ++bk)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(f32(r.st)[(e * kb + bk) * nb + bn]),
                  std::bit_cast<std::uint32_t>(f32(r.s)[(e * nb + bn) * kb + bk]))
            << "qt_scales[" << e << ", " << bk << ", " << bn << "]";
  }
}

TEST(QuantWeights, BlockScalesAndCodesFollowTheDefinition) {
  const std::int64_t L = 2, N = 384, K = 256;
  for (DType dt : {DType::BF16, DType::F32}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    HostTensor w = random_weights(dt, L, N, K, 21);
    w.set_f((1 * N + 200) * K + 7, std::numeric_limits<double>::quiet_NaN());  // skipped by amax, coded 0x7f
    Quantized r(L, N, K, false);
    ref::quantize_weights_fp8(r.args(w, false));
    expect_definition(w, r);
    EXPECT_EQ(codes(r.q)[(1 * N + 200) * K + 7], 0x7f);
  }
}

TEST(QuantWeights, PartialLastBlockOfRows) {
  // N = 328: blocks of 128, 128 and 72 rows. The partial block's largest element is placed in its last row, and a
  // much larger value sits in the full block above it: the partial block's scale must come from its own 72 rows.
  const std::int64_t L = 3, N = 328, K = 384;
  HostTensor w = random_weights(DType::BF16, L, N, K, 22);
  w.set_f((2 * N + 327) * K + 130, 0x1p30);  // beyond every random value (|w| < 2^26)
  w.set_f((2 * N + 255) * K + 131, -0x1p31);
  Quantized r(L, N, K, false);
  ref::quantize_weights_fp8(r.args(w, false));
  expect_definition(w, r);
  const std::int64_t nb = 3, kb = 3;
  EXPECT_EQ(f32(r.s)[(2 * nb + 2) * kb + 1], 0x1p30f / 448.0f);
  EXPECT_EQ(f32(r.s)[(2 * nb + 1) * kb + 1], 0x1p31f / 448.0f);
  EXPECT_EQ(codes(r.q)[(2 * N + 327) * K + 130], 0x7e);
}

TEST(QuantWeights, TransposedCopyIsTheTransposeBitForBit) {
  const std::int64_t L = 3, N = 256, K = 384;
  HostTensor w = random_weights(DType::BF16, L, N, K, 23);
  for (std::int64_t n = 128; n < 256; ++n)
    for (std::int64_t k = 0; k < 128; ++k) w.set_f((1 * N + n) * K + k, 0.0);  // a zero block (expert 1, block (1, 0))
  Quantized r(L, N, K, true);
  ref::quantize_weights_fp8(r.args(w, true));
  expect_definition(w, r);
  expect_transpose(r, L, N, K);

  // A 128x128 block has the amax of its transpose: quantizing w^T [L, K, N] on its own gives the same bits.
  HostTensor wt(DType::BF16, {L, K, N});
  for (std::int64_t e = 0; e < L; ++e)
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t k = 0; k < K; ++k) wt.set_f((e * K + k) * N + n, w.f((e * N + n) * K + k));
  Quantized rt(L, K, N, false);
  ref::quantize_weights_fp8(rt.args(wt, false));
  EXPECT_EQ(std::memcmp(rt.q.view().data(), r.qt.view().data(), r.qt.view().nbytes()), 0);
  EXPECT_EQ(std::memcmp(rt.s.view().data(), r.st.view().data(), r.st.view().nbytes()), 0);

  // Without qt the non-transposed outputs are the same.
  Quantized r2(L, N, K, false);
  ref::quantize_weights_fp8(r2.args(w, false));
  EXPECT_EQ(std::memcmp(r2.q.view().data(), r.q.view().data(), r.q.view().nbytes()), 0);
  EXPECT_EQ(std::memcmp(r2.s.view().data(), r.s.view().data(), r.s.view().nbytes()), 0);
}

TEST(QuantWeights, ZeroAndTinyBlocksGetScaleOne) {
  const std::int64_t L = 1, N = 256, K = 256;
  HostTensor w(DType::F32, {L, N, K});
  for (std::int64_t i = 0; i < N * K; ++i) w.set_f(i, (i % 2) ? 0.0 : -0.0);  // block (0,0) and the rest: zeros
  for (std::int64_t n = 0; n < 128; ++n)                                     // block (0, 1): amax / 448 < FLT_MIN
    for (std::int64_t k = 128; k < 256; ++k) w.set_f(n * K + k, (n + k) % 3 ? 1e-37 : -2e-37);
  w.set_f(200 * K + 200, 1.0);  // block (1, 1): an ordinary block
  Quantized r(L, N, K, true);
  ref::quantize_weights_fp8(r.args(w, true));
  expect_definition(w, r);
  expect_transpose(r, L, N, K);
  EXPECT_EQ(f32(r.s)[0], 1.0f);
  EXPECT_EQ(f32(r.s)[1], 1.0f);
  EXPECT_EQ(f32(r.s)[2], 1.0f);
  EXPECT_EQ(f32(r.s)[3], 1.0f / 448.0f);
  EXPECT_EQ(codes(r.q)[0], 0x80);  // -0 keeps its sign
  EXPECT_EQ(codes(r.q)[1], 0x00);
  EXPECT_EQ(codes(r.q)[128] & 0x7f, 0x00);  // 1e-37 * 1 rounds to ±0
  EXPECT_EQ(codes(r.q)[200 * K + 200], 0x7e);
}

TEST(QuantWeights, EmptyShapesWriteNothing) {
  for (auto [L, N] : {std::pair<std::int64_t, std::int64_t>{0, 256}, {2, 0}}) {
    HostTensor w(DType::BF16, {L, N, 128});
    Quantized r(L, N, 128, true);
    ref::quantize_weights_fp8(r.args(w, true));
  }
}

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    return e.what();
  }
  return "(no error)";
}

TEST(QuantWeights, ErrorsNameTheArgumentAndWriteNothing) {
  const std::int64_t L = 2, N = 256, K = 256;
  HostTensor w = random_weights(DType::BF16, L, N, K, 24);
  Quantized r(L, N, K, true);
  std::memset(r.q.view().data(), 0xab, r.q.view().nbytes());
  std::memset(r.s.view().data(), 0xab, r.s.view().nbytes());
  const QuantizeWeightsArgs good = r.args(w, true);
  auto with = [&](auto&& change) {
    QuantizeWeightsArgs a = good;
    change(a);
    return error_of([&] { ref::quantize_weights_fp8(a); });
  };

  HostTensor w_k(DType::BF16, {L, N, 200});
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) { a.w = w_k.view(); }),
            "quantize_weights_fp8: w has shape [2, 256, 200] but K = 200 is not a multiple of 128 (the 128x128 scale "
            "blocks tile K exactly)");
  HostTensor w_n(DType::BF16, {L, 200, K}), q_n(DType::F8E4M3, {L, 200, K}), s_n(DType::F32, {L, 2, 2});
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) {
              a.w = w_n.view();
              a.q = q_n.view();
              a.q_scales = s_n.view();
            }),
            "quantize_weights_fp8: qt is given but N = 200 (w [2, 200, 256]) is not a multiple of 128 (N is the "
            "reduction dimension of the dgrad GEMM that reads qt)");
  // Without qt, N = 200 is fine (a partial last block of rows).
  Quantized r_n(L, 200, K, false);
  ref::quantize_weights_fp8(r_n.args(w_n, false));

  HostTensor s_bad(DType::F32, {L, 3, 2}), q_f32(DType::F32, {L, N, K});
  HostTensor q_short(DType::F8E4M3, {L, N - 128, K});
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) { a.q = q_short.view(); }),
            "quantize_weights_fp8: q has shape [2, 128, 256] but [2, 256, 256] was expected");
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) { a.q = q_f32.view(); }),
            "quantize_weights_fp8: q has dtype f32 but one of {fp8_e4m3} was expected");
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) { a.q_scales = s_bad.view(); }),
            "quantize_weights_fp8: q_scales has shape [2, 3, 2] but [2, 2, 2] was expected");
  HostTensor qt_bad(DType::F8E4M3, {L, N, K + 128}), st_bad(DType::F32, {L, 2, 3});
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) { a.qt = qt_bad.view(); }),
            "quantize_weights_fp8: qt has shape [2, 256, 384] but [2, 256, 256] was expected");
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) { a.qt_scales = st_bad.view(); }),
            "quantize_weights_fp8: qt_scales has shape [2, 2, 3] but [2, 2, 2] was expected");
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) { a.qt = TensorView(); }),
            "quantize_weights_fp8: qt_scales is given but qt is not (both or neither)");
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) { a.w = TensorView(); }), "quantize_weights_fp8: w is absent but required");
  HostTensor w_i32(DType::I32, {L, N, K});
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) { a.w = w_i32.view(); }),
            "quantize_weights_fp8: w has dtype i32 but one of {bf16, f32} was expected");
  const TensorView on_gpu(w.view().data(), DType::BF16, {L, N, K}, Device::cuda(0));
  EXPECT_EQ(with([&](QuantizeWeightsArgs& a) { a.w = on_gpu; }),
            "quantize_weights_fp8: w is on cuda:0 but host was expected");

  for (std::size_t i = 0; i < r.q.view().nbytes(); ++i) ASSERT_EQ(codes(r.q)[i], 0xab) << "q byte " << i << " written";
  for (std::size_t i = 0; i < r.s.view().nbytes(); ++i) ASSERT_EQ(codes(r.s)[i], 0xab) << "q_scales byte " << i;
}

}  // namespace
}  // namespace moerail
