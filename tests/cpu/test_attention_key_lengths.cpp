// Softmax and FoX with keys of other lengths than the queries (decoding and chunked prefill
// against a cache, cross-attention) and with keys read from the slots of a cache (key_slots,
// key_lengths) on the CPU: forward and backward against the float64 oracles, against the
// full-length call, and every check of the new arguments.

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "reference/softmax_backward_reference.hpp"
#include "reference/softmax_reference.hpp"
#include "support/catch.hpp"
#include "support/errors.hpp"
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

// The oracles' description of a case under Kind and Policy.
template <class Kind, class Policy>
attnmix_ref::softmax_problem oracle_problem(const key_case& c) {
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
  return p;
}

template <class Kind, class Policy>
attnmix_ref::attention_result oracle(const key_case& c, const key_inputs& in) {
  return attnmix_ref::softmax_attention(oracle_problem<Kind, Policy>(c), in.q.storage(),
                                        in.k.storage(), in.v.storage(), in.g.storage());
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

// Queries of N sequences against the slots of a cache: k, v [S, capacity, H, *], g [S, capacity,
// HQ]; sequence n reads the first lengths[n] keys of slot slots[n]. Dense queries [N, T, ...], or
// packed (cu) against packed keys (cu_k, lengths within each range; slots then empty).
struct slot_case {
  index_t N, T, S, capacity, HQ, H, D, Dv;
  std::vector<std::int32_t> slots, lengths;
  index_t window = 0;
  std::vector<std::int32_t> cu{}, cu_k{};

  std::string describe() const {
    std::ostringstream os;
    os << "N=" << N << " T=" << T << " S=" << S << " capacity=" << capacity << " HQ=" << HQ
       << " H=" << H << " D=" << D << " Dv=" << Dv << " window=" << window
       << " packed=" << cu.size() << " slots";
    for (auto x : slots) os << " " << x;
    os << " lengths";
    for (auto x : lengths) os << " " << x;
    return os.str();
  }
};

// The library on the cache against the oracle on each sequence's keys gathered into a packed
// batch (dense queries are a packed batch of equal lengths).
template <class Kind, class Policy, class T>
void check_slots(const slot_case& c, std::uint64_t salt) {
  using A = attnmix::accum_t<T>;
  INFO("seed " << test_seed() << " " << c.describe() << " " << Kind::name);
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  const bool packed = !c.cu.empty();
  const index_t B = packed ? 1 : c.N;  // q: [B, c.T, HQ, D]
  rng r(salt);
  host_tensor<double, 4> q({B, c.T, c.HQ, c.D}), k({c.S, c.capacity, c.H, c.D}),
      v({c.S, c.capacity, c.H, c.Dv});
  host_tensor<double, 3> g({c.S, c.capacity, c.HQ});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v);
  r.fill_uniform(g, -0.3, -0.01);

  // The library.
  const host_tensor<T, 4> qt = as<T>(q), kt = as<T>(k), vt = as<T>(v);
  host_tensor<A, 3> gt(g.shape());
  for (std::size_t i = 0; i < g.storage().size(); ++i) gt.storage()[i] = A(g.storage()[i]);
  host_tensor<T, 4> out({B, c.T, c.HQ, c.Dv});
  host_tensor<A, 3> lse({B, c.T, c.HQ});
  poison(out), poison(lse);
  attnmix::attention_args<T> a{qt.view(), kt.view(), vt.view(), out.view()};
  if constexpr (gated) a.g = gt.view();
  a.lse = lse.view();
  attnmix::attention_params p;
  p.window = c.window;
  if (packed) {
    p.cu_seqlens = {c.cu.data(), {index_t(c.cu.size())}};
    p.cu_seqlens_k = {c.cu_k.data(), {index_t(c.cu_k.size())}};
  }
  if (!c.slots.empty()) p.key_slots = {c.slots.data(), {c.N}};
  p.key_lengths = {c.lengths.data(), {c.N}};
  attnmix::attention<Kind, Policy>(a, p);

  // The oracle on the gathered keys.
  std::vector<std::int32_t> cu{0}, cu_k{0};
  std::vector<double> kk, vv, gg;
  for (index_t n = 0; n < c.N; ++n) {
    const index_t len = c.lengths[std::size_t(n)];
    const index_t slot = packed ? 0 : c.slots.empty() ? n : c.slots[std::size_t(n)];
    const index_t start = packed ? c.cu_k[std::size_t(n)] : 0;
    for (index_t t = start; t < start + len; ++t) {
      for (index_t h = 0; h < c.H; ++h) {
        for (index_t d = 0; d < c.D; ++d) kk.push_back(k(slot, t, h, d));
        for (index_t d = 0; d < c.Dv; ++d) vv.push_back(v(slot, t, h, d));
      }
      for (index_t h = 0; h < c.HQ; ++h) gg.push_back(g(slot, t, h));
    }
    cu.push_back(packed ? c.cu[std::size_t(n) + 1] : std::int32_t((n + 1) * c.T));
    cu_k.push_back(cu_k.back() + std::int32_t(len));
  }
  attnmix_ref::softmax_problem rp{1, B * c.T, c.HQ, c.H, c.D, c.Dv, 1.0 / std::sqrt(double(c.D))};
  rp.causal = Policy::mask == attnmix::mask_type::causal;
  rp.window = c.window;
  rp.Tk = cu_k.back();
  rp.cu_seqlens.assign(cu.begin(), cu.end());
  rp.cu_seqlens_k.assign(cu_k.begin(), cu_k.end());
  if constexpr (gated) rp.gate = attnmix_ref::softmax_problem::gate_after_scale;
  const auto ref = attnmix_ref::softmax_attention(rp, q.storage(), kk, vv, gg);
  CHECK(rel_error(out.storage(), ref.out) <= tolerance<T>());
  CHECK(lse_error(lse.storage(), ref.lse) <= tolerance<T>());
}

