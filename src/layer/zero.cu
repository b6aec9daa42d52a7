// src/layer/zero.cu — see zero.h.
#include "layer/zero.h"

#include "core/cuda_check.h"
#include "moerail/error.h"

namespace moerail::layer {
namespace {

__global__ void zero_f32_kernel(float* p, int n) {
  if (int(threadIdx.x) < n) p[threadIdx.x] = 0.0f;
}

}  // namespace

void launch_zero_f32(float* p, int n, cudaStream_t stream) {
  if (n < 1 || n > 1024) fail_with(ErrorCode::Internal, "layer zero", "n = ", n);
  zero_f32_kernel<<<1, (n + 31) / 32 * 32, 0, stream>>>(p, n);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

}  // namespace moerail::layer
