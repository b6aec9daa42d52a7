// src/experts/fp8/fp8_mlp.cpp — the FP8 expert MLP (moerail/experts_fp8.h, Fp8GroupedMlp): the recipe's GEMMs
// (grouped_gemm_fp8 and its dgrad and wgrad forms) with the bf16 MLP's activation kernels between them, and a
// quantization pass for each FP8 operand made here (act; dy and d_h1; the segment-transposed wgrad copies). Under
// Fp8WeightGrads::BF16 the weight gradients are a bf16 GroupedMlp's backward_dw. Recipe::Fp8Tensor runs the same
// sequence with one scale per expert tensor: the GEMMs per-tensor scaled (the forward's with fast accumulation, the
// dgrads and weight gradients promoting every 128 elements), each quantization preceded by its amax pass
// (quantize_fp8_experts), the wgrad copies holding the same codes transposed; Recipe::Fp8TensorHybrid the same with
// the gradients dy and d_h1 (and their copies) in e5m2, which the dgrads and weight gradients take as their A.
#include <algorithm>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>

#include "core/arena.h"
#include "core/cuda_check.h"
#include "experts/elementwise.h"
#include "experts/setup.h"
#include "moerail/error.h"
#include "moerail/experts_fp8.h"
#include "moerail/quant.h"