std::vector<slot_case> causal_slot_cases() {
  return {
      {3, 1, 5, 40, 4, 2, 16, 16, {4, 0, 2}, {17, 1, 40}},    // a decoding step
      {3, 1, 5, 40, 4, 2, 16, 8, {4, 0, 2}, {17, 1, 40}, 8},  // with a window
      {2, 6, 3, 64, 2, 1, 8, 8, {1, 1}, {10, 64}},            // a chunk; one slot shared
      {2, 1, 2, 30, 2, 2, 8, 8, {}, {30, 9}},                 // lengths only
      {3, 8, 1, 90, 2, 1, 16, 16, {}, {4, 20, 8}, 0, {0, 0, 4, 8}, {0, 30, 60, 90}},  // packed
  };
}

}  // namespace

TEMPLATE_TEST_CASE("attention reads the slots of a cache as the oracle its gathered keys",
                   "[softmax][fox][cpu][key_lengths]", float, double) {
  std::uint64_t salt = 100;
  for (const slot_case& c : causal_slot_cases()) {
    check_slots<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(c, ++salt);
    check_slots<attnmix::kind::fox, attnmix::fox_policy, TestType>(c, ++salt);
  }
  // Cross-attention to the first keys of each slot, fewer than the queries.
  const slot_case cross{2, 9, 3, 20, 2, 1, 8, 8, {2, 0}, {3, 20}};
  check_slots<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, TestType>(cross, 1);
}

