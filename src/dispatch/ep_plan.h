// src/dispatch/ep_plan.h — the expert-parallel layout of one rank from the exchanged counts, as plain code that runs
// on the host (tests, against ref::plan_layout: plan_serial) and in the planner kernel (one block: the same phases
// per expert, the prefix sums by block-wide scans); and the data kernels' list of remote work (RemoteWork, at the
// end).
//
// Input: counts[s * W + e] = routed slots of source rank s to expert e, counts[s * W + E] = T_s, where the row width
// W = PlanShape::row() is E + 1, or E + 1 + R when the rows also carry the rows staged for each rank
// (counts[s * W + E + 1 + r], host-API compact staging: ep_common.cuh).
// Row order on a destination rank: expert-major, by source rank, token, k (docs/design.md); a source's slots to
// expert e start at base[e] = segment start of e + the slots of lower source ranks to e, and the slot's place among
// its own slots to e (token, k order) comes from the local planner. Under Capacity::PerExpert an expert's segment is
// at most expert_cap rows (a multiple of A) and its slots past the first expert_cap are dropped; rows at or beyond
// the capacity of the buffer are dropped too. A source drops a slot whose row reaches limit[e], the end of e's
// segment inside the buffer.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace moerail::ep {

struct PlanShape {
  int R, E, L, A, me;
  std::int64_t capacity;
  std::int64_t expert_cap;  // rows of one expert's segment at most (Capacity::PerExpert); 0 = no bound
  int width = 0;            // i32 per rank in counts; 0 = E + 1
  MOERAIL_HD int row() const { return width > 0 ? width : E + 1; }
};

struct PlanOut {
  std::int32_t* base;               // [E] this rank's first row at each expert
  std::int32_t* limit;              // [E] the end of each expert's segment inside its rank's buffer (rows below it
                                    //     are kept)
  std::int32_t* tokens;             // [R] T of every rank
  std::int32_t* tokens_per_expert;  // [L]
  std::int32_t* padded_per_expert;  // [L]
  std::int32_t* segment_offset;     // [L + 1]
  std::int32_t* segment_rows;       // [L]
  std::int32_t* pad_prefix;         // [L + 1]
  std::int32_t* rows_used;          // [1]
  std::int32_t* staged;             // [R] rows each source staged for this rank (when row() > E + 1)
  std::int64_t rows_needed = 0;     // this rank's (set by plan_rank_end): its padded rows, or under expert_cap the
                                    // padded rows of its fullest expert
  std::int64_t overflow = 0;        // routed rows dropped on this rank (plan_rank_end)
};

// c rounded up to a multiple of A. Counts are i32 and A > 0: 32-bit unsigned division (a 64-bit one is a long
// software routine on the GPU).
MOERAIL_HD inline std::int64_t padded_rows(std::int32_t c, int A) {
  return std::int64_t((std::uint32_t(c) + std::uint32_t(A) - 1u) / std::uint32_t(A)) * A;
}

MOERAIL_HD inline std::int32_t clip_i32(std::int64_t v) { return std::int32_t(v < 0x7fffffff ? v : 0x7fffffff); }

// Rows of the segment of an expert with c routed slots (padded to A, at most expert_cap), and the slots it keeps.
MOERAIL_HD inline std::int64_t segment_size(const PlanShape& s, std::int32_t c) {
  const std::int64_t p = padded_rows(c, s.A);
  return s.expert_cap > 0 && p > s.expert_cap ? s.expert_cap : p;
}
MOERAIL_HD inline std::int32_t kept_slots(const PlanShape& s, std::int32_t c) {
  return s.expert_cap > 0 && c > s.expert_cap ? std::int32_t(s.expert_cap) : c;
}

// Exclusive prefix sums over the experts in global order (rank-major): segment rows (segment_size) and kept slots
// (kept_slots) of all experts before one. The segment start of expert e on its rank d is rows(e) - rows(first
// expert of d).
struct ExpertPrefix {
  std::int64_t rows, slots;  // no initializers: the planner kernel keeps these in shared memory
};

// The phases. Every expert is independent once the two prefix sums are known, so the planner kernel runs them with
// block-wide scans over tiles of experts (src/dispatch/ep_plan_kernel.cuh) and plan_serial below runs them in a loop on
// one thread (the CPU tests); the results are the same integers.

// T of every rank (any thread, r = tid, tid + nthreads, ...).
MOERAIL_HD inline void plan_tokens(const PlanShape& s, const std::int32_t* counts, PlanOut& o, int r) {
  o.tokens[r] = counts[r * s.row() + s.E];
  if (s.row() > s.E + 1) o.staged[r] = r == s.me ? 0 : counts[r * s.row() + s.E + 1 + s.me];
}

// Slots of expert e over all sources.
MOERAIL_HD inline std::int32_t expert_slots(const PlanShape& s, const std::int32_t* counts, int e) {
  std::int32_t sum = 0;
  for (int r = 0; r < s.R; ++r) sum += counts[r * s.row() + e];
  return sum;
}

