// src/experts/grouped/grouped_gemm_sm90.cuh — the one CUTLASS template behind every grouped GEMM of the expert MLP.
// Included only by the gemm_<layout>_<tile>.cu files, each of which instantiates it once (see grouped_gemm.h).
//
// Kernel: CUTLASS 4.2 SM90 ptr-array grouped GEMM (TMA loads, warp-specialized producer/consumer warpgroups,
// wgmma), problem shapes read from device memory by the persistent group tile scheduler (grid = the SMs that can
// hold a cluster at once), TMA descriptors patched per group on the device. bf16 operands in K-major or MN-major
// shared-memory layouts (wgmma reads both for 16-bit types, so dgrad and wgrad need no transposed copies), fp32
// accumulators, bf16 output through a TMA-store epilogue without a source operand (D = A B).
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
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
#include "experts/epilogues/glu_epilogue.cuh"
#include "experts/grouped/grouped_gemm.h"
#include "moerail/error.h"

namespace moerail::experts {

// Compile-time description of one instantiation.
template <GemmLayout kLayout, GemmTile kTile, bool kGlu>
struct Sm90GemmConfig;

// CUTLASS layout tags of A and B per GemmLayout (CUTLASS's B is K x N: "ColumnMajor" = K contiguous).
template <GemmLayout L>
struct LayoutTags;
template <>
struct LayoutTags<GemmLayout::TN> {
  using A = cutlass::layout::RowMajor;     // [M,K], K contiguous
  using B = cutlass::layout::ColumnMajor;  // [N,K] row-major = K x N column-major
};
template <>
struct LayoutTags<GemmLayout::NN> {
  using A = cutlass::layout::RowMajor;     // [M,K], K contiguous
  using B = cutlass::layout::RowMajor;     // [K,N], N contiguous
};
template <>
struct LayoutTags<GemmLayout::Wgrad> {
  using A = cutlass::layout::ColumnMajor;  // stored [K,M] row-major: M contiguous
  using B = cutlass::layout::RowMajor;     // [K,N], N contiguous
};

// Tile, cluster and schedules per GemmTile; the cluster depends on which mode is ragged (see tiles.h):
// ragged-M GEMMs (forward, dgrad) pair CTAs along N, so a small expert never pays for a padded M tile of its
// cluster partner and the token tile of A is multicast to both; wgrad (ragged K, fixed M and N) pairs along M.
template <GemmLayout L, GemmTile T>
struct TileTraits;

template <GemmLayout L>
struct TileTraits<L, GemmTile::Coop128x256> {
  using Tile = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using Cluster = cute::conditional_t<L == GemmLayout::Wgrad, cute::Shape<cute::_2, cute::_1, cute::_1>,
                                      cute::Shape<cute::_1, cute::_2, cute::_1>>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  static constexpr int kEpilogueThreads = 256;  // both consumer warpgroups store a tile
};

template <GemmLayout L>
struct TileTraits<L, GemmTile::Ping128x128> {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::conditional_t<L == GemmLayout::Wgrad, cute::Shape<cute::_2, cute::_1, cute::_1>,
                                      cute::Shape<cute::_1, cute::_2, cute::_1>>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  static constexpr int kEpilogueThreads = 128;  // one consumer warpgroup stores a tile
};

// kGlu: FC1's fused activation epilogue (glu_epilogue.cuh) instead of the TMA-store epilogue.
template <GemmLayout kLayout, GemmTile kTile, bool kGlu = false>
struct Sm90GemmConfig {
  using Element = cutlass::bfloat16_t;
  using Accumulator = float;
  static constexpr int kAlignment = 16 / int(sizeof(Element));  // 16-byte TMA rows: 8 bf16 elements
  using Traits = TileTraits<kLayout, kTile>;
  using LayoutA = typename LayoutTags<kLayout>::A;
  using LayoutB = typename LayoutTags<kLayout>::B;
  using LayoutD = cutlass::layout::RowMajor;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

