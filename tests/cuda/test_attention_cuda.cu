// CUDA softmax attention and FoX against the CPU path in double, in float, half and bfloat16.

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attnmix/cuda.cuh"
#include "cpu/attention_harness.hpp"
#include "support/cuda_testing.cuh"

using namespace attnmix_test;
using attnmix::index_t;

namespace {

struct cuda_case_result {
  double error;        // kernel vs double
  double plain_error;  // float CPU path on the same inputs, output rounded to T, vs double
  double lse_error;
};

// q, k, v drawn in float and rounded to T; the double reference sees the rounded values.
// `row_pad` adds elements between tokens (an unaligned stride when odd).
template <class Kind, class Policy, class T>
cuda_case_result run_cuda_case(const attention_case& c, std::uint64_t salt, index_t row_pad,
                               attnmix::backend::cuda be) {
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  rng r(salt);
  attnmix::host_tensor<float, 4> qf({c.B, c.T, c.HQ, c.D + row_pad}),
      kf({c.B, c.T, c.H, c.D + row_pad}), vf({c.B, c.T, c.H, c.Dv + row_pad});
  attnmix::host_tensor<float, 3> g({c.B, c.T, c.HQ});
  r.fill_normal(qf), r.fill_normal(kf), r.fill_normal(vf);
  r.fill_uniform(g, c.gate_lo, c.gate_hi);
  const auto q = convert_all<T>(qf.storage()), k = convert_all<T>(kf.storage()),
             v = convert_all<T>(vf.storage());

  attnmix::attention_params params;
  params.scale = c.scale;
  params.window = c.window;
  if (!c.cu_seqlens.empty())
    params.cu_seqlens = {c.cu_seqlens.data(), {static_cast<index_t>(c.cu_seqlens.size())}};

  // Views over [.., D + row_pad] storage that use the first D elements of each head.
  auto view_of = [&](auto* data, index_t H, index_t D, attnmix::memory_space s) {
    using E = std::remove_pointer_t<decltype(data)>;
    const index_t Dp = D + row_pad;
    return attnmix::view4<E>(data, {c.B, c.T, H, D}, {c.T * H * Dp, H * Dp, Dp, 1}, s);
  };
  const auto dev = attnmix::memory_space::device, host = attnmix::memory_space::host;

  // The kernel.
  device_buffer<T> dq(q), dk(k), dv(v), dout(static_cast<std::size_t>(c.B * c.T * c.HQ * c.Dv));
  device_buffer<float> dg(g.storage()), dlse(static_cast<std::size_t>(c.B * c.T * c.HQ));
  attnmix::attention_args<T> a{view_of(static_cast<const T*>(dq.get()), c.HQ, c.D, dev),
                               view_of(static_cast<const T*>(dk.get()), c.H, c.D, dev),
                               view_of(static_cast<const T*>(dv.get()), c.H, c.Dv, dev),
                               attnmix::view4<T>(dout.get(), {c.B, c.T, c.HQ, c.Dv}, dev)};
  if constexpr (gated) a.g = attnmix::view3<const float>(dg.get(), {c.B, c.T, c.HQ}, dev);
  a.lse = attnmix::view3<float>(dlse.get(), {c.B, c.T, c.HQ}, dev);
  attnmix::attention<Kind, Policy>(a, params, be);
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "kernel");
  const auto out = convert_all<double>(dout.to_host());
  const auto lse = convert_all<double>(dlse.to_host());

  // The CPU path in double (the reference) and in float (the "plain" computation).
  const auto qd = convert_all<double>(q), kd = convert_all<double>(k), vd = convert_all<double>(v);
  const auto gd = convert_all<double>(g.storage());
  std::vector<double> ref(out.size()), ref_lse(lse.size());
  attnmix::attention_args<double> ad{view_of(qd.data(), c.HQ, c.D, host),
                                     view_of(kd.data(), c.H, c.D, host),
                                     view_of(vd.data(), c.H, c.Dv, host),
                                     attnmix::view4<double>(ref.data(), {c.B, c.T, c.HQ, c.Dv})};
  if constexpr (gated) ad.g = attnmix::view3<const double>(gd.data(), {c.B, c.T, c.HQ});
  ad.lse = attnmix::view3<double>(ref_lse.data(), {c.B, c.T, c.HQ});
  attnmix::attention<Kind, Policy>(ad, params);

  const auto qs = convert_all<float>(q), ks = convert_all<float>(k), vs = convert_all<float>(v);
  std::vector<float> plain(out.size());
  attnmix::attention_args<float> af{view_of(qs.data(), c.HQ, c.D, host),
                                    view_of(ks.data(), c.H, c.D, host),
                                    view_of(vs.data(), c.H, c.Dv, host),
                                    attnmix::view4<float>(plain.data(), {c.B, c.T, c.HQ, c.Dv})};
  if constexpr (gated) af.g = g.view();
  attnmix::attention<Kind, Policy>(af, params);
  const auto plain_rounded = convert_all<double>(convert_all<T>(plain));

  return {rel_error(out, ref), rel_error(plain_rounded, ref), lse_error(lse, ref_lse)};
}

