#pragma once
// PaTH and PaTH-FoX on CUDA: the forward (attnmix::attention<kind::path / path_fox>), the
// prefill key cache (path_prefill_key_cache), and decoding from a cache in device memory
// (path_cache<Store, device_space>, alias device_path_cache<Store>, through the same
// path_prefill / path_decode_step front doors as the host cache).
//
// The chunk size of the CUDA kernels is fixed at 64 (Policy::chunk is a CPU knob; the result does
// not depend on it beyond rounding). Head dims up to 128; decoding needs D, Dv multiples of 8.
//
//   attnmix::device_path_cache<attnmix::bfloat16> cache(slots, capacity, HQ, H, D, Dv);
//   attnmix::path_prefill<attnmix::kind::path_fox>(cache, prompt_args, {}, {}, be);
//   attnmix::path_decode_step<attnmix::kind::path_fox>(cache, step_args, {}, {}, be);

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/path_cache.hpp"
#include "attnmix/cuda/launch/path.cuh"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {

template <>
struct is_implemented<kind::path, backend::cuda> : std::true_type {};
template <>
struct is_implemented<kind::path_fox, backend::cuda> : std::true_type {};

namespace detail {

// The device cache: cudaMalloc'd storage, float or bfloat16 elements, the head dims the decoding
// kernels take.
template <>
struct path_cache_space<device_space> {
  static constexpr const char* name = "attnmix::device_path_cache";
  static constexpr index_t recent = cuda::path_decode_recent;  // deferred transitions
  template <class T>
  static constexpr bool holds = std::is_same_v<T, float> || std::is_same_v<T, bfloat16>;
  static void check_dims(const std::string& fn, index_t head_dim, index_t value_dim) {
    require(head_dim % 8 == 0 && head_dim <= 128, fn, "head_dim",
            "must be a multiple of 8 in [8, 128] but is ", head_dim);
    require(value_dim % 8 == 0 && value_dim <= 128, fn, "value_dim",
            "must be a multiple of 8 in [8, 128] but is ", value_dim);
  }
  // Throws attnmix::cuda_error if the allocation fails. Movable, not copyable.
  class buffer {
   public:
    buffer() = default;
    buffer(std::size_t bytes, const char*) : memory_(bytes, "cudaMalloc(device_path_cache)") {}
    void* get() const { return memory_.get(); }

   private:
    cuda::device_memory memory_;
  };
};

}  // namespace detail

// The decoding cache in device memory (see path_cache).
template <class Store>
using device_path_cache = path_cache<Store, device_space>;

namespace detail {

template <class Policy>
struct attention_impl<kind::path, backend::cuda, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p, const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    cuda::run_path("attnmix::attention<path>", a, p, be, 0.0);
  }
};

template <class Policy>
struct attention_impl<kind::path_fox, backend::cuda, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p, const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    cuda::run_path("attnmix::attention<path_fox>", a, p, be, gate_coefficient<Policy>(p));
  }
};

template <>
struct path_cache_impl<backend::cuda> {
  template <class Policy, class T>
  static void key_cache(const path_key_cache_args<T>& a, const attention_problem& p,
                        const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    cuda::run_path_key_cache("attnmix::path_prefill_key_cache", a, p, be);
  }

  // path_prefill into a device cache: the forward (out, optional lse) and the cache's keys,
  // values and gate cumsum for each prompt, from the same chunk data.
  template <class Kind, class Policy, class Store, class T>
  static void prefill(device_path_cache<Store>& cache, const attention_args<T>& args,
                      const attention_problem& prob, const std::vector<index_t>& where,
                      const backend::cuda& backend) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    const std::string fn = path_fn<Kind>("path_prefill");
    using DevStore = cuda::device_t<Store>;
    cudaStream_t stream = static_cast<cudaStream_t>(backend.stream);
    const std::vector<std::int32_t> slot_host(where.begin(), where.end());
    cuda::stream_buffer slot_dev(slot_host.size() * sizeof(std::int32_t), stream);
    cuda::upload_host(slot_dev.get(), slot_host.data(), slot_host.size() * sizeof(std::int32_t),
                      stream, "cudaMemcpyAsync(slots)");
    cuda::key_cache_target<DevStore> target;
    target.keys = reinterpret_cast<DevStore*>(path_cache_access::keys(cache));
    target.stride[0] = cache.capacity() * prob.kv_heads * prob.head_dim;
    target.stride[1] = prob.kv_heads * prob.head_dim;
    target.stride[2] = prob.head_dim;
    target.slot_of = reinterpret_cast<const std::int32_t*>(slot_dev.get());
    target.values = reinterpret_cast<DevStore*>(path_cache_access::values(cache));
    target.gates = path_cache_access::gates(cache);
    target.recent = path_cache_access::recent(cache);
    target.transitions = path_cache_access::transitions(cache);
    target.capacity = cache.capacity();
    cuda::run_path(fn, args, prob, backend, gate_coefficient<Policy>(prob), target);
    for (index_t n = 0; n < prob.num_sequences; ++n)
      path_cache_access::set_length(cache, where[static_cast<std::size_t>(n)], prob.seq(n).length);
  }

  // One decoding step from a device cache (see cuda/kernels/path_decode.cuh).
  template <class Kind, class Policy, class Store, class T>
  static void decode(device_path_cache<Store>& cache, const attention_args<T>& args,
                     const attention_problem& prob, const std::vector<index_t>& where,
                     const backend::cuda& backend) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    const std::string fn = path_fn<Kind>("path_decode_step");
    cuda::decode_cache target{path_cache_access::keys(cache),
                              path_cache_access::values(cache),
                              path_cache_access::gates(cache),
                              path_cache_access::recent(cache),
                              path_cache_access::transitions(cache),
                              cache.capacity(),
                              {}};
    for (index_t s : where)
      target.rows.push_back(
          {static_cast<std::int32_t>(s), static_cast<std::int32_t>(cache.length(s))});
    cuda::run_path_decode<cuda::device_t<Store>>(fn, args, prob, target,
                                                 gate_coefficient<Policy>(prob), backend);
    for (index_t s : where) path_cache_access::set_length(cache, s, cache.length(s) + 1);
  }
};

}  // namespace detail

}  // namespace attnmix
