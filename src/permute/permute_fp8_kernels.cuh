// src/permute/permute_fp8_kernels.cuh — the FP8 dispatch scatter behind permute_forward_fp8 (moerail/permute.h).
//
// The work list of permute_forward's scatter: one warp per item, items [0, T) are tokens, items [T, T + pad rows)
// pad rows; persistent grid fixed from T_max, T read on the device. A row is handled in chunks of 16 elements, one
// chunk per lane and step (the unit of src/quant): one 16-byte e4m3 vector, from two 16-byte bf16 loads
// (Fp8Source::Quantize) or one 16-byte e4m3 load (Fp8Source::Move).
//
//   Quantize  token t: kQuantUnroll chunks per lane loaded (128 bytes of bf16 in flight per lane, as the bf16
//             scatter keeps), each scale group (8 lanes for 1x128, 2 for MXFP8, 1 for per-tensor) reduces its amax
//             with butterfly shuffles and computes its scale with quant_kernels.cuh's functions, the chunks are
//             encoded once (x * (1 / scale) with an IEEE reciprocal, cvt.rn.satfinite: the arithmetic of
//             quantize_fp8 and ref::quantize_fp8, bit for bit) and stored to each of the token's K rows; the first
//             lane of each group stores the scale to the K scale rows.
//   Move      token t: kMoveUnroll e4m3 vectors per lane in flight, stored to the K rows; then the scale row
//             (f32 or E8M0 bytes) is moved element by element (scale rows are 1/32 of the data bytes).
//   pad row   data 0x00, every scale 1 (1.0f, E8M0 code 127), prob 0.
//
// Chunk c of a row belongs to scale c / G of that row (H % (16 G) == 0), and since a step's chunks start at a
// multiple of 32 per unroll slot, the G lanes of a group are either all inside the row or all past its end: every
// lane reaches the shuffles (the loop bounds are warp-uniform) and a group never mixes valid and padding chunks.
#pragma once

#include <cstdint>
#include <type_traits>

#include "permute/permute_kernels.cuh"
#include "quant/quant_kernels.cuh"

namespace moerail::permute_detail {

enum class Fp8Source { Quantize, Move };

constexpr int kFp8Chunk = quant_detail::kChunk;  // elements per lane and step: 16 (one 16-byte e4m3 vector)
constexpr int kQuantUnroll = 4;  // chunks in flight per lane when quantizing: 4 x 32 B of bf16 = 128 B
constexpr int kMoveUnroll = 8;   // e4m3 vectors in flight per lane when moving: 8 x 16 B = 128 B
constexpr float kPadScale = 1.0f;             // scale of a pad row (Block1x128)
constexpr std::uint8_t kPadScaleE8M0 = 127;   // scale of a pad row (Mx1x32): 2^(127 - 127) = 1

struct Fp8ScatterParams {
  const uint4* src;                       // [T_max, H]: bf16 (Quantize, 2 vectors per chunk) or e4m3 (Move)
  const void* src_scales;                 // Move: [T_max, scale_cols] f32 or E8M0 bytes; else null
  const float* tensor_scale;              // Quantize, PerTensor: [1]; else null
  const float* probs;                     // [T_max, K] or null
  const std::int32_t* num_tokens;         // [1]
  const std::int32_t* dest_row;           // [T_max, K]
  const std::int32_t* tokens_per_expert;  // [E]
  const std::int32_t* segment_offset;     // [E + 1]
  const std::int32_t* pad_prefix;         // [E + 1]
  uint4* dst;                             // [capacity, H] e4m3
  void* dst_scales;                       // [capacity, scale_cols] f32 or E8M0 bytes; null for PerTensor
  float* dst_probs;                       // [capacity] or null
  long long chunks;                       // H / 16: 16-byte e4m3 vectors per row
  int scale_cols;                         // H / 128 (Block1x128), H / 32 (Mx1x32), 0 (PerTensor)
  int t_max, K, E, capacity;
};

// Scale element as stored: f32 bits (moved as 32-bit words, payload bits and all) or one E8M0 byte.
template <Fp8Scaling S>
using ScaleBits = std::conditional_t<S == Fp8Scaling::Mx1x32, std::uint8_t, std::uint32_t>;

template <Fp8Scaling S>
__device__ __forceinline__ ScaleBits<S> pad_scale_bits() {
  if constexpr (S == Fp8Scaling::Mx1x32) return kPadScaleE8M0;
  else return __float_as_uint(kPadScale);
}

// 16 bf16 values (two 16-byte vectors) -> fp32, exact (the bits move up).
__device__ __forceinline__ void unpack_bf16x16(const uint4& a, const uint4& b, float (&v)[kFp8Chunk]) {
  const std::uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = quant_detail::bf16_lo(w[i]);
    v[2 * i + 1] = quant_detail::bf16_hi(w[i]);
  }
}

// Pad row `row`: data zero, scales 1, prob 0.
template <Fp8Scaling S>
__device__ __forceinline__ void write_pad_row(const Fp8ScatterParams& p, int row, int lane) {
  uint4* drow = p.dst + (long long)row * p.chunks;
  for (long long c = lane; c < p.chunks; c += kWarp) drow[c] = make_uint4(0, 0, 0, 0);
  if constexpr (S != Fp8Scaling::PerTensor) {
    ScaleBits<S>* srow = static_cast<ScaleBits<S>*>(p.dst_scales) + (long long)row * p.scale_cols;
    for (int j = lane; j < p.scale_cols; j += kWarp) srow[j] = pad_scale_bits<S>();
  }
  if (lane == 0 && p.dst_probs != nullptr) p.dst_probs[row] = 0.0f;
}

