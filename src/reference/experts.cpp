// CPU reference of the grouped expert MLP (see moerail/reference/experts.h for the contract).
//
// Plain loops over experts, rows and features; every product is accumulated in double and each output element is
// rounded once when stored. Inputs are read into double vectors first so the arithmetic never depends on the
// caller's dtypes. All arguments are checked before the first store.
#include "moerail/reference/experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "moerail/error.h"
#include "moerail/reference/host.h"
#include "moerail/reference/quant.h"

namespace moerail::ref {
namespace {

// ---- scalar activations and their derivatives ------------------------------------------------------------------

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// x * sigmoid(alpha * x): silu for alpha = 1, quick-gelu for alpha = 1.702.
double qgelu(double x, double alpha) { return x * sigmoid(alpha * x); }
double qgelu_grad(double x, double alpha) {
  const double s = sigmoid(alpha * x);
  return s + alpha * x * s * (1.0 - s);
}

// gelu, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
constexpr double kSqrt2OverPi = 0.7978845608028654;
constexpr double kGeluCubic = 0.044715;
double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x))); }
double gelu_grad(double x) {
  const double t = std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
  const double dinner = kSqrt2OverPi * (1.0 + 3.0 * kGeluCubic * x * x);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner;
}

// ---- GLU column layout -----------------------------------------------------------------------------------------

// Columns of FC1's output [F1 = 2F] that hold the gate (a) and linear (b) inputs of GLU output feature j.
struct GluColumns {
  std::size_t gate, linear;
};
GluColumns glu_columns(const MoeConfig& cfg, std::int64_t j) {
  const std::int64_t F = cfg.ffn_hidden;
  if (cfg.glu_layout == GluLayout::Concatenated) return {std::size_t(j), std::size_t(F + j)};
  const std::int64_t g = cfg.glu_block, block = j / g, offset = j % g;  // [a block | b block] pairs of 2g columns
  return {std::size_t(2 * g * block + offset), std::size_t(2 * g * block + g + offset)};
}

// ---- activations of one row, arguments already checked ---------------------------------------------------------

void activation_forward_row(const MoeConfig& cfg, std::span<const double> h1, std::span<double> a) {
  const std::int64_t F = cfg.ffn_hidden;
  const double alpha = cfg.quick_geglu_alpha, limit = cfg.quick_geglu_limit, offset = cfg.quick_geglu_offset;
  for (std::int64_t j = 0; j < F; ++j) {
    const std::size_t jj = std::size_t(j);
    switch (cfg.activation) {
      case Activation::SwiGLU: {
        const auto c = glu_columns(cfg, j);
        a[jj] = qgelu(h1[c.gate], 1.0) * h1[c.linear];
        break;
      }
      case Activation::GeGLU: {
        const auto c = glu_columns(cfg, j);
        a[jj] = gelu(h1[c.gate]) * h1[c.linear];
        break;
      }
      case Activation::QuickGeGLU: {
        const auto c = glu_columns(cfg, j);
        const double gate = std::min(h1[c.gate], limit);
        const double linear = std::clamp(h1[c.linear], -limit, limit) + offset;
        a[jj] = qgelu(gate, alpha) * linear;
        break;
      }
      case Activation::ReLU2: {
        const double r = h1[jj] > 0.0 ? h1[jj] : 0.0;
        a[jj] = r * r;
        break;
      }
      case Activation::GELU: a[jj] = gelu(h1[jj]); break;
    }
  }
}

