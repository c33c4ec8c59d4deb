#pragma once
// kind::bla on CUDA: float, half and bfloat16 inputs, float states
// (cuda/kernels/linear_simt.cuh).

#include <type_traits>

#include "attnmix/attention/linear_attention.hpp"
#include "attnmix/cuda/launch/linear.cuh"

namespace attnmix {

template <>
struct is_implemented<kind::bla, backend::cuda> : std::true_type {};

namespace detail {

template <class Policy>
struct linear_attention_impl<kind::bla, backend::cuda, Policy> {
  template <class T>
  static void run(const linear_attention_args<T>& a, const linear_attention_problem& p,
                  const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    cuda::run_linear<kind::bla, Policy>("attnmix::linear_attention<bla>", a, p, be);
  }
};

}  // namespace detail
}  // namespace attnmix
