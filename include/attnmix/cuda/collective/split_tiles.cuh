#pragma once
// A CTA of 256 threads stages [64][64] tiles into the split (hi, lo) bfloat16 tiles the products
// of collective/split_mma.cuh read (rows padded to ld = 72 elements): load_tile reads this
// thread's elements (r, c) = at(r, c) for r < rows and c < cols, else 0, into registers;
// store_tile writes them, lo (when Lo) holding what hi's rounding left. Loads of several tiles
// issued before the first store are in flight together (a store to shared memory keeps the
// compiler from moving a later load above it), so a kernel can load the next step's tiles while
// a step computes.

#include <cstdint>

#include "attnmix/cuda/collective/split_mma.cuh"

namespace attnmix {
namespace detail {
namespace cuda {
namespace split_tile {

constexpr int C = 64, ld = C + 8, threads = 256;
constexpr int elements = C * ld;  // of one part of a tile

using regs = float[C * 32 / threads][2];
// f(r, c, x0, x1) for each pair of this thread's tile registers: row r, columns c and c + 1.
template <class X, class F>
__device__ __forceinline__ void for_tile_pairs(X& x, F&& f) {
#pragma unroll
  for (int k = 0; k < C * 32 / threads; ++k) {
    const int i = int(threadIdx.x) + k * threads;
    f(i >> 5, 2 * (i & 31), x[k][0], x[k][1]);
  }
}
template <class F>
__device__ __forceinline__ void load_tile(regs& x, F&& at, int rows, int cols) {
  for_tile_pairs(x, [&](int r, int c, float& x0, float& x1) {
    x0 = r < rows && c < cols ? at(r, c) : 0.f;
    x1 = r < rows && c + 1 < cols ? at(r, c + 1) : 0.f;
  });
}
template <bool Lo>
__device__ __forceinline__ void store_tile(const regs& x, split_op* hi, split_op* lo) {
  for_tile_pairs(x, [&](int r, int c, float x0, float x1) {
    std::uint32_t h, l;
    if constexpr (Lo) {
      split2(x0, x1, h, l);
      *reinterpret_cast<std::uint32_t*>(lo + r * ld + c) = l;
    } else {
      h = pack2<split_op>(x0, x1);
    }
    *reinterpret_cast<std::uint32_t*>(hi + r * ld + c) = h;
  });
}
template <bool Lo, class F>
__device__ __forceinline__ void stage(split_op* hi, split_op* lo, F&& at, int rows, int cols) {
  regs x;
  load_tile(x, at, rows, cols);
  store_tile<Lo>(x, hi, lo);
}

// A warp's part of a tile (16 x 32: rows r0 .., columns c0 ..; an accumulator of split_mma's
// warp_mma with NT = 4) into (hi, lo); rows from `rows` on as 0.
__device__ __forceinline__ void store_split(float (&acc)[4][4], split_op* hi, split_op* lo, int r0,
                                            int c0, int rows = C) {
  for_fragment_at<4>(acc, 0, r0, c0, ld, [&](int r, int at, float x0, float x1) {
    std::uint32_t h = 0u, l = 0u;
    if (r < rows) split2(x0, x1, h, l);
    *reinterpret_cast<std::uint32_t*>(hi + at) = h;
    *reinterpret_cast<std::uint32_t*>(lo + at) = l;
  });
}

}  // namespace split_tile
}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
