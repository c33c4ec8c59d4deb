// CUDA softmax attention and FoX with keys of other lengths than the queries: a block of queries
// against a longer prefix, cross-attention with fewer or more keys, packed batches with offsets
// of their own for the keys, and keys read from the slots of a cache (key_slots, key_lengths);
// against the CPU path in double on the same rounded inputs, on every kernel (Hopper, the
// portable tensor-core kernel, CUDA cores). The softmax backward with keys of other lengths
// (Tk, cu_seqlens_k) against the CPU backward in double; FoX's is refused.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "attnmix/cuda.cuh"
#include "support/catch.hpp"
#include "support/cuda_testing.cuh"
#include "support/testing.hpp"

using namespace attnmix_test;
using attnmix::index_t;

namespace {

// Queries [B, T, HQ, D]; keys and values [Bk, Tk, H, D / Dv] and gates [Bk, Tk, HQ] (Bk = B
// unless slots are given). Packed (cu non-empty): B = Bk = 1, the queries' offsets in cu and the
// keys' in cu_k. With slots, sequence n reads row slots[n] of k (and the first lengths[n] keys).
struct key_case {
  index_t B, T, Tk, HQ, H, D, Dv;
  index_t window = 0;
  std::vector<std::int32_t> cu{}, cu_k{};
  index_t Bk = 0;
  std::vector<std::int32_t> slots{}, lengths{};
  index_t reset_at = -1;  // >= 0: a hard reset (g = -inf) at this key of row 0, every head

