// Host launchers of the permute ops (include/moerail/permute.h): argument checks, vector width, grid size.
// Kernels: permute_kernels.cuh. Bytes moved (the model docs/kernels.md and the benchmark use), N routed rows,
// P pad rows, row = H * element size:
//   permute_forward     T * row read + (N + P) * row written  (+ probs: 4 T K read, 4 (N + P) written)
//   permute_backward    N * row read + T * row written
//   unpermute_forward   N * row read + T * row written
//   unpermute_backward  T * row read + (N + P) * row written (+ N * row read for the InCombine dot)
//   permute_forward_fp8 T * H * 2 (bf16 x) or T * (H + scale row) (e4m3 q) read + (N + P) * (H + scale row) written,
//                       scale row = 4 H / 128 (1x128), H / 32 (MXFP8), 0 (per-tensor)
#include "moerail/permute.h"

#include <string>

#include "core/cuda_check.h"
#include "permute/permute_fp8_kernels.cuh"
#include "permute/permute_kernels.cuh"

namespace moerail {
namespace {

using namespace permute_detail;

constexpr int kMaxTopK = 32;  // one lane per slot

// ---- argument checks ----------------------------------------------------------------------------------------

struct Shapes {
  std::int64_t T_max, H, K, E, capacity;
  Device dev;
};

Shapes common_checks(std::string_view op, const MoeConfig& cfg, const LayoutBuffers& layout,
                     const TensorView& num_tokens, bool needs_pad_arrays) {
  cfg.validate();
  if (cfg.ep_size != 1)
    fail_with(ErrorCode::Unsupported, op, "cfg.ep_size = ", cfg.ep_size,
              " but these are the one-GPU ops (expected ep_size = 1; use dispatch for R > 1)");
  if (cfg.topk > kMaxTopK)
    fail_with(ErrorCode::Unsupported, op, "topk = ", cfg.topk, " but at most ", kMaxTopK, " are supported");
  const Shapes s{cfg.max_tokens, cfg.hidden, cfg.topk, cfg.num_experts, layout.capacity,
                 Device::cuda(cuda::current_device())};
  auto i32 = [&](std::string_view name, const TensorView& v, std::initializer_list<std::int64_t> shape) {
    check_shape(op, name, v, shape);
    check_dtype(op, name, v, {DType::I32});
    check_device(op, name, v, s.dev);
  };
  i32("num_tokens", num_tokens, {1});
  i32("layout.dest_row", layout.dest_row, {s.T_max, s.K});
  if (needs_pad_arrays) {
    i32("layout.tokens_per_expert", layout.tokens_per_expert, {s.E});
    i32("layout.segment_offset", layout.segment_offset, {s.E + 1});
    i32("layout.pad_prefix", layout.pad_prefix, {s.E + 1});
  }
  if (s.capacity < 0 || s.capacity > 0x7fffffff)
    fail(op, "layout.capacity = ", s.capacity, " but 0 <= capacity < 2^31 rows was expected");
  return s;
}

void check_act(std::string_view op, std::string_view name, const TensorView& v, std::int64_t rows, bool at_least,
               const Shapes& s, DType dtype) {
  check_shape(op, name, v, {at_least ? -1 : rows, s.H});
  check_dtype(op, name, v, {dtype});
  check_device(op, name, v, s.dev);
  if (at_least && v.size(0) < rows)
    fail(op, name, " has ", v.size(0), " rows but layout.capacity = ", rows, " (expected at least that many)");
}

void check_f32(std::string_view op, std::string_view name, const TensorView& v,
               std::initializer_list<std::int64_t> shape, const Shapes& s) {
  check_shape(op, name, v, shape);
  check_dtype(op, name, v, {DType::F32});
  check_device(op, name, v, s.dev);
}

void check_act_dtype(std::string_view op, std::string_view name, const TensorView& v) {
  check_dtype(op, name, v, {DType::BF16, DType::F16, DType::F32});
}

void check_probs_vec(std::string_view op, std::string_view name, const TensorView& v, std::int64_t rows,
                     const Shapes& s) {
  check_shape(op, name, v, {-1});
  check_dtype(op, name, v, {DType::F32});
  check_device(op, name, v, s.dev);
  if (v.size(0) < rows) fail(op, name, " has ", v.size(0), " elements but layout.capacity = ", rows);
}

// ---- launch configuration (one place) -------------------------------------------------------------------------

// 16-byte vectors when every row starts 16-byte aligned; else one element at a time.
bool use_vec16(std::int64_t H, DType dtype, std::initializer_list<const void*> rows) {
  if ((H * std::int64_t(dtype_size(dtype))) % 16 != 0) return false;
  for (const void* p : rows)
    if (p != nullptr && !cuda::aligned16(p)) return false;
  return true;
}

// Persistent grid: one warp per item, as many blocks as fit on all SMs at once (occupancy computed once per
// kernel: the kernel is a template argument, so every instance has its own cache — instances share a function type),
// never more than the largest possible number of items needs.
template <auto Kernel>
int grid_for(std::int64_t max_items) {
  if (max_items <= 0) return 0;
  static const int blocks_per_sm = [] {
    int n = 0;
    MOERAIL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0));
    return n > 0 ? n : 1;
  }();
  const std::int64_t warps = kThreads / kWarp;
  return int(cuda::persistent_grid((max_items + warps - 1) / warps, blocks_per_sm));
}

