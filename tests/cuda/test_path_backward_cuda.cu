// The CUDA PaTH / PaTH-FoX backward against the CPU backward in double on the same inputs: q, k,
// v, out and dout rounded to the input type on both sides, w, beta, g and lse in float. Every
// gradient is compared on its own (max |gpu - cpu| / max |cpu|, within 1e-5 or 4x the CPU float
// backward's own error) and named when it fails. Cases
// run smallest first (T = 1, 5, 64, 65, 200, D = 64 then 128, GQA, varlen with an empty and a
// length-1 sequence, an odd head dim, several slices), then PaTH-FoX in both gate conventions and
// with hard resets, 16-bit inputs, two runs giving identical bits, and the CUDA forward's out and
// lse as the backward's input. The kernels are the plan's (the register-blocked "tiled" query and
// chunk kernels for float, the tensor-core ones for 16-bit inputs where they apply) except in the
// first cases, which force the tiled kernels for every dtype, and in the run-twice check (every
// set).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnmix/cuda.cuh"
#include "cpu/test_path_harness.hpp"
#include "support/cuda_testing.cuh"

using namespace attnmix_test;
using attnmix::gate_scaling;
using attnmix::index_t;
using attnmix::kind::path;
using attnmix::kind::path_fox;

namespace {

const auto dev = attnmix::memory_space::device;
using after_scale = attnmix::with_gate_scaling<attnmix::path_fox_policy, gate_scaling::after_scale>;

struct grads {
  std::vector<double> dq, dk, dv, dw, dbeta, dg;
};

// Inputs of one case as both sides see them (q, k, v, out, dout on T's grid).
struct bwd_inputs {
  path_inputs in;
  std::vector<double> out, lse, dout;
};

template <class T>
std::vector<double> on_grid(const std::vector<double>& x) {
  return convert_all<double>(convert_all<T>(x));
}

std::vector<double> random_dout(const path_case& c, std::uint64_t salt) {
  rng r(salt);
  std::vector<double> d(static_cast<std::size_t>(c.B * c.T * c.HQ * c.Dv));
  for (auto& x : d) x = to_float_grid(r.normal());
  return d;
}

// The CPU forward in float gives out and lse; `g_inf`: tokens whose log gate becomes -inf.
template <class Kind, class Policy, class T>
bwd_inputs make_inputs(const path_case& c, std::uint64_t salt,
                       const std::vector<index_t>& g_inf = {}) {
  bwd_inputs b;
  b.in = make_path_inputs(c, salt);
  for (index_t t : g_inf)
    for (index_t hq = 0; hq < c.HQ; ++hq)
      b.in.g[static_cast<std::size_t>(t * c.HQ + hq)] = -std::numeric_limits<double>::infinity();
  b.in.q = on_grid<T>(b.in.q), b.in.k = on_grid<T>(b.in.k), b.in.v = on_grid<T>(b.in.v);
  path_case cc = c;
  cc.threads = 0;
  const path_outputs f = run_path_forward<Kind, Policy, float>(cc, b.in);
  b.out = on_grid<T>(f.out);
  b.lse = f.lse;
  b.dout = on_grid<T>(random_dout(c, salt + 7));
  return b;
}

// The CPU backward in S (float or double) on the same inputs.
template <class Kind, class Policy, class S>
grads cpu_backward(const path_case& c, const bwd_inputs& b) {
  path_tensors<S> t(c, b.in);
  t.out.storage() = cast_to<S>(b.out);
  t.lse.storage() = cast_to<S>(b.lse);
  attnmix::host_tensor<S, 4> dO({c.B, c.T, c.HQ, c.Dv}), dq({c.B, c.T, c.HQ, c.D}),
      dk({c.B, c.T, c.H, c.D}), dv({c.B, c.T, c.H, c.Dv}), dw({c.B, c.T, c.H, c.D});
  attnmix::host_tensor<S, 3> dbeta({c.B, c.T, c.H}), dg({c.B, c.T, c.HQ});
  dO.storage() = cast_to<S>(b.dout);
  attnmix::attention_grad_args<S> a;
  a.q = t.q.view(), a.k = t.k.view(), a.v = t.v.view();
  a.w = t.w.view(), a.beta = t.beta.view();
  a.out = t.out.view(), a.lse = t.lse.view(), a.dout = dO.view();
  a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view(), a.dw = dw.view(), a.dbeta = dbeta.view();
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  if constexpr (gated) a.g = t.g.view(), a.dg = dg.view();
  attnmix::attention_backward<Kind, Policy>(a, path_params(c), attnmix::backend::cpu{0});
  return {to_double(dq.storage()),    to_double(dk.storage()),
          to_double(dv.storage()),    to_double(dw.storage()),
          to_double(dbeta.storage()), gated ? to_double(dg.storage()) : std::vector<double>{}};
}

// What the device is measured against: the CPU backward in double, and the CPU backward in float
// (whose own error says how well conditioned each gradient is on these inputs).
struct cpu_reference {
  grads exact, host;
};

template <class Kind, class Policy>
cpu_reference cpu_backward(const path_case& c, const bwd_inputs& b) {
  return {cpu_backward<Kind, Policy, double>(c, b), cpu_backward<Kind, Policy, float>(c, b)};
}

// The case's tensors on the device; gradients start as NaN.
template <class T>
struct device_case {
  path_case c;
  device_buffer<T> q, k, v, out, dout, dq, dk, dv;
  device_buffer<float> w, beta, g, lse, dw, dbeta, dg;

