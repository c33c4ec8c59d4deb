// The argument checks of the backward front doors, attnmix::attention_backward and
// attnmix::linear_attention_backward: the error type, a message naming the function and the
// argument, and every gradient buffer left untouched.

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "support/catch.hpp"
#include "support/errors.hpp"
#include "support/testing.hpp"

using namespace attnmix_test;
using attnmix::host_tensor;
using attnmix::index_t;
using attnmix::view1;
using attnmix::view3;
using attnmix::view4;

namespace {

constexpr index_t B = 2, T = 17, HQ = 4, H = 2, D = 8, Dv = 6;

// Every gradient buffer of both families, filled with 42 so that a write shows.
struct gradients {
  host_tensor<float, 4> dq{{B, T, HQ, D}, 42.0f}, dk{{B, T, H, D}, 42.0f}, dv{{B, T, H, Dv}, 42.0f},
      dw{{B, T, H, D}, 42.0f}, dgate{{B, T, HQ, Dv}, 42.0f};
  host_tensor<float, 3> dg{{B, T, HQ}, 42.0f}, dbeta{{B, T, H}, 42.0f}, da{{B, T, 1}, 42.0f};
  host_tensor<float, 1> dgamma{{Dv}, 42.0f};
  host_tensor<float, 4> dS{{B, H, D, Dv}, 42.0f};
  host_tensor<float, 3> dz{{B, H, D}, 42.0f};

  std::vector<std::vector<float>> snapshot() const {
    return {dq.storage(),     dk.storage(), dv.storage(),    dw.storage(),
            dgate.storage(),  dg.storage(), dbeta.storage(), da.storage(),
            dgamma.storage(), dS.storage(), dz.storage()};
  }
};

// ---- softmax family -----------------------------------------------------------------------

struct attention_fixture {
  host_tensor<float, 4> q{{B, T, HQ, D}, 0.5f}, k{{B, T, H, D}, 0.25f}, v{{B, T, H, Dv}, 1.0f};
  host_tensor<float, 4> w{{B, T, H, D}, 0.35f}, out{{B, T, HQ, Dv}, 1.0f},
      dout{{B, T, HQ, Dv}, 0.5f};
  host_tensor<float, 3> g{{B, T, HQ}, -0.1f}, beta{{B, T, H}, 1.5f}, lse{{B, T, HQ}, 2.0f};
  gradients d;
  std::vector<float> spare = std::vector<float>(1 << 16, 0.0f);  // backs wrongly shaped views

  template <class Kind>
  attnmix::attention_grad_args<float> args() {
    attnmix::attention_grad_args<float> a;
    a.q = q.view(), a.k = k.view(), a.v = v.view(), a.out = out.view(), a.lse = lse.view();
    a.dout = dout.view(), a.dq = d.dq.view(), a.dk = d.dk.view(), a.dv = d.dv.view();
    if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate) a.g = g.view(), a.dg = d.dg.view();
    if constexpr (attnmix::kind_traits<Kind>::uses_householder)
      a.w = w.view(), a.beta = beta.view(), a.dw = d.dw.view(), a.dbeta = d.dbeta.view();
    return a;
  }
};

template <class Kind, class Modify>
void expect_rejected(const std::string& arg, const std::string& detail, Modify modify) {
  attention_fixture f;
  attnmix::attention_grad_args<float> a = f.args<Kind>();
  attnmix::attention_params p;
  modify(f, a, p);
  const auto before = f.d.snapshot();
  expect_error(std::string("attnmix::attention_backward<") + Kind::name + ">", arg, detail,
               [&] { attnmix::attention_backward<Kind>(a, p); });
  const auto after = f.d.snapshot();
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(bitwise_equal(after[i], before[i]));
}

using attnmix::kind::fox;
using attnmix::kind::path_fox;
using attnmix::kind::softmax;

}  // namespace

