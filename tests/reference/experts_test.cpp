// Tests of the CPU reference of the grouped expert MLP (moerail/reference/experts.h).
//
// The reference is the oracle of the GPU kernels, so it is checked against things that do not share its code:
// values worked out by hand, an independent direct computation, and central finite differences in f64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "moerail/config.h"
#include "moerail/error.h"
#include "moerail/reference/experts.h"
#include "moerail/reference/host.h"
#include "reference/experts_harness.h"

namespace moerail {
namespace {

using namespace test::experts_ref;  // NOLINT: the harness is this file's vocabulary

// ---- activations -----------------------------------------------------------------------------------------------

std::vector<double> act(const MoeConfig& cfg, const std::vector<double>& h1) {
  std::vector<double> a(std::size_t(cfg.ffn_hidden), std::numeric_limits<double>::quiet_NaN());
  ref::activation_forward(cfg, h1, a);
  return a;
}

// Expected values computed by hand from the formulas of config.h (sigmoid, tanh-gelu), to 16 digits.
TEST(Activation, ForwardAtKnownPoints) {
  const auto exact = [](double) { return 1e-15; };
  const auto rel = [](double w) { return 4e-16 * std::max(1.0, std::abs(w)); };
  MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, false, ProbMode::InActivation, 4, 2);
  // silu(1) * 2, silu(-2) * 0.5
  expect_close("swiglu", act(c, {1, -2, 2, 0.5}), {1.4621171572600098, -0.11920292202211755}, rel);

  c.activation = Activation::GeGLU;  // gelu(1) * 3, gelu(-0.5) * -2
  expect_close("geglu", act(c, {1, -0.5, 3, -2}), {2.5235759718248305, 0.3085719803497121}, rel);

  c = mlp_config(Activation::QuickGeGLU, GluLayout::Concatenated, false, ProbMode::InActivation, 4, 3);
  // defaults alpha 1.702, limit 7, offset 1:
  //   a=1,  b=0.5 -> qgelu(1) * 1.5;   a=10 (clamped to 7), b=-9 (clamped to -7) -> qgelu(7) * -6;
  //   a=-3, b=20 (clamped to 7) -> qgelu(-3) * 8
  expect_close("quick-geglu", act(c, {1, 10, -3, 0.5, -9, 20}),
               {1.268693648899232, -41.99971876981991, -0.14457047766228776}, rel);

  c = mlp_config(Activation::ReLU2, GluLayout::Concatenated, false, ProbMode::InActivation, 4, 3);
  expect_close("relu2", act(c, {-1.5, 0, 3}), {0, 0, 9}, exact);

  c.activation = Activation::GELU;
  expect_close("gelu", act(c, {-1, 0, 2}), {-0.15880800939172324, 0, 1.954597694087775}, rel);
}

TEST(Activation, InterleavedBlocksPairGateAndLinear) {
  // F = 4, g = 2: columns [a0 a1 b0 b1 a2 a3 b2 b3]. Same (a, b) pairs as the concatenated [a0..a3 | b0..b3].
  MoeConfig inter = mlp_config(Activation::SwiGLU, GluLayout::Interleaved, false, ProbMode::InActivation, 4, 4);
  MoeConfig concat = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, false, ProbMode::InActivation, 4, 4);
  const std::vector<double> a = {0.5, -1.0, 2.0, 0.25}, b = {3.0, -0.5, 1.5, -2.0};
  const std::vector<double> want = act(concat, {a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]});
  const std::vector<double> got = act(inter, {a[0], a[1], b[0], b[1], a[2], a[3], b[2], b[3]});
  for (std::size_t j = 0; j < 4; ++j) EXPECT_EQ(got[j], want[j]) << "feature " << j;
  // silu(a0) * b0, independently of the layout code.
  EXPECT_NEAR(got[0], 0.5 / (1 + std::exp(-0.5)) * 3.0, 1e-15);
  inter.glu_block = 1;  // [a0 b0 a1 b1 ...]
  const std::vector<double> got1 = act(inter, {a[0], b[0], a[1], b[1], a[2], b[2], a[3], b[3]});
  for (std::size_t j = 0; j < 4; ++j) EXPECT_EQ(got1[j], want[j]) << "feature " << j << " (g = 1)";
}

TEST(Activation, QuickGeGluClampedRegionsPassNoGradient) {
  MoeConfig c = mlp_config(Activation::QuickGeGLU, GluLayout::Concatenated, false, ProbMode::InActivation, 4, 3);
  // gate 8 > limit 7: no gate gradient; linear -8 and 9 outside [-7, 7]: no linear gradient.
  const std::vector<double> h1 = {8.0, 1.0, -2.0, 0.5, -8.0, 9.0}, d_a = {1.0, 1.0, 1.0};
  std::vector<double> d_h1(6, std::numeric_limits<double>::quiet_NaN());
  ref::activation_backward(c, h1, d_a, d_h1);
  EXPECT_EQ(d_h1[0], 0.0);  // gate clamped
  EXPECT_NE(d_h1[3], 0.0);  // its linear input is inside the limits
  EXPECT_NE(d_h1[1], 0.0);
  EXPECT_EQ(d_h1[4], 0.0);  // linear clamped below
  EXPECT_NE(d_h1[2], 0.0);  // a negative gate is not clamped
  EXPECT_EQ(d_h1[5], 0.0);  // linear clamped above
}

