// Every argument check of attnmix::attention: the error type, a message naming the function
// and the argument, and output buffers left untouched.

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "support/catch.hpp"
#include "support/errors.hpp"
#include "support/testing.hpp"

using namespace attnmix_test;
using attnmix::attention_args;
using attnmix::attention_params;
using attnmix::host_tensor;
using attnmix::index_t;
using attnmix::view3;
using attnmix::view4;

namespace {

constexpr index_t B = 2, T = 33, HQ = 4, H = 2, D = 16, Dv = 8;

struct fixture {
  host_tensor<float, 4> q{{B, T, HQ, D}, 0.5f}, k{{B, T, H, D}, 0.25f}, v{{B, T, H, Dv}, 1.0f};
  host_tensor<float, 4> out{{B, T, HQ, Dv}, 42.0f};
  host_tensor<float, 3> g{{B, T, HQ}, -0.1f}, lse{{B, T, HQ}, 42.0f};
  std::vector<float> spare = std::vector<float>(1 << 16, 0.0f);  // backs wrongly shaped views
  std::vector<std::int32_t> cu;

  attention_args<float> args() {
    attention_args<float> a{q.view(), k.view(), v.view(), out.view()};
    a.g = g.view();
    a.lse = lse.view();
    return a;
  }
};

template <class Kind = attnmix::kind::fox, class Modify>
void expect_rejected(const std::string& arg, const std::string& detail, Modify modify) {
  fixture f;
  attention_args<float> a = f.args();
  attention_params p;
  modify(f, a, p);
  const std::vector<float> out_before = f.out.storage(), lse_before = f.lse.storage();
  expect_error(std::string("attnmix::attention<") + Kind::name + ">", arg, detail,
               [&] { attnmix::attention<Kind>(a, p); });
  CHECK(bitwise_equal(f.out.storage(), out_before));
  CHECK(bitwise_equal(f.lse.storage(), lse_before));
}

}  // namespace

TEST_CASE("a valid fixture is accepted", "[errors][cpu]") {
  fixture f;
  CHECK_NOTHROW(attnmix::attention<attnmix::kind::fox>(f.args()));
  CHECK(std::isfinite(f.out(1, 32, 3, 7)));
}

TEST_CASE("missing and unexpected tensors", "[errors][cpu]") {
  expect_rejected("q", "was not given", [](fixture&, auto& a, auto&) { a.q = {}; });
  expect_rejected("out", "was not given", [](fixture&, auto& a, auto&) { a.out = {}; });
  expect_rejected("g", "forget gate", [](fixture&, auto& a, auto&) { a.g = {}; });
  expect_rejected<attnmix::kind::softmax>("g", "no forget gate", [](fixture&, auto&, auto&) {});
  expect_rejected("w", "no Householder", [](fixture& f, auto& a, auto&) {
    a.w = view4<const float>(f.spare.data(), {B, T, H, D});
  });
}

TEST_CASE("wrong shapes name both sizes", "[errors][cpu]") {
  expect_rejected("k", "has shape [2, 33, 2, 15] but must be [B, Tk, H, D] = [2, 33, 2, 16]",
                  [](fixture& f, auto& a, auto&) {
                    a.k = view4<const float>(f.spare.data(), {B, T, H, D - 1});
                  });
  expect_rejected("k", "H = 3 heads, which does not divide the HQ = 4",
                  [](fixture& f, auto& a, auto&) {
                    a.k = view4<const float>(f.spare.data(), {B, T, 3, D});
                  });
  expect_rejected("v", "[2, 32, 2, 8] but must be [B, Tk, H, Dv] = [2, 33, 2, 8]",
                  [](fixture& f, auto& a, auto&) {
                    a.v = view4<const float>(f.spare.data(), {B, T - 1, H, Dv});
                  });
  expect_rejected("out", "[2, 33, 4, 9] but must be [B, T, HQ, Dv] = [2, 33, 4, 8]",
                  [](fixture& f, auto& a, auto&) {
                    a.out = view4<float>(f.spare.data(), {B, T, HQ, Dv + 1});
                  });
  expect_rejected("g", "[2, 33, 2] but must be [B, Tk, HQ] = [2, 33, 4]",
                  [](fixture& f, auto& a, auto&) {
                    a.g = view3<const float>(f.spare.data(), {B, T, H});
                  });
  expect_rejected("lse", "[2, 33, 2] but must be [B, T, HQ] = [2, 33, 4]",
                  [](fixture& f, auto& a, auto&) {
                    a.lse = view3<float>(f.spare.data(), {B, T, H});
                  });
  expect_rejected("q", "at least one head", [](fixture& f, auto& a, auto&) {
    a.q = view4<const float>(f.spare.data(), {B, T, 0, D});
  });
}

