// `moerail run`: the main job. On GPUs (every local GPU by default, one worker process each): tools/layer_gpu.cu.
// Without a GPU (or --gpus 0): the CPU reference layer over simulated ranks, one step forward and backward, timed
// per stage, with its gradients checked against finite differences.
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/log.h"
#include "moerail/config.h"
#include "moerail/reference/layer.h"
#if MOERAIL_WITH_NCCL
#include "layer_gpu.h"
#include "moerail/comm.h"
#endif

namespace moerail::tools {
namespace {

constexpr double kGradTolerance = 1e-5;   // fp64 central differences, step 1e-6 (see tests/reference/layer_test)
constexpr double kMaxReferenceBytes = 4.0 * (1ull << 30);

std::vector<std::int64_t> tokens_per_rank(const RunOptions& o, const MoeConfig& cfg) {
  std::vector<std::int64_t> t;
  if (o.tokens.empty()) {
    // Uneven by default: rank r brings T_max * (R - r) / R tokens (the last rank fewest), never 0 unless T_max < R.
    for (std::int64_t r = 0; r < cfg.ep_size; ++r) t.push_back(cfg.max_tokens * (cfg.ep_size - r) / cfg.ep_size);
  } else if (o.tokens.size() == 1) {
    t.assign(std::size_t(cfg.ep_size), o.tokens[0]);
  } else if (std::int64_t(o.tokens.size()) == cfg.ep_size) {
    t.assign(o.tokens.begin(), o.tokens.end());
  } else {
    fail("run", "--tokens got ", o.tokens.size(), " values for ", cfg.ep_size,
         " ranks (expected one value, or one per rank)");
  }
  for (std::size_t r = 0; r < t.size(); ++r)
    if (t[r] < 0) fail("run", "--tokens: rank ", r, " has ", t[r], " tokens (expected >= 0)");
  return t;
}

double reference_bytes(const MoeConfig& c) {
  const double experts = double(c.num_experts) * double(c.fc1_out() * c.hidden + c.hidden * c.ffn_hidden);
  const double rows = double(c.ep_size) * double(c.rows_per_rank()) * double(c.hidden) * 6;  // recv, y, grads
  return 8.0 * (2 * experts + rows + double(c.num_experts * c.hidden));
}

void print_row(const char* stage, double fwd, double bwd) {
  std::printf("  %-16s %12.3f %12.3f\n", stage, fwd * 1e3, bwd * 1e3);
}

}  // namespace

namespace {

// The GPU path: one worker process per GPU (this process when one), each running tools/layer_gpu.cu.
int run_on_gpus(const RunOptions& o, int gpus) {
#if MOERAIL_WITH_NCCL
  if (std::getenv("MOERAIL_WORLD_SIZE") == nullptr && gpus > 1) {
    const std::string failure = spawn_local_workers(gpus, o.argv);
    if (!failure.empty()) fail_with(ErrorCode::System, "run", failure);
    return 0;
  }
  const WorkerInfo info = worker_from_env();
  log::set_identity(info.rank, info.local_rank);
  Communicator comm(info, exchange_unique_id(info), info.local_rank);
  return run_layer_worker(o, comm);
#else
  fail_with(ErrorCode::Unsupported, "run", "--gpus ", gpus, ": this build has no GPU layer (no CUDA or no NCCL); "
            "use --gpus 0 for the CPU reference path");
#endif
}

}  // namespace

// --glu-block g > 0: the GLU halves of FC1 interleaved in blocks of g rows (GroupedMlp then fuses the activation
// into FC1's epilogue where g allows); 0 leaves the preset's layout. A bad g is reported by cfg.validate().
void apply_glu_block(MoeConfig& cfg, int g) {
  if (g <= 0) return;
  if (!is_glu(cfg.activation))
    fail("--glu-block", g, " was given, but the activation ", name_of(cfg.activation), " is not a GLU");
  cfg.glu_layout = GluLayout::Interleaved;
  cfg.glu_block = g;
}

int run_command(const RunOptions& o) {
  const int gpus_here = local_gpu_count();
  if (o.gpus > gpus_here)
    fail("run", "--gpus ", o.gpus, " but ", gpus_here, " GPUs were found (use --gpus 0 for the CPU reference path)");
  const int gpus = o.gpus < 0 ? gpus_here : o.gpus;
  if (gpus > 0) return run_on_gpus(o, gpus);

  const std::string config_name = o.config.empty() ? "small" : o.config;
  MoeConfig cfg = preset_config(config_name);
  cfg.ep_size = o.ranks;
  apply_glu_block(cfg, o.glu_block);
  if (cfg.num_experts % cfg.ep_size != 0)
    fail("run", "--ranks ", o.ranks, " does not divide the ", cfg.num_experts, " experts of --config ",
         config_name);
  const std::vector<std::int64_t> tokens = tokens_per_rank(o, cfg);
  for (std::int64_t t : tokens) cfg.max_tokens = std::max(cfg.max_tokens, t);
  cfg.validate();
  const double bytes = reference_bytes(cfg);
  if (bytes > kMaxReferenceBytes)
    fail("run", "--config ", config_name, " needs about ", std::llround(bytes / (1 << 30)),
         " GiB on the CPU reference path (fp64 weights and activations); use --config small there, or a GPU");

  std::printf("moerail run: %s; running the CPU reference (fp64) over %lld simulated ranks\n",
              gpus_here == 0 ? "no GPU found" : "--gpus 0", static_cast<long long>(cfg.ep_size));
  std::printf("  configuration    %s: %s\n", config_name.c_str(), cfg.summary().c_str());
  std::printf("  tokens per rank ");
  for (std::int64_t t : tokens) std::printf(" %lld", static_cast<long long>(t));
  std::printf("\n  rows per rank    %lld (capacity %s)\n", static_cast<long long>(cfg.rows_per_rank()),
              cfg.capacity.str().c_str());
  std::fflush(stdout);

  ref::Layer layer(cfg, ref::LayerWeights::random(cfg, o.seed));
  ref::Rng rng(o.seed + 1);
  std::vector<ref::HostTensor> x, d_out;
  std::vector<TensorView> xv, dv;
  for (std::int64_t t : tokens) {
    x.emplace_back(DType::F64, std::vector<std::int64_t>{t, cfg.hidden});
    d_out.emplace_back(DType::F64, std::vector<std::int64_t>{t, cfg.hidden});
    ref::fill_normal(x.back(), rng, 1.0);
    ref::fill_normal(d_out.back(), rng, 1.0);
    xv.push_back(x.back());
    dv.push_back(d_out.back());
  }

  ref::LayerStageTimes tf, tb;
  const auto t0 = std::chrono::steady_clock::now();
  const ref::LayerForward f = layer.forward(xv, &tf);
  const auto t1 = std::chrono::steady_clock::now();
  const ref::LayerGrads g = layer.backward(xv, f, dv, 1.0, 1.0, &tb);
  const auto t2 = std::chrono::steady_clock::now();
  const double fwd_s = std::chrono::duration<double>(t1 - t0).count();
  const double bwd_s = std::chrono::duration<double>(t2 - t1).count();

  std::printf("\n  %-16s %12s %12s\n", "stage", "forward ms", "backward ms");
  print_row("router", tf.router, tb.router);
  print_row("layout", tf.layout, tb.layout);
  print_row("dispatch", tf.dispatch, tb.dispatch);
  print_row("experts", tf.experts, tb.experts);
  print_row("combine", tf.combine, tb.combine);
  if (cfg.shared_expert_ffn > 0) print_row("shared expert", tf.shared, tb.shared);
  print_row("total", fwd_s, bwd_s);

  double sum = 0, abs_sum = 0, aux = 0, z = 0;
  for (const auto& out : f.out)
    for (std::int64_t i = 0; i < out.numel(); ++i) {
      sum += out.f(i);
      abs_sum += std::abs(out.f(i));
    }
  std::int64_t dropped = 0;
  for (std::size_t r = 0; r < f.aux_loss.size(); ++r) {
    aux += f.aux_loss[r];
    z += f.z_loss[r];
    dropped += f.plan.overflow[r];
  }
  std::printf("\n  output checksum  sum %.12g   sum|.| %.12g\n", sum, abs_sum);
  std::printf("  losses           aux %.6g   z %.6g\n", aux, z);
  std::printf("  rows used       ");
  for (std::int64_t r : f.plan.rows_used) std::printf(" %lld", static_cast<long long>(r));
  std::printf("   (dropped %lld)\n", static_cast<long long>(dropped));

  ref::GradientCheck check;
  bool grad_ok = true;
  if (o.grad_samples > 0) {
    check = ref::check_gradients(layer, xv, dv, g, o.grad_samples, o.seed + 2);
    grad_ok = check.max_rel_error < kGradTolerance;
    std::printf("  gradient check   largest relative error %.2e over %lld coordinates (finite differences, fp64): "
                "%s\n", check.max_rel_error, static_cast<long long>(check.coordinates), grad_ok ? "ok" : "FAILED");
    if (!grad_ok) std::printf("  worst            %s\n", check.worst.c_str());
  }
  std::printf("  path             CPU reference (%s)\n", gpus_here == 0 ? "no GPU found" : "--gpus 0");

  if (!o.json.empty()) {
    nlohmann::json j;
    j["path"] = "cpu-reference";
    j["gpus_found"] = gpus_here;
    j["config_name"] = config_name;
    j["config"] = cfg.summary();
    j["tokens_per_rank"] = tokens;
    j["forward_ms"] = {{"router", tf.router * 1e3}, {"layout", tf.layout * 1e3}, {"dispatch", tf.dispatch * 1e3},
                       {"experts", tf.experts * 1e3}, {"combine", tf.combine * 1e3}, {"shared", tf.shared * 1e3},
                       {"total", fwd_s * 1e3}};
    j["backward_ms"] = {{"router", tb.router * 1e3}, {"dispatch", tb.dispatch * 1e3}, {"experts", tb.experts * 1e3},
                        {"combine", tb.combine * 1e3}, {"shared", tb.shared * 1e3}, {"total", bwd_s * 1e3}};
    j["checksum"] = {{"sum", sum}, {"abs_sum", abs_sum}};
    j["aux_loss"] = aux;
    j["z_loss"] = z;
    j["rows_used"] = f.plan.rows_used;
    j["dropped_rows"] = dropped;
    if (o.grad_samples > 0)
      j["gradient_check"] = {{"max_rel_error", check.max_rel_error}, {"coordinates", check.coordinates},
                             {"ok", grad_ok}};
    std::ofstream file(o.json);
    if (!file) fail("run", "--json: cannot write ", o.json);
    file << j.dump(2) << "\n";
  }
  return grad_ok ? 0 : 2;
}

}  // namespace moerail::tools
