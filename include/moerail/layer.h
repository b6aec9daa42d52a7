// moerail/layer.h — the whole MoE layer on 1..N GPUs: router gate -> router -> dispatch -> grouped expert MLP ->
// combine (+ the optional shared expert), forward and backward, eager or captured once as CUDA graphs.
//
// Contract: moerail/reference/layer.h (ref::Layer) on the same weights, per rank:
//   logits = x W_router^T (bf16)      (topk_idx, topk_probs), aux, z = router(logits)
//   recv = dispatch(x)                y = experts(recv)               out = combine(y) [+ shared_expert(x)]
// and the backward of J = <out, d_out> + d_aux * aux + d_z * z: dx, and the gradients of every weight of this rank
// (router weight and shared expert: this rank's share; summing them over ranks is the caller's data-parallel
// all-reduce, as for any replicated weight).
//
// Setup (the constructor) sizes and allocates everything once from cfg (T_max, capacity policy of docs/design.md)
// from MoeLayerOptions::allocator: the backward's scratch, the Dispatcher's buffers (its NVLink window from NCCL),
// the GEMM argument arrays, and one default set of saved activations. A step allocates nothing and never
// synchronizes the host: T is read from device memory (num_tokens), so a step captured once replays with any T in
// [0, T_max] and any routing. capture() records forward and backward as two CUDA graphs over the views it is given;
// replay_forward()/replay_backward() run them after the caller has written new inputs into those views. Eager and
// replayed steps give the same bits (every sum has a fixed order).
//
// Microbatches in flight (pipeline schedules): what a forward keeps for its backward lives in a MoeSaved over memory
// the caller gives (saved_bytes(): the router's outputs, the dispatch handles, the received rows and probs, FC1's
// output and the activation, y under ProbMode::InCombine, the shared expert's FC1 output and activation). Any
// number of forwards may precede their backwards, in any order, each backward with its forward's MoeSaved; the
// results are the bits of one step at a time. The forms without a MoeSaved use the layer's default one (one
// microbatch at a time). Steps of one layer run one at a time (stream-ordered) and, being collective, in the same
// order on every rank.
//
// Overlap inside a step: the shared expert runs on a second stream beside router -> dispatch -> experts ->
// combine. The expert weight gradients run last in the backward, after the dispatch and router backward: beside
// them on a stream of their own, the persistent GEMM held the SMs those kernels needed (measured: docs/layer.md).
// The blocks of the communication kernels are MoeLayerOptions::dispatch.sms.
// Chunked step (MoeLayerOptions::chunks = C > 1): the tokens split into C chunks of T_max / C, each with a
// Dispatcher of its own; the communication runs on a stream of its own, dispatch of chunk c + 1 and combine of chunk
// c - 1 beside the experts of chunk c (backward: combine backward of c + 1 and dispatch backward of c - 1 beside the
// data gradients of c), and the weight gradients run once over every chunk's rows. The forward and the data
// gradients equal the unchunked step's bit for bit unless a chunk overflows its capacity (each chunk's dispatcher
// holds the capacity policy's rows for T_max / C tokens; check() reports an overflow); the weight gradients sum
// each expert's rows chunk by chunk (deterministic for a given C, last bits may differ between values of C).
//
// Precision (MoeLayerOptions::recipe): Recipe::BF16, or Recipe::Fp8Blockwise, where the routed experts run the FP8
// recipe of moerail/experts_fp8.h (Fp8GroupedMlp): x is quantized to e4m3 with 1x128 scales inside the dispatch
// (what crosses the links is FP8), the expert GEMMs run in FP8 and the combine, the backward communication, the
// router, the gate and the shared expert stay bf16. The FP8 weights are made by refresh_fp8_weights(), once per
// optimizer step: call it after the weights are first set and after every update of them (a forward before the
// first call throws; one after an update without it runs on the old weights). Contract: ref::Layer with
// LayerOptions::recipe = Recipe::Fp8Blockwise (to the GEMMs' fp32 sums and the bf16 rounding of their outputs).
// Recipe::Fp8Tensor (per-tensor current scaling, one scale per expert tensor): the dispatch moves bf16 rows, which
// are then quantized with each expert's own scale (quantize_fp8_experts, moerail/quant.h); the rest as above
// (Fp8WeightGrads::Fp8 only; contract: ref::Layer with Recipe::Fp8Tensor). Recipe::Fp8TensorHybrid: the same with
// the experts' gradients in e5m2 (contract: ref::Layer with Recipe::Fp8TensorHybrid).
//
// Errors: bad routing or a capacity overflow is recorded on the device and raised by check() (eager steps call it
// after each forward by default); a dead peer ends the step with Error(Timeout) naming it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "moerail/comm.h"
#include "moerail/config.h"
#include "moerail/dispatch.h"
#include "moerail/experts.h"
#include "moerail/recipe.h"
#include "moerail/tensor.h"

