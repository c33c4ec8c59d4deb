#pragma once
// Linear-attention mixer layers: BLA, GBLA (spec/gbla.md §2.1) and causal linear attention.
// GBLA, on the block's normed input u:
//   c = SiLU(conv1d(u))         depthwise causal conv, kernel 4, "conv1d.weight" [D, 1, 4],
//                               restarting at sequence starts (Policy::use_conv)
//   q = q_proj c [HQ*d], k = k_proj c [H*d], v = v_proj c [H*d]           (no bias)
//   a = a_proj u [Hg]           key-gate logits (Hg = 1 shared, H per head; no bias)
//   g = g_proj u [HQ*d]         output gate of the gated RMSNorm, weight "o_norm.weight" [d]
//   y = o_proj linear_attention<Kind, Policy::core>(q, k, v, a, g, o_norm.weight)
// The ablation switches are the policy's: use_conv, and the core policy's key gate, gated norm,
// normaliser and feature map (core/linear_policy.hpp). BLA is GBLA with all of them off.
// The causal kind keeps (S, z, lse) per sequence and KV head, plus the conv state, to decode.

#include <algorithm>
#include <array>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/attention/linear_attention.hpp"
#include "attnmix/attention/linear_attention_backward.hpp"
#include "attnmix/core/linear_policy.hpp"
#include "attnmix/layers/cache_layout.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/linear.hpp"
#include "attnmix/layers/mixer.hpp"
#include "attnmix/layers/ops.hpp"
#include "attnmix/layers/short_conv.hpp"

namespace attnmix {
namespace layers {

struct gbla_layer_policy {
  using kind = attnmix::kind::gbla;
  using core = gbla_policy;
  static constexpr bool use_conv = true;
  static constexpr index_t conv_size = 4;
  static constexpr bool conv_silu = true;
  static constexpr const char* name = "gbla";
};
struct bla_layer_policy : gbla_layer_policy {
  using kind = attnmix::kind::bla;
  using core = bla_policy;
  static constexpr bool use_conv = false;
  static constexpr const char* name = "bla";
};
struct linear_causal_layer_policy : gbla_layer_policy {
  using kind = attnmix::kind::linear_causal;
  using core = linear_causal_policy;
  static constexpr bool use_conv = false;
  static constexpr const char* name = "linear_causal";
};

// Decoding state of a causal linear-attention layer: N slots of one sequence each, in Space's
// memory (the slots' lengths on the host).
template <class T, class Space = host_space>
class linear_layer_cache {
  using A = accum_t<T>;

 public:
  linear_layer_cache() = default;
  // Empty states (S, z zero, lse -inf), or (empty false) states left for the caller to write.
  linear_layer_cache(index_t n, index_t capacity, index_t heads, index_t d,
                     conv_state<T, Space> conv, bool empty = true)
      : conv(std::move(conv)),
        n_(n),
        cap_(capacity),
        h_(heads),
        d_(d),
        lengths_(static_cast<std::size_t>(n), 0) {
    if (empty) {
      S.assign(n * heads * d * d, A(0));
      z.assign(n * heads * d, A(0));
      lse.assign(n * heads, -std::numeric_limits<A>::infinity());
    } else {
      S.resize(n * heads * d * d), z.resize(n * heads * d), lse.resize(n * heads);
    }
  }

  index_t sequences() const { return n_; }
  index_t capacity() const { return cap_; }
  index_t length(index_t n) const { return lengths_[static_cast<std::size_t>(n)]; }
  void set_length(index_t n, index_t len) { lengths_[static_cast<std::size_t>(n)] = len; }
  cache_layout layout() const {
    return {{"kv_heads", h_},
            {"head_dim", d_},
            {"conv sequences", conv.sequences},
            {"conv taps", conv.taps},
            {"conv channels", conv.channels}};
  }

  // The states of the first N slots (all of them by default) as the front door's views.
  linear_state<A> state(index_t N = -1) {
    if (N < 0) N = n_;
    return {view4<A>(S.data(), {N, h_, d_, d_}, Space::value),
            view3<A>(z.data(), {N, h_, d_}, Space::value),
            tensor_view<A, 2>(lse.data(), {N, h_}, Space::value)};
  }

