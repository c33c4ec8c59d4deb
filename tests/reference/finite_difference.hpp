#pragma once
// Finite differences in double, the independent check of every gradient oracle.
//   loss(x) = sum_i weight_i * f(x)_i   (a fixed random weight makes every output count)
// grad[n] = (8 (L(x + h e_n) - L(x - h e_n)) - (L(x + 2h e_n) - L(x - 2h e_n))) / (12 h): the
// fourth-order central stencil, error O(h^4 f^(5)) plus rounding O(eps |loss| / h). The
// second-order one's O(h^2 f''') reached 1e-7 relative on deep stacks (PaTH-FoX under RMSNorm).

#include <cmath>
#include <functional>
#include <vector>

namespace attnmix_ref {

// d/dt L(t) at t = 0, for L(t) the loss at the point moved by t along one coordinate.
template <class LossAt>
double derivative(LossAt&& loss_at, double h = 1e-5) {
  const double near = loss_at(h) - loss_at(-h), far = loss_at(2 * h) - loss_at(-2 * h);
  return (8 * near - far) / (12 * h);
}

// The gradient of the scalar `loss` at x, one stencil per element of x.
inline std::vector<double> finite_difference(
    const std::function<double(const std::vector<double>&)>& loss, std::vector<double> x,
    double h = 1e-5) {
  std::vector<double> grad(x.size());
  for (std::size_t n = 0; n < x.size(); ++n) {
    const double x0 = x[n];
    grad[n] = derivative(
        [&](double t) {
          x[n] = x0 + t;
          return loss(x);
        },
        h);
    x[n] = x0;
  }
  return grad;
}

// sum_i a_i b_i
inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) s += a[i] * b[i];
  return s;
}

// ||a - b|| / ||b||, and ||a|| when b is 0 (a gradient that must vanish).
inline double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// How far the stencil's own rounding can take it from the true gradient: each evaluation of
// L = sum_i w_i y_i is off by about eps * sum_i |w_i y_i|, so each element of `derivative` by
// 1.5 times that over h, and n elements by sqrt(n) times it. A parameter the output barely
// depends on (a query projection behind a scale-invariant norm) has a gradient near this floor,
// where a relative error says nothing.
inline double rounding_floor(const std::vector<double>& w, const std::vector<double>& y,
                             std::size_t n, double h = 1e-5) {
  double s = 0;
  for (std::size_t i = 0; i < w.size() && i < y.size(); ++i) s += std::abs(w[i] * y[i]);
  return 1.5 * 2.220446049250313e-16 * s / h * std::sqrt(static_cast<double>(n));
}

// ||a - b|| <= tol ||b|| + floor: a relative error that does not ask for bits below `floor`.
inline bool close_to(const std::vector<double>& a, const std::vector<double>& b, double tol,
                     double floor) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num) <= tol * std::sqrt(den) + floor;
}

}  // namespace attnmix_ref
