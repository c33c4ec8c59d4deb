// Device-side regression tests of the validation rework (issue 23, item 6) and of the one
// device-pointer check of the front doors. Each runs the CUDA backend and compares it with the CPU
// reference path; without a GPU they report Skipped.

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "attnmix/cuda.cuh"
#include "support/catch.hpp"
#include "support/cuda_testing.cuh"
#include "support/testing.hpp"

using namespace attnmix_test;
using attnmix::host_tensor;
using attnmix::index_t;

namespace {

const auto dev = attnmix::memory_space::device;

template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const attnmix::error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not attnmix::error: ") + e.what();
  }
  return "no exception";
}

}  // namespace

TEST_CASE("CUDA: a host pointer marked as device memory is rejected once, by the front door",
          "[cuda][validation]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  constexpr index_t T = 16, H = 1, D = 64;
  std::vector<float> host_q(T * H * D, 0.5f);
  device_buffer<float> k(T * H * D), v(T * H * D), out(T * H * D);
  attnmix::attention_args<float> a{attnmix::view4<const float>(host_q.data(), {1, T, H, D}, dev),
                                   attnmix::view4<const float>(k.get(), {1, T, H, D}, dev),
                                   attnmix::view4<const float>(v.get(), {1, T, H, D}, dev),
                                   attnmix::view4<float>(out.get(), {1, T, H, D}, dev)};
  const std::string msg = message_of(
      [&] { attnmix::attention<attnmix::kind::softmax>(a, {}, attnmix::backend::cuda{}); });
  INFO(msg);
  CHECK(msg.rfind("attnmix::attention<softmax>: argument 'q' is marked as device memory", 0) == 0);
  attnmix::linear_attention_args<float> la{a.q, a.k, a.v, a.out};
  const std::string lmsg = message_of(
      [&] { attnmix::linear_attention<attnmix::kind::bla>(la, {}, attnmix::backend::cuda{}); });
  INFO(lmsg);
  CHECK(lmsg.rfind("attnmix::linear_attention<bla>: argument 'q' is marked as device memory", 0) ==
        0);
}

TEST_CASE("CUDA: a window near the index type's maximum means no window", "[cuda][validation]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  constexpr index_t B = 2, T = 77, HQ = 2, H = 1, D = 64, Dv = 64;
  rng r(41);
  host_tensor<float, 4> q({B, T, HQ, D}), k({B, T, H, D}), v({B, T, H, Dv});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v);
  device_buffer<float> dq(q.storage()), dk(k.storage()), dv(v.storage());
  const auto run = [&](index_t window) {
    device_buffer<float> out(B * T * HQ * Dv);
    attnmix::attention_args<float> a{attnmix::view4<const float>(dq.get(), {B, T, HQ, D}, dev),
                                     attnmix::view4<const float>(dk.get(), {B, T, H, D}, dev),
                                     attnmix::view4<const float>(dv.get(), {B, T, H, Dv}, dev),
                                     attnmix::view4<float>(out.get(), {B, T, HQ, Dv}, dev)};
    attnmix::attention_params p;
    p.window = window;
    attnmix::attention<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy>(
        a, p, attnmix::backend::cuda{});
    attnmix::detail::cuda::check(cudaDeviceSynchronize(), "kernel");
    return out.to_host();
  };
  const auto none = run(0);
  for (float x : none) REQUIRE(std::isfinite(x));
  CHECK(bitwise_equal(run(std::numeric_limits<index_t>::max()), none));
  CHECK(bitwise_equal(run(std::numeric_limits<index_t>::max() - 1), none));
}

TEST_CASE("CUDA: cu_seqlens in device memory is rejected before any launch", "[cuda][validation]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  // The front door reads the offsets itself, so they are host memory whatever the backend.
  constexpr index_t T = 16, H = 1, D = 64;
  device_buffer<float> q(T * H * D), k(T * H * D), v(T * H * D), out(T * H * D);
  std::vector<std::int32_t> cu{0, 5, T};
  attnmix::attention_args<float> a{attnmix::view4<const float>(q.get(), {1, T, H, D}, dev),
                                   attnmix::view4<const float>(k.get(), {1, T, H, D}, dev),
                                   attnmix::view4<const float>(v.get(), {1, T, H, D}, dev),
                                   attnmix::view4<float>(out.get(), {1, T, H, D}, dev)};
  attnmix::attention_params p;
  p.cu_seqlens = attnmix::view1<const std::int32_t>(cu.data(), {3}, dev);
  const std::string msg = message_of(
      [&] { attnmix::attention<attnmix::kind::softmax>(a, p, attnmix::backend::cuda{}); });
  INFO(msg);
  CHECK(msg.find("argument 'cu_seqlens' is in device memory") != std::string::npos);
}

