// `moerail bench router|permute|combine`: one GPU's kernels, fwd and bwd rows each (router: also a top-k-only fwd
// row, case "<case>-topk", the losses off; permute: also a "permute-fp8" fwd row, see bench_permute_fp8). permute
// and combine are the Dispatcher's dispatch and combine (and their backward passes) at one rank.
//
// Each bench: builds the preset's problem (random routing, never zero data) in 3 buffer sets so that the working
// set exceeds L2, verifies a sample of the results against the definition (and the router against the CPU
// reference on the first tokens), warms up, then times each run with CUDA events and reports the median.
// GB/s counts every input read once and every output written once (docs/kernels.md); the ceiling is the
// device-to-device copy bandwidth (cudaMemcpyAsync of 1 GiB, read + write) measured in the same run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench.h"
#include "bench_gpu.cuh"
#include "commands.h"
#include "core/cuda_check.h"
#include "moerail/error.h"
#include "moerail/comm.h"
#include "moerail/dispatch.h"
#include "moerail/quant.h"
#include "moerail/reference/host.h"
#include "moerail/reference/quant.h"
#include "moerail/reference/router.h"
#include "moerail/router.h"
#include "moerail/status.h"

namespace moerail::tools {
namespace {

constexpr int kSets = 3;

void upload(const DeviceBuf& d, const void* h, std::size_t n) {
  MOERAIL_CUDA_CHECK(cudaMemcpy(d.p, h, n, cudaMemcpyHostToDevice));
}
template <typename T>
std::vector<T> download(const void* d, std::size_t n) {
  std::vector<T> v(n);
  MOERAIL_CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

std::string gpu_name() { return tools::gpu_name(cuda::current_device()); }

BenchRow make_row(const std::string& bench, const BenchOptions& o, const MoeConfig& cfg, const std::string& dir,
                  double us, double bytes, double copy_gbs, const std::string& gpu) {
  BenchRow r;
  r.bench = bench;
  r.case_name = o.case_name.empty() ? o.config : o.case_name;
  r.direction = dir;
  r.gpu = gpu;
  r.gpus = 1;
  r.time_us = us;
  r.metric = "GB/s";
  r.value = bytes / (us * 1e3);
  r.ceiling = Figure{"device copy", copy_gbs, std::nullopt};
  r.verified = o.verify ? "before timing: the op's outputs against the CPU reference (T > 0)" : "no (--no-verify)";
  r.config = {{"tokens", cfg.max_tokens}, {"hidden", cfg.hidden}, {"experts", cfg.num_experts},
              {"topk", cfg.topk}, {"align", cfg.align}, {"dtype", std::string(dtype_name(cfg.dtype))}};
  return r;
}

// The preset as one GPU runs it: R = 1, T_max = the token count asked for.
MoeConfig bench_config(const BenchOptions& o) {
  MoeConfig cfg = preset_config(o.config);
  cfg.ep_size = 1;
  if (o.tokens > 0) cfg.max_tokens = o.tokens;
  if (cfg.dtype != DType::BF16 && cfg.dtype != DType::F32 && cfg.dtype != DType::F16) cfg.dtype = DType::BF16;
  cfg.validate();
  return cfg;
}

// Random routing of T tokens: K distinct experts each, probs in [0.05, 1).
void random_routing(const MoeConfig& cfg, ref::Rng& rng, std::vector<std::int32_t>& idx, std::vector<float>& probs) {
  const std::int64_t T = cfg.max_tokens, K = cfg.topk, E = cfg.num_experts;
  idx.resize(std::size_t(T * K));
  probs.resize(std::size_t(T * K));
  std::vector<std::int32_t> perm(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t e = 0; e < E; ++e) perm[std::size_t(e)] = std::int32_t(e);
    for (std::int64_t k = 0; k < K; ++k) {
      std::swap(perm[std::size_t(k)], perm[std::size_t(k + rng.below(E - k))]);
      idx[std::size_t(t * K + k)] = perm[std::size_t(k)];
      probs[std::size_t(t * K + k)] = float(rng.uniform(0.05, 1.0));
    }
  }
}

// Random activations of dtype d (never zero).
void fill_random(const DeviceBuf& b, DType d, std::size_t elems, ref::Rng& rng) {
  std::vector<std::uint16_t> h16;
  std::vector<float> h32;
  if (d == DType::F32) {
    h32.resize(elems);
    for (auto& v : h32) v = float(rng.uniform(0.1, 1.0)) * (rng.uniform() < 0.5 ? -1.f : 1.f);
    upload(b, h32.data(), elems * 4);
  } else {
    h16.resize(elems);
    for (auto& v : h16) {
      const float f = float(rng.uniform(0.1, 1.0)) * (rng.uniform() < 0.5 ? -1.f : 1.f);
      v = d == DType::BF16 ? float_to_bf16_bits(f) : float_to_f16_bits(f);
    }
    upload(b, h16.data(), elems * 2);
  }
}

// ---- permute and combine: the Dispatcher of one rank over one routed problem in kSets buffer sets -----------

#if MOERAIL_WITH_NCCL
struct TokenProblem {
  MoeConfig cfg;
  std::int64_t C = 0, N = 0, P = 0;  // capacity, routed rows, pad rows (set 0)
  std::unique_ptr<Communicator> comm;  // one rank: the Dispatcher moves rows on this GPU only
  std::unique_ptr<Dispatcher> disp;    // declared after comm: destroyed before it
  std::unique_ptr<DeviceBuf> nt;
  std::unique_ptr<DeviceBuf> x[kSets], probs[kSets], idx[kSets], hmem[kSets], buf_rows[kSets], buf_probs[kSets],
      tok_out[kSets], tok_probs_out[kSets];
  DispatchHandle handle[kSets];

