// GPU FP8 quantization (moerail/quant.h) against the CPU reference (moerail/reference/quant.h), bit for bit.
//
//   Conversions   the device element functions of src/quant/quant_kernels.cuh (e4m3 encode over every bf16 value,
//                 a million random fp32 patterns and every rounding tie; decode of all 256 codes; both scale rules)
//                 against ref::float_to_e4m3 / e4m3_to_float / block_scale_from_amax / mx_scale_from_amax.
//   Tensors       quantize_fp8 and dequantize_fp8 for the three recipes on random bf16 rows (a different magnitude
//                 per row, a zero block) for several T_max, T (0, some, T_max) and H: codes, scales and bf16 output
//                 equal the reference's bits; rows t >= T keep the poison (0xff bytes) they were given.
//   Specials      inf / NaN / ±0 in the input and every code under extreme scales in dequantize (NaN outputs are
//                 compared as NaN: their payload bits are not part of the contract).
//   Graph         quantize + dequantize captured once, replayed with other device token counts.
//   Errors        misaligned views and H not a multiple of 16 are refused with Error(Unsupported).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "moerail/quant.h"
#include "moerail/reference/host.h"
#include "moerail/reference/quant.h"
#include "quant/quant_kernels.cuh"

namespace moerail {
namespace {

using ref::HostTensor;
using testing::DeviceTensor;

// ---- conversions on the device -----------------------------------------------------------------------------------

__global__ void encode_kernel(const float* in, std::uint32_t* out, int n4) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n4) out[i] = quant_detail::encode4(in[4 * i], in[4 * i + 1], in[4 * i + 2], in[4 * i + 3]);
}

__global__ void decode_kernel(float* out) {  // 128 threads: codes 2i, 2i+1
  const int i = threadIdx.x;
  const float2 f = quant_detail::decode2(std::uint32_t(2 * i) | (std::uint32_t(2 * i + 1) << 8));
  out[2 * i] = f.x;
  out[2 * i + 1] = f.y;
}

__global__ void scale_kernel(const float* amax, float* block, std::uint8_t* mx, float* mx_value, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  block[i] = quant_detail::block_scale_from_amax(amax[i]);
  const std::uint32_t code = quant_detail::mx_scale_from_amax(amax[i]);
  mx[i] = std::uint8_t(code);
  mx_value[i] = quant_detail::e8m0_to_float(code);
}

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }

std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%02x", v);
  return buf;
}

TEST(QuantGpu, EncodeMatchesTheReferenceOnEveryBf16TiesAndRandomFloats) {
  MOERAIL_REQUIRE_GPU();
  std::vector<float> in;
  for (std::uint32_t b = 0; b < 0x10000; ++b) in.push_back(std::bit_cast<float>(b << 16));
  for (int c = 0; c < 0x7e; ++c)  // every tie between neighbouring codes and its two neighbours, both signs
    for (float sign : {1.0f, -1.0f}) {
      const float lo = ref::e4m3_to_float(std::uint8_t(c)), hi = ref::e4m3_to_float(std::uint8_t(c + 1));
      const float mid = (lo + hi) / 2;
      for (float v : {mid, std::nextafter(mid, lo), std::nextafter(mid, hi)}) in.push_back(sign * v);
    }
  for (float v : {448.0f, 449.0f, 464.0f, 465.0f, 1e30f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::denorm_min(), 0x1p-10f, std::nextafter(0x1p-10f, 1.0f)}) {
    in.push_back(v);
    in.push_back(-v);
  }
  for (std::uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xffffffffu}) in.push_back(std::bit_cast<float>(nan));
  ref::Rng rng(21);
  for (int i = 0; i < 1000000; ++i) in.push_back(std::bit_cast<float>(std::uint32_t(rng.next())));
  while (in.size() % 4) in.push_back(0.0f);
  const int n4 = int(in.size() / 4);

  DeviceTensor d_in(DType::F32, {std::int64_t(in.size())}), d_out(DType::I32, {n4});
  d_in.from_vector(in);
  encode_kernel<<<(n4 + 255) / 256, 256>>>(static_cast<const float*>(d_in.data()),
                                           static_cast<std::uint32_t*>(d_out.data()), n4);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<std::uint32_t> words = d_out.to_vector<std::uint32_t>(std::size_t(n4));
  int bad = 0;
  for (std::size_t i = 0; i < in.size() && bad < 10; ++i) {
    const unsigned got = (words[i / 4] >> (8 * (i % 4))) & 0xffu, want = ref::float_to_e4m3(in[i]);
    if (got != want) {
      ADD_FAILURE() << "e4m3(" << in[i] << ", fp32 bits " << std::hex << bits(in[i]) << ") = " << hex(got)
                    << " on the GPU but " << hex(want) << " in the reference";
      ++bad;
    }
  }
}

