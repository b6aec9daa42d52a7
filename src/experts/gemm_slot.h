// src/experts/gemm_slot.h — the device memory of grouped GEMMs, shared by the expert MLP and the layer's gate
// linear: a bump allocator over one allocation, and one GEMM's kernel, per-group argument arrays and workspace.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "experts/grouped/grouped_gemm.h"

namespace moerail::experts {

// Bump allocator over one device allocation (256-byte aligned pieces); run once with base = nullptr to size it.
struct Carver {
  static constexpr std::size_t kAlign = 256;
  char* base = nullptr;
  std::size_t used = 0;
  template <typename T>
  T* take(std::size_t count) {
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += (count * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    return p;
  }
};

// One grouped GEMM: its kernel, its `groups`-entry argument arrays and its workspace (carved by carve()).
struct GemmSlot {
  const char* name = "";
  GemmLayout layout = GemmLayout::TN;
  GemmTile tile = GemmTile::Coop128x256;
  std::int64_t ld_a = 0, ld_b = 0, ld_d = 0;
  std::unique_ptr<GroupedGemm> gemm;
  GroupedGemmArrays arrays;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;

  void carve(Carver& c, int groups) {
    arrays.groups = groups;
    arrays.shapes = c.take<GroupShape>(std::size_t(groups));
    arrays.ptr_a = c.take<const void*>(std::size_t(groups));
    arrays.ptr_b = c.take<const void*>(std::size_t(groups));
    arrays.ptr_d = c.take<void*>(std::size_t(groups));
    arrays.ld_a = c.take<std::int64_t>(std::size_t(groups));
    arrays.ld_b = c.take<std::int64_t>(std::size_t(groups));
    arrays.ld_d = c.take<std::int64_t>(std::size_t(groups));
    workspace = c.take<char>(std::max<std::size_t>(workspace_bytes, 1));
  }
};

}  // namespace moerail::experts
