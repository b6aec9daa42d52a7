// src/comm/loopback.h — the in-process ranks of a LoopbackGroup (include/moerail/comm.h): the group's shared state
// and the collectives a Communicator made from it runs instead of NCCL's.
//
// Every collective has the same three phases, each ended by a host barrier of the ranks' threads:
//   1. each rank records an event after its stream's work so far (`ready`) and posts its arguments;
//   2. each rank's stream waits for every peer's `ready`, pulls what it receives from the peers' buffers with
//      cudaMemcpyPeerAsync, and records `done`;
//   3. each rank's stream waits for every peer's `done` (a peer may still be reading this rank's send buffer),
//      and the events may be recorded again by the next collective once every rank has enqueued that wait.
// So the copies see every rank's prior work, and no rank's later work overwrites a buffer a peer still reads.
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "moerail/comm.h"

namespace moerail {

struct LoopbackGroup::State {
  struct Rank {
    bool joined = false;
    int device = 0;
    cudaEvent_t ready = nullptr, done = nullptr;
    void* window = nullptr;      // the window being allocated (alloc_window)
    const char* send = nullptr;  // the posted arguments of the current collective
    std::size_t stride = 0, bytes = 0;
    const std::vector<Communicator::PeerCopy>* copies = nullptr;  // exchange_list's
    int value = 0;
  };
  int size = 1;
  double timeout_s = 60.0;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  std::uint64_t generation = 0;
  bool broken = false;  // a barrier timed out: every later one throws at once
  std::vector<Rank> ranks;

  // Waits until every rank arrived (op names the collective in the Error(Timeout) thrown after timeout_s).
  void barrier(std::string_view op, int rank);
};

namespace loopback {
// Returns "" when the ranks may use the NVLink path (all on one device), else why not.
std::string join(LoopbackGroup::State& g, int rank, int device);
// A window of `bytes` (zeroed device memory) on every rank; peers (device [size]) holds each rank's.
void alloc_window(LoopbackGroup::State& g, int rank, std::size_t bytes, void** local, void*** peers);
void leave(LoopbackGroup::State& g, int rank);
void exchange(LoopbackGroup::State& g, int rank, const void* send, void* recv, std::size_t stride, std::size_t bytes,
              cudaStream_t stream, std::string_view op);
void exchange_list(LoopbackGroup::State& g, int rank, const std::vector<Communicator::PeerCopy>& copies,
                   cudaStream_t stream, std::string_view op);
void all_gather_inplace(LoopbackGroup::State& g, int rank, void* buf, std::size_t bytes, cudaStream_t stream,
                        std::string_view op);
int all_reduce_min(LoopbackGroup::State& g, int rank, int value, cudaStream_t stream);
void barrier(LoopbackGroup::State& g, int rank, cudaStream_t stream);
}  // namespace loopback

}  // namespace moerail
