// Expert-parallel dispatch and combine (include/moerail/dispatch.h): setup, argument checks and the launch
// sequences of both transports. The kernels: ep_plan_kernel.cuh, ep_scatter.cuh, ep_gather.cuh (ep_common.cuh).
#include <nccl.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "comm/nccl_check.h"
#include "core/cuda_check.h"
#include "core/env.h"
#include "core/log.h"
#include "dispatch/ep_gather.cuh"
#include "dispatch/ep_plan_kernel.cuh"
#include "dispatch/ep_scatter.cuh"
#include "moerail/dispatch.h"
#include "moerail/error.h"
#include "moerail/quant.h"

namespace moerail {
namespace {

std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }

// Default blocks of the data kernels: one per SM. Every wait on a peer pairs block i with block i of that peer (the
// entry handshake, chunk and return flags: ep::RemoteWork), so blocks that a kernel of another stream keeps from
// being resident (a data-parallel NCCL collective beside the backward, itself waiting on the other ranks) hold up
// only their partners there; the other blocks finish and free the SMs that the collective's CTAs need on those
// ranks (test Ep.EverySmBesideACollectiveThatWaitsForThePeer). Every SM rather than half of them: the combine gains
// most from more SMs (docs/dispatch.md, "Where the time goes").
int default_blocks(int sms) { return std::max(1, sms); }

}  // namespace

// The arrays of a DispatchHandle, in order, each 256-byte aligned: i32 tokens [R], tokens_per_expert [L],
// padded_per_expert [L], segment_offset [L + 1], segment_rows [L], pad_prefix [L + 1], rows_used [1], dest_rank and
// dest_row [T_max K], slot_rows [R T_max K]; f32 slot_probs [R T_max K]. One function walks the layout for both
// the size and the views.
template <typename Take>
void lay_out_handle(int R, int L, std::int64_t slots, Take&& take) {
  take(R);
  for (int i = 0; i < 2; ++i) take(L);
  take(L + 1);
  take(L);
  take(L + 1);
  take(1);
  take(slots);
  take(slots);
  take(std::int64_t(R) * slots);
  take(std::int64_t(R) * slots);
}

struct Dispatcher::Impl {
  MoeConfig cfg;
  Communicator& comm;
  DispatchOptions opts;
  DeviceAllocator* allocator = nullptr;
  Transport transport = Transport::HostApi;
  int R = 1, me = 0, E = 0, L = 0, K = 0, H = 0, blocks = 0, chunks_max = 0, expert_cap = 0;
  std::int64_t t_max = 0, capacity = 0;
  std::size_t elem = 2, total_bytes = 0;
  ep::Regions reg;

  Communicator::Window win;   // NvLink staging area
  char* recv_area = nullptr;  // HostApi staging area (receive side)
  char* send_area = nullptr;  // HostApi send buffer
  char* local = nullptr;      // the staging area of this rank (window or recv_area)
  char** dst = nullptr;       // device [R]

  MoeConfig local_cfg;        // R = 1, A = 1: the local planner's view (place of each slot among its expert's)
  LayoutBuffers local_layout;
  void* local_layout_mem = nullptr;
  void* local_ws = nullptr;
  std::size_t local_ws_bytes = 0;
  DeviceStatus* scratch = nullptr;
  DeviceStatus* status = nullptr;
  std::uint32_t* epochs = nullptr;
  std::int32_t* base = nullptr;   // [E] the plan's, for the dispatch that computes it
  std::int32_t* limit = nullptr;  // [E]
  DispatchHandle default_handle;
  const void* planned = nullptr;  // memory of the handle whose plan() is the last op (its dispatch comes next)
  std::vector<DeviceBuffer> buffers;

  // MOERAIL_EP_TRACE=<prefix> (a developer knob, src/core/env.h, docs/dispatch.md): the data kernels record per-warp
  // %globaltimer stamps (ep::WarpTrace), and check() appends them to <prefix>.rank<r>.jsonl: those of the last data
  // launch (on HostApi the unpack of a split op) and the planner's of the last dispatch.
  unsigned long long* trace = nullptr;
  std::string trace_path;
  const char* last_op = "";
  int trace_seq = 0;
  std::size_t trace_words() const { return std::size_t(blocks) * ep::kWarps * ep::kTraceSlots + 8; }
  void dump_trace(cudaStream_t stream);

  Impl(const MoeConfig& c, Communicator& cm, const DispatchOptions& o) : cfg(c), comm(cm), opts(o) {}

  // Zero-filled device memory from the allocator, held until the Dispatcher is destroyed.
  void* alloc(std::size_t bytes) {
    bytes = align256(std::max<std::size_t>(bytes, 16));
    DeviceBuffer& b = buffers.emplace_back(*allocator, bytes);
    MOERAIL_CUDA_CHECK(cudaMemset(b.data(), 0, bytes));
    total_bytes += bytes;
    return b.data();
  }

  std::int64_t slots() const { return t_max * K; }

  // `h` is a handle of `self` (make_handle), and a dispatch filled it unless the op is the dispatch that fills it.
  static void check_handle(std::string_view op, const Dispatcher* self, const DispatchHandle& h,
                           bool must_be_filled) {
    if (!h.defined()) fail(op, "handle is empty (make one with Dispatcher::make_handle)");
    if (h.owner_ != self) fail(op, "handle was made by another Dispatcher");
    if (must_be_filled && !h.filled_) fail(op, "handle holds no dispatch yet (pass the handle that dispatch() filled)");
  }