  device_case(const path_case& cs, const bwd_inputs& b)
      : c(cs),
        q(convert_all<T>(b.in.q)),
        k(convert_all<T>(b.in.k)),
        v(convert_all<T>(b.in.v)),
        out(convert_all<T>(b.out)),
        dout(convert_all<T>(b.dout)),
        dq(b.in.q.size()),
        dk(b.in.k.size()),
        dv(b.in.v.size()),
        w(convert_all<float>(b.in.w)),
        beta(convert_all<float>(b.in.beta)),
        g(convert_all<float>(b.in.g)),
        lse(convert_all<float>(b.lse)),
        dw(b.in.w.size()),
        dbeta(b.in.beta.size()),
        dg(b.in.g.size()) {}

  template <class Kind>
  attnmix::attention_grad_args<T> args() const {
    const index_t B = c.B, Tn = c.T, HQ = c.HQ, H = c.H, D = c.D, Dv = c.Dv;
    attnmix::attention_grad_args<T> a;
    a.q = attnmix::view4<const T>(q.get(), {B, Tn, HQ, D}, dev);
    a.k = attnmix::view4<const T>(k.get(), {B, Tn, H, D}, dev);
    a.v = attnmix::view4<const T>(v.get(), {B, Tn, H, Dv}, dev);
    a.w = attnmix::view4<const float>(w.get(), {B, Tn, H, D}, dev);
    a.beta = attnmix::view3<const float>(beta.get(), {B, Tn, H}, dev);
    a.out = attnmix::view4<const T>(out.get(), {B, Tn, HQ, Dv}, dev);
    a.lse = attnmix::view3<const float>(lse.get(), {B, Tn, HQ}, dev);
    a.dout = attnmix::view4<const T>(dout.get(), {B, Tn, HQ, Dv}, dev);
    a.dq = attnmix::view4<T>(dq.get(), {B, Tn, HQ, D}, dev);
    a.dk = attnmix::view4<T>(dk.get(), {B, Tn, H, D}, dev);
    a.dv = attnmix::view4<T>(dv.get(), {B, Tn, H, Dv}, dev);
    a.dw = attnmix::view4<float>(dw.get(), {B, Tn, H, D}, dev);
    a.dbeta = attnmix::view3<float>(dbeta.get(), {B, Tn, H}, dev);
    if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate) {
      a.g = attnmix::view3<const float>(g.get(), {B, Tn, HQ}, dev);
      a.dg = attnmix::view3<float>(dg.get(), {B, Tn, HQ}, dev);
    }
    return a;
  }

  template <class Kind, class Policy>
  grads run() {
    attnmix::attention_backward<Kind, Policy>(args<Kind>(), path_params(c),
                                              attnmix::backend::cuda{});
    attnmix::detail::cuda::check(cudaDeviceSynchronize(), "PaTH backward kernels");
    constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
    return {convert_all<double>(dq.to_host()),
            convert_all<double>(dk.to_host()),
            convert_all<double>(dv.to_host()),
            convert_all<double>(dw.to_host()),
            convert_all<double>(dbeta.to_host()),
            gated ? to_double(dg.to_host()) : std::vector<double>{}};
  }
};

