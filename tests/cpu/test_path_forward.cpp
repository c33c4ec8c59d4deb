// PaTH and PaTH-FoX forward on the CPU: the two float64 oracles against each other, then the
// blocked forward against them for every chunk size, and the beta = 0 identities.

#include <array>
#include <limits>
#include <string>

#include "cpu/test_path_harness.hpp"

using namespace attnmix_test;
using attnmix::gate_scaling;
using attnmix::kind::path;
using attnmix::kind::path_fox;
using gate_mode = attnmix_ref::path_problem::gate_mode;

namespace {

// Lengths off every chunk size, T = 1, T < C, GQA and MQA, D != Dv, varlen with empty and
// length-1 sequences, the beta ranges of the spec, several thread counts.
std::vector<path_case> forward_cases() {
  return {
      {1, 1, 1, 1, 8, 8},
      {2, 13, 4, 2, 16, 8, {}, beta_range::near_two},
      {1, 63, 4, 2, 32, 16},
      {2, 65, 2, 2, 64, 64, {}, beta_range::uniform, 1},
      {1, 129, 3, 3, 16, 24, {}, beta_range::near_zero},
      {1, 200, 4, 1, 32, 16, {}, beta_range::near_two},
      {1, 150, 2, 2, 64, 32, {}, beta_range::exactly_two},
      {1, 200, 4, 2, 32, 16, {0, 0, 1, 64, 64, 130, 200}},
      {1, 150, 2, 1, 16, 16, {0, 70, 71, 150}, beta_range::near_two, 3},
      {3, 40, 2, 2, 8, 8, {}, beta_range::uniform, 3},
      {1, 0, 2, 1, 8, 8, {0, 0}},
      {1, 600, 2, 1, 64, 32, {}, beta_range::near_two},
  };
}

template <class Kind, class Policy, class T>
void check_against(const path_case& c, const path_inputs& in, const attnmix_ref::path_result& ref,
                   const char* label) {
  const path_outputs o = run_path_forward<Kind, Policy, T>(c, in);
  INFO(label << " chunk=" << Policy::chunk << " type=" << (sizeof(T) == 8 ? "double" : "float"));
  CHECK(rel_error(o.out, ref.out) <= tolerance<T>());
  CHECK(lse_error(o.lse, ref.lse) <= tolerance<T>());
}

// Every chunk size and both scalar types against one oracle result.
template <class Kind, class Policy>
void check_all_chunks(const path_case& c, const path_inputs& in, const char* label) {
  const auto ref = attnmix_ref::path_query_scan(path_oracle_problem(c, oracle_gate<Kind, Policy>()),
                                                in.q, in.k, in.v, in.w, in.beta, in.g);
  check_against<Kind, with_chunk<Policy, 16>, double>(c, in, ref, label);
  check_against<Kind, with_chunk<Policy, 32>, double>(c, in, ref, label);
  check_against<Kind, with_chunk<Policy, 64>, double>(c, in, ref, label);
  check_against<Kind, with_chunk<Policy, 128>, double>(c, in, ref, label);
  check_against<Kind, with_chunk<Policy, 16>, float>(c, in, ref, label);
  check_against<Kind, with_chunk<Policy, 32>, float>(c, in, ref, label);
  check_against<Kind, with_chunk<Policy, 64>, float>(c, in, ref, label);
  check_against<Kind, with_chunk<Policy, 128>, float>(c, in, ref, label);
}

}  // namespace