TEST_CASE("a decoding step from the slots gives the row of the whole forward",
          "[fox][cpu][key_lengths]") {
  // The last token of each sequence, decoded against its slot, against the forward of all.
  const key_case whole{2, 50, 50, 4, 2, 16, 16};
  const key_inputs in = random_inputs(whole, 9);
  const auto [out, lse] = run<attnmix::kind::fox, attnmix::fox_policy, float>(whole, in);
  // Slot 2 - b holds sequence b (slot 0 stays empty), with room to spare.
  const index_t cap = 64;
  host_tensor<float, 4> q({2, 1, 4, 16}), k({3, cap, 2, 16}, 7.0f), v({3, cap, 2, 16}, 7.0f);
  host_tensor<float, 3> g({3, cap, 4}, -1.0f);
  for (index_t b = 0; b < 2; ++b) {
    for (index_t h = 0; h < 4; ++h)
      for (index_t d = 0; d < 16; ++d) q(b, 0, h, d) = float(in.q(b, 49, h, d));
    for (index_t t = 0; t < 50; ++t) {
      for (index_t h = 0; h < 2; ++h)
        for (index_t d = 0; d < 16; ++d)
          k(2 - b, t, h, d) = float(in.k(b, t, h, d)), v(2 - b, t, h, d) = float(in.v(b, t, h, d));
      for (index_t h = 0; h < 4; ++h) g(2 - b, t, h) = float(in.g(b, t, h));
    }
  }
  host_tensor<float, 4> o({2, 1, 4, 16});
  host_tensor<float, 3> l({2, 1, 4});
  attnmix::attention_args<float> a{q.view(), k.view(), v.view(), o.view()};
  a.g = g.view(), a.lse = l.view();
  const std::vector<std::int32_t> slots{2, 1}, lengths{50, 50};
  attnmix::attention_params p;
  p.key_slots = {slots.data(), {2}};
  p.key_lengths = {lengths.data(), {2}};
  attnmix::attention<attnmix::kind::fox>(a, p);
  double worst = 0;
  for (index_t b = 0; b < 2; ++b)
    for (index_t h = 0; h < 4; ++h) {
      const auto full = std::size_t((b * 50 + 49) * 4 + h), row = std::size_t(b * 4 + h);
      worst = std::max(worst, double(std::abs(l.storage()[row] - lse[full])));
      for (index_t e = 0; e < 16; ++e)
        worst = std::max(worst, double(std::abs(o.storage()[row * 16 + e] - out[full * 16 + e])));
    }
  CHECK(worst <= 1e-5);
}

namespace {

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
  expect_rejected<softmax>(sm, "k", "gives 5 keys for the 12 queries of sequence 0: causal", 5,
                           offsets({}, {}));
  expect_rejected<softmax, attnmix::bidirectional_softmax_policy>(
      sm, "k", "windowed queries are aligned with the last keys", 5,
      [](auto&, auto& p, auto&, auto&) { p.window = 3; });
  expect_rejected<softmax, attnmix::bidirectional_softmax_policy>(
      sm, "k", "gives no keys for the 7 queries of sequence 1", 20,
      offsets({0, 5, 12}, {0, 20, 20}));
  expect_rejected<fox>(fx, "k", "needs cu_seqlens_k", 20, offsets({0, 5, 12}, {}));
  expect_rejected<fox>(fx, "cu_seqlens_k", "needs cu_seqlens", 20, offsets({}, {0, 20}));
  expect_rejected<fox>(fx, "cu_seqlens_k", "holds 2 offsets but cu_seqlens holds 3", 20,
                       offsets({0, 5, 12}, {0, 20}));
  expect_rejected<fox>(fx, "cu_seqlens_k", "ends at 19 but the packed length is 20", 20,
                       offsets({0, 5, 12}, {0, 10, 19}));
  expect_rejected<fox>(fx, "k", "gives 4 keys for the 7 queries of sequence 1", 20,
                       offsets({0, 5, 12}, {0, 16, 20}));
  expect_rejected<fox>(fx, "g", "[B, Tk, HQ]", 20, [](auto& a, auto&, auto&, auto&) {
    a.g = attnmix::view3<const float>(a.g.data(), {1, 12, 2});
  });
  expect_rejected<attnmix::kind::path_fox>("attnmix::attention<path_fox>", "k",
                                           "must be [B, T, H, D] = [1, 12, 2, 8]", 20,
                                           offsets({}, {}));
  expect_rejected<attnmix::kind::path>("attnmix::attention<path>", "k",
                                       "gives 6 keys for the 7 queries of sequence 1", 12,
                                       offsets({0, 5, 12}, {0, 6, 12}));
}

