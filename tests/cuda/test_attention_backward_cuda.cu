// The CUDA backward of softmax attention and FoX against the CPU backward on the same inputs:
// q, k, v, dout drawn and rounded to T, out and lse from the CPU forward in double (out rounded
// to T, lse to float), then the CPU backward in double on exactly what the GPU reads is the
// reference. Each gradient is checked on its own, as max |x - ref| / max |ref|:
//   float:       <= 1e-5;
//   half, bf16:  <= 2 x the error of the plain computation (the CPU backward in float on the same
//                inputs, gradients rounded to T) + the unit roundoff of T, and <= 2e-2.
// Every call runs twice into NaN-poisoned buffers and must give the same bits. The plan picks the
// v2 tensor-core kernels for 16-bit aligned D = Dv in {64, 128}; "[v2]" also runs them against the
// sm80_mma variant on the same inputs and forces the older variants at those shapes
// (backward_variant_override).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
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

struct bwd_case {
  index_t B, T, HQ, H, D, Dv;
  index_t window = 0;
  std::vector<std::int32_t> cu_seqlens{};  // non-empty: B must be 1 and T == back()
  std::optional<double> scale{};
  double gate_lo = -0.1, gate_hi = -0.01;  // log forget gate ~ U(gate_lo, gate_hi)
  std::vector<index_t> resets{};           // FoX: tokens whose log gate is -inf in every head

  std::string describe() const {
    std::ostringstream os;
    os << "B=" << B << " T=" << T << " HQ=" << HQ << " H=" << H << " D=" << D << " Dv=" << Dv
       << " window=" << window << " varlen=" << cu_seqlens.size()
       << " scale=" << (scale ? *scale : -1.0) << " gate=U(" << gate_lo << "," << gate_hi << ")"
       << " resets=" << resets.size();
    return os.str();
  }
};

// The tensors of a backward call, as flat vectors of one element type (E) and accumulator (A).
template <class E, class A>
struct grad_buffers {
  std::vector<E> q, k, v, out, dout, dq, dk, dv;
  std::vector<A> lse, g, dg;
};

// Views of the tensors of a backward call; pad > 0 leaves pad elements after each head's row of
// every [B, T, H, D] tensor (a stride other than the dims).
template <class Kind, class E, class A>
attnmix::attention_grad_args<E> grad_args(const bwd_case& c, const E* q, const E* k, const E* v,
                                          const E* out, const A* lse, const E* dout, const A* g,
                                          E* dq, E* dk, E* dv, A* dg, attnmix::memory_space s,
                                          index_t pad = 0) {
  const auto view = [&](auto* data, index_t H, index_t D) {
    using X = std::remove_pointer_t<decltype(data)>;
    const index_t Dp = D + pad;
    return attnmix::view4<X>(data, {c.B, c.T, H, D}, {c.T * H * Dp, H * Dp, Dp, 1}, s);
  };
  attnmix::attention_grad_args<E> a{};
  a.q = view(q, c.HQ, c.D), a.k = view(k, c.H, c.D), a.v = view(v, c.H, c.Dv);
  a.out = view(out, c.HQ, c.Dv), a.dout = view(dout, c.HQ, c.Dv);
  a.lse = attnmix::view3<const A>(lse, {c.B, c.T, c.HQ}, s);
  a.dq = view(dq, c.HQ, c.D), a.dk = view(dk, c.H, c.D), a.dv = view(dv, c.H, c.Dv);
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate) {
    a.g = attnmix::view3<const A>(g, {c.B, c.T, c.HQ}, s);
    a.dg = attnmix::view3<A>(dg, {c.B, c.T, c.HQ}, s);
  }
  return a;
}

// Rows of `width` elements with `pad` NaNs after each (so that a kernel reading the padding
// fails), and back.
template <class E>
std::vector<E> padded(const std::vector<E>& x, index_t width, index_t pad) {
  std::vector<E> y;
  for (std::size_t i = 0; i < x.size(); i += static_cast<std::size_t>(width)) {
    y.insert(y.end(), x.begin() + i, x.begin() + i + width);
    y.insert(y.end(), static_cast<std::size_t>(pad),
             attnmix::convert<E>(std::numeric_limits<float>::quiet_NaN()));
  }
  return y;
}
template <class E>
std::vector<E> unpadded(const std::vector<E>& y, index_t width, index_t pad) {
  std::vector<E> x;
  for (std::size_t i = 0; i < y.size(); i += static_cast<std::size_t>(width + pad))
    x.insert(x.end(), y.begin() + i, y.begin() + i + width);
  return x;
}

