// GPU weight quantizer (quantize_weights_fp8, moerail/quant.h) against the CPU reference
// (ref::quantize_weights_fp8), bit for bit: codes and 128x128 scales of q and of the transposed copy qt, on shapes
// with one and many blocks, a partial last block of rows (N % 128 != 0, no qt), one magnitude per block (2^-20 ..
// 2^20, so a scale from the wrong block is off by binades), a zero block, NaN / ±inf / -0 / huge elements; outputs
// are poisoned (0xff) first, so anything not written shows. Also: qt is the transpose of q bit for bit, one captured
// graph replayed with new weights, and the argument errors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "moerail/quant.h"
#include "moerail/reference/host.h"
#include "moerail/reference/quant.h"

namespace moerail {
namespace {

using ref::HostTensor;
using testing::DeviceTensor;

constexpr std::int64_t B = kWeightScaleBlock;

struct Shape {
  std::int64_t L, N, K;
  bool transposed;
};

std::string name_of(const Shape& s) {
  return "L=" + std::to_string(s.L) + " N=" + std::to_string(s.N) + " K=" + std::to_string(s.K) +
         (s.transposed ? " with qt" : " without qt");
}

HostTensor random_weights(const Shape& s, std::uint64_t seed) {
  HostTensor w(DType::BF16, {s.L, s.N, s.K});
  ref::Rng rng(seed);
  const std::int64_t nb = (s.N + B - 1) / B, kb = s.K / B;
  std::vector<double> mag(std::size_t(s.L * nb * kb));
  for (double& m : mag) m = std::ldexp(1.0, int(rng.below(41)) - 20);
  if (!mag.empty()) mag[mag.size() / 2] = 0.0;  // one zero block
  for (std::int64_t e = 0; e < s.L; ++e)
    for (std::int64_t n = 0; n < s.N; ++n)
      for (std::int64_t k = 0; k < s.K; ++k)
        w.set_f((e * s.N + n) * s.K + k, rng.normal() * mag[std::size_t((e * nb + n / B) * kb + k / B)]);
  return w;
}

// Bytes equal; on a mismatch the first few, with their indices in the [d0, d1, d2] array.
void expect_same(const std::vector<std::uint8_t>& gpu, const HostTensor& want, std::int64_t d1, std::int64_t d2,
                 const std::string& what) {
  const std::size_t elem = dtype_size(want.view().dtype());
  const auto* w = static_cast<const std::uint8_t*>(want.view().data());
  ASSERT_EQ(gpu.size(), want.view().nbytes()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < gpu.size() / elem && bad < 5; ++i) {
    if (std::memcmp(&gpu[i * elem], &w[i * elem], elem) == 0) continue;
    unsigned g = 0, x = 0;
    std::memcpy(&g, &gpu[i * elem], elem);
    std::memcpy(&x, &w[i * elem], elem);
    const std::int64_t j = std::int64_t(i);
    ADD_FAILURE() << what << "[" << j / (d1 * d2) << ", " << j / d2 % d1 << ", " << j % d2 << "] = 0x" << std::hex
                  << g << " on the GPU but 0x" << x << " in the reference";
    ++bad;
  }
}

struct Outputs {
  Shape s;
  std::int64_t nb, kb;
  DeviceTensor w, q, qs, qt, qts;
  explicit Outputs(const Shape& sh)
      : s(sh), nb((sh.N + B - 1) / B), kb(sh.K / B), w(DType::BF16, {sh.L, sh.N, sh.K}),
        q(DType::F8E4M3, {sh.L, sh.N, sh.K}), qs(DType::F32, {sh.L, nb, kb}),
        qt(DType::F8E4M3, {sh.L, sh.K, sh.N}), qts(DType::F32, {sh.L, kb, nb}) {}
  QuantizeWeightsArgs args() const {
    QuantizeWeightsArgs a;
    a.w = w.view();
    a.q = q.view();
    a.q_scales = qs.view();
    if (s.transposed) {
      a.qt = qt.view();
      a.qt_scales = qts.view();
    }
    return a;
  }
  void poison() const {
    q.poison();
    qs.poison();
    qt.poison();
    qts.poison();
  }
  // Compares every output with the reference of host weights hw.
  void compare(const HostTensor& hw) const {
    HostTensor rq(DType::F8E4M3, {s.L, s.N, s.K}), rs(DType::F32, {s.L, nb, kb});
    HostTensor rqt(DType::F8E4M3, {s.L, s.K, s.N}), rst(DType::F32, {s.L, kb, nb});
    QuantizeWeightsArgs a;
    a.w = hw.view();
    a.q = rq.view();
    a.q_scales = rs.view();
    if (s.transposed) {
      a.qt = rqt.view();
      a.qt_scales = rst.view();
    }
    ref::quantize_weights_fp8(a);
    expect_same(q.to_vector<std::uint8_t>(rq.view().nbytes()), rq, s.N, s.K, "q");
    expect_same(qs.to_vector<std::uint8_t>(rs.view().nbytes()), rs, nb, kb, "q_scales");
    if (s.transposed) {
      expect_same(qt.to_vector<std::uint8_t>(rqt.view().nbytes()), rqt, s.K, s.N, "qt");
      expect_same(qts.to_vector<std::uint8_t>(rst.view().nbytes()), rst, kb, nb, "qt_scales");
      // And the GPU's qt is the transpose of the GPU's q, bit for bit.
      const auto gq = q.to_vector<std::uint8_t>(rq.view().nbytes());
      const auto gqt = qt.to_vector<std::uint8_t>(rqt.view().nbytes());
      for (std::int64_t e = 0; e < s.L; ++e)
        for (std::int64_t n = 0; n < s.N; ++n)
          for (std::int64_t k = 0; k < s.K; ++k)
            ASSERT_EQ(gqt[std::size_t((e * s.K + k) * s.N + n)], gq[std::size_t((e * s.N + n) * s.K + k)])
                << "qt[" << e << ", " << k << ", " << n << "]";
    } else {
      // Without qt nothing of qt is written.
      for (std::uint8_t b : qt.to_vector<std::uint8_t>(std::size_t(s.L * s.K * s.N))) ASSERT_EQ(b, 0xff);
    }
  }
};

TEST(QuantWeightsGpu, MatchesTheReferenceBitForBit) {
  MOERAIL_REQUIRE_GPU();
  const std::vector<Shape> shapes = {
      {1, 128, 128, true},     // one block
      {2, 384, 256, true},     // several blocks per expert
      {3, 328, 384, false},    // a partial last block of rows (72 of 128)
      {2, 200, 128, false},    // a partial block only just over one
      {1, 72, 256, false},     // N < 128: only a partial block
      {2, 512, 1024, true},
      {4, 256, 7168, true},    // DeepSeek-V3's hidden size as K
      {1, 7168, 256, true},    // ... and as N
      {0, 256, 256, true},     // L = 0: nothing to do
  };
  std::uint64_t seed = 300;
  for (const Shape& s : shapes) {
    SCOPED_TRACE(name_of(s));
    const HostTensor hw = random_weights(s, seed++);
    Outputs o(s);
    o.w.upload(hw);
    o.poison();
    quantize_weights_fp8(o.args(), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    o.compare(hw);
  }
}

TEST(QuantWeightsGpu, SpecialValuesMatchTheReference) {
  MOERAIL_REQUIRE_GPU();
  const Shape s{2, 256, 384, true};
  HostTensor hw = random_weights(s, 7);
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  auto at = [&](std::int64_t e, std::int64_t n, std::int64_t k) { return (e * s.N + n) * s.K + k; };
  hw.set_f(at(0, 3, 5), nan);          // skipped by amax, coded 0x7f
  hw.set_f(at(0, 130, 140), -nan);
  hw.set_f(at(1, 10, 300), inf);       // block (1, 0, 2): scale inf, finite elements ±0, inf NaN
  hw.set_f(at(1, 200, 20), -inf);
  hw.set_f(at(0, 255, 383), -0.0);
  hw.set_f(at(1, 129, 129), 1e38);     // a huge element: the rest of its block underflows to ±0
  for (std::int64_t n = 128; n < 256; ++n)  // a block of values so small that amax / 448 < FLT_MIN: scale 1
    for (std::int64_t k = 256; k < 384; ++k) hw.set_f(at(0, n, k), (n + k) % 2 ? 1e-37 : -3e-38);
  Outputs o(s);
  o.w.upload(hw);
  o.poison();
  quantize_weights_fp8(o.args(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  o.compare(hw);
}

// Captured once, replayed with new weights in the same buffer (the shapes are static; nothing else changes).
TEST(QuantWeightsGpu, GraphReplaysWithNewWeights) {
  MOERAIL_REQUIRE_GPU();
  const Shape s{3, 256, 512, true};
  Outputs o(s);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  quantize_weights_fp8(o.args(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (std::uint64_t seed : {41u, 42u, 43u}) {
    SCOPED_TRACE("replay with weights of seed " + std::to_string(seed));
    const HostTensor hw = random_weights(s, seed);
    o.w.upload(hw);
    o.poison();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    o.compare(hw);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(QuantWeightsGpu, ErrorsNameTheArgument) {
  MOERAIL_REQUIRE_GPU();
  auto error_of = [](const QuantizeWeightsArgs& a) {
    try {
      quantize_weights_fp8(a, nullptr);
    } catch (const Error& e) {
      return std::make_pair(e.code(), std::string(e.what()));
    }
    return std::make_pair(ErrorCode::Internal, std::string("(no error)"));
  };
  const Shape s{2, 256, 256, true};
  Outputs o(s);
  QuantizeWeightsArgs a = o.args();
  DeviceTensor w_k(DType::BF16, {2, 256, 200});
  a.w = w_k.view();
  auto [c1, m1] = error_of(a);
  EXPECT_EQ(c1, ErrorCode::InvalidArgument);
  EXPECT_EQ(m1, "quantize_weights_fp8: w has shape [2, 256, 200] but K = 200 is not a multiple of 128 (the 128x128 "
                "scale blocks tile K exactly)");

  DeviceTensor w_n(DType::BF16, {2, 200, 256}), q_n(DType::F8E4M3, {2, 200, 256}), s_n(DType::F32, {2, 2, 2});
  a = o.args();
  a.w = w_n.view();
  a.q = q_n.view();
  a.q_scales = s_n.view();
  auto [c2, m2] = error_of(a);
  EXPECT_EQ(c2, ErrorCode::InvalidArgument);
  EXPECT_EQ(m2, "quantize_weights_fp8: qt is given but N = 200 (w [2, 200, 256]) is not a multiple of 128 (N is the "
                "reduction dimension of the dgrad GEMM that reads qt)");

  a = o.args();
  a.qt = o.q.view();  // [L, N, K] where [L, K, N] is expected: same here (N = K), so use a wrong dtype instead
  a.qt_scales = o.q.view();
  auto [c3, m3] = error_of(a);
  EXPECT_EQ(c3, ErrorCode::InvalidArgument);
  EXPECT_EQ(m3, "quantize_weights_fp8: qt_scales has dtype fp8_e4m3 but one of {f32} was expected");

  a = o.args();
  int dev = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  a.w = TensorView(static_cast<char*>(o.w.data()) + 2, DType::BF16, {2, 256, 256}, Device::cuda(dev));
  auto [c4, m4] = error_of(a);
  EXPECT_EQ(c4, ErrorCode::Unsupported);
  EXPECT_NE(m4.find("quantize_weights_fp8: w at address"), std::string::npos) << m4;

  a = o.args();
  a.w = TensorView(o.w.data(), DType::BF16, {2, 256, 256}, Device::host());
  auto [c5, m5] = error_of(a);
  EXPECT_EQ(c5, ErrorCode::InvalidArgument);
  EXPECT_NE(m5.find("quantize_weights_fp8: w is on host but cuda:"), std::string::npos) << m5;
}

}  // namespace
}  // namespace moerail
