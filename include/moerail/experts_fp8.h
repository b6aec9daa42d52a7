// moerail/experts_fp8.h — FP8 (e4m3) grouped GEMM with DeepSeek-V3 blockwise scaling (or, as an option, per-tensor
// scaling with fast accumulation: "Per-tensor scaling" below) on Hopper (sm_90a): the
// expert GEMMs of the FP8 training path, forward (FC1 and FC2), dgrad (grouped_gemm_fp8_dgrad below: the same GEMM
// with dy and the transposed weight copy) and wgrad (grouped_gemm_fp8_wgrad below: transposed activation copies),
// with per-expert row counts read on the device.
//
// For each local expert e with segment rows r in [o_e, o_e + counts[e]) (o_e = counts[0] + ... + counts[e-1], the
// same expert-major layout the bf16 GroupedMlp takes: segments contiguous from row 0, in expert order):
//
//   d[r, n] = bf16( sum_kb  sa[r, kb] * sb[e, n/128, kb] * sum_{k in block kb} float(a[r, k]) * float(b[e, n, k]) )
//
// i.e. D = dequant(A) dequant(B_e)^T with A's scales per 1x128 block of a row and B's per 128x128 block (x ≈ q * s,
// the meaning of a scale everywhere in moerail, see moerail/quant.h). Accumulation is CUTLASS's blockwise-scaled
// one: the tensor cores accumulate each 128-wide K block into fp32 registers, which are scaled by sa * sb and added
// ("promoted") into a separate fp32 accumulator; the sum is rounded once to bf16.
//
// Scale layouts. CUTLASS 4.2's SM90 grouped blockwise mainloop ignores the per-group scale layouts it is given and
// derives each group's from its (M_g, N, K) as a compact tensor. With the default (M-major) configuration that is
// [K/128][M_g] per group (column-major, the group's own row count as leading dimension), which the concatenated
// [rows, K/128] scales of the dispatched rows are not, and would need regrouping on every call. moerail instantiates
// K-major scale layouts instead, whose per-group compact form is exactly a slice of the tensors below, so the scales
// are taken as the quantizer and the dispatch produce them, with no transposition:
//   a_scales  [rows, K/128] f32 row-major: group e reads rows [o_e, o_e + counts[e])
//   b_scales  [L, ceil(N/128), K/128] f32 row-major: group e reads slice e
//
// Per-tensor scaling (Fp8GroupedGemmArgs::scaling = Fp8GemmScaling::PerTensor): one scale for all of a (or one for
// each expert's segment) and one for each expert's b (or one for all of b), read from device memory:
//
//   d[r, n] = bf16( alpha_e * sum_k float(a[r, k]) * float(b[e, n, k]) ),   alpha_e = a_scales[e or 0] * b_scales[e or 0]
//
//   a_scales  [1] or [L] f32: a[r, k] ≈ a_code * a_scales[0], or a_scales[e] for the rows of segment e
//             (quantize_fp8_experts, moerail/quant.h)
//   b_scales  [1] or [L] f32: b[e, n, k] ≈ b_code * b_scales[0] (one for all experts) or b_scales[e] (per expert)
//
// alpha_e is formed on the device by the setup kernel (an fp32 product) on every call, so a captured graph replays
// with whatever scales the device holds then (e.g. this step's amax / 448). Accumulation is CUTLASS's FP8 "fast
// accumulation" by default: the tensor cores accumulate the whole K reduction in their fp32 accumulator with no
// promotion into a separate one (Hopper's fp8 wgmma keeps fewer accumulator mantissa bits than IEEE fp32 between
// promotions, the reason the blockwise mainloop promotes every 128-wide K block), and alpha_e scales the sum once in
// the epilogue; with Fp8GroupedGemmArgs::promote the partial sums are added into a separate fp32 accumulator every
// 128 elements of K instead (TransformerEngine's split accumulator), alpha_e still applied once. K must be a multiple
// of 16 here (16-byte TMA rows), not 128; everything else is as for blockwise scaling. Its kernels
// (KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum, and KernelPtrArrayTmaWarpSpecializedCooperative for
// promote, e4m3 or e5m2 a; 128x128x128, cluster 1x2): tile Auto and Cooperative128x128 run them, Pingpong64x128 is
// Error(Unsupported). With promote, a may hold OCP E5M2 codes instead (dtype fp8_e5m2: the gradients of the hybrid
// per-tensor recipe, moerail/recipe.h; b stays e4m3); an e5m2 a without PerTensor and promote is Error(Unsupported).
//
// Counts are int32 or int64 [L] in device memory and are read on the DEVICE only: negative counts read as 0,
// segments are clipped to the rows of a (a wrong count never makes the kernel touch memory outside the views).
// Experts with 0 rows are empty groups: nothing is computed or written for them. Rows of d past the last segment
// are not written.
//
// Requirements (checked; Error(InvalidArgument) names the argument): K a multiple of 128 (blockwise; 16 per-tensor);
// N a multiple of 8 (16-byte rows of d); 1 <= L <= 1024; rows, N, K < 2^31; a, b, d 16-byte aligned; scales f32 (4-byte aligned); every view on
// the current device, which must be sm_90 (else Error(Unsupported)). The fp8 codes are OCP E4M3FN (moerail/quant.h).
//
// grouped_gemm_fp8:  allocates: no · host sync: no · graph-capturable: yes (captured once, a graph replays with
// whatever the device counts say) · stream-ordered on `stream`. Each call rewrites the small per-group argument
// arrays and CUTLASS's TMA-descriptor scratch in `workspace`, so calls sharing a workspace must be ordered (same
// stream or events); concurrent calls need their own workspaces. The host builds the kernel parameters on every call
// (a few microseconds of host time, no device traffic).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "moerail/config.h"
#include "moerail/experts.h"
#include "moerail/memory.h"
#include "moerail/recipe.h"
#include "moerail/tensor.h"