TEST(Activation, BackwardMatchesFiniteDifferences) {
  for (const MoeConfig& base : activation_variants(false, ProbMode::InActivation)) {
    MoeConfig c = base;
    c.quick_geglu_limit = 1.5;  // small, so that random inputs in [-3, 3] hit both clamps
    c.ffn_hidden = 16;          // enough inputs to visit every region of every activation
    SCOPED_TRACE(describe(c));
    const std::int64_t F1 = c.fc1_out(), F = c.ffn_hidden;
    Rng rng(7);
    std::vector<double> h1(static_cast<std::size_t>(F1)), d_a(static_cast<std::size_t>(F));
    for (auto& v : h1) {
      do v = rng.uniform(-3.0, 3.0);  // keep 1e-2 away from every kink (0 for ReLU2, +-limit for the clamps)
      while (std::abs(std::abs(v) - c.quick_geglu_limit) < 1e-2 || std::abs(v) < 1e-2);
    }
    for (auto& v : d_a) v = rng.uniform(-1.0, 1.0);

    std::vector<double> analytic(std::size_t(F1), std::numeric_limits<double>::quiet_NaN());
    ref::activation_backward(c, h1, d_a, analytic);

    // Loss sum_j d_a[j] * act(h1)[j]; central differences with step 1e-6 (error ~ 1e-12 truncation, 1e-10
    // rounding for values of order 1), compared with relative tolerance 1e-7.
    auto loss = [&](const std::vector<double>& h) {
      const std::vector<double> a = act(c, h);
      double s = 0;
      for (std::size_t j = 0; j < a.size(); ++j) s += d_a[j] * a[j];
      return s;
    };
    std::vector<double> numeric(static_cast<std::size_t>(F1));
    for (std::size_t i = 0; i < h1.size(); ++i) {
      std::vector<double> up = h1, down = h1;
      up[i] += 1e-6;
      down[i] -= 1e-6;
      numeric[i] = (loss(up) - loss(down)) / 2e-6;
    }
    expect_close_rel("d_h1", analytic, numeric, 1e-7);
  }
}

TEST(Activation, RejectsSpansOfTheWrongSize) {
  MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, false, ProbMode::InActivation, 4, 2);
  std::vector<double> h1(3), a(2), d_h1(4);
  expect_error([&] { ref::activation_forward(c, h1, a); }, ErrorCode::InvalidArgument, "activation_forward");
  std::vector<double> h1_ok(4), d_a(2);
  expect_error([&] { ref::activation_backward(c, h1_ok, d_a, std::span<double>(d_h1).first(3)); },
               ErrorCode::InvalidArgument, "activation_backward");
}

// ---- forward ---------------------------------------------------------------------------------------------------

TEST(Experts, ForwardHandComputedReLU2) {
  // H = 2, F = 1, L = 2 experts with one row each, biases, probs in the activation.
  MoeConfig c = mlp_config(Activation::ReLU2, GluLayout::Concatenated, true, ProbMode::InActivation, 2, 1);
  const double x[] = {1, 2, 1, -1}, p[] = {0.5, 2.0};
  const double w1[] = {1, 1, 2, 1}, b1[] = {0, 1};      // [2, 1, 2], [2, 1]
  const double w2[] = {1, 2, 3, -1}, b2[] = {0, 0, 1, 1};  // [2, 2, 1], [2, 2]
  double y[4] = {};
  const std::int64_t counts[] = {1, 1};
  ref::ExpertsForwardArgs a;
  a.x = TensorView(x, DType::F64, {2, 2});
  a.probs = TensorView(p, DType::F64, {2});
  a.rows_per_expert = counts;
  a.weights = {TensorView(w1, DType::F64, {2, 1, 2}), TensorView(b1, DType::F64, {2, 1}),
               TensorView(w2, DType::F64, {2, 2, 1}), TensorView(b2, DType::F64, {2, 2})};
  a.y = TensorView(y, DType::F64, {2, 2});
  ref::experts_forward(c, a);
  // row 0: h1 = 1+2 = 3, a = 9, z = [9, 18], y = 0.5 z = [4.5, 9]
  // row 1: h1 = 2-1+1 = 2, a = 4, z = [12, -4] + [1, 1] = [13, -3], y = 2 z = [26, -6]
  EXPECT_EQ(y[0], 4.5);
  EXPECT_EQ(y[1], 9.0);
  EXPECT_EQ(y[2], 26.0);
  EXPECT_EQ(y[3], -6.0);

  c.prob_mode = ProbMode::InCombine;  // probs ignored, even absent
  a.probs = TensorView{};
  ref::experts_forward(c, a);
  EXPECT_EQ(y[0], 9.0);
  EXPECT_EQ(y[3], -3.0);
}

