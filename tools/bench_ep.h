// tools/bench_ep.h — `moerail bench dispatch|combine --gpus N` (tools/bench_ep.cu), run inside each worker process.
#pragma once

#include <string>
#include <vector>

#include "bench.h"
#include "moerail/comm.h"

namespace moerail::tools {

struct EpBenchOptions {
  Transport transport = Transport::Auto;
  int sms = 0;       // blocks of the data kernels (0 = the Dispatcher's default)
  int experts = 64;  // E, spread evenly over the ranks
};

std::vector<BenchRow> run_ep_bench(const std::string& bench, const BenchOptions& options, Communicator& comm,
                                   const EpBenchOptions& ep);

}  // namespace moerail::tools
