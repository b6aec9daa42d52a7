// src/experts/epilogues/act_bwd_epilogue.cuh — FC2's dgrad epilogue with the activation backward fused in, for the contiguous
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
// touched. The tile's h1 columns (two 128-column segments per row: the gate and linear halves' columns n0.. of
// concatenated halves, or the 256 contiguous columns 2 n0.. of interleaved ones) are staged in shared memory with
// 16-byte cp.async loads (a warp reads 512 contiguous bytes of one row), every thread turns its pairs into d_h1 in
// place, and thread i of the warpgroup copies row i out with cp.async.bulk, as FC1's fused epilogue does
// (glu_epilogue.cuh). The epilogue runs beside the other warpgroup's mainloop and must be shorter than it: its
// per-element work is lean (staged indices once per column pair, rows' probs loaded during the h1 wait).
// Against the pass, MlpActivation::Auto fuses it where it measured ahead (kActBwdAutoMinK, tiles.h). What keeps it
// short: indices staged once per column pair (recomputed per element they cost much more), h1 loaded with
// stepping pointers and no branch for rows past M, one-operation bf16 unpacks.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/dispatch_policy.hpp"

#include "experts/activation_math.cuh"
#include "experts/elementwise.h"  // ActShape
#include "experts/epilogues/staged_epilogue.cuh"

namespace moerail::experts {

template <class StrideD_>
class ActBwdEpilogue : public StagedEpilogueBase<StrideD_, cutlass::epilogue::NoSmemWarpSpecialized> {
  using Base = StagedEpilogueBase<StrideD_, cutlass::epilogue::NoSmemWarpSpecialized>;

 public:
  static constexpr int kTileN = 128, kTileM = 128;
  // Per row: two 128-column segments (gate and linear columns) and 16 bytes of padding, so that the 8 rows of a
  // warp's 4-byte accesses fall in different banks. A static __shared__ variable of operator() (StagedEpilogueBase).
  static constexpr int kPitch = 2 * kTileN + 8;
  struct Staging {
    alignas(128) __nv_bfloat16 h[kTileM * kPitch];
  };
  static constexpr int kStagingBytes = int(sizeof(Staging));

  struct Arguments {
    ActShape shape;                      // F = the GEMM's N; F1 = h1's and d_h1's row length
    const __nv_bfloat16* h1 = nullptr;   // [rows, F1]
    __nv_bfloat16* d_h1 = nullptr;       // [rows, F1], written
    const float* probs = nullptr;        // [rows] or nullptr (p = 1)
    float* dp_partial = nullptr;         // [rows, n_tiles] or nullptr (no d_probs, or probs not in the activation)
    int n_tiles = 0;                     // ceil(F / 128)
    const int* tile_row = nullptr;       // device: [M tiles]
    const int* tile_rows = nullptr;      // device: [M tiles]
  };
  using Params = Arguments;

  // A tile's h1 columns must be two 16-byte-aligned 128-column segments: concatenated halves, or interleaved blocks
  // of g dividing 128 (g in 8..128), whose pair blocks tile the 256 columns 2 n0...
  static bool supports(const ActShape& s) {
    return s.F % 8 == 0 && (!is_glu(s.kind) || s.layout == GluLayout::Concatenated ||
                            (s.g % 8 == 0 && s.g <= kTileN && kTileN % s.g == 0));
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
    __shared__ Staging stage;  // one for every activation's instantiation of rows()
    switch (params.shape.kind) {
      case Activation::SwiGLU: rows<Activation::SwiGLU>(acc, coord, t, n_tile, thread_idx, stage); break;
      case Activation::GeGLU: rows<Activation::GeGLU>(acc, coord, t, n_tile, thread_idx, stage); break;
      case Activation::QuickGeGLU: rows<Activation::QuickGeGLU>(acc, coord, t, n_tile, thread_idx, stage); break;
      case Activation::ReLU2: rows<Activation::ReLU2>(acc, coord, t, n_tile, thread_idx, stage); break;
      case Activation::GELU: rows<Activation::GELU>(acc, coord, t, n_tile, thread_idx, stage); break;
    }
  }

