// tests/reference/dispatch_harness.h — what the tests of the reference dispatch and combine share: routing set-ups,
// payloads that name their origin, the ops over per-rank tensors, and the checks (dispatch_test.cpp,
// dispatch_identities_test.cpp, dispatch_errors_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "moerail/config.h"
#include "moerail/error.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/host.h"
#include "moerail/reference/layout.h"
#include "reference/routing_fixtures.h"

namespace moerail::test::dispatch_ref {

using ref::HostTensor;
using ref::LayoutPlan;
using ref::Rng;
using test::PerRank;
using test::views;

inline constexpr std::int64_t kSlack = 2;  // extra buffer rows beyond the capacity: must never be written

// ---- routing set-ups ------------------------------------------------------------------------------------------

struct Case {
  std::int64_t E, K, R, A;
};

// E in {7, 16, 256}, K in {1, 2, 5, 8}, R in {1, 2, 4, 8}, A in {1, 16, 32, 128, 256}, where valid
// (K <= E, E % R == 0).
inline std::vector<Case> sweep_cases() {
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

inline MoeConfig dispatch_config(const Case& c, std::int64_t t_max, Capacity capacity = Capacity::worst_case()) {
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

inline Routing make_routing(const MoeConfig& cfg, PerRank idx, std::int64_t capacity = -1) {
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

inline Routing random_routing(const Case& c, Rng& rng, std::int64_t t_max, double unrouted) {
  const MoeConfig cfg = dispatch_config(c, t_max);
  return make_routing(cfg, test::random_routing(rng, test::random_tokens(rng, c.R, t_max), c.E, c.K, unrouted));
}

// ---- payloads -------------------------------------------------------------------------------------------------

// x[s][t, h] says where it came from; exact in f32 for s < 256, t < 1024, h < 64.
inline double token_payload(std::int64_t s, std::int64_t t, std::int64_t h) { return double(1 + h + 64 * t + 65536 * s); }
// probs[s][t, k], likewise exact in f32 (a multiple of 2^-10 below 2^14).
inline double prob_payload(std::int64_t s, std::int64_t t, std::int64_t k) {
  return double(1 + k + 16 * t + 16384 * s) / 1024.0;
}
// A value per (rank, row, column) of a destination buffer (expert outputs y, gradients d_recv).
inline double row_payload(std::int64_t d, std::int64_t row, std::int64_t h) {
  return double(1 + h) * 0.25 + double(row) + 0.125 * double(d);
}

// [T_s, H] per source rank.
inline PerRank token_tensors(const Routing& r, DType dtype, std::int64_t H) {
  return test::per_rank(dtype, r.token_counts(), H);
}

inline PerRank payload_x(const Routing& r, DType dtype, std::int64_t H) {
  PerRank x = token_tensors(r, dtype, H);
  for (std::int64_t s = 0; s < r.R; ++s)
    for (std::int64_t t = 0; t < r.tokens(s); ++t)
      for (std::int64_t h = 0; h < H; ++h) x[std::size_t(s)].set_f(t * H + h, token_payload(s, t, h));
  return x;
}

inline PerRank payload_probs(const Routing& r, DType dtype) {
  PerRank p = test::per_rank(dtype, r.token_counts(), r.K);
  for (std::int64_t s = 0; s < r.R; ++s)
    for (std::int64_t t = 0; t < r.tokens(s); ++t)
      for (std::int64_t k = 0; k < r.K; ++k) p[std::size_t(s)].set_f(t * r.K + k, prob_payload(s, t, k));
  return p;
}

inline PerRank row_buffers(const Routing& r, DType dtype, std::int64_t H) {
  return test::per_rank(dtype, std::vector<std::int64_t>(std::size_t(r.R), r.buffer_rows()), H);
}

inline PerRank row_prob_buffers(const Routing& r, DType dtype) {
  return test::per_rank_1d(dtype, std::size_t(r.R), r.buffer_rows());
}

inline PerRank payload_rows(const Routing& r, DType dtype, std::int64_t H) {
  PerRank y = row_buffers(r, dtype, H);
  for (std::int64_t d = 0; d < r.R; ++d)
    for (std::int64_t row = 0; row < r.buffer_rows(); ++row)
      for (std::int64_t h = 0; h < H; ++h) y[std::size_t(d)].set_f(row * H + h, row_payload(d, row, h));
  return y;
}

inline void poison(const PerRank& tensors) {
  for (const HostTensor& t : tensors) t.fill_nan();
}

// Uniform in [-1, 1): cheaper than normal draws on the large padded buffers, and just as good here.
inline void fill_random(const PerRank& tensors, Rng& rng) {
  for (const HostTensor& t : tensors) ref::fill_uniform(t, rng, -1.0, 1.0);
}

// Sum over ranks of <a, b>, in double.
inline double dot(const PerRank& a, const PerRank& b) {
  double sum = 0.0;
  for (std::size_t r = 0; r < a.size(); ++r)
    for (std::int64_t i = 0; i < a[r].numel(); ++i) sum += a[r].f(i) * b[r].f(i);
  return sum;
}

inline double abs_dot(const PerRank& a, const PerRank& b) {
  double sum = 0.0;
  for (std::size_t r = 0; r < a.size(); ++r)
    for (std::int64_t i = 0; i < a[r].numel(); ++i) sum += std::abs(a[r].f(i) * b[r].f(i));
  return sum;
}

// ---- op wrappers: keep the view vectors alive for the call -----------------------------------------------------

inline void dispatch(const LayoutPlan& plan, const PerRank& x, const PerRank& probs, const PerRank& recv,
              const PerRank& recv_probs) {
  const auto vx = views(x), vp = views(probs), vr = views(recv), vrp = views(recv_probs);
  ref::dispatch_forward(plan, {.x = vx, .probs = vp, .recv = vr, .recv_probs = vrp});
}

inline void dispatch_bwd(const LayoutPlan& plan, const PerRank& d_recv, const PerRank& d_recv_probs, const PerRank& dx,
                  const PerRank& d_probs) {
  const auto a = views(d_recv), b = views(d_recv_probs), c = views(dx), d = views(d_probs);
  ref::dispatch_backward(plan, {.d_recv = a, .d_recv_probs = b, .dx = c, .d_probs = d});
}

inline void combine(const LayoutPlan& plan, ProbMode mode, const PerRank& y, const PerRank& probs, const PerRank& out) {
  const auto vy = views(y), vp = views(probs), vo = views(out);
  ref::combine_forward(plan, {.mode = mode, .y = vy, .probs = vp, .out = vo});
}

inline void combine_bwd(const LayoutPlan& plan, ProbMode mode, const PerRank& d_out, const PerRank& y, const PerRank& probs,
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

inline std::ostream& operator<<(std::ostream& os, const At& a) {
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

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Each row of rank d's receive buffer: the routed token's payload, or 0 in a pad row, or untouched (NaN) at and
// beyond rows_used. probs likewise. All bit-exact.
inline void expect_received(const Routing& r, const PerRank& recv, const PerRank& recv_probs, std::int64_t H) {
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

// The hand-worked routing of layout_test.cpp (R = 2, E = 4, K = 2, A = 2):
//   rank 0: t0 -> {0, 2}, t1 -> {1, 0}, t2 -> {3, -1};   rank 1: t0 -> {2, 0}, t1 -> {-1, -1}
// Rank 0 receives rows [x0[t0], x0[t1], x1[t0], pad, x0[t1], pad]; rank 1 [x0[t0], x1[t0], x0[t2], pad].
inline Routing hand_routing(std::int64_t capacity) {
  PerRank idx = test::per_rank(DType::I32, {3, 2}, 2);
  const std::int32_t r0[] = {0, 2, 1, 0, 3, -1}, r1[] = {2, 0, -1, -1};
  for (int i = 0; i < 6; ++i) idx[0].set_i(i, r0[i]);
  for (int i = 0; i < 4; ++i) idx[1].set_i(i, r1[i]);
  return make_routing(dispatch_config({4, 2, 2, 2}, 3), std::move(idx), capacity);
}

}  // namespace moerail::test::dispatch_ref
