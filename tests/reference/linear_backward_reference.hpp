#pragma once
// Float64 brute-force reverse pass of BLA, GBLA and causal linear attention, written from the
// quadratic form (spec gbla.md §3.1, R0) and the causal definition (§4): every query row sums
// over its keys (and the incoming state) explicitly, the key gate is differentiated through the
// softmax of each row's own key set, the gated RMSNorm through its plain formula. Plain loops
// over plain arrays, sharing no code with the library; checked against central finite
// differences of the forward oracle (linear_reference.hpp) in tests/cpu/test_linear_backward.cpp.

#include <cmath>
#include <limits>
#include <vector>

#include "reference/linear_reference.hpp"

namespace attnmix_ref {

struct linear_gradients {
  std::vector<double> dq, dk, dv, da, dgate, dgamma;  // shapes of q, k, v, a, gate, gamma
  std::vector<double> dS_in, dz_in, dlse_in;          // [N,H,D,Dv], [N,H,D], [N,H]
};

// The upstream gradients: dout [B,T,HQ,Dv]; causal only, those of the final state (empty = 0).
struct linear_upstream {
  std::vector<double> dout, dS_out, dz_out, dlse_out;
};

inline double ref_phi_derivative(linear_problem::phi_kind f, double x) {
  switch (f) {
    case linear_problem::elu_plus_one:
      return x > 0 ? 1.0 : std::exp(x);
    case linear_problem::relu:
      return x > 0 ? 1.0 : 0.0;
    case linear_problem::squared_relu:
      return x > 0 ? 2 * x : 0.0;
    case linear_problem::sigmoid: {
      const double s = 1.0 / (1.0 + std::exp(-x));
      return s * (1 - s);
    }
    default:
      return 1.0;
  }
}

inline linear_gradients linear_attention_backward(
    const linear_problem& p, const std::vector<double>& q, const std::vector<double>& k,
    const std::vector<double>& v, const std::vector<double>& a, const std::vector<double>& gate,
    const std::vector<double>& gamma, const linear_upstream& up) {
  const double ninf = -std::numeric_limits<double>::infinity();
  const long Hg = p.gate == linear_problem::per_head_gate ? p.H : 1;
  const bool gated = p.gate != linear_problem::no_gate;
  const bool normed = p.norm != linear_problem::no_norm;
  std::vector<long> seq_b, seq_lo, seq_hi;
  if (p.cu_seqlens.empty()) {
    for (long b = 0; b < p.B; ++b) seq_b.push_back(b), seq_lo.push_back(0), seq_hi.push_back(p.T);
  } else {
    for (std::size_t n = 0; n + 1 < p.cu_seqlens.size(); ++n)
      seq_b.push_back(0), seq_lo.push_back(p.cu_seqlens[n]), seq_hi.push_back(p.cu_seqlens[n + 1]);
  }
  const long N = static_cast<long>(seq_b.size());
  const long group = p.HQ / p.H;
  const bool has_state = p.causal && !p.S_in.empty();
  const long W = p.HQ * p.Dv;

  linear_gradients gr;
  gr.dq.assign(q.size(), 0.0);
  gr.dk.assign(k.size(), 0.0);
  gr.dv.assign(v.size(), 0.0);
  gr.da.assign(gated ? p.B * p.T * Hg : 0, 0.0);
  gr.dgate.assign(normed ? p.B * p.T * W : 0, 0.0);
  gr.dgamma.assign(gamma.size(), 0.0);
  gr.dS_in.assign(has_state ? N * p.H * p.D * p.Dv : 0, 0.0);
  gr.dz_in.assign(has_state ? N * p.H * p.D : 0, 0.0);
  gr.dlse_in.assign(has_state && gated ? N * p.H : 0, 0.0);

  auto valid = [&](long b, long t) {
    return p.mask.empty() || p.mask[b * p.T + t] != 0;
  };
  auto qi = [&](long b, long t, long hq, long d) {
    return ((b * p.T + t) * p.HQ + hq) * p.D + d;
  };
  auto ki = [&](long b, long t, long h, long d) {
    return ((b * p.T + t) * p.H + h) * p.D + d;
  };
  auto vi = [&](long b, long t, long h, long c) {
    return ((b * p.T + t) * p.H + h) * p.Dv + c;
  };
  auto oi = [&](long b, long t, long hq, long c) {
    return ((b * p.T + t) * p.HQ + hq) * p.Dv + c;
  };
  auto ai = [&](long b, long t, long h) {
    return (b * p.T + t) * Hg + (Hg == 1 ? 0 : h);
  };
  auto Si = [&](long n, long h, long d, long c) {
    return ((n * p.H + h) * p.D + d) * p.Dv + c;
  };
  auto zi = [&](long n, long h, long d) {
    return (n * p.H + h) * p.D + d;
  };
  auto phik = [&](long b, long t, long h, long d) {
    return ref_phi(p.phi, k[ki(b, t, h, d)]);
  };

  // Softmax weights of one key set plus (optionally) the state, whose logit is lse_in.
  auto weights = [&](long n, long h, const std::vector<long>& keys, std::vector<double>& w,
                     double& w_state) {
    const long b = seq_b[n];
    w.assign(keys.size(), 1.0);
    w_state = has_state ? 1.0 : 0.0;
    if (!gated) return;
    const double l0 = has_state ? p.lse_in[n * p.H + h] : ninf;
    double M = l0;
    for (long t : keys) M = std::max(M, a[ai(b, t, h)]);
    if (M == ninf) {
      w.assign(keys.size(), 0.0), w_state = 0;
      return;
    }
    double Z = l0 != ninf ? std::exp(l0 - M) : 0;
    for (long t : keys) Z += std::exp(a[ai(b, t, h)] - M);
    for (std::size_t j = 0; j < keys.size(); ++j) w[j] = std::exp(a[ai(b, keys[j], h)] - M) / Z;
    w_state = l0 != ninf ? std::exp(l0 - M) / Z : 0;
  };
  // Backward of a softmax: given dw (per key) and dw_state, adds into da and dlse_in.
  auto softmax_backward = [&](long n, long h, const std::vector<long>& keys,
                              const std::vector<double>& w, double w_state,
                              const std::vector<double>& dw, double dw_state) {
    if (!gated) return;
    double dot = w_state * dw_state;
    for (std::size_t j = 0; j < keys.size(); ++j) dot += w[j] * dw[j];
    for (std::size_t j = 0; j < keys.size(); ++j)
      gr.da[ai(seq_b[n], keys[j], h)] += w[j] * (dw[j] - dot);
    if (has_state) gr.dlse_in[n * p.H + h] += w_state * (dw_state - dot);
  };

  // 1. The attention output o before the norm, and its keys' weights, row by row.
  std::vector<double> o(p.B * p.T * W, 0.0);
  std::vector<double> w;
  for (long n = 0; n < N; ++n) {
    const long b = seq_b[n];
    for (long hq = 0; hq < p.HQ; ++hq) {
      const long h = hq / group;
      for (long i = seq_lo[n]; i < seq_hi[n]; ++i) {
        if (!valid(b, i)) continue;
        std::vector<long> keys;
        for (long t = seq_lo[n]; t < seq_hi[n]; ++t)
          if (valid(b, t) && (!p.causal || t <= i)) keys.push_back(t);
        double w_state;
        weights(n, h, keys, w, w_state);
        std::vector<double> r(p.D), num(p.Dv, 0.0);
        for (long d = 0; d < p.D; ++d) r[d] = p.scale * ref_phi(p.phi, q[qi(b, i, hq, d)]);
        double den = p.eps;
        for (std::size_t j = 0; j < keys.size(); ++j) {
          double s = 0;
          for (long d = 0; d < p.D; ++d) s += r[d] * phik(b, keys[j], h, d);
          den += w[j] * s;
          for (long c = 0; c < p.Dv; ++c) num[c] += w[j] * s * v[vi(b, keys[j], h, c)];
        }
        if (has_state)
          for (long d = 0; d < p.D; ++d) {
            if (!p.z_in.empty()) den += w_state * r[d] * p.z_in[zi(n, h, d)];
            for (long c = 0; c < p.Dv; ++c) num[c] += w_state * r[d] * p.S_in[Si(n, h, d, c)];
          }
        for (long c = 0; c < p.Dv; ++c) o[oi(b, i, hq, c)] = p.normalize ? num[c] / den : num[c];
      }
    }
  }

  // 2. The gated RMSNorm backward: do from dout.
  std::vector<double> dO = up.dout;
  if (normed) {
    const long width = p.norm == linear_problem::per_head_norm ? p.Dv : W;
    for (long b = 0; b < p.B; ++b)
      for (long t = 0; t < p.T; ++t) {
        if (!valid(b, t)) {
          for (long e = 0; e < W; ++e) dO[(b * p.T + t) * W + e] = 0;
          continue;
        }
        for (long e0 = 0; e0 < W; e0 += width) {
          std::vector<double> x(width), act(width), dact(width), gm(width, 1.0), dy(width);
          for (long e = 0; e < width; ++e) {
            const long idx = (b * p.T + t) * W + e0 + e;
            const double g = gate[idx], sg = 1.0 / (1.0 + std::exp(-g));
            act[e] = p.sigmoid_activation ? sg : g * sg;
            dact[e] = p.sigmoid_activation ? sg * (1 - sg) : sg + g * sg * (1 - sg);
            x[e] = o[idx] * (p.gate_then_norm ? act[e] : 1.0);
            if (!gamma.empty()) gm[e] = gamma[p.gamma_per_head ? e0 + e : (e0 + e) % p.Dv];
            dy[e] = up.dout[idx];
          }
          double ms = 0;
          for (long e = 0; e < width; ++e) ms += x[e] * x[e];
          const double rstd = 1.0 / std::sqrt(ms / width + p.norm_eps);
          // y_e = x_e rstd gm_e (act_e if norm then gate): dL/dx_e via the chain rule.
          std::vector<double> dn(width);
          for (long e = 0; e < width; ++e) {
            const long idx = (b * p.T + t) * W + e0 + e;
            const double nrm = x[e] * rstd;
            const double post = p.gate_then_norm ? 1.0 : act[e];
            dn[e] = dy[e] * gm[e] * post;
            if (!gamma.empty())
              gr.dgamma[p.gamma_per_head ? e0 + e : (e0 + e) % p.Dv] += dy[e] * nrm * post;
            if (!p.gate_then_norm) gr.dgate[idx] = dy[e] * nrm * gm[e] * dact[e];
          }
          // d rstd / d x_e = -x_e rstd^3 / width
          double sum = 0;
          for (long e = 0; e < width; ++e) sum += dn[e] * x[e];
          for (long e = 0; e < width; ++e) {
            const long idx = (b * p.T + t) * W + e0 + e;
            const double dx = dn[e] * rstd - x[e] * rstd * rstd * rstd * sum / width;
            if (p.gate_then_norm) {
              dO[idx] = dx * act[e];
              gr.dgate[idx] = dx * o[idx] * dact[e];
            } else {
              dO[idx] = dx;
            }
          }
        }
      }
  }

  // 3. The attention backward, row by row, pair by pair.
  for (long n = 0; n < N; ++n) {
    const long b = seq_b[n];
    for (long hq = 0; hq < p.HQ; ++hq) {
      const long h = hq / group;
      for (long i = seq_lo[n]; i < seq_hi[n]; ++i) {
        if (!valid(b, i)) continue;
        std::vector<long> keys;
        for (long t = seq_lo[n]; t < seq_hi[n]; ++t)
          if (valid(b, t) && (!p.causal || t <= i)) keys.push_back(t);
        double w_state;
        weights(n, h, keys, w, w_state);
        std::vector<double> r(p.D), num(p.Dv, 0.0), s(keys.size());
        for (long d = 0; d < p.D; ++d) r[d] = p.scale * ref_phi(p.phi, q[qi(b, i, hq, d)]);
        double den = p.eps;
        for (std::size_t j = 0; j < keys.size(); ++j) {
          s[j] = 0;
          for (long d = 0; d < p.D; ++d) s[j] += r[d] * phik(b, keys[j], h, d);
          den += w[j] * s[j];
          for (long c = 0; c < p.Dv; ++c) num[c] += w[j] * s[j] * v[vi(b, keys[j], h, c)];
        }
        std::vector<double> rS(p.Dv, 0.0);  // r^T S_in
        double rz = 0;
        if (has_state)
          for (long d = 0; d < p.D; ++d) {
            if (!p.z_in.empty()) rz += r[d] * p.z_in[zi(n, h, d)];
            for (long c = 0; c < p.Dv; ++c) rS[c] += r[d] * p.S_in[Si(n, h, d, c)];
          }
        for (long c = 0; c < p.Dv; ++c) num[c] += w_state * rS[c];
        den += w_state * rz;
        // o = num / den (or num): dnum, dden.
        std::vector<double> dnum(p.Dv);
        double dden = 0;
        for (long c = 0; c < p.Dv; ++c) {
          const double g = dO[oi(b, i, hq, c)];
          dnum[c] = p.normalize ? g / den : g;
          if (p.normalize) dden -= g * num[c] / (den * den);
        }
        std::vector<double> dr(p.D, 0.0), dw(keys.size());
        for (std::size_t j = 0; j < keys.size(); ++j) {
          const long t = keys[j];
          double dc = p.normalize ? dden : 0.0;  // d loss / d (w_j s_j)
          for (long c = 0; c < p.Dv; ++c) dc += dnum[c] * v[vi(b, t, h, c)];
          for (long c = 0; c < p.Dv; ++c) gr.dv[vi(b, t, h, c)] += w[j] * s[j] * dnum[c];
          dw[j] = s[j] * dc;
          const double ds = w[j] * dc;
          for (long d = 0; d < p.D; ++d) {
            dr[d] += ds * phik(b, t, h, d);
            gr.dk[ki(b, t, h, d)] += ds * r[d] * ref_phi_derivative(p.phi, k[ki(b, t, h, d)]);
          }
        }
        double dw_state = 0;
        if (has_state) {
          for (long c = 0; c < p.Dv; ++c) dw_state += rS[c] * dnum[c];
          if (p.normalize) dw_state += rz * dden;
          for (long d = 0; d < p.D; ++d) {
            for (long c = 0; c < p.Dv; ++c) {
              dr[d] += w_state * p.S_in[Si(n, h, d, c)] * dnum[c];
              gr.dS_in[Si(n, h, d, c)] += w_state * r[d] * dnum[c];
            }
            if (p.normalize && !p.z_in.empty()) {
              dr[d] += w_state * dden * p.z_in[zi(n, h, d)];
              gr.dz_in[zi(n, h, d)] += w_state * dden * r[d];
            }
          }
        }
        softmax_backward(n, h, keys, w, w_state, dw, dw_state);
        for (long d = 0; d < p.D; ++d)
          gr.dq[qi(b, i, hq, d)] += p.scale * dr[d] * ref_phi_derivative(p.phi, q[qi(b, i, hq, d)]);
      }
    }

    // 4. Causal: the final state S = sum_j w_j phi(k_j) v_j^T + w_s S_in, z likewise,
    // lse = log(sum_j exp(a_j) + exp(lse_in)).
    if (!p.causal) continue;
    for (long h = 0; h < p.H; ++h) {
      std::vector<long> keys;
      for (long t = seq_lo[n]; t < seq_hi[n]; ++t)
        if (valid(b, t)) keys.push_back(t);
      double w_state;
      weights(n, h, keys, w, w_state);
      auto dSo = [&](long d, long c) {
        return up.dS_out.empty() ? 0.0 : up.dS_out[Si(n, h, d, c)];
      };
      auto dzo = [&](long d) {
        return up.dz_out.empty() ? 0.0 : up.dz_out[zi(n, h, d)];
      };
      const double dlse = up.dlse_out.empty() || !gated ? 0.0 : up.dlse_out[n * p.H + h];
      std::vector<double> dw(keys.size());
      for (std::size_t j = 0; j < keys.size(); ++j) {
        const long t = keys[j];
        double dwj = 0;
        for (long d = 0; d < p.D; ++d) {
          double e = dzo(d);
          for (long c = 0; c < p.Dv; ++c) {
            e += dSo(d, c) * v[vi(b, t, h, c)];
            gr.dv[vi(b, t, h, c)] += w[j] * phik(b, t, h, d) * dSo(d, c);
          }
          dwj += phik(b, t, h, d) * e;
          gr.dk[ki(b, t, h, d)] += w[j] * e * ref_phi_derivative(p.phi, k[ki(b, t, h, d)]);
        }
        dw[j] = dwj;
      }
      double dw_state = 0;
      if (has_state)
        for (long d = 0; d < p.D; ++d) {
          if (!p.z_in.empty()) {
            dw_state += dzo(d) * p.z_in[zi(n, h, d)];
            gr.dz_in[zi(n, h, d)] += w_state * dzo(d);
          }
          for (long c = 0; c < p.Dv; ++c) {
            dw_state += dSo(d, c) * p.S_in[Si(n, h, d, c)];
            gr.dS_in[Si(n, h, d, c)] += w_state * dSo(d, c);
          }
        }
      softmax_backward(n, h, keys, w, w_state, dw, dw_state);
      // d lse / d a_j = w_j, d lse / d lse_in = w_s.
      if (gated) {
        for (std::size_t j = 0; j < keys.size(); ++j) gr.da[ai(b, keys[j], h)] += dlse * w[j];
        if (has_state) gr.dlse_in[n * p.H + h] += dlse * w_state;
      }
    }
  }
  return gr;
}

}  // namespace attnmix_ref
