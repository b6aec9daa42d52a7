// The contiguous weight gradient (contig_gemm.h, ContigWgrad): CUTLASS 4.2's SM90 ping-pong GEMM kernel over all
// experts' rows at once, with three pieces of our own plugged into it:
//   WgradTileScheduler  hands out the 128x128 tiles of all experts' dW (clusters of 2 tiles along m, n fastest),
//                       the experts longest first (the setup kernel's places, ContigWgradPlace), the place in the
//                       work tile's L index; with a counter given, the clusters take them dynamically
//                       (ContigUnitWalk);
//   WgradMainloop       CUTLASS's TMA mainloop over A [rows, m] and B [rows, n] whole (one descriptor each); a tile's
//                       k-tiles start at its expert's first row, and its number of k-tiles is its expert's (with
//                       chunks, the k-tiles of the expert's segment in each region, region after region). The
//                       kernel takes one k-tile count for every tile (the problem's), so the mainloop keeps its own
//                       pipeline states: the producer advances by each tile's count, and each consumer warpgroup
//                       starts a tile where its partner's previous tile ended (WgradShared). In a segment's last
//                       k-tile the rows past the segment are zeroed in shared memory before the MMAs.
//   WgradRowEpilogue    dW_e = bf16(acc) through the staging tile, one row per thread, to the expert's pointer.
#include "experts/contig/contig_gemm_sm90.cuh"

namespace moerail::experts {
namespace contig_wgrad {

constexpr int kTileMN = 128;      // the tile's m and n
constexpr int kTileK = 64;        // rows of a k-tile
constexpr int kClusterM = 2;      // CTAs of a cluster, along m: they share (multicast) B's tile

// Tag that selects WgradTileScheduler in CUTLASS's kernel (TileSchedulerSelector below).
struct WgradScheduler {};

// The work units (clusters of kClusterM x 1 tiles) of all experts' dW: unit u belongs to place u / per_expert of
// the walk (ContigWgradPlace), n fastest inside it.
struct WgradUnits {
  int per_expert = 0;  // ceil(m tiles / kClusterM) * n tiles
  int n_tiles = 0;
  int units = 0;       // groups * per_expert (< 2^31, checked on the host)
};

// One expert's segment as its tiles' k-tiles see it.
struct Segment {
  int start = 0;    // its first row
  int k_tiles = 0;  // ceil(rows / 64); 0 for an empty expert
  int tail = 0;     // its rows in the last k-tile, 1..64 (0 when empty)
};
static_assert(kTileK == kContigWgradTileK);

// A consumer warp's current tile: its place and segment in region 0.
struct WgradTile {
  ContigWgradPlace place;
  ContigWgradSegment seg;

  CUTLASS_DEVICE Segment segment() const { return {seg.start, seg.k_tiles, place.tail}; }
};

CUTLASS_DEVICE Segment segment_of(const std::int64_t* offsets, int expert) {
  const int start = int(offsets[expert]), rows = int(offsets[expert + 1]) - start;
  if (rows <= 0) return {start, 0, 0};
  const int k_tiles = (rows + kTileK - 1) / kTileK;
  return {start, k_tiles, rows - (k_tiles - 1) * kTileK};
}

// The segment table: `chunks` regions of segment starts, [chunks][groups + 1] (ContigWgradCall::offsets). An
// expert's rows are its segment in each region, summed region by region.
struct SegmentTable {
  const std::int64_t* offsets = nullptr;
  int chunks = 1;
  int stride = 0;  // groups + 1

