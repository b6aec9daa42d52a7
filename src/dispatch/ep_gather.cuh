// src/dispatch/ep_gather.cuh — the gather kernel: combine (kCombine) and dispatch backward, expert side -> owner.
//
// Producer warps (expert side) take (source rank, chunk) pairs (RemoteWork) and reduce each token's local rows to
// one fp32 partial (k order), stored rounded to the activation dtype into the owner's staging row [me][t]; flag.
// Through nodes (PlanView::node_ranks) they do so only for the sources of their own node (ep_hier.cuh sums the
// others').
// Consumer warps (owner side) take own chunks, wait for the flags of the ranks involved and sum the partials in rank
// order (the own rank's partial in fp32 from the local rows): deterministic.
#pragma once

#include "dispatch/ep_common.cuh"
#include "dispatch/ep_rows.cuh"
#include "dispatch/ep_trace.cuh"

namespace moerail::ep {

// Both roles sum a short list of rows per token (the producer: the token's local rows, k order; the consumer: the
// remote partials in rank order with the own rank's local rows summed in fp32 at its place). A warp loads a batch
// of every row it sums with cp.async into its own slice of shared memory, waits once, then adds them in list order:
// one memory round trip per batch and wave of kWave rows instead of one per row, with no registers held by the loads
// in flight (the register-file limit of 16 warps per SM caps what plain loads can keep in flight). Each lane reads
// back only the vectors it landed itself, so the landing needs no warp barrier; the list is written by the lanes
// that own its entries and read by all (__syncwarp around it). A landed vector is read back with one 16-byte shared
// load (lds16): element by element, the reads of shared memory bound the op on few SMs.

constexpr int kGatherU = 4;  // 16-byte vectors per lane and row in a batch
constexpr int kWave = 6;     // rows landed at once per warp
struct GatherItem {          // one row of a token's sum
  const char* src;
  float w;    // weight (own local rows of a combine under InCombine; 1 otherwise)
  int own;    // 1: a local row, summed into the own partial; 0: a remote partial
};
constexpr std::size_t kLandVecs = std::size_t(kWave) * kGatherU * 32;  // uint4 per warp
constexpr std::size_t kGatherSmemBytes = std::size_t(kWarps) * (kLandVecs * 16 + 32 * sizeof(GatherItem));

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// Sums one batch (vectors v0 + u * 32 + lane, u < kGatherU) of the warp's `total` listed rows in list order:
// own rows into `part` (part += w * x), which joins acc at list position own_end - 1 (the last own row); remote
// rows into acc. The caller zeroes acc and part.
template <typename Elem>
__device__ __forceinline__ void sum_listed_rows(float (&acc)[kGatherU][VecMath<Elem>::kN],
                                                float (&part)[kGatherU][VecMath<Elem>::kN], const GatherItem* items,
                                                int total, int own_end, uint4* land, long long v0, long long nvec) {
  constexpr int N = VecMath<Elem>::kN;
  const int lane = int(threadIdx.x % 32);
  for (int j0 = 0; j0 < total; j0 += kWave) {
    const int n = min(kWave, total - j0);
    for (int jj = 0; jj < n; ++jj) {
      const char* src = items[j0 + jj].src;
#pragma unroll
      for (int u = 0; u < kGatherU; ++u) {
        const long long v = v0 + u * 32 + lane;
        if (v < nvec) cp_async16(&land[(jj * kGatherU + u) * 32 + lane], src + v * 16);
      }
    }
    cp_async_wait_all();
    for (int jj = 0; jj < n; ++jj) {
      const GatherItem it = items[j0 + jj];
#pragma unroll
      for (int u = 0; u < kGatherU; ++u) {
        const long long v = v0 + u * 32 + lane;
        if (v < nvec) {
          float x[N];
          VecMath<Elem>::unpack(lds16(&land[(jj * kGatherU + u) * 32 + lane]), x);
          if (it.own) {
#pragma unroll
            for (int j = 0; j < N; ++j) part[u][j] += it.w * x[j];
          } else {
#pragma unroll
            for (int j = 0; j < N; ++j) acc[u][j] += x[j];
          }
        }
      }
      if (j0 + jj == own_end - 1) {
#pragma unroll
        for (int u = 0; u < kGatherU; ++u)
#pragma unroll
          for (int j = 0; j < N; ++j) acc[u][j] += part[u][j];
      }
    }
  }
}

// out = the sum of the warp's listed rows (sum_listed_rows) over vectors [vb, ve), batch by batch, each batch
// rounded once to Elem.
template <typename Elem>
__device__ __forceinline__ void store_listed_sum(char* out, const GatherItem* items, int total, int own_end,
                                                 uint4* land, long long vb, long long ve) {
  using VM = VecMath<Elem>;
  const int lane = int(threadIdx.x % 32);
  for (long long v0 = vb; v0 < ve; v0 += 32 * kGatherU) {
    float acc[kGatherU][VM::kN], part[kGatherU][VM::kN];
    zero_acc<Elem>(acc);
    zero_acc<Elem>(part);
    sum_listed_rows<Elem>(acc, part, items, total, own_end, land, v0, ve);
#pragma unroll
    for (int u = 0; u < kGatherU; ++u) {
      const long long v = v0 + u * 32 + lane;
      if (v < ve) st16(out, v, VM::pack(acc[u]));
    }
  }
}

template <typename Elem, bool kCombine>
__global__ void __launch_bounds__(kWarps * 32) gather_kernel(Params p) {
  extern __shared__ uint4 gather_smem[];
  const unsigned long long t_entry = global_ns(), deadline = t_entry + p.timeout_ns;
  WarpTrace tr(p.trace, t_entry);
  const std::uint32_t epoch = enter(p, deadline);
  tr.stamp(kTraceEntered);
  const int lane = int(threadIdx.x % 32);
  const int warp = int(threadIdx.x / 32);
  uint4* land = gather_smem + std::size_t(warp) * kLandVecs;
  GatherItem* items = reinterpret_cast<GatherItem*>(gather_smem + std::size_t(kWarps) * kLandVecs) + warp * 32;
  const bool slot_lane = lane < p.K;
  RoleWarps mine;
  const bool producer = split_roles(p, mine);
  const int T = cuda::load_token_count(p.tok.num_tokens, p.t_max);
  const std::size_t row_bytes = std::size_t(p.nvec) * 16;
  const std::size_t stage_slice = std::size_t(p.t_max) * row_bytes;
  const std::size_t k_slice = std::size_t(p.t_max) * p.K * sizeof(float);
  const bool flags = p.role & kFlags;
  const char* rows = static_cast<const char*>(p.rows.src);

  if (producer && (p.role & kProduce)) {
    const RemoteWork rw = remote_work(p);
    int s, c;
    for (int item = 0; rw.pick(mine, item, s, c); ++item) {
      const int Ts = staged_rows_of(p, s);
      if (c >= chunks_of(Ts)) continue;
      tr.item();
      const auto* meta = p.plan.slot_rows + std::size_t(s) * p.t_max * p.K;
      const auto* sprobs = p.plan.slot_probs + std::size_t(s) * p.t_max * p.K;
      char* stage = dst_slice(p, s, p.reg.stage, stage_slice);
      float* ret = region<float>(dst_slice(p, s, p.reg.ret, k_slice), 0);
      const bool sum_rows = p.plan.node_ranks == 0 || s / p.plan.node_ranks == p.me / p.plan.node_ranks;
      const int t_end = min(Ts, (c + 1) * kChunk);
      for (int t = c * kChunk; t < t_end; ++t) {
        const std::size_t slot = std::size_t(t) * p.K + lane;
        const int row = slot_lane ? meta[slot] : -1;
        const float w = kCombine && p.in_combine && row >= 0 ? sprobs[slot] : 1.f;
        if (!kCombine && p.rows.d_recv_probs && row >= 0) ret[slot] = p.rows.d_recv_probs[row];
        const unsigned any = __ballot_sync(cuda::kFullMask, row >= 0);
        if (!any || !sum_rows) continue;
        // the token's local rows in k order: one partial, complete before it is stored
        if (row >= 0) items[__popc(any & ((1u << lane) - 1u))] = GatherItem{rows + std::size_t(row) * row_bytes, w, 1};
        __syncwarp();
        const int total = __popc(any);
        char* d = stage + std::size_t(t) * row_bytes;
        store_listed_sum<Elem>(d, items, total, total, land, 0, p.nvec);
        __syncwarp();  // the list is rewritten for the next token
      }
      if (flags) {
        const unsigned long long f0 = tr.now();
        __threadfence_system();
        tr.add(tr.fence, f0);
        __syncwarp();
        if (lane == 0)
          store_release_sys(region<std::uint32_t>(p.dst[s], p.reg.sig_data) + std::size_t(p.me) * p.chunks_max + c,
                            epoch);
      }
    }
  }

  if (!producer && (p.role & kConsume)) {
    const float* own_probs = p.plan.slot_probs + std::size_t(p.me) * p.t_max * p.K;
    // with fewer chunks than warps, column ranges of a chunk on several warps (LocalParts)
    const int chunks = chunks_of(T);
    const LocalParts parts = local_parts(true, chunks, mine, p.nvec);
    const int range = mine.w / parts.stride;  // 0 when parts.n == 1 (stride = nw)
    const int c_step = parts.n > 1 ? chunks : mine.nw;  // ranges: one chunk per warp
    for (int c = mine.w % parts.stride; range < parts.n && c < chunks; c += c_step) {
      const unsigned long long w0 = tr.now();
      if (flags) {
        if (lane < p.R && lane != p.me)
          wait_flag(p, region<std::uint32_t>(p.local, p.reg.sig_data) + std::size_t(lane) * p.chunks_max + c, epoch,
                    deadline, lane);
        __syncwarp();
      }
      tr.item(tr.add(tr.wait, w0));
      const int t_end = min(T, (c + 1) * kChunk);
      for (int t = c * kChunk; t < t_end; ++t) {
        const std::size_t slot = std::size_t(t) * p.K + lane;
        const int rank = slot_lane ? p.plan.dest_rank[slot] : -1;
        const int row = slot_lane ? p.plan.dest_row[slot] : -1;
        const float w = kCombine && p.in_combine && rank == p.me ? own_probs[slot] : 1.f;
        // compact staging: this slot's place at its rank (remote slots), and lane r's the token's place at rank r
        const int srank = rank != p.me ? rank : -1;
        const int sp = p.plan.compact && srank >= 0 ? p.plan.stage_pos[slot] : -1;
        const int places = staged_places(p, t, srank, sp);
        if (!kCombine && p.tok.d_probs && slot_lane && range == 0) {
          float g = 0.f;
          if (rank == p.me) g = p.rows.d_recv_probs ? p.rows.d_recv_probs[row] : 0.f;
          else if (rank >= 0)
            g = region<float>(local_slice(p, rank, p.reg.ret, k_slice), 0)[p.plan.compact ? std::size_t(sp) * p.K + lane : slot];
          p.tok.d_probs[slot] = g;
        }
        // the list in summation order: remote partials of the ranks below me, the own local rows (k order), the
        // remote partials of the ranks above me
        const unsigned mask = rank_mask(rank, p.K);
        const unsigned local = __ballot_sync(cuda::kFullMask, rank == p.me);
        const unsigned remote = mask & ~(1u << p.me);
        const int below = __popc(remote & ((1u << p.me) - 1u)), own = __popc(local);
        if (rank == p.me)
          items[below + __popc(local & ((1u << lane) - 1u))] = GatherItem{rows + std::size_t(row) * row_bytes, w, 1};
        if (lane < p.R && (remote >> lane & 1u)) {
          const int before = __popc(remote & ((1u << lane) - 1u));  // remote ranks listed before this one
          items[lane < p.me ? before : own + before] =
              GatherItem{local_slice(p, lane, p.reg.stage, stage_slice) + std::size_t(places) * row_bytes, 1.f, 0};
        }
        __syncwarp();
        const int total = __popc(remote) + own, own_end = own > 0 ? below + own : -1;
        char* out = static_cast<char*>(p.tok.dst) + std::size_t(t) * row_bytes;
        store_listed_sum<Elem>(out, items, total, own_end, land, parts.begin(range), parts.begin(range + 1));
        __syncwarp();  // the list is rewritten for the next token
      }
    }
  }
  tr.finish(tr.now());
}

}  // namespace moerail::ep
