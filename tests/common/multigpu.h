// tests/common/multigpu.h — main() of a multi-GPU test program: run plainly, the program spawns one worker process
// per GPU (MOERAIL_TEST_RANKS overrides the count; 1 runs in-process) and fails if any worker fails; each worker
// sets up its Communicator and runs the tests as one rank. Without a GPU the tests run (and skip) in-process.
//
// Skips: ctest reports a test skipped when its output matches the skip expression, whatever the exit code, and every
// worker prints GoogleTest's "[  SKIPPED ]" lines into the one output; so a rank that skips could hide another rank's
// failure. The programs' skip expression is instead kAllSkipped, printed once, by the launching process, only when
// every rank skipped what it ran and none failed (each worker leaves its outcome in a file for it); ranks that
// disagree (one skipped, one passed) fail.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <unistd.h>

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

inline constexpr const char* kAllSkipped = "moerail-multigpu: every rank skipped";

// This process's outcome: "failed", "skipped" (every test that ran skipped) or "passed".
inline const char* gtest_outcome() {
  const ::testing::UnitTest& u = *::testing::UnitTest::GetInstance();
  if (u.failed_test_count() > 0 || !u.Passed()) return "failed";
  if (u.skipped_test_count() > 0 && u.successful_test_count() == 0) return "skipped";
  return "passed";
}

// Spawns the workers with a directory for their outcomes; "" when they all passed or all skipped (kAllSkipped
// printed), else what went wrong.
inline std::string run_workers(int ranks, const std::vector<std::string>& args) {
  char dir[] = "/tmp/moerail-test-outcome-XXXXXX";
  if (::mkdtemp(dir) == nullptr) return "cannot create a directory for the workers' outcomes";
  ::setenv("MOERAIL_TEST_OUTCOME_DIR", dir, 1);
  std::string failure = spawn_local_workers(ranks, args);
  ::unsetenv("MOERAIL_TEST_OUTCOME_DIR");
  std::vector<std::string> outcomes;
  for (int r = 0; r < ranks; ++r) {
    const std::string path = std::string(dir) + "/rank" + std::to_string(r);
    std::string o = "missing";
    if (std::FILE* f = std::fopen(path.c_str(), "r")) {
      char buf[16] = {};
      if (std::fgets(buf, sizeof buf, f)) o = buf;
      std::fclose(f);
      std::remove(path.c_str());
    }
    outcomes.push_back(o);
  }
  ::rmdir(dir);
  if (!failure.empty()) return failure;
  const auto all = [&](const char* o) {
    return std::all_of(outcomes.begin(), outcomes.end(), [&](const std::string& x) { return x == o; });
  };
  if (all("skipped")) {
    std::printf("%s\n", kAllSkipped);
    return "";
  }
  if (all("passed")) return "";
  std::string msg = "the ranks disagree:";
  for (int r = 0; r < ranks; ++r) msg += " rank " + std::to_string(r) + " " + outcomes[std::size_t(r)] + ";";
  return msg;
}

inline int multigpu_main(int argc, char** argv, const char* program, std::unique_ptr<Communicator>& comm) {
  // In-process ranks on the NVLink path (LoopbackGroup, moerail/comm.h) run kernels that wait for each other: a
  // kernel loaded lazily on first launch makes CUDA wait for the device, which then waits for them. Every kernel is
  // loaded at startup instead (before the first CUDA call; a value set by the caller is kept).
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
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
    const std::string failure = run_workers(ranks, args);
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
  if (!listing) {
    if (const char* dir = std::getenv("MOERAIL_TEST_OUTCOME_DIR"); worker && dir) {
      const std::string path = std::string(dir) + "/rank" + std::getenv("MOERAIL_RANK");
      if (std::FILE* f = std::fopen(path.c_str(), "w")) {
        std::fputs(gtest_outcome(), f);
        std::fclose(f);
      }
    } else if (!worker && std::string(gtest_outcome()) == "skipped") {
      std::printf("%s\n", kAllSkipped);  // in-process (one rank, or no GPU)
    }
  }
  return rc;
}

}  // namespace moerail::testing
