#pragma once
// PaTH / PaTH-FoX inference: the prefill key cache, a decoding cache and the decoding step.
//
// PaTH scores a query against keys that have been carried through every later transition:
// the decoding cache holds, for a sequence whose last processed position is t-1,
//   kappa_j = H_{t-1} H_{t-2} ... H_{j+1} k_j           (j <= t-1; spec/path_fox.md §3)
// plus the raw values and the inclusive gate cumsum G_j. A new token t first moves every cached
// key through its own transition (kappa <- kappa - beta_t (w_t^T kappa) w_t), then is appended,
// then attends with its query like softmax attention (FoX) over the cache.
//
// Typical use (CPU; one slot per sequence served):
//   attnmix::path_cache<float> cache(/*slots*/ 8, /*capacity*/ 4096, HQ, H, D, Dv);
//   attnmix::path_prefill<attnmix::kind::path_fox>(cache, prompt_args, slots, params);
//   for (each generated token)   // step_args: q [N,1,HQ,D], k/w [N,1,H,D], v [N,1,H,Dv], ...
//     attnmix::path_decode_step<attnmix::kind::path_fox>(cache, step_args, slots, params);
// Include <attnmix/attnmix.hpp> (or attnmix/cpu/path.hpp) for the implementation.

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/attention/args.hpp"
#include "attnmix/attention/attention.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/core/traits.hpp"
#include "attnmix/core/validate.hpp"

namespace attnmix {

template <class T>
class path_cache;

namespace detail {

// Backend implementations of the operations below; cpu/path.hpp specialises it.
//   key_cache<Policy>(const path_key_cache_args<T>&, const attention_problem&, const Backend&)
//   prefill<Kind, Policy>(path_cache<T>&, const attention_args<T>&, const attention_problem&,
//                         const std::vector<index_t>& slots, const Backend&)
//   decode<Kind, Policy>(same arguments as prefill)
template <class Backend, class Enable = void>
struct path_cache_impl {
  static_assert(dependent_false<Backend>,
                "attnmix: no PaTH key cache / decoding for this backend. For backend::cpu include "
                "<attnmix/attnmix.hpp> (or attnmix/cpu/path.hpp).");
};

// Mutable access to a cache's storage for the implementations.
struct path_cache_access {
  template <class T>
  static T* keys(path_cache<T>& c) {
    return c.keys_.data();
  }
  template <class T>
  static T* values(path_cache<T>& c) {
    return c.values_.data();
  }
  template <class T>
  static double* gates(path_cache<T>& c) {
    return c.gates_.data();
  }
  template <class Cache>  // path_cache or device_path_cache
  static void set_length(Cache& c, index_t slot, index_t length) {
    c.set_length(slot, length);
  }
};

}  // namespace detail

// Arguments of path_prefill_key_cache. k, w and beta are those given to the forward.
template <class T>
struct path_key_cache_args {
  view4<const T> k{};              // [B, T, H, D]
  view4<const accum_t<T>> w{};     // [B, T, H, D]  Householder directions (unit length)
  view3<const accum_t<T>> beta{};  // [B, T, H]     Householder strengths in [0, 2]
  view4<T> key_cache{};            // output [B, T, H, D]
};

namespace detail {

// What every PaTH decoding cache has: its head layout and the number of tokens each slot holds
// (kept on the host). `name` prefixes error messages ("attnmix::path_cache").
class path_cache_base {
 public:
  index_t slots() const { return slots_; }
  index_t capacity() const { return capacity_; }
  index_t q_heads() const { return q_heads_; }
  index_t kv_heads() const { return kv_heads_; }
  index_t head_dim() const { return head_dim_; }
  index_t value_dim() const { return value_dim_; }

