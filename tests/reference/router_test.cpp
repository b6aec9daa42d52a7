// Tests of the CPU reference router (include/moerail/reference/router.h): hand-computed forward cases for every
// score function, selection order and ties, group-limited top-k, expert bias, normalization, scaling, the aux and
// z losses against their formulas, and argument errors (the backward: router_backward_test.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "moerail/config.h"
#include "moerail/error.h"
#include "moerail/reference/host.h"
#include "moerail/reference/router.h"
#include "reference/router_harness.h"

namespace moerail {
namespace {

using namespace test::router_ref;  // NOLINT: the harness is these tests' vocabulary
using Rows = std::vector<std::vector<double>>;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double sqrtsoftplus(double x) { return std::sqrt(x > 20 ? x : std::log1p(std::exp(x))); }

HostTensor make_tensor(const Rows& rows, DType dtype = DType::F64) {
  HostTensor t(dtype, {std::int64_t(rows.size()), std::int64_t(rows.at(0).size())});
  std::int64_t i = 0;
  for (const auto& row : rows)
    for (double v : row) t.set_f(i++, v);
  return t;
}

HostTensor make_vector(const std::vector<double>& values, DType dtype = DType::F64) {
  HostTensor t(dtype, {std::int64_t(values.size())});
  for (std::size_t i = 0; i < values.size(); ++i) t.set_f(std::int64_t(i), values[i]);
  return t;
}

using Idx = std::vector<std::int64_t>;

// ---- forward: each score function by hand ---------------------------------------------------------------------

const Rows kOneToken = {{1.0, 3.0, 2.0, 0.0}};

TEST(RouterForward, SoftmaxPreTopkByHand) {
  const Routed r = route(router_config(4, 2, ScoreFunction::Softmax, /*pre_softmax=*/true), make_tensor(kOneToken));
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + std::exp(0.0);
  EXPECT_EQ(r.row_idx(0), (Idx{1, 2}));
  EXPECT_NEAR(r.probs.f(0), std::exp(3.0) / z, kF64Tol);
  EXPECT_NEAR(r.probs.f(1), std::exp(2.0) / z, kF64Tol);
}

TEST(RouterForward, SoftmaxPostTopkByHand) {
  const Routed r = route(router_config(4, 2, ScoreFunction::Softmax), make_tensor(kOneToken));
  EXPECT_EQ(r.row_idx(0), (Idx{1, 2}));
  // softmax over the selected logits {3, 2} only
  EXPECT_NEAR(r.probs.f(0), 1.0 / (1.0 + std::exp(-1.0)), kF64Tol);
  EXPECT_NEAR(r.probs.f(1), std::exp(-1.0) / (1.0 + std::exp(-1.0)), kF64Tol);
}

TEST(RouterForward, SigmoidByHand) {
  const Routed r2 = route(router_config(4, 2, ScoreFunction::Sigmoid), make_tensor(kOneToken));
  const double s3 = 1.0 / (1.0 + std::exp(-3.0)), s2 = 1.0 / (1.0 + std::exp(-2.0));
  EXPECT_EQ(r2.row_idx(0), (Idx{1, 2}));
  EXPECT_NEAR(r2.probs.f(0), s3 / (s3 + s2), kF64Tol);  // K > 1: normalized
  EXPECT_NEAR(r2.probs.f(1), s2 / (s3 + s2), kF64Tol);

  const Routed r1 = route(router_config(4, 1, ScoreFunction::Sigmoid), make_tensor(kOneToken));
  EXPECT_EQ(r1.row_idx(0), (Idx{1}));
  EXPECT_NEAR(r1.probs.f(0), s3, kF64Tol);  // K = 1: the raw score
}

TEST(RouterForward, SqrtSoftplusByHand) {
  const Routed r2 = route(router_config(4, 2, ScoreFunction::SqrtSoftplus), make_tensor(kOneToken));
  const double s3 = std::sqrt(std::log(1.0 + std::exp(3.0))), s2 = std::sqrt(std::log(1.0 + std::exp(2.0)));
  EXPECT_EQ(r2.row_idx(0), (Idx{1, 2}));
  EXPECT_NEAR(r2.probs.f(0), s3 / (s3 + s2), kF64Tol);
  EXPECT_NEAR(r2.probs.f(1), s2 / (s3 + s2), kF64Tol);

  // softplus(x) = x above 20, so the score of 25 is sqrt(25) = 5 exactly (log1p(exp(25)) is 25 + 1.4e-11).
  const Routed r1 = route(router_config(4, 1, ScoreFunction::SqrtSoftplus), make_tensor({{-1.0, 25.0, 3.0, 2.0}}));
  EXPECT_EQ(r1.row_idx(0), (Idx{1}));
  EXPECT_EQ(r1.probs.f(0), 5.0);
}

// ---- selection order and ties ---------------------------------------------------------------------------------

TEST(RouterForward, TopkIdxIsByDescendingScoreWithTiesToTheLowerIndex) {
  const Rows rows = {{2.0, 5.0, 5.0, 1.0, 5.0, 7.0},   // 7 first, then the three 5s by index
                     {0.0, 0.0, 0.0, 0.0, 0.0, 0.0},   // all equal: 0, 1, 2, 3
                     {-1.0, 3.0, -1.0, 3.0, 4.0, -1.0}};
  const std::vector<Idx> expected = {{5, 1, 2, 4}, {0, 1, 2, 3}, {4, 1, 3, 0}};
  for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::Sigmoid, ScoreFunction::SqrtSoftplus}) {
    for (bool pre : {false, true}) {
      if (pre && score != ScoreFunction::Softmax) continue;
      const Routed r = route(router_config(6, 4, score, pre), make_tensor(rows));
      for (std::int64_t t = 0; t < 3; ++t)
        EXPECT_EQ(r.row_idx(t), expected[t]) << name_of(score) << (pre ? " pre" : "") << " token " << t;
    }
  }
}