namespace moerail {
namespace {

constexpr std::string_view kOp = "Fp8GroupedMlp";


void check(std::string_view name, const TensorView& v, DType t, std::initializer_list<std::int64_t> shape,
           int device) {
  check_shape(kOp, name, v, shape);
  check_dtype(kOp, name, v, {t});
  check_device(kOp, name, v, Device::cuda(device));
  if (reinterpret_cast<std::uintptr_t>(v.data()) % 16 != 0) fail(kOp, name, " is not 16-byte aligned");
}

// The segment-transposed copy of x into qt / qt_scales (the plain form of quantize_fp8_transposed).
QuantizeTransposedArgs transposed_copy(const TensorView& x, const TensorView& counts, const TensorView& qt,
                                       const TensorView& qt_scales) {
  QuantizeTransposedArgs a;
  a.x = x;
  a.counts = counts;
  a.qt = qt;
  a.qt_scales = qt_scales;
  return a;
}

// The views of an Fp8MlpWeights in order (one function for the size and the views): 128x128 block scales, or one
// scale per expert matrix (per-tensor recipes).
Fp8MlpWeights lay_out_weights(const MoeConfig& cfg, Recipe recipe, Arena& a) {
  const std::int64_t L = cfg.local_experts(), H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out();
  const bool tensor = is_per_tensor(recipe);
  auto scales = [&](std::int64_t n, std::int64_t k) {
    return tensor ? a.take(DType::F32, {L}) : a.take(DType::F32, {L, n / 128, k / 128});
  };
  Fp8MlpWeights w;
  w.recipe = recipe;
  w.w1 = a.take(DType::F8E4M3, {L, F1, H});
  w.w1_scales = scales(F1, H);
  w.w1t = a.take(DType::F8E4M3, {L, H, F1});
  w.w1t_scales = scales(H, F1);
  w.w2 = a.take(DType::F8E4M3, {L, H, F});
  w.w2_scales = scales(H, F);
  w.w2t = a.take(DType::F8E4M3, {L, F, H});
  w.w2t_scales = scales(F, H);
  return w;
}

// The recipes whose FP8 weights exist (the hybrid recipe's weights are fp8-tensor's: e4m3, one scale per matrix).
void check_weights_recipe(std::string_view what, Recipe recipe) {
  if (recipe != Recipe::Fp8Blockwise && !is_per_tensor(recipe))
    fail(kOp, what, "recipe = ", name_of(recipe), " (FP8 weights are fp8-blockwise or per-tensor)");
}

void check_fp8_config(const MoeConfig& cfg) {
  cfg.validate();
  if (cfg.dtype != DType::BF16)
    fail_with(ErrorCode::Unsupported, kOp, "cfg.dtype = ", dtype_name(cfg.dtype), " (expected bf16)");
  if (cfg.hidden % 128 != 0 || cfg.ffn_hidden % 128 != 0)
    fail_with(ErrorCode::Unsupported, kOp, "cfg.hidden = ", cfg.hidden, " and cfg.ffn_hidden = ", cfg.ffn_hidden,
              " (the FP8 recipe needs multiples of 128: the GEMMs reduce over 128-wide scale blocks)");
  if (cfg.fc1_bias || cfg.fc2_bias)
    fail_with(ErrorCode::Unsupported, kOp, "cfg.fc1_bias / cfg.fc2_bias (the FP8 MLP has no biases)");
  if (cfg.local_experts() > kMaxLocalExperts)
    fail_with(ErrorCode::Unsupported, kOp, "cfg.local_experts() = ", cfg.local_experts(), " (at most ",
              kMaxLocalExperts, ")");
}

}  // namespace

std::size_t fp8_mlp_weights_bytes(const MoeConfig& cfg, Recipe recipe) {
  check_fp8_config(cfg);
  check_weights_recipe("fp8_mlp_weights_bytes: ", recipe);
  Arena dry;
  lay_out_weights(cfg, recipe, dry);
  return dry.used;
}

Fp8MlpWeights make_fp8_mlp_weights(const MoeConfig& cfg, void* base, int device, Recipe recipe) {
  check_fp8_config(cfg);
  check_weights_recipe("make_fp8_mlp_weights: ", recipe);
  if (base == nullptr) fail(kOp, "make_fp8_mlp_weights: base is null");
  Arena a{static_cast<char*>(base), 0, device};
  return lay_out_weights(cfg, recipe, a);
}

void quantize_mlp_weights_fp8(const MoeConfig& cfg, const MlpWeights& w, const Fp8MlpWeights& q,
                              cudaStream_t stream) {
  check_fp8_config(cfg);
  if (!w.w1.defined() || !w.w2.defined())
    fail(kOp, "quantize_mlp_weights_fp8 takes the grouped weights w1 and w2 (per-expert tensors: stack them first)");
  check_weights_recipe("quantize_mlp_weights_fp8: q.", q.recipe);
  const Fp8Scaling s = is_per_tensor(q.recipe) ? Fp8Scaling::PerTensor : Fp8Scaling::Block1x128;
  quantize_weights_fp8({w.w1, q.w1, q.w1_scales, q.w1t, q.w1t_scales, s}, stream);
  quantize_weights_fp8({w.w2, q.w2, q.w2_scales, q.w2t, q.w2t_scales, s}, stream);
}

struct Fp8GroupedMlp::Impl {
  MoeConfig cfg;
  Recipe recipe = Recipe::Fp8Blockwise;
  bool tensor = false;  // a per-tensor recipe: every FP8 tensor one scale per expert
  DType grad = DType::F8E4M3;  // the codes of dy and d_h1: e5m2 under Recipe::Fp8TensorHybrid
  std::int64_t L = 0, H = 0, F = 0, F1 = 0;
  int device = 0;
  DeviceBuffer state;        // offsets [L + 1] i64, rows_used [1] i32, then the GEMMs' workspace
  std::int64_t* offsets = nullptr;
  std::int32_t* rows_used = nullptr;
  TensorView gemm_ws;
  std::unique_ptr<GroupedMlp> bf16_dw;  // Fp8WeightGrads::BF16: the weight gradients' GEMMs (freed before `state`)
  // What the last Stage call staged the copies for (workspace, rows, counts), checked by the Staged call that
  // consumes them; host state, so it holds for captured calls too.
  struct Staged {
    const void* workspace = nullptr;
    std::int64_t rows = -1;
    const void* counts = nullptr;
  } staged;

  // The segment offsets of `counts` over `rows` rows, and their total as a device row count.
  void setup(const TensorView& counts, std::int64_t rows, cudaStream_t stream) const {
    experts::SetupParams p;
    p.counts = counts.data();
    p.counts_i64 = counts.dtype() == DType::I64;
    p.L = int(L);
    p.rows = rows;
    p.offsets = offsets;
    p.rows_used = rows_used;
    experts::launch_setup(p, nullptr, stream);
  }
  TensorView rows_view() const { return TensorView(rows_used, DType::I32, {1}, Device::cuda(device)); }

