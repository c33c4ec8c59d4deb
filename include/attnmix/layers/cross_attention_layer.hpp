#pragma once
// Cross-attention: the queries of a decoder's rows read the keys and values of another sequence,
// the memory (an encoder's output), one memory sequence for each sequence of queries:
//   q = q_proj x [HQ*d],  k = k_proj m [H*d],  v = v_proj m [H*d]   (bias with Policy::qkv_bias)
//   optional qk-norm (q_norm, k_norm: per-head RMSNorm, weights [d])
//   o = attention<softmax, bidirectional>(q, k, v),  y = o_proj o
// Every query of sequence n sees every memory token of sequence n (no mask, no positions). The
// memory is [B, Tm, D] beside x [B, T, D], or packed ([1, sum Tm, D] with its own offsets) beside
// a packed x; decoding projects each sequence's memory once into a cache (a kv_cache whose slots
// hold k and v) that every step reads in place. The forward and backward are written once over
// ops<Backend> and the attention front doors (the backend's softmax must take keys of other
// lengths: takes_key_lengths, and takes_key_lengths_backward to train).

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/attention_backward.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/layers/attention_layer.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/linear.hpp"
#include "attnmix/layers/norm.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace layers {

// Knobs of the cross-attention layer. Derive to change one.
struct cross_attention_layer_policy {
  static constexpr bool qk_norm = false;
  static constexpr bool qkv_bias = false;
  static constexpr const char* name = "cross_attn";
};

// The memory rows a cross-attention call reads: [rows, D] in the backend's memory, split into
// sequences by `layout` (as many as the queries have).
template <class T>
struct memory_rows {
  const T* rows;
  const token_layout& layout;
};

template <class T, class Policy = cross_attention_layer_policy, class Backend = backend::cpu>
class cross_attention_layer {
  using K = attnmix::kind::softmax;
  using A = accum_t<T>;
  using O = ops<Backend>;
  using space = typename Backend::memory_space;
  template <class, class, class>
  friend class cross_attention_layer;

 public:
  static constexpr const char* name = Policy::name;
  using policy = Policy;
  using backend_type = Backend;
  using attention_policy = bidirectional_softmax_policy;
  // The memory's keys and values of each sequence, projected once for decoding.
  using cache_type = kv_cache<T, space>;
  // What backward_rows reads: q (and k, v before the qk-norm), k, v, the attention's output and
  // log-sum-exp.
  struct saved_type {
    buffer<T, space> q_in, k_in, q, k, v, o;  // q, o: [rows, HQ*d]; k, v: [memory rows, H*d]
    buffer<A, space> lse;                     // [rows, HQ]
    saved_origin origin, memory_origin;
  };

  cross_attention_layer() = default;
  explicit cross_attention_layer(const config& c)
      : D_(checked(std::string("attnmix::layers::") + name, c).hidden_size),
        HQ_(c.num_heads),
        H_(c.kv_heads()),
        d_(c.dim()),
        scale_(c.scale),
        q_proj(D_, HQ_ * d_, Policy::qkv_bias),
        k_proj(D_, H_ * d_, Policy::qkv_bias),
        v_proj(D_, H_ * d_, Policy::qkv_bias),
        o_proj(HQ_ * d_, D_) {
    if constexpr (Policy::qk_norm) {
      q_norm = head_rms_norm<T, Backend>(HQ_, d_, false, c.head_norm_eps);
      k_norm = head_rms_norm<T, Backend>(H_, d_, false, c.head_norm_eps);
    }
  }
  // The same layer with every weight copied once to Backend's memory, projections in T.
  template <class U, class B>
  explicit cross_attention_layer(const cross_attention_layer<U, Policy, B>& o)
      : D_(o.D_),
        HQ_(o.HQ_),
        H_(o.H_),
        d_(o.d_),
        scale_(o.scale_),
        q_proj(o.q_proj),
        k_proj(o.k_proj),
        v_proj(o.v_proj),
        o_proj(o.o_proj),
        q_norm(o.q_norm),
        k_norm(o.k_norm) {}

