// Semantic IDs (include/attnmix/retrieval/semantic_ids.hpp): clusters share their first code,
// every item gets its own tuple and item_of inverts it, each level's residual k-means lowers the
// reconstruction error, collisions get the extra code, the same seed gives the same IDs, and bad
// input is an attnmix::error naming the argument; saved and loaded, the same IDs, and a file with
// codes out of range, repeated IDs or missing tensors is refused.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/errors.hpp"

#include "attnmix/retrieval/semantic_ids.hpp"
#include "attnmix/retrieval/semantic_ids_io.hpp"

namespace {

using attnmix::index_t;
using attnmix_test::expect_error;

// `clusters` well-separated groups of `per` points in `dim` dimensions (centres 10 apart along
// their own axis, spread 0.1), item i in cluster i / per.
std::vector<float> clustered(int clusters, int per, int dim, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.f, 0.1f);
  std::vector<float> v(static_cast<std::size_t>(clusters * per * dim));
  for (int c = 0; c < clusters; ++c)
    for (int p = 0; p < per; ++p)
      for (int d = 0; d < dim; ++d)
        v[((c * per + p) * dim) + d] = (d == c % dim ? 10.f * float(1 + c / dim) : 0.f) + n(g);
  return v;
}

// Mean squared distance between the vectors and the sum of their codes' centroids.
double reconstruction_error(const attnmix::semantic_ids& s, const std::vector<float>& v) {
  double err = 0;
  for (index_t i = 0; i < s.items; ++i)
    for (index_t d = 0; d < s.dim; ++d) {
      double x = v[i * s.dim + d];
      for (int l = 0; l < s.levels; ++l) x -= s.codebook[(l * s.codes + s.of(i)[l]) * s.dim + d];
      err += x * x;
    }
  return err / double(s.items);
}

void check_unique_and_inverse(const attnmix::semantic_ids& s) {
  std::set<std::vector<std::int32_t>> tuples;
  for (index_t i = 0; i < s.items; ++i) {
    const std::int32_t* c = s.of(i);
    for (int l = 0; l < s.depth(); ++l) {
      CHECK(c[l] >= 0);
      CHECK(c[l] < s.codes);
    }
    tuples.emplace(c, c + s.depth());
    CHECK(s.item_of(c) == i);
  }
  CHECK(tuples.size() == static_cast<std::size_t>(s.items));
}

}  // namespace

TEST_CASE("semantic IDs: clusters share their first code, every item its own tuple",
          "[retrieval][semantic_ids]") {
  const int clusters = 6, per = 20, dim = 8;
  const std::vector<float> v = clustered(clusters, per, dim, 7);
  attnmix::semantic_id_options o;
  o.levels = 3, o.codes = clusters, o.seed = 11;
  const attnmix::semantic_ids s = attnmix::assign_semantic_ids(v.data(), clusters * per, dim, o);
  REQUIRE(s.depth() == 4);
  std::set<std::int32_t> firsts;
  for (int c = 0; c < clusters; ++c) {
    const std::int32_t first = s.of(c * per)[0];
    for (int p = 1; p < per; ++p) CHECK(s.of(c * per + p)[0] == first);
    firsts.insert(first);
  }
  CHECK(firsts.size() == std::size_t(clusters));
  check_unique_and_inverse(s);
  const std::vector<std::int32_t> none(4, clusters - 1);
  const index_t owner = s.item_of(none.data());
  CHECK((owner == -1 || std::vector<std::int32_t>(s.of(owner), s.of(owner) + 4) == none));
}

TEST_CASE("semantic IDs: each level lowers the reconstruction error; the same seed, the same IDs",
          "[retrieval][semantic_ids]") {
  std::mt19937_64 g(3);
  std::normal_distribution<float> n(0.f, 1.f);
  const index_t items = 200, dim = 12;
  std::vector<float> v(static_cast<std::size_t>(items * dim));
  for (float& x : v) x = n(g);
  double before = 0;
  for (index_t i = 0; i < items * dim; ++i) before += double(v[i]) * v[i];
  before /= double(items);
  for (int levels = 1; levels <= 3; ++levels) {
    attnmix::semantic_id_options o;
    o.levels = levels, o.codes = 64, o.seed = 5;
    const attnmix::semantic_ids s = attnmix::assign_semantic_ids(v.data(), items, dim, o);
    const double err = reconstruction_error(s, v);
    INFO("levels " << levels << ": error " << err << ", before " << before);
    CHECK(err < 0.95 * before);
    before = err;
    check_unique_and_inverse(s);
    const attnmix::semantic_ids again = attnmix::assign_semantic_ids(v.data(), items, dim, o);
    CHECK(again.code == s.code);
    CHECK(again.codebook == s.codebook);
  }
}

TEST_CASE("semantic IDs: colliding items get the extra code, fewer items than codes work",
          "[retrieval][semantic_ids]") {
  // Items 0, 2, 4 are the same vector: their level codes collide, the extra code is 0, 1, 2.
  std::vector<float> v = {1, 0, 5, 5, 1, 0, -5, 5, 1, 0, 0, -9};
  attnmix::semantic_id_options o;
  o.levels = 2, o.codes = 4, o.seed = 1;
  const attnmix::semantic_ids s = attnmix::assign_semantic_ids(v.data(), 6, 2, o);
  CHECK(s.of(0)[2] == 0);
  CHECK(s.of(2)[2] == 1);
  CHECK(s.of(4)[2] == 2);
  check_unique_and_inverse(s);
  o.codes = 16;  // more codes than items
  check_unique_and_inverse(attnmix::assign_semantic_ids(v.data(), 6, 2, o));
  o.codes = 1;  // one code a level: every item collides, and 6 > 1
  CHECK_THROWS_AS(attnmix::assign_semantic_ids(v.data(), 6, 2, o), attnmix::error);
}

