#pragma once
// CUDA runtime failures and memory-space checks: cuda_error, check(status), device pointers.

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "attnmix/core/error.hpp"
#include "attnmix/core/tensor_view.hpp"

namespace attnmix {

// A CUDA runtime failure (as opposed to a rejected argument, which is attnmix::error).
class cuda_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
namespace cuda {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw cuda_error(concat("attnmix: ", what, ": ", cudaGetErrorString(status)));
}

// True for memory the device can address: cudaMalloc'd or managed.
inline bool is_device_pointer(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error state of this query
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

// A view that claims device memory must really point to it: a host pointer handed to a
// kernel is an illegal address, not an error message.
template <class T, int R>
void check_device_pointer(const std::string& fn, const char* arg, const tensor_view<T, R>& v) {
  if (!v.has_value() || v.size() == 0) return;
  require(is_device_pointer(v.data()), fn, arg,
          "is marked as device memory but its pointer is not device memory");
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
