// src/experts/grouped_mlp_impl.h — GroupedMlp's private state (GroupedMlp::Impl) and what its passes share: the
// per-pass argument arrays, the argument checks and the operand helpers of the setup kernel. Used by grouped_mlp.cpp
// (constructor, forward) and grouped_mlp_backward.cpp (backward, weight gradients).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/cuda_check.h"
#include "core/sync.h"
#include "experts/contig/contig_gemm.h"
#include "experts/elementwise.h"
#include "experts/gemm_slot.h"
#include "experts/setup.h"
#include "moerail/error.h"
#include "moerail/experts.h"

namespace moerail {
namespace experts {

inline constexpr std::int64_t kBf16 = 2;

static_assert(experts::PerExpertTables::kMax == kMaxPerExpertTensors);

struct PassSlots {
  std::int64_t* offsets = nullptr;  // [regions][L + 1] (regions > 1: chunked weight gradients)
  // Per-expert pointers: [0], [1] the pass's bias (gradient) tensors; forward with the fused activation also
  // [2] act rows and [3] probs rows of each segment (FC1's epilogue reads them).
  const void** ptrs[4] = {nullptr, nullptr, nullptr, nullptr};

  void carve(Carver& c, int L, int regions = 1) {
    offsets = c.take<std::int64_t>(std::size_t(regions) * (std::size_t(L) + 1));
    for (const void**& p : ptrs) p = c.take<const void*>(std::size_t(L));
  }
};

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// ---- argument checks ---------------------------------------------------------------------------------------

struct Checker {
  std::string_view op;
  Device device;

  void view(std::string_view name, const TensorView& t, DType dtype, std::initializer_list<std::int64_t> shape) const {
    if (!t.defined()) fail(op, name, " is absent but required");
    check_device(op, name, t, device);
    check_dtype(op, name, t, {dtype});
    check_shape(op, name, t, shape);
    if (!aligned16(t.data()))
      fail(op, name, " at ", t.data(), " is not 16-byte aligned (TMA and vector loads need 16-byte rows)");
  }

  void optional(std::string_view name, const TensorView& t, DType dtype,
                std::initializer_list<std::int64_t> shape) const {
    if (t.defined()) view(name, t, dtype, shape);
  }

  // counts [L], or [regions, L] for regions > 0 (chunked weight gradients).
  void counts(const TensorView& t, std::int64_t L, std::int64_t regions = 0) const {
    if (!t.defined()) fail(op, "counts is absent but required");
    check_device(op, "counts", t, device);
    check_dtype(op, "counts", t, {DType::I32, DType::I64});
    if (regions > 0)
      check_shape(op, "counts", t, {regions, L});
    else
      check_shape(op, "counts", t, {L});
  }

  // One parameter in grouped or per-expert form; exactly one form when `required`, none when not.
  // Returns true for the per-expert form.
  bool param(std::string_view name, const TensorView& grouped, std::span<const TensorView> list, bool required,
             std::string_view flag, std::int64_t L, std::initializer_list<std::int64_t> slice,
             DType dtype = DType::BF16) const {
    if (!required) {
      if (grouped.defined() || !list.empty())
        fail(op, name, " is given but cfg.", flag, " = false (expected no ", name, ")");
      return false;
    }
    if (grouped.defined() && !list.empty())
      fail(op, name, " is given both as a grouped tensor and as per-expert tensors (expected one form)");
    if (grouped.defined()) {
      std::vector<std::int64_t> shape{L};
      shape.insert(shape.end(), slice.begin(), slice.end());
      if (shape.size() == 2)
        view(name, grouped, dtype, {shape[0], shape[1]});
      else
        view(name, grouped, dtype, {shape[0], shape[1], shape[2]});
      return false;
    }
    if (list.empty()) fail(op, name, " is absent but required", flag.empty() ? "" : " (cfg.", flag, flag.empty() ? "" : ")");
    if (std::int64_t(list.size()) != L)
      fail(op, name, "_experts has ", list.size(), " tensors but L = ", L, " local experts were expected");
    if (L > kMaxPerExpertTensors)
      fail(op, name, "_experts has ", L, " tensors but per-expert weights support at most ", kMaxPerExpertTensors,
           " (use one grouped tensor; stack_grouped_weights converts)");
    for (std::size_t e = 0; e < list.size(); ++e) view(std::string(name) + "_experts[" + std::to_string(e) + "]",
                                                       list[e], dtype, slice);
    return true;
  }
};

inline void fill_table(experts::PerExpertTables& t, int slot, std::span<const TensorView> list) {
  for (std::size_t e = 0; e < list.size(); ++e) t.p[slot][e] = list[e].data();
}

inline experts::OperandSetup rows_of(const TensorView& t, std::int64_t width) {
  return {static_cast<const char*>(t.data()), width * kBf16, 0, -1};
}
inline experts::OperandSetup expert_of(const TensorView& grouped, std::int64_t slice_elems, bool per_expert,
                                       int table, std::int64_t elem_bytes = kBf16) {
  if (per_expert) return {nullptr, 0, 0, table};
  return {static_cast<const char*>(grouped.data()), 0, slice_elems * elem_bytes, -1};
}

}  // namespace experts

using experts::aligned16;
using experts::Carver;
using experts::Checker;
using experts::expert_of;
using experts::fill_table;
using experts::GemmSlot;
using experts::GemmTile;
using experts::kBf16;
using experts::kRagged;
using experts::PassSlots;
using experts::rows_of;

// ---- Impl ------------------------------------------------------------------------------------------------------

struct GroupedMlp::Impl {
  MoeConfig cfg;
  int device = 0;
  int L = 0;
  std::int64_t H = 0, F = 0, F1 = 0;
  GemmSlot fc1, fc2, dgrad2, dgrad1, wgrad2, wgrad1;
  bool fused_activation = false;  // FC1's epilogue computes the activation (no separate pass)
  PassSlots fwd, bwd, wgr;
  // MlpOptions::contiguous_gemms: the contiguous TN (FC1, FC2) and NN (dgrads) GEMMs and the tile tables of the
  // forward and backward passes.
  std::unique_ptr<experts::ContigGemm> contig_tn, contig_nn, contig_tn_glu;  // _glu: FC1 with the activation
  // MlpOptions::activation_backward: FC2's contiguous dgrad with the activation backward in its epilogue (null when
  // the pass computes it).
  std::unique_ptr<experts::ContigGemm> contig_nn_act_bwd;
  // MlpOptions::contiguous_gemms: the weight gradients as one GEMM over all experts' rows (needs no tile table),
  // for the slots that run so (ping-pong tile; On, or Auto's rule: contig_wgrad_auto).
  std::unique_ptr<experts::ContigWgrad> contig_wgrad;
  bool contig_wgrad2 = false, contig_wgrad1 = false;
  // The contiguous weight gradient's walk (the wgrad setup's): [L] places and their segments, and [3] the dynamic
  // walk's counters and the k-tiles of all places (ContigWgradCall::walk; both weight gradients).
  experts::ContigWgradPlace* wgrad_places = nullptr;
  experts::ContigWgradSegment* wgrad_segments = nullptr;
  int* wgrad_walk = nullptr;
  experts::ContigTiles fwd_tiles, bwd_tiles;
  DeviceBuffer memory;
  std::unique_ptr<experts::PerExpertTables> tables = std::make_unique<experts::PerExpertTables>();

