// One instantiation of the SM90 grouped GEMM (see grouped_gemm.h): layout Wgrad, tile Ping128x128.
#include "experts/grouped/grouped_gemm_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<GroupedGemm> make_gemm_wgrad_ping128x128() {
  return std::make_unique<Sm90GroupedGemm<GemmLayout::Wgrad, GemmTile::Ping128x128>>();
}

}  // namespace moerail::experts
