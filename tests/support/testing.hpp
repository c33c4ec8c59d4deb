#pragma once
// Helpers for attnmix tests: seeded random inputs, poisoned outputs, error norms.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/core/host_tensor.hpp"
#include "attnmix/core/scalar.hpp"

namespace attnmix_test {

using attnmix::index_t;

// A fresh seed per run unless ATTNMIX_TEST_SEED is set; tests INFO() it so that a failure
// can be replayed.
inline std::uint64_t test_seed() {
  static const std::uint64_t seed = []() -> std::uint64_t {
    if (const char* s = std::getenv("ATTNMIX_TEST_SEED")) return std::strtoull(s, nullptr, 10);
    return (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  }();
  return seed;
}

class rng {
 public:
  explicit rng(std::uint64_t salt = 0) : gen_(test_seed() ^ (salt * 0x9E3779B97F4A7C15ull)) {}

  double uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(gen_);
  }
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen_); }
  index_t integer(index_t lo, index_t hi) {  // inclusive
    return std::uniform_int_distribution<index_t>(lo, hi)(gen_);
  }

  template <class T, int R>
  void fill_normal(attnmix::host_tensor<T, R>& t, double sigma = 1.0) {
    for (auto& x : t.storage()) x = static_cast<T>(sigma * normal());
  }
  template <class T, int R>
  void fill_uniform(attnmix::host_tensor<T, R>& t, double lo, double hi) {
    for (auto& x : t.storage()) x = static_cast<T>(uniform(lo, hi));
  }

 private:
  std::mt19937_64 gen_;
};

// NaN everywhere, so that an element the call forgets to write fails the comparison.
template <class T, int R>
void poison(attnmix::host_tensor<T, R>& t) {
  t.fill(std::numeric_limits<T>::quiet_NaN());
}

template <class T>
std::vector<double> to_double(const std::vector<T>& x) {
  return std::vector<double>(x.begin(), x.end());
}

// Element-wise attnmix::convert, e.g. float inputs rounded to bfloat16, or half outputs widened.
template <class To, class From>
std::vector<To> convert_all(const std::vector<From>& x) {
  std::vector<To> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = attnmix::convert<To>(x[i]);
  return y;
}

// ||out - ref|| / ||ref|| (Frobenius); NaN anywhere in out gives +inf. ||ref|| == 0 compares
// absolutely.
template <class T>
double rel_error(const std::vector<T>& out, const std::vector<double>& ref) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double o = static_cast<double>(out[i]);
    if (!std::isfinite(o)) return std::numeric_limits<double>::infinity();
    num += (o - ref[i]) * (o - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// ||out - ref|| / max(||ref||, floor): rel_error where a sum that cancels is held to the scale of
// its terms instead (float's rounding is relative to the terms); still ||out|| when ref is 0.
template <class T>
double floored_error(const std::vector<T>& out, const std::vector<double>& ref, double floor) {
  double ref2 = 0;
  for (double x : ref) ref2 += x * x;
  if (ref2 >= floor * floor || ref2 == 0) return rel_error(out, ref);  // no floor needed, or empty
  return rel_error(out, ref) * std::sqrt(ref2) / floor;
}

// The floor a tenth of the norm of the terms that `ref` sums (`sizes`: the same computation on
// absolute values).
template <class T>
double floored_error(const std::vector<T>& out, const std::vector<double>& ref,
                     const std::vector<double>& sizes) {
  double sizes2 = 0;
  for (double x : sizes) sizes2 += x * x;
  return floored_error(out, ref, std::sqrt(sizes2) / 10);
}

// Error of log-sum-exp values (natural log of a softmax normaliser). What matters is the
// absolute error, which is the relative error of the normaliser itself, so values near 0 count as
// magnitude 1: ||out - ref|| / max(||ref||, sqrt(n)). -inf (no visible key) must match exactly.
template <class T>
double lse_error(const std::vector<T>& out, const std::vector<double>& ref) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0, finite = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double o = static_cast<double>(out[i]), x = ref[i];
    if (std::isinf(x)) {
      if (o != x) return std::numeric_limits<double>::infinity();
      continue;
    }
    if (!std::isfinite(o)) return std::numeric_limits<double>::infinity();
    num += (o - x) * (o - x), den += x * x, finite += 1;
  }
  return std::sqrt(num / std::max(den, finite > 0 ? finite : 1.0));
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// max |x - ref| / max |ref| (absolute when ref is all 0); NaN or inf in x gives +inf.
template <class X>
double max_rel(const std::vector<X>& x, const std::vector<double>& ref) {
  if (x.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double o = attnmix::convert<double>(x[i]);
    if (!std::isfinite(o)) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::abs(o - ref[i]));
    den = std::max(den, std::abs(ref[i]));
  }
  return den > 0 ? num / den : num;
}

// The unit roundoff of T (of 16-bit types: what one rounding to T may lose, relatively).
template <class T>
constexpr double unit_roundoff() {
  return std::is_same_v<T, attnmix::bfloat16> ? 0x1p-8
         : std::is_same_v<T, attnmix::half>   ? 0x1p-11
                                              : 0x1p-24;
}

// DESIGN.md tolerances for relative error against a float64 oracle.
template <class T>
constexpr double tolerance() {
  return sizeof(T) >= 8 ? 1e-12 : sizeof(T) == 4 ? 1e-5 : 1e-2;
}

}  // namespace attnmix_test
