// moerail/reference/experts.h — CPU reference of the grouped expert MLP, forward and backward.
//
// The rows of x are grouped into contiguous segments, one per local expert: segment e has rows_per_expert[e]
// rows and starts after the previous one (row 0 for e = 0). For each row r of expert e (F1 = 2F for GLU, else F):
//   h1 = x[r] W1[e]^T (+ b1[e])                       [F1]
//   a  = act(h1)                                       [F]   (activation and GLU layout of MoeConfig)
//   y[r] = a W2[e]^T (+ b2[e])                         [H]
//   ProbMode::InActivation: y[r] *= p[r]  (so y = p * (act(..) W2^T + b2))
// Rows past the last segment are not read or written. Everything accumulates in double; each output element is
// rounded once to its view's dtype. H = cfg.hidden, F = cfg.ffn_hidden, L = rows_per_expert.size() (normally
// cfg.local_experts(), but not checked against it). QuickGeGLU's clamps pass the gradient inside the limits, bounds
// included (a <= limit, -limit <= b <= limit, as TransformerEngine), and stop it outside.
// Backward: dx, dW1, dW2, db1, db2 and (InActivation) d_probs[r] = <act(..) W2^T + b2, dy[r]>; experts with zero
// rows get zero weight gradients. Weight gradients may be computed by a separate call (delayed wgrad).
//
// All views are host views; x, y, dy, dx, weights and grads may be f64, f32, bf16 or f16, probs and d_probs f32 or
// f64. Every argument is checked (cfg.validate() included) before anything is written; a check fails with
// Error(InvalidArgument), except a NaN/Inf prob in a segment row, which fails with Error(BadRouting). Nothing is
// allocated beyond host scratch; results are deterministic (fixed row order).
//
// Recipe::Fp8Blockwise (moerail/recipe.h): the same MLP with every GEMM operand quantized to e4m3 and dequantized
// again (QDQ: q = e4m3(v / s), v' = float(q) * s in fp32) where the FP8 step quantizes it, the rest in double:
//   forward   x: 1x128 along H (as the FP8 dispatch sends it); W1, W2: 128x128 blocks; h1 rounded to bf16, act =
//             p a(h1) (InActivation; a under InCombine) rounded to bf16, then 1x128 along F; FC2's bias is added as
//             p b2 after the GEMM
//   dgrads    dy: 1x128 along H; d_act = dy W2 rounded to bf16; d_h1 = act'(h1) (p d_act) rounded to bf16, then
//             1x128 along F1; the weights as in the forward
//   wgrads    dW2 = dy^T act and dW1 = d_h1^T x with both operands QDQ'd 1x128 along the expert's rows (blocks of
//             128 rows from the segment's first row, the last one short): dy, act and d_h1 from their bf16 values,
//             x from its 1x128-along-H dequantized value rounded to bf16 (the expert side holds only the FP8 x);
//             biases from the unquantized gradients. With fp8_weight_grads = Fp8WeightGrads::BF16 the same
//             operands without the QDQ (the bf16 values themselves)
//   d_probs   <a, d_act> (+ <b2, dy>) over the FP8 dgrad's d_act
// The bf16 roundings are the GPU step's: it keeps h1, act, d_act and d_h1 in bf16 between its GEMMs, so each
// quantization starts from the same values and computes the same scales.
// H, F (and F1) must be multiples of 128. Gradients flow straight through the quantizers.
//
// Recipe::Fp8Tensor and Fp8TensorHybrid (per-tensor current scaling): the same points and bf16 roundings, each
// QDQ with one scale per tensor, s = amax / 448 (e4m3) over the tensor as it is quantized (tensor_scale_from_amax,
// moerail/reference/quant.h), where a tensor is one expert's: x, act, dy and d_h1 over the rows of the expert's
// segment, W1[e] and W2[e] whole. x is quantized from its own value on the expert side (a per-tensor scale cannot
// travel with rows from several ranks). Hybrid: dy and d_h1 in e5m2, s = amax / 57344. The FP8 weight gradients'
// operands are the forward's and the dgrads' own quantized tensors (a transposed copy keeps a tensor's one scale):
// dW2 = dyq^T actq, dW1 = d_h1q^T xq; with Fp8WeightGrads::BF16 they are the bf16 dy, act, d_h1 and x's dequantized
// value rounded to bf16, as under Fp8Blockwise. H and F must be multiples of 16 (the FP8 GEMMs' 16-byte rows).
#pragma once

