#include "moerail/reference/routing_map.h"

#include "moerail/reference/host.h"

namespace moerail::ref {

void routing_map_to_topk(const RoutingMapArgs& a) {
  constexpr const char* op = "routing_map_to_topk";
  check_shape(op, "routing_map", a.routing_map, {-1, -1});
  const std::int64_t T = a.routing_map.size(0), E = a.routing_map.size(1);
  check_dtype(op, "routing_map", a.routing_map, {DType::Bool, DType::I32});
  check_shape(op, "probs", a.probs, {T, E});
  check_dtype(op, "probs", a.probs, {DType::F64, DType::F32, DType::BF16, DType::F16});
  check_shape(op, "topk_idx", a.topk_idx, {T, -1});
  const std::int64_t K = a.topk_idx.size(1);
  check_dtype(op, "topk_idx", a.topk_idx, {DType::I32});
  check_shape(op, "topk_probs", a.topk_probs, {T, K});
  check_dtype(op, "topk_probs", a.topk_probs, {DType::F64, DType::F32});
  for (const TensorView* v : {&a.routing_map, &a.probs, &a.topk_idx, &a.topk_probs})
    check_device(op, "argument", *v, Device::host());
  if (K < 1) fail(op, "topk_idx has K = ", K, " slots but at least 1 was expected");
  for (std::int64_t t = 0; t < T; ++t) {
    std::int64_t routed = 0;
    for (std::int64_t e = 0; e < E; ++e) routed += load_int(a.routing_map, t * E + e) != 0;
    if (routed > K)
      fail(op, "token ", t, " routes to ", routed, " experts but topk_idx has K = ", K, " slots");
  }
  for (std::int64_t t = 0; t < T; ++t) {
    std::int64_t k = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      if (load_int(a.routing_map, t * E + e) == 0) continue;
      store_int(a.topk_idx, t * K + k, e);
      store_float(a.topk_probs, t * K + k, load_float(a.probs, t * E + e));
      ++k;
    }
    for (; k < K; ++k) {
      store_int(a.topk_idx, t * K + k, -1);
      store_float(a.topk_probs, t * K + k, 0.0);
    }
  }
}

}  // namespace moerail::ref
