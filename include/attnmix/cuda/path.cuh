#pragma once
// PaTH and PaTH-FoX on CUDA: the forward (attnmix::attention<kind::path / path_fox>), the
// prefill key cache (path_prefill_key_cache), and decoding from a cache in device memory
// (device_path_cache with path_prefill / path_decode_step).
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

// Decoding state of a batch of PaTH / PaTH-FoX sequences in device memory; the layout of
// path_cache (keys [slots, capacity, H, D], values [.., H, Dv], gates [slots, capacity, HQ] in
// double). Store is float or bfloat16: a bfloat16 cache halves the traffic of a decoding step,
// but every step rounds each carried key again (docs/performance.md measures the drift).
// Lengths are kept on the host. Not copyable; movable.
template <class Store>
class device_path_cache : public detail::path_cache_base {
  static_assert(std::is_same_v<Store, float> || std::is_same_v<Store, bfloat16>,
                "attnmix::device_path_cache: the cache holds float or bfloat16");

 public:
  device_path_cache() { name_ = "attnmix::device_path_cache"; }
  // Throws attnmix::error naming a bad size, attnmix::cuda_error if the allocation fails.
  device_path_cache(index_t slots, index_t capacity, index_t q_heads, index_t kv_heads,
                    index_t head_dim, index_t value_dim)
      : path_cache_base("attnmix::device_path_cache", slots, capacity, q_heads, kv_heads, head_dim,
                        value_dim) {
    const std::string fn = name_;
    detail::require(head_dim % 8 == 0 && head_dim <= 128, fn, "head_dim",
                    "must be a multiple of 8 in [8, 128] but is ", head_dim);
    detail::require(value_dim % 8 == 0 && value_dim <= 128, fn, "value_dim",
                    "must be a multiple of 8 in [8, 128] but is ", value_dim);
    keys_ = memory(elements(kv_heads, head_dim) * sizeof(Store));
    values_ = memory(elements(kv_heads, value_dim) * sizeof(Store));
    gates_ = memory(elements(q_heads, 1) * sizeof(double));
  }
  device_path_cache(const device_path_cache&) = delete;
  device_path_cache& operator=(const device_path_cache&) = delete;
  // A moved-from cache holds no slots.
  device_path_cache(device_path_cache&& o) noexcept { *this = std::move(o); }
  device_path_cache& operator=(device_path_cache&& o) noexcept {
    if (this != &o) {
      static_cast<path_cache_base&>(*this) = std::move(o);
      keys_ = std::move(o.keys_), values_ = std::move(o.values_), gates_ = std::move(o.gates_);
      o.slots_ = 0;
    }
    return *this;
  }

  view4<const Store> keys() const {
    return {static_cast<const Store*>(keys_.get()),
            {slots_, capacity_, kv_heads_, head_dim_},
            memory_space::device};
  }
  view4<const Store> values() const {
    return {static_cast<const Store*>(values_.get()),
            {slots_, capacity_, kv_heads_, value_dim_},
            memory_space::device};
  }
  view3<const double> gate_cumsum() const {
    return {static_cast<const double*>(gates_.get()),
            {slots_, capacity_, q_heads_},
            memory_space::device};
  }

  // Device storage, for the implementation (path_prefill, path_decode_step).
  void* raw_keys() { return keys_.get(); }
  void* raw_values() { return values_.get(); }
  double* raw_gates() { return static_cast<double*>(gates_.get()); }

 private:
  static detail::cuda::device_memory memory(std::size_t bytes) {
    return detail::cuda::device_memory(bytes, "cudaMalloc(device_path_cache)");
  }
  detail::cuda::device_memory keys_, values_, gates_;
};

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
};

}  // namespace detail

// path_prefill into a device cache: the forward (out, optional lse) and the cache's keys, values
// and gate cumsum for each prompt, from the same chunk data. Arguments as for the host cache.
template <class Kind, class Policy = default_policy_t<Kind>, class Store, class T>
void path_prefill(device_path_cache<Store>& cache, const attention_args<T>& args,
                  const view1<const std::int32_t>& slots = {}, const attention_params& params = {},
                  const backend::cuda& backend = backend::cuda{}) {
  const std::string fn = detail::path_fn<Kind>("path_prefill");
  const auto [prob, where] =
      detail::check_path_prefill<Kind, backend::cuda>(fn, cache, args, slots, params);
  using DevStore = detail::cuda::device_t<Store>;
  cudaStream_t stream = static_cast<cudaStream_t>(backend.stream);
  const std::vector<std::int32_t> slot_host(where.begin(), where.end());
  detail::cuda::stream_buffer slot_dev(slot_host.size() * sizeof(std::int32_t), stream);
  detail::cuda::check(
      cudaMemcpyAsync(slot_dev.get(), slot_host.data(), slot_host.size() * sizeof(std::int32_t),
                      cudaMemcpyHostToDevice, stream),
      "cudaMemcpyAsync(slots)");
  detail::cuda::key_cache_target<DevStore> target;
  target.keys = static_cast<DevStore*>(cache.raw_keys());
  target.stride[0] = cache.capacity() * prob.kv_heads * prob.head_dim;
  target.stride[1] = prob.kv_heads * prob.head_dim;
  target.stride[2] = prob.head_dim;
  target.slot_of = reinterpret_cast<const std::int32_t*>(slot_dev.get());
  target.values = static_cast<DevStore*>(cache.raw_values());
  target.gates = cache.raw_gates();
  target.capacity = cache.capacity();
  detail::cuda::run_path(fn, args, prob, backend, detail::gate_coefficient<Policy>(prob), target);
  for (index_t n = 0; n < prob.num_sequences; ++n)
    detail::path_cache_access::set_length(cache, where[static_cast<std::size_t>(n)],
                                          prob.seq(n).length);
}

// One decoding step from a device cache, fused (see cuda/detail/path_decode.cuh). Arguments as
// for the host cache; the step's tensors are device memory.
template <class Kind, class Policy = default_policy_t<Kind>, class Store, class T>
void path_decode_step(device_path_cache<Store>& cache, const attention_args<T>& args,
                      const view1<const std::int32_t>& slots = {},
                      const attention_params& params = {},
                      const backend::cuda& backend = backend::cuda{}) {
  static_assert(!std::is_same_v<T, double>,
                "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
  const std::string fn = detail::path_fn<Kind>("path_decode_step");
  const auto [prob, where] =
      detail::check_path_decode<Kind, backend::cuda>(fn, cache, args, slots, params);
  detail::cuda::decode_cache target{
      cache.raw_keys(), cache.raw_values(), cache.raw_gates(), cache.capacity(), {}};
  for (index_t s : where)
    target.rows.push_back(
        {static_cast<std::int32_t>(s), static_cast<std::int32_t>(cache.length(s))});
  detail::cuda::run_path_decode<detail::cuda::device_t<Store>>(
      fn, args, prob, target, detail::gate_coefficient<Policy>(prob), backend);
  for (index_t s : where) detail::path_cache_access::set_length(cache, s, cache.length(s) + 1);
}

}  // namespace attnmix
