// One instantiation of the SM90 FP8 per-tensor-scaled grouped GEMM (see gemm_fp8.h): the per-tensor weight gradient
// added into fp32 gradients (dw += alpha dy^T x, Megatron-LM's main_grad), tile Coop128x128, the partial sums
// promoted every 128 elements of K.
#include "experts/fp8/gemm_fp8_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_tensor_promoted_accum_coop128x128() {
  constexpr Fp8GemmKind kKind{.tile = Fp8Tile::Coop128x128, .scaling = Fp8GemmScaling::PerTensor,
                             .accumulate = true, .promote = true};
  return std::make_unique<Sm90GroupedGemmFp8<kKind>>();
}

}  // namespace moerail::experts
