// The CUDA backend's runtime plumbing: device detection and memory-space checks.

#include <string>

#include "attnmix/cuda.cuh"
#include "support/cuda_testing.cuh"

TEST_CASE("device pointers are told apart from host pointers", "[cuda]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  float* device = nullptr;
  attnmix::detail::cuda::check(cudaMalloc(&device, 64 * sizeof(float)), "cudaMalloc");
  float host[64] = {};
  CHECK(attnmix::detail::cuda::is_device_pointer(device));
  CHECK_FALSE(attnmix::detail::cuda::is_device_pointer(host));

  attnmix::view1<float> good(device, {64}, attnmix::memory_space::device);
  attnmix::view1<float> lying(host, {64}, attnmix::memory_space::device);
  CHECK_NOTHROW(attnmix::detail::cuda::check_device_pointer("f", "x", good));
  try {
    attnmix::detail::cuda::check_device_pointer("f", "x", lying);
    FAIL("a host pointer passed as device memory was accepted");
  } catch (const attnmix::error& e) {
    CHECK(std::string(e.what()).find("argument 'x' is marked as device memory") !=
          std::string::npos);
  }
  attnmix::detail::cuda::check(cudaFree(device), "cudaFree");
}

TEST_CASE("runtime failures become attnmix::cuda_error", "[cuda]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  CHECK_THROWS_AS(attnmix::detail::cuda::check(cudaErrorInvalidValue, "probe"),
                  attnmix::cuda_error);
}
