// router -> layout -> permute -> unpermute, forward and backward, captured once in a CUDA graph and replayed with
// 20 different routings and token counts (T = 0 included). Each replay is compared with the CPU reference: the
// ops read nothing on the host, so the captured graph must follow the new T and routing on every replay.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "moerail/layout.h"
#include "moerail/permute.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/layout.h"
#include "moerail/reference/router.h"
#include "moerail/router.h"
#include "moerail/status.h"
#include "permute/permute_common.h"

namespace moerail {
namespace {

using testing::DeviceTensor;
using testing::rows_of;

TEST(GraphGpu, RouterPermuteCombineForwardBackwardReplays) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig cfg;
  cfg.hidden = 136;
  cfg.num_experts = 64;
  cfg.topk = 4;
  cfg.align = 16;
  cfg.max_tokens = 512;
  cfg.dtype = DType::BF16;
  cfg.prob_mode = ProbMode::InCombine;
  cfg.router = RouterConfig{};
  cfg.router.score = ScoreFunction::Sigmoid;
  cfg.router.num_groups = 8;
  cfg.router.group_topk = 4;
  cfg.router.use_expert_bias = true;
  cfg.router.scaling_factor = 2.5;
  cfg.router.aux_loss_coeff = 1e-2;
  cfg.router.z_loss_coeff = 1e-3;
  const std::int64_t T_max = cfg.max_tokens, H = cfg.hidden, E = cfg.num_experts, K = cfg.topk;
  const std::int64_t C = cfg.rows_per_rank();
  int dev = 0;
  cudaGetDevice(&dev);

  // Buffers, all at fixed addresses for the life of the graph.
  DeviceTensor logits(DType::F32, {T_max, E}), bias(DType::F32, {E}), nt(DType::I32, {1});
  DeviceTensor idx(DType::I32, {T_max, K}), probs(DType::F32, {T_max, K}), losses(DType::F32, {2}),
      aux_tpe(DType::I32, {E});
  DeviceTensor rws(DType::I32, {std::int64_t(router_workspace_bytes(cfg) / 4) + 1});
  DeviceTensor lbuf(DType::I32, {std::int64_t(layout_buffers_bytes(cfg) / 4)});
  DeviceTensor lws(DType::I32, {std::int64_t(layout_workspace_bytes(cfg) / 4) + 1});
  DeviceTensor st(DType::I32, {16});
  DeviceTensor x(DType::BF16, {T_max, H}), recv(DType::BF16, {C, H}), recv_probs(DType::F32, {C});
  DeviceTensor out(DType::BF16, {T_max, H}), d_out(DType::BF16, {T_max, H}), d_y(DType::BF16, {C, H}),
      d_pc(DType::F32, {T_max, K}), dx(DType::BF16, {T_max, H}), d_pd(DType::F32, {T_max, K}),
      d_logits(DType::F32, {T_max, E});
  auto* status = static_cast<DeviceStatus*>(st.data());
  const LayoutBuffers L = make_layout_buffers(cfg, lbuf.data(), dev);

  ref::Rng rng(2024);
  ref::HostTensor bias_h(DType::F32, {E});
  ref::fill_uniform(bias_h, rng, -0.05, 0.05);
  bias.upload(bias_h);

  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  reset_status(status, s);

