// src/experts/cutlass_hw.cuh — what the CUTLASS GEMM wrappers (grouped_gemm_sm90.cuh, gemm_fp8_sm90.cuh,
// contig_gemm_sm90.cuh) ask of the device alike: the hardware info CUTLASS's persistent scheduler sizes its grid
// from, and the number of clusters of a kernel that can be resident at once. Included only by those headers.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "cute/tensor.hpp"
#include "cutlass/device_kernel.h"
#include "cutlass/kernel_hardware_info.h"

#include "core/cuda_check.h"

namespace moerail::experts {

inline cutlass::KernelHardwareInfo hw_info(int max_active_clusters) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = cuda::current_device();
  hw.sm_count = cuda::sm_count();
  hw.max_active_clusters = max_active_clusters;
  return hw;
}

// Clusters of shape Cluster of `Kernel` that fit on the current device at once (the occupancy calculator, with the
// kernel's dynamic shared memory, whose attribute must already be set); 0 if it cannot tell (CUTLASS then launches
// one CTA per SM, which it handles). max_sms > 0 caps them to the clusters of that many SMs (at least one), so that
// the persistent grid leaves the other SMs to kernels beside it (MlpOptions::sms).
template <class Kernel, class Cluster>
int max_active_clusters_of(int max_sms) {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cute::size<0>(Cluster{});
  attr.val.clusterDim.y = cute::size<1>(Cluster{});
  attr.val.clusterDim.z = 1;
  cfg.gridDim = dim3(attr.val.clusterDim.x, attr.val.clusterDim.y, 1);
  cfg.blockDim = dim3(Kernel::MaxThreadsPerBlock, 1, 1);
  cfg.dynamicSmemBytes = Kernel::SharedStorageSize;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, cutlass::device_kernel<Kernel>, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    clusters = 0;
  }
  if (max_sms <= 0) return clusters;
  const int cluster_size = int(cute::size(Cluster{}));
  const int cap = std::max(1, max_sms / cluster_size);
  return clusters > 0 ? std::min(clusters, cap) : std::min(cap, cuda::sm_count() / cluster_size);
}

}  // namespace moerail::experts
