// src/experts/setup.h — the device setup kernel of each pass (forward, backward, wgrad) and of each FP8 grouped GEMM
// call: turns the device counts into segment offsets and into the per-group shapes and pointers (and, for FP8, scale
// pointers and leading dimensions) of the grouped GEMMs, and fills the per-expert bias pointer arrays the elementwise
// kernels read. One block; no host reads; graph-capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "experts/contig/contig_gemm.h"
#include "experts/grouped/grouped_gemm.h"

namespace moerail::experts {

inline constexpr int kRagged = -1;  // a GEMM size that is the segment's row count

// One operand's pointer for expert e with segment start o_e:
//   base + o_e * row_bytes + e * expert_bytes        (table < 0)
//   tables.p[table][e]                               (table >= 0: per-expert tensors)
struct OperandSetup {
  const char* base = nullptr;
  std::int64_t row_bytes = 0;
  std::int64_t expert_bytes = 0;
  int table = -1;
};

struct GemmSetup {
  GroupedGemmArrays arrays;      // destination of the shapes and pointers
  OperandSetup a, b, d;
  int m = 0, n = 0, k = 0;       // kRagged = the segment's rows
  // Blockwise-scaled FP8 GEMMs only (gemm_fp8.h), which are set up on every call rather than once:
  const void** ptr_sfa = nullptr;  // [groups] written when not nullptr: the scales of A_g and B_g, addressed like
  const void** ptr_sfb = nullptr;  // a and b through sfa and sfb
  OperandSetup sfa{}, sfb{};
  std::int64_t ld_a = 0, ld_b = 0, ld_d = 0;  // != 0: written into arrays.ld_a/ld_b/ld_d for every group
                                              // (kRagged: the group's segment rows)
  // Per-tensor-scaled FP8 GEMMs only: alpha[e] = alpha_a[alpha_a_per_expert ? e : 0] * alpha_b[alpha_b_per_expert ?
  // e : 0], written for every expert (empty ones included) when alpha is not nullptr; read on the device, so a graph
  // replays current scales.
  float* alpha = nullptr;
  const float* alpha_a = nullptr;
  const float* alpha_b = nullptr;
  bool alpha_a_per_expert = false;
  bool alpha_b_per_expert = false;
  // The contiguous GEMM of the same product runs beside this one (contig_gemm.h): when the pass's tile table
  // (SetupParams::contig) holds the experts, they get empty groups here.
  bool contig = false;
};

// A per-expert pointer array for the elementwise kernels and FC1's fused epilogue (biases, bias gradients, the
// activation output and probs rows of each segment).
struct PointerSetup {
  const void** out = nullptr;    // [L] written; nullptr = unused
  OperandSetup src;              // addressed like a GEMM operand (row_bytes from the segment start)
};

struct SetupParams {
  const void* counts = nullptr;  // [L] device
  bool counts_i64 = false;
  int L = 0;
  std::int64_t rows = 0;         // rows of the buffers: segments are clipped to [0, rows)
  std::int64_t* offsets = nullptr;  // [L + 1] written: segment starts, offsets[L] = rows in segments
  std::int32_t* rows_used = nullptr;  // [1] written when not nullptr: offsets[L] (region 0), for ops that take a
                                      // device row count (the FP8 quantizers)
  // > 1 (pad 0, no tile table): the counts are [chunks, L] and the buffers `chunks` regions of `rows` rows, region
  // c laid out by counts[c] from row c * rows; offsets is then [chunks][L + 1], region c's starts c * rows on.
  // The shapes and pointers below are region 0's (chunked weight gradients use the setup for ptr_d and the bias
  // pointers only: MlpBackwardDwArgs::chunk_rows).
  int chunks = 1;
  // > 0: every segment is rounded up to a multiple of pad rows and laid out back to back (the segment-transposed
  // FP8 layout of moerail/quant.h: pad 128): offsets, operand starts and ragged sizes are the padded ones.
  std::int64_t pad = 0;
  GemmSetup gemm[2];
  int num_gemms = 0;
  // tile_group != nullptr (and pad == 0): the tile table of the pass's contiguous GEMMs, for every expert (or for
  // none, num_tiles 0, when it would exceed max_tiles: the grouped GEMMs marked `contig` then keep them all).
  ContigTiles contig{};
  // [L] written when not nullptr: the places of the contiguous weight gradient's walk (ContigWgradPlace) and their
  // segments; wgrad_k_tiles[0] the k-tiles of all places (ContigWgradCall::walk[2]).
  ContigWgradPlace* wgrad_places = nullptr;
  ContigWgradSegment* wgrad_segments = nullptr;
  int* wgrad_k_tiles = nullptr;
  PointerSetup ptrs[4];
};

// Pointers of per-expert tensors, passed by value as a kernel parameter (at most 4 tables of
// kMaxPerExpertTensors entries: 8 KiB, within CUDA 12.1+'s 32 KiB parameter limit).
struct PerExpertTables {
  static constexpr int kTables = 4;
  static constexpr int kMax = 256;  // == moerail::kMaxPerExpertTensors
  const void* p[kTables][kMax];
};

// tables may be nullptr when no operand uses one.
void launch_setup(const SetupParams& params, const PerExpertTables* tables, cudaStream_t stream);

// Zeroes the first `num` GEMMs' D_e (of d_expert_bytes[i] bytes each) for every expert e with an empty segment
// (offsets[e + 1] == offsets[e]); D_e pointers are read from ptr_d written by the setup kernel.
struct ZeroEmptyParams {
  const std::int64_t* offsets = nullptr;
  int L = 0;
  void** ptr_d[2] = {nullptr, nullptr};
  std::int64_t bytes[2] = {0, 0};
  int num = 0;
};
void launch_zero_empty(const ZeroEmptyParams& params, cudaStream_t stream);

}  // namespace moerail::experts
