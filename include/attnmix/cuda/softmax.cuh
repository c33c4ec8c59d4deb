#pragma once
// Softmax attention on CUDA: float, half and bfloat16 inputs with float accumulation.

#include <string>
#include <type_traits>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/attention_backward.hpp"
#include "attnmix/cuda/launch/attention.cuh"
#include "attnmix/cuda/launch/attention_backward.cuh"

namespace attnmix {

template <>
struct is_implemented<kind::softmax, backend::cuda> : std::true_type {};
template <>
struct is_backward_implemented<kind::softmax, backend::cuda> : std::true_type {};
// Keys of other lengths than the queries: the forward reads them (cu_seqlens_k, Tk, a cache's
// key_slots and key_lengths), the backward too (Tk, cu_seqlens_k; on CUDA cores for now).
template <>
struct takes_key_lengths<kind::softmax, backend::cuda> : std::true_type {};
template <>
struct takes_key_lengths_backward<kind::softmax, backend::cuda> : std::true_type {};

namespace detail {

template <class Policy>
struct attention_impl<kind::softmax, backend::cuda, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p, const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    cuda::run_attention<Policy>("attnmix::attention<softmax>", a, p, be, 0.0);
  }
};

// dq: [B,T,HQ,D], dk: [B,T,H,D], dv: [B,T,H,Dv] from the forward's inputs, its out and
// lse, and dout: [B,T,HQ,Dv] (launch/attention_backward.cuh); the same bits on every run.
template <class Policy>
struct attention_backward_impl<kind::softmax, backend::cuda, Policy> {
  template <class T>
  static void run(const attention_grad_args<T>& a, const attention_problem& p,
                  const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    cuda::run_attention_backward<Policy>("attnmix::attention_backward<softmax>", a, p, be, 0.0);
  }
};

}  // namespace detail
}  // namespace attnmix