  index_t hidden_size() const { return D_; }
  // What a saved state records of the layer that made it.
  std::array<index_t, 6> sizes() const { return {D_, HQ_, H_, d_, 0, 0}; }

  // ---- On views ---------------------------------------------------------------------------
  // out = cross_attn(x, memory). x, out: [B, T, D]; memory: [B, Tm, D] (dense), or, with
  // cu_seqlens (x packed, B == 1), [1, sum Tm, D] packed with cu_seqlens_memory (as many
  // sequences). Every sequence with queries needs at least one memory token. Throws
  // attnmix::error on bad arguments, before anything is written.
  void forward(const view3<const T>& x, const view3<const T>& memory, const view3<T>& out,
               const view1<const std::int32_t>& cu_seqlens = {},
               const view1<const std::int32_t>& cu_seqlens_memory = {},
               const Backend& be = Backend{}) const {
    forward_impl(x, memory, out, nullptr, cu_seqlens, cu_seqlens_memory, be);
  }
  // Training: the same forward, also keeping in `saved` what backward() reads.
  void forward(const view3<const T>& x, const view3<const T>& memory, const view3<T>& out,
               saved_type& saved, const view1<const std::int32_t>& cu_seqlens = {},
               const view1<const std::int32_t>& cu_seqlens_memory = {},
               const Backend& be = Backend{}) const {
    forward_impl(x, memory, out, &saved, cu_seqlens, cu_seqlens_memory, be);
  }
  // Training: from the forward's x, memory and `saved` (forward(x, memory, out, saved, ...) with
  // the same offsets) and dout = dL/d(out), writes dL/dx into dx and dL/d(memory) into dmemory,
  // and adds every parameter's gradient to its .grad. Throws attnmix::error on bad arguments.
  void backward(const view3<const T>& x, const view3<const T>& memory, const view3<const T>& dout,
                const view3<T>& dx, const view3<T>& dmemory, const saved_type& saved,
                const view1<const std::int32_t>& cu_seqlens = {},
                const view1<const std::int32_t>& cu_seqlens_memory = {},
                const Backend& be = Backend{}) {
    const std::string fn = std::string("attnmix::layers::") + name + "::backward";
    const call_layouts L = check_call(fn, x, memory, dx, "dx", cu_seqlens, cu_seqlens_memory);
    detail::check_activation(fn, "dout", dout, D_, space_of_v<Backend>, Backend::name);
    detail::check_same_shape(fn, dout, x, "dout");
    detail::check_activation(fn, "dmemory", dmemory, D_, space_of_v<Backend>, Backend::name);
    detail::check_same_shape(fn, dmemory, memory, "dmemory");
    attnmix::detail::check_no_alias(fn, "dx", dx, "dout", dout);
    attnmix::detail::check_no_alias(fn, "dmemory", dmemory, "x", x);
    attnmix::detail::check_no_alias(fn, "dmemory", dmemory, "memory", memory);
    attnmix::detail::check_no_alias(fn, "dmemory", dmemory, "dout", dout);
    attnmix::detail::check_no_alias(fn, "dmemory", dmemory, "dx", dx);
    O::check_memory(fn, "dout", dout);
    O::check_memory(fn, "dmemory", dmemory);
    with_context(L.x, be, [&](const context<Backend>& c) {
      backward_rows(c, x.data(), {memory.data(), L.memory}, dout.data(), dx.data(), dmemory.data(),
                    saved);
    });
  }

