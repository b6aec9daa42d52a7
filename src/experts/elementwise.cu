// src/experts/elementwise.cu — activation forward/backward, FC2 bias, bias gradients (see elementwise.h).
//
// One warp per row (rows are grid-strided: the grid is sized from the SM count, the row count is read on the
// device). Each lane handles 8 consecutive output features per step with 16-byte loads and stores; GLU layouts
// whose gate/linear columns are not 8-contiguous (interleave block g not a multiple of 8) take a scalar path.
// Math in fp32; each stored value is rounded once to bf16.
#include "experts/elementwise.h"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/device_utils.cuh"
#include "experts/activation_math.cuh"
#include "moerail/error.h"

namespace moerail::experts {
namespace {

using bf16 = __nv_bfloat16;
using cuda::kFullMask;
using cuda::kWarp;
constexpr int kVec = 8;  // bf16 per 16-byte vector
constexpr int kThreads = 256;
using Vec8 = cuda::Vec<bf16, 16>;
using act_math::act_bwd;
using act_math::act_fwd;
using act_math::columns;

constexpr bool glu(Activation a) { return is_glu(a); }

// The expert whose segment holds row r: the largest e in [0, L) with offsets[e] <= r (empty segments before it
// share its start, and the largest index is the non-empty one since offsets[e + 1] > r).
__device__ __forceinline__ int expert_of(const std::int64_t* offsets, int L, std::int64_t r) {
  int lo = 0, hi = L - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ Vec8 ld8(const bf16* p) { return cuda::load_vec(reinterpret_cast<const Vec8*>(p)); }
__device__ __forceinline__ void st8(bf16* p, const Vec8& v) { cuda::store_vec(reinterpret_cast<Vec8*>(p), v); }

__device__ __forceinline__ bool vector_path(const ActShape& s) {
  return s.layout == GluLayout::Concatenated || s.g % kVec == 0;
}

// Interleaved GLU halves whose pair blocks (2g columns) tile a warp's 256 columns: g a power of two in [8, 128].
// Then lane l's 8 columns and those of lane l ^ (g / 8) are a gate block and its linear block, so the warp walks
// the h1 row contiguously (one 16-byte vector per lane) and the pairs meet by shuffles.
__device__ __forceinline__ bool lane_pairs(const ActShape& s) {
  return s.layout == GluLayout::Interleaved && s.g >= kVec && s.g <= 128 && (s.g & (s.g - 1)) == 0;
}

// The gradients of 8 features from their gate values g, linear values l and d_act d (the per-element math of
// every path below): og, ol = d_h1 of the gate and linear columns; dp += <act(g, l), d>.
template <Activation A>
__device__ __forceinline__ void grads8(const Vec8& g, const Vec8& l, const Vec8& d, float prob, const ActShape& s,
                                       Vec8& og, Vec8& ol, float& dp) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float a = __bfloat162float(g.v[i]), b = __bfloat162float(l.v[i]), dd = __bfloat162float(d.v[i]);
    dp += act_fwd<A>(a, b, s) * dd;
    float da, db;
    act_bwd<A>(a, b, prob * dd, s, da, db);
    og.v[i] = __float2bfloat16_rn(da);
    ol.v[i] = __float2bfloat16_rn(db);
  }
}

__device__ __forceinline__ Vec8 shfl_xor8(const Vec8& v, int mask) {
  Vec8 out;
  const auto* w = reinterpret_cast<const unsigned*>(v.v);
  auto* o = reinterpret_cast<unsigned*>(out.v);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = __shfl_xor_sync(kFullMask, w[i], mask);
  return out;
}

// ---- activation forward ----------------------------------------------------------------------------------------

template <Activation A>
__global__ void __launch_bounds__(kThreads) activation_forward_kernel(ActForwardParams p) {
  const ActShape& s = p.shape;
  const int lane = threadIdx.x % kWarp;
  const std::int64_t warp = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const std::int64_t warps = std::int64_t(gridDim.x) * blockDim.x / kWarp;
  const std::int64_t total = p.offsets[p.L];
  bf16* h1_all = static_cast<bf16*>(p.h1);
  bf16* act_all = static_cast<bf16*>(p.act);
  const bool vec = !glu(A) || vector_path(s);

  for (std::int64_t r = warp; r < total; r += warps) {
    bf16* h1 = h1_all + r * s.F1;
    bf16* out = act_all + r * s.F;
    const float prob = p.probs ? p.probs[r] : 1.0f;
    const bf16* b1 = p.b1 ? static_cast<const bf16*>(p.b1[expert_of(p.offsets, p.L, r)]) : nullptr;

    if (vec) {
      for (int j = lane * kVec; j < s.F; j += kWarp * kVec) {
        int cg, cl;
        columns<A>(s, j, cg, cl);
        Vec8 gv = ld8(h1 + cg), lv = gv, ov;
        if constexpr (glu(A)) lv = ld8(h1 + cl);
        float a[kVec], b[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          a[i] = __bfloat162float(gv.v[i]);
          b[i] = __bfloat162float(lv.v[i]);
        }
        if (b1) {
          const Vec8 bg = ld8(b1 + cg);
          Vec8 bl = bg;
          if constexpr (glu(A)) bl = ld8(b1 + cl);
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            gv.v[i] = __float2bfloat16_rn(a[i] + __bfloat162float(bg.v[i]));
            lv.v[i] = __float2bfloat16_rn(b[i] + __bfloat162float(bl.v[i]));
            a[i] = __bfloat162float(gv.v[i]);  // the saved h1 and the activation see the same rounded value
            b[i] = __bfloat162float(lv.v[i]);
          }
          st8(h1 + cg, gv);
          if constexpr (glu(A)) st8(h1 + cl, lv);
        }
#pragma unroll
        for (int i = 0; i < kVec; ++i) ov.v[i] = __float2bfloat16_rn(prob * act_fwd<A>(a[i], b[i], s));
        st8(out + j, ov);
      }
    } else {
      for (int j = lane; j < s.F; j += kWarp) {
        int cg, cl;
        columns<A>(s, j, cg, cl);
        float a = __bfloat162float(h1[cg]), b = __bfloat162float(h1[cl]);
        if (b1) {
          const bf16 ga = __float2bfloat16_rn(a + __bfloat162float(b1[cg]));
          const bf16 gb = __float2bfloat16_rn(b + __bfloat162float(b1[cl]));
          h1[cg] = ga;
          h1[cl] = gb;
          a = __bfloat162float(ga);
          b = __bfloat162float(gb);
        }
        out[j] = __float2bfloat16_rn(prob * act_fwd<A>(a, b, s));
      }
    }
  }
}

