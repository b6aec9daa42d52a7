// GPU segment-transposed quantizer (quantize_fp8_transposed, moerail/quant.h) against the CPU reference
// (ref::quantize_fp8_transposed), bit for bit: the e4m3 blocks and their 1x128 scales, for unaligned and aligned
// segments, empty experts, all rows on one expert, clipped and negative counts, i32 and i64 counts; rows binades apart
// (a block's amax decides its scale), a zero column block, NaN / inf / -0 elements. Outputs are poisoned (0xff)
// first: bytes past the last block must stay poisoned. Also one captured graph replayed with other counts, and the
// argument errors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "quant/segment_cases.h"
#include "moerail/error.h"
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
  return testing::random_segment_rows(rows, C, seed, /*inf_and_zero_block=*/true);
}

// Runs the GPU op on `counts` (device buffers of the case's size) and compares every byte of qt and qt_scales with
// the reference's, poison included where neither writes.
void expect_matches(const HostTensor& x, const std::vector<std::int64_t>& counts, bool i64,
                    const DeviceTensor& dcounts, const DeviceTensor& dqt, const DeviceTensor& dqs,
                    const std::string& what, const std::function<void()>& run) {
  const std::int64_t rows = x.view().size(0), C = x.view().size(1), L = std::int64_t(counts.size());
  const std::int64_t rows_t = fp8_transposed_rows(rows, L);
  HostTensor hc(i64 ? DType::I64 : DType::I32, {L});
  for (std::int64_t e = 0; e < L; ++e) hc.set_i(e, counts[std::size_t(e)]);
  dcounts.upload(hc);
  dqt.poison();
  dqs.poison();
  run();
  MOERAIL_TEST_CUDA(cudaDeviceSynchronize());
  HostTensor want_q(DType::F8E4M3, {C * rows_t}), want_s(DType::F32, {C * rows_t / 128});
  std::memset(want_q.view().data(), 0xff, std::size_t(C * rows_t));
  std::memset(want_s.view().data(), 0xff, std::size_t(C * rows_t / 128) * 4);
  QuantizeTransposedArgs a;
  a.x = x.view();
  a.counts = hc.view();
  a.qt = want_q.view();
  a.qt_scales = want_s.view();
  ref::quantize_fp8_transposed(a);
  HostTensor got_q(DType::F8E4M3, {C * rows_t}), got_s(DType::F32, {C * rows_t / 128});
  dqt.download(got_q);
  dqs.download(got_s);
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < C * rows_t; ++i)
    if (!testing::same_bits(got_q.view(), want_q.view(), i) && bad++ < 5)
      ADD_FAILURE() << what << ": qt[" << i << "] = " << int(static_cast<const std::uint8_t*>(got_q.view().data())[i])
                    << ", expected " << int(static_cast<const std::uint8_t*>(want_q.view().data())[i]);
  for (std::int64_t i = 0; i < C * rows_t / 128; ++i)
    if (!testing::same_bits(got_s.view(), want_s.view(), i) && bad++ < 10)
      ADD_FAILURE() << what << ": qt_scales[" << i << "] = " << got_s.f(i) << ", expected " << want_s.f(i);
  EXPECT_EQ(bad, 0) << what;
}

TEST(QuantTransposedGpu, MatchesTheReferenceBitForBit) {
  MOERAIL_REQUIRE_GPU();
  const std::vector<Case> cases = {
      {300, 192, {130, 0, 100, 70}, false},        // unaligned, an empty expert
      {512, 256, {128, 128, 256, 0}, true},        // aligned
      {200, 128, {300, -4, 50}, false},            // clipped past the rows, a negative count
      {129, 64, {0, 0, 129}, true},                // one row past a block, leading empty experts
      {1000, 64, {1000}, false},                   // one expert
      {64, 64, {0, 0, 0, 0, 0}, true},             // no rows routed
      {700, 320, {1, 2, 3, 500, 194}, false},      // tiny segments
      {2000, 64, forty_counts(), true},            // 40 experts: the scans run past 32, empties around it
      {8192, 1024, {3000, 2000, 0, 2500, 692}, false},  // 1104 items: more than one per CTA (the prefetch path)
  };
  for (const Case& c : cases) {
    const std::string what = "rows " + std::to_string(c.rows) + " C " + std::to_string(c.C) + " counts " +
                             ::testing::PrintToString(c.counts) + (c.i64 ? " i64" : " i32");
    SCOPED_TRACE(what);
    const std::int64_t L = std::int64_t(c.counts.size()), rows_t = fp8_transposed_rows(c.rows, L);
    const HostTensor x = random_x(c.rows, c.C, std::uint64_t(c.rows * 31 + c.C));
    DeviceTensor dx(DType::BF16, {c.rows, c.C}), dcounts(c.i64 ? DType::I64 : DType::I32, {L}),
        dqt(DType::F8E4M3, {c.C * rows_t}), dqs(DType::F32, {c.C * rows_t / 128});
    dx.upload(x);
    QuantizeTransposedArgs a;
    a.x = dx.view();
    a.counts = dcounts.view();
    a.qt = dqt.view();
    a.qt_scales = dqs.view();
    expect_matches(x, c.counts, c.i64, dcounts, dqt, dqs, what, [&] { quantize_fp8_transposed(a, nullptr); });
  }
}