// Expert e (slots of its own, prefix sums `before` it and at the first expert of its rank): this rank's base row at
// e, and for this rank's own experts the local segment. Returns the routed rows of e dropped on this rank.
MOERAIL_HD inline std::int64_t plan_expert(const PlanShape& s, const std::int32_t* counts, int e, std::int32_t slots,
                                           ExpertPrefix before, ExpertPrefix rank_first, PlanOut& o) {
  const std::int64_t start = before.rows - rank_first.rows;  // segment start on e's rank
  const std::int64_t seg = segment_size(s, slots);
  std::int64_t b = start;
  for (int r = 0; r < s.me; ++r) b += counts[r * s.row() + e];
  o.base[e] = clip_i32(b);
  o.limit[e] = clip_i32(start + seg < s.capacity ? start + seg : s.capacity);
  if (e / s.L != s.me) return 0;
  const int l = e - s.me * s.L;
  o.tokens_per_expert[l] = slots;
  o.padded_per_expert[l] = std::int32_t(padded_rows(slots, s.A));
  o.segment_offset[l] = std::int32_t(start);
  o.pad_prefix[l] = std::int32_t(start - (before.slots - rank_first.slots));
  std::int64_t inside = s.capacity - start;  // rows of this segment inside the buffer
  inside = inside < 0 ? 0 : (inside > seg ? seg : inside);
  o.segment_rows[l] = std::int32_t(inside);
  return slots - (inside < slots ? inside : slots);
}

// This rank's totals (one thread, after every plan_expert): segment rows and kept slots of its experts, rows
// dropped, and the padded rows of its fullest expert (what an expert_cap was too small for).
MOERAIL_HD inline void plan_rank_end(const PlanShape& s, std::int64_t rows, std::int64_t slots, std::int64_t overflow,
                                     std::int64_t fullest, PlanOut& o) {
  o.segment_offset[s.L] = std::int32_t(rows);
  o.pad_prefix[s.L] = std::int32_t(rows - slots);
  o.rows_used[0] = std::int32_t(rows < s.capacity ? rows : s.capacity);
  o.rows_needed = s.expert_cap > 0 ? fullest : rows;
  o.overflow = overflow;
}

// The phases in order on one thread.
inline void plan_serial(const PlanShape& s, const std::int32_t* counts, PlanOut& o) {
  for (int r = 0; r < s.R; ++r) plan_tokens(s, counts, o, r);
  ExpertPrefix before{0, 0}, first{0, 0}, mine{0, 0}, mine_end{0, 0};
  std::int64_t overflow = 0, fullest = 0;
  for (int e = 0; e < s.E; ++e) {
    if (e % s.L == 0) first = before;
    if (e == s.me * s.L) mine = before;
    const std::int32_t c = expert_slots(s, counts, e);
    overflow += plan_expert(s, counts, e, c, before, first, o);
    if (e / s.L == s.me && padded_rows(c, s.A) > fullest) fullest = padded_rows(c, s.A);
    before.rows += segment_size(s, c);
    before.slots += kept_slots(s, c);
    if (e == (s.me + 1) * s.L - 1) mine_end = before;
  }
  plan_rank_end(s, mine_end.rows - mine.rows, mine_end.slots - mine.slots, overflow, fullest, o);
}

// The ranks per node of a Dispatcher (DispatchOptions::ranks_per_node `option`, checked by the caller to be -1 or a
// divisor of R), with lsa = Communicator::lsa_ranks(): -1 takes the NVLink domain when it is a block smaller than
// all ranks; 0 (flat) otherwise, and for an option of 0 or R.
inline int node_ranks(int option, int lsa, int R) {
  const int g = option == -1 ? lsa : option;
  return g > 0 && g < R && R % g == 0 ? g : 0;
}

// ---- the data kernels' work lists -------------------------------------------------------------------------------

// Warp w of the nw warps of one role across a grid of `blocks` blocks. The index runs across the blocks first
// (w = warp of the role in its block * blocks + block), so that consecutive chunks land on different SMs: a small op
// spreads over the whole GPU instead of its first blocks.
struct RoleWarps {
  int w, nw, blocks;
  MOERAIL_HD int block() const { return w % blocks; }
};

// (source rank, chunk) pairs of the remote sources, for the warps of one role. Chunk c of a source is produced by
// warp c mod nw there (block c mod blocks); its pairs for the R - 1 sources go to the warps of the same block,
// source j to warp (its producer's warp-in-block + j) mod warps-per-block. So every wait on a peer pairs a block
// with the block of the same index on that peer, and the sources of one chunk spread over the block's warps. A
// block that cannot be resident (SMs held by a collective of another stream, which waits on the other ranks) then
// holds up only its partners; the other blocks finish and free their SMs (docs/dispatch.md, Blocks). Plain code:
// the data kernels run it, tests/dispatch/ep_plan_test.cpp checks it on the CPU.
struct RemoteWork {
  int R, me, chunks;  // chunks = max over remote sources
  // The n-th pair of warp m (n = 0, 1, ...): round n / (R - 1) of nw chunks, source j = n % (R - 1); false past the
  // last round. c may be beyond a source's chunks (or all of them): the caller skips those.
  MOERAIL_HD bool pick(const RoleWarps& m, int n, int& s, int& c) const {
    if (R < 2) return false;
    const int round = n / (R - 1), j = n % (R - 1);
    if (round * m.nw >= chunks) return false;
    const int per_block = m.nw / m.blocks, in_block = m.w / m.blocks;
    const int producer_in_block = ((in_block - j) % per_block + per_block) % per_block;
    c = round * m.nw + producer_in_block * m.blocks + m.block();
    s = j + (j >= me ? 1 : 0);
    return true;
  }
};

}  // namespace moerail::ep
