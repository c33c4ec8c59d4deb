#pragma once
// GBLA core on the CPU: BLA with the key gate applied on load in the reduce pass and the gated
// RMSNorm fused into the read pass (cpu/detail/linear.hpp).

#include <type_traits>

#include "attnmix/attention/linear_attention.hpp"
#include "attnmix/attention/linear_attention_backward.hpp"
#include "attnmix/cpu/detail/linear.hpp"
#include "attnmix/cpu/detail/linear_backward.hpp"

namespace attnmix {

template <>
struct is_implemented<kind::gbla, backend::cpu> : std::true_type {};
template <>
struct is_backward_implemented<kind::gbla, backend::cpu> : std::true_type {};

namespace detail {

template <class Policy>
struct linear_attention_impl<kind::gbla, backend::cpu, Policy> {
  template <class T>
  static void run(const linear_attention_args<T>& a, const linear_attention_problem& p,
                  const backend::cpu& be) {
    cpu::require_cpu_scalar<T>();
    cpu::bidirectional_forward<Policy>(a, p, be);
  }
};

// Backward: cpu/detail/linear_backward.hpp (bidirectional_backward).
template <class Policy>
struct linear_attention_backward_impl<kind::gbla, backend::cpu, Policy> {
  template <class T>
  static void run(const linear_attention_grad_args<T>& g, const linear_attention_problem& p,
                  const backend::cpu& be) {
    cpu::require_cpu_scalar<T>();
    cpu::bidirectional_backward<Policy>(g, p, be);
  }
};

}  // namespace detail
}  // namespace attnmix
