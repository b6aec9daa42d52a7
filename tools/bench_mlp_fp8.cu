// `moerail bench mlp-fp8`: the FP8 blockwise-scaled grouped GEMMs (moerail/experts_fp8.h) on the grouped-MLP
// issue's shapes beside the bf16 ones of GroupedMlp on the same counts (the baseline) and the dense FP8 GEMM rate
// (cuBLASLt e4m3 8192^3, per-tensor fp32 scales, bf16 out: the ceiling), all measured in the same run.
//
// FLOP model: over the R rows of the segments (padding rows included: they are computed), FC1 2 R H F1, FC2 2 R F H.
// A row's time is its GEMMs plus the quantization passes that make their FP8 operands from bf16 tensors (medians of
// each; the GEMMs alone in config.gemms_us): fwd x and act (quantize_fp8), bwd dy and d_h1, wgrad the four
// segment-transposed copies as Fp8GroupedMlp makes them (what their passes add to the bwd row's). Each FP8 call includes its setup kernel (a few microseconds); the bf16 stages are timed
// without theirs. Each case: verify 16 rows x up to 256 columns of the first and last non-empty expert against a
// host fp64 product of the dequantized operands (relative error < 5e-2), warm up, time with CUDA events, report the
// median; both FP8 tiles are timed and recorded, the row uses the library's choice. Working sets are GBs (the
// weights alone exceed L2), so inputs are not rotated.
//
// "fwd": FC1 (N = F1 = 2F, K = H) and FC2 (N = H, K = F). Its config also holds the per-tensor-scaled forward
// (Fp8GemmScaling::PerTensor, fast accumulation, coop128x128) on the same codes (a_scales [1], b_scales [L] from the
// blockwise buffers), verified and timed the same way.
// "bwd": FC2 dgrad d_act [rows, F] = dy W2 and FC1 dgrad dx [rows, H] = d_h1 W1 (grouped_gemm_fp8_dgrad), FLOP as
// the forward's, over the transposed copies of W1, W2 that quantize_weights_fp8 makes (timed once per case, in
// config) and dy, d_h1 quantized 1x128. Verified first: one 128x128 block of each weight copy bit-exact against
// ref::quantize_weights_fp8, the products like the forward's. Baseline: GroupedMlp::backward without weight
// gradients (FC2 dgrad + activation backward + FC1 dgrad: an elementwise pass the FP8 row does not have).
// "wgrad": dW1 = d_h1^T x and dW2 = dy^T act (grouped_gemm_fp8_wgrad) over the segment-transposed 1x128 copies of
// x (from its FP8 codes), d_h1, act and dy, FLOP as the forward's; verified against the bf16 weight gradients of the
// first non-empty expert (relative error < 5e-2). Baseline: GroupedMlp::backward_dw on the same tensors and counts
// (x as its FP8 value, as the layer holds it).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bench.h"
#include "bench_gpu.cuh"
#include "bench_mlp.h"
#include "commands.h"
#include "core/cuda_check.h"
#include "experts/mlp_tuning.h"
#include "moerail/config.h"
#include "moerail/error.h"
#include "moerail/experts.h"
#include "moerail/experts_fp8.h"
#include "moerail/quant.h"
#include "moerail/reference/host.h"
#include "moerail/reference/quant.h"

namespace moerail::tools {
namespace {

using experts::kMlpStageActivation;
using experts::kMlpStageAll;
using experts::kMlpStageFc1;
using experts::kMlpStageFc2;
using experts::kMlpStageSetup;
using experts::MlpGemmTile;
using experts::forward_stages;  // a forward of some stages only, to time one GEMM

constexpr std::int64_t kBlock = 128;  // scale block (1x128 activations, 128x128 weights)
constexpr double kFp8Tol = 5e-2;      // the bound on the relative error against the dequantized product

// One FP8 grouped GEMM's device operands: a [rows, K], scales, b [L, N, K], scales, d [rows, N]. b and its scales
// are random codes owned here, or given (the dgrad's transposed weight copies).
struct Fp8Gemm {
  std::int64_t rows, L, N, K, kb, nb;
  DeviceBuf a, sa, b_own, sb_own, d;
  const void* b = nullptr;
  const void* sb = nullptr;

  Fp8Gemm(std::int64_t rows_, std::int64_t L_, std::int64_t N_, std::int64_t K_, std::uint64_t seed,
          const void* b_given = nullptr, const void* sb_given = nullptr)
      : rows(rows_), L(L_), N(N_), K(K_), kb(K_ / kBlock), nb((N_ + kBlock - 1) / kBlock),
        a(std::size_t(rows * K)), sa(std::size_t(rows * kb * 4)), b_own(b_given ? 0 : std::size_t(L * N * K)),
        sb_own(b_given ? 0 : std::size_t(L * nb * kb * 4)), d(std::size_t(rows * N * 2)),
        b(b_given ? b_given : b_own.p), sb(b_given ? sb_given : sb_own.p) {
    fill_e4m3(a.p, rows * K, seed);
    fill_scales(sa.p, rows * kb, seed + 2);
    if (!b_given) {
      fill_e4m3(b_own.p, L * N * K, seed + 1);
      fill_scales(sb_own.p, L * nb * kb, seed + 3);
    }
  }

  Fp8GroupedGemmArgs args(const DeviceBuf& counts, const DeviceBuf& ws, Fp8GemmTile tile) const {
    const Device dev = Device::cuda(cuda::current_device());
    Fp8GroupedGemmArgs g;
    g.a = a.view(DType::F8E4M3, {rows, K});
    g.a_scales = sa.view(DType::F32, {rows, kb});
    g.b = TensorView(b, DType::F8E4M3, {L, N, K}, dev);
    g.b_scales = TensorView(sb, DType::F32, {L, nb, kb}, dev);
    g.counts = counts.view(DType::I64, {L});
    g.d = d.view(DType::BF16, {rows, N});
    g.workspace = ws.view(DType::Bool, {std::int64_t(ws.bytes)});
    g.tile = tile;
    return g;
  }

  // The same codes per-tensor-scaled: a_scales = sa[0] ([1]), b_scales = the first L floats of sb ([L], per expert).
  Fp8GroupedGemmArgs args_per_tensor(const DeviceBuf& counts, const DeviceBuf& ws) const {
    const Device dev = Device::cuda(cuda::current_device());
    Fp8GroupedGemmArgs g = args(counts, ws, Fp8GemmTile::Auto);
    g.a_scales = sa.view(DType::F32, {1});
    g.b_scales = TensorView(sb, DType::F32, {L}, dev);
    g.scaling = Fp8GemmScaling::PerTensor;
    return g;
  }

