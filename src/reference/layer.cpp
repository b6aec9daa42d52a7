// CPU reference of the whole layer: the ops of src/reference composed over R simulated ranks.
#include "moerail/reference/layer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <sstream>

#include "moerail/reference/dispatch.h"
#include "moerail/reference/router.h"

namespace moerail::ref {
namespace {

constexpr const char* kOp = "ref::Layer";

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// c[m, n] (+)= sum_k a[m, k] * b[n, k]  — the x W^T product of a linear layer.
void matmul_nt(const HostTensor& a, const HostTensor& b, const HostTensor& c, bool accumulate) {
  const std::int64_t M = a.view().size(0), K = a.view().size(1), N = b.view().size(0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double s = accumulate ? c.f(m * N + n) : 0.0;
      for (std::int64_t k = 0; k < K; ++k) s += a.f(m * K + k) * b.f(n * K + k);
      c.set_f(m * N + n, s);
    }
}

HostTensor copy_f64(const TensorView& t) {
  HostTensor c(DType::F64, t.ndim() == 1 ? std::vector<std::int64_t>{t.size(0)}
                                         : std::vector<std::int64_t>{t.size(0), t.size(1)});
  for (std::int64_t i = 0; i < t.numel(); ++i) c.set_f(i, load_float(t, i));
  return c;
}

std::vector<TensorView> views(const std::vector<HostTensor>& ts) {
  std::vector<TensorView> v;
  for (const auto& t : ts) v.push_back(t.view());
  return v;
}

}  // namespace

LayerWeights LayerWeights::random(const MoeConfig& cfg, std::uint64_t seed) {
  cfg.validate();
  Rng rng(seed);
  const std::int64_t H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out(), E = cfg.num_experts,
                     L = cfg.local_experts(), R = cfg.ep_size;
  LayerWeights w;
  w.router = HostTensor(DType::F64, {E, H});
  fill_normal(w.router, rng, 1.0 / std::sqrt(double(H)));
  if (cfg.router.use_expert_bias) {
    w.expert_bias = HostTensor(DType::F64, {E});
    fill_uniform(w.expert_bias, rng, -0.1, 0.1);
  }
  for (std::int64_t r = 0; r < R; ++r) {
    w.w1.emplace_back(DType::F64, std::vector<std::int64_t>{L, F1, H});
    fill_normal(w.w1.back(), rng, 1.0 / std::sqrt(double(H)));
    w.w2.emplace_back(DType::F64, std::vector<std::int64_t>{L, H, F});
    fill_normal(w.w2.back(), rng, 1.0 / std::sqrt(double(F)));
    if (cfg.fc1_bias) {
      w.b1.emplace_back(DType::F64, std::vector<std::int64_t>{L, F1});
      fill_uniform(w.b1.back(), rng, -0.1, 0.1);
    }
    if (cfg.fc2_bias) {
      w.b2.emplace_back(DType::F64, std::vector<std::int64_t>{L, H});
      fill_uniform(w.b2.back(), rng, -0.1, 0.1);
    }
  }
  if (cfg.shared_expert_ffn > 0) {
    const MoeConfig s = shared_expert_config(cfg);
    w.shared_w1 = HostTensor(DType::F64, {1, s.fc1_out(), H});
    fill_normal(w.shared_w1, rng, 1.0 / std::sqrt(double(H)));
    w.shared_w2 = HostTensor(DType::F64, {1, H, s.ffn_hidden});
    fill_normal(w.shared_w2, rng, 1.0 / std::sqrt(double(s.ffn_hidden)));
  }
  return w;
}

ExpertWeights LayerWeights::experts(std::int64_t rank) const {
  ExpertWeights e;
  e.w1 = w1[std::size_t(rank)].view();
  e.w2 = w2[std::size_t(rank)].view();
  if (!b1.empty()) e.b1 = b1[std::size_t(rank)].view();
  if (!b2.empty()) e.b2 = b2[std::size_t(rank)].view();
  return e;
}

Layer::Layer(MoeConfig cfg, LayerWeights weights, LayerOptions options)
    : cfg_(std::move(cfg)), weights_(std::move(weights)), options_(options) {
  cfg_.validate();
  const auto R = std::size_t(cfg_.ep_size);
  if (weights_.w1.size() != R || weights_.w2.size() != R)
    fail(kOp, "weights hold experts of ", weights_.w1.size(), " ranks but ep_size = ", cfg_.ep_size);
  check_shape(kOp, "router weight", weights_.router, {cfg_.num_experts, cfg_.hidden});
  if (cfg_.router.use_expert_bias) check_shape(kOp, "expert_bias", weights_.expert_bias, {cfg_.num_experts});
  if (cfg_.shared_expert_ffn > 0) {
    const MoeConfig s = shared_expert_config(cfg_);
    check_shape(kOp, "shared_w1", weights_.shared_w1, {1, s.fc1_out(), cfg_.hidden});
    check_shape(kOp, "shared_w2", weights_.shared_w2, {1, cfg_.hidden, s.ffn_hidden});
  }
}

LayerForward Layer::forward(std::span<const TensorView> x, LayerStageTimes* times,
                            std::span<const TensorView> logits) const {
  const std::int64_t R = cfg_.ep_size, H = cfg_.hidden, E = cfg_.num_experts, K = cfg_.topk;
  if (std::int64_t(x.size()) != R) fail(kOp, "forward got x for ", x.size(), " ranks but ep_size = ", R);
  for (std::int64_t r = 0; r < R; ++r) {
    check_shape(kOp, "x", x[std::size_t(r)], {-1, H});
    check_dtype(kOp, "x", x[std::size_t(r)], {DType::F64, DType::F32, DType::BF16, DType::F16});
  }
  if (!logits.empty() && std::int64_t(logits.size()) != R)
    fail(kOp, "forward got logits for ", logits.size(), " ranks but ep_size = ", R);
  for (std::size_t r = 0; r < logits.size(); ++r) check_shape(kOp, "logits", logits[r], {x[r].size(0), E});
  LayerStageTimes t;
  LayerForward f;

  auto t0 = Clock::now();
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t T = x[std::size_t(r)].size(0);
    if (logits.empty()) {
      f.logits.emplace_back(DType::F64, std::vector<std::int64_t>{T, E});
      matmul_nt(copy_f64(x[std::size_t(r)]), weights_.router, f.logits.back(), false);
    } else {
      f.logits.push_back(copy_f64(logits[std::size_t(r)]));
    }
    f.topk_idx.emplace_back(DType::I32, std::vector<std::int64_t>{T, K});
    f.topk_probs.emplace_back(DType::F64, std::vector<std::int64_t>{T, K});
    RouterForwardArgs a;
    a.logits = f.logits.back();
    if (cfg_.router.use_expert_bias) a.expert_bias = weights_.expert_bias;
    a.topk_idx = f.topk_idx.back();
    a.topk_probs = f.topk_probs.back();
    const RouterLosses losses = router_forward(cfg_, a);
    f.aux_loss.push_back(losses.aux_loss);
    f.z_loss.push_back(losses.z_loss);
  }
  t.router = seconds_since(t0);

