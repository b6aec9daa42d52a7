// src/experts/setup.cu — the per-pass device setup kernel and the zero-fill of empty experts' weight gradients.
#include "experts/setup.h"

#include <algorithm>
#include <cub/block/block_radix_sort.cuh>

#include "core/cuda_check.h"
#include "core/device_utils.cuh"
#include "moerail/error.h"

namespace moerail::experts {
namespace {

constexpr int kSetupThreads = 256;
constexpr int kMaxL = 1024;  // moerail::kMaxLocalExperts
constexpr int kExpertsPerThread = kMaxL / kSetupThreads;  // the walk's sort: every expert is one thread's item
static_assert(kExpertsPerThread * kSetupThreads == kMaxL);
using WalkSort = cub::BlockRadixSort<unsigned, kSetupThreads, kExpertsPerThread, int>;

__device__ __forceinline__ const void* operand_ptr(const OperandSetup& o, const PerExpertTables* tables,
                                                   std::int64_t start, int e) {
  if (o.table >= 0) return tables->p[o.table][e];
  return o.base + start * o.row_bytes + std::int64_t(e) * o.expert_bytes;
}

__device__ __forceinline__ int gemm_dim(int fixed, std::int64_t rows) { return fixed == kRagged ? int(rows) : fixed; }

// out[e] = in[0] + ... + in[e - 1] for e <= L, by warp 0, 32 experts per step (a fixed order: deterministic).
__device__ void exclusive_scan(const std::int64_t* in, std::int64_t* out, int L) {
  if (threadIdx.x >= cuda::kWarp) return;
  const int lane = threadIdx.x;
  std::int64_t carry = 0;
  for (int base = 0; base < L; base += cuda::kWarp) {
    const int e = base + lane;
    const std::int64_t v = cuda::warp_inclusive_scan<std::int64_t>(e < L ? in[e] : 0);
    if (e < L) out[e] = carry + v - in[e];
    carry += __shfl_sync(cuda::kFullMask, v, cuda::kWarp - 1);
  }
  if (lane == 0) out[L] = carry;
}

// Region `chunk`'s counts into s_count, negative read as 0, clipped to the rows (so that no scan overflows).
__device__ void load_counts(const SetupParams& p, int chunk, std::int64_t* s_count) {
  const std::int64_t first = std::int64_t(chunk) * p.L;
  for (int e = threadIdx.x; e < p.L; e += blockDim.x) {
    const std::int64_t c = p.counts_i64 ? static_cast<const std::int64_t*>(p.counts)[first + e]
                                        : std::int64_t(static_cast<const std::int32_t*>(p.counts)[first + e]);
    s_count[e] = c < 0 ? 0 : (c > p.rows ? p.rows : c);
  }
}

// Body shared by both kernels below; `tables` is nullptr in the grouped-weights kernel.
__device__ void setup_body(const SetupParams& p, const PerExpertTables* tables) {
  __shared__ std::int64_t s_count[kMaxL];
  __shared__ std::int64_t s_start[kMaxL + 1];
  __shared__ std::int64_t s_pad[kMaxL + 1];  // pad > 0: padded starts; else the contiguous tiles (2b)
  const int L = p.L;

  // 1. counts, negative read as 0.
  load_counts(p, 0, s_count);
  __syncthreads();

  // 2. segment starts: exclusive scan clipped to the buffer rows; with pad, also the padded starts.
  exclusive_scan(s_count, s_start, L);
  __syncthreads();
  if (p.pad > 0) {
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
      const std::int64_t n = min(s_start[e + 1], p.rows) - min(s_start[e], p.rows);
      s_count[e] = (n + p.pad - 1) / p.pad * p.pad;
    }
    __syncthreads();
    exclusive_scan(s_count, s_pad, L);
    __syncthreads();
  }

