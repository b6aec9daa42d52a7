// The contiguous TN GEMM (contig_gemm.h) of FC1 with the GLU activation in its epilogue (glu_epilogue.cuh):
// ping-pong 128x128x64, clusters 1x2.
#include "experts/contig/contig_gemm_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<ContigGemm> make_contig_gemm_tn_glu() {
  return std::make_unique<Sm90ContigGemm<GemmLayout::TN, ContigEpilogue::Glu>>();
}

}  // namespace moerail::experts
