// src/experts/contig_gemm.h — the ragged-M expert GEMMs (FC1, FC2 and their dgrads) as ONE GEMM over the rows of all
// experts, for segments that start and end on multiples of 128 rows (a dispatch with alignment 128 makes them so).
//
// Then every 128-row M tile lies in one expert's segment, and the GEMM is an ordinary GEMM over the whole buffer
// whose B operand is the grouped weight tensor indexed by the tile's expert: D[rows, N] = A[rows, K] B_{g(m)}.
// One set of TMA descriptors serves every expert (the ptr-array grouped kernel patches its descriptors on the
// device each time a CTA moves to another group), and the scheduler walks bands of at most 8 M tiles of one expert
// across all N tiles, so the CTAs resident at once share their A tiles and one expert's B tiles in L2.
//
// The device setup kernel (setup.h, SetupParams::contig) writes the tile table before each run: tile_group[t] = the
// expert of M tile t for the leading experts whose counts are multiples of 128, tile_band[t] = the band of t
// (contig_band), and num_tiles = their tiles. The experts from the first unaligned count on stay with the grouped
// kernel (their groups keep their shapes, the others get empty ones), so any counts give exact results; aligned
// ones leave the grouped kernel nothing to do. Only the ping-pong 128x128 tile exists contiguous: GEMMs given the
// cooperative tile (tiles.h, MlpOptions) stay grouped.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string_view>

#include "experts/gemm_kinds.h"

namespace moerail::experts {

inline constexpr int kContigTileM = 128;  // M tile of the contiguous GEMMs: segments must be multiples of it
// M tiles per band of the scheduler's walk (at most). 4 and 8 measured alike, 16 and 32 slower on deepseek-v3's
// FC1 (H200, one run each; docs/experts.md).
inline constexpr int kContigBand = 8;

// A band in one int: its first M tile and its height (1..kContigBand, 4 bits).
static_assert(kContigBand < 16, "the band height is stored in 4 bits");
constexpr int contig_band(int first, int height) { return first << 4 | height; }
constexpr int contig_band_first(int band) { return band >> 4; }
constexpr int contig_band_height(int band) { return band & 15; }

// Device tile table of one contiguous GEMM, at addresses fixed for its lifetime; written by the setup kernel.
struct ContigTiles {
  int* tile_group = nullptr;  // [max_tiles]: expert of each M tile
  int* tile_band = nullptr;   // [max_tiles]: the tile's band (contig_band)
  int* num_tiles = nullptr;   // [1]: M tiles of the aligned leading experts
  int max_tiles = 0;
};

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
};

class ContigGemm {
 public:
  virtual ~ContigGemm() = default;
  virtual GemmLayout layout() const = 0;
  // Setup, outside capture: the kernel's shared-memory attribute and its resident cluster count.
  virtual void initialize(std::string_view what) = 0;
  // One launch on `stream`. Builds the TMA descriptors on the host from `call` (no device access, no allocation,
  // no sync): graph-capturable, and a captured launch keeps the pointers of its call. Throws Error(Unsupported)
  // naming `what` when CUTLASS rejects the shapes or alignments.
  virtual void run(const ContigCall& call, cudaStream_t stream, std::string_view what) = 0;
};

// The instantiations (ping-pong 128x128x64, clusters 1x2 along N, as the grouped kernels of the same GEMMs).
std::unique_ptr<ContigGemm> make_contig_gemm_tn();
std::unique_ptr<ContigGemm> make_contig_gemm_nn();

}  // namespace moerail::experts
