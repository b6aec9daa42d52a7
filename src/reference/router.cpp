// CPU reference of the router (see include/moerail/reference/router.h for the contract).
//
// Everything is computed in double, one token at a time, with plain loops. The forward and the backward share the
// score functions below; the backward recomputes what it needs from the logits and the given selection instead of
// reading saved activations, so that it can be checked against finite differences of the forward.
#include "moerail/reference/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>

#include "moerail/error.h"
#include "moerail/reference/host.h"

namespace moerail::ref {
namespace {

// TransformerEngine's epsilon for the normalization of sigmoid-type weights and aux-loss scores.
constexpr double kEps = 1e-20;
// softplus(x) = x above this threshold (as TransformerEngine and torch.nn.functional.softplus).
constexpr double kSoftplusThreshold = 20.0;

// ---- argument checks ------------------------------------------------------------------------------------------

// The sizes every check and loop uses: T tokens, E experts, K selected experts per token.
struct Sizes {
  std::int64_t T = 0, E = 0, K = 0;
};

// Checks logits [T, E], expert_bias and total_tokens, shared by the forward and the backward; returns the sizes.
Sizes check_common(std::string_view op, const MoeConfig& cfg, const TensorView& logits,
                   const TensorView& expert_bias, std::int64_t total_tokens) {
  cfg.validate();
  const std::int64_t E = cfg.num_experts, K = cfg.topk;

  check_shape(op, "logits", logits, {-1, E});
  check_dtype(op, "logits", logits, {DType::F64, DType::F32, DType::BF16, DType::F16});
  check_device(op, "logits", logits, Device::host());
  const std::int64_t T = logits.size(0);
  if (T > cfg.max_tokens)
    fail(op, "logits has T = ", T, " tokens but cfg.max_tokens = ", cfg.max_tokens, " (expected T <= max_tokens)");

  if (cfg.router.use_expert_bias) {
    if (!expert_bias.defined()) fail(op, "expert_bias is not given but cfg.router.use_expert_bias is set");
    check_shape(op, "expert_bias", expert_bias, {E});
    check_dtype(op, "expert_bias", expert_bias, {DType::F64, DType::F32});
    check_device(op, "expert_bias", expert_bias, Device::host());
    for (std::int64_t e = 0; e < E; ++e) {
      const double b = load_float(expert_bias, e);
      if (!std::isfinite(b)) fail(op, "expert_bias[", e, "] = ", b, " but a finite bias was expected");
    }
  } else if (expert_bias.defined()) {
    fail(op, "expert_bias is given (shape ", expert_bias.shape_str(),
         ") but cfg.router.use_expert_bias is not set (expected no bias)");
  }

  if (total_tokens != -1 && total_tokens < T)
    fail(op, "total_tokens = ", total_tokens, " but -1 (= T) or a count >= T = ", T, " was expected");

  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t e = 0; e < E; ++e) {
      const double x = load_float(logits, t * E + e);
      if (!std::isfinite(x)) fail(op, "logits[", t, ",", e, "] = ", x, " but finite logits were expected");
    }
  }
  return {T, E, K};
}

// ---- rows and score functions ---------------------------------------------------------------------------------

