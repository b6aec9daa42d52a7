// moerail/reference/host.h — host buffers and element access for the CPU reference, tests and tools.
//
// The reference computes in double and reads/writes caller views of any floating dtype (f64, f32, bf16, f16),
// rounding once on store. HostTensor is a small owning host buffer with a TensorView of itself.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

#include "moerail/tensor.h"

namespace moerail::ref {

// Element i of a floating or integer host view, as double / int64.
double load_float(const TensorView& t, std::int64_t i);
void store_float(const TensorView& t, std::int64_t i, double v);  // rounds to t's dtype
std::int64_t load_int(const TensorView& t, std::int64_t i);       // i32, i64 or bool
void store_int(const TensorView& t, std::int64_t i, std::int64_t v);

std::vector<double> read_floats(const TensorView& t);
void write_floats(const TensorView& t, std::span<const double> values);  // values.size() == t.numel()

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::initializer_list<std::int64_t> shape);
  HostTensor(DType dtype, const std::vector<std::int64_t>& shape);
  // Copies own their storage (a deep copy viewing its own bytes); moves take the storage along.
  HostTensor(const HostTensor& other);
  HostTensor& operator=(const HostTensor& other);
  HostTensor(HostTensor&&) noexcept = default;
  HostTensor& operator=(HostTensor&&) noexcept = default;

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  std::int64_t numel() const { return view_.numel(); }
  DType dtype() const { return view_.dtype(); }
  double f(std::int64_t i) const { return load_float(view_, i); }
  void set_f(std::int64_t i, double v) const { store_float(view_, i, v); }
  std::int64_t i(std::int64_t idx) const { return load_int(view_, idx); }
  void set_i(std::int64_t idx, std::int64_t v) const { store_int(view_, idx, v); }
  void fill(double v) const;       // floating tensors
  void fill_nan() const;           // poison: NaN for floating dtypes, 0x7f.. pattern for integers
  std::vector<double> floats() const { return read_floats(view_); }

 private:
  std::vector<std::uint64_t> storage_;  // 8-byte aligned
  TensorView view_;
};

// Deterministic pseudo-random numbers for tests and tools (splitmix64-seeded xorshift; same on every machine).
class Rng {
 public:
  explicit Rng(std::uint64_t seed);
  std::uint64_t next();
  double uniform();                             // [0, 1)
  double uniform(double lo, double hi);         // [lo, hi)
  double normal();                              // mean 0, stddev 1
  std::int64_t below(std::int64_t n);           // [0, n)

 private:
  std::uint64_t s_[2];
};

void fill_uniform(const HostTensor& t, Rng& rng, double lo, double hi);
void fill_normal(const HostTensor& t, Rng& rng, double stddev);

}  // namespace moerail::ref
