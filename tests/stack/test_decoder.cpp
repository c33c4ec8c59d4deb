// The decoder stack (causal self-attention, cross-attention to a memory, MLP): its forward against
// the float64 oracle (dense and packed, float and double), its backward against finite
// differences in double (x, the memory and every parameter), decoding from a remembered memory
// against the forward, and bad arguments.

#include <cstdint>
#include <string>
#include <vector>

#include "attnmix/stack/decoder.hpp"
#include "layers/layer_harness.hpp"
#include "reference/finite_difference.hpp"
#include "support/errors.hpp"
#include "train/gradcheck.hpp"

namespace {

using namespace attnmix_test;
using attnmix::host_tensor;
namespace L = attnmix::layers;

L::config config_of(index_t D, index_t heads, index_t kv_heads, index_t d, index_t mlp) {
  L::config c;
  c.hidden_size = D;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = d;
  c.intermediate_size = mlp;
  return c;
}

attnmix::view1<const std::int32_t> view_of(const std::vector<std::int32_t>& cu) {
  return cu.empty() ? attnmix::view1<const std::int32_t>{}
                    : attnmix::view1<const std::int32_t>(cu.data(), {index_t(cu.size())});
}

struct shapes {
  index_t B, T, Tm;
  std::vector<std::int32_t> cu{}, cu_m{};
  attnmix::decoder_inputs inputs() const { return {view_of(cu), view_of(cu_m)}; }
};

std::vector<shapes> all_shapes() {
  return {{2, 4, 7}, {1, 9, 12, {0, 1, 5, 5, 9}, {0, 3, 4, 8, 12}}, {1, 1, 1}};
}

}  // namespace

TEST_CASE("the decoder matches the float64 oracle", "[stack][decoder]") {
  const L::config c = config_of(32, 4, 2, 8, 48);
  rng r(1);
  for (const index_t layers : {1, 2}) {
    attnmix::decoder<float> df(c, layers);
    attnmix::decoder<double> dd(c, layers);
    L::randomize_parameters(df, test_seed() ^ layers, 0.15, 0.3);
    copy_parameters(df, dd);
    const auto params = parameters_of(df);
    for (const shapes& s : all_shapes()) {
      INFO("seed " << test_seed() << " layers " << layers << " B=" << s.B << " T=" << s.T
                   << " Tm=" << s.Tm << " packed=" << !s.cu.empty());
      const auto xf = random_activations<float>(r, s.B, s.T, 32);
      const auto mf = random_activations<float>(r, s.B, s.Tm, 32);
      host_tensor<double, 3> xd(xf.shape()), md(mf.shape());
      xd.storage().assign(xf.storage().begin(), xf.storage().end());
      md.storage().assign(mf.storage().begin(), mf.storage().end());
      host_tensor<float, 3> yf(xf.shape());
      host_tensor<double, 3> yd(xf.shape());
      poison(yf), poison(yd);
      df.forward(xf.view(), mf.view(), yf.view(), s.inputs());
      dd.forward(xd.view(), md.view(), yd.view(), s.inputs());
      const auto want = layer_ref::decoder(params, layers, as_double(xf), as_double(mf), dims_of(c),
                                           layer_ref::layout{s.B, s.T, to_long(s.cu)},
                                           layer_ref::layout{s.B, s.Tm, to_long(s.cu_m)});
      CHECK(rel_error(yf.storage(), want) <= 4 * tolerance<float>());
      CHECK(rel_error(yd.storage(), want) <= 1e-11);
    }
  }
}

TEST_CASE("the decoder's backward matches finite differences", "[stack][decoder][backward]") {
  const L::config c = config_of(8, 2, 1, 4, 12);
  rng r(2);
  for (const shapes& s : all_shapes()) {
    INFO("seed " << test_seed() << " B=" << s.B << " T=" << s.T << " Tm=" << s.Tm
                 << " packed=" << !s.cu.empty());
    attnmix::decoder<double> dec(c, 2);
    L::randomize_parameters(dec, test_seed() ^ 2, 0.4, 0.3);
    const auto x = random_activations<double>(r, s.B, s.T, 8);
    const auto mem = random_activations<double>(r, s.B, s.Tm, 8);
    const auto w = random_activations<double>(r, s.B, s.T, 8);
    const auto y_of = [&](const std::vector<double>& xs, const std::vector<double>& ms) {
      host_tensor<double, 3> xv(x.shape()), mv(mem.shape()), y(x.shape());
      xv.storage() = xs, mv.storage() = ms;
      dec.forward(xv.view(), mv.view(), y.view(), s.inputs(), attnmix::backend::cpu{1});
      return y.storage();
    };
    attnmix::decoder<double>::saved_type saved;
    host_tensor<double, 3> y(x.shape()), dx(x.shape()), dmem(mem.shape());
    poison(dx), poison(dmem);
    dec.forward(x.view(), mem.view(), y.view(), saved, s.inputs());
    CHECK(bitwise_equal(y.storage(), y_of(x.storage(), mem.storage())));
    dec.backward(mem.view(), w.view(), dx.view(), dmem.view(), saved);
    const auto fd_x = attnmix_ref::finite_difference(
        [&](const std::vector<double>& xs) {
          return attnmix_ref::dot(w.storage(), y_of(xs, mem.storage()));
        },
        x.storage());
    const auto fd_m = attnmix_ref::finite_difference(
        [&](const std::vector<double>& ms) {
          return attnmix_ref::dot(w.storage(), y_of(x.storage(), ms));
        },
        mem.storage());
    CHECK(attnmix_ref::relative_error(dx.storage(), fd_x) < 1e-7);
    CHECK(attnmix_ref::relative_error(dmem.storage(), fd_m) < 1e-7);
    check_parameter_grads(
        dec, [&] { return y_of(x.storage(), mem.storage()); }, w.storage(), 1e-7);
  }
}