  // Rows [start, start + k) of expert e, columns [0, min(N, 256)), against the host fp64 product of the
  // dequantized operands: the relative Frobenius error.
  // per_tensor: with args_per_tensor's scales (sa[0] and sb[e]).
  double verify(std::int64_t e, std::int64_t start, std::int64_t k, bool per_tensor = false) const {
    const std::int64_t cols = std::min<std::int64_t>(N, 256);
    std::vector<std::uint8_t> ha(std::size_t(k * K)), hb(std::size_t(cols * K));
    std::vector<float> hsa(std::size_t(k * kb)), hsb(std::size_t(nb * kb));
    float tensor_sa = 0, tensor_sb = 0;
    auto down = [](void* dst, const void* src, std::size_t n) {
      MOERAIL_CUDA_CHECK(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost));
    };
    if (per_tensor) {
      down(&tensor_sa, sa.p, 4);
      down(&tensor_sb, static_cast<const float*>(sb) + e, 4);
    }
    std::vector<std::uint16_t> hd(std::size_t(k * N));
    down(ha.data(), static_cast<const std::uint8_t*>(a.p) + start * K, ha.size());
    down(hb.data(), static_cast<const std::uint8_t*>(b) + e * N * K, hb.size());
    down(hsa.data(), static_cast<const float*>(sa.p) + start * kb, hsa.size() * 4);
    down(hsb.data(), static_cast<const float*>(sb) + e * nb * kb, hsb.size() * 4);
    down(hd.data(), static_cast<const std::uint16_t*>(d.p) + start * N, hd.size() * 2);
    auto decode = [](std::uint8_t c) {
      __nv_fp8_e4m3 v;
      v.__x = c;
      return double(float(v));
    };
    double num = 0, den = 0;
    for (std::int64_t r = 0; r < k; ++r)
      for (std::int64_t n = 0; n < cols; ++n) {
        double acc = 0;
        for (std::int64_t kk = 0; kk < K; ++kk)
          acc += decode(ha[std::size_t(r * K + kk)]) *
                 double(per_tensor ? tensor_sa : hsa[std::size_t(r * kb + kk / kBlock)]) *
                 decode(hb[std::size_t(n * K + kk)]) *
                 double(per_tensor ? tensor_sb : hsb[std::size_t((n / kBlock) * kb + kk / kBlock)]);
        const double got = bf16_bits_to_float(hd[std::size_t(r * N + n)]);
        num += (got - acc) * (got - acc);
        den += acc * acc;
      }
    return std::sqrt(num) / std::sqrt(std::max(den, 1e-300));
  }
};

// The bf16 baseline's buffers: GroupedMlp FC1 (h1 = x W1^T) and FC2 (y = act W2^T) on the same counts, and its
// backward (dy -> d_h1, dx; no weight gradients). W1 and W2 are also the weights the FP8 dgrad quantizes.
struct Bf16Run {
  std::int64_t rows, L, H, F, F1;
  DeviceBuf x, probs, w1, w2, y, h1, act, dy, dx, d_probs, d_h1, ws;

  Bf16Run(const MoeConfig& c, std::int64_t rows_)
      : rows(rows_), L(c.local_experts()), H(c.hidden), F(c.ffn_hidden), F1(c.fc1_out()),
        x(std::size_t(rows * H * 2)), probs(std::size_t(rows * 4)), w1(std::size_t(L * F1 * H * 2)),
        w2(std::size_t(L * H * F * 2)), y(std::size_t(rows * H * 2)), h1(std::size_t(rows * F1 * 2)),
        act(std::size_t(rows * F * 2)), dy(std::size_t(rows * H * 2)), dx(std::size_t(rows * H * 2)),
        d_probs(std::size_t(rows * 4)), d_h1(std::size_t(rows * F1 * 2)), ws(mlp_backward_workspace_bytes(c, rows)) {
    fill_uniform_bf16(x.p, rows * H, 1.0f, 1);
    fill_uniform_bf16(act.p, rows * F, 1.0f, 2);
    fill_uniform_bf16(w1.p, L * F1 * H, 1.0f / std::sqrt(float(H)), 3);
    fill_uniform_bf16(w2.p, L * H * F, 1.0f / std::sqrt(float(F)), 4);
    fill_uniform_bf16(dy.p, rows * H, 1.0f, 5);
    MOERAIL_CUDA_CHECK(cudaMemset(probs.p, 0, probs.bytes));
  }

  MlpBackwardArgs bwd(const DeviceBuf& counts) const {
    MlpBackwardArgs a;
    a.x = x.view(DType::BF16, {rows, H});
    a.probs = probs.view(DType::F32, {rows});
    a.counts = counts.view(DType::I64, {L});
    a.weights.w1 = w1.view(DType::BF16, {L, F1, H});
    a.weights.w2 = w2.view(DType::BF16, {L, H, F});
    a.h1 = h1.view(DType::BF16, {rows, F1});
    a.act = act.view(DType::BF16, {rows, F});
    a.dy = dy.view(DType::BF16, {rows, H});
    a.dx = dx.view(DType::BF16, {rows, H});
    a.d_probs = d_probs.view(DType::F32, {rows});
    a.d_h1 = d_h1.view(DType::BF16, {rows, F1});
    a.workspace = ws.view(DType::Bool, {std::int64_t(ws.bytes)});
    return a;
  }

  MlpForwardArgs fwd(const DeviceBuf& counts) const {
    MlpForwardArgs a;
    a.x = x.view(DType::BF16, {rows, H});
    a.probs = probs.view(DType::F32, {rows});
    a.counts = counts.view(DType::I64, {L});
    a.weights.w1 = w1.view(DType::BF16, {L, F1, H});
    a.weights.w2 = w2.view(DType::BF16, {L, H, F});
    a.y = y.view(DType::BF16, {rows, H});
    a.h1 = h1.view(DType::BF16, {rows, F1});
    a.act = act.view(DType::BF16, {rows, F});
    return a;
  }
};

// FP8 copies of one bf16 weight [L, N, K] made by quantize_weights_fp8: q [L, N, K] (the forward's b) and the
// transposed qt [L, K, N] (the dgrad's b), with their 128x128 scales.
struct WeightCopies {
  std::int64_t L, N, K, nb, kb;
  DeviceBuf q, qs, qt, qts;

  WeightCopies(std::int64_t L_, std::int64_t N_, std::int64_t K_)
      : L(L_), N(N_), K(K_), nb(N_ / kBlock), kb(K_ / kBlock), q(std::size_t(L * N * K)),
        qs(std::size_t(L * nb * kb * 4)), qt(std::size_t(L * K * N)), qts(std::size_t(L * kb * nb * 4)) {}

  QuantizeWeightsArgs args(const DeviceBuf& w) const {
    QuantizeWeightsArgs a;
    a.w = w.view(DType::BF16, {L, N, K});
    a.q = q.view(DType::F8E4M3, {L, N, K});
    a.q_scales = qs.view(DType::F32, {L, nb, kb});
    a.qt = qt.view(DType::F8E4M3, {L, K, N});
    a.qt_scales = qts.view(DType::F32, {L, kb, nb});
    return a;
  }