// y computed directly from the formula with matrices as nested vectors and the test's own silu.
TEST(Experts, ForwardMatchesDirectComputation) {
  MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Interleaved, true, ProbMode::InActivation, 5, 4);
  Problem p(c, {2, 0, 3}, 1, 11);
  p.forward();
  const std::int64_t H = 5, F = 4, g = 2;
  std::vector<int> expert_of_row = {0, 0, 2, 2, 2};
  auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
  std::vector<double> want;
  for (std::size_t r = 0; r < expert_of_row.size(); ++r) {
    const std::int64_t e = expert_of_row[r];
    std::vector<double> gate(F), lin(F);
    for (std::int64_t j = 0; j < F; ++j) {
      // interleaved: gate of feature j at column (j/g)*2g + j%g, linear g columns later
      const std::int64_t col_a = (j / g) * 2 * g + j % g, col_b = col_a + g;
      gate[j] = p.b1.f(e * 2 * F + col_a);
      lin[j] = p.b1.f(e * 2 * F + col_b);
      for (std::int64_t k = 0; k < H; ++k) {
        gate[j] += p.w1.f((e * 2 * F + col_a) * H + k) * p.x.f(std::int64_t(r) * H + k);
        lin[j] += p.w1.f((e * 2 * F + col_b) * H + k) * p.x.f(std::int64_t(r) * H + k);
      }
    }
    for (std::int64_t h = 0; h < H; ++h) {
      double z = p.b2.f(e * H + h);
      for (std::int64_t j = 0; j < F; ++j) z += p.w2.f((e * H + h) * F + j) * silu(gate[j]) * lin[j];
      want.push_back(p.probs.f(std::int64_t(r)) * z);
    }
  }
  // Same sums in a different order: differences of a few ulps of the terms (|terms| ~ 1).
  expect_close_rel("y", first(p.y, 5 * H), want, 1e-13);
}

// The interleaved layout computes the same function once W1's rows (and b1) are permuted to match.
TEST(Experts, InterleavedEqualsConcatenatedWithPermutedRows) {
  for (Activation a : {Activation::SwiGLU, Activation::GeGLU, Activation::QuickGeGLU}) {
    for (std::int64_t g : {1, 2}) {
      MoeConfig cc = mlp_config(a, GluLayout::Concatenated, true, ProbMode::InActivation);
      MoeConfig ci = cc;
      ci.glu_layout = GluLayout::Interleaved;
      ci.glu_block = g;
      SCOPED_TRACE(describe(ci));
      Problem pc(cc, {3, 1, 2}, 0, 5), pi(ci, {3, 1, 2}, 0, 5);
      const std::int64_t F = cc.ffn_hidden, H = cc.hidden, F1 = 2 * F;
      // interleaved row 2g*blk + o <- concatenated gate row g*blk + o; row 2g*blk + g + o <- linear row F + g*blk + o
      std::vector<std::int64_t> src(static_cast<std::size_t>(F1));
      for (std::int64_t blk = 0; blk < F / g; ++blk)
        for (std::int64_t o = 0; o < g; ++o) {
          src[std::size_t(2 * g * blk + o)] = g * blk + o;
          src[std::size_t(2 * g * blk + g + o)] = F + g * blk + o;
        }
      for (std::int64_t e = 0; e < pc.L; ++e)
        for (std::int64_t i = 0; i < F1; ++i) {
          const std::int64_t s = src[std::size_t(i)];
          pi.b1.set_f(e * F1 + i, pc.b1.f(e * F1 + s));
          for (std::int64_t k = 0; k < H; ++k) pi.w1.set_f((e * F1 + i) * H + k, pc.w1.f((e * F1 + s) * H + k));
        }
      pc.forward();
      pi.forward();
      EXPECT_TRUE(same_bytes(pi.y, bytes_of(pc.y))) << "outputs differ";

      Grads gc(pc), gi(pi);
      ref::experts_backward(cc, backward_args(pc, gc));
      ref::experts_backward(ci, backward_args(pi, gi));
      // dx = dh1 W1 sums over W1's rows, now in another order: equal up to the rounding of 2F terms of order 1.
      expect_close_rel("dx", gi.dx.floats(), gc.dx.floats(), 1e-14);
      EXPECT_TRUE(same_bytes(gi.dw2, bytes_of(gc.dw2)));
      EXPECT_TRUE(same_bytes(gi.d_probs, bytes_of(gc.d_probs)));
      for (std::int64_t e = 0; e < pc.L; ++e)
        for (std::int64_t i = 0; i < F1; ++i) {
          const std::int64_t s = src[std::size_t(i)];
          EXPECT_EQ(gi.db1.f(e * F1 + i), gc.db1.f(e * F1 + s)) << "db1[" << e << "," << i << "]";
          for (std::int64_t k = 0; k < H; ++k)
            EXPECT_EQ(gi.dw1.f((e * F1 + i) * H + k), gc.dw1.f((e * F1 + s) * H + k));
        }
    }
  }
}

