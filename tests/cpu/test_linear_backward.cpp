// Backward of BLA, GBLA and causal linear attention on the CPU: every gradient against the
// float64 brute-force reverse pass (tests/reference/linear_backward_reference.hpp), the reverse
// pass against central finite differences of the forward oracle, exact zeros at pad tokens,
// `saved` against the recompute, and bitwise equality across thread counts.

#include <array>
#include <functional>

#include "cpu/test_linear_harness.hpp"
#include "reference/finite_difference.hpp"
#include "reference/linear_backward_reference.hpp"

using namespace attnmix_test;
using attnmix::causal_form;
using attnmix::feature_map;
using attnmix::gate_activation;
using attnmix::gated_norm;
using attnmix::key_gate;
using attnmix::norm_gate_order;
using attnmix::norm_weight;

namespace {

// ---- policies: a representative set of knob combinations ----

struct bla_relu_small : attnmix::bla_policy {  // several blocks and parts; pad rows left alone
  static constexpr feature_map phi = feature_map::relu;
  static constexpr attnmix::index_t block = 16;
  static constexpr bool zero_pad_rows = false;
};
struct bla_identity_raw : attnmix::bla_policy {
  static constexpr feature_map phi = feature_map::identity;
  static constexpr bool normalize = false;
  static constexpr attnmix::index_t block = 16;
};
struct gbla_wide : attnmix::gbla_policy {
  static constexpr feature_map phi = feature_map::squared_relu;
  static constexpr key_gate gate = key_gate::per_head;
  static constexpr gated_norm norm = gated_norm::full_width;
  static constexpr norm_gate_order order = norm_gate_order::gate_then_norm;
  static constexpr gate_activation activation = gate_activation::sigmoid;
  static constexpr norm_weight weight = norm_weight::per_head;
  static constexpr attnmix::index_t block = 16;
};
struct gbla_raw_gate : attnmix::gbla_policy {  // the softmax's Jacobian without the normaliser
  static constexpr feature_map phi = feature_map::sigmoid;
  static constexpr bool normalize = false;
  static constexpr gated_norm norm = gated_norm::off;
  static constexpr attnmix::index_t block = 16;
};

using causal_default = attnmix::linear_causal_policy;
struct causal_gated7 : attnmix::linear_causal_policy {
  static constexpr key_gate gate = key_gate::shared;
  static constexpr attnmix::index_t chunk = 7;
};
struct causal_recurrent_raw : attnmix::linear_causal_policy {
  static constexpr causal_form form = causal_form::recurrent;
  static constexpr key_gate gate = key_gate::per_head;
  static constexpr bool normalize = false;
  static constexpr feature_map phi = feature_map::sigmoid;
  static constexpr attnmix::index_t chunk = 4;
};
struct causal_head_norm : attnmix::linear_causal_policy {
  static constexpr key_gate gate = key_gate::per_head;
  static constexpr gated_norm norm = gated_norm::per_head;
  static constexpr norm_gate_order order = norm_gate_order::gate_then_norm;
  static constexpr gate_activation activation = gate_activation::sigmoid;
  static constexpr attnmix::index_t chunk = 5;
};
struct causal_wide_norm : attnmix::linear_causal_policy {
  static constexpr feature_map phi = feature_map::relu;
  static constexpr key_gate gate = key_gate::shared;
  static constexpr gated_norm norm = gated_norm::full_width;
  static constexpr norm_weight weight = norm_weight::per_head;
  static constexpr attnmix::index_t chunk = 7;
};
struct causal_identity_raw : attnmix::linear_causal_policy {
  static constexpr feature_map phi = feature_map::identity;
  static constexpr bool normalize = false;
  static constexpr attnmix::index_t chunk = 7;
};
struct causal_squared3 : attnmix::linear_causal_policy {
  static constexpr feature_map phi = feature_map::squared_relu;
  static constexpr attnmix::index_t chunk = 3;
};

// ---- one backward case ----

struct grad_errors {
  double dq = 0, dk = 0, dv = 0, da = 0, dgate = 0, dgamma = 0, dS_in = 0, dz_in = 0, dlse_in = 0;
  bool pads_zero = true;
  double worst() const { return std::max({dq, dk, dv, da, dgate, dgamma, dS_in, dz_in, dlse_in}); }
};

std::ostream& operator<<(std::ostream& os, const grad_errors& e) {
  return os << "dq " << e.dq << " dk " << e.dk << " dv " << e.dv << " da " << e.da << " dgate "
            << e.dgate << " dgamma " << e.dgamma << " dS_in " << e.dS_in << " dz_in " << e.dz_in
            << " dlse_in " << e.dlse_in << " pads_zero " << e.pads_zero;
}

struct bwd_options {
  bool use_saved = false;  // bidirectional: hand the oracle's final state as `saved`
  bool dstate_out = true;  // causal: give the gradient of the final state
  int threads = 0;
};

// Worst relative error per gradient over every case run, reported at the end.
grad_errors& worst_seen(bool is_double) {
  static grad_errors w[2];
  return w[is_double ? 1 : 0];
}
void note(grad_errors& w, const grad_errors& e) {
  w.dq = std::max(w.dq, e.dq), w.dk = std::max(w.dk, e.dk), w.dv = std::max(w.dv, e.dv);
  w.da = std::max(w.da, e.da), w.dgate = std::max(w.dgate, e.dgate);
  w.dgamma = std::max(w.dgamma, e.dgamma), w.dS_in = std::max(w.dS_in, e.dS_in);
  w.dz_in = std::max(w.dz_in, e.dz_in), w.dlse_in = std::max(w.dlse_in, e.dlse_in);
}

template <class T>
struct grad_tensors {
  using A = attnmix::accum_t<T>;
  attnmix::host_tensor<T, 4> dout, dq, dk, dv, dgate;
  attnmix::host_tensor<A, 3> da;
  attnmix::host_tensor<A, 1> dgamma;
  attnmix::host_tensor<A, 4> dS_out, dS_in, saved_S;
  attnmix::host_tensor<A, 3> dz_out, dz_in, saved_z;
  attnmix::host_tensor<A, 2> dlse_out, dlse_in, saved_lse;
};

template <class Kind, class Policy, class T>
grad_errors run_backward_case(const linear_case& c, std::uint64_t salt, const bwd_options& opt,
                              grad_tensors<T>* keep = nullptr) {
  using A = attnmix::accum_t<T>;
  constexpr bool causal = attnmix::linear_kind_traits<Kind>::causal;
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool normed = Policy::norm != gated_norm::off;
  rng r(salt);
  linear_inputs<T> in = make_inputs<Policy, T>(c, r);
  const index_t N = c.sequences();
  grad_tensors<T> gt;
  gt.dout = attnmix::host_tensor<T, 4>(in.out.shape());
  r.fill_normal(gt.dout);
  gt.dq = attnmix::host_tensor<T, 4>(in.q.shape());
  gt.dk = attnmix::host_tensor<T, 4>(in.k.shape());
  gt.dv = attnmix::host_tensor<T, 4>(in.v.shape());
  gt.dgate = attnmix::host_tensor<T, 4>(in.gate.shape());
  gt.da = attnmix::host_tensor<A, 3>(in.a.shape());
  gt.dgamma = attnmix::host_tensor<A, 1>(in.gamma.shape());
  gt.dS_out = gt.dS_in = attnmix::host_tensor<A, 4>({N, c.H, c.D, c.Dv});
  gt.dz_out = gt.dz_in = attnmix::host_tensor<A, 3>({N, c.H, c.D});
  gt.dlse_out = gt.dlse_in = attnmix::host_tensor<A, 2>({N, c.H});
  r.fill_normal(gt.dS_out), r.fill_normal(gt.dz_out), r.fill_normal(gt.dlse_out);
  poison(gt.dq), poison(gt.dk), poison(gt.dv), poison(gt.dgate), poison(gt.da);
  poison(gt.dgamma), poison(gt.dS_in), poison(gt.dz_in), poison(gt.dlse_in);
  if (c.nan_pads && c.pad != padding::none) {  // dout at pads is don't-care too
    for (index_t b = 0; b < c.B; ++b)
      for (index_t t = 0; t < c.T; ++t)
        if (!in.mask[static_cast<std::size_t>(b * c.T + t)])
          for (index_t h = 0; h < c.HQ; ++h)
            for (index_t d = 0; d < c.Dv; ++d)
              gt.dout(b, t, h, d) = std::numeric_limits<T>::quiet_NaN();
  }

  // The oracle.
  const double scale = c.scale ? *c.scale : Policy::normalize ? 1.0 : 1.0 / std::sqrt(double(c.D));
  attnmix_ref::linear_problem p = oracle_problem<Policy>(c, causal, scale);
  // With one key the normalised output depends on q and k only through eps (and
  // after the norm through norm_eps), and dq, dk are the small remainder of a cancellation;
  // larger epsilons keep them well conditioned.
  const bool one_key = c.T == 1;  // (a state of small weight changes little)
  attnmix::linear_attention_params params = make_params<T>(c);
  if (one_key) params.eps = p.eps = 100.0, params.norm_eps = p.norm_eps = 4.0;
  if (c.pad != padding::none) p.mask.assign(in.mask.begin(), in.mask.end());
  if (c.with_state_in) {
    p.S_in = to_double(in.S_in.storage());
    p.z_in = to_double(in.z_in.storage());
    if (gated) p.lse_in = to_double(in.lse_in.storage());
  }
  const auto q = to_double(in.q.storage()), k = to_double(in.k.storage()),
             v = to_double(in.v.storage()), a = to_double(in.a.storage()),
             gate = to_double(in.gate.storage());
  const auto gamma = c.with_gamma ? to_double(in.gamma.storage()) : std::vector<double>{};
  attnmix_ref::linear_upstream up;
  up.dout = to_double(gt.dout.storage());
  if (c.nan_pads)
    for (auto& x : up.dout)
      if (std::isnan(x)) x = 0;
  if (causal && opt.dstate_out) {
    up.dS_out = to_double(gt.dS_out.storage());
    up.dz_out = to_double(gt.dz_out.storage());
    if (gated) up.dlse_out = to_double(gt.dlse_out.storage());
  }
  const auto ref = attnmix_ref::linear_attention_backward(p, q, k, v, a, gate, gamma, up);

  // The library.
  attnmix::linear_attention_grad_args<T> g;
  g.q = in.q.view(), g.k = in.k.view(), g.v = in.v.view(), g.dout = gt.dout.view();
  g.dq = gt.dq.view(), g.dk = gt.dk.view(), g.dv = gt.dv.view();
  if (c.pad != padding::none) g.mask = {in.mask.data(), {c.B, c.T}};
  if constexpr (gated) g.a = in.a.view(), g.da = gt.da.view();
  if constexpr (normed) {
    g.gate = in.gate.view(), g.dgate = gt.dgate.view();
    if (c.with_gamma) g.gamma = in.gamma.view(), g.dgamma = gt.dgamma.view();
  }
  if constexpr (causal) {
    if (c.with_state_in) {
      g.state_in.S = in.S_in.view(), g.state_in.z = in.z_in.view();
      g.dstate_in.S = gt.dS_in.view(), g.dstate_in.z = gt.dz_in.view();
      if constexpr (gated) g.state_in.lse = in.lse_in.view(), g.dstate_in.lse = gt.dlse_in.view();
    }
    if (opt.dstate_out) {
      g.dstate_out.S = gt.dS_out.view(), g.dstate_out.z = gt.dz_out.view();
      if constexpr (gated) g.dstate_out.lse = gt.dlse_out.view();
    }
  } else if (opt.use_saved) {
    const auto fwd = attnmix_ref::linear_attention(p, q, k, v, a, gate, gamma);
    gt.saved_S = attnmix::host_tensor<A, 4>({N, c.H, c.D, c.Dv});
    gt.saved_z = attnmix::host_tensor<A, 3>({N, c.H, c.D});
    gt.saved_lse = attnmix::host_tensor<A, 2>({N, c.H});
    for (std::size_t i = 0; i < fwd.S.size(); ++i)
      gt.saved_S.storage()[i] = static_cast<A>(fwd.S[i]);
    for (std::size_t i = 0; i < fwd.z.size(); ++i)
      gt.saved_z.storage()[i] = static_cast<A>(fwd.z[i]);
    for (std::size_t i = 0; i < fwd.lse.size(); ++i)
      gt.saved_lse.storage()[i] = static_cast<A>(fwd.lse[i]);
    g.saved.S = gt.saved_S.view(), g.saved.z = gt.saved_z.view();
    if constexpr (gated) g.saved.lse = gt.saved_lse.view();
  }
  attnmix::linear_attention_backward<Kind, Policy>(
      g, params, attnmix::backend::cpu{opt.threads ? opt.threads : c.threads});

  grad_errors e;
  if (sizeof(T) == 4) {
    // Float's rounding is relative to the sizes of the terms summed, not to the sum: dq of a
    // single key is phi'(q) phi(k) (v . dO), dO = dout gamma act(gate) before the norm's small
    // projection, and v . dO may cancel to 1 % of its terms. The oracle on |v|, |dout|, |gamma|,
    // |gate| (so act > 0) gives those sizes; a gradient is held to its error against them where
    // its own norm is smaller than a tenth of theirs.
    auto abs_of = [](std::vector<double> x) {
      for (double& y : x) y = std::abs(y);
      return x;
    };
    attnmix_ref::linear_upstream up_abs = up;
    up_abs.dout = abs_of(up.dout), up_abs.dS_out = abs_of(up.dS_out);
    up_abs.dz_out = abs_of(up.dz_out);
    const auto sizes = attnmix_ref::linear_attention_backward(p, q, k, abs_of(v), a, abs_of(gate),
                                                              abs_of(gamma), up_abs);
    e.dq = floored_error(gt.dq.storage(), ref.dq, sizes.dq);
    e.dk = floored_error(gt.dk.storage(), ref.dk, sizes.dk);
    e.dv = floored_error(gt.dv.storage(), ref.dv, sizes.dv);
  } else {
    e.dq = rel_error(gt.dq.storage(), ref.dq);
    e.dk = rel_error(gt.dk.storage(), ref.dk);
    e.dv = rel_error(gt.dv.storage(), ref.dv);
  }
  // With one key the softmax is 1 and da is dlse_out plus terms of size |dS_out| |S| that cancel
  // exactly: float is held to its error against that scale, as for dlse_in below.
  if (gated)
    e.da = sizeof(T) == 4 && one_key ? lse_error(gt.da.storage(), ref.da) / 10
                                     : rel_error(gt.da.storage(), ref.da);
  if (normed) {
    e.dgate = rel_error(gt.dgate.storage(), ref.dgate);
    if (c.with_gamma) e.dgamma = rel_error(gt.dgamma.storage(), ref.dgamma);
  }
  if (causal && c.with_state_in) {
    e.dS_in = rel_error(gt.dS_in.storage(), ref.dS_in);
    e.dz_in = rel_error(gt.dz_in.storage(), ref.dz_in);
    // d lse is the small remainder of <S_in, dS> - <S_out, dS_out> + ... (the softmax's
    // Jacobian; exactly dlse_out for an empty sequence), terms of size |S| |dS| ~ 30 here: float
    // is held to its error against that scale (lse_error with a floor of 1 per entry, / 10).
    if (gated)
      e.dlse_in = sizeof(T) == 8 ? rel_error(gt.dlse_in.storage(), ref.dlse_in)
                                 : lse_error(gt.dlse_in.storage(), ref.dlse_in) / 10;
  }
  // Pad tokens: exactly zero gradients.
  if (c.pad != padding::none) {
    for (index_t b = 0; b < c.B; ++b)
      for (index_t t = 0; t < c.T; ++t) {
        if (in.mask[static_cast<std::size_t>(b * c.T + t)]) continue;
        for (index_t h = 0; h < c.HQ; ++h) {
          for (index_t d = 0; d < c.D; ++d) e.pads_zero &= gt.dq(b, t, h, d) == T(0);
          if (normed)
            for (index_t d = 0; d < c.Dv; ++d) e.pads_zero &= gt.dgate(b, t, h, d) == T(0);
        }
        for (index_t h = 0; h < c.H; ++h) {
          for (index_t d = 0; d < c.D; ++d) e.pads_zero &= gt.dk(b, t, h, d) == T(0);
          for (index_t d = 0; d < c.Dv; ++d) e.pads_zero &= gt.dv(b, t, h, d) == T(0);
        }
        if (gated)
          for (index_t h = 0; h < in.a.extent(2); ++h) e.pads_zero &= gt.da(b, t, h) == A(0);
      }
  }
  note(worst_seen(sizeof(T) == 8), e);
  if (keep) *keep = std::move(gt);
  return e;
}

template <class T>
double grad_tolerance() {
  return sizeof(T) >= 8 ? 1e-10 : 1e-5;
}

// Cases of the forward tests that the quadratic oracle handles quickly.
std::vector<linear_case> backward_cases(bool causal) {
  std::vector<linear_case> cs = {
      {1, 1, 1, 1, 8, 8},
      {2, 63, 4, 2, 32, 16},
      {1, 65, 3, 3, 16, 16, {}, padding::none, 0.3},
      {2, 130, 4, 1, 16, 24},  // MQA
      {3, 77, 4, 2, 16, 8, {}, padding::right},
      {3, 77, 2, 2, 16, 8, {}, padding::left},
      {3, 150, 2, 1, 8, 16, {}, padding::holes},
      {1, 200, 4, 2, 16, 8, {0, 0, 1, 64, 64, 130, 200}},
      {1, 150, 2, 1, 16, 16, {0, 70, 71, 150}, padding::holes},
      {1, 0, 2, 1, 8, 8, {0, 0}},
      {3, 40, 2, 2, 8, 8, {}, padding::none, std::nullopt, 3},
  };
  linear_case nan_pads{3, 90, 2, 1, 16, 8, {}, padding::holes};
  nan_pads.nan_pads = true;
  cs.push_back(nan_pads);
  if (!causal) return cs;
  std::vector<linear_case> with_state;
  for (linear_case c : cs) {
    with_state.push_back(c);
    c.with_state_in = true;
    with_state.push_back(c);
  }
  return with_state;
}

template <class Kind, class Policy, class T>
void sweep(std::uint64_t salt, const char* what, const bwd_options& opt = {}) {
  constexpr bool causal = attnmix::linear_kind_traits<Kind>::causal;
  for (linear_case c : backward_cases(causal)) {
    if (Policy::norm != gated_norm::off && salt % 2 == 1) c.with_gamma = false;
    INFO("seed " << test_seed() << " " << c.describe() << " policy " << what);
    const grad_errors e = run_backward_case<Kind, Policy, T>(c, ++salt, opt);
    INFO(e);
    CHECK(e.worst() <= grad_tolerance<T>());
    CHECK(e.pads_zero);
  }
}

// ---- finite differences of the forward oracle against the reverse pass ----

double& worst_fd() {
  static double w = 0;
  return w;
}

// loss = <dout, out> + <dS_out, S> + <dz_out, z> + <dlse_out, lse> (the last three causal only).
template <class Policy>
void check_oracle_by_finite_differences(const linear_case& c, bool causal, std::uint64_t salt) {
  rng r(salt);
  linear_inputs<double> in = make_inputs<Policy, double>(c, r);
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool normed = Policy::norm != gated_norm::off;
  // Keep the kinks of relu and squared relu out of reach of the step.
  for (auto* t : {&in.q, &in.k})
    for (auto& x : t->storage())
      if (std::abs(x) < 2e-2) x = x < 0 ? -2e-2 : 2e-2;
  const double scale = c.scale ? *c.scale : Policy::normalize ? 1.0 : 1.0 / std::sqrt(double(c.D));
  attnmix_ref::linear_problem p = oracle_problem<Policy>(c, causal, scale);
  if (c.pad != padding::none) p.mask.assign(in.mask.begin(), in.mask.end());
  // Keep the denominators (which relu-type maps on D = 2 can make about eps) and the norm's
  // mean square away from zero, where the curvature would swamp the differences.
  p.eps = 0.5;
  p.norm_eps = 0.05;

  std::vector<std::vector<double>> x = {in.q.storage(), in.k.storage(), in.v.storage()};
  x.push_back(gated ? in.a.storage() : std::vector<double>{});
  x.push_back(normed ? in.gate.storage() : std::vector<double>{});
  x.push_back(normed && c.with_gamma ? in.gamma.storage() : std::vector<double>{});
  const bool state = causal && c.with_state_in;
  x.push_back(state ? in.S_in.storage() : std::vector<double>{});
  x.push_back(state ? in.z_in.storage() : std::vector<double>{});
  x.push_back(state && gated ? in.lse_in.storage() : std::vector<double>{});

  attnmix_ref::linear_upstream up;
  up.dout.resize(in.out.storage().size());
  for (auto& d : up.dout) d = r.normal();
  const index_t N = c.sequences();
  if (causal) {
    up.dS_out.resize(static_cast<std::size_t>(N * c.H * c.D * c.Dv));
    up.dz_out.resize(static_cast<std::size_t>(N * c.H * c.D));
    for (auto& d : up.dS_out) d = r.normal();
    for (auto& d : up.dz_out) d = r.normal();
    if (gated) {
      up.dlse_out.resize(static_cast<std::size_t>(N * c.H));
      for (auto& d : up.dlse_out) d = r.normal();
    }
  }
  auto loss_of = [&](const std::vector<std::vector<double>>& xs) {
    attnmix_ref::linear_problem pp = p;
    pp.S_in = xs[6], pp.z_in = xs[7], pp.lse_in = xs[8];
    const auto f = attnmix_ref::linear_attention(pp, xs[0], xs[1], xs[2], xs[3], xs[4], xs[5]);
    double l = attnmix_ref::dot(up.dout, f.out);
    if (causal) {
      l += attnmix_ref::dot(up.dS_out, f.S) + attnmix_ref::dot(up.dz_out, f.z);
      if (gated)  // the lse of an empty prefix is -inf whatever the inputs: no gradient
        for (std::size_t i = 0; i < f.lse.size(); ++i)
          if (std::isfinite(f.lse[i])) l += up.dlse_out[i] * f.lse[i];
    }
    return l;
  };
  // sum |each term of the loss|: what the rounding of one loss evaluation is relative to.
  auto loss_terms = [&](const std::vector<std::vector<double>>& xs) {
    attnmix_ref::linear_problem pp = p;
    pp.S_in = xs[6], pp.z_in = xs[7], pp.lse_in = xs[8];
    const auto f = attnmix_ref::linear_attention(pp, xs[0], xs[1], xs[2], xs[3], xs[4], xs[5]);
    const auto abs_dot = [](const std::vector<double>& a, const std::vector<double>& b) {
      double s = 0;
      for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) s += std::abs(a[i] * b[i]);
      return s;
    };
    double l = abs_dot(up.dout, f.out);
    if (causal) {
      l += abs_dot(up.dS_out, f.S) + abs_dot(up.dz_out, f.z);
      if (gated)
        for (std::size_t i = 0; i < f.lse.size(); ++i)
          if (std::isfinite(f.lse[i])) l += std::abs(up.dlse_out[i] * f.lse[i]);
    }
    return l;
  };
  attnmix_ref::linear_problem pp = p;
  pp.S_in = x[6], pp.z_in = x[7], pp.lse_in = x[8];
  const auto g = attnmix_ref::linear_attention_backward(pp, x[0], x[1], x[2], x[3], x[4], x[5], up);
  const std::vector<const std::vector<double>*> grads = {
      &g.dq, &g.dk, &g.dv, &g.da, &g.dgate, &g.dgamma, &g.dS_in, &g.dz_in, &g.dlse_in};
  const char* names[] = {"dq", "dk", "dv", "da", "dgate", "dgamma", "dS_in", "dz_in", "dlse_in"};
  for (std::size_t t = 0; t < x.size(); ++t) {
    if (x[t].empty()) continue;
    // Richardson extrapolation of two fourth-order central stencils: O(h^6) truncation lets h be
    // large enough that rounding (about 1e-16 |loss terms| / h) stays small.
    const auto loss_t = [&](const std::vector<double>& xt) {
      auto xs = x;
      xs[t] = xt;
      return loss_of(xs);
    };
    const double h = 1e-3;
    const auto fd1 = attnmix_ref::finite_difference(loss_t, x[t], 2 * h);
    auto fd = attnmix_ref::finite_difference(loss_t, x[t], h);
    for (std::size_t i = 0; i < fd.size(); ++i) fd[i] = (16 * fd[i] - fd1[i]) / 15;
    INFO("seed " << test_seed() << " " << c.describe() << " gradient " << names[t]);
    REQUIRE(grads[t]->size() == fd.size());
    const double err = attnmix_ref::relative_error(*grads[t], fd);
    worst_fd() = std::max(worst_fd(), err);
    // Relative 1e-7, less the stencils' own rounding (rounding_floor of the loss's terms; the
    // extrapolation weighs the finer stencil by 16/15 and the coarser by 1/15 at 2h).
    const double floor = attnmix_ref::rounding_floor({1.0}, {loss_terms(x)}, fd.size(), h) * 1.1;
    INFO("relative error " << err << ", rounding floor " << floor);
    CHECK(attnmix_ref::close_to(*grads[t], fd, 1e-7, floor));
  }
}

