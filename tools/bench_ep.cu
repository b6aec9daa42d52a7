// `moerail bench dispatch|combine --gpus N`: expert-parallel dispatch and combine across the ranks of one node, in a
// worker process per GPU (the command spawns them). Each case is timed as CUDA-graph replays (ten ops back to back
// per graph, two input sets alternating; CUDA events around each replay, median, divided by ten). Rows report rank
// 0's time (the ops synchronize the ranks, so the times agree).
//
//   floor    = bytes of the unique (token, remote rank) pairs the busiest rank sends or receives / the peer copy
//              bandwidth measured in the same run, per GPU and direction, into the other GPUs' symmetric windows:
//              the better of every GPU writing at once and this GPU writing alone (with two GPUs, also
//              cudaMemcpyAsync), so that it stays a floor when only some ranks send.
//   HBM floor = bytes through the busiest rank's own memory / the device copy bandwidth (cudaMemcpyAsync D2D, read
//              + written) measured in the same run. Dispatch: x read, every receive row written (pads included),
//              each staged row landing here written and read back; combine: the routed rows read, each partial
//              landing here written and read back, out written. At two ranks with top-8 of 64 experts a token's
//              four local rows cost more HBM bytes than its one row over the link costs link time.
//   floor at the op's blocks = the floor's bytes / the peer copy rate of the copy kernel with the op's block count
//              (config.peer_copy_at_blocks_gbs, every rank writing at once).
//   HBM floor at the op's blocks = the same bytes / the device copy bandwidth of the op's block count (`--sms`),
//              the better of a load/store copy kernel and a bulk-copy one (config.device_copy_gbs_at_blocks): what
//              that many SMs can move through their own memory at best (docs/dispatch.md, "On a small SM budget").
//   GB/s     = this rank's unique-pair bytes sent / time.
//   baseline = torch all_to_all_single + PyTorch permute (bench/torch_ep_baseline.py, merged by bench/record.py).
#if MOERAIL_WITH_NCCL
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "bench_gpu.cuh"
#include "bench_ep.h"
#include "commands.h"
#include "core/cuda_check.h"
#include "moerail/comm.h"
#include "moerail/dispatch.h"
#include "moerail/quant.h"
#include "moerail/reference/host.h"
#include "moerail/reference/layout.h"
#include "moerail/reference/quant.h"

namespace moerail::tools {
namespace {

struct EpCase {
  std::string name;
  std::vector<long long> tokens;  // per rank
};

// Copies n 16-byte words to each of `npeers` destinations, the blocks split evenly between them.
__global__ void peer_copy_kernel(const uint4* __restrict__ src, uint4* const* dst, int npeers, long long n) {
  const int per_peer = gridDim.x / npeers;
  const int peer = blockIdx.x / per_peer;
  if (peer >= npeers) return;
  uint4* out = dst[peer];
  for (long long i = (blockIdx.x % per_peer) * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)per_peer * blockDim.x)
    out[i] = src[i];
}

// Copies n 16-byte words with the launch's blocks of 512 threads, four words per thread in flight: what the SMs of
// that many blocks move through their load and store instructions.
__global__ void sm_copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n) {
  constexpr int kU = 4;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += kU * stride) {
    uint4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (i + u * stride < n) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (i + u * stride < n) dst[i + u * stride] = v[u];
  }
}

// The same through the SMs' bulk-copy engines: each warp's lane 0 lands 4 KiB pieces in shared memory (cp.async.bulk,
// kBulkSlots in flight per warp, each completing on its mbarrier) and bulk-stores each piece once it has landed.
constexpr int kBulkSlots = 3;
constexpr unsigned kBulkPiece = 4096;
constexpr int kBulkWarps = 16;
constexpr std::size_t kBulkSmem = std::size_t(kBulkWarps) * kBulkSlots * (kBulkPiece + 8);
__global__ void __launch_bounds__(kBulkWarps * 32) bulk_copy_kernel(const char* src, char* dst, long long pieces) {
  extern __shared__ __align__(128) unsigned char bulk_smem[];
  const int warp = int(threadIdx.x / 32);
  if (threadIdx.x % 32 != 0) return;
  unsigned char* slots = bulk_smem + std::size_t(warp) * kBulkSlots * kBulkPiece;
  auto* bars = reinterpret_cast<unsigned long long*>(bulk_smem + std::size_t(kBulkWarps) * kBulkSlots * kBulkPiece) +
               warp * kBulkSlots;
  const auto addr = [](const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); };
  for (int k = 0; k < kBulkSlots; ++k) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(addr(bars + k)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const long long first = blockIdx.x * (long long)kBulkWarps + warp, step = (long long)gridDim.x * kBulkWarps;
  const auto load = [&](long long piece, int k) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(addr(bars + k)), "r"(kBulkPiece)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     addr(slots + k * kBulkPiece)),
                 "l"(src + piece * kBulkPiece), "r"(kBulkPiece), "r"(addr(bars + k))
                 : "memory");
  };
  for (int k = 0; k < kBulkSlots && first + k * step < pieces; ++k) load(first + k * step, k);
  for (long long i = 0; first + i * step < pieces; ++i) {
    const int k = int(i % kBulkSlots);
    const unsigned parity = unsigned(i / kBulkSlots) & 1u;
    unsigned done = 0;
    while (!done)
      asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                   : "=r"(done)
                   : "r"(addr(bars + k)), "r"(parity)
                   : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + (first + i * step) *
                                                                                             kBulkPiece),
                 "r"(addr(slots + k * kBulkPiece)), "r"(kBulkPiece)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the slot has been read: refill it
    if (first + (i + kBulkSlots) * step < pieces) load(first + (i + kBulkSlots) * step, k);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Device copy bandwidth (GB/s, read + written) of `blocks` blocks: through load/store instructions and through bulk
