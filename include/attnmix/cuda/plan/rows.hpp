#pragma once
// The grid of the layers' grid-stride kernels (kernels/rows.cuh): a block per `threads` values,
// at most rows_blocks_per_sm blocks per multiprocessor (the loop takes the rest). Pure C++.

#include "attnmix/config.hpp"
#include "attnmix/cuda/plan/device_properties.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// Enough resident blocks to hide memory latency, few enough that a block loops over its values.
constexpr int rows_blocks_per_sm = 32;

inline unsigned rows_grid(index_t n, int threads, const device_properties& d) {
  const index_t blocks = (n + threads - 1) / threads;
  const index_t most = index_t(d.sms) * rows_blocks_per_sm;
  return unsigned(blocks < most ? (blocks > 0 ? blocks : 1) : most);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
