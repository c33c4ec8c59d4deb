#pragma once
// What the CUDA benchmarks share: random device arrays and event timing of one call.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <random>
#include <vector>

#include "attnmix/core/scalar.hpp"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix_bench {

// n elements of T drawn from U(lo, hi) (never zeros: they can time faster than real data).
template <class T>
struct device_array {
  T* ptr = nullptr;
  explicit device_array(std::size_t n, unsigned seed = 1, float lo = -1.f, float hi = 1.f) {
    attnmix::detail::cuda::check(cudaMalloc(&ptr, n * sizeof(T)), "cudaMalloc");
    std::vector<T> h(n);
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    for (auto& x : h) x = attnmix::convert<T>(dist(gen));
    attnmix::detail::cuda::check(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice),
                                 "cudaMemcpy");
  }
  ~device_array() { cudaFree(ptr); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
};

// Runs `call` three times to warm up, then once per benchmark iteration between two CUDA
// events, reporting the event time as the iteration's manual time.
template <class Call>
void time_with_events(benchmark::State& state, Call&& call) {
  using attnmix::detail::cuda::check;
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate"),
      check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) call();
  for (auto _ : state) {
    check(cudaEventRecord(start), "cudaEventRecord");
    call();
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(ms / 1e3);
  }
  cudaEventDestroy(start), cudaEventDestroy(stop);
}

}  // namespace attnmix_bench