  // Decoding: projects the memory [N, Tm, D] (or packed [1, sum Tm, D] with cu_seqlens_memory)
  // into `cache`, sequence n -> slot n, replacing what the slot held. Throws attnmix::error on
  // bad arguments (and then leaves the cache as it was).
  void remember(const view3<const T>& memory, cache_type& cache,
                const view1<const std::int32_t>& cu_seqlens_memory = {},
                const Backend& be = Backend{}) const {
    using attnmix::detail::require;
    const std::string fn = std::string("attnmix::layers::") + name + "::remember";
    detail::check_activation(fn, "memory", memory, D_, space_of_v<Backend>, Backend::name);
    O::check_memory(fn, "memory", memory);
    check_cache(fn, "cache", "the cache", cache);
    const token_layout M = detail::make_layout(fn, memory, cu_seqlens_memory);
    require(M.num_sequences() <= cache.sequences(), fn, "cache", "holds ", cache.sequences(),
            " sequences but the memory has ", M.num_sequences());
    std::vector<index_t> slots(static_cast<std::size_t>(M.num_sequences()));
    for (index_t n = 0; n < M.num_sequences(); ++n) {
      require(M.seq(n).length <= cache.capacity(), fn, "cache", "has capacity ", cache.capacity(),
              " but memory sequence ", n, " has ", M.seq(n).length, " tokens");
      slots[static_cast<std::size_t>(n)] = n;
    }
    with_context(M, be, [&](const context<Backend>& c) {
      remember_rows(c, {memory.data(), M}, cache, slots);
    });
  }
  // Decoding: out = cross_attn(x) for x, out [N, T, D], row n reading the memory of slot
  // slots[n] (without slots, slot n). Slots may repeat (the beams of one user read its memory);
  // each must hold memory. Throws attnmix::error on bad arguments.
  void attend(const view3<const T>& x, const view3<T>& out, const cache_type& cache,
              const Backend& be = Backend{}) const {
    attend_impl(x, out, cache, {}, be);
  }
  void attend(const view3<const T>& x, const view3<T>& out, const cache_type& cache,
              const cache_slots& slots, const Backend& be = Backend{}) const {
    attend_impl(x, out, cache, slots.slots, be);
  }

  // The layouts of x and the memory of a call, as check_call resolves them.
  struct call_layouts {
    token_layout x, memory;
  };
  // Checks x, memory and the output `out` (named `arg`) of a call of `fn` and returns both
  // layouts: x dense with memory of as many batch rows, or both packed with as many sequences,
  // each sequence of queries with at least one memory token. (A decoder checks its calls here.)
  call_layouts check_call(const std::string& fn, const view3<const T>& x,
                          const view3<const T>& memory, const view3<T>& out, const char* arg,
                          const view1<const std::int32_t>& cu,
                          const view1<const std::int32_t>& cu_m) const {
    using attnmix::detail::require;
    for (const auto& [n, v] : {std::pair<const char*, view3<const T>>{"x", x}, {"memory", memory}})
      detail::check_activation(fn, n, v, D_, space_of_v<Backend>, Backend::name);
    detail::check_activation(fn, arg, out, D_, space_of_v<Backend>, Backend::name);
    detail::check_same_shape(fn, out, x, arg);
    attnmix::detail::check_no_alias(fn, arg, out, "x", x);
    attnmix::detail::check_no_alias(fn, arg, out, "memory", memory);
    O::check_memory(fn, "x", x);
    O::check_memory(fn, "memory", memory);
    O::check_memory(fn, arg, out);
    require(cu.has_value() == cu_m.has_value(), fn,
            cu.has_value() ? "cu_seqlens_memory" : "cu_seqlens", "must be given with '",
            cu.has_value() ? "cu_seqlens" : "cu_seqlens_memory",
            "': x and memory are packed together or not at all");
    call_layouts L{detail::make_layout(fn, x, cu), {}};
    if (cu_m.has_value()) {
      attnmix::detail::check_space(fn, "cu_seqlens_memory", cu_m, memory_space::host,
                                   "offset validation");
      require(memory.extent(0) == 1, fn, "memory",
              "must have B = 1 when cu_seqlens_memory is given but has B = ", memory.extent(0));
      require(cu_m.extent(0) == cu.extent(0), fn, "cu_seqlens_memory", "holds ", cu_m.extent(0),
              " offsets but cu_seqlens holds ", cu.extent(0),
              ": one memory sequence for each sequence of x");
      L.memory = detail::make_layout(fn, memory, {});
      attnmix::detail::check_offsets(fn, "cu_seqlens_memory", cu_m, memory.extent(1));
      for (index_t i = 0; i < cu_m.extent(0); ++i) L.memory.cu_seqlens.push_back(cu_m(i));
    } else {
      require(memory.extent(0) == x.extent(0), fn, "memory", "has B = ", memory.extent(0),
              " but x has B = ", x.extent(0), ": one memory sequence for each batch row of x");
      L.memory = detail::make_layout(fn, memory, {});
    }
    for (index_t n = 0; n < L.x.num_sequences(); ++n)
      require(L.x.seq(n).length == 0 || L.memory.seq(n).length > 0, fn, "memory",
              "holds no token for the ", L.x.seq(n).length, " queries of sequence ", n);
    return L;
  }