attnmix::attention_params params_of(const bwd_case& c) {
  attnmix::attention_params params;
  params.scale = c.scale;
  params.window = c.window;
  if (!c.cu_seqlens.empty())
    params.cu_seqlens = {c.cu_seqlens.data(), {static_cast<index_t>(c.cu_seqlens.size())}};
  return params;
}

// The CPU backward in E (double or float) on the given inputs; gradients in E (dg in A).
template <class Kind, class Policy, class E, class A>
grad_buffers<E, A> cpu_backward(const bwd_case& c, grad_buffers<E, A> in) {
  in.dq.assign(in.q.size(), E(0)), in.dk.assign(in.k.size(), E(0));
  in.dv.assign(in.v.size(), E(0)), in.dg.assign(in.lse.size(), A(0));
  const auto h = attnmix::memory_space::host;
  attnmix::attention_backward<Kind, Policy>(
      grad_args<Kind>(c, in.q.data(), in.k.data(), in.v.data(), in.out.data(), in.lse.data(),
                      in.dout.data(), in.g.data(), in.dq.data(), in.dk.data(), in.dv.data(),
                      in.dg.data(), h),
      params_of(c));
  return in;
}

struct grad_errors {
  double dq, dk, dv, dg;
};

struct case_result {
  grad_errors error, plain;
  grad_errors vs_old{};  // with compare_old: max |x - old| / max |old|, old the sm80_mma variant's
  bool same_bits = false;
  bool resets_zero = true;  // dg exactly 0 at every hard reset
};

template <class T>
struct device_grads {
  std::vector<T> dq, dk, dv;
  std::vector<float> dg;
};

// The GPU backward from host copies of its inputs, into fresh NaN-filled buffers.
template <class Kind, class Policy, class T>
device_grads<T> gpu_backward(const bwd_case& c, const grad_buffers<T, float>& in,
                             attnmix::backend::cuda be, index_t pad) {
  device_buffer<T> q(padded(in.q, c.D, pad)), k(padded(in.k, c.D, pad)), v(padded(in.v, c.Dv, pad)),
      out(padded(in.out, c.Dv, pad)), dout(padded(in.dout, c.Dv, pad));
  device_buffer<float> lse(in.lse), g(in.g);
  const auto rows = [&](index_t H) {
    return static_cast<std::size_t>(c.B * c.T * H);
  };
  device_buffer<T> dq(rows(c.HQ) * (c.D + pad)), dk(rows(c.H) * (c.D + pad)),
      dv(rows(c.H) * (c.Dv + pad));
  device_buffer<float> dg(in.lse.size());
  attnmix::attention_backward<Kind, Policy>(
      grad_args<Kind>(c, static_cast<const T*>(q.get()), k.get(), v.get(), out.get(), lse.get(),
                      dout.get(), g.get(), dq.get(), dk.get(), dv.get(), dg.get(),
                      attnmix::memory_space::device, pad),
      params_of(c), be);
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "backward kernels");
  return {unpadded(dq.to_host(), c.D, pad), unpadded(dk.to_host(), c.D, pad),
          unpadded(dv.to_host(), c.Dv, pad), dg.to_host()};
}

// Makes every backward call in its scope take `v` where v applies (the plan's choice elsewhere).
struct forced_variant {
  explicit forced_variant(attnmix::detail::cuda::attention_backward_variant v) {
    auto& o = attnmix::detail::cuda::backward_variant_override();
    o.forced = true, o.variant = v;
  }
  ~forced_variant() { attnmix::detail::cuda::backward_variant_override().forced = false; }
  forced_variant(const forced_variant&) = delete;
  forced_variant& operator=(const forced_variant&) = delete;
};