  // Block (e, row block 0, all K) of both copies against ref::quantize_weights_fp8 of the same rows, bit for bit:
  // q's first 128 rows, their scales, and qt's columns [0, 128) with their scales. Returns the first mismatch or "".
  std::string verify(const DeviceBuf& w, std::int64_t e) const {
    ref::HostTensor hw(DType::BF16, {1, kBlock, K}), rq(DType::F8E4M3, {1, kBlock, K}), rs(DType::F32, {1, 1, kb});
    ref::HostTensor rqt(DType::F8E4M3, {1, K, kBlock}), rst(DType::F32, {1, kb, 1});
    MOERAIL_CUDA_CHECK(cudaMemcpy(hw.view().data(), static_cast<const std::uint16_t*>(w.p) + e * N * K,
                                  hw.view().nbytes(), cudaMemcpyDeviceToHost));
    QuantizeWeightsArgs a;
    a.w = hw.view();
    a.q = rq.view();
    a.q_scales = rs.view();
    a.qt = rqt.view();
    a.qt_scales = rst.view();
    ref::quantize_weights_fp8(a);
    std::vector<std::uint8_t> gq(std::size_t(kBlock * K)), gqt(std::size_t(K * kBlock));
    std::vector<float> gs(static_cast<std::size_t>(kb)), gst(static_cast<std::size_t>(kb));  // not a declaration
    MOERAIL_CUDA_CHECK(cudaMemcpy(gq.data(), static_cast<const std::uint8_t*>(q.p) + e * N * K, gq.size(),
                                  cudaMemcpyDeviceToHost));
    MOERAIL_CUDA_CHECK(cudaMemcpy(gs.data(), static_cast<const float*>(qs.p) + e * nb * kb, gs.size() * 4,
                                  cudaMemcpyDeviceToHost));
    MOERAIL_CUDA_CHECK(cudaMemcpy2D(gqt.data(), std::size_t(kBlock), static_cast<const std::uint8_t*>(qt.p) + e * K * N,
                                    std::size_t(N), std::size_t(kBlock), std::size_t(K), cudaMemcpyDeviceToHost));
    MOERAIL_CUDA_CHECK(cudaMemcpy2D(gst.data(), 4, static_cast<const float*>(qts.p) + e * kb * nb, std::size_t(nb * 4),
                                    4, std::size_t(kb), cudaMemcpyDeviceToHost));
    auto diff = [](const void* x, const void* y, std::size_t n, const char* what) -> std::string {
      for (std::size_t i = 0; i < n; ++i)
        if (static_cast<const std::uint8_t*>(x)[i] != static_cast<const std::uint8_t*>(y)[i])
          return std::string(what) + " byte " + std::to_string(i);
      return "";
    };
    for (const std::string& m : {diff(gq.data(), rq.view().data(), gq.size(), "q"),
                                 diff(gs.data(), rs.view().data(), gs.size() * 4, "q_scales"),
                                 diff(gqt.data(), rqt.view().data(), gqt.size(), "qt"),
                                 diff(gst.data(), rst.view().data(), gst.size() * 4, "qt_scales")})
      if (!m.empty()) return "expert " + std::to_string(e) + ": " + m;
    return "";
  }
};

struct Dense {
  double fp8 = 0, fp8_fast = 0, bf16 = 0;
};

constexpr Fp8GemmTile kTiles[] = {Fp8GemmTile::Cooperative128x128, Fp8GemmTile::Pingpong64x128};  // both timed

// One case (preset, routing) of `bench mlp-fp8`: its shape and counts and the buffers every variant reads. The
// variants below run in the order they are defined: the FP8 forward, the bf16 baseline, the weight quantization,
// the FP8 dgrad, the FP8 wgrad (each FP8 one verifies what it times first); the rows are made of their figures.
struct Fp8Case {
  const BenchOptions& o;
  cudaStream_t s;
  const MlpCase& c;
  bool zipf;
  MoeConfig cfg;
  std::int64_t rows, L, H, F, F1, used = 0;
  std::string name;                   // the rows' case
  std::vector<std::int64_t> counts;   // rows per expert
  double fc1_flop = 0, fc2_flop = 0;  // over the rows of the segments (padding rows included)
  DeviceBuf cnt, ws;                  // counts on the device; the FP8 GEMMs' workspace

  Fp8Case(const BenchOptions& o_, cudaStream_t s_, const MlpCase& c_, bool zipf_)
      : o(o_), s(s_), c(c_), zipf(zipf_), cfg(mlp_case_config(c_)), rows(mlp_case_rows(c_, cfg, o_)), L(c_.L),
        H(cfg.hidden), F(cfg.ffn_hidden), F1(cfg.fc1_out()), name(std::string(c_.preset) + (zipf_ ? "-zipf" : "")),
        counts(mlp_case_counts(c_.L, rows, cfg.align, zipf_)), cnt(std::size_t(L * 8)),
        ws(grouped_gemm_fp8_workspace_bytes(L)) {
    for (std::int64_t v : counts) used += v;
    fc1_flop = 2 * double(used) * double(H) * double(F1);
    fc2_flop = 2 * double(used) * double(F) * double(H);
    MOERAIL_CUDA_CHECK(cudaMemcpy(cnt.p, counts.data(), std::size_t(L * 8), cudaMemcpyHostToDevice));
  }

  // The config entries every row of the case starts with.
  nlohmann::json shape() const {
    return {{"preset", c.preset}, {"routing", zipf ? "zipf-1.2" : "balanced"}, {"experts", L}, {"hidden", H},
            {"ffn", F}, {"fc1_out", F1}, {"rows", rows}, {"rows_in_segments", used}, {"align", cfg.align}};
  }

