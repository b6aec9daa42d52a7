// GPU tests of the grouped expert MLP against the CPU reference (src/reference/experts.cpp): every activation and
// GLU layout, biases, both prob modes, empty experts, all rows on one expert, odd row counts, per-expert weights,
// int32/int64 counts, delayed wgrad, every compiled GEMM configuration, the contiguous GEMMs and the fused
// epilogues (the weight gradients' other forms: mlp_wgrad_test.cu).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdlib>

#include "experts/mlp_harness.h"
#include "experts/setup.h"
#include "experts/tiles.h"  // kActBwdAutoMinK

namespace moerail::testing::mlp {
namespace {

// Ragged counts with an empty expert, summing to fewer rows than the buffer holds.
const std::vector<std::int64_t> kCounts4 = {48, 0, 80, 16};
constexpr std::int64_t kRows4 = 200;

TEST(ExpertsMlp, EveryActivationConcatenated) {
  MOERAIL_REQUIRE_GPU();
  for (Activation a : {Activation::SwiGLU, Activation::GeGLU, Activation::QuickGeGLU, Activation::ReLU2,
                       Activation::GELU}) {
    SCOPED_TRACE(std::string(name_of(a)));
    MoeConfig cfg = small_config(a, 4);
    if (a == Activation::QuickGeGLU) cfg.quick_geglu_limit = 2.5;  // some inputs beyond the clamps
    run_case(cfg, kCounts4, kRows4);
  }
}

TEST(ExpertsMlp, InterleavedGlu) {
  MOERAIL_REQUIRE_GPU();
  struct Case {
    Activation act;
    std::int64_t g;
  };
  // g = 8, 32: vectorized path; g = 4: the scalar path (gate and linear columns not 8-contiguous).
  for (Case c : {Case{Activation::SwiGLU, 8}, Case{Activation::SwiGLU, 4}, Case{Activation::GeGLU, 32},
                 Case{Activation::QuickGeGLU, 16}}) {
    SCOPED_TRACE(std::string(name_of(c.act)) + " g=" + std::to_string(c.g));
    MoeConfig cfg = small_config(c.act, 4);
    cfg.glu_layout = GluLayout::Interleaved;
    cfg.glu_block = c.g;
    run_case(cfg, kCounts4, kRows4);
  }
}

TEST(ExpertsMlp, FusedActivationEpilogueMatchesThePassBitExactly) {
  MOERAIL_REQUIRE_GPU();
  // FC1's epilogue computes the activation when the halves are interleaved in blocks of g in {8, 16, 32, 64} (on
  // the cooperative tile {8, 16, 32}); the separate pass on the same tile gives the reference bits. F1 = 640 (F 320)
  // ends in a partial 128-wide pair group for g = 64 and, on the cooperative tile, in a 256-wide tile of which only
  // the first two rounds of 64 columns are inside; row counts end in partial 128-row tiles, one of them (70 rows)
  // inside the second of the ping-pong tile's two 64-row rounds.
  struct Case {
    Activation act;
    std::int64_t g, F;
    bool fc1_bias;
    ProbMode mode;
  };
  for (Case c : {Case{Activation::SwiGLU, 8, 320, false, ProbMode::InActivation},
                 Case{Activation::SwiGLU, 64, 320, true, ProbMode::InActivation},
                 Case{Activation::GeGLU, 32, 320, true, ProbMode::InCombine},
                 Case{Activation::QuickGeGLU, 16, 320, false, ProbMode::InActivation},
                 Case{Activation::QuickGeGLU, 32, 384, true, ProbMode::InActivation}}) {
    SCOPED_TRACE(std::string(name_of(c.act)) + " g=" + std::to_string(c.g) + " F=" + std::to_string(c.F) +
                 " fc1_bias=" + std::to_string(c.fc1_bias) + " " + std::string(name_of(c.mode)));
    MoeConfig cfg = small_config(c.act, 4, 256, c.F);
    cfg.glu_layout = GluLayout::Interleaved;
    cfg.glu_block = c.g;
    cfg.fc1_bias = c.fc1_bias;
    cfg.prob_mode = c.mode;
    if (c.act == Activation::QuickGeGLU) cfg.quick_geglu_limit = 2.5;
    for (MlpGemmTile tile : {MlpGemmTile::Pingpong128x128, MlpGemmTile::Cooperative128x256}) {
      SCOPED_TRACE(tile == MlpGemmTile::Pingpong128x128 ? "ping-pong" : "cooperative");
      GpuOptions fused, pass;
      fused.mlp.activation = MlpActivation::Fused;
      pass.mlp.activation = MlpActivation::Separate;
      fused.tiles.fc1 = pass.tiles.fc1 = tile;  // the same FC1 tile: h1 must match too
      fused.mlp.tuning = &fused.tiles;
      if (tile == MlpGemmTile::Cooperative128x256 && c.g == 64) {  // wider than the cooperative rounds
        expect_error_mentions([&] { GroupedMlp m(cfg, fused.mlp); }, "tuning fc1 = Cooperative128x256",
                              ErrorCode::Unsupported);
        continue;
      }
      const std::vector<std::int64_t> counts = {130, 0, 257, 70};
      const GpuOutputs a = run_case(cfg, counts, 480, fused);  // each also compared with the reference
      const GpuOutputs b = run_case(cfg, counts, 480, pass);
      EXPECT_TRUE(a.activation_fused);
      EXPECT_FALSE(b.activation_fused);
      expect_same_bits("h1", a.h1, b.h1);  // whole buffers: rows past the segments keep the same poison in both
      expect_same_bits("act", a.act, b.act);
      expect_same_bits("y", a.y, b.y);
      expect_same_bits("dx", a.dx, b.dx);
      expect_same_bits("dw1", a.dw1, b.dw1);
    }
  }
  // Auto fuses where the layout allows it, and only there.
  MoeConfig inter = small_config(Activation::SwiGLU, 4, 256, 320);
  inter.glu_layout = GluLayout::Interleaved;
  inter.glu_block = 32;
  EXPECT_TRUE(run_case(inter, kCounts4, kRows4).activation_fused);
  MoeConfig concat = small_config(Activation::SwiGLU, 4, 256, 320);
  EXPECT_FALSE(run_case(concat, kCounts4, kRows4).activation_fused);
  MoeConfig g4 = inter, g128 = small_config(Activation::SwiGLU, 4, 256, 384);
  g4.glu_block = 4;
  g128.glu_layout = GluLayout::Interleaved;
  g128.glu_block = 128;  // 2g is wider than the 128 columns the epilogue stages at a time
  EXPECT_FALSE(run_case(g4, kCounts4, kRows4).activation_fused);
  EXPECT_FALSE(run_case(g128, kCounts4, kRows4).activation_fused);
  GpuOptions coop;  // on either tile
  coop.tiles.fc1 = MlpGemmTile::Cooperative128x256;
  EXPECT_TRUE(run_case(inter, kCounts4, kRows4, coop).activation_fused);
  MoeConfig g64 = inter;  // too wide for the cooperative tile's rounds: Auto runs the pass there
  g64.glu_block = 64;
  EXPECT_FALSE(run_case(g64, kCounts4, kRows4, coop).activation_fused);
  // Fused where it cannot run is an error naming the option.
  GpuOptions force;
  force.mlp.activation = MlpActivation::Fused;
  expect_error_mentions([&] { GroupedMlp m(concat, force.mlp); }, "options.activation = Fused",
                        ErrorCode::Unsupported);
}

TEST(ExpertsMlp, BiasesAndProbModes) {
  MOERAIL_REQUIRE_GPU();
  for (ProbMode mode : {ProbMode::InActivation, ProbMode::InCombine})
    for (int bias = 0; bias < 4; ++bias) {
      SCOPED_TRACE(std::string(name_of(mode)) + " fc1_bias=" + std::to_string(bias & 1) +
                   " fc2_bias=" + std::to_string(bias >> 1));
      MoeConfig cfg = small_config(Activation::SwiGLU, 4);
      cfg.prob_mode = mode;
      cfg.fc1_bias = bias & 1;
      cfg.fc2_bias = bias >> 1;
      run_case(cfg, kCounts4, kRows4);
    }
  MoeConfig relu = small_config(Activation::ReLU2, 3);
  relu.fc1_bias = relu.fc2_bias = true;
  run_case(relu, {40, 8, 0}, 64);
}

TEST(ExpertsMlp, EmptyExpertsAndAllRowsOnOne) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig cfg = small_config(Activation::SwiGLU, 5);
  cfg.fc1_bias = cfg.fc2_bias = true;
  run_case(cfg, {0, 0, 256, 0, 0}, 300);  // all rows on one expert, the others get exact zero gradients
  run_case(cfg, {256, 0, 0, 0, 0}, 256);  // ... on the first, buffer exactly full
  run_case(cfg, {0, 0, 0, 0, 256}, 256);  // ... on the last
  run_case(cfg, {0, 0, 0, 0, 0}, 64);     // no rows at all: nothing written but zero gradients
}

TEST(ExpertsMlp, OddRowCounts) {
  MOERAIL_REQUIRE_GPU();
  // A = 1: segments of any length, so wgrad reductions K = 37, 5, 83 are not multiples of the tile or of 8.
  MoeConfig cfg = small_config(Activation::GeGLU, 4);
  cfg.fc2_bias = true;
  run_case(cfg, {37, 0, 5, 83}, 130);
}

TEST(ExpertsMlp, LargerShapesSeveralTiles) {
  MOERAIL_REQUIRE_GPU();
  // Several M, N and K tiles per expert, and more experts than a warp's worth in the setup scan.
  MoeConfig cfg = small_config(Activation::SwiGLU, 40, 256, 192);
  std::vector<std::int64_t> counts(40);
  for (std::size_t e = 0; e < counts.size(); ++e) counts[e] = std::int64_t((e * 37) % 7) * 8;  // some zeros
  const std::int64_t used = std::accumulate(counts.begin(), counts.end(), std::int64_t(0));
  run_case(cfg, counts, used + 16);
}

TEST(ExpertsMlp, EveryGemmConfiguration) {
  MOERAIL_REQUIRE_GPU();
  // Auto picks ping-pong for these small K; force each compiled instantiation once.
  for (MlpGemmTile t : {MlpGemmTile::Cooperative128x256, MlpGemmTile::Pingpong128x128}) {
    SCOPED_TRACE(t == MlpGemmTile::Cooperative128x256 ? "cooperative 128x256" : "pingpong 128x128");
    GpuOptions opt;
    opt.tiles.fc1 = opt.tiles.fc2 = opt.tiles.dgrad_fc1 = opt.tiles.dgrad_fc2 = opt.tiles.wgrad_fc1 = t;
    opt.tiles.wgrad_fc2 = t;
    MoeConfig cfg = small_config(Activation::SwiGLU, 4, 384, 320);  // N = 384, 320, 640: partial 256-wide tiles
    run_case(cfg, {130, 0, 257, 3}, 400, opt);
  }
}

TEST(ExpertsMlp, PerExpertWeightsMatchGroupedBitExactly) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig cfg = small_config(Activation::SwiGLU, 4);
  cfg.fc1_bias = cfg.fc2_bias = true;
  GpuOptions grouped, per_expert;
  per_expert.per_expert = true;
  per_expert.counts_i64 = true;
  const GpuOutputs a = run_case(cfg, kCounts4, kRows4, grouped);
  const GpuOutputs b = run_case(cfg, kCounts4, kRows4, per_expert);
  // Same kernels on the same data: identical bits (checks the converters and the pointer tables).
  expect_same_bits("y", a.y, b.y);
  expect_same_bits("dx", a.dx, b.dx);
  expect_same_bits("d_probs", a.d_probs, b.d_probs);
  expect_same_bits("dw1", a.dw1, b.dw1);
  expect_same_bits("dw2", a.dw2, b.dw2);
  expect_same_bits("db1", a.db1, b.db1);
  expect_same_bits("db2", a.db2, b.db2);
}

