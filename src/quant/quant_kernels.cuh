// src/quant/quant_kernels.cuh — FP8 e4m3 quantize / dequantize kernels (include/moerail/quant.h).
//
// Work unit: a chunk of 16 consecutive elements of a row, one per lane: two 16-byte bf16 loads and one 16-byte
// fp8 store (quantize), or the reverse (dequantize). A scale group is G = 128 (Block1x128) or 32 (Mx1x32) columns,
// i.e. G/16 = 8 or 2 neighbouring lanes: they reduce their amax with butterfly shuffles (max is exact, so the
// order does not matter) and the group's first lane writes the scale. Since H % G == 0, chunk c belongs to scale
// c / (G/16) of the row-major [rows, H/G] scale array, whatever the row.
//
// Persistent grid (fixed from T_max and the SM count), warps striding over chunks; the number of chunks comes from
// the device token count, so a captured graph replays with any T. The loop bound is warp-uniform and groups never
// straddle it (the total is a multiple of G/16), so every lane reaches the shuffles.
//
// The arithmetic is the reference's (src/reference/quant.cpp), operation for operation: fmaxf over |x| (skips
// NaN), scale = amax / 448.0f (Block) or the E8M0 round-up of amax / 448.0f (MX), q = e4m3(x * (1 / scale)): one
// IEEE fp32 reciprocal per scale group (nvcc's default -prec-div=true), then a product per element and
// cvt.rn.satfinite.e4m3x2.f32, every NaN code made 0x7f;
// dequantize: float(q) (exact, through cvt.rn.f16x2.e4m3x2) * scale, rounded once to bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/device_utils.cuh"
#include "moerail/quant.h"

namespace moerail::quant_detail {

using cuda::kFullMask;
using cuda::kWarp;

constexpr int kThreads = 256;
constexpr int kChunk = 16;  // elements per lane per step

struct QuantParams {
  const void* x;                   // [T_max, H] bf16 (quantize) or fp8 codes (dequantize)
  void* out;                       // [T_max, H] fp8 codes (quantize) or bf16 (dequantize)
  const std::int32_t* num_tokens;  // [1]
  const float* tensor_scale;       // PerTensor: [1]
  void* scales;                    // Block1x128: [T_max, H/128] f32; Mx1x32: [T_max, H/32] E8M0 bytes
  long long chunks_per_row;        // H / 16
  int t_max;
};

// ---- element conversions (the reference's single-value functions, on the device) ---------------------------------

// Block1x128 scale: ref::block_scale_from_amax.
__device__ __forceinline__ float block_scale_from_amax(float amax) {
  const float s = amax / kE4M3Max;
  return s >= 1.17549435e-38f ? s : 1.0f;  // FLT_MIN: 1 / s stays finite
}

// Mx1x32 E8M0 code: ref::mx_scale_from_amax (smallest power of two >= amax / 448).
__device__ __forceinline__ std::uint32_t mx_scale_from_amax(float amax) {
  const float t = amax / kE4M3Max;
  if (!(t <= 3.402823466e38f)) return kE8M0NaN;
  const std::uint32_t u = __float_as_uint(t), exp = u >> 23, man = u & 0x7fffffu;
  if (exp == 0) return man > 0x400000u ? 1u : 0u;
  const std::uint32_t code = exp + (man != 0 ? 1u : 0u);
  return code < 254u ? code : 254u;
}

// ref::e8m0_to_float.
__device__ __forceinline__ float e8m0_to_float(std::uint32_t code) {
  if (code == kE8M0NaN) return __uint_as_float(0x7fffffffu);
  return __uint_as_float(code == 0 ? 0x00400000u : code << 23);
}

// Four floats -> four e4m3 codes packed little-endian (a in the lowest byte), as ref::float_to_e4m3 (kE5M2: e5m2
// codes, as ref::float_to_e5m2): the hardware's NaN code may carry the input's sign (0xff); it becomes 0x7f (NaN in
// both formats).
template <bool kE5M2 = false>
__device__ __forceinline__ std::uint32_t encode4(float a, float b, float c, float d) {
  constexpr __nv_fp8_interpretation_t kFormat = kE5M2 ? __NV_E5M2 : __NV_E4M3;
  const std::uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFormat);
  const std::uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kFormat);
  const std::uint32_t w = lo | (hi << 16);
  return w ^ (__vcmpeq4(w, 0xffffffffu) & 0x80808080u);
}

