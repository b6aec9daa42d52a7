// src/experts/mlp_tuning.h — knobs of GroupedMlp for benchmarks and tests, outside its contract
// (include/moerail/experts.h): the kernel tile of each GEMM instead of the rules of tiles.h, and a forward that runs
// some of its stages (to time one of them).
#pragma once

#include <cuda_runtime_api.h>

#include "moerail/experts.h"

namespace moerail::experts {

// The kernel of one expert GEMM: the rules of tiles.h (Auto), or a tile forced.
enum class MlpGemmTile { Auto, Cooperative128x256, Pingpong128x128 };

// Per-GEMM tiles (MlpOptions::tuning, read by GroupedMlp's constructor): forward FC1 / FC2, dgrad of FC2 / FC1,
// wgrad of FC2 / FC1. A fused FC1 (the activation in its epilogue) takes fc1's tile.
struct MlpTuning {
  MlpGemmTile fc1 = MlpGemmTile::Auto, fc2 = MlpGemmTile::Auto;
  MlpGemmTile dgrad_fc2 = MlpGemmTile::Auto, dgrad_fc1 = MlpGemmTile::Auto;
  MlpGemmTile wgrad_fc2 = MlpGemmTile::Auto, wgrad_fc1 = MlpGemmTile::Auto;
};

// Stages of the forward. A benchmark times one of them; the stages before it must have run on the same data.
enum MlpStage : unsigned {
  kMlpStageSetup = 1u,       // device setup kernel: counts -> offsets, per-group shapes and pointers
  kMlpStageFc1 = 2u,         // h1 = x W1^T
  kMlpStageActivation = 4u,  // (h1 += b1), act = act(h1) [* p]  (inside kMlpStageFc1 when activation_fused())
  kMlpStageFc2 = 8u,         // y = act W2^T (+ p b2)
  kMlpStageAll = 15u,
};

struct MlpAccess {
  static void forward_stages(GroupedMlp& mlp, const MlpForwardArgs& args, unsigned stages, cudaStream_t stream) {
    mlp.forward_stages(args, stages, stream);
  }
};

// GroupedMlp::forward of the given stages only (a non-empty subset of kMlpStageAll), to time one of them.
inline void forward_stages(GroupedMlp& mlp, const MlpForwardArgs& args, unsigned stages, cudaStream_t stream) {
  MlpAccess::forward_stages(mlp, args, stages, stream);
}

}  // namespace moerail::experts