void activation_backward_row(const MoeConfig& cfg, std::span<const double> h1, std::span<const double> d_a,
                             std::span<double> d_h1) {
  const std::int64_t F = cfg.ffn_hidden;
  const double alpha = cfg.quick_geglu_alpha, limit = cfg.quick_geglu_limit, offset = cfg.quick_geglu_offset;
  for (std::int64_t j = 0; j < F; ++j) {
    const std::size_t jj = std::size_t(j);
    switch (cfg.activation) {
      case Activation::SwiGLU: {
        const auto c = glu_columns(cfg, j);
        d_h1[c.gate] = d_a[jj] * qgelu_grad(h1[c.gate], 1.0) * h1[c.linear];
        d_h1[c.linear] = d_a[jj] * qgelu(h1[c.gate], 1.0);
        break;
      }
      case Activation::GeGLU: {
        const auto c = glu_columns(cfg, j);
        d_h1[c.gate] = d_a[jj] * gelu_grad(h1[c.gate]) * h1[c.linear];
        d_h1[c.linear] = d_a[jj] * gelu(h1[c.gate]);
        break;
      }
      case Activation::QuickGeGLU: {
        // The clamps pass the gradient where the input is inside the limits, bounds included (as TransformerEngine's
        // clamped_dsilu / scaled_clamped_dswiglu), and stop it outside.
        const auto c = glu_columns(cfg, j);
        const double a_in = h1[c.gate], b_in = h1[c.linear];
        const double gate = std::min(a_in, limit);
        const double linear = std::clamp(b_in, -limit, limit) + offset;
        d_h1[c.gate] = a_in <= limit ? d_a[jj] * qgelu_grad(gate, alpha) * linear : 0.0;
        d_h1[c.linear] = (b_in >= -limit && b_in <= limit) ? d_a[jj] * qgelu(gate, alpha) : 0.0;
        break;
      }
      case Activation::ReLU2: d_h1[jj] = h1[jj] > 0.0 ? d_a[jj] * 2.0 * h1[jj] : 0.0; break;
      case Activation::GELU: d_h1[jj] = d_a[jj] * gelu_grad(h1[jj]); break;
    }
  }
}

// ---- argument checks -------------------------------------------------------------------------------------------

// The floating dtypes load_float / store_float handle.
void check_float_dtype(std::string_view op, std::string_view name, const TensorView& t) {
  check_dtype(op, name, t, {DType::F64, DType::F32, DType::BF16, DType::F16});
}

void require(std::string_view op, std::string_view name, const TensorView& t) {
  if (!t.defined()) fail(op, name, " is absent but required");
}

// A host view of a floating dtype (prob_like: f32/f64 only) and the given shape.
void check_view(std::string_view op, std::string_view name, const TensorView& t,
                std::initializer_list<std::int64_t> shape, bool prob_like = false) {
  require(op, name, t);
  check_device(op, name, t, Device::host());
  if (prob_like)
    check_dtype(op, name, t, {DType::F32, DType::F64});
  else
    check_float_dtype(op, name, t);
  check_shape(op, name, t, shape);
}

// A bias view is required iff its config flag is set.
void check_bias(std::string_view op, std::string_view name, const TensorView& t, bool flag,
                std::string_view flag_name, std::initializer_list<std::int64_t> shape) {
  if (!flag) {
    if (t.defined()) fail(op, name, " is given but cfg.", flag_name, " = false (expected no ", name, ")");
    return;
  }
  if (!t.defined()) fail(op, name, " is absent but cfg.", flag_name, " = true");
  check_view(op, name, t, shape);
}

// Sizes of one call, all checked against each other.
struct Dims {
  std::int64_t rows = 0;  // rows of x (segments plus the rows past them)
  std::int64_t H = 0, F = 0, F1 = 0, L = 0;
};

// Checks what forward and backward share: cfg, x, rows_per_expert, weights, and probs when InActivation.
Dims check_inputs(std::string_view op, const MoeConfig& cfg, const TensorView& x, const TensorView& probs,
                  std::span<const std::int64_t> rows_per_expert, const ExpertWeights& w) {
  cfg.validate();
  Dims d;
  d.H = cfg.hidden;
  d.F = cfg.ffn_hidden;
  d.F1 = cfg.fc1_out();
  d.L = std::int64_t(rows_per_expert.size());

  check_view(op, "x", x, {-1, d.H});
  d.rows = x.size(0);

  std::int64_t used = 0;
  for (std::int64_t e = 0; e < d.L; ++e) {
    const std::int64_t n = rows_per_expert[std::size_t(e)];
    if (n < 0) fail(op, "rows_per_expert[", e, "] = ", n, " but a count >= 0 was expected");
    if (n > d.rows - used)
      fail(op, "rows_per_expert[", e, "] = ", n, " ends the segments past the ", d.rows, " rows of x (", used,
           " rows before it; expected sum(rows_per_expert) <= rows)");
    used += n;
  }

  check_view(op, "weights.w1", w.w1, {d.L, d.F1, d.H});
  check_bias(op, "weights.b1", w.b1, cfg.fc1_bias, "fc1_bias", {d.L, d.F1});
  check_view(op, "weights.w2", w.w2, {d.L, d.H, d.F});
  check_bias(op, "weights.b2", w.b2, cfg.fc2_bias, "fc2_bias", {d.L, d.H});

  if (cfg.prob_mode == ProbMode::InActivation) {
    if (!probs.defined()) fail(op, "probs is absent but cfg.prob_mode = in-activation needs them");
    check_view(op, "probs", probs, {d.rows}, /*prob_like=*/true);
    for (std::int64_t r = 0; r < used; ++r) {
      const double p = load_float(probs, r);
      if (!std::isfinite(p))
        fail_with(ErrorCode::BadRouting, op, "probs[", r, "] = ", p, " but a finite prob was expected");
    }
  }
  return d;
}

