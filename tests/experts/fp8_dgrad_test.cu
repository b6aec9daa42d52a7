// GPU tests of the FP8 dgrad (grouped_gemm_fp8_dgrad, moerail/experts_fp8.h) end to end from bf16 tensors:
// W [L, N, K] bf16 -> quantize_weights_fp8 (q and the transposed copy qt), dY [rows, N] bf16 -> quantize_fp8
// (Block1x128, scales along N), then dX [rows, K] = dgrad GEMM(dY_q, qt). Reference: the fp64 product
// dequant(dY) dequant(W_e) per expert segment, from the CPU reference quantizers (whose codes and scales the GPU's
// must equal bit for bit: checked first). The GEMM adds fp32 summation and d's rounding to bf16 (2^-9 relative), so
// the relative Frobenius error is ~1e-3 to 2e-3; the bound is issue 7's 5e-2. W's magnitude differs block to block
// by up to 2^9 and dY's row to row, so a scale from the wrong block, row or expert is an O(1) error. Cases: varying
// per-expert counts (unaligned, 0 rows, all rows on one expert, none, negative, clipped), both tiles and Auto, i32
// and i64 counts, rows past the segments keep the NaN poison, one captured graph replayed with other counts, and the
// error prefix. The error against the unquantized bf16 product is printed for information (e4m3 rounding of both
// operands: a few percent).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "experts/mlp_harness.h"  // DeviceTensor, expect_untouched, MOERAIL_REQUIRE_GPU
#include "moerail/error.h"
#include "moerail/experts_fp8.h"
#include "moerail/quant.h"
#include "moerail/reference/quant.h"

namespace moerail::testing::fp8dgrad {
namespace {

using mlp::DeviceTensor;
using ref::HostTensor;
using ref::Rng;

// Issue 7 allows 5e-2 against a bf16 reference; against the dequantized operands' fp64 product the kernels land
// near 2e-3 (bf16 output rounding), and 1e-2 keeps a wrong scale block of a small-scale region from passing.
constexpr double kTol = 1e-2;
constexpr std::int64_t kBlock = 128;

struct Problem {
  std::int64_t L, N, K, rows;  // W [L, N, K], dY [rows, N], dX [rows, K]
};

std::string name_of(const Problem& p) {
  return "L=" + std::to_string(p.L) + " N=" + std::to_string(p.N) + " K=" + std::to_string(p.K) +
         " rows=" + std::to_string(p.rows);
}

// Host operands (bf16), their quantization by the CPU reference, and the dequantized values in fp64.
struct Host {
  Problem p;
  std::int64_t nb, kb;
  HostTensor w, dy;              // [L, N, K], [rows, N] bf16
  HostTensor q, qs, qt, qts;     // reference weight quantization
  HostTensor dyq, dys;           // reference 1x128 quantization of dY
  std::vector<double> w_deq, dy_deq, w_bf16, dy_bf16;