TEST(RouterForward, EqualScoresGetEqualWeights) {
  const Routed r = route(router_config(5, 3, ScoreFunction::Softmax), make_tensor({{1.0, 1.0, 0.0, 1.0, 1.0}}));
  EXPECT_EQ(r.row_idx(0), (Idx{0, 1, 3}));
  for (std::int64_t k = 0; k < 3; ++k) EXPECT_NEAR(r.probs.f(k), 1.0 / 3.0, kF64Tol);
}

// ---- group-limited top-k --------------------------------------------------------------------------------------

TEST(RouterForward, GroupLimitedTopkChangesTheSelection) {
  // E = 8 in 4 groups of 2, K = 4, group_topk = 2: a group scores the sum of its top K / group_topk = 2 experts.
  // Group scores 9, 10, 12, 2: groups 2 and 1 are kept. Without groups expert 0 (logit 9) would be picked first.
  const Rows rows = {{9.0, 0.0, 5.0, 5.0, 6.0, 6.0, 1.0, 1.0}};
  for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::Sigmoid, ScoreFunction::SqrtSoftplus}) {
    MoeConfig cfg = router_config(8, 4, score);
    EXPECT_EQ(route(cfg, make_tensor(rows)).row_idx(0), (Idx{0, 4, 5, 2})) << name_of(score);
    cfg.router.num_groups = 4;
    cfg.router.group_topk = 2;
    EXPECT_EQ(route(cfg, make_tensor(rows)).row_idx(0), (Idx{4, 5, 2, 3})) << name_of(score);
  }
}

TEST(RouterForward, GroupScoreSumsOnlyTheTopExpertsOfTheGroup) {
  // 3 groups of 4, K = 2, group_topk = 1: a group scores its top 2 = K / group_topk experts. Group 0 scores
  // 5 + 5 = 10 (all four: -10), group 1 scores 4 + 4 = 8 (all four: 16), so group 0 is kept.
  MoeConfig cfg = router_config(12, 2, ScoreFunction::Softmax);
  cfg.router.num_groups = 3;
  cfg.router.group_topk = 1;
  const Rows rows = {{5.0, -10.0, 5.0, -10.0, 4.0, 4.0, 4.0, 4.5, 0.0, 0.0, 0.0, 0.0}};
  EXPECT_EQ(route(cfg, make_tensor(rows)).row_idx(0), (Idx{0, 2}));
}

