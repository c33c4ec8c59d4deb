#pragma once
// Householder transitions H = I - beta w w^T on plain arrays, for code that works one vector
// at a time (a decoding step, one thread of a CUDA kernel). No Eigen and no allocation, so
// both backends can share them. PaTH's conventions (spec/path_fox.md §1.1): w is unit length
// and beta in [0, 2], so H is symmetric with eigenvalues 1 - beta in [-1, 1] and 1.

#include "attnmix/config.hpp"

namespace attnmix {
namespace math {

// sum_i x[i] * y[i], accumulated in Acc. Four partial sums: a shorter dependency chain, and
// the compiler may keep them in one vector register.
template <class Acc, class X, class Y>
ATTNMIX_HOST_DEVICE Acc dot(const X* x, const Y* y, index_t n) {
  Acc s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  index_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += static_cast<Acc>(x[i]) * static_cast<Acc>(y[i]);
    s1 += static_cast<Acc>(x[i + 1]) * static_cast<Acc>(y[i + 1]);
    s2 += static_cast<Acc>(x[i + 2]) * static_cast<Acc>(y[i + 2]);
    s3 += static_cast<Acc>(x[i + 3]) * static_cast<Acc>(y[i + 3]);
  }
  for (; i < n; ++i) s0 += static_cast<Acc>(x[i]) * static_cast<Acc>(y[i]);
  return (s0 + s1) + (s2 + s3);
}

// x <- H x = x - beta (w^T x) w, in place; the arithmetic is done in Acc (the type of w and
// beta), then rounded to X. x: [n], w: [n].
template <class X, class Acc>
ATTNMIX_HOST_DEVICE void apply_householder(X* x, const Acc* w, Acc beta, index_t n) {
  const Acc c = beta * dot<Acc>(w, x, n);
  for (index_t i = 0; i < n; ++i) x[i] = static_cast<X>(static_cast<Acc>(x[i]) - c * w[i]);
}

// Number of chunks of `chunk` positions that cover `length` positions (the last may be partial).
ATTNMIX_HOST_DEVICE inline index_t chunk_count(index_t length, index_t chunk) {
  return (length + chunk - 1) / chunk;
}

}  // namespace math
}  // namespace attnmix
