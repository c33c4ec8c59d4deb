#pragma once
// Float64 quadratic oracle (spec gbla.md §3.1, R0) for BLA, GBLA and causal linear attention,
// written from the definitions of spec §1, §2.3, §2.4 and §4 in the plainest way: for every
// query it sums over its keys explicitly, never forming a state. Plain loops over plain arrays;
// it shares no code with the library. Inputs are contiguous [B,T,HQ,D] / [B,T,H,D] /
// [B,T,H,Dv] / [B,T,Hg] / [B,T,HQ,Dv] arrays.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace attnmix_ref {

struct linear_problem {
  long B, T, HQ, H, D, Dv;
  enum phi_kind { elu_plus_one, relu, squared_relu, sigmoid, identity } phi = elu_plus_one;
  bool normalize = true;
  bool causal = false;
  double scale = 1.0, eps = 1e-6, norm_eps = 1e-5;
  enum gate_kind { no_gate, shared_gate, per_head_gate } gate = no_gate;
  enum norm_kind { no_norm, per_head_norm, full_width_norm } norm = no_norm;
  bool gate_then_norm = false;      // else norm then gate
  bool sigmoid_activation = false;  // else SiLU
  bool gamma_per_head = false;      // gamma [HQ*Dv] instead of [Dv]; empty gamma means 1
  std::vector<long> cu_seqlens{};   // empty: dense batch
  std::vector<int> mask{};          // empty: every token valid; else [B*T], nonzero = valid
  // Causal only: the state before token 0, per sequence and KV head; empty = fresh.
  std::vector<double> S_in{}, z_in{}, lse_in{};  // [N,H,D,Dv], [N,H,D], [N,H]
};

struct linear_result {
  std::vector<double> out;  // [B,T,HQ,Dv], pad rows 0
  std::vector<double> S;    // [N,H,D,Dv] state after the last token
  std::vector<double> z;    // [N,H,D]
  std::vector<double> lse;  // [N,H] (gated only)
};

inline double ref_phi(linear_problem::phi_kind f, double x) {
  switch (f) {
    case linear_problem::elu_plus_one:
      return x > 0 ? x + 1.0 : std::exp(x);
    case linear_problem::relu:
      return x > 0 ? x : 0.0;
    case linear_problem::squared_relu:
      return x > 0 ? x * x : 0.0;
    case linear_problem::sigmoid:
      return 1.0 / (1.0 + std::exp(-x));
    default:
      return x;
  }
}

