// src/router/router_packed.cuh — the router forward's packed-key fast path (router.cu's forward_plan() picks it).
//
// Cases: top-k only (no aux loss, no z-loss), sigmoid-type score, E = 256 (J = 8 experts per lane), K <= 8, with or
// without an expert bias and groups. Results are the bits of router_forward_kernel (router_kernels.cuh), whose
// structure it keeps (one warp per token, lane l holding experts [8l, 8l + 8), the next row prefetched); what
// differs is how the top-k is found (and the sigmoid's reciprocal): ~433 warp instructions per deepseek-v3 token
// instead of ~875 (SASS of both with the deepseek-v3 parameters as constants, nvcc 13.0):
//
//  - Packed keys. Each expert's order-preserving uint32 key of its selection score becomes
//    pk = ((key - lo) << 8) | (255 - e) for keys in the window (lo, lo + 2^24 - 1] below the token's best kept key
//    M (2^24 - 1 keys, two binades: at least the floats in [M/4, M] for M > 0), and 255 - e for keys at or below
//    lo and for the experts of groups not kept.
//    Within the window pk orders exactly as the reference (key descending, then expert ascending), ties included,
//    and pk is unique in the warp: one __reduce_max_sync gives the winner and its expert (no ballot, no shuffles),
//    and a lane's list needs no payload. Each lane sorts its 8 pk once (19 compare-exchanges), then K rounds of a
//    warp max on the list heads, the winner popping its head (vs. a J-way arg-max tree with slot and weight payload
//    and a slot clear in each of the K rounds).
//  - Exactness. If the K-th pick lies in the window, so do all picks, in exact order, and every other kept expert
//    is exactly below them (a lower pk in the window, or a key at or below lo). Otherwise (a pick more than two
//    binades below M, or a NaN selection score) the warp redoes the token with the exact rounds of the generic
//    kernel (topk_rounds) on the exact keys: the same bits either way.
//  - Weights. The lane's weight scores go to shared memory; lane k reads its pick's, and the normalizing sum is
//    added in selection order after 8 broadcasts, as the generic kernel adds it.
//  - Sigmoid. 1 / (1 + exp(-x)) without the per-element slow-path branch of the IEEE reciprocal: for |x| < 87,
//    1 <= 1 + exp(-x) < 2^126, where the compiler's rcp.rn.f32 is MUFU.RCP plus one Newton step
//    (rcp_rn_normal, the same instructions). A lane with any |x| >= 87 or non-finite logit takes the generic code
//    (bad-logit report, the division as written).
//  - Groups (num_groups <= 8, so a group spans G >= 4 lanes): group g is kept iff fewer than group_topk groups
//    beat it (higher key, or equal key and lower index) — the set keep_groups()'s rounds keep. Lane q of a group
//    compares it with groups q and q + G (three shuffles: the group keys of its first lanes), two ballots count
//    the wins per group. 16 and 32 groups use keep_groups().
#pragma once

#include "router/router_kernels.cuh"

