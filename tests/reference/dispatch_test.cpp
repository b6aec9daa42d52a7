// Tests of the CPU dispatch and combine references (moerail/reference/dispatch.h), forward and backward.
//
// Expected values come from test::expected_layout (a sorted model of the contract), not from the plan the ops
// are given, so a planner bug shows up here too. Outputs are poisoned (NaN) before each run: a row that should
// have been written and was not, or a row that should not have been written and was, fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "moerail/config.h"
#include "moerail/error.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/host.h"
#include "moerail/reference/layout.h"
#include "reference/routing_fixtures.h"

namespace moerail {
namespace {

using ref::HostTensor;
using ref::LayoutPlan;
using ref::Rng;
using test::PerRank;
using test::views;

constexpr std::int64_t kSlack = 2;  // extra buffer rows beyond the capacity: must never be written

// ---- routing set-ups ------------------------------------------------------------------------------------------

struct Case {
  std::int64_t E, K, R, A;
};

// E in {7, 16, 256}, K in {1, 2, 5, 8}, R in {1, 2, 4, 8}, A in {1, 16, 32, 128, 256}, where valid
// (K <= E, E % R == 0).
std::vector<Case> sweep_cases() {
  std::vector<Case> cases;
  for (std::int64_t E : {7, 16, 256})
    for (std::int64_t K : {1, 2, 5, 8})
      for (std::int64_t R : {1, 2, 4, 8})
        for (std::int64_t A : {1, 16, 32, 128, 256})
          if (K <= E && E % R == 0) cases.push_back({E, K, R, A});
  return cases;
}

struct Routing {
  MoeConfig cfg;
  PerRank idx;
  LayoutPlan plan;
  test::ExpectedLayout model;
  std::int64_t R = 0, K = 0;
  std::int64_t tokens(std::int64_t s) const { return idx[std::size_t(s)].view().size(0); }
  std::int64_t buffer_rows() const { return plan.capacity + kSlack; }
  std::int64_t rows_used(std::int64_t d) const {  // from the model
    return std::min(model.rows_needed[std::size_t(d)], plan.capacity);
  }
  std::vector<std::int64_t> token_counts() const {
    std::vector<std::int64_t> t;
    for (std::int64_t s = 0; s < R; ++s) t.push_back(tokens(s));
    return t;
  }
  // Which slot (s, t, k) the model puts at each row of rank d's buffer; s = -1 for a row no slot lands on.
  struct Source {
    std::int64_t s = -1, t = -1, k = -1;
  };
  std::vector<Source> sources(std::int64_t d) const {
    std::vector<Source> src(static_cast<std::size_t>(buffer_rows()));
    for (std::int64_t s = 0; s < R; ++s)
      for (std::int64_t t = 0; t < tokens(s); ++t)
        for (std::int64_t k = 0; k < K; ++k)
          if (model.rank[std::size_t(s)][std::size_t(t * K + k)] == d)
            src[std::size_t(model.row[std::size_t(s)][std::size_t(t * K + k)])] = {s, t, k};
    return src;
  }
  // Model destination of slot (s, t, k): rank -1 when unrouted or dropped.
  std::int64_t dest_rank(std::int64_t s, std::int64_t t, std::int64_t k) const {
    return model.rank[std::size_t(s)][std::size_t(t * K + k)];
  }
  std::int64_t dest_row(std::int64_t s, std::int64_t t, std::int64_t k) const {
    return model.row[std::size_t(s)][std::size_t(t * K + k)];
  }
};

MoeConfig dispatch_config(const Case& c, std::int64_t t_max, Capacity capacity = Capacity::worst_case()) {
  MoeConfig cfg;
  cfg.num_experts = c.E;
  cfg.topk = c.K;
  cfg.ep_size = c.R;
  cfg.align = c.A;
  cfg.max_tokens = t_max;
  cfg.hidden = 3;
  cfg.capacity = capacity;
  return cfg;
}

Routing make_routing(const MoeConfig& cfg, PerRank idx, std::int64_t capacity = -1) {
  Routing r;
  r.cfg = cfg;
  r.idx = std::move(idx);
  r.R = cfg.ep_size;
  r.K = cfg.topk;
  const std::vector<TensorView> v = views(r.idx);
  r.plan = ref::plan_layout(cfg, v, capacity);
  r.model = test::expected_layout(r.idx, cfg.num_experts, cfg.align, r.plan.capacity);
  return r;
}

Routing random_routing(const Case& c, Rng& rng, std::int64_t t_max, double unrouted) {
  const MoeConfig cfg = dispatch_config(c, t_max);
  return make_routing(cfg, test::random_routing(rng, test::random_tokens(rng, c.R, t_max), c.E, c.K, unrouted));
}

// ---- payloads -------------------------------------------------------------------------------------------------

// x[s][t, h] says where it came from; exact in f32 for s < 256, t < 1024, h < 64.
double token_payload(std::int64_t s, std::int64_t t, std::int64_t h) { return double(1 + h + 64 * t + 65536 * s); }
// probs[s][t, k], likewise exact in f32 (a multiple of 2^-10 below 2^14).
double prob_payload(std::int64_t s, std::int64_t t, std::int64_t k) {
  return double(1 + k + 16 * t + 16384 * s) / 1024.0;
}
// A value per (rank, row, column) of a destination buffer (expert outputs y, gradients d_recv).
double row_payload(std::int64_t d, std::int64_t row, std::int64_t h) {
  return double(1 + h) * 0.25 + double(row) + 0.125 * double(d);
}

// [T_s, H] per source rank.
PerRank token_tensors(const Routing& r, DType dtype, std::int64_t H) {
  return test::per_rank(dtype, r.token_counts(), H);
}

PerRank payload_x(const Routing& r, DType dtype, std::int64_t H) {
  PerRank x = token_tensors(r, dtype, H);
  for (std::int64_t s = 0; s < r.R; ++s)
    for (std::int64_t t = 0; t < r.tokens(s); ++t)
      for (std::int64_t h = 0; h < H; ++h) x[std::size_t(s)].set_f(t * H + h, token_payload(s, t, h));
  return x;
}

PerRank payload_probs(const Routing& r, DType dtype) {
  PerRank p = test::per_rank(dtype, r.token_counts(), r.K);
  for (std::int64_t s = 0; s < r.R; ++s)
    for (std::int64_t t = 0; t < r.tokens(s); ++t)
      for (std::int64_t k = 0; k < r.K; ++k) p[std::size_t(s)].set_f(t * r.K + k, prob_payload(s, t, k));
  return p;
}

PerRank row_buffers(const Routing& r, DType dtype, std::int64_t H) {
  return test::per_rank(dtype, std::vector<std::int64_t>(std::size_t(r.R), r.buffer_rows()), H);
}

PerRank row_prob_buffers(const Routing& r, DType dtype) {
  return test::per_rank_1d(dtype, std::size_t(r.R), r.buffer_rows());
}

PerRank payload_rows(const Routing& r, DType dtype, std::int64_t H) {
  PerRank y = row_buffers(r, dtype, H);
  for (std::int64_t d = 0; d < r.R; ++d)
    for (std::int64_t row = 0; row < r.buffer_rows(); ++row)
      for (std::int64_t h = 0; h < H; ++h) y[std::size_t(d)].set_f(row * H + h, row_payload(d, row, h));
  return y;
}

void poison(const PerRank& tensors) {
  for (const HostTensor& t : tensors) t.fill_nan();
}

// Uniform in [-1, 1): cheaper than normal draws on the large padded buffers, and just as good here.
void fill_random(const PerRank& tensors, Rng& rng) {
  for (const HostTensor& t : tensors) ref::fill_uniform(t, rng, -1.0, 1.0);
}

// Sum over ranks of <a, b>, in double.
double dot(const PerRank& a, const PerRank& b) {
  double sum = 0.0;
  for (std::size_t r = 0; r < a.size(); ++r)
    for (std::int64_t i = 0; i < a[r].numel(); ++i) sum += a[r].f(i) * b[r].f(i);
  return sum;
}

double abs_dot(const PerRank& a, const PerRank& b) {
  double sum = 0.0;
  for (std::size_t r = 0; r < a.size(); ++r)
    for (std::int64_t i = 0; i < a[r].numel(); ++i) sum += std::abs(a[r].f(i) * b[r].f(i));
  return sum;
}

// ---- op wrappers: keep the view vectors alive for the call -----------------------------------------------------

void dispatch(const LayoutPlan& plan, const PerRank& x, const PerRank& probs, const PerRank& recv,
              const PerRank& recv_probs) {
  const auto vx = views(x), vp = views(probs), vr = views(recv), vrp = views(recv_probs);
  ref::dispatch_forward(plan, {.x = vx, .probs = vp, .recv = vr, .recv_probs = vrp});
}

void dispatch_bwd(const LayoutPlan& plan, const PerRank& d_recv, const PerRank& d_recv_probs, const PerRank& dx,
                  const PerRank& d_probs) {
  const auto a = views(d_recv), b = views(d_recv_probs), c = views(dx), d = views(d_probs);
  ref::dispatch_backward(plan, {.d_recv = a, .d_recv_probs = b, .dx = c, .d_probs = d});
}

void combine(const LayoutPlan& plan, ProbMode mode, const PerRank& y, const PerRank& probs, const PerRank& out) {
  const auto vy = views(y), vp = views(probs), vo = views(out);
  ref::combine_forward(plan, {.mode = mode, .y = vy, .probs = vp, .out = vo});
}

void combine_bwd(const LayoutPlan& plan, ProbMode mode, const PerRank& d_out, const PerRank& y, const PerRank& probs,
                 const PerRank& d_y, const PerRank& d_probs) {
  const auto a = views(d_out), b = views(y), c = views(probs), d = views(d_y), e = views(d_probs);
  ref::combine_backward(plan, {.mode = mode, .d_out = a, .y = b, .probs = c, .d_y = d, .d_probs = e});
}

// ---- checks ---------------------------------------------------------------------------------------------------

// Where an element sits: "<name> of rank <rank> [<row>,<col>]" (col < 0: no column).
struct At {
  const char* name;
  std::int64_t rank, row, col = -1;
};

std::ostream& operator<<(std::ostream& os, const At& a) {
  os << a.name << " of rank " << a.rank << " [" << a.row;
  if (a.col >= 0) os << "," << a.col;
  return os << "]";
}

// Counts mismatches and reports the first few with their indices.
class Mismatches {
 public:
  void check(bool ok, const At& where, double got, double want) {
    if (ok) return;
    if (++count_ <= 8) ADD_FAILURE() << where << ": got " << got << ", expected " << want;
  }
  // Exact comparison; an expected NaN means "left untouched by the op" (the poison is still there).
  void expect(double got, double want, const At& where) {
    check(got == want || (std::isnan(want) && std::isnan(got)), where, got, want);
  }
  ~Mismatches() { EXPECT_EQ(count_, 0) << "mismatching elements in total"; }

