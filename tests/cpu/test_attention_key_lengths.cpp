// Softmax and FoX with keys of other lengths than the queries (decoding and chunked prefill
// against a cache, cross-attention) on the CPU: against the float64 oracle, against the
// full-length call, and every check of the new arguments.

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "reference/softmax_reference.hpp"
#include "support/catch.hpp"
#include "support/testing.hpp"

using namespace attnmix_test;
using attnmix::host_tensor;
using attnmix::index_t;

namespace {

// Dense: B rows of T queries and Tk keys. Packed (cu non-empty): B = 1, the queries' offsets
// in cu and the keys' in cu_k (empty: the keys share cu).
struct key_case {
  index_t B, T, Tk, HQ, H, D, Dv;
  index_t window = 0;
  std::vector<std::int32_t> cu{}, cu_k{};
  int threads = 0;

  std::string describe() const {
    std::ostringstream os;
    os << "B=" << B << " T=" << T << " Tk=" << Tk << " HQ=" << HQ << " H=" << H << " D=" << D
       << " Dv=" << Dv << " window=" << window << " packed=" << cu.size()
       << " own key offsets=" << cu_k.size();
    return os.str();
  }
};

struct key_inputs {
  host_tensor<double, 4> q, k, v;
  host_tensor<double, 3> g;
};

template <class T>
host_tensor<T, 4> as(const host_tensor<double, 4>& x) {
  host_tensor<T, 4> y(x.shape());
  for (std::size_t i = 0; i < x.storage().size(); ++i)
    y.storage()[i] = static_cast<T>(x.storage()[i]);
  return y;
}

key_inputs random_inputs(const key_case& c, std::uint64_t salt) {
  rng r(salt);
  key_inputs in{
      host_tensor<double, 4>({c.B, c.T, c.HQ, c.D}), host_tensor<double, 4>({c.B, c.Tk, c.H, c.D}),
      host_tensor<double, 4>({c.B, c.Tk, c.H, c.Dv}), host_tensor<double, 3>({c.B, c.Tk, c.HQ})};
  r.fill_normal(in.q);
  r.fill_normal(in.k);
  r.fill_normal(in.v);
  r.fill_uniform(in.g, -0.3, -0.01);
  return in;
}

attnmix::attention_params params_of(const key_case& c) {
  attnmix::attention_params p;
  p.window = c.window;
  if (!c.cu.empty()) p.cu_seqlens = {c.cu.data(), {static_cast<index_t>(c.cu.size())}};
  if (!c.cu_k.empty()) p.cu_seqlens_k = {c.cu_k.data(), {static_cast<index_t>(c.cu_k.size())}};
  return p;
}

// out and lse of the library in T.
template <class Kind, class Policy, class T>
std::pair<std::vector<T>, std::vector<attnmix::accum_t<T>>> run(const key_case& c,
                                                                const key_inputs& in) {
  using A = attnmix::accum_t<T>;
  const host_tensor<T, 4> q = as<T>(in.q), k = as<T>(in.k), v = as<T>(in.v);
  host_tensor<A, 3> g({c.B, c.Tk, c.HQ});
  for (std::size_t i = 0; i < g.storage().size(); ++i)
    g.storage()[i] = static_cast<A>(in.g.storage()[i]);
  host_tensor<T, 4> out({c.B, c.T, c.HQ, c.Dv});
  host_tensor<A, 3> lse({c.B, c.T, c.HQ});
  poison(out);
  poison(lse);
  attnmix::attention_args<T> a{q.view(), k.view(), v.view(), out.view()};
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate) a.g = g.view();
  a.lse = lse.view();
  attnmix::attention<Kind, Policy>(a, params_of(c), attnmix::backend::cpu{c.threads});
  return {out.storage(), lse.storage()};
}

template <class Kind, class Policy>
attnmix_ref::attention_result oracle(const key_case& c, const key_inputs& in) {
  attnmix_ref::softmax_problem p{c.B, c.T, c.HQ, c.H, c.D, c.Dv, 1.0 / std::sqrt(double(c.D))};
  p.causal = Policy::mask == attnmix::mask_type::causal;
  p.window = c.window;
  p.Tk = c.Tk;
  p.cu_seqlens.assign(c.cu.begin(), c.cu.end());
  p.cu_seqlens_k.assign(c.cu_k.begin(), c.cu_k.end());
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate)
    p.gate = Policy::gate == attnmix::gate_scaling::after_scale
                 ? attnmix_ref::softmax_problem::gate_after_scale
                 : attnmix_ref::softmax_problem::gate_before_scale;
  return attnmix_ref::softmax_attention(p, in.q.storage(), in.k.storage(), in.v.storage(),
                                        in.g.storage());
}

