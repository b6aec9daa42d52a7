// src/experts/contig/contig_gemm_sm90.cuh — the CUTLASS side of contig_gemm.h: CUTLASS 4.2's SM90 ping-pong GEMM kernel
// (TMA loads, warp-specialized producer and consumer warpgroups, wgmma) with three pieces of our own plugged into it:
//   ContigTileScheduler  hands out 128x128 tiles of the M tiles the device table holds (read once per CTA), in
//                        bands of at most 8 M tiles of one expert across all N tiles;
//   ContigMainloop       CUTLASS's TMA mainloop whose B descriptor spans all experts ([N, K, groups]) and whose
//                        loads take A from the tile's first row (tile_row) and B from its expert (tile_group);
//   ContigRowEpilogue    D = bf16(acc) for the tile's own rows (tile_rows) only, staged in shared memory and copied
//                        out row by row with the bulk-copy engine (or FC1's GLU epilogue, glu_epilogue.cuh, or
//                        FC2's dgrad with the activation backward, act_bwd_epilogue.cuh).
// Included only by the gemm_<layout>_ping128x128_contig*.cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string_view>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/kernel_hardware_info.h"

#include "core/cuda_check.h"
#include "core/env.h"
#include "experts/epilogues/act_bwd_epilogue.cuh"
#include "experts/contig/contig_gemm.h"
#include "experts/cutlass_hw.cuh"
#include "experts/epilogues/glu_epilogue.cuh"
#include "experts/grouped/grouped_gemm.h"  // name_of
#include "experts/epilogues/staged_epilogue.cuh"
#include "moerail/error.h"

namespace moerail::experts {

// The epilogue of a contiguous GEMM: D = bf16(acc), FC1's with the GLU activation, FC2's dgrad with the activation
// backward.
enum class ContigEpilogue { Row, Glu, ActBwd };

// Tag that selects ContigTileScheduler in CUTLASS's kernel (see the TileSchedulerSelector specialization below).
struct ContigScheduler {};

// The dynamic walk's shared state: a ring of work units published by the leader CTA of a cluster to every CTA of
// it. Slot s holds one unit; full[s] completes when it has landed (the leader's arrival and the 4 bytes of its
// st.async), empty[s] (used in the leader CTA only) when every reader of it is done.
inline constexpr int kContigWalkRing = 8;
struct ContigWalkShared {
  alignas(8) std::uint64_t full[kContigWalkRing];
  alignas(8) std::uint64_t empty[kContigWalkRing];
  int unit[kContigWalkRing];
};

// Static shared memory of the kernel (one instance per kernel, as the epilogues' staging tiles).
CUTLASS_DEVICE ContigWalkShared& contig_walk_shared() {
  __shared__ ContigWalkShared walk;
  return walk;
}

// Readers of one published unit: the four warps of the consumer warpgroup that computes it, in every CTA of the
// cluster (of kClusterSize CTAs), and the producer warps of the CTAs other than the leader (the leader's producer
// publishes it).
template <int kClusterSize>
inline constexpr int kContigWalkReaders = 4 * kClusterSize + (kClusterSize - 1);

// Initializes the ring's barriers. It takes the place of the scheduler's (empty) pipeline, which CUTLASS's kernel
// constructs on every thread before its cluster-wide barrier, so the initialization is visible to the whole cluster
// before any CTA walks.
template <int kClusterSize>
struct ContigWalkInit {
  static constexpr std::uint32_t Stages = 0;
  using PipelineState = cutlass::PipelineState<0>;
  struct Params {};
  struct SharedStorage {};

  CUTLASS_DEVICE ContigWalkInit(SharedStorage&&, Params const&) { init(); }
  CUTLASS_DEVICE ContigWalkInit(SharedStorage&, Params const&) { init(); }

