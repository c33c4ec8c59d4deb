#pragma once
// The public entry points every mixer layer shares, on [B, T, D] views. A mixer implements the
// row-buffer operations
//   forward_rows(ctx, x, y)                        the whole batch (ctx.layout), no cache
//   prefill_rows(ctx, x, y, cache, slots)          causal mixers: also fills the cache
//   decode_rows(ctx, x, y, cache, slots)           causal mixers: one token per sequence
//                                                  (ctx: N rows of one token; positions unread)
//   check_cache(fn, arg, what, cache)              causal mixers: the cache fits the layer
// (ctx: layers::context<Backend>; slots: std::vector<index_t>, the checked cache slot of each
// sequence) and mixer_api turns them into checked calls on views in the backend's memory.

#include <cstdint>
#include <string>
#include <vector>

#include "attnmix/attention/path_cache.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace layers {

namespace detail {

// What attnmix::detail::resolve_slots needs of a cache: its slot count.
struct slot_count {
  index_t n;
  index_t slots() const { return n; }
};

// The cache slot of each of `rows` sequences of a prefill on a cache of `sequences` slots:
// slots[n] (in range, distinct, one per sequence), or n when no mapping is given.
// Throws attnmix::error naming 'slots' or 'cache'.
inline std::vector<index_t> prefill_slots(const std::string& fn,
                                          const view1<const std::int32_t>& slots, index_t rows,
                                          index_t sequences) {
  if (slots.has_value())
    return attnmix::detail::resolve_slots(fn, slots, rows, slot_count{sequences});
  attnmix::detail::require(rows <= sequences, fn, "cache", "holds ", sequences,
                           " sequences but the batch has ", rows);
  std::vector<index_t> out(static_cast<std::size_t>(rows));
  for (index_t n = 0; n < rows; ++n) out[static_cast<std::size_t>(n)] = n;
  return out;
}

// The same for a decoding step of x [N, 1, D]: without a mapping, N must be the cache's
// sequence count (every sequence advances); with one, N = its length and only those slots
// advance. Each slot must have room for one more token.
template <class X, class Cache>
std::vector<index_t> decode_slots(const std::string& fn, const view1<const std::int32_t>& slots,
                                  const X& x, const Cache& cache) {
  if (slots.has_value()) {
    attnmix::detail::require(x.extent(1) == 1, fn, "x",
                             "must be [N, 1, D] (one token per sequence) but has shape ",
                             attnmix::detail::shape_of(x));
  } else {
    attnmix::detail::require(x.extent(1) == 1 && x.extent(0) == cache.sequences(), fn, "x",
                             "must be [N, 1, D] with N = ", cache.sequences(),
                             " (the cache's sequences) but has shape ",
                             attnmix::detail::shape_of(x));
  }
  std::vector<index_t> where = prefill_slots(fn, slots, x.extent(0), cache.sequences());
  for (index_t n = 0; n < x.extent(0); ++n) {
    const index_t s = where[static_cast<std::size_t>(n)];
    if (slots.has_value())
      attnmix::detail::require(cache.length(s) < cache.capacity(), fn, "cache", "slot ", s,
                               " is full (capacity ", cache.capacity(), ")");
    else
      attnmix::detail::require(cache.length(s) < cache.capacity(), fn, "cache", "sequence ", s,
                               " is full (capacity ", cache.capacity(), ")");
  }
  return where;
}

// Whether slots[n] == n for every n: the caches can then be written in place.
inline bool identity_slots(const std::vector<index_t>& slots) {
  for (std::size_t n = 0; n < slots.size(); ++n)
    if (slots[n] != static_cast<index_t>(n)) return false;
  return true;
}

}  // namespace detail

template <class Derived, class T, class Backend = backend::cpu>
class mixer_api {
  using O = ops<Backend>;

 public:
  // out[b, t, :] = mixer(x)[b, t, :]. x, out: [B, T, D] contiguous, distinct, in the backend's
  // memory; cu_seqlens (host): packed batch (B == 1), sequences never see each other. Throws
  // attnmix::error on bad arguments.
  void forward(const view3<const T>& x, const view3<T>& out,
               const view1<const std::int32_t>& cu_seqlens = {},
               const Backend& be = Backend{}) const {
    const std::string fn = std::string("attnmix::layers::") + Derived::name + "::forward";
    const token_layout L = check(fn, x, out, cu_seqlens);
    with_context(L, be,
                 [&](const context<Backend>& c) { self().forward_rows(c, x.data(), out.data()); });
  }

  // Training: the same forward, also keeping in `saved` what backward() reads.
  template <class Self = Derived>
  void forward(const view3<const T>& x, const view3<T>& out, typename Self::saved_type& saved,
               const view1<const std::int32_t>& cu_seqlens = {},
               const Backend& be = Backend{}) const {
    const std::string fn = std::string("attnmix::layers::") + Derived::name + "::forward";
    const token_layout L = check(fn, x, out, cu_seqlens);
    with_context(L, be, [&](const context<Backend>& c) {
      self().forward_rows(c, x.data(), out.data(), &saved);
    });
  }