// MlpOptions::contiguous_gemms: FC1, FC2 and the dgrads as one GEMM over all experts' rows, each expert's segment in
// tiles of at most 128 rows from its own first row; the same tile and reduction order as the grouped GEMMs, so the
// same bits. Short tiles must not write the next expert's rows. The weight gradients as one GEMM too: each tile's
// k-tiles from its expert's first row, the rows past the segment zeroed (the next expert's, or the poisoned rows
// of d_h1 past the segments), empty experts stored as zeros, into grouped or per-expert tensors (delayed).
TEST(ExpertsMlp, ContiguousGemmsMatchGroupedBitExactly) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig cfg = small_config(Activation::SwiGLU, 6, 384, 320);  // N = 640, 384, 320: partial 128-wide N tiles
  cfg.fc1_bias = cfg.fc2_bias = true;                              // M = 384, 640: odd m tiles in clusters of 2
  GpuOptions grouped, contiguous, contiguous_per_expert;
  grouped.mlp.contiguous_gemms = MlpContiguous::Off;
  contiguous.mlp.contiguous_gemms = MlpContiguous::On;
  contiguous_per_expert = contiguous;
  contiguous_per_expert.per_expert = true;
  contiguous_per_expert.delayed_wgrad = true;
  const std::vector<std::vector<std::int64_t>> cases = {
      {256, 0, 128, 384, 128, 128},  // whole tiles, an empty expert; rows past the segments
      {128, 128, 100, 256, 0, 128},  // a short tile, then segments that start off the 128-row grid
      {0, 0, 1664, 0, 0, 0},         // all rows on one expert: 13 tiles, two bands of the walk
      {1280, 128, 0, 256, 0, 0},     // a 10-tile expert beside small ones
      {37, 128, 128, 0, 0, 5},       // short tiles at both ends
      {1, 129, 255, 16, 0, 1299},    // 1-row tiles, one row past a whole tile, a band of 8 and a short tile
  };
  for (const auto& counts : cases) {
    SCOPED_TRACE(::testing::PrintToString(counts));
    const GpuOutputs a = run_case(cfg, counts, 1700, grouped);
    const GpuOutputs b = run_case(cfg, counts, 1700, contiguous);
    expect_same_bits("y", a.y, b.y);
    expect_same_bits("dx", a.dx, b.dx);
    expect_same_bits("d_probs", a.d_probs, b.d_probs);
    expect_same_bits("dw1", a.dw1, b.dw1);
    expect_same_bits("dw2", a.dw2, b.dw2);
    const GpuOutputs c = run_case(cfg, counts, 1700, contiguous_per_expert);
    expect_same_bits("dw1 (per-expert tensors)", a.dw1, c.dw1);
    expect_same_bits("dw2 (per-expert tensors)", a.dw2, c.dw2);
  }
}

