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

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/attention/attention.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/cpu/fox.hpp"
#include "attnmix/cpu/softmax.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/detail/cpu_ops.hpp"
#include "attnmix/layers/linear.hpp"
#include "attnmix/layers/mixer.hpp"
#include "attnmix/layers/norm.hpp"

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
struct fox_layer_policy : sa_layer_policy {
  using kind = attnmix::kind::fox;
  static constexpr mask_type mask = mask_type::causal;
  static constexpr const char* name = "fox";
};

// KV cache of N slots, one sequence each: keys after qk-norm and RoPE, raw values and, for
// FoX, the inclusive cumsum G of the log forget gate (double, as in path_cache). Under a
// sliding window every token is still kept; decoding reads only the last `window` of them.
template <class T>
class kv_cache {
 public:
  kv_cache() = default;
  kv_cache(index_t sequences, index_t capacity, index_t q_heads, index_t kv_heads, index_t d)
      : n_(sequences),
        cap_(capacity),
        hq_(q_heads),
        h_(kv_heads),
        d_(d),
        keys_(static_cast<std::size_t>(sequences * capacity * kv_heads * d)),
        values_(keys_.size()),
        gates_(static_cast<std::size_t>(sequences * capacity * q_heads), 0.0),
        lengths_(static_cast<std::size_t>(sequences), 0) {}

  index_t sequences() const { return n_; }
  index_t capacity() const { return cap_; }
  index_t length(index_t n) const { return lengths_[static_cast<std::size_t>(n)]; }
  void clear() { lengths_.assign(lengths_.size(), 0); }

  T* key(index_t n, index_t t) { return keys_.data() + (n * cap_ + t) * h_ * d_; }
  T* value(index_t n, index_t t) { return values_.data() + (n * cap_ + t) * h_ * d_; }
  double* gate(index_t n, index_t t) { return gates_.data() + (n * cap_ + t) * hq_; }
  void set_length(index_t n, index_t len) { lengths_[static_cast<std::size_t>(n)] = len; }

 private:
  index_t n_ = 0, cap_ = 0, hq_ = 0, h_ = 0, d_ = 0;
  std::vector<T> keys_, values_;
  std::vector<double> gates_;
  std::vector<index_t> lengths_;
};

template <class T, class Policy = sa_layer_policy>
class attention_layer : public mixer_api<attention_layer<T, Policy>, T> {
  using K = typename Policy::kind;
  static constexpr bool fox = std::is_same_v<K, attnmix::kind::fox>;
  static_assert(
      std::is_same_v<K, attnmix::kind::softmax> || fox,
      "attnmix::layers::attention_layer: Policy::kind must be kind::softmax or kind::fox");
  static_assert(!fox || Policy::mask == mask_type::causal,
                "attnmix::layers::attention_layer: FoX is causal only");

 public:
  static constexpr const char* name = Policy::name;
  static constexpr bool causal = Policy::mask == mask_type::causal;
  using policy = Policy;
  using kind = K;
  using attention_policy = with_mask<default_policy_t<K>, Policy::mask>;
  using cache_type = kv_cache<T>;