TEST(Experts, ForwardWritesSegmentRowsOnly) {
  Problem p(mlp_config(Activation::GeGLU, GluLayout::Concatenated, true), {2, 0, 1}, 2, 3);
  p.probs.set_f(p.rows - 1, std::numeric_limits<double>::quiet_NaN());  // rows past the segments are not read
  p.x.set_f(p.rows * p.cfg.hidden - 1, std::numeric_limits<double>::quiet_NaN());
  p.forward();
  for (std::int64_t r = 0; r < p.rows; ++r)
    for (std::int64_t h = 0; h < p.cfg.hidden; ++h) {
      const double v = p.y.f(r * p.cfg.hidden + h);
      if (r < p.used)
        EXPECT_TRUE(std::isfinite(v)) << "y[" << r << "," << h << "] not written";
      else
        EXPECT_TRUE(std::isnan(v)) << "y[" << r << "," << h << "] = " << v << " written past the segments";
    }
}

// ---- backward --------------------------------------------------------------------------------------------------

// Every output of experts_backward against central differences of L = sum(dy * y), for every activation x GLU
// layout x bias x prob mode. Expert 1 has no rows and there is one row past the segments.
TEST(Experts, BackwardMatchesFiniteDifferences) {
  for (ProbMode mode : {ProbMode::InActivation, ProbMode::InCombine})
    for (bool bias : {true, false})
      for (const MoeConfig& c : activation_variants(bias, mode)) {
        SCOPED_TRACE(describe(c));
        Problem p(c, {2, 0, 1}, 1, 21);
        if (c.activation == Activation::QuickGeGLU) place_clamp_limit(p);
        Grads g(p);
        ref::experts_backward(p.cfg, backward_args(p, g));

        const std::int64_t H = c.hidden, F1 = c.fc1_out(), F = c.ffn_hidden;
        constexpr double rel = 1e-6;
        expect_close_rel("dx", first(g.dx, p.used * H), numeric_grad(p, p.x, p.used * H), rel);
        expect_close_rel("d_probs", first(g.d_probs, p.used), numeric_grad(p, p.probs, p.used), rel);
        expect_close_rel("dw1", g.dw1.floats(), numeric_grad(p, p.w1, p.L * F1 * H), rel);
        expect_close_rel("dw2", g.dw2.floats(), numeric_grad(p, p.w2, p.L * H * F), rel);
        if (bias) {
          expect_close_rel("db1", g.db1.floats(), numeric_grad(p, p.b1, p.L * F1), rel);
          expect_close_rel("db2", g.db2.floats(), numeric_grad(p, p.b2, p.L * H), rel);
        }
        if (mode == ProbMode::InCombine) {
          for (std::int64_t r = 0; r < p.used; ++r) EXPECT_EQ(g.d_probs.f(r), 0.0) << "d_probs[" << r << "]";
        }
        if (c.activation == Activation::QuickGeGLU) {
          // the clamp must be active somewhere, or this case proves nothing about it
          const auto h1 = p.fc1_outputs();
          EXPECT_TRUE(std::any_of(h1.begin(), h1.end(),
                                  [&](double v) { return std::abs(v) > p.cfg.quick_geglu_limit; }));
        }
      }
}

