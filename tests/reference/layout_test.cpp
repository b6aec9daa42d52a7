// Tests of the CPU layout planner (moerail/reference/layout.h): row order, padding, capacity and argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "moerail/config.h"
#include "moerail/error.h"
#include "moerail/reference/host.h"
#include "moerail/reference/layout.h"
#include "reference/routing_fixtures.h"

namespace moerail {
namespace {

using ref::HostTensor;
using ref::LayoutPlan;
using ref::plan_layout;
using ref::Rng;
using test::PerRank;

MoeConfig layout_config(std::int64_t E, std::int64_t K, std::int64_t R, std::int64_t A, std::int64_t t_max,
                        Capacity capacity = Capacity::worst_case()) {
  MoeConfig c;
  c.num_experts = E;
  c.topk = K;
  c.ep_size = R;
  c.align = A;
  c.max_tokens = t_max;
  c.hidden = 8;
  c.capacity = capacity;
  return c;
}

LayoutPlan plan_of(const MoeConfig& cfg, const PerRank& idx, std::int64_t capacity = -1) {
  const std::vector<TensorView> v = test::views(idx);
  return plan_layout(cfg, v, capacity);
}

// topk_idx from literal rows, one list of tokens per rank.
PerRank routing_from(const std::vector<std::vector<std::vector<std::int32_t>>>& ranks, std::int64_t K) {
  PerRank idx;
  for (const auto& tokens : ranks) {
    idx.emplace_back(DType::I32, std::vector<std::int64_t>{std::int64_t(tokens.size()), K});
    for (std::size_t t = 0; t < tokens.size(); ++t)
      for (std::int64_t k = 0; k < K; ++k) idx.back().set_i(std::int64_t(t) * K + k, tokens[t][std::size_t(k)]);
  }
  return idx;
}

// Compares every field of the plan with the sorted model of the contract; reports the first mismatching slots.
void expect_plan_matches_model(const LayoutPlan& plan, const PerRank& idx, std::int64_t E, std::int64_t A) {
  const test::ExpectedLayout x = test::expected_layout(idx, E, A, plan.capacity);
  const auto R = std::int64_t(idx.size());
  const std::int64_t L = E / R;
  EXPECT_EQ(plan.tokens_per_expert, x.count);
  EXPECT_EQ(plan.padded_per_expert, x.padded);
  EXPECT_EQ(plan.segment_offset, x.offset);
  EXPECT_EQ(plan.rows_needed, x.rows_needed);
  EXPECT_EQ(plan.overflow, x.overflow);
  for (std::int64_t r = 0; r < R; ++r)
    EXPECT_EQ(plan.rows_used[std::size_t(r)], std::min(x.rows_needed[std::size_t(r)], plan.capacity)) << "rank " << r;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t inside = std::clamp<std::int64_t>(plan.capacity - x.offset[std::size_t(e)], 0,
                                                         x.padded[std::size_t(e)]);
    EXPECT_EQ(plan.segment_rows[std::size_t(e)], inside) << "expert " << e;
  }
  std::vector<std::int64_t> counts(std::size_t(R * E), 0);
  for (std::int64_t s = 0; s < R; ++s)
    for (std::int64_t i = 0; i < idx[std::size_t(s)].numel(); ++i)
      if (const std::int64_t e = idx[std::size_t(s)].i(i); e >= 0) ++counts[std::size_t(s * E + e)];
  EXPECT_EQ(plan.counts, counts);