  // The rows the buffers of the dispatch over `h` need: those its plan() returned (when it follows one), else
  // capacity. Throws when h was planned but another plan or dispatch ran since, or the routing is not the plan's.
  // Changes nothing (the dispatch's other checks come next; take_plan() then consumes the plan).
  std::int64_t rows_for(std::string_view op, const DispatchHandle& h, const TensorView& topk_idx,
                        const TensorView& probs, const TensorView& num_tokens) const {
    const DispatchHandle::Planned& pl = h.planned_;
    if (pl.topk_idx == nullptr) return capacity;
    if (this->planned != h.memory_.data())
      fail(op, "handle was planned (plan()), but another plan or dispatch of this Dispatcher ran since: plan it "
           "again");
    if (pl.topk_idx != topk_idx.data() || pl.probs != probs.data() || pl.num_tokens != num_tokens.data())
      fail(op, "topk_idx, probs and num_tokens must be the arrays the handle was planned with (plan() and its "
           "dispatch take the same routing)");
    return h.layout_.capacity;
  }
  // Whether the dispatch over `h` follows its plan() (then it moves the rows only); forgets the plan, and gives a
  // dispatch that plans itself the capacity's rows.
  bool take_plan(DispatchHandle& h) {
    const bool planned = h.planned_.topk_idx != nullptr;
    h.planned_ = {};
    this->planned = nullptr;
    if (!planned) h.layout_.capacity = capacity;
    return planned;
  }

  ep::Params params(int role, const DispatchHandle& h) const {
    ep::Params p{};
    p.R = R;
    p.me = me;
    p.E = E;
    p.L = L;
    p.K = K;
    p.t_max = int(t_max);
    p.capacity = int(capacity);
    p.chunks_max = chunks_max;
    p.blocks = blocks;
    p.nvec = (long long)(std::size_t(H) * elem / 16);
    p.role = role;
    p.timeout_ns = (unsigned long long)(opts.timeout_s * 1e9);
    p.reg = reg;
    p.local = local;
    p.dst = dst;
    p.dst_is_peer = transport == Transport::NvLink;
    p.epochs = epochs;
    p.trace = trace;
    p.status = status;
    p.expert_cap = expert_cap;
    p.local_row = local_layout.dest_row.as<const std::int32_t>();
    p.local_off = local_layout.segment_offset.as<const std::int32_t>();
    p.base = base;
    p.limit = limit;
    const EpLayout& l = h.layout();
    p.tokens = l.tokens.as<const std::int32_t>();
    p.dest_rank = l.dest_rank.as<std::int32_t>();
    p.dest_row = l.dest_row.as<std::int32_t>();
    p.slot_rows = h.slot_rows_;
    p.slot_probs = h.slot_probs_;
    p.seg_offset = l.segment_offset.as<const std::int32_t>();
    p.tpe = l.tokens_per_expert.as<const std::int32_t>();
    p.pad_prefix = h.pad_prefix_;
    return p;
  }

  // The plan's outputs: base and limit here, the rest in the handle.
  ep::PlanOut plan_out(const DispatchHandle& h) const {
    const EpLayout& l = h.layout();
    ep::PlanOut o{};
    o.base = base;
    o.limit = limit;
    o.tokens = l.tokens.as<std::int32_t>();
    o.tokens_per_expert = l.tokens_per_expert.as<std::int32_t>();
    o.padded_per_expert = l.padded_per_expert.as<std::int32_t>();
    o.segment_offset = l.segment_offset.as<std::int32_t>();
    o.segment_rows = l.segment_rows.as<std::int32_t>();
    o.pad_prefix = h.pad_prefix_;
    o.rows_used = l.rows_used.as<std::int32_t>();
    return o;
  }

  bool nvlink() const { return transport == Transport::NvLink; }

  // HostApi: rank r's slice of region `off` moves from send_area to r's recv_area, for every peer at once.
  void transfer(std::size_t off, std::size_t slice_bytes, cudaStream_t stream, const char* op) {
    if (R == 1) return;
    auto c = static_cast<ncclComm_t>(comm.nccl_comm());
    MOERAIL_NCCL_CHECK(ncclGroupStart(), op, me);
    for (int r = 0; r < R; ++r) {
      if (r == me) continue;
      MOERAIL_NCCL_CHECK(ncclSend(send_area + off + std::size_t(r) * slice_bytes, slice_bytes, ncclChar, r, c, stream),
                         op, me);
      MOERAIL_NCCL_CHECK(ncclRecv(recv_area + off + std::size_t(r) * slice_bytes, slice_bytes, ncclChar, r, c, stream),
                         op, me);
    }
    MOERAIL_NCCL_CHECK(ncclGroupEnd(), op, me);
  }

  std::size_t stage_slice() const { return std::size_t(t_max) * std::size_t(H) * elem; }
  std::size_t k_slice() const { return std::size_t(t_max) * std::size_t(K) * 4; }
};