  // The worst relative error of GEMMs a and b over up to 16 rows of the first and of the last non-empty expert.
  double worst_rows_err(const Fp8Gemm& a, const Fp8Gemm& b) const {
    double err = 0;
    std::int64_t first = 0, last = L - 1;
    while (first < L - 1 && counts[std::size_t(first)] == 0) ++first;
    while (last > 0 && counts[std::size_t(last)] == 0) --last;
    for (std::int64_t e : {first, last}) {
      std::int64_t start = 0;
      for (std::int64_t i = 0; i < e; ++i) start += counts[std::size_t(i)];
      const std::int64_t k = std::min<std::int64_t>(16, counts[std::size_t(e)]);
      if (k == 0) continue;
      err = std::max({err, a.verify(e, start, k), b.verify(e, start, k)});
    }
    return err;
  }
};

double tflops(double flop, double us) { return us > 0 ? flop / (us * 1e6) : 0.0; }

// The row's `verified`: what was checked and its error, or that nothing was.
std::string verified_text(const BenchOptions& o, double err, const char* what) {
  return o.verify ? detail::concat("before timing: ", what, ", rel. err ", err, " (< ", kFp8Tol, ")")
                  : std::string("no (--no-verify)");
}

// ---- fwd: FC1 (N = F1, K = H) and FC2 (N = H, K = F) on random codes ----

struct Fp8Forward {
  double err = 0, pt_err = 0;             // verification: blockwise, per-tensor
  double fc1_us[2] = {}, fc2_us[2] = {};  // per tile of kTiles
  std::string fc1_tile, fc2_tile;         // the library's choice
  double fc1 = 0, fc2 = 0;                // us on that tile
  double pt_fc1 = 0, pt_fc2 = 0;          // per-tensor scaling, us
};

// Per-tensor scaling on the same codes: verified (overwrites fc1.d, fc2.d; nothing later reads them), then timed.
void time_per_tensor(const Fp8Case& k, const Fp8Gemm& fc1, const Fp8Gemm& fc2, Fp8Forward& f) {
  const BenchOptions& o = k.o;
  cudaStream_t s = k.s;
  grouped_gemm_fp8(fc1.args_per_tensor(k.cnt, k.ws), s);
  grouped_gemm_fp8(fc2.args_per_tensor(k.cnt, k.ws), s);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  if (o.verify) {
    std::int64_t start = 0;
    for (std::int64_t e = 0; e < k.L; ++e) {
      const std::int64_t n = std::min<std::int64_t>(16, k.counts[std::size_t(e)]);
      if (n > 0) {  // the first non-empty expert
        f.pt_err = std::max(fc1.verify(e, start, n, true), fc2.verify(e, start, n, true));
        break;
      }
      start += k.counts[std::size_t(e)];
    }
    if (!(f.pt_err < kFp8Tol))
      fail_with(ErrorCode::Internal, "moerail bench mlp-fp8", k.name,
                ": per-tensor verification failed, relative error ", f.pt_err, " (expected < ", kFp8Tol, ")");
  }
  f.pt_fc1 = median_us(o, s, [&](int) { grouped_gemm_fp8(fc1.args_per_tensor(k.cnt, k.ws), s); });
  f.pt_fc2 = median_us(o, s, [&](int) { grouped_gemm_fp8(fc2.args_per_tensor(k.cnt, k.ws), s); });
}

// Verified on the library's own tile choice, then both tiles of both GEMMs timed, then the per-tensor GEMMs.
Fp8Forward time_forward(const Fp8Case& k) {
  const BenchOptions& o = k.o;
  cudaStream_t s = k.s;
  const Fp8Gemm fc1(k.rows, k.L, k.F1, k.H, 100), fc2(k.rows, k.L, k.H, k.F, 200);
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
  grouped_gemm_fp8(fc1.args(k.cnt, k.ws, Fp8GemmTile::Auto), s);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  grouped_gemm_fp8(fc2.args(k.cnt, k.ws, Fp8GemmTile::Auto), s);  // fc2.d is separate: fc1's result stays
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  Fp8Forward f;
  if (o.verify) {
    f.err = k.worst_rows_err(fc1, fc2);
    if (!(f.err < kFp8Tol))
      fail_with(ErrorCode::Internal, "moerail bench mlp-fp8", k.name, ": verification failed, relative error ",
                f.err, " (expected < ", kFp8Tol, ")");
  }
  for (int t = 0; t < 2; ++t) {
    f.fc1_us[t] = median_us(o, s, [&](int) { grouped_gemm_fp8(fc1.args(k.cnt, k.ws, kTiles[t]), s); });
    f.fc2_us[t] = median_us(o, s, [&](int) { grouped_gemm_fp8(fc2.args(k.cnt, k.ws, kTiles[t]), s); });
  }
  f.fc1_tile = fp8_gemm_tile_name(Fp8GemmTile::Auto, k.rows, k.L, k.F1, k.H);
  f.fc2_tile = fp8_gemm_tile_name(Fp8GemmTile::Auto, k.rows, k.L, k.H, k.F);
  f.fc1 = f.fc1_tile == "coop128x128" ? f.fc1_us[0] : f.fc1_us[1];
  f.fc2 = f.fc2_tile == "coop128x128" ? f.fc2_us[0] : f.fc2_us[1];
  time_per_tensor(k, fc1, fc2, f);
  return f;
}

// ---- the bf16 baseline: GroupedMlp on the same counts ----

MlpOptions with_rows_hint(std::int64_t rows) {
  MlpOptions mo;
  mo.rows_hint = rows;
  return mo;
}

struct Bf16Baseline {
  Bf16Run bf;
  GroupedMlp mlp;
  double fc1_us = 0, fc2_us = 0, bwd_us = 0;

  explicit Bf16Baseline(const Fp8Case& k) : bf(k.cfg, k.rows), mlp(k.cfg, with_rows_hint(k.rows)) {}
};

// FC1 and FC2, each a forward stage of its own.
void time_bf16_forward(const Fp8Case& k, Bf16Baseline& b) {
  cudaStream_t s = k.s;
  forward_stages(b.mlp, b.bf.fwd(k.cnt), kMlpStageSetup, s);
  b.fc1_us = median_us(k.o, s, [&](int) { forward_stages(b.mlp, b.bf.fwd(k.cnt), kMlpStageFc1, s); });
  b.fc2_us = median_us(k.o, s, [&](int) { forward_stages(b.mlp, b.bf.fwd(k.cnt), kMlpStageFc2, s); });
}

// The backward without weight gradients (the dgrad baseline); it also leaves d_h1 [rows, F1], the FC1 dgrad's input.
void time_bf16_dgrad(const Fp8Case& k, Bf16Baseline& b) {
  cudaStream_t s = k.s;
  {
    std::vector<float> p(static_cast<std::size_t>(k.rows));  // nonzero probs, so the backward's products are not zeros
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = 0.1f + 0.9f * float((i * 2654435761u) % 1000u) / 1000.0f;
    MOERAIL_CUDA_CHECK(cudaMemcpy(b.bf.probs.p, p.data(), p.size() * 4, cudaMemcpyHostToDevice));
  }
  forward_stages(b.mlp, b.bf.fwd(k.cnt), kMlpStageAll, s);
  b.mlp.backward(b.bf.bwd(k.cnt), s);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  b.bwd_us = median_us(k.o, s, [&](int) { b.mlp.backward(b.bf.bwd(k.cnt), s); });
}

// [1] i32 on the device: the case's rows, the row count quantize_fp8 reads.
DeviceBuf rows_on_device(const Fp8Case& k) {
  DeviceBuf n(4);
  const std::int32_t r32 = std::int32_t(k.rows);
  MOERAIL_CUDA_CHECK(cudaMemcpy(n.p, &r32, 4, cudaMemcpyHostToDevice));
  return n;
}

// The forward's quantization passes: x [rows, H] and act [rows, F] (the bf16 run's) quantized 1x128, us.
double time_forward_quant(const Fp8Case& k, const Bf16Baseline& b) {
  const std::int64_t rows = k.rows, H = k.H, F = k.F;
  const std::int64_t C_max = std::max(H, F);  // e4m3 bytes and f32 scales of the wider of the two
  const DeviceBuf n = rows_on_device(k), q(std::size_t(rows * C_max)), sc(std::size_t(rows * C_max / kBlock * 4));
  auto quantize = [&] {
    for (const auto& [src, C] : {std::pair<const DeviceBuf*, std::int64_t>{&b.bf.x, H}, {&b.bf.act, F}})
      quantize_fp8({Fp8Scaling::Block1x128, src->view(DType::BF16, {rows, C}), n.view(DType::I32, {1}),
                    q.view(DType::F8E4M3, {rows, C}), sc.view(DType::F32, {rows, C / kBlock})}, k.s);
  };
  quantize();
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(k.s));
  return median_us(k.o, k.s, [&](int) { quantize(); });
}