TEST(QuantGpu, DecodeMatchesTheReferenceOnAll256Codes) {
  MOERAIL_REQUIRE_GPU();
  DeviceTensor d_out(DType::F32, {256});
  decode_kernel<<<1, 128>>>(static_cast<float*>(d_out.data()));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = d_out.to_vector<float>(256);
  for (int c = 0; c < 256; ++c) {
    const float want = ref::e4m3_to_float(std::uint8_t(c));
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(got[std::size_t(c)])) << "code " << hex(c);
    else
      EXPECT_EQ(bits(got[std::size_t(c)]), bits(want)) << "code " << hex(c) << ": " << got[std::size_t(c)]
                                                       << " but the reference has " << want;
  }
}

TEST(QuantGpu, ScaleRulesMatchTheReference) {
  MOERAIL_REQUIRE_GPU();
  std::vector<float> amax = {0.0f, 448.0f, 449.0f, 224.0f, 1.0f, 1e-44f, 448.0f * 0x1p-127f, 448.0f * 0x1.8p-127f,
                             std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::denorm_min()};
  ref::Rng rng(5);
  for (int i = 0; i < 100000; ++i) amax.push_back(std::ldexp(float(rng.uniform(1.0, 2.0)), int(rng.below(260)) - 140));
  const int n = int(amax.size());
  DeviceTensor d_amax(DType::F32, {n}), d_block(DType::F32, {n}), d_mx(kE8M0ScaleDType, {n}), d_mxv(DType::F32, {n});
  d_amax.from_vector(amax);
  scale_kernel<<<(n + 255) / 256, 256>>>(static_cast<const float*>(d_amax.data()), static_cast<float*>(d_block.data()),
                                         static_cast<std::uint8_t*>(d_mx.data()), static_cast<float*>(d_mxv.data()), n);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto block = d_block.to_vector<float>(std::size_t(n));
  const auto mx = d_mx.to_vector<std::uint8_t>(std::size_t(n));
  const auto mxv = d_mxv.to_vector<float>(std::size_t(n));
  int bad = 0;
  for (int i = 0; i < n && bad < 10; ++i) {
    const float a = amax[std::size_t(i)], b = ref::block_scale_from_amax(a);
    const std::uint8_t m = ref::mx_scale_from_amax(a);
    const float mv = ref::e8m0_to_float(m);
    const bool ok = bits(block[std::size_t(i)]) == bits(b) && mx[std::size_t(i)] == m &&
                    (bits(mxv[std::size_t(i)]) == bits(mv) || (std::isnan(mv) && std::isnan(mxv[std::size_t(i)])));
    if (!ok) {
      ADD_FAILURE() << "amax " << a << ": GPU block scale " << block[std::size_t(i)] << ", E8M0 "
                    << int(mx[std::size_t(i)]) << " (" << mxv[std::size_t(i)] << "); reference " << b << ", "
                    << int(m) << " (" << mv << ")";
      ++bad;
    }
  }
}

// ---- tensors ------------------------------------------------------------------------------------------------------

struct Case {
  Fp8Scaling scaling;
  std::int64_t T_max, T, H;   // T: the count stored on the device (the kernels clamp it to [0, T_max])
  float tensor_scale = 0.0f;  // PerTensor: the given scale (0: the tensor's amax / 448)
};

std::string name_of(const Case& c) {
  return std::string(fp8_scaling_name(c.scaling)) + " T=" + std::to_string(c.T) + "/" + std::to_string(c.T_max) +
         " H=" + std::to_string(c.H);
}

std::int64_t scale_cols(const Case& c) {
  return c.scaling == Fp8Scaling::PerTensor ? 0 : c.H / fp8_scale_block_cols(c.scaling);
}