namespace {

template <typename F>
void with_dtype(DType t, F&& f) {
  if (t == DType::BF16) f(__nv_bfloat16{});
  else f(float{});
}

void launch_plan(Dispatcher::Impl& d, const DispatchHandle& h, const TensorView& num_tokens, cudaStream_t stream) {
  ep::PlanParams pp{};
  pp.p = d.params(0, h);
  pp.A = int(d.cfg.align);
  pp.exchange = d.nvlink();  // R = 1 too: the counts go to this rank's own window
  pp.local_tpe = d.local_layout.tokens_per_expert.as<const std::int32_t>();
  pp.num_tokens = num_tokens.as<const std::int32_t>();
  pp.scratch = d.scratch;
  pp.out = d.plan_out(h);
  if (!d.nvlink()) {
    ep::pack_counts_kernel<<<1, 256, 0, stream>>>(pp.p, pp.local_tpe, pp.num_tokens);
    MOERAIL_CUDA_CHECK_LAUNCH();
    const std::size_t n = std::size_t(d.E + 1);
    auto* counts = reinterpret_cast<std::int32_t*>(d.local + d.reg.xcount);
    MOERAIL_NCCL_CHECK(ncclAllGather(counts + std::size_t(d.me) * n, counts, n, ncclInt32,
                                     static_cast<ncclComm_t>(d.comm.nccl_comm()), stream),
                       "dispatch (count exchange)", d.me);
  }
  // NvLink: scheduled while the local planner's assign kernel ends. The data kernel after it is launched plainly:
  // its blocks hold every SM, and resident early they could keep SMs from a collective of another stream while
  // this kernel waits for the peers' counts (docs/dispatch.md, Blocks).
  if (d.nvlink())
    MOERAIL_CUDA_CHECK(cuda::launch_after_previous(ep::plan_kernel, dim3(1), dim3(ep::kPlanThreads), 0, stream, pp));
  else
    ep::plan_kernel<<<1, ep::kPlanThreads, 0, stream>>>(pp);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

template <typename Kernel>
void launch_data(Dispatcher::Impl& d, Kernel kernel, const ep::Params& p, cudaStream_t stream) {
  kernel<<<d.blocks, ep::kWarps * 32, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

// The gather kernels land the rows they sum in shared memory (ep::kGatherSmemBytes, above the 48 KiB default): the
// attribute is set before each launch (a host call, allowed during graph capture; per kernel instance and device).
template <typename Elem, bool kCombine>
void launch_gather(Dispatcher::Impl& d, const ep::Params& p, cudaStream_t stream) {
  const auto kernel = ep::gather_kernel<Elem, kCombine>;
  MOERAIL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(ep::kGatherSmemBytes)));
  kernel<<<d.blocks, ep::kWarps * 32, ep::kGatherSmemBytes, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

// Roles of the one NvLink launch; on HostApi the pack launch (producers) and the unpack launch (consumers).
int fused_role(const Dispatcher::Impl& d, bool consumers_only_when_alone) {
  if (d.R == 1) return consumers_only_when_alone ? ep::kConsume : ep::kProduce;
  return ep::kProduce | ep::kConsume | ep::kFlags;
}

}  // namespace

Dispatcher::Dispatcher(const MoeConfig& cfg, Communicator& comm, const DispatchOptions& opts)
    : impl_(std::make_unique<Impl>(cfg, comm, opts)) {
  constexpr std::string_view op = "Dispatcher";
  cfg.validate();
  Impl& d = *impl_;
  if (cfg.ep_size != comm.size())
    fail(op, "cfg.ep_size = ", cfg.ep_size, " but the communicator has ", comm.size(), " ranks");
  if (cfg.ep_size > ep::kMaxRanks)
    fail_with(ErrorCode::Unsupported, op, "cfg.ep_size = ", cfg.ep_size, " (at most ", ep::kMaxRanks, " ranks)");
  if (cfg.topk > ep::kMaxTopk) fail_with(ErrorCode::Unsupported, op, "cfg.topk = ", cfg.topk, " (at most 32)");
  if (cfg.dtype != DType::BF16 && cfg.dtype != DType::F32)
    fail_with(ErrorCode::Unsupported, op, "cfg.dtype = ", dtype_name(cfg.dtype), " (expected bf16 or f32)");
  d.elem = dtype_size(cfg.dtype);
  if ((std::size_t(cfg.hidden) * d.elem) % 16 != 0)
    fail_with(ErrorCode::Unsupported, op, "cfg.hidden = ", cfg.hidden, " (rows move in 16-byte vectors: hidden * ",
              d.elem, " bytes must be a multiple of 16)");
  if (opts.timeout_s <= 0) fail(op, "opts.timeout_s = ", opts.timeout_s, " (expected > 0)");
  if (opts.sms < 0) fail(op, "opts.sms = ", opts.sms, " (expected >= 0; 0 = default)");
  MOERAIL_CUDA_CHECK(cudaSetDevice(comm.device()));
  d.allocator = opts.allocator ? opts.allocator : &cuda_allocator();

  d.transport = comm.resolve(opts.transport);
  d.R = int(cfg.ep_size);
  d.me = comm.rank();
  d.E = int(cfg.num_experts);
  d.L = int(cfg.local_experts());
  d.K = int(cfg.topk);
  d.H = int(cfg.hidden);
  d.t_max = cfg.max_tokens;
  d.capacity = cfg.rows_per_rank();
  d.expert_cap = int(cfg.expert_rows());
  if (d.capacity >= (std::int64_t(1) << 31) || std::int64_t(d.R) * d.t_max * d.K >= (std::int64_t(1) << 31))
    fail_with(ErrorCode::Unsupported, op, "capacity ", d.capacity, " rows or R * T_max * K beyond 2^31");
  const int sms = cuda::sm_count();
  const int blocks = opts.sms > 0 ? std::min(opts.sms, sms) : default_blocks(sms);
  // one count on every rank: it sizes the staging layout (the handshake flags) and pairs blocks (ep::RemoteWork)
  d.blocks = d.R > 1 ? comm.all_reduce_min(blocks, nullptr) : blocks;
  d.chunks_max = int((d.t_max + ep::kChunk - 1) / ep::kChunk);

  // staging layout (identical on every rank)
  ep::Regions& g = d.reg;
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off += align256(bytes);
    return at;
  };
  const std::size_t R = std::size_t(d.R);
  g.xcount = take(R * std::size_t(d.E + 1) * 4);
  g.sig_count = take(R * 4);
  g.sig_entry = take(std::size_t(d.blocks) * R * 4);
  g.sig_data = take(R * std::size_t(d.chunks_max) * 4);
  g.sig_ret = take(R * std::size_t(d.chunks_max) * 4);
  g.meta = take(R * d.k_slice());
  g.probs = take(R * d.k_slice());
  g.ret = take(R * d.k_slice());
  g.stage = take(R * d.stage_slice());
  g.bytes = off;