  // Training: from the forward's input x and `saved` (forward(x, out, saved, ...) with the same
  // cu_seqlens) and dout = dL/d(out), writes dL/dx into dx and adds every parameter's gradient
  // to its .grad. Throws attnmix::error on bad arguments.
  template <class Self = Derived>
  void backward(const view3<const T>& x, const view3<const T>& dout, const view3<T>& dx,
                const typename Self::saved_type& saved,
                const view1<const std::int32_t>& cu_seqlens = {}, const Backend& be = Backend{}) {
    const std::string fn = std::string("attnmix::layers::") + Derived::name + "::backward";
    const index_t D = self().hidden_size();
    detail::check_activation(fn, "x", x, D, space_of_v<Backend>, Backend::name);
    detail::check_activation(fn, "dout", dout, D, space_of_v<Backend>, Backend::name);
    detail::check_activation(fn, "dx", dx, D, space_of_v<Backend>, Backend::name);
    detail::check_same_shape(fn, dout, x, "dout");
    detail::check_same_shape(fn, dx, x, "dx");
    attnmix::detail::check_no_alias(fn, "dx", dx, "x", x);
    attnmix::detail::check_no_alias(fn, "dx", dx, "dout", dout);
    O::check_memory(fn, "x", x);
    O::check_memory(fn, "dout", dout);
    O::check_memory(fn, "dx", dx);
    const token_layout L = detail::make_layout(fn, x, cu_seqlens);
    with_context(L, be, [&](const context<Backend>& c) {
      derived().backward_rows(c, x.data(), dout.data(), dx.data(), saved);
    });
  }

  // Causal mixers: the forward over a batch of prompts that also (re)fills `cache` (sequence n
  // -> slot n, or slot slots[n] with a mapping; each such slot's previous content is replaced,
  // the other slots are left as they are).
  template <class Cache>
  void prefill(const view3<const T>& x, const view3<T>& out, Cache& cache,
               const view1<const std::int32_t>& cu_seqlens = {},
               const Backend& be = Backend{}) const {
    prefill_impl(x, out, cache, {}, cu_seqlens, be);
  }
  template <class Cache>
  void prefill(const view3<const T>& x, const view3<T>& out, Cache& cache, const cache_slots& slots,
               const view1<const std::int32_t>& cu_seqlens = {},
               const Backend& be = Backend{}) const {
    prefill_impl(x, out, cache, slots.slots, cu_seqlens, be);
  }

  // Causal mixers: one new token for each of the N sequences of `cache` (x, out: [N, 1, D]),
  // or, with a mapping, for the sequences in slots slots[0..N) (row n -> slot slots[n]).
  template <class Cache>
  void decode(const view3<const T>& x, const view3<T>& out, Cache& cache,
              const Backend& be = Backend{}) const {
    decode_impl(x, out, cache, {}, be);
  }
  template <class Cache>
  void decode(const view3<const T>& x, const view3<T>& out, Cache& cache, const cache_slots& slots,
              const Backend& be = Backend{}) const {
    decode_impl(x, out, cache, slots.slots, be);
  }

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
  Derived& derived() { return static_cast<Derived&>(*this); }

  // Calls f with the context of one call on L: the rows' positions in the backend's memory.
  template <class F>
  static void with_context(const token_layout& L, const Backend& be, F&& f) {
    const typename O::handles handles{};
    typename O::scratch s(be, scratch_bytes<std::int32_t>(L.rows()));
    std::int32_t* pos = s.template take<std::int32_t>(L.rows());
    O::positions(be, pos, L);
    f(context<Backend>{be, L, pos, handles});
  }

  template <class Cache>
  void prefill_impl(const view3<const T>& x, const view3<T>& out, Cache& cache,
                    const view1<const std::int32_t>& slots,
                    const view1<const std::int32_t>& cu_seqlens, const Backend& be) const {
    const std::string fn = std::string("attnmix::layers::") + Derived::name + "::prefill";
    const token_layout L = check(fn, x, out, cu_seqlens);
    self().check_cache(fn, "cache", "the cache", cache);
    const std::vector<index_t> where =
        detail::prefill_slots(fn, slots, L.num_sequences(), cache.sequences());
    for (index_t n = 0; n < L.num_sequences(); ++n)
      attnmix::detail::require(L.seq(n).length <= cache.capacity(), fn, "cache", "has capacity ",
                               cache.capacity(), " but sequence ", n, " has ", L.seq(n).length,
                               " tokens");
    with_context(L, be, [&](const context<Backend>& c) {
      self().prefill_rows(c, x.data(), out.data(), cache, where);
    });
  }

  template <class Cache>
  void decode_impl(const view3<const T>& x, const view3<T>& out, Cache& cache,
                   const view1<const std::int32_t>& slots, const Backend& be) const {
    const std::string fn = std::string("attnmix::layers::") + Derived::name + "::decode";
    check(fn, x, out, {});
    self().check_cache(fn, "cache", "the cache", cache);
    const std::vector<index_t> where = detail::decode_slots(fn, slots, x, cache);
    const token_layout L{x.extent(0), 1, {}};
    const typename O::handles handles{};
    self().decode_rows(context<Backend>{be, L, nullptr, handles}, x.data(), out.data(), cache,
                       where);
  }

  token_layout check(const std::string& fn, const view3<const T>& x, const view3<T>& out,
                     const view1<const std::int32_t>& cu) const {
    const index_t D = self().hidden_size();
    detail::check_activation(fn, "x", x, D, space_of_v<Backend>, Backend::name);
    detail::check_activation(fn, "out", out, D, space_of_v<Backend>, Backend::name);
    detail::check_same_shape(fn, out, x);
    attnmix::detail::check_no_alias(fn, "out", out, "x", x);
    O::check_memory(fn, "x", x);
    O::check_memory(fn, "out", out);
    return detail::make_layout(fn, x, cu);
  }
};

}  // namespace layers
}  // namespace attnmix
