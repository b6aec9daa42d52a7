// Hierarchical transfers (DispatchOptions::ranks_per_node, docs/multinode.md) over in-process ranks (LoopbackGroup)
// on this process's GPU, the ranks grouped into nodes: every op checked against the reference as on the flat path
// (the dispatch bit for bit), the rows each rank sends to each node against the count made from the routing, and
// the collective the transfer is built on (Communicator::exchange_list).
#include <string>
#include <tuple>
#include <vector>

#include "dispatch/ep_harness.h"
#include "moerail/reference/dispatch.h"

namespace moerail::test::ep_gpu {
namespace {

// (ranks, ranks per node)
class EpHierLoopback : public ::testing::TestWithParam<std::tuple<int, int>> {
 protected:
  void SetUp() override { MOERAIL_REQUIRE_GPU(); }
  int R() const { return std::get<0>(GetParam()); }
  int G() const { return std::get<1>(GetParam()); }
  std::vector<std::int64_t> tokens(std::initializer_list<std::int64_t> per_rank) const {
    return tokens_of(R(), per_rank);
  }
  Case fit(Case c) const {
    c.E = (c.E + R() - 1) / R() * R();
    c.transport = Transport::HostApi;
    c.ranks_per_node = G();
    return c;
  }
};

TEST_P(EpHierLoopback, RandomRoutingUnevenTokens) {
  const Case c = fit(Case{});
  const std::vector<std::vector<std::int64_t>> steps{tokens({64, 37, 0, 5, 64, 12, 1, 40}),
                                                     tokens({5, 64, 64, 1, 0, 33, 64, 7}), tokens({0, 50})};
  run_ranks(R(), [&](Communicator& comm) { run_steps_on(comm, c, steps, Routing::Random, false, 100); });
}

TEST_P(EpHierLoopback, InCombineProbsTopK8AndWideRows) {
  Case c;
  c.H = 4224;
  c.E = 16;
  c.K = 8;
  c.t_max = 32;
  c.mode = ProbMode::InCombine;
  c = fit(c);
  run_ranks(R(), [&](Communicator& comm) {
    run_steps_on(comm, c, {tokens({32, 20, 7}), tokens({0, 32, 32})}, Routing::Random, false, 200);
    run_steps_on(comm, c, {tokens({32, 32}), tokens({0, 17})}, Routing::OneRank, false, 210);
  });
}

TEST_P(EpHierLoopback, F32RowsFewBlocksAndACapacityFactor) {
  Case c;
  c.dtype = DType::F32;
  c.sms = 2;
  c.capacity = Capacity::of_factor(2.0);
  c = fit(c);
  run_ranks(R(), [&](Communicator& comm) {
    run_steps_on(comm, c, {tokens({64, 37}), tokens({5, 64, 0})}, Routing::Random, false, 300);
  });
}

// Each source's first peer_rows tokens for each peer are kept and the slots of the later ones dropped at the source,
// as on the flat path: the union rows of a node are those of the kept tokens.
TEST_P(EpHierLoopback, PeerRowsBoundKeepsEachSourcesFirstTokens) {
  Case c = fit(Case{});
  c.capacity = Capacity::of_factor(0.6);
  run_ranks(R(), [&](Communicator& comm) {
    const int R = comm.size(), me = comm.rank();
    const MoeConfig cfg = config_of(c, R);
    Dispatcher d(cfg, comm, options_of(c));
    ASSERT_LT(d.peer_rows(), c.t_max);
    const std::int64_t capacity = d.capacity();
    const Step s = draw(c, R, capacity, 900, std::vector<std::int64_t>(std::size_t(R), c.t_max), Routing::Random);
    Buffers b(c, capacity);
    run_step_once(d, c, b, s, me);
    const Expected e = reference(c, cfg, s, capacity, d.peer_rows());
    expect_overflow_reported(d, me, e.plan.overflow[std::size_t(me)], "did not fit",
                             e.plan.peer_dropped[std::size_t(me)]);
    EXPECT_EQ(compare(c, e, b, me, s.tokens[std::size_t(me)], capacity), 0) << "rank " << me;
    EXPECT_GT(e.plan.peer_dropped[0], 0) << "the test routing must exceed peer_rows";
  });
}

// The rows a rank sends to each remote node: one per token with a slot on a rank of that node (none to its own),
// counted on the device, against the count from the routing and ref::node_traffic's network rows.
TEST_P(EpHierLoopback, OneRowPerTokenAndRemoteNode) {
  Case c = fit(Case{});
  c.E = 8 * R();
  c.K = 6;
  c.t_max = 200;
  run_ranks(R(), [&](Communicator& comm) {
    const int R = comm.size(), me = comm.rank(), G = this->G(), N = R / G;
    const MoeConfig cfg = config_of(c, R);
    Dispatcher d(cfg, comm, options_of(c));
    ASSERT_EQ(d.ranks_per_node(), G < R ? G : 0);
    if (G == R) return;
    EXPECT_EQ(d.node_rows(), std::min<std::int64_t>(c.t_max, G * d.peer_rows()));
    const std::int64_t capacity = d.capacity();
    std::vector<std::int64_t> tokens(std::size_t(R), c.t_max);
    tokens[0] = 0;
    tokens[std::size_t(R - 1)] = 77;
    const Step s = draw(c, R, capacity, 1000, tokens, Routing::Random);
    Buffers b(c, capacity);
    run_step_once(d, c, b, s, me);
    EXPECT_NO_THROW(d.check(nullptr)) << "rank " << me;
    const Expected e = reference(c, cfg, s, capacity, d.peer_rows());
    EXPECT_EQ(compare(c, e, b, me, s.tokens[std::size_t(me)], capacity), 0) << "rank " << me;
    std::vector<std::int64_t> want(std::size_t(N), 0);
    for (std::int64_t t = 0; t < s.tokens[std::size_t(me)]; ++t) {
      std::vector<char> hit(std::size_t(N), 0);
      for (std::int64_t k = 0; k < c.K; ++k) {
        const std::int32_t r = e.plan.dest_rank[std::size_t(me)][std::size_t(t * c.K + k)];
        if (r >= 0 && r / G != me / G) hit[std::size_t(r / G)] = 1;
      }
      for (int n = 0; n < N; ++n) want[std::size_t(n)] += hit[std::size_t(n)];
    }
    std::vector<std::int32_t> got(std::size_t(N), -1);
    testing::cuda_ok(cudaMemcpy(got.data(), d.layout().node_staged.data(), std::size_t(N) * 4, cudaMemcpyDeviceToHost),
                     "node_staged");
    std::int64_t sent = 0;
    for (int n = 0; n < N; ++n) {
      EXPECT_EQ(got[std::size_t(n)], want[std::size_t(n)]) << "rank " << me << " to node " << n;
      sent += got[std::size_t(n)];
    }
    EXPECT_EQ(sent, ref::node_traffic(e.plan, G).hier_network[std::size_t(me)]) << "rank " << me;
  });
}

INSTANTIATE_TEST_SUITE_P(Nodes, EpHierLoopback,
                         ::testing::Values(std::make_tuple(2, 1), std::make_tuple(4, 1), std::make_tuple(4, 2),
                                           std::make_tuple(6, 2), std::make_tuple(6, 3), std::make_tuple(8, 2),
                                           std::make_tuple(8, 4), std::make_tuple(4, 4)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& i) {
                           return std::to_string(std::get<0>(i.param)) + "ranks_" +
                                  std::to_string(std::get<1>(i.param)) + "per_node";
                         });

// Bad groupings are refused with the option named; the NVLink path has no nodes; -1 takes the NVLink domain, all of
// one host's ranks here: flat.
TEST(EpHier, RefusesGroupingsThatCannotBe) {
  MOERAIL_REQUIRE_GPU();
  run_ranks(4, [&](Communicator& comm) {
    Case c;
    c.transport = Transport::HostApi;
    const MoeConfig cfg = config_of(c, comm.size());
    EXPECT_EQ(comm.lsa_ranks(), comm.size());
    c.ranks_per_node = -1;
    EXPECT_EQ(Dispatcher(cfg, comm, options_of(c)).ranks_per_node(), 0);
    for (int g : {-2, 3}) {
      c.ranks_per_node = g;
      try {
        Dispatcher d(cfg, comm, options_of(c));
        ADD_FAILURE() << "ranks_per_node = " << g << " was accepted";
      } catch (const Error& err) {
        EXPECT_EQ(err.code(), ErrorCode::InvalidArgument);
        EXPECT_NE(std::string(err.what()).find("ranks_per_node"), std::string::npos) << err.what();
      }
    }
    c.transport = Transport::NvLink;
    c.ranks_per_node = 2;
    try {
      Dispatcher d(cfg, comm, options_of(c));
      ADD_FAILURE() << "hierarchical transfers on the NVLink path were accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), ErrorCode::Unsupported);
      EXPECT_NE(std::string(err.what()).find("host-API"), std::string::npos) << err.what();
    }
  });
}

// exchange_list: several transfers with one peer (matched in list order), different sizes per peer, none with some.
TEST(EpHier, ExchangeListMatchesEachPeersTransfersInOrder) {
  MOERAIL_REQUIRE_GPU();
  constexpr int R = 4;
  run_ranks(R, [&](Communicator& comm) {
    const int me = comm.rank();
    // with peer p: (1 + (me + p) % 3) transfers, transfer i of (i + 1) * 100 ints; none between ranks 0 and 3
    const auto count = [](int a, int b) { return (a == 0 && b == 3) || (a == 3 && b == 0) ? 0 : 1 + (a + b) % 3; };
    std::vector<DeviceTensor> send, recv;
    std::vector<Communicator::PeerCopy> list;
    for (int p = 0; p < R; ++p) {
      if (p == me) continue;
      for (int i = 0; i < count(me, p); ++i) {
        const std::int64_t n = (i + 1) * 100;
        std::vector<std::int32_t> v(static_cast<std::size_t>(n));
        for (std::int64_t j = 0; j < n; ++j) v[std::size_t(j)] = std::int32_t(me * 1000000 + p * 10000 + i * 1000 + j);
        send.emplace_back(DType::I32, std::vector<std::int64_t>{n});
        recv.emplace_back(DType::I32, std::vector<std::int64_t>{n});
        send.back().from_vector(v);
      }
    }
    std::size_t at = 0;
    for (int p = 0; p < R; ++p) {
      if (p == me) continue;
      for (int i = 0; i < count(me, p); ++i, ++at)
        list.push_back({p, send[at].data(), recv[at].data(), std::size_t((i + 1) * 100) * 4});
    }
    cudaStream_t st;
    testing::cuda_ok(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
    comm.exchange_list(list, st, "test exchange_list");
    testing::cuda_ok(cudaStreamSynchronize(st), "sync");
    cudaStreamDestroy(st);
    int bad = 0;
    at = 0;
    for (int p = 0; p < R; ++p) {
      if (p == me) continue;
      for (int i = 0; i < count(me, p); ++i, ++at) {
        const std::int64_t n = (i + 1) * 100;
        const std::vector<std::int32_t> v = recv[at].to_vector<std::int32_t>(n);
        for (std::int64_t j = 0; j < n; ++j) bad += v[std::size_t(j)] != std::int32_t(p * 1000000 + me * 10000 + i * 1000 + j);
      }
    }
    EXPECT_EQ(bad, 0) << "rank " << me;
  });
}

}  // namespace
}  // namespace moerail::test::ep_gpu
