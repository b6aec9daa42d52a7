// GPU tests of the FP8 expert MLP (Fp8GroupedMlp, moerail/experts_fp8.h) against the CPU reference of the same
// recipe (ref::experts_forward / experts_backward with Recipe::Fp8Blockwise): x arrives as e4m3 with 1x128 scales
// (the reference quantizer's codes, which the FP8 dispatch's equal bit for bit), the weights go through
// quantize_mlp_weights_fp8, and y, dx, d_probs, dW1 and dW2 are compared (relative Frobenius, the weight gradients
// expert by expert). The reference rounds h1, act, d_act and d_h1 to bf16 where the GPU keeps them in bf16, so both
// quantize the same values with the same scales; what is left is the GEMMs' fp32 sums and the bf16 rounding of
// y, dx and dW (~1e-3). The bound, 1e-2, is below what one e4m3 step on a few percent of an operand's elements gives
// (without the bf16 roundings in the reference the distances measured 1.4-1.9e-2); a scale from the wrong block,
// row or expert is an O(1) error. Also: rows past the segments untouched, an expert with no rows gets zero
// gradients, one captured graph replayed with other counts, and the configuration errors. The per-tensor recipe
// (Recipe::Fp8Tensor) is checked the same way against the reference of that recipe: x quantized on the device each
// step by quantize_fp8_experts (its scales depend on the counts), one scale per expert tensor everywhere; and the
// hybrid one (Recipe::Fp8TensorHybrid: dy and d_h1 in e5m2) likewise, its gradients' bounds 1.5x the e4m3 ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "experts/mlp_harness.h"
#include "moerail/error.h"
#include "moerail/experts_fp8.h"
#include "moerail/recipe.h"
#include "moerail/reference/quant.h"

namespace moerail::testing::fp8mlp {
namespace {

using mlp::DeviceTensor;
using mlp::HostInputs;
using ref::HostTensor;

constexpr double kTol = 1e-2;
// Per-tensor recipe, the weight gradients expert by expert: an expert's act (or d_h1) is quantized with one scale
// from its amax, so when the GPU's bf16 value of that one largest element differs from the reference's by an ulp
// (their h1 come from different fp32 sums: the per-tensor GEMM accumulates without promotion), every code of the
// expert's tensor moves with a scale 2^-8 apart: a few percent of the codes change by one e4m3 step, ~1-2% of the
// expert's dW2 where its segment has few rows to average over (1.4-1.6% measured on segments of 1 and 7 rows). A
// wrong scale is still an O(1) error; the whole tensors stay within kTol.
constexpr double kTensorExpertTol = 3e-2;
// The hybrid recipe's gradients are e5m2 (2 mantissa bits, e4m3 has 3): each of their code steps is twice as large
// relative to the element, and the rounding-boundary effects above move dx and the weight gradients further: measured
// 1.3-1.5x fp8-tensor's distances here (dx 7.6e-3 against 5.2e-3, dW1 7.6e-3 against 5.1e-3) and in the layer test,
// hence fp8-tensor's bounds times 1.5 for what is computed from them.
constexpr double kHybridFactor = 1.5;

MoeConfig fp8_config(Activation act, std::int64_t L, ProbMode mode) {
  MoeConfig c = mlp::small_config(act, L, 256, 256);
  c.prob_mode = mode;
  return c;
}

struct Ref {
  HostTensor y, dx, d_probs, dw1, dw2;
};

Ref reference(const MoeConfig& cfg, const HostInputs& in, const std::vector<std::int64_t>& counts,
              Fp8WeightGrads wgrad, Recipe recipe = Recipe::Fp8Blockwise) {
  const std::int64_t rows = in.x.view().size(0), H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out();
  const std::int64_t L = cfg.local_experts();
  Ref r{HostTensor(DType::F32, {rows, H}), HostTensor(DType::F32, {rows, H}), HostTensor(DType::F32, {rows}),
        HostTensor(DType::F32, {L, F1, H}), HostTensor(DType::F32, {L, H, F})};
  ref::ExpertsBackwardArgs ba = mlp::reference_backward_args(cfg, in, counts);
  ba.recipe = recipe;
  ba.fp8_weight_grads = wgrad;
  ref::ExpertsForwardArgs fa{in.x.view(), in.probs.view(), counts, ba.weights, r.y.view()};
  fa.recipe = recipe;
  ref::experts_forward(cfg, fa);
  ba.dx = r.dx.view();
  ba.d_probs = r.d_probs.view();
  ba.grads = {r.dw1.view(), TensorView(), r.dw2.view(), TensorView()};
  ref::experts_backward(cfg, ba);
  return r;
}

// Device state of one FP8 MLP: x in FP8, the quantized weights, outputs (poisoned), saved tensors, workspaces.
// Per-tensor recipe: x kept in bf16 too, quantized per expert at the start of every step.
struct Fp8Run {
  MoeConfig cfg;
  std::int64_t rows;
  Fp8WeightGrads wgrad;
  Recipe recipe;
  Fp8GroupedMlp mlp;
  DeviceTensor xq, xs, xbf, probs, counts, w1, w2, wq_mem, dy, y, h1, act, dx, d_probs, d_h1, dw1, dw2, fws, bws;
  Fp8MlpWeights wq;

