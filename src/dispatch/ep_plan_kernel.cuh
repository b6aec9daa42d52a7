// src/dispatch/ep_plan_kernel.cuh — the planner kernel of a dispatch: the count exchange (NvLink: stored into
// every peer's window; HostApi: packed here, then all-gathered by NCCL) and this rank's layout, ep_plan.h's
// arithmetic over tiles of experts by block-wide scans.
#pragma once

#include <cub/block/block_scan.cuh>

#include "dispatch/ep_common.cuh"
#include "dispatch/ep_trace.cuh"

namespace moerail::ep {

struct PlanParams {
  Params p;                             // R, me, E, L, capacity, reg, local, dst, epochs, status, timeout_ns
  int A;
  bool exchange;                        // NvLink: store counts into every peer and wait for theirs
  const std::int32_t* local_tpe;        // [E] this rank's slots per expert (local planner)
  const std::int32_t* num_tokens;       // [1]
  DeviceStatus* scratch;                // the local planner's status word, merged here and reset
  PlanOut out;
};

constexpr int kPlanThreads = 256;

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanParams pp) {
  cuda::wait_for_previous();  // launched after the local planner's last kernel (launch_after_previous)
  const Params& p = pp.p;
  const int tid = int(threadIdx.x);
  auto* counts = region<std::int32_t>(p.local, p.reg.xcount);
  const int T = cuda::load_token_count(pp.num_tokens, p.t_max);
  unsigned long long* const stamps = plan_stamps(p.trace, p.blocks);
  if (stamps && tid == 0) stamps[0] = global_ns();
  if (pp.exchange) {
    __shared__ std::uint32_t epoch;
    if (tid == 0) epoch = ++p.epochs[p.blocks];
    for (int e = tid; e <= p.E; e += kPlanThreads) {
      const std::int32_t v = e < p.E ? pp.local_tpe[e] : T;
      for (int r = 0; r < p.R; ++r) region<std::int32_t>(p.dst[r], p.reg.xcount)[p.me * p.xrow + e] = v;
    }
    __threadfence_system();
    __syncthreads();
    const unsigned long long deadline = global_ns() + p.timeout_ns;
    if (tid < p.R && tid != p.me) store_release_sys(region<std::uint32_t>(p.dst[tid], p.reg.sig_count) + p.me, epoch);
    if (tid < p.R && tid != p.me) wait_flag(p, region<std::uint32_t>(p.local, p.reg.sig_count) + tid, epoch, deadline, tid);
    __threadfence_system();
    __syncthreads();
  } else {
    // HostApi: this rank's row was packed by pack_counts_kernel and all-gathered in place by NCCL.
  }
  if (stamps && tid == 0) stamps[1] = global_ns();
  const PlanShape shape{p.R, p.E, p.L, pp.A, p.me, p.capacity, p.plan.expert_cap, p.xrow};
  PlanOut o = pp.out;
  for (int r = tid; r < p.R; r += kPlanThreads) plan_tokens(shape, counts, o, r);
  // ep_plan.h's phases over tiles of kPlanThreads experts: the two prefix sums of every expert by block-wide scans,
  // carried from tile to tile; the prefix at each rank's first expert kept for the experts of that rank after it.
  using Scan = cub::BlockScan<long long, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ ExpertPrefix carry, rank_first[kMaxRanks];
  __shared__ unsigned long long dropped;  // integer sum: the same whatever the order
  __shared__ unsigned fullest;            // padded rows of this rank's fullest expert
  if (tid == 0) {
    carry = ExpertPrefix{0, 0};
    dropped = 0;
    fullest = 0;
  }
  __syncthreads();
  for (int e0 = 0; e0 < p.E; e0 += kPlanThreads) {
    const int e = e0 + tid;
    const std::int32_t c = e < p.E ? expert_slots(shape, counts, e) : 0;
    long long rows, slots, tile_rows, tile_slots;
    Scan(scan).ExclusiveSum(e < p.E ? (long long)segment_size(shape, c) : 0ll, rows, tile_rows);
    __syncthreads();
    Scan(scan).ExclusiveSum((long long)kept_slots(shape, c), slots, tile_slots);
    const ExpertPrefix before{carry.rows + rows, carry.slots + slots};
    if (e < p.E && e % p.L == 0) rank_first[e / p.L] = before;
    __syncthreads();  // this tile's rank heads written; every thread has read carry
    if (e < p.E) {
      const std::int64_t d = plan_expert(shape, counts, e, c, before, rank_first[e / p.L], o);
      if (d) atomicAdd(&dropped, (unsigned long long)d);
      if (e / p.L == p.me) atomicMax(&fullest, unsigned(padded_rows(c, pp.A)));
    }
    if (tid == 0) {
      carry.rows += tile_rows;
      carry.slots += tile_slots;
    }
    __syncthreads();
  }
  if (stamps && tid == 0) stamps[3] = global_ns();
  if (tid == 0) {
    const ExpertPrefix end = p.me + 1 < p.R ? rank_first[p.me + 1] : carry;
    plan_rank_end(shape, end.rows - rank_first[p.me].rows, end.slots - rank_first[p.me].slots,
                  std::int64_t(dropped), std::int64_t(fullest), o);
  }
  if (tid == 0) {
    DeviceStatus* s = p.status;
    DeviceStatus* l = pp.scratch;
    atomicMax(&s->rows_needed, std::uint32_t(o.rows_needed));
    s->rows_available = std::uint32_t(p.plan.expert_cap > 0 ? p.plan.expert_cap : p.capacity);
    if (o.overflow) atomicAdd(&s->overflow_rows, std::uint32_t(o.overflow));
    if (l->bad_expert_ids) {
      atomicAdd(&s->bad_expert_ids, l->bad_expert_ids);
      atomicMin(reinterpret_cast<unsigned long long*>(&s->first_bad_expert), l->first_bad_expert);
    }
    if (l->bad_probs) {
      atomicAdd(&s->bad_probs, l->bad_probs);
      atomicMin(reinterpret_cast<unsigned long long*>(&s->first_bad_prob), l->first_bad_prob);
    }
    s->num_experts = std::uint32_t(p.E);
    s->topk = std::uint32_t(p.K);
    l->overflow_rows = l->rows_needed = l->bad_expert_ids = l->bad_probs = 0;
    l->first_bad_expert = l->first_bad_prob = ~0ull;
    if (stamps) stamps[2] = global_ns();
  }
}

