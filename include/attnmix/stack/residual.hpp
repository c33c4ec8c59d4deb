#pragma once
// What the stacks' backwards share: the gradient of the residual stream, kept in R = accum_t<T>,
// beside layers that take and give T.

#include <cstddef>
#include <type_traits>

#include "attnmix/config.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace detail {

// In mixed precision (T 16-bit, R float) narrow() rounds the residual gradient to T for a layer
// and wide() widens a layer's gradient back to R before a norm's backward adds it, each into a
// buffer of its own (rows x width, taken from the call's scratch); with R == T both hand back the
// pointer they are given.
template <class T, class R, class Backend>
class residual_grad {
  using O = layers::ops<Backend>;

 public:
  static constexpr bool mixed = !std::is_same_v<R, T>;
  // The scratch bytes its buffers take for n values.
  static std::size_t scratch_bytes(index_t n) {
    return mixed ? layers::scratch_bytes<R>(n) + layers::scratch_bytes<T>(n) : 0;
  }

  residual_grad(const layers::context<Backend>& c, index_t rows, index_t width,
                typename O::scratch& s)
      : c_(c),
        rows_(rows),
        width_(width),
        wide_(mixed ? s.template take<R>(rows * width) : nullptr),
        narrow_(mixed ? s.template take<T>(rows * width) : nullptr) {}

  const R* wide(const T* g) const {
    if constexpr (mixed) {
      O::move_rows(c_, g, wide_, same, same, rows_, width_);
      return wide_;
    } else {
      return g;
    }
  }
  const T* narrow(const R* g) const {
    if constexpr (mixed) {
      O::move_rows(c_, g, narrow_, same, same, rows_, width_);
      return narrow_;
    } else {
      return g;
    }
  }

 private:
  static constexpr const std::int64_t* same = nullptr;  // move_rows without a row map: a copy
  const layers::context<Backend>& c_;
  index_t rows_, width_;
  R* wide_;
  T* narrow_;
};

}  // namespace detail
}  // namespace attnmix