// copies. The ceiling of an op held to that many blocks (its `--sms`), measured in the same run.
struct BlockCopy {
  double sm = 0, bulk = 0;
  double best() const { return std::max(sm, bulk); }
};
BlockCopy block_copy_gbs(int blocks, const BenchOptions& o, cudaStream_t s) {
  MOERAIL_CUDA_CHECK(
      cudaFuncSetAttribute(bulk_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kBulkSmem)));
  BlockCopy r;
  r.sm = copy_rate_gbs(o, s, [&](void* dst, const void* src, std::size_t n) {
    sm_copy_kernel<<<blocks, 512, 0, s>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst),
                                          (long long)(n / 16));
  });
  r.bulk = copy_rate_gbs(o, s, [&](void* dst, const void* src, std::size_t n) {
    bulk_copy_kernel<<<blocks, kBulkWarps * 32, kBulkSmem, s>>>(static_cast<const char*>(src),
                                                                static_cast<char*>(dst), (long long)(n / kBulkPiece));
  });
  MOERAIL_CUDA_CHECK(cudaGetLastError());
  return r;
}

// Per-direction peer write bandwidth of one GPU (GB/s) into the symmetric windows of all other ranks: `all` with
// every rank writing at once (the all-to-all ceiling), `alone` with this rank writing while the others wait (what a
// rank can reach when fewer ranks send, as with uneven token counts). With two ranks, the better of the copy kernel
// and cudaMemcpyAsync. `at_blocks`: every rank writing at once with the op's block count (its `--sms`), the copy
// kernel's blocks split evenly between the peers: what that many SMs can push over the links at best.
struct PeerCopy {
  double all = 0, alone = 0, at_blocks = 0;
  double best() const { return std::max(all, alone); }  // the floor's rate: no op moves bytes faster than this
};

PeerCopy peer_copy_gbs(Communicator& comm, const BenchOptions& o, cudaStream_t s, int op_blocks) {
  const int R = comm.size(), me = comm.rank();
  if (R < 2) return {};
  const std::size_t per_peer = (std::size_t(256) << 20) / std::size_t(R - 1) / 16 * 16;
  Communicator::Window w = comm.alloc_window(per_peer * std::size_t(R));
  std::vector<void*> peers(static_cast<std::size_t>(R));
  MOERAIL_CUDA_CHECK(cudaMemcpy(peers.data(), w.peers, peers.size() * sizeof(void*), cudaMemcpyDeviceToHost));
  std::vector<uint4*> dsts;  // my slot in every other rank's window
  for (int d = 1; d < R; ++d)
    dsts.push_back(reinterpret_cast<uint4*>(static_cast<char*>(peers[std::size_t((me + d) % R)]) + per_peer * me));
  DeviceBuf src(per_peer), dst_table(dsts.size() * sizeof(uint4*));
  MOERAIL_CUDA_CHECK(cudaMemset(src.p, 1, per_peer));
  MOERAIL_CUDA_CHECK(cudaMemcpy(dst_table.p, dsts.data(), dst_table.bytes, cudaMemcpyHostToDevice));
  BenchOptions few = o;
  few.warmup = 3;
  few.iters = 10;
  const int npeers = R - 1;
  const auto copy_with = [&](int blocks) {
    peer_copy_kernel<<<blocks, 512, 0, s>>>(static_cast<const uint4*>(src.p),
                                            static_cast<uint4* const*>(dst_table.p), npeers,
                                            (long long)(per_peer / 16));
  };
  const int blocks = std::max(1, cuda::sm_count() * 2 / npeers) * npeers;
  const auto copy = [&](int) { copy_with(blocks); };
  comm.barrier(s);
  double all_us = median_us(few, s, copy);
  comm.barrier(s);
  if (R == 2) {
    all_us = std::min(all_us, median_us(few, s, [&](int) {
      MOERAIL_CUDA_CHECK(cudaMemcpyAsync(dsts[0], src.p, per_peer, cudaMemcpyDeviceToDevice, s));
    }));
    comm.barrier(s);
  }
  double alone_us = 0;
  for (int writer = 0; writer < R; ++writer) {  // each rank alone in turn
    if (writer == me) alone_us = median_us(few, s, copy);
    comm.barrier(s);
  }
  const int op_copy_blocks = std::max(1, op_blocks / npeers) * npeers;
  const double at_blocks_us = median_us(few, s, [&](int) { copy_with(op_copy_blocks); });
  comm.barrier(s);
  comm.free_window(w);
  const double bytes = double(per_peer) * npeers;
  return {bytes / all_us * 1e-3, bytes / alone_us * 1e-3, bytes / at_blocks_us * 1e-3};
}

struct Inputs {
  std::unique_ptr<DeviceBuf> x, topk, probs;
};

