// tests/experts/mlp_harness.h — runs the GPU grouped expert MLP and the CPU reference on the same fresh random
// inputs and compares them: relative Frobenius error < 1e-2 (bf16 GEMMs) on the segment rows (the weight and bias
// gradients expert by expert), and rows past the segments still holding the NaN poison every output gets before
// each run.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "common/gpu.h"
#include "core/cuda_check.h"
#include "experts/mlp_tuning.h"
#include "moerail/experts.h"
#include "moerail/reference/experts.h"
#include "moerail/reference/host.h"

namespace moerail::testing::mlp {

using experts::MlpGemmTile;  // tile overrides (src/experts/mlp_tuning.h)

using ref::HostTensor;
using ref::Rng;

constexpr double kTol = 1e-2;

// ---- device memory -----------------------------------------------------------------------------------------------

// A device copy of a tensor's shape and dtype, owning its memory.
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(DType dtype, const std::vector<std::int64_t>& shape) : shape_(shape), dtype_(dtype) {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    bytes_ = std::size_t(n) * dtype_size(dtype);
    MOERAIL_CUDA_CHECK(cudaMalloc(&data_, std::max<std::size_t>(bytes_, 16)));
    poison();
  }
  explicit DeviceTensor(const HostTensor& h) : DeviceTensor(h.dtype(), shape_of(h.view())) {
    if (bytes_) MOERAIL_CUDA_CHECK(cudaMemcpy(data_, h.view().data(), bytes_, cudaMemcpyHostToDevice));
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  DeviceTensor(DeviceTensor&& o) noexcept { *this = std::move(o); }
  DeviceTensor& operator=(DeviceTensor&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(shape_, o.shape_);
    std::swap(dtype_, o.dtype_);
    return *this;
  }
  ~DeviceTensor() {
    if (data_) (void)cudaFree(data_);
  }

  // NaN in every floating element (0xff bytes), 0xff.. in integers.
  void poison() const {
    if (bytes_) MOERAIL_CUDA_CHECK(cudaMemset(data_, 0xff, bytes_));
  }
  void upload(const HostTensor& h) const {
    MOERAIL_CUDA_CHECK(cudaMemcpy(data_, h.view().data(), bytes_, cudaMemcpyHostToDevice));
  }
  HostTensor download() const {
    HostTensor h(dtype_, shape_);
    if (bytes_) MOERAIL_CUDA_CHECK(cudaMemcpy(h.view().data(), data_, bytes_, cudaMemcpyDeviceToHost));
    return h;
  }
  TensorView view() const { return make_view(data_, dtype_, shape_, Device::cuda(cuda::current_device())); }
  void* data() const { return data_; }
  DType dtype() const { return dtype_; }

  static std::vector<std::int64_t> shape_of(const TensorView& v) {
    std::vector<std::int64_t> s;
    for (int i = 0; i < v.ndim(); ++i) s.push_back(v.size(i));
    return s;
  }
  static TensorView make_view(void* p, DType t, const std::vector<std::int64_t>& s, Device d) {
    switch (s.size()) {
      case 1: return TensorView(p, t, {s[0]}, d);
      case 2: return TensorView(p, t, {s[0], s[1]}, d);
      case 3: return TensorView(p, t, {s[0], s[1], s[2]}, d);
      default: return TensorView(p, t, {s[0], s[1], s[2], s[3]}, d);
    }
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  std::vector<std::int64_t> shape_;
  DType dtype_ = DType::F32;
};

// ---- comparisons -------------------------------------------------------------------------------------------------

// ||got - want|| / ||want|| over the first `count` elements; prints the first large mismatches on failure.
inline void expect_close(const char* what, const HostTensor& got, const HostTensor& want, std::int64_t count,
                         double tol = kTol) {
  double num = 0, den = 0;
  std::int64_t nan_at = -1;
  for (std::int64_t i = 0; i < count; ++i) {
    const double g = got.f(i), w = want.f(i);
    if (!std::isfinite(g) && nan_at < 0) nan_at = i;
    num += (g - w) * (g - w);
    den += w * w;
  }
  const double err = std::sqrt(num) / std::sqrt(std::max(den, 1e-300));
  EXPECT_TRUE(nan_at < 0) << what << ": element " << nan_at << " is " << got.f(nan_at) << " (expected "
                          << want.f(nan_at) << "): not written, or not finite";
  EXPECT_LT(err, tol) << what << ": relative error " << err << " over " << count << " elements";
  if (!(err < tol) && count > 0) {
    const double rms = std::sqrt(den / double(count));
    int shown = 0;
    for (std::int64_t i = 0; i < count && shown < 5; ++i)
      if (std::abs(got.f(i) - want.f(i)) > 0.05 * (std::abs(want.f(i)) + rms)) {
        std::printf("  %s[%lld] = %g, expected %g\n", what, (long long)i, got.f(i), want.f(i));
        ++shown;
      }
  }
}

// expect_close expert by expert over a [L, ...] tensor (weight and bias gradients): one error over all experts would
// hide a small expert's wrong gradient. An expert whose reference is all zeros (no rows) must be zeros (within tol
// absolute).
inline void expect_close_per_expert(const char* what, const HostTensor& got, const HostTensor& want, std::int64_t L,
                                    double tol = kTol) {
  const std::int64_t n = want.numel() / L;
  double worst = 0;
  std::int64_t worst_e = -1;
  for (std::int64_t e = 0; e < L; ++e) {
    double num = 0, den = 0;
    bool finite = true;
    for (std::int64_t i = e * n; i < (e + 1) * n; ++i) {
      const double g = got.f(i), w = want.f(i);
      finite = finite && std::isfinite(g);
      num += (g - w) * (g - w);
      den += w * w;
    }
    const double err = !finite ? INFINITY : den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    if (!(err <= worst)) {
      worst = err;
      worst_e = e;
    }
  }
  EXPECT_LT(worst, tol) << what << ": relative error " << worst << " at expert " << worst_e << " of " << L
                        << " (the worst; " << n << " elements each)";
}

// Every element from `from` on is still NaN poison (rows past the segments were not written).
inline void expect_untouched(const char* what, const HostTensor& got, std::int64_t from) {
  for (std::int64_t i = from; i < got.numel(); ++i)
    if (!std::isnan(got.f(i))) {
      ADD_FAILURE() << what << ": element " << i << " past the segments was written (" << got.f(i) << ")";
      return;
    }
}

inline void expect_zero(const char* what, const HostTensor& got, std::int64_t from, std::int64_t count) {
  for (std::int64_t i = from; i < from + count; ++i)
    if (got.f(i) != 0.0) {
      ADD_FAILURE() << what << ": element " << i << " of an expert with no rows is " << got.f(i)
                    << " (expected exact 0)";
      return;
    }
}

// f() must throw moerail::Error whose message contains needle (and whose code is `code`, when given).
template <typename F>
void expect_error_mentions(F&& f, const std::string& needle, std::optional<ErrorCode> code = std::nullopt) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "', nothing was thrown";
  } catch (const Error& e) {
    if (code) EXPECT_EQ(e.code(), *code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// ---- one case ----------------------------------------------------------------------------------------------------

inline MoeConfig small_config(Activation act, std::int64_t L, std::int64_t H = 256, std::int64_t F = 128) {
  MoeConfig c;
  c.hidden = H;
  c.ffn_hidden = F;
  c.num_experts = L;
  c.topk = 1;
  c.ep_size = 1;
  c.align = 1;
  c.activation = act;
  return c;
}

struct HostInputs {
  HostTensor x, probs, w1, b1, w2, b2, dy;
};

inline HostInputs make_inputs(const MoeConfig& cfg, std::int64_t rows, std::uint64_t seed) {
  const std::int64_t H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out(), L = cfg.local_experts();
  Rng rng(seed);
  HostInputs in;
  in.x = HostTensor(DType::BF16, {rows, H});
  in.probs = HostTensor(DType::F32, {rows});
  in.w1 = HostTensor(DType::BF16, {L, F1, H});
  in.w2 = HostTensor(DType::BF16, {L, H, F});
  in.dy = HostTensor(DType::BF16, {rows, H});
  ref::fill_uniform(in.probs, rng, 0.1, 1.0);
  // QuickGeGLU's clamps make its derivative jump at +-limit: an h1 within half a bf16 ulp of the limit may fall
  // on either side after rounding, and then GPU and reference legitimately disagree there. On a grid (x in
  // quarters, W1 in eighths, b1 in 1/32 steps) h1 is a multiple of 1/32, exact in fp32 and, below 8 in
  // magnitude, in bf16: both sides take the same side of every clamp.
  const bool grid = cfg.activation == Activation::QuickGeGLU;
  auto fill_grid = [&](const HostTensor& t, std::int64_t half_range, double step) {
    for (std::int64_t i = 0; i < t.numel(); ++i) t.set_f(i, double(rng.below(2 * half_range + 1) - half_range) * step);
  };
  if (grid) {
    fill_grid(in.x, 2, 0.25);
    fill_grid(in.w1, 4, 0.125);
  } else {
    ref::fill_normal(in.x, rng, 1.0);
    ref::fill_normal(in.w1, rng, 1.0 / std::sqrt(double(H)));
  }
  ref::fill_normal(in.w2, rng, 1.0 / std::sqrt(double(F)));
  ref::fill_normal(in.dy, rng, 1.0);
  if (cfg.fc1_bias) {
    in.b1 = HostTensor(DType::BF16, {L, F1});
    if (grid)
      fill_grid(in.b1, 16, 1.0 / 32);
    else
      ref::fill_normal(in.b1, rng, 0.5);
  }
  if (cfg.fc2_bias) {
    in.b2 = HostTensor(DType::BF16, {L, H});
    ref::fill_normal(in.b2, rng, 0.5);
  }
  return in;
}

struct RefOutputs {
  HostTensor y, dx, d_probs, dw1, db1, dw2, db2;
};

// The reference backward's inputs (x, probs, counts, weights, dy); the caller adds what it wants written.
inline ref::ExpertsBackwardArgs reference_backward_args(const MoeConfig& cfg, const HostInputs& in,
                                                        const std::vector<std::int64_t>& counts) {
  ref::ExpertsBackwardArgs ba;
  ba.x = in.x.view();
  ba.probs = in.probs.view();
  ba.rows_per_expert = counts;
  ba.weights = {in.w1.view(), cfg.fc1_bias ? in.b1.view() : TensorView(), in.w2.view(),
                cfg.fc2_bias ? in.b2.view() : TensorView()};
  ba.dy = in.dy.view();
  return ba;
}

inline RefOutputs run_reference(const MoeConfig& cfg, const HostInputs& in, const std::vector<std::int64_t>& counts) {
  const std::int64_t rows = in.x.view().size(0), H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out();
  const std::int64_t L = cfg.local_experts();
  RefOutputs r;
  r.y = HostTensor(DType::F32, {rows, H});
  r.dx = HostTensor(DType::F32, {rows, H});
  r.d_probs = HostTensor(DType::F32, {rows});
  r.dw1 = HostTensor(DType::F32, {L, F1, H});
  r.dw2 = HostTensor(DType::F32, {L, H, F});
  if (cfg.fc1_bias) r.db1 = HostTensor(DType::F32, {L, F1});
  if (cfg.fc2_bias) r.db2 = HostTensor(DType::F32, {L, H});
  ref::ExpertsBackwardArgs ba = reference_backward_args(cfg, in, counts);
  ref::ExpertsForwardArgs fa{in.x.view(), in.probs.view(), counts, ba.weights, r.y.view()};
  ref::experts_forward(cfg, fa);
  ba.dx = r.dx.view();
  ba.d_probs = r.d_probs.view();
  ba.grads = {r.dw1.view(), cfg.fc1_bias ? r.db1.view() : TensorView(), r.dw2.view(),
              cfg.fc2_bias ? r.db2.view() : TensorView()};
  ref::experts_backward(cfg, ba);
  return r;
}

struct GpuOptions {
  MlpOptions mlp;             // (its tuning is `tiles`)
  experts::MlpTuning tiles;   // kernel tiles forced per GEMM (default: the rules)
  bool per_expert = false;    // weights and grads as L per-expert tensors (through the converters)
  bool counts_i64 = false;
  bool delayed_wgrad = false; // backward() without grads, then backward_dw()
};

struct GpuOutputs {
  HostTensor y, dx, d_probs, dw1, db1, dw2, db2;
  HostTensor h1, act;  // saved by the forward
  bool activation_fused = false;
};

// Device state of one MLP run: inputs, outputs, saved tensors; all outputs poisoned at construction. The weight
// gradients are bf16, or `grad_dtype`.
struct GpuRun {
  MoeConfig cfg;
  std::int64_t rows = 0;
  DeviceTensor x, probs, counts, w1, b1, w2, b2, dy;
  DeviceTensor y, h1, act, dx, d_probs, d_h1, workspace, dw1, db1, dw2, db2;
  std::vector<DeviceTensor> pe_w1, pe_b1, pe_w2, pe_b2, pe_dw1, pe_db1, pe_dw2, pe_db2;
  std::vector<TensorView> v_w1, v_b1, v_w2, v_b2, v_dw1, v_db1, v_dw2, v_db2;
  bool per_expert = false;

  GpuRun(const MoeConfig& c, const HostInputs& in, const std::vector<std::int64_t>& host_counts, bool i64,
         bool pe, cudaStream_t stream, DType grad_dtype = DType::BF16)
      : cfg(c), rows(in.x.view().size(0)), per_expert(pe) {
    const std::int64_t H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out(), L = cfg.local_experts();
    x = DeviceTensor(in.x);
    probs = DeviceTensor(in.probs);
    w1 = DeviceTensor(in.w1);
    w2 = DeviceTensor(in.w2);
    dy = DeviceTensor(in.dy);
    if (cfg.fc1_bias) b1 = DeviceTensor(in.b1);
    if (cfg.fc2_bias) b2 = DeviceTensor(in.b2);
    counts = DeviceTensor(i64 ? DType::I64 : DType::I32, {L});
    set_counts(host_counts);
    y = DeviceTensor(DType::BF16, {rows, H});
    h1 = DeviceTensor(DType::BF16, {rows, F1});
    act = DeviceTensor(DType::BF16, {rows, F});
    dx = DeviceTensor(DType::BF16, {rows, H});
    d_probs = DeviceTensor(DType::F32, {rows});
    d_h1 = DeviceTensor(DType::BF16, {rows, F1});
    workspace = DeviceTensor(DType::BF16, {std::max<std::int64_t>(1, rows * F)});
    dw1 = DeviceTensor(grad_dtype, {L, F1, H});
    dw2 = DeviceTensor(grad_dtype, {L, H, F});
    if (cfg.fc1_bias) db1 = DeviceTensor(grad_dtype, {L, F1});
    if (cfg.fc2_bias) db2 = DeviceTensor(grad_dtype, {L, H});
    if (per_expert) {
      split(w1, pe_w1, v_w1, {F1, H}, true, stream);
      split(w2, pe_w2, v_w2, {H, F}, true, stream);
      if (cfg.fc1_bias) split(b1, pe_b1, v_b1, {F1}, true, stream);
      if (cfg.fc2_bias) split(b2, pe_b2, v_b2, {H}, true, stream);
      split(dw1, pe_dw1, v_dw1, {F1, H}, false, stream);
      split(dw2, pe_dw2, v_dw2, {H, F}, false, stream);
      if (cfg.fc1_bias) split(db1, pe_db1, v_db1, {F1}, false, stream);
      if (cfg.fc2_bias) split(db2, pe_db2, v_db2, {H}, false, stream);
    }
    MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());  // uploads and poison (legacy stream) before any MLP launch
  }

  void set_counts(const std::vector<std::int64_t>& c) const {
    HostTensor h(counts.dtype(), {std::int64_t(c.size())});
    for (std::size_t e = 0; e < c.size(); ++e) h.set_i(std::int64_t(e), c[e]);
    counts.upload(h);
    MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());  // the MLP runs on a non-blocking stream
  }

  void poison_outputs() const {
    for (const DeviceTensor* t : {&y, &h1, &act, &dx, &d_probs, &d_h1, &dw1, &dw2}) t->poison();
    if (cfg.fc1_bias) db1.poison();
    if (cfg.fc2_bias) db2.poison();
    for (const auto* list : {&pe_dw1, &pe_db1, &pe_dw2, &pe_db2})
      for (const DeviceTensor& t : *list) t.poison();
    MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());  // cudaMemset runs on the legacy stream
  }

