// CUDA BLA, GBLA and causal linear attention against the CPU path in double, in float, half
// and bfloat16: outputs and the states they return.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "attnmix/cuda.cuh"
#include "cpu/test_linear_harness.hpp"
#include "support/cuda_testing.cuh"

using namespace attnmix_test;
using attnmix::index_t;

namespace {

// Device copies of everything in a linear_inputs<float>, activations rounded to T.
template <class T>
struct device_inputs {
  device_buffer<T> q, k, v, gate, out;
  device_buffer<float> a, gamma, S_in, z_in, lse_in, S_out, z_out, lse_out;
  device_buffer<std::uint8_t> mask;
  explicit device_inputs(const linear_inputs<float>& in)
      : q(convert_all<T>(in.q.storage())),
        k(convert_all<T>(in.k.storage())),
        v(convert_all<T>(in.v.storage())),
        gate(convert_all<T>(in.gate.storage())),
        out(static_cast<std::size_t>(in.out.size())),
        a(in.a.storage()),
        gamma(in.gamma.storage()),
        S_in(in.S_in.storage()),
        z_in(in.z_in.storage()),
        lse_in(in.lse_in.storage()),
        S_out(static_cast<std::size_t>(in.S_out.size())),
        z_out(static_cast<std::size_t>(in.z_out.size())),
        lse_out(static_cast<std::size_t>(in.lse_out.size())),
        mask(in.mask) {}
};

// Re-points every view of host args at the device copies.
template <class V, class P>
V on_device(const V& host, P* ptr) {
  if (!host.has_value()) return V{};
  return V(ptr, host.shape(), host.strides(), attnmix::memory_space::device);
}

template <class Kind, class Policy, class T>
linear_errors run_cuda_linear(const linear_case& c, std::uint64_t salt) {
  rng r(salt);
  linear_inputs<float> in = make_inputs<Policy, float>(c, r);
  // The reference sees exactly the values the kernel sees.
  for (auto* t : {&in.q, &in.k, &in.v, &in.gate})
    t->storage() = convert_all<float>(convert_all<T>(t->storage()));
  device_inputs<T> dev(in);
  const attnmix::linear_attention_args<float> h = make_args<Policy>(in, c);
  attnmix::linear_attention_args<T> d;
  d.q = on_device(attnmix::view4<const T>(nullptr, h.q.shape()), dev.q.get());
  d.k = on_device(attnmix::view4<const T>(nullptr, h.k.shape()), dev.k.get());
  d.v = on_device(attnmix::view4<const T>(nullptr, h.v.shape()), dev.v.get());
  d.out = on_device(attnmix::view4<T>(nullptr, h.out.shape()), dev.out.get());
  if (h.gate.has_value())
    d.gate = on_device(attnmix::view4<const T>(nullptr, h.gate.shape()), dev.gate.get());
  d.mask = on_device(h.mask, dev.mask.get());
  d.a = on_device(h.a, dev.a.get());
  d.gamma = on_device(h.gamma, dev.gamma.get());
  d.state_in.S = on_device(h.state_in.S, dev.S_in.get());
  d.state_in.z = on_device(h.state_in.z, dev.z_in.get());
  d.state_in.lse = on_device(h.state_in.lse, dev.lse_in.get());
  d.state_out.S = on_device(h.state_out.S, dev.S_out.get());
  d.state_out.z = on_device(h.state_out.z, dev.z_out.get());
  d.state_out.lse = on_device(h.state_out.lse, dev.lse_out.get());
  attnmix::linear_attention<Kind, Policy>(d, make_params<T>(c), attnmix::backend::cuda{});
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "kernel");

