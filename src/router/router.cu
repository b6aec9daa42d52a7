// Host launchers of the router (include/moerail/router.h): argument checks, workspace layout, kernel choice.
// Kernels: router_kernels.cuh (forward), router_backward_kernels.cuh. Bytes moved: forward reads T * E logits and
// writes T * K * 8 bytes (idx, probs); the loss partials add blocks * E * 8 bytes written and read once. Backward
// reads T * E logits and T * K * 8 and writes T * E gradients.
#include "moerail/router.h"

#include "core/cuda_check.h"
#include "router/router_backward_kernels.cuh"
#include "router/router_internal.h"
#include "router/router_kernels.cuh"
#include "router/router_packed.cuh"

namespace moerail {
namespace {

using namespace router_detail;

constexpr int kMaxExperts = 512;
constexpr int kMaxTopK = 32;

std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }

int forward_blocks(const MoeConfig& cfg) {
  const std::int64_t b = (cfg.max_tokens + kTokensPerBlock - 1) / kTokensPerBlock;
  return int(b > 0 ? b : 1);  // at least one block: it also resets the finalize ticket
}

bool has_aux(const MoeConfig& cfg) { return cfg.router.aux_loss_coeff > 0; }
bool has_z(const MoeConfig& cfg) { return cfg.router.z_loss_coeff > 0; }

Score score_of(const RouterConfig& r) {
  switch (r.score) {
    case ScoreFunction::Softmax: return r.pre_softmax ? Score::SoftmaxPre : Score::SoftmaxPost;
    case ScoreFunction::Sigmoid: return Score::Sigmoid;
    case ScoreFunction::SqrtSoftplus: return Score::SqrtSoftplus;
  }
  return Score::Sigmoid;
}

// J: experts per lane, the smallest of 1, 2, 4, 8, 16 with 32 * J >= E.
int experts_per_lane(std::int64_t E) {
  int j = 1;
  while (32 * j < E) j *= 2;
  return j;
}

// Calls f(std::integral_constant<int, J>) for the J of E.
template <typename F>
void dispatch_j(std::int64_t E, F&& f) {
  switch (experts_per_lane(E)) {
    case 1: f(std::integral_constant<int, 1>{}); return;
    case 2: f(std::integral_constant<int, 2>{}); return;
    case 4: f(std::integral_constant<int, 4>{}); return;
    case 8: f(std::integral_constant<int, 8>{}); return;
    default: f(std::integral_constant<int, 16>{}); return;
  }
}

// How the forward runs cfg: which kernel, and its launch (constants and their reasons: router_kernels.cuh).
struct ForwardPlan {
  ForwardKernel kernel = ForwardKernel::Generic;  // Generic or Packed
  int blocks = 1;
  int group_lanes_log2 = -1;  // lane group path: log2(G), G = group_size / J lanes per group; -1 = none
  int group_buf = 0;          // floats per warp of the shared-memory group path (0 when it is not used)
  std::size_t smem = 0;       // dynamic shared memory bytes (ForwardSmem)
};

// Why router_forward_packed_kernel cannot run cfg, or "" when it can (its cases: router_packed.cuh). Every
// num_groups > 1 that divides E = 256 gives whole groups of a power-of-two count of lanes (the lane group path),
// since check_config caps num_groups at 32.
std::string_view packed_unsupported(const MoeConfig& cfg) {
  const RouterConfig& r = cfg.router;
  if (has_aux(cfg) || has_z(cfg)) return "an aux loss or z-loss is enabled";
  if (r.score == ScoreFunction::Softmax) return "the score function is softmax";
  if (cfg.num_experts != kPackedE) return "num_experts is not 256";
  if (cfg.topk > kPackedMaxK) return "topk is above 8";
  // Every kept expert picked: the picks reach the group's lowest scores, often outside the packed key window.
  if (r.num_groups > 1 && r.group_topk * (cfg.num_experts / r.num_groups) == cfg.topk)
    return "group_topk * group size = topk (every kept expert is picked)";
  return "";
}

// The one place that chooses the forward kernel: the packed fast path wherever it applies, else the generic
// kernel. Packed: about half the warp instructions per deepseek-v3 token (SASS count, router_packed.cuh;
// docs/kernels.md has both kernels' times).
ForwardPlan forward_plan(const MoeConfig& cfg, ForwardKernel requested) {
  const RouterConfig& r = cfg.router;
  const std::int64_t E = cfg.num_experts;
  ForwardPlan plan;
  plan.blocks = forward_blocks(cfg);
  const std::string_view no_packed = packed_unsupported(cfg);
  if (requested == ForwardKernel::Packed && !no_packed.empty())
    fail_with(ErrorCode::Unsupported, "router_forward", "the packed kernel cannot run this configuration: ",
              no_packed);
  plan.kernel = requested == ForwardKernel::Generic || !no_packed.empty() ? ForwardKernel::Generic
                                                                          : ForwardKernel::Packed;
  if (r.num_groups > 1) {
    // Lane path when a group is whole lanes and their count G is a power of two (every preset); else shared memory.
    const std::int64_t J = experts_per_lane(E), group_size = E / r.num_groups, G = group_size / J;
    if (group_size % J == 0 && G >= 1 && G <= 32 && (G & (G - 1)) == 0) {
      plan.group_lanes_log2 = 0;
      while ((std::int64_t(1) << plan.group_lanes_log2) < G) ++plan.group_lanes_log2;
    } else {
      plan.group_buf = group_buf_floats(int(E));
    }
  }
  if (plan.kernel == ForwardKernel::Packed) {
    if (r.num_groups > 1 && plan.group_lanes_log2 < 0)
      fail_with(ErrorCode::Internal, "router_forward", "num_groups = ", r.num_groups,
                " with E = 256 should take the lane group path");
    plan.group_buf = 0;
    plan.smem = 0;  // static shared memory only
    return plan;
  }
  const bool aux = r.aux_loss_coeff > 0, loss = aux || r.z_loss_coeff > 0;
  plan.smem = ForwardSmem::make(int(E), plan.group_buf, aux, loss).bytes();
  return plan;
}

// Lets `kernel` use `smem` bytes of dynamic shared memory: above the default 48 KB it opts in
// (cudaFuncSetAttribute, not a stream operation, so legal during graph capture); beyond the device's opt-in limit
// it fails naming E.
template <typename Kernel>
void allow_smem(std::string_view op, Kernel* kernel, std::size_t smem, const MoeConfig& cfg) {
  constexpr std::size_t kDefault = 48 * 1024;
  if (smem <= kDefault) return;
  int optin = 0;
  MOERAIL_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, cuda::current_device()));
  if (smem > std::size_t(optin))
    fail_with(ErrorCode::Unsupported, op, "num_experts = ", cfg.num_experts, " (num_groups = ", cfg.router.num_groups,
              ", aux loss ", cfg.router.aux_loss_coeff > 0 ? "on" : "off", ") needs ", smem,
              " bytes of shared memory per block but the device allows at most ", optin);
  MOERAIL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
}

