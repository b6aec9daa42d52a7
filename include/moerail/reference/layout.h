// moerail/reference/layout.h — CPU reference of the layout planner (no data movement).
//
// From topk_idx of every rank, computes where each routed (t, k) lands. Row order on a destination rank is
// expert-major (local experts in order); inside an expert by source rank, then source token index, then k.
// Each expert's segment is padded to padded = ceil(count / A) * A rows; pad rows sit at the end of the segment.
// Segments follow each other from row 0. With R = 1 this is TransformerEngine's mask-map permute order.
//
// Capacity: a rank's buffer has `capacity` rows. A routed row whose index would be >= capacity is dropped (not
// written anywhere) and counted in overflow[rank]; segment_rows[] is clipped to the buffer likewise. Rows are laid
// out first and clipped afterwards, so what is dropped is the tail of the rank's buffer (its last experts first);
// the rows that fit keep the row they would have had with unlimited capacity.
// Under Capacity::PerExpert each expert's segment holds at most expert_capacity = cfg.expert_rows() rows (a
// multiple of A): an expert's segment is min(padded, expert_capacity) rows, and its slots past the first
// expert_capacity (in source rank, token, k order: the last sources' last tokens) are dropped and counted.
//
// A token may name the same expert in several slots: each slot gets its own row, in k order. WorstCase sizing
// assumes distinct experts per token (as every router produces); duplicates can overflow it and are then counted
// in overflow[] like any other overflow.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moerail/config.h"
#include "moerail/tensor.h"

namespace moerail::ref {

struct LayoutPlan {
  std::int64_t num_ranks = 0, num_experts = 0, local_experts = 0, topk = 0, align = 1, capacity = 0;
  std::int64_t expert_capacity = 0;             // rows of one expert's segment at most (Capacity::PerExpert); 0 = none
  std::vector<std::int64_t> tokens;             // [R] tokens on each source rank
  std::vector<std::int64_t> counts;             // [R * E] routed slots per (source rank, expert), row-major
  std::vector<std::int64_t> tokens_per_expert;  // [E] routed rows of each (global) expert, all sources, dropped
                                                //     rows included (the demand, before capacity)
  std::vector<std::int64_t> padded_per_expert;  // [E] ceil(tokens_per_expert / A) * A
  std::vector<std::int64_t> segment_offset;     // [E] first row of the expert's segment on its rank (not clipped:
                                                //     >= capacity for a segment wholly outside the buffer)
  std::vector<std::int64_t> segment_rows;       // [E] rows of the segment inside the buffer: padded, clipped to
                                                //     expert_capacity (if any) and to the buffer
  std::vector<std::int64_t> rows_needed;        // [R] sum of padded segments of the rank's experts (the demand)
  std::vector<std::int64_t> rows_used;          // [R] rows of the rank's segments inside the buffer
  std::vector<std::int64_t> overflow;           // [R] routed rows that did not fit and were dropped
  std::int64_t peer_rows = -1;                  // tokens a source stages for one other rank at most; -1 = no bound
  std::vector<std::int64_t> peer_dropped;       // [R] slots each source dropped past peer_rows (not in counts)
  // Per source rank s, flat slot t * K + k: destination rank and row, or -1 when unrouted (id -1) or dropped.
  std::vector<std::vector<std::int32_t>> dest_rank, dest_row;

  std::int64_t rank_of_expert(std::int64_t e) const { return e / local_experts; }
  // segment_rows of rank r's local experts, [L]: the per-expert row counts an expert MLP on rank r runs over.
  std::vector<std::int64_t> local_segment_rows(std::int64_t r) const;
};

// topk_idx: one [T_r, K] i32 host view per rank (T_r may differ, 0 included), read. capacity: rows per rank; -1
// means cfg.rows_per_rank(). Runs cfg.validate(). Throws Error(InvalidArgument) for a wrong shape/dtype/device,
// topk_idx.size() != cfg.ep_size, T_r > cfg.max_tokens, capacity < -1 or a capacity beyond i32 rows, and
// Error(BadRouting) naming rank, token, slot, value and E for an expert id outside [-1, E).
// peer_rows (the host-API transport's staging, MoeConfig::peer_rows()): -1 = no bound; >= 0: a source sends each
// other rank the rows of at most its first peer_rows tokens routed there (token order); the slots at that rank of
// its later tokens are dropped at the source, counted in peer_dropped, and planned as if unrouted (so they are in
// neither counts nor tokens_per_expert).
LayoutPlan plan_layout(const MoeConfig& cfg, std::span<const TensorView> topk_idx, std::int64_t capacity = -1,
                       std::int64_t peer_rows = -1);

}  // namespace moerail::ref
