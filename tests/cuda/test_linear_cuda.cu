// CUDA BLA, GBLA and causal linear attention against the CPU path in double, in float, half
// and bfloat16: outputs and the states they return.

#include <cstdint>
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
  if (causal) {
    linear_case with_state{2, 50, 2, 1, 16, 8};
    with_state.with_state_in = true;
    cs.push_back(with_state);
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
                   float, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::linear_causal, attnmix::linear_causal_policy, TestType>(
      500, "linear_causal_policy");
  sweep<attnmix::kind::linear_causal, gated_causal, TestType>(600, "prefix key gate, gated norm");
}