  // Slots slots[0..N) as a cache of N sequences (in that order), on c's backend.
  template <class Backend>
  linear_layer_cache gather(const context<Backend>& c, const std::vector<index_t>& slots) const {
    const auto N = static_cast<index_t>(slots.size());
    linear_layer_cache out(N, cap_, h_, d_, layers::gather(c, conv, slots), false);
    move_states(c, *this, out, slots, true);
    for (index_t n = 0; n < N; ++n) out.set_length(n, length(slots[static_cast<std::size_t>(n)]));
    return out;
  }
  // Sequence n of `from` (state and length) into slot slots[n]; the other slots are left as
  // they are.
  template <class Backend>
  void scatter(const context<Backend>& c, const linear_layer_cache& from,
               const std::vector<index_t>& slots) {
    layers::scatter(c, from.conv, conv, slots);
    move_states(c, from, *this, slots, false);
    for (std::size_t n = 0; n < slots.size(); ++n)
      set_length(slots[n], from.length(static_cast<index_t>(n)));
  }

  conv_state<T, Space> conv;

 private:
  template <class Backend>
  static void move_states(const context<Backend>& c, const linear_layer_cache& from,
                          linear_layer_cache& to, const std::vector<index_t>& slots, bool gather) {
    const index_t hd = from.h_ * from.d_;
    detail::move_slots(c, from.S.data(), to.S.data(), slots, hd * from.d_, gather);
    detail::move_slots(c, from.z.data(), to.z.data(), slots, hd, gather);
    detail::move_slots(c, from.lse.data(), to.lse.data(), slots, from.h_, gather);
  }

  index_t n_ = 0, cap_ = 0, h_ = 0, d_ = 0;

 public:
  buffer<A, Space> S, z, lse;

 private:
  std::vector<index_t> lengths_;
};

template <class T, class Policy = gbla_layer_policy, class Backend = backend::cpu>
class linear_layer : public mixer_api<linear_layer<T, Policy, Backend>, T, Backend> {
  using K = typename Policy::kind;
  using Core = typename Policy::core;
  using A = accum_t<T>;
  using O = ops<Backend>;
  using space = typename Backend::memory_space;
  static constexpr bool gated = Core::gate != key_gate::off;
  static constexpr bool normed = Core::norm != gated_norm::off;
  template <class, class, class>
  friend class linear_layer;

 public:
  static constexpr const char* name = Policy::name;
  static constexpr bool causal = linear_kind_traits<K>::causal;
  using policy = Policy;
  using kind = K;
  using backend_type = Backend;
  using cache_type = linear_layer_cache<T, space>;
  // What backward_rows reads: the conv's output, q, k, v, the gates' inputs, the core's output
  // and, for the bidirectional kinds, the state (S, z, lse) that the backward would recompute.
  struct saved_type {
    buffer<T, space> conv, q, k, v, g, o;
    buffer<A, space> a, S, z, lse;
    saved_origin origin;
  };

  linear_layer() = default;
  explicit linear_layer(const config& c)
      : D_(checked(std::string("attnmix::layers::") + name, c).hidden_size),
        HQ_(c.num_heads),
        H_(c.kv_heads()),
        d_(c.dim()),
        norm_eps_(c.head_norm_eps),
        q_proj(D_, HQ_ * d_),
        k_proj(D_, H_ * d_),
        v_proj(D_, H_ * d_),
        o_proj(HQ_ * d_, D_) {
    if constexpr (Policy::use_conv)
      conv1d = short_conv<T, Backend>(D_, Policy::conv_size, Policy::conv_silu);
    if constexpr (gated) a_proj = linear<T, Backend>(D_, Core::gate == key_gate::shared ? 1 : H_);
    if constexpr (normed) {
      g_proj = linear<T, Backend>(D_, HQ_ * d_);
      o_norm_weight =
          parameter<A, space>({Core::weight == norm_weight::shared ? d_ : HQ_ * d_}, A(1));
    }
  }
  // The same layer with every weight copied once to Backend's memory, projections in T.
  template <class U, class B>
  explicit linear_layer(const linear_layer<U, Policy, B>& o)
      : D_(o.D_),
        HQ_(o.HQ_),
        H_(o.H_),
        d_(o.d_),
        norm_eps_(o.norm_eps_),
        conv1d(o.conv1d),
        q_proj(o.q_proj),
        k_proj(o.k_proj),
        v_proj(o.v_proj),
        o_proj(o.o_proj),
        a_proj(o.a_proj),
        g_proj(o.g_proj),
        o_norm_weight(o.o_norm_weight) {}

  index_t hidden_size() const { return D_; }
  // What a saved state records of the layer that made it.
  std::array<index_t, 6> sizes() const {
    return {D_, HQ_, H_, d_, gated ? a_proj.out_features() : 0, normed ? o_norm_weight.numel() : 0};
  }

