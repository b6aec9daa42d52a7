// One instantiation of the SM90 grouped GEMM (see grouped_gemm.h): layout Wgrad, tile Coop128x256.
#include "experts/grouped/grouped_gemm_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<GroupedGemm> make_gemm_wgrad_coop128x256() {
  return std::make_unique<Sm90GroupedGemm<GemmLayout::Wgrad, GemmTile::Coop128x256>>();
}

}  // namespace moerail::experts