  index_t key_rows() const { return Bk > 0 ? Bk : B; }
  std::string describe() const {
    std::ostringstream os;
    os << "B=" << B << " T=" << T << " Tk=" << Tk << " HQ=" << HQ << " H=" << H << " D=" << D
       << " Dv=" << Dv << " window=" << window << " packed=" << cu.size() << " Bk=" << Bk
       << " slots=" << slots.size() << " lengths=" << lengths.size() << " reset=" << reset_at;
    return os.str();
  }
};

// Every sequence has at least as many keys as queries.
std::vector<key_case> causal_cases() {
  return {
      {2, 1, 300, 4, 2, 64, 64},                                              // a decoding step
      {1, 70, 333, 8, 2, 64, 64, 0, {}, {}, 0, {}, {}, 40},                   // a prefill chunk
      {2, 64, 64, 2, 2, 64, 64},                                              // equal lengths
      {1, 70, 300, 2, 1, 64, 64, 32},                                         // window
      {1, 12, 320, 4, 2, 64, 64, 0, {0, 1, 1, 6, 12}, {0, 50, 60, 66, 320}},  // packed
      {1, 200, 700, 4, 2, 128, 128, 0, {0, 150, 150, 200}, {0, 500, 520, 700}, 0, {}, {}, 90},
      {3, 4, 600, 4, 2, 64, 64, 0, {}, {}, 5, {4, 0, 4}, {10, 600, 333}, 7},  // a cache's slots
      {2, 1, 260, 2, 2, 64, 64, 0, {}, {}, 4, {3, 3}, {1, 259}},              // beams of one slot
      {1, 20, 90, 2, 1, 96, 40},  // head dims the tensor-core kernels do not tile
  };
}

// One query a row (decoding): what the split decoding kernel takes. Runs that split at block
// edges (256, 257, 513 keys), a reset inside a later block, windows, wide and narrow groups, head
// dims of 8-element multiples the tensor-core kernels do not tile, a single key.
std::vector<key_case> decode_cases() {
  return {
      {2, 1, 300, 4, 2, 64, 64},
      {3, 1, 1000, 8, 2, 64, 64, 0, {}, {}, 5, {4, 0, 2}, {257, 1000, 513}, 300},
      {2, 1, 260, 2, 2, 64, 64, 0, {}, {}, 4, {3, 3}, {1, 259}},
      {2, 1, 700, 4, 4, 128, 128, 100},
      {1, 1, 600, 16, 1, 64, 64, 0, {}, {}, 0, {}, {}, 599},
      {2, 1, 90, 2, 1, 96, 40},
      {1, 1, 1, 2, 2, 64, 64},
      {2, 1, 256, 4, 2, 64, 64, 0, {}, {}, 2, {1, 0}, {256, 255}},
  };
}

// Bidirectional queries may have fewer keys than queries (cross-attention).
std::vector<key_case> bidirectional_cases() {
  std::vector<key_case> cases = causal_cases();
  cases.push_back({2, 90, 7, 2, 1, 64, 64});
  cases.push_back({1, 30, 12, 2, 2, 64, 64, 0, {0, 25, 25, 30}, {0, 1, 11, 12}});
  cases.push_back({2, 130, 20, 4, 4, 128, 64, 0, {}, {}, 3, {2, 0}, {5, 20}});
  return cases;
}

attnmix::attention_params params_of(const key_case& c) {
  attnmix::attention_params p;
  p.window = c.window;
  const auto view = [](const std::vector<std::int32_t>& x) {
    return attnmix::view1<const std::int32_t>(x.data(), {index_t(x.size())});
  };
  if (!c.cu.empty()) p.cu_seqlens = view(c.cu);
  if (!c.cu_k.empty()) p.cu_seqlens_k = view(c.cu_k);
  if (!c.slots.empty()) p.key_slots = view(c.slots);
  if (!c.lengths.empty()) p.key_lengths = view(c.lengths);
  return p;
}

struct result {
  double error, plain_error, lse_error;
};

// One call of Kind on the GPU in T against the CPU path in double (and in float, rounded to T:
// what a float-accumulated computation in T gets) on the same rounded inputs.
template <class Kind, class Policy, class T>
result run_case(const key_case& c, std::uint64_t salt, const attnmix::backend::cuda& be) {
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  rng r(salt);
  const index_t Bk = c.key_rows();
  std::vector<float> qf(std::size_t(c.B * c.T * c.HQ * c.D)),
      kf(std::size_t(Bk * c.Tk * c.H * c.D)), vf(std::size_t(Bk * c.Tk * c.H * c.Dv)),
      gf(std::size_t(Bk * c.Tk * c.HQ));
  for (auto* x : {&qf, &kf, &vf})
    for (float& e : *x) e = float(r.normal());
  for (float& e : gf) e = float(r.uniform(-0.3, -0.01));
  if (c.reset_at >= 0)
    for (index_t h = 0; h < c.HQ; ++h)
      gf[std::size_t(c.reset_at * c.HQ + h)] = -std::numeric_limits<float>::infinity();
  const auto q = convert_all<T>(qf), k = convert_all<T>(kf), v = convert_all<T>(vf);
  const attnmix::attention_params params = params_of(c);
  const auto dev = attnmix::memory_space::device;
  const std::size_t outs = std::size_t(c.B * c.T * c.HQ);

  device_buffer<T> dq(q), dk(k), dv(v), dout(outs * std::size_t(c.Dv));
  device_buffer<float> dg(gf), dlse(outs);
  attnmix::attention_args<T> a{attnmix::view4<const T>(dq.get(), {c.B, c.T, c.HQ, c.D}, dev),
                               attnmix::view4<const T>(dk.get(), {Bk, c.Tk, c.H, c.D}, dev),
                               attnmix::view4<const T>(dv.get(), {Bk, c.Tk, c.H, c.Dv}, dev),
                               attnmix::view4<T>(dout.get(), {c.B, c.T, c.HQ, c.Dv}, dev)};
  if constexpr (gated) a.g = attnmix::view3<const float>(dg.get(), {Bk, c.Tk, c.HQ}, dev);
  a.lse = attnmix::view3<float>(dlse.get(), {c.B, c.T, c.HQ}, dev);
  attnmix::attention<Kind, Policy>(a, params, be);
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "kernel");
  const auto out = convert_all<double>(dout.to_host());
  const auto lse = convert_all<double>(dlse.to_host());

