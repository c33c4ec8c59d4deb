#pragma once
// The float64 gradient oracle of PaTH and PaTH-FoX: reverse mode of oracle A (the query
// right-to-left scan), written from spec/path_fox.md §4.1 with plain loops; no code shared with
// the library. Per query row i of head hq, with u_j the scan state that scores key j
// (u_i = q_i, u_{j-1} = H_j u_j):
//   dz_ij = p_ij (do_i . v_j - do_i . o_i),  dl_ij = s dz_ij,  dv_j += p_ij do_i
//   dk_j += dl_ij u_j
//   ubar_j = dl_ij k_j + H_j ubar_{j-1} (j > first), dq_i = ubar_i
//   dbeta_j += -(w_j . u_j)(w_j . ubar_{j-1}),
//   dw_j += -beta_j [(w_j . u_j) ubar_{j-1} + (w_j . ubar_{j-1}) u_j]
//   dG_i += c sum_j dz_ij, dG_j -= c dz_ij (c = s before the scale, 1 after), dg = reverse cumsum.
// Layouts as in path_reference.hpp; dout [B,T,HQ,Dv]. Hard resets are not modelled: cut the
// sequence instead (the same problem).

#include <cmath>
#include <limits>
#include <vector>

#include "reference/path_reference.hpp"

namespace attnmix_ref {

struct path_gradients {
  std::vector<double> dq, dk, dv, dw, dbeta, dg;
};

inline path_gradients path_query_scan_backward(
    const path_problem& p, const std::vector<double>& q, const std::vector<double>& k,
    const std::vector<double>& v, const std::vector<double>& w, const std::vector<double>& beta,
    const std::vector<double>& g, const std::vector<double>& dout) {
  const long D = p.D, Dv = p.Dv, group = p.HQ / p.H;
  path_gradients r{
      std::vector<double>(p.B * p.T * p.HQ * D, 0.0), std::vector<double>(p.B * p.T * p.H * D, 0.0),
      std::vector<double>(p.B * p.T * p.H * Dv, 0.0), std::vector<double>(p.B * p.T * p.H * D, 0.0),
      std::vector<double>(p.B * p.T * p.H, 0.0),      std::vector<double>(p.B * p.T * p.HQ, 0.0)};
  const double coef = p.gate == path_problem::gate_before_scale  ? p.scale
                      : p.gate == path_problem::gate_after_scale ? 1.0
                                                                 : 0.0;
  const auto qi = [&](long b, long t, long hq) {
    return ((b * p.T + t) * p.HQ + hq) * D;
  };
  const auto ki = [&](long b, long t, long h) {
    return ((b * p.T + t) * p.H + h) * D;
  };
  const auto vi = [&](long b, long t, long h) {
    return ((b * p.T + t) * p.H + h) * Dv;
  };
  const auto oi = [&](long b, long t, long hq) {
    return ((b * p.T + t) * p.HQ + hq) * Dv;
  };
  const auto bi = [&](long b, long t, long h) {
    return (b * p.T + t) * p.H + h;
  };
  const auto gi = [&](long b, long t, long hq) {
    return (b * p.T + t) * p.HQ + hq;
  };

  for (const auto& s : path_detail::segments(p))
    for (long hq = 0; hq < p.HQ; ++hq) {
      const long h = hq / group;
      const std::vector<double> G = path_detail::gate_cumsum(p, g, s, hq);
      std::vector<double> dG(p.T, 0.0);
      for (long i = s.lo; i < s.hi; ++i) {
        // Forward of row i, keeping every scan state.
        std::vector<std::vector<double>> u(i - s.lo + 1, std::vector<double>(D));
        std::vector<double> x(q.begin() + qi(s.b, i, hq), q.begin() + qi(s.b, i, hq) + D);
        std::vector<double> z(p.T, 0.0);
        for (long j = i; j >= s.lo; --j) {
          u[j - s.lo] = x;
          double l = 0, wx = 0;
          for (long d = 0; d < D; ++d) l += x[d] * k[ki(s.b, j, h) + d];
          z[j] = path_detail::logit(p, l, G[i], G[j]);
          for (long d = 0; d < D; ++d) wx += w[ki(s.b, j, h) + d] * x[d];
          for (long d = 0; d < D; ++d) x[d] -= beta[bi(s.b, j, h)] * wx * w[ki(s.b, j, h) + d];
        }
        double zmax = -std::numeric_limits<double>::infinity(), denom = 0;
        for (long j = s.lo; j <= i; ++j) zmax = std::max(zmax, z[j]);
        for (long j = s.lo; j <= i; ++j) denom += std::exp(z[j] - zmax);
        std::vector<double> prob(p.T, 0.0), o(Dv, 0.0);
        for (long j = s.lo; j <= i; ++j) {
          prob[j] = std::exp(z[j] - zmax) / denom;
          for (long e = 0; e < Dv; ++e) o[e] += prob[j] * v[vi(s.b, j, h) + e];
        }
        const double* dO = &dout[oi(s.b, i, hq)];
        double delta = 0;
        for (long e = 0; e < Dv; ++e) delta += dO[e] * o[e];

        // Reverse: the softmax, then the scan from the oldest key forward.
        std::vector<double> dl(p.T, 0.0);
        for (long j = s.lo; j <= i; ++j) {
          double dp = 0;
          for (long e = 0; e < Dv; ++e) dp += dO[e] * v[vi(s.b, j, h) + e];
          const double dz = prob[j] * (dp - delta);
          for (long e = 0; e < Dv; ++e) r.dv[vi(s.b, j, h) + e] += prob[j] * dO[e];
          dl[j] = p.scale * dz;
          dG[i] += coef * dz;
          dG[j] -= coef * dz;
          for (long d = 0; d < D; ++d) r.dk[ki(s.b, j, h) + d] += dl[j] * u[j - s.lo][d];
        }
        std::vector<double> ubar(D, 0.0), prev(D, 0.0);
        for (long j = s.lo; j <= i; ++j) {
          const double* wj = &w[ki(s.b, j, h)];
          const double bj = beta[bi(s.b, j, h)];
          const std::vector<double>& uj = u[j - s.lo];
          if (j > s.lo) {
            double wu = 0, wp = 0;
            for (long d = 0; d < D; ++d) wu += wj[d] * uj[d], wp += wj[d] * prev[d];
            r.dbeta[bi(s.b, j, h)] += -wu * wp;
            for (long d = 0; d < D; ++d)
              r.dw[ki(s.b, j, h) + d] += -bj * (wu * prev[d] + wp * uj[d]);
            for (long d = 0; d < D; ++d) ubar[d] = prev[d] - bj * wp * wj[d];  // H_j ubar_{j-1}
          } else {
            for (long d = 0; d < D; ++d) ubar[d] = 0;
          }
          for (long d = 0; d < D; ++d) ubar[d] += dl[j] * k[ki(s.b, j, h) + d];
          prev = ubar;
        }
        for (long d = 0; d < D; ++d) r.dq[qi(s.b, i, hq) + d] = ubar[d];
      }
      if (p.gate != path_problem::no_gate) {
        double sum = 0;
        for (long t = s.hi - 1; t >= s.lo; --t) sum += dG[t], r.dg[gi(s.b, t, hq)] = sum;
      }
    }
  return r;
}

}  // namespace attnmix_ref
