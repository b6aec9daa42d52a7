// The NCCL communicator, its device communicator and symmetric windows (include/moerail/comm.h).
#include <nccl.h>
#include <nccl_device.h>

#include <cstring>
#include <memory>

#include "comm/loopback.h"
#include "comm/nccl_check.h"
#include "core/cuda_check.h"
#include "core/log.h"
#include "moerail/comm.h"
#include "moerail/error.h"

namespace moerail {
namespace {

constexpr std::size_t kWindowAlign = 4096;  // NCCL_WIN_REQUIRED_ALIGNMENT

// The address of `win` on every LSA peer, as seen from this GPU (ncclGetLsaPointer is device code in 2.28).
__global__ void resolve_peers_kernel(ncclWindow_t win, int n, void** out) {
  const int peer = int(threadIdx.x);
  if (peer < n) out[peer] = ncclGetLsaPointer(win, 0, peer);
}

std::string version_string(int code) {
  return detail::concat(code / 10000, ".", (code / 100) % 100, ".", code % 100);
}

}  // namespace

std::string_view transport_name(Transport t) {
  switch (t) {
    case Transport::Auto: return "auto";
    case Transport::NvLink: return "nvlink";
    case Transport::HostApi: return "host";
  }
  return "?";
}

Transport parse_transport(std::string_view s, std::string_view what) {
  if (s == "auto") return Transport::Auto;
  if (s == "nvlink") return Transport::NvLink;
  if (s == "host") return Transport::HostApi;
  fail(what, "got \"", s, "\" (expected auto, nvlink or host)");
}

UniqueId new_unique_id() {
  ncclUniqueId id;
  MOERAIL_NCCL_CHECK(ncclGetUniqueId(&id), "bootstrap", 0);
  UniqueId u;
  static_assert(sizeof(id.internal) == sizeof(u.bytes));
  std::memcpy(u.bytes.data(), id.internal, sizeof(id.internal));
  return u;
}

Communicator::Communicator(const WorkerInfo& info, const UniqueId& id, int device)
    : rank_(info.rank), size_(info.world_size), device_(device) {
  if (size_ < 1 || rank_ < 0 || rank_ >= size_)
    fail("Communicator", "rank ", rank_, " of world size ", size_, " (expected 0 <= rank < size)");
  MOERAIL_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId nid;
  std::memcpy(nid.internal, id.bytes.data(), sizeof(nid.internal));
  ncclComm_t comm = nullptr;
  MOERAIL_NCCL_CHECK(ncclCommInitRank(&comm, size_, nid, rank_), "ncclCommInitRank", rank_);
  comm_ = comm;

  // The device API has no ABI guarantee before 2.31: headers and library must be the same release.
  int lib = 0;
  MOERAIL_NCCL_CHECK(ncclGetVersion(&lib), "ncclGetVersion", rank_);
  if (lib != NCCL_VERSION_CODE) {
    nvlink_refusal_ = detail::concat("libnccl is ", version_string(lib), " but moerail was built with NCCL ",
                                     version_string(NCCL_VERSION_CODE),
                                     " headers (the device API needs the same version; point LD_LIBRARY_PATH at a "
                                     "libnccl ", version_string(NCCL_VERSION_CODE), ")");
  } else {
    const ncclTeam_t lsa = ncclTeamLsa(comm);
    if (lsa.stride == 1 && lsa.nRanks > 0 && (rank_ - lsa.rank) % lsa.nRanks == 0) lsa_ranks_ = lsa.nRanks;
    if (lsa.nRanks != size_) {
      nvlink_refusal_ = detail::concat("only ", lsa.nRanks, " of ", size_,
                                       " ranks are load/store accessible from rank ", rank_, " (one LSA team needed)");
    }
  }
  // Every rank must agree, or one would wait in a window registration the others skip.
  int refused = nvlink_refusal_.empty() ? 0 : 1;
  int* d_flag = nullptr;
  MOERAIL_CUDA_CHECK(cudaMalloc(&d_flag, sizeof(int)));
  MOERAIL_CUDA_CHECK(cudaMemcpy(d_flag, &refused, sizeof(int), cudaMemcpyHostToDevice));
  MOERAIL_NCCL_CHECK(ncclAllReduce(d_flag, d_flag, 1, ncclInt32, ncclMax, comm, nullptr), "ncclAllReduce", rank_);
  MOERAIL_CUDA_CHECK(cudaMemcpy(&refused, d_flag, sizeof(int), cudaMemcpyDeviceToHost));
  MOERAIL_CUDA_CHECK(cudaFree(d_flag));
  if (refused && nvlink_refusal_.empty()) nvlink_refusal_ = "another rank cannot use the NVLink path";
  // lsa_ranks: the same block size on every rank, or 0 (one all-reduce of {-g, g} with max: -min, max)
  int g[2] = {-lsa_ranks_, lsa_ranks_};
  MOERAIL_CUDA_CHECK(cudaMalloc(&d_flag, sizeof(g)));
  MOERAIL_CUDA_CHECK(cudaMemcpy(d_flag, g, sizeof(g), cudaMemcpyHostToDevice));
  MOERAIL_NCCL_CHECK(ncclAllReduce(d_flag, d_flag, 2, ncclInt32, ncclMax, comm, nullptr), "ncclAllReduce", rank_);
  MOERAIL_CUDA_CHECK(cudaMemcpy(g, d_flag, sizeof(g), cudaMemcpyDeviceToHost));
  MOERAIL_CUDA_CHECK(cudaFree(d_flag));
  if (-g[0] != g[1]) lsa_ranks_ = 0;

  if (nvlink_refusal_.empty()) {
    auto* dev = new ncclDevComm;
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof(reqs));  // 2.28: no initializer macro (2.29+ needs NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER)
    reqs.lsaBarrierCount = 1;
    const ncclResult_t r = ncclDevCommCreate(comm, &reqs, dev);
    if (r != ncclSuccess) {
      delete dev;
      MOERAIL_NCCL_CHECK(r, "ncclDevCommCreate", rank_);
    }
    dev_comm_ = dev;
  }
  log::info("rank ", rank_, "/", size_, " on cuda:", device_, ": NCCL ", version_string(lib), ", NVLink path ",
            nvlink_refusal_.empty() ? "available" : "refused: " + nvlink_refusal_);
}

