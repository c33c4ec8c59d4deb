#pragma once
// The harness of the CUDA linear-attention backward tests: the CUDA backward against the CPU
// backward in double on the same inputs (activations rounded to the kernel's type first):
// every gradient, exact zeros at pad tokens, the forward's state as `saved`, state_in /
// dstate_out of the causal kind. Small shapes come first, so that a failure names the case,
// the policy and the gradient.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "attnmix/cuda.cuh"
#include "cpu/test_linear_harness.hpp"
#include "support/cuda_testing.cuh"

using namespace attnmix_test;
using attnmix::feature_map;
using attnmix::gate_activation;
using attnmix::gated_norm;
using attnmix::index_t;
using attnmix::key_gate;
using attnmix::norm_gate_order;
using attnmix::norm_weight;

// Named (not anonymous) and inline, so that a test file that uses part of it gets no warnings.
namespace linear_backward_test {

// ---- policies ----

struct bla_relu : attnmix::bla_policy {
  static constexpr feature_map phi = feature_map::relu;
};
struct bla_identity_raw : attnmix::bla_policy {
  static constexpr feature_map phi = feature_map::identity;
  static constexpr bool normalize = false;
};
// Per-head gate, gate then norm, sigmoid activation, per-head gamma, relu.
struct gbla_mamba : attnmix::gbla_policy {
  static constexpr norm_gate_order order = norm_gate_order::gate_then_norm;
  static constexpr gate_activation activation = gate_activation::sigmoid;
  static constexpr key_gate gate = key_gate::per_head;
  static constexpr norm_weight weight = norm_weight::per_head;
  static constexpr feature_map phi = feature_map::relu;
};
// The softmax's Jacobian without the normaliser and without the norm.
struct gbla_raw_gate : attnmix::gbla_policy {
  static constexpr feature_map phi = feature_map::sigmoid;
  static constexpr bool normalize = false;
  static constexpr gated_norm norm = gated_norm::off;
};
using causal_default = attnmix::linear_causal_policy;
struct causal_identity_raw : attnmix::linear_causal_policy {
  static constexpr feature_map phi = feature_map::identity;
  static constexpr bool normalize = false;
};
struct causal_squared : attnmix::linear_causal_policy {
  static constexpr feature_map phi = feature_map::squared_relu;
  static constexpr attnmix::index_t chunk = 3;  // the CPU's chunk; CUDA picks its own
};
struct causal_head_norm : attnmix::linear_causal_policy {
  static constexpr gated_norm norm = gated_norm::per_head;
  static constexpr norm_gate_order order = norm_gate_order::gate_then_norm;
  static constexpr gate_activation activation = gate_activation::sigmoid;
};
// Under the prefix key gate: shared (the default knobs), per-head without the normaliser, and
// a shared gate under the per-head gated norm.
using causal_key_gate = attnmix::with_key_gate<causal_default, key_gate::shared>;
struct causal_head_gate_raw : attnmix::linear_causal_policy {
  static constexpr key_gate gate = key_gate::per_head;
  static constexpr feature_map phi = feature_map::relu;
  static constexpr bool normalize = false;
};
using causal_gated_norm = attnmix::with_gated_norm<causal_key_gate, gated_norm::per_head>;

// ---- one case ----

struct bwd_options {
  bool use_saved = false;   // bidirectional: the forward's state (CPU, double) as `saved`
  bool dstate_out = false;  // causal: a random gradient of the final state
};

struct grad_errors {
  double dq = 0, dk = 0, dv = 0, da = 0, dgate = 0, dgamma = 0, dS_in = 0, dz_in = 0, dlse_in = 0;
  bool pads_zero = true;
};

inline std::ostream& operator<<(std::ostream& os, const grad_errors& e) {
  return os << "dq " << e.dq << " dk " << e.dk << " dv " << e.dv << " da " << e.da << " dgate "
            << e.dgate << " dgamma " << e.dgamma << " dS_in " << e.dS_in << " dz_in " << e.dz_in
            << " dlse_in " << e.dlse_in << " pads_zero " << e.pads_zero;
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// max |out - ref| / max(max |ref|, floor) (NaN or inf in out: +inf; ref all zero and no floor:
// max |out|). The floor is for gradients that cancel to nearly 0 whatever the inputs, whose own
// magnitude is rounding noise. A nonzero magnitude counts as at least 1e-30: float holds nothing
// below that (a key gate whose logits spread over 100 leaves a state carried in a gradient of
// 1e-50).
template <class T>
double max_rel_error(const std::vector<T>& out, const std::vector<double>& ref, double floor = 0) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, mag = floor;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double o = static_cast<double>(out[i]);
    if (!std::isfinite(o)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(o - ref[i]));
    mag = std::max(mag, std::abs(ref[i]));
  }
  return mag > 0 ? diff / std::max(mag, 1e-30) : diff;
}

