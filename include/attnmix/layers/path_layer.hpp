#pragma once
// PaTH and PaTH-FoX mixer layers with fla's parameter names (fla/layers/path_attn.py;
// spec/path_fox.md §2-3):
//   q = q_proj x [HQ*d], k = k_proj x [H*d], v = v_proj x [H*d]            (no bias)
//   optional qk-norm (Policy::qk_norm): q, k through RMSNorms of their full width
//   w = w_proj x: rank-32 low-rank "w_proj.0" [r, D] then "w_proj.1" [H*d, r] under MHA
//       (HQ == H), a full "w_proj" [H*d, D] under GQA (fla's rule);
//       then the short conv "w_conv1d" [H*d, 1, 3] with SiLU (Policy::w_shortconv), restarting
//       at sequence starts; then the per-head L2 norm w / sqrt(|w|^2 + 1e-6)
//   beta = 2 sigmoid(bt_proj x) [H]          (bt_proj has a bias)
//   PaTH-FoX: g = logsigmoid(g_proj x) [HQ]  (g_proj has a bias)
//   y = o_proj attention<path / path_fox>(q, k, v, w, beta[, g])
// Decoding keeps the PaTH key cache (attention/path_cache.hpp) and the conv's rolling state.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/attention_backward.hpp"
#include "attnmix/attention/path_cache.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/layers/cache_layout.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/linear.hpp"
#include "attnmix/layers/mixer.hpp"
#include "attnmix/layers/norm.hpp"
#include "attnmix/layers/ops.hpp"
#include "attnmix/layers/short_conv.hpp"

namespace attnmix {
namespace layers {

struct path_layer_policy {
  using kind = attnmix::kind::path;
  using attention_policy = path_policy;
  static constexpr bool w_shortconv = true;
  static constexpr index_t conv_size = 3;
  // fla's use_qk_norm: RMSNorm over the whole q [HQ*d] and k [H*d] ("maybe_q_norm",
  // "maybe_k_norm"; eps config.head_norm_eps).
  static constexpr bool qk_norm = false;
  static constexpr const char* name = "path";
};
struct path_fox_layer_policy : path_layer_policy {
  using kind = attnmix::kind::path_fox;
  using attention_policy = path_fox_policy;
  static constexpr const char* name = "path_fox";
};

// Decoding state of a PaTH layer: N slots of one sequence each, in Space's memory (a device
// cache holds float or bfloat16).
template <class T, class Space = host_space>
struct path_layer_cache {
  path_cache<T, Space> attn;
  conv_state<T, Space> conv;
  index_t sequences() const { return attn.slots(); }
  index_t capacity() const { return attn.capacity(); }
  index_t length(index_t n) const { return attn.length(n); }
  cache_layout layout() const {
    return {{"q_heads", attn.q_heads()},        {"kv_heads", attn.kv_heads()},
            {"head_dim", attn.head_dim()},      {"value_dim", attn.value_dim()},
            {"conv sequences", conv.sequences}, {"conv taps", conv.taps},
            {"conv channels", conv.channels}};
  }
};

template <class T, class Policy = path_layer_policy, class Backend = backend::cpu>
class path_layer : public mixer_api<path_layer<T, Policy, Backend>, T, Backend> {
  using K = typename Policy::kind;
  static constexpr bool gated = kind_traits<K>::uses_forget_gate;
  static_assert(kind_traits<K>::uses_householder,
                "attnmix::layers::path_layer: Policy::kind must be kind::path or kind::path_fox");
  using A = accum_t<T>;
  using O = ops<Backend>;
  using space = typename Backend::memory_space;
  template <class, class, class>
  friend class path_layer;

 public:
  static constexpr const char* name = Policy::name;
  static constexpr bool causal = true;
  using policy = Policy;
  using kind = K;
  using backend_type = Backend;
  using cache_type = path_layer_cache<T, space>;
  // What backward_rows reads: the projections before their norms, activations and the conv,
  // the attention's inputs, output and log-sum-exp.
  struct saved_type {
    buffer<T, space> q_in, k_in, q, k, v, o, wd, r;  // r: the low-rank w projection's middle
    buffer<A, space> w_in, w, beta_in, beta, g_in, g, lse;
    saved_origin origin;
  };