Communicator::Communicator(LoopbackGroup& group, int rank, int device)
    : rank_(rank), size_(group.size()), device_(device), loop_(&group.state()) {
  nvlink_refusal_ = loopback::join(*loop_, rank_, device_);
  lsa_ranks_ = size_;  // one host
}

Communicator::~Communicator() {
  if (loop_) {
    loopback::leave(*loop_, rank_);
    return;
  }
  cudaSetDevice(device_);
  auto comm = static_cast<ncclComm_t>(comm_);
  if (dev_comm_) {
    auto* dev = static_cast<ncclDevComm*>(dev_comm_);
    ncclDevCommDestroy(comm, dev);
    delete dev;
  }
  if (comm) ncclCommDestroy(comm);
}

Transport Communicator::resolve(Transport wanted) const {
  if (wanted == Transport::HostApi) return Transport::HostApi;
  if (nvlink_ok()) return Transport::NvLink;
  if (wanted == Transport::NvLink) fail_with(ErrorCode::Unsupported, "transport nvlink", nvlink_refusal_);
  return Transport::HostApi;
}

Communicator::Window Communicator::alloc_window(std::size_t bytes) {
  if (!nvlink_ok()) fail_with(ErrorCode::Unsupported, "alloc_window", nvlink_refusal_);
  Window w;
  w.bytes = (bytes + kWindowAlign - 1) / kWindowAlign * kWindowAlign;
  if (w.bytes == 0) w.bytes = kWindowAlign;
  if (loop_) {  // plain device memory of each rank of the group, all on this GPU
    void** peers = nullptr;
    loopback::alloc_window(*loop_, rank_, w.bytes, &w.memory, &peers);
    w.local = w.memory;
    w.peers = peers;
    return w;
  }
  MOERAIL_CUDA_CHECK(cudaSetDevice(device_));
  MOERAIL_NCCL_CHECK(ncclMemAlloc(&w.memory, w.bytes), "ncclMemAlloc", rank_);
  MOERAIL_CUDA_CHECK(cudaMemset(w.memory, 0, w.bytes));
  ncclWindow_t win = nullptr;  // 2.28.9 leaves it unset when symmetric memory is unsupported
  MOERAIL_NCCL_CHECK(ncclCommWindowRegister(static_cast<ncclComm_t>(comm_), w.memory, w.bytes, &win,
                                            NCCL_WIN_COLL_SYMMETRIC),
                     "ncclCommWindowRegister", rank_);
  if (win == nullptr) {
    ncclMemFree(w.memory);
    fail_with(ErrorCode::Nccl, "ncclCommWindowRegister", "rank ", rank_,
              ": NCCL returned no window (symmetric memory unsupported: are all GPUs peer-to-peer connected?)");
  }
  w.handle = win;
  w.local = w.memory;
  void** peers = nullptr;
  MOERAIL_CUDA_CHECK(cudaMalloc(&peers, sizeof(void*) * std::size_t(size_)));
  resolve_peers_kernel<<<1, 1024>>>(win, size_, peers);
  MOERAIL_CUDA_CHECK_LAUNCH();
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
  w.peers = peers;
  return w;
}

