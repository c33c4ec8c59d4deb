#pragma once
// host_tensor: an owning, contiguous, row-major array in host memory that hands out views.

#include <algorithm>
#include <array>
#include <vector>

#include "attnmix/core/tensor_view.hpp"

namespace attnmix {

template <class T, int Rank>
class host_tensor {
 public:
  using extents_type = std::array<index_t, Rank>;

  host_tensor() = default;
  explicit host_tensor(const extents_type& shape, T fill = T{}) : shape_(shape) {
    index_t n = 1;
    for (index_t e : shape_) n *= e;
    data_.assign(static_cast<std::size_t>(n), fill);
  }

  tensor_view<T, Rank> view() { return {data_.data(), shape_}; }
  tensor_view<const T, Rank> view() const { return {data_.data(), shape_}; }
  tensor_view<const T, Rank> cview() const { return view(); }

  const extents_type& shape() const { return shape_; }
  index_t extent(int i) const { return shape_[i]; }
  index_t size() const { return static_cast<index_t>(data_.size()); }
  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  std::vector<T>& storage() { return data_; }
  const std::vector<T>& storage() const { return data_; }

  template <class... I>
  T& operator()(I... idx) {
    return data_[view().offset(idx...)];
  }
  template <class... I>
  const T& operator()(I... idx) const {
    return data_[view().offset(idx...)];
  }

  void fill(T value) { std::fill(data_.begin(), data_.end(), value); }

 private:
  extents_type shape_{};
  std::vector<T> data_;
};

}  // namespace attnmix
