#pragma once
// attnmix::linear_attention: the front door of the linear-attention kinds (bla, gbla,
// linear_causal). It validates every argument, then dispatches to
// detail::linear_attention_impl of the chosen backend. Include the backend headers
// (attnmix/attnmix.hpp, attnmix/cuda.cuh) to use it.

#include <cmath>
#include <cstring>
#include <initializer_list>
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

// The tensors of a linear-attention call, in the order of checks and messages. A state may be
// updated in place: state_out.X the very same view as state_in.X.
template <class Kind, class Policy, class T>
arg_list linear_arg_list(const linear_attention_args<T>& a, const linear_attention_params& p) {
  constexpr bool causal = linear_kind_traits<Kind>::causal;
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool normed = Policy::norm != gated_norm::off;
  constexpr auto opt = arg_presence::optional, req = arg_presence::required,
                 no = arg_presence::forbidden;
  const char* no_gate = "this policy has no key gate (key_gate::off)";
  const char* no_norm = "this policy has no gated norm (gated_norm::off)";
  const char* no_state = "only causal kinds (kind::linear_causal) continue from a state";
  arg_list args = qkv_out_args(a.q, a.k, a.v, a.out);
  args.push_back(input("mask", a.mask));
  args.push_back(input("a", a.a, gated ? req : no,
                       gated ? "(the key-gate logits) is required by this policy" : no_gate));
  args.push_back(input(
      "gate", a.gate, normed ? req : no,
      normed ? "(the output gate of the gated RMSNorm) is required by this policy" : no_norm));
  args.push_back(input("gamma", a.gamma, normed ? opt : no, no_norm));
  args.push_back(input("state_in.S", a.state_in.S, causal ? opt : no, no_state));
  args.push_back(input("state_in.z", a.state_in.z, causal ? opt : no, no_state));
  args.push_back(input("state_in.lse", a.state_in.lse,
                       !causal ? no
                       : gated ? opt
                               : no,
                       causal ? no_gate : no_state));
  args.push_back(host_input("cu_seqlens", p.cu_seqlens, "offset validation"));
  args.push_back(output("state_out.S", a.state_out.S));
  args.push_back(output("state_out.z", a.state_out.z));
  args.push_back(output("state_out.lse", a.state_out.lse, gated ? opt : no, no_gate));
  for (auto& x : args)
    if (std::strncmp(x.name, "state_", 6) == 0) x.in_place = true;
  return args;
}

// The runtime values of a linear-attention call checked in the type they are computed in;
// returns the scale.
template <class Policy, class A>
double check_linear_scalars(const std::string& fn, const linear_attention_params& p,
                            const qkv_sizes& s) {
  const auto finite = [](double x) {
    return std::isfinite(x) && std::isfinite(static_cast<A>(x));
  };
  if constexpr (Policy::norm != gated_norm::off)
    require(finite(p.norm_eps) && p.norm_eps > 0, fn, "norm_eps",
            "must be finite and > 0 (in the type it is computed in) but is ", p.norm_eps);
  const double scale =
      p.scale ? *p.scale : (Policy::normalize ? 1.0 : 1.0 / std::sqrt(static_cast<double>(s.D)));
  check_finite_in<A>(fn, "scale", scale);
  require(finite(p.eps) && p.eps >= 0, fn, "eps",
          "must be finite and >= 0 (in the type it is computed in) but is ", p.eps);
  // phi(q).z is 0 for a query or key set whose features vanish (relu): eps keeps 0 / eps = 0.
  require(!Policy::normalize || p.eps > 0, fn, "eps",
          "must be > 0 with the normaliser on (phi(q).z can be 0) but is ", p.eps);
  return scale;
}

inline linear_attention_problem make_linear_problem(const qkv_sizes& s, index_t gate_heads,
                                                    double scale, const linear_attention_params& p,
                                                    const packed_batch& packed) {
  linear_attention_problem prob{};
  prob.batch = s.B;
  prob.tokens = s.T;
  prob.q_heads = s.HQ;
  prob.kv_heads = s.H;
  prob.gate_heads = gate_heads;
  prob.head_dim = s.D;
  prob.value_dim = s.Dv;
  prob.scale = scale;
  prob.eps = p.eps;
  prob.norm_eps = p.norm_eps;
  prob.cu_seqlens = packed.cu_seqlens;
  prob.num_sequences = packed.sequences;
  return prob;
}

// The names of a state's parts in messages.
struct state_names {
  const char *S, *z, *lse;
};
inline constexpr state_names state_in_names{"state_in.S", "state_in.z", "state_in.lse"};
inline constexpr state_names state_out_names{"state_out.S", "state_out.z", "state_out.lse"};

