// tools/bench.h — what every `moerail bench <name>` implementation returns: rows in the result format of
// docs/design.md ("Testing and measuring"), written by the command as JSON and printed as a table; and the registry
// of benches the command looks names up in (one entry per bench: name, help line, runner).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace moerail {
class Communicator;  // moerail/comm.h: not included here, so that builds without CUDA need no CUDA headers
}

namespace moerail::tools {

struct BenchOptions {
  std::string config = "deepseek-v3";  // preset name (moerail::preset_config)
  std::string case_name;                // result "case"; default = config
  long long tokens = -1;                // tokens per rank; -1 = the preset's max_tokens
  int warmup = 10;                      // untimed runs first
  int iters = 50;                       // timed runs; the median is reported
  bool verify = true;                   // check against src/reference before timing
};

// The options of `moerail bench layer` alone.
struct LayerBenchOptions {
  int glu_block = 0;                    // GLU halves interleaved in blocks of this many rows (the activation then
                                        // runs in FC1's epilogue); 0 = the preset's layout (concatenated)
  std::string contiguous_gemms = "auto";  // MlpOptions::contiguous_gemms (auto | on | off)
  std::string activation_backward = "auto";  // MlpOptions::activation_backward (auto | fused | pass)
  std::string probs = "preset";         // MoeConfig::prob_mode (preset | in-activation | in-combine)
  int chunks = 1;                       // MoeLayerOptions::chunks (the chunked step; 1 = none)
  int gemm_sms = 0;                     // MlpOptions::sms of the forward and data-gradient GEMMs (0 = all)
  int align = 0;                        // per-expert alignment A of the dispatch layout (0 = the preset's)
  std::string recipe = "bf16";          // MoeLayerOptions::recipe (bf16 | fp8-blockwise | fp8-tensor | fp8-tensor-hybrid)
  std::string fp8_weight_grads = "fp8";  // MoeLayerOptions::fp8_weight_grads (fp8 | bf16)
};

struct Figure {
  std::string name;  // "device copy", "torch index_select", ...
  double value = 0;  // in the row's metric
  std::optional<double> time_us;
};

struct BenchRow {
  std::string bench, case_name, direction;  // direction: fwd | bwd | step
  std::string gpu;
  int gpus = 1;
  double time_us = 0;
  std::string metric;  // "GB/s" or "TFLOP/s"
  double value = 0;
  std::optional<Figure> ceiling, baseline;
  std::optional<double> floor_us;
  nlohmann::json config = nlohmann::json::object();
  std::string verified;  // what was checked before timing ("no ..." when nothing was)
};

nlohmann::json to_json(const BenchRow& row, const std::string& commit, const std::string& date);

struct BenchCommandOptions;  // commands.h
struct EpBenchOptions;       // bench_ep.h

// What a bench's runner gets: the command line, the options every bench takes (case name defaulted to the config),
// and, across GPUs, this worker's communicator and the dispatch options.
struct BenchRun {
  const BenchCommandOptions& command;
  const BenchOptions& options;
  Communicator* comm = nullptr;        // across GPUs only
  const EpBenchOptions* ep = nullptr;  // across GPUs only
};
using BenchRunner = std::vector<BenchRow> (*)(const BenchRun&);

// One `moerail bench <name>`: an entry of the registry (bench.cpp). one_gpu runs in this process on one GPU;
// across_gpus runs in one worker process per GPU, which the command spawns. With both, --gpus picks across_gpus.
struct BenchEntry {
  std::string_view name;
  std::string_view help;  // one line of `moerail bench --help`
  BenchRunner one_gpu = nullptr;
  BenchRunner across_gpus = nullptr;
};

std::span<const BenchEntry> benches();                // every bench, in the order the help lists them
const BenchEntry* find_bench(std::string_view name);  // nullptr when there is none of that name
std::string bench_names(std::string_view separator);  // "router, permute, ..." with separator ", "
std::string bench_help();                             // one line per bench: name and help, for --help

// GPU benchmarks of one GPU's kernels: bench is one of "router", "permute", "combine". Defined in bench_kernels.cu
// when the GPU code is built; throws Error(Unsupported) otherwise.
std::vector<BenchRow> run_kernel_bench(const std::string& bench, const BenchOptions& options);
std::vector<BenchRow> run_mlp_bench(const BenchOptions& options);  // `moerail bench mlp` (tools/bench_mlp.cu)
std::vector<BenchRow> run_mlp_fp8_bench(const BenchOptions& options);  // `moerail bench mlp-fp8` (bench_mlp_fp8.cu)

}  // namespace moerail::tools