// ---- the weight quantization: quantize_weights_fp8 of W1 and W2, the copies the dgrad reads ----

struct WeightQuant {
  WeightCopies w1, w2;
  double us = 0, bytes = 0;  // time of both, and the bytes they move

  explicit WeightQuant(const Fp8Case& k) : w1(k.L, k.F1, k.H), w2(k.L, k.H, k.F) {}
};

// Both copies of both weights, verified block by block against the reference, then timed.
void time_weight_quant(const Fp8Case& k, const Bf16Baseline& b, WeightQuant& wq) {
  cudaStream_t s = k.s;
  auto quantize_weights = [&] {
    quantize_weights_fp8(wq.w1.args(b.bf.w1), s);
    quantize_weights_fp8(wq.w2.args(b.bf.w2), s);
  };
  quantize_weights();
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  if (k.o.verify)
    for (std::int64_t e : {std::int64_t(0), k.L - 1})
      for (const auto& [w, c, name] : {std::tuple{&b.bf.w1, &wq.w1, "W1"}, std::tuple{&b.bf.w2, &wq.w2, "W2"}})
        if (const std::string m = c->verify(*w, e); !m.empty())
          fail_with(ErrorCode::Internal, "moerail bench mlp-fp8", k.name, ": quantize_weights_fp8 of ", name,
                    " differs from the reference: ", m);
  wq.us = median_us(k.o, s, [&](int) { quantize_weights(); });
  const double w_elems = double(k.L) * double(k.F1) * double(k.H) + double(k.L) * double(k.H) * double(k.F);
  wq.bytes = w_elems * (2 + 1 + 1) + 2 * (w_elems / double(kBlock * kBlock)) * 4;
}

// ---- bwd: the FP8 dgrad over quantize_weights_fp8's transposed copies ----

struct Fp8Dgrad {
  double err = 0, gquant_us = 0;          // verification; quantize_fp8 of dy and d_h1, us
  double dg2_us[2] = {}, dg1_us[2] = {};  // per tile of kTiles: FC2 dgrad, FC1 dgrad
  std::string dg2_tile, dg1_tile;         // the library's choice
  double dg2 = 0, dg1 = 0;                // us on that tile
};

void run_dgrad(const Fp8Case& k, const Fp8Gemm& g, Fp8GemmTile tile) {
  Fp8DgradArgs d;
  const Fp8GroupedGemmArgs a = g.args(k.cnt, k.ws, tile);
  d.dy = a.a;
  d.dy_scales = a.a_scales;
  d.wt = a.b;
  d.wt_scales = a.b_scales;
  d.counts = a.counts;
  d.dx = a.d;
  d.workspace = a.workspace;
  d.tile = tile;
  grouped_gemm_fp8_dgrad(d, k.s);
}

// FC2 dgrad: d_act [rows, F] = dy [rows, H] W2 (b = W2^T copy [L, F, H]); FC1 dgrad: dx [rows, H] = d_h1 W1. dy and
// d_h1 quantized 1x128 (timed apart), the dgrads verified on the library's tile, then both tiles timed.
Fp8Dgrad time_dgrad(const Fp8Case& k, const Bf16Baseline& b, const WeightQuant& wq) {
  const BenchOptions& o = k.o;
  cudaStream_t s = k.s;
  const std::int64_t rows = k.rows, L = k.L, H = k.H, F = k.F, F1 = k.F1;
  const Fp8Gemm dg2(rows, L, F, H, 300, wq.w2.qt.p, wq.w2.qts.p), dg1(rows, L, H, F1, 400, wq.w1.qt.p, wq.w1.qts.p);
  const DeviceBuf num_rows = rows_on_device(k);
  auto quantize_grads = [&] {
    quantize_fp8({Fp8Scaling::Block1x128, b.bf.dy.view(DType::BF16, {rows, H}), num_rows.view(DType::I32, {1}),
                  dg2.a.view(DType::F8E4M3, {rows, H}), dg2.sa.view(DType::F32, {rows, H / kBlock})}, s);
    quantize_fp8({Fp8Scaling::Block1x128, b.bf.d_h1.view(DType::BF16, {rows, F1}), num_rows.view(DType::I32, {1}),
                  dg1.a.view(DType::F8E4M3, {rows, F1}), dg1.sa.view(DType::F32, {rows, F1 / kBlock})}, s);
  };
  quantize_grads();
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  Fp8Dgrad d;
  d.gquant_us = median_us(o, s, [&](int) { quantize_grads(); });
  run_dgrad(k, dg2, Fp8GemmTile::Auto);
  run_dgrad(k, dg1, Fp8GemmTile::Auto);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  if (o.verify) {
    d.err = k.worst_rows_err(dg2, dg1);
    if (!(d.err < kFp8Tol))
      fail_with(ErrorCode::Internal, "moerail bench mlp-fp8", k.name, ": dgrad verification failed, relative error ",
                d.err, " (expected < ", kFp8Tol, ")");
  }
  for (int t = 0; t < 2; ++t) {
    d.dg2_us[t] = median_us(o, s, [&](int) { run_dgrad(k, dg2, kTiles[t]); });
    d.dg1_us[t] = median_us(o, s, [&](int) { run_dgrad(k, dg1, kTiles[t]); });
  }
  d.dg2_tile = fp8_gemm_tile_name(Fp8GemmTile::Auto, rows, L, F, H);
  d.dg1_tile = fp8_gemm_tile_name(Fp8GemmTile::Auto, rows, L, H, F1);
  d.dg2 = d.dg2_tile == "coop128x128" ? d.dg2_us[0] : d.dg2_us[1];
  d.dg1 = d.dg1_tile == "coop128x128" ? d.dg1_us[0] : d.dg1_us[1];
  return d;
}

// ---- wgrad: the bf16 delayed weight gradients (baseline), then the FP8 ones over segment-transposed copies ----