  void check_common(const TensorView& x, const TensorView& x_scales, const TensorView& probs,
                    const TensorView& counts, const Fp8MlpWeights& w, std::int64_t rows) const {
    if (cuda::current_device() != device)
      fail(kOp, "called on device ", cuda::current_device(), " but made on device ", device);
    check("x", x, DType::F8E4M3, {rows, H}, device);
    if (tensor) check_shape(kOp, "x_scales", x_scales, {L});
    else check_shape(kOp, "x_scales", x_scales, {rows, H / 128});
    check_dtype(kOp, "x_scales", x_scales, {DType::F32});
    check_device(kOp, "x_scales", x_scales, Device::cuda(device));
    if (cfg.prob_mode == ProbMode::InActivation) {
      check_shape(kOp, "probs", probs, {rows});
      check_dtype(kOp, "probs", probs, {DType::F32});
      check_device(kOp, "probs", probs, Device::cuda(device));
    }
    check_shape(kOp, "counts", counts, {L});
    check_dtype(kOp, "counts", counts, {DType::I32, DType::I64});
    check_device(kOp, "counts", counts, Device::cuda(device));
    if (is_per_tensor(w.recipe) != tensor)
      fail(kOp, "weights.recipe = ", name_of(w.recipe), " but the MLP runs ", name_of(recipe),
           " (make_fp8_mlp_weights with the MLP's recipe)");
    check("weights.w1", w.w1, DType::F8E4M3, {L, F1, H}, device);
    check("weights.w1t", w.w1t, DType::F8E4M3, {L, H, F1}, device);
    check("weights.w2", w.w2, DType::F8E4M3, {L, H, F}, device);
    check("weights.w2t", w.w2t, DType::F8E4M3, {L, F, H}, device);
    for (const auto& [name, v, a, b] : {std::tuple{"weights.w1_scales", w.w1_scales, F1, H},
                                        std::tuple{"weights.w1t_scales", w.w1t_scales, H, F1},
                                        std::tuple{"weights.w2_scales", w.w2_scales, H, F},
                                        std::tuple{"weights.w2t_scales", w.w2t_scales, F, H}}) {
      if (tensor) check_shape(kOp, name, v, {L});
      else check_shape(kOp, name, v, {L, a / 128, b / 128});
      check_dtype(kOp, name, v, {DType::F32});
      check_device(kOp, name, v, Device::cuda(device));
    }
  }

  // A workspace of at least `bytes` bytes on this device, 256-byte aligned (its pieces are aligned from its start).
  void check_workspace(const TensorView& ws, std::size_t bytes) const {
    if (ws.nbytes() < bytes) fail(kOp, "workspace has ", ws.nbytes(), " bytes (expected at least ", bytes, ")");
    check_device(kOp, "workspace", ws, Device::cuda(device));
    if (reinterpret_cast<std::uintptr_t>(ws.data()) % 256 != 0) fail(kOp, "workspace is not 256-byte aligned");
  }

  const float* probs_ptr(const TensorView& probs) const {
    return cfg.prob_mode == ProbMode::InActivation ? probs.as<const float>() : nullptr;
  }

  // Scales of a [rows, C] FP8 tensor: 1x128 along C, or one per expert.
  TensorView take_scales(Arena& a, std::int64_t rows, std::int64_t C) const {
    return tensor ? a.take(DType::F32, {L}) : a.take(DType::F32, {rows, C / 128});
  }

  // The forward's workspace: act quantized (1x128 along F, or per expert).
  void forward_pieces(std::int64_t rows, Arena& a, TensorView& act_q, TensorView& act_s) const {
    act_q = a.take(DType::F8E4M3, {rows, F});
    act_s = take_scales(a, rows, F);
  }

  // d = a b^T per expert, as the recipe scales them.
  void gemm(const TensorView& x, const TensorView& xs, const TensorView& w, const TensorView& ws,
            const TensorView& counts, const TensorView& d, cudaStream_t stream) const {
    Fp8GroupedGemmArgs g{x, xs, w, ws, counts, d, gemm_ws};
    g.scaling = tensor ? Fp8GemmScaling::PerTensor : Fp8GemmScaling::Blockwise;
    grouped_gemm_fp8(g, stream);
  }
  void dgrad(const TensorView& dy, const TensorView& dys, const TensorView& wt, const TensorView& wts,
             const TensorView& counts, const TensorView& dx, cudaStream_t stream) const {
    Fp8DgradArgs g{dy, dys, wt, wts, counts, dx, gemm_ws};
    g.scaling = tensor ? Fp8GemmScaling::PerTensor : Fp8GemmScaling::Blockwise;
    g.promote = true;  // the split accumulator (per tensor; blockwise scaling always promotes)
    grouped_gemm_fp8_dgrad(g, stream);
  }

