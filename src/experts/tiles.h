// src/experts/tiles.h — the one place that chooses the kernel configuration of each expert GEMM (plain C++: no
// CUDA or CUTLASS headers, so the CPU unit tests check the rules).
//
// Two configurations are compiled (each instantiation costs minutes of nvcc time, so there are few):
//   Coop128x256  cooperative schedule, 128x256x64 tile: both consumer warpgroups work on one 128x256 tile (64x256
//                each), the largest bf16 accumulator that fits the register file, so the most FLOPs per byte of
//                shared-memory traffic; it is what dense CUTLASS/cuBLAS Hopper bf16 GEMMs run at ~75-80% of peak.
//                Its weakness is the epilogue: nothing computes while the tile is stored.
//   Ping128x128  ping-pong schedule, 128x128x64 tile: the two consumer warpgroups take alternate tiles, so one
//                stores its tile while the other runs its mainloop. Wins when the mainloop is short (small K) and
//                the epilogue is a large share of each tile, and halves the column waste of narrow outputs.
// Clusters (grouped_gemm_sm90.cuh): forward and dgrad (ragged M) pair two CTAs along N (the token tile of A is
// multicast); wgrad (ragged K, fixed M = F1 or H) pairs them along M.
//
// The rules below are a first cut from the structure of the kernels (no measurement was possible when they were
// written); MlpOptions overrides each GEMM for tuning, and `moerail bench mlp` records the choice it ran.
#pragma once

#include <cstdint>

namespace moerail::experts {

// Operand layouts of the expert GEMMs. "K-major" = the reduction index is contiguous in memory.
enum class GemmLayout {
  TN,     // A [M,K] row-major (K-major), B given as [N,K] row-major (K-major):   forward  X W^T
  NN,     // A [M,K] row-major (K-major), B given as [K,N] row-major (N-major):   dgrad    dY W
  Wgrad,  // A given as [K,M] row-major (M-major), B [K,N] row-major (N-major):   wgrad    dY^T X
};

// The compiled kernel configurations (tile M x N x K, schedule); the cluster depends on the layout.
enum class GemmTile {
  Coop128x256,  // KernelPtrArrayTmaWarpSpecializedCooperative, 128x256x64, two consumer warpgroups on one tile
  Ping128x128,  // KernelPtrArrayTmaWarpSpecializedPingpong, 128x128x64, consumer warpgroups on alternate tiles
};

// m: rows of each group (forward/dgrad: average rows per expert; wgrad: F1 or H), n: output columns,
// k: reduction length (wgrad: average rows per expert).
constexpr GemmTile choose_tile(GemmLayout layout, std::int64_t m, std::int64_t n, std::int64_t k) {
  (void)m;
  // 1. Short reductions: with K <= 1024 the cooperative mainloop is <= 16 k-steps, and its exposed epilogue
  //    (128x256 bf16 through shared memory) costs a large fraction of each tile. Ping-pong hides it.
  if (k <= 1024) return GemmTile::Ping128x128;
  // 2. Ragged-M GEMMs pair CTAs along N: an odd number of 256-wide column tiles leaves one dead tile per cluster
  //    row (N = 768: 3 tiles -> 4, a third wasted); take 128-wide tiles when their count is even.
  if (layout != GemmLayout::Wgrad) {
    const std::int64_t tiles256 = (n + 255) / 256, tiles128 = (n + 127) / 128;
    if (tiles256 % 2 == 1 && tiles128 % 2 == 0) return GemmTile::Ping128x128;
  }
  // 3. Otherwise the densest tile.
  return GemmTile::Coop128x256;
}

}  // namespace moerail::experts