 private:
  CUTLASS_DEVICE static void init() {
    ContigWalkShared& w = contig_walk_shared();
    if (threadIdx.x == 0) {
      for (int s = 0; s < kContigWalkRing; ++s) {
        cutlass::arch::ClusterTransactionBarrier::init(&w.full[s], 1);
        cutlass::arch::ClusterBarrier::init(&w.empty[s], kContigWalkReaders<kClusterSize>);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
};

// The walk over a launch's work units (one unit per cluster at a time) that the contiguous GEMMs' schedulers follow
// (ContigTileScheduler below, and the contiguous weight gradient's). Each CTA's roles walk the same sequence of
// tickets: the producer warp all of them, consumer warpgroup 0 the even ones and 1 the odd ones (the ping-pong
// kernel's alternation). Tickets 0 and 1 are static (units c and c + clusters for cluster c).
//
// Static walk (no counter): cluster c takes units c, c + clusters, ... Over a launch's rounds the clusters drift
// apart, and the reads of a tile by the clusters sharing it no longer meet in L2 (docs/experts.md).
// Dynamic walk (a counter given): ticket 2 and later take the next unit from the device counter, in the order the
// clusters ask, so that a cluster that finished early takes the next unit and the clusters at work hold consecutive
// units however their times drift apart. The leader CTA's producer warp publishes each unit to the ring of every
// CTA of its cluster a ticket ahead of its own walk (producer_step); the other roles read it there. The first unit
// past the end ends the walk; the next ticket is published as past the end too, for the consumer warpgroup of the
// other parity. The last cluster to finish resets the counter for the next launch. Which CTA computes a tile does
// not change its result.
//
// For CUTLASS's ping-pong kernel, whose roles that walk are its producer warp and two consumer warpgroups (its
// epilogue-load warp walks only for epilogues with a source, and ours have none). 32-bit on purpose: the walk lives
// in the registers of the consumer warpgroups beside their accumulators; 64-bit counters (and a 64-bit division per
// tile) measured slower on short experts.
template <int kClusterSize>
class ContigUnitWalk {
 public:
  // Ticket 0 of this CTA's cluster, over `units` work units (the grid's clusters, 1-D, walk them); `counter` ([2],
  // zero before the launch) walks dynamically, nullptr statically.
  CUTLASS_DEVICE void start(int units, int* counter) {
    const dim3 id = cute::cluster_id_in_grid(), dims = cute::cluster_grid_dims();
    unit_ = int(id.x + id.y * dims.x);  // the grid's clusters are one row or one column
    clusters_ = int(dims.x * dims.y);
    units_ = units;
    walk_ = counter;
    leader_ = cute::block_rank_in_cluster() == 0;
  }

  CUTLASS_DEVICE int unit() const { return unit_; }
  CUTLASS_DEVICE bool done() const { return unit_ >= units_; }

  CUTLASS_DEVICE void advance(int count) {
    ticket_ += count;
    if (walk_ == nullptr) {
      unit_ += count * clusters_;
    } else if (cutlass::canonical_warp_group_idx() == 0) {
      producer_step();
    } else if (ticket_ < 2) {
      unit_ += count * clusters_;
    } else {
      unit_ = read_ticket(ticket_);
    }
  }

  // Whether the walk ends `count` tickets on; only the static walk knows ahead.
  CUTLASS_DEVICE bool ends_within(int count) const {
    return walk_ == nullptr && unit_ + count * clusters_ >= units_;
  }

 private:
  static constexpr int kPastTheEnd = 0x7fffffff;

  // The producer warp moves to ticket_ (>= 1; every lane calls it). The leader's publishes each ticket one ahead
  // (ticket t + 1 when it moves to t), so that the other CTA's producer and the consumer warpgroups find it there,
  // and takes each unit from the counter one ticket before that (the atomic's latency hidden behind a tile's loads).
  CUTLASS_DEVICE void producer_step() {
    const bool lane0 = cutlass::canonical_lane_idx() == 0;  // the lane the others read next_ from (__shfl_sync)
    if (!leader_) {
      unit_ = ticket_ == 1 ? unit_ + clusters_ : read_ticket(ticket_);
      if (unit_ >= units_) read_ticket(ticket_ + 1);  // the walk ends: the last ticket published
      return;
    }
    int next = 0;  // lane 0: the unit published for ticket_ + 1
    if (ticket_ == 1) {
      unit_ += clusters_;
      if (lane0) {
        next = kPastTheEnd;
        if (unit_ < units_) {
          next = 2 * clusters_ + atomicAdd(walk_, 1);
          pending_ = 2 * clusters_ + atomicAdd(walk_, 1);
        }
      }
    } else {
      unit_ = __shfl_sync(0xffffffffu, next_, 0);
      if (lane0) {
        next = unit_ < units_ ? pending_ : kPastTheEnd;
        if (next < units_) pending_ = 2 * clusters_ + atomicAdd(walk_, 1);
      }
    }
    if (lane0) {
      publish(ticket_ + 1, next);
      next_ = next;
      if (unit_ >= units_) {  // the walk ends here; ticket_ + 1 (past the end too) is the last one published
        drain(ticket_ + 1);
        reset_counters();
      }
    }
    __syncwarp();
  }

  // Leader CTA, one thread: unit `value` into ticket t's slot of every CTA of the cluster, once its readers of
  // ticket t - kContigWalkRing are done.
  CUTLASS_DEVICE static void publish(int t, int value) {
    ContigWalkShared& w = contig_walk_shared();
    const int k = t - 2, s = k % kContigWalkRing, uses = k / kContigWalkRing;
    if (uses > 0) cutlass::arch::ClusterBarrier::wait(&w.empty[s], uint32_t(uses - 1) & 1u);
    const std::uint32_t unit_addr = cute::cast_smem_ptr_to_uint(&w.unit[s]);
    const std::uint32_t full_addr = cute::cast_smem_ptr_to_uint(&w.full[s]);
    for (int cta = 0; cta < kClusterSize; ++cta) {
      asm volatile(
          "{\n\t"
          ".reg .b32 dst, bar;\n\t"
          "mapa.shared::cluster.u32 dst, %0, %2;\n\t"
          "mapa.shared::cluster.u32 bar, %1, %2;\n\t"
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [dst], %3, [bar];\n\t"
          "}"
          :
          : "r"(unit_addr), "r"(full_addr), "r"(cta), "r"(value)
          : "memory");
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&w.full[s], 4u, uint32_t(cta), 1u);
    }
  }

  // Every lane of a warp: the unit of ticket t (>= 2) from this CTA's ring; then the warp's one arrival on the
  // slot's empty barrier in the leader CTA.
  CUTLASS_DEVICE static int read_ticket(int t) {
    ContigWalkShared& w = contig_walk_shared();
    const int k = t - 2, s = k % kContigWalkRing;
    cutlass::arch::ClusterBarrier::wait(&w.full[s], uint32_t(k / kContigWalkRing) & 1u);
    asm volatile("" ::: "memory");
    const int unit = *reinterpret_cast<volatile const int*>(&w.unit[s]);
    __syncwarp();
    cutlass::arch::ClusterBarrier::arrive(&w.empty[s], 0u, uint32_t(cute::elect_one_sync()));
    return unit;
  }

  // Leader CTA, one thread, at the end: wait until every reader of the last ticket of each slot (up to `last`) is
  // done, so that no CTA of the cluster arrives on this CTA's barriers after it exits.
  CUTLASS_DEVICE static void drain(int last) {
    ContigWalkShared& w = contig_walk_shared();
    const int k_last = last - 2;
    for (int k = k_last - kContigWalkRing + 1 > 0 ? k_last - kContigWalkRing + 1 : 0; k <= k_last; ++k)
      cutlass::arch::ClusterBarrier::wait(&w.empty[k % kContigWalkRing], uint32_t(k / kContigWalkRing) & 1u);
  }

  // The clusters whose ticket 1 holds a unit take units from the counter; the last of them to finish zeroes the
  // counters for the next launch. (The others never touch them.)
  CUTLASS_DEVICE void reset_counters() const {
    const dim3 id = cute::cluster_id_in_grid(), dims = cute::cluster_grid_dims();
    if (int(id.x + id.y * dims.x) + clusters_ >= units_) return;
    const int takers = min(clusters_, units_ - clusters_);
    __threadfence();
    if (atomicAdd(walk_ + 1, 1) == takers - 1) {
      __threadfence();  // the other takers' last atomics on walk_[0] (each fenced before its count) come first
      walk_[0] = 0;
      walk_[1] = 0;
      __threadfence();
    }
  }

  int* walk_ = nullptr;
  int unit_ = 0, units_ = 0, clusters_ = 1;
  int ticket_ = 0;   // this role's place in the walk
  int next_ = 0;     // leader's producer, lane 0: the unit published for the next ticket
  int pending_ = 0;  // leader's producer, lane 0: the unit to publish after it
  bool leader_ = true;
};

// The types both contiguous schedulers (below, and the weight gradient's) put in CUTLASS's kernel beside its
// persistent scheduler's: the ring's barrier initialization in place of the scheduler's pipeline, and no shared
// storage of its own (the ring is static shared memory).
template <int kClusterSize>
class ContigWalkSchedulerBase : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
 public:
  using Pipeline = ContigWalkInit<kClusterSize>;
  using PipelineStorage = typename Pipeline::SharedStorage;
  class SharedStorage {
   public:
    CUTLASS_DEVICE PipelineStorage pipeline() { return PipelineStorage{}; }
    CUTLASS_DEVICE ThrottlePipelineStorage throttle_pipeline() { return ThrottlePipelineStorage{}; }
    CUTLASS_DEVICE CLCResponse* data() { return nullptr; }
  };
};

// Persistent scheduler over the M tiles of the device table. A work unit is one cluster of 1 x kClusterN tiles
// (CTAs paired along N share the multicast A tile). Units are numbered band by band: a band is at most 8 M tiles
// of one expert (tile_band, written by the setup kernel) by all N clusters, M fastest inside it, so the band of
// first tile f and height h holds units [f * n_clusters, (f + h) * n_clusters) and unit u lies in the band of
// tile u / n_clusters. Consecutive units share A tiles and one expert's B tiles, so the clusters working at once
// should hold consecutive units: with `walk` given, the units are walked dynamically (ContigUnitWalk).
//
// Everything but the work walk (types, workspace, grid arguments) is CUTLASS's persistent scheduler's. For
// CUTLASS's ping-pong kernel only: the members it calls are the ones overridden here (the cooperative kernel also
// calls fetch_next_work, which is the base's and would run on its uninitialized state). The device table is read
// when the scheduler is built, before the kernel's wait on a preceding grid: launches must not use programmatic
// dependent launch (Sm90ContigGemm::run does not).
template <int kClusterN>
class ContigTileScheduler : public ContigWalkSchedulerBase<kClusterN> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using WorkTileInfo = typename Base::WorkTileInfo;