  // The CPU path in double on the same (rounded) inputs.
  linear_inputs<double> ref;
  ref.q = attnmix::host_tensor<double, 4>(in.q.shape()),
  ref.k = attnmix::host_tensor<double, 4>(in.k.shape());
  ref.v = attnmix::host_tensor<double, 4>(in.v.shape()),
  ref.gate = attnmix::host_tensor<double, 4>(in.gate.shape());
  ref.out = attnmix::host_tensor<double, 4>(in.out.shape());
  ref.a = attnmix::host_tensor<double, 3>(in.a.shape()),
  ref.gamma = attnmix::host_tensor<double, 1>(in.gamma.shape());
  ref.S_in = ref.S_out = attnmix::host_tensor<double, 4>(in.S_in.shape());
  ref.z_in = ref.z_out = attnmix::host_tensor<double, 3>(in.z_in.shape());
  ref.lse_in = ref.lse_out = attnmix::host_tensor<double, 2>(in.lse_in.shape());
  ref.q.storage() = to_double(in.q.storage()), ref.k.storage() = to_double(in.k.storage());
  ref.v.storage() = to_double(in.v.storage()), ref.gate.storage() = to_double(in.gate.storage());
  ref.a.storage() = to_double(in.a.storage()), ref.gamma.storage() = to_double(in.gamma.storage());
  ref.S_in.storage() = to_double(in.S_in.storage()),
  ref.z_in.storage() = to_double(in.z_in.storage());
  ref.lse_in.storage() = to_double(in.lse_in.storage());
  ref.mask = in.mask;
  attnmix::linear_attention<Kind, Policy>(make_args<Policy>(ref, c), make_params<double>(c));

  linear_errors e{rel_error(convert_all<double>(dev.out.to_host()), to_double(ref.out.storage())),
                  rel_error(dev.S_out.to_host(), to_double(ref.S_out.storage())),
                  rel_error(dev.z_out.to_host(), to_double(ref.z_out.storage())), 0.0};
  if (Policy::gate != attnmix::key_gate::off)
    e.lse = lse_error(dev.lse_out.to_host(), to_double(ref.lse_out.storage()));
  return e;
}

