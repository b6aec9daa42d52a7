// Expert-parallel dispatch and combine (include/moerail/dispatch.h), the ops: argument checks and the launch
// sequences of both transports. The kernels: ep_plan_kernel.cuh, ep_scatter.cuh, ep_gather.cuh (ep_common.cuh).
#include <cuda_fp16.h>

#include <string>

#include "dispatch/dispatcher_impl.h"
#include "dispatch/ep_gather.cuh"
#include "dispatch/ep_hier.cuh"
#include "dispatch/ep_plan_kernel.cuh"
#include "dispatch/ep_scatter.cuh"
#include "moerail/quant.h"

namespace moerail {

namespace {

template <typename F>
void with_dtype(DType t, F&& f) {
  if (t == DType::BF16) f(__nv_bfloat16{});
  else if (t == DType::F16) f(__half{});
  else f(float{});
}

void launch_plan(Dispatcher::Impl& d, const DispatchHandle& h, const TensorView& topk_idx, const TensorView& num_tokens,
                 cudaStream_t stream) {
  ep::PlanParams pp{};
  pp.p = d.params(0, h);
  pp.A = int(d.cfg.align);
  pp.exchange = d.nvlink();  // R = 1 too: the counts go to this rank's own window
  pp.local_tpe = d.local_layout.tokens_per_expert.as<const std::int32_t>();
  pp.num_tokens = num_tokens.as<const std::int32_t>();
  pp.scratch = d.scratch;
  pp.out = d.plan_out(h);
  if (d.compact) {
    ep::Params p = pp.p;
    p.tok.topk_idx = topk_idx.as<const std::int32_t>();
    ep::stage_plan_kernel<<<d.R, ep::kStageThreads, std::size_t(d.L) * 4, stream>>>(
        p, pp.local_tpe, pp.num_tokens, d.local_layout.dest_row.as<std::int32_t>());
    MOERAIL_CUDA_CHECK_LAUNCH();
    if (d.hier()) {
      const ep::HierPlan hp{d.me, d.G, d.N, d.K, d.L, int(d.t_max), int(d.node_rows), p.tok.topk_idx,
                            pp.num_tokens, p.plan.stage_pos, d.node_tok(h), d.node_fan(h),
                            h.layout().node_staged.as<std::int32_t>()};
      ep::node_plan_kernel<<<d.N, ep::kStageThreads, 0, stream>>>(hp);
      MOERAIL_CUDA_CHECK_LAUNCH();
    }
    d.comm.all_gather_inplace(d.local + d.reg.xcount, std::size_t(d.xrow()) * 4, stream, "dispatch (count exchange)");
  } else if (!d.nvlink()) {
    ep::pack_counts_kernel<<<1, 256, 0, stream>>>(pp.p, pp.local_tpe, pp.num_tokens);
    MOERAIL_CUDA_CHECK_LAUNCH();
  }
  // NvLink: scheduled while the local planner's assign kernel ends. The data kernel after it is launched plainly:
  // its blocks hold every SM, and resident early they could keep SMs from a collective of another stream while
  // this kernel waits for the peers' counts (docs/dispatch.md, Blocks).
  if (d.nvlink())
    MOERAIL_CUDA_CHECK(cuda::launch_after_previous(ep::plan_kernel, dim3(1), dim3(ep::kPlanThreads), 0, stream, pp));
  else
    ep::plan_kernel<<<1, ep::kPlanThreads, 0, stream>>>(pp);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

template <typename Kernel>
void launch_data(Dispatcher::Impl& d, Kernel kernel, const ep::Params& p, cudaStream_t stream) {
  kernel<<<d.blocks, ep::kWarps * 32, 0, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

// The gather kernels land the rows they sum in shared memory (ep::kGatherSmemBytes, above the 48 KiB default): the
// attribute is set before each launch (a host call, allowed during graph capture; per kernel instance and device).
template <typename Elem, bool kCombine>
void launch_gather(Dispatcher::Impl& d, const ep::Params& p, cudaStream_t stream) {
  const auto kernel = ep::gather_kernel<Elem, kCombine>;
  MOERAIL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(ep::kGatherSmemBytes)));
  kernel<<<d.blocks, ep::kWarps * 32, ep::kGatherSmemBytes, stream>>>(p);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

// Roles of the one NvLink launch; on HostApi the pack launch (producers) and the unpack launch (consumers).
int fused_role(const Dispatcher::Impl& d, bool consumers_only_when_alone) {
  if (d.R == 1) return consumers_only_when_alone ? ep::kConsume : ep::kProduce;
  return ep::kProduce | ep::kConsume | ep::kFlags;
}

}  // namespace

// Hierarchical (ep_hier.cuh): the union rows are copied out; one grouped exchange moves the segments inside the node
// and the union rows and node plans between rail peers (the network); the forwarder copies each union row to its
// places; a second grouped exchange inside the node moves the forwarded segments: node rank g gets from this rank
// the segments of the remote sources of this rank's rail (n * G + me % G, in node order), and sends it those of
// its own rail (n * G + g), which land where the flat transfer would have put them.
void Dispatcher::Impl::transfer_down(std::size_t off, std::size_t row_bytes_, const DispatchHandle& h,
                                     std::int32_t* fan_to, cudaStream_t stream, const char* op) {
  if (!hier()) return transfer(off, row_bytes_, stream, op);
  const std::size_t slice = std::size_t(t_max) * row_bytes_, seg = std::size_t(peer_rows) * row_bytes_;
  const std::size_t node_bytes = std::size_t(node_rows) * row_bytes_;
  const std::size_t fan_row = std::size_t(node_rows) * std::size_t(G) * 4;
  const ep::HierMove m{me, G, N, K, int(t_max), int(node_rows), int(peer_rows),
                       h.layout().dest_rank.as<const std::int32_t>(), off, row_bytes_, h.node_tok_, h.node_fan_,
                       h.layout().node_staged.as<const std::int32_t>(), fan_to, send_area, recv_area,
                       union_send, union_recv, fwd_send};
  const int my_node = me / G;
  ep::union_rows_kernel<<<blocks, ep::kWarps * 32, 0, stream>>>(m);
  MOERAIL_CUDA_CHECK_LAUNCH();
  std::vector<Communicator::PeerCopy> leg;
  for (int p = 0; p < R; ++p) {
    const int n = p / G;
    if (p == me) continue;
    if (n == my_node) {
      leg.push_back({p, send_area + off + std::size_t(p) * slice, recv_area + off + std::size_t(p) * slice, seg});
    } else if (p % G == me % G) {
      leg.push_back({p, union_send + std::size_t(n) * node_bytes, union_recv + std::size_t(n) * node_bytes, node_bytes});
      leg.push_back({p, reinterpret_cast<const char*>(h.node_fan_) + std::size_t(n) * fan_row,
                     reinterpret_cast<char*>(fan_to) + std::size_t(n) * fan_row, fan_row});
    }
  }
  comm.exchange_list(leg, stream, op);
  ep::forward_rows_kernel<<<blocks, ep::kWarps * 32, 0, stream>>>(m);
  MOERAIL_CUDA_CHECK_LAUNCH();
  leg.clear();
  for (int g = 0; g < G; ++g) {
    const int r = my_node * G + g;
    if (r == me) continue;
    for (int n = 0; n < N; ++n) {
      if (n == my_node) continue;
      leg.push_back({r, fwd_send + (std::size_t(g) * N + n) * seg,
                     recv_area + off + std::size_t(n * G + g) * slice, seg});
    }
  }
  comm.exchange_list(leg, stream, op);
}

namespace {

// The sums' reverse of transfer_down (ep_hier.cuh), between the gather's pack (its producers told to sum only for
// the sources of this rank's node: p.plan.node_ranks) and its unpack: the fp32 partials for the remote sources go
// to their forwarders inside the node, the forwarders' node partials to the sources with the segments inside the
// node, and the sources spread each node partial over the places of its ranks.
template <typename Elem>
void transfer_up(Dispatcher::Impl& d, const DispatchHandle& h, const ep::Params& p, const void* rows, bool weighted,
                 cudaStream_t stream, const char* op) {
  const int me = d.me, G = d.G, N = d.N, my_node = me / G;
  const std::size_t row_bytes = d.row_bytes(), slice = d.stage_slice(), seg = std::size_t(d.peer_rows) * row_bytes;
  const std::size_t node_bytes = std::size_t(d.node_rows) * row_bytes;
  const std::size_t seg32 = std::size_t(d.peer_rows) * std::size_t(d.H) * 4;
  const ep::HierSum sum{me, G, N, d.K, int(d.t_max), int(d.node_rows), int(d.peer_rows), p.nvec, weighted,
                        static_cast<const char*>(rows), p.plan.slot_rows, p.plan.slot_probs, p.plan.staged,
                        Dispatcher::Impl::fwd_fan(h), d.part_send, d.part_recv, d.union_send};
  ep::node_partials_kernel<Elem><<<d.blocks, ep::kWarps * 32, 0, stream>>>(sum);
  MOERAIL_CUDA_CHECK_LAUNCH();
  std::vector<Communicator::PeerCopy> leg;
  for (int g = 0; g < G; ++g) {
    const int q = my_node * G + g;
    if (q == me) continue;
    for (int n = 0; n < N; ++n) {
      if (n == my_node) continue;
      const std::size_t at = (std::size_t(g) * N + n) * seg32;
      leg.push_back({q, reinterpret_cast<const char*>(d.part_send) + at, reinterpret_cast<char*>(d.part_recv) + at,
                     seg32});
    }
  }
  d.comm.exchange_list(leg, stream, op);
  ep::node_sum_kernel<Elem><<<d.blocks, ep::kWarps * 32, 0, stream>>>(sum);
  MOERAIL_CUDA_CHECK_LAUNCH();
  leg.clear();
  const std::size_t off = d.reg.stage;
  for (int q = 0; q < d.R; ++q) {
    const int n = q / G;
    if (q == me) continue;
    if (n == my_node)
      leg.push_back({q, d.send_area + off + std::size_t(q) * slice, d.recv_area + off + std::size_t(q) * slice, seg});
    else if (q % G == me % G)
      leg.push_back({q, d.union_send + std::size_t(n) * node_bytes, d.union_recv + std::size_t(n) * node_bytes,
                     node_bytes});
  }
  d.comm.exchange_list(leg, stream, op);
  const ep::HierMove m{me, G, N, d.K, int(d.t_max), int(d.node_rows), int(d.peer_rows),
                       h.layout().dest_rank.as<const std::int32_t>(), off, row_bytes,
                       Dispatcher::Impl::node_tok(h), Dispatcher::Impl::node_fan(h),
                       h.layout().node_staged.as<const std::int32_t>(), nullptr, d.send_area, d.recv_area,
                       d.union_send, d.union_recv, d.fwd_send};
  ep::unfold_kernel<<<d.blocks, ep::kWarps * 32, 0, stream>>>(m);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

}  // namespace

// ---- argument checks ----------------------------------------------------------------------------------------------

namespace {

void check_rows(std::string_view op, std::string_view name, const TensorView& v, const Dispatcher::Impl& d,
                std::int64_t min_rows) {
  check_shape(op, name, v, {-1, std::int64_t(d.H)});
  check_dtype(op, name, v, {d.cfg.dtype});
  check_device(op, name, v, Device::cuda(d.comm.device()));
  if (v.size(0) < min_rows) fail(op, name, " has ", v.size(0), " rows (expected at least ", min_rows, ")");
  if (!cuda::aligned16(v.data())) fail(op, name, " is not 16-byte aligned");
}

void check_vec(std::string_view op, std::string_view name, const TensorView& v, const Dispatcher::Impl& d,
               std::initializer_list<std::int64_t> shape, DType t) {
  check_shape(op, name, v, shape);
  check_dtype(op, name, v, {t});
  check_device(op, name, v, Device::cuda(d.comm.device()));
}

}  // namespace

// ---- ops ------------------------------------------------------------------------------------------------------------

namespace {

// What plan(), dispatch() and dispatch_fp8() check alike: the routing inputs.
void check_routing(std::string_view op, const Dispatcher::Impl& d, const TensorView& topk_idx, const TensorView& probs,
                   const TensorView& num_tokens) {
  const std::int64_t T = d.t_max, K = d.K;
  check_vec(op, "topk_idx", topk_idx, d, {T, K}, DType::I32);
  check_vec(op, "probs", probs, d, {T, K}, DType::F32);
  check_vec(op, "num_tokens", num_tokens, d, {1}, DType::I32);
}

void check_recv_probs(std::string_view op, const Dispatcher::Impl& d, const TensorView& recv_probs,
                      std::int64_t rows) {
  check_vec(op, "recv_probs", recv_probs, d, {recv_probs.defined() ? recv_probs.size(0) : 0}, DType::F32);
  if (recv_probs.size(0) < rows)
    fail(op, "recv_probs has ", recv_probs.size(0), " rows (expected at least ", rows, ")");
}

// 32-bit scale words per row of an FP8 dispatch: H / 128 f32 scales (Block1x128), H / 32 E8M0 bytes = H / 128 words
// (Mx1x32), none (PerTensor: one scale for all rows, given by the caller).
std::int64_t fp8_scale_words(Fp8Scaling s, std::int64_t H) {
  return s == Fp8Scaling::PerTensor ? 0 : H / kBlockScaleCols;
}

// The staged row of an FP8 dispatch: H e4m3 bytes, then the scale words, rounded up to 16 bytes.
std::size_t fp8_wire_bytes(Fp8Scaling s, std::int64_t H) {
  return (std::size_t(H) + std::size_t(fp8_scale_words(s, H)) * 4 + 15) / 16 * 16;
}

// Plans a dispatch: the local planner, the count exchange and this rank's layout (into h, base and limit).
void plan_dispatch(Dispatcher::Impl& d, const DispatchHandle& h, const TensorView& topk_idx, const TensorView& probs,
                   const TensorView& num_tokens, cudaStream_t stream) {
  LayoutArgs la;
  la.topk_idx = topk_idx;
  la.topk_probs = probs;
  la.num_tokens = num_tokens;
  la.out = d.local_layout;
  la.status = d.scratch;
  la.workspace = TensorView(d.local_ws, DType::I32, {std::int64_t(d.local_ws_bytes / 4)}, topk_idx.device());
  plan_layout(d.local_cfg, la, stream);
  launch_plan(d, h, topk_idx, num_tokens, stream);
}

// Plans this step (unless plan() did), then moves the rows: one fused launch on NvLink, pack -> send/recv -> unpack
// on HostApi. `p` holds the payload fields (rows, vectors, FP8 fields); `kernel` is the scatter_kernel instance for
// it; stage_row is the bytes of one staged row.
template <typename Kernel>
void plan_and_scatter(Dispatcher::Impl& d, const DispatchHandle& h, bool planned, const TensorView& topk_idx,
                      const TensorView& probs, const TensorView& num_tokens, ep::Params p, Kernel kernel,
                      std::size_t stage_row, cudaStream_t stream) {
  if (!planned) plan_dispatch(d, h, topk_idx, probs, num_tokens, stream);

  p.tok.num_tokens = num_tokens.as<const std::int32_t>();
  p.tok.topk_idx = topk_idx.as<const std::int32_t>();
  p.tok.probs = probs.as<const float>();
  if (d.nvlink() || d.R == 1) {
    p.role = fused_role(d, false);
    p.zero_pads = true;
    launch_data(d, kernel, p, stream);
    return;
  }
  p.role = ep::kProduce;
  launch_data(d, kernel, p, stream);
  d.transfer(d.reg.meta, d.k_row(), stream, "dispatch (send/recv)");
  d.transfer(d.reg.probs, d.k_row(), stream, "dispatch (send/recv)");
  d.transfer_down(d.reg.stage, stage_row, h, Dispatcher::Impl::fwd_fan(h), stream, "dispatch (send/recv)");
  p.role = ep::kConsume;
  p.zero_pads = true;
  launch_data(d, kernel, p, stream);
}

}  // namespace

std::int64_t Dispatcher::plan(const EpPlanArgs& a, DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "plan";
  Impl& d = *impl_;
  d.last_op = "plan";
  Impl::check_handle(op, this, h, false);
  check_routing(op, d, a.topk_idx, a.probs, a.num_tokens);
  d.planned = nullptr;
  h.planned_ = {};
  h.filled_ = false;
  plan_dispatch(d, h, a.topk_idx, a.probs, a.num_tokens, stream);
  std::int32_t rows = 0;
  MOERAIL_CUDA_CHECK(cudaMemcpyAsync(&rows, h.layout().rows_used.data(), sizeof rows, cudaMemcpyDeviceToHost, stream));
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  h.layout_.capacity = rows;
  h.planned_ = {a.topk_idx.data(), a.probs.data(), a.num_tokens.data()};
  d.planned = h.memory_.data();
  return rows;
}

void Dispatcher::dispatch(const EpDispatchArgs& a, DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "dispatch";
  Impl& d = *impl_;
  d.last_op = "dispatch";
  Impl::check_handle(op, this, h, false);
  check_routing(op, d, a.topk_idx, a.probs, a.num_tokens);
  const std::int64_t rows = d.rows_for(op, h, a.topk_idx, a.probs, a.num_tokens);
  check_rows(op, "x", a.x, d, d.t_max);
  check_rows(op, "recv", a.recv, d, rows);
  check_recv_probs(op, d, a.recv_probs, rows);
  const bool planned = d.take_plan(h);
  h.filled_ = false;
  with_dtype(d.cfg.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    ep::Params p = d.params(0, h);
    p.tok.src = a.x.data();
    p.rows.dst = a.recv.data();
    p.rows.recv_probs = a.recv_probs.as<float>();
    plan_and_scatter(d, h, planned, a.topk_idx, a.probs, a.num_tokens, p, ep::scatter_kernel<T_, true>,
                     std::size_t(p.nvec) * 16, stream);
  });
  h.filled_ = true;
}

void Dispatcher::dispatch_fp8(const EpDispatchFp8Args& a, DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "dispatch_fp8";
  Impl& d = *impl_;
  d.last_op = "dispatch_fp8";
  Impl::check_handle(op, this, h, false);
  check_routing(op, d, a.topk_idx, a.probs, a.num_tokens);
  const std::int64_t rows = d.rows_for(op, h, a.topk_idx, a.probs, a.num_tokens);
  if (d.cfg.dtype != DType::BF16)
    fail_with(ErrorCode::Unsupported, op, "cfg.dtype = ", dtype_name(d.cfg.dtype), " (expected bf16: the FP8 dispatch feeds a bf16 layer)");
  const Fp8Scaling sc = a.scaling;
  if (sc != Fp8Scaling::PerTensor && sc != Fp8Scaling::Block1x128 && sc != Fp8Scaling::Mx1x32)
    fail(op, "scaling = ", int(sc), " is not one of {PerTensor, Block1x128, Mx1x32}");
  if (d.H % kBlockScaleCols != 0)
    fail_with(ErrorCode::Unsupported, op, "cfg.hidden = ", d.H, " (the FP8 dispatch quantizes 128-column groups of ",
              "16 columns per lane: expected a multiple of ", kBlockScaleCols, ")");
  const std::int64_t H = d.H;
  const Device dev = Device::cuda(d.comm.device());
  const bool given = a.q.defined();  // rows quantized by the caller: moved as bytes
  if (given == a.x.defined())
    fail(op, given ? "both x and q are given (expected one: bf16 x to quantize, or e4m3 q with q_scales)"
                   : "neither x nor q is given (expected one: bf16 x to quantize, or e4m3 q with q_scales)");
  if (given) {
    check_shape(op, "q", a.q, {-1, H});
    check_dtype(op, "q", a.q, {DType::F8E4M3});
    check_device(op, "q", a.q, dev);
    if (a.q.size(0) < d.t_max) fail(op, "q has ", a.q.size(0), " rows (expected at least ", d.t_max, ")");
    if (!cuda::aligned16(a.q.data())) fail(op, "q is not 16-byte aligned");
    if (sc == Fp8Scaling::PerTensor) {
      if (a.q_scales.defined()) fail(op, "q_scales is given for PerTensor (every row's scale is recv_scales)");
    } else {
      check_shape(op, "q_scales", a.q_scales, {-1, H / fp8_scale_block_cols(sc)});
      check_dtype(op, "q_scales", a.q_scales, {fp8_scale_dtype(sc)});
      check_device(op, "q_scales", a.q_scales, dev);
      if (a.q_scales.size(0) < d.t_max)
        fail(op, "q_scales has ", a.q_scales.size(0), " rows (expected at least ", d.t_max, ")");
      if (reinterpret_cast<std::uintptr_t>(a.q_scales.data()) % 4 != 0)
        fail(op, "q_scales is not 4-byte aligned (its rows are moved as 32-bit words)");
    }
  } else {
    check_rows(op, "x", a.x, d, d.t_max);
    if (a.q_scales.defined()) fail(op, "q_scales is given without q");
  }
  check_shape(op, "recv", a.recv, {-1, H});
  check_dtype(op, "recv", a.recv, {DType::F8E4M3});
  check_device(op, "recv", a.recv, dev);
  if (a.recv.size(0) < rows) fail(op, "recv has ", a.recv.size(0), " rows (expected at least ", rows, ")");
  if (!cuda::aligned16(a.recv.data())) fail(op, "recv is not 16-byte aligned");
  const bool no_scale = given && sc == Fp8Scaling::PerTensor && !a.recv_scales.defined();  // not read then
  if (!no_scale) {
    check_device(op, "recv_scales", a.recv_scales, dev);
    check_dtype(op, "recv_scales", a.recv_scales, {fp8_scale_dtype(sc)});
  }
  if (sc == Fp8Scaling::PerTensor) {
    if (!no_scale) check_shape(op, "recv_scales", a.recv_scales, {1});
  } else {
    check_shape(op, "recv_scales", a.recv_scales, {-1, H / fp8_scale_block_cols(sc)});
    if (a.recv_scales.size(0) < rows)
      fail(op, "recv_scales has ", a.recv_scales.size(0), " rows (expected at least ", rows, ")");
    if (reinterpret_cast<std::uintptr_t>(a.recv_scales.data()) % 4 != 0)
      fail(op, "recv_scales is not 4-byte aligned (its rows are moved as 32-bit words)");
  }
  check_recv_probs(op, d, a.recv_probs, rows);
  const bool planned = d.take_plan(h);
  h.filled_ = false;

  ep::Params p = d.params(0, h);
  p.nvec = H / 16;                          // e4m3 rows of recv (and of q)
  p.fp8.src_nvec = given ? p.nvec : H * 2 / 16; // rows of the source: e4m3 q or bf16 x
  p.fp8.scale_cols = int(fp8_scale_words(sc, H));
  p.fp8.wire_bytes = fp8_wire_bytes(sc, H);
  p.tok.src = given ? a.q.data() : a.x.data();
  p.fp8.tok_scales = given && sc != Fp8Scaling::PerTensor ? static_cast<const std::uint32_t*>(a.q_scales.data()) : nullptr;
  p.rows.dst = a.recv.data();
  p.rows.recv_probs = a.recv_probs.as<float>();
  if (sc == Fp8Scaling::PerTensor) {
    p.fp8.recv_scales = nullptr;
    p.fp8.tensor_scale = no_scale ? nullptr : a.recv_scales.as<const float>();
  } else {
    p.fp8.recv_scales = static_cast<std::uint32_t*>(a.recv_scales.data());
    p.fp8.pad_scale_word = sc == Fp8Scaling::Block1x128 ? 0x3f800000u   // 1.0f
                                                    : 0x7f7f7f7fu;  // four E8M0 codes 127 = 2^0
  }
  const auto scatter = [&](auto kernel) {
    plan_and_scatter(d, h, planned, a.topk_idx, a.probs, a.num_tokens, p, kernel, p.fp8.wire_bytes, stream);
  };
  if (given) {
    scatter(ep::scatter_kernel<__nv_bfloat16, true, ep::Payload::Fp8Given>);
  } else if (sc == Fp8Scaling::PerTensor) {
    scatter(ep::scatter_kernel<__nv_bfloat16, true, ep::Payload::Fp8PerTensor>);
  } else if (sc == Fp8Scaling::Block1x128) {
    scatter(ep::scatter_kernel<__nv_bfloat16, true, ep::Payload::Fp8Block1x128>);
  } else {
    scatter(ep::scatter_kernel<__nv_bfloat16, true, ep::Payload::Fp8Mx1x32>);
  }
  h.filled_ = true;
}

void Dispatcher::combine(const EpCombineArgs& a, const DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "combine";
  Impl& d = *impl_;
  d.last_op = "combine";
  Impl::check_handle(op, this, h, true);
  check_rows(op, "y", a.y, d, h.layout().capacity);
  check_rows(op, "out", a.out, d, d.t_max);
  with_dtype(d.cfg.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    ep::Params p = d.params(0, h);
    p.tok.num_tokens = p.plan.tokens + d.me;  // T as the handle's dispatch exchanged it
    p.in_combine = a.mode == ProbMode::InCombine;
    p.rows.src = a.y.data();
    p.tok.dst = a.out.data();
    if (d.nvlink() || d.R == 1) {
      p.role = fused_role(d, true);
      launch_gather<T_, true>(d, p, stream);
      return;
    }
    p.role = ep::kProduce;
    p.plan.node_ranks = d.G;
    launch_gather<T_, true>(d, p, stream);
    if (d.hier()) transfer_up<T_>(d, h, p, a.y.data(), p.in_combine, stream, "combine (send/recv)");
    else d.transfer(d.reg.stage, d.row_bytes(), stream, "combine (send/recv)");
    p.role = ep::kConsume;
    launch_gather<T_, true>(d, p, stream);
  });
}

void Dispatcher::dispatch_backward(const EpDispatchBackwardArgs& a, const DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "dispatch_backward";
  Impl& d = *impl_;
  d.last_op = "dispatch_backward";
  Impl::check_handle(op, this, h, true);
  check_rows(op, "d_recv", a.d_recv, d, h.layout().capacity);
  check_rows(op, "dx", a.dx, d, d.t_max);
  if (a.d_recv_probs.defined() != a.d_probs.defined())
    fail(op, "d_recv_probs and d_probs must be given together (or neither)");
  if (a.d_probs.defined()) {
    check_vec(op, "d_probs", a.d_probs, d, {d.t_max, std::int64_t(d.K)}, DType::F32);
    check_vec(op, "d_recv_probs", a.d_recv_probs, d, {a.d_recv_probs.size(0)}, DType::F32);
    if (a.d_recv_probs.size(0) < h.layout().capacity)
      fail(op, "d_recv_probs has ", a.d_recv_probs.size(0), " rows (expected at least ", h.layout().capacity, ")");
  }
  with_dtype(d.cfg.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    ep::Params p = d.params(0, h);
    p.tok.num_tokens = p.plan.tokens + d.me;  // T as the handle's dispatch exchanged it
    p.rows.src = a.d_recv.data();
    p.tok.dst = a.dx.data();
    p.rows.d_recv_probs = a.d_recv_probs.defined() ? a.d_recv_probs.as<const float>() : nullptr;
    p.tok.d_probs = a.d_probs.defined() ? a.d_probs.as<float>() : nullptr;
    if (d.nvlink() || d.R == 1) {
      p.role = fused_role(d, true);
      launch_gather<T_, false>(d, p, stream);
      return;
    }
    p.role = ep::kProduce;
    p.plan.node_ranks = d.G;
    launch_gather<T_, false>(d, p, stream);
    if (d.hier()) transfer_up<T_>(d, h, p, a.d_recv.data(), false, stream, "dispatch_backward (send/recv)");
    else d.transfer(d.reg.stage, d.row_bytes(), stream, "dispatch_backward (send/recv)");
    if (p.tok.d_probs) d.transfer(d.reg.ret, d.k_row(), stream, "dispatch_backward (send/recv)");
    p.role = ep::kConsume;
    launch_gather<T_, false>(d, p, stream);
  });
}

