// src/layer/zero.h — zeros written by a kernel, for the few floats a layer step clears inside a captured graph (a
// kernel node rather than a memset node: docs/layer.md says why).
#pragma once

#include <cuda_runtime_api.h>

namespace moerail::layer {

// p[0, n) = 0.0f, n <= 1024.
void launch_zero_f32(float* p, int n, cudaStream_t stream);

}  // namespace moerail::layer
