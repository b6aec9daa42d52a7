// Tests of the CPU reference router's backward (include/moerail/reference/router.h): router_backward against
// central finite differences in f64 for every score function and option, other shapes, the softplus threshold,
// slot order and f32 views.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "moerail/config.h"
#include "moerail/reference/host.h"
#include "moerail/reference/router.h"
#include "reference/router_harness.h"

namespace moerail {
namespace {

using namespace test::router_ref;  // NOLINT: the harness is these tests' vocabulary

// ---- backward against finite differences ----------------------------------------------------------------------

struct GradCase {
  ScoreFunction score = ScoreFunction::Softmax;
  bool pre_softmax = false;
  std::int64_t T = 10, E = 16, K = 4;
  std::int64_t num_groups = 0, group_topk = 0;
  bool bias = false;
  bool aux = false, z = false;
  std::int64_t samples = 0;  // logits checked: 0 = all, else this many random (t, e)
  double logit_shift = 0.0;  // added to every logit (to reach the softplus threshold)

  std::string name() const {
    std::string s(name_of(score));
    if (pre_softmax) s += "(pre)";
    s += " T=" + std::to_string(T) + " E=" + std::to_string(E) + " K=" + std::to_string(K);
    if (num_groups > 1) s += " groups=" + std::to_string(num_groups) + "/" + std::to_string(group_topk);
    if (bias) s += " bias";
    if (aux) s += " aux";
    if (z) s += " z";
    if (logit_shift != 0) s += " shift=" + std::to_string(logit_shift);
    return s;
  }
};

// Checks router_backward against central differences of L = sum(g * topk_probs) + a * aux + b * z in f64.
// Step h = 1e-5: truncation error ~ h^2 |L'''| ~ 1e-10, cancellation ~ 1e-16 |L| / h ~ 1e-11; a wrong or missing
// gradient term is off by far more than rtol = 1e-6 of the largest gradient, so the check can fail.
void check_gradient(const GradCase& c, std::uint64_t seed) {
  SCOPED_TRACE(c.name());
  ref::Rng rng(seed);
  MoeConfig cfg = router_config(c.E, c.K, c.score, c.pre_softmax);
  cfg.router.num_groups = c.num_groups;
  cfg.router.group_topk = c.group_topk;
  cfg.router.use_expert_bias = c.bias;
  cfg.router.scaling_factor = 1.7;
  cfg.router.aux_loss_coeff = c.aux ? 0.5 : 0.0;
  cfg.router.z_loss_coeff = c.z ? 0.05 : 0.0;

  HostTensor logits = separated_logits(c.T, c.E, rng);
  for (std::int64_t i = 0; i < logits.numel(); ++i) logits.set_f(i, logits.f(i) + c.logit_shift);
  HostTensor bias;
  if (c.bias) {
    bias = HostTensor(DType::F64, {c.E});
    ref::fill_uniform(bias, rng, -0.2, 0.2);
  }
  HostTensor g(DType::F64, {c.T, c.K});
  ref::fill_uniform(g, rng, -1.0, 1.0);
  const double a = c.aux ? rng.uniform(0.5, 2.0) : 0.0, b = c.z ? rng.uniform(0.5, 2.0) : 0.0;

  const Routed base = route(cfg, logits, bias);
  const auto objective = [&](const HostTensor& x) {
    const Routed r = route(cfg, x, bias);
    for (std::int64_t i = 0; i < c.T * c.K; ++i)
      if (r.idx.i(i) != base.idx.i(i)) ADD_FAILURE() << "a finite-difference step changed topk_idx slot " << i;
    if (r.losses.tokens_per_expert != base.losses.tokens_per_expert)
      ADD_FAILURE() << "a finite-difference step changed tokens_per_expert";
    double L = a * r.losses.aux_loss + b * r.losses.z_loss;
    for (std::int64_t i = 0; i < c.T * c.K; ++i) L += g.f(i) * r.probs.f(i);
    return L;
  };

  HostTensor d_logits(DType::F64, {c.T, c.E});
  d_logits.fill_nan();
  ref::RouterBackwardArgs args;
  args.logits = logits;
  args.expert_bias = bias;
  args.topk_idx = base.idx;
  args.d_topk_probs = g;
  args.d_aux_loss = a;
  args.d_z_loss = b;
  args.d_logits = d_logits;
  ref::router_backward(cfg, args);

  double max_grad = 0.0;
  for (std::int64_t i = 0; i < d_logits.numel(); ++i) {
    ASSERT_FALSE(std::isnan(d_logits.f(i))) << "d_logits element " << i << " not written";
    max_grad = std::max(max_grad, std::abs(d_logits.f(i)));
  }
  ASSERT_GT(max_grad, 1e-3) << "the gradient is trivially small: the check would prove nothing";

  std::vector<std::int64_t> checked;
  if (c.samples == 0) {
    checked.resize(logits.numel());
    std::iota(checked.begin(), checked.end(), 0);
  } else {
    for (std::int64_t s = 0; s < c.samples; ++s) checked.push_back(rng.below(logits.numel()));
    for (std::int64_t k = 0; k < c.K; ++k) checked.push_back(base.idx.i(k));  // the selected logits of token 0
  }
  const double h = 1e-5, rtol = 1e-6;
  int mismatches = 0;
  for (std::int64_t i : checked) {
    const double x0 = logits.f(i);
    logits.set_f(i, x0 + h);
    const double up = objective(logits);
    logits.set_f(i, x0 - h);
    const double down = objective(logits);
    logits.set_f(i, x0);
    const double fd = (up - down) / (2 * h);
    if (std::abs(fd - d_logits.f(i)) > rtol * max_grad && mismatches++ < 5)
      ADD_FAILURE() << "d_logits[" << i / c.E << "," << i % c.E << "] = " << d_logits.f(i)
                    << " but finite differences give " << fd << " (max |grad| " << max_grad << ")";
  }
}

TEST(RouterBackward, MatchesFiniteDifferencesForEveryOption) {
  struct Score {
    ScoreFunction score;
    bool pre;
  };
  const Score scores[] = {{ScoreFunction::Softmax, true},
                          {ScoreFunction::Softmax, false},
                          {ScoreFunction::Sigmoid, false},
                          {ScoreFunction::SqrtSoftplus, false}};
  std::uint64_t seed = 100;
  int cases = 0;
  for (const Score& s : scores) {
    for (bool groups : {false, true}) {
      for (bool bias : {false, true}) {
        if (bias && s.score == ScoreFunction::Softmax) continue;  // the bias applies to sigmoid-type scores only
        for (bool aux : {false, true}) {
          for (bool z : {false, true}) {
            GradCase c;
            c.score = s.score;
            c.pre_softmax = s.pre;
            c.bias = bias;
            c.aux = aux;
            c.z = z;
            if (groups) {
              c.num_groups = 4;
              c.group_topk = 2;
            }
            check_gradient(c, seed++);
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 48);
}

TEST(RouterBackward, MatchesFiniteDifferencesOnOtherShapes) {
  std::uint64_t seed = 200;
  for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::Sigmoid, ScoreFunction::SqrtSoftplus}) {
    const bool sig = score != ScoreFunction::Softmax;
    // E not a power of two, K = 5; every logit checked.
    check_gradient({.score = score, .T = 12, .E = 7, .K = 5, .bias = sig, .aux = true, .z = true}, seed++);
    // K = 1 (no normalization; post-softmax weights are constant 1 there), groups of 8 experts.
    check_gradient({.score = score, .T = 16, .E = 32, .K = 1, .num_groups = 4, .group_topk = 1, .bias = sig,
                    .aux = true, .z = true},
                   seed++);
    // DeepSeek-V3-like: E = 256, K = 8, 8 groups keep 4, a few hundred tokens; a sample of the logits.
    check_gradient({.score = score, .T = 128, .E = 256, .K = 8, .num_groups = 8, .group_topk = 4, .bias = sig,
                    .aux = true, .z = true, .samples = 48},
                   seed++);
  }
  check_gradient({.score = ScoreFunction::Softmax, .pre_softmax = true, .T = 12, .E = 7, .K = 5, .aux = true,
                  .z = true},
                 seed++);
}

TEST(RouterBackward, SqrtSoftplusAboveTheThresholdMatchesFiniteDifferences) {
  // Logits in [20.5, 28.5]: softplus(x) = x there, so the derivative is 1 / (2 sqrt(x)).
  check_gradient({.score = ScoreFunction::SqrtSoftplus, .T = 6, .E = 16, .K = 4, .aux = true, .logit_shift = 24.5},
                 300);
}

TEST(RouterBackward, SlotOrderDoesNotMatterAndF32ViewsRound) {
  ref::Rng rng(31);
  MoeConfig cfg = router_config(16, 4, ScoreFunction::Sigmoid);
  cfg.router.aux_loss_coeff = 0.1;
  cfg.router.z_loss_coeff = 0.01;
  const HostTensor logits = separated_logits(8, 16, rng);
  const Routed r = route(cfg, logits);
  HostTensor g(DType::F32, {8, 4});
  ref::fill_uniform(g, rng, -1.0, 1.0);
  // The same selection with the slots of every token reversed, and g reversed with them.
  HostTensor idx_rev(DType::I32, {8, 4}), g_rev(DType::F32, {8, 4});
  for (std::int64_t t = 0; t < 8; ++t) {
    for (std::int64_t k = 0; k < 4; ++k) {
      idx_rev.set_i(t * 4 + k, r.idx.i(t * 4 + 3 - k));
      g_rev.set_f(t * 4 + k, g.f(t * 4 + 3 - k));
    }
  }
  const auto backward = [&](const HostTensor& idx, const HostTensor& dp, DType dtype) {
    HostTensor d_logits(dtype, {8, 16});
    d_logits.fill_nan();
    ref::RouterBackwardArgs args;
    args.logits = logits;
    args.topk_idx = idx;
    args.d_topk_probs = dp;
    args.d_aux_loss = 0.7;
    args.d_z_loss = 1.3;
    args.d_logits = d_logits;
    ref::router_backward(cfg, args);
    return d_logits.floats();
  };
  const std::vector<double> forward_order = backward(r.idx, g, DType::F64);
  const std::vector<double> reversed = backward(idx_rev, g_rev, DType::F64);
  const std::vector<double> as_f32 = backward(r.idx, g, DType::F32);
  for (std::size_t i = 0; i < forward_order.size(); ++i) {
    EXPECT_NEAR(reversed[i], forward_order[i], kF64Tol) << "element " << i;  // sums in another order
    EXPECT_EQ(as_f32[i], double(float(forward_order[i]))) << "element " << i;
  }
}

}  // namespace
}  // namespace moerail