  // Tokens held by `slot` (0 <= slot < slots()).
  index_t length(index_t slot) const {
    check_slot("::length", slot);
    return lengths_[static_cast<std::size_t>(slot)];
  }
  // Empties one slot (or all) for a new sequence; the storage is kept.
  void clear(index_t slot) {
    check_slot("::clear", slot);
    lengths_[static_cast<std::size_t>(slot)] = 0;
  }
  void clear() { lengths_.assign(lengths_.size(), 0); }

 protected:
  path_cache_base() = default;
  // Throws attnmix::error naming the bad size.
  path_cache_base(const char* name, index_t slots, index_t capacity, index_t q_heads,
                  index_t kv_heads, index_t head_dim, index_t value_dim)
      : name_(name),
        slots_(slots),
        capacity_(capacity),
        q_heads_(q_heads),
        kv_heads_(kv_heads),
        head_dim_(head_dim),
        value_dim_(value_dim) {
    const std::string fn = name;
    require(slots >= 1, fn, "slots", "must be >= 1 but is ", slots);
    require(capacity >= 1, fn, "capacity", "must be >= 1 but is ", capacity);
    require(kv_heads >= 1, fn, "kv_heads", "must be >= 1 but is ", kv_heads);
    require(q_heads >= 1 && q_heads % kv_heads == 0, fn, "q_heads",
            "must be a positive multiple of kv_heads = ", kv_heads, " but is ", q_heads);
    require(head_dim >= 1, fn, "head_dim", "must be >= 1 but is ", head_dim);
    require(value_dim >= 1, fn, "value_dim", "must be >= 1 but is ", value_dim);
    lengths_.assign(static_cast<std::size_t>(slots), 0);
  }
  void set_length(index_t slot, index_t length) {
    lengths_[static_cast<std::size_t>(slot)] = length;
  }
  // Elements of a [slots, capacity, heads, dim] array.
  std::size_t elements(index_t heads, index_t dim) const {
    return static_cast<std::size_t>(slots_ * capacity_) * static_cast<std::size_t>(heads * dim);
  }

  const char* name_ = "attnmix::path_cache";
  index_t slots_ = 0, capacity_ = 0, q_heads_ = 0, kv_heads_ = 0, head_dim_ = 0, value_dim_ = 0;
  std::vector<index_t> lengths_;

 private:
  friend struct path_cache_access;
  void check_slot(const char* op, index_t slot) const {
    require(slot >= 0 && slot < slots_, std::string(name_) + op, "slot", "must be in [0, ", slots_,
            ") but is ", slot);
  }
};

}  // namespace detail

// Decoding state of a batch of independent PaTH / PaTH-FoX sequences, in host memory.
// Each of `slots` slots holds one sequence of at most `capacity` tokens:
//   keys   [slots, capacity, H, D]   kappa_j, the keys carried through all later transitions
//   values [slots, capacity, H, Dv]  raw values
//   gates  [slots, capacity, HQ]     inclusive cumsum G_j of the log forget gate (double, so a
//                                    long generation keeps the small differences G_t - G_j);
//                                    zero for kind::path
// Tokens [0, length(slot)) of a slot are valid. The keys are rewritten by every decoding step,
// so slots cannot share a prefix. (The CUDA backend's device_path_cache has the same layout.)
template <class T>
class path_cache : public detail::path_cache_base {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "attnmix::path_cache: the host cache holds float or double");

 public:
  path_cache() = default;
  // Throws attnmix::error naming the bad size.
  path_cache(index_t slots, index_t capacity, index_t q_heads, index_t kv_heads, index_t head_dim,
             index_t value_dim)
      : path_cache_base("attnmix::path_cache", slots, capacity, q_heads, kv_heads, head_dim,
                        value_dim),
        keys_(elements(kv_heads, head_dim), T(0)),
        values_(elements(kv_heads, value_dim), T(0)),
        gates_(elements(q_heads, 1), 0.0) {}

