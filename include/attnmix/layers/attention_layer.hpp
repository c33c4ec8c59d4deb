#pragma once
// Softmax-attention (SA) and FoX mixer layers with fla's parameter names
// (fla/layers/attn.py, fla/layers/forgetting_attn.py), and their KV cache.
//
//   q = q_proj x [HQ*d], k = k_proj x [H*d], v = v_proj x [H*d]     (bias with Policy::qkv_bias)
//   optional qk-norm (q_norm, k_norm: per-head RMSNorm; weights [d] for SA, [HQ*d] / [H*d] for
//   FoX as fla's GroupNorm), optional RoPE (SA; rotate-half, config.rope_theta)
//   FoX: g = logsigmoid(f_proj x) [HQ] (f_proj has a bias), the log forget gate
//   o = attention<Kind>(q, k, v[, g]);  optional output gate o *= sigmoid(g_proj x)
//   y = o_proj o
// SA is causal or bidirectional (Policy::mask); FoX is causal. config.window > 0 restricts
// attention to a sliding window (attention_params::window), in the forward and in decoding.
// The forward, prefill and decoding are written once over ops<Backend>.

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/attention_backward.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/layers/cache_layout.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/linear.hpp"
#include "attnmix/layers/mixer.hpp"
#include "attnmix/layers/norm.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace layers {

// Knobs of the SA mixer. Derive to change one.
struct sa_layer_policy {
  using kind = attnmix::kind::softmax;
  static constexpr mask_type mask = mask_type::bidirectional;
  static constexpr bool rope = false;
  static constexpr bool qk_norm = false;
  static constexpr bool output_gate = false;
  static constexpr bool qkv_bias = false;
  static constexpr const char* name = "sa";
};
struct causal_sa_layer_policy : sa_layer_policy {
  static constexpr mask_type mask = mask_type::causal;
  static constexpr const char* name = "causal_sa";
};
// The PaTH and FoX papers' softmax baseline: causal, with RoPE (config.rope_theta).
struct causal_sa_rope_layer_policy : causal_sa_layer_policy {
  static constexpr bool rope = true;
  static constexpr const char* name = "causal_sa_rope";
};
struct fox_layer_policy : sa_layer_policy {
  using kind = attnmix::kind::fox;
  static constexpr mask_type mask = mask_type::causal;
  static constexpr const char* name = "fox";
};

// KV cache of N slots, one sequence each: keys after qk-norm and RoPE, raw values and, for
// FoX, the log forget gate of each key (the attention call sums it in double, as in the
// forward). Under a sliding window every token is still kept; decoding reads only the last
// `window` of them. The arrays are in Space's memory (a device stack's make_cache gives
// device_space), the slots' lengths on the host.
template <class T, class Space = host_space>
class kv_cache {
  using A = accum_t<T>;

 public:
  kv_cache() = default;
  // Throws attnmix::error naming a bad size, or a capacity whose storage cannot be allocated.
  kv_cache(index_t sequences, index_t capacity, index_t q_heads, index_t kv_heads, index_t d) {
    const std::string fn = "attnmix::layers::kv_cache";
    attnmix::detail::require(kv_heads >= 1, fn, "kv_heads", "must be >= 1 but is ", kv_heads);
    attnmix::detail::require(q_heads >= 1 && q_heads % kv_heads == 0, fn, "q_heads",
                             "must be a positive multiple of kv_heads = ", kv_heads, " but is ",
                             q_heads);
    attnmix::detail::require(d >= 1, fn, "head_dim", "must be >= 1 but is ", d);
    detail::check_cache_size<Space>(
        fn, sequences, capacity,
        2 * kv_heads * d * index_t(sizeof(T)) + q_heads * index_t(sizeof(A)));
    detail::allocate_cache(fn, sequences, capacity, [&] {
      keys_.resize(sequences * capacity * kv_heads * d);
      values_.resize(sequences * capacity * kv_heads * d);
      gates_.resize(sequences * capacity * q_heads);
    });
    lengths_.assign(static_cast<std::size_t>(sequences), 0);
    n_ = sequences, cap_ = capacity, hq_ = q_heads, h_ = kv_heads, d_ = d;
  }
  kv_cache(const kv_cache&) = default;
  kv_cache& operator=(const kv_cache&) = default;
  // A moved-from cache holds no slots and fits no layer (its sizes are 0).
  kv_cache(kv_cache&& o) noexcept { *this = std::move(o); }
  kv_cache& operator=(kv_cache&& o) noexcept {
    if (this != &o) {
      n_ = std::exchange(o.n_, 0), cap_ = std::exchange(o.cap_, 0);
      hq_ = std::exchange(o.hq_, 0), h_ = std::exchange(o.h_, 0), d_ = std::exchange(o.d_, 0);
      keys_ = std::move(o.keys_), values_ = std::move(o.values_), gates_ = std::move(o.gates_);
      lengths_ = std::move(o.lengths_);
      o.lengths_.clear();
    }
    return *this;
  }

