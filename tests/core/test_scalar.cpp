// half and bfloat16 storage conversions.

#include <cmath>
#include <cstdint>
#include <limits>

#include "attnmix/core/scalar.hpp"
#include "support/catch.hpp"

using attnmix::bfloat16;
using attnmix::half;

TEST_CASE("every finite half round-trips through float exactly", "[core][scalar]") {
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const half h = half::from_bits(static_cast<std::uint16_t>(bits));
    const float f = static_cast<float>(h);
    if (std::isnan(f)) {
      CHECK(((bits >> 10) & 0x1f) == 0x1f);
      CHECK(std::isnan(static_cast<float>(half(f))));
      continue;
    }
    CHECK(half(f).bits == bits);
  }
}

TEST_CASE("half conversion rounds to nearest even and saturates to inf", "[core][scalar]") {
  CHECK(static_cast<float>(half(1.0f)) == 1.0f);
  CHECK(static_cast<float>(half(65504.0f)) == 65504.0f);
  CHECK(std::isinf(static_cast<float>(half(65520.0f))));  // halfway to 2^16 rounds up
  CHECK(static_cast<float>(half(65519.0f)) == 65504.0f);
  CHECK(static_cast<float>(half(1.0f + 0x1p-11f)) == 1.0f);                // tie, rounds to even
  CHECK(static_cast<float>(half(1.0f + 3 * 0x1p-11f)) == 1.0f + 0x1p-9f);  // tie, rounds to even
  CHECK(static_cast<float>(half(0x1p-24f)) == 0x1p-24f);                   // smallest subnormal
  CHECK(static_cast<float>(half(0x1p-26f)) == 0.0f);                       // below half of it
  CHECK(half(-0.0f).bits == 0x8000u);
  CHECK(std::isinf(static_cast<float>(half(std::numeric_limits<float>::infinity()))));
}

TEST_CASE("bfloat16 conversion rounds to nearest even", "[core][scalar]") {
  CHECK(static_cast<float>(bfloat16(1.0f)) == 1.0f);
  CHECK(static_cast<float>(bfloat16(1.0f + 0x1p-8f)) == 1.0f);                // tie to even
  CHECK(static_cast<float>(bfloat16(1.0f + 3 * 0x1p-8f)) == 1.0f + 0x1p-6f);  // tie to even
  CHECK(static_cast<float>(bfloat16(1.0f + 0x1p-8f + 0x1p-20f)) == 1.0f + 0x1p-7f);
  CHECK(std::isnan(static_cast<float>(bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const bfloat16 b = bfloat16::from_bits(static_cast<std::uint16_t>(bits));
    const float f = static_cast<float>(b);
    if (!std::isnan(f)) CHECK(bfloat16(f).bits == bits);
  }
}

TEST_CASE("accumulator types", "[core][scalar]") {
  STATIC_REQUIRE(std::is_same_v<attnmix::accum_t<half>, float>);
  STATIC_REQUIRE(std::is_same_v<attnmix::accum_t<bfloat16>, float>);
  STATIC_REQUIRE(std::is_same_v<attnmix::accum_t<const float>, float>);
  STATIC_REQUIRE(std::is_same_v<attnmix::accum_t<double>, double>);
  CHECK(attnmix::convert<float>(attnmix::convert<bfloat16>(2.5)) == 2.5f);
}
