// The generative-retrieval model on the GPU (its encoder a device stack, made from a host model by
// the converting constructor) against the same model on the CPU: the teacher-forced loss and the
// beam search's recommendations, items and scores.

#include <cstdint>
#include <random>
#include <vector>

#include "attnmix/cuda.cuh"
#include "attnmix/retrieval/generative_retrieval.hpp"
#include "attnmix/retrieval/semantic_ids.hpp"
#include "retrieval/retrieval_data.hpp"
#include "support/catch.hpp"
#include "support/cuda_testing.cuh"
#include "support/testing.hpp"

namespace {

using attnmix::index_t;
using namespace attnmix_test;
namespace L = attnmix::layers;

using host_encoder = attnmix::stack<float, attnmix::layer::sa, attnmix::layer::gbla>;
using host_model = attnmix::generative_retrieval<host_encoder>;
using device_model = attnmix::generative_retrieval<attnmix::device_stack<host_encoder, float>>;

}  // namespace

TEST_CASE("generative retrieval on the GPU recommends as on the CPU", "[retrieval][cuda]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  const attnmix::semantic_ids ids = catalogue(24, 6, 9);
  attnmix::retrieval_config rc;
  rc.depth = ids.depth(), rc.codes = ids.codes, rc.buckets = 13, rc.hashes = 2;
  L::config c;
  c.hidden_size = 128, c.num_heads = 2, c.intermediate_size = 192;
  host_model host(c, rc);
  L::randomize_parameters(host, test_seed() ^ 9, 0.3, 0.2);
  device_model gpu(host);  // loss() fills gradients: not const

  std::vector<std::uint64_t> items;
  std::vector<std::int32_t> offsets{0};
  for (const std::vector<index_t>& h : std::vector<std::vector<index_t>>{
           {1, 5, 9, 3, 3, 17}, {4}, {2, 8, 21, 0, 11, 6, 7, 13, 5}}) {
    for (index_t i : h) items.push_back(item_id(i));
    offsets.push_back(std::int32_t(items.size()));
  }
  const attnmix::user_histories hist{
      attnmix::view1<const std::uint64_t>(items.data(), {index_t(items.size())}),
      attnmix::view1<const std::int32_t>(offsets.data(), {index_t(offsets.size())})};
  std::vector<std::int32_t> next;
  for (const index_t i : {7, 12, 2}) next.insert(next.end(), ids.of(i), ids.of(i) + ids.depth());
  const attnmix::tensor_view<const std::int32_t, 2> codes(next.data(), {3, ids.depth()});

  INFO("seed " << test_seed());
  const double want_loss = host.loss(hist, codes, false, attnmix::backend::cpu{});
  const double got_loss = gpu.loss(hist, codes, false, attnmix::backend::cuda{});
  CHECK(got_loss == Approx(want_loss).epsilon(1e-5));

  const auto want = host.recommend(hist, ids, 6, 4, attnmix::backend::cpu{});
  const auto got = gpu.recommend(hist, ids, 6, 4, attnmix::backend::cuda{});
  REQUIRE(got.size() == want.size());
  for (std::size_t u = 0; u < want.size(); ++u) {
    INFO("user " << u);
    CHECK(got[u].items == want[u].items);
    REQUIRE(got[u].scores.size() == want[u].scores.size());
    for (std::size_t k = 0; k < want[u].scores.size(); ++k)
      // A score sums log-probabilities of magnitude ~1 over the levels: float agrees to ~1e-5
      // of it, so relative (seen: 3.6e-5 at |score| 3.3) as well as absolute.
      CHECK(got[u].scores[k] == Approx(want[u].scores[k]).epsilon(1e-4).margin(1e-4));
  }
}
