// src/experts/contig/contig_gemm.h — the ragged-M expert GEMMs (FC1, FC2 and their dgrads) as ONE GEMM over the rows of all
// experts: D[rows, N] = A[rows, K] B_{g(t)} with B the grouped weight tensor indexed by the M tile's expert.
//
// An M tile is at most 128 rows of ONE expert: expert e's segment [start, end) is cut into tiles starting at
// start, start + 128, ...; the last may be shorter. A tile's A rows are loaded from its start row (TMA coordinates
// are per element), and its epilogue writes only its own rows (the rows after a short tile belong to the next
// expert). One set of TMA descriptors serves every expert (the ptr-array grouped kernel patches its descriptors on
// the device each time a CTA moves to another group), and the scheduler walks bands of at most 8 M tiles of one
// expert across all N tiles, so the CTAs resident at once share their A tiles and one expert's B tiles in L2.
//
// The device setup kernel (setup.h, SetupParams::contig) writes the tile table before each run: for tile t the
// expert (tile_group), its first row (tile_row), its rows (tile_rows, 1..128) and its band (tile_band,
// contig_band), and num_tiles. The grouped kernel of the same product then gets only empty groups; if the tiles
// would exceed the table (max_tiles), num_tiles is 0 and the grouped kernel computes every expert instead. Only the
// ping-pong 128x128 tile exists contiguous (plain, FC1 with the activation in its epilogue, and FC2's dgrad with the
// activation backward in its epilogue): GEMMs given the cooperative tile (tiles.h, MlpOptions) stay grouped.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string_view>

#include "core/host_device.h"
#include "experts/gemm_kinds.h"
#include "experts/grouped/grouped_gemm.h"  // GluEpilogue