 private:
  // Staged index of h1 column `col` of a tile starting at feature n0: segment 0 = the gate columns (concatenated)
  // or the first 128 of the 256 contiguous columns (interleaved), segment 1 = the rest.
  CUTLASS_DEVICE static int staged(const ActShape& s, bool inter, int col, int n0) {
    if (inter) return col - 2 * n0;
    return col < s.F ? col - n0 : kTileN + (col - s.F - n0);
  }

  template <Activation A, class Acc, class Coord>
  CUTLASS_DEVICE void rows(const Acc& acc, const Coord& coord, int t, int n_tile, int thread_idx,
                           Staging& stage) const {
    using namespace cute;
    using act_math::act_bwd;
    using act_math::act_fwd;
    using act_math::hi_float;
    using act_math::lo_float;
    constexpr int kV = size<0, 2>(typename Acc::layout_type{});
    constexpr int kMmaM = size<1>(typename Acc::layout_type{});
    constexpr int kMmaN = size<2>(typename Acc::layout_type{});
    const ActShape& s = params.shape;
    const int n0 = n_tile * kTileN;
    // A cluster's second CTA may get the N tile past the last (clusters pair N tiles): nothing to compute, and no
    // partial to store (its slot would be the next row's first).
    if (n0 >= s.F) return;
    const int first = params.tile_row[t], M = params.tile_rows[t];
    const int cols = min(kTileN, s.F - n0);  // features of this tile, a multiple of 8
    const bool inter = is_glu(A) && s.layout == GluLayout::Interleaved;
    // Global h1 columns of the two segments and their valid widths (in columns, multiples of 8).
    const int seg0 = inter ? 2 * n0 : n0, seg1 = inter ? 2 * n0 + kTileN : s.F + n0;
    const int w0 = inter ? min(kTileN, 2 * cols) : cols;
    const int w1 = !is_glu(A) ? 0 : inter ? max(0, 2 * cols - kTileN) : cols;

    // 1. h1 in, 16-byte pieces (32 a row: 16 per segment): thread i loads piece i % 16 of segment i / 16 % 2 of rows
    // i / 32, i / 32 + 4, ... (a warp takes a row's 512 bytes), so its pointers only step.
    {
      const int i = thread_idx % 128, seg = i / 16 % 2, piece = i % 16;
      if (piece * 8 < (seg ? w1 : w0)) {
        const __nv_bfloat16* src =
            params.h1 + (std::int64_t(first) + i / 32) * s.F1 + (seg ? seg1 : seg0) + piece * 8;
        unsigned dst = unsigned(__cvta_generic_to_shared(stage.h + (i / 32) * kPitch + seg * kTileN + piece * 8));
        for (int r = i / 32; r < M; r += 4, src += 4 * std::int64_t(s.F1), dst += 4 * kPitch * 2)
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    // This thread's rows of the tile (kRows of them: the fragment's v1 x mm) and their probs, loaded while h1
    // arrives.
    constexpr int kRows = 2 * kMmaM;
    int row_in_tile[kRows];
    float prob[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int q = 2 * mm + v1, r = int(get<0>(coord(make_coord(make_coord(0, v1, 0), mm, 0))));
        row_in_tile[q] = r;
        prob[q] = r < M && params.probs ? __ldg(params.probs + std::int64_t(first) + r) : 1.0f;
      }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    Base::warpgroup_sync();

    // 2. the math, d_h1 written over the h1 it came from (each pair read and written by the same thread). Column
    // pairs outside, rows inside: a pair's staged indices are computed once for the thread's rows, whose h1 pairs
    // are all loaded before any is written back. Each row's dp still sums its columns in the order (nn, j, i).
    // Rows past M are computed too, on whatever their staged rows hold, without a branch: neither their d_h1 nor
    // their dp leaves the tile.
    float dp[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kRows; ++q) dp[q] = 0.0f;
    CUTLASS_PRAGMA_UNROLL
    for (int nn = 0; nn < kMmaN; ++nn)
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kV; ++j) {
        // The pair's first (even) column; it does not depend on the row indices v1 and mm.
        const int c = n0 + int(get<1>(coord(make_coord(make_coord(0, 0, j), 0, nn))));
        if (c >= s.F) continue;
        int cg, cl;
        act_math::columns<A>(s, c, cg, cl);
        const int ig = staged(s, inter, cg, n0), il = is_glu(A) ? staged(s, inter, cl, n0) : ig;
        __nv_bfloat162 g2[kRows], l2[kRows];
        CUTLASS_PRAGMA_UNROLL
        for (int q = 0; q < kRows; ++q) {
          const __nv_bfloat16* h = stage.h + row_in_tile[q] * kPitch;
          g2[q] = *reinterpret_cast<const __nv_bfloat162*>(h + ig);
          l2[q] = *reinterpret_cast<const __nv_bfloat162*>(h + il);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < kMmaM; ++mm)
          CUTLASS_PRAGMA_UNROLL
          for (int v1 = 0; v1 < 2; ++v1) {
            const int q = 2 * mm + v1;
            const __nv_bfloat162 d2 = __floats2bfloat162_rn(acc(make_coord(make_coord(0, v1, j), mm, nn)),
                                                            acc(make_coord(make_coord(1, v1, j), mm, nn)));
            float da[2], db[2];
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < 2; ++i) {
              const float a = i ? hi_float(g2[q]) : lo_float(g2[q]), b = i ? hi_float(l2[q]) : lo_float(l2[q]);
              const float d = i ? hi_float(d2) : lo_float(d2);
              dp[q] += act_fwd<A>(a, b, s) * d;
              act_bwd<A>(a, b, prob[q] * d, s, da[i], db[i]);
            }
            g2[q] = __floats2bfloat162_rn(da[0], da[1]);
            l2[q] = __floats2bfloat162_rn(db[0], db[1]);
          }
        CUTLASS_PRAGMA_UNROLL
        for (int q = 0; q < kRows; ++q) {
          __nv_bfloat16* h = stage.h + row_in_tile[q] * kPitch;
          *reinterpret_cast<__nv_bfloat162*>(h + ig) = g2[q];
          if constexpr (is_glu(A)) *reinterpret_cast<__nv_bfloat162*>(h + il) = l2[q];
        }
      }
    // The four threads of a quad hold the same rows (the wgmma accumulator layout: lane / 4 picks the row, lane % 4
    // the column pair), so the quad's sum is the row's sum over the tile's columns.
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kRows; ++q) {
      dp[q] += __shfl_xor_sync(0xffffffffu, dp[q], 1);
      dp[q] += __shfl_xor_sync(0xffffffffu, dp[q], 2);
      if (params.dp_partial && row_in_tile[q] < M && (threadIdx.x & 3) == 0)
        params.dp_partial[(std::int64_t(first) + row_in_tile[q]) * params.n_tiles + n_tile] = dp[q];
    }

    // 3. d_h1 out: thread i copies row i's segments.
    Base::staged_tile_ready();
    const int i = thread_idx % 128;
    if (i < M) {
      __nv_bfloat16* dst = params.d_h1 + (std::int64_t(first) + i) * s.F1;
      const __nv_bfloat16* src = stage.h + i * kPitch;
      Base::bulk_copy(dst + seg0, src, unsigned(w0) * 2u);
      if (w1 > 0) Base::bulk_copy(dst + seg1, src + kTileN, unsigned(w1) * 2u);
      Base::commit_copies();
    }
    Base::wait_copies_read();
  }

  Params params;
};

}  // namespace moerail::experts
