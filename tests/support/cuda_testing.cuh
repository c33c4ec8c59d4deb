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

#define ATTNMIX_REQUIRE_CUDA_DEVICE()                                                   \
  do {                                                                                  \
    if (!attnmix_test::cuda_device_available()) {                                       \
      if (std::getenv("ATTNMIX_REQUIRE_GPU")) FAIL("no usable CUDA device");            \
      WARN("ATTNMIX_SKIP: no usable CUDA device");                                      \
      return;                                                                           \
    }                                                                                   \
  } while (0)
