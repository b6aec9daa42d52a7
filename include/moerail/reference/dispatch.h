// moerail/reference/dispatch.h — CPU reference of dispatch and combine over R simulated ranks, forward and backward.
//
// Every function takes one view per rank (index = rank) and the LayoutPlan of the step. Sums accumulate in
// double in k order and are rounded once on store. Arguments are all checked before anything is written: a span
// whose length is not plan.num_ranks, a wrong shape, dtype or host device, or a buffer with fewer than
// plan.capacity rows throws Error(InvalidArgument); a NaN or Inf router prob in a slot that has a row (routed and
// not dropped) throws Error(BadRouting) naming rank, token, slot and value. Probs of unrouted or dropped slots are
// never read and may hold anything.
// Activation-type views (x, recv, y, d_out, ...) may be f64, f32, bf16 or f16, each view its own; moving a value
// between views of the same dtype is bit-exact. Probs and their gradients are f32 or f64.
//
//   dispatch:          recv[row(t,k)] = x[t], recv_probs[row(t,k)] = p[t,k]; pad rows of each segment = 0
//                      (probs too); rows at or beyond rows_used of a rank are not written. FP8 payloads:
//                      dispatch_rows_forward (bytes) and dispatch_fp8_forward (quantize, then move codes, scale
//                      rows and probs).
//   dispatch backward: dx[t] = sum_k d_recv[row(t,k)];  d_probs[t,k] = d_recv_probs[row(t,k)]
//                      (0 for unrouted or dropped slots).
//   combine:           out[t] = sum_k w(t,k) * y[row(t,k)],  w = p[t,k] if ProbMode::InCombine else 1
//                      (unrouted or dropped slots add nothing; a token with none gets 0).
//
// Reduction order of the two sums over a token's slots (combine, dispatch backward):
//   Reduction::SlotOrder  one sum in k order (what one GPU does).
//   Reduction::PerRank    what the expert-parallel ops do to send one row per (token, rank): the slots of t on each
//                         destination rank r are summed first (k order) into a partial P_r; a partial from a rank
//                         other than t's own crosses the link rounded once to the dtype of out/dx; out[t] = the
//                         sum of the partials in rank order.
//   Reduction::PerNode    what a hierarchical combine does to send one row per (token, remote node) over the
//                         network, ranks grouped into nodes of ranks_per_node consecutive ranks: the slots of t on
//                         the ranks of each node n other than t's own are summed first (k order, inside the node,
//                         without rounding) into P_n, which crosses the network rounded once to the dtype of
//                         out/dx; the ranks of t's own node give their partials as PerRank (each rank's slots in k
//                         order, rounded once unless the rank is t's own); out[t] = the sum in rank order (a remote
//                         node's P_n at its place). With one rank per node, or one node, it is PerRank.
//   combine backward:  d_y[row(t,k)] = w(t,k) * d_out[t]; pad rows get 0; rows at or beyond rows_used are not
//                      written.  d_probs[t,k] = <y[row(t,k)], d_out[t]> if InCombine, else 0.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "moerail/config.h"
#include "moerail/quant.h"
#include "moerail/reference/layout.h"
#include "moerail/tensor.h"