// ---- the MLP of one row ----------------------------------------------------------------------------------------

// The weights of all L experts, read once into double.
struct Weights64 {
  std::vector<double> w1, b1, w2, b2;  // [L,F1,H], [L,F1] or empty, [L,H,F], [L,H] or empty

  explicit Weights64(const ExpertWeights& w)
      : w1(read_floats(w.w1)),
        b1(w.b1.defined() ? read_floats(w.b1) : std::vector<double>{}),
        w2(read_floats(w.w2)),
        b2(w.b2.defined() ? read_floats(w.b2) : std::vector<double>{}) {}
};

// The forward of one row of expert e, with the intermediates the backward needs.
struct RowForward {
  std::vector<double> h1;  // [F1] x W1^T + b1
  std::vector<double> a;   // [F]  act(h1)
  std::vector<double> z;   // [H]  a W2^T + b2, before any prob
};

void row_forward(const MoeConfig& cfg, const Dims& d, const Weights64& w, std::int64_t e,
                 std::span<const double> x, RowForward& out) {
  out.h1.assign(std::size_t(d.F1), 0.0);
  out.a.assign(std::size_t(d.F), 0.0);
  out.z.assign(std::size_t(d.H), 0.0);
  for (std::int64_t i = 0; i < d.F1; ++i) {
    double s = w.b1.empty() ? 0.0 : w.b1[std::size_t(e * d.F1 + i)];
    for (std::int64_t k = 0; k < d.H; ++k) s += x[std::size_t(k)] * w.w1[std::size_t((e * d.F1 + i) * d.H + k)];
    out.h1[std::size_t(i)] = s;
  }
  activation_forward_row(cfg, out.h1, out.a);
  for (std::int64_t h = 0; h < d.H; ++h) {
    double s = w.b2.empty() ? 0.0 : w.b2[std::size_t(e * d.H + h)];
    for (std::int64_t f = 0; f < d.F; ++f) s += out.a[std::size_t(f)] * w.w2[std::size_t((e * d.H + h) * d.F + f)];
    out.z[std::size_t(h)] = s;
  }
}

std::vector<double> read_row(const TensorView& t, std::int64_t row, std::int64_t width) {
  std::vector<double> v(static_cast<std::size_t>(width));
  for (std::int64_t k = 0; k < width; ++k) v[std::size_t(k)] = load_float(t, row * width + k);
  return v;
}

// The weight gradients into the views: written, or (accumulate) g rounded to the view's dtype first (stored, then
// read back), then the sum stored.
void store_grads(const MoeConfig& cfg, const ExpertGrads& g, std::span<const double> dw1, std::span<const double> db1,
                 std::span<const double> dw2, std::span<const double> db2) {
  auto out = [&](const TensorView& t, std::span<const double> values) {
    if (!g.accumulate) return write_floats(t, values);
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const double old = load_float(t, i);
      store_float(t, i, values[std::size_t(i)]);
      store_float(t, i, old + load_float(t, i));
    }
  };
  out(g.dw1, dw1);
  out(g.dw2, dw2);
  if (cfg.fc1_bias) out(g.db1, db1);
  if (cfg.fc2_bias) out(g.db2, db2);
}

// ---- the FP8 recipes: quantize-dequantize (QDQ) at the FP8 step's points ------------------------------------------

// One scale group of n values, `stride` apart: s = block_scale_from_amax(amax) (fp32), v <- float(e4m3(v / s)) s
// (quantize_fp8 and dequantize_fp8's arithmetic: one fp32 reciprocal, one product each way).
void qdq_group(double* v, std::int64_t n, std::int64_t stride) {
  float amax = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(float(v[i * stride])));
  const float s = block_scale_from_amax(amax), inv = 1.0f / s;
  for (std::int64_t i = 0; i < n; ++i)
    v[i * stride] = double(e4m3_to_float(float_to_e4m3(float(v[i * stride]) * inv)) * s);
}