  using PlainEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Traits::Tile, typename Traits::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, Accumulator, Accumulator,
      void, LayoutD*, kAlignment,      // no source C
      Element, LayoutD*, kAlignment,   // D
      typename Traits::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<Element, Accumulator>>::CollectiveOp;
  using GluOp = GluEpilogueArray<cutlass::detail::TagToStrideC_t<LayoutD*>, cute::size<1>(typename Traits::Tile{}),
                                 false, Traits::kEpilogueThreads>;
  using GluEpilogueOp = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<GluOp>;
  using CollectiveEpilogue = cute::conditional_t<kGlu, GluEpilogueOp, PlainEpilogue>;
  // The fused epilogue's staging buffer is static shared memory beside the kernel's (glu_epilogue.cuh).
  static constexpr int kStagingBytes = kGlu ? GluEpilogueOp::kStagingBytes : 0;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA*, kAlignment,
      Element, LayoutB*, kAlignment,
      Accumulator, typename Traits::Tile, typename Traits::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage)) + kStagingBytes>,
      typename Traits::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The leading-dimension stride of a ptr-array operand: a cute stride with one dynamic int64 mode.
template <class Stride>
Stride make_ld_stride(std::int64_t ld) {
  static_assert(sizeof(Stride) == sizeof(std::int64_t), "ptr-array strides hold exactly one int64");
  Stride s{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>>)
    cute::get<1>(s) = ld;
  else
    cute::get<0>(s) = ld;
  return s;
}

template <GemmLayout kLayout, GemmTile kTile, bool kGlu = false>
class Sm90GroupedGemm final : public GroupedGemm {
  static_assert(!kGlu || kLayout == GemmLayout::TN, "the fused activation epilogue is FC1's");
  using Cfg = Sm90GemmConfig<kLayout, kTile, kGlu>;
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
  static_assert(sizeof(Shape3) == sizeof(GroupShape), "GroupShape must mirror cute::Shape<int,int,int>");

 public:
  GemmLayout layout() const override { return kLayout; }
  GemmTile tile() const override { return kTile; }

  std::size_t workspace_bytes(int groups) const override {
    return Gemm::get_workspace_size(make_arguments(GroupedGemmArrays{groups}, hw_info(0), glu_, 0, "workspace"));
  }

  void set_glu_epilogue(const GluEpilogue& glu) override {
    if constexpr (kGlu)
      glu_ = glu;
    else
      GroupedGemm::set_glu_epilogue(glu);
  }

  void initialize(const GroupedGemmArrays& arrays, std::int64_t ld_a, std::int64_t ld_b, std::int64_t ld_d,
                  void* workspace, std::string_view what, int max_sms) override {
    check_shape_layout(what);
    upload_strides(arrays, ld_a, ld_b, ld_d);

    Arguments args = make_arguments(arrays, hw_info(0), glu_, ld_d, what);
    cutlass::Status st = Gemm::can_implement(args);
    if (st != cutlass::Status::kSuccess)
      fail_with(ErrorCode::Unsupported, what, ": CUTLASS can_implement rejected the ", name_of(kLayout), " ",
                name_of(kTile), " grouped GEMM: ", cutlassGetStatusString(st));
    init(args, workspace, what);

    // The persistent grid should hold only clusters that can be resident at once; ask the occupancy calculator
    // now that the kernel's shared-memory attribute is set, then rebuild the parameters with that count.
    const int clusters = max_active_clusters_of<Kernel, typename Cfg::Traits::Cluster>(max_sms);
    if (clusters > 0) {
      args = make_arguments(arrays, hw_info(clusters), glu_, ld_d, what);
      init(args, workspace, what);
    }
    initialized_ = true;
  }

  void run(cudaStream_t stream) override {
    if (!initialized_) fail_with(ErrorCode::Internal, "experts", "grouped GEMM run before initialize");
    const cutlass::Status st = gemm_.run(stream);
    if (st != cutlass::Status::kSuccess)
      fail_with(ErrorCode::Cuda, "experts", name_of(kLayout), " ", name_of(kTile),
                " grouped GEMM launch failed: ", cutlassGetStatusString(st), " (", cudaGetErrorString(cudaGetLastError()),
                ")");
    MOERAIL_CUDA_CHECK_LAUNCH();
  }