std::vector<double> load_row(const TensorView& t, std::int64_t row, std::int64_t width) {
  std::vector<double> v(width);
  for (std::int64_t i = 0; i < width; ++i) v[i] = load_float(t, row * width + i);
  return v;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

double softplus(double x) { return x > kSoftplusThreshold ? x : std::log1p(std::exp(x)); }

// Softmax of a whole row, max-subtracted.
std::vector<double> softmax(const std::vector<double>& x) {
  double max = x.empty() ? 0.0 : x[0];
  for (double v : x) max = std::max(max, v);
  double sum = 0.0;
  std::vector<double> p(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    p[i] = std::exp(x[i] - max);
    sum += p[i];
  }
  for (double& v : p) v /= sum;
  return p;
}

double logsumexp(const std::vector<double>& x) {
  double max = x[0];
  for (double v : x) max = std::max(max, v);
  double sum = 0.0;
  for (double v : x) sum += std::exp(v - max);
  return max + std::log(sum);
}

bool is_sigmoid_type(ScoreFunction s) { return s == ScoreFunction::Sigmoid || s == ScoreFunction::SqrtSoftplus; }

// The element-wise activation of the sigmoid-type score functions: sigmoid(x) or sqrt(softplus(x)).
std::vector<double> activate(ScoreFunction score, const std::vector<double>& x) {
  std::vector<double> s(x.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    s[i] = score == ScoreFunction::Sigmoid ? sigmoid(x[i]) : std::sqrt(softplus(x[i]));
  return s;
}

// d activate(x) / dx, given x and s = activate(x).
//   sigmoid:       s (1 - s)
//   sqrtsoftplus:  softplus'(x) / (2 s), softplus'(x) = 1 above the threshold (the forward is x there), else
//                  sigmoid(x); 0 where softplus underflowed to 0 (x < about -745), the limit of the derivative.
double activate_derivative(ScoreFunction score, double x, double s) {
  if (score == ScoreFunction::Sigmoid) return s * (1.0 - s);
  if (s == 0.0) return 0.0;
  const double dsoftplus = x > kSoftplusThreshold ? 1.0 : sigmoid(x);
  return dsoftplus / (2.0 * s);
}

// The aux-loss scores of one token over all E: softmax(x), or s / (sum s + eps) for sigmoid-type s.
std::vector<double> aux_scores(ScoreFunction score, const std::vector<double>& x) {
  if (score == ScoreFunction::Softmax) return softmax(x);
  std::vector<double> s = activate(score, x);
  double sum = 0.0;
  for (double v : s) sum += v;
  for (double& v : s) v /= sum + kEps;
  return s;
}

// ---- selection --------------------------------------------------------------------------------------------------

// The k best entries of `score` by descending score; ties go to the lower index. k repeated arg-max passes: the
// strict '>' keeps the first (lowest) index among equal scores.
std::vector<std::int64_t> top_k(const std::vector<double>& score, std::int64_t k) {
  const std::int64_t n = std::int64_t(score.size());
  std::vector<bool> taken(n, false);
  std::vector<std::int64_t> picked;
  for (std::int64_t j = 0; j < k; ++j) {
    std::int64_t best = -1;
    for (std::int64_t i = 0; i < n; ++i) {
      if (!taken[i] && (best < 0 || score[i] > score[best])) best = i;
    }
    taken[best] = true;
    picked.push_back(best);
  }
  return picked;
}

// The K experts of one token from its selection scores [E], listed by descending score. Group-limited top-k
// (num_groups > 1): a group scores the sum of its top (K / group_topk) selection scores, and the experts outside
// the group_topk best groups are masked to -inf before the top-K (cfg.validate() ensures K eligible experts remain).
std::vector<std::int64_t> select_experts(const MoeConfig& cfg, std::vector<double> sel) {
  const RouterConfig& r = cfg.router;
  if (r.num_groups > 1) {
    const std::int64_t group_size = cfg.num_experts / r.num_groups, per_group = cfg.topk / r.group_topk;
    std::vector<double> group_score(r.num_groups, 0.0);
    for (std::int64_t g = 0; g < r.num_groups; ++g) {
      const std::vector<double> members(sel.begin() + g * group_size, sel.begin() + (g + 1) * group_size);
      for (std::int64_t i : top_k(members, per_group)) group_score[g] += members[i];
    }
    std::vector<bool> kept(r.num_groups, false);
    for (std::int64_t g : top_k(group_score, r.group_topk)) kept[g] = true;
    for (std::int64_t e = 0; e < cfg.num_experts; ++e)
      if (!kept[e / group_size]) sel[e] = -std::numeric_limits<double>::infinity();
  }
  return top_k(sel, cfg.topk);
}

// tokens_per_expert [E] of the aux loss: the top-K counts of the aux-loss scores of every token (no bias, no groups).
std::vector<std::int64_t> aux_tokens_per_expert(const MoeConfig& cfg, const TensorView& logits, std::int64_t T) {
  const std::int64_t E = cfg.num_experts;
  std::vector<std::int64_t> tpe(E, 0);
  for (std::int64_t t = 0; t < T; ++t) {
    const std::vector<double> a = aux_scores(cfg.router.score, load_row(logits, t, E));
    for (std::int64_t e : top_k(a, cfg.topk)) ++tpe[e];
  }
  return tpe;
}

// The aux-loss factor E * coeff / (K * T_total^2); 0 when there are no tokens at all.
double aux_factor(const MoeConfig& cfg, std::int64_t T, std::int64_t total_tokens) {
  const double t_total = double(total_tokens == -1 ? T : total_tokens);
  if (t_total == 0) return 0.0;
  return double(cfg.num_experts) * cfg.router.aux_loss_coeff / (double(cfg.topk) * t_total * t_total);
}

// ---- one token, forward ----------------------------------------------------------------------------------------

// The routing of one token: K experts by descending selection score and their unscaled weights.
struct TokenRoute {
  std::vector<std::int64_t> idx;  // [K]
  std::vector<double> w;          // [K]
};

// Routes one token from its logits x [E]; bias [E] is all zeros without an expert bias.
TokenRoute route_token(const MoeConfig& cfg, const std::vector<double>& x, const std::vector<double>& bias) {
  const RouterConfig& r = cfg.router;
  const std::int64_t E = cfg.num_experts, K = cfg.topk;

  // s: the scores the weights are taken from; sel: the scores the experts are selected by.
  std::vector<double> s, sel;
  if (r.score == ScoreFunction::Softmax) {
    s = r.pre_softmax ? softmax(x) : x;
    sel = s;
  } else {
    s = activate(r.score, x);
    sel = s;
    for (std::int64_t e = 0; e < E; ++e) sel[e] += bias[e];
  }

  TokenRoute route;
  route.idx = select_experts(cfg, sel);
  route.w.resize(K);
  for (std::int64_t k = 0; k < K; ++k) route.w[k] = s[route.idx[k]];
  if (r.score == ScoreFunction::Softmax && !r.pre_softmax) {
    route.w = softmax(route.w);  // softmax over the K selected logits
  } else if (is_sigmoid_type(r.score) && K > 1) {
    double sum = 0.0;
    for (double v : route.w) sum += v;
    for (double& v : route.w) v /= sum + kEps;
  }
  return route;
}

// ---- one token, backward ----------------------------------------------------------------------------------------

// Adds to dx [E] the gradient through the weights of the selected experts idx [K], given g [K], the gradient of
// the unscaled weights. The selection itself is piecewise constant and has no gradient.
void weights_backward(const MoeConfig& cfg, const std::vector<double>& x, const std::vector<std::int64_t>& idx,
                      const std::vector<double>& g, std::vector<double>& dx) {
  const RouterConfig& r = cfg.router;
  const std::int64_t E = cfg.num_experts, K = cfg.topk;
  if (r.score == ScoreFunction::Softmax && r.pre_softmax) {
    // w_k = p[idx_k], p = softmax(x) over all E:  dx = p * (dp - <dp, p>).
    const std::vector<double> p = softmax(x);
    std::vector<double> dp(E, 0.0);
    for (std::int64_t k = 0; k < K; ++k) dp[idx[k]] += g[k];
    double dot = 0.0;
    for (std::int64_t e = 0; e < E; ++e) dot += dp[e] * p[e];
    for (std::int64_t e = 0; e < E; ++e) dx[e] += p[e] * (dp[e] - dot);
  } else if (r.score == ScoreFunction::Softmax) {
    // w = softmax(x[idx]) over the K selected logits:  dx[idx_k] = w_k * (g_k - <g, w>).
    std::vector<double> selected(K);
    for (std::int64_t k = 0; k < K; ++k) selected[k] = x[idx[k]];
    const std::vector<double> w = softmax(selected);
    double dot = 0.0;
    for (std::int64_t k = 0; k < K; ++k) dot += g[k] * w[k];
    for (std::int64_t k = 0; k < K; ++k) dx[idx[k]] += w[k] * (g[k] - dot);
  } else {
    // w_k = s[idx_k], divided by (S + eps), S = sum_k s[idx_k], when K > 1:
    //   ds_k = g_k / (S + eps) - <g, s[idx]> / (S + eps)^2;  dx[idx_k] = ds_k * s'(x[idx_k]).
    const std::vector<double> s = activate(r.score, x);
    std::vector<double> ds = g;
    if (K > 1) {
      double sum = 0.0, dot = 0.0;
      for (std::int64_t k = 0; k < K; ++k) {
        sum += s[idx[k]];
        dot += g[k] * s[idx[k]];
      }
      const double denom = sum + kEps;
      for (std::int64_t k = 0; k < K; ++k) ds[k] = g[k] / denom - dot / (denom * denom);
    }
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t e = idx[k];
      dx[e] += ds[k] * activate_derivative(r.score, x[e], s[e]);
    }
  }
}

// Adds to dx [E] the gradient through the aux-loss scores of one token, given da [E], the gradient of those scores.
void aux_scores_backward(ScoreFunction score, const std::vector<double>& x, const std::vector<double>& da,
                         std::vector<double>& dx) {
  const std::int64_t E = std::int64_t(x.size());
  if (score == ScoreFunction::Softmax) {
    // a = softmax(x):  dx = a * (da - <da, a>).
    const std::vector<double> a = softmax(x);
    double dot = 0.0;
    for (std::int64_t e = 0; e < E; ++e) dot += da[e] * a[e];
    for (std::int64_t e = 0; e < E; ++e) dx[e] += a[e] * (da[e] - dot);
  } else {
    // a = s / (S + eps), S = sum_e s[e]:  ds = da / (S + eps) - <da, s> / (S + eps)^2;  dx = ds * s'(x).
    const std::vector<double> s = activate(score, x);
    double sum = 0.0, dot = 0.0;
    for (std::int64_t e = 0; e < E; ++e) {
      sum += s[e];
      dot += da[e] * s[e];
    }
    const double denom = sum + kEps;
    for (std::int64_t e = 0; e < E; ++e) {
      const double ds = da[e] / denom - dot / (denom * denom);
      dx[e] += ds * activate_derivative(score, x[e], s[e]);
    }
  }
}

// Checks that topk_idx [T, K] holds K distinct experts in [0, E) per token, as the forward writes.
void check_selection(std::string_view op, const TensorView& topk_idx, std::int64_t T, std::int64_t E,
                     std::int64_t K) {
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t id = load_int(topk_idx, t * K + k);
      if (id < 0 || id >= E)
        fail(op, "topk_idx[", t, ",", k, "] = ", id, " but num_experts = ", E, " (expected 0 <= id < ", E,
             ", the forward's selection)");
      for (std::int64_t j = 0; j < k; ++j)
        if (load_int(topk_idx, t * K + j) == id)
          fail(op, "topk_idx[", t, ",", k, "] = ", id, " repeats topk_idx[", t, ",", j,
               "] (expected K distinct experts per token)");
    }
  }
}

}  // namespace

