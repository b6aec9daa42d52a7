// src/dispatch/ep_kernels.cuh — the kernels behind include/moerail/dispatch.h.
//
// Two data-kernel shapes, each one launch of `blocks` blocks of kWarps warps, persistent over the work:
//
//   scatter (dispatch, combine backward): owner -> expert side.
//     producer warps (owner side) take chunks of kChunk own tokens. For token t each lane loads 16-byte vectors
//     of its row once and stores them to the token's local rows and, once per remote rank holding any of its
//     slots, to that rank's staging row [me][t]; the slot rows (meta) and probs go along. After the chunk: a
//     system-scope fence and one release flag per remote rank.
//     consumer warps (expert side) take (source rank, chunk) pairs (RemoteWork: chunk c of every source in the
//     block of the index that produced it there), wait for the flag (bounded), and expand every staged row into
//     its local rows. Combine backward scales by w and, under InCombine, sends
//     the dot products <y, d_out> back (ret + a return flag) that the producers collect at the end.
//   gather (combine, dispatch backward): expert side -> owner.
//     producer warps (expert side) take (source rank, chunk) pairs (RemoteWork) and reduce each token's local rows
//     to one fp32 partial (k order), stored rounded to the activation dtype into the owner's staging row [me][t];
//     flag.
//     consumer warps (owner side) take own chunks, wait for the flags of the ranks involved and sum the partials
//     in rank order (the own rank's partial in fp32 from the local rows): deterministic.
//
// NvLink: producers store through the peers' window addresses, both roles run in one launch (each block starts with
// a handshake with the same block of every peer, so that no peer is still reading a staging area from an earlier
// op). HostApi: the same code with Pack (producers store into a local send buffer) and Unpack (consumers read
// what ncclRecv delivered, no flags) launches around grouped ncclSend/ncclRecv.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "core/device_utils.cuh"
#include "core/status_device.cuh"
#include "dispatch/ep_plan.h"
#include "quant/quant_kernels.cuh"

namespace moerail::ep {

constexpr int kWarps = 16;          // 8 producer + 8 consumer warps per block when both roles run
constexpr int kChunk = 1;           // tokens per flag (2 measured 4-7% slower at 4096 tokens on 2x H200, 132 blocks)
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
  std::size_t xcount = 0;     // i32 [R][E + 1]: exchanged counts (NvLink)
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

struct Params {
  int R, me, E, L, K, t_max, capacity, chunks_max, blocks;
  long long nvec;                  // 16-byte vectors per row
  int role;                        // Role bits of this launch
  bool zero_pads;                  // this launch writes the pad rows of row_dst (and recv_probs) with zeros
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

  // The dispatch's plan (a DispatchHandle's memory, but base and limit): what its combine and both backward
  // passes read of it. A dispatch writes it: tokens .. pad_prefix by the planner, dest_rank / dest_row by the
  // producers, slot_rows / slot_probs by the producers ([me]) and the consumers (the other sources, copied from
  // the staging area's meta and probs as each chunk lands).
  const std::int32_t* tokens;      // [R]
  std::int32_t* dest_rank;         // [T_max, K]
  std::int32_t* dest_row;          // [T_max, K]
  std::int32_t* slot_rows;         // [R][T_max][K]: rows here of source s's slots (-1 none); [me] unused
  float* slot_probs;               // [R][T_max][K]: their probs; [me]: this rank's own slots' probs
  int expert_cap;                  // rows of an expert's segment at most (Capacity::PerExpert); 0 = no bound

  // token side (owner)
  const std::int32_t* num_tokens;  // [1]
  const std::int32_t* topk_idx;    // [T_max, K] (dispatch)
  const std::int32_t* local_row;   // [T_max, K] local planner rows (A = 1): place among own slots of the expert
  const std::int32_t* local_off;   // [E + 1] local planner segment offsets
  const std::int32_t* base;        // [E] (dispatch)
  const std::int32_t* limit;       // [E] (dispatch): rows at or past limit[e] on e's rank are dropped
  const float* probs;              // [T_max, K] (dispatch)
  const void* tok_src;             // [T_max, H]: x (dispatch), d_out (combine backward)
  void* tok_dst;                   // [T_max, H]: out (combine), dx (dispatch backward)
  float* d_probs;                  // [T_max, K] or null

  // expert side
  const void* row_src;             // [capacity, H]: y (combine), d_recv (dispatch backward)
  void* row_dst;                   // [capacity, H]: recv (dispatch), d_y (combine backward)
  const void* y;                   // [capacity, H]: combine backward dots (InCombine)
  float* recv_probs;               // [capacity] (dispatch)
  const float* d_recv_probs;       // [capacity] (dispatch backward) or null
  const std::int32_t* seg_offset;  // [L + 1] local experts (pad zeroing)
  const std::int32_t* tpe;         // [L]
  const std::int32_t* pad_prefix;  // [L + 1]

