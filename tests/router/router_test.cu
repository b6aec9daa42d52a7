// GPU router against the CPU reference (moerail::ref::router_forward / router_backward) over every score
// function, groups, bias, scaling, losses, E not a power of two and T < T_max. Logits are distinct multiples of
// 1/512, so fp32 and the double reference agree on the selection except for rare near-ties (counted, bounded).
// The forward's packed fast path (router_packed.cuh) is also checked bit for bit against the generic kernel on
// the same inputs, ties, near-ties, NaN/Inf and out-of-range logits included.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "moerail/reference/router.h"
#include "moerail/router.h"
#include "moerail/status.h"
#include "common/compare.h"
#include "router/router_internal.h"

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
      // The packed fast path (top-k only, sigmoid-type, E = 256, K <= 8): the deepseek-v3 case above and these.
      {"packed: T = 1", 64, 1, 256, 8, rc(S::Sigmoid, false, 8, 4, true, 2.5, 0, 0), DType::BF16},
      {"packed: no groups, f32 logits, T not a multiple of 32", 300, 259, 256, 8, rc(S::Sigmoid, false, 0, 0, true, 1.0, 0, 0)},
      {"packed: no bias, no groups", 300, 300, 256, 8, rc(S::Sigmoid, false, 0, 0, false, 1.0, 0, 0), DType::BF16},
      {"packed: sqrtsoftplus, 4 groups keep 2 (G=8, P=4), f16", 300, 300, 256, 8, rc(S::SqrtSoftplus, false, 4, 2, true, 1.0, 0, 0), DType::F16},
      {"packed: 16 groups keep 4 (keep_groups rounds)", 300, 300, 256, 8, rc(S::Sigmoid, false, 16, 4, true, 1.0, 0, 0), DType::BF16},
      {"packed: K=1 (no normalization), scaled", 200, 199, 256, 1, rc(S::Sigmoid, false, 0, 0, true, 1.5, 0, 0), DType::BF16},
      {"packed: K=4, 8 groups keep 2", 200, 200, 256, 4, rc(S::Sigmoid, false, 8, 2, true, 1.0, 0, 0), DType::BF16},
  };
  std::uint64_t seed = 11;
  for (const Case& c : cases) run_case(c, seed++);
}

// ---- the packed fast path against the generic kernel, bit for bit -----------------------------------------------

// Inputs that stress the packed kernel's shortcuts (router_packed.cuh): its key window, its exactness check and
// fallback, its sigmoid range and its bad-logit path.
enum class Inputs {
  Grid,     // logits: multiples of 1/512 in [-4, 4); bias uniform in [-0.1, 0.1)
  Ties,     // logits in {-1, -0.5, 0, 0.5, 1}, bias in {0, 1/1024, 2/1024}: many exactly equal selection scores
  NearTie,  // logits 0.5 + k / 2^20 (f32) and bias in {0, 2^-23}: scores one or a few ulps apart
  Sparse,   // ~4 experts at logit 5 and the rest in [-12, -3): picks far below the best (outside the window)
  Extreme,  // Grid plus |x| >= 87 (+-100, +-1e4) and NaN/+-Inf logits (the generic sigmoid and the bad-logit report)
  NegBias,  // Grid logits, bias uniform in [-2, 0): negative selection scores
  NanBias,  // Grid logits, a few NaN and +-Inf biases (not validated on the GPU: the generic kernel's result stands)
};

const char* inputs_name(Inputs i) {
  switch (i) {
    case Inputs::Grid: return "grid";
    case Inputs::Ties: return "ties";
    case Inputs::NearTie: return "near-ties";
    case Inputs::Sparse: return "sparse";
    case Inputs::Extreme: return "extreme";
    case Inputs::NegBias: return "negative bias";
    case Inputs::NanBias: return "NaN/Inf bias";
  }
  return "?";
}

void fill_inputs(Inputs kind, ref::Rng& rng, const ref::HostTensor& lg, const ref::HostTensor& bias) {
  const std::int64_t n = lg.numel(), E = bias.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    double x = double(rng.below(4096)) / 512.0 - 4.0;
    if (kind == Inputs::Ties) x = 0.5 * double(rng.below(5)) - 1.0;
    if (kind == Inputs::NearTie) x = 0.5 + double(rng.below(4)) / double(1 << 20);
    if (kind == Inputs::Sparse) x = rng.below(64) == 0 ? 5.0 : rng.uniform(-12.0, -3.0);
    if (kind == Inputs::Extreme) {
      const std::int64_t r = rng.below(200);
      if (r == 0) x = std::nan("");
      if (r == 1) x = INFINITY;
      if (r == 2) x = -INFINITY;
      if (r >= 3 && r < 7) x = r == 3 ? 100.0 : r == 4 ? -100.0 : r == 5 ? 1e4 : -1e4;
    }
    lg.set_f(i, x);
  }
  for (std::int64_t e = 0; e < E; ++e) {
    double b = rng.uniform(-0.1, 0.1);
    if (kind == Inputs::Ties) b = double(rng.below(3)) / 1024.0;
    if (kind == Inputs::NearTie) b = rng.below(2) == 0 ? 0.0 : std::ldexp(1.0, -23);
    if (kind == Inputs::NegBias) b = rng.uniform(-2.0, 0.0);
    if (kind == Inputs::NanBias) {
      const std::int64_t r = rng.below(40);
      if (r == 0) b = std::nan("");
      if (r == 1) b = INFINITY;
      if (r == 2) b = -INFINITY;
    }
    bias.set_f(e, b);
  }
}

