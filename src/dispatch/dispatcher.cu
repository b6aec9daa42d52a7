// Expert-parallel dispatch and combine (include/moerail/dispatch.h), setup: construction (the staging area of the
// transport, the planner's scratch, the status word), handles, and check(). The ops: dispatcher_ops.cu.
#include <fstream>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/env.h"
#include "core/log.h"
#include "dispatch/dispatcher_impl.h"

namespace moerail {
namespace {

using dispatch_detail::align256;

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
// dest_row [T_max K], slot_rows [R T_max K]; f32 slot_probs [R T_max K]; i32 staged [R], stage_pos [T_max K];
// hierarchical: i32 node_staged [N], node_tok [N node_rows], node_fan and fwd_fan [N node_rows G] (else empty). One function
// walks the layout for both the size and the views.
template <typename Take>
void lay_out_handle(int R, int L, std::int64_t slots, int G, int N, std::int64_t node_rows, Take&& take) {
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
  take(R);
  take(slots);
  const bool hier = G > 0;
  take(hier ? N : 0);
  take(hier ? N * node_rows : 0);
  take(hier ? N * node_rows * G : 0);
  take(hier ? N * node_rows * G : 0);
}

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
  if (cfg.dtype != DType::BF16 && cfg.dtype != DType::F16 && cfg.dtype != DType::F32)
    fail_with(ErrorCode::Unsupported, op, "cfg.dtype = ", dtype_name(cfg.dtype), " (expected bf16, f16 or f32)");
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
  d.compact = d.transport == Transport::HostApi && cfg.ep_size > 1;
  d.peer_rows = d.compact ? cfg.peer_rows() : cfg.max_tokens;
  d.expert_cap = int(cfg.expert_rows());
  if (opts.ranks_per_node < -1 || (opts.ranks_per_node > 0 && d.R % opts.ranks_per_node != 0))
    fail(op, "opts.ranks_per_node = ", opts.ranks_per_node, " (expected -1, 0 or a divisor of the ", d.R, " ranks)");
  if (const int g = ep::node_ranks(opts.ranks_per_node, comm.lsa_ranks(), d.R); g > 0) {
    if (!d.compact)
      fail_with(ErrorCode::Unsupported, op, "opts.ranks_per_node = ", opts.ranks_per_node,
                ": hierarchical transfers need the host-API transport (the NVLink path has every rank in one node)");
    d.G = g;
    d.N = d.R / d.G;
    d.node_rows = std::min<std::int64_t>(d.t_max, std::int64_t(d.G) * d.peer_rows);
  }
  if (d.capacity >= (std::int64_t(1) << 31) || std::int64_t(d.R) * d.t_max * d.K >= (std::int64_t(1) << 31))
    fail_with(ErrorCode::Unsupported, op, "capacity ", d.capacity, " rows or R * T_max * K beyond 2^31");
  const int sms = cuda::sm_count();
  int blocks = opts.sms > 0 ? std::min(opts.sms, sms) : default_blocks(sms);
  // in-process ranks of one GPU (LoopbackGroup) on the NVLink path: every rank's kernels wait on the others', so all
  // must be resident at once
  if (comm.loopback() && d.transport == Transport::NvLink) blocks = std::min(blocks, std::max(1, sms / d.R));
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
  g.xcount = take(R * std::size_t(d.xrow()) * 4);
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
  if (d.hier()) {
    const std::size_t rows = std::size_t(d.N) * std::size_t(d.node_rows), widest = d.row_bytes();
    d.union_send = static_cast<char*>(d.alloc(rows * widest));
    d.union_recv = static_cast<char*>(d.alloc(rows * widest));
    d.fan_recv = static_cast<std::int32_t*>(d.alloc(rows * std::size_t(d.G) * 4));
    d.fwd_send = static_cast<char*>(d.alloc(std::size_t(d.R) * std::size_t(d.peer_rows) * widest));
    const std::size_t part_bytes = std::size_t(d.R) * std::size_t(d.peer_rows) * std::size_t(d.H) * 4;
    d.part_send = static_cast<float*>(d.alloc(part_bytes));
    d.part_recv = static_cast<float*>(d.alloc(part_bytes));
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
std::int64_t Dispatcher::peer_rows() const { return impl_->peer_rows; }
int Dispatcher::ranks_per_node() const { return impl_->G; }
std::int64_t Dispatcher::node_rows() const { return impl_->node_rows; }
const EpLayout& Dispatcher::layout() const { return impl_->default_handle.layout(); }
DeviceStatus* Dispatcher::status() { return impl_->status; }

std::size_t Dispatcher::handle_bytes() const {
  const Impl& d = *impl_;
  std::size_t bytes = 0;
  lay_out_handle(d.R, d.L, d.slots(), d.G, d.N, d.node_rows,
                 [&](std::int64_t n) { bytes += align256(std::size_t(n) * 4); });
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
  lay_out_handle(d.R, d.L, d.slots(), d.G, d.N, d.node_rows, [&](std::int64_t n) {
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
  h.staged_ = a[11];
  h.stage_pos_ = a[12];
  if (d.hier()) {
    l.node_staged = TensorView(a[13], DType::I32, {std::int64_t(d.N)}, dev);
    h.node_tok_ = a[14];
    h.node_fan_ = a[15];
    h.fwd_fan_ = a[16];
  }
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


}  // namespace moerail
