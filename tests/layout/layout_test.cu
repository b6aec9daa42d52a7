// GPU layout planner against the CPU reference (moerail::ref::plan_layout), R = 1, on fresh random routings over
// the edge cases of docs/design.md; every output array compared exactly; status word checked for overflow and bad
// input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "moerail/error.h"
#include "moerail/layout.h"
#include "moerail/reference/layout.h"
#include "moerail/status.h"

namespace moerail {
namespace {

using testing::DeviceTensor;

struct Case {
  std::int64_t T_max, T, E, K, A;
  double capacity_factor;  // > 0 per rank (Capacity::Factor), < 0 per expert (PerExpert, -factor), 0 = worst case
  double unrouted;         // fraction of slots with id -1
  bool one_expert;         // every routed slot goes to expert E-1 (K = 1)
};

std::string name_of(const Case& c) {
  return "T=" + std::to_string(c.T) + "/" + std::to_string(c.T_max) + " E=" + std::to_string(c.E) +
         " K=" + std::to_string(c.K) + " A=" + std::to_string(c.A) + " cap=" + std::to_string(c.capacity_factor);
}

MoeConfig config_of(const Case& c) {
  MoeConfig cfg;
  cfg.hidden = 64;
  cfg.num_experts = c.E;
  cfg.topk = c.K;
  cfg.align = c.A;
  cfg.max_tokens = c.T_max;
  cfg.router = RouterConfig{};
  cfg.capacity = c.capacity_factor > 0   ? Capacity::of_factor(c.capacity_factor)
                 : c.capacity_factor < 0 ? Capacity::per_expert(-c.capacity_factor)
                                         : Capacity::worst_case();
  return cfg;
}

// The GPU plan of one step, downloaded.
struct GpuPlan {
  std::vector<std::int32_t> dest_row, tpe, padded, seg_off, seg_rows, pad_prefix, rows_used;
  StatusReport status;
};

GpuPlan run_gpu(const MoeConfig& cfg, const ref::HostTensor& idx_full, std::int64_t T, const ref::HostTensor* probs) {
  DeviceTensor idx(DType::I32, {cfg.max_tokens, cfg.topk});
  idx.upload(idx_full);
  DeviceTensor p;
  if (probs) {
    p = DeviceTensor(DType::F32, {cfg.max_tokens, cfg.topk});
    p.upload(*probs);
  }
  DeviceTensor nt = testing::device_scalar_i32(std::int32_t(T));
  DeviceTensor buf(DType::I32, {std::int64_t(layout_buffers_bytes(cfg) / 4)});
  DeviceTensor ws(DType::I32, {std::int64_t(layout_workspace_bytes(cfg) / 4) + 1});
  DeviceTensor st(DType::I32, {16});
  int dev = 0;
  cudaGetDevice(&dev);
  auto* status = static_cast<DeviceStatus*>(st.data());
  reset_status(status, nullptr);
  LayoutArgs a;
  a.topk_idx = idx.view();
  if (probs) a.topk_probs = p.view();
  a.num_tokens = nt.view();
  a.out = make_layout_buffers(cfg, buf.data(), dev);
  a.status = status;
  a.workspace = ws.view();
  plan_layout(cfg, a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::size_t E = std::size_t(cfg.num_experts);
  GpuPlan g;
  auto get = [](const TensorView& v, std::size_t n) {
    std::vector<std::int32_t> out(n);
    if (n) cudaMemcpy(out.data(), v.data(), n * 4, cudaMemcpyDeviceToHost);
    return out;
  };
  g.dest_row = get(a.out.dest_row, std::size_t(T * cfg.topk));
  g.tpe = get(a.out.tokens_per_expert, E);
  g.padded = get(a.out.padded_per_expert, E);
  g.seg_off = get(a.out.segment_offset, E + 1);
  g.seg_rows = get(a.out.segment_rows, E);
  g.pad_prefix = get(a.out.pad_prefix, E + 1);
  g.rows_used = get(a.out.rows_used, 1);
  g.status = read_status(status, nullptr);
  return g;
}

// Compares the GPU plan with the reference plan of the first T rows; returns the reference.
ref::LayoutPlan compare(const MoeConfig& cfg, const ref::HostTensor& idx_full, std::int64_t T, const GpuPlan& g,
                        const std::string& what) {
  const std::int64_t K = cfg.topk, E = cfg.num_experts;
  ref::HostTensor idx(DType::I32, {T, K});
  for (std::int64_t i = 0; i < T * K; ++i) idx.set_i(i, idx_full.i(i));
  const TensorView views[1] = {idx.view()};
  const ref::LayoutPlan r = ref::plan_layout(cfg, views);
  int bad = 0;
  for (std::int64_t i = 0; i < T * K && bad < 5; ++i)
    if (g.dest_row[std::size_t(i)] != r.dest_row[0][std::size_t(i)]) {
      ADD_FAILURE() << what << ": dest_row[" << i / K << "," << i % K << "] = " << g.dest_row[std::size_t(i)]
                    << " but the reference has " << r.dest_row[0][std::size_t(i)];
      ++bad;
    }
  // an expert's segment and its kept rows: at most expert_capacity of each under Capacity::PerExpert
  const std::int64_t cap = r.expert_capacity;
  auto clip = [&](std::int64_t v) { return cap > 0 ? std::min(v, cap) : v; };
  std::int64_t pad_before = 0, rows = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    const auto u = std::size_t(e);
    EXPECT_EQ(g.tpe[u], r.tokens_per_expert[u]) << what << " tokens_per_expert[" << e << "]";
    EXPECT_EQ(g.padded[u], r.padded_per_expert[u]) << what << " padded_per_expert[" << e << "]";
    EXPECT_EQ(g.seg_off[u], r.segment_offset[u]) << what << " segment_offset[" << e << "]";
    EXPECT_EQ(g.seg_rows[u], r.segment_rows[u]) << what << " segment_rows[" << e << "]";
    EXPECT_EQ(g.pad_prefix[u], pad_before) << what << " pad_prefix[" << e << "]";
    pad_before += clip(r.padded_per_expert[u]) - clip(r.tokens_per_expert[u]);
    rows += clip(r.padded_per_expert[u]);
  }
  EXPECT_EQ(g.seg_off[std::size_t(E)], rows) << what << " segment_offset[E]";
  EXPECT_EQ(g.pad_prefix[std::size_t(E)], pad_before) << what << " pad_prefix[E]";
  EXPECT_EQ(g.rows_used[0], r.rows_used[0]) << what << " rows_used";
  EXPECT_EQ(std::int64_t(g.status.raw.overflow_rows), r.overflow[0]) << what << " status overflow";
  return r;
}

TEST(LayoutGpu, MatchesReferenceOnEdgeCases) {
  MOERAIL_REQUIRE_GPU();
  const std::vector<Case> cases = {
      {64, 0, 8, 2, 16, 0, 0, false},          // T = 0
      {300, 300, 8, 1, 4, 0, 0, true},         // all tokens to one expert
      {200, 200, 6, 6, 1, 0, 0, false},        // K = L, E not a power of two, A = 1
      {257, 250, 96, 8, 16, 0, 0.1, false},    // T < T_max, unrouted slots
      {1000, 1000, 256, 8, 32, 0, 0, false},
      {1000, 777, 128, 8, 128, 0, 0, false},
      {513, 513, 64, 4, 256, 0, 0, false},
      {2048, 2048, 256, 8, 16, 0.5, 0, false},   // capacity factor 0.5 at E 256: overflow (c = 1 cannot: the
                                                 // factor's rows include L (A - 1) pad rows)
      {1024, 1024, 16, 2, 16, 0.5, 0, false},    // heavy overflow
      {4096, 4096, 3000, 4, 16, 0, 0.05, false}, // E large (one warp per block)
      {4096, 4096, 64, 8, 128, 0, 0, false},     // the local plan of a dispatch at 4096 tokens, E 64
      {16384, 16000, 64, 8, 128, 0, 0.02, false},  // 256 chunks, 4 warps per block; 16384 counts: the largest
                                                   // scan the finalize block does itself
      {4096, 4096, 257, 8, 16, 0, 0.02, false},    // 257 x 64 = 16448 counts: scanned by cub::DeviceScan
      {2048, 2048, 64, 8, 128, -1.0, 0, false},    // per-expert capacity 1 at A = 128: the fuller experts overflow
      {1024, 900, 16, 2, 16, -0.5, 0.1, false},    // per expert, heavy overflow, T < T_max
      {300, 300, 8, 1, 4, -1.25, 0, true},         // per expert, every token on one expert
  };
  ref::Rng rng(1234);
  for (const Case& c : cases) {
    const MoeConfig cfg = config_of(c);
    ref::HostTensor idx = testing::random_topk(rng, c.T_max, c.K, c.E, c.unrouted);
    if (c.one_expert)
      for (std::int64_t i = 0; i < c.T_max * c.K; ++i) idx.set_i(i, c.E - 1);
    const GpuPlan g = run_gpu(cfg, idx, c.T, nullptr);
    const ref::LayoutPlan r = compare(cfg, idx, c.T, g, name_of(c));
    EXPECT_EQ(g.status.raw.bad_expert_ids, 0u);
    // every capacity case of the list is one that overflows (the worst case never does): the checks below run
    if (c.capacity_factor != 0)
      EXPECT_GT(r.overflow[0], 0) << name_of(c) << ": the case is meant to overflow";
    else
      EXPECT_EQ(r.overflow[0], 0) << name_of(c);
    if (r.overflow[0] > 0 && r.expert_capacity > 0) {  // the fullest expert's rows, and one expert's
      EXPECT_EQ(std::int64_t(g.status.raw.rows_needed),
                *std::max_element(r.padded_per_expert.begin(), r.padded_per_expert.end())) << name_of(c);
      EXPECT_EQ(std::int64_t(g.status.raw.rows_available), r.expert_capacity) << name_of(c);
    } else if (r.overflow[0] > 0) {
      EXPECT_EQ(std::int64_t(g.status.raw.rows_needed), r.rows_needed[0]);
      EXPECT_EQ(std::int64_t(g.status.raw.rows_available), r.capacity);
    }
  }
}

TEST(LayoutGpu, OverflowIsReportedByCheckStatus) {
  MOERAIL_REQUIRE_GPU();
  // Factor(c) rows = ceil(c T_max K) + L (A - 1): with c = 1 the pad allowance makes overflow impossible; at
  // c = 0.5 about half the routed rows cannot fit.
  const Case c{2048, 2048, 64, 8, 128, 0.5, 0, false};
  const MoeConfig cfg = config_of(c);
  ref::Rng rng(7);
  ref::HostTensor idx = testing::random_topk(rng, c.T_max, c.K, c.E);
  const GpuPlan g = run_gpu(cfg, idx, c.T, nullptr);
  const ref::LayoutPlan r = compare(cfg, idx, c.T, g, "overflow");
  ASSERT_GT(r.overflow[0], 0);
  const std::string msg = g.status.describe("dispatch", &cfg.capacity);
  EXPECT_NE(msg.find(std::to_string(r.overflow[0]) + " routed rows did not fit"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(r.rows_needed[0]) + " rows needed"), std::string::npos) << msg;
  EXPECT_NE(msg.find("factor"), std::string::npos) << msg;
}

TEST(LayoutGpu, BadIdsAndProbsAreSkippedAndReported) {
  MOERAIL_REQUIRE_GPU();
  const Case c{500, 480, 32, 4, 16, 0, 0, false};
  const MoeConfig cfg = config_of(c);
  ref::Rng rng(99);
  ref::HostTensor idx = testing::random_topk(rng, c.T_max, c.K, c.E);
  ref::HostTensor probs(DType::F32, {c.T_max, c.K});
  probs.fill(0.25);
  idx.set_i(17 * 4 + 3, 300);  // bad ids: the first one is the lowest slot
  idx.set_i(400 * 4 + 0, -5);
  idx.set_i(490 * 4 + 0, 999);  // beyond T: not read
  probs.set_f(20 * 4 + 1, std::numeric_limits<double>::quiet_NaN());
  probs.set_f(30 * 4 + 2, std::numeric_limits<double>::infinity());
  const GpuPlan g = run_gpu(cfg, idx, c.T, &probs);
  EXPECT_EQ(g.status.raw.bad_expert_ids, 2u);
  EXPECT_EQ(g.status.raw.bad_probs, 2u);
  // The reference of the same routing with the offending slots unrouted.
  ref::HostTensor clean(DType::I32, {c.T_max, c.K});
  for (std::int64_t i = 0; i < c.T_max * c.K; ++i) clean.set_i(i, idx.i(i));
  for (std::int64_t s : {17 * 4 + 3, 400 * 4 + 0, 20 * 4 + 1, 30 * 4 + 2}) clean.set_i(s, -1);
  compare(cfg, clean, c.T, g, "bad input");
  const std::string msg = g.status.describe("layout");
  EXPECT_NE(msg.find("2 routed slots had an expert id outside [-1, 32), first topk_idx[17,3] = 300"),
            std::string::npos) << msg;
  EXPECT_NE(msg.find("first topk_probs[20,1] = nan"), std::string::npos) << msg;
}

}  // namespace
}  // namespace moerail
