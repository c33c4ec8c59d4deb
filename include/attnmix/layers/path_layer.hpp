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

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/path_cache.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/cpu/path.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/detail/cpu_ops.hpp"
#include "attnmix/layers/linear.hpp"
#include "attnmix/layers/mixer.hpp"
#include "attnmix/layers/norm.hpp"
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

// Decoding state of a PaTH layer: N slots of one sequence each.
template <class T>
struct path_layer_cache {
  path_cache<T> attn;
  conv_state<T> conv;
  index_t sequences() const { return attn.slots(); }
  index_t capacity() const { return attn.capacity(); }
  index_t length(index_t n) const { return attn.length(n); }
};

template <class T, class Policy = path_layer_policy>
class path_layer : public mixer_api<path_layer<T, Policy>, T> {
  using K = typename Policy::kind;
  static constexpr bool gated = kind_traits<K>::uses_forget_gate;
  static_assert(kind_traits<K>::uses_householder,
                "attnmix::layers::path_layer: Policy::kind must be kind::path or kind::path_fox");
  using A = accum_t<T>;

 public:
  static constexpr const char* name = Policy::name;
  static constexpr bool causal = true;
  using policy = Policy;
  using kind = K;
  using cache_type = path_layer_cache<T>;

  path_layer() = default;
  explicit path_layer(const config& c)
      : D_(c.hidden_size),
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
    validate_config(std::string("attnmix::layers::") + name, c);
    if (low_rank_) {
      w_proj_down = linear<T>(D_, c.w_rank);
      w_proj = linear<T>(c.w_rank, H_ * d_);
    } else {
      w_proj = linear<T>(D_, H_ * d_);
    }
    if constexpr (Policy::w_shortconv) w_conv1d = short_conv<T>(H_ * d_, Policy::conv_size, true);
    if constexpr (gated) g_proj = linear<T>(D_, HQ_, true);
    if constexpr (Policy::qk_norm) {
      maybe_q_norm = rms_norm<T>(HQ_ * d_, c.head_norm_eps);
      maybe_k_norm = rms_norm<T>(H_ * d_, c.head_norm_eps);
    }
  }

  index_t hidden_size() const { return D_; }

  cache_type make_cache(index_t sequences, index_t capacity) const {
    return {path_cache<T>(sequences, capacity, HQ_, H_, d_, d_),
            conv_state<T>(sequences, Policy::conv_size, H_ * d_)};
  }

  void forward_rows(const T* x, T* y, const token_layout& L, const backend::cpu& be) const {
    run(x, y, L, nullptr, nullptr, be);
  }
  // slots[n]: the cache slot of sequence n.
  void prefill_rows(const T* x, T* y, const token_layout& L, cache_type& cache,
                    const std::vector<index_t>& slots, const backend::cpu& be) const {
    run(x, y, L, &cache, &slots, be);
  }
  // x, y: [N, D]; row n is the next token of the sequence in slot slots[n].
  void decode_rows(const T* x, T* y, index_t N, cache_type& cache,
                   const std::vector<index_t>& slots, const backend::cpu& be) const {
    const token_layout L{N, 1, {}};
    // The conv state is small: a mapped step runs on a gathered copy.
    const bool in_place = detail::identity_slots(slots) && N == cache.conv.sequences;
    conv_state<T> conv = in_place ? conv_state<T>() : cache.conv.gather(slots);
    inputs in = project(x, L, in_place ? &cache.conv : &conv, true, be);
    if (!in_place) cache.conv.scatter(conv, slots);
    std::vector<T> o(static_cast<std::size_t>(N * HQ_ * d_));
    attention_args<T> a = args(in, N, 1, o.data());
    attention_params p;
    p.scale = scale_;
    const std::vector<std::int32_t> where = int32_slots(slots);
    path_decode_step<K, typename Policy::attention_policy>(
        cache.attn, a, view1<const std::int32_t>(where.data(), {N}), p, be);
    o_proj.apply(o.data(), N, y, be);
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
  linear<T> q_proj, k_proj, v_proj, o_proj, bt_proj, g_proj;
  linear<T> w_proj_down;  // "w_proj.0" (low rank only)
  linear<T> w_proj;       // "w_proj.1" (low rank) or "w_proj"
  short_conv<T> w_conv1d;
  rms_norm<T> maybe_q_norm, maybe_k_norm;  // Policy::qk_norm only

 private:
  struct inputs {
    std::vector<T> q, k, v;
    std::vector<A> w, beta, g;
  };

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

  // step: conv state given and advanced by one token (decoding); else the conv runs over L and
  // writes its final state to `conv` when given.
  inputs project(const T* x, const token_layout& L, conv_state<T>* conv, bool step,
                 const backend::cpu& be) const {
    const index_t rows = L.rows(), kv = H_ * d_;
    inputs in;
    in.q.resize(static_cast<std::size_t>(rows * HQ_ * d_));
    in.k.resize(static_cast<std::size_t>(rows * kv));
    in.v.resize(in.k.size());
    q_proj.apply(x, rows, in.q.data(), be);
    k_proj.apply(x, rows, in.k.data(), be);
    v_proj.apply(x, rows, in.v.data(), be);
    if constexpr (Policy::qk_norm) {
      maybe_q_norm.apply(in.q.data(), rows, in.q.data(), be);
      maybe_k_norm.apply(in.k.data(), rows, in.k.data(), be);
    }
    std::vector<T> w(static_cast<std::size_t>(rows * kv));
    if (low_rank_) {
      std::vector<T> r(static_cast<std::size_t>(rows * w_proj_down.out_features()));
      w_proj_down.apply(x, rows, r.data(), be);
      w_proj.apply(r.data(), rows, w.data(), be);
    } else {
      w_proj.apply(x, rows, w.data(), be);
    }
    if constexpr (Policy::w_shortconv) {
      std::vector<T> c(w.size());
      if (step)
        w_conv1d.step(w.data(), c.data(), rows, *conv, be);
      else
        w_conv1d.apply(w.data(), c.data(), L, be, conv);
      w.swap(c);
    }
    in.w.assign(w.begin(), w.end());
    detail::l2_norm_groups(in.w.data(), rows * H_, d_, 1e-6);
    std::vector<T> b(static_cast<std::size_t>(rows * H_));
    bt_proj.apply(x, rows, b.data(), be);
    in.beta.resize(b.size());
    for (std::size_t i = 0; i < b.size(); ++i) in.beta[i] = A(2) * detail::sigmoid(A(b[i]));
    if constexpr (gated) {
      std::vector<T> g(static_cast<std::size_t>(rows * HQ_));
      g_proj.apply(x, rows, g.data(), be);
      in.g.resize(g.size());
      for (std::size_t i = 0; i < g.size(); ++i) in.g[i] = detail::log_sigmoid(A(g[i]));
    }
    return in;
  }

  attention_args<T> args(const inputs& in, index_t B, index_t Tn, T* o) const {
    attention_args<T> a;
    a.q = view4<const T>(in.q.data(), {B, Tn, HQ_, d_});
    a.k = view4<const T>(in.k.data(), {B, Tn, H_, d_});
    a.v = view4<const T>(in.v.data(), {B, Tn, H_, d_});
    a.w = view4<const A>(in.w.data(), {B, Tn, H_, d_});
    a.beta = view3<const A>(in.beta.data(), {B, Tn, H_});
    if constexpr (gated) a.g = view3<const A>(in.g.data(), {B, Tn, HQ_});
    a.out = view4<T>(o, {B, Tn, HQ_, d_});
    return a;
  }

  static std::vector<std::int32_t> int32_slots(const std::vector<index_t>& slots) {
    return std::vector<std::int32_t>(slots.begin(), slots.end());
  }

  // cache, slots: prefill (sequence n -> slot (*slots)[n]); both null: forward only.
  void run(const T* x, T* y, const token_layout& L, cache_type* cache,
           const std::vector<index_t>* slots, const backend::cpu& be) const {
    const index_t rows = L.rows();
    const bool in_place = cache == nullptr || detail::identity_slots(*slots);
    conv_state<T> conv =
        in_place ? conv_state<T>() : conv_state<T>(L.num_sequences(), Policy::conv_size, H_ * d_);
    conv_state<T>* conv_out = cache == nullptr ? nullptr : in_place ? &cache->conv : &conv;
    inputs in = project(x, L, conv_out, false, be);
    if (!in_place) cache->conv.scatter(conv, *slots);
    std::vector<T> o(static_cast<std::size_t>(rows * HQ_ * d_));
    const attention_args<T> a = args(in, L.batch, L.tokens, o.data());
    if (cache != nullptr) {
      const std::vector<std::int32_t> where = int32_slots(*slots);
      path_prefill<K, typename Policy::attention_policy>(
          cache->attn, a, view1<const std::int32_t>(where.data(), {L.num_sequences()}),
          L.attention(scale_), be);
    } else {
      attnmix::attention<K, typename Policy::attention_policy>(a, L.attention(scale_), be);
    }
    o_proj.apply(o.data(), rows, y, be);
  }
};

}  // namespace layers
}  // namespace attnmix
