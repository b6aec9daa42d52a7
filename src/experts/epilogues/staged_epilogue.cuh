// src/experts/epilogues/staged_epilogue.cuh — what the expert GEMMs' own operator-style epilogues share (GluEpilogueArray,
// glu_epilogue.cuh; ContigRowEpilogue, contig_gemm_sm90.cuh): the members CUTLASS's Sm90TmaWarpSpecializedAdapter
// asks of an epilogue without workspace, source C or shared storage of CUTLASS's, and the steps that hand a tile
// staged in shared memory to the bulk-copy engine, one row per thread of the consumer warpgroup.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "cutlass/cutlass.h"
#include "cutlass/arch/barrier.h"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"

namespace moerail::experts {

template <class StrideD_, class Schedule>
class StagedEpilogueBase {
 public:
  using EpilogueSchedule = Schedule;
  using DispatchPolicy = Schedule;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementOutput = cutlass::bfloat16_t;
  using ElementC = void;
  using ElementD = cutlass::bfloat16_t;
  using StrideC = StrideD_;
  using StrideD = StrideD_;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  // Named by CUTLASS's device adapter only; never run.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementD, 1, float, float>;
  // The staging buffer is a static __shared__ variable of the derived operator(), not SharedStorage: the adapter
  // allocates SharedStorage twice (as its tensors and as its tensormaps). The mainloop's stage count leaves room.
  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  // Params are the Arguments (the derived class's); no workspace.
  template <class ProblemShape, class Arguments>
  static constexpr Arguments to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int = 0) {
    return 0;
  }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_source_needed() { return false; }

 protected:
  // Waits for the warpgroup's other 127 threads (a named barrier per consumer warpgroup: FirstUserBarrier + 1 or 2).
  CUTLASS_DEVICE static void warpgroup_sync() {
    const int wg = int(threadIdx.x) / 128;  // consumer warpgroup (1 or 2)
    asm volatile("bar.sync %0, 128;" ::"r"(int(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier) + wg)
                 : "memory");
  }

  // Waits for the other threads of a tile's epilogue: kThreads = 128, the warpgroup's (ping-pong: one warpgroup per
  // tile), or 256, both consumer warpgroups' (cooperative: one named barrier of 256 threads).
  template <int kThreads = 128>
  CUTLASS_DEVICE static void epilogue_sync() {
    static_assert(kThreads == 128 || kThreads == 256, "one or both consumer warpgroups");
    if constexpr (kThreads == 128) {
      warpgroup_sync();
    } else {
      asm volatile("bar.sync %0, 256;" ::"r"(int(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier)) : "memory");
    }
  }

  // Every thread of the epilogue has written its values into the staging buffer: make them visible to the copy
  // engine, then epilogue_sync().
  template <int kThreads = 128>
  CUTLASS_DEVICE static void staged_tile_ready() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    epilogue_sync<kThreads>();
  }

  // One staged row to global memory (bytes a multiple of 16, both addresses 16-byte aligned); commit_copies()
  // closes this thread's group of them.
  CUTLASS_DEVICE static void bulk_copy(void* global, const void* shared, unsigned bytes) {
    const unsigned s = unsigned(__cvta_generic_to_shared(shared));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(global), "r"(s), "r"(bytes)
                 : "memory");
  }
  // The same, adding the staged bf16 row to the one in global memory (each element bf16(old + staged), rounded to
  // nearest even, subnormals kept): the copy engine's reduce, one read-modify-write in L2 per element.
  CUTLASS_DEVICE static void bulk_add_bf16(void* global, const void* shared, unsigned bytes) {
    const unsigned s = unsigned(__cvta_generic_to_shared(shared));
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;" ::"l"(global),
                 "r"(s), "r"(bytes)
                 : "memory");
  }
  CUTLASS_DEVICE static void commit_copies() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

  // This thread's copies have read shared memory. Ping-pong: the other warpgroup's epilogue, the next to write the
  // buffer, starts when all 128 threads of this one have arrived at the kernel's ordering barrier, so each copying
  // thread's own wait is enough. Cooperative: an epilogue_sync<256>() after the waits frees the buffer.
  CUTLASS_DEVICE static void wait_copies_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
};

}  // namespace moerail::experts