TEST_CASE("the decoder decodes from a remembered memory as its forward",
          "[stack][decoder][decode]") {
  const L::config c = config_of(24, 4, 2, 6, 40);
  attnmix::decoder<double> dec(c, 2);
  L::randomize_parameters(dec, test_seed() ^ 3, 0.2, 0.3);
  rng r(3);
  const index_t N = 3, T = 4, D = 24;
  // Memory of several lengths: packed, user n -> slot n.
  const std::vector<std::int32_t> cu_m{0, 5, 6, 14};
  const auto x = random_activations<double>(r, N, T, D);
  const auto packed_mem = random_activations<double>(r, 1, 14, D);
  auto cache = dec.make_memory_cache(N, 8);
  dec.remember(packed_mem.view(), cache, view_of(cu_m));
  // The forward of each user's prefixes against its memory alone.
  std::vector<double> full;
  for (index_t n = 0; n < N; ++n) {
    const index_t len = cu_m[std::size_t(n) + 1] - cu_m[std::size_t(n)];
    host_tensor<double, 3> xn({1, T, D}), mn({1, len, D}), yn({1, T, D});
    for (index_t i = 0; i < T * D; ++i) xn.data()[i] = x.data()[n * T * D + i];
    for (index_t i = 0; i < len * D; ++i)
      mn.data()[i] = packed_mem.data()[cu_m[std::size_t(n)] * D + i];
    dec.forward(xn.view(), mn.view(), yn.view());
    full.insert(full.end(), yn.storage().begin(), yn.storage().end());
  }
  host_tensor<double, 3> out(x.shape());
  poison(out);
  dec.forward(x.view(), out.view(), cache, {0, 1, 2});
  CHECK(rel_error(out.storage(), full) <= 1e-13);
  // Beams: four rows over users {2, 0, 2, 1}, prefixes of every length.
  const std::vector<std::int32_t> beams{2, 0, 2, 1};
  for (index_t t = 1; t <= T; ++t) {
    host_tensor<double, 3> xs({4, t, D}), ys({4, t, D});
    std::vector<double> want;
    for (index_t b = 0; b < 4; ++b) {
      const index_t u = beams[std::size_t(b)];
      for (index_t i = 0; i < t; ++i)
        for (index_t e = 0; e < D; ++e) xs(b, i, e) = x(u, i, e);
      // A causal decoder's rows of a prefix are those of the whole sequence.
      for (index_t i = 0; i < t; ++i)
        for (index_t e = 0; e < D; ++e) want.push_back(full[std::size_t((u * T + i) * D + e)]);
    }
    poison(ys);
    dec.forward(xs.view(), ys.view(), cache, beams);
    INFO("prefix " << t);
    CHECK(rel_error(ys.storage(), want) <= 1e-13);
  }
}

TEST_CASE("the decoder rejects bad arguments", "[stack][decoder][errors]") {
  const L::config c = config_of(16, 2, 2, 8, 24);
  attnmix::decoder<float> dec(c, 2);
  L::randomize_parameters(dec, 4, 0.2);
  expect_error("attnmix::decoder", "layers", "must be >= 1 but is 0",
               [&] { attnmix::decoder<float>(c, 0); });
  host_tensor<float, 3> x({2, 3, 16}, 0.5f), mem({2, 5, 16}, 0.25f), out({2, 3, 16}, 42.0f);
  host_tensor<float, 3> mem1({1, 5, 16}, 0.25f);
  const std::string fwd = "attnmix::decoder::forward";
  expect_error(fwd, "memory", "has B = 1 but x has B = 2",
               [&] { dec.forward(x.view(), mem1.view(), out.view()); });
  CHECK(bitwise_equal(out.storage(), std::vector<float>(out.storage().size(), 42.0f)));

  attnmix::decoder<float>::saved_type saved;
  host_tensor<float, 3> dx({2, 3, 16}), dmem({2, 5, 16}), dmem4({2, 4, 16});
  const std::string bwd = "attnmix::decoder::backward";
  expect_error(bwd, "saved", "was not filled by a training forward",
               [&] { dec.backward(mem.view(), x.view(), dx.view(), dmem.view(), saved); });
  dec.forward(x.view(), mem.view(), out.view(), saved);
  expect_error(bwd, "dmemory", "but the forward's memory had [2, 5, 16]",
               [&] { dec.backward(mem.view(), x.view(), dx.view(), dmem4.view(), saved); });
  attnmix::decoder<float> other(c, 1);
  expect_error(bwd, "saved", "was saved by a decoder of sizes",
               [&] { other.backward(mem.view(), x.view(), dx.view(), dmem.view(), saved); });

  auto cache = dec.make_memory_cache(2, 5);
  expect_error("attnmix::decoder::remember", "cache", "holds 1 layers' memory", [&] {
    auto one = other.make_memory_cache(2, 5);
    dec.remember(mem.view(), one);
  });
  dec.remember(mem.view(), cache);
  expect_error(fwd, "slots", "[1] is 2, not a slot of the cache (2 slots)", [&] {
    dec.forward(x.view(), out.view(), cache, {0, 2});
  });
  expect_error(fwd, "slots", "holds 1 slots but x has N = 2",
               [&] { dec.forward(x.view(), out.view(), cache, {0}); });
  auto empty = dec.make_memory_cache(2, 5);
  expect_error(fwd, "cache", "slot 1 holds no memory", [&] {
    dec.forward(x.view(), out.view(), empty, {1, 1});
  });
}
