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
//                      (probs too); rows at or beyond rows_used of a rank are not written.
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
//   combine backward:  d_y[row(t,k)] = w(t,k) * d_out[t]; pad rows get 0; rows at or beyond rows_used are not
//                      written.  d_probs[t,k] = <y[row(t,k)], d_out[t]> if InCombine, else 0.
#pragma once

#include <span>

#include "moerail/config.h"
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

enum class Reduction { SlotOrder, PerRank };

struct DispatchBackwardArgs {
  std::span<const TensorView> d_recv;        // per destination rank [>= capacity, H], read
  std::span<const TensorView> d_recv_probs;  // per destination rank [>= capacity], read; may be empty (no d_probs)
  std::span<const TensorView> dx;            // per source rank [T_r, H], written
  std::span<const TensorView> d_probs;       // per source rank [T_r, K], written; empty exactly when d_recv_probs is
  Reduction reduction = Reduction::SlotOrder;
};
void dispatch_backward(const LayoutPlan& plan, const DispatchBackwardArgs& args);

struct CombineArgs {
  ProbMode mode = ProbMode::InActivation;
  std::span<const TensorView> y;      // per destination rank [>= capacity, H], read
  std::span<const TensorView> probs;  // per source rank [T_r, K], read (InCombine only; may be empty otherwise,
                                      // and is still checked when given)
  std::span<const TensorView> out;    // per source rank [T_r, H], written
  Reduction reduction = Reduction::SlotOrder;
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

}  // namespace moerail::ref