  Fp8Run(const MoeConfig& c, const HostInputs& in, bool i64, cudaStream_t s,
         Fp8WeightGrads wg = Fp8WeightGrads::Fp8, Recipe rc = Recipe::Fp8Blockwise)
      : cfg(c), rows(in.x.view().size(0)), wgrad(wg), recipe(rc),
        mlp(c, Fp8MlpOptions{.weight_grads = wg, .recipe = rc}) {
    const std::int64_t H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out(), L = cfg.local_experts();
    if (is_per_tensor(recipe)) {
      xbf = DeviceTensor(in.x);
      xq = DeviceTensor(DType::F8E4M3, {rows, H});
      xs = DeviceTensor(DType::F32, {L});
    } else {
      HostTensor q(DType::F8E4M3, {rows, H}), sc(DType::F32, {rows, H / 128});
      ref::quantize_fp8(Fp8Scaling::Block1x128, in.x.view(), q.view(), sc.view());
      xq = DeviceTensor(q);
      xs = DeviceTensor(sc);
    }
    probs = DeviceTensor(in.probs);
    counts = DeviceTensor(i64 ? DType::I64 : DType::I32, {L});
    w1 = DeviceTensor(in.w1);
    w2 = DeviceTensor(in.w2);
    wq_mem = DeviceTensor(DType::Bool, {std::int64_t(fp8_mlp_weights_bytes(cfg, recipe))});
    wq = make_fp8_mlp_weights(cfg, wq_mem.data(), cuda::current_device(), recipe);
    quantize_mlp_weights_fp8(cfg, MlpWeights{w1.view(), {}, w2.view(), {}}, wq, s);
    dy = DeviceTensor(in.dy);
    y = DeviceTensor(DType::BF16, {rows, H});
    h1 = DeviceTensor(DType::BF16, {rows, F1});
    act = DeviceTensor(DType::BF16, {rows, F});
    dx = DeviceTensor(DType::BF16, {rows, H});
    d_probs = DeviceTensor(DType::F32, {rows});
    d_h1 = DeviceTensor(DType::BF16, {rows, F1});
    dw1 = DeviceTensor(DType::BF16, {L, F1, H});
    dw2 = DeviceTensor(DType::BF16, {L, H, F});
    fws = DeviceTensor(DType::Bool, {std::int64_t(mlp.forward_workspace_bytes(rows))});
    bws = DeviceTensor(DType::Bool, {std::int64_t(mlp.backward_workspace_bytes(rows))});
  }
  void set_counts(const std::vector<std::int64_t>& c) const {
    HostTensor h(counts.dtype(), {std::int64_t(c.size())});
    for (std::size_t e = 0; e < c.size(); ++e) h.set_i(std::int64_t(e), c[e]);
    counts.upload(h);
  }
  void poison_outputs() const {
    for (const DeviceTensor* t : {&y, &h1, &act, &dx, &d_probs, &d_h1, &dw1, &dw2}) t->poison();
  }
  // How the backward runs: one call for every gradient; the data gradients, then the weight gradients in a second
  // call that makes its own copies (Make); or with the copies of dy and d_h1 staged by the first call (Stage /
  // Staged: dy and d_h1 are poisoned between the calls under FP8 weight gradients, which must not read them then).
  enum class Backward { OneCall, TwoCalls, Staged };
  void step(cudaStream_t s, Backward how = Backward::OneCall) {
    if (is_per_tensor(recipe)) quantize_fp8_experts({xbf.view(), counts.view(), xq.view(), xs.view()}, s);
    mlp.forward({xq.view(), xs.view(), probs.view(), counts.view(), wq, y.view(), h1.view(), act.view(), fws.view()},
                s);
    Fp8MlpBackwardArgs b{xq.view(), xs.view(), probs.view(), counts.view(), wq, h1.view(), act.view(), dy.view(),
                         dx.view(), d_probs.view(), d_h1.view(), dw1.view(), dw2.view(), bws.view()};
    if (how == Backward::OneCall) {
      mlp.backward(b, s);
      return;
    }
    Fp8MlpBackwardArgs data = b, weights = b;
    data.dw1 = data.dw2 = TensorView();
    weights.dx = weights.d_probs = TensorView();
    if (how == Backward::Staged) {
      data.wgrad_operands = Fp8WgradOperands::Stage;
      weights.wgrad_operands = Fp8WgradOperands::Staged;
    }
    mlp.backward(data, s);
    if (how == Backward::Staged && wgrad == Fp8WeightGrads::Fp8) {
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      const HostTensor keep = dy.download(), keep_d_h1 = d_h1.download();
      dy.poison();
      d_h1.poison();
      mlp.backward(weights, s);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      dy.upload(keep);
      d_h1.upload(keep_d_h1);  // what the data call wrote (compare() reads it)
      return;
    }
    mlp.backward(weights, s);
  }
  // Per-tensor recipe: dW2 = dy^T act and dW1 = d_h1^T x against the products of this run's own operands (act and
  // d_h1 as the GPU wrote them; dy and x the inputs), each quantized per expert by the reference quantizer
  // (ref::quantize_fp8_experts), expert by expert at kTol: the weight gradients' codes and scales exactly, without
  // the upstream GEMMs' rounding that kTensorExpertTol allows for. The gradients in the recipe's format (e5m2 under
  // the hybrid recipe).
  void expect_dw_from_own_operands(const HostInputs& in, const std::vector<std::int64_t>& counts,
                                   const HostTensor& gw1, const HostTensor& gw2) const {
    const std::int64_t H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out(), L = cfg.local_experts();
    HostTensor hc(DType::I64, {L});
    for (std::int64_t e = 0; e < L; ++e) hc.set_i(e, counts[std::size_t(e)]);
    // want[e] = sum over the segment's rows of qdq(g)^T qdq(t), g [rows, N], t [rows, K]
    const DType gf = recipe == Recipe::Fp8TensorHybrid ? DType::F8E5M2 : DType::F8E4M3;
    auto decode = [gf](std::uint8_t c) { return gf == DType::F8E5M2 ? ref::e5m2_to_float(c) : ref::e4m3_to_float(c); };
    auto product = [&](const HostTensor& g, const HostTensor& t, std::int64_t N, std::int64_t K) {
      HostTensor gq(gf, {rows, N}), gs(DType::F32, {L}), tq(DType::F8E4M3, {rows, K}), ts(DType::F32, {L}),
          want(DType::F32, {L, N, K});
      ref::quantize_fp8_experts({g.view(), hc.view(), gq.view(), gs.view(), gf});
      ref::quantize_fp8_experts({t.view(), hc.view(), tq.view(), ts.view()});
      const std::uint8_t* g8 = static_cast<const std::uint8_t*>(gq.view().data());
      const std::uint8_t* t8 = static_cast<const std::uint8_t*>(tq.view().data());
      std::vector<double> acc(std::size_t(N * K));
      std::int64_t row = 0;
      for (std::int64_t e = 0; e < L; ++e) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (std::int64_t r = row; r < row + counts[std::size_t(e)]; ++r)
          for (std::int64_t n = 0; n < N; ++n) {
            const double a = double(decode(g8[r * N + n])) * gs.f(e);
            for (std::int64_t k = 0; k < K; ++k)
              acc[std::size_t(n * K + k)] += a * double(ref::e4m3_to_float(t8[r * K + k])) * ts.f(e);
          }
        for (std::int64_t i = 0; i < N * K; ++i) want.set_f(e * N * K + i, acc[std::size_t(i)]);
        row += counts[std::size_t(e)];
      }
      return want;
    };
    const HostTensor ga = act.download(), gd = d_h1.download();
    mlp::expect_close_per_expert("dw2 from this run's dy and act", gw2, product(in.dy, ga, H, F), L, kTol);
    mlp::expect_close_per_expert("dw1 from this run's d_h1 and x", gw1, product(gd, in.x, F1, H), L, kTol);
  }