// Bytes [0, n) equal; bytes [n, total) still 0xff. `elem` bytes per element, for the messages.
void expect_bytes(const std::vector<std::uint8_t>& gpu, const std::vector<std::uint8_t>& want, std::size_t n,
                  std::size_t elem, std::int64_t cols, const std::string& what, bool nan_tolerant_bf16 = false) {
  int bad = 0;
  for (std::size_t i = 0; i < n / elem && bad < 5; ++i) {
    if (std::memcmp(&gpu[i * elem], &want[i * elem], elem) == 0) continue;
    if (nan_tolerant_bf16) {
      std::uint16_t g, w;
      std::memcpy(&g, &gpu[i * elem], 2);
      std::memcpy(&w, &want[i * elem], 2);
      if (std::isnan(bf16_bits_to_float(g)) && std::isnan(bf16_bits_to_float(w))) continue;
    }
    unsigned g = 0, w = 0;
    std::memcpy(&g, &gpu[i * elem], elem);
    std::memcpy(&w, &want[i * elem], elem);
    ADD_FAILURE() << what << "[" << std::int64_t(i) / cols << "," << std::int64_t(i) % cols << "] = 0x" << std::hex
                  << g << " on the GPU but 0x" << w << " in the reference";
    ++bad;
  }
  for (std::size_t i = n; i < gpu.size(); ++i)
    if (gpu[i] != 0xff) {
      ADD_FAILURE() << what << ": byte " << i << " was written but lies in a row t >= T";
      return;
    }
}

std::vector<std::uint8_t> bytes_of(const HostTensor& t, std::size_t n) {
  const auto* p = static_cast<const std::uint8_t*>(t.view().data());
  return std::vector<std::uint8_t>(p, p + n);
}

// bf16 rows with a different magnitude per row (2^-20 .. 2^20) and the first 128 columns of row 0 zero.
HostTensor random_input(std::int64_t T_max, std::int64_t H, std::uint64_t seed) {
  HostTensor x(DType::BF16, {T_max, H});
  ref::Rng rng(seed);
  for (std::int64_t r = 0; r < T_max; ++r) {
    const double mag = std::ldexp(1.0, int(rng.below(41)) - 20);
    for (std::int64_t j = 0; j < H; ++j) x.set_f(r * H + j, (r == 0 && j < 128) ? 0.0 : rng.normal() * mag);
  }
  return x;
}

