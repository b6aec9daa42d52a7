// The whole reference layer: gradients against finite differences, invariance to the number of ranks, capacity.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "moerail/error.h"
#include "moerail/reference/layer.h"

namespace moerail {
namespace {

using ref::HostTensor;

MoeConfig small_config(std::int64_t ranks) {
  MoeConfig c = preset_config("small");
  c.ep_size = ranks;
  c.hidden = 16;
  c.ffn_hidden = 8;
  c.shared_expert_ffn = 8;
  c.max_tokens = 12;
  return c;
}

std::vector<HostTensor> random_inputs(const std::vector<std::int64_t>& tokens, std::int64_t H, std::uint64_t seed) {
  ref::Rng rng(seed);
  std::vector<HostTensor> x;
  for (std::int64_t T : tokens) {
    x.emplace_back(DType::F64, std::vector<std::int64_t>{T, H});
    ref::fill_normal(x.back(), rng, 1.0);
  }
  return x;
}

std::vector<TensorView> views(const std::vector<HostTensor>& ts) {
  std::vector<TensorView> v;
  for (const auto& t : ts) v.push_back(t.view());
  return v;
}

void check_layer_gradients(const MoeConfig& cfg, const std::vector<std::int64_t>& tokens, std::uint64_t seed) {
  ref::Layer layer(cfg, ref::LayerWeights::random(cfg, seed));
  auto x = random_inputs(tokens, cfg.hidden, seed + 1);
  auto g = random_inputs(tokens, cfg.hidden, seed + 2);
  const double d_aux = 0.7, d_z = 1.3;
  const auto xv = views(x), gv = views(g);
  const ref::LayerForward f = layer.forward(xv);
  const ref::LayerGrads grads = layer.backward(xv, f, gv, d_aux, d_z);
  const ref::GradientCheck check = ref::check_gradients(layer, xv, gv, grads, 8, seed + 3, d_aux, d_z);
  EXPECT_GE(check.coordinates, 8 * 4);  // x, router, W1, W2 of at least one rank
  // fp64 central differences with step 1e-6: truncation ~1e-12 relative, rounding ~1e-10 / 1e-6.
  EXPECT_LT(check.max_rel_error, 1e-5) << "worst: " << check.worst;
}

TEST(Layer, GradientsMatchFiniteDifferencesTwoRanks) {
  check_layer_gradients(small_config(2), {11, 5}, 100);
}

TEST(Layer, GradientsMatchFiniteDifferencesVariants) {
  {  // softmax after top-k, probs applied in combine, GeGLU interleaved, alignment 8, four ranks, one empty
    MoeConfig c = small_config(4);
    c.router = RouterConfig{};
    c.router.aux_loss_coeff = 0.05;
    c.prob_mode = ProbMode::InCombine;
    c.activation = Activation::GeGLU;
    c.glu_layout = GluLayout::Interleaved;
    c.glu_block = 2;
    c.align = 8;
    check_layer_gradients(c, {7, 0, 12, 3}, 200);
  }
  {  // softmax before top-k, ReLU^2, no biases, no shared expert, capacity factor that does not overflow
    MoeConfig c = small_config(1);
    c.router = RouterConfig{};
    c.router.pre_softmax = true;
    c.router.z_loss_coeff = 0.01;
    c.activation = Activation::ReLU2;
    c.fc1_bias = c.fc2_bias = false;
    c.shared_expert_ffn = 0;
    c.capacity = Capacity::of_factor(2.0);
    check_layer_gradients(c, {9}, 300);
  }
  {  // sqrtsoftplus, quick-GeGLU, K = L = E / R
    MoeConfig c = small_config(2);
    c.router.score = ScoreFunction::SqrtSoftplus;
    c.router.num_groups = 0;
    c.topk = 4;
    c.activation = Activation::QuickGeGLU;
    check_layer_gradients(c, {6, 8}, 400);
  }
}

// Each token's output depends only on the token, the routing and the weights: splitting the tokens and the
// experts over more ranks must not change it (aux losses are per rank, so they are left out here).
TEST(Layer, OutputDoesNotDependOnTheNumberOfRanks) {
  MoeConfig c2 = small_config(2);
  c2.router.aux_loss_coeff = 0;
  MoeConfig c1 = c2;
  c1.ep_size = 1;
  c1.max_tokens = 2 * c2.max_tokens;
  const ref::LayerWeights w2 = ref::LayerWeights::random(c2, 7);
  ref::LayerWeights w1 = ref::LayerWeights::random(c1, 7);
  // Same router and shared weights; rank 0 and 1's experts stacked into one rank.
  for (std::int64_t i = 0; i < w2.router.numel(); ++i) w1.router.set_f(i, w2.router.f(i));
  for (std::int64_t i = 0; i < w2.expert_bias.numel(); ++i) w1.expert_bias.set_f(i, w2.expert_bias.f(i));
  for (std::int64_t i = 0; i < w2.shared_w1.numel(); ++i) w1.shared_w1.set_f(i, w2.shared_w1.f(i));
  for (std::int64_t i = 0; i < w2.shared_w2.numel(); ++i) w1.shared_w2.set_f(i, w2.shared_w2.f(i));
  auto stack = [](const std::vector<HostTensor>& per_rank, const HostTensor& dst) {
    std::int64_t o = 0;
    for (const auto& t : per_rank)
      for (std::int64_t i = 0; i < t.numel(); ++i) dst.set_f(o++, t.f(i));
    ASSERT_EQ(o, dst.numel());
  };
  stack(w2.w1, w1.w1[0]);
  stack(w2.w2, w1.w2[0]);
  stack(w2.b1, w1.b1[0]);
  stack(w2.b2, w1.b2[0]);

  auto x2 = random_inputs({10, 7}, c2.hidden, 8);
  std::vector<HostTensor> x1 = random_inputs({17}, c2.hidden, 9);
  stack(x2, x1[0]);
  const ref::Layer l1(c1, std::move(w1)), l2(c2, w2);
  const auto f1 = l1.forward(views(x1)), f2 = l2.forward(views(x2));
  std::int64_t o = 0;
  for (const auto& out : f2.out)
    for (std::int64_t i = 0; i < out.numel(); ++i, ++o)
      ASSERT_NEAR(out.f(i), f1.out[0].f(o), 1e-12) << "element " << o;
}

// Each FP8 recipe through the reference layer (2 ranks): the same routing as bf16 (the router stays bf16), the
// experts' outputs and gradients within several percent of bf16 (e5m2 gradients: within 25%), and not equal to them.
TEST(Layer, Fp8RecipesStayNearBf16) {
  MoeConfig c = small_config(2);
  c.hidden = 128;
  c.ffn_hidden = 128;
  c.shared_expert_ffn = 0;
  const ref::LayerWeights w = ref::LayerWeights::random(c, 21);
  for (Recipe recipe : {Recipe::Fp8Blockwise, Recipe::Fp8Tensor, Recipe::Fp8TensorHybrid}) {
    SCOPED_TRACE(std::string(name_of(recipe)));
    ref::LayerOptions o8;
    o8.recipe = recipe;
    const ref::Layer bf(c, w), f8(c, w, o8);
    auto x = random_inputs({12, 5}, c.hidden, 22), g = random_inputs({12, 5}, c.hidden, 23);
    const auto xv = views(x), gv = views(g);
    const ref::LayerForward a = bf.forward(xv), b = f8.forward(xv);
    const ref::LayerGrads ga = bf.backward(xv, a, gv), gb = f8.backward(xv, b, gv);
    auto rel = [](const HostTensor& u, const HostTensor& v) {
      double num = 0, den = 0;
      for (std::int64_t i = 0; i < v.numel(); ++i) {
        num += (u.f(i) - v.f(i)) * (u.f(i) - v.f(i));
        den += v.f(i) * v.f(i);
      }
      return std::sqrt(num / den);
    };
    const double grad_bound = recipe == Recipe::Fp8TensorHybrid ? 0.25 : 0.12;
    for (int r = 0; r < 2; ++r) {
      for (std::int64_t i = 0; i < a.topk_idx[std::size_t(r)].numel(); ++i)
        ASSERT_EQ(a.topk_idx[std::size_t(r)].i(i), b.topk_idx[std::size_t(r)].i(i)) << "the router is bf16 in both";
      const double eo = rel(b.out[std::size_t(r)], a.out[std::size_t(r)]);
      const double ed = rel(gb.dx[std::size_t(r)], ga.dx[std::size_t(r)]);
      const double ew = rel(gb.dw1[std::size_t(r)], ga.dw1[std::size_t(r)]);
      EXPECT_LT(eo, 0.1) << "out, rank " << r;
      EXPECT_LT(ed, grad_bound) << "dx, rank " << r;
      EXPECT_LT(ew, grad_bound) << "dw1, rank " << r;
      EXPECT_GT(eo, 1e-4) << "out, rank " << r << ": no quantization?";
    }
  }
}

TEST(Layer, CapacityOverflowNamesRankAndRows) {
  MoeConfig c = small_config(2);
  c.capacity = Capacity::of_factor(0.25);
  ref::Layer layer(c, ref::LayerWeights::random(c, 11));
  auto x = random_inputs({12, 12}, c.hidden, 12);
  try {
    layer.forward(views(x));
    FAIL() << "an overflowing step was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::CapacityOverflow);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank "), std::string::npos) << msg;
    EXPECT_NE(msg.find("rows needed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("available"), std::string::npos) << msg;
  }
  // Without the check the step completes, reporting the drop in the plan.
  ref::Layer lenient(c, ref::LayerWeights::random(c, 11), ref::LayerOptions{.check_overflow = false});
  const auto f = lenient.forward(views(x));
  EXPECT_GT(f.plan.overflow[0] + f.plan.overflow[1], 0);
}

TEST(Layer, RejectsBadInputNamingTheArgument) {
  const MoeConfig c = small_config(2);
  ref::Layer layer(c, ref::LayerWeights::random(c, 13));
  auto wrong_h = random_inputs({4, 4}, c.hidden + 1, 14);
  EXPECT_THROW(layer.forward(views(wrong_h)), Error);
  auto one_rank = random_inputs({4}, c.hidden, 15);
  EXPECT_THROW(layer.forward(views(one_rank)), Error);
  auto too_many = random_inputs({c.max_tokens + 1, 1}, c.hidden, 16);
  EXPECT_THROW(layer.forward(views(too_many)), Error);
}

}  // namespace
}  // namespace moerail

