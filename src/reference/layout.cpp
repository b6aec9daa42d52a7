// CPU reference of the layout planner. Contract: include/moerail/reference/layout.h.
//
// The plan is built in four passes over plain loops:
//   1. count the routed slots of every (source rank, expert);
//   2. pad each expert's total to a multiple of A;
//   3. lay the padded segments of each rank's local experts one after the other from row 0, each clipped to the
//      per-expert capacity (if any), the whole clipped to the buffer;
//   4. hand out rows: walking the slots in (source rank, token, k) order and giving each slot the next free row of
//      its expert puts the rows of one expert in (source rank, token, k) order, as the contract asks.
#include "moerail/reference/layout.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "moerail/error.h"

namespace moerail::ref {
namespace {

constexpr std::string_view kOp = "plan_layout";

std::int64_t round_up(std::int64_t value, std::int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Everything plan_layout reads is checked here, before any planning starts.
std::int64_t check_arguments(const MoeConfig& cfg, std::span<const TensorView> topk_idx, std::int64_t capacity) {
  cfg.validate();
  const std::int64_t R = cfg.ep_size, E = cfg.num_experts, K = cfg.topk;
  if (std::int64_t(topk_idx.size()) != R)
    fail(kOp, "got topk_idx views for ", topk_idx.size(), " ranks but cfg.ep_size = ", R, " (one view per rank)");
  if (capacity < -1)
    fail(kOp, "capacity = ", capacity, " but a row count >= 0, or -1 for cfg.rows_per_rank(), was expected");
  const std::int64_t rows = capacity == -1 ? cfg.rows_per_rank() : capacity;
  if (rows > std::numeric_limits<std::int32_t>::max())
    fail(kOp, "capacity = ", rows, " rows does not fit the i32 row indices of the plan");

  for (std::int64_t r = 0; r < R; ++r) {
    const TensorView& idx = topk_idx[std::size_t(r)];
    const std::string name = detail::concat("topk_idx of rank ", r);
    check_shape(kOp, name, idx, {-1, K});
    check_dtype(kOp, name, idx, {DType::I32});
    check_device(kOp, name, idx, Device::host());
    if (idx.size(0) > cfg.max_tokens)
      fail(kOp, name, " has ", idx.size(0), " tokens but cfg.max_tokens = ", cfg.max_tokens);
  }
  for (std::int64_t r = 0; r < R; ++r) {
    const TensorView& idx = topk_idx[std::size_t(r)];
    const std::int32_t* ids = idx.as<const std::int32_t>();
    for (std::int64_t t = 0; t < idx.size(0); ++t) {
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int64_t e = ids[t * K + k];
        if (e < -1 || e >= E)
          fail_with(ErrorCode::BadRouting, kOp, "rank ", r, " topk_idx[", t, ",", k, "] = ", e,
                    " but num_experts = ", E, " (expected -1 <= id < ", E, ")");
      }
    }
  }
  return rows;
}

}  // namespace

std::vector<std::int64_t> LayoutPlan::local_segment_rows(std::int64_t r) const {
  if (r < 0 || r >= num_ranks)
    fail("LayoutPlan::local_segment_rows", "rank ", r, " but the plan has ", num_ranks, " ranks");
  const auto first = segment_rows.begin() + r * local_experts;
  return std::vector<std::int64_t>(first, first + local_experts);
}

LayoutPlan plan_layout(const MoeConfig& cfg, std::span<const TensorView> topk_idx, std::int64_t capacity,
                       std::int64_t peer_rows) {
  const std::int64_t rows = check_arguments(cfg, topk_idx, capacity);
  if (peer_rows < -1) fail(kOp, "peer_rows = ", peer_rows, " (expected >= 0, or -1 for no bound)");

  const std::int64_t R = cfg.ep_size, E = cfg.num_experts, L = cfg.local_experts(), K = cfg.topk, A = cfg.align;
  LayoutPlan plan;
  plan.num_ranks = R;
  plan.num_experts = E;
  plan.local_experts = L;
  plan.topk = K;
  plan.align = A;
  plan.capacity = rows;
  plan.tokens.resize(std::size_t(R));
  for (std::int64_t s = 0; s < R; ++s) plan.tokens[std::size_t(s)] = topk_idx[std::size_t(s)].size(0);

  // 0. The routing as planned: under a peer_rows bound each source keeps, for every other rank, the slots of its
  //    first peer_rows tokens routed there; the later ones are dropped at the source.
  plan.peer_rows = peer_rows;
  plan.peer_dropped.assign(std::size_t(R), 0);
  std::vector<std::vector<std::int32_t>> ids(static_cast<std::size_t>(R));
  for (std::int64_t s = 0; s < R; ++s) {
    const std::int64_t T = plan.tokens[std::size_t(s)];
    const auto* in = topk_idx[std::size_t(s)].as<const std::int32_t>();
    ids[std::size_t(s)].assign(in, in + T * K);
    if (peer_rows < 0) continue;
    std::vector<std::int64_t> staged(std::size_t(R), 0);
    for (std::int64_t t = 0; t < T; ++t) {
      std::int32_t* slot = ids[std::size_t(s)].data() + t * K;
      for (std::int64_t d = 0; d < R; ++d) {
        if (d == s) continue;
        bool routed = false;
        for (std::int64_t k = 0; k < K; ++k) routed |= slot[k] >= 0 && slot[k] / L == d;
        if (!routed || staged[std::size_t(d)]++ < peer_rows) continue;
        for (std::int64_t k = 0; k < K; ++k) {
          if (slot[k] >= 0 && slot[k] / L == d) {
            slot[k] = -1;
            ++plan.peer_dropped[std::size_t(s)];
          }
        }
      }
    }
  }
  // Slot k of token t on source rank s routes to this expert, or -1.
  auto expert_of = [&](std::int64_t s, std::int64_t t, std::int64_t k) -> std::int64_t {
    return ids[std::size_t(s)][std::size_t(t * K + k)];
  };

  // 1. Routed slots per (source rank, expert) and per expert over all sources (before capacity).
  plan.counts.assign(std::size_t(R * E), 0);
  plan.tokens_per_expert.assign(std::size_t(E), 0);
  for (std::int64_t s = 0; s < R; ++s) {
    for (std::int64_t t = 0; t < plan.tokens[std::size_t(s)]; ++t) {
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int64_t e = expert_of(s, t, k);
        if (e < 0) continue;
        ++plan.counts[std::size_t(s * E + e)];
        ++plan.tokens_per_expert[std::size_t(e)];
      }
    }
  }