template <typename T, int VB, ScatterMode Mode>
void launch_scatter(const ScatterParams& p, std::int64_t max_items, cudaStream_t stream) {
  const int grid = grid_for<scatter_kernel<T, VB, Mode>>(max_items);
  if (grid == 0) return;
  scatter_kernel<T, VB, Mode><<<grid, kThreads, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

template <typename T, int VB>
void launch_gather(const GatherParams& p, std::int64_t max_items, cudaStream_t stream) {
  const int grid = grid_for<gather_kernel<T, VB>>(max_items);
  if (grid == 0) return;
  gather_kernel<T, VB><<<grid, kThreads, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

template <ScatterMode Mode>
void scatter(DType dtype, bool vec16, ScatterParams p, std::int64_t H, std::int64_t max_items, cudaStream_t stream) {
  cuda::dispatch_float_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (vec16) {
      p.nvec = H * std::int64_t(sizeof(T)) / 16;
      launch_scatter<T, 16, Mode>(p, max_items, stream);
    } else {
      p.nvec = H;
      launch_scatter<T, int(sizeof(T)), Mode>(p, max_items, stream);
    }
  });
}

void gather(DType dtype, bool vec16, GatherParams p, std::int64_t H, std::int64_t max_items, cudaStream_t stream) {
  cuda::dispatch_float_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (vec16) {
      p.nvec = H * std::int64_t(sizeof(T)) / 16;
      launch_gather<T, 16>(p, max_items, stream);
    } else {
      p.nvec = H;
      launch_gather<T, int(sizeof(T))>(p, max_items, stream);
    }
  });
}

// Largest number of pad rows any plan can have: E * (A - 1).
std::int64_t max_pad_rows(const MoeConfig& cfg) { return cfg.num_experts * (cfg.align - 1); }

// The FP8 scatter: one kernel per (source, recipe), each with its own occupancy (grid_for).
template <auto Kernel>
void launch_fp8(const Fp8ScatterParams& p, std::int64_t max_items, cudaStream_t stream) {
  const int grid = grid_for<Kernel>(max_items);
  if (grid == 0) return;
  Kernel<<<grid, kThreads, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

template <Fp8Source Src>
void scatter_fp8(Fp8Scaling scaling, const Fp8ScatterParams& p, std::int64_t max_items, cudaStream_t stream) {
  switch (scaling) {
    case Fp8Scaling::PerTensor:
      launch_fp8<fp8_scatter_kernel<Src, Fp8Scaling::PerTensor>>(p, max_items, stream);
      return;
    case Fp8Scaling::Block1x128:
      launch_fp8<fp8_scatter_kernel<Src, Fp8Scaling::Block1x128>>(p, max_items, stream);
      return;
    case Fp8Scaling::Mx1x32:
      launch_fp8<fp8_scatter_kernel<Src, Fp8Scaling::Mx1x32>>(p, max_items, stream);
      return;
  }
}

const char* given(const TensorView& v) { return v.defined() ? "given" : "absent"; }

void check_aligned16(std::string_view op, std::string_view name, const TensorView& v) {
  if (!v.empty() && !cuda::aligned16(v.data()))
    fail_with(ErrorCode::Unsupported, op, name, " at address ", v.data(),
              " is not 16-byte aligned (the FP8 permute moves rows in 16-byte vectors)");
}

}  // namespace

