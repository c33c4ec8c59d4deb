#pragma once
// The logits of a batch as float in host memory, from a model on any backend: the examples'
// evaluations (train_flipflop, state_tracking) read them there, written in place by a host model,
// copied back from the device otherwise.

#include <cstddef>
#include <vector>

#include "attnmix/attnmix.hpp"
#ifdef __CUDACC__
#include "attnmix/cuda.cuh"
#endif

template <class Backend, class T>
struct host_logits {
  explicit host_logits(attnmix::index_t v) : vocab(v) {}
  attnmix::index_t vocab;
  std::vector<T> host;
  std::vector<float> out;
  attnmix::layers::buffer<T, typename Backend::memory_space> mem;

  // The [B, T, vocab] view the model's forward writes.
  attnmix::view3<T> view(attnmix::index_t B, attnmix::index_t Tn) {
    host.resize(static_cast<std::size_t>(B * Tn * vocab));
    if constexpr (attnmix::layers::on_host_v<Backend>) return {host.data(), {B, Tn, vocab}};
    mem.resize(B * Tn * vocab);
    return {mem.data(), {B, Tn, vocab}, attnmix::memory_space::device};
  }
  // What the forward wrote, as float, row-major.
  const float* read() {
#ifdef __CUDACC__
    if constexpr (!attnmix::layers::on_host_v<Backend>)
      attnmix::detail::cuda::check(
          cudaMemcpy(host.data(), mem.data(), host.size() * sizeof(T), cudaMemcpyDeviceToHost),
          "cudaMemcpy(logits)");
#endif
    out.resize(host.size());
    for (std::size_t i = 0; i < host.size(); ++i) out[i] = static_cast<float>(host[i]);
    return out.data();
  }
};
