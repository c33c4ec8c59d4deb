// The generative-retrieval model (hash embeddings, a bidirectional encoder, a decoder over the
// codes of semantic IDs): every parameter's gradient against finite differences of its loss in
// double; its recommendations as wide as the catalogue against every item's probability under
// teacher forcing; a small model learns a task and recommends its answers; saved and loaded
// beside its semantic IDs, it recommends the same; on a third backend it trains and recommends as
// on the CPU, bit for bit; bad input.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "attnmix/io/safetensors.hpp"
#include "attnmix/retrieval/generative_retrieval.hpp"
#include "attnmix/retrieval/semantic_ids_io.hpp"
#include "attnmix/train/optimizer.hpp"
#include "retrieval/retrieval_data.hpp"
#include "support/catch.hpp"
#include "support/errors.hpp"
#include "support/serial_backend.hpp"
#include "support/testing.hpp"
#include "train/gradcheck.hpp"

namespace {

using attnmix::index_t;
using namespace attnmix_test;
namespace L = attnmix::layers;

template <class T>
using encoder = attnmix::stack<T, attnmix::layer::sa, attnmix::layer::gbla>;
template <class T>
using model = attnmix::generative_retrieval<encoder<T>>;

L::config config_of(index_t D, index_t heads, index_t d, index_t mlp) {
  L::config c;
  c.hidden_size = D;
  c.num_heads = heads;
  c.head_dim = d;
  c.intermediate_size = mlp;
  return c;
}

// Histories as a call takes them.
struct histories {
  std::vector<std::uint64_t> items;
  std::vector<std::int32_t> offsets{0};
  void add(const std::vector<std::uint64_t>& h) {
    items.insert(items.end(), h.begin(), h.end());
    offsets.push_back(std::int32_t(items.size()));
  }
  index_t users() const { return index_t(offsets.size()) - 1; }
  attnmix::user_histories view() const {
    return {attnmix::view1<const std::uint64_t>(items.data(), {index_t(items.size())}),
            attnmix::view1<const std::int32_t>(offsets.data(), {index_t(offsets.size())})};
  }
};

const attnmix::backend::cpu serial{1};  // many small calls: no thread pool for each

}  // namespace

TEST_CASE("generative retrieval: every gradient matches finite differences of the loss",
          "[retrieval][generative][backward]") {
  const attnmix::semantic_ids ids = catalogue(10, 3, 1);
  attnmix::retrieval_config rc;
  rc.depth = ids.depth(), rc.codes = ids.codes, rc.buckets = 5, rc.hashes = 2;
  model<double> m(config_of(8, 2, 4, 12), rc);
  L::randomize_parameters(m, test_seed() ^ 1, 0.4, 0.3);
  histories h;
  h.add({item_id(0), item_id(3), item_id(7)});
  h.add({item_id(2)});
  h.add({item_id(9), item_id(1)});
  std::vector<std::int32_t> next;
  for (const index_t i : {4, 0, 8}) next.insert(next.end(), ids.of(i), ids.of(i) + ids.depth());
  const attnmix::tensor_view<const std::int32_t, 2> codes(next.data(), {3, ids.depth()});
  INFO("seed " << test_seed());
  const double loss = m.loss(h.view(), codes);
  CHECK(std::isfinite(loss));
  CHECK(loss == m.loss(h.view(), codes, false));
  check_parameter_grads(
      m, [&] { return std::vector<double>{m.loss(h.view(), codes, false, serial)}; }, {1.0}, 1e-7);
}

