#pragma once
// Softmax attention on the CPU: the blocked online-softmax loop of cpu/detail/flash.hpp, and
// its backward in cpu/detail/flash_backward.hpp.

#include <type_traits>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/attention_backward.hpp"
#include "attnmix/cpu/detail/flash.hpp"
#include "attnmix/cpu/detail/flash_backward.hpp"

namespace attnmix {

template <>
struct is_implemented<kind::softmax, backend::cpu> : std::true_type {};
template <>
struct is_backward_implemented<kind::softmax, backend::cpu> : std::true_type {};
template <>
struct takes_key_lengths<kind::softmax, backend::cpu> : std::true_type {};
template <>
struct takes_key_lengths_backward<kind::softmax, backend::cpu> : std::true_type {};

namespace detail {

template <class Policy>
struct attention_impl<kind::softmax, backend::cpu, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p, const backend::cpu& be) {
    cpu::require_cpu_scalar<T>();
    cpu::flash_forward<Policy>(a, p, be);
  }
};

// dq: [B,T,HQ,D], dk: [B,Tk,H,D], dv: [B,Tk,H,Dv] from q, k, v, the forward's out and lse, and
// dout: [B,T,HQ,Dv]; causal or bidirectional by Policy::mask, with the params' window.
template <class Policy>
struct attention_backward_impl<kind::softmax, backend::cpu, Policy> {
  template <class T>
  static void run(const attention_grad_args<T>& a, const attention_problem& p,
                  const backend::cpu& be) {
    cpu::require_cpu_scalar<T>();
    cpu::flash_backward<Policy>(a, p, be);
  }
};

}  // namespace detail
}  // namespace attnmix
