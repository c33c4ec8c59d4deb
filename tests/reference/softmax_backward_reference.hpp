#pragma once
// Float64 brute-force reverse pass of softmax attention and FoX, written from the formulas of
// spec/path_fox.md §4.1 and §7 with plain loops over plain arrays; it shares no code with the
// library (nor with the forward oracle, whose problem description it reuses). Per query row it
// recomputes the row's softmax from the definition and differentiates it:
//   dP_ij = do_i . v_j,  delta_i = do_i . o_i,  dz_ij = p_ij (dP_ij - delta_i)
//   dv_j += p_ij do_i,   dq_i += s dz_ij k_j,   dk_j += s dz_ij q_i
// The gate bias of (i, j) is read as the sum b_ij = sum_{j<t<=i} g_t (a -inf in it: weight 0), so
// dg_t += coef * dz_ij for every t in (j, i], coef = 1 (after the scale) or s (before it).
// Keys may have other lengths than the queries (softmax_problem::Tk, cu_seqlens_k): query a of a
// sequence then sits at key position i = a + Lk - Lq, and the masks and the gate read i.

#include <cmath>
#include <limits>
#include <vector>

#include "reference/softmax_reference.hpp"

namespace attnmix_ref {

struct softmax_gradients {
  std::vector<double> dq, dk, dv, dg;  // [B,T,HQ,D], [B,Tk,H,D], [B,Tk,H,Dv], [B,Tk,HQ]
};

// q [B,T,HQ,D], k [B,Tk,H,D], v [B,Tk,H,Dv], dout [B,T,HQ,Dv]; g ([B,Tk,HQ]) is read only when
// p.gate != no_gate; -inf entries are hard resets.
inline softmax_gradients softmax_attention_backward(
    const softmax_problem& p, const std::vector<double>& q, const std::vector<double>& k,
    const std::vector<double>& v, const std::vector<double>& g, const std::vector<double>& dout) {
  const double ninf = -std::numeric_limits<double>::infinity();
  const long Tk = p.key_tokens();
  softmax_gradients r{std::vector<double>(p.B * p.T * p.HQ * p.D, 0.0),
                      std::vector<double>(p.B * Tk * p.H * p.D, 0.0),
                      std::vector<double>(p.B * Tk * p.H * p.Dv, 0.0),
                      std::vector<double>(p.B * Tk * p.HQ, 0.0)};
  // Sequences: batch row, query range [lo, hi), key range [klo, khi).
  std::vector<long> seq_b, seq_lo, seq_hi, seq_klo, seq_khi;
  if (p.cu_seqlens.empty()) {
    for (long b = 0; b < p.B; ++b) {
      seq_b.push_back(b), seq_lo.push_back(0), seq_hi.push_back(p.T);
      seq_klo.push_back(0), seq_khi.push_back(Tk);
    }
  } else {
    const std::vector<long>& ck = p.cu_seqlens_k.empty() ? p.cu_seqlens : p.cu_seqlens_k;
    for (std::size_t n = 0; n + 1 < p.cu_seqlens.size(); ++n) {
      seq_b.push_back(0), seq_lo.push_back(p.cu_seqlens[n]), seq_hi.push_back(p.cu_seqlens[n + 1]);
      seq_klo.push_back(ck[n]), seq_khi.push_back(ck[n + 1]);
    }
  }
  const bool gated = p.gate != softmax_problem::no_gate;
  const double coef = p.gate == softmax_problem::gate_before_scale ? p.scale : 1.0;
  const long group = p.HQ / p.H;
  auto Q = [&](long b, long t, long hq, long d) {
    return q[((b * p.T + t) * p.HQ + hq) * p.D + d];
  };
  auto K = [&](long b, long t, long h, long d) {
    return k[((b * Tk + t) * p.H + h) * p.D + d];
  };
  auto V = [&](long b, long t, long h, long e) {
    return v[((b * Tk + t) * p.H + h) * p.Dv + e];
  };
  auto DO = [&](long b, long t, long hq, long e) {
    return dout[((b * p.T + t) * p.HQ + hq) * p.Dv + e];
  };

  for (std::size_t n = 0; n < seq_b.size(); ++n) {
    const long b = seq_b[n], lo = seq_lo[n], hi = seq_hi[n], klo = seq_klo[n], khi = seq_khi[n];
    for (long hq = 0; hq < p.HQ; ++hq) {
      const long h = hq / group;
      for (long a = lo; a < hi; ++a) {
        const long i = klo + (a - lo) + (khi - klo) - (hi - lo);  // the query's key position
        // Logits of row a over the keys; -inf where masked.
        std::vector<double> z(Tk, ninf);
        double zmax = ninf;
        for (long j = klo; j < khi; ++j) {
          if (p.causal && j > i) continue;
          if (p.window > 0 && (i - j >= p.window || j - i >= p.window)) continue;
          double bias = 0;
          if (gated)
            for (long t = j + 1; t <= i; ++t) bias += g[(b * Tk + t) * p.HQ + hq];
          if (bias == ninf) continue;
          double dot = 0;
          for (long d = 0; d < p.D; ++d) dot += Q(b, a, hq, d) * K(b, j, h, d);
          z[j] = p.gate == softmax_problem::gate_before_scale ? p.scale * (dot + bias)
                                                              : p.scale * dot + bias;
          zmax = std::max(zmax, z[j]);
        }
        std::vector<double> prob(Tk, 0.0);
        double denom = 0;
        for (long j = klo; j < khi; ++j) denom += z[j] == ninf ? 0.0 : std::exp(z[j] - zmax);
        for (long j = klo; j < khi; ++j)
          prob[j] = z[j] == ninf ? 0.0 : std::exp(z[j] - zmax) / denom;

        std::vector<double> o(p.Dv, 0.0);
        for (long j = klo; j < khi; ++j)
          for (long e = 0; e < p.Dv; ++e) o[e] += prob[j] * V(b, j, h, e);
        double delta = 0;
        for (long e = 0; e < p.Dv; ++e) delta += DO(b, a, hq, e) * o[e];

        std::vector<double> dz(Tk, 0.0);
        for (long j = klo; j < khi; ++j) {
          if (prob[j] == 0.0) continue;
          double dp = 0;
          for (long e = 0; e < p.Dv; ++e) dp += DO(b, a, hq, e) * V(b, j, h, e);
          dz[j] = prob[j] * (dp - delta);
          for (long e = 0; e < p.Dv; ++e)
            r.dv[((b * Tk + j) * p.H + h) * p.Dv + e] += prob[j] * DO(b, a, hq, e);
          for (long d = 0; d < p.D; ++d) {
            r.dq[((b * p.T + a) * p.HQ + hq) * p.D + d] += p.scale * dz[j] * K(b, j, h, d);
            r.dk[((b * Tk + j) * p.H + h) * p.D + d] += p.scale * dz[j] * Q(b, a, hq, d);
          }
        }
        if (gated) {
          // g_t (klo < t <= i) enters the bias of every key j < t of this row.
          double below = 0;
          for (long t = klo + 1; t <= i; ++t) {
            below += dz[t - 1];
            r.dg[(b * Tk + t) * p.HQ + hq] += coef * below;
          }
        }
      }
    }
  }
  return r;
}

}  // namespace attnmix_ref
