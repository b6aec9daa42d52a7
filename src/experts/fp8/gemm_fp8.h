// src/experts/fp8/gemm_fp8.h — the FP8 grouped GEMMs behind moerail/experts_fp8.h: a small type-erased
// interface so that each CUTLASS instantiation lives in its own .cu (minutes of nvcc each) and the host launcher
// (grouped_gemm_fp8.cpp) never includes CUTLASS; and the one rule that chooses the tile.
//
// Every GEMM here is e4m3 x e4m3 (or, per-tensor promoted, e5m2 x e4m3) -> bf16 or added into fp32, TN (A [M,K] and
// B [N,K] both K-major: Hopper's fp8 wgmma reads only K-major shared-memory operands), with 1x128 (A) and 128x128 (B) fp32 block scales applied per 128-wide K block
// (CUTLASS 4.2 KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8BlockScaledAccum with moerail's consumer
// loop, overlapped_mainloop.cuh), or, for per-tensor
// scaling, one fp32 alpha per group applied in the epilogue after fast accumulation (one instantiation only:
// KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum, 128x128x128, cluster 1x2), problem shapes read from
// device memory (host_problem_shapes = nullptr). Unlike the bf16 GEMMs, nothing is initialized once: the per-group
// arrays, strides included, are rewritten by the setup kernel on every call, and the host builds the kernel
// parameters on every call, so the public function needs no object and only a caller's workspace.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "experts/grouped/grouped_gemm.h"  // GroupShape
#include "moerail/experts_fp8.h"     // Fp8GemmScaling

namespace moerail::experts {

// The compiled FP8 kernel configurations (cluster 1x2x1 for both: ragged-M GEMMs pair CTAs along N, as the bf16 ones).
enum class Fp8Tile {
  Coop128x128,  // cooperative, 128x128x128: two consumer warpgroups share each tile (64x128 each)
  Ping64x128,   // ping-pong, 64x128x128: each consumer warpgroup its own tile, one's epilogue under the other's MMAs
};

std::string_view name_of(Fp8Tile t);
std::string_view name_of(Fp8GemmScaling s);

// Why these two, and no wider tile: the blockwise-scaled mainloop keeps three fp32 values per output (the promoted
// sum and two per-K-block wgmma results, one promoted while the other is computed: overlapped_mainloop.cuh), so a
// consumer warpgroup holding 64x128 outputs already uses 3 x 64 registers per thread for them; 64x256 (a 128x256
// cooperative tile) would need 384 and does not fit.
// N tiles must be multiples of the 128-wide weight scale blocks. So 128x128 cooperative (the B tile is shared by
// both warpgroups: half the weight traffic per output of 64x128 ping-pong) is the default, and 64x128 ping-pong is
// kept for experts with few rows, where a 128-row tile is mostly padding.
// avg_rows: rows per expert (buffer rows / L); n, k: GEMM N and K. Measured (H100, docs/experts.md): on the
// deepseek-v3, qwen3 and mixtral shapes (256 to 2048 rows per expert) ping-pong was slower on every GEMM, so the rule
// only keeps it for experts with at most 64 rows, which no measured shape has; `moerail bench mlp-fp8` records both.
constexpr Fp8Tile choose_fp8_tile(std::int64_t avg_rows, std::int64_t n, std::int64_t k) {
  (void)n;
  (void)k;
  return avg_rows <= 64 ? Fp8Tile::Ping64x128 : Fp8Tile::Coop128x128;
}

// Device arrays of one FP8 grouped GEMM, `groups` entries each, all written by the setup kernel before the GEMM.
struct Fp8GemmArrays {
  int groups = 0;
  GroupShape* shapes = nullptr;
  const void** ptr_a = nullptr;    // e4m3 A_g [M_g, K], row stride ld_a
  const void** ptr_b = nullptr;    // e4m3 B_g [N, K], row stride ld_b
  void** ptr_d = nullptr;          // bf16 D_g [M_g, N] (f32 for the accumulating wgrad, also read), row stride ld_d
  std::int64_t* ld_a = nullptr;    // leading dimensions in elements (each CUTLASS stride here is one int64)
  std::int64_t* ld_b = nullptr;
  std::int64_t* ld_d = nullptr;
  const void** ptr_sfa = nullptr;  // f32 [M_g, K/128] row-major (K-major)
  const void** ptr_sfb = nullptr;  // f32 [ceil(N/128), K/128] row-major (K-major)
  const float* alpha = nullptr;    // per-tensor only: [groups] f32, a_scale * b_scale of each group
};

class GroupedGemmFp8 {
 public:
  virtual ~GroupedGemmFp8() = default;
  virtual Fp8Tile tile() const = 0;
  virtual Fp8GemmScaling scaling() const = 0;

  // Bytes of CUTLASS workspace (TMA descriptors per SM) for `groups` groups on the current device.
  virtual std::size_t workspace_bytes(int groups) const = 0;

  // Host only (no allocation, no sync, capturable): checks can_implement, builds the kernel parameters over
  // `arrays` and `workspace` (which must hold workspace_bytes(arrays.groups) bytes, 128-byte aligned) and sets the
  // kernel's shared-memory attribute. Throws Error(Unsupported/Internal) naming `what`.
  virtual void initialize(const Fp8GemmArrays& arrays, void* workspace, cudaStream_t stream,
                          std::string_view what) = 0;

  // One launch on `stream` with the parameters of the last initialize().
  virtual void run(cudaStream_t stream) = 0;
};

// The instantiations, one per .cu file (gemm_fp8_<tile>.cu blockwise, gemm_fp8_tensor_<tile>.cu per-tensor), and the
// typed dispatch over them (Error(Unsupported) listing the compiled pairs for any other).
std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_coop128x128();
std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_ping64x128();
std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_tensor_coop128x128();
// The weight gradient's GEMMs (grouped_gemm_fp8_wgrad): blockwise, 1x128 scales on A and on B (gemm_fp8_wgrad_*.cu).
// One tile: ping-pong 64x128 measured slower on deepseek-v3's weight gradients, as on the forward's (docs/fp8.md).
std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_wgrad_coop128x128();
// The same GEMM with fp32 outputs added into (D = acc + D in place): weight gradients accumulated into fp32 main
// gradients (gemm_fp8_wgrad_accum_coop128x128.cu).
std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_wgrad_accum_coop128x128();
// Per-tensor with the partial sums promoted every 128 elements of K (Fp8GroupedGemmArgs::promote, the per-tensor
// weight gradients): bf16 out, and fp32 added into (gemm_fp8_tensor_promoted_*.cu).
std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_tensor_promoted_coop128x128();
std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_tensor_promoted_accum_coop128x128();
// The same two with an e5m2 A operand (the hybrid recipe's gradients: dgrads and weight gradients), B e4m3
// (gemm_fp8_tensor_promoted_*e5m2a_coop128x128.cu).
std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_tensor_promoted_e5m2a_coop128x128();
std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_tensor_promoted_accum_e5m2a_coop128x128();
// The promoted per-tensor GEMM of A's format (e4m3 or e5m2) writing bf16 or (accumulate) adding into fp32.
std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_tensor_promoted(bool e5m2_a, bool accumulate);
std::unique_ptr<GroupedGemmFp8> make_grouped_gemm_fp8(Fp8Tile tile, Fp8GemmScaling scaling);

}  // namespace moerail::experts