TEST(RouterForward, GroupTiesGoToTheLowerGroup) {
  // 4 groups of 2, group_topk = 1, K = 2: groups 1 and 2 both score 3; group 1 is kept, so experts 2 and 3
  // (without groups: 2 and 5, the two logits of 2).
  MoeConfig cfg = router_config(8, 2, ScoreFunction::Softmax);
  const Rows rows = {{0.0, 0.0, 2.0, 1.0, 1.0, 2.0, 0.0, 0.0}};
  EXPECT_EQ(route(cfg, make_tensor(rows)).row_idx(0), (Idx{2, 5}));
  cfg.router.num_groups = 4;
  cfg.router.group_topk = 1;
  EXPECT_EQ(route(cfg, make_tensor(rows)).row_idx(0), (Idx{2, 3}));
}

TEST(RouterForward, GroupScoresIncludeTheExpertBias) {
  // Sigmoid, 2 groups of 2, group_topk = 1, K = 2 (both experts of the kept group). Group 0 has the larger raw
  // scores, but a bias of 1 on expert 3 makes group 1 win; the weights stay the unbiased scores.
  MoeConfig cfg = router_config(4, 2, ScoreFunction::Sigmoid);
  cfg.router.num_groups = 2;
  cfg.router.group_topk = 1;
  const Rows rows = {{2.0, 1.0, 0.0, -1.0}};
  EXPECT_EQ(route(cfg, make_tensor(rows)).row_idx(0), (Idx{0, 1}));
  cfg.router.use_expert_bias = true;
  const HostTensor bias = make_vector({0.0, 0.0, 0.0, 1.0});
  const Routed r = route(cfg, make_tensor(rows), bias);
  EXPECT_EQ(r.row_idx(0), (Idx{3, 2}));  // biased scores 1.27, 0.5
  const double s3 = sigmoid(-1.0), s2 = sigmoid(0.0);
  EXPECT_NEAR(r.probs.f(0), s3 / (s3 + s2), kF64Tol);
  EXPECT_NEAR(r.probs.f(1), s2 / (s3 + s2), kF64Tol);
}

// ---- expert bias, normalization, scaling -----------------------------------------------------------------------

TEST(RouterForward, ExpertBiasMovesTheSelectionButNotTheWeights) {
  const Rows rows = {{2.0, 1.0, 0.0, -1.0}};
  const HostTensor bias = make_vector({0.0, 0.0, 0.0, 2.0}, DType::F32);
  for (ScoreFunction score : {ScoreFunction::Sigmoid, ScoreFunction::SqrtSoftplus}) {
    const auto s = [score](double x) { return score == ScoreFunction::Sigmoid ? sigmoid(x) : sqrtsoftplus(x); };
    MoeConfig cfg = router_config(4, 2, score);
    EXPECT_EQ(route(cfg, make_tensor(rows)).row_idx(0), (Idx{0, 1})) << name_of(score);
    cfg.router.use_expert_bias = true;
    const Routed r = route(cfg, make_tensor(rows), bias);
    EXPECT_EQ(r.row_idx(0), (Idx{3, 0})) << name_of(score);  // -1 + bias 2 beats every other score
    EXPECT_NEAR(r.probs.f(0), s(-1.0) / (s(-1.0) + s(2.0)), kF64Tol) << name_of(score);
    EXPECT_NEAR(r.probs.f(1), s(2.0) / (s(-1.0) + s(2.0)), kF64Tol) << name_of(score);
  }
}

TEST(RouterForward, SigmoidTypeWeightsAreNormalizedOnlyWhenKAboveOne) {
  ref::Rng rng(11);
  const HostTensor logits = separated_logits(20, 16, rng);
  for (ScoreFunction score : {ScoreFunction::Sigmoid, ScoreFunction::SqrtSoftplus}) {
    const Routed r5 = route(router_config(16, 5, score), logits);
    const Routed r1 = route(router_config(16, 1, score), logits);
    for (std::int64_t t = 0; t < 20; ++t) {
      const std::vector<double> p = r5.row_probs(t);
      EXPECT_NEAR(std::accumulate(p.begin(), p.end(), 0.0), 1.0, kF64Tol) << name_of(score) << " token " << t;
      const double x = logits.f(t * 16 + r1.idx.i(t));
      EXPECT_NEAR(r1.probs.f(t), score == ScoreFunction::Sigmoid ? sigmoid(x) : sqrtsoftplus(x), kF64Tol);
    }
  }
  // Pre-softmax weights are the selected softmax probabilities: not renormalized, they sum to less than 1.
  const Routed pre = route(router_config(16, 5, ScoreFunction::Softmax, true), logits);
  const std::vector<double> p = pre.row_probs(0);
  EXPECT_LT(std::accumulate(p.begin(), p.end(), 0.0), 1.0 - 1e-3);
}