  index_t sequences() const { return n_; }
  index_t capacity() const { return cap_; }
  index_t length(index_t n) const { return lengths_[static_cast<std::size_t>(n)]; }
  void clear() { lengths_.assign(lengths_.size(), 0); }
  // The sizes it was made for, checked against the layer before a call writes anything.
  cache_layout layout() const { return {{"q_heads", hq_}, {"kv_heads", h_}, {"head_dim", d_}}; }

  // Token t of slot n (in Space's memory).
  T* key(index_t n, index_t t) { return keys_.data() + (n * cap_ + t) * h_ * d_; }
  T* value(index_t n, index_t t) { return values_.data() + (n * cap_ + t) * h_ * d_; }
  A* gate(index_t n, index_t t) { return gates_.data() + (n * cap_ + t) * hq_; }
  void set_length(index_t n, index_t len) { lengths_[static_cast<std::size_t>(n)] = len; }
  // Every slot's keys [N, capacity, H, D], values (likewise) and log gates [N, capacity, HQ], as
  // the attention call reads them with attention_params::key_slots and key_lengths.
  view4<const T> keys() const { return {keys_.data(), {n_, cap_, h_, d_}, Space::value}; }
  view4<const T> values() const { return {values_.data(), {n_, cap_, h_, d_}, Space::value}; }
  view3<const A> gates() const { return {gates_.data(), {n_, cap_, hq_}, Space::value}; }

 private:
  index_t n_ = 0, cap_ = 0, hq_ = 0, h_ = 0, d_ = 0;
  buffer<T, Space> keys_, values_;
  buffer<A, Space> gates_;
  std::vector<index_t> lengths_;
};

template <class T, class Policy = sa_layer_policy, class Backend = backend::cpu>
class attention_layer : public mixer_api<attention_layer<T, Policy, Backend>, T, Backend> {
  using K = typename Policy::kind;
  static constexpr bool fox = std::is_same_v<K, attnmix::kind::fox>;
  static_assert(
      std::is_same_v<K, attnmix::kind::softmax> || fox,
      "attnmix::layers::attention_layer: Policy::kind must be kind::softmax or kind::fox");
  static_assert(!fox || Policy::mask == mask_type::causal,
                "attnmix::layers::attention_layer: FoX is causal only");
  using A = accum_t<T>;
  using O = ops<Backend>;
  using space = typename Backend::memory_space;
  template <class, class, class>
  friend class attention_layer;

 public:
  static constexpr const char* name = Policy::name;
  static constexpr bool causal = Policy::mask == mask_type::causal;
  using policy = Policy;
  using kind = K;
  using backend_type = Backend;
  using attention_policy = with_mask<default_policy_t<K>, Policy::mask>;
  using cache_type = kv_cache<T, space>;
  // What backward_rows reads: the projections before the qk-norm, the attention's inputs and
  // output and its log-sum-exp, the forget gate's logits, the output gate's logits.
  struct saved_type {
    buffer<T, space> q_in, k_in, q, k, v, o, gate;  // [rows, heads * d]
    buffer<A, space> f, lse;                        // [rows, HQ]
    saved_origin origin;
  };

