// Causal linear attention on the CPU: the chunked and recurrent forms against the float64
// oracle and each other, state continuation (chunked prefill, then decoding), and the
// bidirectional = forward + reverse - diagonal identity of spec gbla.md §4.

#include "cpu/test_linear_harness.hpp"

using namespace attnmix_test;
using attnmix::causal_form;
using attnmix::key_gate;
using attnmix::kind::linear_causal;

namespace {

template <class Policy, class T>
void sweep(const std::vector<linear_case>& cases, std::uint64_t salt, const char* what) {
  for (const linear_case& c : cases) {
    INFO("seed " << test_seed() << " " << c.describe() << " policy " << what);
    const linear_errors e = run_linear_case<linear_causal, Policy, T>(c, ++salt);
    CHECK(e.out <= tolerance<T>());
    CHECK(e.S <= tolerance<T>());
    CHECK(e.z <= tolerance<T>());
    CHECK(e.lse <= tolerance<T>());
  }
}

// The standard sweep, each case once fresh and once continuing from a random state.
std::vector<linear_case> causal_cases(index_t max_t) {
  std::vector<linear_case> cs;
  for (linear_case c : standard_linear_cases()) {
    if (c.T > max_t) continue;
    cs.push_back(c);
    c.with_state_in = true;
    cs.push_back(c);
  }
  return cs;
}

using recurrent = attnmix::with_causal_form<attnmix::linear_causal_policy, causal_form::recurrent>;
using chunk7 = attnmix::with_chunk<attnmix::linear_causal_policy, 7>;
using chunk1 = attnmix::with_chunk<attnmix::linear_causal_policy, 1>;
using gated = attnmix::with_key_gate<attnmix::linear_causal_policy, key_gate::shared>;
using gated_chunk5 = attnmix::with_chunk<gated, 5>;
using gated_recurrent = attnmix::with_key_gate<recurrent, key_gate::per_head>;
struct gated_normed : attnmix::with_key_gate<chunk7, key_gate::per_head> {
  static constexpr attnmix::gated_norm norm = attnmix::gated_norm::per_head;
};
struct full_width_recurrent : gated_recurrent {
  static constexpr attnmix::gated_norm norm = attnmix::gated_norm::full_width;
};
using unnormalised_identity =
    attnmix::with_normalize<attnmix::with_feature_map<chunk7, attnmix::feature_map::identity>,
                            false>;
using unnormalised_gated = attnmix::with_normalize<gated_chunk5, false>;

}  // namespace

TEMPLATE_TEST_CASE("causal chunked form matches the oracle", "[linear_causal][cpu]", float,
                   double) {
  sweep<attnmix::linear_causal_policy, TestType>(causal_cases(1000), 100, "chunk 64");
  sweep<chunk7, TestType>(causal_cases(300), 200, "chunk 7");
  sweep<chunk1, TestType>(causal_cases(130), 300, "chunk 1");
}

TEMPLATE_TEST_CASE("causal recurrent form matches the oracle", "[linear_causal][cpu]", float,
                   double) {
  sweep<recurrent, TestType>(causal_cases(300), 400, "recurrent");
}

TEMPLATE_TEST_CASE("causal key gate (prefix softmax) matches the oracle", "[linear_causal][cpu]",
                   float, double) {
  sweep<gated, TestType>(causal_cases(1000), 500, "gated chunk 64");
  sweep<gated_chunk5, TestType>(causal_cases(300), 600, "gated chunk 5");
  sweep<gated_recurrent, TestType>(causal_cases(300), 700, "gated recurrent, per head");
}

TEMPLATE_TEST_CASE("causal gated norm and normaliser-off variants match the oracle",
                   "[linear_causal][cpu]", float, double) {
  sweep<gated_normed, TestType>(causal_cases(300), 800, "gate + per-head norm");
  sweep<full_width_recurrent, TestType>(causal_cases(300), 900, "full-width norm, recurrent");
  sweep<unnormalised_identity, TestType>(causal_cases(300), 1000, "identity, no normaliser");
  sweep<unnormalised_gated, TestType>(causal_cases(300), 1100, "gated, no normaliser");
}

