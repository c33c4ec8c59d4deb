#pragma once
// Generators of the PaTH paper's synthetic state-tracking tasks (Yang et al. 2025, §4.1), as
// token batches for train::language_model:
//   flip_flop: write / read / ignore instructions each followed by a bit; after a read the next
//     token is the last written bit (Liu et al. 2023; the paper's Table 1).
//   a5: words over the alternating group A5 (the 60 even permutations of 5 items); the label at
//     each position is the composition of the word so far, a task no fixed-depth model of
//     commuting steps solves (the paper's Figure 3).
//   mqrar: multi-query repeated associative recall, N-back: keys are assigned values again and
//     again; a query of a key asks for the value assigned to it N assignments of that key ago.
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

namespace mqrar {

// Tokens: `keys` assignment keys [0, keys), as many query keys [keys, 2 keys) and `values`
// values [2 keys, 2 keys + values).
inline std::int32_t vocab(index_t keys, index_t values) {
  return std::int32_t(2 * keys + values);
}

// Sequences of T / 2 (key, value) pairs. A pair is a query, with probability p_query once some
// key has been assigned n_back times: the query key of such a key (drawn uniformly among them),
// then the value assigned to that key n_back assignments of it ago (1: the latest). Otherwise it
// assigns a uniformly drawn value to a uniformly drawn key. The label at a query key is the
// answer (scored there); every other label is ignore_label, as MQAR trains on its answers only.
// T is even and at least 4; keys, values and n_back are at least 1.
inline task_batch make(std::mt19937_64& gen, index_t B, index_t T, int n_back, index_t keys,
                       index_t values, double p_query = 0.25) {
  const char* fn = "attnmix::train::mqrar::make";
  detail::check_task_shape(fn, B, T);
  detail::require(T >= 4 && T % 2 == 0, fn, "length",
                  "must be even and at least 4 (an assignment and a query), got ", T);
  detail::require(n_back >= 1, fn, "n_back", "must be at least 1 (the latest value), got ", n_back);
  detail::require(keys >= 1, fn, "keys", "must be at least 1, got ", keys);
  detail::require(values >= 1, fn, "values", "must be at least 1, got ", values);
  detail::require(2 * keys + values <= INT32_MAX, fn, "values", "and keys make ", 2 * keys + values,
                  " tokens, more than an int32 counts");
  detail::require(p_query >= 0.0 && p_query <= 1.0, fn, "p_query", "must be in [0, 1], got ",
                  p_query);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<index_t> key(0, keys - 1), value(0, values - 1);
  task_batch b{B, T, std::vector<std::int32_t>(B * T),
               std::vector<std::int32_t>(B * T, ignore_label), std::vector<char>(B * T, 0)};
  std::vector<std::vector<std::int32_t>> assigned(static_cast<std::size_t>(keys));
  std::vector<index_t> ready;  // keys assigned n_back times or more
  for (index_t s = 0; s < B; ++s) {
    for (auto& a : assigned) a.clear();
    ready.clear();
    for (index_t p = 0; p < T; p += 2) {
      const index_t at = s * T + p;
      if (!ready.empty() && u(gen) < p_query) {
        const index_t k = ready[std::size_t(
            std::uniform_int_distribution<std::size_t>(0, ready.size() - 1)(gen))];
        const auto& a = assigned[std::size_t(k)];
        const std::int32_t answer = a[a.size() - std::size_t(n_back)];
        b.tokens[at] = std::int32_t(keys + k);
        b.tokens[at + 1] = answer;
        b.labels[at] = answer;
        b.scored[at] = 1;
      } else {
        const index_t k = key(gen);
        const std::int32_t v = std::int32_t(2 * keys + value(gen));
        auto& a = assigned[std::size_t(k)];
        a.push_back(v);
        if (a.size() == std::size_t(n_back)) ready.push_back(k);
        b.tokens[at] = std::int32_t(k);
        b.tokens[at + 1] = v;
      }
    }
  }
  return b;
}

}  // namespace mqrar
}  // namespace train
}  // namespace attnmix
