// src/dispatch/ep_rows.cuh — moving rows in the EP data kernels: batches of 16-byte vectors per lane (loads,
// stores, the scaled copy with its dot product, fp32 accumulators) and the FP8 dispatch's quantization of a batch at
// the source.
#pragma once

#include "dispatch/ep_common.cuh"
#include "quant/quant_kernels.cuh"

namespace moerail::ep {

// ---- one batch of 16-byte vectors per lane: vectors v0 + u * 32 + lane, u < kU, of a row -----------------------

template <int kU>
__device__ __forceinline__ void load_batch(uint4 (&buf)[kU], const void* row, long long v0, long long nvec) {
  const int lane = int(threadIdx.x % 32);
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const long long v = v0 + u * 32 + lane;
    if (v < nvec) buf[u] = ld16(row, v);
  }
}

template <int kU>
__device__ __forceinline__ void store_batch(void* row, const uint4 (&buf)[kU], long long v0, long long nvec) {
  const int lane = int(threadIdx.x % 32);
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const long long v = v0 + u * 32 + lane;
    if (v < nvec) st16(row, v, buf[u]);
  }
}

// Combine backward under InCombine, one slot: dst = w * g and the warp's fp32 dot product <y, g> (lane-partial sums
// in vector order, then a fixed butterfly), a batch of g and y vectors in flight at a time. Without probs in the
// combine, d_y is d_out as it is: the scatter copies it like a dispatch.
template <typename Elem>
__device__ __forceinline__ float scale_row_and_dot(void* dst, const void* g, const void* y, float w, long long nvec) {
  constexpr int N = VecMath<Elem>::kN;
  constexpr int kU = kUnrollWide / 2;  // g and y together: the 16-byte loads in flight of a dispatch
  const int lane = int(threadIdx.x % 32);
  float dot = 0.f;
  for (long long v0 = 0; v0 < nvec; v0 += 32 * kU) {
    uint4 gb[kU], yb[kU];
    load_batch(gb, g, v0, nvec);
    load_batch(yb, y, v0, nvec);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (v0 + u * 32 + lane >= nvec) continue;
      float gv[N], yv[N];
      VecMath<Elem>::unpack(gb[u], gv);
      VecMath<Elem>::unpack(yb[u], yv);
#pragma unroll
      for (int i = 0; i < N; ++i) dot += yv[i] * gv[i];
#pragma unroll
      for (int i = 0; i < N; ++i) gv[i] *= w;
      gb[u] = VecMath<Elem>::pack(gv);
    }
    store_batch(dst, gb, v0, nvec);
  }
  return cuda::warp_sum(dot);
}

template <typename Elem, int kU>
__device__ __forceinline__ void zero_acc(float (&acc)[kU][VecMath<Elem>::kN]) {
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int j = 0; j < VecMath<Elem>::kN; ++j) acc[u][j] = 0.f;
}

// ---- FP8 at the source: one batch of bf16 vectors -> e4m3 (16 bytes per lane) + the recipe's scales -------------

// Output vector j = j0 + u * 32 + lane holds the 16 e4m3 codes of bf16 vectors 2j and 2j + 1: a scale group is
// quant_detail::group_lanes<S>() neighbouring lanes (8 for 1x128, 2 for MXFP8, 1 per-tensor), which reduce their
// amax with butterfly shuffles, and every store is 16 bytes (8-byte stores would double the store instructions per
// byte that cross the link). The arithmetic is quantize_fp8's (src/quant/quant_kernels.cuh), so the codes and scales
// are the reference's bit for bit; `stored` receives what the scale array holds (f32 bits or the E8M0 code).
// nq = H / 16 with H % 128 == 0: groups are wholly in or out of the row; every lane reaches the shuffles (the
// caller's loop bound is warp-uniform).
template <Fp8Scaling S, int kU>
__device__ __forceinline__ void load_quantize_batch(const char* x, uint4 (&q)[kU], std::uint32_t (&stored)[kU],
                                                    long long j0, long long nq, float tensor_scale) {
  const int lane = int(threadIdx.x % 32);
  uint4 in[kU][2] = {};
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const long long j = j0 + u * 32 + lane;
    if (j < nq) {
      in[u][0] = ld16(x, 2 * j);
      in[u][1] = ld16(x, 2 * j + 1);
    }
  }
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const bool valid = j0 + u * 32 + lane < nq;
    float v[16];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(&in[u][h]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // bf16 -> f32 is exact: the bits move up
        v[8 * h + 2 * i] = valid ? quant_detail::bf16_lo(w[i]) : 0.f;
        v[8 * h + 2 * i + 1] = valid ? quant_detail::bf16_hi(w[i]) : 0.f;
      }
    }
    stored[u] = 0;
    const float s = quant_detail::group_scale<S, quant_detail::group_lanes<S>()>(v, tensor_scale, stored[u]);
    q[u] = quant_detail::encode16(v, 1.0f / s);
  }
}

// Stores a quantized batch into one e4m3 row (data) and its scales (the first lane of each group; PerTensor: none).
template <Fp8Scaling S, int kU>
__device__ __forceinline__ void store_fp8_batch(char* data, std::uint32_t* scales, const uint4 (&q)[kU],
                                                const std::uint32_t (&stored)[kU], long long j0, long long nq) {
  constexpr int G = quant_detail::group_lanes<S>();
  const int lane = int(threadIdx.x % 32);
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const long long j = j0 + u * 32 + lane;
    if (j < nq) {
      st16(data, j, q[u]);
      if constexpr (S == Fp8Scaling::Block1x128) {
        if (lane % G == 0) scales[j / G] = stored[u];
      } else if constexpr (S == Fp8Scaling::Mx1x32) {
        if (lane % G == 0) reinterpret_cast<std::uint8_t*>(scales)[j / G] = std::uint8_t(stored[u]);
      }
    }
  }
}

}  // namespace moerail::ep
