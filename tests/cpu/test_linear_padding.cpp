// Padding for every linear kind: a right-padded batch, a left-padded batch and a packed varlen
// batch give, at valid positions, what each sequence gives alone; pad rows are zeros (or left
// untouched on request); empty sequences give zeros and an empty state, never NaN.

#include <numeric>
#include <utility>

#include "cpu/test_linear_harness.hpp"

using namespace attnmix_test;
using attnmix::host_tensor;

namespace {

constexpr index_t HQ = 4, H = 2, D = 16, Dv = 8;

// One sequence's tensors.
template <class T>
struct sequence_data {
  using A = attnmix::accum_t<T>;
  index_t n;
  host_tensor<T, 4> q, k, v, gate, out;
  host_tensor<A, 3> a;
  host_tensor<A, 4> S;
};

enum class layout { right, left, varlen };

template <class Kind, class Policy, class T>
void check_padding(std::uint64_t salt) {
  using A = attnmix::accum_t<T>;
  constexpr bool gated = Policy::gate != attnmix::key_gate::off;
  constexpr bool normed = Policy::norm != attnmix::gated_norm::off;
  const index_t Hg = Policy::gate == attnmix::key_gate::per_head ? H : 1;
  rng r(salt);
  const std::vector<index_t> lengths = {60, 0, 1, r.integer(2, 59), r.integer(2, 59)};
  const index_t B = static_cast<index_t>(lengths.size()), T_ = 60;
  host_tensor<A, 1> gamma({Dv});
  r.fill_uniform(gamma, 0.5, 1.5);

  auto args_of = [&](auto& q, auto& k, auto& v, auto& gate, auto& a, auto& out) {
    attnmix::linear_attention_args<T> args{q.view(), k.view(), v.view(), out.view()};
    if constexpr (gated) args.a = a.view();
    if constexpr (normed) args.gate = gate.view(), args.gamma = gamma.view();
    return args;
  };

  // Each sequence alone.
  std::vector<sequence_data<T>> seqs;
  for (index_t n : lengths) {
    sequence_data<T> s{n,
                       host_tensor<T, 4>({1, n, HQ, D}),
                       host_tensor<T, 4>({1, n, H, D}),
                       host_tensor<T, 4>({1, n, H, Dv}),
                       host_tensor<T, 4>({1, n, HQ, Dv}),
                       host_tensor<T, 4>({1, n, HQ, Dv}),
                       host_tensor<A, 3>({1, n, Hg}),
                       host_tensor<A, 4>({1, H, D, Dv})};
    r.fill_normal(s.q), r.fill_normal(s.k), r.fill_normal(s.v), r.fill_normal(s.gate);
    r.fill_normal(s.a, 2.0);
    poison(s.out), poison(s.S);
    auto args = args_of(s.q, s.k, s.v, s.gate, s.a, s.out);
    args.state_out.S = s.S.view();
    attnmix::linear_attention<Kind, Policy>(args);
    for (T x : s.out.storage()) REQUIRE(std::isfinite(x));
    if (n == 0)
      for (A x : s.S.storage()) REQUIRE(x == A(0));
    seqs.push_back(std::move(s));
  }

  for (layout L : {layout::right, layout::left, layout::varlen}) {
    INFO("seed " << test_seed() << " layout " << static_cast<int>(L));
    const index_t total = std::accumulate(lengths.begin(), lengths.end(), index_t{0});
    const index_t bb = L == layout::varlen ? 1 : B, tt = L == layout::varlen ? total : T_;
    host_tensor<T, 4> q({bb, tt, HQ, D}), k({bb, tt, H, D}), v({bb, tt, H, Dv});
    host_tensor<T, 4> gate({bb, tt, HQ, Dv}), out({bb, tt, HQ, Dv});
    host_tensor<A, 3> a({bb, tt, Hg});
    host_tensor<A, 4> S({B, H, D, Dv});
    // Pads hold NaN: nothing of theirs may reach a valid output.
    for (auto* x : {&q, &k, &v, &gate}) x->fill(std::numeric_limits<T>::quiet_NaN());
    a.fill(std::numeric_limits<A>::quiet_NaN());
    poison(out), poison(S);
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(bb * tt), 0);
    std::vector<std::int32_t> cu = {0};
    std::vector<std::pair<index_t, index_t>> place;  // (batch row, first token) per sequence
    for (index_t b = 0; b < B; ++b) {
      const index_t n = lengths[static_cast<std::size_t>(b)];
      const index_t row = L == layout::varlen ? 0 : b;
      const index_t t0 = L == layout::right ? 0 : L == layout::left ? T_ - n : cu.back();
      place.emplace_back(row, t0);
      cu.push_back(static_cast<std::int32_t>(cu.back() + n));
      const sequence_data<T>& s = seqs[static_cast<std::size_t>(b)];
      for (index_t t = 0; t < n; ++t) {
        mask[static_cast<std::size_t>(row * tt + t0 + t)] = 1;
        for (index_t h = 0; h < HQ; ++h) {
          for (index_t d = 0; d < D; ++d) q(row, t0 + t, h, d) = s.q(0, t, h, d);
          for (index_t d = 0; d < Dv; ++d) gate(row, t0 + t, h, d) = s.gate(0, t, h, d);
        }
        for (index_t h = 0; h < H; ++h) {
          for (index_t d = 0; d < D; ++d) k(row, t0 + t, h, d) = s.k(0, t, h, d);
          for (index_t d = 0; d < Dv; ++d) v(row, t0 + t, h, d) = s.v(0, t, h, d);
        }
        for (index_t g = 0; g < Hg; ++g) a(row, t0 + t, g) = s.a(0, t, g);
      }
    }
    auto args = args_of(q, k, v, gate, a, out);
    args.state_out.S = S.view();
    attnmix::linear_attention_params params;
    if (L == layout::varlen)
      params.cu_seqlens = {cu.data(), {static_cast<index_t>(cu.size())}};
    else
      args.mask = {mask.data(), {bb, tt}};
    attnmix::linear_attention<Kind, Policy>(args, params);

    std::vector<T> got;
    std::vector<double> want;
    for (index_t b = 0; b < B; ++b) {
      const sequence_data<T>& s = seqs[static_cast<std::size_t>(b)];
      const auto [row, t0] = place[static_cast<std::size_t>(b)];
      for (index_t t = 0; t < s.n; ++t)
        for (index_t h = 0; h < HQ; ++h)
          for (index_t c = 0; c < Dv; ++c) {
            got.push_back(out(row, t0 + t, h, c));
            want.push_back(s.out(0, t, h, c));
          }
    }
    // Same arithmetic per sequence up to the split of the reduction over threads.
    CHECK(rel_error(got, want) <= tolerance<T>());
    for (std::size_t i = 0; i < mask.size(); ++i)
      if (!mask[i])
        for (index_t e = 0; e < HQ * Dv; ++e) REQUIRE(out.storage()[i * HQ * Dv + e] == T(0));
    std::vector<double> S_want;
    for (const auto& s : seqs)
      S_want.insert(S_want.end(), s.S.storage().begin(), s.S.storage().end());
    CHECK(rel_error(S.storage(), S_want) <= tolerance<T>());
  }
}

