#pragma once
// The public entry points every mixer layer shares, on [B, T, D] views. A mixer implements the
// row-buffer operations
//   forward_rows(x, y, layout, be)                  the whole batch, no cache
//   prefill_rows(x, y, layout, cache, be)           causal mixers: also fills the cache
//   decode_rows(x, y, N, cache, be)                 causal mixers: one token per sequence
// and mixer_api turns them into checked calls on views.

#include <cstdint>
#include <string>

#include "attnmix/layers/common.hpp"

namespace attnmix {
namespace layers {

template <class Derived, class T>
class mixer_api {
 public:
  // out[b, t, :] = mixer(x)[b, t, :]. x, out: [B, T, D] contiguous, distinct; cu_seqlens: packed
  // batch (B == 1), sequences never see each other. Throws attnmix::error on bad arguments.
  void forward(const view3<const T>& x, const view3<T>& out,
               const view1<const std::int32_t>& cu_seqlens = {},
               const backend::cpu& be = backend::cpu{}) const {
    const std::string fn = std::string("attnmix::layers::") + Derived::name + "::forward";
    const token_layout L = check(fn, x, out, cu_seqlens);
    self().forward_rows(x.data(), out.data(), L, be);
  }

  // Causal mixers: the forward over a batch of prompts that also (re)fills `cache` (one slot
  // per sequence, in order; each slot's previous content is replaced).
  template <class Cache>
  void prefill(const view3<const T>& x, const view3<T>& out, Cache& cache,
               const view1<const std::int32_t>& cu_seqlens = {},
               const backend::cpu& be = backend::cpu{}) const {
    const std::string fn = std::string("attnmix::layers::") + Derived::name + "::prefill";
    const token_layout L = check(fn, x, out, cu_seqlens);
    attnmix::detail::require(L.num_sequences() <= cache.sequences(), fn, "cache", "holds ",
                             cache.sequences(), " sequences but the batch has ", L.num_sequences());
    for (index_t n = 0; n < L.num_sequences(); ++n)
      attnmix::detail::require(L.seq(n).length <= cache.capacity(), fn, "cache", "has capacity ",
                               cache.capacity(), " but sequence ", n, " has ", L.seq(n).length,
                               " tokens");
    self().prefill_rows(x.data(), out.data(), L, cache, be);
  }

  // Causal mixers: one new token for each of the N sequences of `cache`. x, out: [N, 1, D].
  template <class Cache>
  void decode(const view3<const T>& x, const view3<T>& out, Cache& cache,
              const backend::cpu& be = backend::cpu{}) const {
    const std::string fn = std::string("attnmix::layers::") + Derived::name + "::decode";
    check(fn, x, out, {});
    attnmix::detail::require(x.extent(1) == 1 && x.extent(0) == cache.sequences(), fn, "x",
                             "must be [N, 1, D] with N = ", cache.sequences(),
                             " (the cache's sequences) but has shape ", attnmix::shape_string(x));
    for (index_t n = 0; n < cache.sequences(); ++n)
      attnmix::detail::require(cache.length(n) < cache.capacity(), fn, "cache", "sequence ", n,
                               " is full (capacity ", cache.capacity(), ")");
    self().decode_rows(x.data(), out.data(), x.extent(0), cache, be);
  }

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }

  token_layout check(const std::string& fn, const view3<const T>& x, const view3<T>& out,
                     const view1<const std::int32_t>& cu) const {
    const index_t D = self().hidden_size();
    detail::check_activation(fn, "x", x, D);
    detail::check_activation(fn, "out", out, D);
    detail::check_same_shape(fn, out, x);
    attnmix::detail::check_no_alias(fn, "out", out, "x", x);
    return detail::make_layout(fn, x, cu);
  }
};

}  // namespace layers
}  // namespace attnmix