  RouterForwardArgs rf;
  rf.logits = logits.view();
  rf.expert_bias = bias.view();
  rf.num_tokens = nt.view();
  rf.topk_idx = idx.view();
  rf.topk_probs = probs.view();
  rf.losses = losses.view();
  rf.aux_tokens_per_expert = aux_tpe.view();
  rf.status = status;
  rf.workspace = rws.view();
  LayoutArgs la{idx.view(), probs.view(), nt.view(), L, status, lws.view()};
  PermuteArgs pa{x.view(), probs.view(), nt.view(), L, recv.view(), recv_probs.view()};
  UnpermuteArgs ua{ProbMode::InCombine, recv.view(), probs.view(), nt.view(), L, out.view()};
  UnpermuteBackwardArgs ub{ProbMode::InCombine, d_out.view(), recv.view(), probs.view(), nt.view(), L,
                           d_y.view(), d_pc.view()};
  PermuteBackwardArgs pb{d_y.view(), recv_probs.view(), nt.view(), L, dx.view(), d_pd.view()};
  RouterBackwardArgs rb;
  rb.logits = logits.view();
  rb.num_tokens = nt.view();
  rb.topk_idx = idx.view();
  rb.d_topk_probs = d_pc.view();
  rb.aux_tokens_per_expert = aux_tpe.view();
  rb.d_aux_loss = 1.0f;
  rb.d_z_loss = 1.0f;
  rb.d_logits = d_logits.view();

  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  router_forward(cfg, rf, s);
  plan_layout(cfg, la, s);
  permute_forward(cfg, pa, s);
  unpermute_forward(cfg, ua, s);
  unpermute_backward(cfg, ub, s);
  permute_backward(cfg, pb, s);
  router_backward(cfg, rb, s);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  int router_mismatch_tokens = 0;
  for (int replay = 0; replay < 20; ++replay) {
    const std::int64_t T = replay == 3 ? 0 : replay == 7 ? T_max : 1 + rng.below(T_max);
    SCOPED_TRACE("replay " + std::to_string(replay) + " T=" + std::to_string(T));
    ref::HostTensor lg(DType::F32, {T_max, E}), xh(DType::BF16, {T_max, H}), doh(DType::BF16, {T_max, H});
    for (std::int64_t i = 0; i < T_max * E; ++i) lg.set_f(i, double(rng.below(4096)) / 512.0 - 4.0);
    ref::fill_normal(xh, rng, 1.0);
    ref::fill_normal(doh, rng, 1.0);
    logits.upload(lg);
    x.upload(xh);
    d_out.upload(doh);
    nt.from_vector(std::vector<std::int32_t>{std::int32_t(T)});
    for (DeviceTensor* t : {&idx, &probs, &recv, &recv_probs, &out, &d_y, &d_pc, &dx, &d_pd, &d_logits}) t->poison();
    reset_status(status, s);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    EXPECT_NO_THROW(check_status(status, s, "graph step", &cfg.capacity));

    // Router against the reference (near-ties of fp32 vs double may pick differently: counted, bounded).
    ref::HostTensor idx_g(DType::I32, {T_max, K}), probs_g(DType::F32, {T_max, K});
    idx.download(idx_g);
    probs.download(probs_g);
    ref::HostTensor idx_r(DType::I32, {T, K}), probs_r(DType::F32, {T, K});
    ref::RouterForwardArgs rfa{rows_of(lg, T, E), bias_h.view(), idx_r.view(), probs_r.view(), -1};
    ref::router_forward(cfg, rfa);
    for (std::int64_t t = 0; t < T; ++t) {
      bool same = true;
      for (std::int64_t k = 0; k < K; ++k) same = same && idx_g.i(t * K + k) == idx_r.i(t * K + k);
      if (!same) {
        ++router_mismatch_tokens;
        continue;
      }
      for (std::int64_t k = 0; k < K; ++k)
        ASSERT_NEAR(probs_g.f(t * K + k), probs_r.f(t * K + k), 1e-5) << "topk_probs[" << t << "," << k << "]";
    }

    // The data path against the reference, from the GPU's routing.
    ref::HostTensor idx_t(DType::I32, {T, K});
    for (std::int64_t i = 0; i < T * K; ++i) idx_t.set_i(i, idx_g.i(i));
    const TensorView iv[1] = {idx_t.view()};
    const ref::LayoutPlan plan = ref::plan_layout(cfg, iv);
    const std::int64_t used = plan.rows_used[0];
    ref::HostTensor recv_r(DType::BF16, {C, H}), rp_r(DType::F32, {C}), out_r(DType::BF16, {T_max, H});
    ref::HostTensor dy_r(DType::BF16, {C, H}), dpc_r(DType::F32, {T_max, K}), dx_r(DType::BF16, {T_max, H}),
        dpd_r(DType::F32, {T_max, K}), dl_r(DType::F32, {T, E});
    {
      const TensorView xs[1] = {rows_of(xh, T, H)}, ps[1] = {rows_of(probs_g, T, K)};
      const TensorView rs[1] = {recv_r.view()}, rps[1] = {rp_r.view()};
      ref::dispatch_forward(plan, {xs, ps, rs, rps});
      const TensorView os[1] = {rows_of(out_r, T, H)};
      ref::combine_forward(plan, {ProbMode::InCombine, rs, ps, os});
      const TensorView dos[1] = {rows_of(doh, T, H)}, dys[1] = {dy_r.view()}, dps[1] = {rows_of(dpc_r, T, K)};
      ref::combine_backward(plan, {ProbMode::InCombine, dos, rs, ps, dys, dps});
    }
    ref::HostTensor recv_g(DType::BF16, {C, H}), rp_g(DType::F32, {C}), out_g(DType::BF16, {T_max, H}),
        dy_g(DType::BF16, {C, H}), dpc_g(DType::F32, {T_max, K}), dx_g(DType::BF16, {T_max, H}),
        dpd_g(DType::F32, {T_max, K}), dl_g(DType::F32, {T_max, E});
    recv.download(recv_g);
    recv_probs.download(rp_g);
    out.download(out_g);
    d_y.download(dy_g);
    d_pc.download(dpc_g);
    dx.download(dx_g);
    d_pd.download(dpd_g);
    d_logits.download(dl_g);
    {
      // dispatch backward from the GPU's d_y (so that the check does not compound roundings).
      const TensorView dr[1] = {dy_g.view()}, drp[1] = {rp_g.view()};
      const TensorView dxs[1] = {rows_of(dx_r, T, H)}, dps[1] = {rows_of(dpd_r, T, K)};
      ref::dispatch_backward(plan, {dr, drp, dxs, dps});
      // router backward from the GPU's selection and d_probs.
      ref::RouterBackwardArgs rba{rows_of(lg, T, E), bias_h.view(), iv[0], rows_of(dpc_g, T, K), 1.0, 1.0, -1,
                                  dl_r.view()};
      ref::router_backward(cfg, rba);
    }
    testing::expect_bits(recv_g, recv_r, used * H, H, "recv");
    testing::expect_bits(rp_g, rp_r, used, 0, "recv_probs");
    testing::expect_close(out_g, out_r, T * H, H, "out");
    testing::expect_close(dy_g, dy_r, used * H, H, "d_y");
    testing::expect_close(dpc_g, dpc_r, T * K, K, "d_probs (combine)", 2e-3);
    testing::expect_close(dx_g, dx_r, T * H, H, "dx");
    testing::expect_bits(dpd_g, dpd_r, T * K, K, "d_probs (dispatch)");
    testing::expect_close(dl_g, dl_r, T * E, E, "d_logits", 2e-4);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_LE(router_mismatch_tokens, 3) << "tokens whose GPU selection differs from the reference";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace moerail