TEST_CASE("semantic IDs: bad input is an attnmix::error naming the argument",
          "[retrieval][semantic_ids][errors]") {
  std::vector<float> v(20, 1.f);
  const attnmix::semantic_id_options ok;
  expect_error("attnmix::assign_semantic_ids", "vectors", "is null",
               [&] { attnmix::assign_semantic_ids(nullptr, 5, 4, ok); });
  expect_error("attnmix::assign_semantic_ids", "items", "is 0; a catalogue needs at least one item",
               [&] { attnmix::assign_semantic_ids(v.data(), 0, 4, ok); });
  expect_error("attnmix::assign_semantic_ids", "dim", "is 0; vectors need at least one element",
               [&] { attnmix::assign_semantic_ids(v.data(), 5, 0, ok); });
  attnmix::semantic_id_options o = ok;
  o.levels = 0;
  expect_error("attnmix::assign_semantic_ids", "options.levels", "is 0; at least 1",
               [&] { attnmix::assign_semantic_ids(v.data(), 5, 4, o); });
  o = ok, o.codes = 0;
  expect_error("attnmix::assign_semantic_ids", "options.codes", "is 0; between 1 and 2^24",
               [&] { attnmix::assign_semantic_ids(v.data(), 5, 4, o); });
  o = ok, o.iterations = -1;
  expect_error("attnmix::assign_semantic_ids", "options.iterations", "is -1; at least 0",
               [&] { attnmix::assign_semantic_ids(v.data(), 5, 4, o); });
  v[13] = std::nanf("");
  expect_error("attnmix::assign_semantic_ids", "vectors", "has the non-finite value",
               [&] { attnmix::assign_semantic_ids(v.data(), 5, 4, ok); });
  // Five identical items, two codes at each of three levels: at most two can be told apart.
  std::vector<float> same(10, 2.f);
  o = ok, o.codes = 2;
  expect_error("attnmix::assign_semantic_ids", "options.codes", "more items share the codes",
               [&] { attnmix::assign_semantic_ids(same.data(), 5, 2, o); });
  // of / item_of
  const attnmix::semantic_ids s = attnmix::assign_semantic_ids(same.data(), 2, 5, o);
  expect_error("attnmix::semantic_ids::of", "item", "is 2 but the catalogue has 2 items",
               [&] { s.of(2); });
  expect_error("attnmix::semantic_ids::of", "item", "is -1 but the catalogue has 2 items",
               [&] { s.of(-1); });
  expect_error("attnmix::semantic_ids::item_of", "tuple", "is null", [&] { s.item_of(nullptr); });
  const std::vector<std::int32_t> out_of_range = {0, 0, 2, 0};  // codes 2 of [0, 2)
  expect_error("attnmix::semantic_ids::item_of", "tuple",
               "has the code 2 at level 2, outside [0, 2)",
               [&] { s.item_of(out_of_range.data()); });
  const std::vector<std::int32_t> negative = {0, -1, 0, 0};
  expect_error("attnmix::semantic_ids::item_of", "tuple",
               "has the code -1 at level 1, outside [0, 2)", [&] { s.item_of(negative.data()); });
}

namespace {

std::string temp_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("attnmix_test_semantic_ids_" + name + ".safetensors"))
      .string();
}

struct one_tensor {  // a file of another kind
  std::vector<float> x{1.f, 2.f};
  template <class F>
  void visit_parameters(F&& f) const {
    struct {
      const std::vector<float>& data;
      std::vector<index_t> shape;
    } t{x, {2}};
    f("x", t);
  }
};

}  // namespace

TEST_CASE("semantic IDs: saved and loaded, the same IDs; bad files refused",
          "[retrieval][semantic_ids][io]") {
  const std::vector<float> v = clustered(4, 10, 6, 9);
  attnmix::semantic_id_options o;
  o.levels = 2, o.codes = 8, o.seed = 2;
  const attnmix::semantic_ids s = attnmix::assign_semantic_ids(v.data(), 40, 6, o);
  const std::string path = temp_file("round_trip");
  attnmix::save_semantic_ids(s, path);
  const attnmix::semantic_ids back = attnmix::load_semantic_ids(path);
  CHECK(back.items == s.items);
  CHECK(back.dim == s.dim);
  CHECK(back.levels == s.levels);
  CHECK(back.codes == s.codes);
  CHECK(back.code == s.code);
  CHECK(back.codebook == s.codebook);
  check_unique_and_inverse(back);

  attnmix::semantic_ids bad = s;
  bad.code[5] = o.codes + 3;  // a code out of range
  attnmix::save_semantic_ids(bad, path);
  CHECK_THROWS_AS(attnmix::load_semantic_ids(path), attnmix::error);
  bad = s;
  for (int l = 0; l < s.depth(); ++l) bad.code[s.depth() + l] = s.code[l];  // item 1 = item 0
  attnmix::save_semantic_ids(bad, path);
  CHECK_THROWS_AS(attnmix::load_semantic_ids(path), attnmix::error);
  attnmix::io::save(one_tensor{}, path);
  CHECK_THROWS_AS(attnmix::load_semantic_ids(path), attnmix::error);
  CHECK_THROWS_AS(attnmix::load_semantic_ids(temp_file("does_not_exist")), attnmix::error);
  std::remove(path.c_str());
}