  // The slot each of N rows of `tokens` queries reads: slots[n] (host int32, any slot of
  // `cache`, repeats allowed) or, without slots, n; each must hold memory when tokens > 0. Throws
  // attnmix::error naming 'slots', 'x' or 'cache'. (A decoder checks its rows here.)
  std::vector<index_t> reading_slots(const std::string& fn, const view1<const std::int32_t>& slots,
                                     index_t N, index_t tokens, const cache_type& cache) const {
    using attnmix::detail::require;
    if (slots.has_value()) {
      attnmix::detail::check_space(fn, "slots", slots, memory_space::host, "slot validation");
      require(slots.extent(0) == N, fn, "slots", "holds ", slots.extent(0),
              " slots but x has N = ", N, " sequences");
    } else {
      require(N <= cache.sequences(), fn, "x", "has N = ", N, " sequences but the cache holds ",
              cache.sequences());
    }
    std::vector<index_t> where(static_cast<std::size_t>(N));
    for (index_t n = 0; n < N; ++n) {
      const index_t s = slots.has_value() ? index_t{slots(n)} : n;
      require(s >= 0 && s < cache.sequences(), fn, "slots", "[", n, "] is ", s,
              ", not a slot of the cache (", cache.sequences(), " slots)");
      require(tokens == 0 || cache.length(s) > 0, fn, "cache", "slot ", s,
              " holds no memory for the queries of row ", n);
      where[static_cast<std::size_t>(n)] = s;
    }
    return where;
  }

