// The expert-parallel planner's arithmetic (src/dispatch/ep_plan.h, the code the planner kernel runs) against the
// reference planner, for R up to 64 ranks and E up to 512 experts, under every capacity policy: every slot's row, each
// rank's segments, rows used and dropped rows. Runs on the CPU: the same functions, one "thread".
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "dispatch/ep_plan.h"
#include "moerail/reference/host.h"
#include "moerail/reference/layout.h"

namespace moerail {
namespace {

struct Shape {
  int R, E, K, A;
  double factor;  // capacity factor: > 0 per rank (Capacity::Factor), < 0 per expert (PerExpert, -factor); 0 = worst
                  // case
};

class EpPlan : public ::testing::TestWithParam<Shape> {};

TEST_P(EpPlan, MatchesTheReferencePlanner) {
  const Shape sh = GetParam();
  MoeConfig cfg;
  cfg.hidden = 64;
  cfg.ffn_hidden = 64;
  cfg.num_experts = sh.E;
  cfg.topk = sh.K;
  cfg.ep_size = sh.R;
  cfg.align = sh.A;
  cfg.max_tokens = 40;
  cfg.capacity = sh.factor > 0   ? Capacity::of_factor(sh.factor)
                 : sh.factor < 0 ? Capacity::per_expert(-sh.factor)
                                 : Capacity::worst_case();
  const int L = sh.E / sh.R;
  ref::Rng rng(std::uint64_t(sh.R * 1000 + sh.E));
  std::vector<ref::HostTensor> topk;
  std::vector<TensorView> views;
  std::vector<std::int64_t> tokens;
  for (int r = 0; r < sh.R; ++r) {
    const std::int64_t T = r % 7 == 3 ? 0 : rng.below(cfg.max_tokens + 1);  // uneven, some ranks empty
    tokens.push_back(T);
    topk.emplace_back(DType::I32, std::vector<std::int64_t>{std::max<std::int64_t>(T, 1), sh.K});
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<std::int64_t> chosen;
      for (int k = 0; k < sh.K; ++k) {
        std::int64_t e = -1;
        if (rng.uniform() > 0.05) {
          // skewed: half the slots go to the first 4 experts, so Factor capacities overflow
          do e = rng.uniform() < 0.5 ? rng.below(std::min(4, sh.E)) : rng.below(sh.E);
          while (std::find(chosen.begin(), chosen.end(), e) != chosen.end());
          chosen.push_back(e);
        }
        topk.back().set_i(t * sh.K + k, e);
      }
    }
    views.push_back(TensorView(topk.back().view().data(), DType::I32, {T, sh.K}));
  }
  const ref::LayoutPlan plan = ref::plan_layout(cfg, views);
  const std::int64_t capacity = cfg.rows_per_rank(), cap_e = cfg.expert_rows();
  ASSERT_EQ(plan.expert_capacity, cap_e);
  if (sh.factor < 0) ASSERT_EQ(capacity, L * cap_e);
  // an expert's segment and the routed rows it keeps, from the reference's counts
  auto segment_size = [&](std::size_t e) {
    return cap_e > 0 ? std::min(plan.padded_per_expert[e], cap_e) : plan.padded_per_expert[e];
  };
  auto kept = [&](std::size_t e) {
    return cap_e > 0 ? std::min(plan.tokens_per_expert[e], cap_e) : plan.tokens_per_expert[e];
  };

  // what the kernels exchange: per (source, expert) counts and T, and each slot's place among its source's slots to
  // the same expert (the local planner, token then k order)
  std::vector<std::int32_t> counts(std::size_t(sh.R) * (sh.E + 1), 0);
  std::vector<std::vector<std::int32_t>> within(std::size_t(sh.R));
  for (int r = 0; r < sh.R; ++r) {
    std::int32_t* c = &counts[std::size_t(r) * (sh.E + 1)];
    within[std::size_t(r)].assign(std::size_t(tokens[std::size_t(r)] * sh.K), -1);
    for (std::int64_t i = 0; i < tokens[std::size_t(r)] * sh.K; ++i) {
      const std::int64_t e = topk[std::size_t(r)].i(i);
      if (e >= 0) within[std::size_t(r)][std::size_t(i)] = c[e]++;
    }
    c[sh.E] = std::int32_t(tokens[std::size_t(r)]);
  }

