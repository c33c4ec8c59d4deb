// CPU softmax attention and FoX, forward and backward, beside an Eigen SGEMM that sets the ceiling.
// Counters: GFLOP/s with FLOPs = 4*B*H*T^2*D (bidirectional), half of that causal, for the
// forward (two products per tile) and 10*B*H*T^2*D (five products per tile) for the backward.
// Forward and backward of a kind run at the same shapes; time them interleaved
// (--benchmark_enable_random_interleaving) and compare.
// Argument "threads": 1 compares against the single-threaded Eigen SGEMM; 0 uses every core.

#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <Eigen/Dense>
#include <random>

#include "attnmix/attnmix.hpp"

namespace {

using attnmix::index_t;

template <class T, int R>
void randomize(attnmix::host_tensor<T, R>& t, unsigned seed, double lo = -1, double hi = 1) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (auto& x : t.storage()) x = static_cast<T>(dist(gen));
}

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

// args: T, threads
template <class Kind, class Policy>
void BM_attention(benchmark::State& state) {
  const index_t B = 1, H = 8, D = 64, T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  attnmix::host_tensor<float, 4> q({B, T, H, D}), k({B, T, H, D}), v({B, T, H, D}),
      out({B, T, H, D});
  attnmix::host_tensor<float, 3> g({B, T, H});
  randomize(q, 1), randomize(k, 2), randomize(v, 3), randomize(g, 4, -0.1, -0.01);
  attnmix::attention_args<float> a{q.view(), k.view(), v.view(), out.view()};
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate) a.g = g.view();
  for (auto _ : state) {
    attnmix::attention<Kind, Policy>(a, {}, attnmix::backend::cpu{threads});
    benchmark::DoNotOptimize(out.data());
  }
  const bool causal = Policy::mask == attnmix::mask_type::causal;
  const double flops = 4.0 * B * H * double(T) * double(T) * D * (causal ? 0.5 : 1.0);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// args: T, threads. The backward alone: the forward's out and lse are computed once, untimed.
