// src/experts/grouped_mlp.cpp — host launcher of the grouped expert MLP (moerail/experts.h): the device memory of
// the per-expert argument arrays, CUTLASS setup (the constructor), and the forward's launch sequence; the backward
// passes are in grouped_mlp_backward.cpp, the private state and argument checks in grouped_mlp_impl.h.
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

#include "core/cuda_check.h"
#include "core/log.h"
#include "experts/contig/contig_gemm.h"
#include "experts/elementwise.h"
#include "experts/gemm_slot.h"
#include "experts/grouped/grouped_gemm.h"
#include "experts/grouped_mlp_impl.h"
#include "experts/mlp_tuning.h"
#include "experts/setup.h"
#include "experts/tiles.h"
#include "moerail/error.h"

namespace moerail {

using experts::GemmLayout;
using experts::MlpGemmTile;
using experts::kMlpStageActivation;
using experts::kMlpStageAll;
using experts::kMlpStageFc1;
using experts::kMlpStageFc2;
using experts::kMlpStageSetup;

namespace {

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

}  // namespace

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

}  // namespace moerail
