// GPU tests of the FP8 grouped GEMM (moerail/experts_fp8.h), blockwise- and per-tensor-scaled, against a host
// reference: the fp64 product of the dequantized operands (e4m3 codes from cuda_fp8.h's host conversions times their
// block or tensor scales) per expert segment. The only rounding the GEMM adds is d's to bf16 (relative 2^-9 per
// element) and fp32 summation, so the relative Frobenius error is ~1e-3; the bound checked is issue 7's 5e-2. Scales span nine binades block to
// block, so a scale read from the wrong block, row or expert shows up as an O(1) error, not a small one.
// Cases: unaligned and aligned counts, empty experts, all rows on one expert, no rows, a negative count (read as 0),
// counts past the buffer (clipped), N not a multiple of 128, one K block and many, every tile, i32 and i64 counts,
// one captured CUDA graph replayed with different counts, and argument errors. Per-tensor scaling (fast accumulation:
// the whole K sum in the tensor cores' accumulator, ~1e-3 as well at these K): one b scale and one per expert (scales
// again binades apart, so a wrong expert's alpha is an O(1) error), K = 400 (a multiple of 16, not of 128), and a
// graph replay in which counts and scales both change. Rows of d past the segments must keep
// the NaN poison written before every run.
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "experts/mlp_harness.h"  // DeviceTensor, expect_untouched
#include "moerail/error.h"
#include "moerail/experts_fp8.h"

namespace moerail::testing::fp8gemm {
namespace {

using mlp::DeviceTensor;
using ref::HostTensor;
using ref::Rng;

// Issue 7 allows 5e-2 against a bf16 reference; against the dequantized operands' fp64 product the kernels land
// near 2e-3 (bf16 output rounding), and 1e-2 keeps a wrong scale block of a small-scale region from passing.
constexpr double kTol = 1e-2;
constexpr std::int64_t kBlock = 128;

struct Problem {
  std::int64_t L, N, K, rows;
};

// The scales of a problem: 1x128 / 128x128 blocks, or per-tensor with b's scale shared or per expert, or both a's
// (one per expert's rows) and b's per expert.
enum class Scales { Block, Tensor, TensorPerExpert, TensorAllPerExpert };

bool per_tensor(Scales s) { return s != Scales::Block; }

std::uint8_t to_e4m3(float x) { return __nv_fp8_e4m3(x).__x; }  // round to nearest even, saturating to +-448
float from_e4m3(std::uint8_t code) {
  __nv_fp8_e4m3 v;
  v.__x = code;
  return float(v);
}
std::uint8_t to_e5m2(float x) { return __nv_fp8_e5m2(x).__x; }  // the hybrid recipe's gradients' format
float from_e5m2(std::uint8_t code) {
  __nv_fp8_e5m2 v;
  v.__x = code;
  return float(v);
}

// Host operands: e4m3 codes, block scales, and the dequantized values the reference multiplies.
struct Operands {
  Problem p;
  Scales mode = Scales::Block;
  bool e5m2_a = false;  // a holds e5m2 codes (per-tensor, promoted)
  std::int64_t kb = 0, nb = 0;
  std::vector<std::uint8_t> a, b;   // [rows, K], [L, N, K]
  std::vector<float> sa, sb;        // [rows, K/128], [L, ceil(N/128), K/128]; per-tensor [1], [1] or [L]
  std::vector<double> a_deq, b_deq;

