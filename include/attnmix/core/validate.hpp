#pragma once
// Argument checks shared by the front doors. Each throws attnmix::error naming the function,
// the argument and the sizes involved; none touches the data behind a view except
// check_offsets, which reads the (host) offsets it validates.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attnmix/core/error.hpp"
#include "attnmix/core/memory_space.hpp"
#include "attnmix/core/tensor_view.hpp"

namespace attnmix {
namespace detail {

template <class>
inline constexpr bool dependent_false_space = false;

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

// Whether a view of non-negative extents can be addressed: its element count and the bytes from
// its first to its last element (over its non-negative strides) fit in index_t. A hostile shape
// can multiply past 2^63, and every later size() and offset must not overflow.
inline bool addressable(const index_t* shape, const index_t* stride, int rank,
                        std::size_t element_bytes) {
  for (int i = 0; i < rank; ++i)
    if (shape[i] == 0) return true;  // empty: nothing is addressed
  const auto bytes = static_cast<index_t>(element_bytes);
  index_t count = 1, last = 0, step = 0, total = 0;
  for (int i = 0; i < rank; ++i) {
    if (__builtin_mul_overflow(count, shape[i], &count)) return false;
    if (stride[i] < 0) continue;  // reported as a negative stride
    if (__builtin_mul_overflow(shape[i] - 1, stride[i], &step) ||
        __builtin_add_overflow(last, step, &last))
      return false;
  }
  return !__builtin_mul_overflow(count, bytes, &total) &&
         !__builtin_add_overflow(last, index_t{1}, &last) &&
         !__builtin_mul_overflow(last, bytes, &total);
}

// Non-negative strides, a unit stride on the innermost dimension and a pointer when non-empty.
template <class T, int R>
void check_layout(const std::string& fn, const char* arg, const tensor_view<T, R>& v) {
  // Extents first: a negative extent makes the default (contiguous) strides negative too.
  for (int i = 0; i < R; ++i)
    require(v.extent(i) >= 0, fn, arg, "has a negative extent in dimension ", i, ": shape ",
            shape_of(v));
  require(addressable(v.shape().data(), v.strides().data(), R, sizeof(T)), fn, arg, "has shape ",
          shape_of(v), " whose elements are too many to address");
  for (int i = 0; i < R; ++i)
    require(v.stride(i) >= 0, fn, arg, "has a negative stride ", v.stride(i), " in dimension ", i);
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

// ---- Validation as loops ---------------------------------------------------------------------
// A front door lists its tensors once, as tensor_args (name, role, presence, memory space and,
// once the sizes are known, the expected shape), and runs the loops below over the list:
//   check_presence -> check_placement (layout, space) -> [the door resolves its sizes and sets
//   each entry's expected shape] -> check_shapes -> check_outputs (self-overlap, aliasing)
//   -> check_pointers<Space> (what the memory space's runtime can verify, e.g. CUDA pointers).

enum class arg_role { input, output };
enum class arg_presence { optional, required, forbidden };

// One tensor argument of a front door, its type erased for the loops (rank <= 4).
struct tensor_arg {
  static constexpr int max_rank = 4;
  const char* name = "";
  arg_role role = arg_role::input;
  arg_presence presence = arg_presence::optional;
  const char* why = "";  // completes "is required ..." / "was given but ..."
  bool given = false;
  const void* data = nullptr;
  std::size_t element_bytes = 0;
  memory_space space = memory_space::host;
  int rank = 0;
  std::array<index_t, max_rank> shape{}, stride{};
  // Where it must live, and who needs it there (for the message): the backend's space by default.
  memory_space required_space = memory_space::host;
  const char* space_user = "";
  // An output flagged in_place may be the very same view as an input flagged in_place (a state
  // updated in place); any other overlap with an input is an error.
  bool in_place = false;
  // The expected shape, set once the sizes are resolved; dims names it, e.g. "[B, T, HQ, D]".
  bool has_expected = false;
  std::array<index_t, max_rank> expected{};
  const char* dims = "";

  index_t size() const {
    index_t n = 1;
    for (int i = 0; i < rank; ++i) n *= shape[static_cast<std::size_t>(i)];
    return n;
  }
  // Sets the expected shape.
  template <class... I>
  tensor_arg& expect(const char* dims_name, I... extents) {
    static_assert(sizeof...(I) <= max_rank, "attnmix: tensor_arg has rank <= 4");
    has_expected = true;
    expected = {static_cast<index_t>(extents)...};
    dims = dims_name;
    return *this;
  }
};

template <class T, int R>
tensor_arg make_arg(const char* name, const tensor_view<T, R>& v, arg_role role,
                    arg_presence presence = arg_presence::optional, const char* why = "") {
  static_assert(R <= tensor_arg::max_rank, "attnmix: tensor_arg has rank <= 4");
  tensor_arg a;
  a.name = name;
  a.role = role;
  a.presence = presence;
  a.why = why;
  a.given = v.has_value();
  a.data = v.data();
  a.element_bytes = sizeof(T);
  a.space = v.space();
  a.rank = R;
  for (int i = 0; i < R; ++i) {
    a.shape[static_cast<std::size_t>(i)] = v.extent(i);
    a.stride[static_cast<std::size_t>(i)] = v.stride(i);
  }
  return a;
}
template <class T, int R>
tensor_arg input(const char* name, const tensor_view<T, R>& v,
                 arg_presence presence = arg_presence::optional, const char* why = "") {
  return make_arg(name, v, arg_role::input, presence, why);
}
template <class T, int R>
tensor_arg output(const char* name, const tensor_view<T, R>& v,
                  arg_presence presence = arg_presence::optional, const char* why = "") {
  return make_arg(name, v, arg_role::output, presence, why);
}
// Host-side metadata (offsets, slots) that the front door reads itself.
template <class T, int R>
tensor_arg host_input(const char* name, const tensor_view<T, R>& v, const char* user) {
  tensor_arg a = make_arg(name, v, arg_role::input);
  a.required_space = memory_space::host;
  a.space_user = user;
  return a;
}

using arg_list = std::vector<tensor_arg>;

inline std::string shape_string(const index_t* extents, int rank) {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(extents[i]);
  return s + "]";
}

// An entry's shape for an error message, formatted only when the message is built (as
// shape_of for views: require's arguments are evaluated on every call).
struct lazy_extents {
  const index_t* extents;
  int rank;
};
inline std::ostream& operator<<(std::ostream& os, const lazy_extents& s) {
  return os << shape_string(s.extents, s.rank);
}
inline lazy_extents shape_of(const tensor_arg& a) {
  return {a.shape.data(), a.rank};
}

inline tensor_arg* find_arg(arg_list& args, const char* name) {
  for (auto& a : args)
    if (std::strcmp(a.name, name) == 0) return &a;
  return nullptr;
}

// Required entries are given, forbidden ones are not.
inline void check_presence(const std::string& fn, const arg_list& args) {
  for (const auto& a : args) {
    if (a.presence == arg_presence::required)
      require(a.given, fn, a.name, *a.why ? a.why : "is required", " but was not given");
    if (a.presence == arg_presence::forbidden)
      require(!a.given, fn, a.name, "was given but ", a.why);
  }
}

// Every given entry: extents and strides non-negative, a pointer when non-empty, a unit innermost
// stride, and the memory space it must live in. Entries whose required_space was not set get
// `space` (the backend's), named by `backend`.
inline void check_placement(const std::string& fn, arg_list& args, memory_space space,
                            const char* backend) {
  for (auto& a : args) {
    if (*a.space_user == '\0') a.required_space = space, a.space_user = backend;
    if (!a.given) continue;
    for (int i = 0; i < a.rank; ++i)
      require(a.shape[static_cast<std::size_t>(i)] >= 0, fn, a.name,
              "has a negative extent in dimension ", i, ": shape ", shape_of(a));
    require(addressable(a.shape.data(), a.stride.data(), a.rank, a.element_bytes), fn, a.name,
            "has shape ", shape_of(a), " whose elements are too many to address");
    for (int i = 0; i < a.rank; ++i)
      require(a.stride[static_cast<std::size_t>(i)] >= 0, fn, a.name, "has a negative stride ",
              a.stride[static_cast<std::size_t>(i)], " in dimension ", i);
    if (a.size() > 0) {
      require(a.data != nullptr, fn, a.name, "has shape ", shape_of(a), " but a null pointer");
      const auto last = static_cast<std::size_t>(a.rank - 1);
      require(a.shape[last] == 1 || a.stride[last] == 1, fn, a.name,
              "must be contiguous in its last dimension but has stride ", a.stride[last]);
    }
    require(a.space == a.required_space, fn, a.name, "is in ", to_string(a.space),
            " memory but the ", a.space_user, " backend needs ", to_string(a.required_space),
            " memory");
  }
}

// Every given entry with an expected shape has it.
inline void check_shapes(const std::string& fn, const arg_list& args) {
  for (const auto& a : args) {
    if (!a.given || !a.has_expected) continue;
    bool same = true;
    for (int i = 0; i < a.rank; ++i)
      same =
          same && a.shape[static_cast<std::size_t>(i)] == a.expected[static_cast<std::size_t>(i)];
    if (!same)
      fail(fn, a.name, "has shape ", shape_string(a.shape.data(), a.rank), " but must be ", a.dims,
           " = ", shape_string(a.expected.data(), a.rank));
  }
}

// [first, last] byte range of a given, non-empty entry.
inline std::pair<std::uintptr_t, std::uintptr_t> byte_range(const tensor_arg& a) {
  index_t last = 0;
  for (int i = 0; i < a.rank; ++i)
    last += (a.shape[static_cast<std::size_t>(i)] - 1) * a.stride[static_cast<std::size_t>(i)];
  const auto first = reinterpret_cast<std::uintptr_t>(a.data);
  return {first, first + static_cast<std::uintptr_t>(last + 1) * a.element_bytes - 1};
}

inline bool same_view(const tensor_arg& x, const tensor_arg& y) {
  return x.rank == y.rank && x.data == y.data && x.element_bytes == y.element_bytes &&
         x.shape == y.shape && x.stride == y.stride;
}

// Outputs: distinct indices address distinct elements, and no output shares memory with any
// input or with an output listed before it (the message names the later one), except an
// in-place output that is the very same view as an in-place input.
inline void check_outputs(const std::string& fn, const arg_list& args) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    const tensor_arg& o = args[i];
    if (o.role != arg_role::output || !o.given || o.size() == 0) continue;
    // (stride, extent) of the dims with extent > 1, by stride
    std::array<std::pair<index_t, index_t>, tensor_arg::max_rank> dims{};
    std::size_t n = 0;
    for (int d = 0; d < o.rank; ++d)
      if (o.shape[static_cast<std::size_t>(d)] > 1)
        dims[n++] = {o.stride[static_cast<std::size_t>(d)], o.shape[static_cast<std::size_t>(d)]};
    for (std::size_t a = 1; a < n; ++a)  // insertion sort of at most four
      for (std::size_t b = a; b > 0 && dims[b] < dims[b - 1]; --b) std::swap(dims[b], dims[b - 1]);
    index_t span = 1;
    for (std::size_t d = 0; d < n; ++d) {
      const auto [stride, extent] = dims[d];
      require(stride >= span, fn, o.name, "has strides that make elements overlap (shape ",
              shape_of(o), ")");
      span = stride * (extent - 1) + span;
    }
    const auto r = byte_range(o);
    for (std::size_t j = 0; j < args.size(); ++j) {
      const tensor_arg& x = args[j];
      if (j == i || !x.given || x.size() == 0) continue;
      if (x.role == arg_role::output && j > i) continue;  // checked from x's side
      if (x.role == arg_role::input && o.in_place && x.in_place && same_view(o, x)) continue;
      const auto s = byte_range(x);
      require(r.second < s.first || s.second < r.first, fn, o.name, "overlaps the memory of '",
              x.name, "'");
    }
  }
}

// What a memory space's runtime can verify of the pointers themselves, beyond what the views
// claim. The host has nothing to ask; cuda/runtime/pointer_check.cuh specialises device_space
// (cudaPointerGetAttributes), and a new memory space specialises it too.
template <class Space>
struct pointer_check {
  static_assert(dependent_false_space<Space>,
                "attnmix: no pointer check for this memory space; for device_space include "
                "<attnmix/cuda.cuh> in a translation unit compiled by nvcc");
};
template <>
struct pointer_check<host_space> {
  static void run(const std::string&, const arg_list&) {}
};

// ---- Packed batches: the one resolver every family uses -----------------------------------------

// The sequences of a dense batch of `batch` rows (no offsets) or of a packed one: cu_seqlens
// (host memory) needs B == 1 (named by `batch_arg`) and [N+1] offsets, 0 first, non-decreasing,
// `tokens` last. Returns the offsets (nullptr when dense) and the number of sequences.
struct packed_batch {
  const std::int32_t* cu_seqlens;
  index_t sequences;
};
inline packed_batch resolve_packed_batch(const std::string& fn,
                                         const tensor_view<const std::int32_t, 1>& cu_seqlens,
                                         index_t batch, index_t tokens, const char* batch_arg) {
  if (!cu_seqlens.has_value()) return {nullptr, batch};
  check_space(fn, "cu_seqlens", cu_seqlens, memory_space::host, "offset validation");
  require(batch == 1, fn, batch_arg,
          "must have B = 1 when cu_seqlens is given but has B = ", batch);
  check_offsets(fn, "cu_seqlens", cu_seqlens, tokens);
  return {cu_seqlens.data(), cu_seqlens.extent(0) - 1};
}

// ---- Sizes -------------------------------------------------------------------------------------

// Storage of `bytes` in Space's memory (space_bytes<Space>): more than the space holds is a bad
// size named by `arg` ("<what> needs about N bytes, more than the M bytes of this machine's
// memory"), rejected before it is allocated, not an allocation failure.
template <class Space, class... What>
void check_fits_space(const std::string& fn, const char* arg, std::size_t bytes, What&&... what) {
  const std::size_t limit = space_bytes<Space>::get();
  require(bytes <= limit, fn, arg, std::forward<What>(what)..., " needs about ", bytes,
          " bytes, more than the ", limit,
          Space::value == memory_space::host ? " bytes of this machine's memory"
                                             : " bytes of the device's memory");
}

// a * b, or false when it leaves [0, max]. a, b >= 0.
inline bool checked_mul(index_t a, index_t b, index_t& out,
                        index_t max = std::numeric_limits<index_t>::max()) {
  if (a != 0 && b > max / a) return false;
  out = a * b;
  return true;
}

}  // namespace detail
}  // namespace attnmix