  // FP8 dispatch (scatter_kernel<bf16, true, S>): tok_src rows are bf16 (src_nvec vectors), quantized at the source
  // with recipe S; a staged row is [nvec * 16 e4m3 bytes | scale_cols 32-bit words], wire_bytes apart (a multiple
  // of 16); row_dst rows are the e4m3 bytes (nvec vectors) and recv_scales [capacity, scale_cols] words: H / 128
  // f32 scales (Block1x128) or H / 32 E8M0 bytes (Mx1x32, four per word); PerTensor: no scales (scale_cols 0,
  // recv_scales null), every row quantized with *tensor_scale.
  long long src_nvec;
  int scale_cols;
  std::size_t wire_bytes;
  std::uint32_t* recv_scales;      // [capacity, scale_cols] or null (then no scales anywhere)
  std::uint32_t pad_scale_word;    // a pad row's scale words: 1.0f, or four E8M0 codes of 2^0
  const float* tensor_scale;       // PerTensor: [1]
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
// Developer trace (MOERAIL_EP_TRACE, docs/dispatch.md): each warp of a data kernel records %globaltimer stamps and
// counters in its kTraceSlots slots of trace[(block * kWarps + warp) * kTraceSlots]; the plan kernel six stamps in
// the 8 words after all warps' slots: 0 start, 1 counts exchanged, 2 end, 3 totals, 4 segments, 5 this rank's
// plan. Nothing is recorded when trace is null (the default).
constexpr int kTraceSlots = 10;
enum TraceSlot : int {
  kTraceEntry,      // kernel entry
  kTraceEntered,    // after the block handshake
  kTraceFirst,      // first work item started (after its flag wait, for consumers)
  kTraceRoleEnd,    // producer/consumer loop left
  kTraceEnd,        // kernel end (after the pad rows)
  kTraceItems,      // work items (chunks) handled
  kTraceWaitNs,     // time in flag waits
  kTraceFenceNs,    // time in system-scope fences before flags
  kTraceMetaNs,     // scatter: time in the per-token prologue (slot rows, probs, masks)
  kTraceDataNs,     // scatter: time moving the token rows
};

struct WarpTrace {
  unsigned long long* slots = nullptr;  // this warp's, or null
  unsigned long long first = 0, wait = 0, fence = 0, items = 0, meta = 0, data = 0;
  __device__ WarpTrace(unsigned long long* trace, unsigned long long entry) {
    if (trace == nullptr) return;
    slots = trace + (std::size_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * kTraceSlots;
    put(kTraceEntry, entry);
  }
  __device__ bool on() const { return slots != nullptr; }
  __device__ void put(int slot, unsigned long long v) const {
    if (slots && threadIdx.x % 32 == 0) slots[slot] = v;
  }
  __device__ void item(unsigned long long now) {
    if (items++ == 0) first = now;
  }
  __device__ void finish(unsigned long long role_end, unsigned long long end) const {
    put(kTraceFirst, first);
    put(kTraceRoleEnd, role_end);
    put(kTraceEnd, end);
    put(kTraceItems, items);
    put(kTraceWaitNs, wait);
    put(kTraceFenceNs, fence);
    put(kTraceMetaNs, meta);
    put(kTraceDataNs, data);
  }
};

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
  __device__ static void unpack(const uint4& v, float (&f)[kN]) {
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
__device__ __forceinline__ void st16(void* base, long long vec, const uint4& v) {
  reinterpret_cast<uint4*>(base)[vec] = v;
}

// ---- one batch of 16-byte vectors per lane: vectors v0 + u * 32 + lane, u < kU, of a row -----------------------

template <int kU>
__device__ __forceinline__ void load_batch(uint4 (&buf)[kU], const void* row, long long v0, long long nvec) {
  const int lane = int(threadIdx.x % 32);
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const long long v = v0 + u * 32 + lane;
    if (v < nvec) buf[u] = ld16(row, v);
  }
}

template <int kU>
__device__ __forceinline__ void store_batch(void* row, const uint4 (&buf)[kU], long long v0, long long nvec) {
  const int lane = int(threadIdx.x % 32);
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const long long v = v0 + u * 32 + lane;
    if (v < nvec) st16(row, v, buf[u]);
  }
}

// Combine backward under InCombine, one slot: dst = w * g and the warp's fp32 dot product <y, g> (lane-partial sums
// in vector order, then a fixed butterfly), a batch of g and y vectors in flight at a time. Without probs in the
// combine, d_y is d_out as it is: the scatter copies it like a dispatch.
template <typename Elem>
__device__ __forceinline__ float scale_row_and_dot(void* dst, const void* g, const void* y, float w, long long nvec) {
  constexpr int N = VecMath<Elem>::kN;
  constexpr int kU = kUnrollWide / 2;  // g and y together: the 16-byte loads in flight of a dispatch
  const int lane = int(threadIdx.x % 32);
  float dot = 0.f;
  for (long long v0 = 0; v0 < nvec; v0 += 32 * kU) {
    uint4 gb[kU], yb[kU];
    load_batch(gb, g, v0, nvec);
    load_batch(yb, y, v0, nvec);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (v0 + u * 32 + lane >= nvec) continue;
      float gv[N], yv[N];
      VecMath<Elem>::unpack(gb[u], gv);
      VecMath<Elem>::unpack(yb[u], yv);
#pragma unroll
      for (int i = 0; i < N; ++i) dot += yv[i] * gv[i];
#pragma unroll
      for (int i = 0; i < N; ++i) gv[i] *= w;
      gb[u] = VecMath<Elem>::pack(gv);
    }
    store_batch(dst, gb, v0, nvec);
  }
  return cuda::warp_sum(dot);
}

template <typename Elem, int kU>
__device__ __forceinline__ void zero_acc(float (&acc)[kU][VecMath<Elem>::kN]) {
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int j = 0; j < VecMath<Elem>::kN; ++j) acc[u][j] = 0.f;
}