// x of rank r in input set `set` (bf16 bits, [T_max, H]): drawn from a generator of its own, so that every rank can
// draw every rank's rows (the verification of rows that arrive from other ranks).
std::vector<std::uint16_t> draw_x(int set, int r, long long T_max, std::int64_t H) {
  ref::Rng rng(7000 + 131 * std::uint64_t(set) + std::uint64_t(r));
  std::vector<std::uint16_t> xs(static_cast<std::size_t>(T_max * H));
  for (auto& v : xs) v = float_to_bf16_bits(float(rng.uniform(-1.0, 1.0)));
  return xs;
}

// Verify before timing: the rows this rank received, from every source rank (its own included), against the
// reference plan of every rank's routing: each sampled slot's row holds its token's row (bf16: bit for bit; FP8:
// quantize_fp8 1x128 of it, codes and scales bit for bit) and its prob; also the layout (the plan's rows of each
// destination are the reference's). A spread sample of up to kSample slots per source rank. Returns what was checked.
std::string verify_recv(const Dispatcher& d, const MoeConfig& cfg, int me, const std::vector<long long>& tokens,
                        const std::vector<std::vector<std::int32_t>>& idx, const std::vector<std::vector<float>>& probs,
                        const DeviceBuf& recv, const DeviceBuf& recv_probs, const DeviceBuf* recv8,
                        const DeviceBuf* scales8, const std::string& what) {
  constexpr std::int64_t kSample = 96;
  const int R = int(cfg.ep_size);
  const std::int64_t H = cfg.hidden, K = cfg.topk, S = H / kBlockScaleCols;
  std::vector<TensorView> views;
  for (int r = 0; r < R; ++r)
    views.emplace_back(const_cast<std::int32_t*>(idx[std::size_t(r)].data()), DType::I32,
                       std::initializer_list<std::int64_t>{tokens[std::size_t(r)], K});
  const ref::LayoutPlan plan = ref::plan_layout(cfg, views, d.capacity(), d.peer_rows());
  // this rank's view of its own slots: the device plan's destinations are the reference's
  const EpLayout& l = d.layout();
  const std::int64_t mine = tokens[std::size_t(me)] * K;
  std::vector<std::int32_t> rank(static_cast<std::size_t>(mine)), row(static_cast<std::size_t>(mine));
  MOERAIL_CUDA_CHECK(cudaMemcpy(rank.data(), l.dest_rank.data(), rank.size() * 4, cudaMemcpyDeviceToHost));
  MOERAIL_CUDA_CHECK(cudaMemcpy(row.data(), l.dest_row.data(), row.size() * 4, cudaMemcpyDeviceToHost));
  for (std::int64_t i = 0; i < mine; ++i)
    if (rank[std::size_t(i)] != plan.dest_rank[std::size_t(me)][std::size_t(i)] ||
        row[std::size_t(i)] != plan.dest_row[std::size_t(me)][std::size_t(i)])
      fail_with(ErrorCode::Internal, what, ": slot ", i, " of rank ", me, " goes to rank ", rank[std::size_t(i)],
                " row ", row[std::size_t(i)], ", the reference plan says rank ",
                plan.dest_rank[std::size_t(me)][std::size_t(i)], " row ", plan.dest_row[std::size_t(me)][std::size_t(i)]);
  long long checked = 0;
  std::vector<std::uint16_t> got(static_cast<std::size_t>(H));
  std::vector<std::uint8_t> got8(static_cast<std::size_t>(H));
  std::vector<float> got_s(static_cast<std::size_t>(S));
  ref::HostTensor xt(DType::BF16, {1, H}), qt(DType::F8E4M3, {1, H}), st(DType::F32, {1, S});
  for (int src = 0; src < R; ++src) {
    std::vector<std::int64_t> here;  // slots of src that land on this rank
    for (std::int64_t i = 0; i < tokens[std::size_t(src)] * K; ++i)
      if (plan.dest_rank[std::size_t(src)][std::size_t(i)] == me) here.push_back(i);
    if (here.empty()) continue;
    const std::vector<std::uint16_t> x = draw_x(0, src, cfg.max_tokens, H);
    const std::int64_t step = std::max<std::int64_t>(1, std::int64_t(here.size()) / kSample);
    for (std::size_t j = 0; j < here.size(); j += std::size_t(step)) {
      const std::int64_t i = here[j], t = i / K, r = plan.dest_row[std::size_t(src)][std::size_t(i)];
      const std::uint16_t* want = x.data() + t * H;
      float p = 0;
      MOERAIL_CUDA_CHECK(cudaMemcpy(&p, static_cast<const float*>(recv_probs.p) + r, 4, cudaMemcpyDeviceToHost));
      if (p != probs[std::size_t(src)][std::size_t(i)])
        fail_with(ErrorCode::Internal, what, ": recv_probs[", r, "] = ", p, ", expected ",
                  probs[std::size_t(src)][std::size_t(i)], " (rank ", src, ", token ", t, ", slot ", i % K, ")");
      if (recv8) {
        std::copy_n(want, H, static_cast<std::uint16_t*>(xt.view().data()));
        ref::quantize_fp8(Fp8Scaling::Block1x128, xt.view(), qt.view(), st.view());
        MOERAIL_CUDA_CHECK(cudaMemcpy(got8.data(), static_cast<const char*>(recv8->p) + r * H, std::size_t(H),
                                      cudaMemcpyDeviceToHost));
        MOERAIL_CUDA_CHECK(cudaMemcpy(got_s.data(), static_cast<const float*>(scales8->p) + r * S,
                                      std::size_t(S) * 4, cudaMemcpyDeviceToHost));
        if (std::memcmp(got8.data(), qt.view().data(), std::size_t(H)) != 0 ||
            std::memcmp(got_s.data(), st.view().data(), std::size_t(S) * 4) != 0)
          fail_with(ErrorCode::Internal, what, ": FP8 recv row ", r, " (rank ", src, ", token ", t, ", slot ", i % K,
                    ") is not quantize_fp8 of its token");
      } else {
        MOERAIL_CUDA_CHECK(cudaMemcpy(got.data(), static_cast<const char*>(recv.p) + r * H * 2, std::size_t(H) * 2,
                                      cudaMemcpyDeviceToHost));
        if (!std::equal(got.begin(), got.end(), want))
          fail_with(ErrorCode::Internal, what, ": recv row ", r, " (rank ", src, ", token ", t, ", slot ", i % K,
                    ") is not its token's row");
      }
      ++checked;
    }
  }
  return detail::concat(checked, " received rows from ", R, " source ranks and their probs against the reference "
                        "plan (", recv8 ? "quantize_fp8 1x128, bit for bit" : "bit for bit", "); this rank's slot "
                        "destinations all equal");
}

