// GBLA core on the CPU: the key gate and the gated RMSNorm against the float64 oracle in every
// configuration of the paper's ablations, and the invariances of spec gbla.md §2.3-2.4.

#include <algorithm>
#include <array>

#include "cpu/test_linear_harness.hpp"

using namespace attnmix_test;
using attnmix::gated_norm;
using attnmix::key_gate;
using attnmix::kind::gbla;

namespace {

template <class Policy, class T>
void sweep(const std::vector<linear_case>& cases, std::uint64_t salt, const char* what) {
  for (const linear_case& c : cases) {
    INFO("seed " << test_seed() << " " << c.describe() << " policy " << what);
    const linear_errors e = run_linear_case<gbla, Policy, T>(c, ++salt);
    CHECK(e.out <= tolerance<T>());
    CHECK(e.S <= tolerance<T>());
    CHECK(e.z <= tolerance<T>());
    CHECK(e.lse <= tolerance<T>());
  }
}

std::vector<linear_case> short_cases() {
  std::vector<linear_case> cs;
  for (const linear_case& c : standard_linear_cases())
    if (c.T <= 200) cs.push_back(c);
  linear_case no_gamma{2, 40, 4, 2, 16, 8};
  no_gamma.with_gamma = false;
  cs.push_back(no_gamma);
  return cs;
}

struct per_head_gate : attnmix::gbla_policy {
  static constexpr key_gate gate = key_gate::per_head;
};
struct full_width : attnmix::gbla_policy {
  static constexpr gated_norm norm = gated_norm::full_width;
  static constexpr attnmix::norm_weight weight = attnmix::norm_weight::per_head;
};
struct mamba_style : attnmix::gbla_policy {
  static constexpr attnmix::norm_gate_order order = attnmix::norm_gate_order::gate_then_norm;
  static constexpr attnmix::gate_activation activation = attnmix::gate_activation::sigmoid;
};
struct gamma_per_head : per_head_gate {
  static constexpr attnmix::norm_weight weight = attnmix::norm_weight::per_head;
  static constexpr attnmix::feature_map phi = attnmix::feature_map::relu;
};
using no_key_gate = attnmix::with_key_gate<attnmix::gbla_policy, key_gate::off>;
using no_norm = attnmix::with_gated_norm<attnmix::gbla_policy, gated_norm::off>;
using plain = attnmix::with_gated_norm<no_key_gate, gated_norm::off>;
using unnormalised = attnmix::with_normalize<attnmix::gbla_policy, false>;

}  // namespace

TEMPLATE_TEST_CASE("GBLA core matches the oracle (shared gate, per-head gated norm)", "[gbla][cpu]",
                   float, double) {
  sweep<attnmix::gbla_policy, TestType>(standard_linear_cases(), 100, "gbla_policy");
}

TEMPLATE_TEST_CASE("GBLA variants match the oracle", "[gbla][cpu]", float, double) {
  sweep<per_head_gate, TestType>(short_cases(), 200, "per-head gate");
  sweep<full_width, TestType>(short_cases(), 300, "full-width norm, gamma per head");
  sweep<mamba_style, TestType>(short_cases(), 400, "gate then norm, sigmoid");
  sweep<gamma_per_head, TestType>(short_cases(), 500, "gamma per head, relu");
}

TEMPLATE_TEST_CASE("GBLA ablations match the oracle", "[gbla][cpu]", float, double) {
  sweep<no_key_gate, TestType>(short_cases(), 600, "no key gate");
  sweep<no_norm, TestType>(short_cases(), 700, "no gated norm");
  sweep<plain, TestType>(short_cases(), 800, "no gate, no norm");
  sweep<unnormalised, TestType>(short_cases(), 900, "normaliser off");
}

TEST_CASE("GBLA with both add-ons off is BLA", "[gbla][cpu]") {
  rng r(21);
  attnmix::host_tensor<double, 4> q({2, 100, 4, 16}), k({2, 100, 2, 16}), v({2, 100, 2, 8});
  attnmix::host_tensor<double, 4> a_out({2, 100, 4, 8}), b_out({2, 100, 4, 8});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v);
  attnmix::linear_attention<attnmix::kind::bla>(
      attnmix::linear_attention_args<double>{q.view(), k.view(), v.view(), a_out.view()});
  attnmix::linear_attention<gbla, plain>(
      attnmix::linear_attention_args<double>{q.view(), k.view(), v.view(), b_out.view()});
  CHECK(bitwise_equal(a_out.storage(), b_out.storage()));
}

namespace {

// Runs GBLA on the given tensors (dense batch, with a mask) into `out`.
template <class Policy, class T>
void run_gbla(linear_inputs<T>& in, const std::vector<std::uint8_t>& mask, index_t B, index_t T_,
              attnmix::host_tensor<T, 4>& out, double norm_eps = 1e-5) {
  attnmix::linear_attention_args<T> args{in.q.view(), in.k.view(), in.v.view(), out.view()};
  args.mask = {mask.data(), {B, T_}};
  args.a = in.a.view();
  args.gate = in.gate.view();
  args.gamma = in.gamma.view();
  attnmix::linear_attention_params params;
  params.norm_eps = norm_eps;
  poison(out);
  attnmix::linear_attention<gbla, Policy>(args, params);
}

}  // namespace

