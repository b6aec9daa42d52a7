// moerail/experts.h — the grouped expert MLP on the GPU (Hopper, sm_90a), forward and backward.
//
// Contract: moerail/reference/experts.h (the CPU reference is the oracle). The rows of x are grouped into contiguous
// segments, one per local expert, starting at row 0: segment e has counts[e] rows. For each row r of expert e
// (F1 = 2F for GLU activations, else F):
//   h1 = x[r] W1[e]^T (+ b1[e])                  [F1]
//   a  = act(h1)                                  [F]    (activation and GLU layout of MoeConfig)
//   y[r] = p[r] * (a W2[e]^T (+ b2[e]))           [H]    (p[r] = 1 when cfg.prob_mode = InCombine)
// Backward gives dx, d_probs[r] = <a W2[e]^T + b2[e], dy[r]> (InActivation; 0 when InCombine), and the weight
// gradients dW1, dW2, db1, db2 (experts with zero rows get exact zeros), either in backward() or later in
// backward_dw() (delayed wgrad).
//
// The per-expert counts are read on the DEVICE only (int32 or int64, [L]); nothing here reads device data on the
// host, so forward, backward and backward_dw may be captured once in a CUDA graph and replayed with any counts.
// Counts are trusted to fit the buffers; a negative count is read as 0 and segments are clipped to the rows of x,
// so a wrong count never makes a kernel touch memory outside the views. Rows past the last segment are neither
// read nor written.
//
// Every operation below:  allocates: no (the GroupedMlp constructor does, once) · host sync: no ·
// graph-capturable: yes · stream-ordered on the given stream. Calls of the same kind (two forwards, ...) on one
// GroupedMlp must be ordered (same stream or events): each kind rewrites its own small per-expert argument arrays.
//
// Data types: activations, weights, biases and gradients bf16; probs and d_probs f32; counts i32 or i64. Every view
// is a device view on the GroupedMlp's device, 16-byte aligned. H and F must be multiples of 8 (16-byte TMA rows);
// for GluLayout::Interleaved the block g must divide F (any g; multiples of 8 take the vectorized path).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "moerail/config.h"
#include "moerail/memory.h"
#include "moerail/tensor.h"

namespace moerail {

// Weights of the L local experts, as one grouped tensor per parameter ([L, ...]) or as L per-expert tensors
// (Megatron's weight0..weight{L-1}). Grouped form: set w1/w2 (b1/b2). Per-expert form: leave w1 and w2 undefined
// and set the *_experts spans (L views each; at most kMaxPerExpertTensors experts). Biases follow cfg.fc1_bias /
// cfg.fc2_bias: given iff the flag is set, in the same form as the weights.
struct MlpWeights {
  TensorView w1;  // [L, F1, H] bf16, read
  TensorView b1;  // [L, F1] bf16, read
  TensorView w2;  // [L, H, F] bf16, read
  TensorView b2;  // [L, H] bf16, read
  std::span<const TensorView> w1_experts, b1_experts, w2_experts, b2_experts;  // [F1,H], [F1], [H,F], [H]
};

// Weight gradients, same two forms as MlpWeights; written (overwritten), or added to what the tensors hold
// (`accumulate`). All bf16, or all fp32 (Megatron-LM's fp32 main_grad buffers): fp32 gradients are the GEMMs' fp32
// sums, not rounded to bf16.
struct MlpGrads {
  TensorView dw1;  // [L, F1, H] bf16 or f32
  TensorView db1;  // [L, F1], iff cfg.fc1_bias
  TensorView dw2;  // [L, H, F]
  TensorView db2;  // [L, H], iff cfg.fc2_bias
  std::span<const TensorView> dw1_experts, db1_experts, dw2_experts, db2_experts;
  // false: the gradients are written over the tensors. true: added to what they hold. bf16: each element becomes
  // bf16(old + bf16(g)), the bits of PyTorch's `grad += g` after a call that writes g (gradient accumulation over
  // micro-batches without a pass of its own). fp32: old + g in fp32, rounded to nearest (one atomic add per element
  // of the weight gradients). An expert without rows leaves its gradients as they were. Accumulated or fp32 weight
  // gradients run on the contiguous kernel, whose epilogue adds (or writes) them in memory, whatever
  // MlpOptions::contiguous_gemms says; so calls with more rows than kContigWgradMaxRows (2^31 - 65) are refused.
  bool accumulate = false;

