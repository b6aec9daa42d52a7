// src/experts/epilogues/glu_epilogue.cuh — FC1's epilogue with the GLU activation fused in (GemmLayout::TN). Included through
// grouped_gemm_sm90.cuh (gemm_tn_ping128x128_glu.cu, gemm_tn_coop128x256_glu.cu) and contig_gemm_sm90.cuh.
//
// With the gate/linear halves interleaved in blocks of g columns (GluLayout::Interleaved, g a multiple of 8 with 2g
// dividing a round's columns, below), every thread holds the gate and the linear value of the same output feature
// in its own accumulator registers: a wgmma accumulator fragment is ((2, 2, N/8), MMA_M, MMA_N) — two adjacent
// columns, rows r and r + 8, one entry per 8-column block — so column c + g sits g/8 blocks further in the same
// thread.
// Per pair the epilogue does exactly what FC1's plain epilogue followed by the activation pass (elementwise.cu) do,
// in the same order and with the same roundings, so the results are equal bit for bit:
//   h1 = bf16(acc); with a bias h1 = bf16(h1 + b1); store h1 (both halves, saved for the backward);
//   act[r, j] = bf16(p[r] * act(h1_gate, h1_linear)).
// The tile's h1 and act go through shared memory, 64 rows of 128 columns (a round: one wgmma's rows) at a time on
// the ping-pong tile and in the contiguous GEMM: each warp writes its 8-column blocks there with stmatrix, four 8x8
// blocks per instruction (rows padded by 16 bytes so that the 8 rows of a block fall in different banks), then each
// thread of the warpgroup hands one row to the bulk-copy engine (cp.async.bulk shared -> global: the first 64
// threads h1's rows, the other 64 act's), rows past the group's M skipped, and the warpgroup meets before the next
// round writes the buffer. The copies run beside the next mainloop; before the next tile's epilogue (the
// other warpgroup's, serialized by the kernel) may overwrite the buffer, the issuing threads wait until the copies
// have read it (stores straight from registers measured slower: docs/experts.md).
// On the cooperative tile (128x256, kThreads = 256: both consumer warpgroups share a tile, 64 rows each) a round is
// 64 of the tile's columns (each round a whole number of gate/linear pairs, so g <= 32 there), four a tile, and all
// 256 threads meet at a named barrier before each round writes the buffer; at 24 KB the buffer leaves the mainloop
// four stages. A round leaves as two TMA tensor stores (kTensorStore): the buffer holds h1's 128 x 64 box in the
// TMA unit's 128-byte swizzle and act's 128 x 32 in its 64-byte one, and thread 0 stores them through two tensor
// maps of this CTA (h1 and act of the tile's group, M rows each: the unit drops rows and columns outside them),
// which it points at the group's rows when the group changes. Nothing computes while the cooperative tile's
// epilogue runs, so it cannot afford the row copies' serialized issue (docs/experts.md has the figures).
// The per-group pointers (h1 through CUTLASS's ptr_D, act, probs, bias) are written by the setup kernel.
// kContig: the same epilogue in the contiguous GEMM (contig_gemm_sm90.cuh): tile t holds rows [tile_row[t],
// tile_row[t] + tile_rows[t]) of expert tile_group[t]; h1, act and probs are one buffer each over all rows, the bias
// that expert's pointer in the per-group table.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"

#include "experts/activation_math.cuh"
#include "experts/grouped/grouped_gemm.h"
#include "experts/epilogues/staged_epilogue.cuh"

namespace moerail::experts {

// The operator-style collective (CUTLASS's Sm90TmaWarpSpecializedAdapter wraps it for the SM90 ptr-array kernels,
// as it wraps CUTLASS's own no-smem DefaultEpilogueArray).
// kThreads: the threads that run one tile's epilogue, 128 (ping-pong: one consumer warpgroup per tile) or 256
// (cooperative: both).
template <class StrideD_, int kTileN_, bool kContig = false, int kThreads_ = 128>
class GluEpilogueArray : public StagedEpilogueBase<StrideD_, cutlass::epilogue::PtrArrayNoSmemWarpSpecialized> {
  using Base = StagedEpilogueBase<StrideD_, cutlass::epilogue::PtrArrayNoSmemWarpSpecialized>;

