// moerail/layout.h — the layout planner on the GPU (one GPU, R = 1): from topk_idx to the row of every routed
// (t, k) in the expert-major, alignment-padded receive buffer. No data moves here.
//
// Row order (docs/design.md, exactly the CPU reference moerail::ref::plan_layout with R = 1): expert-major; inside an
// expert by token index, then k. Expert e's segment starts at segment_offset[e] and has padded_per_expert[e] =
// ceil(tokens_per_expert[e] / A) * A rows, at most cfg.expert_rows() under Capacity::per_expert (then only its first
// routed rows are kept); its pad rows sit at the end of the segment. A routed row whose index would be >= capacity,
// or past its expert's segment, is dropped (dest_row = -1), counted in DeviceStatus::overflow_rows (status.h).
// Bad input is never written out of bounds: an expert id outside [-1, E), or (when probs are given) a NaN/Inf
// prob, makes the slot unrouted (dest_row = -1, not counted in tokens_per_expert) and is recorded in the status.
//
// The token count T is read from device memory (num_tokens), so a captured CUDA graph replays with any T in
// [0, T_max] (a stored T outside that range is clamped). Rows t >= T of dest_row are not written.
//
// plan_layout: allocates nothing, never synchronizes the host, may be captured in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "moerail/config.h"
#include "moerail/status.h"
#include "moerail/tensor.h"

namespace moerail {

// The plan of one step, in device memory (all i32). Written by plan_layout, read by the permute ops.
struct LayoutBuffers {
  std::int64_t capacity = 0;    // rows of the receive buffer this plan is made for (host value, fixed at setup)
  TensorView dest_row;          // [T_max, K]: row of (t,k), or -1 (unrouted, dropped, bad); rows t >= T unwritten
  TensorView tokens_per_expert; // [E]: routed rows of each expert (before capacity)
  TensorView padded_per_expert; // [E]: ceil(tokens_per_expert / A) * A
  TensorView segment_offset;    // [E + 1]: first row of each expert's segment; [E] = rows needed (the segments'
                                //      sum: padded rows, at most cfg.expert_rows() each under per_expert)
  TensorView segment_rows;      // [E]: rows of each segment inside the buffer (its segment, clipped to capacity):
                                //      the per-expert row counts a grouped GEMM runs over
  TensorView pad_prefix;        // [E + 1]: pad rows of the experts before e (exclusive scan of segment - routed rows
                                //      kept); [E] = all pad rows. Used to hand out the zeroing of pad rows.
  TensorView rows_used;         // [1]: min(rows needed, capacity)
};

// Bytes of one device allocation holding every LayoutBuffers array for cfg (each array 256-byte aligned).
std::size_t layout_buffers_bytes(const MoeConfig& cfg);
// Views into `base` (device memory of layout_buffers_bytes(cfg) bytes on device `device`); capacity = -1 means
// cfg.rows_per_rank().
LayoutBuffers make_layout_buffers(const MoeConfig& cfg, void* base, int device, std::int64_t capacity = -1);

// Scratch bytes plan_layout needs for cfg (per-chunk counts and their scan, CUB temp storage).
std::size_t layout_workspace_bytes(const MoeConfig& cfg);

struct LayoutArgs {
  TensorView topk_idx;    // [T_max, K] i32, device, read (rows t < T)
  TensorView topk_probs;  // [T_max, K] f32, device, read (rows t < T); optional: when given, NaN/Inf probs make
                          //   their slots unrouted and are reported
  TensorView num_tokens;  // [1] i32, device, read: T
  LayoutBuffers out;      // written
  DeviceStatus* status = nullptr;  // device, updated (overflow, bad ids, bad probs); required
  TensorView workspace;   // [>= layout_workspace_bytes(cfg)] bytes (any dtype), device, scratch
};

// Requires cfg.ep_size == 1 (the multi-GPU planner lives with dispatch), E <= 8192, T_max * K < 2^31.
void plan_layout(const MoeConfig& cfg, const LayoutArgs& args, cudaStream_t stream);

}  // namespace moerail
