// `moerail bench mlp`: the grouped expert MLP (src/experts) on the issue's shapes, forward and backward TFLOP/s,
// beside the dense bf16 GEMM rate (cuBLAS 8192^3, the ceiling) and torch._grouped_mm on the same shapes (the
// baseline, measured in the same run by bench/torch_grouped_mm.py when python3 with torch is available).
//
// FLOP model (docs/experts.md): over the R rows of the segments (padding rows included: they are computed),
//   forward  2 R H F1 (FC1) + 2 R F H (FC2)                      (activation and bias not counted)
//   backward 2 R H F (FC2 dgrad) + 2 R F1 H (FC1 dgrad) + 2 R H F (dW2) + 2 R F1 H (dW1) = 2 x forward.
// Each case: verify a few rows of two experts against the CPU reference (single-expert slices), warm up, time
// with CUDA events, report the median. Working sets are GBs (weights alone exceed L2), so no input rotation.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "bench.h"
#include "bench_gpu.cuh"
#include "bench_mlp.h"
#include "commands.h"
#include "core/cuda_check.h"
#include "experts/mlp_tuning.h"
#include "moerail/config.h"
#include "moerail/error.h"
#include "moerail/experts.h"
#include "moerail/reference/experts.h"
#include "moerail/reference/host.h"

namespace moerail::tools {
namespace {

using experts::kMlpStageActivation;
using experts::kMlpStageAll;
using experts::kMlpStageFc1;
using experts::kMlpStageFc2;
using experts::kMlpStageSetup;
using experts::MlpGemmTile;
using experts::forward_stages;  // a forward of some stages only, to time one GEMM


// torch._grouped_mm figures from bench/torch_grouped_mm.py (run once, before our buffers are allocated).
nlohmann::json run_torch_baseline(const std::string& cases, const BenchOptions& o) {
  const char* script = "bench/torch_grouped_mm.py";
  if (std::FILE* f = std::fopen(script, "r")) {
    std::fclose(f);
  } else {
    std::fprintf(stderr, "moerail bench mlp: %s not found (run from the repository root); no torch baseline\n", script);
    return nlohmann::json::array();
  }
  const std::string cmd = std::string("python3 ") + script + " --cases " + cases + " --tokens " +
                          std::to_string(o.tokens) + " --warmup " + std::to_string(o.warmup) + " --iters " +
                          std::to_string(o.iters) + " 2>/dev/null";
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return nlohmann::json::array();
  std::string out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int rc = pclose(p);
  try {
    nlohmann::json j = nlohmann::json::parse(out);
    if (rc == 0 && j.is_array()) return j;
  } catch (const std::exception&) {
  }
  std::fprintf(stderr, "moerail bench mlp: %s failed (exit %d; needs python3 with torch and a GPU); no torch baseline\n",
               script, rc);
  return nlohmann::json::array();
}

const nlohmann::json* torch_row(const nlohmann::json& rows, const std::string& case_name) {
  for (const auto& r : rows)
    if (r.value("case", "") == case_name) return &r;
  return nullptr;
}

std::string gpu_name() { return tools::gpu_name(cuda::current_device()); }

// Relative Frobenius error of got (device bf16 rows) against want (host f32).
double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num) / std::sqrt(std::max(den, 1e-300));
}

