// moerail/config.h — MoeConfig: the shape and options of one MoE layer.
//
// Every field has a default; validate() reports every problem at once. Sizes use the letters of docs/design.md:
// T tokens on a rank, H hidden, F expert FFN size, E experts, K top-k, R expert-parallel ranks, L = E / R local
// experts, A alignment rows per expert segment, T_max the per-rank token bound.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "moerail/dtype.h"

namespace moerail {

// The most chunks of a chunked layer step (MoeLayerOptions::chunks), and so the most regions of a chunked weight
// gradient (MlpBackwardDwArgs::chunk_rows). Here, free of CUDA headers, for the tools and bindings that check it.
inline constexpr std::int64_t kMaxMlpChunks = 16;

// Score function of the router (TransformerEngine's fused router semantics).
enum class ScoreFunction { Softmax, Sigmoid, SqrtSoftplus };

// Expert activation. GLU kinds split FC1's output [rows, 2F] into a gate half a and a linear half b:
//   SwiGLU      silu(a) * b
//   GeGLU       gelu(a) * b                         (tanh approximation of gelu, as TransformerEngine)
//   QuickGeGLU  qgelu(min(a, limit)) * (clamp(b, -limit, limit) + offset),  qgelu(x) = x * sigmoid(alpha * x)
// Non-GLU kinds take FC1's output [rows, F]:
//   ReLU2       relu(x)^2
//   GELU        gelu(x)                             (tanh approximation)
enum class Activation { SwiGLU, GeGLU, QuickGeGLU, ReLU2, GELU };

constexpr bool is_glu(Activation a) {
  return a == Activation::SwiGLU || a == Activation::GeGLU || a == Activation::QuickGeGLU;
}

// How the gate (a) and linear (b) halves of a GLU's FC1 output are laid out along its 2F columns:
//   Concatenated            [a_0 .. a_{F-1} | b_0 .. b_{F-1}]                  (Megatron's default)
//   Interleaved (block g)   [a_0..a_{g-1}, b_0..b_{g-1}, a_g..a_{2g-1}, ...]   (moe_mlp_glu_interleave_size)
enum class GluLayout { Concatenated, Interleaved };

// Where the router prob p[t,k] multiplies the expert path:
//   InActivation  inside the expert MLP: y = p * (act(x W1^T + b1) W2^T + b2); combine sums with weight 1
//                 (Megatron's default; note that p also scales the FC2 bias, as Megatron's experts do).
//   InCombine     the experts ignore p; combine computes sum_k p[t,k] * y[row(t,k)].
enum class ProbMode { InActivation, InCombine };

// Buffer sizing policy for the received rows of each rank (docs/design.md, "Memory and capacity"):
//   WorstCase      R * T_max * min(K, L) + L * (A - 1) rows: nothing can be dropped.
//   Factor(c)      a rank's budget: ceil(c * T_max * K) + L * (A - 1) rows, shared by its L experts (Megatron's
//                  moe_expert_rank_capacity_factor).
//   PerExpert(c)   every local expert's segment holds at most S = ceil(c * R * T_max * K / E) rows rounded up to A
//                  (Megatron's moe_expert_capacity_factor: ceil(c * T * K / E) per expert from each of the R source
//                  ranks); the buffer is L * S rows.
// Rows that do not fit are dropped (never written), counted on the device and reported by check().
struct Capacity {
  enum class Kind { WorstCase, Factor, PerExpert };
  Kind kind = Kind::WorstCase;
  double factor = 1.0;  // Kind::Factor and Kind::PerExpert; > 0