template <class X>
std::vector<double> as_double(const std::vector<X>& x) {
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = attnmix::convert<double>(x[i]);
  return y;
}

template <class Kind, class Policy, class T>
case_result run_case(const bwd_case& c, std::uint64_t salt, attnmix::backend::cuda be, index_t pad,
                     bool compare_old = false) {
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  rng r(salt);
  attnmix::host_tensor<float, 4> qf({c.B, c.T, c.HQ, c.D}), kf({c.B, c.T, c.H, c.D}),
      vf({c.B, c.T, c.H, c.Dv}), df({c.B, c.T, c.HQ, c.Dv});
  attnmix::host_tensor<float, 3> gf({c.B, c.T, c.HQ});
  r.fill_normal(qf), r.fill_normal(kf), r.fill_normal(vf), r.fill_normal(df);
  r.fill_uniform(gf, c.gate_lo, c.gate_hi);
  for (index_t t : c.resets)
    for (index_t b = 0; b < c.B; ++b)
      for (index_t hq = 0; hq < c.HQ; ++hq) gf(b, t, hq) = -std::numeric_limits<float>::infinity();

  // What the GPU reads: inputs rounded to T; out and lse of the CPU forward in double.
  grad_buffers<T, float> in;
  in.q = convert_all<T>(qf.storage()), in.k = convert_all<T>(kf.storage());
  in.v = convert_all<T>(vf.storage()), in.dout = convert_all<T>(df.storage());
  in.g = gf.storage();
  {
    const auto qd = convert_all<double>(in.q), kd = convert_all<double>(in.k),
               vd = convert_all<double>(in.v), gd = convert_all<double>(in.g);
    std::vector<double> out(static_cast<std::size_t>(c.B * c.T * c.HQ * c.Dv)),
        lse(static_cast<std::size_t>(c.B * c.T * c.HQ));
    attnmix::attention_args<double> fa{
        attnmix::view4<const double>(qd.data(), {c.B, c.T, c.HQ, c.D}),
        attnmix::view4<const double>(kd.data(), {c.B, c.T, c.H, c.D}),
        attnmix::view4<const double>(vd.data(), {c.B, c.T, c.H, c.Dv}),
        attnmix::view4<double>(out.data(), {c.B, c.T, c.HQ, c.Dv})};
    if constexpr (gated) fa.g = attnmix::view3<const double>(gd.data(), {c.B, c.T, c.HQ});
    fa.lse = attnmix::view3<double>(lse.data(), {c.B, c.T, c.HQ});
    attnmix::attention<Kind, Policy>(fa, params_of(c));
    in.out = convert_all<T>(out);
    in.lse = convert_all<float>(lse);
  }

  // The reference (double) and the plain computation (float, gradients rounded to T).
  grad_buffers<double, double> ind{convert_all<double>(in.q),
                                   convert_all<double>(in.k),
                                   convert_all<double>(in.v),
                                   convert_all<double>(in.out),
                                   convert_all<double>(in.dout),
                                   {},
                                   {},
                                   {},
                                   convert_all<double>(in.lse),
                                   convert_all<double>(in.g),
                                   {}};
  const auto ref = cpu_backward<Kind, Policy>(c, ind);
  grad_buffers<float, float> inf{convert_all<float>(in.q),
                                 convert_all<float>(in.k),
                                 convert_all<float>(in.v),
                                 convert_all<float>(in.out),
                                 convert_all<float>(in.dout),
                                 {},
                                 {},
                                 {},
                                 in.lse,
                                 in.g,
                                 {}};
  const auto plain = cpu_backward<Kind, Policy>(c, inf);

  const device_grads<T> gpu = gpu_backward<Kind, Policy, T>(c, in, be, pad);
  const device_grads<T> again = gpu_backward<Kind, Policy, T>(c, in, be, pad);

  case_result res;
  res.error = {max_rel(gpu.dq, ref.dq), max_rel(gpu.dk, ref.dk), max_rel(gpu.dv, ref.dv),
               gated ? max_rel(gpu.dg, ref.dg) : 0.0};
  res.plain = {max_rel(convert_all<T>(plain.dq), ref.dq), max_rel(convert_all<T>(plain.dk), ref.dk),
               max_rel(convert_all<T>(plain.dv), ref.dv), gated ? max_rel(plain.dg, ref.dg) : 0.0};
  res.same_bits = bitwise_equal(gpu.dq, again.dq) && bitwise_equal(gpu.dk, again.dk) &&
                  bitwise_equal(gpu.dv, again.dv) && (!gated || bitwise_equal(gpu.dg, again.dg));
  if (compare_old) {
    const forced_variant old(attnmix::detail::cuda::attention_backward_variant::sm80_mma);
    const device_grads<T> o = gpu_backward<Kind, Policy, T>(c, in, be, pad);
    res.vs_old = {max_rel(gpu.dq, as_double(o.dq)), max_rel(gpu.dk, as_double(o.dk)),
                  max_rel(gpu.dv, as_double(o.dv)), gated ? max_rel(gpu.dg, as_double(o.dg)) : 0.0};
  }
  if constexpr (gated)
    for (index_t t : c.resets)
      for (index_t b = 0; b < c.B; ++b)
        for (index_t hq = 0; hq < c.HQ; ++hq)
          if (gpu.dg[static_cast<std::size_t>((b * c.T + t) * c.HQ + hq)] != 0.f)
            res.resets_zero = false;
  return res;
}

