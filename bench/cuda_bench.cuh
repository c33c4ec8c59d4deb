#pragma once
// What the CUDA benchmarks share: random device arrays and event timing of one call.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "attnmix/cuda/arch/types.cuh"

#include "attnmix/core/scalar.hpp"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix_bench {

// Fills x[0, n) with U(lo, hi) from a per-element hash of (seed, index): fast on the device
// for the gigabyte-sized inputs of the long shapes.
template <class T>
__global__ void fill_uniform_kernel(T* x, std::size_t n, unsigned seed, float lo, float hi) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    unsigned long long z =
        (static_cast<unsigned long long>(seed) << 40) + i + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    x[i] = static_cast<T>(lo + (hi - lo) * u);
  }
}

// n elements of T drawn from U(lo, hi) (never zeros: they can time faster than real data).
template <class T>
struct device_array {
  T* ptr = nullptr;
  explicit device_array(std::size_t n, unsigned seed = 1, float lo = -1.f, float hi = 1.f) {
    using D = attnmix::detail::cuda::device_t<T>;
    attnmix::detail::cuda::check(cudaMalloc(&ptr, (n > 0 ? n : 1) * sizeof(T)), "cudaMalloc");
    fill_uniform_kernel<D><<<1024, 256>>>(reinterpret_cast<D*>(ptr), n, seed, lo, hi);
    attnmix::detail::cuda::check(cudaDeviceSynchronize(), "fill_uniform_kernel");
  }
  ~device_array() { cudaFree(ptr); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
};

// Runs `call` three times to warm up, then `calls` times back to back per benchmark iteration
// between two CUDA events, reporting the event time per call as the iteration's manual time.
template <class Call>
void time_with_events(benchmark::State& state, Call&& call, int calls = 1) {
  using attnmix::detail::cuda::check;
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate"),
      check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) call();
  for (auto _ : state) {
    check(cudaEventRecord(start), "cudaEventRecord");
    for (int i = 0; i < calls; ++i) call();
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(ms / 1e3 / calls);
  }
  cudaEventDestroy(start), cudaEventDestroy(stop);
}

// Milliseconds of body() on the default stream (events around it).
template <class Body>
double event_ms(Body&& body) {
  using attnmix::detail::cuda::check;
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate"), check(cudaEventCreate(&b), "cudaEventCreate");
  check(cudaEventRecord(a), "cudaEventRecord");
  body();
  check(cudaEventRecord(b), "cudaEventRecord");
  check(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a), cudaEventDestroy(b);
  return ms;
}

}  // namespace attnmix_bench