  t0 = Clock::now();
  const auto idx_views = views(f.topk_idx);
  f.plan = plan_layout(cfg_, idx_views, -1, options_.peer_rows);
  t.layout = seconds_since(t0);
  if (options_.check_overflow)
    for (std::int64_t r = 0; r < R; ++r)
      if (f.plan.overflow[std::size_t(r)] > 0) {
        const std::int64_t L = cfg_.local_experts();
        const auto first = f.plan.padded_per_expert.begin() + r * L;
        const std::string need =
            f.plan.expert_capacity > 0
                ? detail::concat("the fullest expert needed ", *std::max_element(first, first + L), " rows, ",
                                 f.plan.expert_capacity, " per expert available")
                : detail::concat(f.plan.rows_needed[std::size_t(r)], " rows needed, ", f.plan.capacity, " available");
        fail_with(ErrorCode::CapacityOverflow, kOp, "rank ", r, " received more rows than fit: ", need, " (capacity ",
                  cfg_.capacity.str(), "); ", f.plan.overflow[std::size_t(r)], " routed rows were dropped");
      }
  if (options_.check_overflow)
    for (std::int64_t r = 0; r < R; ++r)
      if (f.plan.peer_dropped[std::size_t(r)] > 0)
        fail_with(ErrorCode::CapacityOverflow, kOp, "rank ", r, " sent more than peer_rows = ", f.plan.peer_rows,
                  " tokens to one peer; ", f.plan.peer_dropped[std::size_t(r)], " routed slots were dropped");

