// moerail/permute.h — the token data movement of one GPU (R = 1), fused with padding and the weighted sum:
//
//   permute_forward    (dispatch)  recv[row(t,k)] = x[t], recv_probs[row(t,k)] = p[t,k]; the pad rows of every
//                                  expert segment are written with zeros (probs too). One pass: each token row is
//                                  read once and stored to its K rows.
//   permute_forward_fp8            the same with an FP8 e4m3 payload and its scale rows (quantized in the scatter
//                                  from bf16, or moved from an already quantized input); see PermuteFp8Args.
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
// Activations are bf16, f16 or f32 (x, recv, y, out and their gradients share one dtype; permute_forward_fp8: bf16
// or e4m3 in, e4m3 out); probs and their gradients are f32. Except for permute_forward_fp8, any H works: rows move
// in 16-byte vectors when H * element size is a multiple of 16 and every row buffer is 16-byte aligned, else
// element by element.
//
// Every op here: allocates nothing, never synchronizes the host, may be captured in a CUDA graph. Data movement
// is bit-exact (rows are copied as bytes).
#pragma once

#include <cuda_runtime_api.h>

#include "moerail/config.h"
#include "moerail/layout.h"
#include "moerail/quant.h"
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

// ---- FP8 dispatch: e4m3 rows and their scales into the expert-major padded layout ----------------------------
//
// permute_forward_fp8 writes what quantize-then-permute writes (bit for bit), in one pass: recv[row(t,k)] =
// q[t], recv_scales[row(t,k)] = scales[t] (the row's scale row), recv_probs[row(t,k)] = p[t,k]. The source is one
// of (exactly one must be given):
//   x         bf16 [T_max, H]: quantized inside the scatter (each row read once, no separate quantize pass):
//             q = e4m3(x · (1 / s)) with the recipe's scales exactly as quantize_fp8 (moerail/quant.h) computes
//             them: Block1x128 and Mx1x32 compute one scale per 128 / 32 columns, PerTensor multiplies by the
//             reciprocal of the given tensor_scale (read on the device, not checked: finite and > 0 is the
//             caller's promise).
//   q         e4m3 [T_max, H] already quantized, with its q_scales (Block1x128 f32 [T_max, H/128], Mx1x32 E8M0
//             [T_max, H/32]; none for PerTensor): codes and scale rows are moved as bytes.
// Pad rows (the tail of each expert segment): data 0x00 (+0), scales 1 (f32 1.0f; E8M0 code 127 = 2^0), prob 0;
// they dequantize to zero. The per-tensor scale is shared and never moved (recv_scales absent).
// Routing, capacity and bad input are handled exactly as permute_forward does (the planner's dest_row: a slot it
// dropped or found bad moves nothing; overflow and bad routing are in the planner's status word). Rows at or beyond
// rows_used and rows t >= T are not touched.
//
// Rows move in 16-byte vectors: H % 16 == 0 (and H % 128 for Block1x128, H % 32 for Mx1x32) and x / q / recv
// 16-byte aligned, else an error naming the argument. Allocates nothing, never synchronizes the host, may be
// captured in a CUDA graph (the grid is fixed from T_max; T is read on the device).
struct PermuteFp8Args {
  Fp8Scaling scaling = Fp8Scaling::Block1x128;
  TensorView x;             // [T_max, H] bf16, device, read (rows t < T): quantized here. Or absent (then q)
  TensorView tensor_scale;  // [1] f32, device, read: PerTensor with x only (absent otherwise)
  TensorView q;             // [T_max, H] fp8_e4m3, device, read (rows t < T): already quantized. Or absent (then x)
  TensorView q_scales;      // with q: Block1x128 [T_max, H/128] f32, Mx1x32 [T_max, H/32] kE8M0ScaleDType, device,
                            //   read (rows t < T); absent for PerTensor and with x
  TensorView probs;         // [T_max, K] f32, device, read; optional (then recv_probs must be absent too)
  TensorView num_tokens;    // [1] i32, device, read: T
  LayoutBuffers layout;     // read: dest_row, tokens_per_expert, segment_offset, pad_prefix
  TensorView recv;          // [>= layout.capacity, H] fp8_e4m3, device, written (routed and pad rows)
  TensorView recv_scales;   // Block1x128 [>= capacity, H/128] f32, Mx1x32 [>= capacity, H/32] kE8M0ScaleDType,
                            //   device, written (routed and pad rows); absent for PerTensor
  TensorView recv_probs;    // [>= layout.capacity] f32, device, written (routed and pad rows); optional
};
void permute_forward_fp8(const MoeConfig& cfg, const PermuteFp8Args& args, cudaStream_t stream);

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