template <class T>
void check_gradient(const char* name, double error, double plain) {
  INFO("gradient " << name << ": max error " << error << " (plain " << plain << ")");
  if constexpr (sizeof(T) == 4) {
    CHECK(error <= 1e-5);
  } else {
    CHECK(error <= 2 * plain + unit_roundoff<T>());
    CHECK(error <= 2e-2);
  }
}

// The two tensor-core variants on the same inputs: each within its bound of the reference, so
// their difference within the sum of the bounds.
template <class T>
void check_against_old(const char* name, double vs_old, double plain) {
  INFO("gradient " << name << ": max difference to the sm80_mma variant " << vs_old << " (plain "
                   << plain << ")");
  CHECK(vs_old <= 2 * (2 * plain + unit_roundoff<T>()));
}

template <class Kind, class Policy, class T>
void sweep(const std::vector<bwd_case>& cases, std::uint64_t salt, const char* what,
           attnmix::backend::cuda be = {}, index_t pad = 0, bool compare_old = false) {
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  for (const bwd_case& c : cases) {
    INFO(what << ": seed " << test_seed() << " " << c.describe() << " dtype "
              << attnmix::scalar_traits<T>::name << " portable " << be.portable << " row pad "
              << pad);
    const case_result r = run_case<Kind, Policy, T>(c, ++salt, be, pad, compare_old);
    check_gradient<T>("dq", r.error.dq, r.plain.dq);
    check_gradient<T>("dk", r.error.dk, r.plain.dk);
    check_gradient<T>("dv", r.error.dv, r.plain.dv);
    if (gated) check_gradient<T>("dg", r.error.dg, r.plain.dg);
    if (compare_old) {
      check_against_old<T>("dq", r.vs_old.dq, r.plain.dq);
      check_against_old<T>("dk", r.vs_old.dk, r.plain.dk);
      check_against_old<T>("dv", r.vs_old.dv, r.plain.dv);
      if (gated) check_against_old<T>("dg", r.vs_old.dg, r.plain.dg);
    }
    CHECK(r.same_bits);
    CHECK(r.resets_zero);
  }
}

// Quick to localise first: one short sequence, then the awkward shapes.
std::vector<bwd_case> small_cases() {
  return {{1, 1, 1, 1, 64, 64}, {1, 37, 1, 1, 64, 64}, {1, 37, 4, 2, 64, 64}};
}

// For the v2 tensor-core kernels (D = Dv in {64, 128}): one tile, then tails of both tile sizes
// (64 keys or rows fixed, 64 or 32 streamed), GQA, windows, varlen.
std::vector<bwd_case> v2_cases() {
  return {
      {1, 16, 1, 1, 64, 64},
      {1, 64, 1, 1, 64, 64},
      {1, 16, 1, 1, 128, 128},
      {1, 100, 1, 1, 128, 128},
      {2, 130, 4, 2, 64, 64},
      {1, 200, 6, 2, 128, 128},
      {1, 300, 2, 1, 64, 64, 65},
      {1, 250, 2, 2, 128, 128, 31},
      {1, 200, 4, 2, 64, 64, 0, {0, 0, 1, 64, 64, 130, 200}},
      {1, 190, 2, 1, 128, 128, 20, {0, 70, 71, 190}},
      {1, 130, 2, 1, 64, 64, 0, {}, 0.3},
  };
}

