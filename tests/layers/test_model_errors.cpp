// Bad input to the model tier (configs, building blocks, mixers, stacks, caches, saved training
// state): each of these once crashed, overflowed, read past a buffer or wrote before it failed.
// Every one must be an attnmix::error naming the function and the argument, with nothing
// written. CI runs this file under AddressSanitizer and UndefinedBehaviorSanitizer.

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "layers/layer_harness.hpp"
#include "support/errors.hpp"

namespace {

using namespace attnmix_test;
using attnmix::host_tensor;
namespace L = attnmix::layers;
namespace layer = attnmix::layer;

L::config small_config() {
  L::config c;
  c.hidden_size = 16;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.intermediate_size = 24;
  c.w_rank = 4;
  return c;
}

// Every mixer kind, every MLP and a stack reject `c` at construction, naming `arg`.
void expect_config_rejected(const L::config& c, const std::string& arg, const std::string& what) {
  INFO("config argument " << arg);
  const auto check = [&](const std::string& fn, auto&& make) {
    expect_error(fn, arg, what, [&] { make(); });
  };
  check("attnmix::layers::causal_sa", [&] { (void)layer::causal_sa::type<float>(c); });
  check("attnmix::layers::fox", [&] { (void)layer::fox::type<float>(c); });
  check("attnmix::layers::path", [&] { (void)layer::path::type<float>(c); });
  check("attnmix::layers::path_fox", [&] { (void)layer::path_fox::type<double>(c); });
  check("attnmix::layers::gbla", [&] { (void)layer::gbla::type<float>(c); });
  check("attnmix::layers::linear_causal", [&] { (void)layer::linear_causal::type<float>(c); });
  check("attnmix::layers::mlp", [&] { (void)L::mlp<float>(c); });
  check("attnmix::stack", [&] { (void)attnmix::stack<float, layer::sa, layer::path_fox>(c); });
}

TEST_CASE("a config is checked whole before any layer is built from it", "[layers][errors]") {
  struct bad {
    const char* arg;
    const char* what;
    void (*edit)(L::config&);
  };
  const bad cases[] = {
      {"config.num_heads", "must be >= 1 but is 0",
       [](L::config& c) {
         c.num_heads = 0;
       }},
      {"config.num_heads", "must be >= 1 but is -2",
       [](L::config& c) {
         c.num_heads = -2;
       }},
      {"config.hidden_size", "must be >= 1 but is -16",
       [](L::config& c) {
         c.hidden_size = -16;
       }},
      {"config.num_kv_heads", "must be >= 0",
       [](L::config& c) {
         c.num_kv_heads = -1;
       }},
      {"config.num_kv_heads", "must divide",
       [](L::config& c) {
         c.num_kv_heads = 3;
       }},
      {"config.head_dim", "must be >= 0",
       [](L::config& c) {
         c.head_dim = -8;
       }},
      {"config.head_dim", "resolves to 0",
       [](L::config& c) {
         c.head_dim = 0, c.hidden_size = 1;
       }},
      {"config.intermediate_size", "must be >= 0",
       [](L::config& c) {
         c.intermediate_size = -5;
       }},
      {"config.w_rank", "must be >= 1",
       [](L::config& c) {
         c.w_rank = 0;
       }},
      {"config.window", "must be >= 0",
       [](L::config& c) {
         c.window = -3;
       }},
      {"config.norm_eps", "finite and > 0",
       [](L::config& c) {
         c.norm_eps = -1e-6;
       }},
      {"config.head_norm_eps", "finite and > 0",
       [](L::config& c) {
         c.head_norm_eps = std::numeric_limits<double>::quiet_NaN();
       }},
      {"config.rope_theta", "finite and > 0",
       [](L::config& c) {
         c.rope_theta = std::numeric_limits<double>::infinity();
       }},
      {"config.scale", "must be finite",
       [](L::config& c) {
         c.scale = std::numeric_limits<double>::quiet_NaN();
       }},
      {"config.scale", "must be finite",
       [](L::config& c) {
         c.scale = -std::numeric_limits<double>::infinity();
       }},
      {"config.hidden_size", "too large to address",
       [](L::config& c) {
         c.hidden_size = std::numeric_limits<index_t>::max() / 4;
       }},
      {"config.hidden_size", "too large to address",
       [](L::config& c) {
         c.num_heads = index_t{1} << 40, c.num_kv_heads = 1;
       }},
  };
  for (const bad& b : cases) {
    L::config c = small_config();
    b.edit(c);
    expect_config_rejected(c, b.arg, b.what);
  }
}

TEST_CASE("building blocks reject negative sizes and bad constants", "[layers][errors]") {
  expect_error("attnmix::layers::parameter", "shape", "[3, -1]", [] {
    (void)L::parameter<float>({3, -1});
  });
  expect_error("attnmix::layers::parameter", "shape", "addressed", [] {
    (void)L::parameter<float>({index_t{1} << 40, index_t{1} << 40});
  });
  expect_error("attnmix::layers::parameter", "shape", "[-4, 8]",
               [] { (void)L::linear<float>(8, -4); });
  expect_error("attnmix::layers::rms_norm", "eps", "finite and > 0",
               [] { (void)L::rms_norm<float>(8, std::nan("")); });
  expect_error("attnmix::layers::head_rms_norm", "eps", "finite and > 0",
               [] { (void)L::head_rms_norm<float>(2, 8, true, -1.0); });
  expect_error("attnmix::layers::short_conv", "kernel", "must be >= 1",
               [] { (void)L::short_conv<float>(8, 0); });
}

// A layer's backward given the saved state of a forward over other tokens, of another layer, or
// of none: an error before dx or any gradient is written.
template <class Layer>
void check_saved_rejected(const std::string& name) {
  INFO("layer " << name);
  const L::config c = small_config();
  L::config other = c;
  other.num_kv_heads = 2;
  typename Layer::template type<float> m(c), m2(other);
  L::randomize_parameters(m, 7, 0.2, 0.3);
  L::randomize_parameters(m2, 7, 0.2, 0.3);
  host_tensor<float, 3> x({2, 9, 16}, 0.25f), y({2, 9, 16}), dy({2, 9, 16}, 1.0f), dx({2, 9, 16});
  host_tensor<float, 3> xs({2, 4, 16}, 0.25f), ys({2, 4, 16});
  typename Layer::template type<float>::saved_type fewer, foreign, none;
  m.forward(xs.view(), ys.view(), fewer);
  m2.forward(x.view(), y.view(), foreign);
  m.visit_parameters([](const std::string&, auto& p) { p.zero_grad(); });
  const std::string fn = "attnmix::layers::" + name + "::backward";
  poison(dx);
  expect_error(fn, "saved", "over 2 x 4 tokens",
               [&] { m.backward(x.view(), dy.view(), dx.view(), fewer); });
  expect_error(fn, "saved", "was saved by a layer of sizes",
               [&] { m.backward(x.view(), dy.view(), dx.view(), foreign); });
  expect_error(fn, "saved", "not filled by a training forward",
               [&] { m.backward(x.view(), dy.view(), dx.view(), none); });
  std::vector<std::int32_t> cu{0, 9, 18};
  host_tensor<float, 3> xp({1, 18, 16}, 0.25f), dyp({1, 18, 16}, 1.0f), dxp({1, 18, 16});
  typename Layer::template type<float>::saved_type dense;
  m.forward(x.view(), y.view(), dense);
  expect_error(fn, "saved", "this call has 1 x 18", [&] {
    m.backward(xp.view(), dyp.view(), dxp.view(), dense, {cu.data(), {3}});
  });
  CHECK(std::isnan(dx.data()[0]));
  bool untouched = true;
  m.visit_parameters([&](const std::string&, const auto& p) {
    for (auto g : p.grad) untouched = untouched && g == 0;
  });
  CHECK(untouched);
}

TEST_CASE("a mixer's backward checks that its saved state belongs to the call",
          "[layers][errors][backward]") {
  check_saved_rejected<layer::causal_sa>("causal_sa");
  check_saved_rejected<layer::fox>("fox");
  check_saved_rejected<layer::path_fox>("path_fox");
  check_saved_rejected<layer::gbla>("gbla");
  check_saved_rejected<layer::linear_causal>("linear_causal");
}

TEST_CASE("a stack's backward rejects the saved state of another stack",
          "[stack][errors][backward]") {
  using stack_t = attnmix::stack<float, layer::causal_sa, layer::path>;
  const L::config c = small_config();
  L::config other = c;
  other.num_kv_heads = 2;
  other.intermediate_size = 40;
  stack_t s(c), s2(other);
  L::randomize_parameters(s, 3, 0.2, 0.3);
  L::randomize_parameters(s2, 3, 0.2, 0.3);
  host_tensor<float, 3> x({2, 6, 16}, 0.5f), y({2, 6, 16}), dy({2, 6, 16}, 1.0f), dx({2, 6, 16});
  stack_t::saved_type foreign, none;
  s2.forward(x.view(), y.view(), foreign);
  poison(dx);
  expect_error("attnmix::stack::backward", "saved", "was saved by a stack of sizes",
               [&] { s.backward(dy.view(), dx.view(), foreign); });
  expect_error("attnmix::stack::backward", "saved", "not filled by a training forward",
               [&] { s.backward(dy.view(), dx.view(), none); });
  CHECK(std::isnan(dx.data()[0]));
}

// A mixer that fails inside its forward, as a front door deep in a layer can.
template <class T, class Backend = attnmix::backend::cpu>
class failing_mixer : public L::mixer_api<failing_mixer<T, Backend>, T, Backend> {
 public:
  static constexpr const char* name = "failing";
  static constexpr bool causal = false;
  struct cache_type {};
  struct saved_type {};
  explicit failing_mixer(const L::config& c) : D_(c.hidden_size) {}
  index_t hidden_size() const { return D_; }
  void forward_rows(const L::context<Backend>&, const T*, T*, saved_type* = nullptr) const {
    attnmix::detail::fail("failing_mixer", "x", "is rejected deep inside a layer");
  }
  void backward_rows(const L::context<Backend>&, const T*, const T*, T*, const saved_type&,
                     bool = false) {}
  template <class F>
  void visit_parameters(F&&, const std::string& = "") const {}
  template <class F>
  void visit_parameters(F&&, const std::string& = "") {}

