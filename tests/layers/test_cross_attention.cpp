// The cross-attention layer: its forward against the float64 oracle (dense and packed memory,
// GQA, qk-norm with biases, float and double), its backward against finite differences in double
// (x, the memory and every parameter), decoding from a remembered memory against the forward,
// and bad arguments rejected before anything is written.

#include <cstdint>
#include <string>
#include <vector>

#include "layers/layer_harness.hpp"
#include "reference/finite_difference.hpp"
#include "support/errors.hpp"
#include "train/gradcheck.hpp"

namespace {

using namespace attnmix_test;
using attnmix::host_tensor;
namespace L = attnmix::layers;

struct normed_policy : L::cross_attention_layer_policy {
  static constexpr bool qk_norm = true;
  static constexpr bool qkv_bias = true;
};

template <class T, class Policy = L::cross_attention_layer_policy>
using cross = L::cross_attention_layer<T, Policy>;

L::config config_of(index_t D, index_t heads, index_t kv_heads, index_t d) {
  L::config c;
  c.hidden_size = D;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = d;
  return c;
}

// x [B, T, D] against memory [B, Tm, D], or both packed (cu, cu_m non-empty, B == 1).
struct shapes {
  index_t B, T, Tm;
  std::vector<std::int32_t> cu{}, cu_m{};