std::vector<bwd_case> cases() {
  return {
      {1, 1, 1, 1, 64, 64},
      {1, 37, 2, 2, 64, 64},
      {2, 200, 4, 2, 64, 64},  // GQA
      {1, 300, 2, 1, 128, 128},
      {1, 200, 4, 2, 64, 64, 17},
      {1, 300, 2, 2, 128, 128, 64},
      {2, 140, 2, 1, 128, 64, 33},                             // D != Dv
      {1, 200, 4, 2, 64, 64, 0, {0, 0, 1, 64, 64, 130, 200}},  // varlen, empty and length-1
      {1, 150, 2, 1, 128, 128, 20, {0, 70, 71, 150}},          // varlen and a window
      {2, 63, 4, 2, 32, 32},                                   // head dims off the tiles
      {1, 100, 2, 2, 48, 40},
      {1, 70, 2, 1, 200, 160},                                  // the widest chunks (tile 16)
      {1, 0, 2, 1, 64, 64, 0, {0, 0}},                          // no token at all
      {1, 130, 2, 1, 64, 64, 0, {}, 0.3},                       // a custom scale
      {2, 300, 2, 1, 64, 64, 0, {}, std::nullopt, -2.0, -0.5},  // strong decay
  };
}

// Hard resets at a sequence start, mid-tile, on a tile edge and at the last token; and in a
// varlen batch (positions are packed-batch tokens).
std::vector<bwd_case> reset_cases() {
  bwd_case dense{2, 200, 2, 1, 64, 64};
  dense.resets = {0, 37, 64, 199};
  bwd_case wide{1, 300, 4, 2, 128, 128};
  wide.resets = {5, 256, 257};
  bwd_case varlen{1, 200, 2, 2, 64, 64, 0, {0, 1, 90, 90, 200}};
  varlen.resets = {1, 50, 95};
  bwd_case simt{1, 70, 2, 1, 32, 32, 10};
  simt.resets = {3, 40};
  return {dense, wide, varlen, simt};
}

using fox_before =
    attnmix::with_gate_scaling<attnmix::fox_policy, attnmix::gate_scaling::before_scale>;

}  // namespace

TEMPLATE_TEST_CASE("CUDA softmax backward, small shapes first", "[cuda][backward][small]", float,
                   attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(small_cases(), 100, "causal");
  sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(small_cases(), 200, "fox");
}

// The v2 kernels (the plan's choice for these shapes: on wgmma on Hopper), then each against the
// sm80_mma variant on the same inputs, then the v2 kernels on mma.sync and the older variants
// forced at the shapes v2 takes.
TEMPLATE_TEST_CASE("CUDA softmax backward, v2 tensor-core kernels", "[cuda][backward][v2]",
                   attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using attnmix::detail::cuda::attention_backward_variant;
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(v2_cases(), 8000, "v2 causal",
                                                                   {}, 0, true);
  sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, TestType>(
      v2_cases(), 8100, "v2 bidirectional", {}, 0, true);
  sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(v2_cases(), 8200, "v2 fox after", {}, 0,
                                                           true);
  sweep<attnmix::kind::fox, fox_before, TestType>(reset_cases(), 8300, "v2 fox before, resets", {},
                                                  0, true);
  {
    const forced_variant mma_sync(attention_backward_variant::sm80_mma_v2);
    sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(
        v2_cases(), 8700, "sm80_mma_v2 forced", {}, 0, true);
    sweep<attnmix::kind::fox, fox_before, TestType>(reset_cases(), 8800,
                                                    "sm80_mma_v2 forced, fox resets", {}, 0, true);
  }
  {
    const forced_variant old(attention_backward_variant::sm80_mma);
    sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(v2_cases(), 8400,
                                                                     "sm80_mma forced");
    sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(reset_cases(), 8500,
                                                             "sm80_mma forced, fox resets");
  }
  {
    const forced_variant simt(attention_backward_variant::simt);
    sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(small_cases(), 8600,
                                                                     "simt forced");
  }
}

