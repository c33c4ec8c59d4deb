#pragma once
// The compile-time shapes of the softmax-family backward kernels (attention_backward_simt.cuh),
// which the host plan (plan/attention_backward.hpp) sizes grids and shared memory with. Pure C++.

#include "attnmix/config.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

constexpr int attention_backward_threads = 256;
constexpr int attention_backward_preprocess_rows = 8;  // a warp a row, 8 warps a CTA

// Query rows and keys of a tile: 32, or 16 when head dims above 128 (chunks = 8) would make the
// staged tiles too large.
constexpr ATTNMIX_HOST_DEVICE int attention_backward_tile(int chunks) {
  return chunks > 4 ? 16 : 32;
}

// Shared memory of the dk/dv and dq kernels (the same layout): gate terms of the tile's rows and
// keys (double), then q, dout, k, v (float, rows padded by one so that a row read across lanes
// and a column read across lanes both avoid bank conflicts), P and dS (padded likewise), and the
// rows' lse, delta and last reset.
constexpr ATTNMIX_HOST_DEVICE int attention_backward_smem_bytes(int tile, int D, int Dv) {
  return 2 * tile * 8 +
         4 * (2 * tile * (D + 1) + 2 * tile * (Dv + 1) + 2 * tile * (tile + 1) + 3 * tile);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
