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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
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

template <class T, class Space = host_space>
class path_cache;

namespace detail {

// Backend implementations of the operations below; cpu/path.hpp and cuda/path.cuh specialise it.
//   key_cache<Policy>(const path_key_cache_args<T>&, const attention_problem&, const Backend&)
//   prefill<Kind, Policy>(path_cache<Store, Space>&, const attention_args<T>&,
//                         const attention_problem&, const std::vector<index_t>& slots,
//                         const Backend&)
//   decode<Kind, Policy>(same arguments as prefill)
template <class Backend, class Enable = void>
struct path_cache_impl {
  static_assert(dependent_false<Backend>,
                "attnmix: no PaTH key cache / decoding for this backend. For backend::cpu include "
                "<attnmix/attnmix.hpp> (or attnmix/cpu/path.hpp).");
};

// Mutable access to a cache's storage for the implementations.
struct path_cache_access {
  template <class T, class S>
  static T* keys(path_cache<T, S>& c) {
    return static_cast<T*>(c.keys_.get());
  }
  template <class T, class S>
  static T* values(path_cache<T, S>& c) {
    return static_cast<T*>(c.values_.get());
  }
  template <class T, class S>
  static double* gates(path_cache<T, S>& c) {
    return static_cast<double*>(c.gates_.get());
  }
  // The deferred-transition state of a device cache (see path_cache_space<device_space>).
  template <class T, class S>
  static float* recent(path_cache<T, S>& c) {
    return static_cast<float*>(c.recent_.get());
  }
  template <class T, class S>
  static float* transitions(path_cache<T, S>& c) {
    return static_cast<float*>(c.transitions_.get());
  }
  template <class Cache>
  static void set_length(Cache& c, index_t slot, index_t length) {
    c.set_length(slot, length);
  }
};

// What a memory space's path_cache is made of: owned bytes (`buffer`, zero-filled on the host),
// the element types it holds, its name in messages, the head dims its kernels take and the keys
// it keeps in float besides the cache (`recent`: 0 where every step rewrites every key).
// Specialised for host_space here and for device_space in cuda/path.cuh.
template <class Space>
struct path_cache_space {
  static_assert(dependent_false_space<Space>,
                "attnmix::path_cache: no cache for this memory space; for device_space include "
                "<attnmix/cuda.cuh> in a translation unit compiled by nvcc");
};

template <>
struct path_cache_space<host_space> {
  static constexpr const char* name = "attnmix::path_cache";
  static constexpr index_t recent = 0;
  template <class T>
  static constexpr bool holds = std::is_same_v<T, float> || std::is_same_v<T, double>;
  static void check_dims(const std::string&, index_t, index_t) {}
  // Zero-filled bytes; copyable.
  class buffer {
   public:
    buffer() = default;
    buffer(std::size_t bytes, const char*) : bytes_(bytes / sizeof(double) + 1, 0.0) {}
    void* get() { return bytes_.data(); }
    const void* get() const { return bytes_.data(); }

