// The synthetic tasks' generators (train/tasks.hpp) against a direct simulation of each task:
// flip-flop's read bits are the last written bits, A5's labels the running composition of
// permutations applied one after another, MQRAR-N's answers the values assigned N assignments of
// their key ago.

#include <array>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "attnmix/train/tasks.hpp"
#include "support/catch.hpp"
#include "support/errors.hpp"
#include "support/testing.hpp"

using attnmix::index_t;
using attnmix_test::expect_error;

TEST_CASE("flip-flop batches: reads return the last written bit", "[train][tasks]") {
  namespace ff = attnmix::train::flip_flop;
  std::mt19937_64 gen(attnmix_test::test_seed() + 11);
  for (const double p : {0.0, 0.1, 0.8, 0.98, 1.0})
    for (const index_t T : {4, 5, 7, 64, 513}) {
      INFO("p_ignore " << p << " T " << T);
      const attnmix::train::task_batch b = ff::make(gen, 5, T, p);
      REQUIRE(b.batch == 5);
      REQUIRE(b.length == T);
      REQUIRE(b.tokens.size() == std::size_t(5 * T));
      for (index_t s = 0; s < 5; ++s) {
        const std::int32_t* t = b.tokens.data() + s * T;
        std::int32_t written = -1;  // the simulated memory
        index_t reads = 0;
        for (index_t p2 = 0; p2 + 1 < T; p2 += 2) {
          const std::int32_t op = t[p2], bit = t[p2 + 1];
          REQUIRE((op == ff::write || op == ff::read || op == ff::ignore));
          REQUIRE((bit == ff::bit0 || bit == ff::bit1));
          if (p2 == 0) CHECK(op == ff::write);
          if (p2 + 3 >= T) CHECK(op == ff::read);  // the last whole pair
          if (p == 1.0 && p2 > 0 && p2 + 3 < T) CHECK(op == ff::ignore);
          if (op == ff::write) written = bit;
          if (op == ff::read) {
            CHECK(bit == written);
            CHECK(b.scored[s * T + p2] == 1);
            ++reads;
          } else {
            CHECK(b.scored[s * T + p2] == 0);
          }
          CHECK(b.scored[s * T + p2 + 1] == 0);
        }
        if (T % 2 == 1) CHECK(t[T - 1] == ff::ignore);
        CHECK(reads >= 1);
        for (index_t p2 = 0; p2 < T; ++p2)
          CHECK(b.labels[s * T + p2] == (p2 + 1 < T ? t[p2 + 1] : attnmix::train::ignore_label));
      }
    }
}

TEST_CASE("flip-flop batches: ignore at about the asked rate, the same batch for the same seed",
          "[train][tasks]") {
  namespace ff = attnmix::train::flip_flop;
  std::mt19937_64 g1(7), g2(7);
  const auto a = ff::make(g1, 64, 512, 0.8), b = ff::make(g2, 64, 512, 0.8);
  CHECK(a.tokens == b.tokens);
  CHECK(a.labels == b.labels);
  index_t ignores = 0, inner = 0;
  for (index_t s = 0; s < 64; ++s)
    for (index_t p = 2; p + 2 < 512; p += 2, ++inner)
      ignores += a.tokens[s * 512 + p] == ff::ignore;
  const double rate = double(ignores) / double(inner);
  CHECK(rate > 0.78);
  CHECK(rate < 0.82);
}

TEST_CASE("A5: sixty even permutations closed under composition", "[train][tasks]") {
  namespace a5 = attnmix::train::a5;
  const auto& all = a5::elements();
  REQUIRE(all.size() == std::size_t(a5::order));
  CHECK(all[0] == a5::permutation{0, 1, 2, 3, 4});
  CHECK(std::set<a5::permutation>(all.begin(), all.end()).size() == all.size());
  CHECK(a5::index_of({1, 0, 2, 3, 4}) == -1);  // a transposition is odd
  CHECK(a5::index_of({1, 2, 0, 3, 4}) >= 0);   // a 3-cycle is even
  for (std::int32_t x = 0; x < a5::order; ++x) {
    CHECK(a5::index_of(all[x]) == x);
    CHECK(a5::compose(0, x) == x);
    CHECK(a5::compose(x, 0) == x);
    std::set<std::int32_t> row;
    for (std::int32_t y = 0; y < a5::order; ++y) {
      const std::int32_t z = a5::compose(x, y);
      REQUIRE(z >= 0);
      row.insert(z);
    }
    CHECK(row.size() == std::size_t(a5::order));  // a Latin square: a group table
  }
  // Not commutative (what makes the task hard for commuting recurrences).
  const std::int32_t c = a5::index_of({1, 2, 0, 3, 4}), e = a5::index_of({0, 2, 3, 1, 4});
  CHECK(a5::compose(c, e) != a5::compose(e, c));
  // (0 1)(2 3) and (0 2)(1 3), of the Klein four-group, do commute.
  const std::int32_t k1 = a5::index_of({1, 0, 3, 2, 4}), k2 = a5::index_of({2, 3, 0, 1, 4});
  CHECK(a5::compose(k1, k2) == a5::compose(k2, k1));
}

