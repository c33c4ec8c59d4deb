#pragma once
// Two independent float64 oracles for PaTH and PaTH-FoX, written from spec/path_fox.md §1.1
// and §1.4 in the plainest way: plain loops over std::vector<double>, no code shared with the
// library.
//   A. path_query_scan: each query walks right to left over its keys, u <- H_j u after
//      scoring key j.
//   B. path_key_recurrence: the decoding recurrence; every new token first moves all cached
//      keys through its transition, is appended, then attends. Its final cache is the prefill
//      key cache kappa_j = H_{L-1} ... H_{j+1} k_j.
// Inputs are contiguous: q [B,T,HQ,D], k and w [B,T,H,D], v [B,T,H,Dv], beta [B,T,H],
// g [B,T,HQ].

#include <cmath>
#include <limits>
#include <vector>

namespace attnmix_ref {

struct path_problem {
  long B, T, HQ, H, D, Dv;
  double scale;
  std::vector<long> cu_seqlens{};  // empty: dense batch
  enum gate_mode { no_gate, gate_after_scale, gate_before_scale } gate = no_gate;
};

struct path_result {
  std::vector<double> out;        // [B,T,HQ,Dv]
  std::vector<double> lse;        // [B,T,HQ]
  std::vector<double> key_cache;  // [B,T,H,D]; only path_key_recurrence fills it
};

namespace path_detail {

struct segment {
  long b, lo, hi;
};

inline std::vector<segment> segments(const path_problem& p) {
  std::vector<segment> s;
  if (p.cu_seqlens.empty())
    for (long b = 0; b < p.B; ++b) s.push_back({b, 0, p.T});
  else
    for (std::size_t n = 0; n + 1 < p.cu_seqlens.size(); ++n)
      s.push_back({0, p.cu_seqlens[n], p.cu_seqlens[n + 1]});
  return s;
}

// Inclusive cumsum of g over [lo, hi) for one query head, indexed by absolute token.
inline std::vector<double> gate_cumsum(const path_problem& p, const std::vector<double>& g,
                                       const segment& s, long hq) {
  std::vector<double> G(p.T, 0.0);
  if (p.gate == path_problem::no_gate) return G;
  double sum = 0;
  for (long t = s.lo; t < s.hi; ++t) sum += g[(s.b * p.T + t) * p.HQ + hq], G[t] = sum;
  return G;
}

inline double logit(const path_problem& p, double l, double Gi, double Gj) {
  if (p.gate == path_problem::gate_after_scale) return p.scale * l + (Gi - Gj);
  if (p.gate == path_problem::gate_before_scale) return p.scale * (l + Gi - Gj);
  return p.scale * l;
}

// Softmax over logits l[lo..i] of query i, head hq; writes out and lse.
inline void attend(const path_problem& p, const std::vector<double>& v, const segment& s, long i,
                   long hq, const std::vector<double>& logits, path_result& r) {
  const long h = hq / (p.HQ / p.H);
  double zmax = -std::numeric_limits<double>::infinity();
  for (long j = s.lo; j <= i; ++j) zmax = std::max(zmax, logits[j]);
  double denom = 0;
  for (long j = s.lo; j <= i; ++j) denom += std::exp(logits[j] - zmax);
  for (long j = s.lo; j <= i; ++j) {
    const double pj = std::exp(logits[j] - zmax) / denom;
    for (long e = 0; e < p.Dv; ++e)
      r.out[((s.b * p.T + i) * p.HQ + hq) * p.Dv + e] +=
          pj * v[((s.b * p.T + j) * p.H + h) * p.Dv + e];
  }
  r.lse[(s.b * p.T + i) * p.HQ + hq] = zmax + std::log(denom);
}

}  // namespace path_detail

// Oracle A: the query right-to-left scan, O(T^2 D).
inline path_result path_query_scan(const path_problem& p, const std::vector<double>& q,
                                   const std::vector<double>& k, const std::vector<double>& v,
                                   const std::vector<double>& w, const std::vector<double>& beta,
                                   const std::vector<double>& g = {}) {
  path_result r{std::vector<double>(p.B * p.T * p.HQ * p.Dv, 0.0),
                std::vector<double>(p.B * p.T * p.HQ, 0.0),
                {}};
  for (const auto& s : path_detail::segments(p))
    for (long hq = 0; hq < p.HQ; ++hq) {
      const long h = hq / (p.HQ / p.H);
      const std::vector<double> G = path_detail::gate_cumsum(p, g, s, hq);
      for (long i = s.lo; i < s.hi; ++i) {
        std::vector<double> u(p.D), logits(p.T, 0.0);
        for (long d = 0; d < p.D; ++d) u[d] = q[((s.b * p.T + i) * p.HQ + hq) * p.D + d];
        for (long j = i; j >= s.lo; --j) {
          const double* kj = &k[((s.b * p.T + j) * p.H + h) * p.D];
          const double* wj = &w[((s.b * p.T + j) * p.H + h) * p.D];
          double l = 0;
          for (long d = 0; d < p.D; ++d) l += u[d] * kj[d];
          logits[j] = path_detail::logit(p, l, G[i], G[j]);
          double wu = 0;  // u <- H_j u, after scoring key j
          for (long d = 0; d < p.D; ++d) wu += wj[d] * u[d];
          const double bj = beta[(s.b * p.T + j) * p.H + h];
          for (long d = 0; d < p.D; ++d) u[d] -= bj * wu * wj[d];
        }
        path_detail::attend(p, v, s, i, hq, logits, r);
      }
    }
  return r;
}

// Oracle B: the key-cache recurrence, O(T^2 D); also returns the final cache.
inline path_result path_key_recurrence(const path_problem& p, const std::vector<double>& q,
                                       const std::vector<double>& k, const std::vector<double>& v,
                                       const std::vector<double>& w,
                                       const std::vector<double>& beta,
                                       const std::vector<double>& g = {}) {
  path_result r{std::vector<double>(p.B * p.T * p.HQ * p.Dv, 0.0),
                std::vector<double>(p.B * p.T * p.HQ, 0.0),
                std::vector<double>(p.B * p.T * p.H * p.D, 0.0)};
  for (const auto& s : path_detail::segments(p)) {
    std::vector<std::vector<double>> G(p.HQ);
    for (long hq = 0; hq < p.HQ; ++hq) G[hq] = path_detail::gate_cumsum(p, g, s, hq);
    for (long h = 0; h < p.H; ++h) {
      std::vector<std::vector<double>> cache;  // cache[j - lo]
      for (long t = s.lo; t < s.hi; ++t) {
        const double* wt = &w[((s.b * p.T + t) * p.H + h) * p.D];
        const double bt = beta[(s.b * p.T + t) * p.H + h];
        for (auto& kappa : cache) {
          double wk = 0;
          for (long d = 0; d < p.D; ++d) wk += wt[d] * kappa[d];
          for (long d = 0; d < p.D; ++d) kappa[d] -= bt * wk * wt[d];
        }
        cache.emplace_back(&k[((s.b * p.T + t) * p.H + h) * p.D],
                           &k[((s.b * p.T + t) * p.H + h) * p.D] + p.D);
        for (long hq = h * (p.HQ / p.H); hq < (h + 1) * (p.HQ / p.H); ++hq) {
          std::vector<double> logits(p.T, 0.0);
          for (long j = s.lo; j <= t; ++j) {
            double l = 0;
            for (long d = 0; d < p.D; ++d)
              l += q[((s.b * p.T + t) * p.HQ + hq) * p.D + d] * cache[j - s.lo][d];
            logits[j] = path_detail::logit(p, l, G[hq][t], G[hq][j]);
          }
          path_detail::attend(p, v, s, t, hq, logits, r);
        }
      }
      for (long j = s.lo; j < s.hi; ++j)
        for (long d = 0; d < p.D; ++d)
          r.key_cache[((s.b * p.T + j) * p.H + h) * p.D + d] = cache[j - s.lo][d];
    }
  }
  return r;
}

}  // namespace attnmix_ref
