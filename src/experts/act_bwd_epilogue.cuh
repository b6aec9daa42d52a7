// src/experts/act_bwd_epilogue.cuh — FC2's dgrad epilogue with the activation backward fused in, for the contiguous
// NN GEMM (contig_gemm_sm90.cuh): the tile's d_act = bf16(acc) is not stored; it goes straight into what the
// activation backward pass (elementwise.cu) does with it, with the same per-element math and roundings, so d_h1 is
// equal to the pass's bit for bit:
//   d = bf16(acc); a, b = h1 at the gate and linear columns of the feature (the reference's glu_columns);
//   d_h1[gate] = bf16(da), d_h1[linear] = bf16(db) with (da, db) = act_bwd(a, b, p * d);
//   dp += act(a, b) * d   (the a W2ᵀ part of d_probs).
// dp is summed over the tile's 128 features in a fixed order (each thread over its columns, then across the four
// threads of a quad, which hold the same rows) and stored as one partial per (row, N tile); a small kernel adds a
// row's partials in N-tile order (launch_dprobs_from_partials). Deterministic, but not the pass's summation order:
// d_probs then differs from the pass's in its last bits.
// Tile t holds rows [tile_row[t], tile_row[t] + tile_rows[t]) of one expert; the rows after a short tile are not
// touched. h1 is read and d_h1 written two bf16 at a time from registers (the columns a thread holds in pairs).
// Measured slower than the pass (docs/experts.md: qwen3's data gradients +42%, deepseek-v3's +0.1% / +1.8%; loading
// a row's pairs before its math made qwen3's +115%), so MlpActivation::Auto leaves it off; staging h1 and d_h1
// through shared memory with bulk copies, as FC1's fused epilogue does, is the next thing to try.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/dispatch_policy.hpp"

#include "experts/activation_math.cuh"
#include "experts/elementwise.h"  // ActShape
#include "experts/staged_epilogue.cuh"

namespace moerail::experts {

template <class StrideD_>
class ActBwdEpilogue : public StagedEpilogueBase<StrideD_, cutlass::epilogue::NoSmemWarpSpecialized> {
  using Base = StagedEpilogueBase<StrideD_, cutlass::epilogue::NoSmemWarpSpecialized>;

 public:
  static constexpr int kTileN = 128;
  static constexpr int kStagingBytes = 0;  // registers to global memory: no staging tile

  struct Arguments {
    ActShape shape;                      // F = the GEMM's N; F1 = h1's and d_h1's row length
    const __nv_bfloat16* h1 = nullptr;   // [rows, F1]
    __nv_bfloat16* d_h1 = nullptr;       // [rows, F1], written
    const float* probs = nullptr;        // [rows] or nullptr (p = 1)
    float* dp_partial = nullptr;         // [rows, n_tiles] or nullptr (no d_probs)
    int n_tiles = 0;                     // ceil(F / 128)
    const int* tile_row = nullptr;       // device: [M tiles]
    const int* tile_rows = nullptr;      // device: [M tiles]
  };
  using Params = Arguments;

  // Pairs of adjacent features must map to adjacent h1 columns: concatenated halves, or interleaved blocks of a
  // multiple of 8 (as the pass's vector path).
  static bool supports(const ActShape& s) {
    return s.F % 8 == 0 && (!is_glu(s.kind) || s.layout == GluLayout::Concatenated || s.g % 8 == 0);
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    return args.h1 != nullptr && args.d_h1 != nullptr && args.tile_row != nullptr && args.tile_rows != nullptr &&
           int(cute::get<1>(shape)) == args.shape.F && args.n_tiles == (args.shape.F + kTileN - 1) / kTileN &&
           supports(args.shape);
  }