namespace moerail {

struct MoeLayerOptions {
  DispatchOptions dispatch;   // transport, SMs of the communication kernels, spin-wait bound (its allocator is
                              // replaced by `allocator`)
  MlpOptions mlp;             // expert GEMM tiles (normally automatic); mlp.sms caps the SMs of the forward's and
                              // the data gradients' GEMMs (leaving the rest to the chunked step's communication);
                              // the weight gradients, which run alone at the end of the step, take every SM
  bool check_eager = true;    // forward() (not a replay) reads the status word after the step: one host sync
  int chunks = 1;             // 1..kMaxMlpChunks, dividing cfg.max_tokens: the chunked step (above); 1 = none
  DeviceAllocator* allocator = nullptr;  // where the layer's device memory comes from (null = cudaMalloc), its
                                         // dispatchers' and expert GEMMs' too; must outlive the layer
  bool default_saved = true;  // allocate the default MoeSaved (saved_bytes()) for the forms without one and
                              // capture(); off when every forward is given its own (moerail.torch)
  // The experts' precision (above). The FP8 recipes need H and F multiples of 128, no expert biases, chunks = 1 and
  // mlp.sms = 0; of the other mlp options only rows_hint is read (the tiles of the bf16 weight gradients under
  // Fp8WeightGrads::BF16). The expert weight gradients are then grouped tensors: bf16 written, or f32 accumulated
  // (MlpGrads::accumulate: Megatron-LM's fp32 main_grad).
  Recipe recipe = Recipe::BF16;
  // Where the FP8 recipe's expert weight gradients run (moerail/recipe.h: the recipe's FP8 GEMMs, or bf16 GEMMs over
  // the step's bf16 tensors); not read under Recipe::BF16.
  Fp8WeightGrads fp8_weight_grads = Fp8WeightGrads::Fp8;
};

// This rank's weights, device views in bf16 (expert_bias f32).
struct MoeLayerWeights {
  TensorView router;        // [E, H]
  TensorView expert_bias;   // [E] f32, iff cfg.router.use_expert_bias
  MlpWeights experts;       // the L local experts (grouped [L, ...] or per-expert views)
  TensorView shared_w1;     // [F1s, H] (F1s = 2 Fs for GLU activations), iff cfg.shared_expert_ffn > 0
  TensorView shared_w2;     // [H, Fs]
};

// Gradients of this rank's weights, bf16: written, but for the expert weights' when experts.accumulate asks for
// them to be added to what the tensors hold (MlpGrads::accumulate; micro-batches without an accumulation pass).
// The expert weights' may be fp32 (MlpGrads: Megatron-LM's fp32 main_grad buffers).
struct MoeLayerGrads {
  TensorView d_router;      // [E, H]
  MlpGrads experts;
  TensorView d_shared_w1, d_shared_w2;  // iff cfg.shared_expert_ffn > 0
};

struct MoeForwardArgs {
  TensorView x;             // [T_max, H] bf16, read (rows t < T)
  TensorView num_tokens;    // [1] i32, read: T of this rank
  TensorView out;           // [T_max, H] bf16, written (rows t < T)
  MoeLayerWeights weights;
};

struct MoeBackwardArgs {
  TensorView d_out;         // [T_max, H] bf16, read (rows t < T)
  TensorView dx;            // [T_max, H] bf16, written (rows t < T)
  float d_aux_loss = 1.0f;  // upstream gradients of the router losses
  float d_z_loss = 1.0f;
  TensorView d_losses;      // [2] f32 device {d_aux, d_z}, read; optional: overrides the two above (a graph
                            // then replays with new values, and autograd frameworks need no host read)
  MoeLayerGrads grads;
};

class MoeLayer;

// What one forward keeps for its backward: device views over memory the caller owns (MoeLayer::saved_bytes()),
// which must stay allocated, and not be written, until that backward has run; copies of a MoeSaved share its
// state. Made by MoeLayer::make_saved(), filled by forward(), read by backward() of the same layer.
class MoeSaved {
 public:
  MoeSaved() = default;
  bool defined() const { return state_ != nullptr; }
  const TensorView& memory() const { return memory_; }
  struct State;  // in src/layer/layer_impl.h