  // 2b. the contiguous GEMMs' tile table (contig_gemm.h): expert e's clipped segment in tiles of at most 128 rows,
  // its first tile at s_pad[e] (free scratch: padded segments never run contiguously). s_contig_fits: the table
  // holds every expert's tiles and the contiguous GEMM computes them all. (The host sizes the table for every call it
  // gives one to, so it always holds; should it not, no tiles are set and the grouped GEMM computes every expert.)
  __shared__ bool s_contig_fits;
  const bool contig = p.contig.tile_group != nullptr && p.pad == 0;
  if (contig) {
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
      const std::int64_t rows = min(s_start[e + 1], p.rows) - min(s_start[e], p.rows);
      s_count[e] = (rows + kContigTileM - 1) / kContigTileM;  // s_count is free after the scan
    }
    __syncthreads();
    exclusive_scan(s_count, s_pad, L);
    __syncthreads();
    const std::int64_t tiles = s_pad[L];
    const bool fits = tiles <= p.contig.max_tiles;
    for (std::int64_t t = threadIdx.x; fits && t < tiles; t += blockDim.x) {
      const ContigTileEntry c = contig_tile(t, s_pad, s_start, L, p.rows);
      p.contig.tile_group[t] = c.group;
      p.contig.tile_row[t] = c.row;
      p.contig.tile_rows[t] = c.rows;
      p.contig.tile_band[t] = c.band;
    }
    if (threadIdx.x == 0) {
      *p.contig.num_tiles = fits ? int(tiles) : 0;
      s_contig_fits = fits;
    }
    __syncthreads();
  }

  // 3. per expert: clipped segment, offsets, GEMM shapes and pointers, bias pointers.
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    std::int64_t start = s_start[e] < p.rows ? s_start[e] : p.rows;
    std::int64_t end = s_start[e + 1] < p.rows ? s_start[e + 1] : p.rows;
    if (p.pad > 0) {
      start = s_pad[e];
      end = s_pad[e + 1];
    }
    const std::int64_t rows = end - start;
    p.offsets[e] = start;
    if (e == L - 1) {
      p.offsets[L] = end;
      if (p.rows_used) *p.rows_used = int(end);
    }

    for (int g = 0; g < p.num_gemms; ++g) {
      const GemmSetup& s = p.gemm[g];
      // An empty segment is an empty group ({0,0,0}: no tiles), never a K = 0 GEMM, whose accumulators CUTLASS's
      // SM90 mainloop would leave unset; wgrad zeroes those experts' gradients separately (launch_zero_empty).
      const bool in_contig = contig && s.contig && s_contig_fits;  // computed by the contiguous GEMM
      s.arrays.shapes[e] = rows == 0 || in_contig
                               ? GroupShape{0, 0, 0}
                               : GroupShape{gemm_dim(s.m, rows), gemm_dim(s.n, rows), gemm_dim(s.k, rows)};
      s.arrays.ptr_a[e] = operand_ptr(s.a, tables, start, e);
      s.arrays.ptr_b[e] = operand_ptr(s.b, tables, start, e);
      s.arrays.ptr_d[e] = const_cast<void*>(operand_ptr(s.d, tables, start, e));
      if (s.ptr_sfa) s.ptr_sfa[e] = operand_ptr(s.sfa, tables, start, e);
      if (s.ptr_sfb) s.ptr_sfb[e] = operand_ptr(s.sfb, tables, start, e);
      if (s.ld_a != 0) s.arrays.ld_a[e] = s.ld_a == kRagged ? rows : s.ld_a;
      if (s.ld_b != 0) s.arrays.ld_b[e] = s.ld_b == kRagged ? rows : s.ld_b;
      if (s.ld_d != 0) s.arrays.ld_d[e] = s.ld_d == kRagged ? rows : s.ld_d;
      if (s.alpha) s.alpha[e] = s.alpha_a[s.alpha_a_per_expert ? e : 0] * s.alpha_b[s.alpha_b_per_expert ? e : 0];
    }
    for (const PointerSetup& ps : p.ptrs)
      if (ps.out) ps.out[e] = operand_ptr(ps.src, tables, start, e);
  }

  // 4. the other regions' segment starts (chunked weight gradients), clipped to their region.
  for (int chunk = 1; chunk < p.chunks; ++chunk) {
    __syncthreads();  // the previous region's scan is read
    load_counts(p, chunk, s_count);
    __syncthreads();
    exclusive_scan(s_count, s_start, L);
    __syncthreads();
    std::int64_t* offsets = p.offsets + std::int64_t(chunk) * (L + 1);
    const std::int64_t first = std::int64_t(chunk) * p.rows;
    for (int e = threadIdx.x; e <= L; e += blockDim.x) offsets[e] = first + min(s_start[e], p.rows);
  }

  // 5. the contiguous weight gradient's walk: expert e's place is the number of experts before it (more k-tiles,
  // or as many and a lower index), i.e. its index after a stable descending sort by k-tiles. The block sorts
  // (expert, k-tiles) pairs by radix, item i of thread t being expert t * kExpertsPerThread + i (experts past L
  // have 0 k-tiles and come after every expert of 0, so they take the places from L on). The offsets written
  // above are read back (a block's global writes are visible to the block after a barrier).
  if (p.wgrad_places != nullptr) {
    constexpr int kTileK = kContigWgradTileK;
    __shared__ typename WalkSort::TempStorage s_sort;
    __syncthreads();
    unsigned keys[kExpertsPerThread];
    int experts[kExpertsPerThread];
    for (int i = 0; i < kExpertsPerThread; ++i) {
      const int e = threadIdx.x * kExpertsPerThread + i;
      std::int64_t k_tiles = 0;
      for (int chunk = 0; e < L && chunk < p.chunks; ++chunk) {
        const std::int64_t* offsets = p.offsets + std::int64_t(chunk) * (L + 1);
        k_tiles += (offsets[e + 1] - offsets[e] + kTileK - 1) / kTileK;
      }
      if (e < L) s_count[e] = k_tiles;
      keys[i] = unsigned(k_tiles);  // at most rows / kTileK per region (host-checked 32-bit rows)
      experts[i] = e;
    }
    WalkSort(s_sort).SortDescendingBlockedToStriped(keys, experts);
    for (int i = 0; i < kExpertsPerThread; ++i) {
      const int place = i * kSetupThreads + threadIdx.x, e = experts[i];  // striped: consecutive threads, places
      if (place >= L) continue;
      const int start = int(p.offsets[e]), rows = int(p.offsets[e + 1]) - start;  // region 0 (32-bit: host-checked)
      const int seg_k_tiles = (rows + kTileK - 1) / kTileK;
      ContigWgradPlace w;
      w.expert = e;
      w.k_tiles = int(keys[i]);
      w.tail = rows > 0 ? rows - (seg_k_tiles - 1) * kTileK : 0;
      p.wgrad_places[place] = w;
      p.wgrad_segments[place] = {start, rows > 0 ? seg_k_tiles : 0};
    }
    __syncthreads();  // s_count is read below
    if (threadIdx.x < cuda::kWarp) {  // the k-tiles of all places, by warp 0 (a fixed order)
      std::int64_t sum = 0;
      for (int e = threadIdx.x; e < L; e += cuda::kWarp) sum += s_count[e];
      sum = cuda::warp_inclusive_scan(sum);
      if (threadIdx.x == cuda::kWarp - 1) *p.wgrad_k_tiles = int(sum);
    }
  }
}

