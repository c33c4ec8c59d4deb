// train::language_model: its loss's gradients against central finite differences in double,
// bad ids, views and sizes rejected before anything changes, and a short training run whose loss
// falls, resumed from a checkpoint bit for bit.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "attnmix/io/safetensors.hpp"
#include "attnmix/train/language_model.hpp"
#include "attnmix/train/optimizer.hpp"
#include "attnmix/train/schedule.hpp"
#include "support/catch.hpp"
#include "support/errors.hpp"
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

TEST_CASE("language_model: the head in blocks of rows gives the loss and gradients of one block",
          "[train][lm]") {
  using lm_t = attnmix::train::language_model<attnmix::stack<double, attnmix::layer::causal_sa>>;
  lm_t lm(tiny_config(8, 2), 7);
  randomize(lm, 52, 0.4);
  const std::vector<std::int32_t> tok{0, 3, 1, 4, 2, 6, 1, 0, 4, 3, 5, 5},
      lab{3, 1, -100, 2, 2, 1, 0, 6, -100, 0, 4, 2};
  const ids t(tok.data(), {2, 6}), l(lab.data(), {2, 6});
  const auto grads = [&](index_t block, double& loss) {
    lm.logits_rows = block;
    attnmix::train::adamw<>::zero_grad(lm);
    loss = lm.loss(t, l);
    std::vector<double> g;
    lm.visit_parameters([&](const std::string&, const auto& p) {
      g.insert(g.end(), p.grad.begin(), p.grad.end());
    });
    return g;
  };
  double whole = 0;
  const std::vector<double> want = grads(12, whole);
  for (const index_t block : {1, 5, 11, 0, 100}) {
    INFO("logits_rows " << block);
    double loss = 0;
    const std::vector<double> got = grads(block, loss);
    CHECK(loss == Approx(whole).epsilon(1e-14));
    CHECK(attnmix_test::rel_error(got, want) < 1e-14);
  }
  lm.logits_rows = -1;
  CHECK_ERROR(lm.loss(t, l), "argument 'logits_rows' must be >= 0");
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

using fox_lm = attnmix::train::language_model<attnmix::stack<float, attnmix::layer::fox>>;
const std::string forward_fn = "attnmix::train::language_model::forward";
const std::string loss_fn = "attnmix::train::language_model::loss";

// Every parameter's values and gradients, flattened (to compare a model before and after).
template <class Model>
std::vector<double> state_of(Model& m) {
  std::vector<double> out;
  m.visit_parameters([&](const std::string&, auto& p) {
    out.insert(out.end(), p.data.begin(), p.data.end());
    out.insert(out.end(), p.grad.begin(), p.grad.end());
  });
  return out;
}

}  // namespace

TEST_CASE("language_model: strided ids are read through their strides", "[train][lm]") {
  fox_lm lm(tiny_config(8, 2), 5);
  attnmix::layers::randomize_parameters(lm, attnmix_test::test_seed(), 0.3);
  // T = 1, one token per row, rows two apart: the values between them (99) are no ids.
  const std::vector<std::int32_t> spaced{0, 99, 3, 99, 1, 99, 4}, packed{0, 3, 1, 4};
  std::vector<float> a(4 * 5, 0.f), b(4 * 5, 1.f);
  lm.forward(ids(spaced.data(), {4, 1}, {2, 1}), attnmix::view3<float>(a.data(), {4, 1, 5}));
  lm.forward(ids(packed.data(), {4, 1}), attnmix::view3<float>(b.data(), {4, 1, 5}));
  CHECK(attnmix_test::bitwise_equal(a, b));

  // B = 2, T = 3 in rows of 4 (one padding value each), tokens and labels; loss and gradients
  // are those of the packed batch.
  const std::vector<std::int32_t> tok_pad{0, 1, 2, 99, 3, 4, 0, 99},
      lab_pad{1, 2, -100, -7, 4, 0, 1, 1000}, tok{0, 1, 2, 3, 4, 0}, lab{1, 2, -100, 4, 0, 1};
  attnmix::train::adamw<>::zero_grad(lm);
  const double l_pad =
      lm.loss(ids(tok_pad.data(), {2, 3}, {4, 1}), ids(lab_pad.data(), {2, 3}, {4, 1}));
  const std::vector<double> s_pad = state_of(lm);
  attnmix::train::adamw<>::zero_grad(lm);
  const double l = lm.loss(ids(tok.data(), {2, 3}), ids(lab.data(), {2, 3}));
  CHECK(l_pad == l);
  CHECK(attnmix_test::bitwise_equal(s_pad, state_of(lm)));

  // An id out of range in a strided view is reported where the view has it.
  std::vector<std::int32_t> bad = spaced;
  bad[4] = 7;
  const std::vector<double> before = state_of(lm);
  attnmix_test::expect_error(forward_fn, "tokens", "holds 7 at [2, 0]", [&] {
    lm.forward(ids(bad.data(), {4, 1}, {2, 1}), attnmix::view3<float>(a.data(), {4, 1, 5}));
  });
  attnmix_test::expect_error(loss_fn, "labels", "holds 7 at [2, 0]", [&] {
    lm.loss(ids(spaced.data(), {4, 1}, {2, 1}), ids(bad.data(), {4, 1}, {2, 1}));
  });
  CHECK(attnmix_test::bitwise_equal(before, state_of(lm)));
}

