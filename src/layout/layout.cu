// The layout planner on one GPU (include/moerail/layout.h). Three or four launches, no host synchronization:
//
//   1. count     each warp owns a chunk of kChunk consecutive (t,k) slots and histograms its expert ids in shared
//                memory (integer atomics: counting only, so the counts are exact); writes counts[e][chunk].
//   2. scan      exclusive sum over counts in expert-major order: offsets[e][c] = rows of all earlier experts + rows
//                of expert e in earlier chunks (rows before padding). Up to kFusedScanMax counts the finalize block
//                scans them itself, first (cheaper at the sizes of a training step); beyond, cub::DeviceScan::
//                ExclusiveSum runs it (two launches of its own).
//   3. finalize  one block: tokens_per_expert, padded counts, segment offsets, pad prefix, clipped segment rows,
//                rows used, overflow -> status (cub::BlockScan / BlockReduce, fixed order).
//   4. assign    each warp walks its chunk again in slot order; __match_any_sync ranks the lanes of equal experts,
//                so row(t,k) = segment start + offsets[e][c] + earlier slots of e in the chunk: exactly the order
//                (expert, token, k) of the reference, deterministic whatever the timing.
// Bytes moved: topk_idx read twice (4 B * T * K each), dest_row written once (4 B * T * K), plus E * chunks * 12 B
// of counts/offsets and O(E) for the per-expert arrays.
#include "moerail/layout.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>

#include <limits>

#include "core/cuda_check.h"
#include "core/device_utils.cuh"
#include "core/status_device.cuh"

namespace moerail {
namespace {

constexpr std::string_view kOp = "plan_layout";
constexpr int kChunk = 512;             // slots per warp chunk: 16 coalesced 128-byte reads of topk_idx
constexpr int kFinalizeThreads = 1024;  // one block scans all E experts, 1024 at a time
constexpr int kFusedScanItems = 16;     // counts per finalize thread when it scans them itself
constexpr std::int64_t kFusedScanMax = std::int64_t(kFinalizeThreads) * kFusedScanItems;
constexpr int kMaxExperts = 8192;       // the per-warp histograms must fit shared memory (32 KB at one warp)

// ---- launch configuration (one place) -------------------------------------------------------------------------

struct LayoutGeometry {
  std::int64_t slots_max = 0;  // T_max * K
  int chunks = 0;              // ceil(slots_max / kChunk)
  int warps_per_block = 1;     // 4 warps share a block while their histograms fit the default 48 KB of smem
  int blocks = 0;              // ceil(chunks / warps_per_block)
  std::size_t smem = 0;        // warps_per_block * E * 4 bytes
};

LayoutGeometry geometry(const MoeConfig& cfg) {
  LayoutGeometry g;
  g.slots_max = cfg.max_tokens * cfg.topk;
  g.chunks = int((g.slots_max + kChunk - 1) / kChunk);
  g.warps_per_block = cfg.num_experts <= 3072 ? 4 : 1;
  g.blocks = (g.chunks + g.warps_per_block - 1) / g.warps_per_block;
  g.smem = std::size_t(g.warps_per_block) * std::size_t(cfg.num_experts) * sizeof(int);
  return g;
}

std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }

std::size_t cub_scan_bytes(int n) {
  std::size_t bytes = 0;
  if (n > 0)
    MOERAIL_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<int*>(nullptr),
                                                     static_cast<int*>(nullptr), n));
  return bytes;
}

// ---- kernels ----------------------------------------------------------------------------------------------------

struct LayoutParams {
  const std::int32_t* topk_idx;  // [T_max * K]
  const float* topk_probs;       // [T_max * K] or null
  const std::int32_t* num_tokens;
  int t_max, E, K, A, capacity, chunks, warps_per_block;
  int expert_cap;   // rows of one expert's segment at most (Capacity::PerExpert, a multiple of A); 0 = no bound
  bool fused_scan;  // E * chunks <= kFusedScanMax: the finalize block computes offsets from counts
  int* counts;    // [E * chunks]
  int* offsets;   // [E * chunks]
  std::int32_t* dest_row;
  std::int32_t* tokens_per_expert;
  std::int32_t* padded_per_expert;
  std::int32_t* segment_offset;
  std::int32_t* segment_rows;
  std::int32_t* pad_prefix;
  std::int32_t* rows_used;
  DeviceStatus* status;
};