struct causal_gated : attnmix::linear_causal_policy {
  static constexpr attnmix::key_gate gate = attnmix::key_gate::per_head;
  static constexpr attnmix::gated_norm norm = attnmix::gated_norm::per_head;
  static constexpr index_t chunk = 16;
};
using causal_recurrent = attnmix::with_causal_form<causal_gated, attnmix::causal_form::recurrent>;
using gbla_full_width =
    attnmix::with_gated_norm<attnmix::gbla_policy, attnmix::gated_norm::full_width>;

}  // namespace

TEMPLATE_TEST_CASE("padded and varlen batches equal each sequence alone", "[padding][cpu]", float,
                   double) {
  check_padding<attnmix::kind::bla, attnmix::bla_policy, TestType>(1);
  check_padding<attnmix::kind::gbla, attnmix::gbla_policy, TestType>(2);
  check_padding<attnmix::kind::gbla, gbla_full_width, TestType>(3);
  check_padding<attnmix::kind::linear_causal, attnmix::linear_causal_policy, TestType>(4);
  check_padding<attnmix::kind::linear_causal, causal_gated, TestType>(5);
  check_padding<attnmix::kind::linear_causal, causal_recurrent, TestType>(6);
}

TEMPLATE_TEST_CASE("an empty sequence gives zeros and an empty state, no NaN", "[padding][cpu]",
                   float, double) {
  using T = TestType;
  using A = attnmix::accum_t<T>;
  // Row 1 fully masked, and an empty varlen segment: with a key gate too, whose softmax over
  // no keys must give weight 0 rather than 0/0.
  host_tensor<T, 4> q({2, 20, 2, 8}), k({2, 20, 1, 8}), v({2, 20, 1, 4}), g({2, 20, 2, 4});
  host_tensor<T, 4> out({2, 20, 2, 4});
  host_tensor<A, 3> a({2, 20, 1});
  host_tensor<A, 4> S({2, 1, 8, 4});
  host_tensor<A, 3> z({2, 1, 8});
  host_tensor<A, 2> lse({2, 1});
  rng r(5);
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v), r.fill_normal(g), r.fill_normal(a);
  std::vector<std::uint8_t> mask(40, 1);
  for (int t = 20; t < 40; ++t) mask[t] = 0;
  auto check = [&](auto kind_tag, auto policy_tag) {
    using Kind = decltype(kind_tag);
    using Policy = decltype(policy_tag);
    poison(out), poison(S), poison(z), poison(lse);
    attnmix::linear_attention_args<T> args{q.view(), k.view(), v.view(), out.view()};
    args.mask = {mask.data(), {2, 20}};
    args.a = a.view();
    args.gate = g.view();
    args.state_out = {S.view(), z.view(), lse.view()};
    attnmix::linear_attention<Kind, Policy>(args);
    for (index_t t = 0; t < 20; ++t)
      for (index_t e = 0; e < 8; ++e) {
        REQUIRE(std::isfinite(out(0, t, e / 4, e % 4)));
        REQUIRE(out(1, t, e / 4, e % 4) == T(0));
      }
    for (index_t e = 0; e < 32; ++e) REQUIRE(S(1, 0, e / 4, e % 4) == A(0));
    for (index_t e = 0; e < 8; ++e) REQUIRE(z(1, 0, e) == A(0));
    REQUIRE(lse(1, 0) == -std::numeric_limits<A>::infinity());
    REQUIRE(std::isfinite(lse(0, 0)));
  };
  check(attnmix::kind::gbla{}, attnmix::gbla_policy{});
  check(attnmix::kind::linear_causal{},
        attnmix::with_gated_norm<
            attnmix::with_key_gate<attnmix::linear_causal_policy, attnmix::key_gate::shared>,
            attnmix::gated_norm::per_head>{});
}

