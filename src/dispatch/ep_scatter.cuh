// src/dispatch/ep_scatter.cuh — the scatter kernel: dispatch (kDispatch) and combine backward, owner -> expert side.
//
// Producer warps (owner side) take chunks of kChunk own tokens. For token t each lane loads 16-byte vectors of its
// row once and stores them to the token's local rows and, once per remote rank holding any of its slots, to that
// rank's staging row [me][t]; the slot rows (meta) and probs go along. After the chunk: a system-scope fence and one
// release flag per remote rank. Consumer warps (expert side) take (source rank, chunk) pairs (RemoteWork: chunk c
// of every source in the block of the index that produced it there), wait for the flag (bounded), and expand every
// staged row into its local rows. Combine backward scales by w and, under InCombine, sends the dot products
// <y, d_out> back (ret + a return flag) that the producers collect at the end.
#pragma once

#include "dispatch/ep_common.cuh"
#include "dispatch/ep_rows.cuh"
#include "dispatch/ep_trace.cuh"

namespace moerail::ep {

// Payload of a scatter: the rows as they are, bf16 rows quantized to FP8 at the source with a recipe, or FP8 rows
// the caller quantized (e4m3 bytes and scale words moved as they are).
enum class Payload { Native, Fp8PerTensor, Fp8Block1x128, Fp8Mx1x32, Fp8Given };

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
  int sp = -1;                       // compact staging: stage_pos of the slot
  float prob = 0.f;