TEST_CASE("generative retrieval: as wide as the catalogue, every item's teacher-forced score",
          "[retrieval][generative]") {
  const attnmix::semantic_ids ids = catalogue(14, 4, 2);
  attnmix::retrieval_config rc;
  rc.depth = ids.depth(), rc.codes = ids.codes, rc.buckets = 7, rc.hashes = 2;
  model<double> m(config_of(12, 3, 4, 16), rc);
  L::randomize_parameters(m, test_seed() ^ 2, 0.5, 0.3);
  histories h;
  h.add({item_id(5), item_id(6), item_id(1), item_id(13)});
  h.add({item_id(2), item_id(2)});
  const auto all = m.recommend(h.view(), ids, int(ids.items), int(ids.items));
  REQUIRE(all.size() == 2);
  for (index_t u = 0; u < 2; ++u) {
    INFO("seed " << test_seed() << " user " << u);
    histories one;
    one.add(std::vector<std::uint64_t>(h.items.begin() + h.offsets[std::size_t(u)],
                                       h.items.begin() + h.offsets[std::size_t(u) + 1]));
    const auto& r = all[std::size_t(u)];
    REQUIRE(r.items.size() == std::size_t(ids.items));
    std::vector<index_t> seen(r.items);
    std::sort(seen.begin(), seen.end());
    CHECK(std::unique(seen.begin(), seen.end()) == seen.end());
    for (std::size_t k = 0; k < r.items.size(); ++k) {
      const attnmix::tensor_view<const std::int32_t, 2> codes(ids.of(r.items[k]), {1, ids.depth()});
      // The loss is the mean of the codes' negative log-probabilities.
      const double score = -ids.depth() * m.loss(one.view(), codes, false, serial);
      CHECK(r.scores[k] == Approx(score).epsilon(1e-12));
      if (k > 0) CHECK(r.scores[k] <= r.scores[k - 1]);
    }
  }
}

TEST_CASE("generative retrieval: many users at once, each user's own recommendations",
          "[retrieval][generative]") {
  // More users than one decoder call scores: each group's beams are scored together.
  const attnmix::semantic_ids ids = catalogue(14, 4, 2);
  attnmix::retrieval_config rc;
  rc.depth = ids.depth(), rc.codes = ids.codes, rc.buckets = 9, rc.hashes = 2;
  model<double> m(config_of(8, 2, 4, 12), rc);
  L::randomize_parameters(m, test_seed() ^ 5, 0.5, 0.3);
  const index_t users = model<double>::recommend_group + 5;
  std::mt19937_64 g(test_seed() ^ 55);
  histories h;
  for (index_t u = 0; u < users; ++u) {
    std::vector<std::uint64_t> one;
    for (index_t t = 0, n = 1 + index_t(g() % 5); t < n; ++t)
      one.push_back(item_id(index_t(g() % std::uint64_t(ids.items))));
    h.add(one);
  }
  const auto all = m.recommend(h.view(), ids, 5, 3, serial);
  REQUIRE(all.size() == std::size_t(users));
  for (index_t u = 0; u < users; ++u) {
    INFO("seed " << test_seed() << " user " << u);
    histories one;
    one.add(std::vector<std::uint64_t>(h.items.begin() + h.offsets[std::size_t(u)],
                                       h.items.begin() + h.offsets[std::size_t(u) + 1]));
    const auto want = m.recommend(one.view(), ids, 5, 3, serial);
    CHECK(all[std::size_t(u)].items == want[0].items);
    REQUIRE(all[std::size_t(u)].scores.size() == want[0].scores.size());
    for (std::size_t k = 0; k < want[0].scores.size(); ++k)
      CHECK(all[std::size_t(u)].scores[k] == Approx(want[0].scores[k]).epsilon(1e-12));
  }
}

