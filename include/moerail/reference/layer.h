// moerail/reference/layer.h — CPU reference of the whole MoE layer over R simulated expert-parallel ranks.
//
// Forward, on every rank r with its own token count T_r (0 allowed):
//   logits = x W_router^T                                   [T_r, E]   (the router's gate linear)
//   (topk_idx, topk_probs), aux, z = router(logits)         (ref/router.h; aux loss over the rank's tokens)
//   plan = plan_layout(topk_idx of all ranks)               (ref/layout.h)
//   recv, recv_probs = dispatch(x, topk_probs)              (ref/dispatch.h)
//   y = experts(recv, recv_probs) on the rank's L experts   (ref/experts.h)
//   out = combine(y) [+ shared_expert(x)]                   shared expert: same activation, FFN size
//                                                           cfg.shared_expert_ffn, concatenated GLU halves,
//                                                           no biases, no probs
// Backward of the objective  J = sum_r <out_r, d_out_r> + d_aux * sum_r aux_r + d_z * sum_r z_r  gives dx per
// rank, and gradients of every weight: router weight and shared expert summed over ranks (they are replicated),
// expert weights per owning rank.
//
// Everything is computed in double; the layer owns f64 host tensors. With Capacity::Factor a step that drops rows
// throws Error(CapacityOverflow) naming the rank, the rows needed and the rows available, unless
// LayerOptions::check_overflow is false (then the drop is silent here and visible in LayerForward::plan.overflow).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moerail/config.h"
#include "moerail/reference/experts.h"
#include "moerail/reference/host.h"
#include "moerail/reference/layout.h"
#include "moerail/tensor.h"

namespace moerail::ref {

struct LayerWeights {
  HostTensor router;                 // [E, H]
  HostTensor expert_bias;            // [E] (iff cfg.router.use_expert_bias)
  std::vector<HostTensor> w1, b1;    // per rank [L, F1, H], [L, F1] (b1 iff cfg.fc1_bias)
  std::vector<HostTensor> w2, b2;    // per rank [L, H, F],  [L, H]  (b2 iff cfg.fc2_bias)
  HostTensor shared_w1, shared_w2;   // [1, F1s, H], [1, H, Fs] (iff cfg.shared_expert_ffn > 0)

  // Random weights scaled 1/sqrt(fan_in), expert bias in [-0.1, 0.1], deterministic for a seed.
  static LayerWeights random(const MoeConfig& cfg, std::uint64_t seed);
  ExpertWeights experts(std::int64_t rank) const;
};

struct LayerOptions {
  bool check_overflow = true;
  std::int64_t peer_rows = -1;  // the host-API transport's bound per (source, peer) (ref::plan_layout; one chunk)
  // The routed experts' precision (ref/experts.h: an FP8 recipe QDQs their GEMM operands where the FP8 step
  // quantizes them, the experts' output gradient d_y from its bf16 value, as the step keeps it); the router and the
  // shared expert stay in the bf16 recipe.
  Recipe recipe = Recipe::BF16;
  Fp8WeightGrads fp8_weight_grads = Fp8WeightGrads::Fp8;  // as ExpertsBackwardArgs::fp8_weight_grads
};

// Everything the forward computed, kept for the backward and for inspection.
struct LayerForward {
  std::vector<HostTensor> logits, topk_idx, topk_probs;  // per rank [T_r, E], [T_r, K] i32, [T_r, K]
  LayoutPlan plan;
  std::vector<HostTensor> recv, recv_probs, y;           // per rank [capacity, H], [capacity], [capacity, H]
  std::vector<HostTensor> out;                           // per rank [T_r, H]
  std::vector<double> aux_loss, z_loss;                  // per rank
};

struct LayerGrads {
  std::vector<HostTensor> dx;          // per rank [T_r, H]
  HostTensor d_router;                 // [E, H], summed over ranks
  std::vector<HostTensor> dw1, db1, dw2, db2;  // per rank
  HostTensor d_shared_w1, d_shared_w2; // summed over ranks
};

struct LayerStageTimes {  // seconds spent in each stage of the last call (forward or backward)
  double router = 0, layout = 0, dispatch = 0, experts = 0, combine = 0, shared = 0;
};

class Layer {
 public:
  Layer(MoeConfig cfg, LayerWeights weights, LayerOptions options = {});

  const MoeConfig& config() const { return cfg_; }
  const LayerWeights& weights() const { return weights_; }
  LayerWeights& mutable_weights() { return weights_; }

  // x: one [T_r, H] view per rank (any floating dtype). logits (optional, one [T_r, E] view per rank) replace
  // x W_router^T: a GPU layer's rounded logits, so that the routing compared against is the GPU's (a tie broken
  // the other way by rounding would otherwise move a token to another expert). The backward is unchanged.
  LayerForward forward(std::span<const TensorView> x, LayerStageTimes* times = nullptr,
                       std::span<const TensorView> logits = {}) const;
  LayerGrads backward(std::span<const TensorView> x, const LayerForward& fwd, std::span<const TensorView> d_out,
                      double d_aux = 1.0, double d_z = 1.0, LayerStageTimes* times = nullptr) const;

 private:
  MoeConfig cfg_;
  LayerWeights weights_;
  LayerOptions options_;
};

// Central finite differences (step 1e-6, fp64) of J at `samples` random coordinates of every input and weight,
// compared with the analytic gradient `grads` of the same x, d_out, d_aux, d_z. Perturbs and restores x and the
// layer's weights in place. Relative error of one coordinate: |a - n| / max(|a|, |n|, 1e-3).
struct GradientCheck {
  double max_rel_error = 0;
  std::int64_t coordinates = 0;
  std::string worst;  // "dw1[rank 1][37]: analytic 0.12 numeric 0.1201"
};
GradientCheck check_gradients(Layer& layer, std::span<const TensorView> x, std::span<const TensorView> d_out,
                              const LayerGrads& grads, int samples, std::uint64_t seed, double d_aux = 1.0,
                              double d_z = 1.0);

}  // namespace moerail::ref