  CUTLASS_DEVICE Segment at(int chunk, int expert) const { return segment_of(offsets + chunk * stride, expert); }
};

// Static shared memory of the kernel, beside the scheduler's ring.
struct WgradShared {
  // Consumer warp w (of the 8): the place and region-0 segment of its warpgroup's current tile. The warp's scheduler
  // writes them when it moves to the tile, after the previous tile's epilogue (the global reads then overlap the
  // warpgroup's wait for its turn at the tensor cores); its mainloop and epilogue read them. One slot per warp, with
  // the warp converged after each write, so that no lane's write of an earlier tile lands after another's of a
  // later one.
  WgradTile tile[8];
  // The pipeline count at which the next tile of the CTA's walk starts, for consumer warpgroup w: written by its
  // partner when it starts its tile (the kernel's math order barrier puts one's MMAs after the other's).
  int next_stage[2];
};

CUTLASS_DEVICE WgradShared& wgrad_shared() {
  __shared__ WgradShared shared;
  return shared;
}

// The current tile of this thread's consumer warp (warps 4..11 of the kernel).
CUTLASS_DEVICE WgradTile& consumer_tile() { return wgrad_shared().tile[int(threadIdx.x) / 32 - 4]; }

// Persistent scheduler over WgradUnits, walked statically or dynamically (ContigUnitWalk, with `walk` given).
// Everything but the walk (types, workspace) is CUTLASS's persistent scheduler's. For CUTLASS's ping-pong kernel
// only, as ContigTileScheduler. The roles read the places, the segment offsets and ptr_d without waiting on a
// preceding grid: launches must not use programmatic dependent launch (Sm90ContigWgrad::run does not).
class WgradTileScheduler : public ContigWalkSchedulerBase<kClusterM> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    int groups = 0;
    const ContigWgradPlace* places = nullptr;            // device [groups]: the walk's places
    const ContigWgradSegment* place_segments = nullptr;  // device [groups]: their segments in region 0
    int* walk = nullptr;  // device [3]: ContigWgradCall::walk; nullptr: static
    env::ContigWalk mode = env::ContigWalk::Auto;  // with walk: Auto decides on the device (contig_wgrad_walk_dynamic)
  };
  struct Params : Base::Params {
    WgradUnits units;
    const ContigWgradPlace* places = nullptr;
    const ContigWgradSegment* place_segments = nullptr;
    int* walk = nullptr;
    env::ContigWalk mode = env::ContigWalk::Auto;
  };

  // Work units of one expert's dW [m, n], in 64 bits for the host's checks.
  static std::int64_t units_per_expert(std::int64_t m, std::int64_t n) {
    return ((m + kTileMN - 1) / kTileMN + kClusterM - 1) / kClusterM * ((n + kTileMN - 1) / kTileMN);
  }

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL shape, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw, Arguments const& args,
                                        void* = nullptr, uint32_t = 1, uint32_t = 1) {
    static_assert(cute::size<0>(ClusterShape{}) == kClusterM && cute::size<1>(ClusterShape{}) == 1,
                  "the contiguous weight gradient pairs CTAs along m only");
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(shape, tile, cluster, hw, args);
    // m, n and the units in 32 bits: checked by Sm90ContigWgrad::run first.
    const int m = int(cute::get<0>(shape)), n = int(cute::get<1>(shape));
    p.places = args.places;
    p.place_segments = args.place_segments;
    p.mode = args.mode;
    p.units.n_tiles = (n + kTileMN - 1) / kTileMN;
    p.units.per_expert = int(units_per_expert(m, n));
    p.units.units = args.groups * p.units.per_expert;
    p.walk = args.walk;
    return p;
  }

  static bool can_implement(Arguments const& args) {
    return args.groups >= 1 && args.places != nullptr && args.place_segments != nullptr;
  }

  // One cluster per resident cluster slot: grid (kClusterM * clusters, 1), clusters of (kClusterM, 1).
  template <class ProblemShape, class TileShape, class ClusterShape>
  static dim3 get_grid_shape(Base::Params const&, ProblemShape, TileShape, ClusterShape,
                             cutlass::KernelHardwareInfo hw, Base::Arguments = {}, bool = true) {
    const int clusters = hw.max_active_clusters > 0 ? hw.max_active_clusters : hw.sm_count / kClusterM;
    return dim3(unsigned(kClusterM * (clusters > 0 ? clusters : 1)), 1, 1);
  }

  CUTLASS_HOST_DEVICE WgradTileScheduler() {}

  CUTLASS_DEVICE explicit WgradTileScheduler(Params const& p)
      : units_(p.units), places_(p.places), place_segments_(p.place_segments) {
#if defined(__CUDA_ARCH__)
    bool dynamic = p.walk != nullptr && p.mode != env::ContigWalk::Static;
    if (dynamic && p.mode == env::ContigWalk::Auto) {  // every role of every CTA reads the same two values
      const dim3 clusters = cute::cluster_grid_dims();
      dynamic = contig_wgrad_walk_dynamic(places_[0].k_tiles, p.walk[2], units_.per_expert, clusters.x * clusters.y);
    }
    walk_.start(units_.units, dynamic ? p.walk : nullptr);
    stash_tile();
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    if (walk_.done()) return WorkTileInfo::invalid_work_tile();
    const int u = walk_.unit();
    const int place = u / units_.per_expert;
    const int in_expert = u - place * units_.per_expert;
    const int m_cluster = in_expert / units_.n_tiles;
    const int n = in_expert - m_cluster * units_.n_tiles;
    return {m_cluster * kClusterM + int(cute::block_id_in_cluster().x), n, place, true};
  }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) {
    walk_.advance(int(count));
    stash_tile();
  }

  // Only CUTLASS_ENABLE_GDC_FOR_SM90 builds call it (as a hint).
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t count = 1) const { return walk_.ends_within(int(count)); }

 private:
  // A consumer warp's scheduler: the place of its new tile into the warp's slot (WgradShared::tile); every lane
  // writes the same values.
  CUTLASS_DEVICE void stash_tile() const {
    if (cutlass::canonical_warp_group_idx() == 0 || walk_.done()) return;
    const int place = walk_.unit() / units_.per_expert;
    WgradTile& tile = consumer_tile();
    tile.place = places_[place];
    tile.seg = place_segments_[place];
    __syncwarp();
  }

  WgradUnits units_;
  const ContigWgradPlace* places_ = nullptr;
  const ContigWgradSegment* place_segments_ = nullptr;
  ContigUnitWalk<kClusterM> walk_;
};