__global__ void __launch_bounds__(kSetupThreads) setup_kernel(SetupParams p) { setup_body(p, nullptr); }

__global__ void __launch_bounds__(kSetupThreads) setup_per_expert_kernel(SetupParams p, PerExpertTables t) {
  setup_body(p, &t);
}

// grid (blocks, L): block row e zeroes expert e's gradients if its segment is empty, 16 bytes per store.
__global__ void zero_empty_kernel(ZeroEmptyParams p) {
  const int e = blockIdx.y;
  if (p.offsets[e + 1] != p.offsets[e]) return;
  for (int i = 0; i < p.num; ++i) {
    uint4* d = static_cast<uint4*>(p.ptr_d[i][e]);
    const std::int64_t n = p.bytes[i] / 16;  // sizes are multiples of 16 bytes (H, F multiples of 8)
    for (std::int64_t j = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; j < n;
         j += std::int64_t(gridDim.x) * blockDim.x)
      d[j] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

void launch_setup(const SetupParams& params, const PerExpertTables* tables, cudaStream_t stream) {
  if (params.L < 1 || params.L > kMaxL) fail_with(ErrorCode::Internal, "experts setup", "L = ", params.L);
  if (params.chunks < 1 || (params.chunks > 1 && (params.pad > 0 || params.contig.tile_group)))
    fail_with(ErrorCode::Internal, "experts setup", "chunks = ", params.chunks, " (pad ", params.pad,
              ", a tile table: ", params.contig.tile_group != nullptr, ")");
  if (params.contig.tile_group && params.pad > 0)
    fail_with(ErrorCode::Internal, "experts setup", "a contiguous tile table with padded segments (pad ", params.pad,
              ")");
  if (tables)
    setup_per_expert_kernel<<<1, kSetupThreads, 0, stream>>>(params, *tables);
  else
    setup_kernel<<<1, kSetupThreads, 0, stream>>>(params);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

void launch_zero_empty(const ZeroEmptyParams& params, cudaStream_t stream) {
  // Enough blocks per expert to zero a large expert quickly, few enough that non-empty experts cost nothing.
  const dim3 grid(unsigned(std::max(1, cuda::sm_count() / 4)), unsigned(params.L));
  zero_empty_kernel<<<grid, 256, 0, stream>>>(params);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

}  // namespace moerail::experts