// m [rows, C] row-major: 1x128 groups along C (each row's columns).
void qdq_rows(std::vector<double>& m, std::int64_t rows, std::int64_t C) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c0 = 0; c0 < C; c0 += 128) qdq_group(m.data() + r * C + c0, std::min<std::int64_t>(128, C - c0), 1);
}

// m [rows, C] row-major, one expert's segment: 128x1 groups along the rows (blocks of 128 rows from row 0, the last
// one short), each column on its own: the operands of a weight gradient.
std::vector<double> qdq_columns(std::vector<double> m, std::int64_t rows, std::int64_t C) {
  for (std::int64_t r0 = 0; r0 < rows; r0 += 128)
    for (std::int64_t c = 0; c < C; ++c) qdq_group(m.data() + r0 * C + c, std::min<std::int64_t>(128, rows - r0), C);
  return m;
}

// The bf16 value of v (the FP8 step keeps h1, act, d_act and d_h1 in bf16 between its GEMMs: their QDQ starts there).
double bf16_of(double v) { return double(round_to_bf16(float(v))); }
void round_bf16(std::vector<double>& m) {
  for (double& v : m) v = bf16_of(v);
}
std::vector<double> bf16_all(std::vector<double> m) {
  round_bf16(m);
  return m;
}

// w [N, K] row-major (one expert's weight): 128x128 blocks (the last block row short when N % 128 != 0).
std::vector<double> qdq_weight(const double* w, std::int64_t N, std::int64_t K) {
  std::vector<double> q(w, w + N * K);
  for (std::int64_t n0 = 0; n0 < N; n0 += 128)
    for (std::int64_t k0 = 0; k0 < K; k0 += 128) {
      const std::int64_t nn = std::min<std::int64_t>(128, N - n0);
      float amax = 0.0f;
      for (std::int64_t n = n0; n < n0 + nn; ++n)
        for (std::int64_t k = k0; k < k0 + 128; ++k) amax = std::fmax(amax, std::fabs(float(q[std::size_t(n * K + k)])));
      const float s = block_scale_from_amax(amax), inv = 1.0f / s;
      for (std::int64_t n = n0; n < n0 + nn; ++n)
        for (std::int64_t k = k0; k < k0 + 128; ++k) {
          double& v = q[std::size_t(n * K + k)];
          v = double(e4m3_to_float(float_to_e4m3(float(v) * inv)) * s);
        }
    }
  return q;
}

// c [M, N] = a [M, K] b^T (b [N, K]) or, transposed_b, a [M, K] b (b [K, N]); in double, k in order.
std::vector<double> matmul(const std::vector<double>& a, const std::vector<double>& b, std::int64_t M,
                           std::int64_t N, std::int64_t K, bool transposed_b) {
  std::vector<double> c(std::size_t(M * N), 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double s = 0.0;
      for (std::int64_t k = 0; k < K; ++k)
        s += a[std::size_t(m * K + k)] * (transposed_b ? b[std::size_t(k * N + n)] : b[std::size_t(n * K + k)]);
      c[std::size_t(m * N + n)] = s;
    }
  return c;
}

// Per-tensor current scaling of a whole tensor (the per-tensor recipes): s = tensor_scale_from_amax over every
// element, v <- decode(encode(v / s)) s in the format given (e4m3, or e5m2 for the hybrid recipe's gradients).
void qdq_tensor(std::vector<double>& m, bool e5m2) {
  float amax = 0.0f;
  for (const double v : m) amax = std::fmax(amax, std::fabs(float(v)));
  const float s = tensor_scale_from_amax(amax, e5m2 ? kE5M2Max : kE4M3Max), inv = 1.0f / s;
  for (double& v : m) {
    const float q = float(v) * inv;
    v = double((e5m2 ? e5m2_to_float(float_to_e5m2(q)) : e4m3_to_float(float_to_e4m3(q))) * s);
  }
}

