// src/dispatch/ep_common.cuh — what every expert-parallel kernel shares: the launch constants, the staging area's
// regions, the kernel parameters, flags and the per-block handshake, the work lists of producers and consumers, and
// the pad rows. The kernels: ep_plan_kernel.cuh (the planner), ep_scatter.cuh (dispatch, combine backward),
// ep_gather.cuh (combine, dispatch backward); their host side is dispatcher.cu.
//
// Roles: each data kernel is one launch of `blocks` blocks of kWarps warps, persistent over the work; producer
// warps work on one side of the exchange, consumer warps on the other. NvLink: producers store through the peers'
// window addresses, both roles run in one launch (each block starts with a handshake with the same block of every
// peer, so that no peer is still reading a staging area from an earlier op). HostApi: the same code with Pack
// (producers store into a local send buffer) and Unpack (consumers read what ncclRecv delivered, no flags) launches
// around grouped ncclSend/ncclRecv.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/device_utils.cuh"
#include "core/status_device.cuh"
#include "dispatch/ep_plan.h"

namespace moerail::ep {

constexpr int kWarps = 16;          // 8 producer + 8 consumer warps per block when both roles run
constexpr int kChunk = 1;           // tokens per flag (2 measured slower at 4096 tokens: docs/dispatch.md)
constexpr int kScalesPerLane = 4;   // FP8 dispatch consumers: scale words per lane (f32 or 4 E8M0), H <= 16384 at once
constexpr int kUnrollWide = 8;      // 16-byte vectors per lane in flight: scatter and FP8 producers (as 4 pairs)
constexpr int kUnrollFp8Rows = 16;  // the same for the FP8 dispatch's consumers: a staged e4m3 row of H <= 8192 in
                                    // one batch (16 for bf16 rows measured slower on 2 GPUs)
constexpr int kMaxRanks = 32;       // rank masks are 32-bit
constexpr int kMaxLocalParts = 4;   // column ranges of a token's row on idle warps when tokens are fewer (LocalParts)
constexpr int kMaxTopk = 32;        // one lane per slot

enum Role : int { kProduce = 1, kConsume = 2, kFlags = 4, kCollect = 8 };

// Byte offsets of the regions of one rank's staging area (the symmetric window on NvLink; identical layout in the
// send and receive buffers of HostApi).
struct Regions {
  std::size_t xcount = 0;     // i32 [R][xrow]: exchanged counts (ep_plan.h; HostApi: then the rows staged per rank)
  std::size_t sig_count = 0;  // u32 [R]
  std::size_t sig_entry = 0;  // u32 [blocks][R]
  std::size_t sig_data = 0;   // u32 [R][chunks]
  std::size_t sig_ret = 0;    // u32 [R][chunks]
  std::size_t meta = 0;       // i32 [R][T_max][K]: rows here of source s's slots (-1 none), as a dispatch sends them
  std::size_t probs = 0;      // f32 [R][T_max][K]: probs of source s's slots with rows here, likewise
  std::size_t ret = 0;        // f32 [R][T_max][K]: values sent back to the owner
  std::size_t stage = 0;      // act [R][T_max][H]
  std::size_t bytes = 0;
};

// The dispatch's plan (a DispatchHandle's memory, but base and limit): what its combine and both backward passes
// read of it. A dispatch writes it: tokens .. pad_prefix by the planner, dest_rank / dest_row by the producers,
// slot_rows / slot_probs by the producers ([me]) and the consumers (the other sources, copied from the staging
// area's meta and probs as each chunk lands).
struct PlanView {
  const std::int32_t* tokens;      // [R]
  std::int32_t* dest_rank;         // [T_max, K]
  std::int32_t* dest_row;          // [T_max, K]
  std::int32_t* slot_rows;         // [R][T_max][K]: rows here of source s's slots (-1 none); [me] unused
  float* slot_probs;               // [R][T_max][K]: their probs; [me]: this rank's own slots' probs
  int expert_cap;                  // rows of an expert's segment at most (Capacity::PerExpert); 0 = no bound
  // Compact staging (HostApi with peers): a source stages for rank r only its tokens routed there, at most
  // peer_rows, in token order: the staging rows, meta, probs and ret of source s here are indexed by that place
  // (the expert side's loops run over staged[s] places instead of T_s tokens), and the owner finds its token's place
  // at a slot's rank in stage_pos. Otherwise (NvLink) every index is the token's.
  bool compact;
  int peer_rows;
  const std::int32_t* staged;      // [R] places source s staged for this rank
  std::int32_t* stage_pos;         // [T_max, K]: place of the slot's token among this rank's rows staged for the
                                   //   slot's rank; -1 when the slot is local, unrouted or dropped past peer_rows
  int node_ranks;                  // hierarchical combine / dispatch backward (ep_hier.cuh): the gather's producers
                                   //   sum rows only for the sources of this rank's node (the others' partials go
                                   //   through the forwarders); 0 = every source
};

// The token side (the owner of the tokens): its routing and its [T_max, H] rows.
struct TokenSide {
  const std::int32_t* num_tokens;  // [1]
  const std::int32_t* topk_idx;    // [T_max, K] (dispatch)
  const std::int32_t* local_row;   // [T_max, K] local planner rows (A = 1): place among own slots of the expert
  const std::int32_t* local_off;   // [E + 1] local planner segment offsets
  const std::int32_t* base;        // [E] (dispatch)
  const std::int32_t* limit;       // [E] (dispatch): rows at or past limit[e] on e's rank are dropped
  const float* probs;              // [T_max, K] (dispatch)
  const void* src;                 // [T_max, H]: x (dispatch), d_out (combine backward)
  void* dst;                       // [T_max, H]: out (combine), dx (dispatch backward)
  float* d_probs;                  // [T_max, K] or null
};

// The expert side: the [capacity, H] rows of this rank's experts.
struct ExpertSide {
  const void* src;                 // [capacity, H]: y (combine), d_recv (dispatch backward)
  void* dst;                       // [capacity, H]: recv (dispatch), d_y (combine backward)
  const void* y;                   // [capacity, H]: combine backward dots (InCombine)
  float* recv_probs;               // [capacity] (dispatch)
  const float* d_recv_probs;       // [capacity] (dispatch backward) or null
  const std::int32_t* seg_offset;  // [L + 1] local experts (pad zeroing)
  const std::int32_t* tpe;         // [L]
  const std::int32_t* pad_prefix;  // [L + 1]
};

// FP8 dispatch (scatter_kernel<bf16, true, S>): tok.src rows are bf16 (src_nvec vectors), quantized at the source
// with recipe S; a staged row is [nvec * 16 e4m3 bytes | scale_cols 32-bit words], wire_bytes apart (a multiple of
// 16); rows.dst rows are the e4m3 bytes (nvec vectors) and recv_scales [capacity, scale_cols] words: H / 128 f32
// scales (Block1x128) or H / 32 E8M0 bytes (Mx1x32, four per word); PerTensor: no scales (scale_cols 0, recv_scales
// null), every row quantized with *tensor_scale. Payload::Fp8Given: tok.src rows are e4m3 already (src_nvec =
// nvec) with their scale words in tok_scales [T_max, scale_cols] (null for PerTensor), moved as bytes.
struct Fp8Payload {
  long long src_nvec;
  const std::uint32_t* tok_scales;
  int scale_cols;
  std::size_t wire_bytes;
  std::uint32_t* recv_scales;      // [capacity, scale_cols] or null (then no scales anywhere)
  std::uint32_t pad_scale_word;    // a pad row's scale words: 1.0f, or four E8M0 codes of 2^0
  const float* tensor_scale;       // PerTensor: [1]
};

// What every kernel of one op takes: the launch and the exchange, then each role's part.
struct Params {
  int R, me, E, L, K, t_max, capacity, chunks_max, blocks;
  int xrow;                        // i32 per rank in the xcount region
  long long nvec;                  // 16-byte vectors per row
  int role;                        // Role bits of this launch
  bool zero_pads;                  // this launch writes the pad rows of rows.dst (and recv_probs) with zeros
  bool in_combine;                 // combine/combine-backward weights; combine backward dot products
  unsigned long long timeout_ns;
  Regions reg;
  char* local;                     // this rank's staging area (window or receive buffer)
  char* const* dst;                // [R]: where producers store rank r's data: peer window (NvLink) or the local
                                   //      send buffer (HostApi); the region index inside is [me] resp. [r]
  bool dst_is_peer;                // NvLink: index [me] inside dst[r]; HostApi: index [r] inside dst[r] (= send)
  std::uint32_t* epochs;           // [blocks + 1], local memory
  DeviceStatus* status;
  unsigned long long* trace;       // null, or the developer trace (MOERAIL_EP_TRACE; WarpTrace below)