TEST_CASE("language_model: logits must be contiguous and apart from tokens and weights",
          "[train][lm][errors]") {
  fox_lm lm(tiny_config(8, 2), 5);
  attnmix::layers::randomize_parameters(lm, attnmix_test::test_seed(), 0.3);
  const std::vector<std::int32_t> tok{0, 1, 2, 3, 4, 0};
  const ids t(tok.data(), {2, 3});
  std::vector<float> buf(64, 7.f);
  const auto untouched = [&] {
    for (float x : buf) REQUIRE(x == 7.f);
  };
  using v3 = attnmix::view3<float>;
  SECTION("zero row stride") {
    attnmix_test::expect_error(forward_fn, "logits", "contiguous", [&] {
      lm.forward(t, v3(buf.data(), {2, 3, 5}, {0, 5, 1}));
    });
  }
  SECTION("padded rows") {
    attnmix_test::expect_error(forward_fn, "logits", "contiguous", [&] {
      lm.forward(t, v3(buf.data(), {2, 3, 5}, {16, 5, 1}));
    });
  }
  SECTION("padded tokens") {
    attnmix_test::expect_error(forward_fn, "logits", "contiguous", [&] {
      lm.forward(t, v3(buf.data(), {2, 3, 5}, {18, 6, 1}));
    });
  }
  SECTION("tokens of one position") {
    attnmix_test::expect_error(forward_fn, "logits", "contiguous", [&] {
      lm.forward(t, v3(buf.data(), {2, 3, 5}, {5, 0, 1}));
    });
  }
  SECTION("logits over the tokens") {
    // Ids stored in the logits' memory, read before the logits would be written.
    std::memcpy(buf.data() + 40, tok.data(), tok.size() * sizeof(std::int32_t));
    const ids inside(reinterpret_cast<const std::int32_t*>(buf.data() + 40), {2, 3});
    const std::vector<float> saved = buf;
    attnmix_test::expect_error(forward_fn, "logits", "overlaps", [&] {
      lm.forward(inside, v3(buf.data() + 20, {2, 3, 5}));
    });
    CHECK(attnmix_test::bitwise_equal(buf, saved));
    return;
  }
  SECTION("logits over a weight") {
    const std::vector<double> before = state_of(lm);
    attnmix_test::expect_error(forward_fn, "logits", "lm_head.weight", [&] {
      lm.forward(ids(tok.data(), {1, 1}), v3(lm.lm_head.weight.data.data(), {1, 1, 5}));
    });
    CHECK(attnmix_test::bitwise_equal(before, state_of(lm)));
  }
  SECTION("an absent view") {
    attnmix_test::expect_error(forward_fn, "logits", "not given", [&] { lm.forward(t, v3()); });
  }
  untouched();
}

TEST_CASE("language_model: replaced members that disagree are rejected", "[train][lm][errors]") {
  fox_lm lm(tiny_config(8, 2), 5);
  const std::vector<std::int32_t> tok{0, 1, 2};
  std::vector<float> out(15, 7.f);
  const auto run = [&] {
    lm.forward(ids(tok.data(), {1, 3}), attnmix::view3<float>(out.data(), {1, 3, 5}));
  };
  lm.lm_head = attnmix::layers::linear<float>(8, 6);
  attnmix_test::expect_error(forward_fn, "lm_head", "must be [vocab, hidden_size] = [5, 8]", run);
  lm.lm_head = attnmix::layers::linear<float>(8, 5);
  lm.embeddings = attnmix::layers::embedding<float>(5, 4);
  attnmix_test::expect_error(loss_fn, "embeddings", "has a table of shape [5, 4]", [&] {
    lm.loss(ids(tok.data(), {1, 3}), ids(tok.data(), {1, 3}));
  });
  for (float x : out) CHECK(x == 7.f);
}

