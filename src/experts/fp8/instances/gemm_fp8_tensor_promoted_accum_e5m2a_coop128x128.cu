// One instantiation of the SM90 FP8 per-tensor-scaled grouped GEMM (see gemm_fp8.h): the hybrid recipe's weight
// gradient (A = the e5m2 gradient's copy, B = the e4m3 activation's) added into fp32 gradients, tile Coop128x128,
// the partial sums promoted every 128 elements of K.
#include "experts/fp8/gemm_fp8_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_tensor_promoted_accum_e5m2a_coop128x128() {
  constexpr Fp8GemmKind kKind{.tile = Fp8Tile::Coop128x128, .scaling = Fp8GemmScaling::PerTensor,
                             .accumulate = true, .promote = true, .e5m2_a = true};
  return std::make_unique<Sm90GroupedGemmFp8<kKind>>();
}

}  // namespace moerail::experts