void check_config(std::string_view op, const MoeConfig& cfg) {
  cfg.validate();
  const RouterConfig& r = cfg.router;
  if (cfg.num_experts > kMaxExperts)
    fail_with(ErrorCode::Unsupported, op, "num_experts = ", cfg.num_experts, " but at most ", kMaxExperts,
              " are supported (one warp holds a token's logits in registers)");
  if (cfg.topk > kMaxTopK)
    fail_with(ErrorCode::Unsupported, op, "topk = ", cfg.topk, " but at most ", kMaxTopK, " are supported");
  if (r.num_groups > 1) {
    if (r.num_groups > 32)
      fail_with(ErrorCode::Unsupported, op, "router.num_groups = ", r.num_groups, " but at most 32 are supported");
    if (cfg.topk / r.group_topk > kMaxPerGroup)
      fail_with(ErrorCode::Unsupported, op, "topk / router.group_topk = ", cfg.topk / r.group_topk,
                " but at most ", kMaxPerGroup, " are supported");
  }
}

bool logits_vec_ok(const TensorView& logits, std::int64_t E) {
  const int J = experts_per_lane(E);
  return E == 32 * J && (E * std::int64_t(dtype_size(logits.dtype()))) % 16 == 0 && cuda::aligned16(logits.data());
}

void check_tensor(std::string_view op, std::string_view name, const TensorView& v,
                  std::initializer_list<std::int64_t> shape, std::initializer_list<DType> dtypes, Device d) {
  check_shape(op, name, v, shape);
  check_dtype(op, name, v, dtypes);
  check_device(op, name, v, d);
}

}  // namespace

std::size_t router_workspace_bytes(const MoeConfig& cfg) {
  if (!has_aux(cfg) && !has_z(cfg)) return 0;
  const std::size_t B = std::size_t(forward_blocks(cfg)), E = std::size_t(cfg.num_experts);
  return 2 * align256(B * E * 4) + align256(B * 4) + align256(E * 4) + align256(4);
}

