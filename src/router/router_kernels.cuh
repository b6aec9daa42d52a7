// src/router/router_kernels.cuh — router forward kernels (include/moerail/router.h); the backward kernel, which
// shares the constants and per-token pieces below, is in router_backward_kernels.cuh.
//
// One warp per token; lane l holds the J consecutive experts [l*J, l*J + J) of the token in registers (J = E/32
// rounded up to 1, 2, 4, 8 or 16), so a bf16 row of 256 logits is one 16-byte load per lane. Slots past E hold
// -inf logits and key 0. Each warp prefetches its next token's row while it routes the current one.
//
// Top-k: K rounds of a warp arg-max on order-preserving integer keys (0 = not a candidate). Each lane reduces its
// J keys to its best (a tree in which the lower slot wins ties), carrying the weight score along;
// __reduce_max_sync finds the best key and __ballot_sync + __ffs the lowest lane holding it, so ties go to the
// lower expert index, as the reference. Two shuffles bring the winner's slot and weight; the owner clears its key.
//
// Groups (num_groups > 1): group score = the sum of the group's top per_group = K / group_topk selection scores,
// added in descending order; group_topk rounds of the same arg-max over groups (ties to the lower group) keep the
// best groups, and the keys of the other groups' experts are cleared.
//   - lane path (group_size = G * J with G a power of two): the G lanes of a group each sort their J values into a
//     top-P list in registers (P = per_group rounded up to a power of two), then log2(G) xor-shuffle steps merge
//     partner lists (bitonic: max against the reversed partner list, then a bitonic sort), so every lane of the
//     group ends with the group's sorted top list. No shared memory.
//   - shared-memory path (other shapes): the warp writes its selection scores to shared memory (skewed,
//     conflict-free) and lane g walks group g serially.
//
// Losses are reduced without float atomics, in a fixed order: each warp accumulates its tokens in registers, the
// block adds its warps in order into one partial per block, and router_finalize_kernel adds the partials in order
// (the last block to finish computes the losses; an integer ticket decides which one that is).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device_utils.cuh"
#include "core/status_device.cuh"

namespace moerail::router_detail {

using cuda::kFullMask;
using cuda::kWarp;

// ---- launch configuration: the one place (router.cu's forward_plan() and the kernels read these) --------------
//
// The forward is issue- and latency-bound, not bandwidth-bound: a deepseek-v3 token (E = 256, K = 8, 8 groups)
// is ~1k warp instructions (SASS estimate; ~540 of them the K top-k rounds) against a 512-byte bf16 row. Chosen for deepseek-v3 at 8k-16k tokens on H100/H200:
// 8 warps x 4 tokens = 32 tokens per block gives 512 blocks for 16384 tokens; at <= 64 registers per thread
// (kForwardMinBlocks) 4 blocks fit per SM, so all 512 run in one wave on 132 SMs with ~8 warps per scheduler to
// cover the reduce/shuffle chains of the top-k rounds. Fewer tokens per warp would add blocks (and loss partials,
// blocks * E * 8 bytes) without adding resident warps; more would serialize tokens within a warp.
constexpr int kWarps = 8;             // warps per block of the forward kernel
constexpr int kTokensPerWarp = 4;     // tokens each warp routes, one after the other
constexpr int kTokensPerBlock = kWarps * kTokensPerWarp;
// Blocks per SM the forward kernel is compiled for (__launch_bounds__, checked spill-free with -Xptxas -v on
// nvcc 13.0): top-k only at J <= 8 fits 64 registers (4 blocks, the one-wave case above); with losses (J aux
// accumulators more) 80 registers, 3 blocks; J = 16 (E > 256) holds twice the per-lane state: 128, 2 blocks.
template <int J, bool kLosses>
constexpr int kForwardMinBlocks = J > 8 ? 2 : (kLosses ? 3 : 4);
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
  int per_group;                  // K / group_topk (groups only)
  int group_lanes_log2;           // lane group path: log2(group_size / J); -1 = shared-memory path (or no groups)
  int group_buf;                  // floats per warp of the shared-memory group path; 0 when it is not used
  Score score;
  float scale, aux_coeff, z_coeff;
  bool aux, zloss, vec_load;
  bool bias_vec;                  // bias != null, 16-byte aligned and E == 32 * J
};

