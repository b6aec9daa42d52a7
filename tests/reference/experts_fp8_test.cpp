// Tests of the reference expert MLP's FP8 recipe (Recipe::Fp8Blockwise, moerail/reference/experts.h): the same MLP
// composed from the public quantizers, forward and backward; its distance to the bf16 recipe; its refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "moerail/error.h"
#include "moerail/quant.h"
#include "moerail/recipe.h"
#include "moerail/reference/experts.h"
#include "moerail/reference/quant.h"
#include "reference/experts_harness.h"

namespace moerail {
namespace {

using namespace test::experts_ref;  // NOLINT

// ---- Recipe::Fp8Blockwise --------------------------------------------------------------------------------------------

// QDQ through the public quantizers (not the reference MLP's own code): 1x128 rows of an [rows, C] f64 tensor, and
// the 128x128 blocks of a [L, N, K] weight.
HostTensor qdq_rows_public(const HostTensor& t, std::int64_t rows, std::int64_t C) {
  HostTensor f(DType::F32, {rows, C}), q(DType::F8E4M3, {rows, C}), sc(DType::F32, {rows, C / 128}),
      out(DType::F64, {rows, C});
  for (std::int64_t i = 0; i < rows * C; ++i) f.set_f(i, t.f(i));
  ref::quantize_fp8(Fp8Scaling::Block1x128, f.view(), q.view(), sc.view());
  ref::dequantize_fp8(Fp8Scaling::Block1x128, q.view(), sc.view(), f.view());
  for (std::int64_t i = 0; i < rows * C; ++i) out.set_f(i, f.f(i));
  return out;
}
HostTensor qdq_weight_public(const HostTensor& w, std::int64_t L, std::int64_t N, std::int64_t K) {
  HostTensor f(DType::F32, {L, N, K}), q(DType::F8E4M3, {L, N, K}), sc(DType::F32, {L, (N + 127) / 128, K / 128}),
      out(DType::F64, {L, N, K});
  for (std::int64_t i = 0; i < L * N * K; ++i) f.set_f(i, w.f(i));
  QuantizeWeightsArgs a;
  a.w = f.view();
  a.q = q.view();
  a.q_scales = sc.view();
  ref::quantize_weights_fp8(a);
  for (std::int64_t e = 0; e < L; ++e)
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int64_t i = (e * N + n) * K + k;
        out.set_f(i, double(ref::e4m3_to_float(q.view().as<const std::uint8_t>()[i]) *
                            float(sc.f((e * ((N + 127) / 128) + n / 128) * (K / 128) + k / 128))));
      }
  return out;
}

// A value rounded to bf16 (where the recipe keeps h1, act, d_act and d_h1).
double bf16(double v) { return double(round_to_bf16(float(v))); }

// The FP8 forward is the MLP of the QDQ'd operands: x 1x128 along H, W1 and W2 in 128x128 blocks, h1 in bf16, the
// activation p a(h1) in bf16 then 1x128 along F; computed here from the public quantizers.
TEST(ExpertsFp8, ForwardIsTheMlpOfTheQuantizedOperands) {
  for (ProbMode mode : {ProbMode::InActivation, ProbMode::InCombine}) {
    SCOPED_TRACE(name_of(mode));
    MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, false, mode, 256, 128);
    const std::vector<std::int64_t> counts = {5, 0, 3};
    Problem p(c, counts, 2, 31);
    ref::ExpertsForwardArgs fa = p.forward_args();
    fa.recipe = Recipe::Fp8Blockwise;
    ref::experts_forward(c, fa);
    const std::vector<double> got = p.y.floats();

    // the same from parts: QDQ'd x and weights into the bf16 recipe with the GLU's output QDQ'd in between
    const std::int64_t H = 256, F = 128, F1 = 256, rows = p.rows, L = 3;
    const HostTensor xq = qdq_rows_public(p.x, rows, H);
    const HostTensor w1q = qdq_weight_public(p.w1, L, F1, H), w2q = qdq_weight_public(p.w2, L, H, F);
    HostTensor act(DType::F64, {rows, F});
    std::int64_t row = 0;
    std::vector<double> h1(static_cast<std::size_t>(F1)), a(static_cast<std::size_t>(F));
    for (std::int64_t e = 0; e < L; row += counts[std::size_t(e)], ++e)
      for (std::int64_t r = row; r < row + counts[std::size_t(e)]; ++r) {
        for (std::int64_t i = 0; i < F1; ++i) {
          double sum = 0;
          for (std::int64_t k = 0; k < H; ++k) sum += xq.f(r * H + k) * w1q.f((e * F1 + i) * H + k);
          h1[std::size_t(i)] = bf16(sum);
        }
        ref::activation_forward(c, h1, a);
        const double pr = mode == ProbMode::InActivation ? p.probs.f(r) : 1.0;
        for (std::int64_t f = 0; f < F; ++f) act.set_f(r * F + f, bf16(pr * a[std::size_t(f)]));
      }
    const HostTensor actq = qdq_rows_public(act, rows, F);
    std::vector<double> want(got.size(), std::nan(""));
    row = 0;
    for (std::int64_t e = 0; e < L; row += counts[std::size_t(e)], ++e)
      for (std::int64_t r = row; r < row + counts[std::size_t(e)]; ++r)
        for (std::int64_t h = 0; h < H; ++h) {
          double sum = 0;
          for (std::int64_t f = 0; f < F; ++f) sum += actq.f(r * F + f) * w2q.f((e * H + h) * F + f);
          want[std::size_t(r * H + h)] = sum;
        }
    // segment rows: equal to double rounding (the same QDQ values, sums in another order)
    for (std::int64_t i = 0; i < p.used * H; ++i)
      ASSERT_NEAR(got[std::size_t(i)], want[std::size_t(i)], 1e-9 * (1 + std::abs(want[std::size_t(i)]))) << i;
  }
}