  // The outputs against the reference over `counts`' segments; rows past them untouched, empty experts' gradients 0.
  void compare(const HostInputs& in, const std::vector<std::int64_t>& counts, const char* what) const {
    SCOPED_TRACE(std::string(what) + ", " + std::string(name_of(recipe)) + ", weight gradients in " +
                 std::string(name_of(wgrad)));
    const std::int64_t H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out(), L = cfg.local_experts();
    std::int64_t used = 0;
    for (std::int64_t c : counts) used += c;
    const Ref r = reference(cfg, in, counts, wgrad, recipe);
    const HostTensor gy = y.download(), gdx = dx.download(), gdp = d_probs.download(), gw1 = dw1.download(),
                     gw2 = dw2.download();
    const double grad_tol = recipe == Recipe::Fp8TensorHybrid ? kHybridFactor * kTol : kTol;  // downstream of dy
    mlp::expect_close("y", gy, r.y, used * H, kTol);
    mlp::expect_close("dx", gdx, r.dx, used * H, grad_tol);
    if (cfg.prob_mode == ProbMode::InActivation) mlp::expect_close("d_probs", gdp, r.d_probs, used, grad_tol);
    else mlp::expect_zero("d_probs", gdp, 0, used);
    const double expert_tol = !is_per_tensor(recipe) ? kTol
                              : recipe == Recipe::Fp8TensorHybrid ? kHybridFactor * kTensorExpertTol
                                                                  : kTensorExpertTol;
    mlp::expect_close_per_expert("dw1", gw1, r.dw1, L, expert_tol);
    mlp::expect_close_per_expert("dw2", gw2, r.dw2, L, expert_tol);
    mlp::expect_close("dw1", gw1, r.dw1, L * F1 * H, grad_tol);
    mlp::expect_close("dw2", gw2, r.dw2, L * H * F, grad_tol);
    if (is_per_tensor(recipe)) expect_dw_from_own_operands(in, counts, gw1, gw2);
    mlp::expect_untouched("y", gy, used * H);
    mlp::expect_untouched("dx", gdx, used * H);
    for (std::int64_t e = 0; e < L; ++e)
      if (counts[std::size_t(e)] == 0) {
        mlp::expect_zero("dw1", gw1, e * F1 * H, F1 * H);
        mlp::expect_zero("dw2", gw2, e * H * F, H * F);
      }
    // for information: the distances measured
    auto rel = [](const HostTensor& a, const HostTensor& b, std::int64_t n) {
      double num = 0, den = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        num += (a.f(i) - b.f(i)) * (a.f(i) - b.f(i));
        den += b.f(i) * b.f(i);
      }
      return std::sqrt(num / std::max(den, 1e-300));
    };
    std::printf("  %s, %s, %s wgrad: y %.2e dx %.2e dw1 %.2e dw2 %.2e (relative Frobenius to the FP8 reference)\n",
                what, name_of(recipe).data(), name_of(wgrad).data(),
                rel(gy, r.y, used * H), rel(gdx, r.dx, used * H), rel(gw1, r.dw1, L * F1 * H),
                rel(gw2, r.dw2, L * H * F));
  }
};