// ---- the ops ------------------------------------------------------------------------------------------------------

void permute_forward(const MoeConfig& cfg, const PermuteArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "permute_forward";
  const Shapes s = common_checks(op, cfg, a.layout, a.num_tokens, true);
  check_act_dtype(op, "x", a.x);
  check_act(op, "x", a.x, s.T_max, false, s, a.x.dtype());
  check_act(op, "recv", a.recv, s.capacity, true, s, a.x.dtype());
  if (a.probs.defined() != a.recv_probs.defined())
    fail(op, "probs is ", a.probs.defined() ? "given" : "absent", " but recv_probs is ",
         a.recv_probs.defined() ? "given" : "absent", " (expected both or neither)");
  if (a.probs.defined()) {
    check_f32(op, "probs", a.probs, {s.T_max, s.K}, s);
    check_probs_vec(op, "recv_probs", a.recv_probs, s.capacity, s);
  }
  ScatterParams p{};
  p.src = a.x.data();
  p.probs = a.probs.defined() ? a.probs.as<const float>() : nullptr;
  p.num_tokens = a.num_tokens.as<const std::int32_t>();
  p.dest_row = a.layout.dest_row.as<const std::int32_t>();
  p.tokens_per_expert = a.layout.tokens_per_expert.as<const std::int32_t>();
  p.segment_offset = a.layout.segment_offset.as<const std::int32_t>();
  p.pad_prefix = a.layout.pad_prefix.as<const std::int32_t>();
  p.dst = a.recv.data();
  p.dst_probs = a.recv_probs.defined() ? a.recv_probs.as<float>() : nullptr;
  p.t_max = int(s.T_max);
  p.K = int(s.K);
  p.E = int(s.E);
  p.capacity = int(s.capacity);
  const bool vec = use_vec16(s.H, a.x.dtype(), {a.x.data(), a.recv.data()});
  scatter<ScatterMode::Copy>(a.x.dtype(), vec, p, s.H, s.T_max + max_pad_rows(cfg), stream);
}

