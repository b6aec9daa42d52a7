// tools/bench_gpu.cuh — what every GPU benchmark needs: device buffers and event-timed medians.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "bench.h"
#include "core/cuda_check.h"
#include "moerail/tensor.h"

namespace moerail::tools {

// One cudaMalloc'ed buffer, freed on destruction. Benchmarks allocate outside the timed region only.
struct DeviceBuf {
  void* p = nullptr;
  std::size_t bytes = 0;
  DeviceBuf() = default;
  explicit DeviceBuf(std::size_t n) : bytes(n) { MOERAIL_CUDA_CHECK(cudaMalloc(&p, n > 0 ? n : 16)); }
  ~DeviceBuf() { if (p) cudaFree(p); }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
  TensorView view(DType t, std::initializer_list<std::int64_t> shape) const {
    return TensorView(p, t, shape, Device::cuda(cuda::current_device()));
  }
};

// Median time in microseconds of `iters` runs of f(i) on stream s, each between its own pair of CUDA events,
// after `warmup` untimed runs. i counts the runs, so callers can rotate through input sets.
inline double median_us(const BenchOptions& o, cudaStream_t s, const std::function<void(int)>& f) {
  for (int i = 0; i < o.warmup; ++i) f(i);
  const int n = std::max(1, o.iters);
  std::vector<cudaEvent_t> ev(2 * std::size_t(n));
  for (auto& e : ev) MOERAIL_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < n; ++i) {
    MOERAIL_CUDA_CHECK(cudaEventRecord(ev[2 * std::size_t(i)], s));
    f(i);
    MOERAIL_CUDA_CHECK(cudaEventRecord(ev[2 * std::size_t(i) + 1], s));
  }
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<float> ms(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    MOERAIL_CUDA_CHECK(cudaEventElapsedTime(&ms[std::size_t(i)], ev[2 * std::size_t(i)], ev[2 * std::size_t(i) + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return 1000.0 * ms[ms.size() / 2];
}

}  // namespace moerail::tools