TEST(RouterForward, NormalizationDividesBySumPlusEpsilon) {
  // Scores near 1e-22 show the 1e-20 in the denominator: w = s / (sum + 1e-20), not s / sum.
  const Routed r = route(router_config(4, 2, ScoreFunction::Sigmoid), make_tensor({{-60.0, -50.0, -50.5, -70.0}}));
  const double s1 = sigmoid(-50.0), s2 = sigmoid(-50.5);
  EXPECT_EQ(r.row_idx(0), (Idx{1, 2}));
  EXPECT_NEAR(r.probs.f(0), s1 / (s1 + s2 + 1e-20), kF64Tol * r.probs.f(0));
  EXPECT_NEAR(r.probs.f(1), s2 / (s1 + s2 + 1e-20), kF64Tol * r.probs.f(1));
}

TEST(RouterForward, ScalingFactorMultipliesTheWeights) {
  ref::Rng rng(12);
  const HostTensor logits = separated_logits(30, 32, rng);
  for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::Sigmoid, ScoreFunction::SqrtSoftplus}) {
    MoeConfig cfg = router_config(32, 8, score);
    const Routed base = route(cfg, logits);
    cfg.router.scaling_factor = 2.5;
    const Routed scaled = route(cfg, logits);
    for (std::int64_t i = 0; i < 30 * 8; ++i) {
      ASSERT_EQ(scaled.idx.i(i), base.idx.i(i)) << name_of(score) << " slot " << i;
      ASSERT_EQ(scaled.probs.f(i), 2.5 * base.probs.f(i)) << name_of(score) << " slot " << i;  // one rounding each
    }
  }
}

// Checks on a large random batch, against selection rules restated here: every row holds K distinct experts by
// descending selection score (ties to the lower index); with groups, they lie in the group_topk groups of largest
// top-(K / group_topk) sums; and no unselected eligible expert beats the last selected one.
TEST(RouterForward, LargeBatchSelectionIsTheTopK) {
  ref::Rng rng(13);
  const std::int64_t T = 300, E = 256, K = 8, G = 8, group_topk = 4, group_size = E / G;
  HostTensor logits(DType::F32, {T, E});
  ref::fill_normal(logits, rng, 2.0);
  HostTensor bias(DType::F32, {E});
  ref::fill_uniform(bias, rng, -0.1, 0.1);
  for (bool groups : {false, true}) {
    MoeConfig cfg = router_config(E, K, ScoreFunction::Sigmoid);
    cfg.router.use_expert_bias = true;
    if (groups) {
      cfg.router.num_groups = G;
      cfg.router.group_topk = group_topk;
    }
    const Routed r = route(cfg, logits, bias);
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<double> sel(E);
      for (std::int64_t e = 0; e < E; ++e) sel[e] = sigmoid(logits.f(t * E + e)) + bias.f(e);
      const auto before = [&](std::int64_t a, std::int64_t b) { return sel[a] > sel[b] || (sel[a] == sel[b] && a < b); };

      std::vector<bool> eligible(E, true);
      if (groups) {
        std::vector<double> group_score(G);
        for (std::int64_t g = 0; g < G; ++g) {
          std::vector<double> members(sel.begin() + g * group_size, sel.begin() + (g + 1) * group_size);
          std::sort(members.begin(), members.end(), std::greater<>());
          group_score[g] = members[0] + members[1];  // K / group_topk = 2
        }
        Idx order(G);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
          return group_score[a] > group_score[b];
        });
        for (std::int64_t e = 0; e < E; ++e)
          eligible[e] = std::find(order.begin(), order.begin() + group_topk, e / group_size) != order.begin() + group_topk;
      }

      const Idx idx = r.row_idx(t);
      std::vector<bool> picked(E, false);
      for (std::int64_t k = 0; k < K; ++k) {
        ASSERT_TRUE(idx[k] >= 0 && idx[k] < E && !picked[idx[k]] && eligible[idx[k]]) << "token " << t << " slot " << k;
        picked[idx[k]] = true;
        if (k > 0) {
          ASSERT_TRUE(before(idx[k - 1], idx[k])) << "token " << t << " slot " << k;
        }
      }
      for (std::int64_t e = 0; e < E; ++e)
        ASSERT_TRUE(picked[e] || !eligible[e] || before(idx[K - 1], e)) << "token " << t << " expert " << e;
    }
  }
}

