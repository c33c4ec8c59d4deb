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
// One scorer call a level for all the beams (a decoder batches them); beam_search_items_batched
// runs several searches (users) with one scorer call a level for all of them. Deterministic:
// equal scores are ordered by the codes, lower first. With a width at least the number of
// distinct prefixes of every level the search is exhaustive.

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

namespace detail {

// What beam_search_items and beam_search_items_batched share: `searches` searches in lockstep,
// scorer(prefixes, owner, logp) scoring the beams of every search still running at a level
// (owner[b]: beam b's search).
template <class Scorer>
std::vector<beam_result> beam_searches(const std::string& fn, const semantic_ids& ids,
                                       index_t searches, int width, int top_k, Scorer&& scorer) {
  detail::require(ids.items > 0 && ids.code.size() == std::size_t(ids.items * ids.depth()), fn,
                  "ids", "holds ", ids.code.size(), " codes for ", ids.items, " items of ",
                  ids.depth(), " codes");
  detail::require(width >= 1 && width <= ids.items, fn, "width", "is ", width,
                  " but must be in [1, ", ids.items, "] (the catalogue's items)");
  detail::require(top_k >= 1 && top_k <= width, fn, "top_k", "is ", top_k,
                  " but must be in [1, width = ", width, "]");
  detail::require(searches >= 0, fn, "searches", "is ", searches, " but must be >= 0");
  const int depth = ids.depth(), codes = ids.codes;

  // Items in the lexicographic order of their IDs: a prefix is a contiguous range, and within it
  // the next level's codes ascend. sorted: the codes in that order, [items][depth].
  const std::int32_t* code = ids.code.data();  // checked above
  std::vector<index_t> order(static_cast<std::size_t>(ids.items));
  for (index_t i = 0; i < ids.items; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](index_t a, index_t b) {
    return std::lexicographical_compare(code + a * depth, code + (a + 1) * depth, code + b * depth,
                                        code + (b + 1) * depth);
  });
  std::vector<std::int32_t> sorted(ids.code.size());
  for (index_t k = 0; k < ids.items; ++k)
    std::copy(code + order[k] * depth, code + (order[k] + 1) * depth, sorted.begin() + k * depth);
  struct beam {
    index_t lo, hi;  // the items of order[lo, hi) share the prefix
    double score;
    std::vector<std::int32_t> prefix;
  };
  std::vector<std::vector<beam>> beams(static_cast<std::size_t>(searches),
                                       std::vector<beam>{{0, ids.items, 0.0, {}}});
  std::vector<std::vector<std::int32_t>> prefixes;
  std::vector<index_t> owner;
  std::vector<double> logp;
  for (int level = 0; level < depth; ++level) {
    prefixes.clear(), owner.clear();
    for (index_t q = 0; q < searches; ++q)
      for (const beam& b : beams[std::size_t(q)]) prefixes.push_back(b.prefix), owner.push_back(q);
    if (prefixes.empty()) break;  // every code of every beam impossible
    logp.assign(prefixes.size() * std::size_t(codes), 0.0);
    scorer(static_cast<const std::vector<std::vector<std::int32_t>>&>(prefixes),
           static_cast<const std::vector<index_t>&>(owner), logp);
    detail::require(logp.size() == prefixes.size() * std::size_t(codes), fn, "scorer",
                    "resized its output to ", logp.size(), " values; expected ",
                    prefixes.size() * std::size_t(codes), " (beams x codes)");
    std::size_t row = 0;  // the first beam of search q in prefixes
    // A search's extensions as (parent beam, code) until the best `width` are known; only those
    // get their prefix.
    struct extension {
      index_t lo, hi;
      double score;
      std::size_t parent;
      std::int32_t code;
    };
    std::vector<extension> ext;
    for (std::vector<beam>& mine : beams) {
      ext.clear();
      for (std::size_t bi = 0; bi < mine.size(); ++bi, ++row) {
        const beam& b = mine[bi];
        for (index_t at = b.lo; at < b.hi;) {
          const std::int32_t c = sorted[at * depth + level];
          index_t end = at + 1, past = b.hi;  // the first item past code c: a binary search
          while (end < past) {
            const index_t mid = end + (past - end) / 2;
            if (sorted[mid * depth + level] == c)
              end = mid + 1;
            else
              past = mid;
          }
          const double lp = logp[row * codes + c];
          detail::require(!std::isnan(lp), fn, "scorer", "gave NaN for code ", c, " at level ",
                          level);
          if (lp != -std::numeric_limits<double>::infinity())
            ext.push_back({at, end, b.score + lp, bi, c});
          at = end;
        }
      }
      // Higher scores first; equal ones by their prefixes (the parents' are distinct and of one
      // length), lower first.
      const auto better = [&](const extension& a, const extension& b) {
        if (a.score != b.score) return a.score > b.score;
        if (a.parent != b.parent) return mine[a.parent].prefix < mine[b.parent].prefix;
        return a.code < b.code;
      };
      const std::size_t keep = std::min(ext.size(), std::size_t(width));
      std::partial_sort(ext.begin(), ext.begin() + std::ptrdiff_t(keep), ext.end(), better);
      std::vector<beam> next;
      next.reserve(keep);
      for (std::size_t i = 0; i < keep; ++i) {
        const extension& e = ext[i];
        beam n{e.lo, e.hi, e.score, mine[e.parent].prefix};
        n.prefix.push_back(e.code);
        next.push_back(std::move(n));
      }
      mine = std::move(next);
    }
  }
  std::vector<beam_result> out(static_cast<std::size_t>(searches));
  for (std::size_t q = 0; q < out.size(); ++q)
    for (std::size_t i = 0; i < beams[q].size() && int(i) < top_k; ++i) {
      out[q].items.push_back(order[beams[q][i].lo]);  // a whole ID: one item
      out[q].scores.push_back(beams[q][i].score);
    }
  return out;
}

}  // namespace detail

template <class Scorer>
beam_result beam_search_items(const semantic_ids& ids, int width, int top_k, Scorer&& scorer) {
  return detail::beam_searches(
      "attnmix::beam_search_items", ids, 1, width, top_k,
      [&](const std::vector<std::vector<std::int32_t>>& prefixes, const std::vector<index_t>&,
          std::vector<double>& logp) { scorer(prefixes, logp); })[0];
}

// `searches` searches over one catalogue in lockstep (a recommender's users):
// scorer(prefixes, owner, logp) gets the beams of every search still running at a level, beam b
// of search owner[b] (a search's beams together, searches in order), and fills
// logp[b * codes + c]: one scorer call a level for all of them. Search q gives what
// beam_search_items gives with its beams' scores.
template <class Scorer>
std::vector<beam_result> beam_search_items_batched(const semantic_ids& ids, index_t searches,
                                                   int width, int top_k, Scorer&& scorer) {
  return detail::beam_searches("attnmix::beam_search_items_batched", ids, searches, width, top_k,
                               scorer);
}

}  // namespace attnmix
