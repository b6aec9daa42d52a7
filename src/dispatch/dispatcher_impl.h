// src/dispatch/dispatcher_impl.h — what the Dispatcher's two source files share: its state (Dispatcher::Impl:
// the staging area, the planner's scratch, the status word, the default handle) and the kernel parameters it
// builds. dispatcher.cu sets it up (construction, handles, check()); dispatcher_ops.cu runs the ops.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "dispatch/ep_common.cuh"
#include "dispatch/ep_plan.h"
#include "dispatch/ep_trace.cuh"
#include "moerail/dispatch.h"
#include "moerail/error.h"
#include "moerail/layout.h"

namespace moerail {
namespace dispatch_detail {
inline std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }
}  // namespace dispatch_detail

struct Dispatcher::Impl {
  MoeConfig cfg;
  Communicator& comm;
  DispatchOptions opts;
  DeviceAllocator* allocator = nullptr;
  Transport transport = Transport::HostApi;
  int R = 1, me = 0, E = 0, L = 0, K = 0, H = 0, blocks = 0, chunks_max = 0, expert_cap = 0;
  std::int64_t t_max = 0, capacity = 0;
  // HostApi with peers: a source stages for each peer only the tokens routed there, at most peer_rows of them, in
  // token order (the rows sent per peer and op); NvLink (and one rank): staged rows are indexed by token
  bool compact = false;
  std::int64_t peer_rows = 0;
  // Hierarchical transfers (compact, ranks_per_node G in (0, R); ep_hier.cuh): N nodes of G ranks; a source sends
  // each remote node at most node_rows union rows. Its buffers: union rows out and in ([N][node_rows] rows of the
  // widest staged row), the node plans the rail sources sent ([N][node_rows][G] i32), and the forwarded segments
  // ([G][N][peer_rows] rows).
  int G = 0, N = 1;
  std::int64_t node_rows = 0;
  char* union_send = nullptr;
  char* union_recv = nullptr;
  std::int32_t* fan_recv = nullptr;
  char* fwd_send = nullptr;
  // The sums (combine, dispatch backward): the fp32 partials of this rank's slots of the tokens of remote sources,
  // for the forwarder of each ([G][N][peer_rows] rows of H), and those the node's ranks sent this rank likewise.
  float* part_send = nullptr;
  float* part_recv = nullptr;
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
    bytes = dispatch_detail::align256(std::max<std::size_t>(bytes, 16));
    DeviceBuffer& b = buffers.emplace_back(*allocator, bytes);
    MOERAIL_CUDA_CHECK(cudaMemset(b.data(), 0, bytes));
    total_bytes += bytes;
    return b.data();
  }

  std::int64_t slots() const { return t_max * K; }
  // i32 per rank in the count exchange: E slot counts and T; with compact staging also the rows staged per rank
  int xrow() const { return E + 1 + (compact ? R : 0); }

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
    p.plan.expert_cap = expert_cap;
    p.tok.local_row = local_layout.dest_row.as<const std::int32_t>();
    p.tok.local_off = local_layout.segment_offset.as<const std::int32_t>();
    p.tok.base = base;
    p.tok.limit = limit;
    const EpLayout& l = h.layout();
    p.plan.tokens = l.tokens.as<const std::int32_t>();
    p.plan.dest_rank = l.dest_rank.as<std::int32_t>();
    p.plan.dest_row = l.dest_row.as<std::int32_t>();
    p.plan.slot_rows = h.slot_rows_;
    p.plan.slot_probs = h.slot_probs_;
    p.plan.staged = h.staged_;
    p.plan.stage_pos = h.stage_pos_;
    p.plan.compact = compact;
    p.plan.peer_rows = int(peer_rows);
    p.plan.node_ranks = 0;
    p.xrow = xrow();
    p.rows.seg_offset = l.segment_offset.as<const std::int32_t>();
    p.rows.tpe = l.tokens_per_expert.as<const std::int32_t>();
    p.rows.pad_prefix = h.pad_prefix_;
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
    o.staged = h.staged_;
    return o;
  }

  bool nvlink() const { return transport == Transport::NvLink; }
  bool hier() const { return G > 0; }
  // The node plan in a handle (hierarchical): the token of each union row, and its places at the node's ranks.
  static std::int32_t* node_tok(const DispatchHandle& h) { return h.node_tok_; }
  static std::int32_t* node_fan(const DispatchHandle& h) { return h.node_fan_; }
  static std::int32_t* fwd_fan(const DispatchHandle& h) { return h.fwd_fan_; }

  // HostApi: every peer's slice of region `off` (t_max rows of `row_bytes` apart) moves from send_area to that
  // peer's recv_area, for all peers at once: its first peer_rows rows (all t_max unless compact).
  void transfer(std::size_t off, std::size_t row_bytes, cudaStream_t stream, const char* op) {
    comm.exchange(send_area + off, recv_area + off, std::size_t(t_max) * row_bytes, std::size_t(peer_rows) * row_bytes,
                  stream, op);
  }

  // The same for rows moving from the token side to the expert side (a dispatch's staged rows, a combine backward's
  // gradients) of the dispatch of `h`: through the forwarders (ep_hier.cuh) when hierarchical, else transfer().
  // `fan_to`: where the node plans the rail sources send land (the handle's fwd_fan in a dispatch).
  void transfer_down(std::size_t off, std::size_t row_bytes, const DispatchHandle& h, std::int32_t* fan_to,
                     cudaStream_t stream, const char* op);

  std::size_t row_bytes() const { return std::size_t(H) * elem; }
  std::size_t k_row() const { return std::size_t(K) * 4; }
  std::size_t stage_slice() const { return std::size_t(t_max) * std::size_t(H) * elem; }
  std::size_t k_slice() const { return std::size_t(t_max) * std::size_t(K) * 4; }
};

}  // namespace moerail