 public:
  struct Arguments : Base::Arguments {
    const int* num_tiles = nullptr;  // device: M tiles to compute
    const int* tile_band = nullptr;  // device: [M tiles] the band (contig_band: first tile << 4 | height)
    int* walk = nullptr;             // device: [2] the dynamic walk's counters, zero between launches; null: static
  };
  struct Params : Base::Params {
    const int* num_tiles = nullptr;
    const int* tile_band = nullptr;
    int* walk = nullptr;
    int n_clusters = 0;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL shape, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw, Arguments const& args,
                                        void* = nullptr, uint32_t = 1, uint32_t = 1) {
    static_assert(cute::size<0>(ClusterShape{}) == 1 && cute::size<1>(ClusterShape{}) == kClusterN,
                  "the contiguous GEMMs pair CTAs along N only");
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(shape, tile, cluster, hw, args);
    const int n_tiles = (int(cute::get<1>(shape)) + int(cute::size<1>(tile)) - 1) / int(cute::size<1>(tile));
    p.num_tiles = args.num_tiles;
    p.tile_band = args.tile_band;
    p.walk = args.walk;
    p.n_clusters = (n_tiles + kClusterN - 1) / kClusterN;
    return p;
  }

  static bool can_implement(Arguments const& args) { return args.num_tiles != nullptr && args.tile_band != nullptr; }

