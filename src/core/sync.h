// src/core/sync.h — waiting for a device in a destructor.
#pragma once

namespace moerail::cuda {

// Waits for all work on `device` and restores the current device; errors are ignored (for destructors that give
// memory back to an allocator, which may hand it out at once). Defined in cuda_check.cu.
void synchronize_device(int device) noexcept;

}  // namespace moerail::cuda
