// The training pieces: softmax cross-entropy against finite differences, AdamW against the
// formula written out, gradient clipping, the schedules, a checkpoint of the optimiser that
// resumes bit for bit, and the settings and states they reject.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "attnmix/io/safetensors.hpp"
#include "attnmix/train/optimizer.hpp"
#include "attnmix/train/progress.hpp"
#include "attnmix/train/schedule.hpp"
#include "reference/finite_difference.hpp"
#include "support/catch.hpp"
#include "support/errors.hpp"
#include "support/testing.hpp"

using attnmix::index_t;
using vec = std::vector<double>;

namespace {

using O = attnmix::layers::ops<attnmix::backend::cpu>;

struct call {
  attnmix::backend::cpu be{2};
  attnmix::layers::token_layout L;
  O::handles h{};
  attnmix::layers::context<attnmix::backend::cpu> c() const { return {be, L, nullptr, h}; }
};

// A model of two parameters: a [3, 4] weight and a [3] bias.
struct toy {
  attnmix::layers::parameter<double> w{{3, 4}}, b{{3}};
  template <class F>
  void visit_parameters(F&& f) {
    f("w", w), f("b", b);
  }
  template <class F>
  void visit_parameters(F&& f) const {
    f("w", w), f("b", b);
  }
};

// Deterministic gradients of step t.
void set_grads(toy& m, int t) {
  m.w.zero_grad(), m.b.zero_grad();
  for (std::size_t i = 0; i < m.w.grad.size(); ++i) m.w.grad[i] = std::sin(0.7 * double(i) + t);
  for (std::size_t i = 0; i < m.b.grad.size(); ++i) m.b.grad[i] = 3 * std::cos(1.3 * double(i) * t);
}

// Another model: one [3, 5] weight.
struct other {
  attnmix::layers::parameter<double> w{{3, 5}};
  template <class F>
  void visit_parameters(F&& f) {
    f("w", w);
  }
};

// Mixed precision: a bfloat16 weight and a float bias; and float models of the same names.
struct mixed_toy {
  attnmix::layers::parameter<attnmix::bfloat16> w{{2, 3}};
  attnmix::layers::parameter<float> b{{2}};
  template <class F>
  void visit_parameters(F&& f) {
    f("w", w), f("b", b);
  }
};
struct float_toy {
  attnmix::layers::parameter<float> w{{2, 3}}, b{{2}};
  template <class F>
  void visit_parameters(F&& f) {
    f("w", w), f("b", b);
  }
  template <class F>
  void visit_parameters(F&& f) const {
    f("w", w), f("b", b);
  }
};

}  // namespace

TEST_CASE("cross_entropy: loss and gradient of the logits", "[train]") {
  attnmix_test::rng r(11);
  INFO("seed " << attnmix_test::test_seed());
  const index_t rows = 300, V = 7;  // more rows than one block
  call k{{2}, {1, rows, {}}};
  vec z(rows * V);
  for (auto& x : z) x = 4 * r.normal();
  std::vector<std::int32_t> y(rows);
  for (index_t i = 0; i < rows; ++i) y[i] = i % 5 == 0 ? -100 : std::int32_t(r.integer(0, V - 1));
  vec dz(rows * V, 7.0);
  // The summed loss is added to a total.
  const auto summed = [&](const call& on, const vec& x, double* dx, double scale) {
    double total = 0;
    O::cross_entropy(on.c(), x.data(), V, rows, V, y.data(), -100, dx, V, scale, &total);
    return total;
  };
  const double loss = summed(k, z, dz.data(), 0.5);
  double added = 1.5;
  O::cross_entropy(k.c(), z.data(), V, rows, V, y.data(), -100, static_cast<double*>(nullptr), V,
                   0.5, &added);
  CHECK(added == 1.5 + loss);
  double expect = 0;
  for (index_t i = 0; i < rows; ++i) {
    if (y[i] < 0) continue;
    double l = 0;
    for (index_t c = 0; c < V; ++c) l += std::exp(z[i * V + c]);
    expect += std::log(l) - z[i * V + y[i]];
  }
  CHECK(loss == Approx(expect).epsilon(1e-13));
  const vec fd = attnmix_ref::finite_difference(
      [&](const vec& x) { return 0.5 * summed(k, x, nullptr, 1.0); }, z);
  CHECK(attnmix_ref::relative_error(dz, fd) < 1e-7);    // FD rounding: |loss| ~ 1e3
  for (index_t c = 0; c < V; ++c) CHECK(dz[c] == 0.0);  // row 0 is ignored
  call one{{1}, {1, rows, {}}};
  CHECK(summed(one, z, nullptr, 1.0) == loss);
}