  // One cluster per resident cluster slot: grid (1, kClusterN * clusters), clusters of (1, kClusterN).
  template <class ProblemShape, class TileShape, class ClusterShape>
  static dim3 get_grid_shape(Base::Params const&, ProblemShape, TileShape, ClusterShape,
                             cutlass::KernelHardwareInfo hw, Base::Arguments = {}, bool = true) {
    const int clusters = hw.max_active_clusters > 0 ? hw.max_active_clusters : hw.sm_count / kClusterN;
    return dim3(1, unsigned(kClusterN * (clusters > 0 ? clusters : 1)), 1);
  }

  CUTLASS_HOST_DEVICE ContigTileScheduler() {}

  CUTLASS_DEVICE explicit ContigTileScheduler(Params const& p) : tile_band_(p.tile_band), n_clusters_(p.n_clusters) {
#if defined(__CUDA_ARCH__)
    walk_.start(*p.num_tiles * n_clusters_, p.walk);  // < 2^31 units: checked on the host (Sm90ContigGemm::run)
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    if (walk_.done()) return WorkTileInfo::invalid_work_tile();
    const int unit = walk_.unit();
    const int band = tile_band_[unit / n_clusters_];
    const int first = contig_band_first(band), height = contig_band_height(band);
    const int in_band = unit - first * n_clusters_;
    const int n_cluster = in_band / height;
    const int m = first + (in_band - n_cluster * height);
    const int n = n_cluster * kClusterN + int(cute::block_id_in_cluster().y);
    return {m, n, 0, true};
  }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) { walk_.advance(int(count)); }

  // Only CUTLASS_ENABLE_GDC_FOR_SM90 builds call it (as a hint).
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t count = 1) const { return walk_.ends_within(int(count)); }

 private:
  const int* tile_band_ = nullptr;
  int n_clusters_ = 0;
  ContigUnitWalk<kClusterN> walk_;
};

// CUTLASS's SM90 TMA mainloop (`Base`) over grouped B: B's descriptor spans [N, K, groups] (the L stride of dB is
// one expert's weights), and a tile at M index m loads B of expert tile_group[m]; A keeps L = 1.
template <class Base>
struct ContigMainloop : Base {
  using typename Base::GmemTiledCopyB;
  using typename Base::InternalElementB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;

