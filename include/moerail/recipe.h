// moerail/recipe.h — precision recipes of the expert MLP and the layer (docs/fp8.md, "The FP8 layer").
//   BF16           bf16 operands, fp32 accumulation (the default)
//   Fp8Blockwise   DeepSeek-V3's recipe: e4m3 GEMM operands, activations and gradients with 1x128 scales along
//                  the reduction dimension, weights with 128x128 block scales; bf16 outputs and bf16 in between
#pragma once

#include <string_view>

namespace moerail {

enum class Recipe { BF16, Fp8Blockwise };

inline std::string_view name_of(Recipe r) { return r == Recipe::BF16 ? "bf16" : "fp8-blockwise"; }

}  // namespace moerail
