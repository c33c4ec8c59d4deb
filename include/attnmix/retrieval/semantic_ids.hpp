#pragma once
// Semantic IDs of a catalogue (the generative-retrieval recommender of the GBLA paper, after
// TIGER): each item gets a tuple of codes from residual k-means over its vector, so that items
// with similar vectors share their first codes and a decoder can generate an item code by code.
//
//   level 0: k-means with `codes` centroids over the item vectors; code 0 = the nearest centroid;
//   level l: the same over the residuals (vector minus the centroids of the levels before);
//   last:    items whose `levels` codes collide are told apart by one more code, 0, 1, ... in
//            item order (0 for an item that collides with none).
//
// So an ID has levels + 1 codes, each in [0, codes). Deterministic: the same vectors, options and
// seed give the same IDs on every machine (k-means++ seeding from a fixed 64-bit generator, ties
// to the lower index, fixed-order sums in double).
//
//   attnmix::semantic_id_options o;  // levels 3, codes 256
//   const attnmix::semantic_ids ids = attnmix::assign_semantic_ids(vectors, items, dim, o);
//   ids.of(item);              // its levels + 1 codes
//   ids.item_of(tuple);        // the item with these codes, or -1

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "attnmix/config.hpp"
#include "attnmix/core/error.hpp"

namespace attnmix {

struct semantic_id_options {
  int levels = 3;       // code levels from residual k-means (the collision code comes on top)
  int codes = 256;      // centroids a level, and the range of every code
  int iterations = 25;  // Lloyd iterations a level at most (fewer when assignments settle)
  std::uint64_t seed = 0;
};

struct semantic_ids {
  index_t items = 0, dim = 0;
  int levels = 0, codes = 0;
  std::vector<std::int32_t> code;  // [items][levels + 1]
  std::vector<float> codebook;     // [levels][codes][dim]: the centroids of each level

  int depth() const { return levels + 1; }
  // Item i's codes (depth() of them).
  const std::int32_t* of(index_t i) const {
    detail::require(i >= 0 && i < items, "attnmix::semantic_ids::of", "item", "is ", i,
                    " but the catalogue has ", items, " items");
    return code.data() + i * depth();
  }
  // The item whose codes are tuple[0 .. depth()), or -1 when no item has them (after reindex()
  // when `code` was changed by hand). A code outside [0, codes) is an attnmix::error.
  index_t item_of(const std::int32_t* tuple) const {
    const char* fn = "attnmix::semantic_ids::item_of";
    detail::require(tuple != nullptr, fn, "tuple", "is null");
    for (int l = 0; l < depth(); ++l)
      detail::require(tuple[l] >= 0 && tuple[l] < codes, fn, "tuple", "has the code ", tuple[l],
                      " at level ", l, ", outside [0, ", codes, ")");
    const auto it = index_.find(std::vector<std::int32_t>(tuple, tuple + depth()));
    return it == index_.end() ? -1 : it->second;
  }
  // An empty set of IDs of these sizes (for loading into: retrieval/semantic_ids_io.hpp).
  static semantic_ids sized(index_t items, index_t dim, int levels, int codes) {
    semantic_ids s;
    s.items = items, s.dim = dim, s.levels = levels, s.codes = codes;
    s.code.assign(static_cast<std::size_t>(items * (levels + 1)), 0);
    s.codebook.assign(static_cast<std::size_t>(levels * codes * dim), 0.f);
    return s;
  }

