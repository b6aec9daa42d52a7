// moerail/tensor.h — TensorView: a non-owning, dense, row-major view of memory.
//
// Ops take TensorViews for every array argument; the caller owns the memory. A view records where the memory
// lives (host or a CUDA device), the element type and up to four dimensions. Views are always contiguous
// (row-major, no strides): the ops' contracts are written for that layout.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "moerail/dtype.h"
#include "moerail/error.h"

namespace moerail {

enum class DeviceKind : std::uint8_t { Host, Cuda };

struct Device {
  DeviceKind kind = DeviceKind::Host;
  int index = 0;  // CUDA device ordinal; 0 for the host

  static Device host() { return {DeviceKind::Host, 0}; }
  static Device cuda(int index) { return {DeviceKind::Cuda, index}; }
  bool is_host() const { return kind == DeviceKind::Host; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "host" or "cuda:N"
};

class TensorView {
 public:
  static constexpr int kMaxDims = 4;

  TensorView() = default;
  TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape, Device device = Device::host());
  TensorView(const void* data, DType dtype, std::initializer_list<std::int64_t> shape,
             Device device = Device::host())
      : TensorView(const_cast<void*>(data), dtype, shape, device) {}

  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int ndim() const { return ndim_; }
  std::int64_t size(int dim) const { return shape_[dim]; }
  std::int64_t numel() const;
  std::size_t nbytes() const { return std::size_t(numel()) * dtype_size(dtype_); }
  bool empty() const { return numel() == 0; }
  // A view with no memory and no shape: the way to pass "not given" for an optional argument.
  bool defined() const { return ndim_ > 0 || data_ != nullptr; }
  std::string shape_str() const;  // "[4096, 7168]"
  // The same dtype, shape and device over other memory.
  TensorView with_data(void* data) const {
    TensorView v = *this;
    v.data_ = data;
    return v;
  }

  // Typed pointer; the caller asserts the dtype matches (checked by the ops' argument checks, not here).
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Device device_ = Device::host();
  int ndim_ = 0;
  std::array<std::int64_t, kMaxDims> shape_{};
};

// ---- argument checks shared by every op; each throws Error(InvalidArgument) naming op and argument -----------

// `expected` dims of -1 match any size. Also rejects a null pointer when the view has elements.
void check_shape(std::string_view op, std::string_view name, const TensorView& t,
                 std::initializer_list<std::int64_t> expected);
void check_dtype(std::string_view op, std::string_view name, const TensorView& t,
                 std::initializer_list<DType> allowed);
void check_device(std::string_view op, std::string_view name, const TensorView& t, Device expected);
// One grouped tensor [L, ...] against L per-expert views: each present, of grouped's dtype and of its shape without
// the first dimension, none null unless empty (the weight layout converters; devices are the caller's to check).
void check_grouped_slices(std::string_view op, const TensorView& grouped, std::span<const TensorView> per_expert);
// Checks a view has at least `min_elems` elements (buffers sized by a capacity, larger than the data they hold).
void check_min_numel(std::string_view op, std::string_view name, const TensorView& t, std::int64_t min_elems);

}  // namespace moerail
