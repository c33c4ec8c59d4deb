#pragma once
// Float64 oracles of the layers and stacks, written from spec/path_fox.md §2 and
// spec/gbla.md §2, §5 with plain loops over std::vector<double>. Parameters come by name from
// a map (the model's parameters, converted to double); the attention cores are the float64
// oracles of tests/reference/. Shares no code with include/attnmix/layers.

#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/linear_reference.hpp"
#include "reference/path_reference.hpp"
#include "reference/softmax_reference.hpp"

namespace layer_ref {

using vec = std::vector<double>;
using params = std::map<std::string, vec>;

struct dims {
  long D, HQ, H, d;
  double norm_eps = 1e-6, head_eps = 1e-5, rope_theta = 10000;
  long w_rank = 32;
  long window = 0;  // SA / FoX sliding window (softmax_problem::window); 0: none
};

// Sequences of a batch: B rows of T tokens, or packed offsets (B == 1).
struct layout {
  long B, T;
  std::vector<long> cu;                              // empty: dense
  std::vector<std::pair<long, long>> seqs() const {  // (first row, length)
    std::vector<std::pair<long, long>> s;
    if (cu.empty())
      for (long b = 0; b < B; ++b) s.push_back({b * T, T});
    else
      for (std::size_t n = 0; n + 1 < cu.size(); ++n) s.push_back({cu[n], cu[n + 1] - cu[n]});
    return s;
  }
};

inline const vec& get(const params& p, const std::string& name) {
  auto it = p.find(name);
  if (it == p.end()) throw std::runtime_error("layer_ref: no parameter " + name);
  return it->second;
}
inline bool has(const params& p, const std::string& name) {
  return p.count(name) != 0;
}

inline double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
inline double silu(double x) {
  return x * sigmoid(x);
}

// y [rows, out] = x [rows, in] W^T + b
inline vec linear(const vec& x, long rows, long in, const vec& W, long out,
                  const vec* b = nullptr) {
  vec y(rows * out, 0.0);
  for (long r = 0; r < rows; ++r)
    for (long o = 0; o < out; ++o) {
      double s = b ? (*b)[o] : 0.0;
      for (long i = 0; i < in; ++i) s += x[r * in + i] * W[o * in + i];
      y[r * out + o] = s;
    }
  return y;
}
inline vec proj(const params& p, const std::string& name, const vec& x, long rows, long in) {
  const vec& W = get(p, name + ".weight");
  const long out = static_cast<long>(W.size()) / in;
  return linear(x, rows, in, W, out, has(p, name + ".bias") ? &get(p, name + ".bias") : nullptr);
}

// RMSNorm over groups of `width`; w of width (shared) or of groups_per_row * width.
inline vec rms(const vec& x, long width, const vec& w, double eps) {
  vec y(x.size());
  const long groups = static_cast<long>(x.size()) / width;
  const bool per_group = static_cast<long>(w.size()) > width;
  const long gpr = per_group ? static_cast<long>(w.size()) / width : 1;
  for (long g = 0; g < groups; ++g) {
    double ss = 0;
    for (long c = 0; c < width; ++c) ss += x[g * width + c] * x[g * width + c];
    const double r = 1.0 / std::sqrt(ss / width + eps);
    for (long c = 0; c < width; ++c)
      y[g * width + c] = x[g * width + c] * r * w[(per_group ? (g % gpr) * width : 0) + c];
  }
  return y;
}

// Causal depthwise conv, W [C,1,K], zero before each sequence start.
inline vec conv(const vec& x, const layout& L, long C, const vec& W, bool act) {
  const long K = static_cast<long>(W.size()) / C;
  vec y(x.size(), 0.0);
  for (auto [r0, len] : L.seqs())
    for (long t = 0; t < len; ++t)
      for (long c = 0; c < C; ++c) {
        double s = 0;
        for (long r = 0; r < K; ++r) {
          const long src = t - (K - 1) + r;
          if (src >= 0) s += W[c * K + r] * x[(r0 + src) * C + c];
        }
        y[(r0 + t) * C + c] = act ? silu(s) : s;
      }
  return y;
}

inline void rope(vec& x, const layout& L, long heads, long d, double theta) {
  for (auto [r0, len] : L.seqs())
    for (long t = 0; t < len; ++t)
      for (long h = 0; h < heads; ++h)
        for (long i = 0; i < d / 2; ++i) {
          const double a = t / std::pow(theta, 2.0 * i / d);
          double& x0 = x[((r0 + t) * heads + h) * d + i];
          double& x1 = x[((r0 + t) * heads + h) * d + i + d / 2];
          const double u = x0, v = x1;
          x0 = u * std::cos(a) - v * std::sin(a);
          x1 = v * std::cos(a) + u * std::sin(a);
        }
}

inline attnmix_ref::softmax_problem sp(const dims& m, const layout& L) {
  attnmix_ref::softmax_problem p{L.B, L.T, m.HQ, m.H, m.d, m.d, 1.0 / std::sqrt(double(m.d))};
  p.cu_seqlens = L.cu;
  return p;
}

// SA / FoX mixer (fla attn / forgetting_attn).
inline vec attention_mixer(const params& p, const std::string& pre, const vec& x, const dims& m,
                           const layout& L, bool causal, bool fox, bool rope_on = false,
                           bool qk_norm = false, bool output_gate = false) {
  const long rows = L.B * L.T;
  vec q = proj(p, pre + "q_proj", x, rows, m.D), k = proj(p, pre + "k_proj", x, rows, m.D),
      v = proj(p, pre + "v_proj", x, rows, m.D);
  if (qk_norm) {
    q = rms(q, m.d, get(p, pre + "q_norm.weight"), m.head_eps);
    k = rms(k, m.d, get(p, pre + "k_norm.weight"), m.head_eps);
  }
  if (rope_on) rope(q, L, m.HQ, m.d, m.rope_theta), rope(k, L, m.H, m.d, m.rope_theta);
  auto prob = sp(m, L);
  prob.causal = causal;
  prob.window = m.window;
  vec g;
  if (fox) {
    g = proj(p, pre + "f_proj", x, rows, m.D);
    for (auto& e : g) e = std::log(sigmoid(e));
    prob.gate = attnmix_ref::softmax_problem::gate_after_scale;
  }
  vec o = attnmix_ref::softmax_attention(prob, q, k, v, g).out;
  if (output_gate) {
    const vec gg = proj(p, pre + "g_proj", x, rows, m.D);
    for (std::size_t i = 0; i < o.size(); ++i) o[i] *= sigmoid(gg[i]);
  }
  return proj(p, pre + "o_proj", o, rows, m.HQ * m.d);
}

// Cross-attention: the queries of x (layout L) against the keys and values of the memory
// (layout M, as many sequences), every memory token of a sequence visible to its queries.
inline vec cross_attention_mixer(const params& p, const std::string& pre, const vec& x,
                                 const vec& memory, const dims& m, const layout& L, const layout& M,
                                 bool qk_norm = false) {
  const long rows = L.B * L.T, mrows = M.B * M.T;
  vec q = proj(p, pre + "q_proj", x, rows, m.D), k = proj(p, pre + "k_proj", memory, mrows, m.D),
      v = proj(p, pre + "v_proj", memory, mrows, m.D);
  if (qk_norm) {
    q = rms(q, m.d, get(p, pre + "q_norm.weight"), m.head_eps);
    k = rms(k, m.d, get(p, pre + "k_norm.weight"), m.head_eps);
  }
  auto prob = sp(m, L);
  prob.causal = false;
  prob.Tk = M.T;
  prob.cu_seqlens_k = M.cu;
  const vec o = attnmix_ref::softmax_attention(prob, q, k, v).out;
  return proj(p, pre + "o_proj", o, rows, m.HQ * m.d);
}

// PaTH / PaTH-FoX mixer (fla path_attn).
inline vec path_mixer(const params& p, const std::string& pre, const vec& x, const dims& m,
                      const layout& L, bool gated) {
  const long rows = L.B * L.T;
  vec q = proj(p, pre + "q_proj", x, rows, m.D), k = proj(p, pre + "k_proj", x, rows, m.D),
      v = proj(p, pre + "v_proj", x, rows, m.D);
  if (has(p, pre + "maybe_q_norm.weight")) {  // fla's use_qk_norm: full-width RMSNorms
    q = rms(q, m.HQ * m.d, get(p, pre + "maybe_q_norm.weight"), m.head_eps);
    k = rms(k, m.H * m.d, get(p, pre + "maybe_k_norm.weight"), m.head_eps);
  }
  vec w = has(p, pre + "w_proj.0.weight")
              ? proj(p, pre + "w_proj.1", proj(p, pre + "w_proj.0", x, rows, m.D), rows, m.w_rank)
              : proj(p, pre + "w_proj", x, rows, m.D);
  w = conv(w, L, m.H * m.d, get(p, pre + "w_conv1d.weight"), true);
  for (long g = 0; g < rows * m.H; ++g) {
    double ss = 0;
    for (long c = 0; c < m.d; ++c) ss += w[g * m.d + c] * w[g * m.d + c];
    for (long c = 0; c < m.d; ++c) w[g * m.d + c] /= std::sqrt(ss + 1e-6);
  }
  vec beta = proj(p, pre + "bt_proj", x, rows, m.D);
  for (auto& b : beta) b = 2 * sigmoid(b);
  attnmix_ref::path_problem pp{L.B, L.T, m.HQ, m.H, m.d, m.d, 1.0 / std::sqrt(double(m.d))};
  pp.cu_seqlens = L.cu;
  vec g;
  if (gated) {
    g = proj(p, pre + "g_proj", x, rows, m.D);
    for (auto& e : g) e = std::log(sigmoid(e));
    pp.gate = attnmix_ref::path_problem::gate_before_scale;
  }
  const vec o = attnmix_ref::path_query_scan(pp, q, k, v, w, beta, g).out;
  return proj(p, pre + "o_proj", o, rows, m.HQ * m.d);
}

// BLA / GBLA / causal linear mixer. Gate, norm and conv are on when their parameters exist.
inline vec linear_mixer(const params& p, const std::string& pre, const vec& x, const dims& m,
                        const layout& L, bool causal) {
  const long rows = L.B * L.T;
  const vec c =
      has(p, pre + "conv1d.weight") ? conv(x, L, m.D, get(p, pre + "conv1d.weight"), true) : x;
  const vec q = proj(p, pre + "q_proj", c, rows, m.D), k = proj(p, pre + "k_proj", c, rows, m.D),
            v = proj(p, pre + "v_proj", c, rows, m.D);
  attnmix_ref::linear_problem lp{L.B, L.T, m.HQ, m.H, m.d, m.d};
  lp.causal = causal;
  lp.cu_seqlens = L.cu;
  lp.norm_eps = m.head_eps;
  vec a, g, gamma;
  if (has(p, pre + "a_proj.weight")) {
    a = proj(p, pre + "a_proj", x, rows, m.D);
    lp.gate = static_cast<long>(a.size()) == rows ? attnmix_ref::linear_problem::shared_gate
                                                  : attnmix_ref::linear_problem::per_head_gate;
  }
  if (has(p, pre + "g_proj.weight")) {
    g = proj(p, pre + "g_proj", x, rows, m.D);
    gamma = get(p, pre + "o_norm.weight");
    lp.norm = attnmix_ref::linear_problem::per_head_norm;
    lp.gamma_per_head = static_cast<long>(gamma.size()) > m.d;
  }
  const vec o = attnmix_ref::linear_attention(lp, q, k, v, a, g, gamma).out;
  return proj(p, pre + "o_proj", o, rows, m.HQ * m.d);
}

// The MLPs: swiglu when gate_proj exists, else gelu or relu.
inline vec mlp(const params& p, const std::string& pre, const vec& x, long rows, long D,
               bool relu) {
  vec u = proj(p, pre + "up_proj", x, rows, D);
  if (has(p, pre + "gate_proj.weight")) {
    const vec g = proj(p, pre + "gate_proj", x, rows, D);
    for (std::size_t i = 0; i < u.size(); ++i) u[i] *= silu(g[i]);
  } else {
    for (auto& e : u) e = relu ? (e > 0 ? e : 0) : 0.5 * e * (1 + std::erf(e / std::sqrt(2.0)));
  }
  return proj(p, pre + "down_proj", u, rows, static_cast<long>(u.size()) / rows);
}

// A stack of named layers ("sa", "gbla", ...) with pre-norm blocks and the final norm.
inline vec stack(const params& p, const std::vector<std::string>& names, const vec& x,
                 const dims& m, const layout& L) {
  const long rows = L.B * L.T;
  vec h = x;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::string pre = "layers." + std::to_string(i) + ".";
    const vec t = rms(h, m.D, get(p, pre + "attn_norm.weight"), m.norm_eps);
    const std::string& n = names[i];
    const std::string a = pre + "attn.";
    vec y;
    if (n == "sa")
      y = attention_mixer(p, a, t, m, L, false, false);
    else if (n == "causal_sa")
      y = attention_mixer(p, a, t, m, L, true, false);
    else if (n == "fox")
      y = attention_mixer(p, a, t, m, L, true, true);
    else if (n == "path")
      y = path_mixer(p, a, t, m, L, false);
    else if (n == "path_fox")
      y = path_mixer(p, a, t, m, L, true);
    else if (n == "bla" || n == "gbla")
      y = linear_mixer(p, a, t, m, L, false);
    else
      y = linear_mixer(p, a, t, m, L, true);
    for (std::size_t j = 0; j < h.size(); ++j) h[j] += y[j];
    const vec t2 = rms(h, m.D, get(p, pre + "mlp_norm.weight"), m.norm_eps);
    const vec f = mlp(p, pre + "mlp.", t2, rows, m.D, false);
    for (std::size_t j = 0; j < h.size(); ++j) h[j] += f[j];
  }
  return rms(h, m.D, get(p, "norm.weight"), m.norm_eps);
}

// A decoder: blocks of causal self-attention, cross-attention to the memory (layout M) and the
// MLP, pre-norm residual, then the final norm.
inline vec decoder(const params& p, long layers, const vec& x, const vec& memory, const dims& m,
                   const layout& L, const layout& M) {
  const long rows = L.B * L.T;
  vec h = x;
  const auto add = [&](const vec& y) {
    for (std::size_t j = 0; j < h.size(); ++j) h[j] += y[j];
  };
  for (long i = 0; i < layers; ++i) {
    const std::string pre = "layers." + std::to_string(i) + ".";
    add(attention_mixer(p, pre + "attn.", rms(h, m.D, get(p, pre + "attn_norm.weight"), m.norm_eps),
                        m, L, true, false));
    add(cross_attention_mixer(p, pre + "cross_attn.",
                              rms(h, m.D, get(p, pre + "cross_attn_norm.weight"), m.norm_eps),
                              memory, m, L, M));
    add(mlp(p, pre + "mlp.", rms(h, m.D, get(p, pre + "mlp_norm.weight"), m.norm_eps), rows, m.D,
            false));
  }
  return rms(h, m.D, get(p, "norm.weight"), m.norm_eps);
}

}  // namespace layer_ref