  PlanView plan;
  TokenSide tok;
  ExpertSide rows;
  Fp8Payload fp8;
};

// ---- small device helpers -------------------------------------------------------------------------------------

__device__ __forceinline__ void store_release_sys(std::uint32_t* p, std::uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ std::uint32_t load_relaxed_sys(const std::uint32_t* p) {
  std::uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Spins until *flag has reached epoch (wrap-around safe) or the deadline passes; records a timeout naming `peer`.
// The poll is a relaxed load with a short sleep (an acquire load per spin would invalidate L1 under the warps that
// are moving data on the same SM); one acquire fence after it orders what follows.
__device__ __forceinline__ bool wait_flag(const Params& p, const std::uint32_t* flag, std::uint32_t epoch,
                                          unsigned long long deadline, int peer) {
  unsigned spins = 0;
  while (int(load_relaxed_sys(flag) - epoch) < 0) {
    __nanosleep(64);
    if ((++spins & 1023u) == 0 && global_ns() > deadline) {
      cuda::record_timeout(p.status, peer);
      return false;
    }
  }
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  return true;
}

template <typename T>
__device__ __forceinline__ T* region(char* base, std::size_t off) {
  return reinterpret_cast<T*>(base + off);
}

// Where a producer stores data meant for rank r: region `off` of rank r's area, sub-index [me] (NvLink) — or region
// `off` of the local send buffer, sub-index [r] (HostApi), which ncclSend then moves to r's [me].
__device__ __forceinline__ char* dst_slice(const Params& p, int r, std::size_t off, std::size_t slice_bytes) {
  return p.dst[r] + off + std::size_t(p.dst_is_peer ? p.me : r) * slice_bytes;
}
__device__ __forceinline__ char* local_slice(const Params& p, int s, std::size_t off, std::size_t slice_bytes) {
  return p.local + off + std::size_t(s) * slice_bytes;
}

template <typename T>
struct VecMath {
  static constexpr int kN = 16 / int(sizeof(T));
  // v by value: from a reference into shared memory the compiler reads the elements one by one (kN 2-byte loads
  // with 4-way bank conflicts where one 16-byte load serves), which bounds a gather's rate.
  __device__ static void unpack(uint4 v, float (&f)[kN]) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < kN; ++i) f[i] = cuda::to_float<T>(e[i]);
  }
  __device__ static uint4 pack(const float (&f)[kN]) {
    uint4 v;
    T* e = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int i = 0; i < kN; ++i) e[i] = cuda::from_float<T>(f[i]);
    return v;
  }
};

