// src/experts/convert.cpp — grouped <-> per-expert weight layouts on any device (moerail/experts.h): one
// cudaMemcpyAsync per expert, stream-ordered, capturable.
#include <string>

#include "core/cuda_check.h"
#include "moerail/error.h"
#include "moerail/experts.h"

namespace moerail {

void split_grouped_weights(const TensorView& grouped, std::span<const TensorView> per_expert, cudaStream_t stream) {
  check_grouped_slices("split_grouped_weights", grouped, per_expert);
  const auto* src = static_cast<const char*>(grouped.data());
  for (std::size_t e = 0; e < per_expert.size(); ++e) {
    const std::size_t bytes = per_expert[e].nbytes();
    if (bytes > 0)
      MOERAIL_CUDA_CHECK(cudaMemcpyAsync(per_expert[e].data(), src + e * bytes, bytes, cudaMemcpyDefault, stream));
  }
}

void stack_grouped_weights(std::span<const TensorView> per_expert, const TensorView& grouped, cudaStream_t stream) {
  check_grouped_slices("stack_grouped_weights", grouped, per_expert);
  auto* dst = static_cast<char*>(grouped.data());
  for (std::size_t e = 0; e < per_expert.size(); ++e) {
    const std::size_t bytes = per_expert[e].nbytes();
    if (bytes > 0)
      MOERAIL_CUDA_CHECK(cudaMemcpyAsync(dst + e * bytes, per_expert[e].data(), bytes, cudaMemcpyDefault, stream));
  }
}

}  // namespace moerail