namespace {
struct keep_pads : attnmix::gbla_policy {
  static constexpr bool zero_pad_rows = false;
};
struct keep_pads_causal : attnmix::linear_causal_policy {
  static constexpr bool zero_pad_rows = false;
};
}  // namespace

TEST_CASE("zero_pad_rows = false leaves pad rows untouched", "[padding][cpu]") {
  host_tensor<float, 4> q({2, 30, 2, 8}), k({2, 30, 2, 8}), v({2, 30, 2, 4}), g({2, 30, 2, 4});
  host_tensor<float, 3> a({2, 30, 1});
  rng r(9);
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v), r.fill_normal(g), r.fill_normal(a);
  std::vector<std::uint8_t> mask(60);
  for (auto& m : mask) m = r.uniform(0, 1) < 0.6;
  auto check = [&](auto kind_tag, auto policy_tag) {
    host_tensor<float, 4> out({2, 30, 2, 4}, 42.0f);
    attnmix::linear_attention_args<float> args{q.view(), k.view(), v.view(), out.view()};
    args.mask = {mask.data(), {2, 30}};
    if constexpr (std::is_same_v<decltype(kind_tag), attnmix::kind::gbla>)
      args.a = a.view(), args.gate = g.view();
    attnmix::linear_attention<decltype(kind_tag), decltype(policy_tag)>(args);
    for (index_t i = 0; i < 60; ++i)
      for (index_t e = 0; e < 8; ++e) {
        const float x = out.storage()[static_cast<std::size_t>(i * 8 + e)];
        if (mask[static_cast<std::size_t>(i)])
          REQUIRE((std::isfinite(x) && x != 42.0f));
        else
          REQUIRE(x == 42.0f);
      }
  };
  check(attnmix::kind::gbla{}, keep_pads{});
  check(attnmix::kind::linear_causal{}, keep_pads_causal{});
}