// ---- activation backward ---------------------------------------------------------------------------------------

template <Activation A>
__global__ void __launch_bounds__(kThreads) activation_backward_kernel(ActBackwardParams p) {
  const ActShape& s = p.shape;
  const int lane = threadIdx.x % kWarp;
  const std::int64_t warp = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const std::int64_t warps = std::int64_t(gridDim.x) * blockDim.x / kWarp;
  const std::int64_t total = p.offsets[p.L];
  const bool vec = !glu(A) || vector_path(s);

  for (std::int64_t r = warp; r < total; r += warps) {
    const bf16* h1 = static_cast<const bf16*>(p.h1) + r * s.F1;
    const bf16* d_act = static_cast<const bf16*>(p.d_act) + r * s.F;
    bf16* d_h1 = static_cast<bf16*>(p.d_h1) + r * s.F1;
    const float prob = p.probs ? p.probs[r] : 1.0f;
    float dp = 0.0f;  // <act(h1), d_act>: the a W2^T part of d_probs

    if (glu(A) && lane_pairs(s)) {
      // The row of h1 contiguously: a gate lane computes its 8 features and hands the linear gradients to its
      // partner lane (the same per-element math as below, so the same bits; d_probs sums in another order).
      const int partner = s.g / kVec;
      for (int base = 0; base < s.F1; base += kWarp * kVec) {
        const int c = base + lane * kVec;
        const bool active = c < s.F1;  // F1 is a multiple of 2g: a pair is wholly inside or outside
        const bool gate = c % (2 * s.g) < s.g;
        const Vec8 own = active ? ld8(h1 + c) : Vec8{};
        const Vec8 other = shfl_xor8(own, partner);
        Vec8 og{}, ol{};
        if (active && gate) grads8<A>(own, other, ld8(d_act + c / (2 * s.g) * s.g + c % s.g), prob, s, og, ol, dp);
        const Vec8 lin_grad = shfl_xor8(ol, partner);
        if (active) st8(d_h1 + c, gate ? og : lin_grad);
      }
    } else if (vec) {
      for (int j = lane * kVec; j < s.F; j += kWarp * kVec) {
        int cg, cl;
        columns<A>(s, j, cg, cl);
        const Vec8 gv = ld8(h1 + cg), dv = ld8(d_act + j);
        Vec8 lv = gv, og, ol;
        if constexpr (glu(A)) lv = ld8(h1 + cl);
        grads8<A>(gv, lv, dv, prob, s, og, ol, dp);
        st8(d_h1 + cg, og);
        if constexpr (glu(A)) st8(d_h1 + cl, ol);
      }
    } else {
      for (int j = lane; j < s.F; j += kWarp) {
        int cg, cl;
        columns<A>(s, j, cg, cl);
        const float a = __bfloat162float(h1[cg]), b = __bfloat162float(h1[cl]);
        const float d = __bfloat162float(d_act[j]);
        dp += act_fwd<A>(a, b, s) * d;
        float da, db;
        act_bwd<A>(a, b, prob * d, s, da, db);
        d_h1[cg] = __float2bfloat16_rn(da);
        if constexpr (glu(A)) d_h1[cl] = __float2bfloat16_rn(db);
      }
    }

    if (p.d_probs) {
      if (p.probs && p.b2) {  // + <b2[e], dy[r]>
        const bf16* b2 = static_cast<const bf16*>(p.b2[expert_of(p.offsets, p.L, r)]);
        const bf16* dy = static_cast<const bf16*>(p.dy) + r * p.H;
        for (int h = lane * kVec; h < p.H; h += kWarp * kVec) {
          const Vec8 bv = ld8(b2 + h), yv = ld8(dy + h);
#pragma unroll
          for (int i = 0; i < kVec; ++i) dp += __bfloat162float(bv.v[i]) * __bfloat162float(yv.v[i]);
        }
      }
      dp = cuda::warp_sum(dp);
      if (lane == 0) p.d_probs[r] = p.probs ? dp : 0.0f;
    }
  }
}

