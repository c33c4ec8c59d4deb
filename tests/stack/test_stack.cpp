// Hybrid stacks: the [SA, GBLA, GBLA] encoder and causal stacks against the float64 oracle,
// padded / left-padded / varlen batches agreeing at valid positions, whole-stack decoding
// against the full forward (with and without a sliding window), caches addressed through slot
// mappings, caches of another layout rejected before anything is written, and the same stacks
// on a test-only third host backend that only specialises the operations.

#include <string>
#include <vector>

#include "layers/custom_layers.hpp"
#include "layers/gated_softmax_layer.hpp"
#include "layers/layer_harness.hpp"

#include "support/serial_backend.hpp"

namespace {

using namespace attnmix_test;
using attnmix::host_tensor;
namespace L = attnmix::layers;
using attnmix::repeat;
namespace layer = attnmix::layer;

L::config stack_config(index_t window = 0) {
  L::config c;
  c.window = window;
  c.hidden_size = 32;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.intermediate_size = 48;
  c.w_rank = 8;
  return c;
}

std::vector<std::string> names_of(const std::vector<const char*>& n) {
  return std::vector<std::string>(n.begin(), n.end());
}

template <class Stack>
void check_against_oracle(std::uint64_t salt, index_t window = 0) {
  rng r(salt);
  INFO("seed " << test_seed() << " salt " << salt << " window " << window);
  const L::config c = stack_config(window);
  Stack s(c);
  L::randomize_parameters(s, test_seed() ^ salt, 0.15, 0.3);
  auto x = random_activations<double>(r, 2, 29, c.hidden_size);
  host_tensor<double, 3> y(x.shape());
  poison(y);
  s.forward(x.view(), y.view());
  const auto want = layer_ref::stack(parameters_of(s), names_of(Stack::layer_names()), as_double(x),
                                     dims_of(c), layer_ref::layout{2, 29, {}});
  CHECK(rel_error(y.storage(), want) <= 1e-11);
}

TEST_CASE("hybrid encoder and causal stacks match the float64 oracle", "[stack]") {
  check_against_oracle<attnmix::stack<double, repeat<2, layer::sa, layer::gbla, layer::gbla>>>(1);
  check_against_oracle<attnmix::stack<double, layer::path_fox, layer::fox, layer::bla>>(2);
  check_against_oracle<attnmix::stack<double, layer::sa, layer::gbla, layer::sa>>(3, 5);
  check_against_oracle<attnmix::stack<double, layer::path_fox, layer::fox, layer::causal_sa>>(4, 3);
  CHECK(attnmix::stack<float, repeat<3, layer::sa, layer::gbla, layer::gbla>>::num_layers == 9);
}

TEST_CASE("padded, left-padded and varlen encoder batches agree at valid positions", "[stack]") {
  rng r(11);
  INFO("seed " << test_seed());
  using encoder = attnmix::stack<float, repeat<2, layer::sa, layer::gbla, layer::gbla>>;
  const L::config c = stack_config();
  const index_t D = c.hidden_size;
  encoder s(c);
  L::randomize_parameters(s, test_seed() ^ 11, 0.15, 0.3);
  const std::vector<index_t> lengths{13, 1, 0, 20};
  const index_t B = 4, T = 20;

  // Each sequence alone: the reference.
  std::vector<host_tensor<float, 3>> seqs, alone;
  for (index_t b = 0; b < B; ++b) {
    seqs.push_back(random_activations<float>(r, 1, lengths[static_cast<std::size_t>(b)], D));
    alone.emplace_back(seqs.back().shape());
    if (lengths[static_cast<std::size_t>(b)] > 0)
      s.forward(seqs.back().view(), alone.back().view());
  }
  // Packed varlen batch.
  std::vector<std::int32_t> cu{0};
  for (auto l : lengths) cu.push_back(cu.back() + static_cast<std::int32_t>(l));
  host_tensor<float, 3> xp({1, cu.back(), D}), yp({1, cu.back(), D});
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < lengths[static_cast<std::size_t>(b)]; ++t)
      for (index_t e = 0; e < D; ++e)
        xp(0, cu[static_cast<std::size_t>(b)] + t, e) = seqs[static_cast<std::size_t>(b)](0, t, e);
  poison(yp);
  s.forward(xp.view(), yp.view(), {{}, {cu.data(), {static_cast<index_t>(cu.size())}}});