inline linear_result linear_attention(const linear_problem& p, const std::vector<double>& q,
                                      const std::vector<double>& k, const std::vector<double>& v,
                                      const std::vector<double>& a = {},
                                      const std::vector<double>& gate = {},
                                      const std::vector<double>& gamma = {}) {
  const double ninf = -std::numeric_limits<double>::infinity();
  const long Hg = p.gate == linear_problem::per_head_gate ? p.H : 1;
  std::vector<long> seq_b, seq_lo, seq_hi;
  if (p.cu_seqlens.empty()) {
    for (long b = 0; b < p.B; ++b) seq_b.push_back(b), seq_lo.push_back(0), seq_hi.push_back(p.T);
  } else {
    for (std::size_t n = 0; n + 1 < p.cu_seqlens.size(); ++n)
      seq_b.push_back(0), seq_lo.push_back(p.cu_seqlens[n]), seq_hi.push_back(p.cu_seqlens[n + 1]);
  }
  const long N = static_cast<long>(seq_b.size());
  const long group = p.HQ / p.H;
  linear_result r{std::vector<double>(p.B * p.T * p.HQ * p.Dv, 0.0),
                  std::vector<double>(N * p.H * p.D * p.Dv, 0.0),
                  std::vector<double>(N * p.H * p.D, 0.0), std::vector<double>(N * p.H, ninf)};
  const bool has_state = p.causal && !p.S_in.empty();
  const bool gated = p.gate != linear_problem::no_gate;

  auto valid = [&](long b, long t) {
    return p.mask.empty() || p.mask[b * p.T + t] != 0;
  };
  auto kval = [&](long b, long t, long h, long d) {
    return k[((b * p.T + t) * p.H + h) * p.D + d];
  };
  auto vval = [&](long b, long t, long h, long c) {
    return v[((b * p.T + t) * p.H + h) * p.Dv + c];
  };
  auto logit = [&](long b, long t, long h) {
    return a[(b * p.T + t) * Hg + (Hg == 1 ? 0 : h)];
  };

  // Weights of the keys `keys` (and of the incoming state) for KV head h: the softmax of the
  // gate logits over them, or 1 each without a gate.
  auto weights = [&](long n, long h, const std::vector<long>& keys, std::vector<double>& w,
                     double& w_state) {
    const long b = seq_b[n];
    w.assign(keys.size(), 1.0);
    w_state = has_state ? 1.0 : 0.0;
    if (!gated) return;
    double M = has_state ? p.lse_in[n * p.H + h] : ninf;
    for (long t : keys) M = std::max(M, logit(b, t, h));
    if (M == ninf) {
      w.assign(keys.size(), 0.0), w_state = 0;
      return;
    }
    double Z = has_state && p.lse_in[n * p.H + h] != ninf ? std::exp(p.lse_in[n * p.H + h] - M) : 0;
    for (long t : keys) Z += std::exp(logit(b, t, h) - M);
    for (std::size_t j = 0; j < keys.size(); ++j) w[j] = std::exp(logit(b, keys[j], h) - M) / Z;
    w_state =
        has_state && p.lse_in[n * p.H + h] != ninf ? std::exp(p.lse_in[n * p.H + h] - M) / Z : 0;
  };

  std::vector<double> rq(p.D), w;
  for (long n = 0; n < N; ++n) {
    const long b = seq_b[n];
    std::vector<long> all_keys;
    for (long t = seq_lo[n]; t < seq_hi[n]; ++t)
      if (valid(b, t)) all_keys.push_back(t);

    // Outputs.
    for (long hq = 0; hq < p.HQ; ++hq) {
      const long h = hq / group;
      for (long i = seq_lo[n]; i < seq_hi[n]; ++i) {
        if (!valid(b, i)) continue;
        std::vector<long> keys;
        for (long t : all_keys)
          if (!p.causal || t <= i) keys.push_back(t);
        double w_state;
        weights(n, h, keys, w, w_state);
        for (long d = 0; d < p.D; ++d)
          rq[d] = p.scale * ref_phi(p.phi, q[((b * p.T + i) * p.HQ + hq) * p.D + d]);
        double den = 0;
        std::vector<double> num(p.Dv, 0.0);
        for (std::size_t j = 0; j < keys.size(); ++j) {
          double score = 0;
          for (long d = 0; d < p.D; ++d) score += rq[d] * ref_phi(p.phi, kval(b, keys[j], h, d));
          den += w[j] * score;
          for (long c = 0; c < p.Dv; ++c) num[c] += w[j] * score * vval(b, keys[j], h, c);
        }
        if (has_state) {
          for (long d = 0; d < p.D; ++d) {
            if (!p.z_in.empty()) den += w_state * rq[d] * p.z_in[(n * p.H + h) * p.D + d];
            for (long c = 0; c < p.Dv; ++c)
              num[c] += w_state * rq[d] * p.S_in[((n * p.H + h) * p.D + d) * p.Dv + c];
          }
        }
        for (long c = 0; c < p.Dv; ++c)
          r.out[((b * p.T + i) * p.HQ + hq) * p.Dv + c] =
              p.normalize ? num[c] / (den + p.eps) : num[c];
      }
    }

    // Final states.
    for (long h = 0; h < p.H; ++h) {
      double w_state;
      weights(n, h, all_keys, w, w_state);
      for (long d = 0; d < p.D; ++d) {
        double zs = has_state && !p.z_in.empty() ? w_state * p.z_in[(n * p.H + h) * p.D + d] : 0;
        for (std::size_t j = 0; j < all_keys.size(); ++j)
          zs += w[j] * ref_phi(p.phi, kval(b, all_keys[j], h, d));
        r.z[(n * p.H + h) * p.D + d] = zs;
        for (long c = 0; c < p.Dv; ++c) {
          double ss = has_state ? w_state * p.S_in[((n * p.H + h) * p.D + d) * p.Dv + c] : 0;
          for (std::size_t j = 0; j < all_keys.size(); ++j)
            ss += w[j] * ref_phi(p.phi, kval(b, all_keys[j], h, d)) * vval(b, all_keys[j], h, c);
          r.S[((n * p.H + h) * p.D + d) * p.Dv + c] = ss;
        }
      }
      if (gated) {
        double M = has_state ? p.lse_in[n * p.H + h] : ninf;
        for (long t : all_keys) M = std::max(M, logit(b, t, h));
        if (M != ninf) {
          double Z =
              has_state && p.lse_in[n * p.H + h] != ninf ? std::exp(p.lse_in[n * p.H + h] - M) : 0;
          for (long t : all_keys) Z += std::exp(logit(b, t, h) - M);
          r.lse[n * p.H + h] = M + std::log(Z);
        }
      }
    }
  }

  // Gated RMSNorm: y = RMSNorm(o) * gamma * act(g), or RMSNorm(o * act(g)) * gamma.
  if (p.norm != linear_problem::no_norm) {
    const long width = p.norm == linear_problem::per_head_norm ? p.Dv : p.HQ * p.Dv;
    for (long b = 0; b < p.B; ++b)
      for (long t = 0; t < p.T; ++t) {
        if (!valid(b, t)) continue;
        double* row = &r.out[(b * p.T + t) * p.HQ * p.Dv];
        const double* g = &gate[(b * p.T + t) * p.HQ * p.Dv];
        std::vector<double> act(p.HQ * p.Dv);
        for (long e = 0; e < p.HQ * p.Dv; ++e) {
          const double s = 1.0 / (1.0 + std::exp(-g[e]));
          act[e] = p.sigmoid_activation ? s : g[e] * s;
        }
        for (long e0 = 0; e0 < p.HQ * p.Dv; e0 += width) {
          if (p.gate_then_norm)
            for (long e = e0; e < e0 + width; ++e) row[e] *= act[e];
          double ms = 0;
          for (long e = e0; e < e0 + width; ++e) ms += row[e] * row[e];
          const double rstd = 1.0 / std::sqrt(ms / width + p.norm_eps);
          for (long e = e0; e < e0 + width; ++e) {
            double y = row[e] * rstd;
            if (!p.gate_then_norm) y *= act[e];
            if (!gamma.empty()) y *= gamma[p.gamma_per_head ? e : e % p.Dv];
            row[e] = y;
          }
        }
      }
  }
  return r;
}

}  // namespace attnmix_ref
