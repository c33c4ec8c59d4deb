// Every argument check of attnmix::linear_attention: the error type, a message naming the
// function and the argument with both sizes, and output buffers (out and the state) left
// untouched.

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
using attnmix::linear_attention_args;
using attnmix::linear_attention_params;
using attnmix::view1;
using attnmix::view3;
using attnmix::view4;

namespace {

constexpr index_t B = 2, T = 33, HQ = 4, H = 2, D = 16, Dv = 8;

struct fixture {
  host_tensor<float, 4> q{{B, T, HQ, D}, 0.5f}, k{{B, T, H, D}, 0.25f}, v{{B, T, H, Dv}, 1.0f};
  host_tensor<float, 4> gate{{B, T, HQ, Dv}, 0.3f}, out{{B, T, HQ, Dv}, 42.0f};
  host_tensor<float, 3> a{{B, T, 1}, 0.1f};
  host_tensor<float, 1> gamma{{Dv}, 1.0f};
  host_tensor<float, 4> S_in{{B, H, D, Dv}, 0.0f}, S_out{{B, H, D, Dv}, 42.0f};
  host_tensor<float, 3> z_in{{B, H, D}, 0.0f}, z_out{{B, H, D}, 42.0f};
  host_tensor<float, 2> lse_in{{B, H}, 0.0f}, lse_out{{B, H}, 42.0f};
  std::vector<std::uint8_t> mask = std::vector<std::uint8_t>(B * T, 1);
  std::vector<float> spare = std::vector<float>(1 << 16, 0.0f);  // backs wrongly shaped views
  std::vector<std::int32_t> cu;

  // Everything a gated, normed causal call can take.
  linear_attention_args<float> args() {
    linear_attention_args<float> x{q.view(), k.view(), v.view(), out.view()};
    x.mask = {mask.data(), {B, T}};
    x.a = a.view();
    x.gate = gate.view();
    x.gamma = gamma.view();
    x.state_in = {S_in.view(), z_in.view(), lse_in.view()};
    x.state_out = {S_out.view(), z_out.view(), lse_out.view()};
    return x;
  }
};

struct full_causal : attnmix::linear_causal_policy {
  static constexpr attnmix::key_gate gate = attnmix::key_gate::shared;
  static constexpr attnmix::gated_norm norm = attnmix::gated_norm::per_head;
};

// Calls linear_attention<Kind, Policy> on the fixture after `modify` and checks the rejection.
template <class Kind = attnmix::kind::linear_causal, class Policy = full_causal, class Modify>
void expect_rejected(const std::string& arg, const std::string& detail, Modify modify) {
  fixture f;
  linear_attention_args<float> a = f.args();
  if constexpr (!attnmix::linear_kind_traits<Kind>::causal) a.state_in = {};
  linear_attention_params p;
  modify(f, a, p);
  const auto out_before = f.out.storage(), S_before = f.S_out.storage();
  const auto z_before = f.z_out.storage(), lse_before = f.lse_out.storage();
  expect_error(std::string("attnmix::linear_attention<") + Kind::name + ">", arg, detail,
               [&] { attnmix::linear_attention<Kind, Policy>(a, p); });
  CHECK(bitwise_equal(f.out.storage(), out_before));
  CHECK(bitwise_equal(f.S_out.storage(), S_before));
  CHECK(bitwise_equal(f.z_out.storage(), z_before));
  CHECK(bitwise_equal(f.lse_out.storage(), lse_before));
}

using attnmix::kind::bla;
using attnmix::kind::gbla;

}  // namespace

TEST_CASE("a valid fixture is accepted", "[linear][errors][cpu]") {
  fixture f;
  CHECK_NOTHROW(attnmix::linear_attention<attnmix::kind::linear_causal, full_causal>(f.args()));
  CHECK(std::isfinite(f.out(1, 32, 3, 7)));
  CHECK(f.lse_out(1, 1) != 42.0f);
  fixture g;
  auto a = g.args();
  a.state_in = {};
  CHECK_NOTHROW(attnmix::linear_attention<gbla>(a));
}