void check_fp8_dims(std::string_view op, const MoeConfig& cfg, Recipe recipe) {
  if (recipe != Recipe::Fp8Blockwise && !is_per_tensor(recipe))
    fail(op, "recipe = ", int(recipe), " is not a recipe");
  const std::int64_t m = recipe == Recipe::Fp8Blockwise ? 128 : 16;  // the scale blocks; 16-byte FP8 rows
  if (cfg.hidden % m != 0 || cfg.ffn_hidden % m != 0)
    fail_with(ErrorCode::Unsupported, op, "recipe ", name_of(recipe), " needs hidden and ffn_hidden multiples of ",
              m, " (got ", cfg.hidden, " and ", cfg.ffn_hidden, ")");
}

// One operand tensor of the FP8 step QDQ'd as `recipe` quantizes it: activations and gradients [rows, C] (1x128
// along C, or per tensor; `gradient`: the hybrid recipe's e5m2), a weight [N, K] (128x128 blocks, or per tensor).
void qdq_activation(std::vector<double>& m, std::int64_t rows, std::int64_t C, Recipe recipe, bool gradient) {
  if (recipe == Recipe::Fp8Blockwise) qdq_rows(m, rows, C);
  else qdq_tensor(m, gradient && recipe == Recipe::Fp8TensorHybrid);
}
std::vector<double> qdq_weight_as(const double* w, std::int64_t N, std::int64_t K, Recipe recipe) {
  if (recipe == Recipe::Fp8Blockwise) return qdq_weight(w, N, K);
  std::vector<double> q(w, w + N * K);
  qdq_tensor(q, false);
  return q;
}

// One expert's segment of the FP8 step: the forward, and what the backward reads of it.
struct SegmentFp8 {
  std::int64_t n = 0;
  std::vector<double> xq, w1q, w2q, h1, a, act, actq, p;  // [n,H], [F1,H], [H,F], [n,F1], [n,F], [n,F], [n,F], [n]
};

SegmentFp8 segment_forward_fp8(const MoeConfig& cfg, const Dims& d, const Weights64& w, const TensorView& x,
                               const TensorView& probs, std::int64_t e, std::int64_t row0, std::int64_t n,
                               Recipe recipe) {
  SegmentFp8 s;
  s.n = n;
  s.xq.resize(std::size_t(n * d.H));
  for (std::int64_t i = 0; i < n * d.H; ++i) s.xq[std::size_t(i)] = load_float(x, row0 * d.H + i);
  qdq_activation(s.xq, n, d.H, recipe, false);
  s.w1q = qdq_weight_as(w.w1.data() + e * d.F1 * d.H, d.F1, d.H, recipe);
  s.w2q = qdq_weight_as(w.w2.data() + e * d.H * d.F, d.H, d.F, recipe);
  s.h1 = matmul(s.xq, s.w1q, n, d.F1, d.H, false);
  if (!w.b1.empty())
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < d.F1; ++i) s.h1[std::size_t(r * d.F1 + i)] += w.b1[std::size_t(e * d.F1 + i)];
  round_bf16(s.h1);
  s.a.resize(std::size_t(n * d.F));
  s.p.assign(std::size_t(n), 1.0);
  for (std::int64_t r = 0; r < n; ++r) {
    activation_forward_row(cfg, std::span<const double>(s.h1).subspan(std::size_t(r * d.F1), std::size_t(d.F1)),
                           std::span<double>(s.a).subspan(std::size_t(r * d.F), std::size_t(d.F)));
    if (cfg.prob_mode == ProbMode::InActivation) s.p[std::size_t(r)] = load_float(probs, row0 + r);
  }
  s.act.resize(s.a.size());
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t f = 0; f < d.F; ++f)
      s.act[std::size_t(r * d.F + f)] = bf16_of(s.p[std::size_t(r)] * s.a[std::size_t(r * d.F + f)]);
  s.actq = s.act;
  qdq_activation(s.actq, n, d.F, recipe, false);
  return s;
}

// ---- grouped <-> per-expert checks -----------------------------------------------------------------------------

void check_grouped_pair(std::string_view op, const TensorView& grouped, std::span<const TensorView> per_expert) {
  check_grouped_slices(op, grouped, per_expert);
  check_device(op, "grouped", grouped, Device::host());
  for (std::size_t e = 0; e < per_expert.size(); ++e)
    check_device(op, "per_expert[" + std::to_string(e) + "]", per_expert[e], Device::host());
}

}  // namespace

// ---- public entry points ---------------------------------------------------------------------------------------

