// quantize_fp8_transposed (include/moerail/quant.h): bf16 x [rows, C] in expert-major segments -> per expert a
// compact [C, R_e] e4m3 block and its [C, R_e / 128] 1x128 scales along the rows, the K-major operands of the FP8
// weight-gradient GEMM.
//
// Work item: 128 rows (one scale block of one segment) x 64 columns. The CTA loads the bf16 tile with 16-byte row
// loads into shared memory (rows past the segment as zeros), four warps then walk it column-wise (a warp's lanes
// read 32 neighbouring columns of one row: conflict-free), each thread holding 32 rows of one column; the four
// partial amaxes of a column meet in shared memory, every thread encodes its 32 values with the block's reciprocal
// scale and parks the 32 codes in a transposed shared tile, which is written out as 128-byte column runs.
// Persistent grid over the items; each CTA scans the device counts itself (L <= 1024), so nothing is read on the host.
// The arithmetic is the reference's (src/reference/quant.cpp) operation for operation, as in quant_kernels.cuh.
#include <cuda_bf16.h>

#include <string_view>

#include "core/cuda_check.h"
#include "moerail/error.h"
#include "moerail/experts.h"  // kMaxLocalExperts
#include "moerail/quant.h"
#include "quant/quant_kernels.cuh"

namespace moerail {
namespace {

using namespace quant_detail;

constexpr int kRowsT = 128;  // rows per item: one scale block
constexpr int kColsT = 64;   // columns per item
constexpr int kThreadsT = 256;
constexpr int kParts = kThreadsT / kColsT;  // threads per column: 4, each 32 rows
constexpr int kRowsPerPart = kRowsT / kParts;
constexpr int kMaxL = int(kMaxLocalExperts);  // one CTA scans every expert's count into shared memory

struct TransposedParams {
  const __nv_bfloat16* x;  // [rows, C]
  const void* counts;      // [L] i32 / i64
  bool counts_i64;
  int L;
  long long rows, C;
  std::uint8_t* qt;
  float* qt_scales;
};

__global__ void __launch_bounds__(kThreadsT) quantize_transposed_kernel(TransposedParams p) {
  __shared__ long long s_start[kMaxL + 1];  // clipped segment starts in x
  __shared__ long long s_pad[kMaxL + 1];    // P_e: starts of the 128-padded segments
  __shared__ __align__(16) __nv_bfloat16 tile[kRowsT][kColsT + 8];  // +16 bytes per row keeps 16-byte alignment
  __shared__ float s_amax[kParts][kColsT];
  __shared__ uint4 codes[kColsT][kRowsT / 16 + 1];  // one column's 128 codes per row (+1: no bank conflicts)

  // 1. clipped starts and padded starts, by warp 0 in expert order (32 experts per step)
  if (threadIdx.x < kWarp) {
    const int lane = int(threadIdx.x);
    long long carry = 0, carry_pad = 0;
    for (int base = 0; base < p.L; base += kWarp) {
      const int e = base + lane;
      long long c = 0;
      if (e < p.L)
        c = p.counts_i64 ? static_cast<const long long*>(p.counts)[e]
                         : (long long)static_cast<const std::int32_t*>(p.counts)[e];
      c = c < 0 ? 0 : (c > p.rows ? p.rows : c);
      const long long v = cuda::warp_inclusive_scan(c);
      // the clipped start of e + 1 bounds e's rows; padded sizes follow from the clipped ones
      const long long end = min(carry + v, p.rows), begin = min(carry + v - c, p.rows);
      const long long padded = (end - begin + kRowsT - 1) / kRowsT * kRowsT;
      const long long w = cuda::warp_inclusive_scan(padded);
      if (e < p.L) {
        s_start[e] = begin;
        s_pad[e] = carry_pad + w - padded;
      }
      carry += __shfl_sync(kFullMask, v, kWarp - 1);
      carry_pad += __shfl_sync(kFullMask, w, kWarp - 1);
    }
    if (lane == 0) {
      s_start[p.L] = min(carry, p.rows);
      s_pad[p.L] = carry_pad;
    }
  }
  __syncthreads();

  const long long col_tiles = p.C / kColsT;
  const long long items = s_pad[p.L] / kRowsT * col_tiles;
  const int col = int(threadIdx.x) % kColsT, part = int(threadIdx.x) / kColsT;
  for (long long item = blockIdx.x; item < items; item += gridDim.x) {
    const long long prow = item / col_tiles * kRowsT;  // first padded row of the block
    const long long c0 = item % col_tiles * kColsT;
    int lo = 0, hi = p.L - 1;  // the expert e with s_pad[e] <= prow < s_pad[e + 1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_pad[mid] <= prow) lo = mid;
      else hi = mid - 1;
    }
    const int e = lo;
    const long long in_seg = prow - s_pad[e];                 // row of the block inside the segment
    const long long first = s_start[e] + in_seg;              // its first row in x
    const long long valid = min((long long)kRowsT, s_start[e + 1] - first);
    const long long R = s_pad[e + 1] - s_pad[e];

    // 2. the bf16 tile, 8 16-byte vectors per row
    for (int i = int(threadIdx.x); i < kRowsT * kColsT / 8; i += kThreadsT) {
      const int r = i / (kColsT / 8), v = i % (kColsT / 8);
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < valid) val = *reinterpret_cast<const uint4*>(p.x + (first + r) * p.C + c0 + v * 8);
      *reinterpret_cast<uint4*>(&tile[r][v * 8]) = val;
    }
    __syncthreads();

