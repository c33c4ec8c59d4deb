#pragma once
// Central finite differences in double, the independent check of every gradient oracle.
//   loss(x) = sum_i weight_i * f(x)_i   (a fixed random weight makes every output count)
// grad[n] = (loss(x + h e_n) - loss(x - h e_n)) / (2 h). Error O(h^2 f'''), plus rounding
// O(eps |loss| / h): h = 1e-5 gives about 1e-10 relative on smooth, O(1) problems.

#include <cmath>
#include <functional>
#include <vector>

namespace attnmix_ref {

// The gradient of the scalar `loss` at x, one central difference per element of x.
inline std::vector<double> finite_difference(
    const std::function<double(const std::vector<double>&)>& loss, std::vector<double> x,
    double h = 1e-5) {
  std::vector<double> grad(x.size());
  for (std::size_t n = 0; n < x.size(); ++n) {
    const double x0 = x[n];
    x[n] = x0 + h;
    const double up = loss(x);
    x[n] = x0 - h;
    const double down = loss(x);
    x[n] = x0;
    grad[n] = (up - down) / (2 * h);
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

}  // namespace attnmix_ref