  // The tensors attnmix::io::save and load see: "semantic_ids.codes" (I32, [items, levels + 1])
  // and "semantic_ids.codebook" (F32, [levels, codes, dim]).
  template <class F>
  void visit_parameters(F&& f) {
    tensor<std::vector<std::int32_t>> c{code, {items, index_t(depth())}};
    tensor<std::vector<float>> b{codebook, {index_t(levels), index_t(codes), dim}};
    f("semantic_ids.codes", c);
    f("semantic_ids.codebook", b);
  }
  template <class F>
  void visit_parameters(F&& f) const {
    const tensor<const std::vector<std::int32_t>> c{code, {items, index_t(depth())}};
    const tensor<const std::vector<float>> b{codebook, {index_t(levels), index_t(codes), dim}};
    f("semantic_ids.codes", c);
    f("semantic_ids.codebook", b);
  }
  // For attnmix::io::load: every code in [0, codes), every item's codes its own.
  template <class Values, class Reject>
  void check_loaded(Values&& values, Reject&& reject) const {
    const std::vector<double> c = values("semantic_ids.codes");
    std::map<std::vector<double>, index_t> seen;
    for (index_t i = 0; i < items; ++i) {
      const auto first = c.begin() + i * depth();
      for (int l = 0; l < depth(); ++l)
        if (!(first[l] >= 0 && first[l] < codes))
          reject(detail::concat("tensor 'semantic_ids.codes' gives item ", i, " the code ",
                                first[l], " at level ", l, ", outside [0, ", codes, ")"));
      const auto at = seen.emplace(std::vector<double>(first, first + depth()), i);
      if (!at.second)
        reject(detail::concat("tensor 'semantic_ids.codes' gives items ", at.first->second, " and ",
                              i, " the same codes"));
    }
  }

  // Rebuilds the lookup of item_of from `code`.
  void reindex() {
    index_.clear();
    for (index_t i = 0; i < items; ++i)
      index_.emplace(std::vector<std::int32_t>(of(i), of(i) + depth()), i);
  }

 private:
  template <class V>
  struct tensor {
    V& data;
    std::vector<index_t> shape;
  };
  std::map<std::vector<std::int32_t>, index_t> index_;
};

namespace detail {

// splitmix64: a fixed generator, the same numbers on every platform.
struct sid_rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1)
};

inline double sid_distance(const double* x, const double* c, index_t dim) {
  double s = 0;
  for (index_t d = 0; d < dim; ++d) s += (x[d] - c[d]) * (x[d] - c[d]);
  return s;
}

// The centroid nearest to x (ties to the lower index).
inline int sid_nearest(const double* x, const std::vector<double>& centroid, int k, index_t dim) {
  int best = 0;
  double bd = std::numeric_limits<double>::max();
  for (int c = 0; c < k; ++c) {
    const double d = sid_distance(x, centroid.data() + c * dim, dim);
    if (d < bd) bd = d, best = c;
  }
  return best;
}

// k-means of x [n][dim] with k centroids (k-means++ seeding, then Lloyd): the centroids
// [k][dim] and each point's code.
inline void sid_kmeans(const std::vector<double>& x, index_t n, index_t dim, int k, int iterations,
                       sid_rng& rng, std::vector<double>& centroid,
                       std::vector<std::int32_t>& code) {
  centroid.assign(static_cast<std::size_t>(k * dim), 0.0);
  code.assign(static_cast<std::size_t>(n), 0);
  const auto row = [&](const std::vector<double>& v, index_t i) {
    return v.data() + i * dim;
  };
  // Seeding: the first centroid uniformly, each next one with probability D(x)^2 (uniformly when
  // every point already sits on a centroid).
  std::vector<double> nearest(static_cast<std::size_t>(n), std::numeric_limits<double>::max());
  for (int c = 0; c < k; ++c) {
    double total = 0;
    for (index_t i = 0; i < n; ++i) total += c == 0 ? 1.0 : nearest[i];
    index_t pick = n - 1;
    if (total > 0) {
      double u = rng.uniform() * total;
      for (index_t i = 0; i < n; ++i) {
        u -= c == 0 ? 1.0 : nearest[i];
        if (u < 0) {
          pick = i;
          break;
        }
      }
    } else {
      pick = static_cast<index_t>(rng.next() % static_cast<std::uint64_t>(n));
    }
    std::copy(row(x, pick), row(x, pick) + dim, centroid.begin() + c * dim);
    for (index_t i = 0; i < n; ++i)
      nearest[i] = std::min(nearest[i], sid_distance(row(x, i), row(centroid, c), dim));
  }
  // Lloyd: nearest centroid (ties to the lower index), then each centroid the mean of its points
  // (a centroid without points stays).
  std::vector<double> sum;
  std::vector<index_t> count;
  for (int it = 0; it < iterations; ++it) {
    bool moved = it == 0;
    for (index_t i = 0; i < n; ++i) {
      const int best = sid_nearest(row(x, i), centroid, k, dim);
      if (code[i] != best) moved = true;
      code[i] = best;
    }
    if (!moved) break;
    sum.assign(static_cast<std::size_t>(k * dim), 0.0);
    count.assign(static_cast<std::size_t>(k), 0);
    for (index_t i = 0; i < n; ++i) {
      ++count[code[i]];
      for (index_t d = 0; d < dim; ++d) sum[code[i] * dim + d] += x[i * dim + d];
    }
    for (int c = 0; c < k; ++c)
      if (count[c] > 0)
        for (index_t d = 0; d < dim; ++d) centroid[c * dim + d] = sum[c * dim + d] / count[c];
  }
  // The codes of the final centroids.
  for (index_t i = 0; i < n; ++i) code[i] = sid_nearest(row(x, i), centroid, k, dim);
}

}  // namespace detail