TEST_CASE("the two PaTH oracles agree", "[path][cpu][oracle]") {
  const std::vector<path_case> cases = {
      {1, 1, 1, 1, 4, 4},
      {2, 17, 4, 2, 8, 5, {}, beta_range::near_two},
      {1, 40, 2, 1, 6, 3, {0, 0, 1, 20, 40}, beta_range::exactly_two},
      {1, 33, 3, 3, 5, 7},
  };
  std::uint64_t salt = 10;
  for (const path_case& c : cases)
    for (gate_mode gate :
         {gate_mode::no_gate, gate_mode::gate_before_scale, gate_mode::gate_after_scale}) {
      INFO("seed " << test_seed() << " " << c.describe() << " gate mode " << int(gate));
      const path_inputs in = make_path_inputs(c, ++salt);
      const auto p = path_oracle_problem(c, gate);
      const auto a = attnmix_ref::path_query_scan(p, in.q, in.k, in.v, in.w, in.beta, in.g);
      const auto b = attnmix_ref::path_key_recurrence(p, in.q, in.k, in.v, in.w, in.beta, in.g);
      CHECK(rel_error(a.out, b.out) <= 1e-13);
      CHECK(rel_error(a.lse, b.lse) <= 1e-13);
    }
}

TEST_CASE("the PaTH oracles follow the spec's score ordering", "[path][cpu][oracle]") {
  // T = 3, one head: l_20 = q_2^T H_2 H_1 k_0 with explicit 3 x 3 matrices; the diagonal has no H.
  const long D = 3;
  const std::vector<double> q = {0, 0, 0, 0, 0, 0, 0.3, -0.2, 0.9};
  const std::vector<double> k = {1.0, 0.5, -0.7, 0.2, 0.1, 0.4, -0.3, 0.8, 0.6};
  const std::vector<double> v = {1, 0, 0, 0, 1, 0, 0, 0, 1};
  std::vector<double> w = {0.6, 0.0, 0.8, 0.0, 1.0, 0.0, 0.48, 0.6, 0.64};
  const std::vector<double> beta = {1.7, 0.9, 1.3};
  auto H = [&](long t, long r, long c) {
    return (r == c ? 1.0 : 0.0) - beta[t] * w[t * D + r] * w[t * D + c];
  };
  double l[3] = {0, 0, 0};  // l_2j for j = 0, 1, 2
  for (long j = 0; j < 3; ++j) {
    std::vector<double> x(k.begin() + j * D, k.begin() + (j + 1) * D);
    for (long t = j + 1; t <= 2; ++t) {  // x <- H_t x, ascending t: H_2 ... H_{j+1} k_j
      std::vector<double> y(D, 0.0);
      for (long r = 0; r < D; ++r)
        for (long c = 0; c < D; ++c) y[r] += H(t, r, c) * x[c];
      x = y;
    }
    for (long d = 0; d < D; ++d) l[j] += q[2 * D + d] * x[d];
  }
  const attnmix_ref::path_problem p{1, 3, 1, 1, D, D, 1.0};
  const auto ref = attnmix_ref::path_key_recurrence(p, q, k, v, w, beta);
  double z[3], zmax = -1e300, sum = 0;
  for (int j = 0; j < 3; ++j) z[j] = l[j], zmax = std::max(zmax, z[j]);
  for (int j = 0; j < 3; ++j) sum += std::exp(z[j] - zmax);
  for (int j = 0; j < 3; ++j)
    CHECK(std::abs(ref.out[2 * D + j] - std::exp(z[j] - zmax) / sum) < 1e-14);
  CHECK(std::abs(attnmix_ref::path_query_scan(p, q, k, v, w, beta).lse[2] -
                 (zmax + std::log(sum))) < 1e-14);
}

TEST_CASE("PaTH forward matches the oracle for every chunk size", "[path][cpu]") {
  std::uint64_t salt = 1000;
  for (const path_case& c : forward_cases()) {
    INFO("seed " << test_seed() << " " << c.describe());
    check_all_chunks<path, attnmix::path_policy>(c, make_path_inputs(c, ++salt), "path");
  }
}

TEST_CASE("PaTH-FoX forward matches the oracle, gate before the scale", "[path_fox][cpu]") {
  std::uint64_t salt = 2000;
  for (path_case c : forward_cases()) {
    INFO("seed " << test_seed() << " " << c.describe());
    check_all_chunks<path_fox, attnmix::path_fox_policy>(c, make_path_inputs(c, ++salt), "before");
  }
}

