#pragma once
// FoX (forgetting attention) on the CPU: softmax attention with the bias G_i - G_j, where G is
// the inclusive cumsum of the log forget gate g over each sequence.

#include <limits>
#include <type_traits>
#include <vector>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/attention_backward.hpp"
#include "attnmix/cpu/detail/flash.hpp"
#include "attnmix/cpu/detail/flash_backward.hpp"

namespace attnmix {

template <>
struct is_implemented<kind::fox, backend::cpu> : std::true_type {};
template <>
struct is_backward_implemented<kind::fox, backend::cpu> : std::true_type {};
template <>
struct takes_key_lengths<kind::fox, backend::cpu> : std::true_type {};
template <>
struct takes_key_lengths_backward<kind::fox, backend::cpu> : std::true_type {};

namespace detail {
namespace cpu {

// G laid out like g ([key_batch, Tk, HQ], contiguous: one value per key token), restarting at
// every sequence; summed in double over the keys each sequence reads. (Sequences that share a
// slot write the same prefix sums.)
// A log gate of -inf is a hard reset: keys before it get weight 0 for every later query. The sum
// restarts at 0 there (so that G_i - G_j stays finite within the segment), and reset[t] holds
// the sequence-local position of the last reset at or before t (0 when none); a query at t sees
// only keys j >= reset[t]. `reset` stays empty when g holds no -inf.
struct gate_prefix {
  std::vector<double> G;
  std::vector<index_t> reset;

  const double* cumsum() const { return G.data(); }
  const index_t* resets() const { return reset.empty() ? nullptr : reset.data(); }
};

template <class T>
gate_prefix gate_cumsum(const view3<const T>& g, const attention_problem& p) {
  gate_prefix out;
  const auto size = static_cast<std::size_t>(p.key_batch * p.key_tokens * p.q_heads);
  out.G.resize(size);
  for (index_t n = 0; n < p.num_sequences; ++n) {
    const sequence s = p.key_seq(n);
    for (index_t hq = 0; hq < p.q_heads; ++hq) {
      double sum = 0;
      index_t last = 0;
      for (index_t t = s.start; t < s.start + s.length; ++t) {
        const auto at = static_cast<std::size_t>((s.batch * p.key_tokens + t) * p.q_heads + hq);
        const double x = static_cast<double>(g(s.batch, t, hq));
        if (x == -std::numeric_limits<double>::infinity()) {
          if (out.reset.empty()) out.reset.assign(size, 0);
          sum = 0;
          last = t - s.start;
        } else {
          sum += x;
        }
        out.G[at] = sum;
        if (!out.reset.empty()) out.reset[at] = last;
      }
    }
  }
  return out;
}

// The backward of gate_cumsum: dg_t = sum of dG_i over the tokens i >= t of t's reset segment
// (a reverse cumsum per sequence and query head); 0 at a hard reset (-inf gate), whose keys'
// weights do not depend on it. dG is laid out like g ([B, Tk, HQ], contiguous, a value a key).
template <class T>
void gate_cumsum_backward(const std::vector<double>& dG, const view3<const T>& g,
                          const view3<T>& dg, const attention_problem& p) {
  for (index_t n = 0; n < p.num_sequences; ++n) {
    const sequence s = p.key_seq(n);
    for (index_t hq = 0; hq < p.q_heads; ++hq) {
      double sum = 0;
      for (index_t t = s.start + s.length - 1; t >= s.start; --t) {
        const auto at = static_cast<std::size_t>((s.batch * p.key_tokens + t) * p.q_heads + hq);
        if (static_cast<double>(g(s.batch, t, hq)) == -std::numeric_limits<double>::infinity()) {
          dg(s.batch, t, hq) = T(0);
          sum = 0;
        } else {
          sum += dG[at];
          dg(s.batch, t, hq) = static_cast<T>(sum);
        }
      }
    }
  }
}

}  // namespace cpu

template <class Policy>
struct attention_impl<kind::fox, backend::cpu, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p, const backend::cpu& be) {
    cpu::require_cpu_scalar<T>();
    const cpu::gate_prefix G = cpu::gate_cumsum(a.g, p);
    cpu::flash_forward<Policy>(a, p, be, G.cumsum(), gate_coefficient<Policy>(p), G.resets());
  }
};

// dq: [B,T,HQ,D], dk: [B,Tk,H,D], dv: [B,Tk,H,Dv] and dg: [B,Tk,HQ] from the forward's inputs,
// its out and lse, and dout: [B,T,HQ,Dv]. The gradient of the gate cumsum G comes from the row and
// column sums of dS; dg is its reverse cumsum per sequence, 0 at a hard reset.
template <class Policy>
struct attention_backward_impl<kind::fox, backend::cpu, Policy> {
  template <class T>
  static void run(const attention_grad_args<T>& a, const attention_problem& p,
                  const backend::cpu& be) {
    cpu::require_cpu_scalar<T>();
    const cpu::gate_prefix G = cpu::gate_cumsum(a.g, p);
    std::vector<double> dG(G.G.size());
    cpu::flash_backward<Policy>(a, p, be, G.cumsum(), gate_coefficient<Policy>(p), G.resets(),
                                dG.data());
    cpu::gate_cumsum_backward(dG, a.g, a.dg, p);
  }
};

}  // namespace detail
}  // namespace attnmix
