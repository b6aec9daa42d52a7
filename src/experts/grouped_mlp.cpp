// src/experts/grouped_mlp.cpp — host launcher of the grouped expert MLP (moerail/experts.h): argument checks, the
// device memory of the per-expert argument arrays, CUTLASS setup, and the launch sequence of each pass.
//
// Forward     setup -> FC1 (h1 = x W1^T) -> activation (h1 += b1; act = act(h1) * p) -> FC2 (y = act W2^T)
//             [-> y += p b2]
// Backward    setup -> FC2 dgrad (d_act = dy W2) -> activation backward (d_h1, d_probs) -> FC1 dgrad
//             (dx = d_h1 W1) [-> backward_dw]
// Backward dW setup -> zero empty experts' dW -> dW2 = dy^T act -> dW1 = d_h1^T x [-> db2, db1]
// Each pass has its own argument arrays (so a delayed wgrad never races a forward's setup) and each GEMM its own
// CUTLASS workspace, all carved from one allocation made by the constructor.
#include "moerail/experts.h"

#include <algorithm>
#include <array>
#include <sstream>
#include <vector>

#include "core/cuda_check.h"
#include "core/log.h"
#include "core/sync.h"
#include "experts/contig/contig_gemm.h"
#include "experts/elementwise.h"
#include "experts/gemm_slot.h"
#include "experts/grouped/grouped_gemm.h"
#include "experts/mlp_tuning.h"
#include "experts/setup.h"
#include "experts/tiles.h"
#include "moerail/error.h"

namespace moerail {

using experts::GemmLayout;
using experts::GemmTile;
using experts::kRagged;
using experts::MlpGemmTile;
using experts::kMlpStageActivation;
using experts::kMlpStageAll;
using experts::kMlpStageFc1;
using experts::kMlpStageFc2;
using experts::kMlpStageSetup;

namespace {

constexpr std::int64_t kBf16 = 2;
static_assert(experts::PerExpertTables::kMax == kMaxPerExpertTensors);

using experts::Carver;
using experts::GemmSlot;

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

// Whether FC1's epilogue on `tile` can compute the activation (glu_epilogue.cuh): a GLU whose halves are
// interleaved in blocks of g columns, g a multiple of 8 with 2g dividing the columns the epilogue stages at a time
// (128 on the ping-pong tile, 64 on the cooperative one), so that every tile and round holds whole gate/linear pairs.
bool glu_epilogue_fits(const MoeConfig& cfg, GemmTile tile) {
  const std::int64_t g = cfg.glu_block;
  return is_glu(cfg.activation) && cfg.glu_layout == GluLayout::Interleaved && g > 0 && g % 8 == 0 &&
         experts::glu_round_columns(tile) % (2 * g) == 0;
}

// MlpOptions::activation -> fused or not, FC1 on `tile` when fused; throws when Fused is asked for where it cannot
// run.
bool fuse_activation(const MoeConfig& cfg, const MlpOptions& o, GemmTile tile) {
  if (o.activation == MlpActivation::Separate) return false;
  // Auto fuses wherever it can: on every benchmark shape FC1 with the activation in its epilogue costs less over
  // the plain FC1 than the separate pass does (docs/experts.md).
  if (o.activation == MlpActivation::Auto) return glu_epilogue_fits(cfg, tile);
  if (!glu_epilogue_fits(cfg, tile))
    fail_with(ErrorCode::Unsupported, "GroupedMlp", "options.activation = Fused needs a GLU activation with "
              "glu_layout = interleaved and glu_block in {8, 16, 32, 64} ({8, 16, 32} with tuning fc1 = "
              "Cooperative128x256); got activation ", name_of(cfg.activation), ", glu_layout ",
              cfg.glu_layout == GluLayout::Interleaved ? "interleaved" : "concatenated", ", glu_block ",
              cfg.glu_block, ", FC1 tile ", name_of(tile));
  return true;
}

// MlpOptions::activation_backward: whether FC2's contiguous dgrad computes the activation backward in its epilogue.
// `contiguous_dgrad2`: FC2's dgrad runs contiguously (Impl::contiguous).
bool fuse_activation_backward(const MoeConfig& cfg, const MlpOptions& o, bool contiguous_dgrad2,
                              const experts::ActShape& shape) {
  if (o.activation_backward == MlpActivation::Separate) return false;
  const bool b2_term = cfg.fc2_bias && cfg.prob_mode == ProbMode::InActivation;  // the pass adds <b2, dy> to d_probs
  const bool can_fuse = contiguous_dgrad2 && !b2_term && experts::contig_act_bwd_supports(shape);
  if (o.activation_backward == MlpActivation::Auto) return can_fuse && cfg.hidden >= experts::kActBwdAutoMinK;
  if (can_fuse) return true;
  fail_with(ErrorCode::Unsupported, "GroupedMlp", "options.activation_backward = Fused needs FC2's dgrad to run "
            "contiguously (contiguous_gemms on, dgrad_fc2 on the ping-pong tile), no FC2 bias with probs in the "
            "activation, and a tile's gate/linear columns in two 128-column segments (concatenated halves, or "
            "glu_block dividing 128); got contiguous FC2 dgrad ", contiguous_dgrad2 ? "yes" : "no", ", fc2_bias ",
            cfg.fc2_bias ? "on" : "off", ", glu_layout ",
            cfg.glu_layout == GluLayout::Interleaved ? "interleaved" : "concatenated", ", glu_block ", cfg.glu_block);
}

GemmTile to_tile(MlpGemmTile t, GemmTile automatic) {
  switch (t) {
    case MlpGemmTile::Auto: return automatic;
    case MlpGemmTile::Cooperative128x256: return GemmTile::Coop128x256;
    case MlpGemmTile::Pingpong128x128: return GemmTile::Ping128x128;
  }
  return automatic;
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

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

void fill_table(experts::PerExpertTables& t, int slot, std::span<const TensorView> list) {
  for (std::size_t e = 0; e < list.size(); ++e) t.p[slot][e] = list[e].data();
}

}  // namespace

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