namespace {

// The library's forward (out, lse) and backward on the case's keys, against the float64 reverse
// pass; with `resets`, the log gate is -inf at those key tokens of every row and head.
struct key_grads {
  std::vector<double> dq, dk, dv, dg;
};

template <class Kind, class Policy, class T>
key_grads backward_of(const key_case& c, const key_inputs& in, const host_tensor<double, 4>& dout) {
  using A = attnmix::accum_t<T>;
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  const host_tensor<T, 4> q = as<T>(in.q), k = as<T>(in.k), v = as<T>(in.v), dO = as<T>(dout);
  host_tensor<A, 3> g({c.B, c.Tk, c.HQ});
  for (std::size_t i = 0; i < g.storage().size(); ++i)
    g.storage()[i] = static_cast<A>(in.g.storage()[i]);
  host_tensor<T, 4> out({c.B, c.T, c.HQ, c.Dv});
  host_tensor<A, 3> lse({c.B, c.T, c.HQ});
  const attnmix::attention_params p = params_of(c);
  const attnmix::backend::cpu be{c.threads};
  attnmix::attention_args<T> a{q.view(), k.view(), v.view(), out.view()};
  if constexpr (gated) a.g = g.view();
  a.lse = lse.view();
  attnmix::attention<Kind, Policy>(a, p, be);

  host_tensor<T, 4> dq(q.shape()), dk(k.shape()), dv(v.shape());
  host_tensor<A, 3> dg(g.shape());
  poison(dq), poison(dk), poison(dv), poison(dg);
  attnmix::attention_grad_args<T> ga;
  ga.q = q.view(), ga.k = k.view(), ga.v = v.view(), ga.out = out.view(), ga.lse = lse.view();
  ga.dout = dO.view(), ga.dq = dq.view(), ga.dk = dk.view(), ga.dv = dv.view();
  if constexpr (gated) ga.g = g.view(), ga.dg = dg.view();
  attnmix::attention_backward<Kind, Policy>(ga, p, be);
  return {to_double(dq.storage()), to_double(dk.storage()), to_double(dv.storage()),
          gated ? to_double(dg.storage()) : std::vector<double>{}};
}

template <class Kind, class Policy>
attnmix_ref::softmax_gradients backward_oracle(const key_case& c, const key_inputs& in,
                                               const host_tensor<double, 4>& dout) {
  return attnmix_ref::softmax_attention_backward(oracle_problem<Kind, Policy>(c), in.q.storage(),
                                                 in.k.storage(), in.v.storage(), in.g.storage(),
                                                 dout.storage());
}

// The backward's tolerance (its sums are longer than the forward's; as test_softmax_backward).
template <class T>
constexpr double grad_tolerance() {
  return sizeof(T) >= 8 ? 1e-10 : 1e-5;
}

template <class Kind, class Policy, class T>
void backward_sweep(const std::vector<key_case>& cases, std::uint64_t salt,
                    const std::vector<index_t>& resets = {}) {
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  for (const key_case& c : cases) {
    INFO("seed " << test_seed() << " " << c.describe() << " " << Kind::name << " mask "
                 << attnmix::to_string(Policy::mask) << " resets " << resets.size());
    key_inputs in = random_inputs(c, ++salt);
    for (const index_t t : resets)
      for (index_t b = 0; b < c.B; ++b)
        for (index_t h = 0; h < c.HQ; ++h)
          if (t < c.Tk) in.g(b, t, h) = -std::numeric_limits<double>::infinity();
    host_tensor<double, 4> dout({c.B, c.T, c.HQ, c.Dv});
    rng(salt * 31 + 7).fill_normal(dout);
    const key_grads got = backward_of<Kind, Policy, T>(c, in, dout);
    const auto ref = backward_oracle<Kind, Policy>(c, in, dout);
    CHECK(rel_error(got.dq, ref.dq) <= grad_tolerance<T>());
    CHECK(rel_error(got.dk, ref.dk) <= grad_tolerance<T>());
    CHECK(rel_error(got.dv, ref.dv) <= grad_tolerance<T>());
    if (gated) CHECK(rel_error(got.dg, ref.dg) <= grad_tolerance<T>());
  }
}

// Keys much longer than the queries, so that a head's keys are split into several runs whose dq
// and gate sums are added afterwards (one KV head, few sequences).
std::vector<key_case> long_key_cases() {
  return {
      {1, 40, 700, 2, 1, 16, 8},
      {1, 100, 640, 3, 1, 8, 8, 0, {0, 1, 100}, {0, 300, 640}},
      {1, 90, 600, 2, 1, 8, 8, 50},
  };
}

}  // namespace