 private:
  friend class MoeLayer;
  const MoeLayer* owner_ = nullptr;
  TensorView memory_;
  std::shared_ptr<State> state_;  // host-side views into memory_, and the forward's arguments
};

class MoeLayer {
 public:
  // Collective over comm (every rank with the same cfg and options); cfg.ep_size must equal comm.size(), which
  // may be 1. Allocates everything; synchronizes the device (setup only, never inside capture).
  MoeLayer(const MoeConfig& cfg, Communicator& comm, const MoeLayerOptions& options = {});
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  const MoeConfig& config() const;
  std::int64_t capacity() const;        // rows of the receive buffer of this rank (every chunk's region)
  std::int64_t peer_rows() const;       // tokens of a chunk a rank sends each peer on the host-API transport
                                        // (Dispatcher::peer_rows())
  std::size_t workspace_bytes() const;  // device bytes the layer holds on this rank (dispatchers, GEMM arrays and
                                        // the default MoeSaved included)
  std::size_t window_bytes() const;     // of which NCCL windows (the NVLink transport; not from the allocator)

  // Saved state of a forward: saved_bytes() device bytes; make_saved() lays one out over `memory` (device, on the
  // layer's GPU, >= saved_bytes() bytes of any dtype, 256-byte aligned; no work on the device).
  std::size_t saved_bytes() const;
  MoeSaved make_saved(const TensorView& memory) const;

  // One step over a MoeSaved: forward() fills `saved` (and remembers the views of `args`: x, num_tokens and the
  // weights must stay unchanged until the backward); backward() reads the one a forward filled.
  void forward(const MoeForwardArgs& args, MoeSaved& saved, cudaStream_t stream);
  void backward(const MoeBackwardArgs& args, const MoeSaved& saved, cudaStream_t stream);
  // The same over the default MoeSaved: backward() uses what the last forward() saved.
  void forward(const MoeForwardArgs& args, cudaStream_t stream);
  void backward(const MoeBackwardArgs& args, cudaStream_t stream);

  // Records forward and backward over exactly these views (and the weights they name) as two CUDA graphs,
  // replacing earlier ones. Collective; outside any other capture; `stream` must not be the legacy stream. Runs
  // one eager step first (the host-API transport connects its peers on first use) and checks it.
  void capture(const MoeForwardArgs& forward, const MoeBackwardArgs& backward, cudaStream_t stream);
  bool captured() const;
  void replay_forward(cudaStream_t stream);
  void replay_backward(cudaStream_t stream);

  // The router outputs of the last forward (in its MoeSaved's memory), device views: topk_idx [T_max, K] i32,
  // topk_probs [T_max, K] f32, losses [2] f32 {aux, z}, logits [T_max, E] bf16.
  TensorView topk_idx() const;
  TensorView topk_probs() const;
  TensorView losses() const;
  TensorView logits() const;
  // Rows per local expert of the last forward ([L] i32 device), what the expert GEMMs ran over (summed over the
  // chunks of a chunked step).
  TensorView expert_rows() const;

  // An FP8 recipe: quantizes the local experts' bf16 weights (grouped [L, ...] views) into the layer's FP8 weights
  // (128x128 blocks, or one scale per expert matrix under fp8-tensor; with the transposed copies the data gradients
  // read), which every later step uses.
  // Stream-ordered, no allocation, no host sync, capturable (captured, it quantizes when the graph runs). Throws
  // under Recipe::BF16.
  void refresh_fp8_weights(const MlpWeights& experts, cudaStream_t stream);

  // One host read of the status word of every stage; throws Error naming this rank and what went wrong.
  void check(cudaStream_t stream);

  // Time of each stage of the last forward/backward in milliseconds (CUDA events between the stages; synchronizes
  // the stream when read). The shared expert runs beside the others and is reported apart. Eager calls are timed
  // while enable_stage_timing(true) holds; replays when it held at capture() (the graphs then record the events).
  // Chunked step: dispatch is chunk 0's (backward: combine is chunk 0's combine backward), experts the span to the
  // last chunk's expert GEMMs with the other chunks' communication beside them, combine the last chunk's after them
  // (backward: dispatch is the last chunk's dispatch backward): what the communication leaves exposed.
  struct StageTimes {
    double router = 0, dispatch = 0, experts = 0, combine = 0, shared = 0, total = 0;
    double wgrad = 0;  // backward: the expert weight gradients (experts: the data gradients)
  };
  void enable_stage_timing(bool on);
  StageTimes forward_times(cudaStream_t stream);
  StageTimes backward_times(cudaStream_t stream);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace moerail
