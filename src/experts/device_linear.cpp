// src/experts/device_linear.cpp — DeviceLinear (device_linear.h): three one-group GEMMs (forward, dgrad, wgrad) and
// the setup kernel that reads T from device memory before each of them.
#include "experts/device_linear.h"

#include <string>

#include "core/cuda_check.h"
#include "experts/gemm_slot.h"
#include "experts/tiles.h"
#include "experts/setup.h"
#include "moerail/error.h"

namespace moerail::experts {

namespace {
constexpr std::int64_t kBf16 = 2;

OperandSetup rows_of(const TensorView& t, std::int64_t width) {
  return {static_cast<const char*>(t.data()), width * kBf16, 0, -1};
}
OperandSetup whole(const TensorView& t) { return {static_cast<const char*>(t.data()), 0, 0, -1}; }
}  // namespace

struct DeviceLinear::Impl {
  std::string name;
  std::int64_t in = 0, out = 0, max_rows = 0;
  int device = 0;
  GemmSlot fwd, dgrad, wgrad;
  std::int64_t* offsets[3] = {nullptr, nullptr, nullptr};  // [2] per pass (the setup kernel writes them)
  DeviceBuffer memory;
  std::size_t bytes = 0;

  void check(const char* what, const TensorView& t, std::int64_t rows, std::int64_t cols) const {
    if (!t.defined()) fail(name, what, " is absent but required");
    check_device(name, what, t, Device::cuda(device));
    check_dtype(name, what, t, {DType::BF16});
    check_shape(name, what, t, {rows, cols});
    if ((reinterpret_cast<std::uintptr_t>(t.data()) & 15u) != 0) fail(name, what, " is not 16-byte aligned");
  }
  void check_count(const TensorView& n) const {
    if (!n.defined()) fail(name, "num_tokens is absent but required");
    check_device(name, "num_tokens", n, Device::cuda(device));
    check_dtype(name, "num_tokens", n, {DType::I32});
    check_shape(name, "num_tokens", n, {1});
  }
  SetupParams setup(const TensorView& num_tokens, std::int64_t* offs) const {
    SetupParams p;
    p.counts = num_tokens.data();
    p.L = 1;
    p.rows = max_rows;
    p.offsets = offs;
    return p;
  }
};

DeviceLinear::DeviceLinear(std::int64_t in, std::int64_t out, std::int64_t max_rows, const char* name,
                           DeviceAllocator& allocator)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.name = name;
  m.in = in;
  m.out = out;
  m.max_rows = max_rows;
  if (in % 8 != 0 || out % 8 != 0 || in <= 0 || out <= 0)
    fail(name, "sizes ", out, " x ", in, " must be positive multiples of 8 (16-byte TMA rows of bf16)");
  if (max_rows >= (std::int64_t(1) << 31)) fail(name, "max_rows = ", max_rows, " exceeds the 32-bit GEMM sizes");
  m.device = cuda::current_device();
  const std::int64_t rows_hint = std::max<std::int64_t>(max_rows, 1);
  auto slot = [&](GemmSlot& s, const char* what, GemmLayout layout, std::int64_t mm, std::int64_t nn,
                  std::int64_t kk, std::int64_t lda, std::int64_t ldb, std::int64_t ldd) {
    s.name = what;
    s.layout = layout;
    s.tile = choose_tile(layout, mm, nn, kk);  // the expert GEMMs' rules (not measured on the gate's shapes)
    s.ld_a = lda;
    s.ld_b = ldb;
    s.ld_d = ldd;
    s.gemm = make_grouped_gemm(s.layout, s.tile);
    s.workspace_bytes = s.gemm->workspace_bytes(1);
  };
  //                                 layout            M          N    K          lda  ldb  ldd
  slot(m.fwd, "router gate", GemmLayout::TN, rows_hint, out, in, in, in, out);
  slot(m.dgrad, "router gate dgrad", GemmLayout::NN, rows_hint, in, out, out, in, in);
  slot(m.wgrad, "router gate wgrad", GemmLayout::Wgrad, out, in, rows_hint, out, in, in);
  auto carve = [&](Carver& c) {
    for (GemmSlot* s : {&m.fwd, &m.dgrad, &m.wgrad}) s->carve(c, 1);
    for (auto*& o : m.offsets) o = c.take<std::int64_t>(2);
  };
  Carver dry;
  carve(dry);
  m.bytes = dry.used;
  m.memory = DeviceBuffer(allocator, m.bytes);
  MOERAIL_CUDA_CHECK(cudaMemset(m.memory.data(), 0, m.bytes));
  Carver real{static_cast<char*>(m.memory.data())};
  carve(real);
  for (GemmSlot* s : {&m.fwd, &m.dgrad, &m.wgrad})
    s->gemm->initialize(s->arrays, s->ld_a, s->ld_b, s->ld_d, s->workspace, s->name, /*max_sms=*/0);
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
}

DeviceLinear::~DeviceLinear() = default;

std::size_t DeviceLinear::device_bytes() const { return impl_->bytes; }

void DeviceLinear::forward(const TensorView& x, const TensorView& w, const TensorView& num_tokens,
                           const TensorView& y, cudaStream_t stream) {
  Impl& m = *impl_;
  m.check("x", x, m.max_rows, m.in);
  m.check("weight", w, m.out, m.in);
  m.check("y", y, m.max_rows, m.out);
  m.check_count(num_tokens);
  SetupParams p = m.setup(num_tokens, m.offsets[0]);
  p.num_gemms = 1;
  p.gemm[0] = {m.fwd.arrays, rows_of(x, m.in), whole(w), rows_of(y, m.out), kRagged, int(m.out), int(m.in)};
  launch_setup(p, nullptr, stream);
  m.fwd.gemm->run(stream);
}

void DeviceLinear::backward(const TensorView& x, const TensorView& w, const TensorView& num_tokens,
                            const TensorView& dy, const TensorView& dx, const TensorView& dw, cudaStream_t stream) {
  Impl& m = *impl_;
  m.check("x", x, m.max_rows, m.in);
  m.check("weight", w, m.out, m.in);
  m.check("dy", dy, m.max_rows, m.out);
  m.check("dx", dx, m.max_rows, m.in);
  m.check("d_weight", dw, m.out, m.in);
  m.check_count(num_tokens);
  SetupParams p = m.setup(num_tokens, m.offsets[1]);
  p.num_gemms = 2;
  // dx [T, in] = dy [T, out] W [out, in]
  p.gemm[0] = {m.dgrad.arrays, rows_of(dy, m.out), whole(w), rows_of(dx, m.in), kRagged, int(m.in), int(m.out)};
  // dW [out, in] = dy^T x: A = dy read as [K = T, M = out], B = x [K, N = in]
  p.gemm[1] = {m.wgrad.arrays, rows_of(dy, m.out), rows_of(x, m.in), whole(dw), int(m.out), int(m.in), kRagged};
  launch_setup(p, nullptr, stream);
  ZeroEmptyParams z;  // T = 0: the wgrad GEMM has nothing to sum, dW must still be written
  z.offsets = m.offsets[1];
  z.L = 1;
  z.num = 1;
  z.ptr_d[0] = m.wgrad.arrays.ptr_d;
  z.bytes[0] = m.out * m.in * kBf16;
  launch_zero_empty(z, stream);
  m.dgrad.gemm->run(stream);
  m.wgrad.gemm->run(stream);
}

}  // namespace moerail::experts