void Communicator::free_window(Window& w) {
  if (w.memory == nullptr) return;
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  if (loop_) {
    cudaFree(w.memory);
    cudaFree(const_cast<void**>(w.peers));
    w = Window{};
    return;
  }
  if (w.handle) ncclCommWindowDeregister(static_cast<ncclComm_t>(comm_), static_cast<ncclWindow_t>(w.handle));
  ncclMemFree(w.memory);
  cudaFree(const_cast<void**>(w.peers));
  w = Window{};
}

void Communicator::check_async(std::string_view op) const {
  if (loop_) return;
  ncclResult_t async = ncclSuccess;
  ncclCommGetAsyncError(static_cast<ncclComm_t>(comm_), &async);
  if (async != ncclSuccess && async != ncclInProgress)
    fail_with(ErrorCode::Nccl, op, "rank ", rank_, ": NCCL asynchronous error: ", ncclGetErrorString(async));
}

int Communicator::all_reduce_min(int value, cudaStream_t stream) {
  if (loop_) return loopback::all_reduce_min(*loop_, rank_, value, stream);
  int* d = nullptr;
  MOERAIL_CUDA_CHECK(cudaMallocAsync(&d, sizeof(int), stream));
  MOERAIL_CUDA_CHECK(cudaMemcpyAsync(d, &value, sizeof(int), cudaMemcpyHostToDevice, stream));
  MOERAIL_NCCL_CHECK(ncclAllReduce(d, d, 1, ncclInt32, ncclMin, static_cast<ncclComm_t>(comm_), stream),
                     "all_reduce_min", rank_);
  MOERAIL_CUDA_CHECK(cudaMemcpyAsync(&value, d, sizeof(int), cudaMemcpyDeviceToHost, stream));
  MOERAIL_CUDA_CHECK(cudaFreeAsync(d, stream));
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  return value;
}

void Communicator::barrier(cudaStream_t stream) {
  if (loop_) return loopback::barrier(*loop_, rank_, stream);
  int* d = nullptr;
  MOERAIL_CUDA_CHECK(cudaMallocAsync(&d, sizeof(int), stream));
  MOERAIL_CUDA_CHECK(cudaMemsetAsync(d, 0, sizeof(int), stream));
  MOERAIL_NCCL_CHECK(ncclAllReduce(d, d, 1, ncclInt32, ncclSum, static_cast<ncclComm_t>(comm_), stream), "barrier",
                     rank_);
  MOERAIL_CUDA_CHECK(cudaFreeAsync(d, stream));
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void Communicator::exchange(const void* send, void* recv, std::size_t stride, std::size_t bytes, cudaStream_t stream,
                            std::string_view op) {
  if (size_ == 1) return;
  if (loop_) return loopback::exchange(*loop_, rank_, send, recv, stride, bytes, stream, op);
  auto c = static_cast<ncclComm_t>(comm_);
  MOERAIL_NCCL_CHECK(ncclGroupStart(), op, rank_);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MOERAIL_NCCL_CHECK(ncclSend(static_cast<const char*>(send) + std::size_t(r) * stride, bytes, ncclChar, r, c, stream),
                       op, rank_);
    MOERAIL_NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + std::size_t(r) * stride, bytes, ncclChar, r, c, stream), op,
                       rank_);
  }
  MOERAIL_NCCL_CHECK(ncclGroupEnd(), op, rank_);
}

void Communicator::exchange_list(const std::vector<PeerCopy>& copies, cudaStream_t stream, std::string_view op) {
  for (const PeerCopy& c : copies)
    if (c.peer < 0 || c.peer >= size_ || c.peer == rank_)
      fail(op, "rank ", rank_, ": a transfer with peer ", c.peer, " (expected another rank of ", size_, ")");
  if (size_ == 1 || copies.empty()) return;
  if (loop_) return loopback::exchange_list(*loop_, rank_, copies, stream, op);
  auto c = static_cast<ncclComm_t>(comm_);
  MOERAIL_NCCL_CHECK(ncclGroupStart(), op, rank_);
  for (const PeerCopy& x : copies) {
    if (x.bytes == 0) continue;
    MOERAIL_NCCL_CHECK(ncclSend(x.send, x.bytes, ncclChar, x.peer, c, stream), op, rank_);
    MOERAIL_NCCL_CHECK(ncclRecv(x.recv, x.bytes, ncclChar, x.peer, c, stream), op, rank_);
  }
  MOERAIL_NCCL_CHECK(ncclGroupEnd(), op, rank_);
}

void Communicator::all_gather_inplace(void* buf, std::size_t bytes, cudaStream_t stream, std::string_view op) {
  if (size_ == 1) return;
  if (loop_) return loopback::all_gather_inplace(*loop_, rank_, buf, bytes, stream, op);
  char* b = static_cast<char*>(buf);
  MOERAIL_NCCL_CHECK(ncclAllGather(b + std::size_t(rank_) * bytes, b, bytes, ncclChar, static_cast<ncclComm_t>(comm_),
                                   stream),
                     op, rank_);
}

}  // namespace moerail
