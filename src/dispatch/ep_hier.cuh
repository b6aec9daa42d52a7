// src/dispatch/ep_hier.cuh — the hierarchical host-API transfer (DispatchOptions::ranks_per_node, docs/multinode.md).
// Ranks are grouped into nodes of G consecutive ranks. The rows a source staged for the ranks of a remote node (the
// flat pack's segments, compact: ep_common.cuh) cross the network once per token, as one "union" row to the rank of
// that node with the source's local index (its forwarder); the forwarder copies each union row to the places the
// source gave it at the ranks of its node, and those rows move over the node's links. Inside the source's node the
// segments move as on the flat path. Every receive segment ends as the flat transfer leaves it, so the unpack after
// it is the flat one. The sums (combine, dispatch backward) go the reverse way with one partial per (token, remote
// node): below, "the sums".
//
// The node plan (a dispatch's, in its handle): for each remote node n, the tokens this rank staged for any rank of
// n, in token order (union row j: node_tok), and each one's place at every rank of n (node_fan, -1 where it is not
// staged there). A union row count is at most min(T_max, G * peer_rows): nothing is dropped at this level.
#pragma once

#include <cub/block/block_scan.cuh>

#include "dispatch/ep_common.cuh"
#include "dispatch/ep_plan_kernel.cuh"  // kStageThreads, kStageItems

