// tools/bench_gpu.cuh — what every GPU benchmark needs: device buffers and event-timed medians.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
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
  DeviceBuf(DeviceBuf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  TensorView view(DType t, std::initializer_list<std::int64_t> shape) const {
    return TensorView(p, t, shape, Device::cuda(cuda::current_device()));
  }
};

// Uniform values in [-sqrt(3) s, sqrt(3) s) (stddev s) from a counter hash into n bf16 values at p: deterministic,
// fast for GBs. On the legacy default stream (setup, outside timed regions).
void fill_uniform_bf16(void* p, std::int64_t n, float stddev, std::uint64_t seed);
// e4m3 codes of uniform values in [-448, 448) (n bytes), and f32 scales uniform in [0.5, 2) / 448 (n values).
void fill_e4m3(void* p, std::int64_t n, std::uint64_t seed);
void fill_scales(void* p, std::int64_t n, std::uint64_t seed);
// Dense FP8 GEMM rate in TFLOP/s (8192^3, e4m3 x e4m3 -> bf16, per-tensor fp32 scales) with cuBLASLt, measured now:
// the FP8 ceiling. fast_accum: without the periodic promotion of the tensor cores' partial sums.
double dense_fp8_tflops(const BenchOptions& o, cudaStream_t s, bool fast_accum);

// Dense bf16 GEMM rate in TFLOP/s (8192^3, fp32 accumulation) with cuBLAS, measured now: the GEMM ceiling.
double dense_tflops(const BenchOptions& o, cudaStream_t s);

// The GEMM of that ceiling (cuBLAS bf16, 8192^3, random operands), kept so that a benchmark can time it beside its
// own kernels, alternating in one loop: both then run in the same power state, which moves whole runs by up to ~10%.
class DenseGemm {
 public:
  static constexpr int kN = 8192;
  static constexpr double kFlop = 2.0 * double(kN) * kN * kN;
  explicit DenseGemm(cudaStream_t s);
  ~DenseGemm();
  DenseGemm(const DenseGemm&) = delete;
  DenseGemm& operator=(const DenseGemm&) = delete;
  void launch();  // one GEMM on the stream given at construction
  double measure_tflops(const BenchOptions& o);  // the median rate of launch(), timed alone

 private:
  cudaStream_t s_;
  DeviceBuf a_, b_, c_;
  void* handle_ = nullptr;  // cublasHandle_t
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

// Medians of each f[j]() when every iteration runs f[0](), f[1](), ... back to back with events between them: the
// variants see the same power state and clocks (separate loops differ by up to ~10% from that alone).
inline std::vector<double> alternating_medians_us(const BenchOptions& o, cudaStream_t s,
                                                  const std::vector<std::function<void()>>& f) {
  for (int i = 0; i < o.warmup; ++i)
    for (const auto& g : f) g();
  const std::size_t n = std::size_t(std::max(1, o.iters)), m = f.size();
  std::vector<cudaEvent_t> ev(n * (m + 1));
  for (auto& e : ev) MOERAIL_CUDA_CHECK(cudaEventCreate(&e));
  for (std::size_t i = 0; i < n; ++i) {
    MOERAIL_CUDA_CHECK(cudaEventRecord(ev[i * (m + 1)], s));
    for (std::size_t j = 0; j < m; ++j) {
      f[j]();
      MOERAIL_CUDA_CHECK(cudaEventRecord(ev[i * (m + 1) + j + 1], s));
    }
  }
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<double> med(m);
  std::vector<float> t(n);
  for (std::size_t j = 0; j < m; ++j) {
    for (std::size_t i = 0; i < n; ++i)
      MOERAIL_CUDA_CHECK(cudaEventElapsedTime(&t[i], ev[i * (m + 1) + j], ev[i * (m + 1) + j + 1]));
    std::sort(t.begin(), t.end());
    med[j] = 1000.0 * t[n / 2];
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return med;
}

// Medians of a() and of b() when each iteration runs a() then b() back to back, with events between them.
inline std::pair<double, double> split_median_us(const BenchOptions& o, cudaStream_t s, const std::function<void()>& a,
                                                 const std::function<void()>& b) {
  const std::vector<double> m = alternating_medians_us(o, s, {a, b});
  return {m[0], m[1]};
}

// Median time of one f(i) when `launches` calls f(0..launches-1) are captured in one CUDA graph and the graph is
// replayed: the time of back-to-back launches, as inside a captured training step, without the launch gaps that
// event timing of a single short kernel includes. f must be capturable (no host sync, no allocation).
inline double graph_median_us(const BenchOptions& o, cudaStream_t s, const std::function<void(int)>& f,
                              int launches = 20) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int j = 0; j < launches; ++j) f(j);
  MOERAIL_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  MOERAIL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = median_us(o, s, [&](int) { MOERAIL_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return us / launches;
}

// Input sets a benchmark rotates through so that their total is at least twice the L2 cache (never fewer than
// `minimum`): repeated runs then read device memory, not the cache.
inline int input_sets(std::size_t bytes_per_set, int minimum = 3) {
  int l2 = 0;
  MOERAIL_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, cuda::current_device()));
  const std::size_t want = 2 * std::size_t(l2);
  const int n = bytes_per_set == 0 ? minimum : int((want + bytes_per_set - 1) / bytes_per_set);
  return n > minimum ? n : minimum;
}

// Copy bandwidth (GB/s, bytes read + written) of copy(dst, src, bytes) over two 1 GiB buffers, median of timed runs.
inline double copy_rate_gbs(const BenchOptions& o, cudaStream_t s,
                            const std::function<void(void*, const void*, std::size_t)>& copy) {
  const std::size_t n = std::size_t(1) << 30;
  DeviceBuf a(n), b(n);
  MOERAIL_CUDA_CHECK(cudaMemsetAsync(a.p, 1, n, s));
  BenchOptions q = o;
  q.iters = std::max(10, std::min(o.iters, 30));
  q.warmup = 3;
  const double us = median_us(q, s, [&](int) { copy(b.p, a.p, n); });
  return 2.0 * double(n) / (us * 1e3);
}

// Device copy bandwidth (GB/s): cudaMemcpyAsync D2D of 1 GiB; bytes read + written.
inline double copy_bandwidth_gbs(const BenchOptions& o, cudaStream_t s) {
  return copy_rate_gbs(o, s, [&](void* dst, const void* src, std::size_t n) {
    MOERAIL_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s));
  });
}

}  // namespace moerail::tools
