// The contiguous NN GEMM (contig_gemm.h) of FC2's dgrad with the activation backward in its epilogue
// (act_bwd_epilogue.cuh): ping-pong 128x128x64, clusters 1x2.
#include "experts/contig/contig_gemm_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<ContigGemm> make_contig_gemm_nn_act_bwd() {
  return std::make_unique<Sm90ContigGemm<GemmLayout::NN, ContigEpilogue::ActBwd>>();
}

bool contig_act_bwd_supports(const ActShape& s) { return ActBwdEpilogue<contig::StrideD>::supports(s); }

}  // namespace moerail::experts