namespace moerail::router_detail {

constexpr int kPackedE = 256;   // experts (J = 8 per lane; pk keeps 8 bits of expert index)
constexpr int kPackedJ = kPackedE / kWarp;
constexpr int kPackedMaxK = 8;  // K <= 8: 8 rounds, fully unrolled
// 64 registers (4 blocks/SM, the one-wave case of kWarps/kTokensPerWarp), checked spill-free with -Xptxas -v.
constexpr int kPackedMinBlocks = 4;
// Below this |x| the sigmoid's reciprocal takes rcp_rn_normal: 1 + exp(87) = 6.1e37 < 2^126 = 8.5e37.
constexpr float kPackedSigmoidRange = 87.0f;

// 1 / d rounded to nearest, for 1 <= d < 2^126: the instructions of the compiler's rcp.rn.f32 in that range
// (exponent check passed), without its check and slow-path call. e = d * r - 1 is 0 or at least 2^-48 in
// magnitude, so the negation the compiler does with FADD.FTZ is exact here too.
__device__ __forceinline__ float rcp_rn_normal(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float e = __fmaf_rn(d, r, -1.0f);
  return __fmaf_rn(r, -e, r);
}

// Descending compare-exchange of two packed keys.
__device__ __forceinline__ void cx_desc(unsigned& a, unsigned& b) {
  const unsigned hi = max(a, b);
  b = min(a, b);
  a = hi;
}

// Batcher's odd-even merge sort of 8 (19 compare-exchanges, depth 6), descending.
__device__ __forceinline__ void sort8_desc(unsigned (&k)[8]) {
  cx_desc(k[0], k[1]); cx_desc(k[2], k[3]); cx_desc(k[4], k[5]); cx_desc(k[6], k[7]);
  cx_desc(k[0], k[2]); cx_desc(k[1], k[3]); cx_desc(k[4], k[6]); cx_desc(k[5], k[7]);
  cx_desc(k[1], k[2]); cx_desc(k[5], k[6]);
  cx_desc(k[0], k[4]); cx_desc(k[1], k[5]); cx_desc(k[2], k[6]); cx_desc(k[3], k[7]);
  cx_desc(k[2], k[4]); cx_desc(k[3], k[5]);
  cx_desc(k[1], k[2]); cx_desc(k[3], k[4]); cx_desc(k[5], k[6]);
}

// Index in the per-warp weight buffer of expert e. Lane l stores its 8 scores as two float4 at l*8 and l*8 + 4,
// swapped for l & 4 so that each quarter-warp's 16-byte stores cover the 32 banks once.
__device__ __forceinline__ int packed_w_index(int e) { return e ^ ((e >> 3) & 4); }

// Whether the lane's group is among the group_topk best (lane group path, E = 256: G = 32 / num_groups lanes per
// group). Group scores as limit_groups_lanes(), where the group's first lane bids: the lanes of a group end the
// merges with the same sum unless a selection score is NaN (a NaN bias), so the first lane's key is the group's.
template <int P>
__device__ __forceinline__ bool packed_group_kept(const RouterParams& p, const float (&sel)[kPackedJ], int lane) {
  float top[P];
  lane_top<kPackedJ, P>(sel, top);
  const int shift = p.group_lanes_log2;
  for (int offset = 1; offset < (1 << shift); offset <<= 1) merge_partner<P>(top, offset);  // warp-uniform trips
  float sum = 0.0f;  // top[0] + top[1] + ..., as limit_groups_lanes()
#pragma unroll
  for (int q = 0; q < P; ++q)
    if (q < p.per_group) sum += top[q];
  unsigned gkey = cuda::float_key(sum);
  if (gkey == 0) gkey = 1;  // a -inf/NaN group stays a candidate, below every real one
  const int g = lane >> shift;
  if (p.num_groups <= 8) {
    const int q = lane & ((1 << shift) - 1);
    const unsigned members = ((1u << (1 << shift)) - 1u) << (g << shift);  // G <= 16 lanes here
    const unsigned own = __shfl_sync(kFullMask, gkey, g << shift);
    int beaten_by = 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int h = q + (i << shift);  // i = 0, 1 cover h < 2G >= num_groups
      const unsigned kh = __shfl_sync(kFullMask, gkey, (h << shift) & (kWarp - 1));
      const bool beats = h < p.num_groups && (kh > own || (kh == own && h < g));
      beaten_by += __popc(__ballot_sync(kFullMask, beats) & members);
    }
    return beaten_by < p.group_topk;
  }
  const unsigned bid = (lane & ((1 << shift) - 1)) == 0 ? gkey : 0u;  // the group's first lane bids
  return (keep_groups(bid, p.group_topk, lane, shift) >> g) & 1u;
}

__device__ __forceinline__ bool packed_kept(const RouterParams& p, const float (&sel)[kPackedJ], int lane) {
  if (p.num_groups <= 1) return true;
  if (p.per_group <= 1) return packed_group_kept<1>(p, sel, lane);
  if (p.per_group <= 2) return packed_group_kept<2>(p, sel, lane);
  if (p.per_group <= 4) return packed_group_kept<4>(p, sel, lane);
  return packed_group_kept<kMaxPerGroup>(p, sel, lane);
}

template <typename T>
__global__ void __launch_bounds__(kWarps * kWarp, kPackedMinBlocks) router_forward_packed_kernel(RouterParams p) {
  constexpr int J = kPackedJ;
  __shared__ float4 w_buf[kWarps][kPackedE / 4];  // the token's weight scores s, packed_w_index() order
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int n_tok = cuda::load_token_count(p.num_tokens, p.t_max);
  const T* logits = static_cast<const T*>(p.logits);
  float* wbuf = reinterpret_cast<float*>(w_buf[warp]);

  float bias[J];  // held across the warp's tokens; 0 without a bias (s + 0 = s: s is never -0 or NaN)
  load_bias<J>(p.bias, lane, J, p.bias_vec, bias);

  long long t = (long long)blockIdx.x * kTokensPerBlock + warp;  // token i of the warp: t + i * kWarps
  RawRow<T, J> row;
  if (t < n_tok) load_row<T, J>(logits + t * kPackedE, lane, J, p.vec_load, row);
  for (int i = 0; i < kTokensPerWarp; ++i, t += kWarps) {
    if (t >= n_tok) break;  // warp-uniform
    float x[J];
#pragma unroll
    for (int j = 0; j < J; ++j) x[j] = cuda::to_float(row.v[j]);
    if (i + 1 < kTokensPerWarp && t + kWarps < n_tok)
      load_row<T, J>(logits + (t + kWarps) * kPackedE, lane, J, p.vec_load, row);

    // s: the weight scores; sel = s + bias: what experts are selected by.
    float s[J];
    bool fast = p.score == Score::Sigmoid;  // warp-uniform
    if (fast) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        s[j] = rcp_rn_normal(1.0f + expf(-x[j]));
        fast &= fabsf(x[j]) < kPackedSigmoidRange;  // false for NaN and +-inf as well
      }
    }
    if (!fast) {  // rare per lane for sigmoid (|x| >= 87, NaN/Inf); always for sqrtsoftplus: the generic code
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (!isfinite(x[j])) {
          cuda::record_bad_logit(p.status, unsigned(t * kPackedE + lane * J + j), x[j]);
          x[j] = -INFINITY;
        }
        s[j] = activate(p.score, x[j]);
      }
    }
    float sel[J];