  std::vector<char*> dst(R);
  if (d.nvlink()) {
    d.win = comm.alloc_window(g.bytes);
    d.total_bytes += d.win.bytes;
    d.local = static_cast<char*>(d.win.local);
    MOERAIL_CUDA_CHECK(cudaMemcpy(dst.data(), d.win.peers, R * sizeof(char*), cudaMemcpyDeviceToHost));
  } else {
    d.recv_area = static_cast<char*>(d.alloc(g.bytes));
    d.send_area = static_cast<char*>(d.alloc(g.bytes));
    d.local = d.recv_area;
    std::fill(dst.begin(), dst.end(), d.send_area);
  }
  d.dst = static_cast<char**>(d.alloc(R * sizeof(char*)));
  MOERAIL_CUDA_CHECK(cudaMemcpy(d.dst, dst.data(), R * sizeof(char*), cudaMemcpyHostToDevice));

  // the local planner (one GPU, A = 1): its dest_row minus its segment offset is a slot's place among this rank's
  // slots to the same expert
  d.local_cfg = cfg;
  d.local_cfg.ep_size = 1;
  d.local_cfg.align = 1;
  d.local_cfg.capacity = Capacity::worst_case();
  d.local_layout_mem = d.alloc(layout_buffers_bytes(d.local_cfg));
  d.local_layout = make_layout_buffers(d.local_cfg, d.local_layout_mem, comm.device(), d.t_max * d.K);
  d.local_ws_bytes = layout_workspace_bytes(d.local_cfg);
  d.local_ws = d.alloc(d.local_ws_bytes);
  d.scratch = static_cast<DeviceStatus*>(d.alloc(sizeof(DeviceStatus)));
  d.status = static_cast<DeviceStatus*>(d.alloc(sizeof(DeviceStatus)));
  reset_status(d.scratch, nullptr);
  reset_status(d.status, nullptr);
  d.epochs = static_cast<std::uint32_t*>(d.alloc(std::size_t(d.blocks + 1) * 4));
  if (const std::string prefix = env::ep_trace(); !prefix.empty() && !ep::kTraceBuilt) {
    log::warn("MOERAIL_EP_TRACE is set, but this build has no EP trace (configure with -DMOERAIL_EP_TRACE=ON)");
  } else if (!prefix.empty()) {
    d.trace = static_cast<unsigned long long*>(d.alloc(d.trace_words() * 8));
    d.trace_path = detail::concat(prefix, ".rank", d.me, ".jsonl");
  }

  // the plan's scratch, and the default handle
  d.base = static_cast<std::int32_t*>(d.alloc(std::size_t(d.E) * 4));
  d.limit = static_cast<std::int32_t*>(d.alloc(std::size_t(d.E) * 4));
  const std::size_t hb = handle_bytes();
  d.default_handle = make_handle(TensorView(d.alloc(hb), DType::Bool, {std::int64_t(hb)}, Device::cuda(comm.device())));
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
  if (!d.nvlink()) comm.barrier(nullptr);  // every rank set up before the first transfer
}

Dispatcher::~Dispatcher() {
  if (!impl_) return;
  Impl& d = *impl_;
  cudaSetDevice(d.comm.device());
  cudaDeviceSynchronize();
  if (d.win.memory) d.comm.free_window(d.win);
  d.buffers.clear();
}

Transport Dispatcher::transport() const { return impl_->transport; }
std::int64_t Dispatcher::capacity() const { return impl_->capacity; }
std::size_t Dispatcher::workspace_bytes() const { return impl_->total_bytes; }
std::size_t Dispatcher::window_bytes() const { return impl_->win.memory ? impl_->win.bytes : 0; }
int Dispatcher::blocks() const { return impl_->blocks; }
const EpLayout& Dispatcher::layout() const { return impl_->default_handle.layout(); }
DeviceStatus* Dispatcher::status() { return impl_->status; }

std::size_t Dispatcher::handle_bytes() const {
  const Impl& d = *impl_;
  std::size_t bytes = 0;
  lay_out_handle(d.R, d.L, d.slots(), [&](std::int64_t n) { bytes += align256(std::size_t(n) * 4); });
  return bytes;
}

DispatchHandle Dispatcher::make_handle(const TensorView& memory) const {
  constexpr std::string_view op = "Dispatcher::make_handle";
  const Impl& d = *impl_;
  const Device dev = Device::cuda(d.comm.device());
  check_device(op, "memory", memory, dev);
  if (memory.nbytes() < handle_bytes())
    fail(op, "memory has ", memory.nbytes(), " bytes (expected at least handle_bytes() = ", handle_bytes(), ")");
  if (reinterpret_cast<std::uintptr_t>(memory.data()) % 256 != 0) fail(op, "memory is not 256-byte aligned");
  std::vector<std::int32_t*> a;
  char* at = static_cast<char*>(memory.data());
  lay_out_handle(d.R, d.L, d.slots(), [&](std::int64_t n) {
    a.push_back(reinterpret_cast<std::int32_t*>(at));
    at += align256(std::size_t(n) * 4);
  });
  const auto L = std::int64_t(d.L), R = std::int64_t(d.R), K = std::int64_t(d.K);
  DispatchHandle h;
  h.owner_ = this;
  h.memory_ = memory;
  EpLayout& l = h.layout_;
  l.capacity = d.capacity;
  l.tokens = TensorView(a[0], DType::I32, {R}, dev);
  l.tokens_per_expert = TensorView(a[1], DType::I32, {L}, dev);
  l.padded_per_expert = TensorView(a[2], DType::I32, {L}, dev);
  l.segment_offset = TensorView(a[3], DType::I32, {L + 1}, dev);
  l.segment_rows = TensorView(a[4], DType::I32, {L}, dev);
  h.pad_prefix_ = a[5];
  l.rows_used = TensorView(a[6], DType::I32, {1}, dev);
  l.dest_rank = TensorView(a[7], DType::I32, {d.t_max, K}, dev);
  l.dest_row = TensorView(a[8], DType::I32, {d.t_max, K}, dev);
  h.slot_rows_ = a[9];
  h.slot_probs_ = reinterpret_cast<float*>(a[10]);
  return h;
}