__device__ __forceinline__ uint4 ld16(const void* base, long long vec) {
  return reinterpret_cast<const uint4*>(base)[vec];
}
// One 16-byte load from shared memory (volatile: it stays after the wait that says the bytes have landed).
__device__ __forceinline__ uint4 lds16(const uint4* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
  return v;
}
__device__ __forceinline__ void st16(void* base, long long vec, const uint4& v) {
  reinterpret_cast<uint4*>(base)[vec] = v;
}

// ---- work lists ------------------------------------------------------------------------------------------------

// A chunk is kChunk tokens under one flag; chunks_of: the chunks of a source with T tokens. One token per chunk
// spreads a small op over every warp (a warp moves its chunk's tokens one after another, and that chain is the
// latency of a small op) and lets the consumers start on the first token that arrives.
__device__ __forceinline__ int chunks_of(int T) { return (T + kChunk - 1) / kChunk; }

// Fewer chunks than warps: the idle warps take column ranges of a token's row (LocalParts), so that each warp's
// chain of 16-byte accesses, which bounds a small op (docs/dispatch.md), gets shorter. Warp w takes range
// w / stride of chunk w % stride; the stride is a multiple of the blocks, so a chunk's ranges stay in the block of
// its own warp (chunk c on warp c), the block that every wait on a peer pairs with (RemoteWork).
// - Scatter (dispatch only, bf16/f32 rows): the token's producer keeps range 0 of its local rows, the remote rows
//   (whole: the flag protocol is unchanged) and the slot bookkeeping; the other ranges copy only local rows. Not in
//   FP8 dispatches, nor in the combine backward's scatter, where the extra code raised the spills ptxas reports
//   from 236 to 324 bytes.
// - Gather consumers (the owner's sums): every range waits for the chunk's flags itself. Each column keeps its
//   summation order, so the bits do not change.
struct LocalParts {
  int n;       // ranges per chunk (1: one warp per chunk)
  int stride;  // warps w and w + stride take the same chunk
  int nvec;    // a row's 16-byte vectors (H * element bytes / 16: far below 2^31)
  // first vector of range j (j = n: the end); ranges start at multiples of 32 vectors (a warp's 512 bytes)
  __device__ int begin(int j) const { return j >= n ? nvec : nvec * j / n / 32 * 32; }
};

