#pragma once
// attnmix::attention_backward: the backward front door of the softmax-family kinds (softmax,
// fox, path, path_fox), beside attention(). It validates like the forward, then dispatches to
// detail::attention_backward_impl of the chosen backend.

#include <string>
#include <type_traits>

#include "attnmix/attention/args.hpp"
#include "attnmix/attention/attention.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/core/fwd.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/core/traits.hpp"
#include "attnmix/core/validate.hpp"

namespace attnmix {
namespace detail {

// The tensors of a softmax-family backward, in the order of checks and messages: the forward's
// list with out and lse as inputs, then d(out) and the gradients.
template <class Kind, class T>
arg_list attention_backward_arg_list(const attention_grad_args<T>& a, const attention_params& p) {
  constexpr bool gated = kind_traits<Kind>::uses_forget_gate;
  constexpr bool householder = kind_traits<Kind>::uses_householder;
  const auto needs = [](bool used) {
    return used ? arg_presence::required : arg_presence::forbidden;
  };
  const char* no_gate = "this kind has no forget gate";
  const char* no_hh = "this kind has no Householder transforms";
  arg_list args;
  args.reserve(20);
  args.push_back(input("q", a.q, arg_presence::required));
  args.push_back(input("k", a.k, arg_presence::required));
  args.push_back(input("v", a.v, arg_presence::required));
  args.push_back(input("out", a.out, arg_presence::required, "(the forward's output) is required"));
  args.push_back(input("g", a.g, needs(gated),
                       gated ? "(the log forget gate) is required by this kind" : no_gate));
  args.push_back(
      input("w", a.w, needs(householder),
            householder ? "(the Householder directions) is required by this kind" : no_hh));
  args.push_back(
      input("beta", a.beta, needs(householder),
            householder ? "(the Householder strengths) is required by this kind" : no_hh));
  args.push_back(host_input("cu_seqlens", p.cu_seqlens, "offset validation"));
  args.push_back(host_input("cu_seqlens_k", p.cu_seqlens_k, "offset validation"));
  args.push_back(input("lse", a.lse, arg_presence::required,
                       "(the forward's log-sum-exp: pass args.lse to attention()) is required"));
  args.push_back(input("dout", a.dout, arg_presence::required));
  args.push_back(output("dq", a.dq, arg_presence::required));
  args.push_back(output("dk", a.dk, arg_presence::required));
  args.push_back(output("dv", a.dv, arg_presence::required));
  args.push_back(output("dg", a.dg, needs(gated), gated ? "is required by this kind" : no_gate));
  args.push_back(
      output("dw", a.dw, needs(householder), householder ? "is required by this kind" : no_hh));
  args.push_back(output("dbeta", a.dbeta, needs(householder),
                        householder ? "is required by this kind" : no_hh));
  return args;
}

// Checks everything attention_backward() needs and returns the resolved sizes (those of the
// forward). Throws attnmix::error.
template <class Kind, class T, class Backend>
attention_problem validate_attention_backward(const std::string& fn,
                                              const attention_grad_args<T>& a,
                                              const attention_params& p, bool causal) {
  using space = typename Backend::memory_space;
  arg_list args = attention_backward_arg_list<Kind>(a, p);
  check_presence(fn, args);
  check_placement(fn, args, space::value, Backend::name);
  // As in the forward, softmax and FoX keys may have another length than the queries.
  const key_shape keys =
      kind_traits<Kind>::uses_householder ? key_shape::queries : key_shape::other_lengths;
  const key_shape_names names = names_of(keys);
  const qkv_sizes s = resolve_qkv(fn, args, keys);  // k, v and out (entry 3)
  find_arg(args, "g")->expect(names.g, s.B, s.Tk, s.HQ);
  find_arg(args, "w")->expect("[B, T, H, D]", s.B, s.T, s.H, s.D);
  find_arg(args, "beta")->expect("[B, T, H]", s.B, s.T, s.H);
  find_arg(args, "lse")->expect("[B, T, HQ]", s.B, s.T, s.HQ);
  find_arg(args, "dout")->expect("[B, T, HQ, Dv]", s.B, s.T, s.HQ, s.Dv);
  find_arg(args, "dq")->expect("[B, T, HQ, D]", s.B, s.T, s.HQ, s.D);
  find_arg(args, "dk")->expect(names.k, s.B, s.Tk, s.H, s.D);
  find_arg(args, "dv")->expect(names.v, s.B, s.Tk, s.H, s.Dv);
  find_arg(args, "dg")->expect(names.g, s.B, s.Tk, s.HQ);
  find_arg(args, "dw")->expect("[B, T, H, D]", s.B, s.T, s.H, s.D);
  find_arg(args, "dbeta")->expect("[B, T, H]", s.B, s.T, s.H);
  check_shapes(fn, args);
  check_outputs(fn, args);
  require(!p.key_lengths.has_value(), fn, "key_lengths",
          "reads keys from a cache, which the backward does not take");
  require(!p.key_slots.has_value(), fn, "key_slots",
          "reads keys from a cache, which the backward does not take");
  const attention_problem prob = resolve_attention_problem<Kind, T>(fn, s, p, causal);
  require(prob.keys_match_queries() || takes_key_lengths_backward<Kind, Backend>::value, fn,
          p.cu_seqlens_k.has_value() ? "cu_seqlens_k" : "k",
          "gives keys of other lengths than the queries (Tk = ", s.Tk, ", T = ", s.T,
          "), which the backward of ", Kind::name, " does not take on ", Backend::name);
  pointer_check<space>::run(fn, args);
  return prob;
}

}  // namespace detail

// Softmax-family attention backward: given the forward's inputs, its output `out` and `lse`
// (attention() with args.lse set, under the same Kind, Policy and params) and dout = dL/d(out),
// writes dL/dq, dL/dk, dL/dv, and dL/dg (fox, path_fox) and dL/dw, dL/dbeta (path, path_fox).
// Every gradient is overwritten (not accumulated into). Masked-out and padded positions get 0.
// Throws attnmix::error (and writes nothing) when an argument is invalid.
template <class Kind, class Policy = default_policy_t<Kind>, class T, class Backend = backend::cpu>
void attention_backward(const attention_grad_args<T>& args, const attention_params& params = {},
                        const Backend& backend = Backend{}) {
  detail::check_attention_types<Kind, Policy, T, Backend>();
  const std::string fn = std::string("attnmix::attention_backward<") + Kind::name + ">";
  const attention_problem prob = detail::validate_attention_backward<Kind, T, Backend>(
      fn, args, params, Policy::mask == mask_type::causal);
  detail::attention_backward_impl<Kind, Backend, Policy>::run(args, prob, backend);
}

}  // namespace attnmix