TEST(RouterForward, LowPrecisionViewsRoundOnLoadAndStore) {
  ref::Rng rng(14);
  HostTensor logits16(DType::BF16, {10, 7});
  ref::fill_normal(logits16, rng, 1.5);
  HostTensor logits64(DType::F64, {10, 7});
  for (std::int64_t i = 0; i < 70; ++i) logits64.set_f(i, logits16.f(i));  // the same values, exactly
  const MoeConfig cfg = router_config(7, 5, ScoreFunction::SqrtSoftplus);
  const Routed low = route(cfg, logits16, {}, -1, DType::F32);
  const Routed high = route(cfg, logits64);
  for (std::int64_t i = 0; i < 50; ++i) {
    EXPECT_EQ(low.idx.i(i), high.idx.i(i));
    EXPECT_EQ(low.probs.f(i), double(float(high.probs.f(i))));
  }
}

// ---- losses ---------------------------------------------------------------------------------------------------

TEST(RouterLoss, AuxLossByHand) {
  // T = 2, E = 2, K = 1, softmax scores [.5, .5] and [.75, .25]: both tokens count for expert 0 (the first by a
  // tie), so tokens_per_expert = [2, 0] and aux = E * c / (K * T^2) * (0.5 + 0.75) * 2 = 1.25 c.
  MoeConfig cfg = router_config(2, 1, ScoreFunction::Softmax);
  cfg.router.aux_loss_coeff = 0.01;
  const Routed r = route(cfg, make_tensor({{0.0, 0.0}, {std::log(3.0), 0.0}}));
  EXPECT_EQ(r.losses.tokens_per_expert, (Idx{2, 0}));
  EXPECT_NEAR(r.losses.aux_loss, 1.25 * 0.01, kF64Tol);
  EXPECT_EQ(r.losses.z_loss, 0.0);
}

// The aux loss by its formula, computed here independently: scores over all E (softmax, or s / (sum s + 1e-20)),
// counts of their top-K by a stable sort.
double aux_loss_by_formula(const MoeConfig& cfg, const HostTensor& logits, std::int64_t total_tokens,
                           Idx* tokens_per_expert) {
  const std::int64_t T = logits.view().size(0), E = cfg.num_experts, K = cfg.topk;
  std::vector<double> column_sum(E, 0.0);
  Idx tpe(E, 0);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<double> s(E);
    for (std::int64_t e = 0; e < E; ++e) {
      const double x = logits.f(t * E + e);
      s[e] = cfg.router.score == ScoreFunction::Softmax ? std::exp(x)
             : cfg.router.score == ScoreFunction::Sigmoid ? sigmoid(x) : sqrtsoftplus(x);
    }
    const double sum = std::accumulate(s.begin(), s.end(), 0.0);
    const double denom = cfg.router.score == ScoreFunction::Softmax ? sum : sum + 1e-20;
    for (std::int64_t e = 0; e < E; ++e) column_sum[e] += s[e] / denom;
    Idx order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return s[a] > s[b]; });
    for (std::int64_t k = 0; k < K; ++k) ++tpe[order[k]];
  }
  double total = 0.0;
  for (std::int64_t e = 0; e < E; ++e) total += column_sum[e] * double(tpe[e]);
  *tokens_per_expert = tpe;
  const double tt = double(total_tokens);
  return double(E) * cfg.router.aux_loss_coeff / (double(K) * tt * tt) * total;
}