// Token row `t` quantized once and stored to the rows d (lane k holds slot k's row, -1 = none).
template <Fp8Scaling S>
__device__ __forceinline__ void quantize_token(const Fp8ScatterParams& p, long long t, int d, int lane,
                                               float tensor_scale) {
  constexpr int G = quant_detail::group_lanes<S>();
  const uint4* srow = p.src + t * 2 * p.chunks;
  for (long long base = 0; base < p.chunks; base += kWarp * kQuantUnroll) {
    uint4 raw[kQuantUnroll][2];
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) {
      const long long c = base + u * kWarp + lane;
      if (c < p.chunks) {
        raw[u][0] = __ldg(srow + 2 * c);
        raw[u][1] = __ldg(srow + 2 * c + 1);
      } else {
        raw[u][0] = raw[u][1] = make_uint4(0, 0, 0, 0);
      }
    }
    uint4 out[kQuantUnroll];
    ScaleBits<S> sbits[kQuantUnroll];
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) {
      float v[kFp8Chunk];
      unpack_bf16x16(raw[u][0], raw[u][1], v);
      std::uint32_t stored = 0;
      const float scale = quant_detail::group_scale<S, G>(v, tensor_scale, stored);
      if constexpr (S != Fp8Scaling::PerTensor) sbits[u] = ScaleBits<S>(stored);
      out[u] = quant_detail::encode16(v, 1.0f / scale);  // one IEEE reciprocal per group, as quantize_fp8
    }
    for (int k = 0; k < p.K; ++k) {
      const int dk = __shfl_sync(kFullMask, d, k);
      if (dk < 0) continue;  // warp-uniform
      uint4* drow = p.dst + (long long)dk * p.chunks;
#pragma unroll
      for (int u = 0; u < kQuantUnroll; ++u) {
        const long long c = base + u * kWarp + lane;
        if (c < p.chunks) drow[c] = out[u];
      }
      if constexpr (S != Fp8Scaling::PerTensor) {
        ScaleBits<S>* srow = static_cast<ScaleBits<S>*>(p.dst_scales) + (long long)dk * p.scale_cols;
#pragma unroll
        for (int u = 0; u < kQuantUnroll; ++u) {
          const long long c = base + u * kWarp + lane;
          if (c < p.chunks && lane % G == 0) srow[c / G] = sbits[u];
        }
      }
    }
  }
}

// Token row `t` (codes and scale row) moved as bytes to the rows d.
template <Fp8Scaling S>
__device__ __forceinline__ void move_token(const Fp8ScatterParams& p, long long t, int d, int lane) {
  const uint4* srow = p.src + t * p.chunks;
  for (long long base = 0; base < p.chunks; base += kWarp * kMoveUnroll) {
    uint4 buf[kMoveUnroll];
#pragma unroll
    for (int u = 0; u < kMoveUnroll; ++u) {
      const long long c = base + u * kWarp + lane;
      if (c < p.chunks) buf[u] = __ldg(srow + c);
    }
    for (int k = 0; k < p.K; ++k) {
      const int dk = __shfl_sync(kFullMask, d, k);
      if (dk < 0) continue;  // warp-uniform
      uint4* drow = p.dst + (long long)dk * p.chunks;
#pragma unroll
      for (int u = 0; u < kMoveUnroll; ++u) {
        const long long c = base + u * kWarp + lane;
        if (c < p.chunks) drow[c] = buf[u];
      }
    }
  }
  if constexpr (S != Fp8Scaling::PerTensor) {
    using B = ScaleBits<S>;
    const B* ssrc = static_cast<const B*>(p.src_scales) + t * p.scale_cols;
    for (int jb = 0; jb < p.scale_cols; jb += kWarp) {  // warp-uniform bound: every lane reaches the shuffles
      const int j = jb + lane;
      const bool valid = j < p.scale_cols;
      const B v = valid ? ssrc[j] : B(0);
      for (int k = 0; k < p.K; ++k) {
        const int dk = __shfl_sync(kFullMask, d, k);
        if (dk >= 0 && valid) static_cast<B*>(p.dst_scales)[(long long)dk * p.scale_cols + j] = v;
      }
    }
  }
}

template <Fp8Source Src, Fp8Scaling S>
__global__ void __launch_bounds__(kThreads) fp8_scatter_kernel(Fp8ScatterParams p) {
  const int lane = threadIdx.x % kWarp;
  const long long warp0 = (long long)blockIdx.x * (kThreads / kWarp) + threadIdx.x / kWarp;
  const long long nwarps = (long long)gridDim.x * (kThreads / kWarp);
  const int n_tok = cuda::load_token_count(p.num_tokens, p.t_max);
  const long long items = (long long)n_tok + p.pad_prefix[p.E];
  float tensor_scale = 1.0f;
  if constexpr (Src == Fp8Source::Quantize && S == Fp8Scaling::PerTensor) tensor_scale = *p.tensor_scale;

  for (long long item = warp0; item < items; item += nwarps) {
    if (item >= n_tok) {
      const int row = pad_row(p.pad_prefix, p.segment_offset, p.tokens_per_expert, p.E, int(item - n_tok));
      if (row >= 0 && row < p.capacity) write_pad_row<S>(p, row, lane);
      continue;
    }
    const long long t = item;
    int d = -1;
    if (lane < p.K) {
      d = slot_row(p.dest_row, t * p.K + lane, p.capacity);
      if (d >= 0 && p.dst_probs != nullptr) p.dst_probs[d] = p.probs[t * p.K + lane];
    }
    if constexpr (Src == Fp8Source::Quantize) quantize_token<S>(p, t, d, lane, tensor_scale);
    else move_token<S>(p, t, d, lane);
  }
}

}  // namespace moerail::permute_detail
