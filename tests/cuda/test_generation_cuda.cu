// Generation on the GPU: a device stack's caches (make_cache), prefill and decode of every causal
// mixer kind, against the same device stack's full forward and the host stack in double with the
// same weights; slot mappings, packed prompts with an empty one, and argument checks; a device
// language model's greedy generation against its forward.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attnmix/cuda.cuh"
#include "attnmix/train/language_model.hpp"
#include "layers/custom_layers.hpp"
#include "layers/layer_harness.hpp"
#include "support/cuda_testing.cuh"
#include "support/testing.hpp"

namespace {

using namespace attnmix_test;
using attnmix::host_tensor;
using attnmix::index_t;
namespace L = attnmix::layers;
namespace layer = attnmix::layer;
using namespace custom_layers;

L::config make_config(index_t heads, index_t kv_heads, index_t window = 0) {
  L::config c;
  c.hidden_size = 128;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.intermediate_size = 192;
  c.w_rank = 16;
  c.window = window;
  return c;
}

template <class D>
std::vector<double> to_double(const device_buffer<D>& b) {
  const std::vector<D> h = b.to_host();
  std::vector<double> out(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) out[i] = static_cast<float>(h[i]);
  return out;
}

template <class D>
attnmix::view3<const D> dview(const device_buffer<D>& b, index_t B, index_t T, index_t W) {
  return {b.get(), {B, T, W}, attnmix::memory_space::device};
}
template <class D>
attnmix::view3<D> dview(device_buffer<D>& b, index_t B, index_t T, index_t W) {
  return {b.get(), {B, T, W}, attnmix::memory_space::device};
}

// N sequences of T tokens: prompts of lengths[n] tokens prefilled together (packed, into slots
// slots[n] of a cache of `slots_total`), then one token at a time for every sequence whose prompt
// was not empty... and the empty ones too (from an empty slot). Every output row (prompt and
// decoded) against the device stack's full forward (tol_fwd) and the host stack in double
// (tol_ref).
template <class D, class... Layers>
void check_generation(const L::config& c, const std::vector<index_t>& lengths,
                      const std::vector<std::int32_t>& slots, index_t slots_total,
                      std::uint64_t salt, double tol_fwd, double tol_ref) {
  using host_f = attnmix::stack<float, Layers...>;
  using host_d = attnmix::stack<double, Layers...>;
  rng r(salt);
  INFO("seed " << test_seed() << " salt " << salt);
  host_f sf(c);
  L::randomize_parameters(sf, test_seed() ^ salt, 0.15, 0.3);
  sf.visit_parameters([](const std::string&, auto& p) {  // weights D holds exactly
    for (auto& v : p.data) v = static_cast<float>(static_cast<D>(static_cast<float>(v)));
  });
  host_d sd(c);
  copy_parameters(sf, sd);
  const attnmix::device_stack<host_f, D> gpu(sf);

  const auto N = static_cast<index_t>(lengths.size());
  const index_t T = 19, W = c.hidden_size, n = N * T * W;
  std::vector<D> xd(static_cast<std::size_t>(n));
  host_tensor<double, 3> x({N, T, W}), want({N, T, W});
  for (index_t i = 0; i < n; ++i) {
    xd[std::size_t(i)] = static_cast<D>(static_cast<float>(r.normal()));
    x.storage()[std::size_t(i)] = static_cast<float>(xd[std::size_t(i)]);
  }
  sd.forward(x.view(), want.view());
  device_buffer<D> dx(xd), dfull(static_cast<std::size_t>(n));
  gpu.forward(dview(dx, N, T, W), dview(dfull, N, T, W));
  const std::vector<double> full = to_double(dfull);

  // The prompts, packed.
  std::vector<std::int32_t> cu{0};
  for (index_t l : lengths) cu.push_back(cu.back() + std::int32_t(l));
  std::vector<D> pd(static_cast<std::size_t>(cu.back() * W));
  for (index_t s = 0; s < N; ++s)
    for (index_t t = 0; t < lengths[std::size_t(s)]; ++t)
      for (index_t e = 0; e < W; ++e)
        pd[std::size_t((cu[std::size_t(s)] + t) * W + e)] = xd[std::size_t((s * T + t) * W + e)];
  device_buffer<D> dp(pd), dpo(pd.size());
  auto cache = gpu.make_cache(slots_total, T);
  const attnmix::view1<const std::int32_t> cu_view(cu.data(), {index_t(cu.size())});
  gpu.prefill(dview(dp, 1, cu.back(), W), dview(dpo, 1, cu.back(), W), cache, L::cache_slots(slots),
              cu_view);
  const std::vector<double> prompt_out = to_double(dpo);

  std::vector<double> got(static_cast<std::size_t>(n), 0.0), ref_full(got.size()),
      ref_double(got.size());
  std::vector<bool> seen(got.size(), false);
  for (index_t s = 0; s < N; ++s)
    for (index_t t = 0; t < lengths[std::size_t(s)]; ++t)
      for (index_t e = 0; e < W; ++e) {
        const auto i = std::size_t((s * T + t) * W + e);
        got[i] = prompt_out[std::size_t((cu[std::size_t(s)] + t) * W + e)];
        seen[i] = true;
      }
  // Then every sequence a token at a time, from its prompt's end (shorter ones first alone).
  const index_t shortest = *std::min_element(lengths.begin(), lengths.end());
  for (index_t t = shortest; t < T; ++t) {
    std::vector<std::int32_t> step_slots;
    std::vector<index_t> seqs;
    for (index_t s = 0; s < N; ++s)
      if (t >= lengths[std::size_t(s)])
        seqs.push_back(s), step_slots.push_back(slots[std::size_t(s)]);
    const auto M = static_cast<index_t>(seqs.size());
    std::vector<D> xs(static_cast<std::size_t>(M * W));
    for (index_t m = 0; m < M; ++m)
      for (index_t e = 0; e < W; ++e)
        xs[std::size_t(m * W + e)] = xd[std::size_t((seqs[std::size_t(m)] * T + t) * W + e)];
    device_buffer<D> dxs(xs), dys(xs.size());
    gpu.decode(dview(dxs, M, 1, W), dview(dys, M, 1, W), cache, L::cache_slots(step_slots));
    const std::vector<double> ys = to_double(dys);
    for (index_t m = 0; m < M; ++m)
      for (index_t e = 0; e < W; ++e) {
        const auto i = std::size_t((seqs[std::size_t(m)] * T + t) * W + e);
        got[i] = ys[std::size_t(m * W + e)];
        seen[i] = true;
      }
  }
  for (bool b : seen) REQUIRE(b);
  for (index_t s = 0; s < N; ++s) CHECK(std::get<0>(cache).length(slots[std::size_t(s)]) == T);
  const double e_fwd = rel_error(got, full), e_ref = rel_error(got, want.storage());
  INFO("against the device forward " << e_fwd << ", against the host stack in double " << e_ref);
  CHECK(e_fwd <= tol_fwd);
  CHECK(e_ref <= tol_ref);
}

constexpr double float_tol = 1e-5, bf16_tol = 6e-2;

template <class D>
void run_all(double tol_fwd, double tol_ref) {
  const L::config mha = make_config(2, 2), gqa = make_config(4, 2);
  SECTION("PaTH-FoX, FoX, SA, PaTH, causal linear attention (MHA)") {
    check_generation<D, layer::path_fox, layer::fox, layer::causal_sa, layer::path,
                     layer::linear_causal>(mha, {5, 0, 11}, {3, 0, 4}, 5, 1, tol_fwd, tol_ref);
  }
  SECTION("RoPE SA, output-gated FoX, normed PaTH-FoX, causal GBLA (GQA)") {
    check_generation<D, rope_sa, gated_fox, normed_path_fox, causal_gbla>(
        gqa, {7, 1, 3, 0}, {1, 2, 0, 3}, 4, 2, tol_fwd, tol_ref);
  }
  SECTION("sliding windows") {
    check_generation<D, layer::causal_sa, layer::fox>(make_config(2, 2, 4), {9, 2}, {1, 0}, 2, 3,
                                                      tol_fwd, tol_ref);
  }
}

}  // namespace

