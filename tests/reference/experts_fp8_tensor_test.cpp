// Tests of the reference expert MLP's per-tensor FP8 recipes (Recipe::Fp8Tensor, Fp8TensorHybrid,
// moerail/reference/experts.h): the same MLP composed here from per-expert per-tensor QDQs (the public quantizer
// for e4m3, the e5m2 codec for the hybrid recipe's gradients), forward and backward; the weight gradients over the
// forward's and the dgrads' own quantized tensors; the distance to the bf16 recipe; the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <span>
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

double bf16(double v) { return double(round_to_bf16(float(v))); }

// Per-tensor QDQ of n values at v (fp32 in, as the step reads bf16 or fp32 tensors): e4m3 through ref::quantize_fp8
// (PerTensor, with the scale the recipe's rule gives), e5m2 through the codec.
std::vector<double> qdq_tensor_public(std::vector<double> v, bool e5m2) {
  float amax = 0.0f;
  for (const double x : v) amax = std::max(amax, std::fabs(float(x)));
  const float s = ref::tensor_scale_from_amax(amax, e5m2 ? kE5M2Max : kE4M3Max);
  const std::int64_t n = std::int64_t(v.size());
  if (n == 0) return v;
  if (e5m2) {
    const float inv = 1.0f / s;
    for (double& x : v) x = double(ref::e5m2_to_float(ref::float_to_e5m2(float(x) * inv)) * s);
    return v;
  }
  HostTensor f(DType::F32, {1, n}), q(DType::F8E4M3, {1, n}), sc(DType::F32, {1});
  for (std::int64_t i = 0; i < n; ++i) f.set_f(i, v[std::size_t(i)]);
  sc.set_f(0, s);
  ref::quantize_fp8(Fp8Scaling::PerTensor, f.view(), q.view(), sc.view());
  ref::dequantize_fp8(Fp8Scaling::PerTensor, q.view(), sc.view(), f.view());
  for (std::int64_t i = 0; i < n; ++i) v[std::size_t(i)] = f.f(i);
  return v;
}

// Rows [r0, r0 + n) of an [rows, C] tensor, and the same written back.
std::vector<double> rows_of(const HostTensor& t, std::int64_t r0, std::int64_t n, std::int64_t C) {
  std::vector<double> v(std::size_t(n * C));
  for (std::int64_t i = 0; i < n * C; ++i) v[std::size_t(i)] = t.f(r0 * C + i);
  return v;
}

// c [M, N] = a [M, K] b [N, K]^T, or (b_kn) a [M, K] b [K, N].
std::vector<double> mm(const std::vector<double>& a, const std::vector<double>& b, std::int64_t M, std::int64_t N,
                       std::int64_t K, bool b_kn = false) {
  std::vector<double> c(std::size_t(M * N), 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (std::int64_t k = 0; k < K; ++k)
        s += a[std::size_t(m * K + k)] * (b_kn ? b[std::size_t(k * N + n)] : b[std::size_t(n * K + k)]);
      c[std::size_t(m * N + n)] = s;
    }
  return c;
}

// The per-tensor recipe's step for one problem, composed from per-expert QDQs: y, dx, d_probs, dW1, dW2 (segment rows).
struct Composed {
  std::vector<double> y, dx, dp, dw1, dw2;
};

