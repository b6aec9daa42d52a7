// tests/reference/hierarchical_test.cpp — ranks grouped into nodes (NVLink domains) in the reference: the per-node
// reduction of combine and dispatch backward (Reduction::PerNode), the rows one dispatch moves over the network and
// over NVLink (node_traffic), and the dispatch and combine through rail-aligned forwarders (plan_hierarchical,
// dispatch_forward_hierarchical, combine_forward_hierarchical), from 2 to 64 ranks in 1 to 8 nodes, against models
// written here from the contract, the flat dispatch and the per-node combine.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "moerail/error.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/layout.h"
#include "routing_fixtures.h"

namespace moerail {
namespace {

using ref::HostTensor;
using ref::LayoutPlan;
using ref::Reduction;
using ref::Rng;
using test::PerRank;
using test::views;

constexpr std::int64_t kE = 256, kK = 8, kH = 5, kTmax = 12, kAlign = 4;

struct Grouping {
  std::int64_t ranks, nodes;
  std::int64_t per_node() const { return ranks / nodes; }
};

// 2..64 ranks in 1..8 nodes (every split with nodes dividing the ranks).
std::vector<Grouping> groupings() {
  std::vector<Grouping> g;
  for (std::int64_t R : {2, 4, 8, 16, 32, 64})
    for (std::int64_t N : {1, 2, 4, 8})
      if (N <= R && R % N == 0) g.push_back({R, N});
  return g;
}

std::string name(const Grouping& g) {
  return std::to_string(g.ranks) + " ranks in " + std::to_string(g.nodes) + " nodes";
}

struct Step {
  MoeConfig cfg;
  PerRank idx;
  LayoutPlan plan;
};

Step random_step(const Grouping& g, Rng& rng) {
  Step s;
  s.cfg.num_experts = kE;
  s.cfg.topk = kK;
  s.cfg.ep_size = g.ranks;
  s.cfg.align = kAlign;
  s.cfg.max_tokens = kTmax;
  s.cfg.hidden = kH;
  s.idx = test::random_routing(rng, test::random_tokens(rng, g.ranks, kTmax), kE, kK, /*unrouted=*/0.1);
  s.plan = ref::plan_layout(s.cfg, views(s.idx));
  return s;
}

// Per destination rank [capacity, H] f32 rows of random values.
PerRank random_rows(const LayoutPlan& plan, Rng& rng) {
  PerRank rows = test::per_rank(DType::F32, std::vector<std::int64_t>(std::size_t(plan.num_ranks), plan.capacity), kH);
  for (const HostTensor& t : rows) ref::fill_uniform(t, rng, -1.0, 1.0);
  return rows;
}

// The contract's PerNode sum of token t of source s: the slots on each remote node summed in k order, that partial
// rounded to out's dtype (bf16 here) as it crosses the network; on the ranks of t's own node each rank's slots
// summed in k order, rounded unless the rank is s (as PerRank); all added in rank order; then out's rounding.
double per_node_sum(const LayoutPlan& p, const PerRank& rows, std::int64_t G, std::int64_t s, std::int64_t t,
                    std::int64_t h) {
  const auto round_bf16 = [](double v) {
    HostTensor cell(DType::BF16, {1});
    cell.set_f(0, v);
    return cell.f(0);
  };
  // the slots of t on ranks [lo, hi), k order; false when there are none
  const auto partial = [&](std::int64_t lo, std::int64_t hi, double& part) {
    part = 0.0;
    bool any = false;
    for (std::int64_t k = 0; k < p.topk; ++k) {
      const std::int64_t d = p.dest_rank[std::size_t(s)][std::size_t(t * p.topk + k)];
      if (d < lo || d >= hi) continue;
      any = true;
      part += rows[std::size_t(d)].f(p.dest_row[std::size_t(s)][std::size_t(t * p.topk + k)] * kH + h);
    }
    return any;
  };
  double acc = 0.0, part = 0.0;
  for (std::int64_t n = 0; n < p.num_ranks / G; ++n) {
    if (n == s / G) {
      for (std::int64_t r = n * G; r < (n + 1) * G; ++r)
        if (partial(r, r + 1, part)) acc += r == s ? part : round_bf16(part);
    } else if (partial(n * G, (n + 1) * G, part)) {
      acc += round_bf16(part);
    }
  }
  return round_bf16(acc);
}

PerRank combine(const Step& s, const PerRank& y, Reduction reduction, std::int64_t ranks_per_node) {
  PerRank out = test::per_rank(DType::BF16, s.plan.tokens, kH);
  const auto vy = views(y), vo = views(out);
  ref::combine_forward(s.plan, {.y = vy, .out = vo, .reduction = reduction, .ranks_per_node = ranks_per_node});
  return out;
}

PerRank dispatch_backward(const Step& s, const PerRank& d_recv, Reduction reduction, std::int64_t ranks_per_node) {
  PerRank dx = test::per_rank(DType::BF16, s.plan.tokens, kH);
  const auto vd = views(d_recv), vx = views(dx);
  ref::dispatch_backward(s.plan, {.d_recv = vd, .dx = vx, .reduction = reduction, .ranks_per_node = ranks_per_node});
  return dx;
}

void expect_same_bits(const PerRank& a, const PerRank& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t r = 0; r < a.size(); ++r)
    for (std::int64_t i = 0; i < a[r].numel(); ++i)
      ASSERT_EQ(a[r].f(i), b[r].f(i)) << what << ": rank " << r << " element " << i;
}

TEST(Hierarchical, PerNodeReductionIsTheContractsSum) {
  Rng rng(41);
  for (const Grouping& g : groupings()) {
    SCOPED_TRACE(name(g));
    const Step s = random_step(g, rng);
    const PerRank y = random_rows(s.plan, rng);
    const PerRank out = combine(s, y, Reduction::PerNode, g.per_node());
    const PerRank dx = dispatch_backward(s, y, Reduction::PerNode, g.per_node());  // the same sum, weight 1
    for (std::int64_t src = 0; src < g.ranks; ++src)
      for (std::int64_t t = 0; t < s.plan.tokens[std::size_t(src)]; ++t)
        for (std::int64_t h = 0; h < kH; ++h) {
          const double want = per_node_sum(s.plan, y, g.per_node(), src, t, h);
          ASSERT_EQ(out[std::size_t(src)].f(t * kH + h), want) << "combine: rank " << src << " token " << t;
          ASSERT_EQ(dx[std::size_t(src)].f(t * kH + h), want) << "dispatch backward: rank " << src << " token " << t;
        }
  }
}

TEST(Hierarchical, OneRankPerNodeAndOneNodeArePerRank) {
  Rng rng(42);
  for (std::int64_t R : {2, 8, 64}) {
    SCOPED_TRACE(std::to_string(R) + " ranks");
    const Step s = random_step({R, R}, rng);
    const PerRank y = random_rows(s.plan, rng);
    expect_same_bits(combine(s, y, Reduction::PerNode, 1), combine(s, y, Reduction::PerRank, 0), "R nodes");
    expect_same_bits(combine(s, y, Reduction::PerNode, R), combine(s, y, Reduction::PerRank, 0), "one node");
  }
}

// Traffic counted from topk_idx alone (no drops under worst-case capacity): for each token, the ranks and nodes its
// routed experts live on.
ref::NodeTraffic traffic_model(const Step& s, std::int64_t G) {
  const std::int64_t R = s.cfg.ep_size, L = kE / R;
  ref::NodeTraffic m;
  for (auto* v : {&m.flat_network, &m.flat_nvlink, &m.hier_network, &m.hier_nvlink}) v->assign(std::size_t(R), 0);
  for (std::int64_t src = 0; src < R; ++src) {
    const HostTensor& ids = s.idx[std::size_t(src)];
    for (std::int64_t t = 0; t < ids.view().size(0); ++t) {
      std::set<std::int64_t> ranks, nodes;
      for (std::int64_t k = 0; k < kK; ++k)
        if (const std::int64_t e = ids.i(t * kK + k); e >= 0) ranks.insert(e / L), nodes.insert(e / L / G);
      for (std::int64_t d : ranks) {
        if (d == src) continue;
        (d / G == src / G ? m.flat_nvlink : m.flat_network)[std::size_t(src)] += 1;
        if (d / G == src / G) m.hier_nvlink[std::size_t(src)] += 1;
      }
      for (std::int64_t n : nodes) {
        if (n == src / G) continue;
        m.hier_network[std::size_t(src)] += 1;
        const std::int64_t forwarder = n * G + src % G;
        for (std::int64_t d : ranks)
          if (d / G == n && d != forwarder) m.hier_nvlink[std::size_t(forwarder)] += 1;
      }
    }
  }
  return m;
}

std::int64_t sum(const std::vector<std::int64_t>& v) {
  std::int64_t n = 0;
  for (std::int64_t x : v) n += x;
  return n;
}

TEST(Hierarchical, TrafficIsOneNetworkRowPerTokenAndRemoteNode) {
  Rng rng(43);
  for (const Grouping& g : groupings()) {
    SCOPED_TRACE(name(g));
    const Step s = random_step(g, rng);
    const ref::NodeTraffic got = ref::node_traffic(s.plan, g.per_node());
    const ref::NodeTraffic want = traffic_model(s, g.per_node());
    EXPECT_EQ(got.flat_network, want.flat_network);
    EXPECT_EQ(got.flat_nvlink, want.flat_nvlink);
    EXPECT_EQ(got.hier_network, want.hier_network);
    EXPECT_EQ(got.hier_nvlink, want.hier_nvlink);
    EXPECT_LE(sum(got.hier_network), sum(got.flat_network));
    if (g.nodes == 1) EXPECT_EQ(sum(got.flat_network) + sum(got.hier_network), 0);
    if (g.nodes == g.ranks) {  // one rank per node: nothing to forward
      EXPECT_EQ(got.hier_network, got.flat_network);
      EXPECT_EQ(sum(got.hier_nvlink), 0);
    }
  }
}

TEST(Hierarchical, DispatchThroughForwardersLeavesTheFlatDispatchsBuffers) {
  Rng rng(45);
  for (const Grouping& g : groupings()) {
    SCOPED_TRACE(name(g));
    const Step s = random_step(g, rng);
    const std::int64_t G = g.per_node();
    const ref::HierarchicalPlan hier = ref::plan_hierarchical(s.plan, G);
    // the staged rows: one per (token, remote node), each at the rank of that node with the source's local index,
    // in (source rank, token) order
    const ref::NodeTraffic traffic = ref::node_traffic(s.plan, G);
    std::int64_t staged = 0;
    for (std::int64_t f = 0; f < g.ranks; ++f) {
      const auto& rows = hier.staged[std::size_t(f)];
      staged += std::int64_t(rows.size());
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const auto [src, t] = rows[i];
        EXPECT_NE(src / G, f / G) << "rank " << f << " stages a row of its own node";
        EXPECT_EQ(src % G, f % G) << "rank " << f << " stages a row of another rail";
        if (i > 0) EXPECT_LT(rows[i - 1], rows[i]) << "rank " << f << " staged rows out of order";
      }
    }
    EXPECT_EQ(staged, sum(traffic.hier_network));

    PerRank x = test::per_rank(DType::F32, s.plan.tokens, kH), p = test::per_rank(DType::F32, s.plan.tokens, kK);
    for (const HostTensor& t : x) ref::fill_uniform(t, rng, -1.0, 1.0);
    for (const HostTensor& t : p) ref::fill_uniform(t, rng, 0.0, 1.0);
    const std::vector<std::int64_t> capacity(std::size_t(g.ranks), s.plan.capacity);
    PerRank flat = test::per_rank(DType::F32, capacity, kH), hier_recv = test::per_rank(DType::F32, capacity, kH);
    PerRank flat_p = test::per_rank_1d(DType::F32, std::size_t(g.ranks), s.plan.capacity);
    PerRank hier_p = test::per_rank_1d(DType::F32, std::size_t(g.ranks), s.plan.capacity);
    std::vector<std::int64_t> staging_rows;
    for (const auto& rows : hier.staged) staging_rows.push_back(std::int64_t(rows.size()));
    PerRank staging = test::per_rank(DType::F32, staging_rows, kH);
    for (const PerRank* t : {&flat, &hier_recv, &flat_p, &hier_p})
      for (const HostTensor& v : *t) v.fill_nan();
    const auto vx = views(x), vp = views(p), vf = views(flat), vfp = views(flat_p), vh = views(hier_recv),
               vhp = views(hier_p), vs = views(staging);
    ref::dispatch_forward(s.plan, {.x = vx, .probs = vp, .recv = vf, .recv_probs = vfp});
    ref::dispatch_forward_hierarchical(s.plan, hier, {.x = vx, .probs = vp, .recv = vh, .recv_probs = vhp}, vs);
    for (std::int64_t f = 0; f < g.ranks; ++f)  // the network hop: each staged row is its token's row
      for (std::size_t i = 0; i < hier.staged[std::size_t(f)].size(); ++i)
        for (std::int64_t h = 0; h < kH; ++h) {
          const auto [src, t] = hier.staged[std::size_t(f)][i];
          ASSERT_EQ(staging[std::size_t(f)].f(std::int64_t(i) * kH + h), x[std::size_t(src)].f(t * kH + h));
        }
    for (std::int64_t d = 0; d < g.ranks; ++d)
      for (std::int64_t i = 0; i < s.plan.rows_used[std::size_t(d)] * kH; ++i) {
        ASSERT_EQ(hier_recv[std::size_t(d)].f(i), flat[std::size_t(d)].f(i)) << "recv of rank " << d << " [" << i << "]";
        if (i % kH == 0)
          ASSERT_EQ(hier_p[std::size_t(d)].f(i / kH), flat_p[std::size_t(d)].f(i / kH)) << "recv_probs of rank " << d;
      }
  }
}

