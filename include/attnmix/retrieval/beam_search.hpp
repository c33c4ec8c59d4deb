#pragma once
// Beam search over semantic IDs (retrieval/semantic_ids.hpp): the decoder of a generative-
// retrieval model gives, for each partial ID, log-probabilities of the next code; the search keeps
// the `width` best partial IDs level by level, extends each only by codes that lead to an item of
// the catalogue, and returns the best `top_k` whole IDs as items with their scores (the sums of
// the codes' log-probabilities).
//
//   // scorer(prefixes, logp): prefixes[b] holds a partial ID (the same length for every b);
//   // fill logp[b * codes + c] with log p(code c | prefixes[b]).
//   const attnmix::beam_result r = attnmix::beam_search_items(ids, 100, 10, scorer);
//
// One scorer call a level for all the beams (a decoder batches them). Deterministic: equal
// scores are ordered by the codes, lower first. With a width at least the number of distinct
// prefixes of every level the search is exhaustive.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attnmix/config.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/retrieval/semantic_ids.hpp"

namespace attnmix {

struct beam_result {
  std::vector<index_t> items;  // best first
  std::vector<double> scores;  // their summed log-probabilities
};

template <class Scorer>
beam_result beam_search_items(const semantic_ids& ids, int width, int top_k, Scorer&& scorer) {
  const std::string fn = "attnmix::beam_search_items";
  detail::require(ids.items > 0 && ids.code.size() == std::size_t(ids.items * ids.depth()), fn,
                  "ids", "holds ", ids.code.size(), " codes for ", ids.items, " items of ",
                  ids.depth(), " codes");
  detail::require(width >= 1 && width <= ids.items, fn, "width", "is ", width,
                  " but must be in [1, ", ids.items, "] (the catalogue's items)");
  detail::require(top_k >= 1 && top_k <= width, fn, "top_k", "is ", top_k,
                  " but must be in [1, width = ", width, "]");
  const int depth = ids.depth(), codes = ids.codes;

  // Items in the lexicographic order of their IDs: a prefix is a contiguous range.
  std::vector<index_t> order(static_cast<std::size_t>(ids.items));
  for (index_t i = 0; i < ids.items; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](index_t a, index_t b) {
    return std::lexicographical_compare(ids.of(a), ids.of(a) + depth, ids.of(b), ids.of(b) + depth);
  });
  struct beam {
    index_t lo, hi;  // the items of order[lo, hi) share the prefix
    double score;
    std::vector<std::int32_t> prefix;
  };
  std::vector<beam> beams{{0, ids.items, 0.0, {}}};
  std::vector<std::vector<std::int32_t>> prefixes;
  std::vector<double> logp;
  for (int level = 0; level < depth; ++level) {
    prefixes.clear();
    for (const beam& b : beams) prefixes.push_back(b.prefix);
    logp.assign(beams.size() * std::size_t(codes), 0.0);
    scorer(static_cast<const std::vector<std::vector<std::int32_t>>&>(prefixes), logp);
    detail::require(logp.size() == beams.size() * std::size_t(codes), fn, "scorer",
                    "resized its output to ", logp.size(), " values; expected ",
                    beams.size() * std::size_t(codes), " (beams x codes)");
    std::vector<beam> next;
    for (std::size_t bi = 0; bi < beams.size(); ++bi) {
      const beam& b = beams[bi];
      for (index_t at = b.lo; at < b.hi;) {
        const std::int32_t c = ids.of(order[at])[level];
        index_t end = at;
        while (end < b.hi && ids.of(order[end])[level] == c) ++end;
        const double lp = logp[bi * codes + c];
        detail::require(!std::isnan(lp), fn, "scorer", "gave NaN for code ", c, " at level ",
                        level);
        if (lp != -std::numeric_limits<double>::infinity()) {
          beam n{at, end, b.score + lp, b.prefix};
          n.prefix.push_back(c);
          next.push_back(std::move(n));
        }
        at = end;
      }
    }
    const auto better = [](const beam& a, const beam& b) {
      if (a.score != b.score) return a.score > b.score;
      return a.prefix < b.prefix;
    };
    const std::size_t keep = std::min(next.size(), std::size_t(width));
    std::partial_sort(next.begin(), next.begin() + keep, next.end(), better);
    next.resize(keep);
    beams = std::move(next);
    if (beams.empty()) break;  // every code of every beam impossible
  }
  beam_result r;
  for (std::size_t i = 0; i < beams.size() && int(i) < top_k; ++i) {
    r.items.push_back(order[beams[i].lo]);  // a whole ID: one item
    r.scores.push_back(beams[i].score);
  }
  return r;
}

}  // namespace attnmix
