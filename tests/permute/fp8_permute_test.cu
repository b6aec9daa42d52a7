// GPU permute_forward_fp8 (moerail/permute.h) against the CPU reference ref::dispatch_fp8_forward (quantize with
// ref::quantize_fp8, then move code rows, scale rows and probs with the same plan), bit for bit.
//
//   Edge cases   every case runs with the six variants: bf16 x quantized in the scatter (PerTensor, Block1x128,
//                Mx1x32) and already quantized input moved (random bytes, NaN patterns included: PerTensor,
//                Block1x128, Mx1x32). T = 0, T < T_max, all tokens to one expert, A = 16 / 32 / 128, capacity
//                overflow, E not a power of two, bad expert ids and NaN probs, short and long rows. Outputs are
//                poisoned (0xff bytes: e4m3 NaN codes, NaN scales); rows at or beyond rows_used must keep it.
//   Graph        plan_layout + the quantizing and the moving permute captured once, replayed with new routing,
//                data and token counts (T = 0 and T = T_max included).
//   Errors       the argument is named (H not a multiple of the recipe's block, x and q both given, a missing
//                tensor_scale, a misaligned recv, a short recv_scales).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "moerail/layout.h"
#include "moerail/permute.h"
#include "moerail/quant.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/layout.h"
#include "moerail/reference/quant.h"
#include "moerail/status.h"
#include "permute/permute_common.h"

