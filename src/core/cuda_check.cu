#include "core/cuda_check.h"

#include <mutex>
#include <string>
#include <vector>

#include "core/sync.h"
#include "moerail/error.h"

namespace moerail::cuda {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  int dev = -1;
  (void)cudaGetDevice(&dev);  // best effort: the device is part of the message, not of the check
  throw Error(ErrorCode::Cuda, detail::concat(call, " failed on cuda:", dev, ": ", cudaGetErrorName(err), " (",
                                              cudaGetErrorString(err), ") at ", file, ":", line));
}

int current_device() {
  int dev = 0;
  MOERAIL_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

int sm_count() {
  static std::mutex mu;
  static std::vector<int> cache;  // per device ordinal; 0 = not read yet
  const int dev = current_device();
  std::lock_guard<std::mutex> lock(mu);
  if (std::size_t(dev) >= cache.size()) cache.resize(std::size_t(dev) + 1, 0);
  if (cache[std::size_t(dev)] == 0) {
    int n = 0;
    MOERAIL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cache[std::size_t(dev)] = n > 0 ? n : 1;
  }
  return cache[std::size_t(dev)];
}

void synchronize_device(int device) noexcept {
  int current = -1;
  (void)cudaGetDevice(&current);
  if (cudaSetDevice(device) != cudaSuccess) return;
  (void)cudaDeviceSynchronize();
  if (current >= 0) (void)cudaSetDevice(current);
}

double memory_bandwidth() {
  const int dev = current_device();
  int khz = 0, bits = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess) {
    (void)cudaGetLastError();  // not reported: clear the error
    return 0.0;
  }
  return 2.0 * double(khz) * 1e3 * double(bits) / 8.0;
}

}  // namespace moerail::cuda