// QDQ along the rows of each expert's segment (the wgrad operands), through ref::quantize_fp8_transposed.
HostTensor qdq_columns_public(const HostTensor& t, const std::vector<std::int64_t>& counts, std::int64_t rows,
                              std::int64_t C) {
  const std::int64_t L = std::int64_t(counts.size()), cap = fp8_transposed_rows(rows, L);
  HostTensor f(DType::F32, {rows, C}), cnt(DType::I64, {L}), qt(DType::F8E4M3, {C * cap}),
      sc(DType::F32, {C * cap / 128}), out(DType::F64, {rows, C});
  for (std::int64_t i = 0; i < rows * C; ++i) f.set_f(i, t.f(i));
  for (std::int64_t e = 0; e < L; ++e) cnt.view().as<std::int64_t>()[e] = counts[std::size_t(e)];
  ref::quantize_fp8_transposed({f.view(), cnt.view(), qt.view(), sc.view()});
  std::int64_t row0 = 0, P = 0;
  for (std::int64_t e = 0; e < L; ++e) {
    const std::int64_t n = counts[std::size_t(e)], Re = (n + 127) / 128 * 128;
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t i = 0; i < n; ++i) {
        const std::uint8_t q = qt.view().as<const std::uint8_t>()[C * P + c * Re + i];
        out.set_f((row0 + i) * C + c, double(ref::e4m3_to_float(q) * float(sc.f(C * P / 128 + c * (Re / 128) + i / 128))));
      }
    row0 += n;
    P += Re;
  }
  return out;
}

