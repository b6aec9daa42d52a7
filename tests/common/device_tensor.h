// tests/common/device_tensor.h — device buffers for GPU tests: allocate, poison, copy to and from ref::HostTensor.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "moerail/reference/host.h"
#include "moerail/tensor.h"

namespace moerail::testing {

#define MOERAIL_TEST_CUDA(call)                                                                   \
  do {                                                                                            \
    const cudaError_t e_ = (call);                                                                \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_);                       \
  } while (0)

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(ErrorCode::Cuda, std::string(what) + ": " + cudaGetErrorString(e));
}

// An owning device allocation with a TensorView of itself. Poisoned (all bytes 0xff: NaN for floats, -1 for
// integers) when made, so that whatever an op does not write shows up.
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(DType dtype, std::vector<std::int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    std::int64_t n = 1;
    for (auto d : shape_) n *= d;
    bytes_ = std::size_t(n) * dtype_size(dtype) + 16;  // +16: room for a deliberately misaligned view
    cuda_ok(cudaMalloc(&ptr_, bytes_), "cudaMalloc");
    poison();
  }
  ~DeviceTensor() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  DeviceTensor(DeviceTensor&& o) noexcept { *this = std::move(o); }
  DeviceTensor& operator=(DeviceTensor&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    dtype_ = o.dtype_;
    shape_ = o.shape_;
    offset_ = o.offset_;
    return *this;
  }

  void* data() const { return static_cast<char*>(ptr_) + offset_; }
  // Shift the view by `bytes` (to test unaligned fallbacks); poisons again.
  void set_offset(std::size_t bytes) { offset_ = bytes; poison(); }
  TensorView view() const { return view_as(shape_); }
  TensorView view_as(const std::vector<std::int64_t>& shape) const {
    int dev = 0;
    cudaGetDevice(&dev);
    switch (shape.size()) {
      case 1: return TensorView(data(), dtype_, {shape[0]}, Device::cuda(dev));
      case 2: return TensorView(data(), dtype_, {shape[0], shape[1]}, Device::cuda(dev));
      default: return TensorView(data(), dtype_, {shape[0], shape[1], shape[2]}, Device::cuda(dev));
    }
  }
  std::size_t nbytes() const { return bytes_ - 16; }
  void poison() const { cuda_ok(cudaMemset(ptr_, 0xff, bytes_), "cudaMemset"); }
  void zero() const { cuda_ok(cudaMemset(ptr_, 0, bytes_), "cudaMemset"); }
  void upload(const ref::HostTensor& h) const {
    cuda_ok(cudaMemcpy(data(), h.view().data(), h.view().nbytes(), cudaMemcpyHostToDevice), "upload");
  }
  // Copies the first h.numel() elements into h.
  void download(const ref::HostTensor& h) const {
    cuda_ok(cudaMemcpy(h.view().data(), data(), h.view().nbytes(), cudaMemcpyDeviceToHost), "download");
  }
  template <typename T>
  std::vector<T> to_vector(std::size_t n) const {
    std::vector<T> v(n);
    cuda_ok(cudaMemcpy(v.data(), data(), n * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return v;
  }
  template <typename T>
  void from_vector(const std::vector<T>& v) const {
    cuda_ok(cudaMemcpy(data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0, offset_ = 0;
  DType dtype_ = DType::F32;
  std::vector<std::int64_t> shape_;
};

inline DeviceTensor device_scalar_i32(std::int32_t v) {
  DeviceTensor t(DType::I32, {1});
  t.from_vector(std::vector<std::int32_t>{v});
  return t;
}

// Raw bytes of element i of a host tensor (bit-exact comparisons).
inline bool same_bits(const TensorView& a, const TensorView& b, std::int64_t i) {
  const std::size_t s = dtype_size(a.dtype());
  return std::memcmp(static_cast<const char*>(a.data()) + i * s, static_cast<const char*>(b.data()) + i * s, s) == 0;
}

// Random top-k ids [T, K]: K distinct experts per token drawn from [0, E), a fraction of slots -1.
inline ref::HostTensor random_topk(ref::Rng& rng, std::int64_t T, std::int64_t K, std::int64_t E,
                                   double unrouted = 0.0) {
  ref::HostTensor idx(DType::I32, {T, K});
  std::vector<std::int64_t> perm(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t e = 0; e < E; ++e) perm[std::size_t(e)] = e;
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t j = k + rng.below(E - k);
      std::swap(perm[std::size_t(k)], perm[std::size_t(j)]);
      idx.set_i(t * K + k, rng.uniform() < unrouted ? -1 : perm[std::size_t(k)]);
    }
  }
  return idx;
}

}  // namespace moerail::testing