std::vector<linear_case> cuda_linear_cases(bool causal) {
  std::vector<linear_case> cs;
  for (const linear_case& c : standard_linear_cases())
    if (c.D % 4 == 0 && c.Dv % 4 == 0 && c.D <= 128 && c.Dv <= 128) cs.push_back(c);
  cs.push_back({2, 2000, 4, 2, 64, 64});
  cs.push_back({1, 900, 2, 2, 128, 128, {0, 300, 300, 900}, padding::none});
  cs.push_back({2, 333, 4, 4, 64, 128, {}, padding::right});
  if (!causal) {
    // The tensor-core kernels (half, bfloat16): tiny T, lengths around the 64-token tile, GQA,
    // D != Dv both ways, the narrow and wide dims they take, and dims they leave to the portable
    // kernels (D = 32 with Dv = 16, D = 48).
    cs.push_back({1, 1, 1, 1, 64, 64});
    cs.push_back({3, 2, 2, 1, 128, 128});
    cs.push_back({2, 63, 4, 2, 64, 64});
    cs.push_back({2, 64, 4, 2, 64, 32, {}, padding::left});
    cs.push_back({1, 65, 2, 1, 32, 64});
    cs.push_back({2, 129, 6, 3, 128, 64, {}, padding::right});
    cs.push_back({2, 300, 8, 2, 64, 128});
    cs.push_back({1, 200, 2, 1, 16, 128});
    cs.push_back({2, 100, 2, 2, 48, 48});
    // Long sequences: many blocks of the reduce pass merged by their gate maxima.
    cs.push_back({1, 20000, 2, 1, 64, 64});
    cs.push_back({2, 5000, 4, 2, 64, 64, {}, padding::holes});
    // Many sequences, varlen with empty and length-1 sequences.
    cs.push_back({24, 600, 12, 12, 64, 64});
    cs.push_back({1, 1500, 4, 2, 64, 64, {0, 0, 1, 64, 64, 130, 500, 501, 1000, 1500}});
    // More query heads a KV head than the one-kernel path of D = Dv = 64 (a cluster of CTAs a
    // head) takes: the two-pass kernels of those dims.
    cs.push_back({2, 700, 66, 1, 64, 64, {}, padding::holes});
    // Pad tokens whose q, k, v, logits and gate are NaN.
    for (index_t T : {index_t(129), index_t(1000)}) {
      linear_case nan_pads{3, T, 4, 2, 64, 64, {}, T < 500 ? padding::holes : padding::right};
      nan_pads.nan_pads = true;
      cs.push_back(nan_pads);
    }
  }
  if (causal) {
    linear_case with_state{2, 50, 2, 1, 16, 8};
    with_state.with_state_in = true;
    cs.push_back(with_state);
    // Around the 64-token chunk, GQA, D != Dv.
    cs.push_back({2, 63, 4, 2, 64, 64});
    cs.push_back({2, 64, 4, 2, 64, 32});
    cs.push_back({1, 65, 2, 1, 32, 64});
    cs.push_back({2, 127, 6, 3, 64, 64, {}, padding::right});
    cs.push_back({1, 129, 2, 2, 128, 128});
    // Long sequences: cut into segments that run in parallel, with and without a state in.
    cs.push_back({1, 3000, 4, 2, 64, 64});
    linear_case long_state{1, 1500, 2, 1, 64, 96};
    long_state.with_state_in = true;
    cs.push_back(long_state);
    linear_case short_state{3, 130, 4, 2, 32, 32, {}, padding::left};
    short_state.with_state_in = true;
    cs.push_back(short_state);
    cs.push_back({1, 2100, 2, 1, 64, 64, {0, 0, 1, 700, 700, 2100}});
    // Enough (sequence, head) pairs to fill the GPU: one segment of several chunks each.
    cs.push_back({24, 600, 12, 12, 64, 64});
    // Rows that 16-byte loads cannot read (D, Dv not multiples of 8 halves).
    cs.push_back({2, 200, 4, 2, 12, 20});
    // Pad tokens whose q, k, v, logits and gate are NaN, in a chunk and across segments.
    for (index_t T : {index_t(129), index_t(1000)}) {
      linear_case nan_pads{3, T, 4, 2, 64, 64, {}, T < 500 ? padding::holes : padding::right};
      nan_pads.nan_pads = true;
      cs.push_back(nan_pads);
    }
    // The tensor-core scan (bfloat16, D = Dv = 64): one token, a state in with pads over
    // segments, packed sequences with empty and length-1 ones and four query heads a KV head.
    cs.push_back({1, 1, 1, 1, 64, 64});
    linear_case state_pads{2, 900, 8, 2, 64, 64, {}, padding::holes};
    state_pads.with_state_in = true;
    cs.push_back(state_pads);
    cs.push_back({1, 1500, 8, 2, 64, 64, {0, 0, 1, 64, 64, 130, 500, 501, 1000, 1500}});
  }
  return cs;
}

template <class Kind, class Policy, class T>
void sweep(std::uint64_t salt, const char* what) {
  const double tol = sizeof(T) == 2 ? 1e-2 : 2e-5;
  for (const linear_case& c : cuda_linear_cases(attnmix::linear_kind_traits<Kind>::causal)) {
    INFO("seed " << test_seed() << " " << c.describe() << " " << what << " dtype "
                 << attnmix::scalar_traits<T>::name);
    const linear_errors e = run_cuda_linear<Kind, Policy, T>(c, ++salt);
    CAPTURE(e.out, e.S, e.z, e.lse);
    CHECK(e.out <= tol);
    CHECK(e.S <= tol);
    CHECK(e.z <= tol);
    CHECK(e.lse <= tol);
  }
}