TEMPLATE_TEST_CASE("the softmax backward with keys of other lengths matches the float64 oracle",
                   "[softmax][cpu][key_lengths][backward]", float, double) {
  backward_sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(causal_cases(), 100);
  backward_sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, TestType>(
      bidirectional_cases(), 200);
  backward_sweep<attnmix::kind::softmax, tiny_tiles, TestType>(causal_cases(), 300);
  backward_sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(long_key_cases(), 400);
  backward_sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, TestType>(
      long_key_cases(), 500);
}

TEMPLATE_TEST_CASE("the FoX backward with keys of other lengths matches the float64 oracle",
                   "[fox][cpu][key_lengths][backward]", float, double) {
  backward_sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(causal_cases(), 600);
  backward_sweep<attnmix::kind::fox, fox_gate_before_scale, TestType>(causal_cases(), 700);
  backward_sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(long_key_cases(), 800);
  // Hard resets before, inside and after the queries' keys.
  backward_sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(causal_cases(), 900,
                                                                    {3, 60, 250, 690});
  backward_sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(long_key_cases(), 1000,
                                                                    {3, 60, 250, 690});
}

TEST_CASE("the backward with keys of other lengths: the same bits for every thread count",
          "[cpu][key_lengths][backward]") {
  for (key_case c : long_key_cases()) {
    INFO("seed " << test_seed() << " " << c.describe());
    const key_inputs in = random_inputs(c, 1100);
    host_tensor<double, 4> dout({c.B, c.T, c.HQ, c.Dv});
    rng(1101).fill_normal(dout);
    c.threads = 1;
    const key_grads one = backward_of<attnmix::kind::fox, attnmix::fox_policy, float>(c, in, dout);
    c.threads = 3;
    const key_grads three =
        backward_of<attnmix::kind::fox, attnmix::fox_policy, float>(c, in, dout);
    CHECK(bitwise_equal(one.dq, three.dq));
    CHECK(bitwise_equal(one.dk, three.dk));
    CHECK(bitwise_equal(one.dv, three.dv));
    CHECK(bitwise_equal(one.dg, three.dg));
  }
}

namespace keys_test {
// A host backend whose softmax backward takes no keys of other lengths (as a backend that has not
// written that path yet): the front door must refuse such a call before it reaches the backend.
struct equal_keys_only {
  using memory_space = attnmix::host_space;
  static constexpr const char* name = "equal_keys_only";
};
}  // namespace keys_test

namespace attnmix {
template <>
struct is_backward_implemented<kind::softmax, keys_test::equal_keys_only> : std::true_type {};
namespace detail {
template <class Policy>
struct attention_backward_impl<kind::softmax, keys_test::equal_keys_only, Policy> {
  template <class T>
  static void run(const attention_grad_args<T>& a, const attention_problem& p,
                  const keys_test::equal_keys_only&) {
    attention_backward_impl<kind::softmax, backend::cpu, Policy>::run(a, p, backend::cpu{1});
  }
};
}  // namespace detail
}  // namespace attnmix