struct PackedCase {
  std::string name;
  std::int64_t T_max, T, K;
  RouterConfig r;
  DType dtype = DType::BF16;
  bool misaligned = false;  // logits and bias views off their 16-byte alignment (the scalar loads)
};

// One forward with the given kernel on fresh (poisoned) outputs; returns idx, probs and the status word.
struct ForwardOut {
  ref::HostTensor idx, probs;
  DeviceStatus status{};
};

ForwardOut forward_with(router_detail::ForwardKernel kernel, const MoeConfig& cfg, const DeviceTensor& lg,
                        const DeviceTensor* bias, const DeviceTensor& nt) {
  const std::int64_t T_max = cfg.max_tokens, K = cfg.topk;
  DeviceTensor idx(DType::I32, {T_max, K}), probs(DType::F32, {T_max, K}), st(DType::I32, {64});
  auto* status = static_cast<DeviceStatus*>(st.data());
  reset_status(status, nullptr);
  RouterForwardArgs f;
  f.logits = lg.view();
  if (bias != nullptr) f.expert_bias = bias->view();
  f.num_tokens = nt.view();
  f.topk_idx = idx.view();
  f.topk_probs = probs.view();
  f.status = status;
  router_detail::router_forward_using(kernel, cfg, f, nullptr);
  testing::cuda_ok(cudaDeviceSynchronize(), "router_forward");
  ForwardOut out{ref::HostTensor(DType::I32, {T_max, K}), ref::HostTensor(DType::F32, {T_max, K})};
  idx.download(out.idx);
  probs.download(out.probs);
  testing::cuda_ok(cudaMemcpy(&out.status, status, sizeof(DeviceStatus), cudaMemcpyDeviceToHost), "status");
  return out;
}

void run_packed_case(const PackedCase& c, Inputs kind, std::uint64_t seed) {
  SCOPED_TRACE(c.name + ", inputs " + inputs_name(kind));
  MoeConfig cfg;
  cfg.num_experts = 256;
  cfg.topk = c.K;
  cfg.max_tokens = c.T_max;
  cfg.router = c.r;
  const std::int64_t T = c.T, T_max = c.T_max, E = 256, K = c.K;
  ref::Rng rng(seed);
  ref::HostTensor lg(c.dtype, {T_max, E}), bias(DType::F32, {E});
  fill_inputs(kind, rng, lg, bias);
  DeviceTensor d_lg(c.dtype, {T_max, E}), d_bias(DType::F32, {E}), nt = testing::device_scalar_i32(int(T));
  if (c.misaligned) {
    d_lg.set_offset(dtype_size(c.dtype));
    d_bias.set_offset(4);
  }
  d_lg.upload(lg);
  d_bias.upload(bias);
  const DeviceTensor* b = c.r.use_expert_bias ? &d_bias : nullptr;
  const ForwardOut g = forward_with(router_detail::ForwardKernel::Generic, cfg, d_lg, b, nt);
  const ForwardOut p = forward_with(router_detail::ForwardKernel::Packed, cfg, d_lg, b, nt);
  const auto* gp = static_cast<const std::uint32_t*>(g.probs.view().data());
  const auto* pp = static_cast<const std::uint32_t*>(p.probs.view().data());
  int bad = 0;
  for (std::int64_t i = 0; i < T * K && bad < 5; ++i) {
    if (g.idx.i(i) != p.idx.i(i) || gp[i] != pp[i]) {
      ADD_FAILURE() << "[" << i / K << "," << i % K << "]: packed " << p.idx.i(i) << " / " << p.probs.f(i) << " (0x"
                    << std::hex << pp[i] << std::dec << ") but generic " << g.idx.i(i) << " / " << g.probs.f(i)
                    << " (0x" << std::hex << gp[i] << std::dec << ")";
      ++bad;
    }
  }
  testing::expect_untouched(p.idx, T * K, T_max * K, "packed topk_idx");
  testing::expect_untouched(p.probs, T * K, T_max * K, "packed topk_probs");
  EXPECT_EQ(std::memcmp(&g.status, &p.status, sizeof(DeviceStatus)), 0)
      << "status: packed counted " << p.status.bad_logits << " bad logits, generic " << g.status.bad_logits;
  if (kind == Inputs::Extreme && T > 0) EXPECT_GT(p.status.bad_logits, 0u);
}