  for (bool left : {false, true}) {
    INFO((left ? "left" : "right") << " padding");
    host_tensor<float, 3> x({B, T, D}, 7.0f), y({B, T, D});  // pads hold garbage, not zeros
    host_tensor<std::uint8_t, 2> mask({B, T}, 0);
    for (index_t b = 0; b < B; ++b) {
      const index_t len = lengths[static_cast<std::size_t>(b)], off = left ? T - len : 0;
      for (index_t t = 0; t < len; ++t) {
        mask(b, off + t) = 1;
        for (index_t e = 0; e < D; ++e)
          x(b, off + t, e) = seqs[static_cast<std::size_t>(b)](0, t, e);
      }
    }
    poison(y);
    s.forward(x.view(), y.view(), {mask.view(), {}});
    for (index_t b = 0; b < B; ++b) {
      const index_t len = lengths[static_cast<std::size_t>(b)], off = left ? T - len : 0;
      std::vector<float> got, packed, pads;
      std::vector<double> want;
      for (index_t t = 0; t < T; ++t)
        for (index_t e = 0; e < D; ++e) {
          if (t >= off && t < off + len) {
            got.push_back(y(b, t, e));
            packed.push_back(yp(0, cu[static_cast<std::size_t>(b)] + t - off, e));
            want.push_back(alone[static_cast<std::size_t>(b)](0, t - off, e));
          } else {
            pads.push_back(y(b, t, e));
          }
        }
      INFO("sequence " << b);
      CHECK(rel_error(got, want) <= 1e-5);
      CHECK(rel_error(packed, want) <= 1e-5);
      for (float p : pads) CHECK(p == 0.0f);
    }
  }
}

template <class Stack>
void check_stack_decode(index_t P, std::uint64_t salt, index_t window = 0) {
  rng r(salt);
  INFO("seed " << test_seed() << " salt " << salt << " prefill " << P << " window " << window);
  const L::config c = stack_config(window);
  const index_t N = 2, T = 17, D = c.hidden_size;
  Stack s(c);
  L::randomize_parameters(s, test_seed() ^ salt, 0.15, 0.3);
  auto x = random_activations<double>(r, N, T, D);
  host_tensor<double, 3> full(x.shape());
  s.forward(x.view(), full.view());
  auto cache = s.make_cache(N, T);
  check_prefill_then_decode(s, cache, x, full, P,
                            [](const auto& c) { return std::get<0>(c).length(0); });
  // A full cache is an error, not an overflow.
  host_tensor<double, 3> xs({N, 1, D}), ys({N, 1, D});
  ATTNMIX_CHECK_ERROR(s.decode(xs.view(), ys.view(), cache), "is full");
}

TEST_CASE("causal stacks decode token by token as the full forward", "[stack][decode]") {
  using lm = attnmix::stack<double, layer::path_fox, layer::fox, layer::causal_sa, layer::path,
                            layer::linear_causal>;
  check_stack_decode<lm>(0, 21);
  check_stack_decode<lm>(6, 22);
  check_stack_decode<lm>(0, 23, 4);
  check_stack_decode<lm>(6, 24, 4);
  check_stack_decode<lm>(6, 25, 1);
}

using custom_layers::causal_gbla;

// Every kind of layer cache: PaTH key cache and conv state, KV caches, linear states.
using slot_lm = attnmix::stack<double, layer::path_fox, layer::fox, layer::causal_sa, layer::path,
                               layer::linear_causal, causal_gbla>;