  t0 = Clock::now();
  const std::int64_t cap = f.plan.capacity;
  for (std::int64_t r = 0; r < R; ++r) {
    f.recv.emplace_back(DType::F64, std::vector<std::int64_t>{cap, H});
    f.recv_probs.emplace_back(DType::F64, std::vector<std::int64_t>{cap});
    f.y.emplace_back(DType::F64, std::vector<std::int64_t>{cap, H});
    f.recv.back().fill(0.0);  // rows past rows_used are not written by dispatch: keep them defined
    f.recv_probs.back().fill(0.0);
    f.y.back().fill(0.0);
  }
  const auto probs_views = views(f.topk_probs), recv_views = views(f.recv), recv_probs_views = views(f.recv_probs);
  dispatch_forward(f.plan, DispatchArgs{x, probs_views, recv_views, recv_probs_views});
  t.dispatch = seconds_since(t0);

  t0 = Clock::now();
  for (std::int64_t r = 0; r < R; ++r) {
    const std::vector<std::int64_t> rows = f.plan.local_segment_rows(r);
    ExpertsForwardArgs a;
    a.x = f.recv[std::size_t(r)];
    a.probs = f.recv_probs[std::size_t(r)];
    a.rows_per_expert = rows;
    a.weights = weights_.experts(r);
    a.y = f.y[std::size_t(r)];
    a.recipe = options_.recipe;
    experts_forward(cfg_, a);
  }
  t.experts = seconds_since(t0);

  t0 = Clock::now();
  for (std::int64_t r = 0; r < R; ++r)
    f.out.emplace_back(DType::F64, std::vector<std::int64_t>{x[std::size_t(r)].size(0), H});
  const auto y_views = views(f.y), out_views = views(f.out);
  combine_forward(f.plan, CombineArgs{cfg_.prob_mode, y_views, probs_views, out_views});
  t.combine = seconds_since(t0);

  if (cfg_.shared_expert_ffn > 0) {
    t0 = Clock::now();
    const MoeConfig s = shared_expert_config(cfg_);
    for (std::int64_t r = 0; r < R; ++r) {
      const std::int64_t T = x[std::size_t(r)].size(0);
      HostTensor ys(DType::F64, {T, H});
      const std::int64_t rows[1] = {T};
      ExpertsForwardArgs a;
      a.x = x[std::size_t(r)];
      a.rows_per_expert = rows;
      a.weights = ExpertWeights{weights_.shared_w1, {}, weights_.shared_w2, {}};
      a.y = ys;
      experts_forward(s, a);
      const HostTensor& out = f.out[std::size_t(r)];
      for (std::int64_t i = 0; i < T * H; ++i) out.set_f(i, out.f(i) + ys.f(i));
    }
    t.shared = seconds_since(t0);
  }
  if (times) *times = t;
  return f;
}

