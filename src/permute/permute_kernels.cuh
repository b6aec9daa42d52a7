// src/permute/permute_kernels.cuh — the two kernel shapes behind the four permute ops (include/moerail/permute.h).
//
//   scatter  one warp per work item; items [0, T) are tokens, items [T, T + pad rows) are pad rows.
//            Token t: its row (x or d_out) is read once, 16-byte vectors per lane, and stored to each of its K
//            destination rows. Mode::Copy (permute_forward) stores the bytes unchanged and scatters the probs;
//            Mode::Scale (unpermute_backward) stores w * row and, for ProbMode::InCombine, reduces
//            <y[row], d_out[t]> per slot in fp32 (lane-partial sums, then a fixed butterfly: deterministic).
//            Pad row p: found by a binary search of pad_prefix, written with zeros (prob 0).
//   gather   one warp per token: out[t] = sum_k w_k * src[row_k], fp32 accumulation in k order, one cast.
//            Used by unpermute_forward (w = p or 1) and permute_backward (w = 1, plus the d_probs gather).
// Both are persistent (grid-stride over warps): the grid is fixed at launch from T_max and the SM count, the
// work comes from the device token count, so a captured graph replays with any T.
#pragma once

#include <cstdint>

#include "core/device_utils.cuh"

namespace moerail::permute_detail {

using cuda::kFullMask;
using cuda::kWarp;

constexpr int kThreads = 256;  // 8 warps per block
// 16-byte vectors each lane holds before storing them K times: 128 B in flight per lane. Measured on an H200
// (8192 x 7168 bf16, K 8): 8 moves 3.54 TB/s against 3.43 for 4; streaming stores gave nothing at 4.
constexpr int kCopyUnroll = 8;
constexpr int kSlotBlock = 8;  // slots handled together by gather / scale: 8 independent row loads in flight

enum class ScatterMode { Copy, Scale };

struct ScatterParams {
  const void* src;              // [T_max, H]: x (Copy) or d_out (Scale)
  const float* probs;           // [T_max, K]: probs to scatter (Copy) or weights (Scale, InCombine); may be null
  const void* y;                // [capacity, H]: forward output for the d_probs dot (Scale, InCombine), else null
  const std::int32_t* num_tokens;
  const std::int32_t* dest_row;           // [T_max, K]
  const std::int32_t* tokens_per_expert;  // [E]
  const std::int32_t* segment_offset;     // [E + 1]
  const std::int32_t* pad_prefix;         // [E + 1]
  void* dst;                    // [capacity, H]: recv (Copy) or d_y (Scale)
  float* dst_probs;             // [capacity]: recv_probs (Copy), may be null
  float* d_probs;               // [T_max, K]: Scale only, may be null
  long long nvec;               // vectors per row
  int t_max, K, E, capacity;
  bool in_combine;              // Scale: weights and dot products of ProbMode::InCombine
};

struct GatherParams {
  const void* src;              // [capacity, H]: y (unpermute_forward) or d_recv (permute_backward)
  const float* weights;         // [T_max, K]: probs (InCombine), else null (w = 1)
  const float* src_probs;       // [capacity]: d_recv_probs to gather into d_probs, or null
  const std::int32_t* num_tokens;
  const std::int32_t* dest_row; // [T_max, K]
  void* out;                    // [T_max, H]
  float* d_probs;               // [T_max, K] or null
  long long nvec;
  int t_max, K, capacity;
};

// The slot's row, or -1 when it moves nothing (also for a row the buffer cannot hold: never out of bounds).
__device__ __forceinline__ int slot_row(const std::int32_t* dest_row, long long slot, int capacity) {
  const int d = dest_row[slot];
  return (d >= 0 && d < capacity) ? d : -1;
}

// The row of pad item p (0 <= p < pad_prefix[E]): expert e is the last with pad_prefix[e] <= p.
__device__ __forceinline__ int pad_row(const std::int32_t* pad_prefix, const std::int32_t* segment_offset,
                                       const std::int32_t* tokens_per_expert, int E, int item) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (pad_prefix[mid] <= item) lo = mid; else hi = mid - 1;
  }
  return segment_offset[lo] + tokens_per_expert[lo] + (item - pad_prefix[lo]);
}

