// src/router/router_internal.h — the router's forward kernels by name, for tests (not part of the public API).
//
// router_forward (moerail/router.h) lets forward_plan() in router.cu choose; router_forward_using runs the one
// named, so that a test can give one input to both and compare the results bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include "moerail/router.h"

namespace moerail::router_detail {

enum class ForwardKernel : int {
  Auto,     // forward_plan()'s choice: what router_forward runs
  Generic,  // router_forward_kernel: every configuration
  Packed,   // router_forward_packed_kernel: top-k only, sigmoid-type, E = 256, K <= 8 (router_packed.cuh)
};

// router_forward with the kernel `choice`; fails (ErrorCode::Unsupported) when that kernel cannot run cfg.
void router_forward_using(ForwardKernel choice, const MoeConfig& cfg, const RouterForwardArgs& args,
                          cudaStream_t stream);

}  // namespace moerail::router_detail
