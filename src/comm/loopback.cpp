// The in-process ranks of a LoopbackGroup (src/comm/loopback.h, include/moerail/comm.h).
#include "comm/loopback.h"

#include <algorithm>
#include <chrono>

#include "core/cuda_check.h"
#include "moerail/error.h"

namespace moerail {

LoopbackGroup::LoopbackGroup(int size, double timeout_s) : state_(std::make_unique<State>()) {
  if (size < 1) fail("LoopbackGroup", "size = ", size, " (expected >= 1)");
  if (!(timeout_s > 0)) fail("LoopbackGroup", "timeout_s = ", timeout_s, " (expected > 0)");
  state_->size = size;
  state_->timeout_s = timeout_s;
  state_->ranks.resize(std::size_t(size));
}

LoopbackGroup::~LoopbackGroup() = default;

int LoopbackGroup::size() const { return state_->size; }

void LoopbackGroup::State::barrier(std::string_view op, int rank) {
  std::unique_lock<std::mutex> lock(mutex);
  if (broken)
    fail_with(ErrorCode::Timeout, op, "rank ", rank, " of a loopback group: an earlier collective timed out");
  const std::uint64_t gen = generation;
  if (++arrived == size) {
    arrived = 0;
    ++generation;
    cv.notify_all();
    return;
  }
  const bool ok = cv.wait_for(lock, std::chrono::duration<double>(timeout_s),
                              [&] { return generation != gen || broken; });
  if (!ok || generation == gen) {
    broken = true;
    cv.notify_all();
    fail_with(ErrorCode::Timeout, op, "rank ", rank, " of a loopback group waited ", timeout_s,
              " s for the other ranks (is every rank's thread calling the same collectives?)");
  }
}

namespace loopback {
namespace {

void refuse_capture(std::string_view op, int rank, cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  MOERAIL_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
  if (st != cudaStreamCaptureStatusNone)
    fail_with(ErrorCode::Unsupported, op, "rank ", rank,
              ": a loopback group's collectives cannot be captured in a CUDA graph");
}

// Phases 1-3 of src/comm/loopback.h around `pull` (this rank's copies, enqueued on `stream`).
template <typename Pull>
void collective(LoopbackGroup::State& g, int rank, cudaStream_t stream, std::string_view op, Pull&& pull) {
  refuse_capture(op, rank, stream);
  LoopbackGroup::State::Rank& me = g.ranks[std::size_t(rank)];
  MOERAIL_CUDA_CHECK(cudaSetDevice(me.device));
  MOERAIL_CUDA_CHECK(cudaEventRecord(me.ready, stream));
  g.barrier(op, rank);
  for (int p = 0; p < g.size; ++p)
    if (p != rank) MOERAIL_CUDA_CHECK(cudaStreamWaitEvent(stream, g.ranks[std::size_t(p)].ready, 0));
  pull();
  MOERAIL_CUDA_CHECK(cudaEventRecord(me.done, stream));
  g.barrier(op, rank);
  for (int p = 0; p < g.size; ++p)
    if (p != rank) MOERAIL_CUDA_CHECK(cudaStreamWaitEvent(stream, g.ranks[std::size_t(p)].done, 0));
  g.barrier(op, rank);
}

}  // namespace

std::string join(LoopbackGroup::State& g, int rank, int device) {
  if (rank < 0 || rank >= g.size)
    fail("Communicator", "rank ", rank, " of a loopback group of ", g.size, " (expected 0 <= rank < size)");
  LoopbackGroup::State::Rank& me = g.ranks[std::size_t(rank)];
  {
    std::lock_guard<std::mutex> lock(g.mutex);
    if (me.joined) fail("Communicator", "rank ", rank, " of the loopback group has a Communicator already");
    me.joined = true;
  }
  me.device = device;
  MOERAIL_CUDA_CHECK(cudaSetDevice(device));
  MOERAIL_CUDA_CHECK(cudaEventCreateWithFlags(&me.ready, cudaEventDisableTiming));
  MOERAIL_CUDA_CHECK(cudaEventCreateWithFlags(&me.done, cudaEventDisableTiming));
  g.barrier("Communicator", rank);  // every rank's events and device are posted
  for (const auto& r : g.ranks)
    if (r.device != device)
      return detail::concat("the ranks of this loopback group are on several GPUs (rank ", rank, " on cuda:", device,
                            "): windows need one GPU");
  return "";
}

void alloc_window(LoopbackGroup::State& g, int rank, std::size_t bytes, void** local, void*** peers) {
  LoopbackGroup::State::Rank& me = g.ranks[std::size_t(rank)];
  MOERAIL_CUDA_CHECK(cudaSetDevice(me.device));
  MOERAIL_CUDA_CHECK(cudaMalloc(local, bytes));
  MOERAIL_CUDA_CHECK(cudaMemset(*local, 0, bytes));
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
  me.window = *local;
  g.barrier("alloc_window", rank);
  std::vector<void*> all;
  for (const auto& r : g.ranks) all.push_back(r.window);
  g.barrier("alloc_window", rank);  // every rank read the addresses before any posts another window
  MOERAIL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(peers), sizeof(void*) * all.size()));
  MOERAIL_CUDA_CHECK(cudaMemcpy(*peers, all.data(), sizeof(void*) * all.size(), cudaMemcpyHostToDevice));
}