  // The memory goes back to the allocator (a framework's pool may hand it out at once): no kernel may still read
  // these arrays. Destructors do not throw.
  ~Impl() {
    if (memory.data()) cuda::synchronize_device(device);
  }

  std::array<GemmSlot*, 6> gemms() { return {&fc1, &fc2, &dgrad2, &dgrad1, &wgrad2, &wgrad1}; }

  experts::ActShape act_shape() const { return experts::act_shape_of(cfg); }

  void check_current_device(std::string_view op) const {
    const int cur = cuda::current_device();
    if (cur != device)
      fail(op, "the current device is cuda:", cur, " but this GroupedMlp was set up on cuda:", device);
  }

  // Checks what every pass shares and returns rows (counts: Checker::counts with `regions`).
  std::int64_t check_common(const Checker& c, const TensorView& x, const TensorView& probs, const TensorView& counts,
                            std::int64_t regions = 0) const {
    if (!x.defined()) fail(c.op, "x is absent but required");
    const std::int64_t rows = x.ndim() == 2 ? x.size(0) : -1;
    c.view("x", x, DType::BF16, {-1, H});
    if (rows >= (std::int64_t(1) << 31)) fail(c.op, "x has ", rows, " rows but at most 2^31 - 1 are supported");
    c.counts(counts, L, regions);
    if (cfg.prob_mode == ProbMode::InActivation) {
      if (!probs.defined()) fail(c.op, "probs is absent but cfg.prob_mode = in-activation needs them");
      c.view("probs", probs, DType::F32, {rows});
    } else {
      c.optional("probs", probs, DType::F32, {rows});
    }
    return rows;
  }

  // The tile table for a call over `rows` rows, or none (contiguous GEMMs off, per-expert weights, no rows, or
  // more rows than the table was sized for).
  experts::ContigTiles contig_tiles(const experts::ContigTiles& t, std::int64_t rows, bool per_expert) const {
    if (!contig_tn || per_expert || rows <= 0 || experts::contig_max_tiles(rows, L) > t.max_tiles) return {};
    return t;
  }

  // Whether ragged-M slot s (FC1, FC2, a dgrad) runs contiguously where a call has a tile table: only the ping-pong
  // tile exists contiguous, so a slot given the cooperative tile (tiles.h, MlpOptions) stays grouped.
  bool contiguous(const GemmSlot& s) const { return contig_tn && s.tile == GemmTile::Ping128x128; }
  // Whether weight-gradient slot s (wgrad2 or wgrad1) runs contiguously for a buffer of `rows` rows (more rows than
  // the kernel's 32-bit coordinates take run grouped).
  bool contiguous_wgrad(const GemmSlot& s, std::int64_t rows) const {
    return rows >= 1 && rows <= experts::kContigWgradMaxRows && contiguous_wgrad_slot(s);
  }
  // Whether the slot was set up to run contiguously (wgrad2 or wgrad1; the ragged-M slots: never).
  bool contiguous_wgrad_slot(const GemmSlot& s) const {
    return &s == &wgrad2 ? contig_wgrad2 : &s == &wgrad1 && contig_wgrad1;
  }

  const float* probs_ptr(const TensorView& probs) const {
    return cfg.prob_mode == ProbMode::InActivation ? probs.as<const float>() : nullptr;
  }

  experts::SetupParams base_setup(const TensorView& counts, std::int64_t rows, std::int64_t* offsets) const {
    experts::SetupParams p;
    p.counts = counts.data();
    p.counts_i64 = counts.dtype() == DType::I64;
    p.L = L;
    p.rows = rows;
    p.offsets = offsets;
    return p;
  }
};

}  // namespace moerail
