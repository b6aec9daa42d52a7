// GPU router against the CPU reference (moerail::ref::router_forward / router_backward) over every score
// function, groups, bias, scaling, losses, E not a power of two and T < T_max. Logits are distinct multiples of
// 1/512, so fp32 and the double reference agree on the selection except for rare near-ties (counted, bounded).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "moerail/reference/router.h"
#include "moerail/router.h"
#include "moerail/status.h"
#include "permute/permute_common.h"

namespace moerail {
namespace {

using testing::DeviceTensor;
using testing::rows_of;

struct Case {
  std::string name;
  std::int64_t T_max, T, E, K;
  RouterConfig r;
  DType dtype = DType::F32;
};

RouterConfig rc(ScoreFunction s, bool pre, std::int64_t groups, std::int64_t gtopk, bool bias, double scale,
                double aux, double z) {
  RouterConfig r;
  r.score = s;
  r.pre_softmax = pre;
  r.num_groups = groups;
  r.group_topk = gtopk;
  r.use_expert_bias = bias;
  r.scaling_factor = scale;
  r.aux_loss_coeff = aux;
  r.z_loss_coeff = z;
  return r;
}

void run_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(c.name);
  MoeConfig cfg;
  cfg.num_experts = c.E;
  cfg.topk = c.K;
  cfg.max_tokens = c.T_max;
  cfg.router = c.r;
  const std::int64_t T = c.T, T_max = c.T_max, E = c.E, K = c.K;
  ref::Rng rng(seed);

  ref::HostTensor lg(c.dtype, {T_max, E}), bias(DType::F32, {E});
  for (std::int64_t i = 0; i < T_max * E; ++i) lg.set_f(i, double(rng.below(4096)) / 512.0 - 4.0);
  ref::fill_uniform(bias, rng, -0.1, 0.1);
  DeviceTensor d_lg(c.dtype, {T_max, E}), d_bias(DType::F32, {E}), nt = testing::device_scalar_i32(int(T));
  DeviceTensor tt = testing::device_scalar_i32(int(T + 100));
  DeviceTensor idx(DType::I32, {T_max, K}), probs(DType::F32, {T_max, K}), losses(DType::F32, {2}),
      tpe(DType::I32, {E}), ws(DType::I32, {std::int64_t(router_workspace_bytes(cfg) / 4) + 1}),
      st(DType::I32, {16}), d_probs(DType::F32, {T_max, K}), d_lg_out(DType::F32, {T_max, E});
  d_lg.upload(lg);
  d_bias.upload(bias);
  auto* status = static_cast<DeviceStatus*>(st.data());
  reset_status(status, nullptr);
  const bool losses_on = c.r.aux_loss_coeff > 0 || c.r.z_loss_coeff > 0;

  RouterForwardArgs f;
  f.logits = d_lg.view();
  if (c.r.use_expert_bias) f.expert_bias = d_bias.view();
  f.num_tokens = nt.view();
  f.total_tokens = tt.view();
  f.topk_idx = idx.view();
  f.topk_probs = probs.view();
  if (losses_on) f.losses = losses.view();
  if (c.r.aux_loss_coeff > 0) f.aux_tokens_per_expert = tpe.view();
  f.status = status;
  f.workspace = ws.view();
  router_forward(cfg, f, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  ref::HostTensor idx_r(DType::I32, {T, K}), probs_r(DType::F32, {T, K});
  const ref::RouterLosses lr = ref::router_forward(
      cfg, {rows_of(lg, T, E), c.r.use_expert_bias ? bias.view() : TensorView(), idx_r.view(), probs_r.view(), T + 100});
  ref::HostTensor idx_g(DType::I32, {T_max, K}), probs_g(DType::F32, {T_max, K});
  idx.download(idx_g);
  probs.download(probs_g);
  int mismatched = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    bool same = true;
    for (std::int64_t k = 0; k < K; ++k) same = same && idx_g.i(t * K + k) == idx_r.i(t * K + k);
    if (!same) {
      ++mismatched;
      continue;
    }
    for (std::int64_t k = 0; k < K; ++k)
      ASSERT_NEAR(probs_g.f(t * K + k), probs_r.f(t * K + k), 2e-6 * c.r.scaling_factor)
          << "topk_probs[" << t << "," << k << "]";
  }
  EXPECT_LE(mismatched, 1 + T / 500) << "tokens whose selection differs from the reference";
  testing::expect_untouched(idx_g, T * K, T_max * K, "topk_idx");
  if (losses_on) {
    const auto l = losses.to_vector<float>(2);
    EXPECT_NEAR(l[0], lr.aux_loss, 1e-4 * std::fabs(lr.aux_loss) + 1e-9) << "aux loss";
    EXPECT_NEAR(l[1], lr.z_loss, 1e-4 * std::fabs(lr.z_loss) + 1e-9) << "z-loss";
  }
  if (c.r.aux_loss_coeff > 0 && mismatched == 0) {
    const auto g = tpe.to_vector<std::int32_t>(std::size_t(E));
    for (std::int64_t e = 0; e < E; ++e) EXPECT_EQ(g[std::size_t(e)], lr.tokens_per_expert[std::size_t(e)]) << "tpe[" << e << "]";
  }
  EXPECT_TRUE(read_status(status, nullptr).ok());