  attention_layer() = default;
  explicit attention_layer(const config& c)
      : D_(checked(std::string("attnmix::layers::") + name, c).hidden_size),
        HQ_(c.num_heads),
        H_(c.kv_heads()),
        d_(c.dim()),
        theta_(c.rope_theta),
        scale_(c.scale),
        window_(c.window),
        q_proj(D_, HQ_ * d_, Policy::qkv_bias),
        k_proj(D_, H_ * d_, Policy::qkv_bias),
        v_proj(D_, H_ * d_, Policy::qkv_bias),
        o_proj(HQ_ * d_, D_) {
    if constexpr (fox) f_proj = linear<T, Backend>(D_, HQ_, true);
    if constexpr (Policy::output_gate) g_proj = linear<T, Backend>(D_, HQ_ * d_);
    if constexpr (Policy::qk_norm) {
      q_norm = head_rms_norm<T, Backend>(HQ_, d_, fox, c.head_norm_eps);
      k_norm = head_rms_norm<T, Backend>(H_, d_, fox, c.head_norm_eps);
    }
  }
  // The same layer with every weight copied once to Backend's memory, projections in T.
  template <class U, class B>
  explicit attention_layer(const attention_layer<U, Policy, B>& o)
      : D_(o.D_),
        HQ_(o.HQ_),
        H_(o.H_),
        d_(o.d_),
        theta_(o.theta_),
        scale_(o.scale_),
        window_(o.window_),
        q_proj(o.q_proj),
        k_proj(o.k_proj),
        v_proj(o.v_proj),
        o_proj(o.o_proj),
        f_proj(o.f_proj),
        g_proj(o.g_proj),
        q_norm(o.q_norm),
        k_norm(o.k_norm) {}

  index_t hidden_size() const { return D_; }
  // What a saved state records of the layer that made it.
  std::array<index_t, 6> sizes() const { return {D_, HQ_, H_, d_, 0, 0}; }
  // Sliding window (config.window); 0: none.
  index_t window() const { return window_; }

  // A cache in the backend's memory.
  cache_type make_cache(index_t sequences, index_t capacity) const {
    static_assert(causal, "attnmix::layers::attention_layer: only causal layers have a cache");
    const std::string fn = std::string("attnmix::layers::") + name + "::make_cache";
    detail::check_cache_size<space>(fn, sequences, capacity,
                                    2 * H_ * d_ * index_t(sizeof(T)) + HQ_ * index_t(sizeof(A)));
    return cache_type(sequences, capacity, HQ_, H_, d_);
  }
  // Throws attnmix::error naming `what` unless `cache` was made by a layer of this layout.
  void check_cache(const std::string& fn, const char* arg, const std::string& what,
                   const cache_type& cache) const {
    detail::check_cache_layout(fn, arg, what, cache.layout(),
                               {{"q_heads", HQ_}, {"kv_heads", H_}, {"head_dim", d_}});
  }

  // y = mixer(x) on c.layout's rows (x, y: [rows, D], distinct); with `saved`, also what
  // backward_rows needs.
  void forward_rows(const context<Backend>& c, const T* x, T* y,
                    saved_type* saved = nullptr) const {
    if (saved != nullptr) saved->origin.made = false;
    run(c, x, y, nullptr, nullptr, saved);
    if (saved != nullptr) saved->origin.record(c.layout, sizes());
  }