TEST_CASE("the backward checks keys of other lengths", "[errors][cpu][key_lengths]") {
  const index_t T = 12, Tk = 20;
  host_tensor<float, 4> q({1, T, 2, 8}, 0.5f), k({1, Tk, 2, 8}, 0.25f), dq({1, T, 2, 8}, 42.0f);
  host_tensor<float, 4> dk({1, Tk, 2, 8}, 42.0f), dv({1, Tk, 2, 8}, 42.0f);
  host_tensor<float, 4> short_dk(q.shape()), short_dv(q.shape());
  host_tensor<float, 3> lse({1, T, 2}, 1.0f), g({1, Tk, 2}, -0.1f), dg({1, Tk, 2}, 42.0f);
  host_tensor<float, 3> short_g({1, T, 2}, -0.1f);
  attnmix::attention_grad_args<float> a;
  a.q = a.out = a.dout = q.view();
  a.k = a.v = k.view();
  a.lse = lse.view();
  a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view();
  const std::vector<std::int32_t> cu{0, 5, 12}, cu_k{0, 6, 20};
  attnmix::attention_params p;
  p.cu_seqlens = {cu.data(), {3}};
  p.cu_seqlens_k = {cu_k.data(), {3}};
  const auto untouched = [&] {
    CHECK(bitwise_equal(dq.storage(), std::vector<float>(dq.storage().size(), 42.0f)));
    CHECK(bitwise_equal(dk.storage(), std::vector<float>(dk.storage().size(), 42.0f)));
  };
  const std::string sa = "attnmix::attention_backward<softmax>";
  CHECK_NOTHROW(attnmix::attention_backward<attnmix::kind::softmax>(a, p));
  dq.fill(42.0f), dk.fill(42.0f);
  // Gradients of the keys have the keys' shape.
  a.dk = short_dk.view();
  expect_error(sa, "dk", "[B, Tk, H, D] = [1, 20, 2, 8]",
               [&] { attnmix::attention_backward<attnmix::kind::softmax>(a, p); });
  a.dk = dk.view();
  untouched();
  // FoX's gate and its gradient: one value a key.
  a.g = short_g.view(), a.dg = dg.view();
  expect_error("attnmix::attention_backward<fox>", "g", "[B, Tk, HQ] = [1, 20, 2]",
               [&] { attnmix::attention_backward<attnmix::kind::fox>(a, p); });
  untouched();
  a.g = g.view(), a.dg = short_g.view();
  expect_error("attnmix::attention_backward<fox>", "dg", "[B, Tk, HQ] = [1, 20, 2]",
               [&] { attnmix::attention_backward<attnmix::kind::fox>(a, p); });
  untouched();
  a.g = {}, a.dg = {};
  // Causal queries need as many keys as they are.
  const std::vector<std::int32_t> few{0, 4, 20};
  p.cu_seqlens_k = {few.data(), {3}};
  expect_error(sa, "k", "gives 4 keys for the 5 queries of sequence 0",
               [&] { attnmix::attention_backward<attnmix::kind::softmax>(a, p); });
  untouched();
  // A backend without takes_key_lengths_backward refuses them, by argument.
  p.cu_seqlens_k = {cu_k.data(), {3}};
  expect_error(
      sa, "cu_seqlens_k", "which the backward of softmax does not take on equal_keys_only", [&] {
        attnmix::attention_backward<attnmix::kind::softmax>(a, p, keys_test::equal_keys_only{});
      });
  untouched();
  p.cu_seqlens_k = {cu.data(), {3}};  // the queries' own offsets: the same problem as none
  a.k = a.v = q.view(), a.dk = short_dk.view(), a.dv = short_dv.view();
  CHECK_NOTHROW(
      attnmix::attention_backward<attnmix::kind::softmax>(a, p, keys_test::equal_keys_only{}));
}

