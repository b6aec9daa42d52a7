// moerail/quant.h — FP8 (OCP E4M3FN) quantization: the formats, and in CUDA builds the GPU kernels.
//
// Data is e4m3 (1 sign, 4 exponent, 3 mantissa bits, bias 7): finite values up to ±448, subnormals down to 2^-9,
// no infinities, one NaN per sign (0x7f, 0xff). Every recipe keeps one scale per group of elements and the meaning
// of a scale is the same everywhere:
//
//   x ≈ q · scale      quantize   q = e4m3(x · (1 / scale))   (one fp32 reciprocal per scale group, then an fp32
//                                                           product per element; round to nearest even,
//                                                           saturating to ±448; NaN gives 0x7f, ±0 and underflow
//                                                           keep the sign)
//                      dequantize y = round(float(q) · scale)   (fp32 product, rounded once to the output dtype)
//
//   Fp8Scaling::PerTensor   one fp32 scale [1] chosen by the caller (e.g. amax / 448 of this or an earlier step).
//   Fp8Scaling::Block1x128  DeepSeek-V3: one fp32 scale per row per 128 columns, [rows, H/128]:
//                           scale = amax / 448.0f (fp32 division), amax = max |x| over the block (NaN ignored);
//                           a block of zeros, or one so small that amax / 448 is below FLT_MIN, gets scale 1
//                           (its q are ±0, dequantized to ±0 exactly).
//   Fp8Scaling::Mx1x32      MXFP8: one E8M0 byte per row per 32 columns, [rows, H/32], scale = 2^(code - 127):
//                           the smallest power of two >= amax / 448.0f (the fp32 quotient rounded up to a power of
//                           two, as NVIDIA's MXFP8 recipe does; the OCP MX rule 2^(floor(log2 amax) - 8) would
//                           saturate the largest elements instead). A zero block gets code 0 (2^-127): its q are
//                           ±0. A block holding ±inf gets code 0xff (NaN): it dequantizes to NaN.
//
// A block whose amax is infinite (Block1x128) gets scale inf: its finite elements quantize to ±0 and inf to NaN;
// inputs are expected to be finite. The exact fp32 expressions are in moerail/reference/quant.h
// (block_scale_from_amax, mx_scale_from_amax); the GPU computes the same ones, so scales and codes match the CPU
// reference bit for bit.
//
// E8M0 scale bytes travel in views of dtype kE8M0ScaleDType (DType::F8E8M0, one byte per element).
#pragma once

#include <cstdint>
#include <string_view>

#include "moerail/dtype.h"
#include "moerail/tensor.h"

namespace moerail {

inline constexpr float kE4M3Max = 448.0f;           // largest finite e4m3 value (code 0x7e)
inline constexpr float kE5M2Max = 57344.0f;         // largest finite e5m2 value (code 0x7b)
// The largest finite value of an FP8 dtype (fp8_e4m3: 448, fp8_e5m2: 57344): the divisor of amax in its scales.
constexpr float fp8_max(DType t) { return t == DType::F8E5M2 ? kE5M2Max : kE4M3Max; }
inline constexpr std::uint8_t kE4M3NaN = 0x7f;      // the NaN code quantization writes
inline constexpr std::int64_t kBlockScaleCols = 128;  // columns per scale of Fp8Scaling::Block1x128
inline constexpr std::int64_t kMxScaleCols = 32;      // columns per scale of Fp8Scaling::Mx1x32
inline constexpr std::uint8_t kE8M0NaN = 0xff;      // the E8M0 NaN code
// Dtype of E8M0 scale views ([rows, H/32], one byte each).
inline constexpr DType kE8M0ScaleDType = DType::F8E8M0;

enum class Fp8Scaling : std::uint8_t {
  PerTensor,   // scale [1] f32, given by the caller
  Block1x128,  // scale [rows, H/128] f32, amax / 448
  Mx1x32,      // scale [rows, H/32] E8M0 bytes, power of two >= amax / 448
};

constexpr std::string_view fp8_scaling_name(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::PerTensor: return "per-tensor";
    case Fp8Scaling::Block1x128: return "1x128 blockwise";
    case Fp8Scaling::Mx1x32: return "MXFP8 1x32";
  }
  return "?";
}

// Columns covered by one scale (0 for PerTensor: the whole tensor).
constexpr std::int64_t fp8_scale_block_cols(Fp8Scaling s) {
  return s == Fp8Scaling::Block1x128 ? kBlockScaleCols : s == Fp8Scaling::Mx1x32 ? kMxScaleCols : 0;
}

// Dtype of the scale tensor: f32, or kE8M0ScaleDType for MXFP8.
constexpr DType fp8_scale_dtype(Fp8Scaling s) { return s == Fp8Scaling::Mx1x32 ? kE8M0ScaleDType : DType::F32; }

