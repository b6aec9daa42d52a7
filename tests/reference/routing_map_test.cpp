#include <gtest/gtest.h>

#include "moerail/error.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/host.h"
#include "moerail/reference/routing_map.h"

namespace moerail {
namespace {

using ref::HostTensor;

TEST(RoutingMap, ListsRoutedExpertsInAscendingOrderThenPads) {
  // T = 3, E = 5, K = 3: token 0 -> {1, 4}, token 1 -> {}, token 2 -> {0, 2, 3}
  HostTensor map(DType::Bool, {3, 5}), probs(DType::F32, {3, 5});
  const int routed[3][5] = {{0, 1, 0, 0, 1}, {0, 0, 0, 0, 0}, {1, 0, 1, 1, 0}};
  for (int t = 0; t < 3; ++t)
    for (int e = 0; e < 5; ++e) {
      map.set_i(t * 5 + e, routed[t][e]);
      probs.set_f(t * 5 + e, 0.125 * (t * 5 + e + 1));
    }
  HostTensor idx(DType::I32, {3, 3}), p(DType::F64, {3, 3});
  idx.fill_nan();
  p.fill_nan();
  ref::routing_map_to_topk({map, probs, idx, p});
  const int want_idx[9] = {1, 4, -1, -1, -1, -1, 0, 2, 3};
  const double want_p[9] = {0.25, 0.625, 0, 0, 0, 0, 1.375, 1.625, 1.75};
  for (int i = 0; i < 9; ++i) {
    EXPECT_EQ(idx.i(i), want_idx[i]) << "slot " << i;
    EXPECT_EQ(p.f(i), want_p[i]) << "slot " << i;
  }
}

// With R = 1 the converted routing permutes exactly as TransformerEngine's mask map: expert-major, then token.
TEST(RoutingMap, ConvertedRoutingGivesTheMaskMapPermuteOrder) {
  const std::int64_t T = 40, E = 7, K = 3, H = 2;
  ref::Rng rng(5);
  HostTensor map(DType::Bool, {T, E}), probs(DType::F32, {T, E}), x(DType::F32, {T, H});
  for (std::int64_t t = 0; t < T; ++t) {
    std::int64_t n = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      const bool on = n < K && rng.uniform() < 0.4;
      map.set_i(t * E + e, on);
      n += on;
      probs.set_f(t * E + e, rng.uniform(0.1, 1.0));
    }
    for (std::int64_t h = 0; h < H; ++h) x.set_f(t * H + h, double(t * H + h));
  }
  HostTensor idx(DType::I32, {T, K}), p(DType::F32, {T, K});
  ref::routing_map_to_topk({map, probs, idx, p});
  MoeConfig cfg;
  cfg.num_experts = E; cfg.topk = K; cfg.hidden = H; cfg.max_tokens = T;
  const TensorView idx_view = idx;
  const ref::LayoutPlan plan = ref::plan_layout(cfg, std::span(&idx_view, 1));
  HostTensor recv(DType::F32, {plan.capacity, H}), recv_p(DType::F32, {plan.capacity});
  const TensorView xv = x, pv = p, rv = recv, rpv = recv_p;
  ref::dispatch_forward(plan, {std::span(&xv, 1), std::span(&pv, 1), std::span(&rv, 1), std::span(&rpv, 1)});
  std::int64_t row = 0;
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t t = 0; t < T; ++t) {
      if (!map.i(t * E + e)) continue;
      ASSERT_EQ(recv.f(row * H), double(t * H)) << "expert " << e << " token " << t;
      ASSERT_EQ(recv_p.f(row), float(probs.f(t * E + e)));
      ++row;
    }
  EXPECT_EQ(row, plan.rows_used[0]);
}

TEST(RoutingMap, TooManyRoutedExpertsIsAnErrorAndWritesNothing) {
  HostTensor map(DType::Bool, {2, 4}), probs(DType::F32, {2, 4});
  for (int i = 0; i < 8; ++i) map.set_i(i, i >= 4 ? 1 : (i == 0));  // token 1 routes to all 4 experts
  HostTensor idx(DType::I32, {2, 2}), p(DType::F32, {2, 2});
  idx.fill_nan();
  try {
    ref::routing_map_to_topk({map, probs, idx, p});
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "routing_map_to_topk: token 1 routes to 4 experts but topk_idx has K = 2 slots");
  }
  EXPECT_EQ(idx.i(0), 0x7f7f7f7f);
}

}  // namespace
}  // namespace moerail