  experts::ActShape act_shape() const {
    experts::ActShape s;
    s.kind = cfg.activation;
    s.layout = cfg.glu_layout;
    s.g = int(cfg.glu_block);
    s.F = int(F);
    s.F1 = int(F1);
    s.alpha = float(cfg.quick_geglu_alpha);
    s.limit = float(cfg.quick_geglu_limit);
    s.offset = float(cfg.quick_geglu_offset);
    return s;
  }

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

static experts::OperandSetup rows_of(const TensorView& t, std::int64_t width) {
  return {static_cast<const char*>(t.data()), width * kBf16, 0, -1};
}
static experts::OperandSetup expert_of(const TensorView& grouped, std::int64_t slice_elems, bool per_expert,
                                       int table, std::int64_t elem_bytes = kBf16) {
  if (per_expert) return {nullptr, 0, 0, table};
  return {static_cast<const char*>(grouped.data()), 0, slice_elems * elem_bytes, -1};
}

GroupedMlp::GroupedMlp(const MoeConfig& cfg, const MlpOptions& options) : impl_(std::make_unique<Impl>()) {
  constexpr std::string_view op = "GroupedMlp";
  Impl& m = *impl_;
  cfg.validate();
  m.cfg = cfg;
  m.H = cfg.hidden;
  m.F = cfg.ffn_hidden;
  m.F1 = cfg.fc1_out();
  const std::int64_t L = cfg.local_experts();

  ProblemList problems{std::string(op)};
  if (cfg.dtype != DType::BF16)
    problems.add("cfg.dtype = ", dtype_name(cfg.dtype), " but the GPU expert MLP supports bf16 only");
  if (m.H % 8 != 0) problems.add("cfg.hidden = ", m.H, " is not a multiple of 8 (16-byte TMA rows of bf16)");
  if (m.F % 8 != 0) problems.add("cfg.ffn_hidden = ", m.F, " is not a multiple of 8 (16-byte TMA rows of bf16)");
  if (m.F1 >= (std::int64_t(1) << 30) || m.H >= (std::int64_t(1) << 30))
    problems.add("cfg.hidden = ", m.H, " / fc1 width ", m.F1, " exceed the 32-bit GEMM sizes");
  if (L < 1 || L > kMaxLocalExperts)
    problems.add("cfg.local_experts() = ", L, " but 1 <= L <= ", kMaxLocalExperts, " is supported");
  if (options.sms < 0) problems.add("options.sms = ", options.sms, " but it must be 0 (every SM) or positive");
  problems.throw_if_any();
  m.L = int(L);

  m.device = cuda::current_device();
  int major = 0, minor = 0;
  MOERAIL_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, m.device));
  MOERAIL_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, m.device));
  if (major != 9 || minor != 0)
    fail_with(ErrorCode::Unsupported, op, "cuda:", m.device, " is sm_", major, minor,
              " but the grouped expert GEMMs are built for sm_90a (H100/H200) only");

  // Kernel choice per GEMM (tiles.h), from the average rows per expert.
  const std::int64_t rows_hint = options.rows_hint > 0 ? options.rows_hint : cfg.rows_per_rank();
  const std::int64_t avg = std::max<std::int64_t>(1, rows_hint / L);
  const std::int64_t H = m.H, F = m.F, F1 = m.F1;
  const bool contiguous = options.contiguous_gemms == MlpContiguous::On ||
                          (options.contiguous_gemms == MlpContiguous::Auto && m.L >= experts::kContigAutoExperts);
  // Whether a GEMM of [mm, nn] outputs runs contiguously when it has the ping-pong tile (the contiguous kernels'
  // only one); the weight gradients under Auto only where contig_wgrad_auto says so.
  auto contiguous_on_ping = [&](GemmLayout layout, std::int64_t mm, std::int64_t nn) {
    if (!contiguous) return false;
    return layout != GemmLayout::Wgrad || options.contiguous_gemms == MlpContiguous::On ||
           experts::contig_wgrad_auto(mm, nn, cuda::sm_count());
  };
  // A GPU of less memory bandwidth gives the GEMMs that run grouped the cooperative tile, and runs some that would run
  // contiguously grouped on it (tiles.h).
  const bool low_bandwidth = [] {
    const double bw = cuda::memory_bandwidth();
    return bw > 0 && bw < experts::kLowMemoryBandwidth;
  }();
  auto setup_slot = [&](GemmSlot& s, const char* name, GemmLayout layout, MlpGemmTile choice, std::int64_t mm,
                        std::int64_t nn, std::int64_t kk, std::int64_t lda, std::int64_t ldb, std::int64_t ldd) {
    s.name = name;
    s.layout = layout;
    const bool grouped_low =
        low_bandwidth && (!contiguous_on_ping(layout, mm, nn) ||
                          (options.contiguous_gemms == MlpContiguous::Auto &&
                           experts::low_bandwidth_prefers_cooperative(layout, nn, kk)));
    s.tile = to_tile(choice, experts::choose_tile(layout, mm, nn, kk, grouped_low));
    s.ld_a = lda;
    s.ld_b = ldb;
    s.ld_d = ldd;
  };
  const experts::MlpTuning tuning = options.tuning ? *options.tuning : experts::MlpTuning{};
  //                    name            layout            override           M    N   K    lda ldb ldd
  setup_slot(m.fc1, "experts fc1", GemmLayout::TN, tuning.fc1, avg, F1, H, H, H, F1);
  setup_slot(m.fc2, "experts fc2", GemmLayout::TN, tuning.fc2, avg, H, F, F, F, H);
  setup_slot(m.dgrad2, "experts fc2 dgrad", GemmLayout::NN, tuning.dgrad_fc2, avg, F, H, H, F, F);
  setup_slot(m.dgrad1, "experts fc1 dgrad", GemmLayout::NN, tuning.dgrad_fc1, avg, H, F1, F1, H, H);
  setup_slot(m.wgrad2, "experts fc2 wgrad", GemmLayout::Wgrad, tuning.wgrad_fc2, H, F, avg, H, F, F);
  setup_slot(m.wgrad1, "experts fc1 wgrad", GemmLayout::Wgrad, tuning.wgrad_fc1, F1, H, avg, F1, H, H);

  const GemmTile fused_tile =
      tuning.fc1 == MlpGemmTile::Auto
          ? experts::fused_fc1_tile(m.fc1.tile, contiguous_on_ping(GemmLayout::TN, avg, F1), cfg.glu_block)
          : m.fc1.tile;
  m.fused_activation = fuse_activation(cfg, options, fused_tile);
  if (m.fused_activation) m.fc1.tile = fused_tile;
  for (GemmSlot* s : m.gemms()) {
    s->gemm = s == &m.fc1 && m.fused_activation ? experts::make_grouped_gemm_glu(s->tile)
                                                : experts::make_grouped_gemm(s->layout, s->tile);
    s->workspace_bytes = s->gemm->workspace_bytes(m.L);
  }

  // One allocation for everything, sized by a dry run of the same carving.
  auto carve_all = [&](Carver& c) {
    for (GemmSlot* s : m.gemms()) s->carve(c, m.L);
    m.fwd.carve(c, m.L);
    m.bwd.carve(c, m.L);
    m.wgr.carve(c, m.L, int(kMaxMlpChunks));
    m.wgrad_places = c.take<experts::ContigWgradPlace>(std::size_t(m.L));
    m.wgrad_segments = c.take<experts::ContigWgradSegment>(std::size_t(m.L));
    m.wgrad_walk = c.take<int>(3);
    if (contiguous) {
      const std::int64_t rows_max = std::max(cfg.rows_per_rank(), options.rows_hint);
      const int tiles = int(experts::contig_max_tiles(rows_max, m.L));
      for (experts::ContigTiles* t : {&m.fwd_tiles, &m.bwd_tiles}) {
        t->max_tiles = tiles;
        t->tile_group = c.take<int>(std::size_t(tiles));
        t->tile_row = c.take<int>(std::size_t(tiles));
        t->tile_rows = c.take<int>(std::size_t(tiles));
        t->tile_band = c.take<int>(std::size_t(tiles));
        t->num_tiles = c.take<int>(1);
        t->walk = c.take<int>(2);
      }
    }
  };
  Carver dry;
  carve_all(dry);
  m.memory = DeviceBuffer(options.allocator ? *options.allocator : cuda_allocator(), dry.used);
  MOERAIL_CUDA_CHECK(cudaMemset(m.memory.data(), 0, dry.used));
  Carver real{static_cast<char*>(m.memory.data())};
  carve_all(real);

  experts::GluEpilogue glu;
  if (m.fused_activation) {
    glu.act = const_cast<void* const*>(m.fwd.ptrs[2]);
    glu.probs = cfg.prob_mode == ProbMode::InActivation ? reinterpret_cast<const float* const*>(m.fwd.ptrs[3])
                                                        : nullptr;
    glu.bias = cfg.fc1_bias ? m.fwd.ptrs[0] : nullptr;
    glu.shape = m.act_shape();
    m.fc1.gemm->set_glu_epilogue(glu);
  }
  for (GemmSlot* s : m.gemms())
    s->gemm->initialize(s->arrays, s->ld_a, s->ld_b, s->ld_d, s->workspace, s->name, options.sms);
  if (contiguous) {
    m.contig_tn = experts::make_contig_gemm_tn();
    m.contig_nn = experts::make_contig_gemm_nn();
    m.contig_tn->initialize("experts contiguous tn", options.sms);
    m.contig_nn->initialize("experts contiguous nn", options.sms);
    if (m.fused_activation && m.fc1.tile == GemmTile::Ping128x128) {  // the tile of the contiguous kernels
      // the contiguous epilogue takes act and probs per call, the bias table from here
      m.contig_tn_glu = experts::make_contig_gemm_tn_glu();
      m.contig_tn_glu->initialize("experts contiguous tn (activation)", options.sms);
      m.contig_tn_glu->set_glu_epilogue(glu);
    }
  }
  auto wgrad_contiguous = [&](const GemmSlot& s, std::int64_t M, std::int64_t N) {
    return s.tile == GemmTile::Ping128x128 && contiguous_on_ping(GemmLayout::Wgrad, M, N);
  };
  m.contig_wgrad2 = wgrad_contiguous(m.wgrad2, H, F);
  m.contig_wgrad1 = wgrad_contiguous(m.wgrad1, F1, H);
  m.contig_wgrad = experts::make_contig_gemm_wgrad();  // also what chunked weight gradients run on
  m.contig_wgrad->initialize("experts contiguous wgrad", options.sms);
  if (fuse_activation_backward(cfg, options, m.contiguous(m.dgrad2), m.act_shape())) {
    m.contig_nn_act_bwd = experts::make_contig_gemm_nn_act_bwd();
    m.contig_nn_act_bwd->initialize("experts contiguous nn (activation backward)", options.sms);
  }
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
  log::info("GroupedMlp: ", cfg.summary(), " L=", m.L, " rows/expert~", avg, " ", describe(), " (", dry.used,
            " bytes of argument arrays and workspaces)");
}