template <class V, class P>
V on_device(const V& host, P* ptr) {
  if (!host.has_value()) return V{};
  return V(ptr, host.shape(), host.strides(), attnmix::memory_space::device);
}

template <class D, class S, int R>
attnmix::host_tensor<D, R> converted(const attnmix::host_tensor<S, R>& x) {
  attnmix::host_tensor<D, R> y(x.shape());
  y.storage() = convert_all<D>(x.storage());
  return y;
}

// What a run gave back (for the bit-identity checks).
struct grad_bits {
  std::vector<float> dq, dk, dv, dgate, da, dgamma, dS_in, dz_in, dlse_in;
};

template <class Kind, class Policy, class T>
grad_errors run_cuda_backward(const linear_case& c, std::uint64_t salt, const bwd_options& opt,
                              grad_bits* bits = nullptr) {
  using attnmix::host_tensor;
  constexpr bool causal = attnmix::linear_kind_traits<Kind>::causal;
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool normed = Policy::norm != gated_norm::off;
  const index_t N = c.sequences();
  rng r(salt);
  linear_inputs<float> in = make_inputs<Policy, float>(c, r);
  // The reference sees exactly the values the kernels see.
  for (auto* t : {&in.q, &in.k, &in.v, &in.gate})
    t->storage() = convert_all<float>(convert_all<T>(t->storage()));
  host_tensor<float, 4> dout(in.out.shape());
  r.fill_normal(dout);
  dout.storage() = convert_all<float>(convert_all<T>(dout.storage()));
  if (c.nan_pads && c.pad != padding::none)
    for (index_t b = 0; b < c.B; ++b)
      for (index_t t = 0; t < c.T; ++t)
        if (!in.mask[std::size_t(b * c.T + t)])
          for (index_t h = 0; h < c.HQ; ++h)
            for (index_t d = 0; d < c.Dv; ++d)
              dout(b, t, h, d) = std::numeric_limits<float>::quiet_NaN();
  host_tensor<float, 4> dS_out({N, c.H, c.D, c.Dv});
  host_tensor<float, 3> dz_out({N, c.H, c.D});
  host_tensor<float, 2> dlse_out({N, c.H});
  r.fill_normal(dS_out), r.fill_normal(dz_out), r.fill_normal(dlse_out);
  // Under the causal key gate a state in carries its lse.
  constexpr bool state_lse = causal && gated;

  // The CPU backward in double.
  host_tensor<double, 4> q = converted<double>(in.q), k = converted<double>(in.k),
                         v = converted<double>(in.v), gate = converted<double>(in.gate),
                         dout_d = converted<double>(dout), S_in = converted<double>(in.S_in),
                         dS_out_d = converted<double>(dS_out);
  host_tensor<double, 3> a = converted<double>(in.a), z_in = converted<double>(in.z_in),
                         dz_out_d = converted<double>(dz_out);
  host_tensor<double, 2> lse_in = converted<double>(in.lse_in),
                         dlse_out_d = converted<double>(dlse_out), rdlse_in({N, c.H});
  host_tensor<double, 1> gamma = converted<double>(in.gamma);
  host_tensor<double, 4> saved_S({N, c.H, c.D, c.Dv});
  host_tensor<double, 3> saved_z({N, c.H, c.D});
  host_tensor<double, 2> saved_lse({N, c.H});
  // With one key the normalised output depends on q and k only through eps (and after the norm
  // through norm_eps): dq, dk are the small remainder of a cancellation, which larger epsilons
  // keep well conditioned (as the CPU backward's tests do).
  attnmix::linear_attention_params hp = make_params<double>(c);
  if (c.T == 1) hp.eps = 100.0, hp.norm_eps = 4.0;
  const bool saved = !causal && opt.use_saved;
  if (saved) {
    host_tensor<double, 4> out(in.out.shape());
    attnmix::linear_attention_args<double> fa{q.view(), k.view(), v.view(), out.view()};
    if (c.pad != padding::none) fa.mask = {in.mask.data(), {c.B, c.T}};
    if constexpr (gated) fa.a = a.view(), fa.state_out.lse = saved_lse.view();
    if constexpr (normed) {
      fa.gate = gate.view();
      if (c.with_gamma) fa.gamma = gamma.view();
    }
    fa.state_out.S = saved_S.view(), fa.state_out.z = saved_z.view();
    attnmix::linear_attention<Kind, Policy>(fa, hp);
  }
  host_tensor<double, 4> rdq(in.q.shape()), rdk(in.k.shape()), rdv(in.v.shape()),
      rdgate(in.gate.shape()), rdS_in({N, c.H, c.D, c.Dv});
  host_tensor<double, 3> rda(in.a.shape()), rdz_in({N, c.H, c.D});
  host_tensor<double, 1> rdgamma(in.gamma.shape());
  attnmix::linear_attention_grad_args<double> g;
  g.q = q.view(), g.k = k.view(), g.v = v.view(), g.dout = dout_d.view();
  g.dq = rdq.view(), g.dk = rdk.view(), g.dv = rdv.view();
  if (c.pad != padding::none) g.mask = {in.mask.data(), {c.B, c.T}};
  if constexpr (gated) g.a = a.view(), g.da = rda.view();
  if constexpr (normed) {
    g.gate = gate.view(), g.dgate = rdgate.view();
    if (c.with_gamma) g.gamma = gamma.view(), g.dgamma = rdgamma.view();
  }
  if constexpr (causal) {
    if (c.with_state_in) {
      g.state_in.S = S_in.view(), g.state_in.z = z_in.view();
      g.dstate_in.S = rdS_in.view(), g.dstate_in.z = rdz_in.view();
      if constexpr (state_lse) g.state_in.lse = lse_in.view(), g.dstate_in.lse = rdlse_in.view();
    }
    if (opt.dstate_out) {
      g.dstate_out.S = dS_out_d.view(), g.dstate_out.z = dz_out_d.view();
      if constexpr (state_lse) g.dstate_out.lse = dlse_out_d.view();
    }
  }
  if (saved) {
    g.saved.S = saved_S.view(), g.saved.z = saved_z.view();
    if constexpr (gated) g.saved.lse = saved_lse.view();
  }
  attnmix::linear_attention_backward<Kind, Policy>(g, hp);

  // Float's rounding is relative to the sizes of the terms a gradient sums, not to the sum: dq of
  // a single key is phi'(q) phi(k) (v . dO), and v . dO may cancel to 1 % of its terms. The same
  // backward on |v|, |dout|, |gate|, |gamma| and |dstate_out| gives those sizes; a float dq, dk,
  // dv, dS_in, dz_in is held to its relative error (||diff|| / ||ref||) against a tenth of theirs
  // where it is smaller: the CPU tests' rule (floored_error). A 16-bit gradient is held to its
  // largest error over its largest value, or over a tenth of its largest term where that is larger.
  std::vector<double> size_dq, size_dk, size_dv, size_dS_in, size_dz_in, size_dlse_in;
  {
    auto abs_of = [](auto t) {
      for (auto& x : t.storage()) x = std::abs(x);
      return t;
    };
    host_tensor<double, 4> av = abs_of(v), agate = abs_of(gate), adout = abs_of(dout_d),
                           adS_out = abs_of(dS_out_d);
    host_tensor<double, 3> adz_out = abs_of(dz_out_d);
    host_tensor<double, 2> adlse_out = abs_of(dlse_out_d), sdlse_in({N, c.H});
    host_tensor<double, 1> agamma = abs_of(gamma);
    host_tensor<double, 4> sdq(in.q.shape()), sdk(in.k.shape()), sdv(in.v.shape()),
        sdgate(in.gate.shape()), sdS_in({N, c.H, c.D, c.Dv});
    host_tensor<double, 3> sda(in.a.shape()), sdz_in({N, c.H, c.D});
    host_tensor<double, 1> sdgamma(in.gamma.shape());
    attnmix::linear_attention_grad_args<double> s = g;
    s.saved = {};
    s.v = av.view(), s.dout = adout.view();
    s.dq = sdq.view(), s.dk = sdk.view(), s.dv = sdv.view();
    if constexpr (gated) s.da = sda.view();
    if constexpr (normed) {
      s.gate = agate.view(), s.dgate = sdgate.view();
      if (c.with_gamma) s.gamma = agamma.view(), s.dgamma = sdgamma.view();
    }
    if constexpr (causal) {
      if (c.with_state_in) s.dstate_in.S = sdS_in.view(), s.dstate_in.z = sdz_in.view();
      if (opt.dstate_out) s.dstate_out.S = adS_out.view(), s.dstate_out.z = adz_out.view();
      if constexpr (state_lse) {
        if (c.with_state_in) s.dstate_in.lse = sdlse_in.view();
        if (opt.dstate_out) s.dstate_out.lse = adlse_out.view();
      }
    }
    attnmix::linear_attention_backward<Kind, Policy>(s, hp);
    size_dq = sdq.storage(), size_dk = sdk.storage(), size_dv = sdv.storage();
    size_dS_in = sdS_in.storage(), size_dz_in = sdz_in.storage();
    size_dlse_in = sdlse_in.storage();
  }

  // The same on the GPU (every output starts as NaN).
  device_buffer<T> dq_(convert_all<T>(in.q.storage())), dk_(convert_all<T>(in.k.storage())),
      dv_(convert_all<T>(in.v.storage())), dgate_(convert_all<T>(in.gate.storage())),
      ddout(convert_all<T>(dout.storage()));
  device_buffer<float> da_(in.a.storage()), dgamma_(in.gamma.storage()), dS_in_(in.S_in.storage()),
      dz_in_(in.z_in.storage()), ddS_out(dS_out.storage()), ddz_out(dz_out.storage()),
      dlse_in_(in.lse_in.storage()), ddlse_out(dlse_out.storage());
  std::vector<float> sS(saved_S.storage().begin(), saved_S.storage().end()),
      sz(saved_z.storage().begin(), saved_z.storage().end()),
      sl(saved_lse.storage().begin(), saved_lse.storage().end());
  device_buffer<float> dsaved_S(sS), dsaved_z(sz), dsaved_lse(sl);
  device_buffer<std::uint8_t> dmask(in.mask);
  device_buffer<T> gq(std::size_t(in.q.size())), gk(std::size_t(in.k.size())),
      gv(std::size_t(in.v.size())), ggate(std::size_t(in.gate.size()));
  device_buffer<float> ga(std::size_t(in.a.size())), ggamma(std::size_t(in.gamma.size())),
      gS_in(std::size_t(in.S_in.size())), gz_in(std::size_t(in.z_in.size())),
      glse_in(std::size_t(in.lse_in.size()));
  using attnmix::view1;
  using attnmix::view3;
  using attnmix::view4;
  attnmix::linear_attention_grad_args<T> d;
  d.q = on_device(view4<const T>(nullptr, in.q.shape()), dq_.get());
  d.k = on_device(view4<const T>(nullptr, in.k.shape()), dk_.get());
  d.v = on_device(view4<const T>(nullptr, in.v.shape()), dv_.get());
  d.dout = on_device(view4<const T>(nullptr, in.out.shape()), ddout.get());
  d.dq = on_device(view4<T>(nullptr, in.q.shape()), gq.get());
  d.dk = on_device(view4<T>(nullptr, in.k.shape()), gk.get());
  d.dv = on_device(view4<T>(nullptr, in.v.shape()), gv.get());
  if (c.pad != padding::none)
    d.mask =
        on_device(attnmix::tensor_view<const std::uint8_t, 2>(nullptr, {c.B, c.T}), dmask.get());
  if constexpr (gated) {
    d.a = on_device(view3<const float>(nullptr, in.a.shape()), da_.get());
    d.da = on_device(view3<float>(nullptr, in.a.shape()), ga.get());
  }
  if constexpr (normed) {
    d.gate = on_device(view4<const T>(nullptr, in.gate.shape()), dgate_.get());
    d.dgate = on_device(view4<T>(nullptr, in.gate.shape()), ggate.get());
    if (c.with_gamma) {
      d.gamma = on_device(view1<const float>(nullptr, in.gamma.shape()), dgamma_.get());
      d.dgamma = on_device(view1<float>(nullptr, in.gamma.shape()), ggamma.get());
    }
  }
  if constexpr (causal) {
    if (c.with_state_in) {
      d.state_in.S = on_device(view4<const float>(nullptr, in.S_in.shape()), dS_in_.get());
      d.state_in.z = on_device(view3<const float>(nullptr, in.z_in.shape()), dz_in_.get());
      d.dstate_in.S = on_device(view4<float>(nullptr, in.S_in.shape()), gS_in.get());
      d.dstate_in.z = on_device(view3<float>(nullptr, in.z_in.shape()), gz_in.get());
      if constexpr (state_lse) {
        using view2f = attnmix::tensor_view<float, 2>;
        d.state_in.lse = on_device(attnmix::tensor_view<const float, 2>(nullptr, in.lse_in.shape()),
                                   dlse_in_.get());
        d.dstate_in.lse = on_device(view2f(nullptr, in.lse_in.shape()), glse_in.get());
      }
    }
    if (opt.dstate_out) {
      d.dstate_out.S = on_device(view4<const float>(nullptr, dS_out.shape()), ddS_out.get());
      d.dstate_out.z = on_device(view3<const float>(nullptr, dz_out.shape()), ddz_out.get());
      if constexpr (state_lse)
        d.dstate_out.lse = on_device(
            attnmix::tensor_view<const float, 2>(nullptr, dlse_out.shape()), ddlse_out.get());
    }
  }
  if (saved) {
    d.saved.S = on_device(view4<const float>(nullptr, saved_S.shape()), dsaved_S.get());
    d.saved.z = on_device(view3<const float>(nullptr, saved_z.shape()), dsaved_z.get());
    if constexpr (gated)
      d.saved.lse = on_device(attnmix::tensor_view<const float, 2>(nullptr, saved_lse.shape()),
                              dsaved_lse.get());
  }
  attnmix::linear_attention_params dp = make_params<T>(c);
  dp.eps = hp.eps, dp.norm_eps = hp.norm_eps;
  attnmix::linear_attention_backward<Kind, Policy>(d, dp, attnmix::backend::cuda{});
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "linear_attention_backward kernels");

  const std::vector<float> hdq = convert_all<float>(gq.to_host()),
                           hdk = convert_all<float>(gk.to_host()),
                           hdv = convert_all<float>(gv.to_host()),
                           hdgate = convert_all<float>(ggate.to_host());
  const std::vector<float> hda = ga.to_host(), hdgamma = ggamma.to_host(), hdS_in = gS_in.to_host(),
                           hdz_in = gz_in.to_host(), hdlse_in = glse_in.to_host();
  grad_errors e;
  const bool floored = sizeof(T) == 4;
  auto term_floor = [](const std::vector<double>& sizes) {
    return max_abs(sizes) / 10;
  };
  e.dq = floored ? floored_error(hdq, rdq.storage(), size_dq)
                 : max_rel_error(hdq, rdq.storage(), term_floor(size_dq));
  e.dk = floored ? floored_error(hdk, rdk.storage(), size_dk)
                 : max_rel_error(hdk, rdk.storage(), term_floor(size_dk));
  e.dv = floored ? floored_error(hdv, rdv.storage(), size_dv)
                 : max_rel_error(hdv, rdv.storage(), term_floor(size_dv));
  // A softmax over one key has da = 0 exactly: its size is the scale of dk (through the key).
  if (gated) e.da = max_rel_error(hda, rda.storage(), c.T == 1 ? max_abs(rdk.storage()) : 0.0);
  if (normed) {
    e.dgate = max_rel_error(hdgate, rdgate.storage());
    if (c.with_gamma) e.dgamma = max_rel_error(hdgamma, rdgamma.storage());
  }
  if (causal && c.with_state_in) {
    e.dS_in = floored ? floored_error(hdS_in, rdS_in.storage(), size_dS_in)
                      : max_rel_error(hdS_in, rdS_in.storage(), term_floor(size_dS_in));
    // Behind the gated RMSNorm, which ignores the scale of the core's output, dz_in (which only
    // moves that scale) cancels to nearly 0: measure it on the scale of dS_in's terms.
    e.dz_in = normed    ? max_rel_error(hdz_in, rdz_in.storage(), max_abs(rdS_in.storage()))
              : floored ? floored_error(hdz_in, rdz_in.storage(), size_dz_in)
                        : max_rel_error(hdz_in, rdz_in.storage(), term_floor(size_dz_in));
    // d lse_in = kappa + <S_in, dS_in> + <z_in, dz_in> cancels (behind the gated RMSNorm, and
    // where few tokens move the state): it is measured on the size of its inner products' terms,
    // sum |S_in dS_in| + sum |z_in dz_in| a (sequence, head), which the run on absolute values
    // misses (S_in keeps its signs there).
    if (state_lse) {
      std::vector<double> lse_sizes(size_dlse_in);
      for (index_t i = 0; i < N * c.H; ++i) {
        double& t = lse_sizes[std::size_t(i)];
        for (index_t x = i * c.D * c.Dv; x < (i + 1) * c.D * c.Dv; ++x)
          t += std::abs(S_in.storage()[std::size_t(x)] * rdS_in.storage()[std::size_t(x)]);
        for (index_t x = i * c.D; x < (i + 1) * c.D; ++x)
          t += std::abs(z_in.storage()[std::size_t(x)] * rdz_in.storage()[std::size_t(x)]);
      }
      e.dlse_in = floored  ? floored_error(hdlse_in, rdlse_in.storage(), lse_sizes)
                  : normed ? max_rel_error(hdlse_in, rdlse_in.storage(), max_abs(lse_sizes))
                           : max_rel_error(hdlse_in, rdlse_in.storage(), term_floor(lse_sizes));
    }
  }
  if (c.pad != padding::none) {
    const index_t Hg = in.a.extent(2);
    for (index_t b = 0; b < c.B; ++b)
      for (index_t t = 0; t < c.T; ++t) {
        if (in.mask[std::size_t(b * c.T + t)]) continue;
        for (index_t h = 0; h < c.HQ; ++h) {
          for (index_t x = 0; x < c.D; ++x)
            e.pads_zero &= hdq[std::size_t(((b * c.T + t) * c.HQ + h) * c.D + x)] == 0.f;
          if (normed)
            for (index_t x = 0; x < c.Dv; ++x)
              e.pads_zero &= hdgate[std::size_t(((b * c.T + t) * c.HQ + h) * c.Dv + x)] == 0.f;
        }
        for (index_t h = 0; h < c.H; ++h) {
          for (index_t x = 0; x < c.D; ++x)
            e.pads_zero &= hdk[std::size_t(((b * c.T + t) * c.H + h) * c.D + x)] == 0.f;
          for (index_t x = 0; x < c.Dv; ++x)
            e.pads_zero &= hdv[std::size_t(((b * c.T + t) * c.H + h) * c.Dv + x)] == 0.f;
        }
        if (gated)
          for (index_t h = 0; h < Hg; ++h)
            e.pads_zero &= hda[std::size_t((b * c.T + t) * Hg + h)] == 0.f;
      }
  }
  if (bits) *bits = {hdq, hdk, hdv, hdgate, hda, hdgamma, hdS_in, hdz_in, hdlse_in};
  return e;
}

