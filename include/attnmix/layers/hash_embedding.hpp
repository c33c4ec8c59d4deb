#pragma once
// layers::hash_embedding: 64-bit item IDs to rows of the model width through k hash functions (the
// GBLA paper's item input, which a catalogue of millions of items could not give one row each).
// Item id takes bucket h_j(id) in [0, buckets) of table j for j < k; the k rows (each `part` wide)
// are concatenated to [k * part] and projected to `width` (no bias):
//
//   y[r, :] = concat_j table[j * buckets + h_j(id_r), :] projection^T
//
// The k tables are one parameter, "table.weight" [k * buckets, part]; the projection is
// "projection.weight" [width, k * part]. h_j(id) = splitmix64(id + (seed + j) * golden) mod
// buckets, the same on every platform. The hashing runs on the host (bucket_rows); apply and
// backward take its rows in the backend's memory, so a device stack hashes once per batch and
// uploads the rows.

#include <cstdint>
#include <string>

#include "attnmix/core/error.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/embedding.hpp"
#include "attnmix/layers/linear.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace layers {

template <class T, class Backend = backend::cpu>
class hash_embedding {
 public:
  hash_embedding() = default;
  hash_embedding(index_t buckets, int hashes, index_t part, index_t width, std::uint64_t seed = 0)
      : table(checked(buckets, hashes, part, width) * buckets, part),
        projection(hashes * part, width),
        buckets_(buckets),
        hashes_(hashes),
        part_(part),
        width_(width),
        seed_(seed) {}

  // The same layer with the weights copied (and rounded) to T in Backend's memory.
  template <class U, class B>
  explicit hash_embedding(const hash_embedding<U, B>& other)
      : table(other.table),
        projection(other.projection),
        buckets_(other.buckets()),
        hashes_(other.hashes()),
        part_(other.part()),
        width_(other.width()),
        seed_(other.seed()) {}

  index_t buckets() const { return buckets_; }
  int hashes() const { return hashes_; }
  index_t part() const { return part_; }
  index_t width() const { return width_; }
  std::uint64_t seed() const { return seed_; }

  // Bucket j of an id: in [0, buckets).
  index_t bucket(std::uint64_t id, int j) const {
    std::uint64_t z = id + (seed_ + std::uint64_t(j)) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<index_t>(z % static_cast<std::uint64_t>(buckets_));
  }
  // The table rows of `rows` ids (host memory): out[r * hashes + j] = j * buckets + h_j(ids[r]).
  void bucket_rows(const std::uint64_t* ids, index_t rows, std::int32_t* out) const {
    const std::string fn = "attnmix::layers::hash_embedding::bucket_rows";
    attnmix::detail::require(rows >= 0, fn, "rows", "is ", rows, "; at least 0");
    attnmix::detail::require(rows == 0 || ids != nullptr, fn, "ids", "is null for ", rows, " rows");
    attnmix::detail::require(rows == 0 || out != nullptr, fn, "out", "is null for ", rows, " rows");
    for (index_t r = 0; r < rows; ++r)
      for (int j = 0; j < hashes_; ++j)
        out[r * hashes_ + j] = static_cast<std::int32_t>(j * buckets_ + bucket(ids[r], j));
  }

  // y [rows, width] from the rows of bucket_rows ([rows * hashes], in the backend's memory).
  void apply(const context<Backend>& c, const std::int32_t* rows_in, index_t rows, T* y) const {
    using O = ops<Backend>;
    typename O::scratch s(c.be, scratch_bytes<T>(rows * hashes_ * part_));
    T* g = s.template take<T>(rows * hashes_ * part_);
    table.apply(c, rows_in, rows * hashes_, g);  // [rows * k, part] = [rows, k * part]
    projection.apply(c, g, rows, y);
  }
  // The backward of apply: projection.weight.grad += dy^T g, table.weight.grad[rows] += dg.
  void backward(const context<Backend>& c, const std::int32_t* rows_in, index_t rows, const T* dy) {
    using O = ops<Backend>;
    const index_t n = rows * hashes_ * part_;
    typename O::scratch s(c.be, scratch_bytes<T>(n) * 2);
    T* g = s.template take<T>(n);
    T* dg = s.template take<T>(n);
    table.apply(c, rows_in, rows * hashes_, g);
    projection.backward(c, g, rows, dy, dg);
    table.backward(c, rows_in, rows * hashes_, dg);
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    table.visit_parameters(f, prefix + "table.");
    projection.visit_parameters(f, prefix + "projection.");
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    table.visit_parameters(f, prefix + "table.");
    projection.visit_parameters(f, prefix + "projection.");
  }

  embedding<T, Backend> table;
  linear<T, Backend> projection;

 private:
  // k, before the tables are made: every size positive and every table row an int32.
  static index_t checked(index_t buckets, int hashes, index_t part, index_t width) {
    const std::string fn = "attnmix::layers::hash_embedding";
    attnmix::detail::require(buckets >= 1, fn, "buckets", "is ", buckets, "; at least 1");
    attnmix::detail::require(hashes >= 1, fn, "hashes", "is ", hashes, "; at least 1");
    attnmix::detail::require(part >= 1, fn, "part", "is ", part, "; at least 1");
    attnmix::detail::require(width >= 1, fn, "width", "is ", width, "; at least 1");
    attnmix::detail::require(buckets <= INT32_MAX / hashes, fn, "buckets", "is ", buckets,
                             " and hashes ", hashes, ": the table's rows would not fit an int32");
    return hashes;
  }

  index_t buckets_ = 0;
  int hashes_ = 0;
  index_t part_ = 0, width_ = 0;
  std::uint64_t seed_ = 0;
};

}  // namespace layers
}  // namespace attnmix