TEMPLATE_TEST_CASE("adding a constant to the gate logits changes nothing", "[gbla][cpu]", float,
                   double) {
  using T = TestType;
  linear_case c{3, 120, 4, 2, 16, 8, {}, padding::holes};
  rng r(31);
  auto in = make_inputs<per_head_gate, T>(c, r);
  attnmix::host_tensor<T, 4> base(in.out.shape()), shifted(in.out.shape());
  run_gbla<per_head_gate>(in, in.mask, c.B, c.T, base);
  for (auto& x : in.a.storage()) x += attnmix::accum_t<T>(7.25);
  run_gbla<per_head_gate>(in, in.mask, c.B, c.T, shifted);
  INFO("seed " << test_seed());
  CHECK(rel_error(shifted.storage(), to_double(base.storage())) <= tolerance<T>());
}

TEMPLATE_TEST_CASE("with the per-head gated norm, scaling v changes the output only through eps",
                   "[gbla][cpu]", float, double) {
  // o is linear in v, and RMSNorm(c o) = RMSNorm(o) up to norm_eps.
  using T = TestType;
  linear_case c{2, 150, 4, 2, 16, 8, {}, padding::right};
  rng r(41);
  auto in = make_inputs<attnmix::gbla_policy, T>(c, r);
  attnmix::host_tensor<T, 4> base(in.out.shape()), scaled(in.out.shape());
  const double tiny = sizeof(T) == 8 ? 1e-200 : 1e-30;
  run_gbla<attnmix::gbla_policy>(in, in.mask, c.B, c.T, base, tiny);
  for (auto& x : in.v.storage()) x *= T(5.5);
  run_gbla<attnmix::gbla_policy>(in, in.mask, c.B, c.T, scaled, tiny);
  INFO("seed " << test_seed());
  CHECK(rel_error(scaled.storage(), to_double(base.storage())) <= tolerance<T>());

  // With the default eps the difference is there but small.
  run_gbla<attnmix::gbla_policy>(in, in.mask, c.B, c.T, scaled);
  for (auto& x : in.v.storage()) x /= T(5.5);
  run_gbla<attnmix::gbla_policy>(in, in.mask, c.B, c.T, base);
  const double diff = rel_error(scaled.storage(), to_double(base.storage()));
  CHECK(diff <= 1e-3);
}

TEMPLATE_TEST_CASE("strided views give the same result as contiguous ones", "[gbla][cpu]", float,
                   double) {
  // Heads not packed (a gap after every head) and tokens further apart than needed: the
  // block loads fall back from one map over all heads to per-head copies.
  using T = TestType;
  const index_t B = 2, T_ = 70, HQ = 4, H = 2, D = 16, Dv = 8, gap = 3;
  linear_case c{B, T_, HQ, H, D, Dv, {}, padding::holes};
  rng r(51);
  auto in = make_inputs<per_head_gate, T>(c, r);
  attnmix::host_tensor<T, 4> dense(in.out.shape());
  run_gbla<per_head_gate>(in, in.mask, B, T_, dense);

  auto spread = [&](const attnmix::host_tensor<T, 4>& x, std::vector<T>& store) {
    const index_t heads = x.extent(2), W = x.extent(3);
    const std::array<index_t, 4> stride = {T_ * (heads * (W + gap) + 5), heads * (W + gap) + 5,
                                           W + gap, 1};
    store.assign(static_cast<std::size_t>(B * stride[0]), std::numeric_limits<T>::quiet_NaN());
    attnmix::view4<T> v(store.data(), x.shape(), stride);
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < T_; ++t)
        for (index_t h = 0; h < heads; ++h)
          for (index_t d = 0; d < W; ++d) v(b, t, h, d) = x(b, t, h, d);
    return v;
  };
  std::vector<T> qs, ks, vs, gs, os;
  const auto q = spread(in.q, qs), k = spread(in.k, ks), v = spread(in.v, vs);
  const auto g = spread(in.gate, gs);
  auto out = spread(dense, os);  // the shape and strides of out; then poisoned
  std::fill(os.begin(), os.end(), std::numeric_limits<T>::quiet_NaN());
  attnmix::linear_attention_args<T> args{q, k, v, out};
  args.mask = {in.mask.data(), {B, T_}};
  args.a = in.a.view();
  args.gate = g;
  args.gamma = in.gamma.view();
  attnmix::linear_attention<gbla, per_head_gate>(args);
  std::vector<T> got;
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < T_; ++t)
      for (index_t h = 0; h < HQ; ++h)
        for (index_t d = 0; d < Dv; ++d) got.push_back(out(b, t, h, d));
  INFO("seed " << test_seed());
  CHECK(rel_error(got, to_double(dense.storage())) <= tolerance<T>());
}
