// tests/common/gpu.h — helpers for GPU tests: skip cleanly where no GPU is present.
#pragma once

#include <gtest/gtest.h>

#if MOERAIL_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moerail::testing {

// True when a CUDA device can be used by this process.
inline bool gpu_available() {
#if MOERAIL_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

}  // namespace moerail::testing

// First statement of every GPU test: reports the test as skipped (ctest: "Not Run"/skipped) without a GPU.
#define MOERAIL_REQUIRE_GPU()                                                  \
  do {                                                                         \
    if (!::moerail::testing::gpu_available()) GTEST_SKIP() << "no GPU found"; \
  } while (0)
