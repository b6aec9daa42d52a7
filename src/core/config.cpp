#include "moerail/config.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "moerail/error.h"

namespace moerail {

std::string_view name_of(ScoreFunction s) {
  switch (s) {
    case ScoreFunction::Softmax: return "softmax";
    case ScoreFunction::Sigmoid: return "sigmoid";
    case ScoreFunction::SqrtSoftplus: return "sqrtsoftplus";
  }
  return "?";
}

std::string_view name_of(Activation a) {
  switch (a) {
    case Activation::SwiGLU: return "swiglu";
    case Activation::GeGLU: return "geglu";
    case Activation::QuickGeGLU: return "quick-geglu";
    case Activation::ReLU2: return "relu2";
    case Activation::GELU: return "gelu";
  }
  return "?";
}

std::string_view name_of(ProbMode m) { return m == ProbMode::InActivation ? "in-activation" : "in-combine"; }

std::string Capacity::str() const {
  if (kind == Kind::WorstCase) return "worst-case";
  std::ostringstream os;
  os << (kind == Kind::PerExpert ? "per-expert(" : "factor(") << factor << ")";
  return os.str();
}

static bool is_pow2(std::int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

void MoeConfig::validate() const {
  ProblemList p("MoeConfig");
  auto positive = [&](const char* name, std::int64_t v) {
    if (v <= 0) p.add(name, " = ", v, " but a positive size was expected");
  };
  positive("hidden", hidden);
  positive("ffn_hidden", ffn_hidden);
  positive("num_experts", num_experts);
  positive("topk", topk);
  positive("ep_size", ep_size);
  positive("max_tokens", max_tokens);
  if (num_experts > 0 && topk > num_experts) p.add("topk = ", topk, " but num_experts = ", num_experts, " (expected K <= E)");
  if (num_experts > 0 && ep_size > 0 && num_experts % ep_size != 0)
    p.add("num_experts = ", num_experts, " is not a multiple of ep_size = ", ep_size);
  if (!is_pow2(align)) p.add("align = ", align, " but a power of two >= 1 was expected");
  if (glu_layout == GluLayout::Interleaved) {
    if (!is_glu(activation))
      p.add("glu_layout = interleaved but activation ", name_of(activation), " is not a GLU");
    else if (glu_block <= 0 || (ffn_hidden > 0 && ffn_hidden % glu_block != 0))
      p.add("glu_block = ", glu_block, " but a positive divisor of ffn_hidden = ", ffn_hidden, " was expected");
  }
  if (activation == Activation::QuickGeGLU && !(quick_geglu_limit > 0))
    p.add("quick_geglu_limit = ", quick_geglu_limit, " but a positive limit was expected");
  if (capacity.kind != Capacity::Kind::WorstCase && !(capacity.factor > 0 && std::isfinite(capacity.factor)))
    p.add("capacity factor = ", capacity.factor, " but a positive finite factor was expected");
  if (shared_expert_ffn < 0) p.add("shared_expert_ffn = ", shared_expert_ffn, " but >= 0 was expected (0 = none)");
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16 && dtype != DType::F64)
    p.add("dtype = ", dtype_name(dtype), " but one of {f32, bf16, f16, f64} was expected");

  const RouterConfig& r = router;
  if (r.num_groups > 1) {
    if (num_experts % r.num_groups != 0)
      p.add("router.num_groups = ", r.num_groups, " does not divide num_experts = ", num_experts);
    if (r.group_topk < 1 || r.group_topk > r.num_groups)
      p.add("router.group_topk = ", r.group_topk, " but 1 <= group_topk <= num_groups = ", r.num_groups,
            " was expected");
    else if (topk % r.group_topk != 0)
      p.add("topk = ", topk, " is not a multiple of router.group_topk = ", r.group_topk);
    else if (num_experts % r.num_groups == 0 && topk / r.group_topk > num_experts / r.num_groups)
      p.add("topk / group_topk = ", topk / r.group_topk, " exceeds the group size ", num_experts / r.num_groups);
    if (r.group_topk >= 1 && r.group_topk <= r.num_groups && num_experts % r.num_groups == 0 &&
        r.group_topk * (num_experts / r.num_groups) < topk)
      p.add("group_topk * group size = ", r.group_topk * (num_experts / r.num_groups), " < topk = ", topk);
  } else if (r.num_groups < 0) {
    p.add("router.num_groups = ", r.num_groups, " but >= 0 was expected (0 or 1 = no groups)");
  }
  if (r.use_expert_bias && r.score == ScoreFunction::Softmax)
    p.add("router.use_expert_bias needs score sigmoid or sqrtsoftplus (the bias is ignored for softmax)");
  if (r.pre_softmax && r.score != ScoreFunction::Softmax)
    p.add("router.pre_softmax applies to score softmax only, not ", name_of(r.score));
  if (!(r.scaling_factor > 0) || !std::isfinite(r.scaling_factor))
    p.add("router.scaling_factor = ", r.scaling_factor, " but a positive finite value was expected");
  if (!(r.aux_loss_coeff >= 0)) p.add("router.aux_loss_coeff = ", r.aux_loss_coeff, " but >= 0 was expected");
  if (!(r.z_loss_coeff >= 0)) p.add("router.z_loss_coeff = ", r.z_loss_coeff, " but >= 0 was expected");
  p.throw_if_any();
}

std::int64_t MoeConfig::rows_per_rank() const {
  const std::int64_t L = local_experts();
  const std::int64_t pad = L * (align - 1);
  if (capacity.kind == Capacity::Kind::WorstCase) return ep_size * max_tokens * std::min(topk, L) + pad;
  if (capacity.kind == Capacity::Kind::PerExpert) return L * expert_rows();
  return std::int64_t(std::ceil(capacity.factor * double(max_tokens) * double(topk))) + pad;
}

std::int64_t MoeConfig::expert_rows() const {
  if (capacity.kind != Capacity::Kind::PerExpert || num_experts <= 0 || align <= 0) return 0;
  const double rows = std::ceil(capacity.factor * double(ep_size) * double(max_tokens) * double(topk) /
                                double(num_experts));
  const auto r = std::int64_t(rows);
  return std::max<std::int64_t>((r + align - 1) / align * align, align);
}

std::int64_t MoeConfig::peer_rows() const {
  if (capacity.kind == Capacity::Kind::WorstCase || ep_size <= 1) return max_tokens;
  const std::int64_t E = num_experts, L = local_experts(), K = topk;
  double rows = 0;
  if (capacity.kind == Capacity::Kind::PerExpert) {
    rows = double(L) * std::ceil(capacity.factor * double(max_tokens) * double(K) / double(E));
  } else {
    double miss = 1.0;  // C(E - L, K) / C(E, K): none of a token's K experts on the rank
    for (std::int64_t i = 0; i < K; ++i) miss *= E - L - i > 0 ? double(E - L - i) / double(E - i) : 0.0;
    rows = std::ceil(capacity.factor * double(max_tokens) * (1.0 - miss));
  }
  return std::min(max_tokens, std::max<std::int64_t>(1, std::int64_t(std::min(rows, 1e18))));
}

std::string MoeConfig::summary() const {
  std::ostringstream os;
  os << "H=" << hidden << " F=" << ffn_hidden << " E=" << num_experts << " K=" << topk << " R=" << ep_size
     << " A=" << align << " T_max=" << max_tokens << " act=" << name_of(activation);
  if (glu_layout == GluLayout::Interleaved) os << "(interleaved " << glu_block << ")";
  os << " probs=" << name_of(prob_mode) << " capacity=" << capacity.str() << " router=" << name_of(router.score);
  if (router.pre_softmax) os << "(pre)";
  if (router.num_groups > 1) os << " groups=" << router.num_groups << "/" << router.group_topk;
  if (router.use_expert_bias) os << " bias";
  if (router.scaling_factor != 1.0) os << " scale=" << router.scaling_factor;
  if (shared_expert_ffn > 0) os << " shared_ffn=" << shared_expert_ffn;
  os << " dtype=" << dtype_name(dtype);
  return os.str();
}

MoeConfig shared_expert_config(const MoeConfig& cfg) {
  MoeConfig s = cfg;
  s.ffn_hidden = cfg.shared_expert_ffn;
  s.num_experts = 1;
  s.ep_size = 1;
  s.topk = 1;
  s.align = 1;
  s.router = RouterConfig{};
  s.glu_layout = GluLayout::Concatenated;
  s.glu_block = 0;
  s.fc1_bias = s.fc2_bias = false;
  s.prob_mode = ProbMode::InCombine;
  s.capacity = Capacity::worst_case();
  s.shared_expert_ffn = 0;
  return s;
}

std::string_view preset_names() { return "small, deepseek-v3, qwen3-30b-a3b, mixtral-8x7b"; }

MoeConfig preset_config(std::string_view name) {
  MoeConfig c;
  if (name == "small") {
    // Small enough for the fp64 CPU reference and its finite-difference checks to run in well under a second.
    c.hidden = 64; c.ffn_hidden = 32; c.num_experts = 8; c.topk = 2; c.align = 4; c.max_tokens = 48;
    c.router.score = ScoreFunction::Sigmoid; c.router.num_groups = 4; c.router.group_topk = 2;
    c.router.use_expert_bias = true; c.router.aux_loss_coeff = 1e-2; c.router.z_loss_coeff = 1e-3;
    c.fc1_bias = true; c.fc2_bias = true; c.shared_expert_ffn = 32;
  } else if (name == "deepseek-v3") {
    c.hidden = 7168; c.ffn_hidden = 2048; c.num_experts = 256; c.topk = 8; c.align = 128; c.max_tokens = 4096;
    c.router.score = ScoreFunction::Sigmoid; c.router.num_groups = 8; c.router.group_topk = 4;
    c.router.use_expert_bias = true; c.router.scaling_factor = 2.5; c.router.aux_loss_coeff = 1e-4;
    c.shared_expert_ffn = 2048;
  } else if (name == "qwen3-30b-a3b") {
    c.hidden = 2048; c.ffn_hidden = 768; c.num_experts = 128; c.topk = 8; c.align = 16; c.max_tokens = 16384;
    c.router.score = ScoreFunction::Softmax; c.router.aux_loss_coeff = 1e-3;
  } else if (name == "mixtral-8x7b") {
    c.hidden = 4096; c.ffn_hidden = 14336; c.num_experts = 8; c.topk = 2; c.align = 16; c.max_tokens = 4096;
    c.router.score = ScoreFunction::Softmax; c.router.aux_loss_coeff = 1e-2;
  } else {
    fail("preset_config", "unknown configuration '", name, "' (known: ", preset_names(), ")");
  }
  return c;
}

}  // namespace moerail
