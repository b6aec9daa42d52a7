// src/router/router_kernels.cuh — router kernels (include/moerail/router.h).
//
// One warp per token; lane l holds the J consecutive experts [l*J, l*J + J) of the token in registers (J = E/32
// rounded up to 1, 2, 4, 8 or 16), so a bf16 row of 256 logits is one 16-byte load per lane.
// Top-k is K rounds of a warp arg-max on order-preserving integer keys: __reduce_max_sync finds the best key,
// __reduce_min_sync the lowest expert holding it (ties go to the lower index, as the reference), and the owner
// lane clears that key. Groups: each warp writes its selection scores to shared memory (skewed, conflict-free),
// lane g sums the top (K / group_topk) of group g, and group_topk rounds of the same arg-max keep the best groups.
//
// Losses are reduced without float atomics, in a fixed order: each warp accumulates its tokens in registers, the
// block adds its warps in order into one partial per block, and router_finalize_kernel adds the partials in order
// (the last block to finish computes the losses; an integer ticket decides which one that is).
#pragma once

#include <cstdint>

#include "core/device_utils.cuh"
#include "core/status_device.cuh"

namespace moerail::router_detail {

using cuda::kFullMask;
using cuda::kWarp;

constexpr int kWarps = 8;             // warps per block of the forward kernel
constexpr int kTokensPerWarp = 4;     // tokens each warp routes, one after the other
constexpr int kTokensPerBlock = kWarps * kTokensPerWarp;
constexpr int kBwdThreads = 256;
constexpr int kFinalizeWarps = 32;    // finalize: one warp per partial stripe, 32 experts per block
constexpr int kMaxPerGroup = 8;       // K / group_topk
constexpr float kEps = 1e-20f;
constexpr float kSoftplusThreshold = 20.0f;

enum class Score : int { SoftmaxPre, SoftmaxPost, Sigmoid, SqrtSoftplus };

struct RouterParams {
  const void* logits;             // [T_max, E]
  const float* bias;              // [E] or null
  const std::int32_t* num_tokens;
  const std::int32_t* total_tokens;  // or null
  std::int32_t* topk_idx;         // [T_max, K]
  float* topk_probs;              // [T_max, K]
  float* losses;                  // [2] or null
  std::int32_t* aux_tpe;          // [E] or null
  DeviceStatus* status;           // or null
  float* partial_score;           // [blocks, E]
  int* partial_count;             // [blocks, E]
  float* partial_z;               // [blocks]
  float* score_sum;               // [E]
  unsigned* ticket;               // [1]
  int t_max, E, K, num_groups, group_topk, group_size, blocks;
  Score score;
  float scale, aux_coeff, z_coeff;
  bool aux, zloss, vec_load;
};

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

// ---- per-token pieces ---------------------------------------------------------------------------------------------

// x[j] = logits[t, lane*J + j] as float; experts >= E read as -inf.
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

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }

// The sigmoid-type activation and its derivative (reference: activate / activate_derivative).
__device__ __forceinline__ float activate(Score s, float x) {
  if (s == Score::Sigmoid) return 1.0f / (1.0f + expf(-x));
  return sqrtf(x > kSoftplusThreshold ? x : log1pf(expf(x)));
}
__device__ __forceinline__ float activate_derivative(Score s, float x, float y) {
  if (s == Score::Sigmoid) return y * (1.0f - y);
  if (y == 0.0f) return 0.0f;
  const float dsp = x > kSoftplusThreshold ? 1.0f : 1.0f / (1.0f + expf(-x));
  return dsp / (2.0f * y);
}

// Softmax over the token's E logits (invalid experts hold -inf and get 0). Returns the log-sum-exp.
template <int J>
__device__ __forceinline__ float softmax_row(const float (&x)[J], float (&p)[J]) {
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < J; ++j) m = fmaxf(m, x[j]);
  m = cuda::warp_max(m);
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    p[j] = x[j] == -INFINITY ? 0.0f : expf(x[j] - m);
    s += p[j];
  }
  s = cuda::warp_sum(s);
  const float inv = 1.0f / s;
#pragma unroll
  for (int j = 0; j < J; ++j) p[j] *= inv;
  return m + logf(s);
}

