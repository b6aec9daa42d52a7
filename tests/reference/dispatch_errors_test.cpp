// The reference dispatch and combine refuse bad arguments, naming them, and write nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "reference/dispatch_harness.h"

namespace moerail {
namespace {

using namespace test::dispatch_ref;  // NOLINT: the harness is these tests' vocabulary

// ---- argument errors: each is reported, and nothing was written --------------------------------------------------

void expect_error(ErrorCode code, const std::string& needle, auto&& call) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

// Output tensors filled with a sentinel, and a check that they still hold it.
struct Untouched {
  std::vector<const PerRank*> outputs;
  explicit Untouched(std::vector<const PerRank*> o) : outputs(std::move(o)) {
    for (const PerRank* ts : outputs)
      for (const HostTensor& t : *ts) t.fill(7.5);
  }
  void check(const std::string& what) const {
    for (const PerRank* ts : outputs)
      for (const HostTensor& t : *ts)
        for (std::int64_t i = 0; i < t.numel(); ++i)
          if (t.f(i) != 7.5) {
            ADD_FAILURE() << what << ": an output was written (element " << i << " = " << t.f(i) << ")";
            return;
          }
  }
};

// The hand-worked routing (R = 2; rank 0 has 3 tokens, rank 1 has 2; capacity 8), H = 3.
struct ErrorFixture {
  Routing r = hand_routing(8);
  std::int64_t H = 3;
  PerRank x = payload_x(r, DType::F32, H), p = payload_probs(r, DType::F32);
  PerRank rows = row_buffers(r, DType::F32, H), row_p = row_prob_buffers(r, DType::F32);
  PerRank y = payload_rows(r, DType::F32, H);
  PerRank tokens = token_tensors(r, DType::F32, H), slot_p = test::per_rank(DType::F32, r.token_counts(), r.K);
  HostTensor small_rows{DType::F32, {7, 3}};      // one row short of the capacity
  HostTensor small_row_p{DType::F32, {7}};
  HostTensor wide_tokens{DType::F32, {3, 4}};     // H = 4
  HostTensor long_tokens{DType::F32, {3, 3}};     // rank 1 has 2 tokens
  HostTensor int_tokens{DType::I32, {2, 3}};
  HostTensor bf16_probs{DType::BF16, {3, 2}};
  HostTensor flat_probs_2d{DType::F32, {8, 1}};
  HostTensor wrong_k{DType::F32, {2, 3}};

