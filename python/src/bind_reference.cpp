// python/src/bind_reference.cpp — the CPU reference (moerail::ref) for one rank: the backend moerail.torch uses for
// CPU tensors, and an oracle for tests. Arrays of any floating dtype; computed in double, rounded once on store.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <span>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/experts.h"
#include "moerail/reference/layout.h"
#include "moerail/reference/router.h"

namespace moerail::py {
namespace {

constexpr const char* kPlan = "moerail.RefPlan";

// The layout of one rank's dispatch (R = 1) and the data movement over it.
class RefPlan {
 public:
  RefPlan(const MoeConfig& cfg, const Array& topk_idx, std::int64_t capacity) : cfg_(cfg) {
    if (cfg.ep_size != 1) fail(kPlan, "cfg.ep_size = ", cfg.ep_size, "; the Python reference backend runs one rank");
    const TensorView idx = host_view(topk_idx, "topk_idx");
    plan_ = ref::plan_layout(cfg, std::span<const TensorView>(&idx, 1), capacity);
  }

  std::int64_t capacity() const { return plan_.capacity; }
  std::int64_t rows_used() const { return plan_.rows_used[0]; }
  std::int64_t overflow() const { return plan_.overflow[0]; }
  std::vector<std::int64_t> segment_rows() const { return plan_.local_segment_rows(0); }
  std::vector<std::int64_t> tokens_per_expert() const { return plan_.tokens_per_expert; }
  std::vector<std::int32_t> dest_row() const { return plan_.dest_row[0]; }

  void dispatch(const Array& x, const OptArray& probs, const Array& recv, const OptArray& recv_probs) const {
    const TensorView v[] = {host(x, "x"), host(probs, "probs"), host(recv, "recv"), host(recv_probs, "recv_probs")};
    ref::DispatchArgs a;
    a.x = one(v[0]);
    a.recv = one(v[2]);
    if (v[1].defined()) a.probs = one(v[1]);
    if (v[3].defined()) a.recv_probs = one(v[3]);
    ref::dispatch_forward(plan_, a);
  }
  void dispatch_backward(const Array& d_recv, const OptArray& d_recv_probs, const Array& dx,
                         const OptArray& d_probs) const {
    const TensorView v[] = {host(d_recv, "d_recv"), host(d_recv_probs, "d_recv_probs"), host(dx, "dx"),
                            host(d_probs, "d_probs")};
    ref::DispatchBackwardArgs a;
    a.d_recv = one(v[0]);
    a.dx = one(v[2]);
    if (v[1].defined()) a.d_recv_probs = one(v[1]);
    if (v[3].defined()) a.d_probs = one(v[3]);
    ref::dispatch_backward(plan_, a);
  }
  void combine(const Array& y, const OptArray& probs, const Array& out) const {
    const TensorView v[] = {host(y, "y"), host(probs, "probs"), host(out, "out")};
    ref::CombineArgs a;
    a.mode = cfg_.prob_mode;
    a.y = one(v[0]);
    if (v[1].defined()) a.probs = one(v[1]);
    a.out = one(v[2]);
    ref::combine_forward(plan_, a);
  }
  void combine_backward(const Array& d_out, const OptArray& y, const OptArray& probs, const Array& d_y,
                        const OptArray& d_probs) const {
    const TensorView v[] = {host(d_out, "d_out"), host(y, "y"), host(probs, "probs"), host(d_y, "d_y"),
                            host(d_probs, "d_probs")};
    ref::CombineBackwardArgs a;
    a.mode = cfg_.prob_mode;
    a.d_out = one(v[0]);
    if (v[1].defined()) a.y = one(v[1]);
    if (v[2].defined()) a.probs = one(v[2]);
    a.d_y = one(v[3]);
    if (v[4].defined()) a.d_probs = one(v[4]);
    ref::combine_backward(plan_, a);
  }

 private:
  static TensorView host(const OptArray& a, const char* name) { return host_view(a, name); }
  static std::span<const TensorView> one(const TensorView& t) { return {&t, 1}; }

