// Softmax attention on the CPU against the float64 oracle.

#include "cpu/attention_harness.hpp"

using namespace attnmix_test;

namespace {

template <class Policy, class T>
void sweep() {
  std::uint64_t salt = 0;
  for (const attention_case& c : standard_cases()) {
    INFO("seed " << test_seed() << " " << c.describe() << " mask "
                 << attnmix::to_string(Policy::mask));
    const case_result r = run_attention_case<attnmix::kind::softmax, Policy, T>(c, ++salt);
    CHECK(r.out_error <= tolerance<T>());
    CHECK(r.lse_error <= tolerance<T>());
  }
}

}  // namespace

TEMPLATE_TEST_CASE("softmax attention matches the float64 oracle, causal", "[softmax][cpu]", float,
                   double) {
  sweep<attnmix::softmax_policy, TestType>();
}

TEMPLATE_TEST_CASE("softmax attention matches the float64 oracle, bidirectional", "[softmax][cpu]",
                   float, double) {
  sweep<attnmix::bidirectional_softmax_policy, TestType>();
}

namespace {
struct tiny_tiles : attnmix::softmax_policy {
  static constexpr attnmix::index_t block_q = 5, block_k = 3;
};
}  // namespace

TEST_CASE("softmax attention with small tiles matches the oracle", "[softmax][cpu]") {
  for (const attention_case& c : standard_cases()) {
    INFO("seed " << test_seed() << " " << c.describe());
    CHECK(run_attention_case<attnmix::kind::softmax, tiny_tiles, double>(c, 7).out_error <= 1e-12);
  }
}

TEST_CASE("softmax attention is deterministic across thread counts", "[softmax][cpu]") {
  attention_case c{2, 300, 4, 2, 32, 32};
  rng r(1);
  attnmix::host_tensor<float, 4> q({2, 300, 4, 32}), k({2, 300, 2, 32}), v({2, 300, 2, 32});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v);
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 2, 5}) {
    attnmix::host_tensor<float, 4> out({2, 300, 4, 32});
    poison(out);
    attnmix::attention<attnmix::kind::softmax>(
        attnmix::attention_args<float>{q.view(), k.view(), v.view(), out.view()}, {},
        attnmix::backend::cpu{threads});
    outs.push_back(out.storage());
  }
  CHECK(bitwise_equal(outs[0], outs[1]));
  CHECK(bitwise_equal(outs[0], outs[2]));
}

TEST_CASE("softmax attention reads strided views", "[softmax][cpu]") {
  // q, k, v interleaved in one [B, T, 3, H, D] buffer, as a fused QKV projection writes them.
  const attnmix::index_t B = 2, T = 77, H = 3, D = 16;
  rng r(2);
  attnmix::host_tensor<double, 5> qkv({B, T, 3, H, D});
  r.fill_normal(qkv);
  const std::array<attnmix::index_t, 4> shape{B, T, H, D}, stride{T * 3 * H * D, 3 * H * D, D, 1};
  attnmix::view4<const double> q(qkv.data(), shape, stride), k(qkv.data() + H * D, shape, stride),
      v(qkv.data() + 2 * H * D, shape, stride);
  attnmix::host_tensor<double, 4> out({B, T, H, D}), dense_out({B, T, H, D});
  poison(out);
  attnmix::attention<attnmix::kind::softmax>(attnmix::attention_args<double>{q, k, v, out.view()});

  attnmix::host_tensor<double, 4> qd({B, T, H, D}), kd({B, T, H, D}), vd({B, T, H, D});
  for (attnmix::index_t b = 0; b < B; ++b)
    for (attnmix::index_t t = 0; t < T; ++t)
      for (attnmix::index_t h = 0; h < H; ++h)
        for (attnmix::index_t d = 0; d < D; ++d)
          qd(b, t, h, d) = q(b, t, h, d), kd(b, t, h, d) = k(b, t, h, d),
                      vd(b, t, h, d) = v(b, t, h, d);
  attnmix::attention<attnmix::kind::softmax>(
      attnmix::attention_args<double>{qd.view(), kd.view(), vd.view(), dense_out.view()});
  CHECK(bitwise_equal(out.storage(), dense_out.storage()));
}
