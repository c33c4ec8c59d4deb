// One training step on the GPU (forward, backward and AdamW), bfloat16 mixed precision: 16-bit
// activations and projections, float residual stream, gradients, master weights and moments.
//   BM_gemm_bf16: cuBLAS bf16 GEMM (float accumulation), 8192^3, the matrix rate the steps are
//     measured against (run first: the other rows read it).
//   BM_encoder_step/T/B: the GBLA paper's encoder, [SA, GBLA, GBLA] x 3 against [SA] x 9, width
//     1024, 16 heads, SwiGLU, bidirectional; the stack's forward and backward from a fixed
//     d(out), then the AdamW step; both stacks in every iteration.
//   BM_lm_step/<kind>: a 12-layer causal language model of one mixer kind (PaTH-FoX, SA + RoPE,
//     FoX), width 1024, 16 heads, vocabulary 32768, B = 8, T = 4096: loss() and step().
// Counters: step times, tokens/s, the step's model FLOPs (3x the forward's matrix products: the
// projections, the MLP, the head and the attention as softmax attention counts it) over the step
// time, and that rate as a fraction of the GEMM rate: how much of the step is the model.

#include <benchmark/benchmark.h>

#include <attnmix/cuda.cuh>
#include <attnmix/train/language_model.hpp>
#include <attnmix/train/optimizer.hpp>

#include <cstdint>
#include <vector>

#include "cuda_bench.cuh"
#include "encoder_flops.hpp"

