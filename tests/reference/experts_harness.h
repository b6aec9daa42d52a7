// tests/reference/experts_harness.h — what the tests of the reference expert MLP share: configs, a random problem,
// its gradients' buffers, comparisons and finite differences (experts_test.cpp, experts_fp8_test.cpp).
#pragma once

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

namespace moerail::test::experts_ref {

using ref::HostTensor;
using ref::Rng;

// ---- helpers ---------------------------------------------------------------------------------------------------

inline MoeConfig mlp_config(Activation act, GluLayout layout = GluLayout::Concatenated, bool bias = false,
                     ProbMode mode = ProbMode::InActivation, std::int64_t H = 4, std::int64_t F = 4) {
  MoeConfig cfg;
  cfg.hidden = H;
  cfg.ffn_hidden = F;
  cfg.activation = act;
  cfg.glu_layout = layout;
  cfg.glu_block = layout == GluLayout::Interleaved ? 2 : 0;
  cfg.fc1_bias = bias;
  cfg.fc2_bias = bias;
  cfg.prob_mode = mode;
  return cfg;
}

inline std::string describe(const MoeConfig& cfg) {
  std::string s(name_of(cfg.activation));
  if (cfg.glu_layout == GluLayout::Interleaved) s += " interleaved(" + std::to_string(cfg.glu_block) + ")";
  s += cfg.fc1_bias ? " bias" : " no-bias";
  s += " ";
  s += name_of(cfg.prob_mode);
  return s;
}

// Expects |got[i] - want[i]| <= tol(want[i]) for every i; reports the first mismatches with their indices.
template <typename Tol>
inline void expect_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& want, Tol tol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - want[i]);
    if (!(err <= tol(want[i]))) {  // also catches NaN
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << " but " << want[i] << " was expected (error " << err
                    << ", tolerance " << tol(want[i]) << ")";
      if (++reported == 5) return;
    }
  }
}

inline void expect_close_rel(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                      double rel) {
  expect_close(what, got, want, [rel](double w) { return rel * std::max(1.0, std::abs(w)); });
}