// Verify before timing (combine of the rows just dispatched, InActivation): out[t] is the sum of its token's
// dispatched copies, i.e. (routed slots of t) * x[t], within the per-rank bf16 rounding of the partials (2^-7).
void verify_combine(const Dispatcher& d, std::int64_t T, const std::vector<std::uint16_t>& x, const DeviceBuf& out,
                    std::int64_t H, const std::string& what) {
  const EpLayout& l = d.layout();
  const std::int64_t K = l.dest_rank.size(1);
  std::vector<std::int32_t> row(static_cast<std::size_t>(T * K));
  MOERAIL_CUDA_CHECK(cudaMemcpy(row.data(), l.dest_row.data(), row.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<std::uint16_t> got(static_cast<std::size_t>(T * H));
  MOERAIL_CUDA_CHECK(cudaMemcpy(got.data(), out.p, got.size() * 2, cudaMemcpyDeviceToHost));
  for (std::int64_t t = 0; t < T; ++t) {
    int n = 0;
    for (std::int64_t k = 0; k < K; ++k) n += row[std::size_t(t * K + k)] >= 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const double want = n * double(bf16_bits_to_float(x[std::size_t(t * H + h)]));
      const double have = bf16_bits_to_float(got[std::size_t(t * H + h)]);
      if (!(std::fabs(have - want) <= std::ldexp(std::fabs(want), -7) + 1e-30))
        fail_with(ErrorCode::Internal, what, ": out[", t, ", ", h, "] = ", have, ", expected ", want, " (", n,
                  " routed copies of x)");
    }
  }
}

// The cases of a run: T_max tokens on every rank, 512, none (the op's fixed cost: planning, count exchange,
// handshakes, launches), and uneven counts; named -sms<N> with --sms N.
std::vector<EpCase> ep_cases(const EpBenchOptions& ep, long long T_max, int R) {
  const std::string prefix = "ep" + std::to_string(ep.experts) + "-t";
  std::vector<EpCase> cases{{prefix + std::to_string(T_max), std::vector<long long>(std::size_t(R), T_max)},
                            {prefix + "512", std::vector<long long>(std::size_t(R), std::min(512LL, T_max))},
                            {prefix + "0", std::vector<long long>(std::size_t(R), 0)}};
  if (R == 2) {
    cases.push_back({prefix + std::to_string(T_max) + "-0", {T_max, 0}});
    cases.push_back({prefix + std::to_string(T_max) + "-1000", {T_max, std::min(1000LL, T_max)}});
  } else if (R > 2) {  // uneven: T_max, 0, 1000, T_max / 2, repeating
    const long long pattern[4] = {T_max, 0, std::min(1000LL, T_max), T_max / 2};
    EpCase c{prefix + std::to_string(T_max) + "-uneven", {}};
    for (int r = 0; r < R; ++r) c.tokens.push_back(pattern[r % 4]);
    cases.push_back(c);
  }
  if (ep.sms > 0)  // not the default block count: cases of their own (ep256-t4096-sms24), not to replace the default's
    for (EpCase& c : cases) c.name += "-sms" + std::to_string(ep.sms);
  if (ep.ranks_per_node != 0)  // through nodes of N ranks: cases of their own (ep64-t4096-rpn2; -rpnlsa for -1)
    for (EpCase& c : cases)
      c.name += "-rpn" + (ep.ranks_per_node < 0 ? std::string("lsa") : std::to_string(ep.ranks_per_node));
  return cases;
}

// Through nodes: the rows this rank's last dispatch sent to the other nodes (EpLayout::node_staged), else null.
nlohmann::json network_rows_routed(const Dispatcher& d) {
  const TensorView& v = d.layout().node_staged;
  if (!v.defined()) return nullptr;
  std::vector<std::int32_t> rows(std::size_t(v.size(0)));
  MOERAIL_CUDA_CHECK(cudaMemcpy(rows.data(), v.data(), rows.size() * 4, cudaMemcpyDeviceToHost));
  long long sum = 0;
  for (std::int32_t r : rows) sum += r;
  return sum;
}

DispatchOptions dispatch_options(const EpBenchOptions& ep) {
  DispatchOptions d;
  d.transport = ep.transport;
  d.sms = ep.sms;
  d.ranks_per_node = ep.ranks_per_node;
  return d;
}

// What every case of a run shares: the options, the ceilings measured first, the Dispatcher and its buffers.
struct EpBench {
  const std::string& bench;
  const BenchOptions& o;
  Communicator& comm;
  cudaStream_t s;
  const MoeConfig& base;
  int R, me;
  long long T_max;
  PeerCopy peer;
  double copy_gbs;
  BlockCopy block_copy;  // the device copy at the op's block count (set after construction)
  Dispatcher d;
  std::int64_t H, K, E, L, cap;
  std::size_t row_bytes;
  // dispatch-fp8: x quantized at the source (1x128 block scales); a (token, remote rank) pair moves H e4m3 bytes and
  // H / 128 f32 scales instead of 2H bytes (the bytes written; the staged row's stride rounds them up to 16)
  bool fp8;
  std::size_t wire_bytes;
  std::unique_ptr<DeviceBuf> recv8, scales8;
  DeviceBuf recv, recv_probs, out, num_tokens;

  EpBench(const std::string& bench_, const BenchOptions& o_, Communicator& comm_, cudaStream_t s_,
          const MoeConfig& base_, const EpBenchOptions& ep, const PeerCopy& peer_, double copy_gbs_)
      : bench(bench_), o(o_), comm(comm_), s(s_), base(base_), R(comm_.size()), me(comm_.rank()),
        T_max(base_.max_tokens), peer(peer_), copy_gbs(copy_gbs_), d(base_, comm_, dispatch_options(ep)),
        H(base_.hidden), K(base_.topk), E(base_.num_experts), L(E / R), cap(d.capacity()),
        row_bytes(std::size_t(H) * 2), fp8(bench_ == "dispatch-fp8"),
        wire_bytes(fp8 ? std::size_t(H) + std::size_t(H / kBlockScaleCols) * 4 : row_bytes),
        recv8(fp8 ? std::make_unique<DeviceBuf>(std::size_t(cap) * std::size_t(H)) : nullptr),
        scales8(fp8 ? std::make_unique<DeviceBuf>(std::size_t(cap) * std::size_t(H / kBlockScaleCols) * 4) : nullptr),
        recv(std::size_t(cap) * row_bytes), recv_probs(std::size_t(cap) * 4), out(std::size_t(T_max) * row_bytes),
        num_tokens(4) {
    MOERAIL_CUDA_CHECK(cudaMemset(recv.p, 0, recv.bytes));  // y of combine: dispatched rows (finite)
  }

  // one graph of kOpsPerGraph ops back to back (input sets alternating), as in a captured training step: the
  // time per op excludes the host's launch latency
  template <class Op>
  double time_op(Op&& op) {
    constexpr int kOpsPerGraph = 10;
    cudaGraph_t g;
    cudaGraphExec_t e;
    MOERAIL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int j = 0; j < kOpsPerGraph; ++j) op(j % 2);
    MOERAIL_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    MOERAIL_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    cudaGraphDestroy(g);
    comm.barrier(s);
    const double t = median_us(o, s, [&](int) { MOERAIL_CUDA_CHECK(cudaGraphLaunch(e, s)); }) / kOpsPerGraph;
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(s));
    d.check(s);
    cudaGraphExecDestroy(e);
    comm.barrier(s);
    return t;
  }

  void combine() {
    d.combine({ProbMode::InActivation, recv.view(DType::BF16, {cap, H}), out.view(DType::BF16, {T_max, H})}, s);
  }
};

