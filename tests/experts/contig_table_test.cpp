// The contiguous GEMMs' tile table (src/experts/contig/contig_gemm.h, contig_tile: the code the setup kernel runs) on random
// counts: every expert's clipped segment is covered exactly once, in order, by tiles of 1..128 rows of that expert
// alone, the bands of the scheduler's walk never leave an expert, and the table fits contig_max_tiles. No GPU needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "experts/contig/contig_gemm.h"

namespace moerail::experts {
namespace {

// What the setup kernel computes before the table: clipped counts, their starts, the first tile of every expert.
struct Segments {
  std::vector<std::int64_t> start, first;  // [L + 1] each
};

Segments segments(const std::vector<std::int64_t>& counts, std::int64_t rows) {
  const int L = int(counts.size());
  Segments s;
  s.start.assign(std::size_t(L) + 1, 0);
  s.first.assign(std::size_t(L) + 1, 0);
  for (int e = 0; e < L; ++e) {
    const std::int64_t c = std::clamp<std::int64_t>(counts[std::size_t(e)], 0, rows);
    s.start[std::size_t(e) + 1] = s.start[std::size_t(e)] + c;
  }
  for (int e = 0; e < L; ++e) {
    const std::int64_t n = std::min(s.start[std::size_t(e) + 1], rows) - std::min(s.start[std::size_t(e)], rows);
    s.first[std::size_t(e) + 1] = s.first[std::size_t(e)] + (n + kContigTileM - 1) / kContigTileM;
  }
  return s;
}

void check_table(const std::vector<std::int64_t>& counts, std::int64_t rows) {
  SCOPED_TRACE(::testing::Message() << "rows " << rows << ", L " << counts.size());
  const int L = int(counts.size());
  const Segments s = segments(counts, rows);
  const std::int64_t tiles = s.first[std::size_t(L)];
  ASSERT_LE(tiles, contig_max_tiles(rows, L));
  std::vector<ContigTileEntry> table;
  for (std::int64_t t = 0; t < tiles; ++t) table.push_back(contig_tile(t, s.first.data(), s.start.data(), L, rows));

  // coverage: expert e's tiles are first[e] .. first[e + 1] - 1 and tile its clipped segment in order
  for (int e = 0; e < L; ++e) {
    std::int64_t next = std::min(s.start[std::size_t(e)], rows);
    const std::int64_t end = std::min(s.start[std::size_t(e) + 1], rows);
    for (std::int64_t t = s.first[std::size_t(e)]; t < s.first[std::size_t(e) + 1]; ++t) {
      const ContigTileEntry& c = table[std::size_t(t)];
      ASSERT_EQ(c.group, e) << "tile " << t;
      ASSERT_EQ(c.row, next) << "tile " << t;
      ASSERT_GE(c.rows, 1) << "tile " << t;
      ASSERT_LE(c.rows, kContigTileM) << "tile " << t;
      ASSERT_LE(c.row + c.rows, end) << "tile " << t << " writes past its expert's rows";
      if (c.rows < kContigTileM) ASSERT_EQ(c.row + c.rows, end) << "a short tile " << t << " before the last";
      next += c.rows;
    }
    ASSERT_EQ(next, end) << "expert " << e << " not covered";
  }

  // bands: tile t lies in its band, every tile of a band names the same band and expert, at most kContigBand tiles
  for (std::int64_t t = 0; t < tiles; ++t) {
    const int band = table[std::size_t(t)].band;
    const int first = contig_band_first(band), height = contig_band_height(band);
    ASSERT_GE(height, 1);
    ASSERT_LE(height, kContigBand);
    ASSERT_LE(first, t);
    ASSERT_LT(t, first + height);
    for (int u = first; u < first + height; ++u) {
      ASSERT_LT(u, tiles);
      ASSERT_EQ(table[std::size_t(u)].band, band) << "tiles " << t << " and " << u;
      ASSERT_EQ(table[std::size_t(u)].group, table[std::size_t(t)].group) << "a band across experts at " << u;
    }
  }
}

TEST(ExpertsContigTable, HandPickedCounts) {
  check_table({256, 0, 128, 384, 128, 128}, 1700);  // whole tiles, an empty expert, rows past the segments
  check_table({128, 128, 100, 256, 0, 128}, 1700);  // a short tile, then segments off the 128-row grid
  check_table({0, 0, 1664, 0, 0, 0}, 1700);         // 13 tiles of one expert: two bands
  check_table({1, 129, 255, 16, 0, 1299}, 1700);    // 1-row tiles, a band of 8 and a short tile
  check_table({1000, 1000, 1000}, 1700);            // counts past the buffer: the last expert clipped to nothing
  check_table({0, 0, 0}, 64);                       // no rows
  check_table({5}, 5);                              // one expert, one short tile
}

TEST(ExpertsContigTable, RandomCounts) {
  std::mt19937_64 rng(20261123);
  for (int iter = 0; iter < 300; ++iter) {
    const int L = 1 + int(rng() % (iter % 3 == 0 ? 1024 : 64));
    const std::int64_t rows = 1 + std::int64_t(rng() % 40000);
    std::vector<std::int64_t> counts(static_cast<std::size_t>(L));
    for (std::int64_t& c : counts) {
      const unsigned kind = unsigned(rng() % 4);
      c = kind == 0 ? 0 : kind == 1 ? std::int64_t(rng() % 16) * 16 : std::int64_t(rng() % (2 * rows / L + 300));
    }
    if (iter % 7 == 0) counts[rng() % counts.size()] = -5;  // negative counts read as 0
    check_table(counts, rows);
    if (HasFatalFailure()) return;
  }
}

// MlpContiguous::Auto's rule for the weight gradients (contig_wgrad_auto) on the shapes it was measured on, with an
// H100's / H200's 132 SMs: qwen3-30b-a3b's dW2 [2048, 768] and dW1 [1536, 2048] run contiguously, deepseek-v3's
// [7168, 2048] and [4096, 7168] stay grouped; the bound itself is inclusive.
TEST(ExpertsContigTable, WeightGradientAutoRule) {
  EXPECT_TRUE(contig_wgrad_auto(2048, 768, 132));
  EXPECT_TRUE(contig_wgrad_auto(1536, 2048, 132));
  EXPECT_FALSE(contig_wgrad_auto(7168, 2048, 132));
  EXPECT_FALSE(contig_wgrad_auto(4096, 7168, 132));
  EXPECT_TRUE(contig_wgrad_auto(128 * 4, 129 * 128 - 127, 129));  // 4 x 129 tiles: 4 per SM
  EXPECT_FALSE(contig_wgrad_auto(128 * 4 + 1, 129 * 128, 129));   // 5 x 129
}

// The contiguous weight gradient's walk under MOERAIL_CONTIG_WALK=auto (contig_wgrad_walk_dynamic), on the bench's
// qwen3-30b-a3b cases with 66 clusters: Zipf routing (the first expert's 35440 rows are 554 of the 2078 k-tiles of
// all experts) walks dynamically for dW1 (96 units per expert) and dW2 (48); balanced routing (16 k-tiles each of
// 128 experts) statically; the bound is inclusive; no rows, statically.
TEST(ExpertsContigTable, WeightGradientWalkRule) {
  EXPECT_TRUE(contig_wgrad_walk_dynamic(554, 2078, 96, 66));
  EXPECT_TRUE(contig_wgrad_walk_dynamic(554, 2078, 48, 66));
  EXPECT_FALSE(contig_wgrad_walk_dynamic(16, 16 * 128, 96, 66));
  EXPECT_TRUE(contig_wgrad_walk_dynamic(100, 660, 100, 66));  // 100 * 66 * 10 == 100 * 660
  EXPECT_FALSE(contig_wgrad_walk_dynamic(99, 660, 100, 66));
  EXPECT_FALSE(contig_wgrad_walk_dynamic(0, 0, 96, 66));
}

}  // namespace
}  // namespace moerail::experts