TEST_CASE("stack caches through a slot mapping equal each sequence alone", "[stack][slots]") {
  for (index_t window : {index_t{0}, index_t{3}}) {
    INFO("window " << window);
    const L::config c = stack_config(window);
    slot_lm s(c);
    L::randomize_parameters(s, test_seed() ^ 31, 0.15, 0.3);
    check_slot_mapping(s, c.hidden_size, 31 + static_cast<std::uint64_t>(window));
  }
}

TEST_CASE("stacks reject bad slot mappings and leave the cache as it was", "[stack][slots]") {
  const L::config c = stack_config(2);
  slot_lm s(c);
  L::randomize_parameters(s, test_seed() ^ 41, 0.15, 0.3);
  check_bad_slots(s, c.hidden_size, "attnmix::stack", 41);
}

TEST_CASE("stack arguments are checked", "[stack][errors]") {
  const L::config c = stack_config();
  attnmix::stack<float, layer::sa, layer::gbla> s(c);
  host_tensor<float, 3> x({2, 5, 32}), y({2, 5, 32});
  host_tensor<std::uint8_t, 2> bad_mask({2, 4}, 1);
  ATTNMIX_CHECK_ERROR(s.forward(x.view(), y.view(), {bad_mask.view(), {}}), "argument 'mask'");
  std::vector<std::int32_t> cu{0, 3, 4};
  ATTNMIX_CHECK_ERROR(s.forward(x.view(), y.view(), {{}, {cu.data(), {3}}}), "B = 1");
}

TEST_CASE("stacks reject a cache of another layout before any layer writes",
          "[stack][errors][cache]") {
  using lm = attnmix::stack<double, layer::path_fox, layer::fox, layer::causal_sa, layer::path,
                            layer::linear_causal>;
  L::config a = stack_config(), b = stack_config();
  a.num_kv_heads = 1;
  b.num_kv_heads = 4;
  lm sa(a), sb(b);
  const index_t D = a.hidden_size;
  host_tensor<double, 3> x({2, 5, D}, 0.5), y({2, 5, D}), x1({2, 1, D}, 0.5), y1({2, 1, D});
  auto cb = sb.make_cache(2, 8);
  ATTNMIX_CHECK_ERROR(sa.prefill(x.view(), y.view(), cb),
                      "argument 'cache' of layer 0 (path_fox) was made for kv_heads = 4 but the "
                      "layer has kv_heads = 1");
  ATTNMIX_CHECK_ERROR(sa.decode(x1.view(), y1.view(), cb), "kv_heads = 4");
  // Only the last layer's cache is foreign: the earlier layers' caches stay untouched.
  for (bool decode : {false, true}) {
    INFO((decode ? "decode" : "prefill"));
    auto ca = sa.make_cache(2, 8);
    if (decode) sa.prefill(x.view(), y.view(), ca);
    std::get<4>(ca) = std::get<4>(sb.make_cache(2, 8));
    poison(y1);
    if (decode)
      ATTNMIX_CHECK_ERROR(sa.decode(x1.view(), y1.view(), ca), "layer 4 (linear_causal)");
    else
      ATTNMIX_CHECK_ERROR(sa.prefill(x.view(), y.view(), ca), "layer 4 (linear_causal)");
    const index_t want = decode ? 5 : 0;
    CHECK(std::get<0>(ca).length(1) == want);
    CHECK(std::get<1>(ca).length(1) == want);
    CHECK(std::get<2>(ca).length(1) == want);
    CHECK(std::get<3>(ca).length(1) == want);
  }
  // A layer's cache of another capacity is foreign too.
  auto mixed = sa.make_cache(2, 8);
  std::get<2>(mixed) = std::get<2>(sa.make_cache(2, 4));
  ATTNMIX_CHECK_ERROR(sa.prefill(x.view(), y.view(), mixed), "layer 2 (causal_sa)");
  // Absurd sizes are attnmix::error, not a signed overflow.
  ATTNMIX_CHECK_ERROR((void)sa.make_cache(-1, 4), "argument 'sequences' must be >= 0");
  ATTNMIX_CHECK_ERROR((void)sa.make_cache(2, index_t{1} << 62), "argument 'capacity'");
}

