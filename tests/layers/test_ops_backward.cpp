// The backward operations of layers::ops<backend::cpu> against central finite differences of
// the forward operations in double (gradients of L = sum(w * f(x)) for a fixed random w), and
// their sums independent of the thread count.

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "reference/finite_difference.hpp"
#include "support/catch.hpp"
#include "support/testing.hpp"

using attnmix::index_t;
using attnmix::layers::token_layout;
using vec = std::vector<double>;
namespace fn = attnmix::layers::fn;

namespace {

using O = attnmix::layers::ops<attnmix::backend::cpu>;
using ctx = attnmix::layers::context<attnmix::backend::cpu>;

struct call {
  attnmix::backend::cpu be;
  token_layout L;
  std::vector<std::int32_t> pos;
  O::handles h{};
  ctx c() const { return ctx{be, L, pos.empty() ? nullptr : pos.data(), h}; }
};

vec random_vec(attnmix_test::rng& r, std::size_t n, double sigma = 1.0) {
  vec v(n);
  for (auto& x : v) x = sigma * r.normal();
  return v;
}

// FD of x -> dot(w, f(x)).
vec fd(const std::function<vec(const vec&)>& f, const vec& x, const vec& w) {
  return attnmix_ref::finite_difference([&](const vec& y) { return attnmix_ref::dot(w, f(y)); }, x);
}

constexpr double fd_tol = 1e-7;

}  // namespace

TEST_CASE("gemm_dx and gemm_dw match finite differences", "[layers][backward]") {
  attnmix_test::rng r(1);
  INFO("seed " << attnmix_test::test_seed());
  const index_t rows = 37, in = 13, out = 70;  // out crosses one block of output features
  call k{{2}, {1, rows, {}}, {}};
  const vec x = random_vec(r, rows * in), W = random_vec(r, out * in), b = random_vec(r, out);
  const vec dy = random_vec(r, rows * out);
  auto forward = [&](const vec& xx, const vec& WW, const vec& bb) {
    vec y(rows * out);
    O::gemm(k.c(), xx.data(), in, rows, WW.data(), in, out, bb.data(), y.data(), out);
    return y;
  };
  vec dx(rows * in, 7.0), dW(out * in, 0.0), db(out, 0.0);
  O::gemm_dx(k.c(), dy.data(), out, rows, W.data(), in, out, dx.data(), in);
  O::gemm_dw(k.c(), x.data(), in, rows, dy.data(), out, in, out, dW.data(), db.data());
  CHECK(attnmix_ref::relative_error(dx, fd([&](const vec& v) { return forward(v, W, b); }, x, dy)) <
        fd_tol);
  CHECK(attnmix_ref::relative_error(dW, fd([&](const vec& v) { return forward(x, v, b); }, W, dy)) <
        fd_tol);
  CHECK(attnmix_ref::relative_error(db, fd([&](const vec& v) { return forward(x, W, v); }, b, dy)) <
        fd_tol);

  // accumulate adds; parameter gradients add up over calls; one thread gives the same bits.
  vec dx2 = dx, dW1(out * in, 0.0), db1(out, 0.0);
  O::gemm_dx(k.c(), dy.data(), out, rows, W.data(), in, out, dx2.data(), in, true);
  for (std::size_t i = 0; i < dx.size(); ++i) CHECK(dx2[i] == Approx(2 * dx[i]).epsilon(1e-14));
  call one{{1}, {1, rows, {}}, {}};
  O::gemm_dw(one.c(), x.data(), in, rows, dy.data(), out, in, out, dW1.data(), db1.data());
  CHECK(attnmix_test::bitwise_equal(dW1, dW));
  CHECK(attnmix_test::bitwise_equal(db1, db));
}