  // L per-expert device tensors of `slice` shape; weights get the grouped tensor's values via the converter.
  void split(const DeviceTensor& grouped, std::vector<DeviceTensor>& list, std::vector<TensorView>& views,
             std::vector<std::int64_t> slice, bool copy, cudaStream_t stream) {
    const std::int64_t L = cfg.local_experts();
    for (std::int64_t e = 0; e < L; ++e) list.emplace_back(grouped.dtype(), slice);
    for (const DeviceTensor& t : list) views.push_back(t.view());
    if (copy) split_grouped_weights(grouped.view(), views, stream);
  }

  MlpWeights weights() const {
    MlpWeights w;
    if (per_expert) {
      w.w1_experts = v_w1;
      w.w2_experts = v_w2;
      w.b1_experts = v_b1;
      w.b2_experts = v_b2;
    } else {
      w.w1 = w1.view();
      w.w2 = w2.view();
      if (cfg.fc1_bias) w.b1 = b1.view();
      if (cfg.fc2_bias) w.b2 = b2.view();
    }
    return w;
  }

  MlpGrads grads() const {
    MlpGrads g;
    if (per_expert) {
      g.dw1_experts = v_dw1;
      g.dw2_experts = v_dw2;
      g.db1_experts = v_db1;
      g.db2_experts = v_db2;
    } else {
      g.dw1 = dw1.view();
      g.dw2 = dw2.view();
      if (cfg.fc1_bias) g.db1 = db1.view();
      if (cfg.fc2_bias) g.db2 = db2.view();
    }
    return g;
  }