TEST_CASE("attention_backward: a valid call writes every gradient", "[errors][backward][cpu]") {
  attention_fixture f;
  attnmix::attention_args<float> fa{f.q.view(), f.k.view(), f.v.view(), f.out.view()};
  fa.g = f.g.view(), fa.w = f.w.view(), fa.beta = f.beta.view(), fa.lse = f.lse.view();
  attnmix::attention<path_fox>(fa);
  REQUIRE_NOTHROW(attnmix::attention_backward<path_fox>(f.args<path_fox>()));
  for (const auto& x : {f.d.dq.storage(), f.d.dk.storage(), f.d.dv.storage(), f.d.dw.storage(),
                        f.d.dg.storage(), f.d.dbeta.storage()})
    for (float y : x) REQUIRE((std::isfinite(y) && y != 42.0f));
}

TEST_CASE("attention_backward: missing and unexpected tensors", "[errors][backward][cpu]") {
  expect_rejected<fox>("out", "forward's output", [](auto&, auto& a, auto&) { a.out = {}; });
  expect_rejected<fox>("lse", "forward's log-sum-exp", [](auto&, auto& a, auto&) { a.lse = {}; });
  expect_rejected<fox>("dout", "was not given", [](auto&, auto& a, auto&) { a.dout = {}; });
  expect_rejected<fox>("dq", "was not given", [](auto&, auto& a, auto&) { a.dq = {}; });
  expect_rejected<fox>("dg", "was not given", [](auto&, auto& a, auto&) { a.dg = {}; });
  expect_rejected<path_fox>("dbeta", "was not given", [](auto&, auto& a, auto&) { a.dbeta = {}; });
  expect_rejected<softmax>("dg", "no forget gate",
                           [](auto& f, auto& a, auto&) { a.dg = f.d.dg.view(); });
  expect_rejected<fox>("dw", "no Householder",
                       [](auto& f, auto& a, auto&) { a.dw = f.d.dw.view(); });
}

TEST_CASE("attention_backward: wrongly shaped gradients name both sizes",
          "[errors][backward][cpu]") {
  expect_rejected<fox>("dk", "has shape [2, 17, 4, 8] but must be [B, Tk, H, D] = [2, 17, 2, 8]",
                       [](auto& f, auto& a, auto&) {
                         a.dk = view4<float>(f.spare.data(), {B, T, HQ, D});
                       });
  expect_rejected<fox>("dq", "must be [B, T, HQ, D] = [2, 17, 4, 8]", [](auto& f, auto& a, auto&) {
    a.dq = view4<float>(f.spare.data(), {B, T, HQ, D + 1});
  });
  expect_rejected<fox>("dout", "must be [B, T, HQ, Dv] = [2, 17, 4, 6]",
                       [](auto& f, auto& a, auto&) {
                         a.dout = view4<const float>(f.spare.data(), {B, T - 1, HQ, Dv});
                       });
  expect_rejected<path_fox>("dbeta", "must be [B, T, H] = [2, 17, 2]", [](auto& f, auto& a, auto&) {
    a.dbeta = view3<float>(f.spare.data(), {B, T, HQ});
  });
  expect_rejected<fox>("lse", "must be [B, T, HQ] = [2, 17, 4]", [](auto& f, auto& a, auto&) {
    a.lse = view3<const float>(f.spare.data(), {B, T, H});
  });
}

TEST_CASE("attention_backward: gradients aliasing inputs or each other",
          "[errors][backward][cpu]") {
  expect_rejected<fox>("dq", "overlaps the memory of 'q'", [](auto& f, auto& a, auto&) {
    a.dq = view4<float>(f.q.data(), {B, T, HQ, D});
  });
  expect_rejected<fox>("dv", "overlaps the memory of 'dout'", [](auto& f, auto& a, auto&) {
    a.dv = view4<float>(f.dout.data() + 3, {B, T, H, Dv});
  });
  expect_rejected<fox>("dk", "overlaps the memory of 'dq'", [](auto& f, auto& a, auto&) {
    a.dk = view4<float>(f.d.dq.data() + 5, {B, T, H, D});
  });
  expect_rejected<path_fox>("dbeta", "overlaps the memory of 'dw'", [](auto& f, auto& a, auto&) {
    a.dbeta = view3<float>(f.d.dw.data(), {B, T, H});
  });
  expect_rejected<fox>("dg", "overlap", [](auto& f, auto& a, auto&) {
    a.dg = view3<float>(f.d.dg.data(), {B, T, HQ}, {0, HQ, 1});
  });
  expect_rejected<fox>(
      "dq", "device memory but the cpu backend needs host memory", [](auto& f, auto& a, auto&) {
        a.dq = view4<float>(f.d.dq.data(), {B, T, HQ, D}, attnmix::memory_space::device);
      });
}

