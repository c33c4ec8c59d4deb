// CUDA backward of causal linear attention against the CPU backward: a small case first, the
// rejected key gate, bit-identical reruns, then with and without state_in and dstate_out, the
// other knobs in float, the gated norm in bfloat16. The harness: linear_backward_harness.cuh.

#include "cuda/linear_backward_harness.cuh"

TEST_CASE("CUDA causal linear backward: one small case (float)", "[cuda][linear_backward][small]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const linear_case c{1, 37, 2, 1, 16, 8};
  INFO("linear_causal " << c.describe());
  check_errors(run_cuda_backward<linear_causal, causal_default, float>(c, 13, {}), 1e-5);
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

TEST_CASE("CUDA causal linear backward gives the same bits on a second run",
          "[cuda][linear_backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  auto same = [](const grad_bits& x, const grad_bits& y) {
    return bitwise_equal(x.dq, y.dq) && bitwise_equal(x.dk, y.dk) && bitwise_equal(x.dv, y.dv) &&
           bitwise_equal(x.dgate, y.dgate) && bitwise_equal(x.da, y.da) &&
           bitwise_equal(x.dgamma, y.dgamma) && bitwise_equal(x.dS_in, y.dS_in) &&
           bitwise_equal(x.dz_in, y.dz_in);
  };
  linear_case c{2, 1000, 4, 2, 64, 64, {}, padding::holes};
  c.with_state_in = true;
  bwd_options dso;
  dso.dstate_out = true;
  grad_bits x, y;
  run_cuda_backward<linear_causal, causal_default, float>(c, 2100, dso, &x);
  run_cuda_backward<linear_causal, causal_default, float>(c, 2100, dso, &y);
  CHECK(same(x, y));
}

TEMPLATE_TEST_CASE("CUDA causal linear backward matches the CPU backward",
                   "[cuda][linear_backward][linear_causal]", float, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<linear_causal, causal_default, TestType>(700, "linear_causal_policy");
  bwd_options dso;
  dso.dstate_out = true;
  sweep<linear_causal, causal_default, TestType>(750, "linear_causal_policy", dso);
}

TEST_CASE("CUDA causal linear backward, other knobs (float)",
          "[cuda][linear_backward][linear_causal]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  bwd_options dso;
  dso.dstate_out = true;
  sweep<linear_causal, causal_identity_raw, float>(800, "identity, no normaliser", dso);
  sweep<linear_causal, causal_squared, float>(850, "squared relu", dso);
  sweep<linear_causal, causal_head_norm, float>(900, "per-head norm, gate then norm, sigmoid", dso);
  sweep<linear_causal, causal_head_norm, float>(950, "per-head norm, no gamma", {}, true);
}

TEST_CASE("CUDA causal linear backward with a gated norm (bfloat16)",
          "[cuda][linear_backward][linear_causal]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  bwd_options dso;
  dso.dstate_out = true;
  sweep<linear_causal, causal_head_norm, attnmix::bfloat16>(990, "per-head norm", dso);
}

TEST_CASE("CUDA linear backward: worst errors seen", "[cuda][linear_backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  // Runs last in declaration order; prints what the cases above saw.
  WARN(
      "float, worst max|diff| / max|ref| against the CPU backward in double: " << worst_seen(1e-5));
  WARN("half / bfloat16, worst max|diff| / max|ref|: " << worst_seen(1e-2));
}