struct mamba_style : attnmix::gbla_policy {
  static constexpr attnmix::norm_gate_order order = attnmix::norm_gate_order::gate_then_norm;
  static constexpr attnmix::gate_activation activation = attnmix::gate_activation::sigmoid;
  static constexpr attnmix::key_gate gate = attnmix::key_gate::per_head;
  static constexpr attnmix::norm_weight weight = attnmix::norm_weight::per_head;
  static constexpr attnmix::feature_map phi = attnmix::feature_map::relu;
};
using unnormalised = attnmix::with_normalize<attnmix::bla_policy, false>;
struct causal_variant : attnmix::linear_causal_policy {
  static constexpr attnmix::key_gate gate = attnmix::key_gate::per_head;
  static constexpr bool normalize = false;
  static constexpr attnmix::feature_map phi = attnmix::feature_map::relu;
  static constexpr attnmix::gated_norm norm = attnmix::gated_norm::per_head;
  static constexpr attnmix::norm_gate_order order = attnmix::norm_gate_order::gate_then_norm;
};
using gated_causal = attnmix::with_gated_norm<
    attnmix::with_key_gate<attnmix::linear_causal_policy, attnmix::key_gate::shared>,
    attnmix::gated_norm::per_head>;

}  // namespace

TEMPLATE_TEST_CASE("CUDA BLA matches the CPU path", "[cuda][bla]", float, attnmix::half,
                   attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::bla, attnmix::bla_policy, TestType>(100, "bla_policy");
  sweep<attnmix::kind::bla, unnormalised, TestType>(200, "normaliser off");
}

TEMPLATE_TEST_CASE("CUDA GBLA core matches the CPU path", "[cuda][gbla]", float, attnmix::half,
                   attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::gbla, attnmix::gbla_policy, TestType>(300, "gbla_policy");
  sweep<attnmix::kind::gbla, mamba_style, TestType>(400, "per-head gate, gate then norm, sigmoid");
}

TEMPLATE_TEST_CASE("CUDA causal linear attention matches the CPU path", "[cuda][linear_causal]",
                   float, attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::linear_causal, attnmix::linear_causal_policy, TestType>(
      500, "linear_causal_policy");
  sweep<attnmix::kind::linear_causal, gated_causal, TestType>(600, "prefix key gate, gated norm");
  sweep<attnmix::kind::linear_causal, causal_variant, TestType>(
      700, "per-head prefix gate, no normaliser, relu, gate then norm");
}

// A few small shapes of every path (one segment, several segments, varlen, pads with NaN, a
// state in), quick enough for compute-sanitizer.
TEMPLATE_TEST_CASE("CUDA causal linear attention, small shapes", "[cuda][linear_causal][small]",
                   float, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  std::vector<linear_case> cs = {{1, 1, 1, 1, 8, 8},
                                 {2, 65, 4, 2, 32, 16},
                                 {1, 700, 2, 1, 16, 24},
                                 {1, 200, 4, 2, 12, 20, {0, 0, 1, 64, 64, 130, 200}},
                                 {1, 200, 4, 2, 64, 64, {0, 0, 1, 64, 64, 130, 200}}};
  for (index_t D : {index_t(16), index_t(64)}) {  // D = 64: the tensor-core scan in bfloat16
    linear_case nan_pads{3, 600, 2, 1, D, D == 16 ? 8 : 64, {}, padding::holes};
    nan_pads.nan_pads = true;
    nan_pads.with_state_in = true;
    cs.push_back(nan_pads);
  }
  std::uint64_t salt = 900;
  for (const linear_case& c : cs) {
    INFO("seed " << test_seed() << " " << c.describe() << " dtype "
                 << attnmix::scalar_traits<TestType>::name);
    const linear_errors e =
        run_cuda_linear<attnmix::kind::linear_causal, gated_causal, TestType>(c, ++salt);
    const double tol = sizeof(TestType) == 2 ? 1e-2 : 2e-5;
    CAPTURE(e.out, e.S, e.z, e.lse);
    CHECK(e.out <= tol);
    CHECK(e.S <= tol);
    CHECK(e.z <= tol);
    CHECK(e.lse <= tol);
  }
}