  Operands(const Problem& prob, std::uint64_t seed, Scales scales_mode = Scales::Block, bool a_e5m2 = false)
      : p(prob), mode(scales_mode), e5m2_a(a_e5m2), kb(prob.K / kBlock), nb((prob.N + kBlock - 1) / kBlock) {
    Rng rng(seed);
    // Codes from normal values of stddev 96: most of e4m3's range, a few saturating at 448, some subnormals.
    auto codes = [&](std::vector<std::uint8_t>& v, std::int64_t n) {
      v.resize(std::size_t(n));
      for (auto& c : v) c = to_e4m3(float(rng.normal() * 96.0));
    };
    // Scales 2^e * [1, 2) with e in [-12, -4]: neighbouring blocks differ by up to 2^9.
    auto scales = [&](std::vector<float>& v, std::int64_t n) {
      v.resize(std::size_t(n));
      for (auto& s : v) s = std::ldexp(float(rng.uniform(1.0, 2.0)), int(rng.below(9)) - 12);
    };
    codes(b, p.L * p.N * p.K);
    if (e5m2_a) {  // normal values of stddev 12000: e5m2's upper binades (to 2^15), a few saturating at 57344
      a.resize(std::size_t(p.rows * p.K));
      for (auto& c : a) c = to_e5m2(float(rng.normal() * 12000.0));
    } else {
      codes(a, p.rows * p.K);
    }
    const bool tensor = per_tensor(mode);
    scales(sa, mode == Scales::TensorAllPerExpert ? p.L : tensor ? 1 : p.rows * kb);
    scales(sb, mode == Scales::Tensor ? 1 : tensor ? p.L : p.L * nb * kb);
    dequantize();
  }

  // a_deq, b_deq from the codes and the current scales.
  void dequantize() {
    const bool tensor = per_tensor(mode);
    a_deq.resize(a.size());
    for (std::int64_t r = 0; r < p.rows; ++r)
      for (std::int64_t k = 0; k < p.K; ++k) {
        const std::size_t i = std::size_t(r * p.K + k);
        a_deq[i] = double(e5m2_a ? from_e5m2(a[i]) : from_e4m3(a[i])) *
                   double(sa[tensor ? 0 : std::size_t(r * kb + k / kBlock)]);
      }
    b_deq.resize(b.size());
    for (std::int64_t e = 0; e < p.L; ++e)
      for (std::int64_t n = 0; n < p.N; ++n)
        for (std::int64_t k = 0; k < p.K; ++k) {
          const std::size_t i = std::size_t((e * p.N + n) * p.K + k);
          std::size_t si = std::size_t((e * nb + n / kBlock) * kb + k / kBlock);
          if (mode == Scales::Tensor) si = 0;
          if (mode == Scales::TensorPerExpert || mode == Scales::TensorAllPerExpert) si = std::size_t(e);
          b_deq[i] = double(from_e4m3(b[i])) * double(sb[si]);
        }
  }
};

// Segments as the kernel reads them: negative counts are 0, segments clipped to the buffer rows.
std::vector<std::int64_t> segment_starts(const std::vector<std::int64_t>& counts, std::int64_t rows) {
  std::vector<std::int64_t> start(counts.size() + 1, 0);
  for (std::size_t e = 0; e < counts.size(); ++e)
    start[e + 1] = std::min(rows, start[e] + std::max<std::int64_t>(counts[e], 0));
  return start;
}

// Reference d [rows, N] over the segment rows (rows past the last segment are left at 0 and not compared).
std::vector<double> reference(const Operands& o, const std::vector<std::int64_t>& counts) {
  const Problem& p = o.p;
  const std::vector<std::int64_t> start = segment_starts(counts, p.rows);
  std::vector<double> d(std::size_t(p.rows * p.N), 0.0);
  for (std::int64_t e = 0; e < p.L; ++e)
    for (std::int64_t r = start[std::size_t(e)]; r < start[std::size_t(e) + 1]; ++r)
      for (std::int64_t n = 0; n < p.N; ++n) {
        const double* x = &o.a_deq[std::size_t(r * p.K)];
        const double* w = &o.b_deq[std::size_t((e * p.N + n) * p.K)];
        double acc = 0;
        for (std::int64_t k = 0; k < p.K; ++k) acc += x[k] * w[k];
        // a_deq holds a's codes times sa[0]; with one scale per expert's rows the row's own is sa[e]
        if (o.mode == Scales::TensorAllPerExpert) acc *= double(o.sa[std::size_t(e)]) / double(o.sa[0]);
        d[std::size_t(r * p.N + n)] = acc;
      }
  return d;
}

// Device side of one problem: operands uploaded once, d poisoned before each run, counts rewritten in place.
struct GpuGemm {
  Problem p;
  Scales mode;
  DeviceTensor a, sa, b, sb, counts, d, workspace;
  bool i64 = false;

