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

// Sizes every front door reads off q [B,T,HQ,D], k [Bk,Tk,H,D], v [Bk,Tk,H,Dv],
// out [B,T,HQ,Dv]. Tk == T and Bk == B unless the call takes keys of other lengths or from the
// slots of a cache (resolve_qkv).
struct qkv_sizes {
  index_t B, T, HQ, H, D, Dv, Tk, Bk;
};

// What k and v may be, beside q-shaped: of another length (Tk), and read from slots (Bk rows).
enum class key_shape { queries, other_lengths, slots };

// The shapes of k, v and a per-key gate g that messages name, for each key_shape.
struct key_shape_names {
  const char *k, *v, *g;
};
inline key_shape_names names_of(key_shape keys) {
  switch (keys) {
    case key_shape::slots:
      return {"[S, Tk, H, D]", "[S, Tk, H, Dv]", "[S, Tk, HQ]"};
    case key_shape::other_lengths:
      return {"[B, Tk, H, D]", "[B, Tk, H, Dv]", "[B, Tk, HQ]"};
    default:
      return {"[B, T, H, D]", "[B, T, H, Dv]", "[B, T, HQ]"};
  }
}

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
// expected shapes of k, v and out. k and v may have another T (Tk) than q unless `keys` is
// key_shape::queries, and another B (Bk, the slots) with key_shape::slots.
inline qkv_sizes resolve_qkv(const std::string& fn, arg_list& args,
                             key_shape keys = key_shape::queries) {
  const tensor_arg &q = args[0], &k = args[1], &v = args[2];
  const qkv_sizes s{q.shape[0],
                    q.shape[1],
                    q.shape[2],
                    k.shape[2],
                    q.shape[3],
                    v.shape[3],
                    keys != key_shape::queries ? k.shape[1] : q.shape[1],
                    keys == key_shape::slots ? k.shape[0] : q.shape[0]};
  const key_shape_names names = names_of(keys);
  require(s.HQ >= 1 && s.D >= 1, fn, "q", "must have at least one head and D >= 1 but has shape ",
          shape_of(q));
  require(s.H >= 1, fn, "k", "must have at least one head but has shape ", shape_of(k));
  require(s.HQ % s.H == 0, fn, "k", "has H = ", s.H,
          " heads, which does not divide the HQ = ", s.HQ, " heads of 'q'");
  args[1].expect(names.k, s.Bk, s.Tk, s.H, s.D);
  check_shapes(fn, {args[1]});
  require(s.Dv >= 1, fn, "v", "must have Dv >= 1 but has shape ", shape_of(v));
  args[2].expect(names.v, s.Bk, s.Tk, s.H, s.Dv);
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
  args.push_back(host_input("key_lengths", p.key_lengths, "key validation"));
  args.push_back(host_input("key_slots", p.key_slots, "key validation"));
  args.push_back(output("lse", a.lse));
  return args;
}

// The keys of every sequence: the offsets of a packed batch (cu_seqlens_k, or cu_seqlens when
// absent; cu_seqlens itself when the two hold the same offsets), the slots and the lengths read
// (key_slots, key_lengths), set in `prob`. Every sequence needs a key for each of its rows to
// see. Causal rows (and windowed ones) are aligned with the last keys, so they need at least as
// many keys as queries; bidirectional rows need one.
inline void resolve_keys(const std::string& fn, const attention_params& p, const qkv_sizes& s,
                         const packed_batch& packed, bool causal, attention_problem& prob) {
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
  const index_t N = packed.sequences;
  prob.key_tokens = s.Tk;
  prob.key_batch = s.Bk;
  prob.cu_seqlens_k = cu_k;
  if (p.key_slots.has_value()) {
    require(packed.cu_seqlens == nullptr, fn, "key_slots",
            "takes a dense batch (a packed one places its keys with cu_seqlens_k)");
    require(p.key_slots.extent(0) == N, fn, "key_slots", "holds ", p.key_slots.extent(0),
            " slots for a batch of ", N, " sequences");
    for (index_t n = 0; n < N; ++n)
      require(p.key_slots(n) >= 0 && p.key_slots(n) < s.Bk, fn, "key_slots", "[", n, "] is ",
              p.key_slots(n), ", not a row of k (S = ", s.Bk, ")");
    prob.key_slots = p.key_slots.data();
  }
  if (p.key_lengths.has_value()) {
    require(p.key_lengths.extent(0) == N, fn, "key_lengths", "holds ", p.key_lengths.extent(0),
            " lengths for a batch of ", N, " sequences");
    for (index_t n = 0; n < N; ++n) {
      const index_t most = sequence_at(cu_k, s.Tk, n).length;
      require(p.key_lengths(n) >= 0 && p.key_lengths(n) <= most, fn, "key_lengths", "[", n, "] is ",
              p.key_lengths(n), " but sequence ", n, " has ", most, " keys in k");
    }
    prob.key_lengths = p.key_lengths.data();
  }
  const bool need_all = causal || p.window > 0;
  const char* arg = p.key_lengths.has_value() ? "key_lengths" : "k";
  for (index_t n = 0; n < N; ++n) {
    const index_t queries = sequence_at(packed.cu_seqlens, s.T, n).length;
    const index_t keys = prob.key_seq(n).length;
    if (queries == 0) continue;
    if (need_all)
      require(keys >= queries, fn, arg, "gives ", keys, " keys for the ", queries,
              " queries of sequence ", n, ": ", causal ? "causal" : "windowed",
              " queries are aligned with the last keys and need at least as many");
    else
      require(keys >= 1, fn, arg, "gives no keys for the ", queries, " queries of sequence ", n);
  }
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
  resolve_keys(fn, p, s, packed, causal, prob);
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
  const key_shape keys = kind_traits<Kind>::uses_householder ? key_shape::queries
                         : p.key_slots.has_value()           ? key_shape::slots
                                                             : key_shape::other_lengths;
  const qkv_sizes s = resolve_qkv(fn, args, keys);
  find_arg(args, "g")->expect(names_of(keys).g, s.Bk, s.Tk, s.HQ);
  find_arg(args, "w")->expect("[B, T, H, D]", s.B, s.T, s.H, s.D);
  find_arg(args, "beta")->expect("[B, T, H]", s.B, s.T, s.H);
  find_arg(args, "lse")->expect("[B, T, HQ]", s.B, s.T, s.HQ);
  check_shapes(fn, args);
  check_outputs(fn, args);

  const attention_problem prob = resolve_attention_problem<Kind, T>(fn, s, p, causal);
  // (PaTH gets here only with key_lengths or key_slots: its k has the queries' T, and other
  // offsets of the same total give some sequence fewer keys than queries.)
  require(prob.keys_match_queries() || takes_key_lengths<Kind, Backend>::value, fn,
          p.key_slots.has_value()      ? "key_slots"
          : p.key_lengths.has_value()  ? "key_lengths"
          : p.cu_seqlens_k.has_value() ? "cu_seqlens_k"
                                       : "k",
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
