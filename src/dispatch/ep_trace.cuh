// src/dispatch/ep_trace.cuh — the developer trace of the EP kernels (MOERAIL_EP_TRACE, docs/dispatch.md), compiled
// in only when the build defines MOERAIL_EP_TRACE_BUILD (CMake option MOERAIL_EP_TRACE). Each warp of a data kernel
// then records %globaltimer stamps and counters in its kTraceSlots slots of trace[(block * kWarps + warp) *
// kTraceSlots], and the plan kernel four stamps in the 8 words after all warps' slots (0 start, 1 counts exchanged,
// 2 end, 3 totals); nothing is recorded when the trace pointer is null (the environment variable unset). In a build
// without it every call below is a no-op the compiler removes, and the kernels read as if there were no trace.
#pragma once

#include "dispatch/ep_common.cuh"

namespace moerail::ep {

#ifdef MOERAIL_EP_TRACE_BUILD
inline constexpr bool kTraceBuilt = true;
#else
inline constexpr bool kTraceBuilt = false;
#endif

constexpr int kTraceSlots = 10;
enum TraceSlot : int {
  kTraceEntry,      // kernel entry
  kTraceEntered,    // after the block handshake
  kTraceFirst,      // first work item started (after its flag wait, for consumers)
  kTraceRoleEnd,    // producer/consumer loop left
  kTraceEnd,        // kernel end (after the pad rows)
  kTraceItems,      // work items (chunks) handled
  kTraceWaitNs,     // time in flag waits
  kTraceFenceNs,    // time in system-scope fences before flags
  kTraceMetaNs,     // scatter: time in the per-token prologue (slot rows, probs, masks)
  kTraceDataNs,     // scatter: time moving the token rows
};

// One warp's trace. now() is a stamp (0 when off); add(acc, since) adds the time since `since` to a counter and
// returns the new stamp; item(now) counts a work item (the first one's stamp kept).
struct WarpTrace {
  unsigned long long* slots = nullptr;  // this warp's, or null
  unsigned long long first = 0, wait = 0, fence = 0, items = 0, meta = 0, data = 0;
  __device__ WarpTrace(unsigned long long* trace, unsigned long long entry) {
    if (!kTraceBuilt || trace == nullptr) return;
    slots = trace + (std::size_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * kTraceSlots;
    put(kTraceEntry, entry);
  }
  __device__ bool on() const { return kTraceBuilt && slots != nullptr; }
  __device__ unsigned long long now() const { return on() ? global_ns() : 0; }
  __device__ unsigned long long add(unsigned long long& acc, unsigned long long since) const {
    if (!on()) return 0;
    const unsigned long long t = global_ns();
    acc += t - since;
    return t;
  }
  __device__ void put(int slot, unsigned long long v) const {
    if (on() && threadIdx.x % 32 == 0) slots[slot] = v;
  }
  __device__ void stamp(int slot) const { put(slot, now()); }
  __device__ void item(unsigned long long t) {
    if (on() && items++ == 0) first = t;
  }
  __device__ void item() { item(now()); }
  __device__ void finish(unsigned long long role_end) const {
    if (!on()) return;
    put(kTraceFirst, first);
    put(kTraceRoleEnd, role_end);
    put(kTraceEnd, global_ns());
    put(kTraceItems, items);
    put(kTraceWaitNs, wait);
    put(kTraceFenceNs, fence);
    put(kTraceMetaNs, meta);
    put(kTraceDataNs, data);
  }
};

// The plan kernel's stamps (thread 0 writes them): null when off.
__device__ __forceinline__ unsigned long long* plan_stamps(unsigned long long* trace, int blocks) {
  return kTraceBuilt && trace ? trace + std::size_t(blocks) * kWarps * kTraceSlots : nullptr;
}

}  // namespace moerail::ep
