// src/experts/gemm_kinds.h — names of the expert GEMMs' operand layouts and compiled kernel configurations. Kept
// apart from the rules that choose among them (tiles.h), so that tuning a rule does not rebuild the CUTLASS
// instantiations that include grouped_gemm.h.
#pragma once

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

}  // namespace moerail::experts