TEST(RouterLoss, AuxLossMatchesTheFormulaAndIgnoresBiasGroupsAndPreSoftmax) {
  ref::Rng rng(21);
  const std::int64_t T = 40, E = 16, K = 4;
  HostTensor logits(DType::F64, {T, E});
  ref::fill_normal(logits, rng, 1.0);
  HostTensor bias(DType::F64, {E});
  ref::fill_uniform(bias, rng, -1.0, 1.0);
  for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::Sigmoid, ScoreFunction::SqrtSoftplus}) {
    MoeConfig cfg = router_config(E, K, score);
    cfg.router.aux_loss_coeff = 0.3;
    Idx tpe;
    const double expected = aux_loss_by_formula(cfg, logits, T, &tpe);
    // The loss is a sum of T*E products of size ~1: a relative error of a few hundred ulps at most.
    const double tol = 1e-13 * expected;

    const Routed plain = route(cfg, logits);
    EXPECT_NEAR(plain.losses.aux_loss, expected, tol) << name_of(score);
    EXPECT_EQ(plain.losses.tokens_per_expert, tpe) << name_of(score);
    EXPECT_EQ(std::accumulate(tpe.begin(), tpe.end(), std::int64_t(0)), T * K);

    // total_tokens = 3T (a loss group of three ranks): the factor 1/T_total^2 makes it 9 times smaller.
    EXPECT_NEAR(route(cfg, logits, {}, 3 * T).losses.aux_loss, expected / 9.0, tol / 9.0) << name_of(score);

    // Neither groups nor the bias nor pre-softmax enter the aux loss.
    cfg.router.num_groups = 4;
    cfg.router.group_topk = 2;
    if (score == ScoreFunction::Softmax) {
      cfg.router.pre_softmax = true;
      EXPECT_NEAR(route(cfg, logits).losses.aux_loss, expected, tol);
    } else {
      cfg.router.use_expert_bias = true;
      const Routed biased = route(cfg, logits, bias);
      EXPECT_NEAR(biased.losses.aux_loss, expected, tol) << name_of(score);
      EXPECT_EQ(biased.losses.tokens_per_expert, tpe) << name_of(score);
    }
  }
}

TEST(RouterLoss, AuxLossNormalizesSigmoidScoresBySumPlusEpsilon) {
  // Sigmoid scores near 1e-22: the 1e-20 of the normalization dominates the sum.
  MoeConfig cfg = router_config(3, 1, ScoreFunction::Sigmoid);
  cfg.router.aux_loss_coeff = 0.1;
  const HostTensor logits = make_tensor({{-50.0, -51.0, -49.0}, {-52.0, -48.0, -50.0}});
  Idx tpe;
  const double expected = aux_loss_by_formula(cfg, logits, 2, &tpe);
  const Routed r = route(cfg, logits);
  EXPECT_EQ(r.losses.tokens_per_expert, (Idx{0, 1, 1}));
  EXPECT_NEAR(r.losses.aux_loss, expected, 1e-13 * expected);
}

TEST(RouterLoss, ZLossIsTheMeanSquaredLogsumexp) {
  // logsumexp of [0, 0] is ln 2, of [ln 3, 0] is ln 4 = 2 ln 2: z = c * (1 + 4) (ln 2)^2 / 2.
  MoeConfig cfg = router_config(2, 1, ScoreFunction::Sigmoid);
  cfg.router.z_loss_coeff = 0.001;
  const Routed r = route(cfg, make_tensor({{0.0, 0.0}, {std::log(3.0), 0.0}}));
  const double ln2 = std::log(2.0);
  EXPECT_NEAR(r.losses.z_loss, 0.001 * 2.5 * ln2 * ln2, kF64Tol * 0.001);
  EXPECT_EQ(r.losses.aux_loss, 0.0);
  EXPECT_TRUE(r.losses.tokens_per_expert.empty());
}

TEST(RouterLoss, NoTokensGiveZeroLosses) {
  MoeConfig cfg = router_config(8, 2, ScoreFunction::Softmax);
  cfg.router.aux_loss_coeff = 0.1;
  cfg.router.z_loss_coeff = 0.1;
  HostTensor logits(DType::F32, {0, 8});
  const Routed r = route(cfg, logits);
  EXPECT_EQ(r.losses.aux_loss, 0.0);
  EXPECT_EQ(r.losses.z_loss, 0.0);
  EXPECT_EQ(r.losses.tokens_per_expert, Idx(8, 0));
}

// ---- argument errors: named, and nothing written ----------------------------------------------------------------