// The FP8 backward from parts: dy and d_h1 (bf16) QDQ'd 1x128 along their rows' features for the dgrads, the weights
// as in the forward, d_act in bf16; both operands of each weight gradient QDQ'd along the expert's rows (public
// quantizers; x from its FP8 value in bf16), the biases' gradients from the unquantized values; d_probs over the
// FP8 dgrad's d_act. With Fp8WeightGrads::BF16: the same data gradients, the weight gradients over the same operands
// without their QDQ along the rows.
TEST(ExpertsFp8, BackwardIsTheMlpOfTheQuantizedOperands) {
  MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, true, ProbMode::InActivation, 128, 128);
  const std::vector<std::int64_t> counts = {130, 0, 7};  // two row blocks in expert 0, one short one in expert 2
  Problem p(c, counts, 1, 41);
  Grads g(p);
  ref::ExpertsBackwardArgs ba = backward_args(p, g);
  ba.recipe = Recipe::Fp8Blockwise;
  ref::experts_backward(c, ba);

  const std::int64_t H = 128, F = 128, F1 = 256, rows = p.rows, L = 3, used = p.used;
  const HostTensor xq = qdq_rows_public(p.x, rows, H), dyq = qdq_rows_public(p.dy, rows, H);
  const HostTensor w1q = qdq_weight_public(p.w1, L, F1, H), w2q = qdq_weight_public(p.w2, L, H, F);
  HostTensor h1(DType::F64, {rows, F1}), act(DType::F64, {rows, F}), dh1(DType::F64, {rows, F1});
  h1.fill(0.0), act.fill(0.0), dh1.fill(0.0);
  std::vector<double> dx(static_cast<std::size_t>(used * H)), dp(static_cast<std::size_t>(used)),
      dw1(static_cast<std::size_t>(L * F1 * H), 0.0), dw2(static_cast<std::size_t>(L * H * F), 0.0);
  std::vector<std::int64_t> expert_of(static_cast<std::size_t>(used));
  for (std::int64_t e = 0, r0 = 0; e < L; r0 += counts[std::size_t(e)], ++e)
    for (std::int64_t r = r0; r < r0 + counts[std::size_t(e)]; ++r) expert_of[std::size_t(r)] = e;
  std::vector<double> hr(static_cast<std::size_t>(F1)), ar(static_cast<std::size_t>(F)),
      dar(static_cast<std::size_t>(F)), dhr(static_cast<std::size_t>(F1));
  for (std::int64_t r = 0; r < used; ++r) {
    const std::int64_t e = expert_of[std::size_t(r)];
    const double pr = p.probs.f(r);
    for (std::int64_t i = 0; i < F1; ++i) {
      double sum = p.b1.f(e * F1 + i);
      for (std::int64_t k = 0; k < H; ++k) sum += xq.f(r * H + k) * w1q.f((e * F1 + i) * H + k);
      hr[std::size_t(i)] = bf16(sum);
    }
    ref::activation_forward(c, hr, ar);
    double d = 0;
    for (std::int64_t f = 0; f < F; ++f) {
      double sum = 0;
      for (std::int64_t h = 0; h < H; ++h) sum += dyq.f(r * H + h) * w2q.f((e * H + h) * F + f);
      sum = bf16(sum);  // d_act
      act.set_f(r * F + f, bf16(pr * ar[std::size_t(f)]));
      d += ar[std::size_t(f)] * sum;
      dar[std::size_t(f)] = pr * sum;
    }
    for (std::int64_t h = 0; h < H; ++h) d += p.b2.f(e * H + h) * p.dy.f(r * H + h);
    dp[std::size_t(r)] = d;
    ref::activation_backward(c, hr, dar, dhr);
    for (std::int64_t i = 0; i < F1; ++i) dh1.set_f(r * F1 + i, bf16(dhr[std::size_t(i)]));
  }
  const HostTensor dh1q = qdq_rows_public(dh1, rows, F1);
  for (std::int64_t r = 0; r < used; ++r)
    for (std::int64_t k = 0; k < H; ++k) {
      double sum = 0;
      for (std::int64_t i = 0; i < F1; ++i) sum += dh1q.f(r * F1 + i) * w1q.f((expert_of[std::size_t(r)] * F1 + i) * H + k);
      dx[std::size_t(r * H + k)] = sum;
    }
  std::vector<std::int64_t> full = counts;  // the transposed quantizer over exactly the segment rows
  const HostTensor dyt = qdq_columns_public(p.dy, full, rows, H), actt = qdq_columns_public(act, full, rows, F);
  HostTensor xq_bf16(DType::F64, {rows, H});
  for (std::int64_t i = 0; i < rows * H; ++i) xq_bf16.set_f(i, bf16(xq.f(i)));
  const HostTensor dht = qdq_columns_public(dh1, full, rows, F1), xt = qdq_columns_public(xq_bf16, full, rows, H);
  for (std::int64_t r = 0; r < used; ++r) {
    const std::int64_t e = expert_of[std::size_t(r)];
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t f = 0; f < F; ++f) dw2[std::size_t((e * H + h) * F + f)] += dyt.f(r * H + h) * actt.f(r * F + f);
    for (std::int64_t i = 0; i < F1; ++i)
      for (std::int64_t k = 0; k < H; ++k) dw1[std::size_t((e * F1 + i) * H + k)] += dht.f(r * F1 + i) * xt.f(r * H + k);
  }
  auto head = [](const HostTensor& t, std::int64_t n) {
    std::vector<double> v = t.floats();
    v.resize(std::size_t(n));
    return v;
  };
  expect_close_rel("dx", head(g.dx, used * H), dx, 1e-9);
  expect_close_rel("d_probs", head(g.d_probs, used), dp, 1e-9);
  expect_close_rel("dw1", g.dw1.floats(), dw1, 1e-9);
  expect_close_rel("dw2", g.dw2.floats(), dw2, 1e-9);

  Grads gb(p);
  ref::ExpertsBackwardArgs bb = backward_args(p, gb);
  bb.recipe = Recipe::Fp8Blockwise;
  bb.fp8_weight_grads = Fp8WeightGrads::BF16;
  ref::experts_backward(c, bb);
  std::vector<double> dw1b(static_cast<std::size_t>(L * F1 * H), 0.0), dw2b(static_cast<std::size_t>(L * H * F), 0.0);
  for (std::int64_t r = 0; r < used; ++r) {
    const std::int64_t e = expert_of[std::size_t(r)];
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t f = 0; f < F; ++f) dw2b[std::size_t((e * H + h) * F + f)] += p.dy.f(r * H + h) * act.f(r * F + f);
    for (std::int64_t i = 0; i < F1; ++i)
      for (std::int64_t k = 0; k < H; ++k)
        dw1b[std::size_t((e * F1 + i) * H + k)] += dh1.f(r * F1 + i) * xq_bf16.f(r * H + k);
  }
  expect_close_rel("dx, bf16 weight gradients", head(gb.dx, used * H), dx, 1e-9);
  expect_close_rel("d_probs, bf16 weight gradients", head(gb.d_probs, used), dp, 1e-9);
  expect_close_rel("dw1, bf16 weight gradients", gb.dw1.floats(), dw1b, 1e-9);
  expect_close_rel("dw2, bf16 weight gradients", gb.dw2.floats(), dw2b, 1e-9);
  EXPECT_GT(rel_frobenius(gb.dw2.floats(), g.dw2.floats()), 1e-3) << "the bf16 weight gradients equal the FP8 ones";
}