// A state read as a whole: S, then z with the normaliser on and lse under a key gate; no z or
// lse without S.
template <class Policy, class A>
void check_state_parts(const std::string& fn, const state_names& n, const linear_state<A>& st) {
  if (st.S.has_value()) {
    if (Policy::normalize)
      require(st.z.has_value(), fn, n.z, "is required with '", n.S,
              "' when the normaliser is on but was not given");
    if constexpr (Policy::gate != key_gate::off)
      require(st.lse.has_value(), fn, n.lse, "is required with '", n.S,
              "' under a key gate but was not given");
  } else {
    require(!st.z.has_value(), fn, n.z, "was given but '", n.S, "' was not");
    require(!st.lse.has_value(), fn, n.lse, "was given but '", n.S, "' was not");
  }
}

// The shapes of the policy's optional tensors, each under the names given (an input and its
// gradient): the mask, the key-gate logits, the gated norm's output gate and weight. Hg: the
// key gate's heads.
template <class Policy>
void expect_policy_shapes(arg_list& args, const qkv_sizes& s, index_t Hg,
                          std::initializer_list<const char*> logits,
                          std::initializer_list<const char*> gates,
                          std::initializer_list<const char*> weights) {
  find_arg(args, "mask")->expect("[B, T]", s.B, s.T);
  const char* a_dims = Policy::gate == key_gate::shared ? "[B, T, 1] (key_gate::shared)"
                                                        : "[B, T, H] (key_gate::per_head)";
  for (const char* n : logits) find_arg(args, n)->expect(a_dims, s.B, s.T, Hg);
  for (const char* n : gates) find_arg(args, n)->expect("[B, T, HQ, Dv]", s.B, s.T, s.HQ, s.Dv);
  for (const char* n : weights) {
    if constexpr (Policy::weight == norm_weight::shared)
      find_arg(args, n)->expect("[Dv] (norm_weight::shared)", s.Dv);
    else
      find_arg(args, n)->expect("[HQ * Dv] (norm_weight::per_head)", s.HQ * s.Dv);
  }
}

// The parts of each named state against N sequences: S [N, H, D, Dv], z [N, H, D], lse [N, H].
inline void expect_state_shapes(arg_list& args, const qkv_sizes& s, index_t N,
                                std::initializer_list<state_names> states) {
  for (const state_names& n : states) {
    find_arg(args, n.S)->expect("[N, H, D, Dv]", N, s.H, s.D, s.Dv);
    find_arg(args, n.z)->expect("[N, H, D]", N, s.H, s.D);
    find_arg(args, n.lse)->expect("[N, H]", N, s.H);
  }
}

// Checks everything linear_attention() needs and returns the resolved sizes. Throws
// attnmix::error and reads no tensor data but cu_seqlens.
template <class Kind, class Policy, class T, class Backend>
linear_attention_problem validate_linear_attention(const std::string& fn,
                                                   const linear_attention_args<T>& a,
                                                   const linear_attention_params& p) {
  using space = typename Backend::memory_space;
  using A = accum_t<T>;
  constexpr bool gated = Policy::gate != key_gate::off;

  arg_list args = linear_arg_list<Kind, Policy>(a, p);
  check_presence(fn, args);
  check_state_parts<Policy>(fn, state_in_names, a.state_in);
  check_placement(fn, args, space::value, Backend::name);
  const qkv_sizes s = resolve_qkv(fn, args);
  const index_t Hg = !gated ? 0 : Policy::gate == key_gate::shared ? 1 : s.H;
  expect_policy_shapes<Policy>(args, s, Hg, {"a"}, {"gate"}, {"gamma"});
  check_shapes(fn, args);

  const double scale = check_linear_scalars<Policy, A>(fn, p, s);
  const packed_batch packed = check_packed_batch(fn, p.cu_seqlens, s);
  expect_state_shapes(args, s, packed.sequences, {state_in_names, state_out_names});
  check_shapes(fn, args);
  check_outputs(fn, args);
  pointer_check<space>::run(fn, args);

  return make_linear_problem(s, Hg, scale, p, packed);
}

// The compile-time checks of both linear-attention front doors.
template <class Kind, class Policy, class T, class Backend>
constexpr void check_linear_types() {
  static_assert(linear_kind_traits<Kind>::linear_family,
                "attnmix::linear_attention: Kind must be kind::bla, gbla or linear_causal");
  static_assert(is_scalar_v<T>,
                "attnmix::linear_attention: T must be float, double, half or bfloat16");
  static_assert(
      is_backend_v<Backend>,
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
  detail::check_linear_types<Kind, Policy, T, Backend>();
  const std::string fn = std::string("attnmix::linear_attention<") + Kind::name + ">";
  const linear_attention_problem prob =
      detail::validate_linear_attention<Kind, Policy, T, Backend>(fn, args, params);
  detail::linear_attention_impl<Kind, Backend, Policy>::run(args, prob, backend);
}

}  // namespace attnmix
