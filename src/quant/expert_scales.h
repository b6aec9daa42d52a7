// src/quant/expert_scales.h — the per-expert tensor scales of the per-tensor FP8 recipe (moerail/quant.h,
// QuantizeExpertsArgs), as launchers other quantizers share (quantize_fp8_experts; quantize_weights_fp8's per-tensor
// form, where each expert's matrix is one segment).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string_view>

#include "moerail/error.h"
#include "moerail/experts.h"  // kMaxLocalExperts
#include "moerail/tensor.h"

namespace moerail::quant_detail {

// The expert counts of a segment quantizer (`op`): [L] i32 or i64 on `dev`, 1 <= L <= kMaxLocalExperts (every CTA
// scans them into shared memory). Returns L; errors name `counts`.
inline std::int64_t check_expert_counts(std::string_view op, const TensorView& counts, Device dev) {
  if (!counts.defined()) fail(op, "counts is absent but required");
  check_device(op, "counts", counts, dev);
  check_shape(op, "counts", counts, {-1});
  check_dtype(op, "counts", counts, {DType::I32, DType::I64});
  const std::int64_t L = counts.size(0);
  if (L < 1 || L > kMaxLocalExperts)
    fail(op, "counts has ", L, " experts but 1 <= L <= ", kMaxLocalExperts, " are supported");
  return L;
}

// The rows of each expert of a bf16 x [rows, C] (C % 8 == 0, 16-byte aligned): the segments of counts [L] (i32 /
// i64 on the device, clipped), or, counts null, rows / L rows per expert (a grouped weight [L, N, K] as [L N, K]).
struct ExpertRows {
  const void* x = nullptr;
  long long rows = 0, C = 0;
  const void* counts = nullptr;
  bool counts_i64 = false;
  int L = 0;
};

// scales[e] = tensor_scale_from_amax(max |x| over expert e's rows, fp8_max): a zero fill of scales, the amax pass
// (per-CTA maxima in shared memory, then a device-wide atomic max per expert: exact in any order), and a pass of L
// threads turning each amax into its scale. On `stream`; no allocation, no host sync.
void launch_expert_scales(const ExpertRows& rows, float* scales, float fp8_max, cudaStream_t stream);

// q[r, c] = e4m3(x[r, c] * (1 / scales[e])) (e5m2: e5m2 codes) for the rows r of each expert e (rows past the last
// segment untouched).
void launch_expert_quantize(const ExpertRows& rows, const float* scales, std::uint8_t* q, bool e5m2,
                            cudaStream_t stream);

}  // namespace moerail::quant_detail