// max |got - ref| / max |ref| (absolute when ref is 0); +inf for a NaN or an infinity in got.
double max_rel(const std::vector<double>& got, const std::vector<double>& ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, mag = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(got[i] - ref[i]));
    mag = std::max(mag, std::abs(ref[i]));
  }
  return mag > 0 ? diff / mag : diff;
}

// Bounds: float gradients 1e-5; gradients stored in 16 bits (dq, dk, dv) also carry their
// rounding, at most 2^-9 of max |ref| for bfloat16. Against the CPU (`host` given, `ref` then
// in double), a gradient may also be off by 4x the CPU float backward's own error: a small dbeta
// of a short sequence sums terms that cancel, and float's rounding is relative to the terms.
// The tensor-core query kernel (`split`) multiplies operands of about 16 bits (two bfloat16
// parts): its float gradients (dw, dbeta, dg) get 1.5e-4 (2^-13; seen up to 4.5e-5), where a
// product of one-part bfloat16 operands would be off by about 2^-9.
// The worst error of each gradient (dv, dq, dk, dw, dbeta, dg) over the checks since reset.
std::array<double, 6> worst_errors{};

template <class T>
void check_grads(const grads& got, const grads& ref, bool gated, const grads* host = nullptr,
                 bool split = false) {
  const double tol16 = sizeof(T) == 4 ? 1e-5 : 5e-3;
  const double tol32 = sizeof(T) == 4 ? 1e-5 : split ? 1.5e-4 : 2e-5;
  int which = 0;
  auto check = [&](const char* name, std::vector<double> grads::*m, double tol) {
    const double err = max_rel(got.*m, ref.*m), host_err = host ? max_rel(host->*m, ref.*m) : 0.0;
    worst_errors[which] = std::max(worst_errors[which], err);
    ++which;
    INFO(name << ": error " << err << ", the CPU float backward's " << host_err << " (tolerance "
              << tol << " or 4x that)");
    CHECK(err <= std::max(tol, 4 * host_err));
  };
  check("dv", &grads::dv, tol16);
  check("dq", &grads::dq, tol16);
  check("dk", &grads::dk, tol16);
  check("dw", &grads::dw, tol32);
  check("dbeta", &grads::dbeta, tol32);
  if (gated) check("dg", &grads::dg, tol32);
}

template <class T>
void check_grads(const grads& got, const cpu_reference& ref, bool gated, bool split = false) {
  check_grads<T>(got, ref.exact, gated, &ref.host, split);
}

using attnmix::detail::cuda::path_backward_kernel;

// Whether the plan runs the tensor-core query kernel on case c under the current override.
template <class T>
bool on_tensor_cores(const path_case& c) {
  namespace cu = attnmix::detail::cuda;
  cu::path_shape s;
  s.batch = c.B, s.tokens = c.T, s.max_len = c.T, s.sequences = c.sequences();
  s.q_heads = c.HQ, s.kv_heads = c.H, s.head_dim = c.D, s.value_dim = c.Dv;
  s.sixteen_bit = sizeof(T) == 2;
  return cu::plan_path_backward(s, false, cu::current_properties(),
                                cu::path_backward_kernel_override())
             .query_kernel == path_backward_kernel::mma;
}

template <class Kind, class Policy, class T>
void backward_case(const path_case& c, std::uint64_t salt, const std::vector<index_t>& g_inf = {}) {
  INFO("seed " << test_seed() << " salt " << salt << " " << c.describe() << " dtype "
               << attnmix::scalar_traits<T>::name << " kind " << Kind::name << " hard resets "
               << g_inf.size());
  const bwd_inputs b = make_inputs<Kind, Policy, T>(c, salt, g_inf);
  const cpu_reference ref = cpu_backward<Kind, Policy>(c, b);
  device_case<T> d(c, b);
  const grads got = d.template run<Kind, Policy>();
  check_grads<T>(got, ref, attnmix::kind_traits<Kind>::uses_forget_gate, on_tensor_cores<T>(c));
}

