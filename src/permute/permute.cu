// Host launchers of the permute ops (include/moerail/permute.h): argument checks, vector width, grid size.
// Kernels: permute_kernels.cuh. Bytes moved (the model docs/kernels.md and the benchmark use), N routed rows,
// P pad rows, row = H * element size:
//   permute_forward     T * row read + (N + P) * row written  (+ probs: 4 T K read, 4 (N + P) written)
//   permute_backward    N * row read + T * row written
//   unpermute_forward   N * row read + T * row written
//   unpermute_backward  T * row read + (N + P) * row written (+ N * row read for the InCombine dot)
#include "moerail/permute.h"

#include <string>

#include "core/cuda_check.h"
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
// kernel), never more than the largest possible number of items needs.
template <typename Kernel>
int grid_for(Kernel kernel, std::int64_t max_items) {
  if (max_items <= 0) return 0;
  static const int blocks_per_sm = [&] {
    int n = 0;
    MOERAIL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
    return n > 0 ? n : 1;
  }();
  const std::int64_t warps = kThreads / kWarp;
  return int(cuda::persistent_grid((max_items + warps - 1) / warps, blocks_per_sm));
}

template <typename T, int VB, ScatterMode Mode>
void launch_scatter(const ScatterParams& p, std::int64_t max_items, cudaStream_t stream) {
  auto kernel = scatter_kernel<T, VB, Mode>;
  const int grid = grid_for(kernel, max_items);
  if (grid == 0) return;
  kernel<<<grid, kThreads, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

template <typename T, int VB>
void launch_gather(const GatherParams& p, std::int64_t max_items, cudaStream_t stream) {
  auto kernel = gather_kernel<T, VB>;
  const int grid = grid_for(kernel, max_items);
  if (grid == 0) return;
  kernel<<<grid, kThreads, 0, stream>>>(p);
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