GroupedMlp::~GroupedMlp() = default;

const MoeConfig& GroupedMlp::config() const { return impl_->cfg; }

bool GroupedMlp::activation_fused() const { return impl_->fused_activation; }

std::size_t GroupedMlp::device_bytes() const { return impl_->memory.bytes(); }

std::string GroupedMlp::describe() const {
  std::ostringstream os;
  const char* names[] = {"fc1", "fc2", "dgrad_fc2", "dgrad_fc1", "wgrad_fc2", "wgrad_fc1"};
  int i = 0;
  for (GemmSlot* s : impl_->gemms()) {
    os << (i ? " " : "") << names[i] << "=" << experts::name_of(s->tile);
    if (i == 0 && impl_->fused_activation) os << "+act";
    if (i == 2 && impl_->contig_nn_act_bwd) os << "+actbwd";
    if (i < 4 ? impl_->contiguous(*s) : impl_->contiguous_wgrad_slot(*s)) os << "+contig";
    ++i;
  }
  return os.str();
}

std::size_t mlp_backward_workspace_bytes(const MoeConfig& cfg, std::int64_t rows) {
  // d_act [rows, F] bf16 at offset 0.
  return std::size_t(std::max<std::int64_t>(rows, 0)) * std::size_t(cfg.ffn_hidden) * std::size_t(kBf16);
}