namespace moerail::ref {

struct DispatchArgs {
  std::span<const TensorView> x;           // per source rank [T_r, H], read
  std::span<const TensorView> probs;       // per source rank [T_r, K] f32/f64, read; NaN/Inf -> Error(BadRouting)
  std::span<const TensorView> recv;        // per destination rank [>= capacity, H], written
  std::span<const TensorView> recv_probs;  // per destination rank [>= capacity] f32/f64, written
                                           // probs and recv_probs may both be empty: no probs are moved
};
void dispatch_forward(const LayoutPlan& plan, const DispatchArgs& args);

// Rows of any dtype moved as bytes (FP8 codes, scale rows, anything dispatch_forward's floating loads would
// change): recv[row(t,k)] = x[t] bit for bit for every slot with a row; every element of every pad row gets the bits
// pad_bits (its low dtype_size bytes, little-endian: 0 for zero data, 0x3f800000 for an f32 1.0f, 127 for an E8M0
// 2^0); rows at or beyond rows_used are not written. All views on the host and of one dtype.
struct DispatchRowsArgs {
  std::span<const TensorView> x;     // per source rank [T_r, W], read
  std::span<const TensorView> recv;  // per destination rank [>= capacity, W], x's dtype, written
  std::uint64_t pad_bits = 0;
};
void dispatch_rows_forward(const LayoutPlan& plan, const DispatchRowsArgs& args);

// FP8 dispatch, the oracle of permute_forward_fp8 (moerail/permute.h): quantize, then move rows.
//   With x: each source rank's rows are quantized by quantize_fp8 (moerail/reference/quant.h) with the recipe's
//   scales (PerTensor: the given tensor_scale). With q: the given codes and scale rows are used as they are.
//   Then the codes move as dispatch_rows_forward does (pad rows 0x00), the scale rows likewise (pad rows scale 1:
//   f32 1.0f, E8M0 code 127; PerTensor has none: its scale is shared), and the probs as dispatch_forward moves
//   them (pad rows 0). Quantization is row-wise, so quantizing before or after moving a row gives the same bits.
// Exactly one of x and q is given; all arguments are checked before anything is written.
struct DispatchFp8Args {
  Fp8Scaling scaling = Fp8Scaling::Block1x128;
  std::span<const TensorView> x;            // per source rank [T_r, H] bf16/f32, read; or empty (then q)
  TensorView tensor_scale;                  // PerTensor with x: [1] f32, read (finite, > 0); otherwise not read
  std::span<const TensorView> q;            // per source rank [T_r, H] fp8_e4m3, read; or empty (then x)
  std::span<const TensorView> q_scales;     // with q and a block recipe: per source rank [T_r, H/G] (f32 or E8M0)
  std::span<const TensorView> probs;        // per source rank [T_r, K] f32/f64, read; may be empty with recv_probs
  std::span<const TensorView> recv;         // per destination rank [>= capacity, H] fp8_e4m3, written
  std::span<const TensorView> recv_scales;  // block recipes: per destination rank [>= capacity, H/G], written;
                                            //   empty for PerTensor
  std::span<const TensorView> recv_probs;   // per destination rank [>= capacity] f32/f64, written; may be empty
};
void dispatch_fp8_forward(const LayoutPlan& plan, const DispatchFp8Args& args);

enum class Reduction { SlotOrder, PerRank, PerNode };

struct DispatchBackwardArgs {
  std::span<const TensorView> d_recv;        // per destination rank [>= capacity, H], read
  std::span<const TensorView> d_recv_probs;  // per destination rank [>= capacity], read; may be empty (no d_probs)
  std::span<const TensorView> dx;            // per source rank [T_r, H], written
  std::span<const TensorView> d_probs;       // per source rank [T_r, K], written; empty exactly when d_recv_probs is
  Reduction reduction = Reduction::SlotOrder;
  std::int64_t ranks_per_node = 0;           // Reduction::PerNode: ranks of a node, dividing R
};
void dispatch_backward(const LayoutPlan& plan, const DispatchBackwardArgs& args);

struct CombineArgs {
  ProbMode mode = ProbMode::InActivation;
  std::span<const TensorView> y;      // per destination rank [>= capacity, H], read
  std::span<const TensorView> probs;  // per source rank [T_r, K], read (InCombine only; may be empty otherwise,
                                      // and is still checked when given)
  std::span<const TensorView> out;    // per source rank [T_r, H], written
  Reduction reduction = Reduction::SlotOrder;
  std::int64_t ranks_per_node = 0;    // Reduction::PerNode: ranks of a node, dividing R
};
void combine_forward(const LayoutPlan& plan, const CombineArgs& args);

struct CombineBackwardArgs {
  ProbMode mode = ProbMode::InActivation;
  std::span<const TensorView> d_out;    // per source rank [T_r, H], read
  std::span<const TensorView> y;        // per destination rank [>= capacity, H], read (needed for d_probs under
                                        // InCombine; may be empty otherwise)
  std::span<const TensorView> probs;    // per source rank [T_r, K], read (InCombine only; may be empty otherwise)
  std::span<const TensorView> d_y;      // per destination rank [>= capacity, H], written
  std::span<const TensorView> d_probs;  // per source rank [T_r, K], written; may be empty (all 0 under InActivation)
};
void combine_backward(const LayoutPlan& plan, const CombineBackwardArgs& args);

// The rows one dispatch moves between ranks, with the ranks grouped into nodes of ranks_per_node consecutive ranks
// (a combine moves the same rows back). Only routed slots that were not dropped count; a rank's rows to itself move
// through its own memory and are not counted.
//   flat          one row per (token, destination rank), over the network when the destination is in another
//                 node, over NVLink inside the source's node.
//   hierarchical  one row per (token, remote node) over the network, to the rank of that node with the source's
//                 local index (rail-aligned), which forwards it over NVLink to every other rank of its node that
//                 holds one of the token's slots; inside the source's node, as flat.
// Each vector has one entry per rank: the rows that rank sends (as source or, hierarchical, as forwarder).
struct NodeTraffic {
  std::vector<std::int64_t> flat_network, flat_nvlink;
  std::vector<std::int64_t> hier_network, hier_nvlink;
};
// Throws Error(InvalidArgument) unless 1 <= ranks_per_node and R % ranks_per_node == 0.
NodeTraffic node_traffic(const LayoutPlan& plan, std::int64_t ranks_per_node);

// The hierarchical dispatch's network hop (docs/multinode.md): the forwarder of source rank s in node n is the rank
// n * G + s % G (G = ranks_per_node); it stages one row for each token of a source outside n with a slot on a rank
// of n, in (source rank, token) order. staged[f] lists forwarder f's rows as (source rank, token).
struct HierarchicalPlan {
  std::int64_t ranks_per_node = 0;
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> staged;  // [R]
};
// Same checks as node_traffic.
HierarchicalPlan plan_hierarchical(const LayoutPlan& plan, std::int64_t ranks_per_node);

// dispatch_forward through the two hops: a slot on a rank of the source's own node is copied to its row directly
// (NVLink); a token's row for a remote node is copied once to its forwarder's staging row (network), and from there
// to the row of each of its slots in that node (NVLink); a slot's prob travels with its row. recv and recv_probs end
// as dispatch_forward leaves them, bit for bit. staging: per rank [>= staged rows, H] of x's dtype, written.
// Checks as dispatch_forward, and that `hier` is the plan's (its rank count) and each staging buffer's shape.
void dispatch_forward_hierarchical(const LayoutPlan& plan, const HierarchicalPlan& hier, const DispatchArgs& args,
                                   std::span<const TensorView> staging);

// combine_forward under Reduction::PerNode through the same hops in reverse: each forwarder sums, for each of its
// staged rows, the slots of that token on the ranks of its node (k order, NVLink reads) and writes the partial to
// the staging row, rounded to its dtype (out's: what crosses the network); each source adds the partials of its own
// node's ranks (as PerRank) and the staged partials of the remote nodes in node order. out ends as combine_forward with
// Reduction::PerNode leaves it, bit for bit (args.reduction and args.ranks_per_node are not read).
// staging: per rank [>= staged rows, H] of the dtype of out, written.
void combine_forward_hierarchical(const LayoutPlan& plan, const HierarchicalPlan& hier, const CombineArgs& args,
                                  std::span<const TensorView> staging);

}  // namespace moerail::ref