  int mismatches = 0;
  for (std::int64_t s = 0; s < R; ++s) {
    ASSERT_EQ(plan.dest_rank[std::size_t(s)].size(), x.rank[std::size_t(s)].size()) << "source rank " << s;
    for (std::size_t i = 0; i < x.rank[std::size_t(s)].size(); ++i) {
      const bool same = plan.dest_rank[std::size_t(s)][i] == x.rank[std::size_t(s)][i] &&
                        plan.dest_row[std::size_t(s)][i] == x.row[std::size_t(s)][i];
      if (!same && ++mismatches <= 5)
        ADD_FAILURE() << "source rank " << s << " slot " << i << " (expert " << idx[std::size_t(s)].i(std::int64_t(i))
                      << "): plan (" << plan.dest_rank[std::size_t(s)][i] << ", " << plan.dest_row[std::size_t(s)][i]
                      << ") expected (" << x.rank[std::size_t(s)][i] << ", " << x.row[std::size_t(s)][i] << ")";
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(plan.local_experts, L);
}

// Invariants that hold for any plan, without a model: every kept slot lands in a unique row of its expert's
// segment inside the buffer, counts add up, segments are contiguous and aligned.
void expect_plan_consistent(const LayoutPlan& plan, const PerRank& idx) {
  const std::int64_t R = plan.num_ranks, E = plan.num_experts, L = plan.local_experts, K = plan.topk,
                     A = plan.align;
  std::int64_t routed = 0, kept = 0;
  std::vector<std::int64_t> per_expert(std::size_t(E), 0);
  std::vector<std::set<std::int64_t>> taken(static_cast<std::size_t>(R));
  for (std::int64_t s = 0; s < R; ++s) {
    for (std::int64_t i = 0; i < idx[std::size_t(s)].numel(); ++i) {
      const std::int64_t e = idx[std::size_t(s)].i(i);
      const std::int64_t d = plan.dest_rank[std::size_t(s)][std::size_t(i)];
      const std::int64_t row = plan.dest_row[std::size_t(s)][std::size_t(i)];
      if (e < 0) {
        ASSERT_EQ(d, -1) << "unrouted slot " << i << " of rank " << s << " got a rank";
        ASSERT_EQ(row, -1);
        continue;
      }
      ++routed;
      ++per_expert[std::size_t(e)];
      if (d < 0) continue;  // dropped
      ++kept;
      ASSERT_EQ(d, e / L) << "slot " << i << " of rank " << s;
      ASSERT_GE(row, plan.segment_offset[std::size_t(e)]);
      ASSERT_LT(row, plan.segment_offset[std::size_t(e)] + plan.tokens_per_expert[std::size_t(e)]);
      ASSERT_LT(row, plan.capacity);
      ASSERT_TRUE(taken[std::size_t(d)].insert(row).second) << "row " << row << " of rank " << d << " used twice";
    }
  }
  EXPECT_EQ(per_expert, plan.tokens_per_expert);
  std::int64_t overflow = 0, count_sum = 0;
  for (std::int64_t r = 0; r < R; ++r) overflow += plan.overflow[std::size_t(r)];
  for (std::int64_t c : plan.counts) count_sum += c;
  EXPECT_EQ(count_sum, routed);
  EXPECT_EQ(kept + overflow, routed);
  for (std::int64_t e = 0; e < E; ++e) {
    EXPECT_EQ(plan.padded_per_expert[std::size_t(e)] % A, 0) << "expert " << e;
    EXPECT_GE(plan.padded_per_expert[std::size_t(e)], plan.tokens_per_expert[std::size_t(e)]);
    EXPECT_LT(plan.padded_per_expert[std::size_t(e)] - plan.tokens_per_expert[std::size_t(e)], A);
    const std::int64_t expected_offset =
        e % L == 0 ? 0 : plan.segment_offset[std::size_t(e - 1)] + plan.padded_per_expert[std::size_t(e - 1)];
    EXPECT_EQ(plan.segment_offset[std::size_t(e)], expected_offset) << "expert " << e;
  }
  for (std::int64_t r = 0; r < R; ++r) {
    std::int64_t used = 0;
    for (std::int64_t n : plan.local_segment_rows(r)) used += n;
    EXPECT_EQ(used, plan.rows_used[std::size_t(r)]) << "rank " << r;
    EXPECT_EQ(plan.rows_used[std::size_t(r)], std::min(plan.rows_needed[std::size_t(r)], plan.capacity));
  }
  EXPECT_EQ(K, idx.empty() ? K : idx[0].view().size(1));
}

// ---- known answers ------------------------------------------------------------------------------------------

// R = 2, E = 4 (L = 2), K = 2, A = 2, worked by hand:
//   rank 0: t0 -> {0, 2}, t1 -> {1, 0}, t2 -> {3, -1};   rank 1: t0 -> {2, 0}, t1 -> {-1, -1}
//   expert 0 (rank 0): (s0,t0,k0) (s0,t1,k1) (s1,t0,k1) -> rows 0 1 2, pad row 3
//   expert 1 (rank 0): (s0,t1,k0)                       -> row 4, pad row 5
//   expert 2 (rank 1): (s0,t0,k1) (s1,t0,k0)            -> rows 0 1
//   expert 3 (rank 1): (s0,t2,k0)                       -> row 2, pad row 3
PerRank hand_routing() { return routing_from({{{0, 2}, {1, 0}, {3, -1}}, {{2, 0}, {-1, -1}}}, 2); }

TEST(Layout, HandWorkedExample) {
  const LayoutPlan p = plan_of(layout_config(4, 2, 2, 2, 3), hand_routing(), 100);
  EXPECT_EQ(p.tokens, (std::vector<std::int64_t>{3, 2}));
  EXPECT_EQ(p.counts, (std::vector<std::int64_t>{2, 1, 1, 1, 1, 0, 1, 0}));
  EXPECT_EQ(p.tokens_per_expert, (std::vector<std::int64_t>{3, 1, 2, 1}));
  EXPECT_EQ(p.padded_per_expert, (std::vector<std::int64_t>{4, 2, 2, 2}));
  EXPECT_EQ(p.segment_offset, (std::vector<std::int64_t>{0, 4, 0, 2}));
  EXPECT_EQ(p.segment_rows, (std::vector<std::int64_t>{4, 2, 2, 2}));
  EXPECT_EQ(p.rows_needed, (std::vector<std::int64_t>{6, 4}));
  EXPECT_EQ(p.rows_used, (std::vector<std::int64_t>{6, 4}));
  EXPECT_EQ(p.overflow, (std::vector<std::int64_t>{0, 0}));
  EXPECT_EQ(p.dest_rank[0], (std::vector<std::int32_t>{0, 1, 0, 0, 1, -1}));
  EXPECT_EQ(p.dest_row[0], (std::vector<std::int32_t>{0, 0, 4, 1, 2, -1}));
  EXPECT_EQ(p.dest_rank[1], (std::vector<std::int32_t>{1, 0, -1, -1}));
  EXPECT_EQ(p.dest_row[1], (std::vector<std::int32_t>{1, 2, -1, -1}));
  EXPECT_EQ(p.local_segment_rows(0), (std::vector<std::int64_t>{4, 2}));
  EXPECT_EQ(p.local_segment_rows(1), (std::vector<std::int64_t>{2, 2}));
}

// A bound of peer_rows tokens per (source, other rank): each source keeps, for each other rank, its first tokens
// routed there; the later ones' slots at that rank are dropped at the source (peer_dropped) and planned as unrouted.
TEST(Layout, PeerRowsKeepEachSourcesFirstTokensPerPeer) {
  // E 4, K 2, R 2 (experts 0-1 on rank 0, 2-3 on rank 1); rank 0's tokens: {2, 3}, {0, 2}, {3, -1}, {1, 0}
  const PerRank idx = routing_from({{{2, 3}, {0, 2}, {3, -1}, {1, 0}}, {{0, 1}, {2, 0}, {1, -1}}}, 2);
  const MoeConfig cfg = layout_config(4, 2, 2, 1, 4);
  const std::vector<TensorView> v = test::views(idx);
  const LayoutPlan p = plan_layout(cfg, v, -1, 2);
  // rank 0 stages tokens 0 and 1 for rank 1 and drops token 2's slot (both of token 0's slots there are one row);
  // rank 1 stages tokens 0 and 1 for rank 0 and drops token 2's
  EXPECT_EQ(p.peer_rows, 2);
  EXPECT_EQ(p.peer_dropped, (std::vector<std::int64_t>{1, 1}));
  EXPECT_EQ(p.counts, (std::vector<std::int64_t>{2, 1, 2, 1, 2, 1, 1, 0}));
  EXPECT_EQ(p.dest_rank[0], (std::vector<std::int32_t>{1, 1, 0, 1, -1, -1, 0, 0}));
  EXPECT_EQ(p.dest_rank[1], (std::vector<std::int32_t>{0, 0, 1, 0, -1, -1}));
  // as if the dropped slots were unrouted
  const PerRank unrouted = routing_from({{{2, 3}, {0, 2}, {-1, -1}, {1, 0}}, {{0, 1}, {2, 0}, {-1, -1}}}, 2);
  const std::vector<TensorView> u = test::views(unrouted);
  const LayoutPlan q = plan_layout(cfg, u);
  EXPECT_EQ(p.counts, q.counts);
  EXPECT_EQ(p.dest_rank, q.dest_rank);
  EXPECT_EQ(p.dest_row, q.dest_row);
  EXPECT_EQ(q.peer_dropped, (std::vector<std::int64_t>{0, 0}));
  // a bound no source reaches changes nothing
  const LayoutPlan w = plan_layout(cfg, v, -1, 4);
  const LayoutPlan n = plan_layout(cfg, v);
  EXPECT_EQ(w.dest_row, n.dest_row);
  EXPECT_EQ(w.peer_dropped, (std::vector<std::int64_t>{0, 0}));
  EXPECT_THROW(plan_layout(cfg, v, -1, -2), Error);
}

// Against a count from the routing alone, over random routings: per source and peer, min(tokens routed there,
// peer_rows) tokens are kept, the slots of the others dropped.
TEST(Layout, PeerRowsDropCountsMatchTheRouting) {
  Rng rng(31);
  for (int trial = 0; trial < 20; ++trial) {
    const std::int64_t R = 1 + rng.below(6), L = 1 + rng.below(4), E = R * L, K = 1 + rng.below(std::min<std::int64_t>(E, 4));
    const std::int64_t t_max = 1 + rng.below(40), peer = rng.below(t_max + 1);
    const MoeConfig cfg = layout_config(E, K, R, 1, t_max);
    std::vector<std::int64_t> tokens;
    for (std::int64_t r = 0; r < R; ++r) tokens.push_back(rng.below(t_max + 1));
    const PerRank idx = test::random_routing(rng, tokens, E, K, 0.2);
    const std::vector<TensorView> v = test::views(idx);
    const LayoutPlan p = plan_layout(cfg, v, -1, peer);
    std::int64_t kept_total = 0, routed_total = 0;
    for (std::int64_t s = 0; s < R; ++s) {
      std::int64_t dropped = 0;
      std::vector<std::int64_t> seen(std::size_t(R), 0);
      for (std::int64_t t = 0; t < idx[std::size_t(s)].view().size(0); ++t) {
        for (std::int64_t d = 0; d < R; ++d) {
          std::int64_t slots = 0;
          for (std::int64_t k = 0; k < K; ++k) {
            const std::int64_t e = idx[std::size_t(s)].i(t * K + k);
            slots += e >= 0 && e / L == d;
          }
          if (slots == 0 || d == s) continue;
          if (seen[std::size_t(d)]++ >= peer) dropped += slots;
        }
        for (std::int64_t k = 0; k < K; ++k) {
          routed_total += idx[std::size_t(s)].i(t * K + k) >= 0;
          kept_total += p.dest_rank[std::size_t(s)][std::size_t(t * K + k)] >= 0;
        }
      }
      EXPECT_EQ(p.peer_dropped[std::size_t(s)], dropped) << "trial " << trial << " source " << s;
    }
    std::int64_t dropped_all = 0;
    for (std::int64_t d : p.peer_dropped) dropped_all += d;
    EXPECT_EQ(kept_total + dropped_all, routed_total) << "trial " << trial;  // worst-case capacity: no other drops
  }
}

TEST(Layout, HandWorkedExampleUnderCapacity) {
  // Capacity 5: rank 0 keeps row 4 (expert 1) but loses its pad row 5; nothing is dropped.
  const LayoutPlan p5 = plan_of(layout_config(4, 2, 2, 2, 3), hand_routing(), 5);
  EXPECT_EQ(p5.segment_rows, (std::vector<std::int64_t>{4, 1, 2, 2}));
  EXPECT_EQ(p5.rows_used, (std::vector<std::int64_t>{5, 4}));
  EXPECT_EQ(p5.overflow, (std::vector<std::int64_t>{0, 0}));
  EXPECT_EQ(p5.dest_row[0], (std::vector<std::int32_t>{0, 0, 4, 1, 2, -1}));

  // Capacity 2: rank 0 drops (s1,t0,k1) at row 2 and (s0,t1,k0) at row 4; rank 1 drops (s0,t2,k0) at row 2.
  const LayoutPlan p2 = plan_of(layout_config(4, 2, 2, 2, 3), hand_routing(), 2);
  EXPECT_EQ(p2.segment_rows, (std::vector<std::int64_t>{2, 0, 2, 0}));
  EXPECT_EQ(p2.rows_needed, (std::vector<std::int64_t>{6, 4}));
  EXPECT_EQ(p2.rows_used, (std::vector<std::int64_t>{2, 2}));
  EXPECT_EQ(p2.overflow, (std::vector<std::int64_t>{2, 1}));
  EXPECT_EQ(p2.tokens_per_expert, (std::vector<std::int64_t>{3, 1, 2, 1}));  // demand, before capacity
  EXPECT_EQ(p2.dest_rank[0], (std::vector<std::int32_t>{0, 1, -1, 0, -1, -1}));
  EXPECT_EQ(p2.dest_row[0], (std::vector<std::int32_t>{0, 0, -1, 1, -1, -1}));
  EXPECT_EQ(p2.dest_rank[1], (std::vector<std::int32_t>{1, -1, -1, -1}));
  EXPECT_EQ(p2.dest_row[1], (std::vector<std::int32_t>{1, -1, -1, -1}));
}

TEST(Layout, PaddingRoundsEachSegmentUpToA) {
  // One rank, A = 16, expert counts 0, 1, 16, 17 -> padded 0, 16, 16, 32 at offsets 0, 0, 16, 32.
  std::vector<std::vector<std::int32_t>> tokens;
  for (int e = 1; e < 4; ++e)
    for (int n = 0; n < (e == 1 ? 1 : e == 2 ? 16 : 17); ++n) tokens.push_back({e});
  const LayoutPlan p = plan_of(layout_config(4, 1, 1, 16, 64), routing_from({tokens}, 1));
  EXPECT_EQ(p.tokens_per_expert, (std::vector<std::int64_t>{0, 1, 16, 17}));
  EXPECT_EQ(p.padded_per_expert, (std::vector<std::int64_t>{0, 16, 16, 32}));
  EXPECT_EQ(p.segment_offset, (std::vector<std::int64_t>{0, 0, 16, 32}));
  EXPECT_EQ(p.rows_needed, (std::vector<std::int64_t>{64}));
  EXPECT_EQ(p.dest_row[0][0], 0);    // expert 1's only row
  EXPECT_EQ(p.dest_row[0][1], 16);   // expert 2's first row
  EXPECT_EQ(p.dest_row[0][17], 32);  // expert 3's first row
}

// ---- R = 1 is TransformerEngine's mask-map order --------------------------------------------------------------

// TE's mask-map permute, written the way TE computes it: routing_map [T, E]; dst = (rank of t among the expert's
// tokens) + (tokens of all earlier experts); with padding, dst += pad_offsets[e] = sum_{j<e} (target_j - tpe_j).
std::vector<std::int64_t> te_mask_map_rows(const HostTensor& idx, std::int64_t E, std::int64_t A) {
  const std::int64_t T = idx.view().size(0), K = idx.view().size(1);
  std::vector<std::vector<bool>> map(std::size_t(T), std::vector<bool>(std::size_t(E), false));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < K; ++k)
      if (idx.i(t * K + k) >= 0) map[std::size_t(t)][std::size_t(idx.i(t * K + k))] = true;
  std::vector<std::vector<std::int64_t>> dst(std::size_t(T), std::vector<std::int64_t>(std::size_t(E), -1));
  std::int64_t earlier = 0, pad_offset = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    std::int64_t tpe = 0;
    for (std::int64_t t = 0; t < T; ++t)
      if (map[std::size_t(t)][std::size_t(e)]) dst[std::size_t(t)][std::size_t(e)] = earlier + tpe++ + pad_offset;
    earlier += tpe;
    const std::int64_t target = (tpe + A - 1) / A * A;
    pad_offset += target - tpe;
  }
  std::vector<std::int64_t> rows(std::size_t(T * K), -1);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < K; ++k)
      if (idx.i(t * K + k) >= 0) rows[std::size_t(t * K + k)] = dst[std::size_t(t)][std::size_t(idx.i(t * K + k))];
  return rows;
}