// CUTLASS's SM90 TMA mainloop (`Base`) with per-tile reduction lengths; see the file comment. The kernel's pipeline
// states and k-tile count are ignored: the members below are this thread's (the kernel builds one mainloop object
// per thread and keeps it for the whole launch).
template <class Base>
struct WgradMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  static_assert(cute::size<2>(typename Base::TileShape{}) == kTileK, "64-row k-tiles");
  static constexpr int kStages = Base::DispatchPolicy::Stages;

  struct Arguments : Base::Arguments {
    const ContigWgradPlace* places = nullptr;            // device [groups]: the walk's places
    const ContigWgradSegment* place_segments = nullptr;  // device [groups]: their segments in region 0
    const std::int64_t* offsets = nullptr;               // device: [chunks][groups + 1] segment starts
    int groups = 0;
    int chunks = 1;
  };
  struct Params : Base::Params {
    const ContigWgradPlace* places = nullptr;
    const ContigWgradSegment* place_segments = nullptr;
    SegmentTable segments;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(shape, args, workspace);
    p.places = args.places;
    p.place_segments = args.place_segments;
    p.segments = {args.offsets, args.chunks, args.groups + 1};
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    return args.places != nullptr && args.place_segments != nullptr && args.offsets != nullptr && args.groups >= 1 &&
           args.chunks >= 1 &&
           Base::can_implement(shape, args);
  }

  // Producer: the tile's k-tiles from its expert's first row in each region (the kernel passes the place in the
  // walk as l; A and B have L = 1). TMA coordinates are per element, so any first row works.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState first_state,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    if (!started_) {
      pipe_ = first_state;  // the producer's start state
      started_ = true;
    }
    const int place = int(cute::get<3>(blk_coord));
    const ContigWgradSegment seg0 = p.place_segments[place];
    const auto coord = cute::make_coord(cute::get<0>(blk_coord), cute::get<1>(blk_coord), cute::get<2>(blk_coord), 0);
    for (int chunk = 0; chunk < p.segments.chunks; ++chunk) {
      const Segment seg =  // the place's expert is read for further regions only
          chunk == 0 ? Segment{seg0.start, seg0.k_tiles, 0} : p.segments.at(chunk, p.places[place].expert);
      if (seg.k_tiles == 0) continue;
      auto gA = cute::domain_offset(cute::make_coord(0, seg.start, 0, 0, 0), cute::get<0>(load_inputs));
      auto gB = cute::domain_offset(cute::make_coord(0, seg.start, 0, 0, 0), cute::get<1>(load_inputs));
      Base::load(p, pipeline, pipe_, cute::make_tuple(gA, gB), coord, k_tile_iter, seg.k_tiles, thread_idx,
                 block_rank_in_cluster, shared_tensors);
      pipe_.advance(seg.k_tiles);
    }
  }

  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState state) {
    Base::load_tail(pipeline, started_ ? pipe_ : state);
  }

  // Consumer: this warpgroup's current tile (its place, from its scheduler: consumer_tile()). It starts at the
  // pipeline count where the CTA's previous tile ended: warpgroup 0's first tile at 0, every later one where its
  // partner left it; the stages between a warpgroup's tiles are its partner's.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState, FrgTensorC& accum, int, int thread_idx,
                          TensorStorage& shared_tensors, Params const& p) {
    using namespace cute;
    WgradShared& shared = wgrad_shared();
    const int wg = int(threadIdx.x) / cutlass::NumThreadsPerWarpGroup - 1;  // the producer is warpgroup 0
    const WgradTile tile = consumer_tile();
    const int first = started_ || wg == 1 ? shared.next_stage[wg] : 0;
    shared.next_stage[wg ^ 1] = first + tile.place.k_tiles;
    started_ = true;
    k_tiles_ = tile.place.k_tiles;
    pipe_ = PipelineState(first % kStages, uint32_t(first / kStages) & 1u, uint32_t(first));
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_slice(0);  // one warpgroup per tile
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));  // (MMA,MMA_N,MMA_K,PIPE)

    release_ = pipe_;
    // Before the MMAs: an instruction that touches the accumulators after them would serialize every wgmma of the
    // loop (ptxas C7514).
    if (tile.place.k_tiles == 0) clear(accum);  // an empty expert: dW_e = 0
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accum);
    int issued = 0;  // the tile's k-tiles so far
    mma_segment(pipeline, tile.segment(), accum, tiled_mma, tCrA, tCrB, sA, sB, issued, thread_idx);
    for (int chunk = 1; chunk < p.segments.chunks; ++chunk)
      mma_segment(pipeline, p.segments.at(chunk, tile.place.expert), accum, tiled_mma, tCrA, tCrB, sA, sB, issued,
                  thread_idx);
    warpgroup_fence_operand(accum);
  }

  // The MMAs of one segment's k-tiles (one k-tile in flight); `issued` counts the tile's k-tiles so far, whose
  // stages but the last are released here.
  template <class FrgTensorC, class FragA, class FragB, class TensorSA, class TensorSB>
  CUTLASS_DEVICE void mma_segment(MainloopPipeline& pipeline, const Segment& seg, FrgTensorC& accum,
                                  TiledMma& tiled_mma, FragA& tCrA, FragB& tCrB, TensorSA& sA, TensorSB& sB,
                                  int& issued, int thread_idx) {
    using namespace cute;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int kt = 0; kt < seg.k_tiles; ++kt) {
      pipeline.consumer_wait(pipe_, pipeline.consumer_try_wait(pipe_));
      const int stage = pipe_.index();
      if (kt == seg.k_tiles - 1 && seg.tail < kTileK) zero_rows_past(sA, sB, stage, seg.tail, thread_idx);
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // the previous k-tile's MMAs are done: its stage goes back to the producer
      warpgroup_fence_operand(accum);
      if (issued > 0) {
        pipeline.consumer_release(release_);
        ++release_;
      }
      ++issued;
      ++pipe_;
    }
  }

  // After the tile's MMAs: release its last stage.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState, int) {
    cute::warpgroup_wait<0>();
    if (k_tiles_ > 0) pipeline.consumer_release(release_);
  }

 private:
  // Rows [tail, 64) of the stage's k-tile belong to the next expert or region (or lie past the buffer, zero-filled
  // by TMA): zero them in both operands (one would do for finite values; both keep a NaN of the next expert out),
  // then make the zeros visible to the MMAs (async proxy) and wait for the warpgroup's other threads. A and B are both
  // m-/n-major here, so 8 consecutive m (n) of one row are 16 contiguous bytes of the swizzled layout.
  template <class TensorSA, class TensorSB>
  CUTLASS_DEVICE static void zero_rows_past(TensorSA& sA, TensorSB& sB, int stage, int tail, int thread_idx) {
    constexpr int kChunks = kTileMN / 8;  // 16-byte pieces of a row
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int i = thread_idx % cutlass::NumThreadsPerWarpGroup; i < (kTileK - tail) * kChunks;
         i += cutlass::NumThreadsPerWarpGroup) {
      const int k = tail + i / kChunks, c = i % kChunks * 8;
      *reinterpret_cast<uint4*>(&sA(c, k, stage)) = zero;
      *reinterpret_cast<uint4*>(&sB(c, k, stage)) = zero;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const int wg = int(threadIdx.x) / cutlass::NumThreadsPerWarpGroup;  // as StagedEpilogueBase::warpgroup_sync
    asm volatile("bar.sync %0, 128;" ::"r"(int(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier) + wg)
                 : "memory");
  }

  PipelineState pipe_{};     // producer: the next stage to write; consumer: the next stage to read
  PipelineState release_{};  // consumer: the oldest stage not yet released
  bool started_ = false;
  int k_tiles_ = 0;          // consumer: of the current tile
};