  attention_layer() = default;
  explicit attention_layer(const config& c)
      : D_(c.hidden_size),
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
    validate_config(std::string("attnmix::layers::") + name, c);
    if constexpr (fox) f_proj = linear<T>(D_, HQ_, true);
    if constexpr (Policy::output_gate) g_proj = linear<T>(D_, HQ_ * d_);
    if constexpr (Policy::qk_norm) {
      q_norm = head_rms_norm<T>(HQ_, d_, fox, c.head_norm_eps);
      k_norm = head_rms_norm<T>(H_, d_, fox, c.head_norm_eps);
    }
  }

  index_t hidden_size() const { return D_; }
  // Sliding window (config.window); 0: none.
  index_t window() const { return window_; }

  cache_type make_cache(index_t sequences, index_t capacity) const {
    static_assert(causal, "attnmix::layers::attention_layer: only causal layers have a cache");
    return cache_type(sequences, capacity, HQ_, H_, d_);
  }

  void forward_rows(const T* x, T* y, const token_layout& L, const backend::cpu& be) const {
    run(x, y, L, nullptr, nullptr, be);
  }
  // slots[n]: the cache slot of sequence n.
  void prefill_rows(const T* x, T* y, const token_layout& L, cache_type& cache,
                    const std::vector<index_t>& slots, const backend::cpu& be) const {
    static_assert(causal, "attnmix::layers::attention_layer: only causal layers have a cache");
    run(x, y, L, &cache, &slots, be);
  }

  // x, y: [N, D]; row n appends one token to slot slots[n], at position cache.length(slots[n]),
  // and attends to that slot's last `window` tokens (all of them without a window).
  void decode_rows(const T* x, T* y, index_t N, cache_type& cache,
                   const std::vector<index_t>& slots, const backend::cpu& be) const {
    static_assert(causal, "attnmix::layers::attention_layer: only causal layers decode");
    using A = accum_t<T>;
    token_layout L{N, 1, {}};
    const auto slot = [&](index_t n) {
      return slots[static_cast<std::size_t>(n)];
    };
    std::vector<index_t> pos(static_cast<std::size_t>(N));
    for (index_t n = 0; n < N; ++n) pos[static_cast<std::size_t>(n)] = cache.length(slot(n));
    projections p = project(x, L, pos, be);
    for (index_t n = 0; n < N; ++n) {
      const index_t s = slot(n), t = cache.length(s);
      std::copy_n(p.k.data() + n * H_ * d_, H_ * d_, cache.key(s, t));
      std::copy_n(p.v.data() + n * H_ * d_, H_ * d_, cache.value(s, t));
      for (index_t hq = 0; hq < HQ_; ++hq)
        cache.gate(s, t)[hq] = (t > 0 ? cache.gate(s, t - 1)[hq] : 0.0) +
                               (fox ? double(p.g[static_cast<std::size_t>(n * HQ_ + hq)]) : 0.0);
      cache.set_length(s, t + 1);
    }
    const double s = scale_ ? *scale_ : 1.0 / std::sqrt(double(d_));
    std::vector<T> o(static_cast<std::size_t>(N * HQ_ * d_));
    const index_t group = HQ_ / H_;
    const int workers = attnmix::detail::cpu::worker_count(be, N * HQ_);
    attnmix::detail::cpu::parallel_for(N * HQ_, workers, [&](index_t task, int) {
      const index_t n = task / HQ_, hq = task % HQ_, h = hq / group, sl = slot(n);
      const index_t len = cache.length(sl);
      // The new token sits at position len - 1 and sees keys len-1-window < j <= len-1.
      const index_t j0 = window_ > 0 ? std::max<index_t>(0, len - window_) : 0;
      const T* q = p.q.data() + (n * HQ_ + hq) * d_;
      const double Gt = cache.gate(sl, len - 1)[hq];
      std::vector<A> z(static_cast<std::size_t>(len - j0));
      A zmax = -std::numeric_limits<A>::infinity();
      for (index_t j = j0; j < len; ++j) {
        const T* kj = cache.key(sl, j) + h * d_;
        A dot = 0;
        for (index_t c = 0; c < d_; ++c) dot += A(q[c]) * A(kj[c]);
        A zj = A(s) * dot;
        if constexpr (fox) zj += A(Gt - cache.gate(sl, j)[hq]);
        z[static_cast<std::size_t>(j - j0)] = zj;
        zmax = std::max(zmax, zj);
      }
      std::vector<A> acc(static_cast<std::size_t>(d_), A(0));
      A den = 0;
      for (index_t j = j0; j < len; ++j) {
        const A e = std::exp(z[static_cast<std::size_t>(j - j0)] - zmax);
        den += e;
        const T* vj = cache.value(sl, j) + h * d_;
        for (index_t c = 0; c < d_; ++c) acc[static_cast<std::size_t>(c)] += e * A(vj[c]);
      }
      T* out = o.data() + (n * HQ_ + hq) * d_;
      for (index_t c = 0; c < d_; ++c)
        out[c] = static_cast<T>(acc[static_cast<std::size_t>(c)] / den);
    });
    finish(x, o.data(), N, y, be);
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
  linear<T> q_proj, k_proj, v_proj, o_proj, f_proj, g_proj;
  head_rms_norm<T> q_norm, k_norm;

 private:
  struct projections {
    std::vector<T> q, k, v;
    std::vector<accum_t<T>> g;  // FoX: log forget gate [rows, HQ]
  };

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

  // q, k, v (normed, rotated) and g of every row; pos: position of each row in its sequence.
  projections project(const T* x, const token_layout& L, const std::vector<index_t>& pos,
                      const backend::cpu& be) const {
    const index_t rows = L.rows();
    projections p;
    p.q.resize(static_cast<std::size_t>(rows * HQ_ * d_));
    p.k.resize(static_cast<std::size_t>(rows * H_ * d_));
    p.v.resize(p.k.size());
    q_proj.apply(x, rows, p.q.data(), be);
    k_proj.apply(x, rows, p.k.data(), be);
    v_proj.apply(x, rows, p.v.data(), be);
    if constexpr (Policy::qk_norm) {
      q_norm.apply(p.q.data(), rows, p.q.data(), be);
      k_norm.apply(p.k.data(), rows, p.k.data(), be);
    }
    if constexpr (Policy::rope) {
      detail::rope_rows(p.q.data(), rows, HQ_, d_, pos.data(), theta_);
      detail::rope_rows(p.k.data(), rows, H_, d_, pos.data(), theta_);
    }
    if constexpr (fox) {
      std::vector<T> f(static_cast<std::size_t>(rows * HQ_));
      f_proj.apply(x, rows, f.data(), be);
      p.g.resize(f.size());
      for (std::size_t i = 0; i < f.size(); ++i) p.g[i] = detail::log_sigmoid(accum_t<T>(f[i]));
    }
    (void)pos;
    return p;
  }

  // Output gate and o_proj: o [rows, HQ*d] -> y [rows, D].
  void finish(const T* x, T* o, index_t rows, T* y, const backend::cpu& be) const {
    if constexpr (Policy::output_gate) {
      std::vector<T> g(static_cast<std::size_t>(rows * HQ_ * d_));
      g_proj.apply(x, rows, g.data(), be);
      for (std::size_t i = 0; i < g.size(); ++i)
        o[i] = static_cast<T>(accum_t<T>(o[i]) * detail::sigmoid(accum_t<T>(g[i])));
    }
    o_proj.apply(o, rows, y, be);
  }

  // cache, slots: prefill (sequence n -> slot (*slots)[n]); both null: forward only.
  void run(const T* x, T* y, const token_layout& L, cache_type* cache,
           const std::vector<index_t>* slots, const backend::cpu& be) const {
    const index_t rows = L.rows();
    projections p = project(x, L, detail::positions(L), be);
    std::vector<T> o(static_cast<std::size_t>(rows * HQ_ * d_));
    attention_args<T> a;
    a.q = view4<const T>(p.q.data(), {L.batch, L.tokens, HQ_, d_});
    a.k = view4<const T>(p.k.data(), {L.batch, L.tokens, H_, d_});
    a.v = view4<const T>(p.v.data(), {L.batch, L.tokens, H_, d_});
    a.out = view4<T>(o.data(), {L.batch, L.tokens, HQ_, d_});
    if constexpr (fox) a.g = view3<const accum_t<T>>(p.g.data(), {L.batch, L.tokens, HQ_});
    attnmix::attention<K, attention_policy>(a, L.attention(scale_, window_), be);
    if (cache != nullptr) {
      for (index_t n = 0; n < L.num_sequences(); ++n) {
        const index_t r0 = L.first_row(n), len = L.seq(n).length,
                      sl = (*slots)[static_cast<std::size_t>(n)];
        std::vector<double> G(static_cast<std::size_t>(HQ_), 0.0);
        for (index_t t = 0; t < len; ++t) {
          std::copy_n(p.k.data() + (r0 + t) * H_ * d_, H_ * d_, cache->key(sl, t));
          std::copy_n(p.v.data() + (r0 + t) * H_ * d_, H_ * d_, cache->value(sl, t));
          for (index_t hq = 0; hq < HQ_; ++hq) {
            if constexpr (fox)
              G[static_cast<std::size_t>(hq)] +=
                  double(p.g[static_cast<std::size_t>((r0 + t) * HQ_ + hq)]);
            cache->gate(sl, t)[hq] = G[static_cast<std::size_t>(hq)];
          }
        }
        cache->set_length(sl, len);
      }
    }
    finish(x, o.data(), rows, y, be);
  }
};

}  // namespace layers
}  // namespace attnmix