void Dispatcher::Impl::dump_trace(cudaStream_t stream) {
  std::vector<unsigned long long> h(trace_words());
  MOERAIL_CUDA_CHECK(cudaMemcpyAsync(h.data(), trace, h.size() * 8, cudaMemcpyDeviceToHost, stream));
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  MOERAIL_CUDA_CHECK(cudaMemsetAsync(trace, 0, h.size() * 8, stream));
  std::ofstream f(trace_path, std::ios::app);
  if (!f) {  // a developer trace must not hide what check() is for
    log::warn("MOERAIL_EP_TRACE: cannot append to ", trace_path, "; trace of rank ", me, " dropped");
    return;
  }
  f << "{\"seq\": " << trace_seq++ << ", \"op\": \"" << last_op << "\", \"rank\": " << me << ", \"blocks\": " << blocks
    << ", \"warps\": " << ep::kWarps << ", \"slots\": " << ep::kTraceSlots << ", \"stamps\": [";
  for (std::size_t i = 0; i < h.size(); ++i) f << (i ? "," : "") << h[i];
  f << "]}\n";
}

void Dispatcher::check(cudaStream_t stream) {
  Impl& d = *impl_;
  if (d.trace) d.dump_trace(stream);
  const StatusReport r = read_status(d.status, stream);
  if (r.ok()) return;
  reset_status(d.status, stream);
  r.raise_if_bad(detail::concat("dispatch (rank ", d.me, " of ", d.R, ")"), &d.cfg.capacity);
}

// ---- argument checks ----------------------------------------------------------------------------------------------

namespace {

void check_rows(std::string_view op, std::string_view name, const TensorView& v, const Dispatcher::Impl& d,
                std::int64_t min_rows) {
  check_shape(op, name, v, {-1, std::int64_t(d.H)});
  check_dtype(op, name, v, {d.cfg.dtype});
  check_device(op, name, v, Device::cuda(d.comm.device()));
  if (v.size(0) < min_rows) fail(op, name, " has ", v.size(0), " rows (expected at least ", min_rows, ")");
  if (!cuda::aligned16(v.data())) fail(op, name, " is not 16-byte aligned");
}

void check_vec(std::string_view op, std::string_view name, const TensorView& v, const Dispatcher::Impl& d,
               std::initializer_list<std::int64_t> shape, DType t) {
  check_shape(op, name, v, shape);
  check_dtype(op, name, v, {t});
  check_device(op, name, v, Device::cuda(d.comm.device()));
}

}  // namespace

// ---- ops ------------------------------------------------------------------------------------------------------------

namespace {

// What plan(), dispatch() and dispatch_fp8() check alike: the routing inputs.
void check_routing(std::string_view op, const Dispatcher::Impl& d, const TensorView& topk_idx, const TensorView& probs,
                   const TensorView& num_tokens) {
  const std::int64_t T = d.t_max, K = d.K;
  check_vec(op, "topk_idx", topk_idx, d, {T, K}, DType::I32);
  check_vec(op, "probs", probs, d, {T, K}, DType::F32);
  check_vec(op, "num_tokens", num_tokens, d, {1}, DType::I32);
}

void check_recv_probs(std::string_view op, const Dispatcher::Impl& d, const TensorView& recv_probs,
                      std::int64_t rows) {
  check_vec(op, "recv_probs", recv_probs, d, {recv_probs.defined() ? recv_probs.size(0) : 0}, DType::F32);
  if (recv_probs.size(0) < rows)
    fail(op, "recv_probs has ", recv_probs.size(0), " rows (expected at least ", rows, ")");
}

// 32-bit scale words per row of an FP8 dispatch: H / 128 f32 scales (Block1x128), H / 32 E8M0 bytes = H / 128 words
// (Mx1x32), none (PerTensor: one scale for all rows, given by the caller).
std::int64_t fp8_scale_words(Fp8Scaling s, std::int64_t H) {
  return s == Fp8Scaling::PerTensor ? 0 : H / kBlockScaleCols;
}

// The staged row of an FP8 dispatch: H e4m3 bytes, then the scale words, rounded up to 16 bytes.
std::size_t fp8_wire_bytes(Fp8Scaling s, std::int64_t H) {
  return (std::size_t(H) + std::size_t(fp8_scale_words(s, H)) * 4 + 15) / 16 * 16;
}

// Plans a dispatch: the local planner, the count exchange and this rank's layout (into h, base and limit).
void plan_dispatch(Dispatcher::Impl& d, const DispatchHandle& h, const TensorView& topk_idx, const TensorView& probs,
                   const TensorView& num_tokens, cudaStream_t stream) {
  LayoutArgs la;
  la.topk_idx = topk_idx;
  la.topk_probs = probs;
  la.num_tokens = num_tokens;
  la.out = d.local_layout;
  la.status = d.scratch;
  la.workspace = TensorView(d.local_ws, DType::I32, {std::int64_t(d.local_ws_bytes / 4)}, topk_idx.device());
  plan_layout(d.local_cfg, la, stream);
  launch_plan(d, h, num_tokens, stream);
}

// Plans this step (unless plan() did), then moves the rows: one fused launch on NvLink, pack -> send/recv -> unpack
// on HostApi. `p` holds the payload fields (rows, vectors, FP8 fields); `kernel` is the scatter_kernel instance for
// it; stage_row is the bytes of one staged row.
template <typename Kernel>
void plan_and_scatter(Dispatcher::Impl& d, const DispatchHandle& h, bool planned, const TensorView& topk_idx,
                      const TensorView& probs, const TensorView& num_tokens, ep::Params p, Kernel kernel,
                      std::size_t stage_row, cudaStream_t stream) {
  if (!planned) plan_dispatch(d, h, topk_idx, probs, num_tokens, stream);

  p.num_tokens = num_tokens.as<const std::int32_t>();
  p.topk_idx = topk_idx.as<const std::int32_t>();
  p.probs = probs.as<const float>();
  if (d.nvlink() || d.R == 1) {
    p.role = fused_role(d, false);
    p.zero_pads = true;
    launch_data(d, kernel, p, stream);
    return;
  }
  p.role = ep::kProduce;
  launch_data(d, kernel, p, stream);
  d.transfer(d.reg.meta, d.k_slice(), stream, "dispatch (send/recv)");
  d.transfer(d.reg.probs, d.k_slice(), stream, "dispatch (send/recv)");
  d.transfer(d.reg.stage, std::size_t(d.t_max) * stage_row, stream, "dispatch (send/recv)");
  p.role = ep::kConsume;
  p.zero_pads = true;
  launch_data(d, kernel, p, stream);
}

}  // namespace

