// moerail/comm.h — the process group: one NCCL communicator per process (one GPU each), its bootstrap, and the
// symmetric memory the NVLink kernels store into.
//
// Bootstrap. Rank 0 makes an ncclUniqueId and hands it to the others through a rendezvous directory (a file
// written atomically; a shared directory serves several nodes). `moerail run|bench --gpus N` spawns N local worker
// processes with spawn_local_workers(), which sets the environment worker_from_env() reads:
//   MOERAIL_RANK, MOERAIL_WORLD_SIZE, MOERAIL_LOCAL_RANK, MOERAIL_RENDEZVOUS (a directory).
//
// Transports (docs/design.md, Transport):
//   NvLink   every rank is load/store accessible (one NCCL LSA team): symmetric windows (ncclMemAlloc +
//            ncclCommWindowRegister) and a device communicator (ncclDevCommCreate); kernels store straight into
//            peers' windows. Needs libnccl to be the exact version of the headers moerail was built with (the
//            device API has no ABI guarantee): checked at startup, refused with a message otherwise.
//   HostApi  grouped ncclSend/ncclRecv from the host, on any NCCL topology.
//   Auto     NvLink when possible, else HostApi.
//
// Teardown order (graphs first, then windows and device communicators, then the communicator) is the caller's:
// destroy every graph and every object holding a Window before the Communicator.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moerail {

enum class Transport { Auto, NvLink, HostApi };
std::string_view transport_name(Transport t);
// "auto" | "nvlink" | "host"; anything else throws Error(InvalidArgument) naming `what`.
Transport parse_transport(std::string_view s, std::string_view what = "transport");

struct UniqueId {
  std::array<char, 128> bytes{};  // an ncclUniqueId
};
UniqueId new_unique_id();  // ncclGetUniqueId

// ---- bootstrap ------------------------------------------------------------------------------------------------

struct WorkerInfo {
  int rank = 0, world_size = 1, local_rank = 0;
  std::string rendezvous;  // directory shared by all ranks ("" for a single process)
};
// Reads the MOERAIL_* variables above; a single process (rank 0 of 1) when they are absent. Bad values throw
// Error(InvalidArgument) naming the variable.
WorkerInfo worker_from_env();

// Rank 0 publishes, the others wait (polling, at most timeout_s seconds, then Error(Timeout) naming the directory).
void publish_unique_id(const std::string& dir, const UniqueId& id);
UniqueId wait_unique_id(const std::string& dir, double timeout_s = 120.0);
// publish (rank 0) or wait (others) in info.rendezvous; a fresh id for a single process.
UniqueId exchange_unique_id(const WorkerInfo& info, double timeout_s = 120.0);

struct SpawnOptions {
  int nnodes = 1, node_rank = 0;  // global rank = node_rank * n + local rank; world size = nnodes * n
  std::string rendezvous;         // "" = a fresh temporary directory (single node only), removed afterwards
  double grace_s = 10.0;          // after one worker fails, the others get this long before SIGKILL
};
// Runs `argv` (argv[0] = the program, e.g. /proc/self/exe) as n local worker processes with the environment above
// and waits for all. If a worker exits non-zero or by a signal, the others are terminated and the returned message
// names the rank and how it ended; "" when every worker succeeded.
std::string spawn_local_workers(int n, const std::vector<std::string>& argv, const SpawnOptions& opts = {});

// ---- in-process ranks ------------------------------------------------------------------------------------------

// `size` ranks in one process, for tests and development on fewer GPUs than ranks: one Communicator per rank, made
// with Communicator(group, rank, device) and used from that rank's own host thread (each rank calls every collective,
// as separate processes would). Their collectives are device copies (cudaMemcpyPeerAsync) ordered by CUDA events,
// so the host-API path of the Dispatcher and the layer runs over them unchanged, on one GPU or several. When every
// rank is on one GPU the NVLink path runs too: a window is plain device memory of each rank, and peers holds every
// rank's (the kernels' stores and flags between ranks are then stores within the GPU); the ranks' spinning kernels
// must then fit on the GPU at once, so a Dispatcher over such ranks uses at most SMs / size blocks, and nothing may
// wait for the whole device while one waits for another: no cudaDeviceSynchronize or cudaFree (moerail's
// constructors and destructors make such calls: let the ranks meet, barrier(), between them and the next op) and
// no kernel loaded lazily (run with CUDA_MODULE_LOADING=EAGER: loading a kernel waits for the device). Give each rank
// streams of its own (cudaStreamNonBlocking): the legacy default stream is one for the whole GPU, so one rank's
// spinning kernel there would wait behind another's. Limits: no graph capture of a host-API collective
// (Error(Unsupported)), no nccl_comm(); a rank that stops calling the collectives leaves the others waiting at most
// timeout_s, then they throw Error(Timeout) (and so does every later collective of the group).
class LoopbackGroup {
 public:
  explicit LoopbackGroup(int size, double timeout_s = 60.0);
  ~LoopbackGroup();
  LoopbackGroup(const LoopbackGroup&) = delete;
  LoopbackGroup& operator=(const LoopbackGroup&) = delete;
  int size() const;