// dQ inside the dk/dv kernel, added in key-block order (Hopper; elsewhere the plan's choice), on
// the v2 shapes, against the CPU backward and the sm80_mma variant; identical bits twice.
TEMPLATE_TEST_CASE("CUDA softmax backward, dQ in the dk/dv kernel", "[cuda][backward][fused]",
                   attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using attnmix::detail::cuda::attention_backward_variant;
  const forced_variant fused(attention_backward_variant::sm90_wgmma_fused);
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(v2_cases(), 8900, "fused", {}, 0,
                                                                   true);
  sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, TestType>(
      v2_cases(), 9000, "fused, bidirectional", {}, 0, true);
  sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(v2_cases(), 9100, "fused, fox", {}, 0,
                                                           true);
  sweep<attnmix::kind::fox, fox_before, TestType>(reset_cases(), 9200, "fused, fox resets", {}, 0,
                                                  true);
}

TEMPLATE_TEST_CASE("CUDA softmax backward matches the CPU backward", "[cuda][backward][softmax]",
                   float, attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, TestType>(cases(), 1000, "causal");
  sweep<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, TestType>(cases(), 2000,
                                                                                 "bidirectional");
}

TEMPLATE_TEST_CASE("CUDA FoX backward matches the CPU backward in both gate conventions",
                   "[cuda][backward][fox]", float, attnmix::half, attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(cases(), 3000, "fox after");
  sweep<attnmix::kind::fox, fox_before, TestType>(cases(), 4000, "fox before");
}

TEMPLATE_TEST_CASE("CUDA FoX backward through hard resets", "[cuda][backward][fox]", float,
                   attnmix::bfloat16) {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  sweep<attnmix::kind::fox, attnmix::fox_policy, TestType>(reset_cases(), 5000, "fox, resets");
  sweep<attnmix::kind::fox, fox_before, TestType>(reset_cases(), 5500, "fox before, resets");
}

TEST_CASE("CUDA backward with the portable knob", "[cuda][backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  attnmix::backend::cuda portable{};
  portable.portable = true;
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, attnmix::bfloat16>(small_cases(), 6000,
                                                                            "portable", portable);
}

// Every [B, T, H, D] tensor with 3 elements between heads (odd strides, NaN in the gaps): the
// kernels must use each view's own strides and write only the view's elements.
TEST_CASE("CUDA backward on strided views", "[cuda][backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const std::vector<bwd_case> strided{{1, 37, 4, 2, 64, 64}, {2, 100, 2, 1, 48, 40, 20}};
  sweep<attnmix::kind::softmax, attnmix::softmax_policy, attnmix::half>(strided, 6500, "strided",
                                                                        {}, 3);
  sweep<attnmix::kind::fox, attnmix::fox_policy, float>(strided, 6600, "strided fox", {}, 3);
}