__device__ __forceinline__ LocalParts local_parts(bool split, int chunks, const RoleWarps& m, long long nvec) {
  LocalParts lp{1, m.nw, int(nvec)};
  if (split && chunks > 0 && chunks <= m.nw) {
    lp.stride = (chunks + m.blocks - 1) / m.blocks * m.blocks;
    lp.n = max(min(min((m.nw - chunks) / lp.stride + 1, kMaxLocalParts), lp.nvec / 64), 1);
  }
  return lp;
}

__device__ __forceinline__ RemoteWork remote_work(const Params& p) {
  int most = 0;
  for (int s = 0; s < p.R; ++s)
    if (s != p.me) most = max(most, chunks_of(min(max(p.plan.tokens[s], 0), p.t_max)));
  return RemoteWork{p.R, p.me, most};
}

// This warp's place among the warps of its role (producer or consumer) across the grid; returns true for a producer.
__device__ __forceinline__ bool split_roles(const Params& p, RoleWarps& mine) {
  const int warp = int(threadIdx.x) / 32;
  const bool both = (p.role & kProduce) && (p.role & kConsume);
  const int per_block = both ? kWarps / 2 : kWarps;
  const bool producer = (p.role & kProduce) && (!both || warp < per_block);
  const int lw = both && !producer ? warp - per_block : warp;
  mine = RoleWarps{lw * int(gridDim.x) + int(blockIdx.x), int(gridDim.x) * per_block, int(gridDim.x)};
  return producer;
}

