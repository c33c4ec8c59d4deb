// The test-only serial backend (support/serial_backend.hpp) through the front doors: attention,
// linear attention, the PaTH key cache, prefill and decoding give the cpu backend's bits, and the
// memory-space checks name it; a language model of every mixer kind trains on it as on the cpu
// backend, bit for bit; the traits that say whether a backend's layer operations are complete.

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "attnmix/train/language_model.hpp"
#include "attnmix/train/optimizer.hpp"
#include "support/catch.hpp"
#include "support/serial_backend.hpp"
#include "support/testing.hpp"

using namespace attnmix_test;
using attnmix::host_tensor;
using attnmix::index_t;
using test_backend::serial;

static_assert(attnmix::is_backend_v<serial>);
static_assert(attnmix::space_of_v<serial> == attnmix::memory_space::host);
static_assert(attnmix::is_implemented_v<attnmix::kind::path_fox, serial>);
static_assert(attnmix::is_backward_implemented_v<attnmix::kind::gbla, serial>);
static_assert(attnmix::layers::has_layer_ops_v<serial>);
static_assert(attnmix::layers::has_training_ops_v<serial>);

// A backend whose ops<> has only its handles: the traits say so instead of failing to compile.
namespace test_backend {
struct bare {
  using memory_space = attnmix::host_space;
  static constexpr const char* name = "bare";
};
}  // namespace test_backend
template <>
struct attnmix::layers::ops<test_backend::bare> {
  struct handles {};
};
static_assert(!attnmix::layers::has_layer_ops_v<test_backend::bare>);
static_assert(!attnmix::layers::has_training_ops_v<test_backend::bare>);

namespace {

constexpr index_t B = 2, T = 45, HQ = 4, H = 2, D = 16, Dv = 8;

struct inputs {
  host_tensor<float, 4> q{{B, T, HQ, D}}, k{{B, T, H, D}}, v{{B, T, H, Dv}}, w{{B, T, H, D}};
  host_tensor<float, 4> gate{{B, T, HQ, Dv}};
  host_tensor<float, 3> g{{B, T, HQ}}, beta{{B, T, H}}, a{{B, T, 1}};
  explicit inputs(std::uint64_t salt) {
    rng r(salt);
    r.fill_normal(q), r.fill_normal(k), r.fill_normal(v), r.fill_normal(gate), r.fill_normal(a);
    r.fill_uniform(g, -0.2, -0.01), r.fill_uniform(beta, 0.1, 1.9);
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < T; ++t)
        for (index_t h = 0; h < H; ++h) {
          w(b, t, h, h) = 1.0f;  // unit directions
        }
  }
  attnmix::attention_args<float> args(host_tensor<float, 4>& out) {
    attnmix::attention_args<float> x{q.view(), k.view(), v.view(), out.view()};
    return x;
  }
};

template <class Kind, class Backend>
std::vector<float> run_attention(inputs& in, const Backend& be) {
  host_tensor<float, 4> out({B, T, HQ, Dv});
  poison(out);
  auto x = in.args(out);
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate) x.g = in.g.view();
  if constexpr (attnmix::kind_traits<Kind>::uses_householder)
    x.w = in.w.view(), x.beta = in.beta.view();
  attnmix::attention<Kind>(x, {}, be);
  return out.storage();
}

template <class Kind, class Backend>
std::vector<float> run_linear(inputs& in, const Backend& be) {
  host_tensor<float, 4> out({B, T, HQ, Dv});
  poison(out);
  attnmix::linear_attention_args<float> x{in.q.view(), in.k.view(), in.v.view(), out.view()};
  if constexpr (std::is_same_v<Kind, attnmix::kind::gbla>)
    x.a = in.a.view(), x.gate = in.gate.view();
  attnmix::linear_attention<Kind>(x, {}, be);
  return out.storage();
}

}  // namespace

TEMPLATE_TEST_CASE("a serial backend runs the softmax family through the front door",
                   "[core][backend]", attnmix::kind::softmax, attnmix::kind::fox,
                   attnmix::kind::path, attnmix::kind::path_fox) {
  inputs in(31);
  const auto mine = run_attention<TestType>(in, serial{});
  CHECK(bitwise_equal(mine, run_attention<TestType>(in, attnmix::backend::cpu{})));
  for (float x : mine) REQUIRE(std::isfinite(x));
}

TEMPLATE_TEST_CASE("a serial backend runs linear attention through the front door",
                   "[core][backend]", attnmix::kind::bla, attnmix::kind::gbla,
                   attnmix::kind::linear_causal) {
  inputs in(32);
  const auto mine = run_linear<TestType>(in, serial{});
  CHECK(bitwise_equal(mine, run_linear<TestType>(in, attnmix::backend::cpu{})));
  for (float x : mine) REQUIRE(std::isfinite(x));
}

