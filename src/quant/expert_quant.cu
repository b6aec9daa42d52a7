// Per-tensor current scaling with one scale per expert segment (moerail/quant.h, QuantizeExpertsArgs): the amax
// pass, the scales, the codes. Work unit: one row per warp (its lanes over the row's 16-byte vectors), warps of a
// persistent grid striding over the rows; each CTA scans the device counts into shared memory itself (L <= 1024), so
// nothing is read on the host and a captured graph replays with any counts. A warp's rows only increase, so its
// expert is found by walking the segment starts forward. The arithmetic is the reference's
// (src/reference/quant.cpp, quantize_fp8_experts): fmaxf over |x| (NaN skipped), s = amax / fp8_max (448 for e4m3,
// 57344 for e5m2) with the FLT_MIN guard, one IEEE reciprocal per expert, a product and cvt.rn.satfinite per element.
#include <cuda_bf16.h>

#include <cstdint>
#include <string_view>

#include "core/cuda_check.h"
#include "moerail/error.h"
#include "moerail/experts.h"  // kMaxLocalExperts
#include "moerail/quant.h"
#include "quant/expert_scales.h"
#include "quant/quant_kernels.cuh"

namespace moerail {
namespace quant_detail {
namespace {

constexpr int kMaxL = int(kMaxLocalExperts);
constexpr int kWarpsPerCta = kThreads / kWarp;
constexpr std::int64_t kVecCols = 8;  // bf16 per 16-byte vector

struct ExpertRowsParams {
  const uint4* x;       // [rows, C] bf16 as 16-byte vectors
  long long rows;
  int vecs;             // C / 8
  const void* counts;   // null: rows / L per expert
  bool counts_i64;
  int L;
  unsigned* amax;       // [L]: the amax pass's device-wide maxima (float bits; the scales' memory)
  const float* scales;  // [L]: the quantize pass's scales
  uint2* q;             // [rows, C] e4m3 as 8-byte vectors
};

// kQuantize false: the amax of each expert's rows into p.amax (atomic max of the bits of floats >= 0: their order
// is the floats'); true: the codes of each row with its expert's scale (kE5M2: e5m2 codes).
template <bool kQuantize, bool kE5M2 = false>
__global__ void __launch_bounds__(kThreads) expert_rows_kernel(ExpertRowsParams p) {
  __shared__ int s_start[kMaxL + 1];
  __shared__ float s_val[kMaxL];  // amax: this CTA's maxima; quantize: 1 / scale
  if (p.counts) {
    if (threadIdx.x < kWarp) warp_segment_starts(p.counts, p.counts_i64, p.L, int(p.rows), s_start, nullptr, 0);
  } else {
    for (int e = int(threadIdx.x); e <= p.L; e += kThreads) s_start[e] = int(p.rows / p.L * e);
  }
  for (int e = int(threadIdx.x); e < p.L; e += kThreads) s_val[e] = kQuantize ? 1.0f / p.scales[e] : 0.0f;
  __syncthreads();

  const int lane = int(threadIdx.x) % kWarp, warp = int(threadIdx.x) / kWarp;
  const long long used = s_start[p.L], stride = (long long)gridDim.x * kWarpsPerCta;
  int e = 0;
  for (long long r = (long long)blockIdx.x * kWarpsPerCta + warp; r < used; r += stride) {
    while (s_start[e + 1] <= r) ++e;  // r < used = s_start[L]: e stays below L
    const uint4* row = p.x + r * p.vecs;
    float m = 0.0f;
    const float inv = kQuantize ? s_val[e] : 0.0f;
#pragma unroll 4
    for (int v = lane; v < p.vecs; v += kWarp) {
      const uint4 in = __ldg(row + v);
      if constexpr (kQuantize) {
        p.q[r * p.vecs + v] =
            make_uint2(encode4<kE5M2>(bf16_lo(in.x) * inv, bf16_hi(in.x) * inv, bf16_lo(in.y) * inv,
                                      bf16_hi(in.y) * inv),
                       encode4<kE5M2>(bf16_lo(in.z) * inv, bf16_hi(in.z) * inv, bf16_lo(in.w) * inv,
                                      bf16_hi(in.w) * inv));
      } else {
        m = fmaxf(m, fmaxf(fmaxf(fabsf(bf16_lo(in.x)), fabsf(bf16_hi(in.x))),
                           fmaxf(fabsf(bf16_lo(in.y)), fabsf(bf16_hi(in.y)))));
        m = fmaxf(m, fmaxf(fmaxf(fabsf(bf16_lo(in.z)), fabsf(bf16_hi(in.z))),
                           fmaxf(fabsf(bf16_lo(in.w)), fabsf(bf16_hi(in.w)))));
      }
    }
    if constexpr (!kQuantize) {
      m = cuda::warp_max(m);
      if (lane == 0 && m > 0.0f) atomicMax(reinterpret_cast<unsigned*>(&s_val[e]), __float_as_uint(m));
    }
  }
  if constexpr (!kQuantize) {
    __syncthreads();
    for (int i = int(threadIdx.x); i < p.L; i += kThreads)
      if (s_val[i] > 0.0f) atomicMax(p.amax + i, __float_as_uint(s_val[i]));
  }
}

// scales[e] = tensor_scale_from_amax(amax[e], fp8_max), in place.
__global__ void expert_scales_from_amax_kernel(float* scales, int L, float fp8_max) {
  const int e = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= L) return;
  const float s = scales[e] / fp8_max;
  scales[e] = s >= 1.17549435e-38f ? s : 1.0f;  // FLT_MIN: 1 / s stays finite (zero or empty segments get 1)
}

template <bool kQuantize, bool kE5M2 = false>
void launch_rows_kernel(const ExpertRowsParams& p, cudaStream_t stream) {
  constexpr auto kernel = expert_rows_kernel<kQuantize, kE5M2>;
  static const int blocks_per_sm = [] {
    int n = 0;
    MOERAIL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
    return n > 0 ? n : 1;
  }();
  const int grid = int(cuda::persistent_grid((p.rows + kWarpsPerCta - 1) / kWarpsPerCta, blocks_per_sm));
  if (grid == 0) return;
  kernel<<<grid, kThreads, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

ExpertRowsParams params_of(const ExpertRows& r) {
  ExpertRowsParams p{};
  p.x = static_cast<const uint4*>(r.x);
  p.rows = r.rows;
  p.vecs = int(r.C / 8);
  p.counts = r.counts;
  p.counts_i64 = r.counts_i64;
  p.L = r.L;
  return p;
}

}  // namespace

void launch_expert_scales(const ExpertRows& r, float* scales, float fp8_max, cudaStream_t stream) {
  MOERAIL_CUDA_CHECK(cudaMemsetAsync(scales, 0, sizeof(float) * std::size_t(r.L), stream));
  ExpertRowsParams p = params_of(r);
  p.amax = reinterpret_cast<unsigned*>(scales);
  launch_rows_kernel<false>(p, stream);
  constexpr int kFinalThreads = 256;
  expert_scales_from_amax_kernel<<<(r.L + kFinalThreads - 1) / kFinalThreads, kFinalThreads, 0, stream>>>(scales, r.L,
                                                                                                          fp8_max);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

void launch_expert_quantize(const ExpertRows& r, const float* scales, std::uint8_t* q, bool e5m2,
                            cudaStream_t stream) {
  ExpertRowsParams p = params_of(r);
  p.scales = scales;
  p.q = reinterpret_cast<uint2*>(q);
  if (e5m2) launch_rows_kernel<true, true>(p, stream);
  else launch_rows_kernel<true>(p, stream);
}

}  // namespace quant_detail

void quantize_fp8_experts(const QuantizeExpertsArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "quantize_fp8_experts";
  const Device dev = Device::cuda(cuda::current_device());
  if (!a.x.defined()) fail(op, "x is absent but required");
  check_device(op, "x", a.x, dev);
  check_shape(op, "x", a.x, {-1, -1});
  check_dtype(op, "x", a.x, {DType::BF16});
  const std::int64_t L = quant_detail::check_expert_counts(op, a.counts, dev);
  const std::int64_t rows = a.x.size(0), C = a.x.size(1);
  if (C <= 0 || C % quant_detail::kVecCols != 0)
    fail(op, "x has shape ", a.x.shape_str(), " but its columns C = ", C, " must be a positive multiple of ",
         quant_detail::kVecCols, " (16-byte vectors of bf16)");
  if (rows >= (std::int64_t(1) << 31)) fail(op, "x has ", rows, " rows but fewer than 2^31 are supported");
  if (!a.scales.defined()) fail(op, "scales is absent but required");
  check_device(op, "scales", a.scales, dev);
  check_shape(op, "scales", a.scales, {L});
  check_dtype(op, "scales", a.scales, {DType::F32});
  if ((reinterpret_cast<std::uintptr_t>(a.scales.data()) & 3u) != 0)
    fail(op, "scales at address ", a.scales.data(), " is not 4-byte aligned (the amax pass takes atomic maxima on it)");
  if (a.format != DType::F8E4M3 && a.format != DType::F8E5M2)
    fail(op, "format = ", dtype_name(a.format), " but fp8_e4m3 or fp8_e5m2 is expected");
  if (a.q.defined()) {
    check_device(op, "q", a.q, dev);
    check_shape(op, "q", a.q, {rows, C});
    check_dtype(op, "q", a.q, {a.format});
  }
  for (const auto& [name, v] : {std::pair{"x", &a.x}, std::pair{"q", &a.q}})
    if (v->defined() && !cuda::aligned16(v->data()))
      fail_with(ErrorCode::Unsupported, op, name, " at address ", v->data(),
                " is not 16-byte aligned (the kernels move 16-byte vectors)");
  quant_detail::ExpertRows r;
  r.x = a.x.data();
  r.rows = rows;
  r.C = C;
  r.counts = a.counts.data();
  r.counts_i64 = a.counts.dtype() == DType::I64;
  r.L = int(L);
  float* scales = a.scales.as<float>();
  quant_detail::launch_expert_scales(r, scales, fp8_max(a.format), stream);
  if (a.q.defined() && rows > 0)
    quant_detail::launch_expert_quantize(r, scales, a.q.as<std::uint8_t>(), a.format == DType::F8E5M2, stream);
}

}  // namespace moerail