template <class Kind, class Policy>
void BM_attention_backward(benchmark::State& state) {
  const index_t B = 1, H = 8, D = 64, T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  attnmix::host_tensor<float, 4> q({B, T, H, D}), k({B, T, H, D}), v({B, T, H, D}),
      out({B, T, H, D}), dout({B, T, H, D}), dq({B, T, H, D}), dk({B, T, H, D}), dv({B, T, H, D});
  attnmix::host_tensor<float, 3> g({B, T, H}), lse({B, T, H}), dg({B, T, H});
  randomize(q, 1), randomize(k, 2), randomize(v, 3), randomize(g, 4, -0.1, -0.01);
  randomize(dout, 5);
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  attnmix::attention_args<float> a{q.view(), k.view(), v.view(), out.view()};
  if constexpr (gated) a.g = g.view();
  a.lse = lse.view();
  const attnmix::backend::cpu be{threads};
  attnmix::attention<Kind, Policy>(a, {}, be);
  attnmix::attention_grad_args<float> ga{};
  ga.q = q.view(), ga.k = k.view(), ga.v = v.view(), ga.out = out.view(), ga.lse = lse.view();
  ga.dout = dout.view(), ga.dq = dq.view(), ga.dk = dk.view(), ga.dv = dv.view();
  if constexpr (gated) ga.g = g.view(), ga.dg = dg.view();
  for (auto _ : state) {
    attnmix::attention_backward<Kind, Policy>(ga, {}, be);
    benchmark::DoNotOptimize(dq.data());
  }
  const bool causal = Policy::mask == attnmix::mask_type::causal;
  const double flops = 10.0 * B * H * double(T) * double(T) * D * (causal ? 0.5 : 1.0);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// args: M, N, K. Eigen is single-threaded here (no OpenMP).
void BM_eigen_sgemm(benchmark::State& state) {
  const index_t M = state.range(0), N = state.range(1), K = state.range(2);
  Eigen::MatrixXf a = Eigen::MatrixXf::Random(M, K), b = Eigen::MatrixXf::Random(K, N), c(M, N);
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * M * N * K / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// One long causal head: extra memory stays O(T*D) (a T x T float matrix would be 16 GiB).
void BM_softmax_long(benchmark::State& state) {
  const index_t T = state.range(0), D = 64;
  attnmix::host_tensor<float, 4> q({1, T, 1, D}), k({1, T, 1, D}), v({1, T, 1, D}),
      out({1, T, 1, D});
  randomize(q, 1), randomize(k, 2), randomize(v, 3);
  const double before = peak_rss_mib();
  for (auto _ : state) {
    attnmix::attention<attnmix::kind::softmax>(
        attnmix::attention_args<float>{q.view(), k.view(), v.view(), out.view()});
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(T) * double(T) * D / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["inputs_MiB"] = 4.0 * T * D * sizeof(float) / (1 << 20);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  state.counters["rss_growth_MiB"] = peak_rss_mib() - before;
}

// Forward and backward of one long causal head: the backward's extra memory stays O(T*D) too.
void BM_softmax_backward_long(benchmark::State& state) {
  const index_t T = state.range(0), D = 64;
  attnmix::host_tensor<float, 4> q({1, T, 1, D}), k({1, T, 1, D}), v({1, T, 1, D}),
      out({1, T, 1, D}), dout({1, T, 1, D}), dq({1, T, 1, D}), dk({1, T, 1, D}), dv({1, T, 1, D});
  attnmix::host_tensor<float, 3> lse({1, T, 1});
  randomize(q, 1), randomize(k, 2), randomize(v, 3), randomize(dout, 5);
  attnmix::attention_args<float> a{q.view(), k.view(), v.view(), out.view()};
  a.lse = lse.view();
  attnmix::attention_grad_args<float> ga{};
  ga.q = q.view(), ga.k = k.view(), ga.v = v.view(), ga.out = out.view(), ga.lse = lse.view();
  ga.dout = dout.view(), ga.dq = dq.view(), ga.dk = dk.view(), ga.dv = dv.view();
  const double before = peak_rss_mib();
  for (auto _ : state) {
    attnmix::attention<attnmix::kind::softmax>(a);
    attnmix::attention_backward<attnmix::kind::softmax>(ga);
    benchmark::DoNotOptimize(dq.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(7.0 * double(T) * double(T) * D / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tensors_MiB"] = 9.0 * T * D * sizeof(float) / (1 << 20);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  state.counters["rss_growth_MiB"] = peak_rss_mib() - before;
}

void attention_args_list(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 0})
    for (index_t T : {512, 2048, 8192}) b->Args({T, threads});
  b->ArgNames({"T", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_eigen_sgemm)
    ->Args({1024, 1024, 1024})
    ->Args({2048, 2048, 64})
    ->Args({2048, 64, 2048})
    ->ArgNames({"M", "N", "K"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_attention, attnmix::kind::softmax, attnmix::softmax_policy)
    ->Name("softmax_causal")
    ->Apply(attention_args_list);
BENCHMARK_TEMPLATE(BM_attention, attnmix::kind::softmax, attnmix::bidirectional_softmax_policy)
    ->Name("softmax_bidirectional")
    ->Apply(attention_args_list);
BENCHMARK_TEMPLATE(BM_attention, attnmix::kind::fox, attnmix::fox_policy)
    ->Name("fox_causal")
    ->Apply(attention_args_list);
BENCHMARK_TEMPLATE(BM_attention_backward, attnmix::kind::softmax, attnmix::softmax_policy)
    ->Name("softmax_causal_backward")
    ->Apply(attention_args_list);
BENCHMARK_TEMPLATE(BM_attention_backward, attnmix::kind::softmax,
                   attnmix::bidirectional_softmax_policy)
    ->Name("softmax_bidirectional_backward")
    ->Apply(attention_args_list);
BENCHMARK_TEMPLATE(BM_attention_backward, attnmix::kind::fox, attnmix::fox_policy)
    ->Name("fox_causal_backward")
    ->Apply(attention_args_list);
BENCHMARK(BM_softmax_long)
    ->Arg(65536)
    ->ArgNames({"T"})
    ->Iterations(1)
    ->Unit(benchmark::kSecond)
    ->UseRealTime();
BENCHMARK(BM_softmax_backward_long)
    ->Arg(65536)
    ->ArgNames({"T"})
    ->Iterations(1)
    ->Unit(benchmark::kSecond)
    ->UseRealTime();