// ---- FP8 at the source: one batch of bf16 vectors -> e4m3 (16 bytes per lane) + the recipe's scales -------------

// Output vector j = j0 + u * 32 + lane holds the 16 e4m3 codes of bf16 vectors 2j and 2j + 1: a scale group is
// quant_detail::group_lanes<S>() neighbouring lanes (8 for 1x128, 2 for MXFP8, 1 per-tensor), which reduce their
// amax with butterfly shuffles, and every store is 16 bytes (8-byte stores would double the store instructions per
// byte that cross the link). The arithmetic is quantize_fp8's (src/quant/quant_kernels.cuh), so the codes and scales
// are the reference's bit for bit; `stored` receives what the scale array holds (f32 bits or the E8M0 code).
// nq = H / 16 with H % 128 == 0: groups are wholly in or out of the row; every lane reaches the shuffles (the
// caller's loop bound is warp-uniform).
template <Fp8Scaling S, int kU>
__device__ __forceinline__ void load_quantize_batch(const char* x, uint4 (&q)[kU], std::uint32_t (&stored)[kU],
                                                    long long j0, long long nq, float tensor_scale) {
  const int lane = int(threadIdx.x % 32);
  uint4 in[kU][2] = {};
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const long long j = j0 + u * 32 + lane;
    if (j < nq) {
      in[u][0] = ld16(x, 2 * j);
      in[u][1] = ld16(x, 2 * j + 1);
    }
  }
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const bool valid = j0 + u * 32 + lane < nq;
    float v[16];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(&in[u][h]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // bf16 -> f32 is exact: the bits move up
        v[8 * h + 2 * i] = valid ? quant_detail::bf16_lo(w[i]) : 0.f;
        v[8 * h + 2 * i + 1] = valid ? quant_detail::bf16_hi(w[i]) : 0.f;
      }
    }
    stored[u] = 0;
    const float s = quant_detail::group_scale<S, quant_detail::group_lanes<S>()>(v, tensor_scale, stored[u]);
    q[u] = quant_detail::encode16(v, 1.0f / s);
  }
}

// Stores a quantized batch into one e4m3 row (data) and its scales (the first lane of each group; PerTensor: none).
template <Fp8Scaling S, int kU>
__device__ __forceinline__ void store_fp8_batch(char* data, std::uint32_t* scales, const uint4 (&q)[kU],
                                                const std::uint32_t (&stored)[kU], long long j0, long long nq) {
  constexpr int G = quant_detail::group_lanes<S>();
  const int lane = int(threadIdx.x % 32);
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const long long j = j0 + u * 32 + lane;
    if (j < nq) {
      st16(data, j, q[u]);
      if constexpr (S == Fp8Scaling::Block1x128) {
        if (lane % G == 0) scales[j / G] = stored[u];
      } else if constexpr (S == Fp8Scaling::Mx1x32) {
        if (lane % G == 0) reinterpret_cast<std::uint8_t*>(scales)[j / G] = std::uint8_t(stored[u]);
      }
    }
  }
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
    if (s != p.me) most = max(most, chunks_of(min(max(p.tokens[s], 0), p.t_max)));
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
__device__ std::uint32_t enter(const Params& p, unsigned long long deadline) {
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

// ---- pad rows -------------------------------------------------------------------------------------------------

__device__ void zero_pad_rows(const Params& p, void* dst, float* dst_probs, int warp, int nwarps) {
  const int L = p.L, lane = int(threadIdx.x % 32);
  const int pads = p.pad_prefix[L];
  for (int i = warp; i < pads; i += nwarps) {
    int lo = 0, hi = L - 1;  // expert l with pad_prefix[l] <= i < pad_prefix[l + 1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.pad_prefix[mid] <= i) lo = mid; else hi = mid - 1;
    }
    const int kept = p.expert_cap > 0 ? min(p.tpe[lo], p.expert_cap) : p.tpe[lo];
    const long long row = (long long)p.seg_offset[lo] + kept + (i - p.pad_prefix[lo]);
    if (row >= p.capacity) continue;
    char* r = static_cast<char*>(dst) + row * p.nvec * 16;
    for (long long v = lane; v < p.nvec; v += 32) st16(r, v, make_uint4(0, 0, 0, 0));
    if (dst_probs && lane == 0) dst_probs[row] = 0.f;
    if (p.recv_scales)  // FP8 pad rows: scale 1 (1.0f, or E8M0 code 127), as the one-GPU FP8 permute writes
      for (int j = lane; j < p.scale_cols; j += 32) p.recv_scales[row * p.scale_cols + j] = p.pad_scale_word;
  }
}

}  // namespace moerail::ep