void router_forward(const MoeConfig& cfg, const RouterForwardArgs& a, cudaStream_t stream) {
  router_detail::router_forward_using(ForwardKernel::Auto, cfg, a, stream);
}

void router_detail::router_forward_using(ForwardKernel choice, const MoeConfig& cfg, const RouterForwardArgs& a,
                                         cudaStream_t stream) {
  constexpr std::string_view op = "router_forward";
  check_config(op, cfg);
  const RouterConfig& r = cfg.router;
  const std::int64_t T_max = cfg.max_tokens, E = cfg.num_experts, K = cfg.topk;
  const Device d = Device::cuda(cuda::current_device());
  check_tensor(op, "logits", a.logits, {T_max, E}, {DType::BF16, DType::F16, DType::F32}, d);
  const bool sigmoid_type = r.score != ScoreFunction::Softmax;
  if (r.use_expert_bias) {
    if (!a.expert_bias.defined()) fail(op, "expert_bias is absent but cfg.router.use_expert_bias is set");
    check_tensor(op, "expert_bias", a.expert_bias, {E}, {DType::F32}, d);
  } else if (a.expert_bias.defined()) {
    fail(op, "expert_bias is given but cfg.router.use_expert_bias is not set (expected no bias)");
  }
  check_tensor(op, "num_tokens", a.num_tokens, {1}, {DType::I32}, d);
  if (a.total_tokens.defined()) check_tensor(op, "total_tokens", a.total_tokens, {1}, {DType::I32}, d);
  check_tensor(op, "topk_idx", a.topk_idx, {T_max, K}, {DType::I32}, d);
  check_tensor(op, "topk_probs", a.topk_probs, {T_max, K}, {DType::F32}, d);
  const bool aux = has_aux(cfg), z = has_z(cfg);
  if (aux || z) check_tensor(op, "losses", a.losses, {2}, {DType::F32}, d);
  if (aux) check_tensor(op, "aux_tokens_per_expert", a.aux_tokens_per_expert, {E}, {DType::I32}, d);
  const std::size_t ws = router_workspace_bytes(cfg);
  if (ws > 0) {
    check_device(op, "workspace", a.workspace, d);
    if (a.workspace.nbytes() < ws)
      fail(op, "workspace has ", a.workspace.nbytes(), " bytes but router_workspace_bytes(cfg) = ", ws);
  }

  const ForwardPlan plan = forward_plan(cfg, choice);
  const int blocks = plan.blocks;
  RouterParams p{};
  p.logits = a.logits.data();
  p.bias = (r.use_expert_bias && sigmoid_type) ? a.expert_bias.as<const float>() : nullptr;  // softmax: no bias
  p.num_tokens = a.num_tokens.as<const std::int32_t>();
  p.total_tokens = a.total_tokens.defined() ? a.total_tokens.as<const std::int32_t>() : nullptr;
  p.topk_idx = a.topk_idx.as<std::int32_t>();
  p.topk_probs = a.topk_probs.as<float>();
  p.losses = (aux || z) ? a.losses.as<float>() : nullptr;
  p.aux_tpe = aux ? a.aux_tokens_per_expert.as<std::int32_t>() : nullptr;
  p.status = a.status;
  if (ws > 0) {
    char* w = static_cast<char*>(a.workspace.data());
    const std::size_t BE = std::size_t(blocks) * std::size_t(E) * 4;
    p.partial_score = reinterpret_cast<float*>(w);
    p.partial_count = reinterpret_cast<int*>(w + align256(BE));
    p.partial_z = reinterpret_cast<float*>(w + 2 * align256(BE));
    p.score_sum = reinterpret_cast<float*>(w + 2 * align256(BE) + align256(std::size_t(blocks) * 4));
    p.ticket = reinterpret_cast<unsigned*>(w + 2 * align256(BE) + align256(std::size_t(blocks) * 4) +
                                           align256(std::size_t(E) * 4));
  }
  p.t_max = int(T_max);
  p.E = int(E);
  p.K = int(K);
  p.num_groups = r.num_groups > 1 ? int(r.num_groups) : 1;
  p.group_topk = r.num_groups > 1 ? int(r.group_topk) : 1;
  p.group_size = int(E / p.num_groups);
  p.per_group = int(K / p.group_topk);
  p.group_lanes_log2 = plan.group_lanes_log2;
  p.group_buf = plan.group_buf;
  p.blocks = blocks;
  p.score = score_of(r);
  p.scale = float(r.scaling_factor);
  p.aux_coeff = float(r.aux_loss_coeff);
  p.z_coeff = float(r.z_loss_coeff);
  p.aux = aux;
  p.zloss = z;
  p.vec_load = logits_vec_ok(a.logits, E);
  p.bias_vec = p.bias != nullptr && E == 32 * experts_per_lane(E) && cuda::aligned16(p.bias);

  cuda::dispatch_float_dtype(a.logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto* kernel) {
      allow_smem(op, kernel, plan.smem, cfg);
      kernel<<<blocks, kWarps * kWarp, plan.smem, stream>>>(p);
      MOERAIL_CUDA_CHECK_LAUNCH();
    };
    if (plan.kernel == ForwardKernel::Packed) {
      launch(router_forward_packed_kernel<T>);
      return;
    }
    dispatch_j(E, [&](auto jc) {
      constexpr int J = decltype(jc)::value;
      if (aux || z) launch(router_forward_kernel<T, J, true>);
      else launch(router_forward_kernel<T, J, false>);
    });
  });
  if (aux || z) {
    router_finalize_kernel<<<int((E + kWarp - 1) / kWarp), kFinalizeWarps * kWarp, 0, stream>>>(p);
    MOERAIL_CUDA_CHECK_LAUNCH();
  }
}

