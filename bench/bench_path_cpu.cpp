// CPU PaTH and PaTH-FoX forward beside CPU softmax attention at the same shapes (the peer),
// their backward at the same shapes, the prefill key cache, and one decoding step.
// Counters: GFLOP/s of the FLOPs each computation performs, causal:
//   softmax:  B*HQ*T^2*(D + Dv)                      (Q K^T and P V over the lower triangle)
//   PaTH:     the same plus B*HQ*T^2*D^2/C           (each query row moves through one D x D
//             chunk product per earlier chunk; C = 64 = D here) plus O(T*C*D) per head
//   PaTH backward: B*HQ*T^2*(3D + 2Dv + 3D^2/C)      (per tile: the scores again, dO V^T, P^T dO,
//             dZ^T R, dZ K~; per query row and earlier chunk: R P, Rbar P^T and R^T Rbar)
// Argument "threads": 1 runs single-threaded; 0 uses every core. On a shared machine run with
// --benchmark_repetitions=N --benchmark_enable_random_interleaving=true so that a kernel and its
// peer see the same load.

#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <random>

#include "attnmix/attnmix.hpp"

namespace {

using attnmix::index_t;

constexpr index_t B = 1, H = 2, D = 64;

template <class T, int R>
void randomize(attnmix::host_tensor<T, R>& t, unsigned seed, double lo = -1, double hi = 1) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (auto& x : t.storage()) x = static_cast<T>(dist(gen));
}

// Unit-length Householder directions.
void unit_rows(attnmix::host_tensor<float, 4>& w, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist;
  for (index_t row = 0; row < w.size() / D; ++row) {
    double norm = 0;
    for (index_t d = 0; d < D; ++d) {
      const double x = dist(gen);
      w.data()[row * D + d] = static_cast<float>(x);
      norm += x * x;
    }
    for (index_t d = 0; d < D; ++d) w.data()[row * D + d] /= static_cast<float>(std::sqrt(norm));
  }
}

struct inputs {
  attnmix::host_tensor<float, 4> q, k, v, w, out;
  attnmix::host_tensor<float, 3> beta, g;
  explicit inputs(index_t T)
      : q({B, T, H, D}),
        k({B, T, H, D}),
        v({B, T, H, D}),
        w({B, T, H, D}),
        out({B, T, H, D}),
        beta({B, T, H}),
        g({B, T, H}) {
    randomize(q, 1), randomize(k, 2), randomize(v, 3), unit_rows(w, 4);
    randomize(beta, 5, 0.0, 2.0), randomize(g, 6, -0.1, -0.01);
  }
};

double softmax_flops(index_t T) {
  return double(B * H) * double(T) * double(T) * (D + D);
}

// args: T, threads
template <class Kind, class Policy = attnmix::default_policy_t<Kind>>
void BM_forward(benchmark::State& state) {
  const index_t T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  inputs in(T);
  attnmix::attention_args<float> a{in.q.view(), in.k.view(), in.v.view(), in.out.view()};
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate) a.g = in.g.view();
  if constexpr (attnmix::kind_traits<Kind>::uses_householder)
    a.w = in.w.view(), a.beta = in.beta.view();
  for (auto _ : state) {
    attnmix::attention<Kind, Policy>(a, {}, attnmix::backend::cpu{threads});
    benchmark::DoNotOptimize(in.out.data());
  }
  double flops = softmax_flops(T);
  if constexpr (attnmix::kind_traits<Kind>::uses_householder)
    flops += double(B * H) * double(T) * double(T) * D * D / Policy::chunk;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// args: T, threads. The forward runs once (for out and lse) before the timed backward calls.
template <class Kind, class Policy = attnmix::default_policy_t<Kind>>
void BM_backward(benchmark::State& state) {
  const index_t T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  inputs in(T);
  attnmix::host_tensor<float, 4> dout({B, T, H, D}), dq({B, T, H, D}), dk({B, T, H, D}),
      dv({B, T, H, D}), dw({B, T, H, D});
  attnmix::host_tensor<float, 3> lse({B, T, H}), dbeta({B, T, H}), dg({B, T, H});
  randomize(dout, 7);
  attnmix::attention_args<float> a{in.q.view(), in.k.view(), in.v.view(), in.out.view()};
  a.w = in.w.view(), a.beta = in.beta.view(), a.lse = lse.view();
  attnmix::attention_grad_args<float> g;
  g.q = in.q.view(), g.k = in.k.view(), g.v = in.v.view(), g.w = in.w.view();
  g.beta = in.beta.view(), g.out = in.out.view(), g.lse = lse.view(), g.dout = dout.view();
  g.dq = dq.view(), g.dk = dk.view(), g.dv = dv.view(), g.dw = dw.view(), g.dbeta = dbeta.view();
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate)
    a.g = in.g.view(), g.g = in.g.view(), g.dg = dg.view();
  attnmix::attention<Kind, Policy>(a, {}, attnmix::backend::cpu{threads});
  for (auto _ : state) {
    attnmix::attention_backward<Kind, Policy>(g, {}, attnmix::backend::cpu{threads});
    benchmark::DoNotOptimize(dq.data());
  }
  const double flops =
      double(B * H) * double(T) * double(T) * (3.0 * D + 2.0 * D + 3.0 * D * D / Policy::chunk);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

