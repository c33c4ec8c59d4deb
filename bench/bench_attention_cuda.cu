// CUDA softmax attention and FoX forward, bf16, timed with CUDA events (manual time).
// Shapes are those of bench/sdpa_peer.py, which times PyTorch's SDPA beside these and prints
// the ratio table. FLOPs: 4*B*H*T^2*D bidirectional, half of that causal.

#include <benchmark/benchmark.h>

#include "attnmix/cuda.cuh"
#include "cuda_bench.cuh"

namespace {

using attnmix::index_t;
using attnmix_bench::device_array;

// args: B, T, H. Portable: the mma.sync kernel that GPUs other than Hopper run. Calls: calls
// timed back to back (per call), so that the host's work for a call overlaps the previous one.
template <class Kind, class Policy, bool Portable = false, int Calls = 1>
void BM_attention_cuda(benchmark::State& state) {
  using T = attnmix::bfloat16;
  const index_t B = state.range(0), Tn = state.range(1), H = state.range(2), D = 64;
  const std::size_t n = static_cast<std::size_t>(B * Tn * H * D);
  device_array<T> q(n, 1), k(n, 2), v(n, 3), out(n, 5);
  device_array<float> g(static_cast<std::size_t>(B * Tn * H), 4, -0.1f, -0.01f);
  const auto dev = attnmix::memory_space::device;
  attnmix::attention_args<T> a{attnmix::view4<const T>(q.ptr, {B, Tn, H, D}, dev),
                               attnmix::view4<const T>(k.ptr, {B, Tn, H, D}, dev),
                               attnmix::view4<const T>(v.ptr, {B, Tn, H, D}, dev),
                               attnmix::view4<T>(out.ptr, {B, Tn, H, D}, dev)};
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate)
    a.g = attnmix::view3<const float>(g.ptr, {B, Tn, H}, dev);
  attnmix::backend::cuda be{};
  be.portable = Portable;
  attnmix_bench::time_with_events(
      state, [&] { attnmix::attention<Kind, Policy>(a, {}, be); }, Calls);
  const bool causal = Policy::mask == attnmix::mask_type::causal;
  const double flops = 4.0 * B * H * double(Tn) * double(Tn) * D * (causal ? 0.5 : 1.0);
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
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
    ->Name("sa_causal")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_attention_cuda, attnmix::kind::fox, attnmix::fox_policy)
    ->Name("fox_causal")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_attention_cuda, attnmix::kind::softmax, attnmix::softmax_policy, false, 10)
    ->Name("sa_causal_chain10")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_attention_cuda, attnmix::kind::fox, attnmix::fox_policy, false, 10)
    ->Name("fox_causal_chain10")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_attention_cuda, attnmix::kind::softmax, attnmix::bidirectional_softmax_policy)
    ->Name("sa_bidirectional")
    ->Apply(bidirectional_shapes);
// The portable kernel at the causal shapes ("_causal" last: sdpa_peer.py pairs it with causal
// SDPA).
BENCHMARK_TEMPLATE(BM_attention_cuda, attnmix::kind::softmax, attnmix::softmax_policy, true)
    ->Name("portable_sa_causal")
    ->Apply(causal_shapes);