// dW_e = bf16(acc) for tile (m, n) of the expert e of the warp's current tile (consumer_tile()), rows and columns
// inside [m, n] only, through the staging tile (as ContigRowEpilogue) to the expert's pointer; with `accumulate`
// each staged row is added to dW_e's (dW_e = bf16(dW_e + bf16(acc))) by the copy engine's reduce. With `f32` dW_e
// is fp32 (dW_e = acc, or dW_e + acc): the tile is staged in two halves of 64 columns (each the staging buffer's
// size in fp32), and from each the threads store, or add with red.global.add.v4.f32, 16 bytes at a time, a warp two
// half rows. Every element is added once per call, so the sum does not depend on the order of the adds. (The copy
// engine's fp32 reduce of each half row, waiting for its reads before the next half, was slower.)
template <int kPitch, int kHalf, class BlockShapeMNK, class FrgEngine, class FrgLayout, class TiledMma>
CUTLASS_DEVICE void stage_half_tile_f32(cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma,
                                        BlockShapeMNK blk_shape_MNK, int thread_idx, int half, float* d) {
  for_each_accumulator_pair(acc, tiled_mma, blk_shape_MNK, thread_idx, [&](int row, int col, float a0, float a1) {
    col -= half * kHalf;
    if (col >= 0 && col < kHalf) *reinterpret_cast<float2*>(d + row * kPitch + col) = make_float2(a0, a1);
  });
}