TEST_CASE("keys from the slots of a cache: bad calls are rejected", "[errors][cpu][key_lengths]") {
  using attnmix::kind::fox;
  const std::string fx = "attnmix::attention<fox>";
  // q [2, 3, 2, 8] against a cache of 4 slots of 10 tokens.
  host_tensor<float, 4> q({2, 3, 2, 8}, 0.5f), k({4, 10, 2, 8}, 0.25f), v({4, 10, 2, 8}, 1.0f);
  host_tensor<float, 4> out({2, 3, 2, 8}, 42.0f);
  host_tensor<float, 3> g({4, 10, 2}, -0.1f);
  const auto rejects = [&](const std::string& arg, const std::string& detail,
                           std::vector<std::int32_t> slots, std::vector<std::int32_t> lengths,
                           auto&& modify) {
    attnmix::attention_args<float> a{q.view(), k.view(), v.view(), out.view()};
    a.g = g.view();
    attnmix::attention_params p;
    if (!slots.empty()) p.key_slots = {slots.data(), {index_t(slots.size())}};
    if (!lengths.empty()) p.key_lengths = {lengths.data(), {index_t(lengths.size())}};
    modify(a, p);
    expect_error(fx, arg, detail, [&] { attnmix::attention<fox>(a, p); });
    CHECK(bitwise_equal(out.storage(), std::vector<float>(out.storage().size(), 42.0f)));
  };
  const auto as_is = [](auto&, auto&) {
  };
  rejects("key_slots", "holds 3 slots for a batch of 2 sequences", {0, 1, 2}, {}, as_is);
  rejects("key_slots", "[1] is 4, not a row of k (S = 4)", {0, 4}, {}, as_is);
  rejects("key_slots", "[0] is -1", {-1, 0}, {}, as_is);
  rejects("key_lengths", "holds 1 lengths for a batch of 2 sequences", {0, 1}, {5}, as_is);
  rejects("key_lengths", "[1] is 11 but sequence 1 has 10 keys in k", {0, 1}, {5, 11}, as_is);
  rejects("key_lengths", "[0] is -2", {0, 1}, {-2, 5}, as_is);
  rejects("key_lengths", "gives 2 keys for the 3 queries of sequence 1: causal", {3, 0}, {10, 2},
          as_is);
  rejects("g", "[S, Tk, HQ]", {0, 1}, {5, 5}, [&](auto& a, auto&) {
    a.g = attnmix::view3<const float>(g.data(), {2, 10, 2});
  });
  // Without key_slots, k keeps the queries' batch.
  rejects("k", "[B, Tk, H, D]", {}, {5, 5}, as_is);
  // A packed batch places its keys with cu_seqlens_k.
  const std::vector<std::int32_t> cu{0, 3, 6}, cu_k{0, 20, 40};
  rejects("key_slots", "takes a dense batch", {0, 1}, {}, [&](auto& a, auto& p) {
    a.q = attnmix::view4<const float>(q.data(), {1, 6, 2, 8});
    a.out = attnmix::view4<float>(out.data(), {1, 6, 2, 8});
    a.k = attnmix::view4<const float>(k.data(), {1, 40, 2, 8});
    a.v = attnmix::view4<const float>(v.data(), {1, 40, 2, 8});
    a.g = attnmix::view3<const float>(g.data(), {1, 40, 2});
    p.cu_seqlens = {cu.data(), {3}}, p.cu_seqlens_k = {cu_k.data(), {3}};
  });
  // PaTH reads its queries' own keys.
  host_tensor<float, 4> w({2, 3, 2, 8}, 0.1f), pk({2, 3, 2, 8}, 0.25f);
  host_tensor<float, 3> beta({2, 3, 2}, 1.0f), pg({2, 3, 2}, -0.1f);
  const std::vector<std::int32_t> lengths{3, 3};
  attnmix::attention_args<float> a{q.view(), pk.view(), pk.view(), out.view()};
  a.g = pg.view(), a.w = w.view(), a.beta = beta.view();
  attnmix::attention_params p;
  p.key_lengths = {lengths.data(), {2}};
  expect_error("attnmix::attention<path_fox>", "key_lengths", "which path_fox does not take on cpu",
               [&] { attnmix::attention<attnmix::kind::path_fox>(a, p); });
}

TEST_CASE("the backward takes no keys from a cache", "[errors][cpu][key_lengths]") {
  host_tensor<float, 4> q({2, 3, 2, 8}, 0.5f), dq({2, 3, 2, 8}, 42.0f);
  host_tensor<float, 4> dk({2, 3, 2, 8}, 42.0f), dv({2, 3, 2, 8}, 42.0f);
  host_tensor<float, 3> lse({2, 3, 2}, 1.0f);
  attnmix::attention_grad_args<float> a;
  a.q = a.k = a.v = a.out = a.dout = q.view();
  a.lse = lse.view();
  a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view();
  const std::vector<std::int32_t> two{1, 0};
  for (const char* arg : {"key_lengths", "key_slots"}) {
    attnmix::attention_params p;
    (std::string(arg) == "key_slots" ? p.key_slots : p.key_lengths) = {two.data(), {2}};
    expect_error("attnmix::attention_backward<softmax>", arg, "the backward does not take",
                 [&] { attnmix::attention_backward<attnmix::kind::softmax>(a, p); });
    CHECK(bitwise_equal(dq.storage(), std::vector<float>(dq.storage().size(), 42.0f)));
  }
}