TEST(Experts, ZeroRowExpertsGetExactlyZeroWeightGrads) {
  Problem p(mlp_config(Activation::SwiGLU, GluLayout::Concatenated, true), {0, 3, 0, 2}, 0, 4);
  Grads g(p);  // NaN-poisoned
  ref::experts_backward(p.cfg, backward_args(p, g));
  const std::int64_t H = p.cfg.hidden, F1 = p.cfg.fc1_out(), F = p.cfg.ffn_hidden;
  for (std::int64_t e : {0, 2}) {
    for (std::int64_t i = 0; i < F1 * H; ++i) EXPECT_EQ(g.dw1.f(e * F1 * H + i), 0.0) << "dw1 expert " << e;
    for (std::int64_t i = 0; i < F1; ++i) EXPECT_EQ(g.db1.f(e * F1 + i), 0.0) << "db1 expert " << e;
    for (std::int64_t i = 0; i < H * F; ++i) EXPECT_EQ(g.dw2.f(e * H * F + i), 0.0) << "dw2 expert " << e;
    for (std::int64_t i = 0; i < H; ++i) EXPECT_EQ(g.db2.f(e * H + i), 0.0) << "db2 expert " << e;
  }
  for (std::int64_t e : {1, 3}) {
    double norm = 0;
    for (std::int64_t i = 0; i < F1 * H; ++i) norm += std::abs(g.dw1.f(e * F1 * H + i));
    EXPECT_GT(norm, 0.0) << "dw1 of expert " << e << " which has rows";
  }

  // No rows at all: every weight gradient is zero, and dx / d_probs stay untouched.
  Problem empty(mlp_config(Activation::GELU), {0, 0, 0}, 2, 4);
  Grads ge(empty);
  ref::experts_backward(empty.cfg, backward_args(empty, ge));
  for (double v : ge.dw1.floats()) EXPECT_EQ(v, 0.0);
  for (double v : ge.dw2.floats()) EXPECT_EQ(v, 0.0);
  for (double v : ge.dx.floats()) EXPECT_TRUE(std::isnan(v));
}

TEST(Experts, BackwardWritesSegmentRowsOnly) {
  for (ProbMode mode : {ProbMode::InActivation, ProbMode::InCombine}) {
    Problem p(mlp_config(Activation::QuickGeGLU, GluLayout::Interleaved, false, mode), {1, 2, 1}, 3, 8);
    p.probs.set_f(p.rows - 1, std::numeric_limits<double>::infinity());  // not read
    Grads g(p);
    ref::experts_backward(p.cfg, backward_args(p, g));
    const std::int64_t H = p.cfg.hidden;
    for (std::int64_t r = 0; r < p.rows; ++r) {
      const bool seg = r < p.used;
      EXPECT_EQ(std::isfinite(g.d_probs.f(r)), seg) << "d_probs[" << r << "] = " << g.d_probs.f(r);
      for (std::int64_t h = 0; h < H; ++h)
        EXPECT_EQ(std::isfinite(g.dx.f(r * H + h)), seg) << "dx[" << r << "," << h << "] = " << g.dx.f(r * H + h);
    }
  }
}

TEST(Experts, DelayedWgradEqualsOneFullCall) {
  for (bool bias : {true, false}) {
    MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Interleaved, bias, ProbMode::InActivation);
    Problem p(c, {2, 1, 0, 3}, 1, 9);
    Grads full(p), split(p);
    ref::experts_backward(c, backward_args(p, full));
    ref::experts_backward(c, backward_args(p, split, /*data=*/true, /*wgrad=*/false));
    for (double v : split.dw1.floats()) ASSERT_TRUE(std::isnan(v)) << "data-only call wrote dw1";
    ref::experts_backward(c, backward_args(p, split, /*data=*/false, /*wgrad=*/true));
    EXPECT_TRUE(same_bytes(split.dx, bytes_of(full.dx)));
    EXPECT_TRUE(same_bytes(split.d_probs, bytes_of(full.d_probs)));
    EXPECT_TRUE(same_bytes(split.dw1, bytes_of(full.dw1)));
    EXPECT_TRUE(same_bytes(split.dw2, bytes_of(full.dw2)));
    EXPECT_TRUE(same_bytes(split.db1, bytes_of(full.db1)));  // still NaN in both without bias
    EXPECT_TRUE(same_bytes(split.db2, bytes_of(full.db2)));
  }
}

// ExpertGrads::accumulate: each weight-gradient element becomes cast(old + cast(g)), g what a writing call gives
// (so a zero-row expert keeps its old values), in f64, f32 and bf16 views; the data gradients are unchanged.
TEST(Experts, AccumulatedWeightGradsAddTheWrittenOnes) {
  for (DType dtype : {DType::F64, DType::F32, DType::BF16}) {  // f32: Megatron-LM's main_grad
    SCOPED_TRACE(dtype_name(dtype));
    MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, true, ProbMode::InActivation);
    Problem p(c, {2, 0, 3, 1}, 1, 17, dtype);
    Grads written(p, dtype), acc(p, dtype);
    ref::experts_backward(c, backward_args(p, written));
    Rng rng(3);
    std::vector<std::vector<double>> old;
    for (const HostTensor* t : {&acc.dw1, &acc.db1, &acc.dw2, &acc.db2}) {
      ref::fill_normal(*t, rng, 0.5);
      old.push_back(t->floats());
    }
    ref::ExpertsBackwardArgs a = backward_args(p, acc);
    a.grads.accumulate = true;
    ref::experts_backward(c, a);
    const HostTensor* w[] = {&written.dw1, &written.db1, &written.dw2, &written.db2};
    const HostTensor* g[] = {&acc.dw1, &acc.db1, &acc.dw2, &acc.db2};
    for (std::size_t i = 0; i < 4; ++i) {
      HostTensor want(dtype, {g[i]->numel()});
      for (std::int64_t j = 0; j < want.numel(); ++j) want.set_f(j, old[i][std::size_t(j)] + w[i]->f(j));
      EXPECT_EQ(std::memcmp(want.view().data(), g[i]->view().data(), want.view().nbytes()), 0) << "gradient " << i;
    }
    // expert 1 has no rows: its dW1 is what it was
    const std::int64_t n1 = c.fc1_out() * c.hidden;
    for (std::int64_t j = n1; j < 2 * n1; ++j) ASSERT_EQ(acc.dw1.f(j), old[0][std::size_t(j)]);
    EXPECT_TRUE(same_bytes(acc.dx, bytes_of(written.dx)));
    EXPECT_TRUE(same_bytes(acc.d_probs, bytes_of(written.d_probs)));
  }
}

