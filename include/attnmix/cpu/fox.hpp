#pragma once
// FoX (forgetting attention) on the CPU: softmax attention with the bias G_i - G_j, where G is
// the inclusive cumsum of the log forget gate g over each sequence.

#include <type_traits>
#include <vector>

#include "attnmix/attention/attention.hpp"
#include "attnmix/cpu/detail/flash.hpp"

namespace attnmix {

template <>
struct is_implemented<kind::fox, backend::cpu> : std::true_type {};

namespace detail {
namespace cpu {

// G laid out like g ([B, T, HQ], contiguous), restarting at every sequence; summed in double.
template <class T>
std::vector<double> gate_cumsum(const view3<const T>& g, const attention_problem& p) {
  std::vector<double> G(static_cast<std::size_t>(p.batch * p.tokens * p.q_heads));
  for (index_t n = 0; n < p.num_sequences; ++n) {
    const sequence s = p.seq(n);
    for (index_t hq = 0; hq < p.q_heads; ++hq) {
      double sum = 0;
      for (index_t t = s.start; t < s.start + s.length; ++t) {
        sum += static_cast<double>(g(s.batch, t, hq));
        G[static_cast<std::size_t>((s.batch * p.tokens + t) * p.q_heads + hq)] = sum;
      }
    }
  }
  return G;
}

}  // namespace cpu

template <class Policy>
struct attention_impl<kind::fox, backend::cpu, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p, const backend::cpu& be) {
    cpu::require_cpu_scalar<T>();
    const std::vector<double> G = cpu::gate_cumsum(a.g, p);
    cpu::flash_forward<Policy>(a, p, be, G.data(), gate_coefficient<Policy>(p));
  }
};

}  // namespace detail
}  // namespace attnmix