LayerGrads Layer::backward(std::span<const TensorView> x, const LayerForward& f, std::span<const TensorView> d_out,
                           double d_aux, double d_z, LayerStageTimes* times) const {
  const std::int64_t R = cfg_.ep_size, H = cfg_.hidden, E = cfg_.num_experts, K = cfg_.topk;
  const std::int64_t L = cfg_.local_experts(), F = cfg_.ffn_hidden, F1 = cfg_.fc1_out(), cap = f.plan.capacity;
  if (std::int64_t(x.size()) != R || std::int64_t(d_out.size()) != R)
    fail(kOp, "backward got x for ", x.size(), " and d_out for ", d_out.size(), " ranks but ep_size = ", R);
  for (std::int64_t r = 0; r < R; ++r)
    check_shape(kOp, "d_out", d_out[std::size_t(r)], {x[std::size_t(r)].size(0), H});
  LayerStageTimes t;
  LayerGrads g;

  // combine backward: d_y per destination rank, d_probs (InCombine) per source rank
  auto t0 = Clock::now();
  std::vector<HostTensor> d_y, d_probs_combine, d_recv, d_recv_probs;
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t T = x[std::size_t(r)].size(0);
    // the FP8 recipe quantizes d_y: from its bf16 value, as the step keeps it
    d_y.emplace_back(options_.recipe != Recipe::BF16 ? DType::BF16 : DType::F64,
                     std::vector<std::int64_t>{cap, H});
    d_y.back().fill(0.0);
    d_probs_combine.emplace_back(DType::F64, std::vector<std::int64_t>{T, K});
    d_recv.emplace_back(DType::F64, std::vector<std::int64_t>{cap, H});
    d_recv.back().fill(0.0);
    d_recv_probs.emplace_back(DType::F64, std::vector<std::int64_t>{cap});
    d_recv_probs.back().fill(0.0);
  }
  const auto probs_views = views(f.topk_probs), y_views = views(f.y), d_y_views = views(d_y),
             d_probs_c_views = views(d_probs_combine);
  combine_backward(f.plan, CombineBackwardArgs{cfg_.prob_mode, d_out, y_views, probs_views, d_y_views,
                                               d_probs_c_views});
  t.combine = seconds_since(t0);

  // experts backward on each rank: data and weight gradients
  t0 = Clock::now();
  for (std::int64_t r = 0; r < R; ++r) {
    g.dw1.emplace_back(DType::F64, std::vector<std::int64_t>{L, F1, H});
    g.dw2.emplace_back(DType::F64, std::vector<std::int64_t>{L, H, F});
    ExpertGrads eg{g.dw1.back(), {}, g.dw2.back(), {}};
    if (cfg_.fc1_bias) {
      g.db1.emplace_back(DType::F64, std::vector<std::int64_t>{L, F1});
      eg.db1 = g.db1.back();
    }
    if (cfg_.fc2_bias) {
      g.db2.emplace_back(DType::F64, std::vector<std::int64_t>{L, H});
      eg.db2 = g.db2.back();
    }
    const std::vector<std::int64_t> rows = f.plan.local_segment_rows(r);
    ExpertsBackwardArgs a;
    a.x = f.recv[std::size_t(r)];
    a.probs = f.recv_probs[std::size_t(r)];
    a.rows_per_expert = rows;
    a.weights = weights_.experts(r);
    a.dy = d_y[std::size_t(r)];
    a.dx = d_recv[std::size_t(r)];
    a.d_probs = d_recv_probs[std::size_t(r)];
    a.grads = eg;
    a.recipe = options_.recipe;
    a.fp8_weight_grads = options_.fp8_weight_grads;
    experts_backward(cfg_, a);
  }
  t.experts = seconds_since(t0);

  // dispatch backward: dx and d_probs per source rank
  t0 = Clock::now();
  std::vector<HostTensor> d_probs;
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t T = x[std::size_t(r)].size(0);
    g.dx.emplace_back(DType::F64, std::vector<std::int64_t>{T, H});
    d_probs.emplace_back(DType::F64, std::vector<std::int64_t>{T, K});
  }
  const auto d_recv_views = views(d_recv), d_recv_probs_views = views(d_recv_probs), dx_views = views(g.dx),
             d_probs_views = views(d_probs);
  dispatch_backward(f.plan, DispatchBackwardArgs{d_recv_views, d_recv_probs_views, dx_views, d_probs_views});
  t.dispatch = seconds_since(t0);

  // router backward, then the gate linear: dx += d_logits W_router; d_router += d_logits^T x
  t0 = Clock::now();
  g.d_router = HostTensor(DType::F64, {E, H});
  g.d_router.fill(0.0);
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t T = x[std::size_t(r)].size(0);
    const HostTensor& dp = d_probs[std::size_t(r)];
    const HostTensor& dpc = d_probs_combine[std::size_t(r)];
    for (std::int64_t i = 0; i < T * K; ++i) dp.set_f(i, dp.f(i) + dpc.f(i));
    HostTensor d_logits(DType::F64, {T, E});
    RouterBackwardArgs a;
    a.logits = f.logits[std::size_t(r)];
    if (cfg_.router.use_expert_bias) a.expert_bias = weights_.expert_bias;
    a.topk_idx = f.topk_idx[std::size_t(r)];
    a.d_topk_probs = dp;
    a.d_aux_loss = d_aux;
    a.d_z_loss = d_z;
    a.d_logits = d_logits;
    router_backward(cfg_, a);
    const TensorView& xr = x[std::size_t(r)];
    const HostTensor& dx = g.dx[std::size_t(r)];
    for (std::int64_t tk = 0; tk < T; ++tk)
      for (std::int64_t e = 0; e < E; ++e) {
        const double dl = d_logits.f(tk * E + e);
        if (dl == 0.0) continue;
        for (std::int64_t h = 0; h < H; ++h) {
          dx.set_f(tk * H + h, dx.f(tk * H + h) + dl * weights_.router.f(e * H + h));
          g.d_router.set_f(e * H + h, g.d_router.f(e * H + h) + dl * load_float(xr, tk * H + h));
        }
      }
  }
  t.router = seconds_since(t0);

  if (cfg_.shared_expert_ffn > 0) {
    t0 = Clock::now();
    const MoeConfig s = shared_expert_config(cfg_);
    g.d_shared_w1 = HostTensor(DType::F64, {1, s.fc1_out(), H});
    g.d_shared_w2 = HostTensor(DType::F64, {1, H, s.ffn_hidden});
    g.d_shared_w1.fill(0.0);
    g.d_shared_w2.fill(0.0);
    for (std::int64_t r = 0; r < R; ++r) {
      const std::int64_t T = x[std::size_t(r)].size(0);
      HostTensor dxs(DType::F64, {T, H}), dw1(DType::F64, {1, s.fc1_out(), H}), dw2(DType::F64, {1, H, s.ffn_hidden});
      const std::int64_t rows[1] = {T};
      ExpertsBackwardArgs a;
      a.x = x[std::size_t(r)];
      a.rows_per_expert = rows;
      a.weights = ExpertWeights{weights_.shared_w1, {}, weights_.shared_w2, {}};
      a.dy = d_out[std::size_t(r)];
      a.dx = dxs;
      a.grads = ExpertGrads{dw1, {}, dw2, {}};
      experts_backward(s, a);
      const HostTensor& dx = g.dx[std::size_t(r)];
      for (std::int64_t i = 0; i < T * H; ++i) dx.set_f(i, dx.f(i) + dxs.f(i));
      for (std::int64_t i = 0; i < dw1.numel(); ++i) g.d_shared_w1.set_f(i, g.d_shared_w1.f(i) + dw1.f(i));
      for (std::int64_t i = 0; i < dw2.numel(); ++i) g.d_shared_w2.set_f(i, g.d_shared_w2.f(i) + dw2.f(i));
    }
    t.shared = seconds_since(t0);
  }
  if (times) *times = t;
  return g;
}

