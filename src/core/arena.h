// src/core/arena.h — typed views carved one after another out of one device allocation (256-byte aligned
// pieces): run a layout once with a null base to size the allocation, then over the allocation for the views.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "moerail/tensor.h"

namespace moerail {

struct Arena {
  char* base = nullptr;  // null: a dry run (take() returns undefined views, `used` counts the bytes)
  std::size_t used = 0;
  int device = 0;
  TensorView take(DType dtype, std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    void* p = base ? base + used : nullptr;
    used += (std::size_t(n) * dtype_size(dtype) + 255) / 256 * 256;
    return base ? TensorView(p, dtype, shape, Device::cuda(device)) : TensorView();
  }
};

}  // namespace moerail
