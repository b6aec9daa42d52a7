// src/dispatch/ep_plan.h — the expert-parallel layout of one rank from the exchanged counts, as plain code that runs
// on the host (tests, against ref::plan_layout) and in the planner kernel (one block, `tid`/`nthreads` loops with a
// block barrier between phases); and the data kernels' list of remote work (RemoteWork, at the end).
//
// Input: counts[s * (E + 1) + e] = routed slots of source rank s to expert e, counts[s * (E + 1) + E] = T_s.
// Row order on a destination rank: expert-major, by source rank, token, k (DESIGN.md); a source's slots to expert e
// start at base[e] = segment start of e + the slots of lower source ranks to e, and the slot's place among its own
// slots to e (token, k order) comes from the local planner. Rows at or beyond capacity are dropped.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace moerail::ep {

struct PlanShape {
  int R, E, L, A, me;
  std::int64_t capacity;
};

struct PlanOut {
  std::int32_t* total;              // [E] scratch: slots of every expert over all sources
  std::int32_t* segment_start;      // [E] scratch: segment start of every expert on its rank
  std::int32_t* base;               // [E] this rank's first row at each expert
  std::int32_t* tokens;             // [R] T of every rank
  std::int32_t* tokens_per_expert;  // [L]
  std::int32_t* padded_per_expert;  // [L]
  std::int32_t* segment_offset;     // [L + 1]
  std::int32_t* segment_rows;       // [L]
  std::int32_t* pad_prefix;         // [L + 1]
  std::int32_t* rows_used;          // [1]
  std::int64_t rows_needed = 0;     // this rank's (set by the thread with tid 0)
  std::int64_t overflow = 0;        // routed rows dropped on this rank (tid 0)
};

// c rounded up to a multiple of A. Counts are i32 and A > 0: 32-bit unsigned division (a 64-bit one is a long
// software routine on the GPU, and the planner kernel calls this serially once per expert).
MOERAIL_HD inline std::int64_t padded_rows(std::int32_t c, int A) {
  return std::int64_t((std::uint32_t(c) + std::uint32_t(A) - 1u) / std::uint32_t(A)) * A;
}

// Phase 1 (all threads): totals per expert and T per rank.
MOERAIL_HD inline void plan_totals(const PlanShape& s, const std::int32_t* counts, PlanOut& o, int tid, int nthreads) {
  for (int e = tid; e < s.E; e += nthreads) {
    std::int32_t sum = 0;
    for (int r = 0; r < s.R; ++r) sum += counts[r * (s.E + 1) + e];
    o.total[e] = sum;
  }
  for (int r = tid; r < s.R; r += nthreads) o.tokens[r] = counts[r * (s.E + 1) + s.E];
}

// Phase 2 (all threads; after phase 1): segment starts, one thread per destination rank.
MOERAIL_HD inline void plan_segments(const PlanShape& s, PlanOut& o, int tid, int nthreads) {
  for (int d = tid; d < s.R; d += nthreads) {
    std::int64_t off = 0;
    for (int l = 0; l < s.L; ++l) {
      o.segment_start[d * s.L + l] = std::int32_t(off < 0x7fffffff ? off : 0x7fffffff);
      off += padded_rows(o.total[d * s.L + l], s.A);
    }
  }
}

// Phase 3 (all threads; after phase 2): this rank's bases and its local segments; tid 0 adds the totals.
MOERAIL_HD inline void plan_rank(const PlanShape& s, const std::int32_t* counts, PlanOut& o, int tid, int nthreads) {
  for (int e = tid; e < s.E; e += nthreads) {
    std::int64_t b = o.segment_start[e];
    for (int r = 0; r < s.me; ++r) b += counts[r * (s.E + 1) + e];
    o.base[e] = std::int32_t(b < 0x7fffffff ? b : 0x7fffffff);
  }
  if (tid != 0) return;
  std::int64_t off = 0, pads = 0, overflow = 0;
  for (int l = 0; l < s.L; ++l) {
    const std::int32_t c = o.total[s.me * s.L + l];
    const std::int64_t p = padded_rows(c, s.A);
    o.tokens_per_expert[l] = std::int32_t(c);
    o.padded_per_expert[l] = std::int32_t(p);
    o.segment_offset[l] = std::int32_t(off);
    o.pad_prefix[l] = std::int32_t(pads);
    std::int64_t inside = s.capacity - off;  // rows of this segment inside the buffer
    inside = inside < 0 ? 0 : (inside > p ? p : inside);
    o.segment_rows[l] = std::int32_t(inside);
    overflow += c - (inside < c ? inside : c);
    off += p;
    pads += p - c;
  }
  o.segment_offset[s.L] = std::int32_t(off);
  o.pad_prefix[s.L] = std::int32_t(pads);
  o.rows_used[0] = std::int32_t(off < s.capacity ? off : s.capacity);
  o.rows_needed = off;
  o.overflow = overflow;
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