std::vector<linear_case> fd_cases(bool causal) {
  std::vector<linear_case> cs = {
      {1, 9, 2, 1, 3, 2},
      {2, 6, 2, 2, 2, 3, {}, padding::right},
      {1, 8, 2, 1, 2, 2, {0, 3, 3, 4, 8}},
      {2, 7, 1, 1, 3, 3, {}, padding::holes, 0.7},
  };
  if (causal)
    for (std::size_t i = 0, n = cs.size(); i < n; ++i) {
      linear_case c = cs[i];
      c.with_state_in = true;
      cs.push_back(c);
    }
  return cs;
}

template <class Policy>
void fd_sweep(bool causal, std::uint64_t salt, const char* what) {
  for (const linear_case& c : fd_cases(causal)) {
    INFO("policy " << what);
    check_oracle_by_finite_differences<Policy>(c, causal, ++salt);
  }
}

}  // namespace

using attnmix::kind::bla;
using attnmix::kind::gbla;
using attnmix::kind::linear_causal;

TEST_CASE("the reverse-pass oracle matches finite differences of the forward oracle",
          "[linear_backward][oracle]") {
  fd_sweep<attnmix::bla_policy>(false, 10, "bla_policy");
  fd_sweep<bla_relu_small>(false, 20, "bla_relu_small");
  fd_sweep<bla_identity_raw>(false, 30, "bla_identity_raw");
  fd_sweep<attnmix::gbla_policy>(false, 40, "gbla_policy");
  fd_sweep<gbla_wide>(false, 50, "gbla_wide");
  fd_sweep<gbla_raw_gate>(false, 60, "gbla_raw_gate");
  fd_sweep<causal_default>(true, 70, "causal_default");
  fd_sweep<causal_gated7>(true, 80, "causal_gated7");
  fd_sweep<causal_recurrent_raw>(true, 90, "causal_recurrent_raw");
  fd_sweep<causal_head_norm>(true, 100, "causal_head_norm");
  fd_sweep<causal_wide_norm>(true, 110, "causal_wide_norm");
  fd_sweep<causal_identity_raw>(true, 120, "causal_identity_raw");
  fd_sweep<causal_squared3>(true, 130, "causal_squared3");
}

