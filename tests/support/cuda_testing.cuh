#pragma once
// CUDA tests compile everywhere nvcc is and report Skipped (via the "ATTNMIX_SKIP:" warning that
// CTest matches) on machines without a usable GPU; ATTNMIX_REQUIRE_GPU=1 turns that into a failure.

#include <cuda_runtime.h>

#include <cstdlib>

#include "support/catch.hpp"

namespace attnmix_test {

inline bool cuda_device_available() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) (void)cudaGetLastError();
  return status == cudaSuccess && count > 0;
}

}  // namespace attnmix_test

#define ATTNMIX_REQUIRE_CUDA_DEVICE()                                        \
  do {                                                                       \
    if (!attnmix_test::cuda_device_available()) {                            \
      if (std::getenv("ATTNMIX_REQUIRE_GPU")) FAIL("no usable CUDA device"); \
      WARN("ATTNMIX_SKIP: no usable CUDA device");                           \
      return;                                                                \
    }                                                                        \
  } while (0)

#include <vector>

#include "attnmix/cuda/runtime.cuh"

namespace attnmix_test {

// Device memory for tests; contents start as NaN (0xFF bytes) so unwritten outputs show.
template <class T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t n) : n_(n) {
    attnmix::detail::cuda::check(cudaMalloc(&ptr_, (n > 0 ? n : 1) * sizeof(T)), "cudaMalloc");
    attnmix::detail::cuda::check(cudaMemset(ptr_, 0xFF, (n > 0 ? n : 1) * sizeof(T)), "cudaMemset");
  }
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) {
    attnmix::detail::cuda::check(
        cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~device_buffer() { (void)cudaFree(ptr_); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  T* get() const { return ptr_; }
  std::vector<T> to_host() const {
    std::vector<T> h(n_);
    attnmix::detail::cuda::check(cudaMemcpy(h.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost),
                                 "cudaMemcpy");
    return h;
  }

 private:
  T* ptr_ = nullptr;
  std::size_t n_;
};

}  // namespace attnmix_test