  for (int me = 0; me < sh.R; ++me) {
    std::vector<std::int32_t> base(std::size_t(sh.E)), limit(std::size_t(sh.E)), toks(std::size_t(sh.R)),
        tpe(static_cast<std::size_t>(L)), padded(static_cast<std::size_t>(L)), seg(static_cast<std::size_t>(L + 1)),
        seg_rows(static_cast<std::size_t>(L)), pads(static_cast<std::size_t>(L + 1)), used(1);
    ep::PlanOut o{base.data(), limit.data(), toks.data(), tpe.data(), padded.data(), seg.data(), seg_rows.data(),
                  pads.data(), used.data()};
    const ep::PlanShape s{sh.R, sh.E, L, sh.A, me, capacity, cap_e};
    ep::plan_serial(s, counts.data(), o);
    for (int r = 0; r < sh.R; ++r) ASSERT_EQ(toks[std::size_t(r)], tokens[std::size_t(r)]) << "rank " << r;
    std::int64_t pads_before = 0, rows = 0, fullest = 0;  // pad rows and segment rows of this rank's earlier experts
    for (int l = 0; l < L; ++l) {
      const std::size_t e = std::size_t(me * L + l);
      ASSERT_EQ(tpe[std::size_t(l)], plan.tokens_per_expert[e]) << "rank " << me << " expert " << e;
      ASSERT_EQ(padded[std::size_t(l)], plan.padded_per_expert[e]) << "rank " << me << " expert " << e;
      ASSERT_EQ(seg[std::size_t(l)], plan.segment_offset[e]) << "rank " << me << " expert " << e;
      ASSERT_EQ(seg_rows[std::size_t(l)], plan.segment_rows[e]) << "rank " << me << " expert " << e;
      ASSERT_EQ(pads[std::size_t(l)], pads_before) << "rank " << me << " expert " << e;
      pads_before += segment_size(e) - kept(e);
      rows += segment_size(e);
      fullest = std::max(fullest, plan.padded_per_expert[e]);
    }
    ASSERT_EQ(pads[std::size_t(L)], pads_before) << "rank " << me;
    ASSERT_EQ(seg[std::size_t(L)], rows) << "rank " << me;
    ASSERT_EQ(o.rows_needed, cap_e > 0 ? fullest : plan.rows_needed[std::size_t(me)]) << "rank " << me;
    ASSERT_EQ(used[0], plan.rows_used[std::size_t(me)]) << "rank " << me;
    ASSERT_EQ(o.overflow, plan.overflow[std::size_t(me)]) << "rank " << me;
    // this rank as a source: row of every slot = base[e] + place, dropped at or beyond the end of e's segment
    // inside its rank's buffer (limit[e])
    for (std::int64_t i = 0; i < tokens[std::size_t(me)] * sh.K; ++i) {
      const std::int64_t e = topk[std::size_t(me)].i(i);
      std::int64_t rank = -1, row = -1;
      if (e >= 0) {
        const std::int64_t r = std::int64_t(base[std::size_t(e)]) + within[std::size_t(me)][std::size_t(i)];
        if (r < limit[std::size_t(e)]) {
          rank = e / L;
          row = r;
        }
      }
      ASSERT_EQ(rank, plan.dest_rank[std::size_t(me)][std::size_t(i)]) << "rank " << me << " slot " << i;
      ASSERT_EQ(row, plan.dest_row[std::size_t(me)][std::size_t(i)]) << "rank " << me << " slot " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, EpPlan,
                         ::testing::Values(Shape{1, 8, 2, 1, 0}, Shape{2, 64, 8, 128, 0}, Shape{4, 12, 3, 16, 0},
                                           Shape{8, 256, 8, 32, 1.0}, Shape{16, 512, 8, 128, 0.5},
                                           Shape{64, 512, 8, 16, 0}, Shape{64, 64, 4, 256, 1.0},
                                           Shape{32, 96, 6, 1, 0.25}, Shape{1, 8, 2, 1, -1.0},
                                           Shape{2, 64, 8, 16, -1.25}, Shape{4, 12, 3, 16, -0.5},
                                           Shape{8, 256, 8, 32, -2.0}, Shape{64, 64, 4, 1, -1.0}));

// The data kernels' remote work list (ep::RemoteWork): over the warps of a role, every (remote source, chunk) pair
// exactly once, always in the block that produces the chunk on its source rank (chunk c on warp c mod nw there,
// block c mod blocks: every wait on a peer pairs blocks of the same index; docs/dispatch.md, Blocks), and the
// sources of one chunk on different warps of that block while there are enough.
TEST(EpWork, EveryRemoteChunkOnceInTheBlockThatProducesIt) {
  for (int R : {1, 2, 3, 4, 8, 64})
    for (int blocks : {1, 3, 132})
      for (int per_block : {1, 8})
        for (int chunks : {0, 1, 7, 500, 2048})
          for (int me : {0, R / 2, R - 1}) {
            const int nw = blocks * per_block;
            const ep::RemoteWork rw{R, me, chunks};
            std::vector<int> seen(std::size_t(R) * std::size_t(chunks), -1);  // the warp of each pair
            for (int w = 0; w < nw; ++w) {
              const ep::RoleWarps m{w, nw, blocks};
              int s = -1, c = -1;
              for (int n = 0; rw.pick(m, n, s, c); ++n) {
                ASSERT_TRUE(s >= 0 && s < R && s != me) << "R " << R << " source " << s;
                ASSERT_GE(c, 0);
                if (c >= chunks) continue;  // past this source's chunks: the kernels skip it
                EXPECT_EQ(m.block(), (c % nw) % blocks) << "R " << R << ": chunk " << c << " away from its block";
                int& at = seen[std::size_t(s) * std::size_t(chunks) + std::size_t(c)];
                EXPECT_EQ(at, -1) << "R " << R << " source " << s << " chunk " << c << " twice";
                at = w;
              }
            }
            for (int s = 0; s < R; ++s)
              for (int c = 0; c < chunks; ++c) {
                const int at = seen[std::size_t(s) * std::size_t(chunks) + std::size_t(c)];
                EXPECT_EQ(at >= 0, s != me) << "R " << R << " source " << s << " chunk " << c;
              }
            // The R - 1 pairs of one chunk on distinct warps when the block has as many.
            if (R > 1 && R - 1 <= per_block && chunks > 0)
              for (int c = 0; c < chunks; ++c) {
                std::vector<int> warps;
                for (int s = 0; s < R; ++s)
                  if (s != me) warps.push_back(seen[std::size_t(s) * std::size_t(chunks) + std::size_t(c)]);
                std::sort(warps.begin(), warps.end());
                EXPECT_EQ(std::unique(warps.begin(), warps.end()), warps.end()) << "R " << R << " chunk " << c;
              }
          }
}

// DispatchOptions::ranks_per_node to the Dispatcher's nodes: a grouping given, the NVLink domain for -1, flat when
// the grouping is one node of all ranks or not known.
TEST(EpNodes, RanksPerNodeFromTheOptionOrTheNvlinkDomain) {
  EXPECT_EQ(ep::node_ranks(0, 8, 16), 0);    // flat, whatever the domain
  EXPECT_EQ(ep::node_ranks(4, 0, 16), 4);    // given
  EXPECT_EQ(ep::node_ranks(1, 16, 16), 1);   // one rank per node
  EXPECT_EQ(ep::node_ranks(16, 8, 16), 0);   // one node: flat
  EXPECT_EQ(ep::node_ranks(-1, 8, 16), 8);   // the NVLink domain
  EXPECT_EQ(ep::node_ranks(-1, 16, 16), 0);  // every rank in one domain: flat
  EXPECT_EQ(ep::node_ranks(-1, 0, 16), 0);   // domain unknown: flat
}

}  // namespace
}  // namespace moerail