 public:
  static constexpr int kTileN = kTileN_;  // the GEMM tile's N
  static constexpr int kThreads = kThreads_;
  // The cooperative grouped form stores each round with the TMA unit; the others copy rows.
  static constexpr bool kTensorStore = kThreads == 256 && !kContig;
  static_assert(kTensorStore || kThreads == 128, "row copies serve one warpgroup's tiles (ping-pong, contiguous)");
  // Tile columns staged at a time (a round; 2g must divide it; tiles.h's glu_round_columns says the same for the
  // kernel choice). The tensor stores' rounds are 64 columns wide, so that the cooperative mainloop keeps four
  // stages (a 48 KB round left it three).
  static constexpr int kStageN = kTensorStore ? 64 : 128;
  static constexpr int kRounds = kTileN / kStageN;
  static_assert(kTileN % kStageN == 0 && (kThreads == 128 || kThreads == 256), "whole rounds, one or two warpgroups");
  // Tile rows staged at a time. Row copies: one 64-row half of the warpgroup's 128-row tile (the rows of one wgmma,
  // MMA_M) per round, so that a round's values held in registers and the buffer are half a tile's: with whole tiles
  // the values spilled to local memory and the buffer (53 KB) left the ping-pong mainloop five stages of six.
  // Tensor stores: the cooperative tile's 128 rows (64 per warpgroup, one wgmma each).
  static constexpr int kTileM = 128;
  static constexpr int kStageM = kTensorStore ? kTileM : 64;
  using typename Base::ElementD;
  using typename Base::StrideC;
  using typename Base::StrideD;
  using InternalStrideC = cute::remove_pointer_t<StrideC>;
  using InternalStrideD = cute::remove_pointer_t<StrideD>;

  // One round of h1 (kStageM rows, kStageN columns) and of act (kStageN / 2 columns) per CTA; a static __shared__
  // variable of operator() (see StagedEpilogueBase), for which the mainloop's stage count leaves room
  // (kStagingBytes, grouped_gemm_sm90.cuh). Row copies: rows padded by 16 bytes, so that the 8 rows of a warp's
  // store fall in different banks.
  static constexpr int kH1Pitch = kStageN + 8;       // bf16 elements per staged h1 row
  static constexpr int kActPitch = kStageN / 2 + 8;  // bf16 elements per staged act row
  struct RowStaging {
    alignas(128) __nv_bfloat16 h1[kStageM * kH1Pitch];
    alignas(128) __nv_bfloat16 act[kStageM * kActPitch];
  };
  // Tensor stores: two boxes of 128 rows, h1's kStageN columns (128 bytes a row) and act's kStageN / 2 (64 bytes),
  // in the TMA unit's 128- and 64-byte swizzles (swizzled()), which also spread a warp's 8 rows over the banks.
  struct BoxStaging {
    alignas(1024) unsigned char h1[kTileM * kStageN * 2];  // the swizzles repeat every 1024 / 512 bytes: the
    alignas(1024) unsigned char act[kTileM * kStageN];     // boxes start on it
  };
  using Staging = cute::conditional_t<kTensorStore, BoxStaging, RowStaging>;
  static constexpr int kStagingBytes = int(sizeof(Staging)) + (kTensorStore ? 1024 : 0);  // + the alignment

  // kTensorStore: the tensor maps in the GEMM's workspace: the two templates (encode_tensor_maps), then two maps
  // (h1, act) per CTA of the persistent grid.
  static constexpr int kTemplateMaps = 2;

