// GPU per-tensor quantization with one scale per expert (moerail/quant.h: quantize_fp8_experts, the per-tensor forms
// of quantize_fp8_transposed and quantize_weights_fp8) against the CPU reference, bit for bit: scales and codes for
// uneven, empty, clipped and negative counts, i32 and i64 counts, 40 experts (the scans past 32), experts whose
// magnitudes are binades apart (each expert's amax decides its scale), NaN and -0 elements. Outputs are poisoned
// first: rows past the segments must stay poisoned. Also the invariant that makes the per-tensor wgrad copies the
// forward's own tensors (a copy is the row codes transposed), a captured graph replayed with other counts, and the
// argument errors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "quant/segment_cases.h"
#include "moerail/error.h"
#include "moerail/experts.h"  // kMaxLocalExperts
#include "moerail/quant.h"
#include "moerail/reference/host.h"
#include "moerail/reference/quant.h"

namespace moerail {
namespace {

using ref::HostTensor;
using testing::DeviceTensor;

using testing::forty_counts;
using Case = testing::SegmentCase;

HostTensor random_x(std::int64_t rows, std::int64_t C, std::uint64_t seed) {
  return testing::random_segment_rows(rows, C, seed, /*inf_and_zero_block=*/false);
}

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {300, 256, {130, 0, 100, 50}, false},             // uneven, an empty expert, 20 rows past the segments
      {512, 128, {128, 128, 256, 0}, true},             // aligned
      {200, 384, {300, -4, 50}, false},                 // clipped past the rows, a negative count
      {2000, 128, forty_counts(), true},                // 40 experts
      {64, 128, {0, 0, 0}, false},                      // no rows routed: every scale 1
      {4096, 1024, {1500, 1000, 0, 1250, 346}, true},   // many rows per CTA
  };
  return c;
}

HostTensor counts_tensor(const Case& c) {
  HostTensor hc(c.i64 ? DType::I64 : DType::I32, {std::int64_t(c.counts.size())});
  for (std::size_t e = 0; e < c.counts.size(); ++e) hc.set_i(std::int64_t(e), c.counts[e]);
  return hc;
}

std::int64_t bad_bytes(const HostTensor& got, const HostTensor& want, const std::string& name) {
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < got.view().numel(); ++i)
    if (!testing::same_bits(got.view(), want.view(), i) && bad++ < 5) ADD_FAILURE() << name << "[" << i << "] differs";
  return bad;
}

HostTensor poisoned(DType t, std::vector<std::int64_t> shape) {
  HostTensor h(t, std::move(shape));
  std::memset(h.view().data(), 0xff, h.view().nbytes());
  return h;
}

TEST(QuantExpertsGpu, ScalesAndCodesMatchTheReferenceBitForBit) {
  MOERAIL_REQUIRE_GPU();
  for (const Case& c : cases())
  for (const DType format : {DType::F8E4M3, DType::F8E5M2}) {  // e5m2: the hybrid recipe's gradients
    const std::string what = std::string(dtype_name(format)) + ", rows " + std::to_string(c.rows) + " C " +
                             std::to_string(c.C) + " counts " + ::testing::PrintToString(c.counts);
    SCOPED_TRACE(what);
    const std::int64_t L = std::int64_t(c.counts.size());
    const HostTensor x = random_x(c.rows, c.C, std::uint64_t(c.rows * 13 + c.C)), hc = counts_tensor(c);
    DeviceTensor dx(DType::BF16, {c.rows, c.C}), dcounts(hc.view().dtype(), {L}), dq(format, {c.rows, c.C}),
        ds(DType::F32, {L});
    dx.upload(x);
    dcounts.upload(hc);
    dq.poison();
    ds.poison();
    quantize_fp8_experts({dx.view(), dcounts.view(), dq.view(), ds.view(), format}, nullptr);
    MOERAIL_TEST_CUDA(cudaDeviceSynchronize());
    HostTensor want_q = poisoned(format, {c.rows, c.C}), want_s(DType::F32, {L});
    ref::quantize_fp8_experts({x.view(), hc.view(), want_q.view(), want_s.view(), format});
    HostTensor got_q(format, {c.rows, c.C}), got_s(DType::F32, {L});
    dq.download(got_q);
    ds.download(got_s);
    EXPECT_EQ(bad_bytes(got_s, want_s, "scales"), 0);
    EXPECT_EQ(bad_bytes(got_q, want_q, "q"), 0);
    // the scales are each expert's own: not all equal when several experts have rows
    int distinct = 0;
    for (std::int64_t e = 1; e < L; ++e) distinct += want_s.f(e) != want_s.f(0);
    if (c.counts.size() > 3 && c.rows >= 300) EXPECT_GT(distinct, 0);
  }
}