  view4<const T> keys() const { return {keys_.data(), {slots_, capacity_, kv_heads_, head_dim_}}; }
  view4<const T> values() const {
    return {values_.data(), {slots_, capacity_, kv_heads_, value_dim_}};
  }
  view3<const double> gate_cumsum() const { return {gates_.data(), {slots_, capacity_, q_heads_}}; }

 private:
  friend struct detail::path_cache_access;
  std::vector<T> keys_, values_;
  std::vector<double> gates_;
};

namespace detail {

template <class Kind>
std::string path_fn(const char* op) {
  return std::string("attnmix::") + op + "<" + Kind::name + ">";
}

// The cache (path_cache, or the CUDA backend's device_path_cache) must have the head layout of
// the call.
template <class Cache>
void check_cache_layout(const std::string& fn, const Cache& c, const attention_problem& p) {
  require(c.slots() >= 1, fn, "cache", "is empty (default-constructed)");
  require(c.q_heads() == p.q_heads && c.kv_heads() == p.kv_heads, fn, "cache",
          "holds HQ = ", c.q_heads(), " query and H = ", c.kv_heads(),
          " key/value heads but 'q' has HQ = ", p.q_heads, " and 'k' has H = ", p.kv_heads);
  require(c.head_dim() == p.head_dim, fn, "cache", "holds keys of D = ", c.head_dim(),
          " but 'k' has D = ", p.head_dim);
  require(c.value_dim() == p.value_dim, fn, "cache", "holds values of Dv = ", c.value_dim(),
          " but 'v' has Dv = ", p.value_dim);
}

// Slot of each of `rows` sequences: slots[n], or n when `slots` is absent. In range, distinct.
template <class Cache>
std::vector<index_t> resolve_slots(const std::string& fn, const view1<const std::int32_t>& slots,
                                   index_t rows, const Cache& c) {
  std::vector<index_t> out(static_cast<std::size_t>(rows));
  if (!slots.has_value()) {
    require(rows <= c.slots(), fn, "slots",
            "was not given, so sequence n uses slot n, but there are ", rows,
            " sequences and the cache has ", c.slots(), " slots");
    for (index_t n = 0; n < rows; ++n) out[static_cast<std::size_t>(n)] = n;
    return out;
  }
  check_layout(fn, "slots", slots);
  check_space(fn, "slots", slots, memory_space::host, "slot lookup");
  require(slots.extent(0) == rows, fn, "slots", "has ", slots.extent(0), " entries but there are ",
          rows, " sequences");
  std::vector<bool> seen(static_cast<std::size_t>(c.slots()), false);
  for (index_t n = 0; n < rows; ++n) {
    const index_t s = slots(n);
    require(s >= 0 && s < c.slots(), fn, "slots", "entry ", n, " is ", s,
            " but the cache has slots [0, ", c.slots(), ")");
    require(!seen[static_cast<std::size_t>(s)], fn, "slots", "names slot ", s, " twice");
    seen[static_cast<std::size_t>(s)] = true;
    out[static_cast<std::size_t>(n)] = s;
  }
  return out;
}

template <class Kind>
constexpr void check_path_kind() {
  static_assert(kind_traits<Kind>::uses_householder,
                "attnmix: PaTH caches and decoding take kind::path or kind::path_fox");
}

}  // namespace detail

