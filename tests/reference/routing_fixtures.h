// tests/reference/routing_fixtures.h — random routing, per-rank tensors and an independent layout model, shared by
// layout_test.cpp and dispatch_test.cpp.
//
// expected_layout() derives every (t, k)'s destination by sorting the routed slots by (expert, source rank, token,
// k), the order the contract states, instead of the planner's running counters; the tests compare the planner
// against it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "moerail/reference/host.h"
#include "moerail/tensor.h"

namespace moerail::test {

using ref::HostTensor;
using ref::Rng;

// One tensor per rank, and their views (what the ops take as std::span<const TensorView>).
using PerRank = std::vector<HostTensor>;

inline std::vector<TensorView> views(const PerRank& tensors) {
  std::vector<TensorView> v;
  for (const HostTensor& t : tensors) v.push_back(t.view());
  return v;
}

inline PerRank per_rank(DType dtype, const std::vector<std::int64_t>& rows, std::int64_t cols) {
  PerRank out;
  for (std::int64_t r : rows) out.emplace_back(dtype, std::vector<std::int64_t>{r, cols});
  return out;
}

inline PerRank per_rank_1d(DType dtype, std::size_t ranks, std::int64_t rows) {
  PerRank out;
  for (std::size_t r = 0; r < ranks; ++r) out.emplace_back(dtype, std::vector<std::int64_t>{rows});
  return out;
}

// Token counts per rank in [0, t_max]; with R > 1 one rank (chosen at random) brings no tokens at all.
inline std::vector<std::int64_t> random_tokens(Rng& rng, std::int64_t R, std::int64_t t_max) {
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(R));
  for (auto& t : tokens) t = rng.below(t_max + 1);
  if (R > 1) tokens[std::size_t(rng.below(R))] = 0;
  return tokens;
}

// topk_idx [T_r, K] i32 per rank: K distinct experts per token, each slot -1 (unrouted) with probability
// `unrouted`.
inline PerRank random_routing(Rng& rng, const std::vector<std::int64_t>& tokens, std::int64_t E, std::int64_t K,
                              double unrouted = 0.0) {
  PerRank idx = per_rank(DType::I32, tokens, K);
  for (const HostTensor& ids : idx) {
    const std::int64_t T = ids.view().size(0);
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<std::int64_t> chosen;
      while (std::int64_t(chosen.size()) < K) {
        const std::int64_t e = rng.below(E);
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (std::int64_t k = 0; k < K; ++k)
        ids.set_i(t * K + k, rng.uniform() < unrouted ? -1 : chosen[std::size_t(k)]);
    }
  }
  return idx;
}

// The layout the contract describes, derived by sorting.
struct ExpectedLayout {
  std::vector<std::int64_t> count;                      // [E] routed slots, all sources
  std::vector<std::int64_t> padded;                     // [E] count rounded up to A
  std::vector<std::int64_t> offset;                     // [E] first row of the segment on its rank
  std::vector<std::int64_t> rows_needed, overflow;      // [R]
  std::vector<std::vector<std::int64_t>> rank, row;     // per source rank, slot t*K+k; -1 unrouted or dropped
  std::vector<std::vector<std::int64_t>> unclipped_row; // per source rank, slot t*K+k; row ignoring capacity
};

inline ExpectedLayout expected_layout(const PerRank& topk_idx, std::int64_t E, std::int64_t A,
                                      std::int64_t capacity) {
  const auto R = std::int64_t(topk_idx.size());
  const std::int64_t L = E / R;
  ExpectedLayout x;
  x.count.assign(std::size_t(E), 0);
  x.rows_needed.assign(std::size_t(R), 0);
  x.overflow.assign(std::size_t(R), 0);

  using Slot = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>;  // (expert, source, token, k)
  std::vector<Slot> slots;
  for (std::int64_t s = 0; s < R; ++s) {
    const TensorView& ids = topk_idx[std::size_t(s)].view();
    const std::int64_t T = ids.size(0), K = ids.size(1);
    x.rank.emplace_back(std::size_t(T * K), -1);
    x.row.emplace_back(std::size_t(T * K), -1);
    x.unclipped_row.emplace_back(std::size_t(T * K), -1);
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t k = 0; k < K; ++k)
        if (const std::int64_t e = ref::load_int(ids, t * K + k); e >= 0) slots.emplace_back(e, s, t, k);
  }
  std::sort(slots.begin(), slots.end());
  for (const Slot& sl : slots) ++x.count[std::size_t(std::get<0>(sl))];

  x.padded.resize(std::size_t(E));
  x.offset.resize(std::size_t(E));
  for (std::int64_t e = 0; e < E; ++e) {
    x.padded[std::size_t(e)] = (x.count[std::size_t(e)] + A - 1) / A * A;
    x.offset[std::size_t(e)] = e % L == 0 ? 0 : x.offset[std::size_t(e - 1)] + x.padded[std::size_t(e - 1)];
    x.rows_needed[std::size_t(e / L)] += x.padded[std::size_t(e)];
  }
  std::int64_t position = 0;  // index of the slot inside its expert's sorted run
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const auto [e, s, t, k] = slots[i];
    position = (i > 0 && std::get<0>(slots[i - 1]) == e) ? position + 1 : 0;
    const std::int64_t row = x.offset[std::size_t(e)] + position;
    const std::int64_t K = topk_idx[std::size_t(s)].view().size(1);
    x.unclipped_row[std::size_t(s)][std::size_t(t * K + k)] = row;
    if (row >= capacity) {
      ++x.overflow[std::size_t(e / L)];
    } else {
      x.rank[std::size_t(s)][std::size_t(t * K + k)] = e / L;
      x.row[std::size_t(s)][std::size_t(t * K + k)] = row;
    }
  }
  return x;
}

}  // namespace moerail::test
