// src/permute/bulk_scatter.cuh — permute_forward on the bulk copy engine (TMA): each warp is a small DMA pipeline.
//
// The SM-issued scatter (permute_kernels.cuh) reads a token's row into registers and stores it K times; measured
// on an H200 it stays at ~83% of the device copy rate however many vectors are in flight, the level of a minimal
// 1-read/8-write probe. Here the SMs issue no data loads or stores at all: lane 0 of each warp runs a ring of
// `stages` shared-memory buffers,
//   load   cp.async.bulk global -> shared of one chunk of a token's row, completion on the stage's mbarrier;
//   store  once it lands, K cp.async.bulk shared -> global stores of that chunk (one bulk group per item);
// and keeps `stages - 1` loads in flight ahead of the item whose stores it is issuing. A stage is reloaded only
// after the bulk group that read it has finished reading shared memory (cp.async.bulk.wait_group.read 1: every
// group but the newest). Rows longer than kMaxChunkBytes are split into equal chunks (multiples of 16 bytes),
// so one item is (token, chunk). Probs are scattered by the lanes that hold the slots, as in the SM path; pad
// rows are zeroed with ordinary 16-byte stores after the warp's last item, while its bulk stores drain.
//
// Requirements (checked by the launcher): row bytes a multiple of 16, x and recv 16-byte aligned.
// Persistent like every permute kernel: the grid depends on T_max and the device only, the token count is read
// on the device, so a captured graph replays with any T.
#pragma once

#include <cstdint>

#include "core/device_utils.cuh"
#include "permute/permute_kernels.cuh"