// Causal shapes: every sequence has at least as many keys as queries.
std::vector<key_case> causal_cases() {
  return {
      {2, 1, 100, 4, 2, 16, 16},      // a decoding step
      {1, 1, 1, 1, 1, 8, 8},          // the first token
      {1, 17, 130, 4, 1, 32, 24},     // a chunk of a prefill, MQA, D != Dv
      {2, 64, 64, 2, 2, 16, 16},      // equal lengths
      {1, 70, 300, 2, 1, 16, 8, 32},  // window
      {1, 5, 200, 3, 3, 8, 8, 1},     // window of one: the query's own key
      {1, 12, 320, 4, 2, 16, 16, 0, {0, 1, 1, 6, 12}, {0, 50, 60, 66, 320}},  // packed
      {1, 20, 100, 2, 1, 16, 16, 9, {0, 10, 20}, {0, 40, 100}},               // packed, window
      {2, 33, 77, 2, 2, 8, 8, 0, {}, {}, 3},                                  // three threads
  };
}

// Bidirectional shapes may have fewer keys than queries (cross-attention).
std::vector<key_case> bidirectional_cases() {
  std::vector<key_case> cases = causal_cases();
  cases.push_back({2, 90, 7, 2, 1, 16, 32});
  cases.push_back({1, 30, 12, 2, 2, 8, 8, 0, {0, 25, 25, 30}, {0, 1, 11, 12}});
  return cases;
}

template <class Kind, class Policy, class T>
void sweep(const std::vector<key_case>& cases) {
  std::uint64_t salt = 0;
  for (const key_case& c : cases) {
    INFO("seed " << test_seed() << " " << c.describe() << " " << Kind::name << " mask "
                 << attnmix::to_string(Policy::mask));
    const key_inputs in = random_inputs(c, ++salt);
    const auto [out, lse] = run<Kind, Policy, T>(c, in);
    const auto ref = oracle<Kind, Policy>(c, in);
    CHECK(rel_error(out, ref.out) <= tolerance<T>());
    CHECK(lse_error(lse, ref.lse) <= tolerance<T>());
  }
}

struct tiny_tiles : attnmix::softmax_policy {
  static constexpr index_t block_q = 5, block_k = 3;
};
struct fox_gate_before_scale : attnmix::fox_policy {
  static constexpr attnmix::gate_scaling gate = attnmix::gate_scaling::before_scale;
};

}  // namespace

TEMPLATE_TEST_CASE("softmax with keys of other lengths matches the float64 oracle",
                   "[softmax][cpu][key_lengths]", float, double) {
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(causal_cases());
  sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, TestType>(
      bidirectional_cases());
  sweep<attnmix::kind::softmax, tiny_tiles, TestType>(causal_cases());
}

TEMPLATE_TEST_CASE("FoX with keys of other lengths matches the float64 oracle",
                   "[fox][cpu][key_lengths]", float, double) {
  sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(causal_cases());
  sweep<attnmix::kind::fox, fox_gate_before_scale, TestType>(causal_cases());
}