TEST(Hierarchical, CombineThroughForwardersIsThePerNodeSum) {
  Rng rng(46);
  for (const Grouping& g : groupings()) {
    for (ProbMode mode : {ProbMode::InActivation, ProbMode::InCombine}) {
      SCOPED_TRACE(name(g) + (mode == ProbMode::InCombine ? ", in-combine" : ", in-activation"));
      const Step s = random_step(g, rng);
      const ref::HierarchicalPlan hier = ref::plan_hierarchical(s.plan, g.per_node());
      const PerRank y = random_rows(s.plan, rng);
      PerRank p = test::per_rank(DType::F32, s.plan.tokens, kK);
      for (const HostTensor& t : p) ref::fill_uniform(t, rng, 0.0, 1.0);
      PerRank want = test::per_rank(DType::BF16, s.plan.tokens, kH), got = test::per_rank(DType::BF16, s.plan.tokens, kH);
      std::vector<std::int64_t> staging_rows;
      for (const auto& rows : hier.staged) staging_rows.push_back(std::int64_t(rows.size()));
      PerRank staging = test::per_rank(DType::BF16, staging_rows, kH);
      const auto vy = views(y), vp = views(p), vw = views(want), vg = views(got), vs = views(staging);
      ref::combine_forward(s.plan, {.mode = mode, .y = vy, .probs = vp, .out = vw, .reduction = Reduction::PerNode,
                                    .ranks_per_node = g.per_node()});
      ref::combine_forward_hierarchical(s.plan, hier, {.mode = mode, .y = vy, .probs = vp, .out = vg}, vs);
      expect_same_bits(got, want, "combine through the forwarders");
    }
  }
}

TEST(Hierarchical, RanksPerNodeMustDivideTheRanks) {
  Rng rng(44);
  const Step s = random_step({4, 1}, rng);
  const PerRank y = random_rows(s.plan, rng);
  for (std::int64_t bad : {0, 3}) {
    try {
      combine(s, y, Reduction::PerNode, bad);
      FAIL() << "combine_forward accepted ranks_per_node = " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find("ranks_per_node = " + std::to_string(bad)), std::string::npos) << e.what();
    }
    EXPECT_THROW(ref::node_traffic(s.plan, bad), Error);
    EXPECT_THROW(ref::plan_hierarchical(s.plan, bad), Error);
  }
}

}  // namespace
}  // namespace moerail
