// CUDA backward of BLA and GBLA against the CPU backward: the default policies in every
// dtype, with and without the forward's state, and the other knobs in float.

#include "cuda/linear_backward_harness.cuh"

// half shares the 16-bit path with bfloat16; it is swept with GBLA.
TEMPLATE_TEST_CASE("CUDA BLA backward matches the CPU backward", "[cuda][linear_backward][bla]",
                   float, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<bla, attnmix::bla_policy, TestType>(100, "bla_policy");
  bwd_options saved;
  saved.use_saved = true;
  sweep<bla, attnmix::bla_policy, TestType>(150, "bla_policy", saved);
}

TEST_CASE("CUDA BLA backward, other feature maps and no normaliser (float)",
          "[cuda][linear_backward][bla]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<bla, bla_relu, float>(200, "relu");
  sweep<bla, bla_identity_raw, float>(300, "identity, no normaliser");
  bwd_options saved;
  saved.use_saved = true;
  sweep<bla, bla_identity_raw, float>(350, "identity, no normaliser", saved);
}

TEMPLATE_TEST_CASE("CUDA GBLA backward matches the CPU backward", "[cuda][linear_backward][gbla]",
                   float, attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<gbla, attnmix::gbla_policy, TestType>(400, "gbla_policy");
  sweep<gbla, attnmix::gbla_policy, TestType>(450, "gbla_policy, no gamma", {}, true);
  bwd_options saved;
  saved.use_saved = true;
  sweep<gbla, attnmix::gbla_policy, TestType>(480, "gbla_policy", saved);
}

TEST_CASE("CUDA GBLA backward, other knobs (float)", "[cuda][linear_backward][gbla]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<gbla, gbla_mamba, float>(500, "per-head gate, gate then norm, sigmoid, per-head gamma");
  sweep<gbla, gbla_raw_gate, float>(600, "sigmoid map, no normaliser, no norm");
  bwd_options saved;
  saved.use_saved = true;
  sweep<gbla, gbla_mamba, float>(650, "per-head gate, gate then norm", saved);
}

TEST_CASE("CUDA linear backward: worst errors seen", "[cuda][linear_backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  // Runs last in declaration order; prints what the cases above saw.
  WARN(
      "float, worst max|diff| / max|ref| against the CPU backward in double: " << worst_seen(1e-5));
  WARN("half / bfloat16, worst max|diff| / max|ref|: " << worst_seen(1e-2));
}