  // Backward of forward_rows(c, x, y, &saved): every parameter's .grad added to, dx written (or
  // added with `accumulate`). dy, dx: [rows, D].
  void backward_rows(const context<Backend>& c, const T* x, const T* dy, T* dx,
                     const saved_type& sv, bool accumulate = false) {
    sv.origin.check(std::string("attnmix::layers::") + name + "::backward", "saved", c.layout,
                    sizes());
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    typename O::scratch sc(c.be, scratch_bytes<T>(nq) * 3 + scratch_bytes<T>(nk) * 2 +
                                     scratch_bytes<A>(rows * HQ_) * 2);
    T *t = sc.template take<T>(nq), *dout = sc.template take<T>(nq), *dq = sc.template take<T>(nq);
    T *dk = sc.template take<T>(nk), *dv = sc.template take<T>(nk);
    A *g = sc.template take<A>(rows * HQ_), *dg = sc.template take<A>(rows * HQ_);
    // o_proj: its input is the gated output (recomputed into t).
    const T* gated = sv.o.data();
    if constexpr (Policy::output_gate) {
      O::template map<fn::times_sigmoid>(c, t, sv.o.data(), sv.gate.data(), nq);
      gated = t;
    }
    o_proj.backward(c, gated, rows, dy, dout);
    bool first = !accumulate;  // the first contribution to dx writes it
    if constexpr (Policy::output_gate) {
      // d(gate logits) into t, d(o) in place of dout.
      O::template map_backward<fn::times_sigmoid>(c, dout, sv.o.data(), sv.gate.data(), dout, t,
                                                  nq);
      g_proj.backward(c, x, rows, t, dx, !first);
      first = false;
    }
    attention_grad_args<T> a;
    a.q = as_heads<Backend, const T>(sv.q.data(), L, HQ_, d_);
    a.k = as_heads<Backend, const T>(sv.k.data(), L, H_, d_);
    a.v = as_heads<Backend, const T>(sv.v.data(), L, H_, d_);
    a.out = as_heads<Backend, const T>(sv.o.data(), L, HQ_, d_);
    a.lse = as_rows<Backend, const A>(sv.lse.data(), L, HQ_);
    a.dout = as_heads<Backend, const T>(dout, L, HQ_, d_);
    a.dq = as_heads<Backend, T>(dq, L, HQ_, d_);
    a.dk = as_heads<Backend, T>(dk, L, H_, d_);
    a.dv = as_heads<Backend, T>(dv, L, H_, d_);
    if constexpr (fox) {  // the log forget gate, recomputed from its logits
      O::template map<fn::log_sigmoid>(c, g, sv.f.data(), static_cast<const A*>(nullptr),
                                       rows * HQ_);
      a.g = as_rows<Backend, const A>(g, L, HQ_);
      a.dg = as_rows<Backend, A>(dg, L, HQ_);
    }
    attnmix::attention_backward<K, attention_policy>(a, L.attention(scale_, window_), c.be);
    if constexpr (fox) {
      O::template map_backward<fn::log_sigmoid>(c, dg, sv.f.data(), static_cast<const A*>(nullptr),
                                                dg, static_cast<A*>(nullptr), rows * HQ_);
      f_proj.backward(c, x, rows, dg, dx, !first);
      first = false;
    }
    if constexpr (Policy::rope) {
      O::rope_backward(c, dq, rows, HQ_, d_, theta_);
      O::rope_backward(c, dk, rows, H_, d_, theta_);
    }
    if constexpr (Policy::qk_norm) {
      q_norm.backward(c, sv.q_in.data(), rows, dq, dq);
      k_norm.backward(c, sv.k_in.data(), rows, dk, dk);
    }
    q_proj.backward(c, x, rows, dq, dx, !first);
    k_proj.backward(c, x, rows, dk, dx, true);
    v_proj.backward(c, x, rows, dv, dx, true);
  }
  // slots[n]: the cache slot of sequence n.
  void prefill_rows(const context<Backend>& c, const T* x, T* y, cache_type& cache,
                    const std::vector<index_t>& slots) const {
    static_assert(causal, "attnmix::layers::attention_layer: only causal layers have a cache");
    run(c, x, y, &cache, &slots);
  }