std::size_t GroupedMlp::backward_workspace_bytes(std::int64_t rows) const {
  return mlp_backward_workspace_bytes(impl_->cfg, rows);
}

// ---- forward ---------------------------------------------------------------------------------------------------

void GroupedMlp::forward(const MlpForwardArgs& a, cudaStream_t stream) { forward_stages(a, kMlpStageAll, stream); }

void GroupedMlp::forward_stages(const MlpForwardArgs& a, unsigned stages, cudaStream_t stream) {
  Impl& m = *impl_;
  const Checker c{"experts forward", Device::cuda(m.device)};
  m.check_current_device(c.op);
  const std::int64_t rows = m.check_common(c, a.x, a.probs, a.counts);
  const std::int64_t H = m.H, F = m.F, F1 = m.F1, L = m.L;
  const MlpWeights& w = a.weights;
  const bool pe_w1 = c.param("weights.w1", w.w1, w.w1_experts, true, "", L, {F1, H});
  const bool pe_w2 = c.param("weights.w2", w.w2, w.w2_experts, true, "", L, {H, F});
  const bool pe_b1 = c.param("weights.b1", w.b1, w.b1_experts, m.cfg.fc1_bias, "fc1_bias", L, {F1});
  const bool pe_b2 = c.param("weights.b2", w.b2, w.b2_experts, m.cfg.fc2_bias, "fc2_bias", L, {H});
  c.view("y", a.y, DType::BF16, {rows, H});
  c.view("h1", a.h1, DType::BF16, {rows, F1});
  c.view("act", a.act, DType::BF16, {rows, F});
  if (stages == 0 || (stages & ~unsigned(kMlpStageAll)) != 0)
    fail(c.op, "stages = ", stages, " but a non-empty subset of kMlpStageAll was expected");
  const bool per_expert = pe_w1 || pe_w2 || pe_b1 || pe_b2;
  const experts::ContigTiles tiles = m.contig_tiles(m.fwd_tiles, rows, pe_w1 || pe_w2);
  const bool contig_fc1 = tiles.tile_group && m.contiguous(m.fc1), contig_fc2 = tiles.tile_group && m.contiguous(m.fc2);

  if (stages & kMlpStageSetup) {
    experts::SetupParams p = m.base_setup(a.counts, rows, m.fwd.offsets);
    p.num_gemms = 2;
    p.gemm[0] = {m.fc1.arrays, rows_of(a.x, H), expert_of(w.w1, F1 * H, pe_w1, 0), rows_of(a.h1, F1), kRagged,
                 int(F1), int(H)};
    p.gemm[1] = {m.fc2.arrays, rows_of(a.act, F), expert_of(w.w2, H * F, pe_w2, 1), rows_of(a.y, H), kRagged,
                 int(H), int(F)};
    p.contig = tiles;
    p.gemm[0].contig = contig_fc1;
    p.gemm[1].contig = contig_fc2;
    if (m.cfg.fc1_bias) p.ptrs[0] = {m.fwd.ptrs[0], expert_of(w.b1, F1, pe_b1, 2)};
    if (m.cfg.fc2_bias) p.ptrs[1] = {m.fwd.ptrs[1], expert_of(w.b2, H, pe_b2, 3)};
    if (m.fused_activation) {
      p.ptrs[2] = {m.fwd.ptrs[2], rows_of(a.act, F)};
      if (const float* probs = m.probs_ptr(a.probs))
        p.ptrs[3] = {m.fwd.ptrs[3], {reinterpret_cast<const char*>(probs), std::int64_t(sizeof(float)), 0, -1}};
    }
    if (per_expert) {
      fill_table(*m.tables, 0, w.w1_experts);
      fill_table(*m.tables, 1, w.w2_experts);
      fill_table(*m.tables, 2, w.b1_experts);
      fill_table(*m.tables, 3, w.b2_experts);
    }
    experts::launch_setup(p, per_expert ? m.tables.get() : nullptr, stream);
  }
  if (stages & kMlpStageFc1) {
    if (contig_fc1)
      (m.fused_activation ? m.contig_tn_glu : m.contig_tn)
          ->run({.a = a.x.data(), .b = w.w1.data(), .d = a.h1.data(), .rows = rows, .n = F1, .k = H, .lda = H,
                 .ldb = H, .ldd = F1, .b_group_stride = F1 * H, .groups = m.L, .tiles = tiles,
                 .act = a.act.data(), .probs = m.probs_ptr(a.probs)},
                stream, m.fc1.name);
    m.fc1.gemm->run(stream);
  }
  if ((stages & kMlpStageActivation) && !m.fused_activation) {  // fused: FC1 has done it
    experts::ActForwardParams p;
    p.shape = m.act_shape();
    p.h1 = a.h1.data();
    p.act = a.act.data();
    p.probs = m.probs_ptr(a.probs);
    p.b1 = m.cfg.fc1_bias ? m.fwd.ptrs[0] : nullptr;
    p.offsets = m.fwd.offsets;
    p.L = m.L;
    experts::launch_activation_forward(p, rows, stream);
  }
  if (stages & kMlpStageFc2) {
    if (contig_fc2)
      m.contig_tn->run({.a = a.act.data(), .b = w.w2.data(), .d = a.y.data(), .rows = rows, .n = H, .k = F,
                        .lda = F, .ldb = F, .ldd = H, .b_group_stride = H * F, .groups = m.L, .tiles = tiles},
                       stream, m.fc2.name);
    m.fc2.gemm->run(stream);
    if (m.cfg.fc2_bias) {
      experts::RowBiasParams p;
      p.y = a.y.data();
      p.probs = m.probs_ptr(a.probs);
      p.b = m.fwd.ptrs[1];
      p.C = int(H);
      p.offsets = m.fwd.offsets;
      p.L = m.L;
      experts::launch_row_bias(p, rows, stream);
    }
  }
}