// A slot routes iff its id is in [0, E) and (with probs) its prob is finite.
__device__ __forceinline__ bool slot_routes(const LayoutParams& p, int e, float prob) {
  return e >= 0 && e < p.E && isfinite(prob);
}

// A warp's chunk of slots, loaded at once: slot first + j * 32 + lane in e[j] (-1 past the tokens) and its prob in
// prob[j] (0 without probs). All loads are issued before any is used: one memory round trip per chunk instead of
// one per 32 slots (the kernels are latency-bound at the token counts of a training step).
constexpr int kPerLane = kChunk / cuda::kWarp;
__device__ __forceinline__ void load_chunk(const LayoutParams& p, long long first, long long n_slots,
                                           int (&e)[kPerLane], float (&prob)[kPerLane]) {
  const int lane = threadIdx.x % cuda::kWarp;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const long long s = first + j * cuda::kWarp + lane;
    const bool in = s < n_slots;
    e[j] = in ? p.topk_idx[s] : -1;
    prob[j] = in && p.topk_probs != nullptr ? p.topk_probs[s] : 0.f;
  }
}

__global__ void layout_count_kernel(LayoutParams p) {
  cuda::let_next_start();  // the finalize block may be scheduled now; it waits for this grid's end
  extern __shared__ int hist[];  // [warps_per_block][E]
  const int warp = threadIdx.x / cuda::kWarp, lane = threadIdx.x % cuda::kWarp;
  int* h = hist + warp * p.E;
  for (int e = lane; e < p.E; e += cuda::kWarp) h[e] = 0;
  __syncwarp();

  const int T = cuda::load_token_count(p.num_tokens, p.t_max);
  const long long n_slots = (long long)T * p.K;
  const int c = blockIdx.x * p.warps_per_block + warp;
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.status) {
    p.status->num_experts = unsigned(p.E);
    p.status->topk = unsigned(p.K);
  }
  if (c < p.chunks && (long long)c * kChunk < n_slots) {
    const long long first = (long long)c * kChunk;
    int e[kPerLane];
    float prob[kPerLane];
    load_chunk(p, first, n_slots, e, prob);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const long long s = first + j * cuda::kWarp + lane;
      if (s >= n_slots) break;
      if (e[j] < -1 || e[j] >= p.E) {
        cuda::record_bad_expert(p.status, unsigned(s), e[j]);
      } else if (e[j] >= 0) {
        if (!isfinite(prob[j])) cuda::record_bad_prob(p.status, unsigned(s), prob[j]);
        else atomicAdd(&h[e[j]], 1);
      }
    }
  }
  __syncthreads();
  // counts[e][c]: the block's warps write their chunks side by side (warps_per_block consecutive ints per e).
  for (int i = threadIdx.x; i < p.E * p.warps_per_block; i += blockDim.x) {
    const int e = i / p.warps_per_block, w = i % p.warps_per_block;
    const int cw = blockIdx.x * p.warps_per_block + w;
    if (cw < p.chunks) p.counts[(long long)e * p.chunks + cw] = hist[w * p.E + e];
  }
}

// offsets = the exclusive sum of counts (n <= kFusedScanMax), by one block: thread i sums its kFusedScanItems
// consecutive counts, the block scans those sums, and each thread writes its offsets from its sum's prefix.
template <typename Scan>
__device__ void scan_counts(const LayoutParams& p, long long n, typename Scan::TempStorage& tmp) {
  const long long first = (long long)threadIdx.x * kFusedScanItems;
  int c[kFusedScanItems];
  int sum = 0;
#pragma unroll
  for (int j = 0; j < kFusedScanItems; ++j) {
    c[j] = first + j < n ? p.counts[first + j] : 0;
    sum += c[j];
  }
  int before;
  Scan(tmp).ExclusiveSum(sum, before);
#pragma unroll
  for (int j = 0; j < kFusedScanItems; ++j) {
    if (first + j < n) p.offsets[first + j] = before;
    before += c[j];
  }
  __syncthreads();  // the block's global writes are visible to the block after the barrier
}

