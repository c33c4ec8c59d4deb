#pragma once
// Runs one softmax-family attention case through the library and through the float64
// oracle, on fresh random inputs, with outputs poisoned first.

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "reference/softmax_reference.hpp"
#include "support/catch.hpp"
#include "support/testing.hpp"

namespace attnmix_test {

struct attention_case {
  index_t B, T, HQ, H, D, Dv;
  index_t window = 0;
  std::vector<std::int32_t> cu_seqlens{};  // non-empty: B must be 1 and T == back()
  std::optional<double> scale{};
  double gate_lo = -0.1, gate_hi = -0.01;  // log forget gate ~ U(gate_lo, gate_hi)
  int threads = 0;

  std::string describe() const {
    std::ostringstream os;
    os << "B=" << B << " T=" << T << " HQ=" << HQ << " H=" << H << " D=" << D << " Dv=" << Dv
       << " window=" << window << " varlen=" << cu_seqlens.size()
       << " scale=" << (scale ? *scale : -1.0) << " gate=U(" << gate_lo << "," << gate_hi << ")";
    return os.str();
  }
};

struct case_result {
  double out_error, lse_error;
};

template <class Kind, class Policy, class T>
case_result run_attention_case(const attention_case& c, std::uint64_t salt) {
  using A = attnmix::accum_t<T>;
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  rng r(salt);
  attnmix::host_tensor<T, 4> q({c.B, c.T, c.HQ, c.D}), k({c.B, c.T, c.H, c.D});
  attnmix::host_tensor<T, 4> v({c.B, c.T, c.H, c.Dv}), out({c.B, c.T, c.HQ, c.Dv});
  attnmix::host_tensor<A, 3> g({c.B, c.T, c.HQ}), lse({c.B, c.T, c.HQ});
  r.fill_normal(q);
  r.fill_normal(k);
  r.fill_normal(v);
  r.fill_uniform(g, c.gate_lo, c.gate_hi);
  poison(out);
  poison(lse);

  attnmix::attention_args<T> args{q.view(), k.view(), v.view(), out.view()};
  if constexpr (gated) args.g = g.view();
  args.lse = lse.view();
  attnmix::attention_params params;
  params.scale = c.scale;
  params.window = c.window;
  if (!c.cu_seqlens.empty())
    params.cu_seqlens = {c.cu_seqlens.data(), {static_cast<index_t>(c.cu_seqlens.size())}};
  attnmix::attention<Kind, Policy>(args, params, attnmix::backend::cpu{c.threads});

  attnmix_ref::softmax_problem p{
      c.B, c.T, c.HQ, c.H, c.D, c.Dv, c.scale ? *c.scale : 1.0 / std::sqrt(double(c.D))};
  p.causal = Policy::mask == attnmix::mask_type::causal;
  p.window = c.window;
  p.cu_seqlens.assign(c.cu_seqlens.begin(), c.cu_seqlens.end());
  if constexpr (gated)
    p.gate = Policy::gate == attnmix::gate_scaling::after_scale
                 ? attnmix_ref::softmax_problem::gate_after_scale
                 : attnmix_ref::softmax_problem::gate_before_scale;
  const auto ref = attnmix_ref::softmax_attention(p, to_double(q.storage()), to_double(k.storage()),
                                                  to_double(v.storage()), to_double(g.storage()));
  return {rel_error(out.storage(), ref.out), lse_error(lse.storage(), ref.lse)};
}

// The shape sweep of DESIGN.md: lengths off every tile size, GQA, D != Dv, varlen with empty
// and length-1 sequences, windows, a custom scale.
inline std::vector<attention_case> standard_cases() {
  return {
      {1, 1, 1, 1, 8, 8},
      {2, 63, 4, 2, 32, 16},
      {1, 65, 3, 3, 64, 64, 0, {}, 0.3},
      {2, 130, 8, 1, 16, 24},  // MQA
      {1, 1000, 2, 1, 64, 32},
      {1, 200, 4, 2, 32, 32, 17},
      {2, 129, 2, 2, 16, 8, 1},
      {1, 300, 2, 2, 16, 16, 64},
      {1, 200, 4, 2, 32, 16, 0, {0, 0, 1, 64, 64, 130, 200}},
      {1, 150, 2, 1, 16, 16, 20, {0, 70, 71, 150}},
      {1, 0, 2, 1, 8, 8, 0, {0, 0}},
      {3, 40, 2, 2, 8, 8, 0, {}, std::nullopt, -0.1, -0.01, 3},
  };
}

}  // namespace attnmix_test
