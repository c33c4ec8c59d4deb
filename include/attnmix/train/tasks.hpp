#pragma once
// Generators of the PaTH paper's synthetic state-tracking tasks (Yang et al. 2025, §4.1), as
// token batches for train::language_model:
//   flip_flop: write / read / ignore instructions each followed by a bit; after a read the next
//     token is the last written bit (Liu et al. 2023; the paper's Table 1).
//   a5: words over the alternating group A5 (the 60 even permutations of 5 items); the label at
//     each position is the composition of the word so far, a task no fixed-depth model of
//     commuting steps solves (the paper's Figure 3).
// Labels are -100 (train::ignore_label) where there is nothing to predict; `scored` marks the
// positions a task's error is measured at. Deterministic for a given generator state.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "attnmix/config.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/train/language_model.hpp"

namespace attnmix {
namespace detail {
inline void check_task_shape(const char* fn, index_t B, index_t T) {
  require(B > 0, fn, "batch", "must be positive, got ", B);
  require(T > 0, fn, "length", "must be positive, got ", T);
}
}  // namespace detail

namespace train {

// B sequences of T tokens each, row-major, with the next-token labels and the scored positions.
struct task_batch {
  index_t batch = 0, length = 0;
  std::vector<std::int32_t> tokens, labels;
  std::vector<char> scored;
};

namespace flip_flop {

// Tokens: the three instructions and the two bits.
enum token : std::int32_t { write = 0, read = 1, ignore = 2, bit0 = 3, bit1 = 4, vocab = 5 };

// Sequences of (instruction, bit) pairs, the first a write and the last a read; the others are
// ignore with probability p_ignore, else write or read with equal odds. The bit after a read is
// the last written bit, after a write or an ignore a fair coin. Labels are the next tokens (the
// language-modelling objective on every token); scored marks the positions whose label is a read
// bit. An odd T ends with an ignore; T is at least 4.
inline task_batch make(std::mt19937_64& gen, index_t B, index_t T, double p_ignore) {
  const char* fn = "attnmix::train::flip_flop::make";
  detail::check_task_shape(fn, B, T);
  detail::require(T >= 4, fn, "length", "must be at least 4 (a write and a read), got ", T);
  detail::require(p_ignore >= 0.0 && p_ignore <= 1.0, fn, "p_ignore", "must be in [0, 1], got ",
                  p_ignore);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  task_batch b{B, T, std::vector<std::int32_t>(B * T), std::vector<std::int32_t>(B * T),
               std::vector<char>(B * T, 0)};
  for (index_t s = 0; s < B; ++s) {
    std::int32_t* t = b.tokens.data() + s * T;
    std::int32_t last = bit0;
    for (index_t p = 0; p + 1 < T; p += 2) {
      std::int32_t op = ignore;
      if (p == 0) {
        op = write;
      } else if (p + 3 >= T) {  // the last whole pair
        op = read;
      } else {
        const double x = u(gen);
        op = x < p_ignore ? ignore : x < p_ignore + (1 - p_ignore) / 2 ? write : read;
      }
      const std::int32_t random_bit = u(gen) < 0.5 ? bit0 : bit1;
      t[p] = op;
      t[p + 1] = op == read ? last : random_bit;
      if (op == write) last = random_bit;
    }
    if (T % 2 == 1) t[T - 1] = ignore;
    for (index_t p = 0; p < T; ++p) {
      b.labels[s * T + p] = p + 1 < T ? t[p + 1] : ignore_label;
      b.scored[s * T + p] = p + 1 < T && t[p] == read;
    }
  }
  return b;
}

}  // namespace flip_flop

namespace a5 {

using permutation = std::array<std::int32_t, 5>;  // item i goes to p[i]
constexpr std::int32_t order = 60;                // elements of A5, the tokens 0 .. 59

// The even permutations of 5 items in lexicographic order; element 0 is the identity.
inline const std::vector<permutation>& elements() {
  static const std::vector<permutation> all = [] {
    std::vector<permutation> out(order);
    std::size_t n = 0;
    permutation p = {0, 1, 2, 3, 4};
    do {
      int inversions = 0;
      for (int i = 0; i < 5; ++i)
        for (int j = i + 1; j < 5; ++j) inversions += p[i] > p[j];
      if (inversions % 2 == 0) out[n++] = p;
    } while (std::next_permutation(p.begin(), p.end()));
    return out;
  }();
  return all;
}

// The index of permutation p among elements(), or -1 if p is odd or not a permutation.
inline std::int32_t index_of(const permutation& p) {
  const auto& all = elements();
  const auto it = std::lower_bound(all.begin(), all.end(), p);
  return it != all.end() && *it == p ? std::int32_t(it - all.begin()) : -1;
}

// Element b after element a (apply a, then b): (b . a)[i] = b[a[i]].
inline std::int32_t compose(std::int32_t a, std::int32_t b) {
  static const std::vector<std::int32_t> table = [] {
    const auto& all = elements();
    std::vector<std::int32_t> t(order * order);
    for (std::int32_t x = 0; x < order; ++x)
      for (std::int32_t y = 0; y < order; ++y) {
        permutation r;
        for (int i = 0; i < 5; ++i) r[i] = all[y][all[x][i]];
        t[x * order + y] = index_of(r);
      }
    return t;
  }();
  return table[a * order + b];
}

// Words of T uniformly drawn elements; the label at position p is the product of the word's
// elements 0 .. p applied in order (each one after the ones before). Every position is scored.
inline task_batch make(std::mt19937_64& gen, index_t B, index_t T) {
  detail::check_task_shape("attnmix::train::a5::make", B, T);
  std::uniform_int_distribution<std::int32_t> pick(0, order - 1);
  task_batch b{B, T, std::vector<std::int32_t>(B * T), std::vector<std::int32_t>(B * T),
               std::vector<char>(B * T, 1)};
  for (index_t s = 0; s < B; ++s) {
    std::int32_t state = 0;
    for (index_t p = 0; p < T; ++p) {
      const std::int32_t x = pick(gen);
      state = compose(state, x);
      b.tokens[s * T + p] = x;
      b.labels[s * T + p] = state;
    }
  }
  return b;
}

}  // namespace a5
}  // namespace train
}  // namespace attnmix