// ---- shared memory of the forward kernel ------------------------------------------------------------------------

// Floats per warp of the shared-memory group path: E selection scores at the skewed index e + e/32, plus one.
__host__ __device__ constexpr int group_buf_floats(int E) { return E + E / 32 + 1; }

// Dynamic shared memory of router_forward_kernel, offsets in 4-byte words: [kWarps][group_buf] selection scores of
// the shared-memory group path (group_buf = 0 otherwise), then [kWarps][E] aux-score and [kWarps][E] aux-count
// partials (aux loss only), then [kWarps] z partials (any loss).
struct ForwardSmem {
  int score, count, z, words;
  __host__ __device__ static ForwardSmem make(int E, int group_buf, bool aux, bool loss) {
    ForwardSmem s{};
    s.score = kWarps * group_buf;
    s.count = s.score + (aux ? kWarps * E : 0);
    s.z = s.count + (aux ? kWarps * E : 0);
    s.words = s.z + (loss ? kWarps : 0);
    return s;
  }
  __host__ __device__ std::size_t bytes() const { return std::size_t(words) * 4; }
};

// ---- per-token pieces ---------------------------------------------------------------------------------------------

// The lane's J logits of one row as stored (the forward's prefetch buffer: converted only when the row is used,
// so that the load of the next token stays in flight while the current one is routed).
template <typename T, int J>
struct alignas(16) RawRow {
  T v[J];
};