    // 3. amax of each column over the 128 rows, then its codes
    float x[kRowsPerPart];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowsPerPart; ++i) {
      x[i] = __bfloat162float(tile[part * kRowsPerPart + i][col]);
      amax = fmaxf(amax, fabsf(x[i]));
    }
    s_amax[part][col] = amax;
    __syncthreads();
    amax = fmaxf(fmaxf(s_amax[0][col], s_amax[1][col]), fmaxf(s_amax[2][col], s_amax[3][col]));
    const float scale = block_scale_from_amax(amax), inv = 1.0f / scale;
    if (part == 0) p.qt_scales[p.C * s_pad[e] / kRowsT + (c0 + col) * (R / kRowsT) + in_seg / kRowsT] = scale;
#pragma unroll
    for (int h = 0; h < kRowsPerPart / 16; ++h) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = x[h * 16 + i];
      codes[col][part * (kRowsPerPart / 16) + h] = encode16(v, inv);
    }
    __syncthreads();

    // 4. 128 codes per column, contiguous in qt_e's row c0 + col
    std::uint8_t* out = p.qt + p.C * s_pad[e] + in_seg;
    for (int i = int(threadIdx.x); i < kColsT * kRowsT / 16; i += kThreadsT) {
      const int c = i / (kRowsT / 16), v = i % (kRowsT / 16);
      *reinterpret_cast<uint4*>(out + (c0 + c) * R + v * 16) = codes[c][v];
    }
    __syncthreads();  // tile, s_amax and codes are reused by the next item
  }
}

}  // namespace

void quantize_fp8_transposed(const QuantizeTransposedArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "quantize_fp8_transposed";
  const Device dev = Device::cuda(cuda::current_device());
  if (!a.x.defined()) fail(op, "x is absent but required");
  check_device(op, "x", a.x, dev);
  check_shape(op, "x", a.x, {-1, -1});
  check_dtype(op, "x", a.x, {DType::BF16});
  if (!a.counts.defined()) fail(op, "counts is absent but required");
  check_device(op, "counts", a.counts, dev);
  check_shape(op, "counts", a.counts, {-1});
  check_dtype(op, "counts", a.counts, {DType::I32, DType::I64});
  const std::int64_t rows = a.x.size(0), C = a.x.size(1), L = a.counts.size(0);
  if (L < 1 || L > kMaxL) fail(op, "counts has ", L, " experts but 1 <= L <= ", kMaxL, " are supported");
  if (C <= 0 || C % kColsT != 0)
    fail(op, "x has shape ", a.x.shape_str(), " but its columns C = ", C, " must be a positive multiple of ", kColsT,
         " (64-column tiles)");
  const std::int64_t rows_t = fp8_transposed_rows(rows, L);
  if (!a.qt.defined()) fail(op, "qt is absent but required");
  check_device(op, "qt", a.qt, dev);
  check_shape(op, "qt", a.qt, {C * rows_t});
  check_dtype(op, "qt", a.qt, {DType::F8E4M3});
  if (!a.qt_scales.defined()) fail(op, "qt_scales is absent but required");
  check_device(op, "qt_scales", a.qt_scales, dev);
  check_shape(op, "qt_scales", a.qt_scales, {C * rows_t / kBlockScaleCols});
  check_dtype(op, "qt_scales", a.qt_scales, {DType::F32});
  for (const char* name : {"x", "qt"}) {
    const TensorView& v = name[0] == 'x' ? a.x : a.qt;
    if (!cuda::aligned16(v.data()))
      fail_with(ErrorCode::Unsupported, op, name, " at address ", v.data(),
                " is not 16-byte aligned (the kernel moves 16-byte vectors)");
  }
  if (rows == 0) return;

  TransposedParams p{};
  p.x = a.x.as<const __nv_bfloat16>();
  p.counts = a.counts.data();
  p.counts_i64 = a.counts.dtype() == DType::I64;
  p.L = int(L);
  p.rows = rows;
  p.C = C;
  p.qt = a.qt.as<std::uint8_t>();
  p.qt_scales = a.qt_scales.as<float>();
  static const int blocks_per_sm = [] {
    int n = 0;
    MOERAIL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, quantize_transposed_kernel, kThreadsT, 0));
    return n > 0 ? n : 1;
  }();
  const long long most_items = rows_t / kRowsT * (C / kColsT);  // items for any counts
  const int grid = int(cuda::persistent_grid(most_items, blocks_per_sm));
  if (grid == 0) return;
  quantize_transposed_kernel<<<grid, kThreadsT, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

}  // namespace moerail
