// FoX on the CPU against the float64 oracle, in both gate conventions.

#include "cpu/attention_harness.hpp"

using namespace attnmix_test;
using attnmix::gate_scaling;

namespace {

template <gate_scaling S, class T>
void sweep(double gate_lo, double gate_hi) {
  using policy = attnmix::with_gate_scaling<attnmix::fox_policy, S>;
  std::uint64_t salt = 100;
  for (attention_case c : standard_cases()) {
    c.gate_lo = gate_lo, c.gate_hi = gate_hi;
    INFO("seed " << test_seed() << " " << c.describe() << " gate "
                 << (S == gate_scaling::after_scale ? "after" : "before") << " scale");
    const case_result r = run_attention_case<attnmix::kind::fox, policy, T>(c, ++salt);
    CHECK(r.out_error <= tolerance<T>());
    CHECK(r.lse_error <= tolerance<T>());
  }
}

}  // namespace

TEMPLATE_TEST_CASE("FoX matches the oracle, gate after the scale (FoX convention)", "[fox][cpu]",
                   float, double) {
  sweep<gate_scaling::after_scale, TestType>(-0.1, -0.01);
  sweep<gate_scaling::after_scale, TestType>(std::log(0.5), 0.0);  // strong forgetting
}

TEMPLATE_TEST_CASE("FoX matches the oracle, gate before the scale (PaTH-FoX convention)",
                   "[fox][cpu]", float, double) {
  sweep<gate_scaling::before_scale, TestType>(-0.1, -0.01);
  sweep<gate_scaling::before_scale, TestType>(std::log(0.5), 0.0);
}

TEST_CASE("FoX keeps float accuracy over a long sequence", "[fox][cpu]") {
  // G reaches about -300 at T = 6000; a float cumsum would lose the differences G_i - G_j.
  attention_case c{1, 6000, 1, 1, 16, 16};
  INFO("seed " << test_seed());
  CHECK(run_attention_case<attnmix::kind::fox, attnmix::fox_policy, float>(c, 9).out_error <= 1e-5);
}

TEST_CASE("FoX with a zero gate is softmax attention", "[fox][cpu]") {
  rng r(3);
  attnmix::host_tensor<double, 4> q({2, 90, 4, 16}), k({2, 90, 2, 16}), v({2, 90, 2, 8});
  attnmix::host_tensor<double, 4> sa({2, 90, 4, 8}), fox({2, 90, 4, 8});
  attnmix::host_tensor<double, 3> g({2, 90, 4}, 0.0);
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v);
  attnmix::attention<attnmix::kind::softmax>(
      attnmix::attention_args<double>{q.view(), k.view(), v.view(), sa.view()});
  attnmix::attention_args<double> a{q.view(), k.view(), v.view(), fox.view()};
  a.g = g.view();
  attnmix::attention<attnmix::kind::fox>(a);
  CHECK(rel_error(fox.storage(), to_double(sa.storage())) <= 1e-14);
}