// HostApi, one rank: its counts and T into its row of the xcount region.
__global__ void pack_counts_kernel(Params p, const std::int32_t* local_tpe, const std::int32_t* num_tokens) {
  auto* counts = region<std::int32_t>(p.local, p.reg.xcount) + p.me * p.xrow;
  for (int e = int(threadIdx.x); e <= p.E; e += int(blockDim.x))
    counts[e] = e < p.E ? local_tpe[e] : cuda::load_token_count(num_tokens, p.t_max);
}

// HostApi with peers (compact staging, ep_common.cuh): where this rank's tokens are staged, and its row of the count
// exchange (all-gathered in place next). Block d (one per rank, d != me) walks the tokens in order: a token goes to
// d when one of its routed slots does, and its place there is the number of earlier such tokens (block-wide scans
// over tiles of tokens). Places at or past peer_rows are not staged: the token's slots at d are dropped here (local
// row -1, so the scatter skips them; counted in the status word) and leave their experts' counts. They are the last
// slots of each of those experts in token order, so the kept slots keep the places the local planner gave them.
// Writes stage_pos of every slot below T (block me: -1 for the local and the unrouted ones), and the row: E slot
// counts, T, then the places staged for every rank.
constexpr int kStageThreads = 256;
constexpr int kStageItems = 4;  // tokens per thread and tile

__global__ void __launch_bounds__(kStageThreads) stage_plan_kernel(Params p, const std::int32_t* local_tpe,
                                                                  const std::int32_t* num_tokens,
                                                                  std::int32_t* local_row) {
  extern __shared__ std::int32_t dropped_at[];  // [L]: slots of each expert of rank d dropped
  const int d = int(blockIdx.x), tid = int(threadIdx.x);
  const int T = cuda::load_token_count(num_tokens, p.t_max);
  const std::int32_t* topk = p.tok.topk_idx;
  std::int32_t* row = region<std::int32_t>(p.local, p.reg.xcount) + p.me * p.xrow;
  if (d == p.me) {
    for (int l = tid; l < p.L; l += kStageThreads) row[d * p.L + l] = local_tpe[d * p.L + l];
    if (tid == 0) {
      row[p.E] = T;
      row[p.E + 1 + d] = 0;
    }
    // a slot another block drops turns -1 here too: both write -1
    for (int i = tid; i < T * p.K; i += kStageThreads)
      if (local_row[i] < 0 || topk[i] / p.L == p.me) p.plan.stage_pos[i] = -1;
    return;
  }
  __shared__ std::uint32_t dropped;
  for (int l = tid; l < p.L; l += kStageThreads) dropped_at[l] = 0;
  if (tid == 0) dropped = 0;
  __syncthreads();
  using Scan = cub::BlockScan<int, kStageThreads>;
  __shared__ typename Scan::TempStorage scan;
  // (the rank first: other blocks may be dropping slots of their ranks meanwhile)
  const auto goes_to_d = [&](std::size_t i) { return topk[i] / p.L == d && local_row[i] >= 0; };
  int carry = 0;  // places given so far (the same on every thread)
  for (int t0 = 0; t0 < T; t0 += kStageThreads * kStageItems) {
    bool has[kStageItems];
    int n = 0;
#pragma unroll
    for (int j = 0; j < kStageItems; ++j) {
      const int t = t0 + tid * kStageItems + j;
      has[j] = false;
      for (int k = 0; t < T && k < p.K; ++k) has[j] |= goes_to_d(std::size_t(t) * p.K + k);
      n += has[j];
    }
    int before, tile;
    Scan(scan).ExclusiveSum(n, before, tile);
    int place = carry + before;
#pragma unroll
    for (int j = 0; j < kStageItems; ++j) {
      if (!has[j]) continue;
      const int t = t0 + tid * kStageItems + j;
      const bool kept = place < p.plan.peer_rows;
      for (int k = 0; k < p.K; ++k) {
        const std::size_t i = std::size_t(t) * p.K + k;
        if (!goes_to_d(i)) continue;
        p.plan.stage_pos[i] = kept ? place : -1;
        if (!kept) {
          atomicAdd(&dropped_at[topk[i] - d * p.L], 1);
          atomicAdd(&dropped, 1u);
          local_row[i] = -1;
        }
      }
      ++place;
    }
    carry += tile;
    __syncthreads();  // the scan's storage is used again
  }
  for (int l = tid; l < p.L; l += kStageThreads) row[d * p.L + l] = local_tpe[d * p.L + l] - dropped_at[l];
  if (tid == 0) {
    row[p.E + 1 + d] = min(carry, p.plan.peer_rows);
    if (dropped) atomicAdd(&p.status->peer_dropped, dropped);
    p.status->peer_rows = std::uint32_t(p.plan.peer_rows);
  }
}

}  // namespace moerail::ep