namespace moerail {

// How the FP8 grouped GEMM's operands are scaled (Fp8GroupedGemmArgs::scaling; see "Per-tensor scaling" above).
enum class Fp8GemmScaling {
  Blockwise,  // 1x128 scales of a, 128x128 scales of b (DeepSeek-V3), promoted fp32 accumulation (the default)
  PerTensor,  // one scale of a and one of b (or one per expert each), alpha in the epilogue; fast or promoted
              // fp32 accumulation (Fp8GroupedGemmArgs::promote)
};

// Kernel configuration of the FP8 grouped GEMM, normally automatic (rule and reasons in src/experts/fp8/gemm_fp8.h).
enum class Fp8GemmTile {
  Auto,
  Cooperative128x128,  // 128x128x128 tile, both consumer warpgroups on one tile, CTA pairs along N (cluster 1x2)
  Pingpong64x128,      // 64x128x128 tile per consumer warpgroup, alternating tiles (epilogue overlaps), cluster 1x2
};

struct Fp8GroupedGemmArgs {
  TensorView a;          // [rows, K] fp8_e4m3 (PerTensor with promote: or fp8_e5m2), read: the segment rows of all
                         // experts, expert-major
  TensorView a_scales;   // Blockwise: [rows, K/128] f32, read: a[r, k] ≈ a_code * a_scales[r, k/128]
                         // PerTensor: [1] or [L] f32, read on the device: a_code * a_scales[0] or a_scales[e]
  TensorView b;          // [L, N, K] fp8_e4m3, read: each expert's weight, K contiguous (W as stored: y = x W^T)
  TensorView b_scales;   // Blockwise: [L, ceil(N/128), K/128] f32, read:
                         //   b[e, n, k] ≈ b_code * b_scales[e, n/128, k/128]
                         // PerTensor: [1] or [L] f32, read on the device: b_code * b_scales[0] or b_scales[e]
  TensorView counts;     // [L] i32 or i64, device, read on the device: rows of each expert's segment
  TensorView d;          // [rows, N] bf16, written (segment rows only)
  TensorView workspace;  // device bytes >= grouped_gemm_fp8_workspace_bytes(L), any dtype: per-call scratch
  Fp8GemmTile tile = Fp8GemmTile::Auto;  // Auto chooses from rows / L, N and K
  Fp8GemmScaling scaling = Fp8GemmScaling::Blockwise;  // the meaning of a_scales and b_scales (see above)
  // PerTensor: the wgmma partial sums promoted into a separate fp32 accumulator every 128 elements of K
  // (TransformerEngine's split accumulator) instead of fast accumulation; alpha still applied once. Blockwise
  // scaling always promotes (this is not read).
  bool promote = false;
};

// Bytes of workspace grouped_gemm_fp8 needs for L experts on the current device (per-group argument arrays plus
// CUTLASS's per-SM TMA descriptors: under 1 KiB per expert and per SM). Enough for every tile.
std::size_t grouped_gemm_fp8_workspace_bytes(std::int64_t L);

// d = scaled a b_e^T per expert segment (blockwise or per-tensor, as args.scaling says), as described above, on
// `stream`.
void grouped_gemm_fp8(const Fp8GroupedGemmArgs& args, cudaStream_t stream);

// ---- dgrad ---------------------------------------------------------------------------------------------------------
//
// The data gradient of an expert FC y = x W_e^T (W [L, N, K], x [rows, K], y [rows, N]) is dx = dy W_e, a GEMM whose
// reduction dimension is N. It runs on grouped_gemm_fp8 itself, with the operands in these roles:
//
//   a = dy_q [rows, N] e4m3, a_scales = dy_scales [rows, N/128]: quantize_fp8(dy, Block1x128) (1x128 along N)
//   b = wt [L, K, N] e4m3, b_scales = wt_scales [L, K/128, N/128]: quantize_weights_fp8's transposed copy (qt) of W
//   d = dx [rows, K] bf16
//
// so that d[r, k] = sum over N-blocks of dy_scales * wt_scales * (dy_q · wt)[r, k] = dequant(dy) dequant(W_e) per
// expert. Hopper's fp8 MMA reads only K-major operands, so W itself ([N, K], K contiguous) cannot be the B operand of
// this GEMM: its N-contiguous copy wt is. Since a 128x128 block and its transpose have one amax, wt and wt_scales
// are exactly the transposes of the forward's q and q_scales (no second rounding of W). Requirements are
// grouped_gemm_fp8's with (N, K) exchanged: N % 128 == 0 (the reduction), K % 8 == 0; counts, segments, workspace,
// tiles, allocation, synchronization and graph capture exactly as for grouped_gemm_fp8. FC1 dgrad: W = W1
// [L, F1, H], dy = d_h1 [rows, F1], dx [rows, H]; FC2 dgrad: W = W2 [L, H, F], dy [rows, H], dx = d_act [rows, F].
//
// Per-tensor scaling (scaling = PerTensor): dy_scales [1] or [L] (quantize_fp8_experts) and wt_scales [1] or [L]
// (quantize_weights_fp8's per-tensor form: qt_scales = q_scales), as grouped_gemm_fp8's a_scales and b_scales; N %
// 16 == 0 then; promote as grouped_gemm_fp8's (with promote, dy may be e5m2: the hybrid recipe's gradient).
struct Fp8DgradArgs {
  TensorView dy;         // [rows, N] fp8_e4m3 (or, PerTensor with promote, fp8_e5m2), read: the quantized output
                         // gradient, expert-major segments
  TensorView dy_scales;  // [rows, N/128] f32, read: its 1x128 scales (PerTensor: [1] or [L])
  TensorView wt;         // [L, K, N] fp8_e4m3, read: the transposed weight copy (QuantizeWeightsArgs::qt)
  TensorView wt_scales;  // [L, K/128, N/128] f32, read (QuantizeWeightsArgs::qt_scales; PerTensor: [1] or [L])
  TensorView counts;     // [L] i32 or i64, device, read on the device: rows of each expert's segment
  TensorView dx;         // [rows, K] bf16, written (segment rows only)
  TensorView workspace;  // device bytes >= grouped_gemm_fp8_workspace_bytes(L)
  Fp8GemmTile tile = Fp8GemmTile::Auto;
  Fp8GemmScaling scaling = Fp8GemmScaling::Blockwise;
  bool promote = false;  // as Fp8GroupedGemmArgs::promote
};

// The grouped_gemm_fp8 arguments of a dgrad (the mapping above; no checks, no work).
inline Fp8GroupedGemmArgs fp8_dgrad_gemm_args(const Fp8DgradArgs& g) {
  Fp8GroupedGemmArgs a;
  a.a = g.dy;
  a.a_scales = g.dy_scales;
  a.b = g.wt;
  a.b_scales = g.wt_scales;
  a.counts = g.counts;
  a.d = g.dx;
  a.workspace = g.workspace;
  a.tile = g.tile;
  a.scaling = g.scaling;
  a.promote = g.promote;
  return a;
}

// dx = dequant(dy) dequant(W_e) per expert segment: grouped_gemm_fp8(fp8_dgrad_gemm_args(args), stream). Its errors
// are grouped_gemm_fp8's, prefixed with "grouped_gemm_fp8_dgrad (a = dy, a_scales = dy_scales, b = wt, b_scales =
// wt_scales, d = dx)" so the names can be mapped back.
void grouped_gemm_fp8_dgrad(const Fp8DgradArgs& args, cudaStream_t stream);

// ---- wgrad --------------------------------------------------------------------------------------------------------
//
// The weight gradient of an expert FC y = x W_e^T (W [L, N, K]) is dW_e = dy_e^T x_e, a reduction over the expert's
// rows. Hopper's fp8 MMA reads only K-major operands, so it runs on the segment-transposed 1x128 copies of dy and x
// (quantize_fp8_transposed, moerail/quant.h: per expert a [C, R_e] block, R_e = the segment's rows rounded up to 128,
// the padding rows zero, with 1x128 scales along the rows), as one grouped GEMM whose per-expert K = R_e comes from
// the device:
//
//   dw[e, n, k] = bf16( sum_b  dyt_s[e][n, b] * xt_s[e][k, b] * sum_{i in row block b} float(dyt_e[n, i]) * float(xt_e[k, i]) )
//
// = dequant(dy_e)^T dequant(x_e), fp32 accumulation promoted every 128 rows as in grouped_gemm_fp8. The blocks are
// found from counts exactly as quantize_fp8_transposed placed them (same counts, same rows). Experts with no rows get
// dw_e = 0 (a zero fill, not a GEMM). FC1: dy = d_h1 [rows, F1], x = the FC1 input [rows, H], dw = dW1 [L, F1, H];
// FC2: dy [rows, H], x = act [rows, F], dw = dW2 [L, H, F]. Requirements (checked, Error(InvalidArgument) naming the
// argument): N % 64 == 0 and K % 64 == 0 (quantize_fp8_transposed's tiles), the copies' sizes as moerail/quant.h
// gives them for (rows, L), 16-byte aligned copies and dw; allocation, synchronization, graph capture, workspace and
// device as for grouped_gemm_fp8 (cooperative 128x128x128: the blockwise kernel, or under scaling = PerTensor the
// per-tensor one with promotion, each also in an fp32-accumulating form).
struct Fp8WgradArgs {
  TensorView dyt;         // [N * fp8_transposed_rows(rows, L)] fp8_e4m3 (PerTensor: or fp8_e5m2, the hybrid
                          // recipe's gradient), read: quantize_fp8_transposed(dy).qt
  TensorView dyt_scales;  // [N * fp8_transposed_rows(rows, L) / 128] f32, read: its qt_scales
  TensorView xt;          // [K * fp8_transposed_rows(rows, L)] fp8_e4m3, read: quantize_fp8_transposed(x).qt
  TensorView xt_scales;   // [K * fp8_transposed_rows(rows, L) / 128] f32, read
  TensorView counts;      // [L] i32 or i64, device, read on the device: the counts the copies were made with
  std::int64_t rows = 0;  // rows of dy and x: exactly the x.size(0) the copies were made with (the blocks' places
                          // follow from it and the counts; only its 128-row bucket can be checked here)
  TensorView dw;          // [L, N, K] bf16, written (every expert); f32 with `accumulate`
  TensorView workspace;   // device bytes >= grouped_gemm_fp8_workspace_bytes(L)
  // false: dw (bf16) is written, experts without rows get zeros. true: dw (f32, e.g. Megatron-LM's main_grad) gets
  // the gradients added, dw = dw + the fp32 sum (one fp32 rounding, not rounded to bf16 first); experts without
  // rows are left as they are.
  bool accumulate = false;
  // PerTensor: the copies hold codes of one scale per expert (quantize_fp8_transposed's per-tensor form), and
  // dyt_scales, xt_scales are [1] or [L] f32 (each expert's scale); dw = dyt_s[e] xt_s[e] times the codes' product,
  // the partial sums promoted every 128 rows, the scale product applied once (alpha). Blockwise: as above.
  Fp8GemmScaling scaling = Fp8GemmScaling::Blockwise;
};

// dw = dequant(dy_e)^T dequant(x_e) per expert, from the segment-transposed copies, on `stream`.
void grouped_gemm_fp8_wgrad(const Fp8WgradArgs& args, cudaStream_t stream);

// ---- the FP8 expert MLP (Recipe::Fp8Blockwise, Fp8Tensor, Fp8TensorHybrid) -------------------------------------------
//
// The grouped expert MLP of moerail/experts.h with every GEMM in FP8 as DeepSeek-V3 trains (moerail/recipe.h; the
// oracle is moerail::ref::experts_forward / experts_backward with Recipe::Fp8Blockwise, which rounds to bf16 where this
// keeps bf16 tensors between the GEMMs: h1, act, d_act, d_h1):
//   forward   h1 = x W1^T with x e4m3 and its 1x128 scales (what Dispatcher::dispatch_fp8 delivers) and W1 in
//             128x128 blocks; act = p act(h1) (p = 1 under InCombine); y = act W2^T with act quantized 1x128 along F
//   backward  d_act = dy W2 with dy quantized 1x128 along H; d_h1 = act'(h1) (p d_act) and d_probs (bf16 d_h1);
//             dx = d_h1 W1 with d_h1 quantized 1x128 along F1; dW2 = dy^T act and dW1 = d_h1^T x over copies of each
//             segment quantized 1x128 along its rows (dy, act and d_h1 from their bf16 values, x from its FP8 value);
//             or, with Fp8MlpOptions::weight_grads = BF16, as GroupedMlp::backward_dw computes them over dy, act,
//             d_h1 and x dequantized to bf16 (no quantized copies)
// h1, act, y, dx and the weight gradients are bf16; probs and d_probs f32. The weights are quantized once per
// optimizer step (quantize_mlp_weights_fp8 below), not once per call: call it again after the optimizer has updated
// the bf16 weights. No biases (cfg.fc1_bias / fc2_bias: Error(Unsupported)); H and F multiples of 128; weight
// gradients grouped [L, ...]: bf16 written, or f32 accumulated (Fp8MlpBackwardArgs::accumulate_weight_grads).
// Counts, clipping, allocation (none per call), host synchronization (none) and graph capture as for GroupedMlp;
// calls on one Fp8GroupedMlp are stream-ordered.
//
// Per-tensor recipe (Fp8MlpOptions::recipe = Recipe::Fp8Tensor; oracle: the reference with Recipe::Fp8Tensor): the
// same GEMMs and points of quantization, each FP8 tensor with one scale per expert (its segment's rows, its weight
// matrix) from its own amax: x comes with x_scales [L] (quantize_fp8_experts of the bf16 rows), act, dy and d_h1 are
// quantized here the same way (quantize_fp8_experts: an amax pass, then the codes), the weights by
// quantize_mlp_weights_fp8 into an Fp8MlpWeights made with the recipe. Every GEMM is per-tensor scaled (one alpha
// per expert in the epilogue) and accumulation follows TransformerEngine's current scaling: fast accumulation in
// the forward GEMMs, the partial sums promoted every 128 elements of the reduction (the split accumulator;
// Fp8GroupedGemmArgs::promote) in the dgrads and the weight gradients, which run over the segment-transposed copies
// of the same codes (a transposition keeps a tensor's scale). The backward recomputes act's scales (one more read of
// act) rather than keep them from the forward. Recipe::Fp8TensorHybrid (oracle: the reference with that recipe): the
// same, with dy and d_h1 quantized to e5m2 (scales amax / 57344) for the dgrads and the weight gradients, whose A
// operands they are (e5m2 x e4m3 products; weights, x and act stay e4m3).

// The FP8 weights of one optimizer step: each weight's forward operand and the transposed copy its dgrad reads
// (quantize_weights_fp8's q / qt, moerail/quant.h). The scales are 128x128 blocks (Recipe::Fp8Blockwise, shapes
// below) or one per expert matrix ([L] f32 each; recipe per-tensor).
struct Fp8MlpWeights {
  TensorView w1, w1_scales;    // [L, F1, H] fp8_e4m3, [L, F1/128, H/128] f32
  TensorView w1t, w1t_scales;  // [L, H, F1] fp8_e4m3, [L, H/128, F1/128] f32
  TensorView w2, w2_scales;    // [L, H, F] fp8_e4m3, [L, H/128, F/128] f32
  TensorView w2t, w2t_scales;  // [L, F, H] fp8_e4m3, [L, F/128, H/128] f32
  Recipe recipe = Recipe::Fp8Blockwise;  // how they are scaled (set by make_fp8_mlp_weights)
};

// Device bytes of one Fp8MlpWeights for cfg and recipe (fp8-blockwise, or a per-tensor recipe; every array 256-byte
// aligned), and its views over `base` (device memory of that many bytes on `device`).
std::size_t fp8_mlp_weights_bytes(const MoeConfig& cfg, Recipe recipe = Recipe::Fp8Blockwise);
Fp8MlpWeights make_fp8_mlp_weights(const MoeConfig& cfg, void* base, int device,
                                   Recipe recipe = Recipe::Fp8Blockwise);

// q = the quantization of the grouped bf16 weights w.w1 and w.w2 as q.recipe scales them (128x128 blocks, or one
// scale per expert matrix from its amax), with their transposed copies; on `stream`, no allocation, no host sync,
// capturable.
void quantize_mlp_weights_fp8(const MoeConfig& cfg, const MlpWeights& w, const Fp8MlpWeights& q,
                              cudaStream_t stream);

struct Fp8MlpForwardArgs {
  TensorView x;          // [rows, H] fp8_e4m3, read: the segment rows (a dispatch's recv)
  TensorView x_scales;   // [rows, H/128] f32, read (the per-tensor recipes: [L] f32, each expert's scale:
                         // quantize_fp8_experts of the bf16 rows, moerail/quant.h)
  TensorView probs;      // [rows] f32, read; required when cfg.prob_mode = InActivation
  TensorView counts;     // [L] i32 or i64, device, read on the device
  Fp8MlpWeights weights;
  TensorView y;          // [rows, H] bf16, written (segment rows)
  TensorView h1;         // [rows, F1] bf16, written: saved for backward
  TensorView act;        // [rows, F] bf16, written: p act(h1), saved for backward
  TensorView workspace;  // device bytes >= Fp8GroupedMlp::forward_workspace_bytes(rows), 256-byte aligned: act in FP8
};

// Where the FP8 weight gradients' operands (the segment-transposed copies of dy, act, d_h1 and x) come from when the
// backward is split in two calls, the data gradients first and the weight gradients later (MoeLayer's order):
//   Make    each call makes what it needs (a weights-only call quantizes dy and d_h1 once more)
//   Stage   the data call (dx given, no dw1 / dw2): the passes that quantize dy and d_h1 for the dgrads also write
//           their transposed copies into the workspace, from the same read
//   Staged  the weights call (dw1 and dw2, no dx): the copies of dy and d_h1 are those a Stage call left in this
//           workspace; it must be the same workspace, untouched since, with the same rows and counts (dy and d_h1
//           are then not read). A Staged call whose workspace, rows or counts view differ from the last Stage call's
//           on this object, or with no Stage call since the last Staged one, is refused (Error(InvalidArgument))
// A call that computes both kinds of gradients makes every copy in the fused passes by itself (Make). Under
// Fp8WeightGrads::BF16 there are no copies and Stage / Staged change nothing.
enum class Fp8WgradOperands { Make, Stage, Staged };

// The data gradients when dx is given, the weight gradients when dw1 and dw2 are; a call with dw1 and dw2 but no dx
// (the delayed weight gradients, after a call for the data gradients of the same step) reads the d_h1 that call
// wrote (or, Staged, its quantized copy).
struct Fp8MlpBackwardArgs {
  TensorView x, x_scales, probs, counts;  // as given to the forward
  Fp8MlpWeights weights;
  TensorView h1, act;    // saved by the forward (h1: read with dx only)
  TensorView dy;         // [rows, H] bf16, read
  TensorView dx;         // [rows, H] bf16, written (segment rows); absent: weight gradients only
  TensorView d_probs;    // [rows] f32, written with dx (segment rows; 0 under InCombine); may be absent
  TensorView d_h1;       // [rows, F1] bf16, written with dx, else read
  TensorView dw1;        // [L, F1, H] bf16, written; absent (with dw2): no weight gradients
  TensorView dw2;        // [L, H, F] bf16, written
  // true: dw1 and dw2 are f32 (Megatron-LM's main_grad buffers) and the weight gradients are added into them in
  // fp32, experts without rows left as they are (grouped_gemm_fp8_wgrad's accumulate; under Fp8WeightGrads::BF16,
  // MlpGrads::accumulate with fp32 gradients)
  TensorView workspace;  // device bytes >= Fp8GroupedMlp::backward_workspace_bytes(rows), 256-byte aligned: the
                         // quantized operands
  Fp8WgradOperands wgrad_operands = Fp8WgradOperands::Make;
  bool accumulate_weight_grads = false;
};

struct Fp8MlpOptions {
  Fp8WeightGrads weight_grads = Fp8WeightGrads::Fp8;  // the weight gradients' GEMMs (moerail/recipe.h)
  std::int64_t rows_hint = 0;  // Fp8WeightGrads::BF16: the bf16 GEMMs' tile choice (MlpOptions::rows_hint)
  DeviceAllocator* allocator = nullptr;  // null = cudaMalloc; must outlive the Fp8GroupedMlp
  // Recipe::Fp8Blockwise, Fp8Tensor or Fp8TensorHybrid (see "Per-tensor recipe" above; the per-tensor recipes with
  // Fp8WeightGrads::Fp8 only)
  Recipe recipe = Recipe::Fp8Blockwise;
};

class Fp8GroupedMlp {
 public:
  // Setup (outside capture): validates cfg (bf16 activations, SwiGLU-type or plain activations as GroupedMlp, no
  // biases, H and F multiples of 128, L <= kMaxLocalExperts) and options.weight_grads, allocates the segment offsets
  // and the GEMMs' workspace from options.allocator; under Fp8WeightGrads::BF16 also a GroupedMlp for the weight
  // gradients (its setup, memory and checks as GroupedMlp's).
  explicit Fp8GroupedMlp(const MoeConfig& cfg, const Fp8MlpOptions& options = {});
  ~Fp8GroupedMlp();
  Fp8GroupedMlp(const Fp8GroupedMlp&) = delete;
  Fp8GroupedMlp& operator=(const Fp8GroupedMlp&) = delete;

