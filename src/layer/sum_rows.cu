// src/layer/sum_rows.cu — see sum_rows.h.
#include "layer/sum_rows.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "core/cuda_check.h"

namespace moerail::layer {
namespace {

__global__ void sum_rows_bf16_kernel(SumRowsParams p) {
  const long long T = ::min((long long)::max(*p.num_tokens, 0), (long long)p.t_max);
  const long long vecs = T * p.width / 8;  // 8 bf16 per 16-byte vector
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < vecs;
       i += (long long)gridDim.x * blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int s = 0; s < p.num_src; ++s) {
      const uint4 v = static_cast<const uint4*>(p.src[s])[i];
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        acc[2 * j] += f.x;
        acc[2 * j + 1] += f.y;
      }
    }
    uint4 o;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
    for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    static_cast<uint4*>(p.dst)[i] = o;
  }
}

}  // namespace

void launch_sum_rows_bf16(const SumRowsParams& p, cudaStream_t stream) {
  const long long vecs = p.t_max * p.width / 8;
  const int blocks = int(std::clamp<long long>((vecs + 255) / 256, 1, 132LL * 8));
  sum_rows_bf16_kernel<<<blocks, 256, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

}  // namespace moerail::layer
