// `moerail check`: what this machine offers, and GPU queries shared by the other commands.
#include <cstdio>

#include "build_commit.h"  // MOERAIL_BUILD_COMMIT (generated at build time)
#include "commands.h"

#if MOERAIL_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moerail::tools {

int local_gpu_count() {
#if MOERAIL_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

std::string gpu_name(int device) {
#if MOERAIL_WITH_CUDA
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) == cudaSuccess) return p.name;
  (void)cudaGetLastError();
#endif
  return "none";
}

int check_command() {
  std::printf("moerail %s (commit %s)\n", MOERAIL_VERSION, MOERAIL_BUILD_COMMIT);
  std::printf("  GPU code built   %s\n", MOERAIL_WITH_CUDA ? "yes (sm_90a)" : "no");
#if MOERAIL_WITH_CUDA
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("  CUDA             runtime %d.%d, driver %d.%d\n", runtime / 1000, runtime % 1000 / 10, driver / 1000,
              driver % 1000 / 10);
#endif
  const int n = local_gpu_count();
  std::printf("  GPUs             %d\n", n);
  for (int d = 0; d < n; ++d) {
#if MOERAIL_WITH_CUDA
    cudaDeviceProp p{};
    cudaGetDeviceProperties(&p, d);
    std::printf("    cuda:%d         %s, sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MiB\n", d, p.name, p.major, p.minor,
                p.multiProcessorCount, double(p.totalGlobalMem) / (1 << 30), double(p.l2CacheSize) / (1 << 20));
#endif
  }
  if (n == 0) std::printf("  path             CPU reference only (moerail run uses it)\n");
  return 0;
}

}  // namespace moerail::tools