  bool defined() const { return dw1.defined() || !dw1_experts.empty(); }
};

// The most per-expert tensors a per-expert weight list may hold (their pointers travel as kernel parameters).
inline constexpr std::int64_t kMaxPerExpertTensors = 256;
// The most local experts a GroupedMlp supports (one block scans the counts).
inline constexpr std::int64_t kMaxLocalExperts = 1024;

namespace experts {
struct MlpTuning;  // benchmark and test knobs (src/experts/mlp_tuning.h): not part of this contract
struct MlpAccess;
}  // namespace experts

struct MlpForwardArgs {
  TensorView x;        // [rows, H] bf16, read (rows = buffer capacity; only the segments are read)
  TensorView probs;    // [rows] f32, read; required when cfg.prob_mode = InActivation, else may be absent
  TensorView counts;   // [L] i32 or i64 device, read on the device: rows of each expert's segment
  MlpWeights weights;
  TensorView y;        // [rows, H] bf16, written (segment rows only)
  TensorView h1;       // [rows, F1] bf16, written: FC1 output including b1; saved for backward
  TensorView act;      // [rows, F] bf16, written: act(h1), times p when InActivation; saved for backward_dw
};

struct MlpBackwardArgs {
  TensorView x, probs, counts;  // as given to the forward
  MlpWeights weights;
  TensorView h1;         // [rows, F1] bf16, read: saved by the forward
  TensorView act;        // [rows, F] bf16, read: saved by the forward (needed only when grads are given)
  TensorView dy;         // [rows, H] bf16, read
  TensorView dx;         // [rows, H] bf16, written (segment rows only)
  TensorView d_probs;    // [rows] f32, written (segment rows; 0 when InCombine); may be absent
  TensorView d_h1;       // [rows, F1] bf16, written: gradient of h1; read again by backward_dw
  TensorView workspace;  // device bytes >= GroupedMlp::backward_workspace_bytes(rows), any dtype: scratch; it may
                         // share memory with dx (its contents are dead before FC1's dgrad writes dx)
  MlpGrads grads;        // given: weight gradients are computed at the end of this call; absent: call backward_dw
};

struct MlpBackwardDwArgs {
  TensorView x, probs, counts;  // as given to the forward (probs: for db2 = sum_r p[r] dy[r] when InActivation)
  TensorView act;               // [rows, F] bf16, read: saved by the forward
  TensorView dy;                // [rows, H] bf16, read
  TensorView d_h1;              // [rows, F1] bf16, read: written by backward
  MlpGrads grads;               // written
  // Chunked rows (MoeLayer's chunked step): > 0 reads counts as [C, L] (1 <= C <= kMaxMlpChunks) and the rows as C
  // regions of chunk_rows rows each (C * chunk_rows <= rows), region c laid out by counts[c] from its first row, c
  // * chunk_rows, as a forward over that region alone lays it out. The gradients sum expert e's rows of every
  // region, region by region: a fixed order for a given C (deterministic), which is not that of one call over the
  // same rows back to back (the products are summed in other 64-row groups), so its last bits may differ. Runs on
  // the contiguous weight gradient kernel whatever MlpOptions::contiguous_gemms says. 0: counts [L], one region.
  std::int64_t chunk_rows = 0;
};

// Where the forward computes the activation (bias, GLU, prob scale): in FC1's epilogue ("fused", on FC1's tile: no
// separate pass re-reading h1) or in a separate pass. Fused needs a GLU with GluLayout::Interleaved and glu_block g
// in {8, 16, 32, 64} ({8, 16, 32} on the cooperative FC1 tile: a fused FC1 with g = 64 takes the ping-pong tile);
// the results are the same bit for bit. h1 is written for the backward either way.
//   Auto      fused when the layout allows it
//   Fused     fused; GroupedMlp's constructor throws Unsupported when the layout does not allow it
//   Separate  always the pass
enum class MlpActivation { Auto, Fused, Separate };

// Whether the ragged GEMMs run as one contiguous GEMM over all experts' rows (MlpOptions::contiguous_gemms), each
// expert's segment in tiles of at most 128 rows. Calls with per-expert weight tensors or with more rows than
// max(cfg.rows_per_rank(), rows_hint) and GEMMs on the cooperative tile run in the grouped GEMMs; FC1 with the
// activation in its epilogue runs contiguously too. The weight gradients dW1 and dW2 on the ping-pong tile run as
// one GEMM over all experts' rows as well (grouped or per-expert gradient tensors alike). Both give the same results,
// bit for bit.
//   Auto  on with 16 or more local experts (measured faster there; with a few long experts the grouped GEMM's
//         walk over the tiles is as fast or faster: docs/experts.md); a weight gradient only where one expert's dW
//         has at most 4 128x128 tiles per SM (src/experts/contig/contig_gemm.h, contig_wgrad_auto); on a GPU of less
//         than 4e12 B/s of memory bandwidth (H100) not the forward and dgrad GEMMs that the cooperative tile runs
//         faster grouped (src/experts/tiles.h, low_bandwidth_prefers_cooperative)
//   Off   never
//   On    always
enum class MlpContiguous { Auto, Off, On };

struct MlpOptions {
  // Rows the GEMMs are expected to see, for the tile choice only (src/experts/tiles.h: rows per expert = this / L);
  // 0 = cfg.rows_per_rank(), the capacity, which can be up to R times the rows of balanced routing (MoeLayer passes
  // T_max K). Any rows may be passed later.
  std::int64_t rows_hint = 0;
  // The activation in FC1's epilogue or in a separate pass (see MlpActivation); the fused FC1 takes the plain FC1's
  // tile, but for the contiguous ping-pong kernels where those can run it (src/experts/tiles.h, fused_fc1_tile).
  MlpActivation activation = MlpActivation::Auto;
  // The activation backward (d_h1, d_probs) in the epilogue of FC2's contiguous dgrad or in a separate pass. d_h1
  // is the same bit for bit; d_probs is summed per 128-feature tile and then over the tiles, a fixed order that is
  // not the pass's, so it may differ from the pass's in its last bits (deterministic either way).
  //   Auto      fused where Fused would fuse and H >= 2048 (FC2's dgrad reduces over H; src/experts/tiles.h,
  //             kActBwdAutoMinK: where the fused epilogue measured ahead of the pass), else the pass
  //   Fused     fused wherever FC2's dgrad runs contiguously (contiguous_gemms) and d_probs has no FC2-bias term
  //             (fc2_bias with ProbMode::InActivation); GroupedMlp's constructor throws Unsupported when the
  //             configuration can never fuse; calls whose FC2 dgrad runs grouped (per-expert weight tensors, more
  //             rows than the table) use the pass
  //   Separate  the pass
  MlpActivation activation_backward = MlpActivation::Auto;
  // FC1, FC2 and both dgrads as ONE GEMM over the rows of all experts (src/experts/contig/contig_gemm.h): one set
  // of TMA descriptors instead of per-expert ones. See MlpContiguous.
  MlpContiguous contiguous_gemms = MlpContiguous::Auto;
  // SMs the persistent GEMM grids may hold (each grid: the clusters of 2 of at most this many SMs); 0 = every SM.
  // Leaves the other SMs to kernels that run beside the GEMMs on another stream (MoeLayer's chunked step gives them
  // to its dispatch and combine). Results do not depend on it.
  int sms = 0;
  // Where the argument arrays and CUTLASS workspaces come from (null = cudaMalloc); must outlive the GroupedMlp.
  DeviceAllocator* allocator = nullptr;
  // Benchmarks and tests only (src/experts/mlp_tuning.h: per-GEMM kernel tiles instead of the rules of
  // src/experts/tiles.h); read by the constructor. Null: the rules.
  const experts::MlpTuning* tuning = nullptr;
};

// The grouped expert MLP of one layer on the current CUDA device.
class GroupedMlp {
 public:
  // Setup (outside graph capture): validates cfg (bf16, H and F multiples of 8, L = cfg.local_experts() <=
  // kMaxLocalExperts), checks the device is sm_90, allocates the per-expert argument arrays and CUTLASS
  // workspaces (a few KiB per expert and SM), initializes the CUTLASS kernels. Synchronizes the device.
  explicit GroupedMlp(const MoeConfig& cfg, const MlpOptions& options = {});
  ~GroupedMlp();
  GroupedMlp(const GroupedMlp&) = delete;
  GroupedMlp& operator=(const GroupedMlp&) = delete;