template <class StrideD_>
class WgradRowEpilogue : public StagedEpilogueBase<StrideD_, cutlass::epilogue::NoSmemWarpSpecialized> {
  using Base = StagedEpilogueBase<StrideD_, cutlass::epilogue::NoSmemWarpSpecialized>;

 public:
  static constexpr int kPitch = kTileMN + 8;  // bf16 elements per staged row
  static constexpr int kHalfF32 = kTileMN / 2;  // fp32 columns per staged half tile
  static constexpr int kPitchF32 = kPitch / 2;  // fp32 elements per staged row: the same bytes
  struct Staging {
    alignas(128) __nv_bfloat16 d[kTileMN * kPitch];
  };
  static constexpr int kStagingBytes = int(sizeof(Staging));
  static_assert(kPitchF32 >= kHalfF32 && kPitchF32 * 4 % 16 == 0, "16-byte fp32 rows of a half tile");

  struct Arguments {
    void* const* ptr_d = nullptr;  // device [groups]
    std::int64_t ldd = 0;          // elements
    bool accumulate = false;
    bool f32 = false;              // dW is fp32
  };
  using Params = Arguments;
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    return args.ptr_d != nullptr && args.ldd % 8 == 0 && int(cute::get<1>(shape)) % 8 == 0;  // 16-byte rows
  }

  CUTLASS_HOST_DEVICE explicit WgradRowEpilogue(Params const& p) : params(p) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    const int M = int(cute::get<0>(problem_shape_mnkl)), N = int(cute::get<1>(problem_shape_mnkl));
    const int m0 = int(cute::get<0>(blk_coord_mnkl)) * kTileMN, n0 = int(cute::get<1>(blk_coord_mnkl)) * kTileMN;
    const int expert = consumer_tile().place.expert;  // the tile's place is blk_coord's l
    __shared__ Staging stage;
    const int i = thread_idx % 128;
    if (params.f32) {
      float* staged = reinterpret_cast<float*>(stage.d);
      float* base = static_cast<float*>(params.ptr_d[expert]);
      for (int half = 0; half < 2; ++half) {
        if (half == 1) Base::warpgroup_sync();  // every thread has read the first half
        stage_half_tile_f32<kPitchF32, kHalfF32>(acc, tiled_mma, blk_shape_MNK, thread_idx, half, staged);
        Base::warpgroup_sync();
        const int c0 = n0 + half * kHalfF32;
        constexpr int kVecs = kHalfF32 / 4;  // float4 per half row
        CUTLASS_PRAGMA_UNROLL
        for (int it = 0; it < kTileMN * kVecs / 128; ++it) {
          const int idx = it * 128 + i, r = idx / kVecs, c = c0 + idx % kVecs * 4;
          if (m0 + r >= M || c >= N) continue;
          const float4 v = *reinterpret_cast<const float4*>(staged + r * kPitchF32 + (idx % kVecs) * 4);
          float4* p = reinterpret_cast<float4*>(base + std::int64_t(m0 + r) * params.ldd + c);
          if (params.accumulate)
            atomicAdd(p, v);
          else
            *p = v;
        }
      }
      return;  // the loads of the staged values are done: the other warpgroup may write the buffer next
    }
    stage_tile_bf16<kPitch>(acc, tiled_mma, blk_shape_MNK, thread_idx, stage.d);
    Base::staged_tile_ready();
    if (m0 + i < M && n0 < N) {
      const int cols = min(kTileMN, N - n0);  // a multiple of 8: whole 16-byte pieces
      __nv_bfloat16* row = static_cast<__nv_bfloat16*>(params.ptr_d[expert]) + std::int64_t(m0 + i) * params.ldd + n0;
      if (params.accumulate)
        Base::bulk_add_bf16(row, stage.d + i * kPitch, unsigned(cols) * 2u);
      else
        Base::bulk_copy(row, stage.d + i * kPitch, unsigned(cols) * 2u);
      Base::commit_copies();
    }
    Base::wait_copies_read();
  }

 private:
  Params params;
};

}  // namespace contig_wgrad
}  // namespace moerail::experts

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t kStages>
struct TileSchedulerSelector<moerail::experts::contig_wgrad::WgradScheduler, arch::Sm90, TileShape, ClusterShape,
                             kStages> {
  using Scheduler = moerail::experts::contig_wgrad::WgradTileScheduler;
};

}  // namespace cutlass::gemm::kernel::detail

