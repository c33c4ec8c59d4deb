#pragma once
// Small catalogues and item IDs the generative-retrieval tests (CPU and CUDA) share.

#include <cstdint>
#include <random>
#include <vector>

#include "attnmix/retrieval/semantic_ids.hpp"

namespace attnmix_test {

// A catalogue of `items` items with semantic IDs of 2 levels of `codes` codes (and the collision
// code), from random vectors.
inline attnmix::semantic_ids catalogue(attnmix::index_t items, int codes, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> v(static_cast<std::size_t>(items * 4));
  for (float& x : v) x = n(g);
  attnmix::semantic_id_options o;
  o.levels = 2, o.codes = codes, o.seed = seed;
  return attnmix::assign_semantic_ids(v.data(), items, 4, o);
}

// The 64-bit ID of catalogue item i.
inline std::uint64_t item_id(attnmix::index_t i) {
  return 0x9e3779b97f4a7c15ull * std::uint64_t(i + 1) + 12345;
}

}  // namespace attnmix_test