TEST(Fp8Mlp, MatchesTheFp8ReferenceForwardAndBackward) {
  MOERAIL_REQUIRE_GPU();
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  struct Case {
    Activation act;
    ProbMode mode;
    std::vector<std::int64_t> counts;
    std::int64_t rows;
    bool i64;
  };
  const std::vector<Case> cases = {
      {Activation::SwiGLU, ProbMode::InActivation, {37, 0, 130, 64}, 300, false},  // uneven, an empty expert
      {Activation::SwiGLU, ProbMode::InCombine, {0, 0, 257, 0}, 260, true},        // one expert, two row blocks+
      {Activation::GeGLU, ProbMode::InActivation, {128, 1, 5, 200, 7, 0, 64, 33}, 500, false},
  };
  std::uint64_t seed = 70;
  for (const Case& c : cases) {
    const MoeConfig cfg = fp8_config(c.act, std::int64_t(c.counts.size()), c.mode);
    const HostInputs in = mlp::make_inputs(cfg, c.rows, seed++);
    for (const auto& [recipe, wgrad] : {std::pair{Recipe::Fp8Blockwise, Fp8WeightGrads::Fp8},
                                        std::pair{Recipe::Fp8Blockwise, Fp8WeightGrads::BF16},
                                        std::pair{Recipe::Fp8Tensor, Fp8WeightGrads::Fp8},
                                        std::pair{Recipe::Fp8TensorHybrid, Fp8WeightGrads::Fp8}}) {
      Fp8Run run(cfg, in, c.i64, s, wgrad, recipe);
      run.set_counts(c.counts);
      for (const auto& [how, what] : {std::pair{Fp8Run::Backward::OneCall, "one backward call"},
                                      std::pair{Fp8Run::Backward::TwoCalls, "data, then weights (Make)"},
                                      std::pair{Fp8Run::Backward::Staged, "data (Stage), then weights (Staged)"}}) {
        run.poison_outputs();
        run.bws.poison();  // no pass may read copies an earlier pass left in the workspace
        run.step(s, how);
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        run.compare(in, c.counts, (std::string(name_of(c.act)) + ", " + what).c_str());
      }
    }
  }
  cudaStreamDestroy(s);
}