TEST_CASE("missing and unexpected tensors", "[linear][errors][cpu]") {
  expect_rejected("q", "was not given", [](fixture&, auto& a, auto&) { a.q = {}; });
  expect_rejected("out", "was not given", [](fixture&, auto& a, auto&) { a.out = {}; });
  expect_rejected<gbla, attnmix::gbla_policy>("a", "key-gate logits",
                                              [](fixture&, auto& a, auto&) { a.a = {}; });
  expect_rejected<gbla, attnmix::gbla_policy>("gate", "gated RMSNorm",
                                              [](fixture&, auto& a, auto&) { a.gate = {}; });
  expect_rejected<bla, attnmix::bla_policy>("a", "no key gate", [](fixture&, auto&, auto&) {});
  expect_rejected<bla, attnmix::bla_policy>("gate", "no gated norm",
                                            [](fixture&, auto& a, auto&) { a.a = {}; });
  expect_rejected<bla, attnmix::bla_policy>(
      "gamma", "no gated norm", [](fixture&, auto& a, auto&) { a.a = {}, a.gate = {}; });
  expect_rejected<gbla, attnmix::gbla_policy>(
      "state_in.S", "only causal kinds",
      [](fixture& f, auto& a, auto&) { a.state_in.S = f.S_in.view(); });
  expect_rejected("state_in.z", "is required with 'state_in.S' when the normaliser is on",
                  [](fixture&, auto& a, auto&) { a.state_in.z = {}; });
  expect_rejected("state_in.lse", "is required with 'state_in.S' under a key gate",
                  [](fixture&, auto& a, auto&) { a.state_in.lse = {}; });
  expect_rejected("state_in.z", "'state_in.S' was not",
                  [](fixture&, auto& a, auto&) { a.state_in.S = {}; });
  expect_rejected<attnmix::kind::linear_causal, attnmix::linear_causal_policy>(
      "a", "no key gate", [](fixture&, auto&, auto&) {});
  expect_rejected<attnmix::kind::linear_causal, attnmix::linear_causal_policy>(
      "state_out.lse", "no key gate",
      [](fixture&, auto& a, auto&) { a.a = {}, a.gate = {}, a.gamma = {}, a.state_in.lse = {}; });
}

TEST_CASE("wrong shapes and head counts name both sizes", "[linear][errors][cpu]") {
  expect_rejected("k", "has shape [2, 33, 2, 15] but must be [B, T, H, D] = [2, 33, 2, 16]",
                  [](fixture& f, auto& a, auto&) {
                    a.k = view4<const float>(f.spare.data(), {B, T, H, D - 1});
                  });
  expect_rejected("k", "H = 3 heads, which does not divide the HQ = 4",
                  [](fixture& f, auto& a, auto&) {
                    a.k = view4<const float>(f.spare.data(), {B, T, 3, D});
                  });
  expect_rejected("v", "[2, 32, 2, 8] but must be [B, T, H, Dv] = [2, 33, 2, 8]",
                  [](fixture& f, auto& a, auto&) {
                    a.v = view4<const float>(f.spare.data(), {B, T - 1, H, Dv});
                  });
  expect_rejected("out", "[2, 33, 4, 9] but must be [B, T, HQ, Dv] = [2, 33, 4, 8]",
                  [](fixture& f, auto& a, auto&) {
                    a.out = view4<float>(f.spare.data(), {B, T, HQ, Dv + 1});
                  });
  expect_rejected("mask", "has shape [2, 32] but must be [B, T] = [2, 33]",
                  [](fixture& f, auto& a, auto&) {
                    a.mask = {f.mask.data(), {B, T - 1}};
                  });
  expect_rejected("a", "has shape [2, 33, 2] but must be [B, T, 1] (key_gate::shared) = [2, 33, 1]",
                  [](fixture& f, auto& a, auto&) {
                    a.a = view3<const float>(f.spare.data(), {B, T, H});
                  });
  expect_rejected<attnmix::kind::linear_causal,
                  attnmix::with_key_gate<full_causal, attnmix::key_gate::per_head>>(
      "a", "has shape [2, 33, 1] but must be [B, T, H] (key_gate::per_head) = [2, 33, 2]",
      [](fixture&, auto&, auto&) {});
  expect_rejected("gate", "has shape [2, 33, 2, 8] but must be [B, T, HQ, Dv] = [2, 33, 4, 8]",
                  [](fixture& f, auto& a, auto&) {
                    a.gate = view4<const float>(f.spare.data(), {B, T, H, Dv});
                  });
  expect_rejected(
      "gamma", "has shape [32] but must be [Dv] (norm_weight::shared) = [8]",
      [](fixture& f, auto& a, auto&) { a.gamma = view1<const float>(f.spare.data(), {HQ * Dv}); });
  expect_rejected("state_in.S", "has shape [2, 2, 8, 16] but must be [N, H, D, Dv] = [2, 2, 16, 8]",
                  [](fixture& f, auto& a, auto&) {
                    a.state_in.S = view4<const float>(f.spare.data(), {B, H, Dv, D});
                  });
  expect_rejected("state_out.z", "has shape [1, 2, 16] but must be [N, H, D] = [2, 2, 16]",
                  [](fixture& f, auto& a, auto&) {
                    a.state_out.z = view3<float>(f.spare.data(), {1, H, D});
                  });
  expect_rejected("state_out.lse", "has shape [2, 1] but must be [N, H] = [2, 2]",
                  [](fixture& f, auto& a, auto&) {
                    a.state_out.lse = attnmix::tensor_view<float, 2>(f.spare.data(), {B, 1});
                  });
}

