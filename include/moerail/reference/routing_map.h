// moerail/reference/routing_map.h — CPU reference of the converter from Megatron/TransformerEngine routing
// (routing_map [T, E] bool + probs [T, E]) to moerail's (topk_idx [T, K] i32, topk_probs [T, K]).
//
// Token t's routed experts (map[t, e] != 0) are listed in ascending expert order, each with probs[t, e]; the
// remaining slots get id -1 and prob 0. A token with more than K routed experts is an error (nothing is written).
// With R = 1 the layout of the result is TransformerEngine's mask-map permute order.
#pragma once

#include "moerail/tensor.h"

namespace moerail::ref {

struct RoutingMapArgs {
  TensorView routing_map;  // [T, E] bool (or i32), read
  TensorView probs;        // [T, E] f64/f32/bf16/f16, read; only routed entries are read
  TensorView topk_idx;     // [T, K] i32, written
  TensorView topk_probs;   // [T, K] f64/f32, written
};

void routing_map_to_topk(const RoutingMapArgs& args);

}  // namespace moerail::ref
