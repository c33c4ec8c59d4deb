// CUDA PaTH and PaTH-FoX, bf16: the forward at the causal SA shapes of bench/sdpa_peer.py
// (which times cuDNN causal SDPA beside it), one decoding step against its memory floor, the
// prefill of a decoding cache against the forward, the forward + backward (attention_backward) and
// the backward's extra device memory. FLOPs of the forward: 4*B*H*T^2*D (spec/path_fox.md §6: twice
// causal attention's).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "attnmix/cuda.cuh"
#include "cuda_bench.cuh"

namespace {

using attnmix::index_t;
using attnmix_bench::device_array;
const auto dev = attnmix::memory_space::device;

__global__ void normalise_rows_kernel(float* w, index_t rows, int D) {
  for (index_t r = blockIdx.x * index_t{blockDim.x} + threadIdx.x; r < rows;
       r += index_t{gridDim.x} * blockDim.x) {
    float s = 0;
    for (int d = 0; d < D; ++d) s += w[r * D + d] * w[r * D + d];
    const float inv = rsqrtf(s);
    for (int d = 0; d < D; ++d) w[r * D + d] *= inv;
  }
}

// Unit-length w rows (the layer L2-normalises them); beta in (0, 2).
struct householder_inputs {
  device_array<float> w, beta;
  householder_inputs(index_t rows, index_t D)
      : w(static_cast<std::size_t>(rows * D), 7),
        beta(static_cast<std::size_t>(rows), 8, 0.f, 2.f) {
    normalise_rows_kernel<<<1024, 256>>>(w.ptr, rows, static_cast<int>(D));
    attnmix::detail::cuda::check(cudaDeviceSynchronize(), "normalise_rows_kernel");
  }
};

// Random inputs of a [B, T, H, D] PaTH-FoX call (HQ = H, bf16 q, k, v; float w, beta, g) and
// the arguments of kind Kind over them. `seed` offsets every array's seed.
struct path_call {
  using T = attnmix::bfloat16;
  index_t B, Tn, H, D;
  device_array<T> q, k, v, out;
  device_array<float> g;
  householder_inputs hh;

  path_call(index_t B_, index_t T_, index_t H_, index_t D_, unsigned seed)
      : B(B_),
        Tn(T_),
        H(H_),
        D(D_),
        q(size(), seed + 1),
        k(size(), seed + 2),
        v(size(), seed + 3),
        out(size(), seed + 5),
        g(static_cast<std::size_t>(B * Tn * H), seed + 4, -0.1f, -0.01f),
        hh(B * Tn * H, D) {}
  std::size_t size() const { return static_cast<std::size_t>(B * Tn * H * D); }

  template <class Kind>
  attnmix::attention_args<T> args() const {
    attnmix::attention_args<T> a{attnmix::view4<const T>(q.ptr, {B, Tn, H, D}, dev),
                                 attnmix::view4<const T>(k.ptr, {B, Tn, H, D}, dev),
                                 attnmix::view4<const T>(v.ptr, {B, Tn, H, D}, dev),
                                 attnmix::view4<T>(out.ptr, {B, Tn, H, D}, dev)};
    a.w = attnmix::view4<const float>(hh.w.ptr, {B, Tn, H, D}, dev);
    a.beta = attnmix::view3<const float>(hh.beta.ptr, {B, Tn, H}, dev);
    if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate)
      a.g = attnmix::view3<const float>(g.ptr, {B, Tn, H}, dev);
    return a;
  }
};

// args: B, T, H. Portable: the mma.sync kernel of non-Hopper GPUs, on this one. Calls: calls
// timed back to back (per call), so that the host's work for a call overlaps the previous one.
template <class Kind, bool Portable = false, int Calls = 1>
void BM_path_cuda(benchmark::State& state) {
  const index_t B = state.range(0), Tn = state.range(1), H = state.range(2), D = 64;
  const path_call call(B, Tn, H, D, 0);
  const auto a = call.args<Kind>();
  attnmix::backend::cuda be{};
  be.portable = Portable;
  attnmix_bench::time_with_events(
      state, [&] { attnmix::attention<Kind>(a, {}, be); }, Calls);
  const double flops = 4.0 * B * H * double(Tn) * double(Tn) * D;
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}

