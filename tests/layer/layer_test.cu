// The whole MoE layer (include/moerail/layer.h) on 1..N GPUs against the CPU reference layer (ref::Layer) over the
// same ranks. The program is its own launcher (tests/common/multigpu.h): one worker process per GPU.
//
// Every rank draws the weights and inputs of every rank from one seed (weights rounded to bf16 for both sides) and
// computes the whole reference. The GPU's gate GEMM (its bf16 logits) is checked against the reference's own
// x W_router^T, each logit within its bf16 rounding plus the fp32 accumulation; the reference is then given the
// GPUs' bf16 logits (gathered from all ranks), so that the routing compared against is the GPUs' own (a tie between
// two experts' scores may break either way after rounding); then: topk_idx exact, probs and losses to fp32
// rounding, out / dx / every weight and bias gradient within the bf16 GEMM bound of docs/design.md (||gpu - ref|| /
// ||ref|| < 1e-2), the expert gradients expert by expert (one error over all experts would hide a small expert's).
// Router and shared expert gradients are this rank's share; the reference sums them over ranks, so the test sums
// the gathered shares.
// A captured step replayed with new inputs must give the bits of an eager step on the same inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "common/loopback.h"
#include "common/multigpu.h"
#include "moerail/comm.h"
#include "moerail/layer.h"
#include "moerail/reference/host.h"
#include "moerail/reference/layer.h"