// The fused forms, bit for bit against the reference: an FP8 x (codes + 1x128 scales, made by the reference from a
// random x) and a bf16 x with the row-wise codes too (q / q_scales poisoned first: rows past the segments must stay
// poisoned). C multiples of 128; segments as above.
TEST(QuantTransposedGpu, FusedFormsMatchTheReferenceBitForBit) {
  MOERAIL_REQUIRE_GPU();
  const std::vector<Case> cases = {
      {300, 256, {130, 0, 100, 50}, false},   // unaligned, an empty expert, 20 rows past the segments
      {512, 128, {128, 128, 256, 0}, true},   // aligned
      {200, 384, {300, -4, 50}, false},       // clipped, a negative count
      {2000, 128, forty_counts(), true},      // 40 experts
      {64, 128, {0, 0, 0}, false},            // no rows routed
      {8192, 1024, {3000, 2000, 0, 2500, 692}, true},  // 552 items: more than one per CTA (the prefetch path)
  };
  auto bad_bytes = [](const HostTensor& got, const HostTensor& want, const std::string& name) {
    std::int64_t bad = 0;
    for (std::int64_t i = 0; i < got.view().numel(); ++i)
      if (!testing::same_bits(got.view(), want.view(), i) && bad++ < 5) ADD_FAILURE() << name << "[" << i << "] differs";
    return bad;
  };
  for (const Case& c : cases) {
    for (const bool fp8_source : {true, false}) {
      const std::string what = std::string(fp8_source ? "FP8 x" : "bf16 x + q") + ", rows " + std::to_string(c.rows) +
                               " C " + std::to_string(c.C) + " counts " + ::testing::PrintToString(c.counts);
      SCOPED_TRACE(what);
      const std::int64_t L = std::int64_t(c.counts.size()), rows_t = fp8_transposed_rows(c.rows, L);
      const HostTensor x = random_x(c.rows, c.C, std::uint64_t(c.rows * 7 + c.C));
      HostTensor xq(DType::F8E4M3, {c.rows, c.C}), xs(DType::F32, {c.rows, c.C / 128});
      ref::quantize_fp8(Fp8Scaling::Block1x128, x.view(), xq.view(), xs.view());
      HostTensor hc(c.i64 ? DType::I64 : DType::I32, {L});
      for (std::int64_t e = 0; e < L; ++e) hc.set_i(e, c.counts[std::size_t(e)]);
      DeviceTensor dx(fp8_source ? DType::F8E4M3 : DType::BF16, {c.rows, c.C}), dxs(DType::F32, {c.rows, c.C / 128}),
          dcounts(hc.view().dtype(), {L}), dqt(DType::F8E4M3, {c.C * rows_t}), dqs(DType::F32, {c.C * rows_t / 128}),
          dq(DType::F8E4M3, {c.rows, c.C}), dqsc(DType::F32, {c.rows, c.C / 128});
      dx.upload(fp8_source ? xq : x);
      dxs.upload(xs);
      dcounts.upload(hc);
      for (const DeviceTensor* t : {&dqt, &dqs, &dq, &dqsc}) t->poison();
      QuantizeTransposedArgs a;
      a.x = dx.view();
      a.counts = dcounts.view();
      a.qt = dqt.view();
      a.qt_scales = dqs.view();
      if (fp8_source) {
        a.x_scales = dxs.view();
      } else {
        a.q = dq.view();
        a.q_scales = dqsc.view();
      }
      quantize_fp8_transposed(a, nullptr);
      MOERAIL_TEST_CUDA(cudaDeviceSynchronize());

      HostTensor want_qt(DType::F8E4M3, {c.C * rows_t}), want_qs(DType::F32, {c.C * rows_t / 128}),
          want_q(DType::F8E4M3, {c.rows, c.C}), want_qsc(DType::F32, {c.rows, c.C / 128});
      for (const HostTensor* t : {&want_qt, &want_qs, &want_q, &want_qsc})
        std::memset(t->view().data(), 0xff, t->view().nbytes());
      QuantizeTransposedArgs r = a;
      r.x = fp8_source ? xq.view() : x.view();
      r.x_scales = fp8_source ? xs.view() : TensorView();
      r.counts = hc.view();
      r.qt = want_qt.view();
      r.qt_scales = want_qs.view();
      r.q = fp8_source ? TensorView() : want_q.view();
      r.q_scales = fp8_source ? TensorView() : want_qsc.view();
      ref::quantize_fp8_transposed(r);
      HostTensor got_qt(DType::F8E4M3, {c.C * rows_t}), got_qs(DType::F32, {c.C * rows_t / 128}),
          got_q(DType::F8E4M3, {c.rows, c.C}), got_qsc(DType::F32, {c.rows, c.C / 128});
      dqt.download(got_qt);
      dqs.download(got_qs);
      dq.download(got_q);
      dqsc.download(got_qsc);
      EXPECT_EQ(bad_bytes(got_qt, want_qt, "qt"), 0);
      EXPECT_EQ(bad_bytes(got_qs, want_qs, "qt_scales"), 0);
      EXPECT_EQ(bad_bytes(got_q, want_q, "q"), 0);  // FP8 x: both all poison
      EXPECT_EQ(bad_bytes(got_qsc, want_qsc, "q_scales"), 0);
    }
  }
}

