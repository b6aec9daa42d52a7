// python/src/bind_config.cpp — moerail.Config (MoeConfig) with the router options flattened onto it, enums as
// the strings the command line uses ("swiglu", "sigmoid", "in-combine", ...).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <optional>
#include <string>

#include "bindings.h"
#include "moerail/config.h"
#include "moerail/error.h"

namespace moerail::py {
namespace {

template <typename Enum, std::size_t N>
Enum parse_enum(const std::string& s, const Enum (&values)[N], const char* what) {
  std::string known;
  for (Enum v : values) {
    if (name_of(v) == s) return v;
    known += (known.empty() ? "" : ", ") + std::string(name_of(v));
  }
  fail("moerail", what, " = '", s, "' is not one of ", known);
}

constexpr ScoreFunction kScores[] = {ScoreFunction::Softmax, ScoreFunction::Sigmoid, ScoreFunction::SqrtSoftplus};
constexpr Activation kActivations[] = {Activation::SwiGLU, Activation::GeGLU, Activation::QuickGeGLU,
                                       Activation::ReLU2, Activation::GELU};
constexpr ProbMode kProbModes[] = {ProbMode::InActivation, ProbMode::InCombine};

// The plain-int64 and bool fields, bound by name.
#define MOERAIL_FIELD(name) .def_rw(#name, &MoeConfig::name)
#define MOERAIL_ROUTER_FIELD(name)                                                   \
  .def_prop_rw(                                                                      \
      #name, [](const MoeConfig& c) { return c.router.name; },                       \
      [](MoeConfig& c, decltype(RouterConfig::name) v) { c.router.name = v; })

}  // namespace

ProbMode parse_prob_mode(const std::string& s) { return parse_enum(s, kProbModes, "prob_mode"); }

void bind_config(nb::module_& m) {
  nb::class_<MoeConfig>(m, "Config",
                        "Shape and options of one MoE layer (C++ moerail::MoeConfig). Every field has a default;\n"
                        "validate() lists every problem. Router options are fields of their own here\n"
                        "(score_function, num_groups, ...). Construct with keywords: Config(hidden=1024, topk=2).")
      .def(nb::init<>())
      MOERAIL_FIELD(hidden) MOERAIL_FIELD(ffn_hidden) MOERAIL_FIELD(num_experts) MOERAIL_FIELD(topk)
      MOERAIL_FIELD(ep_size) MOERAIL_FIELD(align) MOERAIL_FIELD(max_tokens) MOERAIL_FIELD(glu_block)
      MOERAIL_FIELD(quick_geglu_alpha) MOERAIL_FIELD(quick_geglu_limit) MOERAIL_FIELD(quick_geglu_offset)
      MOERAIL_FIELD(fc1_bias) MOERAIL_FIELD(fc2_bias) MOERAIL_FIELD(shared_expert_ffn)
      MOERAIL_ROUTER_FIELD(pre_softmax) MOERAIL_ROUTER_FIELD(num_groups) MOERAIL_ROUTER_FIELD(group_topk)
      MOERAIL_ROUTER_FIELD(scaling_factor) MOERAIL_ROUTER_FIELD(use_expert_bias)
      MOERAIL_ROUTER_FIELD(aux_loss_coeff) MOERAIL_ROUTER_FIELD(z_loss_coeff)
      .def_prop_rw(
          "activation", [](const MoeConfig& c) { return std::string(name_of(c.activation)); },
          [](MoeConfig& c, const std::string& s) { c.activation = parse_enum(s, kActivations, "activation"); },
          "swiglu | geglu | quick-geglu | relu2 | gelu")
      .def_prop_rw(
          "score_function", [](const MoeConfig& c) { return std::string(name_of(c.router.score)); },
          [](MoeConfig& c, const std::string& s) { c.router.score = parse_enum(s, kScores, "score_function"); },
          "softmax | sigmoid | sqrtsoftplus")
      .def_prop_rw(
          "prob_mode", [](const MoeConfig& c) { return std::string(name_of(c.prob_mode)); },
          [](MoeConfig& c, const std::string& s) { c.prob_mode = parse_enum(s, kProbModes, "prob_mode"); },
          "in-activation (the experts multiply by the prob) | in-combine (combine does)")
      .def_prop_rw(
          "glu_layout",
          [](const MoeConfig& c) {
            return std::string(c.glu_layout == GluLayout::Interleaved ? "interleaved" : "concatenated");
          },
          [](MoeConfig& c, const std::string& s) {
            if (s == "concatenated") c.glu_layout = GluLayout::Concatenated;
            else if (s == "interleaved") c.glu_layout = GluLayout::Interleaved;
            else fail("moerail.Config", "glu_layout = '", s, "' is not one of concatenated, interleaved");
          },
          "concatenated | interleaved (blocks of glu_block rows)")
      .def_prop_rw(
          "capacity_factor",
          [](const MoeConfig& c) -> nb::object {
            if (c.capacity.kind != Capacity::Kind::PerExpert) return nb::none();
            return nb::float_(c.capacity.factor);
          },
          [](MoeConfig& c, std::optional<double> f) {
            c.capacity = f ? Capacity::per_expert(*f) : Capacity::worst_case();
          },
          nb::for_setter(nb::arg("value").none()),
          "Per-expert capacity (Megatron's moe_expert_capacity_factor): c > 0 gives each expert a segment of\n"
          "ceil(c R T_max K / E) rows rounded up to align; None: worst-case buffers (never drop), unless\n"
          "rank_capacity_factor is set. Rows that do not fit are dropped and reported by check().")
      .def_prop_rw(
          "rank_capacity_factor",
          [](const MoeConfig& c) -> nb::object {
            if (c.capacity.kind != Capacity::Kind::Factor) return nb::none();
            return nb::float_(c.capacity.factor);
          },
          [](MoeConfig& c, std::optional<double> f) {
            c.capacity = f ? Capacity::of_factor(*f) : Capacity::worst_case();
          },
          nb::for_setter(nb::arg("value").none()),
          "Per-rank capacity (Megatron's moe_expert_rank_capacity_factor): c > 0 gives each rank\n"
          "ceil(c T_max K) + L (align - 1) rows shared by its experts; None: worst case, unless capacity_factor\n"
          "is set.")
      .def_prop_ro("expert_rows", &MoeConfig::expert_rows,
                   "Rows of one expert's segment under capacity_factor (0 without a per-expert capacity).")
      .def("validate", &MoeConfig::validate, "Raises moerail.Error listing every problem, or returns.")
      .def_prop_ro("local_experts", &MoeConfig::local_experts)
      .def_prop_ro("fc1_out", &MoeConfig::fc1_out)
      .def_prop_ro("rows_per_rank", &MoeConfig::rows_per_rank)
      .def("summary", &MoeConfig::summary)
      .def("__repr__", [](const MoeConfig& c) { return "moerail.Config(" + c.summary() + ")"; })
      .def("copy", [](const MoeConfig& c) { return c; })
      .def("shared_expert_config", &shared_expert_config,
           "The shared expert as a layer of its own (one expert over every token).");
  m.def(
      "preset", [](const std::string& name) { return preset_config(name); }, nb::arg("name"),
      "A named model shape: deepseek-v3, qwen3-30b-a3b, mixtral-8x7b, small.");
  m.def("preset_names", []() { return std::string(preset_names()); });
}

}  // namespace moerail::py