namespace moerail::experts {
namespace contig_wgrad {

namespace wgrad {
using Element = cutlass::bfloat16_t;
using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
using Cluster = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;
using StrideD = cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>;
using EpilogueOp = WgradRowEpilogue<StrideD>;
using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<EpilogueOp>;
// the epilogue's staging tile, the scheduler's ring and WgradShared are static shared memory beside the kernel's
inline constexpr int kStaticSmem = EpilogueOp::kStagingBytes + int(sizeof(ContigWalkShared) + sizeof(WgradShared));
inline constexpr int kEpilogueSmem = int(sizeof(typename Epilogue::SharedStorage)) + kStaticSmem;
// A stored [rows, m] (m contiguous: CUTLASS's column-major M x K), B [rows, n] (n contiguous: row-major K x N).
using Mainloop = WgradMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Element, cutlass::layout::ColumnMajor, 8,
    Element, cutlass::layout::RowMajor, 8,
    float, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp>;
using Kernel =
    cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, WgradScheduler>;
}  // namespace wgrad

class Sm90ContigWgrad final : public ContigWgrad {
  using Kernel = wgrad::Kernel;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(Kernel::SharedStorageSize + wgrad::kStaticSmem <=
                    cutlass::gemm::collective::detail::sm90_smem_capacity_bytes,
                "the mainloop's stages and the static shared memory must fit an SM's shared memory");
  static_assert(Kernel::CollectiveMainloop::DispatchPolicy::Stages == 6, "six stages, as before the scheduler's ring");

 public:
  void initialize(std::string_view what, int max_sms) override {
    const cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::SharedStorageSize);
    if (e != cudaSuccess)
      fail_with(ErrorCode::Cuda, what, ": setting the contiguous weight gradient's shared memory failed: ",
                cudaGetErrorString(e));
    clusters_ = max_active_clusters_of<Kernel, wgrad::Cluster>(max_sms);
    walk_ = env::contig_walk();
  }

