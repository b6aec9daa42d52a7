// src/router/router_backward_kernels.cuh — the router's backward kernel (router_backward in router.cu): d_logits of
// the top-k weights, the aux loss and the z-loss, one warp per token, lane l holding experts [l*J, l*J + J) as in
// the forward (router_kernels.cuh: the launch constants, Score, softmax_row and activate).
#pragma once

#include <cstdint>

#include "core/device_utils.cuh"
#include "router/router_kernels.cuh"

namespace moerail::router_detail {

struct RouterBwdParams {
  const void* logits;
  const std::int32_t* num_tokens;
  const std::int32_t* total_tokens;
  const std::int32_t* topk_idx;
  const float* d_probs;
  const std::int32_t* aux_tpe;
  const float* d_losses;          // [2] or null
  void* d_logits;
  int t_max, E, K;
  Score score;
  float scale, aux_coeff, z_coeff, d_aux, d_z;
  bool aux, zloss, vec_load;
};

// x[j] = logits[t, lane*J + j] as float; experts >= E read as -inf. (Backward.)
template <typename T, int J>
__device__ __forceinline__ void load_logits(const T* row, int E, int lane, bool vec_load, float (&x)[J]) {
  const int e0 = lane * J;
  if constexpr ((J * sizeof(T)) % 16 == 0) {
    if (vec_load) {  // the whole row is 16-byte aligned and E == 32 * J
      constexpr int kVecs = int(J * sizeof(T) / 16);
      T tmp[J];
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
        reinterpret_cast<uint4*>(tmp)[v] = __ldg(reinterpret_cast<const uint4*>(row + e0) + v);
#pragma unroll
      for (int j = 0; j < J; ++j) x[j] = cuda::to_float(tmp[j]);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < J; ++j) x[j] = (e0 + j < E) ? cuda::to_float(row[e0 + j]) : -INFINITY;
}

// The derivative of activate (reference: activate_derivative).
__device__ __forceinline__ float activate_derivative(Score s, float x, float y) {
  if (s == Score::Sigmoid) return y * (1.0f - y);
  if (y == 0.0f) return 0.0f;
  const float dsp = x > kSoftplusThreshold ? 1.0f : 1.0f / (1.0f + expf(-x));
  return dsp / (2.0f * y);
}

// ---- backward ----------------------------------------------------------------------------------------------------

template <typename T, typename TOut, int J>
__global__ void __launch_bounds__(kBwdThreads) router_backward_kernel(RouterBwdParams p) {
  const int lane = threadIdx.x % kWarp;
  const long long warp0 = (long long)blockIdx.x * (kBwdThreads / kWarp) + threadIdx.x / kWarp;
  const long long nwarps = (long long)gridDim.x * (kBwdThreads / kWarp);
  const int n_tok = cuda::load_token_count(p.num_tokens, p.t_max);
  const T* logits = static_cast<const T*>(p.logits);
  TOut* d_logits = static_cast<TOut*>(p.d_logits);
  const float d_aux = p.d_losses != nullptr ? p.d_losses[0] : p.d_aux;
  const float d_z = p.d_losses != nullptr ? p.d_losses[1] : p.d_z;
  float aux_factor = 0.0f;
  if (p.aux) {
    const long long t_total = p.total_tokens != nullptr ? (long long)*p.total_tokens : (long long)n_tok;
    if (t_total > 0)
      aux_factor = float(double(p.E) * double(p.aux_coeff) / (double(p.K) * double(t_total) * double(t_total)));
  }

  for (long long t = warp0; t < n_tok; t += nwarps) {
    float x[J];
    load_logits<T, J>(logits + t * p.E, p.E, lane, p.vec_load, x);
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (!isfinite(x[j])) x[j] = -INFINITY;

    // g[j]: gradient of the unscaled weight of expert lane*J+j if selected (0 otherwise).
    float g[J];
    bool selected[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
      g[j] = 0.0f;
      selected[j] = false;
    }
    int idx = -1;
    float gk = 0.0f;
    if (lane < p.K) {
      idx = p.topk_idx[t * p.K + lane];
      gk = p.scale * p.d_probs[t * p.K + lane];
    }
    for (int r = 0; r < p.K; ++r) {
      const int e = __shfl_sync(kFullMask, idx, r);
      const float gr = __shfl_sync(kFullMask, gk, r);
      if (e >= 0 && e < p.E && e / J == lane) {
#pragma unroll
        for (int j = 0; j < J; ++j)
          if (lane * J + j == e) {
            g[j] += gr;
            selected[j] = true;
          }
      }
    }

    float soft[J], dx[J];
    float lse = 0.0f;
    const bool need_soft = p.score == Score::SoftmaxPre || p.zloss || (p.aux && p.score == Score::SoftmaxPost);
    if (need_soft) lse = softmax_row<J>(x, soft);
#pragma unroll
    for (int j = 0; j < J; ++j) dx[j] = 0.0f;

    if (p.score == Score::SoftmaxPre) {
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j) dot += g[j] * soft[j];
      dot = cuda::warp_sum(dot);
#pragma unroll
      for (int j = 0; j < J; ++j) dx[j] += soft[j] * (g[j] - dot);
    } else if (p.score == Score::SoftmaxPost) {
      float m = -INFINITY;
#pragma unroll
      for (int j = 0; j < J; ++j)
        if (selected[j]) m = fmaxf(m, x[j]);
      m = cuda::warp_max(m);
      float w[J], sum = 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        w[j] = selected[j] ? expf(x[j] - m) : 0.0f;
        sum += w[j];
      }
      sum = cuda::warp_sum(sum);
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        w[j] /= sum;
        dot += g[j] * w[j];
      }
      dot = cuda::warp_sum(dot);
#pragma unroll
      for (int j = 0; j < J; ++j)
        if (selected[j]) dx[j] += w[j] * (g[j] - dot);
    } else {
      float s[J], sum = 0.0f, dot = 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        s[j] = lane * J + j < p.E ? activate(p.score, x[j]) : 0.0f;
        if (selected[j]) {
          sum += s[j];
          dot += g[j] * s[j];
        }
      }
      sum = cuda::warp_sum(sum);
      dot = cuda::warp_sum(dot);
      const float denom = sum + kEps;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (!selected[j]) continue;
        const float ds = p.K > 1 ? g[j] / denom - dot / (denom * denom) : g[j];
        dx[j] += ds * activate_derivative(p.score, x[j], s[j]);
      }
    }

    if (p.aux) {
      float da[J];
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int e = lane * J + j;
        da[j] = e < p.E ? d_aux * aux_factor * float(p.aux_tpe[e]) : 0.0f;
      }
      if (p.score == Score::SoftmaxPre || p.score == Score::SoftmaxPost) {
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < J; ++j) dot += da[j] * soft[j];
        dot = cuda::warp_sum(dot);
#pragma unroll
        for (int j = 0; j < J; ++j) dx[j] += soft[j] * (da[j] - dot);
      } else {
        float s[J], sum = 0.0f, dot = 0.0f;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          s[j] = lane * J + j < p.E ? activate(p.score, x[j]) : 0.0f;
          sum += s[j];
          dot += da[j] * s[j];
        }
        sum = cuda::warp_sum(sum);
        dot = cuda::warp_sum(dot);
        const float denom = sum + kEps;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          if (lane * J + j >= p.E) continue;
          const float ds = da[j] / denom - dot / (denom * denom);
          dx[j] += ds * activate_derivative(p.score, x[j], s[j]);
        }
      }
    }
    if (p.zloss) {
      const float c = d_z * p.z_coeff * 2.0f * lse / float(n_tok);
#pragma unroll
      for (int j = 0; j < J; ++j) dx[j] += c * soft[j];
    }
    TOut* out = d_logits + t * p.E;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = lane * J + j;
      if (e < p.E) out[e] = cuda::from_float<TOut>(dx[j]);
    }
  }
}

}  // namespace moerail::router_detail