// The routing of one case: two input sets on this rank (the second is larger than L2 together with the first),
// every rank's routing drawn from one seed so that every rank knows the pairs of all.
struct EpRouting {
  std::vector<Inputs> sets = std::vector<Inputs>(2);
  std::vector<long long> pairs, received;  // unique (token, remote rank) pairs sent / received by each rank
  std::vector<long long> expert_slots;     // routed slots per expert (all ranks' tokens)
  std::vector<std::vector<std::int32_t>> all_idx;  // set 0, every rank: what the verification plans with
  std::vector<std::vector<float>> all_probs;
  std::vector<std::uint16_t> x0;  // this rank's x of set 0 (bf16 bits): the combine verification's source

  EpDispatchArgs dispatch_args(const EpBench& b, int set) const {
    const Inputs& in = sets[std::size_t(set)];
    return EpDispatchArgs{in.x->view(DType::BF16, {b.T_max, b.H}), in.topk->view(DType::I32, {b.T_max, b.K}),
                          in.probs->view(DType::F32, {b.T_max, b.K}), b.num_tokens.view(DType::I32, {1}),
                          b.recv.view(DType::BF16, {b.cap, b.H}), b.recv_probs.view(DType::F32, {b.cap})};
  }
  EpDispatchFp8Args dispatch_fp8_args(const EpBench& b, int set) const {
    const EpDispatchArgs a = dispatch_args(b, set);
    return EpDispatchFp8Args{a.x, a.topk_idx, a.probs, a.num_tokens, b.recv8->view(DType::F8E4M3, {b.cap, b.H}),
                             b.scales8->view(DType::F32, {b.cap, b.H / kBlockScaleCols}), a.recv_probs};
  }
};

