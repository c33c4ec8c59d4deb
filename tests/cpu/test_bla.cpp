// BLA on the CPU against the float64 quadratic oracle: every feature map, the normaliser on
// and off, GQA, D != Dv, masks, varlen batches, split reductions and the final state.

#include "cpu/test_linear_harness.hpp"

using namespace attnmix_test;
using attnmix::feature_map;
using attnmix::kind::bla;

namespace {

template <class Policy, class T>
void sweep(const std::vector<linear_case>& cases, std::uint64_t salt) {
  for (const linear_case& c : cases) {
    INFO("seed " << test_seed() << " " << c.describe() << " phi "
                 << attnmix::feature_map_traits<Policy::phi>::name << " normalize "
                 << Policy::normalize);
    const linear_errors e = run_linear_case<bla, Policy, T>(c, ++salt);
    CHECK(e.out <= tolerance<T>());
    CHECK(e.S <= tolerance<T>());
    CHECK(e.z <= tolerance<T>());
  }
}

// The sweep without its longest case, for the secondary variants.
std::vector<linear_case> short_cases() {
  std::vector<linear_case> cs;
  for (const linear_case& c : standard_linear_cases())
    if (c.T <= 300) cs.push_back(c);
  return cs;
}

template <feature_map F>
using with_phi = attnmix::with_feature_map<attnmix::bla_policy, F>;

}  // namespace

TEMPLATE_TEST_CASE("BLA matches the oracle (elu+1, normalised)", "[bla][cpu]", float, double) {
  sweep<attnmix::bla_policy, TestType>(standard_linear_cases(), 1000);
}

TEMPLATE_TEST_CASE("BLA matches the oracle for every non-negative feature map", "[bla][cpu]", float,
                   double) {
  sweep<with_phi<feature_map::relu>, TestType>(short_cases(), 2000);
  sweep<with_phi<feature_map::squared_relu>, TestType>(short_cases(), 3000);
  sweep<with_phi<feature_map::sigmoid>, TestType>(short_cases(), 4000);
}

TEMPLATE_TEST_CASE("BLA matches the oracle with the normaliser off", "[bla][cpu]", float, double) {
  using identity = attnmix::with_normalize<with_phi<feature_map::identity>, false>;
  using elu = attnmix::with_normalize<attnmix::bla_policy, false>;
  sweep<identity, TestType>(short_cases(), 5000);
  sweep<elu, TestType>(short_cases(), 6000);
}

TEST_CASE("feature maps: the vectorised CPU form equals apply_feature_map", "[bla][cpu]") {
  std::vector<double> xs = {-50, -3, -1, -1e-9, 0, 1e-9, 0.5, 1, 3, 50};
  attnmix::detail::cpu::matrix<double> x(1, static_cast<index_t>(xs.size())), y;
  for (std::size_t i = 0; i < xs.size(); ++i) x(0, static_cast<index_t>(i)) = xs[i];
  auto check = [&](auto tag) {
    constexpr feature_map F = decltype(tag)::value;
    y.resize(x.rows(), x.cols());
    attnmix::detail::cpu::apply_phi<F>(y, x);
    for (std::size_t i = 0; i < xs.size(); ++i) {
      INFO(attnmix::feature_map_traits<F>::name << " at " << xs[i]);
      const double want = attnmix::apply_feature_map<F>(xs[i]);
      CHECK(std::abs(y(0, static_cast<index_t>(i)) - want) <= 1e-15 * (1 + std::abs(want)));
      if (attnmix::feature_map_traits<F>::nonnegative) CHECK(want >= 0);
    }
  };
  check(std::integral_constant<feature_map, feature_map::elu_plus_one>{});
  check(std::integral_constant<feature_map, feature_map::relu>{});
  check(std::integral_constant<feature_map, feature_map::squared_relu>{});
  check(std::integral_constant<feature_map, feature_map::sigmoid>{});
  check(std::integral_constant<feature_map, feature_map::identity>{});
  STATIC_REQUIRE_FALSE(attnmix::feature_map_traits<feature_map::identity>::nonnegative);
}

TEMPLATE_TEST_CASE("relu features that are all zero give finite zero outputs", "[bla][cpu]", float,
                   double) {
  // q, k < 0 everywhere: phi = relu is 0, so num = 0 and den = 0 + eps.
  using T = TestType;
  rng r(7);
  attnmix::host_tensor<T, 4> q({2, 50, 4, 16}), k({2, 50, 2, 16}), v({2, 50, 2, 8});
  attnmix::host_tensor<T, 4> out({2, 50, 4, 8});
  r.fill_uniform(q, -2, -0.1);
  r.fill_uniform(k, -2, -0.1);
  r.fill_normal(v);
  poison(out);
  using policy = with_phi<feature_map::relu>;
  attnmix::linear_attention<bla, policy>(
      attnmix::linear_attention_args<T>{q.view(), k.view(), v.view(), out.view()});
  for (T x : out.storage()) REQUIRE(x == T(0));

  // Half the keys positive: queries that are all negative still give 0.
  for (index_t t = 0; t < 50; t += 2)
    for (index_t d = 0; d < 16; ++d) k(1, t, 0, d) = T(1);
  poison(out);
  attnmix::linear_attention<bla, policy>(
      attnmix::linear_attention_args<T>{q.view(), k.view(), v.view(), out.view()});
  for (T x : out.storage()) REQUIRE(x == T(0));
}

TEST_CASE("BLA results do not depend on the thread count beyond rounding", "[bla][cpu]") {
  rng r(11);
  attnmix::host_tensor<double, 4> q({1, 3000, 2, 32}), k({1, 3000, 1, 32}), v({1, 3000, 1, 16});
  attnmix::host_tensor<double, 4> one({1, 3000, 2, 16}), many({1, 3000, 2, 16});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v);
  attnmix::linear_attention<bla>(
      attnmix::linear_attention_args<double>{q.view(), k.view(), v.view(), one.view()}, {},
      attnmix::backend::cpu{1});
  attnmix::linear_attention<bla>(
      attnmix::linear_attention_args<double>{q.view(), k.view(), v.view(), many.view()}, {},
      attnmix::backend::cpu{7});
  INFO("seed " << test_seed());
  CHECK(rel_error(many.storage(), to_double(one.storage())) <= 1e-14);
}
