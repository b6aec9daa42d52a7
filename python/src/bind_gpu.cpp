// python/src/bind_gpu.cpp — the single-GPU ops (router, grouped expert MLP) and, with NCCL, the communicator, the
// expert-parallel dispatcher and the whole layer. Every call is stream-ordered on the stream handle it is given
// (torch.cuda.current_stream().cuda_stream), allocates nothing and never synchronizes the host, except where a
// docstring says so (setup, check()). Objects that hold device memory take an Allocator (a Python callable that
// returns a tensor: PyTorch's caching allocator), and per-microbatch state (DispatchHandle, MoeSaved) lives in
// arrays the caller gives.
#include "bindings.h"

#if MOERAIL_WITH_CUDA
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>

#include "convert.h"
#include "moerail/experts.h"
#include "moerail/experts_fp8.h"
#include "moerail/quant.h"
#include "moerail/router.h"

#if MOERAIL_WITH_NCCL
#include "moerail/comm.h"
#include "moerail/dispatch.h"
#include "moerail/layer.h"
#endif

namespace moerail::py {
namespace {

// A DeviceAllocator over a Python callable alloc(nbytes) -> an object with data_ptr() (a torch.uint8 tensor of
// nbytes on the device): moerail's buffers then come from that framework's allocator, and its statistics count them.
// The objects are held until moerail gives the memory back.
class PyAllocator final : public DeviceAllocator {
 public:
  explicit PyAllocator(nb::callable alloc) : alloc_(std::move(alloc)) {}
  ~PyAllocator() override {
    if (!Py_IsInitialized())
      for (auto& [p, held] : held_) held.object.release();  // the interpreter is gone: nothing left to release to
  }

