// src/experts/grouped/grouped_gemm.h — the grouped GEMMs of the expert MLP, behind a small type-erased interface so that
// each CUTLASS instantiation lives in its own .cu (they take minutes each to compile; separate files build in
// parallel) and the host launcher never includes CUTLASS.
//
// Every GEMM here is bf16 x bf16 -> bf16 with fp32 accumulation, D = A B (no source C), run by CUTLASS 4.2's SM90
// ptr-array grouped kernel with the problem shapes in device memory (host_problem_shapes = nullptr): G groups,
// group g computes D_g [M_g, N_g] = A_g [M_g, K_g] B_g [K_g, N_g]. The per-group arrays (shapes, pointers, leading
// dimensions) live at fixed device addresses given at initialize(); the setup kernel (setup.cu) rewrites shapes
// and pointers on the stream before each run(), so a captured graph replays with whatever the device counts say.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "experts/elementwise.h"  // ActShape
#include "experts/gemm_kinds.h"   // GemmLayout, GemmTile

namespace moerail::experts {

std::string_view name_of(GemmLayout l);
std::string_view name_of(GemmTile t);

// One group's problem size as the CUTLASS kernel reads it (cute::Shape<int,int,int>: M, N, K in that order;
// checked against the CUTLASS type at initialize()).
struct GroupShape {
  int m, n, k;
};

// Device arrays of one grouped GEMM, `groups` entries each, at addresses fixed for the GEMM's lifetime.
struct GroupedGemmArrays {
  int groups = 0;
  GroupShape* shapes = nullptr;   // written by the setup kernel before each run
  const void** ptr_a = nullptr;   // element pointers of A_g, B_g, D_g; written by the setup kernel
  const void** ptr_b = nullptr;
  void** ptr_d = nullptr;
  std::int64_t* ld_a = nullptr;   // leading dimensions in elements (the CUTLASS stride types hold exactly this
  std::int64_t* ld_b = nullptr;   // one int64 for ptr-array layouts; written once by initialize())
  std::int64_t* ld_d = nullptr;
};

// FC1's fused activation epilogue (glu_epilogue.cuh): beside D_g = h1_g it writes act_g = p * act(h1_g), adding the
// bias to h1 first. Device arrays of `groups` entries at fixed addresses, written by the setup kernel.
struct GluEpilogue {
  void* const* act = nullptr;           // act_g: [M_g, shape.F] bf16 rows
  const float* const* probs = nullptr;  // p_g: [M_g] f32, or nullptr (p = 1)
  const void* const* bias = nullptr;    // b1_g: [N] bf16, or nullptr
  ActShape shape;                       // a GLU kind, Interleaved, g a multiple of 8 with 2g dividing the tile's N
};

class GroupedGemm {
 public:
  virtual ~GroupedGemm() = default;
  virtual GemmLayout layout() const = 0;
  virtual GemmTile tile() const = 0;

  // Bytes of device workspace the kernel needs (tensormaps per SM), for `groups` groups on the current device.
  virtual std::size_t workspace_bytes(int groups) const = 0;

  // Setup, outside capture: writes the leading dimensions (same for every group) into arrays.ld_*, checks
  // can_implement, builds the kernel parameters and sets the kernel's shared-memory attribute. `workspace` must
  // hold workspace_bytes(arrays.groups) bytes and stay at its address. Synchronizes the device (setup only).
  // max_sms > 0: the persistent grid holds the clusters of at most that many SMs (MlpOptions::sms). Throws
  // Error(Internal/Unsupported/Cuda) naming `what` (e.g. "experts fc1") on failure.
  virtual void initialize(const GroupedGemmArrays& arrays, std::int64_t ld_a, std::int64_t ld_b,
                          std::int64_t ld_d, void* workspace, std::string_view what, int max_sms) = 0;

  // One launch on `stream`: no allocation, no host sync, graph-capturable.
  virtual void run(cudaStream_t stream) = 0;
  // Fused-activation instantiations only (make_grouped_gemm_glu), before initialize().
  virtual void set_glu_epilogue(const GluEpilogue& glu);
};

// The instantiations, one per .cu file (gemm_<layout>_<tile>.cu).
std::unique_ptr<GroupedGemm> make_gemm_tn_coop128x256();
std::unique_ptr<GroupedGemm> make_gemm_tn_ping128x128();
std::unique_ptr<GroupedGemm> make_gemm_nn_coop128x256();
std::unique_ptr<GroupedGemm> make_gemm_nn_ping128x128();
std::unique_ptr<GroupedGemm> make_gemm_wgrad_coop128x256();
std::unique_ptr<GroupedGemm> make_gemm_wgrad_ping128x128();
// FC1 with the activation in its epilogue (GluEpilogue), on either tile.
std::unique_ptr<GroupedGemm> make_gemm_tn_ping128x128_glu();
std::unique_ptr<GroupedGemm> make_gemm_tn_coop128x256_glu();
// FC1 with the activation in its epilogue on `tile`.
std::unique_ptr<GroupedGemm> make_grouped_gemm_glu(GemmTile tile);

// Typed dispatch over the instantiations above; the error lists the supported combinations.
std::unique_ptr<GroupedGemm> make_grouped_gemm(GemmLayout layout, GemmTile tile);

}  // namespace moerail::experts
