// CUDA backward of causal linear attention against the CPU backward: a small case first, the
// prefix key gate, bit-identical reruns, then with and without state_in and dstate_out, the
// other knobs in float, the gated norm in bfloat16, and every knob on the tensor-core kernels. The
// harness: linear_backward_harness.cuh.

#include "cuda/linear_backward_harness.cuh"

TEST_CASE("CUDA causal linear backward: one small case (float)", "[cuda][linear_backward][small]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const linear_case c{1, 37, 2, 1, 16, 8};
  INFO("linear_causal " << c.describe());
  check_errors(run_cuda_backward<linear_causal, causal_default, float>(c, 13, {}), 1e-5);
}

TEMPLATE_TEST_CASE("CUDA causal linear backward under the prefix key gate matches the CPU backward",
                   "[cuda][linear_backward][linear_causal][key_gate]", float, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  bwd_options dso;
  dso.dstate_out = true;
  sweep<linear_causal, causal_key_gate, TestType>(1100, "shared key gate", dso);
  sweep<linear_causal, causal_head_gate_raw, TestType>(1150, "per-head key gate, no normaliser");
}

TEST_CASE("CUDA causal linear backward under the prefix key gate with a gated norm (bfloat16)",
          "[cuda][linear_backward][linear_causal][key_gate]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  bwd_options dso;
  dso.dstate_out = true;
  sweep<linear_causal, causal_gated_norm, attnmix::bfloat16>(1200, "key gate and gated norm", dso);
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
  run_cuda_backward<linear_causal, causal_key_gate, float>(c, 2101, dso, &x);
  run_cuda_backward<linear_causal, causal_key_gate, float>(c, 2101, dso, &y);
  CHECK((same(x, y) && bitwise_equal(x.dlse_in, y.dlse_in)));
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

// The tensor-core kernels (bfloat16, D = Dv = 64, sm80_linear_backward_causal.cuh): one token,
// a chunk and a bit, packed sequences with empty and length-1 ones, left pads with GQA, MQA, NaN
// pads; each with and without a state in.
std::vector<linear_case> tensor_core_cases() {
  std::vector<linear_case> cs = {{1, 1, 1, 1, 64, 64},
                                 {2, 65, 2, 2, 64, 64},
                                 {1, 700, 4, 2, 64, 64, {0, 0, 1, 64, 64, 130, 500, 501, 700}},
                                 {3, 200, 8, 2, 64, 64, {}, padding::left},
                                 {2, 129, 4, 1, 64, 64}};
  linear_case nan_pads{2, 333, 4, 2, 64, 64, {}, padding::holes};
  nan_pads.nan_pads = true;
  cs.push_back(nan_pads);
  std::vector<linear_case> with_state;
  for (linear_case c : cs) {
    with_state.push_back(c);
    c.with_state_in = true;
    with_state.push_back(c);
  }
  return with_state;
}

template <class Policy>
void tensor_core_sweep(std::uint64_t salt, const char* what) {
  bwd_options dso;
  dso.dstate_out = true;
  const double tol = grad_tolerance<attnmix::bfloat16>(Policy::norm != attnmix::gated_norm::off);
  for (const linear_case& c : tensor_core_cases())
    for (const bwd_options& opt : {bwd_options{}, dso}) {
      INFO("seed " << test_seed() << " " << c.describe() << " policy " << what << " dstate_out "
                   << opt.dstate_out);
      check_errors(run_cuda_backward<linear_causal, Policy, attnmix::bfloat16>(c, ++salt, opt),
                   tol);
    }
}

TEST_CASE("CUDA causal linear backward on tensor cores (bfloat16, D = Dv = 64)",
          "[cuda][linear_backward][linear_causal][tensor_cores]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  tensor_core_sweep<causal_default>(1100, "linear_causal_policy");
  tensor_core_sweep<causal_identity_raw>(1200, "identity, no normaliser");
  tensor_core_sweep<causal_squared>(1300, "squared relu");
  tensor_core_sweep<causal_head_norm>(1400, "per-head norm, gate then norm, sigmoid");
}

// The tensor-core passes walk several chunks a CTA where the problem has enough of them; force
// walks of three chunks on the cases above (partial walks, walks across empty and one-token
// sequences and pads, the state and its gradient carried in every direction).
struct force_walk {
  explicit force_walk(int chunks) { attnmix::detail::cuda::linear_backward_force_super() = chunks; }
  ~force_walk() { attnmix::detail::cuda::linear_backward_force_super() = 0; }
};

TEST_CASE("CUDA causal linear backward on tensor cores, walks of three chunks",
          "[cuda][linear_backward][linear_causal][tensor_cores]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const force_walk walk(3);
  tensor_core_sweep<causal_default>(1500, "linear_causal_policy");
  tensor_core_sweep<causal_identity_raw>(1600, "identity, no normaliser");
  tensor_core_sweep<causal_head_norm>(1700, "per-head norm, gate then norm, sigmoid");
  // Enough (sequence, head) pairs that the plan itself walks two chunks a CTA (18 chunks of 32
  // pairs: 288 CTAs on the H200's 132 SMs), with and without grouped queries.
  bwd_options dso;
  dso.dstate_out = true;
  const force_walk own(0);
  for (linear_case c : {linear_case{4, 1100, 8, 8, 64, 64}, linear_case{4, 1100, 16, 8, 64, 64}}) {
    c.with_state_in = true;
    INFO("seed " << test_seed() << " " << c.describe());
    check_errors(run_cuda_backward<linear_causal, causal_default, attnmix::bfloat16>(c, 1800, dso),
                 grad_tolerance<attnmix::bfloat16>());
  }
}

// A small case's gradients on tensor cores, against the CPU's, and the same bits on a second run;
// with walks of one chunk and of two.
template <class Policy>
void tensor_core_bits_twice(std::uint64_t salt) {
  linear_case c{2, 150, 4, 2, 64, 64, {}, padding::holes};
  c.with_state_in = true;
  bwd_options dso;
  dso.dstate_out = true;
  const auto same_bits_twice = [&] {
    grad_bits x, y;
    check_errors(run_cuda_backward<linear_causal, Policy, attnmix::bfloat16>(c, salt, dso, &x),
                 grad_tolerance<attnmix::bfloat16>());
    run_cuda_backward<linear_causal, Policy, attnmix::bfloat16>(c, salt, dso, &y);
    CHECK(bitwise_equal(x.dq, y.dq));
    CHECK(bitwise_equal(x.dk, y.dk));
    CHECK(bitwise_equal(x.dv, y.dv));
    CHECK(bitwise_equal(x.da, y.da));
    CHECK(bitwise_equal(x.dS_in, y.dS_in));
    CHECK(bitwise_equal(x.dz_in, y.dz_in));
    CHECK(bitwise_equal(x.dlse_in, y.dlse_in));
  };
  same_bits_twice();
  const force_walk walk(2);
  same_bits_twice();
}

TEST_CASE("CUDA causal linear backward on tensor cores: the same bits twice, a small case",
          "[cuda][linear_backward][linear_causal][tensor_cores][small]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  tensor_core_bits_twice<causal_default>(2200);
}

// Under the prefix key gate the tensor-core passes weight A and dA elementwise and carry the
// state and its gradient by mass ratios: every case above under both gates (with the normaliser,
// without it, behind the gated norm), walks of one chunk and of three, and logits on three levels
// 50 apart, far beyond float's exponent range within a chunk. (Logits spread so that every row
// attends to one key make dq cancel to 1e-4 of its terms through the carried state, which the
// test's term sizes do not see.)
TEST_CASE("CUDA causal linear backward on tensor cores under the prefix key gate",
          "[cuda][linear_backward][linear_causal][tensor_cores][key_gate]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  tensor_core_sweep<causal_key_gate>(2300, "shared key gate");
  tensor_core_sweep<causal_head_gate_raw>(2400, "per-head key gate, no normaliser");
  tensor_core_sweep<causal_gated_norm>(2500, "key gate and gated norm");
  {
    const force_walk walk(3);
    tensor_core_sweep<causal_key_gate>(2600, "shared key gate, walks of three");
    tensor_core_sweep<causal_head_gate_raw>(2700, "per-head key gate, walks of three");
  }
  bwd_options dso;
  dso.dstate_out = true;
  std::uint64_t salt = 2800;
  for (int walk : {0, 2})
    for (linear_case c : {linear_case{2, 300, 4, 2, 64, 64}, linear_case{1, 700, 2, 1, 64, 64}}) {
      const force_walk w(walk);
      c.gate_step = 50;
      c.with_state_in = walk != 0;
      INFO("seed " << test_seed() << " " << c.describe() << " wide logits, walk " << walk);
      check_errors(
          run_cuda_backward<linear_causal, causal_key_gate, attnmix::bfloat16>(c, ++salt, dso),
          grad_tolerance<attnmix::bfloat16>());
      check_errors(
          run_cuda_backward<linear_causal, causal_head_gate_raw, attnmix::bfloat16>(c, ++salt, dso),
          grad_tolerance<attnmix::bfloat16>());
    }
}

TEST_CASE("CUDA causal linear backward on tensor cores under the key gate: the same bits twice",
          "[cuda][linear_backward][linear_causal][tensor_cores][key_gate][small]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  tensor_core_bits_twice<causal_key_gate>(2900);
}

TEST_CASE("CUDA linear backward: worst errors seen", "[cuda][linear_backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  // Runs last in declaration order; prints what the cases above saw.
  WARN(
      "float, worst max|diff| / max|ref| against the CPU backward in double: " << worst_seen(1e-5));
  WARN("half / bfloat16, worst max|diff| / max|ref|: " << worst_seen(1e-2));
}
