// GPU permute ops against the CPU reference (moerail::ref::dispatch_* / combine_* with R = 1) on fresh random
// inputs over the edge cases of docs/design.md. Every output is poisoned first; moved data must match bit for bit,
// sums within the dtype's rounding, and rows beyond the plan's rows_used must stay untouched.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "moerail/layout.h"
#include "moerail/permute.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/layout.h"
#include "moerail/status.h"
#include "permute/permute_common.h"

namespace moerail {
namespace {

using testing::DeviceTensor;
using testing::rows_of;

struct Case {
  DType dtype;
  std::int64_t T_max, T, H, E, K, A;
  double capacity_factor = 0;  // 0 = worst case
  bool one_expert = false;
  std::size_t misalign = 0;    // bytes to shift x / recv by (scalar fallback)
};

std::string name_of(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " T=" + std::to_string(c.T) + "/" + std::to_string(c.T_max) +
         " H=" + std::to_string(c.H) + " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) +
         " A=" + std::to_string(c.A) + (c.capacity_factor > 0 ? " cap=" + std::to_string(c.capacity_factor) : "") +
         (c.misalign ? " misaligned" : "");
}

void run_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(name_of(c));
  MoeConfig cfg;
  cfg.hidden = c.H;
  cfg.num_experts = c.E;
  cfg.topk = c.K;
  cfg.align = c.A;
  cfg.max_tokens = c.T_max;
  cfg.dtype = c.dtype;
  cfg.router = RouterConfig{};
  cfg.capacity = c.capacity_factor > 0 ? Capacity::of_factor(c.capacity_factor) : Capacity::worst_case();
  const std::int64_t T = c.T, T_max = c.T_max, H = c.H, K = c.K, C = cfg.rows_per_rank();
  ref::Rng rng(seed);
  int dev = 0;
  cudaGetDevice(&dev);

  // ---- inputs ----
  ref::HostTensor idx = testing::random_topk(rng, T_max, K, c.E, 0.05);
  if (c.one_expert)
    for (std::int64_t i = 0; i < T_max * K; ++i) idx.set_i(i, c.E - 1);
  ref::HostTensor x(c.dtype, {T_max, H}), probs(DType::F32, {T_max, K});
  ref::fill_normal(x, rng, 1.0);
  ref::fill_uniform(probs, rng, 0.05, 1.0);

  // ---- the plan, on both sides ----
  DeviceTensor d_idx(DType::I32, {T_max, K}), d_probs_in(DType::F32, {T_max, K});
  d_idx.upload(idx);
  d_probs_in.upload(probs);
  DeviceTensor nt = testing::device_scalar_i32(std::int32_t(T));
  DeviceTensor lbuf(DType::I32, {std::int64_t(layout_buffers_bytes(cfg) / 4)});
  DeviceTensor ws(DType::I32, {std::int64_t(layout_workspace_bytes(cfg) / 4) + 1});
  DeviceTensor st(DType::I32, {16});
  auto* status = static_cast<DeviceStatus*>(st.data());
  reset_status(status, nullptr);
  LayoutArgs la;
  la.topk_idx = d_idx.view();
  la.topk_probs = d_probs_in.view();
  la.num_tokens = nt.view();
  la.out = make_layout_buffers(cfg, lbuf.data(), dev);
  la.status = status;
  la.workspace = ws.view();
  plan_layout(cfg, la, nullptr);
  const LayoutBuffers& L = la.out;

  ref::HostTensor idx_t(DType::I32, {T, K});
  for (std::int64_t i = 0; i < T * K; ++i) idx_t.set_i(i, idx.i(i));
  const TensorView idx_views[1] = {idx_t.view()};
  const ref::LayoutPlan plan = ref::plan_layout(cfg, idx_views);
  const std::int64_t used = plan.rows_used[0];