__global__ void __launch_bounds__(kFinalizeThreads) layout_finalize_kernel(LayoutParams p) {
  using Scan = cub::BlockScan<int, kFinalizeThreads>;
  using Reduce = cub::BlockReduce<int, kFinalizeThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  cuda::let_next_start();
  cuda::wait_for_previous();  // launched after the count kernel (launch_after_previous)
  if (p.fused_scan) scan_counts<Scan>(p, (long long)p.E * p.chunks, tmp.scan);
  __shared__ int carry_padded, carry_pad, fullest;
  if (threadIdx.x == 0) {
    carry_padded = 0;
    carry_pad = 0;
    fullest = 0;
  }
  int overflow = 0;  // this thread's share
  for (int base = 0; base < p.E; base += kFinalizeThreads) {
    __syncthreads();
    const int e = base + threadIdx.x;
    int tpe = 0;
    if (e < p.E && p.chunks > 0) {
      const long long last = (long long)e * p.chunks + p.chunks - 1;
      tpe = p.offsets[last] + p.counts[last] - p.offsets[(long long)e * p.chunks];
    }
    const int padded = e < p.E ? (tpe + p.A - 1) / p.A * p.A : 0;
    // the expert's segment and the routed rows it keeps (Capacity::PerExpert: at most expert_cap of each)
    const int seg = p.expert_cap > 0 && padded > p.expert_cap ? p.expert_cap : padded;
    const int kept = p.expert_cap > 0 && tpe > p.expert_cap ? p.expert_cap : tpe;
    if (e < p.E && padded > 0) atomicMax(&fullest, padded);
    int off, pad_off, tile_padded, tile_pad;
    Scan(tmp.scan).ExclusiveSum(seg, off, tile_padded);
    __syncthreads();
    Scan(tmp.scan).ExclusiveSum(seg - kept, pad_off, tile_pad);
    off += carry_padded;
    pad_off += carry_pad;
    if (e < p.E) {
      p.tokens_per_expert[e] = tpe;
      p.padded_per_expert[e] = padded;
      p.segment_offset[e] = off;
      p.pad_prefix[e] = pad_off;
      const int room = p.capacity - off;  // rows of the buffer from the segment start on
      const int inside = room <= 0 ? 0 : (room < seg ? room : seg);
      p.segment_rows[e] = inside;
      // Routed rows occupy [off, off + tpe); those past the segment's rows inside the buffer are dropped.
      overflow += tpe - (tpe < inside ? tpe : inside);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry_padded += tile_padded;
      carry_pad += tile_pad;
    }
  }
  __syncthreads();
  const int total_overflow = Reduce(tmp.reduce).Sum(overflow);
  if (threadIdx.x == 0) {
    const int needed = carry_padded;
    p.segment_offset[p.E] = needed;
    p.pad_prefix[p.E] = carry_pad;
    *p.rows_used = needed < p.capacity ? needed : p.capacity;
    if (p.status) {  // under Capacity::PerExpert the fullest expert's rows and one expert's
      atomicMax(&p.status->rows_needed, unsigned(p.expert_cap > 0 ? fullest : needed));
      p.status->rows_available = unsigned(p.expert_cap > 0 ? p.expert_cap : p.capacity);
      if (total_overflow > 0) atomicAdd(&p.status->overflow_rows, unsigned(total_overflow));
    }
  }
}

__global__ void layout_assign_kernel(LayoutParams p) {
  cuda::let_next_start();     // a caller's next kernel launched with launch_after_previous (the EP planner)
  cuda::wait_for_previous();  // launched after the finalize block
  extern __shared__ int next_row[];  // [warps_per_block][E]: next row of expert e for the warp's chunk
  const int warp = threadIdx.x / cuda::kWarp, lane = threadIdx.x % cuda::kWarp;
  for (int i = threadIdx.x; i < p.E * p.warps_per_block; i += blockDim.x) {
    const int e = i / p.warps_per_block, w = i % p.warps_per_block;
    const int cw = blockIdx.x * p.warps_per_block + w;
    if (cw < p.chunks)  // the segment's start plus the expert's slots in the chunks before this warp's
      next_row[w * p.E + e] = p.segment_offset[e] + p.offsets[(long long)e * p.chunks + cw] -
                              p.offsets[(long long)e * p.chunks];
  }
  __syncthreads();

  const int T = cuda::load_token_count(p.num_tokens, p.t_max);
  const long long n_slots = (long long)T * p.K;
  const int c = blockIdx.x * p.warps_per_block + warp;
  if (c >= p.chunks) return;
  int* h = next_row + warp * p.E;
  const unsigned lower_lanes = (1u << lane) - 1u;
  const long long first = (long long)c * kChunk;
  if (first >= n_slots) return;
  int ev[kPerLane];
  float prob[kPerLane];
  load_chunk(p, first, n_slots, ev, prob);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int i = j * cuda::kWarp;
    if (first + i >= n_slots) break;  // warp-uniform
    const long long s = first + i + lane;
    const bool active = s < n_slots;
    const int e = ev[j];
    const bool routes = active && slot_routes(p, e, prob[j]);
    // Lanes of the same expert form one group; lanes that do not route get a key of their own.
    const unsigned key = routes ? unsigned(e) : 0x80000000u | unsigned(lane);
    const unsigned peers = __match_any_sync(cuda::kFullMask, key);
    int row = -1;
    if (routes) row = h[e] + __popc(peers & lower_lanes);
    __syncwarp();
    if (routes && lane == 31 - __clz(peers)) h[e] += __popc(peers);
    __syncwarp();
    const bool fits = row < p.capacity && (p.expert_cap == 0 || row - p.segment_offset[e] < p.expert_cap);
    if (active) p.dest_row[s] = (routes && fits) ? row : -1;
  }
}

}  // namespace

