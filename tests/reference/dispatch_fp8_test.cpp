// Tests of the FP8 dispatch reference (moerail/reference/dispatch.h: dispatch_rows_forward, dispatch_fp8_forward).
//
//   Commutes   quantize-then-move (dispatch_fp8_forward on bf16 x) equals move-then-quantize (dispatch_forward on
//              x, then quantize_fp8 of each routed row) bit for bit, for every recipe, R = 1 and 2, A = 16/32/128,
//              capacity overflow; pad rows hold 0x00 data and scale 1; rows at or beyond rows_used keep the poison.
//   Bytes      already quantized rows (random bytes, NaN patterns included) move unchanged.
//   Errors     the argument is named, nothing is written.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "moerail/config.h"
#include "moerail/error.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/host.h"
#include "moerail/reference/layout.h"
#include "moerail/reference/quant.h"
#include "reference/routing_fixtures.h"

namespace moerail {
namespace {

using ref::HostTensor;
using ref::LayoutPlan;
using ref::Rng;
using test::PerRank;
using test::views;

constexpr std::int64_t kSlack = 2;  // buffer rows beyond the capacity: never written

struct Routed {
  MoeConfig cfg;
  PerRank idx;
  LayoutPlan plan;
};

Routed make_setup(Rng& rng, std::int64_t R, std::int64_t E, std::int64_t K, std::int64_t A, std::int64_t t_max,
                 std::int64_t H, double capacity_factor) {
  Routed s;
  s.cfg.num_experts = E;
  s.cfg.topk = K;
  s.cfg.ep_size = R;
  s.cfg.align = A;
  s.cfg.max_tokens = t_max;
  s.cfg.hidden = H;
  s.cfg.capacity = capacity_factor > 0 ? Capacity::of_factor(capacity_factor) : Capacity::worst_case();
  s.idx = test::random_routing(rng, test::random_tokens(rng, R, t_max), E, K, 0.05);
  const std::vector<TensorView> v = views(s.idx);
  s.plan = ref::plan_layout(s.cfg, v);
  return s;
}

std::int64_t tokens_of(const Routed& s, std::int64_t r) { return s.plan.tokens[std::size_t(r)]; }

PerRank dest_tensors(const Routed& s, DType dtype, std::int64_t cols) {
  PerRank out;
  for (std::int64_t d = 0; d < s.plan.num_ranks; ++d) {
    out.emplace_back(dtype, std::vector<std::int64_t>{s.plan.capacity + kSlack, cols});
    std::memset(out.back().view().data(), 0xff, out.back().view().nbytes());
  }
  return out;
}

PerRank dest_probs(const Routed& s) {
  PerRank out = test::per_rank_1d(DType::F32, std::size_t(s.plan.num_ranks), s.plan.capacity + kSlack);
  for (const HostTensor& t : out) std::memset(t.view().data(), 0xff, t.view().nbytes());
  return out;
}

const unsigned char* row_bytes(const HostTensor& t, std::int64_t row) {
  const std::size_t row_size = t.view().nbytes() / std::size_t(t.view().size(0));
  return static_cast<const unsigned char*>(t.view().data()) + std::size_t(row) * row_size;
}

// true when row `row` of destination rank d is a pad row of the plan.
bool is_pad_row(const LayoutPlan& p, std::int64_t d, std::int64_t row) {
  for (std::int64_t e = 0; e < p.num_experts; ++e) {
    if (p.rank_of_expert(e) != d) continue;
    const std::int64_t first = p.segment_offset[std::size_t(e)] + p.tokens_per_expert[std::size_t(e)];
    if (row >= first && row < p.segment_offset[std::size_t(e)] + p.segment_rows[std::size_t(e)]) return true;
  }
  return false;
}

TEST(DispatchFp8, QuantizeThenMoveEqualsMoveThenQuantize) {
  struct C {
    Fp8Scaling scaling;
    std::int64_t R, E, K, A, t_max, H;
    double cap;
  };
  const std::vector<C> cases = {
      {Fp8Scaling::Block1x128, 1, 16, 4, 128, 40, 256, 0},    {Fp8Scaling::Block1x128, 2, 12, 3, 16, 30, 128, 0.6},
      {Fp8Scaling::Mx1x32, 1, 7, 2, 32, 50, 96, 0},           {Fp8Scaling::Mx1x32, 2, 16, 5, 128, 33, 64, 0.5},
      {Fp8Scaling::PerTensor, 1, 9, 3, 16, 45, 48, 0},        {Fp8Scaling::PerTensor, 2, 8, 2, 32, 20, 16, 0.7},
  };
  Rng rng(77);
  for (const C& c : cases) {
    SCOPED_TRACE(std::string(fp8_scaling_name(c.scaling)) + " R=" + std::to_string(c.R) + " A=" + std::to_string(c.A));
    const Routed s = make_setup(rng, c.R, c.E, c.K, c.A, c.t_max, c.H, c.cap);
    const std::int64_t H = c.H, block = fp8_scale_block_cols(c.scaling), nb = block ? H / block : 0;
    const DType sdt = fp8_scale_dtype(c.scaling);
    std::vector<std::int64_t> tokens;
    for (std::int64_t r = 0; r < c.R; ++r) tokens.push_back(tokens_of(s, r));
    PerRank x = test::per_rank(DType::BF16, tokens, H), probs = test::per_rank(DType::F32, tokens, c.K);
    for (std::int64_t r = 0; r < c.R; ++r) {
      ref::fill_normal(x[std::size_t(r)], rng, 3.0);
      ref::fill_uniform(probs[std::size_t(r)], rng, 0.05, 1.0);
      if (tokens[std::size_t(r)] > 0)  // a zero block: scale 1 (1x128) / code 0 (MXFP8) from the quantizer
        for (std::int64_t h = 0; h < 32; ++h) x[std::size_t(r)].set_f(h, 0.0);
    }
    HostTensor tscale(DType::F32, {1});
    tscale.set_f(0, 0.02);

    PerRank recv = dest_tensors(s, DType::F8E4M3, H), rscales = dest_tensors(s, sdt, nb), rprobs = dest_probs(s);
    const auto xv = views(x), pv = views(probs), rv = views(recv), rsv = views(rscales), rpv = views(rprobs);
    ref::DispatchFp8Args a;
    a.scaling = c.scaling;
    a.x = xv;
    a.tensor_scale = tscale.view();
    a.probs = pv;
    a.recv = rv;
    if (block) a.recv_scales = rsv;
    a.recv_probs = rpv;
    ref::dispatch_fp8_forward(s.plan, a);

    // Move then quantize: bf16 rows by dispatch_forward, each destination row quantized on its own.
    PerRank recv16 = dest_tensors(s, DType::BF16, H), rprobs2 = dest_probs(s);
    const auto r16 = views(recv16), rp2 = views(rprobs2);
    ref::dispatch_forward(s.plan, {xv, pv, r16, rp2});
    for (std::int64_t d = 0; d < c.R; ++d) {
      const std::int64_t used = s.plan.rows_used[std::size_t(d)], total = s.plan.capacity + kSlack;
      for (std::int64_t row = 0; row < total; ++row) {
        SCOPED_TRACE("rank " + std::to_string(d) + " row " + std::to_string(row));
        const unsigned char* q = row_bytes(recv[std::size_t(d)], row);
        const unsigned char* sc = block ? row_bytes(rscales[std::size_t(d)], row) : nullptr;
        const std::size_t sbytes = std::size_t(nb) * dtype_size(sdt);
        if (row >= used) {  // untouched
          for (std::int64_t h = 0; h < H; ++h) ASSERT_EQ(q[h], 0xff);
          for (std::size_t b = 0; b < sbytes; ++b) ASSERT_EQ(sc[b], 0xff);
          continue;
        }
        ASSERT_EQ(std::memcmp(row_bytes(rprobs[std::size_t(d)], row), row_bytes(rprobs2[std::size_t(d)], row), 4), 0);
        if (is_pad_row(s.plan, d, row)) {
          for (std::int64_t h = 0; h < H; ++h) ASSERT_EQ(q[h], 0x00);
          for (std::int64_t j = 0; j < nb; ++j) {
            if (c.scaling == Fp8Scaling::Mx1x32)
              ASSERT_EQ(sc[j], 127);
            else
              ASSERT_EQ(std::bit_cast<float>(*reinterpret_cast<const std::uint32_t*>(sc + 4 * j)), 1.0f);
          }
          continue;
        }
        const TensorView one(const_cast<unsigned char*>(row_bytes(recv16[std::size_t(d)], row)), DType::BF16, {1, H});
        HostTensor q1(DType::F8E4M3, {1, H}), s1 = block ? HostTensor(sdt, {1, nb}) : HostTensor(DType::F32, {1});
        if (!block) s1.set_f(0, 0.02);
        ref::quantize_fp8(c.scaling, one, q1, s1);
        ASSERT_EQ(std::memcmp(q, q1.view().data(), std::size_t(H)), 0);
        if (block) ASSERT_EQ(std::memcmp(sc, s1.view().data(), sbytes), 0);
      }
    }
  }
}

TEST(DispatchFp8, PreQuantizedRowsMoveAsBytes) {
  Rng rng(78);
  for (Fp8Scaling sc : {Fp8Scaling::Block1x128, Fp8Scaling::Mx1x32, Fp8Scaling::PerTensor}) {
    SCOPED_TRACE(std::string(fp8_scaling_name(sc)));
    const std::int64_t H = 256, block = fp8_scale_block_cols(sc), nb = block ? H / block : 0, K = 3;
    const Routed s = make_setup(rng, 2, 8, K, 16, 25, H, 0.8);
    const DType sdt = fp8_scale_dtype(sc);
    std::vector<std::int64_t> tokens = {tokens_of(s, 0), tokens_of(s, 1)};
    PerRank q = test::per_rank(DType::F8E4M3, tokens, H), qs = test::per_rank(sdt, tokens, nb);
    for (PerRank* p : {&q, &qs})
      for (const HostTensor& t : *p) {
        auto* b = static_cast<unsigned char*>(t.view().data());
        for (std::size_t i = 0; i < t.view().nbytes(); ++i) b[i] = static_cast<unsigned char>(rng.next());
      }
    PerRank recv = dest_tensors(s, DType::F8E4M3, H), rscales = dest_tensors(s, sdt, nb);
    const auto qv = views(q), qsv = views(qs), rv = views(recv), rsv = views(rscales);
    ref::DispatchFp8Args a;
    a.scaling = sc;
    a.q = qv;
    if (block) {
      a.q_scales = qsv;
      a.recv_scales = rsv;
    }
    a.recv = rv;
    ref::dispatch_fp8_forward(s.plan, a);
    for (std::int64_t r = 0; r < 2; ++r)
      for (std::int64_t t = 0; t < tokens[std::size_t(r)]; ++t)
        for (std::int64_t k = 0; k < K; ++k) {
          const auto i = std::size_t(t * K + k);
          const std::int64_t d = s.plan.dest_rank[std::size_t(r)][i], row = s.plan.dest_row[std::size_t(r)][i];
          if (d < 0) continue;
          ASSERT_EQ(std::memcmp(row_bytes(recv[std::size_t(d)], row), row_bytes(q[std::size_t(r)], t), std::size_t(H)),
                    0);
          if (block)
            ASSERT_EQ(std::memcmp(row_bytes(rscales[std::size_t(d)], row), row_bytes(qs[std::size_t(r)], t),
                                  std::size_t(nb) * dtype_size(sdt)),
                      0);
        }
  }
}

TEST(DispatchFp8, RowsOfAnyDtypeMoveWithThePadPattern) {
  Rng rng(79);
  const Routed s = make_setup(rng, 1, 4, 2, 16, 10, 4, 0);
  const std::int64_t T = tokens_of(s, 0);
  PerRank x = test::per_rank(DType::F32, {T}, 3);
  for (std::int64_t i = 0; i < T * 3; ++i) x[0].set_f(i, double(i) + 0.5);
  PerRank recv = dest_tensors(s, DType::F32, 3);
  const auto xv = views(x), rv = views(recv);
  ref::dispatch_rows_forward(s.plan, {xv, rv, std::bit_cast<std::uint32_t>(-2.0f)});
  for (std::int64_t row = 0; row < s.plan.rows_used[0]; ++row)
    if (is_pad_row(s.plan, 0, row))
      for (std::int64_t h = 0; h < 3; ++h) EXPECT_EQ(recv[0].f(row * 3 + h), -2.0);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < 2; ++k) {
      const std::int64_t row = s.plan.dest_row[0][std::size_t(t * 2 + k)];
      if (row >= 0)
        for (std::int64_t h = 0; h < 3; ++h) EXPECT_EQ(recv[0].f(row * 3 + h), x[0].f(t * 3 + h));
    }
}

TEST(DispatchFp8, ErrorsNameTheArgumentAndWriteNothing) {
  Rng rng(80);
  const std::int64_t H = 96;  // a multiple of 32, not of 128
  const Routed s = make_setup(rng, 1, 4, 2, 16, 10, H, 0);
  const std::int64_t T = tokens_of(s, 0);
  PerRank x = test::per_rank(DType::BF16, {T}, H), q = test::per_rank(DType::F8E4M3, {T}, H);
  PerRank recv = dest_tensors(s, DType::F8E4M3, H), rs_block = dest_tensors(s, DType::F32, 1),
          rs_mx = dest_tensors(s, kE8M0ScaleDType, H / 32);
  HostTensor zero_scale(DType::F32, {1});
  const auto xv = views(x), qv = views(q), rv = views(recv), rb = views(rs_block), rm = views(rs_mx);
  auto expect_error = [&](const ref::DispatchFp8Args& a, const std::string& needle) {
    try {
      ref::dispatch_fp8_forward(s.plan, a);
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    const auto* b = static_cast<const unsigned char*>(recv[0].view().data());
    for (std::size_t i = 0; i < recv[0].view().nbytes(); ++i) ASSERT_EQ(b[i], 0xff) << "written before the error";
  };
  ref::DispatchFp8Args a;
  a.scaling = Fp8Scaling::Mx1x32;
  a.x = xv;
  a.q = qv;
  a.recv = rv;
  a.recv_scales = rm;
  expect_error(a, "exactly one");
  a.q = {};
  a.scaling = Fp8Scaling::Block1x128;
  a.recv_scales = rb;
  expect_error(a, "multiple of 128");
  a.scaling = Fp8Scaling::PerTensor;
  a.recv_scales = {};
  a.tensor_scale = zero_scale.view();
  expect_error(a, "tensor_scale = 0");
  a.recv_scales = rm;
  expect_error(a, "recv_scales");
}

}  // namespace
}  // namespace moerail
