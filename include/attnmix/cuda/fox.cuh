#pragma once
// FoX on CUDA: softmax attention plus the forget-gate bias, with G summed in double on device.

#include <string>
#include <type_traits>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/attention_backward.hpp"
#include "attnmix/cuda/launch/attention.cuh"
#include "attnmix/cuda/launch/attention_backward.cuh"

namespace attnmix {

template <>
struct is_implemented<kind::fox, backend::cuda> : std::true_type {};
template <>
struct is_backward_implemented<kind::fox, backend::cuda> : std::true_type {};
// The forward reads keys of other lengths than the queries (cu_seqlens_k, Tk, a cache's
// key_slots and key_lengths); the backward not yet.
template <>
struct takes_key_lengths<kind::fox, backend::cuda> : std::true_type {};

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

// dq: [B,T,HQ,D], dk: [B,T,H,D], dv: [B,T,H,Dv] and dg: [B,T,HQ] from the forward's inputs, its out
// and lse, and dout: [B,T,HQ,Dv] (launch/attention_backward.cuh); the same bits on every run.
template <class Policy>
struct attention_backward_impl<kind::fox, backend::cuda, Policy> {
  template <class T>
  static void run(const attention_grad_args<T>& a, const attention_problem& p,
                  const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    cuda::run_attention_backward<Policy>("attnmix::attention_backward<fox>", a, p, be,
                                         gate_coefficient<Policy>(p));
  }
};

}  // namespace detail
}  // namespace attnmix