TEST_CASE("CUDA: GBLA and gated causal LA with every key-gate logit -inf give 0",
          "[cuda][validation]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  constexpr index_t B = 2, T = 70, HQ = 2, H = 1, D = 64, Dv = 64;
  rng r(42);
  host_tensor<float, 4> q({B, T, HQ, D}), k({B, T, H, D}), v({B, T, H, Dv}), gate({B, T, HQ, Dv});
  host_tensor<float, 3> a({B, T, 1});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v), r.fill_normal(gate), r.fill_normal(a);
  for (index_t t = 0; t < T; ++t) a(1, t, 0) = -std::numeric_limits<float>::infinity();
  device_buffer<float> dq(q.storage()), dk(k.storage()), dv(v.storage()), dgate(gate.storage()),
      da(a.storage());
  const auto run = [&](auto kind, auto policy, bool on_device) {
    using Kind = decltype(kind);
    using Policy = decltype(policy);
    const auto space = on_device ? dev : attnmix::memory_space::host;
    const auto pick = [&](const device_buffer<float>& d, const host_tensor<float, 4>& h) {
      return on_device ? static_cast<const float*>(d.get()) : h.data();
    };
    device_buffer<float> dout(B * T * HQ * Dv);
    host_tensor<float, 4> hout({B, T, HQ, Dv});
    attnmix::linear_attention_args<float> la{
        attnmix::view4<const float>(pick(dq, q), {B, T, HQ, D}, space),
        attnmix::view4<const float>(pick(dk, k), {B, T, H, D}, space),
        attnmix::view4<const float>(pick(dv, v), {B, T, H, Dv}, space),
        attnmix::view4<float>(on_device ? dout.get() : hout.data(), {B, T, HQ, Dv}, space)};
    la.a = attnmix::view3<const float>(on_device ? static_cast<const float*>(da.get()) : a.data(),
                                       {B, T, 1}, space);
    if constexpr (Policy::norm != attnmix::gated_norm::off)
      la.gate = attnmix::view4<const float>(pick(dgate, gate), {B, T, HQ, Dv}, space);
    if (on_device) {
      attnmix::linear_attention<Kind, Policy>(la, {}, attnmix::backend::cuda{});
      attnmix::detail::cuda::check(cudaDeviceSynchronize(), "kernel");
      return dout.to_host();
    }
    attnmix::linear_attention<Kind, Policy>(la);
    return hout.storage();
  };
  using causal = attnmix::with_key_gate<attnmix::linear_causal_policy, attnmix::key_gate::shared>;
  for (int which = 0; which < 2; ++which) {
    INFO((which == 0 ? "gbla" : "linear_causal"));
    const auto gpu = which == 0 ? run(attnmix::kind::gbla{}, attnmix::gbla_policy{}, true)
                                : run(attnmix::kind::linear_causal{}, causal{}, true);
    const auto cpu = which == 0 ? run(attnmix::kind::gbla{}, attnmix::gbla_policy{}, false)
                                : run(attnmix::kind::linear_causal{}, causal{}, false);
    for (float x : gpu) REQUIRE(std::isfinite(x));
    for (std::size_t i = static_cast<std::size_t>(T * HQ * Dv); i < gpu.size(); ++i)
      CHECK(gpu[i] == 0.0f);
    CHECK(rel_error(gpu, to_double(cpu)) <= 1e-5);
  }
}

// A forget gate of -inf (a hard reset) zeroes every earlier key, as on the CPU: the gate cumsum
// (cuda/kernels/gate_cumsum.cuh) sums it as 0 and keeps each token's last reset, and every kernel
// cuts its rows' keys there. Float takes the SIMT kernel, 16-bit the Hopper or (portable) the
// mma.sync kernel; two resets in one key tile, one at the first token, one per head elsewhere.
TEMPLATE_TEST_CASE("CUDA: FoX with a log gate of -inf (a hard reset) matches the CPU",
                   "[cuda][validation][hard_reset]", float, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using T = TestType;
  constexpr index_t T_ = 300, HQ = 2, H = 1, D = 64, Dv = 64;
  rng r(43);
  host_tensor<float, 4> q({1, T_, HQ, D}), k({1, T_, H, D}), v({1, T_, H, Dv});
  host_tensor<float, 3> g({1, T_, HQ});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v), r.fill_uniform(g, -0.2, -0.01);
  const float inf = std::numeric_limits<float>::infinity();
  for (index_t t : {index_t(40), index_t(45), index_t(130), index_t(191)}) g(0, t, 0) = -inf;
  g(0, 0, 1) = -inf, g(0, 100, 1) = -inf, g(0, 257, 1) = -inf;
  // The CPU reference sees the inputs rounded to T.
  auto rounded = [](const host_tensor<float, 4>& x) {
    host_tensor<float, 4> y = x;
    y.storage() = convert_all<float>(convert_all<T>(x.storage()));
    return y;
  };
  const host_tensor<float, 4> qr = rounded(q), kr = rounded(k), vr = rounded(v);
  host_tensor<float, 4> ref({1, T_, HQ, Dv});
  attnmix::attention_args<float> h{qr.view(), kr.view(), vr.view(), ref.view()};
  h.g = g.view();
  attnmix::attention<attnmix::kind::fox>(h);
  device_buffer<T> dq(convert_all<T>(q.storage())), dk(convert_all<T>(k.storage())),
      dv(convert_all<T>(v.storage())), dout(T_ * HQ * Dv);
  device_buffer<float> dg(g.storage());
  attnmix::attention_args<T> a{attnmix::view4<const T>(dq.get(), {1, T_, HQ, D}, dev),
                               attnmix::view4<const T>(dk.get(), {1, T_, H, D}, dev),
                               attnmix::view4<const T>(dv.get(), {1, T_, H, Dv}, dev),
                               attnmix::view4<T>(dout.get(), {1, T_, HQ, Dv}, dev)};
  a.g = attnmix::view3<const float>(dg.get(), {1, T_, HQ}, dev);
  attnmix::backend::cuda portable{};
  portable.portable = true;
  for (const attnmix::backend::cuda& be : {attnmix::backend::cuda{}, portable}) {
    INFO("portable " << be.portable);
    attnmix::attention<attnmix::kind::fox>(a, {}, be);
    attnmix::detail::cuda::check(cudaDeviceSynchronize(), "kernel");
    const std::vector<double> out = convert_all<double>(dout.to_host());
    CHECK(rel_error(out, to_double(ref.storage())) <= (sizeof(T) == 4 ? 1e-5 : 5e-3));
  }
}
