// `moerail bench mlp-fp8`: the FP8 blockwise-scaled grouped GEMM (moerail/experts_fp8.h) on the grouped-MLP
// issue's shapes, forward FC1 (N = F1 = 2F, K = H) and FC2 (N = H, K = F), beside the bf16 grouped GEMMs of
// GroupedMlp on the same counts (the baseline) and the dense FP8 GEMM rate (cuBLASLt e4m3 8192^3, per-tensor fp32
// scales, bf16 out: the ceiling), all measured in the same run.
//
// FLOP model: over the R rows of the segments (padding rows included: they are computed), FC1 2 R H F1, FC2
// 2 R F H; a row's time is FC1 + FC2 (medians of each). Each FP8 call includes its setup kernel (counts ->
// per-group arguments, a few microseconds); the bf16 stages are timed without theirs (it runs once, before).
// Each case: verify 16 rows x up to 256 columns of the first and last non-empty expert against a host fp64 product
// of the dequantized operands (relative error < 5e-2), warm up, time with CUDA events, report the median; both FP8
// tiles are timed on every GEMM and recorded, the row itself uses the tile the library chooses. Working sets are GBs
// (the weights alone exceed L2), so inputs are not rotated.
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "bench.h"
#include "bench_gpu.cuh"
#include "bench_mlp.h"
#include "commands.h"
#include "core/cuda_check.h"
#include "moerail/config.h"
#include "moerail/error.h"
#include "moerail/experts.h"
#include "moerail/experts_fp8.h"