std::int64_t Dispatcher::plan(const EpPlanArgs& a, DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "plan";
  Impl& d = *impl_;
  d.last_op = "plan";
  Impl::check_handle(op, this, h, false);
  check_routing(op, d, a.topk_idx, a.probs, a.num_tokens);
  d.planned = nullptr;
  h.planned_ = {};
  h.filled_ = false;
  plan_dispatch(d, h, a.topk_idx, a.probs, a.num_tokens, stream);
  std::int32_t rows = 0;
  MOERAIL_CUDA_CHECK(cudaMemcpyAsync(&rows, h.layout().rows_used.data(), sizeof rows, cudaMemcpyDeviceToHost, stream));
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  h.layout_.capacity = rows;
  h.planned_ = {a.topk_idx.data(), a.probs.data(), a.num_tokens.data()};
  d.planned = h.memory_.data();
  return rows;
}

void Dispatcher::dispatch(const EpDispatchArgs& a, DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "dispatch";
  Impl& d = *impl_;
  d.last_op = "dispatch";
  Impl::check_handle(op, this, h, false);
  check_routing(op, d, a.topk_idx, a.probs, a.num_tokens);
  const std::int64_t rows = d.rows_for(op, h, a.topk_idx, a.probs, a.num_tokens);
  check_rows(op, "x", a.x, d, d.t_max);
  check_rows(op, "recv", a.recv, d, rows);
  check_recv_probs(op, d, a.recv_probs, rows);
  const bool planned = d.take_plan(h);
  h.filled_ = false;
  with_dtype(d.cfg.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    ep::Params p = d.params(0, h);
    p.tok_src = a.x.data();
    p.row_dst = a.recv.data();
    p.recv_probs = a.recv_probs.as<float>();
    plan_and_scatter(d, h, planned, a.topk_idx, a.probs, a.num_tokens, p, ep::scatter_kernel<T_, true>,
                     std::size_t(p.nvec) * 16, stream);
  });
  h.filled_ = true;
}