  attnmix::view1<const std::int32_t> cu_view() const {
    return cu.empty() ? attnmix::view1<const std::int32_t>{}
                      : attnmix::view1<const std::int32_t>(cu.data(), {index_t(cu.size())});
  }
  attnmix::view1<const std::int32_t> cu_m_view() const {
    return cu_m.empty() ? attnmix::view1<const std::int32_t>{}
                        : attnmix::view1<const std::int32_t>(cu_m.data(), {index_t(cu_m.size())});
  }
};

// Dense; packed with a sequence of no queries (its memory still there) and one of one query;
// queries against a single memory token; one token each.
std::vector<shapes> all_shapes() {
  return {{2, 5, 11},
          {1, 12, 20, {0, 1, 7, 7, 12}, {0, 4, 5, 9, 20}},
          {1, 6, 3, {0, 0, 6}, {0, 2, 3}},
          {3, 1, 1}};
}

template <class Policy>
void check_forward(const L::config& c, std::uint64_t salt) {
  rng r(salt);
  INFO("seed " << test_seed() << " qk_norm " << Policy::qk_norm);
  cross<float, Policy> mf(c);
  cross<double, Policy> md(c);
  L::randomize_parameters(mf, test_seed() ^ salt, 0.15, 0.3);
  copy_parameters(mf, md);
  const auto params = parameters_of(mf);
  for (const shapes& s : all_shapes()) {
    INFO("B=" << s.B << " T=" << s.T << " Tm=" << s.Tm << " packed=" << !s.cu.empty());
    const auto xf = random_activations<float>(r, s.B, s.T, c.hidden_size);
    const auto mem_f = random_activations<float>(r, s.B, s.Tm, c.hidden_size);
    host_tensor<double, 3> xd(xf.shape()), mem_d(mem_f.shape());
    for (index_t i = 0; i < xf.size(); ++i) xd.data()[i] = xf.data()[i];
    for (index_t i = 0; i < mem_f.size(); ++i) mem_d.data()[i] = mem_f.data()[i];
    host_tensor<float, 3> yf(xf.shape());
    host_tensor<double, 3> yd(xf.shape());
    poison(yf), poison(yd);
    mf.forward(xf.view(), mem_f.view(), yf.view(), s.cu_view(), s.cu_m_view());
    md.forward(xd.view(), mem_d.view(), yd.view(), s.cu_view(), s.cu_m_view());
    const auto want = layer_ref::cross_attention_mixer(
        params, "", as_double(xf), as_double(mem_f), dims_of(c),
        layer_ref::layout{s.B, s.T, to_long(s.cu)}, layer_ref::layout{s.B, s.Tm, to_long(s.cu_m)},
        Policy::qk_norm);
    CHECK(rel_error(yf.storage(), want) <= 4 * tolerance<float>());
    CHECK(rel_error(yd.storage(), want) <= 1e-11);
  }
}

// dL/dx, dL/d(memory) and every parameter's gradient of L = dot(w, y) against finite differences.
template <class Policy>
void check_backward(const L::config& c, std::uint64_t salt) {
  rng r(salt);
  INFO("seed " << test_seed() << " qk_norm " << Policy::qk_norm);
  for (const shapes& s : all_shapes()) {
    INFO("B=" << s.B << " T=" << s.T << " Tm=" << s.Tm << " packed=" << !s.cu.empty());
    cross<double, Policy> m(c);
    L::randomize_parameters(m, test_seed() ^ salt, 0.3, 0.3);
    auto x = random_activations<double>(r, s.B, s.T, c.hidden_size);
    auto mem = random_activations<double>(r, s.B, s.Tm, c.hidden_size);
    auto w = random_activations<double>(r, s.B, s.T, c.hidden_size);
    const auto y_of = [&](const std::vector<double>& xs, const std::vector<double>& ms) {
      host_tensor<double, 3> xv(x.shape()), mv(mem.shape()), y(x.shape());
      xv.storage() = xs, mv.storage() = ms;
      m.forward(xv.view(), mv.view(), y.view(), s.cu_view(), s.cu_m_view(),
                attnmix::backend::cpu{1});
      return y.storage();
    };
    typename cross<double, Policy>::saved_type saved;
    host_tensor<double, 3> y(x.shape()), dx(x.shape()), dmem(mem.shape());
    poison(dx), poison(dmem);
    m.forward(x.view(), mem.view(), y.view(), saved, s.cu_view(), s.cu_m_view());
    CHECK(bitwise_equal(y.storage(), y_of(x.storage(), mem.storage())));
    m.backward(x.view(), mem.view(), w.view(), dx.view(), dmem.view(), saved, s.cu_view(),
               s.cu_m_view());
    const auto loss_x = [&](const std::vector<double>& xs) {
      return attnmix_ref::dot(w.storage(), y_of(xs, mem.storage()));
    };
    const auto loss_m = [&](const std::vector<double>& ms) {
      return attnmix_ref::dot(w.storage(), y_of(x.storage(), ms));
    };
    CHECK(attnmix_ref::relative_error(dx.storage(),
                                      attnmix_ref::finite_difference(loss_x, x.storage())) < 1e-7);
    CHECK(attnmix_ref::relative_error(
              dmem.storage(), attnmix_ref::finite_difference(loss_m, mem.storage())) < 1e-7);
    check_parameter_grads(
        m, [&] { return y_of(x.storage(), mem.storage()); }, w.storage(), 1e-7);
  }
}

}  // namespace

TEST_CASE("cross-attention matches the float64 oracle", "[layers][cross_attention]") {
  check_forward<L::cross_attention_layer_policy>(config_of(48, 4, 2, 16), 1);
  check_forward<normed_policy>(config_of(48, 4, 4, 8), 2);
}

TEST_CASE("cross-attention: the backward matches finite differences",
          "[layers][cross_attention][backward]") {
  check_backward<L::cross_attention_layer_policy>(config_of(16, 2, 1, 8), 3);
  check_backward<normed_policy>(config_of(12, 2, 2, 4), 4);
}