  cache_type make_cache(index_t sequences, index_t capacity) const {
    static_assert(causal, "attnmix::layers::linear_layer: only causal layers have a cache");
    const std::string fn = std::string("attnmix::layers::") + name + "::make_cache";
    detail::check_cache_size<space>(
        fn, sequences, capacity, 0,
        (H_ * d_ * d_ + H_ * d_ + H_) * index_t(sizeof(A)) +
            (Policy::use_conv ? Policy::conv_size : 1) * D_ * index_t(sizeof(T)));
    return detail::allocate_cache(fn, sequences, capacity, [&] {
      return cache_type(
          sequences, capacity, H_, d_,
          conv_state<T, space>(sequences, Policy::use_conv ? Policy::conv_size : 1, D_));
    });
  }
  void check_cache(const std::string& fn, const char* arg, const std::string& what,
                   const cache_type& cache) const {
    detail::check_cache_layout(fn, arg, what, cache.layout(),
                               {{"kv_heads", H_},
                                {"head_dim", d_},
                                {"conv sequences", cache.sequences()},
                                {"conv taps", Policy::use_conv ? Policy::conv_size - 1 : 0},
                                {"conv channels", D_}});
  }

  // y = mixer(x) on c.layout's rows (x, y: [rows, D], distinct); with `saved`, also what
  // backward_rows needs.
  void forward_rows(const context<Backend>& c, const T* x, T* y,
                    saved_type* saved = nullptr) const {
    if (saved != nullptr) saved->origin.made = false;
    run(c, x, y, nullptr, false, saved);
    if (saved != nullptr) saved->origin.record(c.layout, sizes());
  }