  // Replaces rank r's view in a copy of `base`.
  static std::vector<TensorView> with(const PerRank& base, std::size_t rank, const TensorView& v) {
    std::vector<TensorView> out = views(base);
    out[rank] = v;
    return out;
  }
};

TEST(DispatchErrors, ForwardRejectsBadArgumentsBeforeWriting) {
  ErrorFixture f;
  const Untouched outputs({&f.rows, &f.row_p});
  const auto x = views(f.x), p = views(f.p), recv = views(f.rows), recv_p = views(f.row_p);
  using VS = std::vector<TensorView>;
  auto run = [&](const VS& vx, const VS& vp, const VS& vr, const VS& vrp) {
    ref::dispatch_forward(f.r.plan, {.x = vx, .probs = vp, .recv = vr, .recv_probs = vrp});
  };
  const auto inv = ErrorCode::InvalidArgument;
  expect_error(inv, "dispatch_forward: got 1 x views but the plan has 2 ranks", [&] { run({x[0]}, p, recv, recv_p); });
  expect_error(inv, "got 3 recv views", [&] { run(x, p, {recv[0], recv[1], recv[1]}, recv_p); });
  expect_error(inv, "got 1 recv_probs views", [&] { run(x, p, recv, {recv_p[0]}); });
  expect_error(inv, "recv of rank 1 has 7 rows but the plan's capacity is 8 rows",
               [&] { run(x, p, f.with(f.rows, 1, f.small_rows), recv_p); });
  expect_error(inv, "recv_probs of rank 0 has 7 rows but the plan's capacity is 8 rows",
               [&] { run(x, p, recv, f.with(f.row_p, 0, f.small_row_p)); });
  expect_error(inv, "x of rank 1 has shape [3, 3] but [2, 3] was expected",
               [&] { run(f.with(f.x, 1, f.long_tokens), p, recv, recv_p); });
  expect_error(inv, "x of rank 0 has shape [3, 4]", [&] { run(f.with(f.x, 0, f.wide_tokens), p, recv, recv_p); });
  expect_error(inv, "x of rank 1 has dtype i32", [&] { run(f.with(f.x, 1, f.int_tokens), p, recv, recv_p); });
  expect_error(inv, "probs of rank 0 has dtype bf16", [&] { run(x, f.with(f.p, 0, f.bf16_probs), recv, recv_p); });
  expect_error(inv, "probs of rank 1 has shape [2, 3]", [&] { run(x, f.with(f.p, 1, f.wrong_k), recv, recv_p); });
  expect_error(inv, "recv_probs of rank 1 has shape [8, 1]",
               [&] { run(x, p, recv, f.with(f.row_p, 1, f.flat_probs_2d)); });
  expect_error(inv, "recv of rank 1 is on cuda:0", [&] {
    run(x, p, f.with(f.rows, 1, TensorView(f.rows[1].view().data(), DType::F32, {10, 3}, Device::cuda(0))), recv_p);
  });
  expect_error(inv, "probs and recv_probs must be given together", [&] { run(x, p, recv, {}); });
  // NaN or Inf in a routed slot is bad routing input (rank 1, token 0 routes both slots).
  f.p[1].set_f(0 * 2 + 0, kNaN);
  expect_error(ErrorCode::BadRouting, "dispatch_forward: rank 1 probs[0,0] = nan (expected a finite value)",
               [&] { run(x, p, recv, recv_p); });
  f.p[1].set_f(0 * 2 + 0, 0.5);
  f.p[1].set_f(0 * 2 + 1, std::numeric_limits<double>::infinity());
  expect_error(ErrorCode::BadRouting, "rank 1 probs[0,1] = inf", [&] { run(x, p, recv, recv_p); });
  // A plan that does not match itself.
  LayoutPlan broken = f.r.plan;
  broken.dest_row[1].pop_back();
  expect_error(inv, "LayoutPlan is inconsistent", [&] {
    ref::dispatch_forward(broken, {.x = x, .probs = {}, .recv = recv, .recv_probs = {}});
  });
  broken = f.r.plan;
  broken.dest_row[0][0] = std::int32_t(broken.capacity);  // would write one row past the capacity
  expect_error(inv, "LayoutPlan is inconsistent", [&] {
    ref::dispatch_forward(broken, {.x = x, .probs = {}, .recv = recv, .recv_probs = {}});
  });
  broken = f.r.plan;
  broken.segment_rows[1] = 5;  // segment of expert 1 (offset 4) would end past the capacity 8
  expect_error(inv, "LayoutPlan is inconsistent", [&] {
    ref::dispatch_forward(broken, {.x = x, .probs = {}, .recv = recv, .recv_probs = {}});
  });
  outputs.check("dispatch_forward");
}

TEST(DispatchErrors, BackwardRejectsBadArgumentsBeforeWriting) {
  ErrorFixture f;
  const Untouched outputs({&f.tokens, &f.slot_p});
  const auto g = views(f.rows), gp = views(f.row_p), dx = views(f.tokens), dp = views(f.slot_p);
  using VS = std::vector<TensorView>;
  auto run = [&](const VS& a, const VS& b, const VS& c, const VS& d) {
    ref::dispatch_backward(f.r.plan, {.d_recv = a, .d_recv_probs = b, .dx = c, .d_probs = d});
  };
  const auto inv = ErrorCode::InvalidArgument;
  expect_error(inv, "got 1 dx views", [&] { run(g, gp, {dx[0]}, dp); });
  expect_error(inv, "d_recv of rank 0 has 7 rows but the plan's capacity is 8",
               [&] { run(f.with(f.rows, 0, f.small_rows), gp, dx, dp); });
  expect_error(inv, "d_recv_probs of rank 1 has 7 rows", [&] { run(g, f.with(f.row_p, 1, f.small_row_p), dx, dp); });
  expect_error(inv, "dx of rank 1 has shape [3, 3] but [2, 3] was expected",
               [&] { run(g, gp, f.with(f.tokens, 1, f.long_tokens), dp); });
  expect_error(inv, "d_probs of rank 0 has dtype bf16", [&] { run(g, gp, dx, f.with(f.slot_p, 0, f.bf16_probs)); });
  expect_error(inv, "d_recv_probs and d_probs must be given together", [&] { run(g, {}, dx, dp); });
  outputs.check("dispatch_backward");
}

TEST(CombineErrors, ForwardRejectsBadArgumentsBeforeWriting) {
  ErrorFixture f;
  const Untouched outputs({&f.tokens});
  const auto y = views(f.y), p = views(f.p), out = views(f.tokens);
  using VS = std::vector<TensorView>;
  auto run = [&](ProbMode mode, const VS& a, const VS& b, const VS& c) {
    ref::combine_forward(f.r.plan, {.mode = mode, .y = a, .probs = b, .out = c});
  };
  const auto inv = ErrorCode::InvalidArgument;
  const auto in_comb = ProbMode::InCombine;
  expect_error(inv, "combine_forward: ProbMode::InCombine needs probs", [&] { run(in_comb, y, {}, out); });
  expect_error(inv, "got 1 y views", [&] { run(in_comb, {y[1]}, p, out); });
  expect_error(inv, "y of rank 1 has 7 rows but the plan's capacity is 8",
               [&] { run(in_comb, f.with(f.y, 1, f.small_rows), p, out); });
  expect_error(inv, "out of rank 0 has shape [3, 4] but [3, 3] was expected",
               [&] { run(in_comb, y, p, f.with(f.tokens, 0, f.wide_tokens)); });
  expect_error(inv, "probs of rank 1 has shape [2, 3]", [&] { run(in_comb, y, f.with(f.p, 1, f.wrong_k), out); });
  f.p[0].set_f(2 * 2 + 0, -std::numeric_limits<double>::infinity());
  expect_error(ErrorCode::BadRouting, "combine_forward: rank 0 probs[2,0] = -inf", [&] { run(in_comb, y, p, out); });
  expect_error(ErrorCode::BadRouting, "rank 0 probs[2,0]", [&] { run(ProbMode::InActivation, y, p, out); });
  outputs.check("combine_forward");
}

TEST(CombineErrors, BackwardRejectsBadArgumentsBeforeWriting) {
  ErrorFixture f;
  const Untouched outputs({&f.rows, &f.slot_p});
  const auto g = views(f.x), y = views(f.y), p = views(f.p), d_y = views(f.rows), d_p = views(f.slot_p);
  using VS = std::vector<TensorView>;
  auto run = [&](ProbMode mode, const VS& a, const VS& b, const VS& c, const VS& d, const VS& e) {
    ref::combine_backward(f.r.plan, {.mode = mode, .d_out = a, .y = b, .probs = c, .d_y = d, .d_probs = e});
  };
  const auto inv = ErrorCode::InvalidArgument;
  const auto in_comb = ProbMode::InCombine;
  expect_error(inv, "ProbMode::InCombine needs probs", [&] { run(in_comb, g, y, {}, d_y, d_p); });
  expect_error(inv, "d_probs under ProbMode::InCombine needs the forward input y",
               [&] { run(in_comb, g, {}, p, d_y, d_p); });
  expect_error(inv, "d_y of rank 1 has 7 rows but the plan's capacity is 8",
               [&] { run(in_comb, g, y, p, f.with(f.rows, 1, f.small_rows), d_p); });
  expect_error(inv, "d_out of rank 1 has shape [3, 3] but [2, 3] was expected",
               [&] { run(in_comb, f.with(f.x, 1, f.long_tokens), y, p, d_y, d_p); });
  expect_error(inv, "got 3 d_probs views", [&] { run(in_comb, g, y, p, d_y, {d_p[0], d_p[1], d_p[0]}); });
  f.p[1].set_f(0, kNaN);
  expect_error(ErrorCode::BadRouting, "combine_backward: rank 1 probs[0,0] = nan",
               [&] { run(in_comb, g, y, p, d_y, d_p); });
  outputs.check("combine_backward");
}

}  // namespace
}  // namespace moerail
