#pragma once
// The feature map, its derivative and the gate activation of math/feature_map.hpp with the
// hardware exp and reciprocal, for the 16-bit tensor-core kernels (forward and backward): they
// are bound by these per-element instructions (the library's expf is a dozen instructions and a
// branch), and the error of the fast ones (a few float ulps) is far below their operands'
// rounding. Pure functions of one element: callers select pads away rather than branch.

#include "attnmix/core/linear_policy.hpp"
#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

template <feature_map F>
__device__ __forceinline__ float fast_feature_map(float x) {
  if constexpr (F == feature_map::elu_plus_one) {
    return x > 0.f ? x + 1.f : fast_exp(x);
  } else if constexpr (F == feature_map::sigmoid) {
    return __fdividef(1.f, 1.f + fast_exp(-x));
  } else {
    return apply_feature_map<F>(x);
  }
}

// d phi / dx from x and phi(x); Fast: sigmoid's exp and division on the hardware ones (the
// CUDA-core kernels' phi_derivative is the exact one).
template <feature_map F, bool Fast = true>
__device__ __forceinline__ float phi_derivative_of(float x, float phi) {
  if constexpr (F == feature_map::elu_plus_one) {
    return fminf(phi, 1.f);  // 1 for x > 0, exp(x) = phi(x) below
  } else if constexpr (F == feature_map::relu) {
    return x > 0.f ? 1.f : 0.f;
  } else if constexpr (F == feature_map::squared_relu) {
    return 2.f * fmaxf(x, 0.f);
  } else if constexpr (F == feature_map::sigmoid) {
    // sigma(x) sigma(-x) without 1 - phi's rounding
    if constexpr (Fast) {
      const float e = fast_exp(-fabsf(x));
      return __fdividef(e, (1.f + e) * (1.f + e));
    } else {
      const float e = expf(-fabsf(x));
      return e / ((1.f + e) * (1.f + e));
    }
  } else {
    return 1.f;
  }
}
template <feature_map F>
__device__ __forceinline__ float fast_phi_derivative(float x, float phi) {
  return phi_derivative_of<F, true>(x, phi);
}

template <gate_activation G>
__device__ __forceinline__ float fast_gate_activation(float g) {
  // exp(-g) = inf for g < -88 gives g * 0 = -0 and 1 * 0 = 0, the limits.
  if constexpr (G == gate_activation::silu) {
    return __fdividef(g, 1.f + fast_exp(-g));
  } else {
    return __fdividef(1.f, 1.f + fast_exp(-g));
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
