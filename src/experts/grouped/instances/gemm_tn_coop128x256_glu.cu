// One instantiation of the SM90 grouped GEMM (see grouped_gemm.h): FC1 (layout TN, tile Coop128x256) with the GLU
// activation fused into its epilogue (glu_epilogue.cuh, in four rounds of 64 columns, stored with the TMA unit).
#include "experts/grouped/grouped_gemm_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<GroupedGemm> make_gemm_tn_coop128x256_glu() {
  return std::make_unique<Sm90GroupedGemm<GemmLayout::TN, GemmTile::Coop128x256, true>>();
}

}  // namespace moerail::experts