// ---- backward --------------------------------------------------------------------------------------------------

void GroupedMlp::backward(const MlpBackwardArgs& a, cudaStream_t stream) {
  Impl& m = *impl_;
  const Checker c{"experts backward", Device::cuda(m.device)};
  m.check_current_device(c.op);
  const std::int64_t rows = m.check_common(c, a.x, a.probs, a.counts);
  const std::int64_t H = m.H, F = m.F, F1 = m.F1, L = m.L;
  const MlpWeights& w = a.weights;
  const bool pe_w1 = c.param("weights.w1", w.w1, w.w1_experts, true, "", L, {F1, H});
  const bool pe_w2 = c.param("weights.w2", w.w2, w.w2_experts, true, "", L, {H, F});
  c.param("weights.b1", w.b1, w.b1_experts, m.cfg.fc1_bias, "fc1_bias", L, {F1});  // checked, not read
  const bool pe_b2 = c.param("weights.b2", w.b2, w.b2_experts, m.cfg.fc2_bias, "fc2_bias", L, {H});
  c.view("h1", a.h1, DType::BF16, {rows, F1});
  c.view("dy", a.dy, DType::BF16, {rows, H});
  c.optional("dx", a.dx, DType::BF16, {rows, H});
  c.optional("d_probs", a.d_probs, DType::F32, {rows});
  c.view("d_h1", a.d_h1, DType::BF16, {rows, F1});
  if (!a.workspace.defined()) fail(c.op, "workspace is absent but required");
  check_device(c.op, "workspace", a.workspace, Device::cuda(m.device));
  const std::size_t need = backward_workspace_bytes(rows);
  if (a.workspace.nbytes() < need)
    fail(c.op, "workspace has ", a.workspace.nbytes(), " bytes but backward_workspace_bytes(", rows, ") = ", need,
         " are needed");
  if (!aligned16(a.workspace.data())) fail(c.op, "workspace is not 16-byte aligned");
  const TensorView d_act(a.workspace.data(), DType::BF16, {rows, F}, Device::cuda(m.device));
  const bool per_expert = pe_w1 || pe_w2 || pe_b2;
  const bool d_probs_bias = m.cfg.fc2_bias && m.cfg.prob_mode == ProbMode::InActivation && a.d_probs.defined();

  experts::SetupParams p = m.base_setup(a.counts, rows, m.bwd.offsets);
  p.num_gemms = 2;
  p.gemm[0] = {m.dgrad2.arrays, rows_of(a.dy, H), expert_of(w.w2, H * F, pe_w2, 0), rows_of(d_act, F), kRagged,
               int(F), int(H)};
  // Without dx, FC1's dgrad has nothing to write: its groups stay empty (n = 0 everywhere is not expressible,
  // so the GEMM is simply not launched below).
  p.gemm[1] = {m.dgrad1.arrays, rows_of(a.d_h1, F1), expert_of(w.w1, F1 * H, pe_w1, 1),
               a.dx.defined() ? rows_of(a.dx, H) : rows_of(a.d_h1, F1), kRagged, int(H), int(F1)};
  const experts::ContigTiles tiles = m.contig_tiles(m.bwd_tiles, rows, pe_w1 || pe_w2);
  const bool contig_dgrad2 = tiles.tile_group && m.contiguous(m.dgrad2);
  const bool contig_dgrad1 = tiles.tile_group && m.contiguous(m.dgrad1);
  p.contig = tiles;
  p.gemm[0].contig = contig_dgrad2;
  p.gemm[1].contig = contig_dgrad1;
  if (d_probs_bias) p.ptrs[0] = {m.bwd.ptrs[0], expert_of(w.b2, H, pe_b2, 2)};
  if (per_expert) {
    fill_table(*m.tables, 0, w.w2_experts);
    fill_table(*m.tables, 1, w.w1_experts);
    fill_table(*m.tables, 2, w.b2_experts);
  }
  experts::launch_setup(p, per_expert ? m.tables.get() : nullptr, stream);

  // FC2's dgrad with the activation backward in its epilogue: d_act is never stored, and the workspace (sized for
  // it, rows x F bf16) holds the d_probs partials instead (rows x ceil(F / 128) f32). The tile table of a call that
  // has one always holds every expert (contig_max_tiles), so the epilogue sees every row and the pass is not needed.
  const bool fused_act_bwd = contig_dgrad2 && m.contig_nn_act_bwd;
  // (Without probs in the activation d_probs is 0: no partials.)
  const bool dp_needed = a.d_probs.defined() && m.cfg.prob_mode == ProbMode::InActivation;
  float* const dp_partial = dp_needed ? static_cast<float*>(a.workspace.data()) : nullptr;
  const int n_tiles = int((F + experts::kContigTileM - 1) / experts::kContigTileM);
  if (contig_dgrad2) {
    experts::ContigCall call{.a = a.dy.data(), .b = w.w2.data(), .d = d_act.data(), .rows = rows, .n = F, .k = H,
                             .lda = H, .ldb = F, .ldd = F, .b_group_stride = H * F, .groups = m.L, .tiles = tiles};
    if (fused_act_bwd) {
      call.act_shape = m.act_shape();
      call.h1 = a.h1.data();
      call.d_h1 = a.d_h1.data();
      call.probs = m.probs_ptr(a.probs);
      call.dp_partial = dp_partial;
    }
    (fused_act_bwd ? m.contig_nn_act_bwd : m.contig_nn)->run(call, stream, m.dgrad2.name);
  }
  m.dgrad2.gemm->run(stream);

  if (fused_act_bwd) {
    if (a.d_probs.defined()) {
      experts::DprobsFromPartialsParams dp;
      dp.partial = dp_partial;
      dp.n_tiles = n_tiles;
      dp.d_probs = a.d_probs.as<float>();
      dp.offsets = m.bwd.offsets;
      dp.L = m.L;
      experts::launch_dprobs_from_partials(dp, rows, stream);
    }
  } else {
    experts::ActBackwardParams ab;
    ab.shape = m.act_shape();
    ab.h1 = a.h1.data();
    ab.d_act = d_act.data();
    ab.d_h1 = a.d_h1.data();
    ab.probs = m.probs_ptr(a.probs);
    ab.d_probs = a.d_probs.defined() ? a.d_probs.as<float>() : nullptr;
    ab.dy = a.dy.data();
    ab.b2 = d_probs_bias ? m.bwd.ptrs[0] : nullptr;
    ab.H = int(H);
    ab.offsets = m.bwd.offsets;
    ab.L = m.L;
    experts::launch_activation_backward(ab, rows, stream);
  }

  if (a.dx.defined()) {
    if (contig_dgrad1)
      m.contig_nn->run({.a = a.d_h1.data(), .b = w.w1.data(), .d = a.dx.data(), .rows = rows, .n = H, .k = F1,
                        .lda = F1, .ldb = H, .ldd = H, .b_group_stride = F1 * H, .groups = m.L, .tiles = tiles},
                       stream, m.dgrad1.name);
    m.dgrad1.gemm->run(stream);
  }

  if (a.grads.defined()) {
    MlpBackwardDwArgs dw;
    dw.x = a.x;
    dw.probs = a.probs;
    dw.counts = a.counts;
    dw.act = a.act;
    dw.dy = a.dy;
    dw.d_h1 = a.d_h1;
    dw.grads = a.grads;
    backward_dw(dw, stream);
  }
}

