// src/layer/layer.cpp — MoeLayer (moerail/layer.h): setup, the buffers of one layer, and the public calls. The launch
// sequence of a step (streams, events, the chunked schedule) is in layer_step.cpp, the private state in layer_impl.h.
//
// Memory: the layer's scratch (forward scratch and the backward's own arrays) is one allocation; what a forward
// keeps for its backward is a MoeSaved (its memory the caller's, or the layer's default one).
#include "moerail/layer.h"

#include <algorithm>
#include <string>
#include <tuple>

#include "core/cuda_check.h"
#include "core/log.h"
#include "core/sync.h"
#include "experts/device_linear.h"
#include "layer/layer_impl.h"
#include "moerail/error.h"
#include "moerail/status.h"

namespace moerail {

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
  if (options.recipe == Recipe::Fp8Blockwise || is_per_tensor(options.recipe)) {
    if (options.chunks != 1) problems.add("options.chunks = ", options.chunks, " (the FP8 recipes run unchunked)");
    if (options.mlp.sms != 0) problems.add("options.mlp.sms = ", options.mlp.sms, " (the FP8 recipes take every SM)");
    if (options.fp8_weight_grads != Fp8WeightGrads::Fp8 && options.fp8_weight_grads != Fp8WeightGrads::BF16)
      problems.add("options.fp8_weight_grads = ", int(options.fp8_weight_grads), " is not an Fp8WeightGrads");
    else if (is_per_tensor(options.recipe) && options.fp8_weight_grads != Fp8WeightGrads::Fp8)
      problems.add("options.fp8_weight_grads = bf16 with options.recipe = ", name_of(options.recipe),
                   " (bf16 weight gradients run with fp8-blockwise only)");
  } else if (options.recipe != Recipe::BF16) {
    problems.add("options.recipe = ", int(options.recipe), " is not a recipe");
  }
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
  if (m.fp8_recipe()) {
    Fp8MlpOptions fo;
    fo.weight_grads = options.fp8_weight_grads;
    fo.rows_hint = mo.rows_hint;
    fo.allocator = m.allocator;
    fo.recipe = options.recipe;
    m.fp8 = std::make_unique<Fp8GroupedMlp>(cfg, fo);
    m.fp8_weight_memory = DeviceBuffer(*m.allocator, fp8_mlp_weights_bytes(cfg, options.recipe));
    m.fp8_weights = make_fp8_mlp_weights(cfg, m.fp8_weight_memory.data(), m.device, options.recipe);
  } else {
    m.experts = std::make_unique<GroupedMlp>(cfg, mo);
  }
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
std::int64_t MoeLayer::peer_rows() const { return impl_->dispatchers[0]->peer_rows(); }
std::size_t MoeLayer::workspace_bytes() const {
  const Impl& m = *impl_;
  std::size_t n = m.bytes + m.default_memory.bytes() + m.dispatcher_bytes() + m.gate->device_bytes() +
                  (m.experts ? m.experts->device_bytes() : 0);
  if (m.fp8) n += m.fp8->device_bytes() + m.fp8_weight_memory.bytes();
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
  if (m.fp8 && !m.fp8_weights_set)
    fail(kOp, "forward under the FP8 recipe before refresh_fp8_weights(): the layer holds no FP8 weights yet");
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

void MoeLayer::refresh_fp8_weights(const MlpWeights& experts, cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.fp8) fail(kOp, "refresh_fp8_weights() but options.recipe is bf16 (the layer holds no FP8 weights)");
  const std::int64_t L = m.L, H = m.H, F = m.cfg.ffn_hidden, F1 = m.cfg.fc1_out();
  for (const auto& [name, t, a, b] : {std::tuple{"experts.w1", experts.w1, F1, H},
                                      std::tuple{"experts.w2", experts.w2, H, F}}) {
    if (!t.defined()) fail(kOp, "refresh_fp8_weights: ", name, " is absent (the grouped [L, ...] weights are needed)");
    check_device(kOp, name, t, Device::cuda(m.device));
    check_dtype(kOp, name, t, {DType::BF16});
    check_shape(kOp, name, t, {L, a, b});
  }
  quantize_mlp_weights_fp8(m.cfg, experts, m.fp8_weights, stream);
  m.fp8_weights_set = true;
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
  if (m.fp8 && !m.fp8_weights_set)
    fail(kOp, "capture() under the FP8 recipe before refresh_fp8_weights(): the layer holds no FP8 weights yet");
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
