// Dispatch handles on 1..N GPUs: several microbatches in flight (eager and in one captured graph) give the bytes of
// each alone; a dispatch planned first (plan()) takes buffers of exactly its rows; misuse of handles is refused.
#include <gtest/gtest.h>

#include "dispatch/ep_harness.h"

namespace moerail::test::ep_gpu {
namespace {

// Several microbatches in flight, each with its own handle: k dispatches (and their combines) before any backward,
// the combines out of order, the backward passes in reverse and in shuffled order, eagerly and as one captured graph
// replayed with new inputs. Every output buffer, whole, is the same bytes as the same microbatch run alone (one step
// at a time over the default handle), which is checked against the reference.
// As rank comm.rank() over `transport`; graph: also as one captured graph replayed with new inputs.
void check_microbatches_in_flight(Communicator& comm, Transport transport, bool graph) {
  const int R = comm.size(), me = comm.rank();
  const auto tokens = [&](std::initializer_list<std::int64_t> per_rank) {
    std::vector<std::int64_t> v(per_rank);
    v.resize(std::size_t(R), v.back());
    return v;
  };
  constexpr int kMicro = 4;
  for (const ProbMode mode : {ProbMode::InActivation, ProbMode::InCombine}) {
    Case c;
    c.mode = mode;
    c.transport = transport;
    c.E = (c.E + R - 1) / R * R;
    const MoeConfig cfg = config_of(c, R);
    Dispatcher d(cfg, comm, options_of(c));
    const std::int64_t capacity = d.capacity();
    std::vector<std::unique_ptr<Buffers>> mb;
    std::vector<DeviceTensor> memory;
    std::vector<DispatchHandle> handles;
    for (int i = 0; i < kMicro; ++i) {
      mb.push_back(std::make_unique<Buffers>(c, capacity));
      memory.emplace_back(DType::Bool, std::vector<std::int64_t>{std::int64_t(d.handle_bytes())});
      handles.push_back(d.make_handle(memory.back().view()));
    }
    cudaStream_t stream;
    testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    // the inputs of round `round`: microbatch i gets its own token counts and routing
    auto inputs = [&](int round) {
      std::vector<Step> steps;
      for (int i = 0; i < kMicro; ++i)
        steps.push_back(draw(c, R, capacity, 1000 + 100 * std::uint64_t(round) + std::uint64_t(i),
                             tokens({(17 * i + 29 * round + 5) % 65, (23 * i + 11 * round) % 65}), Routing::Random));
      return steps;
    };
    // one at a time, checked against the reference: the bytes every other order must give
    auto alone = [&](const std::vector<Step>& steps) {
      std::vector<std::vector<std::vector<char>>> want;
      for (int i = 0; i < kMicro; ++i) {
        mb[std::size_t(i)]->upload(steps[std::size_t(i)], me);
        mb[std::size_t(i)]->run(d, mode, stream);
        testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
        EXPECT_NO_THROW(d.check(stream));
        const Expected e = reference(c, cfg, steps[std::size_t(i)], capacity, d.peer_rows());
        const std::int64_t T = steps[std::size_t(i)].tokens[std::size_t(me)];
        EXPECT_EQ(compare(c, e, *mb[std::size_t(i)], me, T, capacity), 0) << "microbatch " << i << " alone";
        want.push_back(mb[std::size_t(i)]->outputs());
      }
      return want;
    };
    const std::vector<int> combine_order{1, 0, 3, 2};
    auto in_flight = [&](const std::vector<int>& backward_order) {
      for (int i = 0; i < kMicro; ++i) mb[std::size_t(i)]->dispatch(d, handles[std::size_t(i)], stream);
      for (int i : combine_order) mb[std::size_t(i)]->combine(d, mode, handles[std::size_t(i)], stream);
      for (int i : backward_order) mb[std::size_t(i)]->backward(d, mode, handles[std::size_t(i)], stream);
    };
    auto expect_same = [&](const std::vector<std::vector<std::vector<char>>>& want, const char* what) {
      for (int i = 0; i < kMicro; ++i) {
        const auto got = mb[std::size_t(i)]->outputs();
        for (std::size_t o = 0; o < got.size(); ++o)
          EXPECT_TRUE(got[o] == want[std::size_t(i)][o])
              << what << ": microbatch " << i << " output " << o << " differs from the microbatch alone";
      }
    };
    for (const auto& order : {std::vector<int>{3, 2, 1, 0}, std::vector<int>{2, 0, 3, 1}}) {
      const std::vector<Step> steps = inputs(order[0]);
      const auto want = alone(steps);
      for (int i = 0; i < kMicro; ++i) mb[std::size_t(i)]->upload(steps[std::size_t(i)], me);
      in_flight(order);
      testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
      EXPECT_NO_THROW(d.check(stream));
      expect_same(want, order[0] == 3 ? "backward in reverse" : "backward shuffled");
    }
    if (!graph) {
      cudaStreamDestroy(stream);
      continue;
    }
    // one graph of all four in flight, replayed with new inputs
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    testing::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
    in_flight({2, 0, 3, 1});
    testing::cuda_ok(cudaStreamEndCapture(stream, &g), "capture");
    testing::cuda_ok(cudaGraphInstantiate(&exec, g, 0), "instantiate");
    for (int round = 5; round < 8; ++round) {
      const std::vector<Step> steps = inputs(round);
      const auto want = alone(steps);
      for (int i = 0; i < kMicro; ++i) mb[std::size_t(i)]->upload(steps[std::size_t(i)], me);
      testing::cuda_ok(cudaGraphLaunch(exec, stream), "replay");
      testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
      EXPECT_NO_THROW(d.check(stream));
      expect_same(want, "graph replay");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    cudaStreamDestroy(stream);
  }
}

TEST_P(Ep, MicrobatchesInFlightMatchOneAtATime) { check_microbatches_in_flight(*g_comm, GetParam(), true); }

// The same over 2 to 4 in-process ranks (LoopbackGroup) on this GPU, both transports (the host API eagerly: each
// handle keeps its own staging places).
TEST(EpHandlesLoopback, MicrobatchesInFlightMatchOneAtATime) {
  MOERAIL_REQUIRE_GPU();
  for (const Transport t : {Transport::HostApi, Transport::NvLink}) {
    for (int R = 2; R <= 4; ++R) {
      SCOPED_TRACE(std::to_string(R) + " in-process ranks, " + std::string(transport_name(t)));
      run_ranks(R, [t](Communicator& comm) { check_microbatches_in_flight(comm, t, t == Transport::NvLink); });
    }
  }
}

// plan() then dispatch(): the ops take buffers of exactly the planned rows (views of that many rows: the rows past
// them keep their poison) and give the bytes of a dispatch that plans itself, whose results the other cases check
// against the reference; the rows are the reference plan's. Misuse is refused: another op between plan() and the
// dispatch, other routing than the plan's, a buffer shorter than the plan.
TEST_P(Ep, PlannedDispatchTakesBuffersOfExactlyItsRows) {
  for (const ProbMode mode : {ProbMode::InActivation, ProbMode::InCombine}) {
    Case c;
    c.mode = mode;
    c.transport = GetParam();
    const MoeConfig cfg = config_of(c, R());
    Dispatcher d(cfg, *g_comm, options_of(c));
    const std::int64_t capacity = d.capacity();
    Buffers whole(c, capacity), exact(c, capacity);
    DeviceTensor mem(DType::Bool, {std::int64_t(d.handle_bytes())});
    DispatchHandle h = d.make_handle(mem.view());
    cudaStream_t stream;
    testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    const std::vector<std::vector<std::int64_t>> steps{tokens({64, 37}), tokens({0, 50}), tokens({33, 0}),
                                                       tokens({64, 64})};
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const Step s = draw(c, R(), capacity, 3000 + i, steps[i], Routing::Random);
      whole.upload(s, me());
      whole.dispatch(d, h, stream);
      whole.combine(d, mode, h, stream);
      whole.backward(d, mode, h, stream);
      testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
      EXPECT_EQ(h.layout().capacity, capacity) << "a dispatch that plans itself takes capacity() rows";
      const auto want = whole.outputs();

      exact.upload(s, me());
      const std::int64_t rows = d.plan({exact.topk.view(), exact.probs.view(), exact.num_tokens.view()}, h, stream);
      const Expected e = reference(c, cfg, s, capacity);
      EXPECT_EQ(rows, e.plan.rows_used[std::size_t(me())]) << "step " << i;
      EXPECT_EQ(h.layout().capacity, rows);
      exact.dispatch(d, h, stream, rows);
      exact.combine(d, mode, h, stream, rows);
      exact.backward(d, mode, h, stream, rows);
      testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
      EXPECT_NO_THROW(d.check(stream));
      const auto got = exact.outputs();
      for (std::size_t o = 0; o < got.size(); ++o)
        EXPECT_TRUE(got[o] == want[o]) << "step " << i << ", output " << o << ": the planned dispatch over " << rows
                                       << " rows differs from the dispatch that plans itself";
    }

    auto refused = [&](const std::function<void()>& f, const std::string& needle, const char* what) {
      try {
        f();
        ADD_FAILURE() << what << " was accepted";
      } catch (const Error& err) {
        EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << what << ": " << err.what();
      }
    };
    const EpPlanArgs routing{exact.topk.view(), exact.probs.view(), exact.num_tokens.view()};
    std::int64_t rows = d.plan(routing, h, stream);  // the last step's routing: rows on every rank
    ASSERT_GT(rows, 0);
    refused([&] { exact.dispatch(d, h, stream, rows - 1); }, "recv has", "a recv shorter than the plan");
    rows = d.plan(routing, h, stream);
    refused([&] { whole.dispatch(d, h, stream, rows); }, "planned with", "other routing than the plan's");
    rows = d.plan(routing, h, stream);
    DeviceTensor mem2(DType::Bool, {std::int64_t(d.handle_bytes())});
    DispatchHandle other = d.make_handle(mem2.view());
    whole.dispatch(d, other, stream);  // a dispatch of another microbatch (it plans itself)
    refused([&] { exact.dispatch(d, h, stream, rows); }, "plan it again", "another op between plan() and dispatch()");
    testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
    cudaStreamDestroy(stream);
  }
}

// Handles are checked: an empty one, one of another Dispatcher, one no dispatch filled, too little memory.
TEST_P(Ep, HandlesAreChecked) {
  Case c;
  c.transport = GetParam();
  const MoeConfig cfg = config_of(c, R());
  DispatchOptions opts;
  opts.transport = c.transport;
  Dispatcher d(cfg, *g_comm, opts), other(cfg, *g_comm, opts);
  Buffers b(c, d.capacity());
  DeviceTensor mem(DType::Bool, {std::int64_t(d.handle_bytes())});
  auto refused = [&](const std::function<void()>& f, const std::string& needle, const char* what) {
    try {
      f();
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << what << ": " << err.what();
    }
  };
  DispatchHandle empty;
  refused([&] { b.dispatch(d, empty, nullptr); }, "handle is empty", "an empty handle");
  DispatchHandle theirs = other.make_handle(mem.view());
  refused([&] { b.dispatch(d, theirs, nullptr); }, "another Dispatcher", "another Dispatcher's handle");
  DispatchHandle fresh = d.make_handle(mem.view());
  refused([&] { b.combine(d, c.mode, fresh, nullptr); }, "holds no dispatch", "a handle no dispatch filled");
  refused([&] { b.backward(d, c.mode, fresh, nullptr); }, "holds no dispatch", "a handle no dispatch filled");
  const TensorView small(mem.data(), DType::Bool, {std::int64_t(d.handle_bytes()) - 256}, mem.view().device());
  refused([&] { (void)d.make_handle(small); }, "handle_bytes()", "too little memory");
}

}  // namespace
}  // namespace moerail::test::ep_gpu