namespace moerail {
namespace {

using ref::HostTensor;
using testing::DeviceTensor;
using testing::rows_of;

enum class Source { Quantize, Move };

struct Variant {
  Source source;
  Fp8Scaling scaling;
};

std::string name_of(const Variant& v) {
  return std::string(v.source == Source::Quantize ? "quantize " : "move ") + std::string(fp8_scaling_name(v.scaling));
}

const std::vector<Variant>& all_variants() {
  static const std::vector<Variant> v = {
      {Source::Quantize, Fp8Scaling::PerTensor}, {Source::Quantize, Fp8Scaling::Block1x128},
      {Source::Quantize, Fp8Scaling::Mx1x32},    {Source::Move, Fp8Scaling::PerTensor},
      {Source::Move, Fp8Scaling::Block1x128},    {Source::Move, Fp8Scaling::Mx1x32},
  };
  return v;
}

struct Case {
  std::int64_t T_max, T, H, E, K, A;
  double capacity_factor = 0;  // 0 = worst case
  bool one_expert = false;
  bool bad_routing = false;    // an expert id >= E and a NaN prob in the first tokens
};

std::string name_of(const Case& c) {
  return "T=" + std::to_string(c.T) + "/" + std::to_string(c.T_max) + " H=" + std::to_string(c.H) +
         " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) + " A=" + std::to_string(c.A) +
         (c.capacity_factor > 0 ? " cap=" + std::to_string(c.capacity_factor) : "") +
         (c.one_expert ? " one expert" : "") + (c.bad_routing ? " bad routing" : "");
}

MoeConfig config_of(const Case& c) {
  MoeConfig cfg;
  cfg.hidden = c.H;
  cfg.num_experts = c.E;
  cfg.topk = c.K;
  cfg.align = c.A;
  cfg.max_tokens = c.T_max;
  cfg.dtype = DType::BF16;
  cfg.router = RouterConfig{};
  cfg.capacity = c.capacity_factor > 0 ? Capacity::of_factor(c.capacity_factor) : Capacity::worst_case();
  return cfg;
}

std::int64_t scale_cols(Fp8Scaling s, std::int64_t H) {
  const std::int64_t b = fp8_scale_block_cols(s);
  return b > 0 ? H / b : 0;
}

void poison(const HostTensor& t) { std::memset(t.view().data(), 0xff, t.view().nbytes()); }

void random_bytes(const HostTensor& t, ref::Rng& rng) {
  auto* b = static_cast<unsigned char*>(t.view().data());
  for (std::size_t i = 0; i < t.view().nbytes(); ++i) b[i] = static_cast<unsigned char>(rng.next());
}

// bf16 rows with a magnitude of their own (2^-20 .. 2^20) and row 0's first 128 columns zero (a zero block).
HostTensor random_x(ref::Rng& rng, std::int64_t T_max, std::int64_t H) {
  HostTensor x(DType::BF16, {T_max, H});
  for (std::int64_t r = 0; r < T_max; ++r) {
    const double mag = std::ldexp(1.0, int(rng.below(41)) - 20);
    for (std::int64_t j = 0; j < H; ++j) x.set_f(r * H + j, (r == 0 && j < 128) ? 0.0 : rng.normal() * mag);
  }
  return x;
}

// Bytes [0, n) of `gpu` equal `want`'s; bytes [n, total) still 0xff. elem bytes per element, cols per row.
void expect_bytes(const HostTensor& gpu, const HostTensor& want, std::size_t n, std::size_t elem, std::int64_t cols,
                  const std::string& what) {
  const auto* g = static_cast<const unsigned char*>(gpu.view().data());
  const auto* w = static_cast<const unsigned char*>(want.view().data());
  int bad = 0;
  for (std::size_t i = 0; i < n / elem && bad < 5; ++i) {
    if (std::memcmp(g + i * elem, w + i * elem, elem) == 0) continue;
    unsigned gv = 0, wv = 0;
    std::memcpy(&gv, g + i * elem, elem);
    std::memcpy(&wv, w + i * elem, elem);
    const std::int64_t c = cols > 0 ? cols : 1;
    ADD_FAILURE() << what << "[" << std::int64_t(i) / c << "," << std::int64_t(i) % c << "] = 0x" << std::hex << gv
                  << " on the GPU but 0x" << wv << " in the reference";
    ++bad;
  }
  for (std::size_t i = n; i < gpu.view().nbytes(); ++i)
    if (g[i] != 0xff) {
      ADD_FAILURE() << what << ": byte " << std::dec << i << " (row " << std::int64_t(i / elem) / (cols > 0 ? cols : 1)
                    << ") was written but lies at or beyond rows_used";
      return;
    }
}

// The device and host state of one routed problem: inputs on both sides, the plan on both sides.
struct Problem {
  MoeConfig cfg;
  std::int64_t T = 0, C = 0;
  HostTensor idx, probs, x, q, q_scales_block, q_scales_mx;
  ref::LayoutPlan plan;
};

// Host inputs for T tokens of T_max; the reference plan from the routing the GPU planner keeps (bad slots unrouted).
void make_inputs(Problem& p, const Case& c, ref::Rng& rng) {
  const std::int64_t T_max = c.T_max, H = c.H, K = c.K;
  p.T = c.T;
  p.idx = testing::random_topk(rng, T_max, K, c.E, 0.05);
  if (c.one_expert)
    for (std::int64_t i = 0; i < T_max * K; ++i) p.idx.set_i(i, c.E - 1);
  p.probs = HostTensor(DType::F32, {T_max, K});
  ref::fill_uniform(p.probs, rng, 0.05, 1.0);
  ref::HostTensor idx_t(DType::I32, {p.T, K});
  for (std::int64_t i = 0; i < p.T * K; ++i) idx_t.set_i(i, p.idx.i(i));
  if (c.bad_routing && p.T > 2) {
    p.idx.set_i(1 * K + 0, std::int32_t(c.E + 3));
    idx_t.set_i(1 * K + 0, -1);
    if (p.idx.i(2 * K + K - 1) >= 0) {
      p.probs.set_f(2 * K + K - 1, std::numeric_limits<double>::quiet_NaN());
      idx_t.set_i(2 * K + K - 1, -1);
    }
  }
  p.x = random_x(rng, T_max, H);
  p.q = HostTensor(DType::F8E4M3, {T_max, H});
  p.q_scales_block = HostTensor(DType::F32, {T_max, std::max<std::int64_t>(H / 128, 1)});
  p.q_scales_mx = HostTensor(kE8M0ScaleDType, {T_max, std::max<std::int64_t>(H / 32, 1)});
  for (const HostTensor* t : {&p.q, &p.q_scales_block, &p.q_scales_mx}) random_bytes(*t, rng);
  const TensorView iv[1] = {idx_t.view()};
  p.plan = ref::plan_layout(p.cfg, iv);
}

// The reference output of variant v for the current inputs: recv, scales, probs of C rows, poisoned past rows_used.
struct RefOut {
  HostTensor recv, scales, probs;
};
RefOut reference_of(const Problem& p, const Variant& v, float tensor_scale) {
  const std::int64_t T = p.T, H = p.cfg.hidden, K = p.cfg.topk, C = p.C, nb = scale_cols(v.scaling, H);
  const DType sdt = fp8_scale_dtype(v.scaling);
  RefOut r{HostTensor(DType::F8E4M3, {C, H}), HostTensor(sdt, {C, std::max<std::int64_t>(nb, 1)}),
           HostTensor(DType::F32, {C})};
  for (const HostTensor* t : {&r.recv, &r.scales, &r.probs}) poison(*t);
  HostTensor ts(DType::F32, {1});
  ts.set_f(0, tensor_scale);
  const HostTensor& qs = v.scaling == Fp8Scaling::Mx1x32 ? p.q_scales_mx : p.q_scales_block;
  const TensorView xs[1] = {rows_of(p.x, T, H)}, qv[1] = {rows_of(p.q, T, H)}, qsv[1] = {rows_of(qs, T, nb)};
  const TensorView ps[1] = {rows_of(p.probs, T, K)};
  const TensorView rs[1] = {r.recv.view()}, rss[1] = {rows_of(r.scales, C, nb)}, rps[1] = {r.probs.view()};
  ref::DispatchFp8Args a;
  a.scaling = v.scaling;
  if (v.source == Source::Quantize) {
    a.x = xs;
    a.tensor_scale = ts.view();
  } else {
    a.q = qv;
    if (nb > 0) a.q_scales = qsv;
  }
  a.probs = ps;
  a.recv = rs;
  if (nb > 0) a.recv_scales = rss;
  a.recv_probs = rps;
  ref::dispatch_fp8_forward(p.plan, a);
  return r;
}

// Device buffers of one variant's outputs (poisoned on creation and before each run).
struct DeviceOut {
  DeviceTensor recv, scales, probs;
  DeviceOut(const Variant& v, std::int64_t C, std::int64_t H)
      : recv(DType::F8E4M3, {C, H}),
        scales(fp8_scale_dtype(v.scaling), {C, std::max<std::int64_t>(scale_cols(v.scaling, H), 1)}),
        probs(DType::F32, {C}) {}
};

// Device inputs of a problem.
struct DeviceIn {
  DeviceTensor idx, probs, x, q, qs_block, qs_mx, tensor_scale, nt, lbuf, lws, status;
  LayoutBuffers layout;
  DeviceIn(const MoeConfig& cfg, int dev)
      : idx(DType::I32, {cfg.max_tokens, cfg.topk}),
        probs(DType::F32, {cfg.max_tokens, cfg.topk}),
        x(DType::BF16, {cfg.max_tokens, cfg.hidden}),
        q(DType::F8E4M3, {cfg.max_tokens, cfg.hidden}),
        qs_block(DType::F32, {cfg.max_tokens, std::max<std::int64_t>(cfg.hidden / 128, 1)}),
        qs_mx(kE8M0ScaleDType, {cfg.max_tokens, std::max<std::int64_t>(cfg.hidden / 32, 1)}),
        tensor_scale(DType::F32, {1}),
        nt(DType::I32, {1}),
        lbuf(DType::I32, {std::int64_t(layout_buffers_bytes(cfg) / 4)}),
        lws(DType::I32, {std::int64_t(layout_workspace_bytes(cfg) / 4) + 1}),
        status(DType::I32, {16}) {
    layout = make_layout_buffers(cfg, lbuf.data(), dev);
  }
  DeviceStatus* st() const { return static_cast<DeviceStatus*>(status.data()); }
  void upload(const Problem& p, float scale) const {
    idx.upload(p.idx);
    probs.upload(p.probs);
    x.upload(p.x);
    q.upload(p.q);
    qs_block.upload(p.q_scales_block);
    qs_mx.upload(p.q_scales_mx);
    tensor_scale.from_vector(std::vector<float>{scale});
    nt.from_vector(std::vector<std::int32_t>{std::int32_t(p.T)});
  }
  LayoutArgs layout_args() const {
    LayoutArgs la;
    la.topk_idx = idx.view();
    la.topk_probs = probs.view();
    la.num_tokens = nt.view();
    la.out = layout;
    la.status = st();
    la.workspace = lws.view();
    return la;
  }
};

PermuteFp8Args args_of(const DeviceIn& in, const DeviceOut& out, const Variant& v, const MoeConfig& cfg) {
  const std::int64_t H = cfg.hidden, nb = scale_cols(v.scaling, H);
  PermuteFp8Args a;
  a.scaling = v.scaling;
  if (v.source == Source::Quantize) {
    a.x = in.x.view();
    if (v.scaling == Fp8Scaling::PerTensor) a.tensor_scale = in.tensor_scale.view();
  } else {
    a.q = in.q.view();
    if (nb > 0) a.q_scales = (v.scaling == Fp8Scaling::Mx1x32 ? in.qs_mx : in.qs_block).view_as({cfg.max_tokens, nb});
  }
  a.probs = in.probs.view();
  a.num_tokens = in.nt.view();
  a.layout = in.layout;
  a.recv = out.recv.view();
  if (nb > 0) a.recv_scales = out.scales.view_as({cfg.rows_per_rank(), nb});
  a.recv_probs = out.probs.view();
  return a;
}

// The per-tensor scale the tests give: the bf16 rows' amax / 448 (rows t < T), or 1 for all-zero data.
float tensor_scale_of(const Problem& p) {
  float amax = 0.0f;
  for (std::int64_t i = 0; i < p.T * p.cfg.hidden; ++i) amax = std::fmax(amax, std::fabs(float(p.x.f(i))));
  return amax > 0 ? amax / kE4M3Max : 1.0f;
}

// Downloads the GPU outputs and compares them with the reference: bit for bit up to rows_used, poison after it.
void compare(const Problem& p, const Variant& v, const DeviceOut& out, const RefOut& want) {
  const std::int64_t H = p.cfg.hidden, C = p.C, nb = scale_cols(v.scaling, H), used = p.plan.rows_used[0];
  const std::size_t se = dtype_size(fp8_scale_dtype(v.scaling));
  HostTensor recv(DType::F8E4M3, {C, H}), probs(DType::F32, {C});
  out.recv.download(recv);
  out.probs.download(probs);
  expect_bytes(recv, want.recv, std::size_t(used * H), 1, H, "recv");
  expect_bytes(probs, want.probs, std::size_t(used) * 4, 4, 0, "recv_probs");
  if (nb > 0) {
    HostTensor scales(fp8_scale_dtype(v.scaling), {C, nb});
    out.scales.download(scales);
    expect_bytes(scales, want.scales, std::size_t(used * nb) * se, se, nb, "recv_scales");
  } else {  // per-tensor: the scale buffer is not an output at all
    HostTensor scales(fp8_scale_dtype(v.scaling), {C, 1});
    out.scales.download(scales);
    expect_bytes(scales, want.scales, 0, se, 1, "recv_scales (per-tensor: none)");
  }
}

void run_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(name_of(c));
  int dev = 0;
  cudaGetDevice(&dev);
  Problem p;
  p.cfg = config_of(c);
  p.C = p.cfg.rows_per_rank();
  ref::Rng rng(seed);
  make_inputs(p, c, rng);
  const float tscale = tensor_scale_of(p);
  DeviceIn in(p.cfg, dev);
  in.upload(p, tscale);
  reset_status(in.st(), nullptr);
  plan_layout(p.cfg, in.layout_args(), nullptr);