Composed compose(const MoeConfig& c, const Problem& p, const std::vector<std::int64_t>& counts, bool hybrid) {
  const std::int64_t H = c.hidden, F = c.ffn_hidden, F1 = c.fc1_out(), L = std::int64_t(counts.size());
  Composed out;
  out.y.assign(std::size_t(p.used * H), 0.0);
  out.dx.assign(std::size_t(p.used * H), 0.0);
  out.dp.assign(std::size_t(p.used), 0.0);
  out.dw1.assign(std::size_t(L * F1 * H), 0.0);
  out.dw2.assign(std::size_t(L * H * F), 0.0);
  std::int64_t r0 = 0;
  for (std::int64_t e = 0; e < L; r0 += counts[std::size_t(e)], ++e) {
    const std::int64_t n = counts[std::size_t(e)];
    if (n == 0) continue;
    const std::vector<double> xq = qdq_tensor_public(rows_of(p.x, r0, n, H), false);
    const std::vector<double> w1q = qdq_tensor_public(rows_of(p.w1, e * F1, F1, H), false);
    const std::vector<double> w2q = qdq_tensor_public(rows_of(p.w2, e * H, H, F), false);
    std::vector<double> h1 = mm(xq, w1q, n, F1, H);
    for (double& v : h1) v = bf16(v);
    std::vector<double> a(static_cast<std::size_t>(n * F)), act(static_cast<std::size_t>(n * F));
    for (std::int64_t r = 0; r < n; ++r) {
      ref::activation_forward(c, std::span<const double>(h1).subspan(std::size_t(r * F1), std::size_t(F1)),
                              std::span<double>(a).subspan(std::size_t(r * F), std::size_t(F)));
      for (std::int64_t f = 0; f < F; ++f)
        act[std::size_t(r * F + f)] = bf16(p.probs.f(r0 + r) * a[std::size_t(r * F + f)]);
    }
    const std::vector<double> actq = qdq_tensor_public(act, false);
    const std::vector<double> y = mm(actq, w2q, n, H, F);
    std::copy(y.begin(), y.end(), out.y.begin() + r0 * H);
    // backward
    const std::vector<double> dy = rows_of(p.dy, r0, n, H);
    const std::vector<double> dyq = qdq_tensor_public(dy, hybrid);
    std::vector<double> dact = mm(dyq, w2q, n, F, H, /*b_kn=*/true);
    for (double& v : dact) v = bf16(v);
    std::vector<double> dh1(static_cast<std::size_t>(n * F1)), da(static_cast<std::size_t>(F));
    for (std::int64_t r = 0; r < n; ++r) {
      const double pr = p.probs.f(r0 + r);
      double d = 0;
      for (std::int64_t f = 0; f < F; ++f) {
        d += a[std::size_t(r * F + f)] * dact[std::size_t(r * F + f)];
        da[std::size_t(f)] = pr * dact[std::size_t(r * F + f)];
      }
      out.dp[std::size_t(r0 + r)] = d;
      ref::activation_backward(c, std::span<const double>(h1).subspan(std::size_t(r * F1), std::size_t(F1)), da,
                               std::span<double>(dh1).subspan(std::size_t(r * F1), std::size_t(F1)));
    }
    for (double& v : dh1) v = bf16(v);
    const std::vector<double> dh1q = qdq_tensor_public(dh1, hybrid);
    const std::vector<double> dx = mm(dh1q, w1q, n, H, F1, /*b_kn=*/true);
    std::copy(dx.begin(), dx.end(), out.dx.begin() + r0 * H);
    // weight gradients over the same quantized tensors: dW2 = dyq^T actq, dW1 = dh1q^T xq
    for (std::int64_t r = 0; r < n; ++r) {
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t f = 0; f < F; ++f)
          out.dw2[std::size_t((e * H + h) * F + f)] += dyq[std::size_t(r * H + h)] * actq[std::size_t(r * F + f)];
      for (std::int64_t i = 0; i < F1; ++i)
        for (std::int64_t k = 0; k < H; ++k)
          out.dw1[std::size_t((e * F1 + i) * H + k)] += dh1q[std::size_t(r * F1 + i)] * xq[std::size_t(r * H + k)];
    }
  }
  return out;
}

std::vector<double> head(const std::vector<double>& v, std::int64_t n) {
  return std::vector<double>(v.begin(), v.begin() + n);
}

// The reference's forward (into p.y) and backward (into g) of problem p under `recipe`.
void run_recipe(const MoeConfig& c, Problem& p, Grads& g, Recipe recipe) {
  ref::ExpertsForwardArgs fa = p.forward_args();
  fa.recipe = recipe;
  ref::experts_forward(c, fa);
  ref::ExpertsBackwardArgs ba = backward_args(p, g);
  ba.recipe = recipe;
  ref::experts_backward(c, ba);
}