namespace moerail::tools {
namespace {

constexpr std::int64_t kBlock = 128;  // scale block (1x128 activations, 128x128 weights)
constexpr double kFp8Tol = 5e-2;      // issue 7's bound on the relative error against the dequantized product

#define BENCH_CUBLASLT(call)                                                                                 \
  do {                                                                                                       \
    const cublasStatus_t st_ = (call);                                                                       \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                        \
      fail_with(ErrorCode::Cuda, "moerail bench mlp-fp8", #call, " failed: ", cublasGetStatusString(st_));   \
  } while (0)

__device__ __forceinline__ float hash_uniform(std::int64_t i, std::uint64_t seed) {  // [0, 1)
  std::uint64_t z = (std::uint64_t(i) + 1) * 0x9e3779b97f4a7c15ull + seed * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return float(z >> 40) * (1.0f / 16777216.0f);
}

// e4m3 codes of uniform values in [-448, 448): real-looking quantized data (a block's largest value near 448).
__global__ void fill_e4m3_kernel(std::uint8_t* out, std::int64_t n, std::uint64_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    out[i] = __nv_cvt_float_to_fp8((2.0f * hash_uniform(i, seed) - 1.0f) * 448.0f, __NV_SATFINITE, __NV_E4M3);
}

// Scales uniform in [lo, hi).
__global__ void fill_scales_kernel(float* out, std::int64_t n, float lo, float hi, std::uint64_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    out[i] = lo + (hi - lo) * hash_uniform(i, seed);
}

void fill_e4m3(void* p, std::int64_t n, std::uint64_t seed) {
  fill_e4m3_kernel<<<1024, 256>>>(static_cast<std::uint8_t*>(p), n, seed);
  MOERAIL_CUDA_CHECK_LAUNCH();
}
void fill_scales(void* p, std::int64_t n, std::uint64_t seed) {
  // 1 / 448 is what a block of N(0, 1) values of amax ~4 would get; the range only keeps products finite in bf16.
  fill_scales_kernel<<<1024, 256>>>(static_cast<float*>(p), n, 0.5f / 448.0f, 2.0f / 448.0f, seed);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

// Dense FP8 GEMM rate in TFLOP/s (8192^3, e4m3 x e4m3 -> bf16, per-tensor fp32 scales, fp32 accumulation) with
// cuBLASLt: the ceiling. fast_accum = CUBLASLT_MATMUL_DESC_FAST_ACCUM (no periodic promotion of the tensor cores'
// partial sums; the blockwise kernel promotes every 128 K, so the default, promoting form is the comparable one).
double dense_fp8_tflops(const BenchOptions& o, cudaStream_t s, bool fast_accum) {
  constexpr std::int64_t n = 8192;
  // C (not read: beta = 0) and D in separate buffers: no in-place product
  DeviceBuf a(std::size_t(n * n)), b(std::size_t(n * n)), c(std::size_t(n * n * 2)), d(std::size_t(n * n * 2)),
      scales(32);  // two scales, 16 bytes apart: cuBLASLt refused every algorithm with them 4 bytes apart
  DeviceBuf ws(std::size_t(64) << 20);
  fill_e4m3(a.p, n * n, 21);
  fill_e4m3(b.p, n * n, 22);
  fill_scales(scales.p, 8, 23);
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());

  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  struct Guard {
    cublasLtHandle_t& lt;
    cublasLtMatmulDesc_t& op;
    cublasLtMatrixLayout_t &la, &lb, &ld;
    cublasLtMatmulPreference_t& pref;
    ~Guard() {
      if (pref) cublasLtMatmulPreferenceDestroy(pref);
      if (ld) cublasLtMatrixLayoutDestroy(ld);
      if (lb) cublasLtMatrixLayoutDestroy(lb);
      if (la) cublasLtMatrixLayoutDestroy(la);
      if (op) cublasLtMatmulDescDestroy(op);
      if (lt) cublasLtDestroy(lt);
    }
  } guard{lt, op, la, lb, ld, pref};
  BENCH_CUBLASLT(cublasLtCreate(&lt));
  BENCH_CUBLASLT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major D [n, n] = A^T B with A and B stored K-major ("TN", the form Hopper's fp8 tensor cores take).
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  BENCH_CUBLASLT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  BENCH_CUBLASLT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  const float* scale_a = static_cast<const float*>(scales.p);
  const float* scale_b = scale_a + 4;
  BENCH_CUBLASLT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof scale_a));
  BENCH_CUBLASLT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b));
  const std::int8_t fast = fast_accum ? 1 : 0;
  BENCH_CUBLASLT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
  BENCH_CUBLASLT(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, n, n, n));
  BENCH_CUBLASLT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, n, n, n));
  BENCH_CUBLASLT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, n, n, n));  // C (unused, beta = 0) and D
  BENCH_CUBLASLT(cublasLtMatmulPreferenceCreate(&pref));
  const std::size_t ws_bytes = ws.bytes;
  BENCH_CUBLASLT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                      sizeof ws_bytes));
  // The heuristic's candidates in its order; the first that runs is timed (cuBLASLt may offer an algorithm that
  // then refuses this problem at run time).
  constexpr int kCandidates = 8;
  cublasLtMatmulHeuristicResult_t heuristic[kCandidates] = {};
  int found = 0;
  BENCH_CUBLASLT(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, kCandidates, heuristic, &found));
  const float one = 1.0f, zero = 0.0f;
  int pick = -1;
  cublasStatus_t last = CUBLAS_STATUS_NOT_SUPPORTED;
  for (int i = 0; i < found && pick < 0; ++i) {
    last = cublasLtMatmul(lt, op, &one, a.p, la, b.p, lb, &zero, c.p, ld, d.p, ld, &heuristic[i].algo, ws.p,
                          ws.bytes, s);
    if (last == CUBLAS_STATUS_SUCCESS) pick = i;
  }
  if (pick < 0)
    fail_with(ErrorCode::Unsupported, "moerail bench mlp-fp8", "cuBLASLt offered ", found,
              " fp8 algorithms and none ran: ", cublasGetStatusString(last));
  const double us = median_us(o, s, [&](int) {
    BENCH_CUBLASLT(cublasLtMatmul(lt, op, &one, a.p, la, b.p, lb, &zero, c.p, ld, d.p, ld, &heuristic[pick].algo,
                                  ws.p, ws.bytes, s));
  });
  return 2.0 * double(n) * n * n / (us * 1e6);
}

// One FP8 grouped GEMM's device operands: a [rows, K], scales, b [L, N, K], scales, d [rows, N].
struct Fp8Gemm {
  std::int64_t rows, L, N, K, kb, nb;
  DeviceBuf a, sa, b, sb, d;