// The low and the high bf16 of a 32-bit word as floats (exact: the bits move up). Every FP8 quantizer unpacks
// its bf16 input with these.
__device__ __forceinline__ float bf16_lo(std::uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(std::uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Two e4m3 codes (low byte first) -> two floats, exact (e4m3 is a subset of f16).
__device__ __forceinline__ float2 decode2(std::uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(h));
}

// ---- one scale group (shared by every FP8 quantizer that reads bf16 rows: these kernels, the FP8 permute, the
// EP dispatch) -------------------------------------------------------------------------------------------------

// The scale of a group of G neighbouring lanes, each holding N values: amax of the lane's values (fmaxf skips NaN),
// reduced over the group with butterfly shuffles (max is exact: any order gives the same bits), then the recipe's
// scale. `stored` receives what the scale array holds: the f32 bits (Block1x128) or the E8M0 code (Mx1x32);
// PerTensor returns tensor_scale and stores nothing. Every lane of the warp must call it (the shuffles).
template <Fp8Scaling S, int G, int N>
__device__ __forceinline__ float group_scale(const float (&v)[N], float tensor_scale, std::uint32_t& stored) {
  if constexpr (S == Fp8Scaling::PerTensor) {
    return tensor_scale;
  } else {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
    if constexpr (S == Fp8Scaling::Block1x128) {
      const float scale = block_scale_from_amax(amax);
      stored = __float_as_uint(scale);
      return scale;
    } else {
      stored = mx_scale_from_amax(amax);
      return e8m0_to_float(stored);
    }
  }
}

// 16 values times inv (the scale's reciprocal, one IEEE division per group) -> 16 e4m3 (kE5M2: e5m2) codes in one
// vector.
template <bool kE5M2 = false>
__device__ __forceinline__ uint4 encode16(const float (&v)[16], float inv) {
  return make_uint4(encode4<kE5M2>(v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv),
                    encode4<kE5M2>(v[4] * inv, v[5] * inv, v[6] * inv, v[7] * inv),
                    encode4<kE5M2>(v[8] * inv, v[9] * inv, v[10] * inv, v[11] * inv),
                    encode4<kE5M2>(v[12] * inv, v[13] * inv, v[14] * inv, v[15] * inv));
}

// ---- expert segments ----------------------------------------------------------------------------------------------

// The clipped segment starts of counts [L] (i32 or i64; negative counts read as 0, segments end at `rows`) into
// s_start[0..L] (s_start[L] = the rows used) and, when s_pad is not null, the starts of the segments padded to
// multiples of `pad` rows into s_pad[0..L]. Run by the first warp of the CTA alone (32 experts per step, in expert
// order); the caller synchronizes the CTA after it. rows < 2^31 and the padded total < 2^31.
__device__ __forceinline__ void warp_segment_starts(const void* counts, bool counts_i64, int L, int rows, int* s_start,
                                                    int* s_pad, int pad) {
  const int lane = int(threadIdx.x % kWarp);
  long long carry = 0;  // the clipped counts' running sum (up to 32 counts of `rows` each: 64-bit)
  int carry_pad = 0;
  for (int base = 0; base < L; base += kWarp) {
    const int e = base + lane;
    long long c = 0;
    if (e < L)
      c = counts_i64 ? static_cast<const long long*>(counts)[e] : (long long)static_cast<const std::int32_t*>(counts)[e];
    c = c < 0 ? 0 : (c > rows ? rows : c);
    const long long v = cuda::warp_inclusive_scan(c);
    // the clipped start of e + 1 bounds e's rows; padded sizes follow from the clipped ones
    const int end = int(min(carry + v, (long long)rows)), begin = int(min(carry + v - c, (long long)rows));
    const int padded = s_pad ? (end - begin + pad - 1) / pad * pad : 0;
    const int w = cuda::warp_inclusive_scan(padded);
    if (e < L) {
      s_start[e] = begin;
      if (s_pad) s_pad[e] = carry_pad + w - padded;
    }
    carry = min(carry + __shfl_sync(kFullMask, v, kWarp - 1), (long long)rows);
    carry_pad += __shfl_sync(kFullMask, w, kWarp - 1);
  }
  if (lane == 0) {
    s_start[L] = int(carry);
    if (s_pad) s_pad[L] = carry_pad;
  }
}

// ---- kernels ------------------------------------------------------------------------------------------------------

// Lanes per scale group: 1 (PerTensor: no reduction), 8 (1x128), 2 (1x32).
template <Fp8Scaling S>
constexpr int group_lanes() {
  return S == Fp8Scaling::PerTensor ? 1 : int(fp8_scale_block_cols(S)) / kChunk;
}

template <Fp8Scaling S>
__global__ void __launch_bounds__(kThreads) quantize_kernel(QuantParams p) {
  constexpr int G = group_lanes<S>();
  const int lane = threadIdx.x % kWarp;
  const long long first = (long long)blockIdx.x * kThreads + (threadIdx.x - lane);  // warp's first chunk
  const long long stride = (long long)gridDim.x * kThreads;
  const long long total = (long long)cuda::load_token_count(p.num_tokens, p.t_max) * p.chunks_per_row;
  const uint4* x = static_cast<const uint4*>(p.x);
  uint4* q = static_cast<uint4*>(p.out);
  float tensor_scale = 1.0f;
  if constexpr (S == Fp8Scaling::PerTensor) tensor_scale = *p.tensor_scale;

  for (long long base = first; base < total; base += stride) {
    const long long c = base + lane;
    const bool valid = c < total;
    float v[kChunk];
    if (valid) {
      const uint4 in[2] = {__ldg(x + 2 * c), __ldg(x + 2 * c + 1)};
      const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(in);
#pragma unroll
      for (int i = 0; i < kChunk / 2; ++i) {  // bf16 -> f32 is exact: the bits move up
        v[2 * i] = bf16_lo(w[i]);
        v[2 * i + 1] = bf16_hi(w[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) v[i] = 0.0f;
    }

    std::uint32_t stored = 0;
    const float scale = group_scale<S, G>(v, tensor_scale, stored);
    if (S != Fp8Scaling::PerTensor && valid && (lane % G) == 0) {
      if constexpr (S == Fp8Scaling::Block1x128) static_cast<std::uint32_t*>(p.scales)[c / G] = stored;
      else static_cast<std::uint8_t*>(p.scales)[c / G] = std::uint8_t(stored);
    }
    if (valid) q[c] = encode16(v, 1.0f / scale);
  }
}

template <Fp8Scaling S>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(QuantParams p) {
  constexpr int G = group_lanes<S>();
  const long long first = (long long)blockIdx.x * kThreads + threadIdx.x;
  const long long stride = (long long)gridDim.x * kThreads;
  const long long total = (long long)cuda::load_token_count(p.num_tokens, p.t_max) * p.chunks_per_row;
  const uint4* q = static_cast<const uint4*>(p.x);
  uint4* out = static_cast<uint4*>(p.out);
  float tensor_scale = 1.0f;
  if constexpr (S == Fp8Scaling::PerTensor) tensor_scale = *p.tensor_scale;

  for (long long c = first; c < total; c += stride) {
    float scale = tensor_scale;
    if constexpr (S == Fp8Scaling::Block1x128) scale = static_cast<const float*>(p.scales)[c / G];
    if constexpr (S == Fp8Scaling::Mx1x32) scale = e8m0_to_float(static_cast<const std::uint8_t*>(p.scales)[c / G]);
    const uint4 in = __ldg(q + c);
    const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(&in);
    uint4 o[2];
    std::uint32_t* ow = reinterpret_cast<std::uint32_t*>(o);
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // codes 2i, 2i+1 -> one bf16 pair
      const float2 f = decode2(w[i / 2] >> (16 * (i % 2)));
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
      ow[i] = *reinterpret_cast<const std::uint32_t*>(&b);
    }
    out[2 * c] = o[0];
    out[2 * c + 1] = o[1];
  }
}

}  // namespace moerail::quant_detail