  MlpForwardArgs forward_args() const {
    MlpForwardArgs a;
    a.x = x.view();
    a.probs = probs.view();
    a.counts = counts.view();
    a.weights = weights();
    a.y = y.view();
    a.h1 = h1.view();
    a.act = act.view();
    return a;
  }

  MlpBackwardArgs backward_args(bool with_grads) const {
    MlpBackwardArgs a;
    a.x = x.view();
    a.probs = probs.view();
    a.counts = counts.view();
    a.weights = weights();
    a.h1 = h1.view();
    a.act = act.view();
    a.dy = dy.view();
    a.dx = dx.view();
    a.d_probs = d_probs.view();
    a.d_h1 = d_h1.view();
    a.workspace = workspace.view();
    if (with_grads) a.grads = grads();
    return a;
  }

  MlpBackwardDwArgs backward_dw_args() const {
    MlpBackwardDwArgs a;
    a.x = x.view();
    a.probs = probs.view();
    a.counts = counts.view();
    a.act = act.view();
    a.dy = dy.view();
    a.d_h1 = d_h1.view();
    a.grads = grads();
    return a;
  }

  // Results on the host, per-expert gradients stacked back into grouped tensors through the converter.
  GpuOutputs results(cudaStream_t stream) const {
    if (per_expert) {
      stack_grouped_weights(v_dw1, dw1.view(), stream);
      stack_grouped_weights(v_dw2, dw2.view(), stream);
      if (cfg.fc1_bias) stack_grouped_weights(v_db1, db1.view(), stream);
      if (cfg.fc2_bias) stack_grouped_weights(v_db2, db2.view(), stream);
    }
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
    GpuOutputs o{y.download(), dx.download(), d_probs.download(), dw1.download(), {}, dw2.download(), {},
                 h1.download(), act.download()};
    if (cfg.fc1_bias) o.db1 = db1.download();
    if (cfg.fc2_bias) o.db2 = db2.download();
    return o;
  }
};