void permute_forward_fp8(const MoeConfig& cfg, const PermuteFp8Args& a, cudaStream_t stream) {
  constexpr std::string_view op = "permute_forward_fp8";
  const Shapes s = common_checks(op, cfg, a.layout, a.num_tokens, true);
  const Fp8Scaling scaling = a.scaling;
  if (scaling != Fp8Scaling::PerTensor && scaling != Fp8Scaling::Block1x128 && scaling != Fp8Scaling::Mx1x32)
    fail(op, "scaling = ", int(scaling), " is not one of {PerTensor, Block1x128, Mx1x32}");
  if (a.x.defined() == a.q.defined())
    fail(op, "x is ", given(a.x), " and q is ", given(a.q),
         " (expected exactly one: x, bf16 quantized in the scatter, or q, e4m3 already quantized)");
  const bool quantize = a.x.defined();
  const std::string_view src_name = quantize ? "x" : "q";
  const TensorView& src = quantize ? a.x : a.q;
  check_act(op, src_name, src, s.T_max, false, s, quantize ? DType::BF16 : DType::F8E4M3);
  const std::int64_t block = fp8_scale_block_cols(scaling);
  if (block > 0 && s.H % block != 0)
    fail(op, src_name, " has ", s.H, " columns but ", fp8_scaling_name(scaling), " scaling needs a multiple of ",
         block, " (H % ", block, " == 0)");
  if (s.H % kFp8Chunk != 0)
    fail_with(ErrorCode::Unsupported, op, src_name, " has ", s.H, " columns but the FP8 permute moves rows in ",
              kFp8Chunk, "-element vectors (expected H % ", kFp8Chunk, " == 0)");
  const std::int64_t scale_cols = block > 0 ? s.H / block : 0;
  const DType scale_dtype = fp8_scale_dtype(scaling);

  if (quantize && scaling == Fp8Scaling::PerTensor)
    check_f32(op, "tensor_scale", a.tensor_scale, {1}, s);
  else if (a.tensor_scale.defined())
    fail(op, "tensor_scale is given but only per-tensor scaling with x (quantized here) reads it (scaling = ",
         fp8_scaling_name(scaling), ", source ", src_name, ")");
  if (!quantize && block > 0) {
    check_shape(op, "q_scales", a.q_scales, {s.T_max, scale_cols});
    check_dtype(op, "q_scales", a.q_scales, {scale_dtype});
    check_device(op, "q_scales", a.q_scales, s.dev);
  } else if (a.q_scales.defined()) {
    fail(op, "q_scales is given but ",
         quantize ? "x is quantized here (its scales are computed)" : "per-tensor scaling has no per-row scales",
         " (expected q_scales only with q and a block recipe)");
  }
  check_act(op, "recv", a.recv, s.capacity, true, s, DType::F8E4M3);
  if (block > 0) {
    check_shape(op, "recv_scales", a.recv_scales, {-1, scale_cols});
    check_dtype(op, "recv_scales", a.recv_scales, {scale_dtype});
    check_device(op, "recv_scales", a.recv_scales, s.dev);
    if (a.recv_scales.size(0) < s.capacity)
      fail(op, "recv_scales has ", a.recv_scales.size(0), " rows but layout.capacity = ", s.capacity,
           " (expected at least that many)");
  } else if (a.recv_scales.defined()) {
    fail(op, "recv_scales is given but per-tensor scaling has no per-row scales (the tensor scale is shared, not "
             "moved; expected recv_scales absent)");
  }
  if (a.probs.defined() != a.recv_probs.defined())
    fail(op, "probs is ", given(a.probs), " but recv_probs is ", given(a.recv_probs), " (expected both or neither)");
  if (a.probs.defined()) {
    check_f32(op, "probs", a.probs, {s.T_max, s.K}, s);
    check_probs_vec(op, "recv_probs", a.recv_probs, s.capacity, s);
  }
  check_aligned16(op, src_name, src);
  check_aligned16(op, "recv", a.recv);

  Fp8ScatterParams p{};
  p.src = static_cast<const uint4*>(src.data());
  p.src_scales = quantize ? nullptr : a.q_scales.data();
  p.tensor_scale = quantize && scaling == Fp8Scaling::PerTensor ? a.tensor_scale.as<const float>() : nullptr;
  p.probs = a.probs.defined() ? a.probs.as<const float>() : nullptr;
  p.num_tokens = a.num_tokens.as<const std::int32_t>();
  p.dest_row = a.layout.dest_row.as<const std::int32_t>();
  p.tokens_per_expert = a.layout.tokens_per_expert.as<const std::int32_t>();
  p.segment_offset = a.layout.segment_offset.as<const std::int32_t>();
  p.pad_prefix = a.layout.pad_prefix.as<const std::int32_t>();
  p.dst = static_cast<uint4*>(a.recv.data());
  p.dst_scales = block > 0 ? a.recv_scales.data() : nullptr;
  p.dst_probs = a.recv_probs.defined() ? a.recv_probs.as<float>() : nullptr;
  p.chunks = s.H / kFp8Chunk;
  p.scale_cols = int(scale_cols);
  p.t_max = int(s.T_max);
  p.K = int(s.K);
  p.E = int(s.E);
  p.capacity = int(s.capacity);
  const std::int64_t max_items = s.T_max + max_pad_rows(cfg);
  if (quantize)
    scatter_fp8<Fp8Source::Quantize>(scaling, p, max_items, stream);
  else
    scatter_fp8<Fp8Source::Move>(scaling, p, max_items, stream);
}

