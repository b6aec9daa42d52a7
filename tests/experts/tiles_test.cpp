// The expert-GEMM kernel choice (src/experts/tiles.h) on the benchmark shapes: runs everywhere, no GPU needed.
#include <gtest/gtest.h>

#include "experts/tiles.h"

namespace moerail::experts {
namespace {

constexpr GemmTile kCoop = GemmTile::Coop128x256;
constexpr GemmTile kPing = GemmTile::Ping128x128;

TEST(ExpertsTiles, LongReductionsTakeTheCooperativeTile) {
  // deepseek-v3 (H 7168, F 2048, ~1024 rows/expert) and mixtral-8x7b (H 4096, F 14336, ~2048 rows/expert).
  EXPECT_EQ(choose_tile(GemmLayout::TN, 1024, 4096, 7168), kCoop);     // FC1
  EXPECT_EQ(choose_tile(GemmLayout::TN, 1024, 7168, 2048), kCoop);     // FC2: 28 column tiles, even
  EXPECT_EQ(choose_tile(GemmLayout::NN, 1024, 2048, 7168), kCoop);     // FC2 dgrad
  EXPECT_EQ(choose_tile(GemmLayout::TN, 2048, 28672, 4096), kCoop);
  EXPECT_EQ(choose_tile(GemmLayout::Wgrad, 28672, 4096, 2048), kCoop);  // dW1, K = 2048 rows
}

TEST(ExpertsTiles, ShortReductionsTakePingPong) {
  // qwen3-30b-a3b: FC2 has K = F = 768; wgrad K = ~1024 rows per expert.
  EXPECT_EQ(choose_tile(GemmLayout::TN, 1024, 2048, 768), kPing);
  EXPECT_EQ(choose_tile(GemmLayout::Wgrad, 2048, 768, 1024), kPing);
  EXPECT_EQ(choose_tile(GemmLayout::TN, 1024, 1536, 2048), kCoop);  // FC1: 6 column tiles of 256
}

TEST(ExpertsTiles, OddColumnTileCountsAvoidTheDeadClusterTile) {
  // qwen3 FC2 dgrad: N = F = 768 is 3 tiles of 256 (a cluster pair along N wastes one) but 6 of 128.
  EXPECT_EQ(choose_tile(GemmLayout::NN, 1024, 768, 2048), kPing);
  // Wgrad pairs CTAs along M, so its N parity does not matter.
  EXPECT_EQ(choose_tile(GemmLayout::Wgrad, 768, 768, 4096), kCoop);
}

static_assert(choose_tile(GemmLayout::TN, 1, 512, 4096) == GemmTile::Coop128x256, "usable in constant expressions");

}  // namespace
}  // namespace moerail::experts