  Fp8Gemm(std::int64_t rows_, std::int64_t L_, std::int64_t N_, std::int64_t K_, std::uint64_t seed)
      : rows(rows_), L(L_), N(N_), K(K_), kb(K_ / kBlock), nb((N_ + kBlock - 1) / kBlock),
        a(std::size_t(rows * K)), sa(std::size_t(rows * kb * 4)), b(std::size_t(L * N * K)),
        sb(std::size_t(L * nb * kb * 4)), d(std::size_t(rows * N * 2)) {
    fill_e4m3(a.p, rows * K, seed);
    fill_e4m3(b.p, L * N * K, seed + 1);
    fill_scales(sa.p, rows * kb, seed + 2);
    fill_scales(sb.p, L * nb * kb, seed + 3);
  }

  Fp8GroupedGemmArgs args(const DeviceBuf& counts, const DeviceBuf& ws, Fp8GemmTile tile) const {
    Fp8GroupedGemmArgs g;
    g.a = a.view(DType::F8E4M3, {rows, K});
    g.a_scales = sa.view(DType::F32, {rows, kb});
    g.b = b.view(DType::F8E4M3, {L, N, K});
    g.b_scales = sb.view(DType::F32, {L, nb, kb});
    g.counts = counts.view(DType::I64, {L});
    g.d = d.view(DType::BF16, {rows, N});
    g.workspace = ws.view(DType::Bool, {std::int64_t(ws.bytes)});
    g.tile = tile;
    return g;
  }

  // Rows [start, start + k) of expert e, columns [0, min(N, 256)), against the host fp64 product of the
  // dequantized operands: the relative Frobenius error.
  double verify(std::int64_t e, std::int64_t start, std::int64_t k) const {
    const std::int64_t cols = std::min<std::int64_t>(N, 256);
    std::vector<std::uint8_t> ha(std::size_t(k * K)), hb(std::size_t(cols * K));
    std::vector<float> hsa(std::size_t(k * kb)), hsb(std::size_t(nb * kb));
    std::vector<std::uint16_t> hd(std::size_t(k * N));
    MOERAIL_CUDA_CHECK(cudaMemcpy(ha.data(), static_cast<const std::uint8_t*>(a.p) + start * K, ha.size(),
                                  cudaMemcpyDeviceToHost));
    MOERAIL_CUDA_CHECK(cudaMemcpy(hb.data(), static_cast<const std::uint8_t*>(b.p) + e * N * K, hb.size(),
                                  cudaMemcpyDeviceToHost));
    MOERAIL_CUDA_CHECK(cudaMemcpy(hsa.data(), static_cast<const float*>(sa.p) + start * kb, hsa.size() * 4,
                                  cudaMemcpyDeviceToHost));
    MOERAIL_CUDA_CHECK(cudaMemcpy(hsb.data(), static_cast<const float*>(sb.p) + e * nb * kb, hsb.size() * 4,
                                  cudaMemcpyDeviceToHost));
    MOERAIL_CUDA_CHECK(cudaMemcpy(hd.data(), static_cast<const std::uint16_t*>(d.p) + start * N, hd.size() * 2,
                                  cudaMemcpyDeviceToHost));
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
          acc += decode(ha[std::size_t(r * K + kk)]) * double(hsa[std::size_t(r * kb + kk / kBlock)]) *
                 decode(hb[std::size_t(n * K + kk)]) * double(hsb[std::size_t((n / kBlock) * kb + kk / kBlock)]);
        const double got = bf16_bits_to_float(hd[std::size_t(r * N + n)]);
        num += (got - acc) * (got - acc);
        den += acc * acc;
      }
    return std::sqrt(num) / std::sqrt(std::max(den, 1e-300));
  }
};

// The bf16 baseline's buffers: GroupedMlp FC1 (h1 = x W1^T) and FC2 (y = act W2^T) on the same counts.
struct Bf16Run {
  std::int64_t rows, L, H, F, F1;
  DeviceBuf x, probs, w1, w2, y, h1, act;

