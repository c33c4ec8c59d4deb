#pragma once
// Softmax attention on the CPU: the blocked online-softmax loop of cpu/detail/flash.hpp.

#include <type_traits>

#include "attnmix/attention/attention.hpp"
#include "attnmix/cpu/detail/flash.hpp"

namespace attnmix {

template <>
struct is_implemented<kind::softmax, backend::cpu> : std::true_type {};

namespace detail {

template <class Policy>
struct attention_impl<kind::softmax, backend::cpu, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p, const backend::cpu& be) {
    cpu::require_cpu_scalar<T>();
    cpu::flash_forward<Policy>(a, p, be);
  }
};

}  // namespace detail
}  // namespace attnmix