TEST_CASE("bad strides, pointers, memory spaces and aliasing", "[errors][cpu]") {
  expect_rejected("q", "contiguous in its last dimension", [](fixture& f, auto& a, auto&) {
    a.q = view4<const float>(f.spare.data(), {B, T, HQ, D}, {T * HQ * D * 2, HQ * D * 2, D * 2, 2});
  });
  expect_rejected("k", "negative stride", [](fixture& f, auto& a, auto&) {
    a.k = view4<const float>(f.spare.data() + 40000, {B, T, H, D}, {-T * H * D, H * D, D, 1});
  });
  expect_rejected("v", "null pointer", [](fixture&, auto& a, auto&) {
    a.v = view4<const float>(nullptr, {B, T, H, Dv});
  });
  expect_rejected("out", "overlap", [](fixture& f, auto& a, auto&) {
    a.out = view4<float>(f.spare.data(), {B, T, HQ, Dv}, {0, HQ * Dv, Dv, 1});
  });
  expect_rejected("out", "overlaps the memory of 'q'", [](fixture& f, auto& a, auto&) {
    a.out = view4<float>(const_cast<float*>(f.q.data()), {B, T, HQ, Dv});
  });
  expect_rejected("lse", "overlaps the memory of 'out'", [](fixture& f, auto& a, auto&) {
    a.lse = view3<float>(f.out.data() + 8, {B, T, HQ});
  });
  expect_rejected(
      "k", "device memory but the cpu backend needs host memory", [](fixture& f, auto& a, auto&) {
        a.k = view4<const float>(f.k.data(), {B, T, H, D}, attnmix::memory_space::device);
      });
}

TEST_CASE("bad runtime parameters", "[errors][cpu]") {
  expect_rejected("scale", "must be finite",
                  [](fixture&, auto&, auto& p) { p.scale = std::nan(""); });
  expect_rejected("window", "must be >= 0", [](fixture&, auto&, auto& p) { p.window = -1; });
}

TEST_CASE("bad cu_seqlens", "[errors][cpu]") {
  auto with_offsets = [](std::vector<std::int32_t> offsets, bool batch_one = true) {
    return [offsets, batch_one](fixture& f, auto& a, auto& p) {
      f.cu = offsets;
      p.cu_seqlens = attnmix::view1<const std::int32_t>(f.cu.data(), {index_t(f.cu.size())});
      if (batch_one) {  // a packed [1, 2T] batch over the same storage
        a.q = view4<const float>(f.q.data(), {1, B * T, HQ, D});
        a.k = view4<const float>(f.k.data(), {1, B * T, H, D});
        a.v = view4<const float>(f.v.data(), {1, B * T, H, Dv});
        a.out = view4<float>(f.out.data(), {1, B * T, HQ, Dv});
        a.g = view3<const float>(f.g.data(), {1, B * T, HQ});
        a.lse = view3<float>(f.lse.data(), {1, B * T, HQ});
      }
    };
  };
  expect_rejected("cu_seqlens", "entry 2 (10) < entry 1 (20)", with_offsets({0, 20, 10, 66}));
  expect_rejected("cu_seqlens", "ends at 60 but the packed length is 66",
                  with_offsets({0, 20, 60}));
  expect_rejected("cu_seqlens", "must start at 0", with_offsets({3, 20, 66}));
  expect_rejected("cu_seqlens", "N+1 >= 1", with_offsets({}));
  expect_rejected("q", "B = 1 when cu_seqlens is given but has B = 2",
                  with_offsets({0, 33}, false));
  // Sanity: the same packing with good offsets is accepted.
  fixture f;
  attention_args<float> a = f.args();
  attention_params p;
  with_offsets({0, 20, 20, 66})(f, a, p);
  CHECK_NOTHROW(attnmix::attention<attnmix::kind::fox>(a, p));
}