TEST_CASE("adamw: the formula, decay of matrices only, and clipping", "[train]") {
  toy m;
  for (std::size_t i = 0; i < m.w.data.size(); ++i) m.w.data[i] = 0.1 * double(i) - 0.5;
  for (std::size_t i = 0; i < m.b.data.size(); ++i) m.b.data[i] = 0.3 * double(i);
  toy ref = m;
  attnmix::train::adamw_config cfg;
  cfg.beta1 = 0.8, cfg.beta2 = 0.95, cfg.eps = 1e-6, cfg.weight_decay = 0.1, cfg.clip_norm = 2.0;
  attnmix::train::adamw<> opt(cfg);
  vec mw(12, 0), vw(12, 0), mb(3, 0), vb(3, 0);
  for (int t = 1; t <= 4; ++t) {
    const double lr = 0.01 * t;
    set_grads(m, t);
    set_grads(ref, t);
    const double norm = opt.step(m, lr);
    double ss = 0;
    for (double g : ref.w.grad) ss += g * g;
    for (double g : ref.b.grad) ss += g * g;
    CHECK(norm == Approx(std::sqrt(ss)).epsilon(1e-14));
    const double f = std::sqrt(ss) > 2.0 ? 2.0 / (std::sqrt(ss) + 1e-6) : 1.0;
    auto update = [&](std::vector<double>& p, const std::vector<double>& g, vec& mm, vec& vv,
                      double wd) {
      for (std::size_t i = 0; i < p.size(); ++i) {
        const double gi = g[i] * f;
        mm[i] = 0.8 * mm[i] + 0.2 * gi;
        vv[i] = 0.95 * vv[i] + 0.05 * gi * gi;
        p[i] *= 1 - lr * wd;
        p[i] -= lr * (mm[i] / (1 - std::pow(0.8, t))) /
                (std::sqrt(vv[i] / (1 - std::pow(0.95, t))) + 1e-6);
      }
    };
    update(ref.w.data, ref.w.grad, mw, vw, 0.1);
    update(ref.b.data, ref.b.grad, mb, vb, 0.0);
    for (std::size_t i = 0; i < 12; ++i) CHECK(m.w.data[i] == Approx(ref.w.data[i]).epsilon(1e-14));
    for (std::size_t i = 0; i < 3; ++i) CHECK(m.b.data[i] == Approx(ref.b.data[i]).epsilon(1e-14));
  }
  CHECK(opt.steps() == 4);
}

// Mixed precision: a bfloat16 weight and a float bias. The weight's float master takes every
// update (also those below the bfloat16 spacing) and is rounded into the weight after each step;
// the float bias has no master. master_weights(model) shows the model with the masters in place
// of its 16-bit weights, to move them in and out by name.
TEST_CASE("adamw: float master weights of 16-bit parameters", "[train]") {
  using bf16 = attnmix::bfloat16;
  mixed_toy m;
  for (std::size_t i = 0; i < 6; ++i) m.w.data[i] = bf16(1.0f + 0.25f * float(i));
  attnmix::train::adamw_config cfg;
  cfg.weight_decay = 0;
  attnmix::train::adamw<> opt(cfg);
  opt.init(m);
  std::vector<std::string> names;
  std::vector<double> master;
  const auto master_of_w = [&] {
    opt.master_weights(m).visit_parameters([&](const std::string& name, const auto& p) {
      if (name == "w") p.get_values(master);
    });
  };
  opt.master_weights(m).visit_parameters([&](const std::string& name, const auto& p) {
    names.push_back(name);
    CHECK(std::is_same_v<typename std::decay_t<decltype(p.data)>::value_type, float>);
  });
  REQUIRE(names == std::vector<std::string>{"w", "b"});
  master_of_w();
  for (std::size_t i = 0; i < 6; ++i) CHECK(master[i] == 1.0 + 0.25 * double(i));

  // Steps of 1e-3 each (Adam's first steps move by lr): far below the bfloat16 spacing at 1
  // (2^-7), so the weight stays while the master moves; after 40 steps the weight is the master
  // rounded.
  const auto step = [&] {
    m.w.zero_grad(), m.b.zero_grad();
    for (auto& g : m.w.grad) g = 1.0f;
    for (auto& g : m.b.grad) g = -1.0f;
    opt.step(m, 1e-3);
  };
  step();
  CHECK(float(m.w.data[0]) == 1.0f);
  CHECK(m.b.data[0] == Approx(1e-3).epsilon(1e-5));
  for (int t = 1; t < 40; ++t) step();
  master_of_w();
  for (std::size_t i = 0; i < 6; ++i) {
    INFO("i = " << i);
    CHECK(master[i] == Approx(1.0 + 0.25 * double(i) - 0.04).epsilon(1e-4));
    CHECK(float(m.w.data[i]) == float(bf16(float(master[i]))));
  }
  CHECK(float(m.w.data[0]) != 1.0f);

  // The masters and the bias into a float model (a float checkpoint), and back from one.
  float_toy f;
  attnmix::layers::transfer_parameters(opt.master_weights(m), f);
  for (std::size_t i = 0; i < 6; ++i) CHECK(double(f.w.data[i]) == master[i]);
  CHECK(f.b.data[0] == m.b.data[0]);
  for (std::size_t i = 0; i < 6; ++i) f.w.data[i] = 0.5f + 1e-4f * float(i);
  f.b.data[1] = 7.0f;
  auto view = opt.master_weights(m);
  attnmix::layers::transfer_parameters(f, view);
  master_of_w();
  for (std::size_t i = 0; i < 6; ++i) CHECK(master[i] == double(f.w.data[i]));
  CHECK(m.b.data[1] == 7.0f);

  // A state made for the float model is refused for the mixed one (no master).
  attnmix::train::adamw<> plain(cfg);
  float_toy af;
  plain.init(af);
  CHECK_THROWS_AS(plain.step(m, 1e-3), attnmix::error);
  auto plain_view = plain.master_weights(m);
  CHECK_THROWS_AS(attnmix::layers::transfer_parameters(f, plain_view), attnmix::error);
}