// The segment-transposed 1x128 copies of x, d_h1, act and dy as Fp8GroupedMlp makes them (quantize_fp8_transposed):
// x's from its FP8 codes and scales, dy's and d_h1's in the passes that also quantize them 1x128 along their columns
// for the dgrads, act's from bf16.
struct TransposedCopies {
  struct Copy {
    DeviceBuf q, s;
    std::int64_t C;
    Copy(std::int64_t C_, std::int64_t rows_t) : q(std::size_t(C_ * rows_t)), s(std::size_t(C_ * rows_t / 32)), C(C_) {}
  };
  std::int64_t rows_t;
  Copy xt, h1t, actt, dyt;
  DeviceBuf xq, xs, rowq, rows_s;  // x in FP8 (its 1x128 codes and scales); the row-wise codes of dy, then d_h1

  // Also replaces bf.x by its FP8 value (quantize, dequantize), as the layer's expert side holds it: the bf16
  // weight gradients then take the x the FP8 ones do.
  TransposedCopies(const Fp8Case& k, Bf16Run& bf)
      : rows_t(fp8_transposed_rows(k.rows, k.L)), xt(k.H, rows_t), h1t(k.F1, rows_t), actt(k.F, rows_t),
        dyt(k.H, rows_t), xq(std::size_t(k.rows * k.H)), xs(std::size_t(k.rows * k.H / kBlock * 4)),
        rowq(std::size_t(k.rows * std::max(k.H, k.F1))), rows_s(std::size_t(k.rows * std::max(k.H, k.F1) / kBlock * 4)) {
    const DeviceBuf num_rows = rows_on_device(k);
    const TensorView x = bf.x.view(DType::BF16, {k.rows, k.H}), n = num_rows.view(DType::I32, {1});
    const TensorView q = xq.view(DType::F8E4M3, {k.rows, k.H}), sc = xs.view(DType::F32, {k.rows, k.H / kBlock});
    quantize_fp8({Fp8Scaling::Block1x128, x, n, q, sc}, k.s);
    dequantize_fp8({Fp8Scaling::Block1x128, q, sc, n, x}, k.s);
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(k.s));
  }

  void quantize(const Fp8Case& k, const Bf16Run& bf) const {
    auto copy = [&](const TensorView& x, const Copy& cp) {
      QuantizeTransposedArgs q;
      q.x = x;
      q.counts = k.cnt.view(DType::I64, {k.L});
      q.qt = cp.q.view(DType::F8E4M3, {cp.C * rows_t});
      q.qt_scales = cp.s.view(DType::F32, {cp.C * rows_t / kBlock});
      return q;
    };
    for (const auto& [src, cp] : {std::pair<const DeviceBuf*, const Copy*>{&bf.dy, &dyt}, {&bf.d_h1, &h1t}}) {
      QuantizeTransposedArgs q = copy(src->view(DType::BF16, {k.rows, cp->C}), *cp);
      q.q = rowq.view(DType::F8E4M3, {k.rows, cp->C});
      q.q_scales = rows_s.view(DType::F32, {k.rows, cp->C / kBlock});
      quantize_fp8_transposed(q, k.s);
    }
    quantize_fp8_transposed(copy(bf.act.view(DType::BF16, {k.rows, k.F}), actt), k.s);
    QuantizeTransposedArgs q = copy(xq.view(DType::F8E4M3, {k.rows, k.H}), xt);
    q.x_scales = xs.view(DType::F32, {k.rows, k.H / kBlock});
    quantize_fp8_transposed(q, k.s);
  }

  // dw [L, N, K] = dy_copy^T x_copy over the segments.
  Fp8WgradArgs args(const Fp8Case& k, const Copy& dy_copy, const Copy& x_copy, const DeviceBuf& dw, std::int64_t N,
                    std::int64_t K) const {
    Fp8WgradArgs a;
    a.dyt = dy_copy.q.view(DType::F8E4M3, {N * rows_t});
    a.dyt_scales = dy_copy.s.view(DType::F32, {N * rows_t / kBlock});
    a.xt = x_copy.q.view(DType::F8E4M3, {K * rows_t});
    a.xt_scales = x_copy.s.view(DType::F32, {K * rows_t / kBlock});
    a.counts = k.cnt.view(DType::I64, {k.L});
    a.rows = k.rows;
    a.dw = dw.view(DType::BF16, {k.L, N, K});
    a.workspace = k.ws.view(DType::Bool, {std::int64_t(k.ws.bytes)});
    return a;
  }
};

