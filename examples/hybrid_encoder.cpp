// attnmix hybrid_encoder: the GBLA paper's [SA, GBLA, GBLA] x 3 encoder beside a 9-layer SA-only
// encoder, over a synthetic batch of user histories (item embeddings, right-padded to T), on the
// CPU. Prints the time of every layer, the FLOP counts, and the predicted against the measured
// speedup. Built by nvcc (the hybrid_encoder_cuda target, when CUDA is found) it then runs both
// encoders on the GPU too, in bfloat16 through attnmix::device_stack, and checks the GPU output
// against the CPU one.
//   hybrid_encoder [T=8192] [B=2] [D=256] [heads=4] [threads=0]
// The default length is one where the GBLA layers' linear cost beats softmax's quadratic one
// (about 2x on 2 CPU cores, in about 20 s); at T = 1024 the two stacks take the same time.

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#if defined(__CUDACC__)
#include <attnmix/cuda.cuh>
#else
#include <attnmix/attnmix.hpp>
#endif

namespace {

using attnmix::index_t;
namespace layer = attnmix::layer;
using hybrid = attnmix::stack<float, attnmix::repeat<3, layer::sa, layer::gbla, layer::gbla>>;
using sa_only = attnmix::stack<float, attnmix::repeat<9, layer::sa>>;

// Forward FLOPs of one layer (mixer + SwiGLU MLP) over the valid tokens of the batch.
double layer_flops(bool sa, const attnmix::layers::config& c, const std::vector<index_t>& lengths) {
  const double D = double(c.hidden_size),
               I = double(attnmix::layers::mlp_width(c, attnmix::layers::mlp_kind::swiglu));
  const double inner = double(c.num_heads * c.dim()), kv = double(c.kv_heads() * c.dim());
  const double d = double(c.dim());
  double f = 0;
  for (index_t n : lengths) {
    const double L = double(n);
    const double mlp = 6.0 * D * I * L;
    if (sa) {
      f += 2.0 * D * (2 * inner + 2 * kv) * L + 4.0 * L * L * inner + mlp;  // q,k,v,o + QK^T, PV
    } else {
      // conv, q/k/v/g/o projections, key gate, the S = sum p v^T reduce and the S^T phi(q) read.
      f += 8.0 * D * L + 2.0 * D * (3 * inner + 2 * kv + 1) * L + 4.0 * L * inner * d + mlp;
    }
  }
  return f;
}

template <class Stack>
double run(const char* label, const Stack& s, const attnmix::host_tensor<float, 3>& x,
           const attnmix::host_tensor<std::uint8_t, 2>& mask, attnmix::host_tensor<float, 3>& y,
           int threads, bool progress) {
  std::printf("%s\n", label);
  std::vector<double> times;
  attnmix::stack_inputs in;
  in.mask = mask.view();
  in.on_layer = [&](index_t i, const char* name, double sec) {
    times.push_back(sec);
    if (progress)
      std::fprintf(stderr, "\r  ... layer %lld/%zu done", static_cast<long long>(i + 1),
                   Stack::num_layers);
    (void)name;
  };
  const auto t0 = std::chrono::steady_clock::now();
  s.forward(x.view(), y.view(), in, attnmix::backend::cpu{threads});
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (progress) std::fprintf(stderr, "\r%40s\r", "");
  const auto names = Stack::layer_names();
  for (std::size_t i = 0; i < times.size(); ++i)
    std::printf("  layer %zu %-5s %9.2f ms\n", i, names[i], 1e3 * times[i]);
  std::printf("  total          %9.2f ms\n", 1e3 * total);
  return total;
}

#if defined(__CUDACC__)
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw attnmix::cuda_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// The same encoder on the GPU in bfloat16: per-layer times (CUDA events), then the whole forward
// timed without them; returns the whole forward's seconds. `ref`: the CPU output, to compare.
template <class Stack>
double run_gpu(const char* label, const Stack& s, const attnmix::host_tensor<float, 3>& x,
               const attnmix::host_tensor<std::uint8_t, 2>& mask,
               const attnmix::host_tensor<float, 3>& ref) {
  using bf16 = attnmix::bfloat16;
  std::printf("%s, GPU, bfloat16\n", label);
  const attnmix::device_stack<Stack, bf16> gpu(s);
  const std::size_t n = x.storage().size();
  std::vector<bf16> hx(n), hy(n);
  for (std::size_t i = 0; i < n; ++i) hx[i] = bf16(x.storage()[i]);
  bf16 *dx = nullptr, *dy = nullptr;
  cuda_check(cudaMalloc(&dx, n * sizeof(bf16)), "cudaMalloc");
  cuda_check(cudaMalloc(&dy, n * sizeof(bf16)), "cudaMalloc");
  cuda_check(cudaMemcpy(dx, hx.data(), n * sizeof(bf16), cudaMemcpyHostToDevice), "cudaMemcpy");
  const auto dev = attnmix::memory_space::device;
  const attnmix::view3<const bf16> vx(dx, x.shape(), dev);
  const attnmix::view3<bf16> vy(dy, x.shape(), dev);
  attnmix::stack_inputs in;
  in.mask = mask.view();
  const auto names = Stack::layer_names();
  in.on_layer = [&](index_t i, const char*, double sec) {
    std::printf("  layer %lld %-5s %9.3f ms\n", static_cast<long long>(i),
                names[static_cast<std::size_t>(i)], 1e3 * sec);
  };
  gpu.forward(vx, vy, in);  // also the warm-up
  in.on_layer = nullptr;
  cudaEvent_t a, b;
  cuda_check(cudaEventCreate(&a), "cudaEventCreate");
  cuda_check(cudaEventCreate(&b), "cudaEventCreate");
  constexpr int reps = 5;
  cuda_check(cudaEventRecord(a), "cudaEventRecord");
  for (int r = 0; r < reps; ++r) gpu.forward(vx, vy, in);
  cuda_check(cudaEventRecord(b), "cudaEventRecord");
  cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cuda_check(cudaMemcpy(hy.data(), dy, n * sizeof(bf16), cudaMemcpyDeviceToHost), "cudaMemcpy");
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double d = double(float(hy[i])) - double(ref.storage()[i]);
    num += d * d;
    den += double(ref.storage()[i]) * double(ref.storage()[i]);
  }
  const double err = std::sqrt(num / (den > 0 ? den : 1.0));
  std::printf("  total          %9.3f ms (mean of %d); relative difference to the CPU: %.2e\n",
              ms / reps, reps, err);
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  (void)cudaFree(dx);
  (void)cudaFree(dy);
  if (!(err < 0.05)) throw attnmix::cuda_error("the GPU output differs from the CPU one");
  return 1e-3 * ms / reps;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const index_t T = argc > 1 ? std::atol(argv[1]) : 8192;
  const index_t B = argc > 2 ? std::atol(argv[2]) : 2;
  attnmix::layers::config c;
  c.hidden_size = argc > 3 ? std::atol(argv[3]) : 256;
  c.num_heads = argc > 4 ? std::atol(argv[4]) : 4;
  const int threads = argc > 5 ? std::atoi(argv[5]) : 0;
  if (T < 1 || B < 1 || c.hidden_size < 1 || c.num_heads < 1 || c.hidden_size % c.num_heads != 0) {
    std::fprintf(stderr, "usage: hybrid_encoder [T>=1] [B>=1] [D] [heads dividing D] [threads]\n");
    return 2;
  }
  try {
    // Synthetic user histories: B users, history lengths in [T/2, T], each token the embedding of
    // one of 4096 items; right-padded to T with a validity mask.
    std::mt19937_64 gen(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const index_t items = 4096, D = c.hidden_size;
    std::vector<float> table(static_cast<std::size_t>(items * D));
    for (auto& v : table) v = normal(gen);
    attnmix::host_tensor<float, 3> x({B, T, D}), y_h({B, T, D}), y_s({B, T, D});
    attnmix::host_tensor<std::uint8_t, 2> mask({B, T}, 0);
    std::vector<index_t> lengths;
    for (index_t b = 0; b < B; ++b) {
      const index_t len = b == 0 ? T : std::uniform_int_distribution<index_t>((T + 1) / 2, T)(gen);
      lengths.push_back(len);
      for (index_t t = 0; t < len; ++t) {
        const index_t item = std::uniform_int_distribution<index_t>(0, items - 1)(gen);
        mask(b, t) = 1;
        for (index_t e = 0; e < D; ++e) x(b, t, e) = table[static_cast<std::size_t>(item * D + e)];
      }
    }
    hybrid h(c);
    sa_only s(c);
    attnmix::layers::randomize_parameters(h, 1);
    attnmix::layers::randomize_parameters(s, 2);

    index_t tokens = 0;
    for (index_t l : lengths) tokens += l;
    std::printf(
        "attnmix hybrid_encoder: B = %lld users, T = %lld (%lld valid tokens), D = %lld, "
        "%lld heads, SwiGLU MLP %lld, CPU threads %d\n",
        static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(tokens),
        static_cast<long long>(D), static_cast<long long>(c.num_heads),
        static_cast<long long>(attnmix::layers::mlp_width(c, attnmix::layers::mlp_kind::swiglu)),
        threads);
    const bool progress = T * B >= 8192;
    const double th = run("[SA, GBLA, GBLA] x 3", h, x, mask, y_h, threads, progress);
    const double ts = run("[SA] x 9", s, x, mask, y_s, threads, progress);

    const double f_sa = layer_flops(true, c, lengths), f_la = layer_flops(false, c, lengths);
    const double fh = 3 * f_sa + 6 * f_la, fs = 9 * f_sa;
    const double predicted = fs / fh, measured = ts / th;
    std::printf("FLOPs: hybrid %.2f G (%.1f GFLOP/s), SA-only %.2f G (%.1f GFLOP/s)\n", fh / 1e9,
                fh / th / 1e9, fs / 1e9, fs / ts / 1e9);
    std::printf(
        "speedup of the hybrid: predicted by FLOPs %.2fx, measured %.2fx (%.0f%% of predicted)\n",
        predicted, measured, 100.0 * measured / predicted);
#if defined(__CUDACC__)
    int devices = 0;
    if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
      const double gh = run_gpu("[SA, GBLA, GBLA] x 3", h, x, mask, y_h);
      const double gs = run_gpu("[SA] x 9", s, x, mask, y_s);
      std::printf("GPU speedup of the hybrid: predicted by FLOPs %.2fx, measured %.2fx\n",
                  predicted, gs / gh);
    } else {
      (void)cudaGetLastError();
      std::printf("no usable CUDA device: the GPU part is skipped\n");
    }
#endif
    for (float v : y_h.storage())
      if (!std::isfinite(v)) {
        std::fprintf(stderr, "hybrid_encoder: non-finite output\n");
        return 1;
      }
    std::printf("done\n");
  } catch (const std::exception& e) {  // attnmix::error, attnmix::cuda_error
    std::fprintf(stderr, "hybrid_encoder: %s\n", e.what());
    return 1;
  }
  return 0;
}