template <class T>
inline double grad_tolerance(bool causal_norm = false) {
  // 16-bit: the gradients are rounded to T once (and a causal gated norm reads the recomputed
  // output o rounded to T as well).
  return sizeof(T) == 4 ? 1e-5 : causal_norm ? 2e-2 : 1e-2;
}

// The worst error of each gradient over every case run, per dtype width (4: float, 2: 16-bit),
// printed by the last test case so that a passing run shows its margins.
inline grad_errors& worst_seen(double tol) {
  static grad_errors w[2];
  return w[tol < 1e-4 ? 0 : 1];
}

inline void check_errors(const grad_errors& e, double tol) {
  grad_errors& w = worst_seen(tol);
  w.dq = std::max(w.dq, e.dq), w.dk = std::max(w.dk, e.dk), w.dv = std::max(w.dv, e.dv);
  w.da = std::max(w.da, e.da), w.dgate = std::max(w.dgate, e.dgate);
  w.dgamma = std::max(w.dgamma, e.dgamma), w.dS_in = std::max(w.dS_in, e.dS_in);
  w.dz_in = std::max(w.dz_in, e.dz_in), w.dlse_in = std::max(w.dlse_in, e.dlse_in);
  w.pads_zero = w.pads_zero && e.pads_zero;
  INFO(e);
  CHECK(e.dq <= tol);
  CHECK(e.dk <= tol);
  CHECK(e.dv <= tol);
  CHECK(e.da <= tol);
  CHECK(e.dgate <= tol);
  CHECK(e.dgamma <= tol);
  CHECK(e.dS_in <= tol);
  CHECK(e.dz_in <= tol);
  CHECK(e.dlse_in <= tol);
  CHECK(e.pads_zero);
}

