#pragma once
// tensor_view: a non-owning strided view of a rank-R array, plus the memory space it lives in.
// Layout conventions: [B, T, H, D] token-major with heads inner; strides are in elements.

#include <array>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>

#include "attnmix/config.hpp"
#include "attnmix/core/memory_space.hpp"

namespace attnmix {

template <class T, int Rank>
class tensor_view {
  static_assert(Rank >= 1, "attnmix::tensor_view: rank must be at least 1");

 public:
  using element_type = T;
  using extents_type = std::array<index_t, Rank>;
  static constexpr int rank = Rank;

  // An absent view: optional arguments are left default-constructed.
  tensor_view() = default;

  // A contiguous row-major view.
  tensor_view(T* data, const extents_type& shape, memory_space space = memory_space::host)
      : data_(data), shape_(shape), space_(space), bound_(true) {
    // Wrapping arithmetic: a shape too large to address gets meaningless strides, not undefined
    // behaviour, and the front doors' layout check rejects it by its extents.
    std::uint64_t s = 1;
    for (int i = Rank - 1; i >= 0; --i) {
      stride_[i] = static_cast<index_t>(s);
      s *= static_cast<std::uint64_t>(shape_[i]);
    }
  }

  // A view with explicit strides (in elements).
  tensor_view(T* data, const extents_type& shape, const extents_type& stride,
              memory_space space = memory_space::host)
      : data_(data), shape_(shape), stride_(stride), space_(space), bound_(true) {}

  // T -> const T.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  tensor_view(const tensor_view<U, Rank>& other)  // NOLINT(google-explicit-constructor)
      : data_(other.data()),
        shape_(other.shape()),
        stride_(other.strides()),
        space_(other.space()),
        bound_(other.has_value()) {}

  bool has_value() const { return bound_; }
  T* data() const { return data_; }
  const extents_type& shape() const { return shape_; }
  const extents_type& strides() const { return stride_; }
  index_t extent(int i) const { return shape_[i]; }
  index_t stride(int i) const { return stride_[i]; }
  memory_space space() const { return space_; }

  index_t size() const {
    index_t n = 1;
    for (index_t e : shape_) n *= e;
    return n;
  }

  template <class... I>
  index_t offset(I... idx) const {
    static_assert(sizeof...(I) == Rank, "attnmix::tensor_view: wrong number of indices");
    const index_t ids[] = {static_cast<index_t>(idx)...};
    index_t off = 0;
    for (int i = 0; i < Rank; ++i) off += ids[i] * stride_[i];
    return off;
  }

  // Element access; host memory only.
  template <class... I>
  T& operator()(I... idx) const {
    return data_[offset(idx...)];
  }

 private:
  T* data_ = nullptr;
  extents_type shape_{};
  extents_type stride_{};
  memory_space space_ = memory_space::host;
  bool bound_ = false;
};

template <class T, int R>
std::string shape_string(const tensor_view<T, R>& v) {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < R; ++i) os << (i ? ", " : "") << v.extent(i);
  os << ']';
  return os.str();
}

namespace detail {

// A view's shape for an error message, formatted only when the message is built: the arguments
// of require() are evaluated on every call, and a string each costs the front door microseconds.
template <class T, int R>
struct lazy_shape {
  const tensor_view<T, R>& view;
};
template <class T, int R>
std::ostream& operator<<(std::ostream& os, const lazy_shape<T, R>& s) {
  return os << shape_string(s.view);
}
template <class T, int R>
lazy_shape<T, R> shape_of(const tensor_view<T, R>& v) {
  return {v};
}

}  // namespace detail

// Common ranks: [B,T,H,D] activations, [B,T,H] per-token per-head scalars, [N] vectors.
template <class T>
using view4 = tensor_view<T, 4>;
template <class T>
using view3 = tensor_view<T, 3>;
template <class T>
using view1 = tensor_view<T, 1>;

}  // namespace attnmix