  struct Arguments : Base::Arguments {
    int groups = 1;
    const int* tile_group = nullptr;  // device: [M tiles]
    const int* tile_row = nullptr;    // device: [M tiles]
  };
  struct Params : Base::Params {
    int groups = 1;
    const int* tile_group = nullptr;
    const int* tile_row = nullptr;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(shape, args, workspace);
    const auto [M, N, K, L] = cute::append<4>(shape, 1);
    (void)M;
    (void)L;
    auto b = cute::make_tensor(reinterpret_cast<InternalElementB const*>(args.ptr_B),
                               cute::make_layout(cute::make_shape(N, K, args.groups), args.dB));
    p.tma_load_b = cute::make_tma_copy_B_sm90(GmemTiledCopyB{}, b, SmemLayoutB{}(cute::_, cute::_, cute::Int<0>{}),
                                              TileShape{}, ClusterShape{});
    p.groups = args.groups;
    p.tile_group = args.tile_group;
    p.tile_row = args.tile_row;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    return args.groups >= 1 && args.tile_group != nullptr && args.tile_row != nullptr &&
           Base::can_implement(shape, args);
  }

  // (BLK_M, BLK_K, m, k, l) tiles of A as CUTLASS's, and (BLK_N, BLK_K, n, k, group) tiles of B over all groups.
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& shape, Params const& p) const {
    using cute::_;
    using X = cute::Underscore;
    const auto [M, N, K, L] = shape;
    auto mA = p.tma_load_a.get_tma_tensor(cute::make_shape(M, K, L));
    auto mB = p.tma_load_b.get_tma_tensor(cute::make_shape(N, K, p.groups));
    auto gA = cute::local_tile(mA, TileShape{}, cute::make_coord(_, _, _), cute::Step<cute::_1, X, cute::_1>{});
    auto gB = cute::local_tile(mB, TileShape{}, cute::make_coord(_, _, _), cute::Step<X, cute::_1, cute::_1>{});
    return cute::make_tuple(gA, gB);
  }

  // CUTLASS's producer loop on A's tiles shifted to start at the tile's first row, and on B's tiles shifted to the
  // tile's expert (the kernel passes l = 0). TMA coordinates are per element, so any first row works; rows past the
  // tile's own (the next expert's, or past the buffer: zeros) are loaded but never stored.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    const int t = int(cute::get<0>(blk_coord));
    const int group = p.tile_group[t];
    const int shift = p.tile_row[t] - t * int(cute::size<0>(TileShape{}));  // rows from tile t's default place
    auto gA = cute::domain_offset(cute::make_coord(shift, 0, 0, 0, 0), cute::get<0>(load_inputs));
    auto gB = cute::domain_offset(cute::make_coord(0, 0, 0, 0, group), cute::get<1>(load_inputs));
    Base::load(p, pipeline, smem_pipe_write, cute::make_tuple(gA, gB), blk_coord, k_tile_iter, k_tile_count,
               thread_idx, block_rank_in_cluster, shared_tensors);
  }
};

// Calls f(row, col, a0, a1) for every pair of this thread's accumulators of a wgmma tile: (row, col) and
// (row, col + 1) in the tile (col even) hold a0 and a1. Unrolled: the coordinates of a pair depend on the thread only.
template <class BlockShapeMNK, class FrgEngine, class FrgLayout, class TiledMma, class F>
CUTLASS_DEVICE void for_each_accumulator_pair(cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma,
                                              BlockShapeMNK blk_shape_MNK, int thread_idx, F&& f) {
  using namespace cute;
  static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
  static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "expected the wgmma fragment ((2,2,V),M,N)");
  static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "expected the wgmma fragment");
  constexpr int kV = size<0, 2>(FrgLayout{});
  constexpr int kMmaM = size<1>(FrgLayout{});
  constexpr int kMmaN = size<2>(FrgLayout{});
  auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
  Tensor coord = thr_mma.partition_C(make_identity_tensor(take<0, 2>(blk_shape_MNK)));
  CUTLASS_PRAGMA_UNROLL
  for (int nn = 0; nn < kMmaN; ++nn)
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1)
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kV; ++j) {
          const auto rc = coord(make_coord(make_coord(0, v1, j), mm, nn));  // the pair's first (even) column
          f(int(get<0>(rc)), int(get<1>(rc)), acc(make_coord(make_coord(0, v1, j), mm, nn)),
            acc(make_coord(make_coord(1, v1, j), mm, nn)));
        }
}