  // x, y: [N, D] (N = c.rows()); row n appends one token to slot slots[n], at position
  // cache.length(slots[n]), and attends to that slot's last `window` tokens (all of them without
  // a window). c's positions are not read.
  void decode_rows(const context<Backend>& dc, const T* x, T* y, cache_type& cache,
                   const std::vector<index_t>& slots) const {
    static_assert(causal, "attnmix::layers::attention_layer: only causal layers decode");
    static_assert(takes_key_lengths<K, Backend>::value,
                  "attnmix::layers::attention_layer: decoding reads the cache's slots in place "
                  "(attention_params::key_slots), which this backend does not take");
    const index_t N = dc.rows();
    const token_layout L{N, 1, {}};
    std::vector<std::int32_t> pos(static_cast<std::size_t>(N)), lengths(pos.size()),
        rows(pos.size());
    std::vector<std::int64_t> at(pos.size());  // the cache row each new token goes to
    for (index_t n = 0; n < N; ++n) {
      const auto i = static_cast<std::size_t>(n);
      rows[i] = static_cast<std::int32_t>(slots[i]);
      pos[i] = static_cast<std::int32_t>(cache.length(slots[i]));
      lengths[i] = pos[i] + 1;
      at[i] = slots[i] * cache.capacity() + pos[i];
    }
    const index_t nq = N * HQ_ * d_, nk = N * H_ * d_;
    typename O::scratch sc(dc.be, scratch_bytes<T>(nq) * 2 + scratch_bytes<T>(nk) * 2 +
                                      scratch_bytes<A>(N * HQ_) + scratch_bytes<std::int32_t>(N) +
                                      scratch_bytes<std::int64_t>(N));
    T *q = sc.template take<T>(nq), *k = sc.template take<T>(nk), *v = sc.template take<T>(nk),
      *o = sc.template take<T>(nq);
    A* g = sc.template take<A>(N * HQ_);
    std::int32_t* dpos = sc.template take<std::int32_t>(N);
    std::int64_t* dat = sc.template take<std::int64_t>(N);
    O::upload(dc.be, dpos, pos.data(), N);
    O::upload(dc.be, dat, at.data(), N);
    const context<Backend> c{dc.be, L, dpos, dc.handles};
    project(c, x, q, k, v, g);
    store(c, k, v, g, cache, dat);
    for (index_t n = 0; n < N; ++n)
      cache.set_length(slots[static_cast<std::size_t>(n)], lengths[static_cast<std::size_t>(n)]);
    // The new token is the last of its slot's keys (bottom-right alignment).
    attention_args<T> a;
    a.q = as_heads<Backend, const T>(q, L, HQ_, d_);
    a.k = cache.keys();
    a.v = cache.values();
    a.out = as_heads<Backend, T>(o, L, HQ_, d_);
    if constexpr (fox) a.g = cache.gates();
    attention_params params = L.attention(scale_, window_);
    params.key_lengths = view1<const std::int32_t>(lengths.data(), {N});
    params.key_slots = view1<const std::int32_t>(rows.data(), {N});
    attnmix::attention<K, attention_policy>(a, params, c.be);
    finish(c, x, q, o, o, y);
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
  double theta_ = 10000.0;
  std::optional<double> scale_;
  index_t window_ = 0;

 public:
  linear<T, Backend> q_proj, k_proj, v_proj, o_proj, f_proj, g_proj;
  head_rms_norm<T, Backend> q_norm, k_norm;

 private:
  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    s.q_proj.visit_parameters(f, prefix + "q_proj.");
    s.k_proj.visit_parameters(f, prefix + "k_proj.");
    s.v_proj.visit_parameters(f, prefix + "v_proj.");
    if constexpr (fox) s.f_proj.visit_parameters(f, prefix + "f_proj.");
    if constexpr (Policy::output_gate) s.g_proj.visit_parameters(f, prefix + "g_proj.");
    if constexpr (Policy::qk_norm) {
      s.q_norm.visit_parameters(f, prefix + "q_norm.");
      s.k_norm.visit_parameters(f, prefix + "k_norm.");
    }
    s.o_proj.visit_parameters(f, prefix + "o_proj.");
  }

  // q, k, v (normed, rotated at c.positions) and, for FoX, the log forget gate g [rows, HQ].
  // With `sv`, also the projections before the qk-norm and the gate's logits.
  void project(const context<Backend>& c, const T* x, T* q, T* k, T* v, A* g,
               saved_type* sv = nullptr) const {
    const index_t rows = c.rows(), nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    q_proj.apply(c, x, rows, q);
    k_proj.apply(c, x, rows, k);
    v_proj.apply(c, x, rows, v);
    if constexpr (Policy::qk_norm) {
      if (sv != nullptr) {
        sv->q_in.resize(nq), sv->k_in.resize(nk);
        O::move_rows(c, q, sv->q_in.data(), nullptr, nullptr, rows, HQ_ * d_);
        O::move_rows(c, k, sv->k_in.data(), nullptr, nullptr, rows, H_ * d_);
      }
      q_norm.apply(c, q, rows, q);
      k_norm.apply(c, k, rows, k);
    }
    if constexpr (Policy::rope) {
      O::rope(c, q, rows, HQ_, d_, theta_);
      O::rope(c, k, rows, H_, d_, theta_);
    }
    if constexpr (fox) {
      f_proj.apply(c, x, rows, g);
      if (sv != nullptr)
        sv->f.resize(rows * HQ_), O::move_rows(c, g, sv->f.data(), nullptr, nullptr, rows, HQ_);
      O::template map<fn::log_sigmoid>(c, g, g, static_cast<const A*>(nullptr), rows * HQ_);
    }
    (void)g, (void)nq, (void)nk, (void)sv;
  }

  // Row r of k, v (and the log gates g) to cache row at[r] (backend memory) of a slot-major
  // [slots * capacity] array.
  void store(const context<Backend>& c, const T* k, const T* v, const A* g, cache_type& cache,
             const std::int64_t* at) const {
    const index_t rows = c.rows();
    const std::int64_t* in_order = nullptr;
    O::move_rows(c, k, cache.key(0, 0), in_order, at, rows, H_ * d_);
    O::move_rows(c, v, cache.value(0, 0), in_order, at, rows, H_ * d_);
    if constexpr (fox) O::move_rows(c, g, cache.gate(0, 0), in_order, at, rows, HQ_);
    (void)g;
  }