TEST_CASE("bad strides, pointers, memory spaces and aliasing", "[linear][errors][cpu]") {
  expect_rejected("q", "contiguous in its last dimension", [](fixture& f, auto& a, auto&) {
    a.q = view4<const float>(f.spare.data(), {B, T, HQ, D}, {T * HQ * D * 2, HQ * D * 2, D * 2, 2});
  });
  expect_rejected("k", "negative stride", [](fixture& f, auto& a, auto&) {
    a.k = view4<const float>(f.spare.data() + 40000, {B, T, H, D}, {-T * H * D, H * D, D, 1});
  });
  expect_rejected("v", "null pointer", [](fixture&, auto& a, auto&) {
    a.v = view4<const float>(nullptr, {B, T, H, Dv});
  });
  expect_rejected(
      "k", "device memory but the cpu backend needs host memory", [](fixture& f, auto& a, auto&) {
        a.k = view4<const float>(f.k.data(), {B, T, H, D}, attnmix::memory_space::device);
      });
  expect_rejected("mask", "device memory", [](fixture& f, auto& a, auto&) {
    a.mask = {f.mask.data(), {B, T}, attnmix::memory_space::device};
  });
  expect_rejected("out", "overlap", [](fixture& f, auto& a, auto&) {
    a.out = view4<float>(f.spare.data(), {B, T, HQ, Dv}, {0, HQ * Dv, Dv, 1});
  });
  expect_rejected("out", "overlaps the memory of 'q'", [](fixture& f, auto& a, auto&) {
    a.out = view4<float>(const_cast<float*>(f.q.data()), {B, T, HQ, Dv});
  });
  expect_rejected("state_out.S", "overlaps the memory of 'out'", [](fixture& f, auto& a, auto&) {
    a.state_out.S = view4<float>(f.out.data() + 8, {B, H, D, Dv});
  });
  expect_rejected("state_out.z", "overlaps the memory of 'state_in.S'",
                  [](fixture& f, auto& a, auto&) {
                    a.state_out.z = view3<float>(f.S_in.data(), {B, H, D});
                  });
  // The very same view in and out is an in-place update and is accepted.
  fixture f;
  auto a = f.args();
  a.state_out = {f.S_in.view(), f.z_in.view(), f.lse_in.view()};
  CHECK_NOTHROW(attnmix::linear_attention<attnmix::kind::linear_causal, full_causal>(a));
}

TEST_CASE("bad runtime parameters", "[linear][errors][cpu]") {
  expect_rejected("scale", "must be finite",
                  [](fixture&, auto&, auto& p) { p.scale = std::nan(""); });
  expect_rejected("eps", "must be finite and >= 0",
                  [](fixture&, auto&, auto& p) { p.eps = -1e-6; });
  expect_rejected("eps", "must be > 0 with the normaliser on",
                  [](fixture&, auto&, auto& p) { p.eps = 0; });
  expect_rejected("norm_eps", "must be finite and > 0",
                  [](fixture&, auto&, auto& p) { p.norm_eps = 0; });
}

TEST_CASE("bad cu_seqlens", "[linear][errors][cpu]") {
  auto with_offsets = [](std::vector<std::int32_t> offsets, bool batch_one = true) {
    return [offsets, batch_one](fixture& f, auto& a, auto& p) {
      f.cu = offsets;
      p.cu_seqlens = view1<const std::int32_t>(f.cu.data(), {index_t(f.cu.size())});
      a.state_in = {};
      a.state_out = {};
      if (batch_one) {  // a packed [1, 2T] batch over the same storage
        a.q = view4<const float>(f.q.data(), {1, B * T, HQ, D});
        a.k = view4<const float>(f.k.data(), {1, B * T, H, D});
        a.v = view4<const float>(f.v.data(), {1, B * T, H, Dv});
        a.out = view4<float>(f.out.data(), {1, B * T, HQ, Dv});
        a.gate = view4<const float>(f.gate.data(), {1, B * T, HQ, Dv});
        a.a = view3<const float>(f.a.data(), {1, B * T, 1});
        a.mask = {f.mask.data(), {1, B * T}};
      }
    };
  };
  expect_rejected("cu_seqlens", "entry 2 (10) < entry 1 (20)", with_offsets({0, 20, 10, 66}));
  expect_rejected("cu_seqlens", "ends at 60 but the packed length is 66",
                  with_offsets({0, 20, 60}));
  expect_rejected("cu_seqlens", "must start at 0", with_offsets({3, 20, 66}));
  expect_rejected("q", "B = 1 when cu_seqlens is given but has B = 2",
                  with_offsets({0, 33}, false));
  // Three sequences need a state of N = 3.
  expect_rejected("state_out.S", "[N, H, D, Dv] = [3, 2, 16, 8]",
                  [&](fixture& f, auto& a, auto& p) {
                    with_offsets({0, 20, 20, 66})(f, a, p);
                    a.state_out.S = f.S_out.view();
                  });
  fixture f;
  auto a = f.args();
  linear_attention_params p;
  with_offsets({0, 20, 20, 66})(f, a, p);
  CHECK_NOTHROW(attnmix::linear_attention<attnmix::kind::linear_causal, full_causal>(a, p));
}