  const MoeConfig& config() const;

  void forward(const MlpForwardArgs& args, cudaStream_t stream);
  // Data gradients (dx, d_probs, d_h1), and the weight gradients too when args.grads is given.
  void backward(const MlpBackwardArgs& args, cudaStream_t stream);
  // Weight gradients alone (delayed wgrad), after backward() of the same step.
  void backward_dw(const MlpBackwardDwArgs& args, cudaStream_t stream);

  // Scratch bytes backward() needs for `rows` rows (d_act [rows, F] bf16), laid out by backward() itself.
  std::size_t backward_workspace_bytes(std::int64_t rows) const;

  // The kernel choice of each GEMM, for logs and benchmark records: "fc1=coop128x256 fc2=ping128x128 ..."
  // ("fc1=ping128x128+act" when FC1's epilogue computes the activation, "+contig" for a GEMM that runs as one
  // contiguous GEMM over all experts' rows, MlpOptions::contiguous_gemms, "dgrad_fc2=...+actbwd" when FC2's
  // contiguous dgrad computes the activation backward, MlpOptions::activation_backward).
  std::string describe() const;
  std::size_t device_bytes() const;  // what it holds (from MlpOptions::allocator)
  // Whether FC1's epilogue computes the activation (MlpOptions::activation): then there is no activation pass.
  bool activation_fused() const;

 private:
  friend struct experts::MlpAccess;  // src/experts/mlp_tuning.h: a forward of some of its stages, for benchmarks
  void forward_stages(const MlpForwardArgs& args, unsigned stages, cudaStream_t stream);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Scratch bytes of GroupedMlp::backward for cfg and `rows` rows (the same as GroupedMlp::backward_workspace_bytes).
std::size_t mlp_backward_workspace_bytes(const MoeConfig& cfg, std::int64_t rows);

// Weight layout converters on any device (Megatron's checkpoint-key normalization): one grouped tensor [L, ...]
// <-> L per-expert tensors of its slice shape, same dtype; copies bit-exactly with cudaMemcpyAsync on `stream`.
// Allocates: no · host sync: no · graph-capturable: yes (device views).
void split_grouped_weights(const TensorView& grouped, std::span<const TensorView> per_expert, cudaStream_t stream);
void stack_grouped_weights(std::span<const TensorView> per_expert, const TensorView& grouped, cudaStream_t stream);

}  // namespace moerail