// A valid forward call (sigmoid with bias, groups, both losses) whose pieces the error tests break one at a time.
struct ForwardCall {
  MoeConfig cfg = [] {
    MoeConfig c = router_config(8, 2, ScoreFunction::Sigmoid);
    c.max_tokens = 6;
    c.router.use_expert_bias = true;
    c.router.num_groups = 4;
    c.router.group_topk = 2;
    c.router.aux_loss_coeff = 0.01;
    c.router.z_loss_coeff = 0.001;
    return c;
  }();
  HostTensor logits{DType::F32, {6, 8}}, bias{DType::F32, {8}};
  HostTensor idx{DType::I32, {6, 2}}, probs{DType::F32, {6, 2}};
  ref::RouterForwardArgs args;

  ForwardCall() {
    ref::Rng rng(41);
    ref::fill_normal(logits, rng, 1.0);
    ref::fill_uniform(bias, rng, -0.1, 0.1);
    idx.fill_nan();
    probs.fill_nan();
    args.logits = logits;
    args.expert_bias = bias;
    args.topk_idx = idx;
    args.topk_probs = probs;
  }
};

std::vector<unsigned char> bytes_of(const TensorView& t) {
  const auto* p = static_cast<const unsigned char*>(t.data());
  return std::vector<unsigned char>(p, p + t.nbytes());
}

// Runs `call`, expects Error(InvalidArgument) whose message contains `needle`, and that `outputs` were not touched.
void expect_rejected(const std::function<void()>& call, const std::string& needle,
                     const std::vector<TensorView>& outputs) {
  std::vector<std::vector<unsigned char>> before;
  for (const TensorView& t : outputs) before.push_back(bytes_of(t));
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error containing: " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
  for (std::size_t i = 0; i < outputs.size(); ++i)
    EXPECT_EQ(bytes_of(outputs[i]), before[i]) << "output " << i << " was written before the error (" << needle << ")";
}

TEST(RouterErrors, ValidCallIsAcceptedAndWritesEverything) {
  ForwardCall f;
  ref::router_forward(f.cfg, f.args);
  for (std::int64_t i = 0; i < 12; ++i) {
    EXPECT_TRUE(f.idx.i(i) >= 0 && f.idx.i(i) < 8);
    EXPECT_FALSE(std::isnan(f.probs.f(i)));
  }
}

TEST(RouterErrors, ForwardRejectsBadArgumentsAndWritesNothing) {
  const auto rejects = [](const std::function<void(ForwardCall&)>& mutate, const std::string& needle) {
    ForwardCall f;
    mutate(f);
    expect_rejected([&] { ref::router_forward(f.cfg, f.args); }, needle, {f.idx, f.probs});
  };
  HostTensor wide(DType::F32, {6, 9}), idx_long(DType::I32, {6, 3}), probs_short(DType::F32, {5, 2});
  HostTensor idx_i64(DType::I64, {6, 2}), probs_bf16(DType::BF16, {6, 2}), logits_i32(DType::I32, {6, 8});
  HostTensor bias_short(DType::F32, {7}), seven_tokens(DType::F32, {7, 8});
  wide.fill(0.0);
  seven_tokens.fill(0.0);

  rejects([&](ForwardCall& f) { f.args.logits = wide; }, "router_forward: logits has shape [6, 9] but [*, 8] was expected");
  rejects([&](ForwardCall& f) { f.args.topk_idx = idx_long; }, "router_forward: topk_idx has shape [6, 3] but [6, 2]");
  rejects([&](ForwardCall& f) { f.args.topk_probs = probs_short; }, "topk_probs has shape [5, 2] but [6, 2]");
  rejects([&](ForwardCall& f) { f.args.topk_idx = idx_i64; }, "topk_idx has dtype i64 but one of {i32}");
  rejects([&](ForwardCall& f) { f.args.topk_probs = probs_bf16; }, "topk_probs has dtype bf16");
  rejects([&](ForwardCall& f) { f.args.logits = logits_i32; }, "logits has dtype i32");
  rejects([&](ForwardCall& f) { f.args.logits = TensorView(f.logits.view().data(), DType::F32, {6, 8}, Device::cuda(0)); },
          "logits is on cuda:0 but host was expected");
  rejects([&](ForwardCall& f) { f.logits.set_f(3 * 8 + 5, std::numeric_limits<double>::quiet_NaN()); },
          "router_forward: logits[3,5] = nan but finite logits were expected");
  rejects([&](ForwardCall& f) { f.logits.set_f(1 * 8 + 2, std::numeric_limits<double>::infinity()); },
          "logits[1,2] = inf but finite");
  rejects([&](ForwardCall& f) { f.logits.set_f(5 * 8 + 7, -std::numeric_limits<double>::infinity()); },
          "logits[5,7] = -inf but finite");
  rejects([&](ForwardCall& f) { f.args.logits = seven_tokens; }, "logits has T = 7 tokens but cfg.max_tokens = 6");
  rejects([&](ForwardCall& f) { f.args.expert_bias = TensorView(); },
          "expert_bias is not given but cfg.router.use_expert_bias is set");
  rejects([&](ForwardCall& f) { f.cfg.router.use_expert_bias = false; f.cfg.router.score = ScoreFunction::Softmax; },
          "expert_bias is given (shape [8]) but cfg.router.use_expert_bias is not set");
  rejects([&](ForwardCall& f) { f.args.expert_bias = bias_short; }, "expert_bias has shape [7] but [8]");
  rejects([&](ForwardCall& f) { f.bias.set_f(4, std::numeric_limits<double>::quiet_NaN()); }, "expert_bias[4] = nan");
  rejects([&](ForwardCall& f) { f.args.total_tokens = 5; }, "total_tokens = 5 but -1 (= T) or a count >= T = 6");
  rejects([&](ForwardCall& f) { f.cfg.topk = 9; }, "topk = 9 but num_experts = 8");
}

