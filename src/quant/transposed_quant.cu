// quantize_fp8_transposed (include/moerail/quant.h): x [rows, C] in expert-major segments (bf16, or e4m3 with 1x128
// row scales) -> per expert a compact [C, R_e] e4m3 block and its [C, R_e / 128] 1x128 scales along the rows, the
// K-major operands of the FP8 weight-gradient GEMM; optionally (bf16 x) also the row-wise 1x128 quantization of the
// segment rows, from the same read.
//
// Work item: 128 rows (one scale block of one segment) x kCols columns (64 for a bf16 x; 128 for an FP8 one, whose
// items are half the bytes, and with the row-wise output, whose 1x128 scales must fit in one item). The CTA (4 kCols
// threads) loads the tile into shared memory as bf16, every thread's loads in flight together and the next item's
// issued under this one's arithmetic (rows past the segment as zeros; an FP8 source is dequantized on the way in,
// exactly as dequantize_fp8: float(code) * scale in fp32, rounded once to bf16). Four thread groups then walk it
// column-wise (a warp's lanes read 32 neighbouring columns of one row: conflict-free), each thread reducing the amax
// of 32 rows of one column; meanwhile, with the row-wise output, groups of 16 lanes quantize whole rows of the tile
// (8 columns a lane, the amax by shuffles as in quantize_fp8) straight to q. The four partial amaxes of a column meet
// in shared memory, every thread reads its 32 values again and encodes them with the block's reciprocal scale, the
// codes go into a transposed shared tile over the bf16 one (dead by then) and out as 128-byte column runs.
// Persistent grid over the items; each CTA scans the device counts itself (L <= 1024), so nothing is read on the host.
// The arithmetic is the reference's (src/reference/quant.cpp) operation for operation, as in quant_kernels.cuh.
#include <cuda_bf16.h>

#include <algorithm>
#include <string_view>
#include <type_traits>

#include "core/cuda_check.h"
#include "moerail/error.h"
#include "moerail/experts.h"  // kMaxLocalExperts
#include "moerail/quant.h"
#include "quant/expert_scales.h"  // check_expert_counts
#include "quant/quant_kernels.cuh"