TEST_CASE("causal gate with a growing running max keeps float accuracy", "[linear_causal][cpu]") {
  // Logits rising steeply inside each chunk: every row has its own running max, and a shared
  // chunk max would underflow the early rows.
  linear_case c{1, 200, 2, 1, 16, 8};
  c.gate_sigma = 60;
  INFO("seed " << test_seed());
  CHECK(run_linear_case<linear_causal, gated, float>(c, 77).out <= 1e-5);
  CHECK(run_linear_case<linear_causal, gated_recurrent, float>(c, 78).out <= 1e-5);
}

TEMPLATE_TEST_CASE("chunked and recurrent forms agree", "[linear_causal][cpu]", float, double) {
  using T = TestType;
  for (const linear_case& c : causal_cases(300)) {
    INFO("seed " << test_seed() << " " << c.describe());
    rng r(2024);
    auto in = make_inputs<gated, T>(c, r);
    auto a1 = make_args<gated>(in, c);
    attnmix::linear_attention<linear_causal, gated_chunk5>(a1, make_params<T>(c));
    const std::vector<T> chunked = in.out.storage(), S1 = in.S_out.storage();
    poison(in.out), poison(in.S_out);
    using gated_rec = attnmix::with_key_gate<recurrent, key_gate::shared>;
    attnmix::linear_attention<linear_causal, gated_rec>(a1, make_params<T>(c));
    CHECK(rel_error(in.out.storage(), to_double(chunked)) <= 2 * tolerance<T>());
    CHECK(rel_error(in.S_out.storage(), to_double(S1)) <= 2 * tolerance<T>());
  }
}

namespace {

// View of tokens [t0, t0 + len) of a [B, T, ...] tensor, keeping its strides.
template <class V>
V token_slice(const V& full, index_t t0, index_t len) {
  auto shape = full.shape();
  shape[1] = len;
  return V(full.data() + t0 * full.stride(1), shape, full.strides());
}

template <class Policy, class T>
void check_continuation(index_t split) {
  linear_case c{3, 101, 4, 2, 16, 8, {}, padding::left};
  INFO("seed " << test_seed() << " split " << split);
  rng r(split + 5);
  auto in = make_inputs<Policy, T>(c, r);
  auto whole = make_args<Policy>(in, c);
  attnmix::linear_attention<linear_causal, Policy>(whole);
  const std::vector<T> out_whole = in.out.storage();
  const auto S_whole = in.S_out.storage();
  const auto z_whole = in.z_out.storage();
  const auto lse_whole = in.lse_out.storage();

  // Prefill [0, split) with the chunked form, then continue [split, T).
  poison(in.out), poison(in.S_out), poison(in.z_out), poison(in.lse_out);
  attnmix::host_tensor<attnmix::accum_t<T>, 4> S_mid(in.S_out.shape());
  attnmix::host_tensor<attnmix::accum_t<T>, 3> z_mid(in.z_out.shape());
  attnmix::host_tensor<attnmix::accum_t<T>, 2> lse_mid(in.lse_out.shape());
  auto first = whole;
  first.q = token_slice(whole.q, 0, split), first.k = token_slice(whole.k, 0, split);
  first.v = token_slice(whole.v, 0, split), first.out = token_slice(whole.out, 0, split);
  first.mask = {in.mask.data(), {c.B, split}, {c.T, 1}};
  if (whole.a.has_value()) first.a = token_slice(whole.a, 0, split);
  if (whole.gate.has_value()) first.gate = token_slice(whole.gate, 0, split);
  first.state_out = {S_mid.view(), z_mid.view(), {}};
  if (whole.a.has_value()) first.state_out.lse = lse_mid.view();
  attnmix::linear_attention<linear_causal, Policy>(first);

  auto second = whole;
  const index_t rest = c.T - split;
  second.q = token_slice(whole.q, split, rest), second.k = token_slice(whole.k, split, rest);
  second.v = token_slice(whole.v, split, rest), second.out = token_slice(whole.out, split, rest);
  second.mask = {in.mask.data() + split, {c.B, rest}, {c.T, 1}};
  if (whole.a.has_value()) second.a = token_slice(whole.a, split, rest);
  if (whole.gate.has_value()) second.gate = token_slice(whole.gate, split, rest);
  second.state_in = {S_mid.view(), z_mid.view(), {}};
  if (whole.a.has_value()) second.state_in.lse = lse_mid.view();
  attnmix::linear_attention<linear_causal, Policy>(second);

  CHECK(rel_error(in.out.storage(), to_double(out_whole)) <= tolerance<T>());
  CHECK(rel_error(in.S_out.storage(), to_double(S_whole)) <= tolerance<T>());
  CHECK(rel_error(in.z_out.storage(), to_double(z_whole)) <= tolerance<T>());
  if (whole.a.has_value()) {
    CHECK(lse_error(in.lse_out.storage(), to_double(lse_whole)) <= tolerance<T>());
  }
}

}  // namespace

