// moerail/status.h — the device status word: what kernels found wrong, read by the host only when the caller asks.
//
// Kernels never stop or synchronize on bad input. They skip the offending slot (never writing out of bounds),
// count it in a DeviceStatus in device memory, and go on. The caller reads the word once, at a point it chooses
// (check_status), and gets an Error that names what happened and how many rows:
//   CapacityOverflow  "dispatch: 1152 routed rows did not fit: 9344 rows needed, 8192 available (capacity factor(1))"
//                     "dispatch: 96 routed rows did not fit: the fullest expert needed 1408 rows, 1280 per expert
//                      available (capacity per-expert(1.25))"
//   BadRouting        "layout: 3 routed slots had an expert id outside [-1, 256), first topk_idx[17,3] = 300"
// Counts accumulate over steps until reset_status(); "rows needed" is the largest need seen since the reset.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "moerail/config.h"

namespace moerail {

// Lives in device memory (128 bytes, 8-byte aligned); zero-initialized it is NOT valid: use reset_status() once
// after allocating it, and again whenever the caller wants fresh counts.
struct DeviceStatus {
  std::uint32_t overflow_rows;   // routed rows dropped because the receive buffer was full (capacity)
  std::uint32_t rows_needed;     // most rows one plan needed (padded), since the last reset; under
                                 // Capacity::PerExpert the most rows one expert needed
  std::uint32_t rows_available;  // rows of the receive buffer of that plan (its capacity), or of one expert's
                                 // segment under Capacity::PerExpert
  std::uint32_t bad_expert_ids;  // (t,k) slots whose expert id was outside [-1, E); treated as unrouted
  std::uint32_t bad_probs;       // routed slots whose prob was NaN or Inf; treated as unrouted
  std::uint32_t bad_logits;      // router tokens with a NaN/Inf logit (treated as -inf)
  std::uint32_t num_experts;     // E and K of the last op that wrote the word, to decode the slots below
  std::uint32_t topk;
  std::uint64_t first_bad_expert;  // (t*K + k) << 32 | id bits of the lowest bad slot; ~0 = none
  std::uint64_t first_bad_prob;    // (t*K + k) << 32 | float bits of the prob;           ~0 = none
  std::uint64_t first_bad_logit;   // (t*E + e) << 32 | float bits of the logit;          ~0 = none
  std::uint32_t wait_timeouts;     // bounded spin-waits on a peer rank that gave up (the peer is dead or stuck)
  std::int32_t timeout_peer;       // the lowest rank waited for in vain; -1 = none
  std::uint32_t peer_dropped;      // host-API transport: slots of this rank's tokens not sent, because more than
                                   // peer_rows of its tokens went to one peer (MoeConfig::peer_rows())
  std::uint32_t peer_rows;         // that bound
  std::uint32_t reserved[14];
};
static_assert(sizeof(DeviceStatus) == 128, "DeviceStatus is a 128-byte device word");

// A host copy of the word with the messages built from it.
struct StatusReport {
  DeviceStatus raw{};
  bool ok() const {
    return raw.overflow_rows == 0 && raw.bad_expert_ids == 0 && raw.bad_probs == 0 && raw.bad_logits == 0 &&
           raw.wait_timeouts == 0 && raw.peer_dropped == 0;
  }
  // One sentence per problem found, "" when ok(). capacity (optional) names the policy in the overflow sentence.
  std::string describe(std::string_view op, const Capacity* capacity = nullptr) const;
  // Throws the Error check_status() describes below when !ok(); returns otherwise.
  void raise_if_bad(std::string_view op, const Capacity* capacity = nullptr) const;
};

// Sets every count to zero and every "first offender" to none. Asynchronous on `stream`, graph-capturable
// (one tiny kernel), allocates nothing.
void reset_status(DeviceStatus* status, cudaStream_t stream);

// One device->host read of the word: enqueues the copy on `stream` and waits for the stream (a host
// synchronization by design: call it where the caller chooses, never inside a captured graph).
StatusReport read_status(const DeviceStatus* status, cudaStream_t stream);

// read_status(), then throws Error(Timeout) if a kernel gave up waiting for a peer rank, else Error(BadRouting) if any bad id / prob / logit was seen (the message also mentions an
// overflow if there was one), else Error(CapacityOverflow) if rows were dropped; returns when all is well.
// `op` starts the message; `capacity` (optional) is the policy the buffers were sized with.
void check_status(const DeviceStatus* status, cudaStream_t stream, std::string_view op = "moe",
                  const Capacity* capacity = nullptr);

}  // namespace moerail