TEST_CASE("generative retrieval: a small model learns a task and recommends its answers",
          "[retrieval][generative][train]") {
  // Items come in three genres (i mod 3); a history holds items of one genre, and the next item
  // is the genre's own (item 3 g + 9 for genre g). The encoder must read the history's genre.
  const attnmix::semantic_ids ids = catalogue(12, 4, 3);
  attnmix::retrieval_config rc;
  rc.depth = ids.depth(), rc.codes = ids.codes, rc.buckets = 64, rc.hashes = 2;
  model<float> m(config_of(32, 4, 8, 64), rc);
  L::randomize_parameters(m, 3, 0.1);
  std::mt19937_64 g(test_seed());
  const auto batch = [&](index_t users, histories& h, std::vector<std::int32_t>& next,
                         std::vector<index_t>& answer) {
    for (index_t u = 0; u < users; ++u) {
      const index_t genre = index_t(g() % 3), len = 1 + index_t(g() % 5);
      std::vector<std::uint64_t> items;
      for (index_t t = 0; t < len; ++t) items.push_back(item_id(genre + 3 * index_t(g() % 3)));
      h.add(items);
      answer.push_back(9 + genre);
      next.insert(next.end(), ids.of(answer.back()), ids.of(answer.back()) + ids.depth());
    }
  };
  attnmix::train::adamw<> opt({0.9, 0.99, 1e-8, 0.0, 1.0});
  opt.init(m);
  double first = 0, last = 0;
  for (int step = 0; step < 150; ++step) {
    histories h;
    std::vector<std::int32_t> next;
    std::vector<index_t> answer;
    batch(16, h, next, answer);
    attnmix::train::adamw<>::zero_grad(m);
    last = m.loss(h.view(), {next.data(), {16, ids.depth()}});
    if (step == 0) first = last;
    opt.step(m, 3e-3);
  }
  INFO("seed " << test_seed() << " loss " << first << " -> " << last);
  CHECK(last < 0.05);
  histories h;
  std::vector<std::int32_t> next;
  std::vector<index_t> answer;
  batch(12, h, next, answer);
  const auto r = m.recommend(h.view(), ids, 4, 2);
  for (std::size_t u = 0; u < r.size(); ++u) CHECK(r[u].items[0] == answer[u]);
}

TEST_CASE("generative retrieval: saved and loaded, the same recommendations",
          "[retrieval][generative][io]") {
  const attnmix::semantic_ids ids = catalogue(20, 6, 6);
  attnmix::retrieval_config rc;
  rc.depth = ids.depth(), rc.codes = ids.codes, rc.buckets = 16, rc.hashes = 3, rc.part = 4;
  const L::config c = config_of(16, 2, 8, 24);
  model<float> m(c, rc), back(c, rc);
  L::randomize_parameters(m, test_seed() ^ 6, 0.3, 0.2);
  L::randomize_parameters(back, test_seed() ^ 7, 0.3, 0.2);
  const std::string stem = (std::filesystem::temp_directory_path() /
                            ("attnmix_test_retrieval_" + std::to_string(test_seed())))
                               .string();
  attnmix::io::save(m, stem + ".model.safetensors");
  attnmix::save_semantic_ids(ids, stem + ".ids.safetensors");
  attnmix::io::load(back, stem + ".model.safetensors");
  const attnmix::semantic_ids ids_back = attnmix::load_semantic_ids(stem + ".ids.safetensors");
  std::filesystem::remove(stem + ".model.safetensors");
  std::filesystem::remove(stem + ".ids.safetensors");
  histories h;
  h.add({item_id(3), item_id(17), item_id(4)});
  h.add({item_id(11)});
  const auto want = m.recommend(h.view(), ids, 6, 5),
             got = back.recommend(h.view(), ids_back, 6, 5);
  REQUIRE(got.size() == want.size());
  for (std::size_t u = 0; u < want.size(); ++u) {
    CHECK(got[u].items == want[u].items);
    CHECK(bitwise_equal(got[u].scores, want[u].scores));
  }
  // Its parameters by name, as a checkpoint holds them.
  std::vector<std::string> names;
  m.visit_parameters([&](const std::string& n, const auto&) { names.push_back(n); });
  for (const char* n :
       {"items.table.weight", "items.projection.weight", "encoder.layers.0.attn.q_proj.weight",
        "codes.weight", "decoder.layers.0.cross_attn.k_proj.weight", "head.weight"})
    CHECK(std::find(names.begin(), names.end(), n) != names.end());
}

