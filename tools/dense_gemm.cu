// tools/dense_gemm.cu — what the GPU benchmarks share: random bf16 / e4m3 / scale fills (a counter hash:
// deterministic, fast for GBs) and the dense GEMM ceilings measured in the same run (cuBLAS bf16, cuBLASLt e4m3).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bench.h"
#include "bench_gpu.cuh"
#include "core/cuda_check.h"
#include "moerail/error.h"

namespace moerail::tools {
namespace {

// cuBLAS and cuBLASLt calls: an error naming the call.
#define BENCH_CUBLAS(call)                                                                        \
  do {                                                                                            \
    const cublasStatus_t st_ = (call);                                                            \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                             \
      fail_with(ErrorCode::Cuda, "moerail bench", #call, " failed: ", cublasGetStatusString(st_)); \
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

// Uniform values in [-sqrt(3) s, sqrt(3) s) (stddev s).
__global__ void fill_uniform_bf16_kernel(std::uint16_t* out, std::int64_t n, float stddev, std::uint64_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const float v = (2.0f * hash_uniform(i, seed) - 1.0f) * 1.7320508f * stddev;
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

}  // namespace

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
  BENCH_CUBLAS(cublasLtCreate(&lt));
  BENCH_CUBLAS(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major D [n, n] = A^T B with A and B stored K-major ("TN", the form Hopper's fp8 tensor cores take).
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  const float* scale_a = static_cast<const float*>(scales.p);
  const float* scale_b = scale_a + 4;
  BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof scale_a));
  BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b));
  const std::int8_t fast = fast_accum ? 1 : 0;
  BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
  BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, n, n, n));
  BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, n, n, n));
  BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, n, n, n));  // C (unused, beta = 0) and D
  BENCH_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  const std::size_t ws_bytes = ws.bytes;
  BENCH_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                      sizeof ws_bytes));
  // The heuristic's candidates in its order; the first that runs is timed (cuBLASLt may offer an algorithm that
  // then refuses this problem at run time).
  constexpr int kCandidates = 8;
  cublasLtMatmulHeuristicResult_t heuristic[kCandidates] = {};
  int found = 0;
  BENCH_CUBLAS(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, kCandidates, heuristic, &found));
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
    BENCH_CUBLAS(cublasLtMatmul(lt, op, &one, a.p, la, b.p, lb, &zero, c.p, ld, d.p, ld, &heuristic[pick].algo,
                                  ws.p, ws.bytes, s));
  });
  return 2.0 * double(n) * n * n / (us * 1e6);
}


void fill_uniform_bf16(void* p, std::int64_t n, float stddev, std::uint64_t seed) {
  fill_uniform_bf16_kernel<<<1024, 256>>>(static_cast<std::uint16_t*>(p), n, stddev, seed);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

DenseGemm::DenseGemm(cudaStream_t s)
    : s_(s), a_(std::size_t(kN) * kN * 2), b_(std::size_t(kN) * kN * 2), c_(std::size_t(kN) * kN * 2) {
  // Random operands: constant or zero data lets the tensor cores run faster than real data does.
  fill_uniform_bf16(a_.p, std::int64_t(kN) * kN, 1.0f, 11);
  fill_uniform_bf16(b_.p, std::int64_t(kN) * kN, 1.0f, 12);
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
  cublasHandle_t h;
  BENCH_CUBLAS(cublasCreate(&h));
  handle_ = h;
  BENCH_CUBLAS(cublasSetStream(h, s));
}

DenseGemm::~DenseGemm() { cublasDestroy(static_cast<cublasHandle_t>(handle_)); }

void DenseGemm::launch() {
  const float one = 1.0f, zero = 0.0f;
  BENCH_CUBLAS(cublasGemmEx(static_cast<cublasHandle_t>(handle_), CUBLAS_OP_T, CUBLAS_OP_N, kN, kN, kN, &one, a_.p,
                            CUDA_R_16BF, kN, b_.p, CUDA_R_16BF, kN, &zero, c_.p, CUDA_R_16BF, kN, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
}

double DenseGemm::measure_tflops(const BenchOptions& o) {
  return kFlop / (median_us(o, s_, [&](int) { launch(); }) * 1e6);
}

// Dense bf16 GEMM rate (8192^3, fp32 accumulation) with cuBLAS: the ceiling every row is compared with.
double dense_tflops(const BenchOptions& o, cudaStream_t s) { return DenseGemm(s).measure_tflops(o); }

}  // namespace moerail::tools
