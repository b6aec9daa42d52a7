// moerail/dispatch.h — expert-parallel dispatch and combine across the ranks of a Communicator, forward and
// backward, fused with permute + alignment padding (dispatch) and unpermute + the weighted sum (combine).
//
// Contract (docs/design.md; executable form: moerail::ref dispatch/combine over the plan of ref::plan_layout):
//   dispatch           recv[row(t,k)] = x[t], recv_probs[row(t,k)] = p[t,k] on the rank owning expert topk_idx[t,k];
//                      rows expert-major, inside an expert by source rank, token, k; each segment padded with zero
//                      rows to a multiple of A. Ranks bring different T (0 included): nothing is padded to the
//                      largest rank.
//   combine            out[t] = sum over ranks r in rank order of P_r(t), P_r(t) = sum over the slots k of t on
//                      rank r, in k order, of w(t,k) * y[row(t,k)] in fp32; w = p[t,k] (the probs given to dispatch)
//                      under ProbMode::InCombine, else 1. A partial P_r from another rank crosses the link once per
//                      (token, rank), rounded once to the activation dtype (ref: Reduction::PerRank).
//   dispatch backward  dx[t] = the same per-rank sum of d_recv rows (w = 1); d_probs[t,k] = d_recv_probs[row(t,k)].
//   combine backward   d_y[row(t,k)] = w(t,k) * d_out[t] (pad rows 0); d_probs[t,k] = <y[row(t,k)], d_out[t]> (fp32)
//                      under InCombine, else 0.
// Every sum has a fixed order: the results are deterministic, whatever the timing.
//
// Wire bytes: one row per (token, remote rank) in every direction, never one per (token, expert); with
// hierarchical transfers (DispatchOptions::ranks_per_node) a dispatch's rows cross between nodes once per (token,
// remote node).
//
// Transports: NvLink — one kernel per op stores rows straight into the peers' symmetric windows and raises a
// per-chunk flag; the receiving warps of the same kernel expand each chunk into the expert layout as it lands.
// HostApi — the same kernels pack into a send buffer, grouped ncclSend/ncclRecv move fixed-size segments, and an
// unpack kernel expands. A source packs for each peer only its tokens routed there, at most cfg.peer_rows() of them
// (T_max under Capacity::worst_case()), and sends that many rows; the slots there of its later tokens are dropped at
// the source, counted in its status word and reported by check(). Identical results when nothing is dropped.
//
// Graph safety: T and all counts are read on the device; dispatch() exchanges the per-expert counts itself (inside
// a kernel on NvLink, ncclAllGather on HostApi). No op allocates or synchronizes the host (but plan(), below); all
// others can be captured in a CUDA graph after the first eager call of the HostApi path (NCCL connects lazily).
//
// Microbatches in flight: a dispatch writes its layout (the plan) into a DispatchHandle, and its combine and both
// backward passes read it from there. Any number of handles may be in flight: the dispatches of several
// microbatches, then their combines and backward passes in any order, each with its own handle (a captured graph
// holds the handles it was recorded with). What the handles share is the Dispatcher's: the staging area (window or
// send/receive buffers), the planner's scratch and the status word. So the ops of one Dispatcher run one at a time
// (stream-ordered, not on two streams at once) and are collective: every rank issues them in the same order.
// The forms without a handle use the Dispatcher's own default handle (one microbatch at a time).
//
// Exact-size buffers (plan()): the buffers of a dispatch are capacity() rows, the worst case cfg allows, so that
// nothing is read on the host. A dispatch may instead be planned first: plan() exchanges the counts, reads on the
// host how many rows land on this rank (one synchronization, as a framework's dropless all-to-all makes) and the
// ops of that dispatch then take buffers of exactly those rows. Not capturable.
//
// Bad input and capacity: as in layout.h; overflowing rows are dropped at the source (never written), counted in
// the destination rank's status word; under Capacity::PerExpert an expert's rows past its segment of
// cfg.expert_rows() rows are the overflow. Spin-waits are bounded (DispatchOptions::timeout_s) and a timeout is
// recorded in the status too. check() turns the word into an Error that names this rank.
//
// Memory: what the Dispatcher holds comes from DispatchOptions::allocator (but the NVLink window, from NCCL:
// window_bytes()); a handle lives in memory the caller gives (handle_bytes(): the plan, O(R T_max K) int32 words).
// Rows of recv / d_y past the last segment are never written; nothing is zero-filled but pad rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "moerail/comm.h"
#include "moerail/config.h"
#include "moerail/layout.h"
#include "moerail/memory.h"
#include "moerail/quant.h"
#include "moerail/status.h"
#include "moerail/tensor.h"