namespace detail {

// What path_prefill checks, for any cache type: the forward's arguments, the cache's head
// layout, the slots, and room for every prompt. Returns the problem and each sequence's slot.
template <class Kind, class Backend, class Cache, class T>
std::pair<attention_problem, std::vector<index_t>> check_path_prefill(
    const std::string& fn, const Cache& cache, const attention_args<T>& args,
    const view1<const std::int32_t>& slots, const attention_params& params) {
  check_path_kind<Kind>();
  const attention_problem prob = validate_attention<Kind, T, Backend>(fn, args, params);
  check_cache_layout(fn, cache, prob);
  std::vector<index_t> where = resolve_slots(fn, slots, prob.num_sequences, cache);
  for (index_t n = 0; n < prob.num_sequences; ++n)
    require(prob.seq(n).length <= cache.capacity(), fn, "cache", "has capacity ", cache.capacity(),
            " but sequence ", n, " has ", prob.seq(n).length, " tokens");
  return {prob, std::move(where)};
}

// What path_decode_step checks, for any cache type: one token per row, the cache's head
// layout, the slots, and a free position in each slot.
template <class Kind, class Backend, class Cache, class T>
std::pair<attention_problem, std::vector<index_t>> check_path_decode(
    const std::string& fn, const Cache& cache, const attention_args<T>& args,
    const view1<const std::int32_t>& slots, const attention_params& params) {
  check_path_kind<Kind>();
  check_not_given(fn, "cu_seqlens", params.cu_seqlens,
                  "a decoding step takes one token per batch row");
  const attention_problem prob = validate_attention<Kind, T, Backend>(fn, args, params);
  require(prob.tokens == 1, fn, "q",
          "must hold one new token per sequence ([N, 1, HQ, D]) but has shape ", shape_of(args.q));
  check_cache_layout(fn, cache, prob);
  std::vector<index_t> where = resolve_slots(fn, slots, prob.batch, cache);
  for (index_t n = 0; n < prob.batch; ++n) {
    const index_t s = where[static_cast<std::size_t>(n)];
    require(cache.length(s) < cache.capacity(), fn, "cache", "slot ", s, " is full: it holds ",
            cache.length(s), " tokens, its capacity");
  }
  return {prob, std::move(where)};
}

}  // namespace detail

// The prefill key cache: for each sequence of length L (a batch row, or a cu_seqlens segment)
//   key_cache[j] = H_{L-1} H_{L-2} ... H_{j+1} k_j,   H_t = I - beta_t w_t w_t^T,
// i.e. every key carried through all later transitions of its sequence (the last key is k
// itself). This is what decoding needs after a prompt. O(L D^2 + L C D) per head with
// C = Policy::chunk (suffix products of the chunk transitions), not O(L^2 D).
// Uses params.cu_seqlens only (packed batch: B == 1); params.scale is ignored.
// Throws attnmix::error (and writes nothing) when an argument is invalid.
template <class Policy = path_policy, class T, class Backend = backend::cpu>
void path_prefill_key_cache(const path_key_cache_args<T>& a, const attention_params& params = {},
                            const Backend& backend = Backend{}) {
  static_assert(is_backend_v<Backend>, "attnmix: Backend must be a backend tag (a name and a memory_space)");
  const std::string fn = "attnmix::path_prefill_key_cache";
  constexpr memory_space space = detail::space_of<Backend>;
  const char* be = Backend::name;
  detail::check_given(fn, "k", a.k);
  detail::check_given(fn, "w", a.w);
  detail::check_given(fn, "beta", a.beta);
  detail::check_given(fn, "key_cache", a.key_cache);
  detail::check_tensor(fn, "k", a.k, space, be);
  detail::check_tensor(fn, "w", a.w, space, be);
  detail::check_tensor(fn, "beta", a.beta, space, be);
  detail::check_tensor(fn, "key_cache", a.key_cache, space, be);
  const index_t B = a.k.extent(0), T_ = a.k.extent(1), H = a.k.extent(2), D = a.k.extent(3);
  detail::require(H >= 1 && D >= 1, fn, "k",
                  "must have at least one head and D >= 1 but has shape ", detail::shape_of(a.k));
  detail::check_shape(fn, "w", a.w, {B, T_, H, D}, "[B, T, H, D]");
  detail::check_shape(fn, "beta", a.beta, {B, T_, H}, "[B, T, H]");
  detail::check_shape(fn, "key_cache", a.key_cache, {B, T_, H, D}, "[B, T, H, D]");
  detail::check_non_overlapping(fn, "key_cache", a.key_cache);
  detail::check_no_alias(fn, "key_cache", a.key_cache, "k", a.k);
  detail::check_no_alias(fn, "key_cache", a.key_cache, "w", a.w);
  detail::check_no_alias(fn, "key_cache", a.key_cache, "beta", a.beta);
  detail::require(params.window == 0, fn, "window",
                  "must be 0: PaTH has no sliding window, but is ", params.window);
  attention_problem prob{B, T_, H, H, D, D, 1.0, 0, nullptr, B};
  if (params.cu_seqlens.has_value()) {
    detail::check_space(fn, "cu_seqlens", params.cu_seqlens, memory_space::host,
                        "offset validation");
    detail::require(B == 1, fn, "k", "must have B = 1 when cu_seqlens is given but has B = ", B);
    detail::check_offsets(fn, "cu_seqlens", params.cu_seqlens, T_);
    prob.cu_seqlens = params.cu_seqlens.data();
    prob.num_sequences = params.cu_seqlens.extent(0) - 1;
  }
  detail::path_cache_impl<Backend>::template key_cache<Policy>(a, prob, backend);
}