// One long causal PaTH-FoX head, forward then backward: extra memory stays O(T*D) (a T x T
// float matrix would be 16 GiB, a copy of the queries per chunk 1 GiB).
void BM_path_fox_long(benchmark::State& state) {
  const index_t T = state.range(0);
  attnmix::host_tensor<float, 4> q({1, T, 1, D}), k({1, T, 1, D}), v({1, T, 1, D}), w({1, T, 1, D}),
      out({1, T, 1, D}), dout({1, T, 1, D}), dq({1, T, 1, D}), dk({1, T, 1, D}), dv({1, T, 1, D}),
      dw({1, T, 1, D});
  attnmix::host_tensor<float, 3> beta({1, T, 1}), g({1, T, 1}), lse({1, T, 1}), dbeta({1, T, 1}),
      dg({1, T, 1});
  randomize(q, 1), randomize(k, 2), randomize(v, 3), unit_rows(w, 4), randomize(dout, 7);
  randomize(beta, 5, 0.0, 2.0), randomize(g, 6, -0.1, -0.01);
  attnmix::attention_args<float> a{q.view(), k.view(), v.view(), out.view()};
  a.g = g.view(), a.w = w.view(), a.beta = beta.view(), a.lse = lse.view();
  attnmix::attention_grad_args<float> b;
  b.q = q.view(), b.k = k.view(), b.v = v.view(), b.g = g.view(), b.w = w.view();
  b.beta = beta.view(), b.out = out.view(), b.lse = lse.view(), b.dout = dout.view();
  b.dq = dq.view(), b.dk = dk.view(), b.dv = dv.view(), b.dg = dg.view(), b.dw = dw.view();
  b.dbeta = dbeta.view();
  const double before = peak_rss_mib();
  for (auto _ : state) {
    attnmix::attention<attnmix::kind::path_fox>(a);
    attnmix::attention_backward<attnmix::kind::path_fox>(b);
    benchmark::DoNotOptimize(dq.data());
  }
  state.counters["tensors_MiB"] = 10.0 * T * D * sizeof(float) / (1 << 20);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  state.counters["rss_growth_MiB"] = peak_rss_mib() - before;
}

// args: T, threads. O(T D^2) per head: suffix products of the chunk transitions.
void BM_key_cache(benchmark::State& state) {
  const index_t T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  inputs in(T);
  attnmix::host_tensor<float, 4> kc({B, T, H, D});
  attnmix::path_key_cache_args<float> a{in.k.view(), in.w.view(), in.beta.view(), kc.view()};
  for (auto _ : state) {
    attnmix::path_prefill_key_cache(a, {}, attnmix::backend::cpu{threads});
    benchmark::DoNotOptimize(kc.data());
  }
  const index_t C = attnmix::path_policy::chunk;
  // per chunk: UT transform ~ (7 C^2 D + C^3) and P (2 C D^2); suffix: 2 D^3 + 2 C D^2
  const double per_chunk =
      7.0 * C * C * D + double(C) * C * C + 2.0 * C * D * D + 2.0 * D * D * D + 2.0 * C * D * D;
  state.counters["GFLOP/s"] = benchmark::Counter(double(B * H) * (double(T) / C) * per_chunk / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// args: cached tokens, threads. One PaTH-FoX decoding step of B sequences; the cache update
// reads and writes every cached key.
void BM_decode_step(benchmark::State& state) {
  const index_t L = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  inputs prompt(L), step(1);
  attnmix::path_cache<float> cache(B, L + 1000, H, H, D, D);  // room for the timed steps
  attnmix::attention_args<float> p{prompt.q.view(), prompt.k.view(), prompt.v.view(),
                                   prompt.out.view()};
  p.g = prompt.g.view(), p.w = prompt.w.view(), p.beta = prompt.beta.view();
  attnmix::attention_args<float> s{step.q.view(), step.k.view(), step.v.view(), step.out.view()};
  s.g = step.g.view(), s.w = step.w.view(), s.beta = step.beta.view();
  attnmix::path_prefill<attnmix::kind::path_fox>(cache, p, {}, {}, attnmix::backend::cpu{threads});
  for (auto _ : state) {  // each step appends one token: L grows by at most the iteration count
    attnmix::path_decode_step<attnmix::kind::path_fox>(cache, s, {}, {},
                                                       attnmix::backend::cpu{threads});
    benchmark::DoNotOptimize(step.out.data());
  }
  state.counters["cache_GB/s"] =
      benchmark::Counter(double(B * H) * double(L) * (3.0 * D + D) * sizeof(float) / 1e9,
                         benchmark::Counter::kIsIterationInvariantRate);
}

void forward_args(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 0})
    for (index_t T : {2048, 4096, 8192}) b->Args({T, threads});
  b->ArgNames({"T", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK_TEMPLATE(BM_forward, attnmix::kind::softmax)->Name("softmax_causal")->Apply(forward_args);
BENCHMARK_TEMPLATE(BM_forward, attnmix::kind::path)->Name("path")->Apply(forward_args);
BENCHMARK_TEMPLATE(BM_forward, attnmix::kind::path_fox)->Name("path_fox")->Apply(forward_args);
// The chunk knob: larger chunks mean fewer, larger products per query block.
struct chunk128 : attnmix::path_policy {
  static constexpr index_t chunk = 128;
};
BENCHMARK_TEMPLATE(BM_forward, attnmix::kind::path, chunk128)
    ->Name("path_chunk128")
    ->Apply(forward_args);
BENCHMARK_TEMPLATE(BM_backward, attnmix::kind::path)->Name("path_backward")->Apply(forward_args);
BENCHMARK_TEMPLATE(BM_backward, attnmix::kind::path_fox)
    ->Name("path_fox_backward")
    ->Apply(forward_args);
BENCHMARK(BM_path_fox_long)
    ->Arg(65536)
    ->ArgNames({"T"})
    ->Iterations(1)
    ->Unit(benchmark::kSecond)
    ->UseRealTime();
BENCHMARK(BM_key_cache)->Name("path_key_cache")->Apply(forward_args);
BENCHMARK(BM_decode_step)
    ->Name("path_fox_decode_step")
    ->Args({8192, 1})
    ->ArgNames({"L", "threads"})
    ->Iterations(200)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
