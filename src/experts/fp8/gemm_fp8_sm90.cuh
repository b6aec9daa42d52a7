// src/experts/fp8/gemm_fp8_sm90.cuh — the one CUTLASS template behind the FP8 grouped GEMMs (gemm_fp8.h). Included only
// by the gemm_fp8_*.cu files, each of which instantiates it once.
//
// Blockwise kernels: CUTLASS 4.2 SM90 ptr-array grouped GEMM with the FP8 blockwise-scaling mainloop
// (sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp): TMA loads of the e4m3 tiles, a separate
// producer warp copying the fp32 scales of each K block into shared memory (cp.async, predicated), wgmma into
// fp32 registers that are scaled by sa * sb and added into the promoted accumulator after every 128-wide K block,
// by moerail's consumer loop, which promotes one K block while the next one's wgmmas run (overlapped_mainloop.cuh).
// Per-tensor kernels: the plain ptr-array FP8 mainloop with fast accumulation (every wgmma accumulates into the one
// fp32 accumulator, no promotion), the scale applied once in the epilogue as a per-group alpha read from device
// memory (alpha_ptr with an L stride of 1: alpha[g] for group g).
// Both: bf16 output through a TMA-store epilogue without a source operand. Problem shapes read from device memory by
// the persistent group tile scheduler; TMA descriptors patched per group on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#include "core/cuda_check.h"
#include "experts/cutlass_hw.cuh"
#include "experts/fp8/gemm_fp8.h"
#include "experts/fp8/overlapped_mainloop.cuh"
#include "moerail/error.h"

namespace moerail::experts {

template <Fp8Tile T>
struct Fp8TileTraits;

template <>
struct Fp8TileTraits<Fp8Tile::Coop128x128> {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using BlockKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using FastAccumKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum;
  // Per-tensor with promotion: CUTLASS's FP8 mainloop that adds the wgmma results into a separate fp32 accumulator
  // every mma_promotion_interval (4) MMAs of K = 32, i.e. every 128 elements of K, with no scale to apply.
  using PromoteKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  // Epilogue sub-tiles of 128x64 (CUTLASS's default for this tile: 128x32): half the shared-memory round trips and
  // barriers per tile; measured faster on the dgrads and weight gradients, 128x128 slower (figures: docs/experts.md).
  using EpiTile = cute::Shape<cute::_128, cute::_64>;
};

template <>
struct Fp8TileTraits<Fp8Tile::Ping64x128> {
  using Tile = cute::Shape<cute::_64, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using BlockKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum;
  using FastAccumKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum;
  using PromoteKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using EpiTile = cutlass::epilogue::collective::EpilogueTileAuto;  // 64x32; a 128-row sub-tile cannot divide it
};

// What one instantiation computes (a structural type: the instances name their fields).
struct Fp8GemmKind {
  Fp8Tile tile = Fp8Tile::Coop128x128;
  Fp8GemmScaling scaling = Fp8GemmScaling::Blockwise;
  // Rows of B (GEMM N) per B scale: 128 for the weights' 128x128 blocks (forward, dgrad), 1 for the weight gradient,
  // whose B operand is an activation with 1x128 scales along its rows (its K).
  int sfb_rows = 128;
  // D is fp32 and read as the source C of the same address, D = acc + D (beta 1, in place: each tile reads and
  // writes only its own outputs), the weight gradient added into fp32 main gradients; else D is bf16, written, no
  // source.
  bool accumulate = false;
  // Per-tensor only: the partial sums promoted every 128 elements of K into a separate fp32 accumulator
  // (TransformerEngine's split accumulator) instead of fast accumulation.
  bool promote = false;
  // Per-tensor, promoted only: A holds e5m2 codes (the hybrid recipe's gradients; wgmma multiplies e5m2 by e4m3 as it
  // does e4m3 by e4m3), B stays e4m3.
  bool e5m2_a = false;
};

template <Fp8GemmKind K>
struct Sm90Fp8GemmConfig {
  static_assert(!K.promote || K.scaling == Fp8GemmScaling::PerTensor, "blockwise scaling always promotes");
  static_assert(!K.e5m2_a || K.promote, "e5m2 A operands run in the promoted per-tensor GEMMs only");
  static constexpr bool kBlockwise = K.scaling == Fp8GemmScaling::Blockwise;
  using ElementA = std::conditional_t<K.e5m2_a, cutlass::float_e5m2_t, cutlass::float_e4m3_t>;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = std::conditional_t<K.accumulate, float, cutlass::bfloat16_t>;
  using ElementC = std::conditional_t<K.accumulate, float, void>;
  using Accumulator = float;
  static constexpr int kAlignmentAB = 16;                           // 16-byte TMA rows: 16 fp8 elements
  static constexpr int kAlignmentD = 16 / int(sizeof(ElementD));  // 16 bytes: 8 bf16 or 4 f32 elements
  using Traits = Fp8TileTraits<K.tile>;
  using LayoutA = cutlass::layout::RowMajor;     // [M,K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // [N,K] row-major = K x N column-major
  using LayoutD = cutlass::layout::RowMajor;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

