// moerail/reference/router.h — CPU reference of the router: logits -> (topk_idx, topk_probs), losses, backward.
//
// Semantics are TransformerEngine's fused router (fused_topk_with_score_function + aux-loss kernels), computed in
// double. Host views only; outputs are fully written; nothing allocates on the device; no CUDA involved.
//
// Forward, per token t (s = scores, w = weights):
//   softmax, pre_softmax:  s = softmax(logits[t, :]) over all E; select top-K of s; w = selected s
//   softmax, post:         select top-K of logits; w = softmax over the K selected logits
//   sigmoid:               s = sigmoid(logits);              select top-K of s (+ bias); w = s (unbiased)
//   sqrtsoftplus:          s = sqrt(softplus(logits));       select top-K of s (+ bias); w = s (unbiased)
//   sigmoid-type with K > 1: w /= (sum of the K selected w + 1e-20)
//   topk_probs = scaling_factor * w
// Group-limited top-k (num_groups > 1): group score = sum of the top (K / group_topk) selection scores in the
// group; keep the group_topk best groups, then take the top K among their experts.
// Ties go to the lower expert (and lower group) index. topk_idx[t, :] lists experts by descending selection score.
//
// Aux loss (coeff > 0), Megatron's switch load-balancing loss, from scores over all E with no bias and no groups
// (softmax, or sigmoid-type s / (sum s + 1e-20)); tokens_per_expert counts the top-K of those scores:
//   aux = E * coeff / (K * T_total^2) * sum_e (sum_t score[t, e]) * tokens_per_expert[e]
// T_total = total_tokens, or T when it is -1; the aux loss is 0 when T_total = 0.
// z-loss (coeff > 0): z = coeff * (1/T) * sum_t logsumexp(logits[t, :])^2 (the mean of the squares; 0 when T = 0).
//
// Backward: d_logits = the gradient of sum(d_topk_probs * topk_probs) + d_aux_loss * aux + d_z_loss * z, through
// the weights of the experts listed in topk_idx (the selection and tokens_per_expert are piecewise constant and
// carry no gradient). It recomputes what it needs from the logits; the expert bias only moves the selection, so it
// is checked but not used. sqrtsoftplus uses softplus'(x) = 1 where softplus(x) = x (x > 20), else sigmoid(x).
#pragma once

#include <cstdint>
#include <vector>

#include "moerail/config.h"
#include "moerail/tensor.h"

namespace moerail::ref {

struct RouterForwardArgs {
  TensorView logits;       // [T, E] f64/f32/bf16/f16, read
  TensorView expert_bias;  // [E] f64/f32 finite, read; given iff cfg.router.use_expert_bias (else a default view)
  TensorView topk_idx;     // [T, K] i32, written
  TensorView topk_probs;   // [T, K] f64/f32, written
  std::int64_t total_tokens = -1;  // T_total of the aux loss (tokens over the whole loss group), >= T; -1 = T
};

struct RouterLosses {
  double aux_loss = 0.0;                        // 0 when aux_loss_coeff == 0
  double z_loss = 0.0;                          // 0 when z_loss_coeff == 0
  std::vector<std::int64_t> tokens_per_expert;  // [E] top-K counts of the aux-loss scores (empty if no aux loss)
};

// Throws Error(InvalidArgument) naming the argument for an invalid cfg, a wrong shape, dtype or device,
// T > cfg.max_tokens, a non-finite logit or bias, an expert_bias missing or given against cfg, or
// total_tokens < T (other than -1); nothing is written then.
RouterLosses router_forward(const MoeConfig& cfg, const RouterForwardArgs& args);

struct RouterBackwardArgs {
  TensorView logits;        // [T, E], read (as given to the forward)
  TensorView expert_bias;   // [E], as given to the forward (checked the same way; the gradient does not use it)
  TensorView topk_idx;      // [T, K] i32, read: the forward's selection (K distinct experts in [0, E) per token)
  TensorView d_topk_probs;  // [T, K] f64/f32, read
  double d_aux_loss = 0.0;  // upstream gradient of the aux loss
  double d_z_loss = 0.0;    // upstream gradient of the z-loss
  std::int64_t total_tokens = -1;
  TensorView d_logits;      // [T, E] f64/f32, written
};

// Throws Error(InvalidArgument) as the forward does for cfg, logits, expert_bias and total_tokens; for a wrong
// shape, dtype or device of the other views; for a topk_idx entry outside [0, E) or repeated in its row; and for a
// non-finite d_aux_loss or d_z_loss; nothing is written then.
void router_backward(const MoeConfig& cfg, const RouterBackwardArgs& args);

}  // namespace moerail::ref