TEST_CASE("bidirectional backward matches the oracle (double)", "[linear_backward][bla][gbla]") {
  sweep<bla, attnmix::bla_policy, double>(1000, "bla");
  sweep<bla, bla_relu_small, double>(1100, "bla relu, block 16");
  sweep<bla, bla_identity_raw, double>(1200, "bla identity, no normaliser");
  sweep<gbla, attnmix::gbla_policy, double>(1300, "gbla");
  sweep<gbla, attnmix::gbla_policy, double>(1301, "gbla, no gamma");
  sweep<gbla, gbla_wide, double>(1400, "gbla per-head gate, full-width gate-then-norm");
  sweep<gbla, gbla_raw_gate, double>(1500, "gbla sigmoid, no normaliser, no norm");
}

TEST_CASE("bidirectional backward matches the oracle (float)", "[linear_backward][bla][gbla]") {
  sweep<bla, attnmix::bla_policy, float>(2000, "bla");
  sweep<gbla, attnmix::gbla_policy, float>(2100, "gbla");
  sweep<gbla, gbla_raw_gate, float>(2200, "gbla sigmoid, no normaliser, no norm");
}

TEST_CASE("bidirectional backward from the saved state", "[linear_backward][bla][gbla]") {
  bwd_options saved;
  saved.use_saved = true;
  sweep<bla, attnmix::bla_policy, double>(3000, "bla, saved", saved);
  sweep<bla, bla_identity_raw, double>(3100, "bla identity, saved", saved);
  sweep<gbla, gbla_wide, double>(3200, "gbla wide, saved", saved);
  sweep<gbla, attnmix::gbla_policy, float>(3300, "gbla, saved", saved);
}

