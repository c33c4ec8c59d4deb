// Beam search over semantic IDs (include/attnmix/retrieval/beam_search.hpp): as wide as the
// catalogue it is the exhaustive search (the same items, order and scores); narrower, its items
// are real, their scores the sums of their codes' log-probabilities, best first; impossible codes
// (-inf) are never taken; bad input is an attnmix::error naming the argument.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "support/catch.hpp"
#include "support/errors.hpp"

#include "attnmix/retrieval/beam_search.hpp"

namespace {

using attnmix::index_t;
using attnmix_test::expect_error;
using prefix_list = std::vector<std::vector<std::int32_t>>;

// log p(code | prefix): a log-softmax of pseudo-random logits that depend on prefix and salt.
struct hash_scorer {
  int codes;
  std::uint64_t salt;
  double logp(const std::vector<std::int32_t>& prefix, int c) const {
    std::vector<double> z(static_cast<std::size_t>(codes));
    double mx = -1e300;
    for (int k = 0; k < codes; ++k) {
      std::uint64_t h = salt * 0x9e3779b97f4a7c15ull + std::uint64_t(k) + 1;
      for (const std::int32_t p : prefix) h = (h ^ std::uint64_t(p + 7)) * 0xbf58476d1ce4e5b9ull;
      h ^= h >> 31;
      z[k] = 4.0 * double(h >> 11) * 0x1.0p-53;
      mx = std::max(mx, z[k]);
    }
    double sum = 0;
    for (const double v : z) sum += std::exp(v - mx);
    return z[c] - mx - std::log(sum);
  }
  void operator()(const prefix_list& prefixes, std::vector<double>& out) const {
    for (std::size_t b = 0; b < prefixes.size(); ++b)
      for (int c = 0; c < codes; ++c) out[b * codes + c] = logp(prefixes[b], c);
  }
};

double item_score(const attnmix::semantic_ids& ids, const hash_scorer& s, index_t i) {
  double score = 0;
  std::vector<std::int32_t> prefix;
  for (int l = 0; l < ids.depth(); ++l) {
    score += s.logp(prefix, ids.of(i)[l]);
    prefix.push_back(ids.of(i)[l]);
  }
  return score;
}

attnmix::semantic_ids catalogue(index_t items, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> v(static_cast<std::size_t>(items * 5));
  for (float& x : v) x = n(g);
  attnmix::semantic_id_options o;
  o.levels = 2, o.codes = 8, o.seed = seed;
  return attnmix::assign_semantic_ids(v.data(), items, 5, o);
}

}  // namespace

TEST_CASE("beam search: as wide as the catalogue, the exhaustive search",
          "[retrieval][beam_search]") {
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    const attnmix::semantic_ids ids = catalogue(60, seed);
    const hash_scorer s{ids.codes, seed};
    std::vector<std::tuple<double, std::vector<std::int32_t>, index_t>> all;
    for (index_t i = 0; i < ids.items; ++i)
      all.emplace_back(-item_score(ids, s, i),
                       std::vector<std::int32_t>(ids.of(i), ids.of(i) + ids.depth()), i);
    std::sort(all.begin(), all.end());
    const attnmix::beam_result r = attnmix::beam_search_items(ids, int(ids.items), 10, s);
    REQUIRE(r.items.size() == 10u);
    for (int k = 0; k < 10; ++k) {
      INFO("seed " << seed << " rank " << k);
      CHECK(r.items[k] == std::get<2>(all[k]));
      CHECK(r.scores[k] == -std::get<0>(all[k]));
    }
  }
}

TEST_CASE("beam search: narrower beams give real items, their scores, best first",
          "[retrieval][beam_search]") {
  const attnmix::semantic_ids ids = catalogue(80, 4);
  const hash_scorer s{ids.codes, 9};
  for (int width : {1, 3, 10}) {
    const attnmix::beam_result r = attnmix::beam_search_items(ids, width, width, s);
    REQUIRE(!r.items.empty());
    CHECK(r.items.size() <= std::size_t(width));
    for (std::size_t k = 0; k < r.items.size(); ++k) {
      CHECK(r.items[k] >= 0);
      CHECK(r.items[k] < ids.items);
      CHECK(std::abs(r.scores[k] - item_score(ids, s, r.items[k])) < 1e-12);
      if (k > 0) CHECK(r.scores[k] <= r.scores[k - 1]);
    }
  }
  // Forbidding first code 0 keeps every item with it out.
  const auto forbid = [&](const prefix_list& p, std::vector<double>& out) {
    s(p, out);
    if (!p.empty() && p[0].empty())
      for (std::size_t b = 0; b < p.size(); ++b)
        out[b * ids.codes] = -std::numeric_limits<double>::infinity();
  };
  const attnmix::beam_result r = attnmix::beam_search_items(ids, 80, 80, forbid);
  for (const index_t i : r.items) CHECK(ids.of(i)[0] != 0);
}

