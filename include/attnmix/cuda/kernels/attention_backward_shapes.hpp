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

// The FlashAttention-2-style tensor-core backward (sm80_attention_backward_v2.cuh), D = Dv in
// {64, 128}: 4 warps; a dk/dv CTA holds 64 keys (16 a warp) and streams query tiles of
// attention_backward_v2_stream(D) rows through two buffers, a dq CTA holds 64 query rows and
// streams key tiles of as many keys. 32 streamed rows or keys keep the registers of D = 64
// within 168, so that a multiprocessor runs 3 CTAs (attention_backward_v2_min_blocks); at
// D = 128 it runs 2 (255 registers).
constexpr int attention_backward_v2_threads = 128;
constexpr int attention_backward_v2_fixed = 64;
constexpr ATTNMIX_HOST_DEVICE int attention_backward_v2_stream(int) {
  return 32;
}
constexpr ATTNMIX_HOST_DEVICE int attention_backward_v2_min_blocks(int D) {
  return D <= 64 ? 3 : 2;
}

// Shared memory of either v2 kernel (the larger of the two): the fixed tiles (k, v or q, dout)
// and two buffers of the streamed ones, 16-bit, then two buffers of the streamed rows' terms
// (G as double; lse, delta, last reset as 4-byte values) and of the fixed keys' G (double).
constexpr ATTNMIX_HOST_DEVICE int attention_backward_v2_smem_bytes(int D) {
  return 2 * (2 * attention_backward_v2_fixed * D + 4 * attention_backward_v2_stream(D) * D) +
         2 * attention_backward_v2_stream(D) * (8 + 3 * 4) + 2 * attention_backward_v2_fixed * 8;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
