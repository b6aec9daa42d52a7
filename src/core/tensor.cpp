#include "moerail/tensor.h"

#include <sstream>

namespace moerail {

std::string Device::str() const { return is_host() ? std::string("host") : "cuda:" + std::to_string(index); }

TensorView::TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape, Device device)
    : data_(data), dtype_(dtype), device_(device) {
  if (shape.size() == 0 || shape.size() > std::size_t(kMaxDims))
    fail("TensorView", "a view has 1 to ", kMaxDims, " dimensions, got ", shape.size());
  for (std::int64_t d : shape) {
    if (d < 0) fail("TensorView", "negative dimension ", d);
    shape_[ndim_++] = d;
  }
}

std::int64_t TensorView::numel() const {
  if (ndim_ == 0) return 0;
  std::int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= shape_[i];
  return n;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < ndim_; ++i) os << (i ? ", " : "") << shape_[i];
  os << ']';
  return os.str();
}

static std::string shape_of(std::initializer_list<std::int64_t> dims) {
  std::ostringstream os;
  os << '[';
  int i = 0;
  for (std::int64_t d : dims) {
    os << (i++ ? ", " : "");
    if (d < 0) os << '*'; else os << d;
  }
  os << ']';
  return os.str();
}

void check_shape(std::string_view op, std::string_view name, const TensorView& t,
                 std::initializer_list<std::int64_t> expected) {
  bool ok = t.ndim() == int(expected.size());
  int i = 0;
  for (std::int64_t d : expected) {
    if (ok && d >= 0 && t.size(i) != d) ok = false;
    ++i;
  }
  if (!ok) fail(op, name, " has shape ", t.shape_str(), " but ", shape_of(expected), " was expected");
  if (t.numel() > 0 && t.data() == nullptr) fail(op, name, " has shape ", t.shape_str(), " but a null data pointer");
}

void check_dtype(std::string_view op, std::string_view name, const TensorView& t,
                 std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype() == d) return;
  std::ostringstream os;
  int i = 0;
  for (DType d : allowed) os << (i++ ? ", " : "") << dtype_name(d);
  fail(op, name, " has dtype ", dtype_name(t.dtype()), " but one of {", os.str(), "} was expected");
}

void check_device(std::string_view op, std::string_view name, const TensorView& t, Device expected) {
  if (t.numel() > 0 && !(t.device() == expected))
    fail(op, name, " is on ", t.device().str(), " but ", expected.str(), " was expected");
}

void check_min_numel(std::string_view op, std::string_view name, const TensorView& t, std::int64_t min_elems) {
  if (t.numel() < min_elems)
    fail(op, name, " has ", t.numel(), " elements (shape ", t.shape_str(), ") but at least ", min_elems,
         " are needed");
}

void check_grouped_slices(std::string_view op, const TensorView& grouped, std::span<const TensorView> per_expert) {
  if (!grouped.defined()) fail(op, "grouped is absent but required");
  if (grouped.ndim() < 2)
    fail(op, "grouped has shape ", grouped.shape_str(), " but [L, ...] with at least 2 dimensions was expected");
  if (grouped.numel() > 0 && grouped.data() == nullptr)
    fail(op, "grouped has shape ", grouped.shape_str(), " but a null data pointer");
  if (std::int64_t(per_expert.size()) != grouped.size(0))
    fail(op, "got ", per_expert.size(), " per-expert views but grouped has shape ", grouped.shape_str(),
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

}  // namespace moerail