  void forward(const Fp8MlpForwardArgs& args, cudaStream_t stream);
  void backward(const Fp8MlpBackwardArgs& args, cudaStream_t stream);

  std::size_t forward_workspace_bytes(std::int64_t rows) const;
  std::size_t backward_workspace_bytes(std::int64_t rows) const;
  std::size_t device_bytes() const;
  Recipe recipe() const;  // options.recipe

 private:
  struct Impl;
  struct BackwardPieces {  // the backward's workspace, laid out (fp8_mlp.cpp)
    TensorView dy_q, dy_s, dh1_q, dh1_s, scratch, dyt, dyt_s, actt, actt_s, dh1t, dh1t_s, xt, xt_s, act_s;
  };
  // copies: also the weight gradients' copies of dy and d_h1, from the passes that quantize them for the dgrads.
  void data_gradients(const Fp8MlpBackwardArgs& a, const BackwardPieces& b, const TensorView& d_act, bool copies,
                      cudaStream_t stream);
  // copies_made: the copies of dy and d_h1 are in the workspace already.
  void weight_gradients(const Fp8MlpBackwardArgs& a, const BackwardPieces& b, const TensorView& x_deq,
                        bool copies_made, cudaStream_t stream);
  std::unique_ptr<Impl> impl_;
};

// The kernel `tile` runs as for these sizes ("coop128x128" or "ping64x128"; Auto resolved), for logs and benchmarks.
const char* fp8_gemm_tile_name(Fp8GemmTile tile, std::int64_t rows, std::int64_t L, std::int64_t N, std::int64_t K,
                               Fp8GemmScaling scaling = Fp8GemmScaling::Blockwise);

}  // namespace moerail