  static Capacity worst_case() { return {Kind::WorstCase, 1.0}; }
  static Capacity of_factor(double c) { return {Kind::Factor, c}; }
  static Capacity per_expert(double c) { return {Kind::PerExpert, c}; }
  std::string str() const;  // "worst-case", "factor(1.5)" or "per-expert(1.25)"
};

struct RouterConfig {
  ScoreFunction score = ScoreFunction::Softmax;
  bool pre_softmax = false;        // softmax over all E before top-k (else softmax over the K selected logits)
  std::int64_t num_groups = 0;     // group-limited top-k: experts split into num_groups groups; 0 or 1 = off
  std::int64_t group_topk = 0;     // groups kept per token when num_groups > 1
  double scaling_factor = 1.0;     // multiplies the final weights
  bool use_expert_bias = false;    // expert_bias [E] f32 is added to the scores for selection only
  double aux_loss_coeff = 0.0;     // load-balancing loss coefficient; 0 = no aux loss
  double z_loss_coeff = 0.0;       // router z-loss coefficient; 0 = no z-loss
};

struct MoeConfig {
  std::int64_t hidden = 1024;        // H
  std::int64_t ffn_hidden = 512;     // F: FFN size of one expert (FC1 has 2F outputs for GLU activations)
  std::int64_t num_experts = 8;      // E
  std::int64_t topk = 2;             // K, 1 <= K <= E
  std::int64_t ep_size = 1;          // R: expert-parallel ranks; E % R == 0
  std::int64_t align = 1;            // A: rows of each expert segment are padded to a multiple of A (power of 2)
  std::int64_t max_tokens = 4096;    // T_max: most tokens any rank brings in one step
  Activation activation = Activation::SwiGLU;
  GluLayout glu_layout = GluLayout::Concatenated;
  std::int64_t glu_block = 0;        // g for GluLayout::Interleaved; F % g == 0
  double quick_geglu_alpha = 1.702;  // QuickGeGLU constants (TransformerEngine's defaults)
  double quick_geglu_limit = 7.0;
  double quick_geglu_offset = 1.0;
  bool fc1_bias = false;             // b1 [L, F1]
  bool fc2_bias = false;             // b2 [L, H]
  ProbMode prob_mode = ProbMode::InActivation;
  Capacity capacity = Capacity::worst_case();
  RouterConfig router;
  std::int64_t shared_expert_ffn = 0;  // FFN size of the optional shared expert (same activation); 0 = none
  DType dtype = DType::BF16;         // activation and weight dtype of the GPU path

  // Throws Error(InvalidArgument) listing every problem found, or returns.
  void validate() const;

  std::int64_t local_experts() const { return num_experts / ep_size; }              // L
  std::int64_t fc1_out() const { return is_glu(activation) ? 2 * ffn_hidden : ffn_hidden; }  // F1
  // Rows of the receive buffer of each rank under the capacity policy (Capacity, above):
  //   WorstCase      R * T_max * min(K, L) + L * (A - 1)
  //   Factor(c)      ceil(c * T_max * K) + L * (A - 1)
  //   PerExpert(c)   L * expert_rows()
  std::int64_t rows_per_rank() const;
  // PerExpert(c): the most rows of one expert's segment, ceil(c * R * T_max * K / E) rounded up to A; else 0 (no
  // per-expert bound).
  std::int64_t expert_rows() const;
  // Tokens a source stages for one other rank on the host-API transport (the rows it sends that peer per op), at
  // most T_max (and T_max for ep_size 1):
  //   WorstCase     T_max (nothing is dropped)
  //   Factor(c)     ceil(c * T_max * p), p = 1 - C(E - L, K) / C(E, K): c times the share of a rank's tokens that
  //                 reach a given other rank when each token picks K of the E experts uniformly
  //   PerExpert(c)  L * ceil(c * T_max * K / E): the most a source sends a peer when it keeps its per-expert share of
  //                 each of the peer's L experts (Megatron's capacity, which its router enforces on each rank: then
  //                 nothing more is dropped here)
  // A source's later tokens for that rank lose their slots there: dropped at the source, counted on the device and
  // reported by check() (docs/dispatch.md, "Host-API transport").
  std::int64_t peer_rows() const;
  std::string summary() const;  // one line: "H=7168 F=2048 E=256 K=8 R=8 A=128 T_max=4096 swiglu ..."
};

// The shared expert as a layer of its own: one expert (E = R = K = 1, A = 1) of FFN size cfg.shared_expert_ffn over
// every token, cfg's activation with concatenated GLU halves, no biases, no probs (ProbMode::InCombine), no router.
MoeConfig shared_expert_config(const MoeConfig& cfg);

std::string_view name_of(ScoreFunction s);
std::string_view name_of(Activation a);
std::string_view name_of(ProbMode m);

// Named model shapes used by the command line and the benchmarks; throws listing the known names.
MoeConfig preset_config(std::string_view name);
// The names preset_config accepts, comma-separated.
std::string_view preset_names();

}  // namespace moerail