// A prefill in chunks against the growing cache gives the rows of the whole prefill.
TEST_CASE("a chunked causal prefill gives the whole prefill's rows", "[cpu][key_lengths]") {
  const key_case whole{2, 150, 150, 4, 2, 16, 16};
  const key_inputs in = random_inputs(whole, 7);
  const auto [out, lse] = run<attnmix::kind::fox, attnmix::fox_policy, double>(whole, in);
  index_t done = 0;
  for (const index_t chunk : {1, 40, 64, 45}) {
    INFO("seed " << test_seed() << " chunk of " << chunk << " after " << done);
    const key_case c{2, chunk, done + chunk, 4, 2, 16, 16};
    key_inputs part{host_tensor<double, 4>({2, chunk, 4, 16}),
                    host_tensor<double, 4>({2, done + chunk, 2, 16}),
                    host_tensor<double, 4>({2, done + chunk, 2, 16}),
                    host_tensor<double, 3>({2, done + chunk, 4})};
    for (index_t b = 0; b < 2; ++b) {
      for (index_t t = 0; t < chunk; ++t)
        for (index_t h = 0; h < 4; ++h)
          for (index_t d = 0; d < 16; ++d) part.q(b, t, h, d) = in.q(b, done + t, h, d);
      for (index_t t = 0; t < done + chunk; ++t) {
        for (index_t h = 0; h < 2; ++h)
          for (index_t d = 0; d < 16; ++d)
            part.k(b, t, h, d) = in.k(b, t, h, d), part.v(b, t, h, d) = in.v(b, t, h, d);
        for (index_t h = 0; h < 4; ++h) part.g(b, t, h) = in.g(b, t, h);
      }
    }
    const auto [o, l] = run<attnmix::kind::fox, attnmix::fox_policy, double>(c, part);
    double worst = 0;
    for (index_t b = 0; b < 2; ++b)
      for (index_t t = 0; t < chunk; ++t)
        for (index_t h = 0; h < 4; ++h) {
          const auto row = static_cast<std::size_t>((b * chunk + t) * 4 + h);
          const auto full = static_cast<std::size_t>((b * 150 + done + t) * 4 + h);
          worst = std::max(worst, std::abs(l[row] - lse[full]));
          for (index_t e = 0; e < 16; ++e)
            worst = std::max(worst, std::abs(o[row * 16 + e] - out[full * 16 + e]));
        }
    CHECK(worst <= 1e-12);
    done += chunk;
  }
}

TEST_CASE("key offsets equal to the queries' give the same bits as none", "[cpu][key_lengths]") {
  key_case c{1, 100, 100, 2, 1, 16, 16, 0, {0, 30, 30, 100}};
  const key_inputs in = random_inputs(c, 8);
  const auto plain = run<attnmix::kind::fox, attnmix::fox_policy, float>(c, in);
  c.cu_k = c.cu;
  const auto same = run<attnmix::kind::fox, attnmix::fox_policy, float>(c, in);
  CHECK(bitwise_equal(plain.first, same.first));
  CHECK(bitwise_equal(plain.second, same.second));
}

namespace {

// `call` throws attnmix::error whose message starts with fn and names arg, with `detail` in it.
template <class Call>
void expect_error(const std::string& fn, const std::string& arg, const std::string& detail,
                  Call&& call) {
  try {
    call();
    FAIL("no attnmix::error for argument '" << arg << "'");
  } catch (const attnmix::error& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.rfind(fn + ": argument '" + arg + "'", 0) == 0);
    CHECK(msg.find(detail) != std::string::npos);
  }
}

// A call with q [1, 12, 2, 8] and k, v, g of Tk tokens, whose params `modify` changes; it must
// throw naming fn and arg, with `detail` in the message, and leave out and lse untouched.
template <class Kind, class Policy = attnmix::default_policy_t<Kind>, class Modify>
void expect_rejected(const std::string& fn, const std::string& arg, const std::string& detail,
                     index_t Tk, Modify modify) {
  host_tensor<float, 4> q({1, 12, 2, 8}, 0.5f), k({1, Tk, 2, 8}, 0.25f), v({1, Tk, 2, 8}, 1.0f);
  host_tensor<float, 4> out({1, 12, 2, 8}, 42.0f);
  host_tensor<float, 3> g({1, Tk, 2}, -0.1f), lse({1, 12, 2}, 42.0f);
  host_tensor<float, 4> w({1, 12, 2, 8}, 0.1f);  // PaTH's parameters are the queries' own
  host_tensor<float, 3> beta({1, 12, 2}, 1.0f);
  attnmix::attention_args<float> a{q.view(), k.view(), v.view(), out.view()};
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate) a.g = g.view();
  if constexpr (attnmix::kind_traits<Kind>::uses_householder) a.w = w.view(), a.beta = beta.view();
  a.lse = lse.view();
  attnmix::attention_params p;
  std::vector<std::int32_t> cu, cu_k;
  modify(a, p, cu, cu_k);
  expect_error(fn, arg, detail, [&] { attnmix::attention<Kind, Policy>(a, p); });
  CHECK(bitwise_equal(out.storage(), std::vector<float>(out.storage().size(), 42.0f)));
  CHECK(bitwise_equal(lse.storage(), std::vector<float>(lse.storage().size(), 42.0f)));
}