std::vector<double> bf16_rows(const void* dev, std::int64_t first, std::int64_t count, std::int64_t width) {
  std::vector<std::uint16_t> h(static_cast<std::size_t>(count * width));
  MOERAIL_CUDA_CHECK(cudaMemcpy(h.data(), static_cast<const std::uint16_t*>(dev) + first * width,
                                h.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<double> v(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) v[i] = bf16_bits_to_float(h[i]);
  return v;
}

// The state of one case: buffers and the MLP.
struct CaseRun {
  MoeConfig cfg;
  std::int64_t rows = 0, used = 0, H = 0, F = 0, F1 = 0, L = 0;
  std::vector<std::int64_t> counts;
  DeviceBuf x, probs, cnt, w1, w2, y, h1, act, dy, dx, dprobs, dh1, ws, dw1, dw2;

  CaseRun(const MoeConfig& c, std::int64_t rows_, std::vector<std::int64_t> counts_)
      : cfg(c), rows(rows_), H(c.hidden), F(c.ffn_hidden), F1(c.fc1_out()), L(c.local_experts()),
        counts(std::move(counts_)),
        x(std::size_t(rows * H * 2)), probs(std::size_t(rows * 4)), cnt(std::size_t(L * 8)),
        w1(std::size_t(L * F1 * H * 2)), w2(std::size_t(L * H * F * 2)), y(std::size_t(rows * H * 2)),
        h1(std::size_t(rows * F1 * 2)), act(std::size_t(rows * F * 2)), dy(std::size_t(rows * H * 2)),
        dx(std::size_t(rows * H * 2)), dprobs(std::size_t(rows * 4)), dh1(std::size_t(rows * F1 * 2)),
        ws(mlp_backward_workspace_bytes(c, rows)), dw1(std::size_t(L * F1 * H * 2)), dw2(std::size_t(L * H * F * 2)) {
    for (std::int64_t v : counts) used += v;
    MOERAIL_CUDA_CHECK(cudaMemcpy(cnt.p, counts.data(), std::size_t(L * 8), cudaMemcpyHostToDevice));
    // Random bf16 data on the device (GBs: a host generator would take minutes): uniform with the given stddev.
    fill_uniform_bf16(x.p, rows * H, 1.0f, 1);
    fill_uniform_bf16(dy.p, rows * H, 1.0f, 2);
    fill_uniform_bf16(w1.p, L * F1 * H, 1.0f / std::sqrt(float(H)), 3);
    fill_uniform_bf16(w2.p, L * H * F, 1.0f / std::sqrt(float(F)), 4);
    MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
    ref::Rng rng(42);
    std::vector<float> p(static_cast<std::size_t>(rows));
    for (auto& v : p) v = float(rng.uniform(0.1, 1.0));
    MOERAIL_CUDA_CHECK(cudaMemcpy(probs.p, p.data(), p.size() * 4, cudaMemcpyHostToDevice));
  }

  MlpWeights weights() const {
    MlpWeights w;
    w.w1 = w1.view(DType::BF16, {L, F1, H});
    w.w2 = w2.view(DType::BF16, {L, H, F});
    return w;
  }
  MlpForwardArgs fwd() const {
    MlpForwardArgs a;
    a.x = x.view(DType::BF16, {rows, H});
    a.probs = probs.view(DType::F32, {rows});
    a.counts = cnt.view(DType::I64, {L});
    a.weights = weights();
    a.y = y.view(DType::BF16, {rows, H});
    a.h1 = h1.view(DType::BF16, {rows, F1});
    a.act = act.view(DType::BF16, {rows, F});
    return a;
  }
  MlpBackwardArgs bwd() const {
    MlpBackwardArgs a;
    a.x = x.view(DType::BF16, {rows, H});
    a.probs = probs.view(DType::F32, {rows});
    a.counts = cnt.view(DType::I64, {L});
    a.weights = weights();
    a.h1 = h1.view(DType::BF16, {rows, F1});
    a.act = act.view(DType::BF16, {rows, F});
    a.dy = dy.view(DType::BF16, {rows, H});
    a.dx = dx.view(DType::BF16, {rows, H});
    a.d_probs = dprobs.view(DType::F32, {rows});
    a.d_h1 = dh1.view(DType::BF16, {rows, F1});
    a.workspace = ws.view(DType::BF16, {std::int64_t(ws.bytes / 2)});
    return a;
  }
  MlpBackwardDwArgs bwd_dw() const {
    MlpBackwardDwArgs a;
    a.x = x.view(DType::BF16, {rows, H});
    a.probs = probs.view(DType::F32, {rows});
    a.counts = cnt.view(DType::I64, {L});
    a.act = act.view(DType::BF16, {rows, F});
    a.dy = dy.view(DType::BF16, {rows, H});
    a.d_h1 = dh1.view(DType::BF16, {rows, F1});
    a.grads.dw1 = dw1.view(DType::BF16, {L, F1, H});
    a.grads.dw2 = dw2.view(DType::BF16, {L, H, F});
    return a;
  }

  // A few rows of expert e against the reference run on that expert alone (y, dx, d_probs); worst error.
  double verify_expert(std::int64_t e, std::int64_t k) const {
    std::int64_t start = 0;
    for (std::int64_t i = 0; i < e; ++i) start += counts[std::size_t(i)];
    k = std::min(k, counts[std::size_t(e)]);
    if (k == 0) return 0.0;
    MoeConfig one = cfg;
    one.num_experts = 1;
    one.ep_size = 1;
    one.topk = 1;
    one.router = RouterConfig{};
    auto host_bf16 = [](const void* dev, std::int64_t offset, std::initializer_list<std::int64_t> shape) {
      ref::HostTensor t(DType::BF16, shape);
      MOERAIL_CUDA_CHECK(cudaMemcpy(t.view().data(), static_cast<const std::uint16_t*>(dev) + offset,
                                    t.view().nbytes(), cudaMemcpyDeviceToHost));
      return t;
    };
    const ref::HostTensor hx = host_bf16(x.p, start * H, {k, H});
    const ref::HostTensor hdy = host_bf16(dy.p, start * H, {k, H});
    const ref::HostTensor hw1 = host_bf16(w1.p, e * F1 * H, {1, F1, H});
    const ref::HostTensor hw2 = host_bf16(w2.p, e * H * F, {1, H, F});
    ref::HostTensor hp(DType::F32, {k});
    MOERAIL_CUDA_CHECK(cudaMemcpy(hp.view().data(), static_cast<const float*>(probs.p) + start,
                                  std::size_t(k) * 4, cudaMemcpyDeviceToHost));
    ref::HostTensor ry(DType::F32, {k, H}), rdx(DType::F32, {k, H}), rdp(DType::F32, {k});
    const std::vector<std::int64_t> seg{k};
    const ref::ExpertWeights w{hw1.view(), TensorView(), hw2.view(), TensorView()};
    ref::experts_forward(one, {hx.view(), hp.view(), seg, w, ry.view()});
    ref::ExpertsBackwardArgs b;
    b.x = hx.view();
    b.probs = hp.view();
    b.rows_per_expert = seg;
    b.weights = w;
    b.dy = hdy.view();
    b.dx = rdx.view();
    b.d_probs = rdp.view();
    ref::experts_backward(one, b);
    std::vector<double> gdp(static_cast<std::size_t>(k));
    std::vector<float> tmp(static_cast<std::size_t>(k));
    MOERAIL_CUDA_CHECK(cudaMemcpy(tmp.data(), static_cast<const float*>(dprobs.p) + start, std::size_t(k) * 4,
                                  cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < tmp.size(); ++i) gdp[i] = tmp[i];
    return std::max({rel_err(bf16_rows(y.p, start, k, H), ry.floats()),
                     rel_err(bf16_rows(dx.p, start, k, H), rdx.floats()), rel_err(gdp, rdp.floats())});
  }
};

// Every expert GEMM on both compiled tiles (src/experts/tiles.h), against which the library's choice can be
// checked: four GroupedMlp instances take the four (first, second) tile pairs of each pass (FC1/FC2, the two
// dgrads, the two wgrads); each pass's variants are timed alternating in one loop. Times in us; keys "coop"/"ping"
// for FC1 and FC2, "<first>/<second>" for the pairs (dgrad: FC2's then FC1's; wgrad: dW2 then dW1).
nlohmann::json tile_sweep(const BenchOptions& o, cudaStream_t s, const MoeConfig& cfg, const MlpOptions& base,
                          const CaseRun& run, const std::string& case_name) {
  auto tile = [](int ping) { return ping ? MlpGemmTile::Pingpong128x128 : MlpGemmTile::Cooperative128x256; };
  experts::MlpTuning tunings[4];
  const char* names[] = {"coop", "ping"};
  std::vector<std::unique_ptr<GroupedMlp>> m;
  for (int i = 0; i < 4; ++i) {
    MlpOptions mo = base;
    mo.activation = MlpActivation::Separate;       // GEMMs only
    mo.contiguous_gemms = MlpContiguous::Off;      // the grouped kernels' tiles (tiles.h); contig_compare has those
    experts::MlpTuning& t = tunings[i];
    t.fc1 = t.dgrad_fc2 = t.wgrad_fc2 = tile(i & 1);
    t.fc2 = t.dgrad_fc1 = t.wgrad_fc1 = tile(i >> 1);
    mo.tuning = &t;
    m.push_back(std::make_unique<GroupedMlp>(cfg, mo));
    m.back()->forward(run.fwd(), s);  // setup arrays and h1/act for the stage runs
  }
  auto pass = [&](const std::vector<int>& which, auto&& call) {
    std::vector<std::function<void()>> f;
    for (int i : which) f.push_back([&, i] { call(*m[std::size_t(i)]); });
    return alternating_medians_us(o, s, f);
  };
  const auto fc1 = pass({0, 1}, [&](GroupedMlp& g) { forward_stages(g, run.fwd(), kMlpStageFc1, s); });
  const auto fc2 = pass({0, 2}, [&](GroupedMlp& g) { forward_stages(g, run.fwd(), kMlpStageFc2, s); });
  const auto dgrad = pass({0, 1, 2, 3}, [&](GroupedMlp& g) { g.backward(run.bwd(), s); });
  const auto wgrad = pass({0, 1, 2, 3}, [&](GroupedMlp& g) { g.backward_dw(run.bwd_dw(), s); });
  nlohmann::json j = {{"fc1_us", {{names[0], fc1[0]}, {names[1], fc1[1]}}},
                      {"fc2_us", {{names[0], fc2[0]}, {names[1], fc2[1]}}}};
  std::string line = "bench mlp " + case_name + " tiles (us):";
  char buf[160];
  std::snprintf(buf, sizeof buf, " FC1 coop %.0f ping %.0f | FC2 coop %.0f ping %.0f", fc1[0], fc1[1], fc2[0], fc2[1]);
  line += buf;
  for (const auto& [key, t] : {std::pair{"dgrad_us", dgrad}, std::pair{"wgrad_us", wgrad}}) {
    line += std::string(" | ") + key;
    for (int i = 0; i < 4; ++i) {
      const std::string k = std::string(names[i & 1]) + "/" + names[i >> 1];
      j[key][k] = t[std::size_t(i)];
      std::snprintf(buf, sizeof buf, " %s %.0f", k.c_str(), t[std::size_t(i)]);
      line += buf;
    }
  }
  std::fprintf(stderr, "%s\n", line.c_str());
  return j;
}

// The contiguous GEMMs (MlpOptions::contiguous_gemms) against the grouped ones, on the case's counts made multiples
// of `align` (the case's own alignment, or 128: whole tiles): outputs checked bit for bit, then FC1, FC2, the
// data-gradient pass and the weight gradients of the two timed alternating in one loop. The case's counts are
// restored after.
nlohmann::json contig_compare(const BenchOptions& o, cudaStream_t s, const MoeConfig& cfg, const MlpOptions& base,
                              CaseRun& run, const std::string& case_name, bool zipf, std::int64_t align) {
  const std::vector<std::int64_t> counts = mlp_case_counts(run.L, run.rows, align, zipf);
  std::int64_t used = 0;
  for (std::int64_t v : counts) used += v;
  MOERAIL_CUDA_CHECK(cudaMemcpy(run.cnt.p, counts.data(), counts.size() * 8, cudaMemcpyHostToDevice));
  MlpOptions grouped_opt = base, contig_opt = base;
  grouped_opt.activation = contig_opt.activation = MlpActivation::Separate;  // GEMMs only
  grouped_opt.activation_backward = contig_opt.activation_backward = MlpActivation::Separate;
  contig_opt.contiguous_gemms = MlpContiguous::On;
  grouped_opt.contiguous_gemms = MlpContiguous::Off;
  GroupedMlp grouped(cfg, grouped_opt), contig(cfg, contig_opt);

  // Same tile, same reduction order: the same bits in y and dx (which depend on every other output), dW1 and dW2.
  const std::size_t y_bytes = std::size_t(used * run.H) * 2;
  std::vector<unsigned char> want, got;
  for (int pass = 0; pass < 2; ++pass) {
    GroupedMlp& m = pass == 0 ? grouped : contig;
    std::vector<unsigned char>& out = pass == 0 ? want : got;
    for (const DeviceBuf* b : {&run.y, &run.dx, &run.h1, &run.act, &run.dh1, &run.ws, &run.dw1, &run.dw2})
      MOERAIL_CUDA_CHECK(cudaMemsetAsync(b->p, 0xff, b->bytes, s));  // every output: NaN
    m.forward(run.fwd(), s);
    m.backward(run.bwd(), s);
    m.backward_dw(run.bwd_dw(), s);
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
    for (const auto& [p, bytes] : {std::pair{run.y.p, y_bytes}, std::pair{run.dx.p, y_bytes},
                                   std::pair{run.dw1.p, run.dw1.bytes}, std::pair{run.dw2.p, run.dw2.bytes}}) {
      const std::size_t at = out.size();
      out.resize(at + bytes);
      MOERAIL_CUDA_CHECK(cudaMemcpy(out.data() + at, p, bytes, cudaMemcpyDeviceToHost));
    }
  }
  if (o.verify && want != got)
    fail_with(ErrorCode::Internal, "moerail bench mlp", case_name,
              ": the contiguous GEMMs' y, dx, dW1 or dW2 differ from the grouped GEMMs'");

  auto pair = [&](auto&& call) {
    return alternating_medians_us(o, s, {[&] { call(grouped); }, [&] { call(contig); }});
  };
  const auto fc1 = pair([&](GroupedMlp& m) { forward_stages(m, run.fwd(), kMlpStageFc1, s); });
  const auto fc2 = pair([&](GroupedMlp& m) { forward_stages(m, run.fwd(), kMlpStageFc2, s); });
  const auto dgrad = pair([&](GroupedMlp& m) { m.backward(run.bwd(), s); });
  const auto wgrad = pair([&](GroupedMlp& m) { m.backward_dw(run.bwd_dw(), s); });
  MOERAIL_CUDA_CHECK(cudaMemcpy(run.cnt.p, run.counts.data(), run.counts.size() * 8, cudaMemcpyHostToDevice));

  const double R = double(used);
  const double fc1_flop = 2 * R * double(run.H) * double(run.F1), fc2_flop = 2 * R * double(run.F) * double(run.H);
  auto tf = [](double flop, double us) { return us > 0 ? flop / (us * 1e6) : 0.0; };
  std::fprintf(stderr,
               "bench mlp %s contiguous vs grouped (%lld rows, counts multiples of %lld, us): FC1 %.0f vs %.0f (%.0f "
               "vs %.0f TFLOP/s) | FC2 %.0f vs %.0f (%.0f vs %.0f) | dgrad pass %.0f vs %.0f | wgrads %.0f vs %.0f "
               "(%.0f vs %.0f)\n",
               case_name.c_str(), static_cast<long long>(used), static_cast<long long>(align), fc1[1], fc1[0],
               tf(fc1_flop, fc1[1]), tf(fc1_flop, fc1[0]), fc2[1], fc2[0], tf(fc2_flop, fc2[1]), tf(fc2_flop, fc2[0]),
               dgrad[1], dgrad[0], wgrad[1], wgrad[0], tf(fc1_flop + fc2_flop, wgrad[1]),
               tf(fc1_flop + fc2_flop, wgrad[0]));
  return {{"rows_in_segments", used},
          {"count_multiple", align},
          {"fc1_us", {{"grouped", fc1[0]}, {"contiguous", fc1[1]}}},
          {"fc2_us", {{"grouped", fc2[0]}, {"contiguous", fc2[1]}}},
          {"dgrad_pass_us", {{"grouped", dgrad[0]}, {"contiguous", dgrad[1]}}},
          {"wgrad_us", {{"grouped", wgrad[0]}, {"contiguous", wgrad[1]}}},
          {"wgrad_tflops",
           {{"grouped", tf(fc1_flop + fc2_flop, wgrad[0])}, {"contiguous", tf(fc1_flop + fc2_flop, wgrad[1])}}},
          {"fc1_tflops", {{"grouped", tf(fc1_flop, fc1[0])}, {"contiguous", tf(fc1_flop, fc1[1])}}},
          {"fc2_tflops", {{"grouped", tf(fc2_flop, fc2[0])}, {"contiguous", tf(fc2_flop, fc2[1])}}}};
}

// One case (preset, routing) of `bench mlp`: its buffers, the MLP as the library configures it, and the FLOPs of its
// passes. The variants below run in the order bench_case calls them, each verifying what it times first.
struct MlpBench {
  const BenchOptions& o;
  cudaStream_t s;
  const MlpCase& c;
  bool zipf;
  MoeConfig cfg;
  std::int64_t rows;
  std::string name;  // the rows' case
  CaseRun run;
  MlpOptions mo;     // the library's defaults (the rows as a hint)
  GroupedMlp mlp;
  double fc1_flop = 0, fc2_flop = 0, fwd_flop = 0;  // over the rows of the segments (padding rows included)

  static MlpOptions with_rows_hint(std::int64_t rows) {
    MlpOptions m;
    m.rows_hint = rows;
    return m;
  }

  MlpBench(const BenchOptions& o_, cudaStream_t s_, const MlpCase& c_, bool zipf_)
      : o(o_), s(s_), c(c_), zipf(zipf_), cfg(mlp_case_config(c_)), rows(mlp_case_rows(c_, cfg, o_)),
        name(std::string(c_.preset) + (zipf_ ? "-zipf" : "")),
        run(cfg, rows, mlp_case_counts(c_.L, rows, cfg.align, zipf_)), mo(with_rows_hint(rows)), mlp(cfg, mo) {
    const double R = double(run.used), H = double(run.H), F = double(run.F), F1 = double(run.F1);
    fc1_flop = 2 * R * H * F1;
    fc2_flop = 2 * R * F * H;
    fwd_flop = fc1_flop + fc2_flop;
  }

  void fc1() { forward_stages(mlp, run.fwd(), kMlpStageFc1, s); }  // FC1 alone: the stage most variants time beside
};

double tflops(double flop, double us) { return us > 0 ? flop / (us * 1e6) : 0.0; }

// One forward and backward, then a few rows of the first and last non-empty expert against the CPU reference.
double verify_case(MlpBench& k) {
  k.mlp.forward(k.run.fwd(), k.s);
  k.mlp.backward(k.run.bwd(), k.s);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(k.s));
  std::int64_t last = k.c.L - 1;
  while (last > 0 && k.run.counts[std::size_t(last)] == 0) --last;
  const double err = k.o.verify ? std::max(k.run.verify_expert(0, 16), k.run.verify_expert(last, 16)) : 0.0;
  if (k.o.verify && !(err < 1e-2))
    fail_with(ErrorCode::Internal, "moerail bench mlp", k.name, ": verification failed, relative error ", err,
              " (expected < 1e-2)");
  return err;
}

// The weight gradients written (as configured) against added to the gradients already there
// (MlpGrads::accumulate, on the contiguous kernel), bf16 and fp32 (Megatron-LM's fp32 main_grad), alternating in
// one loop.
std::vector<double> wgrad_accumulate_us(MlpBench& k) {
  CaseRun& run = k.run;
  DeviceBuf dw1_f32(std::size_t(run.L * run.F1 * run.H * 4)), dw2_f32(std::size_t(run.L * run.H * run.F * 4));
  MOERAIL_CUDA_CHECK(cudaMemset(dw1_f32.p, 0, dw1_f32.bytes));
  MOERAIL_CUDA_CHECK(cudaMemset(dw2_f32.p, 0, dw2_f32.bytes));
  auto accumulated = [&](bool f32) {
    MlpBackwardDwArgs a = run.bwd_dw();
    a.grads.accumulate = true;
    if (f32) {
      a.grads.dw1 = dw1_f32.view(DType::F32, {run.L, run.F1, run.H});
      a.grads.dw2 = dw2_f32.view(DType::F32, {run.L, run.H, run.F});
    }
    k.mlp.backward_dw(a, k.s);
  };
  return alternating_medians_us(k.o, k.s, {[&] { k.mlp.backward_dw(run.bwd_dw(), k.s); }, [&] { accumulated(false); },
                                           [&] { accumulated(true); }});
}

// The rows' own figures: each pass of the MLP as the library configures it, in a loop of its own.
struct PassTimes {
  double fc1 = 0, fc1_act = 0, fc1_seq = 0, act_seq = 0, fc2 = 0, fwd = 0, dgrad = 0, wgrad = 0, bwd = 0;
  std::vector<double> wgrad_acc;  // wgrad_accumulate_us
};

PassTimes time_passes(MlpBench& k) {
  const BenchOptions& o = k.o;
  cudaStream_t s = k.s;
  GroupedMlp& mlp = k.mlp;
  const CaseRun& run = k.run;
  PassTimes t;
  t.fc1 = median_us(o, s, [&](int) { k.fc1(); });
  t.fc1_act = median_us(o, s, [&](int) { forward_stages(mlp, run.fwd(), kMlpStageFc1 | kMlpStageActivation, s); });
  // The activation's cost over FC1 alone, measured in one loop: FC1 then the pass, each between its own events.
  // (FC1 alone and FC1 + pass timed in separate loops differ by up to ~10% run to run from the GPU's power state
  // alone, more than the pass costs; the slowdown is therefore pass / FC1 of the same iterations.)
  std::tie(t.fc1_seq, t.act_seq) =
      split_median_us(o, s, [&] { k.fc1(); }, [&] { forward_stages(mlp, run.fwd(), kMlpStageActivation, s); });
  t.fc2 = median_us(o, s, [&](int) { forward_stages(mlp, run.fwd(), kMlpStageFc2, s); });
  t.fwd = median_us(o, s, [&](int) { mlp.forward(run.fwd(), s); });
  t.dgrad = median_us(o, s, [&](int) { mlp.backward(run.bwd(), s); });
  t.wgrad = median_us(o, s, [&](int) { mlp.backward_dw(run.bwd_dw(), s); });
  t.wgrad_acc = wgrad_accumulate_us(k);
  t.bwd = median_us(o, s, [&](int) {
    mlp.backward(run.bwd(), s);
    mlp.backward_dw(run.bwd_dw(), s);
  });
  return t;
}

// FC1 with the activation in its epilogue, beside the plain FC1 and FC1 then the pass (us, medians of one loop);
// all zero where the case has no GLU the fused epilogue takes.
struct FusedFc1 {
  static constexpr std::int64_t kBlock = 32;  // the GLU halves interleaved in blocks of this many rows
  double fused = 0, beside_fused = 0, other = 0, pass_beside_fused = 0;
  std::string gemm;        // GroupedMlp::describe()'s fc1 entry of the fused MLP
  std::string other_gemm;  // the fused FC1 on the other tile (describe()'s fc1 entry)
};

// The activation fused into FC1's epilogue (glu_epilogue.cuh) needs the GLU halves interleaved: time it on the
// same buffers with the layout read as interleaved in blocks of 32, after checking it against the separate pass
// on that layout bit for bit. Forced on (MlpActivation::Fused) whatever Auto would choose for this shape; timed
// alternating with the plain FC1 in one loop, for the same reason as above, and with FC1 followed by the pass
// (what MlpActivation::Auto chooses between). The fused FC1 runs on the tile Auto gives it; the fused FC1 on the
// other tile (ping-pong or cooperative, the latter always grouped) joins the loop, so that the rule of
// tiles.h's fused_fc1_tile can rest on it.
FusedFc1 fused_fc1_compare(MlpBench& k) {
  FusedFc1 r;
  const MoeConfig& cfg = k.cfg;
  if (!(is_glu(cfg.activation) && cfg.ffn_hidden % FusedFc1::kBlock == 0)) return r;
  cudaStream_t s = k.s;
  const CaseRun& run = k.run;
  MoeConfig ci = cfg;
  ci.glu_layout = GluLayout::Interleaved;
  ci.glu_block = FusedFc1::kBlock;
  MlpOptions fused_opt = k.mo, pass_opt = k.mo;
  fused_opt.activation = MlpActivation::Fused;
  pass_opt.activation = MlpActivation::Separate;
  GroupedMlp fused(ci, fused_opt), pass(ci, pass_opt);
  const MlpForwardArgs f = run.fwd();
  constexpr unsigned f_stages = kMlpStageSetup | kMlpStageFc1 | kMlpStageActivation;
  const std::size_t bytes = std::size_t(run.used) * std::size_t(run.F) * 2;
  std::vector<unsigned char> want(bytes), got(bytes);
  forward_stages(pass, f, f_stages, s);
  MOERAIL_CUDA_CHECK(cudaMemcpyAsync(want.data(), f.act.data(), bytes, cudaMemcpyDeviceToHost, s));
  MOERAIL_CUDA_CHECK(cudaMemsetAsync(f.act.data(), 0xff, bytes, s));
  forward_stages(fused, f, f_stages, s);
  MOERAIL_CUDA_CHECK(cudaMemcpyAsync(got.data(), f.act.data(), bytes, cudaMemcpyDeviceToHost, s));
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  if (k.o.verify && std::memcmp(want.data(), got.data(), bytes) != 0)
    fail_with(ErrorCode::Internal, "moerail bench mlp", k.name,
              ": the fused activation epilogue differs from the activation pass");
  const std::string d = fused.describe();
  r.gemm = d.substr(0, d.find(' '));
  std::vector<std::function<void()>> timed = {
      [&] { k.fc1(); }, [&] { forward_stages(fused, run.fwd(), kMlpStageFc1, s); },
      [&] { forward_stages(pass, run.fwd(), kMlpStageFc1 | kMlpStageActivation, s); }};
  std::unique_ptr<GroupedMlp> fused_other;
  {
    MlpOptions other_opt = fused_opt;
    experts::MlpTuning other_tiles;
    other_tiles.fc1 = r.gemm.find("coop") != std::string::npos ? MlpGemmTile::Pingpong128x128
                                                               : MlpGemmTile::Cooperative128x256;
    other_opt.tuning = &other_tiles;
    fused_other = std::make_unique<GroupedMlp>(ci, other_opt);
    forward_stages(*fused_other, f, f_stages, s);  // its setup stage: the timed calls run FC1 alone
    const std::string od = fused_other->describe();
    r.other_gemm = od.substr(0, od.find(' '));
    timed.push_back([&] { forward_stages(*fused_other, run.fwd(), kMlpStageFc1, s); });
  }
  const std::vector<double> us = alternating_medians_us(k.o, s, timed);
  r.beside_fused = us[0];
  r.fused = us[1];
  r.pass_beside_fused = us[2];
  r.other = us[3];
  return r;
}

// The activation backward in FC2's dgrad epilogue (MlpOptions::activation_backward = Fused, where the case allows
// it) against the pass: the data gradients of both, alternating in one loop, after checking that dx (which d_h1
// feeds) is equal bit for bit. Both run FC2's dgrad contiguously (the fused epilogue exists only there): where
// `Auto` would run it grouped (mixtral), the pass side is a contiguous MLP of its own, so that the comparison
// covers one more reduction length (K = H) and the choice of `Auto` can rest on it. Null where the case refuses it.
nlohmann::json activation_backward_compare(MlpBench& k) {
  cudaStream_t s = k.s;
  const CaseRun& run = k.run;
  std::unique_ptr<GroupedMlp> fused_bwd, contig_pass;
  {
    MlpOptions fused_opt = k.mo, pass_opt = k.mo;
    fused_opt.activation_backward = MlpActivation::Fused;
    pass_opt.activation_backward = MlpActivation::Separate;
    fused_opt.contiguous_gemms = pass_opt.contiguous_gemms = MlpContiguous::On;
    try {
      fused_bwd = std::make_unique<GroupedMlp>(k.cfg, fused_opt);
      contig_pass = std::make_unique<GroupedMlp>(k.cfg, pass_opt);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::Unsupported) throw;
      fused_bwd.reset();
    }
  }
  if (!fused_bwd) return nullptr;
  GroupedMlp& pass = *contig_pass;
  const std::size_t bytes = std::size_t(run.used) * std::size_t(run.H) * 2;
  std::vector<unsigned char> want(bytes), got(bytes);
  const MlpBackwardArgs ba = run.bwd();
  pass.forward(run.fwd(), s);  // the saved h1 and act are the same bits whichever MLP wrote them
  pass.backward(ba, s);
  MOERAIL_CUDA_CHECK(cudaMemcpyAsync(want.data(), ba.dx.data(), bytes, cudaMemcpyDeviceToHost, s));
  MOERAIL_CUDA_CHECK(cudaMemsetAsync(ba.dx.data(), 0xff, bytes, s));
  fused_bwd->backward(ba, s);
  MOERAIL_CUDA_CHECK(cudaMemcpyAsync(got.data(), ba.dx.data(), bytes, cudaMemcpyDeviceToHost, s));
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  if (k.o.verify && std::memcmp(want.data(), got.data(), bytes) != 0)
    fail_with(ErrorCode::Internal, "moerail bench mlp", k.name,
              ": dx with the activation backward in FC2's dgrad epilogue differs from dx with the pass");
  const auto [fused_us, pass_us] =
      split_median_us(k.o, s, [&] { fused_bwd->backward(run.bwd(), s); }, [&] { pass.backward(run.bwd(), s); });
  std::fprintf(stderr, "bench mlp %s: data gradients with the activation backward in FC2's dgrad epilogue %.1f us, "
               "with the pass %.1f us (%+.1f%%; both contiguous, K = H = %lld)\n", k.name.c_str(), fused_us,
               pass_us, 100.0 * (fused_us / pass_us - 1.0), static_cast<long long>(run.H));
  return {{"fused_us", fused_us}, {"pass_us", pass_us}, {"k", run.H},
          {"auto_fuses", k.mlp.describe().find("+actbwd") != std::string::npos}};
}

// The case's passes beside the dense GEMM (the ceiling), medians of loops that alternate them.
struct BesideDense {
  double dense_us = 0, fc1_us = 0;  // the dense GEMM and FC1, alternating
  double dense_tflops = 0, fc1_tflops = 0;
  std::vector<double> all;  // dense, FC1, FC2, data gradients, weight gradients, in one loop
};

// The ceiling again, alternating with this case's FC1 in one loop: the dense rate in the power state of this
// case's GEMMs (the run's first dense figure moves by up to ~10% between runs while the GEMMs move by a few %).
// Last, so that the figures above are timed as before: a loop right after it finds the GPU hotter (H200: the
// deepseek-v3 FC2 timed after it measured 541 instead of ~650 TFLOP/s).
BesideDense time_beside_dense(MlpBench& k, DenseGemm& dense_gemm) {
  BesideDense b;
  std::tie(b.dense_us, b.fc1_us) = split_median_us(k.o, k.s, [&] { dense_gemm.launch(); }, [&] { k.fc1(); });
  // Every GEMM pass of the case and the dense GEMM in one loop (dense, FC1, FC2, data gradients, weight gradients,
  // events between them): the shares of the dense rate that the targets ask for, all in one power state. Whole
  // loops of the same work move by up to ~7% from one loop to the next on an H200 (the backward alone, in two loops
  // of one run: 4363 and 4680 us), more than the gaps to the targets; the dense GEMM between the passes moves with
  // them.
  b.all = alternating_medians_us(
      k.o, k.s, {[&] { dense_gemm.launch(); }, [&] { k.fc1(); },
                 [&] { forward_stages(k.mlp, k.run.fwd(), kMlpStageFc2, k.s); },
                 [&] { k.mlp.backward(k.run.bwd(), k.s); }, [&] { k.mlp.backward_dw(k.run.bwd_dw(), k.s); }});
  b.dense_tflops = tflops(DenseGemm::kFlop, b.dense_us);
  b.fc1_tflops = tflops(k.fc1_flop, b.fc1_us);
  return b;
}

// The config of the case's rows: every figure above.
nlohmann::json case_config(const MlpBench& k, double err, const PassTimes& t, const FusedFc1& fused,
                           const nlohmann::json& act_bwd, const nlohmann::json& tiles, const nlohmann::json& contig,
                           const BesideDense& b) {
  const double fc1_flop = k.fc1_flop, fc2_flop = k.fc2_flop, fwd_flop = k.fwd_flop;
  const std::vector<double>& beside = b.all;
  nlohmann::json config = {{"preset", k.c.preset}, {"routing", k.zipf ? "zipf-1.2" : "balanced"},
                           {"experts", k.c.L}, {"hidden", k.run.H}, {"ffn", k.run.F}, {"fc1_out", k.run.F1},
                           {"rows", k.rows}, {"rows_in_segments", k.run.used}, {"align", k.cfg.align},
                           {"activation", std::string(name_of(k.cfg.activation))}, {"kernels", k.mlp.describe()},
                           {"fc1_tflops", tflops(fc1_flop, t.fc1)}, {"fc1_act_tflops", tflops(fc1_flop, t.fc1_act)},
                           {"fc1_act_slowdown_pct", 100.0 * t.act_seq / t.fc1_seq},
                           {"fc1_then_act_us", {t.fc1_seq, t.act_seq}},
                           {"fc2_tflops", tflops(fc2_flop, t.fc2)}, {"dgrad_tflops", tflops(fwd_flop, t.dgrad)},
                           {"wgrad_tflops", tflops(fwd_flop, t.wgrad)},
                           {"wgrad_written_vs_accumulated_us", {t.wgrad_acc[0], t.wgrad_acc[1]}},
                           {"wgrad_accumulated_f32_us", t.wgrad_acc[2]},
                           {"tile_sweep", tiles}, {"contiguous", contig},
                           {"dense_beside_fc1_tflops", b.dense_tflops}, {"fc1_beside_dense_tflops", b.fc1_tflops},
                           {"one_loop_with_dense",
                            {{"dense_tflops", tflops(DenseGemm::kFlop, beside[0])},
                             {"fc1_tflops", tflops(fc1_flop, beside[1])}, {"fc2_tflops", tflops(fc2_flop, beside[2])},
                             {"bwd_tflops", tflops(2 * fwd_flop, beside[3] + beside[4])},
                             {"us", {beside[0], beside[1], beside[2], beside[3], beside[4]}}}},
                           {"verify_rel_err", err}};
  if (!act_bwd.is_null()) config["activation_backward"] = act_bwd;
  if (fused.fused > 0) {
    config["fc1_act_fused_glu_block"] = FusedFc1::kBlock;
    config["fc1_act_fused_tflops"] = tflops(fc1_flop, fused.fused);
    config["fc1_act_fused_slowdown_pct"] = 100.0 * (fused.fused / fused.beside_fused - 1.0);
    config["fc1_act_fused_gemm"] = fused.gemm;
    if (fused.other > 0) {
      config["fc1_act_fused_other_gemm"] = fused.other_gemm;
      config["fc1_act_fused_other_slowdown_pct"] = 100.0 * (fused.other / fused.beside_fused - 1.0);
    }
    config["fc1_act_pass_beside_fused_slowdown_pct"] = 100.0 * (fused.pass_beside_fused / fused.beside_fused - 1.0);
  }
  return config;
}

// The case's figures beside the dense GEMM, of the weight gradients and of the activation, on stderr.
void print_case(const MlpBench& k, const PassTimes& t, const FusedFc1& fused, const BesideDense& b) {
  const char* name = k.name.c_str();
  std::fprintf(stderr, "bench mlp %s: dense bf16 GEMM beside FC1 %.1f TFLOP/s (FC1 %.1f TFLOP/s, %.1f%% of it)\n",
               name, b.dense_tflops, b.fc1_tflops, 100.0 * b.fc1_tflops / b.dense_tflops);
  {
    const std::vector<double>& beside = b.all;
    const double d = tflops(DenseGemm::kFlop, beside[0]), f1 = tflops(k.fc1_flop, beside[1]),
                 f2 = tflops(k.fc2_flop, beside[2]), bw = tflops(2 * k.fwd_flop, beside[3] + beside[4]);
    std::fprintf(stderr, "bench mlp %s, one loop with the dense GEMM: dense %.1f TFLOP/s, FC1 %.1f (%.1f%%), FC2 %.1f "
                 "(%.1f%%), backward %.1f (%.1f%%; data gradients %.1f us, weight gradients %.1f us)\n",
                 name, d, f1, 100 * f1 / d, f2, 100 * f2 / d, bw, 100 * bw / d, beside[3], beside[4]);
  }
  const std::vector<double>& acc = t.wgrad_acc;
  std::fprintf(stderr, "bench mlp %s: weight gradients written %.1f us, accumulated %.1f us (%+.1f%%), into fp32 "
               "%.1f us (%+.1f%%)\n", name, acc[0], acc[1], 100.0 * (acc[1] / acc[0] - 1), acc[2],
               100.0 * (acc[2] / acc[0] - 1));
  std::fprintf(stderr, "bench mlp %s: FC1 %.1f us then the activation pass %.1f us (%+.1f%%)", name, t.fc1_seq,
               t.act_seq, 100.0 * t.act_seq / t.fc1_seq);
  if (fused.fused > 0) {
    std::fprintf(stderr, "; FC1 %.1f us beside FC1 with the activation in its epilogue (GLU interleaved by %lld, "
                 "%s) %.1f us (%+.1f%%)", fused.beside_fused, static_cast<long long>(FusedFc1::kBlock),
                 fused.gemm.c_str(), fused.fused, 100.0 * (fused.fused / fused.beside_fused - 1.0));
    if (fused.other > 0)
      std::fprintf(stderr, ", as %s %.1f us (%+.1f%%)", fused.other_gemm.c_str(), fused.other,
                   100.0 * (fused.other / fused.beside_fused - 1.0));
    std::fprintf(stderr, ", FC1 then the pass %.1f us (%+.1f%%)", fused.pass_beside_fused,
                 100.0 * (fused.pass_beside_fused / fused.beside_fused - 1.0));
  }
  std::fprintf(stderr, "\n");
}

// torch._grouped_mm's figures of the case (t: its row of bench/torch_grouped_mm.py) in the config, and FC1 against
// torch's FC1, each as a share of the dense rate it ran beside.
void add_torch_figures(const MlpBench& k, const nlohmann::json& t, const BesideDense& b, nlohmann::json& config) {
  config["torch_fc1_tflops"] = t.value("fc1_us", 0.0) > 0 ? tflops(k.fc1_flop, t["fc1_us"].get<double>()) : 0.0;
  config["torch_fc2_tflops"] = t.value("fc2_us", 0.0) > 0 ? tflops(k.fc2_flop, t["fc2_us"].get<double>()) : 0.0;
  // The torch process timed its FC1 beside its own dense matmul too (bench/torch_grouped_mm.py): FC1 against
  // torch's FC1 with each as a share of the dense rate it ran beside, i.e. each side in its own power state.
  const double torch_dense = t.value("dense_beside_fc1_tflops", 0.0);
  const double torch_fc1 = t.value("fc1_beside_dense_tflops", 0.0);
  if (torch_dense > 0 && torch_fc1 > 0) {
    const double ours = b.fc1_tflops / b.dense_tflops;
    config["torch_dense_beside_fc1_tflops"] = torch_dense;
    config["torch_fc1_beside_dense_tflops"] = torch_fc1;
    config["fc1_x_torch_beside_dense"] = ours / (torch_fc1 / torch_dense);
    std::fprintf(stderr, "bench mlp %s: FC1 beside the dense GEMM %.1f%% of it, torch._grouped_mm's FC1 beside "
                 "torch's dense matmul %.1f%% of it (%.2fx)\n", k.name.c_str(), 100.0 * ours,
                 100.0 * torch_fc1 / torch_dense, ours / (torch_fc1 / torch_dense));
  }
}

// One case's variants in order, then its rows: fwd and bwd.
std::vector<BenchRow> bench_case(const BenchOptions& o, cudaStream_t s, const MlpCase& c, bool zipf, double dense,
                                 DenseGemm& dense_gemm, const nlohmann::json& torch_rows, const std::string& gpu) {
  MlpBench k(o, s, c, zipf);
  const double err = verify_case(k);
  const PassTimes t = time_passes(k);
  const FusedFc1 fused = fused_fc1_compare(k);
  const nlohmann::json act_bwd = activation_backward_compare(k);
  const nlohmann::json tiles = tile_sweep(o, s, k.cfg, k.mo, k.run, k.name);
  // on whole 128-row tiles, and on the case's own counts where they are not
  nlohmann::json contig = contig_compare(o, s, k.cfg, k.mo, k.run, k.name, zipf, 128);
  if (k.cfg.align % 128 != 0)
    contig["case_counts"] = contig_compare(o, s, k.cfg, k.mo, k.run, k.name, zipf, std::int64_t(k.cfg.align));
  const BesideDense beside = time_beside_dense(k, dense_gemm);

  nlohmann::json config = case_config(k, err, t, fused, act_bwd, tiles, contig, beside);
  print_case(k, t, fused, beside);
  const nlohmann::json* torch = torch_row(torch_rows, k.name);
  if (torch) add_torch_figures(k, *torch, beside, config);
  auto baseline = [&](const char* key_us) -> std::optional<Figure> {
    if (!torch || !torch->contains(key_us)) return std::nullopt;
    const double us = (*torch)[key_us].get<double>();
    const double flop = std::string(key_us) == "bwd_us" ? 2 * k.fwd_flop : k.fwd_flop;
    return Figure{"torch._grouped_mm", tflops(flop, us), us};
  };

  std::vector<BenchRow> rows_out;
  BenchRow f;
  f.bench = "mlp";
  f.case_name = k.name;
  f.direction = "fwd";
  f.gpu = gpu;
  f.time_us = t.fwd;
  f.metric = "TFLOP/s";
  f.value = tflops(k.fwd_flop, t.fwd);
  f.ceiling = Figure{"dense bf16 GEMM 8192^3 (cuBLAS)", dense, std::nullopt};
  f.baseline = baseline("fwd_us");
  f.config = config;
  f.verified = o.verify ? detail::concat("before timing: 16 rows of the first and last expert (y, dx, d_probs) "
                                         "against the CPU reference, rel. err ", err, "; the contiguous and fused "
                                         "variants' outputs bit-equal to the grouped ones (weight gradients: tests)")
                        : std::string("no (--no-verify)");
  rows_out.push_back(f);
  BenchRow b = f;
  b.direction = "bwd";
  b.time_us = t.bwd;
  b.value = tflops(2 * k.fwd_flop, t.bwd);
  b.baseline = baseline("bwd_us");
  rows_out.push_back(b);
  return rows_out;
}

}  // namespace

std::vector<BenchRow> run_mlp_bench(const BenchOptions& options) {
  const std::vector<const MlpCase*> cases = select_mlp_cases(options, "mlp");
  std::string names;
  for (const MlpCase* c : cases) names += (names.empty() ? "" : ",") + std::string(c->preset);
  const nlohmann::json torch_rows = run_torch_baseline(names, options);

  cudaStream_t s;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{s};
  const std::string gpu = gpu_name();
  DenseGemm dense_gemm(s);
  const double dense = dense_gemm.measure_tflops(options);
  std::vector<BenchRow> out;
  for (const MlpCase* c : cases)
    for (bool zipf : {false, true}) {
      std::vector<BenchRow> r = bench_case(options, s, *c, zipf, dense, dense_gemm, torch_rows, gpu);
      out.insert(out.end(), r.begin(), r.end());
    }
  return out;
}

}  // namespace moerail::tools