namespace moerail {

struct DispatchOptions {
  Transport transport = Transport::Auto;
  int sms = 0;             // blocks of the data kernels, one per SM (0 = every SM). A block waits only on the
                           // block of its index on each peer, so a collective of another stream that holds some
                           // SMs (data-parallel NCCL beside the backward) delays only those pairs (docs/dispatch.md).
                           // Fewer leave SMs to kernels beside. The smallest over the ranks is used.
  double timeout_s = 60.0; // bounded spin-waits on peers
  DeviceAllocator* allocator = nullptr;  // where the Dispatcher's device memory comes from (null = cudaMalloc);
                                         // must outlive it. Not the NVLink window (NCCL's).
  // Hierarchical transfers (host-API transport, docs/multinode.md): ranks grouped into nodes of this many
  // consecutive ranks (a divisor of the rank count); rows cross between nodes once per (token, remote node): a
  // dispatch's (and a combine backward's) to the rank of that node with the source's index in its node, which
  // forwards them inside its node; a combine's (and a dispatch backward's) as one partial per remote node, which
  // that rank sums from its node's ranks' fp32 partials in rank order and rounds once. 0 or the rank count: flat
  // (every row straight to its rank). Dispatches give the flat path's results bit for bit; a sum is the flat
  // path's with the rounded partials of a remote node's ranks replaced by that node's one partial. -1: the NVLink
  // domain of each rank (Communicator::lsa_ranks()) when it is smaller than all ranks, else flat.
  int ranks_per_node = 0;
};

// The layout of this rank's receive buffer (its L local experts), in device memory (a DispatchHandle's), valid
// after the dispatch that filled the handle: what the grouped expert MLP runs over.
struct EpLayout {
  std::int64_t capacity = 0;      // rows the buffers of this dispatch (recv, y, d_recv, d_y) need at least: the
                                  // Dispatcher's capacity(), or the rows plan() returned (host value)
  TensorView tokens_per_expert;   // [L] i32: routed rows per local expert (all sources, before capacity)
  TensorView tokens;              // [R] i32: T of every rank
  TensorView padded_per_expert;   // [L] i32
  TensorView segment_offset;      // [L + 1] i32: first row of each segment; [L] = the rows of all segments (padded,
                                  // at most cfg.expert_rows() each under Capacity::PerExpert)
  TensorView segment_rows;        // [L] i32: segment rows inside the buffer (clipped): the grouped GEMM's counts
  TensorView rows_used;           // [1] i32
  TensorView dest_rank;           // [T_max, K] i32: rank of each of this rank's slots, -1 = unrouted/dropped
  TensorView dest_row;            // [T_max, K] i32: row on that rank
  TensorView node_staged;         // [nodes] i32, hierarchical transfers only (else empty): the rows this rank sent
                                  // to each node (one per token with a slot there; 0 for its own node)
};

// What plan() reads: the routing of the dispatch that follows it (the same arrays must be given to it).
struct EpPlanArgs {
  TensorView topk_idx;    // [T_max, K] i32, device, read
  TensorView probs;       // [T_max, K] f32, device, read
  TensorView num_tokens;  // [1] i32, device, read: T of this rank
};

struct EpDispatchArgs {
  TensorView x;           // [T_max, H] bf16/f16/f32 (cfg.dtype), device, read (rows t < T)
  TensorView topk_idx;    // [T_max, K] i32, device, read
  TensorView probs;       // [T_max, K] f32, device, read
  TensorView num_tokens;  // [1] i32, device, read: T of this rank
  TensorView recv;        // [>= capacity, H] like x, written (routed + pad rows)
  TensorView recv_probs;  // [>= capacity] f32, written (routed + pad rows)
};
// FP8 dispatch: x is bf16 and is quantized at the source, fused into the dispatch (one read of x), with one of the
// recipes of include/moerail/quant.h, exactly as quantize_fp8 then dispatch would give (bit for bit):
//   Block1x128 (DeepSeek-V3, the default): recv[row(t,k)] = e4m3(x[t] · (1 / s)), recv_scales[row(t,k)] = the row's
//     H / 128 f32 scales s; the link carries H + H/32 bytes per (token, remote rank) instead of 2H.
//   Mx1x32 (MXFP8; storage only on Hopper): recv_scales[row(t,k)] = the row's H / 32 E8M0 codes (kE8M0ScaleDType);
//     H + H/32 bytes on the link.
//   PerTensor: recv_scales is [1] f32, READ: the one scale every rank quantizes with (it must be the same on every
//     rank, e.g. an all-reduced amax / 448, since received rows carry no scale); H bytes on the link.
// Pad rows: zero bytes, every scale 1 (1.0f; E8M0 code 127 = 2^0, not the code 0 a quantized zero block gets,
// docs/fp8.md), probs 0. Needs cfg.dtype = bf16 and hidden % 128 == 0. The plan is shared with the other ops as for
// dispatch(): combine and the backward ops (bf16) follow an FP8 dispatch unchanged.
// Rows the caller quantized: give q (e4m3 [T_max, H]) and q_scales (the recipe's scale rows, as quantize_fp8 writes
// them; none for PerTensor) instead of x: codes and scale words are moved as bytes, so recv and recv_scales hold
// exactly q's and q_scales' rows (PerTensor: recv_scales is not read then, and may be absent).
struct EpDispatchFp8Args {
  TensorView x;           // [T_max, H] bf16, device, read (rows t < T); or absent, then q and q_scales below
  TensorView topk_idx;    // [T_max, K] i32, device, read
  TensorView probs;       // [T_max, K] f32, device, read
  TensorView num_tokens;  // [1] i32, device, read: T of this rank
  TensorView recv;        // [>= capacity, H] fp8_e4m3, 16-byte aligned, written (routed + pad rows)
  TensorView recv_scales; // Block1x128: [>= capacity, H / 128] f32, written (routed + pad rows)
                          // Mx1x32: [>= capacity, H / 32] kE8M0ScaleDType, 4-byte aligned, written (routed + pad rows)
                          // PerTensor: [1] f32, device, read (the scale of every row)
  TensorView recv_probs;  // [>= capacity] f32, written (routed + pad rows)
  Fp8Scaling scaling = Fp8Scaling::Block1x128;
  TensorView q;           // [T_max, H] fp8_e4m3, 16-byte aligned, device, read (rows t < T): instead of x
  TensorView q_scales;    // with q: Block1x128 [T_max, H / 128] f32, Mx1x32 [T_max, H / 32] kE8M0ScaleDType (4-byte
                          // aligned), device, read (rows t < T); absent for PerTensor
};
struct EpCombineArgs {
  ProbMode mode = ProbMode::InActivation;
  TensorView y;    // [>= capacity, H] like x, read (routed rows)
  TensorView out;  // [T_max, H], written (rows t < T)
};
struct EpDispatchBackwardArgs {
  TensorView d_recv;        // [>= capacity, H], read
  TensorView d_recv_probs;  // [>= capacity] f32, read; optional (then no d_probs)
  TensorView dx;            // [T_max, H], written
  TensorView d_probs;       // [T_max, K] f32, written; optional
};
struct EpCombineBackwardArgs {
  ProbMode mode = ProbMode::InActivation;
  TensorView d_out;    // [T_max, H], read
  TensorView y;        // [>= capacity, H], read (InCombine only)
  TensorView d_y;      // [>= capacity, H], written (routed + pad rows)
  TensorView d_probs;  // [T_max, K] f32, written (0 unless InCombine); optional
};

class Dispatcher;

// One dispatch's layout: what its combine and both backward passes read (T of every rank, the per-expert counts and
// segments, the destination of each of this rank's slots, the rows and probs of every source's slots that landed
// here). A view over memory the caller owns (Dispatcher::handle_bytes() bytes, e.g. a framework's tensor), which
// must stay allocated, and not be written, while an op of that dispatch may still run; copies of a handle are views
// of the same memory. Made by Dispatcher::make_handle(), filled by dispatch() / dispatch_fp8(), read by combine()
// and the backward ops of the same Dispatcher.
class DispatchHandle {
 public:
  DispatchHandle() = default;
  bool defined() const { return owner_ != nullptr; }
  const EpLayout& layout() const { return layout_; }  // device views into the handle's memory
  const TensorView& memory() const { return memory_; }

