// One instantiation of the SM90 FP8 blockwise-scaled grouped GEMM (see gemm_fp8.h): the weight gradient, tile
// Ping64x128, 1x128 scales on both operands (B is the transposed activation copy, not a weight).
#include "experts/fp8/gemm_fp8_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_wgrad_ping64x128() {
  return std::make_unique<Sm90GroupedGemmFp8<Fp8Tile::Ping64x128, Fp8GemmScaling::Blockwise, 1>>();
}

}  // namespace moerail::experts