// MOERAIL_CONTIG_WALK for one scope (GroupedMlp reads it when built).
// The contiguous GEMMs' two scheduler walks (contig_gemm_sm90.cuh, ContigUnitWalk) give the grouped GEMMs' bits. The
// dynamic walk takes the units past each cluster's first two from a device counter and hands them to the cluster's
// CTAs through a ring of 8; the static one strides by the grid. Cases: 782 M tiles (each of the four GEMMs has one N
// cluster, so ~12 units per cluster: the ring wraps), units between one and two grids, fewer units than clusters.
// The forward and the data gradients run two GEMMs each on one counter, and the two weight gradients (whose experts
// are walked longest first, the counts here unsorted) on a third, so every launch must leave its counter at zero.
// GPU only (the grouped GEMMs are checked against the reference elsewhere).
TEST(ExpertsMlp, ContiguousGemmsWalkDynamicallyAndStatically) {
  MOERAIL_REQUIRE_GPU();
  const MoeConfig cfg = small_config(Activation::SwiGLU, 8, 256, 128);
  auto run = [&](const std::vector<std::int64_t>& counts, std::int64_t rows, MlpContiguous contiguous) {
    const HostInputs in = make_inputs(cfg, rows, 99);
    cudaStream_t stream = nullptr;
    MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    GpuOutputs out;
    {
      MlpOptions mo;
      mo.contiguous_gemms = contiguous;
      mo.rows_hint = rows;
      GroupedMlp mlp(cfg, mo);
      GpuRun g(cfg, in, counts, false, false, stream);
      g.poison_outputs();
      for (int step = 0; step < 2; ++step) {  // twice: the second runs on the counters the first left behind
        mlp.forward(g.forward_args(), stream);
        mlp.backward(g.backward_args(true), stream);
      }
      out = g.results(stream);
    }
    MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
    return out;
  };
  const std::vector<std::pair<std::vector<std::int64_t>, std::int64_t>> cases = {
      {{40000, 128, 0, 20000, 37, 9000, 1, 30900}, 100100},  // 782 M tiles
      {{4224, 0, 0, 0, 0, 0, 0, 0}, 4300},                     // 33 M tiles
      {{300, 0, 0, 0, 0, 0, 0, 0}, 300},                       // 3 M tiles
  };
  for (const auto& [counts, rows] : cases) {
    SCOPED_TRACE(::testing::PrintToString(counts));
    const GpuOutputs want = run(counts, rows, MlpContiguous::Off);
    for (const char* walk : {"dynamic", "static"}) {
      SCOPED_TRACE(walk);
      const ScopedWalk scoped(walk);
      const GpuOutputs got = run(counts, rows, MlpContiguous::On);
      expect_same_y_dx_dw(want, got);
    }
  }
}