  path_layer() = default;
  explicit path_layer(const config& c)
      : D_(checked(std::string("attnmix::layers::") + name, c).hidden_size),
        HQ_(c.num_heads),
        H_(c.kv_heads()),
        d_(c.dim()),
        scale_(c.scale),
        low_rank_(c.num_heads == c.kv_heads()),
        q_proj(D_, HQ_ * d_),
        k_proj(D_, H_ * d_),
        v_proj(D_, H_ * d_),
        o_proj(HQ_ * d_, D_),
        bt_proj(D_, H_, true) {
    if (low_rank_) {
      w_proj_down = linear<T, Backend>(D_, c.w_rank);
      w_proj = linear<T, Backend>(c.w_rank, H_ * d_);
    } else {
      w_proj = linear<T, Backend>(D_, H_ * d_);
    }
    if constexpr (Policy::w_shortconv)
      w_conv1d = short_conv<T, Backend>(H_ * d_, Policy::conv_size, true);
    if constexpr (gated) g_proj = linear<T, Backend>(D_, HQ_, true);
    if constexpr (Policy::qk_norm) {
      maybe_q_norm = rms_norm<T, Backend>(HQ_ * d_, c.head_norm_eps);
      maybe_k_norm = rms_norm<T, Backend>(H_ * d_, c.head_norm_eps);
    }
  }
  // The same layer with every weight copied once to Backend's memory, projections in T.
  template <class U, class B>
  explicit path_layer(const path_layer<U, Policy, B>& o)
      : D_(o.D_),
        HQ_(o.HQ_),
        H_(o.H_),
        d_(o.d_),
        scale_(o.scale_),
        low_rank_(o.low_rank_),
        q_proj(o.q_proj),
        k_proj(o.k_proj),
        v_proj(o.v_proj),
        o_proj(o.o_proj),
        bt_proj(o.bt_proj),
        g_proj(o.g_proj),
        w_proj_down(o.w_proj_down),
        w_proj(o.w_proj),
        w_conv1d(o.w_conv1d),
        maybe_q_norm(o.maybe_q_norm),
        maybe_k_norm(o.maybe_k_norm) {}

  index_t hidden_size() const { return D_; }
  // What a saved state records of the layer that made it.
  std::array<index_t, 6> sizes() const {
    return {D_, HQ_, H_, d_, low_rank_ ? w_proj_down.out_features() : 0, 0};
  }

  // A cache in the backend's memory.
  cache_type make_cache(index_t sequences, index_t capacity) const {
    const std::string fn = std::string("attnmix::layers::") + name + "::make_cache";
    detail::check_cache_size<space>(fn, sequences, capacity,
                                    (4 * H_ * d_ + 2 * HQ_ + 2 * H_) * index_t(sizeof(double)),
                                    Policy::conv_size * H_ * d_ * index_t(sizeof(T)));
    return detail::allocate_cache(fn, sequences, capacity, [&] {
      return cache_type{path_cache<T, space>(sequences, capacity, HQ_, H_, d_, d_),
                        conv_state<T, space>(sequences, Policy::conv_size, H_ * d_)};
    });
  }
  void check_cache(const std::string& fn, const char* arg, const std::string& what,
                   const cache_type& cache) const {
    detail::check_cache_layout(fn, arg, what, cache.layout(),
                               {{"q_heads", HQ_},
                                {"kv_heads", H_},
                                {"head_dim", d_},
                                {"value_dim", d_},
                                {"conv sequences", cache.sequences()},
                                {"conv taps", Policy::conv_size - 1},
                                {"conv channels", H_ * d_}});
  }

