#pragma once
// Scalar types. float and double run on every backend; half and bfloat16 are 16-bit storage
// types that host code can create, convert and copy (the CUDA backend computes with them).
// Accumulation is float for 16- and 32-bit inputs and double for double (accum_t).

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attnmix/config.hpp"

namespace attnmix {

namespace detail {

ATTNMIX_HOST_DEVICE inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
ATTNMIX_HOST_DEVICE inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// IEEE binary16 from binary32, round to nearest even; overflow gives inf, NaN stays NaN.
ATTNMIX_HOST_DEVICE inline std::uint16_t float_to_half_bits(float value) {
  std::uint32_t f = float_bits(value);
  const std::uint32_t sign = f & 0x80000000u;
  f ^= sign;
  std::uint32_t out;
  if (f >= (127u + 16u) << 23) {  // >= 2^16, inf or NaN
    out = f > (255u << 23) ? 0x7e00u : 0x7c00u;
  } else if (f < (113u << 23)) {  // result is subnormal or zero: let a float add round it
    const std::uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    out = float_bits(bits_float(f) + bits_float(magic)) - magic;
  } else {
    const std::uint32_t odd = (f >> 13) & 1u;
    f += (static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu + odd;
    out = f >> 13;
  }
  return static_cast<std::uint16_t>(out | (sign >> 16));
}

ATTNMIX_HOST_DEVICE inline float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float
    return bits_float(sign | float_bits(static_cast<float>(mant) * 5.9604644775390625e-8f));
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// bfloat16 from binary32, round to nearest even; NaN stays a quiet NaN.
ATTNMIX_HOST_DEVICE inline std::uint16_t float_to_bfloat16_bits(float value) {
  const std::uint32_t f = float_bits(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((f >> 16) | 0x40u);
  return static_cast<std::uint16_t>((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}

ATTNMIX_HOST_DEVICE inline float bfloat16_bits_to_float(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail

// IEEE binary16 storage. Same size and layout as CUDA's __half.
struct half {
  std::uint16_t bits = 0;
  half() = default;
  ATTNMIX_HOST_DEVICE explicit half(float f) : bits(detail::float_to_half_bits(f)) {}
  ATTNMIX_HOST_DEVICE explicit operator float() const { return detail::half_bits_to_float(bits); }
  ATTNMIX_HOST_DEVICE static half from_bits(std::uint16_t b) {
    half h;
    h.bits = b;
    return h;
  }
};

// bfloat16 storage (8-bit exponent, 7-bit mantissa). Same size and layout as __nv_bfloat16.
struct bfloat16 {
  std::uint16_t bits = 0;
  bfloat16() = default;
  ATTNMIX_HOST_DEVICE explicit bfloat16(float f) : bits(detail::float_to_bfloat16_bits(f)) {}
  ATTNMIX_HOST_DEVICE explicit operator float() const {
    return detail::bfloat16_bits_to_float(bits);
  }
  ATTNMIX_HOST_DEVICE static bfloat16 from_bits(std::uint16_t b) {
    bfloat16 h;
    h.bits = b;
    return h;
  }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2, "16-bit storage types must be 2 bytes");

// What attnmix knows about an element type.
template <class T>
struct scalar_traits {
  static constexpr bool supported = false;
};
template <>
struct scalar_traits<float> {
  static constexpr bool supported = true;
  static constexpr const char* name = "float";
  using accum = float;
};
template <>
struct scalar_traits<double> {
  static constexpr bool supported = true;
  static constexpr const char* name = "double";
  using accum = double;
};
template <>
struct scalar_traits<half> {
  static constexpr bool supported = true;
  static constexpr const char* name = "half";
  using accum = float;
};
template <>
struct scalar_traits<bfloat16> {
  static constexpr bool supported = true;
  static constexpr const char* name = "bfloat16";
  using accum = float;
};

template <class T>
inline constexpr bool is_scalar_v = scalar_traits<std::remove_const_t<T>>::supported;

// Accumulator and statistics type for inputs of type T. Gates, w and beta use it too.
template <class T>
using accum_t = typename scalar_traits<std::remove_const_t<T>>::accum;

// Conversions that work for every attnmix scalar.
template <class To, class From>
ATTNMIX_HOST_DEVICE To convert(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<From, half> || std::is_same_v<From, bfloat16>) {
    return convert<To>(static_cast<float>(x));
  } else if constexpr (std::is_same_v<To, half> || std::is_same_v<To, bfloat16>) {
    return To(static_cast<float>(x));
  } else {
    return static_cast<To>(x);
  }
}

}  // namespace attnmix