TEST(RouterErrors, BackwardRejectsBadArgumentsAndWritesNothing) {
  ForwardCall f;
  ref::router_forward(f.cfg, f.args);
  HostTensor d_probs(DType::F32, {6, 2}), d_logits(DType::F32, {6, 8});
  d_probs.fill(1.0);
  d_logits.fill_nan();
  const auto rejects = [&](const std::function<void(ref::RouterBackwardArgs&, MoeConfig&)>& mutate,
                           const std::string& needle) {
    ref::RouterBackwardArgs args;
    args.logits = f.logits;
    args.expert_bias = f.bias;
    args.topk_idx = f.idx;
    args.d_topk_probs = d_probs;
    args.d_logits = d_logits;
    MoeConfig cfg = f.cfg;
    mutate(args, cfg);
    expect_rejected([&] { ref::router_backward(cfg, args); }, needle, {d_logits});
  };
  HostTensor bad_idx(DType::I32, {6, 2}), d_logits_bf16(DType::BF16, {6, 8}), d_logits_short(DType::F32, {6, 7});
  for (std::int64_t i = 0; i < 12; ++i) bad_idx.set_i(i, f.idx.i(i));

  bad_idx.set_i(2 * 2 + 1, 8);
  rejects([&](auto& a, auto&) { a.topk_idx = bad_idx; }, "router_backward: topk_idx[2,1] = 8 but num_experts = 8");
  bad_idx.set_i(2 * 2 + 1, bad_idx.i(2 * 2 + 0));
  rejects([&](auto& a, auto&) { a.topk_idx = bad_idx; }, "repeats topk_idx[2,0]");
  bad_idx.set_i(2 * 2 + 1, -1);
  rejects([&](auto& a, auto&) { a.topk_idx = bad_idx; }, "topk_idx[2,1] = -1");
  rejects([&](auto& a, auto&) { a.d_logits = d_logits_bf16; }, "d_logits has dtype bf16");
  rejects([&](auto& a, auto&) { a.d_logits = d_logits_short; }, "d_logits has shape [6, 7] but [6, 8]");
  rejects([&](auto& a, auto&) { a.d_topk_probs = f.idx; }, "d_topk_probs has dtype i32");
  rejects([&](auto& a, auto&) { a.expert_bias = TensorView(); }, "expert_bias is not given");
  rejects([&](auto& a, auto&) { a.d_aux_loss = std::numeric_limits<double>::quiet_NaN(); }, "d_aux_loss = nan");
  rejects([&](auto&, auto& cfg) { cfg.max_tokens = 5; }, "logits has T = 6 tokens but cfg.max_tokens = 5");

  f.logits.set_f(0, std::numeric_limits<double>::quiet_NaN());
  rejects([&](auto&, auto&) {}, "router_backward: logits[0,0] = nan");
}

}  // namespace
}  // namespace moerail