  EpDispatchArgs dispatch_args(int k) const {
    const std::int64_t T = cfg.max_tokens, K = cfg.topk;
    return {rows(*x[k], T), idx[k]->view(DType::I32, {T, K}), probs[k]->view(DType::F32, {T, K}),
            nt->view(DType::I32, {1}), rows(*buf_rows[k], C), buf_probs[k]->view(DType::F32, {C})};
  }
  TensorView rows(const DeviceBuf& b, std::int64_t n) const { return b.view(cfg.dtype, {n, cfg.hidden}); }
};

std::unique_ptr<TokenProblem> make_problem(const BenchOptions& o, cudaStream_t stream) {
  auto p = std::make_unique<TokenProblem>();
  MoeConfig& cfg = p->cfg;
  cfg = bench_config(o);
  const std::int64_t T = cfg.max_tokens, H = cfg.hidden, K = cfg.topk;
  const std::size_t es = dtype_size(cfg.dtype);
  const int dev = cuda::current_device();
  p->comm = std::make_unique<Communicator>(WorkerInfo{}, new_unique_id(), dev);
  p->disp = std::make_unique<Dispatcher>(cfg, *p->comm);
  p->C = p->disp->capacity();
  ref::Rng rng(42);
  std::int32_t t32 = std::int32_t(T);
  p->nt = std::make_unique<DeviceBuf>(4);
  upload(*p->nt, &t32, 4);
  for (int s = 0; s < kSets; ++s) {
    std::vector<std::int32_t> idx;
    std::vector<float> probs;
    random_routing(cfg, rng, idx, probs);
    p->x[s] = std::make_unique<DeviceBuf>(std::size_t(T * H) * es);
    fill_random(*p->x[s], cfg.dtype, std::size_t(T * H), rng);
    p->idx[s] = std::make_unique<DeviceBuf>(idx.size() * 4);
    upload(*p->idx[s], idx.data(), idx.size() * 4);
    p->probs[s] = std::make_unique<DeviceBuf>(probs.size() * 4);
    upload(*p->probs[s], probs.data(), probs.size() * 4);
    p->hmem[s] = std::make_unique<DeviceBuf>(p->disp->handle_bytes());
    p->handle[s] = p->disp->make_handle(p->hmem[s]->view(DType::Bool, {std::int64_t(p->hmem[s]->bytes)}));
    p->buf_rows[s] = std::make_unique<DeviceBuf>(std::size_t(p->C * H) * es);
    p->buf_probs[s] = std::make_unique<DeviceBuf>(std::size_t(p->C) * 4);
    p->tok_out[s] = std::make_unique<DeviceBuf>(std::size_t(T * H) * es);
    p->tok_probs_out[s] = std::make_unique<DeviceBuf>(std::size_t(T * K) * 4);
    p->disp->dispatch(p->dispatch_args(s), p->handle[s], stream);  // fills the handle the combines read
  }
  p->disp->check(stream);
  const EpLayout& l = p->handle[0].layout();
  const auto tpe = download<std::int32_t>(l.tokens_per_expert.data(), std::size_t(cfg.num_experts));
  const auto need = download<std::int32_t>(static_cast<std::int32_t*>(l.segment_offset.data()) + cfg.num_experts, 1);
  for (auto v : tpe) p->N += v;
  p->P = need[0] - p->N;
  return p;
}

// Sampled check: recv[dest(t,k)] == x[t] byte for byte.
void verify_permute(const TokenProblem& p) {
  const std::int64_t T = p.cfg.max_tokens, K = p.cfg.topk, H = p.cfg.hidden;
  const std::size_t row = std::size_t(H) * dtype_size(p.cfg.dtype);
  const auto dest = download<std::int32_t>(p.handle[0].layout().dest_row.data(), std::size_t(T * K));
  ref::Rng rng(5);
  std::vector<char> a(row), b(row);
  for (int i = 0; i < 64 && T > 0; ++i) {
    const std::int64_t t = rng.below(T), k = rng.below(K);
    const std::int32_t d = dest[std::size_t(t * K + k)];
    if (d < 0) continue;
    MOERAIL_CUDA_CHECK(cudaMemcpy(a.data(), static_cast<char*>(p.x[0]->p) + t * row, row, cudaMemcpyDeviceToHost));
    MOERAIL_CUDA_CHECK(cudaMemcpy(b.data(), static_cast<char*>(p.buf_rows[0]->p) + std::size_t(d) * row, row, cudaMemcpyDeviceToHost));
    if (std::memcmp(a.data(), b.data(), row) != 0)
      fail_with(ErrorCode::Internal, "bench permute", "verification failed: recv[", d, "] != x[", t, "] (slot ", k, ")");
  }
}

// Sampled check of the combine: out[t] against sum_k p * y[row] computed here in double.
void verify_combine(const TokenProblem& p) {
  const std::int64_t T = p.cfg.max_tokens, K = p.cfg.topk, H = p.cfg.hidden;
  const DType d = p.cfg.dtype;
  const std::size_t es = dtype_size(d);
  const auto dest = download<std::int32_t>(p.handle[0].layout().dest_row.data(), std::size_t(T * K));
  const auto probs = download<float>(p.probs[0]->p, std::size_t(T * K));
  auto load = [&](const void* base, std::int64_t r) {
    std::vector<char> raw(std::size_t(H) * es);
    MOERAIL_CUDA_CHECK(cudaMemcpy(raw.data(), static_cast<const char*>(base) + std::size_t(r) * raw.size(), raw.size(), cudaMemcpyDeviceToHost));
    const TensorView v(raw.data(), d, {H});
    std::vector<double> f(static_cast<std::size_t>(H));
    for (std::int64_t h = 0; h < H; ++h) f[std::size_t(h)] = ref::load_float(v, h);
    return f;
  };
  ref::Rng rng(6);
  for (int i = 0; i < 16 && T > 0; ++i) {
    const std::int64_t t = rng.below(T);
    std::vector<double> want(std::size_t(H), 0.0);
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int32_t r = dest[std::size_t(t * K + k)];
      if (r < 0) continue;
      const auto y = load(p.buf_rows[0]->p, r);
      for (std::int64_t h = 0; h < H; ++h) want[std::size_t(h)] += double(probs[std::size_t(t * K + k)]) * y[std::size_t(h)];
    }
    const auto got = load(p.tok_out[0]->p, t);
    for (std::int64_t h = 0; h < H; ++h)
      if (std::fabs(got[std::size_t(h)] - want[std::size_t(h)]) > 1e-2 * std::fabs(want[std::size_t(h)]) + 1e-3)
        fail_with(ErrorCode::Internal, "bench combine", "verification failed: out[", t, ",", h, "] = ", got[std::size_t(h)],
                  " but ", want[std::size_t(h)], " was expected");
  }
}

// Sampled check of the FP8 dispatch (1x128 blockwise): recv[dest(t,k)] and its scale row equal ref::quantize_fp8 of
// x[t] byte for byte, and the first pad row found has zero codes and scales 1.
void verify_permute_fp8(const TokenProblem& p, const DeviceBuf& recv, const DeviceBuf& scales) {
  const std::int64_t T = p.cfg.max_tokens, K = p.cfg.topk, H = p.cfg.hidden, E = p.cfg.num_experts;
  const std::int64_t nb = H / kBlockScaleCols;
  const std::size_t srow = std::size_t(nb) * 4;
  const EpLayout& l = p.handle[0].layout();
  const auto dest = download<std::int32_t>(l.dest_row.data(), std::size_t(T * K));
  ref::HostTensor x(DType::BF16, {1, H}), q(DType::F8E4M3, {1, H}), sc(DType::F32, {1, nb});
  std::vector<unsigned char> got(static_cast<std::size_t>(H)), got_s(srow);
  auto fetch = [&](std::int64_t row) {
    MOERAIL_CUDA_CHECK(cudaMemcpy(got.data(), static_cast<char*>(recv.p) + std::size_t(row) * std::size_t(H),
                                  std::size_t(H), cudaMemcpyDeviceToHost));
    MOERAIL_CUDA_CHECK(cudaMemcpy(got_s.data(), static_cast<char*>(scales.p) + std::size_t(row) * srow, srow,
                                  cudaMemcpyDeviceToHost));
  };
  ref::Rng rng(7);
  for (int i = 0; i < 64 && T > 0; ++i) {
    const std::int64_t t = rng.below(T), k = rng.below(K);
    const std::int32_t d = dest[std::size_t(t * K + k)];
    if (d < 0) continue;
    MOERAIL_CUDA_CHECK(cudaMemcpy(x.view().data(), static_cast<char*>(p.x[0]->p) + std::size_t(t * H) * 2,
                                  std::size_t(H) * 2, cudaMemcpyDeviceToHost));
    ref::quantize_fp8(Fp8Scaling::Block1x128, x, q, sc);
    fetch(d);
    if (std::memcmp(got.data(), q.view().data(), got.size()) != 0 ||
        std::memcmp(got_s.data(), sc.view().data(), srow) != 0)
      fail_with(ErrorCode::Internal, "bench permute-fp8", "verification failed: recv[", d,
                "] or its scales differ from quantize_fp8(x[", t, "]) (slot ", k, ")");
  }
  const auto tpe = download<std::int32_t>(l.tokens_per_expert.data(), std::size_t(E));
  const auto padded = download<std::int32_t>(l.padded_per_expert.data(), std::size_t(E));
  const auto offset = download<std::int32_t>(l.segment_offset.data(), std::size_t(E));
  for (std::int64_t e = 0; e < E; ++e) {
    if (padded[std::size_t(e)] == tpe[std::size_t(e)]) continue;
    const std::int64_t row = offset[std::size_t(e)] + tpe[std::size_t(e)];
    if (row >= p.C) break;
    fetch(row);
    bool ok = std::all_of(got.begin(), got.end(), [](unsigned char b) { return b == 0; });
    for (std::int64_t j = 0; j < nb; ++j) {
      float v;
      std::memcpy(&v, got_s.data() + 4 * j, 4);
      ok = ok && v == 1.0f;
    }
    if (!ok)
      fail_with(ErrorCode::Internal, "bench permute-fp8", "verification failed: pad row ", row,
                " is not zero codes with scales 1");
    break;
  }
}

// permute-fp8 fwd: the FP8 dispatch of one rank, bf16 x quantized with 1x128 blockwise scales (the DeepSeek-V3
// recipe) inside the scatter, e4m3 rows and their f32 scale rows written. GB/s counts x read once (bf16) and the
// e4m3 rows and scale rows written once (routed and pad rows), plus the probs and dest_row traffic the bf16 row
// counts. Baseline: the bf16 dispatch of the same run. Also timed, in config: the per-tensor recipe, and the move of
// rows given in FP8 (e4m3 + 1x128 scales, made by quantize_fp8 outside the timing).
BenchRow bench_permute_fp8(const BenchOptions& o, cudaStream_t s, double copy, const std::string& gpu,
                           TokenProblem& p, double bf16_us, double bf16_bytes) {
  const MoeConfig& cfg = p.cfg;
  const std::int64_t T = cfg.max_tokens, H = cfg.hidden, nb = H / kBlockScaleCols;
  std::unique_ptr<DeviceBuf> recv[kSets], scales[kSets], q[kSets], qs[kSets];
  for (int k = 0; k < kSets; ++k) {
    recv[k] = std::make_unique<DeviceBuf>(std::size_t(p.C * H));
    scales[k] = std::make_unique<DeviceBuf>(std::size_t(p.C * nb) * 4);
    q[k] = std::make_unique<DeviceBuf>(std::size_t(T * H));
    qs[k] = std::make_unique<DeviceBuf>(std::size_t(T * nb) * 4);
  }
  DeviceBuf tensor_scale(4);
  const float ts = 1.0f / kE4M3Max;  // the inputs lie in (-1, 1): amax / 448 at most
  upload(tensor_scale, &ts, 4);
  auto run = [&](int i, Fp8Scaling scaling, bool given) {
    const int k = i % kSets;
    const EpDispatchArgs b = p.dispatch_args(k);
    EpDispatchFp8Args a{b.x, b.topk_idx, b.probs, b.num_tokens, recv[k]->view(DType::F8E4M3, {p.C, H}),
                        scaling == Fp8Scaling::PerTensor ? tensor_scale.view(DType::F32, {1})
                                                         : scales[k]->view(DType::F32, {p.C, nb}),
                        b.recv_probs, scaling};
    if (given) {
      a.x = {};
      a.q = q[k]->view(DType::F8E4M3, {T, H});
      a.q_scales = qs[k]->view(DType::F32, {T, nb});
    }
    p.disp->dispatch_fp8(a, p.handle[k], s);
  };
  auto block = [&](int i) { run(i, Fp8Scaling::Block1x128, false); };
  auto per_tensor = [&](int i) { run(i, Fp8Scaling::PerTensor, false); };
  auto moved = [&](int i) { run(i, Fp8Scaling::Block1x128, true); };
  if (o.verify) {
    block(0);
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
    verify_permute_fp8(p, *recv[0], *scales[0]);
  }
  const double us = median_us(o, s, block);
  const double extra = 4.0 * T * cfg.topk * 2 + 4.0 * double(p.N + p.P);  // probs + dest_row, recv_probs written
  const double rows = double(p.N + p.P), scale_row = 4.0 * double(nb);
  const double bytes = double(T) * H * 2 + rows * (double(H) + scale_row) + extra;
  BenchRow r = make_row("permute-fp8", o, cfg, "fwd", us, bytes, copy, gpu);
  r.baseline = Figure{"bf16 dispatch", bf16_bytes / (bf16_us * 1e3), bf16_us};
  r.config["dtype"] = "bf16 -> fp8_e4m3";
  r.config["recipe"] = std::string(fp8_scaling_name(Fp8Scaling::Block1x128));
  r.config["time_vs_bf16"] = us / bf16_us;

  const double pt_us = median_us(o, s, per_tensor);
  r.config["per_tensor_us"] = pt_us;
  r.config["per_tensor_gbs"] = (double(T) * H * 2 + rows * double(H) + extra) / (pt_us * 1e3);
  for (int k = 0; k < kSets; ++k)
    quantize_fp8({Fp8Scaling::Block1x128, p.rows(*p.x[k], T), p.nt->view(DType::I32, {1}),
                  q[k]->view(DType::F8E4M3, {T, H}), qs[k]->view(DType::F32, {T, nb})},
                 s);
  const double mv_us = median_us(o, s, moved);
  r.config["prequantized_us"] = mv_us;
  r.config["prequantized_gbs"] = ((double(T) + rows) * (double(H) + scale_row) + extra) / (mv_us * 1e3);
  p.disp->check(s);
  return r;
}

// What the rows of permute and combine time: the Dispatcher's ops at one rank (Dispatcher::dispatch plans the
// layout of the routing on the device, then moves the rows; the others read the plan in the dispatch's handle).
constexpr const char* kOneRankNote = "Dispatcher ops of one rank; dispatch includes planning its layout";

std::vector<BenchRow> bench_permute(const BenchOptions& o, cudaStream_t s, double copy, const std::string& gpu) {
  auto pp = make_problem(o, s);
  TokenProblem& p = *pp;
  const MoeConfig& cfg = p.cfg;
  const std::int64_t T = cfg.max_tokens, K = cfg.topk;
  const double row = double(cfg.hidden * std::int64_t(dtype_size(cfg.dtype)));
  auto fwd = [&](int i) { p.disp->dispatch(p.dispatch_args(i % kSets), p.handle[i % kSets], s); };
  auto bwd = [&](int i) {
    const int k = i % kSets;
    p.disp->dispatch_backward({p.rows(*p.buf_rows[k], p.C), p.buf_probs[k]->view(DType::F32, {p.C}),
                               p.rows(*p.tok_out[k], T), p.tok_probs_out[k]->view(DType::F32, {T, K})},
                              p.handle[k], s);
  };
  if (o.verify) {
    fwd(0);
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
    verify_permute(p);
  }
  const double fwd_us = median_us(o, s, fwd);
  const double fwd_bytes = double(T) * row + double(p.N + p.P) * row + 4.0 * T * K * 2 + 4.0 * double(p.N + p.P);
  const double bwd_us = median_us(o, s, bwd);
  const double bwd_bytes = double(p.N) * row + double(T) * row + 4.0 * T * K * 2 + 4.0 * double(p.N);
  p.disp->check(s);
  std::vector<BenchRow> rows = {make_row("permute", o, cfg, "fwd", fwd_us, fwd_bytes, copy, gpu),
                                make_row("permute", o, cfg, "bwd", bwd_us, bwd_bytes, copy, gpu)};
  if (cfg.dtype == DType::BF16 && cfg.hidden % kBlockScaleCols == 0)
    rows.push_back(bench_permute_fp8(o, s, copy, gpu, p, fwd_us, fwd_bytes));
  for (auto& r : rows) r.config["op"] = kOneRankNote;
  return rows;
}

std::vector<BenchRow> bench_combine(const BenchOptions& o, cudaStream_t s, double copy, const std::string& gpu) {
  auto pp = make_problem(o, s);
  TokenProblem& p = *pp;
  const MoeConfig& cfg = p.cfg;
  const std::int64_t T = cfg.max_tokens, K = cfg.topk, H = cfg.hidden;
  const double row = double(H * std::int64_t(dtype_size(cfg.dtype)));
  ref::Rng rng(9);
  for (int k = 0; k < kSets; ++k) fill_random(*p.buf_rows[k], cfg.dtype, std::size_t(p.C * H), rng);  // y
  auto fwd = [&](int i) {
    const int k = i % kSets;
    p.disp->combine({ProbMode::InCombine, p.rows(*p.buf_rows[k], p.C), p.rows(*p.tok_out[k], T)}, p.handle[k], s);
  };
  // Backward writes d_y into a buffer of its own (y must stay intact for the dot products).
  std::unique_ptr<DeviceBuf> d_y[kSets];
  for (int k = 0; k < kSets; ++k) d_y[k] = std::make_unique<DeviceBuf>(std::size_t(p.C * H) * dtype_size(cfg.dtype));
  auto bwd = [&](int i) {
    const int k = i % kSets;
    p.disp->combine_backward({ProbMode::InCombine, p.rows(*p.x[k], T), p.rows(*p.buf_rows[k], p.C),
                              p.rows(*d_y[k], p.C), p.tok_probs_out[k]->view(DType::F32, {T, K})},
                             p.handle[k], s);
  };
  if (o.verify) {
    fwd(0);
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
    verify_combine(p);
  }
  const double fwd_us = median_us(o, s, fwd);
  const double fwd_bytes = double(p.N) * row + double(T) * row + 4.0 * T * K * 2;
  const double bwd_us = median_us(o, s, bwd);
  const double bwd_bytes = double(T) * row + double(p.N) * row + double(p.N + p.P) * row + 4.0 * T * K * 3;
  p.disp->check(s);
  std::vector<BenchRow> rows = {make_row("combine", o, cfg, "fwd", fwd_us, fwd_bytes, copy, gpu),
                                make_row("combine", o, cfg, "bwd", bwd_us, bwd_bytes, copy, gpu)};
  for (auto& r : rows) r.config["op"] = kOneRankNote;
  return rows;
}
#else
std::vector<BenchRow> bench_permute(const BenchOptions&, cudaStream_t, double, const std::string&) {
  fail_with(ErrorCode::Unsupported, "bench permute", "this build has no NCCL (the Dispatcher moves the rows)");
}
std::vector<BenchRow> bench_combine(const BenchOptions&, cudaStream_t, double, const std::string&) {
  fail_with(ErrorCode::Unsupported, "bench combine", "this build has no NCCL (the Dispatcher moves the rows)");
}
#endif  // MOERAIL_WITH_NCCL

// ---- router -------------------------------------------------------------------------------------------------------

// The router rows: "fwd" and "bwd" of the preset as configured, and "fwd" of case "<case>-topk": the same routing
// (score, groups, bias, scaling) with the aux and z losses off, i.e. top-k selection only.
std::vector<BenchRow> bench_router(const BenchOptions& o, cudaStream_t s, double copy, const std::string& gpu) {
  const MoeConfig cfg = bench_config(o);
  MoeConfig topk_cfg = cfg;
  topk_cfg.router.aux_loss_coeff = 0;
  topk_cfg.router.z_loss_coeff = 0;
  const std::int64_t T = cfg.max_tokens, E = cfg.num_experts, K = cfg.topk;
  const std::size_t es = dtype_size(cfg.dtype);
  ref::Rng rng(77);
  std::int32_t t32 = std::int32_t(T);
  DeviceBuf nt(4), bias(std::size_t(E) * 4), ws(router_workspace_bytes(cfg)), losses(8), tpe(std::size_t(E) * 4),
      status(sizeof(DeviceStatus));
  upload(nt, &t32, 4);
  std::vector<float> bh(static_cast<std::size_t>(E));
  for (auto& v : bh) v = float(rng.uniform(-0.1, 0.1));
  upload(bias, bh.data(), bh.size() * 4);
  reset_status(static_cast<DeviceStatus*>(status.p), nullptr);
  // Enough input sets that the logits rotated through exceed the L2 cache twice over.
  const int sets = input_sets(std::size_t(T * E) * es);
  std::vector<std::unique_ptr<DeviceBuf>> logits(sets), idx(sets), probs(sets), dprobs(sets), dlogits(sets);
  for (int k = 0; k < sets; ++k) {
    logits[k] = std::make_unique<DeviceBuf>(std::size_t(T * E) * es);
    fill_random(*logits[k], cfg.dtype, std::size_t(T * E), rng);
    idx[k] = std::make_unique<DeviceBuf>(std::size_t(T * K) * 4);
    probs[k] = std::make_unique<DeviceBuf>(std::size_t(T * K) * 4);
    dprobs[k] = std::make_unique<DeviceBuf>(std::size_t(T * K) * 4);
    fill_random(*dprobs[k], DType::F32, std::size_t(T * K), rng);
    dlogits[k] = std::make_unique<DeviceBuf>(std::size_t(T * E) * 4);
  }
  // Forward of config c on buffer set i % sets (c is cfg or topk_cfg: the same shapes, losses on or off).
  auto forward = [&](const MoeConfig& c, int i) {
    const int k = i % sets;
    const bool aux = c.router.aux_loss_coeff > 0, losses_on = aux || c.router.z_loss_coeff > 0;
    RouterForwardArgs a;
    a.logits = logits[k]->view(c.dtype, {T, E});
    if (c.router.use_expert_bias) a.expert_bias = bias.view(DType::F32, {E});
    a.num_tokens = nt.view(DType::I32, {1});
    a.topk_idx = idx[k]->view(DType::I32, {T, K});
    a.topk_probs = probs[k]->view(DType::F32, {T, K});
    if (losses_on) a.losses = losses.view(DType::F32, {2});
    if (aux) a.aux_tokens_per_expert = tpe.view(DType::I32, {E});
    a.status = static_cast<DeviceStatus*>(status.p);
    const std::size_t need = router_workspace_bytes(c);
    if (need > 0) a.workspace = ws.view(DType::I32, {std::int64_t(ws.bytes / 4)});
    router_forward(c, a, s);
  };
  const bool aux = cfg.router.aux_loss_coeff > 0;
  auto fwd = [&](int i) { forward(cfg, i); };
  auto fwd_topk = [&](int i) { forward(topk_cfg, i); };
  auto bwd = [&](int i) {
    const int k = i % sets;
    RouterBackwardArgs a;
    a.logits = logits[k]->view(cfg.dtype, {T, E});
    a.num_tokens = nt.view(DType::I32, {1});
    a.topk_idx = idx[k]->view(DType::I32, {T, K});
    a.d_topk_probs = dprobs[k]->view(DType::F32, {T, K});
    if (aux) a.aux_tokens_per_expert = tpe.view(DType::I32, {E});
    a.d_logits = dlogits[k]->view(DType::F32, {T, E});
    router_backward(cfg, a, s);
  };
  // The first tokens of set 0 against the CPU reference (selection; a near-tie may differ: allow one token).
  auto verify = [&](const MoeConfig& c, const std::string& what) {
    if (!o.verify || T == 0) return;
    const std::int64_t n = std::min<std::int64_t>(T, 64);
    std::vector<char> raw(std::size_t(n * E) * es);
    MOERAIL_CUDA_CHECK(cudaMemcpy(raw.data(), logits[0]->p, raw.size(), cudaMemcpyDeviceToHost));
    MoeConfig small = c;
    small.max_tokens = n;
    ref::HostTensor ridx(DType::I32, {n, K}), rprobs(DType::F32, {n, K});
    ref::HostTensor bias_h(DType::F32, {E});
    for (std::int64_t e = 0; e < E; ++e) bias_h.set_f(e, bh[std::size_t(e)]);
    ref::router_forward(small, {TensorView(raw.data(), c.dtype, {n, E}),
                                c.router.use_expert_bias ? bias_h.view() : TensorView(), ridx.view(), rprobs.view(), -1});
    const auto gidx = download<std::int32_t>(idx[0]->p, std::size_t(n * K));
    int differ = 0;
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t k = 0; k < K; ++k)
        if (gidx[std::size_t(t * K + k)] != ridx.i(t * K + k)) {
          ++differ;
          break;
        }
    if (differ > 1) fail_with(ErrorCode::Internal, "bench router", what, " verification failed: ", differ, " of ", n,
                              " tokens select other experts than the reference");
  };