TEST_CASE("causal backward matches the oracle (double)", "[linear_backward][linear_causal]") {
  sweep<linear_causal, causal_default, double>(4000, "chunk 64");
  sweep<linear_causal, causal_gated7, double>(4100, "shared gate, chunk 7");
  sweep<linear_causal, causal_recurrent_raw, double>(4200, "recurrent, per-head gate, raw");
  sweep<linear_causal, causal_head_norm, double>(4300, "per-head norm, gate then norm");
  sweep<linear_causal, causal_head_norm, double>(4301, "per-head norm, no gamma");
  sweep<linear_causal, causal_wide_norm, double>(4400, "full-width norm, shared gate");
  sweep<linear_causal, causal_identity_raw, double>(4500, "identity, no normaliser");
  sweep<linear_causal, causal_squared3, double>(4600, "squared relu, chunk 3");
  bwd_options no_dstate;
  no_dstate.dstate_out = false;
  sweep<linear_causal, causal_gated7, double>(4700, "no dstate_out", no_dstate);
  // Logits on three levels 50 apart: running maxima and rescaling past float's exp range.
  std::uint64_t salt = 4800;
  for (linear_case c :
       {linear_case{2, 150, 4, 2, 16, 8, {}, padding::holes}, linear_case{1, 200, 2, 1, 8, 8}}) {
    c.gate_step = 50;
    c.with_state_in = true;
    INFO("seed " << test_seed() << " " << c.describe() << " logits 50 apart");
    grad_errors e = run_backward_case<linear_causal, causal_gated7, double>(c, ++salt, {});
    INFO(e);
    CHECK(e.worst() <= grad_tolerance<double>());
    e = run_backward_case<linear_causal, causal_recurrent_raw, double>(c, ++salt, {});
    INFO(e);
    CHECK(e.worst() <= grad_tolerance<double>());
  }
}

