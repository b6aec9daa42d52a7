// moerail/reference/quant.h — CPU reference of FP8 e4m3 quantization (formats and scale rules: moerail/quant.h).
//
// Plain C++ bit arithmetic, no CUDA headers. Every step is one fp32 operation in a fixed order — amax, the scale,
// 1 / scale, x * (1 / scale), the rounding to e4m3 — the same operations the GPU kernels perform, so the GPU's
// codes and scales
// must equal these bit for bit (tests/quant). The single-value conversions round exactly as CUDA's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) (cvt.rn.satfinite.e4m3x2.f32) does, except that every NaN
// becomes 0x7f whatever its sign (the GPU kernels canonicalize likewise).
#pragma once

#include <cstdint>

#include "moerail/quant.h"
#include "moerail/tensor.h"

namespace moerail::ref {

// ---- single values --------------------------------------------------------------------------------------------

// float -> e4m3 code: round to nearest, ties to even; |x| beyond 448 (inf included) saturates to ±448 (0x7e /
// 0xfe); NaN -> 0x7f; values that round to zero keep their sign (0x00 / 0x80).
std::uint8_t float_to_e4m3(float x);
// e4m3 code -> float, exact; 0x7f and 0xff -> NaN (bits 0x7fffffff, CUDA's canonical NaN).
float e4m3_to_float(std::uint8_t code);
// float -> e5m2 code (OCP E5M2: bias 15, 2 mantissa bits, subnormals m * 2^-16; the backward's format of the
// per-tensor "hybrid" recipe, moerail/recipe.h): round to nearest, ties to even; |x| beyond 57344 (inf included)
// saturates to ±57344 (0x7b / 0xfb), as cvt.rn.satfinite.e5m2x2.f32 does; NaN -> 0x7f; values that round to zero
// keep their sign.
std::uint8_t float_to_e5m2(float x);
// e5m2 code -> float, exact; 0x7c / 0xfc -> ±inf, 0x7d-0x7f and 0xfd-0xff -> NaN (bits 0x7fffffff).
float e5m2_to_float(std::uint8_t code);
// E8M0 code -> 2^(code - 127) as float (code 0 is 2^-127, a float subnormal); 0xff -> NaN (bits 0x7fffffff).
float e8m0_to_float(std::uint8_t code);

// ---- scale rules (fp32; the GPU evaluates the same expressions) -----------------------------------------------

// Block1x128: s = amax / 448.0f; s >= FLT_MIN ? s : 1 (zero blocks, and blocks whose amax / 448 is subnormal or
// underflows, get 1: 1 / s stays finite).
float block_scale_from_amax(float amax);
// Per-tensor current scaling (the fp8-tensor recipes): s = amax / fp8_max (448 for e4m3, 57344 for e5m2) over the
// whole tensor, with block_scale_from_amax's guard (s >= FLT_MIN ? s : 1).
float tensor_scale_from_amax(float amax, float fp8_max);
// Mx1x32: the E8M0 code of the smallest power of two >= amax / 448.0f (the quotient rounded to fp32 first);
// 0 for amax = 0 (2^-127), 0xff (NaN) for amax = inf. amax is >= 0 (a max of |x| that skipped NaNs).
std::uint8_t mx_scale_from_amax(float amax);

// ---- tensors --------------------------------------------------------------------------------------------------
//
// All views are host views. rows = x.size(0) may be 0. H % 128 == 0 is required for Block1x128 and H % 32 == 0
// for Mx1x32 (any H for PerTensor). amax skips NaN elements (fmax); a NaN element quantizes to 0x7f.

// x: [rows, H] bf16 or f32, read. q: [rows, H] fp8_e4m3, written.
// scale: PerTensor [1] f32, read (finite and > 0, else Error); Block1x128 [rows, H/128] f32, written;
//        Mx1x32 [rows, H/32] kE8M0ScaleDType (E8M0 codes), written.
void quantize_fp8(Fp8Scaling scaling, const TensorView& x, const TensorView& q, const TensorView& scale);

// q: [rows, H] fp8_e4m3, read. scale: as for quantize_fp8 (PerTensor [1] f32: any value), read.
// out: [rows, H] bf16 or f32, written: round(float(q) * scale) in fp32, then once to out's dtype.
void dequantize_fp8(Fp8Scaling scaling, const TensorView& q, const TensorView& scale, const TensorView& out);

// ---- weights (128x128 blocks; contract in moerail/quant.h, QuantizeWeightsArgs) ------------------------------------

// args.w [L, N, K] bf16 or f32, read; q, q_scales written; qt, qt_scales written when qt is defined (the exact
// transpose of q and q_scales). K % 128 == 0; with qt also N % 128 == 0. Host views. Errors name the argument and
// write nothing.
void quantize_weights_fp8(const QuantizeWeightsArgs& args);

// ---- segment-transposed 1x128 copies (contract in moerail/quant.h, QuantizeTransposedArgs) ------------------------

// args.x [rows, C] bf16 or f32 (or e4m3 with x_scales), counts [L] i32 or i64, read; qt, qt_scales written (the
// blocks only); q, q_scales (bf16 x only) written for the segment rows. C % 128 is not required for the plain form
// (the GPU op needs C % 64 == 0); it is with x_scales or q. Host views. Errors name the argument and write nothing.
void quantize_fp8_transposed(const QuantizeTransposedArgs& args);

// ---- per-tensor scales per expert (contract in moerail/quant.h, QuantizeExpertsArgs) -------------------------------

// args.x [rows, C] bf16 or f32, counts [L] i32 or i64, read; scales [L] f32 written; q (optional) written for the
// segment rows. Host views. Errors name the argument and write nothing.
void quantize_fp8_experts(const QuantizeExpertsArgs& args);

}  // namespace moerail::ref
