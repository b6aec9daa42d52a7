// Tests of the CPU dispatch and combine references (moerail/reference/dispatch.h), forward and backward.
//
// Expected values come from test::expected_layout (a sorted model of the contract), not from the plan the ops
// are given, so a planner bug shows up here too. Outputs are poisoned (NaN) before each run: a row that should
// have been written and was not, or a row that should not have been written and was, fails.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "reference/dispatch_harness.h"

namespace moerail {
namespace {

using namespace test::dispatch_ref;  // NOLINT: the harness is these tests' vocabulary

// ---- dispatch forward -----------------------------------------------------------------------------------------


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

}  // namespace
}  // namespace moerail
