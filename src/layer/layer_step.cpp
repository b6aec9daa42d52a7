// src/layer/layer_step.cpp — the launch sequence of a MoeLayer step: MoeLayer::Impl::run_forward, run_backward and
// the per-chunk ops they issue (the layer's setup and buffers: layer.cpp; its private state: layer_impl.h).
//
// Forward   main:  gate (logits = x W_r^T) -> router -> dispatch -> experts -> combine (out) -> out += shared
//           side:  shared expert (x -> s_y)                                          joins before the add
// Backward  main:  combine bwd -> experts bwd (data) -> dispatch bwd -> router bwd -> gate bwd -> experts' weight
//                  gradients -> dx = sum
//           side:  shared expert bwd (data + weights)                                joins before the sum
// Probs' gradient: under InActivation it comes from the experts through the dispatch backward; under InCombine
// from the combine backward (the other path gives zeros), so each writes d_topk_probs directly.
//
// Chunked step (options.chunks = C > 1): chunk c is tokens [c Tc, (c + 1) Tc) (Tc = T_max / C) with a Dispatcher
// of its own and region c of the expert buffers (rows [c S, c S + R), R = one dispatcher's capacity, S = R rounded
// up to 8 rows so that every region's f32 rows start 16-byte aligned).
// Forward   main:  gate -> router -> split T ->  experts(0)  experts(1) ...  experts(C-1)        -> join -> counts
//           comm:                  dispatch(0) dispatch(1) combine(0) dispatch(2) combine(1) ... combine(C-1)
// Backward  comm:  combine bwd(0) combine bwd(1) dispatch bwd(0) ... dispatch bwd(C-1)
//           main:                 experts bwd(0) experts bwd(1) ... -> join -> router bwd -> gate bwd -> wgrad (all
//                                 chunks' rows, MlpBackwardDwArgs::chunk_rows) -> dx = sum
// Each arrow between the streams is an event; the communication ops of the chunks run in the same order on every
// rank.
#include <cstdint>

#include "core/cuda_check.h"
#include "layer/chunks.h"
#include "layer/layer_impl.h"
#include "layer/sum_rows.h"
#include "moerail/quant.h"
#include "moerail/router.h"

