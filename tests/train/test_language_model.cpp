// train::language_model: its loss's gradients against central finite differences in double,
// bad ids rejected before anything changes, and a short training run whose loss falls, resumed
// from a checkpoint bit for bit.

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "attnmix/io/safetensors.hpp"
#include "attnmix/train/language_model.hpp"
#include "attnmix/train/optimizer.hpp"
#include "attnmix/train/schedule.hpp"
#include "support/catch.hpp"
#include "support/testing.hpp"
#include "train/gradcheck.hpp"

using attnmix::index_t;
using ids = attnmix::tensor_view<const std::int32_t, 2>;

namespace {

attnmix::layers::config tiny_config(index_t D, index_t heads) {
  attnmix::layers::config c;
  c.hidden_size = D;
  c.num_heads = heads;
  c.intermediate_size = 2 * D;
  return c;
}

template <class Model>
void randomize(Model& m, std::uint64_t seed, double sigma) {
  attnmix_test::rng r(seed);
  m.visit_parameters([&](const std::string&, auto& p) {
    for (auto& x : p.data) x = (p.shape.size() == 1 ? 1.0 : 0.0) + sigma * r.normal();
  });
}

// Checks that `expr` throws attnmix::error whose message contains `text`.
#define CHECK_ERROR(expr, text)                  \
  do {                                           \
    std::string msg_ = "<no attnmix::error>";    \
    try {                                        \
      expr;                                      \
    } catch (const attnmix::error& e) {          \
      msg_ = e.what();                           \
    }                                            \
    INFO(msg_);                                  \
    CHECK(msg_.find(text) != std::string::npos); \
  } while (0)

}  // namespace

TEST_CASE("language_model: gradients of the loss match finite differences", "[train][lm]") {
  attnmix::train::language_model<
      attnmix::stack<double, attnmix::layer::causal_sa, attnmix::layer::fox>>
      lm(tiny_config(8, 2), 5);
  randomize(lm, 51, 0.4);
  // The weights change with the test seed; central differences of a loss through two blocks
  // and a softmax over the vocabulary reach ~2e-7 on some seeds, a wrong gradient O(1).
  const std::vector<std::int32_t> tok{0, 3, 1, 4, 2, 2, 1, 0, 4, 3},
      lab{3, 1, -100, 2, 2, 1, 0, 4, -100, 0};
  const ids t(tok.data(), {2, 5}), l(lab.data(), {2, 5});
  const double loss = lm.loss(t, l);
  CHECK(std::isfinite(loss));
  attnmix_test::check_parameter_grads(
      lm, [&] { return std::vector<double>{lm.loss(t, l, false)}; }, {1.0}, 1e-6);
}

TEST_CASE("language_model: ids outside the vocabulary are rejected, nothing changes",
          "[train][lm][errors]") {
  attnmix::train::language_model<attnmix::stack<float, attnmix::layer::fox>> lm(tiny_config(8, 2),
                                                                                5);
  attnmix::train::adamw<>::zero_grad(lm);
  std::vector<std::int32_t> tok{0, 1, 2, 3}, lab{1, 2, 3, -100};
  tok[2] = 5;
  CHECK_ERROR(lm.loss(ids(tok.data(), {1, 4}), ids(lab.data(), {1, 4})),
              "argument 'tokens' holds 5 at [0, 2], outside the vocabulary [0, 5)");
  tok[2] = 2, lab[1] = -1;
  CHECK_ERROR(lm.loss(ids(tok.data(), {1, 4}), ids(lab.data(), {1, 4})),
              "argument 'labels' holds -1 at [0, 1]");
  lab[1] = 2;
  CHECK_ERROR(lm.loss(ids(tok.data(), {1, 4}), ids(lab.data(), {2, 2})),
              "argument 'labels' has shape [2, 2] but must have the shape of 'tokens'");
  lm.visit_parameters([](const std::string&, const auto& p) {
    for (float g : p.grad) REQUIRE(g == 0.0f);
  });
}

namespace {

// Next-token data of the previous-token task: label t is token t - 1.
struct batch {
  std::vector<std::int32_t> tokens, labels;
};
batch previous_token_batch(attnmix_test::rng& r, index_t B, index_t T, index_t V) {
  batch b{std::vector<std::int32_t>(B * T), std::vector<std::int32_t>(B * T)};
  for (index_t i = 0; i < B * T; ++i) b.tokens[i] = std::int32_t(r.integer(0, V - 1));
  for (index_t i = 0; i < B * T; ++i)
    b.labels[i] = i % T == 0 ? attnmix::train::ignore_label : b.tokens[i - 1];
  return b;
}

using tiny_lm = attnmix::train::language_model<attnmix::stack<float, attnmix::layer::fox>>;

// Losses of steps [first, last) of a run (data and learning rate functions of the step).
std::vector<double> train_steps(tiny_lm& lm, attnmix::train::adamw<>& opt, int first, int last) {
  const index_t B = 8, T = 16, V = 8;
  const attnmix::train::warmup_cosine lr{20, 400, 1e-2, 1e-3};
  std::vector<double> losses;
  for (int step = first; step < last; ++step) {
    attnmix_test::rng r(1000 + step);
    const batch b = previous_token_batch(r, B, T, V);
    attnmix::train::adamw<>::zero_grad(lm);
    losses.push_back(lm.loss(ids(b.tokens.data(), {B, T}), ids(b.labels.data(), {B, T})));
    opt.step(lm, lr(opt.steps() + 1), attnmix::backend::cpu{1});
  }
  return losses;
}

}  // namespace

TEST_CASE("training: a tiny FoX model learns the previous token; a resumed run is the same",
          "[train][lm]") {
  attnmix::train::adamw_config cfg;
  cfg.clip_norm = 1.0;
  tiny_lm a(tiny_config(16, 2), 8), b(tiny_config(16, 2), 8);
  attnmix::layers::randomize_parameters(a, 7, 0.1);
  attnmix::layers::randomize_parameters(b, 7, 0.1);
  attnmix::train::adamw<> opt_a(cfg), opt_b(cfg);
  const std::vector<double> full = train_steps(a, opt_a, 0, 300);
  const double first = (full[0] + full[1] + full[2]) / 3,
               last = (full[297] + full[298] + full[299]) / 3;
  INFO("loss " << first << " -> " << last);
  CHECK(first > 1.8);  // about log 8
  CHECK(last < 0.3);

  const std::vector<double> part = train_steps(b, opt_b, 0, 200);
  const auto tmp = std::filesystem::temp_directory_path();
  const std::string stem = "attnmix_test_" + std::to_string(attnmix_test::test_seed());
  const std::string model_path = (tmp / (stem + "_lm.safetensors")).string();
  const std::string state_path = (tmp / (stem + "_lm_adamw.safetensors")).string();
  attnmix::io::save(b, model_path);
  attnmix::io::save(opt_b, state_path);
  tiny_lm c(tiny_config(16, 2), 8);
  attnmix::train::adamw<> opt_c(cfg);
  opt_c.init(c);
  attnmix::io::load(c, model_path);
  attnmix::io::load(opt_c, state_path);
  std::filesystem::remove(model_path);
  std::filesystem::remove(state_path);
  const std::vector<double> rest = train_steps(c, opt_c, 200, 300);
  for (int i = 0; i < 200; ++i) CHECK(part[i] == full[i]);
  for (int i = 0; i < 100; ++i) CHECK(rest[i] == full[200 + i]);
}
