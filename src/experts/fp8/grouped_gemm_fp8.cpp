// src/experts/fp8/grouped_gemm_fp8.cpp — host launcher of the FP8 grouped GEMM (moerail/experts_fp8.h), blockwise- or
// per-tensor-scaled: argument checks, the layout of the caller's workspace, the tile choice, and the launch sequence
//   host: CUTLASS parameters over the workspace arrays  ->  setup kernel (counts -> shapes, pointers, strides,
//   scale pointers, or per-tensor each group's alpha)  ->  grouped GEMM,
// the host work first so the two launches follow each other without a gap.
#include "moerail/experts_fp8.h"

#include <algorithm>
#include <string>
#include <tuple>

#include "core/cuda_check.h"
#include "experts/fp8/gemm_fp8.h"
#include "experts/gemm_slot.h"  // Carver
#include "experts/setup.h"
#include "moerail/error.h"
#include "moerail/experts.h"  // kMaxLocalExperts
#include "moerail/quant.h"    // fp8_transposed_rows

namespace moerail {

using experts::Fp8Tile;

namespace {

constexpr std::string_view kOp = "grouped_gemm_fp8";
constexpr std::int64_t kScaleBlock = 128;  // columns of K (and rows of N) per scale
constexpr std::int64_t kTmaRowElems = 16;  // e4m3 elements per 16 bytes: TMA rows of a and b (per-tensor K)

// The caller's workspace: the per-group argument arrays the setup kernel writes, then CUTLASS's scratch.
struct Fp8Workspace {
  std::int64_t* offsets = nullptr;  // [L + 1] segment starts (written by the setup kernel; not read here)
  experts::Fp8GemmArrays arrays;
  float* alpha = nullptr;  // [L] per-tensor alpha of each group (written by the setup kernel; unused when blockwise)
  void* cutlass = nullptr;