// ---- buffers and workspace ------------------------------------------------------------------------------------

std::size_t layout_buffers_bytes(const MoeConfig& cfg) {
  const std::size_t E = std::size_t(cfg.num_experts), i4 = sizeof(std::int32_t);
  return align256(std::size_t(cfg.max_tokens * cfg.topk) * i4) + 3 * align256(E * i4) +
         2 * align256((E + 1) * i4) + align256(i4) + align256(E * i4);
}

LayoutBuffers make_layout_buffers(const MoeConfig& cfg, void* base, int device, std::int64_t capacity) {
  if (base == nullptr) fail("make_layout_buffers", "base is null (expected layout_buffers_bytes(cfg) device bytes)");
  const std::int64_t E = cfg.num_experts;
  char* p = static_cast<char*>(base);
  const Device dev = Device::cuda(device);
  auto take = [&](std::initializer_list<std::int64_t> shape, std::size_t elems) {
    TensorView v(p, DType::I32, shape, dev);
    p += align256(elems * sizeof(std::int32_t));
    return v;
  };
  LayoutBuffers b;
  b.capacity = capacity < 0 ? cfg.rows_per_rank() : capacity;
  b.dest_row = take({cfg.max_tokens, cfg.topk}, std::size_t(cfg.max_tokens * cfg.topk));
  b.tokens_per_expert = take({E}, std::size_t(E));
  b.padded_per_expert = take({E}, std::size_t(E));
  b.segment_offset = take({E + 1}, std::size_t(E + 1));
  b.segment_rows = take({E}, std::size_t(E));
  b.pad_prefix = take({E + 1}, std::size_t(E + 1));
  b.rows_used = take({1}, 1);
  return b;
}

std::size_t layout_workspace_bytes(const MoeConfig& cfg) {
  const LayoutGeometry g = geometry(cfg);
  const std::size_t n = std::size_t(cfg.num_experts) * std::size_t(g.chunks);
  return 2 * align256(n * sizeof(int)) + align256(cub_scan_bytes(int(n)));
}

// ---- launcher ---------------------------------------------------------------------------------------------------

