// tests/common/compare.h — shared pieces of the one-GPU tests: host views of the first rows of a buffer,
// "untouched" checks of poisoned rows, and a precision-derived tolerance for sums, printing the first mismatches
// with their indices.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "common/device_tensor.h"
#include "moerail/reference/host.h"

namespace moerail::testing {

// A host view of the first `rows` rows of a [*, H] host tensor (or [*] when H == 0).
inline TensorView rows_of(const ref::HostTensor& t, std::int64_t rows, std::int64_t H) {
  if (H == 0) return TensorView(t.view().data(), t.dtype(), {rows});
  return TensorView(t.view().data(), t.dtype(), {rows, H});
}

// Elements [from, to) still hold the poison (all bytes 0xff): the op did not touch them.
inline void expect_untouched(const ref::HostTensor& gpu, std::int64_t from, std::int64_t to, const std::string& what) {
  const std::size_t s = dtype_size(gpu.dtype());
  const auto* p = static_cast<const unsigned char*>(gpu.view().data());
  for (std::int64_t i = from; i < to; ++i)
    for (std::size_t b = 0; b < s; ++b)
      if (p[std::size_t(i) * s + b] != 0xff) {
        ADD_FAILURE() << what << ": element " << i << " was written but lies beyond the rows the op may write";
        return;
      }
}

// |gpu - ref| <= atol + rtol * |ref| on elements [0, n); rtol from the dtype (one bf16/f16 ulp, or fp32 sums).
inline void expect_close(const ref::HostTensor& gpu, const ref::HostTensor& ref, std::int64_t n, std::int64_t H,
                         const std::string& what, double atol = 1e-5) {
  const DType d = gpu.dtype();
  const double rtol = d == DType::BF16 ? 1.0 / 128 : d == DType::F16 ? 1.0 / 1024 : 2e-6;
  int bad = 0;
  for (std::int64_t i = 0; i < n && bad < 5; ++i) {
    const double g = gpu.f(i), r = ref.f(i);
    if (!(std::fabs(g - r) <= atol + rtol * std::fabs(r))) {
      ADD_FAILURE() << what << "[" << (H ? i / H : i) << "," << (H ? i % H : 0) << "] = " << g
                    << " but the reference has " << r << " (tolerance " << atol + rtol * std::fabs(r) << ")";
      ++bad;
    }
  }
}

}  // namespace moerail::testing
