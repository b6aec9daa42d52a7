// src/experts/elementwise.h — the memory-bound kernels between the expert GEMMs: the fused activation pass and its
// backward, the FC2 bias, and the bias gradients. All rows are located through the segment offsets the setup
// kernel wrote ([L + 1] int64 on the device); rows past offsets[L] are never touched. Deterministic: every sum
// has a fixed order. Launch-only functions: no allocation, no host sync, graph-capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moerail/config.h"

namespace moerail::experts {

// The activation's shape and constants, copied from MoeConfig.
struct ActShape {
  Activation kind = Activation::SwiGLU;
  GluLayout layout = GluLayout::Concatenated;
  int g = 0;           // interleave block (GluLayout::Interleaved)
  int F = 0, F1 = 0;   // activation width and FC1 width (2F for GLU)
  float alpha = 1.702f, limit = 7.0f, offset = 1.0f;  // QuickGeGLU
};

inline ActShape act_shape_of(const MoeConfig& cfg) {
  ActShape s;
  s.kind = cfg.activation;
  s.layout = cfg.glu_layout;
  s.g = int(cfg.glu_block);
  s.F = int(cfg.ffn_hidden);
  s.F1 = int(cfg.fc1_out());
  s.alpha = float(cfg.quick_geglu_alpha);
  s.limit = float(cfg.quick_geglu_limit);
  s.offset = float(cfg.quick_geglu_offset);
  return s;
}

struct ActForwardParams {
  ActShape shape;
  void* h1 = nullptr;                 // [rows, F1] bf16, read; b1 added in place when b1 is given
  void* act = nullptr;                // [rows, F] bf16, written: act(h1 + b1) * p
  const float* probs = nullptr;       // [rows] f32 or nullptr (p = 1)
  const void* const* b1 = nullptr;    // [L] pointers to [F1] bf16, or nullptr
  const std::int64_t* offsets = nullptr;
  int L = 0;
};
void launch_activation_forward(const ActForwardParams& p, std::int64_t max_rows, cudaStream_t stream);

struct ActBackwardParams {
  ActShape shape;
  const void* h1 = nullptr;           // [rows, F1] bf16 (b1 included)
  const void* d_act = nullptr;        // [rows, F] bf16: dy W2, the gradient of act
  void* d_h1 = nullptr;               // [rows, F1] bf16, written
  const float* probs = nullptr;       // [rows] f32 when InActivation, else nullptr (p = 1, d_probs = 0)
  float* d_probs = nullptr;           // [rows] f32 or nullptr
  const void* dy = nullptr;           // [rows, H] bf16: for the b2 term of d_probs
  const void* const* b2 = nullptr;    // [L] pointers to [H] bf16, or nullptr
  int H = 0;
  const std::int64_t* offsets = nullptr;
  int L = 0;
};
void launch_activation_backward(const ActBackwardParams& p, std::int64_t max_rows, cudaStream_t stream);

// d_probs when FC2's dgrad epilogue did the activation backward (act_bwd_epilogue.cuh): d_probs[r] = the sum of
// row r's per-N-tile partials in tile order, or 0 without partials (probs not in the activation, as the pass writes).
struct DprobsFromPartialsParams {
  const float* partial = nullptr;     // [rows, n_tiles], or nullptr
  int n_tiles = 0;
  float* d_probs = nullptr;           // [rows], written
  const std::int64_t* offsets = nullptr;
  int L = 0;
};
void launch_dprobs_from_partials(const DprobsFromPartialsParams& p, std::int64_t max_rows, cudaStream_t stream);

// y[r, :] += s[r] * b[e(r), :], s = probs or 1 (the FC2 bias, scaled by p when InActivation).
struct RowBiasParams {
  void* y = nullptr;                  // [rows, C] bf16
  const float* probs = nullptr;       // or nullptr
  const void* const* b = nullptr;     // [L] pointers to [C] bf16
  int C = 0;
  const std::int64_t* offsets = nullptr;
  int L = 0;
};
void launch_row_bias(const RowBiasParams& p, std::int64_t max_rows, cudaStream_t stream);

// db[e][c] = sum over the rows r of segment e (in row order per lane, lanes summed in a fixed order) of
// s[r] * g[r, c], s = probs or 1; written as bf16 (or fp32) through the pointer array (zeros for empty segments).
struct BiasGradParams {
  const void* g = nullptr;            // [rows, C] bf16
  const float* probs = nullptr;       // or nullptr
  void* const* db = nullptr;          // [L] pointers to [C] bf16 (f32)
  int C = 0;
  const std::int64_t* offsets = nullptr;  // [chunks][L + 1] (setup.h): expert e's rows in every region
  int L = 0;
  int chunks = 1;
  bool accumulate = false;  // db = bf16(db + bf16(sum)) instead of bf16(sum) (MlpGrads::accumulate)
  bool f32 = false;         // db is fp32: db = sum, or with accumulate db + sum
};
void launch_bias_grad(const BiasGradParams& p, cudaStream_t stream);

}  // namespace moerail::experts
