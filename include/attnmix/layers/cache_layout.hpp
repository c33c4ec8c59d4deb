#pragma once
// What a decoding cache was made for (heads, dims, conv widths, ...), so that a layer can check
// a cache before it writes anything to it, and the checks of cache sizes.

#include <array>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <new>
#include <string>

#include "attnmix/core/error.hpp"
#include "attnmix/core/memory_space.hpp"
#include "attnmix/core/tensor_view.hpp"
#include "attnmix/core/validate.hpp"

namespace attnmix {
namespace layers {

// A cache's sizes by name, in the order its layer lists them (at most 8).
class cache_layout {
 public:
  struct dim {
    const char* name = "";
    index_t value = 0;
  };
  cache_layout() = default;
  cache_layout(std::initializer_list<dim> dims) {
    for (const dim& d : dims) add(d.name, d.value);
  }
  // Appends one size (name: a static string).
  cache_layout& add(const char* name, index_t value) {
    if (size_ < dims_.size()) dims_[size_++] = {name, value};
    return *this;
  }
  std::size_t size() const { return size_; }
  const dim& operator[](std::size_t i) const { return dims_[i]; }

 private:
  std::array<dim, 8> dims_{};
  std::size_t size_ = 0;
};

namespace detail {

// Throws attnmix::error("<fn>: argument '<arg>' <what> was made for <name> = <have> but ... has
// <name> = <want>") unless the layouts agree.
inline void check_cache_layout(const std::string& fn, const char* arg, const std::string& what,
                               const cache_layout& have, const cache_layout& want) {
  attnmix::detail::require(have.size() == want.size(), fn, arg, what,
                           " does not have the layout of this layer's cache");
  for (std::size_t i = 0; i < want.size(); ++i)
    attnmix::detail::require(have[i].value == want[i].value, fn, arg, what, " was made for ",
                             want[i].name, " = ", have[i].value, " but the layer has ",
                             want[i].name, " = ", want[i].value);
}

// sequences, capacity >= 0, and the cache's bytes (bytes_per_token for each token a sequence
// holds, plus bytes_per_sequence) within the index type: absurd sizes are an attnmix::error,
// not a signed overflow. The cache must also fit its memory space (the machine's memory, the
// device's): more is a bad capacity, not an allocation failure.
template <class Space>
void check_cache_size(const std::string& fn, index_t sequences, index_t capacity,
                      index_t bytes_per_token, index_t bytes_per_sequence = 0) {
  attnmix::detail::require(sequences >= 0, fn, "sequences", "must be >= 0 but is ", sequences);
  attnmix::detail::require(capacity >= 0, fn, "capacity", "must be >= 0 but is ", capacity);
  const index_t max = std::numeric_limits<index_t>::max() / 2;
  const index_t tok = bytes_per_token > 0 ? bytes_per_token : 1;
  bool fits = capacity <= (max - bytes_per_sequence) / tok;
  if (fits && sequences > 0) fits = capacity * tok + bytes_per_sequence <= max / sequences;
  attnmix::detail::require(fits, fn, "capacity", "of ", capacity, " tokens for ", sequences,
                           " sequences (", bytes_per_token, " bytes a token, ", bytes_per_sequence,
                           " a sequence) exceeds the addressable size");
  attnmix::detail::check_fits_space<Space>(
      fn, "capacity", static_cast<std::size_t>(sequences * (capacity * tok + bytes_per_sequence)),
      "of ", capacity, " tokens for ", sequences, " sequences");
}

// make(), with an allocation that fails (std::bad_alloc) reported as attnmix::error naming the
// capacity: a cache too large for the machine is a bad argument, not a crash.
template <class Make>
auto allocate_cache(const std::string& fn, index_t sequences, index_t capacity, Make&& make)
    -> decltype(make()) {
  try {
    return make();
  } catch (const std::bad_alloc&) {
    attnmix::detail::fail(fn, "capacity", "of ", capacity, " tokens for ", sequences,
                          " sequences needs more memory than could be allocated");
  }
}

}  // namespace detail
}  // namespace layers
}  // namespace attnmix