auto offsets(std::vector<std::int32_t> q, std::vector<std::int32_t> k) {
  return [q, k](auto&, attnmix::attention_params& p, std::vector<std::int32_t>& cu,
                std::vector<std::int32_t>& cu_k) {
    cu = q, cu_k = k;
    if (!cu.empty()) p.cu_seqlens = {cu.data(), {static_cast<index_t>(cu.size())}};
    if (!cu_k.empty()) p.cu_seqlens_k = {cu_k.data(), {static_cast<index_t>(cu_k.size())}};
  };
}

}  // namespace

TEST_CASE("keys of other lengths: bad calls are rejected", "[errors][cpu][key_lengths]") {
  using attnmix::kind::fox;
  using attnmix::kind::softmax;
  const std::string sm = "attnmix::attention<softmax>", fx = "attnmix::attention<fox>";
  expect_rejected<softmax>(sm, "k", "has 5 keys for the 12 queries of sequence 0: causal", 5,
                           offsets({}, {}));
  expect_rejected<softmax, attnmix::bidirectional_softmax_policy>(
      sm, "k", "windowed queries are aligned with the last keys", 5,
      [](auto&, auto& p, auto&, auto&) { p.window = 3; });
  expect_rejected<softmax, attnmix::bidirectional_softmax_policy>(
      sm, "k", "has no keys for the 7 queries of sequence 1", 20, offsets({0, 5, 12}, {0, 20, 20}));
  expect_rejected<fox>(fx, "k", "needs cu_seqlens_k", 20, offsets({0, 5, 12}, {}));
  expect_rejected<fox>(fx, "cu_seqlens_k", "needs cu_seqlens", 20, offsets({}, {0, 20}));
  expect_rejected<fox>(fx, "cu_seqlens_k", "holds 2 offsets but cu_seqlens holds 3", 20,
                       offsets({0, 5, 12}, {0, 20}));
  expect_rejected<fox>(fx, "cu_seqlens_k", "ends at 19 but the packed length is 20", 20,
                       offsets({0, 5, 12}, {0, 10, 19}));
  expect_rejected<fox>(fx, "k", "has 4 keys for the 7 queries of sequence 1", 20,
                       offsets({0, 5, 12}, {0, 16, 20}));
  expect_rejected<fox>(fx, "g", "[B, Tk, HQ]", 20, [](auto& a, auto&, auto&, auto&) {
    a.g = attnmix::view3<const float>(a.g.data(), {1, 12, 2});
  });
  expect_rejected<attnmix::kind::path_fox>("attnmix::attention<path_fox>", "k",
                                           "must be [B, T, H, D] = [1, 12, 2, 8]", 20,
                                           offsets({}, {}));
  expect_rejected<attnmix::kind::path>("attnmix::attention<path>", "k",
                                       "has 6 keys for the 7 queries of sequence 1", 12,
                                       offsets({0, 5, 12}, {0, 6, 12}));
}

TEST_CASE("the backward takes no keys of other lengths", "[errors][cpu][key_lengths]") {
  const index_t T = 12;
  host_tensor<float, 4> q({1, T, 2, 8}, 0.5f), dq({1, T, 2, 8}, 42.0f);
  host_tensor<float, 4> dk({1, T, 2, 8}, 42.0f), dv({1, T, 2, 8}, 42.0f);
  host_tensor<float, 3> lse({1, T, 2}, 1.0f);
  attnmix::attention_grad_args<float> a;
  a.q = a.k = a.v = a.out = a.dout = q.view();
  a.lse = lse.view();
  a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view();
  const std::vector<std::int32_t> cu{0, 5, 12}, cu_k{0, 6, 12};
  attnmix::attention_params p;
  p.cu_seqlens = {cu.data(), {3}};
  p.cu_seqlens_k = {cu_k.data(), {3}};
  expect_error("attnmix::attention_backward<softmax>", "cu_seqlens_k", "the backward does not take",
               [&] { attnmix::attention_backward<attnmix::kind::softmax>(a, p); });
  CHECK(bitwise_equal(dq.storage(), std::vector<float>(dq.storage().size(), 42.0f)));
  p.cu_seqlens_k = {cu.data(), {3}};  // the queries' own offsets: accepted
  CHECK_NOTHROW(attnmix::attention_backward<attnmix::kind::softmax>(a, p));
}
