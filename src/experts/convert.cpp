// src/experts/convert.cpp — grouped <-> per-expert weight layouts on any device (moerail/experts.h): one
// cudaMemcpyAsync per expert, stream-ordered, capturable.
#include <string>

#include "core/cuda_check.h"
#include "moerail/error.h"
#include "moerail/experts.h"

namespace moerail {
namespace {

void check_grouped_pair(std::string_view op, const TensorView& grouped, std::span<const TensorView> per_expert) {
  if (!grouped.defined()) fail(op, "grouped is absent but required");
  if (grouped.ndim() < 2)
    fail(op, "grouped has shape ", grouped.shape_str(), " but [L, ...] with at least 2 dimensions was expected");
  if (grouped.numel() > 0 && grouped.data() == nullptr)
    fail(op, "grouped has shape ", grouped.shape_str(), " but a null data pointer");
  if (std::int64_t(per_expert.size()) != grouped.size(0))
    fail(op, "got ", per_expert.size(), " per-expert tensors but grouped has shape ", grouped.shape_str(),
         " (expected ", grouped.size(0), ")");
  for (std::size_t e = 0; e < per_expert.size(); ++e) {
    const TensorView& t = per_expert[e];
    const std::string name = "per_expert[" + std::to_string(e) + "]";
    if (!t.defined()) fail(op, name, " is absent but required");
    if (t.dtype() != grouped.dtype())
      fail(op, name, " has dtype ", dtype_name(t.dtype()), " but grouped has ", dtype_name(grouped.dtype()));
    bool same = t.ndim() == grouped.ndim() - 1;
    for (int k = 0; same && k < t.ndim(); ++k) same = t.size(k) == grouped.size(k + 1);
    if (!same)
      fail(op, name, " has shape ", t.shape_str(), " but grouped ", grouped.shape_str(),
           " needs each expert's slice to have its shape without the first dimension");
    if (t.numel() > 0 && t.data() == nullptr) fail(op, name, " has shape ", t.shape_str(), " but a null data pointer");
  }
}

}  // namespace

void split_grouped_weights(const TensorView& grouped, std::span<const TensorView> per_expert, cudaStream_t stream) {
  check_grouped_pair("split_grouped_weights", grouped, per_expert);
  const auto* src = static_cast<const char*>(grouped.data());
  for (std::size_t e = 0; e < per_expert.size(); ++e) {
    const std::size_t bytes = per_expert[e].nbytes();
    if (bytes > 0)
      MOERAIL_CUDA_CHECK(cudaMemcpyAsync(per_expert[e].data(), src + e * bytes, bytes, cudaMemcpyDefault, stream));
  }
}

void stack_grouped_weights(std::span<const TensorView> per_expert, const TensorView& grouped, cudaStream_t stream) {
  check_grouped_pair("stack_grouped_weights", grouped, per_expert);
  auto* dst = static_cast<char*>(grouped.data());
  for (std::size_t e = 0; e < per_expert.size(); ++e) {
    const std::size_t bytes = per_expert[e].nbytes();
    if (bytes > 0)
      MOERAIL_CUDA_CHECK(cudaMemcpyAsync(dst + e * bytes, per_expert[e].data(), bytes, cudaMemcpyDefault, stream));
  }
}

}  // namespace moerail
