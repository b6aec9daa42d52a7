// src/layer/layer.cpp — MoeLayer (moerail/layer.h): the buffers of one layer and the launch sequence of a step.
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
//
// Memory: the layer's scratch (forward scratch and the backward's own arrays) is one allocation; what a forward
// keeps for its backward is a MoeSaved (its memory the caller's, or the layer's default one).
#include "moerail/layer.h"

#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/log.h"
#include "core/sync.h"
#include "experts/device_linear.h"
#include "layer/chunks.h"
#include "layer/sum_rows.h"
#include "moerail/error.h"
#include "moerail/router.h"
#include "moerail/status.h"

namespace moerail {
namespace {

constexpr const char* kOp = "MoeLayer";

// Bump allocator over the layer's one allocation (256-byte aligned pieces); a dry run sizes it.
struct Arena {
  char* base = nullptr;
  std::size_t used = 0;
  int device = 0;
  TensorView take(DType dtype, std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    void* p = base ? base + used : nullptr;
    used += (std::size_t(n) * dtype_size(dtype) + 255) / 256 * 256;
    return base ? TensorView(p, dtype, shape, Device::cuda(device)) : TensorView();
  }
};

struct Event {
  cudaEvent_t e = nullptr;
  explicit Event(bool timing) {
    MOERAIL_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~Event() {
    if (e) (void)cudaEventDestroy(e);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() {
    if (s) (void)cudaStreamDestroy(s);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

// `after` waits for everything `before` has queued so far.
void order(cudaStream_t before, cudaStream_t after, cudaEvent_t e) {
  MOERAIL_CUDA_CHECK(cudaEventRecord(e, before));
  MOERAIL_CUDA_CHECK(cudaStreamWaitEvent(after, e, 0));
}

TensorView as_3d(const TensorView& t) {  // [a, b] -> [1, a, b]: one expert's weight as a grouped tensor
  return TensorView(t.data(), t.dtype(), {1, t.size(0), t.size(1)}, t.device());
}

// Rows [first, first + n) of a [rows] or [rows, cols] tensor.
TensorView rows_of(const TensorView& t, std::int64_t first, std::int64_t n) {
  const std::int64_t cols = t.ndim() == 2 ? t.size(1) : 1;
  void* p = static_cast<char*>(t.data()) + first * cols * std::int64_t(dtype_size(t.dtype()));
  return t.ndim() == 2 ? TensorView(p, t.dtype(), {n, cols}, t.device()) : TensorView(p, t.dtype(), {n}, t.device());
}

}  // namespace

// What one forward keeps for its backward (MoeSaved): views into the MoeSaved's memory, and the forward's arguments.
struct MoeSaved::State {
  TensorView logits, topk_idx, topk_probs, losses, tpe, recv, recv_probs, h1, act, y, s_h1, s_act;
  TensorView chunk_tokens, chunk_rows, expert_rows_total;  // the chunked step's: [C], [C, L], [L] i32
  std::vector<DispatchHandle> handles;                     // one per chunk
  MoeForwardArgs forward;                                  // the views the forward ran over
  bool filled = false;
};

struct MoeLayer::Impl {
  using Saved = MoeSaved::State;

  MoeConfig cfg, scfg;
  MoeLayerOptions opts;
  Communicator* comm = nullptr;
  DeviceAllocator* allocator = nullptr;
  int device = 0;
  bool shared = false;
  std::int64_t T_max = 0, H = 0, E = 0, K = 0, L = 0;
  int C = 1;                 // chunks
  std::int64_t Tc = 0;       // tokens per chunk (T_max / C)
  std::int64_t cap = 0;      // rows of one chunk's region of the expert buffers (a dispatcher's capacity)
  std::int64_t stride = 0;   // rows from one region to the next: cap rounded up to 8 (16-byte aligned f32 probs)
  std::int64_t rows = 0;     // rows of the expert buffers (every chunk's region)

  std::vector<std::unique_ptr<Dispatcher>> dispatchers;  // one per chunk
  std::unique_ptr<GroupedMlp> experts, shared_mlp;
  std::unique_ptr<GroupedMlp> experts_dw;  // the weight gradients on every SM when options.mlp.sms caps the others
  std::unique_ptr<experts::DeviceLinear> gate;
  Stream side;
  Stream comm_stream;  // the chunked step's communication

  DeviceBuffer memory;             // the scratch below
  std::size_t bytes = 0;
  DeviceStatus* status = nullptr;  // the router's (NaN logits); the dispatcher keeps its own
  // forward scratch (y only when the probs apply in the activation; else it is saved: the combine backward reads it)
  TensorView router_ws, y;
  // backward scratch
  TensorView d_y, d_recv, d_recv_probs, d_h1, mlp_ws, d_topk_probs, d_logits, dx_router;
  TensorView s_dx, s_d_h1, s_ws;

  DeviceBuffer default_memory;  // the default MoeSaved's
  MoeSaved default_saved;
  std::shared_ptr<Saved> last;  // the MoeSaved of the last forward (the router-output accessors)

  // fork/join events (no timing) and stage events (timing)
  Event fork{false}, join_shared{false};
  Event to_comm{false}, to_main{false};  // the chunked step's arrows between the streams
  bool timing = false;
  std::array<std::unique_ptr<Event>, 7> fwd_ev, bwd_ev;  // stage boundaries (forward uses 6)
  std::unique_ptr<Event> s_fwd0, s_fwd1, s_bwd0, s_bwd1;
  bool fwd_timed = false, bwd_timed = false;

  cudaGraphExec_t fwd_graph = nullptr, bwd_graph = nullptr;
  bool capturing = false;
  bool graphs_timed = false;  // the graphs record the stage events (timing was on at capture())

  ~Impl() {
    if (fwd_graph) (void)cudaGraphExecDestroy(fwd_graph);
    if (bwd_graph) (void)cudaGraphExecDestroy(bwd_graph);
  }

  bool y_saved() const { return cfg.prob_mode == ProbMode::InCombine; }  // the combine backward reads y

  // The layer's scratch: forward scratch and what the backward writes and reads within itself.
  void carve_scratch(Arena& a) {
    const std::int64_t F1 = cfg.fc1_out();
    status = static_cast<DeviceStatus*>(a.take(DType::Bool, {sizeof(DeviceStatus)}).data());
    const std::size_t rws = router_workspace_bytes(cfg);
    router_ws = rws ? a.take(DType::Bool, {std::int64_t(rws)}) : TensorView();
    if (!y_saved()) y = a.take(DType::BF16, {rows, H});
    d_y = a.take(DType::BF16, {rows, H});
    // the forward's y when the backward does not read it (probs in the activation): one buffer for both
    d_recv = y_saved() ? a.take(DType::BF16, {rows, H}) : y;
    d_recv_probs = a.take(DType::F32, {rows});
    d_h1 = a.take(DType::BF16, {rows, F1});
    // The experts' backward scratch (d_act) is dead before FC1's dgrad writes d_recv (experts.h): one chunk at a
    // time it lives in d_recv's memory when it fits (chunked, the dispatch backward of one chunk reads d_recv beside
    // the experts' backward of the next).
    const std::size_t ws = mlp_backward_workspace_bytes(cfg, cap);
    if (C == 1 && ws <= std::size_t(rows * H) * dtype_size(DType::BF16))
      mlp_ws = d_recv.defined() ? TensorView(d_recv.data(), DType::Bool, {std::int64_t(ws)}, d_recv.device())
                                : TensorView();
    else
      mlp_ws = a.take(DType::Bool, {std::int64_t(ws)});
    d_topk_probs = a.take(DType::F32, {T_max, K});
    d_logits = a.take(DType::BF16, {T_max, E});
    dx_router = a.take(DType::BF16, {T_max, H});
    if (shared) {
      s_dx = a.take(DType::BF16, {T_max, H});
      s_d_h1 = a.take(DType::BF16, {T_max, scfg.fc1_out()});
      s_ws = a.take(DType::Bool, {std::int64_t(mlp_backward_workspace_bytes(scfg, T_max))});
    }
  }

  // A MoeSaved's arrays (handles: dispatcher c's make_handle over a piece of handle_bytes()).
  void carve_saved(Arena& a, Saved* v) const {
    const std::int64_t F = cfg.ffn_hidden, F1 = cfg.fc1_out();
    auto take = [&](TensorView Saved::*field, DType dt, std::initializer_list<std::int64_t> shape) {
      TensorView t = a.take(dt, shape);
      if (v) v->*field = t;
    };
    take(&Saved::logits, DType::BF16, {T_max, E});
    take(&Saved::topk_idx, DType::I32, {T_max, K});
    take(&Saved::topk_probs, DType::F32, {T_max, K});
    take(&Saved::losses, DType::F32, {2});
    take(&Saved::tpe, DType::I32, {E});
    take(&Saved::recv, DType::BF16, {rows, H});
    take(&Saved::recv_probs, DType::F32, {rows});
    take(&Saved::h1, DType::BF16, {rows, F1});
    take(&Saved::act, DType::BF16, {rows, F});
    if (y_saved()) take(&Saved::y, DType::BF16, {rows, H});
    if (shared) {
      take(&Saved::s_h1, DType::BF16, {T_max, scfg.fc1_out()});
      take(&Saved::s_act, DType::BF16, {T_max, scfg.ffn_hidden});
    }
    if (C > 1) {
      take(&Saved::chunk_tokens, DType::I32, {C});
      take(&Saved::chunk_rows, DType::I32, {C, L});
      take(&Saved::expert_rows_total, DType::I32, {L});
    }
    for (const auto& d : dispatchers) {
      const TensorView piece = a.take(DType::Bool, {std::int64_t(d->handle_bytes())});
      if (v) v->handles.push_back(d->make_handle(piece));
    }
    if (v && !y_saved()) v->y = y;
  }

  void check_args(const MoeForwardArgs& f) const {
    const Device d = Device::cuda(device);
    auto tensor = [&](const char* name, const TensorView& t, DType dt, std::initializer_list<std::int64_t> shape) {
      if (!t.defined()) fail(kOp, name, " is absent but required");
      check_device(kOp, name, t, d);
      check_dtype(kOp, name, t, {dt});
      check_shape(kOp, name, t, shape);
    };
    tensor("x", f.x, DType::BF16, {T_max, H});
    tensor("num_tokens", f.num_tokens, DType::I32, {1});
    tensor("out", f.out, DType::BF16, {T_max, H});
    tensor("weights.router", f.weights.router, DType::BF16, {E, H});
    if (cfg.router.use_expert_bias)
      tensor("weights.expert_bias", f.weights.expert_bias, DType::F32, {E});
    else if (f.weights.expert_bias.defined())
      fail(kOp, "weights.expert_bias is given but cfg.router.use_expert_bias is not set");
    if (shared) {
      tensor("weights.shared_w1", f.weights.shared_w1, DType::BF16, {scfg.fc1_out(), H});
      tensor("weights.shared_w2", f.weights.shared_w2, DType::BF16, {H, scfg.ffn_hidden});
    } else if (f.weights.shared_w1.defined() || f.weights.shared_w2.defined()) {
      fail(kOp, "weights.shared_w1/w2 are given but cfg.shared_expert_ffn = 0 (no shared expert)");
    }
  }

  void check_args(const MoeBackwardArgs& b) const {
    const Device d = Device::cuda(device);
    auto tensor = [&](const char* name, const TensorView& t, std::initializer_list<std::int64_t> shape) {
      if (!t.defined()) fail(kOp, name, " is absent but required");
      check_device(kOp, name, t, d);
      check_dtype(kOp, name, t, {DType::BF16});
      check_shape(kOp, name, t, shape);
    };
    tensor("d_out", b.d_out, {T_max, H});
    tensor("dx", b.dx, {T_max, H});
    tensor("grads.d_router", b.grads.d_router, {E, H});
    if (b.d_losses.defined()) {
      check_device(kOp, "d_losses", b.d_losses, d);
      check_dtype(kOp, "d_losses", b.d_losses, {DType::F32});
      check_shape(kOp, "d_losses", b.d_losses, {2});
    }
    if (!b.grads.experts.defined()) fail(kOp, "grads.experts.dw1 is absent but required");
    if (shared) {
      tensor("grads.d_shared_w1", b.grads.d_shared_w1, {scfg.fc1_out(), H});
      tensor("grads.d_shared_w2", b.grads.d_shared_w2, {H, scfg.ffn_hidden});
    }
  }

  // A MoeSaved of this layer; a filled one unless the caller is the forward that fills it.
  Saved& state_of(const MoeSaved& saved, const MoeLayer* self, std::string_view op, bool must_be_filled) const {
    if (!saved.defined()) fail(kOp, op, ": saved is empty (make one with MoeLayer::make_saved)");
    if (saved.owner_ != self) fail(kOp, op, ": saved was made by another MoeLayer");
    if (must_be_filled && !saved.state_->filled)
      fail(kOp, op, ": saved holds no forward (pass the MoeSaved its forward() filled)");
    return *saved.state_;
  }

  // Stage events: recorded eagerly, and into the graphs when timing is on at capture() (as event-record nodes:
  // cudaEventRecordExternal; a plain record during capture only orders streams).
  void stamp(cudaEvent_t e, cudaStream_t s) {
    if (!timing) return;
    if (capturing) MOERAIL_CUDA_CHECK(cudaEventRecordWithFlags(e, s, cudaEventRecordExternal));
    else MOERAIL_CUDA_CHECK(cudaEventRecord(e, s));
  }
  void stamp(std::array<std::unique_ptr<Event>, 7>& ev, int i, cudaStream_t s) { stamp(ev[std::size_t(i)]->e, s); }
  void stamp(std::unique_ptr<Event>& ev, cudaStream_t s) { stamp(ev->e, s); }

  // ---- one chunk's ops (C = 1: the whole step's) ------------------------------------------------------------------
  // Token rows of chunk c, and region c of the expert buffers.
  TensorView tokens(const TensorView& t, int c) const { return C == 1 ? t : rows_of(t, c * Tc, Tc); }
  TensorView region(const TensorView& t, int c) const { return C == 1 ? t : rows_of(t, c * stride, cap); }
  TensorView num_tokens_of(const Saved& v, int c) const {
    return C == 1 ? v.forward.num_tokens : rows_of(v.chunk_tokens, c, 1);
  }
  static const TensorView& expert_counts(const Saved& v, int c) {
    return v.handles[std::size_t(c)].layout().segment_rows;
  }
  Dispatcher& dispatcher(int c) const { return *dispatchers[std::size_t(c)]; }

  void dispatch_chunk(int c, Saved& v, cudaStream_t st) {
    dispatcher(c).dispatch({tokens(v.forward.x, c), tokens(v.topk_idx, c), tokens(v.topk_probs, c),
                            num_tokens_of(v, c), region(v.recv, c), region(v.recv_probs, c)},
                           v.handles[std::size_t(c)], st);
  }
  void experts_chunk(int c, const Saved& v, cudaStream_t st) {
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
  void combine_chunk(int c, const Saved& v, cudaStream_t st) {
    dispatcher(c).combine({cfg.prob_mode, region(v.y, c), tokens(v.forward.out, c)}, v.handles[std::size_t(c)],
                          st);
  }
  void combine_backward_chunk(int c, const Saved& v, const MoeBackwardArgs& b, cudaStream_t st) {
    const bool in_combine = cfg.prob_mode == ProbMode::InCombine;
    dispatcher(c).combine_backward({cfg.prob_mode, tokens(b.d_out, c), in_combine ? region(v.y, c) : TensorView(),
                                    region(d_y, c), in_combine ? tokens(d_topk_probs, c) : TensorView()},
                                   v.handles[std::size_t(c)], st);
  }
  void experts_data_chunk(int c, const Saved& v, cudaStream_t st) {
    const bool in_combine = cfg.prob_mode == ProbMode::InCombine;
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
  void dispatch_backward_chunk(int c, const Saved& v, const MoeBackwardArgs& b, cudaStream_t st) {
    const bool in_combine = cfg.prob_mode == ProbMode::InCombine;
    dispatcher(c).dispatch_backward({region(d_recv, c), in_combine ? TensorView() : region(d_recv_probs, c),
                                     tokens(b.dx, c), in_combine ? TensorView() : tokens(d_topk_probs, c)},
                                    v.handles[std::size_t(c)], st);
  }

  void run_forward(Saved& v, cudaStream_t s) {
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

  // The shared expert's output, added to out at the end of the forward: scratch (dx_router's rows, which only the
  // backward writes; the side stream's work joins the main stream before the add).
  TensorView shared_y() const { return dx_router; }

  void run_backward(const Saved& v, const MoeBackwardArgs& b, cudaStream_t s) {
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

  std::size_t dispatcher_bytes() const {
    std::size_t n = 0;
    for (const auto& d : dispatchers) n += d->workspace_bytes();
    return n;
  }

  MoeSaved& default_or_fail(std::string_view op);
};

MoeLayer::MoeLayer(const MoeConfig& cfg, Communicator& comm, const MoeLayerOptions& options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  cfg.validate();
  ProblemList problems{std::string(kOp)};
  if (cfg.ep_size != comm.size())
    problems.add("cfg.ep_size = ", cfg.ep_size, " but the communicator has ", comm.size(), " ranks");
  if (cfg.dtype != DType::BF16) problems.add("cfg.dtype = ", dtype_name(cfg.dtype), " but the layer runs bf16 only");
  if (cfg.hidden % 8 != 0) problems.add("cfg.hidden = ", cfg.hidden, " is not a multiple of 8");
  if (cfg.num_experts % 8 != 0)
    problems.add("cfg.num_experts = ", cfg.num_experts, " is not a multiple of 8 (the gate GEMM's 16-byte rows)");
  if (cfg.shared_expert_ffn % 8 != 0)
    problems.add("cfg.shared_expert_ffn = ", cfg.shared_expert_ffn, " is not a multiple of 8");
  if (options.chunks < 1 || options.chunks > kMaxMlpChunks)
    problems.add("options.chunks = ", options.chunks, " but 1 to ", kMaxMlpChunks, " are supported");
  else if (cfg.max_tokens % options.chunks != 0)
    problems.add("options.chunks = ", options.chunks, " does not divide cfg.max_tokens = ", cfg.max_tokens);
  problems.throw_if_any();
  m.cfg = cfg;
  m.opts = options;
  m.comm = &comm;
  m.allocator = options.allocator ? options.allocator : &cuda_allocator();
  m.device = comm.device();
  MOERAIL_CUDA_CHECK(cudaSetDevice(m.device));
  m.shared = cfg.shared_expert_ffn > 0;
  m.scfg = shared_expert_config(cfg);
  m.T_max = cfg.max_tokens;
  m.H = cfg.hidden;
  m.E = cfg.num_experts;
  m.K = cfg.topk;
  m.L = cfg.local_experts();

  m.C = options.chunks;
  m.Tc = m.T_max / m.C;
  MoeConfig chunk_cfg = cfg;  // a chunk's dispatch: Tc tokens
  chunk_cfg.max_tokens = m.Tc;
  DispatchOptions dopts = options.dispatch;
  dopts.allocator = m.allocator;
  for (int c = 0; c < m.C; ++c) m.dispatchers.push_back(std::make_unique<Dispatcher>(chunk_cfg, comm, dopts));
  m.cap = m.dispatchers[0]->capacity();
  m.stride = (m.cap + 7) / 8 * 8;
  m.rows = m.C == 1 ? m.cap : m.C * m.stride;
  MlpOptions mo = options.mlp;
  mo.allocator = m.allocator;
  // The GEMM tiles are chosen for the average expert (experts/tiles.h): the rows a rank holds under balanced
  // routing, T_max * K, not the buffer's capacity (up to R times that). Not per chunk: the kernels, and so the
  // bits of the forward and the data gradients, do not depend on the chunking.
  if (mo.rows_hint <= 0) mo.rows_hint = m.T_max * m.K;
  m.experts = std::make_unique<GroupedMlp>(cfg, mo);
  if (mo.sms > 0) {
    MlpOptions dwo = mo;
    dwo.sms = 0;
    m.experts_dw = std::make_unique<GroupedMlp>(cfg, dwo);
  }
  if (m.shared) {
    MlpOptions so;
    so.rows_hint = m.T_max;
    so.allocator = m.allocator;
    m.shared_mlp = std::make_unique<GroupedMlp>(m.scfg, so);
  }
  m.gate = std::make_unique<experts::DeviceLinear>(m.H, m.E, m.T_max, "router gate", *m.allocator);

  Arena dry{nullptr, 0, m.device};
  m.carve_scratch(dry);
  m.bytes = dry.used;
  m.memory = DeviceBuffer(*m.allocator, m.bytes);
  MOERAIL_CUDA_CHECK(cudaMemset(m.memory.data(), 0, m.bytes));
  Arena real{static_cast<char*>(m.memory.data()), 0, m.device};
  m.carve_scratch(real);
  reset_status(m.status, nullptr);
  if (options.default_saved) {
    m.default_memory = DeviceBuffer(*m.allocator, saved_bytes());
    MOERAIL_CUDA_CHECK(cudaMemset(m.default_memory.data(), 0, saved_bytes()));
    m.default_saved = make_saved(TensorView(m.default_memory.data(), DType::Bool, {std::int64_t(saved_bytes())},
                                            Device::cuda(m.device)));
    m.last = m.default_saved.state_;
  }
  for (auto* evs : {&m.fwd_ev, &m.bwd_ev})
    for (auto& e : *evs) e = std::make_unique<Event>(true);
  for (auto* e : {&m.s_fwd0, &m.s_fwd1, &m.s_bwd0, &m.s_bwd1}) *e = std::make_unique<Event>(true);
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
  log::info("MoeLayer: ", cfg.summary(), " capacity ", m.C * m.cap, " rows", m.C > 1 ? " in " : "",
            m.C > 1 ? std::to_string(m.C) + " chunks" : std::string(), ", ", workspace_bytes() >> 20,
            " MiB per rank (dispatchers ", m.dispatcher_bytes() >> 20, " MiB, saved activations ",
            saved_bytes() >> 20, " MiB per microbatch in flight)");
}

MoeLayer::~MoeLayer() {
  // The buffers go back to the allocator (a framework's pool may hand them out at once): no kernel of any stream
  // may still use them.
  if (impl_) cuda::synchronize_device(impl_->device);
}

const MoeConfig& MoeLayer::config() const { return impl_->cfg; }
std::int64_t MoeLayer::capacity() const { return impl_->C * impl_->cap; }  // routed rows it can hold
std::size_t MoeLayer::workspace_bytes() const {
  const Impl& m = *impl_;
  std::size_t n = m.bytes + m.default_memory.bytes() + m.dispatcher_bytes() + m.gate->device_bytes() +
                  m.experts->device_bytes();
  if (m.experts_dw) n += m.experts_dw->device_bytes();
  if (m.shared_mlp) n += m.shared_mlp->device_bytes();
  return n;
}
std::size_t MoeLayer::window_bytes() const {
  std::size_t n = 0;
  for (const auto& d : impl_->dispatchers) n += d->window_bytes();
  return n;
}

std::size_t MoeLayer::saved_bytes() const {
  Arena dry{nullptr, 0, impl_->device};
  impl_->carve_saved(dry, nullptr);
  return dry.used;
}

MoeSaved MoeLayer::make_saved(const TensorView& memory) const {
  constexpr std::string_view op = "MoeLayer::make_saved";
  const Impl& m = *impl_;
  check_device(op, "memory", memory, Device::cuda(m.device));
  if (memory.nbytes() < saved_bytes())
    fail(op, "memory has ", memory.nbytes(), " bytes (expected at least saved_bytes() = ", saved_bytes(), ")");
  if (reinterpret_cast<std::uintptr_t>(memory.data()) % 256 != 0) fail(op, "memory is not 256-byte aligned");
  MoeSaved s;
  s.owner_ = this;
  s.memory_ = memory;
  s.state_ = std::make_shared<MoeSaved::State>();
  Arena a{static_cast<char*>(memory.data()), 0, m.device};
  m.carve_saved(a, s.state_.get());
  return s;
}

void MoeLayer::forward(const MoeForwardArgs& args, MoeSaved& saved, cudaStream_t stream) {
  Impl& m = *impl_;
  Impl::Saved& v = m.state_of(saved, this, "forward", false);
  m.check_args(args);
  v.forward = args;
  m.run_forward(v, stream);
  v.filled = true;
  m.last = saved.state_;
  m.fwd_timed = m.timing;
  if (m.opts.check_eager) check(stream);
}

void MoeLayer::backward(const MoeBackwardArgs& args, const MoeSaved& saved, cudaStream_t stream) {
  Impl& m = *impl_;
  const Impl::Saved& v = m.state_of(saved, this, "backward", true);
  m.check_args(args);
  m.run_backward(v, args, stream);
  m.bwd_timed = m.timing;
}

MoeSaved& MoeLayer::Impl::default_or_fail(std::string_view op) {
  if (!default_saved.defined())
    fail(kOp, op, " without a MoeSaved, but options.default_saved is off: pass each forward a MoeSaved");
  return default_saved;
}

void MoeLayer::forward(const MoeForwardArgs& args, cudaStream_t stream) {
  forward(args, impl_->default_or_fail("forward()"), stream);
}

void MoeLayer::backward(const MoeBackwardArgs& args, cudaStream_t stream) {
  MoeSaved& saved = impl_->default_or_fail("backward()");
  if (!saved.state_->filled) fail(kOp, "backward() before any forward(): nothing is saved to differentiate");
  backward(args, saved, stream);
}

void MoeLayer::capture(const MoeForwardArgs& f, const MoeBackwardArgs& b, cudaStream_t stream) {
  Impl& m = *impl_;
  m.check_args(f);
  m.check_args(b);
  if (stream == nullptr) fail(kOp, "capture() needs a non-default stream (the legacy stream cannot be captured)");
  Impl::Saved& v = *m.default_or_fail("capture()").state_;
  v.forward = f;
  // The host-API transport connects its peers on first use: run one eager step before recording.
  m.run_forward(v, stream);
  m.run_backward(v, b, stream);
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  check(stream);
  for (cudaGraphExec_t* g : {&m.fwd_graph, &m.bwd_graph})
    if (*g) {
      MOERAIL_CUDA_CHECK(cudaGraphExecDestroy(*g));
      *g = nullptr;
    }
  m.capturing = true;
  auto record = [&](cudaGraphExec_t* exec, auto&& body) {
    cudaGraph_t g = nullptr;
    MOERAIL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (...) {
      cudaStreamEndCapture(stream, &g);
      if (g) cudaGraphDestroy(g);
      m.capturing = false;
      throw;
    }
    MOERAIL_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    const cudaError_t err = cudaGraphInstantiate(exec, g, 0);
    cudaGraphDestroy(g);
    MOERAIL_CUDA_CHECK(err);
  };
  record(&m.fwd_graph, [&] { m.run_forward(v, stream); });
  record(&m.bwd_graph, [&] { m.run_backward(v, b, stream); });
  m.capturing = false;
  m.graphs_timed = m.timing;
  v.filled = true;
  m.last = m.default_saved.state_;
}

bool MoeLayer::captured() const { return impl_->fwd_graph != nullptr; }

void MoeLayer::replay_forward(cudaStream_t stream) {
  if (!impl_->fwd_graph) fail(kOp, "replay_forward() before capture()");
  MOERAIL_CUDA_CHECK(cudaGraphLaunch(impl_->fwd_graph, stream));
  impl_->fwd_timed = impl_->graphs_timed;
  impl_->last = impl_->default_saved.state_;
}
void MoeLayer::replay_backward(cudaStream_t stream) {
  if (!impl_->bwd_graph) fail(kOp, "replay_backward() before capture()");
  MOERAIL_CUDA_CHECK(cudaGraphLaunch(impl_->bwd_graph, stream));
  impl_->bwd_timed = impl_->graphs_timed;
}

namespace {
const MoeSaved::State& last_of(const std::shared_ptr<MoeSaved::State>& last, const char* what) {
  if (!last || !last->filled) fail(kOp, what, "() before any forward()");
  return *last;
}
}  // namespace

TensorView MoeLayer::topk_idx() const { return last_of(impl_->last, "topk_idx").topk_idx; }
TensorView MoeLayer::topk_probs() const { return last_of(impl_->last, "topk_probs").topk_probs; }
TensorView MoeLayer::losses() const { return last_of(impl_->last, "losses").losses; }
TensorView MoeLayer::logits() const { return last_of(impl_->last, "logits").logits; }
TensorView MoeLayer::expert_rows() const {
  const Impl& m = *impl_;
  const MoeSaved::State& last = last_of(m.last, "expert_rows");
  return m.C == 1 ? Impl::expert_counts(last, 0) : last.expert_rows_total;
}

void MoeLayer::check(cudaStream_t stream) {
  Impl& m = *impl_;
  const StatusReport r = read_status(m.status, stream);
  if (!r.ok()) {
    reset_status(m.status, stream);
    r.raise_if_bad("router (rank " + std::to_string(m.comm->rank()) + " of " + std::to_string(m.comm->size()) + ")");
  }
  for (auto& d : m.dispatchers) d->check(stream);
}

void MoeLayer::enable_stage_timing(bool on) { impl_->timing = on; }

namespace {
double ms_between(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  MOERAIL_CUDA_CHECK(cudaEventSynchronize(b));
  MOERAIL_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}
}  // namespace

MoeLayer::StageTimes MoeLayer::forward_times(cudaStream_t) {
  Impl& m = *impl_;
  if (!m.fwd_timed)
    fail(kOp, "forward_times(): the last forward ran without enable_stage_timing(true) (a replay: its graph was "
              "captured without it)");
  auto e = [&](int i) { return m.fwd_ev[std::size_t(i)]->e; };
  StageTimes t;
  t.router = ms_between(e(0), e(1));
  t.dispatch = ms_between(e(1), e(2));
  t.experts = ms_between(e(2), e(3));
  t.combine = ms_between(e(3), e(4));
  t.total = ms_between(e(0), e(5));
  if (m.shared) t.shared = ms_between(m.s_fwd0->e, m.s_fwd1->e);
  return t;
}

MoeLayer::StageTimes MoeLayer::backward_times(cudaStream_t) {
  Impl& m = *impl_;
  if (!m.bwd_timed)
    fail(kOp, "backward_times(): the last backward ran without enable_stage_timing(true) (a replay: its graph was "
              "captured without it)");
  auto e = [&](int i) { return m.bwd_ev[std::size_t(i)]->e; };
  StageTimes t;
  t.combine = ms_between(e(0), e(1));
  t.experts = ms_between(e(1), e(2));
  t.dispatch = ms_between(e(2), e(3));
  t.router = ms_between(e(3), e(4));
  t.wgrad = ms_between(e(4), e(5));
  t.total = ms_between(e(0), e(6));
  if (m.shared) t.shared = ms_between(m.s_bwd0->e, m.s_bwd1->e);
  return t;
}

}  // namespace moerail