// Runs quantize and dequantize on the GPU and on the CPU, compares. x: [T_max, H] bf16 on the host.
void run_case(const Case& c, const HostTensor& x) {
  SCOPED_TRACE(name_of(c));
  const std::int64_t T_max = c.T_max, T = std::min(c.T, c.T_max), H = c.H, nb = scale_cols(c);
  const bool per_tensor = c.scaling == Fp8Scaling::PerTensor;
  const DType sdt = fp8_scale_dtype(c.scaling);
  const std::vector<std::int64_t> scale_shape = per_tensor ? std::vector<std::int64_t>{1}
                                                           : std::vector<std::int64_t>{T_max, nb};
  const std::size_t scale_elem = dtype_size(sdt);

  // Reference on the first T rows.
  const TensorView x_t(x.view().data(), DType::BF16, {T, H});
  HostTensor q_ref(DType::F8E4M3, {T, H}), y_ref(DType::BF16, {T, H});
  HostTensor s_ref = per_tensor ? HostTensor(DType::F32, {1}) : HostTensor(sdt, {T, nb});
  if (per_tensor) {
    float amax = 0;
    for (std::int64_t i = 0; i < T_max * H; ++i) amax = std::fmax(amax, std::fabs(float(x.f(i))));
    static_cast<float*>(s_ref.view().data())[0] = c.tensor_scale > 0 ? c.tensor_scale : ref::block_scale_from_amax(amax);
  }
  ref::quantize_fp8(c.scaling, x_t, q_ref, s_ref);
  ref::dequantize_fp8(c.scaling, q_ref, s_ref, y_ref);

  // GPU, outputs poisoned (DeviceTensor starts as 0xff bytes).
  DeviceTensor d_x(DType::BF16, {T_max, H}), d_q(DType::F8E4M3, {T_max, H}), d_s(sdt, scale_shape),
      d_y(DType::BF16, {T_max, H});
  DeviceTensor nt = testing::device_scalar_i32(std::int32_t(c.T));
  d_x.upload(x);
  if (per_tensor) d_s.from_vector(std::vector<float>{static_cast<const float*>(s_ref.view().data())[0]});
  QuantizeArgs qa;
  qa.scaling = c.scaling;
  qa.x = d_x.view();
  qa.num_tokens = nt.view();
  qa.q = d_q.view();
  qa.scale = d_s.view();
  quantize_fp8(qa, nullptr);
  DequantizeArgs da;
  da.scaling = c.scaling;
  da.q = d_q.view();
  da.scale = d_s.view();
  da.num_tokens = nt.view();
  da.out = d_y.view();
  dequantize_fp8(da, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const auto q_gpu = d_q.to_vector<std::uint8_t>(std::size_t(T_max * H));
  const auto y_gpu = d_y.to_vector<std::uint8_t>(std::size_t(T_max * H * 2));
  expect_bytes(q_gpu, bytes_of(q_ref, std::size_t(T * H)), std::size_t(T * H), 1, H, "q");
  if (!per_tensor) {
    const auto s_gpu = d_s.to_vector<std::uint8_t>(std::size_t(T_max * nb) * scale_elem);
    expect_bytes(s_gpu, bytes_of(s_ref, std::size_t(T * nb) * scale_elem), std::size_t(T * nb) * scale_elem,
                 scale_elem, nb, "scale");
  }
  expect_bytes(y_gpu, bytes_of(y_ref, std::size_t(T * H * 2)), std::size_t(T * H * 2), 2, H, "out");
}

std::vector<Case> cases() {
  std::vector<Case> cs;
  for (Fp8Scaling s : {Fp8Scaling::PerTensor, Fp8Scaling::Block1x128, Fp8Scaling::Mx1x32}) {
    const std::int64_t h_small = s == Fp8Scaling::Mx1x32 ? 96 : s == Fp8Scaling::PerTensor ? 48 : 384;
    cs.push_back({s, 64, 64, 7168});  // DeepSeek-V3 hidden size, T = T_max
    cs.push_back({s, 64, 37, 2048});
    cs.push_back({s, 64, 0, 1024});   // no tokens: nothing written
    cs.push_back({s, 300, 1, h_small});
    cs.push_back({s, 257, 129, 128});
    cs.push_back({s, 1, 1, s == Fp8Scaling::Mx1x32 ? 32 : 128});
    cs.push_back({s, 0, 0, 256});     // T_max = 0: no launch
    cs.push_back({s, 16, 99, 256});   // a stored T beyond T_max is clamped to T_max
  }
  cs.push_back({Fp8Scaling::PerTensor, 64, 50, 512, 1e-3f});  // a small given scale: most elements saturate
  return cs;
}

TEST(QuantGpu, QuantizeAndDequantizeMatchTheReference) {
  MOERAIL_REQUIRE_GPU();
  std::uint64_t seed = 100;
  for (const Case& c : cases()) run_case(c, random_input(c.T_max, c.H, seed++));
}

TEST(QuantGpu, SpecialValuesMatchTheReference) {
  MOERAIL_REQUIRE_GPU();
  const std::int64_t T = 8, H = 256;
  HostTensor x = random_input(T, H, 7);
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  x.set_f(1 * H + 3, inf);     // block 0 of row 1: Block scale inf, MX scale NaN for its 32-block
  x.set_f(2 * H + 5, -inf);
  x.set_f(3 * H + 7, nan);     // ignored by amax, quantizes to 0x7f
  x.set_f(3 * H + 200, -nan);
  x.set_f(4 * H + 9, -0.0);
  x.set_f(5 * H + 11, 1e38);   // a huge element: its block's others underflow to ±0
  for (Fp8Scaling s : {Fp8Scaling::Block1x128, Fp8Scaling::Mx1x32}) {
    SCOPED_TRACE(std::string(fp8_scaling_name(s)));
    const std::int64_t nb = H / fp8_scale_block_cols(s);
    HostTensor q_ref(DType::F8E4M3, {T, H}), s_ref(fp8_scale_dtype(s), {T, nb}), y_ref(DType::BF16, {T, H});
    ref::quantize_fp8(s, x, q_ref, s_ref);
    ref::dequantize_fp8(s, q_ref, s_ref, y_ref);
    DeviceTensor d_x(DType::BF16, {T, H}), d_q(DType::F8E4M3, {T, H}), d_s(fp8_scale_dtype(s), {T, nb}),
        d_y(DType::BF16, {T, H});
    DeviceTensor nt = testing::device_scalar_i32(std::int32_t(T));
    d_x.upload(x);
    quantize_fp8({s, d_x.view(), nt.view(), d_q.view(), d_s.view()}, nullptr);
    dequantize_fp8({s, d_q.view(), d_s.view(), nt.view(), d_y.view()}, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::size_t se = dtype_size(fp8_scale_dtype(s));
    expect_bytes(d_q.to_vector<std::uint8_t>(std::size_t(T * H)), bytes_of(q_ref, std::size_t(T * H)),
                 std::size_t(T * H), 1, H, "q");
    expect_bytes(d_s.to_vector<std::uint8_t>(std::size_t(T * nb) * se), bytes_of(s_ref, std::size_t(T * nb) * se),
                 std::size_t(T * nb) * se, se, nb, "scale");
    expect_bytes(d_y.to_vector<std::uint8_t>(std::size_t(T * H * 2)), bytes_of(y_ref, std::size_t(T * H * 2)),
                 std::size_t(T * H * 2), 2, H, "out", /*nan_tolerant_bf16=*/true);
  }

  // Dequantize alone: every code under extreme scales (E8M0 0, 1, 127, 254, NaN; fp32 subnormal, huge, NaN).
  const std::vector<std::uint8_t> e8m0 = {0, 1, 2, 100, 127, 200, 254, 0xff};
  const std::vector<float> f32s = {1.0f, 1e-40f, 3e38f, 0.7f, std::numeric_limits<float>::quiet_NaN(), 1e-3f, 5.5f, 2.0f};
  for (Fp8Scaling s : {Fp8Scaling::Block1x128, Fp8Scaling::Mx1x32}) {
    SCOPED_TRACE(std::string("dequantize ") + std::string(fp8_scaling_name(s)));
    const std::int64_t nb = H / fp8_scale_block_cols(s);
    HostTensor q(DType::F8E4M3, {T, H}), sc(fp8_scale_dtype(s), {T, nb}), y_ref(DType::BF16, {T, H});
    for (std::int64_t i = 0; i < T * H; ++i) static_cast<std::uint8_t*>(q.view().data())[i] = std::uint8_t(i * 7 % 256);
    for (std::int64_t i = 0; i < T * nb; ++i) {
      if (s == Fp8Scaling::Mx1x32)
        static_cast<std::uint8_t*>(sc.view().data())[i] = e8m0[std::size_t(i) % e8m0.size()];
      else
        static_cast<float*>(sc.view().data())[i] = f32s[std::size_t(i) % f32s.size()];
    }
    ref::dequantize_fp8(s, q, sc, y_ref);
    DeviceTensor d_q(DType::F8E4M3, {T, H}), d_s(fp8_scale_dtype(s), {T, nb}), d_y(DType::BF16, {T, H});
    DeviceTensor nt = testing::device_scalar_i32(std::int32_t(T));
    d_q.upload(q);
    d_s.upload(sc);
    dequantize_fp8({s, d_q.view(), d_s.view(), nt.view(), d_y.view()}, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_bytes(d_y.to_vector<std::uint8_t>(std::size_t(T * H * 2)), bytes_of(y_ref, std::size_t(T * H * 2)),
                 std::size_t(T * H * 2), 2, H, "out", /*nan_tolerant_bf16=*/true);
  }
}

TEST(QuantGpu, GraphReplaysWithOtherTokenCounts) {
  MOERAIL_REQUIRE_GPU();
  const std::int64_t T_max = 96, H = 1024, nb = H / 128;
  const HostTensor x = random_input(T_max, H, 9);
  DeviceTensor d_x(DType::BF16, {T_max, H}), d_q(DType::F8E4M3, {T_max, H}), d_s(DType::F32, {T_max, nb}),
      d_y(DType::BF16, {T_max, H});
  DeviceTensor nt = testing::device_scalar_i32(1);
  d_x.upload(x);
  const QuantizeArgs qa{Fp8Scaling::Block1x128, d_x.view(), nt.view(), d_q.view(), d_s.view()};
  const DequantizeArgs da{Fp8Scaling::Block1x128, d_q.view(), d_s.view(), nt.view(), d_y.view()};
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  quantize_fp8(qa, stream);  // eager once (the launchers' one-time setup happens outside capture)
  dequantize_fp8(da, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  quantize_fp8(qa, stream);
  dequantize_fp8(da, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  for (std::int32_t T : {std::int32_t(T_max), 0, 17, 95}) {
    SCOPED_TRACE("replay with T = " + std::to_string(T));
    d_q.poison();
    d_s.poison();
    d_y.poison();
    nt.from_vector(std::vector<std::int32_t>{T});
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // poison and count land before the non-blocking stream runs
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const TensorView x_t(x.view().data(), DType::BF16, {T, H});
    HostTensor q_ref(DType::F8E4M3, {T, H}), s_ref(DType::F32, {T, nb}), y_ref(DType::BF16, {T, H});
    ref::quantize_fp8(Fp8Scaling::Block1x128, x_t, q_ref, s_ref);
    ref::dequantize_fp8(Fp8Scaling::Block1x128, q_ref, s_ref, y_ref);
    expect_bytes(d_q.to_vector<std::uint8_t>(std::size_t(T_max * H)), bytes_of(q_ref, std::size_t(T * H)),
                 std::size_t(T * H), 1, H, "q");
    expect_bytes(d_s.to_vector<std::uint8_t>(std::size_t(T_max * nb * 4)), bytes_of(s_ref, std::size_t(T * nb * 4)),
                 std::size_t(T * nb * 4), 4, nb, "scale");
    expect_bytes(d_y.to_vector<std::uint8_t>(std::size_t(T_max * H * 2)), bytes_of(y_ref, std::size_t(T * H * 2)),
                 std::size_t(T * H * 2), 2, H, "out");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(QuantGpu, RefusesWhatTheVectorKernelsCannotMove) {
  MOERAIL_REQUIRE_GPU();
  DeviceTensor d_x(DType::BF16, {4, 256}), d_q(DType::F8E4M3, {4, 256}), d_s(DType::F32, {4, 2});
  DeviceTensor nt = testing::device_scalar_i32(4);
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::make_pair(e.code(), std::string(e.what()));
    }
    return std::make_pair(ErrorCode::Internal, std::string("(no error)"));
  };
  d_x.set_offset(2);  // bf16-aligned, not 16-byte aligned
  auto [c1, m1] = code_of([&] { quantize_fp8({Fp8Scaling::Block1x128, d_x.view(), nt.view(), d_q.view(), d_s.view()}, nullptr); });
  EXPECT_EQ(c1, ErrorCode::Unsupported) << m1;
  EXPECT_NE(m1.find("quantize_fp8: x at address"), std::string::npos) << m1;
  d_x.set_offset(0);

  DeviceTensor d_x40(DType::BF16, {4, 40}), d_q40(DType::F8E4M3, {4, 40}), d_t(DType::F32, {1});
  auto [c2, m2] = code_of([&] { quantize_fp8({Fp8Scaling::PerTensor, d_x40.view(), nt.view(), d_q40.view(), d_t.view()}, nullptr); });
  EXPECT_EQ(c2, ErrorCode::Unsupported) << m2;
  EXPECT_EQ(m2, "quantize_fp8: x has 40 columns but the FP8 kernels move rows in 16-element vectors (expected H % 16 == 0)");

  DeviceTensor d_x96(DType::BF16, {4, 96}), d_q96(DType::F8E4M3, {4, 96});
  auto [c3, m3] = code_of([&] { quantize_fp8({Fp8Scaling::Block1x128, d_x96.view(), nt.view(), d_q96.view(), d_s.view()}, nullptr); });
  EXPECT_EQ(c3, ErrorCode::InvalidArgument) << m3;
  EXPECT_EQ(m3, "quantize_fp8: x has 96 columns but 1x128 blockwise scaling needs a multiple of 128 (H % 128 == 0)");
}

}  // namespace
}  // namespace moerail