TEST_CASE("causal backward matches the oracle (float)", "[linear_backward][linear_causal]") {
  sweep<linear_causal, causal_default, float>(5000, "chunk 64");
  sweep<linear_causal, causal_recurrent_raw, float>(5100, "recurrent, per-head gate, raw");
  sweep<linear_causal, causal_gated7, float>(5200, "shared gate, chunk 7");
}

TEST_CASE("chunked and recurrent forms have the same gradient",
          "[linear_backward][linear_causal]") {
  using chunked_raw = attnmix::with_causal_form<causal_recurrent_raw, causal_form::chunked>;
  linear_case c{2, 90, 4, 2, 16, 8, {}, padding::holes};
  c.with_state_in = true;
  grad_tensors<double> a, b;
  run_backward_case<linear_causal, causal_recurrent_raw, double>(c, 6000, {}, &a);
  run_backward_case<linear_causal, chunked_raw, double>(c, 6000, {}, &b);
  CHECK(bitwise_equal(a.dq.storage(), b.dq.storage()));
  CHECK(bitwise_equal(a.dk.storage(), b.dk.storage()));
  CHECK(bitwise_equal(a.da.storage(), b.da.storage()));
}

TEST_CASE("the backward gives the same bits for any thread count", "[linear_backward]") {
  linear_case c{2, 700, 4, 2, 16, 8, {}, padding::holes};
  c.with_state_in = true;
  auto same = [](const auto& x, const auto& y) {
    return bitwise_equal(x.dq.storage(), y.dq.storage()) &&
           bitwise_equal(x.dk.storage(), y.dk.storage()) &&
           bitwise_equal(x.dv.storage(), y.dv.storage()) &&
           bitwise_equal(x.da.storage(), y.da.storage()) &&
           bitwise_equal(x.dgate.storage(), y.dgate.storage()) &&
           bitwise_equal(x.dgamma.storage(), y.dgamma.storage());
  };
  for (int threads : {2, 3, 7}) {
    bwd_options one, many;
    one.threads = 1, many.threads = threads;
    {
      grad_tensors<float> x, y;
      run_backward_case<gbla, attnmix::gbla_policy, float>(c, 7000, one, &x);
      run_backward_case<gbla, attnmix::gbla_policy, float>(c, 7000, many, &y);
      CHECK(same(x, y));
    }
    {
      grad_tensors<float> x, y;
      run_backward_case<linear_causal, causal_gated7, float>(c, 7100, one, &x);
      run_backward_case<linear_causal, causal_gated7, float>(c, 7100, many, &y);
      CHECK(same(x, y));
    }
  }
}

TEST_CASE("worst relative errors", "[linear_backward]") {
  // Runs last in declaration order; prints what the sweeps above saw.
  WARN("oracle against finite differences, worst relative error: " << worst_fd());
  for (bool is_double : {false, true}) {
    const grad_errors& w = worst_seen(is_double);
    WARN((is_double ? "double" : "float") << " worst relative errors: " << w);
  }
}
