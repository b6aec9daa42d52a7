// One instantiation of the SM90 FP8 blockwise-scaled grouped GEMM (see gemm_fp8.h): the weight gradient, tile
// Coop128x128, 1x128 scales on both operands (B is the transposed activation copy, not a weight).
#include "experts/fp8/gemm_fp8_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_wgrad_coop128x128() {
  constexpr Fp8GemmKind kKind{.tile = Fp8Tile::Coop128x128, .scaling = Fp8GemmScaling::Blockwise, .sfb_rows = 1};
  return std::make_unique<Sm90GroupedGemmFp8<kKind>>();
}

}  // namespace moerail::experts