  struct Arguments {
    ElementD** ptr_D = nullptr;  // h1_g (grouped)
    StrideD dD{};
    GluEpilogue glu{};           // kContig: shape and the per-group bias table only
    // kTensorStore: templates of the tensor maps of h1 (rows of ld_h1 elements, shape.F1 wide) and act (shape.F
    // wide), boxes and swizzle as staged; each CTA copies them and sets the group's address and rows.
    // initialize_workspace puts them in the workspace, whose address to_underlying_arguments keeps in maps.
    struct TensorStore {
      bool encoded = false;
      cute::TmaDescriptor h1{}, act{};
      cute::TmaDescriptor* maps = nullptr;
    } tma;
    struct Contig {              // kContig: the buffers over all rows and the tile table
      ElementD* h1 = nullptr;
      std::int64_t ld_h1 = 0;    // elements (act rows are glu.shape.F)
      void* act = nullptr;
      const float* probs = nullptr;
      const int* tile_row = nullptr;
      const int* tile_rows = nullptr;
      const int* tile_group = nullptr;
    } contig;
  };
  using Params = Arguments;
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    const int g = args.glu.shape.g;
    const bool where = kContig ? args.contig.h1 != nullptr && args.contig.act != nullptr &&
                                     args.contig.tile_row != nullptr && args.contig.tile_rows != nullptr &&
                                     args.contig.tile_group != nullptr && args.contig.ld_h1 % 8 == 0
                               : args.glu.act != nullptr;
    return is_glu(args.glu.shape.kind) && args.glu.shape.layout == GluLayout::Interleaved && g > 0 && g % 8 == 0 &&
           kStageN % (2 * g) == 0 && where && (!kTensorStore || args.tma.encoded);
  }

