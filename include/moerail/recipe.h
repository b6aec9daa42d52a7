// moerail/recipe.h — precision recipes of the expert MLP and the layer (docs/fp8.md, "The FP8 layer").
//   BF16             bf16 operands, fp32 accumulation (the default)
//   Fp8Blockwise     DeepSeek-V3's recipe: e4m3 GEMM operands, activations and gradients with 1x128 scales along
//                    the reduction dimension, weights with 128x128 block scales; bf16 outputs and bf16 in between
//   Fp8Tensor        per-tensor current scaling (as TransformerEngine's Float8CurrentScaling with Format.E4M3, with
//                    moerail's scale rule: s = amax / 448 in fp32, moerail/reference/quant.h): every GEMM operand
//                    e4m3 with one scale per tensor, from that tensor's amax as it is quantized; the
//                    tensors of a grouped GEMM are each expert's (its segment of rows, its weight), as a grouped
//                    linear layer quantizes each of its GEMMs' inputs on its own
//   Fp8TensorHybrid  the same with the backward's gradients (dy, d_h1) in e5m2, amax / 57344 (Format.HYBRID)
// The per-tensor recipes are defined by the CPU reference (moerail/reference/experts.h); both run on the GPU too
// (Fp8GroupedMlp, MoeLayer).
#pragma once

#include <string_view>

namespace moerail {

enum class Recipe { BF16, Fp8Blockwise, Fp8Tensor, Fp8TensorHybrid };

inline std::string_view name_of(Recipe r) {
  switch (r) {
    case Recipe::BF16: return "bf16";
    case Recipe::Fp8Blockwise: return "fp8-blockwise";
    case Recipe::Fp8Tensor: return "fp8-tensor";
    case Recipe::Fp8TensorHybrid: return "fp8-tensor-hybrid";
  }
  return "?";
}

// Whether a recipe scales its FP8 tensors per tensor (the current-scaling recipes).
constexpr bool is_per_tensor(Recipe r) { return r == Recipe::Fp8Tensor || r == Recipe::Fp8TensorHybrid; }

// Where an FP8 recipe's expert weight gradients run (MoeLayerOptions::fp8_weight_grads, Fp8MlpOptions):
//   Fp8    the recipe's own: FP8 GEMMs over copies of dy, act, d_h1 and x quantized 1x128 along each expert's rows
//          (per-tensor recipes: the same quantized tensors as the forward's and the dgrads', transposed, whose
//          one scale a transposition keeps)
//   BF16   bf16 GEMMs (fp32 sums) over the bf16 dy, act and d_h1 and x dequantized from its FP8 value: no quantized
//          copies, and no quantization error in dW beyond the forward's and the dgrads'
enum class Fp8WeightGrads { Fp8, BF16 };

inline std::string_view name_of(Fp8WeightGrads w) { return w == Fp8WeightGrads::Fp8 ? "fp8" : "bf16"; }

}  // namespace moerail
