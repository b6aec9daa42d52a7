// Expert-parallel dispatch/combine on 1..N GPUs (include/moerail/dispatch.h) against the CPU reference over the same
// ranks. The program is its own launcher: run plainly, it spawns one worker process per GPU (MOERAIL_TEST_RANKS
// overrides the count; 1 runs in-process) and fails if any worker fails; each worker runs the same tests as one rank.
// Every rank draws the inputs of every rank from the same seed, so each can compute the whole reference and checks
// its own part: data movement bit-exact, sums within the rounding bound of docs/design.md, pad rows zero.
#include <gtest/gtest.h>

#include "dispatch/ep_harness.h"

namespace moerail::test::ep_gpu {
namespace {

TEST_P(Ep, RandomRoutingUnevenTokens) {
  Case c;
  run_steps(c, {tokens({64, 37}), tokens({5, 64}), tokens({0, 50}), tokens({33, 0})}, Routing::Random, false, 100);
}

// f16 and f32 rows: moved bit for bit, summed within their own rounding bound; H = 136 f16 / 68 f32 is 17 vectors.
TEST_P(Ep, F16AndF32Rows) {
  for (DType t : {DType::F16, DType::F32}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Case c;
    c.dtype = t;
    c.H = t == DType::F16 ? 136 : 68;
    c.mode = ProbMode::InCombine;
    run_steps(c, {tokens({64, 37}), tokens({0, 50})}, Routing::Random, false, 110);
    c.mode = ProbMode::InActivation;
    run_steps(c, {tokens({5, 64}), tokens({33, 0}), tokens({64, 64})}, Routing::Random, true, 120);
  }
}

// Shapes at the edges: K = E / R slots over 12 experts with no alignment and 288-byte f32 rows; long bf16 rows
// (12296 columns, 1537 vectors: three scatter batches and a partial fourth).
TEST_P(Ep, TwelveExpertsAndLongRows) {
  Case c;
  c.dtype = DType::F32;
  c.H = 72;
  c.E = 12;
  c.K = 12 / R() < 3 ? 3 : 12 / R();
  c.A = 1;
  run_steps(c, {tokens({64, 50}), tokens({0, 64})}, Routing::Random, false, 130);
  c = Case{};
  c.H = 12296;
  c.E = 16;
  c.t_max = 32;
  run_steps(c, {tokens({32, 30}), tokens({17, 0})}, Routing::Random, false, 140);
}

// Two blocks: 16 producer warps, so every warp handles several chunks, and sources of different sizes in one step.
TEST_P(Ep, FewBlocks) {
  Case c;
  c.sms = 2;
  run_steps(c, {tokens({64, 5}), tokens({16, 17}), tokens({0, 64}), tokens({1, 33})}, Routing::Random, false, 150);
  c.mode = ProbMode::InCombine;
  std::vector<std::vector<std::int64_t>> steps;
  for (int i = 0; i < 8; ++i) steps.push_back(tokens({(i * 11) % 65, (i * 23 + 9) % 65}));
  run_steps(c, steps, Routing::Random, true, 160);
}

// Fewer tokens than warps: idle warps take column ranges of a token's row (ep::LocalParts): the dispatch's local
// rows, the combine's and the dispatch backward's sums on the owner. H = 4104 is 513 vectors, so the ranges are
// uneven and the last ends mid-batch. 132 blocks give 4 ranges per token; 2 blocks give 2 to 4 at 5 and 8 tokens
// (by the rank count and the transport's warps per role) and one from 17 tokens on. A graph replay moves the token
// counts across those thresholds.
TEST_P(Ep, FewTokensSplitTheirRowsAcrossWarps) {
  Case c;
  c.H = 4104;
  c.K = 8;
  c.E = 16;
  c.t_max = 32;
  run_steps(c, {tokens({5, 32}), tokens({1, 0}), tokens({32, 8})}, Routing::Random, false, 800);
  c.sms = 2;
  run_steps(c, {tokens({5, 8}), tokens({8, 17}), tokens({0, 5})}, Routing::OneRank, false, 810);
  std::vector<std::vector<std::int64_t>> steps;
  for (int i = 0; i < 6; ++i) steps.push_back(tokens({(i * 7) % 33, (i * 5 + 3) % 33}));
  run_steps(c, steps, Routing::Random, true, 820);
}

// Every SM for the data kernels while a collective of another stream (a data-parallel all-reduce beside the
// backward) holds some of them on rank 0 and waits for rank 1, which launched its data kernels first and holds all
// of its SMs. Rank 0's blocks that cannot be resident wait for the all-reduce, which needs rank 1's all-reduce,
// which needs SMs on rank 1. Every wait on a peer pairs blocks of the same index (ep::RemoteWork), so only rank 1's
// partners of the missing blocks wait; the others finish and free SMs for rank 1's all-reduce. A design in which
// every block of rank 1 could wait for one of the missing blocks hangs here until the spin-wait timeout and fails
// the check. (At R = 2 the pairing held before RemoteWork spread chunks over blocks too; the test guards the
// all-SM default. Whether rank 0's blocks were in fact kept out is not checked: the all-reduce's CTAs, 96
// registers x 512+ threads, cannot share an SM with a data-kernel block of 512 threads x 95-128 registers.)
TEST_P(Ep, EverySmBesideACollectiveThatWaitsForThePeer) {
  if (R() < 2) GTEST_SKIP() << "needs two ranks";
  // HostApi's send/recv and the all-reduce would share one communicator in a different order on the two ranks
  // (NCCL needs one order); its kernels never wait on a peer's SMs anyway.
  if (GetParam() != Transport::NvLink) GTEST_SKIP() << "NvLink path only";
  Case c;
  c.H = 1024;
  c.t_max = 4096;  // 2048 two-token chunks per source: work for every producer warp of every block
  c.transport = GetParam();
  int sms = 0;
  testing::cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g_comm->device()), "attribute");
  c.sms = sms;
  const MoeConfig cfg = config_of(c, R());
  Dispatcher d(cfg, *g_comm, options_of(c, 10));
  const std::int64_t capacity = d.capacity();
  Buffers b(c, capacity);
  const Step s = draw(c, R(), capacity, 700, tokens({4096, 3000}), Routing::Random);
  b.upload(s, me());
  cudaStream_t stream, coll;
  testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  testing::cuda_ok(cudaStreamCreateWithFlags(&coll, cudaStreamNonBlocking), "stream");
  b.run(d, c.mode, stream);  // a first step outside the scenario (the planner's count exchange, warm kernels)
  testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
  b.upload(s, me());
  const std::size_t n = std::size_t(64) << 20;  // 256 MB of f32: the all-reduce spans the whole scenario
  DeviceTensor grads(DType::F32, {std::int64_t(n)});
  testing::cuda_ok(cudaMemset(grads.data(), 0, n * 4), "memset");
  auto all_reduce = [&] {
    ASSERT_EQ(ncclAllReduce(grads.data(), grads.data(), n, ncclFloat, ncclSum,
                            static_cast<ncclComm_t>(g_comm->nccl_comm()), coll),
              ncclSuccess);
  };
  all_reduce();  // NCCL connects a collective's peers on its first call, on the host of both ranks: not in the scenario
  testing::cuda_ok(cudaStreamSynchronize(coll), "sync");
  const auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); };
  // Each kernel shape in turn is the one the collective meets: the whole step starts with the scatter kernel
  // (no shared memory), a combine alone is the gather kernel (192 KB of shared memory per block).
  auto scenario = [&](const char* what, const std::function<void()>& ops) {
    if (me() == 0) {
      all_reduce();  // resident and waiting for rank 1 before the data kernels arrive
      pause();
      ops();
    } else {
      ops();  // every SM, waiting for rank 0's data
      pause();
      all_reduce();
    }
    testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
    testing::cuda_ok(cudaStreamSynchronize(coll), "sync");
    EXPECT_NO_THROW(d.check(stream)) << what;
  };
  scenario("whole step", [&] { b.run(d, c.mode, stream); });
  scenario("combine", [&] { d.combine({c.mode, b.y.view(), b.out.view()}, stream); });
  const Expected e = reference(c, cfg, s, capacity);
  EXPECT_EQ(compare(c, e, b, me(), s.tokens[std::size_t(me())], capacity), 0);
  cudaStreamDestroy(coll);
  cudaStreamDestroy(stream);
}

