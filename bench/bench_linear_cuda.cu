// CUDA GBLA core, BLA and causal linear attention forward, bf16, timed with CUDA events. Counter
// GB/s: the bytes the core must move (q, k, v, gate read, out written in bf16, the gate logits
// in float) over the time; compare with the device's copy bandwidth (bytes read + written) for
// the memory floor.

#include <benchmark/benchmark.h>

#include "attnmix/cuda.cuh"
#include "cuda_bench.cuh"

namespace {

using attnmix::index_t;
using attnmix::detail::cuda::check;
using attnmix_bench::device_array;

// Calls > 1: that many calls back to back between the two events, the time reported per call:
// the device time of a call without the host's latency before its first kernel.
template <class Kind, class Policy, int Calls = 1>
void BM_linear_cuda(benchmark::State& state) {
  using T = attnmix::bfloat16;
  constexpr bool normed = Policy::norm != attnmix::gated_norm::off;
  constexpr bool gated = Policy::gate != attnmix::key_gate::off;
  const index_t B = state.range(0), Tn = state.range(1), H = state.range(2), D = 64;
  const std::size_t n = static_cast<std::size_t>(B * Tn * H * D);
  device_array<T> q(n, 1), k(n, 2), v(n, 3), gate(n, 4), out(n, 5);
  device_array<float> a(static_cast<std::size_t>(B * Tn), 6, -2.f, 2.f),
      gamma(static_cast<std::size_t>(D), 7, 0.5f, 1.5f);
  const auto dev = attnmix::memory_space::device;
  attnmix::linear_attention_args<T> args;
  args.q = attnmix::view4<const T>(q.ptr, {B, Tn, H, D}, dev);
  args.k = attnmix::view4<const T>(k.ptr, {B, Tn, H, D}, dev);
  args.v = attnmix::view4<const T>(v.ptr, {B, Tn, H, D}, dev);
  args.out = attnmix::view4<T>(out.ptr, {B, Tn, H, D}, dev);
  if constexpr (gated) args.a = attnmix::view3<const float>(a.ptr, {B, Tn, 1}, dev);
  if constexpr (normed) {
    args.gate = attnmix::view4<const T>(gate.ptr, {B, Tn, H, D}, dev);
    args.gamma = attnmix::view1<const float>(gamma.ptr, {D}, dev);
  }
  auto call = [&] {
    attnmix::linear_attention<Kind, Policy>(args, {}, attnmix::backend::cuda{});
  };
  attnmix_bench::time_with_events(state, call, Calls);
  const double bytes =
      double(B) * Tn * H * D * 2 * (normed ? 5 : 4) + (gated ? double(B) * Tn * 4 : 0);
  state.counters["GB/s"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["MB"] = bytes / 1e6;
}

// Device-to-device copy of a buffer the size of the GBLA inputs: the bandwidth ceiling.
void BM_copy(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) << 20;
  void *src, *dst;
  check(cudaMalloc(&src, bytes), "cudaMalloc"), check(cudaMalloc(&dst, bytes), "cudaMalloc");
  check(cudaMemset(src, 1, bytes), "memset");
  attnmix_bench::time_with_events(
      state, [&] { check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice), "copy"); });
  state.counters["GB/s"] =
      benchmark::Counter(2.0 * bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  cudaFree(src), cudaFree(dst);
}