TEST_CASE("device stacks prefill and decode as their forward, in float", "[generation][float]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  run_all<float>(float_tol, float_tol);
}

TEST_CASE("device stacks prefill and decode as their forward, in bfloat16", "[generation][bf16]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  run_all<attnmix::bfloat16>(bf16_tol, bf16_tol);
}

TEST_CASE("device generation refuses bad slots before writing anything", "[generation][errors]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using host = attnmix::stack<float, layer::path_fox, layer::causal_sa, layer::linear_causal>;
  const L::config c = make_config(2, 2);
  host hs(c);
  L::randomize_parameters(hs, 7, 0.15, 0.3);
  const attnmix::device_stack<host, float> gpu(hs);
  const index_t W = c.hidden_size;
  auto cache = gpu.make_cache(2, 4);
  device_buffer<float> x(std::vector<float>(std::size_t(2 * 4 * W), 0.5f)),
      y(std::vector<float>(std::size_t(2 * 4 * W), 0.f));
  gpu.prefill(dview(x, 2, 3, W), dview(y, 2, 3, W), cache);
  const std::vector<std::int32_t> bad{0, 2}, twice{1, 1};
  ATTNMIX_CHECK_ERROR(gpu.decode(dview(x, 2, 1, W), dview(y, 2, 1, W), cache, L::cache_slots(bad)),
                      "slots");
  ATTNMIX_CHECK_ERROR(
      gpu.decode(dview(x, 2, 1, W), dview(y, 2, 1, W), cache, L::cache_slots(twice)), "slots");
  ATTNMIX_CHECK_ERROR(gpu.prefill(dview(x, 2, 4, W), dview(y, 2, 4, W), cache, L::cache_slots(bad)),
                      "slots");
  // Nothing moved: the lengths are the prefill's.
  CHECK(std::get<0>(cache).length(0) == 3);
  CHECK(std::get<2>(cache).length(1) == 3);
  gpu.decode(dview(x, 2, 1, W), dview(y, 2, 1, W), cache);
  CHECK(std::get<1>(cache).length(1) == 4);
  ATTNMIX_CHECK_ERROR(gpu.decode(dview(x, 2, 1, W), dview(y, 2, 1, W), cache), "is full");
  // A cache larger than the device is a bad capacity, named before anything is allocated.
  const index_t huge = index_t{1} << 36;
  ATTNMIX_CHECK_ERROR((void)gpu.make_cache(2, huge), "bytes of the device's memory");
  using sa_only = attnmix::stack<float, layer::causal_sa, layer::fox, layer::linear_causal>;
  sa_only hs2(c);
  const attnmix::device_stack<sa_only, float> gpu2(hs2);
  ATTNMIX_CHECK_ERROR((void)gpu2.make_cache(2, huge), "bytes of the device's memory");
  ATTNMIX_CHECK_ERROR((void)gpu2.make_cache(huge, 1), "bytes of the device's memory");
}

