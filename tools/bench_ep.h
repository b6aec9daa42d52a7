// tools/bench_ep.h — `moerail bench dispatch|combine --gpus N` (tools/bench_ep.cu), run inside each worker process.
#pragma once

#include <string>
#include <vector>

#include "bench.h"
#include "moerail/comm.h"

namespace moerail::tools {

std::vector<BenchRow> run_ep_bench(const std::string& bench, const BenchOptions& options, Communicator& comm,
                                   Transport transport, int sms);

}  // namespace moerail::tools
