// CPU layers and stacks.
//   BM_encoder/T: the [SA, GBLA, GBLA] x 3 encoder and a 9-layer SA-only encoder side by side in
//     each iteration (B = 1, D = 256, 4 heads, SwiGLU MLP); counters: both times, the measured
//     speedup, the speedup the FLOP counts predict, and measured / predicted.
//   BM_path_fox_decode/L: one decoding step of a PaTH-FoX layer (D = 256, 4 heads) after a
//     prefill of L tokens; per-token time should grow linearly with L (O(L D) per token).

#include <benchmark/benchmark.h>

#include <chrono>
#include <random>
#include <vector>

#include <attnmix/attnmix.hpp>

#include "encoder_flops.hpp"

namespace {

using attnmix::index_t;
namespace layer = attnmix::layer;
namespace L = attnmix::layers;
using hybrid = attnmix::stack<float, attnmix::repeat<3, layer::sa, layer::gbla, layer::gbla>>;
using sa_only = attnmix::stack<float, attnmix::repeat<9, layer::sa>>;

L::config bench_config() {
  L::config c;
  c.hidden_size = 256;
  c.num_heads = 4;
  return c;
}

using attnmix_bench::block_flops;

attnmix::host_tensor<float, 3> random_input(index_t B, index_t T, index_t D) {
  std::mt19937_64 gen(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  attnmix::host_tensor<float, 3> x({B, T, D});
  for (auto& v : x.storage()) v = normal(gen);
  return x;
}

void BM_encoder(benchmark::State& state) {
  const index_t T = state.range(0);
  const L::config c = bench_config();
  hybrid h(c);
  sa_only s(c);
  L::randomize_parameters(h, 1);
  L::randomize_parameters(s, 2);
  const auto x = random_input(1, T, c.hidden_size);
  attnmix::host_tensor<float, 3> y(x.shape());
  double th = 0, ts = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    h.forward(x.view(), y.view());
    auto t1 = std::chrono::steady_clock::now();
    s.forward(x.view(), y.view());
    auto t2 = std::chrono::steady_clock::now();
    const double a = std::chrono::duration<double>(t1 - t0).count();
    const double b = std::chrono::duration<double>(t2 - t1).count();
    th += a, ts += b;
    state.SetIterationTime(a + b);
    benchmark::DoNotOptimize(y.data());
  }
  const double it = double(state.iterations());
  const double fh = 3 * block_flops(true, c, double(T)) + 6 * block_flops(false, c, double(T));
  const double fs = 9 * block_flops(true, c, double(T));
  state.counters["hybrid_ms"] = 1e3 * th / it;
  state.counters["sa_only_ms"] = 1e3 * ts / it;
  state.counters["hybrid_GFLOPs"] = fh / (th / it) / 1e9;
  state.counters["sa_only_GFLOPs"] = fs / (ts / it) / 1e9;
  state.counters["measured_speedup"] = ts / th;
  state.counters["predicted_speedup"] = fs / fh;
  state.counters["pct_of_predicted"] = 100.0 * (ts / th) / (fs / fh);
}
BENCHMARK(BM_encoder)
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(16384)
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

void BM_path_fox_decode(benchmark::State& state) {
  const index_t Lc = state.range(0), steps = 64;
  const L::config c = bench_config();
  layer::path_fox::type<float> m(c);
  L::randomize_parameters(m, 3);
  const auto x = random_input(1, Lc, c.hidden_size);
  attnmix::host_tensor<float, 3> y(x.shape());
  auto cache = m.make_cache(1, Lc + steps + 1);
  m.prefill(x.view(), y.view(), cache);
  const auto x1 = random_input(1, 1, c.hidden_size);
  attnmix::host_tensor<float, 3> y1(x1.shape());
  for (auto _ : state) {
    m.decode(x1.view(), y1.view(), cache, attnmix::backend::cpu{1});
    benchmark::DoNotOptimize(y1.data());
  }
  state.counters["cache_len"] = double(Lc);
  // Bytes of the K and V caches one step reads (keys are also rewritten): O(L D).
  state.counters["kv_bytes"] = double(2 * Lc * c.hidden_size * sizeof(float));
}
BENCHMARK(BM_path_fox_decode)
    ->Arg(1024)
    ->Arg(2048)
    ->Arg(4096)
    ->Arg(8192)
    ->Iterations(64)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