  // Backward from the GPU's selection.
  ref::HostTensor dp(DType::F32, {T_max, K});
  ref::fill_normal(dp, rng, 1.0);
  d_probs.upload(dp);
  RouterBackwardArgs b;
  b.logits = d_lg.view();
  b.num_tokens = nt.view();
  b.total_tokens = tt.view();
  b.topk_idx = idx.view();
  b.d_topk_probs = d_probs.view();
  if (c.r.aux_loss_coeff > 0) b.aux_tokens_per_expert = tpe.view();
  b.d_aux_loss = 0.7f;
  b.d_z_loss = 1.3f;
  b.d_logits = d_lg_out.view();
  router_backward(cfg, b, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ref::HostTensor idx_t(DType::I32, {T, K}), dl_r(DType::F32, {T, E}), dl_g(DType::F32, {T_max, E});
  for (std::int64_t i = 0; i < T * K; ++i) idx_t.set_i(i, idx_g.i(i));
  ref::router_backward(cfg, {rows_of(lg, T, E), c.r.use_expert_bias ? bias.view() : TensorView(), idx_t.view(),
                             rows_of(dp, T, K), 0.7, 1.3, T + 100, dl_r.view()});
  d_lg_out.download(dl_g);
  testing::expect_close(dl_g, dl_r, T * E, E, "d_logits", 3e-5 * c.r.scaling_factor);
  testing::expect_untouched(dl_g, T * E, T_max * E, "d_logits");
}

TEST(RouterGpu, MatchesReference) {
  MOERAIL_REQUIRE_GPU();
  using S = ScoreFunction;
  const std::vector<Case> cases = {
      {"softmax post K=2", 300, 300, 8, 2, rc(S::Softmax, false, 0, 0, false, 1.0, 1e-2, 1e-3)},
      {"softmax pre, bf16 logits", 300, 250, 64, 6, rc(S::Softmax, true, 0, 0, false, 1.0, 1e-2, 0), DType::BF16},
      {"sigmoid K=1", 200, 200, 16, 1, rc(S::Sigmoid, false, 0, 0, false, 1.0, 0, 0)},
      {"sigmoid groups bias (deepseek-v3 routing)", 1024, 1000, 256, 8, rc(S::Sigmoid, false, 8, 4, true, 2.5, 1e-4, 0), DType::BF16},
      {"sqrtsoftplus bias aux", 300, 300, 96, 8, rc(S::SqrtSoftplus, false, 0, 0, true, 1.0, 1e-3, 1e-3)},
      {"softmax post qwen3 shape", 512, 512, 128, 8, rc(S::Softmax, false, 0, 0, false, 1.0, 1e-3, 0)},
      {"E not a power of two with groups", 257, 257, 48, 6, rc(S::Sigmoid, false, 6, 3, true, 1.0, 1e-2, 1e-3)},
      {"K = E", 100, 100, 6, 6, rc(S::Softmax, false, 0, 0, false, 1.0, 1e-2, 0)},
      {"E = 512", 128, 128, 512, 8, rc(S::Sigmoid, false, 0, 0, false, 1.0, 1e-2, 1e-3)},
      {"T = 0", 64, 0, 32, 4, rc(S::Sigmoid, false, 0, 0, false, 1.0, 1e-2, 1e-3)},
      // Group paths (router_kernels.cuh): lanes per group G = group_size / J, top list P = per_group rounded up.
      {"deepseek-v3 routing top-k only (lane groups G=4 P=2)", 600, 577, 256, 8, rc(S::Sigmoid, false, 8, 4, true, 2.5, 0, 0), DType::BF16},
      {"groups of one lane (G=1, J=8)", 300, 300, 256, 8, rc(S::Sigmoid, false, 32, 4, true, 1.0, 1e-3, 0)},
      {"groups of 8 lanes (G=8, P=4)", 300, 290, 256, 8, rc(S::SqrtSoftplus, false, 4, 2, true, 1.0, 0, 1e-3)},
      {"E=64 groups of 8, J=2 (G=4), softmax pre", 300, 300, 64, 6, rc(S::Softmax, true, 8, 3, false, 1.0, 1e-2, 0)},
      {"per_group = 3 (P=4), J=4 (G=8)", 300, 300, 128, 6, rc(S::Sigmoid, false, 4, 2, true, 1.0, 1e-2, 1e-3)},
      {"per_group = 8 (P=8), softmax post", 300, 300, 256, 8, rc(S::Softmax, false, 8, 1, false, 1.0, 1e-3, 0)},
      {"per_group = 1, J=1 (G=8)", 300, 300, 32, 4, rc(S::Sigmoid, false, 4, 4, true, 1.0, 0, 0)},
      {"groups of 15 (shared-memory path)", 300, 300, 60, 4, rc(S::Sigmoid, false, 4, 2, true, 1.0, 1e-2, 0)},
      {"E=508 groups of 127: shared-memory path over 48 KB", 128, 128, 508, 8, rc(S::Sigmoid, false, 4, 2, true, 1.0, 1e-2, 1e-3)},
      {"E=512 groups, aux and z (J=16, G=8)", 128, 128, 512, 8, rc(S::Sigmoid, false, 4, 2, true, 1.0, 1e-2, 1e-3)},
  };
  std::uint64_t seed = 11;
  for (const Case& c : cases) run_case(c, seed++);
}

}  // namespace
}  // namespace moerail