  void carve(experts::Carver& c, int L, std::size_t cutlass_bytes) {
    const std::size_t n = std::size_t(L);
    offsets = c.take<std::int64_t>(n + 1);
    arrays.groups = L;
    arrays.shapes = c.take<experts::GroupShape>(n);
    arrays.ptr_a = c.take<const void*>(n);
    arrays.ptr_b = c.take<const void*>(n);
    arrays.ptr_d = c.take<void*>(n);
    arrays.ld_a = c.take<std::int64_t>(n);
    arrays.ld_b = c.take<std::int64_t>(n);
    arrays.ld_d = c.take<std::int64_t>(n);
    arrays.ptr_sfa = c.take<const void*>(n);
    arrays.ptr_sfb = c.take<const void*>(n);
    alpha = c.take<float>(n);
    arrays.alpha = alpha;
    cutlass = c.take<char>(std::max<std::size_t>(cutlass_bytes, 1));
  }
};

// CUTLASS's scratch for L groups: the largest of the compiled tiles, so any tile runs in any workspace.
std::size_t cutlass_workspace_bytes(int L) {
  std::size_t bytes = 0;
  for (Fp8Tile t : {Fp8Tile::Coop128x128, Fp8Tile::Ping64x128})
    bytes = std::max(bytes, experts::make_grouped_gemm_fp8(t, Fp8GemmScaling::Blockwise)->workspace_bytes(L));
  bytes = std::max(bytes, experts::make_grouped_gemm_fp8(Fp8Tile::Coop128x128, Fp8GemmScaling::PerTensor)
                              ->workspace_bytes(L));
  bytes = std::max(bytes, experts::make_gemm_fp8_wgrad_coop128x128()->workspace_bytes(L));
  bytes = std::max(bytes, experts::make_gemm_fp8_wgrad_accum_coop128x128()->workspace_bytes(L));
  for (bool e5m2_a : {false, true})
    for (bool accumulate : {false, true})
      bytes = std::max(bytes, experts::make_gemm_fp8_tensor_promoted(e5m2_a, accumulate)->workspace_bytes(L));
  return bytes;
}

// Per-tensor scaling has one tile (Cooperative128x128: fast accumulation, or promoted); Auto resolves to it and an
// explicit Pingpong64x128 is rejected in grouped_gemm_fp8 before this is reached.
Fp8Tile resolve_tile(Fp8GemmTile tile, Fp8GemmScaling scaling, std::int64_t rows, std::int64_t L, std::int64_t N,
                     std::int64_t K) {
  if (scaling == Fp8GemmScaling::PerTensor) return Fp8Tile::Coop128x128;
  switch (tile) {
    case Fp8GemmTile::Cooperative128x128: return Fp8Tile::Coop128x128;
    case Fp8GemmTile::Pingpong64x128: return Fp8Tile::Ping64x128;
    case Fp8GemmTile::Auto: break;
  }
  return experts::choose_fp8_tile(L > 0 ? rows / L : rows, N, K);
}

bool aligned(const void* p, std::uintptr_t bytes) { return (reinterpret_cast<std::uintptr_t>(p) % bytes) == 0; }

void check_view(const TensorView& t, std::string_view name, DType dtype, std::initializer_list<std::int64_t> shape,
                Device device, std::uintptr_t alignment) {
  if (!t.defined()) fail(kOp, name, " is absent but required");
  check_device(kOp, name, t, device);
  check_dtype(kOp, name, t, {dtype});
  check_shape(kOp, name, t, shape);
  if (!aligned(t.data(), alignment))
    fail(kOp, name, " at ", t.data(), " is not ", alignment, "-byte aligned",
         alignment == 16 ? " (TMA needs 16-byte rows and base addresses)" : "");
}

}  // namespace

namespace experts {

std::string_view name_of(Fp8Tile t) {
  switch (t) {
    case Fp8Tile::Coop128x128: return "coop128x128";
    case Fp8Tile::Ping64x128: return "ping64x128";
  }
  return "?";
}

std::string_view name_of(Fp8GemmScaling s) {
  switch (s) {
    case Fp8GemmScaling::Blockwise: return "blockwise";
    case Fp8GemmScaling::PerTensor: return "per-tensor";
  }
  return "?";
}

std::unique_ptr<GroupedGemmFp8> make_gemm_fp8_tensor_promoted(bool e5m2_a, bool accumulate) {
  if (e5m2_a)
    return accumulate ? make_gemm_fp8_tensor_promoted_accum_e5m2a_coop128x128()
                      : make_gemm_fp8_tensor_promoted_e5m2a_coop128x128();
  return accumulate ? make_gemm_fp8_tensor_promoted_accum_coop128x128() : make_gemm_fp8_tensor_promoted_coop128x128();
}

std::unique_ptr<GroupedGemmFp8> make_grouped_gemm_fp8(Fp8Tile tile, Fp8GemmScaling scaling) {
  if (scaling == Fp8GemmScaling::Blockwise) {
    switch (tile) {
      case Fp8Tile::Coop128x128: return make_gemm_fp8_coop128x128();
      case Fp8Tile::Ping64x128: return make_gemm_fp8_ping64x128();
    }
  } else if (scaling == Fp8GemmScaling::PerTensor && tile == Fp8Tile::Coop128x128) {
    return make_gemm_fp8_tensor_coop128x128();
  }
  fail_with(ErrorCode::Unsupported, "experts fp8", "no grouped GEMM for tile ", name_of(tile), " with ",
            name_of(scaling), " scaling (supported: coop128x128 and ping64x128 blockwise, coop128x128 per-tensor)");
}

}  // namespace experts

std::size_t grouped_gemm_fp8_workspace_bytes(std::int64_t L) {
  if (L < 1 || L > kMaxLocalExperts)
    fail(kOp, "L = ", L, " but 1 <= L <= ", kMaxLocalExperts, " experts are supported");
  Fp8Workspace ws;
  experts::Carver dry;
  ws.carve(dry, int(L), cutlass_workspace_bytes(int(L)));
  return dry.used + experts::Carver::kAlign;  // room to align the caller's base
}

const char* fp8_gemm_tile_name(Fp8GemmTile tile, std::int64_t rows, std::int64_t L, std::int64_t N,
                               std::int64_t K, Fp8GemmScaling scaling) {
  return resolve_tile(tile, scaling, rows, L, N, K) == Fp8Tile::Coop128x128 ? "coop128x128" : "ping64x128";
}

namespace {

// The current device, which must be an sm_90 one (the kernels are built for sm_90a only).
Device sm90_device(std::string_view op) {
  const int device = cuda::current_device();
  int major = 0, minor = 0;
  MOERAIL_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOERAIL_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0)
    fail_with(ErrorCode::Unsupported, op, "cuda:", device, " is sm_", major, minor,
              " but the FP8 grouped GEMM is built for sm_90a (H100/H200) only");
  return Device::cuda(device);
}

// Checks counts and workspace for L experts and carves the workspace (aligned) into `ws`.
void carve_workspace(std::string_view op, const TensorView& counts, const TensorView& workspace, std::int64_t L,
                     Device dev, Fp8Workspace& ws) {
  if (!counts.defined()) fail(op, "counts is absent but required");
  check_device(op, "counts", counts, dev);
  check_dtype(op, "counts", counts, {DType::I32, DType::I64});
  check_shape(op, "counts", counts, {L});
  if (!workspace.defined()) fail(op, "workspace is absent but required");
  check_device(op, "workspace", workspace, dev);
  const std::size_t cutlass_bytes = cutlass_workspace_bytes(int(L));
  experts::Carver dry;
  ws.carve(dry, int(L), cutlass_bytes);
  const std::size_t need = dry.used + experts::Carver::kAlign;
  if (workspace.nbytes() < need)
    fail(op, "workspace has ", workspace.nbytes(), " bytes but grouped_gemm_fp8_workspace_bytes(", L, ") = ", need,
         " are needed");
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(workspace.data());
  const std::uintptr_t aligned_base = (base + experts::Carver::kAlign - 1) / experts::Carver::kAlign *
                                      experts::Carver::kAlign;
  experts::Carver real{reinterpret_cast<char*>(aligned_base)};
  ws.carve(real, int(L), cutlass_bytes);
}

// The setup kernel's parameters for one GEMM over the workspace arrays (operands, sizes and scales still to fill).
experts::SetupParams one_gemm_setup(const TensorView& counts, std::int64_t L, std::int64_t rows,
                                    const Fp8Workspace& ws) {
  experts::SetupParams p;
  p.counts = counts.data();
  p.counts_i64 = counts.dtype() == DType::I64;
  p.L = int(L);
  p.rows = rows;
  p.offsets = ws.offsets;
  p.num_gemms = 1;
  experts::GemmSetup& g = p.gemm[0];
  g.arrays.groups = int(L);
  g.arrays.shapes = ws.arrays.shapes;
  g.arrays.ptr_a = ws.arrays.ptr_a;
  g.arrays.ptr_b = ws.arrays.ptr_b;
  g.arrays.ptr_d = ws.arrays.ptr_d;
  g.arrays.ld_a = ws.arrays.ld_a;
  g.arrays.ld_b = ws.arrays.ld_b;
  g.arrays.ld_d = ws.arrays.ld_d;
  return p;
}

}  // namespace

