// layers::hash_embedding on the CPU: each id's k buckets in their tables' row ranges and the same
// on every call, the forward against a direct computation, the backward against central finite
// differences in double (repeated ids and shared buckets included), its parameters' names and
// shapes, and bad sizes or inputs as an attnmix::error naming the argument.

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "attnmix/layers/hash_embedding.hpp"
#include "support/catch.hpp"
#include "support/errors.hpp"
#include "support/testing.hpp"

using attnmix::index_t;
using attnmix_test::expect_error;

namespace {

using layer = attnmix::layers::hash_embedding<double>;
using O = attnmix::layers::ops<attnmix::backend::cpu>;
using ctx = attnmix::layers::context<attnmix::backend::cpu>;

struct call {
  attnmix::backend::cpu be;
  attnmix::layers::token_layout L;
  O::handles h{};
  ctx c() const { return ctx{be, L, nullptr, h}; }
};

std::vector<double> forward(const layer& e, const std::vector<std::int32_t>& rows_in,
                            index_t rows) {
  call k{{}, {1, rows, {}}};
  std::vector<double> y(static_cast<std::size_t>(rows * e.width()));
  e.apply(k.c(), rows_in.data(), rows, y.data());
  return y;
}

}  // namespace

TEST_CASE("hash embedding: buckets, forward, backward against finite differences in double",
          "[layers][hash_embedding]") {
  attnmix_test::rng r(attnmix_test::test_seed() ^ 0x4a5e);
  layer e(7, 3, 4, 5, 42);
  for (double& x : e.table.weight.data) x = r.normal();
  for (double& x : e.projection.weight.data) x = r.normal();
  // 8 rows: a repeated id, ids near 0 and near 2^64.
  const std::vector<std::uint64_t> ids = {0,     1, 0x8000000000000005ull, 12345678901234ull, 1, 99,
                                          ~0ull, 7};
  const index_t rows = static_cast<index_t>(ids.size()), k = e.hashes();
  std::vector<std::int32_t> rows_in(static_cast<std::size_t>(rows * k)), again(rows_in.size());
  e.bucket_rows(ids.data(), rows, rows_in.data());
  e.bucket_rows(ids.data(), rows, again.data());
  CHECK(rows_in == again);
  for (index_t i = 0; i < rows; ++i)
    for (index_t j = 0; j < k; ++j) {
      const std::int32_t v = rows_in[i * k + j];
      CHECK(v >= j * e.buckets());
      CHECK(v < (j + 1) * e.buckets());
      CHECK(v == j * e.buckets() + e.bucket(ids[i], int(j)));
    }
  // Another seed moves some buckets.
  const layer other(7, 3, 4, 5, 43);
  int moved = 0;
  for (const std::uint64_t id : ids)
    for (int j = 0; j < 3; ++j) moved += other.bucket(id, j) != e.bucket(id, j);
  CHECK(moved > 0);

  // Forward against concat(table rows) projection^T.
  const std::vector<double> y = forward(e, rows_in, rows);
  const index_t P = e.part(), W = e.width();
  for (index_t i = 0; i < rows; ++i)
    for (index_t o = 0; o < W; ++o) {
      double want = 0;
      for (index_t j = 0; j < k; ++j)
        for (index_t d = 0; d < P; ++d)
          want += e.table.weight.data[rows_in[i * k + j] * P + d] *
                  e.projection.weight.data[o * k * P + j * P + d];
      CHECK(std::abs(y[i * W + o] - want) <= 1e-12 * (1 + std::abs(want)));
    }

  // Backward of L = sum(w * y) against central differences of every parameter.
  std::vector<double> w(y.size());
  for (double& x : w) x = r.normal();
  call kc{{}, {1, rows, {}}};
  e.table.weight.zero_grad();
  e.projection.weight.zero_grad();
  e.backward(kc.c(), rows_in.data(), rows, w.data());
  const auto loss = [&] {
    const std::vector<double> yy = forward(e, rows_in, rows);
    double l = 0;
    for (std::size_t i = 0; i < yy.size(); ++i) l += w[i] * yy[i];
    return l;
  };
  for (auto* p : {&e.table.weight, &e.projection.weight}) {
    double worst = 0, mag = 0;
    for (std::size_t i = 0; i < p->data.size(); ++i) {
      const double keep = p->data[i], h = 1e-5;
      p->data[i] = keep + h;
      const double up = loss();
      p->data[i] = keep - h;
      const double down = loss();
      p->data[i] = keep;
      const double fd = (up - down) / (2 * h);
      worst = std::max(worst, std::abs(fd - p->grad[i]));
      mag = std::max(mag, std::abs(fd));
    }
    INFO("worst |fd - grad| " << worst << " of max |fd| " << mag);
    CHECK(mag > 0);
    CHECK(worst <= 1e-8 * mag);
  }

  // Names and shapes.
  std::map<std::string, std::vector<index_t>> seen;
  e.visit_parameters([&](const std::string& name, const auto& p) { seen[name] = p.shape; },
                     "items.");
  CHECK(seen.size() == 2u);
  CHECK(seen["items.table.weight"] == std::vector<index_t>{21, 4});
  CHECK(seen["items.projection.weight"] == std::vector<index_t>{5, 12});
}

TEST_CASE("hash embedding: bad sizes and inputs are an attnmix::error naming the argument",
          "[layers][hash_embedding][errors]") {
  expect_error("attnmix::layers::hash_embedding", "buckets", "is 0; at least 1",
               [] { layer(0, 2, 4, 4); });
  expect_error("attnmix::layers::hash_embedding", "hashes", "is 0; at least 1",
               [] { layer(8, 0, 4, 4); });
  expect_error("attnmix::layers::hash_embedding", "part", "is 0; at least 1",
               [] { layer(8, 2, 0, 4); });
  expect_error("attnmix::layers::hash_embedding", "width", "is 0; at least 1",
               [] { layer(8, 2, 4, 0); });
  expect_error("attnmix::layers::hash_embedding", "buckets",
               "the table's rows would not fit an int32",
               [] { layer(index_t(1) << 30, 4, 1, 1); });  // rows past int32
  const layer e(8, 2, 4, 4);
  std::vector<std::int32_t> out(4);
  const std::uint64_t ids[2] = {1, 2};
  expect_error("attnmix::layers::hash_embedding::bucket_rows", "ids", "is null for 2 rows",
               [&] { e.bucket_rows(nullptr, 2, out.data()); });
  expect_error("attnmix::layers::hash_embedding::bucket_rows", "out", "is null for 2 rows",
               [&] { e.bucket_rows(ids, 2, nullptr); });
  expect_error("attnmix::layers::hash_embedding::bucket_rows", "rows", "is -1; at least 0",
               [&] { e.bucket_rows(ids, -1, out.data()); });
  e.bucket_rows(nullptr, 0, nullptr);  // nothing to do
}