// Sets the launcher's query-kernel override for a scope.
struct kernel_override {
  path_backward_kernel saved;
  explicit kernel_override(path_backward_kernel k)
      : saved(attnmix::detail::cuda::path_backward_kernel_override()) {
    attnmix::detail::cuda::path_backward_kernel_override() = k;
  }
  ~kernel_override() { attnmix::detail::cuda::path_backward_kernel_override() = saved; }
  kernel_override(const kernel_override&) = delete;
  kernel_override& operator=(const kernel_override&) = delete;
};

const char* kernel_name(path_backward_kernel k) {
  return k == path_backward_kernel::tiled ? "tiled"
         : k == path_backward_kernel::mma ? "tensor-core query"
                                          : "automatic";
}

// The CUDA-core kernel set (query + chunk), forced for every dtype, against the CPU.
template <class Kind, class Policy, class T>
void tiled_kernels_case(const path_case& c, std::uint64_t salt) {
  INFO("seed " << test_seed() << " salt " << salt << " " << c.describe() << " dtype "
               << attnmix::scalar_traits<T>::name << " kind " << Kind::name);
  const bwd_inputs b = make_inputs<Kind, Policy, T>(c, salt);
  const cpu_reference ref = cpu_backward<Kind, Policy>(c, b);
  device_case<T> d(c, b);
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  kernel_override o(path_backward_kernel::tiled);
  INFO("the tiled query and chunk kernels against the CPU");
  check_grads<T>(d.template run<Kind, Policy>(), ref, gated);
}

// Smallest first, so that the first failure points at the simplest shape.
std::vector<path_case> sweep() {
  return {
      {1, 1, 1, 1, 64, 64},
      {1, 5, 1, 1, 64, 64},
      {1, 64, 1, 1, 64, 64},
      {1, 65, 1, 1, 64, 64},
      {1, 65, 4, 2, 64, 64},   // GQA
      {2, 200, 4, 2, 64, 64},  // four chunks, the last partial
      {1, 200, 2, 2, 64, 64, {}, beta_range::near_two},
      {1, 200, 2, 1, 64, 64, {0, 0, 1, 64, 130, 200}},  // empty and length-1 sequences
      {1, 130, 2, 1, 128, 128},
      {1, 100, 2, 2, 40, 24},   // an odd head dim, D != Dv
      {1, 1100, 2, 1, 64, 64},  // several slices
  };
}

}  // namespace

// First: the CUDA-core kernels on small shapes, one case at a time, so that a failure names the
// shape and the gradient.
TEST_CASE("CUDA PaTH backward: the tiled kernels agree with the CPU on every dtype",
          "[cuda][path][backward][kernels]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  std::uint64_t salt = 30000;
  const std::vector<path_case> cases = {
      {1, 1, 1, 1, 64, 64},                             // one token
      {1, 5, 1, 1, 64, 64},                             // a partial chunk
      {1, 65, 1, 1, 64, 64},                            // two chunks, the walk
      {1, 65, 4, 2, 64, 64},                            // GQA
      {2, 200, 4, 2, 64, 64},                           // four chunks, the adjoint pass
      {1, 200, 2, 1, 64, 64, {0, 0, 1, 64, 130, 200}},  // varlen, empty and length-1
      {1, 130, 2, 1, 128, 128},                         // D = 128: dO read from global memory
      {1, 100, 2, 2, 40, 24},                           // odd head dims, D != Dv
      {1, 100, 1, 1, 17, 9},                            // head dims not multiples of 4
  };
  for (const path_case& c : cases) {
    tiled_kernels_case<path, attnmix::path_policy, float>(c, ++salt);
    tiled_kernels_case<path_fox, attnmix::path_fox_policy, float>(c, ++salt);
  }
  for (const path_case& c : cases) {
    tiled_kernels_case<path, attnmix::path_policy, attnmix::bfloat16>(c, ++salt);
    tiled_kernels_case<path_fox, attnmix::path_fox_policy, attnmix::bfloat16>(c, ++salt);
  }
}

TEST_CASE("CUDA PaTH backward matches the CPU, float", "[cuda][path][backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  std::uint64_t salt = 31000;
  for (const path_case& c : sweep()) backward_case<path, attnmix::path_policy, float>(c, ++salt);
}