std::vector<attention_case> cuda_cases() {
  std::vector<attention_case> cases = standard_cases();
  cases.push_back({2, 300, 4, 2, 64, 64});
  cases.push_back({1, 257, 2, 1, 128, 128});
  cases.push_back({1, 190, 4, 4, 64, 128, 0, {0, 1, 100, 100, 190}});
  cases.push_back({2, 140, 2, 1, 128, 64, 33});
  cases.push_back({1, 100, 2, 2, 96, 40});  // head dims the tensor-core kernel does not tile
  cases.push_back({1, 2048, 4, 2, 64, 64});
  // More work items (row tiles x heads x sequences) than an H200 has SMs, so that a persistent
  // CTA carries its pipeline across items: dense, and varlen with empty and one-token sequences.
  cases.push_back({4, 200, 48, 12, 64, 64});
  std::vector<std::int32_t> offsets{0};
  for (int n = 0; n < 40; ++n) offsets.push_back(offsets.back() + (n * 37) % 150 * (n % 7 != 3));
  offsets.push_back(offsets.back() + 1);
  cases.push_back({1, offsets.back(), 8, 4, 64, 64, 0, offsets});
  cases.push_back({1, offsets.back(), 8, 8, 64, 64, 100, offsets});
  // Strong decay (gate terms in the hundreds); a negative and a zero scale, which the Hopper
  // kernel hands to the portable one.
  cases.push_back({2, 400, 4, 2, 64, 64, 0, {}, std::nullopt, -6.0, -0.5});
  cases.push_back({1, 300, 2, 1, 64, 64, 0, {}, -0.2});
  cases.push_back({1, 130, 2, 1, 64, 64, 0, {}, 0.0});
  return cases;
}

// Short enough for compute-sanitizer: every kernel path, tail tiles, varlen, windows, and (at
// T = 300) items whose key tiles go round the Hopper kernel's ring of stages.
std::vector<attention_case> small_cases() {
  return {{1, 70, 2, 1, 64, 64, 0, {0, 0, 1, 70}},
          {1, 300, 2, 1, 64, 64},
          {2, 33, 2, 2, 128, 64, 9},
          {1, 20, 2, 1, 40, 24}};
}

template <class Kind, class Policy, class T>
void sweep(std::uint64_t salt, index_t row_pad = 0, bool small = false,
           attnmix::backend::cuda be = {}) {
  for (const attention_case& c : small ? small_cases() : cuda_cases()) {
    INFO("seed " << test_seed() << " " << c.describe() << " dtype "
                 << attnmix::scalar_traits<T>::name << " row_pad " << row_pad << " portable "
                 << be.portable);
    const cuda_case_result r = run_cuda_case<Kind, Policy, T>(c, ++salt, row_pad, be);
    CAPTURE(r.error, r.plain_error, r.lse_error);
    CHECK(r.error <= tolerance<T>());
    if constexpr (sizeof(T) == 2) CHECK(r.error <= 2 * r.plain_error);
    CHECK(r.lse_error <= (sizeof(T) == 2 ? 1e-2 : 1e-5));
  }
}

}  // namespace

TEMPLATE_TEST_CASE("CUDA softmax attention matches the CPU path", "[cuda][softmax]", float,
                   attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(1000);
  sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, TestType>(2000);
}

TEMPLATE_TEST_CASE("CUDA FoX matches the CPU path in both gate conventions", "[cuda][fox]", float,
                   attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(3000);
  sweep<attnmix::kind::fox,
        attnmix::with_gate_scaling<attnmix::fox_policy, attnmix::gate_scaling::before_scale>,
        TestType>(4000);
}

// On a Hopper GPU the 16-bit cases above run the wgmma kernel; these run the mma.sync one that
// other GPUs take.
TEMPLATE_TEST_CASE("CUDA attention on the portable tensor-core kernel", "[cuda][softmax]",
                   attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  attnmix::backend::cuda portable{};
  portable.portable = true;
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(8000, 0, false, portable);
  sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, TestType>(8100, 0, false,
                                                                                 portable);
  sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(8200, 0, false, portable);
}

TEST_CASE("CUDA attention on unaligned strides takes the portable kernel", "[cuda][softmax]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, attnmix::bfloat16>(5000, 3);
  sweep<attnmix::kind::fox, attnmix::fox_policy, attnmix::half>(6000, 1);
}

TEST_CASE("CUDA attention, a small sweep for compute-sanitizer", "[cuda][small]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, attnmix::bfloat16>(7000, 0, true);
  sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, attnmix::half>(7100, 0,
                                                                                      true);
  sweep<attnmix::kind::fox, attnmix::fox_policy, float>(7200, 0, true);
  sweep<attnmix::kind::fox, attnmix::fox_policy, attnmix::bfloat16>(7300, 0, true);
}

TEST_CASE("CUDA attention rejects host pointers marked as device memory", "[cuda][errors]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  std::vector<float> host(4 * 8 * 2 * 16, 1.0f);
  device_buffer<float> d(host.size()), out(host.size());
  const auto dev = attnmix::memory_space::device;
  attnmix::view4<const float> good(d.get(), {4, 8, 2, 16}, dev),
      lying(host.data(), {4, 8, 2, 16}, dev);
  try {
    attnmix::attention<attnmix::kind::softmax>(
        attnmix::attention_args<float>{good, lying, good,
                                       attnmix::view4<float>(out.get(), {4, 8, 2, 16}, dev)},
        {}, attnmix::backend::cuda{});
    FAIL("accepted");
  } catch (const attnmix::error& e) {
    CHECK(std::string(e.what()).find("argument 'k' is marked as device memory") !=
          std::string::npos);
  }
  for (float x : out.to_host()) CHECK(std::isnan(x));  // untouched
}
