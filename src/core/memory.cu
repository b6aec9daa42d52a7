// The default device allocator and DeviceBuffer (include/moerail/memory.h).
#include "moerail/memory.h"

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"

namespace moerail {
namespace {

class CudaAllocator final : public DeviceAllocator {
 public:
  void* allocate(std::size_t bytes) override {
    void* p = nullptr;
    MOERAIL_CUDA_CHECK(cudaMalloc(&p, bytes));
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept override { (void)cudaFree(p); }
};

}  // namespace

DeviceAllocator& cuda_allocator() {
  static CudaAllocator a;
  return a;
}

DeviceBuffer::DeviceBuffer(DeviceAllocator& allocator, std::size_t bytes) {
  if (bytes == 0) return;
  data_ = allocator.allocate(bytes);
  allocator_ = &allocator;
  bytes_ = bytes;
}

void DeviceBuffer::reset() noexcept {
  if (allocator_ && data_) allocator_->deallocate(data_, bytes_);
  allocator_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace moerail