// One round of the warp arg-max over key[J] (0 = not a candidate). Returns the winning expert (UINT_MAX if no
// candidate), clears its key in the owner lane and sets *src_lane to the owner lane and *src_j to the slot there.
template <int J>
__device__ __forceinline__ unsigned argmax_round(unsigned (&key)[J], int lane, int* best_j) {
  unsigned bk = 0;
  int bj = 0;
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (key[j] > bk) {
      bk = key[j];
      bj = j;
    }
  const unsigned mx = __reduce_max_sync(kFullMask, bk);
  const unsigned cand = (bk == mx && bk != 0) ? unsigned(lane * J + bj) : 0xffffffffu;
  const unsigned win = __reduce_min_sync(kFullMask, cand);
  if (cand == win && win != 0xffffffffu) {
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (j == bj) key[j] = 0;
  }
  *best_j = bj;
  return win;
}

template <int J>
__device__ __forceinline__ float pick(const float (&v)[J], int j) {
  float r = 0.0f;
#pragma unroll
  for (int q = 0; q < J; ++q)
    if (q == j) r = v[q];
  return r;
}

// Group-limited selection: clears the keys of experts outside the group_topk best groups.
template <int J>
__device__ __forceinline__ void limit_groups(const RouterParams& p, const float (&sel)[J], unsigned (&key)[J],
                                             float* buf, int lane) {
  // Skewed index e + e/32 keeps lane g's walk over its group free of bank conflicts.
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = lane * J + j;
    if (e < p.E) buf[e + (e >> 5)] = sel[j];
  }
  __syncwarp();
  const int per_group = p.K / p.group_topk;
  unsigned gkey = 0;
  if (lane < p.num_groups) {
    float top[kMaxPerGroup];
#pragma unroll
    for (int q = 0; q < kMaxPerGroup; ++q) top[q] = -INFINITY;
    const int first = lane * p.group_size;
    for (int i = 0; i < p.group_size; ++i) {
      const int e = first + i;
      float v = buf[e + (e >> 5)];
#pragma unroll
      for (int q = 0; q < kMaxPerGroup; ++q) {  // insertion into the sorted top list, larger values first
        if (q < per_group && v > top[q]) {
          const float tmp = top[q];
          top[q] = v;
          v = tmp;
        }
      }
    }
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < kMaxPerGroup; ++q)
      if (q < per_group) sum += top[q];
    gkey = cuda::float_key(sum);
    if (gkey == 0) gkey = 1;  // a -inf/NaN group stays a candidate, below every real one
  }
  __syncwarp();  // buf is reused by the next token
  unsigned kept = 0;
  for (int r = 0; r < p.group_topk; ++r) {
    const unsigned mx = __reduce_max_sync(kFullMask, gkey);
    const unsigned win = __reduce_min_sync(kFullMask, (gkey == mx && gkey != 0) ? unsigned(lane) : 32u);
    if (win < 32u) kept |= 1u << win;
    if (unsigned(lane) == win) gkey = 0;
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int g = (lane * J + j) / p.group_size;
    if (g >= 32 || !((kept >> g) & 1u)) key[j] = 0;
  }
}

// ---- forward -----------------------------------------------------------------------------------------------------