TEST_CASE("a device language model generates as its forward would", "[generation][lm]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using host_stack = attnmix::stack<float, layer::path_fox, layer::causal_sa, layer::linear_causal>;
  using host_lm = attnmix::train::language_model<host_stack>;
  using gpu_lm = attnmix::train::language_model<attnmix::device_stack<host_stack, float>>;
  const L::config c = make_config(2, 2);
  const index_t V = 23, N = 3, P = 5, steps = 12;
  host_lm h(c, V);
  L::randomize_parameters(h, test_seed() ^ 91, 0.15, 0.3);
  const gpu_lm g(h);
  rng r(92);
  std::vector<std::int32_t> prompt(std::size_t(N * P));
  for (auto& t : prompt) t = std::int32_t(r.integer(0, V - 1));
  const attnmix::tensor_view<const std::int32_t, 2> pv(prompt.data(), {N, P});
  const attnmix::backend::cuda be{};
  const host_tensor<std::int32_t, 2> out = g.generate(pv, steps, be);
  REQUIRE(out.extent(1) == steps);
  // Every new token is the argmax of the device forward's logits over what came before it, up
  // to the rounding between the cached and the full computation.
  std::vector<std::int32_t> seq(std::size_t(N * (P + steps - 1)));
  const index_t len = P + steps - 1;
  for (index_t n = 0; n < N; ++n)
    for (index_t i = 0; i < len; ++i)
      seq[std::size_t(n * len + i)] = i < P ? prompt[std::size_t(n * P + i)] : out(n, i - P);
  device_buffer<float> logits(std::size_t(N * len * V));
  g.forward(attnmix::tensor_view<const std::int32_t, 2>(seq.data(), {N, len}),
            attnmix::view3<float>(logits.get(), {N, len, V}, attnmix::memory_space::device), be);
  const std::vector<float> z = logits.to_host();
  for (index_t n = 0; n < N; ++n)
    for (index_t t = 0; t < steps; ++t) {
      const float* row = z.data() + (n * len + P - 1 + t) * V;
      const float best = *std::max_element(row, row + V);
      INFO("sequence " << n << " step " << t << " token " << out(n, t));
      CHECK(row[out(n, t)] >= best - 1e-4f * std::max(1.f, std::abs(best)));
    }
}
