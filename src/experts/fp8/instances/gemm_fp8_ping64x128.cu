// One instantiation of the SM90 FP8 blockwise-scaled grouped GEMM (see gemm_fp8.h): tile Ping64x128.
#include "experts/fp8/gemm_fp8_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_ping64x128() {
  constexpr Fp8GemmKind kKind{.tile = Fp8Tile::Ping64x128, .scaling = Fp8GemmScaling::Blockwise};
  return std::make_unique<Sm90GroupedGemmFp8<kKind>>();
}

}  // namespace moerail::experts