  struct State;  // src/comm/loopback.h
  State& state() { return *state_; }

 private:
  std::unique_ptr<State> state_;
};

// ---- the communicator -----------------------------------------------------------------------------------------

class Communicator {
 public:
  // Collective over all ranks: ncclCommInitRank on `device` (cudaSetDevice is called). Creates the device
  // communicator too when the NVLink path is possible.
  Communicator(const WorkerInfo& info, const UniqueId& id, int device);
  // Rank `rank` of an in-process group (LoopbackGroup, above); collective over the group's ranks.
  Communicator(LoopbackGroup& group, int rank, int device);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  // NvLink possible: every rank in one LSA team and libnccl == the headers' version. nvlink_refusal() says why not.
  bool nvlink_ok() const { return nvlink_refusal_.empty(); }
  const std::string& nvlink_refusal() const { return nvlink_refusal_; }
  // The ranks of this rank's NVLink domain (NCCL's LSA team) when every rank's is a block of that many consecutive
  // ranks (ranks r with the same r / lsa_ranks()); 0 when not, or not known (a libnccl of another release than the
  // headers). All ranks for in-process ranks (one host).
  int lsa_ranks() const { return lsa_ranks_; }
  // Auto -> NvLink or HostApi; NvLink when refused -> Error(Unsupported) with the reason.
  Transport resolve(Transport wanted) const;

  // A symmetric window: `bytes` (rounded up to 4 KiB) on every rank, zero-filled, registered with NCCL; collective,
  // identical sizes on every rank, never inside graph capture. peers is a device array [size] of the window's
  // address on each rank (index = rank) as seen from this GPU.
  struct Window {
    void* local = nullptr;
    std::size_t bytes = 0;
    void* const* peers = nullptr;  // device memory
    void* handle = nullptr;        // ncclWindow_t
    void* memory = nullptr;        // ncclMemAlloc'd
  };
  Window alloc_window(std::size_t bytes);
  void free_window(Window& w);  // local; safe on an empty window

  void* nccl_comm() const { return comm_; }  // ncclComm_t (nullptr for a rank of a LoopbackGroup)
  // Throws Error(Nccl) naming the rank and `op` if NCCL reported an asynchronous error.
  void check_async(std::string_view op) const;
  // A host barrier over all ranks (an all-reduce of one int on `stream`, then a stream synchronize).
  void barrier(cudaStream_t stream);
  // The smallest `value` over all ranks (collective, synchronizes `stream`; for setup, not for a step).
  int all_reduce_min(int value, cudaStream_t stream);

  // The host API's collectives of a step, enqueued on `stream` (graph-capturable on NCCL; `op` names the caller in
  // errors). exchange: with every peer p != rank() at once (grouped ncclSend / ncclRecv), the `bytes` at
  // send + p * stride go to p, and p's `bytes` for this rank land at recv + p * stride. all_gather_inplace: this
  // rank's `bytes` at buf + rank() * bytes to every rank's buf at the same place (ncclAllGather).
  void exchange(const void* send, void* recv, std::size_t stride, std::size_t bytes, cudaStream_t stream,
                std::string_view op);
  void all_gather_inplace(void* buf, std::size_t bytes, cudaStream_t stream, std::string_view op);
  // exchange_list: any transfers with any peers at once (one NCCL group). Each entry sends `bytes` at `send` to
  // `peer` and receives `bytes` from `peer` at `recv`; the entries for one peer are matched with that peer's
  // entries for this rank in list order, so both list as many with the same bytes. Entries of 0 bytes are skipped.
  struct PeerCopy {
    int peer = 0;
    const void* send = nullptr;
    void* recv = nullptr;
    std::size_t bytes = 0;
  };
  void exchange_list(const std::vector<PeerCopy>& copies, cudaStream_t stream, std::string_view op);

  bool loopback() const { return loop_ != nullptr; }  // a rank of a LoopbackGroup

 private:
  int rank_ = 0, size_ = 1, device_ = 0;
  LoopbackGroup::State* loop_ = nullptr;
  void* comm_ = nullptr;      // ncclComm_t
  void* dev_comm_ = nullptr;  // ncclDevComm*, when nvlink_ok()
  std::string nvlink_refusal_;
  int lsa_ranks_ = 0;
};

}  // namespace moerail