  Bf16Run(const MoeConfig& c, std::int64_t rows_)
      : rows(rows_), L(c.local_experts()), H(c.hidden), F(c.ffn_hidden), F1(c.fc1_out()),
        x(std::size_t(rows * H * 2)), probs(std::size_t(rows * 4)), w1(std::size_t(L * F1 * H * 2)),
        w2(std::size_t(L * H * F * 2)), y(std::size_t(rows * H * 2)), h1(std::size_t(rows * F1 * 2)),
        act(std::size_t(rows * F * 2)) {
    fill_uniform_bf16(x.p, rows * H, 1.0f, 1);
    fill_uniform_bf16(act.p, rows * F, 1.0f, 2);
    fill_uniform_bf16(w1.p, L * F1 * H, 1.0f / std::sqrt(float(H)), 3);
    fill_uniform_bf16(w2.p, L * H * F, 1.0f / std::sqrt(float(F)), 4);
    MOERAIL_CUDA_CHECK(cudaMemset(probs.p, 0, probs.bytes));
  }

  MlpForwardArgs fwd(const DeviceBuf& counts, unsigned stages) const {
    MlpForwardArgs a;
    a.x = x.view(DType::BF16, {rows, H});
    a.probs = probs.view(DType::F32, {rows});
    a.counts = counts.view(DType::I64, {L});
    a.weights.w1 = w1.view(DType::BF16, {L, F1, H});
    a.weights.w2 = w2.view(DType::BF16, {L, H, F});
    a.y = y.view(DType::BF16, {rows, H});
    a.h1 = h1.view(DType::BF16, {rows, F1});
    a.act = act.view(DType::BF16, {rows, F});
    a.stages = stages;
    return a;
  }
};

struct Dense {
  double fp8 = 0, fp8_fast = 0, bf16 = 0;
};

