// CPU BLA, GBLA core and causal linear attention forward, beside their peers measured in the
// same run: bidirectional softmax attention (what BLA replaces), Eigen SGEMMs of the same
// shapes as BLA's two products (the compute ceiling) and a multi-threaded copy (the memory
// floor). Shapes: B = 1, H = 16, D = Dv = 64.
// Counters: GFLOP/s with FLOPs = 4*B*H*T*D*Dv (the two products S = P^T V and R S); GB/s over
// the bytes a fused implementation must move (q, k, v read, out written; for GBLA also the
// output gate and the key-gate logits). Second argument: threads (1, or 0 for every core).
// The backward of each kind (<name>_backward) runs right after its forward at the same shape,
// so that time(backward) / time(forward) compares runs of one machine state (<name>_backward_saved:
// handed the forward's final state instead of recomputing it); its GFLOP/s counts
// the forward's FLOPs (a rate of "forward equivalents"). linear_causal_long: one causal head of
// T = 65536, forward then backward, with the growth of the peak RSS over the inputs (the peak is
// the process's: run it alone, --benchmark_filter=linear_causal_long).

#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <Eigen/Dense>
#include <cstring>
#include <random>
#include <string>
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

// The backward of the same call: dout in; dq, dk, dv (and da, dgate, dgamma as the policy has
// them) out, the forward's state recomputed.
template <class Kind, class Policy, bool Saved = false>
void BM_linear_backward(benchmark::State& state) {
  const index_t T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  constexpr bool gated = Policy::gate != attnmix::key_gate::off;
  constexpr bool normed = Policy::norm != attnmix::gated_norm::off;
  attnmix::host_tensor<float, 4> q({B, T, H, D}), k({B, T, H, D}), v({B, T, H, Dv});
  attnmix::host_tensor<float, 4> gate({B, T, H, Dv}), dout({B, T, H, Dv});
  attnmix::host_tensor<float, 3> a({B, T, 1}), da({B, T, 1});
  attnmix::host_tensor<float, 4> dq({B, T, H, D}), dk({B, T, H, D}), dv({B, T, H, Dv}),
      dgate({B, T, H, Dv});
  attnmix::host_tensor<float, 1> gamma({Dv}, 1.0f), dgamma({Dv});
  randomize(q, 1), randomize(k, 2), randomize(v, 3), randomize(gate, 4), randomize(a, 5);
  randomize(dout, 6);
  attnmix::linear_attention_grad_args<float> g;
  g.q = q.view(), g.k = k.view(), g.v = v.view(), g.dout = dout.view();
  g.dq = dq.view(), g.dk = dk.view(), g.dv = dv.view();
  if constexpr (gated) g.a = a.view(), g.da = da.view();
  if constexpr (normed) {
    g.gate = gate.view(), g.dgate = dgate.view();
    g.gamma = gamma.view(), g.dgamma = dgamma.view();
  }
  // Saved: the forward's final state handed over, as a training step that keeps it would.
  attnmix::host_tensor<float, 4> S({B, H, D, Dv}), out({B, T, H, Dv});
  attnmix::host_tensor<float, 3> z({B, H, D});
  attnmix::host_tensor<float, 2> lse({B, H});
  if constexpr (Saved) {
    attnmix::linear_attention_args<float> fa{q.view(), k.view(), v.view(), out.view()};
    if constexpr (gated) fa.a = a.view(), fa.state_out.lse = lse.view();
    if constexpr (normed) fa.gate = gate.view(), fa.gamma = gamma.view();
    fa.state_out.S = S.view(), fa.state_out.z = z.view();
    attnmix::linear_attention<Kind, Policy>(fa);
    g.saved.S = S.view(), g.saved.z = z.view();
    if constexpr (gated) g.saved.lse = lse.view();
  }
  for (auto _ : state) {
    attnmix::linear_attention_backward<Kind, Policy>(g, {}, attnmix::backend::cpu{threads});
    benchmark::DoNotOptimize(dq.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(linear_flops(T) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ns/token"] =
      benchmark::Counter(double(T) * 1e-9, benchmark::Counter::kIsIterationInvariantRate |
                                               benchmark::Counter::kInvert);
}

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

// One long causal head, forward then backward: the extra memory stays O(T D) (the state
// checkpoints, per-token scalars and scratch), reported as the growth of the peak RSS.
void BM_linear_causal_long(benchmark::State& state) {
  const index_t T = state.range(0);
  attnmix::host_tensor<float, 4> q({1, T, 1, D}), k({1, T, 1, D}), v({1, T, 1, Dv}),
      out({1, T, 1, Dv}), dout({1, T, 1, Dv});
  attnmix::host_tensor<float, 4> dq({1, T, 1, D}), dk({1, T, 1, D}), dv({1, T, 1, Dv});
  randomize(q, 1), randomize(k, 2), randomize(v, 3), randomize(dout, 4);
  attnmix::linear_attention_args<float> args{q.view(), k.view(), v.view(), out.view()};
  attnmix::linear_attention_grad_args<float> g;
  g.q = q.view(), g.k = k.view(), g.v = v.view(), g.dout = dout.view();
  g.dq = dq.view(), g.dk = dk.view(), g.dv = dv.view();
  const double before = peak_rss_mib();
  for (auto _ : state) {
    attnmix::linear_attention<attnmix::kind::linear_causal>(args);
    attnmix::linear_attention_backward<attnmix::kind::linear_causal>(g);
    benchmark::DoNotOptimize(dq.data());
  }
  state.counters["tensors_MiB"] = 8.0 * T * D * sizeof(float) / (1 << 20);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  state.counters["rss_growth_MiB"] = peak_rss_mib() - before;
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

// Forward and backward of each kind interleaved shape by shape: <name>/T/threads, then
// <name>_backward/T/threads.
template <class Kind, class Policy, bool Bidirectional = true>
void register_forward_backward(const std::string& name) {
  for (int T : {2048, 8192, 32768})
    for (int threads : {1, 0}) {
      benchmark::RegisterBenchmark(name.c_str(), BM_linear<Kind, Policy>)
          ->Args({T, threads})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark((name + "_backward").c_str(), BM_linear_backward<Kind, Policy>)
          ->Args({T, threads})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      if constexpr (Bidirectional)
        benchmark::RegisterBenchmark((name + "_backward_saved").c_str(),
                                     BM_linear_backward<Kind, Policy, true>)
            ->Args({T, threads})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    }
}
const bool registered = [] {
  register_forward_backward<attnmix::kind::bla, attnmix::bla_policy>("bla");
  register_forward_backward<attnmix::kind::gbla, attnmix::gbla_policy>("gbla");
  register_forward_backward<attnmix::kind::linear_causal, attnmix::linear_causal_policy, false>(
      "linear_causal_chunked");
  return true;
}();

}  // namespace

BENCHMARK(BM_linear_causal_long)
    ->Name("linear_causal_long")
    ->Arg(65536)
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
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
