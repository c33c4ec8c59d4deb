#pragma once
// FoX on CUDA: softmax attention plus the forget-gate bias, with G summed in double on device.

#include <string>
#include <type_traits>

#include "attnmix/attention/attention.hpp"
#include "attnmix/cuda/launch/attention.cuh"

namespace attnmix {

template <>
struct is_implemented<kind::fox, backend::cuda> : std::true_type {};

namespace detail {

template <class Policy>
struct attention_impl<kind::fox, backend::cuda, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p, const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    cuda::run_attention<Policy>("attnmix::attention<fox>", a, p, be, gate_coefficient<Policy>(p));
  }
};

}  // namespace detail
}  // namespace attnmix