TEST_CASE("generative retrieval trains and recommends on a third backend as on the cpu one",
          "[retrieval][generative][third_backend]") {
  // The serial test backend forwards to the CPU's kernels on one thread, whose sums do not
  // depend on the thread count: the same losses, weights and recommendations, bit for bit.
  using serial = test_backend::serial;
  using host_encoder = encoder<float>;
  using serial_model = attnmix::generative_retrieval<attnmix::stack_on<host_encoder, serial>>;
  const attnmix::semantic_ids ids = catalogue(16, 6, 8);
  attnmix::retrieval_config rc;
  rc.depth = ids.depth(), rc.codes = ids.codes, rc.buckets = 11, rc.hashes = 2;
  const L::config c = config_of(16, 2, 8, 24);
  model<float> host(c, rc);
  serial_model ser(c, rc);
  L::randomize_parameters(host, test_seed() ^ 8, 0.2, 0.2);
  L::transfer_parameters(host, ser);
  histories h;
  h.add({item_id(1), item_id(5), item_id(9)});
  h.add({item_id(4), item_id(2)});
  std::vector<std::int32_t> next;
  for (const index_t i : {7, 12}) next.insert(next.end(), ids.of(i), ids.of(i) + ids.depth());
  const attnmix::tensor_view<const std::int32_t, 2> codes(next.data(), {2, ids.depth()});
  attnmix::train::adamw<attnmix::backend::cpu> host_opt;
  attnmix::train::adamw<serial> serial_opt;
  for (int step = 0; step < 2; ++step) {
    INFO("seed " << test_seed() << " step " << step);
    host_opt.zero_grad(host);
    serial_opt.zero_grad(ser);
    CHECK(ser.loss(h.view(), codes, true, serial{}) ==
          host.loss(h.view(), codes, true, attnmix::backend::cpu{3}));
    serial_opt.step(ser, 1e-2, serial{});
    host_opt.step(host, 1e-2, attnmix::backend::cpu{3});
  }
  const auto want = host.recommend(h.view(), ids, 5, 5, attnmix::backend::cpu{3});
  const auto got = ser.recommend(h.view(), ids, 5, 5, serial{});
  REQUIRE(got.size() == want.size());
  for (std::size_t u = 0; u < want.size(); ++u) {
    CHECK(got[u].items == want[u].items);
    CHECK(bitwise_equal(got[u].scores, want[u].scores));
  }
}

TEST_CASE("generative retrieval rejects bad input", "[retrieval][generative][errors]") {
  const attnmix::semantic_ids ids = catalogue(10, 3, 4);
  attnmix::retrieval_config rc;
  rc.depth = ids.depth(), rc.codes = ids.codes, rc.buckets = 5, rc.hashes = 2;
  const L::config c = config_of(8, 2, 4, 12);
  rc.depth = 0;
  expect_error("attnmix::generative_retrieval", "retrieval.depth", "must be >= 1",
               [&] { model<float>(c, rc); });
  rc.depth = ids.depth();
  model<float> m(c, rc);
  L::randomize_parameters(m, 4, 0.2);
  histories h;
  h.add({item_id(1), item_id(2)});
  h.add({item_id(3)});
  std::vector<std::int32_t> next(std::size_t(2 * ids.depth()), 0);
  const std::string loss = "attnmix::generative_retrieval::loss";
  next[3] = ids.codes;
  expect_error(loss, "codes", "[1, 0] is 3, not a code in [0, 3)", [&] {
    m.loss(h.view(), {next.data(), {2, ids.depth()}});
  });
  next[3] = 0;
  expect_error(loss, "codes", "must be [users, depth] = [2, 3]", [&] {
    m.loss(h.view(), {next.data(), {1, ids.depth()}});
  });
  histories empty = h;
  empty.offsets.push_back(empty.offsets.back());
  expect_error(loss, "offsets", "give user 2 an empty history", [&] {
    m.loss(empty.view(), {next.data(), {2, ids.depth()}});
  });
  histories short_items = h;
  short_items.items.pop_back();
  expect_error(loss, "offsets", "", [&] {
    m.loss(short_items.view(), {next.data(), {2, ids.depth()}});
  });
  const std::string rec = "attnmix::generative_retrieval::recommend";
  expect_error(rec, "width", "is 11 but must be in [1, 10]",
               [&] { m.recommend(h.view(), ids, 11, 1); });
  expect_error(rec, "top_k", "is 3 but must be in [1, width = 2]",
               [&] { m.recommend(h.view(), ids, 2, 3); });
  const attnmix::semantic_ids other = catalogue(10, 4, 5);
  expect_error(rec, "ids", "but the model's are 3 codes in [0, 3)",
               [&] { m.recommend(h.view(), other, 2, 1); });
}