namespace {

// One causal call over [0, T) against two chained calls over [0, T1) and [T1, T) (state_out of
// the first is state_in of the second), on the GPU: the second call's rows and final state must
// equal the single call's. The halves are strided views into the full tensors.
template <class Policy, class T>
void check_chaining(index_t B, index_t Tn, index_t T1, index_t HQ, index_t H, index_t D, index_t Dv,
                    std::uint64_t salt) {
  using attnmix::view1;
  using attnmix::view3;
  using attnmix::view4;
  constexpr bool gated = Policy::gate != attnmix::key_gate::off;
  constexpr bool normed = Policy::norm != attnmix::gated_norm::off;
  const auto dev = attnmix::memory_space::device;
  const index_t Hg = Policy::gate == attnmix::key_gate::per_head ? H : 1;
  rng r(salt);
  auto normal = [&](std::size_t n, double sigma) {
    std::vector<float> x(n);
    for (float& e : x) e = static_cast<float>(r.normal() * sigma);
    return x;
  };
  const std::size_t nq = std::size_t(B * Tn * HQ * D), nk = std::size_t(B * Tn * H * D),
                    nv = std::size_t(B * Tn * H * Dv), no = std::size_t(B * Tn * HQ * Dv);
  device_buffer<T> q(convert_all<T>(normal(nq, 1))), k(convert_all<T>(normal(nk, 1))),
      v(convert_all<T>(normal(nv, 1))), gate(convert_all<T>(normal(no, 1)));
  device_buffer<float> a(normal(std::size_t(B * Tn * Hg), 2)), gamma(std::vector<float>(Dv, 1.25f));
  device_buffer<T> out_one(no), out_two(no);
  const std::size_t ns = std::size_t(B * H * D * Dv), nz = std::size_t(B * H * D),
                    nl = std::size_t(B * H);
  device_buffer<float> S_one(ns), z_one(nz), lse_one(nl), S_mid(ns), z_mid(nz), lse_mid(nl),
      S_two(ns), z_two(nz), lse_two(nl);

  auto call = [&](index_t t0, index_t len, T* out, float* S_in, float* z_in, float* lse_in,
                  float* S_out, float* z_out, float* lse_out) {
    attnmix::linear_attention_args<T> args;
    args.q =
        view4<const T>(q.get() + t0 * HQ * D, {B, len, HQ, D}, {Tn * HQ * D, HQ * D, D, 1}, dev);
    args.k = view4<const T>(k.get() + t0 * H * D, {B, len, H, D}, {Tn * H * D, H * D, D, 1}, dev);
    args.v =
        view4<const T>(v.get() + t0 * H * Dv, {B, len, H, Dv}, {Tn * H * Dv, H * Dv, Dv, 1}, dev);
    args.out = view4<T>(out + t0 * HQ * Dv, {B, len, HQ, Dv}, {Tn * HQ * Dv, HQ * Dv, Dv, 1}, dev);
    if constexpr (gated) {
      args.a = view3<const float>(a.get() + t0 * Hg, {B, len, Hg}, {Tn * Hg, Hg, 1}, dev);
      if (lse_in != nullptr)
        args.state_in.lse = attnmix::tensor_view<const float, 2>(lse_in, {B, H}, dev);
      args.state_out.lse = attnmix::tensor_view<float, 2>(lse_out, {B, H}, dev);
    }
    if constexpr (normed) {
      args.gate = view4<const T>(gate.get() + t0 * HQ * Dv, {B, len, HQ, Dv},
                                 {Tn * HQ * Dv, HQ * Dv, Dv, 1}, dev);
      args.gamma = view1<const float>(gamma.get(), {Dv}, dev);
    }
    if (S_in != nullptr) {
      args.state_in.S = view4<const float>(S_in, {B, H, D, Dv}, dev);
      args.state_in.z = view3<const float>(z_in, {B, H, D}, dev);
    }
    args.state_out.S = view4<float>(S_out, {B, H, D, Dv}, dev);
    args.state_out.z = view3<float>(z_out, {B, H, D}, dev);
    attnmix::linear_attention<attnmix::kind::linear_causal, Policy>(args, {},
                                                                    attnmix::backend::cuda{});
  };
  call(0, Tn, out_one.get(), nullptr, nullptr, nullptr, S_one.get(), z_one.get(), lse_one.get());
  call(0, T1, out_two.get(), nullptr, nullptr, nullptr, S_mid.get(), z_mid.get(), lse_mid.get());
  call(T1, Tn - T1, out_two.get(), S_mid.get(), z_mid.get(), lse_mid.get(), S_two.get(),
       z_two.get(), lse_two.get());
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "chained calls");

