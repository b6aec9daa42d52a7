// tests/quant/segment_cases.h — inputs shared by the GPU tests of the quantizers that read expert segments
// (transposed_quant_test.cu, expert_quant_test.cu).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "moerail/reference/host.h"

namespace moerail::testing {

// x [rows, C] bf16, row r of magnitude 2^(k - 12) with k drawn per row (rows binades apart), a NaN and a -0; with
// `inf_and_zero_block` also a +inf and a zero column block (128 rows of column 5): the block recipes' edge cases
// (a per-tensor scale over a tensor holding an inf would be inf for the whole segment, so those tests leave it out).
inline ref::HostTensor random_segment_rows(std::int64_t rows, std::int64_t C, std::uint64_t seed,
                                           bool inf_and_zero_block) {
  ref::HostTensor x(DType::BF16, {rows, C});
  ref::Rng rng(seed);
  for (std::int64_t r = 0; r < rows; ++r) {
    const double m = std::ldexp(1.0, int(rng.below(24)) - 12);
    for (std::int64_t c = 0; c < C; ++c) x.set_f(r * C + c, rng.normal() * m);
  }
  if (rows > 3 && C >= 64) {
    if (inf_and_zero_block) {
      for (std::int64_t r = 0; r < std::min<std::int64_t>(rows, 128); ++r) x.set_f(r * C + 5, 0.0);
      x.set_f(2 * C + 8, std::numeric_limits<double>::infinity());
    }
    x.set_f(1 * C + 7, std::numeric_limits<double>::quiet_NaN());
    x.set_f(3 * C + 9, -0.0);
  }
  return x;
}

// 40 experts, every fourth and the two around the 32-expert step of the scans empty, 1770 rows routed.
inline std::vector<std::int64_t> forty_counts() {
  std::vector<std::int64_t> c(40);
  for (std::size_t e = 0; e < c.size(); ++e) c[e] = (e % 4 == 0 || e == 31 || e == 33) ? 0 : 59 + std::int64_t(e % 3);
  return c;
}

// One case: x's rows and columns, the counts, and whether they are i64.
struct SegmentCase {
  std::int64_t rows, C;
  std::vector<std::int64_t> counts;
  bool i64;
};

}  // namespace moerail::testing