// Every thread of a consumer warpgroup writes its accumulators of a 128x128 tile as bf16 into the staging tile `d`
// (rows of kPitch elements; two bf16 per 4-byte store, round to nearest). The caller then makes the tile ready
// (StagedEpilogueBase::staged_tile_ready) and copies its rows out.
template <int kPitch, class BlockShapeMNK, class FrgEngine, class FrgLayout, class TiledMma>
CUTLASS_DEVICE void stage_tile_bf16(cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma,
                                    BlockShapeMNK blk_shape_MNK, int thread_idx, __nv_bfloat16* d) {
  static_assert(cute::size<0>(BlockShapeMNK{}) == kContigTileM && cute::size<1>(BlockShapeMNK{}) == 128,
                "the staging buffers hold 128x128 tiles");
  for_each_accumulator_pair(acc, tiled_mma, blk_shape_MNK, thread_idx, [&](int row, int col, float a0, float a1) {
    *reinterpret_cast<__nv_bfloat162*>(d + row * kPitch + col) = __floats2bfloat162_rn(a0, a1);
  });
}

// The contiguous GEMMs' epilogue, operator-style (CUTLASS's Sm90TmaWarpSpecializedAdapter wraps it for the kernel):
// D = bf16(acc) for the rows of the tile's expert only. Tile t covers rows [tile_row[t], tile_row[t] + tile_rows[t]);
// the rows after a short tile belong to the next expert's tile and are not written. Every thread writes its
// accumulators into the staging tile (two bf16 per 4-byte store, rows padded by 16 bytes), then thread i of the
// warpgroup copies row i to global memory with one cp.async.bulk, as the fused activation epilogue does
// (glu_epilogue.cuh); the copies run beside the other warpgroup's mainloop. bf16(acc) rounds to nearest, as CUTLASS's
// LinearCombination with alpha 1 and no source does: the results equal the grouped GEMM's bit for bit.
template <class StrideD_>
class ContigRowEpilogue : public StagedEpilogueBase<StrideD_, cutlass::epilogue::NoSmemWarpSpecialized> {
  using Base = StagedEpilogueBase<StrideD_, cutlass::epilogue::NoSmemWarpSpecialized>;

 public:
  using typename Base::ElementD;
  static constexpr int kTileM = kContigTileM, kTileN = 128;
  static constexpr int kPitch = kTileN + 8;  // bf16 elements per staged row
  // A static __shared__ variable of operator() (see StagedEpilogueBase); the mainloop's stage count leaves room for
  // it (kEpilogueSmem below).
  struct Staging {
    alignas(128) __nv_bfloat16 d[kTileM * kPitch];
  };
  static constexpr int kStagingBytes = int(sizeof(Staging));

  struct Arguments {
    ElementD* ptr_D = nullptr;
    std::int64_t ldd = 0;             // elements
    const int* tile_row = nullptr;    // device: [M tiles]
    const int* tile_rows = nullptr;   // device: [M tiles]
  };
  using Params = Arguments;
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    const int N = int(cute::get<1>(shape));
    return args.ptr_D != nullptr && args.tile_row != nullptr && args.tile_rows != nullptr && args.ldd % 8 == 0 &&
           N % 8 == 0 && (reinterpret_cast<std::uintptr_t>(args.ptr_D) % 16) == 0;  // 16-byte row copies
  }

  CUTLASS_HOST_DEVICE explicit ContigRowEpilogue(Params const& p) : params(p) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    const int N = int(cute::get<1>(problem_shape_mnkl));
    const int t = int(cute::get<0>(blk_coord_mnkl));
    const int n0 = int(cute::get<1>(blk_coord_mnkl)) * kTileN;
    __shared__ Staging stage;
    stage_tile_bf16<kPitch>(acc, tiled_mma, blk_shape_MNK, thread_idx, stage.d);
    Base::staged_tile_ready();
    const int i = thread_idx % 128;
    if (i < params.tile_rows[t] && n0 < N) {
      const int cols = min(kTileN, N - n0);  // a multiple of 8: whole 16-byte pieces
      Base::bulk_copy(reinterpret_cast<__nv_bfloat16*>(params.ptr_D) +
                          (std::int64_t(params.tile_row[t]) + i) * params.ldd + n0,
                      stage.d + i * kPitch, unsigned(cols) * 2u);
      Base::commit_copies();
    }
    Base::wait_copies_read();
  }

 private:
  Params params;
};

}  // namespace moerail::experts

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t kStages>
struct TileSchedulerSelector<moerail::experts::ContigScheduler, arch::Sm90, TileShape, ClusterShape, kStages> {
  using Scheduler = moerail::experts::ContigTileScheduler<cute::size<1>(ClusterShape{})>;
};

}  // namespace cutlass::gemm::kernel::detail

