// moerail/permute.h — the token data movement of one GPU (R = 1), fused with padding and the weighted sum:
//
//   permute_forward    (dispatch)  recv[row(t,k)] = x[t], recv_probs[row(t,k)] = p[t,k]; the pad rows of every
//                                  expert segment are written with zeros (probs too). One pass: each token row is
//                                  read once and stored to its K rows.
//   permute_backward               dx[t] = sum_k d_recv[row(t,k)] (fp32, k order, cast once);
//                                  d_probs[t,k] = d_recv_probs[row(t,k)] (0 for unrouted/dropped slots).
//   unpermute_forward  (combine)   out[t] = sum_k w(t,k) * y[row(t,k)] (fp32, k order, cast once), w = p[t,k] if
//                                  ProbMode::InCombine else 1; a token with no routed slot gets 0. Pad rows are
//                                  never read.
//   unpermute_backward             d_y[row(t,k)] = w(t,k) * d_out[t]; pad rows of d_y get 0;
//                                  d_probs[t,k] = <y[row(t,k)], d_out[t]> (fp32) if InCombine, else 0.
//
// row(t,k) is layout.dest_row from plan_layout (layout.h); -1 means the slot moves nothing. Rows of the receive
// buffers at or beyond the plan's rows_used are not touched. Rows t >= T of token-side buffers are not touched;
// T is read from device memory (num_tokens), so a captured graph replays with any T in [0, T_max].
//
// Activations are bf16, f16 or f32 (x, recv, y, out and their gradients share one dtype); probs and their
// gradients are f32. Any H works; rows move in 16-byte vectors when H * element size is a multiple of 16 and
// every row buffer is 16-byte aligned, else element by element.
//
// Every op here: allocates nothing, never synchronizes the host, may be captured in a CUDA graph. Data movement
// is bit-exact (rows are copied as bytes).
#pragma once

#include <cuda_runtime_api.h>

#include "moerail/config.h"
#include "moerail/layout.h"
#include "moerail/tensor.h"

namespace moerail {

struct PermuteArgs {
  TensorView x;           // [T_max, H] bf16/f16/f32, device, read (rows t < T)
  TensorView probs;       // [T_max, K] f32, device, read; optional (then recv_probs must be absent too)
  TensorView num_tokens;  // [1] i32, device, read: T
  LayoutBuffers layout;   // read: dest_row, tokens_per_expert, padded_per_expert, segment_offset, pad_prefix
  TensorView recv;        // [>= layout.capacity, H] same dtype as x, device, written (routed and pad rows)
  TensorView recv_probs;  // [>= layout.capacity] f32, device, written (routed and pad rows); optional
};
void permute_forward(const MoeConfig& cfg, const PermuteArgs& args, cudaStream_t stream);

struct PermuteBackwardArgs {
  TensorView d_recv;        // [>= layout.capacity, H] bf16/f16/f32, device, read (routed rows only)
  TensorView d_recv_probs;  // [>= layout.capacity] f32, device, read; optional (then no d_probs)
  TensorView num_tokens;    // [1] i32, device, read
  LayoutBuffers layout;     // read: dest_row
  TensorView dx;            // [T_max, H] same dtype as d_recv, device, written (rows t < T)
  TensorView d_probs;       // [T_max, K] f32, device, written (rows t < T); optional
};
void permute_backward(const MoeConfig& cfg, const PermuteBackwardArgs& args, cudaStream_t stream);

struct UnpermuteArgs {
  ProbMode mode = ProbMode::InActivation;
  TensorView y;           // [>= layout.capacity, H] bf16/f16/f32, device, read (routed rows only)
  TensorView probs;       // [T_max, K] f32, device, read (InCombine only; may be absent otherwise)
  TensorView num_tokens;  // [1] i32, device, read
  LayoutBuffers layout;   // read: dest_row
  TensorView out;         // [T_max, H] same dtype as y, device, written (rows t < T)
};
void unpermute_forward(const MoeConfig& cfg, const UnpermuteArgs& args, cudaStream_t stream);

struct UnpermuteBackwardArgs {
  ProbMode mode = ProbMode::InActivation;
  TensorView d_out;       // [T_max, H] bf16/f16/f32, device, read (rows t < T)
  TensorView y;           // [>= layout.capacity, H] same dtype, device, read (InCombine only; else may be absent)
  TensorView probs;       // [T_max, K] f32, device, read (InCombine only; else may be absent)
  TensorView num_tokens;  // [1] i32, device, read
  LayoutBuffers layout;   // read: dest_row, tokens_per_expert, padded_per_expert, segment_offset, pad_prefix
  TensorView d_y;         // [>= layout.capacity, H] same dtype, device, written (routed and pad rows)
  TensorView d_probs;     // [T_max, K] f32, device, written (rows t < T; zeros unless InCombine); optional
};
void unpermute_backward(const MoeConfig& cfg, const UnpermuteBackwardArgs& args, cudaStream_t stream);

}  // namespace moerail
