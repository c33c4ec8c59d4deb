#pragma once
// Element-wise feature maps phi of kernelised linear attention (spec gbla.md §1.5). Both
// backends compute exactly these functions; the CPU backend evaluates them on whole Eigen
// blocks (cpu/detail/linear.hpp) and checks itself against apply_feature_map.

#include <cmath>

#include "attnmix/config.hpp"

namespace attnmix {

// phi: R^D -> R^D, applied element-wise to keys and queries.
enum class feature_map {
  elu_plus_one,  // elu(x) + 1 = exp(x) for x < 0, x + 1 for x >= 0; always > 0 (the default)
  relu,          // max(x, 0); >= 0, can give all-zero rows
  squared_relu,  // max(x, 0)^2; >= 0
  sigmoid,       // 1 / (1 + exp(-x)); > 0
  identity,      // x; can go negative, so only valid with the normaliser off
};

// Compile-time facts about a feature map.
template <feature_map F>
struct feature_map_traits {
  // phi(x) >= 0 for every x. The normaliser phi(q).sum_j phi(k_j) + eps is then >= eps > 0;
  // a map that can go negative can make it zero or negative, so it needs the normaliser off.
  static constexpr bool nonnegative = F != feature_map::identity;
  static constexpr const char* name = F == feature_map::elu_plus_one   ? "elu_plus_one"
                                      : F == feature_map::relu         ? "relu"
                                      : F == feature_map::squared_relu ? "squared_relu"
                                      : F == feature_map::sigmoid      ? "sigmoid"
                                                                       : "identity";
};

// phi(x) for one element.
template <feature_map F, class A>
ATTNMIX_HOST_DEVICE inline A apply_feature_map(A x) {
  if constexpr (F == feature_map::elu_plus_one) {
    return x > A(0) ? x + A(1) : std::exp(x);
  } else if constexpr (F == feature_map::relu) {
    return x > A(0) ? x : A(0);
  } else if constexpr (F == feature_map::squared_relu) {
    return x > A(0) ? x * x : A(0);
  } else if constexpr (F == feature_map::sigmoid) {
    return A(1) / (A(1) + std::exp(-x));
  } else {
    return x;
  }
}

// Output-gate activations of the gated RMSNorm (spec gbla.md §2.4).
enum class gate_activation {
  silu,     // g * sigmoid(g) (the default, fla's 'swish')
  sigmoid,  // sigmoid(g)
};

template <gate_activation G, class A>
ATTNMIX_HOST_DEVICE inline A apply_gate_activation(A g) {
  const A s = A(1) / (A(1) + std::exp(-g));
  if constexpr (G == gate_activation::silu) {
    return g * s;
  } else {
    return s;
  }
}

}  // namespace attnmix
