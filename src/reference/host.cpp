#include "moerail/reference/host.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace moerail::ref {

double load_float(const TensorView& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::F64: return t.as<const double>()[i];
    case DType::F32: return t.as<const float>()[i];
    case DType::BF16: return bf16_bits_to_float(t.as<const std::uint16_t>()[i]);
    case DType::F16: return f16_bits_to_float(t.as<const std::uint16_t>()[i]);
    default: fail("load_float", "dtype ", dtype_name(t.dtype()), " is not a floating type the reference reads");
  }
}

void store_float(const TensorView& t, std::int64_t i, double v) {
  switch (t.dtype()) {
    case DType::F64: t.as<double>()[i] = v; return;
    case DType::F32: t.as<float>()[i] = float(v); return;
    case DType::BF16: t.as<std::uint16_t>()[i] = float_to_bf16_bits(float(v)); return;
    case DType::F16: t.as<std::uint16_t>()[i] = float_to_f16_bits(float(v)); return;
    default: fail("store_float", "dtype ", dtype_name(t.dtype()), " is not a floating type the reference writes");
  }
}

std::int64_t load_int(const TensorView& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::I32: return t.as<const std::int32_t>()[i];
    case DType::I64: return t.as<const std::int64_t>()[i];
    case DType::Bool: return t.as<const std::uint8_t>()[i] ? 1 : 0;
    default: fail("load_int", "dtype ", dtype_name(t.dtype()), " is not an integer type");
  }
}

void store_int(const TensorView& t, std::int64_t i, std::int64_t v) {
  switch (t.dtype()) {
    case DType::I32: t.as<std::int32_t>()[i] = std::int32_t(v); return;
    case DType::I64: t.as<std::int64_t>()[i] = v; return;
    case DType::Bool: t.as<std::uint8_t>()[i] = v ? 1 : 0; return;
    default: fail("store_int", "dtype ", dtype_name(t.dtype()), " is not an integer type");
  }
}

std::vector<double> read_floats(const TensorView& t) {
  std::vector<double> v(std::size_t(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) v[std::size_t(i)] = load_float(t, i);
  return v;
}

void write_floats(const TensorView& t, std::span<const double> values) {
  if (std::int64_t(values.size()) != t.numel())
    fail("write_floats", "got ", values.size(), " values for a view of ", t.numel(), " elements");
  for (std::int64_t i = 0; i < t.numel(); ++i) store_float(t, i, values[std::size_t(i)]);
}

HostTensor::HostTensor(const HostTensor& other) : storage_(other.storage_), view_(other.view_) {
  if (view_.defined()) view_ = view_.with_data(storage_.data());
}

HostTensor& HostTensor::operator=(const HostTensor& other) {
  if (this != &other) {
    storage_ = other.storage_;
    view_ = other.view_.defined() ? other.view_.with_data(storage_.data()) : other.view_;
  }
  return *this;
}

HostTensor::HostTensor(DType dtype, std::initializer_list<std::int64_t> shape)
    : HostTensor(dtype, std::vector<std::int64_t>(shape)) {}

HostTensor::HostTensor(DType dtype, const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  storage_.assign(std::size_t((n * std::int64_t(dtype_size(dtype)) + 7) / 8 + 1), 0);
  void* p = storage_.data();
  switch (shape.size()) {
    case 1: view_ = TensorView(p, dtype, {shape[0]}); break;
    case 2: view_ = TensorView(p, dtype, {shape[0], shape[1]}); break;
    case 3: view_ = TensorView(p, dtype, {shape[0], shape[1], shape[2]}); break;
    case 4: view_ = TensorView(p, dtype, {shape[0], shape[1], shape[2], shape[3]}); break;
    default: fail("HostTensor", "1 to 4 dimensions expected, got ", shape.size());
  }
}

void HostTensor::fill(double v) const {
  for (std::int64_t k = 0; k < numel(); ++k) store_float(view_, k, v);
}

void HostTensor::fill_nan() const {
  if (is_floating(dtype())) {
    fill(std::numeric_limits<double>::quiet_NaN());
  } else {
    std::memset(view_.data(), 0x7f, view_.nbytes());
  }
}

Rng::Rng(std::uint64_t seed) {
  auto splitmix = [&seed]() {
    std::uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  s_[0] = splitmix();
  s_[1] = splitmix();
}

std::uint64_t Rng::next() {  // xorshift128+
  std::uint64_t a = s_[0];
  const std::uint64_t b = s_[1];
  s_[0] = b;
  a ^= a << 23;
  s_[1] = a ^ b ^ (a >> 17) ^ (b >> 26);
  return s_[1] + b;
}

double Rng::uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
double Rng::uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

double Rng::normal() {
  double u1 = uniform(), u2 = uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

std::int64_t Rng::below(std::int64_t n) { return n <= 0 ? 0 : std::int64_t(next() % std::uint64_t(n)); }

void fill_uniform(const HostTensor& t, Rng& rng, double lo, double hi) {
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set_f(i, rng.uniform(lo, hi));
}

void fill_normal(const HostTensor& t, Rng& rng, double stddev) {
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set_f(i, stddev * rng.normal());
}

}  // namespace moerail::ref