  void run(const ContigWgradCall& c, cudaStream_t stream, std::string_view what) override {
    // 32-bit rows (TMA coordinates, segment offsets), sizes and work units (the walk steps past the last by at most
    // two grids of clusters); 16-byte rows.
    if (c.rows < 1 || c.rows > kContigWgradMaxRows)
      fail_with(ErrorCode::Unsupported, what, ": the contiguous weight gradient takes 1 to ", kContigWgradMaxRows,
                " rows, got ", c.rows);
    if (c.m < 1 || c.n < 1 || c.m >= (1ll << 30) || c.n >= (1ll << 30) || c.groups < 1 || c.chunks < 1)
      fail_with(ErrorCode::Unsupported, what, ": the contiguous weight gradient takes m and n in [1, 2^30), 1 or "
                "more groups and 1 or more chunks, got m ", c.m, ", n ", c.n, ", groups ", c.groups, ", chunks ",
                c.chunks);
    if (c.offsets == nullptr || c.places == nullptr || c.place_segments == nullptr || c.ptr_d == nullptr)
      fail_with(ErrorCode::InvalidArgument, what, ": the contiguous weight gradient needs the setup's offsets, "
                "places, place_segments and ptr_d; one of them is null");
    if (c.lda < c.m || c.ldb < c.n || c.ldd < c.n || c.lda % 8 != 0 || c.ldb % 8 != 0 || c.ldd % 8 != 0)
      fail_with(ErrorCode::Unsupported, what, ": the contiguous weight gradient needs leading dimensions at least "
                "the rows' widths and multiples of 8 elements (16-byte rows), got lda ", c.lda, " (m ", c.m, "), ldb ",
                c.ldb, " (n ", c.n, "), ldd ", c.ldd);
    const std::int64_t per_expert = WgradTileScheduler::units_per_expert(c.m, c.n);
    if (c.groups * per_expert + 2 * std::int64_t(std::max(clusters_, 1024)) >= (1ll << 31))
      fail_with(ErrorCode::Unsupported, what, ": the contiguous weight gradient's work units (", c.groups,
                " groups x ", per_expert, ") exceed 32 bits");
    typename Kernel::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {int(c.m), int(c.n), int(c.rows), 1};
    args.mainloop.ptr_A = static_cast<const wgrad::Element*>(c.a);
    args.mainloop.dA = contig::make_stride_ld<typename Kernel::StrideA>(c.lda, c.rows * c.lda);
    args.mainloop.ptr_B = static_cast<const wgrad::Element*>(c.b);
    args.mainloop.dB = contig::make_stride_ld<typename Kernel::StrideB>(c.ldb, c.rows * c.ldb);
    args.mainloop.places = c.places;
    args.mainloop.place_segments = c.place_segments;
    args.mainloop.offsets = c.offsets;
    args.mainloop.groups = c.groups;
    args.mainloop.chunks = c.chunks;
    args.epilogue.ptr_d = c.ptr_d;
    args.epilogue.ldd = c.ldd;
    args.epilogue.accumulate = c.accumulate;
    args.epilogue.f32 = c.f32;
    args.scheduler.groups = c.groups;
    args.scheduler.places = c.places;
    args.scheduler.place_segments = c.place_segments;
    args.scheduler.walk = c.walk;
    args.scheduler.mode = walk_;
    args.hw_info = hw_info(clusters_);
    if (Kernel::can_implement(args) == false)
      fail_with(ErrorCode::Unsupported, what, ": CUTLASS rejected the contiguous weight gradient (rows ", c.rows,
                ", m ", c.m, ", n ", c.n, ", lda ", c.lda, ", ldb ", c.ldb, ", ldd ", c.ldd, ", groups ", c.groups,
                ")");
    typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
    const cutlass::Status st = Gemm::run(params, stream);
    if (st != cutlass::Status::kSuccess)
      fail_with(ErrorCode::Cuda, what, ": contiguous weight gradient launch failed: ", cutlassGetStatusString(st),
                " (", cudaGetErrorString(cudaGetLastError()), ")");
    MOERAIL_CUDA_CHECK_LAUNCH();
  }

 private:
  int clusters_ = 0;
  env::ContigWalk walk_ = env::ContigWalk::Auto;
};

}  // namespace contig_wgrad

std::unique_ptr<ContigWgrad> make_contig_gemm_wgrad() {
  return std::make_unique<contig_wgrad::Sm90ContigWgrad>();
}

}  // namespace moerail::experts
