#pragma once
// Shared pieces of the PaTH tests: random inputs (float-representable, so that float and double
// runs and the oracles see the same numbers), library runs with poisoned outputs, and oracle
// runs.

#include <cmath>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "reference/path_reference.hpp"
#include "support/catch.hpp"
#include "support/testing.hpp"

namespace attnmix_test {

enum class beta_range { uniform, near_zero, near_two, exactly_two, zero };

inline const char* to_string(beta_range b) {
  switch (b) {
    case beta_range::uniform:
      return "U(0,2)";
    case beta_range::near_zero:
      return "U(0,1e-3)";
    case beta_range::near_two:
      return "U(1.9,2)";
    case beta_range::exactly_two:
      return "2";
    case beta_range::zero:
      return "0";
  }
  return "?";
}

struct path_case {
  index_t B, T, HQ, H, D, Dv;
  std::vector<std::int32_t> cu_seqlens{};  // non-empty: B == 1 and T == back()
  beta_range beta = beta_range::uniform;
  int threads = 0;
  double gate_lo = -0.2, gate_hi = -0.01;
  std::optional<double> scale{};  // softmax scale; default 1/sqrt(D)

  index_t sequences() const {
    return cu_seqlens.empty() ? B : static_cast<index_t>(cu_seqlens.size()) - 1;
  }
  std::string describe() const {
    std::ostringstream os;
    os << "B=" << B << " T=" << T << " HQ=" << HQ << " H=" << H << " D=" << D << " Dv=" << Dv
       << " cu_seqlens={";
    for (auto c : cu_seqlens) os << c << ",";
    os << "} beta=" << to_string(beta) << " threads=" << threads << " gate=U(" << gate_lo << ","
       << gate_hi << ") scale=";
    if (scale)
      os << *scale;
    else
      os << "1/sqrt(D)";
    return os.str();
  }
};

// Inputs as doubles that are exactly representable in float.
struct path_inputs {
  std::vector<double> q, k, v, w, beta, g;
};

inline double to_float_grid(double x) {
  return static_cast<double>(static_cast<float>(x));
}

inline path_inputs make_path_inputs(const path_case& c, std::uint64_t salt) {
  rng r(salt);
  path_inputs in;
  auto normal = [&](index_t n) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = to_float_grid(r.normal());
    return x;
  };
  in.q = normal(c.B * c.T * c.HQ * c.D);
  in.k = normal(c.B * c.T * c.H * c.D);
  in.v = normal(c.B * c.T * c.H * c.Dv);
  in.w.resize(static_cast<std::size_t>(c.B * c.T * c.H * c.D));
  for (index_t row = 0; row < c.B * c.T * c.H; ++row) {  // unit directions, as the layer gives
    double norm = 0;
    std::vector<double> x(static_cast<std::size_t>(c.D));
    for (auto& e : x) e = r.normal(), norm += e * e;
    for (index_t d = 0; d < c.D; ++d)
      in.w[static_cast<std::size_t>(row * c.D + d)] = to_float_grid(x[d] / std::sqrt(norm));
  }
  in.beta.resize(static_cast<std::size_t>(c.B * c.T * c.H));
  for (auto& b : in.beta) {
    switch (c.beta) {
      case beta_range::uniform:
        b = r.uniform(0.0, 2.0);
        break;
      case beta_range::near_zero:
        b = r.uniform(0.0, 1e-3);
        break;
      case beta_range::near_two:
        b = r.uniform(1.9, 2.0);
        break;
      case beta_range::exactly_two:
        b = 2.0;
        break;
      case beta_range::zero:
        b = 0.0;
        break;
    }
    b = to_float_grid(b);
  }
  in.g.resize(static_cast<std::size_t>(c.B * c.T * c.HQ));
  for (auto& g : in.g) g = to_float_grid(r.uniform(c.gate_lo, c.gate_hi));
  return in;
}

template <class T>
std::vector<T> cast_to(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

// Owns typed copies of the inputs and hands out views.
template <class T>
struct path_tensors {
  using A = attnmix::accum_t<T>;
  attnmix::host_tensor<T, 4> q, k, v, out;
  attnmix::host_tensor<A, 4> w;
  attnmix::host_tensor<A, 3> beta, g, lse;

  path_tensors(const path_case& c, const path_inputs& in)
      : q({c.B, c.T, c.HQ, c.D}),
        k({c.B, c.T, c.H, c.D}),
        v({c.B, c.T, c.H, c.Dv}),
        out({c.B, c.T, c.HQ, c.Dv}),
        w({c.B, c.T, c.H, c.D}),
        beta({c.B, c.T, c.H}),
        g({c.B, c.T, c.HQ}),
        lse({c.B, c.T, c.HQ}) {
    q.storage() = cast_to<T>(in.q);
    k.storage() = cast_to<T>(in.k);
    v.storage() = cast_to<T>(in.v);
    w.storage() = cast_to<A>(in.w);
    beta.storage() = cast_to<A>(in.beta);
    g.storage() = cast_to<A>(in.g);
    poison(out);
    poison(lse);
  }

  // Arguments for kind Kind (g only when the kind has a gate).
  template <class Kind>
  attnmix::attention_args<T> args() {
    attnmix::attention_args<T> a{q.view(), k.view(), v.view(), out.view()};
    if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate) a.g = g.view();
    if constexpr (attnmix::kind_traits<Kind>::uses_householder) {
      a.w = w.view();
      a.beta = beta.view();
    }
    a.lse = lse.view();
    return a;
  }
};

inline attnmix::attention_params path_params(const path_case& c) {
  attnmix::attention_params p;
  p.scale = c.scale;
  if (!c.cu_seqlens.empty())
    p.cu_seqlens = {c.cu_seqlens.data(), {static_cast<index_t>(c.cu_seqlens.size())}};
  return p;
}

struct path_outputs {
  std::vector<double> out, lse;
};

// One library forward on fresh, poisoned outputs.
template <class Kind, class Policy, class T>
path_outputs run_path_forward(const path_case& c, const path_inputs& in) {
  path_tensors<T> t(c, in);
  attnmix::attention<Kind, Policy>(t.template args<Kind>(), path_params(c),
                                   attnmix::backend::cpu{c.threads});
  return {to_double(t.out.storage()), to_double(t.lse.storage())};
}

inline attnmix_ref::path_problem path_oracle_problem(const path_case& c,
                                                     attnmix_ref::path_problem::gate_mode gate) {
  attnmix_ref::path_problem p{c.B, c.T, c.HQ, c.H, c.D, c.Dv, 1.0 / std::sqrt(double(c.D))};
  p.cu_seqlens.assign(c.cu_seqlens.begin(), c.cu_seqlens.end());
  p.gate = gate;
  return p;
}

// Oracle gate mode for a kind and policy.
template <class Kind, class Policy>
constexpr attnmix_ref::path_problem::gate_mode oracle_gate() {
  if constexpr (!attnmix::kind_traits<Kind>::uses_forget_gate)
    return attnmix_ref::path_problem::no_gate;
  else if constexpr (Policy::gate == attnmix::gate_scaling::before_scale)
    return attnmix_ref::path_problem::gate_before_scale;
  else
    return attnmix_ref::path_problem::gate_after_scale;
}

// A path_policy (or path_fox_policy) with another chunk size.
template <class Base, index_t C>
struct with_chunk : Base {
  static constexpr index_t chunk = C;
};

}  // namespace attnmix_test
