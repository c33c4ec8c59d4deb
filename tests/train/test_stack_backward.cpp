// The backward of hybrid stacks against central finite differences of their forwards in double:
// the input's gradient and every parameter's, for a packed causal stack and a masked encoder.

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

namespace {

attnmix::layers::config small_config() {
  attnmix::layers::config c;
  c.hidden_size = 8;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  c.intermediate_size = 12;
  return c;
}

template <class Stack>
void check_stack(Stack& stack, index_t B, index_t T, const attnmix::stack_inputs& in,
                 std::uint64_t salt) {
  attnmix_test::rng r(salt);
  INFO("seed " << attnmix_test::test_seed());
  stack.visit_parameters([&](const std::string&, auto& p) {
    for (auto& x : p.data) x = (p.shape.size() == 1 ? 1.0 : 0.0) + 0.4 * r.normal();
  });
  const index_t D = stack.hidden_size(), n = B * T * D;
  vec x(n), w(n);
  for (auto& v : x) v = r.normal();
  for (auto& v : w) v = r.normal();
  auto forward = [&](const vec& xx) {
    vec y(n);
    stack.forward(attnmix::view3<const double>(xx.data(), {B, T, D}),
                  attnmix::view3<double>(y.data(), {B, T, D}), in);
    return y;
  };
  typename Stack::saved_type saved;
  vec y(n), dx(n, 42.0);
  stack.forward(attnmix::view3<const double>(x.data(), {B, T, D}),
                attnmix::view3<double>(y.data(), {B, T, D}), saved, in);
  CHECK(attnmix_test::bitwise_equal(y, forward(x)));
  stack.backward(attnmix::view3<const double>(w.data(), {B, T, D}),
                 attnmix::view3<double>(dx.data(), {B, T, D}), saved);
  const vec fd = attnmix_ref::finite_difference(
      [&](const vec& v) { return attnmix_ref::dot(w, forward(v)); }, x);
  // Relative 1e-7, less the stencil's own rounding (see rounding_floor).
  CHECK(attnmix_ref::close_to(dx, fd, 1e-7, attnmix_ref::rounding_floor(w, forward(x), x.size())));
  attnmix_test::check_parameter_grads(
      stack, [&] { return forward(x); }, w, 1e-7);
  if (in.mask.has_value())
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < T; ++t)
        if (in.mask(b, t) == 0)
          for (index_t e = 0; e < D; ++e) CHECK(dx[(b * T + t) * D + e] == 0.0);
}

}  // namespace

TEST_CASE("a causal SA, FoX and PaTH-FoX stack: backward matches finite differences",
          "[train][stack][backward]") {
  attnmix::stack<double, attnmix::layer::causal_sa, attnmix::layer::fox, attnmix::layer::path_fox>
      s(small_config());
  const std::vector<std::int32_t> cu{0, 4, 5, 5, 11};
  attnmix::stack_inputs in;
  in.cu_seqlens = attnmix::view1<const std::int32_t>(cu.data(), {5});
  check_stack(s, 1, 11, in, 41);
}

TEST_CASE("a masked SA + GBLA encoder: backward matches finite differences, pad rows get 0",
          "[train][stack][backward]") {
  attnmix::basic_stack<double, attnmix::with_mlp<attnmix::layers::mlp_kind::gelu>,
                       attnmix::backend::cpu, attnmix::layer::sa, attnmix::layer::gbla>
      s(small_config());
  const std::vector<std::uint8_t> mask{1, 1, 1, 0, 0, 0, 1, 1, 1, 1};
  attnmix::stack_inputs in;
  in.mask = attnmix::tensor_view<const std::uint8_t, 2>(mask.data(), {2, 5});
  check_stack(s, 2, 5, in, 42);
}
