// tools/bench_ep.h — `moerail bench dispatch|combine --gpus N` (tools/bench_ep.cu), run inside each worker process.
#pragma once

#include <string>
#include <vector>

#include "bench.h"
#include "moerail/comm.h"
#include "moerail/config.h"

namespace moerail::tools {

struct EpBenchOptions {
  Transport transport = Transport::Auto;
  int sms = 0;       // blocks of the data kernels (0 = the Dispatcher's default)
  int experts = 64;  // E, spread evenly over the ranks
  Capacity capacity = Capacity::worst_case();  // of the receive buffers, and of the host-API transport's staging
  int ranks_per_node = 0;  // DispatchOptions::ranks_per_node (host API: through nodes; 0 = flat)
};

// "worst-case" | "factor:C" | "per-expert:C" (C > 0); anything else throws Error(InvalidArgument) naming `what`.
Capacity parse_capacity(const std::string& s, std::string_view what);

std::vector<BenchRow> run_ep_bench(const std::string& bench, const BenchOptions& options, Communicator& comm,
                                   const EpBenchOptions& ep);

}  // namespace moerail::tools