void activation_forward(const MoeConfig& cfg, std::span<const double> h1, std::span<double> a) {
  cfg.validate();
  if (std::int64_t(h1.size()) != cfg.fc1_out() || std::int64_t(a.size()) != cfg.ffn_hidden)
    fail("activation_forward", "h1 has ", h1.size(), " and a has ", a.size(), " elements but ", cfg.fc1_out(),
         " and ", cfg.ffn_hidden, " were expected (", name_of(cfg.activation), ")");
  activation_forward_row(cfg, h1, a);
}

void activation_backward(const MoeConfig& cfg, std::span<const double> h1, std::span<const double> d_a,
                         std::span<double> d_h1) {
  cfg.validate();
  if (std::int64_t(h1.size()) != cfg.fc1_out() || std::int64_t(d_a.size()) != cfg.ffn_hidden ||
      std::int64_t(d_h1.size()) != cfg.fc1_out())
    fail("activation_backward", "h1, d_a and d_h1 have ", h1.size(), ", ", d_a.size(), " and ", d_h1.size(),
         " elements but ", cfg.fc1_out(), ", ", cfg.ffn_hidden, " and ", cfg.fc1_out(), " were expected (",
         name_of(cfg.activation), ")");
  activation_backward_row(cfg, h1, d_a, d_h1);
}

void experts_forward(const MoeConfig& cfg, const ExpertsForwardArgs& args) {
  constexpr std::string_view op = "experts_forward";
  const Dims d = check_inputs(op, cfg, args.x, args.probs, args.rows_per_expert, args.weights);
  check_view(op, "y", args.y, {d.rows, d.H});

  const Weights64 w(args.weights);
  if (args.recipe != Recipe::BF16) {
    check_fp8_dims(op, cfg, args.recipe);
    std::int64_t row0 = 0;
    for (std::int64_t e = 0; e < d.L; ++e) {
      const std::int64_t n = args.rows_per_expert[std::size_t(e)];
      const SegmentFp8 sg = segment_forward_fp8(cfg, d, w, args.x, args.probs, e, row0, n, args.recipe);
      const std::vector<double> z = matmul(sg.actq, sg.w2q, n, d.H, d.F, false);
      for (std::int64_t r = 0; r < n; ++r)
        for (std::int64_t h = 0; h < d.H; ++h) {
          const double b2 = w.b2.empty() ? 0.0 : sg.p[std::size_t(r)] * w.b2[std::size_t(e * d.H + h)];
          store_float(args.y, (row0 + r) * d.H + h, z[std::size_t(r * d.H + h)] + b2);
        }
      row0 += n;
    }
    return;
  }
  const bool scale_by_prob = cfg.prob_mode == ProbMode::InActivation;
  RowForward f;
  std::int64_t row = 0;
  for (std::int64_t e = 0; e < d.L; ++e) {
    const std::int64_t end = row + args.rows_per_expert[std::size_t(e)];
    for (; row < end; ++row) {
      row_forward(cfg, d, w, e, read_row(args.x, row, d.H), f);
      const double p = scale_by_prob ? load_float(args.probs, row) : 1.0;
      for (std::int64_t h = 0; h < d.H; ++h) store_float(args.y, row * d.H + h, p * f.z[std::size_t(h)]);
    }
  }
}

