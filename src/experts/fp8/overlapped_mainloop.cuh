// src/experts/fp8/overlapped_mainloop.cuh — the consumer side of the FP8 blockwise-scaled GEMMs, rewritten so that
// the promotion of one K block runs while the tensor cores work on the next. Included only by gemm_fp8_sm90.cuh.
//
// Blockwise scaling (1x128 A scales, 128x128 or 1x128 B scales) means the wgmma result of every 128-wide K block has
// to be multiplied by its scales and added into the fp32 sum on the CUDA cores ("promotion"). CUTLASS 4.2's SM90
// ptr-array blockwise mainloop issues one K block's wgmmas into a temporary accumulator, waits for all of them
// (wgmma.wait_group 0) and only then promotes, so each warpgroup's tensor-core pipe stands idle for the promotion and
// for the drain of its wgmma queue on every K block.
//
// This mainloop keeps two temporary accumulators and one K block of wgmmas always queued: it issues block k+1 into
// one temporary, loads block k's scales from shared memory (the weight gradient's per-column B scales after the
// wait, below), waits until only that batch is outstanding (wgmma.wait_group 1), promotes block k from the other,
// handing block k's shared-memory stage back to the producer as soon as every warp of the warpgroup has its scales
// in registers. Per K block the arithmetic is CUTLASS's (the scale product, then one fused multiply-add into the sum
// per element), only its place in time changes. ptxas must see the same straight-line sequence on every path with a
// batch in flight (it serializes the wgmmas otherwise, and says so: warning C7514), hence the loop's shape. Cost: a
// third 64-register fragment per thread for a 64x128 warpgroup tile (the 232-240 registers the warp-specialized
// kernels give a consumer warpgroup hold it), one more stage held by the consumers at a time, and a 128-thread
// barrier per K block.
//
// Everything else (the TMA and scale producers, the pipeline, the parameters, the tensor maps) is the CUTLASS
// collective this one derives from: the kernel calls mma() and mma_tail() on the type it is given, which resolves to
// the ones below.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace moerail::experts {