TEST_CASE("adamw: a checkpoint of weights and state resumes bit for bit", "[train]") {
  toy a;
  for (std::size_t i = 0; i < a.w.data.size(); ++i) a.w.data[i] = std::cos(double(i));
  toy b = a;
  attnmix::train::adamw<> full, first;
  for (int t = 1; t <= 6; ++t) set_grads(a, t), full.step(a, 1e-2);
  for (int t = 1; t <= 3; ++t) set_grads(b, t), first.step(b, 1e-2);
  const auto tmp = std::filesystem::temp_directory_path();
  const std::string stem = "attnmix_test_" + std::to_string(attnmix_test::test_seed());
  const std::string model_path = (tmp / (stem + "_model.safetensors")).string();
  const std::string state_path = (tmp / (stem + "_adamw.safetensors")).string();
  attnmix::io::save(b, model_path);
  attnmix::io::save(first, state_path);

  toy c;
  attnmix::train::adamw<> resumed;
  resumed.init(c);
  attnmix::io::load(c, model_path);
  attnmix::io::load(resumed, state_path);
  std::filesystem::remove(model_path);
  std::filesystem::remove(state_path);
  CHECK(resumed.steps() == 3);
  for (int t = 4; t <= 6; ++t) set_grads(c, t), resumed.step(c, 1e-2);
  CHECK(attnmix_test::bitwise_equal(c.w.data, a.w.data));
  CHECK(attnmix_test::bitwise_equal(c.b.data, a.b.data));
}

TEST_CASE("adamw: a state made for another model is rejected before any change", "[train]") {
  toy a;
  attnmix::train::adamw<> opt;
  set_grads(a, 1);
  opt.step(a, 1e-2);
  other o;
  o.w.zero_grad();
  const auto before = o.w.data;
  CHECK_THROWS_AS(opt.step(o, 1e-2), attnmix::error);
  CHECK(attnmix_test::bitwise_equal(o.w.data, before));
  CHECK(opt.steps() == 1);
}

TEST_CASE("schedules: warm-up and cosine", "[train]") {
  const attnmix::train::warmup_cosine s{10, 110, 1.0, 0.1};
  CHECK(s(0) == 0.0);
  CHECK(s(5) == Approx(0.5));
  CHECK(s(10) == Approx(1.0));
  CHECK(s(60) == Approx(0.55));
  CHECK(s(110) == Approx(0.1));
  CHECK(s(500) == Approx(0.1));
  for (index_t t = 11; t < 110; ++t) CHECK(s(t) <= s(t - 1));
  const attnmix::train::constant_rate c{0.2, 4};
  CHECK(c(2) == Approx(0.1));
  CHECK(c(9) == Approx(0.2));
}

