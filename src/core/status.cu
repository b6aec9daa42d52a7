// The device status word: reset kernel, host read and the messages (include/moerail/status.h).
#include "moerail/status.h"

#include <cstring>
#include <vector>

#include "core/cuda_check.h"
#include "moerail/error.h"

namespace moerail {
namespace {

__global__ void reset_status_kernel(DeviceStatus* s) {
  s->overflow_rows = 0;
  s->rows_needed = 0;
  s->rows_available = 0;
  s->bad_expert_ids = 0;
  s->bad_probs = 0;
  s->bad_logits = 0;
  s->num_experts = 0;
  s->topk = 0;
  s->first_bad_expert = ~0ull;
  s->first_bad_prob = ~0ull;
  s->first_bad_logit = ~0ull;
  s->wait_timeouts = 0;
  s->timeout_peer = -1;
  s->peer_dropped = 0;
  s->peer_rows = 0;
  for (std::uint32_t& r : s->reserved) r = 0;
}

float bits_to_float(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

}  // namespace

void reset_status(DeviceStatus* status, cudaStream_t stream) {
  if (status == nullptr) fail("reset_status", "status is null (expected a DeviceStatus in device memory)");
  reset_status_kernel<<<1, 1, 0, stream>>>(status);
  MOERAIL_CUDA_CHECK_LAUNCH();
}

StatusReport read_status(const DeviceStatus* status, cudaStream_t stream) {
  if (status == nullptr) fail("read_status", "status is null (expected a DeviceStatus in device memory)");
  StatusReport r;
  MOERAIL_CUDA_CHECK(cudaMemcpyAsync(&r.raw, status, sizeof(DeviceStatus), cudaMemcpyDeviceToHost, stream));
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  return r;
}

std::string StatusReport::describe(std::string_view op, const Capacity* capacity) const {
  const DeviceStatus& s = raw;
  std::vector<std::string> parts;
  const std::uint32_t K = s.topk ? s.topk : 1, E = s.num_experts;
  if (s.bad_expert_ids) {
    std::string p = detail::concat(s.bad_expert_ids, " routed slot", s.bad_expert_ids == 1 ? "" : "s",
                                   " had an expert id outside [-1, ", E, ")");
    if (s.first_bad_expert != ~0ull) {
      const std::uint32_t slot = std::uint32_t(s.first_bad_expert >> 32);
      p += detail::concat(", first topk_idx[", slot / K, ",", slot % K, "] = ",
                          std::int32_t(std::uint32_t(s.first_bad_expert)));
    }
    parts.push_back(p + " (skipped)");
  }
  if (s.bad_probs) {
    std::string p = detail::concat(s.bad_probs, " routed slot", s.bad_probs == 1 ? "" : "s", " had a NaN/Inf prob");
    if (s.first_bad_prob != ~0ull) {
      const std::uint32_t slot = std::uint32_t(s.first_bad_prob >> 32);
      p += detail::concat(", first topk_probs[", slot / K, ",", slot % K,
                          "] = ", bits_to_float(std::uint32_t(s.first_bad_prob)));
    }
    parts.push_back(p + " (skipped)");
  }
  if (s.bad_logits) {
    std::string p = detail::concat(s.bad_logits, " router logit", s.bad_logits == 1 ? "" : "s", " were NaN/Inf");
    if (s.first_bad_logit != ~0ull && E > 0) {
      const std::uint32_t i = std::uint32_t(s.first_bad_logit >> 32);
      p += detail::concat(", first logits[", i / E, ",", i % E, "] = ", bits_to_float(std::uint32_t(s.first_bad_logit)));
    }
    parts.push_back(p + " (treated as -inf)");
  }
  if (s.overflow_rows) {
    const bool per_expert = capacity && capacity->kind == Capacity::Kind::PerExpert;
    std::string p = detail::concat(s.overflow_rows, " routed row", s.overflow_rows == 1 ? "" : "s", " did not fit: ");
    p += per_expert ? detail::concat("the fullest expert needed ", s.rows_needed, " rows, ", s.rows_available,
                                     " per expert available")
                    : detail::concat(s.rows_needed, " rows needed, ", s.rows_available, " available");
    if (capacity) p += detail::concat(" (capacity ", capacity->str(), ")");
    parts.push_back(p + " and were dropped");
  }
  if (s.peer_dropped) {
    std::string p = detail::concat(s.peer_dropped, " routed slot", s.peer_dropped == 1 ? "" : "s",
                                   " of this rank's tokens were not sent: more than ", s.peer_rows,
                                   " of its tokens went to one peer (the host-API transport stages that many per peer");
    if (capacity) p += detail::concat(" under capacity ", capacity->str());
    parts.push_back(p + ") and were dropped");
  }
  if (s.wait_timeouts) {
    parts.push_back(detail::concat(s.wait_timeouts, " wait", s.wait_timeouts == 1 ? "" : "s", " for rank ",
                                   s.timeout_peer, " timed out (the peer died, hung or ran a different op); the data "
                                   "of this step is incomplete"));
  }
  std::string msg;
  for (std::size_t i = 0; i < parts.size(); ++i) msg += (i ? "; " : "") + parts[i];
  return msg.empty() ? msg : detail::concat(op, ": ", msg);
}

void StatusReport::raise_if_bad(std::string_view op, const Capacity* capacity) const {
  if (ok()) return;
  const bool bad = raw.bad_expert_ids || raw.bad_probs || raw.bad_logits;
  const ErrorCode code = raw.wait_timeouts ? ErrorCode::Timeout
                         : bad             ? ErrorCode::BadRouting
                                           : ErrorCode::CapacityOverflow;
  throw Error(code, describe(op, capacity));
}

void check_status(const DeviceStatus* status, cudaStream_t stream, std::string_view op, const Capacity* capacity) {
  read_status(status, stream).raise_if_bad(op, capacity);
}

}  // namespace moerail
