// src/experts/grouped_mlp_backward.cpp — GroupedMlp::backward (FC2 dgrad, activation backward, FC1 dgrad) and
// GroupedMlp::backward_dw (the weight and bias gradients), each with its own argument arrays (grouped_mlp_impl.h).
#include "moerail/experts.h"

#include <cstddef>
#include <cstdint>

#include "experts/contig/contig_gemm.h"
#include "experts/elementwise.h"
#include "experts/grouped_mlp_impl.h"
#include "experts/setup.h"
#include "moerail/error.h"

namespace moerail {

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