EpRouting draw_routing(const EpBench& b, const EpCase& c) {
  const int R = b.R;
  const long long T_max = b.T_max;
  const std::int64_t K = b.K, E = b.E, L = b.L;
  EpRouting out;
  out.pairs.assign(std::size_t(R), 0);
  out.received.assign(std::size_t(R), 0);
  out.expert_slots.assign(std::size_t(E), 0);
  out.all_idx.resize(std::size_t(R));
  out.all_probs.resize(std::size_t(R));
  for (int set = 0; set < 2; ++set) {
    ref::Rng rng(1000 + std::uint64_t(set));
    for (int r = 0; r < R; ++r) {
      std::vector<std::int32_t> idx(std::size_t(T_max * K), -1);
      std::vector<float> p(std::size_t(T_max * K));
      for (long long t = 0; t < c.tokens[std::size_t(r)]; ++t) {
        std::vector<std::int32_t> chosen;
        std::uint64_t remote = 0;  // bit d: the token goes to rank d (R <= 64)
        for (long long k = 0; k < K; ++k) {
          std::int32_t e;
          do e = std::int32_t(rng.below(E));
          while (std::find(chosen.begin(), chosen.end(), e) != chosen.end());
          chosen.push_back(e);
          idx[std::size_t(t * K + k)] = e;
          p[std::size_t(t * K + k)] = float(rng.uniform(0.1, 1.0));
          if (e / L != r) remote |= std::uint64_t(1) << (e / L);
          if (set == 0) ++out.expert_slots[std::size_t(e)];
        }
        if (set == 0) {
          out.pairs[std::size_t(r)] += __builtin_popcountll(remote);
          for (int d2 = 0; d2 < R; ++d2) out.received[std::size_t(d2)] += (remote >> d2) & 1;
        }
      }
      if (set == 0) {
        out.all_idx[std::size_t(r)] = idx;
        out.all_probs[std::size_t(r)] = p;
      }
      if (r != b.me) continue;
      Inputs& in = out.sets[std::size_t(set)];
      in.x = std::make_unique<DeviceBuf>(std::size_t(T_max) * b.row_bytes);
      in.topk = std::make_unique<DeviceBuf>(idx.size() * 4);
      in.probs = std::make_unique<DeviceBuf>(p.size() * 4);
      const std::vector<std::uint16_t> xs = draw_x(set, r, T_max, b.H);  // (its own generator: every rank can draw it)
      MOERAIL_CUDA_CHECK(cudaMemcpy(in.x->p, xs.data(), in.x->bytes, cudaMemcpyHostToDevice));
      if (set == 0) out.x0 = xs;
      MOERAIL_CUDA_CHECK(cudaMemcpy(in.topk->p, idx.data(), in.topk->bytes, cudaMemcpyHostToDevice));
      MOERAIL_CUDA_CHECK(cudaMemcpy(in.probs->p, p.data(), in.probs->bytes, cudaMemcpyHostToDevice));
    }
  }
  return out;
}

// The busiest rank's HBM bytes (see the top of this file).
double busiest_hbm_bytes(const EpBench& b, const EpCase& c, const EpRouting& rt) {
  const std::size_t recv_row = b.fp8 ? std::size_t(b.H) + std::size_t(b.H / kBlockScaleCols) * 4 : b.row_bytes;
  double hbm_bytes = 0;
  for (int r = 0; r < b.R; ++r) {
    double routed = 0, padded = 0;
    for (std::int64_t e = std::int64_t(r) * b.L; e < std::int64_t(r + 1) * b.L; ++e) {
      const double n = double(rt.expert_slots[std::size_t(e)]);
      routed += n;
      padded += std::ceil(n / double(b.base.align)) * double(b.base.align);
    }
    const double Tr = double(c.tokens[std::size_t(r)]);
    const double bytes = b.bench == "combine"
                             ? (routed + 2.0 * double(rt.pairs[std::size_t(r)]) + Tr) * double(b.row_bytes)
                             : Tr * double(b.row_bytes) + padded * double(recv_row) +
                                   2.0 * double(rt.received[std::size_t(r)]) * double(b.wire_bytes);
    hbm_bytes = std::max(hbm_bytes, bytes);
  }
  return hbm_bytes;
}

// The op once, eager (it connects NCCL peers on the host path before capture), then verified: the received rows
// against the reference plan, and for combine its output. Returns what was checked.
std::string verify_case(EpBench& b, const EpCase& c, const EpRouting& rt, std::int32_t T) {
  b.d.dispatch(rt.dispatch_args(b, 0), b.s);
  if (b.fp8) b.d.dispatch_fp8(rt.dispatch_fp8_args(b, 0), b.s);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(b.s));
  b.d.check(b.s);
  std::string verified = "no (--no-verify)";
  if (b.o.verify) {
    MoeConfig vc = b.base;
    vc.max_tokens = b.T_max;
    verified = "before timing: " + verify_recv(b.d, vc, b.me, c.tokens, rt.all_idx, rt.all_probs, b.recv,
                                               b.recv_probs, nullptr, nullptr, "bench " + b.bench + " " + c.name);
    if (b.fp8)
      verified += "; " + verify_recv(b.d, vc, b.me, c.tokens, rt.all_idx, rt.all_probs, b.recv, b.recv_probs,
                                     b.recv8.get(), b.scales8.get(), "bench dispatch-fp8 " + c.name);
  }
  if (b.bench == "combine" && b.o.verify) {  // y = the rows just dispatched
    b.combine();
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(b.s));
    b.d.check(b.s);
    verify_combine(b.d, T, rt.x0, b.out, b.H, "bench combine " + c.name);
  }
  return verified;
}