template <class Base>
struct OverlappedPromotionMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  using ElementScale = typename Base::ElementBlockScale;
  static constexpr int kScaleMsPerTile = Base::ScaleMsPerTile;
  static constexpr int kScaleNsPerTile = Base::ScaleNsPerTile;
  // One promotion per K tile: the scale block spans exactly the tile's K (128).
  static_assert(Base::ScaleGranularityK == cute::size<2>(TileShape{}), "one scale block per K tile");
  static_assert(Base::DispatchPolicy::Stages >= 3, "two K tiles are held by the consumers at a time");
  // A's scales are 1x128 (one per row): several per tile along M; B's one per tile (128x128 weight blocks) or one per
  // column (1x128, the weight gradient).
  static_assert(kScaleMsPerTile > 1, "A scaled per row");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulators live in registers");

    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    // The scale tiles viewed with the accumulator's (M, N) shape: A's scales broadcast along N, B's along M.
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    const Layout warp_group_layout = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_layout(warp_group));
    Tensor tCsA = thread_mma.partition_A(sA);                     // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCsB = thread_mma.partition_B(sB);                     // (MMA,MMA_N,MMA_K,PIPE)
    Tensor tCrA = thread_mma.make_fragment_A(tCsA);               // descriptors
    Tensor tCrB = thread_mma.make_fragment_B(tCsB);
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA,MMA_M,MMA_N,(MMA_K,PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCrSFA = make_tensor_like<ElementScale>(tCsSFA(_, _, _, _0{}));  // (MMA,MMA_M,MMA_N), stride 0 along N
    Tensor tCrSFB = make_tensor_like<ElementScale>(tCsSFB(_, _, _, _0{}));  // stride 0 along M
    CUTE_STATIC_ASSERT_V(size<1>(tCsA) == size<1>(accum));
    CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<2>(accum));
    CUTE_STATIC_ASSERT_V(size<2>(tCsA) == size<2>(tCsB));

    Tensor block0 = make_fragment_like(accum);  // the two per-K-block wgmma results
    Tensor block1 = make_fragment_like(accum);
    clear(accum);
    warpgroup_fence_operand(accum);
    if (k_tile_count <= 0) return;

    // One K tile's wgmmas into `block`, as one committed batch, the accumulator zeroed by the first.
    auto issue = [&](auto& block, int stage) {
      warpgroup_fence_operand(block);
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < size<2>(tCrA); ++k) {
        cute::gemm(tiled_mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), block);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(block);
    };
    // A stage's scales into registers, issued before the wait for the block's wgmmas so that the shared-memory
    // loads' latency passes under that wait instead of stalling the multiplies after it. B's 1x128 scales of the
    // weight gradient (one per column: 32 registers) are loaded after the wait instead: held across it they spill.
    auto load_scales = [&](PipelineState stage) {
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage.index())), tCrSFA);
      if constexpr (kScaleNsPerTile == 1) copy(tCsSFB(_, _, _, make_coord(_0{}, stage.index())), tCrSFB);
    };
    // Once `block`'s wgmmas are complete and its scales are in registers: its stage handed back to the producer,
    // then accum += block * (A scale * B scale).
    auto promote = [&](auto& block, PipelineState stage) {
      warpgroup_fence_operand(block);
      warpgroup_fence_operand(accum);
      // The pipeline's release is one thread's arrive on behalf of the whole warpgroup (per destination CTA of the
      // cluster), and the producer refills the stage's scales once it sees it: every warp of the warpgroup must have
      // read them first. A barrier of this warpgroup's 128 threads (an id of its own past CUTLASS's reserved ones)
      // orders all four warps' loads before the arrive; wgmma completion alone does not (the other warps may not
      // have reached their loads of this stage yet).
      if constexpr (kScaleNsPerTile > 1) copy(tCsSFB(_, _, _, make_coord(_0{}, stage.index())), tCrSFB);
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, cutlass::canonical_warp_group_idx());
      pipeline.consumer_release(stage);
      if constexpr (kScaleNsPerTile == 1) {  // one B scale per tile: fold it into the row scales
        const ElementScale sb = tCrSFB(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(tCrSFA)); ++i) filter_zeros(tCrSFA)(i) = filter_zeros(tCrSFA)(i) * sb;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += block(i) * tCrSFA(i);
      } else {  // 1x128 scales on B as well (the weight gradient): a product of two scales per element
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += block(i) * tCrSFA(i) * tCrSFB(i);
      }
      warpgroup_fence_operand(accum);
    };

    auto token = pipeline.consumer_try_wait(smem_pipe_read);
    pipeline.consumer_wait(smem_pipe_read, token);
    issue(block0, smem_pipe_read.index());
    PipelineState in_flight = smem_pipe_read;  // the stage whose wgmmas were issued last
    ++smem_pipe_read;
    int left = k_tile_count - 1;               // K tiles not issued yet

    // Issue the next K tile into `next`, then promote `done` (issued before it) while `next` runs, and free its stage.
    auto advance = [&](auto& done, auto& next) {
      token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, token);
      issue(next, smem_pipe_read.index());
      load_scales(in_flight);
      warpgroup_wait<1>();
      promote(done, in_flight);
      in_flight = smem_pipe_read;
      ++smem_pipe_read;
      --left;
    };
    // The last K tile: nothing to overlap its promotion with.
    auto finish = [&](auto& done) {
      load_scales(in_flight);
      warpgroup_wait<0>();
      promote(done, in_flight);
    };
    // Registers cannot be indexed at run time: two K tiles per iteration, the temporaries' roles swapped, and the
    // same straight-line sequence in every iteration (one batch in flight at the back edge, as at the loop entry).
    CUTLASS_PRAGMA_NO_UNROLL
    while (left >= 2) {
      advance(block0, block1);
      advance(block1, block0);
    }
    if (left == 1) {
      advance(block0, block1);
      finish(block1);
    } else {
      finish(block0);
    }
    warpgroup_fence_operand(accum);
  }

  // mma() released every stage it read: nothing is left for the tail.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {}
};

}  // namespace moerail::experts