// Loads slots j < nv of the lane's experts [lane*J, lane*J + J) of `row`.
template <typename T, int J>
__device__ __forceinline__ void load_row(const T* row, int lane, int nv, bool vec_load, RawRow<T, J>& r) {
  const T* src = row + lane * J;
  if constexpr ((J * sizeof(T)) % 16 == 0) {
    if (vec_load) {  // the whole row is 16-byte aligned and E == 32 * J
      constexpr int kVecs = int(J * sizeof(T) / 16);
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
        reinterpret_cast<uint4*>(r.v)[v] = __ldg(reinterpret_cast<const uint4*>(src) + v);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < J; ++j) r.v[j] = j < nv ? src[j] : cuda::from_float<T>(0.0f);
}

// The expert bias of the lane's slots (0 without a bias or past E): one 16-byte load per 4 slots when aligned.
template <int J>
__device__ __forceinline__ void load_bias(const float* bias, int lane, int nv, bool vec, float (&b)[J]) {
  if constexpr (J % 4 == 0) {
    if (vec) {  // bias != null, 16-byte aligned, E == 32 * J
#pragma unroll
      for (int v = 0; v < J / 4; ++v) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(bias + lane * J) + v);
        b[4 * v] = f.x;
        b[4 * v + 1] = f.y;
        b[4 * v + 2] = f.z;
        b[4 * v + 3] = f.w;
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < J; ++j) b[j] = (bias != nullptr && j < nv) ? __ldg(bias + lane * J + j) : 0.0f;
}

// The sigmoid-type activation (reference: activate).
__device__ __forceinline__ float activate(Score s, float x) {
  if (s == Score::Sigmoid) return 1.0f / (1.0f + expf(-x));
  return sqrtf(x > kSoftplusThreshold ? x : log1pf(expf(x)));
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

// The best of the lane's J keys: a tree in which the lower slot wins ties. Returns the key, sets *bj to its slot
// and, when kCarry, *bs to s[*bj].
template <int J, bool kCarry>
__device__ __forceinline__ unsigned lane_best(const unsigned (&key)[J], const float (&s)[J], int* bj, float* bs) {
  unsigned k[J];
  int slot[J];
  float v[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    k[j] = key[j];
    slot[j] = j;
    if constexpr (kCarry) v[j] = s[j];
  }
#pragma unroll
  for (int stride = 1; stride < J; stride *= 2) {
#pragma unroll
    for (int i = 0; i < J; i += 2 * stride) {
      const bool right = k[i + stride] > k[i];
      k[i] = right ? k[i + stride] : k[i];
      slot[i] = right ? slot[i + stride] : slot[i];
      if constexpr (kCarry) v[i] = right ? v[i + stride] : v[i];
    }
  }
  *bj = slot[0];
  if constexpr (kCarry) *bs = v[0];
  return k[0];
}

template <int J>
__device__ __forceinline__ void clear_slot(unsigned (&key)[J], int slot, bool owner) {
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (owner && j == slot) key[j] = 0;
}

// What the K top-k rounds give: lane k < K holds pick k (the k-th largest selection score).
struct TopK {
  int idx = -1;          // the expert
  float w = 0.0f;        // its weight score s
  float w_first = 0.0f;  // warp-uniform: the first pick's weight score
  float w_sum = 0.0f;    // warp-uniform: 0 + the picks' weight scores, added in selection order
};

// K rounds of the warp arg-max on key (0 = not a candidate; the picked keys are cleared): each lane reduces its J
// keys (lower slot wins ties), __reduce_max_sync finds the best key and __ballot_sync + __ffs the lowest lane
// holding it, so ties go to the lower expert index.
template <int J>
__device__ __forceinline__ TopK topk_rounds(unsigned (&key)[J], const float (&s)[J], int K, int lane) {
  TopK out;
  for (int r = 0; r < K; ++r) {
    int bj;
    float bs;
    const unsigned bk = lane_best<J, true>(key, s, &bj, &bs);
    const unsigned mx = __reduce_max_sync(kFullMask, bk);
    const int wl = __ffs(int(__ballot_sync(kFullMask, bk == mx))) - 1;  // the lowest lane holding the max
    const int wj = __shfl_sync(kFullMask, bj, wl);
    const float w = __shfl_sync(kFullMask, bs, wl);
    clear_slot<J>(key, bj, lane == wl);
    if (mx != 0) {  // warp-uniform; 0 = no candidate left (cannot happen for a validated config)
      if (r == 0) out.w_first = w;
      out.w_sum += w;  // the selected weights in descending selection order
      if (lane == r) {
        out.idx = wl * J + wj;
        out.w = w;
      }
    }
  }
  return out;
}

// group_topk rounds of the warp arg-max over group keys gkey (0 = not a candidate); the group of lane l is
// l >> shift. Returns the bit mask of the kept groups (ties to the lower group).
__device__ __forceinline__ unsigned keep_groups(unsigned gkey, int group_topk, int lane, int shift) {
  unsigned kept = 0;
  for (int r = 0; r < group_topk; ++r) {
    const unsigned mx = __reduce_max_sync(kFullMask, gkey);
    const unsigned holders = __ballot_sync(kFullMask, gkey == mx && mx != 0);
    if (holders != 0) {  // warp-uniform
      const int wl = __ffs(int(holders)) - 1;
      kept |= 1u << (wl >> shift);
      if (lane == wl) gkey = 0;
    }
  }
  return kept;
}

// Group-limited selection, shared-memory path (any group shape): clears the keys of experts outside the
// group_topk best groups.
template <int J>
__device__ __forceinline__ void limit_groups_smem(const RouterParams& p, const float (&sel)[J], unsigned (&key)[J],
                                                  float* buf, int lane) {
  // Skewed index e + e/32 keeps lane g's walk over its group free of bank conflicts.
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = lane * J + j;
    if (e < p.E) buf[e + (e >> 5)] = sel[j];
  }
  __syncwarp();
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
        if (q < p.per_group && v > top[q]) {
          const float tmp = top[q];
          top[q] = v;
          v = tmp;
        }
      }
    }
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < kMaxPerGroup; ++q)
      if (q < p.per_group) sum += top[q];
    gkey = cuda::float_key(sum);
    if (gkey == 0) gkey = 1;  // a -inf/NaN group stays a candidate, below every real one
  }
  __syncwarp();  // buf is reused by the next token
  const unsigned kept = keep_groups(gkey, p.group_topk, lane, 0);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int g = (lane * J + j) / p.group_size;
    if (g >= 32 || !((kept >> g) & 1u)) key[j] = 0;
  }
}