void causal_shapes(benchmark::internal::Benchmark* b) {
  for (auto [B, T] : {std::pair{32, 2048}, {32, 4096}, {8, 8192}, {4, 16384}}) b->Args({B, T, 32});
  b->ArgNames({"B", "T", "H"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

// One decoding step of N sequences holding L cached tokens each (H = HQ = 32, D = Dv = 64),
// from a cache in Store. GB/s counts the step's floor: every cached key and value read once (the
// cache defers the transitions, so a step no longer rewrites the keys; the flush every 64 steps
// and the float state, M and the recent keys, are left out of the count). The 200 iterations
// grow the cache from L to L + 200, through three flushes.
template <class Store>
void BM_path_decode(benchmark::State& state) {
  const index_t N = state.range(0), L = state.range(1), H = state.range(2), D = 64;
  attnmix::device_path_cache<Store> cache(N, L + 1024, H, H, D, D);
  using fox = attnmix::kind::path_fox;
  {  // fill the cache with a prefill of L tokens per sequence
    const path_call prompt(N, L, H, D, 0);
    attnmix::path_prefill<fox>(cache, prompt.args<fox>(), {}, {}, attnmix::backend::cuda{});
  }
  const path_call step(N, 1, H, D, 10);
  const auto a = step.args<fox>();
  attnmix_bench::time_with_events(
      state, [&] { attnmix::path_decode_step<fox>(cache, a, {}, {}, attnmix::backend::cuda{}); });
  const double bytes = double(N) * double(L) * H * 2.0 * D * sizeof(Store);
  state.counters["GB/s"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// The prefill of N prompts of L tokens (PaTH-FoX, H = HQ heads, D = Dv = 64) into a bfloat16
// device cache: the forward plus the keys carried to the prompt's end, the values and the gates
// moved into the slots. prefill_over_forward: its time over the forward's alone (median of 5,
// the same inputs, after the timed iterations). TensorCores: the key cache's walk on tensor cores
// (else on CUDA cores).
template <bool TensorCores>
void BM_path_prefill(benchmark::State& state) {
  const index_t N = state.range(0), L = state.range(1), H = state.range(2), D = 64;
  struct restore {
    ~restore() { attnmix::detail::cuda::path_key_cache_tensor_cores() = true; }
  } r;
  attnmix::detail::cuda::path_key_cache_tensor_cores() = TensorCores;
  using fox = attnmix::kind::path_fox;
  attnmix::device_path_cache<attnmix::bfloat16> cache(N, L, H, H, D, D);
  const path_call prompt(N, L, H, D, 0);
  const auto a = prompt.args<fox>();
  attnmix_bench::time_with_events(
      state, [&] { attnmix::path_prefill<fox>(cache, a, {}, {}, attnmix::backend::cuda{}); });
  std::vector<double> prefill, forward;
  for (int i = 0; i < 5; ++i) {
    prefill.push_back(attnmix_bench::event_ms(
        [&] { attnmix::path_prefill<fox>(cache, a, {}, {}, attnmix::backend::cuda{}); }));
    forward.push_back(
        attnmix_bench::event_ms([&] { attnmix::attention<fox>(a, {}, attnmix::backend::cuda{}); }));
  }
  std::sort(prefill.begin(), prefill.end()), std::sort(forward.begin(), forward.end());
  state.counters["forward_ms"] = forward[2];
  state.counters["prefill_over_forward"] = prefill[2] / forward[2];
}

// Device-to-device copy of 2 GiB: the bandwidth the decoding floor is measured against.
void BM_copy_bandwidth(benchmark::State& state) {
  const std::size_t bytes = std::size_t{1} << 31;
  void *src = nullptr, *dst = nullptr;
  attnmix::detail::cuda::check(cudaMalloc(&src, bytes), "cudaMalloc");
  attnmix::detail::cuda::check(cudaMalloc(&dst, bytes), "cudaMalloc");
  attnmix::detail::cuda::check(cudaMemset(src, 1, bytes), "cudaMemset");
  attnmix_bench::time_with_events(
      state, [&] { cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice); });
  state.counters["GB/s"] =  // read + write
      benchmark::Counter(2.0 * double(bytes) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  cudaFree(src), cudaFree(dst);
}

// Forward + backward (attention_backward), bf16 q, k, v and float w, beta, g as the authors'
// kernels take them, H = HQ, D = Dv; args B, T, H, D. FLOPs counted as the forward's
// 4 B H T^2 D plus 2.5 times that for the backward (the recomputed scan, dV, dK~, the adjoint
// scan and its transition gradients).
// One warm-up call (a call takes up to seconds), then the iterations, each timed with events.
template <class Kind>
void BM_path_backward_cuda(benchmark::State& state) {
  namespace cu = attnmix::detail::cuda;
  using T = attnmix::bfloat16;
  const index_t B = state.range(0), Tn = state.range(1), H = state.range(2), D = state.range(3);
  const path_call call(B, Tn, H, D, 0);
  device_array<float> lse(static_cast<std::size_t>(B * Tn * H), 11);
  device_array<T> dout(call.size(), 12), dq(call.size(), 13), dk(call.size(), 14),
      dv(call.size(), 15);
  device_array<float> dw(call.size(), 16), dbeta(static_cast<std::size_t>(B * Tn * H), 17),
      dg(static_cast<std::size_t>(B * Tn * H), 18);
  auto fa = call.args<Kind>();
  fa.lse = attnmix::view3<float>(lse.ptr, {B, Tn, H}, dev);
  attnmix::attention_grad_args<T> a;
  a.q = fa.q, a.k = fa.k, a.v = fa.v, a.w = fa.w, a.beta = fa.beta, a.g = fa.g;
  a.out = attnmix::view4<const T>(call.out.ptr, {B, Tn, H, D}, dev);
  a.lse = attnmix::view3<const float>(lse.ptr, {B, Tn, H}, dev);
  a.dout = attnmix::view4<const T>(dout.ptr, {B, Tn, H, D}, dev);
  a.dq = attnmix::view4<T>(dq.ptr, {B, Tn, H, D}, dev);
  a.dk = attnmix::view4<T>(dk.ptr, {B, Tn, H, D}, dev);
  a.dv = attnmix::view4<T>(dv.ptr, {B, Tn, H, D}, dev);
  a.dw = attnmix::view4<float>(dw.ptr, {B, Tn, H, D}, dev);
  a.dbeta = attnmix::view3<float>(dbeta.ptr, {B, Tn, H}, dev);
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate)
    a.dg = attnmix::view3<float>(dg.ptr, {B, Tn, H}, dev);
  const attnmix::backend::cuda be{};
  const auto call_once = [&] {
    attnmix::attention<Kind>(fa, {}, be);
    attnmix::attention_backward<Kind>(a, {}, be);
  };
  call_once();
  cudaEvent_t start, stop;
  cu::check(cudaEventCreate(&start), "cudaEventCreate");
  cu::check(cudaEventCreate(&stop), "cudaEventCreate");
  for (auto _ : state) {
    cu::check(cudaEventRecord(start), "cudaEventRecord");
    call_once();
    cu::check(cudaEventRecord(stop), "cudaEventRecord");
    cu::check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cu::check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(ms / 1e3);
  }
  cudaEventDestroy(start), cudaEventDestroy(stop);
  const double flops = 3.5 * 4.0 * B * H * double(Tn) * double(Tn) * D;
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}

// The shapes of the backward goals: H = 32, D = 64 and H = 16, D = 128.
void backward_shapes(benchmark::internal::Benchmark* b) {
  for (auto [B, T] : {std::pair{32, 2048}, {32, 4096}, {8, 8192}, {4, 16384}})
    b->Args({B, T, 32, 64});
  for (auto [B, T] : {std::pair{8, 4096}, {2, 16384}}) b->Args({B, T, 16, 128});
  // A call takes up to seconds: a few iterations are enough.
  b->ArgNames({"B", "T", "H", "D"})->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
}

// The backward's extra device memory (the plan's scratch: chunk data, per-slice sums, gate sums)
// on this GPU for bf16 inputs, reported as counters without running anything; args: B, T, H
// (HQ = H, D = 64).
void BM_path_backward_memory(benchmark::State& state) {
  namespace cu = attnmix::detail::cuda;
  const index_t B = state.range(0), Tn = state.range(1), H = state.range(2), D = 64;
  cu::path_shape s;
  s.batch = B, s.tokens = Tn, s.head_dim = D, s.value_dim = D, s.max_len = Tn;
  s.q_heads = H, s.kv_heads = H, s.sequences = B;
  s.sixteen_bit = true;  // bf16 inputs: the tensor-core kernels' plan
  const cu::path_backward_plan plan = cu::plan_path_backward(s, true, cu::current_properties());
  for (auto _ : state) benchmark::DoNotOptimize(plan.scratch_bytes);
  const double inputs = double(B) * Tn * H * D * 2.0;  // one bf16 [B, T, H, D] tensor
  state.counters["scratch_GiB"] = double(plan.scratch_bytes) / double(1ull << 30);
  state.counters["x_qkv_tensor"] = double(plan.scratch_bytes) / inputs;
  state.counters["slices"] = plan.slices;
}

}  // namespace

BENCHMARK_TEMPLATE(BM_path_cuda, attnmix::kind::path)->Name("path_causal")->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_path_cuda, attnmix::kind::path_fox)
    ->Name("path_fox_causal")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_path_cuda, attnmix::kind::path, false, 10)
    ->Name("path_causal_chain10")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_path_cuda, attnmix::kind::path_fox, false, 10)
    ->Name("path_fox_causal_chain10")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_path_cuda, attnmix::kind::path, true)
    ->Name("portable_path_causal")
    ->Apply(causal_shapes);