namespace moerail {
namespace {

// `after` waits for everything `before` has queued so far.
void order(cudaStream_t before, cudaStream_t after, cudaEvent_t e) {
  MOERAIL_CUDA_CHECK(cudaEventRecord(e, before));
  MOERAIL_CUDA_CHECK(cudaStreamWaitEvent(after, e, 0));
}

TensorView as_3d(const TensorView& t) {  // [a, b] -> [1, a, b]: one expert's weight as a grouped tensor
  return TensorView(t.data(), t.dtype(), {1, t.size(0), t.size(1)}, t.device());
}

}  // namespace

void MoeLayer::Impl::dispatch_chunk(int c, Saved& v, cudaStream_t st) {
  if (per_tensor()) {  // bf16 rows cross the links (a scale every rank agrees on would need the step's global
    // amax first); each expert's rows are then quantized with their own scale. The bf16 rows land in d_recv, the
    // backward's scratch (free in a forward; d_recv is y's memory when y is not saved, and FC2 writes y later).
    const TensorView recv = region(d_recv, c);
    dispatcher(c).dispatch({tokens(v.forward.x, c), tokens(v.topk_idx, c), tokens(v.topk_probs, c),
                            num_tokens_of(v, c), recv, region(v.recv_probs, c)},
                           v.handles[std::size_t(c)], st);
    quantize_fp8_experts({recv, expert_counts(v, c), region(v.recv, c), v.recv_scales}, st);
    return;
  }
  if (fp8) {  // x quantized at the source: e4m3 rows and their 1x128 scales cross the links
    EpDispatchFp8Args a;
    a.x = tokens(v.forward.x, c);
    a.topk_idx = tokens(v.topk_idx, c);
    a.probs = tokens(v.topk_probs, c);
    a.num_tokens = num_tokens_of(v, c);
    a.recv = region(v.recv, c);
    a.recv_scales = region(v.recv_scales, c);
    a.recv_probs = region(v.recv_probs, c);
    a.scaling = Fp8Scaling::Block1x128;
    dispatcher(c).dispatch_fp8(a, v.handles[std::size_t(c)], st);
    return;
  }
  dispatcher(c).dispatch({tokens(v.forward.x, c), tokens(v.topk_idx, c), tokens(v.topk_probs, c),
                          num_tokens_of(v, c), region(v.recv, c), region(v.recv_probs, c)},
                         v.handles[std::size_t(c)], st);
}

void MoeLayer::Impl::experts_chunk(int c, const Saved& v, cudaStream_t st) {
  if (fp8) {
    fp8->forward({region(v.recv, c), region(v.recv_scales, c), region(v.recv_probs, c), expert_counts(v, c),
                  fp8_weights, region(v.y, c), region(v.h1, c), region(v.act, c), fp8_fwd_ws},
                 st);
    return;
  }
  MlpForwardArgs m;
  m.x = region(v.recv, c);
  m.probs = region(v.recv_probs, c);
  m.counts = expert_counts(v, c);
  m.weights = v.forward.weights.experts;
  m.y = region(v.y, c);
  m.h1 = region(v.h1, c);
  m.act = region(v.act, c);
  experts->forward(m, st);
}

void MoeLayer::Impl::combine_chunk(int c, const Saved& v, cudaStream_t st) {
  dispatcher(c).combine({cfg.prob_mode, region(v.y, c), tokens(v.forward.out, c)}, v.handles[std::size_t(c)],
                        st);
}

void MoeLayer::Impl::combine_backward_chunk(int c, const Saved& v, const MoeBackwardArgs& b, cudaStream_t st) {
  const bool in_combine = cfg.prob_mode == ProbMode::InCombine;
  dispatcher(c).combine_backward({cfg.prob_mode, tokens(b.d_out, c), in_combine ? region(v.y, c) : TensorView(),
                                  region(d_y, c), in_combine ? tokens(d_topk_probs, c) : TensorView()},
                                 v.handles[std::size_t(c)], st);
}

void MoeLayer::Impl::experts_data_chunk(int c, const Saved& v, cudaStream_t st) {
  const bool in_combine = cfg.prob_mode == ProbMode::InCombine;
  if (fp8) {  // data gradients; the weight gradients come last (run_backward)
    Fp8MlpBackwardArgs m = fp8_backward_args(v, c);
    m.dx = region(d_recv, c);
    m.d_probs = in_combine ? TensorView() : region(d_recv_probs, c);
    m.d_h1 = region(d_h1, c);
    m.workspace = mlp_ws;
    m.wgrad_operands = Fp8WgradOperands::Stage;  // the weight gradients' copies of dy and d_h1 from the same passes
    fp8->backward(m, st);
    return;
  }
  MlpBackwardArgs m;
  m.x = region(v.recv, c);
  m.probs = region(v.recv_probs, c);
  m.counts = expert_counts(v, c);
  m.weights = v.forward.weights.experts;
  m.h1 = region(v.h1, c);
  m.act = region(v.act, c);
  m.dy = region(d_y, c);
  m.dx = region(d_recv, c);
  m.d_probs = in_combine ? TensorView() : region(d_recv_probs, c);
  m.d_h1 = region(d_h1, c);
  m.workspace = mlp_ws;
  experts->backward(m, st);  // data gradients; the weight gradients come last (run_backward)
}

void MoeLayer::Impl::dispatch_backward_chunk(int c, const Saved& v, const MoeBackwardArgs& b, cudaStream_t st) {
  const bool in_combine = cfg.prob_mode == ProbMode::InCombine;
  dispatcher(c).dispatch_backward({region(d_recv, c), in_combine ? TensorView() : region(d_recv_probs, c),
                                   tokens(b.dx, c), in_combine ? TensorView() : tokens(d_topk_probs, c)},
                                  v.handles[std::size_t(c)], st);
}

void MoeLayer::Impl::run_forward(Saved& v, cudaStream_t s) {
  const MoeForwardArgs& a = v.forward;
  const MoeLayerWeights& w = a.weights;
  stamp(fwd_ev, 0, s);
  if (shared) {
    order(s, side.s, fork.e);
    stamp(s_fwd0, side.s);
    MlpForwardArgs m;
    m.x = a.x;
    m.counts = a.num_tokens;
    m.weights.w1 = as_3d(w.shared_w1);
    m.weights.w2 = as_3d(w.shared_w2);
    m.y = shared_y();
    m.h1 = v.s_h1;
    m.act = v.s_act;
    shared_mlp->forward(m, side.s);
    stamp(s_fwd1, side.s);
  }
  gate->forward(a.x, w.router, a.num_tokens, v.logits, s);
  RouterForwardArgs r;
  r.logits = v.logits;
  r.expert_bias = w.expert_bias;
  r.num_tokens = a.num_tokens;
  r.topk_idx = v.topk_idx;
  r.topk_probs = v.topk_probs;
  r.losses = v.losses;
  if (cfg.router.aux_loss_coeff > 0) r.aux_tokens_per_expert = v.tpe;
  r.status = status;
  r.workspace = router_ws;
  if (cfg.router.aux_loss_coeff <= 0 && cfg.router.z_loss_coeff <= 0)  // the router writes none: zeros
    MOERAIL_CUDA_CHECK(cudaMemsetAsync(v.losses.data(), 0, v.losses.nbytes(), s));
  router_forward(cfg, r, s);
  stamp(fwd_ev, 1, s);
  if (C == 1) {
    dispatch_chunk(0, v, s);
    stamp(fwd_ev, 2, s);
    experts_chunk(0, v, s);
    stamp(fwd_ev, 3, s);
    combine_chunk(0, v, s);
  } else {
    // Stage times: dispatch = chunk 0's, experts = from there to the last chunk's experts (the communication of
    // the other chunks beside them), combine = the last chunk's after its experts.
    const cudaStream_t comm = comm_stream.s;
    layer::launch_split_tokens(a.num_tokens.as<const std::int32_t>(), v.chunk_tokens.as<std::int32_t>(), C, Tc, s);
    order(s, comm, to_comm.e);
    dispatch_chunk(0, v, comm);
    stamp(fwd_ev, 2, comm);
    order(comm, s, to_main.e);
    experts_chunk(0, v, s);
    for (int c = 1; c < C; ++c) {
      dispatch_chunk(c, v, comm);
      MOERAIL_CUDA_CHECK(cudaEventRecord(to_main.e, comm));  // dispatch(c) done
      order(s, comm, to_comm.e);                             // experts(c - 1) done
      combine_chunk(c - 1, v, comm);
      MOERAIL_CUDA_CHECK(cudaStreamWaitEvent(s, to_main.e, 0));
      experts_chunk(c, v, s);
    }
    stamp(fwd_ev, 3, s);
    order(s, comm, to_comm.e);
    combine_chunk(C - 1, v, comm);
    order(comm, s, to_main.e);
    layer::GatherCountsParams g;
    for (int c = 0; c < C; ++c) g.rows[c] = expert_counts(v, c).as<const std::int32_t>();
    g.chunks = C;
    g.L = int(L);
    g.all = v.chunk_rows.as<std::int32_t>();
    g.total = v.expert_rows_total.as<std::int32_t>();
    layer::launch_gather_counts(g, s);
  }
  stamp(fwd_ev, 4, s);
  if (shared) {
    order(side.s, s, join_shared.e);
    layer::SumRowsParams p;
    p.dst = a.out.data();
    p.src[0] = a.out.data();
    p.src[1] = shared_y().data();
    p.num_src = 2;
    p.width = H;
    p.t_max = T_max;
    p.num_tokens = a.num_tokens.as<const std::int32_t>();
    layer::launch_sum_rows_bf16(p, s);
  }
  stamp(fwd_ev, 5, s);
}

void MoeLayer::Impl::run_backward(const Saved& v, const MoeBackwardArgs& b, cudaStream_t s) {
  const MoeForwardArgs& f = v.forward;
  const MoeLayerWeights& w = f.weights;
  stamp(bwd_ev, 0, s);
  if (shared) {
    order(s, side.s, fork.e);
    stamp(s_bwd0, side.s);
    MlpBackwardArgs m;
    m.x = f.x;
    m.counts = f.num_tokens;
    m.weights.w1 = as_3d(w.shared_w1);
    m.weights.w2 = as_3d(w.shared_w2);
    m.h1 = v.s_h1;
    m.act = v.s_act;
    m.dy = b.d_out;
    m.dx = s_dx;
    m.d_h1 = s_d_h1;
    m.workspace = s_ws;
    m.grads.dw1 = as_3d(b.grads.d_shared_w1);
    m.grads.dw2 = as_3d(b.grads.d_shared_w2);
    shared_mlp->backward(m, side.s);
    stamp(s_bwd1, side.s);
  }
  if (C == 1) {
    combine_backward_chunk(0, v, b, s);
    stamp(bwd_ev, 1, s);
    experts_data_chunk(0, v, s);
    stamp(bwd_ev, 2, s);
    dispatch_backward_chunk(0, v, b, s);
  } else {
    // Stage times as in the forward: combine = chunk 0's, experts = up to the last chunk's data gradients,
    // dispatch = the last chunk's after them.
    const cudaStream_t comm = comm_stream.s;
    order(s, comm, to_comm.e);
    combine_backward_chunk(0, v, b, comm);
    stamp(bwd_ev, 1, comm);
    order(comm, s, to_main.e);
    experts_data_chunk(0, v, s);
    for (int c = 1; c < C; ++c) {
      combine_backward_chunk(c, v, b, comm);
      MOERAIL_CUDA_CHECK(cudaEventRecord(to_main.e, comm));  // combine backward(c) done
      order(s, comm, to_comm.e);                             // data gradients(c - 1) done
      dispatch_backward_chunk(c - 1, v, b, comm);
      MOERAIL_CUDA_CHECK(cudaStreamWaitEvent(s, to_main.e, 0));
      experts_data_chunk(c, v, s);
    }
    stamp(bwd_ev, 2, s);
    order(s, comm, to_comm.e);
    dispatch_backward_chunk(C - 1, v, b, comm);
    order(comm, s, to_main.e);
  }
  stamp(bwd_ev, 3, s);
  RouterBackwardArgs r;
  r.logits = v.logits;
  r.num_tokens = f.num_tokens;
  r.topk_idx = v.topk_idx;
  r.d_topk_probs = d_topk_probs;
  if (cfg.router.aux_loss_coeff > 0) r.aux_tokens_per_expert = v.tpe;
  r.d_aux_loss = b.d_aux_loss;
  r.d_z_loss = b.d_z_loss;
  r.d_losses = b.d_losses;
  r.d_logits = d_logits;
  router_backward(cfg, r, s);
  gate->backward(f.x, w.router, f.num_tokens, d_logits, dx_router, b.grads.d_router, s);
  // The expert weight gradients after the rest, not beside the dispatch backward on a stream of their own: the
  // persistent GEMM holds every SM, so the kernels "beside" it waited for SMs and stretched the step
  // (docs/layer.md).
  stamp(bwd_ev, 4, s);
  if (fp8) {
    Fp8MlpBackwardArgs m = fp8_backward_args(v, 0);  // the FP8 recipe runs unchunked (C = 1: checked at setup)
    m.d_h1 = d_h1;
    m.dw1 = b.grads.experts.dw1;
    m.dw2 = b.grads.experts.dw2;
    m.accumulate_weight_grads = b.grads.experts.accumulate;
    m.workspace = mlp_ws;  // untouched since experts_data_chunk staged the copies in it
    m.wgrad_operands = Fp8WgradOperands::Staged;
    fp8->backward(m, s);
  } else {
    MlpBackwardDwArgs dw;
    dw.x = v.recv;
    dw.probs = v.recv_probs;
    dw.counts = C == 1 ? expert_counts(v, 0) : v.chunk_rows;
    dw.chunk_rows = C == 1 ? 0 : stride;
    dw.act = v.act;
    dw.dy = d_y;
    dw.d_h1 = d_h1;
    dw.grads = b.grads.experts;
    (experts_dw ? experts_dw : experts)->backward_dw(dw, s);
  }
  stamp(bwd_ev, 5, s);
  if (shared) order(side.s, s, join_shared.e);
  layer::SumRowsParams p;
  p.dst = b.dx.data();
  p.src[0] = b.dx.data();
  p.src[1] = dx_router.data();
  p.src[2] = shared ? s_dx.data() : nullptr;
  p.num_src = shared ? 3 : 2;
  p.width = H;
  p.t_max = T_max;
  p.num_tokens = f.num_tokens.as<const std::int32_t>();
  layer::launch_sum_rows_bf16(p, s);
  stamp(bwd_ev, 6, s);
}

}  // namespace moerail