// top = the lane's J selection scores' largest P, sorted descending (-inf filled). Insertion with min/max: the
// values, and so the sum of any prefix, are those of the strict '>' insertion of the shared-memory path.
template <int J, int P>
__device__ __forceinline__ void lane_top(const float (&sel)[J], float (&top)[P]) {
  top[0] = sel[0];
#pragma unroll
  for (int q = 1; q < P; ++q) top[q] = -INFINITY;
#pragma unroll
  for (int j = 1; j < J; ++j) {
    float v = sel[j];
#pragma unroll
    for (int q = 0; q < (j < P ? j : P); ++q) {  // the first min(j, P) entries are filled
      const float hi = fmaxf(top[q], v);
      v = fminf(top[q], v);
      top[q] = hi;
    }
    if (j < P) top[j] = v;
  }
}

// Merges the sorted top list of lane ^ offset into this lane's: both end with the sorted top P of the union.
// c[q] = max(top[q], partner[P-1-q]) holds the top P of the union and is bitonic; a bitonic merge sorts it.
template <int P>
__device__ __forceinline__ void merge_partner(float (&top)[P], int offset) {
  float c[P];
#pragma unroll
  for (int q = 0; q < P; ++q) c[q] = fmaxf(top[q], __shfl_xor_sync(kFullMask, top[P - 1 - q], offset));
#pragma unroll
  for (int stride = P / 2; stride > 0; stride /= 2) {
#pragma unroll
    for (int i = 0; i < P; ++i) {
      if ((i & stride) == 0) {
        const float hi = fmaxf(c[i], c[i + stride]);
        const float lo = fminf(c[i], c[i + stride]);
        c[i] = hi;
        c[i + stride] = lo;
      }
    }
  }
#pragma unroll
  for (int q = 0; q < P; ++q) top[q] = c[q];
}

// Group-limited selection, lane path (group_size = G * J, G = 2^group_lanes_log2 <= 32, P >= per_group): the G
// lanes of a group merge their top lists by xor shuffles, the group's first lane bids its sum, and the keys of the
// experts outside the group_topk best groups are cleared. Padding lanes (experts >= E) form groups >= num_groups
// of their own and never bid.
template <int J, int P>
__device__ __forceinline__ void limit_groups_lanes(const RouterParams& p, const float (&sel)[J], unsigned (&key)[J],
                                                   int lane) {
  float top[P];
  lane_top<J, P>(sel, top);
  const int shift = p.group_lanes_log2;
  for (int offset = 1; offset < (1 << shift); offset <<= 1) merge_partner<P>(top, offset);  // warp-uniform trips
  float sum = 0.0f;  // top[0] + top[1] + ..., as the shared-memory path
#pragma unroll
  for (int q = 0; q < P; ++q)
    if (q < p.per_group) sum += top[q];
  const int g = lane >> shift;
  unsigned gkey = 0;
  if ((lane & ((1 << shift) - 1)) == 0 && g < p.num_groups) {
    gkey = cuda::float_key(sum);
    if (gkey == 0) gkey = 1;  // a -inf/NaN group stays a candidate, below every real one
  }
  const unsigned kept = keep_groups(gkey, p.group_topk, lane, shift);
  if (!((kept >> g) & 1u)) {
#pragma unroll
    for (int j = 0; j < J; ++j) key[j] = 0;
  }
}

template <int J>
__device__ __forceinline__ void limit_groups(const RouterParams& p, const float (&sel)[J], unsigned (&key)[J],
                                             float* buf, int lane) {
  if (p.group_lanes_log2 < 0) limit_groups_smem<J>(p, sel, key, buf, lane);
  else if (p.per_group <= 1) limit_groups_lanes<J, 1>(p, sel, key, lane);
  else if (p.per_group <= 2) limit_groups_lanes<J, 2>(p, sel, key, lane);
  else if (p.per_group <= 4) limit_groups_lanes<J, 4>(p, sel, key, lane);
  else limit_groups_lanes<J, kMaxPerGroup>(p, sel, key, lane);
}