  // ---- permute_forward ----
  DeviceTensor d_x(c.dtype, {T_max, H}), d_recv(c.dtype, {C, H}), d_recv_probs(DType::F32, {C});
  if (c.misalign) {
    d_x.set_offset(c.misalign);
    d_recv.set_offset(c.misalign);
  }
  d_x.upload(x);
  PermuteArgs pa;
  pa.x = d_x.view();
  pa.probs = d_probs_in.view();
  pa.num_tokens = nt.view();
  pa.layout = L;
  pa.recv = d_recv.view();
  pa.recv_probs = d_recv_probs.view();
  permute_forward(cfg, pa, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  ref::HostTensor recv_ref(c.dtype, {C, H}), rprobs_ref(DType::F32, {C});
  recv_ref.fill_nan();
  rprobs_ref.fill_nan();
  {
    const TensorView xs[1] = {rows_of(x, T, H)}, ps[1] = {rows_of(probs, T, K)};
    const TensorView rs[1] = {recv_ref.view()}, rps[1] = {rprobs_ref.view()};
    ref::dispatch_forward(plan, {xs, ps, rs, rps});
  }
  ref::HostTensor recv_gpu(c.dtype, {C, H}), rprobs_gpu(DType::F32, {C});
  d_recv.download(recv_gpu);
  d_recv_probs.download(rprobs_gpu);
  testing::expect_bits(recv_gpu, recv_ref, used * H, H, "recv");
  testing::expect_bits(rprobs_gpu, rprobs_ref, used, 0, "recv_probs");
  testing::expect_untouched(recv_gpu, used * H, C * H, "recv");
  testing::expect_untouched(rprobs_gpu, used, C, "recv_probs");

  // ---- permute_backward ----
  ref::HostTensor d_recv_h(c.dtype, {C, H}), d_rprobs_h(DType::F32, {C});
  ref::fill_normal(d_recv_h, rng, 1.0);
  ref::fill_normal(d_rprobs_h, rng, 1.0);
  DeviceTensor dd_recv(c.dtype, {C, H}), dd_rprobs(DType::F32, {C}), d_dx(c.dtype, {T_max, H}),
      d_dprobs(DType::F32, {T_max, K});
  dd_recv.upload(d_recv_h);
  dd_rprobs.upload(d_rprobs_h);
  PermuteBackwardArgs pb;
  pb.d_recv = dd_recv.view();
  pb.d_recv_probs = dd_rprobs.view();
  pb.num_tokens = nt.view();
  pb.layout = L;
  pb.dx = d_dx.view();
  pb.d_probs = d_dprobs.view();
  permute_backward(cfg, pb, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ref::HostTensor dx_ref(c.dtype, {T_max, H}), dp_ref(DType::F32, {T_max, K});
  {
    const TensorView dr[1] = {d_recv_h.view()}, drp[1] = {d_rprobs_h.view()};
    const TensorView dxs[1] = {rows_of(dx_ref, T, H)}, dps[1] = {rows_of(dp_ref, T, K)};
    ref::dispatch_backward(plan, {dr, drp, dxs, dps});
  }
  ref::HostTensor dx_gpu(c.dtype, {T_max, H}), dp_gpu(DType::F32, {T_max, K});
  d_dx.download(dx_gpu);
  d_dprobs.download(dp_gpu);
  testing::expect_close(dx_gpu, dx_ref, T * H, H, "dx");
  testing::expect_bits(dp_gpu, dp_ref, T * K, K, "d_probs (dispatch)");
  testing::expect_untouched(dx_gpu, T * H, T_max * H, "dx");

  for (ProbMode mode : {ProbMode::InActivation, ProbMode::InCombine}) {
    SCOPED_TRACE(std::string(moerail::name_of(mode)));
    // ---- unpermute_forward: y = random expert outputs in the received layout ----
    ref::HostTensor y(c.dtype, {C, H});
    ref::fill_normal(y, rng, 1.0);
    DeviceTensor d_y_in(c.dtype, {C, H}), d_out(c.dtype, {T_max, H});
    d_y_in.upload(y);
    UnpermuteArgs ua;
    ua.mode = mode;
    ua.y = d_y_in.view();
    ua.probs = d_probs_in.view();
    ua.num_tokens = nt.view();
    ua.layout = L;
    ua.out = d_out.view();
    unpermute_forward(cfg, ua, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ref::HostTensor out_ref(c.dtype, {T_max, H}), out_gpu(c.dtype, {T_max, H});
    {
      const TensorView ys[1] = {y.view()}, ps[1] = {rows_of(probs, T, K)}, os[1] = {rows_of(out_ref, T, H)};
      ref::combine_forward(plan, {mode, ys, ps, os});
    }
    d_out.download(out_gpu);
    testing::expect_close(out_gpu, out_ref, T * H, H, "out");
    testing::expect_untouched(out_gpu, T * H, T_max * H, "out");

    // ---- unpermute_backward ----
    ref::HostTensor d_out_h(c.dtype, {T_max, H});
    ref::fill_normal(d_out_h, rng, 1.0);
    DeviceTensor dd_out(c.dtype, {T_max, H}), dd_y(c.dtype, {C, H}), dd_p(DType::F32, {T_max, K});
    dd_out.upload(d_out_h);
    UnpermuteBackwardArgs ub;
    ub.mode = mode;
    ub.d_out = dd_out.view();
    ub.y = d_y_in.view();
    ub.probs = d_probs_in.view();
    ub.num_tokens = nt.view();
    ub.layout = L;
    ub.d_y = dd_y.view();
    ub.d_probs = dd_p.view();
    unpermute_backward(cfg, ub, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ref::HostTensor dy_ref(c.dtype, {C, H}), dpc_ref(DType::F32, {T_max, K});
    dy_ref.fill_nan();
    {
      const TensorView dos[1] = {rows_of(d_out_h, T, H)}, ys[1] = {y.view()}, ps[1] = {rows_of(probs, T, K)};
      const TensorView dys[1] = {dy_ref.view()}, dps[1] = {rows_of(dpc_ref, T, K)};
      ref::combine_backward(plan, {mode, dos, ys, ps, dys, dps});
    }
    ref::HostTensor dy_gpu(c.dtype, {C, H}), dpc_gpu(DType::F32, {T_max, K});
    dd_y.download(dy_gpu);
    dd_p.download(dpc_gpu);
    if (mode == ProbMode::InActivation) testing::expect_bits(dy_gpu, dy_ref, used * H, H, "d_y");
    else testing::expect_close(dy_gpu, dy_ref, used * H, H, "d_y");
    testing::expect_untouched(dy_gpu, used * H, C * H, "d_y");
    testing::expect_close(dpc_gpu, dpc_ref, T * K, K, "d_probs (combine)", 1e-4 * std::sqrt(double(H)));
  }
  const StatusReport s = read_status(status, nullptr);
  // the capacity cases are ones that overflow (a factor's rows include L (A - 1) pad rows: c = 1 never does)
  if (c.capacity_factor > 0) EXPECT_GT(plan.overflow[0], 0) << "the case is meant to overflow";
  EXPECT_EQ(std::int64_t(s.raw.overflow_rows), plan.overflow[0]);
  EXPECT_EQ(s.raw.bad_expert_ids + s.raw.bad_probs, 0u);
}

TEST(PermuteGpu, MatchesReferenceOnEdgeCases) {
  MOERAIL_REQUIRE_GPU();
  const std::vector<Case> cases = {
      {DType::BF16, 64, 0, 64, 8, 2, 16},               // T = 0
      {DType::BF16, 300, 300, 64, 8, 1, 16, 0, true},   // all tokens to one expert
      {DType::F32, 200, 190, 72, 6, 6, 1},              // K = L, E not a power of two, H not a multiple of 64
      {DType::BF16, 257, 250, 136, 96, 8, 16},          // E not a power of two, T < T_max
      {DType::BF16, 512, 512, 256, 256, 8, 128},        // deepseek-like routing, small H
      {DType::F32, 300, 300, 64, 64, 4, 256},           // A = 256
      {DType::BF16, 400, 400, 2048, 128, 8, 32},        // A = 32, wide rows
      {DType::F16, 128, 128, 40, 16, 4, 16},            // f16
      {DType::BF16, 130, 130, 100, 16, 4, 16},          // H * 2 not a multiple of 16: scalar path
      {DType::BF16, 130, 130, 64, 16, 4, 16, 0, false, 2},   // misaligned buffers: scalar path
      {DType::BF16, 1024, 1024, 64, 16, 4, 128, 0.5},   // capacity factor 0.5: overflow, rows dropped
      {DType::F32, 333, 333, 8, 12, 3, 16, 0.6},        // H = 8, overflow
      {DType::BF16, 200, 180, 12296, 32, 4, 16},        // long rows (24592 bytes), T < T_max
      {DType::F32, 96, 96, 4100, 16, 4, 16, 0.5},       // long fp32 rows, overflow
  };
  std::uint64_t seed = 1;
  for (const Case& c : cases) run_case(c, seed++);
}

}  // namespace
}  // namespace moerail