TEST(QuantTransposedGpu, GraphReplaysWithOtherCounts) {
  MOERAIL_REQUIRE_GPU();
  const std::int64_t rows = 600, C = 128, L = 4, rows_t = fp8_transposed_rows(rows, L);
  const HostTensor x = random_x(rows, C, 77);
  DeviceTensor dx(DType::BF16, {rows, C}), dcounts(DType::I32, {L}), dqt(DType::F8E4M3, {C * rows_t}),
      dqs(DType::F32, {C * rows_t / 128});
  dx.upload(x);
  QuantizeTransposedArgs a;
  a.x = dx.view();
  a.counts = dcounts.view();
  a.qt = dqt.view();
  a.qt_scales = dqs.view();
  cudaStream_t stream = nullptr;
  MOERAIL_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOERAIL_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  quantize_fp8_transposed(a, stream);
  MOERAIL_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  MOERAIL_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (const std::vector<std::int64_t>& counts :
       {std::vector<std::int64_t>{150, 150, 150, 150}, {0, 600, 0, 0}, {0, 0, 0, 0}, {1, 0, 255, 129}}) {
    const std::string what = "graph replay, counts " + ::testing::PrintToString(counts);
    SCOPED_TRACE(what);
    expect_matches(x, counts, false, dcounts, dqt, dqs, what, [&] {
      MOERAIL_TEST_CUDA(cudaGraphLaunch(exec, stream));
      MOERAIL_TEST_CUDA(cudaStreamSynchronize(stream));
    });
  }
  MOERAIL_TEST_CUDA(cudaGraphExecDestroy(exec));
  MOERAIL_TEST_CUDA(cudaGraphDestroy(graph));
  MOERAIL_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(QuantTransposedGpu, ErrorsNameTheArgument) {
  MOERAIL_REQUIRE_GPU();
  DeviceTensor dx(DType::BF16, {100, 96}), dcounts(DType::I32, {2}), dqt(DType::F8E4M3, {96 * 384}),
      dqs(DType::F32, {96 * 384 / 128});
  QuantizeTransposedArgs a;
  a.x = dx.view();
  a.counts = dcounts.view();
  a.qt = dqt.view();
  a.qt_scales = dqs.view();
  auto expect_error = [&](const QuantizeTransposedArgs& args, const std::string& needle) {
    try {
      quantize_fp8_transposed(args, nullptr);
      ADD_FAILURE() << "accepted; expected an error naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(a, "C = 96");  // not a multiple of 64
  DeviceTensor dx2(DType::BF16, {100, 128}), dqt2(DType::F8E4M3, {128 * 100});
  a.x = dx2.view();
  a.qt = dqt2.view();
  expect_error(a, "qt has shape");
  DeviceTensor dq(DType::F8E4M3, {100, 96}), dqs2(DType::F32, {100, 1});
  a.x = dx.view();
  a.qt = dqt.view();
  a.q = dq.view();
  a.q_scales = dqs2.view();
  expect_error(a, "multiple of 128 (q:");  // C = 96 with the row-wise codes
  a.q = TensorView();
  a.q_scales = TensorView();
  a.x_scales = dqs2.view();
  expect_error(a, "x_scales is given (an FP8 x) but x has dtype bf16");
}

}  // namespace
}  // namespace moerail