void Dispatcher::dispatch_fp8(const EpDispatchFp8Args& a, DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "dispatch_fp8";
  Impl& d = *impl_;
  d.last_op = "dispatch_fp8";
  Impl::check_handle(op, this, h, false);
  check_routing(op, d, a.topk_idx, a.probs, a.num_tokens);
  const std::int64_t rows = d.rows_for(op, h, a.topk_idx, a.probs, a.num_tokens);
  if (d.cfg.dtype != DType::BF16)
    fail_with(ErrorCode::Unsupported, op, "cfg.dtype = ", dtype_name(d.cfg.dtype), " (expected bf16: x is quantized)");
  const Fp8Scaling sc = a.scaling;
  if (sc != Fp8Scaling::PerTensor && sc != Fp8Scaling::Block1x128 && sc != Fp8Scaling::Mx1x32)
    fail(op, "scaling = ", int(sc), " is not one of {PerTensor, Block1x128, Mx1x32}");
  if (d.H % kBlockScaleCols != 0)
    fail_with(ErrorCode::Unsupported, op, "cfg.hidden = ", d.H, " (the FP8 dispatch quantizes 128-column groups of ",
              "16 columns per lane: expected a multiple of ", kBlockScaleCols, ")");
  const std::int64_t H = d.H;
  const Device dev = Device::cuda(d.comm.device());
  check_rows(op, "x", a.x, d, d.t_max);
  check_shape(op, "recv", a.recv, {-1, H});
  check_dtype(op, "recv", a.recv, {DType::F8E4M3});
  check_device(op, "recv", a.recv, dev);
  if (a.recv.size(0) < rows) fail(op, "recv has ", a.recv.size(0), " rows (expected at least ", rows, ")");
  if (!cuda::aligned16(a.recv.data())) fail(op, "recv is not 16-byte aligned");
  check_device(op, "recv_scales", a.recv_scales, dev);
  check_dtype(op, "recv_scales", a.recv_scales, {fp8_scale_dtype(sc)});
  if (sc == Fp8Scaling::PerTensor) {
    check_shape(op, "recv_scales", a.recv_scales, {1});
  } else {
    check_shape(op, "recv_scales", a.recv_scales, {-1, H / fp8_scale_block_cols(sc)});
    if (a.recv_scales.size(0) < rows)
      fail(op, "recv_scales has ", a.recv_scales.size(0), " rows (expected at least ", rows, ")");
    if (reinterpret_cast<std::uintptr_t>(a.recv_scales.data()) % 4 != 0)
      fail(op, "recv_scales is not 4-byte aligned (its rows are moved as 32-bit words)");
  }
  check_recv_probs(op, d, a.recv_probs, rows);
  const bool planned = d.take_plan(h);
  h.filled_ = false;

  ep::Params p = d.params(0, h);
  p.nvec = H / 16;          // e4m3 rows of recv
  p.src_nvec = H * 2 / 16;  // bf16 rows of x
  p.scale_cols = int(fp8_scale_words(sc, H));
  p.wire_bytes = fp8_wire_bytes(sc, H);
  p.tok_src = a.x.data();
  p.row_dst = a.recv.data();
  p.recv_probs = a.recv_probs.as<float>();
  if (sc == Fp8Scaling::PerTensor) {
    p.recv_scales = nullptr;
    p.tensor_scale = a.recv_scales.as<const float>();
  } else {
    p.recv_scales = static_cast<std::uint32_t*>(a.recv_scales.data());
    p.pad_scale_word = sc == Fp8Scaling::Block1x128 ? 0x3f800000u   // 1.0f
                                                    : 0x7f7f7f7fu;  // four E8M0 codes 127 = 2^0
  }
  switch (sc) {
    case Fp8Scaling::PerTensor:
      plan_and_scatter(d, h, planned, a.topk_idx, a.probs, a.num_tokens, p,
                       ep::scatter_kernel<__nv_bfloat16, true, ep::Payload::Fp8PerTensor>, p.wire_bytes, stream);
      break;
    case Fp8Scaling::Block1x128:
      plan_and_scatter(d, h, planned, a.topk_idx, a.probs, a.num_tokens, p,
                       ep::scatter_kernel<__nv_bfloat16, true, ep::Payload::Fp8Block1x128>, p.wire_bytes, stream);
      break;
    case Fp8Scaling::Mx1x32:
      plan_and_scatter(d, h, planned, a.topk_idx, a.probs, a.num_tokens, p,
                       ep::scatter_kernel<__nv_bfloat16, true, ep::Payload::Fp8Mx1x32>, p.wire_bytes, stream);
      break;
  }
  h.filled_ = true;
}

void Dispatcher::combine(const EpCombineArgs& a, const DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "combine";
  Impl& d = *impl_;
  d.last_op = "combine";
  Impl::check_handle(op, this, h, true);
  check_rows(op, "y", a.y, d, h.layout().capacity);
  check_rows(op, "out", a.out, d, d.t_max);
  with_dtype(d.cfg.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    ep::Params p = d.params(0, h);
    p.num_tokens = p.tokens + d.me;  // T as the handle's dispatch exchanged it
    p.in_combine = a.mode == ProbMode::InCombine;
    p.row_src = a.y.data();
    p.tok_dst = a.out.data();
    if (d.nvlink() || d.R == 1) {
      p.role = fused_role(d, true);
      launch_gather<T_, true>(d, p, stream);
      return;
    }
    p.role = ep::kProduce;
    launch_gather<T_, true>(d, p, stream);
    d.transfer(d.reg.stage, d.stage_slice(), stream, "combine (send/recv)");
    p.role = ep::kConsume;
    launch_gather<T_, true>(d, p, stream);
  });
}

void Dispatcher::dispatch_backward(const EpDispatchBackwardArgs& a, const DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "dispatch_backward";
  Impl& d = *impl_;
  d.last_op = "dispatch_backward";
  Impl::check_handle(op, this, h, true);
  check_rows(op, "d_recv", a.d_recv, d, h.layout().capacity);
  check_rows(op, "dx", a.dx, d, d.t_max);
  if (a.d_recv_probs.defined() != a.d_probs.defined())
    fail(op, "d_recv_probs and d_probs must be given together (or neither)");
  if (a.d_probs.defined()) {
    check_vec(op, "d_probs", a.d_probs, d, {d.t_max, std::int64_t(d.K)}, DType::F32);
    check_vec(op, "d_recv_probs", a.d_recv_probs, d, {a.d_recv_probs.size(0)}, DType::F32);
    if (a.d_recv_probs.size(0) < h.layout().capacity)
      fail(op, "d_recv_probs has ", a.d_recv_probs.size(0), " rows (expected at least ", h.layout().capacity, ")");
  }
  with_dtype(d.cfg.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    ep::Params p = d.params(0, h);
    p.num_tokens = p.tokens + d.me;  // T as the handle's dispatch exchanged it
    p.row_src = a.d_recv.data();
    p.tok_dst = a.dx.data();
    p.d_recv_probs = a.d_recv_probs.defined() ? a.d_recv_probs.as<const float>() : nullptr;
    p.d_probs = a.d_probs.defined() ? a.d_probs.as<float>() : nullptr;
    if (d.nvlink() || d.R == 1) {
      p.role = fused_role(d, true);
      launch_gather<T_, false>(d, p, stream);
      return;
    }
    p.role = ep::kProduce;
    launch_gather<T_, false>(d, p, stream);
    d.transfer(d.reg.stage, d.stage_slice(), stream, "dispatch_backward (send/recv)");
    if (p.d_probs) d.transfer(d.reg.ret, d.k_slice(), stream, "dispatch_backward (send/recv)");
    p.role = ep::kConsume;
    launch_gather<T_, false>(d, p, stream);
  });
}