  fwd_topk(0);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  verify(topk_cfg, "top-k only:");
  for (int k = 0; k < sets; ++k) fwd(k);  // every set gets a selection for the backward
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
  verify(cfg, "fwd:");
  // The router is a ~20-60 us kernel: rows report its time in back-to-back launches (graph replay, as inside a
  // captured step); the event-timed single launch, launch gap included, is kept in the row's config.
  const double fwd_bytes = double(T * E) * double(es) + 8.0 * T * K;
  const double bwd_bytes = double(T * E) * double(es) + 8.0 * T * K + 4.0 * double(T * E);
  auto row = [&](const BenchOptions& bo, const MoeConfig& c, const char* dir, const std::function<void(int)>& f,
                 double bytes) {
    BenchRow r = make_row("router", bo, c, dir, graph_median_us(o, s, f), bytes, copy, gpu);
    r.config["timing"] = "graph of 20 back-to-back launches";
    r.config["single_launch_us"] = median_us(o, s, f);
    r.config["input_sets"] = sets;
    return r;
  };
  BenchOptions topk_o = o;
  topk_o.case_name = (o.case_name.empty() ? o.config : o.case_name) + "-topk";
  return {row(o, cfg, "fwd", fwd, fwd_bytes), row(o, cfg, "bwd", bwd, bwd_bytes),
          row(topk_o, topk_cfg, "fwd", fwd_topk, fwd_bytes)};
}

}  // namespace

std::vector<BenchRow> run_kernel_bench(const std::string& bench, const BenchOptions& options) {
  if (bench != "router" && bench != "permute" && bench != "combine")
    fail("moerail bench", "unknown kernel bench '", bench, "' (known: router, permute, combine)");
  cudaStream_t s;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{s};
  const std::string gpu = gpu_name();
  const double copy = copy_bandwidth_gbs(options, s);
  if (bench == "router") return bench_router(options, s, copy, gpu);
  if (bench == "permute") return bench_permute(options, s, copy, gpu);
  return bench_combine(options, s, copy, gpu);
}

}  // namespace moerail::tools
