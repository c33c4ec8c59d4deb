// The decoder (causal self-attention, cross-attention to a memory of other lengths, a SwiGLU MLP)
// on the GPU against the same decoder on the CPU: the forward, and the training forward and
// backward (dx, d(memory) and every parameter's gradient), in float and in bfloat16, with dense
// and packed memories; and decoding from a memory remembered in device caches. Cross-attention is
// the softmax front door with keys of other lengths (cu_seqlens_k, key_slots), forward and
// backward.

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "attnmix/cuda.cuh"
#include "attnmix/stack/decoder.hpp"
#include "support/catch.hpp"
#include "support/cuda_testing.cuh"
#include "support/testing.hpp"

namespace {

using namespace attnmix_test;
using attnmix::index_t;
namespace L = attnmix::layers;
using gpu_be = attnmix::backend::cuda;
using host_decoder = attnmix::decoder<float>;
template <class T>
using device_decoder = attnmix::decoder<T, attnmix::decoder_policy, gpu_be>;

L::config config() {
  L::config c;
  c.hidden_size = 128;
  c.num_heads = 2;  // head dim 64: the tensor-core forward kernels in bfloat16
  c.intermediate_size = 192;
  return c;
}

// x [B, T, D] against memory [B, Tm, D], or both packed (cu, cu_m non-empty, B == 1).
struct shapes {
  index_t B, T, Tm;
  std::vector<std::int32_t> cu{}, cu_m{};
  attnmix::decoder_inputs inputs() const {
    attnmix::decoder_inputs in;
    if (!cu.empty()) {
      in.cu_seqlens = {cu.data(), {index_t(cu.size())}};
      in.cu_seqlens_memory = {cu_m.data(), {index_t(cu_m.size())}};
    }
    return in;
  }
};

std::vector<shapes> all_shapes() {
  return {{2, 9, 30}, {1, 12, 20, {0, 1, 7, 7, 12}, {0, 4, 5, 9, 20}}, {2, 70, 5}};
}

template <class M>
std::vector<std::pair<std::string, std::vector<double>>> device_grads(const M& m) {
  std::vector<std::pair<std::string, std::vector<double>>> out;
  m.visit_parameters([&](const std::string& name, const auto& p) {
    const auto g = p.grad_values();
    out.emplace_back(name, std::vector<double>(g.begin(), g.end()));
  });
  return out;
}
std::vector<std::pair<std::string, std::vector<double>>> host_grads(const host_decoder& m) {
  std::vector<std::pair<std::string, std::vector<double>>> out;
  m.visit_parameters([&](const std::string& name, const auto& p) {
    out.emplace_back(name, p.grad.empty() ? std::vector<double>(std::size_t(p.numel()), 0.0)
                                          : std::vector<double>(p.grad.begin(), p.grad.end()));
  });
  return out;
}

template <class T>
std::vector<double> to_double(const device_buffer<T>& b) {
  return convert_all<double>(b.to_host());
}

// Relative errors allowed: float on both sides differs by the order of its sums; bfloat16 by its
// roundings (a few 2^-9 through a few dozen roundings, as the mixed-precision step test).
template <class T>
constexpr double out_tol() {
  return std::is_same_v<T, float> ? 1e-5 : 2e-2;
}
template <class T>
constexpr double grad_tol() {
  return std::is_same_v<T, float> ? 1e-4 : 3e-2;
}

template <class T>
void check_decoder(std::uint64_t salt) {
  const L::config c = config();
  const index_t D = c.hidden_size;
  host_decoder host(c, 2);
  L::randomize_parameters(host, test_seed() ^ salt, 0.1, 0.2);
  const auto dev = attnmix::memory_space::device;
  rng r(salt);
  for (const shapes& s : all_shapes()) {
    INFO("seed " << test_seed() << " dtype " << attnmix::scalar_traits<T>::name << " B=" << s.B
                 << " T=" << s.T << " Tm=" << s.Tm << " packed=" << !s.cu.empty());
    const std::size_t nx = std::size_t(s.B * s.T * D), nm = std::size_t(s.B * s.Tm * D);
    std::vector<float> x(nx), mem(nm), dout(nx);
    for (auto* v : {&x, &mem, &dout})
      for (float& e : *v) e = float(r.normal());
    // The CPU sees the inputs rounded to T, as the GPU does.
    const auto xt = convert_all<T>(x), mt = convert_all<T>(mem), dt = convert_all<T>(dout);
    const auto xh = convert_all<float>(xt), mh = convert_all<float>(mt),
               dh = convert_all<float>(dt);
    const attnmix::view3<const float> hx(xh.data(), {s.B, s.T, D}), hm(mh.data(), {s.B, s.Tm, D}),
        hd(dh.data(), {s.B, s.T, D});
    std::vector<float> out_h(nx), dx_h(nx), dmem_h(nm);
    host_decoder h(host);
    h.visit_parameters([](const std::string&, auto& p) { p.zero_grad(); });
    typename host_decoder::saved_type hs;
    h.forward(hx, hm, attnmix::view3<float>(out_h.data(), {s.B, s.T, D}), hs, s.inputs());
    h.backward(hm, hd, attnmix::view3<float>(dx_h.data(), {s.B, s.T, D}),
               attnmix::view3<float>(dmem_h.data(), {s.B, s.Tm, D}), hs);

    device_decoder<T> d(host);
    d.visit_parameters([](const std::string&, auto& p) { p.zero_grad(); });
    device_buffer<T> gx(xt), gm(mt), gd(dt), out(nx), out2(nx), dx(nx), dmem(nm);
    const attnmix::view3<const T> vx(gx.get(), {s.B, s.T, D}, dev),
        vm(gm.get(), {s.B, s.Tm, D}, dev), vd(gd.get(), {s.B, s.T, D}, dev);
    d.forward(vx, vm, attnmix::view3<T>(out.get(), {s.B, s.T, D}, dev), s.inputs(), gpu_be{});
    typename device_decoder<T>::saved_type ds;
    d.forward(vx, vm, attnmix::view3<T>(out2.get(), {s.B, s.T, D}, dev), ds, s.inputs(), gpu_be{});
    d.backward(vm, vd, attnmix::view3<T>(dx.get(), {s.B, s.T, D}, dev),
               attnmix::view3<T>(dmem.get(), {s.B, s.Tm, D}, dev), ds, gpu_be{});
    attnmix::detail::cuda::check(cudaDeviceSynchronize(), "decoder");

    const auto want = convert_all<double>(out_h);
    const double e_out = rel_error(to_double(out), want), e_out2 = rel_error(to_double(out2), want);
    const double e_dx = rel_error(to_double(dx), convert_all<double>(dx_h));
    const double e_dm = rel_error(to_double(dmem), convert_all<double>(dmem_h));
    CAPTURE(e_out, e_out2, e_dx, e_dm);
    CHECK(e_out <= out_tol<T>());
    CHECK(e_out2 <= out_tol<T>());
    CHECK(e_dx <= grad_tol<T>());
    CHECK(e_dm <= grad_tol<T>());
    if (s.cu.empty()) {  // decoding from the memory remembered in a device cache: the same rows
      auto cache = d.make_memory_cache(s.B + 1, s.Tm);
      d.remember(vm, cache, {}, gpu_be{});
      std::vector<std::int32_t> slots(static_cast<std::size_t>(s.B));
      for (index_t b = 0; b < s.B; ++b) slots[std::size_t(b)] = std::int32_t(b);
      device_buffer<T> out3(nx);
      d.forward(vx, attnmix::view3<T>(out3.get(), {s.B, s.T, D}, dev), cache, slots, gpu_be{});
      const double e_out3 = rel_error(to_double(out3), want);
      CAPTURE(e_out3);
      CHECK(e_out3 <= out_tol<T>());
    }
    const auto gh = host_grads(h), gg = device_grads(d);
    REQUIRE(gh.size() == gg.size());
    for (std::size_t i = 0; i < gh.size(); ++i) {
      REQUIRE(gh[i].first == gg[i].first);
      const double e = rel_error(gg[i].second, gh[i].second);
      INFO("d " << gh[i].first << ": relative error " << e);
      CHECK(e <= grad_tol<T>());
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("the decoder on the GPU matches the CPU, forward and backward",
                   "[cuda][decoder]", float, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  check_decoder<TestType>(700);
}
