#pragma once
// The runtime-to-compile-time switches of the CUDA backend, in one place: a plan picks numbers
// (head dims, chunk counts, tile counts) at run time; the launchers turn them into template
// arguments here. Only the listed values are instantiated, so a list is also the set of kernels
// a launcher compiles. (The element type is a compile-time parameter throughout: device_t in
// arch/types.cuh maps attnmix's scalars to CUDA's.)

#include <type_traits>
#include <utility>

#include "attnmix/config.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

template <int V>
using int_constant = std::integral_constant<int, V>;

// Calls f(int_constant<V>{}) for the V of Values that equals v; false when none does.
template <int... Values, class F>
bool with_value(index_t v, F&& f) {
  return ((v == Values ? (f(int_constant<Values>{}), true) : false) || ...);
}

namespace dispatch_detail {
template <int D, int... Dvs, class F>
bool with_value_dim(index_t dv, F& f) {
  return ((dv == Dvs ? (f(int_constant<D>{}, int_constant<Dvs>{}), true) : false) || ...);
}
}  // namespace dispatch_detail

// Calls f(int_constant<D>{}, int_constant<Dv>{}) for the pair of Dims x Dims that equals
// (d, dv); false when none does. The tensor-core kernels take D, Dv in {64, 128}.
template <int... Dims, class F>
bool with_head_dims(index_t d, index_t dv, F&& f) {
  return ((d == Dims && dispatch_detail::with_value_dim<Dims, Dims...>(dv, f)) || ...);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