namespace moerail::permute_detail {

constexpr int kBulkWarps = 2;              // independent pipelines per block
constexpr int kMaxChunkBytes = 16384;      // largest bulk copy of one item
constexpr int kMaxStages = 8;              // per warp
constexpr int kStageBudgetBytes = 48 << 10;  // shared memory per warp's ring (2 blocks of 2 warps per SM fit)
// Rows shorter than this go to the SM path: one bulk copy per 16..511 bytes costs more than it moves.
constexpr long long kBulkMinRowBytes = 512;

struct BulkScatterParams {
  const char* src;                         // [T_max, row_bytes]
  const float* probs;                      // [T_max, K] or null
  const std::int32_t* num_tokens;          // [1]
  const std::int32_t* dest_row;            // [T_max, K]
  const std::int32_t* tokens_per_expert;   // [E]
  const std::int32_t* segment_offset;      // [E + 1]
  const std::int32_t* pad_prefix;          // [E + 1]
  char* dst;                               // [capacity, row_bytes]
  float* dst_probs;                        // [capacity] or null
  long long row_bytes;
  int chunk_bytes;                         // every chunk but the last; multiple of 16
  int chunks;                              // per row
  int stages;                              // ring depth per warp, 2..kMaxStages
  int t_max, K, E, capacity;
};

// Chunking and ring depth of a row size (one place; the launcher sizes shared memory from it).
struct BulkShape {
  int chunk_bytes, chunks, stages;
  std::size_t smem_bytes() const {
    return std::size_t(kBulkWarps) * stages * (std::size_t(chunk_bytes) + 8) + 128;
  }
};

// Chunks are at most kMaxChunkBytes, so the budget holds at least 2 of them and a ring never exceeds it.
static_assert(kStageBudgetBytes >= 2 * kMaxChunkBytes);
constexpr std::size_t kBulkMaxSmemBytes = std::size_t(kBulkWarps) * (kStageBudgetBytes + kMaxStages * 8) + 128;

inline BulkShape bulk_shape(long long row_bytes) {
  BulkShape s{};
  s.chunks = int((row_bytes + kMaxChunkBytes - 1) / kMaxChunkBytes);
  s.chunk_bytes = int(((row_bytes + s.chunks - 1) / s.chunks + 15) / 16 * 16);
  const int fit = kStageBudgetBytes / s.chunk_bytes;
  s.stages = fit < 2 ? 2 : (fit > kMaxStages ? kMaxStages : fit);
  return s;
}

// ---- PTX wrappers of the bulk copy engine and mbarriers (sm_90) ---------------------------------------------------

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(std::uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, std::uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, std::uint32_t bytes, std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void bulk_store(void* gmem, const void* smem, std::uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem), "r"(smem_addr(smem)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Every bulk group but the newest has finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read_all_but_newest() {
  asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}

// Every bulk group of this thread is complete (its writes done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// ---- the kernel -----------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kBulkWarps * 32) bulk_scatter_kernel(BulkScatterParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const long long gwarp = (long long)blockIdx.x * kBulkWarps + warp;
  const long long nwarps = (long long)gridDim.x * kBulkWarps;
  const int S = p.stages;
  // Layout: [kBulkWarps * S mbarriers][pad to 128][kBulkWarps * S stages of chunk_bytes].
  std::uint64_t* bars = reinterpret_cast<std::uint64_t*>(smem_raw) + warp * S;
  unsigned char* ring = smem_raw + ((std::size_t(kBulkWarps) * S * 8 + 127) / 128) * 128 +
                        std::size_t(warp) * S * p.chunk_bytes;
  auto stage = [&](long long j) { return ring + std::size_t(j % S) * p.chunk_bytes; };

  const int n_tok = cuda::load_token_count(p.num_tokens, p.t_max);
  const long long n_items = (long long)n_tok * p.chunks;
  auto item_of = [&](long long j) { return gwarp + j * nwarps; };
  auto chunk_size = [&](int c) {
    return std::uint32_t(c + 1 < p.chunks ? p.chunk_bytes : p.row_bytes - (long long)c * p.chunk_bytes);
  };
  // Lane 0: start the load of the warp's j-th item into its stage.
  auto load = [&](long long j) {
    const long long id = item_of(j);
    const long long t = id / p.chunks;
    const int c = int(id % p.chunks);
    const std::uint32_t bytes = chunk_size(c);
    mbar_expect_tx(&bars[j % S], bytes);
    bulk_load(stage(j), p.src + t * p.row_bytes + (long long)c * p.chunk_bytes, bytes, &bars[j % S]);
  };

  if (lane == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&bars[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the bulk copy engine
    for (long long j = 0; j < S - 1 && item_of(j) < n_items; ++j) load(j);
  }
  __syncwarp();

  for (long long j = 0; item_of(j) < n_items; ++j) {
    const long long id = item_of(j);
    const long long t = id / p.chunks;
    const int c = int(id % p.chunks);
    int d = -1;
    if (lane < p.K) {
      d = slot_row(p.dest_row, t * p.K + lane, p.capacity);
      if (c == 0 && d >= 0 && p.dst_probs != nullptr) p.dst_probs[d] = p.probs != nullptr ? p.probs[t * p.K + lane] : 1.0f;
    }
    if (lane == 0) mbar_wait(&bars[j % S], std::uint32_t((j / S) & 1));
    const std::uint32_t bytes = chunk_size(c);
    for (int k = 0; k < p.K; ++k) {
      const int dk = __shfl_sync(kFullMask, d, k);
      if (lane == 0 && dk >= 0) bulk_store(p.dst + (long long)dk * p.row_bytes + (long long)c * p.chunk_bytes, stage(j), bytes);
    }
    if (lane == 0) {
      bulk_commit();
      // Stage (j + S - 1) % S held item j - 1, whose group is the one before the newest.
      if (item_of(j + S - 1) < n_items) {
        bulk_wait_read_all_but_newest();
        load(j + S - 1);
      }
    }
  }

  // Pad rows: zeros, prob 0, by the whole warp while the bulk stores drain.
  using V = cuda::Vec<std::uint32_t, 16>;
  const long long pads = p.pad_prefix[p.E];
  const long long nvec = p.row_bytes / 16;
  for (long long item = gwarp; item < pads; item += nwarps) {
    const int row = pad_row_of(p.pad_prefix, p.segment_offset, p.tokens_per_expert, p.E, int(item));
    if (row < 0 || row >= p.capacity) continue;
    zero_row(reinterpret_cast<V*>(p.dst + (long long)row * p.row_bytes), nvec, lane);
    if (lane == 0 && p.dst_probs != nullptr) p.dst_probs[row] = 0.0f;
  }
  if (lane == 0) bulk_wait_all();
}

}  // namespace moerail::permute_detail