namespace moerail::experts {

// The types of the contiguous GEMMs; the epilogue is the same for both layouts, so it is spelled out at namespace
// scope (outside any template: the host compiler then needs no `typename` in what nvcc hands it).
namespace contig {
using Element = cutlass::bfloat16_t;
using Accumulator = float;
inline constexpr int kAlignment = 16 / int(sizeof(Element));  // 16-byte TMA rows
using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
using Cluster = cute::Shape<cute::_1, cute::_2, cute::_1>;
using LayoutD = cutlass::layout::RowMajor;
using StrideD = cutlass::detail::TagToStrideC_t<LayoutD>;
// D = bf16(acc) (ContigRowEpilogue), FC1's with the activation (GluEpilogueArray in its contiguous form), or FC2's
// dgrad with the activation backward (ActBwdEpilogue)
template <ContigEpilogue kEpi>
using EpilogueOp = cute::conditional_t<
    kEpi == ContigEpilogue::Glu, GluEpilogueArray<StrideD, cute::size<1>(Tile{}), true>,
    cute::conditional_t<kEpi == ContigEpilogue::ActBwd, ActBwdEpilogue<StrideD>, ContigRowEpilogue<StrideD>>>;
template <ContigEpilogue kEpi>
using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<EpilogueOp<kEpi>>;
// the epilogue's staging tile and the scheduler's ring are static shared memory beside the kernel's
template <ContigEpilogue kEpi>
inline constexpr int kEpilogueSmem = int(sizeof(typename Epilogue<kEpi>::SharedStorage)) +
                                     EpilogueOp<kEpi>::kStagingBytes + int(sizeof(ContigWalkShared));

template <class LayoutB, ContigEpilogue kEpi>
using Mainloop = ContigMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Element, cutlass::layout::RowMajor, kAlignment,
    Element, LayoutB, kAlignment,
    Accumulator, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem<kEpi>>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp>;

template <class LayoutB, ContigEpilogue kEpi>
using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop<LayoutB, kEpi>,
                                                    Epilogue<kEpi>, ContigScheduler>;

// A packed CUTLASS stride with the leading dimension `ld` in whichever of its first two modes is dynamic, and `batch`
// in its L mode.
template <class Stride>
Stride make_stride_ld(std::int64_t ld, std::int64_t batch) {
  Stride s{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>>)
    cute::get<1>(s) = ld;
  else
    cute::get<0>(s) = ld;
  cute::get<2>(s) = batch;
  return s;
}
}  // namespace contig

template <GemmLayout kLayout, ContigEpilogue kEpi = ContigEpilogue::Row>
class Sm90ContigGemm final : public ContigGemm {
  static constexpr bool kGlu = kEpi == ContigEpilogue::Glu;
  static_assert(kLayout == GemmLayout::TN || kLayout == GemmLayout::NN, "ragged-M GEMMs only");
  static_assert(!kGlu || kLayout == GemmLayout::TN, "the activation is fused into FC1 (TN) only");
  static_assert(kEpi != ContigEpilogue::ActBwd || kLayout == GemmLayout::NN,
                "the activation backward is fused into FC2's dgrad (NN) only");
  using Element = contig::Element;
  using Cluster = contig::Cluster;
  using LayoutB = cute::conditional_t<kLayout == GemmLayout::TN, cutlass::layout::ColumnMajor,
                                      cutlass::layout::RowMajor>;
  using Kernel = contig::Kernel<LayoutB, kEpi>;
  static_assert(cute::is_base_of_v<cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                   typename Kernel::CollectiveMainloop::DispatchPolicy::Schedule>,
                "ContigTileScheduler overrides what the ping-pong kernel calls, no more");
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(Kernel::SharedStorageSize + contig::EpilogueOp<kEpi>::kStagingBytes + sizeof(ContigWalkShared) <=
                    cutlass::gemm::collective::detail::sm90_smem_capacity_bytes,
                "the mainloop's stages, the epilogue's static staging tile and the scheduler's ring must fit an SM's "
                "shared memory");
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;

 public:
  GemmLayout layout() const override { return kLayout; }

  void initialize(std::string_view what, int max_sms) override {
    const cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::SharedStorageSize);
    if (e != cudaSuccess)
      fail_with(ErrorCode::Cuda, what, ": setting the contiguous ", name_of(kLayout),
                " GEMM's shared memory failed: ", cudaGetErrorString(e));
    clusters_ = max_active_clusters_of<Kernel, Cluster>(max_sms);
    walk_ = env::contig_walk();
  }