// ---- weights: 128x128 blocks (DeepSeek-V3) ------------------------------------------------------------------------
//
// A weight w [L, N, K] (expert e's matrix [N, K], K contiguous, y = x w_e^T) gets one fp32 scale per 128x128 block
// of each expert's matrix: block (nb, kb) covers rows [128 nb, min(128 nb + 128, N)) and columns [128 kb, 128 kb +
// 128); scale = amax / 448.0f over the block (NaN ignored), 1 where that is below FLT_MIN (zero blocks), exactly as
// Fp8Scaling::Block1x128 per row; q = e4m3(w * (1 / scale)). When N % 128 != 0 the last block of rows is partial and
// its amax is over the rows it has. Output: the layout grouped_gemm_fp8 (moerail/experts_fp8.h) takes as b / b_scales.
//
// The transposed copy qt [L, K, N] + qt_scales [L, K/128, N/128] is what the dgrad of y = x w^T needs
// (dx [rows, K] = dy [rows, N] · w_e, with N the reduction dimension): Hopper's FP8 tensor cores read only K-major
// operands, so the B operand of that GEMM must be stored N-contiguous, and its 128x128 blocks must tile N exactly.
// A 128x128 block and its transpose hold the same elements, hence the same amax, scale and codes: the transposed
// copy IS the transpose of the codes and of the scale grid, bit for bit, qt[e, k, n] = q[e, n, k] and
// qt_scales[e, kb, nb] = q_scales[e, nb, kb] (tests check it). Quantizing it in the same pass reads w once.
//
// Requirements (else Error(InvalidArgument) naming the argument): K % 128 == 0 always (the GEMM's reduction blocks
// along K, and the scale grid [.., K/128]); with qt, also N % 128 == 0 (N is qt's reduction dimension in dgrad: the
// GEMM needs it a multiple of 128, and a partial block along a reduction dimension has no place in the 1x128 scales
// of dy). N may be any positive size without qt.
inline constexpr std::int64_t kWeightScaleBlock = 128;  // rows and columns per weight scale

//
// Per-tensor form (scaling = Fp8Scaling::PerTensor, the fp8-tensor recipe's weights): one scale per expert's matrix,
// q_scales[e] = tensor_scale_from_amax(max |w_e|, 448) (moerail/reference/quant.h), q = e4m3(w * (1 / q_scales[e]));
// q_scales and qt_scales are [L] (equal: a transposition keeps the matrix's one scale). Same requirements.
struct QuantizeWeightsArgs {
  TensorView w;          // [L, N, K] bf16 (the reference also takes f32), read
  TensorView q;          // [L, N, K] fp8_e4m3, written
  TensorView q_scales;   // [L, ceil(N/128), K/128] f32, written: w[e, n, k] ≈ q * q_scales[e, n/128, k/128]
                         // (PerTensor: [L], w[e, n, k] ≈ q * q_scales[e])
  TensorView qt;         // optional (undefined view: not written) [L, K, N] fp8_e4m3, written: qt[e, k, n] = q[e, n, k]
  TensorView qt_scales;  // with qt: [L, K/128, N/128] f32, written: qt_scales[e, kb, nb] = q_scales[e, nb, kb]
                         // (PerTensor: [L], = q_scales)
  Fp8Scaling scaling = Fp8Scaling::Block1x128;  // Block1x128 (128x128 blocks, as named above) or PerTensor
};

// ---- per-tensor current scaling, one scale per expert (Recipe::Fp8Tensor, Fp8TensorHybrid) ---------------------------
//
// For x [rows, C] in expert-major segments (counts [L], clipped as every moerail op clips them), expert e's rows are
// quantized with one scale computed from their own values:
//
//   scales[e] = tensor_scale_from_amax(amax_e, 448)   amax_e = max |x| over the segment's rows (NaN skipped; an
//                                                     empty segment gets scale 1)
//   q[r, c]   = e4m3(x[r, c] * (1 / scales[e]))      for the rows r of segment e
//
// (moerail/reference/quant.h has tensor_scale_from_amax; TransformerEngine's current scaling, per expert tensor).
// The amax is a reduction over the segment before any code can be written, so the op reads x twice (the scales,
// then the codes). Rows of q past the last segment are not written. format = fp8_e5m2 (the hybrid recipe's
// gradients): scales[e] = tensor_scale_from_amax(amax_e, 57344) and e5m2 codes (ref::float_to_e5m2), the rest alike.
struct QuantizeExpertsArgs {
  TensorView x;       // [rows, C] bf16 (the reference also takes f32), read: the segment rows
  TensorView counts;  // [L] i32 or i64, read (on the device in the GPU op)
  TensorView q;       // [rows, C] of dtype `format`, written (segment rows); absent: the scales only
  TensorView scales;  // [L] f32, written
  DType format = DType::F8E4M3;  // the codes' format: fp8_e4m3 or fp8_e5m2
};