TEST_CASE("CUDA PaTH-FoX backward matches the CPU, float, both gate conventions",
          "[cuda][path_fox][backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  std::uint64_t salt = 32000;
  for (const path_case& c : sweep()) {
    backward_case<path_fox, attnmix::path_fox_policy, float>(c, ++salt);
    backward_case<path_fox, after_scale, float>(c, ++salt);
  }
}

// Small enough for compute-sanitizer (memcheck, racecheck, synccheck):
//   compute-sanitizer --tool racecheck build/cuda/tests/test_path_backward_cuda "[small]"
TEST_CASE("CUDA PaTH-FoX backward, a small case for compute-sanitizer",
          "[cuda][path_fox][backward][small]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  backward_case<path_fox, attnmix::path_fox_policy, float>({1, 330, 4, 2, 64, 64, {0, 1, 70, 330}},
                                                           39001, {100});
  backward_case<path_fox, attnmix::path_fox_policy, attnmix::bfloat16>({1, 140, 2, 1, 128, 128},
                                                                       39002);
}

// The tensor-core query kernel (the plan's at D = 64 with 16-bit inputs), for compute-sanitizer.
TEST_CASE("CUDA PaTH-FoX backward on tensor cores, a small case for compute-sanitizer",
          "[cuda][path_fox][backward][small_mma]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  backward_case<path_fox, attnmix::path_fox_policy, attnmix::bfloat16>(
      {1, 200, 4, 2, 64, 64, {0, 1, 70, 200}}, 39003, {100});
  // Two super-chunks walked at once, the second through its product Pi.
  backward_case<path_fox, attnmix::path_fox_policy, attnmix::bfloat16>({1, 1100, 2, 1, 64, 64},
                                                                       39004, {300});
}

TEST_CASE("CUDA PaTH-FoX backward through hard resets", "[cuda][path_fox][backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const path_case c{1, 200, 2, 1, 64, 64, {}, beta_range::near_two};
  backward_case<path_fox, attnmix::path_fox_policy, float>(c, 33001, {0, 17, 64, 65, 199});
  const path_case v{1, 200, 2, 1, 64, 64, {0, 0, 1, 70, 200}};
  backward_case<path_fox, attnmix::path_fox_policy, float>(v, 33002, {5, 100});
}

TEMPLATE_TEST_CASE("CUDA PaTH backward with 16-bit inputs", "[cuda][path][backward]", attnmix::half,
                   attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  std::uint64_t salt = 34000;
  const std::vector<path_case> cases = {{1, 5, 1, 1, 64, 64},
                                        {1, 200, 4, 2, 64, 64},
                                        {1, 130, 2, 1, 128, 128},
                                        {1, 200, 2, 1, 64, 64, {0, 0, 1, 64, 130, 200}}};
  for (const path_case& c : cases) {
    backward_case<path, attnmix::path_policy, TestType>(c, ++salt);
    backward_case<path_fox, attnmix::path_fox_policy, TestType>(c, ++salt);
  }
}