  // ---- On rows ----------------------------------------------------------------------------
  // y = cross_attn(x, m) on c.layout's rows (x, y: [rows, D], distinct); with `saved`, also what
  // backward_rows needs. m.layout has the sequences of c.layout (checked by the front door).
  void forward_rows(const context<Backend>& c, const T* x, const memory_rows<T>& m, T* y,
                    saved_type* saved = nullptr) const {
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), mrows = m.layout.rows();
    const index_t nq = rows * HQ_ * d_, nk = mrows * H_ * d_;
    const bool keep = saved != nullptr;
    if (keep) saved->origin.made = false;
    typename O::scratch sc(c.be, keep ? 0 : scratch_bytes<T>(nq) * 2 + scratch_bytes<T>(nk) * 2);
    if (keep) {
      for (auto* b : {&saved->q, &saved->o}) b->resize(nq);
      for (auto* b : {&saved->k, &saved->v}) b->resize(nk);
      saved->lse.resize(rows * HQ_);
    }
    T* q = keep ? saved->q.data() : sc.template take<T>(nq);
    T* k = keep ? saved->k.data() : sc.template take<T>(nk);
    T* v = keep ? saved->v.data() : sc.template take<T>(nk);
    T* o = keep ? saved->o.data() : sc.template take<T>(nq);
    project_queries(c, x, rows, q, saved);
    project_memory(c, m.rows, mrows, k, v, saved);
    attention_args<T> a;
    a.q = as_heads<Backend, const T>(q, L, HQ_, d_);
    a.k = as_heads<Backend, const T>(k, m.layout, H_, d_);
    a.v = as_heads<Backend, const T>(v, m.layout, H_, d_);
    a.out = as_heads<Backend, T>(o, L, HQ_, d_);
    if (keep) a.lse = as_rows<Backend, A>(saved->lse.data(), L, HQ_);
    attnmix::attention<K, attention_policy>(a, params(L, m.layout), c.be);
    o_proj.apply(c, o, rows, y);
    if (keep) {
      saved->origin.record(L, sizes());
      saved->memory_origin.record(m.layout, sizes());
    }
  }

  // Backward of forward_rows(c, x, m, y, &saved): every parameter's .grad added to; dx and dm
  // (the memory's gradient, [memory rows, D]) written, or added with accumulate /
  // accumulate_memory (a decoder's layers all read one memory).
  void backward_rows(const context<Backend>& c, const T* x, const memory_rows<T>& m, const T* dy,
                     T* dx, T* dm, const saved_type& sv, bool accumulate = false,
                     bool accumulate_memory = false) {
    const std::string fn = std::string("attnmix::layers::") + name + "::backward";
    sv.origin.check(fn, "saved", c.layout, sizes());
    sv.memory_origin.check(fn, "saved", m.layout, sizes());
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), mrows = m.layout.rows();
    const index_t nq = rows * HQ_ * d_, nk = mrows * H_ * d_;
    typename O::scratch sc(c.be, scratch_bytes<T>(nq) * 2 + scratch_bytes<T>(nk) * 2);
    T *dout = sc.template take<T>(nq), *dq = sc.template take<T>(nq);
    T *dk = sc.template take<T>(nk), *dv = sc.template take<T>(nk);
    o_proj.backward(c, sv.o.data(), rows, dy, dout);
    attention_grad_args<T> a;
    a.q = as_heads<Backend, const T>(sv.q.data(), L, HQ_, d_);
    a.k = as_heads<Backend, const T>(sv.k.data(), m.layout, H_, d_);
    a.v = as_heads<Backend, const T>(sv.v.data(), m.layout, H_, d_);
    a.out = as_heads<Backend, const T>(sv.o.data(), L, HQ_, d_);
    a.lse = as_rows<Backend, const A>(sv.lse.data(), L, HQ_);
    a.dout = as_heads<Backend, const T>(dout, L, HQ_, d_);
    a.dq = as_heads<Backend, T>(dq, L, HQ_, d_);
    a.dk = as_heads<Backend, T>(dk, m.layout, H_, d_);
    a.dv = as_heads<Backend, T>(dv, m.layout, H_, d_);
    attnmix::attention_backward<K, attention_policy>(a, params(L, m.layout), c.be);
    if constexpr (Policy::qk_norm) {
      q_norm.backward(c, sv.q_in.data(), rows, dq, dq);
      k_norm.backward(c, sv.k_in.data(), mrows, dk, dk);
    }
    q_proj.backward(c, x, rows, dq, dx, accumulate);
    k_proj.backward(c, m.rows, mrows, dk, dm, accumulate_memory);
    v_proj.backward(c, m.rows, mrows, dv, dm, true);
  }

  // ---- Decoding ---------------------------------------------------------------------------
  // A cache of `sequences` slots of up to `capacity` memory tokens each, in the backend's memory.
  cache_type make_cache(index_t sequences, index_t capacity) const {
    const std::string fn = std::string("attnmix::layers::") + name + "::make_cache";
    detail::check_cache_size<space>(fn, sequences, capacity, 2 * H_ * d_ * index_t(sizeof(T)));
    return cache_type(sequences, capacity, HQ_, H_, d_);
  }
  // Throws attnmix::error naming `what` unless `cache` was made by a layer of this layout.
  void check_cache(const std::string& fn, const char* arg, const std::string& what,
                   const cache_type& cache) const {
    detail::check_cache_layout(fn, arg, what, cache.layout(),
                               {{"q_heads", HQ_}, {"kv_heads", H_}, {"head_dim", d_}});
  }
  // Projects the memory of each sequence n of m.layout into slot slots[n] of `cache` (replacing
  // what the slot held; its length becomes the sequence's). Checked by the caller: distinct slots
  // in range, each sequence within the capacity.
  void remember_rows(const context<Backend>& c, const memory_rows<T>& m, cache_type& cache,
                     const std::vector<index_t>& slots) const {
    const index_t mrows = m.layout.rows(), nk = mrows * H_ * d_;
    // Memory token t of sequence n -> row t of slot slots[n].
    std::vector<std::int64_t> at(static_cast<std::size_t>(mrows));
    for (index_t n = 0; n < m.layout.num_sequences(); ++n) {
      const index_t s = slots[static_cast<std::size_t>(n)], r0 = m.layout.first_row(n);
      for (index_t t = 0; t < m.layout.seq(n).length; ++t)
        at[static_cast<std::size_t>(r0 + t)] = s * cache.capacity() + t;
    }
    typename O::scratch sc(c.be, scratch_bytes<T>(nk) * 2 + scratch_bytes<std::int64_t>(mrows));
    T *k = sc.template take<T>(nk), *v = sc.template take<T>(nk);
    std::int64_t* dat = sc.template take<std::int64_t>(mrows);
    O::upload(c.be, dat, at.data(), mrows);
    project_memory(c, m.rows, mrows, k, v, nullptr);
    const std::int64_t* in_order = nullptr;
    O::move_rows(c, k, cache.key(0, 0), in_order, dat, mrows, H_ * d_);
    O::move_rows(c, v, cache.value(0, 0), in_order, dat, mrows, H_ * d_);
    for (index_t n = 0; n < m.layout.num_sequences(); ++n)
      cache.set_length(slots[static_cast<std::size_t>(n)], m.layout.seq(n).length);
  }
  // y = cross_attn(x) for c.layout's dense rows [N, T] (packed rows are not taken here), query
  // sequence n reading the memory of slot slots[n] (slots may repeat: the beams of one user read
  // its memory). Checked by the caller: slots in range, each holding memory.
  void attend_rows(const context<Backend>& c, const T* x, T* y, const cache_type& cache,
                   const std::vector<index_t>& slots) const {
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), nq = rows * HQ_ * d_, N = L.num_sequences();
    std::vector<std::int32_t> where(static_cast<std::size_t>(N)), lengths(where.size());
    for (index_t n = 0; n < N; ++n) {
      const auto i = static_cast<std::size_t>(n);
      where[i] = static_cast<std::int32_t>(slots[i]);
      lengths[i] = static_cast<std::int32_t>(cache.length(slots[i]));
    }
    typename O::scratch sc(c.be, scratch_bytes<T>(nq) * 2);
    T *q = sc.template take<T>(nq), *o = sc.template take<T>(nq);
    project_queries(c, x, rows, q, nullptr);
    attention_args<T> a;
    a.q = as_heads<Backend, const T>(q, L, HQ_, d_);
    a.k = cache.keys();
    a.v = cache.values();
    a.out = as_heads<Backend, T>(o, L, HQ_, d_);
    attention_params p = L.attention(scale_);
    p.key_lengths = view1<const std::int32_t>(lengths.data(), {N});
    p.key_slots = view1<const std::int32_t>(where.data(), {N});
    attnmix::attention<K, attention_policy>(a, p, c.be);
    o_proj.apply(c, o, rows, y);
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    visit(*this, f, prefix);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    visit(*this, f, prefix);
  }

 private:
  index_t D_ = 0, HQ_ = 0, H_ = 0, d_ = 0;
  std::optional<double> scale_;

 public:
  linear<T, Backend> q_proj, k_proj, v_proj, o_proj;
  head_rms_norm<T, Backend> q_norm, k_norm;

 private:
  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    s.q_proj.visit_parameters(f, prefix + "q_proj.");
    s.k_proj.visit_parameters(f, prefix + "k_proj.");
    s.v_proj.visit_parameters(f, prefix + "v_proj.");
    if constexpr (Policy::qk_norm) {
      s.q_norm.visit_parameters(f, prefix + "q_norm.");
      s.k_norm.visit_parameters(f, prefix + "k_norm.");
    }
    s.o_proj.visit_parameters(f, prefix + "o_proj.");
  }

  // The attention call's params: queries of L against keys of M (their own offsets when packed).
  attention_params params(const token_layout& L, const token_layout& M) const {
    attention_params p = L.attention(scale_);
    p.cu_seqlens_k = M.cu_view();
    return p;
  }

  // q (normed) of x's rows; with sv and a qk-norm, also q before it.
  void project_queries(const context<Backend>& c, const T* x, index_t rows, T* q,
                       saved_type* sv) const {
    q_proj.apply(c, x, rows, q);
    if constexpr (Policy::qk_norm) {
      if (sv != nullptr) {
        sv->q_in.resize(rows * HQ_ * d_);
        O::move_rows(c, q, sv->q_in.data(), nullptr, nullptr, rows, HQ_ * d_);
      }
      q_norm.apply(c, q, rows, q);
    }
    (void)sv;
  }
  // k (normed) and v of the memory's rows; with sv and a qk-norm, also k before it.
  void project_memory(const context<Backend>& c, const T* m, index_t rows, T* k, T* v,
                      saved_type* sv) const {
    k_proj.apply(c, m, rows, k);
    v_proj.apply(c, m, rows, v);
    if constexpr (Policy::qk_norm) {
      if (sv != nullptr) {
        sv->k_in.resize(rows * H_ * d_);
        O::move_rows(c, k, sv->k_in.data(), nullptr, nullptr, rows, H_ * d_);
      }
      k_norm.apply(c, k, rows, k);
    }
    (void)sv;
  }

  void forward_impl(const view3<const T>& x, const view3<const T>& memory, const view3<T>& out,
                    saved_type* saved, const view1<const std::int32_t>& cu,
                    const view1<const std::int32_t>& cu_m, const Backend& be) const {
    const std::string fn = std::string("attnmix::layers::") + name + "::forward";
    const call_layouts L = check_call(fn, x, memory, out, "out", cu, cu_m);
    with_context(L.x, be, [&](const context<Backend>& c) {
      forward_rows(c, x.data(), {memory.data(), L.memory}, out.data(), saved);
    });
  }

  void attend_impl(const view3<const T>& x, const view3<T>& out, const cache_type& cache,
                   const view1<const std::int32_t>& slots, const Backend& be) const {
    const std::string fn = std::string("attnmix::layers::") + name + "::attend";
    detail::check_activation(fn, "x", x, D_, space_of_v<Backend>, Backend::name);
    detail::check_activation(fn, "out", out, D_, space_of_v<Backend>, Backend::name);
    detail::check_same_shape(fn, out, x);
    attnmix::detail::check_no_alias(fn, "out", out, "x", x);
    O::check_memory(fn, "x", x);
    O::check_memory(fn, "out", out);
    check_cache(fn, "cache", "the cache", cache);
    const std::vector<index_t> where = reading_slots(fn, slots, x.extent(0), x.extent(1), cache);
    const token_layout L{x.extent(0), x.extent(1), {}};
    with_context(L, be, [&](const context<Backend>& c) {
      attend_rows(c, x.data(), out.data(), cache, where);
    });
  }

  template <class F>
  static void with_context(const token_layout& L, const Backend& be, F&& f) {
    const typename O::handles handles{};
    f(context<Backend>{be, L, nullptr, handles});
  }
};

}  // namespace layers
}  // namespace attnmix