  // y = mixer(x) on c.layout's rows (x, y: [rows, D], distinct).
  // y = mixer(x) on c.layout's rows; with `saved`, also what backward_rows needs.
  void forward_rows(const context<Backend>& c, const T* x, T* y,
                    saved_type* saved = nullptr) const {
    if (saved == nullptr) return run(c, x, y, nullptr, nullptr);
    saved->origin.made = false;
    const token_layout& L = c.layout;
    const index_t rows = L.rows();
    const buffers b = take(*saved, rows);
    project(c, x, b, nullptr, false, saved);
    attention_args<T> a = args(b, L);
    a.lse = as_rows<Backend, A>(saved->lse.data(), L, HQ_);
    attnmix::attention<K, typename Policy::attention_policy>(a, L.attention(scale_), c.be);
    o_proj.apply(c, b.o, rows, y);
    saved->origin.record(L, sizes());
  }

  // Backward of forward_rows(c, x, y, &saved): every parameter's .grad added to, dx written (or
  // added with `accumulate`). dy, dx: [rows, D].
  void backward_rows(const context<Backend>& c, const T* x, const T* dy, T* dx,
                     const saved_type& sv, bool accumulate = false) {
    sv.origin.check(std::string("attnmix::layers::") + name + "::backward", "saved", c.layout,
                    sizes());
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    const index_t nr = low_rank_ ? rows * w_proj_down.out_features() : 0;
    typename O::scratch sc(c.be, scratch_bytes<T>(nq) * 2 + scratch_bytes<T>(nk) * 3 +
                                     scratch_bytes<T>(nr) + scratch_bytes<A>(nk) * 2 +
                                     scratch_bytes<A>(rows * H_) + scratch_bytes<A>(rows * HQ_));
    T *dout = sc.template take<T>(nq), *dq = sc.template take<T>(nq);
    T *dk = sc.template take<T>(nk), *dv = sc.template take<T>(nk), *dwd = sc.template take<T>(nk);
    T* dr = sc.template take<T>(nr);
    A *dw = sc.template take<A>(nk), *dw_in = sc.template take<A>(nk);
    A *dbeta = sc.template take<A>(rows * H_), *dg = sc.template take<A>(rows * HQ_);
    o_proj.backward(c, sv.o.data(), rows, dy, dout);
    attention_grad_args<T> a;
    a.q = as_heads<Backend, const T>(sv.q.data(), L, HQ_, d_);
    a.k = as_heads<Backend, const T>(sv.k.data(), L, H_, d_);
    a.v = as_heads<Backend, const T>(sv.v.data(), L, H_, d_);
    a.w = as_heads<Backend, const A>(sv.w.data(), L, H_, d_);
    a.beta = as_rows<Backend, const A>(sv.beta.data(), L, H_);
    a.out = as_heads<Backend, const T>(sv.o.data(), L, HQ_, d_);
    a.lse = as_rows<Backend, const A>(sv.lse.data(), L, HQ_);
    a.dout = as_heads<Backend, const T>(dout, L, HQ_, d_);
    a.dq = as_heads<Backend, T>(dq, L, HQ_, d_);
    a.dk = as_heads<Backend, T>(dk, L, H_, d_);
    a.dv = as_heads<Backend, T>(dv, L, H_, d_);
    a.dw = as_heads<Backend, A>(dw, L, H_, d_);
    a.dbeta = as_rows<Backend, A>(dbeta, L, H_);
    if constexpr (gated) {
      a.g = as_rows<Backend, const A>(sv.g.data(), L, HQ_);
      a.dg = as_rows<Backend, A>(dg, L, HQ_);
    }
    attnmix::attention_backward<K, typename Policy::attention_policy>(a, L.attention(scale_), c.be);
    bool first = !accumulate;  // the first contribution to dx writes it
    if constexpr (gated) {
      O::template map_backward<fn::log_sigmoid>(c, dg, sv.g_in.data(),
                                                static_cast<const A*>(nullptr), dg,
                                                static_cast<A*>(nullptr), rows * HQ_);
      g_proj.backward(c, x, rows, dg, dx, !first);
      first = false;
    }
    O::template map_backward<fn::two_sigmoid>(c, dbeta, sv.beta_in.data(),
                                              static_cast<const A*>(nullptr), dbeta,
                                              static_cast<A*>(nullptr), rows * H_);
    bt_proj.backward(c, x, rows, dbeta, dx, !first);
    // w = l2norm(conv(wd)): back through the norm, the conv, the projection(s).
    O::norm_backward(c, sv.w_in.data(), dw, dw_in, rows * H_, d_, static_cast<const A*>(nullptr),
                     false, 1, false, 1e-6, static_cast<A*>(nullptr));
    if constexpr (Policy::w_shortconv)
      w_conv1d.backward(c, sv.wd.data(), dw_in, dwd);
    else
      O::move_rows(c, dw_in, dwd, nullptr, nullptr, rows, H_ * d_);
    if (low_rank_) {
      w_proj.backward(c, sv.r.data(), rows, dwd, dr);
      w_proj_down.backward(c, x, rows, dr, dx, true);
    } else {
      w_proj.backward(c, x, rows, dwd, dx, true);
    }
    if constexpr (Policy::qk_norm) {
      maybe_q_norm.backward(c, sv.q_in.data(), rows, dq, dq);
      maybe_k_norm.backward(c, sv.k_in.data(), rows, dk, dk);
    }
    q_proj.backward(c, x, rows, dq, dx, true);
    k_proj.backward(c, x, rows, dk, dx, true);
    v_proj.backward(c, x, rows, dv, dx, true);
  }
  // slots[n]: the cache slot of sequence n.
  void prefill_rows(const context<Backend>& c, const T* x, T* y, cache_type& cache,
                    const std::vector<index_t>& slots) const {
    run(c, x, y, &cache, &slots);
  }
  // x, y: [N, D] (N = c.rows()); row n is the next token of the sequence in slot slots[n].
  void decode_rows(const context<Backend>& c, const T* x, T* y, cache_type& cache,
                   const std::vector<index_t>& slots) const {
    const token_layout& L = c.layout;
    const index_t N = c.rows();
    typename O::scratch sc(c.be, scratch_size(N));
    const buffers b = take(sc, N);
    // The conv state is small: a mapped step runs on a gathered copy.
    const bool in_place = detail::identity_slots(slots) && N == cache.conv.sequences;
    conv_state<T, space> conv = in_place ? conv_state<T, space>() : gather(c, cache.conv, slots);
    project(c, x, b, in_place ? &cache.conv : &conv, true);
    if (!in_place) scatter(c, conv, cache.conv, slots);
    attention_args<T> a = args(b, L);
    attention_params p;
    p.scale = scale_;
    const std::vector<std::int32_t> where = int32_slots(slots);
    path_decode_step<K, typename Policy::attention_policy>(
        cache.attn, a, view1<const std::int32_t>(where.data(), {N}), p, c.be);
    o_proj.apply(c, b.o, N, y);
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
  bool low_rank_ = true;

 public:
  linear<T, Backend> q_proj, k_proj, v_proj, o_proj, bt_proj, g_proj;
  linear<T, Backend> w_proj_down;  // "w_proj.0" (low rank only)
  linear<T, Backend> w_proj;       // "w_proj.1" (low rank) or "w_proj"
  short_conv<T, Backend> w_conv1d;
  rms_norm<T, Backend> maybe_q_norm, maybe_k_norm;  // Policy::qk_norm only

 private:
  // The rows of one call, carved from one scratch allocation: q, k, v, the attention output o,
  // w before the conv (wd) and the low-rank middle r in T; w, beta and g in accum_t<T>.
  struct buffers {
    T *q, *k, *v, *o, *wd, *r;
    A *w, *beta, *g;
  };
  std::size_t scratch_size(index_t rows) const {
    const index_t nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    return scratch_bytes<T>(nq) * 2 + scratch_bytes<T>(nk) * 3 +
           scratch_bytes<T>(rows * w_proj_down.out_features()) + scratch_bytes<A>(nk) +
           scratch_bytes<A>(rows * (H_ + HQ_));
  }
  template <class Scratch>
  buffers take(Scratch& s, index_t rows) const {
    const index_t nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    buffers b{};
    b.q = s.template take<T>(nq);
    b.k = s.template take<T>(nk);
    b.v = s.template take<T>(nk);
    b.o = s.template take<T>(nq);
    b.wd = s.template take<T>(nk);
    b.r = low_rank_ ? s.template take<T>(rows * w_proj_down.out_features()) : nullptr;
    b.w = s.template take<A>(nk);
    b.beta = s.template take<A>(rows * (H_ + HQ_));
    b.g = b.beta + rows * H_;
    return b;
  }

  // The buffers of a training forward, in `sv` (the same roles as take's).
  buffers take(saved_type& sv, index_t rows) const {
    const index_t nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    for (auto* x : {&sv.q, &sv.o}) x->resize(nq);
    for (auto* x : {&sv.k, &sv.v, &sv.wd}) x->resize(nk);
    for (auto* x : {&sv.w, &sv.w_in}) x->resize(nk);
    sv.beta.resize(rows * H_), sv.beta_in.resize(rows * H_);
    sv.g.resize(rows * HQ_), sv.g_in.resize(rows * HQ_), sv.lse.resize(rows * HQ_);
    if (low_rank_) sv.r.resize(rows * w_proj_down.out_features());
    if constexpr (Policy::qk_norm) sv.q_in.resize(nq), sv.k_in.resize(nk);
    buffers b{};
    b.q = sv.q.data(), b.k = sv.k.data(), b.v = sv.v.data(), b.o = sv.o.data();
    b.wd = sv.wd.data(), b.r = low_rank_ ? sv.r.data() : nullptr;
    b.w = sv.w.data(), b.beta = sv.beta.data(), b.g = sv.g.data();
    return b;
  }

  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    s.q_proj.visit_parameters(f, prefix + "q_proj.");
    s.k_proj.visit_parameters(f, prefix + "k_proj.");
    s.v_proj.visit_parameters(f, prefix + "v_proj.");
    if (s.low_rank_) {
      s.w_proj_down.visit_parameters(f, prefix + "w_proj.0.");
      s.w_proj.visit_parameters(f, prefix + "w_proj.1.");
    } else {
      s.w_proj.visit_parameters(f, prefix + "w_proj.");
    }
    if constexpr (Policy::qk_norm) {
      s.maybe_q_norm.visit_parameters(f, prefix + "maybe_q_norm.");
      s.maybe_k_norm.visit_parameters(f, prefix + "maybe_k_norm.");
    }
    if constexpr (Policy::w_shortconv) s.w_conv1d.visit_parameters(f, prefix + "w_conv1d.");
    s.bt_proj.visit_parameters(f, prefix + "bt_proj.");
    if constexpr (gated) s.g_proj.visit_parameters(f, prefix + "g_proj.");
    s.o_proj.visit_parameters(f, prefix + "o_proj.");
  }