void plan_layout(const MoeConfig& cfg, const LayoutArgs& args, cudaStream_t stream) {
  cfg.validate();
  const std::int64_t E = cfg.num_experts, K = cfg.topk, T_max = cfg.max_tokens, A = cfg.align;
  if (cfg.ep_size != 1)
    fail_with(ErrorCode::Unsupported, kOp, "cfg.ep_size = ", cfg.ep_size,
              " but this planner is the one-GPU planner (expected ep_size = 1; use dispatch for R > 1)");
  if (E > kMaxExperts) fail_with(ErrorCode::Unsupported, kOp, "num_experts = ", E, " but at most ", kMaxExperts, " are supported");
  const LayoutBuffers& o = args.out;
  const std::int64_t C = o.capacity;
  if (C < 0 || C > std::numeric_limits<std::int32_t>::max())
    fail(kOp, "out.capacity = ", C, " but 0 <= capacity < 2^31 rows was expected");
  if (T_max * K + E * (A - 1) >= std::numeric_limits<std::int32_t>::max())
    fail(kOp, "T_max * K + E * (A - 1) = ", T_max * K + E * (A - 1), " rows do not fit i32 row indices");

  const int dev = cuda::current_device();
  const Device d = Device::cuda(dev);
  auto check_i32 = [&](std::string_view name, const TensorView& v, std::initializer_list<std::int64_t> shape) {
    check_shape(kOp, name, v, shape);
    check_dtype(kOp, name, v, {DType::I32});
    check_device(kOp, name, v, d);
  };
  check_i32("topk_idx", args.topk_idx, {T_max, K});
  if (args.topk_probs.defined()) {
    check_shape(kOp, "topk_probs", args.topk_probs, {T_max, K});
    check_dtype(kOp, "topk_probs", args.topk_probs, {DType::F32});
    check_device(kOp, "topk_probs", args.topk_probs, d);
  }
  check_i32("num_tokens", args.num_tokens, {1});
  check_i32("out.dest_row", o.dest_row, {T_max, K});
  check_i32("out.tokens_per_expert", o.tokens_per_expert, {E});
  check_i32("out.padded_per_expert", o.padded_per_expert, {E});
  check_i32("out.segment_offset", o.segment_offset, {E + 1});
  check_i32("out.segment_rows", o.segment_rows, {E});
  check_i32("out.pad_prefix", o.pad_prefix, {E + 1});
  check_i32("out.rows_used", o.rows_used, {1});
  if (args.status == nullptr) fail(kOp, "status is null (expected a DeviceStatus in device memory)");
  check_device(kOp, "workspace", args.workspace, d);
  const std::size_t need = layout_workspace_bytes(cfg);
  if (args.workspace.nbytes() < need)
    fail(kOp, "workspace has ", args.workspace.nbytes(), " bytes but layout_workspace_bytes(cfg) = ", need);

  const LayoutGeometry g = geometry(cfg);
  const std::size_t n = std::size_t(E) * std::size_t(g.chunks);
  char* ws = static_cast<char*>(args.workspace.data());
  LayoutParams p{};
  p.topk_idx = args.topk_idx.as<const std::int32_t>();
  p.topk_probs = args.topk_probs.defined() ? args.topk_probs.as<const float>() : nullptr;
  p.num_tokens = args.num_tokens.as<const std::int32_t>();
  p.t_max = int(T_max);
  p.E = int(E);
  p.K = int(K);
  p.A = int(A);
  p.capacity = int(C);
  p.expert_cap = int(cfg.expert_rows());
  p.chunks = g.chunks;
  p.warps_per_block = g.warps_per_block;
  p.counts = reinterpret_cast<int*>(ws);
  p.offsets = reinterpret_cast<int*>(ws + align256(n * sizeof(int)));
  void* cub_tmp = ws + 2 * align256(n * sizeof(int));
  p.dest_row = o.dest_row.as<std::int32_t>();
  p.tokens_per_expert = o.tokens_per_expert.as<std::int32_t>();
  p.padded_per_expert = o.padded_per_expert.as<std::int32_t>();
  p.segment_offset = o.segment_offset.as<std::int32_t>();
  p.segment_rows = o.segment_rows.as<std::int32_t>();
  p.pad_prefix = o.pad_prefix.as<std::int32_t>();
  p.rows_used = o.rows_used.as<std::int32_t>();
  p.status = args.status;

  const int threads = g.warps_per_block * cuda::kWarp;
  p.fused_scan = std::int64_t(n) <= kFusedScanMax;
  if (g.blocks > 0) {
    layout_count_kernel<<<g.blocks, threads, g.smem, stream>>>(p);
    MOERAIL_CUDA_CHECK_LAUNCH();
    if (!p.fused_scan) {
      std::size_t cub_bytes = cub_scan_bytes(int(n));
      MOERAIL_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(cub_tmp, cub_bytes, p.counts, p.offsets, int(n), stream));
    }
  }
  // finalize and assign may be scheduled while the kernel before them (count, or CUB's scan) ends
  MOERAIL_CUDA_CHECK(
      cuda::launch_after_previous(layout_finalize_kernel, dim3(1), dim3(kFinalizeThreads), 0, stream, p));
  if (g.blocks > 0)
    MOERAIL_CUDA_CHECK(cuda::launch_after_previous(layout_assign_kernel, dim3(g.blocks), dim3(threads), g.smem, stream,
                                                   p));
}

}  // namespace moerail
