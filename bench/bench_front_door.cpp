// Host cost of a public call's argument checks, with no kernel behind them: what every call
// pays before its first kernel, visible in a short CUDA call's time (docs/performance.md, "A
// call's host work"). The checks do not depend on the sizes or on the backend's memory space, so
// small host tensors stand in. Peer: an empty loop body (Google Benchmark's own overhead).

#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"

namespace {

using attnmix::index_t;
constexpr index_t B = 2, T = 16, H = 2, D = 8;

struct host_inputs {
  std::vector<float> q = std::vector<float>(B * T * H * D, 0.5f), k = q, v = q, out = q, gate = q,
                     w = q;
  std::vector<float> per_token = std::vector<float>(B * T * H, 0.5f),
                     gamma = std::vector<float>(D, 1.f);
};

// q, k, v and out of either front door's arguments.
template <class Args>
void set_qkv_out(Args& a, host_inputs& in) {
  a.q = attnmix::view4<const float>(in.q.data(), {B, T, H, D});
  a.k = attnmix::view4<const float>(in.k.data(), {B, T, H, D});
  a.v = attnmix::view4<const float>(in.v.data(), {B, T, H, D});
  a.out = attnmix::view4<float>(in.out.data(), {B, T, H, D});
}

void BM_empty(benchmark::State& state) {
  for (auto _ : state) benchmark::ClobberMemory();
}

// GBLA core: q, k, v, out, the key-gate logits, the output gate and gamma.
void BM_checks_gbla(benchmark::State& state) {
  host_inputs in;
  attnmix::linear_attention_args<float> a;
  set_qkv_out(a, in);
  a.a = attnmix::view3<const float>(in.per_token.data(), {B, T, 1});
  a.gate = attnmix::view4<const float>(in.gate.data(), {B, T, H, D});
  a.gamma = attnmix::view1<const float>(in.gamma.data(), {D});
  const std::string fn = "attnmix::linear_attention<gbla>";
  for (auto _ : state) {
    auto p = attnmix::detail::validate_linear_attention<attnmix::kind::gbla, attnmix::gbla_policy,
                                                        float, attnmix::backend::cpu>(fn, a, {});
    benchmark::DoNotOptimize(p);
  }
}

// PaTH-FoX: q, k, v, out, w, beta and the forget gate.
void BM_checks_path_fox(benchmark::State& state) {
  host_inputs in;
  attnmix::attention_args<float> a;
  set_qkv_out(a, in);
  a.w = attnmix::view4<const float>(in.w.data(), {B, T, H, D});
  a.beta = attnmix::view3<const float>(in.per_token.data(), {B, T, H});
  a.g = attnmix::view3<const float>(in.per_token.data(), {B, T, H});
  const std::string fn = "attnmix::attention<path_fox>";
  for (auto _ : state) {
    auto p =
        attnmix::detail::validate_attention<attnmix::kind::path_fox, float, attnmix::backend::cpu>(
            fn, a, {}, true);
    benchmark::DoNotOptimize(p);
  }
}

}  // namespace

BENCHMARK(BM_empty);
BENCHMARK(BM_checks_gbla);
BENCHMARK(BM_checks_path_fox);