TEST_CASE("A5 batches: labels are the running composition, simulated on the items",
          "[train][tasks]") {
  namespace a5 = attnmix::train::a5;
  std::mt19937_64 gen(attnmix_test::test_seed() + 17);
  const index_t B = 6, T = 97;
  const attnmix::train::task_batch b = a5::make(gen, B, T);
  const auto& all = a5::elements();
  std::set<std::int32_t> seen;
  for (index_t s = 0; s < B; ++s) {
    std::array<int, 5> where = {0, 1, 2, 3, 4};  // where each item is after the steps so far
    for (index_t p = 0; p < T; ++p) {
      const std::int32_t x = b.tokens[s * T + p];
      REQUIRE(x >= 0);
      REQUIRE(x < a5::order);
      seen.insert(x);
      for (int& w : where) w = all[x][w];
      a5::permutation state;
      for (int i = 0; i < 5; ++i) state[i] = where[i];
      CHECK(b.labels[s * T + p] == a5::index_of(state));
      CHECK(b.scored[s * T + p] == 1);
    }
  }
  CHECK(seen.size() > 50);  // uniform over the group
}

TEST_CASE("task generators reject bad sizes and rates", "[train][tasks][errors]") {
  std::mt19937_64 gen(1);
  expect_error("attnmix::train::flip_flop::make", "batch", "0",
               [&] { attnmix::train::flip_flop::make(gen, 0, 8, 0.5); });
  expect_error("attnmix::train::flip_flop::make", "length", "-3",
               [&] { attnmix::train::flip_flop::make(gen, 2, -3, 0.5); });
  expect_error("attnmix::train::flip_flop::make", "length", "at least 4",
               [&] { attnmix::train::flip_flop::make(gen, 2, 3, 0.5); });
  expect_error("attnmix::train::flip_flop::make", "p_ignore", "1.5",
               [&] { attnmix::train::flip_flop::make(gen, 2, 8, 1.5); });
  expect_error("attnmix::train::a5::make", "length", "0",
               [&] { attnmix::train::a5::make(gen, 2, 0); });
}

TEST_CASE("MQRAR-N batches: a query's answer is its key's value N assignments ago",
          "[train][tasks]") {
  namespace mq = attnmix::train::mqrar;
  std::mt19937_64 gen(attnmix_test::test_seed() + 13);
  for (const int n : {1, 2, 4})
    for (const double pq : {0.0, 0.25, 0.9, 1.0}) {
      INFO("N " << n << " p_query " << pq);
      const index_t K = 8, V = 5, T = 200;
      const attnmix::train::task_batch b = mq::make(gen, 4, T, n, K, V, pq);
      REQUIRE(b.tokens.size() == std::size_t(4 * T));
      index_t queries = 0, pairs = 0;
      for (index_t s = 0; s < 4; ++s) {
        std::vector<std::vector<std::int32_t>> values(K);  // the simulated assignments
        for (index_t p = 0; p < T; p += 2, ++pairs) {
          const std::int32_t k = b.tokens[s * T + p], v = b.tokens[s * T + p + 1];
          REQUIRE(k >= 0);
          REQUIRE(k < 2 * K);
          REQUIRE(v >= 2 * K);
          REQUIRE(v < mq::vocab(K, V));
          CHECK(b.labels[s * T + p + 1] == attnmix::train::ignore_label);
          CHECK(b.scored[s * T + p + 1] == 0);
          if (k < K) {  // an assignment
            values[std::size_t(k)].push_back(v);
            CHECK(b.labels[s * T + p] == attnmix::train::ignore_label);
            CHECK(b.scored[s * T + p] == 0);
          } else {  // a query
            const auto& h = values[std::size_t(k - K)];
            REQUIRE(h.size() >= std::size_t(n));
            CHECK(v == h[h.size() - std::size_t(n)]);
            CHECK(b.labels[s * T + p] == v);
            CHECK(b.scored[s * T + p] == 1);
            ++queries;
          }
        }
      }
      if (pq == 0.0) CHECK(queries == 0);
      if (pq >= 0.25) CHECK(queries > 0);
      if (pq == 1.0) CHECK(queries > pairs / 2);  // every pair once a key is ready
    }
  std::mt19937_64 g1(5), g2(5);
  CHECK(mq::make(g1, 3, 64, 2, 4, 4).tokens == mq::make(g2, 3, 64, 2, 4, 4).tokens);
  std::mt19937_64 g(1);
  const char* fn = "attnmix::train::mqrar::make";
  expect_error(fn, "length", "must be even", [&] { mq::make(g, 1, 7, 1, 4, 4); });
  expect_error(fn, "n_back", "at least 1", [&] { mq::make(g, 1, 8, 0, 4, 4); });
  expect_error(fn, "keys", "at least 1", [&] { mq::make(g, 1, 8, 1, 0, 4); });
  expect_error(fn, "p_query", "in [0, 1]", [&] { mq::make(g, 1, 8, 1, 4, 4, 1.5); });
}