TEMPLATE_TEST_CASE("prefill half, then continue from the state, equals the whole",
                   "[linear_causal][cpu]", float, double) {
  for (index_t split : {0, 1, 37, 64, 100, 101}) {
    check_continuation<attnmix::linear_causal_policy, TestType>(split);
    check_continuation<recurrent, TestType>(split);
    check_continuation<gated_chunk5, TestType>(split);
    check_continuation<gated_normed, TestType>(split);
  }
}

TEMPLATE_TEST_CASE("chunked prefill then token-by-token decoding with an in-place state",
                   "[linear_causal][cpu]", float, double) {
  using T = TestType;
  using A = attnmix::accum_t<T>;
  using prefill = attnmix::with_key_gate<attnmix::linear_causal_policy, key_gate::per_head>;
  using decode = gated_recurrent;
  const index_t B = 2, T_ = 90, HQ = 4, H = 2, D = 16, Dv = 8, P = 50;
  rng r(61);
  attnmix::host_tensor<T, 4> q({B, T_, HQ, D}), k({B, T_, H, D}), v({B, T_, H, Dv});
  attnmix::host_tensor<T, 4> whole({B, T_, HQ, Dv}), steps({B, T_, HQ, Dv});
  attnmix::host_tensor<A, 3> a({B, T_, H});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v), r.fill_normal(a, 2.0);
  poison(whole), poison(steps);
  attnmix::linear_attention_args<T> args{q.view(), k.view(), v.view(), whole.view()};
  args.a = a.view();
  attnmix::linear_attention<linear_causal, prefill>(args);

  attnmix::host_tensor<A, 4> S({B, H, D, Dv});
  attnmix::host_tensor<A, 3> z({B, H, D});
  attnmix::host_tensor<A, 2> lse({B, H});
  auto part = args;
  part.q = token_slice(args.q, 0, P), part.k = token_slice(args.k, 0, P);
  part.v = token_slice(args.v, 0, P), part.a = token_slice(args.a, 0, P);
  part.out = token_slice(steps.view(), 0, P);
  part.state_out = {S.view(), z.view(), lse.view()};
  attnmix::linear_attention<linear_causal, prefill>(part);
  for (index_t t = P; t < T_; ++t) {
    part.q = token_slice(args.q, t, 1), part.k = token_slice(args.k, t, 1);
    part.v = token_slice(args.v, t, 1), part.a = token_slice(args.a, t, 1);
    part.out = token_slice(steps.view(), t, 1);
    part.state_in = {S.view(), z.view(), lse.view()};  // updated in place
    attnmix::linear_attention<linear_causal, decode>(part);
  }
  INFO("seed " << test_seed());
  CHECK(rel_error(steps.storage(), to_double(whole.storage())) <= tolerance<T>());
}