void Dispatcher::combine_backward(const EpCombineBackwardArgs& a, const DispatchHandle& h, cudaStream_t stream) {
  constexpr std::string_view op = "combine_backward";
  Impl& d = *impl_;
  d.last_op = "combine_backward";
  Impl::check_handle(op, this, h, true);
  const bool in_combine = a.mode == ProbMode::InCombine;
  const std::int64_t rows = h.layout().capacity;
  check_rows(op, "d_out", a.d_out, d, d.t_max);
  check_rows(op, "d_y", a.d_y, d, rows);
  if (in_combine) check_rows(op, "y", a.y, d, rows);
  if (a.d_probs.defined()) check_vec(op, "d_probs", a.d_probs, d, {d.t_max, std::int64_t(d.K)}, DType::F32);
  with_dtype(d.cfg.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    ep::Params p = d.params(0, h);
    p.tok.num_tokens = p.plan.tokens + d.me;  // T as the handle's dispatch exchanged it
    p.in_combine = in_combine;
    p.tok.src = a.d_out.data();
    p.rows.dst = a.d_y.data();
    p.rows.y = in_combine ? a.y.data() : nullptr;
    p.tok.d_probs = a.d_probs.defined() ? a.d_probs.as<float>() : nullptr;
    if (d.nvlink() || d.R == 1) {
      p.role = fused_role(d, false) | ep::kCollect;
      p.zero_pads = true;
      launch_data(d, ep::scatter_kernel<T_, false>, p, stream);
      return;
    }
    p.role = ep::kProduce;
    launch_data(d, ep::scatter_kernel<T_, false>, p, stream);
    d.transfer_down(d.reg.stage, d.row_bytes(), h, d.fan_recv, stream, "combine_backward (send/recv)");
    p.role = ep::kConsume;
    p.zero_pads = true;
    launch_data(d, ep::scatter_kernel<T_, false>, p, stream);
    if (in_combine && p.tok.d_probs) {
      d.transfer(d.reg.ret, d.k_row(), stream, "combine_backward (send/recv)");
      p.role = ep::kCollect;
      p.zero_pads = false;
      launch_data(d, ep::scatter_kernel<T_, false>, p, stream);
    }
  });
}

