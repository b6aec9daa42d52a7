// src/experts/device_linear.h — a bias-free linear layer y = x W^T whose row count T is read from device memory:
// the router's gate of the MoE layer (W [N, K_in], x [rows, K_in], y [rows, N], bf16, fp32 accumulation). The one
// interface of src/experts that the layer uses besides the public GroupedMlp; its GEMM machinery stays private.
//
// It is the expert MLP's grouped GEMM machinery with one group (experts/grouped/grouped_gemm.h, experts/setup.h): the
// setup kernel turns the device count into the group's shape, so rows t >= T are neither read nor written and a
// captured graph replays with any T. Backward gives dx = dy W and dW = dy^T x summed over the T rows only (T = 0:
// dW = 0), whatever rows t >= T of x and dy hold.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "moerail/memory.h"
#include "moerail/tensor.h"

namespace moerail::experts {

class DeviceLinear {
 public:
  // Setup (outside capture): allocates the argument arrays and workspaces from `allocator`, initializes the kernels
  // on the current device (sm_90). in and out must be multiples of 8. `name` prefixes errors.
  DeviceLinear(std::int64_t in, std::int64_t out, std::int64_t max_rows, const char* name,
               DeviceAllocator& allocator);
  ~DeviceLinear();
  DeviceLinear(const DeviceLinear&) = delete;
  DeviceLinear& operator=(const DeviceLinear&) = delete;

  // y [max_rows, out] = x [max_rows, in] W^T (rows t < T).
  void forward(const TensorView& x, const TensorView& w, const TensorView& num_tokens, const TensorView& y,
               cudaStream_t stream);
  // dx [max_rows, in] = dy W (rows t < T); dW [out, in] = dy^T x over rows t < T.
  void backward(const TensorView& x, const TensorView& w, const TensorView& num_tokens, const TensorView& dy,
                const TensorView& dx, const TensorView& dw, cudaStream_t stream);

  std::size_t device_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moerail::experts