  static std::vector<std::int64_t> sa_shape(const Operands& o) {
    if (o.mode == Scales::TensorAllPerExpert) return {o.p.L};
    if (per_tensor(o.mode)) return {1};
    return {o.p.rows, o.kb};
  }
  static std::vector<std::int64_t> sb_shape(const Operands& o) {
    if (o.mode == Scales::Tensor) return {1};
    if (o.mode == Scales::TensorPerExpert || o.mode == Scales::TensorAllPerExpert) return {o.p.L};
    return {o.p.L, o.nb, o.kb};
  }

  GpuGemm(const Operands& o, bool counts_i64)
      : p(o.p),
        mode(o.mode),
        a(o.e5m2_a ? DType::F8E5M2 : DType::F8E4M3, {o.p.rows, o.p.K}),
        sa(DType::F32, sa_shape(o)),
        b(DType::F8E4M3, {o.p.L, o.p.N, o.p.K}),
        sb(DType::F32, sb_shape(o)),
        counts(counts_i64 ? DType::I64 : DType::I32, {o.p.L}),
        d(DType::BF16, {o.p.rows, o.p.N}),
        workspace(DType::Bool, {std::int64_t(grouped_gemm_fp8_workspace_bytes(o.p.L))}),
        i64(counts_i64) {
    MOERAIL_CUDA_CHECK(cudaMemcpy(a.data(), o.a.data(), o.a.size(), cudaMemcpyHostToDevice));
    MOERAIL_CUDA_CHECK(cudaMemcpy(b.data(), o.b.data(), o.b.size(), cudaMemcpyHostToDevice));
    set_scales(o);
  }

  void set_scales(const Operands& o) const {
    MOERAIL_CUDA_CHECK(cudaMemcpy(sa.data(), o.sa.data(), o.sa.size() * 4, cudaMemcpyHostToDevice));
    MOERAIL_CUDA_CHECK(cudaMemcpy(sb.data(), o.sb.data(), o.sb.size() * 4, cudaMemcpyHostToDevice));
  }

  void set_counts(const std::vector<std::int64_t>& c) const {
    if (i64) {
      MOERAIL_CUDA_CHECK(cudaMemcpy(counts.data(), c.data(), c.size() * 8, cudaMemcpyHostToDevice));
    } else {
      std::vector<std::int32_t> c32(c.begin(), c.end());
      MOERAIL_CUDA_CHECK(cudaMemcpy(counts.data(), c32.data(), c32.size() * 4, cudaMemcpyHostToDevice));
    }
  }

