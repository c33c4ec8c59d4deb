#pragma once
// The backward of the linear-attention kinds on CUDA (linear_attention_backward with
// backend::cuda): kind::bla, kind::gbla and kind::linear_causal, float, half and bfloat16
// inputs, float states and accumulation, D, Dv <= 128 (cuda/launch/linear_backward.cuh).
// Not on CUDA: gated_norm::full_width (a compile-time error, as in the forward).

#include <type_traits>

#include "attnmix/attention/linear_attention_backward.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/cuda/launch/linear_backward.cuh"

namespace attnmix {

template <>
struct is_backward_implemented<kind::bla, backend::cuda> : std::true_type {};
template <>
struct is_backward_implemented<kind::gbla, backend::cuda> : std::true_type {};
template <>
struct is_backward_implemented<kind::linear_causal, backend::cuda> : std::true_type {};

namespace detail {

template <class Kind, class Policy>
struct cuda_linear_backward {
  template <class T>
  static void run(const linear_attention_grad_args<T>& a, const linear_attention_problem& p,
                  const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    const std::string fn = std::string("attnmix::linear_attention_backward<") + Kind::name + ">";
    cuda::run_linear_backward<Kind, Policy>(fn, a, p, be);
  }
};

template <class Policy>
struct linear_attention_backward_impl<kind::bla, backend::cuda, Policy>
    : cuda_linear_backward<kind::bla, Policy> {};
template <class Policy>
struct linear_attention_backward_impl<kind::gbla, backend::cuda, Policy>
    : cuda_linear_backward<kind::gbla, Policy> {};
template <class Policy>
struct linear_attention_backward_impl<kind::linear_causal, backend::cuda, Policy>
    : cuda_linear_backward<kind::linear_causal, Policy> {};

}  // namespace detail
}  // namespace attnmix
