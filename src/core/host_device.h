// src/core/host_device.h — MOERAIL_HD marks plain functions that run on the host (tests, CPU reference) and in
// kernels alike.
#pragma once

#if defined(__CUDACC__)
#define MOERAIL_HD __host__ __device__
#else
#define MOERAIL_HD
#endif