namespace moerail {
namespace {

using testing::DeviceTensor;
using ref::HostTensor;

std::unique_ptr<Communicator> g_comm;  // this process's rank (set up in main)
// The rank a thread runs as: g_comm, or in a loopback test (LayerLoopback) its in-process rank's Communicator.
thread_local Communicator* t_comm = nullptr;
Communicator& comm() { return t_comm ? *t_comm : *g_comm; }

// In-process ranks (LoopbackGroup) share one GPU: a host call that waits for the whole device (cudaFree, the
// layer's construction) waits for the other ranks' kernels too, and on the NVLink path those may be waiting for this
// rank's next op. Ranks meet here between such calls and the next collective op; separate processes need not.
void sync_ranks(cudaStream_t s) {
  if (comm().loopback()) comm().barrier(s);
}

void round_weights_to_bf16(const HostTensor& t) {
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set_f(i, double(round_to_bf16(float(t.f(i)))));
}

HostTensor to_bf16(const HostTensor& t, std::vector<std::int64_t> shape) {
  HostTensor b(DType::BF16, shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) b.set_f(i, t.f(i));
  return b;
}

HostTensor download(const DeviceTensor& d, DType dtype, std::vector<std::int64_t> shape) {
  HostTensor h(dtype, shape);
  d.download(h);
  return h;
}

// ||a - b|| / ||b|| over the first n elements.
double rel_error(const HostTensor& a, const HostTensor& b, std::int64_t n) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double d = a.f(i) - b.f(i);
    num += d * d;
    den += b.f(i) * b.f(i);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The worst of rel_error over the L experts of a [L, ...] gradient (an expert whose reference is 0 must be 0).
double worst_expert_error(const HostTensor& a, const HostTensor& b, std::int64_t L) {
  const std::int64_t n = a.numel() / L;
  double worst = 0;
  for (std::int64_t e = 0; e < L; ++e) {
    double num = 0, den = 0;
    for (std::int64_t i = e * n; i < (e + 1) * n; ++i) {
      const double d = a.f(i) - b.f(i);
      num += d * d;
      den += b.f(i) * b.f(i);
    }
    worst = std::max(worst, den > 0 ? std::sqrt(num / den) : std::sqrt(num));
  }
  return worst;
}

// Logits of the GPU ([T, E] bf16) that are not the reference's x W^T (bf16 inputs, exact products) within the bf16
// rounding of the result (2^-8 relative) plus 1e-5 of the sum of |terms| (fp32 accumulation in another order).
std::int64_t gate_mismatches(const HostTensor& gpu, const HostTensor& x, const HostTensor& router, std::int64_t T,
                             std::int64_t E, std::int64_t H) {
  std::int64_t bad = 0;
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e) {
      double sum = 0, mag = 0;
      for (std::int64_t h = 0; h < H; ++h) {
        const double term = x.f(t * H + h) * router.f(e * H + h);
        sum += term;
        mag += std::abs(term);
      }
      bad += !(std::abs(gpu.f(t * E + e) - sum) <= std::ldexp(std::abs(sum), -8) + 1e-5 * mag);
    }
  return bad;
}

bool same_bytes(const HostTensor& a, const HostTensor& b, std::int64_t n) {
  return std::memcmp(a.view().data(), b.view().data(), std::size_t(n) * dtype_size(a.dtype())) == 0;
}

// Gathers `bytes` from every rank (rank order) on `stream`.
std::vector<char> all_gather(const void* device_src, std::size_t bytes, cudaStream_t stream) {
  const int R = comm().size();
  DeviceTensor buf(DType::Bool, {std::int64_t(bytes * std::size_t(R))});
  EXPECT_EQ(cudaMemcpyAsync(static_cast<char*>(buf.data()) + std::size_t(comm().rank()) * bytes, device_src, bytes,
                            cudaMemcpyDeviceToDevice, stream),
            cudaSuccess);
  comm().all_gather_inplace(buf.data(), bytes, stream, "test all_gather");
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<char> host(bytes * std::size_t(R));
  EXPECT_EQ(cudaMemcpy(host.data(), buf.data(), host.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

struct Case {
  const char* name;
  MoeConfig cfg;
};

MoeConfig base_config(int R) {
  MoeConfig c;
  c.hidden = 256;
  c.ffn_hidden = 128;
  c.num_experts = 16;
  c.topk = 4;
  c.ep_size = R;
  c.align = 16;
  c.max_tokens = 64;
  c.dtype = DType::BF16;
  return c;
}

// The device copies of one rank's weights and gradients.
struct DeviceParams {
  DeviceTensor router, bias, w1, w2, b1, b2, sw1, sw2;
  DeviceTensor d_router, dw1, dw2, db1, db2, dsw1, dsw2;
  MoeLayerWeights weights;
  MoeLayerGrads grads;

  DeviceParams(const MoeConfig& cfg, const ref::LayerWeights& w, int me) {
    const std::int64_t H = cfg.hidden, E = cfg.num_experts, L = cfg.local_experts(), F = cfg.ffn_hidden,
                       F1 = cfg.fc1_out();
    auto up = [](DeviceTensor& d, const HostTensor& h, DType dt, std::vector<std::int64_t> shape) {
      d = DeviceTensor(dt, shape);
      d.upload(dt == DType::BF16 ? to_bf16(h, shape) : h);
    };
    up(router, w.router, DType::BF16, {E, H});
    weights.router = router.view();
    if (cfg.router.use_expert_bias) {
      HostTensor b(DType::F32, {E});
      for (std::int64_t e = 0; e < E; ++e) b.set_f(e, w.expert_bias.f(e));
      up(bias, b, DType::F32, {E});
      weights.expert_bias = bias.view();
    }
    up(w1, w.w1[std::size_t(me)], DType::BF16, {L, F1, H});
    up(w2, w.w2[std::size_t(me)], DType::BF16, {L, H, F});
    weights.experts.w1 = w1.view();
    weights.experts.w2 = w2.view();
    d_router = DeviceTensor(DType::BF16, {E, H});
    dw1 = DeviceTensor(DType::BF16, {L, F1, H});
    dw2 = DeviceTensor(DType::BF16, {L, H, F});
    grads.d_router = d_router.view();
    grads.experts.dw1 = dw1.view();
    grads.experts.dw2 = dw2.view();
    if (cfg.fc1_bias) {
      up(b1, w.b1[std::size_t(me)], DType::BF16, {L, F1});
      weights.experts.b1 = b1.view();
      db1 = DeviceTensor(DType::BF16, {L, F1});
      grads.experts.db1 = db1.view();
    }
    if (cfg.fc2_bias) {
      up(b2, w.b2[std::size_t(me)], DType::BF16, {L, H});
      weights.experts.b2 = b2.view();
      db2 = DeviceTensor(DType::BF16, {L, H});
      grads.experts.db2 = db2.view();
    }
    if (cfg.shared_expert_ffn > 0) {
      const std::int64_t Fs = cfg.shared_expert_ffn, F1s = is_glu(cfg.activation) ? 2 * Fs : Fs;
      up(sw1, w.shared_w1, DType::BF16, {F1s, H});
      up(sw2, w.shared_w2, DType::BF16, {H, Fs});
      weights.shared_w1 = sw1.view();
      weights.shared_w2 = sw2.view();
      dsw1 = DeviceTensor(DType::BF16, {F1s, H});
      dsw2 = DeviceTensor(DType::BF16, {H, Fs});
      grads.d_shared_w1 = dsw1.view();
      grads.d_shared_w2 = dsw2.view();
    }
  }
};

class Layer : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    MOERAIL_REQUIRE_GPU();
    if (!g_comm) GTEST_SKIP() << "no communicator";
    if (GetParam() == Transport::NvLink && !g_comm->nvlink_ok())
      GTEST_SKIP() << "NVLink path refused: " << g_comm->nvlink_refusal();
  }
  int R() const { return comm().size(); }
  int me() const { return comm().rank(); }
  Transport transport() const { return GetParam(); }

  // Runs one step per entry of `tokens` (tokens per rank, cycled over the ranks), eagerly, checks each against
  // the reference; the steps are then replayed from a captured graph and must match the eager bits.
  // stage_timing: the graphs are captured with enable_stage_timing(true) (event-record nodes), and every replay's
  // stage times must be readable and add up; without it, reading them after a replay is an error.
  // chunks > 1: the chunked step (MoeLayerOptions::chunks); every eager step is then also run by an unchunked layer
  // on the same inputs, whose forward and data gradients must be the same bits (weight gradients: the reference).
  // gemm_sms: MlpOptions::sms of the layer's expert GEMMs (the chunked layer's only).
  // recipe: MoeLayerOptions::recipe, the reference's too (which rounds the tensors the GPU keeps in bf16 between
  // its FP8 GEMMs, so both quantize the same values). What is left are e4m3 steps (6% of an element on average)
  // where the GPU's fp32 sums land on the other side of a rounding boundary than the reference's exact ones, on a
  // few percent of the elements: ~5e-3 over a tensor of many rows, but a tensor of a few rows does not average them
  // (F = 128 features per row here; a rank of 5 tokens measured 1.35e-2 in out, an expert of a few rows 1.03e-2 in
  // dW2). The FP8 recipe's bound is therefore 2e-2, bf16's 1e-2; an error of the recipe's own size (a scale from the
  // wrong block, row or expert: O(1); a wrong rounding mode: a step on half the elements, ~3%) exceeds either.
  void run(MoeConfig cfg, const std::vector<std::vector<std::int64_t>>& tokens, std::uint64_t seed,
           bool stage_timing = false, int chunks = 1, int gemm_sms = 0, Recipe recipe = Recipe::BF16,
           Fp8WeightGrads fp8_wgrad = Fp8WeightGrads::Fp8) {
    const double tol = recipe == Recipe::BF16 ? 1e-2 : 2e-2;
    // The hybrid recipe's gradients are e5m2, whose steps are twice e4m3's (2 mantissa bits against 3), and only they:
    // what the backward computes from them (dx, the router's gradient, the weight gradients) measured 1.3-1.4x
    // fp8-tensor's distances on the same steps (dx 1.15e-2 against 9.1e-3, the worst expert's dW 4.2e-2 against
    // 3.1e-2), so its bounds are fp8-tensor's times 1.5.
    constexpr double kHybrid = 1.5;
    const double grad_tol = recipe == Recipe::Fp8TensorHybrid ? kHybrid * tol : tol;
    // bf16 weight gradients have no e4m3 steps of their own (their distance measured ~2e-3, the FP8 ones' from them
    // ~3.7e-2): the bf16 bound holds for them, and a layer that ran the FP8 ones instead fails it.
    // Per-tensor recipe: an expert's act or d_h1 has one scale from its amax, so where the GPU's bf16 value of that
    // one largest element is an ulp from the reference's, every code of the expert's tensor moves with a scale 2^-8
    // apart (a few percent of them by one e4m3 step): 2-3% in the weight gradients of experts of a few rows
    // (3.06e-2 measured on a rank of 17 tokens). The kernels themselves are held to 1e-2 on their own operands by
    // tests/experts/fp8_mlp_test.cu; out and dx keep the 2e-2 bound (dx: times kHybrid under the hybrid recipe).
    const double dw_tol = recipe != Recipe::BF16 && fp8_wgrad == Fp8WeightGrads::BF16 ? 1e-2
                          : recipe == Recipe::Fp8Tensor                              ? 5e-2
                          : recipe == Recipe::Fp8TensorHybrid                        ? kHybrid * 5e-2
                                                                                     : tol;
    cfg.ep_size = R();
    const std::int64_t T_max = cfg.max_tokens, H = cfg.hidden, E = cfg.num_experts, K = cfg.topk,
                       L = cfg.local_experts();
    ref::LayerWeights w = ref::LayerWeights::random(cfg, seed);
    for (HostTensor* t : {&w.router, &w.shared_w1, &w.shared_w2})
      if (t->numel() > 0) round_weights_to_bf16(*t);
    for (auto* list : {&w.w1, &w.w2, &w.b1, &w.b2})
      for (HostTensor& t : *list) round_weights_to_bf16(t);
    ref::LayerOptions ref_opts;
    ref_opts.recipe = recipe;
    ref_opts.fp8_weight_grads = fp8_wgrad;
    ref::Layer reference(cfg, w, ref_opts);
    DeviceParams params(cfg, w, me());

    MoeLayerOptions opts;
    opts.dispatch.transport = transport();
    if (t_comm) opts.dispatch.timeout_s = 20;  // in-process ranks: a stuck rank fails the test sooner
    opts.chunks = chunks;
    opts.mlp.sms = gemm_sms;
    opts.recipe = recipe;
    opts.fp8_weight_grads = fp8_wgrad;
    MoeLayer layer(cfg, comm(), opts);
    if (recipe != Recipe::BF16) ASSERT_NO_THROW(layer.refresh_fp8_weights(params.weights.experts, nullptr));
    std::unique_ptr<MoeLayer> unchunked;
    if (chunks > 1) {
      MoeLayerOptions plain = opts;
      plain.chunks = 1;
      plain.mlp.sms = 0;
      unchunked = std::make_unique<MoeLayer>(cfg, comm(), plain);
    }
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    DeviceTensor x(DType::BF16, {T_max, H}), num(DType::I32, {1}), out(DType::BF16, {T_max, H}),
        d_out(DType::BF16, {T_max, H}), dx(DType::BF16, {T_max, H});
    sync_ranks(s);  // every rank's layer constructed
    const MoeForwardArgs fa{x.view(), num.view(), out.view(), params.weights};
    MoeBackwardArgs ba;
    ba.d_out = d_out.view();
    ba.dx = dx.view();
    ba.d_aux_loss = 1.0f;
    ba.d_z_loss = 1.0f;
    ba.grads = params.grads;

    struct Outputs {
      HostTensor out, dx, d_router, dw1, dw2, db1, db2;
    };
    auto outputs = [&]() {
      Outputs o{download(out, DType::BF16, {T_max, H}), download(dx, DType::BF16, {T_max, H}),
                download(params.d_router, DType::BF16, {E, H}),
                download(params.dw1, DType::BF16, {L, cfg.fc1_out(), H}),
                download(params.dw2, DType::BF16, {L, H, cfg.ffn_hidden}), HostTensor(), HostTensor()};
      if (cfg.fc1_bias) o.db1 = download(params.db1, DType::BF16, {L, cfg.fc1_out()});
      if (cfg.fc2_bias) o.db2 = download(params.db2, DType::BF16, {L, H});
      return o;
    };

    std::vector<Outputs> eager;
    std::vector<std::vector<HostTensor>> inputs;  // per step: this rank's x, d_out (bf16, [T_max, H])
    for (std::size_t step = 0; step < tokens.size(); ++step) {
      std::vector<std::int64_t> T(static_cast<std::size_t>(R()));
      for (int r = 0; r < R(); ++r) T[std::size_t(r)] = tokens[step][std::size_t(r) % tokens[step].size()];
      ref::Rng rng(seed * 100 + step);
      std::vector<HostTensor> xs, douts;
      for (int r = 0; r < R(); ++r) {
        HostTensor xr(DType::BF16, {T_max, H}), dr(DType::BF16, {T_max, H});
        ref::fill_normal(xr, rng, 1.0);
        ref::fill_normal(dr, rng, 1.0);
        xs.push_back(std::move(xr));
        douts.push_back(std::move(dr));
      }
      const std::int64_t Tm = T[std::size_t(me())];
      x.upload(xs[std::size_t(me())]);
      d_out.upload(douts[std::size_t(me())]);
      num.from_vector(std::vector<std::int32_t>{std::int32_t(Tm)});
      out.poison();
      dx.poison();
      ASSERT_NO_THROW(layer.forward(fa, s));
      ASSERT_NO_THROW(layer.backward(ba, s));
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      ASSERT_NO_THROW(layer.check(s));

      // the reference, routed by the GPUs' logits
      const std::size_t logit_bytes = std::size_t(T_max * E) * 2;
      const std::vector<char> all_logits = all_gather(layer.logits().data(), logit_bytes, s);
      std::vector<HostTensor> logits;
      std::vector<TensorView> x_views, logit_views, dout_views;
      for (int r = 0; r < R(); ++r) {
        const std::int64_t Tr = T[std::size_t(r)];
        HostTensor lg(DType::BF16, {Tr, E});
        std::memcpy(lg.view().data(), all_logits.data() + std::size_t(r) * logit_bytes, std::size_t(Tr * E) * 2);
        logits.push_back(std::move(lg));
      }
      EXPECT_EQ(gate_mismatches(logits[std::size_t(me())], xs[std::size_t(me())], w.router, Tm, E, H), 0)
          << "gate logits against the reference's x W_router^T, step " << step << " rank " << me();
      for (int r = 0; r < R(); ++r) {
        const std::int64_t Tr = T[std::size_t(r)];
        x_views.emplace_back(xs[std::size_t(r)].view().data(), DType::BF16, std::initializer_list<std::int64_t>{Tr, H});
        dout_views.emplace_back(douts[std::size_t(r)].view().data(), DType::BF16,
                                std::initializer_list<std::int64_t>{Tr, H});
        logit_views.push_back(logits[std::size_t(r)].view());
      }
      const ref::LayerForward rf = reference.forward(x_views, nullptr, logit_views);
      const ref::LayerGrads rg = reference.backward(x_views, rf, dout_views);
      const std::string where = "step " + std::to_string(step) + " rank " + std::to_string(me()) + " T " +
                                std::to_string(Tm);

      // routing and losses
      HostTensor idx = download_view(layer.topk_idx(), DType::I32, {T_max, K});
      HostTensor probs = download_view(layer.topk_probs(), DType::F32, {T_max, K});
      std::int64_t idx_mismatch = 0;
      double prob_err = 0;
      for (std::int64_t i = 0; i < Tm * K; ++i) {
        idx_mismatch += idx.i(i) != rf.topk_idx[std::size_t(me())].i(i);
        prob_err = std::max(prob_err, std::abs(probs.f(i) - rf.topk_probs[std::size_t(me())].f(i)));
      }
      EXPECT_EQ(idx_mismatch, 0) << where;
      EXPECT_LT(prob_err, 1e-5) << where;
      HostTensor losses = download_view(layer.losses(), DType::F32, {2});
      if (cfg.router.aux_loss_coeff > 0 && Tm > 0)
        EXPECT_NEAR(losses.f(0), rf.aux_loss[std::size_t(me())], 1e-5 + 1e-4 * std::abs(rf.aux_loss[std::size_t(me())]))
            << where;
      if (cfg.router.z_loss_coeff > 0 && Tm > 0)
        EXPECT_NEAR(losses.f(1), rf.z_loss[std::size_t(me())], 1e-5 + 1e-4 * std::abs(rf.z_loss[std::size_t(me())]))
            << where;

      // outputs and gradients of this rank
      Outputs o = outputs();
      EXPECT_LT(rel_error(o.out, rf.out[std::size_t(me())], Tm * H), tol) << "out, " << where;
      EXPECT_LT(rel_error(o.dx, rg.dx[std::size_t(me())], Tm * H), grad_tol) << "dx, " << where;
      EXPECT_LT(worst_expert_error(o.dw1, rg.dw1[std::size_t(me())], L), dw_tol) << "dw1 (worst expert), " << where;
      EXPECT_LT(worst_expert_error(o.dw2, rg.dw2[std::size_t(me())], L), dw_tol) << "dw2 (worst expert), " << where;
      if (recipe != Recipe::BF16 && me() == 0)
        std::printf("  %s (%s wgrad), %s: out %.2e dx %.2e dw1 %.2e dw2 %.2e (relative to the FP8 reference)\n",
                    std::string(name_of(recipe)).c_str(), std::string(name_of(fp8_wgrad)).c_str(), where.c_str(),
                    rel_error(o.out, rf.out[std::size_t(me())], Tm * H),
                    rel_error(o.dx, rg.dx[std::size_t(me())], Tm * H),
                    worst_expert_error(o.dw1, rg.dw1[std::size_t(me())], L),
                    worst_expert_error(o.dw2, rg.dw2[std::size_t(me())], L));
      if (cfg.fc1_bias)
        EXPECT_LT(worst_expert_error(o.db1, rg.db1[std::size_t(me())], L), 1e-2) << "db1 (worst expert), " << where;
      if (cfg.fc2_bias)
        EXPECT_LT(worst_expert_error(o.db2, rg.db2[std::size_t(me())], L), 1e-2) << "db2 (worst expert), " << where;
      // replicated weights: the sum of every rank's share
      HostTensor d_router_sum = sum_over_ranks(params.d_router, E * H, s);
      EXPECT_LT(rel_error(d_router_sum, rg.d_router, E * H), grad_tol) << "d_router, " << where;
      if (cfg.shared_expert_ffn > 0) {
        HostTensor s1 = sum_over_ranks(params.dsw1, rg.d_shared_w1.numel(), s);
        EXPECT_LT(rel_error(s1, rg.d_shared_w1, s1.numel()), 1e-2) << "d_shared_w1, " << where;
        HostTensor s2 = sum_over_ranks(params.dsw2, rg.d_shared_w2.numel(), s);
        EXPECT_LT(rel_error(s2, rg.d_shared_w2, s2.numel()), 1e-2) << "d_shared_w2, " << where;
      }
      if (unchunked) {
        const HostTensor rows = download_view(layer.expert_rows(), DType::I32, {L});
        out.poison();
        dx.poison();
        params.d_router.poison();
        ASSERT_NO_THROW(unchunked->forward(fa, s));
        ASSERT_NO_THROW(unchunked->backward(ba, s));
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        const Outputs p = outputs();
        const HostTensor plain_rows = download_view(unchunked->expert_rows(), DType::I32, {L});
        std::int64_t routed = 0, plain_routed = 0;
        for (std::int64_t e = 0; e < L; ++e) {
          routed += rows.i(e);
          plain_routed += plain_rows.i(e);
        }
        // Each chunk pads its segments on its own: at most chunks (A - 1) more pad rows per expert.
        EXPECT_GE(routed, plain_routed) << where;
        EXPECT_LE(routed, plain_routed + L * chunks * (cfg.align - 1)) << where;
        EXPECT_TRUE(same_bytes(o.out, p.out, Tm * H)) << "out (chunked vs not), " << where;
        EXPECT_TRUE(same_bytes(o.dx, p.dx, Tm * H)) << "dx (chunked vs not), " << where;
        EXPECT_TRUE(same_bytes(o.d_router, p.d_router, E * H)) << "d_router (chunked vs not), " << where;
        EXPECT_LT(worst_expert_error(o.dw1, p.dw1, L), 1e-2) << "dw1 (chunked vs not, worst expert), " << where;
        EXPECT_LT(worst_expert_error(o.dw2, p.dw2, L), 1e-2) << "dw2 (chunked vs not, worst expert), " << where;
      }
      eager.push_back(std::move(o));
      inputs.push_back({std::move(xs[std::size_t(me())]), std::move(douts[std::size_t(me())])});
      inputs.back().push_back(HostTensor(DType::I32, {1}));
      inputs.back().back().set_i(0, Tm);
      sync_ranks(s);  // the step's buffers freed (all_gather) on every rank
    }

    // the same steps from the captured graphs: the eager bits (not for in-process ranks on the host API, whose
    // collectives cannot be captured)
    if (comm().loopback() && transport() == Transport::HostApi) {
      cudaStreamDestroy(s);
      return;
    }
    layer.enable_stage_timing(stage_timing);
    ASSERT_NO_THROW(layer.capture(fa, ba, s));
    sync_ranks(s);
    for (std::size_t step = 0; step < inputs.size(); ++step) {
      x.upload(inputs[step][0]);
      d_out.upload(inputs[step][1]);
      num.upload(inputs[step][2]);
      out.poison();
      dx.poison();
      params.d_router.poison();
      layer.replay_forward(s);
      layer.replay_backward(s);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      ASSERT_NO_THROW(layer.check(s));
      const std::int64_t Tm = inputs[step][2].i(0);
      const Outputs o = outputs();
      const std::string where = "replay of step " + std::to_string(step) + " rank " + std::to_string(me());
      EXPECT_TRUE(same_bytes(o.out, eager[step].out, Tm * H)) << "out, " << where;
      EXPECT_TRUE(same_bytes(o.dx, eager[step].dx, Tm * H)) << "dx, " << where;
      EXPECT_TRUE(same_bytes(o.d_router, eager[step].d_router, E * H)) << "d_router, " << where;
      EXPECT_TRUE(same_bytes(o.dw1, eager[step].dw1, o.dw1.numel())) << "dw1, " << where;
      EXPECT_TRUE(same_bytes(o.dw2, eager[step].dw2, o.dw2.numel())) << "dw2, " << where;
      if (!stage_timing) {
        EXPECT_THROW(layer.forward_times(s), Error) << where;
        continue;
      }
      for (const MoeLayer::StageTimes& t : {layer.forward_times(s), layer.backward_times(s)}) {
        EXPECT_GT(t.total, 0.0) << where;
        for (double v : {t.router, t.dispatch, t.experts, t.combine}) EXPECT_GE(v, 0.0) << where;
        EXPECT_GE(t.wgrad, 0.0) << where;
        EXPECT_LE(t.router + t.dispatch + t.experts + t.combine + t.wgrad, t.total * 1.001 + 1e-3) << where;
      }
    }
    cudaStreamDestroy(s);
  }

  static HostTensor download_view(const TensorView& v, DType dtype, std::vector<std::int64_t> shape) {
    HostTensor h(dtype, shape);
    EXPECT_EQ(cudaMemcpy(h.view().data(), v.data(), h.view().nbytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

  // The element-wise sum over ranks (in double) of a bf16 device tensor of n elements.
  HostTensor sum_over_ranks(const DeviceTensor& d, std::int64_t n, cudaStream_t s) const {
    const std::vector<char> all = all_gather(d.data(), std::size_t(n) * 2, s);
    HostTensor sum(DType::F64, {n});
    for (int r = 0; r < R(); ++r) {
      const TensorView v(const_cast<char*>(all.data()) + std::size_t(r) * std::size_t(n) * 2, DType::BF16, {n});
      for (std::int64_t i = 0; i < n; ++i) sum.set_f(i, sum.f(i) + ref::load_float(v, i));
    }
    return sum;
  }
};

TEST_P(Layer, SoftmaxAuxLossSharedExpertUnevenTokens) {
  MoeConfig cfg = base_config(1);
  cfg.router.aux_loss_coeff = 1e-2;
  cfg.router.z_loss_coeff = 1e-3;
  cfg.shared_expert_ffn = 64;
  run(cfg, {{64, 37}, {0, 64}, {17, 0}, {64, 64}}, 11);
}

// The FP8 recipe (MoeLayerOptions::recipe): x quantized inside the dispatch, the experts' GEMMs in FP8, against the
// reference layer with the same recipe; both prob modes, a shared expert (bf16), uneven and empty ranks, the
// captured step's replays, and the weight gradients in bf16.
TEST_P(Layer, Fp8BlockwiseRecipe) {
  MoeConfig cfg = base_config(1);
  cfg.ffn_hidden = 256;
  cfg.router.aux_loss_coeff = 1e-2;
  cfg.shared_expert_ffn = 64;
  run(cfg, {{64, 37}, {0, 64}, {17, 0}}, 21, false, 1, 0, Recipe::Fp8Blockwise);
  cfg = base_config(1);
  cfg.ffn_hidden = 128;
  cfg.prob_mode = ProbMode::InCombine;
  cfg.router.score = ScoreFunction::Sigmoid;
  run(cfg, {{64, 64}, {5, 60}}, 22, false, 1, 0, Recipe::Fp8Blockwise);
  // the weight gradients by the bf16 GEMMs (MoeLayerOptions::fp8_weight_grads)
  run(cfg, {{64, 64}, {5, 60}}, 23, false, 1, 0, Recipe::Fp8Blockwise, Fp8WeightGrads::BF16);
}

// The per-tensor recipes (Recipe::Fp8Tensor, and Fp8TensorHybrid with e5m2 gradients): bf16 rows dispatched, then
// quantized with one scale per expert; the experts' GEMMs per-tensor scaled, against the reference layer with the
// same recipe; both prob modes, a shared expert, uneven and empty ranks, the captured step's replays.
TEST_P(Layer, Fp8TensorRecipe) {
  for (const Recipe recipe : {Recipe::Fp8Tensor, Recipe::Fp8TensorHybrid}) {
    SCOPED_TRACE(std::string(name_of(recipe)));
    MoeConfig cfg = base_config(1);
    cfg.ffn_hidden = 256;
    cfg.router.aux_loss_coeff = 1e-2;
    cfg.shared_expert_ffn = 64;
    run(cfg, {{64, 37}, {0, 64}, {17, 0}}, 31, false, 1, 0, recipe);
    cfg = base_config(1);
    cfg.ffn_hidden = 128;
    cfg.prob_mode = ProbMode::InCombine;
    cfg.router.score = ScoreFunction::Sigmoid;
    run(cfg, {{64, 64}, {5, 60}}, 32, false, 1, 0, recipe);
    cfg.ep_size = R();
    MoeLayerOptions opts;
    opts.dispatch.transport = transport();
    opts.recipe = recipe;
    opts.fp8_weight_grads = Fp8WeightGrads::BF16;
    try {
      MoeLayer layer(cfg, comm(), opts);
      ADD_FAILURE() << name_of(recipe) << " with bf16 weight gradients was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("options.fp8_weight_grads = bf16"), std::string::npos) << e.what();
    }
  }
}

TEST_P(Layer, SigmoidGroupLimitedBiasInCombineWithExpertBiases) {
  MoeConfig cfg = base_config(1);
  cfg.router.score = ScoreFunction::Sigmoid;
  cfg.router.num_groups = 4;
  cfg.router.group_topk = 2;
  cfg.router.use_expert_bias = true;
  cfg.router.scaling_factor = 2.5;
  cfg.prob_mode = ProbMode::InCombine;
  cfg.fc1_bias = cfg.fc2_bias = true;
  cfg.align = 128;
  run(cfg, {{48, 64}, {5, 1}, {64, 0}}, 22, /*stage_timing=*/true);
}

// The chunked step: 4 chunks of 16 tokens (full, partial and empty chunks across the steps), shared expert and
// router losses; then 2 chunks of 30 tokens in-combine with biases and stage timing, the GEMMs on 32 SMs (top-3:
// a chunk's capacity is not a multiple of 4 rows, so the regions are spaced wider than the capacity).
TEST_P(Layer, ChunkedStepMatchesTheUnchunkedOne) {
  MoeConfig cfg = base_config(1);
  cfg.router.aux_loss_coeff = 1e-2;
  cfg.router.z_loss_coeff = 1e-3;
  cfg.shared_expert_ffn = 64;
  run(cfg, {{64, 37}, {0, 64}, {17, 0}, {5, 64}}, 33, /*stage_timing=*/false, /*chunks=*/4);
  cfg.shared_expert_ffn = 0;
  cfg.prob_mode = ProbMode::InCombine;
  cfg.fc1_bias = cfg.fc2_bias = true;
  cfg.max_tokens = 60;
  cfg.topk = 3;
  run(cfg, {{48, 60}, {33, 1}}, 44, /*stage_timing=*/true, /*chunks=*/2, /*gemm_sms=*/32);

  // Chunk counts that cannot work are named before anything is allocated.
  cfg.ep_size = R();
  for (const auto& [chunks, needle] : {std::pair<int, const char*>{7, "options.chunks = 7 does not divide"},
                                       std::pair<int, const char*>{0, "options.chunks = 0 but 1 to"},
                                       std::pair<int, const char*>{17, "options.chunks = 17 but 1 to"}}) {
    MoeLayerOptions opts;
    opts.dispatch.transport = transport();
    if (t_comm) opts.dispatch.timeout_s = 20;  // in-process ranks: a stuck rank fails the test sooner
    opts.chunks = chunks;
    try {
      MoeLayer layer(cfg, comm(), opts);
      ADD_FAILURE() << "chunks = " << chunks << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
}

// Four microbatches in flight, each with its own MoeSaved (pipeline schedules: several forwards before the first
// backward): forwards 0..3, then the backwards in reverse and in shuffled order, eagerly and as one captured graph
// replayed with new inputs, give every microbatch the bits it gets alone (one forward + backward at a time). Shared
// expert, router losses, and the chunked step too.
TEST_P(Layer, MicrobatchesInFlightMatchOneAtATime) {
  constexpr int kMicro = 4;
  for (const int chunks : {1, 2}) {
    SCOPED_TRACE("chunks " + std::to_string(chunks));
    MoeConfig cfg = base_config(R());
    cfg.router.aux_loss_coeff = 1e-2;
    cfg.router.z_loss_coeff = 1e-3;
    cfg.shared_expert_ffn = 64;
    if (chunks > 1) cfg.prob_mode = ProbMode::InCombine;  // y kept in the MoeSaved
    const std::int64_t T_max = cfg.max_tokens, H = cfg.hidden, E = cfg.num_experts, L = cfg.local_experts();
    ref::LayerWeights w = ref::LayerWeights::random(cfg, 77);
    DeviceParams params(cfg, w, me());
    MoeLayerOptions opts;
    opts.dispatch.transport = transport();
    if (t_comm) opts.dispatch.timeout_s = 20;  // in-process ranks: a stuck rank fails the test sooner
    opts.chunks = chunks;
    opts.check_eager = false;  // no host read inside the captured graph
    MoeLayer layer(cfg, comm(), opts);
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    struct Micro {
      DeviceTensor x, num, out, d_out, dx, saved_memory;
      MoeSaved saved;
    };
    std::vector<Micro> mb(kMicro);
    for (Micro& m : mb) {
      m.x = DeviceTensor(DType::BF16, {T_max, H});
      m.num = DeviceTensor(DType::I32, {1});
      m.out = DeviceTensor(DType::BF16, {T_max, H});
      m.d_out = DeviceTensor(DType::BF16, {T_max, H});
      m.dx = DeviceTensor(DType::BF16, {T_max, H});
      m.saved_memory = DeviceTensor(DType::Bool, {std::int64_t(layer.saved_bytes())});
      m.saved = layer.make_saved(m.saved_memory.view());
    }
    auto fwd_args = [&](Micro& m) { return MoeForwardArgs{m.x.view(), m.num.view(), m.out.view(), params.weights}; };
    auto bwd_args = [&](Micro& m) {
      MoeBackwardArgs b;
      b.d_out = m.d_out.view();
      b.dx = m.dx.view();
      b.grads = params.grads;
      return b;
    };
    auto upload = [&](int round) {
      for (int i = 0; i < kMicro; ++i) {
        ref::Rng rng(std::uint64_t(9000 + 100 * round + 10 * i + me()));
        HostTensor xr(DType::BF16, {T_max, H}), dr(DType::BF16, {T_max, H});
        ref::fill_normal(xr, rng, 1.0);
        ref::fill_normal(dr, rng, 1.0);
        Micro& m = mb[std::size_t(i)];
        m.x.upload(xr);
        m.d_out.upload(dr);
        m.num.from_vector(std::vector<std::int32_t>{std::int32_t((13 * i + 7 * round + 11 * me()) % (T_max + 1))});
        m.out.poison();
        m.dx.poison();
      }
    };
    // What each microbatch's backward wrote: its out and dx, and the weight gradients (written by every backward).
    struct Result {
      HostTensor out, dx, d_router, dw1, dw2, dsw1;
    };
    auto result = [&](const Micro& m) {
      return Result{download(m.out, DType::BF16, {T_max, H}), download(m.dx, DType::BF16, {T_max, H}),
                    download(params.d_router, DType::BF16, {E, H}),
                    download(params.dw1, DType::BF16, {L, cfg.fc1_out(), H}),
                    download(params.dw2, DType::BF16, {L, H, cfg.ffn_hidden}),
                    download(params.dsw1, DType::BF16, {shared_expert_config(cfg).fc1_out(), H})};
    };
    auto same = [&](const Result& a, const Result& b, const std::string& where) {
      EXPECT_TRUE(same_bytes(a.out, b.out, T_max * H)) << "out, " << where;
      EXPECT_TRUE(same_bytes(a.dx, b.dx, T_max * H)) << "dx, " << where;
      EXPECT_TRUE(same_bytes(a.d_router, b.d_router, E * H)) << "d_router, " << where;
      EXPECT_TRUE(same_bytes(a.dw1, b.dw1, a.dw1.numel())) << "dw1, " << where;
      EXPECT_TRUE(same_bytes(a.dw2, b.dw2, a.dw2.numel())) << "dw2, " << where;
      EXPECT_TRUE(same_bytes(a.dsw1, b.dsw1, a.dsw1.numel())) << "d_shared_w1, " << where;
    };
    auto alone = [&](int round) {
      upload(round);
      std::vector<Result> r;
      for (Micro& m : mb) {
        layer.forward(fwd_args(m), s);
        layer.backward(bwd_args(m), s);
        EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        EXPECT_NO_THROW(layer.check(s));
        r.push_back(result(m));
      }
      return r;
    };
    for (const auto& order : {std::vector<int>{3, 2, 1, 0}, std::vector<int>{1, 3, 0, 2}}) {
      const std::vector<Result> want = alone(order[0]);
      upload(order[0]);
      for (Micro& m : mb) layer.forward(fwd_args(m), m.saved, s);
      for (int i : order) {
        layer.backward(bwd_args(mb[std::size_t(i)]), mb[std::size_t(i)].saved, s);
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        same(result(mb[std::size_t(i)]), want[std::size_t(i)],
             "microbatch " + std::to_string(i) + ", backward order " + ::testing::PrintToString(order));
      }
      EXPECT_NO_THROW(layer.check(s));
    }
    // one graph of the four forwards and the shuffled backwards; the weight gradients are the last backward's
    const std::vector<int> order{2, 0, 3, 1};
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    for (Micro& m : mb) layer.forward(fwd_args(m), m.saved, s);
    for (int i : order) layer.backward(bwd_args(mb[std::size_t(i)]), mb[std::size_t(i)].saved, s);
    ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
    for (int round = 10; round < 12; ++round) {
      const std::vector<Result> want = alone(round);
      upload(round);
      ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      EXPECT_NO_THROW(layer.check(s));
      for (int i = 0; i < kMicro; ++i) {
        const Result got = result(mb[std::size_t(i)]);
        const std::string where = "graph replay, microbatch " + std::to_string(i);
        EXPECT_TRUE(same_bytes(got.out, want[std::size_t(i)].out, T_max * H)) << "out, " << where;
        EXPECT_TRUE(same_bytes(got.dx, want[std::size_t(i)].dx, T_max * H)) << "dx, " << where;
      }
      same(result(mb[std::size_t(order.back())]), want[std::size_t(order.back())], "graph replay, last backward");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    // a backward with a MoeSaved no forward filled is refused
    DeviceTensor fresh_memory(DType::Bool, {std::int64_t(layer.saved_bytes())});
    const MoeSaved fresh = layer.make_saved(fresh_memory.view());
    try {
      layer.backward(bwd_args(mb[0]), fresh, s);
      ADD_FAILURE() << "a backward over an empty MoeSaved was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("saved holds no forward"), std::string::npos) << e.what();
    }
    cudaStreamDestroy(s);
  }
}

// Capacity::PerExpert through the whole layer: an expert bias sends every token to experts 0..K-1, whose segments
// (16 rows at factor 0.25) overflow. check() reports the drop with its counts; the forward equals the reference
// layer's with the same experts' first rows kept (the reference plan drops the same slots).
TEST_P(Layer, PerExpertCapacityOverflowThroughTheLayer) {
  MoeConfig cfg = base_config(R());
  cfg.router.score = ScoreFunction::Sigmoid;
  cfg.router.use_expert_bias = true;
  cfg.capacity = Capacity::per_expert(0.25);
  const std::int64_t T_max = cfg.max_tokens, H = cfg.hidden, E = cfg.num_experts;
  ref::LayerWeights w = ref::LayerWeights::random(cfg, 55);
  for (HostTensor* t : {&w.router}) round_weights_to_bf16(*t);
  for (auto* list : {&w.w1, &w.w2}) for (HostTensor& t : *list) round_weights_to_bf16(t);
  for (std::int64_t e = 0; e < E; ++e) w.expert_bias.set_f(e, e < cfg.topk ? 100.0 : 0.0);
  DeviceParams params(cfg, w, me());
  MoeLayerOptions opts;
  opts.dispatch.transport = transport();
  opts.check_eager = false;
  MoeLayer layer(cfg, comm(), opts);
  ASSERT_EQ(layer.capacity(), cfg.local_experts() * cfg.expert_rows());
  ref::LayerOptions ro;
  ro.check_overflow = false;
  ro.peer_rows = layer.peer_rows();  // the host-API transport also bounds the tokens a source sends each peer
  ref::Layer reference(cfg, w, ro);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  DeviceTensor x(DType::BF16, {T_max, H}), num(DType::I32, {1}), out(DType::BF16, {T_max, H});
  std::vector<HostTensor> xs;
  ref::Rng rng(56);
  for (int r = 0; r < R(); ++r) {
    xs.emplace_back(DType::BF16, std::vector<std::int64_t>{T_max, H});
    ref::fill_normal(xs.back(), rng, 1.0);
  }
  x.upload(xs[std::size_t(me())]);
  num.from_vector(std::vector<std::int32_t>{std::int32_t(T_max)});
  ASSERT_NO_THROW(layer.forward({x.view(), num.view(), out.view(), params.weights}, s));
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const std::size_t logit_bytes = std::size_t(T_max * E) * 2;
  const std::vector<char> all_logits = all_gather(layer.logits().data(), logit_bytes, s);
  std::vector<HostTensor> logits;
  std::vector<TensorView> x_views, logit_views;
  for (int r = 0; r < R(); ++r) {
    logits.emplace_back(DType::BF16, std::vector<std::int64_t>{T_max, E});
    std::memcpy(logits.back().view().data(), all_logits.data() + std::size_t(r) * logit_bytes, logit_bytes);
    x_views.push_back(xs[std::size_t(r)].view());
  }
  for (const HostTensor& l : logits) logit_views.push_back(l.view());
  const ref::LayerForward rf = reference.forward(x_views, nullptr, logit_views);
  const std::int64_t lost = rf.plan.overflow[std::size_t(me())], peer_lost = rf.plan.peer_dropped[std::size_t(me())];
  if (peer_lost > 0) {
    try {
      layer.check(s);
      ADD_FAILURE() << "rank " << me() << " did not send " << peer_lost << " slots but check() passed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::CapacityOverflow);
      EXPECT_NE(std::string(e.what()).find(std::to_string(peer_lost) + " routed slots of this rank's tokens were not "
                                           "sent"), std::string::npos) << e.what();
    }
  } else if (lost > 0) {
    try {
      layer.check(s);
      ADD_FAILURE() << "rank " << me() << " dropped " << lost << " rows but check() passed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::CapacityOverflow);
      const std::string msg = e.what();
      EXPECT_NE(msg.find(std::to_string(lost) + " routed rows did not fit: the fullest expert needed"),
                std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(cfg.expert_rows()) + " per expert available"), std::string::npos) << msg;
    }
  } else {
    EXPECT_NO_THROW(layer.check(s));
  }
  EXPECT_GT(rf.plan.overflow[0], 0) << "the bias must overflow rank 0's experts";
  const HostTensor o = download(out, DType::BF16, {T_max, H});
  EXPECT_LT(rel_error(o, rf.out[std::size_t(me())], T_max * H), 1e-2) << "out under per-expert drops";
  cudaStreamDestroy(s);
}

// The layer over 2 and 4 in-process ranks (LoopbackGroup) on this GPU, on the host API: each rank a thread running
// Layer::run as that rank (without the graph replays: the group's collectives are not capturable). Not the NVLink
// path: there the ranks' first dispatches on one GPU wait for each other until they time out, with 2 ranks as with 4
// (their data kernels are not all resident at once beside the layer's other kernels; the cause is not found yet),
// while the Dispatcher alone passes over in-process ranks (EpLoopback) and the layer over 2 and 4 GPUs.
class LayerLoopback : public Layer {
 protected:
  void SetUp() override { MOERAIL_REQUIRE_GPU(); }
  void run_ranks(const std::function<void()>& body) {
    for (int R : {2, 4}) {  // base_config's 16 experts
      SCOPED_TRACE(std::to_string(R) + " in-process ranks");
      testing::run_ranks(R, g_comm ? g_comm->device() : 0, [&](Communicator& c) {
        t_comm = &c;
        body();
        t_comm = nullptr;
      });
    }
  }
};

TEST_P(LayerLoopback, Bf16StepsUnevenTokensSharedExpertAndLosses) {
  MoeConfig cfg = base_config(1);
  cfg.router.aux_loss_coeff = 1e-2;
  cfg.router.z_loss_coeff = 1e-3;
  cfg.shared_expert_ffn = 64;
  run_ranks([&] { run(cfg, {{64, 37, 0}, {5, 64, 64, 17}}, 11); });
}

TEST_P(LayerLoopback, Fp8BlockwiseRecipeInCombineProbs) {
  MoeConfig cfg = base_config(1);
  cfg.prob_mode = ProbMode::InCombine;
  run_ranks([&] { run(cfg, {{64, 5, 37}, {0, 64, 17, 64}}, 13, false, 1, 0, Recipe::Fp8Blockwise); });
}

TEST_P(LayerLoopback, ChunkedStep) {
  MoeConfig cfg = base_config(1);
  run_ranks([&] { run(cfg, {{64, 40, 0, 64}}, 17, false, 2); });
}

INSTANTIATE_TEST_SUITE_P(InProcess, LayerLoopback, ::testing::Values(Transport::HostApi),
                         [](const ::testing::TestParamInfo<Transport>&) { return std::string("host"); });

INSTANTIATE_TEST_SUITE_P(Transports, Layer, ::testing::Values(Transport::NvLink, Transport::HostApi),
                         [](const ::testing::TestParamInfo<Transport>& i) {
                           return std::string(i.param == Transport::NvLink ? "nvlink" : "host");
                         });

}  // namespace
}  // namespace moerail

int main(int argc, char** argv) { return moerail::testing::multigpu_main(argc, argv, "layer_test", moerail::g_comm); }
