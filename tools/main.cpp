// The `moerail` command: run (the main job), bench (one stage's benchmark), check (what this machine offers).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "commands.h"
#include "moerail/config.h"  // kMaxMlpChunks
#include "moerail/error.h"

namespace {
constexpr const char* kGluBlockHelp =
    "GLU layouts: gate and linear halves of FC1 interleaved in blocks of this many rows (8, 16, 32 or 64 let the "
    "activation run in FC1's epilogue); 0 = the configuration's layout (concatenated halves, Megatron's default)";

// `moerail run` and its options, parsed into run.
CLI::App* add_run_command(CLI::App& app, moerail::tools::RunOptions& run) {
  CLI::App* run_cmd = app.add_subcommand(
      "run", "The main job: a few training steps of one MoE layer, forward and backward, checked against the\n"
             "CPU reference. Without a GPU it runs the CPU reference over simulated ranks.");
  run_cmd->add_option("--gpus", run.gpus, "GPUs to use, one worker process each; -1 = every local GPU, 0 = the CPU "
                                          "reference path")
      ->default_val(-1);
  run_cmd->add_option("--config", run.config, std::string("layer shape: ") + std::string(moerail::preset_names()) +
                                                 " (default: deepseek-v3 on GPUs, sized to fit; small on the CPU)");
  run_cmd->add_option("--tokens", run.tokens,
                      "tokens per rank: one value for every rank, or one per rank (e.g. --tokens 48 0 17); default "
                      "uneven counts up to the configuration's T_max")
      ->expected(1, -1);
  run_cmd->add_option("--ranks", run.ranks, "simulated expert-parallel ranks of the CPU reference path")
      ->default_val(2)
      ->check(CLI::Range(1, 64));
  run_cmd->add_option("--seed", run.seed, "seed of the random inputs and weights")->default_val(1);
  run_cmd->add_option("--grad-samples", run.grad_samples,
                      "finite-difference coordinates checked per tensor (0 = skip the gradient check)")
      ->default_val(6)
      ->check(CLI::Range(0, 1000));
  run_cmd->add_option("--json", run.json, "also write the results as JSON to this file");
  run_cmd->add_option("--steps", run.steps, "GPU path: training steps, forward + backward, captured once and replayed")
      ->default_val(10)->check(CLI::Range(1, 1000000));
  run_cmd->add_option("--transport", run.transport, "GPU path: auto | nvlink | host")->default_val("auto");
  run_cmd->add_option("--sms", run.sms, "GPU path: blocks (SMs) of the dispatch/combine kernels, 0 = default")
      ->default_val(0);
  run_cmd->add_option("--glu-block", run.glu_block, kGluBlockHelp)->default_val(0)->check(CLI::Range(0, 1 << 20));
  return run_cmd;
}

// `moerail bench` and its options, parsed into bench; the benches it names come from the registry (bench.cpp).
CLI::App* add_bench_command(CLI::App& app, moerail::tools::BenchCommandOptions& bench) {
  using namespace moerail::tools;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench", "Benchmark one stage on the GPU: verify it against the reference (layer: a scaled-down copy of the\n"
               "layer; --no-verify skips it), warm up, time with CUDA events (median), and print time, GB/s or\n"
               "TFLOP/s beside the ceiling measured in the same run; each recorded row says what was verified.");
  bench_cmd->add_option("name", bench.name, "stage: " + bench_names(" | ") + " (each described below)")->required();
  bench_cmd->footer("Benchmarks:\n" + bench_help());
  bench_cmd->add_option("--gpus", bench.gpus, "dispatch/combine/layer: GPUs (one worker process each); combine "
                                              "without it benchmarks the one-GPU unpermute, layer uses one GPU")
      ->check(CLI::Range(1, 64));
  bench_cmd->add_option("--transport", bench.transport, "dispatch/combine: auto | nvlink | host")->default_val("auto");
  bench_cmd->add_option("--rendezvous", bench.rendezvous,
                        "dispatch/combine on several nodes: a directory every node sees (rank 0 leaves the NCCL id "
                        "there)");
  bench_cmd->add_option("--nnodes", bench.nnodes, "dispatch/combine: nodes taking part")->default_val(1)
      ->check(CLI::Range(1, 1024));
  bench_cmd->add_option("--node-rank", bench.node_rank, "dispatch/combine: this node's index")->default_val(0)
      ->check(CLI::Range(0, 1023));
  bench_cmd->add_option("--experts", bench.experts, "dispatch/combine across GPUs: experts E, a multiple of --gpus")
      ->default_val(64)->check(CLI::Range(1, 1 << 20));
  bench_cmd->add_option("--sms", bench.sms, "dispatch/combine: blocks (SMs) of the data kernels, 0 = default")
      ->default_val(0);
  bench_cmd->add_option("--ranks-per-node", bench.ranks_per_node,
                        "dispatch/combine across GPUs, --transport host: the ranks grouped into nodes of this many "
                        "(rows cross between nodes once per token and node, docs/multinode.md); 0 = flat, "
                        "-1 = each GPU's NVLink domain (NCCL's LSA team)")
      ->default_val(0)->check(CLI::Range(-1, 1024));
  bench_cmd->add_option("--capacity", bench.capacity,
                        "dispatch/combine across GPUs: the capacity policy, worst-case | factor:C | per-expert:C "
                        "(sizes the receive buffers, and on --transport host the rows sent per peer)")
      ->default_val("worst-case");
  bench_cmd->add_option("--glu-block", bench.layer.glu_block, std::string("layer: ") + kGluBlockHelp)
      ->default_val(0)->check(CLI::Range(0, 1 << 20));
  bench_cmd->add_option("--contiguous-gemms", bench.layer.contiguous_gemms,
                        "layer: the experts' FC1, FC2, dgrads and weight gradients as one GEMM over all experts' rows "
                        "(auto = with 16 or more local experts)")
      ->default_val("auto")->check(CLI::IsMember({"auto", "on", "off"}));
  bench_cmd->add_option("--activation-backward", bench.layer.activation_backward,
                        "layer: the activation backward in FC2's contiguous dgrad epilogue (fused) or as a pass of "
                        "its own (pass); auto = the library's choice")
      ->default_val("auto")->check(CLI::IsMember({"auto", "fused", "pass"}));
  bench_cmd->add_option("--probs", bench.layer.probs,
                        "layer: where the routing probs scale the expert rows: in-activation (the activation before FC2) "
                        "or in-combine (the combine's weighted sum, Megatron-LM's default); preset = the "
                        "configuration's")
      ->default_val("preset")->check(CLI::IsMember({"preset", "in-activation", "in-combine"}));
  bench_cmd->add_option("--chunks", bench.layer.chunks,
                        "layer: split each step's tokens into this many chunks, whose dispatch and combine run beside "
                        "the other chunks' expert GEMMs (must divide the tokens per rank; 1 = no chunking)")
      ->default_val(1)->check(CLI::Range(1, int(moerail::kMaxMlpChunks)));
  bench_cmd->add_option("--gemm-sms", bench.layer.gemm_sms,
                        "layer: SMs the expert GEMMs of the forward and the data gradients may hold, leaving the rest "
                        "to the chunks' dispatch and combine beside them (0 = every SM; with --sms for the "
                        "communication's)")
      ->default_val(0)->check(CLI::Range(0, 1024));
  bench_cmd->add_option("--align", bench.layer.align,
                        "layer: pad each expert's rows to a multiple of this (0 = the preset's, 128 for deepseek-v3); "
                        "the expert GEMMs run over the pad rows too")
      ->default_val(0)->check(CLI::Range(0, 4096));
  bench_cmd->add_option("--recipe", bench.layer.recipe,
                        "layer: the experts' precision: bf16, fp8-blockwise (DeepSeek-V3's recipe: x quantized in "
                        "the dispatch, FP8 expert GEMMs), fp8-tensor (per-tensor current scaling, one scale per "
                        "expert tensor) or fp8-tensor-hybrid (the same with e5m2 gradients); rows of case "
                        "<config>-<recipe>, beside the bf16 step of the same run")
      ->default_val("bf16")->check(CLI::IsMember({"bf16", "fp8-blockwise", "fp8-tensor", "fp8-tensor-hybrid"}));
  bench_cmd->add_option("--fp8-weight-grads", bench.layer.fp8_weight_grads,
                        "layer, FP8 recipe: the expert weight gradients' GEMMs: fp8 (the recipe's, over quantized "
                        "copies) or bf16 (over the step's bf16 tensors; rows of case <config>-<recipe>-wgrad-bf16)")
      ->default_val("fp8")->check(CLI::IsMember({"fp8", "bf16"}));
  bench_cmd->add_option("--config", bench.bench.config, std::string("layer shape: ") + std::string(moerail::preset_names()) +
                                                         " (mlp and mlp-fp8 also take 'all')")
      ->default_val("deepseek-v3");
  bench_cmd->add_option("--case", bench.bench.case_name, "case name recorded in the results (default: the config)");
  bench_cmd->add_option("--tokens", bench.bench.tokens, "tokens per rank (default: the configuration's T_max)");
  bench_cmd->add_option("--warmup", bench.bench.warmup, "untimed runs before timing")->default_val(10);
  bench_cmd->add_option("--iters", bench.bench.iters, "timed runs; the median is reported")->default_val(50)
      ->check(CLI::Range(1, 100000));
  bench_cmd->add_flag("!--no-verify", bench.bench.verify, "skip the check against the CPU reference");
  bench_cmd->add_option("--json", bench.json, "write the rows as a JSON array to this file");
  bench_cmd->add_option("--record", bench.record_dir,
                        "merge the rows into DIR/<gpu>-x<count>.json (e.g. bench/results), replacing older rows of "
                        "the same bench, case and direction");
  bench_cmd->add_option("--commit", bench.commit, "commit id recorded in the rows (default: $MOERAIL_COMMIT, else "
                                                  "the commit the binary was built from)");
  return bench_cmd;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moerail::tools;
  CLI::App app{"moerail: the token path of a Mixture-of-Experts layer (router, dispatch, grouped expert MLP,\n"
               "combine; forward and backward) for expert-parallel training on NVIDIA GPUs."};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("moerail ") + MOERAIL_VERSION);

  RunOptions run;
  CLI::App* run_cmd = add_run_command(app, run);
  BenchCommandOptions bench;
  CLI::App* bench_cmd = add_bench_command(app, bench);

  CLI::App* check_cmd = app.add_subcommand("check", "Print what this machine offers: GPUs, CUDA, NCCL, build options.");

  CLI11_PARSE(app, argc, argv);
  try {
    if (run_cmd->parsed()) {
      run.argv.assign(argv, argv + argc);
      run.argv[0] = "/proc/self/exe";
      return run_command(run);
    }
    if (bench_cmd->parsed()) {
      bench.argv.assign(argv, argv + argc);
      bench.argv[0] = "/proc/self/exe";
      return bench_command(bench);
    }
    if (check_cmd->parsed()) return check_command();
  } catch (const moerail::Error& e) {
    std::fprintf(stderr, "moerail: %s (%s)\n", e.what(), std::string(moerail::error_code_name(e.code())).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moerail: %s\n", e.what());
    return 1;
  }
  return 0;
}
