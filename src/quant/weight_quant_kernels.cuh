// src/quant/weight_quant_kernels.cuh — the 128x128-block weight quantizer (moerail/quant.h, quantize_weights_fp8).
//
// One CTA of 256 threads per 128x128 block (expert e, row block bn, column block bk) of w [L, N, K] bf16:
//   1. load   each thread 4 chunks of 16 elements (two 16-byte loads each; a warp reads 4 rows x 256 contiguous
//             bytes per step), 32 KiB of the block in flight per CTA; rows past N (a partial last block) are skipped;
//   2. amax   fmaxf over |w| in the thread, butterfly shuffles over the warp, the 8 warp maxima through shared
//             memory (max is exact, so the order does not matter); scale = block_scale_from_amax, inv = 1 / scale
//             (the functions and order of quant_kernels.cuh, so codes match ref::quantize_weights_fp8 bit for bit);
//   3. encode each chunk to one 16-byte e4m3 vector stored to q; with the transposed copy also to a shared tile
//             [128 n][128 k] bytes (row stride 132 bytes: 33 words);
//   4. transpose (Transposed only) each thread reads a 16 n x 4 k sub-block of the tile as 16 words, transposes it
//             with byte permutes into 4 vectors of 16 n and stores them to qt rows k (16-byte stores; lane pairs fill
//             32-byte sectors). Lane mapping k4 = 16 (warp % 2) + lane / 2, n16 = 2 (warp / 2) + lane % 2: the 32
//             lanes of a warp read words k4 + 33 (16 n16 + i), 32 distinct banks (k4 spans 16 values, n16 two values
//             16 rows = 16 banks apart), so the transposed reads are conflict-free; the encode stores of step 3
//             (4 rows x 8 chunks per warp, words 33 r + 4 kc + j) are too.
// The scale is the same for the block and its transpose, so qt's scale grid is q's transposed: thread 0 writes
// both. Nothing is read from the device but w; the grid (L * ceil(N/128) * K/128 CTAs) is fixed by the shapes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "quant/quant_kernels.cuh"  // block_scale_from_amax, encode4