TEST_CASE("language_model: an empty batch writes nothing and costs nothing", "[train][lm]") {
  fox_lm lm(tiny_config(8, 2), 5);
  const std::vector<std::int32_t> tok{0};
  std::vector<float> buf(5, 7.f);
  lm.forward(ids(tok.data(), {0, 3}), attnmix::view3<float>(buf.data(), {0, 3, 5}));
  lm.forward(ids(tok.data(), {2, 0}), attnmix::view3<float>(buf.data(), {2, 0, 5}));
  CHECK(lm.loss(ids(tok.data(), {0, 3}), ids(tok.data(), {0, 3})) == 0.0);
  for (float x : buf) CHECK(x == 7.f);
}

TEST_CASE("language_model: labels and tokens are checked against each other and the vocabulary",
          "[train][lm][errors]") {
  fox_lm lm(tiny_config(8, 2), 5);
  attnmix::layers::randomize_parameters(lm, attnmix_test::test_seed(), 0.3);
  attnmix::train::adamw<>::zero_grad(lm);
  const std::vector<double> before = state_of(lm);
  std::vector<std::int32_t> tok{0, 1, 2, 3}, lab{1, 2, 3, attnmix::train::ignore_label};
  const auto loss = [&](ids t, ids l) {
    return [&lm, t, l] {
      lm.loss(t, l);
    };
  };
  lab[3] = 5;
  attnmix_test::expect_error(loss_fn, "labels", "holds 5 at [0, 3]",
                             loss(ids(tok.data(), {1, 4}), ids(lab.data(), {1, 4})));
  lab[3] = attnmix::train::ignore_label;
  // ignore_label is a label, not a token.
  tok[1] = attnmix::train::ignore_label;
  attnmix_test::expect_error(loss_fn, "tokens", "holds -100 at [0, 1]",
                             loss(ids(tok.data(), {1, 4}), ids(lab.data(), {1, 4})));
  attnmix_test::expect_error(forward_fn, "tokens", "holds -100 at [0, 1]", [&] {
    std::vector<float> out(20);
    lm.forward(ids(tok.data(), {1, 4}), attnmix::view3<float>(out.data(), {1, 4, 5}));
  });
  tok[1] = 1;
  // A shape mismatch is reported as one, whatever the labels hold.
  lab[0] = -1;
  attnmix_test::expect_error(loss_fn, "labels", "has shape [4, 1]",
                             loss(ids(tok.data(), {1, 4}), ids(lab.data(), {4, 1})));
  attnmix_test::expect_error(loss_fn, "labels", "not given", loss(ids(tok.data(), {1, 4}), ids()));
  attnmix_test::expect_error(loss_fn, "tokens", "negative stride",
                             loss(ids(tok.data() + 3, {1, 4}, {4, -1}), ids(lab.data(), {1, 4})));
  CHECK(attnmix_test::bitwise_equal(before, state_of(lm)));
  // Every label ignored: a loss of 0 and no gradient.
  const std::vector<std::int32_t> none(4, attnmix::train::ignore_label);
  CHECK(lm.loss(ids(tok.data(), {1, 4}), ids(none.data(), {1, 4})) == 0.0);
  CHECK(attnmix_test::bitwise_equal(before, state_of(lm)));
}