TEST_CASE("cross-attention: gradients of the memory add up over calls",
          "[layers][cross_attention][backward]") {
  // backward_rows with accumulate_memory adds to dm (a decoder's layers read one memory).
  const L::config c = config_of(16, 2, 2, 8);
  cross<double> m(c);
  L::randomize_parameters(m, test_seed() ^ 5, 0.3);
  rng r(5);
  const auto x = random_activations<double>(r, 2, 3, 16),
             mem = random_activations<double>(r, 2, 4, 16);
  const auto w = random_activations<double>(r, 2, 3, 16);
  cross<double>::saved_type saved;
  host_tensor<double, 3> y(x.shape()), dx(x.shape()), once(mem.shape());
  m.forward(x.view(), mem.view(), y.view(), saved);
  m.backward(x.view(), mem.view(), w.view(), dx.view(), once.view(), saved);
  const attnmix::backend::cpu be;
  const L::ops<attnmix::backend::cpu>::handles h{};
  const L::token_layout lx{2, 3, {}}, lm{2, 4, {}};
  const L::context<attnmix::backend::cpu> ctx{be, lx, nullptr, h};
  std::vector<double> twice = once.storage(), dx2(dx.storage().size());
  m.backward_rows(ctx, x.data(), {mem.data(), lm}, w.data(), dx2.data(), twice.data(), saved, false,
                  true);
  for (std::size_t i = 0; i < twice.size(); ++i) CHECK(twice[i] == Approx(2 * once.storage()[i]));
  CHECK(bitwise_equal(dx2, dx.storage()));
}

TEST_CASE("cross-attention decodes from a remembered memory as its forward",
          "[layers][cross_attention][decode]") {
  const L::config c = config_of(32, 4, 2, 8);
  cross<double, normed_policy> m(c);
  L::randomize_parameters(m, test_seed() ^ 6, 0.2, 0.3);
  rng r(6);
  const index_t N = 3, T = 4, Tm = 9, D = 32;
  const auto x = random_activations<double>(r, N, T, D),
             mem = random_activations<double>(r, N, Tm, D);
  host_tensor<double, 3> full(x.shape());
  m.forward(x.view(), mem.view(), full.view());

  // Memory of different lengths a slot: packed, sequence n -> slot n.
  auto cache = m.make_cache(N + 1, Tm);
  m.remember(mem.view(), cache);
  for (index_t n = 0; n < N; ++n) CHECK(cache.length(n) == Tm);
  host_tensor<double, 3> out(x.shape());
  poison(out);
  m.attend(x.view(), out.view(), cache);
  CHECK(rel_error(out.storage(), full.storage()) <= 1e-13);

  // Beams: rows reading slots {2, 0, 2, 1} give the forward's rows of those users, token by
  // token.
  const std::vector<std::int32_t> beams{2, 0, 2, 1};
  for (index_t t = 0; t < T; ++t) {
    host_tensor<double, 3> xs({4, 1, D}), ys({4, 1, D});
    std::vector<double> want;
    for (index_t b = 0; b < 4; ++b)
      for (index_t e = 0; e < D; ++e)
        xs(b, 0, e) = x(beams[std::size_t(b)], t, e),
                 want.push_back(full(beams[std::size_t(b)], t, e));
    poison(ys);
    m.attend(xs.view(), ys.view(), cache, beams);
    INFO("token " << t);
    CHECK(rel_error(ys.storage(), want) <= 1e-13);
  }
}