// ---- dtypes ----------------------------------------------------------------------------------------------------

// Storing a double v to bf16 goes through float. Rounding to nearest in a format with p significant bits moves a
// value by at most 2^-p of its magnitude (p = 8 for bf16, 24 for f32), so
// |bf16(float(v)) - v| <= 2^-8 |float(v)| + 2^-24 |v| <= (2^-8 + 2^-23) |v|.
const auto kBf16Tol = [](double w) { return (std::ldexp(1.0, -8) + std::ldexp(1.0, -23)) * std::abs(w); };

TEST(Experts, Bf16ViewsRoundOnceOnStore) {
  MoeConfig c = mlp_config(Activation::GeGLU, GluLayout::Concatenated, true, ProbMode::InActivation, 8, 6);
  Problem pb(c, {3, 0, 2}, 1, 31, DType::BF16);  // bf16 inputs, weights and outputs
  Problem pd(c, {3, 0, 2}, 1, 31, DType::F64);   // the same (bf16-representable) values in f64
  const std::pair<const HostTensor*, const HostTensor*> same_values[] = {
      {&pb.x, &pd.x}, {&pb.w1, &pd.w1}, {&pb.b1, &pd.b1}, {&pb.w2, &pd.w2}, {&pb.b2, &pd.b2}, {&pb.dy, &pd.dy}};
  for (const auto& [b, d] : same_values) ref::write_floats(*d, b->floats());
  pb.forward();
  pd.forward();
  expect_close("y bf16", first(pb.y, pb.used * c.hidden), first(pd.y, pd.used * c.hidden), kBf16Tol);
  for (std::int64_t i = pb.used * c.hidden; i < pb.rows * c.hidden; ++i) EXPECT_TRUE(std::isnan(pb.y.f(i)));

  Grads gb(pb, DType::BF16), gd(pd);
  HostTensor d_probs_f32(DType::F32, {pb.rows});
  d_probs_f32.fill_nan();
  ref::ExpertsBackwardArgs ab = backward_args(pb, gb);
  ab.d_probs = d_probs_f32;
  ref::experts_backward(c, ab);
  ref::experts_backward(c, backward_args(pd, gd));
  expect_close("dx bf16", first(gb.dx, pb.used * c.hidden), first(gd.dx, pd.used * c.hidden), kBf16Tol);
  expect_close("dw1 bf16", gb.dw1.floats(), gd.dw1.floats(), kBf16Tol);
  expect_close("db2 bf16", gb.db2.floats(), gd.db2.floats(), kBf16Tol);
  expect_close("d_probs f32", first(d_probs_f32, pb.used), first(gd.d_probs, pd.used),
               [](double w) { return std::ldexp(1.0, -24) * std::abs(w); });
}

// ---- split / stack ---------------------------------------------------------------------------------------------

TEST(ExpertWeights, SplitAndStackRoundTripBitExact) {
  for (DType t : {DType::BF16, DType::F32, DType::F8E4M3}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    HostTensor grouped(t, {3, 5, 4}), restacked(t, {3, 5, 4});
    auto* bytes = static_cast<unsigned char*>(grouped.view().data());
    Rng rng(3);
    for (std::size_t i = 0; i < grouped.view().nbytes(); ++i)
      bytes[i] = static_cast<unsigned char>(rng.below(256));  // any bits, NaN patterns too
    std::vector<HostTensor> parts;
    parts.reserve(3);
    for (int e = 0; e < 3; ++e) parts.emplace_back(t, std::initializer_list<std::int64_t>{5, 4});
    std::vector<TensorView> views;
    for (auto& h : parts) views.push_back(h.view());
    ref::split_grouped(grouped, views);
    const std::size_t slice = views[0].nbytes();
    for (int e = 0; e < 3; ++e)
      EXPECT_EQ(std::memcmp(views[std::size_t(e)].data(), bytes + std::size_t(e) * slice, slice), 0) << "expert " << e;
    std::memset(restacked.view().data(), 0xab, restacked.view().nbytes());
    ref::stack_grouped(views, restacked);
    EXPECT_TRUE(same_bytes(restacked, bytes_of(grouped)));
  }
  // Biases: [L, F1] <-> L x [F1].
  HostTensor b(DType::BF16, {2, 3}), b0(DType::BF16, {3}), b1(DType::BF16, {3});
  for (int i = 0; i < 6; ++i) b.set_f(i, 0.5 * i - 1);
  const TensorView parts[] = {b0.view(), b1.view()};
  ref::split_grouped(b, parts);
  EXPECT_EQ(b1.f(2), 1.5);
}