namespace moerail::quant_detail {

constexpr int kWeightThreads = 256;
constexpr int kWeightBlock = 128;
constexpr int kWeightChunks = kWeightBlock * kWeightBlock / kChunk / kWeightThreads;  // 4 chunks per thread
constexpr int kTileWords = 33;                                                      // words per tile row

struct WeightQuantParams {
  const uint4* w;       // [L, N, K] bf16
  uint4* q;             // [L, N, K] e4m3
  float* q_scales;      // [L, nb, kb]
  uint4* qt;            // [L, K, N] e4m3 (Transposed)
  float* qt_scales;     // [L, kb, nb] (Transposed)
  const float* tensor_scales;  // [L] (Tensor): each expert's one scale, given (the blocks' scales are not written)
  long long N, K;
  int nb, kb;
};

// Bytes b of w0..w3 -> one word [w0.b, w1.b, w2.b, w3.b], for b = 0..3 (a 4x4 byte transpose).
__device__ __forceinline__ void transpose4x4(std::uint32_t w0, std::uint32_t w1, std::uint32_t w2, std::uint32_t w3,
                                             std::uint32_t out[4]) {
  const std::uint32_t t0 = __byte_perm(w0, w1, 0x5140), t1 = __byte_perm(w0, w1, 0x7362);
  const std::uint32_t t2 = __byte_perm(w2, w3, 0x5140), t3 = __byte_perm(w2, w3, 0x7362);
  out[0] = __byte_perm(t0, t2, 0x5410);
  out[1] = __byte_perm(t0, t2, 0x7632);
  out[2] = __byte_perm(t1, t3, 0x5410);
  out[3] = __byte_perm(t1, t3, 0x7632);
}

// Tensor: the per-tensor form, every block quantized with its expert's tensor_scales[e] (no amax, no scale grid).
template <bool Transposed, bool Tensor = false>
__global__ void __launch_bounds__(kWeightThreads) quantize_weights_kernel(WeightQuantParams p) {
  __shared__ std::uint32_t tile[Transposed ? kWeightBlock * kTileWords : 1];
  __shared__ float warp_amax[kWeightThreads / kWarp];
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int bk = int(blockIdx.x % unsigned(p.kb));
  const long long rest = blockIdx.x / unsigned(p.kb);
  const int bn = int(rest % p.nb);
  const long long e = rest / p.nb;
  const long long n0 = (long long)bn * kWeightBlock, k0 = (long long)bk * kWeightBlock;
  const long long rows = p.N - n0 < kWeightBlock ? p.N - n0 : kWeightBlock;

  // 1. load
  uint4 raw[kWeightChunks][2];
  float amax = 0.0f;  // (unused by Tensor)
#pragma unroll
  for (int c = 0; c < kWeightChunks; ++c) {
    const int chunk = c * kWeightThreads + tid, r = chunk / 8, kc = chunk % 8;
    if (r < rows) {
      const long long v = ((e * p.N + n0 + r) * p.K + k0 + kc * kChunk) / 8;  // in 16-byte bf16 vectors
      raw[c][0] = __ldg(p.w + v);
      raw[c][1] = __ldg(p.w + v + 1);
    } else {
      raw[c][0] = raw[c][1] = make_uint4(0, 0, 0, 0);
    }
    // 2. amax (bf16 -> f32 is exact: the bits move up)
    const std::uint32_t* wd = reinterpret_cast<const std::uint32_t*>(raw[c]);
#pragma unroll
    for (int i = 0; i < kChunk / 2; ++i)
      amax = fmaxf(amax, fmaxf(fabsf(bf16_lo(wd[i])), fabsf(bf16_hi(wd[i]))));
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
  amax = warp_amax[0];
#pragma unroll
  for (int i = 1; i < kWeightThreads / kWarp; ++i) amax = fmaxf(amax, warp_amax[i]);
  const float scale = Tensor ? p.tensor_scales[e] : block_scale_from_amax(amax);
  const float inv = 1.0f / scale;
  if (!Tensor && tid == 0) {
    p.q_scales[(e * p.nb + bn) * p.kb + bk] = scale;
    if constexpr (Transposed) p.qt_scales[(e * p.kb + bk) * p.nb + bn] = scale;
  }

  // 3. encode
#pragma unroll
  for (int c = 0; c < kWeightChunks; ++c) {
    const int chunk = c * kWeightThreads + tid, r = chunk / 8, kc = chunk % 8;
    if (r >= rows) continue;
    const std::uint32_t* wd = reinterpret_cast<const std::uint32_t*>(raw[c]);
    std::uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::uint32_t a = wd[2 * i], b = wd[2 * i + 1];
      o[i] = encode4(bf16_lo(a) * inv, bf16_hi(a) * inv, bf16_lo(b) * inv, bf16_hi(b) * inv);
    }
    p.q[((e * p.N + n0 + r) * p.K + k0 + kc * kChunk) / 16] = make_uint4(o[0], o[1], o[2], o[3]);
    if constexpr (Transposed) {
#pragma unroll
      for (int i = 0; i < 4; ++i) tile[r * kTileWords + kc * 4 + i] = o[i];
    }
  }

  // 4. transpose (N % 128 == 0 here: every block is full)
  if constexpr (Transposed) {
    __syncthreads();
    const int k4 = 16 * (warp % 2) + lane / 2, n16 = 2 * (warp / 2) + lane % 2;
    std::uint32_t col[4][4];  // col[b][g]: k = 4 k4 + b, n = 16 n16 + 4 g .. + 3
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const int r = 16 * n16 + 4 * g;
      std::uint32_t t[4];
      transpose4x4(tile[(r + 0) * kTileWords + k4], tile[(r + 1) * kTileWords + k4], tile[(r + 2) * kTileWords + k4],
                   tile[(r + 3) * kTileWords + k4], t);
#pragma unroll
      for (int b = 0; b < 4; ++b) col[b][g] = t[b];
    }
#pragma unroll
    for (int b = 0; b < 4; ++b)
      p.qt[((e * p.K + k0 + 4 * k4 + b) * p.N + n0 + 16 * n16) / 16] =
          make_uint4(col[b][0], col[b][1], col[b][2], col[b][3]);
  }
}

}  // namespace moerail::quant_detail