// The contiguous weight gradient with many tiles per CTA: 64 experts of dW2 [512, 256] and dW1 [512, 512] are 256
// and 512 work units for ~66 resident clusters, so both consumer warpgroups of a CTA compute tiles, each starting
// where its partner's tile ended in the pipeline, and the stages wrap around many times. Segments of every length
// class (empty, 1 row, under one 64-row k-tile, whole k-tiles, a k-tile and a bit), in an order that mixes them;
// both walks (the units' order and which CTA takes them differ, the bits must not).
TEST(ExpertsMlp, ContiguousWeightGradientsWithManyTilesPerCta) {
  MOERAIL_REQUIRE_GPU();
  const MoeConfig cfg = small_config(Activation::SwiGLU, 64, 512, 256);
  GpuOptions grouped, contiguous;
  grouped.mlp.contiguous_gemms = MlpContiguous::Off;
  contiguous.mlp.contiguous_gemms = MlpContiguous::On;
  std::vector<std::int64_t> counts(64);
  const std::int64_t lengths[] = {0, 1, 37, 64, 128, 65, 200, 3};
  for (std::size_t e = 0; e < counts.size(); ++e) counts[e] = lengths[(e * 5 + e / 8) % 8];
  std::int64_t used = 0;
  for (std::int64_t c : counts) used += c;
  const GpuOutputs a = run_case(cfg, counts, used + 40, grouped);
  for (const char* walk : {"dynamic", "static"}) {
    SCOPED_TRACE(walk);
    const ScopedWalk scoped(walk);
    const GpuOutputs b = run_case(cfg, counts, used + 40, contiguous);
    expect_same_bits("dw1", a.dw1, b.dw1);
    expect_same_bits("dw2", a.dw2, b.dw2);
  }
}