TEST_P(Ep, NoAlignmentAndInCombineProbs) {
  Case c;
  c.A = 1;
  c.mode = ProbMode::InCombine;
  run_steps(c, {tokens({64, 64}), tokens({17, 3})}, Routing::Random, false, 200);
}

TEST_P(Ep, HiddenNotAMultipleOf64AndAlign128) {
  Case c;
  c.H = 136;
  c.A = 128;
  c.mode = ProbMode::InCombine;
  run_steps(c, {tokens({40, 64}), tokens({1, 1})}, Routing::Random, false, 300);
}

// Top-8 with 16 experts and wide rows: a token's summed rows (up to 8 on one rank) exceed one shared-memory landing
// wave of the gather (6 rows), so own rows fall into a second wave; H = 4224 makes rows longer than one gather batch
// (528 vectors, 128 per batch) and than one scatter batch (512 vectors). OneRank puts all 8 slots on one rank.
TEST_P(Ep, TopK8WideRowsAndManyRowsPerRank) {
  Case c;
  c.H = 4224;
  c.E = 16;
  c.K = 8;
  c.t_max = 32;
  run_steps(c, {tokens({32, 20}), tokens({7, 32})}, Routing::Random, false, 600);
  c.mode = ProbMode::InCombine;
  run_steps(c, {tokens({32, 32}), tokens({0, 17})}, Routing::OneRank, false, 610);
}

