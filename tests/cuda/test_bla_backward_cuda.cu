// CUDA backward of BLA and GBLA against the CPU backward: a small case of each first, bit-identical
// reruns, then the default policies (GBLA in every dtype), with and without the forward's state,
// and the other knobs in float. The harness: linear_backward_harness.cuh.

#include "cuda/linear_backward_harness.cuh"

TEST_CASE("CUDA linear backward: is_backward_implemented", "[cuda][linear_backward]") {
  STATIC_REQUIRE(attnmix::is_backward_implemented_v<bla, attnmix::backend::cuda>);
  STATIC_REQUIRE(attnmix::is_backward_implemented_v<gbla, attnmix::backend::cuda>);
  STATIC_REQUIRE(attnmix::is_backward_implemented_v<linear_causal, attnmix::backend::cuda>);
}

TEST_CASE("CUDA BLA and GBLA backward: one small case each (float)",
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
}

TEST_CASE("CUDA BLA and GBLA backward on tensor cores: a small case each (16-bit)",
          "[cuda][linear_backward][small_mma]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  // Packed sequences shorter and longer than a tile (GQA); a padded batch with holes.
  const linear_case packed{1, 300, 2, 1, 64, 64, {0, 40, 300}};
  const linear_case holes{2, 150, 2, 2, 64, 64, {}, padding::holes};
  {
    INFO("gbla bfloat16 " << packed.describe());
    check_errors(run_cuda_backward<gbla, attnmix::gbla_policy, attnmix::bfloat16>(packed, 13, {}),
                 grad_tolerance<attnmix::bfloat16>());
  }
  {
    INFO("bla half " << holes.describe());
    check_errors(run_cuda_backward<bla, attnmix::bla_policy, attnmix::half>(holes, 14, {}),
                 grad_tolerance<attnmix::half>());
  }
}

TEST_CASE("CUDA GBLA backward gives the same bits on a second run", "[cuda][linear_backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  auto same = [](const grad_bits& x, const grad_bits& y) {
    return bitwise_equal(x.dq, y.dq) && bitwise_equal(x.dk, y.dk) && bitwise_equal(x.dv, y.dv) &&
           bitwise_equal(x.dgate, y.dgate) && bitwise_equal(x.da, y.da) &&
           bitwise_equal(x.dgamma, y.dgamma) && bitwise_equal(x.dS_in, y.dS_in) &&
           bitwise_equal(x.dz_in, y.dz_in);
  };
  linear_case c{1, 3000, 4, 2, 64, 64, {0, 0, 1, 1000, 1001, 3000}};
  grad_bits x, y;
  run_cuda_backward<gbla, attnmix::gbla_policy, attnmix::bfloat16>(c, 2000, {}, &x);
  run_cuda_backward<gbla, attnmix::gbla_policy, attnmix::bfloat16>(c, 2000, {}, &y);
  CHECK(same(x, y));
}

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

// 16-bit inputs at D = Dv = 64 take the tensor-core kernels (sm80_linear_backward.cuh);
// the sweeps above run them under the default policies. Here the other knobs on them, and the
// CUDA-core kernels forced at those dims.
TEST_CASE("CUDA BLA and GBLA backward, other knobs (bfloat16)",
          "[cuda][linear_backward][gbla][bla]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using attnmix::bfloat16;
  sweep<gbla, gbla_mamba, bfloat16>(700, "per-head gate, gate then norm, sigmoid, per-head gamma");
  sweep<gbla, gbla_raw_gate, bfloat16>(750, "sigmoid map, no normaliser, no norm");
  sweep<bla, bla_relu, attnmix::half>(800, "relu");
  sweep<bla, bla_identity_raw, bfloat16>(850, "identity, no normaliser");
  bwd_options saved;
  saved.use_saved = true;
  sweep<gbla, gbla_mamba, attnmix::half>(880, "per-head gate, gate then norm", saved);
}

TEST_CASE("CUDA BLA and GBLA backward, the CUDA-core kernels forced (bfloat16)",
          "[cuda][linear_backward][gbla][bla]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  struct force_simt {
    force_simt() { attnmix::detail::cuda::linear_backward_force_simt() = true; }
    ~force_simt() { attnmix::detail::cuda::linear_backward_force_simt() = false; }
  } forced;
  sweep<gbla, attnmix::gbla_policy, attnmix::bfloat16>(900, "gbla_policy, CUDA cores");
  sweep<bla, attnmix::bla_policy, attnmix::bfloat16>(950, "bla_policy, CUDA cores");
}