  // q, k, v, then w: low-rank (or full) projection, short conv with SiLU, per-head L2 norm (in
  // accum_t); beta = 2 sigmoid(bt_proj x); PaTH-FoX: g = logsigmoid(g_proj x).
  // conv: with step, the rolling state, advanced by one token (decoding); else
  // it receives the conv's final state.
  // sv: a training forward, which also keeps the inputs of the norms and activations.
  void project(const context<Backend>& c, const T* x, const buffers& b, conv_state<T, space>* conv,
               bool step, saved_type* sv = nullptr) const {
    const index_t rows = c.rows(), nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    q_proj.apply(c, x, rows, b.q);
    k_proj.apply(c, x, rows, b.k);
    v_proj.apply(c, x, rows, b.v);
    if constexpr (Policy::qk_norm) {
      if (sv != nullptr) {
        O::move_rows(c, b.q, sv->q_in.data(), nullptr, nullptr, rows, HQ_ * d_);
        O::move_rows(c, b.k, sv->k_in.data(), nullptr, nullptr, rows, H_ * d_);
      }
      maybe_q_norm.apply(c, b.q, rows, b.q);
      maybe_k_norm.apply(c, b.k, rows, b.k);
    }
    if (low_rank_) {
      w_proj_down.apply(c, x, rows, b.r);
      w_proj.apply(c, b.r, rows, b.wd);
    } else {
      w_proj.apply(c, x, rows, b.wd);
    }
    if constexpr (Policy::w_shortconv) {
      if (step)
        w_conv1d.step(c, b.wd, b.w, *conv);
      else
        w_conv1d.apply(c, b.wd, b.w, conv);
    } else {
      O::move_rows(c, b.wd, b.w, nullptr, nullptr, rows, H_ * d_);
    }
    (void)conv;
    (void)step;
    if (sv != nullptr) O::move_rows(c, b.w, sv->w_in.data(), nullptr, nullptr, rows, H_ * d_);
    O::norm(c, b.w, b.w, rows * H_, d_, static_cast<const A*>(nullptr), false, 1, false, 1e-6);
    bt_proj.apply(c, x, rows, b.beta);
    if (sv != nullptr) O::move_rows(c, b.beta, sv->beta_in.data(), nullptr, nullptr, rows, H_);
    O::template map<fn::two_sigmoid>(c, b.beta, b.beta, static_cast<const A*>(nullptr), rows * H_);
    if constexpr (gated) {
      g_proj.apply(c, x, rows, b.g);
      if (sv != nullptr) O::move_rows(c, b.g, sv->g_in.data(), nullptr, nullptr, rows, HQ_);
      O::template map<fn::log_sigmoid>(c, b.g, b.g, static_cast<const A*>(nullptr), rows * HQ_);
    }
    (void)nq, (void)nk, (void)sv;
  }