// The tensor-core query kernel (16-bit inputs, D = Dv = 64), forced, on every shape it takes,
// PaTH and PaTH-FoX in both gate conventions, against the CPU; the worst errors as a warning.
TEMPLATE_TEST_CASE("CUDA PaTH backward: the tensor-core query kernel matches the CPU",
                   "[cuda][path][backward][kernels][mma]", attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using T = TestType;
  worst_errors = {};
  std::uint64_t salt = 40000;
  const std::vector<path_case> cases = {
      {1, 1, 1, 1, 64, 64},
      {1, 5, 1, 1, 64, 64},
      {1, 64, 1, 1, 64, 64},
      {1, 65, 1, 1, 64, 64},
      {1, 65, 4, 2, 64, 64},   // GQA
      {1, 130, 3, 1, 64, 64},  // MQA, the adjoint pass
      {2, 200, 4, 2, 64, 64},
      {1, 200, 2, 2, 64, 64, {}, beta_range::near_two},
      {1, 200, 2, 2, 64, 64, {}, beta_range::near_zero},
      {1, 200, 2, 1, 64, 64, {0, 0, 1, 64, 130, 200}},  // empty and length-1 sequences
      {1, 300, 2, 1, 64, 64, {}, beta_range::uniform, 0, -3.0, -0.5},        // strong gates
      {1, 150, 2, 1, 64, 64, {}, beta_range::uniform, 0, -0.2, -0.01, 0.3},  // another scale
      {1, 1100, 2, 1, 64, 64},                                               // several slices
      {1, 600, 4, 2, 64, 64},  // GQA through super-chunks
      // Super-chunks in varlen: 18 and 10 chunks around a length-1 sequence.
      {1, 1700, 2, 1, 64, 64, {0, 1090, 1091, 1700}},
  };
  for (const path_case& c : cases) {
    for (int kind = 0; kind < 3; ++kind) {
      INFO("seed " << test_seed() << " salt " << salt + 1 << " " << c.describe() << " dtype "
                   << attnmix::scalar_traits<T>::name << " kind " << kind);
      const auto one = [&](auto kind_tag, auto policy_tag) {
        using Kind = decltype(kind_tag);
        using Policy = decltype(policy_tag);
        const bwd_inputs b = make_inputs<Kind, Policy, T>(c, ++salt);
        const cpu_reference ref = cpu_backward<Kind, Policy>(c, b);
        device_case<T> d(c, b);
        constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
        kernel_override o(path_backward_kernel::mma);
        const grads mma = d.template run<Kind, Policy>();
        INFO("the tensor-core query kernel against the CPU");
        check_grads<T>(mma, ref, gated, true);
      };
      if (kind == 0) one(path{}, attnmix::path_policy{});
      if (kind == 1) one(path_fox{}, attnmix::path_fox_policy{});
      if (kind == 2) one(path_fox{}, after_scale{});
    }
  }
  {
    kernel_override o(path_backward_kernel::mma);
    const path_case c{1, 200, 2, 1, 64, 64, {}, beta_range::near_two};
    backward_case<path_fox, attnmix::path_fox_policy, T>(c, 40901, {0, 17, 64, 65, 199});
    const path_case v{1, 200, 2, 1, 64, 64, {0, 0, 1, 70, 200}};
    backward_case<path_fox, attnmix::path_fox_policy, T>(v, 40902, {5, 100});
  }
  WARN("tensor-core PaTH backward, " << attnmix::scalar_traits<T>::name << ", worst errors: dv "
                                     << worst_errors[0] << " dq " << worst_errors[1] << " dk "
                                     << worst_errors[2] << " dw " << worst_errors[3] << " dbeta "
                                     << worst_errors[4] << " dg " << worst_errors[5]);
}

TEST_CASE("CUDA PaTH-FoX backward gives the same bits twice", "[cuda][path_fox][backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const path_case c{1, 1100, 4, 2, 64, 64, {0, 3, 500, 1100}};
  INFO("seed " << test_seed() << " " << c.describe());
  const bwd_inputs b = make_inputs<path_fox, attnmix::path_fox_policy, attnmix::bfloat16>(c, 35001);
  device_case<attnmix::bfloat16> d(c, b);
  for (path_backward_kernel k : {path_backward_kernel::tiled, path_backward_kernel::mma}) {
    INFO("query and chunk kernels " << kernel_name(k));
    kernel_override o(k);
    const grads one = d.run<path_fox, attnmix::path_fox_policy>();
    const grads two = d.run<path_fox, attnmix::path_fox_policy>();
    CHECK(bitwise_equal(one.dq, two.dq));
    CHECK(bitwise_equal(one.dk, two.dk));
    CHECK(bitwise_equal(one.dv, two.dv));
    CHECK(bitwise_equal(one.dw, two.dw));
    CHECK(bitwise_equal(one.dbeta, two.dbeta));
    CHECK(bitwise_equal(one.dg, two.dg));
  }
}