  // The CPU path in double and in float on the rounded inputs.
  const auto host_call = [&](auto zero) {
    using E = decltype(zero);
    const auto qe = convert_all<E>(q), ke = convert_all<E>(k), ve = convert_all<E>(v);
    const auto ge = convert_all<E>(gf);
    std::vector<E> o(outs * std::size_t(c.Dv)), l(outs);
    attnmix::attention_args<E> h{attnmix::view4<const E>(qe.data(), {c.B, c.T, c.HQ, c.D}),
                                 attnmix::view4<const E>(ke.data(), {Bk, c.Tk, c.H, c.D}),
                                 attnmix::view4<const E>(ve.data(), {Bk, c.Tk, c.H, c.Dv}),
                                 attnmix::view4<E>(o.data(), {c.B, c.T, c.HQ, c.Dv})};
    if constexpr (gated) h.g = attnmix::view3<const E>(ge.data(), {Bk, c.Tk, c.HQ});
    h.lse = attnmix::view3<E>(l.data(), {c.B, c.T, c.HQ});
    attnmix::attention<Kind, Policy>(h, params);
    return std::make_pair(convert_all<double>(o), convert_all<double>(l));
  };
  const auto [ref, ref_lse] = host_call(0.0);
  const auto plain = host_call(0.f).first;
  const auto plain_rounded = convert_all<double>(convert_all<T>(plain));
  return {rel_error(out, ref), rel_error(plain_rounded, ref), lse_error(lse, ref_lse)};
}

template <class Kind, class Policy, class T>
void sweep(const std::vector<key_case>& cases, std::uint64_t salt,
           const attnmix::backend::cuda& be = {}) {
  for (const key_case& c : cases) {
    INFO("seed " << test_seed() << " " << c.describe() << " dtype "
                 << attnmix::scalar_traits<T>::name << " portable " << be.portable);
    const result r = run_case<Kind, Policy, T>(c, ++salt, be);
    CAPTURE(r.error, r.plain_error, r.lse_error);
    CHECK(r.error <= tolerance<T>());
    if constexpr (sizeof(T) == 2) CHECK(r.error <= 2 * r.plain_error);
    CHECK(r.lse_error <= (sizeof(T) == 2 ? 1e-2 : 1e-5));
  }
}

template <class T>
void all_kinds(std::uint64_t salt, const attnmix::backend::cuda& be = {}) {
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, T>(causal_cases(), salt, be);
  sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, T>(bidirectional_cases(),
                                                                          salt + 100, be);
  sweep<attnmix::kind::fox, attnmix::fox_policy, T>(causal_cases(), salt + 200, be);
}

// Whether one-query rows take the split decoding kernel (the default) or the forward's kernels,
// for a scope.
struct split_decoding {
  bool saved = attnmix::detail::cuda::attention_decode_splits();
  explicit split_decoding(bool on) { attnmix::detail::cuda::attention_decode_splits() = on; }
  ~split_decoding() { attnmix::detail::cuda::attention_decode_splits() = saved; }
};

}  // namespace

TEMPLATE_TEST_CASE("CUDA attention with keys of other lengths matches the CPU path", "[cuda][keys]",
                   float, attnmix::bfloat16, attnmix::half) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const split_decoding forward_kernels(false);  // the decoding rows on every forward kernel too
  all_kinds<TestType>(1000);
}

TEMPLATE_TEST_CASE("CUDA split decoding kernel matches the CPU path", "[cuda][keys][decode]", float,
                   attnmix::bfloat16, attnmix::half) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using T = TestType;
  const split_decoding on(true);
  std::vector<key_case> cross = decode_cases();
  cross.push_back({2, 1, 7, 2, 1, 64, 64});  // cross-attention: all of a short memory
  cross.push_back({2, 1, 20, 4, 4, 128, 64, 0, {}, {}, 3, {2, 0}, {5, 20}});
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, T>(decode_cases(), 4000);
  sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, T>(cross, 4100);
  sweep<attnmix::kind::fox, attnmix::fox_policy, T>(decode_cases(), 4200);
}