  // 1x128 scales of A (one per row and K block), 128x128 (or, wgrad, 1x128) scales of B, both K-major: the grouped
  // mainloop builds each group's scale layout from (M_g, N, K) alone, and only the K-major form of that compact
  // layout is a slice of the caller's [rows, K/128] and [L, ceil(N/128), K/128] tensors (moerail/experts_fp8.h), or
  // a block of the segment-transposed copies (moerail/quant.h).
  using ScaleConfig =
      cutlass::detail::Sm90BlockwiseScaleConfig<1, K.sfb_rows, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  // Blockwise: each operand's layout paired with its scale layout. Per-tensor: the bare layouts (no scale operands).
  using MainloopLayoutA = std::conditional_t<kBlockwise, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using MainloopLayoutB = std::conditional_t<kBlockwise, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;
  using MainloopKernel = std::conditional_t<
      kBlockwise, typename Traits::BlockKernel,
      std::conditional_t<K.promote, typename Traits::PromoteKernel, typename Traits::FastAccumKernel>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Traits::Tile, typename Traits::Cluster,
      typename Traits::EpiTile, Accumulator, Accumulator,
      ElementC, LayoutD*, kAlignmentD,    // source C: D itself (accumulate) or none
      ElementD, LayoutD*, kAlignmentD,    // D
      typename Traits::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, Accumulator>>::CollectiveOp;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, MainloopLayoutA, kAlignmentAB,
      ElementB, MainloopLayoutB, kAlignmentAB,
      Accumulator, typename Traits::Tile, typename Traits::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopKernel>::CollectiveOp;
  // Blockwise: CUTLASS's collective with the consumer loop that overlaps promotion and MMAs (overlapped_mainloop.cuh).
  using CollectiveMainloop =
      std::conditional_t<kBlockwise, OverlappedPromotionMainloop<BuiltMainloop>, BuiltMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The setup kernel writes one int64 leading dimension per group for each operand (Fp8GemmArrays::ld_*); that is the
// whole of a ptr-array stride exactly when the stride has one dynamic mode and it comes first.
template <class Stride>
constexpr bool is_leading_int64_stride() {
  return sizeof(Stride) == sizeof(std::int64_t) &&
         !cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(Stride{}))>>;
}

template <Fp8GemmKind K>
class Sm90GroupedGemmFp8 final : public GroupedGemmFp8 {
  static constexpr Fp8Tile kTile = K.tile;
  static constexpr Fp8GemmScaling kScaling = K.scaling;
  static constexpr bool kAccumulate = K.accumulate;
  using Cfg = Sm90Fp8GemmConfig<K>;
  static constexpr bool kBlockwise = Cfg::kBlockwise;
  using Gemm = typename Cfg::Gemm;
  using Kernel = typename Cfg::Kernel;
  using Arguments = typename Gemm::Arguments;
  using Shape3 = typename Cfg::ProblemShape::UnderlyingProblemShape;
  using StrideA = cute::remove_pointer_t<typename Kernel::StrideA>;
  using StrideB = cute::remove_pointer_t<typename Kernel::StrideB>;
  using StrideD = cute::remove_pointer_t<typename Kernel::StrideD>;
  using ElementA = typename Kernel::ElementA;
  using ElementB = typename Kernel::ElementB;
  using ElementD = typename Kernel::ElementD;
  using Mainloop = typename Cfg::CollectiveMainloop;
  static_assert(sizeof(Shape3) == sizeof(GroupShape), "GroupShape must mirror cute::Shape<int,int,int>");
  static_assert(!kAccumulate || std::is_same_v<cute::remove_pointer_t<typename Kernel::StrideC>, StrideD>,
                "the accumulating epilogue reads C through D's strides");
  static_assert(is_leading_int64_stride<StrideA>() && is_leading_int64_stride<StrideB>() &&
                    is_leading_int64_stride<StrideD>(),
                "the setup kernel writes each operand's stride as one int64 leading dimension");

  static constexpr bool check_block_scales() {
    if constexpr (kBlockwise) {
      static_assert(std::is_same_v<typename Mainloop::ElementBlockScale, float>, "block scales are fp32");
      static_assert(Mainloop::ScaleGranularityM == 1 && Mainloop::ScaleGranularityN == K.sfb_rows &&
                        Mainloop::ScaleGranularityK == 128 && !Mainloop::MMajorSFA && !Mainloop::NMajorSFB,
                    "1x128 scales of A and sfb_rows x 128 scales of B, K-major");
    }
    return true;
  }
  static_assert(check_block_scales());

 public:
  Fp8Tile tile() const override { return kTile; }
  Fp8GemmScaling scaling() const override { return kScaling; }

  std::size_t workspace_bytes(int groups) const override {
    Fp8GemmArrays a;
    a.groups = groups;
    return Gemm::get_workspace_size(make_arguments(a, hw_info(0)));
  }