// Compares one GPU run with the reference: every output, rows past the segments untouched, empty experts' weight
// gradients exactly zero.
inline void compare(const MoeConfig& cfg, const GpuOutputs& g, const RefOutputs& r,
                    const std::vector<std::int64_t>& counts) {
  const std::int64_t H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out();
  const std::int64_t used = std::accumulate(counts.begin(), counts.end(), std::int64_t(0));
  if (used > 0) {
    expect_close("y", g.y, r.y, used * H);
    expect_close("dx", g.dx, r.dx, used * H);
    if (cfg.prob_mode == ProbMode::InActivation)
      expect_close("d_probs", g.d_probs, r.d_probs, used);
    else
      expect_zero("d_probs (in-combine)", g.d_probs, 0, used);
    const std::int64_t L = cfg.local_experts();
    expect_close_per_expert("dw1", g.dw1, r.dw1, L);
    expect_close_per_expert("dw2", g.dw2, r.dw2, L);
    if (cfg.fc1_bias) expect_close_per_expert("db1", g.db1, r.db1, L);
    if (cfg.fc2_bias) expect_close_per_expert("db2", g.db2, r.db2, L);
  }
  expect_untouched("y", g.y, used * H);
  expect_untouched("dx", g.dx, used * H);
  expect_untouched("d_probs", g.d_probs, used);
  for (std::size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] != 0) continue;
    const std::int64_t ee = std::int64_t(e);
    expect_zero("dw1", g.dw1, ee * F1 * H, F1 * H);
    expect_zero("dw2", g.dw2, ee * H * F, H * F);
    if (cfg.fc1_bias) expect_zero("db1", g.db1, ee * F1, F1);
    if (cfg.fc2_bias) expect_zero("db2", g.db2, ee * H, H);
  }
}