// ---- forward ----------------------------------------------------------------------------------------------------

RouterLosses router_forward(const MoeConfig& cfg, const RouterForwardArgs& args) {
  constexpr std::string_view op = "router_forward";
  const auto [T, E, K] = check_common(op, cfg, args.logits, args.expert_bias, args.total_tokens);
  check_shape(op, "topk_idx", args.topk_idx, {T, K});
  check_dtype(op, "topk_idx", args.topk_idx, {DType::I32});
  check_device(op, "topk_idx", args.topk_idx, Device::host());
  check_shape(op, "topk_probs", args.topk_probs, {T, K});
  check_dtype(op, "topk_probs", args.topk_probs, {DType::F64, DType::F32});
  check_device(op, "topk_probs", args.topk_probs, Device::host());

  const RouterConfig& r = cfg.router;
  const std::vector<double> bias = r.use_expert_bias ? read_floats(args.expert_bias) : std::vector<double>(E, 0.0);
  for (std::int64_t t = 0; t < T; ++t) {
    const TokenRoute route = route_token(cfg, load_row(args.logits, t, E), bias);
    for (std::int64_t k = 0; k < K; ++k) {
      store_int(args.topk_idx, t * K + k, route.idx[k]);
      store_float(args.topk_probs, t * K + k, r.scaling_factor * route.w[k]);
    }
  }

  RouterLosses losses;
  if (r.aux_loss_coeff > 0) {
    losses.tokens_per_expert = aux_tokens_per_expert(cfg, args.logits, T);
    std::vector<double> score_sum(E, 0.0);  // sum_t score[t, e]
    for (std::int64_t t = 0; t < T; ++t) {
      const std::vector<double> a = aux_scores(r.score, load_row(args.logits, t, E));
      for (std::int64_t e = 0; e < E; ++e) score_sum[e] += a[e];
    }
    double sum = 0.0;
    for (std::int64_t e = 0; e < E; ++e) sum += score_sum[e] * double(losses.tokens_per_expert[e]);
    losses.aux_loss = aux_factor(cfg, T, args.total_tokens) * sum;
  }
  if (r.z_loss_coeff > 0 && T > 0) {
    double sum = 0.0;  // sum_t logsumexp(x_t)^2
    for (std::int64_t t = 0; t < T; ++t) {
      const double lse = logsumexp(load_row(args.logits, t, E));
      sum += lse * lse;
    }
    losses.z_loss = r.z_loss_coeff * sum / double(T);
  }
  return losses;
}