  attention_args<T> args(const buffers& b, const token_layout& L) const {
    attention_args<T> a;
    a.q = as_heads<Backend, const T>(b.q, L, HQ_, d_);
    a.k = as_heads<Backend, const T>(b.k, L, H_, d_);
    a.v = as_heads<Backend, const T>(b.v, L, H_, d_);
    a.w = as_heads<Backend, const A>(b.w, L, H_, d_);
    a.beta = as_rows<Backend, const A>(b.beta, L, H_);
    if constexpr (gated) a.g = as_rows<Backend, const A>(b.g, L, HQ_);
    a.out = as_heads<Backend, T>(b.o, L, HQ_, d_);
    return a;
  }

  static std::vector<std::int32_t> int32_slots(const std::vector<index_t>& slots) {
    return std::vector<std::int32_t>(slots.begin(), slots.end());
  }

  // cache, slots: prefill (sequence n -> slot (*slots)[n]); both null: forward only.
  void run(const context<Backend>& c, const T* x, T* y, cache_type* cache,
           const std::vector<index_t>* slots) const {
    const token_layout& L = c.layout;
    const index_t rows = L.rows();
    typename O::scratch sc(c.be, scratch_size(rows));
    const buffers b = take(sc, rows);
    const bool in_place = cache == nullptr || detail::identity_slots(*slots);
    conv_state<T, space> conv =
        in_place ? conv_state<T, space>()
                 : conv_state<T, space>(L.num_sequences(), Policy::conv_size, H_ * d_, false);
    conv_state<T, space>* conv_out = cache == nullptr ? nullptr : in_place ? &cache->conv : &conv;
    project(c, x, b, conv_out, false);
    if (!in_place) scatter(c, conv, cache->conv, *slots);
    const attention_args<T> a = args(b, L);
    if (cache != nullptr) {
      const std::vector<std::int32_t> where = int32_slots(*slots);
      path_prefill<K, typename Policy::attention_policy>(
          cache->attn, a, view1<const std::int32_t>(where.data(), {L.num_sequences()}),
          L.attention(scale_), c.be);
      o_proj.apply(c, b.o, rows, y);
      return;
    }
    (void)slots;
    attnmix::attention<K, typename Policy::attention_policy>(a, L.attention(scale_), c.be);
    o_proj.apply(c, b.o, rows, y);
  }
};

}  // namespace layers
}  // namespace attnmix
