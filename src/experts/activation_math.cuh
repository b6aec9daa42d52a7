// src/experts/activation_math.cuh — the activations' scalar forward and backward formulas in fp32 (the reference's
// formulas; the sigmoid with an approximate reciprocal), shared by the activation pass (elementwise.cu), FC1's
// fused activation epilogue (glu_epilogue.cuh) and FC2's dgrad epilogue with the activation backward
// (act_bwd_epilogue.cuh).
#pragma once

#include <cuda_bf16.h>

#include "experts/elementwise.h"  // ActShape
#include "moerail/config.h"       // Activation

namespace moerail::experts::act_math {

// The reciprocal is the hardware's approximate one (MUFU.RCP, within 1 ulp): an IEEE division is a dozen
// instructions, and FC1's fused epilogue is bound by its instruction count (docs/experts.md). Outputs are rounded
// to bf16, 8 bits of mantissa, afterwards.
__device__ __forceinline__ float rcp_approx(float y) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
}
// e^x as 2^(x log2 e) on the hardware's approximate exp2 (MUFU.EX2), flushing subnormal results to zero: in the
// sigmoid 1 + e^-x they round away anyway, and without the flush each call pays a range test and two multiplies.
__device__ __forceinline__ float exp_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.44269504088896341f));
  return r;
}
__device__ __forceinline__ float sigmoidf_(float x) { return rcp_approx(1.0f + exp_approx(-x)); }
__device__ __forceinline__ float qgelu(float x, float alpha) { return x * sigmoidf_(alpha * x); }
__device__ __forceinline__ float qgelu_grad(float x, float alpha) {
  const float s = sigmoidf_(alpha * x);
  return s + alpha * x * s * (1.0f - s);
}
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x)));
}
__device__ __forceinline__ float gelu_grad(float x) {
  const float t = tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
  const float dinner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
}

// The low and high bf16 of a pair as floats, exactly (a bf16 is the high half of its float): one integer operation
// each, where __high2float spends two.
__device__ __forceinline__ float lo_float(__nv_bfloat162 v) {
  return __uint_as_float(*reinterpret_cast<const unsigned*>(&v) << 16);
}
__device__ __forceinline__ float hi_float(__nv_bfloat162 v) {
  return __uint_as_float(*reinterpret_cast<const unsigned*>(&v) & 0xffff0000u);
}

// Columns of the gate and linear inputs of output feature j (the reference's glu_columns).
template <Activation A>
__device__ __forceinline__ void columns(const ActShape& s, int j, int& gate, int& lin) {
  if constexpr (!is_glu(A)) {
    gate = j;
    lin = j;
  } else if (s.layout == GluLayout::Concatenated) {
    gate = j;
    lin = s.F + j;
  } else {
    gate = 2 * s.g * (j / s.g) + j % s.g;
    lin = gate + s.g;
  }
}

// Forward of one feature: gate input a, linear input b (unused for non-GLU kinds).
template <Activation A>
__device__ __forceinline__ float act_fwd(float a, float b, const ActShape& s) {
  if constexpr (A == Activation::SwiGLU) return qgelu(a, 1.0f) * b;
  if constexpr (A == Activation::GeGLU) return gelu(a) * b;
  if constexpr (A == Activation::QuickGeGLU)
    return qgelu(fminf(a, s.limit), s.alpha) * (fminf(fmaxf(b, -s.limit), s.limit) + s.offset);
  if constexpr (A == Activation::ReLU2) {
    const float r = a > 0.0f ? a : 0.0f;
    return r * r;
  }
  if constexpr (A == Activation::GELU) return gelu(a);
  return 0.0f;
}

// Backward of one feature: d_a (gradient of the activation output) -> gradients of a and b.
template <Activation A>
__device__ __forceinline__ void act_bwd(float a, float b, float d, const ActShape& s, float& da, float& db) {
  db = 0.0f;
  if constexpr (A == Activation::SwiGLU) {
    da = d * qgelu_grad(a, 1.0f) * b;
    db = d * qgelu(a, 1.0f);
  } else if constexpr (A == Activation::GeGLU) {
    da = d * gelu_grad(a) * b;
    db = d * gelu(a);
  } else if constexpr (A == Activation::QuickGeGLU) {
    // Clamps pass the gradient inside the limits, bounds included, and stop it outside (as the reference).
    const float gate = fminf(a, s.limit);
    const float lin = fminf(fmaxf(b, -s.limit), s.limit) + s.offset;
    da = a <= s.limit ? d * qgelu_grad(gate, s.alpha) * lin : 0.0f;
    db = (b >= -s.limit && b <= s.limit) ? d * qgelu(gate, s.alpha) : 0.0f;
  } else if constexpr (A == Activation::ReLU2) {
    da = a > 0.0f ? d * 2.0f * a : 0.0f;
  } else {
    da = d * gelu_grad(a);
  }
}

}  // namespace moerail::experts::act_math
