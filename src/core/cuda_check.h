// src/core/cuda_check.h — turning CUDA failures into moerail::Error(ErrorCode::Cuda), and device facts the launch
// heuristics read (SM count), never hard-coded.
//
// MOERAIL_CUDA_CHECK(call) evaluates a CUDA runtime call and throws
//   Error(Cuda, "<call> failed on cuda:<device>: <error name> (<error string>) at <file>:<line>")
// when it does not return cudaSuccess. MOERAIL_CUDA_CHECK_LAUNCH() does the same for the last kernel launch
// (cudaGetLastError: launch-configuration errors only, it never synchronizes).
#pragma once

#include <cuda_runtime_api.h>

namespace moerail::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);

// The current device ordinal (cudaGetDevice), checked.
int current_device();
// Number of SMs of the current device (cached per device; cudaDeviceGetAttribute only on the first call).
int sm_count();
// Peak bandwidth of the current device's memory in bytes per second, from its memory clock and bus width (double
// data rate); 0 when the device does not report them. H100 SXM: 3.35e12; H200: 4.8e12.
double memory_bandwidth();

// Grid size of a persistent kernel: enough blocks to fill every SM (blocks_per_sm from the occupancy
// calculator, computed by the caller once per kernel), never more than there is work for, 0 when there is none.
inline long long persistent_grid(long long work_blocks, int blocks_per_sm) {
  const long long full = (long long)sm_count() * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  return work_blocks < full ? work_blocks : full;
}

}  // namespace moerail::cuda

#define MOERAIL_CUDA_CHECK(call)                                                          \
  do {                                                                                    \
    const cudaError_t moerail_err_ = (call);                                              \
    if (moerail_err_ != cudaSuccess)                                                      \
      ::moerail::cuda::throw_cuda_error(moerail_err_, #call, __FILE__, __LINE__);         \
  } while (0)

#define MOERAIL_CUDA_CHECK_LAUNCH() MOERAIL_CUDA_CHECK(cudaGetLastError())