TEMPLATE_TEST_CASE("bidirectional = forward-inclusive + reverse-inclusive - diagonal",
                   "[linear_causal][bla][cpu]", float, double) {
  using T = TestType;
  const index_t B = 2, T_ = 75, HQ = 4, H = 2, D = 16, Dv = 8, G = HQ / H;
  rng r(71);
  attnmix::host_tensor<T, 4> q({B, T_, HQ, D}), k({B, T_, H, D}), v({B, T_, H, Dv});
  attnmix::host_tensor<T, 4> ones({B, T_, H, 1}, T(1));
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v);
  // The same tokens in reverse order.
  attnmix::host_tensor<T, 4> qr(q.shape()), kr(k.shape()), vr(v.shape());
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < T_; ++t) {
      for (index_t h = 0; h < HQ; ++h)
        for (index_t d = 0; d < D; ++d) qr(b, t, h, d) = q(b, T_ - 1 - t, h, d);
      for (index_t h = 0; h < H; ++h) {
        for (index_t d = 0; d < D; ++d) kr(b, t, h, d) = k(b, T_ - 1 - t, h, d);
        for (index_t d = 0; d < Dv; ++d) vr(b, t, h, d) = v(b, T_ - 1 - t, h, d);
      }
    }
  // Numerators (normaliser off, scale 1); den - eps is the numerator with v = 1.
  using causal_num = attnmix::with_normalize<chunk7, false>;
  using bla_num = attnmix::with_normalize<attnmix::bla_policy, false>;
  attnmix::linear_attention_params unit;
  unit.scale = 1.0;
  auto run_causal = [&](auto& qq, auto& kk, auto& vv, index_t dv) {
    attnmix::host_tensor<T, 4> o({B, T_, HQ, dv});
    poison(o);
    attnmix::linear_attention<linear_causal, causal_num>(
        attnmix::linear_attention_args<T>{qq.view(), kk.view(), vv.view(), o.view()}, unit);
    return o;
  };
  const auto fwd = run_causal(q, k, v, Dv), rev = run_causal(qr, kr, vr, Dv);
  const auto fwd_den = run_causal(q, k, ones, 1), rev_den = run_causal(qr, kr, ones, 1);

  attnmix::host_tensor<T, 4> bi({B, T_, HQ, Dv}), bi_num({B, T_, HQ, Dv});
  poison(bi), poison(bi_num);
  attnmix::linear_attention<attnmix::kind::bla>(
      attnmix::linear_attention_args<T>{q.view(), k.view(), v.view(), bi.view()});
  attnmix::linear_attention<attnmix::kind::bla, bla_num>(
      attnmix::linear_attention_args<T>{q.view(), k.view(), v.view(), bi_num.view()}, unit);

  std::vector<double> num(bi.storage().size()), normalised(bi.storage().size());
  constexpr auto F = attnmix::feature_map::elu_plus_one;
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < T_; ++t)
      for (index_t hq = 0; hq < HQ; ++hq) {
        double diag = 0;  // phi(q_t) . phi(k_t)
        for (index_t d = 0; d < D; ++d)
          diag += attnmix::apply_feature_map<F>(double(q(b, t, hq, d))) *
                  attnmix::apply_feature_map<F>(double(k(b, t, hq / G, d)));
        const double den =
            double(fwd_den(b, t, hq, 0)) + double(rev_den(b, T_ - 1 - t, hq, 0)) - diag;
        for (index_t c = 0; c < Dv; ++c) {
          const std::size_t i = static_cast<std::size_t>(((b * T_ + t) * HQ + hq) * Dv + c);
          num[i] = double(fwd(b, t, hq, c)) + double(rev(b, T_ - 1 - t, hq, c)) -
                   diag * double(v(b, t, hq / G, c));
          normalised[i] = num[i] / (den + 1e-6);
        }
      }
  INFO("seed " << test_seed());
  CHECK(rel_error(bi_num.storage(), num) <= 4 * tolerance<T>());
  CHECK(rel_error(bi.storage(), normalised) <= 4 * tolerance<T>());
}