TEST_CASE("beam search: searches in lockstep give each search's own result",
          "[retrieval][beam_search][batched]") {
  const attnmix::semantic_ids ids = catalogue(70, 6);
  // Search q scores with its own salt; search 2 forbids every first code (no result).
  std::vector<hash_scorer> own;
  for (std::uint64_t q = 0; q < 4; ++q) own.push_back({ids.codes, 20 + q});
  for (int width : {1, 4, 70}) {
    int calls = 0;
    const auto batched = [&](const prefix_list& p, const std::vector<index_t>& owner,
                             std::vector<double>& out) {
      ++calls;
      REQUIRE(owner.size() == p.size());
      for (std::size_t b = 0; b < p.size(); ++b) {
        if (b > 0) CHECK(owner[b] >= owner[b - 1]);  // a search's beams together, in order
        std::vector<double> row(static_cast<std::size_t>(ids.codes));
        own[std::size_t(owner[b])](prefix_list{p[b]}, row);
        std::copy(row.begin(), row.end(), out.begin() + std::ptrdiff_t(b * ids.codes));
      }
    };
    const auto forbid_all = [&](const prefix_list& p, std::vector<double>& out) {
      std::fill(out.begin(), out.end(), -std::numeric_limits<double>::infinity());
      (void)p;
    };
    // Search 2 as its own beams would see it: -inf everywhere.
    const auto with_forbidden = [&](const prefix_list& p, const std::vector<index_t>& owner,
                                    std::vector<double>& out) {
      std::vector<index_t> o2;
      prefix_list p2;
      std::vector<std::size_t> at;
      for (std::size_t b = 0; b < p.size(); ++b) {
        if (owner[b] != 2) {
          p2.push_back(p[b]), o2.push_back(owner[b]), at.push_back(b);
        } else {
          CHECK(p[b].empty());  // search 2 has no beams past level 0: not scored again
        }
      }
      std::vector<double> o(p2.size() * std::size_t(ids.codes));
      if (!p2.empty()) batched(p2, o2, o);
      std::fill(out.begin(), out.end(), -std::numeric_limits<double>::infinity());
      for (std::size_t k = 0; k < at.size(); ++k)
        std::copy(o.begin() + std::ptrdiff_t(k * ids.codes),
                  o.begin() + std::ptrdiff_t((k + 1) * ids.codes),
                  out.begin() + std::ptrdiff_t(at[k] * ids.codes));
    };
    const int top = std::min(width, 5);
    const auto got = attnmix::beam_search_items_batched(ids, 4, width, top, with_forbidden);
    REQUIRE(got.size() == 4u);
    CHECK(calls == ids.depth());  // one call a level for every search
    for (std::size_t q = 0; q < 4; ++q) {
      INFO("width " << width << " search " << q);
      const attnmix::beam_result want =
          q == 2 ? attnmix::beam_search_items(ids, width, top, forbid_all)
                 : attnmix::beam_search_items(ids, width, top, own[q]);
      CHECK(got[q].items == want.items);
      CHECK(got[q].scores == want.scores);
    }
  }
  const auto never = [](const prefix_list&, const std::vector<index_t>&, std::vector<double>&) {
    FAIL("no search, no scorer call");
  };
  CHECK(attnmix::beam_search_items_batched(ids, 0, 3, 3, never).empty());
  expect_error("attnmix::beam_search_items_batched", "searches", "is -1 but must be >= 0",
               [&] { attnmix::beam_search_items_batched(ids, -1, 3, 3, never); });
}

TEST_CASE("beam search: bad input is an attnmix::error naming the argument",
          "[retrieval][beam_search][errors]") {
  const attnmix::semantic_ids ids = catalogue(20, 5);
  const hash_scorer s{ids.codes, 1};
  expect_error("attnmix::beam_search_items", "width", "is 0 but must be in [1, 20]",
               [&] { attnmix::beam_search_items(ids, 0, 1, s); });
  expect_error("attnmix::beam_search_items", "width", "is 21 but must be in [1, 20]",
               [&] { attnmix::beam_search_items(ids, 21, 1, s); });  // wider than 20
  expect_error("attnmix::beam_search_items", "top_k", "is 0 but must be in [1, width = 5]",
               [&] { attnmix::beam_search_items(ids, 5, 0, s); });
  expect_error("attnmix::beam_search_items", "top_k", "is 6 but must be in [1, width = 5]",
               [&] { attnmix::beam_search_items(ids, 5, 6, s); });
  const auto shrinks = [](const prefix_list&, std::vector<double>& out) {
    out.resize(1);
  };
  expect_error("attnmix::beam_search_items", "scorer", "resized its output to 1 values",
               [&] { attnmix::beam_search_items(ids, 5, 5, shrinks); });
  const auto nan = [](const prefix_list&, std::vector<double>& out) {
    std::fill(out.begin(), out.end(), std::nan(""));
  };
  expect_error("attnmix::beam_search_items", "scorer", "gave NaN",
               [&] { attnmix::beam_search_items(ids, 5, 5, nan); });
  attnmix::semantic_ids empty;
  expect_error("attnmix::beam_search_items", "ids", "holds 0 codes for 0 items",
               [&] { attnmix::beam_search_items(empty, 1, 1, s); });
}