TEST_CASE("a host stack rejects a mask tagged as device memory", "[stack][errors]") {
  const L::config c = stack_config();
  attnmix::stack<float, layer::sa, layer::gbla> s(c);
  host_tensor<float, 3> x({2, 5, 32}), y({2, 5, 32});
  host_tensor<std::uint8_t, 2> mask({2, 5}, 1);
  const attnmix::tensor_view<const std::uint8_t, 2> dm(mask.data(), {2, 5},
                                                       attnmix::memory_space::device);
  poison(y);
  ATTNMIX_CHECK_ERROR(s.forward(x.view(), y.view(), {dm, {}}),
                      "argument 'mask' is in device memory");
  CHECK(std::isnan(y.data()[0]));
}

// The same stack (including the test-only layer) on the serial backend: bit for bit the CPU's.
template <class Stack>
void check_on_serial(const attnmix::stack_inputs& in, index_t B, index_t T, std::uint64_t salt) {
  rng r(salt);
  INFO("seed " << test_seed() << " salt " << salt);
  const L::config c = stack_config();
  Stack s(c);
  L::randomize_parameters(s, test_seed() ^ salt, 0.15, 0.3);
  const attnmix::stack_on<Stack, test_backend::serial> ss(s);
  auto x = random_activations<double>(r, B, T, c.hidden_size);
  host_tensor<double, 3> want(x.shape()), got(x.shape());
  poison(got);
  s.forward(x.view(), want.view(), in);
  ss.forward(x.view(), got.view(), in, test_backend::serial{});
  CHECK(got.storage() == want.storage());
}

TEST_CASE("a third host backend runs stacks by specialising only the operations",
          "[stack][backend]") {
  using hybrid = attnmix::stack<double, layer::sa, layer::gbla, attnmix_test::gated_softmax,
                                layer::path_fox, layer::fox, layer::bla>;
  check_on_serial<hybrid>({}, 2, 13, 51);
  std::vector<std::int32_t> cu{0, 4, 4, 17};
  check_on_serial<hybrid>({{}, {cu.data(), {4}}}, 1, 17, 52);
  host_tensor<std::uint8_t, 2> mask({2, 9}, 1);
  mask(1, 0) = mask(1, 8) = 0;
  check_on_serial<hybrid>({mask.view(), {}}, 2, 9, 53);
  // And a causal stack's prefill and decoding there.
  using lm =
      attnmix::stack<double, layer::path_fox, layer::fox, layer::causal_sa, layer::linear_causal>;
  const L::config c = stack_config();
  lm s(c);
  L::randomize_parameters(s, test_seed() ^ 54, 0.15, 0.3);
  const attnmix::stack_on<lm, test_backend::serial> ss(s);
  rng r(54);
  auto x = random_activations<double>(r, 2, 6, c.hidden_size);
  host_tensor<double, 3> y0(x.shape()), y1(x.shape());
  auto c0 = s.make_cache(2, 8);
  auto c1 = ss.make_cache(2, 8);
  s.prefill(x.view(), y0.view(), c0);
  ss.prefill(x.view(), y1.view(), c1, {}, test_backend::serial{});
  CHECK(y1.storage() == y0.storage());
  host_tensor<double, 3> t({2, 1, c.hidden_size}, 0.25), o0({2, 1, c.hidden_size}),
      o1({2, 1, c.hidden_size});
  s.decode(t.view(), o0.view(), c0);
  ss.decode(t.view(), o1.view(), c1, test_backend::serial{});
  CHECK(o1.storage() == o0.storage());
}

}  // namespace