TEST_CASE("cross-attention rejects bad arguments before writing",
          "[layers][cross_attention][errors]") {
  const L::config c = config_of(16, 2, 1, 8);
  cross<float> m(c);
  L::randomize_parameters(m, 7, 0.2);
  host_tensor<float, 3> x({2, 3, 16}, 0.5f), mem({2, 5, 16}, 0.25f), out({2, 3, 16}, 42.0f);
  host_tensor<float, 3> mem3({3, 5, 16}, 0.25f), packed_x({1, 6, 16}, 0.5f),
      packed_out({1, 6, 16}, 42.0f), packed_mem({1, 10, 16}, 0.25f);
  const std::string fwd = "attnmix::layers::cross_attn::forward";
  const auto untouched = [](const host_tensor<float, 3>& t) {
    CHECK(bitwise_equal(t.storage(), std::vector<float>(t.storage().size(), 42.0f)));
  };
  expect_error(fwd, "memory", "has B = 3 but x has B = 2",
               [&] { m.forward(x.view(), mem3.view(), out.view()); });
  untouched(out);
  host_tensor<float, 3> narrow({2, 5, 8});
  expect_error(fwd, "memory", "hidden_size = 16",
               [&] { m.forward(x.view(), narrow.view(), out.view()); });
  const std::vector<std::int32_t> cu{0, 2, 6}, cu_m{0, 4, 10}, cu_m3{0, 4, 7, 10},
      empty_m{0, 0, 10};
  const attnmix::view1<const std::int32_t> cu_v(cu.data(), {3}), cu_m_v(cu_m.data(), {3});
  expect_error(fwd, "cu_seqlens_memory", "must be given with 'cu_seqlens'",
               [&] { m.forward(packed_x.view(), packed_mem.view(), packed_out.view(), cu_v); });
  expect_error(fwd, "cu_seqlens", "must be given with 'cu_seqlens_memory'", [&] {
    m.forward(packed_x.view(), packed_mem.view(), packed_out.view(), {}, cu_m_v);
  });
  expect_error(fwd, "cu_seqlens_memory", "holds 4 offsets but cu_seqlens holds 3", [&] {
    m.forward(packed_x.view(), packed_mem.view(), packed_out.view(), cu_v,
              attnmix::view1<const std::int32_t>(cu_m3.data(), {4}));
  });
  expect_error(fwd, "memory", "holds no token for the 2 queries of sequence 0", [&] {
    m.forward(packed_x.view(), packed_mem.view(), packed_out.view(), cu_v,
              attnmix::view1<const std::int32_t>(empty_m.data(), {3}));
  });
  expect_error(fwd, "out", "overlaps the memory of 'memory'", [&] {
    m.forward(x.view(), mem.view(), attnmix::view3<float>(mem.data(), {2, 3, 16}));
  });
  untouched(packed_out);
  untouched(out);

  // The backward: its gradients' shapes, and a saved state of another memory.
  cross<float>::saved_type saved;
  m.forward(x.view(), mem.view(), out.view(), saved);
  out.fill(42.0f);
  host_tensor<float, 3> dx({2, 3, 16}, 42.0f), dmem({2, 5, 16}, 42.0f), short_dmem({2, 4, 16});
  const std::string bwd = "attnmix::layers::cross_attn::backward";
  expect_error(bwd, "dmemory", "must have the shape of 'x'", [&] {
    m.backward(x.view(), mem.view(), x.view(), dx.view(), short_dmem.view(), saved);
  });
  host_tensor<float, 3> other_mem({2, 4, 16}, 0.25f);
  expect_error(bwd, "saved", "was saved by a forward over 2 x 5 tokens", [&] {
    m.backward(x.view(), other_mem.view(), x.view(), dx.view(), short_dmem.view(), saved);
  });
  untouched(dx);
  untouched(dmem);

  // Decoding: the cache's layout, capacity and slots.
  auto cache = m.make_cache(2, 4);
  const std::string rem = "attnmix::layers::cross_attn::remember";
  expect_error(rem, "cache", "has capacity 4 but memory sequence 0 has 5 tokens",
               [&] { m.remember(mem.view(), cache); });
  CHECK(cache.length(0) == 0);
  m.remember(other_mem.view(), cache);
  cross<float> wide(config_of(16, 2, 2, 8));
  expect_error(rem, "cache", "", [&] { wide.remember(other_mem.view(), cache); });
  const std::string att = "attnmix::layers::cross_attn::attend";
  const std::vector<std::int32_t> bad{0, 2}, two{1, 1, 0};
  expect_error(att, "slots", "[1] is 2, not a slot of the cache (2 slots)",
               [&] { m.attend(x.view(), out.view(), cache, bad); });
  expect_error(att, "slots", "holds 3 slots but x has N = 2",
               [&] { m.attend(x.view(), out.view(), cache, two); });
  auto fresh = m.make_cache(2, 4);
  expect_error(att, "cache", "slot 0 holds no memory for the queries of row 0",
               [&] { m.attend(x.view(), out.view(), fresh); });
  untouched(out);
}