// The Frobenius norm of a - b over ||b||.
inline double rel_frobenius(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

// Bit-exact equality of two byte ranges (compares doubles as bits so that NaN poison compares equal).
inline bool same_bytes(const TensorView& a, const std::vector<unsigned char>& snapshot) {
  return a.nbytes() == snapshot.size() && std::memcmp(a.data(), snapshot.data(), snapshot.size()) == 0;
}
inline std::vector<unsigned char> bytes_of(const TensorView& t) {
  const auto* p = static_cast<const unsigned char*>(t.data());
  return std::vector<unsigned char>(p, p + t.nbytes());
}

// One grouped-MLP problem: inputs filled with deterministic random values, outputs allocated.
// rows = sum(counts) + extra_rows; the extra rows sit past the last segment.
class Problem {
 public:
  Problem(const MoeConfig& config, std::vector<std::int64_t> counts_in, std::int64_t extra_rows, std::uint64_t seed,
          DType dtype = DType::F64)
      : cfg(config),
        counts(std::move(counts_in)),
        L(std::int64_t(counts.size())),
        used(sum(counts)),
        rows(used + extra_rows),
        x(dtype, {rows, cfg.hidden}),
        probs(DType::F64, {rows}),
        w1(dtype, {L, cfg.fc1_out(), cfg.hidden}),
        b1(dtype, {L, cfg.fc1_out()}),
        w2(dtype, {L, cfg.hidden, cfg.ffn_hidden}),
        b2(dtype, {L, cfg.hidden}),
        dy(dtype, {rows, cfg.hidden}),
        y(dtype, {rows, cfg.hidden}) {
    Rng rng(seed);
    ref::fill_uniform(x, rng, -1.0, 1.0);
    ref::fill_uniform(probs, rng, 0.1, 1.0);
    ref::fill_normal(w1, rng, 0.6);
    ref::fill_normal(b1, rng, 0.3);
    ref::fill_normal(w2, rng, 0.5);
    ref::fill_normal(b2, rng, 0.3);
    ref::fill_uniform(dy, rng, -1.0, 1.0);
    y.fill_nan();
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  static std::int64_t sum(const std::vector<std::int64_t>& v) {
    std::int64_t s = 0;
    for (auto c : v) s += c;
    return s;
  }

  ref::ExpertWeights weights() const {
    return {w1.view(), cfg.fc1_bias ? b1.view() : TensorView{}, w2.view(), cfg.fc2_bias ? b2.view() : TensorView{}};
  }
  ref::ExpertsForwardArgs forward_args() const { return {x.view(), probs.view(), counts, weights(), y.view()}; }
  void forward() const { ref::experts_forward(cfg, forward_args()); }

  // L = sum over the segment rows of <dy[r], y[r]>: the loss whose gradient experts_backward computes.
  double loss() const {
    forward();
    double s = 0.0;
    for (std::int64_t i = 0; i < used * cfg.hidden; ++i) s += dy.f(i) * y.f(i);
    return s;
  }

  // h1 = x W1^T + b1 of every segment row, computed directly (used to keep finite differences off the clamp kinks).
  std::vector<double> fc1_outputs() const {
    std::vector<double> out;
    const std::int64_t H = cfg.hidden, F1 = cfg.fc1_out();
    std::int64_t r = 0;
    for (std::int64_t e = 0; e < L; ++e)
      for (std::int64_t n = 0; n < counts[std::size_t(e)]; ++n, ++r)
        for (std::int64_t i = 0; i < F1; ++i) {
          double s = cfg.fc1_bias ? b1.f(e * F1 + i) : 0.0;
          for (std::int64_t k = 0; k < H; ++k) s += x.f(r * H + k) * w1.f((e * F1 + i) * H + k);
          out.push_back(s);
        }
    return out;
  }

  MoeConfig cfg;
  std::vector<std::int64_t> counts;
  std::int64_t L, used, rows;
  HostTensor x, probs, w1, b1, w2, b2, dy, y;
};

// Gradient outputs of experts_backward, poisoned with NaN.
struct Grads {
  Grads(const Problem& p, DType dtype = DType::F64)
      : dx(dtype, {p.rows, p.cfg.hidden}),
        d_probs(DType::F64, {p.rows}),
        dw1(dtype, {p.L, p.cfg.fc1_out(), p.cfg.hidden}),
        db1(dtype, {p.L, p.cfg.fc1_out()}),
        dw2(dtype, {p.L, p.cfg.hidden, p.cfg.ffn_hidden}),
        db2(dtype, {p.L, p.cfg.hidden}) {
    for (const HostTensor* t : {&dx, &d_probs, &dw1, &db1, &dw2, &db2}) t->fill_nan();
  }
  ref::ExpertGrads weight_grads(const MoeConfig& cfg) const {
    return {dw1.view(), cfg.fc1_bias ? db1.view() : TensorView{}, dw2.view(), cfg.fc2_bias ? db2.view() : TensorView{}};
  }
  HostTensor dx, d_probs, dw1, db1, dw2, db2;
};

inline ref::ExpertsBackwardArgs backward_args(const Problem& p, const Grads& g, bool data = true, bool wgrad = true) {
  ref::ExpertsBackwardArgs a;
  a.x = p.x;
  a.probs = p.probs;
  a.rows_per_expert = p.counts;
  a.weights = p.weights();
  a.dy = p.dy;
  if (data) {
    a.dx = g.dx;
    a.d_probs = g.d_probs;
  }
  if (wgrad) a.grads = g.weight_grads(p.cfg);
  return a;
}

// Sets the QuickGeGLU limit between two of the |h1| values near their median, so that some inputs are clamped and
// some are not, with every h1 at least 1e-3 from a kink (the finite-difference steps move h1 by ~1e-5).
inline void place_clamp_limit(Problem& p) {
  std::vector<double> mags;
  for (double v : p.fc1_outputs()) mags.push_back(std::abs(v));
  std::sort(mags.begin(), mags.end());
  std::size_t best = mags.size() / 4;
  for (std::size_t i = mags.size() / 4; i + 1 < 3 * mags.size() / 4; ++i)
    if (mags[i + 1] - mags[i] > mags[best + 1] - mags[best]) best = i;
  ASSERT_GT(mags[best + 1] - mags[best], 2e-3) << "test setup: no gap between |h1| values to put the clamp in";
  p.cfg.quick_geglu_limit = 0.5 * (mags[best] + mags[best + 1]);
}

// Central difference of p.loss() with respect to every element of t (an f64 tensor of p).
// Step 1e-5: truncation error ~ step^2 |L'''| / 6 ~ 1e-11 and rounding error ~ eps |L| / step ~ 1e-10 for |L| ~ 10,
// four orders of magnitude below the 1e-6 relative tolerance the comparisons use.
inline std::vector<double> numeric_grad(const Problem& p, const HostTensor& t, std::int64_t count) {
  constexpr double step = 1e-5;
  std::vector<double> g(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    const double v = t.f(i);
    t.set_f(i, v + step);
    const double up = p.loss();
    t.set_f(i, v - step);
    const double down = p.loss();
    t.set_f(i, v);
    g[std::size_t(i)] = (up - down) / (2 * step);
  }
  return g;
}

inline std::vector<double> first(const HostTensor& t, std::int64_t count) {
  std::vector<double> v = t.floats();
  v.resize(std::size_t(count));
  return v;
}

// Every activation / layout combination the config accepts.
inline std::vector<MoeConfig> activation_variants(bool bias, ProbMode mode) {
  std::vector<MoeConfig> out;
  for (Activation act :
       {Activation::SwiGLU, Activation::GeGLU, Activation::QuickGeGLU, Activation::ReLU2, Activation::GELU}) {
    out.push_back(mlp_config(act, GluLayout::Concatenated, bias, mode));
    if (is_glu(act)) out.push_back(mlp_config(act, GluLayout::Interleaved, bias, mode));
  }
  return out;
}

template <typename Fn>
inline void expect_error(Fn fn, ErrorCode code, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace moerail::test::experts_ref
