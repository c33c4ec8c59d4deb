#pragma once
// The backward of PaTH and PaTH-FoX on CUDA (attnmix::attention_backward<kind::path / path_fox>
// with backend::cuda): float, half or bfloat16 q, k, v (and out, dout, dq, dk, dv); float w, beta,
// g, lse, dw, dbeta, dg. Head dims up to 128 (the tiles' shared memory). Deterministic: no float
// atomics, fixed-order sums. See cuda/kernels/path_backward_tiled.cuh and sm80_path_backward.cuh.

#include <type_traits>

#include "attnmix/attention/attention_backward.hpp"
#include "attnmix/cuda/launch/path_backward.cuh"
#include "attnmix/cuda/path.cuh"

namespace attnmix {

template <>
struct is_backward_implemented<kind::path, backend::cuda> : std::true_type {};
template <>
struct is_backward_implemented<kind::path_fox, backend::cuda> : std::true_type {};

namespace detail {

// a.out and a.lse must be those of attention<kind>(...) under the same Policy (on either
// backend: the backward recomputes everything else).
template <class Policy>
struct attention_backward_impl<kind::path, backend::cuda, Policy> {
  template <class T>
  static void run(const attention_grad_args<T>& a, const attention_problem& p,
                  const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    cuda::run_path_backward("attnmix::attention_backward<path>", a, p, be, 0.0);
  }
};

template <class Policy>
struct attention_backward_impl<kind::path_fox, backend::cuda, Policy> {
  template <class T>
  static void run(const attention_grad_args<T>& a, const attention_problem& p,
                  const backend::cuda& be) {
    static_assert(!std::is_same_v<T, double>,
                  "attnmix: the CUDA backend takes float, half or bfloat16 inputs");
    cuda::run_path_backward("attnmix::attention_backward<path_fox>", a, p, be,
                            gate_coefficient<Policy>(p));
  }
};

}  // namespace detail
}  // namespace attnmix
