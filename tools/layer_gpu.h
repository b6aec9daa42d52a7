// tools/layer_gpu.h — the whole MoE layer on GPUs, for `moerail run` and `moerail bench layer` (tools/layer_gpu.cu),
// run inside each worker process (one per GPU; the commands spawn them).
#pragma once

#include <vector>

#include "bench.h"
#include "bench_ep.h"
#include "commands.h"
#include "moerail/comm.h"

namespace moerail::tools {

// `moerail run` on this rank: checks a scaled-down copy of the layer against the CPU reference, then runs
// options' steps of the full-size layer (captured once, replayed) and reports (rank 0 prints and writes JSON).
// Returns the process exit code.
int run_layer_worker(const RunOptions& options, Communicator& comm);

// `moerail bench layer --gpus N`: step time (forward + backward, captured graph replays) for each token count.
std::vector<BenchRow> run_layer_bench(const BenchOptions& options, const LayerBenchOptions& layer, Communicator& comm,
                                      const EpBenchOptions& ep, const std::vector<long long>& tokens_per_rank);

}  // namespace moerail::tools
