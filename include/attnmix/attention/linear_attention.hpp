#pragma once
// attnmix::linear_attention: the front door of the linear-attention kinds (bla, gbla,
// linear_causal). It validates every argument, then dispatches to
// detail::linear_attention_impl of the chosen backend. Include the backend headers
// (attnmix/attnmix.hpp, attnmix/cuda.cuh) to use it.

#include <cmath>
#include <string>
#include <type_traits>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/linear_args.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/core/fwd.hpp"
#include "attnmix/core/linear_policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/core/traits.hpp"
#include "attnmix/core/validate.hpp"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {

template <class T, int R>
bool same_view(const tensor_view<T, R>& x, const tensor_view<T, R>& y) {
  return x.data() == y.data() && x.shape() == y.shape() && x.strides() == y.strides();
}

// Checks everything linear_attention() needs and returns the resolved sizes. Throws
// attnmix::error and reads no tensor data but cu_seqlens.
template <class Kind, class Policy, class T, class Backend>
linear_attention_problem validate_linear_attention(const std::string& fn,
                                                   const linear_attention_args<T>& a,
                                                   const linear_attention_params& p) {
  constexpr memory_space space = space_of<Backend>;
  constexpr bool causal = linear_kind_traits<Kind>::causal;
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool normed = Policy::norm != gated_norm::off;
  const char* be = Backend::name;

  const qkv_sizes sz = check_qkv_out<Backend>(fn, a.q, a.k, a.v, a.out);
  const index_t B = sz.B, T_ = sz.T, HQ = sz.HQ, H = sz.H, D = sz.D, Dv = sz.Dv;

  if (a.mask.has_value()) {
    check_tensor(fn, "mask", a.mask, space, be);
    check_shape(fn, "mask", a.mask, {B, T_}, "[B, T]");
  }

  index_t Hg = 0;
  if constexpr (gated) {
    Hg = Policy::gate == key_gate::shared ? 1 : H;
    check_given(fn, "a", a.a, "(the key-gate logits) is required by this policy");
    check_tensor(fn, "a", a.a, space, be);
    check_shape(fn, "a", a.a, {B, T_, Hg},
                Policy::gate == key_gate::shared ? "[B, T, 1] (key_gate::shared)"
                                                 : "[B, T, H] (key_gate::per_head)");
  } else {
    check_not_given(fn, "a", a.a, "this policy has no key gate (key_gate::off)");
  }

  if constexpr (normed) {
    check_given(fn, "gate", a.gate,
                "(the output gate of the gated RMSNorm) is required by this policy");
    check_tensor(fn, "gate", a.gate, space, be);
    check_shape(fn, "gate", a.gate, {B, T_, HQ, Dv}, "[B, T, HQ, Dv]");
    if (a.gamma.has_value()) {
      check_tensor(fn, "gamma", a.gamma, space, be);
      if constexpr (Policy::weight == norm_weight::shared)
        check_shape(fn, "gamma", a.gamma, {Dv}, "[Dv] (norm_weight::shared)");
      else
        check_shape(fn, "gamma", a.gamma, {HQ * Dv}, "[HQ * Dv] (norm_weight::per_head)");
    }
    require(std::isfinite(p.norm_eps) && p.norm_eps > 0, fn, "norm_eps",
            "must be finite and > 0 but is ", p.norm_eps);
  } else {
    check_not_given(fn, "gate", a.gate, "this policy has no gated norm (gated_norm::off)");
    check_not_given(fn, "gamma", a.gamma, "this policy has no gated norm (gated_norm::off)");
  }

  const double scale =
      p.scale ? *p.scale : (Policy::normalize ? 1.0 : 1.0 / std::sqrt(static_cast<double>(D)));
  require(std::isfinite(scale), fn, "scale", "must be finite but is ", scale);
  require(std::isfinite(p.eps) && p.eps >= 0, fn, "eps", "must be finite and >= 0 but is ", p.eps);
  // phi(q).z is 0 for a query or key set whose features vanish (relu): eps keeps 0 / eps = 0.
  require(!Policy::normalize || p.eps > 0, fn, "eps",
          "must be > 0 with the normaliser on (phi(q).z can be 0) but is ", p.eps);

  const auto [cu, sequences] = check_packed_batch(fn, p.cu_seqlens, sz);
  const linear_attention_problem prob{B,  T_,    HQ,    H,          Hg, D,
                                      Dv, scale, p.eps, p.norm_eps, cu, sequences};
  const index_t N = prob.num_sequences;

  // States.
  const auto& si = a.state_in;
  const auto& so = a.state_out;
  if constexpr (causal) {
    if (si.S.has_value()) {
      check_tensor(fn, "state_in.S", si.S, space, be);
      check_shape(fn, "state_in.S", si.S, {N, H, D, Dv}, "[N, H, D, Dv]");
      if (Policy::normalize)
        check_given(fn, "state_in.z", si.z,
                    "is required with state_in.S when the normaliser is on");
      if constexpr (gated)
        check_given(fn, "state_in.lse", si.lse, "is required with state_in.S under a key gate");
    } else {
      check_not_given(fn, "state_in.z", si.z, "'state_in.S' was not");
      check_not_given(fn, "state_in.lse", si.lse, "'state_in.S' was not");
    }
    if (si.z.has_value()) {
      check_tensor(fn, "state_in.z", si.z, space, be);
      check_shape(fn, "state_in.z", si.z, {N, H, D}, "[N, H, D]");
    }
    if constexpr (!gated)
      check_not_given(fn, "state_in.lse", si.lse, "this policy has no key gate (key_gate::off)");
    if (si.lse.has_value()) {
      check_tensor(fn, "state_in.lse", si.lse, space, be);
      check_shape(fn, "state_in.lse", si.lse, {N, H}, "[N, H]");
    }
  } else {
    const char* why = "only causal kinds (kind::linear_causal) continue from a state";
    check_not_given(fn, "state_in.S", si.S, why);
    check_not_given(fn, "state_in.z", si.z, why);
    check_not_given(fn, "state_in.lse", si.lse, why);
  }
  if (so.S.has_value()) {
    check_tensor(fn, "state_out.S", so.S, space, be);
    check_shape(fn, "state_out.S", so.S, {N, H, D, Dv}, "[N, H, D, Dv]");
    check_non_overlapping(fn, "state_out.S", so.S);
  }
  if (so.z.has_value()) {
    check_tensor(fn, "state_out.z", so.z, space, be);
    check_shape(fn, "state_out.z", so.z, {N, H, D}, "[N, H, D]");
    check_non_overlapping(fn, "state_out.z", so.z);
  }
  if constexpr (!gated)
    check_not_given(fn, "state_out.lse", so.lse, "this policy has no key gate (key_gate::off)");
  if (so.lse.has_value()) {
    check_tensor(fn, "state_out.lse", so.lse, space, be);
    check_shape(fn, "state_out.lse", so.lse, {N, H}, "[N, H]");
    check_non_overlapping(fn, "state_out.lse", so.lse);
  }

  // Outputs never share memory with the inputs, except that a state may be updated in place
  // (state_out.X the very same view as state_in.X): each (sequence, head) reads its state
  // before it writes it.
  const auto no_alias = [&](const char* out_name, const auto& out) {
    check_no_alias(fn, out_name, out, "q", a.q);
    check_no_alias(fn, out_name, out, "k", a.k);
    check_no_alias(fn, out_name, out, "v", a.v);
    check_no_alias(fn, out_name, out, "mask", a.mask);
    check_no_alias(fn, out_name, out, "a", a.a);
    check_no_alias(fn, out_name, out, "gate", a.gate);
    check_no_alias(fn, out_name, out, "gamma", a.gamma);
    check_no_alias(fn, out_name, out, "cu_seqlens", p.cu_seqlens);
  };
  no_alias("out", a.out);
  no_alias("state_out.S", so.S);
  no_alias("state_out.z", so.z);
  no_alias("state_out.lse", so.lse);
  check_no_alias(fn, "out", a.out, "state_in.S", si.S);
  check_no_alias(fn, "out", a.out, "state_in.z", si.z);
  check_no_alias(fn, "out", a.out, "state_in.lse", si.lse);
  check_no_alias(fn, "state_out.S", so.S, "out", a.out);
  check_no_alias(fn, "state_out.z", so.z, "out", a.out);
  check_no_alias(fn, "state_out.lse", so.lse, "out", a.out);
  check_no_alias(fn, "state_out.z", so.z, "state_out.S", so.S);
  check_no_alias(fn, "state_out.lse", so.lse, "state_out.S", so.S);
  check_no_alias(fn, "state_out.lse", so.lse, "state_out.z", so.z);
  const auto in_place_or_apart = [&](const char* out_name, const auto& out, const char* in_name,
                                     const auto& in) {
    using out_view = std::decay_t<decltype(out)>;
    using in_view = std::decay_t<decltype(in)>;
    if constexpr (out_view::rank == in_view::rank) {
      if (out.has_value() && in.has_value() && same_view(in_view(out), in)) return;
    }
    check_no_alias(fn, out_name, out, in_name, in);
  };
  in_place_or_apart("state_out.S", so.S, "state_in.S", si.S);
  in_place_or_apart("state_out.S", so.S, "state_in.z", si.z);
  in_place_or_apart("state_out.S", so.S, "state_in.lse", si.lse);
  in_place_or_apart("state_out.z", so.z, "state_in.S", si.S);
  in_place_or_apart("state_out.z", so.z, "state_in.z", si.z);
  in_place_or_apart("state_out.z", so.z, "state_in.lse", si.lse);
  in_place_or_apart("state_out.lse", so.lse, "state_in.S", si.S);
  in_place_or_apart("state_out.lse", so.lse, "state_in.z", si.z);
  in_place_or_apart("state_out.lse", so.lse, "state_in.lse", si.lse);
  return prob;
}

}  // namespace detail

