// tests/common/loopback.h — running a test body as the ranks of a LoopbackGroup (moerail/comm.h): R host threads in
// this process, each with its own Communicator on `device`, so that multi-rank host-API paths run on one GPU.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "moerail/comm.h"

namespace moerail::testing {

// body(comm) on R threads, rank r's Communicator of one LoopbackGroup on `device`. An exception in a rank fails the
// test with its message (the other ranks then time out of their collectives after timeout_s and fail too).
inline void run_ranks(int R, int device, const std::function<void(Communicator&)>& body, double timeout_s = 60.0) {
  LoopbackGroup group(R, timeout_s);
  std::vector<std::string> errors(static_cast<std::size_t>(R));
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      try {
        if (cudaSetDevice(device) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
        Communicator comm(group, r, device);
        body(comm);
      } catch (const std::exception& e) {
        errors[std::size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < R; ++r) EXPECT_EQ(errors[std::size_t(r)], "") << "rank " << r;
}

}  // namespace moerail::testing
