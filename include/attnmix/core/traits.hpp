#pragma once
// Compile-time facts about kinds and backends.

#include <type_traits>

#include "attnmix/core/tags.hpp"

namespace attnmix {

// true once the header implementing (Kind, Backend) has been included: cpu/<kind>.hpp or
// cuda/<kind>.cuh specialise it. Tests skip and stacks static_assert on it.
template <class Kind, class Backend>
struct is_implemented : std::false_type {};
template <class Kind, class Backend>
inline constexpr bool is_implemented_v = is_implemented<Kind, Backend>::value;

// true where the forward of (Kind, Backend) takes keys of other lengths than the queries
// (attention_params::cu_seqlens_k, key_lengths and key_slots, or k with another T than q): a
// block of queries against a longer key sequence or a cache's slots. The front door rejects
// such a call elsewhere; the SA and FoX layers decode only where it holds.
template <class Kind, class Backend>
struct takes_key_lengths : std::false_type {};

// true where the backward of (Kind, Backend) takes keys of other lengths than the queries (k, v
// and g of another Tk, or packed with cu_seqlens_k): training cross-attention, or a block of
// queries against a longer prefix. Keys read from a cache (key_lengths, key_slots) are a forward
// matter: no backward takes them.
template <class Kind, class Backend>
struct takes_key_lengths_backward : std::false_type {};

// true once the backward of (Kind, Backend) is implemented (the same headers specialise it).
template <class Kind, class Backend>
struct is_backward_implemented : std::false_type {};
template <class Kind, class Backend>
inline constexpr bool is_backward_implemented_v = is_backward_implemented<Kind, Backend>::value;

// Which extra inputs a softmax-family kind reads.
template <class Kind>
struct kind_traits {
  static constexpr bool softmax_family = false;
  static constexpr bool uses_forget_gate = false;  // g: [B,T,HQ]
  static constexpr bool uses_householder = false;  // w: [B,T,H,D], beta: [B,T,H]
};
template <>
struct kind_traits<kind::softmax> {
  static constexpr bool softmax_family = true;
  static constexpr bool uses_forget_gate = false;
  static constexpr bool uses_householder = false;
};
template <>
struct kind_traits<kind::fox> {
  static constexpr bool softmax_family = true;
  static constexpr bool uses_forget_gate = true;
  static constexpr bool uses_householder = false;
};
template <>
struct kind_traits<kind::path> {
  static constexpr bool softmax_family = true;
  static constexpr bool uses_forget_gate = false;
  static constexpr bool uses_householder = true;
};
template <>
struct kind_traits<kind::path_fox> {
  static constexpr bool softmax_family = true;
  static constexpr bool uses_forget_gate = true;
  static constexpr bool uses_householder = true;
};

// A backend tag: has a `name` and a `memory_space` that is host_space or device_space.
template <class Backend, class = void>
struct is_backend : std::false_type {};
template <class Backend>
struct is_backend<Backend, std::void_t<typename Backend::memory_space, decltype(Backend::name)>>
    : std::bool_constant<std::is_same_v<typename Backend::memory_space, host_space> ||
                         std::is_same_v<typename Backend::memory_space, device_space>> {};
template <class Backend>
inline constexpr bool is_backend_v = is_backend<Backend>::value;

// The memory space a backend's kernels read and write (the enum a view records).
template <class Backend>
inline constexpr memory_space space_of_v = Backend::memory_space::value;

namespace detail {
// For static_asserts in primary templates that must only fire on instantiation.
template <class...>
inline constexpr bool dependent_false = false;
}  // namespace detail

}  // namespace attnmix
