#pragma once
// Finite-difference checks of a layer's parameter gradients: with L = dot(w, f(model)), every
// parameter's .grad (after the caller's backward with d(out) = w) against central differences
// of L in that parameter.

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
      p.data[i] = x0 + h;
      const double up = attnmix_ref::dot(w, f());
      p.data[i] = x0 - h;
      const double down = attnmix_ref::dot(w, f());
      p.data[i] = x0;
      fd[i] = (up - down) / (2 * h);
    }
    REQUIRE(p.grad.size() == p.data.size());
    const std::vector<double> g(p.grad.begin(), p.grad.end());
    CHECK(attnmix_ref::relative_error(g, fd) < tol);
  });
}

}  // namespace attnmix_test