namespace {

// Weights, gradients and optimiser state, flattened (to compare before and after a call).
std::vector<double> snapshot(const toy& m, const attnmix::train::adamw<>& opt) {
  std::vector<double> out;
  for (const auto* p : {&m.w, &m.b}) {
    out.insert(out.end(), p->data.begin(), p->data.end());
    out.insert(out.end(), p->grad.begin(), p->grad.end());
  }
  opt.visit_parameters([&](const std::string&, const auto& p) {
    out.insert(out.end(), p.data.begin(), p.data.end());
  });
  return out;
}

const double not_a_number = std::numeric_limits<double>::quiet_NaN();
const double infinity = std::numeric_limits<double>::infinity();

}  // namespace

TEST_CASE("adamw: settings PyTorch rejects, NaN and inf are attnmix::errors", "[train][errors]") {
  using cfg_t = attnmix::train::adamw_config;
  const std::string fn = "attnmix::train::adamw";
  const auto with = [](double cfg_t::*field, double value) {
    cfg_t c;
    c.*field = value;
    return c;
  };
  struct field_case {
    const char* name;
    double cfg_t::*field;
    std::vector<double> bad;
  };
  const field_case cases[] = {
      {"config.beta1", &cfg_t::beta1, {-0.1, 1.0, 1.5, not_a_number, infinity}},
      {"config.beta2", &cfg_t::beta2, {-0.1, 1.0, 1.5, not_a_number, -infinity}},
      {"config.eps", &cfg_t::eps, {-1e-8, not_a_number, infinity}},
      {"config.weight_decay", &cfg_t::weight_decay, {-0.01, not_a_number, infinity}},
      {"config.clip_norm", &cfg_t::clip_norm, {-1.0, not_a_number, infinity}},
  };
  for (const auto& c : cases)
    for (double v : c.bad) {
      INFO(c.name << " = " << v);
      attnmix_test::expect_error(fn, c.name, "must be",
                                 [&] { attnmix::train::adamw<> opt(with(c.field, v)); });
    }
  // The edges PyTorch accepts.
  for (const auto& c : cases) {
    INFO(c.name);
    CHECK_NOTHROW(attnmix::train::adamw<>(with(c.field, 0.0)));
  }
}

TEST_CASE("adamw: a learning rate that is negative, NaN or inf changes nothing",
          "[train][errors]") {
  toy m;
  for (std::size_t i = 0; i < m.w.data.size(); ++i) m.w.data[i] = 0.1 * double(i);
  attnmix::train::adamw<> fresh, used;
  set_grads(m, 1);
  const std::vector<double> first = snapshot(m, fresh);
  for (double lr : {-1e-3, not_a_number, infinity, -infinity}) {
    INFO("lr " << lr);
    attnmix_test::expect_error("attnmix::train::adamw::step", "lr", "must be finite and >= 0",
                               [&] { fresh.step(m, lr); });
    CHECK(attnmix_test::bitwise_equal(snapshot(m, fresh), first));  // not even initialised
  }
  used.step(m, 1e-2);
  set_grads(m, 2);
  const std::vector<double> before = snapshot(m, used);
  attnmix_test::expect_error("attnmix::train::adamw::step", "lr", "must be finite and >= 0",
                             [&] { used.step(m, not_a_number); });
  CHECK(attnmix_test::bitwise_equal(snapshot(m, used), before));
  CHECK(used.steps() == 1);
  CHECK_NOTHROW(used.step(m, 0.0));
}

namespace {

// The state of `opt` as safetensors bytes, with `edit` applied to a copy of tensor `name`.
template <class Edit>
std::vector<unsigned char> edited_state(const attnmix::train::adamw<>& opt, const std::string& name,
                                        Edit edit) {
  std::vector<std::vector<double>> copies;
  std::vector<attnmix::io::tensor_bytes> list;
  opt.visit_parameters([&](const std::string& n, const auto& p) {
    copies.push_back(p.data);
    if (n == name) edit(copies.back());
  });
  std::size_t i = 0;
  opt.visit_parameters([&](const std::string& n, const auto& p) {
    const auto& c = copies[i++];
    list.push_back({n, attnmix::io::dtype::f64, p.shape, c.data(), c.size() * sizeof(double)});
  });
  return attnmix::io::serialize(list);
}

}  // namespace

