// src/layer/chunks.cu — see chunks.h.
#include "layer/chunks.h"

#include "core/cuda_check.h"
#include "moerail/error.h"

namespace moerail::layer {
namespace {

__global__ void split_tokens_kernel(const std::int32_t* num_tokens, std::int32_t* chunk_tokens, int chunks,
                                    long long chunk_max) {
  const long long T = *num_tokens > 0 ? *num_tokens : 0;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const long long left = T - c * chunk_max;
    chunk_tokens[c] = std::int32_t(left < 0 ? 0 : (left > chunk_max ? chunk_max : left));
  }
}

__global__ void gather_counts_kernel(GatherCountsParams p) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < p.L; e += gridDim.x * blockDim.x) {
    std::int32_t sum = 0;
    for (int c = 0; c < p.chunks; ++c) {
      const std::int32_t n = p.rows[c][e];
      p.all[c * p.L + e] = n;
      sum += n;
    }
    p.total[e] = sum;
  }
}

}  // namespace

void launch_split_tokens(const std::int32_t* num_tokens, std::int32_t* chunk_tokens, int chunks,
                         std::int64_t chunk_max, cudaStream_t stream) {
  if (chunks < 1 || chunks > kMaxChunks) fail_with(ErrorCode::Internal, "layer chunks", "chunks = ", chunks);
  split_tokens_kernel<<<1, 32, 0, stream>>>(num_tokens, chunk_tokens, chunks, chunk_max);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

void launch_gather_counts(const GatherCountsParams& p, cudaStream_t stream) {
  if (p.chunks < 1 || p.chunks > kMaxChunks || p.L < 1)
    fail_with(ErrorCode::Internal, "layer chunks", "chunks = ", p.chunks, ", L = ", p.L);
  gather_counts_kernel<<<(p.L + 255) / 256, 256, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

}  // namespace moerail::layer
