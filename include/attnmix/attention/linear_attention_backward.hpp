#pragma once
// attnmix::linear_attention_backward: the backward front door of the linear-attention kinds
// (bla, gbla, linear_causal), beside linear_attention(). It validates like the forward, then
// dispatches to detail::linear_attention_backward_impl of the chosen backend.

#include <string>

#include "attnmix/attention/linear_args.hpp"
#include "attnmix/attention/linear_attention.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/core/fwd.hpp"
#include "attnmix/core/linear_policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/core/validate.hpp"

namespace attnmix {
namespace detail {

inline constexpr state_names saved_names{"saved.S", "saved.z", "saved.lse"};
inline constexpr state_names dstate_out_names{"dstate_out.S", "dstate_out.z", "dstate_out.lse"};
inline constexpr state_names dstate_in_names{"dstate_in.S", "dstate_in.z", "dstate_in.lse"};

// The tensors of a linear-attention backward, in the order of checks and messages. Entry 3 is
// dout (shaped like the forward's out).
template <class Kind, class Policy, class T>
arg_list linear_backward_arg_list(const linear_attention_grad_args<T>& a,
                                  const linear_attention_params& p) {
  constexpr bool causal = linear_kind_traits<Kind>::causal;
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool normed = Policy::norm != gated_norm::off;
  constexpr auto opt = arg_presence::optional, req = arg_presence::required,
                 no = arg_presence::forbidden;
  const auto when = [](bool given, arg_presence p) {
    return given ? p : arg_presence::forbidden;
  };
  const char* no_gate = "this policy has no key gate (key_gate::off)";
  const char* no_norm = "this policy has no gated norm (gated_norm::off)";
  const char* no_state = "only causal kinds (kind::linear_causal) continue from a state";
  const char* bidir_only =
      "only bidirectional kinds take the forward's state (causal kinds "
      "recompute theirs)";
  arg_list args;
  args.reserve(28);
  args.push_back(input("q", a.q, req));
  args.push_back(input("k", a.k, req));
  args.push_back(input("v", a.v, req));
  args.push_back(input("dout", a.dout, req));
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
  args.push_back(input("saved.S", a.saved.S, causal ? no : opt, bidir_only));
  args.push_back(input("saved.z", a.saved.z, causal ? no : opt, bidir_only));
  args.push_back(input("saved.lse", a.saved.lse,
                       !gated   ? no
                       : causal ? no
                                : opt,
                       causal ? bidir_only : no_gate));
  args.push_back(host_input("cu_seqlens", p.cu_seqlens, "offset validation"));
  args.push_back(input("dstate_out.S", a.dstate_out.S, causal ? opt : no, no_state));
  args.push_back(input("dstate_out.z", a.dstate_out.z, causal ? opt : no, no_state));
  args.push_back(input("dstate_out.lse", a.dstate_out.lse,
                       !causal ? no
                       : gated ? opt
                               : no,
                       causal ? no_gate : no_state));
  args.push_back(output("dq", a.dq, req));
  args.push_back(output("dk", a.dk, req));
  args.push_back(output("dv", a.dv, req));
  args.push_back(
      output("da", a.da, gated ? req : no, gated ? "is required by this policy" : no_gate));
  args.push_back(
      output("dgate", a.dgate, normed ? req : no, normed ? "is required by this policy" : no_norm));
  args.push_back(
      output("dgamma", a.dgamma, when(a.gamma.has_value(), req),
             a.gamma.has_value() ? "is required when gamma is given" : "'gamma' was not"));
  args.push_back(output("dstate_in.S", a.dstate_in.S, when(a.state_in.S.has_value(), opt),
                        "'state_in.S' was not"));
  args.push_back(output("dstate_in.z", a.dstate_in.z, when(a.state_in.z.has_value(), opt),
                        "'state_in.z' was not"));
  args.push_back(output("dstate_in.lse", a.dstate_in.lse, when(a.state_in.lse.has_value(), opt),
                        "'state_in.lse' was not"));
  return args;
}

// Checks everything linear_attention_backward() needs and returns the resolved sizes (those of
// the forward). Throws attnmix::error.
template <class Kind, class Policy, class T, class Backend>
linear_attention_problem validate_linear_attention_backward(const std::string& fn,
                                                            const linear_attention_grad_args<T>& a,
                                                            const linear_attention_params& p) {
  using space = typename Backend::memory_space;
  using A = accum_t<T>;
  constexpr bool gated = Policy::gate != key_gate::off;

  arg_list args = linear_backward_arg_list<Kind, Policy>(a, p);
  check_presence(fn, args);
  check_state_parts<Policy>(fn, state_in_names, a.state_in);
  check_state_parts<Policy>(fn, saved_names, a.saved);
  check_placement(fn, args, space::value, Backend::name);
  const qkv_sizes s = resolve_qkv(fn, args);  // k, v and dout (entry 3)
  const index_t Hg = !gated ? 0 : Policy::gate == key_gate::shared ? 1 : s.H;
  expect_policy_shapes<Policy>(args, s, Hg, {"a", "da"}, {"gate", "dgate"}, {"gamma", "dgamma"});
  find_arg(args, "dq")->expect("[B, T, HQ, D]", s.B, s.T, s.HQ, s.D);
  find_arg(args, "dk")->expect("[B, T, H, D]", s.B, s.T, s.H, s.D);
  find_arg(args, "dv")->expect("[B, T, H, Dv]", s.B, s.T, s.H, s.Dv);
  check_shapes(fn, args);

  const double scale = check_linear_scalars<Policy, A>(fn, p, s);
  const packed_batch packed = check_packed_batch(fn, p.cu_seqlens, s);
  expect_state_shapes(args, s, packed.sequences,
                      {state_in_names, saved_names, dstate_out_names, dstate_in_names});
  check_shapes(fn, args);
  check_outputs(fn, args);
  pointer_check<space>::run(fn, args);
  return make_linear_problem(s, Hg, scale, p, packed);
}

}  // namespace detail

// Linear-attention backward: given the forward's inputs (the same Kind, Policy and params as
// the forward call) and dout = dL/d(out), writes dL/dq, dL/dk, dL/dv and, as the policy has
// them, dL/da (key gate), dL/dgate and dL/dgamma (gated norm) and dL/dstate_in (linear_causal).
// Every gradient is overwritten (not accumulated into). See linear_attention_grad_args.
// Throws attnmix::error (and writes nothing) when an argument is invalid.
template <class Kind, class Policy = default_policy_t<Kind>, class T, class Backend = backend::cpu>
void linear_attention_backward(const linear_attention_grad_args<T>& args,
                               const linear_attention_params& params = {},
                               const Backend& backend = Backend{}) {
  detail::check_linear_types<Kind, Policy, T, Backend>();
  const std::string fn = std::string("attnmix::linear_attention_backward<") + Kind::name + ">";
  const linear_attention_problem prob =
      detail::validate_linear_attention_backward<Kind, Policy, T, Backend>(fn, args, params);
  detail::linear_attention_backward_impl<Kind, Backend, Policy>::run(args, prob, backend);
}

}  // namespace attnmix
