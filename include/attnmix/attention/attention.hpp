#pragma once
// attnmix::attention: the front door of the softmax-family kinds (softmax, fox, path,
// path_fox). It validates every argument, then dispatches to detail::attention_impl of the
// chosen backend. Include the backend headers (attnmix/attnmix.hpp, attnmix/cuda.cuh) to use it.

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

// Sizes every front door reads off q [B,T,HQ,D], k [B,T,H,D], v [B,T,H,Dv], out [B,T,HQ,Dv].
struct qkv_sizes {
  index_t B, T, HQ, H, D, Dv;
};

// Checks q, k, v and out: given, laid out for and living where the backend needs them, their
// shapes consistent (HQ % H == 0), out free of self-overlap.
template <class Backend, class T>
qkv_sizes check_qkv_out(const std::string& fn, const view4<const T>& q, const view4<const T>& k,
                        const view4<const T>& v, const view4<T>& out) {
  constexpr memory_space space = space_of<Backend>;
  const char* be = Backend::name;
  check_given(fn, "q", q);
  check_given(fn, "k", k);
  check_given(fn, "v", v);
  check_given(fn, "out", out);
  check_tensor(fn, "q", q, space, be);
  check_tensor(fn, "k", k, space, be);
  check_tensor(fn, "v", v, space, be);
  check_tensor(fn, "out", out, space, be);
  const qkv_sizes s{q.extent(0), q.extent(1), q.extent(2), k.extent(2), q.extent(3), v.extent(3)};
  require(s.HQ >= 1 && s.D >= 1, fn, "q", "must have at least one head and D >= 1 but has shape ",
          shape_of(q));
  require(s.H >= 1, fn, "k", "must have at least one head but has shape ", shape_of(k));
  require(s.HQ % s.H == 0, fn, "k", "has H = ", s.H,
          " heads, which does not divide the HQ = ", s.HQ, " heads of 'q'");
  check_shape(fn, "k", k, {s.B, s.T, s.H, s.D}, "[B, T, H, D]");
  require(s.Dv >= 1, fn, "v", "must have Dv >= 1 but has shape ", shape_of(v));
  check_shape(fn, "v", v, {s.B, s.T, s.H, s.Dv}, "[B, T, H, Dv]");
  check_shape(fn, "out", out, {s.B, s.T, s.HQ, s.Dv}, "[B, T, HQ, Dv]");
  check_non_overlapping(fn, "out", out);
  return s;
}

// Checks packed-batch offsets (host memory, B == 1, 0 first, non-decreasing, T last).
// Returns them and the number of sequences; a dense batch (no offsets) has B sequences.
inline std::pair<const std::int32_t*, index_t> check_packed_batch(
    const std::string& fn, const view1<const std::int32_t>& cu_seqlens, const qkv_sizes& s) {
  if (!cu_seqlens.has_value()) return {nullptr, s.B};
  check_space(fn, "cu_seqlens", cu_seqlens, memory_space::host, "offset validation");
  require(s.B == 1, fn, "q", "must have B = 1 when cu_seqlens is given but has B = ", s.B);
  check_offsets(fn, "cu_seqlens", cu_seqlens, s.T);
  return {cu_seqlens.data(), cu_seqlens.extent(0) - 1};
}

// Checks everything attention() needs and returns the resolved sizes. Throws attnmix::error.
// The factor of (G_i - G_j) in the logits of the gated kinds: the softmax scale when the gate
// enters before it (PaTH-FoX's convention), else 1 (FoX's). Every backend uses this one.
template <class Policy>
double gate_coefficient(const attention_problem& p) {
  return Policy::gate == gate_scaling::before_scale ? p.scale : 1.0;
}

template <class Kind, class T, class Backend>
attention_problem validate_attention(const std::string& fn, const attention_args<T>& a,
                                     const attention_params& p) {
  constexpr memory_space space = space_of<Backend>;
  const char* be = Backend::name;
  const qkv_sizes sz = check_qkv_out<Backend>(fn, a.q, a.k, a.v, a.out);
  const index_t B = sz.B, T_ = sz.T, HQ = sz.HQ, H = sz.H, D = sz.D, Dv = sz.Dv;

  if constexpr (kind_traits<Kind>::uses_forget_gate) {
    check_given(fn, "g", a.g, "(the log forget gate) is required by this kind");
    check_tensor(fn, "g", a.g, space, be);
    check_shape(fn, "g", a.g, {B, T_, HQ}, "[B, T, HQ]");
  } else {
    check_not_given(fn, "g", a.g, "this kind has no forget gate");
  }
  if constexpr (kind_traits<Kind>::uses_householder) {
    check_given(fn, "w", a.w, "(the Householder directions) is required by this kind");
    check_given(fn, "beta", a.beta, "(the Householder strengths) is required by this kind");
    check_tensor(fn, "w", a.w, space, be);
    check_tensor(fn, "beta", a.beta, space, be);
    check_shape(fn, "w", a.w, {B, T_, H, D}, "[B, T, H, D]");
    check_shape(fn, "beta", a.beta, {B, T_, H}, "[B, T, H]");
  } else {
    check_not_given(fn, "w", a.w, "this kind has no Householder transforms");
    check_not_given(fn, "beta", a.beta, "this kind has no Householder transforms");
  }
  if (a.lse.has_value()) {
    check_tensor(fn, "lse", a.lse, space, be);
    check_shape(fn, "lse", a.lse, {B, T_, HQ}, "[B, T, HQ]");
    check_non_overlapping(fn, "lse", a.lse);
  }
  const auto no_alias = [&](const char* out_name, const auto& out) {
    check_no_alias(fn, out_name, out, "q", a.q);
    check_no_alias(fn, out_name, out, "k", a.k);
    check_no_alias(fn, out_name, out, "v", a.v);
    check_no_alias(fn, out_name, out, "g", a.g);
    check_no_alias(fn, out_name, out, "w", a.w);
    check_no_alias(fn, out_name, out, "beta", a.beta);
  };
  no_alias("out", a.out);
  no_alias("lse", a.lse);
  check_no_alias(fn, "lse", a.lse, "out", a.out);

  const double scale = p.scale ? *p.scale : 1.0 / std::sqrt(static_cast<double>(D));
  require(std::isfinite(scale), fn, "scale", "must be finite but is ", scale);
  require(p.window >= 0, fn, "window", "must be >= 0 (0: no window) but is ", p.window);
  if constexpr (kind_traits<Kind>::uses_householder)
    require(p.window == 0, fn, "window", "must be 0: PaTH has no sliding window, but is ",
            p.window);

  const auto [cu, sequences] = check_packed_batch(fn, p.cu_seqlens, sz);
  return {B, T_, HQ, H, D, Dv, scale, p.window, cu, sequences};
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
  static_assert(kind_traits<Kind>::softmax_family,
                "attnmix::attention: Kind must be kind::softmax, fox, path or path_fox");
  static_assert(is_scalar_v<T>, "attnmix::attention: T must be float, double, half or bfloat16");
  static_assert(is_backend_v<Backend>, "attnmix::attention: Backend must be a backend tag (a name and a memory_space)");
  static_assert(std::is_same_v<Kind, kind::softmax> || Policy::mask == mask_type::causal,
                "attnmix::attention: fox, path and path_fox are causal only; only kind::softmax "
                "takes mask_type::bidirectional");
  const std::string fn = std::string("attnmix::attention<") + Kind::name + ">";
  const attention_problem prob = detail::validate_attention<Kind, T, Backend>(fn, args, params);
  detail::attention_impl<Kind, Backend, Policy>::run(args, prob, backend);
}

}  // namespace attnmix