 private:
  int count_ = 0;
};

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Each row of rank d's receive buffer: the routed token's payload, or 0 in a pad row, or untouched (NaN) at and
// beyond rows_used. probs likewise. All bit-exact.
void expect_received(const Routing& r, const PerRank& recv, const PerRank& recv_probs, std::int64_t H) {
  Mismatches bad;
  for (std::int64_t d = 0; d < r.R; ++d) {
    const auto src = r.sources(d);
    for (std::int64_t row = 0; row < r.buffer_rows(); ++row) {
      const auto& o = src[std::size_t(row)];
      const bool inside = row < r.rows_used(d);
      for (std::int64_t h = 0; h < H; ++h) {
        const double want = !inside ? kNaN : o.s < 0 ? 0.0 : token_payload(o.s, o.t, h);
        bad.expect(recv[std::size_t(d)].f(row * H + h), want, At{"recv", d, row, h});
      }
      if (!recv_probs.empty()) {
        const double want = !inside ? kNaN : o.s < 0 ? 0.0 : prob_payload(o.s, o.t, o.k);
        bad.expect(recv_probs[std::size_t(d)].f(row), want, At{"recv_probs", d, row});
      }
    }
  }
}

// ---- dispatch forward -----------------------------------------------------------------------------------------

// The hand-worked routing of layout_test.cpp (R = 2, E = 4, K = 2, A = 2):
//   rank 0: t0 -> {0, 2}, t1 -> {1, 0}, t2 -> {3, -1};   rank 1: t0 -> {2, 0}, t1 -> {-1, -1}
// Rank 0 receives rows [x0[t0], x0[t1], x1[t0], pad, x0[t1], pad]; rank 1 [x0[t0], x1[t0], x0[t2], pad].
Routing hand_routing(std::int64_t capacity) {
  PerRank idx = test::per_rank(DType::I32, {3, 2}, 2);
  const std::int32_t r0[] = {0, 2, 1, 0, 3, -1}, r1[] = {2, 0, -1, -1};
  for (int i = 0; i < 6; ++i) idx[0].set_i(i, r0[i]);
  for (int i = 0; i < 4; ++i) idx[1].set_i(i, r1[i]);
  return make_routing(dispatch_config({4, 2, 2, 2}, 3), std::move(idx), capacity);
}

TEST(Dispatch, HandWorkedExample) {
  const Routing r = hand_routing(8);
  const std::int64_t H = 2;
  const PerRank x = payload_x(r, DType::F32, H), p = payload_probs(r, DType::F32);
  const PerRank recv = row_buffers(r, DType::F32, H), recv_p = row_prob_buffers(r, DType::F32);
  poison(recv);
  poison(recv_p);
  dispatch(r.plan, x, p, recv, recv_p);
  auto row_is = [&](std::int64_t d, std::int64_t row, double first) {
    EXPECT_EQ(recv[std::size_t(d)].f(row * H), first) << "rank " << d << " row " << row;
  };
  row_is(0, 0, token_payload(0, 0, 0));
  row_is(0, 1, token_payload(0, 1, 0));
  row_is(0, 2, token_payload(1, 0, 0));
  row_is(0, 3, 0.0);
  row_is(0, 4, token_payload(0, 1, 0));
  row_is(0, 5, 0.0);
  EXPECT_TRUE(std::isnan(recv[0].f(6 * H))) << "row 6 of rank 0 is beyond rows_used and must stay untouched";
  row_is(1, 0, token_payload(0, 0, 0));
  row_is(1, 1, token_payload(1, 0, 0));
  row_is(1, 2, token_payload(0, 2, 0));
  row_is(1, 3, 0.0);
  EXPECT_EQ(recv_p[0].f(4), prob_payload(0, 1, 0));
  EXPECT_EQ(recv_p[1].f(1), prob_payload(1, 0, 0));
  EXPECT_EQ(recv_p[1].f(3), 0.0);
  expect_received(r, recv, recv_p, H);
}

TEST(Dispatch, ForwardMovesEveryRowBitExactlyAcrossTheSweep) {
  Rng rng(21);
  const std::int64_t H = 3;
  for (const Case& c : sweep_cases()) {
    SCOPED_TRACE(testing::Message() << "E=" << c.E << " K=" << c.K << " R=" << c.R << " A=" << c.A);
    const Routing r = random_routing(c, rng, 12, 0.1);
    const PerRank x = payload_x(r, DType::F32, H), p = payload_probs(r, DType::F32);
    const PerRank recv = row_buffers(r, DType::F32, H), recv_p = row_prob_buffers(r, DType::F32);
    poison(recv);
    poison(recv_p);
    dispatch(r.plan, x, p, recv, recv_p);
    expect_received(r, recv, recv_p, H);
  }
}

TEST(Dispatch, WithoutProbs) {
  Rng rng(22);
  const Routing r = random_routing({16, 2, 4, 16}, rng, 10, 0.1);
  const PerRank x = payload_x(r, DType::F64, 5), recv = row_buffers(r, DType::F64, 5);
  poison(recv);
  dispatch(r.plan, x, {}, recv, {});
  expect_received(r, recv, {}, 5);
}

TEST(Dispatch, MovesEachFloatingDtypeBitExactly) {
  Rng rng(23);
  const std::int64_t H = 7;
  const Routing r = random_routing({16, 4, 2, 16}, rng, 9, 0.1);
  for (DType dtype : {DType::F64, DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const PerRank x = token_tensors(r, dtype, H);
    fill_random(x, rng);  // stored rounded to dtype
    const PerRank recv = row_buffers(r, dtype, H);
    poison(recv);
    dispatch(r.plan, x, {}, recv, {});
    const std::size_t row_bytes = std::size_t(H) * dtype_size(dtype);
    int bad = 0;
    for (std::int64_t s = 0; s < r.R; ++s)
      for (std::int64_t t = 0; t < r.tokens(s); ++t)
        for (std::int64_t k = 0; k < r.K; ++k) {
          if (r.dest_rank(s, t, k) < 0) continue;
          const auto* got = static_cast<const char*>(recv[std::size_t(r.dest_rank(s, t, k))].view().data()) +
                            std::size_t(r.dest_row(s, t, k)) * row_bytes;
          const auto* want = static_cast<const char*>(x[std::size_t(s)].view().data()) + std::size_t(t) * row_bytes;
          if (std::memcmp(got, want, row_bytes) != 0 && ++bad <= 5)
            ADD_FAILURE() << "token " << t << " of rank " << s << " slot " << k << " arrived with other bits";
        }
    EXPECT_EQ(bad, 0);
  }
}

TEST(Dispatch, AllTokensOnOneExpertAndRanksWithoutTokens) {
  const Case c{16, 1, 4, 32};
  PerRank idx = test::per_rank(DType::I32, {12, 0, 7, 0}, 1);
  for (const HostTensor& ids : idx)
    for (std::int64_t i = 0; i < ids.numel(); ++i) ids.set_i(i, 13);
  const Routing r = make_routing(dispatch_config(c, 12), std::move(idx));
  ASSERT_EQ(r.plan.rows_used[3], 32);
  const PerRank x = payload_x(r, DType::F32, 3), p = payload_probs(r, DType::F32);
  const PerRank recv = row_buffers(r, DType::F32, 3), recv_p = row_prob_buffers(r, DType::F32);
  poison(recv);
  poison(recv_p);
  dispatch(r.plan, x, p, recv, recv_p);
  expect_received(r, recv, recv_p, 3);
  EXPECT_EQ(recv[3].f(12 * 3), token_payload(2, 0, 0)) << "rank 2's first token follows rank 0's 12 tokens";
}

TEST(Dispatch, UnroutedSlotsAndEmptyRanksSendNothing) {
  PerRank idx = test::per_rank(DType::I32, {4, 0}, 2);
  for (std::int64_t i = 0; i < 8; ++i) idx[0].set_i(i, -1);
  const Routing r = make_routing(dispatch_config({8, 2, 2, 16}, 4), std::move(idx));
  const PerRank x = payload_x(r, DType::F32, 3), p = payload_probs(r, DType::F32);
  const PerRank recv = row_buffers(r, DType::F32, 3), recv_p = row_prob_buffers(r, DType::F32);
  poison(recv);
  poison(recv_p);
  dispatch(r.plan, x, p, recv, recv_p);
  for (const HostTensor& t : recv)
    for (std::int64_t i = 0; i < t.numel(); ++i) ASSERT_TRUE(std::isnan(t.f(i))) << "element " << i << " written";
}

TEST(Dispatch, FactorCapacityWritesNothingAtOrAfterTheCapacity) {
  Rng rng(24);
  for (std::int64_t A : {1, 16}) {
    SCOPED_TRACE(testing::Message() << "A=" << A);
    const Case c{16, 4, 4, A};
    const MoeConfig cfg = dispatch_config(c, 24, Capacity::of_factor(0.3));
    PerRank idx = test::random_routing(rng, {24, 20, 0, 24}, 16, 4);
    for (std::int64_t s = 0; s < 4; ++s)  // half the tokens pile onto rank 1's experts 4..7
      for (std::int64_t t = 0; t < idx[std::size_t(s)].view().size(0); t += 2)
        for (std::int64_t k = 0; k < 4; ++k) idx[std::size_t(s)].set_i(t * 4 + k, std::int32_t(4 + k));
    const Routing r = make_routing(cfg, std::move(idx));
    ASSERT_GT(r.plan.overflow[1], 0) << "the test needs an overflowing rank";
    EXPECT_EQ(r.plan.overflow, r.model.overflow);
    EXPECT_EQ(r.plan.rows_used[1], r.plan.capacity);
    const PerRank x = payload_x(r, DType::F32, 3), p = payload_probs(r, DType::F32);
    const PerRank recv = row_buffers(r, DType::F32, 3), recv_p = row_prob_buffers(r, DType::F32);
    poison(recv);
    poison(recv_p);
    dispatch(r.plan, x, p, recv, recv_p);
    expect_received(r, recv, recv_p, 3);  // rows >= rows_used (and the slack past capacity) still NaN
  }
}

TEST(Dispatch, ProbsOfUnroutedAndDroppedSlotsAreNeverRead) {
  // Hand routing at capacity 2: rank 0 t2 k1 and rank 1 t1 are unrouted; (s0,t1,k0), (s1,t0,k1) and (s0,t2,k0)
  // are dropped. Their probs are NaN and must not matter.
  const Routing r = hand_routing(2);
  ASSERT_EQ(r.plan.overflow, (std::vector<std::int64_t>{2, 1}));
  const std::int64_t H = 2;
  const PerRank x = payload_x(r, DType::F32, H), p = payload_probs(r, DType::F32);
  for (std::int64_t s = 0; s < r.R; ++s)
    for (std::int64_t t = 0; t < r.tokens(s); ++t)
      for (std::int64_t k = 0; k < r.K; ++k)
        if (r.dest_rank(s, t, k) < 0) p[std::size_t(s)].set_f(t * r.K + k, kNaN);
  const PerRank recv = row_buffers(r, DType::F32, H), recv_p = row_prob_buffers(r, DType::F32);
  poison(recv);
  poison(recv_p);
  dispatch(r.plan, x, p, recv, recv_p);
  expect_received(r, recv, recv_p, H);
  const PerRank y = payload_rows(r, DType::F32, H), out = token_tensors(r, DType::F32, H);
  poison(out);
  combine(r.plan, ProbMode::InCombine, y, p, out);
  for (const HostTensor& o : out)
    for (std::int64_t i = 0; i < o.numel(); ++i) EXPECT_TRUE(std::isfinite(o.f(i))) << "element " << i;
  EXPECT_EQ(out[1].f(1 * H), 0.0) << "rank 1's token 1 has no routed slot";
}

// ---- dispatch backward ----------------------------------------------------------------------------------------

TEST(Dispatch, BackwardSumsSlotGradientsAndNeverReadsPadRows) {
  Rng rng(25);
  const std::int64_t H = 3;
  for (const Case& c : sweep_cases()) {
    if (c.A == 32 || c.A == 128) continue;  // the forward sweep covers every A; keep this one lighter
    SCOPED_TRACE(testing::Message() << "E=" << c.E << " K=" << c.K << " R=" << c.R << " A=" << c.A);
    const Routing r = random_routing(c, rng, 12, 0.1);
    PerRank d_recv = payload_rows(r, DType::F32, H);
    PerRank d_recv_p = row_prob_buffers(r, DType::F32);
    for (std::int64_t d = 0; d < r.R; ++d) {
      const auto src = r.sources(d);
      for (std::int64_t row = 0; row < r.buffer_rows(); ++row) {
        d_recv_p[std::size_t(d)].set_f(row, row_payload(d, row, 7));
        if (src[std::size_t(row)].s >= 0) continue;
        // Pad rows and rows beyond rows_used carry NaN: reading one would poison dx.
        d_recv_p[std::size_t(d)].set_f(row, kNaN);
        for (std::int64_t h = 0; h < H; ++h) d_recv[std::size_t(d)].set_f(row * H + h, kNaN);
      }
    }
    const PerRank dx = token_tensors(r, DType::F32, H), d_p = test::per_rank(DType::F32, r.token_counts(), r.K);
    poison(dx);
    poison(d_p);
    dispatch_bwd(r.plan, d_recv, d_recv_p, dx, d_p);
    Mismatches bad;
    for (std::int64_t s = 0; s < r.R; ++s)
      for (std::int64_t t = 0; t < r.tokens(s); ++t) {
        for (std::int64_t h = 0; h < H; ++h) {
          double sum = 0.0;
          for (std::int64_t k = 0; k < r.K; ++k)
            if (r.dest_rank(s, t, k) >= 0) sum += row_payload(r.dest_rank(s, t, k), r.dest_row(s, t, k), h);
          bad.expect(dx[std::size_t(s)].f(t * H + h), double(float(sum)), At{"dx", s, t, h});
        }
        for (std::int64_t k = 0; k < r.K; ++k) {
          const std::int64_t d = r.dest_rank(s, t, k);
          const double want = d < 0 ? 0.0 : row_payload(d, r.dest_row(s, t, k), 7);
          bad.expect(d_p[std::size_t(s)].f(t * r.K + k), want, At{"d_probs", s, t, k});
        }
      }
  }
}

// ---- combine forward and backward -----------------------------------------------------------------------------

TEST(Combine, ForwardWeightsAndSumsInKOrderAcrossTheSweep) {
  Rng rng(26);
  const std::int64_t H = 3;
  for (const Case& c : sweep_cases()) {
    if (c.A == 32 || c.A == 128) continue;
    for (ProbMode mode : {ProbMode::InCombine, ProbMode::InActivation}) {
      SCOPED_TRACE(testing::Message() << "E=" << c.E << " K=" << c.K << " R=" << c.R << " A=" << c.A << " "
                                      << name_of(mode));
      const Routing r = random_routing(c, rng, 12, 0.15);
      PerRank y = payload_rows(r, DType::F32, H);
      for (std::int64_t d = 0; d < r.R; ++d) {  // combine never reads pad rows or rows past rows_used
        const auto src = r.sources(d);
        for (std::int64_t row = 0; row < r.buffer_rows(); ++row)
          if (src[std::size_t(row)].s < 0)
            for (std::int64_t h = 0; h < H; ++h) y[std::size_t(d)].set_f(row * H + h, kNaN);
      }
      const PerRank p = payload_probs(r, DType::F32), out = token_tensors(r, DType::F32, H);
      poison(out);
      combine(r.plan, mode, y, mode == ProbMode::InCombine ? p : PerRank{}, out);
      Mismatches bad;
      for (std::int64_t s = 0; s < r.R; ++s)
        for (std::int64_t t = 0; t < r.tokens(s); ++t)
          for (std::int64_t h = 0; h < H; ++h) {
            double sum = 0.0;
            for (std::int64_t k = 0; k < r.K; ++k) {
              if (r.dest_rank(s, t, k) < 0) continue;
              const double w = mode == ProbMode::InCombine ? prob_payload(s, t, k) : 1.0;
              sum += w * row_payload(r.dest_rank(s, t, k), r.dest_row(s, t, k), h);
            }
            bad.expect(out[std::size_t(s)].f(t * H + h), double(float(sum)), At{"out", s, t, h});
          }
    }
  }
}

TEST(Combine, BackwardScattersWeightedGradientsAndZeroesPadRows) {
  Rng rng(27);
  const std::int64_t H = 3;
  for (const Case& c : sweep_cases()) {
    if (c.A == 32 || c.A == 128) continue;
    for (ProbMode mode : {ProbMode::InCombine, ProbMode::InActivation}) {
      SCOPED_TRACE(testing::Message() << "E=" << c.E << " K=" << c.K << " R=" << c.R << " A=" << c.A << " "
                                      << name_of(mode));
      const Routing r = random_routing(c, rng, 12, 0.15);
      const PerRank d_out = payload_x(r, DType::F32, H), p = payload_probs(r, DType::F32);
      const PerRank y = payload_rows(r, DType::F64, H);
      const PerRank d_y = row_buffers(r, DType::F32, H), d_p = test::per_rank(DType::F64, r.token_counts(), r.K);
      poison(d_y);
      poison(d_p);
      combine_bwd(r.plan, mode, d_out, y, p, d_y, d_p);
      const bool in_combine = mode == ProbMode::InCombine;
      Mismatches bad;
      for (std::int64_t d = 0; d < r.R; ++d) {
        const auto src = r.sources(d);
        for (std::int64_t row = 0; row < r.buffer_rows(); ++row) {
          const auto& o = src[std::size_t(row)];
          for (std::int64_t h = 0; h < H; ++h) {
            const double w = o.s >= 0 && in_combine ? prob_payload(o.s, o.t, o.k) : 1.0;
            const double want = row >= r.rows_used(d) ? kNaN
                                : o.s < 0         ? 0.0
                                                  : double(float(w * token_payload(o.s, o.t, h)));
            bad.expect(d_y[std::size_t(d)].f(row * H + h), want, At{"d_y", d, row, h});
          }
        }
      }
      for (std::int64_t s = 0; s < r.R; ++s)
        for (std::int64_t t = 0; t < r.tokens(s); ++t)
          for (std::int64_t k = 0; k < r.K; ++k) {
            double want = 0.0;
            if (in_combine && r.dest_rank(s, t, k) >= 0)
              for (std::int64_t h = 0; h < H; ++h)
                want += row_payload(r.dest_rank(s, t, k), r.dest_row(s, t, k), h) * token_payload(s, t, h);
            bad.expect(d_p[std::size_t(s)].f(t * r.K + k), want, At{"d_probs", s, t, k});
          }
    }
  }
}

// ---- adjoint identities and finite differences (fp64) ---------------------------------------------------------

// <F(u), g> == <u, F^T(g)> for dispatch (u = (x, probs)) and for combine (u = y, probs fixed), in both prob modes.
// Buffers the forward does not write (rows past rows_used) start at 0, so F is a linear map into the whole buffer;
// g is random everywhere, pad rows included, so a backward that read a pad row or beyond would break the identity.
TEST(DispatchCombine, AdjointIdentities) {
  Rng rng(28);
  const std::int64_t H = 4;
  for (const Case& c : sweep_cases()) {
    if (c.A == 32 || c.A == 128) continue;
    SCOPED_TRACE(testing::Message() << "E=" << c.E << " K=" << c.K << " R=" << c.R << " A=" << c.A);
    const Routing r = random_routing(c, rng, 10, 0.1);
    const auto rel_close = [](double lhs, double rhs, double scale) {
      EXPECT_LE(std::abs(lhs - rhs), 1e-13 * (scale + 1e-300)) << "lhs " << lhs << " rhs " << rhs;
    };

    // Dispatch.
    const PerRank x = token_tensors(r, DType::F64, H), p = test::per_rank(DType::F64, r.token_counts(), r.K);
    fill_random(x, rng);
    fill_random(p, rng);
    const PerRank recv = row_buffers(r, DType::F64, H), recv_p = row_prob_buffers(r, DType::F64);
    for (const auto& t : recv) t.fill(0.0);
    for (const auto& t : recv_p) t.fill(0.0);
    dispatch(r.plan, x, p, recv, recv_p);
    const PerRank g = row_buffers(r, DType::F64, H), gp = row_prob_buffers(r, DType::F64);
    fill_random(g, rng);
    fill_random(gp, rng);
    const PerRank dx = token_tensors(r, DType::F64, H), dp = test::per_rank(DType::F64, r.token_counts(), r.K);
    poison(dx);
    poison(dp);
    dispatch_bwd(r.plan, g, gp, dx, dp);
    rel_close(dot(recv, g) + dot(recv_p, gp), dot(x, dx) + dot(p, dp),
              abs_dot(recv, g) + abs_dot(recv_p, gp) + abs_dot(x, dx) + abs_dot(p, dp));

    // Combine, linear in y.
    for (ProbMode mode : {ProbMode::InCombine, ProbMode::InActivation}) {
      const PerRank y = row_buffers(r, DType::F64, H), out = token_tensors(r, DType::F64, H);
      fill_random(y, rng);
      poison(out);
      combine(r.plan, mode, y, p, out);
      const PerRank g_out = token_tensors(r, DType::F64, H), d_y = row_buffers(r, DType::F64, H);
      fill_random(g_out, rng);
      for (const auto& t : d_y) t.fill(0.0);
      combine_bwd(r.plan, mode, g_out, y, p, d_y, {});
      rel_close(dot(out, g_out), dot(y, d_y), abs_dot(out, g_out) + abs_dot(y, d_y));
    }
  }
}

// d_probs of combine (InCombine) against central differences of L(p) = <combine(y, p), g> in fp64.
TEST(Combine, ProbGradientMatchesFiniteDifferences) {
  Rng rng(29);
  for (const Case& c : {Case{8, 2, 2, 4}, Case{16, 5, 4, 16}, Case{7, 3, 1, 1}}) {
    SCOPED_TRACE(testing::Message() << "E=" << c.E << " K=" << c.K << " R=" << c.R << " A=" << c.A);
    const Routing r = random_routing(c, rng, 5, 0.2);
    const std::int64_t H = 6;
    const PerRank y = row_buffers(r, DType::F64, H), g = token_tensors(r, DType::F64, H);
    const PerRank p = test::per_rank(DType::F64, r.token_counts(), r.K);
    fill_random(y, rng);
    fill_random(g, rng);
    fill_random(p, rng);
    const PerRank d_y = row_buffers(r, DType::F64, H), d_p = test::per_rank(DType::F64, r.token_counts(), r.K);
    poison(d_p);
    combine_bwd(r.plan, ProbMode::InCombine, g, y, p, d_y, d_p);

    const PerRank out = token_tensors(r, DType::F64, H);
    auto loss = [&] {
      combine(r.plan, ProbMode::InCombine, y, p, out);
      return dot(out, g);
    };
    const double step = 1e-4;
    for (std::int64_t s = 0; s < r.R; ++s)
      for (std::int64_t i = 0; i < p[std::size_t(s)].numel(); ++i) {
        const double p0 = p[std::size_t(s)].f(i);
        p[std::size_t(s)].set_f(i, p0 + step);
        const double up = loss();
        p[std::size_t(s)].set_f(i, p0 - step);
        const double down = loss();
        p[std::size_t(s)].set_f(i, p0);
        const double numeric = (up - down) / (2 * step);
        EXPECT_NEAR(d_p[std::size_t(s)].f(i), numeric, 1e-8 * (1 + std::abs(numeric)))
            << "rank " << s << " slot " << i;
      }
  }
}

// ---- the Megatron round trip: combine(experts(dispatch(x))) == x with probs 1/K and identity experts ------------

struct RoundTrip {
  PerRank out, dx, d_probs;
};

// Identity experts; probs either multiply inside the "expert" (InActivation: y = p * x) or in combine.
// Upstream gradient of out is g. Rows past rows_used are never touched, so buffers are simply sized and poisoned.
RoundTrip round_trip(const Routing& r, ProbMode mode, const PerRank& x, const PerRank& p, const PerRank& g,
                     std::int64_t H) {
  const bool in_act = mode == ProbMode::InActivation;
  const PerRank recv = row_buffers(r, DType::F64, H), recv_p = row_prob_buffers(r, DType::F64);
  poison(recv);
  poison(recv_p);
  dispatch(r.plan, x, p, recv, recv_p);
  const PerRank y = row_buffers(r, DType::F64, H);
  poison(y);
  for (std::int64_t d = 0; d < r.R; ++d)
    for (std::int64_t row = 0; row < r.plan.rows_used[std::size_t(d)]; ++row)
      for (std::int64_t h = 0; h < H; ++h)
        y[std::size_t(d)].set_f(row * H + h,
                                (in_act ? recv_p[std::size_t(d)].f(row) : 1.0) * recv[std::size_t(d)].f(row * H + h));
  RoundTrip res{token_tensors(r, DType::F64, H), token_tensors(r, DType::F64, H),
                test::per_rank(DType::F64, r.token_counts(), r.K)};
  poison(res.out);
  combine(r.plan, mode, y, p, res.out);

  const PerRank d_y = row_buffers(r, DType::F64, H), d_p_combine = test::per_rank(DType::F64, r.token_counts(), r.K);
  poison(d_y);
  combine_bwd(r.plan, mode, g, y, p, d_y, d_p_combine);
  // Expert backward (identity with optional p): d_recv = p * d_y, d_recv_probs = <recv, d_y> (InActivation).
  const PerRank d_recv = row_buffers(r, DType::F64, H), d_recv_p = row_prob_buffers(r, DType::F64);
  poison(d_recv);
  poison(d_recv_p);
  for (std::int64_t d = 0; d < r.R; ++d)
    for (std::int64_t row = 0; row < r.plan.rows_used[std::size_t(d)]; ++row) {
      double dp = 0.0;
      for (std::int64_t h = 0; h < H; ++h) {
        const double dy = d_y[std::size_t(d)].f(row * H + h);
        d_recv[std::size_t(d)].set_f(row * H + h, (in_act ? recv_p[std::size_t(d)].f(row) : 1.0) * dy);
        dp += recv[std::size_t(d)].f(row * H + h) * dy;
      }
      d_recv_p[std::size_t(d)].set_f(row, in_act ? dp : 0.0);
    }
  const PerRank d_p_dispatch = test::per_rank(DType::F64, r.token_counts(), r.K);
  poison(res.dx);
  poison(d_p_dispatch);
  dispatch_bwd(r.plan, d_recv, d_recv_p, res.dx, d_p_dispatch);
  for (std::int64_t s = 0; s < r.R; ++s)
    for (std::int64_t i = 0; i < res.d_probs[std::size_t(s)].numel(); ++i)
      res.d_probs[std::size_t(s)].set_f(i, d_p_combine[std::size_t(s)].f(i) + d_p_dispatch[std::size_t(s)].f(i));
  return res;
}

void expect_near_all(const PerRank& got, const PerRank& want, double tol, const char* name) {
  Mismatches bad;
  for (std::size_t s = 0; s < got.size(); ++s)
    for (std::int64_t i = 0; i < got[s].numel(); ++i)
      bad.check(std::abs(got[s].f(i) - want[s].f(i)) <= tol * (1 + std::abs(want[s].f(i))),
                At{name, std::int64_t(s), i}, got[s].f(i), want[s].f(i));
}

TEST(DispatchCombine, MegatronRoundTripRestoresTokensAndGradients) {
  Rng rng(30);
  for (std::int64_t K : {1, 2, 5, 8}) {
    for (std::int64_t A : {1, 16}) {
      SCOPED_TRACE(testing::Message() << "K=" << K << " A=" << A);
      const Case c{16, K, 4, A};
      const Routing r = random_routing(c, rng, 10, 0.0);  // every slot routed
      const std::int64_t H = 5;
      const PerRank x = token_tensors(r, DType::F64, H), p = test::per_rank(DType::F64, r.token_counts(), K);
      fill_random(x, rng);
      for (const auto& t : p) t.fill(1.0 / double(K));
      // Megatron's test: the upstream gradient is x itself, and the gradient reaching the input is x again.
      const RoundTrip comb = round_trip(r, ProbMode::InCombine, x, p, x, H);
      const RoundTrip act = round_trip(r, ProbMode::InActivation, x, p, x, H);
      expect_near_all(comb.out, x, 1e-14, "out (InCombine)");
      expect_near_all(act.out, x, 1e-14, "out (InActivation)");
      expect_near_all(comb.dx, x, 1e-14, "dx (InCombine)");
      expect_near_all(act.dx, x, 1e-14, "dx (InActivation)");
      // d_probs[t,k] = <x[t], g[t]> = |x[t]|^2 in both modes.
      PerRank want = test::per_rank(DType::F64, r.token_counts(), K);
      for (std::int64_t s = 0; s < r.R; ++s)
        for (std::int64_t t = 0; t < r.tokens(s); ++t) {
          double n2 = 0.0;
          for (std::int64_t h = 0; h < H; ++h) n2 += x[std::size_t(s)].f(t * H + h) * x[std::size_t(s)].f(t * H + h);
          for (std::int64_t k = 0; k < K; ++k) want[std::size_t(s)].set_f(t * K + k, n2);
        }
      expect_near_all(comb.d_probs, want, 1e-13, "d_probs (InCombine)");
      expect_near_all(act.d_probs, want, 1e-13, "d_probs (InActivation)");
    }
  }
}

TEST(DispatchCombine, DroppedRowsLeaveTheKeptProbsShare) {
  // Megatron's capacity test: with identity experts, out[t] = x[t] * (sum of the probs of the kept slots).
  Rng rng(31);
  const Case c{16, 4, 4, 16};
  const MoeConfig cfg = dispatch_config(c, 24, Capacity::of_factor(0.3));
  PerRank idx = test::random_routing(rng, {24, 17, 24, 0}, 16, 4);
  for (std::int64_t s = 0; s < 4; ++s)
    for (std::int64_t t = 0; t < idx[std::size_t(s)].view().size(0); t += 2)
      for (std::int64_t k = 0; k < 4; ++k) idx[std::size_t(s)].set_i(t * 4 + k, std::int32_t(8 + k));
  const Routing r = make_routing(cfg, std::move(idx));
  ASSERT_GT(r.plan.overflow[2], 0);
  const std::int64_t H = 4;
  const PerRank x = token_tensors(r, DType::F64, H), p = test::per_rank(DType::F64, r.token_counts(), 4);
  fill_random(x, rng);
  for (const auto& t : p) ref::fill_uniform(t, rng, 0.0, 1.0);
  for (ProbMode mode : {ProbMode::InCombine, ProbMode::InActivation}) {
    SCOPED_TRACE(name_of(mode));
    const RoundTrip res = round_trip(r, mode, x, p, x, H);
    PerRank want = token_tensors(r, DType::F64, H);
    int dropped = 0;
    for (std::int64_t s = 0; s < r.R; ++s)
      for (std::int64_t t = 0; t < r.tokens(s); ++t) {
        double kept = 0.0;
        for (std::int64_t k = 0; k < 4; ++k) {
          if (r.dest_rank(s, t, k) >= 0) kept += p[std::size_t(s)].f(t * 4 + k);
          else ++dropped;
        }
        for (std::int64_t h = 0; h < H; ++h)
          want[std::size_t(s)].set_f(t * H + h, kept * x[std::size_t(s)].f(t * H + h));
      }
    EXPECT_EQ(dropped, r.plan.overflow[0] + r.plan.overflow[1] + r.plan.overflow[2] + r.plan.overflow[3]);
    expect_near_all(res.out, want, 1e-14, "out");
    expect_near_all(res.dx, want, 1e-14, "dx");  // the same linear map, applied to g = x
  }
}

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