// ---- d_probs from the fused activation backward's partials -------------------------------------------------------

__global__ void __launch_bounds__(kThreads) dprobs_from_partials_kernel(DprobsFromPartialsParams p) {
  const std::int64_t total = p.offsets[p.L];
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t r = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < total; r += stride) {
    float dp = 0.0f;
    for (int t = 0; p.partial && t < p.n_tiles; ++t) dp += p.partial[r * p.n_tiles + t];
    p.d_probs[r] = dp;
  }
}

// ---- FC2 bias --------------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) row_bias_kernel(RowBiasParams p) {
  const int lane = threadIdx.x % kWarp;
  const std::int64_t warp = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const std::int64_t warps = std::int64_t(gridDim.x) * blockDim.x / kWarp;
  const std::int64_t total = p.offsets[p.L];
  for (std::int64_t r = warp; r < total; r += warps) {
    bf16* y = static_cast<bf16*>(p.y) + r * p.C;
    const bf16* b = static_cast<const bf16*>(p.b[expert_of(p.offsets, p.L, r)]);
    const float scale = p.probs ? p.probs[r] : 1.0f;
    for (int c = lane * kVec; c < p.C; c += kWarp * kVec) {
      Vec8 yv = ld8(y + c);
      const Vec8 bv = ld8(b + c);
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        yv.v[i] = __float2bfloat16_rn(__bfloat162float(yv.v[i]) + scale * __bfloat162float(bv.v[i]));
      st8(y + c, yv);
    }
  }
}

// ---- bias gradients --------------------------------------------------------------------------------------------

constexpr int kBiasCols = 64;  // columns per block: 32 lanes x 2
constexpr int kBiasRowLanes = 16;