// ---- backward ---------------------------------------------------------------------------------------------------

void router_backward(const MoeConfig& cfg, const RouterBackwardArgs& args) {
  constexpr std::string_view op = "router_backward";
  const auto [T, E, K] = check_common(op, cfg, args.logits, args.expert_bias, args.total_tokens);
  check_shape(op, "topk_idx", args.topk_idx, {T, K});
  check_dtype(op, "topk_idx", args.topk_idx, {DType::I32});
  check_device(op, "topk_idx", args.topk_idx, Device::host());
  check_shape(op, "d_topk_probs", args.d_topk_probs, {T, K});
  check_dtype(op, "d_topk_probs", args.d_topk_probs, {DType::F64, DType::F32});
  check_device(op, "d_topk_probs", args.d_topk_probs, Device::host());
  check_shape(op, "d_logits", args.d_logits, {T, E});
  check_dtype(op, "d_logits", args.d_logits, {DType::F64, DType::F32});
  check_device(op, "d_logits", args.d_logits, Device::host());
  check_selection(op, args.topk_idx, T, E, K);
  if (!std::isfinite(args.d_aux_loss)) fail(op, "d_aux_loss = ", args.d_aux_loss, " but a finite value was expected");
  if (!std::isfinite(args.d_z_loss)) fail(op, "d_z_loss = ", args.d_z_loss, " but a finite value was expected");

  const RouterConfig& r = cfg.router;
  // d aux / d score[t, e] = C * tokens_per_expert[e] (the same for every token); tokens_per_expert is piecewise
  // constant in the logits.
  std::vector<double> d_aux_score(E, 0.0);
  if (r.aux_loss_coeff > 0) {
    const std::vector<std::int64_t> tpe = aux_tokens_per_expert(cfg, args.logits, T);
    const double c = aux_factor(cfg, T, args.total_tokens);
    for (std::int64_t e = 0; e < E; ++e) d_aux_score[e] = c * double(tpe[e]) * args.d_aux_loss;
  }

  for (std::int64_t t = 0; t < T; ++t) {
    const std::vector<double> x = load_row(args.logits, t, E);
    std::vector<std::int64_t> idx(K);
    std::vector<double> g(K);  // gradient of the unscaled weights
    for (std::int64_t k = 0; k < K; ++k) {
      idx[k] = load_int(args.topk_idx, t * K + k);
      g[k] = r.scaling_factor * load_float(args.d_topk_probs, t * K + k);
    }

    std::vector<double> dx(E, 0.0);
    weights_backward(cfg, x, idx, g, dx);
    if (r.aux_loss_coeff > 0) aux_scores_backward(r.score, x, d_aux_score, dx);
    if (r.z_loss_coeff > 0) {
      // z = coeff / T * sum_t lse_t^2:  dz / dx = coeff / T * 2 lse * softmax(x).
      const double lse = logsumexp(x);
      const std::vector<double> p = softmax(x);
      const double c = args.d_z_loss * r.z_loss_coeff * 2.0 * lse / double(T);
      for (std::int64_t e = 0; e < E; ++e) dx[e] += c * p[e];
    }
    for (std::int64_t e = 0; e < E; ++e) store_float(args.d_logits, t * E + e, dx[e]);
  }
}

}  // namespace moerail::ref