// Each block's handshake with the same block of every peer (NvLink): once it passes, every peer has finished all
// its earlier kernels, so its staging area is free. Returns this op's epoch (the same in every block and rank).
__device__ inline std::uint32_t enter(const Params& p, unsigned long long deadline) {
  __shared__ std::uint32_t epoch;
  if (threadIdx.x == 0) {
    const std::uint32_t e = p.epochs[blockIdx.x] + 1;
    p.epochs[blockIdx.x] = e;
    epoch = e;
  }
  __syncthreads();
  const std::uint32_t e = epoch;
  if ((p.role & kFlags) && p.R > 1) {
    const int r = int(threadIdx.x);
    if (r < p.R && r != p.me) {
      auto* peer = region<std::uint32_t>(p.dst[r], p.reg.sig_entry) + std::size_t(blockIdx.x) * p.R + p.me;
      store_release_sys(peer, e);
    }
    if (r < p.R && r != p.me) {
      const auto* mine = region<std::uint32_t>(p.local, p.reg.sig_entry) + std::size_t(blockIdx.x) * p.R + r;
      wait_flag(p, mine, e, deadline, r);
    }
  }
  __syncthreads();
  return e;
}

// Lane-held slots to a warp-uniform rank mask.
__device__ __forceinline__ unsigned rank_mask(int rank, int K) {
  unsigned bit = (int(threadIdx.x % 32) < K && rank >= 0) ? (1u << rank) : 0u;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) bit |= __shfl_xor_sync(cuda::kFullMask, bit, o);
  return bit;
}

// Where the warp's token t goes in the staging rows of each rank: lane r (< R) gets its place at rank r. Compact
// staging: the stage_pos `sp` of a slot lane whose rank `srank` is r (every slot of t at r has the same place; -1
// on lanes of ranks t is not staged for); otherwise t. Warp-collective; read with __shfl_sync(.., places, r).
__device__ __forceinline__ int staged_places(const Params& p, int t, int srank, int sp) {
  if (!p.plan.compact) return t;
  const int lane = int(threadIdx.x % 32);
  int place = -1;
  for (unsigned m = rank_mask(srank, p.K); m; m &= m - 1) {
    const int r = __ffs(m) - 1;
    const int v = __shfl_sync(cuda::kFullMask, sp, __ffs(__ballot_sync(cuda::kFullMask, srank == r)) - 1);
    if (lane == r) place = v;
  }
  return place;
}

// The rows source s staged for this rank that the expert side walks: its places (compact) or its tokens.
__device__ __forceinline__ int staged_rows_of(const Params& p, int s) {
  return min(max(p.plan.compact ? p.plan.staged[s] : p.plan.tokens[s], 0), p.t_max);
}

// ---- pad rows -------------------------------------------------------------------------------------------------

__device__ inline void zero_pad_rows(const Params& p, void* dst, float* dst_probs, int warp, int nwarps) {
  const int L = p.L, lane = int(threadIdx.x % 32);
  const int pads = p.rows.pad_prefix[L];
  for (int i = warp; i < pads; i += nwarps) {
    int lo = 0, hi = L - 1;  // expert l with pad_prefix[l] <= i < pad_prefix[l + 1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.rows.pad_prefix[mid] <= i) lo = mid; else hi = mid - 1;
    }
    const int kept = p.plan.expert_cap > 0 ? min(p.rows.tpe[lo], p.plan.expert_cap) : p.rows.tpe[lo];
    const long long row = (long long)p.rows.seg_offset[lo] + kept + (i - p.rows.pad_prefix[lo]);
    if (row >= p.capacity) continue;
    char* r = static_cast<char*>(dst) + row * p.nvec * 16;
    for (long long v = lane; v < p.nvec; v += 32) st16(r, v, make_uint4(0, 0, 0, 0));
    if (dst_probs && lane == 0) dst_probs[row] = 0.f;
    if (p.fp8.recv_scales)  // FP8 pad rows: scale 1 (1.0f, or E8M0 code 127), as the one-GPU FP8 permute writes
      for (int j = lane; j < p.fp8.scale_cols; j += 32) p.fp8.recv_scales[row * p.fp8.scale_cols + j] = p.fp8.pad_scale_word;
  }
}

}  // namespace moerail::ep
