#pragma once
// attnmix::attention: the front door of the softmax-family kinds (softmax, fox, path,
// path_fox). It validates every argument, then dispatches to detail::attention_impl of the
// chosen backend. Include the backend headers (attnmix/attnmix.hpp, attnmix/cuda.cuh) to use it.

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

#include "attnmix/attention/args.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/core/fwd.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/core/traits.hpp"
#include "attnmix/core/validate.hpp"

namespace attnmix {
namespace detail {

template <class Backend>
inline constexpr memory_space space_of = space_of_v<Backend>;

template <class T, int R>
void check_tensor(const std::string& fn, const char* arg, const tensor_view<T, R>& v,
                  memory_space space, const char* backend) {
  check_layout(fn, arg, v);
  check_space(fn, arg, v, space, backend);
}

// Sizes every front door reads off q [B,T,HQ,D], k [B,Tk,H,D], v [B,Tk,H,Dv],
// out [B,T,HQ,Dv]. Tk == T unless the call takes keys of other lengths (resolve_qkv).
struct qkv_sizes {
  index_t B, T, HQ, H, D, Dv, Tk;
};

// q, k, v and out: required. Entries 0..3 of every list the front doors build.
template <class T>
arg_list qkv_out_args(const view4<const T>& q, const view4<const T>& k, const view4<const T>& v,
                      const view4<T>& out) {
  arg_list args;
  args.reserve(16);  // room for every family's list: one allocation a call
  args.push_back(input("q", q, arg_presence::required));
  args.push_back(input("k", k, arg_presence::required));
  args.push_back(input("v", v, arg_presence::required));
  args.push_back(output("out", out, arg_presence::required));
  return args;
}

// The sizes of q, k, v (whose placement is checked), their consistency (HQ % H == 0), and the
// expected shapes of k, v and out. With `key_lengths`, k and v may have another T (Tk) than q.
inline qkv_sizes resolve_qkv(const std::string& fn, arg_list& args, bool key_lengths = false) {
  const tensor_arg &q = args[0], &k = args[1], &v = args[2];
  const qkv_sizes s{q.shape[0],
                    q.shape[1],
                    q.shape[2],
                    k.shape[2],
                    q.shape[3],
                    v.shape[3],
                    key_lengths ? k.shape[1] : q.shape[1]};
  require(s.HQ >= 1 && s.D >= 1, fn, "q", "must have at least one head and D >= 1 but has shape ",
          shape_of(q));
  require(s.H >= 1, fn, "k", "must have at least one head but has shape ", shape_of(k));
  require(s.HQ % s.H == 0, fn, "k", "has H = ", s.H,
          " heads, which does not divide the HQ = ", s.HQ, " heads of 'q'");
  args[1].expect(key_lengths ? "[B, Tk, H, D]" : "[B, T, H, D]", s.B, s.Tk, s.H, s.D);
  check_shapes(fn, {args[1]});
  require(s.Dv >= 1, fn, "v", "must have Dv >= 1 but has shape ", shape_of(v));
  args[2].expect(key_lengths ? "[B, Tk, H, Dv]" : "[B, T, H, Dv]", s.B, s.Tk, s.H, s.Dv);
  args[3].expect("[B, T, HQ, Dv]", s.B, s.T, s.HQ, s.Dv);
  return s;
}

// Checks q, k, v and out: given, laid out for and living where the backend needs them, their
// shapes consistent (HQ % H == 0), out free of self-overlap.
template <class Backend, class T>
qkv_sizes check_qkv_out(const std::string& fn, const view4<const T>& q, const view4<const T>& k,
                        const view4<const T>& v, const view4<T>& out) {
  arg_list args = qkv_out_args(q, k, v, out);
  check_presence(fn, args);
  check_placement(fn, args, space_of<Backend>, Backend::name);
  const qkv_sizes s = resolve_qkv(fn, args);
  check_shapes(fn, args);
  check_outputs(fn, args);
  return s;
}

// The packed-batch offsets of a call on q-shaped tensors (see resolve_packed_batch).
inline packed_batch check_packed_batch(const std::string& fn,
                                       const view1<const std::int32_t>& cu_seqlens,
                                       const qkv_sizes& s) {
  return resolve_packed_batch(fn, cu_seqlens, s.B, s.T, "q");
}

// A softmax or linear scale, eps and the like: finite in the type the kernels compute in
// (1e39 is finite in double but not in float).
template <class A>
void check_finite_in(const std::string& fn, const char* arg, double x) {
  require(std::isfinite(x) && std::isfinite(static_cast<A>(x)), fn, arg, "must be finite in ",
          sizeof(A) == 4 ? "float" : "double", " (the type it is computed in) but is ", x);
}

// The factor of (G_i - G_j) in the logits of the gated kinds: the softmax scale when the gate
// enters before it (PaTH-FoX's convention), else 1 (FoX's). Every backend uses this one.
template <class Policy>
double gate_coefficient(const attention_problem& p) {
  return Policy::gate == gate_scaling::before_scale ? p.scale : 1.0;
}

// The tensors of a softmax-family call, in the order of checks and messages.
template <class Kind, class T>
arg_list attention_arg_list(const attention_args<T>& a, const attention_params& p) {
  constexpr bool gated = kind_traits<Kind>::uses_forget_gate;
  constexpr bool householder = kind_traits<Kind>::uses_householder;
  const auto needs = [](bool used) {
    return used ? arg_presence::required : arg_presence::forbidden;
  };
  arg_list args = qkv_out_args(a.q, a.k, a.v, a.out);
  args.push_back(input(
      "g", a.g, needs(gated),
      gated ? "(the log forget gate) is required by this kind" : "this kind has no forget gate"));
  args.push_back(input("w", a.w, needs(householder),
                       householder ? "(the Householder directions) is required by this kind"
                                   : "this kind has no Householder transforms"));
  args.push_back(input("beta", a.beta, needs(householder),
                       householder ? "(the Householder strengths) is required by this kind"
                                   : "this kind has no Householder transforms"));
  args.push_back(host_input("cu_seqlens", p.cu_seqlens, "offset validation"));
  args.push_back(host_input("cu_seqlens_k", p.cu_seqlens_k, "offset validation"));
  args.push_back(output("lse", a.lse));
  return args;
}

// The keys' offsets of a packed batch (cu_seqlens_k, or cu_seqlens when absent) and the lengths
// of keys and queries: every sequence needs a key for each of its rows to see. Causal rows (and
// windowed ones) are aligned with the last keys, so they need at least as many keys as queries;
// bidirectional rows need one. Returns cu_seqlens itself when the two hold the same offsets.
inline const std::int32_t* resolve_key_offsets(const std::string& fn, const attention_params& p,
                                               const qkv_sizes& s, const packed_batch& packed,
                                               bool causal) {
  const std::int32_t* cu_k = packed.cu_seqlens;
  if (p.cu_seqlens_k.has_value()) {
    require(p.cu_seqlens.has_value(), fn, "cu_seqlens_k",
            "needs cu_seqlens (the queries' offsets) beside it");
    require(p.cu_seqlens_k.extent(0) == p.cu_seqlens.extent(0), fn, "cu_seqlens_k", "holds ",
            p.cu_seqlens_k.extent(0), " offsets but cu_seqlens holds ", p.cu_seqlens.extent(0),
            ": one sequence of keys for each sequence of queries");
    check_offsets(fn, "cu_seqlens_k", p.cu_seqlens_k, s.Tk);
    cu_k = p.cu_seqlens_k.data();
    if (std::equal(cu_k, cu_k + p.cu_seqlens_k.extent(0), packed.cu_seqlens))
      cu_k = packed.cu_seqlens;
  } else if (packed.cu_seqlens != nullptr) {
    require(s.Tk == s.T, fn, "k", "has Tk = ", s.Tk, " tokens but q has T = ", s.T,
            ": a packed batch with keys of other lengths needs cu_seqlens_k");
  }
  const bool need_all = causal || p.window > 0;
  for (index_t n = 0; n < packed.sequences; ++n) {
    const sequence q = sequence_at(packed.cu_seqlens, s.T, n), k = sequence_at(cu_k, s.Tk, n);
    if (q.length == 0) continue;
    if (need_all)
      require(k.length >= q.length, fn, "k", "has ", k.length, " keys for the ", q.length,
              " queries of sequence ", n, ": ", causal ? "causal" : "windowed",
              " queries are aligned with the last keys and need at least as many");
    else
      require(k.length >= 1, fn, "k", "has no keys for the ", q.length, " queries of sequence ", n);
  }
  return cu_k;
}

// The runtime values of a softmax-family call (scale, window, packed-batch offsets) checked
// against the resolved sizes, and the problem every backend gets.
template <class Kind, class T>
attention_problem resolve_attention_problem(const std::string& fn, const qkv_sizes& s,
                                            const attention_params& p, bool causal) {
  const double scale = p.scale ? *p.scale : 1.0 / std::sqrt(static_cast<double>(s.D));
  check_finite_in<accum_t<T>>(fn, "scale", scale);
  require(p.window >= 0, fn, "window", "must be >= 0 (0: no window) but is ", p.window);
  if constexpr (kind_traits<Kind>::uses_householder)
    require(p.window == 0, fn, "window", "must be 0: PaTH has no sliding window, but is ",
            p.window);
  const packed_batch packed = check_packed_batch(fn, p.cu_seqlens, s);

  attention_problem prob{};
  prob.batch = s.B;
  prob.tokens = s.T;
  prob.q_heads = s.HQ;
  prob.kv_heads = s.H;
  prob.head_dim = s.D;
  prob.value_dim = s.Dv;
  prob.scale = scale;
  // A window of T or more sees every key of every sequence: no window. This also keeps the
  // kernels' index arithmetic (i + window) far from overflow.
  prob.window = p.window >= std::max(s.T, s.Tk) ? 0 : p.window;
  prob.cu_seqlens = packed.cu_seqlens;
  prob.num_sequences = packed.sequences;
  prob.key_tokens = s.Tk;
  prob.cu_seqlens_k = resolve_key_offsets(fn, p, s, packed, causal);
  return prob;
}

// Checks everything attention() needs and returns the resolved sizes. Throws attnmix::error.
template <class Kind, class T, class Backend>
attention_problem validate_attention(const std::string& fn, const attention_args<T>& a,
                                     const attention_params& p, bool causal) {
  using space = typename Backend::memory_space;
  arg_list args = attention_arg_list<Kind>(a, p);
  check_presence(fn, args);
  check_placement(fn, args, space::value, Backend::name);
  // PaTH's keys are its queries' tokens: only softmax and FoX read keys of other lengths.
  constexpr bool key_lengths = !kind_traits<Kind>::uses_householder;
  const qkv_sizes s = resolve_qkv(fn, args, key_lengths);
  find_arg(args, "g")->expect(key_lengths ? "[B, Tk, HQ]" : "[B, T, HQ]", s.B, s.Tk, s.HQ);
  find_arg(args, "w")->expect("[B, T, H, D]", s.B, s.T, s.H, s.D);
  find_arg(args, "beta")->expect("[B, T, H]", s.B, s.T, s.H);
  find_arg(args, "lse")->expect("[B, T, HQ]", s.B, s.T, s.HQ);
  check_shapes(fn, args);
  check_outputs(fn, args);

  const attention_problem prob = resolve_attention_problem<Kind, T>(fn, s, p, causal);
  // (PaTH never gets here: its k has the queries' T, and other offsets of the same total give
  // some sequence fewer keys than queries.)
  require(prob.keys_match_queries() || takes_key_lengths<Kind, Backend>::value, fn,
          p.cu_seqlens_k.has_value() ? "cu_seqlens_k" : "k",
          "gives keys of other lengths than the queries (Tk = ", s.Tk, ", T = ", s.T, "), which ",
          Kind::name, " does not take on ", Backend::name);
  pointer_check<space>::run(fn, args);
  return prob;
}

// The compile-time checks of both softmax-family front doors.
template <class Kind, class Policy, class T, class Backend>
constexpr void check_attention_types() {
  static_assert(kind_traits<Kind>::softmax_family,
                "attnmix::attention: Kind must be kind::softmax, fox, path or path_fox");
  static_assert(is_scalar_v<T>, "attnmix::attention: T must be float, double, half or bfloat16");
  static_assert(is_backend_v<Backend>,
                "attnmix::attention: Backend must be a backend tag (a name and a memory_space)");
  static_assert(std::is_same_v<Kind, kind::softmax> || Policy::mask == mask_type::causal,
                "attnmix::attention: fox, path and path_fox are causal only; only kind::softmax "
                "takes mask_type::bidirectional");
}

}  // namespace detail

// Softmax-family attention forward.
//   out[b,i,hq,:] = sum_j softmax_j(z_ij) v[b,j,hq/(HQ/H),:]
// with z_ij = scale * q_i.k_j (softmax), plus G_i - G_j for fox (G the per-sequence inclusive
// cumsum of g; before or after the scale per Policy::gate), with PaTH's Householder products
// for path and path_fox. Masking follows Policy::mask, params.window and params.cu_seqlens.
// Throws attnmix::error (and writes nothing) when an argument is invalid.
template <class Kind, class Policy = default_policy_t<Kind>, class T, class Backend = backend::cpu>
void attention(const attention_args<T>& args, const attention_params& params = {},
               const Backend& backend = Backend{}) {
  detail::check_attention_types<Kind, Policy, T, Backend>();
  const std::string fn = std::string("attnmix::attention<") + Kind::name + ">";
  const attention_problem prob = detail::validate_attention<Kind, T, Backend>(
      fn, args, params, Policy::mask == mask_type::causal);
  detail::attention_impl<Kind, Backend, Policy>::run(args, prob, backend);
}

}  // namespace attnmix
