// CUDA backward of causal linear attention against the CPU backward: with and without
// state_in and dstate_out, the other knobs in float, the gated norm in bfloat16.

#include "cuda/linear_backward_harness.cuh"

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