void leave(LoopbackGroup::State& g, int rank) {
  LoopbackGroup::State::Rank& me = g.ranks[std::size_t(rank)];
  cudaSetDevice(me.device);
  cudaDeviceSynchronize();
  if (me.ready) cudaEventDestroy(me.ready);
  if (me.done) cudaEventDestroy(me.done);
  std::lock_guard<std::mutex> lock(g.mutex);
  me = LoopbackGroup::State::Rank{};
}

namespace {

// Posts this rank's send buffer, then pulls from every peer p the `bytes` at p's send + block * stride into
// recv + p * stride, block = rank (exchange: p's slice for this rank) or p (all-gather: p's own slice).
void pull_from_peers(LoopbackGroup::State& g, int rank, const void* send, void* recv, std::size_t stride,
                     std::size_t bytes, bool peer_block, cudaStream_t stream, std::string_view op) {
  LoopbackGroup::State::Rank& me = g.ranks[std::size_t(rank)];
  me.send = static_cast<const char*>(send);
  me.stride = stride;
  me.bytes = bytes;
  collective(g, rank, stream, op, [&] {
    for (int p = 0; p < g.size; ++p) {
      const LoopbackGroup::State::Rank& peer = g.ranks[std::size_t(p)];
      if (p == rank || bytes == 0) continue;
      if (peer.bytes != bytes || peer.stride != stride)
        fail(op, "rank ", rank, " moves ", bytes, " bytes at stride ", stride, " but rank ", p, " ", peer.bytes,
             " at stride ", peer.stride);
      const std::size_t block = std::size_t(peer_block ? p : rank);
      MOERAIL_CUDA_CHECK(cudaMemcpyPeerAsync(static_cast<char*>(recv) + std::size_t(p) * stride, me.device,
                                             peer.send + block * stride, peer.device, bytes, stream));
    }
  });
}

}  // namespace

void exchange(LoopbackGroup::State& g, int rank, const void* send, void* recv, std::size_t stride, std::size_t bytes,
              cudaStream_t stream, std::string_view op) {
  pull_from_peers(g, rank, send, recv, stride, bytes, false, stream, op);
}

void exchange_list(LoopbackGroup::State& g, int rank, const std::vector<Communicator::PeerCopy>& copies,
                   cudaStream_t stream, std::string_view op) {
  LoopbackGroup::State::Rank& me = g.ranks[std::size_t(rank)];
  me.copies = &copies;
  collective(g, rank, stream, op, [&] {
    // the n-th entry of this rank for peer p pulls from the n-th entry of p for this rank
    std::vector<std::size_t> seen(std::size_t(g.size), 0);
    for (const Communicator::PeerCopy& c : copies) {
      const std::size_t n = seen[std::size_t(c.peer)]++;
      const LoopbackGroup::State::Rank& peer = g.ranks[std::size_t(c.peer)];
      const Communicator::PeerCopy* match = nullptr;
      std::size_t i = 0;
      for (const Communicator::PeerCopy& pc : *peer.copies)
        if (pc.peer == rank && i++ == n) {
          match = &pc;
          break;
        }
      if (!match || match->bytes != c.bytes)
        fail(op, "rank ", rank, "'s transfer ", n, " with rank ", c.peer, " (", c.bytes, " bytes) has ",
             match ? "a different size there" : "no counterpart there");
      if (c.bytes)
        MOERAIL_CUDA_CHECK(cudaMemcpyPeerAsync(c.recv, me.device, match->send, peer.device, c.bytes, stream));
    }
  });
  me.copies = nullptr;
}

void all_gather_inplace(LoopbackGroup::State& g, int rank, void* buf, std::size_t bytes, cudaStream_t stream,
                        std::string_view op) {
  pull_from_peers(g, rank, buf, buf, bytes, bytes, true, stream, op);
}

int all_reduce_min(LoopbackGroup::State& g, int rank, int value, cudaStream_t stream) {
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  g.ranks[std::size_t(rank)].value = value;
  g.barrier("all_reduce_min", rank);
  int m = value;
  for (const auto& r : g.ranks) m = std::min(m, r.value);
  g.barrier("all_reduce_min", rank);  // every rank read the values before any posts the next one
  return m;
}

void barrier(LoopbackGroup::State& g, int rank, cudaStream_t stream) {
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  g.barrier("barrier", rank);
}

}  // namespace loopback
}  // namespace moerail
