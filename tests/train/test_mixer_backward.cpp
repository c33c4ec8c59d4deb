// The backward of the mixer layers against central finite differences of their forwards in
// double: the input's gradient and every parameter's, over a packed batch with an empty and a
// length-1 sequence, GQA, and every option of the layer.

#include <cstdint>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "reference/finite_difference.hpp"
#include "support/catch.hpp"
#include "support/testing.hpp"
#include "train/gradcheck.hpp"

using attnmix::index_t;
using vec = std::vector<double>;
namespace L = attnmix::layers;

namespace {

struct sa_every_option : L::causal_sa_layer_policy {
  static constexpr bool rope = true, qk_norm = true, output_gate = true, qkv_bias = true;
  static constexpr const char* name = "sa_every_option";
};
struct bidirectional_sa_gated : L::sa_layer_policy {
  static constexpr bool output_gate = true;
};
struct fox_every_option : L::fox_layer_policy {
  static constexpr bool qk_norm = true, output_gate = true, qkv_bias = true;
};
struct path_fox_qk_norm : L::path_fox_layer_policy {
  static constexpr bool qk_norm = true;
};
struct path_without_conv : L::path_layer_policy {
  static constexpr bool w_shortconv = false;
};
// GBLA with a per-head key gate, per-head norm weights and the sigmoid-gated norm.
struct gbla_variant_core : attnmix::gbla_policy {
  static constexpr auto gate = attnmix::key_gate::per_head;
  static constexpr auto weight = attnmix::norm_weight::per_head;
  static constexpr auto activation = attnmix::gate_activation::sigmoid;
};
struct gbla_variant : L::gbla_layer_policy {
  using core = gbla_variant_core;
  static constexpr const char* name = "gbla_variant";
};
struct causal_gated : L::linear_causal_layer_policy {
  using core = attnmix::with_key_gate<attnmix::linear_causal_policy, attnmix::key_gate::shared>;
  static constexpr bool use_conv = true;
  static constexpr const char* name = "causal_gated";
};

L::config small_config(index_t window = 0) {
  L::config c;
  c.hidden_size = 8;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 3;
  c.window = window;
  c.rope_theta = 100.0;
  return c;
}

template <class Layer>
void check_mixer(Layer& layer, std::uint64_t salt) {
  attnmix_test::rng r(salt);
  INFO("seed " << attnmix_test::test_seed() << " layer " << Layer::name);
  layer.visit_parameters([&](const std::string&, auto& p) {
    for (auto& x : p.data) x = 0.4 * r.normal();
  });
  const std::vector<std::int32_t> cu{0, 5, 5, 6, 13};
  const attnmix::view1<const std::int32_t> cuv(cu.data(), {5});
  const index_t rows = 13, D = layer.hidden_size();
  vec x(rows * D), w(rows * D);
  for (auto& v : x) v = r.normal();
  for (auto& v : w) v = r.normal();
  auto forward = [&](const vec& xx) {
    vec y(rows * D);
    layer.forward(attnmix::view3<const double>(xx.data(), {1, rows, D}),
                  attnmix::view3<double>(y.data(), {1, rows, D}), cuv);
    return y;
  };
  typename Layer::saved_type saved;
  vec y(rows * D), dx(rows * D, 42.0);
  layer.forward(attnmix::view3<const double>(x.data(), {1, rows, D}),
                attnmix::view3<double>(y.data(), {1, rows, D}), saved, cuv);
  CHECK(attnmix_test::bitwise_equal(y, forward(x)));  // saving changes nothing
  layer.backward(attnmix::view3<const double>(x.data(), {1, rows, D}),
                 attnmix::view3<const double>(w.data(), {1, rows, D}),
                 attnmix::view3<double>(dx.data(), {1, rows, D}), saved, cuv);
  const vec fd = attnmix_ref::finite_difference(
      [&](const vec& v) { return attnmix_ref::dot(w, forward(v)); }, x);
  // Relative 1e-7, less the stencil's own rounding (see rounding_floor).
  CHECK(attnmix_ref::close_to(dx, fd, 1e-7, attnmix_ref::rounding_floor(w, forward(x), x.size())));
  attnmix_test::check_parameter_grads(
      layer, [&] { return forward(x); }, w, 1e-7);
}

}  // namespace

TEST_CASE("softmax and FoX mixers: backward matches finite differences",
          "[train][layers][backward]") {
  L::attention_layer<double, sa_every_option> sa(small_config());
  check_mixer(sa, 31);
  L::attention_layer<double, bidirectional_sa_gated> bsa(small_config(3));
  check_mixer(bsa, 32);
  L::attention_layer<double, fox_every_option> fox(small_config());
  check_mixer(fox, 33);
  L::attention_layer<double, L::fox_layer_policy> fox_window(small_config(2));
  check_mixer(fox_window, 34);
}

TEST_CASE("PaTH and PaTH-FoX mixers: backward matches finite differences",
          "[train][layers][backward]") {
  L::config mha = small_config();
  mha.num_kv_heads = 4;
  mha.w_rank = 3;  // MHA: the low-rank w projection
  L::path_layer<double, L::path_layer_policy> path(mha);
  check_mixer(path, 35);
  L::path_layer<double, L::path_fox_layer_policy> path_fox(mha);
  check_mixer(path_fox, 36);
  L::path_layer<double, path_fox_qk_norm> gqa(small_config());  // GQA: the full w projection
  check_mixer(gqa, 37);
  L::path_layer<double, path_without_conv> plain(small_config());
  check_mixer(plain, 38);
}

TEST_CASE("BLA, GBLA and causal linear-attention mixers: backward matches finite differences",
          "[train][layers][backward]") {
  L::linear_layer<double, L::gbla_layer_policy> gbla(small_config());
  check_mixer(gbla, 39);
  L::linear_layer<double, L::bla_layer_policy> bla(small_config());
  check_mixer(bla, 40);
  L::linear_layer<double, gbla_variant> variant(small_config());
  check_mixer(variant, 41);
  L::linear_layer<double, L::linear_causal_layer_policy> causal(small_config());
  check_mixer(causal, 42);
  L::linear_layer<double, causal_gated> gated(small_config());
  check_mixer(gated, 43);
}