TEST(Layout, SingleRankIsTransformerEngineMaskMapOrder) {
  Rng rng(11);
  for (std::int64_t E : {7, 16, 256}) {
    for (std::int64_t K : {1, 2, 5, 8}) {
      if (K > E) continue;
      for (std::int64_t A : {1, 16, 32, 128, 256}) {
        SCOPED_TRACE(testing::Message() << "E=" << E << " K=" << K << " A=" << A);
        const std::int64_t T = 1 + rng.below(40);
        const PerRank idx = test::random_routing(rng, {T}, E, K, 0.1);
        const LayoutPlan p = plan_of(layout_config(E, K, 1, A, 40), idx);
        const std::vector<std::int64_t> te = te_mask_map_rows(idx[0], E, A);
        for (std::int64_t i = 0; i < T * K; ++i) {
          ASSERT_EQ(p.dest_row[0][std::size_t(i)], te[std::size_t(i)]) << "slot " << i;
          ASSERT_EQ(p.dest_rank[0][std::size_t(i)], te[std::size_t(i)] < 0 ? -1 : 0) << "slot " << i;
        }
      }
    }
  }
}

// ---- multi-rank order, sweep ----------------------------------------------------------------------------------

TEST(Layout, OrderIsExpertSourceRankTokenSlotAcrossTheSweep) {
  Rng rng(12);
  int cases = 0;
  for (std::int64_t E : {7, 16, 256}) {
    for (std::int64_t K : {1, 2, 5, 8}) {
      if (K > E) continue;
      for (std::int64_t R : {1, 2, 4, 8}) {
        if (E % R != 0) continue;
        for (std::int64_t A : {1, 16, 32, 128, 256}) {
          SCOPED_TRACE(testing::Message() << "E=" << E << " K=" << K << " R=" << R << " A=" << A);
          const std::int64_t t_max = 24;
          const PerRank idx = test::random_routing(rng, test::random_tokens(rng, R, t_max), E, K, 0.15);
          const MoeConfig cfg = layout_config(E, K, R, A, t_max);
          const LayoutPlan p = plan_of(cfg, idx);
          EXPECT_EQ(p.capacity, cfg.rows_per_rank());
          expect_plan_matches_model(p, idx, E, A);
          expect_plan_consistent(p, idx);
          EXPECT_EQ(p.overflow, std::vector<std::int64_t>(std::size_t(R), 0));
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 5 + 4 * 4 * 5 + 4 * 4 * 5);  // E = 7 runs R = 1 and K <= 7 only
}

// ---- edge cases -----------------------------------------------------------------------------------------------

TEST(Layout, RanksWithZeroTokens) {
  const MoeConfig cfg = layout_config(16, 2, 4, 16, 8);
  // Every rank empty: nothing routed, nothing needed.
  const PerRank none = test::per_rank(DType::I32, {0, 0, 0, 0}, 2);
  const LayoutPlan p0 = plan_of(cfg, none);
  EXPECT_EQ(p0.rows_needed, (std::vector<std::int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(p0.tokens_per_expert, std::vector<std::int64_t>(16, 0));
  for (const auto& d : p0.dest_row) EXPECT_TRUE(d.empty());
  // Only rank 2 brings tokens.
  Rng rng(13);
  const PerRank idx = test::random_routing(rng, {0, 0, 8, 0}, 16, 2);
  const LayoutPlan p = plan_of(cfg, idx);
  expect_plan_matches_model(p, idx, 16, 16);
  for (std::int64_t e = 0; e < 16; ++e)
    for (std::int64_t s : {0, 1, 3}) EXPECT_EQ(p.counts[std::size_t(s * 16 + e)], 0);
}

TEST(Layout, AllTokensOnOneExpert) {
  Rng rng(14);
  for (std::int64_t K : {1, 4}) {
    const std::int64_t E = 16, R = 4, hot = 9;  // expert 9 lives on rank 2
    PerRank idx = test::random_routing(rng, {8, 3, 0, 8}, E, K);
    for (const HostTensor& ids : idx) {
      for (std::int64_t t = 0; t < ids.view().size(0); ++t) {
        // Slot 0 goes to the hot expert; other slots keep distinct experts different from it.
        for (std::int64_t k = 1; k < K; ++k)
          if (ids.i(t * K + k) == hot) ids.set_i(t * K + k, ids.i(t * K));
        ids.set_i(t * K, hot);
      }
    }
    const LayoutPlan p = plan_of(layout_config(E, K, R, 32, 8), idx);
    expect_plan_matches_model(p, idx, E, 32);
    EXPECT_EQ(p.tokens_per_expert[hot], 19);
    EXPECT_EQ(p.padded_per_expert[hot], 32);
    // The hot expert's rows are 0..18 on rank 2 in (source rank, token) order.
    std::int64_t next = p.segment_offset[hot];
    for (std::int64_t s = 0; s < R; ++s)
      for (std::int64_t t = 0; t < idx[std::size_t(s)].view().size(0); ++t) {
        EXPECT_EQ(p.dest_rank[std::size_t(s)][std::size_t(t * K)], 2);
        EXPECT_EQ(p.dest_row[std::size_t(s)][std::size_t(t * K)], next++);
      }
  }
}

TEST(Layout, UnroutedSlotsGetNoRow) {
  PerRank idx = test::per_rank(DType::I32, {5, 2}, 3);
  for (const HostTensor& ids : idx)
    for (std::int64_t i = 0; i < ids.numel(); ++i) ids.set_i(i, -1);
  idx[0].set_i(4, 6);  // token 1, slot 1 -> expert 6 (rank 1)
  const LayoutPlan p = plan_of(layout_config(8, 3, 2, 4, 5), idx);
  EXPECT_EQ(p.tokens_per_expert, (std::vector<std::int64_t>{0, 0, 0, 0, 0, 0, 1, 0}));
  EXPECT_EQ(p.rows_needed, (std::vector<std::int64_t>{0, 4}));
  EXPECT_EQ(p.segment_offset[6], 0);
  for (std::int64_t i = 0; i < 15; ++i) {
    EXPECT_EQ(p.dest_rank[0][std::size_t(i)], i == 4 ? 1 : -1) << "slot " << i;
    EXPECT_EQ(p.dest_row[0][std::size_t(i)], i == 4 ? 0 : -1) << "slot " << i;
  }
  for (std::int32_t r : p.dest_rank[1]) EXPECT_EQ(r, -1);
}

TEST(Layout, RepeatedExpertInOneTokenGetsOneRowPerSlotInKOrder) {
  const PerRank idx = routing_from({{{3, 1, 3}, {3, 3, 3}}}, 3);
  const LayoutPlan p = plan_of(layout_config(4, 3, 1, 1, 2), idx);
  EXPECT_EQ(p.tokens_per_expert, (std::vector<std::int64_t>{0, 1, 0, 5}));
  EXPECT_EQ(p.dest_row[0], (std::vector<std::int32_t>{1, 0, 2, 3, 4, 5}));
  expect_plan_matches_model(p, idx, 4, 1);
}

TEST(Layout, LocalSegmentRowsRejectsABadRank) {
  const LayoutPlan p = plan_of(layout_config(4, 2, 2, 2, 3), hand_routing());
  EXPECT_THROW(p.local_segment_rows(2), Error);
  EXPECT_THROW(p.local_segment_rows(-1), Error);
}

// ---- capacity -------------------------------------------------------------------------------------------------

// Adversarial routing for WorstCase: every token of every rank, at T_max, sends as many slots as it can (min(K, L),
// distinct experts) to rank `hot`'s experts; its remaining slots go to other ranks.
PerRank pile_onto_rank(std::int64_t E, std::int64_t K, std::int64_t R, std::int64_t t_max, std::int64_t hot) {
  const std::int64_t L = E / R;
  PerRank idx = test::per_rank(DType::I32, std::vector<std::int64_t>(std::size_t(R), t_max), K);
  for (const HostTensor& ids : idx) {
    for (std::int64_t t = 0; t < t_max; ++t) {
      for (std::int64_t k = 0; k < K; ++k) {
        // Slots 0..L-1 take hot's experts (rotated by token so every expert fills); the rest walk the others.
        const std::int64_t e = k < L ? hot * L + (t + k) % L : (hot * L + L + (k - L)) % E;
        ids.set_i(t * K + k, std::int32_t(e));
      }
    }
  }
  return idx;
}

TEST(LayoutCapacity, WorstCaseNeverDropsUnderAdversarialRouting) {
  for (std::int64_t E : {16, 256}) {
    for (std::int64_t K : {1, 2, 5, 8}) {
      for (std::int64_t R : {1, 2, 4, 8}) {
        for (std::int64_t A : {1, 16, 256}) {
          SCOPED_TRACE(testing::Message() << "E=" << E << " K=" << K << " R=" << R << " A=" << A);
          const std::int64_t t_max = 9, hot = R - 1;
          const MoeConfig cfg = layout_config(E, K, R, A, t_max);
          const PerRank idx = pile_onto_rank(E, K, R, t_max, hot);
          const LayoutPlan p = plan_of(cfg, idx);
          EXPECT_EQ(p.overflow, std::vector<std::int64_t>(std::size_t(R), 0));
          EXPECT_LE(p.rows_needed[std::size_t(hot)], cfg.rows_per_rank());
          std::int64_t to_hot = 0;
          for (std::int64_t e = hot * cfg.local_experts(); e < (hot + 1) * cfg.local_experts(); ++e)
            to_hot += p.tokens_per_expert[std::size_t(e)];
          EXPECT_EQ(to_hot, R * t_max * std::min(K, cfg.local_experts()));
          expect_plan_consistent(p, idx);
        }
      }
    }
  }
}

TEST(LayoutCapacity, WorstCaseBoundIsTight) {
  // R = 1, E = K = 4, A = 16, T_max = 17: each expert gets 17 rows, padded to 32: 128 = 1*17*4 + 4*15 rows.
  const MoeConfig cfg = layout_config(4, 4, 1, 16, 17);
  const LayoutPlan p = plan_of(cfg, pile_onto_rank(4, 4, 1, 17, 0));
  EXPECT_EQ(p.rows_needed[0], 128);
  EXPECT_EQ(cfg.rows_per_rank(), 128);
  EXPECT_EQ(p.overflow[0], 0);
}

TEST(LayoutCapacity, FactorDropsTheTailAndCountsIt) {
  Rng rng(15);
  for (double factor : {0.25, 0.5, 1.0}) {
    for (std::int64_t A : {1, 16, 128}) {
      SCOPED_TRACE(testing::Message() << "factor=" << factor << " A=" << A);
      const std::int64_t E = 16, K = 4, R = 4, t_max = 24;
      const MoeConfig cfg = layout_config(E, K, R, A, t_max, Capacity::of_factor(factor));
      // Skewed: a quarter of the tokens pile onto rank 1, the rest are random.
      PerRank idx = test::random_routing(rng, test::random_tokens(rng, R, t_max), E, K);
      for (std::int64_t s = 0; s < R; ++s)
        for (std::int64_t t = 0; t < idx[std::size_t(s)].view().size(0); t += 4)
          for (std::int64_t k = 0; k < K; ++k) idx[std::size_t(s)].set_i(t * K + k, std::int32_t(4 + k));
      const LayoutPlan p = plan_of(cfg, idx);
      const LayoutPlan unlimited = plan_of(cfg, idx, 1 << 20);
      EXPECT_EQ(p.capacity, cfg.rows_per_rank());
      expect_plan_matches_model(p, idx, E, A);
      expect_plan_consistent(p, idx);
      // What fits keeps its unlimited row; what is dropped had a row at or beyond the capacity.
      std::vector<std::int64_t> dropped(std::size_t(R), 0);
      for (std::int64_t s = 0; s < R; ++s) {
        for (std::size_t i = 0; i < p.dest_row[std::size_t(s)].size(); ++i) {
          const std::int64_t free_row = unlimited.dest_row[std::size_t(s)][i];
          if (free_row < 0) continue;
          if (free_row < p.capacity) {
            EXPECT_EQ(p.dest_row[std::size_t(s)][i], free_row);
          } else {
            EXPECT_EQ(p.dest_row[std::size_t(s)][i], -1);
            EXPECT_EQ(p.dest_rank[std::size_t(s)][i], -1);
            ++dropped[std::size_t(unlimited.dest_rank[std::size_t(s)][i])];
          }
        }
      }
      EXPECT_EQ(p.overflow, dropped);
      EXPECT_EQ(p.rows_needed, unlimited.rows_needed);
      if (factor == 0.25 && A == 1) {
        EXPECT_GT(p.overflow[1], 0) << "the skewed rank should overflow at factor 0.25";
      }
    }
  }
}

// Capacity::PerExpert on the hand-worked routing: c = 0.5 gives ceil(0.5 * R T_max K / E) = ceil(1.5) = 2 rows per
// expert (a multiple of A = 2), 4 rows per rank.
//   expert 0 (rank 0): (s0,t0,k0) (s0,t1,k1) -> rows 0 1; (s1,t0,k1), the third, is dropped
//   expert 1 (rank 0): (s0,t1,k0)            -> row 2, pad row 3
//   expert 2 (rank 1): (s0,t0,k1) (s1,t0,k0) -> rows 0 1
//   expert 3 (rank 1): (s0,t2,k0)            -> row 2, pad row 3
TEST(LayoutCapacity, PerExpertHandWorkedExample) {
  const MoeConfig cfg = layout_config(4, 2, 2, 2, 3, Capacity::per_expert(0.5));
  EXPECT_EQ(cfg.expert_rows(), 2);
  EXPECT_EQ(cfg.rows_per_rank(), 4);
  const LayoutPlan p = plan_of(cfg, hand_routing());
  EXPECT_EQ(p.capacity, 4);
  EXPECT_EQ(p.expert_capacity, 2);
  EXPECT_EQ(p.tokens_per_expert, (std::vector<std::int64_t>{3, 1, 2, 1}));  // demand, before capacity
  EXPECT_EQ(p.segment_offset, (std::vector<std::int64_t>{0, 2, 0, 2}));
  EXPECT_EQ(p.segment_rows, (std::vector<std::int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(p.rows_needed, (std::vector<std::int64_t>{6, 4}));
  EXPECT_EQ(p.rows_used, (std::vector<std::int64_t>{4, 4}));
  EXPECT_EQ(p.overflow, (std::vector<std::int64_t>{1, 0}));
  EXPECT_EQ(p.dest_rank[0], (std::vector<std::int32_t>{0, 1, 0, 0, 1, -1}));
  EXPECT_EQ(p.dest_row[0], (std::vector<std::int32_t>{0, 0, 2, 1, 2, -1}));
  EXPECT_EQ(p.dest_rank[1], (std::vector<std::int32_t>{1, -1, -1, -1}));
  EXPECT_EQ(p.dest_row[1], (std::vector<std::int32_t>{1, -1, -1, -1}));
}

// Capacity::PerExpert on skewed random routings: each expert keeps its first expert_rows() slots in (source rank,
// token, k) order, in a segment of min(padded, expert_rows()) rows; the segments follow each other; the rest is
// dropped and counted against the expert's rank.
TEST(LayoutCapacity, PerExpertKeepsEachExpertsFirstRows) {
  Rng rng(17);
  bool some_dropped = false;
  for (double factor : {0.25, 0.5, 1.0, 1.25, 4.0}) {
    for (std::int64_t A : {1, 16}) {
      SCOPED_TRACE(testing::Message() << "factor=" << factor << " A=" << A);
      const std::int64_t E = 16, K = 4, R = 4, L = E / R, t_max = 24;
      const MoeConfig cfg = layout_config(E, K, R, A, t_max, Capacity::per_expert(factor));
      PerRank idx = test::random_routing(rng, test::random_tokens(rng, R, t_max), E, K);
      for (std::int64_t s = 0; s < R; ++s)  // a quarter of the tokens on experts 4..7
        for (std::int64_t t = 0; t < idx[std::size_t(s)].view().size(0); t += 4)
          for (std::int64_t k = 0; k < K; ++k) idx[std::size_t(s)].set_i(t * K + k, std::int32_t(4 + k));
      const LayoutPlan p = plan_of(cfg, idx);
      const std::int64_t cap = cfg.expert_rows();
      EXPECT_EQ(cap % A, 0);
      EXPECT_EQ(p.capacity, L * cap);
      // the model
      std::vector<std::int64_t> seen(std::size_t(E), 0), offset(std::size_t(E), 0), overflow(std::size_t(R), 0);
      for (std::int64_t r = 0; r < R; ++r) {
        std::int64_t at = 0;
        for (std::int64_t e = r * L; e < (r + 1) * L; ++e) {
          offset[std::size_t(e)] = at;
          const std::int64_t padded = (p.tokens_per_expert[std::size_t(e)] + A - 1) / A * A;
          EXPECT_EQ(p.segment_rows[std::size_t(e)], std::min(padded, cap)) << "expert " << e;
          at += std::min(padded, cap);
        }
        EXPECT_EQ(p.rows_used[std::size_t(r)], at) << "rank " << r;
      }
      for (std::int64_t s = 0; s < R; ++s) {
        for (std::int64_t i = 0; i < idx[std::size_t(s)].view().size(0) * K; ++i) {
          const std::int64_t e = idx[std::size_t(s)].i(i);
          if (e < 0) continue;
          const std::int64_t place = seen[std::size_t(e)]++;
          const bool kept = place < cap;
          if (!kept) ++overflow[std::size_t(e / L)];
          EXPECT_EQ(p.dest_rank[std::size_t(s)][std::size_t(i)], kept ? e / L : -1) << "source " << s << " slot " << i;
          EXPECT_EQ(p.dest_row[std::size_t(s)][std::size_t(i)], kept ? offset[std::size_t(e)] + place : -1)
              << "source " << s << " slot " << i;
        }
      }
      EXPECT_EQ(p.overflow, overflow);
      for (std::int64_t o : overflow) some_dropped = some_dropped || o > 0;
    }
  }
  EXPECT_TRUE(some_dropped) << "the skewed routings should overflow some expert at the small factors";
}

TEST(LayoutCapacity, ZeroCapacityDropsEverything) {
  Rng rng(16);
  const PerRank idx = test::random_routing(rng, {5, 7}, 8, 2);
  const LayoutPlan p = plan_of(layout_config(8, 2, 2, 4, 8), idx, 0);
  EXPECT_EQ(p.rows_used, (std::vector<std::int64_t>{0, 0}));
  EXPECT_EQ(p.overflow[0] + p.overflow[1], 24);
  for (const auto& rows : p.dest_row)
    for (std::int32_t r : rows) EXPECT_EQ(r, -1);
  expect_plan_consistent(p, idx);
}

// ---- scale ----------------------------------------------------------------------------------------------------

TEST(LayoutPlanner, ManyRanksAndExperts) {
  Rng rng(17);
  struct Case {
    std::int64_t E, K, R, A;
  };
  for (const Case c : {Case{512, 8, 64, 128}, Case{512, 8, 32, 16}, Case{64, 8, 64, 32}, Case{320, 5, 64, 1},
                       Case{512, 1, 16, 256}}) {
    SCOPED_TRACE(testing::Message() << "E=" << c.E << " K=" << c.K << " R=" << c.R << " A=" << c.A);
    const PerRank idx = test::random_routing(rng, test::random_tokens(rng, c.R, 32), c.E, c.K, 0.05);
    const LayoutPlan p = plan_of(layout_config(c.E, c.K, c.R, c.A, 32), idx);
    expect_plan_consistent(p, idx);
    // Every kept row lies in the segment of the slot's expert, and segments end where the next begins.
    for (std::int64_t r = 0; r < c.R; ++r) {
      const std::int64_t L = p.local_experts;
      const std::int64_t last = (r + 1) * L - 1;
      EXPECT_EQ(p.segment_offset[std::size_t(last)] + p.padded_per_expert[std::size_t(last)],
                p.rows_needed[std::size_t(r)]);
    }
  }
}

// ---- argument errors ------------------------------------------------------------------------------------------

void expect_error(ErrorCode code, const std::string& needle, auto&& call) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(LayoutErrors, ExpertIdOutOfRangeNamesRankTokenSlotAndValue) {
  const MoeConfig cfg = layout_config(256, 4, 2, 16, 32);
  Rng rng(18);
  PerRank idx = test::random_routing(rng, {20, 20}, 256, 4);
  idx[1].set_i(17 * 4 + 3, 300);
  expect_error(ErrorCode::BadRouting,
               "plan_layout: rank 1 topk_idx[17,3] = 300 but num_experts = 256 (expected -1 <= id < 256)",
               [&] { plan_of(cfg, idx); });
  idx[1].set_i(17 * 4 + 3, 256);
  expect_error(ErrorCode::BadRouting, "topk_idx[17,3] = 256", [&] { plan_of(cfg, idx); });
  idx[1].set_i(17 * 4 + 3, 5);
  idx[0].set_i(2 * 4 + 0, -2);
  expect_error(ErrorCode::BadRouting, "rank 0 topk_idx[2,0] = -2", [&] { plan_of(cfg, idx); });
}

TEST(LayoutErrors, BadArguments) {
  const MoeConfig cfg = layout_config(8, 2, 2, 4, 6);
  Rng rng(19);
  const PerRank good = test::random_routing(rng, {6, 3}, 8, 2);
  plan_of(cfg, good);  // the baseline is accepted

  expect_error(ErrorCode::InvalidArgument, "topk_idx views for 1 ranks but cfg.ep_size = 2",
               [&] { plan_of(cfg, PerRank{good[0]}); });
  expect_error(ErrorCode::InvalidArgument, "topk_idx views for 3 ranks",
               [&] { plan_of(cfg, PerRank{good[0], good[1], good[1]}); });
  expect_error(ErrorCode::InvalidArgument, "topk_idx of rank 1 has 7 tokens but cfg.max_tokens = 6",
               [&] { plan_of(cfg, test::random_routing(rng, {6, 7}, 8, 2)); });
  expect_error(ErrorCode::InvalidArgument, "topk_idx of rank 0 has shape [6, 3]",
               [&] { plan_of(cfg, PerRank{test::per_rank(DType::I32, {6}, 3)[0], good[1]}); });
  expect_error(ErrorCode::InvalidArgument, "topk_idx of rank 1 has dtype i64",
               [&] { plan_of(cfg, PerRank{good[0], test::per_rank(DType::I64, {3}, 2)[0]}); });
  expect_error(ErrorCode::InvalidArgument, "capacity = -5", [&] { plan_of(cfg, good, -5); });
  {
    const std::vector<TensorView> v = {good[0].view(),
                                       TensorView(good[1].view().data(), DType::I32, {3, 2}, Device::cuda(0))};
    expect_error(ErrorCode::InvalidArgument, "topk_idx of rank 1 is on cuda:0", [&] { plan_layout(cfg, v); });
  }
  MoeConfig bad = cfg;
  bad.num_experts = 7;  // not a multiple of ep_size
  expect_error(ErrorCode::InvalidArgument, "not a multiple of ep_size", [&] { plan_of(bad, good); });
}

}  // namespace
}  // namespace moerail