BENCHMARK_TEMPLATE(BM_path_decode, attnmix::bfloat16)
    ->Name("path_fox_decode_bf16_cache")
    ->Args({32, 8192, 32})
    ->ArgNames({"N", "L", "heads"})
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_path_decode, float)
    ->Name("path_fox_decode_f32_cache")
    ->Args({32, 8192, 32})
    ->ArgNames({"N", "L", "heads"})
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_path_prefill, true)
    ->Name("path_fox_prefill_bf16_cache")
    ->Args({32, 4096, 16})
    ->ArgNames({"N", "L", "heads"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_path_prefill, false)
    ->Name("path_fox_prefill_bf16_cache_simt")
    ->Args({32, 4096, 16})
    ->ArgNames({"N", "L", "heads"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_copy_bandwidth)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_path_backward_cuda, attnmix::kind::path)
    ->Name("path_fwd_bwd")
    ->Apply(backward_shapes);
BENCHMARK_TEMPLATE(BM_path_backward_cuda, attnmix::kind::path_fox)
    ->Name("path_fox_fwd_bwd")
    ->Apply(backward_shapes);
BENCHMARK(BM_path_backward_memory)
    ->Name("path_backward_scratch")
    ->Args({4, 16384, 32})
    ->Args({1, 131072, 8})
    ->ArgNames({"B", "T", "H"})
    ->Iterations(1);
