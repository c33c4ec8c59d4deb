// The GBLA paper's recommender on the GPU (retrieval/generative_retrieval.hpp; bfloat16, width
// 1024, 16 heads, one decoder block, semantic IDs of 3 codes of 256 over 65536 items, hash tables
// of 2 x 65536 rows): for `users` users with histories of T items, the encoding alone and the
// whole recommendation (encode, remember, a beam search of width 100 over the 3 levels, the top
// 10), with the hybrid [SA, GBLA, GBLA] x 3 encoder and with [SA] x 9. Both models run in every
// iteration, each timed with CUDA events; counters: the four times, and SA over hybrid for the
// encoding and for the recommendation.

#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include <attnmix/cuda.cuh>
#include <attnmix/retrieval/generative_retrieval.hpp>

#include "cuda_bench.cuh"

namespace {

using attnmix::index_t;
namespace layer = attnmix::layer;
namespace L = attnmix::layers;
using bf16 = attnmix::bfloat16;
using hybrid = attnmix::stack<float, attnmix::repeat<3, layer::sa, layer::gbla, layer::gbla>>;
using sa_only = attnmix::stack<float, attnmix::repeat<9, layer::sa>>;
template <class Encoder>
using device_model = attnmix::generative_retrieval<attnmix::device_stack<Encoder, bf16>>;

constexpr index_t catalogue_items = 65536;
constexpr int codes = 256, width = 100, top_k = 10;

// Item i's ID: (i / 256, i % 256, 0); the collision level unused.
attnmix::semantic_ids catalogue() {
  attnmix::semantic_ids ids = attnmix::semantic_ids::sized(catalogue_items, 1, 2, codes);
  for (index_t i = 0; i < catalogue_items; ++i) {
    ids.code[std::size_t(3 * i)] = std::int32_t(i / codes);
    ids.code[std::size_t(3 * i + 1)] = std::int32_t(i % codes);
  }
  return ids;
}

L::config model_config() {
  L::config c;
  c.hidden_size = 1024;
  c.num_heads = 16;
  return c;
}
attnmix::retrieval_config retrieval_sizes() {
  attnmix::retrieval_config rc;
  rc.depth = 3, rc.codes = codes, rc.buckets = 65536, rc.hashes = 2;
  return rc;
}

void BM_recommend_cuda(benchmark::State& state) {
  const index_t T = state.range(0), users = state.range(1);
  const attnmix::semantic_ids ids = catalogue();
  attnmix::generative_retrieval<hybrid> host_h(model_config(), retrieval_sizes());
  attnmix::generative_retrieval<sa_only> host_s(model_config(), retrieval_sizes());
  L::randomize_parameters(host_h, 1);
  L::randomize_parameters(host_s, 2);
  const device_model<hybrid> mh(host_h);
  const device_model<sa_only> ms(host_s);
  std::mt19937_64 g(3);
  std::vector<std::uint64_t> items(static_cast<std::size_t>(users * T));
  for (std::uint64_t& x : items) x = g();
  std::vector<std::int32_t> offsets;
  for (index_t u = 0; u <= users; ++u) offsets.push_back(std::int32_t(u * T));
  const attnmix::user_histories h{
      attnmix::view1<const std::uint64_t>(items.data(), {index_t(items.size())}),
      attnmix::view1<const std::int32_t>(offsets.data(), {users + 1})};
  attnmix_bench::device_array<bf16> memory(std::size_t(users * T * 1024));
  const attnmix::view3<bf16> vm(memory.ptr, {1, users * T, 1024}, attnmix::memory_space::device);
  const attnmix::backend::cuda be{};
  // Warm-up: cuBLAS picks its kernels, the stream-ordered pool fills.
  mh.encode(h, vm, be), ms.encode(h, vm, be);
  (void)mh.recommend(h, ids, width, top_k, be), (void)ms.recommend(h, ids, width, top_k, be);
  using attnmix_bench::event_ms;
  double eh = 0, es = 0, rh = 0, rs = 0;
  for (auto _ : state) {
    const double a = event_ms([&] { mh.encode(h, vm, be); });
    const double b = event_ms([&] { ms.encode(h, vm, be); });
    const double c =
        event_ms([&] { benchmark::DoNotOptimize(mh.recommend(h, ids, width, top_k, be)); });
    const double d =
        event_ms([&] { benchmark::DoNotOptimize(ms.recommend(h, ids, width, top_k, be)); });
    eh += a, es += b, rh += c, rs += d;
    state.SetIterationTime((a + b + c + d) * 1e-3);
  }
  const double n = double(state.iterations());
  state.counters["hybrid_encode_ms"] = eh / n;
  state.counters["sa_encode_ms"] = es / n;
  state.counters["hybrid_recommend_ms"] = rh / n;
  state.counters["sa_recommend_ms"] = rs / n;
  state.counters["encode_speedup"] = es / eh;
  state.counters["recommend_speedup"] = rs / rh;
}

}  // namespace

BENCHMARK(BM_recommend_cuda)
    ->Name("recommend_cuda")
    ->Args({2048, 32})
    ->Args({8192, 32})
    ->ArgNames({"T", "users"})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);
