// tests/reference/router_harness.h — what the tests of the reference router share: configs, well-separated random
// logits, and a forward into NaN-poisoned outputs (router_test.cpp, router_backward_test.cpp).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "moerail/config.h"
#include "moerail/reference/host.h"
#include "moerail/reference/router.h"

namespace moerail::test::router_ref {

using ref::HostTensor;

// f64 results of a few double operations: a few units of the last place.
inline constexpr double kF64Tol = 1e-14;

inline MoeConfig router_config(std::int64_t E, std::int64_t K, ScoreFunction score, bool pre_softmax = false) {
  MoeConfig cfg;
  cfg.num_experts = E;
  cfg.topk = K;
  cfg.max_tokens = 1024;
  cfg.router.score = score;
  cfg.router.pre_softmax = pre_softmax;
  return cfg;
}

// Logits [T, E] whose values in each row are spread over [-4, 4] at least 0.5 * 8 / (E - 1) apart, in random
// order: far enough apart that a finite-difference step cannot change which experts are selected.
inline HostTensor separated_logits(std::int64_t T, std::int64_t E, ref::Rng& rng) {
  HostTensor t(DType::F64, {T, E});
  const double spacing = 8.0 / double(E - 1);
  for (std::int64_t r = 0; r < T; ++r) {
    std::vector<double> v(E);
    for (std::int64_t e = 0; e < E; ++e) v[e] = -4.0 + spacing * (double(e) + rng.uniform(-0.25, 0.25));
    for (std::int64_t e = E - 1; e > 0; --e) std::swap(v[e], v[rng.below(e + 1)]);
    for (std::int64_t e = 0; e < E; ++e) t.set_f(r * E + e, v[e]);
  }
  return t;
}

struct Routed {
  HostTensor idx, probs;
  ref::RouterLosses losses;

  std::vector<std::int64_t> row_idx(std::int64_t t) const {
    const std::int64_t K = idx.view().size(1);
    std::vector<std::int64_t> v(K);
    for (std::int64_t k = 0; k < K; ++k) v[k] = idx.i(t * K + k);
    return v;
  }
  std::vector<double> row_probs(std::int64_t t) const {
    const std::int64_t K = probs.view().size(1);
    std::vector<double> v(K);
    for (std::int64_t k = 0; k < K; ++k) v[k] = probs.f(t * K + k);
    return v;
  }
};

// Runs the forward into NaN-poisoned outputs.
inline Routed route(const MoeConfig& cfg, const HostTensor& logits, const TensorView& bias = {},
                    std::int64_t total_tokens = -1, DType probs_dtype = DType::F64) {
  const std::int64_t T = logits.view().size(0);
  Routed out{HostTensor(DType::I32, {T, cfg.topk}), HostTensor(probs_dtype, {T, cfg.topk}), {}};
  out.idx.fill_nan();
  out.probs.fill_nan();
  ref::RouterForwardArgs args;
  args.logits = logits;
  args.expert_bias = bias;
  args.topk_idx = out.idx;
  args.topk_probs = out.probs;
  args.total_tokens = total_tokens;
  out.losses = ref::router_forward(cfg, args);
  return out;
}

}  // namespace moerail::test::router_ref