namespace moerail {
namespace {

using namespace quant_detail;

constexpr int kRowsT = 128;  // rows per item: one scale block
constexpr int kParts = 4;    // threads per column, each 32 rows
constexpr int kRowsPerPart = kRowsT / kParts;
constexpr int kMaxL = int(kMaxLocalExperts);  // one CTA scans every expert's count into shared memory

struct TransposedParams {
  const void* x;           // [rows, C] bf16, or e4m3 codes with x_scales
  const float* x_scales;   // [rows, C / 128]: x is e4m3
  const void* counts;      // [L] i32 / i64
  bool counts_i64;
  int L;
  int rows;                // fp8_transposed_rows(rows, L) < 2^31: every row index fits an int
  long long C;
  std::uint8_t* qt;
  float* qt_scales;
  std::uint8_t* q;         // [rows, C]: the row-wise codes (or null)
  float* q_scales;         // [rows, C / 128]
  const float* tensor_scales;  // [L]: the per-tensor form (each segment's one scale; an e4m3 x's codes copied)
};

// One work item: its expert, rows and columns.
struct Item {
  int e = 0, in_seg = 0, first = 0, valid = 0, R = 0;
  long long c0 = 0;
};

// The shared memory of one CTA: the bf16 tile, then (once every thread holds its column) the codes over it.
template <int kCols>
struct TileMemory {
  static constexpr int kPitch = kCols + 8;  // +16 bytes per row keeps 16-byte alignment, spreads the banks
  static constexpr std::size_t kTileBytes = sizeof(__nv_bfloat16) * kRowsT * kPitch;
  static constexpr std::size_t kCodeBytes = sizeof(uint4) * kCols * (kRowsT / 16 + 1);
  static constexpr std::size_t kBytes = kTileBytes > kCodeBytes ? kTileBytes : kCodeBytes;
};

// Occupancy: two CTAs of 512 threads or four of 256 per multiprocessor (at most 64 registers a thread: the next
// item's loads and two vectors of codes are held across the phases).
// kTensor: the per-tensor form (every scale is the segment's tensor_scales[e]; an FP8 source's codes are decoded
// unscaled, exact in bf16, and encoded again with reciprocal 1: the same codes). kE5M2 (per-tensor, bf16 source):
// e5m2 codes.
template <int kCols, bool kFp8Source, bool kRowQ, bool kTensor, bool kE5M2 = false>
__global__ void __launch_bounds__(kParts * kCols, 1024 / (kParts * kCols)) quantize_transposed_kernel(TransposedParams p) {
  constexpr int kThreads = kParts * kCols;
  using Mem = TileMemory<kCols>;
  __shared__ int s_start[kMaxL + 1];  // clipped segment starts in x
  __shared__ int s_pad[kMaxL + 1];    // P_e: starts of the 128-padded segments
  __shared__ float s_amax[kParts][kCols];
  __shared__ __align__(16) unsigned char s_mem[Mem::kBytes];
  auto tile = reinterpret_cast<__nv_bfloat16(*)[Mem::kPitch]>(s_mem);      // [kRowsT][kPitch]
  auto codes = reinterpret_cast<uint4(*)[kRowsT / 16 + 1]>(s_mem);         // [kCols][kRowsT / 16 + 1]: +1, no conflicts

  // 1. clipped starts and padded starts, by warp 0 in expert order
  if (threadIdx.x < kWarp) warp_segment_starts(p.counts, p.counts_i64, p.L, p.rows, s_start, s_pad, kRowsT);
  __syncthreads();

  const long long col_tiles = p.C / kCols;
  const long long items = s_pad[p.L] / kRowsT * col_tiles;
  const int col = int(threadIdx.x) % kCols, part = int(threadIdx.x) / kCols;
  auto item_of = [&](long long item) {
    Item it;
    const int prow = int(item / col_tiles) * kRowsT;  // first padded row of the block
    it.c0 = item % col_tiles * kCols;
    int lo = 0, hi = p.L - 1;  // the expert e with s_pad[e] <= prow < s_pad[e + 1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_pad[mid] <= prow) lo = mid;
      else hi = mid - 1;
    }
    it.e = lo;
    it.in_seg = prow - s_pad[lo];                          // row of the block inside the segment
    it.first = s_start[lo] + it.in_seg;                    // its first row in x
    it.valid = min(kRowsT, s_start[lo + 1] - it.first);
    it.R = s_pad[lo + 1] - s_pad[lo];
    return it;
  };

