// Mixed-precision training on the GPU: language models over device stacks in bfloat16 (the
// residual stream in float, parameter gradients in float, float master weights in AdamW) against
// the same model in float on the CPU: the loss and every gradient of one step, for each mixer
// kind; a short run whose loss falls; and a run resumed from a float checkpoint (the masters as
// the model's weights, the moments through a host optimiser) that continues bit for bit.

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "attnmix/cuda.cuh"
#include "attnmix/train/language_model.hpp"
#include "attnmix/train/optimizer.hpp"
#include "support/catch.hpp"
#include "support/cuda_testing.cuh"
#include "support/testing.hpp"

namespace {

using namespace attnmix_test;
using attnmix::index_t;
namespace L = attnmix::layers;
using cpu_be = attnmix::backend::cpu;
using gpu_be = attnmix::backend::cuda;
using bf16 = attnmix::bfloat16;

template <class Layer>
using host_lm = attnmix::train::language_model<attnmix::stack<float, Layer>>;
template <class Layer>
using mixed_lm =
    attnmix::train::language_model<attnmix::device_stack<attnmix::stack<float, Layer>, bf16>>;

L::config small_config() {
  L::config c;
  c.hidden_size = 64;
  c.num_heads = 4;
  c.intermediate_size = 96;
  c.w_rank = 8;
  return c;
}

// Tokens and next-token labels; with `previous`, the label is the token before (a task a causal
// model learns in a few dozen steps).
struct lm_data {
  index_t B = 2, T = 45, V = 29;
  std::vector<std::int32_t> tokens, labels;
  attnmix::tensor_view<const std::int32_t, 2> tok() const { return {tokens.data(), {B, T}}; }
  attnmix::tensor_view<const std::int32_t, 2> lab() const { return {labels.data(), {B, T}}; }
};
lm_data make_data(std::uint64_t salt, bool previous = false, index_t V = 29) {
  rng r(salt);
  lm_data d;
  d.V = V;
  for (index_t i = 0; i < d.B * d.T; ++i) d.tokens.push_back(std::int32_t(r.integer(0, V - 1)));
  for (index_t b = 0; b < d.B; ++b)
    for (index_t t = 0; t < d.T; ++t) {
      const index_t i = b * d.T + t;
      const bool has = previous ? t > 0 : t + 1 < d.T;
      d.labels.push_back(has ? d.tokens[std::size_t(previous ? i - 1 : i + 1)]
                             : attnmix::train::ignore_label);
    }
  return d;
}

template <class Model>
std::vector<std::pair<std::string, std::vector<double>>> grads_of(const Model& m) {
  std::vector<std::pair<std::string, std::vector<double>>> out;
  m.visit_parameters([&](const std::string& name, const auto& p) {
    if constexpr (std::is_same_v<typename std::decay_t<decltype(p)>::value_type, float> ||
                  std::is_same_v<typename std::decay_t<decltype(p)>::value_type, bf16>) {
      const auto g = p.grad_values();
      out.emplace_back(name, std::vector<double>(g.begin(), g.end()));
    }
  });
  return out;
}
template <class Layer>
std::vector<std::pair<std::string, std::vector<double>>> host_grads(const host_lm<Layer>& m) {
  std::vector<std::pair<std::string, std::vector<double>>> out;
  m.visit_parameters([&](const std::string& name, const auto& p) {
    out.emplace_back(name, p.grad.empty() ? std::vector<double>(std::size_t(p.numel()), 0.0)
                                          : std::vector<double>(p.grad.begin(), p.grad.end()));
  });
  return out;
}

// One step's loss and gradients in bfloat16 on the device against float on the CPU. bfloat16
// keeps 8 bits: each rounding of an activation or a weight is a relative error of up to 2^-9, and a
// gradient passes through a few dozen of them (two projections a layer, the attention, the MLP,
// the head), so its relative error is a few 2^-9 in norm: 3 % allows about 15.
constexpr double loss_tol = 1e-2, grad_tol = 3e-2;

template <class Layer>
void check_step(std::uint64_t salt) {
  INFO("seed " << test_seed() << ", layer " << Layer::name);
  const lm_data d = make_data(salt);
  host_lm<Layer> host(small_config(), d.V);
  L::randomize_parameters(host, test_seed() ^ salt, 0.1, 0.2);
  mixed_lm<Layer> dev(host);
  attnmix::train::adamw<cpu_be>::zero_grad(host);
  attnmix::train::adamw<gpu_be>::zero_grad(dev);
  const double want = host.loss(d.tok(), d.lab(), true);
  const double got = dev.loss(d.tok(), d.lab(), true, gpu_be{});
  INFO("loss " << got << " against " << want);
  CHECK(std::isfinite(got));
  CHECK(std::abs(got - want) <= loss_tol * std::abs(want));
  const auto gh = host_grads<Layer>(host), gd = grads_of(dev);
  REQUIRE(gh.size() == gd.size());
  // A bias's gradient sums its projection's dy over the rows and may cancel (the gate and beta
  // projections'): its error is held to the size of the terms it sums, which the weight's
  // gradient shows (dW sums the same dy times the RMS-normed inputs: ||dW|| / sqrt(in)).
  const auto floor_of = [&](std::size_t i) {
    const std::string& name = gh[i].first;
    const std::string suffix = ".bias";
    if (name.size() < suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      return 0.0;
    const std::string weight = name.substr(0, name.size() - suffix.size()) + ".weight";
    for (const auto& [n, g] : gh)
      if (n == weight && !g.empty() && g.size() % gh[i].second.size() == 0) {
        double sq = 0;
        for (double x : g) sq += x * x;
        return std::sqrt(sq / double(g.size() / gh[i].second.size()));
      }
    return 0.0;
  };
  double worst = 0;
  for (std::size_t i = 0; i < gh.size(); ++i) {
    REQUIRE(gh[i].first == gd[i].first);
    const double err = floored_error(gd[i].second, gh[i].second, floor_of(i));
    worst = std::max(worst, err);
    INFO("d " << gh[i].first << ": relative error " << err);
    CHECK(err <= grad_tol);
  }
  UNSCOPED_INFO(Layer::name << ": largest gradient error " << worst);
}

}  // namespace

TEST_CASE("a bfloat16 step of every mixer kind against the float step", "[cuda][mixed]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  namespace ly = attnmix::layer;
  check_step<ly::sa>(11);
  check_step<ly::fox>(12);
  check_step<ly::path>(13);
  check_step<ly::path_fox>(14);
  check_step<ly::bla>(15);
  check_step<ly::gbla>(16);
  check_step<ly::linear_causal>(17);
}

namespace {

using run_lm = mixed_lm<attnmix::layer::path_fox>;
using run_host = host_lm<attnmix::layer::path_fox>;

// Steps [first, last) of a run on the previous-token task; the loss before each step.
std::vector<double> steps(run_lm& m, attnmix::train::adamw<gpu_be>& opt, int first, int last) {
  std::vector<double> losses;
  for (int s = first; s < last; ++s) {
    const lm_data d = make_data(5000 + std::uint64_t(s), true, 13);
    attnmix::train::adamw<gpu_be>::zero_grad(m);
    losses.push_back(m.loss(d.tok(), d.lab(), true, gpu_be{}));
    opt.step(m, 3e-3, gpu_be{});
  }
  return losses;
}

// A run's start: the device model from the float one, the masters from its float weights.
void start(const run_host& h, run_lm& m, attnmix::train::adamw<gpu_be>& opt) {
  opt.init(m);
  auto weights = opt.master_weights(m);
  L::transfer_parameters(h, weights);
}

std::vector<double> weights_of(const run_lm& m) {
  std::vector<double> all, v;
  m.visit_parameters([&](const std::string&, const auto& p) {
    p.get_values(v);
    all.insert(all.end(), v.begin(), v.end());
  });
  return all;
}

}  // namespace

TEST_CASE("a bfloat16 PaTH-FoX model learns; a run resumed from a float checkpoint is the same",
          "[cuda][mixed]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  attnmix::train::adamw_config oc;
  oc.clip_norm = 1.0;
  run_host h(small_config(), 13);
  L::randomize_parameters(h, test_seed() ^ 77, 0.05, 0.1);

  constexpr int total = 60, cut = 35;
  run_lm a(h);
  attnmix::train::adamw<gpu_be> oa(oc);
  start(h, a, oa);
  const std::vector<double> full = steps(a, oa, 0, total);
  for (double x : full) REQUIRE(std::isfinite(x));
  const double first = (full[0] + full[1] + full[2]) / 3,
               last = (full[total - 3] + full[total - 2] + full[total - 1]) / 3;
  INFO("loss " << first << " -> " << last);
  CHECK(first > 2.0);  // about log 13
  CHECK(last < 0.5 * first);

  // The same run, saved at `cut` as a float model (the masters over the 16-bit weights) and a
  // host optimiser, and resumed in a fresh model and optimiser made from them.
  run_lm b(h);
  attnmix::train::adamw<gpu_be> ob(oc);
  start(h, b, ob);
  const std::vector<double> part = steps(b, ob, 0, cut);
  run_host ckpt(small_config(), 13);
  L::transfer_parameters(ob.master_weights(b), ckpt);
  attnmix::train::adamw<cpu_be> host_opt(oc);
  host_opt.init(ckpt);
  L::transfer_parameters(ob, host_opt);

  run_lm c(ckpt);
  attnmix::train::adamw<gpu_be> oc2(oc);
  start(ckpt, c, oc2);
  L::transfer_parameters(host_opt, oc2);
  CHECK(weights_of(c) == weights_of(b));
  const std::vector<double> rest = steps(c, oc2, cut, total);
  for (int i = 0; i < cut; ++i) CHECK(part[std::size_t(i)] == full[std::size_t(i)]);
  for (int i = cut; i < total; ++i) CHECK(rest[std::size_t(i - cut)] == full[std::size_t(i)]);
  CHECK(weights_of(c) == weights_of(a));
}

// ---- What a training step promises: after the first step it allocates no device memory, and it
// waits for the device only at its two reads (the loss, at the end of loss(); the gradient norm,
// at the end of step()).
namespace {

// Holds its stream until *open turns nonzero (host memory the device reads) or timeout_ns pass;
// *expired says which.
__global__ void gate_kernel(const volatile int* open, int* expired, unsigned long long timeout_ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    if (*open != 0) {
      *expired = 0;
      return;
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < timeout_ns);
  *expired = 1;
}

// Whether `call` queues all its work before it first waits for the device. The stream is held by
// a gate that another thread opens only once the call has reached attnmix's read of a device
// value (the count of such reads moves): a call that waited anywhere before that would hold the
// gate shut until it expires (5 s).
template <class Call>
bool waits_only_at_its_read(Call&& call) {
  namespace k = attnmix::detail::cuda;
  int* host = nullptr;
  k::check(cudaHostAlloc(reinterpret_cast<void**>(&host), 2 * sizeof(int), cudaHostAllocMapped),
           "cudaHostAlloc");
  volatile int* shared = host;
  shared[0] = 0, shared[1] = -1;
  int* dev = nullptr;
  k::check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0),
           "cudaHostGetDevicePointer");
  std::atomic<std::uint64_t>& waits = k::counts().waits;
  const std::uint64_t before = waits.load();
  gate_kernel<<<1, 1>>>(dev, dev + 1, 5000000000ull);
  k::check(cudaGetLastError(), "gate kernel launch");
  std::thread opener([&] {
    const auto t0 = std::chrono::steady_clock::now();
    while (waits.load() == before &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
      std::this_thread::yield();
    shared[0] = 1;
  });
  call();
  opener.join();
  k::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const int expired = shared[1];
  (void)cudaFreeHost(host);
  INFO("the gate " << (expired == 1 ? "expired" : expired == 0 ? "was opened" : "never ran"));
  return expired == 0;
}

std::uint64_t pool_reserved() {
  namespace k = attnmix::detail::cuda;
  cuuint64_t bytes = 0;
  k::check(cudaMemPoolGetAttribute(k::current_device().scratch_pool,
                                   cudaMemPoolAttrReservedMemCurrent, &bytes),
           "cudaMemPoolGetAttribute");
  return std::uint64_t(bytes);
}

}  // namespace