 private:
  friend class Dispatcher;
  const Dispatcher* owner_ = nullptr;
  TensorView memory_;
  EpLayout layout_;
  std::int32_t* pad_prefix_ = nullptr;  // [L + 1]
  std::int32_t* slot_rows_ = nullptr;   // [R][T_max][K]
  float* slot_probs_ = nullptr;         // [R][T_max][K]
  std::int32_t* staged_ = nullptr;      // [R] host-API transport: rows each source staged for this rank
  std::int32_t* stage_pos_ = nullptr;   // [T_max][K] host-API transport: a slot's token's place among the rows
                                        //   this rank staged for the slot's rank (-1 none)
  std::int32_t* node_tok_ = nullptr;    // [nodes][node_rows] hierarchical: the token of each row sent to a node
  std::int32_t* node_fan_ = nullptr;    // [nodes][node_rows][ranks_per_node]: its place at each rank there (-1)
  std::int32_t* fwd_fan_ = nullptr;     // [nodes][node_rows][ranks_per_node]: the node_fan the rail source of each
                                        //   node sent this rank, which forwards its rows
  bool filled_ = false;                 // set (on the host) by the dispatch that fills it
  struct Planned {                      // plan() ran over it with this routing; its dispatch has not yet
    const void* topk_idx = nullptr;
    const void* probs = nullptr;
    const void* num_tokens = nullptr;
  } planned_;
};

class Dispatcher {
 public:
  // Collective: every rank constructs with the same cfg and options. Allocates everything (windows included).
  // cfg.ep_size must equal comm.size().
  Dispatcher(const MoeConfig& cfg, Communicator& comm, const DispatchOptions& opts = {});
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  Transport transport() const;
  std::int64_t capacity() const;       // rows of recv, y, d_recv, d_y
  std::size_t workspace_bytes() const; // device bytes this object holds on this rank (window and default handle
                                       // included)
  std::size_t window_bytes() const;    // of which the NCCL window (NVLink; not from the allocator): 0 on HostApi
  int blocks() const;                  // blocks of the data kernels
  // Tokens this rank stages (sends) for each peer per op on the host-API transport: cfg.peer_rows(); T_max on the
  // NVLink path, which stages nothing (no bound).
  std::int64_t peer_rows() const;
  // Hierarchical transfers (DispatchOptions::ranks_per_node): the ranks of a node (0: flat), and the rows a rank
  // sends to each remote node per op: min(T_max, ranks_per_node * peer_rows()), never fewer than it routes there.
  int ranks_per_node() const;
  std::int64_t node_rows() const;
  DeviceStatus* status();
  // One host read of the status word; throws Error naming this rank and what went wrong. Resets the word.
  void check(cudaStream_t stream);

