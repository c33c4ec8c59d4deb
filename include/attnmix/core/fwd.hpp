#pragma once
// Primary templates of every operation. Backends specialise them in cpu/<kind>.hpp and
// cuda/<kind>.cuh; an unspecialised use fails to compile with a message saying what to include.

#include "attnmix/core/traits.hpp"

namespace attnmix {
namespace detail {

// Softmax-family attention forward: static void run(const attention_args<T>&,
// const attention_problem&, const Backend&).
template <class Kind, class Backend, class Policy, class Enable = void>
struct attention_impl {
  static_assert(dependent_false<Kind, Backend>,
                "attnmix::attention: no implementation of this kind for this backend. For "
                "backend::cpu include <attnmix/attnmix.hpp> (or attnmix/cpu/<kind>.hpp); for "
                "backend::cuda include <attnmix/cuda.cuh> in a translation unit compiled by nvcc.");
};

// Linear-attention forward (bla, gbla, linear_causal): static void run(const
// linear_attention_args<T>&, const linear_attention_problem&, const Backend&).
template <class Kind, class Backend, class Policy, class Enable = void>
struct linear_attention_impl {
  static_assert(dependent_false<Kind, Backend>,
                "attnmix::linear_attention: no implementation of this kind for this backend. For "
                "backend::cpu include <attnmix/attnmix.hpp> (or attnmix/cpu/<kind>.hpp); for "
                "backend::cuda include <attnmix/cuda.cuh> in a translation unit compiled by nvcc.");
};

// Softmax-family backward: static void run(const attention_grad_args<T>&,
// const attention_problem&, const Backend&).
template <class Kind, class Backend, class Policy, class Enable = void>
struct attention_backward_impl {
  static_assert(dependent_false<Kind, Backend>,
                "attnmix::attention_backward: no backward of this kind for this backend. For "
                "backend::cpu include <attnmix/attnmix.hpp> (or attnmix/cpu/<kind>.hpp).");
};

// Linear-attention backward: static void run(const linear_attention_grad_args<T>&,
// const linear_attention_problem&, const Backend&).
template <class Kind, class Backend, class Policy, class Enable = void>
struct linear_attention_backward_impl {
  static_assert(dependent_false<Kind, Backend>,
                "attnmix::linear_attention_backward: no backward of this kind for this backend. "
                "For backend::cpu include <attnmix/attnmix.hpp> (or attnmix/cpu/<kind>.hpp).");
};

}  // namespace detail
}  // namespace attnmix