// accumulate_weight_grads: the weight gradients added into fp32 buffers that hold values (Megatron-LM's main_grad),
// by a weights-only call after the data call, in both kinds of weight gradients; experts without rows keep what
// their buffers held, bit for bit.
TEST(Fp8Mlp, AccumulatesWeightGradientsIntoFp32) {
  MOERAIL_REQUIRE_GPU();
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  const MoeConfig cfg = fp8_config(Activation::SwiGLU, 4, ProbMode::InActivation);
  const std::vector<std::int64_t> counts = {37, 0, 130, 64};
  const HostInputs in = mlp::make_inputs(cfg, 300, 95);
  const std::int64_t H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out(), L = cfg.local_experts();
  ref::Rng rng(96);
  HostTensor held1(DType::F32, {L, F1, H}), held2(DType::F32, {L, H, F});
  for (HostTensor* t : {&held1, &held2})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set_f(i, rng.normal() * 0.05);
  auto added = [](const HostTensor& got, const HostTensor& held) {  // got - held, exact in double
    HostTensor d(DType::F64, {got.numel()});
    for (std::int64_t i = 0; i < got.numel(); ++i) d.set_f(i, got.f(i) - held.f(i));
    return d;
  };
  for (const auto& [recipe, wgrad] : {std::pair{Recipe::Fp8Blockwise, Fp8WeightGrads::Fp8},
                                      std::pair{Recipe::Fp8Blockwise, Fp8WeightGrads::BF16},
                                      std::pair{Recipe::Fp8Tensor, Fp8WeightGrads::Fp8},
                                      std::pair{Recipe::Fp8TensorHybrid, Fp8WeightGrads::Fp8}}) {
    SCOPED_TRACE(std::string(name_of(recipe)) + ", weight gradients in " + std::string(name_of(wgrad)));
    Fp8Run run(cfg, in, false, s, wgrad, recipe);
    run.set_counts(counts);
    const DeviceTensor acc1(held1), acc2(held2);
    run.step(s);  // forward and every gradient (d_h1 for the weights-only call below)
    Fp8MlpBackwardArgs b{run.xq.view(), run.xs.view(), run.probs.view(), run.counts.view(), run.wq, run.h1.view(),
                         run.act.view(), run.dy.view(), TensorView(), TensorView(), run.d_h1.view(), acc1.view(),
                         acc2.view(), run.bws.view()};
    b.accumulate_weight_grads = true;
    run.mlp.backward(b, s);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const Ref r = reference(cfg, in, counts, wgrad, recipe);
    const HostTensor d1 = added(acc1.download(), held1), d2 = added(acc2.download(), held2);
    const double expert_tol = !is_per_tensor(recipe) ? kTol
                              : recipe == Recipe::Fp8TensorHybrid ? kHybridFactor * kTensorExpertTol
                                                                  : kTensorExpertTol;
    mlp::expect_close_per_expert("dw1 added", d1, r.dw1, L, expert_tol);
    mlp::expect_close_per_expert("dw2 added", d2, r.dw2, L, expert_tol);
    for (std::int64_t e = 0; e < L; ++e)
      if (counts[std::size_t(e)] == 0) {
        mlp::expect_zero("dw1 added", d1, e * F1 * H, F1 * H);
        mlp::expect_zero("dw2 added", d2, e * H * F, H * F);
      }
    b.dw1 = run.dw1.view();  // bf16: accumulation is into fp32 only
    b.dw2 = run.dw2.view();
    mlp::expect_error_mentions([&] { run.mlp.backward(b, s); }, "dw1");
  }
  cudaStreamDestroy(s);
}