  void initialize(const Fp8GemmArrays& arrays, void* workspace, cudaStream_t stream, std::string_view what) override {
    check_shape_layout(what);
    const Arguments args = make_arguments(arrays, hw_info(max_active_clusters()));
    cutlass::Status st = Gemm::can_implement(args);
    if (st != cutlass::Status::kSuccess)
      fail_with(ErrorCode::Unsupported, what, ": CUTLASS can_implement rejected the FP8 ", name_of(kTile), " ",
                name_of(kScaling), " grouped GEMM: ", cutlassGetStatusString(st));
    st = gemm_.initialize(args, workspace, stream);
    if (st != cutlass::Status::kSuccess)
      fail_with(ErrorCode::Internal, what, ": CUTLASS initialize of the FP8 ", name_of(kTile), " ",
                name_of(kScaling), " grouped GEMM failed: ", cutlassGetStatusString(st), " (",
                cudaGetErrorString(cudaGetLastError()), ")");
    initialized_ = true;
  }

  void run(cudaStream_t stream) override {
    if (!initialized_) fail_with(ErrorCode::Internal, "experts fp8", "grouped GEMM run before initialize");
    const cutlass::Status st = gemm_.run(stream);
    if (st != cutlass::Status::kSuccess)
      fail_with(ErrorCode::Cuda, "experts fp8", name_of(kTile), " ", name_of(kScaling),
                " grouped GEMM launch failed: ",
                cutlassGetStatusString(st), " (", cudaGetErrorString(cudaGetLastError()), ")");
    MOERAIL_CUDA_CHECK_LAUNCH();
  }

 private:
  static Arguments make_arguments(const Fp8GemmArrays& a, const cutlass::KernelHardwareInfo& hw) {
    Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {a.groups, reinterpret_cast<Shape3*>(a.shapes), nullptr};  // sizes on the device only
    args.mainloop.ptr_A = reinterpret_cast<const ElementA**>(a.ptr_a);
    args.mainloop.dA = reinterpret_cast<StrideA*>(a.ld_a);
    args.mainloop.ptr_B = reinterpret_cast<const ElementB**>(a.ptr_b);
    args.mainloop.dB = reinterpret_cast<StrideB*>(a.ld_b);
    if constexpr (kBlockwise) {
      using ElementScale = typename Mainloop::ElementBlockScale;
      args.mainloop.ptr_SFA = reinterpret_cast<const ElementScale**>(a.ptr_sfa);
      args.mainloop.ptr_SFB = reinterpret_cast<const ElementScale**>(a.ptr_sfb);
      // The grouped SM90 mainloop derives each group's scale layout from its problem shape (load_init) and never
      // reads these arrays.
      args.mainloop.layout_SFA = nullptr;
      args.mainloop.layout_SFB = nullptr;
      args.epilogue.thread.alpha = 1.0f;
    } else {
      // alpha[g] for group g (the scalar broadcast reads alpha_ptr[g * dAlpha.L] per tile, on the device).
      args.epilogue.thread.alpha_ptr = a.alpha;
      args.epilogue.thread.dAlpha = {cute::_0{}, cute::_0{}, std::int64_t(1)};
    }
    if constexpr (kAccumulate) {  // C = D: the same pointers and strides
      args.epilogue.thread.beta = 1.0f;
      args.epilogue.ptr_C = reinterpret_cast<const ElementD**>(const_cast<const void**>(a.ptr_d));
      args.epilogue.dC = reinterpret_cast<StrideD*>(a.ld_d);
    } else {
      args.epilogue.thread.beta = 0.0f;
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = nullptr;
    }
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(a.ptr_d);
    args.epilogue.dD = reinterpret_cast<StrideD*>(a.ld_d);
    args.hw_info = hw;
    return args;
  }

  // The setup kernel writes GroupShape {m, n, k}; make sure cute's tuple stores them in that order.
  static void check_shape_layout(std::string_view what) {
    const Shape3 s{1, 2, 3};
    GroupShape g{};
    std::memcpy(&g, &s, sizeof g);
    if (g.m != 1 || g.n != 2 || g.k != 3)
      fail_with(ErrorCode::Internal, what, ": cute::Shape<int,int,int> is not laid out as {M, N, K}");
  }

  // Clusters that can be resident at once on the current device (the persistent grid), asked of the occupancy
  // calculator once per device after the kernel's shared-memory attribute is set; 0 = unknown (CUTLASS then
  // launches one CTA per SM, which it handles).
  static int max_active_clusters() {
    static std::mutex mutex;
    static std::vector<int> known;  // per device; -1 = not asked yet
    const int device = cuda::current_device();
    const std::lock_guard<std::mutex> lock(mutex);
    if (std::size_t(device) >= known.size()) known.resize(std::size_t(device) + 1, -1);
    int& clusters = known[std::size_t(device)];
    if (clusters >= 0) return clusters;
    clusters = 0;
    if (cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(Kernel::SharedStorageSize)) != cudaSuccess) {
      (void)cudaGetLastError();
      return clusters;
    }
    clusters = max_active_clusters_of<Kernel, typename Cfg::Traits::Cluster>(/*max_sms=*/0);
    return clusters;
  }

  Gemm gemm_;
  bool initialized_ = false;
};

}  // namespace moerail::experts