  const double tol = sizeof(T) == 2 ? 1e-2 : 2e-5;
  // 16-bit gated: the state update rounds w o v to bfloat16 once, w relative to the running
  // reference, which the split moves (the second call's is the carried log-sum-exp, where one
  // call's may be the last key's own logit, w = 1 exact). A dominant key then differs by its
  // rounding, 2^-9 of its term: the states agree to twice that, not to float.
  const double state_tol = sizeof(T) == 2 && gated ? 4e-3 : 2e-5;
  INFO("seed " << test_seed() << " B=" << B << " T=" << Tn << " T1=" << T1 << " HQ=" << HQ << " H="
               << H << " D=" << D << " Dv=" << Dv << " dtype " << attnmix::scalar_traits<T>::name);
  CHECK(rel_error(convert_all<double>(out_two.to_host()), convert_all<double>(out_one.to_host())) <=
        tol);
  CHECK(rel_error(S_two.to_host(), to_double(S_one.to_host())) <= state_tol);
  CHECK(rel_error(z_two.to_host(), to_double(z_one.to_host())) <= state_tol);
  if (gated) CHECK(lse_error(lse_two.to_host(), to_double(lse_one.to_host())) <= 2e-5);
}

}  // namespace

TEMPLATE_TEST_CASE("CUDA causal linear attention: state out then in equals one call",
                   "[cuda][linear_causal]", float, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  check_chaining<attnmix::linear_causal_policy, TestType>(2, 3000, 1100, 4, 2, 64, 48, 800);
  check_chaining<gated_causal, TestType>(2, 3000, 1100, 4, 2, 64, 48, 801);
  check_chaining<gated_causal, TestType>(3, 200, 65, 2, 1, 32, 32, 802);
  check_chaining<gated_causal, TestType>(1, 5000, 4999, 2, 2, 64, 64, 803);
}

// A few small shapes of the bidirectional kernels (tensor-core and portable), quick enough for
// compute-sanitizer.
TEMPLATE_TEST_CASE("CUDA GBLA core, small shapes", "[cuda][gbla][small]", attnmix::half,
                   attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  std::vector<linear_case> cs = {{1, 1, 1, 1, 64, 64},
                                 {2, 70, 2, 2, 32, 64},
                                 {1, 200, 2, 1, 128, 64, {0, 0, 1, 64, 64, 130, 200}},
                                 {2, 150, 4, 2, 64, 128, {}, padding::left},
                                 {1, 90, 2, 1, 24, 40},
                                 {1, 300, 4, 2, 64, 64, {0, 0, 1, 64, 64, 130, 300}},
                                 {1, 100, 65, 1, 64, 64}};
  linear_case nan_pads{3, 130, 4, 2, 64, 64, {}, padding::holes};
  nan_pads.nan_pads = true;
  cs.push_back(nan_pads);
  std::uint64_t salt = 950;
  for (const linear_case& c : cs) {
    INFO("seed " << test_seed() << " " << c.describe() << " dtype "
                 << attnmix::scalar_traits<TestType>::name);
    const linear_errors e = run_cuda_linear<attnmix::kind::gbla, mamba_style, TestType>(c, ++salt);
    CAPTURE(e.out, e.S, e.z, e.lse);
    CHECK(e.out <= 1e-2);
    CHECK(e.S <= 1e-2);
    CHECK(e.z <= 1e-2);
    CHECK(e.lse <= 1e-2);
  }
}

