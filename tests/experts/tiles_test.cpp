// The expert-GEMM kernel choice (src/experts/tiles.h) on the benchmark shapes: runs everywhere, no GPU needed.
// Each expectation is the faster tile of `moerail bench mlp`'s tile sweep on that GEMM (tiles.h gives the figures).
#include <gtest/gtest.h>

#include "experts/tiles.h"

namespace moerail::experts {
namespace {

constexpr GemmTile kCoop = GemmTile::Coop128x256;
constexpr GemmTile kPing = GemmTile::Ping128x128;

TEST(ExpertsTiles, RaggedRowGemmsTakePingPong) {
  // deepseek-v3 (H 7168, F 2048, ~1024 rows per expert): FC1, FC2, FC2 dgrad, FC1 dgrad.
  EXPECT_EQ(choose_tile(GemmLayout::TN, 1024, 4096, 7168), kPing);
  EXPECT_EQ(choose_tile(GemmLayout::TN, 1024, 7168, 2048), kPing);
  EXPECT_EQ(choose_tile(GemmLayout::NN, 1024, 2048, 7168), kPing);
  EXPECT_EQ(choose_tile(GemmLayout::NN, 1024, 7168, 4096), kPing);
  // qwen3-30b-a3b (H 2048, F 768): FC2 with K = 768, FC2 dgrad with N = 768.
  EXPECT_EQ(choose_tile(GemmLayout::TN, 1024, 2048, 768), kPing);
  EXPECT_EQ(choose_tile(GemmLayout::NN, 1024, 768, 2048), kPing);
  // mixtral-8x7b (H 4096, F 14336): FC1 and FC2 (K = 14336, below the long-reduction bound).
  EXPECT_EQ(choose_tile(GemmLayout::TN, 2048, 28672, 4096), kPing);
  EXPECT_EQ(choose_tile(GemmLayout::TN, 2048, 4096, 14336), kPing);
}

TEST(ExpertsTiles, LongReductionsTakeTheCooperativeTile) {
  EXPECT_EQ(choose_tile(GemmLayout::NN, 2048, 4096, 28672), kCoop);  // mixtral FC1 dgrad, K = F1
  EXPECT_EQ(choose_tile(GemmLayout::NN, 2048, 4096, kLongReduction), kCoop);
  EXPECT_EQ(choose_tile(GemmLayout::NN, 2048, 4096, kLongReduction - 1), kPing);
}

TEST(ExpertsTiles, WeightGradients) {
  // ~1024 rows per expert: ping-pong (deepseek-v3 dW2 and dW1, qwen3 dW2).
  EXPECT_EQ(choose_tile(GemmLayout::Wgrad, 7168, 2048, 1024), kPing);
  EXPECT_EQ(choose_tile(GemmLayout::Wgrad, 4096, 7168, 1024), kPing);
  EXPECT_EQ(choose_tile(GemmLayout::Wgrad, 2048, 768, 1024), kPing);
  // mixtral, 2048 rows per expert: dW2 (M = H < N = F) ping-pong, dW1 (M = F1 > N = H) cooperative.
  EXPECT_EQ(choose_tile(GemmLayout::Wgrad, 4096, 14336, 2048), kPing);
  EXPECT_EQ(choose_tile(GemmLayout::Wgrad, 28672, 4096, 2048), kCoop);
  EXPECT_EQ(choose_tile(GemmLayout::Wgrad, 28672, 4096, kLongWgradReduction - 1), kPing);
}

TEST(ExpertsTiles, GroupedGemmsOnLowBandwidthGpusTakeTheCooperativeTile) {
  // H100 SXM: every GEMM that runs grouped (mixtral's eight experts; deepseek-v3's weight gradients).
  for (GemmLayout layout : {GemmLayout::TN, GemmLayout::NN, GemmLayout::Wgrad}) {
    EXPECT_EQ(choose_tile(layout, 2048, 28672, 4096, true), kCoop);
    EXPECT_EQ(choose_tile(layout, 1024, 768, 2048, true), kCoop);
  }
  EXPECT_EQ(choose_tile(GemmLayout::TN, 2048, 28672, 4096, false), kPing);  // the H200 rule
}

TEST(ExpertsTiles, LowBandwidthGpusRunLongRaggedGemmsOfWholeClustersGrouped) {
  // deepseek-v3: FC1, FC2, FC2 dgrad, FC1 dgrad (N = F 2048, H 7168 or F1 4096; K >= 2048).
  EXPECT_TRUE(low_bandwidth_prefers_cooperative(GemmLayout::TN, 4096, 7168));
  EXPECT_TRUE(low_bandwidth_prefers_cooperative(GemmLayout::TN, 7168, 2048));
  EXPECT_TRUE(low_bandwidth_prefers_cooperative(GemmLayout::NN, 2048, 7168));
  EXPECT_TRUE(low_bandwidth_prefers_cooperative(GemmLayout::NN, 7168, 4096));
  // qwen3-30b-a3b: FC1 (N = F1 1536, K = H 2048) yes; FC2 (K = 768), FC2 dgrad (N = 768: three 256-wide tiles in
  // two clusters) and FC1 dgrad (K = F1 1536) stay contiguous.
  EXPECT_TRUE(low_bandwidth_prefers_cooperative(GemmLayout::TN, 1536, 2048));
  EXPECT_FALSE(low_bandwidth_prefers_cooperative(GemmLayout::TN, 2048, 768));
  EXPECT_FALSE(low_bandwidth_prefers_cooperative(GemmLayout::NN, 768, 2048));
  EXPECT_FALSE(low_bandwidth_prefers_cooperative(GemmLayout::NN, 2048, 1536));
  // weight gradients keep their own rule (contig_wgrad_auto)
  EXPECT_FALSE(low_bandwidth_prefers_cooperative(GemmLayout::Wgrad, 2048, 4096));
}

TEST(ExpertsTiles, TheFusedFc1LeavesTheCooperativeTileWhereItCanRunContiguously) {
  // H100: deepseek-v3's and qwen3's FC1 run grouped on the cooperative tile, the fused one contiguously on ping-pong
  EXPECT_EQ(fused_fc1_tile(kCoop, true, 32), kPing);
  // mixtral's eight experts run grouped either way: the fused FC1 keeps the cooperative tile
  EXPECT_EQ(fused_fc1_tile(kCoop, false, 32), kCoop);
  EXPECT_EQ(fused_fc1_tile(kCoop, false, 8), kCoop);
  EXPECT_EQ(fused_fc1_tile(kPing, true, 32), kPing);
  EXPECT_EQ(fused_fc1_tile(kPing, false, 32), kPing);
}

TEST(ExpertsTiles, AGluBlockWiderThanTheCooperativeRoundsTakesThePingPongTile) {
  // the cooperative fused epilogue stages 64 columns at a time: pairs of 2 x 64 columns do not fit
  EXPECT_EQ(glu_round_columns(kCoop), 64);
  EXPECT_EQ(glu_round_columns(kPing), 128);
  EXPECT_EQ(fused_fc1_tile(kCoop, false, 64), kPing);
  EXPECT_EQ(fused_fc1_tile(kPing, false, 64), kPing);
  // glu_block 0 (concatenated halves; nothing fuses): no division by it
  static_assert(fused_fc1_tile(kCoop, false, 0) == kPing, "usable in constant expressions");
}

static_assert(choose_tile(GemmLayout::TN, 1, 512, 4096) == GemmTile::Ping128x128, "usable in constant expressions");

}  // namespace
}  // namespace moerail::experts