// The FP8 recipe stays near the bf16 one: e4m3 keeps 3 mantissa bits, so each QDQ'd operand is within 2^-4 of its
// value, a GEMM's result within several percent; the weight gradients (both operands QDQ'd along the rows) as well.
// Experts with no rows get zero weight gradients, and only the segment rows are written.
TEST(ExpertsFp8, NearTheBf16RecipeAndShapedLikeIt) {
  MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Interleaved, true, ProbMode::InActivation, 256, 128);
  c.glu_block = 32;
  const std::vector<std::int64_t> counts = {40, 0, 150};  // a segment of more than 128 rows: two row blocks
  Problem p(c, counts, 3, 37);
  Grads bf(p), f8(p);
  ref::experts_forward(c, p.forward_args());
  const std::vector<double> y_bf = p.y.floats();
  ref::ExpertsBackwardArgs ba = backward_args(p, bf);
  ref::experts_backward(c, ba);
  p.y.fill_nan();
  ref::ExpertsForwardArgs fa = p.forward_args();
  fa.recipe = Recipe::Fp8Blockwise;
  ref::experts_forward(c, fa);
  const std::vector<double> y_f8 = p.y.floats();
  ref::ExpertsBackwardArgs b8 = backward_args(p, f8);
  b8.recipe = Recipe::Fp8Blockwise;
  ref::experts_backward(c, b8);

  const std::size_t seg = std::size_t(p.used * c.hidden);
  auto head = [](const std::vector<double>& v, std::size_t n) { return std::vector<double>(v.begin(), v.begin() + n); };
  const double ey = rel_frobenius(head(y_f8, seg), head(y_bf, seg));
  const double edx = rel_frobenius(head(f8.dx.floats(), seg), head(bf.dx.floats(), seg));
  const double edp = rel_frobenius(head(f8.d_probs.floats(), std::size_t(p.used)), head(bf.d_probs.floats(),
                                                                                        std::size_t(p.used)));
  const double ew1 = rel_frobenius(f8.dw1.floats(), bf.dw1.floats()), ew2 = rel_frobenius(f8.dw2.floats(),
                                                                                            bf.dw2.floats());
  // each QDQ'd operand ~2.6% RMS off (3 mantissa bits), two GEMMs in series: ~6-7% here; bounds with 1.5x room
  EXPECT_LT(ey, 0.1) << "y";
  EXPECT_LT(edx, 0.12) << "dx";
  EXPECT_LT(edp, 0.12) << "d_probs";
  EXPECT_LT(ew1, 0.12) << "dw1";
  EXPECT_LT(ew2, 0.12) << "dw2";
  EXPECT_GT(ey, 1e-4) << "y: the FP8 recipe gave the bf16 values (no quantization?)";
  EXPECT_GT(ew1, 1e-4) << "dw1: the FP8 recipe gave the bf16 values (no quantization?)";
  // biases' gradients come from the unquantized gradients: db2 = sum p dy exactly as in bf16
  EXPECT_TRUE(same_bytes(f8.db2.view(), bytes_of(bf.db2.view())));
  const std::int64_t F1H = c.fc1_out() * c.hidden;
  for (std::int64_t i = F1H; i < 2 * F1H; ++i) ASSERT_EQ(f8.dw1.f(i), 0.0) << "expert 1 has no rows";
  for (std::int64_t i = std::int64_t(seg); i < p.rows * c.hidden; ++i) {
    ASSERT_TRUE(std::isnan(y_f8[std::size_t(i)])) << "y row past the segments written";
    ASSERT_TRUE(std::isnan(f8.dx.f(i))) << "dx row past the segments written";
  }
}

TEST(ExpertsFp8, RefusesDimensionsThatAreNotBlocks) {
  MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, false, ProbMode::InActivation, 64, 128);
  Problem p(c, {2}, 0, 3);
  ref::ExpertsForwardArgs fa = p.forward_args();
  fa.recipe = Recipe::Fp8Blockwise;
  try {
    ref::experts_forward(c, fa);
    ADD_FAILURE() << "hidden = 64 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported);
    EXPECT_NE(std::string(e.what()).find("multiples of 128"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moerail