// Prefill: the PaTH / PaTH-FoX forward over a batch of prompts (exactly attnmix::attention<Kind,
// Policy>: out, optional lse), which also loads each prompt's keys (carried through all its
// transitions), values and gate cumsum into the cache, replacing what slot slots[n] held.
// args as for attention<Kind>: q [B,T,HQ,D], k/w [B,T,H,D], v [B,T,H,Dv], beta [B,T,H],
// g [B,T,HQ] (path_fox), out [B,T,HQ,Dv]; params.cu_seqlens for a packed batch.
// slots: [N] host int32, the cache slot of each of the N sequences (absent: sequence n -> slot n).
// The cache must have the call's head layout and room for every prompt.
// Throws attnmix::error (and changes neither the outputs nor the cache) on invalid arguments.
template <class Kind, class Policy = default_policy_t<Kind>, class T, class Backend = backend::cpu>
void path_prefill(path_cache<T>& cache, const attention_args<T>& args,
                  const view1<const std::int32_t>& slots = {}, const attention_params& params = {},
                  const Backend& backend = Backend{}) {
  const auto [prob, where] = detail::check_path_prefill<Kind, Backend>(
      detail::path_fn<Kind>("path_prefill"), cache, args, slots, params);
  detail::path_cache_impl<Backend>::template prefill<Kind, Policy>(cache, args, prob, where,
                                                                   backend);
}

// One decoding step for N sequences: row n of the step carries the next token of the sequence
// in cache slot slots[n] (absent: slot n). Sequences may have any lengths, including 0.
//   q [N,1,HQ,D], k [N,1,H,D], v [N,1,H,Dv], w [N,1,H,D], beta [N,1,H], g [N,1,HQ] (path_fox),
//   out [N,1,HQ,Dv], optional lse [N,1,HQ].
// Moves every cached key of the slot through the new token's transition, appends the token and
// writes its attention output: the same numbers as row L of the forward over L+1 tokens.
// params.scale as for the forward; cu_seqlens and window must be absent.
// Throws attnmix::error (and changes neither the outputs nor the cache) on invalid arguments,
// a cache of another head layout, or a full slot.
template <class Kind, class Policy = default_policy_t<Kind>, class T, class Backend = backend::cpu>
void path_decode_step(path_cache<T>& cache, const attention_args<T>& args,
                      const view1<const std::int32_t>& slots = {},
                      const attention_params& params = {}, const Backend& backend = Backend{}) {
  const auto [prob, where] = detail::check_path_decode<Kind, Backend>(
      detail::path_fn<Kind>("path_decode_step"), cache, args, slots, params);
  detail::path_cache_impl<Backend>::template decode<Kind, Policy>(cache, args, prob, where,
                                                                  backend);
}

}  // namespace attnmix