  Host(const Problem& prob, std::uint64_t seed)
      : p(prob), nb(prob.N / kBlock), kb(prob.K / kBlock), w(DType::BF16, {p.L, p.N, p.K}), dy(DType::BF16, {p.rows, p.N}),
        q(DType::F8E4M3, {p.L, p.N, p.K}), qs(DType::F32, {p.L, nb, kb}), qt(DType::F8E4M3, {p.L, p.K, p.N}),
        qts(DType::F32, {p.L, kb, nb}), dyq(DType::F8E4M3, {p.rows, p.N}), dys(DType::F32, {p.rows, nb}) {
    Rng rng(seed);
    std::vector<double> mag(std::size_t(p.L * nb * kb));
    for (double& m : mag) m = std::ldexp(1.0, int(rng.below(10)) - 10);  // 2^-10 .. 2^-1 per 128x128 block
    for (std::int64_t e = 0; e < p.L; ++e)
      for (std::int64_t n = 0; n < p.N; ++n)
        for (std::int64_t k = 0; k < p.K; ++k)
          w.set_f((e * p.N + n) * p.K + k, rng.normal() * mag[std::size_t((e * nb + n / kBlock) * kb + k / kBlock)]);
    for (std::int64_t r = 0; r < p.rows; ++r) {
      const double m = std::ldexp(1.0, int(rng.below(10)) - 12);  // per row: gradients are small
      for (std::int64_t n = 0; n < p.N; ++n) dy.set_f(r * p.N + n, rng.normal() * m);
    }
    QuantizeWeightsArgs a;
    a.w = w.view();
    a.q = q.view();
    a.q_scales = qs.view();
    a.qt = qt.view();
    a.qt_scales = qts.view();
    ref::quantize_weights_fp8(a);
    ref::quantize_fp8(Fp8Scaling::Block1x128, dy.view(), dyq.view(), dys.view());
    const auto* wc = static_cast<const std::uint8_t*>(q.view().data());
    const auto* ws = static_cast<const float*>(qs.view().data());
    w_deq.resize(std::size_t(p.L * p.N * p.K));
    w_bf16.resize(w_deq.size());
    for (std::int64_t e = 0; e < p.L; ++e)
      for (std::int64_t n = 0; n < p.N; ++n)
        for (std::int64_t k = 0; k < p.K; ++k) {
          const std::size_t i = std::size_t((e * p.N + n) * p.K + k);
          w_deq[i] = double(ref::e4m3_to_float(wc[i])) * double(ws[(e * nb + n / kBlock) * kb + k / kBlock]);
          w_bf16[i] = w.f(std::int64_t(i));
        }
    const auto* dc = static_cast<const std::uint8_t*>(dyq.view().data());
    const auto* ds = static_cast<const float*>(dys.view().data());
    dy_deq.resize(std::size_t(p.rows * p.N));
    dy_bf16.resize(dy_deq.size());
    for (std::int64_t r = 0; r < p.rows; ++r)
      for (std::int64_t n = 0; n < p.N; ++n) {
        const std::size_t i = std::size_t(r * p.N + n);
        dy_deq[i] = double(ref::e4m3_to_float(dc[i])) * double(ds[r * nb + n / kBlock]);
        dy_bf16[i] = dy.f(std::int64_t(i));
      }
  }
};

std::vector<std::int64_t> segment_starts(const std::vector<std::int64_t>& counts, std::int64_t rows) {
  std::vector<std::int64_t> start(counts.size() + 1, 0);
  for (std::size_t e = 0; e < counts.size(); ++e)
    start[e + 1] = std::min(rows, start[e] + std::max<std::int64_t>(counts[e], 0));
  return start;
}

// dX [rows, K] = dY W_e over the segment rows, from the given (dequantized or bf16) operands, in fp64.
std::vector<double> reference(const Problem& p, const std::vector<double>& dy, const std::vector<double>& w,
                              const std::vector<std::int64_t>& counts) {
  const std::vector<std::int64_t> start = segment_starts(counts, p.rows);
  std::vector<double> dx(std::size_t(p.rows * p.K), 0.0);
  for (std::int64_t e = 0; e < p.L; ++e)
    for (std::int64_t r = start[std::size_t(e)]; r < start[std::size_t(e) + 1]; ++r) {
      double* out = &dx[std::size_t(r * p.K)];
      for (std::int64_t n = 0; n < p.N; ++n) {
        const double g = dy[std::size_t(r * p.N + n)];
        const double* wr = &w[std::size_t((e * p.N + n) * p.K)];
        for (std::int64_t k = 0; k < p.K; ++k) out[k] += g * wr[k];
      }
    }
  return dx;
}

// Device side: bf16 inputs quantized on the GPU (checked bit for bit against the reference), dX, counts, workspace.
struct Gpu {
  Problem p;
  DeviceTensor w, q, qs, qt, qts, dy, dyq, dys, num_rows, counts, dx, workspace;
  bool i64;

  Gpu(const Host& h, bool counts_i64, cudaStream_t stream)
      : p(h.p), w(h.w), q(DType::F8E4M3, {p.L, p.N, p.K}), qs(DType::F32, {p.L, h.nb, h.kb}),
        qt(DType::F8E4M3, {p.L, p.K, p.N}), qts(DType::F32, {p.L, h.kb, h.nb}), dy(h.dy),
        dyq(DType::F8E4M3, {p.rows, p.N}), dys(DType::F32, {p.rows, h.nb}), num_rows(DType::I32, {1}),
        counts(counts_i64 ? DType::I64 : DType::I32, {p.L}), dx(DType::BF16, {p.rows, p.K}),
        workspace(DType::Bool, {std::int64_t(grouped_gemm_fp8_workspace_bytes(p.L))}), i64(counts_i64) {
    const std::int32_t r32 = std::int32_t(p.rows);
    MOERAIL_CUDA_CHECK(cudaMemcpy(num_rows.data(), &r32, 4, cudaMemcpyHostToDevice));
    QuantizeWeightsArgs wa;
    wa.w = w.view();
    wa.q = q.view();
    wa.q_scales = qs.view();
    wa.qt = qt.view();
    wa.qt_scales = qts.view();
    quantize_weights_fp8(wa, stream);
    QuantizeArgs qa;
    qa.scaling = Fp8Scaling::Block1x128;
    qa.x = dy.view();
    qa.num_tokens = num_rows.view();
    qa.q = dyq.view();
    qa.scale = dys.view();
    quantize_fp8(qa, stream);
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
    auto same = [](const DeviceTensor& d, const HostTensor& r, const char* what) {
      const HostTensor got = d.download();
      EXPECT_EQ(std::memcmp(got.view().data(), r.view().data(), r.view().nbytes()), 0)
          << what << " on the GPU differs from the reference quantizer";
    };
    same(qt, h.qt, "qt");
    same(qts, h.qts, "qt_scales");
    same(dyq, h.dyq, "dy codes");
    same(dys, h.dys, "dy scales");
  }