TEMPLATE_TEST_CASE("CUDA PaTH-FoX forward then backward with the CUDA lse",
                   "[cuda][path_fox][backward]", float, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using T = TestType;
  const path_case c{2, 300, 4, 2, 64, 64};
  INFO("seed " << test_seed() << " " << c.describe() << " dtype "
               << attnmix::scalar_traits<T>::name);
  bwd_inputs b = make_inputs<path_fox, attnmix::path_fox_policy, T>(c, 36001);
  device_case<T> d(c, b);
  // The CUDA forward writes out and lse; the CPU reference takes them as they came out.
  attnmix::attention_args<T> fa{attnmix::view4<const T>(d.q.get(), {c.B, c.T, c.HQ, c.D}, dev),
                                attnmix::view4<const T>(d.k.get(), {c.B, c.T, c.H, c.D}, dev),
                                attnmix::view4<const T>(d.v.get(), {c.B, c.T, c.H, c.Dv}, dev),
                                attnmix::view4<T>(d.out.get(), {c.B, c.T, c.HQ, c.Dv}, dev)};
  fa.w = attnmix::view4<const float>(d.w.get(), {c.B, c.T, c.H, c.D}, dev);
  fa.beta = attnmix::view3<const float>(d.beta.get(), {c.B, c.T, c.H}, dev);
  fa.g = attnmix::view3<const float>(d.g.get(), {c.B, c.T, c.HQ}, dev);
  fa.lse = attnmix::view3<float>(d.lse.get(), {c.B, c.T, c.HQ}, dev);
  attnmix::attention<path_fox, attnmix::path_fox_policy>(fa, path_params(c),
                                                         attnmix::backend::cuda{});
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "PaTH forward");
  b.out = convert_all<double>(d.out.to_host());
  b.lse = to_double(d.lse.to_host());
  const cpu_reference ref = cpu_backward<path_fox, attnmix::path_fox_policy>(c, b);
  const grads got = d.template run<path_fox, attnmix::path_fox_policy>();
  check_grads<T>(got, ref, true, on_tensor_cores<T>(c));
}

namespace {

// A [B, T, H, D] tensor (D == 0: [B, T, H]) inside a padded device buffer: heads, tokens and
// batch rows further apart than dense, the padding holding `fill`.
template <class S>
struct padded_tensor {
  index_t B, T, H, D;
  std::array<index_t, 4> stride;
  std::vector<S> host;
  device_buffer<S> dev_buf;

  static std::vector<S> layout(index_t B, index_t T, index_t H, index_t D,
                               const std::array<index_t, 4>& st, const std::vector<double>& dense,
                               double fill) {
    std::vector<S> h(static_cast<std::size_t>(B * st[0]), attnmix::convert<S>(fill));
    const index_t Dd = std::max<index_t>(D, 1);
    if (!dense.empty())
      for (index_t b = 0; b < B; ++b)
        for (index_t t = 0; t < T; ++t)
          for (index_t x = 0; x < H; ++x)
            for (index_t d = 0; d < Dd; ++d)
              h[static_cast<std::size_t>(b * st[0] + t * st[1] + x * st[2] + d)] =
                  attnmix::convert<S>(
                      dense[static_cast<std::size_t>(((b * T + t) * H + x) * Dd + d)]);
    return h;
  }
  static std::array<index_t, 4> strides(index_t T, index_t H, index_t D) {
    const index_t s2 = D > 0 ? D + 4 : 1, s1 = H * s2 + 5;
    return {T * s1 + 7, s1, s2, 1};
  }
  padded_tensor(index_t b, index_t t, index_t h, index_t d, const std::vector<double>& dense,
                double fill)
      : B(b),
        T(t),
        H(h),
        D(d),
        stride(strides(t, h, d)),
        host(layout(b, t, h, d, stride, dense, fill)),
        dev_buf(host) {}

