// tensor_view, host_tensor and the validation helpers.

#include <string>

#include "attnmix/core/host_tensor.hpp"
#include "attnmix/core/validate.hpp"
#include "support/catch.hpp"

using attnmix::index_t;

TEST_CASE("contiguous views are row-major", "[core][view]") {
  attnmix::host_tensor<int, 3> t({2, 3, 4});
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<int>(i);
  auto v = t.view();
  CHECK(v.stride(0) == 12);
  CHECK(v.stride(1) == 4);
  CHECK(v.stride(2) == 1);
  CHECK(v(1, 2, 3) == 23);
  attnmix::tensor_view<const int, 3> c = v;  // T -> const T
  CHECK(c(1, 0, 2) == 14);
  CHECK(c.has_value());
  CHECK_FALSE(attnmix::tensor_view<const int, 3>{}.has_value());
  CHECK(attnmix::shape_string(v) == "[2, 3, 4]");
  // The form error messages take, formatted only when one is built.
  CHECK(attnmix::detail::concat("shape ", attnmix::detail::shape_of(v)) == "shape [2, 3, 4]");
}

TEST_CASE("overlap and aliasing checks", "[core][view]") {
  std::vector<float> buf(64);
  const std::string fn = "f";
  attnmix::tensor_view<float, 2> ok(buf.data(), {4, 8});
  CHECK_NOTHROW(attnmix::detail::check_non_overlapping(fn, "x", ok));
  attnmix::tensor_view<float, 2> broadcast(buf.data(), {4, 8}, {0, 1});
  CHECK_THROWS_WITH(attnmix::detail::check_non_overlapping(fn, "x", broadcast),
                    "f: argument 'x' has strides that make elements overlap (shape [4, 8])");
  attnmix::tensor_view<float, 2> transposed(buf.data(), {8, 4}, {1, 8});
  CHECK_NOTHROW(attnmix::detail::check_non_overlapping(fn, "x", transposed));
  attnmix::tensor_view<float, 2> first(buf.data(), {2, 8}), second(buf.data() + 16, {2, 8});
  CHECK_NOTHROW(attnmix::detail::check_no_alias(fn, "a", first, "b", second));
  attnmix::tensor_view<float, 2> shifted(buf.data() + 15, {2, 8});
  CHECK_THROWS_AS(attnmix::detail::check_no_alias(fn, "a", first, "b", shifted), attnmix::error);
}

TEST_CASE("offset checks name the argument and the entry", "[core][view]") {
  std::vector<std::int32_t> cu{0, 5, 3, 9};
  attnmix::view1<const std::int32_t> v(cu.data(), {4});
  try {
    attnmix::detail::check_offsets("fn", "cu_seqlens", v, 9);
    FAIL("no error");
  } catch (const attnmix::error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("fn: argument 'cu_seqlens'") != std::string::npos);
    CHECK(msg.find("entry 2 (3) < entry 1 (5)") != std::string::npos);
  }
  cu = {0, 5, 9};
  attnmix::view1<const std::int32_t> good(cu.data(), {3});
  CHECK_NOTHROW(attnmix::detail::check_offsets("fn", "cu_seqlens", good, 9));
  CHECK_THROWS_AS(attnmix::detail::check_offsets("fn", "cu_seqlens", good, 10), attnmix::error);
}