TEST_CASE("a serial backend prefills and decodes a host path_cache", "[core][backend]") {
  using fox = attnmix::kind::path_fox;
  inputs in(33);
  const auto decode = [&](const auto& be) {
    attnmix::path_cache<float> cache(B, T + 1, HQ, H, D, Dv);
    host_tensor<float, 4> out({B, T, HQ, Dv}), step_out({B, 1, HQ, Dv});
    auto x = in.args(out);
    x.g = in.g.view(), x.w = in.w.view(), x.beta = in.beta.view();
    attnmix::path_prefill<fox>(cache, x, {}, {}, be);
    // One more token per sequence: the first token of each row again.
    const auto row0 = [](const auto& t) {
      auto s = t.view().shape();
      s[1] = 1;
      return decltype(t.view())(t.view().data(), s, t.view().strides());
    };
    attnmix::attention_args<float> step{row0(in.q), row0(in.k), row0(in.v), step_out.view()};
    step.g = row0(in.g), step.w = row0(in.w), step.beta = row0(in.beta);
    attnmix::path_decode_step<fox>(cache, step, {}, {}, be);
    std::vector<float> all = out.storage();
    all.insert(all.end(), step_out.storage().begin(), step_out.storage().end());
    host_tensor<float, 4> keys({B, T, H, D});
    attnmix::path_prefill_key_cache(
        attnmix::path_key_cache_args<float>{in.k.view(), in.w.view(), in.beta.view(), keys.view()},
        {}, be);
    all.insert(all.end(), keys.storage().begin(), keys.storage().end());
    return all;
  };
  const auto mine = decode(serial{});
  CHECK(bitwise_equal(mine, decode(attnmix::backend::cpu{})));
  for (float x : mine) REQUIRE(std::isfinite(x));
}

TEST_CASE("the front doors check a new backend's memory space by its tag", "[core][backend]") {
  inputs in(34);
  host_tensor<float, 4> out({B, T, HQ, Dv}, 42.0f);
  auto x = in.args(out);
  x.k = attnmix::view4<const float>(in.k.data(), {B, T, H, D}, attnmix::memory_space::device);
  try {
    attnmix::attention<attnmix::kind::softmax>(x, {}, serial{});
    FAIL("no attnmix::error");
  } catch (const attnmix::error& e) {
    CHECK(std::string(e.what()).find("'k' is in device memory but the serial backend needs host "
                                     "memory") != std::string::npos);
  }
  CHECK(out(0, 0, 0, 0) == 42.0f);
}

// Every mixer kind, with an MLP block: embeddings -> stack -> head, cross-entropy, AdamW with
// clipping. The serial backend forwards to the CPU's kernels on one thread, whose sums do not
// depend on the thread count, so the losses and weights are the cpu backend's bits.
TEST_CASE("a language model of every mixer kind trains on the serial backend as on the cpu one",
          "[third_backend][train]") {
  namespace L = attnmix::layers;
  using host_stack =
      attnmix::stack<float, attnmix::layer::sa, attnmix::layer::fox, attnmix::layer::path,
                     attnmix::layer::path_fox, attnmix::layer::bla, attnmix::layer::gbla,
                     attnmix::layer::linear_causal>;
  using host_lm = attnmix::train::language_model<host_stack>;
  using serial_lm = attnmix::train::language_model<attnmix::stack_on<host_stack, serial, float>>;
  L::config c;
  c.hidden_size = 16;
  c.num_heads = 2;
  c.intermediate_size = 24;
  const index_t Bn = 2, Tn = 11, V = 13;
  rng r(test_seed() ^ 4100);
  std::vector<std::int32_t> tokens, labels;
  for (index_t i = 0; i < Bn * Tn; ++i) tokens.push_back(std::int32_t(r.integer(0, V - 1)));
  for (index_t i = 0; i < Bn * Tn; ++i)
    labels.push_back(i % Tn + 1 < Tn ? tokens[std::size_t(i + 1)] : attnmix::train::ignore_label);
  const attnmix::tensor_view<const std::int32_t, 2> tok(tokens.data(), {Bn, Tn}),
      lab(labels.data(), {Bn, Tn});

  host_lm host(c, V);
  L::randomize_parameters(host, test_seed() ^ 4101, 0.2);
  serial_lm ser(host);
  attnmix::train::adamw_config oc;
  oc.clip_norm = 0.5;
  attnmix::train::adamw<attnmix::backend::cpu> host_opt(oc);
  attnmix::train::adamw<serial> serial_opt(oc);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    host_opt.zero_grad(host);
    serial_opt.zero_grad(ser);
    const double lh = host.loss(tok, lab, true, attnmix::backend::cpu{3});
    const double ls = ser.loss(tok, lab, true, serial{});
    CHECK(ls == lh);
    CHECK(serial_opt.step(ser, 1e-2, serial{}) ==
          host_opt.step(host, 1e-2, attnmix::backend::cpu{3}));
  }
  std::vector<double> want, got;
  host.visit_parameters([&](const std::string&, const auto& p) {
    want.insert(want.end(), p.data.begin(), p.data.end());
  });
  ser.visit_parameters([&](const std::string&, const auto& p) {
    got.insert(got.end(), p.data.begin(), p.data.end());
  });
  REQUIRE(got.size() == want.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
  CHECK(differ == 0);
}
