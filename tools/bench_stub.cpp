// Without the GPU code there is nothing to benchmark: say so clearly.
#include "bench.h"
#include "moerail/error.h"

#if !MOERAIL_WITH_CUDA
namespace moerail::tools {
std::vector<BenchRow> run_kernel_bench(const std::string& bench, const BenchOptions&) {
  fail_with(ErrorCode::Unsupported, "bench", "'", bench,
            "' needs the GPU code, and this build has none (configure with nvcc present, MOERAIL_CUDA=ON)");
}
std::vector<BenchRow> run_mlp_bench(const BenchOptions&) {
  fail_with(ErrorCode::Unsupported, "bench",
            "'mlp' needs the GPU code, and this build has none (configure with nvcc present, MOERAIL_CUDA=ON)");
}
std::vector<BenchRow> run_mlp_fp8_bench(const BenchOptions&) {
  fail_with(ErrorCode::Unsupported, "bench",
            "'mlp-fp8' needs the GPU code, and this build has none (configure with nvcc present, MOERAIL_CUDA=ON)");
}
}  // namespace moerail::tools
#endif