// Both per-tensor recipes against their composition: each expert's x, act, dy and d_h1 over its segment and its
// W1 and W2 whole quantized with one scale each (dy and d_h1 in e5m2 under the hybrid recipe), the weight
// gradients over those same quantized tensors; H = 144 (a multiple of 16, not of 128), uneven and empty experts.
TEST(ExpertsFp8Tensor, IsTheMlpOfPerExpertPerTensorQuantizedOperands) {
  for (Recipe recipe : {Recipe::Fp8Tensor, Recipe::Fp8TensorHybrid}) {
    SCOPED_TRACE(std::string(name_of(recipe)));
    MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, false, ProbMode::InActivation, 144, 96);
    const std::vector<std::int64_t> counts = {9, 0, 4};
    Problem p(c, counts, 2, 53);
    Grads g(p);
    run_recipe(c, p, g, recipe);
    const Composed want = compose(c, p, counts, recipe == Recipe::Fp8TensorHybrid);
    const std::int64_t H = c.hidden;
    expect_close_rel("y", head(p.y.floats(), p.used * H), want.y, 1e-9);
    expect_close_rel("dx", head(g.dx.floats(), p.used * H), want.dx, 1e-9);
    expect_close_rel("d_probs", head(g.d_probs.floats(), p.used), want.dp, 1e-9);
    expect_close_rel("dw1", g.dw1.floats(), want.dw1, 1e-9);
    expect_close_rel("dw2", g.dw2.floats(), want.dw2, 1e-9);
  }
}

// The hybrid recipe changes the backward only (its forward is the e4m3 one, bit for bit), and its e5m2 gradients
// are coarser than e4m3's; both stay near the bf16 recipe (per-tensor scales over a segment of random rows leave the
// smaller elements fewer mantissa bits than 1x128 blocks do); the blockwise recipe is a different one.
TEST(ExpertsFp8Tensor, HybridChangesTheBackwardOnlyAndBothStayNearBf16) {
  MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, false, ProbMode::InActivation, 128, 128);
  const std::vector<std::int64_t> counts = {40, 25};
  Problem p(c, counts, 0, 61);
  const std::int64_t n = p.used * c.hidden;
  auto run = [&](Recipe recipe, Grads& g) {
    run_recipe(c, p, g, recipe);
    return head(p.y.floats(), n);
  };
  Grads gb(p), gt(p), gh(p), gw(p);
  const std::vector<double> yb = run(Recipe::BF16, gb), yt = run(Recipe::Fp8Tensor, gt),
                            yh = run(Recipe::Fp8TensorHybrid, gh), yw = run(Recipe::Fp8Blockwise, gw);
  EXPECT_EQ(yt, yh) << "the hybrid recipe's forward differs from fp8-tensor's";
  const double dx_t = rel_frobenius(head(gt.dx.floats(), n), head(gb.dx.floats(), n));
  const double dx_h = rel_frobenius(head(gh.dx.floats(), n), head(gb.dx.floats(), n));
  EXPECT_LT(rel_frobenius(yt, yb), 0.1);
  EXPECT_GT(rel_frobenius(yt, yb), 1e-4) << "no quantization?";
  EXPECT_LT(dx_t, 0.12);
  EXPECT_LT(dx_h, 0.25);
  EXPECT_GT(dx_h, dx_t) << "e5m2 gradients (2 mantissa bits) came out closer to bf16 than e4m3 ones";
  EXPECT_LT(rel_frobenius(gt.dw1.floats(), gb.dw1.floats()), 0.12);
  EXPECT_LT(rel_frobenius(gh.dw2.floats(), gb.dw2.floats()), 0.25);
  EXPECT_GT(rel_frobenius(yt, yw), 1e-4) << "the per-tensor forward equals the blockwise one";
}

TEST(ExpertsFp8Tensor, RefusesDimensionsThatAreNotMultiplesOf16) {
  MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, false, ProbMode::InActivation, 72, 128);
  Problem p(c, {2}, 0, 3);
  ref::ExpertsForwardArgs fa = p.forward_args();
  fa.recipe = Recipe::Fp8TensorHybrid;
  try {
    ref::experts_forward(c, fa);
    ADD_FAILURE() << "hidden = 72 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported);
    EXPECT_NE(std::string(e.what()).find("fp8-tensor-hybrid needs hidden and ffn_hidden multiples of 16"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moerail
