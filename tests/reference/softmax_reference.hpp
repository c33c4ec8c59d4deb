#pragma once
// Float64 brute-force oracle for softmax attention and FoX, written from the definitions in
// DESIGN.md and spec/path_fox.md §7. Plain loops over plain arrays; it shares no code with
// the library. Inputs are contiguous [B,T,HQ,D] / [B,T,H,D] / [B,T,H,Dv] / [B,T,HQ] arrays.

#include <cmath>
#include <limits>
#include <vector>

namespace attnmix_ref {

// Keys may have other lengths than the queries: Tk tokens a batch row (dense) or offsets of
// their own (packed). Query a of a sequence with Lq queries and Lk keys sits at key position
// a + Lk - Lq (the last query aligned with the last key); masks and the gate use that position.
struct softmax_problem {
  long B, T, HQ, H, D, Dv;
  double scale;
  bool causal = true;
  long window = 0;  // 0: none; else keys with 0 <= i-j < window (|i-j| < window bidirectional)
  std::vector<long> cu_seqlens{};  // empty: dense batch
  enum gate_mode { no_gate, gate_after_scale, gate_before_scale } gate = no_gate;
  long Tk = 0;                       // 0: T
  std::vector<long> cu_seqlens_k{};  // empty: cu_seqlens

  long key_tokens() const { return Tk > 0 ? Tk : T; }
};

struct attention_result {
  std::vector<double> out;  // [B,T,HQ,Dv]
  std::vector<double> lse;  // [B,T,HQ]
};

// q [B,T,HQ,D], k [B,Tk,H,D], v [B,Tk,H,Dv], g [B,Tk,HQ] (one log gate per key token).
inline attention_result softmax_attention(const softmax_problem& p, const std::vector<double>& q,
                                          const std::vector<double>& k,
                                          const std::vector<double>& v,
                                          const std::vector<double>& g = {}) {
  const long Tk = p.key_tokens();
  attention_result r{std::vector<double>(p.B * p.T * p.HQ * p.Dv, 0.0),
                     std::vector<double>(p.B * p.T * p.HQ, 0.0)};
  // Sequences as (batch, query range, key range).
  struct seq {
    long b, lo, hi, klo, khi;
  };
  std::vector<seq> seqs;
  if (p.cu_seqlens.empty()) {
    for (long b = 0; b < p.B; ++b) seqs.push_back({b, 0, p.T, 0, Tk});
  } else {
    const std::vector<long>& ck = p.cu_seqlens_k.empty() ? p.cu_seqlens : p.cu_seqlens_k;
    for (std::size_t n = 0; n + 1 < p.cu_seqlens.size(); ++n)
      seqs.push_back({0, p.cu_seqlens[n], p.cu_seqlens[n + 1], ck[n], ck[n + 1]});
  }
  const long group = p.HQ / p.H;
  for (const seq& s : seqs) {
    const long b = s.b, shift = (s.khi - s.klo) - (s.hi - s.lo);
    for (long hq = 0; hq < p.HQ; ++hq) {
      const long h = hq / group;
      // Inclusive cumulative log gate from the sequence's first key.
      std::vector<double> G(Tk, 0.0);
      if (p.gate != softmax_problem::no_gate) {
        double sum = 0;
        for (long t = s.klo; t < s.khi; ++t) sum += g[(b * Tk + t) * p.HQ + hq], G[t] = sum;
      }
      for (long i = s.lo; i < s.hi; ++i) {
        const long at = s.klo + (i - s.lo) + shift;  // the query's key position
        std::vector<double> z(Tk, -std::numeric_limits<double>::infinity());
        double zmax = -std::numeric_limits<double>::infinity();
        for (long j = s.klo; j < s.khi; ++j) {
          if (p.causal && j > at) continue;
          if (p.window > 0 && (at - j >= p.window || j - at >= p.window)) continue;
          double dot = 0;
          for (long d = 0; d < p.D; ++d)
            dot += q[((b * p.T + i) * p.HQ + hq) * p.D + d] * k[((b * Tk + j) * p.H + h) * p.D + d];
          const double bias = p.gate != softmax_problem::no_gate ? G[at] - G[j] : 0.0;
          if (p.gate == softmax_problem::gate_after_scale)
            z[j] = p.scale * dot + bias;
          else if (p.gate == softmax_problem::gate_before_scale)
            z[j] = p.scale * (dot + bias);
          else
            z[j] = p.scale * dot;
          zmax = std::max(zmax, z[j]);
        }
        double denom = 0;
        for (long j = s.klo; j < s.khi; ++j) denom += std::exp(z[j] - zmax);
        for (long j = s.klo; j < s.khi; ++j) {
          const double pj = std::exp(z[j] - zmax) / denom;
          for (long e = 0; e < p.Dv; ++e)
            r.out[((b * p.T + i) * p.HQ + hq) * p.Dv + e] +=
                pj * v[((b * Tk + j) * p.H + h) * p.Dv + e];
        }
        r.lse[(b * p.T + i) * p.HQ + hq] = zmax + std::log(denom);
      }
    }
  }
  return r;
}

}  // namespace attnmix_ref