__device__ __forceinline__ int pad_row(const ScatterParams& p, int item) {
  return pad_row(p.pad_prefix, p.segment_offset, p.tokens_per_expert, p.E, item);
}

template <typename V>
__device__ __forceinline__ void zero_row(V* row, long long nvec, int lane) {
  const V z = cuda::zero_vec<V>();
  for (long long v = lane; v < nvec; v += kWarp) cuda::store_vec(row + v, z);
}

template <typename T, int VB, ScatterMode Mode>
__global__ void __launch_bounds__(kThreads) scatter_kernel(ScatterParams p) {
  using V = cuda::Vec<T, VB>;
  const int lane = threadIdx.x % kWarp;
  const long long warp0 = (long long)blockIdx.x * (kThreads / kWarp) + threadIdx.x / kWarp;
  const long long nwarps = (long long)gridDim.x * (kThreads / kWarp);
  const int n_tok = cuda::load_token_count(p.num_tokens, p.t_max);
  const long long items = (long long)n_tok + p.pad_prefix[p.E];
  const V* src = static_cast<const V*>(p.src);
  V* dst = static_cast<V*>(p.dst);

  for (long long item = warp0; item < items; item += nwarps) {
    if (item >= n_tok) {  // a pad row: zeros
      const int row = pad_row(p, int(item - n_tok));
      if (row >= 0 && row < p.capacity) {
        zero_row(dst + (long long)row * p.nvec, p.nvec, lane);
        if (lane == 0 && p.dst_probs != nullptr) p.dst_probs[row] = 0.0f;
      }
      continue;
    }
    const long long t = item;
    const V* srow = src + t * p.nvec;
    int d = -1;
    float w = 1.0f;
    if (lane < p.K) {
      d = slot_row(p.dest_row, t * p.K + lane, p.capacity);
      if (p.probs != nullptr && (Mode == ScatterMode::Copy || p.in_combine)) w = p.probs[t * p.K + lane];
    }
    if constexpr (Mode == ScatterMode::Copy) {
      if (d >= 0 && p.dst_probs != nullptr) p.dst_probs[d] = w;
      // The loop bound is warp-uniform (base), so every lane reaches the shuffles below.
      for (long long base = 0; base < p.nvec; base += kWarp * kCopyUnroll) {
        const long long v0 = base + lane;
        V buf[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
          if (v0 + u * kWarp < p.nvec) buf[u] = cuda::load_vec(srow + v0 + u * kWarp);
        for (int k = 0; k < p.K; ++k) {
          const int dk = __shfl_sync(kFullMask, d, k);
          if (dk < 0) continue;  // warp-uniform
          V* drow = dst + (long long)dk * p.nvec;
#pragma unroll
          for (int u = 0; u < kCopyUnroll; ++u)
            if (v0 + u * kWarp < p.nvec) cuda::store_vec(drow + v0 + u * kWarp, buf[u]);
        }
      }
    } else {
      const bool dot = p.in_combine && p.y != nullptr;
      const V* y = static_cast<const V*>(p.y);
      for (int kb = 0; kb < p.K; kb += kSlotBlock) {
        int dk[kSlotBlock];
        float wk[kSlotBlock], acc[kSlotBlock];
#pragma unroll
        for (int j = 0; j < kSlotBlock; ++j) {
          dk[j] = __shfl_sync(kFullMask, d, (kb + j) & (kWarp - 1));
          wk[j] = __shfl_sync(kFullMask, w, (kb + j) & (kWarp - 1));
          if (kb + j >= p.K) dk[j] = -1;
          acc[j] = 0.0f;
        }
        for (long long v = lane; v < p.nvec; v += kWarp) {
          const V g = cuda::load_vec(srow + v);
          float gf[V::N];
#pragma unroll
          for (int i = 0; i < V::N; ++i) gf[i] = cuda::to_float(g.v[i]);
#pragma unroll
          for (int j = 0; j < kSlotBlock; ++j) {
            if (dk[j] < 0) continue;
            V o;
#pragma unroll
            for (int i = 0; i < V::N; ++i) o.v[i] = cuda::from_float<T>(wk[j] * gf[i]);
            cuda::store_vec(dst + (long long)dk[j] * p.nvec + v, o);
            if (dot) {
              const V yv = cuda::load_vec(y + (long long)dk[j] * p.nvec + v);
#pragma unroll
              for (int i = 0; i < V::N; ++i) acc[j] = fmaf(cuda::to_float(yv.v[i]), gf[i], acc[j]);
            }
          }
        }
        if (p.d_probs != nullptr) {
          float mine = 0.0f;
#pragma unroll
          for (int j = 0; j < kSlotBlock; ++j) {
            const float s = dot ? cuda::warp_sum(acc[j]) : 0.0f;
            if (lane == j && dk[j] >= 0) mine = s;
          }
          if (lane < kSlotBlock && kb + lane < p.K) p.d_probs[t * p.K + kb + lane] = mine;
        }
      }
    }
  }
}

template <typename T, int VB>
__global__ void __launch_bounds__(kThreads) gather_kernel(GatherParams p) {
  using V = cuda::Vec<T, VB>;
  const int lane = threadIdx.x % kWarp;
  const long long warp0 = (long long)blockIdx.x * (kThreads / kWarp) + threadIdx.x / kWarp;
  const long long nwarps = (long long)gridDim.x * (kThreads / kWarp);
  const int n_tok = cuda::load_token_count(p.num_tokens, p.t_max);
  const V* src = static_cast<const V*>(p.src);
  V* out = static_cast<V*>(p.out);

  for (long long t = warp0; t < n_tok; t += nwarps) {
    int d = -1;
    float w = 1.0f;
    if (lane < p.K) {
      d = slot_row(p.dest_row, t * p.K + lane, p.capacity);
      if (p.weights != nullptr) w = p.weights[t * p.K + lane];
      if (p.d_probs != nullptr) p.d_probs[t * p.K + lane] = (d >= 0 && p.src_probs != nullptr) ? p.src_probs[d] : 0.0f;
    }
    V* orow = out + t * p.nvec;
    // The loop bound is warp-uniform (base), so every lane reaches the shuffles below; loads and the store are
    // guarded per lane.
    for (long long base = 0; base < p.nvec; base += kWarp) {
      const long long v = base + lane;
      const bool in_row = v < p.nvec;
      float acc[V::N];
#pragma unroll
      for (int i = 0; i < V::N; ++i) acc[i] = 0.0f;
      for (int kb = 0; kb < p.K; kb += kSlotBlock) {
        V buf[kSlotBlock];
        int dk[kSlotBlock];
#pragma unroll
        for (int j = 0; j < kSlotBlock; ++j) {
          dk[j] = __shfl_sync(kFullMask, d, (kb + j) & (kWarp - 1));
          if (kb + j >= p.K) dk[j] = -1;
          if (dk[j] >= 0 && in_row) buf[j] = cuda::load_vec(src + (long long)dk[j] * p.nvec + v);
        }
#pragma unroll
        for (int j = 0; j < kSlotBlock; ++j) {
          const float wj = __shfl_sync(kFullMask, w, (kb + j) & (kWarp - 1));
          if (dk[j] < 0 || !in_row) continue;
#pragma unroll
          for (int i = 0; i < V::N; ++i) acc[i] = fmaf(wj, cuda::to_float(buf[j].v[i]), acc[i]);
        }
      }
      if (in_row) {
        V o;
#pragma unroll
        for (int i = 0; i < V::N; ++i) o.v[i] = cuda::from_float<T>(acc[i]);
        cuda::store_vec(orow + v, o);
      }
    }
  }
}

}  // namespace moerail::permute_detail
