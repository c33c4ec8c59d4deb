// Stacks on the GPU (attnmix::device_stack, bfloat16).
//   BM_encoder_cuda/T/B/D/heads: the [SA, GBLA, GBLA] x 3 encoder and a 9-layer SA-only encoder
//     side by side, each timed with CUDA events; counters: both times, the measured speedup, the
//     speedup the FLOP counts predict, and measured / predicted. Shapes: the CPU benchmark's
//     (B = 1, D = 256, 4 heads) and the GBLA paper's encoder width (D = 1024, 16 heads).

#include <benchmark/benchmark.h>

#include <attnmix/cuda.cuh>

#include "cuda_bench.cuh"
#include "encoder_flops.hpp"

namespace {

using attnmix::index_t;
namespace layer = attnmix::layer;
namespace L = attnmix::layers;
using bf16 = attnmix::bfloat16;
using hybrid = attnmix::stack<float, attnmix::repeat<3, layer::sa, layer::gbla, layer::gbla>>;
using sa_only = attnmix::stack<float, attnmix::repeat<9, layer::sa>>;

void BM_encoder_cuda(benchmark::State& state) {
  const index_t T = state.range(0), B = state.range(1);
  L::config c;
  c.hidden_size = state.range(2);
  c.num_heads = state.range(3);
  hybrid h(c);
  sa_only s(c);
  L::randomize_parameters(h, 1);
  L::randomize_parameters(s, 2);
  const attnmix::device_stack<hybrid, bf16> gh(h);
  const attnmix::device_stack<sa_only, bf16> gs(s);
  const std::size_t n = std::size_t(B * T * c.hidden_size);
  attnmix_bench::device_array<bf16> x(n, 1, -2.f, 2.f), y(n);
  const auto dev = attnmix::memory_space::device;
  const attnmix::view3<const bf16> vx(x.ptr, {B, T, c.hidden_size}, dev);
  const attnmix::view3<bf16> vy(y.ptr, {B, T, c.hidden_size}, dev);
  // Warm-up (cuBLAS picks its kernels, the stream-ordered pool fills), then both stacks one
  // after the other in every iteration.
  for (int i = 0; i < 2; ++i) gh.forward(vx, vy), gs.forward(vx, vy);
  using attnmix::detail::cuda::check;
  cudaEvent_t e[3];
  for (auto& ev : e) check(cudaEventCreate(&ev), "cudaEventCreate");
  double th = 0, ts = 0;
  for (auto _ : state) {
    check(cudaEventRecord(e[0]), "cudaEventRecord");
    gh.forward(vx, vy);
    check(cudaEventRecord(e[1]), "cudaEventRecord");
    gs.forward(vx, vy);
    check(cudaEventRecord(e[2]), "cudaEventRecord");
    check(cudaEventSynchronize(e[2]), "cudaEventSynchronize");
    float a = 0, b = 0;
    check(cudaEventElapsedTime(&a, e[0], e[1]), "cudaEventElapsedTime");
    check(cudaEventElapsedTime(&b, e[1], e[2]), "cudaEventElapsedTime");
    th += a, ts += b;
    state.SetIterationTime((a + b) * 1e-3);
  }
  for (auto& ev : e) cudaEventDestroy(ev);
  th /= double(state.iterations()), ts /= double(state.iterations());
  const double fh = B * (3 * attnmix_bench::block_flops(true, c, double(T)) +
                         6 * attnmix_bench::block_flops(false, c, double(T)));
  const double fs = B * 9 * attnmix_bench::block_flops(true, c, double(T));
  state.counters["hybrid_ms"] = th;
  state.counters["sa_only_ms"] = ts;
  state.counters["hybrid_TFLOPs"] = fh / (th * 1e-3) / 1e12;
  state.counters["sa_only_TFLOPs"] = fs / (ts * 1e-3) / 1e12;
  state.counters["measured_speedup"] = ts / th;
  state.counters["predicted_speedup"] = fs / fh;
  state.counters["pct_of_predicted"] = 100.0 * (ts / th) / (fs / fh);
}
BENCHMARK(BM_encoder_cuda)
    ->Args({1024, 1, 256, 4})
    ->Args({4096, 1, 256, 4})
    ->Args({16384, 1, 256, 4})
    ->Args({2048, 8, 1024, 16})
    ->Args({8192, 8, 1024, 16})
    ->Args({32768, 2, 1024, 16})
    ->Iterations(5)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