  CUTLASS_HOST_DEVICE explicit ActBwdEpilogue(Params const& p) : params(p) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK blk_shape_MNK, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma, ResidueMNK,
                                 int thread_idx, char*) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "expected the wgmma fragment ((2,2,V),M,N)");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "expected the wgmma fragment");
    static_assert(size<1>(BlockShapeMNK{}) == kTileN, "kTileN must be the tile's N");

    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coord = thr_mma.partition_C(make_identity_tensor(take<0, 2>(blk_shape_MNK)));
    const int t = int(get<0>(blk_coord_mnkl)), n_tile = int(get<1>(blk_coord_mnkl));
    switch (params.shape.kind) {
      case Activation::SwiGLU: rows<Activation::SwiGLU>(acc, coord, t, n_tile); break;
      case Activation::GeGLU: rows<Activation::GeGLU>(acc, coord, t, n_tile); break;
      case Activation::QuickGeGLU: rows<Activation::QuickGeGLU>(acc, coord, t, n_tile); break;
      case Activation::ReLU2: rows<Activation::ReLU2>(acc, coord, t, n_tile); break;
      case Activation::GELU: rows<Activation::GELU>(acc, coord, t, n_tile); break;
    }
  }

 private:
  template <Activation A, class Acc, class Coord>
  CUTLASS_DEVICE void rows(const Acc& acc, const Coord& coord, int t, int n_tile) const {
    using namespace cute;
    using act_math::act_bwd;
    using act_math::act_fwd;
    constexpr int kV = size<0, 2>(typename Acc::layout_type{});
    constexpr int kMmaM = size<1>(typename Acc::layout_type{});
    constexpr int kMmaN = size<2>(typename Acc::layout_type{});
    const ActShape& s = params.shape;
    const int n0 = n_tile * kTileN;
    // A cluster's second CTA may get the N tile past the last (clusters pair N tiles): nothing to compute, and no
    // partial to store (its slot would be the next row's first).
    if (n0 >= s.F) return;
    const int first = params.tile_row[t], M = params.tile_rows[t];

    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int r = int(get<0>(coord(make_coord(make_coord(0, v1, 0), mm, 0))));  // this thread's row in the tile
        const bool in = r < M;
        const std::int64_t row = std::int64_t(first) + r;
        const float prob = in && params.probs ? __ldg(params.probs + row) : 1.0f;
        const __nv_bfloat16* h1 = params.h1 + row * s.F1;
        __nv_bfloat16* d_h1 = params.d_h1 + row * s.F1;

        float dp = 0.0f;
        CUTLASS_PRAGMA_UNROLL
        for (int nn = 0; nn < kMmaN; ++nn)
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kV; ++j) {
            const int c = n0 + int(get<1>(coord(make_coord(make_coord(0, v1, j), mm, nn))));  // even
            if (!in || c >= s.F) continue;
            const __nv_bfloat162 d2 = __floats2bfloat162_rn(acc(make_coord(make_coord(0, v1, j), mm, nn)),
                                                            acc(make_coord(make_coord(1, v1, j), mm, nn)));
            int cg, cl;
            act_math::columns<A>(s, c, cg, cl);
            const __nv_bfloat162 g2 = *reinterpret_cast<const __nv_bfloat162*>(h1 + cg);
            const __nv_bfloat162 l2 = is_glu(A) ? *reinterpret_cast<const __nv_bfloat162*>(h1 + cl) : g2;
            float da[2], db[2];
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < 2; ++i) {
              const float a = __bfloat162float(i ? g2.y : g2.x), b = __bfloat162float(i ? l2.y : l2.x);
              const float d = __bfloat162float(i ? d2.y : d2.x);
              dp += act_fwd<A>(a, b, s) * d;
              act_bwd<A>(a, b, prob * d, s, da[i], db[i]);
            }
            *reinterpret_cast<__nv_bfloat162*>(d_h1 + cg) = __floats2bfloat162_rn(da[0], da[1]);
            if constexpr (is_glu(A)) *reinterpret_cast<__nv_bfloat162*>(d_h1 + cl) = __floats2bfloat162_rn(db[0], db[1]);
          }
        // The four threads of a quad hold the same two rows (the wgmma accumulator layout: lane / 4 picks the row,
        // lane % 4 the column pair), so the quad's sum is the row's sum over the tile's columns.
        dp += __shfl_xor_sync(0xffffffffu, dp, 1);
        dp += __shfl_xor_sync(0xffffffffu, dp, 2);
        if (params.dp_partial && in && (threadIdx.x & 3) == 0)
          params.dp_partial[row * params.n_tiles + n_tile] = dp;
      }
  }

  Params params;
};

}  // namespace moerail::experts