void router_backward(const MoeConfig& cfg, const RouterBackwardArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "router_backward";
  check_config(op, cfg);
  const RouterConfig& r = cfg.router;
  const std::int64_t T_max = cfg.max_tokens, E = cfg.num_experts, K = cfg.topk;
  const Device d = Device::cuda(cuda::current_device());
  check_tensor(op, "logits", a.logits, {T_max, E}, {DType::BF16, DType::F16, DType::F32}, d);
  check_tensor(op, "num_tokens", a.num_tokens, {1}, {DType::I32}, d);
  if (a.total_tokens.defined()) check_tensor(op, "total_tokens", a.total_tokens, {1}, {DType::I32}, d);
  check_tensor(op, "topk_idx", a.topk_idx, {T_max, K}, {DType::I32}, d);
  check_tensor(op, "d_topk_probs", a.d_topk_probs, {T_max, K}, {DType::F32}, d);
  const bool aux = has_aux(cfg), z = has_z(cfg);
  if (aux) check_tensor(op, "aux_tokens_per_expert", a.aux_tokens_per_expert, {E}, {DType::I32}, d);
  if (a.d_losses.defined()) check_tensor(op, "d_losses", a.d_losses, {2}, {DType::F32}, d);
  check_tensor(op, "d_logits", a.d_logits, {T_max, E}, {DType::F32, DType::BF16}, d);

  RouterBwdParams p{};
  p.logits = a.logits.data();
  p.num_tokens = a.num_tokens.as<const std::int32_t>();
  p.total_tokens = a.total_tokens.defined() ? a.total_tokens.as<const std::int32_t>() : nullptr;
  p.topk_idx = a.topk_idx.as<const std::int32_t>();
  p.d_probs = a.d_topk_probs.as<const float>();
  p.aux_tpe = aux ? a.aux_tokens_per_expert.as<const std::int32_t>() : nullptr;
  p.d_losses = a.d_losses.defined() ? a.d_losses.as<const float>() : nullptr;
  p.d_logits = a.d_logits.data();
  p.t_max = int(T_max);
  p.E = int(E);
  p.K = int(K);
  p.score = score_of(r);
  p.scale = float(r.scaling_factor);
  p.aux_coeff = float(r.aux_loss_coeff);
  p.z_coeff = float(r.z_loss_coeff);
  p.d_aux = a.d_aux_loss;
  p.d_z = a.d_z_loss;
  p.aux = aux;
  p.zloss = z;
  p.vec_load = logits_vec_ok(a.logits, E);
  if (T_max == 0) return;

  auto launch = [&](auto kernel) {
    static_assert(true);
    int per_sm = 0;
    MOERAIL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBwdThreads, 0));
    const long long warps = kBwdThreads / kWarp;
    const int grid = int(cuda::persistent_grid((T_max + warps - 1) / warps, per_sm));
    if (grid == 0) return;
    kernel<<<grid, kBwdThreads, 0, stream>>>(p);
    MOERAIL_CUDA_CHECK_LAUNCH();
  };
  cuda::dispatch_float_dtype(a.logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_j(E, [&](auto jc) {
      constexpr int J = decltype(jc)::value;
      if (a.d_logits.dtype() == DType::F32) launch(router_backward_kernel<T, float, J>);
      else launch(router_backward_kernel<T, __nv_bfloat16, J>);
    });
  });
}

}  // namespace moerail