// ---- weight gradients ------------------------------------------------------------------------------------------

void GroupedMlp::backward_dw(const MlpBackwardDwArgs& a, cudaStream_t stream) {
  Impl& m = *impl_;
  const Checker c{"experts backward_dw", Device::cuda(m.device)};
  m.check_current_device(c.op);
  // Chunked rows: counts [C, L], C regions of chunk_rows rows (MlpBackwardDwArgs::chunk_rows).
  const bool chunked = a.chunk_rows != 0;
  std::int64_t chunks = 1;
  if (chunked) {
    if (a.chunk_rows < 0) fail(c.op, "chunk_rows = ", a.chunk_rows, " but it must be 0 (one region) or positive");
    if (!a.counts.defined() || a.counts.ndim() != 2)
      fail(c.op, "counts must be [C, L] when chunk_rows > 0 (one row of counts per region)");
    chunks = a.counts.size(0);
    if (chunks < 1 || chunks > kMaxMlpChunks)
      fail(c.op, "counts has ", chunks, " regions but 1 to ", kMaxMlpChunks, " are supported");
  }
  const std::int64_t rows = m.check_common(c, a.x, a.probs, a.counts, chunked ? chunks : 0);
  if (chunked) {
    if (chunks * a.chunk_rows > rows)
      fail(c.op, "counts has ", chunks, " regions of chunk_rows = ", a.chunk_rows, " rows but x has ", rows,
           " rows");
    if (rows > experts::kContigWgradMaxRows)
      fail_with(ErrorCode::Unsupported, c.op, ": chunked weight gradients take at most ",
                experts::kContigWgradMaxRows, " rows, x has ", rows);
  }
  const std::int64_t H = m.H, F = m.F, F1 = m.F1, L = m.L;
  c.view("act", a.act, DType::BF16, {rows, F});
  c.view("dy", a.dy, DType::BF16, {rows, H});
  c.view("d_h1", a.d_h1, DType::BF16, {rows, F1});
  const MlpGrads& g = a.grads;
  if (!g.defined()) fail(c.op, "grads.dw1 is absent but required");
  // bf16 or fp32, every gradient as grads.dw1 (the first of its form)
  const DType gd = g.dw1.defined() ? g.dw1.dtype() : g.dw1_experts.front().dtype();
  if (gd != DType::BF16 && gd != DType::F32)
    fail(c.op, g.dw1.defined() ? "grads.dw1" : "grads.dw1_experts[0]", " has dtype ", dtype_name(gd),
         " but the weight gradients are bf16 or f32");
  const bool f32 = gd == DType::F32;
  const std::int64_t gb = f32 ? 4 : kBf16;  // bytes per gradient element
  const bool pe_dw1 = c.param("grads.dw1", g.dw1, g.dw1_experts, true, "", L, {F1, H}, gd);
  const bool pe_dw2 = c.param("grads.dw2", g.dw2, g.dw2_experts, true, "", L, {H, F}, gd);
  const bool pe_db1 = c.param("grads.db1", g.db1, g.db1_experts, m.cfg.fc1_bias, "fc1_bias", L, {F1}, gd);
  const bool pe_db2 = c.param("grads.db2", g.db2, g.db2_experts, m.cfg.fc2_bias, "fc2_bias", L, {H}, gd);
  const bool per_expert = pe_dw1 || pe_dw2 || pe_db1 || pe_db2;

  // The contiguous weight gradients store every expert's tiles (zeros for an empty one; added, when accumulating);
  // the grouped GEMMs skip empty groups, whose dW the zero kernel writes. Only the contiguous kernel accumulates or
  // writes fp32; without rows (which it does not take) every group is empty and the zero kernel writes any dtype.
  if ((g.accumulate || f32) && rows > experts::kContigWgradMaxRows)
    fail_with(ErrorCode::Unsupported, c.op, ": ", g.accumulate ? "accumulated" : "fp32",
              " weight gradients take at most ", experts::kContigWgradMaxRows, " rows, x has ", rows);
  if (g.accumulate && rows == 0) return;  // nothing to add
  const bool contig_only = (g.accumulate || f32) && rows > 0;
  const bool contig_w2 = chunked || contig_only || m.contiguous_wgrad(m.wgrad2, rows);
  const bool contig_w1 = chunked || contig_only || m.contiguous_wgrad(m.wgrad1, rows);

  experts::SetupParams p = m.base_setup(a.counts, chunked ? a.chunk_rows : rows, m.wgr.offsets);
  p.chunks = int(chunks);
  if (contig_w2 || contig_w1) {  // the contiguous kernel's walk; the grouped one has no use for it
    p.wgrad_places = m.wgrad_places;
    p.wgrad_segments = m.wgrad_segments;
    p.wgrad_k_tiles = m.wgrad_walk + 2;
  }
  p.num_gemms = 2;
  // dW2[e] [H, F] = dy[e]^T act[e]: A = dy read as [K = rows, M = H] (M-major), B = act [K, N = F].
  p.gemm[0] = {m.wgrad2.arrays, rows_of(a.dy, H), rows_of(a.act, F), expert_of(g.dw2, H * F, pe_dw2, 0, gb),
               int(H), int(F), kRagged};
  // dW1[e] [F1, H] = d_h1[e]^T x[e].
  p.gemm[1] = {m.wgrad1.arrays, rows_of(a.d_h1, F1), rows_of(a.x, H), expert_of(g.dw1, F1 * H, pe_dw1, 1, gb),
               int(F1), int(H), kRagged};
  if (m.cfg.fc1_bias) p.ptrs[0] = {m.wgr.ptrs[0], expert_of(g.db1, F1, pe_db1, 2, gb)};
  if (m.cfg.fc2_bias) p.ptrs[1] = {m.wgr.ptrs[1], expert_of(g.db2, H, pe_db2, 3, gb)};
  if (per_expert) {
    fill_table(*m.tables, 0, g.dw2_experts);
    fill_table(*m.tables, 1, g.dw1_experts);
    fill_table(*m.tables, 2, g.db1_experts);
    fill_table(*m.tables, 3, g.db2_experts);
  }
  experts::launch_setup(p, per_expert ? m.tables.get() : nullptr, stream);

  experts::ZeroEmptyParams z;
  z.offsets = m.wgr.offsets;
  z.L = m.L;
  if (!contig_w2) {
    z.ptr_d[z.num] = m.wgrad2.arrays.ptr_d;
    z.bytes[z.num++] = H * F * gb;
  }
  if (!contig_w1) {
    z.ptr_d[z.num] = m.wgrad1.arrays.ptr_d;
    z.bytes[z.num++] = F1 * H * gb;
  }
  if (z.num > 0) experts::launch_zero_empty(z, stream);

  // dW [M, N] = A^T B over each expert's rows of A [rows, M] and B [rows, N]
  auto run_wgrad = [&](GemmSlot& slot, bool contig, const TensorView& A, const TensorView& B, std::int64_t M,
                       std::int64_t N) {
    if (!contig) return slot.gemm->run(stream);
    m.contig_wgrad->run({.a = A.data(), .b = B.data(), .ptr_d = slot.arrays.ptr_d, .offsets = m.wgr.offsets,
                         .places = m.wgrad_places, .place_segments = m.wgrad_segments, .walk = m.wgrad_walk,
                         .rows = rows, .m = M, .n = N, .lda = M, .ldb = N, .ldd = N, .groups = m.L,
                         .chunks = int(chunks), .accumulate = g.accumulate, .f32 = f32},
                        stream, slot.name);
  };
  run_wgrad(m.wgrad2, contig_w2, a.dy, a.act, H, F);
  run_wgrad(m.wgrad1, contig_w1, a.d_h1, a.x, F1, H);

  if (m.cfg.fc2_bias) {  // db2 = sum_r p[r] dy[r]  (dz = p dy)
    experts::BiasGradParams b;
    b.g = a.dy.data();
    b.probs = m.probs_ptr(a.probs);
    b.db = const_cast<void* const*>(reinterpret_cast<const void* const*>(m.wgr.ptrs[1]));
    b.C = int(H);
    b.offsets = m.wgr.offsets;
    b.L = m.L;
    b.chunks = int(chunks);
    b.accumulate = g.accumulate;
    b.f32 = f32;
    experts::launch_bias_grad(b, stream);
  }
  if (m.cfg.fc1_bias) {  // db1 = sum_r d_h1[r]
    experts::BiasGradParams b;
    b.g = a.d_h1.data();
    b.probs = nullptr;
    b.db = const_cast<void* const*>(reinterpret_cast<const void* const*>(m.wgr.ptrs[0]));
    b.C = int(F1);
    b.offsets = m.wgr.offsets;
    b.L = m.L;
    b.chunks = int(chunks);
    b.accumulate = g.accumulate;
    b.f32 = f32;
    experts::launch_bias_grad(b, stream);
  }
}

}  // namespace moerail