namespace {

// q, k, v as strided views into one packed [B, T, HQ*D + H*D + H*Dv] projection, first aligned
// (the tensor-core kernels), then shifted by one element (the portable kernels): both must
// equal the call on contiguous copies.
template <class T>
void check_packed_views(index_t B, index_t Tn, index_t HQ, index_t H, index_t D, index_t Dv,
                        std::uint64_t salt) {
  using attnmix::view1;
  using attnmix::view3;
  using attnmix::view4;
  const auto dev = attnmix::memory_space::device;
  rng r(salt);
  const index_t W = HQ * D + H * D + H * Dv;
  std::vector<float> packed(std::size_t(B * Tn * W + 1));
  for (float& x : packed) x = static_cast<float>(r.normal());
  std::vector<float> q(std::size_t(B * Tn * HQ * D)), k(std::size_t(B * Tn * H * D)),
      v(std::size_t(B * Tn * H * Dv)), gate(std::size_t(B * Tn * HQ * Dv)), a(std::size_t(B * Tn));
  for (index_t bt = 0; bt < B * Tn; ++bt) {
    for (index_t i = 0; i < HQ * D; ++i) q[bt * HQ * D + i] = packed[bt * W + i];
    for (index_t i = 0; i < H * D; ++i) k[bt * H * D + i] = packed[bt * W + HQ * D + i];
    for (index_t i = 0; i < H * Dv; ++i) v[bt * H * Dv + i] = packed[bt * W + HQ * D + H * D + i];
  }
  for (float& x : gate) x = static_cast<float>(r.normal());
  for (float& x : a) x = static_cast<float>(2 * r.normal());
  device_buffer<T> dq(convert_all<T>(q)), dk(convert_all<T>(k)), dv(convert_all<T>(v)),
      dgate(convert_all<T>(gate)), dpacked(convert_all<T>(packed));
  device_buffer<float> da(a), dgamma(std::vector<float>(std::size_t(Dv), 0.75f));
  const std::size_t no = std::size_t(B * Tn * HQ * Dv);
  device_buffer<T> out_ref(no), out_packed(no), out_shifted(no);

  auto call = [&](const T* qp, const T* kp, const T* vp, index_t row, T* out) {
    attnmix::linear_attention_args<T> args;
    const index_t sq = row == 0 ? HQ * D : row, sk = row == 0 ? H * D : row,
                  sv = row == 0 ? H * Dv : row;
    args.q = view4<const T>(qp, {B, Tn, HQ, D}, {Tn * sq, sq, D, 1}, dev);
    args.k = view4<const T>(kp, {B, Tn, H, D}, {Tn * sk, sk, D, 1}, dev);
    args.v = view4<const T>(vp, {B, Tn, H, Dv}, {Tn * sv, sv, Dv, 1}, dev);
    args.out = view4<T>(out, {B, Tn, HQ, Dv}, dev);
    args.a = view3<const float>(da.get(), {B, Tn, 1}, dev);
    args.gate = view4<const T>(dgate.get(), {B, Tn, HQ, Dv}, dev);
    args.gamma = view1<const float>(dgamma.get(), {Dv}, dev);
    attnmix::linear_attention<attnmix::kind::gbla, attnmix::gbla_policy>(args, {},
                                                                         attnmix::backend::cuda{});
  };
  call(dq.get(), dk.get(), dv.get(), 0, out_ref.get());
  const T* base = dpacked.get();
  call(base, base + HQ * D, base + HQ * D + H * D, W, out_packed.get());
  // The packed copy shifted by one element: rows no longer 16-byte aligned.
  device_buffer<T> shifted(convert_all<T>(std::vector<float>(packed.size(), 0.f)));
  attnmix::detail::cuda::check(cudaMemcpy(shifted.get() + 1, base, (packed.size() - 1) * sizeof(T),
                                          cudaMemcpyDeviceToDevice),
                               "shift");
  call(shifted.get() + 1, shifted.get() + 1 + HQ * D, shifted.get() + 1 + HQ * D + H * D, W,
       out_shifted.get());
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "packed views");
  const std::vector<double> ref = convert_all<double>(out_ref.to_host());
  INFO("seed " << test_seed() << " B=" << B << " T=" << Tn << " HQ=" << HQ << " H=" << H
               << " D=" << D << " Dv=" << Dv << " dtype " << attnmix::scalar_traits<T>::name);
  CHECK(rel_error(convert_all<double>(out_packed.to_host()), ref) <= 1e-6);
  CHECK(rel_error(convert_all<double>(out_shifted.to_host()), ref) <= 1e-2);
}

}  // namespace

