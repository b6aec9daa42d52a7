// src/layer/chunks.h — the small kernels of MoeLayer's chunked step (MoeLayerOptions::chunks): the token count of
// each chunk from the rank's T on the device, and the per-expert rows of every chunk's dispatch gathered for the
// weight gradients over all chunks. Graph-capturable; no host reads.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moerail/config.h"  // kMaxMlpChunks

namespace moerail::layer {

inline constexpr int kMaxChunks = int(kMaxMlpChunks);  // MoeLayerOptions::chunks

// chunk_tokens[c] = clamp(T - c * chunk_max, 0, chunk_max) for c < chunks, T = *num_tokens (negative read as 0).
void launch_split_tokens(const std::int32_t* num_tokens, std::int32_t* chunk_tokens, int chunks,
                         std::int64_t chunk_max, cudaStream_t stream);

// all[c][e] = rows[c][e] (the chunks' dispatch layouts' segment rows, [L] i32 each) and total[e] = their sum over c.
struct GatherCountsParams {
  const std::int32_t* rows[kMaxChunks] = {};
  int chunks = 0;
  int L = 0;
  std::int32_t* all = nullptr;    // [chunks, L]
  std::int32_t* total = nullptr;  // [L]
};
void launch_gather_counts(const GatherCountsParams& p, cudaStream_t stream);

}  // namespace moerail::layer