  // Backward of forward_rows(c, x, y, &saved): every parameter's .grad added to, dx written (or
  // added with `accumulate`). dy, dx: [rows, D].
  void backward_rows(const context<Backend>& c, const T* u, const T* dy, T* du,
                     const saved_type& sv, bool accumulate = false) {
    sv.origin.check(std::string("attnmix::layers::") + name + "::backward", "saved", c.layout,
                    sizes());
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    const index_t Hg = gated ? a_proj.out_features() : 0;
    const index_t ngamma = normed ? o_norm_weight.numel() : 0;
    typename O::scratch sc(c.be, scratch_bytes<T>(Policy::use_conv ? rows * D_ : 0) +
                                     scratch_bytes<T>(nq) * (normed ? 3 : 2) +
                                     scratch_bytes<T>(nk) * 2 + scratch_bytes<A>(rows * Hg) +
                                     scratch_bytes<A>(ngamma));
    T* dconv = Policy::use_conv ? sc.template take<T>(rows * D_) : nullptr;
    T *dout = sc.template take<T>(nq), *dq = sc.template take<T>(nq);
    T *dk = sc.template take<T>(nk), *dv = sc.template take<T>(nk);
    o_proj.backward(c, sv.o.data(), rows, dy, dout);
    linear_attention_grad_args<T> a;
    a.q = as_heads<Backend, const T>(sv.q.data(), L, HQ_, d_);
    a.k = as_heads<Backend, const T>(sv.k.data(), L, H_, d_);
    a.v = as_heads<Backend, const T>(sv.v.data(), L, H_, d_);
    a.dout = as_heads<Backend, const T>(dout, L, HQ_, d_);
    a.dq = as_heads<Backend, T>(dq, L, HQ_, d_);
    a.dk = as_heads<Backend, T>(dk, L, H_, d_);
    a.dv = as_heads<Backend, T>(dv, L, H_, d_);
    A* da = gated ? sc.template take<A>(rows * Hg) : nullptr;
    T* dg = normed ? sc.template take<T>(nq) : nullptr;
    A* dgamma = normed ? sc.template take<A>(ngamma) : nullptr;
    if constexpr (gated) {
      a.a = as_rows<Backend, const A>(sv.a.data(), L, Hg);
      a.da = as_rows<Backend, A>(da, L, Hg);
    }
    if constexpr (normed) {
      a.gate = as_heads<Backend, const T>(sv.g.data(), L, HQ_, d_);
      a.dgate = as_heads<Backend, T>(dg, L, HQ_, d_);
      a.gamma = view1<const A>(o_norm_weight.ptr(), {ngamma}, space_of_v<Backend>);
      a.dgamma = view1<A>(dgamma, {ngamma}, space_of_v<Backend>);
    }
    if constexpr (!causal) a.saved = saved_state(sv, L.num_sequences());
    linear_attention_params p;
    p.norm_eps = norm_eps_;
    p.cu_seqlens = L.cu_view();
    attnmix::linear_attention_backward<K, Core>(a, p, c.be);
    bool first = !accumulate;  // the first contribution to du writes it
    if constexpr (normed) {
      A* grad = o_norm_weight.grad_ptr();
      O::template map<fn::plus>(c, grad, grad, dgamma, ngamma);
      g_proj.backward(c, u, rows, dg, du, !first);
      first = false;
    }
    if constexpr (gated) {
      a_proj.backward(c, u, rows, da, du, !first);
      first = false;
    }
    // q, k, v read the conv's output (or u itself).
    const T* cin = Policy::use_conv ? sv.conv.data() : u;
    T* dcin = Policy::use_conv ? dconv : du;
    const bool acc = Policy::use_conv ? false : !first;
    q_proj.backward(c, cin, rows, dq, dcin, acc);
    k_proj.backward(c, cin, rows, dk, dcin, true);
    v_proj.backward(c, cin, rows, dv, dcin, true);
    if constexpr (Policy::use_conv) conv1d.backward(c, u, dconv, du, !first);
  }
  // slots[n]: the cache slot of sequence n. A mapped call runs on a compact copy of the mapped
  // slots (a state is O(H d^2), what one step reads anyway) and writes it back.
  void prefill_rows(const context<Backend>& c, const T* x, T* y, cache_type& cache,
                    const std::vector<index_t>& slots) const {
    static_assert(causal, "attnmix::layers::linear_layer: only causal layers have a cache");
    const token_layout& L = c.layout;
    if (!detail::identity_slots(slots)) {
      cache_type tmp = make_cache(L.num_sequences(), cache.capacity());
      run(c, x, y, &tmp, false);
      for (index_t n = 0; n < L.num_sequences(); ++n) tmp.set_length(n, L.seq(n).length);
      cache.scatter(c, tmp, slots);
      return;
    }
    run(c, x, y, &cache, false);
    for (index_t n = 0; n < L.num_sequences(); ++n) cache.set_length(n, L.seq(n).length);
  }
  // x, y: [N, D] (N = c.rows()); row n is the next token of the sequence in slot slots[n].
  void decode_rows(const context<Backend>& c, const T* x, T* y, cache_type& cache,
                   const std::vector<index_t>& slots) const {
    static_assert(causal, "attnmix::layers::linear_layer: only causal layers decode");
    const index_t N = c.rows();
    if (!detail::identity_slots(slots) || N != cache.sequences()) {
      cache_type tmp = cache.gather(c, slots);
      run(c, x, y, &tmp, true);
      for (index_t n = 0; n < N; ++n) tmp.set_length(n, tmp.length(n) + 1);
      cache.scatter(c, tmp, slots);
      return;
    }
    run(c, x, y, &cache, true);
    for (index_t n = 0; n < N; ++n) cache.set_length(n, cache.length(n) + 1);
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
  double norm_eps_ = 1e-5;

 public:
  short_conv<T, Backend> conv1d;
  linear<T, Backend> q_proj, k_proj, v_proj, o_proj, a_proj, g_proj;
  parameter<A, space> o_norm_weight;  // "o_norm.weight"

 private:
  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    if constexpr (Policy::use_conv) s.conv1d.visit_parameters(f, prefix + "conv1d.");
    s.q_proj.visit_parameters(f, prefix + "q_proj.");
    s.k_proj.visit_parameters(f, prefix + "k_proj.");
    s.v_proj.visit_parameters(f, prefix + "v_proj.");
    if constexpr (gated) s.a_proj.visit_parameters(f, prefix + "a_proj.");
    if constexpr (normed) {
      s.g_proj.visit_parameters(f, prefix + "g_proj.");
      f(prefix + "o_norm.weight", s.o_norm_weight);
    }
    s.o_proj.visit_parameters(f, prefix + "o_proj.");
  }

  // The bidirectional state a training forward kept, as the backward's `saved`.
  linear_state<const A> saved_state(const saved_type& sv, index_t N) const {
    linear_state<const A> st;
    st.S = view4<const A>(sv.S.data(), {N, H_, d_, d_}, space_of_v<Backend>);
    if (Core::normalize) st.z = view3<const A>(sv.z.data(), {N, H_, d_}, space_of_v<Backend>);
    if (gated) st.lse = tensor_view<const A, 2>(sv.lse.data(), {N, H_}, space_of_v<Backend>);
    return st;
  }