namespace moerail::experts {

inline constexpr int kContigTileM = 128;  // rows of a full M tile of the contiguous GEMMs
// M tiles per band of the scheduler's walk (at most). 4 and 8 measured alike, 16 and 32 slower on deepseek-v3's
// FC1 (H200, one run each; docs/experts.md).
inline constexpr int kContigBand = 8;

// MlpContiguous::Auto turns the contiguous GEMMs on from this many local experts: bench mlp (contiguous vs grouped,
// alternating) put them ahead with many short experts (qwen3-30b-a3b, deepseek-v3) and behind with a few long ones
// (mixtral-8x7b's FC1), whose tiles the grouped kernel walks as well (docs/experts.md).
inline constexpr int kContigAutoExperts = 16;

// MlpContiguous::Auto runs a weight gradient contiguously (beside the 16-expert rule above) when one expert's dW has
// at most this many 128x128 tiles per SM: then the grouped kernel's CTAs move to another expert (and patch their
// descriptors) every tile or two. bench mlp (both wgrads, alternating): ahead on qwen3-30b-a3b's small dWs, behind
// on deepseek-v3's large ones, where the grouped kernel's CTAs stay on one expert for many tiles (docs/experts.md).
inline constexpr std::int64_t kContigWgradAutoMaxTilesPerSm = 4;
constexpr bool contig_wgrad_auto(std::int64_t m, std::int64_t n, int sms) {
  return (m + kContigTileM - 1) / kContigTileM * ((n + kContigTileM - 1) / kContigTileM) <=
         kContigWgradAutoMaxTilesPerSm * sms;
}

// The contiguous forward GEMMs' scheduler walks dynamically (the next unit from a device counter;
// contig_gemm_sm90.cuh) where one expert's weights (N x K bf16) are about the size of the L2 cache (50 MB on
// H100/H200) or larger: their tiles are then shared in L2 only by the clusters that read them at about the same
// time. bench mlp, the two walks alternating: the dynamic walk is ahead on GEMMs whose expert weights exceed L2 and
// behind on smaller ones; the data gradients (NN) lost with it even at that size, so they walk statically.
inline constexpr std::int64_t kContigWalkDynamicMinBytes = std::int64_t(48) << 20;
constexpr bool contig_walk_dynamic(GemmLayout layout, std::int64_t n, std::int64_t k) {
  return layout == GemmLayout::TN && 2 * n * k >= kContigWalkDynamicMinBytes;
}

// A band in one int: its first M tile and its height (1..kContigBand, 4 bits).
static_assert(kContigBand < 16, "the band height is stored in 4 bits");
MOERAIL_HD constexpr int contig_band(int first, int height) { return first << 4 | height; }
MOERAIL_HD constexpr int contig_band_first(int band) { return band >> 4; }
MOERAIL_HD constexpr int contig_band_height(int band) { return band & 15; }

// Device tile table of one contiguous GEMM, at addresses fixed for its lifetime; written by the setup kernel.
struct ContigTiles {
  int* tile_group = nullptr;  // [max_tiles]: expert of each M tile
  int* tile_row = nullptr;    // [max_tiles]: its first row
  int* tile_rows = nullptr;   // [max_tiles]: its rows, 1..kContigTileM
  int* tile_band = nullptr;   // [max_tiles]: its band (contig_band)
  int* num_tiles = nullptr;   // [1]: M tiles of this call (0: the grouped kernel computes every expert)
  int* walk = nullptr;        // [2]: the scheduler's dynamic walk (zero before a launch, and each launch leaves zeros)
  int max_tiles = 0;
};

// Table entries for up to `rows` rows over L experts: every expert but the last tile of each is full.
constexpr std::int64_t contig_max_tiles(std::int64_t rows, int L) {
  return (rows + kContigTileM - 1) / kContigTileM + L;
}

// Entry t of the tile table, as the setup kernel writes it (and tests/experts/contig_table_test.cpp checks it):
// start[e] = expert e's segment start before clipping ([L + 1], an exclusive scan of the counts), rows = the buffer's
// rows (segments are clipped to them), first[e] = the index of e's first tile ([L + 1], an exclusive scan of
// ceil(clipped rows of e / 128)); t < first[L].
struct ContigTileEntry {
  int group, row, rows, band;  // tile_group, tile_row, tile_rows, tile_band
};
MOERAIL_HD inline ContigTileEntry contig_tile(std::int64_t t, const std::int64_t* first, const std::int64_t* start,
                                              int L, std::int64_t rows) {
  int lo = 0, hi = L - 1;  // the last expert whose first tile is at or before t (empty ones share it)
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const std::int64_t j = t - first[lo];
  const std::int64_t row = (start[lo] < rows ? start[lo] : rows) + j * kContigTileM;
  const std::int64_t end = start[lo + 1] < rows ? start[lo + 1] : rows;
  const std::int64_t band = first[lo] + j / kContigBand * kContigBand, left = first[lo + 1] - band;
  return {lo, int(row), int(end - row < kContigTileM ? end - row : kContigTileM),
          contig_band(int(band), int(left < kContigBand ? left : kContigBand))};
}

// One call: A [rows, K] (row-major, lda), B the grouped weights (expert g at b + g * b_group_stride elements; TN:
// [N, K] K-major rows of ldb, NN: [K, N] N-major rows of ldb), D [rows, N] (ldd). Host pointers of device memory.
struct ContigCall {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  std::int64_t rows = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldd = 0, b_group_stride = 0;
  int groups = 0;
  ContigTiles tiles;
  // FC1 with the activation in its epilogue (make_contig_gemm_tn_glu): act [rows, F] and probs [rows] (or null)
  void* act = nullptr;
  const float* probs = nullptr;
  // FC2's dgrad with the activation backward in its epilogue (make_contig_gemm_nn_act_bwd; d is not written):
  // the shape (F = n), h1 and d_h1 [rows, F1], probs as above, and the d_probs partials [rows, ceil(n / 128)] (or
  // null when no d_probs is wanted).
  ActShape act_shape{};
  const void* h1 = nullptr;
  void* d_h1 = nullptr;
  float* dp_partial = nullptr;
};

class ContigGemm {
 public:
  virtual ~ContigGemm() = default;
  virtual GemmLayout layout() const = 0;
  // Setup, outside capture: the kernel's shared-memory attribute and its resident cluster count (of at most
  // max_sms SMs when > 0: MlpOptions::sms).
  virtual void initialize(std::string_view what, int max_sms) = 0;
  // The fused activation's fixed part (shape, per-expert bias pointers), before run(): the GLU kernel only.
  virtual void set_glu_epilogue(const GluEpilogue& glu) = 0;
  // One launch on `stream`. Builds the TMA descriptors on the host from `call` (no device access, no allocation,
  // no sync): graph-capturable, and a captured launch keeps the pointers of its call. Throws Error(Unsupported)
  // naming `what` when CUTLASS rejects the shapes or alignments.
  virtual void run(const ContigCall& call, cudaStream_t stream, std::string_view what) = 0;
};

// Place i of the contiguous weight gradient's walk, as the setup kernel writes it (SetupParams::wgrad_places): the
// experts by decreasing 64-row k-tiles summed over the regions (ties: the lower index first), so that the longest
// tiles go first and the short ones fill in at the end. In two arrays: the segment in region 0 (first row and
// k-tiles: 8 bytes, four places to a 32-byte sector, what the producer reads as it moves to a place), and the
// rest (the expert, its k-tiles over all regions, its rows in region 0's last k-tile, 1..64, 0 when empty).
struct ContigWgradSegment {
  int start = 0, k_tiles = 0;
};
struct alignas(16) ContigWgradPlace {
  int expert = 0, k_tiles = 0, tail = 0, unused = 0;
};
inline constexpr int kContigWgradTileK = 64;  // rows of the contiguous weight gradient's k-tiles

// Whether the contiguous weight gradient walks dynamically under MOERAIL_CONTIG_WALK=auto, decided on the device
// for each launch: when the longest place's work units (`longest` k-tiles) are a tenth or more of what a cluster
// computes on average (per_expert units of every place, over `clusters`). The static walk then leaves clusters idle
// at the end (under Zipf routing one expert can hold a quarter of the rows); in balanced routing the dynamic walk
// measured slower.
MOERAIL_HD constexpr bool contig_wgrad_walk_dynamic(std::int64_t longest, std::int64_t total_k_tiles,
                                                    std::int64_t per_expert, std::int64_t clusters) {
  return longest * clusters * 10 >= per_expert * total_k_tiles && total_k_tiles > 0;
}

// The weight gradients of all experts as ONE GEMM over the rows of all experts: dW_e [m, n] = A_e^T B_e, with A
// [rows, m] and B [rows, n] (row-major) and expert e's rows the segment [offsets[e], offsets[e + 1]). One TMA
// descriptor per operand serves every expert (no descriptor patched when a CTA moves to another expert): a tile's
// k-tiles start at its expert's first row, and in the last one the rows past the segment (the next expert's, or
// zeros past the buffer) are zeroed in shared memory before the MMAs, so the result equals the grouped GEMM's bit for
// bit. The work is fixed per expert (m x n tiles, clusters of 2 along m), so the scheduler needs no tile table: it
// walks the experts in the order of `places` (the setup kernel's: longest first), n fastest, each cluster taking
// its next tiles from the counter `walk` (or statically without it), and a tile's reduction length is its place's
// k-tiles. An empty expert's tiles store zeros.
// With chunks > 1 the rows hold `chunks` regions, each laid out by its own row of offsets (MoeLayer's chunked
// step: MlpBackwardDwArgs::chunk_rows), and dW_e sums expert e's segment of every region, region by region; the
// rows between a region's last segment and the next region are never read into a product.
struct ContigWgradCall {
  const void* a = nullptr;               // [rows, m] bf16, row-major (lda)
  const void* b = nullptr;               // [rows, n] bf16, row-major (ldb)
  void* const* ptr_d = nullptr;          // device [groups]: dW_e [m, n] bf16 (f32), row-major (ldd); the setup's
  const std::int64_t* offsets = nullptr;  // device [chunks][groups + 1]: segment starts (setup.h)
  const ContigWgradPlace* places = nullptr;            // device [groups]: the walk's places (the setup's)
  const ContigWgradSegment* place_segments = nullptr;  // device [groups]: their segments in region 0
  // device [3]: the dynamic walk's counters ([0], [1]: zero before a launch, and each launch leaves zeros) and the
  // k-tiles of all places ([2], the setup's); nullptr: the static walk
  int* walk = nullptr;
  std::int64_t rows = 0, m = 0, n = 0;
  std::int64_t lda = 0, ldb = 0, ldd = 0;
  int groups = 0;
  int chunks = 1;
  bool accumulate = false;  // dW_e = bf16(dW_e + bf16(A^T B)) instead of bf16(A^T B) (MlpGrads::accumulate)
  bool f32 = false;         // dW_e is fp32: dW_e = A^T B, or with accumulate dW_e + A^T B (fp32 adds)
};

// The rows a contiguous weight gradient takes (32-bit TMA coordinates with a 64-row k-tile past the last row).
inline constexpr std::int64_t kContigWgradMaxRows = (std::int64_t(1) << 31) - 65;

class ContigWgrad {
 public:
  virtual ~ContigWgrad() = default;
  // Setup, outside capture: the kernel's shared-memory attribute and its resident cluster count (of at most
  // max_sms SMs when > 0).
  virtual void initialize(std::string_view what, int max_sms) = 0;
  // One launch on `stream`; graph-capturable as ContigGemm::run. Throws Error(Unsupported) naming `what` when the
  // sizes or alignments do not fit the kernel (1 <= rows <= kContigWgradMaxRows, m and n below 2^30, leading
  // dimensions multiples of 8, work units within 32 bits).
  virtual void run(const ContigWgradCall& call, cudaStream_t stream, std::string_view what) = 0;
};

// The instantiations (ping-pong 128x128x64, clusters 1x2 along N, as the grouped kernels of the same GEMMs); the
// _glu one is FC1 with the activation in its epilogue (glu_epilogue.cuh), as make_gemm_tn_ping128x128_glu; the
// _act_bwd one FC2's dgrad with the activation backward in its epilogue (act_bwd_epilogue.cuh).
std::unique_ptr<ContigGemm> make_contig_gemm_tn();
std::unique_ptr<ContigGemm> make_contig_gemm_nn();
std::unique_ptr<ContigGemm> make_contig_gemm_tn_glu();
std::unique_ptr<ContigGemm> make_contig_gemm_nn_act_bwd();
// Whether make_contig_gemm_nn_act_bwd's epilogue handles this activation shape (a tile's h1 columns in two aligned
// 128-column segments: concatenated halves, or interleaved blocks g dividing 128).
bool contig_act_bwd_supports(const ActShape& s);
// The contiguous weight gradient: ping-pong 128x128x64, clusters 2x1 along m (as the grouped wgrad kernels).
std::unique_ptr<ContigWgrad> make_contig_gemm_wgrad();

}  // namespace moerail::experts