void experts_backward(const MoeConfig& cfg, const ExpertsBackwardArgs& args) {
  constexpr std::string_view op = "experts_backward";
  const Dims d = check_inputs(op, cfg, args.x, args.probs, args.rows_per_expert, args.weights);
  check_view(op, "dy", args.dy, {d.rows, d.H});
  if (args.dx.defined()) check_view(op, "dx", args.dx, {d.rows, d.H});
  if (args.d_probs.defined()) check_view(op, "d_probs", args.d_probs, {d.rows}, /*prob_like=*/true);
  const ExpertGrads& g = args.grads;
  const bool want_wgrad = g.dw1.defined() || g.db1.defined() || g.dw2.defined() || g.db2.defined();
  if (want_wgrad) {
    check_view(op, "grads.dw1", g.dw1, {d.L, d.F1, d.H});
    check_bias(op, "grads.db1", g.db1, cfg.fc1_bias, "fc1_bias", {d.L, d.F1});
    check_view(op, "grads.dw2", g.dw2, {d.L, d.H, d.F});
    check_bias(op, "grads.db2", g.db2, cfg.fc2_bias, "fc2_bias", {d.L, d.H});
  }

  const Weights64 w(args.weights);
  const bool in_activation = cfg.prob_mode == ProbMode::InActivation;
  // Weight gradients accumulate over all rows of an expert (in row order) and are stored once at the end, so
  // experts with no rows get exact zeros.
  std::vector<double> dw1(std::size_t(d.L * d.F1 * d.H), 0.0), db1(std::size_t(d.L * d.F1), 0.0);
  std::vector<double> dw2(std::size_t(d.L * d.H * d.F), 0.0), db2(std::size_t(d.L * d.H), 0.0);
  if (args.recipe != Recipe::BF16) {
    check_fp8_dims(op, cfg, args.recipe);
    std::int64_t row0 = 0;
    for (std::int64_t e = 0; e < d.L; ++e) {
      const std::int64_t n = args.rows_per_expert[std::size_t(e)];
      const SegmentFp8 sg = segment_forward_fp8(cfg, d, w, args.x, args.probs, e, row0, n, args.recipe);
      std::vector<double> dy(std::size_t(n * d.H));
      for (std::int64_t i = 0; i < n * d.H; ++i) dy[std::size_t(i)] = load_float(args.dy, row0 * d.H + i);
      std::vector<double> dyq = dy;
      qdq_activation(dyq, n, d.H, args.recipe, true);
      std::vector<double> dact = matmul(dyq, sg.w2q, n, d.F, d.H, true);  // d_act = dy W2
      round_bf16(dact);
      std::vector<double> dh1(std::size_t(n * d.F1)), da(std::size_t(d.F));
      for (std::int64_t r = 0; r < n; ++r) {
        const double p = sg.p[std::size_t(r)];
        if (args.d_probs.defined()) {
          double dp = 0.0;
          if (in_activation) {
            for (std::int64_t f = 0; f < d.F; ++f)
              dp += sg.a[std::size_t(r * d.F + f)] * dact[std::size_t(r * d.F + f)];
            if (!w.b2.empty())
              for (std::int64_t h = 0; h < d.H; ++h)
                dp += w.b2[std::size_t(e * d.H + h)] * dy[std::size_t(r * d.H + h)];
          }
          store_float(args.d_probs, row0 + r, dp);
        }
        for (std::int64_t f = 0; f < d.F; ++f) da[std::size_t(f)] = p * dact[std::size_t(r * d.F + f)];
        activation_backward_row(cfg, std::span<const double>(sg.h1).subspan(std::size_t(r * d.F1), std::size_t(d.F1)),
                                da, std::span<double>(dh1).subspan(std::size_t(r * d.F1), std::size_t(d.F1)));
      }
      round_bf16(dh1);
      std::vector<double> dh1q = dh1;
      qdq_activation(dh1q, n, d.F1, args.recipe, true);
      if (args.dx.defined()) {
        const std::vector<double> dx = matmul(dh1q, sg.w1q, n, d.H, d.F1, true);  // dx = d_h1 W1
        for (std::int64_t i = 0; i < n * d.H; ++i) store_float(args.dx, row0 * d.H + i, dx[std::size_t(i)]);
      }
      if (want_wgrad && n > 0) {
        const bool qdq = args.fp8_weight_grads == Fp8WeightGrads::Fp8;
        const auto operand = [&](const std::vector<double>& v, std::int64_t width) {
          return qdq ? qdq_columns(v, n, width) : v;
        };
        // Per tensor, a transposed copy keeps the tensor's one scale: the operands are the dgrads' and the
        // forward's own quantized tensors.
        const bool same = qdq && is_per_tensor(args.recipe);
        const std::vector<double> dyt = same ? dyq : operand(dy, d.H), actt = same ? sg.actq : operand(sg.act, d.F),
                                  dh1t = same ? dh1q : operand(dh1, d.F1),
                                  xt = same ? sg.xq : operand(bf16_all(sg.xq), d.H);
        for (std::int64_t r = 0; r < n; ++r) {
          for (std::int64_t h = 0; h < d.H; ++h) {
            db2[std::size_t(e * d.H + h)] += sg.p[std::size_t(r)] * dy[std::size_t(r * d.H + h)];
            for (std::int64_t f = 0; f < d.F; ++f)
              dw2[std::size_t((e * d.H + h) * d.F + f)] += dyt[std::size_t(r * d.H + h)] * actt[std::size_t(r * d.F + f)];
          }
          for (std::int64_t i = 0; i < d.F1; ++i) {
            db1[std::size_t(e * d.F1 + i)] += dh1[std::size_t(r * d.F1 + i)];
            for (std::int64_t k = 0; k < d.H; ++k)
              dw1[std::size_t((e * d.F1 + i) * d.H + k)] += dh1t[std::size_t(r * d.F1 + i)] * xt[std::size_t(r * d.H + k)];
          }
        }
      }
      row0 += n;
    }
    if (want_wgrad) store_grads(cfg, g, dw1, db1, dw2, db2);
    return;
  }

  RowForward f;
  std::vector<double> dz(std::size_t(d.H)), da(std::size_t(d.F)), dh1(std::size_t(d.F1));
  std::int64_t row = 0;
  for (std::int64_t e = 0; e < d.L; ++e) {
    const std::int64_t end = row + args.rows_per_expert[std::size_t(e)];
    for (; row < end; ++row) {
      const std::vector<double> x = read_row(args.x, row, d.H);
      const std::vector<double> dy = read_row(args.dy, row, d.H);
      row_forward(cfg, d, w, e, x, f);

      // y = p z: dz = p dy, dp = <z, dy>.
      const double p = in_activation ? load_float(args.probs, row) : 1.0;
      for (std::int64_t h = 0; h < d.H; ++h) dz[std::size_t(h)] = p * dy[std::size_t(h)];
      if (args.d_probs.defined()) {
        double dp = 0.0;
        if (in_activation)
          for (std::int64_t h = 0; h < d.H; ++h) dp += f.z[std::size_t(h)] * dy[std::size_t(h)];
        store_float(args.d_probs, row, dp);
      }

      // z = a W2^T + b2: da = dz W2.
      for (std::int64_t k = 0; k < d.F; ++k) {
        double s = 0.0;
        for (std::int64_t h = 0; h < d.H; ++h)
          s += dz[std::size_t(h)] * w.w2[std::size_t((e * d.H + h) * d.F + k)];
        da[std::size_t(k)] = s;
      }
      activation_backward_row(cfg, f.h1, da, dh1);

      // h1 = x W1^T + b1: dx = dh1 W1.
      if (args.dx.defined()) {
        for (std::int64_t k = 0; k < d.H; ++k) {
          double s = 0.0;
          for (std::int64_t i = 0; i < d.F1; ++i)
            s += dh1[std::size_t(i)] * w.w1[std::size_t((e * d.F1 + i) * d.H + k)];
          store_float(args.dx, row * d.H + k, s);
        }
      }

      if (want_wgrad) {
        for (std::int64_t h = 0; h < d.H; ++h) {
          db2[std::size_t(e * d.H + h)] += dz[std::size_t(h)];
          for (std::int64_t k = 0; k < d.F; ++k)
            dw2[std::size_t((e * d.H + h) * d.F + k)] += dz[std::size_t(h)] * f.a[std::size_t(k)];
        }
        for (std::int64_t i = 0; i < d.F1; ++i) {
          db1[std::size_t(e * d.F1 + i)] += dh1[std::size_t(i)];
          for (std::int64_t k = 0; k < d.H; ++k)
            dw1[std::size_t((e * d.F1 + i) * d.H + k)] += dh1[std::size_t(i)] * x[std::size_t(k)];
        }
      }
    }
  }

  if (want_wgrad) store_grads(cfg, g, dw1, db1, dw2, db2);
}

void split_grouped(const TensorView& grouped, std::span<const TensorView> per_expert) {
  check_grouped_pair("split_grouped", grouped, per_expert);
  const auto* src = static_cast<const unsigned char*>(grouped.data());
  for (std::size_t e = 0; e < per_expert.size(); ++e) {
    const std::size_t bytes = per_expert[e].nbytes();
    if (bytes > 0) std::memcpy(per_expert[e].data(), src + e * bytes, bytes);
  }
}

void stack_grouped(std::span<const TensorView> per_expert, const TensorView& grouped) {
  check_grouped_pair("stack_grouped", grouped, per_expert);
  auto* dst = static_cast<unsigned char*>(grouped.data());
  for (std::size_t e = 0; e < per_expert.size(); ++e) {
    const std::size_t bytes = per_expert[e].nbytes();
    if (bytes > 0) std::memcpy(dst + e * bytes, per_expert[e].data(), bytes);
  }
}

}  // namespace moerail::ref
