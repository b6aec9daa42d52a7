// python/src/convert.h — arrays from Python (NumPy arrays, torch tensors: anything speaking DLPack) as TensorViews.
//
// The bindings never copy: a view points at the caller's memory, which must stay alive for the call (and, for
// GPU ops, until the stream has run the work: torch's caching allocator guarantees that on the current stream).
// Views are dense row-major; a strided array is refused with a message naming the argument.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <string>

#include "moerail/error.h"
#include "moerail/recipe.h"
#include "moerail/tensor.h"

#if MOERAIL_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moerail::py {

namespace nb = nanobind;

using Array = nb::ndarray<>;
using OptArray = std::optional<Array>;

inline DType dtype_of(const Array& a, const char* name) {
  const nb::dlpack::dtype d = a.dtype();
  using Code = nb::dlpack::dtype_code;
  if (d.lanes == 1) {
    if (d.code == std::uint8_t(Code::Float) && d.bits == 32) return DType::F32;
    if (d.code == std::uint8_t(Code::Float) && d.bits == 64) return DType::F64;
    if (d.code == std::uint8_t(Code::Float) && d.bits == 16) return DType::F16;
    if (d.code == std::uint8_t(Code::Bfloat) && d.bits == 16) return DType::BF16;
    if (d.code == std::uint8_t(Code::Int) && d.bits == 32) return DType::I32;
    if (d.code == std::uint8_t(Code::Int) && d.bits == 64) return DType::I64;
    if (d.code == std::uint8_t(Code::Bool) && d.bits == 8) return DType::Bool;
    if (d.code == std::uint8_t(Code::UInt) && d.bits == 8) return DType::Bool;  // byte buffers (workspaces)
  }
  fail("moerail", name, ": element type (DLPack code ", int(d.code), ", ", int(d.bits),
       " bits) is not one of float32, float64, float16, bfloat16, int32, int64, bool, uint8");
}

// A dense view of `a`; `name` is the argument's name in error messages.
inline TensorView view(const Array& a, const char* name) {
  const std::size_t nd = a.ndim();
  if (nd < 1 || nd > std::size_t(TensorView::kMaxDims))
    fail("moerail", name, ": ", nd, " dimensions; 1 to ", TensorView::kMaxDims, " are supported");
  std::int64_t expect = 1;  // strides in elements, row-major
  for (std::size_t i = nd; i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect)
      fail("moerail", name, ": not contiguous (call .contiguous() first)");
    expect *= std::int64_t(a.shape(i));
  }
  Device dev = Device::host();
  if (a.device_type() == nb::device::cuda::value) {
    dev = Device::cuda(int(a.device_id()));
  } else if (a.device_type() != nb::device::cpu::value) {
    fail("moerail", name, ": lives on a device that is neither the CPU nor a CUDA GPU");
  }
  const DType dt = dtype_of(a, name);
  void* p = const_cast<void*>(a.data());
  auto s = [&](std::size_t i) { return std::int64_t(a.shape(i)); };
  switch (nd) {
    case 1: return TensorView(p, dt, {s(0)}, dev);
    case 2: return TensorView(p, dt, {s(0), s(1)}, dev);
    case 3: return TensorView(p, dt, {s(0), s(1), s(2)}, dev);
    default: return TensorView(p, dt, {s(0), s(1), s(2), s(3)}, dev);
  }
}

inline TensorView view(const OptArray& a, const char* name) { return a ? view(*a, name) : TensorView(); }

// "bf16" | "fp8-blockwise" | "fp8-tensor" | "fp8-tensor-hybrid" (moerail/recipe.h); anything else throws naming the
// argument.
inline Recipe recipe_of(const std::string& s) {
  for (Recipe r : {Recipe::BF16, Recipe::Fp8Blockwise, Recipe::Fp8Tensor, Recipe::Fp8TensorHybrid})
    if (s == name_of(r)) return r;
  fail("moerail", "recipe = '", s, "' (expected 'bf16', 'fp8-blockwise', 'fp8-tensor' or 'fp8-tensor-hybrid')");
}

inline Fp8WeightGrads fp8_weight_grads_of(const std::string& s) {
  for (Fp8WeightGrads w : {Fp8WeightGrads::Fp8, Fp8WeightGrads::BF16})
    if (s == name_of(w)) return w;
  fail("moerail", "fp8_weight_grads = '", s, "' (expected 'fp8' or 'bf16')");
}

// A view that must be CPU memory (the reference ops read it on the host).
inline TensorView host_view(const OptArray& a, const char* name) {
  TensorView t = view(a, name);
  if (t.defined() && !t.device().is_host())
    fail("moerail", name, " is on ", t.device().str(), "; the reference backend runs on the CPU");
  return t;
}

#if MOERAIL_WITH_CUDA
inline cudaStream_t stream_of(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
#endif

}  // namespace moerail::py
