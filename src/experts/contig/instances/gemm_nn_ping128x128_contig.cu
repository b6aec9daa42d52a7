// The contiguous NN GEMM (contig_gemm.h): ping-pong 128x128x64, clusters 1x2.
#include "experts/contig/contig_gemm_sm90.cuh"

namespace moerail::experts {

std::unique_ptr<ContigGemm> make_contig_gemm_nn() { return std::make_unique<Sm90ContigGemm<GemmLayout::NN>>(); }

}  // namespace moerail::experts
