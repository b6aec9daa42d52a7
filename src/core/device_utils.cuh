// src/core/device_utils.cuh — small device helpers shared by the kernels: element conversions, 16-byte vectors,
// warp reductions in a fixed order (deterministic), a warp prefix sum, the device token count, chains of small
// launches.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "moerail/dtype.h"

namespace moerail::cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;

// ---- element types --------------------------------------------------------------------------------------------

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Calls f(T{}) with the CUDA element type of a floating activation dtype (f32, bf16, f16).
template <typename F>
inline void dispatch_float_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(__nv_bfloat16{}); return;
    case DType::F16: f(__half{}); return;
    default: return;  // callers check the dtype first
  }
}

// ---- 16-byte vectors ------------------------------------------------------------------------------------------

// N elements of T packed in 16 bytes (or a single element for the scalar fallback, Bytes = sizeof(T)).
template <typename T, int Bytes>
struct alignas(Bytes) Vec {
  static constexpr int N = Bytes / int(sizeof(T));
  T v[N];
};

template <typename V>
__device__ __forceinline__ V load_vec(const V* p) {
  if constexpr (sizeof(V) == 16) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    V out;
    *reinterpret_cast<uint4*>(&out) = u;
    return out;
  } else {
    return *p;
  }
}

template <typename V>
__device__ __forceinline__ void store_vec(V* p, const V& v) {
  if constexpr (sizeof(V) == 16) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
  } else {
    *p = v;
  }
}

template <typename V>
__device__ __forceinline__ V zero_vec() {
  V out;
  // All-zero bits are +0 in every floating type.
  if constexpr (sizeof(V) == 16) {
    *reinterpret_cast<uint4*>(&out) = make_uint4(0, 0, 0, 0);
  } else if constexpr (sizeof(V) == 8) {
    *reinterpret_cast<uint2*>(&out) = make_uint2(0, 0);
  } else if constexpr (sizeof(V) == 4) {
    *reinterpret_cast<unsigned*>(&out) = 0u;
  } else {
    static_assert(sizeof(V) == 2, "vectors are 2, 4, 8 or 16 bytes");
    *reinterpret_cast<unsigned short*>(&out) = 0;
  }
  return out;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// ---- warp reductions (butterfly: every lane ends with the same value, computed in the same order) --------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Inclusive prefix sum over the warp's lanes (lane i gets v_0 + ... + v_i), integer types: exact, any order.
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = int(threadIdx.x % kWarp);
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const T u = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Order-preserving map of a float to uint32 (a > b as floats <=> key(a) > key(b) as unsigned; -0 is mapped as +0).
// Key 0 is below every float's key (-inf maps to 0x007fffff): it marks "not a candidate".
__device__ __forceinline__ unsigned float_key(float f) {
  unsigned u = __float_as_uint(f + 0.0f);  // -0 + 0 = +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// ---- the device token count -------------------------------------------------------------------------------------

// T read from device memory, clamped to [0, t_max] so that a wrong count can never index out of bounds.
__device__ __forceinline__ int load_token_count(const std::int32_t* num_tokens, int t_max) {
  const int t = *num_tokens;
  return t < 0 ? 0 : (t > t_max ? t_max : t);
}

// ---- chains of small launches (programmatic dependent launch) -----------------------------------------------------
//
// A kernel launched by launch_after_previous may be scheduled while the kernel before it on the stream still runs,
// once every block of that one has called let_next_start (or ended). Before it reads or writes anything, it calls
// wait_for_previous, which returns when the previous kernel has completed and its writes are visible. What is saved
// is the launch latency between small dependent kernels; without the launch attribute both calls do nothing.

__device__ __forceinline__ void wait_for_previous() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void let_next_start() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

template <typename... KernelArgs, typename... Args>
cudaError_t launch_after_previous(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, std::size_t smem,
                                  cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace moerail::cuda