// More experts than the planner kernel's 256 threads: its prefix sums are carried over three tiles of experts, and
// at R > 1 a rank's first expert lies inside a later tile.
TEST_P(Ep, ManyExpertsPlannedInSeveralTiles) {
  Case c;
  c.E = 520;
  c.K = 8;
  run_steps(c, {tokens({64, 37}), tokens({0, 64}), tokens({3, 3})}, Routing::Random, false, 700);
}

TEST_P(Ep, AllTokensToOneExpert) {
  Case c;
  run_steps(c, {tokens({64, 64}), tokens({0, 64})}, Routing::OneExpert, false, 400);
}

TEST_P(Ep, GraphReplayWithNewRoutingsAndTokenCounts) {
  Case c;
  c.mode = ProbMode::InCombine;
  std::vector<std::vector<std::int64_t>> steps;
  for (int i = 0; i < 21; ++i) steps.push_back(tokens({(i * 13) % 65, (i * 29 + 7) % 65}));
  steps[3] = tokens({0, 0});
  steps[7] = tokens({64, 0});
  run_steps(c, steps, Routing::Random, true, 500);
}

// Capacity::PerExpert too small for a skewed routing: each expert keeps its first rows (the reference's plan, bit for
// bit), the rank whose experts overflow says so with the counts, per expert, and names itself.
TEST_P(Ep, PerExpertCapacityOverflowIsReportedWithItsCounts) {
  Case c;
  c.capacity = Capacity::per_expert(0.5);
  c.transport = GetParam();
  check_skewed_overflow(*g_comm, c, 650);
}

TEST_P(Ep, PerExpertCapacityThatFits) {
  Case c;
  c.capacity = Capacity::per_expert(2.0);
  run_steps(c, {tokens({64, 37}), tokens({5, 64})}, Routing::Random, false, 670);
}

// Factor capacity too small for the routing: the overflowing rank says so, names itself, and nothing is written
// past the buffers (they are exactly capacity rows: a write beyond would fault or corrupt the guard check below).
TEST_P(Ep, CapacityOverflowIsReportedByTheOverflowingRank) {
  Case c;
  c.capacity = Capacity::of_factor(0.3);
  c.transport = GetParam();
  check_skewed_overflow(*g_comm, c, 600);
}

// An expert id outside [-1, E) on one rank: that slot is skipped everywhere and the rank's check() says so.
TEST_P(Ep, BadExpertIdIsReportedAndSkipped) {
  Case c;
  c.transport = GetParam();
  const MoeConfig cfg = config_of(c, R());
  DispatchOptions opts;
  opts.transport = c.transport;
  Dispatcher d(cfg, *g_comm, opts);
  const std::int64_t capacity = d.capacity();
  Step s = draw(c, R(), capacity, 700, tokens({64, 64}), Routing::Random);
  s.topk[0].set_i(5 * c.K + 1, 999);
  Buffers b(c, capacity);
  b.upload(s, me());
  b.run(d, c.mode, nullptr);
  testing::cuda_ok(cudaDeviceSynchronize(), "sync");
  if (me() == 0) {
    try {
      d.check(nullptr);
      ADD_FAILURE() << "check() passed with expert id 999";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), ErrorCode::BadRouting);
      EXPECT_NE(std::string(err.what()).find("topk_idx[5,1] = 999"), std::string::npos) << err.what();
    }
  } else {
    EXPECT_NO_THROW(d.check(nullptr));
  }
  s.topk[0].set_i(5 * c.K + 1, -1);  // the reference of a skipped slot
  const Expected e = reference(c, cfg, s, capacity);
  EXPECT_EQ(compare(c, e, b, me(), 64, capacity), 0);
}

}  // namespace

std::unique_ptr<Communicator> g_comm;

INSTANTIATE_TEST_SUITE_P(Transports, Ep, ::testing::Values(Transport::NvLink, Transport::HostApi),
                         [](const auto& info) { return std::string(transport_name(info.param)); });

}  // namespace moerail::test::ep_gpu

int main(int argc, char** argv) {
  return moerail::testing::multigpu_main(argc, argv, "ep_test", moerail::test::ep_gpu::g_comm);
}
