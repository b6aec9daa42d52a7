// One instantiation of the SM90 FP8 per-tensor-scaled grouped GEMM (see gemm_fp8.h): tile Coop128x128, the partial
// sums promoted every 128 elements of K (the split accumulator: per-tensor dgrads and weight gradients), alpha per
// group in the epilogue, bf16 out.
#include "experts/fp8/gemm_fp8_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_tensor_promoted_coop128x128() {
  constexpr Fp8GemmKind kKind{.tile = Fp8Tile::Coop128x128, .scaling = Fp8GemmScaling::PerTensor, .promote = true};
  return std::make_unique<Sm90GroupedGemmFp8<kKind>>();
}

}  // namespace moerail::experts