// The worst relative error of the FP8 weight gradients against the bf16 ones (the issue's bound: 5e-2 relative to
// the bf16 reference; the difference is the e4m3 rounding of both operands), over the first non-empty expert's
// matrices.
double wgrad_rel_err(const Fp8Case& k, const DeviceBuf& fp8_dw1, const DeviceBuf& bf_dw1, const DeviceBuf& fp8_dw2,
                     const DeviceBuf& bf_dw2) {
  double worst = 0;
  std::int64_t e = 0;
  while (e < k.L - 1 && k.counts[std::size_t(e)] == 0) ++e;
  using Pair = std::tuple<const DeviceBuf*, const DeviceBuf*, std::int64_t>;
  for (const auto& [fp8, ref, n] : {Pair{&fp8_dw1, &bf_dw1, k.F1 * k.H}, Pair{&fp8_dw2, &bf_dw2, k.H * k.F}}) {
    std::vector<std::uint16_t> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
    for (const auto& [dst, src] : {std::pair{&a, fp8}, std::pair{&b, ref}})
      MOERAIL_CUDA_CHECK(cudaMemcpy(dst->data(), static_cast<const char*>(src->p) + e * n * 2, std::size_t(n) * 2,
                                    cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double x = bf16_bits_to_float(a[i]), y = bf16_bits_to_float(b[i]);
      num += (x - y) * (x - y);
      den += y * y;
    }
    worst = std::max(worst, den > 0 ? std::sqrt(num / den) : std::sqrt(num));
  }
  return worst;
}

struct Fp8Wgrad {
  double err = 0;                     // against the bf16 weight gradients
  double bf_us = 0, tquant_us = 0;    // GroupedMlp::backward_dw; the copies' passes (dy's and d_h1's with their
                                      // row-wise codes)
  double wg1_us = 0, wg2_us = 0;      // FP8 dW1, dW2
};

// dW1 = d_h1^T x and dW2 = dy^T act: the bf16 ones timed, the transposed copies made and timed, the FP8 ones
// verified against the bf16 ones, then timed.
Fp8Wgrad time_wgrad(const Fp8Case& k, Bf16Baseline& b) {
  const BenchOptions& o = k.o;
  cudaStream_t s = k.s;
  const std::int64_t rows = k.rows, L = k.L, H = k.H, F = k.F, F1 = k.F1;
  Fp8Wgrad w;
  const TransposedCopies t(k, b.bf);
  DeviceBuf bf_dw1(std::size_t(L * F1 * H * 2)), bf_dw2(std::size_t(L * H * F * 2));
  MlpBackwardDwArgs dwa;
  dwa.x = b.bf.x.view(DType::BF16, {rows, H});
  dwa.probs = b.bf.probs.view(DType::F32, {rows});
  dwa.counts = k.cnt.view(DType::I64, {L});
  dwa.act = b.bf.act.view(DType::BF16, {rows, F});
  dwa.dy = b.bf.dy.view(DType::BF16, {rows, H});
  dwa.d_h1 = b.bf.d_h1.view(DType::BF16, {rows, F1});
  dwa.grads.dw1 = bf_dw1.view(DType::BF16, {L, F1, H});
  dwa.grads.dw2 = bf_dw2.view(DType::BF16, {L, H, F});
  b.mlp.backward_dw(dwa, s);
  w.bf_us = median_us(o, s, [&](int) { b.mlp.backward_dw(dwa, s); });

  t.quantize(k, b.bf);
  w.tquant_us = median_us(o, s, [&](int) { t.quantize(k, b.bf); });
  DeviceBuf fp8_dw1(std::size_t(L * F1 * H * 2)), fp8_dw2(std::size_t(L * H * F * 2));
  const Fp8WgradArgs wg1 = t.args(k, t.h1t, t.xt, fp8_dw1, F1, H), wg2 = t.args(k, t.dyt, t.actt, fp8_dw2, H, F);
  grouped_gemm_fp8_wgrad(wg1, s);
  grouped_gemm_fp8_wgrad(wg2, s);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  if (o.verify) {
    w.err = wgrad_rel_err(k, fp8_dw1, bf_dw1, fp8_dw2, bf_dw2);
    if (!(w.err < kFp8Tol))
      fail_with(ErrorCode::Internal, "moerail bench mlp-fp8", k.name, ": wgrad verification failed, relative error ",
                w.err, " against the bf16 weight gradients (expected < ", kFp8Tol, ")");
  }
  w.wg1_us = median_us(o, s, [&](int) { grouped_gemm_fp8_wgrad(wg1, s); });
  w.wg2_us = median_us(o, s, [&](int) { grouped_gemm_fp8_wgrad(wg2, s); });
  return w;
}

// ---- the rows ----

BenchRow forward_row(const Fp8Case& k, const Fp8Forward& f, const Bf16Baseline& b, const Dense& dense,
                     const std::string& gpu, double quant_us) {
  const double fc1_flop = k.fc1_flop, fc2_flop = k.fc2_flop;
  const double fp8_us = f.fc1 + f.fc2 + quant_us, bf_us = b.fc1_us + b.fc2_us, pt_us = f.pt_fc1 + f.pt_fc2;
  nlohmann::json config = k.shape();
  config.update(nlohmann::json{
      {"scaling", "1x128 activations, 128x128 weights, fp32 scales"},
      {"fc1_tile", f.fc1_tile}, {"fc2_tile", f.fc2_tile},
      {"fc1_tflops", tflops(fc1_flop, f.fc1)}, {"fc2_tflops", tflops(fc2_flop, f.fc2)},
      {"fc1_tflops_coop128x128", tflops(fc1_flop, f.fc1_us[0])},
      {"fc1_tflops_ping64x128", tflops(fc1_flop, f.fc1_us[1])},
      {"fc2_tflops_coop128x128", tflops(fc2_flop, f.fc2_us[0])},
      {"fc2_tflops_ping64x128", tflops(fc2_flop, f.fc2_us[1])},
      {"bf16_fc1_tflops", tflops(fc1_flop, b.fc1_us)}, {"bf16_fc2_tflops", tflops(fc2_flop, b.fc2_us)},
      {"bf16_kernels", b.mlp.describe()},
      {"gemm_speedup_fc1", b.fc1_us / f.fc1}, {"gemm_speedup_fc2", b.fc2_us / f.fc2}, {"speedup", bf_us / fp8_us},
      {"gemms_us", f.fc1 + f.fc2}, {"quant_us", quant_us}, {"quant_what", "quantize_fp8 1x128 of x and of act"},
      {"per_tensor_tflops", tflops(fc1_flop + fc2_flop, pt_us)},
      {"per_tensor_us", pt_us},
      {"per_tensor_fc1_tflops", tflops(fc1_flop, f.pt_fc1)},
      {"per_tensor_fc2_tflops", tflops(fc2_flop, f.pt_fc2)},
      {"per_tensor_gemm_speedup_vs_blockwise", (f.fc1 + f.fc2) / pt_us},
      {"per_tensor_kernel", "coop128x128 fp8 fast accumulation, alpha = a_scale * b_scale[e] in the epilogue (same "
                            "codes; a_scales [1], b_scales [L])"},
      {"per_tensor_verify_rel_err", f.pt_err},
      {"dense_fp8_fast_accum_tflops", dense.fp8_fast}, {"dense_bf16_tflops", dense.bf16},
      {"fp8_time_includes_setup_kernel", true}, {"verify_rel_err", f.err}});
  BenchRow r;
  r.bench = "mlp-fp8";
  r.case_name = k.name;
  r.direction = "fwd";
  r.gpu = gpu;
  r.time_us = fp8_us;
  r.metric = "TFLOP/s";
  r.value = tflops(fc1_flop + fc2_flop, fp8_us);
  r.ceiling = Figure{"dense fp8 e4m3 GEMM 8192^3 (cuBLASLt, per-tensor fp32 scales, bf16 out)", dense.fp8,
                     std::nullopt};
  r.baseline = Figure{"bf16 grouped GEMM (moerail GroupedMlp FC1 + FC2)", tflops(fc1_flop + fc2_flop, bf_us), bf_us};
  r.config = config;
  r.verified = verified_text(k.o, f.err, "FC1 and FC2 rows of the first and last non-empty expert against a host "
                                         "fp64 product of the quantized operands (per-tensor scaling too)");
  return r;
}

// The "bwd" row: the forward row's bench, case, GPU and ceiling, with the dgrad's figures.
BenchRow dgrad_row(const BenchRow& fwd, const Fp8Case& k, const Fp8Dgrad& d, const Bf16Baseline& b,
                   const WeightQuant& wq, const Dense& dense) {
  const double fc1_flop = k.fc1_flop, fc2_flop = k.fc2_flop, fp8_us = d.dg2 + d.dg1 + d.gquant_us;
  nlohmann::json config = k.shape();
  config.update(nlohmann::json{
      {"scaling", "dy, d_h1 1x128 along the FC output; W1, W2 128x128, transposed copies"},
      {"gemms", "FC2 dgrad d_act = dy W2 (N = F, K = H); FC1 dgrad dx = d_h1 W1 (N = H, K = F1)"},
      {"fc2_dgrad_tile", d.dg2_tile}, {"fc1_dgrad_tile", d.dg1_tile},
      {"fc2_dgrad_tflops", tflops(fc2_flop, d.dg2)}, {"fc1_dgrad_tflops", tflops(fc1_flop, d.dg1)},
      {"fc2_dgrad_tflops_coop128x128", tflops(fc2_flop, d.dg2_us[0])},
      {"fc2_dgrad_tflops_ping64x128", tflops(fc2_flop, d.dg2_us[1])},
      {"fc1_dgrad_tflops_coop128x128", tflops(fc1_flop, d.dg1_us[0])},
      {"fc1_dgrad_tflops_ping64x128", tflops(fc1_flop, d.dg1_us[1])},
      {"baseline_is", "GroupedMlp::backward without weight grads: bf16 FC2 dgrad + activation backward + FC1 dgrad "
                      "(GroupedMlp exposes no per-GEMM dgrad timing)"},
      {"bf16_kernels", b.mlp.describe()},
      {"speedup", b.bwd_us / fp8_us},
      {"weight_quant_us", wq.us},
      {"weight_quant_gbps", wq.us > 0 ? wq.bytes / (wq.us * 1e3) : 0.0},
      {"weight_quant_what", "quantize_weights_fp8 of W1 and W2, q and transposed qt (bf16 read once, both e4m3 "
                            "copies and scales written)"},
      {"gemms_us", d.dg2 + d.dg1}, {"quant_us", d.gquant_us},
      {"quant_what", "quantize_fp8 1x128 of dy [rows, H] and d_h1 [rows, F1]"},
      {"dense_fp8_fast_accum_tflops", dense.fp8_fast}, {"dense_bf16_tflops", dense.bf16},
      {"fp8_time_includes_setup_kernel", true}, {"verify_rel_err", d.err}});
  BenchRow r = fwd;
  r.direction = "bwd";
  r.time_us = fp8_us;
  r.value = tflops(fc1_flop + fc2_flop, fp8_us);
  r.baseline = Figure{"bf16 GroupedMlp::backward, no weight grads (FC2 dgrad + activation backward + FC1 dgrad)",
                      tflops(fc1_flop + fc2_flop, b.bwd_us), b.bwd_us};
  r.config = config;
  r.verified = verified_text(k.o, d.err, "both FP8 dgrads' rows of the first and last non-empty expert against a "
                                         "host fp64 product");
  return r;
}

// The "wgrad" row: the forward row's bench, case, GPU and ceiling, with the weight gradients' figures. The copies
// cost what their passes take beyond the dgrad row's quantize_fp8 of dy and d_h1 (dgrad_quant_us), which they
// replace.
BenchRow wgrad_row(const BenchRow& fwd, const Fp8Case& k, const Fp8Wgrad& w, const Dense& dense,
                   double dgrad_quant_us) {
  const double copies_us = std::max(0.0, w.tquant_us - dgrad_quant_us);
  const double fc1_flop = k.fc1_flop, fc2_flop = k.fc2_flop, fp8_us = w.wg1_us + w.wg2_us + copies_us;
  nlohmann::json config = k.shape();
  config.update(nlohmann::json{
      {"scaling", "1x128 along the rows on both operands (segment-transposed copies), fp32 scales"},
      {"gemms", "FC1 dW1 = d_h1^T x (M = F1, N = H, K = rows); FC2 dW2 = dy^T act (M = H, N = F, K = rows)"},
      {"fc1_wgrad_tflops", tflops(fc1_flop, w.wg1_us)}, {"fc2_wgrad_tflops", tflops(fc2_flop, w.wg2_us)},
      {"gemms_us", w.wg1_us + w.wg2_us}, {"quant_us", copies_us},
      {"quant_what", "quantize_fp8_transposed: x from its FP8 codes, act, and dy and d_h1 with their row-wise codes "
                     "(copy_passes_us), less the bwd row's quantize_fp8 of dy and d_h1 (dgrad_quant_us)"},
      {"copy_passes_us", w.tquant_us}, {"dgrad_quant_us", dgrad_quant_us},
      {"speedup", w.bf_us / fp8_us},
      {"baseline_is", "GroupedMlp::backward_dw (bf16 dW1 and dW2 grouped GEMMs)"},
      {"dense_fp8_tflops", dense.fp8}, {"dense_bf16_tflops", dense.bf16},
      {"fp8_time_includes_setup_kernel", true}, {"verify_rel_err_vs_bf16", w.err}});
  BenchRow r = fwd;
  r.direction = "wgrad";
  r.time_us = fp8_us;
  r.value = tflops(fc1_flop + fc2_flop, fp8_us);
  r.baseline = Figure{"bf16 GroupedMlp::backward_dw (dW1 + dW2)", tflops(fc1_flop + fc2_flop, w.bf_us), w.bf_us};
  r.config = config;
  r.verified = verified_text(k.o, w.err, "the FP8 weight gradients against the bf16 ones");
  return r;
}

// One case's variants in order, then its rows: fwd, bwd (dgrad), wgrad.
std::vector<BenchRow> bench_case(const BenchOptions& o, cudaStream_t s, const MlpCase& c, bool zipf,
                                 const Dense& dense, const std::string& gpu) {
  const Fp8Case k(o, s, c, zipf);
  const Fp8Forward fwd = time_forward(k);
  Bf16Baseline bf(k);
  time_bf16_forward(k, bf);
  time_bf16_dgrad(k, bf);
  const double fwd_quant_us = time_forward_quant(k, bf);
  WeightQuant wq(k);
  time_weight_quant(k, bf, wq);
  const Fp8Dgrad dgrad = time_dgrad(k, bf, wq);
  const Fp8Wgrad wgrad = time_wgrad(k, bf);
  const BenchRow r = forward_row(k, fwd, bf, dense, gpu, fwd_quant_us);
  return {r, dgrad_row(r, k, dgrad, bf, wq, dense), wgrad_row(r, k, wgrad, dense, dgrad.gquant_us)};
}

}  // namespace

std::vector<BenchRow> run_mlp_fp8_bench(const BenchOptions& options) {
  const std::vector<const MlpCase*> cases = select_mlp_cases(options, "mlp-fp8");
  cudaStream_t s;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{s};
  const std::string gpu = tools::gpu_name(cuda::current_device());
  Dense dense;
  dense.fp8 = dense_fp8_tflops(options, s, false);
  dense.fp8_fast = dense_fp8_tflops(options, s, true);
  dense.bf16 = dense_tflops(options, s);
  std::vector<BenchRow> out;
  for (const MlpCase* c : cases)
    for (bool zipf : {false, true}) {
      std::vector<BenchRow> r = bench_case(options, s, *c, zipf, dense, gpu);
      out.insert(out.end(), r.begin(), r.end());
    }
  return out;
}

}  // namespace moerail::tools
