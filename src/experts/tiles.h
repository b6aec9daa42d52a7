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
// The rules come from `moerail bench mlp`'s tile sweep (config.tile_sweep: every GEMM on both tiles, the variants
// timed alternating in one loop; H200, commit 7a7be7431407, six cases: deepseek-v3, qwen3-30b-a3b, mixtral-8x7b, each
// balanced and Zipf 1.2). Ping-pong was faster or equal on every forward and dgrad GEMM but one, by 2-11% (FC2:
// deepseek-v3 1594 vs 1754 us, qwen3 729 vs 803; qwen3 FC2 dgrad 11%), and on every wgrad with <= ~1024 rows per
// expert (deepseek-v3 balanced: both wgrads 4351 vs 5132 us). The cooperative tile won where its mainloop
// dominates: mixtral's FC1 dgrad (K = F1 = 28672; 9634 vs 10400 us under Zipf) and mixtral's dW1 (2048 rows per
// expert, M = F1 = 28672 > N = H = 4096; 9404 vs 10099 us with dW2 on ping-pong in both), while mixtral's dW2
// (M = 4096 < N = 14336) was 3% faster on ping-pong. The reading for wgrad: a group's M-side operand [K, M] is
// re-read once per column tile (the scheduler walks M first), so when it is the larger one and does not stay in L2,
// the 256-wide column tile halves that traffic. MlpOptions overrides each GEMM; the bench records its choice.
//
// On a GPU of less memory bandwidth the grouped kernels want the cooperative tile: on an H100 SXM (3.35 TB/s) the
// same sweep (commit 63a044e) put it ahead on every GEMM that runs grouped (mixtral-8x7b, 8 experts, balanced:
// FC1 5812 vs 7397 us, FC2 2797 vs 3777, the data gradients 9102 vs 9754 against the H200 rule's pair, the weight
// gradients 9431 vs 9876; deepseek-v3's grouped weight gradients 4902 vs 5216), twice the FLOPs per byte of
// operand traffic. The contiguous GEMMs (many experts; contig_gemm.h) exist on the ping-pong tile only. There the
// cooperative tile, grouped, still beats them on a ragged-M GEMM whose reduction is long enough and whose N fills
// whole clusters of two 256-wide tiles (`low_bandwidth_prefers_cooperative`). H100 SXM, bench mlp (63a044e,
// b3950aa): deepseek-v3's data gradients 4777-4859 us grouped on it against 6346 contiguous (Zipf 4559 against 6160),
// its Zipf FC2 1462 against 1735, qwen3's FC1 1403 against 1571. qwen3's FC2 dgrad (N = 768: three 256-wide tiles
// take two clusters) ran 2757 us on it against 2471 contiguous, and qwen3's FC2 (K = 768) 811 against 762.
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

// The tile of FC1 with the activation in its epilogue under MlpGemmTile::Auto, given the plain FC1's tile, whether
// FC1 can run contiguously on the ping-pong tile (contig_gemm.h) and the GLU's interleave block. On the cooperative
// tile the fused epilogue (glu_epilogue.cuh) is exposed: nothing computes while it runs, where on the ping-pong
// tile the other warpgroup's mainloop runs meanwhile. H100 SXM, bench mlp, the fused FC1 over the plain
// cooperative FC1: qwen3-30b-a3b +27.8% on the cooperative tile (e328f15, row copies in 128-column rounds) against
// +3.4% contiguous ping-pong (ca90563, another run); deepseek-v3 -0.9% (Zipf +0.5%) contiguous ping-pong against
// +10.4% (+8.6%) for ca90563's cooperative variant, which copied out through registers (reverted, slower still on
// mixtral and qwen3: docs/experts.md); so where FC1 took the cooperative tile only to run grouped rather than
// contiguously (low_bandwidth_prefers_cooperative) the fused one goes back to the contiguous ping-pong kernels.
// Where it runs grouped either way (mixtral-8x7b's eight experts) the cooperative one is ahead, alternating in one
// loop (102d444, tensor stores in 64-column rounds, stmatrix): +3.8% (Zipf +3.1%) against +17.1% (+20.3%) on the
// ping-pong tile. On qwen3-30b-a3b and deepseek-v3 the contiguous ping-pong kernel stays ahead (243bda9): qwen3 +1.3%
// (Zipf +5.7%) against +17.1% (+11.6%) cooperative, deepseek-v3 -0.7% (+0.1%) against +4.6% (-2.1%).
// A glu_block too wide for the cooperative tile's rounds goes to the ping-pong tile as well (as does 0, no
// interleave, which fuses on neither).
constexpr GemmTile fused_fc1_tile(GemmTile plain, bool contiguous_on_ping, std::int64_t glu_block) {
  const bool fits = glu_block > 0 && glu_round_columns(GemmTile::Coop128x256) % (2 * glu_block) == 0;
  return plain == GemmTile::Coop128x256 && (contiguous_on_ping || !fits) ? GemmTile::Ping128x128 : plain;
}

// MlpActivation::Auto puts the activation backward into FC2's contiguous dgrad epilogue (act_bwd_epilogue.cuh) from
// this reduction length (K = H) on: the epilogue's work per tile does not depend on K, the other warpgroup's mainloop
// beside it grows with K. bench mlp, the data gradients fused against the pass (both contiguous, alternating):
// H100 SXM at 761483c: K 2048 (qwen3-30b-a3b) -5.4% (Zipf -3.0%), K 7168 (deepseek-v3) -10.1% (Zipf -3.3%);
// H200 at cff3d54: K 2048 -0.3% (Zipf +0.0%), so the rule is the same on both GPUs.
// Before 761483c's leaner epilogue (H200, 5643205): K 2048 +5.0%, 4096 (mixtral-8x7b) -1.2%, 7168 -2.4%, and the
// rule began at 4096 (docs/experts.md).
inline constexpr std::int64_t kActBwdAutoMinK = 2048;

}  // namespace moerail::experts
