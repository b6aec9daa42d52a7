// The reference dispatch and combine as one another's adjoints (fp64), the prob gradient against finite
// differences, and Megatron's round trip (combine(experts(dispatch(x))) == x with probs 1/K and identity experts).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "reference/dispatch_harness.h"

namespace moerail {
namespace {

using namespace test::dispatch_ref;  // NOLINT: the harness is these tests' vocabulary

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

}  // namespace
}  // namespace moerail