  void set_glu_epilogue(const GluEpilogue& glu) override {
    if (!kGlu) fail_with(ErrorCode::Internal, "contiguous GEMM", "set_glu_epilogue on a kernel without the activation");
    glu_ = glu;
  }

  void run(const ContigCall& c, cudaStream_t stream, std::string_view what) override {
    typename Kernel::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {int(c.rows), int(c.n), int(c.k), 1};
    args.mainloop.ptr_A = static_cast<const Element*>(c.a);
    args.mainloop.dA = contig::make_stride_ld<StrideA>(c.lda, c.rows * c.lda);
    args.mainloop.ptr_B = static_cast<const Element*>(c.b);
    args.mainloop.dB = contig::make_stride_ld<StrideB>(c.ldb, c.b_group_stride);
    args.mainloop.groups = c.groups;
    args.mainloop.tile_group = c.tiles.tile_group;
    args.mainloop.tile_row = c.tiles.tile_row;
    if constexpr (kGlu) {
      args.epilogue.glu = glu_;
      args.epilogue.contig = {static_cast<Element*>(c.d), c.ldd, c.act, c.probs, c.tiles.tile_row, c.tiles.tile_rows,
                              c.tiles.tile_group};
    } else if constexpr (kEpi == ContigEpilogue::ActBwd) {
      args.epilogue.shape = c.act_shape;
      args.epilogue.h1 = static_cast<const __nv_bfloat16*>(c.h1);
      args.epilogue.d_h1 = static_cast<__nv_bfloat16*>(c.d_h1);
      args.epilogue.probs = c.probs;
      args.epilogue.dp_partial = c.dp_partial;
      args.epilogue.n_tiles = int((c.n + kContigTileM - 1) / kContigTileM);
      args.epilogue.tile_row = c.tiles.tile_row;
      args.epilogue.tile_rows = c.tiles.tile_rows;
    } else {
      args.epilogue.ptr_D = static_cast<Element*>(c.d);
      args.epilogue.ldd = c.ldd;
      args.epilogue.tile_row = c.tiles.tile_row;
      args.epilogue.tile_rows = c.tiles.tile_rows;
    }
    args.hw_info = hw_info(clusters_);
    args.scheduler.num_tiles = c.tiles.num_tiles;
    args.scheduler.tile_band = c.tiles.tile_band;
    const bool dynamic = walk_ == env::ContigWalk::Dynamic ||
                         (walk_ == env::ContigWalk::Auto && contig_walk_dynamic(kLayout, c.n, c.k));
    args.scheduler.walk = dynamic ? c.tiles.walk : nullptr;
    // The mainloop places tile t at row t * 128 before shifting it to its first row, in 32-bit coordinates.
    if (std::int64_t(c.tiles.max_tiles) * kContigTileM >= (1ll << 31))
      fail_with(ErrorCode::Unsupported, what, ": the contiguous ", name_of(kLayout), " GEMM's tile table (",
                c.tiles.max_tiles, " tiles of 128 rows) exceeds 32-bit row coordinates");
    // The scheduler counts work units in 32 bits, and steps past the last by at most two grids of clusters.
    const std::int64_t n_clusters = (c.n + 255) / 256;  // 128-wide tiles in clusters of 2
    if (std::int64_t(c.tiles.max_tiles) * n_clusters + 2 * std::int64_t(std::max(clusters_, 1024)) >= (1ll << 31))
      fail_with(ErrorCode::Unsupported, what, ": the contiguous ", name_of(kLayout), " GEMM's work units (",
                c.tiles.max_tiles, " M tiles x ", n_clusters, " N clusters) exceed 32 bits");
    if (Kernel::can_implement(args) == false)
      fail_with(ErrorCode::Unsupported, what, ": CUTLASS rejected the contiguous ", name_of(kLayout), " GEMM (rows ",
                c.rows, ", n ", c.n, ", k ", c.k, ", lda ", c.lda, ", ldb ", c.ldb, ", ldd ", c.ldd, ")");
    typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
    const cutlass::Status st = Gemm::run(params, stream);
    if (st != cutlass::Status::kSuccess)
      fail_with(ErrorCode::Cuda, what, ": contiguous ", name_of(kLayout), " GEMM launch failed: ",
                cutlassGetStatusString(st), " (", cudaGetErrorString(cudaGetLastError()), ")");
    MOERAIL_CUDA_CHECK_LAUNCH();
  }

 private:
  int clusters_ = 0;
  env::ContigWalk walk_ = env::ContigWalk::Auto;
  GluEpilogue glu_{};
};

}  // namespace moerail::experts