template <typename T, int J>
__global__ void __launch_bounds__(kWarps * kWarp) router_forward_kernel(RouterParams p) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int group_buf = p.E + p.E / 32 + 1;
  float* buf = smem + warp * group_buf;                       // [kWarps][group_buf] (groups only)
  float* red_score = smem + kWarps * group_buf;              // [kWarps][E] (aux only)
  int* red_count = reinterpret_cast<int*>(red_score + kWarps * p.E);  // [kWarps][E]
  float* red_z = reinterpret_cast<float*>(red_count + kWarps * p.E);  // [kWarps]

  if (blockIdx.x == 0 && threadIdx.x == 0 && p.ticket != nullptr) *p.ticket = 0;  // for router_finalize_kernel
  const int n_tok = cuda::load_token_count(p.num_tokens, p.t_max);
  const T* logits = static_cast<const T*>(p.logits);

  float acc_score[J];
  int acc_count[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    acc_score[j] = 0.0f;
    acc_count[j] = 0;
  }
  float acc_z = 0.0f;

  for (int i = 0; i < kTokensPerWarp; ++i) {
    const long long t = (long long)blockIdx.x * kTokensPerBlock + i * kWarps + warp;
    if (t >= n_tok) break;  // warp-uniform
    float x[J];
    load_logits<T, J>(logits + t * p.E, p.E, lane, p.vec_load, x);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = lane * J + j;
      if (e < p.E && !isfinite(x[j])) {
        cuda::record_bad_logit(p.status, unsigned(t * p.E + e), x[j]);
        x[j] = -INFINITY;
      }
    }

    // s: what the weights are taken from; sel: what experts are selected by.
    float s[J], sel[J], soft[J];
    float lse = 0.0f;
    const bool need_soft = p.score == Score::SoftmaxPre || p.zloss || (p.aux && p.score == Score::SoftmaxPost);
    if (need_soft) lse = softmax_row<J>(x, soft);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = lane * J + j;
      if (p.score == Score::SoftmaxPre) {
        s[j] = soft[j];
        sel[j] = s[j];
      } else if (p.score == Score::SoftmaxPost) {
        s[j] = x[j];
        sel[j] = x[j];
      } else {
        s[j] = e < p.E ? activate(p.score, x[j]) : 0.0f;
        sel[j] = s[j] + ((p.bias != nullptr && e < p.E) ? p.bias[e] : 0.0f);
      }
    }
    unsigned key[J];
#pragma unroll
    for (int j = 0; j < J; ++j) key[j] = (lane * J + j < p.E) ? cuda::float_key(sel[j]) : 0u;
    if (p.num_groups > 1) limit_groups<J>(p, sel, key, buf, lane);

    int my_idx = -1;
    float my_w = 0.0f;
    for (int r = 0; r < p.K; ++r) {
      int bj;
      const unsigned win = argmax_round<J>(key, lane, &bj);
      const float w = __shfl_sync(kFullMask, pick<J>(s, bj), int(win / J) & (kWarp - 1));
      if (lane == r) {
        my_idx = win < unsigned(p.E) ? int(win) : -1;
        my_w = w;
      }
    }
    // Weights of the selected experts, lane k holding slot k.
    float w = my_w;
    if (p.score == Score::SoftmaxPost) {
      const float m = __shfl_sync(kFullMask, my_w, 0);  // the first pick has the largest logit
      const float ex = lane < p.K ? expf(my_w - m) : 0.0f;
      w = ex / cuda::warp_sum(ex);
    } else if (p.score != Score::SoftmaxPre && p.K > 1) {
      const float sum = cuda::warp_sum(lane < p.K ? my_w : 0.0f);
      w = my_w / (sum + kEps);
    }
    if (lane < p.K) {
      p.topk_idx[t * p.K + lane] = my_idx;
      p.topk_probs[t * p.K + lane] = p.scale * w;
    }

    if (p.aux) {
      float a[J];
      if (p.score == Score::SoftmaxPre || p.score == Score::SoftmaxPost) {
#pragma unroll
        for (int j = 0; j < J; ++j) a[j] = soft[j];
      } else {
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < J; ++j) sum += s[j];  // s = 0 for experts >= E
        sum = cuda::warp_sum(sum);
#pragma unroll
        for (int j = 0; j < J; ++j) a[j] = s[j] / (sum + kEps);
      }
      // Without groups and bias the routing selection is the top-K of a monotone function of the aux scores:
      // reuse it (key == 0 marks the picked experts). Otherwise select again on the aux scores.
      const bool reuse = p.num_groups <= 1 && p.bias == nullptr;
      if (!reuse) {
#pragma unroll
        for (int j = 0; j < J; ++j) key[j] = (lane * J + j < p.E) ? cuda::float_key(a[j]) : 0u;
        for (int r = 0; r < p.K; ++r) {
          int bj;
          (void)argmax_round<J>(key, lane, &bj);
        }
      }
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (lane * J + j < p.E) {
          acc_score[j] += a[j];
          acc_count[j] += key[j] == 0 ? 1 : 0;
        }
      }
    }
    if (p.zloss) acc_z += lse * lse;
  }

  if (!p.aux && !p.zloss) return;
  // Block partials: warps added in order 0..kWarps-1 (deterministic).
  if (p.aux) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = lane * J + j;
      if (e < p.E) {
        red_score[warp * p.E + e] = acc_score[j];
        red_count[warp * p.E + e] = acc_count[j];
      }
    }
  }
  if (lane == 0) red_z[warp] = acc_z;
  __syncthreads();
  if (p.aux) {
    for (int e = threadIdx.x; e < p.E; e += blockDim.x) {
      float sc = 0.0f;
      int cnt = 0;
      for (int w = 0; w < kWarps; ++w) {
        sc += red_score[w * p.E + e];
        cnt += red_count[w * p.E + e];
      }
      p.partial_score[(long long)blockIdx.x * p.E + e] = sc;
      p.partial_count[(long long)blockIdx.x * p.E + e] = cnt;
    }
  }
  if (threadIdx.x == 0) {
    float z = 0.0f;
    for (int w = 0; w < kWarps; ++w) z += red_z[w];
    p.partial_z[blockIdx.x] = z;
  }
}