// The case's row (rank 0's figures are the ones recorded), and its line on stderr from rank 0.
BenchRow ep_row(const EpBench& b, const EpCase& c, const EpRouting& rt, double us, double bf16_us,
                const std::string& verified) {
  const int R = b.R, me = b.me;
  // the busiest rank's link direction: what it sends, or what it receives
  long long busiest = 0;
  for (int r = 0; r < R; ++r) busiest = std::max({busiest, rt.pairs[std::size_t(r)], rt.received[std::size_t(r)]});
  const double hbm_bytes = busiest_hbm_bytes(b, c, rt);
  BenchRow row;
  row.bench = b.bench;
  row.case_name = c.name;
  row.verified = b.bench == "combine" && b.o.verify ? verified + "; combine: out = the routed copies of x, every "
                                                                 "token of this rank, within the partials' rounding"
                                                    : verified;
  row.direction = "fwd";
  row.gpu = gpu_name(cuda::current_device());
  row.gpus = R;
  row.time_us = us;
  row.metric = "GB/s";
  row.value = double(rt.pairs[std::size_t(me)]) * double(b.wire_bytes) / (us * 1e3);
  row.ceiling = Figure{"peer copy (per direction)", b.peer.all, std::nullopt};
  // one rank: no link. The rate: the better of all ranks writing at once and this one alone, so that the floor
  // holds when fewer ranks send (uneven token counts)
  if (R > 1) row.floor_us = double(busiest) * double(b.wire_bytes) / (b.peer.best() * 1e3);
  // the same bytes at the peer copy rate of the op's block count, every rank writing (config.floor_at_blocks_us)
  const double link_floor_blocks_us =
      R > 1 && b.peer.at_blocks > 0 ? double(busiest) * double(b.wire_bytes) / (b.peer.at_blocks * 1e3) : 0.0;
  const double hbm_floor_us = hbm_bytes / (b.copy_gbs * 1e3);
  // the same bytes at the device copy rate of the op's block count: what that many SMs can move at best
  const double hbm_floor_blocks_us = hbm_bytes / (b.block_copy.best() * 1e3);
  if (b.fp8)  // the baseline of the FP8 row: the bf16 dispatch of the same inputs, same run
    row.baseline =
        Figure{"bf16 dispatch", double(rt.pairs[std::size_t(me)]) * double(b.row_bytes) / (bf16_us * 1e3), bf16_us};
  nlohmann::json tok = nlohmann::json::array();
  for (long long t : c.tokens) tok.push_back(t);
  const bool host = b.d.transport() == Transport::HostApi && R > 1;
  row.config = {{"tokens_per_rank", tok},
                {"hidden", b.H},
                {"experts", b.E},
                {"topk", b.K},
                {"align", b.base.align},
                {"transport", std::string(transport_name(b.d.transport()))},
                {"blocks", b.d.blocks()},
                {"unique_pairs_sent", rt.pairs[std::size_t(me)]},
                {"floor_over_time", row.floor_us ? nlohmann::json(*row.floor_us / us) : nlohmann::json(nullptr)},
                {"peer_copy_all_gbs", b.peer.all},
                {"peer_copy_alone_gbs", b.peer.alone},
                {"peer_copy_at_blocks_gbs", b.peer.at_blocks},
                {"floor_at_blocks_us", R > 1 ? nlohmann::json(link_floor_blocks_us) : nlohmann::json(nullptr)},
                {"hbm_bytes_busiest_rank", hbm_bytes},
                {"device_copy_gbs", b.copy_gbs},
                {"hbm_floor_us", hbm_floor_us},
                {"device_copy_gbs_at_blocks", {{"sm", b.block_copy.sm}, {"bulk", b.block_copy.bulk}}},
                {"hbm_floor_at_blocks_us", hbm_floor_blocks_us},
                {"wire_bytes_per_pair", b.wire_bytes},
                {"capacity", b.base.capacity.str()},
                // host API: the rows each rank sends each peer per op, and all it sends against its routed rows
                {"peer_rows", host ? nlohmann::json(b.d.peer_rows()) : nlohmann::json(nullptr)},
                {"rows_sent_over_routed", host && rt.pairs[std::size_t(me)] > 0
                                              ? nlohmann::json(double(R - 1) * double(b.d.peer_rows()) /
                                                               double(rt.pairs[std::size_t(me)]))
                                              : nlohmann::json(nullptr)},
                // through nodes: the ranks of a node, the rows sent to each remote node per op, and the rows
                // this rank's last dispatch routed to the other nodes (one per token and remote node)
                {"ranks_per_node", b.d.ranks_per_node()},
                {"node_rows", b.d.ranks_per_node() ? nlohmann::json(b.d.node_rows()) : nlohmann::json(nullptr)},
                {"network_rows_routed", network_rows_routed(b.d)},
                {"workspace_bytes_per_rank", b.d.workspace_bytes()}};
  const char *bench = b.bench.c_str(), *name = c.name.c_str();
  if (me == 0 && row.floor_us)
    std::fprintf(stderr, "bench %s %s: %.1f us, floor %.1f us (%.2fx; at %d blocks %.1f us, %.2fx), HBM floor %.1f us "
                 "(%.2fx; at %d blocks %.1f us, %.2fx), %.1f GB/s, peer copy %.1f GB/s\n", bench, name, us,
                 *row.floor_us, us / *row.floor_us, b.d.blocks(), link_floor_blocks_us, us / link_floor_blocks_us,
                 hbm_floor_us, us / hbm_floor_us, b.d.blocks(), hbm_floor_blocks_us, us / hbm_floor_blocks_us,
                 row.value, b.peer.all);
  else if (me == 0)
    std::fprintf(stderr, "bench %s %s: %.1f us (one rank: no link floor), HBM floor %.1f us (%.2fx; at %d blocks "
                 "%.1f us, %.2fx)\n", bench, name, us, hbm_floor_us, us / hbm_floor_us, b.d.blocks(),
                 hbm_floor_blocks_us, us / hbm_floor_blocks_us);
  if (me == 0 && b.fp8)
    std::fprintf(stderr, "bench %s %s: bf16 dispatch %.1f us, fp8 / bf16 time %.3f\n", bench, name, bf16_us,
                 us / bf16_us);
  return row;
}

