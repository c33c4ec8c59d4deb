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

// The FlashAttention-2-style tensor-core backward (attention_backward_mma.cuh), D = Dv in
// {64, 128}, on mma.sync (sm80_mma_v2) or wgmma (sm90_wgmma): 4 warps (a warpgroup); a dk/dv CTA
// holds 64 keys (16 a warp) and streams query tiles of attention_backward_v2_stream rows through
// two buffers, a dq CTA holds 64 query rows and streams key tiles of as many keys. On mma.sync 32
// streamed rows keep the registers of D = 64 within 168, so that a multiprocessor runs 3 CTAs
// (attention_backward_v2_min_blocks); wgmma's products are 64 wide. At D = 128: 2 CTAs.
constexpr int attention_backward_v2_threads = 128;
constexpr int attention_backward_v2_fixed = 64;
constexpr ATTNMIX_HOST_DEVICE int attention_backward_v2_stream(bool wgmma) {
  return wgmma ? 64 : 32;
}
constexpr ATTNMIX_HOST_DEVICE int attention_backward_v2_min_blocks(int D) {
  return D <= 64 ? 3 : 2;
}

// Shared memory of either kernel (the larger of the two): the fixed tiles (k, v or q, dout) and
// two buffers of the streamed ones, 16-bit, then two buffers of the streamed rows' terms (G as
// double; lse, delta, last reset as 4-byte values) and of the fixed keys' G (double) and their
// float terms; wgmma's tiles start 1024-byte aligned (slack for aligning the dynamic shared
// memory).
constexpr ATTNMIX_HOST_DEVICE int attention_backward_v2_smem_bytes(int D, bool wgmma) {
  return 2 * (2 * attention_backward_v2_fixed * D + 4 * attention_backward_v2_stream(wgmma) * D) +
         2 * attention_backward_v2_stream(wgmma) * (8 + 3 * 4) +
         2 * attention_backward_v2_fixed * (8 + 4) + (wgmma ? 1024 : 0);
}

// The query rows [first, end) that see some key of keys [j0, j1) of a sequence of `length`, under
// a window W (0: none), causal or not: the rows the dk/dv kernels walk.
constexpr ATTNMIX_HOST_DEVICE index_t backward_first_row(index_t j0, index_t W, bool causal) {
  return causal ? j0 : (W > 0 ? (j0 - W + 1 > 0 ? j0 - W + 1 : 0) : 0);
}
constexpr ATTNMIX_HOST_DEVICE index_t backward_end_row(index_t j1, index_t W, index_t length) {
  return W > 0 ? (j1 + W - 1 < length ? j1 + W - 1 : length) : length;
}
// The fused kernel walks row tiles from first / 64 * 64, so the 64-key blocks whose tiles include
// the one at row i0 (a multiple of 64) are those up to the last such block whose rows reach past
// i0: a run from the first block whose end row passes i0 (end rows grow with the block). Its rank
// in that run is a block's turn on the tile. Searched among blocks 0 .. j (j's tiles include i0).
constexpr ATTNMIX_HOST_DEVICE index_t backward_first_block_at(index_t i0, index_t j, index_t W,
                                                              index_t length) {
  constexpr index_t B = attention_backward_v2_fixed;
  index_t a = 0, b = j;
  while (a < b) {
    const index_t m = (a + b) / 2;
    if (backward_end_row((m + 1) * B < length ? (m + 1) * B : length, W, length) > i0)
      b = m;
    else
      a = m + 1;
  }
  return a;
}

// Key block j's turn on the row tile at i0 (a multiple of 64) in the fused kernel, whose rows
// reach it: causal, the blocks take their turns in descending order from i0 / 64 (the last block
// whose rows start at or before the tile; each starts at its own tile, so the one after it in
// turn reaches the tile a step later and never waits); otherwise ascending from the first.
constexpr ATTNMIX_HOST_DEVICE index_t backward_turn(index_t i0, index_t j, index_t W,
                                                    index_t length, bool causal) {
  return causal ? i0 / attention_backward_v2_fixed - j
                : j - backward_first_block_at(i0, j, W, length);
}

// The fused dk/dv kernel (wgmma): the above and the dS^T tile [64][64] (16-bit), the dQ tile
// [64][D] and the warps' row sums of dS [4][64] (float).
constexpr ATTNMIX_HOST_DEVICE int attention_backward_fused_smem_bytes(int D) {
  return attention_backward_v2_smem_bytes(D, true) + attention_backward_v2_fixed * 64 * 2 +
         64 * D * 4 + 4 * 64 * 4;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