// Forward + backward (+ delayed wgrad) of one case, eagerly, compared with the reference.
inline GpuOutputs run_case(const MoeConfig& cfg, const std::vector<std::int64_t>& counts, std::int64_t rows,
                           const GpuOptions& opt = {}, std::uint64_t seed = 1234) {
  const HostInputs in = make_inputs(cfg, rows, seed);
  const RefOutputs r = run_reference(cfg, in, counts);
  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  GpuOutputs out;
  {
    MlpOptions mo = opt.mlp;
    mo.tuning = &opt.tiles;
    if (mo.rows_hint == 0) mo.rows_hint = rows;
    GroupedMlp mlp(cfg, mo);
    GpuRun run(cfg, in, counts, opt.counts_i64, opt.per_expert, stream);
    run.poison_outputs();
    mlp.forward(run.forward_args(), stream);
    mlp.backward(run.backward_args(!opt.delayed_wgrad), stream);
    if (opt.delayed_wgrad) mlp.backward_dw(run.backward_dw_args(), stream);
    out = run.results(stream);
    out.activation_fused = mlp.activation_fused();
    compare(cfg, out, r, counts);
  }
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
  return out;
}

// Two runs' outputs are identical bit for bit (whole buffers).
inline void expect_same_bits(const char* what, const HostTensor& x, const HostTensor& y) {
  ASSERT_EQ(x.numel(), y.numel()) << what;
  EXPECT_EQ(std::memcmp(x.view().data(), y.view().data(), x.view().nbytes()), 0) << what << " differs";
}

// The same bits in y, dx, dW1 and dW2 (dx depends on every other output of the data gradients).
inline void expect_same_y_dx_dw(const GpuOutputs& a, const GpuOutputs& b) {
  expect_same_bits("y", a.y, b.y);
  expect_same_bits("dx", a.dx, b.dx);
  expect_same_bits("dw1", a.dw1, b.dw1);
  expect_same_bits("dw2", a.dw2, b.dw2);
}

// MOERAIL_CONTIG_WALK set for a scope (the contiguous GEMMs' walk, forced for a test).
struct ScopedWalk {
  explicit ScopedWalk(const char* v) { setenv("MOERAIL_CONTIG_WALK", v, 1); }
  ~ScopedWalk() { unsetenv("MOERAIL_CONTIG_WALK"); }
  ScopedWalk(const ScopedWalk&) = delete;
  ScopedWalk& operator=(const ScopedWalk&) = delete;
};

}  // namespace moerail::testing::mlp
