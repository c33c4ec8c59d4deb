#pragma once
// Float64 brute-force oracle for softmax attention and FoX, written from the definitions in
// DESIGN.md and spec/path_fox.md §7. Plain loops over plain arrays; it shares no code with
// the library. Inputs are contiguous [B,T,HQ,D] / [B,T,H,D] / [B,T,H,Dv] / [B,T,HQ] arrays.

#include <cmath>
#include <limits>
#include <vector>

namespace attnmix_ref {

struct softmax_problem {
  long B, T, HQ, H, D, Dv;
  double scale;
  bool causal = true;
  long window = 0;  // 0: none; else keys with 0 <= i-j < window (|i-j| < window bidirectional)
  std::vector<long> cu_seqlens{};  // empty: dense batch
  enum gate_mode { no_gate, gate_after_scale, gate_before_scale } gate = no_gate;
};

struct attention_result {
  std::vector<double> out;  // [B,T,HQ,Dv]
  std::vector<double> lse;  // [B,T,HQ]
};

inline attention_result softmax_attention(const softmax_problem& p, const std::vector<double>& q,
                                          const std::vector<double>& k,
                                          const std::vector<double>& v,
                                          const std::vector<double>& g = {}) {
  attention_result r{std::vector<double>(p.B * p.T * p.HQ * p.Dv, 0.0),
                     std::vector<double>(p.B * p.T * p.HQ, 0.0)};
  // Sequences as (batch, begin, end).
  std::vector<long> seq_b, seq_lo, seq_hi;
  if (p.cu_seqlens.empty()) {
    for (long b = 0; b < p.B; ++b) seq_b.push_back(b), seq_lo.push_back(0), seq_hi.push_back(p.T);
  } else {
    for (std::size_t n = 0; n + 1 < p.cu_seqlens.size(); ++n)
      seq_b.push_back(0), seq_lo.push_back(p.cu_seqlens[n]), seq_hi.push_back(p.cu_seqlens[n + 1]);
  }
  const long group = p.HQ / p.H;
  for (std::size_t n = 0; n < seq_b.size(); ++n) {
    const long b = seq_b[n], lo = seq_lo[n], hi = seq_hi[n];
    for (long hq = 0; hq < p.HQ; ++hq) {
      const long h = hq / group;
      // Inclusive cumulative log gate from the sequence start.
      std::vector<double> G(p.T, 0.0);
      if (p.gate != softmax_problem::no_gate) {
        double sum = 0;
        for (long t = lo; t < hi; ++t) sum += g[(b * p.T + t) * p.HQ + hq], G[t] = sum;
      }
      for (long i = lo; i < hi; ++i) {
        std::vector<double> z(p.T, -std::numeric_limits<double>::infinity());
        double zmax = -std::numeric_limits<double>::infinity();
        for (long j = lo; j < hi; ++j) {
          if (p.causal && j > i) continue;
          if (p.window > 0 && (i - j >= p.window || j - i >= p.window)) continue;
          double dot = 0;
          for (long d = 0; d < p.D; ++d)
            dot +=
                q[((b * p.T + i) * p.HQ + hq) * p.D + d] * k[((b * p.T + j) * p.H + h) * p.D + d];
          const double bias = G[i] - G[j];
          if (p.gate == softmax_problem::gate_after_scale)
            z[j] = p.scale * dot + bias;
          else if (p.gate == softmax_problem::gate_before_scale)
            z[j] = p.scale * (dot + bias);
          else
            z[j] = p.scale * dot;
          zmax = std::max(zmax, z[j]);
        }
        double denom = 0;
        for (long j = lo; j < hi; ++j) denom += std::exp(z[j] - zmax);
        for (long j = lo; j < hi; ++j) {
          const double pj = std::exp(z[j] - zmax) / denom;
          for (long e = 0; e < p.Dv; ++e)
            r.out[((b * p.T + i) * p.HQ + hq) * p.Dv + e] +=
                pj * v[((b * p.T + j) * p.H + h) * p.Dv + e];
        }
        r.lse[(b * p.T + i) * p.HQ + hq] = zmax + std::log(denom);
      }
    }
  }
  return r;
}

}  // namespace attnmix_ref
