// moerail/memory.h — where moerail's device memory comes from.
//
// Every object that holds device memory (Dispatcher, GroupedMlp, MoeLayer) takes it at construction from the
// DeviceAllocator named in its options, and per microbatch from memory the caller gives (DispatchHandle, MoeSaved):
// a framework passes its own allocator (moerail.torch passes PyTorch's caching allocator), so that its memory
// statistics see moerail's buffers and freed memory goes back to its pool. The default is cudaMalloc / cudaFree.
//
// Not from the allocator: NCCL symmetric windows (the NVLink transport's staging area: ncclMemAlloc, registered with
// the communicator), which each object reports apart (window_bytes()).
//
// An allocator is called on the host, outside any step and outside graph capture, with the object's device
// current; it must outlive every object it gave memory to.
#pragma once

#include <cstddef>
#include <utility>

namespace moerail {

class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  // `bytes` (> 0) of device memory on the current device, 256-byte aligned; throws on failure.
  virtual void* allocate(std::size_t bytes) = 0;
  // Gives back what allocate() returned (same size). Must not throw.
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
};

// cudaMalloc / cudaFree (the default of every options struct).
DeviceAllocator& cuda_allocator();

// One allocation of an allocator, given back when the buffer is destroyed; move-only. The memory is not
// initialized.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceAllocator& allocator, std::size_t bytes);
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(allocator_, o.allocator_);
      std::swap(data_, o.data_);
      std::swap(bytes_, o.bytes_);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  void reset() noexcept;

 private:
  DeviceAllocator* allocator_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace moerail