// ---- training: forward (with lse) then backward ----------------------------------------------
// args: B, T, H, D. BackwardOnly: the backward alone, from one forward's out and lse. FLOPs: the
// forward's, and 2.5 times that for the backward (its five matrix products against the forward's
// two), FlashAttention's count. Names as bench/train_peer.py reads them
// (<kind>_fwd_bwd[_causal]/B/T/H/D; run it with --benchmark_filter=fwd_bwd); sdpa_peer.py's
// forward table wants a filter that leaves these out.
namespace {

// Forced: the backward's kernels forced to another variant where it applies (the mma.sync ones,
// or dQ inside the dk/dv kernel), for an A/B in one run.
using attnmix::detail::cuda::attention_backward_variant;
template <class Kind, class Policy, bool BackwardOnly, bool Forced = false,
          attention_backward_variant Variant = attention_backward_variant::sm80_mma_v2>
void BM_attention_train_cuda(benchmark::State& state) {
  using T = attnmix::bfloat16;
  using attnmix::detail::cuda::backward_variant_override;
  backward_variant_override() = {Forced, Variant};
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  const index_t B = state.range(0), Tn = state.range(1), H = state.range(2), D = state.range(3);
  const std::size_t n = static_cast<std::size_t>(B * Tn * H * D);
  const std::size_t rows = static_cast<std::size_t>(B * Tn * H);
  device_array<T> q(n, 1), k(n, 2), v(n, 3), out(n, 5), dout(n, 6), dq(n, 7), dk(n, 8), dv(n, 9);
  device_array<float> g(rows, 4, -0.1f, -0.01f), lse(rows, 10), dg(rows, 11);
  const auto dev = attnmix::memory_space::device;
  const attnmix::view4<const T> qv(q.ptr, {B, Tn, H, D}, dev), kv(k.ptr, {B, Tn, H, D}, dev),
      vv(v.ptr, {B, Tn, H, D}, dev);
  attnmix::attention_args<T> a{qv, kv, vv, attnmix::view4<T>(out.ptr, {B, Tn, H, D}, dev)};
  a.lse = attnmix::view3<float>(lse.ptr, {B, Tn, H}, dev);
  attnmix::attention_grad_args<T> ga{};
  ga.q = qv, ga.k = kv, ga.v = vv;
  ga.out = attnmix::view4<const T>(out.ptr, {B, Tn, H, D}, dev);
  ga.lse = attnmix::view3<const float>(lse.ptr, {B, Tn, H}, dev);
  ga.dout = attnmix::view4<const T>(dout.ptr, {B, Tn, H, D}, dev);
  ga.dq = attnmix::view4<T>(dq.ptr, {B, Tn, H, D}, dev);
  ga.dk = attnmix::view4<T>(dk.ptr, {B, Tn, H, D}, dev);
  ga.dv = attnmix::view4<T>(dv.ptr, {B, Tn, H, D}, dev);
  if constexpr (gated) {
    a.g = ga.g = attnmix::view3<const float>(g.ptr, {B, Tn, H}, dev);
    ga.dg = attnmix::view3<float>(dg.ptr, {B, Tn, H}, dev);
  }
  const attnmix::backend::cuda be{};
  if (BackwardOnly) attnmix::attention<Kind, Policy>(a, {}, be);
  attnmix_bench::time_with_events(state, [&] {
    if (!BackwardOnly) attnmix::attention<Kind, Policy>(a, {}, be);
    attnmix::attention_backward<Kind, Policy>(ga, {}, be);
  });
  const bool causal = Policy::mask == attnmix::mask_type::causal;
  const double forward = 4.0 * B * H * double(Tn) * double(Tn) * D * (causal ? 0.5 : 1.0);
  const double flops = forward * (BackwardOnly ? 2.5 : 3.5);
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  backward_variant_override() = {};
}

void train_shapes(benchmark::internal::Benchmark* b) {
  b->Args({32, 2048, 32, 64})->Args({32, 4096, 32, 64})->Args({8, 8192, 32, 64});
  b->Args({4, 16384, 32, 64})->Args({8, 4096, 16, 128})->Args({2, 16384, 16, 128});
  b->ArgNames({"B", "T", "H", "D"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK_TEMPLATE(BM_attention_train_cuda, attnmix::kind::softmax, attnmix::softmax_policy, false)
    ->Name("softmax_fwd_bwd_causal")
    ->Apply(train_shapes);
BENCHMARK_TEMPLATE(BM_attention_train_cuda, attnmix::kind::softmax, attnmix::softmax_policy, true)
    ->Name("softmax_bwd_causal")
    ->Apply(train_shapes);
BENCHMARK_TEMPLATE(BM_attention_train_cuda, attnmix::kind::softmax, attnmix::softmax_policy, true,
                   true)
    ->Name("softmax_bwd_causal_mma_sync")
    ->Apply(train_shapes);
BENCHMARK_TEMPLATE(BM_attention_train_cuda, attnmix::kind::softmax, attnmix::softmax_policy, true,
                   true, attention_backward_variant::sm90_wgmma_fused)
    ->Name("softmax_bwd_causal_fused")
    ->Apply(train_shapes);
BENCHMARK_TEMPLATE(BM_attention_train_cuda, attnmix::kind::fox, attnmix::fox_policy, false, true,
                   attention_backward_variant::sm90_wgmma_fused)
    ->Name("fox_fused_fwd_bwd")
    ->Apply(train_shapes);
BENCHMARK_TEMPLATE(BM_attention_train_cuda, attnmix::kind::fox, attnmix::fox_policy, false)
    ->Name("fox_fwd_bwd")
    ->Apply(train_shapes);
