// src/experts/grouped/grouped_gemm.cpp — names and the typed dispatch over the compiled grouped-GEMM instantiations.
#include "experts/grouped/grouped_gemm.h"

#include "moerail/error.h"

namespace moerail::experts {

std::string_view name_of(GemmLayout l) {
  switch (l) {
    case GemmLayout::TN: return "tn";
    case GemmLayout::NN: return "nn";
    case GemmLayout::Wgrad: return "wgrad";
  }
  return "?";
}

std::string_view name_of(GemmTile t) {
  switch (t) {
    case GemmTile::Coop128x256: return "coop128x256";
    case GemmTile::Ping128x128: return "ping128x128";
  }
  return "?";
}

void GroupedGemm::set_glu_epilogue(const GluEpilogue&) {
  fail_with(ErrorCode::Internal, "experts", "the ", name_of(layout()), " ", name_of(tile()),
            " grouped GEMM has no fused activation epilogue");
}

std::unique_ptr<GroupedGemm> make_grouped_gemm(GemmLayout layout, GemmTile tile) {
  const bool coop = tile == GemmTile::Coop128x256;
  switch (layout) {
    case GemmLayout::TN: return coop ? make_gemm_tn_coop128x256() : make_gemm_tn_ping128x128();
    case GemmLayout::NN: return coop ? make_gemm_nn_coop128x256() : make_gemm_nn_ping128x128();
    case GemmLayout::Wgrad: return coop ? make_gemm_wgrad_coop128x256() : make_gemm_wgrad_ping128x128();
  }
  fail_with(ErrorCode::Unsupported, "experts", "no grouped GEMM for layout ", int(layout), " tile ", int(tile),
            " (supported: layouts tn, nn, wgrad x tiles coop128x256, ping128x128)");
}

std::unique_ptr<GroupedGemm> make_grouped_gemm_glu(GemmTile tile) {
  return tile == GemmTile::Coop128x256 ? make_gemm_tn_coop128x256_glu() : make_gemm_tn_ping128x128_glu();
}

}  // namespace moerail::experts
