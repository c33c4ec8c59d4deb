#pragma once
// Argument checks shared by the front doors. Each throws attnmix::error naming the function,
// the argument and the sizes involved; none touches the data behind a view except
// check_offsets, which reads the (host) offsets it validates.

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "attnmix/core/error.hpp"
#include "attnmix/core/tensor_view.hpp"

namespace attnmix {
namespace detail {

template <class T, int R>
void check_given(const std::string& fn, const char* arg, const tensor_view<T, R>& v,
                 const char* why = "is required") {
  require(v.has_value(), fn, arg, why, " but was not given");
}

template <class T, int R>
void check_not_given(const std::string& fn, const char* arg, const tensor_view<T, R>& v,
                     const char* why) {
  require(!v.has_value(), fn, arg, "was given but ", why);
}

// `dims` names the expected layout, e.g. "[B, T, HQ, D]".
template <class T, int R>
void check_shape(const std::string& fn, const char* arg, const tensor_view<T, R>& v,
                 const std::array<index_t, R>& expected, const char* dims) {
  if (v.shape() == expected) return;
  fail(fn, arg, "has shape ", shape_string(v), " but must be ", dims, " = ",
       shape_string(tensor_view<T, R>(nullptr, expected)));
}

template <class T, int R>
void check_space(const std::string& fn, const char* arg, const tensor_view<T, R>& v,
                 memory_space required, const char* backend) {
  require(v.space() == required, fn, arg, "is in ", to_string(v.space()), " memory but the ",
          backend, " backend needs ", to_string(required), " memory");
}

// Non-negative strides, a unit stride on the innermost dimension and a pointer when non-empty.
template <class T, int R>
void check_layout(const std::string& fn, const char* arg, const tensor_view<T, R>& v) {
  for (int i = 0; i < R; ++i) {
    require(v.extent(i) >= 0, fn, arg, "has a negative extent in dimension ", i, ": shape ",
            shape_of(v));
    require(v.stride(i) >= 0, fn, arg, "has a negative stride ", v.stride(i), " in dimension ", i);
  }
  if (v.size() == 0) return;
  require(v.data() != nullptr, fn, arg, "has shape ", shape_of(v), " but a null pointer");
  require(v.extent(R - 1) == 1 || v.stride(R - 1) == 1, fn, arg,
          "must be contiguous in its last dimension but has stride ", v.stride(R - 1));
}

// Distinct indices address distinct elements (outputs must satisfy this).
template <class T, int R>
void check_non_overlapping(const std::string& fn, const char* arg, const tensor_view<T, R>& v) {
  if (v.size() == 0) return;
  std::vector<std::pair<index_t, index_t>> dims;  // (stride, extent) of dims with extent > 1
  for (int i = 0; i < R; ++i)
    if (v.extent(i) > 1) dims.emplace_back(v.stride(i), v.extent(i));
  std::sort(dims.begin(), dims.end());
  index_t span = 1;
  for (auto [stride, extent] : dims) {
    require(stride >= span, fn, arg, "has strides that make elements overlap (shape ", shape_of(v),
            ")");
    span = stride * (extent - 1) + span;
  }
}

// [first, last] byte range a view touches.
template <class T, int R>
std::pair<std::uintptr_t, std::uintptr_t> byte_range(const tensor_view<T, R>& v) {
  index_t last = 0;
  for (int i = 0; i < R; ++i) last += (v.extent(i) - 1) * v.stride(i);
  const auto first = reinterpret_cast<std::uintptr_t>(v.data());
  return {first, first + static_cast<std::uintptr_t>(last + 1) * sizeof(T) - 1};
}

// An output must not share memory with an input it is computed from.
template <class T, int R, class U, int S>
void check_no_alias(const std::string& fn, const char* out_arg, const tensor_view<T, R>& out,
                    const char* in_arg, const tensor_view<U, S>& in) {
  if (!out.has_value() || !in.has_value() || out.size() == 0 || in.size() == 0) return;
  auto a = byte_range(out);
  auto b = byte_range(in);
  require(a.second < b.first || b.second < a.first, fn, out_arg, "overlaps the memory of '", in_arg,
          "'");
}

// Packed variable-length offsets: [N+1] entries, 0 first, non-decreasing, `total` last.
inline void check_offsets(const std::string& fn, const char* arg,
                          const tensor_view<const std::int32_t, 1>& cu, index_t total) {
  check_layout(fn, arg, cu);
  require(cu.extent(0) >= 1, fn, arg, "must hold N+1 >= 1 offsets but has ", cu.extent(0));
  require(cu(0) == 0, fn, arg, "must start at 0 but starts at ", cu(0));
  for (index_t n = 0; n + 1 < cu.extent(0); ++n)
    require(cu(n + 1) >= cu(n), fn, arg, "must be non-decreasing but entry ", n + 1, " (",
            cu(n + 1), ") < entry ", n, " (", cu(n), ")");
  const index_t last = cu(cu.extent(0) - 1);
  require(last == total, fn, arg, "ends at ", last, " but the packed length is ", total);
}

}  // namespace detail
}  // namespace attnmix