// The places of the contiguous weight gradient's walk (SetupParams::wgrad_places): experts by decreasing 64-row
// k-tiles summed over the regions, ties by index, each with its k-tiles and its segment in region 0. 300 experts
// (more than the setup block's threads) and 1024 (the most, four per thread) in two regions, with segments of equal
// k-tiles but different rows (65 and 128 rows are both 2 k-tiles), empty ones, and counts past the region's rows
// (clipped).
class ExpertsSetup : public ::testing::TestWithParam<int> {};

TEST_P(ExpertsSetup, PlacesTheWeightGradientsExpertsLongestFirst) {
  MOERAIL_REQUIRE_GPU();
  const int L = GetParam();
  constexpr int kChunks = 2;
  constexpr std::int64_t kRows = 60000;  // per region
  std::vector<std::int32_t> counts(std::size_t(kChunks) * L);
  const std::int32_t lengths[] = {0, 1, 64, 65, 128, 129, 500, 77, 3, 1000};
  for (std::size_t i = 0; i < counts.size(); ++i) counts[i] = lengths[(i * 7 + i / 13) % 10];
  counts[std::size_t(L) + L - 1] = 100000;  // region 1's last expert: clipped to the rows left in the region
  std::int32_t* d_counts = nullptr;
  std::int64_t* d_offsets = nullptr;
  experts::ContigWgradPlace* d_places = nullptr;
  experts::ContigWgradSegment* d_segments = nullptr;
  int* d_k_tiles = nullptr;
  MOERAIL_CUDA_CHECK(cudaMalloc(&d_counts, counts.size() * sizeof(std::int32_t)));
  MOERAIL_CUDA_CHECK(cudaMalloc(&d_offsets, std::size_t(kChunks) * (L + 1) * sizeof(std::int64_t)));
  MOERAIL_CUDA_CHECK(cudaMalloc(&d_places, L * sizeof(experts::ContigWgradPlace)));
  MOERAIL_CUDA_CHECK(cudaMalloc(&d_segments, L * sizeof(experts::ContigWgradSegment)));
  MOERAIL_CUDA_CHECK(cudaMalloc(&d_k_tiles, sizeof(int)));
  MOERAIL_CUDA_CHECK(cudaMemcpy(d_counts, counts.data(), counts.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  MOERAIL_CUDA_CHECK(cudaMemset(d_places, 0xff, L * sizeof(experts::ContigWgradPlace)));
  experts::SetupParams p;
  p.counts = d_counts;
  p.L = L;
  p.rows = kRows;
  p.offsets = d_offsets;
  p.chunks = kChunks;
  p.wgrad_places = d_places;
  p.wgrad_segments = d_segments;
  p.wgrad_k_tiles = d_k_tiles;
  experts::launch_setup(p, nullptr, nullptr);
  std::vector<experts::ContigWgradPlace> places(L);
  std::vector<experts::ContigWgradSegment> segments(L);
  int total = -1;
  MOERAIL_CUDA_CHECK(
      cudaMemcpy(places.data(), d_places, L * sizeof(experts::ContigWgradPlace), cudaMemcpyDeviceToHost));
  MOERAIL_CUDA_CHECK(
      cudaMemcpy(segments.data(), d_segments, L * sizeof(experts::ContigWgradSegment), cudaMemcpyDeviceToHost));
  MOERAIL_CUDA_CHECK(cudaMemcpy(&total, d_k_tiles, sizeof(int), cudaMemcpyDeviceToHost));
  for (void* d : {static_cast<void*>(d_counts), static_cast<void*>(d_offsets), static_cast<void*>(d_places),
                  static_cast<void*>(d_segments), static_cast<void*>(d_k_tiles)})
    MOERAIL_CUDA_CHECK(cudaFree(d));

  std::vector<std::int64_t> k_tiles(L, 0), start0(L), rows0(L);
  for (int c = 0; c < kChunks; ++c) {
    std::int64_t start = 0;
    for (int e = 0; e < L; ++e) {
      const std::int64_t end = std::min(kRows, start + counts[std::size_t(c) * L + e]);
      k_tiles[std::size_t(e)] += (end - start + 63) / 64;
      if (c == 0) start0[std::size_t(e)] = start, rows0[std::size_t(e)] = end - start;
      start = end;
    }
  }
  std::vector<int> want(L);
  for (int e = 0; e < L; ++e) want[std::size_t(e)] = e;
  std::stable_sort(want.begin(), want.end(),
                   [&](int a, int b) { return k_tiles[std::size_t(a)] > k_tiles[std::size_t(b)]; });
  std::int64_t want_total = 0;
  for (int i = 0; i < L; ++i) {
    SCOPED_TRACE(i);
    const experts::ContigWgradPlace& w = places[std::size_t(i)];
    const std::size_t e = std::size_t(want[std::size_t(i)]);
    ASSERT_EQ(w.expert, int(e));
    EXPECT_EQ(w.k_tiles, k_tiles[e]);
    EXPECT_EQ(w.tail, rows0[e] == 0 ? 0 : rows0[e] - ((rows0[e] + 63) / 64 - 1) * 64);
    EXPECT_EQ(segments[std::size_t(i)].start, start0[e]);
    EXPECT_EQ(segments[std::size_t(i)].k_tiles, (rows0[e] + 63) / 64);
    want_total += k_tiles[e];
  }
  EXPECT_EQ(total, want_total);
}

INSTANTIATE_TEST_SUITE_P(Experts, ExpertsSetup, ::testing::Values(300, 1024));

// With the activation in FC1's epilogue: the contiguous FC1 computes it in the same epilogue (bias, probs, short
// tiles), so every output equals the grouped one's.
TEST(ExpertsMlp, ContiguousGemmsWithTheFusedActivation) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig cfg = small_config(Activation::SwiGLU, 4, 256, 128);
  cfg.glu_layout = GluLayout::Interleaved;
  cfg.glu_block = 32;
  cfg.fc1_bias = true;
  cfg.prob_mode = ProbMode::InActivation;  // the epilogue scales by the row's prob
  GpuOptions grouped, contiguous;
  grouped.mlp.activation = contiguous.mlp.activation = MlpActivation::Fused;
  grouped.mlp.contiguous_gemms = MlpContiguous::Off;
  contiguous.mlp.contiguous_gemms = MlpContiguous::On;
  contiguous.mlp.activation_backward = MlpActivation::Separate;  // d_probs below in the pass's order
  for (const std::vector<std::int64_t>& counts : {std::vector<std::int64_t>{256, 128, 0, 384},
                                                   std::vector<std::int64_t>{100, 1, 300, 383}}) {
    SCOPED_TRACE(::testing::PrintToString(counts));
    const GpuOutputs a = run_case(cfg, counts, 800, grouped);
    const GpuOutputs b = run_case(cfg, counts, 800, contiguous);
    ASSERT_TRUE(b.activation_fused);
    expect_same_bits("y", a.y, b.y);
    expect_same_bits("dx", a.dx, b.dx);
    expect_same_bits("d_probs", a.d_probs, b.d_probs);
    expect_same_bits("dw1", a.dw1, b.dw1);
  }
}

// MlpOptions::activation_backward: FC2's contiguous dgrad computes d_h1 and the d_probs partials in its epilogue.
// d_h1 uses the pass's per-element math, so dx and dW1 (which it feeds) equal the pass's bit for bit; d_probs is
// summed in another order, so it is compared to the pass's within fp32 rounding (and to the reference by run_case).
// Every activation; concatenated and interleaved halves; short tiles, empty experts, rows past the segments; probs
// in the activation or not.
TEST(ExpertsMlp, ContiguousDgradWithTheActivationBackward) {
  MOERAIL_REQUIRE_GPU();
  struct Case {
    Activation act;
    GluLayout layout;
    std::int64_t g;
    ProbMode probs;
    bool fc1_bias;
  };
  const Case cases[] = {
      {Activation::SwiGLU, GluLayout::Concatenated, 0, ProbMode::InActivation, false},
      {Activation::GeGLU, GluLayout::Interleaved, 32, ProbMode::InActivation, true},
      {Activation::QuickGeGLU, GluLayout::Interleaved, 8, ProbMode::InActivation, false},
      {Activation::ReLU2, GluLayout::Concatenated, 0, ProbMode::InActivation, false},
      {Activation::GELU, GluLayout::Concatenated, 0, ProbMode::InCombine, true},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(std::string(name_of(k.act)) + (k.layout == GluLayout::Interleaved ? " interleaved" : ""));
    MoeConfig cfg = small_config(k.act, 4, 256, 320);  // F = 320: a partial 128-wide N tile
    cfg.glu_layout = k.layout;
    cfg.glu_block = k.g;
    cfg.prob_mode = k.probs;
    cfg.fc1_bias = k.fc1_bias;
    GpuOptions pass, fused;
    pass.mlp.contiguous_gemms = fused.mlp.contiguous_gemms = MlpContiguous::On;
    pass.mlp.activation_backward = MlpActivation::Separate;
    fused.mlp.activation_backward = MlpActivation::Fused;
    for (const std::vector<std::int64_t>& counts : {std::vector<std::int64_t>{256, 0, 100, 129},
                                                     std::vector<std::int64_t>{1, 383, 0, 16}}) {
      SCOPED_TRACE(::testing::PrintToString(counts));
      const GpuOutputs a = run_case(cfg, counts, 520, pass);
      const GpuOutputs b = run_case(cfg, counts, 520, fused);
      expect_same_y_dx_dw(a, b);
      const std::int64_t used = std::accumulate(counts.begin(), counts.end(), std::int64_t(0));
      const float* pa = a.d_probs.view().as<const float>();
      const float* pb = b.d_probs.view().as<const float>();
      for (std::int64_t r = 0; r < used; ++r) {
        if (k.probs != ProbMode::InActivation) {
          ASSERT_EQ(pb[r], 0.0f) << "row " << r;
          continue;
        }
        ASSERT_NEAR(pb[r], pa[r], 1e-4f * (1.0f + std::fabs(pa[r]))) << "row " << r;
      }
    }
  }
  // Fused where it cannot be: a named error at construction.
  MoeConfig cfg = small_config(Activation::SwiGLU, 4);
  cfg.fc2_bias = true;  // d_probs takes <b2, dy>, which the epilogue does not compute
  MlpOptions o;
  o.contiguous_gemms = MlpContiguous::On;
  o.activation_backward = MlpActivation::Fused;
  expect_error_mentions([&] { GroupedMlp m(cfg, o); }, "activation_backward = Fused");
  cfg.fc2_bias = false;
  o.contiguous_gemms = MlpContiguous::Off;
  expect_error_mentions([&] { GroupedMlp m(cfg, o); }, "activation_backward = Fused");

  // Auto fuses from H = kActBwdAutoMinK on, where FC2's dgrad runs contiguously, and never throws.
  o.activation_backward = MlpActivation::Auto;
  o.contiguous_gemms = MlpContiguous::On;
  auto fuses = [&](const MoeConfig& c) { return GroupedMlp(c, o).describe().find("+actbwd") != std::string::npos; };
  MoeConfig wide = small_config(Activation::SwiGLU, 4, experts::kActBwdAutoMinK, 256);
  EXPECT_TRUE(fuses(wide));
  wide.hidden = experts::kActBwdAutoMinK - 1024;
  EXPECT_FALSE(fuses(wide));
  wide.hidden = experts::kActBwdAutoMinK;
  wide.fc2_bias = true;
  EXPECT_FALSE(fuses(wide));
  wide.fc2_bias = false;
  o.contiguous_gemms = MlpContiguous::Off;
  EXPECT_FALSE(fuses(wide));
}

TEST(ExpertsMlp, DelayedWgradMatchesFusedBitExactly) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig cfg = small_config(Activation::QuickGeGLU, 4);
  cfg.fc1_bias = cfg.fc2_bias = true;
  GpuOptions delayed;
  delayed.delayed_wgrad = true;
  const GpuOutputs a = run_case(cfg, kCounts4, kRows4);
  const GpuOutputs b = run_case(cfg, kCounts4, kRows4, delayed);
  EXPECT_EQ(std::memcmp(a.dw1.view().data(), b.dw1.view().data(), a.dw1.view().nbytes()), 0);
  EXPECT_EQ(std::memcmp(a.dw2.view().data(), b.dw2.view().data(), a.dw2.view().nbytes()), 0);
  EXPECT_EQ(std::memcmp(a.db1.view().data(), b.db1.view().data(), a.db1.view().nbytes()), 0);
  EXPECT_EQ(std::memcmp(a.db2.view().data(), b.db2.view().data(), a.db2.view().nbytes()), 0);
}

}  // namespace
}  // namespace moerail::testing::mlp