  Fp8GroupedGemmArgs args(Fp8GemmTile tile) const {
    Fp8GroupedGemmArgs g;
    g.a = a.view();
    g.a_scales = sa.view();
    g.b = b.view();
    g.b_scales = sb.view();
    g.counts = counts.view();
    g.d = d.view();
    g.workspace = workspace.view();
    g.tile = tile;
    g.scaling = per_tensor(mode) ? Fp8GemmScaling::PerTensor : Fp8GemmScaling::Blockwise;
    return g;
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

// Compares d with the reference: relative Frobenius error per expert and over all segment rows (each < kTol), the
// first mismatches printed on failure, and rows past the segments still NaN. Returns the overall error.
double compare(const GpuGemm& g, const std::vector<double>& want, const std::vector<std::int64_t>& counts,
               const std::string& what) {
  const Problem& p = g.p;
  const HostTensor got = g.d.download();
  const std::vector<std::int64_t> start = segment_starts(counts, p.rows);
  double num_all = 0, den_all = 0;
  for (std::int64_t e = 0; e < p.L; ++e) {
    double num = 0, den = 0;
    std::int64_t bad = -1;
    for (std::int64_t i = start[std::size_t(e)] * p.N; i < start[std::size_t(e) + 1] * p.N; ++i) {
      const double x = got.f(i), w = want[std::size_t(i)];
      if (!std::isfinite(x) && bad < 0) bad = i;
      num += (x - w) * (x - w);
      den += w * w;
    }
    num_all += num;
    den_all += den;
    const double err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    EXPECT_LT(bad, 0) << what << ": d[" << bad / p.N << ", " << bad % p.N << "] (expert " << e << ") is "
                      << got.f(bad) << ", expected " << want[std::size_t(std::max<std::int64_t>(bad, 0))];
    EXPECT_LT(err, kTol) << what << ": expert " << e << " rows [" << start[std::size_t(e)] << ", "
                         << start[std::size_t(e) + 1] << "): relative error " << err;
    if (!(err < kTol)) {
      int shown = 0;
      for (std::int64_t i = start[std::size_t(e)] * p.N; i < start[std::size_t(e) + 1] * p.N && shown < 5; ++i) {
        const double x = got.f(i), w = want[std::size_t(i)];
        if (!(std::abs(x - w) <= 0.02 * std::abs(w) + 1e-6)) {
          std::printf("  %s: d[%lld, %lld] = %g, expected %g\n", what.c_str(), (long long)(i / p.N),
                      (long long)(i % p.N), x, w);
          ++shown;
        }
      }
    }
  }
  mlp::expect_untouched(what.c_str(), got, start.back() * p.N);
  return den_all > 0 ? std::sqrt(num_all / den_all) : 0.0;
}

const char* scales_name(Scales s) {
  switch (s) {
    case Scales::Block: return "blockwise";
    case Scales::Tensor: return "per-tensor";
    case Scales::TensorPerExpert: return "per-tensor (b per expert)";
    case Scales::TensorAllPerExpert: return "per-tensor (a and b per expert)";
  }
  return "?";
}

void run_cases(const Problem& p, const std::vector<std::vector<std::int64_t>>& count_sets, bool i64,
               std::uint64_t seed, Scales mode = Scales::Block, bool e5m2_a = false) {
  const Operands o(p, seed, mode, e5m2_a);
  const GpuGemm g(o, i64);
  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Per-tensor scaling has one kernel (coop128x128); Pingpong64x128 is rejected (RejectsBadArguments).
  const std::vector<Fp8GemmTile> tiles =
      per_tensor(mode) ? std::vector<Fp8GemmTile>{Fp8GemmTile::Cooperative128x128, Fp8GemmTile::Auto}
                       : std::vector<Fp8GemmTile>{Fp8GemmTile::Cooperative128x128, Fp8GemmTile::Pingpong64x128,
                                                  Fp8GemmTile::Auto};
  for (const auto& counts : count_sets) {
    const std::vector<double> want = reference(o, counts);
    g.set_counts(counts);
    // per-tensor: fast accumulation, and the partial sums promoted every 128 elements of K (promote)
    // (an e5m2 a runs promoted only)
    for (const bool promote : e5m2_a            ? std::vector<bool>{true}
                              : per_tensor(mode) ? std::vector<bool>{false, true}
                                                 : std::vector<bool>{false})
    for (Fp8GemmTile tile : tiles) {
      const std::string what = std::string("L=") + std::to_string(p.L) + " N=" + std::to_string(p.N) +
                                " K=" + std::to_string(p.K) + " rows=" + std::to_string(p.rows) + " counts " +
                                ::testing::PrintToString(counts) + " tile " + tile_name(tile) + " " +
                                scales_name(mode) + (promote ? " promoted" : "") + (e5m2_a ? " e5m2 a" : "") +
                                (i64 ? " i64" : " i32");
      SCOPED_TRACE(what);
      g.d.poison();
      Fp8GroupedGemmArgs args = g.args(tile);
      args.promote = promote;
      grouped_gemm_fp8(args, stream);
      MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
      const double err = compare(g, want, counts, what);
      std::printf("[ fp8 gemm ] %s: relative error %.3e\n", what.c_str(), err);
    }
  }
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(ExpertsFp8Gemm, MatchesReference) {
  MOERAIL_REQUIRE_GPU();
  // N = 328: two full weight-scale blocks and a partial one (and a partial N tile); K = 384: three K blocks.
  run_cases({5, 328, 384, 600},
            {
                {130, 0, 257, 1, 64},      // unaligned, one empty expert, one single-row expert
                {0, 0, 600, 0, 0},         // all rows on one expert, buffer exactly full
                {128, 128, 128, 128, 88},  // aligned segments, buffer full
                {400, -3, 300, 0, 5},      // a negative count (0 rows); counts past the buffer (clipped to 200, 0)
                {0, 0, 0, 0, 0},           // no rows at all
            },
            /*i64=*/false, 7);
}

TEST(ExpertsFp8Gemm, OneKBlockAndManyKBlocks) {
  MOERAIL_REQUIRE_GPU();
  run_cases({3, 256, 128, 200}, {{100, 36, 64}, {0, 200, 0}}, /*i64=*/true, 11);       // one K block
  run_cases({2, 136, 1024, 300}, {{1, 299}, {257, 0}}, /*i64=*/false, 12);             // 8 K blocks, N = 136
  run_cases({1, 512, 256, 256}, {{256}, {70}}, /*i64=*/true, 13);                      // one expert
}

// One call captured in a CUDA graph, replayed with different counts written to the same device buffer.
TEST(ExpertsFp8Gemm, GraphReplayWithDifferentCounts) {
  MOERAIL_REQUIRE_GPU();
  const Problem p{6, 256, 256, 320};
  const Operands o(p, 99);
  const GpuGemm g(o, /*i64=*/true);
  const std::vector<std::vector<std::int64_t>> steps = {
      {48, 48, 48, 48, 48, 48},  // balanced
      {160, 64, 32, 16, 0, 16},  // skewed, one empty expert
      {0, 0, 0, 300, 0, 0},      // all rows on one expert
      {0, 0, 0, 0, 0, 0},        // no rows
      {8, 0, 120, 0, 0, 192},    // several empty, buffer exactly full
  };
  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  g.set_counts(steps[0]);
  grouped_gemm_fp8(g.args(Fp8GemmTile::Auto), stream);  // first call outside capture (occupancy query cached)
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    grouped_gemm_fp8(g.args(Fp8GemmTile::Auto), stream);
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
    g.set_counts(counts);  // the only thing that changes between replays
    g.d.poison();
    MOERAIL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double err = compare(g, reference(o, counts), counts, what);
    std::printf("[ fp8 gemm ] %s: relative error %.3e\n", what.c_str(), err);
  }
  MOERAIL_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOERAIL_CUDA_CHECK(cudaGraphDestroy(graph));
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(ExpertsFp8Gemm, PerTensorMatchesReference) {
  MOERAIL_REQUIRE_GPU();
  const std::vector<std::vector<std::int64_t>> counts = {
      {130, 0, 257, 1, 64},      // unaligned, one empty expert, one single-row expert
      {0, 0, 600, 0, 0},         // all rows on one expert, buffer exactly full
      {128, 128, 128, 128, 88},  // aligned segments, buffer full
      {400, -3, 300, 0, 5},      // a negative count (0 rows); counts past the buffer (clipped)
      {0, 0, 0, 0, 0},           // no rows at all
  };
  run_cases({5, 328, 384, 600}, counts, /*i64=*/false, 21, Scales::Tensor);
  run_cases({5, 328, 384, 600}, counts, /*i64=*/true, 22, Scales::TensorPerExpert);
  // K = 400: three full 128-wide K tiles and a partial one (per-tensor needs K % 16 only); 8 K tiles; one expert.
  run_cases({3, 256, 400, 200}, {{100, 36, 64}, {0, 200, 0}}, /*i64=*/true, 23, Scales::TensorPerExpert);
  run_cases({2, 136, 1024, 300}, {{1, 299}, {257, 0}}, /*i64=*/false, 24, Scales::Tensor);
  run_cases({1, 512, 256, 256}, {{256}, {70}}, /*i64=*/true, 25, Scales::TensorPerExpert);
  run_cases({5, 328, 384, 600}, counts, /*i64=*/false, 26, Scales::TensorAllPerExpert);  // a's scale per expert too
}

// The hybrid recipe's products: a in e5m2 (the gradients), b in e4m3, per-tensor scaled and promoted (the dgrads and,
// over the segment-transposed copies, the weight gradients).
TEST(ExpertsFp8Gemm, PerTensorE5m2AMatchesReference) {
  MOERAIL_REQUIRE_GPU();
  const std::vector<std::vector<std::int64_t>> counts = {
      {130, 0, 257, 1, 64},      // unaligned, one empty expert, one single-row expert
      {400, -3, 300, 0, 5},      // a negative count (0 rows); counts past the buffer (clipped)
      {0, 0, 0, 0, 0},           // no rows at all
  };
  run_cases({5, 328, 384, 600}, counts, /*i64=*/false, 27, Scales::Tensor, /*e5m2_a=*/true);
  run_cases({5, 328, 384, 600}, counts, /*i64=*/true, 28, Scales::TensorAllPerExpert, /*e5m2_a=*/true);
  run_cases({2, 136, 1024, 300}, {{1, 299}, {257, 0}}, /*i64=*/false, 29, Scales::TensorPerExpert, true);
}

// Per-tensor: one captured call replayed while counts AND scales change between replays (alpha is formed on the
// device from the scales it holds at replay time).
TEST(ExpertsFp8Gemm, PerTensorGraphReplayWithDifferentCountsAndScales) {
  MOERAIL_REQUIRE_GPU();
  const Problem p{6, 256, 256, 320};
  Operands o(p, 98, Scales::TensorPerExpert);
  const GpuGemm g(o, /*i64=*/false);
  const std::vector<std::vector<std::int64_t>> steps = {
      {48, 48, 48, 48, 48, 48},  // balanced
      {160, 64, 32, 16, 0, 16},  // skewed, one empty expert
      {0, 0, 0, 300, 0, 0},      // all rows on one expert
      {0, 0, 0, 0, 0, 0},        // no rows
      {8, 0, 120, 0, 0, 192},    // several empty, buffer exactly full
  };
  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  g.set_counts(steps[0]);
  grouped_gemm_fp8(g.args(Fp8GemmTile::Auto), stream);  // first call outside capture (occupancy query cached)
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    grouped_gemm_fp8(g.args(Fp8GemmTile::Auto), stream);
  } catch (...) {
    (void)cudaStreamEndCapture(stream, &graph);
    if (graph) (void)cudaGraphDestroy(graph);
    throw;
  }
  MOERAIL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOERAIL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  Rng rng(1234);
  for (std::size_t step = 0; step < steps.size(); ++step) {
    const auto& counts = steps[step];
    if (step > 0) {  // new scales: a by 2^step, b's rotated among the experts and rescaled
      o.sa[0] = std::ldexp(o.sa[0], 1);
      std::rotate(o.sb.begin(), o.sb.begin() + 1, o.sb.end());
      for (auto& s : o.sb) s *= float(rng.uniform(0.5, 1.0));
      o.dequantize();
      g.set_scales(o);
    }
    const std::string what = "per-tensor graph replay " + std::to_string(step) + ", counts " +
                             ::testing::PrintToString(counts);
    SCOPED_TRACE(what);
    g.set_counts(counts);
    g.d.poison();
    MOERAIL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double err = compare(g, reference(o, counts), counts, what);
    std::printf("[ fp8 gemm ] %s: relative error %.3e\n", what.c_str(), err);
  }
  MOERAIL_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOERAIL_CUDA_CHECK(cudaGraphDestroy(graph));
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
}

void expect_invalid(const std::function<void()>& f, const std::string& needle) {
  mlp::expect_error_mentions(f, needle, ErrorCode::InvalidArgument);
}

TEST(ExpertsFp8Gemm, RejectsBadArguments) {
  MOERAIL_REQUIRE_GPU();
  const Problem p{2, 128, 256, 64};
  const Operands o(p, 5);
  const GpuGemm g(o, false);
  g.set_counts({32, 32});
  const Device dev = Device::cuda(cuda::current_device());
  const Fp8GroupedGemmArgs good = g.args(Fp8GemmTile::Auto);

  Fp8GroupedGemmArgs x = good;
  x.a = TensorView(g.a.data(), DType::F8E4M3, {p.rows, 200}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "b has shape");
  x = good;
  x.a = TensorView(g.a.data(), DType::BF16, {p.rows, p.K}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "a has dtype bf16");
  x = good;
  x.b_scales = TensorView(g.sb.data(), DType::F32, {p.L, 2, 2}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "b_scales has shape");
  x = good;
  x.d = TensorView(g.d.data(), DType::F32, {p.rows, p.N}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "d has dtype");
  x = good;
  x.counts = TensorView(g.counts.data(), DType::I32, {p.L + 1}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "counts has shape");
  x = good;
  x.workspace = TensorView(g.workspace.data(), DType::Bool, {64}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "workspace has 64 bytes");
  x = good;
  x.d = TensorView(static_cast<char*>(g.d.data()) + 2, DType::BF16, {p.rows - 1, p.N}, dev);
  x.a = TensorView(g.a.data(), DType::F8E4M3, {p.rows - 1, p.K}, dev);
  x.a_scales = TensorView(g.sa.data(), DType::F32, {p.rows - 1, p.K / kBlock}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "is not 16-byte aligned");
  // K not a multiple of 128 (a and b agree on it).
  x = good;
  x.a = TensorView(g.a.data(), DType::F8E4M3, {p.rows / 2, 192}, dev);
  x.b = TensorView(g.b.data(), DType::F8E4M3, {p.L, p.N, 192}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "K = 192 is not a positive multiple of 128");
  expect_invalid([] { (void)grouped_gemm_fp8_workspace_bytes(0); }, "L = 0");
}

TEST(ExpertsFp8Gemm, PerTensorRejectsBadArguments) {
  MOERAIL_REQUIRE_GPU();
  const Problem p{3, 128, 256, 64};
  const Operands o(p, 6, Scales::TensorPerExpert);
  const GpuGemm g(o, false);
  g.set_counts({32, 0, 32});
  const Device dev = Device::cuda(cuda::current_device());
  const Fp8GroupedGemmArgs good = g.args(Fp8GemmTile::Auto);

  Fp8GroupedGemmArgs x = good;
  x.b_scales = TensorView(g.sb.data(), DType::F32, {p.L - 1}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "b_scales has shape");
  x = good;
  x.a_scales = TensorView(g.sb.data(), DType::F32, {p.L - 1}, dev);  // [1] or [L] (one per expert's rows)
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "a_scales has shape");
  x = good;
  x.a_scales = TensorView(g.sa.data(), DType::BF16, {1}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "a_scales has dtype");
  // K = 200 is not a multiple of 16 (a and b agree on it).
  x = good;
  x.a = TensorView(g.a.data(), DType::F8E4M3, {p.rows, 200}, dev);
  x.b = TensorView(g.b.data(), DType::F8E4M3, {p.L, p.N, 200}, dev);
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "K = 200 is not a positive multiple of 16");
  // Per-tensor scale tensors under Blockwise scaling are the wrong shape.
  x = good;
  x.scaling = Fp8GemmScaling::Blockwise;
  expect_invalid([&] { grouped_gemm_fp8(x, nullptr); }, "a_scales has shape");
  // The one per-tensor kernel is coop128x128.
  x = good;
  x.tile = Fp8GemmTile::Pingpong64x128;
  try {
    grouped_gemm_fp8(x, nullptr);
    ADD_FAILURE() << "per-tensor with Pingpong64x128: expected Error(Unsupported), nothing was thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
  }
  // An e5m2 a runs per-tensor and promoted only.
  for (const auto& [scaling, promote] : {std::pair{Fp8GemmScaling::PerTensor, false},
                                         std::pair{Fp8GemmScaling::Blockwise, true}}) {
    x = good;
    x.a = TensorView(g.a.data(), DType::F8E5M2, {p.rows, p.K}, dev);
    x.scaling = scaling;
    x.promote = promote;
    try {
      grouped_gemm_fp8(x, nullptr);
      ADD_FAILURE() << "an e5m2 a without per-tensor promotion: expected Error(Unsupported), nothing was thrown";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find("a is fp8_e5m2"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace moerail::testing::fp8gemm