TEST(RouterGpu, PackedMatchesGenericBitwise) {
  MOERAIL_REQUIRE_GPU();
  using S = ScoreFunction;
  const std::vector<PackedCase> cases = {
      {"deepseek-v3 (8 groups keep 4, G=4 P=2)", 1024, 1000, 8, rc(S::Sigmoid, false, 8, 4, true, 2.5, 0, 0)},
      {"deepseek-v3, misaligned rows", 300, 290, 8, rc(S::Sigmoid, false, 8, 4, true, 2.5, 0, 0), DType::BF16, true},
      {"deepseek-v3, f32 logits", 300, 300, 8, rc(S::Sigmoid, false, 8, 4, true, 2.5, 0, 0), DType::F32},
      {"no groups, f32", 300, 297, 8, rc(S::Sigmoid, false, 0, 0, true, 1.0, 0, 0), DType::F32},
      {"no groups, no bias", 300, 300, 8, rc(S::Sigmoid, false, 0, 0, false, 1.0, 0, 0)},
      {"sqrtsoftplus, 4 groups keep 2 (G=8, P=4), f16", 300, 270, 8, rc(S::SqrtSoftplus, false, 4, 2, true, 1.0, 0, 0), DType::F16},
      {"2 groups keep 1 (G=16, P=8)", 300, 300, 8, rc(S::Sigmoid, false, 2, 1, true, 1.0, 0, 0)},
      {"8 groups keep 1 (P=8)", 300, 300, 8, rc(S::Sigmoid, false, 8, 1, true, 1.0, 0, 0)},
      {"8 groups keep 8 (P=1)", 300, 300, 8, rc(S::Sigmoid, false, 8, 8, true, 1.0, 0, 0)},
      {"16 groups keep 4 (keep_groups rounds)", 300, 300, 8, rc(S::Sigmoid, false, 16, 4, true, 1.0, 0, 0)},
      {"32 groups keep 4 (G=1)", 300, 300, 8, rc(S::Sigmoid, false, 32, 4, true, 1.0, 0, 0)},
      {"K=4, 8 groups keep 2", 300, 300, 4, rc(S::Sigmoid, false, 8, 2, true, 1.0, 0, 0)},
      {"K=1, no groups", 300, 255, 1, rc(S::Sigmoid, false, 0, 0, true, 3.0, 0, 0)},
      {"T = 1", 64, 1, 8, rc(S::Sigmoid, false, 8, 4, true, 2.5, 0, 0)},
      {"T = 0", 64, 0, 8, rc(S::Sigmoid, false, 8, 4, true, 2.5, 0, 0)},
  };
  const Inputs kinds[] = {Inputs::Grid,    Inputs::Ties,    Inputs::NearTie, Inputs::Sparse,
                          Inputs::Extreme, Inputs::NegBias, Inputs::NanBias};
  std::uint64_t seed = 101;
  for (const PackedCase& c : cases)
    for (Inputs k : kinds) run_packed_case(c, k, seed++);
}

// The packed kernel runs only the cases of router_packed.cuh; named for anything else it fails, naming why.
TEST(RouterGpu, PackedRefusesOtherConfigs) {
  MOERAIL_REQUIRE_GPU();
  using S = ScoreFunction;
  struct Other {
    std::int64_t E, K;
    RouterConfig r;
  };
  const std::vector<Other> others = {
      {256, 8, rc(S::Softmax, false, 0, 0, false, 1.0, 0, 0)},     // softmax
      {128, 8, rc(S::Sigmoid, false, 0, 0, true, 1.0, 0, 0)},      // E != 256
      {256, 16, rc(S::Sigmoid, false, 0, 0, true, 1.0, 0, 0)},     // K > 8
      {256, 8, rc(S::Sigmoid, false, 8, 4, true, 1.0, 1e-3, 0)},   // aux loss
      {256, 8, rc(S::Sigmoid, false, 32, 1, true, 1.0, 0, 0)},     // every kept expert picked
  };
  for (const Other& o : others) {
    MoeConfig cfg;
    cfg.num_experts = o.E;
    cfg.topk = o.K;
    cfg.max_tokens = 64;
    cfg.router = o.r;
    DeviceTensor lg(DType::BF16, {64, o.E}), bias(DType::F32, {o.E}), nt = testing::device_scalar_i32(64);
    DeviceTensor idx(DType::I32, {64, o.K}), probs(DType::F32, {64, o.K}), losses(DType::F32, {2}),
        tpe(DType::I32, {o.E}), ws(DType::I32, {std::int64_t(router_workspace_bytes(cfg) / 4) + 1});
    RouterForwardArgs f;
    f.logits = lg.view();
    if (o.r.use_expert_bias) f.expert_bias = bias.view();
    f.num_tokens = nt.view();
    f.topk_idx = idx.view();
    f.topk_probs = probs.view();
    if (o.r.aux_loss_coeff > 0) {
      f.losses = losses.view();
      f.aux_tokens_per_expert = tpe.view();
      f.workspace = ws.view();
    }
    try {
      router_detail::router_forward_using(router_detail::ForwardKernel::Packed, cfg, f, nullptr);
      ADD_FAILURE() << "the packed kernel accepted E = " << o.E << ", K = " << o.K;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find("packed"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace moerail