// Linear-attention forward. Per sequence and query head hq (KV head h = hq / (HQ/H)), with
// phi = Policy::phi, m_j the validity mask (cu_seqlens segments and/or args.mask) and w_j the
// key gate (softmax of a over the valid keys; a prefix softmax for linear_causal; 1 when off):
//   p_j = m_j w_j phi(k_j),  S = sum_j p_j v_j^T,  z = sum_j p_j      (j <= i when causal)
//   o_i = S^T r_i / (r_i.z + eps)  with r_i = scale * phi(q_i)       (normaliser on)
//   o_i = S^T r_i                                                    (normaliser off)
//   out_i = o_i, or the gated RMSNorm of o_i (Policy::norm, order, activation, weight).
// q: [B,T,HQ,D], k: [B,T,H,D], v: [B,T,H,Dv], out: [B,T,HQ,Dv]; see linear_attention_args for
// the optional tensors. Time O(T D Dv) per head, state memory O(D Dv) per head.
// Throws attnmix::error (and writes nothing) when an argument is invalid.
template <class Kind, class Policy = default_policy_t<Kind>, class T, class Backend = backend::cpu>
void linear_attention(const linear_attention_args<T>& args,
                      const linear_attention_params& params = {},
                      const Backend& backend = Backend{}) {
  static_assert(linear_kind_traits<Kind>::linear_family,
                "attnmix::linear_attention: Kind must be kind::bla, gbla or linear_causal");
  static_assert(is_scalar_v<T>,
                "attnmix::linear_attention: T must be float, double, half or bfloat16");
  static_assert(is_backend_v<Backend>,
                "attnmix::linear_attention: Backend must be a backend tag (a name and a memory_space)");
  static_assert(!Policy::normalize || feature_map_traits<Policy::phi>::nonnegative,
                "attnmix::linear_attention: this feature map can go negative, which can make the "
                "normaliser phi(q).z + eps zero; use it only with Policy::normalize = false");
  static_assert(!std::is_same_v<Kind, kind::bla> ||
                    (Policy::gate == key_gate::off && Policy::norm == gated_norm::off),
                "attnmix::linear_attention: kind::bla has no key gate and no gated norm; use "
                "kind::gbla for them");
  static_assert(Policy::chunk >= 1 && Policy::block >= 1,
                "attnmix::linear_attention: Policy::chunk and Policy::block must be positive");
  const std::string fn = std::string("attnmix::linear_attention<") + Kind::name + ">";
  const linear_attention_problem prob =
      detail::validate_linear_attention<Kind, Policy, T, Backend>(fn, args, params);
  detail::linear_attention_impl<Kind, Backend, Policy>::run(args, prob, backend);
}

}  // namespace attnmix
