// src/experts/tiles.h — the one place that chooses the kernel configuration of each expert GEMM (plain C++: no
// CUDA or CUTLASS headers, so the CPU unit tests check the rules; not included by the CUTLASS instantiations).
//
// Two configurations are compiled (each instantiation costs minutes of nvcc time, so there are few):
//   Coop128x256  cooperative schedule, 128x256x64 tile: both consumer warpgroups work on one 128x256 tile (64x256
//                each): the most FLOPs per byte of shared-memory traffic, but nothing computes while a tile is
//                stored.
//   Ping128x128  ping-pong schedule, 128x128x64 tile: the two consumer warpgroups take alternate tiles, so one
//                stores its tile while the other runs its mainloop.
// Clusters (grouped_gemm_sm90.cuh): forward and dgrad (ragged M) pair two CTAs along N (the token tile of A is
// multicast); wgrad (ragged K, fixed M = F1 or H) pairs them along M.
//
// The rules below come from `moerail bench mlp`'s tile sweep (config.tile_sweep: every GEMM on both tiles, timed
// alternating in one loop, on the preset shapes, balanced and Zipf 1.2); rerun it to revisit them.
// - Ping-pong wins where the epilogue is a visible share of a tile: every forward and dgrad GEMM but those with a
//   long reduction, and every wgrad of up to ~1024 rows per expert.
// - The cooperative tile wins where its mainloop dominates: long reductions (kLongReduction), and wgrads of many rows
//   per expert whose M side (F1 or H) is the larger operand: that operand is re-read once per column tile (the
//   scheduler walks M first), and the 256-wide tile halves the traffic when it does not stay in L2.
// - On a GPU of less memory bandwidth (H100 SXM) the grouped kernels take the cooperative tile everywhere (twice the
//   FLOPs per byte of operand traffic). The contiguous GEMMs (contig_gemm.h) exist on the ping-pong tile only; the
//   grouped cooperative tile still beats them there on ragged-M GEMMs of a long reduction whose N fills whole
//   clusters of two 256-wide tiles (low_bandwidth_prefers_cooperative).
// MlpOptions overrides each GEMM; the bench records its choice.
#pragma once

#include <cstdint>

#include "experts/gemm_kinds.h"

namespace moerail::experts {

// Reductions at least this long amortize the cooperative tile's exposed epilogue (ragged-M GEMMs).
inline constexpr std::int64_t kLongReduction = 16384;
// Wgrad reductions (rows per expert) at least this long may take the cooperative tile (see above).
inline constexpr std::int64_t kLongWgradReduction = 2048;
// Memory bandwidth (bytes/s) below which GEMMs that run grouped take the cooperative tile (see above): between the
// H100 SXM's 3.35e12 and the H200's 4.8e12.
inline constexpr double kLowMemoryBandwidth = 4.0e12;

// Ragged-M reductions at least this long may take the cooperative tile on a low-bandwidth GPU (see above).
inline constexpr std::int64_t kLowBandwidthCooperativeMinK = 2048;
// Columns of a cluster of two cooperative tiles (128x256, clusters 1x2 along N for ragged-M GEMMs).
inline constexpr std::int64_t kCooperativeClusterN = 512;

// Whether, on a GPU of less than kLowMemoryBandwidth, a forward or dgrad GEMM of n output columns and reduction k
// runs grouped on the cooperative tile rather than contiguously on the ping-pong one (see above).
constexpr bool low_bandwidth_prefers_cooperative(GemmLayout layout, std::int64_t n, std::int64_t k) {
  return layout != GemmLayout::Wgrad && k >= kLowBandwidthCooperativeMinK && n % kCooperativeClusterN == 0;
}

// m: rows of each group (forward/dgrad: average rows per expert; wgrad: F1 or H), n: output columns,
// k: reduction length (wgrad: average rows per expert). grouped_on_low_bandwidth: the GEMM runs on the grouped
// kernel (not contiguously) on a GPU of less than kLowMemoryBandwidth.
constexpr GemmTile choose_tile(GemmLayout layout, std::int64_t m, std::int64_t n, std::int64_t k,
                               bool grouped_on_low_bandwidth = false) {
  if (grouped_on_low_bandwidth) return GemmTile::Coop128x256;
  if (layout != GemmLayout::Wgrad) return k >= kLongReduction ? GemmTile::Coop128x256 : GemmTile::Ping128x128;
  return k >= kLongWgradReduction && m > n ? GemmTile::Coop128x256 : GemmTile::Ping128x128;
}

// Columns of FC1's tile that its fused activation epilogue (glu_epilogue.cuh, kStageN) stages at a time on `tile`:
// the GLU's pairs of interleaved blocks (2 glu_block) must divide it. The cooperative tile's rounds are narrower so
// that its mainloop keeps four stages.
constexpr std::int64_t glu_round_columns(GemmTile tile) { return tile == GemmTile::Coop128x256 ? 64 : 128; }

// The tile of FC1 with the activation in its epilogue when no tile is forced (mlp_tuning.h), given the plain FC1's tile, whether
// FC1 can run contiguously on the ping-pong tile (contig_gemm.h) and the GLU's interleave block. On the cooperative
// tile the fused epilogue (glu_epilogue.cuh) is exposed: nothing computes while it runs, where on the ping-pong tile
// the other warpgroup's mainloop runs meanwhile. So where FC1 took the cooperative tile only to run grouped
// (low_bandwidth_prefers_cooperative), the fused FC1 goes back to the contiguous ping-pong kernel (measured ahead
// there); where it runs grouped either way (a few long experts, as mixtral-8x7b's eight) the cooperative tile stays
// (measured ahead there). A glu_block too wide for the cooperative tile's rounds goes to the ping-pong tile as well
// (as does 0, no interleave, which fuses on neither).
constexpr GemmTile fused_fc1_tile(GemmTile plain, bool contiguous_on_ping, std::int64_t glu_block) {
  const bool fits = glu_block > 0 && glu_round_columns(GemmTile::Coop128x256) % (2 * glu_block) == 0;
  return plain == GemmTile::Coop128x256 && (contiguous_on_ping || !fits) ? GemmTile::Ping128x128 : plain;
}

// MlpActivation::Auto puts the activation backward into FC2's contiguous dgrad epilogue (act_bwd_epilogue.cuh) from
// this reduction length (K = H) on: the epilogue's work per tile does not depend on K, while the other warpgroup's
// mainloop beside it grows with K. bench mlp, fused against the pass: ahead from K 2048 on the H100 SXM, level at
// 2048 and ahead at 7168 on the H200.
inline constexpr std::int64_t kActBwdAutoMinK = 2048;

}  // namespace moerail::experts