  // 2. Each expert's segment is padded to a multiple of A.
  plan.padded_per_expert.resize(std::size_t(E));
  for (std::int64_t e = 0; e < E; ++e)
    plan.padded_per_expert[std::size_t(e)] = round_up(plan.tokens_per_expert[std::size_t(e)], A);

  // 3. Segments of rank r's local experts follow each other from row 0, each at most expert_capacity rows (a
  //    multiple of A) under Capacity::PerExpert; the buffer clips them at `rows`.
  plan.expert_capacity = cfg.expert_rows();
  const auto segment_size = [&](std::int64_t e) {
    const std::int64_t padded = plan.padded_per_expert[std::size_t(e)];
    return plan.expert_capacity > 0 ? std::min(padded, plan.expert_capacity) : padded;
  };
  plan.segment_offset.resize(std::size_t(E));
  plan.segment_rows.resize(std::size_t(E));
  plan.rows_needed.assign(std::size_t(R), 0);
  plan.rows_used.assign(std::size_t(R), 0);
  for (std::int64_t r = 0; r < R; ++r) {
    std::int64_t offset = 0;
    for (std::int64_t e = r * L; e < (r + 1) * L; ++e) {
      plan.segment_offset[std::size_t(e)] = offset;
      plan.segment_rows[std::size_t(e)] = std::clamp<std::int64_t>(rows - offset, 0, segment_size(e));
      offset += segment_size(e);
      plan.rows_needed[std::size_t(r)] += plan.padded_per_expert[std::size_t(e)];
    }
    plan.rows_used[std::size_t(r)] = std::min(offset, rows);
  }

  // 4. Rows of the routed slots. next_row[e] is the next free row of expert e's segment; a slot whose place in its
  //    expert reaches the expert's capacity, or whose row falls at or beyond the buffer's end, is dropped and
  //    counted against the destination rank.
  std::vector<std::int64_t> next_row = plan.segment_offset;
  plan.overflow.assign(std::size_t(R), 0);
  plan.dest_rank.resize(std::size_t(R));
  plan.dest_row.resize(std::size_t(R));
  for (std::int64_t s = 0; s < R; ++s) {
    const std::int64_t T = plan.tokens[std::size_t(s)];
    std::vector<std::int32_t>& dest_rank = plan.dest_rank[std::size_t(s)];
    std::vector<std::int32_t>& dest_row = plan.dest_row[std::size_t(s)];
    dest_rank.assign(std::size_t(T * K), -1);
    dest_row.assign(std::size_t(T * K), -1);
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int64_t e = expert_of(s, t, k);
        if (e < 0) continue;
        const std::int64_t d = plan.rank_of_expert(e);
        const std::int64_t row = next_row[std::size_t(e)]++;
        const std::int64_t place = row - plan.segment_offset[std::size_t(e)];
        if (row >= rows || (plan.expert_capacity > 0 && place >= plan.expert_capacity)) {
          ++plan.overflow[std::size_t(d)];
          continue;
        }
        dest_rank[std::size_t(t * K + k)] = std::int32_t(d);
        dest_row[std::size_t(t * K + k)] = std::int32_t(row);
      }
    }
  }
  return plan;
}

}  // namespace moerail::ref