void Dispatcher::combine_backward(const EpCombineBackwardArgs& a, const DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "combine_backward";
  Impl& d = *impl_;
  d.last_op = "combine_backward";
  Impl::check_handle(op, this, h, true);
  const bool in_combine = a.mode == ProbMode::InCombine;
  const std::int64_t rows = h.layout().capacity;
  check_rows(op, "d_out", a.d_out, d, d.t_max);
  check_rows(op, "d_y", a.d_y, d, rows);
  if (in_combine) check_rows(op, "y", a.y, d, rows);
  if (a.d_probs.defined()) check_vec(op, "d_probs", a.d_probs, d, {d.t_max, std::int64_t(d.K)}, DType::F32);
  with_dtype(d.cfg.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    ep::Params p = d.params(0, h);
    p.num_tokens = p.tokens + d.me;  // T as the handle's dispatch exchanged it
    p.in_combine = in_combine;
    p.tok_src = a.d_out.data();
    p.row_dst = a.d_y.data();
    p.y = in_combine ? a.y.data() : nullptr;
    p.d_probs = a.d_probs.defined() ? a.d_probs.as<float>() : nullptr;
    if (d.nvlink() || d.R == 1) {
      p.role = fused_role(d, false) | ep::kCollect;
      p.zero_pads = true;
      launch_data(d, ep::scatter_kernel<T_, false>, p, stream);
      return;
    }
    p.role = ep::kProduce;
    launch_data(d, ep::scatter_kernel<T_, false>, p, stream);
    d.transfer(d.reg.stage, d.stage_slice(), stream, "combine_backward (send/recv)");
    p.role = ep::kConsume;
    p.zero_pads = true;
    launch_data(d, ep::scatter_kernel<T_, false>, p, stream);
    if (in_combine && p.d_probs) {
      d.transfer(d.reg.ret, d.k_slice(), stream, "combine_backward (send/recv)");
      p.role = ep::kCollect;
      p.zero_pads = false;
      launch_data(d, ep::scatter_kernel<T_, false>, p, stream);
    }
  });
}

namespace {

// Rows [*used, capacity) of `rows` (row_vecs 16-byte vectors each) and of `probs` (if any) set to zero.
__global__ void zero_rows_past_kernel(uint4* rows, long long row_vecs, float* probs, const std::int32_t* used,
                                      long long capacity) {
  const long long first = min((long long)max(*used, 0), capacity);
  const long long n = (capacity - first) * row_vecs;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    rows[first * row_vecs + i] = make_uint4(0, 0, 0, 0);
  if (probs)
    for (long long r = first + (long long)blockIdx.x * blockDim.x + threadIdx.x; r < capacity; r += stride)
      probs[r] = 0.f;
}

}  // namespace

void Dispatcher::zero_unused_rows(const TensorView& recv, const TensorView& recv_probs, const DispatchHandle& h,
                                  cudaStream_t stream) {
  constexpr std::string_view op = "zero_unused_rows";
  Impl& d = *impl_;
  Impl::check_handle(op, this, h, true);
  const std::int64_t rows = h.layout().capacity;
  const Device dev = Device::cuda(d.comm.device());
  check_device(op, "recv", recv, dev);
  if (recv.ndim() != 2 || recv.size(0) < rows)
    fail(op, "recv has shape ", recv.shape_str(), " (expected [>= ", rows, ", columns])");
  const std::size_t row_bytes = std::size_t(recv.size(1)) * dtype_size(recv.dtype());
  if (row_bytes % 16 != 0 || !cuda::aligned16(recv.data()))
    fail(op, "recv rows are ", row_bytes, " bytes at ", recv.data(), " (expected 16-byte aligned rows)");
  if (recv_probs.defined()) {
    check_vec(op, "recv_probs", recv_probs, d, {recv_probs.size(0)}, DType::F32);
    if (recv_probs.size(0) < rows)
      fail(op, "recv_probs has ", recv_probs.size(0), " rows (expected at least ", rows, ")");
  }
  zero_rows_past_kernel<<<std::max(1, cuda::sm_count() * 4), 256, 0, stream>>>(
      static_cast<uint4*>(recv.data()), (long long)(row_bytes / 16),
      recv_probs.defined() ? recv_probs.as<float>() : nullptr, h.layout().rows_used.as<const std::int32_t>(),
      (long long)rows);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

// ---- the default handle: one microbatch at a time ------------------------------------------------------------------

void Dispatcher::dispatch(const EpDispatchArgs& a, cudaStream_t stream) { dispatch(a, impl_->default_handle, stream); }
void Dispatcher::dispatch_fp8(const EpDispatchFp8Args& a, cudaStream_t stream) {
  dispatch_fp8(a, impl_->default_handle, stream);
}
void Dispatcher::combine(const EpCombineArgs& a, cudaStream_t stream) { combine(a, impl_->default_handle, stream); }
void Dispatcher::dispatch_backward(const EpDispatchBackwardArgs& a, cudaStream_t stream) {
  dispatch_backward(a, impl_->default_handle, stream);
}
void Dispatcher::combine_backward(const EpCombineBackwardArgs& a, cudaStream_t stream) {
  combine_backward(a, impl_->default_handle, stream);
}

}  // namespace moerail