GradientCheck check_gradients(Layer& layer, std::span<const TensorView> x, std::span<const TensorView> d_out,
                              const LayerGrads& grads, int samples, std::uint64_t seed, double d_aux, double d_z) {
  const MoeConfig& cfg = layer.config();
  auto J = [&] {
    const LayerForward f = layer.forward(x);
    double j = 0;
    for (std::size_t r = 0; r < x.size(); ++r) {
      for (std::int64_t i = 0; i < f.out[r].numel(); ++i) j += f.out[r].f(i) * load_float(d_out[r], i);
      j += d_aux * f.aux_loss[r] + d_z * f.z_loss[r];
    }
    return j;
  };
  GradientCheck result;
  Rng rng(seed);
  auto check = [&](const std::string& name, const TensorView& param, const TensorView& grad) {
    constexpr double eps = 1e-6;
    for (int s = 0; s < samples && param.numel() > 0; ++s) {
      const std::int64_t i = rng.below(param.numel());
      const double v = load_float(param, i);
      store_float(param, i, v + eps);
      const double jp = J();
      store_float(param, i, v - eps);
      const double jm = J();
      store_float(param, i, v);
      const double numeric = (jp - jm) / (2 * eps), analytic = load_float(grad, i);
      const double err = std::abs(analytic - numeric) / std::max({std::abs(analytic), std::abs(numeric), 1e-3});
      ++result.coordinates;
      if (err >= result.max_rel_error) {
        result.max_rel_error = err;
        std::ostringstream os;
        os << name << "[" << i << "]: analytic " << analytic << " numeric " << numeric;
        result.worst = os.str();
      }
    }
  };
  LayerWeights& w = layer.mutable_weights();
  for (std::size_t r = 0; r < x.size(); ++r) check("dx[rank " + std::to_string(r) + "]", x[r], grads.dx[r]);
  check("d_router", w.router, grads.d_router);
  for (std::size_t r = 0; r < w.w1.size(); ++r) {
    const std::string rank = "[rank " + std::to_string(r) + "]";
    check("dw1" + rank, w.w1[r], grads.dw1[r]);
    check("dw2" + rank, w.w2[r], grads.dw2[r]);
    if (cfg.fc1_bias) check("db1" + rank, w.b1[r], grads.db1[r]);
    if (cfg.fc2_bias) check("db2" + rank, w.b2[r], grads.db2[r]);
  }
  if (cfg.shared_expert_ffn > 0) {
    check("d_shared_w1", w.shared_w1, grads.d_shared_w1);
    check("d_shared_w2", w.shared_w2, grads.d_shared_w2);
  }
  return result;
}

}  // namespace moerail::ref
