#pragma once
// Runs one linear-attention case (bla, gbla, linear_causal) through the library and through
// the float64 oracle, on fresh random inputs, with outputs poisoned first.

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "reference/linear_reference.hpp"
#include "support/catch.hpp"
#include "support/testing.hpp"

namespace attnmix_test {

enum class padding { none, right, left, holes };

struct linear_case {
  index_t B, T, HQ, H, D, Dv;
  std::vector<std::int32_t> cu_seqlens{};  // non-empty: B must be 1 and T == back()
  padding pad = padding::none;             // a [B,T] mask with this pattern
  std::optional<double> scale{};
  int threads = 0;
  bool with_state_in = false;  // causal: start from a random state
  bool nan_pads = false;       // fill q, k, v, a, gate at pad positions with NaN
  double gate_sigma = 2.0;     // key-gate logits ~ N(0, gate_sigma^2)
  bool with_gamma = true;
  // Plus gate_step times a random level 0, 1 or 2: logits far apart (past float's exp range for a
  // step of 50) with many keys on each level, so that rows do not all attend to one key each.
  double gate_step = 0;

  std::string describe() const {
    std::ostringstream os;
    os << "B=" << B << " T=" << T << " HQ=" << HQ << " H=" << H << " D=" << D << " Dv=" << Dv
       << " varlen=" << cu_seqlens.size() << " pad=" << static_cast<int>(pad)
       << " scale=" << (scale ? *scale : -1.0) << " threads=" << threads
       << " state_in=" << with_state_in << " nan_pads=" << nan_pads;
    return os.str();
  }
  index_t sequences() const {
    return cu_seqlens.empty() ? B : static_cast<index_t>(cu_seqlens.size()) - 1;
  }
};

struct linear_errors {
  double out, S, z, lse;
};

template <class Policy>
attnmix_ref::linear_problem oracle_problem(const linear_case& c, bool causal, double scale) {
  using namespace attnmix;
  attnmix_ref::linear_problem p{c.B, c.T, c.HQ, c.H, c.D, c.Dv};
  switch (Policy::phi) {
    case feature_map::elu_plus_one:
      p.phi = attnmix_ref::linear_problem::elu_plus_one;
      break;
    case feature_map::relu:
      p.phi = attnmix_ref::linear_problem::relu;
      break;
    case feature_map::squared_relu:
      p.phi = attnmix_ref::linear_problem::squared_relu;
      break;
    case feature_map::sigmoid:
      p.phi = attnmix_ref::linear_problem::sigmoid;
      break;
    case feature_map::identity:
      p.phi = attnmix_ref::linear_problem::identity;
      break;
  }
  p.normalize = Policy::normalize;
  p.causal = causal;
  p.scale = scale;
  p.gate = Policy::gate == key_gate::off      ? attnmix_ref::linear_problem::no_gate
           : Policy::gate == key_gate::shared ? attnmix_ref::linear_problem::shared_gate
                                              : attnmix_ref::linear_problem::per_head_gate;
  p.norm = Policy::norm == gated_norm::off        ? attnmix_ref::linear_problem::no_norm
           : Policy::norm == gated_norm::per_head ? attnmix_ref::linear_problem::per_head_norm
                                                  : attnmix_ref::linear_problem::full_width_norm;
  p.gate_then_norm = Policy::order == norm_gate_order::gate_then_norm;
  p.sigmoid_activation = Policy::activation == gate_activation::sigmoid;
  p.gamma_per_head = Policy::weight == norm_weight::per_head;
  p.cu_seqlens.assign(c.cu_seqlens.begin(), c.cu_seqlens.end());
  return p;
}

// Validity mask [B,T] of a padding pattern; per-row lengths include 0 and T.
inline std::vector<std::uint8_t> make_mask(const linear_case& c, rng& r) {
  std::vector<std::uint8_t> m(static_cast<std::size_t>(c.B * c.T), 1);
  if (c.pad == padding::none) return m;
  for (index_t b = 0; b < c.B; ++b) {
    const index_t len = b == 0 ? c.T : b == 1 ? 0 : r.integer(0, c.T);
    for (index_t t = 0; t < c.T; ++t) {
      bool ok = true;
      if (c.pad == padding::right) ok = t < len;
      if (c.pad == padding::left) ok = t >= c.T - len;
      if (c.pad == padding::holes) ok = r.uniform(0, 1) < 0.7;
      m[static_cast<std::size_t>(b * c.T + t)] = ok;
    }
  }
  return m;
}

// All the tensors of one call.
template <class T>
struct linear_inputs {
  using A = attnmix::accum_t<T>;
  attnmix::host_tensor<T, 4> q, k, v, gate, out;
  attnmix::host_tensor<A, 3> a;
  attnmix::host_tensor<A, 1> gamma;
  std::vector<std::uint8_t> mask;
  attnmix::host_tensor<A, 4> S_in, S_out;
  attnmix::host_tensor<A, 3> z_in, z_out;
  attnmix::host_tensor<A, 2> lse_in, lse_out;
};

template <class Policy, class T>
linear_inputs<T> make_inputs(const linear_case& c, rng& r) {
  using A = attnmix::accum_t<T>;
  const index_t Hg = Policy::gate == attnmix::key_gate::per_head ? c.H : 1;
  const index_t N = c.sequences();
  linear_inputs<T> in;
  in.q = attnmix::host_tensor<T, 4>({c.B, c.T, c.HQ, c.D});
  in.k = attnmix::host_tensor<T, 4>({c.B, c.T, c.H, c.D});
  in.v = attnmix::host_tensor<T, 4>({c.B, c.T, c.H, c.Dv});
  in.gate = attnmix::host_tensor<T, 4>({c.B, c.T, c.HQ, c.Dv});
  in.out = attnmix::host_tensor<T, 4>({c.B, c.T, c.HQ, c.Dv});
  in.a = attnmix::host_tensor<A, 3>({c.B, c.T, Hg});
  in.gamma = attnmix::host_tensor<A, 1>(
      {Policy::weight == attnmix::norm_weight::per_head ? c.HQ * c.Dv : c.Dv});
  in.S_in = in.S_out = attnmix::host_tensor<A, 4>({N, c.H, c.D, c.Dv});
  in.z_in = in.z_out = attnmix::host_tensor<A, 3>({N, c.H, c.D});
  in.lse_in = in.lse_out = attnmix::host_tensor<A, 2>({N, c.H});
  r.fill_normal(in.q);
  r.fill_normal(in.k);
  r.fill_normal(in.v);
  r.fill_normal(in.gate);
  r.fill_normal(in.a, c.gate_sigma);
  if (c.gate_step != 0) {
    attnmix::host_tensor<A, 3> level(in.a.shape());
    r.fill_uniform(level, 0.0, 3.0);
    for (std::size_t i = 0; i < level.storage().size(); ++i)
      in.a.storage()[i] += A(c.gate_step * std::floor(double(level.storage()[i])));
  }
  r.fill_uniform(in.gamma, 0.5, 1.5);
  in.mask = make_mask(c, r);
  // A plausible incoming state: S and z of a few random earlier keys (z > 0 like phi(k) sums).
  r.fill_normal(in.S_in, 3.0);
  r.fill_uniform(in.z_in, 0.5, 4.0);
  r.fill_normal(in.lse_in);
  if (c.nan_pads && c.pad != padding::none) {
    const T nan = std::numeric_limits<T>::quiet_NaN();
    for (index_t b = 0; b < c.B; ++b)
      for (index_t t = 0; t < c.T; ++t) {
        if (in.mask[static_cast<std::size_t>(b * c.T + t)]) continue;
        for (index_t h = 0; h < c.HQ; ++h)
          for (index_t d = 0; d < c.D; ++d) in.q(b, t, h, d) = nan;
        for (index_t h = 0; h < c.H; ++h) {
          for (index_t d = 0; d < c.D; ++d) in.k(b, t, h, d) = nan;
          for (index_t d = 0; d < c.Dv; ++d) in.v(b, t, h, d) = nan;
        }
        for (index_t h = 0; h < c.HQ; ++h)
          for (index_t d = 0; d < c.Dv; ++d) in.gate(b, t, h, d) = nan;
        for (index_t g = 0; g < Hg; ++g) in.a(b, t, g) = std::numeric_limits<A>::quiet_NaN();
      }
  }
  poison(in.out);
  poison(in.S_out);
  poison(in.z_out);
  poison(in.lse_out);
  return in;
}

template <class Policy, class T>
attnmix::linear_attention_args<T> make_args(linear_inputs<T>& in, const linear_case& c) {
  attnmix::linear_attention_args<T> args{in.q.view(), in.k.view(), in.v.view(), in.out.view()};
  if (c.pad != padding::none) args.mask = {in.mask.data(), {c.B, c.T}};
  if constexpr (Policy::gate != attnmix::key_gate::off) {
    args.a = in.a.view();
    args.state_out.lse = in.lse_out.view();
  }
  if constexpr (Policy::norm != attnmix::gated_norm::off) {
    args.gate = in.gate.view();
    if (c.with_gamma) args.gamma = in.gamma.view();
  }
  args.state_out.S = in.S_out.view();
  args.state_out.z = in.z_out.view();
  if (c.with_state_in) {
    args.state_in.S = in.S_in.view();
    args.state_in.z = in.z_in.view();
    if constexpr (Policy::gate != attnmix::key_gate::off) args.state_in.lse = in.lse_in.view();
  }
  return args;
}

template <class T>
attnmix::linear_attention_params make_params(const linear_case& c) {
  attnmix::linear_attention_params params;
  params.scale = c.scale;
  if (!c.cu_seqlens.empty())
    params.cu_seqlens = {c.cu_seqlens.data(), {static_cast<index_t>(c.cu_seqlens.size())}};
  return params;
}

template <class Kind, class Policy, class T>
linear_errors run_linear_case(const linear_case& c, std::uint64_t salt) {
  constexpr bool causal = attnmix::linear_kind_traits<Kind>::causal;
  rng r(salt);
  linear_inputs<T> in = make_inputs<Policy, T>(c, r);
  attnmix::linear_attention_args<T> args = make_args<Policy>(in, c);
  attnmix::linear_attention<Kind, Policy>(args, make_params<T>(c),
                                          attnmix::backend::cpu{c.threads});

  const double scale = c.scale ? *c.scale : Policy::normalize ? 1.0 : 1.0 / std::sqrt(double(c.D));
  attnmix_ref::linear_problem p = oracle_problem<Policy>(c, causal, scale);
  if (c.pad != padding::none) p.mask.assign(in.mask.begin(), in.mask.end());
  if (c.with_state_in) {
    p.S_in = to_double(in.S_in.storage());
    p.z_in = to_double(in.z_in.storage());
    if (Policy::gate != attnmix::key_gate::off) p.lse_in = to_double(in.lse_in.storage());
  }
  const auto ref = attnmix_ref::linear_attention(
      p, to_double(in.q.storage()), to_double(in.k.storage()), to_double(in.v.storage()),
      to_double(in.a.storage()), to_double(in.gate.storage()),
      c.with_gamma ? to_double(in.gamma.storage()) : std::vector<double>{});
  linear_errors e{rel_error(in.out.storage(), ref.out), rel_error(in.S_out.storage(), ref.S),
                  rel_error(in.z_out.storage(), ref.z), 0.0};
  if (Policy::gate != attnmix::key_gate::off) e.lse = lse_error(in.lse_out.storage(), ref.lse);
  return e;
}

// Shapes off every block size, GQA, D != Dv, varlen with empty and length-1 sequences, each
// padding pattern, a custom scale, explicit thread counts.
inline std::vector<linear_case> standard_linear_cases() {
  std::vector<linear_case> cs = {
      {1, 1, 1, 1, 8, 8},
      {2, 63, 4, 2, 32, 16},
      {1, 65, 3, 3, 64, 64, {}, padding::none, 0.3},
      {2, 130, 8, 1, 16, 24},  // MQA
      {1, 1000, 2, 1, 64, 32},
      {3, 77, 2, 2, 16, 8, {}, padding::right},
      {3, 77, 4, 2, 16, 8, {}, padding::left},
      {3, 300, 2, 1, 8, 16, {}, padding::holes},
      {1, 200, 4, 2, 32, 16, {0, 0, 1, 64, 64, 130, 200}},
      {1, 150, 2, 1, 16, 16, {0, 70, 71, 150}, padding::holes},
      {1, 0, 2, 1, 8, 8, {0, 0}},
      {3, 40, 2, 2, 8, 8, {}, padding::none, std::nullopt, 3},
      {1, 700, 1, 1, 16, 8, {}, padding::none, std::nullopt, 2},  // split reduction
  };
  linear_case nan_pads{3, 90, 2, 1, 16, 8, {}, padding::holes};
  nan_pads.nan_pads = true;
  cs.push_back(nan_pads);
  return cs;
}

}  // namespace attnmix_test