  // 2. the tile's loads: every thread's vectors (8 elements each) are in flight together, and the next item's are
  // issued as soon as this one's are in shared memory, to run under its arithmetic
  constexpr int kVecs = kRowsT * kCols / 8 / kThreads;
  static_assert(kVecs * kThreads * 8 == kRowsT * kCols, "the tile splits evenly into 8-element vectors");
  using Raw = std::conditional_t<kFp8Source, uint2, uint4>;  // e4m3 codes or bf16
  Raw raw[kVecs];
  float raw_scale[kVecs];  // FP8 source: the row's scale of each vector
  auto load = [&](const Item& it) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int i = int(threadIdx.x) + j * kThreads, r = i / (kCols / 8), v = i % (kCols / 8);
      const long long row = it.first + r, c = it.c0 + v * 8;
      raw[j] = Raw{};
      raw_scale[j] = 0.0f;
      if (r < it.valid) {
        if constexpr (kFp8Source) {
          raw[j] = *reinterpret_cast<const uint2*>(static_cast<const std::uint8_t*>(p.x) + row * p.C + c);
          raw_scale[j] = kTensor ? 1.0f : p.x_scales[row * (p.C / kBlockScaleCols) + c / kBlockScaleCols];
        } else {
          raw[j] = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.x) + row * p.C + c);
        }
      }
    }
  };
  Item cur = item_of(blockIdx.x);
  if (blockIdx.x < items) load(cur);
  for (long long item = blockIdx.x; item < items; item += gridDim.x) {
    const Item it = cur;
    const int e = it.e, in_seg = it.in_seg, first = it.first, valid = it.valid, R = it.R;
    const long long c0 = it.c0;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int i = int(threadIdx.x) + j * kThreads, r = i / (kCols / 8), v = i % (kCols / 8);
      uint4 t;
      if constexpr (kFp8Source) {  // dequantize_fp8's arithmetic: float(code) * scale, rounded once to bf16
        const std::uint32_t w[2] = {raw[j].x, raw[j].y};
        std::uint32_t* o = reinterpret_cast<std::uint32_t*>(&t);
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          const float2 f = decode2(w[h / 2] >> (16 * (h % 2)));
          const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * raw_scale[j], f.y * raw_scale[j]);
          o[h] = *reinterpret_cast<const std::uint32_t*>(&b);
        }
      } else {
        t = raw[j];
      }
      *reinterpret_cast<uint4*>(&tile[r][v * 8]) = t;
    }
    __syncthreads();
    if (item + gridDim.x < items) {
      cur = item_of(item + gridDim.x);
      load(cur);
    }

    // 3. the amax of each thread's column part; with kRowQ, meanwhile, the tile's rows quantized 1x128 straight to q:
    // 16 lanes per row (8 columns each, the amax by shuffles as quantize_fp8), 2 rows per warp and step
    float amax = 0.0f;
    if constexpr (!kTensor) {
#pragma unroll 8
      for (int i = 0; i < kRowsPerPart; ++i)
        amax = fmaxf(amax, fabsf(__bfloat162float(tile[part * kRowsPerPart + i][col])));
      s_amax[part][col] = amax;
    }
    if constexpr (kRowQ) {
      static_assert(kCols == kBlockScaleCols, "one row-wise scale block per item row");
      constexpr int kLanes = 16;  // per row, 8 columns each
      constexpr int kRowsPerStep = kThreads / kLanes;
      const int sub = int(threadIdx.x) % kLanes;
      for (int r0 = 0; r0 < kRowsT; r0 += kRowsPerStep) {  // every lane takes part in every step (the shuffles)
        const int r = r0 + int(threadIdx.x) / kLanes;
        const uint4 in = *reinterpret_cast<const uint4*>(&tile[r][sub * 8]);
        const float v[8] = {bf16_lo(in.x), bf16_hi(in.x), bf16_lo(in.y), bf16_hi(in.y),
                            bf16_lo(in.z), bf16_hi(in.z), bf16_lo(in.w), bf16_hi(in.w)};
        std::uint32_t stored = 0;
        const float scale = kTensor ? p.tensor_scales[e] : group_scale<Fp8Scaling::Block1x128, kLanes>(v, 1.0f, stored);
        const float inv = 1.0f / scale;
        if (r < valid) {
          const long long row = first + r;
          if (!kTensor && sub == 0)
            p.q_scales[row * (p.C / kBlockScaleCols) + c0 / kBlockScaleCols] = __uint_as_float(stored);
          *reinterpret_cast<uint2*>(p.q + row * p.C + c0 + sub * 8) =
              make_uint2(encode4<kE5M2>(v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv),
                         encode4<kE5M2>(v[4] * inv, v[5] * inv, v[6] * inv, v[7] * inv));
        }
      }
    }
    __syncthreads();

    // 4. the column's scale; its 32 codes from the tile again (two vectors in registers)
    if constexpr (!kTensor) {
#pragma unroll
      for (int i = 1; i < kParts; ++i) amax = fmaxf(amax, s_amax[(part + i) % kParts][col]);
    }
    const float scale = kTensor ? p.tensor_scales[e] : block_scale_from_amax(amax);
    const float inv = kTensor && kFp8Source ? 1.0f : 1.0f / scale;
    if (part == 0) p.qt_scales[p.C * s_pad[e] / kRowsT + (c0 + col) * (R / kRowsT) + in_seg / kRowsT] = scale;
    uint4 cv[kRowsPerPart / 16];
