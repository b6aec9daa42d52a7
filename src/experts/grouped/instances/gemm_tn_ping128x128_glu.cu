// One instantiation of the SM90 grouped GEMM (see grouped_gemm.h): FC1 (layout TN, tile Ping128x128) with the GLU
// activation fused into its epilogue (glu_epilogue.cuh).
#include "experts/grouped/grouped_gemm_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<GroupedGemm> make_gemm_tn_ping128x128_glu() {
  return std::make_unique<Sm90GroupedGemm<GemmLayout::TN, GemmTile::Ping128x128, true>>();
}

}  // namespace moerail::experts