// One captured forward + backward, replayed with the counts below.
void replay_with_other_counts(Fp8WeightGrads wgrad, Recipe recipe) {
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  const MoeConfig cfg = fp8_config(Activation::SwiGLU, 4, ProbMode::InActivation);
  const HostInputs in = mlp::make_inputs(cfg, 400, 90);
  Fp8Run run(cfg, in, false, s, wgrad, recipe);
  run.set_counts({100, 100, 100, 100});
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaGraph_t g = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  run.step(s);
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
  for (const std::vector<std::int64_t>& counts :
       {std::vector<std::int64_t>{100, 100, 100, 100}, {0, 390, 0, 10}, {0, 0, 0, 0}, {3, 129, 128, 1}}) {
    run.set_counts(counts);
    run.poison_outputs();
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    std::int64_t used = 0;
    for (std::int64_t c : counts) used += c;
    if (used == 0) {
      mlp::expect_untouched("y", run.y.download(), 0);
      mlp::expect_zero("dw1", run.dw1.download(), 0, cfg.local_experts() * cfg.fc1_out() * cfg.hidden);
      continue;
    }
    run.compare(in, counts, "graph replay");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
}

// Forward and backward captured once, replayed with other counts (0 rows included): the counts are read on the
// device only. Both kinds of weight gradients, and the per-tensor recipe (its scales from the replayed counts).
TEST(Fp8Mlp, GraphReplaysWithOtherCounts) {
  MOERAIL_REQUIRE_GPU();
  for (const Fp8WeightGrads wgrad : {Fp8WeightGrads::Fp8, Fp8WeightGrads::BF16})
    replay_with_other_counts(wgrad, Recipe::Fp8Blockwise);
  replay_with_other_counts(Fp8WeightGrads::Fp8, Recipe::Fp8Tensor);
  replay_with_other_counts(Fp8WeightGrads::Fp8, Recipe::Fp8TensorHybrid);
}

TEST(Fp8Mlp, RefusesWhatTheRecipeCannotRun) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig cfg = fp8_config(Activation::SwiGLU, 2, ProbMode::InActivation);
  cfg.fc1_bias = true;
  mlp::expect_error_mentions([&] { Fp8GroupedMlp m(cfg); }, "fc1_bias", ErrorCode::Unsupported);
  cfg = fp8_config(Activation::SwiGLU, 2, ProbMode::InActivation);
  cfg.ffn_hidden = 192;
  mlp::expect_error_mentions([&] { Fp8GroupedMlp m(cfg); }, "multiples of 128", ErrorCode::Unsupported);
  cfg = fp8_config(Activation::SwiGLU, 2, ProbMode::InActivation);
  mlp::expect_error_mentions([&] { Fp8GroupedMlp m(cfg, Fp8MlpOptions{.weight_grads = Fp8WeightGrads(7)}); },
                             "options.weight_grads = 7");
  mlp::expect_error_mentions(
      [&] {
        Fp8GroupedMlp m(cfg, Fp8MlpOptions{.weight_grads = Fp8WeightGrads::BF16, .recipe = Recipe::Fp8TensorHybrid});
      },
      "options.weight_grads = bf16 with options.recipe = fp8-tensor-hybrid", ErrorCode::Unsupported);
  mlp::expect_error_mentions([&] { Fp8GroupedMlp m(cfg, Fp8MlpOptions{.recipe = Recipe::BF16}); },
                             "options.recipe = bf16");
  mlp::expect_error_mentions(
      [&] { Fp8GroupedMlp m(cfg, Fp8MlpOptions{.weight_grads = Fp8WeightGrads::BF16, .recipe = Recipe::Fp8Tensor}); },
      "options.weight_grads = bf16", ErrorCode::Unsupported);
  {  // per-tensor weights given to a blockwise MLP
    const HostInputs in = mlp::make_inputs(cfg, 64, 6);
    Fp8Run tensor_run(cfg, in, false, nullptr, Fp8WeightGrads::Fp8, Recipe::Fp8Tensor);
    Fp8GroupedMlp blockwise(cfg);
    Fp8Run block_run(cfg, in, false, nullptr);
    Fp8MlpForwardArgs f{block_run.xq.view(), block_run.xs.view(), block_run.probs.view(), block_run.counts.view(),
                        tensor_run.wq, block_run.y.view(), block_run.h1.view(), block_run.act.view(),
                        block_run.fws.view()};
    mlp::expect_error_mentions([&] { blockwise.forward(f, nullptr); }, "weights.recipe = fp8-tensor");
  }
  Fp8GroupedMlp m(cfg);
  const HostInputs in = mlp::make_inputs(cfg, 64, 5);
  Fp8Run run(cfg, in, false, nullptr);
  Fp8MlpForwardArgs a{run.xq.view(), run.xs.view(), run.probs.view(), run.counts.view(), run.wq, run.y.view(),
                      run.h1.view(), run.act.view(), run.fws.view()};
  a.x = run.y.view();  // bf16 rows where e4m3 ones are expected
  mlp::expect_error_mentions([&] { m.forward(a, nullptr); }, "x has dtype");
  a.x = run.xq.view();
  a.workspace = TensorView(run.fws.data(), DType::Bool, {16}, run.fws.view().device());
  mlp::expect_error_mentions([&] { m.forward(a, nullptr); }, "workspace has 16 bytes");
  Fp8MlpBackwardArgs b{run.xq.view(), run.xs.view(), run.probs.view(), run.counts.view(), run.wq, run.h1.view(),
                       run.act.view(), run.dy.view(), run.dx.view(), run.d_probs.view(), run.d_h1.view(),
                       run.dw1.view(), run.dw2.view(), run.bws.view()};
  b.wgrad_operands = Fp8WgradOperands::Stage;  // Stage with the weight gradients in the same call
  mlp::expect_error_mentions([&] { m.backward(b, nullptr); }, "Stage is for the data call");
  b.wgrad_operands = Fp8WgradOperands::Staged;
  mlp::expect_error_mentions([&] { m.backward(b, nullptr); }, "Staged is for the weights call");
  b.wgrad_operands = Fp8WgradOperands(5);
  mlp::expect_error_mentions([&] { m.backward(b, nullptr); }, "wgrad_operands = 5");
  // a Staged weights call needs the copies a Stage call staged in the same workspace for the same rows and counts
  Fp8MlpBackwardArgs weights = b, data = b;
  weights.dx = weights.d_probs = TensorView();
  weights.wgrad_operands = Fp8WgradOperands::Staged;
  data.dw1 = data.dw2 = TensorView();
  data.wgrad_operands = Fp8WgradOperands::Stage;
  run.set_counts({64, 0});
  mlp::expect_error_mentions([&] { m.backward(weights, nullptr); }, "the last Stage call");  // none yet
  m.backward(data, nullptr);
  const DeviceTensor other(DType::Bool, {std::int64_t(m.backward_workspace_bytes(64))});
  Fp8MlpBackwardArgs elsewhere = weights;
  elsewhere.workspace = other.view();
  mlp::expect_error_mentions([&] { m.backward(elsewhere, nullptr); }, "the last Stage call");  // another workspace
  m.backward(data, nullptr);
  m.backward(weights, nullptr);  // the pair, as staged
  mlp::expect_error_mentions([&] { m.backward(weights, nullptr); }, "the last Stage call");  // consumed
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace moerail::testing::fp8mlp