  MoeConfig cfg_;
  ref::LayoutPlan plan_;
};

ref::ExpertWeights expert_weights(const Array& w1, const OptArray& b1, const Array& w2, const OptArray& b2) {
  return {host_view(w1, "w1"), host_view(b1, "b1"), host_view(w2, "w2"), host_view(b2, "b2")};
}

}  // namespace

void bind_reference(nb::module_& m) {
  nb::class_<RefPlan>(m, "RefPlan",
                      "The dispatch layout of one rank on the CPU (reference): expert-major rows, padded to\n"
                      "cfg.align, and the data movement over it (dispatch, combine and their backward).")
      .def(nb::init<const MoeConfig&, const Array&, std::int64_t>(), nb::arg("cfg"), nb::arg("topk_idx"),
           nb::arg("capacity") = -1)
      .def_prop_ro("capacity", &RefPlan::capacity)
      .def_prop_ro("rows_used", &RefPlan::rows_used)
      .def_prop_ro("overflow", &RefPlan::overflow)
      .def_prop_ro("segment_rows", &RefPlan::segment_rows)
      .def_prop_ro("tokens_per_expert", &RefPlan::tokens_per_expert)
      .def_prop_ro("dest_row", &RefPlan::dest_row)
      .def("dispatch", &RefPlan::dispatch, nb::arg("x"), nb::arg("probs").none(), nb::arg("recv"),
           nb::arg("recv_probs").none())
      .def("dispatch_backward", &RefPlan::dispatch_backward, nb::arg("d_recv"), nb::arg("d_recv_probs").none(),
           nb::arg("dx"), nb::arg("d_probs").none())
      .def("combine", &RefPlan::combine, nb::arg("y"), nb::arg("probs").none(), nb::arg("out"))
      .def("combine_backward", &RefPlan::combine_backward, nb::arg("d_out"), nb::arg("y").none(),
           nb::arg("probs").none(), nb::arg("d_y"), nb::arg("d_probs").none());

  m.def(
      "ref_router_forward",
      [](const MoeConfig& cfg, const Array& logits, const OptArray& expert_bias, const Array& topk_idx,
         const Array& topk_probs, std::int64_t total_tokens) {
        ref::RouterForwardArgs a{host_view(logits, "logits"), host_view(expert_bias, "expert_bias"),
                                 host_view(topk_idx, "topk_idx"), host_view(topk_probs, "topk_probs"), total_tokens};
        const ref::RouterLosses l = ref::router_forward(cfg, a);
        return std::make_tuple(l.aux_loss, l.z_loss, l.tokens_per_expert);
      },
      nb::arg("cfg"), nb::arg("logits"), nb::arg("expert_bias").none(), nb::arg("topk_idx"), nb::arg("topk_probs"),
      nb::arg("total_tokens") = -1, "Router forward on the CPU; returns (aux_loss, z_loss, tokens_per_expert).");
  m.def(
      "ref_router_backward",
      [](const MoeConfig& cfg, const Array& logits, const OptArray& expert_bias, const Array& topk_idx,
         const Array& d_topk_probs, double d_aux, double d_z, std::int64_t total_tokens, const Array& d_logits) {
        ref::RouterBackwardArgs a;
        a.logits = host_view(logits, "logits");
        a.expert_bias = host_view(expert_bias, "expert_bias");
        a.topk_idx = host_view(topk_idx, "topk_idx");
        a.d_topk_probs = host_view(d_topk_probs, "d_topk_probs");
        a.d_aux_loss = d_aux;
        a.d_z_loss = d_z;
        a.total_tokens = total_tokens;
        a.d_logits = host_view(d_logits, "d_logits");
        ref::router_backward(cfg, a);
      },
      nb::arg("cfg"), nb::arg("logits"), nb::arg("expert_bias").none(), nb::arg("topk_idx"),
      nb::arg("d_topk_probs"), nb::arg("d_aux_loss"), nb::arg("d_z_loss"), nb::arg("total_tokens"),
      nb::arg("d_logits"));
  m.def(
      "ref_experts_forward",
      [](const MoeConfig& cfg, const Array& x, const OptArray& probs, const std::vector<std::int64_t>& rows,
         const Array& w1, const OptArray& b1, const Array& w2, const OptArray& b2, const Array& y,
         const std::string& recipe) {
        ref::ExpertsForwardArgs a;
        a.recipe = recipe_of(recipe);
        a.x = host_view(x, "x");
        a.probs = host_view(probs, "probs");
        a.rows_per_expert = rows;
        a.weights = expert_weights(w1, b1, w2, b2);
        a.y = host_view(y, "y");
        ref::experts_forward(cfg, a);
      },
      nb::arg("cfg"), nb::arg("x"), nb::arg("probs").none(), nb::arg("rows_per_expert"), nb::arg("w1"),
      nb::arg("b1").none(), nb::arg("w2"), nb::arg("b2").none(), nb::arg("y"), nb::arg("recipe") = "bf16");
  m.def(
      "ref_experts_backward",
      [](const MoeConfig& cfg, const Array& x, const OptArray& probs, const std::vector<std::int64_t>& rows,
         const Array& w1, const OptArray& b1, const Array& w2, const OptArray& b2, const Array& dy,
         const OptArray& dx, const OptArray& d_probs, const OptArray& dw1, const OptArray& db1,
         const OptArray& dw2, const OptArray& db2, const std::string& recipe, const std::string& fp8_weight_grads) {
        ref::ExpertsBackwardArgs a;
        a.recipe = recipe_of(recipe);
        a.fp8_weight_grads = fp8_weight_grads_of(fp8_weight_grads);
        a.x = host_view(x, "x");
        a.probs = host_view(probs, "probs");
        a.rows_per_expert = rows;
        a.weights = expert_weights(w1, b1, w2, b2);
        a.dy = host_view(dy, "dy");
        a.dx = host_view(dx, "dx");
        a.d_probs = host_view(d_probs, "d_probs");
        a.grads = {host_view(dw1, "dw1"), host_view(db1, "db1"), host_view(dw2, "dw2"), host_view(db2, "db2")};
        ref::experts_backward(cfg, a);
      },
      nb::arg("cfg"), nb::arg("x"), nb::arg("probs").none(), nb::arg("rows_per_expert"), nb::arg("w1"),
      nb::arg("b1").none(), nb::arg("w2"), nb::arg("b2").none(), nb::arg("dy"), nb::arg("dx").none(),
      nb::arg("d_probs").none(), nb::arg("dw1").none(), nb::arg("db1").none(), nb::arg("dw2").none(),
      nb::arg("db2").none(), nb::arg("recipe") = "bf16", nb::arg("fp8_weight_grads") = "fp8");
}

}  // namespace moerail::py