TEST_CASE("attention_backward: runtime parameters as the forward", "[errors][backward][cpu]") {
  expect_rejected<fox>("scale", "must be finite", [](auto&, auto&, auto& p) { p.scale = 1e39; });
  expect_rejected<path_fox>("window", "PaTH has no sliding window",
                            [](auto&, auto&, auto& p) { p.window = 4; });
  static const std::vector<std::int32_t> bad{0, 9, 5, 34};
  expect_rejected<fox>("q", "must have B = 1 when cu_seqlens is given", [](auto&, auto&, auto& p) {
    p.cu_seqlens = view1<const std::int32_t>(bad.data(), {4});
  });
}

// ---- linear family ------------------------------------------------------------------------

namespace {

struct linear_fixture {
  host_tensor<float, 4> q{{B, T, HQ, D}, 0.5f}, k{{B, T, H, D}, 0.25f}, v{{B, T, H, Dv}, 1.0f};
  host_tensor<float, 4> gate{{B, T, HQ, Dv}, 0.3f}, dout{{B, T, HQ, Dv}, 0.5f};
  host_tensor<float, 3> a{{B, T, 1}, 0.1f};
  host_tensor<float, 1> gamma{{Dv}, 1.0f};
  host_tensor<float, 4> S{{B, H, D, Dv}, 0.1f};
  host_tensor<float, 3> z{{B, H, D}, 1.0f};
  gradients d;
  std::vector<float> spare = std::vector<float>(1 << 16, 0.0f);

  template <class Policy>
  attnmix::linear_attention_grad_args<float> args() {
    attnmix::linear_attention_grad_args<float> g;
    g.q = q.view(), g.k = k.view(), g.v = v.view(), g.dout = dout.view();
    g.dq = d.dq.view(), g.dk = d.dk.view(), g.dv = d.dv.view();
    if constexpr (Policy::gate != attnmix::key_gate::off) g.a = a.view(), g.da = d.da.view();
    if constexpr (Policy::norm != attnmix::gated_norm::off)
      g.gate = gate.view(), g.gamma = gamma.view(), g.dgate = d.dgate.view(),
      g.dgamma = d.dgamma.view();
    return g;
  }
};

template <class Kind, class Policy = attnmix::default_policy_t<Kind>, class Modify>
void expect_linear_rejected(const std::string& arg, const std::string& detail, Modify modify) {
  linear_fixture f;
  attnmix::linear_attention_grad_args<float> a = f.args<Policy>();
  attnmix::linear_attention_params p;
  modify(f, a, p);
  const auto before = f.d.snapshot();
  expect_error(std::string("attnmix::linear_attention_backward<") + Kind::name + ">", arg, detail,
               [&] { attnmix::linear_attention_backward<Kind, Policy>(a, p); });
  const auto after = f.d.snapshot();
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(bitwise_equal(after[i], before[i]));
}

using attnmix::kind::bla;
using attnmix::kind::gbla;
using attnmix::kind::linear_causal;

}  // namespace

TEST_CASE("linear_attention_backward: a valid call writes every gradient",
          "[errors][backward][cpu]") {
  linear_fixture f;
  auto a = f.args<attnmix::gbla_policy>();
  REQUIRE_NOTHROW(attnmix::linear_attention_backward<gbla>(a));
  for (const auto& x : {f.d.dq.storage(), f.d.dk.storage(), f.d.dv.storage(), f.d.da.storage(),
                        f.d.dgate.storage(), f.d.dgamma.storage()})
    for (float y : x) REQUIRE((std::isfinite(y) && y != 42.0f));
}

