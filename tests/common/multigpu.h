// tests/common/multigpu.h — main() of a multi-GPU test program: run plainly, the program spawns one worker process
// per GPU (MOERAIL_TEST_RANKS overrides the count; 1 runs in-process) and fails if any worker fails; each worker
// sets up its Communicator and runs the tests as one rank. Without a GPU the tests run (and skip) in-process.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moerail/comm.h"
#include "moerail/error.h"

namespace moerail::testing {

inline int multigpu_main(int argc, char** argv, const char* program, std::unique_ptr<Communicator>& comm) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing |= std::strstr(argv[i], "--gtest_list_tests") != nullptr;
  const bool worker = std::getenv("MOERAIL_WORLD_SIZE") != nullptr;
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  int ranks = std::max(gpus, 1);  // one worker per GPU
  if (const char* v = std::getenv("MOERAIL_TEST_RANKS")) ranks = std::atoi(v);
  if (!listing && !worker && gpus > 0 && ranks > 1) {
    std::fprintf(stderr, "%s: %d ranks (one worker process each)\n", program, ranks);
    std::vector<std::string> args{"/proc/self/exe"};
    for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
    const std::string failure = spawn_local_workers(ranks, args);
    if (!failure.empty()) std::fprintf(stderr, "%s: %s\n", program, failure.c_str());
    return failure.empty() ? 0 : 1;
  }
  ::testing::InitGoogleTest(&argc, argv);
  if (!listing && gpus > 0) {
    try {
      const WorkerInfo info = worker_from_env();
      cudaSetDevice(info.local_rank);
      comm = std::make_unique<Communicator>(info, exchange_unique_id(info), info.local_rank);
    } catch (const Error& e) {
      std::fprintf(stderr, "%s: cannot set up the process group: %s\n", program, e.what());
      return 1;
    }
  }
  const int rc = RUN_ALL_TESTS();
  comm.reset();
  return rc;
}

}  // namespace moerail::testing