#pragma unroll
    for (int j = 0; j < J; ++j) sel[j] = s[j] + bias[j];

    __syncwarp();  // the previous token's reads of wbuf are done
    const int half = (lane >> 2) & 1;
    w_buf[warp][lane * 2 + half] = make_float4(s[0], s[1], s[2], s[3]);
    w_buf[warp][lane * 2 + (half ^ 1)] = make_float4(s[4], s[5], s[6], s[7]);

    const bool kept = packed_kept(p, sel, lane);

    // Exact keys (cuda::float_key without its "+ 0.0f": sel is never -0, as s >= +0 and s + bias is -0 only if
    // both are) and the best kept one, M.
    unsigned k[J], best = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const unsigned u = __float_as_uint(sel[j]);
      k[j] = u ^ (unsigned(int(u) >> 31) | 0x80000000u);
      best = max(best, k[j]);
    }
    const unsigned top_key = __reduce_max_sync(kFullMask, kept ? best : 0u);
    // Packed keys pk = ((max(key, lo) - lo) << 8) | (255 - e): the window (lo, lo + 2^24 - 1] below M exactly,
    // keys at or below lo and the experts of groups not kept (lo = 2^32 - 1) as 0 << 8.
    const unsigned lo = kept ? max(top_key, 0xffffffu) - 0xffffffu : 0xffffffffu;
    const unsigned low = 255u - unsigned(lane * J) - (lo << 8);  // (x - lo) << 8 + 255 - e = (x << 8) + low - j
#pragma unroll
    for (int j = 0; j < J; ++j) k[j] = (max(k[j], lo) << 8) + low - unsigned(j);
    sort8_desc(k);

    // K rounds (always 8: the trips are compile-time; for K < 8 the extra ones are unused). Lane r keeps m_r.
    unsigned mine = 0;
#pragma unroll
    for (int r = 0; r < kPackedMaxK; ++r) {
      const unsigned m = __reduce_max_sync(kFullMask, k[0]);
      if (lane == r) mine = m;
      if (r + 1 < kPackedMaxK) {
        const bool win = k[0] == m;  // one lane: pk is unique
        // After round r the lane may win kPackedMaxK - r - 2 more times before the last round reads its head.
#pragma unroll
        for (int q = 0; q + 1 < kPackedMaxK - r; ++q) k[q] = win ? k[q + 1] : k[q];
      }
    }
    // Exact when the K-th pick lies in the window (header comment); else the exact rounds.
    const bool outside = lane == p.K - 1 && mine < 0x100u;

    int my_idx = ~int(mine) & 0xff;  // lanes < K: 255 - (m & 0xff)
    float my_w = 0.0f, w_sum = 0.0f;
    __syncwarp();  // wbuf is written
    if (!__any_sync(kFullMask, outside)) {
      my_w = wbuf[packed_w_index(my_idx)];
#pragma unroll
      for (int r = 0; r < kPackedMaxK; ++r) {
        const float w = __shfl_sync(kFullMask, my_w, r);
        if (r < p.K) w_sum += w;  // selection order, from 0, as topk_rounds()
      }
    } else {  // rare: the exact rounds of the generic kernel on the exact keys
      float sv[J];
#pragma unroll
      for (int j = 0; j < J; ++j) sv[j] = wbuf[packed_w_index(lane * J + j)];
      unsigned key[J];
#pragma unroll
      for (int j = 0; j < J; ++j) key[j] = kept ? cuda::float_key(sv[j] + bias[j]) : 0u;
      const TopK top = topk_rounds<J>(key, sv, p.K, lane);
      my_idx = top.idx;
      my_w = top.w;
      w_sum = top.w_sum;
    }
    // Weights of the selected experts, lane k holding slot k (sigmoid-type: normalized when K > 1).
    const float w = p.K > 1 ? my_w / (w_sum + kEps) : my_w;
    if (lane < p.K) {
      p.topk_idx[t * p.K + lane] = my_idx;
      p.topk_probs[t * p.K + lane] = p.scale * w;
    }
  }
}

}  // namespace moerail::router_detail
