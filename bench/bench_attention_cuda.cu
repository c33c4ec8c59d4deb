// CUDA softmax attention and FoX forward, bf16, timed with CUDA events (manual time).
// Shapes are those of bench/sdpa_peer.py, which times PyTorch's SDPA beside these and prints
// the ratio table. FLOPs: 4*B*H*T^2*D bidirectional, half of that causal.

#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "attnmix/cuda.cuh"

namespace {

using attnmix::index_t;
using attnmix::detail::cuda::check;

template <class T>
struct device_array {
  T* ptr = nullptr;
  explicit device_array(std::size_t n, float lo = -1.f, float hi = 1.f, unsigned seed = 1) {
    check(cudaMalloc(&ptr, n * sizeof(T)), "cudaMalloc");
    std::vector<T> h(n);
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    for (auto& x : h) x = attnmix::convert<T>(dist(gen));
    check(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~device_array() { cudaFree(ptr); }
};

// args: B, T, H, causal
template <class Kind, class Policy>
void BM_attention_cuda(benchmark::State& state) {
  using T = attnmix::bfloat16;
  const index_t B = state.range(0), Tn = state.range(1), H = state.range(2), D = 64;
  const std::size_t n = static_cast<std::size_t>(B * Tn * H * D);
  device_array<T> q(n, -1, 1, 1), k(n, -1, 1, 2), v(n, -1, 1, 3), out(n);
  device_array<float> g(static_cast<std::size_t>(B * Tn * H), -0.1f, -0.01f, 4);
  const auto dev = attnmix::memory_space::device;
  attnmix::attention_args<T> a{attnmix::view4<const T>(q.ptr, {B, Tn, H, D}, dev),
                               attnmix::view4<const T>(k.ptr, {B, Tn, H, D}, dev),
                               attnmix::view4<const T>(v.ptr, {B, Tn, H, D}, dev),
                               attnmix::view4<T>(out.ptr, {B, Tn, H, D}, dev)};
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate)
    a.g = attnmix::view3<const float>(g.ptr, {B, Tn, H}, dev);
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event"), check(cudaEventCreate(&stop), "event");
  for (int i = 0; i < 3; ++i) attnmix::attention<Kind, Policy>(a, {}, attnmix::backend::cuda{});
  for (auto _ : state) {
    check(cudaEventRecord(start), "record");
    attnmix::attention<Kind, Policy>(a, {}, attnmix::backend::cuda{});
    check(cudaEventRecord(stop), "record");
    check(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    state.SetIterationTime(ms / 1e3);
  }
  const bool causal = Policy::mask == attnmix::mask_type::causal;
  const double flops = 4.0 * B * H * double(Tn) * double(Tn) * D * (causal ? 0.5 : 1.0);
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  cudaEventDestroy(start), cudaEventDestroy(stop);
}

void causal_shapes(benchmark::internal::Benchmark* b) {
  for (auto [B, T] : {std::pair{32, 2048}, {32, 4096}, {8, 8192}, {4, 16384}}) b->Args({B, T, 32});
  b->ArgNames({"B", "T", "H"})->UseManualTime()->Unit(benchmark::kMillisecond);
}
void bidirectional_shapes(benchmark::internal::Benchmark* b) {
  for (int T : {2048, 4096, 8192, 16384, 32768}) b->Args({8, T, 16});
  b->ArgNames({"B", "T", "H"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK_TEMPLATE(BM_attention_cuda, attnmix::kind::softmax, attnmix::softmax_policy)
    ->Name("sa_causal")->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_attention_cuda, attnmix::kind::fox, attnmix::fox_policy)
    ->Name("fox_causal")->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_attention_cuda, attnmix::kind::softmax, attnmix::bidirectional_softmax_policy)
    ->Name("sa_bidirectional")->Apply(bidirectional_shapes);