namespace {

using attnmix::index_t;
namespace layer = attnmix::layer;
namespace L = attnmix::layers;
using bf16 = attnmix::bfloat16;
using gpu = attnmix::backend::cuda;
using attnmix::detail::cuda::check;

double gemm_tflops = 0;  // BM_gemm_bf16's rate, for the fractions of the later rows

using attnmix_bench::event_ms;

void BM_gemm_bf16(benchmark::State& state) {
  const index_t n = 8192;
  attnmix_bench::device_array<bf16> x(std::size_t(n * n), 1), w(std::size_t(n * n), 2),
      y(std::size_t(n * n), 3);
  attnmix::detail::cuda::blas_handle h;
  const auto ten = [&] {
    for (int i = 0; i < 10; ++i)
      attnmix::detail::cuda::gemm_rows(h.get(), nullptr, x.ptr, n, n, w.ptr, n, n, y.ptr, n);
  };
  ten();  // warm-up: cuBLAS picks its kernel
  double ms = 0;
  for (auto _ : state) {
    const double t = event_ms(ten) / 10;
    ms += t;
    state.SetIterationTime(t * 1e-3);
  }
  ms /= double(state.iterations());
  gemm_tflops = 2.0 * double(n) * double(n) * double(n) / (ms * 1e-3) / 1e12;
  state.counters["TFLOPs"] = gemm_tflops;
}
BENCHMARK(BM_gemm_bf16)->Iterations(5)->UseManualTime()->Unit(benchmark::kMillisecond);

L::config paper_config() {
  L::config c;
  c.hidden_size = 1024;
  c.num_heads = 16;
  return c;
}

template <class HostStack>
struct encoder_run {
  using device = attnmix::device_stack<HostStack, bf16>;
  device stack;
  typename device::saved_type saved;
  attnmix::train::adamw<gpu> opt;
  explicit encoder_run(const HostStack& h) : stack(h) { opt.init(stack); }
  // One step: the forward, the backward from dout, the optimiser.
  void step(const attnmix::view3<const bf16>& x, const attnmix::view3<bf16>& out,
            const attnmix::view3<const bf16>& dout, const attnmix::view3<bf16>& dx) {
    attnmix::train::adamw<gpu>::zero_grad(stack, gpu{});
    stack.forward(x, out, saved, {}, gpu{});
    stack.backward(dout, dx, saved, gpu{});
    opt.step(stack, 1e-4, gpu{});
  }
};

void BM_encoder_step(benchmark::State& state) {
  using hybrid = attnmix::stack<float, attnmix::repeat<3, layer::sa, layer::gbla, layer::gbla>>;
  using sa_only = attnmix::stack<float, attnmix::repeat<9, layer::sa>>;
  const index_t T = state.range(0), B = state.range(1);
  const L::config c = paper_config();
  const index_t D = c.hidden_size;
  double th = 0, ts = 0;
  {
    hybrid hh(c);
    sa_only hs(c);
    L::randomize_parameters(hh, 1);
    L::randomize_parameters(hs, 2);
    encoder_run<hybrid> rh(hh);
    encoder_run<sa_only> rs(hs);
    const std::size_t n = std::size_t(B * T * D);
    attnmix_bench::device_array<bf16> x(n, 1, -2.f, 2.f), out(n), dout(n, 4, -1e-3f, 1e-3f), dx(n);
    const auto dev = attnmix::memory_space::device;
    const attnmix::view3<const bf16> vx(x.ptr, {B, T, D}, dev), vd(dout.ptr, {B, T, D}, dev);
    const attnmix::view3<bf16> vo(out.ptr, {B, T, D}, dev), vdx(dx.ptr, {B, T, D}, dev);
    rh.step(vx, vo, vd, vdx), rs.step(vx, vo, vd, vdx);  // the first steps allocate
    for (auto _ : state) {
      const double a = event_ms([&] { rh.step(vx, vo, vd, vdx); });
      const double b = event_ms([&] { rs.step(vx, vo, vd, vdx); });
      th += a, ts += b;
      state.SetIterationTime((a + b) * 1e-3);
    }
  }
  th /= double(state.iterations()), ts /= double(state.iterations());
  const double fh = 3.0 * double(B) *
                    (3 * attnmix_bench::block_flops(true, c, double(T)) +
                     6 * attnmix_bench::block_flops(false, c, double(T)));
  const double fs = 3.0 * double(B) * 9 * attnmix_bench::block_flops(true, c, double(T));
  state.counters["hybrid_ms"] = th;
  state.counters["sa_only_ms"] = ts;
  state.counters["speedup"] = ts / th;
  state.counters["hybrid_TFLOPs"] = fh / (th * 1e-3) / 1e12;
  state.counters["sa_only_TFLOPs"] = fs / (ts * 1e-3) / 1e12;
  state.counters["sa_only_of_gemm"] = gemm_tflops > 0 ? fs / (ts * 1e-3) / 1e12 / gemm_tflops : 0;
  state.counters["hybrid_of_gemm"] = gemm_tflops > 0 ? fh / (th * 1e-3) / 1e12 / gemm_tflops : 0;
}
BENCHMARK(BM_encoder_step)
    ->Args({2048, 32})
    ->Args({8192, 8})
    ->Args({32768, 2})
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

template <class Layer>
void BM_lm_step(benchmark::State& state) {
  using host_stack = attnmix::stack<float, attnmix::repeat<12, Layer>>;
  using host_lm = attnmix::train::language_model<host_stack>;
  using device_lm = attnmix::train::language_model<attnmix::device_stack<host_stack, bf16>>;
  const index_t B = 8, T = 4096, V = 32768;
  const L::config c = paper_config();
  double ms = 0;
  {
    host_lm h(c, V);
    L::randomize_parameters(h, 7);
    device_lm m(h);
    m.logits_rows = 8192;  // [8192, V] logits at once, not [B T, V]
    attnmix::train::adamw<gpu> opt;
    opt.init(m);
    std::vector<std::int32_t> tokens(std::size_t(B * T)), labels(tokens.size());
    std::uint64_t z = 12345;
    for (auto& t : tokens)
      z = z * 6364136223846793005ull + 1442695040888963407ull,
      t = std::int32_t((z >> 33) % std::uint64_t(V));
    for (index_t i = 0; i < B * T; ++i)
      labels[std::size_t(i)] =
          (i + 1) % T == 0 ? attnmix::train::ignore_label : tokens[std::size_t(i + 1)];
    const attnmix::tensor_view<const std::int32_t, 2> tv(tokens.data(), {B, T}),
        lv(labels.data(), {B, T});
    const auto step = [&] {
      attnmix::train::adamw<gpu>::zero_grad(m, gpu{});
      m.loss(tv, lv, true, gpu{});
      opt.step(m, 1e-4, gpu{});
    };
    step();  // the first step allocates
    for (auto _ : state) {
      const double t = event_ms(step);
      ms += t;
      state.SetIterationTime(t * 1e-3);
    }
  }
  ms /= double(state.iterations());
  const double flops = 3.0 * double(B) *
                       (12 * attnmix_bench::block_flops(true, c, double(T), true) +
                        2.0 * double(c.hidden_size) * V * double(T));
  state.counters["step_ms"] = ms;
  state.counters["tokens_per_s"] = double(B * T) / (ms * 1e-3);
  state.counters["model_TFLOPs"] = flops / (ms * 1e-3) / 1e12;
  state.counters["of_gemm"] = gemm_tflops > 0 ? flops / (ms * 1e-3) / 1e12 / gemm_tflops : 0;
}
BENCHMARK(BM_lm_step<layer::path_fox>)
    ->Name("BM_lm_step/path_fox")
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_lm_step<layer::causal_sa_rope>)
    ->Name("BM_lm_step/sa_rope")
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_lm_step<layer::fox>)
    ->Name("BM_lm_step/fox")
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
