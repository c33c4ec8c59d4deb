// The backward of the building-block layers (linear, RMSNorm, per-head RMSNorm, short
// convolution, the three MLPs) against central finite differences of their forwards in double:
// the input's gradient and every parameter's.

#include <functional>
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

using be_t = attnmix::backend::cpu;
using O = L::ops<be_t>;

struct call {
  be_t be{2};
  L::token_layout layout;
  O::handles h{};
  L::context<be_t> c() const { return {be, layout, nullptr, h}; }
};

vec random_vec(attnmix_test::rng& r, std::size_t n, double sigma = 1.0) {
  vec v(n);
  for (auto& x : v) x = sigma * r.normal();
  return v;
}

template <class Layer>
void randomize(Layer& l, attnmix_test::rng& r, double sigma) {
  l.visit_parameters([&](const std::string&, auto& p) {
    for (auto& x : p.data) x = sigma * r.normal();
  });
}

// d/dx of dot(w, f(x)) against FD.
void check_input_grad(const std::function<vec(const vec&)>& f, const vec& x, const vec& w,
                      const vec& dx, double tol = 1e-7) {
  const vec fd =
      attnmix_ref::finite_difference([&](const vec& y) { return attnmix_ref::dot(w, f(y)); }, x);
  CHECK(attnmix_ref::relative_error(dx, fd) < tol);
}

constexpr double tol = 1e-7;

}  // namespace

TEST_CASE("linear: backward matches finite differences", "[train][layers][backward]") {
  attnmix_test::rng r(21);
  INFO("seed " << attnmix_test::test_seed());
  const index_t rows = 9, in = 6, out = 5;
  call k{{2}, {1, rows, {}}};
  L::linear<double> lin(in, out, true);
  randomize(lin, r, 0.5);
  const vec x = random_vec(r, rows * in), w = random_vec(r, rows * out);
  auto f = [&](const vec& xx) {
    vec y(rows * out);
    lin.apply(k.c(), xx.data(), rows, y.data());
    return y;
  };
  vec dx(rows * in);
  lin.backward(k.c(), x.data(), rows, w.data(), dx.data());
  check_input_grad(f, x, w, dx);
  attnmix_test::check_parameter_grads(
      lin, [&] { return f(x); }, w, tol);
}

TEST_CASE("RMSNorm and per-head RMSNorm: backward matches finite differences",
          "[train][layers][backward]") {
  attnmix_test::rng r(22);
  INFO("seed " << attnmix_test::test_seed());
  const index_t rows = 7, D = 12, heads = 3, d = 4;
  call k{{2}, {1, rows, {}}};
  L::rms_norm<double> norm(D, 1e-3);
  randomize(norm, r, 1.0);
  const vec x = random_vec(r, rows * D), w = random_vec(r, rows * D);
  auto f = [&](const vec& xx) {
    vec y(rows * D);
    norm.apply(k.c(), xx.data(), rows, y.data());
    return y;
  };
  vec dx(rows * D);
  norm.backward(k.c(), x.data(), rows, w.data(), dx.data());
  check_input_grad(f, x, w, dx);
  attnmix_test::check_parameter_grads(
      norm, [&] { return f(x); }, w, tol);

  for (bool per_head : {false, true}) {
    L::head_rms_norm<double> hn(heads, d, per_head, 1e-3);
    randomize(hn, r, 1.0);
    auto g = [&](const vec& xx) {
      vec y(rows * D);
      hn.apply(k.c(), xx.data(), rows, y.data());
      return y;
    };
    vec dxh(rows * D);
    hn.backward(k.c(), x.data(), rows, w.data(), dxh.data());
    check_input_grad(g, x, w, dxh);
    attnmix_test::check_parameter_grads(
        hn, [&] { return g(x); }, w, tol);
  }
}

TEST_CASE("short convolution: backward matches finite differences", "[train][layers][backward]") {
  attnmix_test::rng r(23);
  INFO("seed " << attnmix_test::test_seed());
  const index_t C = 5, K = 4;
  call k{{2}, {1, 11, {0, 4, 4, 5, 11}}};
  const index_t rows = k.layout.rows();
  for (bool silu : {true, false}) {
    L::short_conv<double> conv(C, K, silu);
    randomize(conv, r, 0.5);
    const vec x = random_vec(r, rows * C), w = random_vec(r, rows * C);
    auto f = [&](const vec& xx) {
      vec y(rows * C);
      conv.apply(k.c(), xx.data(), y.data());
      return y;
    };
    vec dx(rows * C);
    conv.backward(k.c(), x.data(), w.data(), dx.data());
    check_input_grad(f, x, w, dx);
    attnmix_test::check_parameter_grads(
        conv, [&] { return f(x); }, w, tol);
  }
}

namespace {

template <L::mlp_kind Kind>
void check_mlp() {
  attnmix_test::rng r(24 + int(Kind));
  INFO("seed " << attnmix_test::test_seed() << " kind " << L::to_string(Kind));
  L::config cfg;
  cfg.hidden_size = 6;
  cfg.intermediate_size = 10;
  const index_t rows = 5, D = 6;
  call k{{2}, {1, rows, {}}};
  L::mlp<double, Kind> m(cfg);
  randomize(m, r, 0.5);
  const vec x = random_vec(r, rows * D), w = random_vec(r, rows * D);
  auto f = [&](const vec& xx) {
    vec y(rows * D);
    m.apply(k.c(), xx.data(), rows, y.data());
    return y;
  };
  typename L::mlp<double, Kind>::saved_type saved;
  vec y(rows * D), dx(rows * D, 3.0);
  m.apply(k.c(), x.data(), rows, y.data(), &saved);
  CHECK(attnmix_test::bitwise_equal(y, f(x)));  // saving changes nothing
  m.backward(k.c(), x.data(), rows, w.data(), dx.data(), saved);
  check_input_grad(f, x, w, dx);
  attnmix_test::check_parameter_grads(
      m, [&] { return f(x); }, w, tol);
  // accumulate adds to dx.
  vec dx2 = dx;
  m.backward(k.c(), x.data(), rows, w.data(), dx2.data(), saved, true);
  for (std::size_t i = 0; i < dx.size(); ++i) CHECK(dx2[i] == Approx(2 * dx[i]).epsilon(1e-13));
}

}  // namespace

TEST_CASE("MLPs: backward matches finite differences", "[train][layers][backward]") {
  check_mlp<L::mlp_kind::swiglu>();
  check_mlp<L::mlp_kind::gelu>();
  check_mlp<L::mlp_kind::relu>();
}