namespace {

// Rows [*used, capacity) of `rows` (row_vecs 16-byte vectors each) and of `probs` (if any) set to zero.
__global__ void zero_rows_past_kernel(uint4* rows, long long row_vecs, float* probs, const std::int32_t* used,
                                      long long capacity) {
  const long long first = min((long long)max(*used, 0), capacity);
  const long long n = (capacity - first) * row_vecs;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    rows[first * row_vecs + i] = make_uint4(0, 0, 0, 0);
  if (probs)
    for (long long r = first + (long long)blockIdx.x * blockDim.x + threadIdx.x; r < capacity; r += stride)
      probs[r] = 0.f;
}

}  // namespace

void Dispatcher::zero_unused_rows(const TensorView& recv, const TensorView& recv_probs, const DispatchHandle& h,
                                  cudaStream_t stream) {
  constexpr std::string_view op = "zero_unused_rows";
  Impl& d = *impl_;
  Impl::check_handle(op, this, h, true);
  const std::int64_t rows = h.layout().capacity;
  const Device dev = Device::cuda(d.comm.device());
  check_device(op, "recv", recv, dev);
  if (recv.ndim() != 2 || recv.size(0) < rows)
    fail(op, "recv has shape ", recv.shape_str(), " (expected [>= ", rows, ", columns])");
  const std::size_t row_bytes = std::size_t(recv.size(1)) * dtype_size(recv.dtype());
  if (row_bytes % 16 != 0 || !cuda::aligned16(recv.data()))
    fail(op, "recv rows are ", row_bytes, " bytes at ", recv.data(), " (expected 16-byte aligned rows)");
  if (recv_probs.defined()) {
    check_vec(op, "recv_probs", recv_probs, d, {recv_probs.size(0)}, DType::F32);
    if (recv_probs.size(0) < rows)
      fail(op, "recv_probs has ", recv_probs.size(0), " rows (expected at least ", rows, ")");
  }
  zero_rows_past_kernel<<<std::max(1, cuda::sm_count() * 4), 256, 0, stream>>>(
      static_cast<uint4*>(recv.data()), (long long)(row_bytes / 16),
      recv_probs.defined() ? recv_probs.as<float>() : nullptr, h.layout().rows_used.as<const std::int32_t>(),
      (long long)rows);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

// ---- the default handle: one microbatch at a time ------------------------------------------------------------------

void Dispatcher::dispatch(const EpDispatchArgs& a, cudaStream_t stream) { dispatch(a, impl_->default_handle, stream); }
void Dispatcher::dispatch_fp8(const EpDispatchFp8Args& a, cudaStream_t stream) {
  dispatch_fp8(a, impl_->default_handle, stream);
}
void Dispatcher::combine(const EpCombineArgs& a, cudaStream_t stream) { combine(a, impl_->default_handle, stream); }
void Dispatcher::dispatch_backward(const EpDispatchBackwardArgs& a, cudaStream_t stream) {
  dispatch_backward(a, impl_->default_handle, stream);
}
void Dispatcher::combine_backward(const EpCombineBackwardArgs& a, cudaStream_t stream) {
  combine_backward(a, impl_->default_handle, stream);
}

}  // namespace moerail