  __device__ void fetch(const Params& p, int t, std::size_t k_slice) {
    const int lane = int(threadIdx.x % 32);
    a = b = sp = -1;
    prob = 0.f;
    if (t < 0 || lane >= p.K) return;
    const std::size_t slot = std::size_t(t) * p.K + lane;
    if (p.plan.compact) sp = p.plan.stage_pos[slot];
    if constexpr (kDispatch) {
      a = p.tok.local_row[slot];
      b = p.tok.topk_idx[slot];
      prob = p.tok.probs[slot];
    } else {
      a = p.plan.dest_rank[slot];
      b = p.plan.dest_row[slot];
      prob = p.plan.slot_probs[std::size_t(p.me) * p.t_max * p.K + slot];
    }
  }
  __device__ void resolve(const Params& p) {
    if (kDispatch && a >= 0) {  // a slot with a local row has a valid expert
      base = p.tok.base[b];
      off = p.tok.local_off[b];
      limit = p.tok.limit[b];
    }
  }
  // The slot's rank in the staging (compact): where its token is staged, even when the destination then drops the
  // slot for capacity (its meta row there says -1); -1 for a local, unrouted or peer-dropped slot.
  __device__ int staged_rank(const Params& p, int rank) const {
    if (sp < 0) return -1;
    return kDispatch ? b / p.L : rank;
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
  tr.stamp(kTraceEntered);
  const int lane = int(threadIdx.x % 32);
  const bool slot_lane = lane < p.K;
  RoleWarps mine;
  const bool producer = split_roles(p, mine);
  const int T = cuda::load_token_count(p.tok.num_tokens, p.t_max);
  const std::size_t row_bytes = std::size_t(p.nvec) * 16;           // a row of rows.dst
  const std::size_t stage_row = kFp8 ? p.fp8.wire_bytes : row_bytes;    // a staged row
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
      tr.item();
      const int t_end = min(T, (c + 1) * kChunk);
      for (int t = c * kChunk; t < t_end; ++t) {
        const std::size_t slot = std::size_t(t) * p.K + lane;
        const unsigned long long tt0 = tr.now();
        const SlotLoads<kDispatch> cur = next;
        next.fetch(p, next_token(t, c), k_slice);
        int rank, row;
        cur.place(p, rank, row);
        const float prob = cur.prob;
        if (kDispatch && slot_lane) {
          p.plan.dest_rank[slot] = rank;
          p.plan.dest_row[slot] = row;
        }
        const unsigned mask = rank_mask(rank, p.K);
        const unsigned remote = mask & ~(1u << p.me);
        const int srank = slot_lane ? cur.staged_rank(p, rank) : -1;
        const int places = staged_places(p, t, srank, cur.sp);  // lane r: the token's place at rank r
        // the token's staging row for rank r (r in remote: every lane runs it)
        const auto staged_row = [&](int r) {
          return dst_slice(p, r, p.reg.stage, stage_slice) +
                 std::size_t(__shfl_sync(cuda::kFullMask, places, r)) * stage_row;
        };
        if (kDispatch && slot_lane && !p.plan.compact) {
          // the slot rows and probs travel to every remote rank (-1 where the slot is elsewhere)
          for (int r = 0; r < p.R; ++r) {
            if (r == p.me) continue;
            region<std::int32_t>(dst_slice(p, r, p.reg.meta, std::size_t(p.t_max) * p.K * 4), 0)[slot] =
                rank == r ? row : -1;
            if (rank == r) region<float>(dst_slice(p, r, p.reg.probs, k_slice), 0)[slot] = prob;
          }
        }
        if (kDispatch && p.plan.compact) {
          // to the ranks the token is staged for, at its place there (-1 where the slot is elsewhere or dropped)
          for (unsigned m = rank_mask(srank, p.K); m; m &= m - 1) {
            const int r = __ffs(m) - 1;
            const std::size_t at = std::size_t(__shfl_sync(cuda::kFullMask, places, r)) * p.K + lane;
            if (!slot_lane) continue;
            region<std::int32_t>(dst_slice(p, r, p.reg.meta, std::size_t(p.t_max) * p.K * 4), 0)[at] =
                rank == r ? row : -1;
            if (rank == r) region<float>(dst_slice(p, r, p.reg.probs, k_slice), 0)[at] = prob;
          }
        }
        if (kDispatch && slot_lane) {
          p.plan.slot_probs[std::size_t(p.me) * p.t_max * p.K + slot] = prob;
          if (rank == p.me) p.rows.recv_probs[row] = prob;
        }
        const unsigned long long tt1 = tr.add(tr.meta, tt0);
        const char* src = static_cast<const char*>(p.tok.src) + std::size_t(t) * row_bytes;
        if constexpr (kPay == Payload::Fp8Given) {
          // the e4m3 row and its scale words as they are, to every local row and once per remote rank
          const unsigned local = __ballot_sync(cuda::kFullMask, slot_lane && rank == p.me);
          for (long long v0 = 0; v0 < p.nvec; v0 += 32 * kUnrollWide) {
            uint4 buf[kUnrollWide];
            load_batch(buf, src, v0, p.nvec);
            for (unsigned m = remote; m; m &= m - 1) store_batch(staged_row(__ffs(m) - 1), buf, v0, p.nvec);
            for (unsigned m = local; m; m &= m - 1) {
              const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
              store_batch(static_cast<char*>(p.rows.dst) + std::size_t(wk) * row_bytes, buf, v0, p.nvec);
            }
          }
          const std::uint32_t* scales = p.fp8.tok_scales ? p.fp8.tok_scales + std::size_t(t) * p.fp8.scale_cols : nullptr;
          for (int j0 = 0; scales && j0 < p.fp8.scale_cols; j0 += 32) {
            const int j = j0 + lane;
            const std::uint32_t w = j < p.fp8.scale_cols ? scales[j] : 0u;
            for (unsigned m = remote; m; m &= m - 1) {
              char* staged = staged_row(__ffs(m) - 1);
              if (j < p.fp8.scale_cols) reinterpret_cast<std::uint32_t*>(staged + row_bytes)[j] = w;
            }
            for (unsigned m = local; m; m &= m - 1) {
              const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
              if (j < p.fp8.scale_cols) p.fp8.recv_scales[std::size_t(wk) * p.fp8.scale_cols + j] = w;
            }
          }
        } else if constexpr (kFp8) {
          // one read of the bf16 row, quantized once, stored to every local row and once per remote rank
          const unsigned local = __ballot_sync(cuda::kFullMask, slot_lane && rank == p.me);
          const char* x = static_cast<const char*>(p.tok.src) + std::size_t(t) * std::size_t(p.fp8.src_nvec) * 16;
          constexpr Fp8Scaling S = fp8_scaling_of(kPay);
          constexpr int kU = kUnrollWide / 2;  // the same 16-byte loads in flight as the bf16 path
          const float tensor_scale = S == Fp8Scaling::PerTensor ? *p.fp8.tensor_scale : 1.0f;
          for (long long j0 = 0; j0 < p.nvec; j0 += 32 * kU) {
            uint4 q[kU];
            std::uint32_t sc[kU];
            load_quantize_batch<S>(x, q, sc, j0, p.nvec, tensor_scale);
            for (unsigned m = remote; m; m &= m - 1) {
              char* w = staged_row(__ffs(m) - 1);
              store_fp8_batch<S>(w, reinterpret_cast<std::uint32_t*>(w + row_bytes), q, sc, j0, p.nvec);
            }
            for (unsigned m = local; m; m &= m - 1) {
              const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
              store_fp8_batch<S>(static_cast<char*>(p.rows.dst) + std::size_t(wk) * row_bytes,
                                 p.fp8.recv_scales + std::size_t(wk) * p.fp8.scale_cols, q, sc, j0, p.nvec);
            }
          }
        } else if (kDispatch || !p.in_combine) {
          // one read of the row, stored to every local row and once per remote rank (combine backward with the
          // probs in the activation: d_y = d_out, the same copy)
          if (!kDispatch && p.tok.d_probs && slot_lane) p.tok.d_probs[slot] = 0.f;  // no probs in the combine: no gradient
          const unsigned local = __ballot_sync(cuda::kFullMask, slot_lane && rank == p.me);
          for (long long v0 = 0; v0 < (remote ? p.nvec : local_end); v0 += 32 * kUnrollWide) {
            uint4 buf[kUnrollWide];
            load_batch(buf, src, v0, p.nvec);
            for (unsigned m = remote; m; m &= m - 1) store_batch(staged_row(__ffs(m) - 1), buf, v0, p.nvec);
            for (unsigned m = v0 < local_end ? local : 0u; m; m &= m - 1) {
              const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
              store_batch(static_cast<char*>(p.rows.dst) + std::size_t(wk) * row_bytes, buf, v0, local_end);
            }
          }
        } else {
          // combine backward, InCombine: d_out once per remote rank; local rows get w * d_out and the dot product
          for (long long v0 = 0; remote && v0 < p.nvec; v0 += 32 * kUnrollWide) {
            uint4 buf[kUnrollWide];
            load_batch(buf, src, v0, p.nvec);
            for (unsigned m = remote; m; m &= m - 1) store_batch(staged_row(__ffs(m) - 1), buf, v0, p.nvec);
          }
          for (int k = 0; k < p.K; ++k) {
            const int rk = __shfl_sync(cuda::kFullMask, rank, k), wk = __shfl_sync(cuda::kFullMask, row, k);
            const float w = __shfl_sync(cuda::kFullMask, prob, k);
            if (rk != p.me) continue;
            char* d = static_cast<char*>(p.rows.dst) + std::size_t(wk) * row_bytes;
            const char* yr = static_cast<const char*>(p.rows.y) + std::size_t(wk) * row_bytes;
            const float dot = scale_row_and_dot<Elem>(d, src, yr, w, p.nvec);
            if (p.tok.d_probs && lane == 0) p.tok.d_probs[std::size_t(t) * p.K + k] = dot;
          }
          if (p.tok.d_probs && slot_lane && rank != p.me) p.tok.d_probs[slot] = 0.f;  // remote ones come back later
        }
        next.resolve(p);  // its loads land while this token's stores drain (and the fence waits)
        tr.add(tr.data, tt1);
      }
      if (flags) {
        const unsigned long long f0 = tr.now();
        __threadfence_system();
        tr.add(tr.fence, f0);
        __syncwarp();
        if (lane < p.R && lane != p.me)
          store_release_sys(region<std::uint32_t>(p.dst[lane], p.reg.sig_data) + std::size_t(p.me) * p.chunks_max + c,
                            epoch);
      }
    }
    const int j = mine.w / parts.stride, c = mine.w % parts.stride;
    if (kDispatch && j > 0 && j < parts.n && c < chunks) {  // range j of chunk c's local rows
      const long long vb = parts.begin(j), ve = parts.begin(j + 1);
      tr.item();
      for (int t = c * kChunk; t < min(T, (c + 1) * kChunk); ++t) {
        SlotLoads<kDispatch> cur;
        cur.fetch(p, t, k_slice);
        cur.resolve(p);
        int rank, row;
        cur.place(p, rank, row);
        const unsigned local = __ballot_sync(cuda::kFullMask, slot_lane && rank == p.me);
        const char* src = static_cast<const char*>(p.tok.src) + std::size_t(t) * row_bytes;
        for (long long v0 = vb; local && v0 < ve; v0 += 32 * kUnrollWide) {
          uint4 buf[kUnrollWide];
          load_batch(buf, src, v0, ve);
          for (unsigned m = local; m; m &= m - 1) {
            const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
            store_batch(static_cast<char*>(p.rows.dst) + std::size_t(wk) * row_bytes, buf, v0, ve);
          }
        }
      }
    }
  }

  if (!producer && (p.role & kConsume)) {
    // the pad rows first: until the first chunk arrives these warps would only wait
    if (p.zero_pads) zero_pad_rows(p, p.rows.dst, kDispatch ? p.rows.recv_probs : nullptr, mine.w, mine.nw);
    const RemoteWork rw = remote_work(p);
    int s, c;
    for (int item = 0; rw.pick(mine, item, s, c); ++item) {
      const int Ts = staged_rows_of(p, s);
      if (c >= chunks_of(Ts)) continue;
      const unsigned long long w0 = tr.now();
      if (flags) {
        if (lane == 0)
          wait_flag(p, region<std::uint32_t>(p.local, p.reg.sig_data) + std::size_t(s) * p.chunks_max + c, epoch,
                    deadline, s);
        __syncwarp();
      }
      tr.item(tr.add(tr.wait, w0));
      // a dispatch reads the slot rows and probs that came with the chunk and keeps them in its handle; the
      // combine backward reads them there
      const std::size_t tk = std::size_t(p.t_max) * p.K;
      std::int32_t* kept_rows = p.plan.slot_rows + std::size_t(s) * tk;
      float* kept_probs = p.plan.slot_probs + std::size_t(s) * tk;
      const auto* meta = kDispatch ? region<std::int32_t>(local_slice(p, s, p.reg.meta, tk * 4), 0) : kept_rows;
      const auto* sprobs = kDispatch ? region<float>(local_slice(p, s, p.reg.probs, k_slice), 0) : kept_probs;
      const char* stage = local_slice(p, s, p.reg.stage, stage_slice);
      const int t_end = min(Ts, (c + 1) * kChunk);
      for (int t = c * kChunk; t < t_end; ++t) {
        const unsigned long long tt0 = tr.now();
        const std::size_t slot = std::size_t(t) * p.K + lane;
        const int row = slot_lane ? meta[slot] : -1;
        const float prob = slot_lane && row >= 0 ? sprobs[slot] : 0.f;
        if (kDispatch && slot_lane) {
          kept_rows[slot] = row;
          kept_probs[slot] = prob;
        }
        const unsigned any = __ballot_sync(cuda::kFullMask, row >= 0);
        if (!any) continue;
        const unsigned long long tt1 = tr.add(tr.meta, tt0);
        const char* src = stage + std::size_t(t) * stage_row;
        if (kDispatch || !p.in_combine) {  // the staged row as it is to every row it lands in
          if (kDispatch && row >= 0) p.rows.recv_probs[row] = prob;
          // FP8: the scales follow the e4m3 bytes of the staged row; loaded here, beside the first data batch, so
          // that they cost no round trip of their own
          std::uint32_t sv[kScalesPerLane];
          const auto* ssrc = reinterpret_cast<const std::uint32_t*>(src + row_bytes);
          if constexpr (kFp8) {
#pragma unroll
            for (int i = 0; i < kScalesPerLane; ++i)
              if (lane + 32 * i < p.fp8.scale_cols) sv[i] = ssrc[lane + 32 * i];
          }
          constexpr int kU = kFp8 ? kUnrollFp8Rows : kUnrollWide;
          for (long long v0 = 0; v0 < p.nvec; v0 += 32 * kU) {
            uint4 buf[kU];
            load_batch(buf, src, v0, p.nvec);
            for (unsigned m = any; m; m &= m - 1) {
              const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
              store_batch(static_cast<char*>(p.rows.dst) + std::size_t(wk) * row_bytes, buf, v0, p.nvec);
            }
          }
          if (kFp8 && p.fp8.scale_cols > 0) {  // PerTensor moves no scales
            for (unsigned m = any; m; m &= m - 1) {
              const int wk = __shfl_sync(cuda::kFullMask, row, __ffs(m) - 1);
              std::uint32_t* dst = p.fp8.recv_scales + std::size_t(wk) * p.fp8.scale_cols;
#pragma unroll
              for (int i = 0; i < kScalesPerLane; ++i)
                if (lane + 32 * i < p.fp8.scale_cols) dst[lane + 32 * i] = sv[i];
              for (int j = lane + 32 * kScalesPerLane; j < p.fp8.scale_cols; j += 32) dst[j] = ssrc[j];  // H > 16384
            }
          }
        } else {
          float* ret = region<float>(dst_slice(p, s, p.reg.ret, k_slice), 0);
          for (unsigned m = any; m; m &= m - 1) {
            const int k = __ffs(m) - 1;
            const int wk = __shfl_sync(cuda::kFullMask, row, k);
            const float w = __shfl_sync(cuda::kFullMask, prob, k);
            char* d = static_cast<char*>(p.rows.dst) + std::size_t(wk) * row_bytes;
            const char* yr = static_cast<const char*>(p.rows.y) + std::size_t(wk) * row_bytes;
            const float dot = scale_row_and_dot<Elem>(d, src, yr, w, p.nvec);
            if (lane == 0) ret[std::size_t(t) * p.K + k] = dot;
          }
        }
        tr.add(tr.data, tt1);
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
  if (!kDispatch && p.in_combine && p.tok.d_probs && (p.role & kCollect) && (producer || !(p.role & kProduce))) {
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
        const int rank = p.plan.dest_rank[slot];
        if (rank >= 0 && rank != p.me) {
          const std::size_t at = p.plan.compact ? std::size_t(p.plan.stage_pos[slot]) * p.K + lane : slot;
          p.tok.d_probs[slot] = region<float>(local_slice(p, rank, p.reg.ret, k_slice), 0)[at];
        }
      }
    }
  }

  const unsigned long long role_end = tr.now();
  if (p.zero_pads && !(p.role & kConsume)) {  // a launch without consumers (R = 1): every warp, at the end
    const int warp = int(blockIdx.x) * kWarps + int(threadIdx.x / 32);
    zero_pad_rows(p, p.rows.dst, kDispatch ? p.rows.recv_probs : nullptr, warp, int(gridDim.x) * kWarps);
  }
  tr.finish(role_end);
}

}  // namespace moerail::ep