  void* allocate(std::size_t bytes) override {
    nb::gil_scoped_acquire gil;
    nb::object t = alloc_(bytes);
    void* p = reinterpret_cast<void*>(nb::cast<std::uintptr_t>(t.attr("data_ptr")()));
    if (p == nullptr || reinterpret_cast<std::uintptr_t>(p) % 256 != 0)
      fail("moerail.Allocator", "alloc(", bytes, ") returned memory at ", p, " (expected a 256-byte aligned pointer)");
    held_.emplace(p, Held{std::move(t), bytes});
    bytes_ += bytes;
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept override {
    if (!Py_IsInitialized()) return;
    nb::gil_scoped_acquire gil;
    auto it = held_.find(p);
    if (it == held_.end()) return;
    bytes_ -= it->second.bytes;
    held_.erase(it);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  struct Held {
    nb::object object;
    std::size_t bytes;
  };
  nb::callable alloc_;
  std::unordered_map<void*, Held> held_;
  std::size_t bytes_ = 0;
};

DeviceAllocator* allocator_of(PyAllocator* a) { return a; }

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail_with(ErrorCode::Cuda, "moerail", what, ": ", cudaGetErrorString(e));
}

// Copies a device view owned by a C++ object into the caller's array of the same dtype and element count.
void copy_into(const TensorView& src, const Array& dst, const char* name, std::uintptr_t stream) {
  const TensorView d = view(dst, name);
  if (d.dtype() != src.dtype() || d.numel() != src.numel())
    fail("moerail", name, ": ", dtype_name(d.dtype()), d.shape_str(), " given; ", dtype_name(src.dtype()), " with ",
         src.numel(), " elements expected");
  check_cuda(cudaMemcpyAsync(d.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, stream_of(stream)),
             name);
}

MlpWeights mlp_weights(const Array& w1, const OptArray& b1, const Array& w2, const OptArray& b2) {
  MlpWeights w;
  w.w1 = view(w1, "w1");
  w.b1 = view(b1, "b1");
  w.w2 = view(w2, "w2");
  w.b2 = view(b2, "b2");
  return w;
}

MlpGrads mlp_grads(const Array& dw1, const OptArray& db1, const Array& dw2, const OptArray& db2) {
  MlpGrads g;
  g.dw1 = view(dw1, "dw1");
  g.db1 = view(db1, "db1");
  g.dw2 = view(dw2, "dw2");
  g.db2 = view(db2, "db2");
  return g;
}

// e4m3 codes arrive as uint8 arrays (tensor.view(torch.uint8): DLPack has no float8 type every framework exports):
// the same memory and shape with the e4m3 dtype.
TensorView fp8_view(const Array& a, const char* name) {
  const TensorView v = view(a, name);
  if (v.dtype() != DType::Bool)
    fail("moerail", name, ": e4m3 codes are passed as a uint8 array (tensor.view(torch.uint8)), not ",
         dtype_name(v.dtype()));
  auto d = [&](int i) { return v.size(i); };
  switch (v.ndim()) {
    case 1: return TensorView(v.data(), DType::F8E4M3, {d(0)}, v.device());
    case 2: return TensorView(v.data(), DType::F8E4M3, {d(0), d(1)}, v.device());
    case 3: return TensorView(v.data(), DType::F8E4M3, {d(0), d(1), d(2)}, v.device());
    default: return TensorView(v.data(), DType::F8E4M3, {d(0), d(1), d(2), d(3)}, v.device());
  }
}

// The FP8 weights of cfg and recipe over a caller's byte buffer of fp8_mlp_weights_bytes(cfg, recipe) bytes.
Fp8MlpWeights fp8_weights_over(const MoeConfig& cfg, const Array& buffer, Recipe recipe) {
  const TensorView b = view(buffer, "fp8_weights");
  // Exactly the recipe's size: a buffer laid out for the other recipe (another size) is not reinterpreted.
  if (b.nbytes() != fp8_mlp_weights_bytes(cfg, recipe) || b.device().is_host())
    fail("moerail", "fp8_weights: ", b.nbytes(), " bytes on ", b.device().str(), " given; ",
         fp8_mlp_weights_bytes(cfg, recipe), " device bytes expected (fp8_mlp_weights_bytes(cfg, '",
         name_of(recipe), "'))");
  return make_fp8_mlp_weights(cfg, b.data(), b.device().index, recipe);
}

void bind_fp8_mlp(nb::module_& m) {
  m.def(
      "fp8_mlp_weights_bytes",
      [](const MoeConfig& cfg, const std::string& recipe) { return fp8_mlp_weights_bytes(cfg, recipe_of(recipe)); },
      nb::arg("cfg"), nb::arg("recipe") = "fp8-blockwise",
      "Device bytes of the FP8 weights of one grouped MLP (w1, w2 and their transposed copies, with scales).");
  m.def(
      "quantize_mlp_weights_fp8",
      [](const MoeConfig& cfg, const Array& w1, const Array& w2, const Array& fp8_weights, std::uintptr_t stream,
         const std::string& recipe) {
        MlpWeights w;
        w.w1 = view(w1, "w1");
        w.w2 = view(w2, "w2");
        quantize_mlp_weights_fp8(cfg, w, fp8_weights_over(cfg, fp8_weights, recipe_of(recipe)), stream_of(stream));
      },
      "The quantization of the grouped bf16 w1, w2 (and their transposed copies) into the byte buffer fp8_weights,\n"
      "as the recipe scales them (128x128 blocks, or one scale per expert matrix), on `stream`: once per optimizer\n"
      "step.",
      nb::arg("cfg"), nb::arg("w1"), nb::arg("w2"), nb::arg("fp8_weights"), nb::arg("stream"),
      nb::arg("recipe") = "fp8-blockwise");
  m.def(
      "quantize_fp8_experts",
      [](const Array& x, const Array& counts, const OptArray& q, const Array& scales, std::uintptr_t stream) {
        quantize_fp8_experts({view(x, "x"), view(counts, "counts"), q ? fp8_view(*q, "q") : TensorView(),
                              view(scales, "scales")},
                             stream_of(stream));
      },
      "x [rows, H] bf16 in expert segments (counts [L]) -> scales [L] f32 (amax / 448 of each segment) and, q given,\n"
      "q [rows, H] e4m3 (as uint8): the per-tensor recipe's quantization, one scale per expert.",
      nb::arg("x"), nb::arg("counts"), nb::arg("q").none(), nb::arg("scales"), nb::arg("stream"));
  m.def(
      "quantize_fp8_1x128",
      [](const Array& x, const Array& num_tokens, const Array& q, const Array& scales, std::uintptr_t stream) {
        quantize_fp8({Fp8Scaling::Block1x128, view(x, "x"), view(num_tokens, "num_tokens"), fp8_view(q, "q"),
                      view(scales, "scales")},
                     stream_of(stream));
      },
      "x [T_max, H] bf16 -> q [T_max, H] e4m3 (as uint8) and scales [T_max, H/128] f32, rows t < num_tokens[0].",
      nb::arg("x"), nb::arg("num_tokens"), nb::arg("q"), nb::arg("scales"), nb::arg("stream"));

  nb::class_<Fp8GroupedMlp>(m, "Fp8GroupedMlp",
                            "The grouped expert MLP in FP8 (recipe fp8-blockwise, fp8-tensor or fp8-tensor-hybrid) on the current\n"
                            "CUDA device (setup allocates and synchronizes; forward/backward do neither). FP8 arrays are uint8.")
      .def(
          "__init__",
          [](Fp8GroupedMlp* self, const MoeConfig& cfg, const std::string& weight_grads, PyAllocator* allocator,
             const std::string& recipe) {
            Fp8MlpOptions o;
            o.weight_grads = fp8_weight_grads_of(weight_grads);
            o.allocator = allocator_of(allocator);
            o.recipe = recipe_of(recipe);
            new (self) Fp8GroupedMlp(cfg, o);
          },
          nb::arg("cfg"), nb::arg("weight_grads") = "fp8", nb::arg("allocator").none() = nb::none(),
          nb::arg("recipe") = "fp8-blockwise", nb::keep_alive<1, 4>())
      .def_prop_ro("device_bytes", &Fp8GroupedMlp::device_bytes)
      .def("forward_workspace_bytes", &Fp8GroupedMlp::forward_workspace_bytes, nb::arg("rows"))
      .def("backward_workspace_bytes", &Fp8GroupedMlp::backward_workspace_bytes, nb::arg("rows"))
      .def(
          "forward",
          [](Fp8GroupedMlp& g, const MoeConfig& cfg, const Array& x, const Array& x_scales, const OptArray& probs,
             const Array& counts, const Array& fp8_weights, const Array& y, const Array& h1, const Array& act,
             const Array& workspace, std::uintptr_t stream) {
            Fp8MlpForwardArgs a;
            a.x = fp8_view(x, "x");
            a.x_scales = view(x_scales, "x_scales");
            a.probs = view(probs, "probs");
            a.counts = view(counts, "counts");
            a.weights = fp8_weights_over(cfg, fp8_weights, g.recipe());
            a.y = view(y, "y");
            a.h1 = view(h1, "h1");
            a.act = view(act, "act");
            a.workspace = view(workspace, "workspace");
            g.forward(a, stream_of(stream));
          },
          nb::arg("cfg"), nb::arg("x"), nb::arg("x_scales"), nb::arg("probs").none(), nb::arg("counts"),
          nb::arg("fp8_weights"), nb::arg("y"), nb::arg("h1"), nb::arg("act"), nb::arg("workspace"),
          nb::arg("stream"))
      .def(
          "backward",
          [](Fp8GroupedMlp& g, const MoeConfig& cfg, const Array& x, const Array& x_scales, const OptArray& probs,
             const Array& counts, const Array& fp8_weights, const OptArray& h1, const Array& act, const Array& dy,
             const OptArray& dx, const OptArray& d_probs, const Array& d_h1, const OptArray& dw1,
             const OptArray& dw2, const Array& workspace, std::uintptr_t stream, const std::string& wgrad_operands,
             bool accumulate) {
            Fp8MlpBackwardArgs a;
            a.x = fp8_view(x, "x");
            a.x_scales = view(x_scales, "x_scales");
            a.probs = view(probs, "probs");
            a.counts = view(counts, "counts");
            a.weights = fp8_weights_over(cfg, fp8_weights, g.recipe());
            a.h1 = view(h1, "h1");
            a.act = view(act, "act");
            a.dy = view(dy, "dy");
            a.dx = view(dx, "dx");
            a.d_probs = view(d_probs, "d_probs");
            a.d_h1 = view(d_h1, "d_h1");
            a.dw1 = view(dw1, "dw1");
            a.dw2 = view(dw2, "dw2");
            a.workspace = view(workspace, "workspace");
            if (wgrad_operands == "stage") a.wgrad_operands = Fp8WgradOperands::Stage;
            else if (wgrad_operands == "staged") a.wgrad_operands = Fp8WgradOperands::Staged;
            else if (wgrad_operands != "make")
              fail("Fp8GroupedMlp.backward", "wgrad_operands = '", wgrad_operands,
                   "' (expected 'make', 'stage' or 'staged')");
            a.accumulate_weight_grads = accumulate;
            g.backward(a, stream_of(stream));
          },
          "The data gradients (dx given) and/or the weight gradients (dw1, dw2 given); wgrad_operands 'stage' /\n"
          "'staged' splits them in two calls over one workspace (moerail/experts_fp8.h, Fp8WgradOperands);\n"
          "accumulate: dw1 and dw2 are float32 and the weight gradients are added into them (main_grad).",
          nb::arg("cfg"), nb::arg("x"), nb::arg("x_scales"), nb::arg("probs").none(), nb::arg("counts"),
          nb::arg("fp8_weights"), nb::arg("h1").none(), nb::arg("act"), nb::arg("dy"), nb::arg("dx").none(),
          nb::arg("d_probs").none(), nb::arg("d_h1"), nb::arg("dw1").none(), nb::arg("dw2").none(),
          nb::arg("workspace"), nb::arg("stream"), nb::arg("wgrad_operands") = "make", nb::arg("accumulate") = false);
}

void bind_single_gpu(nb::module_& m) {
  bind_fp8_mlp(m);
  nb::class_<PyAllocator>(m, "Allocator",
                          "Device memory for moerail's objects from alloc(nbytes) -> a tensor of nbytes (uint8,\n"
                          "on the device): e.g. lambda n: torch.empty(n, dtype=torch.uint8, device=dev).")
      .def(nb::init<nb::callable>(), nb::arg("alloc"))
      .def_prop_ro("bytes", &PyAllocator::bytes, "Device bytes moerail holds from this allocator now.");

  m.def("router_workspace_bytes", &router_workspace_bytes, nb::arg("cfg"));
  m.def(
      "router_forward",
      [](const MoeConfig& cfg, const Array& logits, const OptArray& expert_bias, const Array& num_tokens,
         const Array& topk_idx, const Array& topk_probs, const OptArray& losses, const OptArray& aux_tpe,
         const OptArray& workspace, std::uintptr_t stream) {
        RouterForwardArgs a;
        a.logits = view(logits, "logits");
        a.expert_bias = view(expert_bias, "expert_bias");
        a.num_tokens = view(num_tokens, "num_tokens");
        a.topk_idx = view(topk_idx, "topk_idx");
        a.topk_probs = view(topk_probs, "topk_probs");
        a.losses = view(losses, "losses");
        a.aux_tokens_per_expert = view(aux_tpe, "aux_tokens_per_expert");
        a.workspace = view(workspace, "workspace");
        router_forward(cfg, a, stream_of(stream));
      },
      nb::arg("cfg"), nb::arg("logits"), nb::arg("expert_bias").none(), nb::arg("num_tokens"), nb::arg("topk_idx"),
      nb::arg("topk_probs"), nb::arg("losses").none(), nb::arg("aux_tokens_per_expert").none(),
      nb::arg("workspace").none(), nb::arg("stream"));
  m.def(
      "router_backward",
      [](const MoeConfig& cfg, const Array& logits, const Array& num_tokens, const Array& topk_idx,
         const Array& d_topk_probs, const OptArray& aux_tpe, const OptArray& d_losses, const Array& d_logits,
         std::uintptr_t stream) {
        RouterBackwardArgs a;
        a.logits = view(logits, "logits");
        a.num_tokens = view(num_tokens, "num_tokens");
        a.topk_idx = view(topk_idx, "topk_idx");
        a.d_topk_probs = view(d_topk_probs, "d_topk_probs");
        a.aux_tokens_per_expert = view(aux_tpe, "aux_tokens_per_expert");
        a.d_losses = view(d_losses, "d_losses");
        a.d_aux_loss = 0.0f;
        a.d_z_loss = 0.0f;
        a.d_logits = view(d_logits, "d_logits");
        router_backward(cfg, a, stream_of(stream));
      },
      nb::arg("cfg"), nb::arg("logits"), nb::arg("num_tokens"), nb::arg("topk_idx"), nb::arg("d_topk_probs"),
      nb::arg("aux_tokens_per_expert").none(), nb::arg("d_losses").none(), nb::arg("d_logits"), nb::arg("stream"));

  nb::class_<GroupedMlp>(m, "GroupedMlp",
                         "The grouped expert MLP of one layer on the current CUDA device (setup allocates and\n"
                         "synchronizes; forward/backward do neither).")
      .def(
          "__init__",
          [](GroupedMlp* self, const MoeConfig& cfg, PyAllocator* allocator) {
            MlpOptions o;
            o.allocator = allocator_of(allocator);
            new (self) GroupedMlp(cfg, o);
          },
          nb::arg("cfg"), nb::arg("allocator").none() = nb::none(), nb::keep_alive<1, 3>())
      .def_prop_ro("device_bytes", &GroupedMlp::device_bytes)
      .def("backward_workspace_bytes", &GroupedMlp::backward_workspace_bytes, nb::arg("rows"))
      .def("describe", &GroupedMlp::describe)
      .def(
          "forward",
          [](GroupedMlp& g, const Array& x, const OptArray& probs, const Array& counts, const Array& w1,
             const OptArray& b1, const Array& w2, const OptArray& b2, const Array& y, const Array& h1,
             const Array& act, std::uintptr_t stream) {
            MlpForwardArgs a;
            a.x = view(x, "x");
            a.probs = view(probs, "probs");
            a.counts = view(counts, "counts");
            a.weights = mlp_weights(w1, b1, w2, b2);
            a.y = view(y, "y");
            a.h1 = view(h1, "h1");
            a.act = view(act, "act");
            g.forward(a, stream_of(stream));
          },
          nb::arg("x"), nb::arg("probs").none(), nb::arg("counts"), nb::arg("w1"), nb::arg("b1").none(),
          nb::arg("w2"), nb::arg("b2").none(), nb::arg("y"), nb::arg("h1"), nb::arg("act"), nb::arg("stream"))
      .def(
          "backward",
          [](GroupedMlp& g, const Array& x, const OptArray& probs, const Array& counts, const Array& w1,
             const OptArray& b1, const Array& w2, const OptArray& b2, const Array& h1, const Array& act,
             const Array& dy, const Array& dx, const OptArray& d_probs, const Array& d_h1, const Array& workspace,
             const OptArray& dw1, const OptArray& db1, const OptArray& dw2, const OptArray& db2,
             std::uintptr_t stream, bool accumulate) {
            MlpBackwardArgs a;
            a.x = view(x, "x");
            a.probs = view(probs, "probs");
            a.counts = view(counts, "counts");
            a.weights = mlp_weights(w1, b1, w2, b2);
            a.h1 = view(h1, "h1");
            a.act = view(act, "act");
            a.dy = view(dy, "dy");
            a.dx = view(dx, "dx");
            a.d_probs = view(d_probs, "d_probs");
            a.d_h1 = view(d_h1, "d_h1");
            a.workspace = view(workspace, "workspace");
            if (dw1.has_value() != dw2.has_value())
              fail_with(ErrorCode::InvalidArgument, "GroupedMlp.backward: dw1 and dw2 are given together (weight "
                        "gradients now) or not at all (later, in backward_dw)");
            if (dw1.has_value()) {
              a.grads = mlp_grads(*dw1, db1, *dw2, db2);
              a.grads.accumulate = accumulate;
            }
            g.backward(a, stream_of(stream));
          },
          nb::arg("x"), nb::arg("probs").none(), nb::arg("counts"), nb::arg("w1"), nb::arg("b1").none(),
          nb::arg("w2"), nb::arg("b2").none(), nb::arg("h1"), nb::arg("act"), nb::arg("dy"), nb::arg("dx"),
          nb::arg("d_probs").none(), nb::arg("d_h1"), nb::arg("workspace"), nb::arg("dw1").none(),
          nb::arg("db1").none(), nb::arg("dw2").none(), nb::arg("db2").none(), nb::arg("stream"),
          nb::arg("accumulate") = false)
      .def(
          "backward_dw",
          [](GroupedMlp& g, const Array& x, const OptArray& probs, const Array& counts, const Array& act,
             const Array& dy, const Array& d_h1, const Array& dw1, const OptArray& db1, const Array& dw2,
             const OptArray& db2, std::uintptr_t stream, bool accumulate) {
            MlpBackwardDwArgs a;
            a.x = view(x, "x");
            a.probs = view(probs, "probs");
            a.counts = view(counts, "counts");
            a.act = view(act, "act");
            a.dy = view(dy, "dy");
            a.d_h1 = view(d_h1, "d_h1");
            a.grads = mlp_grads(dw1, db1, dw2, db2);
            a.grads.accumulate = accumulate;
            g.backward_dw(a, stream_of(stream));
          },
          "The weight gradients alone (delayed wgrad), after a backward() of the same rows without them.",
          nb::arg("x"), nb::arg("probs").none(), nb::arg("counts"), nb::arg("act"), nb::arg("dy"), nb::arg("d_h1"),
          nb::arg("dw1"), nb::arg("db1").none(), nb::arg("dw2"), nb::arg("db2").none(), nb::arg("stream"),
          nb::arg("accumulate") = false);
}

#if MOERAIL_WITH_NCCL
void bind_multi_gpu(nb::module_& m) {
  m.def("new_unique_id", []() {
    const UniqueId id = new_unique_id();
    return nb::bytes(id.bytes.data(), id.bytes.size());
  }, "A fresh ncclUniqueId (rank 0 makes it; every rank passes it to Communicator).");

  nb::class_<Communicator>(m, "Communicator",
                           "One NCCL communicator per process on one GPU (collective construction).")
      .def(
          "__init__",
          [](Communicator* self, int rank, int size, int local_rank, nb::bytes unique_id, int device) {
            UniqueId id;
            if (unique_id.size() != id.bytes.size())
              fail("moerail.Communicator", "unique_id has ", unique_id.size(), " bytes; ", id.bytes.size(),
                   " expected (from moerail._C.new_unique_id)");
            std::memcpy(id.bytes.data(), unique_id.c_str(), id.bytes.size());
            WorkerInfo info;
            info.rank = rank;
            info.world_size = size;
            info.local_rank = local_rank;
            nb::gil_scoped_release release;  // a collective: other threads of this process may need the GIL
            new (self) Communicator(info, id, device);
          },
          nb::arg("rank"), nb::arg("size"), nb::arg("local_rank"), nb::arg("unique_id"), nb::arg("device"))
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("size", &Communicator::size)
      .def_prop_ro("device", &Communicator::device)
      .def_prop_ro("nvlink_ok", &Communicator::nvlink_ok)
      .def_prop_ro("nvlink_refusal", &Communicator::nvlink_refusal);

  nb::class_<DispatchHandle>(m, "DispatchHandle",
                             "One dispatch's layout, in the array given to Dispatcher.make_handle (kept alive).")
      .def_prop_ro("defined", &DispatchHandle::defined)
      .def_prop_ro("rows", [](const DispatchHandle& h) { return h.layout().capacity; },
                   "Rows the buffers of its dispatch need: the Dispatcher's capacity, or what plan() returned.");

  // The handle given, or the Dispatcher's default one (None).
  auto handle_or_default = [](Dispatcher& d, DispatchHandle* h, auto&& op) {
    if (h) op(*h);
    else op();
  };
  nb::class_<Dispatcher>(m, "Dispatcher",
                         "Expert-parallel dispatch and combine over a Communicator (collective construction).")
      .def(
          "__init__",
          [](Dispatcher* self, const MoeConfig& cfg, Communicator& comm, const std::string& transport, int sms,
             double timeout_s, PyAllocator* allocator, int ranks_per_node) {
            DispatchOptions o;
            o.transport = parse_transport(transport, "transport");
            o.sms = sms;
            o.timeout_s = timeout_s;
            o.allocator = allocator_of(allocator);
            o.ranks_per_node = ranks_per_node;
            new (self) Dispatcher(cfg, comm, o);
          },
          nb::arg("cfg"), nb::arg("comm"), nb::arg("transport") = "auto", nb::arg("sms") = 0,
          nb::arg("timeout_s") = 60.0, nb::arg("allocator").none() = nb::none(), nb::arg("ranks_per_node") = 0,
          nb::keep_alive<1, 3>(), nb::keep_alive<1, 7>())
      .def_prop_ro("ranks_per_node", &Dispatcher::ranks_per_node)
      .def_prop_ro("node_rows", &Dispatcher::node_rows)
      .def_prop_ro("capacity", &Dispatcher::capacity)
      .def_prop_ro("transport", [](const Dispatcher& d) { return std::string(transport_name(d.transport())); })
      .def_prop_ro("workspace_bytes", &Dispatcher::workspace_bytes)
      .def_prop_ro("window_bytes", &Dispatcher::window_bytes)
      .def_prop_ro("handle_bytes", &Dispatcher::handle_bytes)
      .def(
          "make_handle", [](const Dispatcher& d, const Array& memory) { return d.make_handle(view(memory, "memory")); },
          nb::arg("memory"), nb::keep_alive<0, 2>(),
          "A DispatchHandle over memory (handle_bytes bytes on the device); the handle keeps memory alive.")
      .def(
          "check", [](Dispatcher& d, std::uintptr_t stream) { d.check(stream_of(stream)); }, nb::arg("stream"),
          "Reads the status word (one host sync); raises moerail.Error naming this rank and the problem.")
      .def(
          "plan",
          [](Dispatcher& d, const Array& topk_idx, const Array& probs, const Array& num_tokens, std::uintptr_t stream,
             DispatchHandle& handle) {
            const EpPlanArgs a{view(topk_idx, "topk_idx"), view(probs, "probs"), view(num_tokens, "num_tokens")};
            return d.plan(a, handle, stream_of(stream));
          },
          nb::arg("topk_idx"), nb::arg("probs"), nb::arg("num_tokens"), nb::arg("stream"), nb::arg("handle"),
          "Plans the handle's dispatch and returns the rows it will write (one host sync): the dispatch that comes\n"
          "next over the handle, with the same routing, then takes buffers of exactly that many rows.")
      .def(
          "dispatch",
          [=](Dispatcher& d, const Array& x, const Array& topk_idx, const Array& probs, const Array& num_tokens,
              const Array& recv, const Array& recv_probs, std::uintptr_t stream, DispatchHandle* handle) {
            const EpDispatchArgs a{view(x, "x"), view(topk_idx, "topk_idx"), view(probs, "probs"),
                                   view(num_tokens, "num_tokens"), view(recv, "recv"), view(recv_probs, "recv_probs")};
            handle_or_default(d, handle, [&](auto&&... h) { d.dispatch(a, h..., stream_of(stream)); });
          },
          nb::arg("x"), nb::arg("topk_idx"), nb::arg("probs"), nb::arg("num_tokens"), nb::arg("recv"),
          nb::arg("recv_probs"), nb::arg("stream"), nb::arg("handle").none() = nb::none())
      .def(
          "combine",
          [=](Dispatcher& d, const std::string& mode, const Array& y, const Array& out, std::uintptr_t stream,
              DispatchHandle* handle) {
            const EpCombineArgs a{parse_prob_mode(mode), view(y, "y"), view(out, "out")};
            handle_or_default(d, handle, [&](auto&&... h) { d.combine(a, h..., stream_of(stream)); });
          },
          nb::arg("prob_mode"), nb::arg("y"), nb::arg("out"), nb::arg("stream"), nb::arg("handle").none() = nb::none())
      .def(
          "dispatch_backward",
          [=](Dispatcher& d, const Array& d_recv, const OptArray& d_recv_probs, const Array& dx,
              const OptArray& d_probs, std::uintptr_t stream, DispatchHandle* handle) {
            const EpDispatchBackwardArgs a{view(d_recv, "d_recv"), view(d_recv_probs, "d_recv_probs"), view(dx, "dx"),
                                           view(d_probs, "d_probs")};
            handle_or_default(d, handle, [&](auto&&... h) { d.dispatch_backward(a, h..., stream_of(stream)); });
          },
          nb::arg("d_recv"), nb::arg("d_recv_probs").none(), nb::arg("dx"), nb::arg("d_probs").none(),
          nb::arg("stream"), nb::arg("handle").none() = nb::none())
      .def(
          "combine_backward",
          [=](Dispatcher& d, const std::string& mode, const Array& d_out, const OptArray& y, const Array& d_y,
              const OptArray& d_probs, std::uintptr_t stream, DispatchHandle* handle) {
            const EpCombineBackwardArgs a{parse_prob_mode(mode), view(d_out, "d_out"), view(y, "y"), view(d_y, "d_y"),
                                          view(d_probs, "d_probs")};
            handle_or_default(d, handle, [&](auto&&... h) { d.combine_backward(a, h..., stream_of(stream)); });
          },
          nb::arg("prob_mode"), nb::arg("d_out"), nb::arg("y").none(), nb::arg("d_y"), nb::arg("d_probs").none(),
          nb::arg("stream"), nb::arg("handle").none() = nb::none())
      .def(
          "zero_unused_rows",
          [](Dispatcher& d, const Array& recv, const OptArray& recv_probs, std::uintptr_t stream,
             const DispatchHandle& handle) {
            d.zero_unused_rows(view(recv, "recv"), view(recv_probs, "recv_probs"), handle, stream_of(stream));
          },
          nb::arg("recv"), nb::arg("recv_probs").none(), nb::arg("stream"), nb::arg("handle"),
          "Zeros the rows of recv (and recv_probs) past the handle's last segment.")
      .def(
          "segment_rows",
          [](Dispatcher& d, const Array& out, std::uintptr_t stream, const DispatchHandle* handle) {
            copy_into(handle ? handle->layout().segment_rows : d.layout().segment_rows, out, "out", stream);
          },
          nb::arg("out"), nb::arg("stream"), nb::arg("handle").none() = nb::none(),
          "Copies the rows of each local expert's segment ([L] int32, padded) of the handle's dispatch (default:\n"
          "the last dispatch over the default handle) into out.");

  nb::class_<MoeSaved>(m, "MoeSaved",
                       "What one forward keeps for its backward, in the array given to MoeLayer.make_saved (kept "
                       "alive).")
      .def_prop_ro("defined", &MoeSaved::defined);

  nb::class_<MoeLayer>(m, "MoeLayer", "The whole MoE layer on this rank (collective construction).")
      .def(
          "__init__",
          [](MoeLayer* self, const MoeConfig& cfg, Communicator& comm, const std::string& transport, int sms,
             int chunks, PyAllocator* allocator, const std::string& recipe, const std::string& fp8_weight_grads) {
            MoeLayerOptions o;
            o.dispatch.transport = parse_transport(transport, "transport");
            o.dispatch.sms = sms;
            o.chunks = chunks;
            o.recipe = recipe_of(recipe);
            o.fp8_weight_grads = fp8_weight_grads_of(fp8_weight_grads);
            o.check_eager = false;    // the Python layer calls check() itself, never under graph capture
            o.default_saved = false;  // every forward gets a MoeSaved of its own from moerail.torch
            o.allocator = allocator_of(allocator);
            new (self) MoeLayer(cfg, comm, o);
          },
          nb::arg("cfg"), nb::arg("comm"), nb::arg("transport") = "auto", nb::arg("sms") = 0, nb::arg("chunks") = 1,
          nb::arg("allocator").none() = nb::none(), nb::arg("recipe") = "bf16", nb::arg("fp8_weight_grads") = "fp8",
          nb::keep_alive<1, 3>(),
          nb::keep_alive<1, 7>())
      .def(
          "refresh_fp8_weights",
          [](MoeLayer& l, const Array& w1, const Array& w2, std::uintptr_t stream) {
            MlpWeights w;
            w.w1 = view(w1, "w1");
            w.w2 = view(w2, "w2");
            l.refresh_fp8_weights(w, stream_of(stream));
          },
          nb::arg("w1"), nb::arg("w2"), nb::arg("stream"),
          "Recipe fp8-blockwise: quantizes the experts' bf16 weights into the layer's FP8 weights (every later\n"
          "step uses them; call it again after each update of the weights).")
      .def_prop_ro("capacity", &MoeLayer::capacity)
      .def_prop_ro("workspace_bytes", &MoeLayer::workspace_bytes)
      .def_prop_ro("window_bytes", &MoeLayer::window_bytes)
      .def_prop_ro("saved_bytes", &MoeLayer::saved_bytes)
      .def(
          "make_saved", [](const MoeLayer& l, const Array& memory) { return l.make_saved(view(memory, "memory")); },
          nb::arg("memory"), nb::keep_alive<0, 2>(),
          "A MoeSaved over memory (saved_bytes bytes on the device); the MoeSaved keeps memory alive.")
      .def(
          "check", [](MoeLayer& l, std::uintptr_t stream) { l.check(stream_of(stream)); }, nb::arg("stream"),
          "Reads the status words (one host sync); raises moerail.Error naming this rank and the problem.")
      .def(
          "forward",
          [](MoeLayer& l, const Array& x, const Array& num_tokens, const Array& out, const Array& router,
             const OptArray& expert_bias, const Array& w1, const OptArray& b1, const Array& w2, const OptArray& b2,
             const OptArray& shared_w1, const OptArray& shared_w2, std::uintptr_t stream, MoeSaved* saved) {
            MoeForwardArgs a;
            a.x = view(x, "x");
            a.num_tokens = view(num_tokens, "num_tokens");
            a.out = view(out, "out");
            a.weights.router = view(router, "router");
            a.weights.expert_bias = view(expert_bias, "expert_bias");
            a.weights.experts = mlp_weights(w1, b1, w2, b2);
            a.weights.shared_w1 = view(shared_w1, "shared_w1");
            a.weights.shared_w2 = view(shared_w2, "shared_w2");
            if (saved) l.forward(a, *saved, stream_of(stream));
            else l.forward(a, stream_of(stream));
          },
          nb::arg("x"), nb::arg("num_tokens"), nb::arg("out"), nb::arg("router"), nb::arg("expert_bias").none(),
          nb::arg("w1"), nb::arg("b1").none(), nb::arg("w2"), nb::arg("b2").none(), nb::arg("shared_w1").none(),
          nb::arg("shared_w2").none(), nb::arg("stream"), nb::arg("saved").none() = nb::none())
      .def(
          "backward",
          [](MoeLayer& l, const Array& d_out, const Array& dx, const Array& d_losses, const Array& d_router,
             const Array& dw1, const OptArray& db1, const Array& dw2, const OptArray& db2,
             const OptArray& d_shared_w1, const OptArray& d_shared_w2, std::uintptr_t stream,
             bool accumulate_experts, const MoeSaved* saved) {
            MoeBackwardArgs a;
            a.d_out = view(d_out, "d_out");
            a.dx = view(dx, "dx");
            a.d_losses = view(d_losses, "d_losses");
            a.grads.d_router = view(d_router, "d_router");
            a.grads.experts = mlp_grads(dw1, db1, dw2, db2);
            a.grads.experts.accumulate = accumulate_experts;
            a.grads.d_shared_w1 = view(d_shared_w1, "d_shared_w1");
            a.grads.d_shared_w2 = view(d_shared_w2, "d_shared_w2");
            if (saved) l.backward(a, *saved, stream_of(stream));
            else l.backward(a, stream_of(stream));
          },
          nb::arg("d_out"), nb::arg("dx"), nb::arg("d_losses"), nb::arg("d_router"), nb::arg("dw1"),
          nb::arg("db1").none(), nb::arg("dw2"), nb::arg("db2").none(), nb::arg("d_shared_w1").none(),
          nb::arg("d_shared_w2").none(), nb::arg("stream"), nb::arg("accumulate_experts") = false,
          nb::arg("saved").none() = nb::none())
      .def(
          "router_outputs",
          [](MoeLayer& l, const Array& topk_idx, const Array& topk_probs, const Array& losses,
             std::uintptr_t stream) {
            copy_into(l.topk_idx(), topk_idx, "topk_idx", stream);
            copy_into(l.topk_probs(), topk_probs, "topk_probs", stream);
            copy_into(l.losses(), losses, "losses", stream);
          },
          nb::arg("topk_idx"), nb::arg("topk_probs"), nb::arg("losses"), nb::arg("stream"),
          "Copies the router outputs of the last forward ([T_max, K] int32, [T_max, K] float32, [2] float32).")
      .def(
          "expert_rows",
          [](MoeLayer& l, const Array& out, std::uintptr_t stream) {
            copy_into(l.expert_rows(), out, "out", stream);
          },
          nb::arg("out"), nb::arg("stream"));
}
#endif

}  // namespace

void bind_gpu(nb::module_& m) {
  bind_single_gpu(m);
#if MOERAIL_WITH_NCCL
  bind_multi_gpu(m);
#endif
}

}  // namespace moerail::py

#endif  // MOERAIL_WITH_CUDA
