// Host launcher of the 128x128-block weight quantizer (moerail/quant.h, quantize_weights_fp8): argument checks and
// the launch. Kernel: weight_quant_kernels.cuh. Bytes: 2 read + 1 written per element (+ 1 with the transposed copy),
// plus 4 bytes per 128x128 block and copy for the scales.
#include <string_view>

#include "core/cuda_check.h"
#include "moerail/experts.h"  // kMaxLocalExperts
#include "moerail/quant.h"
#include "quant/expert_scales.h"
#include "quant/weight_quant_kernels.cuh"

namespace moerail {
namespace {

using namespace quant_detail;

constexpr std::string_view kOp = "quantize_weights_fp8";

void check_view(std::string_view name, const TensorView& t, DType dtype, std::initializer_list<std::int64_t> shape,
                Device dev, bool vectors) {
  if (!t.defined()) fail(kOp, name, " is absent but required");
  check_device(kOp, name, t, dev);
  check_dtype(kOp, name, t, {dtype});
  check_shape(kOp, name, t, shape);
  if (vectors && !t.empty() && !cuda::aligned16(t.data()))
    fail_with(ErrorCode::Unsupported, kOp, name, " at address ", t.data(),
              " is not 16-byte aligned (the weight quantizer moves 16-byte vectors)");
}

}  // namespace

void quantize_weights_fp8(const QuantizeWeightsArgs& a, cudaStream_t stream) {
  constexpr std::int64_t B = kWeightScaleBlock;
  const Device dev = Device::cuda(cuda::current_device());
  check_view("w", a.w, DType::BF16, {-1, -1, -1}, dev, true);
  const std::int64_t L = a.w.size(0), N = a.w.size(1), K = a.w.size(2);
  if (K % B != 0)
    fail(kOp, "w has shape ", a.w.shape_str(), " but K = ", K, " is not a multiple of ", B,
         " (the 128x128 scale blocks tile K exactly)");
  const bool tensor = a.scaling == Fp8Scaling::PerTensor;
  if (!tensor && a.scaling != Fp8Scaling::Block1x128)
    fail(kOp, "scaling = ", int(a.scaling), " but Block1x128 or PerTensor is supported");
  const std::int64_t nb = (N + B - 1) / B, kb = K / B;
  check_view("q", a.q, DType::F8E4M3, {L, N, K}, dev, true);
  if (tensor) check_view("q_scales", a.q_scales, DType::F32, {L}, dev, false);
  else check_view("q_scales", a.q_scales, DType::F32, {L, nb, kb}, dev, false);
  const bool transposed = a.qt.defined();
  if (transposed) {
    if (N % B != 0)
      fail(kOp, "qt is given but N = ", N, " (w ", a.w.shape_str(), ") is not a multiple of ", B,
           " (N is the reduction dimension of the dgrad GEMM that reads qt)");
    check_view("qt", a.qt, DType::F8E4M3, {L, K, N}, dev, true);
    if (tensor) check_view("qt_scales", a.qt_scales, DType::F32, {L}, dev, false);
    else check_view("qt_scales", a.qt_scales, DType::F32, {L, kb, nb}, dev, false);
  } else if (a.qt_scales.defined()) {
    fail(kOp, "qt_scales is given but qt is not (both or neither)");
  }
  const std::int64_t blocks = L * nb * kb;
  if (blocks > 0x7fffffff) fail(kOp, "w has shape ", a.w.shape_str(), ": ", blocks, " blocks exceed the grid");
  if (tensor && (L < 1 || L > kMaxLocalExperts))
    fail(kOp, "w has shape ", a.w.shape_str(), " but the per-tensor form takes 1 <= L <= ", kMaxLocalExperts,
         " experts (one scale each, reduced in shared memory)");
  if (tensor && L * N >= (std::int64_t(1) << 31))
    fail(kOp, "w has shape ", a.w.shape_str(), ": L * N must be below 2^31");
  if (blocks == 0 && !tensor) return;  // (per tensor the scales are still written: 1 for empty matrices)

  WeightQuantParams p{};
  p.w = static_cast<const uint4*>(a.w.data());
  p.q = static_cast<uint4*>(a.q.data());
  p.q_scales = a.q_scales.as<float>();
  p.qt = transposed ? static_cast<uint4*>(a.qt.data()) : nullptr;
  p.qt_scales = transposed ? a.qt_scales.as<float>() : nullptr;
  p.N = N;
  p.K = K;
  p.nb = int(nb);
  p.kb = int(kb);
  if (tensor) {  // each expert's scale from its matrix's amax first, then the blocks with it
    quant_detail::ExpertRows r;
    r.x = a.w.data();
    r.rows = L * N;
    r.C = K;
    r.L = int(L);
    quant_detail::launch_expert_scales(r, a.q_scales.as<float>(), kE4M3Max, stream);
    p.tensor_scales = a.q_scales.as<const float>();
    if (blocks > 0) {
      if (transposed)
        quantize_weights_kernel<true, true><<<unsigned(blocks), kWeightThreads, 0, stream>>>(p);
      else
        quantize_weights_kernel<false, true><<<unsigned(blocks), kWeightThreads, 0, stream>>>(p);
      MOERAIL_CUDA_CHECK_LAUNCH();
    }
    if (transposed)
      MOERAIL_CUDA_CHECK(cudaMemcpyAsync(a.qt_scales.data(), a.q_scales.data(), sizeof(float) * std::size_t(L),
                                         cudaMemcpyDeviceToDevice, stream));
    return;
  }
  // One CTA per block, no persistent loop: the shapes are static and each CTA's work is the same (32 KiB read).
  if (transposed)
    quantize_weights_kernel<true><<<unsigned(blocks), kWeightThreads, 0, stream>>>(p);
  else
    quantize_weights_kernel<false><<<unsigned(blocks), kWeightThreads, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

}  // namespace moerail