  // Output gate and o_proj: o [rows, HQ*d] -> y [rows, D]. The gate's logits go to `logits`,
  // the gated output to `gated` (either may be o's buffer when o is not needed again).
  void finish(const context<Backend>& c, const T* x, T* logits, T* o, T* gated, T* y) const {
    const index_t rows = c.rows();
    if constexpr (Policy::output_gate) {
      g_proj.apply(c, x, rows, logits);
      O::template map<fn::times_sigmoid>(c, gated, o, logits, rows * HQ_ * d_);
      o = gated;
    }
    (void)logits, (void)gated;
    o_proj.apply(c, o, rows, y);
  }

  // cache, slots: prefill (sequence n -> slot (*slots)[n]); both null: forward only. sv: the
  // forward of training, which keeps q, k, v, o, lse and the gates' logits in *sv. One scratch
  // allocation for the rest.
  void run(const context<Backend>& c, const T* x, T* y, cache_type* cache,
           const std::vector<index_t>* slots, saved_type* sv = nullptr) const {
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    const bool keep = sv != nullptr;
    typename O::scratch sc(c.be, (keep ? scratch_bytes<T>(nq) * (Policy::output_gate ? 1 : 0)
                                       : scratch_bytes<T>(nq) * 2 + scratch_bytes<T>(nk) * 2) +
                                     scratch_bytes<A>(rows * HQ_));
    if (keep) {
      for (auto* b : {&sv->q, &sv->o}) b->resize(nq);
      for (auto* b : {&sv->k, &sv->v}) b->resize(nk);
      sv->lse.resize(rows * HQ_);
      if constexpr (Policy::output_gate) sv->gate.resize(nq);
    }
    T* q = keep ? sv->q.data() : sc.template take<T>(nq);
    T* k = keep ? sv->k.data() : sc.template take<T>(nk);
    T* v = keep ? sv->v.data() : sc.template take<T>(nk);
    T* o = keep ? sv->o.data() : sc.template take<T>(nq);
    A* g = sc.template take<A>(rows * HQ_);
    project(c, x, q, k, v, g, sv);
    attention_args<T> a;
    a.q = as_heads<Backend, const T>(q, L, HQ_, d_);
    a.k = as_heads<Backend, const T>(k, L, H_, d_);
    a.v = as_heads<Backend, const T>(v, L, H_, d_);
    a.out = as_heads<Backend, T>(o, L, HQ_, d_);
    if (keep) a.lse = as_rows<Backend, A>(sv->lse.data(), L, HQ_);
    if constexpr (fox) a.g = as_rows<Backend, const A>(g, L, HQ_);
    attnmix::attention<K, attention_policy>(a, L.attention(scale_, window_), c.be);
    if constexpr (causal) {
      if (cache != nullptr) {  // token t of sequence n -> row t of slot slots[n]
        std::vector<std::int64_t> at(static_cast<std::size_t>(rows));
        for (index_t n = 0; n < L.num_sequences(); ++n) {
          const index_t r0 = L.first_row(n), sl = (*slots)[static_cast<std::size_t>(n)];
          for (index_t t = 0; t < L.seq(n).length; ++t)
            at[static_cast<std::size_t>(r0 + t)] = sl * cache->capacity() + t;
        }
        typename O::scratch rs(c.be, scratch_bytes<std::int64_t>(rows));
        std::int64_t* dat = rs.template take<std::int64_t>(rows);
        O::upload(c.be, dat, at.data(), rows);
        store(c, k, v, g, *cache, dat);
        for (index_t n = 0; n < L.num_sequences(); ++n)
          cache->set_length((*slots)[static_cast<std::size_t>(n)], L.seq(n).length);
      }
    }
    (void)cache;
    (void)slots;
    if (keep) {
      T* gated = Policy::output_gate ? sc.template take<T>(nq) : o;
      finish(c, x, Policy::output_gate ? sv->gate.data() : q, o, gated, y);
    } else {
      finish(c, x, q, o, o, y);  // q and o are free again
    }
  }
};

}  // namespace layers
}  // namespace attnmix