#pragma unroll
    for (int h = 0; h < kRowsPerPart / 16; ++h) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = __bfloat162float(tile[part * kRowsPerPart + h * 16 + i][col]);
      cv[h] = encode16<kE5M2>(v, inv);
    }
    __syncthreads();  // the tile is dead from here: the codes go over it
#pragma unroll
    for (int h = 0; h < kRowsPerPart / 16; ++h) codes[col][part * (kRowsPerPart / 16) + h] = cv[h];
    __syncthreads();

    // 5. 128 codes per column, contiguous in qt_e's row c0 + col
    std::uint8_t* out = p.qt + p.C * s_pad[e] + in_seg;
    for (int i = int(threadIdx.x); i < kCols * kRowsT / 16; i += kThreads) {
      const int c = i / (kRowsT / 16), v = i % (kRowsT / 16);
      *reinterpret_cast<uint4*>(out + (c0 + c) * R + v * 16) = codes[c][v];
    }
    __syncthreads();  // s_amax and the codes are reused by the next item
  }
}

template <int kCols, bool kFp8Source, bool kRowQ, bool kTensor = false, bool kE5M2 = false>
void launch_transposed(const TransposedParams& p, long long rows_t, cudaStream_t stream) {
  static_assert(!kE5M2 || (kTensor && !kFp8Source), "e5m2 codes in the per-tensor form from bf16 only");
  constexpr auto kernel = quantize_transposed_kernel<kCols, kFp8Source, kRowQ, kTensor, kE5M2>;
  constexpr int threads = kParts * kCols;
  static const int blocks_per_sm = [] {
    int n = 0;
    MOERAIL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
    return n > 0 ? n : 1;
  }();
  const long long most_items = rows_t / kRowsT * (p.C / kCols);  // items for any counts
  const int grid = int(cuda::persistent_grid(most_items, blocks_per_sm));
  if (grid == 0) return;
  kernel<<<grid, threads, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_fp8_transposed(const QuantizeTransposedArgs& a, cudaStream_t stream) {
  constexpr std::string_view op = "quantize_fp8_transposed";
  const Device dev = Device::cuda(cuda::current_device());
  const bool tensor = a.tensor_scales.defined();
  if (!a.x.defined()) fail(op, "x is absent but required");
  const bool fp8_source = a.x_scales.defined() || (tensor && a.x.dtype() == DType::F8E4M3);
  const bool row_q = a.q.defined() || a.q_scales.defined();
  if (tensor && a.x_scales.defined()) fail(op, "x_scales with tensor_scales (an e4m3 x's scales are tensor_scales)");
  if (fp8_source && row_q) fail(op, "q / q_scales with an FP8 x: the row-wise codes are x itself");
  if (a.x_scales.defined() && a.x.dtype() != DType::F8E4M3)
    fail(op, "x_scales is given (an FP8 x) but x has dtype ", dtype_name(a.x.dtype()), " (expected fp8_e4m3 codes)");
  check_device(op, "x", a.x, dev);
  check_shape(op, "x", a.x, {-1, -1});
  check_dtype(op, "x", a.x, {fp8_source ? DType::F8E4M3 : DType::BF16});
  const std::int64_t L = check_expert_counts(op, a.counts, dev);
  const std::int64_t rows = a.x.size(0), C = a.x.size(1);
  const std::int64_t cols = fp8_source || row_q ? kBlockScaleCols : 64;
  if (C <= 0 || C % cols != 0)
    fail(op, "x has shape ", a.x.shape_str(), " but its columns C = ", C, " must be a positive multiple of ", cols,
         fp8_source ? " (an FP8 x: 128-column tiles)"
                    : (row_q ? " (q: 1x128 blocks along the columns)" : " (64-column tiles)"));
  const std::int64_t rows_t = fp8_transposed_rows(rows, L);
  // The codes' format: qt's dtype, e5m2 only in the per-tensor form from bf16 (q, when given, the same).
  if (!a.qt.defined()) fail(op, "qt is absent but required");
  const bool e5m2 = a.qt.dtype() == DType::F8E5M2;
  if (e5m2 && (!tensor || fp8_source))
    fail_with(ErrorCode::Unsupported, op, "qt is fp8_e5m2, which the per-tensor form from a bf16 x writes only "
              "(tensor_scales given, x bf16)");
  const DType codes = e5m2 ? DType::F8E5M2 : DType::F8E4M3;
  if (rows_t >= (std::int64_t(1) << 31))
    fail(op, "fp8_transposed_rows(rows = ", rows, ", L = ", L, ") = ", rows_t, " but it must be below 2^31");
  if (a.x_scales.defined()) {
    check_device(op, "x_scales", a.x_scales, dev);
    check_shape(op, "x_scales", a.x_scales, {rows, C / kBlockScaleCols});
    check_dtype(op, "x_scales", a.x_scales, {DType::F32});
  }
  if (tensor) {
    check_device(op, "tensor_scales", a.tensor_scales, dev);
    check_shape(op, "tensor_scales", a.tensor_scales, {L});
    check_dtype(op, "tensor_scales", a.tensor_scales, {DType::F32});
    if (a.q_scales.defined()) fail(op, "q_scales with tensor_scales (the per-tensor form's row codes use them)");
  }
  if (row_q) {
    if (!a.q.defined()) fail(op, "q_scales is given but q is absent (both or neither)");
    check_device(op, "q", a.q, dev);
    check_shape(op, "q", a.q, {rows, C});
    check_dtype(op, "q", a.q, {codes});
    if (!tensor) {
      if (!a.q_scales.defined()) fail(op, "q is given but q_scales is absent (both or neither)");
      check_device(op, "q_scales", a.q_scales, dev);
      check_shape(op, "q_scales", a.q_scales, {rows, C / kBlockScaleCols});
      check_dtype(op, "q_scales", a.q_scales, {DType::F32});
    }
  }
  check_device(op, "qt", a.qt, dev);
  check_shape(op, "qt", a.qt, {C * rows_t});
  check_dtype(op, "qt", a.qt, {codes});
  if (!a.qt_scales.defined()) fail(op, "qt_scales is absent but required");
  check_device(op, "qt_scales", a.qt_scales, dev);
  check_shape(op, "qt_scales", a.qt_scales, {C * rows_t / kBlockScaleCols});
  check_dtype(op, "qt_scales", a.qt_scales, {DType::F32});
  for (const auto& [name, v] : {std::pair{"x", &a.x}, std::pair{"qt", &a.qt}, std::pair{"q", &a.q}})
    if (v->defined() && !cuda::aligned16(v->data()))
      fail_with(ErrorCode::Unsupported, op, name, " at address ", v->data(),
                " is not 16-byte aligned (the kernel moves 16-byte vectors)");
  if (rows == 0) return;

  TransposedParams p{};
  p.x = a.x.data();
  p.x_scales = a.x_scales.defined() ? a.x_scales.as<const float>() : nullptr;
  p.counts = a.counts.data();
  p.counts_i64 = a.counts.dtype() == DType::I64;
  p.L = int(L);
  p.rows = int(rows);
  p.C = C;
  p.qt = a.qt.as<std::uint8_t>();
  p.qt_scales = a.qt_scales.as<float>();
  p.q = row_q ? a.q.as<std::uint8_t>() : nullptr;
  p.q_scales = row_q && !tensor ? a.q_scales.as<float>() : nullptr;
  p.tensor_scales = tensor ? a.tensor_scales.as<const float>() : nullptr;
  if (tensor) {
    if (fp8_source) launch_transposed<128, true, false, true>(p, rows_t, stream);
    else if (row_q && e5m2) launch_transposed<128, false, true, true, true>(p, rows_t, stream);
    else if (row_q) launch_transposed<128, false, true, true>(p, rows_t, stream);
    else if (e5m2) launch_transposed<64, false, false, true, true>(p, rows_t, stream);
    else launch_transposed<64, false, false, true>(p, rows_t, stream);
  } else if (fp8_source) {
    launch_transposed<128, true, false>(p, rows_t, stream);
  } else if (row_q) {
    launch_transposed<128, false, true>(p, rows_t, stream);
  } else {
    launch_transposed<64, false, false>(p, rows_t, stream);
  }
}

}  // namespace moerail