  // The workspace: kTensorStore's tensor maps (no workspace otherwise).
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int sm_count = 0) {
    return kTensorStore ? std::size_t(kTemplateMaps + 2 * sm_count) * sizeof(cute::TmaDescriptor) : 0;
  }
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void* workspace) {
    Params p = args;
    if constexpr (kTensorStore) p.tma.maps = static_cast<cute::TmaDescriptor*>(workspace);
    return p;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const& args, void* workspace,
                                              cudaStream_t stream, cutlass::CudaHostAdapter* = nullptr) {
    if constexpr (kTensorStore) {
      const cute::TmaDescriptor templates[kTemplateMaps] = {args.tma.h1, args.tma.act};
      if (cudaMemcpyAsync(workspace, templates, sizeof templates, cudaMemcpyHostToDevice, stream) != cudaSuccess ||
          cudaStreamSynchronize(stream) != cudaSuccess)
        return cutlass::Status::kErrorInternal;
    }
    return cutlass::Status::kSuccess;
  }

  // kTensorStore, on the host: encodes args.tma's templates for h1 rows of ld_h1 elements; `anchor` is any device
  // address to encode them with (the device sets each group's). CUDA_SUCCESS or the driver's error.
  static CUresult encode_tensor_maps(Arguments& args, std::int64_t ld_h1, const void* anchor) {
    const ActShape& s = args.glu.shape;
    void* aligned = reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(anchor) & ~std::uintptr_t(15));
    auto encode = [&](cute::TmaDescriptor* map, int cols, std::int64_t ld, int box_cols) {
      const cuuint64_t dims[2] = {cuuint64_t(cols), 1};  // columns, rows (set per group)
      const cuuint64_t strides[1] = {cuuint64_t(ld) * 2};
      const cuuint32_t box[2] = {cuuint32_t(box_cols), kTileM}, unit[2] = {1, 1};
      return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
          map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, aligned, dims, strides, box, unit,
          CU_TENSOR_MAP_INTERLEAVE_NONE, box_cols * 2 == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
          CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    };
    static_assert(kStageN == 64, "the boxes' rows are 128 (h1) and 64 bytes (act)");
    CUresult r = encode(&args.tma.h1, s.F1, ld_h1, kStageN);
    if (r == CUDA_SUCCESS) r = encode(&args.tma.act, s.F, s.F, kStageN / 2);
    args.tma.encoded = r == CUDA_SUCCESS;
    return r;
  }

  CUTLASS_HOST_DEVICE explicit GluEpilogueArray(Params const& p) : params(p) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "expected the wgmma fragment ((2,2,V),M,N)");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "expected the wgmma fragment");
    static_assert(size<2>(FrgLayout{}) == 1 && size<0, 2>(FrgLayout{}) * 8 == size<1>(BlockShapeMNK{}),
                  "one wgmma must span the tile's N (the gate/linear pairing assumes it)");
    static_assert(size<1>(BlockShapeMNK{}) == kTileN, "kTileN must be the tile's N");
    static_assert(size<0>(BlockShapeMNK{}) == kTileM, "the staging buffer holds 128-row tiles");

    // M: the rows of the group (grouped) or of the tile (kContig, whose Row pointers start at the tile's first row)
    int M = get<0>(problem_shape_mnkl), m0 = int(get<0>(blk_coord_mnkl)) * int(size<0>(BlockShapeMNK{}));
    const int N = get<1>(problem_shape_mnkl);
    const int n0 = int(get<1>(blk_coord_mnkl)) * kTileN;

    // Tile-local (row, column) of every accumulator of this thread.
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coord = thr_mma.partition_C(make_identity_tensor(take<0, 2>(blk_shape_MNK)));

    Row row{};
    if constexpr (kContig) {
      const auto& c = params.contig;
      const int t = int(get<0>(blk_coord_mnkl)), first = c.tile_row[t], e = c.tile_group[t];
      M = c.tile_rows[t];
      m0 = 0;
      row.h1 = reinterpret_cast<__nv_bfloat16*>(c.h1) + std::int64_t(first) * c.ld_h1;
      row.ld = c.ld_h1;
      row.act = static_cast<__nv_bfloat16*>(c.act) + std::int64_t(first) * params.glu.shape.F;
      row.probs = c.probs ? c.probs + first : nullptr;
      row.bias = params.glu.bias ? static_cast<const __nv_bfloat16*>(params.glu.bias[e]) : nullptr;
    } else {
      const int l = int(get<3>(blk_coord_mnkl));
      row.h1 = reinterpret_cast<__nv_bfloat16*>(params.ptr_D[l]);
      row.ld = get<0>(params.dD[l]);
      row.act = static_cast<__nv_bfloat16*>(params.glu.act[l]);
      row.probs = params.glu.probs ? params.glu.probs[l] : nullptr;
      row.bias = params.glu.bias ? static_cast<const __nv_bfloat16*>(params.glu.bias[l]) : nullptr;
    }

    if constexpr (kTensorStore) {
      const int l = int(get<3>(blk_coord_mnkl));
      if (l != map_group_) {
        if (thread_idx == 0) point_maps(row, M);
        map_group_ = l;
      }
    }

    __shared__ Staging stage;
    const ActShape& s = params.glu.shape;
    const Tile tile{M, N, m0, n0, thread_idx};
    switch (s.kind) {
      case Activation::SwiGLU: by_block<Activation::SwiGLU>(acc, coord, row, s, tile, stage); break;
      case Activation::GeGLU: by_block<Activation::GeGLU>(acc, coord, row, s, tile, stage); break;
      case Activation::QuickGeGLU: by_block<Activation::QuickGeGLU>(acc, coord, row, s, tile, stage); break;
      default: break;  // can_implement admits GLU kinds only
    }
  }

 private:
  struct Row {
    __nv_bfloat16* h1;
    std::int64_t ld;
    __nv_bfloat16* act;
    const float* probs;
    const __nv_bfloat16* bias;
  };
  // The group's (or the contiguous tile's) rows M and columns N, the tile's first row and column, the thread.
  struct Tile {
    int M, N, m0, n0, thread_idx;
  };

  template <Activation A, class Acc, class Coord>
  CUTLASS_DEVICE void by_block(const Acc& acc, const Coord& coord, const Row& row, const ActShape& s, const Tile& t,
                               Staging& stage) const {
    switch (s.g) {  // g / 8 = 8-column blocks per half, a compile-time constant for register indexing
      case 8: pairs<A, 1>(acc, coord, row, s, t, stage); break;
      case 16: pairs<A, 2>(acc, coord, row, s, t, stage); break;
      case 32: pairs<A, 4>(acc, coord, row, s, t, stage); break;
      case 64: pairs<A, 8>(acc, coord, row, s, t, stage); break;
      case 128: pairs<A, 16>(acc, coord, row, s, t, stage); break;
      default: break;  // can_implement admits these only
    }
  }

  // Where h1's (tile row r, column c of the round) and act's (r, output column j of the round) pair is staged.
  CUTLASS_DEVICE static __nv_bfloat162* h1_at(Staging& stage, int r, int c) {
    if constexpr (kTensorStore)
      return swizzled<kStageN * 2>(stage.h1, r, c);
    else
      return reinterpret_cast<__nv_bfloat162*>(stage.h1 + r * kH1Pitch + c);
  }
  CUTLASS_DEVICE static __nv_bfloat162* act_at(Staging& stage, int r, int j) {
    if constexpr (kTensorStore)
      return swizzled<kStageN>(stage.act, r, j);
    else
      return reinterpret_cast<__nv_bfloat162*>(stage.act + r * kActPitch + j);
  }
  // Element (r, c) of a box of kRowBytes-byte rows in the TMA unit's swizzle of that span (128 or 64 bytes): the
  // 16-byte piece of byte address a moves to piece ^ (a / 128) % 8 (128 bytes) or ^ (a / 128) % 4 (64 bytes).
  template <int kRowBytes>
  CUTLASS_DEVICE static __nv_bfloat162* swizzled(unsigned char* box, int r, int c) {
    static_assert(kRowBytes == 128 || kRowBytes == 64, "the 128- and 64-byte swizzles");
    constexpr int kPieces = kRowBytes == 128 ? 0x70 : 0x30;  // the address bits of the 16-byte piece it permutes
    const int a = r * kRowBytes + c * 2;
    return reinterpret_cast<__nv_bfloat162*>(box + (a ^ ((a >> 3) & kPieces)));
  }

  // kTensorStore: this CTA's two tensor maps in the workspace (h1, act).
  CUTLASS_DEVICE cute::TmaDescriptor* cta_maps() const {
    return params.tma.maps + kTemplateMaps + 2 * int(blockIdx.x + blockIdx.y * gridDim.x);
  }
  // Thread 0, when the group changes: points this CTA's maps at the group's h1 and act, M rows each. The stores
  // issued through the maps so far complete first (they are a mainloop old: no wait in practice).
  CUTLASS_DEVICE void point_maps(const Row& r, int M) const {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    cute::TmaDescriptor* maps = cta_maps();
    const void* base[2] = {r.h1, r.act};
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 2; ++i) {
      const uint4* from = reinterpret_cast<const uint4*>(params.tma.maps + i);
      uint4* to = reinterpret_cast<uint4*>(maps + i);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < int(sizeof(cute::TmaDescriptor) / sizeof(uint4)); ++k) to[k] = from[k];
      asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;" ::"l"(maps + i), "l"(base[i])
                   : "memory");
      asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], 1, %1;" ::"l"(maps + i), "r"(M)
                   : "memory");
    }
    asm volatile("fence.proxy.tensormap::generic.release.gpu;" ::: "memory");
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 2; ++i)
      asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(maps + i) : "memory");
  }
  // One staged box to the tensor of `map` at (column x, row y); rows and columns outside the tensor are dropped.
  CUTLASS_DEVICE static void tensor_store(const cute::TmaDescriptor* map, const unsigned char* box, int x, int y) {
    const unsigned s = unsigned(__cvta_generic_to_shared(box));
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map), "r"(s),
                 "r"(x), "r"(y)
                 : "memory");
  }

  // One pair of a round in registers: h1's gate and linear values (bf16, two adjacent columns) and their activation.
  struct Pair {
    __nv_bfloat162 gate, lin, out;
  };

  // Four 8x8 bf16 matrices into shared memory (stmatrix): this lane's registers r0..r3 hold row lane / 4, columns
  // 2 (lane % 4) and + 1 of matrices 0..3 (the wgmma accumulator's layout of one 8-column block); the lane gives
  // the address of row lane % 8 of matrix lane / 8.
  CUTLASS_DEVICE static void stmatrix_x4(const void* row_of_lane, __nv_bfloat162 r0, __nv_bfloat162 r1,
                                         __nv_bfloat162 r2, __nv_bfloat162 r3) {
    const unsigned s = unsigned(__cvta_generic_to_shared(row_of_lane));
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(s),
                 "r"(*reinterpret_cast<unsigned*>(&r0)), "r"(*reinterpret_cast<unsigned*>(&r1)),
                 "r"(*reinterpret_cast<unsigned*>(&r2)), "r"(*reinterpret_cast<unsigned*>(&r3))
                 : "memory");
  }

  // A round's pairs into the staging buffer, whole 8-column blocks at a time with stmatrix (no per-element
  // addresses or bounds: rows past M and columns past N are staged too, and never leave: the row copies skip them,
  // the TMA unit drops them). Round-local h1 block b (columns 8b..8b+7) is the gate (b % 2g' < g', g' = kBlocks) or
  // the linear block of pair a = (b / 2g') g' + b % g' (less g' for a linear block); act block a holds pair a's
  // activation. Each stmatrix stores blocks b and b + 1 of the band's two 8-row halves.
  // v[i]: the round's values of its wgmma row block i; staged[i]: the staged row of the first row of this thread's
  // 16-row band in it.
  template <int kBlocks, int kRoundV, int kMmaR>
  CUTLASS_DEVICE static void stage_round(const Pair (&v)[kMmaR][2][kRoundV / 2], Staging& stage,
                                         const int (&staged)[kMmaR], int thread_idx) {
    const int lane = thread_idx % 32, half = lane / 8 % 2, next = lane / 16;  // the matrix this lane addresses
    auto h1_block = [&](int mm, int v1, int b) {
      const Pair& o = v[mm][v1][b / (2 * kBlocks) * kBlocks + b % kBlocks];
      return b % (2 * kBlocks) < kBlocks ? o.gate : o.lin;
    };
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaR; ++mm) {
      const int row = staged[mm] + 8 * half + lane % 8;
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kRoundV; b += 2)
        stmatrix_x4(h1_at(stage, row, 8 * (b + next)), h1_block(mm, 0, b), h1_block(mm, 1, b),
                    h1_block(mm, 0, b + 1), h1_block(mm, 1, b + 1));
      CUTLASS_PRAGMA_UNROLL
      for (int a = 0; a < kRoundV / 2; a += 2)
        stmatrix_x4(act_at(stage, row, 8 * (a + next)), v[mm][0][a].out, v[mm][1][a].out, v[mm][0][a + 1].out,
                    v[mm][1][a + 1].out);
    }
  }

  // A round's staged columns [c0, c0 + kStageN) of tile rows [row0, row0 + kStageM) to global memory. Tensor
  // stores: thread 0 stores the two boxes (pairs() waits until they have read the buffer). Row copies: thread i of
  // the warpgroup copies staged row i of h1 (i < kStageM) or row i - kStageM of act (if inside M), then waits until
  // its copy has read the buffer.
  CUTLASS_DEVICE void copy_out(const Row& r, Staging& stage, const ActShape& s, const Tile& t, int c0,
                                int row0) const {
    Base::template staged_tile_ready<kThreads>();
    if constexpr (kTensorStore) {
      if (t.thread_idx == 0) {
        if (c0 < t.N) {
          const cute::TmaDescriptor* maps = cta_maps();
          tensor_store(maps, stage.h1, c0, t.m0);
          tensor_store(maps + 1, stage.act, c0 / 2, t.m0);
          Base::commit_copies();
        }
      }  // waited for by pairs(), after the next round's math
    } else {
      static_assert(2 * kStageM == 128, "a warpgroup's threads copy a round's h1 rows and act rows");
      const int i = t.thread_idx % 128, staged = i % kStageM, row = t.m0 + row0 + staged;  // the row it copies
      if (row < t.M && c0 < t.N) {
        const int cols = min(kStageN, t.N - c0);  // a multiple of 8 (N is): whole 16-byte pieces
        if (i < kStageM)
          Base::bulk_copy(r.h1 + std::int64_t(row) * r.ld + c0, stage.h1 + staged * kH1Pitch, unsigned(cols) * 2u);
        else
          Base::bulk_copy(r.act + std::int64_t(row) * s.F + c0 / 2, stage.act + staged * kActPitch, unsigned(cols));
        Base::commit_copies();
      }
      Base::wait_copies_read();
    }
  }

  // All loads (probs, bias) are issued before the first store, so that the math warps wait for global memory
  // once per tile and never behind their own stores. Then round by round: the round's pairs into the staging
  // buffer, copied out (copy_out).
  template <Activation A, int kBlocks, class Acc, class Coord>
  CUTLASS_DEVICE void pairs(const Acc& acc, const Coord& coord, const Row& r, const ActShape& s, const Tile& t,
                            Staging& stage) const {
    using namespace cute;
    using act_math::hi_float;
    using act_math::lo_float;
    if constexpr (2 * kBlocks * 8 > kStageN) return;             // g too wide for a round (can_implement)
    constexpr int kV = size<0, 2>(typename Acc::layout_type{});  // 8-column blocks across the tile
    constexpr int kRoundV = kV / kRounds;                        // of them in one round (block j: columns 8j..8j+7)
    constexpr int kMmaM = size<1>(typename Acc::layout_type{});
    const int M = t.M, N = t.N, m0 = t.m0;

    int rows[kMmaM][2];
    float p[kMmaM][2];
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        rows[mm][v1] = m0 + int(get<0>(coord(make_coord(make_coord(0, v1, 0), mm, 0))));
        p[mm][v1] = r.probs && rows[mm][v1] < M ? __ldg(r.probs + rows[mm][v1]) : 1.0f;
      }
    // The first tile row of this thread's 16-row band per mm (its rows are band + lane / 4 and band + 8 + lane / 4).
    int band[kMmaM];
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm) band[mm] = (rows[mm][0] - m0) / 16 * 16;
    // This thread's columns are the same in every row: n0 + cols[j] (+1) for 8-column block j.
    int cols[kV];
    __nv_bfloat162 bias[kV];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kV; ++j) {
      cols[j] = t.n0 + int(get<1>(coord(make_coord(make_coord(0, 0, j), 0, 0))));
      bias[j] = __floats2bfloat162_rn(0.0f, 0.0f);
      if (r.bias && cols[j] < N) {
        const unsigned bits = __ldg(reinterpret_cast<const unsigned*>(r.bias + cols[j]));
        bias[j] = *reinterpret_cast<const __nv_bfloat162*>(&bits);
      }
    }

    // Round by round (row rounds outside, column rounds inside): the round's values in registers first, then (once
    // the buffer is free) into the staging buffer, then out (copy_out). With tensor stores, thread 0 waits for the
    // last round's stores to read the buffer only after its math, so that the reads overlap the math of all 256
    // threads; with row copies every thread has waited for its own copy in copy_out, and the warpgroup meets before
    // the next round writes the buffer.
    constexpr int kRowRounds = kTileM / kStageM;  // row copies: one per wgmma's 64 rows; tensor stores: one
    constexpr int kMmaR = kMmaM / kRowRounds;     // wgmma row blocks (mm) of a round
    static_assert(kMmaR * kRowRounds == kMmaM, "a row round holds whole wgmma row blocks");
    CUTLASS_PRAGMA_UNROLL
    for (int rr = 0; rr < kRowRounds; ++rr) {
      CUTLASS_PRAGMA_UNROLL
      for (int round = 0; round < kRounds; ++round) {
        const int c0 = t.n0 + round * kStageN;  // the round's first column, a multiple of 2g
        Pair v[kMmaR][2][kRoundV / 2];          // pair (chunk, q) of the round at (chunk - round kRoundV) / 2 + q
        int staged[kMmaR];                      // the first staged row of this thread's band in each
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kMmaR; ++i) {
          const int mm = rr * kMmaR + i;
          staged[i] = band[mm] - rr * kStageM;
          CUTLASS_PRAGMA_UNROLL
          for (int v1 = 0; v1 < 2; ++v1) {
            CUTLASS_PRAGMA_UNROLL
            for (int chunk = round * kRoundV; chunk < (round + 1) * kRoundV; chunk += 2 * kBlocks) {
              CUTLASS_PRAGMA_UNROLL
              for (int q = 0; q < kBlocks; ++q) {
                const int jg = chunk + q, jl = jg + kBlocks;  // gate block, linear block (g columns further)
                Pair& o = v[i][v1][(chunk - round * kRoundV) / 2 + q];
                o.gate = __floats2bfloat162_rn(acc(make_coord(make_coord(0, v1, jg), mm, 0)),
                                               acc(make_coord(make_coord(1, v1, jg), mm, 0)));
                o.lin = __floats2bfloat162_rn(acc(make_coord(make_coord(0, v1, jl), mm, 0)),
                                              acc(make_coord(make_coord(1, v1, jl), mm, 0)));
                if (r.bias) {
                  const __nv_bfloat162 bg = bias[jg], bl = bias[jl];
                  o.gate = __floats2bfloat162_rn(lo_float(o.gate) + lo_float(bg), hi_float(o.gate) + hi_float(bg));
                  o.lin = __floats2bfloat162_rn(lo_float(o.lin) + lo_float(bl), hi_float(o.lin) + hi_float(bl));
                }
                const float o0 = p[mm][v1] * act_math::act_fwd<A>(lo_float(o.gate), lo_float(o.lin), s);
                const float o1 = p[mm][v1] * act_math::act_fwd<A>(hi_float(o.gate), hi_float(o.lin), s);
                o.out = __floats2bfloat162_rn(o0, o1);
              }
            }
          }
        }
        // The buffer is free once every copy of the last round (or tile) has read it.
        if constexpr (kTensorStore) {
          if (t.thread_idx == 0) Base::wait_copies_read();
        }
        if constexpr (kThreads > 128)
          Base::template epilogue_sync<kThreads>();
        else if (rr > 0 || round > 0)
          Base::template epilogue_sync<kThreads>();
        stage_round<kBlocks, kRoundV>(v, stage, staged, t.thread_idx);
        copy_out(r, stage, s, t, c0, rr * kStageM);
      }
    }
    // Tensor stores: the last round's stores have read the buffer before the kernel may end (or the next tile's
    // epilogue begins).
    if constexpr (kTensorStore) {
      if (t.thread_idx == 0) Base::wait_copies_read();
    }
  }

  Params params;
  int map_group_ = -1;  // kTensorStore: the group this CTA's tensor maps point at
};

}  // namespace moerail::experts
