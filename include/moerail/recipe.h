// moerail/recipe.h — precision recipes of the expert MLP and the layer (docs/fp8.md, "The FP8 layer").
//   BF16           bf16 operands, fp32 accumulation (the default)
//   Fp8Blockwise   DeepSeek-V3's recipe: e4m3 GEMM operands, activations and gradients with 1x128 scales along
//                  the reduction dimension, weights with 128x128 block scales; bf16 outputs and bf16 in between
#pragma once

#include <string_view>

namespace moerail {

enum class Recipe { BF16, Fp8Blockwise };

inline std::string_view name_of(Recipe r) { return r == Recipe::BF16 ? "bf16" : "fp8-blockwise"; }

// Where an FP8 recipe's expert weight gradients run (MoeLayerOptions::fp8_weight_grads, Fp8MlpOptions):
//   Fp8    the recipe's own: FP8 GEMMs over copies of dy, act, d_h1 and x quantized 1x128 along each expert's rows
//   BF16   bf16 GEMMs (fp32 sums) over the bf16 dy, act and d_h1 and x dequantized from its FP8 value: no quantized
//          copies, and no quantization error in dW beyond the forward's and the dgrads'
enum class Fp8WeightGrads { Fp8, BF16 };

inline std::string_view name_of(Fp8WeightGrads w) { return w == Fp8WeightGrads::Fp8 ? "fp8" : "bf16"; }

}  // namespace moerail