 private:
  // ld_d > 0: also the tensor maps of a fused epilogue that stores with them (GluEpilogueArray::kTensorStore).
  static Arguments make_arguments(const GroupedGemmArrays& a, const cutlass::KernelHardwareInfo& hw,
                                  [[maybe_unused]] const GluEpilogue& glu, [[maybe_unused]] std::int64_t ld_d,
                                  [[maybe_unused]] std::string_view what) {
    Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {a.groups, reinterpret_cast<Shape3*>(a.shapes), nullptr};  // sizes on the device only
    args.mainloop.ptr_A = reinterpret_cast<const ElementA**>(a.ptr_a);
    args.mainloop.dA = reinterpret_cast<StrideA*>(a.ld_a);
    args.mainloop.ptr_B = reinterpret_cast<const ElementB**>(a.ptr_b);
    args.mainloop.dB = reinterpret_cast<StrideB*>(a.ld_b);
    if constexpr (kGlu) {
      args.epilogue.glu = glu;
      if constexpr (Cfg::GluOp::kTensorStore) {
        if (ld_d > 0) {
          const CUresult r = Cfg::GluOp::encode_tensor_maps(args.epilogue, ld_d, a.ptr_d);
          if (r != CUDA_SUCCESS)
            fail_with(ErrorCode::Cuda, what, ": encoding the fused activation's tensor maps failed (CUresult ",
                      int(r), ")");
        }
      }
    } else {
      args.epilogue.thread.alpha = 1.0f;
      args.epilogue.thread.beta = 0.0f;
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = nullptr;
    }
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(a.ptr_d);
    args.epilogue.dD = reinterpret_cast<StrideD*>(a.ld_d);
    args.hw_info = hw;
    return args;
  }

  void init(const Arguments& args, void* workspace, std::string_view what) {
    const cutlass::Status st = gemm_.initialize(args, workspace);
    if (st != cutlass::Status::kSuccess)
      fail_with(ErrorCode::Internal, what, ": CUTLASS initialize of the ", name_of(kLayout), " ", name_of(kTile),
                " grouped GEMM failed: ", cutlassGetStatusString(st), " (", cudaGetErrorString(cudaGetLastError()),
                ")");
  }

  // The setup kernel writes GroupShape {m, n, k}; make sure cute's tuple stores them in that order.
  static void check_shape_layout(std::string_view what) {
    const Shape3 s{1, 2, 3};
    GroupShape g{};
    std::memcpy(&g, &s, sizeof g);
    if (g.m != 1 || g.n != 2 || g.k != 3)
      fail_with(ErrorCode::Internal, what, ": cute::Shape<int,int,int> is not laid out as {M, N, K}");
  }

  static void upload_strides(const GroupedGemmArrays& a, std::int64_t ld_a, std::int64_t ld_b, std::int64_t ld_d) {
    const std::size_t n = std::size_t(a.groups);
    std::vector<StrideA> sa(n, make_ld_stride<StrideA>(ld_a));
    std::vector<StrideB> sb(n, make_ld_stride<StrideB>(ld_b));
    std::vector<StrideD> sd(n, make_ld_stride<StrideD>(ld_d));
    MOERAIL_CUDA_CHECK(cudaMemcpy(a.ld_a, sa.data(), n * sizeof(StrideA), cudaMemcpyHostToDevice));
    MOERAIL_CUDA_CHECK(cudaMemcpy(a.ld_b, sb.data(), n * sizeof(StrideB), cudaMemcpyHostToDevice));
    MOERAIL_CUDA_CHECK(cudaMemcpy(a.ld_d, sd.data(), n * sizeof(StrideD), cudaMemcpyHostToDevice));
  }

  Gemm gemm_;
  GluEpilogue glu_{};
  bool initialized_ = false;
};

}  // namespace moerail::experts