namespace moerail::ep {

struct HierPlan {
  int me, G, N, K, L, t_max, node_rows;
  const std::int32_t* topk_idx;     // [T_max, K]
  const std::int32_t* num_tokens;   // [1]
  const std::int32_t* stage_pos;    // [T_max, K] (stage_plan_kernel)
  std::int32_t* node_tok;           // [N][node_rows]
  std::int32_t* node_fan;           // [N][node_rows][G]
  std::int32_t* node_staged;        // [N] union rows per node (0 for the own node)
};

// Block n: node n's union rows (block-wide scans over tiles of tokens, as stage_plan_kernel). Writes every fan
// entry of the node (-1 past the count): the whole table is sent.
__global__ void __launch_bounds__(kStageThreads) node_plan_kernel(HierPlan h) {
  const int n = int(blockIdx.x), tid = int(threadIdx.x);
  std::int32_t* tok = h.node_tok + std::size_t(n) * h.node_rows;
  std::int32_t* fan = h.node_fan + std::size_t(n) * h.node_rows * h.G;
  if (n == h.me / h.G) {
    if (tid == 0) h.node_staged[n] = 0;
    return;
  }
  const int T = cuda::load_token_count(h.num_tokens, h.t_max);
  const auto in_node = [&](std::size_t i) { return h.stage_pos[i] >= 0 && h.topk_idx[i] / h.L / h.G == n; };
  using Scan = cub::BlockScan<int, kStageThreads>;
  __shared__ typename Scan::TempStorage scan;
  int carry = 0;
  for (int t0 = 0; t0 < T; t0 += kStageThreads * kStageItems) {
    bool has[kStageItems];
    int cnt = 0;
#pragma unroll
    for (int q = 0; q < kStageItems; ++q) {
      const int t = t0 + tid * kStageItems + q;
      has[q] = false;
      for (int k = 0; t < T && k < h.K; ++k) has[q] |= in_node(std::size_t(t) * h.K + k);
      cnt += has[q];
    }
    int before, tile;
    Scan(scan).ExclusiveSum(cnt, before, tile);
    int j = carry + before;
#pragma unroll
    for (int q = 0; q < kStageItems; ++q) {
      if (!has[q]) continue;
      const int t = t0 + tid * kStageItems + q;
      if (j < h.node_rows) {
        tok[j] = t;
        for (int g = 0; g < h.G; ++g) fan[std::size_t(j) * h.G + g] = -1;
        for (int k = 0; k < h.K; ++k) {
          const std::size_t i = std::size_t(t) * h.K + k;
          if (in_node(i)) fan[std::size_t(j) * h.G + (h.topk_idx[i] / h.L) % h.G] = h.stage_pos[i];
        }
      }
      ++j;
    }
    carry += tile;
    __syncthreads();
  }
  const int count = min(carry, h.node_rows);
  for (std::size_t e = std::size_t(count) * h.G + tid; e < std::size_t(h.node_rows) * h.G; e += kStageThreads)
    fan[e] = -1;
  if (tid == 0) h.node_staged[n] = count;
}

// The data movers of one transfer of rows of `row_bytes` (a multiple of 16) in region `off`.
struct HierMove {
  int me, G, N, K, t_max, node_rows, peer_rows;
  const std::int32_t* dest_rank;    // [T_max, K] the dispatch's: a slot's rank, -1 where it was dropped
  std::size_t off, row_bytes;
  const std::int32_t* node_tok;     // source: the node plan
  const std::int32_t* node_fan;     //   "
  const std::int32_t* node_staged;  //   "
  const std::int32_t* fan_recv;     // forwarder: the plans the rail sources sent, [N][node_rows][G]
  const char* send_area;            // the flat pack's segments, [R][t_max] rows of region off
  char* recv_area;                  // the flat unpack's input, likewise
  char* union_send;                 // [N][node_rows] rows: this rank's union rows for each remote node
  const char* union_recv;           // [N][node_rows] rows: from the rail source of each remote node
  char* fwd_send;                   // [G][N][peer_rows] rows: for node rank g, from the rail source of node n
};

__device__ __forceinline__ void copy_row(char* dst, const char* src, std::size_t bytes) {
  const long long nv = (long long)(bytes / 16);
  for (long long v = threadIdx.x % 32; v < nv; v += 32) st16(dst, v, ld16(src, v));
}

// Source: union row j of node n is the row staged for the rank of its first slot kept in n (the same bytes for
// every such rank). The pack stores a token's row only for the ranks that keep one of its slots: a rank whose slots
// of the token were all dropped for capacity has a staging place with nothing in it (its slot rows there say -1),
// and a token with no slot kept in n has nothing to send there (its forwarded rows are not read).
__global__ void union_rows_kernel(HierMove m) {
  const int warps = int(gridDim.x * blockDim.x / 32), w = int((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const std::size_t slice = std::size_t(m.t_max) * m.row_bytes;
  for (long long x = w; x < (long long)m.N * m.node_rows; x += warps) {
    const int n = int(x / m.node_rows), j = int(x % m.node_rows);
    if (n == m.me / m.G || j >= m.node_staged[n]) continue;
    const std::int32_t* f = m.node_fan + std::size_t(x) * m.G;
    const std::int32_t* ranks = m.dest_rank + std::size_t(m.node_tok[x]) * m.K;
    int r = -1;
    for (int k = 0; k < m.K && r < 0; ++k)
      if (ranks[k] >= 0 && ranks[k] / m.G == n) r = ranks[k];
    if (r < 0) continue;
    const int g = r % m.G;
    if (f[g] < 0) continue;  // (a kept slot's token is staged at its rank)
    copy_row(m.union_send + std::size_t(x) * m.row_bytes,
             m.send_area + m.off + std::size_t(r) * slice + std::size_t(f[g]) * m.row_bytes, m.row_bytes);
  }
}

// Forwarder: union row j from the rail source s of node n goes to its place at each rank of this node: its own
// receive segment of s, or the segment of s for node rank g in fwd_send.
__global__ void forward_rows_kernel(HierMove m) {
  const int warps = int(gridDim.x * blockDim.x / 32), w = int((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const int lane = int(threadIdx.x % 32), mine = m.me % m.G;
  const std::size_t slice = std::size_t(m.t_max) * m.row_bytes;
  const long long nv = (long long)(m.row_bytes / 16);
  for (long long x = w; x < (long long)m.N * m.node_rows; x += warps) {
    const int n = int(x / m.node_rows);
    if (n == m.me / m.G) continue;
    const int s = n * m.G + mine;
    const std::int32_t* f = m.fan_recv + std::size_t(x) * m.G;
    const char* src = m.union_recv + std::size_t(x) * m.row_bytes;
    for (int g = 0; g < m.G; ++g) {
      const int i = f[g];
      if (i < 0 || i >= m.peer_rows) continue;
      char* dst = g == mine ? m.recv_area + m.off + std::size_t(s) * slice + std::size_t(i) * m.row_bytes
                            : m.fwd_send + ((std::size_t(g) * m.N + n) * m.peer_rows + i) * m.row_bytes;
      for (long long v = lane; v < nv; v += 32) st16(dst, v, ld16(src, v));
    }
  }
}

// ---- the sums (combine, dispatch backward) in reverse -----------------------------------------------------------
// Each rank sums its slots of every token a remote source staged for it (k order, fp32, weighted by the slot's
// prob in a combine under InCombine) into an fp32 partial for that source's forwarder in this node; the forwarder
// adds its node's partials in rank order, rounds once and returns one row per (token, node) to the source over the
// network; there each node's partial lands at the place of the token's first kept rank of that node and zeros at
// the others', so the flat unpack's sum in rank order adds the node's partial once. The sources of this rank's own
// node take the flat path (their partials are the flat pack's).
struct HierSum {
  int me, G, N, K, t_max, node_rows, peer_rows;
  long long nvec;                   // 16-byte vectors of a row of Elem
  bool weighted;                    // combine under InCombine: slot probs weight the rows
  const char* rows;                 // [capacity, H] y (combine) or d_recv (dispatch backward)
  const std::int32_t* slot_rows;    // [R][T_max][K] rows here of source s's slots, by its place (the handle's)
  const float* slot_probs;          // [R][T_max][K]
  const std::int32_t* staged;       // [R] places source s staged for this rank
  const std::int32_t* fwd_fan;      // [N][node_rows][G] forwarder: the node plans of its rail sources
  float* part_send;                 // [G][N][peer_rows][H]
  float* part_recv;                 // [G][N][peer_rows][H]
  char* union_send;                 // [N][node_rows] rows: node partials for the rail source of each node
};

// Every rank: the fp32 partial of each place a remote source staged for it, into the forwarder's slot (its own
// part_recv when it is that forwarder).
template <typename Elem>
__global__ void node_partials_kernel(HierSum m) {
  constexpr int kN = VecMath<Elem>::kN;
  const int warps = int(gridDim.x * blockDim.x / 32), w = int((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const int lane = int(threadIdx.x % 32), my_node = m.me / m.G, R = m.N * m.G;
  const std::size_t H = std::size_t(m.nvec) * kN, row_bytes = std::size_t(m.nvec) * 16;
  for (long long x = w; x < (long long)R * m.peer_rows; x += warps) {
    const int s = int(x / m.peer_rows), i = int(x % m.peer_rows);
    if (s / m.G == my_node || i >= min(max(m.staged[s], 0), m.peer_rows)) continue;
    const std::size_t slot = (std::size_t(s) * m.t_max + i) * m.K + lane;
    const int row = lane < m.K ? m.slot_rows[slot] : -1;
    const float wt = m.weighted && row >= 0 ? m.slot_probs[slot] : 1.f;
    const int g = s % m.G, n = s / m.G;
    float* dst = (g == m.me % m.G ? m.part_recv + ((std::size_t(m.me % m.G) * m.N + n) * m.peer_rows + i) * H
                                  : m.part_send + ((std::size_t(g) * m.N + n) * m.peer_rows + i) * H);
    for (long long v0 = 0; v0 < m.nvec; v0 += 32) {  // every lane in the loop: the slots are shuffled from theirs
      const long long v = v0 + lane;
      float acc[kN] = {};
      for (int k = 0; k < m.K; ++k) {
        const int r = __shfl_sync(cuda::kFullMask, row, k);
        const float wk = __shfl_sync(cuda::kFullMask, wt, k);
        if (r < 0 || v >= m.nvec) continue;
        float f[kN];
        VecMath<Elem>::unpack(ld16(m.rows + std::size_t(r) * row_bytes, v), f);
#pragma unroll
        for (int e = 0; e < kN; ++e) acc[e] += wk * f[e];
      }
      if (v >= m.nvec) continue;
      float4* d = reinterpret_cast<float4*>(dst + std::size_t(v) * kN);
#pragma unroll
      for (int e = 0; e < kN; e += 4) d[e / 4] = make_float4(acc[e], acc[e + 1], acc[e + 2], acc[e + 3]);
    }
  }
}

// Forwarder: each union row of its rail sources, the node's partials in rank order, rounded once.
template <typename Elem>
__global__ void node_sum_kernel(HierSum m) {
  constexpr int kN = VecMath<Elem>::kN;
  const int warps = int(gridDim.x * blockDim.x / 32), w = int((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const int lane = int(threadIdx.x % 32), my_node = m.me / m.G;
  const std::size_t H = std::size_t(m.nvec) * kN, row_bytes = std::size_t(m.nvec) * 16;
  for (long long x = w; x < (long long)m.N * m.node_rows; x += warps) {
    const int n = int(x / m.node_rows);
    if (n == my_node) continue;
    const std::int32_t* f = m.fwd_fan + std::size_t(x) * m.G;
    bool any = false;
    for (int g = 0; g < m.G; ++g) any |= f[g] >= 0 && f[g] < m.peer_rows;
    if (!any) continue;
    char* out = m.union_send + std::size_t(x) * row_bytes;
    for (long long v = lane; v < m.nvec; v += 32) {
      float acc[kN] = {};
      for (int g = 0; g < m.G; ++g) {
        const int i = f[g];
        if (i < 0 || i >= m.peer_rows) continue;
        const float4* src = reinterpret_cast<const float4*>(
            m.part_recv + ((std::size_t(g) * m.N + n) * m.peer_rows + i) * H + std::size_t(v) * kN);
#pragma unroll
        for (int e = 0; e < kN; e += 4) {
          const float4 q = src[e / 4];
          acc[e] += q.x;
          acc[e + 1] += q.y;
          acc[e + 2] += q.z;
          acc[e + 3] += q.w;
        }
      }
      st16(out, v, VecMath<Elem>::pack(acc));
    }
  }
}

// Source: node n's partial of its union row j to the place of the token's first kept rank in n (the first slot in
// k order kept on a rank of n), zeros to the places of its other kept ranks there.
__global__ void unfold_kernel(HierMove m) {
  const int warps = int(gridDim.x * blockDim.x / 32), w = int((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const int lane = int(threadIdx.x % 32);
  const std::size_t slice = std::size_t(m.t_max) * m.row_bytes;
  const long long nv = (long long)(m.row_bytes / 16);
  for (long long x = w; x < (long long)m.N * m.node_rows; x += warps) {
    const int n = int(x / m.node_rows), j = int(x % m.node_rows);
    if (n == m.me / m.G || j >= m.node_staged[n]) continue;
    const std::int32_t* f = m.node_fan + std::size_t(x) * m.G;
    const std::int32_t* ranks = m.dest_rank + std::size_t(m.node_tok[x]) * m.K;
    int first = -1;
    unsigned kept = 0;
    for (int k = 0; k < m.K; ++k) {
      const int r = ranks[k];
      if (r < 0 || r / m.G != n || f[r % m.G] < 0) continue;
      if (first < 0) first = r % m.G;
      kept |= 1u << (r % m.G);
    }
    const char* src = m.union_recv + std::size_t(x) * m.row_bytes;
    for (; kept; kept &= kept - 1) {
      const int g = __ffs(kept) - 1;
      char* dst = m.recv_area + m.off + std::size_t(n * m.G + g) * slice + std::size_t(f[g]) * m.row_bytes;
      for (long long v = lane; v < nv; v += 32) st16(dst, v, g == first ? ld16(src, v) : make_uint4(0, 0, 0, 0));
    }
  }
}

}  // namespace moerail::ep