TEST(ExpertWeights, SplitAndStackRejectMismatches) {
  HostTensor grouped(DType::BF16, {2, 3, 4}), a(DType::BF16, {3, 4}), wrong_shape(DType::BF16, {4, 3}),
      wrong_dtype(DType::F32, {3, 4}), flat(DType::BF16, {6});
  const auto before = bytes_of(a), grouped_before = bytes_of(grouped);
  const TensorView one[] = {a.view()};
  const TensorView shape[] = {a.view(), wrong_shape.view()};
  const TensorView dtype[] = {a.view(), wrong_dtype.view()};
  expect_error([&] { ref::split_grouped(grouped, one); }, ErrorCode::InvalidArgument, "got 1 per-expert views");
  expect_error([&] { ref::split_grouped(grouped, shape); }, ErrorCode::InvalidArgument,
               "per_expert[1] has shape [4, 3]");
  expect_error([&] { ref::stack_grouped(dtype, grouped); }, ErrorCode::InvalidArgument, "per_expert[1] has dtype f32");
  const TensorView flat_parts[] = {a.view(), a.view(), a.view(), a.view(), a.view(), a.view()};
  expect_error([&] { ref::split_grouped(flat, flat_parts); }, ErrorCode::InvalidArgument, "at least 2 dimensions");
  EXPECT_TRUE(same_bytes(a, before)) << "split wrote before failing";
  EXPECT_TRUE(same_bytes(grouped, grouped_before)) << "stack wrote before failing";
}

// ---- argument errors -------------------------------------------------------------------------------------------

// Each bad call must throw naming the problem and leave every output exactly as it was.
TEST(Experts, ForwardRejectsBadArgumentsWithoutWriting) {
  MoeConfig c = mlp_config(Activation::SwiGLU, GluLayout::Concatenated, true);
  Problem p(c, {2, 1, 1}, 1, 13);
  HostTensor bad_x(DType::F64, {p.rows, 5}), int_w1(DType::I32, {3, 8, 4}), bad_w2(DType::F64, {3, 4, 5}),
      bf16_probs(DType::BF16, {p.rows}), short_y(DType::F64, {p.rows - 1, 4});
  const std::vector<std::int64_t> too_many = {2, 2, 2}, negative = {2, -2, 1}, two = {2, 1};
  const auto y_before = bytes_of(p.y);

  struct Case {
    const char* needle;
    ErrorCode code;
    std::function<void(ref::ExpertsForwardArgs&, MoeConfig&)> mutate;
  };
  const std::vector<Case> cases = {
      {"x has shape", ErrorCode::InvalidArgument, [&](auto& a, auto&) { a.x = bad_x; }},
      {"weights.w1 has dtype i32", ErrorCode::InvalidArgument, [&](auto& a, auto&) { a.weights.w1 = int_w1; }},
      {"weights.w2 has shape [3, 4, 5]", ErrorCode::InvalidArgument, [&](auto& a, auto&) { a.weights.w2 = bad_w2; }},
      {"weights.b1 is absent but cfg.fc1_bias = true", ErrorCode::InvalidArgument,
       [&](auto& a, auto&) { a.weights.b1 = TensorView{}; }},
      {"weights.b2 is given but cfg.fc2_bias = false", ErrorCode::InvalidArgument,
       [&](auto&, auto& cfg) { cfg.fc2_bias = false; }},
      {"rows_per_expert[2] = 2 ends the segments past the 5 rows", ErrorCode::InvalidArgument,
       [&](auto& a, auto&) { a.rows_per_expert = too_many; }},
      {"rows_per_expert[1] = -2", ErrorCode::InvalidArgument, [&](auto& a, auto&) { a.rows_per_expert = negative; }},
      {"weights.w1 has shape [3, 8, 4] but [2, 8, 4]", ErrorCode::InvalidArgument,
       [&](auto& a, auto&) { a.rows_per_expert = two; }},
      {"probs is absent", ErrorCode::InvalidArgument, [&](auto& a, auto&) { a.probs = TensorView{}; }},
      {"probs has dtype bf16", ErrorCode::InvalidArgument, [&](auto& a, auto&) { a.probs = bf16_probs; }},
      {"probs[3] = nan", ErrorCode::BadRouting,
       [&](auto&, auto&) { p.probs.set_f(3, std::numeric_limits<double>::quiet_NaN()); }},
      {"probs[0] = inf", ErrorCode::BadRouting,
       [&](auto&, auto&) { p.probs.set_f(0, std::numeric_limits<double>::infinity()); }},
      {"y has shape", ErrorCode::InvalidArgument, [&](auto& a, auto&) { a.y = short_y; }},
      {"y is absent", ErrorCode::InvalidArgument, [&](auto& a, auto&) { a.y = TensorView{}; }},
      {"x is on cuda:0", ErrorCode::InvalidArgument,
       [&](auto& a, auto&) { a.x = TensorView(p.x.view().data(), DType::F64, {p.rows, 4}, Device::cuda(0)); }},
      {"glu_block = 3", ErrorCode::InvalidArgument,
       [&](auto&, auto& cfg) { cfg.glu_layout = GluLayout::Interleaved; cfg.glu_block = 3; }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.needle);
    const std::vector<double> probs = p.probs.floats();
    ref::ExpertsForwardArgs a = p.forward_args();
    MoeConfig cfg = c;
    k.mutate(a, cfg);
    expect_error([&] { ref::experts_forward(cfg, a); }, k.code, k.needle);
    EXPECT_TRUE(same_bytes(p.y, y_before)) << "y was written";
    ref::write_floats(p.probs, probs);
  }

  // A NaN prob past the segments is not read, and InCombine does not read probs at all.
  p.probs.set_f(p.rows - 1, std::numeric_limits<double>::quiet_NaN());
  p.forward();
  MoeConfig combine = c;
  combine.prob_mode = ProbMode::InCombine;
  p.probs.set_f(0, std::numeric_limits<double>::quiet_NaN());
  ref::experts_forward(combine, p.forward_args());
}