TEST_CASE("a training step allocates nothing after the first and waits only at its two reads",
          "[cuda][mixed][step]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  namespace ly = attnmix::layer;
  using host_stack = attnmix::stack<float, ly::path_fox, ly::causal_sa, ly::gbla>;
  using host_model = attnmix::train::language_model<host_stack>;
  using model = attnmix::train::language_model<attnmix::device_stack<host_stack, bf16>>;
  using opt_t = attnmix::train::adamw<gpu_be>;
  namespace k = attnmix::detail::cuda;
  host_model h(small_config(), 29);
  L::randomize_parameters(h, test_seed() ^ 91, 0.05, 0.1);
  model m(h);
  attnmix::train::adamw_config oc;
  oc.clip_norm = 0.5;  // below the gradient's norm: the step clips
  opt_t opt(oc);
  opt.init(m);
  const lm_data d = make_data(93);
  const gpu_be be{};
  double loss = 0, norm = 0;
  const auto step = [&] {
    opt_t::zero_grad(m, be);
    loss = m.loss(d.tok(), d.lab(), true, be);
    norm = opt.step(m, 1e-3, be);
  };
  step();  // the first step allocates the gradients, the saved activations and scratch
  step();
  const std::uint64_t allocations = k::counts().allocations.load(), reserved = pool_reserved(),
                      waits = k::counts().waits.load();
  for (int i = 0; i < 3; ++i) step();
  CHECK(k::counts().allocations.load() == allocations);
  CHECK(pool_reserved() == reserved);
  CHECK(k::counts().waits.load() == waits + 6);
  INFO("loss " << loss << ", gradient norm " << norm);
  CHECK(std::isfinite(loss));
  CHECK(norm > oc.clip_norm);

  opt_t::zero_grad(m, be);
  CHECK(waits_only_at_its_read([&] { loss = m.loss(d.tok(), d.lab(), true, be); }));
  CHECK(waits_only_at_its_read([&] { norm = opt.step(m, 1e-3, be); }));
  CHECK(std::isfinite(loss));
  CHECK(std::isfinite(norm));

  // A batch of 32768 tokens (128 KB of ids and of labels, copied from pageable host memory) is
  // queued without a wait too, once a first call at its size has grown the saved activations.
  lm_data big;
  big.B = 8, big.T = 4096;
  rng r(95);
  for (index_t i = 0; i < big.B * big.T; ++i) {
    big.tokens.push_back(std::int32_t(r.integer(0, big.V - 1)));
    big.labels.push_back(std::int32_t(r.integer(0, big.V - 1)));
  }
  m.loss(big.tok(), big.lab(), true, be);
  CHECK(waits_only_at_its_read([&] { loss = m.loss(big.tok(), big.lab(), true, be); }));
  CHECK(std::isfinite(loss));
}