TEST_CASE("PaTH-FoX forward matches the oracle, gate after the scale", "[path_fox][cpu]") {
  using after = attnmix::with_gate_scaling<attnmix::path_fox_policy, gate_scaling::after_scale>;
  std::uint64_t salt = 3000;
  for (path_case c : forward_cases()) {
    c.gate_lo = std::log(0.5);  // strong forgetting: the convention makes a visible difference
    INFO("seed " << test_seed() << " " << c.describe());
    check_all_chunks<path_fox, after>(c, make_path_inputs(c, ++salt), "after");
  }
}

TEMPLATE_TEST_CASE("beta = 0 reduces PaTH to softmax attention and PaTH-FoX to FoX", "[path][cpu]",
                   float, double) {
  using T = TestType;
  path_case c{2, 150, 4, 2, 32, 16};
  c.beta = beta_range::zero;
  INFO("seed " << test_seed() << " " << c.describe());
  const path_inputs in = make_path_inputs(c, 77);
  const auto pair = [&](auto kind_path, auto kind_peer, auto policy_path, auto policy_peer) {
    using KP = decltype(kind_path);
    using KS = decltype(kind_peer);
    path_tensors<T> a(c, in), b(c, in);
    attnmix::attention<KP, decltype(policy_path)>(a.template args<KP>());
    attnmix::attention<KS, decltype(policy_peer)>(b.template args<KS>());
    CHECK(rel_error(a.out.storage(), to_double(b.out.storage())) <= tolerance<T>());
    CHECK(rel_error(a.lse.storage(), to_double(b.lse.storage())) <= tolerance<T>());
  };
  using before_fox = attnmix::with_gate_scaling<attnmix::fox_policy, gate_scaling::before_scale>;
  using after_path =
      attnmix::with_gate_scaling<attnmix::path_fox_policy, gate_scaling::after_scale>;
  pair(path{}, attnmix::kind::softmax{}, attnmix::path_policy{}, attnmix::softmax_policy{});
  pair(path_fox{}, attnmix::kind::fox{}, attnmix::path_fox_policy{}, before_fox{});
  pair(path_fox{}, attnmix::kind::fox{}, after_path{}, attnmix::fox_policy{});
}