void grouped_gemm_fp8(const Fp8GroupedGemmArgs& a, cudaStream_t stream) {
  const Device dev = sm90_device(kOp);

  // Sizes come from a [rows, K] and b [L, N, K]; every other view is checked against them.
  if (!a.a.defined()) fail(kOp, "a is absent but required");
  if (!a.b.defined()) fail(kOp, "b is absent but required");
  const bool blockwise = a.scaling == Fp8GemmScaling::Blockwise;
  if (!blockwise && a.scaling != Fp8GemmScaling::PerTensor)
    fail(kOp, "scaling = ", int(a.scaling), " but Blockwise or PerTensor is supported");
  const bool e5m2_a = a.a.dtype() == DType::F8E5M2;
  if (e5m2_a && (blockwise || !a.promote))
    fail_with(ErrorCode::Unsupported, kOp, "a is fp8_e5m2, which runs with PerTensor scaling and promote = true only "
              "(the hybrid recipe's gradients; scaling = ", experts::name_of(a.scaling), ", promote = ", a.promote ? "true" : "false",
              ")");
  check_view(a.a, "a", e5m2_a ? DType::F8E5M2 : DType::F8E4M3, {-1, -1}, dev, 16);
  check_view(a.b, "b", DType::F8E4M3, {-1, -1, -1}, dev, 16);
  const std::int64_t rows = a.a.size(0), K = a.a.size(1);
  const std::int64_t L = a.b.size(0), N = a.b.size(1);
  if (a.b.size(2) != K) fail(kOp, "b has shape ", a.b.shape_str(), " but K = ", K, " (a is ", a.a.shape_str(), ")");
  if (!blockwise && a.tile == Fp8GemmTile::Pingpong64x128)
    fail_with(ErrorCode::Unsupported, kOp, "tile = Pingpong64x128 with PerTensor scaling, but per-tensor scaling is "
              "compiled for Cooperative128x128 only (pass it or Auto)");
  if (blockwise && (K <= 0 || K % kScaleBlock != 0))
    fail(kOp, "K = ", K, " is not a positive multiple of ", kScaleBlock, " (the 1x128 / 128x128 scale blocks)");
  if (!blockwise && (K <= 0 || K % kTmaRowElems != 0))
    fail(kOp, "K = ", K, " is not a positive multiple of ", kTmaRowElems, " (16-byte rows of fp8 a and b)");
  if (N <= 0 || N % 8 != 0) fail(kOp, "N = ", N, " is not a positive multiple of 8 (16-byte rows of bf16 d)");
  if (L < 1 || L > kMaxLocalExperts)
    fail(kOp, "b has L = ", L, " experts but 1 <= L <= ", kMaxLocalExperts, " is supported");
  constexpr std::int64_t kMax32 = (std::int64_t(1) << 31) - 1;
  if (rows > kMax32 || N > kMax32 || K > kMax32)
    fail(kOp, "rows = ", rows, ", N = ", N, ", K = ", K, " but each must be below 2^31 (32-bit GEMM sizes)");
  const std::int64_t kb = K / kScaleBlock, nb = (N + kScaleBlock - 1) / kScaleBlock;
  bool a_scale_per_expert = false, b_scale_per_expert = false;
  if (blockwise) {
    check_view(a.a_scales, "a_scales", DType::F32, {rows, kb}, dev, 4);
    check_view(a.b_scales, "b_scales", DType::F32, {L, nb, kb}, dev, 4);
  } else {
    for (const auto& [name, v, per_expert] : {std::tuple{"a_scales", &a.a_scales, &a_scale_per_expert},
                                              std::tuple{"b_scales", &a.b_scales, &b_scale_per_expert}}) {
      check_view(*v, name, DType::F32, {-1}, dev, 4);
      if (v->size(0) != 1 && v->size(0) != L)
        fail(kOp, name, " has shape ", v->shape_str(), " but per-tensor scaling takes [1] or [L] = [", L, "] f32");
      *per_expert = v->size(0) == L && L > 1;
    }
  }
  check_view(a.d, "d", DType::BF16, {rows, N}, dev, 16);
  Fp8Workspace ws;
  carve_workspace(kOp, a.counts, a.workspace, L, dev, ws);

  const Fp8Tile tile = resolve_tile(a.tile, a.scaling, rows, L, N, K);

  // Host: the kernel parameters (TMA descriptors over the arrays' fixed addresses; sizes come later, on the device).
  const std::unique_ptr<experts::GroupedGemmFp8> gemm = !blockwise && a.promote
                                                           ? experts::make_gemm_fp8_tensor_promoted(e5m2_a, false)
                                                           : experts::make_grouped_gemm_fp8(tile, a.scaling);
  gemm->initialize(ws.arrays, ws.cutlass, stream, kOp);

  // Device: counts -> per-group shapes, pointers, strides and scale pointers; then the GEMM.
  experts::SetupParams p = one_gemm_setup(a.counts, L, rows, ws);
  experts::GemmSetup& g = p.gemm[0];
  // Operands as {base, bytes per row (times the segment start), bytes per expert, no per-expert table}.
  g.a = {static_cast<const char*>(a.a.data()), K, 0, -1};
  g.b = {static_cast<const char*>(a.b.data()), 0, N * K, -1};
  g.d = {static_cast<const char*>(a.d.data()), N * 2, 0, -1};
  if (blockwise) {
    g.sfa = {static_cast<const char*>(a.a_scales.data()), kb * 4, 0, -1};
    g.sfb = {static_cast<const char*>(a.b_scales.data()), 0, nb * kb * 4, -1};
    g.ptr_sfa = ws.arrays.ptr_sfa;
    g.ptr_sfb = ws.arrays.ptr_sfb;
  } else {
    g.alpha = ws.alpha;
    g.alpha_a = static_cast<const float*>(a.a_scales.data());
    g.alpha_b = static_cast<const float*>(a.b_scales.data());
    g.alpha_a_per_expert = a_scale_per_expert;
    g.alpha_b_per_expert = b_scale_per_expert;
  }
  g.m = experts::kRagged;
  g.n = int(N);
  g.k = int(K);
  g.ld_a = K;
  g.ld_b = K;
  g.ld_d = N;
  experts::launch_setup(p, nullptr, stream);
  gemm->run(stream);
}

