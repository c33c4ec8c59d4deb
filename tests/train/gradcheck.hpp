#pragma once
// Finite-difference checks of a layer's parameter gradients: with L = dot(w, f(model)), every
// parameter's .grad (after the caller's backward with d(out) = w) against finite differences
// of L in that parameter (attnmix_ref::derivative): a relative error below tol, less what the
// differences' own rounding hides (attnmix_ref::rounding_floor).

#include <string>
#include <vector>

#include "reference/finite_difference.hpp"
#include "support/catch.hpp"

namespace attnmix_test {

template <class Model, class F>
void check_parameter_grads(Model& model, F&& f, const std::vector<double>& w, double tol,
                           double h = 1e-5) {
  model.visit_parameters([&](const std::string& name, auto& p) {
    INFO("parameter " << name);
    std::vector<double> fd(p.data.size());
    for (std::size_t i = 0; i < p.data.size(); ++i) {
      const auto x0 = p.data[i];
      fd[i] = attnmix_ref::derivative(
          [&](double t) {
            p.data[i] = x0 + t;
            return attnmix_ref::dot(w, f());
          },
          h);
      p.data[i] = x0;
    }
    REQUIRE(p.grad.size() == p.data.size());
    const std::vector<double> g(p.grad.begin(), p.grad.end());
    const double floor = attnmix_ref::rounding_floor(w, f(), g.size(), h);
    INFO("relative error " << attnmix_ref::relative_error(g, fd) << ", rounding floor " << floor);
    CHECK(attnmix_ref::close_to(g, fd, tol, floor));
  });
}

}  // namespace attnmix_test
