// Stacks on the GPU (attnmix::device_stack, bfloat16).
//   BM_encoder_cuda/T/B/D/heads: the [SA, GBLA, GBLA] x 3 encoder and a 9-layer SA-only encoder
//     side by side, each timed with CUDA events; counters: both times, the measured speedup, the
//     speedup the FLOP counts predict, and measured / predicted. Shapes: the CPU benchmark's
//     (B = 1, D = 256, 4 heads) and the GBLA paper's encoder width (D = 1024, 16 heads).
//   BM_decode_cuda<Layer>/N/L: a 12-layer causal model of width 1024 and 16 heads (PaTH-FoX, and
//     SA + RoPE) serving N sequences: the prefill of N prompts of L tokens beside the stack's
//     forward over them, then decoding steps from L cached tokens on. Counters: the step's time
//     against its memory floor (every weight and every cached byte read once, at the rate of a
//     device-to-device copy timed in the same run), and prefill / forward; the SA model also
//     with its decoding through the forward's kernels instead of the split decoding kernel
//     (attention_decode_splits).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

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

// Milliseconds of call() on the default stream: the median of `reps` after one warm-up.
template <class Call>
double median_ms(Call&& call, int reps) {
  call();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) ms.push_back(attnmix_bench::event_ms(call));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Bytes a second of a device-to-device copy moves (read + written), 2 GiB a copy.
double copy_rate() {
  const std::size_t bytes = std::size_t{1} << 31;
  void *src = nullptr, *dst = nullptr;
  attnmix::detail::cuda::check(cudaMalloc(&src, bytes), "cudaMalloc");
  attnmix::detail::cuda::check(cudaMalloc(&dst, bytes), "cudaMalloc");
  attnmix::detail::cuda::check(cudaMemset(src, 1, bytes), "cudaMemset");
  const double ms =
      median_ms([&] { cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice); }, 5);
  cudaFree(src), cudaFree(dst);
  return 2.0 * double(bytes) / (ms * 1e-3);
}

template <class Layer, bool split = true>
void BM_decode_cuda(benchmark::State& state) {
  namespace cu = attnmix::detail::cuda;
  const bool saved = cu::attention_decode_splits();
  cu::attention_decode_splits() = split;  // SA and FoX decoding: the split kernel or not
  const index_t N = state.range(0), Lc = state.range(1);
  L::config c;
  c.hidden_size = 1024;
  c.num_heads = 16;
  using host = attnmix::stack<float, attnmix::repeat<12, Layer>>;
  host h(c);
  L::randomize_parameters(h, 3);
  const attnmix::device_stack<host, bf16> g(h);
  const index_t W = c.hidden_size, steps = 64;
  const auto dev = attnmix::memory_space::device;
  attnmix_bench::device_array<bf16> x(std::size_t(N * Lc * W), 1, -2.f, 2.f),
      y(std::size_t(N * Lc * W)), xs(std::size_t(N * W), 2, -2.f, 2.f), ys(std::size_t(N * W));
  const attnmix::view3<const bf16> vx(x.ptr, {N, Lc, W}, dev), vxs(xs.ptr, {N, 1, W}, dev);
  const attnmix::view3<bf16> vy(y.ptr, {N, Lc, W}, dev), vys(ys.ptr, {N, 1, W}, dev);
  auto cache = g.make_cache(N, Lc + steps + 8);
  const double forward_ms = median_ms([&] { g.forward(vx, vy); }, 3);
  const double prefill_ms = median_ms([&] { g.prefill(vx, vy, cache); }, 3);
  g.prefill(vx, vy, cache);   // the cache holds the L prompt tokens again
  g.decode(vxs, vys, cache);  // warm-up
  std::vector<double> step_ms;
  for (auto _ : state) {  // one step an iteration; the cache grows by a token each
    step_ms.push_back(attnmix_bench::event_ms([&] { g.decode(vxs, vys, cache); }));
    state.SetIterationTime(step_ms.back() * 1e-3);
  }
  std::sort(step_ms.begin(), step_ms.end());
  // The floor: weights in bf16, each cached key and value in bf16 (and the PaTH-FoX gate sums in
  // double), read once.
  double weights = 0;
  h.visit_parameters([&](const std::string&, auto& p) { weights += 2.0 * double(p.data.size()); });
  const double tokens = double(N) * double(Lc), d = double(c.dim());
  const double per_token =
      double(c.kv_heads()) * 2.0 * d * 2.0 +
      (attnmix::kind_traits<typename Layer::kind>::uses_forget_gate ? 8.0 * double(c.num_heads)
                                                                    : 0.0);
  const double bytes = weights + 12.0 * tokens * per_token;
  const double floor_ms = bytes / copy_rate() * 1e3;
  const double median = step_ms[step_ms.size() / 2];
  state.counters["step_ms"] = median;
  state.counters["floor_ms"] = floor_ms;
  state.counters["step_over_floor"] = median / floor_ms;
  state.counters["GB"] = bytes / 1e9;
  state.counters["prefill_ms"] = prefill_ms;
  state.counters["forward_ms"] = forward_ms;
  state.counters["prefill_over_forward"] = prefill_ms / forward_ms;
  cu::attention_decode_splits() = saved;
}
// The issue's serving shape: 32 sequences of 4096 cached tokens, a step an iteration.
void decode_shape(benchmark::internal::Benchmark* b) {
  b->Args({32, 4096})->ArgNames({"N", "L"})->Iterations(64)->UseManualTime();
  b->Unit(benchmark::kMillisecond);
}
BENCHMARK_TEMPLATE(BM_decode_cuda, attnmix::layer::path_fox)
    ->Name("decode_path_fox_12x1024")
    ->Apply(decode_shape);
BENCHMARK_TEMPLATE(BM_decode_cuda, attnmix::layer::causal_sa_rope)
    ->Name("decode_sa_rope_12x1024")
    ->Apply(decode_shape);
BENCHMARK_TEMPLATE(BM_decode_cuda, attnmix::layer::causal_sa_rope, false)
    ->Name("decode_sa_rope_12x1024_forward_kernels")
    ->Apply(decode_shape);

}  // namespace