// The CUDA forward's out and lse feed the CUDA backward through the front doors; the CPU backward
// on the same out and lse is the reference.
template <class Kind, class Policy, class T>
void round_trip(const bwd_case& c, std::uint64_t salt) {
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  INFO("round trip: seed " << test_seed() << " " << c.describe() << " dtype "
                           << attnmix::scalar_traits<T>::name);
  rng r(salt);
  attnmix::host_tensor<float, 4> qf({c.B, c.T, c.HQ, c.D}), kf({c.B, c.T, c.H, c.D}),
      vf({c.B, c.T, c.H, c.Dv}), df({c.B, c.T, c.HQ, c.Dv});
  attnmix::host_tensor<float, 3> gf({c.B, c.T, c.HQ});
  r.fill_normal(qf), r.fill_normal(kf), r.fill_normal(vf), r.fill_normal(df);
  r.fill_uniform(gf, c.gate_lo, c.gate_hi);
  grad_buffers<T, float> in;
  in.q = convert_all<T>(qf.storage()), in.k = convert_all<T>(kf.storage());
  in.v = convert_all<T>(vf.storage()), in.dout = convert_all<T>(df.storage());
  in.g = gf.storage();

  const auto dev = attnmix::memory_space::device;
  device_buffer<T> q(in.q), k(in.k), v(in.v), dout(in.dout);
  device_buffer<T> out(static_cast<std::size_t>(c.B * c.T * c.HQ * c.Dv));
  device_buffer<float> lse(static_cast<std::size_t>(c.B * c.T * c.HQ)), g(in.g);
  attnmix::attention_args<T> fa{attnmix::view4<const T>(q.get(), {c.B, c.T, c.HQ, c.D}, dev),
                                attnmix::view4<const T>(k.get(), {c.B, c.T, c.H, c.D}, dev),
                                attnmix::view4<const T>(v.get(), {c.B, c.T, c.H, c.Dv}, dev),
                                attnmix::view4<T>(out.get(), {c.B, c.T, c.HQ, c.Dv}, dev)};
  if constexpr (gated) fa.g = attnmix::view3<const float>(g.get(), {c.B, c.T, c.HQ}, dev);
  fa.lse = attnmix::view3<float>(lse.get(), {c.B, c.T, c.HQ}, dev);
  attnmix::attention<Kind, Policy>(fa, params_of(c), attnmix::backend::cuda{});
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "forward");
  in.out = out.to_host();
  in.lse = lse.to_host();

  device_buffer<T> dq(in.q.size()), dk(in.k.size()), dv(in.v.size());
  device_buffer<float> dg(in.lse.size());
  attnmix::attention_backward<Kind, Policy>(
      grad_args<Kind>(c, static_cast<const T*>(q.get()), k.get(), v.get(), out.get(), lse.get(),
                      dout.get(), g.get(), dq.get(), dk.get(), dv.get(), dg.get(), dev),
      params_of(c), attnmix::backend::cuda{});
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "backward");

  grad_buffers<double, double> ind{convert_all<double>(in.q),
                                   convert_all<double>(in.k),
                                   convert_all<double>(in.v),
                                   convert_all<double>(in.out),
                                   convert_all<double>(in.dout),
                                   {},
                                   {},
                                   {},
                                   convert_all<double>(in.lse),
                                   convert_all<double>(in.g),
                                   {}};
  const auto ref = cpu_backward<Kind, Policy>(c, ind);
  grad_buffers<float, float> inf{convert_all<float>(in.q),
                                 convert_all<float>(in.k),
                                 convert_all<float>(in.v),
                                 convert_all<float>(in.out),
                                 convert_all<float>(in.dout),
                                 {},
                                 {},
                                 {},
                                 in.lse,
                                 in.g,
                                 {}};
  const auto plain = cpu_backward<Kind, Policy>(c, inf);
  check_gradient<T>("dq", max_rel(dq.to_host(), ref.dq), max_rel(convert_all<T>(plain.dq), ref.dq));
  check_gradient<T>("dk", max_rel(dk.to_host(), ref.dk), max_rel(convert_all<T>(plain.dk), ref.dk));
  check_gradient<T>("dv", max_rel(dv.to_host(), ref.dv), max_rel(convert_all<T>(plain.dv), ref.dv));
  if (gated) check_gradient<T>("dg", max_rel(dg.to_host(), ref.dg), max_rel(plain.dg, ref.dg));
}

TEST_CASE("CUDA forward then backward through the front doors", "[cuda][backward]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  round_trip<attnmix::kind::softmax, attnmix::softmax_policy, attnmix::bfloat16>(
      {2, 300, 4, 2, 64, 64}, 7000);
  round_trip<attnmix::kind::softmax, attnmix::bidirectional_softmax_policy, attnmix::half>(
      {1, 257, 2, 1, 128, 128, 40}, 7100);
  round_trip<attnmix::kind::fox, attnmix::fox_policy, attnmix::bfloat16>(
      {1, 200, 4, 2, 64, 64, 0, {0, 0, 1, 120, 200}}, 7200);
  round_trip<attnmix::kind::fox, fox_before, float>({1, 100, 2, 2, 48, 40}, 7300);
}
