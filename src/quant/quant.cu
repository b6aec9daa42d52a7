// Host launchers of the FP8 quantization ops (include/moerail/quant.h): argument checks, grid size.
// Kernels: quant_kernels.cuh. Bytes moved per element: quantize 2 read + 1 written (+ 4/128 or 1/32 for the scales),
// dequantize 1 (+ scales) read + 2 written.
#include "moerail/quant.h"

#include <string_view>

#include "core/cuda_check.h"
#include "quant/quant_kernels.cuh"

namespace moerail {
namespace {

using namespace quant_detail;

struct Shape {
  std::int64_t T_max, H;
  Device dev;
};

// Checks the [T_max, H] data view (name, dtype), num_tokens and the scale view; returns the shape.
Shape check_common(std::string_view op, Fp8Scaling scaling, std::string_view data_name, const TensorView& data,
                   DType data_dtype, const TensorView& num_tokens, const TensorView& scale) {
  if (scaling != Fp8Scaling::PerTensor && scaling != Fp8Scaling::Block1x128 && scaling != Fp8Scaling::Mx1x32)
    fail(op, "scaling = ", int(scaling), " is not one of {PerTensor, Block1x128, Mx1x32}");
  const Device dev = Device::cuda(cuda::current_device());
  check_shape(op, data_name, data, {-1, -1});
  check_dtype(op, data_name, data, {data_dtype});
  check_device(op, data_name, data, dev);
  const Shape s{data.size(0), data.size(1), dev};
  if (s.T_max > 0x7fffffff) fail(op, data_name, " has ", s.T_max, " rows but at most 2^31 - 1 are supported");
  const std::int64_t block = fp8_scale_block_cols(scaling);
  if (block > 0 && s.H % block != 0)
    fail(op, data_name, " has ", s.H, " columns but ", fp8_scaling_name(scaling), " scaling needs a multiple of ",
         block, " (H % ", block, " == 0)");
  if (s.H % kChunk != 0)
    fail_with(ErrorCode::Unsupported, op, data_name, " has ", s.H, " columns but the FP8 kernels move rows in ",
              kChunk, "-element vectors (expected H % ", kChunk, " == 0)");
  check_shape(op, "num_tokens", num_tokens, {1});
  check_dtype(op, "num_tokens", num_tokens, {DType::I32});
  check_device(op, "num_tokens", num_tokens, dev);
  if (block == 0)
    check_shape(op, "scale", scale, {1});
  else
    check_shape(op, "scale", scale, {s.T_max, s.H / block});
  check_dtype(op, "scale", scale, {fp8_scale_dtype(scaling)});
  check_device(op, "scale", scale, dev);
  return s;
}

void check_aligned(std::string_view op, std::string_view name, const TensorView& v) {
  if (!v.empty() && !cuda::aligned16(v.data()))
    fail_with(ErrorCode::Unsupported, op, name, " at address ", v.data(),
              " is not 16-byte aligned (the FP8 kernels move 16-byte vectors)");
}

// ---- launch configuration (one place) -------------------------------------------------------------------------
// Persistent grid: one 16-element chunk per thread and step, as many blocks as fit on all SMs at once (occupancy
// computed once per kernel), never more than T_max rows need. Not tuned by measurement yet: a full SM keeps up to
// 64 KiB of loads in flight, about three times the ~20 KiB per SM that H100/H200 bandwidth x latency asks for.
template <auto Kernel>
void launch(const QuantParams& p, std::int64_t max_chunks, cudaStream_t stream) {
  if (max_chunks <= 0) return;
  static const int blocks_per_sm = [] {
    int n = 0;
    MOERAIL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0));
    return n > 0 ? n : 1;
  }();
  const int grid = int(cuda::persistent_grid((max_chunks + kThreads - 1) / kThreads, blocks_per_sm));
  if (grid == 0) return;
  Kernel<<<grid, kThreads, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

QuantParams params_of(const Shape& s, const void* in, void* out, const TensorView& num_tokens, Fp8Scaling scaling,
                      const TensorView& scale) {
  QuantParams p{};
  p.x = in;
  p.out = out;
  p.num_tokens = num_tokens.as<const std::int32_t>();
  p.tensor_scale = scaling == Fp8Scaling::PerTensor ? scale.as<const float>() : nullptr;
  p.scales = scaling == Fp8Scaling::PerTensor ? nullptr : scale.data();
  p.chunks_per_row = s.H / kChunk;
  p.t_max = int(s.T_max);
  return p;
}

}  // namespace

void quantize_fp8(const QuantizeArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "quantize_fp8";
  const Shape s = check_common(op, a.scaling, "x", a.x, DType::BF16, a.num_tokens, a.scale);
  check_shape(op, "q", a.q, {s.T_max, s.H});
  check_dtype(op, "q", a.q, {DType::F8E4M3});
  check_device(op, "q", a.q, s.dev);
  check_aligned(op, "x", a.x);
  check_aligned(op, "q", a.q);
  const QuantParams p = params_of(s, a.x.data(), a.q.data(), a.num_tokens, a.scaling, a.scale);
  const std::int64_t max_chunks = s.T_max * (s.H / kChunk);
  switch (a.scaling) {
    case Fp8Scaling::PerTensor: launch<quantize_kernel<Fp8Scaling::PerTensor>>(p, max_chunks, stream); return;
    case Fp8Scaling::Block1x128: launch<quantize_kernel<Fp8Scaling::Block1x128>>(p, max_chunks, stream); return;
    case Fp8Scaling::Mx1x32: launch<quantize_kernel<Fp8Scaling::Mx1x32>>(p, max_chunks, stream); return;
  }
}

void dequantize_fp8(const DequantizeArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "dequantize_fp8";
  const Shape s = check_common(op, a.scaling, "q", a.q, DType::F8E4M3, a.num_tokens, a.scale);
  check_shape(op, "out", a.out, {s.T_max, s.H});
  check_dtype(op, "out", a.out, {DType::BF16});
  check_device(op, "out", a.out, s.dev);
  check_aligned(op, "q", a.q);
  check_aligned(op, "out", a.out);
  const QuantParams p = params_of(s, a.q.data(), a.out.data(), a.num_tokens, a.scaling, a.scale);
  const std::int64_t max_chunks = s.T_max * (s.H / kChunk);
  switch (a.scaling) {
    case Fp8Scaling::PerTensor: launch<dequantize_kernel<Fp8Scaling::PerTensor>>(p, max_chunks, stream); return;
    case Fp8Scaling::Block1x128: launch<dequantize_kernel<Fp8Scaling::Block1x128>>(p, max_chunks, stream); return;
    case Fp8Scaling::Mx1x32: launch<dequantize_kernel<Fp8Scaling::Mx1x32>>(p, max_chunks, stream); return;
  }
}

}  // namespace moerail