TEST(Experts, BackwardRejectsBadArgumentsWithoutWriting) {
  MoeConfig c = mlp_config(Activation::GELU, GluLayout::Concatenated, true);
  Problem p(c, {1, 2, 1}, 1, 17);
  Grads g(p);
  HostTensor short_dp(DType::F64, {p.rows - 1}), bf16_dp(DType::BF16, {p.rows});
  const std::vector<std::int64_t> negative = {1, -1, 1}, too_many = {1, 2, 3};

  struct Case {
    const char* needle;
    ErrorCode code;
    std::function<void(ref::ExpertsBackwardArgs&)> mutate;
  };
  const std::vector<Case> cases = {
      {"dy is absent", ErrorCode::InvalidArgument, [&](auto& a) { a.dy = TensorView{}; }},
      {"grads.dw2 is absent", ErrorCode::InvalidArgument, [&](auto& a) { a.grads.dw2 = TensorView{}; }},
      {"grads.db1 is absent but cfg.fc1_bias = true", ErrorCode::InvalidArgument,
       [&](auto& a) { a.grads.db1 = TensorView{}; }},
      {"d_probs has shape", ErrorCode::InvalidArgument, [&](auto& a) { a.d_probs = short_dp; }},
      {"d_probs has dtype bf16", ErrorCode::InvalidArgument, [&](auto& a) { a.d_probs = bf16_dp; }},
      {"rows_per_expert[1] = -1", ErrorCode::InvalidArgument, [&](auto& a) { a.rows_per_expert = negative; }},
      {"rows_per_expert[2] = 3", ErrorCode::InvalidArgument, [&](auto& a) { a.rows_per_expert = too_many; }},
      {"probs is absent", ErrorCode::InvalidArgument, [&](auto& a) { a.probs = TensorView{}; }},
      {"probs[2] = nan", ErrorCode::BadRouting,
       [&](auto&) { p.probs.set_f(2, std::numeric_limits<double>::quiet_NaN()); }},
      {"weights.b2 is absent", ErrorCode::InvalidArgument, [&](auto& a) { a.weights.b2 = TensorView{}; }},
  };
  const std::vector<const HostTensor*> outputs = {&g.dx, &g.d_probs, &g.dw1, &g.db1, &g.dw2, &g.db2};
  std::vector<std::vector<unsigned char>> before;
  for (const HostTensor* t : outputs) before.push_back(bytes_of(*t));
  for (const Case& k : cases) {
    SCOPED_TRACE(k.needle);
    const std::vector<double> probs = p.probs.floats();
    ref::ExpertsBackwardArgs a = backward_args(p, g);
    k.mutate(a);
    expect_error([&] { ref::experts_backward(c, a); }, k.code, k.needle);
    for (std::size_t i = 0; i < outputs.size(); ++i)
      EXPECT_TRUE(same_bytes(*outputs[i], before[i])) << "output " << i << " was written";
    ref::write_floats(p.probs, probs);
  }
}

}  // namespace
}  // namespace moerail