  template <class V>
  attnmix::view4<V> v4() const {
    return attnmix::view4<V>(dev_buf.get(), {B, T, H, D}, {stride[0], stride[1], stride[2], 1},
                             dev);
  }
  template <class V>
  attnmix::view3<V> v3() const {
    return attnmix::view3<V>(dev_buf.get(), {B, T, H}, {stride[0], stride[1], 1}, dev);
  }
  // The dense contents, and whether the padding still holds `fill`.
  std::vector<double> dense() const {
    const std::vector<S> h = dev_buf.to_host();
    const index_t Dd = std::max<index_t>(D, 1);
    std::vector<double> out;
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < T; ++t)
        for (index_t x = 0; x < H; ++x)
          for (index_t d = 0; d < Dd; ++d)
            out.push_back(attnmix::convert<double>(
                h[static_cast<std::size_t>(b * stride[0] + t * stride[1] + x * stride[2] + d)]));
    return out;
  }
  bool padding_kept(double fill) const {
    const std::vector<S> h = dev_buf.to_host();
    std::vector<bool> inside(h.size(), false);
    const index_t Dd = std::max<index_t>(D, 1);
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < T; ++t)
        for (index_t x = 0; x < H; ++x)
          for (index_t d = 0; d < Dd; ++d)
            inside[static_cast<std::size_t>(b * stride[0] + t * stride[1] + x * stride[2] + d)] =
                true;
    for (std::size_t i = 0; i < h.size(); ++i)
      if (!inside[i] && attnmix::convert<double>(h[i]) != fill) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("CUDA PaTH-FoX backward reads and writes strided views, the same bits as dense",
          "[cuda][path_fox][backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using T = attnmix::bfloat16;
  using P = attnmix::path_fox_policy;
  // The second reaches the tensor-core query kernel's earlier super-chunks, whose v it copies
  // ahead only from 16-byte aligned rows: the strided v takes the other way there.
  const path_case c = GENERATE(path_case{2, 150, 4, 2, 64, 64}, path_case{1, 700, 2, 1, 64, 64});
  INFO("seed " << test_seed() << " " << c.describe());
  const bwd_inputs b = make_inputs<path_fox, P, T>(c, 38001 + c.T);
  device_case<T> d(c, b);
  const grads dense = d.run<path_fox, P>();
  const double fill = 3.0;
  padded_tensor<T> q(c.B, c.T, c.HQ, c.D, b.in.q, fill), k(c.B, c.T, c.H, c.D, b.in.k, fill),
      v(c.B, c.T, c.H, c.Dv, b.in.v, fill), out(c.B, c.T, c.HQ, c.Dv, b.out, fill),
      dO(c.B, c.T, c.HQ, c.Dv, b.dout, fill), dq(c.B, c.T, c.HQ, c.D, {}, fill),
      dk(c.B, c.T, c.H, c.D, {}, fill), dv(c.B, c.T, c.H, c.Dv, {}, fill);
  padded_tensor<float> w(c.B, c.T, c.H, c.D, b.in.w, fill), beta(c.B, c.T, c.H, 0, b.in.beta, fill),
      g(c.B, c.T, c.HQ, 0, b.in.g, fill), lse(c.B, c.T, c.HQ, 0, b.lse, fill),
      dw(c.B, c.T, c.H, c.D, {}, fill), dbeta(c.B, c.T, c.H, 0, {}, fill),
      dg(c.B, c.T, c.HQ, 0, {}, fill);
  attnmix::attention_grad_args<T> a;
  a.q = q.v4<const T>(), a.k = k.v4<const T>(), a.v = v.v4<const T>();
  a.w = w.v4<const float>(), a.beta = beta.v3<const float>(), a.g = g.v3<const float>();
  a.out = out.v4<const T>(), a.lse = lse.v3<const float>(), a.dout = dO.v4<const T>();
  a.dq = dq.v4<T>(), a.dk = dk.v4<T>(), a.dv = dv.v4<T>();
  a.dw = dw.v4<float>(), a.dbeta = dbeta.v3<float>(), a.dg = dg.v3<float>();
  attnmix::attention_backward<path_fox, P>(a, path_params(c), attnmix::backend::cuda{});
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "PaTH backward kernels");
  CHECK(bitwise_equal(dq.dense(), dense.dq));
  CHECK(bitwise_equal(dk.dense(), dense.dk));
  CHECK(bitwise_equal(dv.dense(), dense.dv));
  CHECK(bitwise_equal(dw.dense(), dense.dw));
  CHECK(bitwise_equal(dbeta.dense(), dense.dbeta));
  CHECK(bitwise_equal(dg.dense(), dense.dg));
  for (const auto* t : {&dq, &dk, &dv}) CHECK(t->padding_kept(fill));
  for (const auto* t : {&dw, &dbeta, &dg}) CHECK(t->padding_kept(fill));
}

TEST_CASE("CUDA PaTH backward rejects head dims its tiles cannot take", "[cuda][path][backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const path_case c{1, 8, 1, 1, 256, 64};
  const bwd_inputs b = make_inputs<path, attnmix::path_policy, float>(c, 37001);
  device_case<float> d(c, b);
  CHECK_THROWS_AS((d.run<path, attnmix::path_policy>()), attnmix::error);
}