void shapes(benchmark::internal::Benchmark* b) {
  for (int T : {2048, 8192, 32768}) b->Args({8, T, 16});
  b->ArgNames({"B", "T", "H"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

void causal_shapes(benchmark::internal::Benchmark* b) {
  for (int T : {2048, 8192, 32768}) b->Args({8, T, 16});
  b->Args({1, 32768, 16});
  b->ArgNames({"B", "T", "H"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

// Causal linear attention with the prefix-softmax key gate and the per-head gated RMSNorm.
using gated_causal_policy = attnmix::with_gated_norm<
    attnmix::with_key_gate<attnmix::linear_causal_policy, attnmix::key_gate::shared>,
    attnmix::gated_norm::per_head>;

}  // namespace

BENCHMARK(BM_copy)->Arg(2048)->ArgNames({"MiB"})->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_linear_cuda, attnmix::kind::gbla, attnmix::gbla_policy)
    ->Name("gbla")
    ->Apply(shapes);
BENCHMARK_TEMPLATE(BM_linear_cuda, attnmix::kind::gbla, attnmix::gbla_policy, 10)
    ->Name("gbla_chain10")
    ->Apply(shapes);
BENCHMARK_TEMPLATE(BM_linear_cuda, attnmix::kind::bla, attnmix::bla_policy)
    ->Name("bla")
    ->Apply(shapes);
BENCHMARK_TEMPLATE(BM_linear_cuda, attnmix::kind::linear_causal, attnmix::linear_causal_policy)
    ->Name("linear_causal")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_linear_cuda, attnmix::kind::linear_causal, gated_causal_policy)
    ->Name("linear_causal_gated")
    ->Apply(causal_shapes);

// ---- backward ----
// The linear-attention backward (linear_attention_backward), bf16, and the forward + backward
// of a training step (FwdToo). Counter GB/s: the bytes a backward must move at least (q, k, v,
// dout, and gate under the gated norm, read; dq, dk, dv, and dgate, written, in bf16; the gate
// logits read and da written in float), plus the forward's bytes for FwdToo, over the time;
// MB is that byte count, so that time / (MB / copy GB/s) is the distance from the memory floor.
namespace {

// Saved: the forward hands its state (S, z, lse) to the backward, which then skips the reduce.
template <class Kind, class Policy, bool FwdToo, bool Saved = false>
void BM_linear_backward_cuda(benchmark::State& state) {
  using T = attnmix::bfloat16;
  constexpr bool normed = Policy::norm != attnmix::gated_norm::off;
  constexpr bool gated = Policy::gate != attnmix::key_gate::off;
  const index_t B = state.range(0), Tn = state.range(1), H = state.range(2), D = 64;
  const std::size_t n = static_cast<std::size_t>(B * Tn * H * D);
  device_array<T> q(n, 1), k(n, 2), v(n, 3), gate(n, 4), out(n, 5), dout(n, 6);
  device_array<T> dq(n, 7), dk(n, 8), dv(n, 9), dgate(n, 10);
  device_array<float> a(static_cast<std::size_t>(B * Tn), 11, -2.f, 2.f),
      da(static_cast<std::size_t>(B * Tn), 12), gamma(static_cast<std::size_t>(D), 13, 0.5f, 1.5f),
      dgamma(static_cast<std::size_t>(D), 14);
  const auto dev = attnmix::memory_space::device;
  const attnmix::view4<const T> qv(q.ptr, {B, Tn, H, D}, dev), kv(k.ptr, {B, Tn, H, D}, dev),
      vv(v.ptr, {B, Tn, H, D}, dev), gv(gate.ptr, {B, Tn, H, D}, dev);
  attnmix::linear_attention_args<T> fwd;
  fwd.q = qv, fwd.k = kv, fwd.v = vv;
  fwd.out = attnmix::view4<T>(out.ptr, {B, Tn, H, D}, dev);
  attnmix::linear_attention_grad_args<T> g;
  g.q = qv, g.k = kv, g.v = vv;
  g.dout = attnmix::view4<const T>(dout.ptr, {B, Tn, H, D}, dev);
  g.dq = attnmix::view4<T>(dq.ptr, {B, Tn, H, D}, dev);
  g.dk = attnmix::view4<T>(dk.ptr, {B, Tn, H, D}, dev);
  g.dv = attnmix::view4<T>(dv.ptr, {B, Tn, H, D}, dev);
  if constexpr (gated) {
    fwd.a = g.a = attnmix::view3<const float>(a.ptr, {B, Tn, 1}, dev);
    g.da = attnmix::view3<float>(da.ptr, {B, Tn, 1}, dev);
  }
  if constexpr (normed) {
    fwd.gate = g.gate = gv;
    fwd.gamma = g.gamma = attnmix::view1<const float>(gamma.ptr, {D}, dev);
    g.dgate = attnmix::view4<T>(dgate.ptr, {B, Tn, H, D}, dev);
    g.dgamma = attnmix::view1<float>(dgamma.ptr, {D}, dev);
  }
  device_array<float> S(static_cast<std::size_t>(B * H * D * D), 15),
      z(static_cast<std::size_t>(B * H * D), 16), lse(static_cast<std::size_t>(B * H), 17);
  if constexpr (Saved) {
    fwd.state_out.S = attnmix::view4<float>(S.ptr, {B, H, D, D}, dev);
    fwd.state_out.z = attnmix::view3<float>(z.ptr, {B, H, D}, dev);
    g.saved.S = attnmix::view4<const float>(S.ptr, {B, H, D, D}, dev);
    g.saved.z = attnmix::view3<const float>(z.ptr, {B, H, D}, dev);
    if constexpr (gated) {
      fwd.state_out.lse = attnmix::tensor_view<float, 2>(lse.ptr, {B, H}, dev);
      g.saved.lse = attnmix::tensor_view<const float, 2>(lse.ptr, {B, H}, dev);
    }
    attnmix::linear_attention<Kind, Policy>(fwd, {}, attnmix::backend::cuda{});
  }
  auto call = [&] {
    if constexpr (FwdToo)
      attnmix::linear_attention<Kind, Policy>(fwd, {}, attnmix::backend::cuda{});
    attnmix::linear_attention_backward<Kind, Policy>(g, {}, attnmix::backend::cuda{});
  };
  attnmix_bench::time_with_events(state, call, 1);
  const double act = double(B) * Tn * H * D * 2;
  double bytes = act * (normed ? 9 : 7) + (gated ? double(B) * Tn * 8 : 0);
  if (FwdToo) bytes += act * (normed ? 5 : 4) + (gated ? double(B) * Tn * 4 : 0);
  state.counters["GB/s"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["MB"] = bytes / 1e6;
}

}  // namespace

BENCHMARK_TEMPLATE(BM_linear_backward_cuda, attnmix::kind::gbla, attnmix::gbla_policy, false)
    ->Name("gbla_backward")
    ->Apply(shapes);
BENCHMARK_TEMPLATE(BM_linear_backward_cuda, attnmix::kind::gbla, attnmix::gbla_policy, true)
    ->Name("gbla_forward_backward")
    ->Apply(shapes);
BENCHMARK_TEMPLATE(BM_linear_backward_cuda, attnmix::kind::gbla, attnmix::gbla_policy, false, true)
    ->Name("gbla_backward_saved")
    ->Apply(shapes);
BENCHMARK_TEMPLATE(BM_linear_backward_cuda, attnmix::kind::gbla, attnmix::gbla_policy, true, true)
    ->Name("gbla_forward_backward_saved")
    ->Apply(shapes);
BENCHMARK_TEMPLATE(BM_linear_backward_cuda, attnmix::kind::bla, attnmix::bla_policy, false)
    ->Name("bla_backward")
    ->Apply(shapes);
BENCHMARK_TEMPLATE(BM_linear_backward_cuda, attnmix::kind::bla, attnmix::bla_policy, true)
    ->Name("bla_forward_backward")
    ->Apply(shapes);
BENCHMARK_TEMPLATE(BM_linear_backward_cuda, attnmix::kind::linear_causal,
                   attnmix::linear_causal_policy, false)
    ->Name("linear_causal_backward")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_linear_backward_cuda, attnmix::kind::linear_causal,
                   attnmix::linear_causal_policy, true)
    ->Name("linear_causal_forward_backward")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_linear_backward_cuda, attnmix::kind::linear_causal, gated_causal_policy,
                   false)
    ->Name("linear_causal_gated_backward")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_linear_backward_cuda, attnmix::kind::linear_causal, gated_causal_policy, true)
    ->Name("linear_causal_gated_forward_backward")
    ->Apply(causal_shapes);