// Small shapes first (one head, one tile), then T off the tiles (1, 37, 300), padding, varlen
// with empty and length-1 sequences, GQA / MQA, D != Dv, the widest dims, dims off the 16-byte
// vectors, NaN pads, long sequences (many parts or chunks).
inline std::vector<linear_case> backward_cases(bool causal) {
  std::vector<linear_case> cs = {
      {1, 1, 1, 1, 8, 8},
      {1, 37, 1, 1, 16, 16},
      {2, 37, 4, 2, 32, 16},
      {2, 300, 4, 2, 64, 64, {}, padding::right},
      {3, 77, 4, 2, 16, 8, {}, padding::left},
      {3, 150, 2, 1, 8, 16, {}, padding::holes},
      {1, 200, 4, 2, 32, 16, {0, 0, 1, 64, 64, 130, 200}},
      {1, 150, 2, 1, 16, 16, {0, 70, 71, 150}, padding::holes},
      {1, 0, 2, 1, 8, 8, {0, 0}},
      {2, 130, 8, 1, 16, 24},  // MQA
      {1, 65, 3, 3, 64, 64, {}, padding::none, 0.3},
      {2, 129, 2, 2, 128, 128},
      {1, 100, 2, 1, 64, 128, {}, padding::right},
      {2, 100, 4, 2, 12, 20},
  };
  linear_case nan_pads{3, 90, 2, 1, 16, 8, {}, padding::holes};
  nan_pads.nan_pads = true;
  cs.push_back(nan_pads);
  cs.push_back({1, 3000, 2, 1, 64, 64});
  cs.push_back({2, 2000, 4, 2, 64, 64, {}, padding::holes});
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
void sweep(std::uint64_t salt, const char* what, const bwd_options& opt = {},
           bool drop_gamma = false) {
  constexpr bool causal = attnmix::linear_kind_traits<Kind>::causal;
  const double tol = grad_tolerance<T>(causal && Policy::norm != gated_norm::off);
  for (linear_case c : backward_cases(causal)) {
    if (drop_gamma) c.with_gamma = false;
    INFO("seed " << test_seed() << " " << c.describe() << " policy " << what << " saved "
                 << opt.use_saved << " dstate_out " << opt.dstate_out << " dtype "
                 << attnmix::scalar_traits<T>::name);
    check_errors(run_cuda_backward<Kind, Policy, T>(c, ++salt, opt), tol);
  }
}

}  // namespace linear_backward_test

using namespace linear_backward_test;
using attnmix::kind::bla;
using attnmix::kind::gbla;
using attnmix::kind::linear_causal;
