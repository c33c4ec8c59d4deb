#pragma once
// Shared pieces of the layer and stack tests: parameters as a name -> double map for the
// oracles, copying parameters between models, random activations.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "layers/layer_reference.hpp"
#include "support/catch.hpp"
#include "support/testing.hpp"

namespace attnmix_test {

template <class Model>
layer_ref::params parameters_of(const Model& m) {
  layer_ref::params out;
  m.visit_parameters([&](const std::string& name, const auto& p) {
    out[name] = std::vector<double>(p.data.begin(), p.data.end());
  });
  return out;
}

// dst's parameters take src's values (same names and sizes).
template <class Src, class Dst>
void copy_parameters(const Src& src, Dst& dst) {
  const layer_ref::params p = parameters_of(src);
  dst.visit_parameters([&](const std::string& name, auto& q) {
    using T = typename std::decay_t<decltype(q.data)>::value_type;
    const auto& v = p.at(name);
    REQUIRE(v.size() == q.data.size());
    for (std::size_t i = 0; i < v.size(); ++i) q.data[i] = static_cast<T>(v[i]);
  });
}

inline layer_ref::dims dims_of(const attnmix::layers::config& c) {
  layer_ref::dims m{c.hidden_size, c.num_heads, c.kv_heads(), c.dim()};
  m.norm_eps = c.norm_eps;
  m.head_eps = c.head_norm_eps;
  m.rope_theta = c.rope_theta;
  m.w_rank = c.w_rank;
  return m;
}

// Activations exactly representable in float, so that float and double runs see one input.
template <class T>
attnmix::host_tensor<T, 3> random_activations(rng& r, index_t B, index_t Tn, index_t D) {
  attnmix::host_tensor<T, 3> x({B, Tn, D});
  for (auto& v : x.storage()) v = static_cast<T>(static_cast<float>(r.normal()));
  return x;
}

template <class T>
std::vector<double> as_double(const attnmix::host_tensor<T, 3>& x) {
  return std::vector<double>(x.storage().begin(), x.storage().end());
}

inline std::vector<long> to_long(const std::vector<std::int32_t>& cu) {
  return std::vector<long>(cu.begin(), cu.end());
}

// The message of the attnmix::error that f throws, or a marker if it throws none.
template <class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const attnmix::error& e) {
    return e.what();
  }
  return "<no attnmix::error>";
}

}  // namespace attnmix_test

// Checks that `expr` throws attnmix::error whose message contains `text`.
#define ATTNMIX_CHECK_ERROR(expr, text)                                          \
  do {                                                                           \
    const std::string attnmix_msg_ = attnmix_test::error_message([&] { expr; }); \
    INFO(attnmix_msg_);                                                          \
    CHECK(attnmix_msg_.find(text) != std::string::npos);                         \
  } while (0)