namespace moerail::ep {

// ---- planner: count exchange (NvLink) + this rank's layout ----------------------------------------------------

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
  unsigned long long* stamps = p.trace ? p.trace + std::size_t(p.blocks) * kWarps * kTraceSlots : nullptr;
  if (stamps && tid == 0) stamps[0] = global_ns();
  if (pp.exchange) {
    __shared__ std::uint32_t epoch;
    if (tid == 0) epoch = ++p.epochs[p.blocks];
    for (int e = tid; e <= p.E; e += kPlanThreads) {
      const std::int32_t v = e < p.E ? pp.local_tpe[e] : T;
      for (int r = 0; r < p.R; ++r) region<std::int32_t>(p.dst[r], p.reg.xcount)[p.me * (p.E + 1) + e] = v;
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
  const PlanShape shape{p.R, p.E, p.L, pp.A, p.me, p.capacity, p.expert_cap};
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
    s->rows_available = std::uint32_t(p.expert_cap > 0 ? p.expert_cap : p.capacity);
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

// HostApi: this rank's counts and T into its own row of the xcount region (then ncclAllGather in place).
__global__ void pack_counts_kernel(Params p, const std::int32_t* local_tpe, const std::int32_t* num_tokens) {
  auto* counts = region<std::int32_t>(p.local, p.reg.xcount) + p.me * (p.E + 1);
  for (int e = int(threadIdx.x); e <= p.E; e += int(blockDim.x))
    counts[e] = e < p.E ? local_tpe[e] : cuda::load_token_count(num_tokens, p.t_max);
}

// ---- scatter: dispatch (kDispatch) and combine backward --------------------------------------------------------

// Payload of a scatter: the rows as they are, or bf16 rows quantized to FP8 at the source with a recipe.
enum class Payload { Native, Fp8PerTensor, Fp8Block1x128, Fp8Mx1x32 };

constexpr Fp8Scaling fp8_scaling_of(Payload pay) {
  return pay == Payload::Fp8PerTensor ? Fp8Scaling::PerTensor
         : pay == Payload::Fp8Mx1x32  ? Fp8Scaling::Mx1x32
                                      : Fp8Scaling::Block1x128;
}

// One token's slots as the scatter producer needs them (lane k < K: slot k). fetch() issues the token's loads,
// resolve() those that depend on them (dispatch: the expert's base row and local offset), place() computes where
// each slot's row goes. The producer fetches the next token before it moves the current one's row and resolves it
// after, so that the per-token prologue's two dependent round trips leave the warp's chain of tokens.
template <bool kDispatch>
struct SlotLoads {
  int a = -1, b = -1;  // dispatch: the slot's local row and expert; combine backward: its rank and row
  int base = 0, off = 0, limit = 0;  // dispatch: base[expert], local_off[expert], limit[expert]
  float prob = 0.f;

  __device__ void fetch(const Params& p, int t, std::size_t k_slice) {
    const int lane = int(threadIdx.x % 32);
    a = b = -1;
    prob = 0.f;
    if (t < 0 || lane >= p.K) return;
    const std::size_t slot = std::size_t(t) * p.K + lane;
    if constexpr (kDispatch) {
      a = p.local_row[slot];
      b = p.topk_idx[slot];
      prob = p.probs[slot];
    } else {
      a = p.dest_rank[slot];
      b = p.dest_row[slot];
      prob = p.slot_probs[std::size_t(p.me) * p.t_max * p.K + slot];
    }
  }
  __device__ void resolve(const Params& p) {
    if (kDispatch && a >= 0) {  // a slot with a local row has a valid expert
      base = p.base[b];
      off = p.local_off[b];
      limit = p.limit[b];
    }
  }
  __device__ void place(const Params& p, int& rank, int& row) const {
    rank = row = -1;
    if constexpr (kDispatch) {
      const long long r = (long long)base + (a - off);
      if (a >= 0 && r < limit) {  // rows past the expert's capacity or the buffer are dropped (counted by the
                                  // destination)
        rank = b / p.L;
        row = int(r);
      }
    } else {
      rank = a;
      row = b;
    }
  }
};

template <typename Elem, bool kDispatch, Payload kPay = Payload::Native>
__global__ void __launch_bounds__(kWarps * 32) scatter_kernel(Params p) {
  constexpr bool kFp8 = kPay != Payload::Native;
  static_assert(!kFp8 || kDispatch, "FP8 payloads are a dispatch feature");
  const unsigned long long t_entry = global_ns(), deadline = t_entry + p.timeout_ns;
  WarpTrace tr(p.trace, t_entry);
  const std::uint32_t epoch = enter(p, deadline);
  if (tr.on()) tr.put(kTraceEntered, global_ns());
  const int lane = int(threadIdx.x % 32);
  const bool slot_lane = lane < p.K;
  RoleWarps mine;
  const bool producer = split_roles(p, mine);
  const int T = cuda::load_token_count(p.num_tokens, p.t_max);
  const std::size_t row_bytes = std::size_t(p.nvec) * 16;           // a row of row_dst
  const std::size_t stage_row = kFp8 ? p.wire_bytes : row_bytes;    // a staged row
  const std::size_t stage_slice = std::size_t(p.t_max) * stage_row;
  const std::size_t k_slice = std::size_t(p.t_max) * p.K * sizeof(float);
  const bool flags = p.role & kFlags;

  if (producer && (p.role & kProduce)) {
    const int chunks = chunks_of(T);
    const LocalParts parts = local_parts(kDispatch && !kFp8, chunks, mine, p.nvec);
    const long long local_end = parts.begin(1);  // this warp's range of its tokens' local rows
    // this warp's tokens one after another; the next one's slot loads are issued before the current row moves
    const auto next_token = [&](int t, int c) {
      return t + 1 < min(T, (c + 1) * kChunk) ? t + 1 : c + mine.nw < chunks ? (c + mine.nw) * kChunk : -1;
    };
    SlotLoads<kDispatch> next;
    next.fetch(p, mine.w < chunks ? mine.w * kChunk : -1, k_slice);
    next.resolve(p);
    for (int c = mine.w; c < chunks; c += mine.nw) {
      if (tr.on()) tr.item(global_ns());
      const int t_end = min(T, (c + 1) * kChunk);
      for (int t = c * kChunk; t < t_end; ++t) {
        const std::size_t slot = std::size_t(t) * p.K + lane;
        const unsigned long long tt0 = tr.on() ? global_ns() : 0;
        const SlotLoads<kDispatch> cur = next;
        next.fetch(p, next_token(t, c), k_slice);
        int rank, row;
        cur.place(p, rank, row);
        const float prob = cur.prob;
        if (kDispatch && slot_lane) {
          p.dest_rank[slot] = rank;
          p.dest_row[slot] = row;
        }
        const unsigned mask = rank_mask(rank, p.K);
        const unsigned remote = mask & ~(1u << p.me);
        if (kDispatch && slot_lane) {
          // the slot rows and probs travel to every remote rank (-1 where the slot is elsewhere)
          for (int r = 0; r < p.R; ++r) {
            if (r == p.me) continue;
            region<std::int32_t>(dst_slice(p, r, p.reg.meta, std::size_t(p.t_max) * p.K * 4), 0)[slot] =
                rank == r ? row : -1;
            if (rank == r) region<float>(dst_slice(p, r, p.reg.probs, k_slice), 0)[slot] = prob;
          }
          p.slot_probs[std::size_t(p.me) * p.t_max * p.K + slot] = prob;
          if (rank == p.me) p.recv_probs[row] = prob;
        }
        const unsigned long long tt1 = tr.on() ? global_ns() : 0;
        if (tr.on()) tr.meta += tt1 - tt0;
        const char* src = static_cast<const char*>(p.tok_src) + std::size_t(t) * row_bytes;
        if constexpr (kFp8) {
          // one read of the bf16 row, quantized once, stored to every local row and once per remote rank
          const unsigned local = __ballot_sync(cuda::kFullMask, slot_lane && rank == p.me);
          const char* x = static_cast<const char*>(p.tok_src) + std::size_t(t) * std::size_t(p.src_nvec) * 16;
          constexpr Fp8Scaling S = fp8_scaling_of(kPay);
          constexpr int kU = kUnrollWide / 2;  // the same 16-byte loads in flight as the bf16 path
          const float tensor_scale = S == Fp8Scaling::PerTensor ? *p.tensor_scale : 1.0f;
          for (long long j0 = 0; j0 < p.nvec; j0 += 32 * kU) {
            uint4 q[kU];
            std::uint32_t sc[kU];
            load_quantize_batch<S>(x, q, sc, j0, p.nvec, tensor_scale);
            for (unsigned m = remote; m; m &= m - 1) {
              char* w = dst_slice(p, __ffs(m) - 1, p.reg.stage, stage_slice) + std::size_t(t) * stage_row;
              store_fp8_batch<S>(w, reinterpret_cast<std::uint32_t*>(w + row_bytes), q, sc, j0, p.nvec);
            }
            for (unsigned m = local; m; m &= m - 1) {
              const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
              store_fp8_batch<S>(static_cast<char*>(p.row_dst) + std::size_t(wk) * row_bytes,
                                 p.recv_scales + std::size_t(wk) * p.scale_cols, q, sc, j0, p.nvec);
            }
          }
        } else if (kDispatch || !p.in_combine) {
          // one read of the row, stored to every local row and once per remote rank (combine backward with the
          // probs in the activation: d_y = d_out, the same copy)
          if (!kDispatch && p.d_probs && slot_lane) p.d_probs[slot] = 0.f;  // no probs in the combine: no gradient
          const unsigned local = __ballot_sync(cuda::kFullMask, slot_lane && rank == p.me);
          for (long long v0 = 0; v0 < (remote ? p.nvec : local_end); v0 += 32 * kUnrollWide) {
            uint4 buf[kUnrollWide];
            load_batch(buf, src, v0, p.nvec);
            for (unsigned m = remote; m; m &= m - 1) {
              const int r = __ffs(m) - 1;
              store_batch(dst_slice(p, r, p.reg.stage, stage_slice) + std::size_t(t) * row_bytes, buf, v0, p.nvec);
            }
            for (unsigned m = v0 < local_end ? local : 0u; m; m &= m - 1) {
              const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
              store_batch(static_cast<char*>(p.row_dst) + std::size_t(wk) * row_bytes, buf, v0, local_end);
            }
          }
        } else {
          // combine backward, InCombine: d_out once per remote rank; local rows get w * d_out and the dot product
          for (long long v0 = 0; remote && v0 < p.nvec; v0 += 32 * kUnrollWide) {
            uint4 buf[kUnrollWide];
            load_batch(buf, src, v0, p.nvec);
            for (unsigned m = remote; m; m &= m - 1)
              store_batch(dst_slice(p, __ffs(m) - 1, p.reg.stage, stage_slice) + std::size_t(t) * row_bytes, buf, v0,
                          p.nvec);
          }
          for (int k = 0; k < p.K; ++k) {
            const int rk = __shfl_sync(cuda::kFullMask, rank, k), wk = __shfl_sync(cuda::kFullMask, row, k);
            const float w = __shfl_sync(cuda::kFullMask, prob, k);
            if (rk != p.me) continue;
            char* d = static_cast<char*>(p.row_dst) + std::size_t(wk) * row_bytes;
            const char* yr = static_cast<const char*>(p.y) + std::size_t(wk) * row_bytes;
            const float dot = scale_row_and_dot<Elem>(d, src, yr, w, p.nvec);
            if (p.d_probs && lane == 0) p.d_probs[std::size_t(t) * p.K + k] = dot;
          }
          if (p.d_probs && slot_lane && rank != p.me) p.d_probs[slot] = 0.f;  // remote ones come back later
        }
        next.resolve(p);  // its loads land while this token's stores drain (and the fence waits)
        if (tr.on()) tr.data += global_ns() - tt1;
      }
      if (flags) {
        const unsigned long long f0 = tr.on() ? global_ns() : 0;
        __threadfence_system();
        if (tr.on()) tr.fence += global_ns() - f0;
        __syncwarp();
        if (lane < p.R && lane != p.me)
          store_release_sys(region<std::uint32_t>(p.dst[lane], p.reg.sig_data) + std::size_t(p.me) * p.chunks_max + c,
                            epoch);
      }
    }
    const int j = mine.w / parts.stride, c = mine.w % parts.stride;
    if (kDispatch && j > 0 && j < parts.n && c < chunks) {  // range j of chunk c's local rows
      const long long vb = parts.begin(j), ve = parts.begin(j + 1);
      if (tr.on()) tr.item(global_ns());
      for (int t = c * kChunk; t < min(T, (c + 1) * kChunk); ++t) {
        SlotLoads<kDispatch> cur;
        cur.fetch(p, t, k_slice);
        cur.resolve(p);
        int rank, row;
        cur.place(p, rank, row);
        const unsigned local = __ballot_sync(cuda::kFullMask, slot_lane && rank == p.me);
        const char* src = static_cast<const char*>(p.tok_src) + std::size_t(t) * row_bytes;
        for (long long v0 = vb; local && v0 < ve; v0 += 32 * kUnrollWide) {
          uint4 buf[kUnrollWide];
          load_batch(buf, src, v0, ve);
          for (unsigned m = local; m; m &= m - 1) {
            const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
            store_batch(static_cast<char*>(p.row_dst) + std::size_t(wk) * row_bytes, buf, v0, ve);
          }
        }
      }
    }
  }

  if (!producer && (p.role & kConsume)) {
    // the pad rows first: until the first chunk arrives these warps would only wait
    if (p.zero_pads) zero_pad_rows(p, p.row_dst, kDispatch ? p.recv_probs : nullptr, mine.w, mine.nw);
    const RemoteWork rw = remote_work(p);
    int s, c;
    for (int item = 0; rw.pick(mine, item, s, c); ++item) {
      const int Ts = min(max(p.tokens[s], 0), p.t_max);
      if (c >= chunks_of(Ts)) continue;
      const unsigned long long w0 = tr.on() ? global_ns() : 0;
      if (flags) {
        if (lane == 0)
          wait_flag(p, region<std::uint32_t>(p.local, p.reg.sig_data) + std::size_t(s) * p.chunks_max + c, epoch,
                    deadline, s);
        __syncwarp();
      }
      if (tr.on()) {
        const unsigned long long now = global_ns();
        tr.wait += now - w0;
        tr.item(now);
      }
      // a dispatch reads the slot rows and probs that came with the chunk and keeps them in its handle; the
      // combine backward reads them there
      const std::size_t tk = std::size_t(p.t_max) * p.K;
      std::int32_t* kept_rows = p.slot_rows + std::size_t(s) * tk;
      float* kept_probs = p.slot_probs + std::size_t(s) * tk;
      const auto* meta = kDispatch ? region<std::int32_t>(local_slice(p, s, p.reg.meta, tk * 4), 0) : kept_rows;
      const auto* sprobs = kDispatch ? region<float>(local_slice(p, s, p.reg.probs, k_slice), 0) : kept_probs;
      const char* stage = local_slice(p, s, p.reg.stage, stage_slice);
      const int t_end = min(Ts, (c + 1) * kChunk);
      for (int t = c * kChunk; t < t_end; ++t) {
        const unsigned long long tt0 = tr.on() ? global_ns() : 0;
        const std::size_t slot = std::size_t(t) * p.K + lane;
        const int row = slot_lane ? meta[slot] : -1;
        const float prob = slot_lane && row >= 0 ? sprobs[slot] : 0.f;
        if (kDispatch && slot_lane) {
          kept_rows[slot] = row;
          kept_probs[slot] = prob;
        }
        const unsigned any = __ballot_sync(cuda::kFullMask, row >= 0);
        if (!any) continue;
        const unsigned long long tt1 = tr.on() ? global_ns() : 0;
        if (tr.on()) tr.meta += tt1 - tt0;
        const char* src = stage + std::size_t(t) * stage_row;
        if (kDispatch || !p.in_combine) {  // the staged row as it is to every row it lands in
          if (kDispatch && row >= 0) p.recv_probs[row] = prob;
          // FP8: the scales follow the e4m3 bytes of the staged row; loaded here, beside the first data batch, so
          // that they cost no round trip of their own
          std::uint32_t sv[kScalesPerLane];
          const auto* ssrc = reinterpret_cast<const std::uint32_t*>(src + row_bytes);
          if constexpr (kFp8) {
#pragma unroll
            for (int i = 0; i < kScalesPerLane; ++i)
              if (lane + 32 * i < p.scale_cols) sv[i] = ssrc[lane + 32 * i];
          }
          constexpr int kU = kFp8 ? kUnrollFp8Rows : kUnrollWide;
          for (long long v0 = 0; v0 < p.nvec; v0 += 32 * kU) {
            uint4 buf[kU];
            load_batch(buf, src, v0, p.nvec);
            for (unsigned m = any; m; m &= m - 1) {
              const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
              store_batch(static_cast<char*>(p.row_dst) + std::size_t(wk) * row_bytes, buf, v0, p.nvec);
            }
          }
          if (kFp8 && p.scale_cols > 0) {  // PerTensor moves no scales
            for (unsigned m = any; m; m &= m - 1) {
              const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
              std::uint32_t* dst = p.recv_scales + std::size_t(wk) * p.scale_cols;
#pragma unroll
              for (int i = 0; i < kScalesPerLane; ++i)
                if (lane + 32 * i < p.scale_cols) dst[lane + 32 * i] = sv[i];
              for (int j = lane + 32 * kScalesPerLane; j < p.scale_cols; j += 32) dst[j] = ssrc[j];  // H > 16384
            }
          }
        } else {
          float* ret = region<float>(dst_slice(p, s, p.reg.ret, k_slice), 0);
          for (unsigned m = any; m; m &= m - 1) {
            const int k = __ffs(m) - 1;
            const int wk = __shfl_sync(cuda::kFullMask, row, k);
            const float w = __shfl_sync(cuda::kFullMask, prob, k);
            char* d = static_cast<char*>(p.row_dst) + std::size_t(wk) * row_bytes;
            const char* yr = static_cast<const char*>(p.y) + std::size_t(wk) * row_bytes;
            const float dot = scale_row_and_dot<Elem>(d, src, yr, w, p.nvec);
            if (lane == 0) ret[std::size_t(t) * p.K + k] = dot;
          }
        }
        if (tr.on()) tr.data += global_ns() - tt1;
      }
      if (!kDispatch && p.in_combine && flags) {
        __threadfence_system();
        __syncwarp();
        if (lane == 0)
          store_release_sys(region<std::uint32_t>(p.dst[s], p.reg.sig_ret) + std::size_t(p.me) * p.chunks_max + c,
                            epoch);
      }
    }
  }

  // combine backward, InCombine: the dot products of remote slots come back to the owner
  if (!kDispatch && p.in_combine && p.d_probs && (p.role & kCollect) && (producer || !(p.role & kProduce))) {
    for (int c = mine.w; c < chunks_of(T); c += mine.nw) {
      if (flags) {
        if (lane < p.R && lane != p.me)
          wait_flag(p, region<std::uint32_t>(p.local, p.reg.sig_ret) + std::size_t(lane) * p.chunks_max + c, epoch,
                    deadline, lane);
        __syncwarp();
      }
      const int t_end = min(T, (c + 1) * kChunk);
      for (int t = c * kChunk; t < t_end; ++t) {
        const std::size_t slot = std::size_t(t) * p.K + lane;
        if (!slot_lane) continue;
        const int rank = p.dest_rank[slot];
        if (rank >= 0 && rank != p.me)
          p.d_probs[slot] = region<float>(local_slice(p, rank, p.reg.ret, k_slice), 0)[slot];
      }
    }
  }

  const unsigned long long role_end = tr.on() ? global_ns() : 0;
  if (p.zero_pads && !(p.role & kConsume)) {  // a launch without consumers (R = 1): every warp, at the end
    const int warp = int(blockIdx.x) * kWarps + int(threadIdx.x / 32);
    zero_pad_rows(p, p.row_dst, kDispatch ? p.recv_probs : nullptr, warp, int(gridDim.x) * kWarps);
  }
  if (tr.on()) tr.finish(role_end, global_ns());
}

// ---- gather: combine (kCombine) and dispatch backward -----------------------------------------------------------
//
// Both roles sum a short list of rows per token (the producer: the token's local rows, k order; the consumer: the
// remote partials in rank order with the own rank's local rows summed in fp32 at its place). A warp loads a batch
// of every row it sums with cp.async into its own slice of shared memory, waits once, then adds them in list order:
// one memory round trip per batch and wave of kWave rows instead of one per row, with no registers held by the loads
// in flight (the register-file limit of 16 warps per SM caps what plain loads can keep in flight). Each lane reads
// back only the vectors it landed itself, so the landing needs no warp barrier; the list is written by the lanes
// that own its entries and read by all (__syncwarp around it).

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
          VecMath<Elem>::unpack(land[(jj * kGatherU + u) * 32 + lane], x);
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
  if (tr.on()) tr.put(kTraceEntered, global_ns());
  const int lane = int(threadIdx.x % 32);
  const int warp = int(threadIdx.x / 32);
  uint4* land = gather_smem + std::size_t(warp) * kLandVecs;
  GatherItem* items = reinterpret_cast<GatherItem*>(gather_smem + std::size_t(kWarps) * kLandVecs) + warp * 32;
  const bool slot_lane = lane < p.K;
  RoleWarps mine;
  const bool producer = split_roles(p, mine);
  const int T = cuda::load_token_count(p.num_tokens, p.t_max);
  const std::size_t row_bytes = std::size_t(p.nvec) * 16;
  const std::size_t stage_slice = std::size_t(p.t_max) * row_bytes;
  const std::size_t k_slice = std::size_t(p.t_max) * p.K * sizeof(float);
  const bool flags = p.role & kFlags;
  const char* rows = static_cast<const char*>(p.row_src);

  if (producer && (p.role & kProduce)) {
    const RemoteWork rw = remote_work(p);
    int s, c;
    for (int item = 0; rw.pick(mine, item, s, c); ++item) {
      const int Ts = min(max(p.tokens[s], 0), p.t_max);
      if (c >= chunks_of(Ts)) continue;
      if (tr.on()) tr.item(global_ns());
      const auto* meta = p.slot_rows + std::size_t(s) * p.t_max * p.K;
      const auto* sprobs = p.slot_probs + std::size_t(s) * p.t_max * p.K;
      char* stage = dst_slice(p, s, p.reg.stage, stage_slice);
      float* ret = region<float>(dst_slice(p, s, p.reg.ret, k_slice), 0);
      const int t_end = min(Ts, (c + 1) * kChunk);
      for (int t = c * kChunk; t < t_end; ++t) {
        const std::size_t slot = std::size_t(t) * p.K + lane;
        const int row = slot_lane ? meta[slot] : -1;
        const float w = kCombine && p.in_combine && row >= 0 ? sprobs[slot] : 1.f;
        if (!kCombine && p.d_recv_probs && row >= 0) ret[slot] = p.d_recv_probs[row];
        const unsigned any = __ballot_sync(cuda::kFullMask, row >= 0);
        if (!any) continue;
        // the token's local rows in k order: one partial, complete before it is stored
        if (row >= 0) items[__popc(any & ((1u << lane) - 1u))] = GatherItem{rows + std::size_t(row) * row_bytes, w, 1};
        __syncwarp();
        const int total = __popc(any);
        char* d = stage + std::size_t(t) * row_bytes;
        store_listed_sum<Elem>(d, items, total, total, land, 0, p.nvec);
        __syncwarp();  // the list is rewritten for the next token
      }
      if (flags) {
        const unsigned long long f0 = tr.on() ? global_ns() : 0;
        __threadfence_system();
        if (tr.on()) tr.fence += global_ns() - f0;
        __syncwarp();
        if (lane == 0)
          store_release_sys(region<std::uint32_t>(p.dst[s], p.reg.sig_data) + std::size_t(p.me) * p.chunks_max + c,
                            epoch);
      }
    }
  }

  if (!producer && (p.role & kConsume)) {
    const float* own_probs = p.slot_probs + std::size_t(p.me) * p.t_max * p.K;
    // with fewer chunks than warps, column ranges of a chunk on several warps (LocalParts)
    const int chunks = chunks_of(T);
    const LocalParts parts = local_parts(true, chunks, mine, p.nvec);
    const int range = mine.w / parts.stride;  // 0 when parts.n == 1 (stride = nw)
    const int c_step = parts.n > 1 ? chunks : mine.nw;  // ranges: one chunk per warp
    for (int c = mine.w % parts.stride; range < parts.n && c < chunks; c += c_step) {
      const unsigned long long w0 = tr.on() ? global_ns() : 0;
      if (flags) {
        if (lane < p.R && lane != p.me)
          wait_flag(p, region<std::uint32_t>(p.local, p.reg.sig_data) + std::size_t(lane) * p.chunks_max + c, epoch,
                    deadline, lane);
        __syncwarp();
      }
      if (tr.on()) {
        const unsigned long long now = global_ns();
        tr.wait += now - w0;
        tr.item(now);
      }
      const int t_end = min(T, (c + 1) * kChunk);
      for (int t = c * kChunk; t < t_end; ++t) {
        const std::size_t slot = std::size_t(t) * p.K + lane;
        const int rank = slot_lane ? p.dest_rank[slot] : -1;
        const int row = slot_lane ? p.dest_row[slot] : -1;
        const float w = kCombine && p.in_combine && rank == p.me ? own_probs[slot] : 1.f;
        if (!kCombine && p.d_probs && slot_lane && range == 0) {
          float g = 0.f;
          if (rank == p.me) g = p.d_recv_probs ? p.d_recv_probs[row] : 0.f;
          else if (rank >= 0) g = region<float>(local_slice(p, rank, p.reg.ret, k_slice), 0)[slot];
          p.d_probs[slot] = g;
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
              GatherItem{local_slice(p, lane, p.reg.stage, stage_slice) + std::size_t(t) * row_bytes, 1.f, 0};
        }
        __syncwarp();
        const int total = __popc(remote) + own, own_end = own > 0 ? below + own : -1;
        char* out = static_cast<char*>(p.tok_dst) + std::size_t(t) * row_bytes;
        store_listed_sum<Elem>(out, items, total, own_end, land, parts.begin(range), parts.begin(range + 1));
        __syncwarp();  // the list is rewritten for the next token
      }
    }
  }
  if (tr.on()) {
    const unsigned long long now = global_ns();
    tr.finish(now, now);
  }
}

}  // namespace moerail::ep
