// moerail/router.h — the router on the GPU: logits -> (topk_idx, topk_probs), aux loss and z-loss, and backward.
//
// Semantics are the CPU reference's (moerail/reference/router.h), i.e. TransformerEngine's fused router, in fp32:
// score functions softmax (pre- or post-top-k), sigmoid and sqrtsoftplus; group-limited top-k; an expert bias
// used for selection only; normalization of sigmoid-type weights when K > 1 (sum + 1e-20); scaling factor; ties to
// the lower expert (and group) index; topk_idx lists experts by descending selection score.
// Aux loss (cfg.router.aux_loss_coeff > 0): E * coeff / (K * T_total^2) * sum_e (sum_t a[t,e]) * tpe[e], a the
// unbiased, ungrouped aux scores, tpe their top-K counts; reduced in a fixed order (no float atomics), so the loss
// is the same bits on every run. T_total is read from device memory. z-loss: coeff * mean_t logsumexp(x_t)^2.
//
// T is read from device memory (num_tokens); rows t >= T are neither read nor written. A NaN/Inf logit is
// treated as -inf and reported in the DeviceStatus (status.h) when one is given.
// Limits: E <= 512, K <= 32, num_groups <= 32, K / group_topk <= 8.
//
// router_forward and router_backward: allocate nothing, never synchronize the host, may be captured in a CUDA
// graph. router_forward is one kernel, plus one small reduction kernel when a loss is enabled.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "moerail/config.h"
#include "moerail/status.h"
#include "moerail/tensor.h"

namespace moerail {

// Scratch bytes router_forward needs for cfg (per-block partial sums of the losses; 0 without losses).
std::size_t router_workspace_bytes(const MoeConfig& cfg);

struct RouterForwardArgs {
  TensorView logits;        // [T_max, E] bf16/f16/f32, device, read (rows t < T)
  TensorView expert_bias;   // [E] f32, device, read; required iff cfg.router.use_expert_bias, else absent
  TensorView num_tokens;    // [1] i32, device, read: T
  TensorView total_tokens;  // [1] i32, device, read: T_total of the aux loss; optional (absent = T)
  TensorView topk_idx;      // [T_max, K] i32, device, written (rows t < T)
  TensorView topk_probs;    // [T_max, K] f32, device, written (rows t < T)
  TensorView losses;        // [2] f32, device, written: {aux loss, z-loss}; required when a loss coeff is > 0
  TensorView aux_tokens_per_expert;  // [E] i32, device, written: tpe of the aux loss; required iff aux coeff > 0
  DeviceStatus* status = nullptr;    // device, optional: NaN/Inf logits are counted there
  TensorView workspace;     // [>= router_workspace_bytes(cfg)] bytes, device, scratch (absent when 0 bytes)
};
void router_forward(const MoeConfig& cfg, const RouterForwardArgs& args, cudaStream_t stream);

struct RouterBackwardArgs {
  TensorView logits;        // [T_max, E] bf16/f16/f32, device, read: as given to the forward
  TensorView num_tokens;    // [1] i32, device, read
  TensorView total_tokens;  // [1] i32, device, read; optional (absent = T), as given to the forward
  TensorView topk_idx;      // [T_max, K] i32, device, read: the forward's selection
  TensorView d_topk_probs;  // [T_max, K] f32, device, read
  TensorView aux_tokens_per_expert;  // [E] i32, device, read: the forward's; required iff aux coeff > 0
  float d_aux_loss = 1.0f;  // upstream gradients of the losses (captured by value in a graph) ...
  float d_z_loss = 1.0f;
  TensorView d_losses;      // ... or [2] f32, device, read: {d_aux, d_z}; optional, overrides the two above
  TensorView d_logits;      // [T_max, E] f32/bf16, device, written (rows t < T)
};
void router_backward(const MoeConfig& cfg, const RouterBackwardArgs& args, cudaStream_t stream);

}  // namespace moerail
