#pragma once
// Device memory: owned allocations (device_memory) and stream-ordered scratch (stream_buffer).

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "attnmix/core/memory_space.hpp"
#include "attnmix/cuda/runtime/device.cuh"
#include "attnmix/cuda/runtime/error.cuh"

namespace attnmix {

// The current device's total memory.
template <>
struct space_bytes<device_space> {
  static std::size_t get() {
    std::size_t free_bytes = 0, total = 0;
    detail::cuda::check(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
    return total;
  }
};

namespace detail {
namespace cuda {

// What a training step promises and a test counts: attnmix's cudaMalloc calls (device_memory)
// and its reads of device values that wait for a stream (download), since the program started.
struct runtime_counts {
  std::atomic<std::uint64_t> allocations{0}, waits{0};
};
inline runtime_counts& counts() {
  static runtime_counts c;
  return c;
}

// Device memory from cudaMalloc, freed when the owner goes; movable, not copyable.
class device_memory {
 public:
  device_memory() = default;
  // Throws cuda_error (naming `what`) when the allocation fails.
  device_memory(std::size_t bytes, const char* what) {
    void* p = nullptr;
    if (bytes > 0) {
      ++counts().allocations;
      check(cudaMalloc(&p, bytes), what);
    }
    ptr_.reset(p);
  }
  void* get() const { return ptr_.get(); }

 private:
  struct free_device {
    void operator()(void* p) const { (void)cudaFree(p); }
  };
  std::unique_ptr<void, free_device> ptr_;
};

// Stream-ordered scratch from attnmix's pool, released on the same stream when it goes out of
// scope.
class stream_buffer {
 public:
  stream_buffer(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0)
      check(cudaMallocFromPoolAsync(&ptr_, bytes, current_device().scratch_pool, stream),
            "cudaMallocFromPoolAsync");
  }
  ~stream_buffer() {
    if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
  }
  stream_buffer(const stream_buffer&) = delete;
  stream_buffer& operator=(const stream_buffer&) = delete;
  unsigned char* get() const { return static_cast<unsigned char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
