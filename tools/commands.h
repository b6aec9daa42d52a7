// tools/commands.h — the subcommands of the `moerail` command, each in its own file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench.h"

namespace moerail {
struct MoeConfig;
}

namespace moerail::tools {

struct RunOptions {
  int gpus = -1;                      // -1: every local GPU; 0: the CPU reference
  std::string config;                 // preset name; "" = small (CPU reference) or deepseek-v3 (GPUs)
  std::vector<long long> tokens;      // tokens per rank (one value for all, or one per rank); empty = default
  int ranks = 2;                      // simulated ranks of the CPU reference
  std::uint64_t seed = 1;
  int grad_samples = 6;               // finite-difference coordinates per tensor
  std::string json;                   // write the results as JSON here ("" = no)
  int steps = 10;                     // GPU path: training steps (captured once, replayed)
  std::string transport = "auto";     // GPU path: auto | nvlink | host
  int sms = 0;                        // GPU path: blocks of the dispatch/combine kernels (0 = default)
  int glu_block = 0;                  // GLU halves interleaved in blocks of this many rows (0 = the preset's layout)
  std::vector<std::string> argv;      // the command line, for the worker processes
};
int run_command(const RunOptions& options);
// --glu-block (run, bench layer): FC1's GLU halves interleaved in blocks of g rows; g <= 0 leaves cfg as it is.
void apply_glu_block(MoeConfig& cfg, int g);

struct BenchCommandOptions {
  std::string name;                   // router | permute | combine | ...
  BenchOptions bench;
  LayerBenchOptions layer;            // `bench layer` only
  std::string json;                   // write the rows as a JSON array here
  std::string record_dir;             // merge the rows into <dir>/<gpu>-x<count>.json
  std::string commit;                 // commit recorded in the rows; default MOERAIL_COMMIT or the build's commit
  int gpus = 0;                       // dispatch/combine across GPUs: worker processes (0 = combine on one GPU)
  std::string transport = "auto";     // dispatch/combine across GPUs: auto | nvlink | host
  int sms = 0;                        // blocks of the dispatch/combine kernels (0 = default)
  int experts = 64;                   // dispatch/combine across GPUs: experts E (a multiple of --gpus)
  std::string capacity = "worst-case";  // dispatch/combine across GPUs: worst-case | factor:C | per-expert:C
  int ranks_per_node = 0;             // dispatch/combine across GPUs, host API: nodes of this many ranks (0 = flat)
  std::vector<std::string> argv;      // the command line, for the worker processes
  std::string rendezvous;             // several nodes: a directory every node sees
  int nnodes = 1, node_rank = 0;
};
int bench_command(const BenchCommandOptions& options);

int check_command();

// Local CUDA devices usable by this process (0 without CUDA or a driver), and the first one's name.
int local_gpu_count();
std::string gpu_name(int device);

}  // namespace moerail::tools