// The per-tensor copies: bf16 x (with and without the row codes, e4m3 or e5m2) and an e4m3 x whose scales are the
// experts', bit for bit against the reference; and a copy holds exactly the row codes transposed (what makes the
// weight gradient's operands the forward's and the dgrads' own tensors).
TEST(QuantExpertsGpu, TransposedCopiesMatchTheReferenceBitForBit) {
  MOERAIL_REQUIRE_GPU();
  for (const Case& c : cases()) {
    for (const int form : {0, 1, 2, 3, 4}) {  // 0 bf16 x + q, 1 bf16 x, 2 e4m3 x; 3 and 4: 0 and 1 in e5m2
      const DType codes = form >= 3 ? DType::F8E5M2 : DType::F8E4M3;
      const bool with_q = form == 0 || form == 3;
      const std::string what = std::string(with_q ? "bf16 x + q" : form == 2 ? "e4m3 x" : "bf16 x") + ", " +
                               std::string(dtype_name(codes)) + ", rows " + std::to_string(c.rows) + " C " +
                               std::to_string(c.C) + " counts " + ::testing::PrintToString(c.counts);
      SCOPED_TRACE(what);
      const std::int64_t L = std::int64_t(c.counts.size()), rows_t = fp8_transposed_rows(c.rows, L);
      const HostTensor x = random_x(c.rows, c.C, std::uint64_t(c.rows * 5 + c.C)), hc = counts_tensor(c);
      HostTensor xq = poisoned(codes, {c.rows, c.C}), xs(DType::F32, {L});
      ref::quantize_fp8_experts({x.view(), hc.view(), xq.view(), xs.view(), codes});
      DeviceTensor dx(form == 2 ? DType::F8E4M3 : DType::BF16, {c.rows, c.C}), dxs(DType::F32, {L}),
          dcounts(hc.view().dtype(), {L}), dqt(codes, {c.C * rows_t}), dqs(DType::F32, {c.C * rows_t / 128}),
          dq(codes, {c.rows, c.C});
      dx.upload(form == 2 ? xq : x);
      dxs.upload(xs);
      dcounts.upload(hc);
      for (const DeviceTensor* t : {&dqt, &dqs, &dq}) t->poison();
      QuantizeTransposedArgs a;
      a.x = dx.view();
      a.counts = dcounts.view();
      a.qt = dqt.view();
      a.qt_scales = dqs.view();
      a.tensor_scales = dxs.view();
      if (with_q) a.q = dq.view();
      quantize_fp8_transposed(a, nullptr);
      MOERAIL_TEST_CUDA(cudaDeviceSynchronize());

      HostTensor want_qt = poisoned(codes, {c.C * rows_t}), want_qs = poisoned(DType::F32, {c.C * rows_t / 128}),
                 want_q = poisoned(codes, {c.rows, c.C});
      QuantizeTransposedArgs r;
      r.x = form == 2 ? xq.view() : x.view();
      r.counts = hc.view();
      r.qt = want_qt.view();
      r.qt_scales = want_qs.view();
      r.tensor_scales = xs.view();
      if (with_q) r.q = want_q.view();
      ref::quantize_fp8_transposed(r);
      HostTensor got_qt(codes, {c.C * rows_t}), got_qs(DType::F32, {c.C * rows_t / 128}), got_q(codes, {c.rows, c.C});
      dqt.download(got_qt);
      dqs.download(got_qs);
      dq.download(got_q);
      EXPECT_EQ(bad_bytes(got_qt, want_qt, "qt"), 0);
      EXPECT_EQ(bad_bytes(got_qs, want_qs, "qt_scales"), 0);
      EXPECT_EQ(bad_bytes(got_q, want_q, "q"), 0);  // forms without q: all poison

      // the copy is the row codes (xq: the reference's quantize_fp8_experts) transposed, segment by segment
      const std::uint8_t* rq = static_cast<const std::uint8_t*>(xq.view().data());
      const std::uint8_t* tq = static_cast<const std::uint8_t*>(got_qt.view().data());
      std::int64_t start = 0, padded = 0, bad = 0;
      for (std::int64_t e = 0; e < L; ++e) {
        const std::int64_t n = std::min(std::max<std::int64_t>(c.counts[std::size_t(e)], 0), c.rows - start);
        const std::int64_t R = (n + 127) / 128 * 128;
        for (std::int64_t ch = 0; ch < c.C; ++ch) {
          for (std::int64_t i = 0; i < n; ++i)
            if (tq[c.C * padded + ch * R + i] != rq[(start + i) * c.C + ch] && bad++ < 5)
              ADD_FAILURE() << "expert " << e << ": copy[" << ch << ", " << i << "] is not the row code";
          for (std::int64_t b = 0; b < R / 128; ++b)
            if (got_qs.f(c.C * padded / 128 + ch * (R / 128) + b) != xs.f(e) && bad++ < 5)
              ADD_FAILURE() << "expert " << e << ": a copy scale is not the expert's";
        }
        start += n;
        padded += R;
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

TEST(QuantExpertsGpu, PerTensorWeightsMatchTheReferenceBitForBit) {
  MOERAIL_REQUIRE_GPU();
  for (const auto& [L, N, K] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{3, 256, 384}, {1, 128, 128},
                                {5, 384, 256}}) {
    for (const bool transposed : {true, false}) {
      SCOPED_TRACE("w [" + std::to_string(L) + ", " + std::to_string(N) + ", " + std::to_string(K) + "]" +
                   (transposed ? " with qt" : ""));
      HostTensor w(DType::BF16, {L, N, K});
      ref::Rng rng(std::uint64_t(L * 1000 + N + K));
      for (std::int64_t e = 0; e < L; ++e) {
        const double m = std::ldexp(1.0, int(e * 5) - 8);  // experts binades apart
        for (std::int64_t i = 0; i < N * K; ++i) w.set_f(e * N * K + i, rng.normal() * m);
      }
      DeviceTensor dw(DType::BF16, {L, N, K}), dq(DType::F8E4M3, {L, N, K}), ds(DType::F32, {L}),
          dqt(DType::F8E4M3, {L, K, N}), dts(DType::F32, {L});
      dw.upload(w);
      for (const DeviceTensor* t : {&dq, &ds, &dqt, &dts}) t->poison();
      QuantizeWeightsArgs a{dw.view(), dq.view(), ds.view(), transposed ? dqt.view() : TensorView(),
                            transposed ? dts.view() : TensorView(), Fp8Scaling::PerTensor};
      quantize_weights_fp8(a, nullptr);
      MOERAIL_TEST_CUDA(cudaDeviceSynchronize());
      HostTensor want_q(DType::F8E4M3, {L, N, K}), want_s(DType::F32, {L}), want_qt = poisoned(DType::F8E4M3, {L, K, N}),
          want_ts = poisoned(DType::F32, {L});
      ref::quantize_weights_fp8({w.view(), want_q.view(), want_s.view(), transposed ? want_qt.view() : TensorView(),
                                 transposed ? want_ts.view() : TensorView(), Fp8Scaling::PerTensor});
      HostTensor got_q(DType::F8E4M3, {L, N, K}), got_s(DType::F32, {L}), got_qt(DType::F8E4M3, {L, K, N}),
          got_ts(DType::F32, {L});
      dq.download(got_q);
      ds.download(got_s);
      dqt.download(got_qt);
      dts.download(got_ts);
      EXPECT_EQ(bad_bytes(got_s, want_s, "q_scales"), 0);
      EXPECT_EQ(bad_bytes(got_q, want_q, "q"), 0);
      EXPECT_EQ(bad_bytes(got_qt, want_qt, "qt"), 0);
      EXPECT_EQ(bad_bytes(got_ts, want_ts, "qt_scales"), 0);
      for (std::int64_t e = 1; e < L; ++e) EXPECT_NE(want_s.f(e), want_s.f(0)) << "expert " << e << "'s own scale";
    }
  }
}

TEST(QuantExpertsGpu, GraphReplaysWithOtherCounts) {
  MOERAIL_REQUIRE_GPU();
  const std::int64_t rows = 600, C = 256, L = 4;
  const HostTensor x = random_x(rows, C, 99);
  DeviceTensor dx(DType::BF16, {rows, C}), dcounts(DType::I32, {L}), dq(DType::F8E4M3, {rows, C}), ds(DType::F32, {L});
  dx.upload(x);
  cudaStream_t stream = nullptr;
  MOERAIL_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOERAIL_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  quantize_fp8_experts({dx.view(), dcounts.view(), dq.view(), ds.view()}, stream);
  MOERAIL_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  MOERAIL_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (const std::vector<std::int64_t>& counts :
       {std::vector<std::int64_t>{150, 150, 150, 150}, {0, 600, 0, 0}, {0, 0, 0, 0}, {1, 0, 255, 129}}) {
    SCOPED_TRACE("graph replay, counts " + ::testing::PrintToString(counts));
    HostTensor hc(DType::I32, {L});
    for (std::int64_t e = 0; e < L; ++e) hc.set_i(e, counts[std::size_t(e)]);
    dcounts.upload(hc);
    dq.poison();
    MOERAIL_TEST_CUDA(cudaGraphLaunch(exec, stream));
    MOERAIL_TEST_CUDA(cudaStreamSynchronize(stream));
    HostTensor want_q = poisoned(DType::F8E4M3, {rows, C}), want_s(DType::F32, {L}), got_q(DType::F8E4M3, {rows, C}),
               got_s(DType::F32, {L});
    ref::quantize_fp8_experts({x.view(), hc.view(), want_q.view(), want_s.view()});
    dq.download(got_q);
    ds.download(got_s);
    EXPECT_EQ(bad_bytes(got_s, want_s, "scales"), 0);
    EXPECT_EQ(bad_bytes(got_q, want_q, "q"), 0);
  }
  MOERAIL_TEST_CUDA(cudaGraphExecDestroy(exec));
  MOERAIL_TEST_CUDA(cudaGraphDestroy(graph));
  MOERAIL_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(QuantExpertsGpu, ErrorsNameTheArgument) {
  MOERAIL_REQUIRE_GPU();
  DeviceTensor dx(DType::BF16, {100, 128}), dx12(DType::BF16, {100, 12}), dcounts(DType::I32, {2}),
      dq(DType::F8E4M3, {100, 128}), ds(DType::F32, {2}), ds3(DType::F32, {3}), dqt(DType::F8E4M3, {128 * 356}),
      dqs(DType::F32, {356}), dqsc(DType::F32, {100, 1});
  auto expect_error = [](const auto& run, const std::string& needle) {
    try {
      run();
      ADD_FAILURE() << "accepted; expected an error naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { quantize_fp8_experts({dx.view(), dcounts.view(), dq.view(), ds3.view()}, nullptr); },
               "scales has shape");
  expect_error([&] { quantize_fp8_experts({dx.view(), dcounts.view(), dq.view(), TensorView()}, nullptr); },
               "scales is absent");
  expect_error([&] { quantize_fp8_experts({dx12.view(), dcounts.view(), TensorView(), ds.view()}, nullptr); },
               "C = 12");
  QuantizeTransposedArgs a;
  a.x = dx.view();
  a.counts = dcounts.view();
  a.qt = dqt.view();
  a.qt_scales = dqs.view();
  a.tensor_scales = ds3.view();
  expect_error([&] { quantize_fp8_transposed(a, nullptr); }, "tensor_scales has shape");
  a.tensor_scales = ds.view();
  a.q = dq.view();
  a.q_scales = dqsc.view();
  expect_error([&] { quantize_fp8_transposed(a, nullptr); }, "q_scales with tensor_scales");
  a.q_scales = TensorView();
  a.x_scales = dqsc.view();
  expect_error([&] { quantize_fp8_transposed(a, nullptr); }, "x_scales with tensor_scales");
  // per-tensor weights: one scale per expert, reduced in shared memory for at most kMaxLocalExperts experts
  const std::int64_t many = kMaxLocalExperts + 1;
  DeviceTensor dw(DType::BF16, {many, 8, 128}), dwq(DType::F8E4M3, {many, 8, 128}), dws(DType::F32, {many});
  expect_error([&] {
    quantize_weights_fp8({dw.view(), dwq.view(), dws.view(), TensorView(), TensorView(), Fp8Scaling::PerTensor},
                         nullptr);
  }, "1 <= L <= 1024");
  DeviceTensor dsx(DType::Bool, {16});  // a misaligned scales view
  const TensorView odd(static_cast<char*>(dsx.data()) + 2, DType::F32, {2}, dsx.view().device());
  expect_error([&] { quantize_fp8_experts({dx.view(), dcounts.view(), dq.view(), odd}, nullptr); },
               "not 4-byte aligned");
  // e5m2: q must be of the format asked for; the copies' e5m2 is the per-tensor form's from bf16 only
  expect_error([&] { quantize_fp8_experts({dx.view(), dcounts.view(), dq.view(), ds.view(), DType::F8E5M2}, nullptr); },
               "q has dtype");
  expect_error([&] { quantize_fp8_experts({dx.view(), dcounts.view(), dq.view(), ds.view(), DType::BF16}, nullptr); },
               "format = bf16");
  DeviceTensor dqt5(DType::F8E5M2, {128 * 356});
  QuantizeTransposedArgs block;  // the 1x128 form
  block.x = dx.view();
  block.counts = dcounts.view();
  block.qt = dqt5.view();
  block.qt_scales = dqs.view();
  expect_error([&] { quantize_fp8_transposed(block, nullptr); }, "qt is fp8_e5m2");
  QuantizeTransposedArgs mixed = block;  // e5m2 copies with e4m3 row codes
  mixed.tensor_scales = ds.view();
  mixed.q = dq.view();
  expect_error([&] { quantize_fp8_transposed(mixed, nullptr); }, "q has dtype");
  QuantizeTransposedArgs from_codes = block;  // an e4m3 x: its copy is its own codes, e4m3 only
  from_codes.x = dq.view();
  from_codes.tensor_scales = ds.view();
  expect_error([&] { quantize_fp8_transposed(from_codes, nullptr); }, "qt is fp8_e5m2");
}

}  // namespace
}  // namespace moerail