#include <cstdint>
#include <span>

#include "moerail/config.h"
#include "moerail/recipe.h"
#include "moerail/tensor.h"

namespace moerail::ref {

struct ExpertWeights {
  TensorView w1;  // [L, F1, H], read
  TensorView b1;  // [L, F1], read; required iff cfg.fc1_bias
  TensorView w2;  // [L, H, F], read
  TensorView b2;  // [L, H], read; required iff cfg.fc2_bias
};

struct ExpertGrads {
  TensorView dw1;  // [L, F1, H], written
  TensorView db1;  // [L, F1], written iff cfg.fc1_bias
  TensorView dw2;  // [L, H, F], written
  TensorView db2;  // [L, H], written iff cfg.fc2_bias
  // true: added to the views' values instead, each element becoming cast(old + cast(g)) in the views' dtype (what
  // `grad += g` gives after a call that writes g); experts without rows add 0.
  bool accumulate = false;
};

struct ExpertsForwardArgs {
  TensorView x;                                // [rows, H], read
  TensorView probs;                            // [rows] f32/f64, read (InActivation only; may be absent otherwise)
  std::span<const std::int64_t> rows_per_expert;  // [L] segment lengths, sum <= rows
  ExpertWeights weights;
  TensorView y;                                // [rows, H], written (rows of the segments only)
  Recipe recipe = Recipe::BF16;
};
void experts_forward(const MoeConfig& cfg, const ExpertsForwardArgs& args);

struct ExpertsBackwardArgs {
  TensorView x, probs;                         // as given to the forward
  std::span<const std::int64_t> rows_per_expert;
  ExpertWeights weights;
  TensorView dy;                               // [rows, H], read
  TensorView dx;                               // [rows, H], written (rows of the segments only); may be absent
  TensorView d_probs;                          // [rows] f32/f64, written (segments; 0 when InCombine); may be absent
  ExpertGrads grads;                           // written (overwritten, not accumulated) unless all four views are
                                               // absent; if any is given, dw1 and dw2 are required
  // dx and d_probs absent: weight gradients only (the delayed-wgrad call); grads absent: data gradients only.
  // probs are read as in the forward (required when InActivation).
  Recipe recipe = Recipe::BF16;
  Fp8WeightGrads fp8_weight_grads = Fp8WeightGrads::Fp8;  // an FP8 recipe: the wgrads' operands (above)
};
void experts_backward(const MoeConfig& cfg, const ExpertsBackwardArgs& args);

// Activation a = act(h1) of one row: h1 [F1] -> a [F]. And its backward: d_h1 [F1] from h1 and d_a [F] (every
// element of d_h1 is written). Span sizes are checked against cfg.
void activation_forward(const MoeConfig& cfg, std::span<const double> h1, std::span<double> a);
void activation_backward(const MoeConfig& cfg, std::span<const double> h1, std::span<const double> d_a,
                         std::span<double> d_h1);

// Weight layout converters (Megatron's checkpoint-key normalization): one grouped host tensor [L, ...] (at least
// 2 dimensions) <-> L per-expert host tensors [...]. Shapes and dtypes (any dtype) must match; copies bit-exactly.
void split_grouped(const TensorView& grouped, std::span<const TensorView> per_expert);
void stack_grouped(std::span<const TensorView> per_expert, const TensorView& grouped);

}  // namespace moerail::ref