TEST_CASE("CUDA attention with keys of other lengths on the portable tensor-core kernel",
          "[cuda][keys]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const split_decoding forward_kernels(false);
  attnmix::backend::cuda portable{};
  portable.portable = true;
  all_kinds<attnmix::bfloat16>(2000, portable);
}

TEST_CASE("CUDA attention with keys of other lengths, a small sweep for compute-sanitizer",
          "[cuda][keys_small]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const std::vector<key_case> cases{causal_cases()[1], causal_cases()[4], causal_cases()[6]};
  sweep<attnmix::kind::fox, attnmix::fox_policy, attnmix::bfloat16>(cases, 3000);
  {
    const split_decoding on(true);
    sweep<attnmix::kind::fox, attnmix::fox_policy, attnmix::bfloat16>(
        {decode_cases()[1], decode_cases()[3]}, 3050);
  }
  sweep<attnmix::kind::fox, attnmix::fox_policy, float>(cases, 3100);
  attnmix::backend::cuda portable{};
  portable.portable = true;
  sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, attnmix::bfloat16>(
      bidirectional_cases(), 3200, portable);
}

// ---- backward ------------------------------------------------------------------------------
namespace {

// Keys of other lengths without a cache (what a backward takes), including a sequence of keys
// with no query (its keys' gradients are zero).
std::vector<key_case> backward_causal_cases() {
  return {
      {2, 1, 300, 4, 2, 64, 64},
      {1, 70, 333, 8, 2, 64, 64},
      {1, 70, 300, 2, 1, 64, 64, 32},
      {1, 12, 320, 4, 2, 64, 64, 0, {0, 1, 1, 6, 12}, {0, 50, 60, 66, 320}},
      {1, 200, 700, 4, 2, 128, 128, 0, {0, 150, 150, 200}, {0, 500, 520, 700}},
      {1, 20, 90, 2, 1, 96, 40},
  };
}
std::vector<key_case> backward_bidirectional_cases() {
  std::vector<key_case> cases = backward_causal_cases();
  cases.push_back({2, 90, 7, 2, 1, 64, 64});
  cases.push_back({1, 30, 12, 2, 2, 64, 64, 0, {0, 25, 25, 30}, {0, 1, 11, 12}});
  cases.push_back({2, 33, 130, 4, 4, 64, 32, 9});
  return cases;
}

template <class Policy, class T>
void check_backward(const key_case& c, std::uint64_t salt) {
  using softmax = attnmix::kind::softmax;
  INFO("seed " << test_seed() << " " << c.describe() << " dtype "
               << attnmix::scalar_traits<T>::name);
  rng r(salt);
  const index_t B = c.B, Bk = c.key_rows();
  const std::size_t nq = std::size_t(B * c.T * c.HQ), nk = std::size_t(Bk * c.Tk * c.H);
  std::vector<float> qf(nq * std::size_t(c.D)), kf(nk * std::size_t(c.D)),
      vf(nk * std::size_t(c.Dv)), df(nq * std::size_t(c.Dv));
  for (auto* x : {&qf, &kf, &vf, &df})
    for (float& e : *x) e = float(r.normal());
  const auto q = convert_all<T>(qf), k = convert_all<T>(kf), v = convert_all<T>(vf),
             dout = convert_all<T>(df);
  const attnmix::attention_params params = params_of(c);

  // out and lse of the CPU forward in double on the rounded inputs; the backward in E.
  const auto views = [&](const auto& qe, const auto& ke, const auto& ve, auto& oe) {
    using E = std::decay_t<decltype(qe[0])>;
    return attnmix::attention_args<E>{attnmix::view4<const E>(qe.data(), {B, c.T, c.HQ, c.D}),
                                      attnmix::view4<const E>(ke.data(), {Bk, c.Tk, c.H, c.D}),
                                      attnmix::view4<const E>(ve.data(), {Bk, c.Tk, c.H, c.Dv}),
                                      attnmix::view4<E>(oe.data(), {B, c.T, c.HQ, c.Dv})};
  };
  const auto qd = convert_all<double>(q), kd = convert_all<double>(k), vd = convert_all<double>(v);
  std::vector<double> out_d(nq * std::size_t(c.Dv)), lse_d(nq);
  {
    auto a = views(qd, kd, vd, out_d);
    a.lse = attnmix::view3<double>(lse_d.data(), {B, c.T, c.HQ});
    attnmix::attention<softmax, Policy>(a, params);
  }
  const auto out = convert_all<T>(out_d);
  const auto lse = convert_all<float>(lse_d);
  struct grads {
    std::vector<double> dq, dk, dv;
  };
  const auto cpu_backward = [&](auto zero) {
    using E = decltype(zero);
    const auto qe = convert_all<E>(q), ke = convert_all<E>(k), ve = convert_all<E>(v),
               oe = convert_all<E>(out), de = convert_all<E>(dout), le = convert_all<E>(lse);
    std::vector<E> dq(qe.size()), dk(ke.size()), dv(ve.size());
    attnmix::attention_grad_args<E> g{attnmix::view4<const E>(qe.data(), {B, c.T, c.HQ, c.D}),
                                      attnmix::view4<const E>(ke.data(), {Bk, c.Tk, c.H, c.D}),
                                      attnmix::view4<const E>(ve.data(), {Bk, c.Tk, c.H, c.Dv})};
    g.out = attnmix::view4<const E>(oe.data(), {B, c.T, c.HQ, c.Dv});
    g.lse = attnmix::view3<const E>(le.data(), {B, c.T, c.HQ});
    g.dout = attnmix::view4<const E>(de.data(), {B, c.T, c.HQ, c.Dv});
    g.dq = attnmix::view4<E>(dq.data(), {B, c.T, c.HQ, c.D});
    g.dk = attnmix::view4<E>(dk.data(), {Bk, c.Tk, c.H, c.D});
    g.dv = attnmix::view4<E>(dv.data(), {Bk, c.Tk, c.H, c.Dv});
    attnmix::attention_backward<softmax, Policy>(g, params);
    return grads{convert_all<double>(dq), convert_all<double>(dk), convert_all<double>(dv)};
  };
  const grads ref = cpu_backward(0.0), plain = cpu_backward(0.f);

  const auto dev = attnmix::memory_space::device;
  const auto gpu = [&] {
    device_buffer<T> gq(q), gk(k), gv(v), go(out), gd(dout), dq(q.size()), dk(k.size()),
        dv(v.size());
    device_buffer<float> gl(lse);
    attnmix::attention_grad_args<T> g{
        attnmix::view4<const T>(gq.get(), {B, c.T, c.HQ, c.D}, dev),
        attnmix::view4<const T>(gk.get(), {Bk, c.Tk, c.H, c.D}, dev),
        attnmix::view4<const T>(gv.get(), {Bk, c.Tk, c.H, c.Dv}, dev)};
    g.out = attnmix::view4<const T>(go.get(), {B, c.T, c.HQ, c.Dv}, dev);
    g.lse = attnmix::view3<const float>(gl.get(), {B, c.T, c.HQ}, dev);
    g.dout = attnmix::view4<const T>(gd.get(), {B, c.T, c.HQ, c.Dv}, dev);
    g.dq = attnmix::view4<T>(dq.get(), {B, c.T, c.HQ, c.D}, dev);
    g.dk = attnmix::view4<T>(dk.get(), {Bk, c.Tk, c.H, c.D}, dev);
    g.dv = attnmix::view4<T>(dv.get(), {Bk, c.Tk, c.H, c.Dv}, dev);
    attnmix::attention_backward<softmax, Policy>(g, params, attnmix::backend::cuda{});
    attnmix::detail::cuda::check(cudaDeviceSynchronize(), "backward kernels");
    return std::vector<std::vector<T>>{dq.to_host(), dk.to_host(), dv.to_host()};
  };
  const auto got = gpu(), again = gpu();
  const std::vector<double>* refs[] = {&ref.dq, &ref.dk, &ref.dv};
  const std::vector<double>* plains[] = {&plain.dq, &plain.dk, &plain.dv};
  const char* names[] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    const double error = max_rel(got[std::size_t(i)], *refs[i]),
                 base = max_rel(convert_all<T>(*plains[i]), *refs[i]);
    INFO("gradient " << names[i] << ": max error " << error << " (plain " << base << ")");
    if constexpr (std::is_same_v<T, float>) {
      CHECK(error <= 1e-5);
    } else {
      CHECK(error <= 2 * base + unit_roundoff<T>());
      CHECK(error <= 2e-2);
    }
    CHECK(bitwise_equal(got[std::size_t(i)], again[std::size_t(i)]));
  }
}