void grouped_gemm_fp8_dgrad(const Fp8DgradArgs& a, cudaStream_t stream) {
  try {
    grouped_gemm_fp8(fp8_dgrad_gemm_args(a), stream);
  } catch (const Error& e) {
    throw Error(e.code(), std::string("grouped_gemm_fp8_dgrad (a = dy, a_scales = dy_scales, b = wt, b_scales = "
                                      "wt_scales, d = dx): ") + e.what());
  }
}

void grouped_gemm_fp8_wgrad(const Fp8WgradArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "grouped_gemm_fp8_wgrad";
  const Device dev = sm90_device(op);
  if (!a.dw.defined()) fail(op, "dw is absent but required");
  check_device(op, "dw", a.dw, dev);
  if (a.accumulate && a.dw.dtype() != DType::F32)
    fail(op, "accumulate = true adds into fp32 gradients, but dw is ", dtype_name(a.dw.dtype()));
  check_dtype(op, "dw", a.dw, {a.accumulate ? DType::F32 : DType::BF16});
  check_shape(op, "dw", a.dw, {-1, -1, -1});
  const std::int64_t L = a.dw.size(0), N = a.dw.size(1), K = a.dw.size(2);
  if (L < 1 || L > kMaxLocalExperts)
    fail(op, "dw has L = ", L, " experts but 1 <= L <= ", kMaxLocalExperts, " is supported");
  if (N <= 0 || N % 64 != 0 || K <= 0 || K % 64 != 0)
    fail(op, "dw has shape ", a.dw.shape_str(), " but N and K must be positive multiples of 64 (the tiles of "
         "quantize_fp8_transposed)");
  if (!aligned(a.dw.data(), 16)) fail(op, "dw at ", a.dw.data(), " is not 16-byte aligned");
  if (a.rows < 0) fail(op, "rows = ", a.rows, " but it must be >= 0");
  const std::int64_t rows_t = fp8_transposed_rows(a.rows, L);
  constexpr std::int64_t kMax32 = (std::int64_t(1) << 31) - 1;
  if (rows_t > kMax32 || N > kMax32 || K > kMax32)
    fail(op, "fp8_transposed_rows(rows = ", a.rows, ", L) = ", rows_t, ", N = ", N, ", K = ", K,
         " but each must be below 2^31 (32-bit GEMM sizes)");
  const bool tensor = a.scaling == Fp8GemmScaling::PerTensor;
  if (!tensor && a.scaling != Fp8GemmScaling::Blockwise)
    fail(op, "scaling = ", int(a.scaling), " but Blockwise or PerTensor is supported");
  bool per_expert[2] = {false, false};  // PerTensor: dyt_scales, xt_scales [L] (else [1])
  const bool e5m2_a = a.dyt.defined() && a.dyt.dtype() == DType::F8E5M2;  // the hybrid recipe's gradient copies
  if (e5m2_a && !tensor)
    fail_with(ErrorCode::Unsupported, op, "dyt is fp8_e5m2, which runs with PerTensor scaling only (the hybrid "
              "recipe's gradients)");
  auto check_copy = [&](const TensorView& t, const TensorView& s, std::string_view name, std::string_view sname,
                        std::int64_t C, bool& s_per_expert, DType codes) {
    if (!t.defined()) fail(op, name, " is absent but required");
    check_device(op, name, t, dev);
    check_dtype(op, name, t, {codes});
    check_shape(op, name, t, {C * rows_t});
    if (!aligned(t.data(), 16)) fail(op, name, " at ", t.data(), " is not 16-byte aligned");
    if (!s.defined()) fail(op, sname, " is absent but required");
    check_device(op, sname, s, dev);
    check_dtype(op, sname, s, {DType::F32});
    if (tensor) {
      check_shape(op, sname, s, {-1});
      if (s.size(0) != 1 && s.size(0) != L)
        fail(op, sname, " has shape ", s.shape_str(), " but per-tensor scaling takes [1] or [L] = [", L, "] f32");
      s_per_expert = s.size(0) == L && L > 1;
    } else {
      check_shape(op, sname, s, {C * rows_t / kScaleBlock});
    }
    if (!aligned(s.data(), 4)) fail(op, sname, " at ", s.data(), " is not 4-byte aligned");
  };
  check_copy(a.dyt, a.dyt_scales, "dyt", "dyt_scales", N, per_expert[0], e5m2_a ? DType::F8E5M2 : DType::F8E4M3);
  check_copy(a.xt, a.xt_scales, "xt", "xt_scales", K, per_expert[1], DType::F8E4M3);
  Fp8Workspace ws;
  carve_workspace(op, a.counts, a.workspace, L, dev, ws);

  const std::unique_ptr<experts::GroupedGemmFp8> gemm =
      tensor ? experts::make_gemm_fp8_tensor_promoted(e5m2_a, a.accumulate)
             : (a.accumulate ? experts::make_gemm_fp8_wgrad_accum_coop128x128()
                             : experts::make_gemm_fp8_wgrad_coop128x128());
  gemm->initialize(ws.arrays, ws.cutlass, stream, op);

  // Device: counts -> the padded blocks' shapes {N, K, R_e}, pointers, leading dimensions R_e; empty experts
  // zeroed; then the GEMM.
  experts::SetupParams p = one_gemm_setup(a.counts, L, a.rows, ws);
  p.pad = kScaleBlock;
  experts::GemmSetup& g = p.gemm[0];
  // Blocks start at N * P_e (dyt) and K * P_e (xt) codes, their scales at N * P_e / 128 and K * P_e / 128 floats.
  g.a = {static_cast<const char*>(a.dyt.data()), N, 0, -1};
  g.b = {static_cast<const char*>(a.xt.data()), K, 0, -1};
  const std::int64_t out_bytes = a.accumulate ? 4 : 2;
  g.d = {static_cast<const char*>(a.dw.data()), 0, N * K * out_bytes, -1};
  if (tensor) {  // alpha_e = dyt_scales[e] * xt_scales[e] in the epilogue
    g.alpha = ws.alpha;
    g.alpha_a = a.dyt_scales.as<const float>();
    g.alpha_b = a.xt_scales.as<const float>();
    g.alpha_a_per_expert = per_expert[0];
    g.alpha_b_per_expert = per_expert[1];
  } else {
    g.sfa = {static_cast<const char*>(a.dyt_scales.data()), N * 4 / kScaleBlock, 0, -1};
    g.sfb = {static_cast<const char*>(a.xt_scales.data()), K * 4 / kScaleBlock, 0, -1};
    g.ptr_sfa = ws.arrays.ptr_sfa;
    g.ptr_sfb = ws.arrays.ptr_sfb;
  }
  g.m = int(N);
  g.n = int(K);
  g.k = experts::kRagged;
  g.ld_a = experts::kRagged;
  g.ld_b = experts::kRagged;
  g.ld_d = K;
  experts::launch_setup(p, nullptr, stream);
  if (!a.accumulate) {  // empty experts are empty groups (no tiles): zeros written, or (accumulating) left alone
    experts::ZeroEmptyParams z;
    z.offsets = ws.offsets;
    z.L = int(L);
    z.ptr_d[0] = ws.arrays.ptr_d;
    z.bytes[0] = N * K * 2;
    z.num = 1;
    experts::launch_zero_empty(z, stream);
  }
  gemm->run(stream);
}

}  // namespace moerail
