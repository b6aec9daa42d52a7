// Both transports with in-process ranks (LoopbackGroup, moerail/comm.h): several ranks on this process's GPU, each
// a host thread with its own Communicator, Dispatcher and stream, every op checked against the reference as the
// ranks of separate processes are (ep_harness.h). This runs the multi-rank paths where fewer GPUs than ranks are
// present; every worker of a multi-GPU run runs it too, on its own GPU.
#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "dispatch/ep_harness.h"

namespace moerail::test::ep_gpu {
namespace {

// (ranks, transport): the NVLink path's stores and flags between in-process ranks are stores within this GPU.
class EpLoopback : public ::testing::TestWithParam<std::tuple<int, Transport>> {
 protected:
  void SetUp() override { MOERAIL_REQUIRE_GPU(); }
  int R() const { return std::get<0>(GetParam()); }
  Transport transport() const { return std::get<1>(GetParam()); }
  std::vector<std::int64_t> tokens(std::initializer_list<std::int64_t> per_rank) const {
    return tokens_of(R(), per_rank);
  }
  // c.E rounded up to a multiple of the ranks
  Case fit(Case c) const {
    c.E = (c.E + R() - 1) / R() * R();
    c.transport = transport();
    return c;
  }
  // NVLink: the steps after the first also as one captured graph's replays (no host collective in a step)
  void run_steps(Case c, const std::vector<std::vector<std::int64_t>>& steps, Routing routing, std::uint64_t seed) {
    c = fit(c);
    const bool graph = c.transport == Transport::NvLink;
    run_ranks(R(), [&](Communicator& comm) { run_steps_on(comm, c, steps, routing, graph, seed); });
  }
};

// The group's collectives themselves: each rank's slices reach the right peers, in place and between buffers.
TEST_P(EpLoopback, ExchangeAndAllGatherMoveEveryRanksSlices) {
  if (transport() != Transport::HostApi) GTEST_SKIP() << "the host-API collectives";
  const int R = this->R();
  constexpr std::size_t kInts = 1000;
  run_ranks(R, [&](Communicator& comm) {
    const int me = comm.rank();
    DeviceTensor send(DType::I32, {std::int64_t(R * kInts)}), recv(DType::I32, {std::int64_t(R * kInts)}),
        all(DType::I32, {std::int64_t(R * kInts)});
    std::vector<std::int32_t> s(R * kInts), a(R * kInts, -1);
    for (int p = 0; p < R; ++p)
      for (std::size_t i = 0; i < kInts; ++i) s[p * kInts + i] = std::int32_t(me * 1000000 + p * 10000 + int(i));
    for (std::size_t i = 0; i < kInts; ++i) a[me * kInts + i] = std::int32_t(me * 7 + int(i));
    send.from_vector(s);
    all.from_vector(a);
    recv.poison();
    cudaStream_t st;
    testing::cuda_ok(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
    comm.exchange(send.data(), recv.data(), kInts * 4, kInts * 4, st, "test exchange");
    comm.all_gather_inplace(all.data(), kInts * 4, st, "test all_gather");
    testing::cuda_ok(cudaStreamSynchronize(st), "sync");
    cudaStreamDestroy(st);
    const std::vector<std::int32_t> r = recv.to_vector<std::int32_t>(R * kInts), g = all.to_vector<std::int32_t>(R * kInts);
    int bad = 0;
    for (int p = 0; p < R; ++p)
      for (std::size_t i = 0; i < kInts; ++i) {
        if (p != me && r[p * kInts + i] != std::int32_t(p * 1000000 + me * 10000 + int(i))) ++bad;
        if (g[p * kInts + i] != std::int32_t(p * 7 + int(i))) ++bad;
      }
    EXPECT_EQ(bad, 0) << "rank " << me;
    EXPECT_EQ(comm.all_reduce_min(50 - me, nullptr), 50 - (R - 1));
  });
}

TEST_P(EpLoopback, RandomRoutingUnevenTokens) {
  Case c;
  run_steps(c, {tokens({64, 37, 0, 5}), tokens({5, 64, 64, 1}), tokens({0, 50}), tokens({33, 0})}, Routing::Random,
            100);
}

TEST_P(EpLoopback, InCombineProbsTopK8AndWideRows) {
  Case c;
  c.H = 4224;
  c.E = 16;
  c.K = 8;
  c.t_max = 32;
  c.mode = ProbMode::InCombine;
  run_steps(c, {tokens({32, 20, 7}), tokens({0, 32, 32})}, Routing::Random, 200);
  run_steps(c, {tokens({32, 32}), tokens({0, 17})}, Routing::OneRank, 210);
}

TEST_P(EpLoopback, F32RowsFewBlocksAndCapacityThatFits) {
  Case c;
  c.dtype = DType::F32;
  c.sms = 2;
  c.capacity = Capacity::per_expert(4.0);
  run_steps(c, {tokens({64, 37}), tokens({5, 64, 0})}, Routing::Random, 300);
}

// A capacity factor whose bound per peer (MoeConfig::peer_rows()) is below what a random routing sends a peer: each
// source stages its first peer_rows tokens for each peer, the slots of the later ones are dropped at the source and
// counted there, and everything else is the reference plan's (with the same bound) bit for bit.
TEST_P(EpLoopback, PeerRowsBoundKeepsEachSourcesFirstTokensAndReportsTheRest) {
  if (transport() != Transport::HostApi) GTEST_SKIP() << "the host-API transport's staging bound";
  Case c = fit(Case{});
  c.capacity = Capacity::of_factor(0.6);
  run_ranks(R(), [&](Communicator& comm) {
    const int R = comm.size(), me = comm.rank();
    const MoeConfig cfg = config_of(c, R);
    Dispatcher d(cfg, comm, options_of(c));
    ASSERT_EQ(d.peer_rows(), cfg.peer_rows());
    ASSERT_LT(d.peer_rows(), c.t_max);
    const std::int64_t capacity = d.capacity();
    std::vector<std::int64_t> tokens(std::size_t(R), c.t_max);
    tokens[std::size_t(R - 1)] = 7;
    const Step s = draw(c, R, capacity, 900, tokens, Routing::Random);
    Buffers b(c, capacity);
    run_step_once(d, c, b, s, me);
    const Expected e = reference(c, cfg, s, capacity, d.peer_rows());
    expect_overflow_reported(d, me, e.plan.overflow[std::size_t(me)], "routed rows did not fit",
                             e.plan.peer_dropped[std::size_t(me)]);
    EXPECT_EQ(compare(c, e, b, me, s.tokens[std::size_t(me)], capacity), 0) << "rank " << me;
    compare_layout(e, d, me, cfg.local_experts());
    EXPECT_GT(e.plan.peer_dropped[0], 0) << "the test routing must exceed peer_rows";
    EXPECT_EQ(e.plan.peer_dropped[std::size_t(R - 1)], 0) << "7 tokens fit every peer";
  });
}

TEST_P(EpLoopback, SkewedRoutingOverflowsAFactorCapacity) {
  Case c = fit(Case{});
  c.capacity = Capacity::of_factor(0.3);
  run_ranks(R(), [&](Communicator& comm) { check_skewed_overflow(comm, c, 600); });
}

TEST_P(EpLoopback, SkewedRoutingOverflowsAPerExpertCapacity) {
  Case c = fit(Case{});
  c.capacity = Capacity::per_expert(0.5);
  run_ranks(R(), [&](Communicator& comm) { check_skewed_overflow(comm, c, 650); });
}

INSTANTIATE_TEST_SUITE_P(Ranks, EpLoopback,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(Transport::HostApi, Transport::NvLink)),
                         [](const ::testing::TestParamInfo<std::tuple<int, Transport>>& i) {
                           return std::to_string(std::get<0>(i.param)) + "ranks_" +
                                  std::string(std::get<1>(i.param) == Transport::NvLink ? "nvlink" : "host");
                         });

// A rank that does not take part: the others time out of the collective with Error(Timeout), nothing hangs.
TEST(Loopback, MissingRankTimesOut) {
  MOERAIL_REQUIRE_GPU();
  LoopbackGroup group(2, 0.5);
  std::atomic<int> code{-1};
  std::thread t0([&] {
    try {
      testing::cuda_ok(cudaSetDevice(this_device()), "cudaSetDevice");
      Communicator comm(group, 0, this_device());
      ADD_FAILURE() << "a Communicator of a group of 2 was made without rank 1";
    } catch (const Error& e) {
      code = int(e.code());
    }
  });
  t0.join();
  EXPECT_EQ(code.load(), int(ErrorCode::Timeout));
}

TEST(Loopback, CollectivesRefuseGraphCapture) {
  MOERAIL_REQUIRE_GPU();
  run_ranks(1, [](Communicator& comm) {
    DeviceTensor buf(DType::I32, {4});
    cudaStream_t st;
    testing::cuda_ok(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
    testing::cuda_ok(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
    EXPECT_NO_THROW(comm.all_gather_inplace(buf.data(), 16, st, "one rank"));  // nothing to move
    cudaGraph_t g = nullptr;
    testing::cuda_ok(cudaStreamEndCapture(st, &g), "capture");
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(st);
  });
  run_ranks(2, [](Communicator& comm) {
    DeviceTensor buf(DType::I32, {8});
    cudaStream_t st;
    testing::cuda_ok(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
    testing::cuda_ok(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
    try {
      comm.all_gather_inplace(buf.data(), 16, st, "captured gather");
      ADD_FAILURE() << "a loopback collective was captured";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Unsupported);
      EXPECT_NE(std::string(e.what()).find("captured gather"), std::string::npos) << e.what();
    }
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(st, &g);
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(st);
  });
}

}  // namespace
}  // namespace moerail::test::ep_gpu