template <class T>
void backward_sweep(std::uint64_t salt) {
  for (const key_case& c : backward_causal_cases())
    check_backward<attnmix::softmax_policy, T>(c, ++salt);
  for (const key_case& c : backward_bidirectional_cases())
    check_backward<attnmix::bidirectional_softmax_policy, T>(c, ++salt);
}

}  // namespace

TEMPLATE_TEST_CASE("CUDA softmax backward with keys of other lengths matches the CPU path",
                   "[cuda][keys][backward]", float, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  backward_sweep<TestType>(4000);
}

TEST_CASE("CUDA FoX backward refuses keys of other lengths", "[cuda][keys][backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const index_t T = 4, Tk = 9, H = 1, D = 64;
  device_buffer<float> q(std::size_t(T * H * D)), k(std::size_t(Tk * H * D)),
      v(std::size_t(Tk * H * D)), out(std::size_t(T * H * D)), dout(std::size_t(T * H * D)),
      lse(std::size_t(T * H)), g(std::size_t(Tk * H)), dq(std::size_t(T * H * D)),
      dk(std::size_t(Tk * H * D)), dv(std::size_t(Tk * H * D)), dg(std::size_t(Tk * H));
  const auto dev = attnmix::memory_space::device;
  attnmix::attention_grad_args<float> a{attnmix::view4<const float>(q.get(), {1, T, H, D}, dev),
                                        attnmix::view4<const float>(k.get(), {1, Tk, H, D}, dev),
                                        attnmix::view4<const float>(v.get(), {1, Tk, H, D}, dev)};
  a.out = attnmix::view4<const float>(out.get(), {1, T, H, D}, dev);
  a.lse = attnmix::view3<const float>(lse.get(), {1, T, H}, dev);
  a.dout = attnmix::view4<const float>(dout.get(), {1, T, H, D}, dev);
  a.g = attnmix::view3<const float>(g.get(), {1, Tk, H}, dev);
  a.dq = attnmix::view4<float>(dq.get(), {1, T, H, D}, dev);
  a.dk = attnmix::view4<float>(dk.get(), {1, Tk, H, D}, dev);
  a.dv = attnmix::view4<float>(dv.get(), {1, Tk, H, D}, dev);
  a.dg = attnmix::view3<float>(dg.get(), {1, Tk, H}, dev);
  try {
    attnmix::attention_backward<attnmix::kind::fox>(a, {}, attnmix::backend::cuda{});
    FAIL("accepted");
  } catch (const attnmix::error& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("argument 'k'") != std::string::npos);
  }
  for (float x : dq.to_host()) CHECK(std::isnan(x));  // untouched
}