// grid (ceil(C / 64), L), block (32, 16): lane x owns 2 columns, lane y every 16th row of the segment (of each
// region's segment in turn); the 16 partial sums are added in y order.
__global__ void __launch_bounds__(kWarp * kBiasRowLanes) bias_grad_kernel(BiasGradParams p) {
  __shared__ float part[kBiasRowLanes][kBiasCols];
  const int e = blockIdx.y;
  const int c = blockIdx.x * kBiasCols + threadIdx.x * 2;
  float s0 = 0.0f, s1 = 0.0f;
  for (int chunk = 0; chunk < p.chunks && c < p.C; ++chunk) {
    const std::int64_t* offsets = p.offsets + std::int64_t(chunk) * (p.L + 1);
    const std::int64_t start = offsets[e], end = offsets[e + 1];
    for (std::int64_t r = start + threadIdx.y; r < end; r += kBiasRowLanes) {
      const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(p.g) + r * p.C + c);
      const float w = p.probs ? p.probs[r] : 1.0f;
      s0 += w * __low2float(v);
      s1 += w * __high2float(v);
    }
  }
  part[threadIdx.y][threadIdx.x * 2] = s0;
  part[threadIdx.y][threadIdx.x * 2 + 1] = s1;
  __syncthreads();
  if (threadIdx.y == 0 && c < p.C) {
    float t0 = 0.0f, t1 = 0.0f;
    for (int y = 0; y < kBiasRowLanes; ++y) {
      t0 += part[y][threadIdx.x * 2];
      t1 += part[y][threadIdx.x * 2 + 1];
    }
    if (p.f32) {
      float2* db = reinterpret_cast<float2*>(static_cast<float*>(p.db[e]) + c);
      const float2 old = p.accumulate ? *db : make_float2(0.0f, 0.0f);
      *db = make_float2(old.x + t0, old.y + t1);
      return;
    }
    __nv_bfloat162* db = reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.db[e]) + c);
    const __nv_bfloat162 sum = __floats2bfloat162_rn(t0, t1);
    *db = p.accumulate ? __hadd2(*db, sum) : sum;  // __hadd2: bf16 add, rounded to nearest even
  }
}

// ---- launch helpers --------------------------------------------------------------------------------------------

// Warp-per-row grid-stride kernels: one wave of the blocks that can be resident at once (the occupancy calculator,
// per kernel: their register counts differ, 40-64), never more than the rows need. A fixed 8 blocks per SM left
// the 48-64-register kernels two waves, the second one partial.
template <typename Kernel>
unsigned row_grid(Kernel kernel, std::int64_t max_rows) {
  int per_sm = 0;
  MOERAIL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
  const std::int64_t warps_per_block = kThreads / kWarp;
  const std::int64_t need = std::max<std::int64_t>(1, (max_rows + warps_per_block - 1) / warps_per_block);
  return unsigned(std::min<std::int64_t>(need, std::int64_t(cuda::sm_count()) * std::max(per_sm, 1)));
}

template <typename F>
void dispatch_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::SwiGLU: f.template operator()<Activation::SwiGLU>(); return;
    case Activation::GeGLU: f.template operator()<Activation::GeGLU>(); return;
    case Activation::QuickGeGLU: f.template operator()<Activation::QuickGeGLU>(); return;
    case Activation::ReLU2: f.template operator()<Activation::ReLU2>(); return;
    case Activation::GELU: f.template operator()<Activation::GELU>(); return;
  }
  fail_with(ErrorCode::Internal, "experts activation", "unknown activation ", int(a));
}

}  // namespace

void launch_activation_forward(const ActForwardParams& p, std::int64_t max_rows, cudaStream_t stream) {
  dispatch_activation(p.shape.kind, [&]<Activation A>() {
    activation_forward_kernel<A><<<row_grid(activation_forward_kernel<A>, max_rows), kThreads, 0, stream>>>(p);
  });
  MOERAIL_CUDA_CHECK_LAUNCH();
}

void launch_activation_backward(const ActBackwardParams& p, std::int64_t max_rows, cudaStream_t stream) {
  dispatch_activation(p.shape.kind, [&]<Activation A>() {
    activation_backward_kernel<A><<<row_grid(activation_backward_kernel<A>, max_rows), kThreads, 0, stream>>>(p);
  });
  MOERAIL_CUDA_CHECK_LAUNCH();
}

void launch_dprobs_from_partials(const DprobsFromPartialsParams& p, std::int64_t max_rows, cudaStream_t stream) {
  const std::int64_t blocks = std::max<std::int64_t>(1, (max_rows + kThreads - 1) / kThreads);
  dprobs_from_partials_kernel<<<unsigned(std::min<std::int64_t>(blocks, 4 * std::int64_t(cuda::sm_count()))), kThreads,
                                0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

void launch_row_bias(const RowBiasParams& p, std::int64_t max_rows, cudaStream_t stream) {
  row_bias_kernel<<<row_grid(row_bias_kernel, max_rows), kThreads, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

void launch_bias_grad(const BiasGradParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned((p.C + kBiasCols - 1) / kBiasCols), unsigned(p.L));
  bias_grad_kernel<<<grid, dim3(kWarp, kBiasRowLanes), 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

}  // namespace moerail::experts
