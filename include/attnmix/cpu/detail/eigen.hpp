#pragma once
// The one place that includes Eigen, with the nvcc diagnostics Eigen 3.4 triggers silenced.
// Eigen types stay inside attnmix/cpu.

#if defined(__NVCC__)
#pragma nv_diag_suppress 20012
#endif
#include <Eigen/Dense>
#if defined(__NVCC__)
#pragma nv_diag_default 20012
#endif

#include <type_traits>

#include "attnmix/config.hpp"

namespace attnmix {
namespace detail {
namespace cpu {

// Every CPU implementation computes in its input type; one check with one message for all.
template <class T>
constexpr void require_cpu_scalar() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "attnmix: the CPU backend computes in float or double; convert half/bfloat16 "
                "inputs first (attnmix::convert)");
}

template <class T>
using matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using column = Eigen::Array<T, Eigen::Dynamic, 1>;

// Row-major rows x cols block with `row_stride` elements between rows.
template <class T>
using const_rows = Eigen::Map<const matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using mutable_rows = Eigen::Map<matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

template <class T>
const_rows<T> rows_of(const T* p, index_t rows, index_t cols, index_t row_stride) {
  return const_rows<T>(p, rows, cols, Eigen::OuterStride<>(row_stride));
}
template <class T>
mutable_rows<T> rows_of(T* p, index_t rows, index_t cols, index_t row_stride) {
  return mutable_rows<T>(p, rows, cols, Eigen::OuterStride<>(row_stride));
}

}  // namespace cpu
}  // namespace detail
}  // namespace attnmix