   private:
    std::vector<double> bytes_;  // doubles: aligned for every element type the cache holds
  };
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
    // Every array's bytes (8 per element at most) must be addressable.
    const index_t max_elements = std::numeric_limits<index_t>::max() / 8;
    index_t rows = 0, row = 0, n = 0;
    const bool fits = checked_mul(slots, capacity, rows, max_elements) &&
                      checked_mul(kv_heads, std::max(head_dim, value_dim), row, max_elements) &&
                      checked_mul(rows, row, n, max_elements) &&
                      checked_mul(rows, q_heads, n, max_elements);
    require(fits, fn, "capacity", "makes the cache too large to address: ", slots, " slots x ",
            capacity, " tokens x ", kv_heads, " heads x ", std::max(head_dim, value_dim), " (or ",
            q_heads, " query heads) elements");
    lengths_.assign(static_cast<std::size_t>(slots), 0);
  }
  void set_length(index_t slot, index_t length) {
    lengths_[static_cast<std::size_t>(slot)] = length;
  }
  // Bytes of a [slots, capacity, heads, dim] array of `element` bytes (checked to fit).
  std::size_t bytes(index_t heads, index_t dim, std::size_t element) const {
    return static_cast<std::size_t>(slots_ * capacity_) * static_cast<std::size_t>(heads * dim) *
           element;
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

// Decoding state of a batch of independent PaTH / PaTH-FoX sequences, in the memory space
// `Space` (host_space: float or double; device_space, with <attnmix/cuda.cuh>: float or bfloat16,
// D and Dv multiples of 8 up to 128). Each of `slots` slots holds one sequence of at most
// `capacity` tokens:
//   keys   [slots, capacity, H, D]   kappa_j, the keys carried through all later transitions
//   values [slots, capacity, H, Dv]  raw values
//   gates  [slots, capacity, HQ]     inclusive cumsum G_j of the log forget gate (double, so a
//                                    long generation keeps the small differences G_t - G_j);
//                                    zero for kind::path
// Tokens [0, length(slot)) of a slot are valid; lengths are kept on the host. The keys are
// carried by every decoding step, so slots cannot share a prefix.
// The device cache defers the transitions: keys older than the slot's last flush stay as they
// were then (read once a step, not rewritten), the product of the transitions since is kept per
// slot and head as a float D x D matrix M (a step scores them against M^T q), and the latest keys
// (fewer than 64) in float; every 64 steps the flush applies M to the old keys and stores the
// recent ones. A bfloat16 device cache so rounds a key once every 64 steps, not every step, and
// `keys()` of a device cache holds the keys as of their last flush.
// Movable (a moved-from cache holds no slots); copyable where its storage is (the host).
template <class T, class Space>
class path_cache : public detail::path_cache_base {
  using space_traits = detail::path_cache_space<Space>;
  static_assert(space_traits::template holds<T>,
                "attnmix::path_cache: this memory space's cache "
                "does not hold this element type (host: float, "
                "double; device: float, bfloat16)");
  using buffer = typename space_traits::buffer;

 public:
  using element_type = T;
  using memory_space = Space;

  path_cache() { name_ = space_traits::name; }
  // Throws attnmix::error naming a bad size (before allocating anything).
  path_cache(index_t slots, index_t capacity, index_t q_heads, index_t kv_heads, index_t head_dim,
             index_t value_dim)
      : path_cache_base(space_traits::name, slots, capacity, q_heads, kv_heads, head_dim,
                        value_dim) {
    space_traits::check_dims(name_, head_dim, value_dim);
    // The deferred-transition state (device): recent keys [slots, recent, H, D] and M
    // [slots, H, D, D], in float.
    index_t recent_n = 0, transition_n = 0;  // slots * kv_heads fits (the base checked it)
    const index_t max_elements = std::numeric_limits<index_t>::max() / 8;
    const bool fits =
        detail::checked_mul(slots * kv_heads, space_traits::recent * head_dim, recent_n,
                            max_elements) &&
        detail::checked_mul(slots * kv_heads, space_traits::recent == 0 ? 0 : head_dim * head_dim,
                            transition_n, max_elements);
    detail::require(fits, name_, "slots", "makes the cache too large to address: ", slots,
                    " slots x ", kv_heads, " heads x ", head_dim, " x ", head_dim, " elements");
    const std::size_t recent_bytes = static_cast<std::size_t>(recent_n) * 4,
                      transition_bytes = static_cast<std::size_t>(transition_n) * 4;
    detail::check_fits_space<Space>(
        name_, "capacity",
        bytes(kv_heads, head_dim, sizeof(T)) + bytes(kv_heads, value_dim, sizeof(T)) +
            bytes(q_heads, 1, sizeof(double)) + recent_bytes + transition_bytes,
        "of ", capacity, " tokens for ", slots, " slots");
    try {
      keys_ = buffer(bytes(kv_heads, head_dim, sizeof(T)), "path_cache keys");
      values_ = buffer(bytes(kv_heads, value_dim, sizeof(T)), "path_cache values");
      gates_ = buffer(bytes(q_heads, 1, sizeof(double)), "path_cache gates");
      if (recent_bytes != 0) {
        recent_ = buffer(recent_bytes, "path_cache recent keys");
        transitions_ = buffer(transition_bytes, "path_cache transitions");
      }
    } catch (const std::bad_alloc&) {  // a host cache larger than the machine's memory
      detail::fail(name_, "capacity", "of ", capacity, " tokens for ", slots,
                   " slots needs more memory than could be allocated");
    }
  }
  path_cache(const path_cache&) = default;
  path_cache& operator=(const path_cache&) = default;
  path_cache(path_cache&& o) noexcept { *this = std::move(o); }
  path_cache& operator=(path_cache&& o) noexcept {
    if (this != &o) {
      static_cast<path_cache_base&>(*this) = std::move(static_cast<path_cache_base&>(o));
      keys_ = std::move(o.keys_), values_ = std::move(o.values_), gates_ = std::move(o.gates_);
      recent_ = std::move(o.recent_), transitions_ = std::move(o.transitions_);
      o.slots_ = 0;
      o.lengths_.clear();
    }
    return *this;
  }

  view4<const T> keys() const {
    return {static_cast<const T*>(keys_.get()),
            {slots_, capacity_, kv_heads_, head_dim_},
            Space::value};
  }
  view4<const T> values() const {
    return {static_cast<const T*>(values_.get()),
            {slots_, capacity_, kv_heads_, value_dim_},
            Space::value};
  }
  view3<const double> gate_cumsum() const {
    return {static_cast<const double*>(gates_.get()), {slots_, capacity_, q_heads_}, Space::value};
  }

 private:
  friend struct detail::path_cache_access;
  buffer keys_, values_, gates_, recent_, transitions_;
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
  const attention_problem prob = validate_attention<Kind, T, Backend>(fn, args, params, true);
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
  const attention_problem prob = validate_attention<Kind, T, Backend>(fn, args, params, true);
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

// The default backend of a cache's memory space, for the front doors' default arguments.
template <class Space>
struct default_backend;
template <>
struct default_backend<host_space> {
  using type = backend::cpu;
};
template <>
struct default_backend<device_space> {
  using type = backend::cuda;
};

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
  static_assert(is_backend_v<Backend>,
                "attnmix: Backend must be a backend tag (a name and a memory_space)");
  using space = typename Backend::memory_space;
  namespace d = detail;
  const std::string fn = "attnmix::path_prefill_key_cache";
  const auto req = d::arg_presence::required;
  d::arg_list args{d::input("k", a.k, req), d::input("w", a.w, req), d::input("beta", a.beta, req),
                   d::host_input("cu_seqlens", params.cu_seqlens, "offset validation"),
                   d::output("key_cache", a.key_cache, req)};
  d::check_presence(fn, args);
  d::check_placement(fn, args, space::value, Backend::name);
  const index_t B = a.k.extent(0), T_ = a.k.extent(1), H = a.k.extent(2), D = a.k.extent(3);
  d::require(H >= 1 && D >= 1, fn, "k", "must have at least one head and D >= 1 but has shape ",
             d::shape_of(a.k));
  d::find_arg(args, "w")->expect("[B, T, H, D]", B, T_, H, D);
  d::find_arg(args, "beta")->expect("[B, T, H]", B, T_, H);
  d::find_arg(args, "key_cache")->expect("[B, T, H, D]", B, T_, H, D);
  d::check_shapes(fn, args);
  d::check_outputs(fn, args);
  d::require(params.window == 0, fn, "window", "must be 0: PaTH has no sliding window, but is ",
             params.window);
  const d::packed_batch packed = d::resolve_packed_batch(fn, params.cu_seqlens, B, T_, "k");
  d::pointer_check<space>::run(fn, args);
  attention_problem prob{};
  prob.batch = B;
  prob.tokens = T_;
  prob.q_heads = prob.kv_heads = H;
  prob.head_dim = prob.value_dim = D;
  prob.scale = 1.0;
  prob.window = 0;
  prob.cu_seqlens = prob.cu_seqlens_k = packed.cu_seqlens;
  prob.num_sequences = packed.sequences;
  prob.key_tokens = T_;
  prob.key_batch = B;
  d::path_cache_impl<Backend>::template key_cache<Policy>(a, prob, backend);
}

namespace detail {
template <class Space, class Backend>
constexpr void check_cache_space() {
  static_assert(std::is_same_v<Space, typename Backend::memory_space>,
                "attnmix: the cache lives in another memory space than the backend computes in "
                "(path_cache<T> for host backends, path_cache<T, device_space> for backend::cuda)");
}
}  // namespace detail

// Prefill: the PaTH / PaTH-FoX forward over a batch of prompts (exactly attnmix::attention<Kind,
// Policy>: out, optional lse), which also loads each prompt's keys (carried through all its
// transitions), values and gate cumsum into the cache, replacing what slot slots[n] held.
// args as for attention<Kind>: q [B,T,HQ,D], k/w [B,T,H,D], v [B,T,H,Dv], beta [B,T,H],
// g [B,T,HQ] (path_fox), out [B,T,HQ,Dv]; params.cu_seqlens for a packed batch.
// slots: [N] host int32, the cache slot of each of the N sequences (absent: sequence n -> slot n).
// The cache must live where the backend computes, have the call's head layout and room for
// every prompt. The backend defaults to the cache's space's (cpu on the host, cuda on the device).
// Throws attnmix::error (and changes neither the outputs nor the cache) on invalid arguments.
template <class Kind, class Policy = default_policy_t<Kind>, class Store, class Space, class T,
          class Backend = typename default_backend<Space>::type>
void path_prefill(path_cache<Store, Space>& cache, const attention_args<T>& args,
                  const view1<const std::int32_t>& slots = {}, const attention_params& params = {},
                  const Backend& backend = Backend{}) {
  detail::check_cache_space<Space, Backend>();
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
template <class Kind, class Policy = default_policy_t<Kind>, class Store, class Space, class T,
          class Backend = typename default_backend<Space>::type>
void path_decode_step(path_cache<Store, Space>& cache, const attention_args<T>& args,
                      const view1<const std::int32_t>& slots = {},
                      const attention_params& params = {}, const Backend& backend = Backend{}) {
  detail::check_cache_space<Space, Backend>();
  const auto [prob, where] = detail::check_path_decode<Kind, Backend>(
      detail::path_fn<Kind>("path_decode_step"), cache, args, slots, params);
  detail::path_cache_impl<Backend>::template decode<Kind, Policy>(cache, args, prob, where,
                                                                  backend);
}

}  // namespace attnmix
