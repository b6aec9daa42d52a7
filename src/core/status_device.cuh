// src/core/status_device.cuh — how kernels record problems in the DeviceStatus word (include/moerail/status.h).
// Only the slow path (something is wrong) touches the word, with integer atomics: the counts are exact and the
// "first offender" is the lowest slot index (atomicMin), so the word is deterministic whatever the timing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moerail/status.h"

namespace moerail::cuda {

__device__ __forceinline__ unsigned long long offender_key(std::uint32_t slot, std::uint32_t bits) {
  return (static_cast<unsigned long long>(slot) << 32) | bits;
}

__device__ __forceinline__ void record_bad_expert(DeviceStatus* s, std::uint32_t slot, std::int32_t id) {
  if (s == nullptr) return;
  atomicAdd(&s->bad_expert_ids, 1u);
  atomicMin(reinterpret_cast<unsigned long long*>(&s->first_bad_expert), offender_key(slot, std::uint32_t(id)));
}

__device__ __forceinline__ void record_bad_prob(DeviceStatus* s, std::uint32_t slot, float p) {
  if (s == nullptr) return;
  atomicAdd(&s->bad_probs, 1u);
  atomicMin(reinterpret_cast<unsigned long long*>(&s->first_bad_prob), offender_key(slot, __float_as_uint(p)));
}

__device__ __forceinline__ void record_bad_logit(DeviceStatus* s, std::uint32_t index, float x) {
  if (s == nullptr) return;
  atomicAdd(&s->bad_logits, 1u);
  atomicMin(reinterpret_cast<unsigned long long*>(&s->first_bad_logit), offender_key(index, __float_as_uint(x)));
}

// A bounded spin-wait on `peer` gave up.
__device__ __forceinline__ void record_timeout(DeviceStatus* s, int peer) {
  if (s == nullptr) return;
  atomicAdd(&s->wait_timeouts, 1u);
  atomicMin(reinterpret_cast<unsigned int*>(&s->timeout_peer), static_cast<unsigned int>(peer));
}

}  // namespace moerail::cuda