TEST_CASE("linear_attention_backward: missing and unexpected tensors", "[errors][backward][cpu]") {
  expect_linear_rejected<gbla>("da", "was not given", [](auto&, auto& a, auto&) { a.da = {}; });
  expect_linear_rejected<gbla>("dgate", "was not given",
                               [](auto&, auto& a, auto&) { a.dgate = {}; });
  expect_linear_rejected<gbla>("dgamma", "is required when gamma is given",
                               [](auto&, auto& a, auto&) { a.dgamma = {}; });
  expect_linear_rejected<gbla>("dgamma", "'gamma' was not",
                               [](auto&, auto& a, auto&) { a.gamma = {}; });
  expect_linear_rejected<bla>("da", "no key gate",
                              [](auto& f, auto& a, auto&) { a.da = f.d.da.view(); });
  expect_linear_rejected<linear_causal>(
      "dstate_in.S", "'state_in.S' was not",
      [](auto& f, auto& a, auto&) { a.dstate_in.S = f.d.dS.view(); });
  expect_linear_rejected<linear_causal>("saved.S", "only bidirectional kinds",
                                        [](auto& f, auto& a, auto&) { a.saved.S = f.S.view(); });
  expect_linear_rejected<bla>("dstate_out.S", "only causal kinds",
                              [](auto& f, auto& a, auto&) { a.dstate_out.S = f.S.view(); });
  expect_linear_rejected<bla>("saved.z", "is required with 'saved.S' when the normaliser is on",
                              [](auto& f, auto& a, auto&) { a.saved.S = f.S.view(); });
  expect_linear_rejected<gbla>(
      "saved.lse", "is required with 'saved.S' under a key gate",
      [](auto& f, auto& a, auto&) { a.saved.S = f.S.view(), a.saved.z = f.z.view(); });
}

TEST_CASE("linear_attention_backward: wrong shapes and aliasing", "[errors][backward][cpu]") {
  expect_linear_rejected<gbla>("da", "must be [B, T, 1] (key_gate::shared) = [2, 17, 1]",
                               [](auto& f, auto& a, auto&) {
                                 a.da = view3<float>(f.spare.data(), {B, T, H});
                               });
  expect_linear_rejected<gbla>(
      "dgamma", "must be [Dv] (norm_weight::shared) = [6]",
      [](auto& f, auto& a, auto&) { a.dgamma = view1<float>(f.spare.data(), {Dv + 1}); });
  expect_linear_rejected<linear_causal>(
      "dstate_in.S", "must be [N, H, D, Dv] = [2, 2, 8, 6]", [](auto& f, auto& a, auto&) {
        a.state_in.S = f.S.view(), a.state_in.z = f.z.view();
        a.dstate_in.S = view4<float>(f.spare.data(), {B, H, Dv, D});
      });
  expect_linear_rejected<linear_causal>(
      "dstate_out.z", "must be [N, H, D] = [2, 2, 8]", [](auto& f, auto& a, auto&) {
        a.dstate_out.z = view3<const float>(f.spare.data(), {B, HQ, D});
      });
  expect_linear_rejected<gbla>("dgate", "overlaps the memory of 'gate'",
                               [](auto& f, auto& a, auto&) {
                                 a.dgate = view4<float>(f.gate.data(), {B, T, HQ, Dv});
                               });
  expect_linear_rejected<gbla>("dv", "overlaps the memory of 'dk'", [](auto& f, auto& a, auto&) {
    a.dv = view4<float>(f.d.dk.data() + 1, {B, T, H, Dv});
  });
  expect_linear_rejected<linear_causal>("dstate_in.S", "overlaps the memory of 'state_in.S'",
                                        [](auto& f, auto& a, auto&) {
                                          a.state_in.S = f.S.view(), a.state_in.z = f.z.view();
                                          a.dstate_in.S = f.S.view();
                                        });
  expect_linear_rejected<bla>("eps", "must be > 0 with the normaliser on",
                              [](auto&, auto&, auto& p) { p.eps = 0; });
}