  // cache: with step, continue from its state and conv state (one token per
  // sequence); without, start fresh and leave the final states there. sv: a training forward,
  // which keeps its intermediate tensors there.
  // One scratch allocation: the conv output, q, k, v, o, the output gate and the key-gate logits.
  void run(const context<Backend>& c, const T* u, T* y, cache_type* cache, bool step,
           saved_type* sv = nullptr) const {
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    const index_t Hg = gated ? a_proj.out_features() : 0;
    const bool keep = sv != nullptr;
    typename O::scratch sc(c.be, keep ? 0
                                      : scratch_bytes<T>(Policy::use_conv ? rows * D_ : 0) +
                                            scratch_bytes<T>(nq) * (normed ? 3 : 2) +
                                            scratch_bytes<T>(nk) * 2 + scratch_bytes<A>(rows * Hg));
    if (keep) {
      if (Policy::use_conv) sv->conv.resize(rows * D_);
      for (auto* b : {&sv->q, &sv->o}) b->resize(nq);
      for (auto* b : {&sv->k, &sv->v}) b->resize(nk);
      if (normed) sv->g.resize(nq);
      if (gated) sv->a.resize(rows * Hg);
      if (!causal) {
        const index_t N = L.num_sequences();
        sv->S.resize(N * H_ * d_ * d_), sv->z.resize(N * H_ * d_), sv->lse.resize(N * H_);
      }
    }
    const T* cin = u;
    if constexpr (Policy::use_conv) {
      T* conv = keep ? sv->conv.data() : sc.template take<T>(rows * D_);
      if constexpr (causal) {
        if (step)
          conv1d.step(c, u, conv, cache->conv);
        else
          conv1d.apply(c, u, conv, cache ? &cache->conv : nullptr);
      } else {
        conv1d.apply(c, u, conv);
      }
      cin = conv;
    }
    T* q = keep ? sv->q.data() : sc.template take<T>(nq);
    T* k = keep ? sv->k.data() : sc.template take<T>(nk);
    T* v = keep ? sv->v.data() : sc.template take<T>(nk);
    T* o = keep ? sv->o.data() : sc.template take<T>(nq);
    q_proj.apply(c, cin, rows, q);
    k_proj.apply(c, cin, rows, k);
    v_proj.apply(c, cin, rows, v);
    linear_attention_args<T> args;
    args.q = as_heads<Backend, const T>(q, L, HQ_, d_);
    args.k = as_heads<Backend, const T>(k, L, H_, d_);
    args.v = as_heads<Backend, const T>(v, L, H_, d_);
    args.out = as_heads<Backend, T>(o, L, HQ_, d_);
    if constexpr (gated) {
      A* logits = keep ? sv->a.data() : sc.template take<A>(rows * Hg);
      a_proj.apply(c, u, rows, logits);
      args.a = as_rows<Backend, const A>(logits, L, Hg);
    }
    if constexpr (normed) {
      T* g = keep ? sv->g.data() : sc.template take<T>(nq);
      g_proj.apply(c, u, rows, g);
      args.gate = as_heads<Backend, const T>(g, L, HQ_, d_);
      args.gamma =
          view1<const A>(o_norm_weight.ptr(), {o_norm_weight.numel()}, space_of_v<Backend>);
    }
    if constexpr (causal) {
      if (cache != nullptr) {
        // The state views cover exactly the call's sequences (the first slots).
        const linear_state<A> st = cache->state(L.num_sequences());
        if (step) {
          args.state_in = {st.S, st.z,
                           gated ? tensor_view<const A, 2>(st.lse) : tensor_view<const A, 2>()};
        }
        args.state_out = {st.S, st.z, gated ? st.lse : tensor_view<A, 2>()};
      }
    }
    if constexpr (!causal) {
      if (keep) {
        const index_t N = L.num_sequences();
        args.state_out.S = view4<A>(sv->S.data(), {N, H_, d_, d_}, space_of_v<Backend>);
        if (Core::normalize)
          args.state_out.z = view3<A>(sv->z.data(), {N, H_, d_}, space_of_v<Backend>);
        if (gated)
          args.state_out.lse = tensor_view<A, 2>(sv->lse.data(), {N, H_}, space_of_v<Backend>);
      }
    }
    (void)cache;
    (void)step;
    linear_attention_params p;
    p.norm_eps = norm_eps_;
    p.cu_seqlens = L.cu_view();
    attnmix::linear_attention<K, Core>(args, p, c.be);
    o_proj.apply(c, o, rows, y);
  }
};

}  // namespace layers
}  // namespace attnmix