// Adds the per-block partials in a fixed order; the last block to finish computes the losses.
__global__ void __launch_bounds__(kFinalizeWarps * kWarp) router_finalize_kernel(RouterParams p) {
  __shared__ float s_score[kFinalizeWarps][kWarp];
  __shared__ int s_count[kFinalizeWarps][kWarp];
  __shared__ bool is_last;
  __shared__ double s_red[kFinalizeWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int e = blockIdx.x * kWarp + lane;
  const int n_tok = cuda::load_token_count(p.num_tokens, p.t_max);
  const int used_blocks = (n_tok + kTokensPerBlock - 1) / kTokensPerBlock;

  if (p.aux) {
    float sc = 0.0f;
    int cnt = 0;
    if (e < p.E) {
      for (int b = warp; b < used_blocks; b += kFinalizeWarps) {
        sc += __ldcg(p.partial_score + (long long)b * p.E + e);
        cnt += __ldcg(p.partial_count + (long long)b * p.E + e);
      }
    }
    s_score[warp][lane] = sc;
    s_count[warp][lane] = cnt;
    __syncthreads();
    if (warp == 0 && e < p.E) {
      float total = 0.0f;
      int count = 0;
      for (int w = 0; w < kFinalizeWarps; ++w) {
        total += s_score[w][lane];
        count += s_count[w][lane];
      }
      p.score_sum[e] = total;
      p.aux_tpe[e] = count;
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(p.ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();

  // The last block: aux = factor * sum_e score_sum[e] * tpe[e]; z = coeff * sum_b partial_z[b] / T.
  double part = 0.0;
  if (p.aux)
    for (int i = threadIdx.x; i < p.E; i += blockDim.x)
      part += double(__ldcg(p.score_sum + i)) * double(__ldcg(p.aux_tpe + i));
  part += __shfl_xor_sync(kFullMask, part, 16);
  part += __shfl_xor_sync(kFullMask, part, 8);
  part += __shfl_xor_sync(kFullMask, part, 4);
  part += __shfl_xor_sync(kFullMask, part, 2);
  part += __shfl_xor_sync(kFullMask, part, 1);
  if (lane == 0) s_red[warp] = part;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0.0;
    for (int w = 0; w < kFinalizeWarps; ++w) sum += s_red[w];
    const long long t_total = p.total_tokens != nullptr ? (long long)*p.total_tokens : (long long)n_tok;
    double aux = 0.0;
    if (p.aux && t_total > 0)
      aux = double(p.E) * double(p.aux_coeff) / (double(p.K) * double(t_total) * double(t_total)) * sum;
    double z = 0.0;
    if (p.zloss && n_tok > 0) {
      double zs = 0.0;
      for (int b = 0; b < used_blocks; ++b) zs += double(__ldcg(p.partial_z + b));
      z = double(p.z_coeff) * zs / double(n_tok);
    }
    if (p.losses != nullptr) {
      p.losses[0] = float(aux);
      p.losses[1] = float(z);
    }
    *p.ticket = 0;
  }
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
