// attnmix demo: softmax attention and FoX on random inputs, on the CPU. Prints the shapes, the
// time of the float computation and its error against the same computation in double.
//   demo [T] [heads] [threads]

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>

#include <attnmix/attnmix.hpp>

namespace {

using attnmix::index_t;

template <class T, int R>
attnmix::host_tensor<T, R> cast(const attnmix::host_tensor<float, R>& x) {
  attnmix::host_tensor<T, R> y(x.shape());
  for (index_t i = 0; i < x.size(); ++i) y.data()[i] = static_cast<T>(x.data()[i]);
  return y;
}

double rel_error(const attnmix::host_tensor<float, 4>& x,
                 const attnmix::host_tensor<double, 4>& ref) {
  double num = 0, den = 0;
  for (index_t i = 0; i < x.size(); ++i) {
    const double d = x.data()[i] - ref.data()[i];
    num += d * d, den += ref.data()[i] * ref.data()[i];
  }
  return std::sqrt(num / den);
}

// Runs Kind in float (timed) and in double; returns nothing, prints one line.
template <class Kind>
void run(const char* label, const attnmix::host_tensor<float, 4>& q,
         const attnmix::host_tensor<float, 4>& k, const attnmix::host_tensor<float, 4>& v,
         const attnmix::host_tensor<float, 3>& g, int threads) {
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  attnmix::host_tensor<float, 4> out(q.shape());
  attnmix::attention_args<float> a{q.view(), k.view(), v.view(), out.view()};
  if (gated) a.g = g.view();
  const auto t0 = std::chrono::steady_clock::now();
  attnmix::attention<Kind>(a, {}, attnmix::backend::cpu{threads});
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  const auto qd = cast<double>(q), kd = cast<double>(k), vd = cast<double>(v);
  const auto gd = cast<double>(g);
  attnmix::host_tensor<double, 4> ref(q.shape());
  attnmix::attention_args<double> ad{qd.view(), kd.view(), vd.view(), ref.view()};
  if (gated) ad.g = gd.view();
  attnmix::attention<Kind>(ad, {}, attnmix::backend::cpu{threads});

  const double T = double(q.extent(1)),
               flops = 2.0 * q.extent(0) * q.extent(2) * T * T * q.extent(3);
  std::printf("  %-22s %9.2f ms  %7.1f GFLOP/s  rel. error vs double %.2e\n", label, ms,
              flops / ms / 1e6, rel_error(out, ref));
}

}  // namespace

int main(int argc, char** argv) {
  const index_t B = 2, T = argc > 1 ? std::atol(argv[1]) : 1024,
                H = argc > 2 ? std::atol(argv[2]) : 8, D = 64;
  const int threads = argc > 3 ? std::atoi(argv[3]) : 0;
  if (T < 1 || H < 1) {
    std::fprintf(stderr, "usage: demo [T >= 1] [heads >= 1] [threads]\n");
    return 2;
  }
  attnmix::host_tensor<float, 4> q({B, T, H, D}), k({B, T, H, D}), v({B, T, H, D});
  attnmix::host_tensor<float, 3> g({B, T, H});
  std::mt19937 gen(2026);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> gate(std::log(0.9f), std::log(0.999f));
  for (auto* t : {&q, &k, &v})
    for (auto& x : t->storage()) x = normal(gen);
  for (auto& x : g.storage()) x = gate(gen);

  std::printf("attnmix %d.%d.%d demo, CPU backend\n", ATTNMIX_VERSION_MAJOR, ATTNMIX_VERSION_MINOR,
              ATTNMIX_VERSION_PATCH);
  std::printf("  q, k, v: [B=%lld, T=%lld, H=%lld, D=%lld] float; g: [B, T, H] log forget gate\n",
              (long long)B, (long long)T, (long long)H, (long long)D);
  run<attnmix::kind::softmax>("softmax (causal)", q, k, v, g, threads);
  run<attnmix::kind::fox>("FoX (causal)", q, k, v, g, threads);

  // A rejected call: k with 3 heads cannot serve 8 query heads.
  attnmix::host_tensor<float, 4> bad_k({B, T, 3, D}), out({B, T, H, D});
  try {
    attnmix::attention<attnmix::kind::softmax>(
        attnmix::attention_args<float>{q.view(), bad_k.view(), v.view(), out.view()});
  } catch (const attnmix::error& e) {
    std::printf("  bad input is rejected: %s\n", e.what());
  }
  return 0;
}