  // The backward's workspace: dy and d_h1 quantized 1x128 along their columns, d_act (bf16; under bf16 weight
  // gradients its memory is x's dequantized copy later), and the segment-transposed copies of the FP8 weight
  // gradients' operands.
  BackwardPieces backward_pieces(std::int64_t rows, Arena& a) const {
    BackwardPieces b;
    b.dy_q = a.take(grad, {rows, H});
    b.dy_s = take_scales(a, rows, H);
    b.dh1_q = a.take(grad, {rows, F1});
    b.dh1_s = take_scales(a, rows, F1);
    b.scratch = a.take(DType::BF16, {rows, bf16_dw ? std::max(F, H) : F});
    if (bf16_dw) return b;
    const std::int64_t Rt = fp8_transposed_rows(rows, L);
    b.dyt = a.take(grad, {H * Rt});
    b.dyt_s = a.take(DType::F32, {H * Rt / 128});
    b.actt = a.take(DType::F8E4M3, {F * Rt});
    b.actt_s = a.take(DType::F32, {F * Rt / 128});
    b.dh1t = a.take(grad, {F1 * Rt});
    b.dh1t_s = a.take(DType::F32, {F1 * Rt / 128});
    b.xt = a.take(DType::F8E4M3, {H * Rt});
    b.xt_s = a.take(DType::F32, {H * Rt / 128});
    if (tensor) b.act_s = a.take(DType::F32, {L});  // act's scales again, for its copy
    return b;
  }
};

Fp8GroupedMlp::Fp8GroupedMlp(const MoeConfig& cfg, const Fp8MlpOptions& options)
    : impl_(std::make_unique<Impl>()) {
  check_fp8_config(cfg);
  if (options.weight_grads != Fp8WeightGrads::Fp8 && options.weight_grads != Fp8WeightGrads::BF16)
    fail(kOp, "options.weight_grads = ", int(options.weight_grads), " is not an Fp8WeightGrads");
  if (options.recipe != Recipe::Fp8Blockwise && !is_per_tensor(options.recipe))
    fail(kOp, "options.recipe = ", name_of(options.recipe),
         " (expected fp8-blockwise, fp8-tensor or fp8-tensor-hybrid)");
  if (is_per_tensor(options.recipe) && options.weight_grads == Fp8WeightGrads::BF16)
    fail_with(ErrorCode::Unsupported, kOp, "options.weight_grads = bf16 with options.recipe = ",
              name_of(options.recipe), " (bf16 weight gradients run with fp8-blockwise only)");
  DeviceAllocator* allocator = options.allocator;
  Impl& m = *impl_;
  m.cfg = cfg;
  m.recipe = options.recipe;
  m.tensor = is_per_tensor(options.recipe);
  m.grad = options.recipe == Recipe::Fp8TensorHybrid ? DType::F8E5M2 : DType::F8E4M3;
  m.L = cfg.local_experts();
  m.H = cfg.hidden;
  m.F = cfg.ffn_hidden;
  m.F1 = cfg.fc1_out();
  m.device = cuda::current_device();
  const std::size_t head = ((m.L + 1) * 8 + 4 + 255) / 256 * 256;
  const std::size_t ws = grouped_gemm_fp8_workspace_bytes(m.L);
  m.state = DeviceBuffer(allocator ? *allocator : cuda_allocator(), head + ws);
  MOERAIL_CUDA_CHECK(cudaMemset(m.state.data(), 0, head));
  m.offsets = static_cast<std::int64_t*>(m.state.data());
  m.rows_used = reinterpret_cast<std::int32_t*>(m.offsets + m.L + 1);
  m.gemm_ws = TensorView(static_cast<char*>(m.state.data()) + head, DType::Bool, {std::int64_t(ws)},
                         Device::cuda(m.device));
  if (options.weight_grads == Fp8WeightGrads::BF16) {
    MlpOptions mo;
    mo.rows_hint = options.rows_hint;
    mo.allocator = allocator;
    m.bf16_dw = std::make_unique<GroupedMlp>(cfg, mo);
  }
}

Fp8GroupedMlp::~Fp8GroupedMlp() = default;

std::size_t Fp8GroupedMlp::forward_workspace_bytes(std::int64_t rows) const {
  Arena dry;
  TensorView q, s;
  impl_->forward_pieces(rows, dry, q, s);
  return dry.used;
}

std::size_t Fp8GroupedMlp::backward_workspace_bytes(std::int64_t rows) const {
  Arena dry;
  impl_->backward_pieces(rows, dry);
  return dry.used;
}

Recipe Fp8GroupedMlp::recipe() const { return impl_->recipe; }

std::size_t Fp8GroupedMlp::device_bytes() const {
  return impl_->state.bytes() + (impl_->bf16_dw ? impl_->bf16_dw->device_bytes() : 0);
}

void Fp8GroupedMlp::forward(const Fp8MlpForwardArgs& a, cudaStream_t stream) {
  const Impl& m = *impl_;
  const std::int64_t rows = a.x.defined() ? a.x.size(0) : 0;
  m.check_common(a.x, a.x_scales, a.probs, a.counts, a.weights, rows);
  check("y", a.y, DType::BF16, {rows, m.H}, m.device);
  check("h1", a.h1, DType::BF16, {rows, m.F1}, m.device);
  check("act", a.act, DType::BF16, {rows, m.F}, m.device);
  m.check_workspace(a.workspace, forward_workspace_bytes(rows));
  Arena ws{static_cast<char*>(a.workspace.data()), 0, m.device};
  TensorView act_q, act_s;
  m.forward_pieces(rows, ws, act_q, act_s);

  m.setup(a.counts, rows, stream);
  const Fp8MlpWeights& w = a.weights;
  m.gemm(a.x, a.x_scales, w.w1, w.w1_scales, a.counts, a.h1, stream);
  experts::ActForwardParams ap;
  ap.shape = experts::act_shape_of(m.cfg);
  ap.h1 = a.h1.data();
  ap.act = a.act.data();
  ap.probs = m.probs_ptr(a.probs);
  ap.offsets = m.offsets;
  ap.L = int(m.L);
  experts::launch_activation_forward(ap, rows, stream);
  if (m.tensor) quantize_fp8_experts({a.act, a.counts, act_q, act_s}, stream);
  else quantize_fp8({Fp8Scaling::Block1x128, a.act, m.rows_view(), act_q, act_s}, stream);
  m.gemm(act_q, act_s, w.w2, w.w2_scales, a.counts, a.y, stream);
}

void Fp8GroupedMlp::backward(const Fp8MlpBackwardArgs& a, cudaStream_t stream) {
  const Impl& m = *impl_;
  const std::int64_t rows = a.x.defined() ? a.x.size(0) : 0;
  m.check_common(a.x, a.x_scales, a.probs, a.counts, a.weights, rows);
  const bool data = a.dx.defined();
  if (data) check("h1", a.h1, DType::BF16, {rows, m.F1}, m.device);  // the weight gradients do not read it
  check("act", a.act, DType::BF16, {rows, m.F}, m.device);
  check("dy", a.dy, DType::BF16, {rows, m.H}, m.device);
  if (data) check("dx", a.dx, DType::BF16, {rows, m.H}, m.device);
  check("d_h1", a.d_h1, DType::BF16, {rows, m.F1}, m.device);
  if (a.d_probs.defined()) {
    check_shape(kOp, "d_probs", a.d_probs, {rows});
    check_dtype(kOp, "d_probs", a.d_probs, {DType::F32});
    check_device(kOp, "d_probs", a.d_probs, Device::cuda(m.device));
  }
  const bool wgrad = a.dw1.defined() || a.dw2.defined();
  if (!data && !wgrad) fail(kOp, "backward: neither dx nor dw1 / dw2 is given (nothing to compute)");
  if (wgrad) {
    const DType dw_type = a.accumulate_weight_grads ? DType::F32 : DType::BF16;  // f32: added into, else written
    check("dw1", a.dw1, dw_type, {m.L, m.F1, m.H}, m.device);
    check("dw2", a.dw2, dw_type, {m.L, m.H, m.F}, m.device);
  }
  const Fp8WgradOperands ops = a.wgrad_operands;
  if (ops != Fp8WgradOperands::Make && ops != Fp8WgradOperands::Stage && ops != Fp8WgradOperands::Staged)
    fail(kOp, "backward: wgrad_operands = ", int(ops), " is not an Fp8WgradOperands");
  if (ops == Fp8WgradOperands::Stage && (!data || wgrad))
    fail(kOp, "backward: wgrad_operands = Stage is for the data call (dx given, dw1 / dw2 absent)");
  if (ops == Fp8WgradOperands::Staged && (data || !wgrad))
    fail(kOp, "backward: wgrad_operands = Staged is for the weights call (dw1 and dw2 given, dx absent)");
  m.check_workspace(a.workspace, backward_workspace_bytes(rows));
  if (ops == Fp8WgradOperands::Staged && !m.bf16_dw) {
    const Impl::Staged& st = m.staged;
    if (st.workspace != a.workspace.data() || st.rows != rows || st.counts != a.counts.data())
      fail(kOp, "backward: wgrad_operands = Staged, but the last Stage call on this Fp8GroupedMlp staged the copies "
           "in another workspace or for other rows or counts (or there was none since the last Staged call)");
    impl_->staged = {};
  }
  if (ops == Fp8WgradOperands::Stage) impl_->staged = {a.workspace.data(), rows, a.counts.data()};
  Arena ws{static_cast<char*>(a.workspace.data()), 0, m.device};
  const BackwardPieces b = m.backward_pieces(rows, ws);
  const TensorView d_act(b.scratch.data(), DType::BF16, {rows, m.F}, Device::cuda(m.device));
  // x dequantized for the bf16 weight gradients, over the same scratch ([rows, max(F, H)] in that mode only)
  const TensorView x_deq = m.bf16_dw ? TensorView(b.scratch.data(), DType::BF16, {rows, m.H}, Device::cuda(m.device))
                                     : TensorView();

  // FP8 weight gradients: the copies of dy and d_h1 come from the dgrads' quantization passes when both run here or
  // the caller stages them for a later weights call.
  const bool fp8_copies = !m.bf16_dw && ((data && wgrad) || ops == Fp8WgradOperands::Stage);
  m.setup(a.counts, rows, stream);
  if (data) data_gradients(a, b, d_act, fp8_copies, stream);
  if (wgrad) weight_gradients(a, b, x_deq, fp8_copies || ops == Fp8WgradOperands::Staged, stream);
}

// d_act = dy W2, the activation backward, dx = d_h1 W1; with `copies`, the passes that quantize dy and d_h1 along
// their columns also write their segment-transposed copies (one read of each).
void Fp8GroupedMlp::data_gradients(const Fp8MlpBackwardArgs& a, const BackwardPieces& b, const TensorView& d_act,
                                   bool copies, cudaStream_t stream) {
  const Impl& m = *impl_;
  const Fp8MlpWeights& w = a.weights;
  const std::int64_t rows = a.x.size(0);
  auto quantize_rows = [&](const TensorView& t, const TensorView& q, const TensorView& s, const TensorView& qt,
                           const TensorView& qt_s) {
    if (m.tensor) {  // the experts' scales, then the codes (and their copies, from one more read)
      quantize_fp8_experts({t, a.counts, copies ? TensorView() : q, s, m.grad}, stream);
      if (!copies) return;
      QuantizeTransposedArgs both = transposed_copy(t, a.counts, qt, qt_s);
      both.q = q;
      both.tensor_scales = s;
      quantize_fp8_transposed(both, stream);
      return;
    }
    if (!copies) {
      quantize_fp8({Fp8Scaling::Block1x128, t, m.rows_view(), q, s}, stream);
      return;
    }
    QuantizeTransposedArgs both = transposed_copy(t, a.counts, qt, qt_s);
    both.q = q;
    both.q_scales = s;
    quantize_fp8_transposed(both, stream);
  };
  quantize_rows(a.dy, b.dy_q, b.dy_s, b.dyt, b.dyt_s);
  m.dgrad(b.dy_q, b.dy_s, w.w2t, w.w2t_scales, a.counts, d_act, stream);
  experts::ActBackwardParams ab;
  ab.shape = experts::act_shape_of(m.cfg);
  ab.h1 = a.h1.data();
  ab.d_act = d_act.data();
  ab.d_h1 = a.d_h1.data();
  ab.probs = m.probs_ptr(a.probs);
  ab.d_probs = a.d_probs.defined() ? a.d_probs.as<float>() : nullptr;
  ab.dy = a.dy.data();
  ab.H = int(m.H);
  ab.offsets = m.offsets;
  ab.L = int(m.L);
  experts::launch_activation_backward(ab, rows, stream);
  quantize_rows(a.d_h1, b.dh1_q, b.dh1_s, b.dh1t, b.dh1t_s);
  m.dgrad(b.dh1_q, b.dh1_s, w.w1t, w.w1t_scales, a.counts, a.dx, stream);
}

// dW2 = dy^T act, dW1 = d_h1^T x (x from its FP8 value): over the segment-transposed FP8 copies (those of dy and
// d_h1 made here unless `copies_made`; x's straight from its codes and scales), or (BF16) by the bf16 GEMMs over the
// tensors themselves.
void Fp8GroupedMlp::weight_gradients(const Fp8MlpBackwardArgs& a, const BackwardPieces& b, const TensorView& x_deq,
                                     bool copies_made, cudaStream_t stream) {
  const Impl& m = *impl_;
  const std::int64_t rows = a.x.size(0);
  if (m.bf16_dw) {
    dequantize_fp8({Fp8Scaling::Block1x128, a.x, a.x_scales, m.rows_view(), x_deq}, stream);
    MlpBackwardDwArgs dw;
    dw.x = x_deq;
    if (m.cfg.prob_mode == ProbMode::InActivation) dw.probs = a.probs;  // read only for the FC2 bias, absent here
    dw.counts = a.counts;
    dw.act = a.act;
    dw.dy = a.dy;
    dw.d_h1 = a.d_h1;
    dw.grads.dw1 = a.dw1;
    dw.grads.dw2 = a.dw2;
    dw.grads.accumulate = a.accumulate_weight_grads;
    m.bf16_dw->backward_dw(dw, stream);
    return;
  }
  auto wgrad = [&](const TensorView& dyt, const TensorView& dyt_s, const TensorView& xt, const TensorView& xt_s,
                   const TensorView& dw) {
    Fp8WgradArgs g;
    g.dyt = dyt;
    g.dyt_scales = dyt_s;
    g.xt = xt;
    g.xt_scales = xt_s;
    g.counts = a.counts;
    g.rows = rows;
    g.dw = dw;
    g.workspace = m.gemm_ws;
    g.accumulate = a.accumulate_weight_grads;
    g.scaling = m.tensor ? Fp8GemmScaling::PerTensor : Fp8GemmScaling::Blockwise;
    grouped_gemm_fp8_wgrad(g, stream);
  };
  // A copy of bf16 t: 1x128 blocks along the rows, or (per tensor) the codes of t's per-expert quantization, whose
  // scales are computed into `s` first (the forward's or the dgrads' scales again: the same amax, the same codes; in
  // qt's format, e5m2 for the hybrid recipe's gradients).
  auto copy = [&](const TensorView& t, const TensorView& s, const TensorView& qt, const TensorView& qt_s) {
    QuantizeTransposedArgs c = transposed_copy(t, a.counts, qt, qt_s);
    if (m.tensor) {
      quantize_fp8_experts({t, a.counts, TensorView(), s, qt.dtype()}, stream);
      c.tensor_scales = s;
    }
    quantize_fp8_transposed(c, stream);
  };
  if (!copies_made) copy(a.dy, b.dy_s, b.dyt, b.dyt_s);
  copy(a.act, b.act_s, b.actt, b.actt_s);
  // per tensor the scales are the experts' ([L]); the copies' block scales are then not read
  wgrad(b.dyt, m.tensor ? b.dy_s : b.dyt_s, b.actt, m.tensor ? b.act_s : b.actt_s, a.dw2);
  QuantizeTransposedArgs from_fp8 = transposed_copy(a.x, a.counts, b.xt, b.xt_s);
  if (m.tensor) from_fp8.tensor_scales = a.x_scales;  // x's codes, transposed
  else from_fp8.x_scales = a.x_scales;
  quantize_fp8_transposed(from_fp8, stream);
  if (!copies_made) copy(a.d_h1, b.dh1_s, b.dh1t, b.dh1t_s);
  wgrad(b.dh1t, m.tensor ? b.dh1_s : b.dh1t_s, b.xt, m.tensor ? a.x_scales : b.xt_s, a.dw1);
}

}  // namespace moerail
