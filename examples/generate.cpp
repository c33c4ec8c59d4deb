// attnmix generate: greedy generation from a small hybrid language model ([PaTH-FoX, SA + RoPE,
// causal linear attention] x 2, random weights) for prompts of several lengths packed together:
// the prompts prefilled into the decoding caches, then one token a step. Every generated token
// is checked against the full forward over the prompt and the tokens before it; exits non-zero
// if one is not its argmax. Built by nvcc (generate_cuda) it also generates on the GPU.
//   generate [steps=24] [width=64]

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <vector>

#if defined(__CUDACC__)
#include <attnmix/cuda.cuh>
#else
#include <attnmix/attnmix.hpp>
#endif
#include <attnmix/train/language_model.hpp>

namespace {

using attnmix::index_t;
namespace layer = attnmix::layer;
using ids = attnmix::tensor_view<const std::int32_t, 2>;
using body = attnmix::stack<
    float, attnmix::repeat<2, layer::path_fox, layer::causal_sa_rope, layer::linear_causal>>;
using host_lm = attnmix::train::language_model<body>;

// How many generated tokens are not the argmax (within `tol`, relative) of logits [1, len, V]
// that `forward(seq, logits)` gives over each sequence's prompt and what came before them.
template <class Forward>
int check(const std::vector<std::int32_t>& packed, const std::vector<std::int32_t>& cu,
          const attnmix::host_tensor<std::int32_t, 2>& out, index_t V, double tol,
          Forward&& forward) {
  int wrong = 0;
  for (index_t n = 0; n + 1 < index_t(cu.size()); ++n) {
    std::vector<std::int32_t> seq(packed.begin() + cu[n], packed.begin() + cu[n + 1]);
    for (index_t t = 0; t < out.extent(1); ++t) seq.push_back(out(n, t));
    const index_t len = index_t(seq.size());
    const std::vector<float> z = forward(seq, len);
    for (index_t t = 0; t < out.extent(1); ++t) {
      const float* row = z.data() + (cu[n + 1] - cu[n] - 1 + t) * V;
      float best = row[0];
      for (index_t v = 1; v < V; ++v) best = std::max(best, row[v]);
      wrong += row[out(n, t)] < best - tol * std::max(1.f, std::abs(best));
    }
  }
  return wrong;
}

void print(const char* where, const attnmix::host_tensor<std::int32_t, 2>& out, double ms) {
  std::printf("%s: %.3f ms a step\n", where, ms);
  for (index_t n = 0; n < out.extent(0); ++n) {
    std::printf("  sequence %lld:", static_cast<long long>(n));
    for (index_t t = 0; t < out.extent(1); ++t) std::printf(" %d", out(n, t));
    std::printf("\n");
  }
}

// A whole decimal number in [lo, hi] into x, else false.
bool parse_count(const char* s, long long lo, long long hi, index_t& x) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) return false;
  x = index_t(v);
  return true;
}

int run(index_t steps, index_t width) {
  attnmix::layers::config c;
  c.hidden_size = width;
  c.num_heads = 2;
  c.intermediate_size = 2 * c.hidden_size;
  c.w_rank = 16;
  const index_t V = 97;
  host_lm lm(c, V);
  attnmix::layers::randomize_parameters(lm, 2026, 0.2, 0.3);

  // Three prompts of 5, 11 and 2 tokens, packed: [1, 18] with offsets.
  std::mt19937 gen(7);
  std::vector<std::int32_t> packed(18), cu{0, 5, 16, 18};
  for (auto& t : packed) t = std::int32_t(gen() % V);
  const ids prompts(packed.data(), {1, index_t(packed.size())});
  const attnmix::view1<const std::int32_t> offsets(cu.data(), {index_t(cu.size())});

  auto t0 = std::chrono::steady_clock::now();
  const auto out = lm.generate(prompts, offsets, steps);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  print("CPU", out, ms / double(steps));
  int wrong =
      check(packed, cu, out, V, 1e-5, [&](const std::vector<std::int32_t>& seq, index_t len) {
        attnmix::host_tensor<float, 3> z({1, len, V});
        lm.forward(ids(seq.data(), {1, len}), z.view());
        return z.storage();
      });

#if defined(__CUDACC__)
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    using gpu_lm = attnmix::train::language_model<attnmix::device_stack<body, float>>;
    const gpu_lm g(lm);  // the weights copied to the device once
    const attnmix::backend::cuda be{};
    (void)g.generate(prompts, offsets, 2, be);  // warm-up: cuBLAS and the kernels' first launch
    t0 = std::chrono::steady_clock::now();
    const auto gout = g.generate(prompts, offsets, steps, be);
    const double gms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    print("GPU", gout, gms / double(steps));
    wrong +=
        check(packed, cu, gout, V, 1e-4, [&](const std::vector<std::int32_t>& seq, index_t len) {
          attnmix::detail::cuda::device_memory z(std::size_t(len * V) * sizeof(float), "logits");
          g.forward(ids(seq.data(), {1, len}),
                    attnmix::view3<float>(static_cast<float*>(z.get()), {1, len, V},
                                          attnmix::memory_space::device),
                    be);
          std::vector<float> host(std::size_t(len * V));
          attnmix::detail::cuda::check(
              cudaMemcpy(host.data(), z.get(), host.size() * sizeof(float), cudaMemcpyDeviceToHost),
              "cudaMemcpy(logits)");
          return host;
        });
  } else {
    (void)cudaGetLastError();
    std::printf("no usable CUDA device: the GPU part is skipped\n");
  }
#endif
  if (wrong > 0) {
    std::fprintf(stderr, "generate: %d tokens are not the forward's argmax\n", wrong);
    return 1;
  }
  std::printf("every generated token is the full forward's argmax: done\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  index_t steps = 24, width = 64;
  if (argc > 3 || (argc > 1 && !parse_count(argv[1], 1, 1 << 20, steps)) ||
      (argc > 2 && !parse_count(argv[2], 2, 1 << 14, width)) || width % 2 != 0) {
    std::fprintf(stderr, "usage: generate [steps >= 1] [width: even, 2 to 16384]\n");
    return 2;
  }
  try {
    return run(steps, width);
  } catch (const std::exception& e) {  // attnmix::error, attnmix::cuda_error
    std::fprintf(stderr, "generate: %s\n", e.what());
    return 1;
  }
}