// ---- forward -----------------------------------------------------------------------------------------------------

// kLosses: the aux loss or the z-loss is on (p.aux / p.zloss say which); without, the kernel holds no loss state.
template <typename T, int J, bool kLosses>
__global__ void __launch_bounds__(kWarps * kWarp, kForwardMinBlocks<J, kLosses>) router_forward_kernel(RouterParams p) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const ForwardSmem lay = ForwardSmem::make(p.E, p.group_buf, p.aux, kLosses);
  float* buf = smem + warp * p.group_buf;                           // shared-memory group path only
  float* red_score = smem + lay.score;                              // [kWarps][E] (aux only)
  int* red_count = reinterpret_cast<int*>(smem + lay.count);        // [kWarps][E] (aux only)
  float* red_z = smem + lay.z;                                      // [kWarps]

  if (blockIdx.x == 0 && threadIdx.x == 0 && p.ticket != nullptr) *p.ticket = 0;  // for router_finalize_kernel
  const int n_tok = cuda::load_token_count(p.num_tokens, p.t_max);
  const T* logits = static_cast<const T*>(p.logits);
  const int nv = min(J, max(0, p.E - lane * J));  // slots of this lane that hold experts
  const bool sigmoid_type = p.score == Score::Sigmoid || p.score == Score::SqrtSoftplus;

  // Loss accumulators. Counts: 4 bits per slot (a warp routes kTokensPerWarp < 16 tokens).
  static_assert(kTokensPerWarp < 16, "aux counts are packed 4 bits per expert");
  constexpr int kAcc = kLosses ? J : 1;
  float acc_score[kAcc];
  unsigned acc_count[(kAcc + 7) / 8];
#pragma unroll
  for (int j = 0; j < kAcc; ++j) acc_score[j] = 0.0f;
#pragma unroll
  for (int j = 0; j < (kAcc + 7) / 8; ++j) acc_count[j] = 0;
  float acc_z = 0.0f;

  // The next token's row is loaded while the current one is routed, except at J = 16 where its registers would
  // spill (kForwardMinBlocks).
  constexpr bool kPrefetch = J <= 8;
  long long t = (long long)blockIdx.x * kTokensPerBlock + warp;  // token i of the warp: t + i * kWarps
  RawRow<T, J> row;
  if (kPrefetch && t < n_tok) load_row<T, J>(logits + t * p.E, lane, nv, p.vec_load, row);
  for (int i = 0; i < kTokensPerWarp; ++i, t += kWarps) {
    if (t >= n_tok) break;  // warp-uniform
    if (!kPrefetch) load_row<T, J>(logits + t * p.E, lane, nv, p.vec_load, row);
    float x[J];
#pragma unroll
    for (int j = 0; j < J; ++j) x[j] = j < nv ? cuda::to_float(row.v[j]) : -INFINITY;
    if (kPrefetch && i + 1 < kTokensPerWarp && t + kWarps < n_tok)
      load_row<T, J>(logits + (t + kWarps) * p.E, lane, nv, p.vec_load, row);
    bool bad = false;
#pragma unroll
    for (int j = 0; j < J; ++j) bad |= (j < nv) & !isfinite(x[j]);
    if (bad) {  // rare: record and treat as -inf
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (j < nv && !isfinite(x[j])) {
          cuda::record_bad_logit(p.status, unsigned(t * p.E + lane * J + j), x[j]);
          x[j] = -INFINITY;
        }
      }
    }

    // s: what the weights are taken from; sel: what experts are selected by.
    float s[J], sel[J], soft[J];
    float lse = 0.0f;
    const bool need_soft =
        p.score == Score::SoftmaxPre || (kLosses && (p.zloss || (p.aux && p.score == Score::SoftmaxPost)));
    if (need_soft) lse = softmax_row<J>(x, soft);
    // One branch per token, not per slot (the score is warp-uniform).
    if (p.score == Score::SoftmaxPre) {
#pragma unroll
      for (int j = 0; j < J; ++j) s[j] = soft[j];
    } else if (p.score == Score::SoftmaxPost) {
#pragma unroll
      for (int j = 0; j < J; ++j) s[j] = x[j];
    } else if (p.score == Score::Sigmoid) {  // experts >= E: x = -inf gives s = 0 exactly (both activations)
#pragma unroll
      for (int j = 0; j < J; ++j) s[j] = activate(Score::Sigmoid, x[j]);
    } else {
#pragma unroll
      for (int j = 0; j < J; ++j) s[j] = activate(Score::SqrtSoftplus, x[j]);
    }
    if (p.bias != nullptr) {  // sigmoid-type only
      float bias[J];  // reloaded per token (L1 hits): holding it across tokens costs 8 registers at J = 8
      load_bias<J>(p.bias, lane, nv, p.bias_vec, bias);
#pragma unroll
      for (int j = 0; j < J; ++j) sel[j] = s[j] + bias[j];
    } else {
#pragma unroll
      for (int j = 0; j < J; ++j) sel[j] = s[j];
    }
    unsigned key[J];