namespace moerail {
namespace {

TEST(HostTensorCopy, OwnsItsStorage) {
  std::vector<HostTensor> copies;
  {
    HostTensor a(DType::F32, {3, 4});
    for (std::int64_t i = 0; i < a.numel(); ++i) a.set_f(i, double(i) + 0.5);
    copies.push_back(a);                          // copy
    copies.push_back(HostTensor(DType::I32, {2}));
    copies.back() = a;                            // copy assignment
    a.fill(-1.0);                                 // the copies must not see this, nor a's destruction
  }
  for (const HostTensor& c : copies) {
    ASSERT_EQ(c.view().size(0), 3);
    ASSERT_EQ(c.view().size(1), 4);
    EXPECT_EQ(c.dtype(), DType::F32);
    for (std::int64_t i = 0; i < c.numel(); ++i) EXPECT_EQ(c.f(i), double(i) + 0.5) << i;
  }
}

TEST(Layer, GivenLogitsRouteTheForward) {
  const MoeConfig cfg = small_config(2);
  ref::Layer layer(cfg, ref::LayerWeights::random(cfg, 7));
  const auto x = random_inputs({6, 4}, cfg.hidden, 8);
  const auto xv = views(x);
  const ref::LayerForward own = layer.forward(xv);
  // its own logits given back: the same forward
  const auto own_logits = views(own.logits);
  const ref::LayerForward same = layer.forward(xv, nullptr, own_logits);
  for (std::size_t r = 0; r < 2; ++r)
    for (std::int64_t i = 0; i < own.out[r].numel(); ++i) EXPECT_EQ(same.out[r].f(i), own.out[r].f(i));
  // other logits: other routing (every token of rank 0 first to the expert with the largest id)
  std::vector<HostTensor> other(own.logits);
  for (std::int64_t t = 0; t < 6; ++t)
    for (std::int64_t e = 0; e < cfg.num_experts; ++e)  // sigmoid scores 0.5 for the last, < 0.05 for the rest
      other[0].set_f(t * cfg.num_experts + e, 3.0 * double(e - (cfg.num_experts - 1)));
  const ref::LayerForward moved = layer.forward(xv, nullptr, views(other));
  for (std::int64_t t = 0; t < 6; ++t)
    EXPECT_EQ(moved.topk_idx[0].i(t * cfg.topk), cfg.num_experts - 1) << "token " << t;
  EXPECT_THROW(layer.forward(xv, nullptr, std::span<const TensorView>(own_logits.data(), 1)), Error);
}

}  // namespace
}  // namespace moerail