  // Handles. handle_bytes(): device bytes of one; make_handle() lays one out over `memory` (device, on this
  // Dispatcher's GPU, >= handle_bytes() bytes of any dtype, 256-byte aligned; no work on the device).
  std::size_t handle_bytes() const;
  DispatchHandle make_handle(const TensorView& memory) const;

  // Two-phase dispatch, for buffers of exactly the rows that land on this rank: plan() runs the count exchange and
  // this rank's layout into `handle`, waits for them on the host and returns the rows the dispatch will write
  // (handle.layout().capacity; the rows of every segment, pads included). The dispatch() or dispatch_fp8() that
  // comes next over the same handle, with the same topk_idx, probs and num_tokens, moves the rows without planning
  // again, and the ops of that dispatch take recv, y, d_recv and d_y of at least that many rows instead of
  // capacity(). No other plan() or dispatch of this Dispatcher may run in between (they replace the planner's
  // scratch that the dispatch reads: it then throws); combines and backward passes of other dispatches may.
  // Collective; synchronizes the host with `stream`, so not capturable.
  std::int64_t plan(const EpPlanArgs& args, DispatchHandle& handle, cudaStream_t stream);

  // The ops over a handle. dispatch() fills `handle` (its earlier contents are replaced); the others read the one a
  // dispatch filled and throw if it was not.
  void dispatch(const EpDispatchArgs& args, DispatchHandle& handle, cudaStream_t stream);
  void dispatch_fp8(const EpDispatchFp8Args& args, DispatchHandle& handle, cudaStream_t stream);
  void combine(const EpCombineArgs& args, const DispatchHandle& handle, cudaStream_t stream);
  void dispatch_backward(const EpDispatchBackwardArgs& args, const DispatchHandle& handle, cudaStream_t stream);
  void combine_backward(const EpCombineBackwardArgs& args, const DispatchHandle& handle, cudaStream_t stream);

  // Writes zeros to rows [rows used, capacity) of recv (any 2-D [>= capacity, *] array of the dispatch's row
  // layout, 16-byte aligned rows) and, when given, of recv_probs ([>= capacity] f32): for a consumer that reads the
  // whole buffer (dispatch writes only the routed and pad rows). Reads the handle's rows_used on the device.
  void zero_unused_rows(const TensorView& recv, const TensorView& recv_probs, const DispatchHandle& handle,
                        cudaStream_t stream);

  // The same over the default handle: one microbatch at a time.
  void dispatch(const EpDispatchArgs& args, cudaStream_t stream);
  void dispatch_fp8(const EpDispatchFp8Args& args, cudaStream_t stream);
  void combine(const EpCombineArgs& args, cudaStream_t stream);
  void dispatch_backward(const EpDispatchBackwardArgs& args, cudaStream_t stream);
  void combine_backward(const EpCombineBackwardArgs& args, cudaStream_t stream);
  const EpLayout& layout() const;      // the default handle's

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace moerail
