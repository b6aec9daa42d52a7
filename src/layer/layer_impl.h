// src/layer/layer_impl.h — MoeLayer's private state (MoeSaved::State, MoeLayer::Impl) and the helpers they use,
// shared by layer.cpp (setup, buffers, the public calls) and layer_step.cpp (the launch sequence of a step).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string_view>
#include <vector>

#include "core/arena.h"
#include "core/cuda_check.h"
#include "experts/device_linear.h"
#include "moerail/error.h"
#include "moerail/experts_fp8.h"
#include "moerail/layer.h"
#include "moerail/router.h"
#include "moerail/status.h"

namespace moerail {
namespace layer {

inline constexpr const char* kOp = "MoeLayer";


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

// Rows [first, first + n) of a [rows] or [rows, cols] tensor.
inline TensorView rows_of(const TensorView& t, std::int64_t first, std::int64_t n) {
  const std::int64_t cols = t.ndim() == 2 ? t.size(1) : 1;
  void* p = static_cast<char*>(t.data()) + first * cols * std::int64_t(dtype_size(t.dtype()));
  return t.ndim() == 2 ? TensorView(p, t.dtype(), {n, cols}, t.device()) : TensorView(p, t.dtype(), {n}, t.device());
}

}  // namespace layer

using layer::Event;
using layer::kOp;
using layer::rows_of;
using layer::Stream;

// What one forward keeps for its backward (MoeSaved): views into the MoeSaved's memory, and the forward's arguments.
struct MoeSaved::State {
  TensorView logits, topk_idx, topk_probs, losses, tpe, recv, recv_probs, h1, act, y, s_h1, s_act;
  TensorView recv_scales;  // an FP8 recipe: recv is e4m3, its 1x128 scales [rows, H/128] f32 (fp8-blockwise) or
                           // each expert's scale [L] f32 (fp8-tensor)
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
  // An FP8 recipe: the routed experts (instead of `experts`), their FP8 weights (refresh_fp8_weights)
  std::unique_ptr<Fp8GroupedMlp> fp8;
  DeviceBuffer fp8_weight_memory;
  Fp8MlpWeights fp8_weights;
  bool fp8_weights_set = false;
  TensorView fp8_fwd_ws;
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
  bool fp8_recipe() const { return opts.recipe == Recipe::Fp8Blockwise || is_per_tensor(opts.recipe); }
  bool per_tensor() const { return is_per_tensor(opts.recipe); }

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
    const std::size_t ws = fp8 ? fp8->backward_workspace_bytes(cap) : mlp_backward_workspace_bytes(cfg, cap);
    if (!fp8 && C == 1 && ws <= std::size_t(rows * H) * dtype_size(DType::BF16))
      mlp_ws = d_recv.defined() ? TensorView(d_recv.data(), DType::Bool, {std::int64_t(ws)}, d_recv.device())
                                : TensorView();
    else
      mlp_ws = a.take(DType::Bool, {std::int64_t(ws)});
    // the FP8 forward's act in e4m3: in d_h1's memory (which only a backward uses, within itself) when it fits
    if (fp8) {
      const std::size_t fws = fp8->forward_workspace_bytes(rows);
      const std::size_t d_h1_bytes = (std::size_t(rows * F1) * dtype_size(DType::BF16) + 255) / 256 * 256;
      fp8_fwd_ws = fws <= d_h1_bytes ? TensorView(d_h1.data(), DType::Bool, {std::int64_t(fws)}, Device::cuda(device))
                                     : a.take(DType::Bool, {std::int64_t(fws)});
    }
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
    if (fp8_recipe()) {
      take(&Saved::recv, DType::F8E4M3, {rows, H});
      if (per_tensor()) take(&Saved::recv_scales, DType::F32, {L});  // C = 1 (checked at setup)
      else take(&Saved::recv_scales, DType::F32, {rows, H / 128});
    } else {
      take(&Saved::recv, DType::BF16, {rows, H});
    }
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
    if (fp8_recipe()) {
      const MlpGrads& g = b.grads.experts;
      const DType want = g.accumulate ? DType::F32 : DType::BF16;
      if (!g.dw1.defined() || !g.dw2.defined() || g.dw1.dtype() != want || g.dw2.dtype() != want)
        fail_with(ErrorCode::Unsupported, kOp, "grads.experts under the FP8 recipe: grouped dw1 and dw2, bf16 "
                  "written or f32 accumulated (per-expert tensors, and bf16 accumulated gradients, are the bf16 "
                  "recipe's)");
    }
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

  // What both FP8 backward calls of chunk c read (the forward's saved tensors, the weights, d_y).
  Fp8MlpBackwardArgs fp8_backward_args(const Saved& v, int c) const {
    Fp8MlpBackwardArgs m;
    m.x = region(v.recv, c);
    m.x_scales = region(v.recv_scales, c);
    m.probs = region(v.recv_probs, c);
    m.counts = expert_counts(v, c);
    m.weights = fp8_weights;
    m.h1 = region(v.h1, c);
    m.act = region(v.act, c);
    m.dy = region(d_y, c);
    return m;
  }

  // One chunk's ops and the launch sequence of a step: layer_step.cpp.
  void dispatch_chunk(int c, Saved& v, cudaStream_t st);
  void experts_chunk(int c, const Saved& v, cudaStream_t st);
  void combine_chunk(int c, const Saved& v, cudaStream_t st);
  void combine_backward_chunk(int c, const Saved& v, const MoeBackwardArgs& b, cudaStream_t st);
  void experts_data_chunk(int c, const Saved& v, cudaStream_t st);
  void dispatch_backward_chunk(int c, const Saved& v, const MoeBackwardArgs& b, cudaStream_t st);

  void run_forward(Saved& v, cudaStream_t s);

  // The shared expert's output, added to out at the end of the forward: scratch (dx_router's rows, which only the
  // backward writes; the side stream's work joins the main stream before the add).
  TensorView shared_y() const { return dx_router; }

  void run_backward(const Saved& v, const MoeBackwardArgs& b, cudaStream_t s);

  std::size_t dispatcher_bytes() const {
    std::size_t n = 0;
    for (const auto& d : dispatchers) n += d->workspace_bytes();
    return n;
  }

  MoeSaved& default_or_fail(std::string_view op);
};

}  // namespace moerail
