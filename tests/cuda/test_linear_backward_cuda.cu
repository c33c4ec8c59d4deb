// CUDA backward of the linear-attention family: the small case of each kind first, then rejections,
// bit-identical reruns and the margins seen (the sweeps: test_bla_backward_cuda.cu,
// test_linear_causal_backward_cuda.cu; the harness: linear_backward_harness.cuh).

#include "cuda/linear_backward_harness.cuh"

TEST_CASE("CUDA linear backward: is_backward_implemented", "[cuda][linear_backward]") {
  STATIC_REQUIRE(attnmix::is_backward_implemented_v<bla, attnmix::backend::cuda>);
  STATIC_REQUIRE(attnmix::is_backward_implemented_v<gbla, attnmix::backend::cuda>);
  STATIC_REQUIRE(attnmix::is_backward_implemented_v<linear_causal, attnmix::backend::cuda>);
}

TEST_CASE("CUDA linear backward: one small case of each kind (float)",
          "[cuda][linear_backward][small]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const linear_case c{1, 37, 2, 1, 16, 8};
  {
    INFO("bla " << c.describe());
    check_errors(run_cuda_backward<bla, attnmix::bla_policy, float>(c, 11, {}), 1e-5);
  }
  {
    INFO("gbla " << c.describe());
    check_errors(run_cuda_backward<gbla, attnmix::gbla_policy, float>(c, 12, {}), 1e-5);
  }
  {
    INFO("linear_causal " << c.describe());
    check_errors(run_cuda_backward<linear_causal, causal_default, float>(c, 13, {}), 1e-5);
  }
}

TEST_CASE("CUDA linear backward: a prefix key gate is rejected by name",
          "[cuda][linear_backward][linear_causal]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using gated_causal = attnmix::with_key_gate<causal_default, key_gate::shared>;
  const linear_case c{1, 10, 1, 1, 8, 8};
  std::string message;
  try {
    run_cuda_backward<linear_causal, gated_causal, float>(c, 1, {});
  } catch (const attnmix::error& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("Policy::gate") != std::string::npos);
}

TEST_CASE("CUDA linear backward gives the same bits on a second run", "[cuda][linear_backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  auto same = [](const grad_bits& x, const grad_bits& y) {
    return bitwise_equal(x.dq, y.dq) && bitwise_equal(x.dk, y.dk) && bitwise_equal(x.dv, y.dv) &&
           bitwise_equal(x.dgate, y.dgate) && bitwise_equal(x.da, y.da) &&
           bitwise_equal(x.dgamma, y.dgamma) && bitwise_equal(x.dS_in, y.dS_in) &&
           bitwise_equal(x.dz_in, y.dz_in);
  };
  {
    linear_case c{1, 3000, 4, 2, 64, 64, {0, 0, 1, 1000, 1001, 3000}};
    grad_bits x, y;
    run_cuda_backward<gbla, attnmix::gbla_policy, attnmix::bfloat16>(c, 2000, {}, &x);
    run_cuda_backward<gbla, attnmix::gbla_policy, attnmix::bfloat16>(c, 2000, {}, &y);
    CHECK(same(x, y));
  }
  {
    linear_case c{2, 1000, 4, 2, 64, 64, {}, padding::holes};
    c.with_state_in = true;
    bwd_options dso;
    dso.dstate_out = true;
    grad_bits x, y;
    run_cuda_backward<linear_causal, causal_default, float>(c, 2100, dso, &x);
    run_cuda_backward<linear_causal, causal_default, float>(c, 2100, dso, &y);
    CHECK(same(x, y));
  }
}

TEST_CASE("CUDA linear backward: worst errors seen", "[cuda][linear_backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  // Runs last in declaration order; prints what the cases above saw.
  WARN(
      "float, worst max|diff| / max|ref| against the CPU backward in double: " << worst_seen(1e-5));
  WARN("half / bfloat16, worst max|diff| / max|ref|: " << worst_seen(1e-2));
}