  void set_counts(const std::vector<std::int64_t>& c) const {
    if (i64) {
      MOERAIL_CUDA_CHECK(cudaMemcpy(counts.data(), c.data(), c.size() * 8, cudaMemcpyHostToDevice));
    } else {
      std::vector<std::int32_t> c32(c.begin(), c.end());
      MOERAIL_CUDA_CHECK(cudaMemcpy(counts.data(), c32.data(), c32.size() * 4, cudaMemcpyHostToDevice));
    }
  }

  Fp8DgradArgs args(Fp8GemmTile tile) const {
    Fp8DgradArgs a;
    a.dy = dyq.view();
    a.dy_scales = dys.view();
    a.wt = qt.view();
    a.wt_scales = qts.view();
    a.counts = counts.view();
    a.dx = dx.view();
    a.workspace = workspace.view();
    a.tile = tile;
    return a;
  }
};

const char* tile_name(Fp8GemmTile t) {
  switch (t) {
    case Fp8GemmTile::Auto: return "auto";
    case Fp8GemmTile::Cooperative128x128: return "coop128x128";
    case Fp8GemmTile::Pingpong64x128: return "ping64x128";
  }
  return "?";
}

// Relative Frobenius error of dX per expert (each < kTol) and overall; the first mismatches on failure; rows past
// the segments still NaN. Returns {error vs dequantized product, error vs bf16 product}.
std::pair<double, double> compare(const Gpu& g, const std::vector<double>& want, const std::vector<double>& want_bf16,
                                  const std::vector<std::int64_t>& counts, const std::string& what) {
  const Problem& p = g.p;
  const HostTensor got = g.dx.download();
  const std::vector<std::int64_t> start = segment_starts(counts, p.rows);
  double num_all = 0, den_all = 0, num_bf = 0, den_bf = 0;
  for (std::int64_t e = 0; e < p.L; ++e) {
    double num = 0, den = 0;
    std::int64_t bad = -1;
    for (std::int64_t i = start[std::size_t(e)] * p.K; i < start[std::size_t(e) + 1] * p.K; ++i) {
      const double x = got.f(i), w = want[std::size_t(i)], wb = want_bf16[std::size_t(i)];
      if (!std::isfinite(x) && bad < 0) bad = i;
      num += (x - w) * (x - w);
      den += w * w;
      num_bf += (x - wb) * (x - wb);
      den_bf += wb * wb;
    }
    num_all += num;
    den_all += den;
    const double err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    EXPECT_LT(bad, 0) << what << ": dx[" << bad / p.K << ", " << bad % p.K << "] (expert " << e << ") is "
                      << got.f(std::max<std::int64_t>(bad, 0)) << ", expected "
                      << want[std::size_t(std::max<std::int64_t>(bad, 0))];
    EXPECT_LT(err, kTol) << what << ": expert " << e << " rows [" << start[std::size_t(e)] << ", "
                         << start[std::size_t(e) + 1] << "): relative error " << err;
    if (!(err < kTol)) {
      int shown = 0;
      for (std::int64_t i = start[std::size_t(e)] * p.K; i < start[std::size_t(e) + 1] * p.K && shown < 5; ++i) {
        const double x = got.f(i), w = want[std::size_t(i)];
        if (!(std::abs(x - w) <= 0.02 * std::abs(w) + 1e-9)) {
          std::printf("  %s: dx[%lld, %lld] = %g, expected %g\n", what.c_str(), (long long)(i / p.K),
                      (long long)(i % p.K), x, w);
          ++shown;
        }
      }
    }
  }
  mlp::expect_untouched(what.c_str(), got, start.back() * p.K);
  return {den_all > 0 ? std::sqrt(num_all / den_all) : 0.0, den_bf > 0 ? std::sqrt(num_bf / den_bf) : 0.0};
}

void run_cases(const Problem& p, const std::vector<std::vector<std::int64_t>>& count_sets, bool i64,
               std::uint64_t seed) {
  SCOPED_TRACE(name_of(p));
  const Host h(p, seed);
  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Gpu g(h, i64, stream);
  for (const auto& counts : count_sets) {
    const std::vector<double> want = reference(p, h.dy_deq, h.w_deq, counts);
    const std::vector<double> want_bf16 = reference(p, h.dy_bf16, h.w_bf16, counts);
    g.set_counts(counts);
    for (Fp8GemmTile tile : {Fp8GemmTile::Cooperative128x128, Fp8GemmTile::Pingpong64x128, Fp8GemmTile::Auto}) {
      const std::string what = name_of(p) + " counts " + ::testing::PrintToString(counts) + " tile " +
                               tile_name(tile) + (i64 ? " i64" : " i32");
      SCOPED_TRACE(what);
      g.dx.poison();
      grouped_gemm_fp8_dgrad(g.args(tile), stream);
      MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto [err, err_bf16] = compare(g, want, want_bf16, counts, what);
      std::printf("[ fp8 dgrad ] %s: relative error %.3e (vs the unquantized bf16 product %.3e)\n", what.c_str(), err,
                  err_bf16);
    }
  }
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(ExpertsFp8Dgrad, MatchesTheDequantizedProduct) {
  MOERAIL_REQUIRE_GPU();
  // N = 384 (the reduction: three 1x128 blocks of dY), K = 256 (dX columns).
  run_cases({5, 384, 256, 600},
            {
                {130, 0, 257, 1, 64},      // unaligned, one empty expert, one single-row expert
                {0, 0, 600, 0, 0},         // all rows on one expert, buffer full
                {128, 128, 128, 128, 88},  // aligned
                {400, -3, 300, 0, 5},      // a negative count (0 rows), counts past the buffer (clipped)
                {0, 0, 0, 0, 0},           // no rows
            },
            /*i64=*/false, 17);
}

TEST(ExpertsFp8Dgrad, OneAndManyReductionBlocks) {
  MOERAIL_REQUIRE_GPU();
  run_cases({3, 128, 384, 200}, {{100, 36, 64}, {0, 200, 0}}, /*i64=*/true, 18);  // N = 128: one block of dY
  run_cases({2, 1024, 128, 300}, {{1, 299}, {257, 0}}, /*i64=*/false, 19);         // eight blocks, K = 128
  run_cases({4, 512, 640, 256}, {{64, 0, 128, 64}, {0, 0, 0, 256}}, /*i64=*/true, 20);
}

TEST(ExpertsFp8Dgrad, GraphReplayWithDifferentCounts) {
  MOERAIL_REQUIRE_GPU();
  const Problem p{4, 256, 256, 320};
  const Host h(p, 23);
  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Gpu g(h, /*i64=*/true, stream);
  const std::vector<std::vector<std::int64_t>> steps = {{80, 80, 80, 80}, {0, 300, 0, 20}, {0, 0, 0, 0}, {7, 0, 0, 1}};
  g.set_counts(steps[0]);
  grouped_gemm_fp8_dgrad(g.args(Fp8GemmTile::Auto), stream);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    grouped_gemm_fp8_dgrad(g.args(Fp8GemmTile::Auto), stream);
  } catch (...) {
    (void)cudaStreamEndCapture(stream, &graph);
    if (graph) (void)cudaGraphDestroy(graph);
    throw;
  }
  MOERAIL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOERAIL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (const auto& counts : steps) {
    const std::string what = "graph replay, counts " + ::testing::PrintToString(counts);
    SCOPED_TRACE(what);
    g.set_counts(counts);
    g.dx.poison();
    MOERAIL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto [err, err_bf16] =
        compare(g, reference(p, h.dy_deq, h.w_deq, counts), reference(p, h.dy_bf16, h.w_bf16, counts), counts, what);
    std::printf("[ fp8 dgrad ] %s: relative error %.3e (vs bf16 %.3e)\n", what.c_str(), err, err_bf16);
  }
  MOERAIL_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOERAIL_CUDA_CHECK(cudaGraphDestroy(graph));
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(ExpertsFp8Dgrad, ErrorsNameTheDgradOperands) {
  MOERAIL_REQUIRE_GPU();
  const Problem p{2, 256, 128, 64};
  const Host h(p, 29);
  const Gpu g(h, false, nullptr);
  g.set_counts({32, 32});
  Fp8DgradArgs a = g.args(Fp8GemmTile::Auto);
  a.wt = g.q.view();  // the forward copy [L, N, K] where [L, K, N] is needed
  a.wt_scales = g.qs.view();
  try {
    grouped_gemm_fp8_dgrad(a, nullptr);
    ADD_FAILURE() << "the forward weight copy was accepted as wt";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("grouped_gemm_fp8_dgrad (a = dy, a_scales = dy_scales, b = wt, b_scales = wt_scales, d = dx): "
                      "grouped_gemm_fp8: b has shape [2, 256, 128]",
                      0),
              0u)
        << m;
  }
}

}  // namespace
}  // namespace moerail::testing::fp8dgrad