void permute_backward(const MoeConfig& cfg, const PermuteBackwardArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "permute_backward";
  const Shapes s = common_checks(op, cfg, a.layout, a.num_tokens, false);
  check_act_dtype(op, "d_recv", a.d_recv);
  check_act(op, "d_recv", a.d_recv, s.capacity, true, s, a.d_recv.dtype());
  check_act(op, "dx", a.dx, s.T_max, false, s, a.d_recv.dtype());
  if (a.d_recv_probs.defined()) check_probs_vec(op, "d_recv_probs", a.d_recv_probs, s.capacity, s);
  if (a.d_probs.defined()) check_f32(op, "d_probs", a.d_probs, {s.T_max, s.K}, s);
  GatherParams p{};
  p.src = a.d_recv.data();
  p.weights = nullptr;
  p.src_probs = a.d_recv_probs.defined() ? a.d_recv_probs.as<const float>() : nullptr;
  p.num_tokens = a.num_tokens.as<const std::int32_t>();
  p.dest_row = a.layout.dest_row.as<const std::int32_t>();
  p.out = a.dx.data();
  p.d_probs = a.d_probs.defined() ? a.d_probs.as<float>() : nullptr;
  p.t_max = int(s.T_max);
  p.K = int(s.K);
  p.capacity = int(s.capacity);
  const bool vec = use_vec16(s.H, a.d_recv.dtype(), {a.d_recv.data(), a.dx.data()});
  gather(a.d_recv.dtype(), vec, p, s.H, s.T_max, stream);
}

void unpermute_forward(const MoeConfig& cfg, const UnpermuteArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "unpermute_forward";
  const Shapes s = common_checks(op, cfg, a.layout, a.num_tokens, false);
  check_act_dtype(op, "y", a.y);
  check_act(op, "y", a.y, s.capacity, true, s, a.y.dtype());
  check_act(op, "out", a.out, s.T_max, false, s, a.y.dtype());
  const bool in_combine = a.mode == ProbMode::InCombine;
  if (in_combine) check_f32(op, "probs", a.probs, {s.T_max, s.K}, s);
  GatherParams p{};
  p.src = a.y.data();
  p.weights = in_combine ? a.probs.as<const float>() : nullptr;
  p.src_probs = nullptr;
  p.num_tokens = a.num_tokens.as<const std::int32_t>();
  p.dest_row = a.layout.dest_row.as<const std::int32_t>();
  p.out = a.out.data();
  p.d_probs = nullptr;
  p.t_max = int(s.T_max);
  p.K = int(s.K);
  p.capacity = int(s.capacity);
  const bool vec = use_vec16(s.H, a.y.dtype(), {a.y.data(), a.out.data()});
  gather(a.y.dtype(), vec, p, s.H, s.T_max, stream);
}

void unpermute_backward(const MoeConfig& cfg, const UnpermuteBackwardArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "unpermute_backward";
  const Shapes s = common_checks(op, cfg, a.layout, a.num_tokens, true);
  check_act_dtype(op, "d_out", a.d_out);
  check_act(op, "d_out", a.d_out, s.T_max, false, s, a.d_out.dtype());
  check_act(op, "d_y", a.d_y, s.capacity, true, s, a.d_out.dtype());
  const bool in_combine = a.mode == ProbMode::InCombine;
  if (in_combine) {
    check_act(op, "y", a.y, s.capacity, true, s, a.d_out.dtype());
    check_f32(op, "probs", a.probs, {s.T_max, s.K}, s);
  }
  if (a.d_probs.defined()) check_f32(op, "d_probs", a.d_probs, {s.T_max, s.K}, s);
  ScatterParams p{};
  p.src = a.d_out.data();
  p.probs = in_combine ? a.probs.as<const float>() : nullptr;
  p.y = in_combine ? a.y.data() : nullptr;
  p.num_tokens = a.num_tokens.as<const std::int32_t>();
  p.dest_row = a.layout.dest_row.as<const std::int32_t>();
  p.tokens_per_expert = a.layout.tokens_per_expert.as<const std::int32_t>();
  p.segment_offset = a.layout.segment_offset.as<const std::int32_t>();
  p.pad_prefix = a.layout.pad_prefix.as<const std::int32_t>();
  p.dst = a.d_y.data();
  p.dst_probs = nullptr;
  p.d_probs = a.d_probs.defined() ? a.d_probs.as<float>() : nullptr;
  p.t_max = int(s.T_max);
  p.K = int(s.K);
  p.E = int(s.E);
  p.capacity = int(s.capacity);
  p.in_combine = in_combine;
  const bool vec = use_vec16(s.H, a.d_out.dtype(), {a.d_out.data(), a.d_y.data(), p.y});
  scatter<ScatterMode::Scale>(a.d_out.dtype(), vec, p, s.H, s.T_max + max_pad_rows(cfg), stream);
}

}  // namespace moerail
