// CPU BLA, GBLA core and causal linear attention forward, beside their peers measured in the
// same run: bidirectional softmax attention (what BLA replaces), Eigen SGEMMs of the same
// shapes as BLA's two products (the compute ceiling) and a multi-threaded copy (the memory
// floor). Shapes: B = 1, H = 16, D = Dv = 64.
// Counters: GFLOP/s with FLOPs = 4*B*H*T*D*Dv (the two products S = P^T V and R S); GB/s over
// the bytes a fused implementation must move (q, k, v read, out written; for GBLA also the
// output gate and the key-gate logits). Second argument: threads (1, or 0 for every core).

#include <benchmark/benchmark.h>

#include <Eigen/Dense>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "attnmix/attnmix.hpp"

namespace {

using attnmix::index_t;

constexpr index_t B = 1, H = 16, D = 64, Dv = 64;

template <class T, int R>
void randomize(attnmix::host_tensor<T, R>& t, unsigned seed, double lo = -1, double hi = 1) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (auto& x : t.storage()) x = static_cast<T>(dist(gen));
}

double linear_flops(index_t T) {
  return 4.0 * B * H * double(T) * D * Dv;
}

template <class Kind, class Policy>
void BM_linear(benchmark::State& state) {
  const index_t T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  constexpr bool gated = Policy::gate != attnmix::key_gate::off;
  constexpr bool normed = Policy::norm != attnmix::gated_norm::off;
  attnmix::host_tensor<float, 4> q({B, T, H, D}), k({B, T, H, D}), v({B, T, H, Dv});
  attnmix::host_tensor<float, 4> gate({B, T, H, Dv}), out({B, T, H, Dv});
  attnmix::host_tensor<float, 3> a({B, T, 1});
  randomize(q, 1), randomize(k, 2), randomize(v, 3), randomize(gate, 4), randomize(a, 5);
  attnmix::linear_attention_args<float> args{q.view(), k.view(), v.view(), out.view()};
  if constexpr (gated) args.a = a.view();
  if constexpr (normed) args.gate = gate.view();
  for (auto _ : state) {
    attnmix::linear_attention<Kind, Policy>(args, {}, attnmix::backend::cpu{threads});
    benchmark::DoNotOptimize(out.data());
  }
  double bytes = 4.0 * B * T * H * D * sizeof(float);
  if (normed) bytes += double(B) * T * H * Dv * sizeof(float);
  if (gated) bytes += double(B) * T * sizeof(float);
  state.counters["GFLOP/s"] =
      benchmark::Counter(linear_flops(T) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  // Inverted rate of T * 1e-9 "units" per second: nanoseconds per token.
  state.counters["ns/token"] =
      benchmark::Counter(double(T) * 1e-9, benchmark::Counter::kIsIterationInvariantRate |
                                               benchmark::Counter::kInvert);
}

// Bidirectional softmax attention on the same shapes; FLOPs = 4*B*H*T^2*D.
void BM_softmax_bidirectional(benchmark::State& state) {
  const index_t T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  attnmix::host_tensor<float, 4> q({B, T, H, D}), k({B, T, H, D}), v({B, T, H, Dv}),
      out({B, T, H, Dv});
  randomize(q, 1), randomize(k, 2), randomize(v, 3);
  attnmix::attention_args<float> args{q.view(), k.view(), v.view(), out.view()};
  for (auto _ : state) {
    attnmix::attention<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy>(
        args, {}, attnmix::backend::cpu{threads});
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(4.0 * B * H * double(T) * double(T) * D / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// Eigen SGEMMs of BLA's shapes, per head: S = P^T V (D x T times T x Dv) and N = R S (T x D
// times D x Dv), heads spread over the threads; no feature map, mask or division. The rate the
// two products of BLA can reach.
void BM_eigen_products(benchmark::State& state) {
  const index_t T = state.range(0);
  using mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::vector<mat> p(H, mat::Random(T, D)), v(H, mat::Random(T, Dv)), s(H, mat(D, Dv)),
      n(H, mat(T, Dv));
  const int threads = static_cast<int>(state.range(1));
  const int workers = attnmix::detail::cpu::worker_count(attnmix::backend::cpu{threads}, H);
  for (auto _ : state) {
    attnmix::detail::cpu::parallel_for(H, workers, [&](index_t h, int) {
      s[h].noalias() = p[h].transpose() * v[h];
      n[h].noalias() = p[h] * s[h];
    });
    benchmark::DoNotOptimize(n[0].data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(linear_flops(T) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// A square SGEMM per core: the machine's Eigen matrix rate.
void BM_eigen_sgemm_square(benchmark::State& state) {
  const index_t M = state.range(0);
  const int workers = attnmix::detail::cpu::worker_count(attnmix::backend::cpu{}, 64);
  std::vector<Eigen::MatrixXf> a(workers, Eigen::MatrixXf::Random(M, M)),
      b(workers, Eigen::MatrixXf::Random(M, M)), c(workers, Eigen::MatrixXf(M, M));
  for (auto _ : state) {
    attnmix::detail::cpu::parallel_for(workers, workers,
                                       [&](index_t w, int) { c[w].noalias() = a[w] * b[w]; });
    benchmark::DoNotOptimize(c[0].data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * workers * double(M) * M * M / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// Copy bandwidth over every core, reading and writing as many bytes as BLA at length T moves
// (q, k, v in; out out): GB/s counts bytes read plus bytes written.
void BM_copy(benchmark::State& state) {
  const index_t T = state.range(0);
  const std::size_t n = static_cast<std::size_t>(2 * B * T * H * D);  // floats per side
  std::vector<float> src(n, 1.0f), dst(n, 0.0f);
  const int workers = attnmix::detail::cpu::worker_count(attnmix::backend::cpu{}, 64);
  for (auto _ : state) {
    attnmix::detail::cpu::parallel_for(workers, workers, [&](index_t w, int) {
      const std::size_t lo = n * w / workers, hi = n * (w + 1) / workers;
      std::memcpy(dst.data() + lo, src.data() + lo, (hi - lo) * sizeof(float));
    });
    benchmark::DoNotOptimize(dst.data());
  }
  state.counters["GB/s"] = benchmark::Counter(2.0 * n * sizeof(float) / 1e9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

using causal_recurrent =
    attnmix::with_causal_form<attnmix::linear_causal_policy, attnmix::causal_form::recurrent>;

void lengths(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 0})
    for (int T : {2048, 8192, 32768}) b->Args({T, threads});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}
void at_8192(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 0}) b->Args({8192, threads});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_linear<attnmix::kind::bla, attnmix::bla_policy>)->Name("bla")->Apply(lengths);
BENCHMARK(BM_linear<attnmix::kind::gbla, attnmix::gbla_policy>)->Name("gbla")->Apply(lengths);
BENCHMARK(BM_linear<attnmix::kind::linear_causal, attnmix::linear_causal_policy>)
    ->Name("linear_causal_chunked")
    ->Apply(at_8192);
BENCHMARK(BM_linear<attnmix::kind::linear_causal, causal_recurrent>)
    ->Name("linear_causal_recurrent")
    ->Apply(at_8192);
BENCHMARK(BM_softmax_bidirectional)->Name("softmax_bidirectional")->Apply(at_8192);
BENCHMARK(BM_eigen_products)->Name("eigen_products")->Apply(lengths);
BENCHMARK(BM_eigen_sgemm_square)
    ->Name("eigen_sgemm_square")
    ->Arg(1024)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_copy)
    ->Name("copy")
    ->Arg(8192)
    ->Arg(32768)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