std::vector<BenchRow> bench_case(const BenchOptions& o, cudaStream_t s, const MlpCase& c, bool zipf,
                                 const Dense& dense, const std::string& gpu) {
  const MoeConfig cfg = mlp_case_config(c);
  const std::int64_t rows = mlp_case_rows(c, cfg, o);
  const std::string case_name = std::string(c.preset) + (zipf ? "-zipf" : "");
  const std::vector<std::int64_t> counts = mlp_case_counts(c.L, rows, cfg.align, zipf);
  const std::int64_t L = c.L, H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out();
  std::int64_t used = 0;
  for (std::int64_t v : counts) used += v;

  DeviceBuf cnt(std::size_t(L * 8)), ws(grouped_gemm_fp8_workspace_bytes(L));
  MOERAIL_CUDA_CHECK(cudaMemcpy(cnt.p, counts.data(), std::size_t(L * 8), cudaMemcpyHostToDevice));
  const Fp8Gemm fc1(rows, L, F1, H, 100), fc2(rows, L, H, F, 200);
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());

  // Verify (the library's own tile choice), then time both tiles of both GEMMs.
  grouped_gemm_fp8(fc1.args(cnt, ws, Fp8GemmTile::Auto), s);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  grouped_gemm_fp8(fc2.args(cnt, ws, Fp8GemmTile::Auto), s);  // fc2.d is separate: fc1's result stays
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  double err = 0;
  if (o.verify) {
    std::int64_t first = 0, last = L - 1;
    while (first < L - 1 && counts[std::size_t(first)] == 0) ++first;
    while (last > 0 && counts[std::size_t(last)] == 0) --last;
    for (std::int64_t e : {first, last}) {
      std::int64_t start = 0;
      for (std::int64_t i = 0; i < e; ++i) start += counts[std::size_t(i)];
      const std::int64_t k = std::min<std::int64_t>(16, counts[std::size_t(e)]);
      if (k == 0) continue;
      err = std::max({err, fc1.verify(e, start, k), fc2.verify(e, start, k)});
    }
    if (!(err < kFp8Tol))
      fail_with(ErrorCode::Internal, "moerail bench mlp-fp8", case_name, ": verification failed, relative error ",
                err, " (expected < ", kFp8Tol, ")");
  }

  const Fp8GemmTile tiles[] = {Fp8GemmTile::Cooperative128x128, Fp8GemmTile::Pingpong64x128};
  double fc1_us[2], fc2_us[2];
  for (int t = 0; t < 2; ++t) {
    fc1_us[t] = median_us(o, s, [&](int) { grouped_gemm_fp8(fc1.args(cnt, ws, tiles[t]), s); });
    fc2_us[t] = median_us(o, s, [&](int) { grouped_gemm_fp8(fc2.args(cnt, ws, tiles[t]), s); });
  }
  const std::string fc1_tile = fp8_gemm_tile_name(Fp8GemmTile::Auto, rows, L, F1, H);
  const std::string fc2_tile = fp8_gemm_tile_name(Fp8GemmTile::Auto, rows, L, H, F);
  const double fp8_fc1_us = fc1_tile == "coop128x128" ? fc1_us[0] : fc1_us[1];
  const double fp8_fc2_us = fc2_tile == "coop128x128" ? fc2_us[0] : fc2_us[1];

  // The bf16 baseline on the same counts.
  Bf16Run bf(cfg, rows);
  MlpOptions mo;
  mo.rows_hint = rows;
  GroupedMlp mlp(cfg, mo);
  mlp.forward(bf.fwd(cnt, kMlpStageSetup), s);
  const double bf_fc1_us = median_us(o, s, [&](int) { mlp.forward(bf.fwd(cnt, kMlpStageFc1), s); });
  const double bf_fc2_us = median_us(o, s, [&](int) { mlp.forward(bf.fwd(cnt, kMlpStageFc2), s); });

  const double R = double(used);
  const double fc1_flop = 2 * R * double(H) * double(F1), fc2_flop = 2 * R * double(F) * double(H);
  auto tf = [](double flop, double us) { return us > 0 ? flop / (us * 1e6) : 0.0; };
  const double fp8_us = fp8_fc1_us + fp8_fc2_us, bf_us = bf_fc1_us + bf_fc2_us;
  const double value = tf(fc1_flop + fc2_flop, fp8_us), bf_value = tf(fc1_flop + fc2_flop, bf_us);

  nlohmann::json config = {{"preset", c.preset}, {"routing", zipf ? "zipf-1.2" : "balanced"},
                           {"experts", L}, {"hidden", H}, {"ffn", F}, {"fc1_out", F1},
                           {"rows", rows}, {"rows_in_segments", used}, {"align", cfg.align},
                           {"scaling", "1x128 activations, 128x128 weights, fp32 scales"},
                           {"fc1_tile", fc1_tile}, {"fc2_tile", fc2_tile},
                           {"fc1_tflops", tf(fc1_flop, fp8_fc1_us)}, {"fc2_tflops", tf(fc2_flop, fp8_fc2_us)},
                           {"fc1_tflops_coop128x128", tf(fc1_flop, fc1_us[0])},
                           {"fc1_tflops_ping64x128", tf(fc1_flop, fc1_us[1])},
                           {"fc2_tflops_coop128x128", tf(fc2_flop, fc2_us[0])},
                           {"fc2_tflops_ping64x128", tf(fc2_flop, fc2_us[1])},
                           {"bf16_fc1_tflops", tf(fc1_flop, bf_fc1_us)}, {"bf16_fc2_tflops", tf(fc2_flop, bf_fc2_us)},
                           {"bf16_kernels", mlp.describe()},
                           {"speedup_fc1", bf_fc1_us / fp8_fc1_us}, {"speedup_fc2", bf_fc2_us / fp8_fc2_us},
                           {"speedup", bf_us / fp8_us},
                           {"dense_fp8_fast_accum_tflops", dense.fp8_fast}, {"dense_bf16_tflops", dense.bf16},
                           {"fp8_time_includes_setup_kernel", true}, {"verify_rel_err", err}};

  BenchRow r;
  r.bench = "mlp-fp8";
  r.case_name = case_name;
  r.direction = "fwd";
  r.gpu = gpu;
  r.time_us = fp8_us;
  r.metric = "TFLOP/s";
  r.value = value;
  r.ceiling = Figure{"dense fp8 e4m3 GEMM 8192^3 (cuBLASLt, per-tensor fp32 scales, bf16 out)", dense.fp8,
                     std::nullopt};
  r.baseline = Figure{"bf16 grouped GEMM (moerail GroupedMlp FC1 + FC2)", bf_value, bf_us};
  r.config = config;
  return {r};
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
