// CUDA-graph test of the grouped expert MLP: forward + backward (with weight gradients) captured once, replayed
// with different per-expert counts written to the same device buffer (balanced, skewed, zeros, all rows on one
// expert, no rows), each replay compared with the CPU reference. Also: a captured delayed wgrad.
#include <gtest/gtest.h>

#include "experts/mlp_harness.h"

namespace moerail::testing::mlp {
namespace {

class Graph {
 public:
  ~Graph() {
    if (exec_) (void)cudaGraphExecDestroy(exec_);
    if (graph_) (void)cudaGraphDestroy(graph_);
  }
  template <typename F>
  void capture(cudaStream_t stream, F&& body) {
    MOERAIL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    try {
      body();
    } catch (...) {
      cudaGraph_t g = nullptr;
      (void)cudaStreamEndCapture(stream, &g);
      if (g) (void)cudaGraphDestroy(g);
      throw;
    }
    MOERAIL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    MOERAIL_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  void replay(cudaStream_t stream) const { MOERAIL_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

struct Replay {
  bool delayed_wgrad = false;  // backward_dw() captured after backward()
  // GLU halves interleaved in blocks of 32, so FC1's epilogue computes the activation (glu_epilogue.cuh)
  bool fused = false;
  // MlpOptions::contiguous_gemms, with counts of whole 128-row tiles and counts that are not (short tiles)
  bool contiguous = false;
  // MlpOptions::activation_backward = Fused (FC2's contiguous dgrad computes the activation backward; no FC2 bias,
  // whose d_probs term it does not compute)
  bool act_bwd = false;
  MlpGemmTile fc1 = MlpGemmTile::Auto;
};

void replay_with_counts(const Replay& r) {
  const auto [delayed_wgrad, fused, contiguous, act_bwd, fc1] = r;
  MoeConfig cfg = small_config(Activation::SwiGLU, 6);
  cfg.fc1_bias = true;
  cfg.fc2_bias = !act_bwd;
  if (fused) {
    cfg.glu_layout = GluLayout::Interleaved;
    cfg.glu_block = 32;
  }
  const std::int64_t kRows = contiguous ? 896 : 320;
  const HostInputs in = make_inputs(cfg, kRows, 99);
  const std::vector<std::vector<std::int64_t>> steps =
      contiguous ? std::vector<std::vector<std::int64_t>>{
                       {128, 128, 256, 128, 0, 256},  // whole tiles, one empty expert, buffer exactly full
                       {0, 0, 0, 768, 0, 0},          // all rows on one expert
                       {128, 100, 128, 0, 0, 0},      // a short tile, then a segment off the 128-row grid
                       {0, 0, 0, 0, 0, 0},            // no rows
                       {256, 128, 128, 128, 128, 100},  // the last tile short
                       {48, 48, 48, 48, 48, 48},      // every tile short
                   }
                 : std::vector<std::vector<std::int64_t>>{
                       {48, 48, 48, 48, 48, 48},  // balanced
                       {160, 64, 32, 16, 0, 16},  // skewed, one empty expert
                       {0, 0, 0, 300, 0, 0},      // all rows on one expert
                       {0, 0, 0, 0, 0, 0},        // no rows
                       {8, 0, 120, 0, 0, 192},    // several empty, buffer exactly full
                   };

  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    MlpOptions mo;
    mo.rows_hint = kRows;
    if (fused) mo.activation = MlpActivation::Fused;
    if (act_bwd) mo.activation_backward = MlpActivation::Fused;
    mo.contiguous_gemms = contiguous ? MlpContiguous::On : MlpContiguous::Off;
    experts::MlpTuning tiles;
    tiles.fc1 = fc1;
    mo.tuning = &tiles;
    GroupedMlp mlp(cfg, mo);  // setup (allocation, CUTLASS init) before capture
    ASSERT_EQ(mlp.activation_fused(), fused);
    GpuRun run(cfg, in, steps[0], /*i64=*/true, /*per_expert=*/false, stream);
    Graph graph;
    graph.capture(stream, [&] {
      mlp.forward(run.forward_args(), stream);
      mlp.backward(run.backward_args(!delayed_wgrad), stream);
      if (delayed_wgrad) mlp.backward_dw(run.backward_dw_args(), stream);
    });
    for (const auto& counts : steps) {
      SCOPED_TRACE(::testing::PrintToString(counts));
      run.set_counts(counts);  // the only thing that changes between replays
      run.poison_outputs();
      graph.replay(stream);
      const GpuOutputs out = run.results(stream);
      compare(cfg, out, run_reference(cfg, in, counts), counts);
    }
  }
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(ExpertsMlpGraph, ReplayWithDifferentCounts) {
  MOERAIL_REQUIRE_GPU();
  replay_with_counts({});
}

TEST(ExpertsMlpGraph, ReplayDelayedWgrad) {
  MOERAIL_REQUIRE_GPU();
  replay_with_counts({.delayed_wgrad = true});
}

TEST(ExpertsMlpGraph, ReplayWithTheFusedActivationEpilogue) {
  MOERAIL_REQUIRE_GPU();
  replay_with_counts({.fused = true});
}

TEST(ExpertsMlpGraph, ReplayWithTheFusedActivationOnTheCooperativeTile) {
  MOERAIL_REQUIRE_GPU();
  replay_with_counts({.fused = true, .fc1 = MlpGemmTile::Cooperative128x256});
}

TEST(ExpertsMlpGraph, ReplayWithContiguousGemms) {
  MOERAIL_REQUIRE_GPU();
  replay_with_counts({.contiguous = true});
}

TEST(ExpertsMlpGraph, ReplayWithContiguousGemmsAndTheFusedActivation) {
  MOERAIL_REQUIRE_GPU();
  replay_with_counts({.fused = true, .contiguous = true});
}

TEST(ExpertsMlpGraph, ReplayWithTheActivationBackwardInFc2sDgrad) {
  MOERAIL_REQUIRE_GPU();
  replay_with_counts({.contiguous = true, .act_bwd = true});
}

}  // namespace
}  // namespace moerail::testing::mlp