TEST_CASE("norm_backward (RMSNorm, per-group weights, L2) matches finite differences",
          "[layers][backward]") {
  attnmix_test::rng r(2);
  INFO("seed " << attnmix_test::test_seed());
  const index_t rows = 300, heads = 3, width = 10, groups = rows * heads;  // > one row block
  call k{{2}, {1, rows, {}}, {}};
  for (int mode = 0; mode < 4; ++mode) {
    const bool mean = mode != 3, per_group = mode == 1, weighted = mode <= 1;
    INFO("mode " << mode);
    const index_t wn = !weighted ? 0 : per_group ? heads * width : width;
    const vec x = random_vec(r, groups * width), w = random_vec(r, wn);
    const vec dy = random_vec(r, groups * width);
    const double eps = 1e-3;
    auto forward = [&](const vec& xx, const vec& ww) {
      vec y(xx.size());
      O::norm(k.c(), xx.data(), y.data(), groups, width, weighted ? ww.data() : nullptr, per_group,
              heads, mean, eps);
      return y;
    };
    vec dx(x.size()), dw(wn, 0.0);
    O::norm_backward(k.c(), x.data(), dy.data(), dx.data(), groups, width,
                     weighted ? w.data() : static_cast<const double*>(nullptr), per_group, heads,
                     mean, eps, weighted ? dw.data() : nullptr);
    // dx against finite differences on the first rows only (each group is independent; the
    // differences cost groups^2 evaluations), the thread split on all of them below.
    const index_t fd_groups = 20 * heads, fd_n = fd_groups * width;
    const vec x_fd(x.begin(), x.begin() + fd_n), dy_fd(dy.begin(), dy.begin() + fd_n);
    const vec dx_fd(dx.begin(), dx.begin() + fd_n);
    const auto forward_fd = [&](const vec& v) {
      vec y(v.size());
      O::norm(k.c(), v.data(), y.data(), fd_groups, width, weighted ? w.data() : nullptr, per_group,
              heads, mean, eps);
      return y;
    };
    CHECK(attnmix_ref::relative_error(dx_fd, fd(forward_fd, x_fd, dy_fd)) < fd_tol);
    if (weighted) {
      CHECK(attnmix_ref::relative_error(
                dw, fd([&](const vec& v) { return forward(x, v); }, w, dy)) < fd_tol);
      vec dw1(wn, 0.0), dx1(x.size());
      call one{{1}, {1, rows, {}}, {}};
      O::norm_backward(one.c(), x.data(), dy.data(), dx1.data(), groups, width, w.data(), per_group,
                       heads, mean, eps, dw1.data());
      CHECK(attnmix_test::bitwise_equal(dw1, dw));
    }
    // dx in place of dy.
    vec inplace = dy;
    O::norm_backward(k.c(), x.data(), inplace.data(), inplace.data(), groups, width,
                     weighted ? w.data() : static_cast<const double*>(nullptr), per_group, heads,
                     mean, eps, static_cast<double*>(nullptr));
    CHECK(attnmix_test::bitwise_equal(inplace, dx));
  }
}

TEST_CASE("short_conv_backward matches finite differences over packed sequences",
          "[layers][backward]") {
  attnmix_test::rng r(3);
  INFO("seed " << attnmix_test::test_seed());
  const index_t C = 70, K = 4;
  call k{{2}, {1, 12, {0, 1, 1, 7, 12}}, {}};  // lengths 1, 0, 6, 5
  const index_t rows = k.L.rows();
  for (bool silu : {false, true}) {
    const vec x = random_vec(r, rows * C), W = random_vec(r, C * K, 0.5),
              dy = random_vec(r, rows * C);
    auto forward = [&](const vec& xx, const vec& WW) {
      vec y(rows * C);
      O::short_conv(k.c(), xx.data(), y.data(), C, WW.data(), K, silu);
      return y;
    };
    vec dx(rows * C), dW(C * K, 0.0);
    O::short_conv_backward(k.c(), x.data(), dy.data(), dx.data(), C, W.data(), K, silu, dW.data());
    CHECK(attnmix_ref::relative_error(dx, fd([&](const vec& v) { return forward(v, W); }, x, dy)) <
          fd_tol);
    CHECK(attnmix_ref::relative_error(dW, fd([&](const vec& v) { return forward(x, v); }, W, dy)) <
          fd_tol);
  }
}

TEST_CASE("rope_backward is the transpose of the rotation", "[layers][backward]") {
  attnmix_test::rng r(4);
  const index_t rows = 9, heads = 2, d = 8;
  call k{{1}, {1, rows, {}}, {}};
  for (index_t i = 0; i < rows; ++i) k.pos.push_back(std::int32_t(3 * i + 1));
  const vec x = random_vec(r, rows * heads * d), dy = random_vec(r, rows * heads * d);
  auto forward = [&](const vec& xx) {
    vec y = xx;
    O::rope(k.c(), y.data(), rows, heads, d, 500.0);
    return y;
  };
  vec dx = dy;
  O::rope_backward(k.c(), dx.data(), rows, heads, d, 500.0);
  CHECK(attnmix_ref::relative_error(dx, fd(forward, x, dy)) < fd_tol);
}

namespace {

template <class Fn>
void check_map(bool binary) {
  attnmix_test::rng r(5);
  const index_t n = 200;
  call k{{1}, {1, n, {}}, {}};
  const vec a = random_vec(r, n, 3.0), b = random_vec(r, n, 3.0), dy = random_vec(r, n);
  auto forward = [&](const vec& aa, const vec& bb) {
    vec y(n);
    O::map<Fn>(k.c(), y.data(), aa.data(), binary ? bb.data() : nullptr, n);
    return y;
  };
  vec da(n), db(n);
  O::map_backward<Fn>(k.c(), dy.data(), a.data(), binary ? b.data() : nullptr, da.data(),
                      binary ? db.data() : nullptr, n);
  CHECK(attnmix_ref::relative_error(da, fd([&](const vec& v) { return forward(v, b); }, a, dy)) <
        fd_tol);
  if (binary)
    CHECK(attnmix_ref::relative_error(db, fd([&](const vec& v) { return forward(a, v); }, b, dy)) <
          fd_tol);
}

}  // namespace

TEST_CASE("map_backward matches finite differences for every element-wise function",
          "[layers][backward]") {
  INFO("seed " << attnmix_test::test_seed());
  check_map<fn::silu_times>(true);
  check_map<fn::times_sigmoid>(true);
  check_map<fn::plus>(true);
  check_map<fn::gelu>(false);
  check_map<fn::log_sigmoid>(false);
  check_map<fn::two_sigmoid>(false);
  check_map<fn::relu>(false);  // FD across a kink has probability ~0 at these points
}