TEST_CASE("language_model: a bad vocabulary size is an attnmix::error before any member is built",
          "[train][lm][errors]") {
  const std::string fn = "attnmix::train::language_model";
  for (const index_t v : {index_t{0}, index_t{-1}, -(index_t{1} << 40)})
    attnmix_test::expect_error(fn, "vocab", "must be >= 1",
                               [&] { fox_lm lm(tiny_config(8, 2), v); });
  // A table of vocab x hidden_size values that cannot be addressed.
  attnmix_test::expect_error(fn, "vocab", "too large", [] {
    fox_lm lm(tiny_config(8, 2), std::numeric_limits<index_t>::max() / 4);
  });
  // The model's own argument first, then the stack's config.
  attnmix::layers::config bad = tiny_config(8, 2);
  bad.hidden_size = 0;
  attnmix_test::expect_error(fn, "vocab", "must be >= 1", [&] { fox_lm lm(bad, -1); });
  CHECK_THROWS_AS(fox_lm(bad, 5), attnmix::error);
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

TEST_CASE("language_model: greedy generation continues as the full forward would",
          "[train][lm][generate]") {
  using stack_t = attnmix::stack<double, attnmix::layer::path_fox, attnmix::layer::causal_sa,
                                 attnmix::layer::linear_causal>;
  attnmix::layers::config c = tiny_config(16, 2);
  attnmix::train::language_model<stack_t> lm(c, 11);
  randomize(lm, attnmix_test::test_seed() ^ 77, 0.5);
  const index_t N = 3, P = 4, steps = 9, V = 11;
  attnmix_test::rng r(78);
  std::vector<std::int32_t> prompt(std::size_t(N * 2 * P), 0);  // row stride 2P: strided prompts
  for (index_t n = 0; n < N; ++n)
    for (index_t t = 0; t < P; ++t)
      prompt[std::size_t(n * 2 * P + t)] = std::int32_t(r.uniform(0, double(V) - 1e-9));
  const attnmix::tensor_view<const std::int32_t, 2> pv(prompt.data(), {N, P}, {2 * P, 1});
  const attnmix::host_tensor<std::int32_t, 2> out = lm.generate(pv, steps);
  REQUIRE(out.extent(0) == N);
  REQUIRE(out.extent(1) == steps);
  // Each new token is the argmax of the full forward's logits over the prompt and the tokens
  // generated before it (up to rounding between the cached and the full computation).
  for (index_t t = 0; t < steps; ++t) {
    const index_t len = P + t;
    std::vector<std::int32_t> seq(std::size_t(N * len));
    for (index_t n = 0; n < N; ++n)
      for (index_t i = 0; i < len; ++i)
        seq[std::size_t(n * len + i)] = i < P ? prompt[std::size_t(n * 2 * P + i)] : out(n, i - P);
    attnmix::host_tensor<double, 3> logits({N, len, V});
    lm.forward(ids(seq.data(), {N, len}), logits.view());
    for (index_t n = 0; n < N; ++n) {
      double best = logits(n, len - 1, 0);
      for (index_t v = 1; v < V; ++v) best = std::max(best, logits(n, len - 1, v));
      INFO("sequence " << n << " step " << t << " token " << out(n, t));
      CHECK(logits(n, len - 1, out(n, t)) >= best - 1e-9);
    }
  }
  // Bad arguments are errors before anything runs; zero steps give an empty result.
  CHECK(lm.generate(pv, 0).extent(1) == 0);
  CHECK_ERROR((void)lm.generate(pv, -1), "argument 'steps' must be >= 0");
  CHECK_ERROR((void)lm.generate(ids(prompt.data(), {N, 0}), 3), "each prompt needs a token");
  prompt[1] = std::int32_t(V);
  CHECK_ERROR((void)lm.generate(pv, 3), "argument 'prompts' holds 11 at [0, 1]");
}

TEST_CASE("language_model: generation from packed prompts of several lengths",
          "[train][lm][generate]") {
  using stack_t = attnmix::stack<double, attnmix::layer::fox, attnmix::layer::path>;
  attnmix::train::language_model<stack_t> lm(tiny_config(16, 2), 13);
  randomize(lm, attnmix_test::test_seed() ^ 79, 0.5);
  const std::vector<std::int32_t> packed{3, 1, 4, 1, 5, 9, 2, 6}, cu{0, 2, 7, 8};
  const index_t steps = 6, V = 13;
  const auto out = lm.generate(ids(packed.data(), {1, 8}), {cu.data(), {4}}, steps);
  REQUIRE(out.extent(0) == 3);
  for (index_t n = 0; n < 3; ++n) {
    // The prompt alone, then each generated token: the argmax of the forward at its position.
    std::vector<std::int32_t> seq(packed.begin() + cu[n], packed.begin() + cu[n + 1]);
    for (index_t t = 0; t < steps; ++t) {
      const index_t len = index_t(seq.size());
      attnmix::host_tensor<double, 3> logits({1, len, V});
      lm.forward(ids(seq.data(), {1, len}), logits.view());
      double best = logits(0, len - 1, 0);
      for (index_t v = 1; v < V; ++v) best = std::max(best, logits(0, len - 1, v));
      INFO("sequence " << n << " step " << t);
      CHECK(logits(0, len - 1, out(n, t)) >= best - 1e-9);
      seq.push_back(out(n, t));
    }
  }
  const std::vector<std::int32_t> empty{0, 2, 2, 8};
  CHECK_ERROR((void)lm.generate(ids(packed.data(), {1, 8}), {empty.data(), {4}}, 2),
              "has a prompt of 0 tokens (sequence 1)");
  const std::vector<std::int32_t> bad{0, 2, 9};
  CHECK_ERROR((void)lm.generate(ids(packed.data(), {1, 8}), {bad.data(), {3}}, 2), "cu_seqlens");
}