TEST_CASE("adamw: a loaded state of a step or moment out of range is rejected, nothing changes",
          "[train][errors]") {
  toy a;
  attnmix::train::adamw<> opt;
  for (int t = 1; t <= 3; ++t) set_grads(a, t), opt.step(a, 1e-2);
  toy b = a;
  attnmix::train::adamw<> resumed;
  resumed.init(b);
  set_grads(b, 4);
  const std::vector<double> before = snapshot(b, resumed);
  const auto expect_rejected = [&](const std::string& tensor, const std::string& detail,
                                   const std::vector<unsigned char>& bytes) {
    std::string msg = "<no attnmix::error>";
    try {
      attnmix::io::load(resumed, attnmix::io::safetensors_file::parse(bytes, "state"));
    } catch (const attnmix::error& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(msg.rfind("attnmix::io::load: file 'state' tensor '" + tensor + "'", 0) == 0);
    CHECK(msg.find(detail) != std::string::npos);
    CHECK(attnmix_test::bitwise_equal(snapshot(b, resumed), before));
    CHECK(resumed.steps() == 0);
  };
  for (double step : {not_a_number, infinity, -infinity, 1e300, -1.0, 2.5, 9007199254740994.0}) {
    INFO("step " << step);
    expect_rejected("step", "is not a step count",
                    edited_state(opt, "step", [&](std::vector<double>& v) { v[0] = step; }));
  }
  for (double x : {not_a_number, infinity}) {
    INFO("exp_avg " << x);
    expect_rejected("w.exp_avg", "at [5]",
                    edited_state(opt, "w.exp_avg", [&](std::vector<double>& v) { v[5] = x; }));
  }
  for (double x : {not_a_number, -infinity, -1e-30}) {
    INFO("exp_avg_sq " << x);
    expect_rejected("b.exp_avg_sq", "at [2]",
                    edited_state(opt, "b.exp_avg_sq", [&](std::vector<double>& v) { v[2] = x; }));
  }
  // The state as saved loads, and the run continues as the uninterrupted one.
  attnmix::io::load(resumed, attnmix::io::safetensors_file::parse(
                                 edited_state(opt, "step", [](std::vector<double>&) {}), "state"));
  CHECK(resumed.steps() == 3);
  set_grads(a, 4);
  opt.step(a, 1e-2);
  resumed.step(b, 1e-2);
  CHECK(attnmix_test::bitwise_equal(a.w.data, b.w.data));
  CHECK(attnmix_test::bitwise_equal(a.b.data, b.b.data));
}

TEST_CASE("schedules and progress: settings that would overflow or print garbage are rejected",
          "[train][errors]") {
  using attnmix::train::constant_rate;
  using attnmix::train::warmup_cosine;
  const index_t big = std::numeric_limits<index_t>::max();
  attnmix_test::expect_error("attnmix::train::warmup_cosine", "warmup", "must be >= 0", [&] {
    (void)warmup_cosine{-big, big, 1.0, 0.0}(5);
  });
  attnmix_test::expect_error("attnmix::train::warmup_cosine", "total", "must be >= 0", [&] {
    (void)warmup_cosine{0, -1, 1.0, 0.0}(5);
  });
  attnmix_test::expect_error("attnmix::train::warmup_cosine", "peak", "finite", [&] {
    (void)warmup_cosine{1, 10, not_a_number, 0.0}(5);
  });
  attnmix_test::expect_error("attnmix::train::warmup_cosine", "floor", "finite", [&] {
    (void)warmup_cosine{1, 10, 1.0, -infinity}(5);
  });
  attnmix_test::expect_error("attnmix::train::constant_rate", "warmup", "must be >= 0", [&] {
    (void)constant_rate{1.0, -1}(5);
  });
  attnmix_test::expect_error("attnmix::train::constant_rate", "rate", "finite", [&] {
    (void)constant_rate{not_a_number, 0}(5);
  });
  // A warm-up as long as the run: the peak at its end, no division by zero.
  CHECK(warmup_cosine{10, 10, 1.0, 0.1}(10) == 1.0);
  CHECK(warmup_cosine{10, 10, 1.0, 0.1}(11) == 0.1);

  using attnmix::train::progress;
  attnmix_test::expect_error("attnmix::train::progress", "out", "null",
                             [] { progress p(10, 1, 1, nullptr); });
  attnmix_test::expect_error("attnmix::train::progress", "total", "must be >= 0",
                             [] { progress p(-big, 1, 1); });
  attnmix_test::expect_error("attnmix::train::progress", "every", "must be >= 0",
                             [] { progress p(1, 1, -1); });
  progress quiet(big, big, 0);
  attnmix_test::expect_error("attnmix::train::progress::step", "step", "must be >= 0",
                             [&] { quiet.step(-big, 0.0); });
  // Durations out of range print as such instead of converting out of range.
  CHECK(progress::duration(not_a_number) == "?");
  CHECK(progress::duration(-5.0) == "?");
  CHECK(progress::duration(1e300).size() < 32);
  CHECK(progress::duration(3725.0) == "1h02m");
}