  for (const Variant& v : all_variants()) {
    const std::int64_t block = fp8_scale_block_cols(v.scaling);
    if (c.H % (block > 0 ? block : 16) != 0) continue;
    SCOPED_TRACE(name_of(v));
    DeviceOut out(v, p.C, c.H);
    permute_forward_fp8(p.cfg, args_of(in, out, v, p.cfg), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    compare(p, v, out, reference_of(p, v, tscale));
    if (::testing::Test::HasFailure()) return;
  }
  const StatusReport s = read_status(in.st(), nullptr);
  // the capacity cases are ones that overflow (a factor's rows include L (A - 1) pad rows: c = 1 never does)
  if (c.capacity_factor > 0) EXPECT_GT(p.plan.overflow[0], 0) << "the case is meant to overflow";
  EXPECT_EQ(std::int64_t(s.raw.overflow_rows), p.plan.overflow[0]);
  if (c.bad_routing && c.T > 2) {
    EXPECT_EQ(s.raw.bad_expert_ids, 1u);
    EXPECT_LE(s.raw.bad_probs, 1u);
  } else {
    EXPECT_EQ(s.raw.bad_expert_ids + s.raw.bad_probs, 0u);
  }
}

TEST(PermuteFp8Gpu, MatchesQuantizeThenPermuteOnEdgeCases) {
  MOERAIL_REQUIRE_GPU();
  const std::vector<Case> cases = {
      {64, 0, 256, 8, 2, 16},                         // T = 0: nothing written
      {300, 300, 256, 8, 1, 16, 0, true},              // all tokens to one expert
      {300, 290, 384, 16, 4, 32, 0, true},             // all to one expert, A = 32, T < T_max
      {257, 250, 384, 96, 8, 16},                      // E not a power of two, T < T_max
      {256, 256, 7168, 64, 8, 128},                    // DeepSeek-V3 rows (448 chunks: a partial last step)
      {400, 400, 2048, 128, 8, 32},                    // Qwen3 rows, A = 32
      {200, 170, 1536, 24, 6, 16},                     // E = 24, T < T_max
      {1024, 1024, 256, 16, 4, 128, 0.5},              // capacity factor 0.5 with A = 128: overflow, rows dropped
      {333, 333, 128, 12, 3, 16, 0.6},                 // overflow, E = 12, one scale block per row
      {128, 100, 512, 10, 4, 32, 0, false, true},      // bad expert id and NaN prob: skipped, reported
      {96, 96, 96, 6, 2, 32},                          // H = 96: MXFP8 and per-tensor only (3 MX blocks per row)
      {64, 60, 48, 5, 2, 16},                          // H = 48: per-tensor only (3 chunks per row)
      {64, 64, 160, 7, 3, 16},                         // H = 160: MXFP8 (5 blocks) and per-tensor
  };
  std::uint64_t seed = 11;
  for (const Case& c : cases) run_case(c, seed++);
}

// plan_layout + both permute forms in one graph, replayed with new routing, data and counts.
TEST(PermuteFp8Gpu, GraphReplaysWithOtherRoutingAndTokenCounts) {
  MOERAIL_REQUIRE_GPU();
  const Case c{384, 384, 1024, 24, 4, 32, 0.9};
  int dev = 0;
  cudaGetDevice(&dev);
  Problem p;
  p.cfg = config_of(c);
  p.C = p.cfg.rows_per_rank();
  DeviceIn in(p.cfg, dev);
  const std::vector<Variant> vs = {{Source::Quantize, Fp8Scaling::Block1x128}, {Source::Move, Fp8Scaling::Mx1x32},
                                   {Source::Quantize, Fp8Scaling::PerTensor}};
  std::vector<DeviceOut> outs;
  for (const Variant& v : vs) outs.emplace_back(v, p.C, c.H);
  ref::Rng rng(99);
  make_inputs(p, c, rng);
  in.upload(p, tensor_scale_of(p));

  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  auto step = [&] {
    plan_layout(p.cfg, in.layout_args(), s);
    for (std::size_t i = 0; i < vs.size(); ++i) permute_forward_fp8(p.cfg, args_of(in, outs[i], vs[i], p.cfg), s);
  };
  reset_status(in.st(), s);
  step();  // eager once: the launchers' one-time setup (occupancy queries) happens outside capture
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  step();
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  const std::vector<std::int64_t> counts = {c.T_max, 0, 17, 1, 250, c.T_max};
  for (std::size_t r = 0; r < counts.size(); ++r) {
    Case cr = c;
    cr.T = counts[r];
    SCOPED_TRACE("replay " + std::to_string(r) + " T=" + std::to_string(cr.T));
    make_inputs(p, cr, rng);
    const float tscale = tensor_scale_of(p);
    in.upload(p, tscale);
    for (const DeviceOut& o : outs)
      for (const DeviceTensor* t : {&o.recv, &o.scales, &o.probs}) t->poison();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // uploads and poison land before the non-blocking stream runs
    reset_status(in.st(), s);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    for (std::size_t i = 0; i < vs.size(); ++i) {
      SCOPED_TRACE(name_of(vs[i]));
      compare(p, vs[i], outs[i], reference_of(p, vs[i], tscale));
    }
    const StatusReport st = read_status(in.st(), nullptr);
    EXPECT_EQ(std::int64_t(st.raw.overflow_rows), p.plan.overflow[0]);
    if (::testing::Test::HasFailure()) break;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST(PermuteFp8Gpu, ArgumentErrorsNameTheArgument) {
  MOERAIL_REQUIRE_GPU();
  int dev = 0;
  cudaGetDevice(&dev);
  const Case c{32, 32, 192, 8, 2, 16};  // H = 192: a multiple of 32 and 16, not of 128
  Problem p;
  p.cfg = config_of(c);
  p.C = p.cfg.rows_per_rank();
  DeviceIn in(p.cfg, dev);
  auto expect_error = [&](const PermuteFp8Args& a, const std::string& needle) {
    try {
      permute_forward_fp8(p.cfg, a, nullptr);
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const Variant mx{Source::Move, Fp8Scaling::Mx1x32};
  DeviceOut out_mx(mx, p.C, c.H);
  DeviceTensor recv(DType::F8E4M3, {p.C, c.H}), scales(DType::F32, {p.C, 1});
  {
    PermuteFp8Args a = args_of(in, out_mx, mx, p.cfg);
    a.scaling = Fp8Scaling::Block1x128;
    a.q = {};
    a.q_scales = {};
    a.x = in.x.view();
    a.recv_scales = scales.view();
    expect_error(a, "x has 192 columns but 1x128 blockwise scaling needs a multiple of 128");
  }
  {
    PermuteFp8Args a = args_of(in, out_mx, mx, p.cfg);
    a.x = in.x.view();
    expect_error(a, "x is given and q is given");
  }
  {
    PermuteFp8Args a = args_of(in, out_mx, {Source::Quantize, Fp8Scaling::PerTensor}, p.cfg);
    a.tensor_scale = {};
    expect_error(a, "tensor_scale");
  }
  {
    PermuteFp8Args a = args_of(in, out_mx, mx, p.cfg);
    recv.set_offset(8);
    a.recv = recv.view();
    try {
      permute_forward_fp8(p.cfg, a, nullptr);
      ADD_FAILURE() << "a misaligned recv was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Unsupported);
      EXPECT_NE(std::string(e.what()).find("recv at address"), std::string::npos) << e.what();
    }
  }
  {
    PermuteFp8Args a = args_of(in, out_mx, mx, p.cfg);
    a.recv_scales = out_mx.scales.view_as({p.C - 1, c.H / 32});
    expect_error(a, "recv_scales has");
  }
  {
    PermuteFp8Args a = args_of(in, out_mx, {Source::Move, Fp8Scaling::PerTensor}, p.cfg);
    a.recv_scales = out_mx.scales.view_as({p.C, c.H / 32});
    expect_error(a, "recv_scales is given but per-tensor scaling has no per-row scales");
  }
}

}  // namespace
}  // namespace moerail