// ---- segment-transposed 1x128 copies: the operands of an FP8 weight gradient ----------------------------------------
//
// The weight gradient of an expert FC y = x W_e^T is dW_e = dy_e^T x_e, a GEMM whose reduction runs over the expert's
// rows. Hopper's FP8 tensor cores read only K-major operands, so both dy and x must be stored with their rows
// contiguous, and their 1x128 scales must run along the rows (DeepSeek-V3 quantizes the wgrad operands this way).
// For a bf16 x [rows, C] in expert-major segments (counts [L], clipped as every moerail op clips them: negative counts
// read as 0, segments end at row `rows`), segment e of n_e rows becomes
//
//   qt_e        [C, R_e] e4m3 at element offset C * P_e of qt         R_e = n_e rounded up to a multiple of 128
//   qt_scales_e [C, R_e / 128] f32 at offset C * P_e / 128 of qt_scales   P_e = R_0 + ... + R_{e-1}
//
// i.e. Fp8Scaling::Block1x128 applied to x_e^T with the rows n_e <= i < R_e read as zeros (codes 0): qt_e[c, i] =
// e4m3(x[o_e + i, c] * (1 / s)), s = qt_scales_e[c, i / 128] = amax / 448 over those 128 rows of column c (1 for a
// zero block). Each block is a compact row-major matrix, the form the FP8 weight-gradient GEMM
// (grouped_gemm_fp8_wgrad, moerail/experts_fp8.h) takes. qt and qt_scales are flat: C * fp8_transposed_rows(rows, L)
// codes and that / 128 scales, which hold the blocks for any counts; elements past the last block are not written.
inline constexpr std::int64_t fp8_transposed_rows(std::int64_t rows, std::int64_t L) {
  return (rows + kBlockScaleCols - 1) / kBlockScaleCols * kBlockScaleCols + kBlockScaleCols * L;
}

//
// Two more forms, each in the same single pass over x:
// - an FP8 x: x e4m3 [rows, C] with its 1x128 scales `x_scales` [rows, C/128] f32 (Fp8Scaling::Block1x128 along the
//   columns, as quantize_fp8 and the FP8 dispatch write them): the copy is that of x's FP8 value dequantized and
//   rounded once to bf16 (dequantize_fp8's bits), i.e. quantize_fp8_transposed(dequantize_fp8(x)) without the bf16
//   tensor. C % 128 == 0.
// - the row-wise quantization too (bf16 x only): `q` [rows, C] e4m3 and `q_scales` [rows, C/128] f32 receive
//   quantize_fp8(Block1x128) of the segment rows (rows o_0 .. o_L - 1 + n_{L-1}: what quantize_fp8 writes with
//   num_tokens = the clipped counts' sum; other rows are not touched). C % 128 == 0. One read of x gives the FP8
//   dgrad's operand and the weight gradient's.
//
// And the per-tensor form (tensor_scales given, [L] f32: the segments' scales, e.g. quantize_fp8_experts'): every
// element of segment e is quantized with tensor_scales[e] instead of its block's own scale, qt_e[c, i] =
// e4m3(x[o_e + i, c] * (1 / tensor_scales[e])), and every scale of qt_scales_e is tensor_scales[e] (so the weight
// gradient's blockwise GEMM scales each block by the expert's scale: the per-tensor product, promoted every 128
// rows); with q, the row-wise codes use the same scale and q_scales is absent. An e4m3 x (x_scales absent) holds
// codes of value code * tensor_scales[e]: its copy is those codes, transposed. C % 128 == 0 with q or an e4m3 x.
// From a bf16 x the per-tensor form may write e5m2 codes instead (qt, and q when given, of dtype fp8_e5m2: the
// hybrid recipe's gradients; ref::float_to_e5m2).
struct QuantizeTransposedArgs {
  TensorView x;          // [rows, C] bf16 (the reference also takes f32), or e4m3 with x_scales; read: segment rows
  TensorView counts;     // [L] i32 or i64, read (on the device in the GPU op): rows of each expert's segment
  TensorView qt;         // [C * fp8_transposed_rows(rows, L)] fp8_e4m3 (per-tensor from bf16: or fp8_e5m2), written:
                         // the blocks qt_e
  TensorView qt_scales;  // [C * fp8_transposed_rows(rows, L) / 128] f32, written: the blocks qt_scales_e
  TensorView x_scales;   // optional: [rows, C/128] f32, read: x holds e4m3 codes of value x[r, c] * x_scales[r, c/128]
  TensorView q;          // optional (bf16 x): [rows, C] of qt's dtype, written: x quantized 1x128 along its columns
  TensorView q_scales;   // with q: [rows, C/128] f32, written: their scales (absent in the per-tensor form)
  TensorView tensor_scales;  // optional: [L] f32, read: the per-tensor form (above)
};

}  // namespace moerail