TEST_CASE("PaTH-FoX forward reads and writes strided views", "[path_fox][cpu]") {
  // Every tensor lives inside a padded buffer: rows and heads further apart than dense.
  const path_case c{2, 70, 4, 2, 16, 8};
  INFO("seed " << test_seed() << " " << c.describe());
  const path_inputs in = make_path_inputs(c, 91);
  const index_t pad = 3;
  auto padded4 = [&](const std::vector<double>& x, index_t heads, index_t dim) {
    std::vector<double> y(static_cast<std::size_t>(c.B * c.T * heads * (dim + pad)), -7.0);
    for (index_t row = 0; row < c.B * c.T * heads; ++row)
      for (index_t d = 0; d < dim; ++d) y[row * (dim + pad) + d] = x[row * dim + d];
    return y;
  };
  auto strides4 = [&](index_t heads, index_t dim) {
    return std::array<index_t, 4>{c.T * heads * (dim + pad), heads * (dim + pad), dim + pad, 1};
  };
  auto padded3 = [&](const std::vector<double>& x, index_t heads) {  // one spare per token
    std::vector<double> y(static_cast<std::size_t>(c.B * c.T * (heads + 1)), -7.0);
    for (index_t tok = 0; tok < c.B * c.T; ++tok)
      for (index_t h = 0; h < heads; ++h) y[tok * (heads + 1) + h] = x[tok * heads + h];
    return y;
  };
  const auto q = padded4(in.q, c.HQ, c.D), k = padded4(in.k, c.H, c.D),
             v = padded4(in.v, c.H, c.Dv);
  const auto w = padded4(in.w, c.H, c.D), beta = padded3(in.beta, c.H), g = padded3(in.g, c.HQ);
  std::vector<double> out(static_cast<std::size_t>(c.B * c.T * c.HQ * (c.Dv + pad)),
                          std::numeric_limits<double>::quiet_NaN());
  std::vector<double> lse(static_cast<std::size_t>(c.B * c.T * (c.HQ + 1)),
                          std::numeric_limits<double>::quiet_NaN());
  for (std::size_t i = 0; i < out.size(); ++i)
    if (i % (c.Dv + pad) >= static_cast<std::size_t>(c.Dv)) out[i] = -7.0;
  for (std::size_t i = c.HQ; i < lse.size(); i += c.HQ + 1) lse[i] = -7.0;
  using attnmix::view3;
  using attnmix::view4;
  attnmix::attention_args<double> a{
      view4<const double>(q.data(), {c.B, c.T, c.HQ, c.D}, strides4(c.HQ, c.D)),
      view4<const double>(k.data(), {c.B, c.T, c.H, c.D}, strides4(c.H, c.D)),
      view4<const double>(v.data(), {c.B, c.T, c.H, c.Dv}, strides4(c.H, c.Dv)),
      view4<double>(out.data(), {c.B, c.T, c.HQ, c.Dv}, strides4(c.HQ, c.Dv))};
  a.w = view4<const double>(w.data(), {c.B, c.T, c.H, c.D}, strides4(c.H, c.D));
  a.beta = view3<const double>(beta.data(), {c.B, c.T, c.H}, {c.T * (c.H + 1), c.H + 1, 1});
  a.g = view3<const double>(g.data(), {c.B, c.T, c.HQ}, {c.T * (c.HQ + 1), c.HQ + 1, 1});
  a.lse = view3<double>(lse.data(), {c.B, c.T, c.HQ}, {c.T * (c.HQ + 1), c.HQ + 1, 1});
  attnmix::attention<path_fox, with_chunk<attnmix::path_fox_policy, 16>>(a);

  const auto ref = attnmix_ref::path_query_scan(
      path_oracle_problem(c, gate_mode::gate_before_scale), in.q, in.k, in.v, in.w, in.beta, in.g);
  std::vector<double> dense_out, dense_lse;
  bool padding_kept = true;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (i % (c.Dv + pad) < static_cast<std::size_t>(c.Dv))
      dense_out.push_back(out[i]);
    else
      padding_kept = padding_kept && out[i] == -7.0;
  }
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (i % (c.HQ + 1) != static_cast<std::size_t>(c.HQ))
      dense_lse.push_back(lse[i]);
    else
      padding_kept = padding_kept && lse[i] == -7.0;
  }
  CHECK(padding_kept);
  CHECK(rel_error(dense_out, ref.out) <= tolerance<double>());
  CHECK(rel_error(dense_lse, ref.lse) <= tolerance<double>());
}

TEST_CASE("PaTH-FoX keeps float accuracy over a long sequence", "[path_fox][cpu]") {
  // ~50 chunk products in a row with eigenvalues near -1, and G down to about -300.
  path_case c{1, 3000, 1, 1, 32, 32, {}, beta_range::near_two};
  c.gate_lo = -0.2, c.gate_hi = 0.0;
  INFO("seed " << test_seed() << " " << c.describe());
  const path_inputs in = make_path_inputs(c, 31);
  const auto ref = attnmix_ref::path_query_scan(
      path_oracle_problem(c, gate_mode::gate_before_scale), in.q, in.k, in.v, in.w, in.beta, in.g);
  const path_outputs o = run_path_forward<path_fox, attnmix::path_fox_policy, float>(c, in);
  CHECK(rel_error(o.out, ref.out) <= tolerance<float>());
  CHECK(lse_error(o.lse, ref.lse) <= tolerance<float>());
}