#pragma unroll
    for (int j = 0; j < J; ++j) key[j] = j < nv ? cuda::float_key(sel[j]) : 0u;
    if (p.num_groups > 1) limit_groups<J>(p, sel, key, buf, lane);

    const TopK top = topk_rounds<J>(key, s, p.K, lane);
    const int my_idx = top.idx;
    const float my_w = top.w, w_first = top.w_first, w_sum = top.w_sum;
    // Weights of the selected experts, lane k holding slot k.
    float w = my_w;
    if (p.score == Score::SoftmaxPost) {
      const float ex = lane < p.K ? expf(my_w - w_first) : 0.0f;  // the first pick has the largest logit
      w = ex / cuda::warp_sum(ex);
    } else if (sigmoid_type && p.K > 1) {
      w = my_w / (w_sum + kEps);
    }
    if (lane < p.K) {
      p.topk_idx[t * p.K + lane] = my_idx;
      p.topk_probs[t * p.K + lane] = p.scale * w;
    }

    if constexpr (kLosses) {
      if (p.aux) {
        // The aux loss counts the top-K of the unbiased, ungrouped scores. Without groups and bias that is the
        // routing selection (key == 0 marks the picked experts); otherwise K more rounds on the keys of s (a
        // monotone function of the aux scores; after the routing rounds, so that only one key array is live).
        if (p.num_groups > 1 || p.bias != nullptr) {
#pragma unroll
          for (int j = 0; j < J; ++j) key[j] = j < nv ? cuda::float_key(s[j]) : 0u;
          for (int r = 0; r < p.K; ++r) {
            int cj;
            float unused;
            const unsigned ck = lane_best<J, false>(key, s, &cj, &unused);
            const unsigned cmx = __reduce_max_sync(kFullMask, ck);
            const int cl = __ffs(int(__ballot_sync(kFullMask, ck == cmx))) - 1;
            clear_slot<J>(key, cj, lane == cl);
          }
        }
        float a[J];
        if (sigmoid_type) {
          float sum = 0.0f;
#pragma unroll
          for (int j = 0; j < J; ++j) sum += s[j];  // s = 0 for experts >= E
          const float inv = 1.0f / (cuda::warp_sum(sum) + kEps);
#pragma unroll
          for (int j = 0; j < J; ++j) a[j] = s[j] * inv;
        } else {
#pragma unroll
          for (int j = 0; j < J; ++j) a[j] = soft[j];
        }
#pragma unroll
        for (int j = 0; j < J; ++j) {
          if (j < nv) {
            const bool picked = key[j] == 0;
            acc_score[j] += a[j];
            acc_count[j / 8] += picked ? 1u << (4 * (j % 8)) : 0u;
          }
        }
      }
      if (p.zloss) acc_z += lse * lse;
    }
  }

  if constexpr (kLosses) {
    // Block partials: warps added in order 0..kWarps-1 (deterministic).
    if (p.aux) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (j < nv) {
          red_score[warp * p.E + lane * J + j] = acc_score[j];
          red_count[warp * p.E + lane * J + j] = int((acc_count[j / 8] >> (4 * (j % 8))) & 15u);
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

}  // namespace moerail::router_detail