#if MOERAIL_WITH_CUDA
#include <cuda_runtime_api.h>

namespace moerail {

// ---- GPU kernels (sm_90a) ---------------------------------------------------------------------------------------
//
// The row count T is read from device memory (num_tokens), clamped to [0, T_max]; rows t >= T of q, out and the
// scales are not touched, so a captured CUDA graph replays with any T. The grid is fixed from T_max = x.size(0)
// and the SM count. Both ops: allocate nothing, never synchronize the host, may be captured in a CUDA graph; the
// result is bit-identical to moerail::ref::quantize_fp8 / dequantize_fp8.
//
// Rows move in 16-byte vectors: H must be a multiple of 16 (and of 128 / 32 for the block recipes) and x, q and
// out 16-byte aligned, else Error(Unsupported); H not a multiple of 128 / 32 for the block recipes is
// Error(InvalidArgument) naming x's columns. The per-tensor scale is read on the device and not checked: it should
// be finite and > 0 (0 saturates the non-zero elements and turns zeros into NaN (0x7f): 1 / 0 = inf, 0 · inf = NaN;
// a NaN scale gives NaN codes).

struct QuantizeArgs {
  Fp8Scaling scaling = Fp8Scaling::Block1x128;
  TensorView x;           // [T_max, H] bf16, device, read (rows t < T)
  TensorView num_tokens;  // [1] i32, device, read: T
  TensorView q;           // [T_max, H] fp8_e4m3, device, written (rows t < T)
  TensorView scale;       // PerTensor: [1] f32, device, read (given by the caller)
                          // Block1x128: [T_max, H/128] f32, device, written (rows t < T)
                          // Mx1x32: [T_max, H/32] kE8M0ScaleDType, device, written (rows t < T)
};
void quantize_fp8(const QuantizeArgs& args, cudaStream_t stream);

struct DequantizeArgs {
  Fp8Scaling scaling = Fp8Scaling::Block1x128;
  TensorView q;           // [T_max, H] fp8_e4m3, device, read (rows t < T)
  TensorView scale;       // as QuantizeArgs::scale, device, read
  TensorView num_tokens;  // [1] i32, device, read: T
  TensorView out;         // [T_max, H] bf16, device, written (rows t < T)
};
void dequantize_fp8(const DequantizeArgs& args, cudaStream_t stream);

// Weights [L, N, K] bf16 -> e4m3 + 128x128 scales, and the transposed copy when qt is given (see QuantizeWeightsArgs
// above). One CTA per 128x128 block: w is read once, q, qt and both scale grids are written once. Every view on the
// current device; w, q, qt 16-byte aligned (else Error(Unsupported)). Allocates nothing, never synchronizes the
// host, may be captured in a CUDA graph (shapes are static; nothing is read from the device but w). Bit-identical
// to moerail::ref::quantize_weights_fp8.
void quantize_weights_fp8(const QuantizeWeightsArgs& args, cudaStream_t stream);

// x [rows, C] -> the segment-transposed 1x128 copies qt / qt_scales (QuantizeTransposedArgs above). Counts are read
// on the device only; the grid is fixed from rows, L, C and the SM count, so a captured graph replays with any
// counts. C % 64 == 0 (64-column tiles; 128 with x_scales or q) and x, qt, q 16-byte aligned, else
// Error(InvalidArgument) / Error(Unsupported) naming the argument; 1 <= L <= 1024; fp8_transposed_rows(rows, L) below
// 2^31. Allocates nothing, never synchronizes the host. Bit-identical to
// moerail::ref::quantize_fp8_transposed.
void quantize_fp8_transposed(const QuantizeTransposedArgs& args, cudaStream_t stream);

// x [rows, C] -> each expert segment's scale and (q given) its codes (QuantizeExpertsArgs above): a pass over the
// segment rows for the amaxes (a device-wide max per expert), a tiny pass turning them into scales, and a pass
// writing the codes. Counts are read on the device only (the grid is fixed from rows, C and the SM count). C % 8
// == 0 and x, q 16-byte aligned, else Error(InvalidArgument) / Error(Unsupported) naming the argument; 1 <= L <=
// 1024. Allocates nothing, never synchronizes the host, may be captured; deterministic (a max is exact in any
// order). Bit-identical to moerail::ref::quantize_fp8_experts.
void quantize_fp8_experts(const QuantizeExpertsArgs& args, cudaStream_t stream);

}  // namespace moerail
#endif  // MOERAIL_WITH_CUDA
