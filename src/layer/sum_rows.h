// src/layer/sum_rows.h — the layer's elementwise sums over token rows: dst[t] = sum_i src_i[t] for rows t < T
// (T read from device memory), in fp32, cast once. dst may be one of the sources (in-place add).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moerail::layer {

struct SumRowsParams {
  void* dst = nullptr;               // [T_max, width] bf16
  const void* src[3] = {nullptr, nullptr, nullptr};
  int num_src = 0;                   // 1..3, summed in this order
  std::int64_t width = 0;            // elements per row, a multiple of 8
  std::int64_t t_max = 0;
  const std::int32_t* num_tokens = nullptr;
};
void launch_sum_rows_bf16(const SumRowsParams& p, cudaStream_t stream);

}  // namespace moerail::layer