TEMPLATE_TEST_CASE("CUDA GBLA core: packed and unaligned strided views", "[cuda][gbla]",
                   attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  check_packed_views<TestType>(2, 777, 4, 2, 64, 64, 960);
  check_packed_views<TestType>(1, 300, 2, 2, 64, 128, 961);
}

// A call captured into a CUDA graph and replayed gives the direct call's output, bit for bit:
// with 4 query heads a KV head on Hopper the one-kernel path (a cluster launch), with 66 the
// two-pass kernels (their scratch allocation, memset and the read kernel's dependent launch
// become graph nodes).
TEST_CASE("CUDA GBLA core: a call captured into a CUDA graph", "[cuda][gbla][graph]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using T = attnmix::bfloat16;
  using attnmix::detail::cuda::check;
  const auto dev = attnmix::memory_space::device;
  const index_t B = 2, Tn = 1000, D = 64;
  for (const auto& heads : {std::pair<index_t, index_t>{4, 4}, {66, 1}}) {
    const index_t HQ = heads.first, H = heads.second;
    INFO("HQ " << HQ << " H " << H);
    rng r(970);
    auto normals = [&](std::size_t n, double s) {
      std::vector<float> x(n);
      for (float& e : x) e = static_cast<float>(s * r.normal());
      return x;
    };
    const std::size_t n = std::size_t(B * Tn * HQ * D), nkv = std::size_t(B * Tn * H * D);
    device_buffer<T> q(convert_all<T>(normals(n, 1))), k(convert_all<T>(normals(nkv, 1))),
        v(convert_all<T>(normals(nkv, 1))), gate(convert_all<T>(normals(n, 1))), out_direct(n),
        out_graph(n);
    device_buffer<float> a(normals(std::size_t(B * Tn), 2)),
        gamma(std::vector<float>(std::size_t(D), 0.75f));
    cudaStream_t stream = nullptr;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    auto call = [&](T* out) {
      attnmix::linear_attention_args<T> args;
      args.q = attnmix::view4<const T>(q.get(), {B, Tn, HQ, D}, dev);
      args.k = attnmix::view4<const T>(k.get(), {B, Tn, H, D}, dev);
      args.v = attnmix::view4<const T>(v.get(), {B, Tn, H, D}, dev);
      args.out = attnmix::view4<T>(out, {B, Tn, HQ, D}, dev);
      args.a = attnmix::view3<const float>(a.get(), {B, Tn, 1}, dev);
      args.gate = attnmix::view4<const T>(gate.get(), {B, Tn, HQ, D}, dev);
      args.gamma = attnmix::view1<const float>(gamma.get(), {D}, dev);
      attnmix::linear_attention<attnmix::kind::gbla, attnmix::gbla_policy>(
          args, {}, attnmix::backend::cuda{stream});
    };
    call(out_direct.get());
    check(cudaStreamSynchronize(stream), "direct call");
    const std::vector<T> direct = out_direct.to_host();
    bool finite = true;
    for (float x : convert_all<float>(direct)) finite = finite && std::isfinite(x);
    REQUIRE(finite);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    call(out_graph.get());
    check(cudaStreamEndCapture(stream, &graph), "end capture");
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    for (int replay = 0; replay < 2; ++replay) {
      check(cudaMemsetAsync(out_graph.get(), 0xff, n * sizeof(T), stream), "poison");  // NaNs
      check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
      check(cudaStreamSynchronize(stream), "replay");
      const std::vector<T> replayed = out_graph.to_host();
      INFO("replay " << replay);
      CHECK(std::memcmp(direct.data(), replayed.data(), n * sizeof(T)) == 0);
    }
    check(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
    check(cudaGraphDestroy(graph), "cudaGraphDestroy");
    check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  }
}