// One case: its routing drawn, the op verified, then timed (dispatch-fp8: the bf16 dispatch first, its baseline).
BenchRow run_case(EpBench& b, const EpCase& c) {
  const EpRouting rt = draw_routing(b, c);
  const std::int32_t T = std::int32_t(c.tokens[std::size_t(b.me)]);
  MOERAIL_CUDA_CHECK(cudaMemcpy(b.num_tokens.p, &T, 4, cudaMemcpyHostToDevice));
  const std::string verified = verify_case(b, c, rt, T);
  double us = 0, bf16_us = 0;
  if (b.bench == "combine") {
    us = b.time_op([&](int) { b.combine(); });
  } else {
    bf16_us = b.time_op([&](int set) { b.d.dispatch(rt.dispatch_args(b, set), b.s); });
    us = b.fp8 ? b.time_op([&](int set) { b.d.dispatch_fp8(rt.dispatch_fp8_args(b, set), b.s); }) : bf16_us;
  }
  return ep_row(b, c, rt, us, bf16_us, verified);
}

}  // namespace

Capacity parse_capacity(const std::string& s, std::string_view what) {
  if (s == "worst-case") return Capacity::worst_case();
  const auto colon = s.find(':');
  const std::string kind = s.substr(0, colon);
  double c = 0;
  bool ok = colon != std::string::npos && (kind == "factor" || kind == "per-expert");
  if (ok) {
    try {
      std::size_t used = 0;
      c = std::stod(s.substr(colon + 1), &used);
      ok = used == s.size() - colon - 1 && c > 0 && std::isfinite(c);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  if (!ok) fail(what, "got \"", s, "\" (expected worst-case, factor:C or per-expert:C with C > 0)");
  return kind == "factor" ? Capacity::of_factor(c) : Capacity::per_expert(c);
}

std::vector<BenchRow> run_ep_bench(const std::string& bench, const BenchOptions& o, Communicator& comm,
                                   const EpBenchOptions& ep) {
  const int R = comm.size(), me = comm.rank();
  MoeConfig base = preset_config(o.config);
  base.num_experts = ep.experts;
  base.ep_size = R;
  base.align = 128;
  base.dtype = DType::BF16;
  const long long T_max = o.tokens > 0 ? o.tokens : 4096;
  base.max_tokens = T_max;
  base.capacity = ep.capacity;
  std::vector<EpCase> cases = ep_cases(ep, T_max, R);
  if (ep.capacity.kind != Capacity::Kind::WorstCase)  // cases of their own (ep64-t4096-factor(1.25))
    for (EpCase& c : cases) c.name += "-" + ep.capacity.str();
  cudaStream_t s;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copy_gbs = copy_bandwidth_gbs(o, s);
  EpBench b(bench, o, comm, s, base, ep, PeerCopy{}, copy_gbs);
  b.peer = peer_copy_gbs(comm, o, s, b.d.blocks());
  b.block_copy = block_copy_gbs(b.d.blocks(), o, s);
  if (me == 0)
    std::fprintf(stderr, "bench %s: device copy at %d blocks: %.0f GB/s (loads/stores), %.0f GB/s (bulk copies); "
                 "every SM: %.0f GB/s\n", bench.c_str(), b.d.blocks(), b.block_copy.sm, b.block_copy.bulk, copy_gbs);
  std::vector<BenchRow> rows;
  for (const EpCase& c : cases) rows.push_back(run_case(b, c));
  // workspace of the two capacity policies at this shape (reported, not timed)
  if (me == 0) {
    for (Capacity cap_policy : {Capacity::worst_case(), Capacity::of_factor(1.5)}) {
      MoeConfig c2 = base;
      c2.capacity = cap_policy;
      std::fprintf(stderr, "bench %s: capacity %s: %lld rows per rank (%.1f MiB of receive buffer per rank)\n",
                   bench.c_str(), cap_policy.str().c_str(), (long long)c2.rows_per_rank(),
                   double(c2.rows_per_rank()) * double(b.row_bytes) / (1 << 20));
    }
  }
  cudaStreamDestroy(s);
  return rows;
}

}  // namespace moerail::tools
#endif  // MOERAIL_WITH_NCCL