 private:
  index_t D_ = 0;
};

TEST_CASE("a masked stack forward that fails in a layer leaves out as it was", "[stack][errors]") {
  using stack_t =
      attnmix::stack<float, layer::sa, layer::custom<attnmix::kind::softmax, failing_mixer>>;
  stack_t s(small_config());
  host_tensor<float, 3> x({2, 5, 16}, 0.5f), y({2, 5, 16});
  host_tensor<std::uint8_t, 2> mask({2, 5}, 1);
  mask(1, 0) = 0;
  poison(y);
  expect_error("failing_mixer", "x", "deep inside", [&] {
    s.forward(x.view(), y.view(), {mask.view(), {}});
  });
  bool untouched = true;
  for (index_t i = 0; i < y.size(); ++i) untouched = untouched && std::isnan(y.data()[i]);
  CHECK(untouched);
  stack_t::saved_type sv;
  expect_error("failing_mixer", "x", "deep inside", [&] {
    s.forward(x.view(), y.view(), sv, {mask.view(), {}});
  });
  for (index_t i = 0; i < y.size(); ++i) untouched = untouched && std::isnan(y.data()[i]);
  CHECK(untouched);
}

TEST_CASE("a moved-from cache is rejected, not dereferenced", "[layers][errors][decode]") {
  const L::config c = small_config();
  layer::fox::type<float> fox(c);
  layer::path::type<float> path(c);
  host_tensor<float, 3> x1({2, 1, 16}, 0.5f), y1({2, 1, 16});
  auto kv = fox.make_cache(2, 4);
  auto kv_moved = std::move(kv);
  expect_error("attnmix::layers::fox::decode", "cache", "was made for",
               [&] { fox.decode(x1.view(), y1.view(), kv); });
  CHECK(kv.sequences() == 0);
  fox.decode(x1.view(), y1.view(), kv_moved);
  CHECK(kv_moved.length(1) == 1);
  auto pc = path.make_cache(2, 4);
  auto pc_moved = std::move(pc);
  expect_error("attnmix::layers::path::decode", "cache", "",
               [&] { path.decode(x1.view(), y1.view(), pc); });
  path.decode(x1.view(), y1.view(), pc_moved);
  CHECK(pc_moved.length(1) == 1);
}

TEST_CASE("caches too large for the machine are an attnmix::error", "[layers][errors][cache]") {
  const L::config c = small_config();
  const index_t huge = index_t{1} << 48;
  const std::string memory = "bytes of this machine's memory";
  layer::fox::type<float> fox(c);
  layer::path_fox::type<float> path(c);
  layer::linear_causal::type<float> lin(c);
  expect_error("attnmix::layers::fox::make_cache", "capacity", memory,
               [&] { (void)fox.make_cache(2, huge); });
  expect_error("attnmix::layers::path_fox::make_cache", "capacity", memory,
               [&] { (void)path.make_cache(2, huge); });
  expect_error("attnmix::layers::linear_causal::make_cache", "capacity", memory,
               [&] { (void)lin.make_cache(huge, 1); });
  expect_error("attnmix::path_cache", "capacity", memory,
               [&] { (void)attnmix::path_cache<float>(2, huge, 2, 1, 8, 8); });
  expect_error("attnmix::layers::kv_cache", "capacity", memory,
               [&] { (void)L::kv_cache<float>(2, huge, 2, 1, 8); });
  expect_error("attnmix::layers::kv_cache", "q_heads", "multiple of kv_heads",
               [&] { (void)L::kv_cache<float>(2, 4, 3, 2, 8); });
  using lm = attnmix::stack<float, layer::path_fox, layer::causal_sa>;
  lm s(c);
  // The layer whose cache is made first names itself.
  ATTNMIX_CHECK_ERROR((void)s.make_cache(2, huge), "::make_cache: argument 'capacity' of");
}

}  // namespace