// The semantic IDs of `items` item vectors, rows of `dim` floats (row-major, contiguous). Throws
// attnmix::error before any work for a null or empty input, non-finite values, options out of
// range, or when more items share their `levels` codes than a level has codes.
inline semantic_ids assign_semantic_ids(const float* vectors, index_t items, index_t dim,
                                        const semantic_id_options& o) {
  const std::string fn = "attnmix::assign_semantic_ids";
  detail::require(vectors != nullptr, fn, "vectors", "is null");
  detail::require(items > 0, fn, "items", "is ", items, "; a catalogue needs at least one item");
  detail::require(dim > 0, fn, "dim", "is ", dim, "; vectors need at least one element");
  detail::require(o.levels >= 1, fn, "options.levels", "is ", o.levels, "; at least 1");
  detail::require(o.codes >= 1 && o.codes <= (1 << 24), fn, "options.codes", "is ", o.codes,
                  "; between 1 and 2^24");
  detail::require(o.iterations >= 0, fn, "options.iterations", "is ", o.iterations, "; at least 0");
  for (index_t i = 0; i < items * dim; ++i)
    detail::require(std::isfinite(vectors[i]), fn, "vectors", "has the non-finite value ",
                    vectors[i], " at item ", i / dim, ", element ", i % dim);

  semantic_ids s;
  s.items = items, s.dim = dim, s.levels = o.levels, s.codes = o.codes;
  s.code.assign(static_cast<std::size_t>(items * s.depth()), 0);
  s.codebook.assign(static_cast<std::size_t>(o.levels * o.codes * dim), 0.f);
  std::vector<double> residual(vectors, vectors + items * dim), centroid;
  std::vector<std::int32_t> code;
  detail::sid_rng rng{o.seed};
  for (int l = 0; l < o.levels; ++l) {
    detail::sid_kmeans(residual, items, dim, o.codes, o.iterations, rng, centroid, code);
    for (index_t i = 0; i < items; ++i) {
      s.code[i * s.depth() + l] = code[i];
      for (index_t d = 0; d < dim; ++d) residual[i * dim + d] -= centroid[code[i] * dim + d];
    }
    for (std::size_t e = 0; e < centroid.size(); ++e)
      s.codebook[l * o.codes * dim + e] = static_cast<float>(centroid[e]);
  }
  // The collision code: 0, 1, ... in item order among the items that share their level codes.
  std::map<std::vector<std::int32_t>, std::int32_t> seen;
  for (index_t i = 0; i < items; ++i) {
    std::int32_t* c = s.code.data() + i * s.depth();
    std::int32_t& next = seen[std::vector<std::int32_t>(c, c + o.levels)];
    detail::require(next < o.codes, fn, "options.codes", "is ", o.codes,
                    ", but more items share the codes of item ", i,
                    " at every level: raise options.codes or options.levels");
    c[o.levels] = next++;
  }
  s.reindex();
  return s;
}

}  // namespace attnmix
