#pragma once
// Tile-level pieces of the tensor-core kernels (kernels/sm80_linear_backward.cuh,
// sm80_path_backward.cuh, sm80_linear_causal.cuh): m16n8k16 fragments read from padded
// row-major 16-bit tiles in shared memory, operands kept in two bfloat16 parts (or one), and one
// warp's product of 16 rows by up to 80 columns with a reduction depth of 64.
//
// Two parts: x = hi + lo with hi = bfloat16(x) and lo = bfloat16(x - hi), about 16 bits in all.
// A product of two split operands takes three mma (hi hi, lo hi, hi lo; lo lo is below float's
// rounding of the sum's terms). The backward sums cancel (a softmax's dP - delta, a normaliser's
// projection, a chain of Householder products), so one rounding to bfloat16 would cost its
// relative error many times over; half's range would not hold the states.

#include <cuda_bf16.h>

#include <cstdint>

#include "attnmix/cuda/arch/mma.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

using split_op = __nv_bfloat16;  // the products' operand type

// ---- fragments from shared memory (m16n8k16; layouts in arch/mma.cuh) ----------------------

// A (16 x 16) at rows r0, columns k0 of a row-major tile.
__device__ __forceinline__ void frag_a(std::uint32_t (&a)[4], const split_op* s, int ld, int r0,
                                       int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, s + (r0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}
// A (16 x 16) = X^T at m0, k0 where X is stored [k][m].
__device__ __forceinline__ void frag_a_t(std::uint32_t (&a)[4], const split_op* s, int ld, int k0,
                                         int m0) {
  const int lane = threadIdx.x % 32, i = lane >> 3, j = lane & 7;
  ldmatrix_x4_trans(a, s + (k0 + j + (i >> 1) * 8) * ld + m0 + (i & 1) * 8);
}
// B of two n-tiles n0, n0 + 8 (b[0..1], b[2..3]) at k0, stored [n][k].
__device__ __forceinline__ void frag_b2(std::uint32_t (&b)[4], const split_op* s, int ld, int n0,
                                        int k0) {
  const int lane = threadIdx.x % 32, i = lane >> 3, j = lane & 7;
  ldmatrix_x4(b, s + (n0 + j + (i >> 1) * 8) * ld + k0 + (i & 1) * 8);
}
// B of two n-tiles n0, n0 + 8 at k0, stored [k][n].
__device__ __forceinline__ void frag_b2_t(std::uint32_t (&b)[4], const split_op* s, int ld, int k0,
                                          int n0) {
  const int lane = threadIdx.x % 32, i = lane >> 3, j = lane & 7;
  ldmatrix_x4_trans(b, s + (k0 + j + (i & 1) * 8) * ld + n0 + (i >> 1) * 8);
}
// acc n-tiles 2 jp and 2 jp + 1 += a b (b from frag_b2 / frag_b2_t).
template <int NT>
__device__ __forceinline__ void mma_pairs(float (&acc)[NT][4], const std::uint32_t (&a)[4],
                                          const std::uint32_t (&b)[4], int jp) {
  const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
  mma_16816<split_op>(acc[2 * jp], a, b0);
  if (2 * jp + 1 < NT) mma_16816<split_op>(acc[2 * jp + 1], a, b1);
}

// Two floats as high and low bfloat16 pairs (x = hi + lo to about 16 bits).
__device__ __forceinline__ void split2(float x, float y, std::uint32_t& hi, std::uint32_t& lo) {
  hi = pack2<split_op>(x, y);
  const float2 r = unpack2<split_op>(hi);
  lo = pack2<split_op>(x - r.x, y - r.y);
}

// ---- A operands of a warp's 16 rows --------------------------------------------------------
// Each gives the hi and lo fragments of k-step kk (columns 16 kk .. 16 kk + 15); `has_lo` says
// whether lo exists (an input already in bfloat16 has none).

// mul * x for a float accumulator tile x (16 x 64, arch/mma.cuh's C layout), split on the fly
// (Split), or rounded to bfloat16 once.
template <bool Split = true>
struct a_from_regs {
  static constexpr bool has_lo = Split;
  const float (*x)[4];
  float mul;
  __device__ __forceinline__ void operator()(int kk, std::uint32_t (&h)[4],
                                             std::uint32_t (&l)[4]) const {
    const float* p = x[2 * kk];
    const float* q = x[2 * kk + 1];
    const float v[8] = {p[0], p[1], p[2], p[3], q[0], q[1], q[2], q[3]};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (Split)
        split2(mul * v[2 * i], mul * v[2 * i + 1], h[i], l[i]);
      else
        h[i] = pack2<split_op>(mul * v[2 * i], mul * v[2 * i + 1]);
    }
  }
};

// Rows r0 .. r0 + 15 of a row-major split tile (hi, lo with leading dimension Ld); Neg: -x.
template <int Ld, bool Lo, bool Neg = false>
struct a_from_tile {
  static constexpr bool has_lo = Lo;
  const split_op* hi;
  const split_op* lo;
  int r0;
  __device__ __forceinline__ void operator()(int kk, std::uint32_t (&h)[4],
                                             std::uint32_t (&l)[4]) const {
    frag_a(h, hi, Ld, r0, 16 * kk);
    if constexpr (Lo) frag_a(l, lo, Ld, r0, 16 * kk);
    if constexpr (Neg)
#pragma unroll
      for (int i = 0; i < 4; ++i) h[i] ^= 0x80008000u, l[i] ^= 0x80008000u;
  }
};

// Rows m0 .. m0 + 15 of X^T, X a row-major split tile [k][m]: for sums over X's rows (tokens)
// that every warp of a CTA holds a part of.
template <int Ld, bool Lo>
struct a_from_tile_t {
  static constexpr bool has_lo = Lo;
  const split_op* hi;
  const split_op* lo;
  int m0;
  __device__ __forceinline__ void operator()(int kk, std::uint32_t (&h)[4],
                                             std::uint32_t (&l)[4]) const {
    frag_a_t(h, hi, Ld, 16 * kk, m0);
    if constexpr (Lo) frag_a_t(l, lo, Ld, 16 * kk, m0);
  }
};

// acc[16 x 8 NT] += A[16 x 16 KS] B over a depth of 16 KS (64 by default), for the output
// columns n0 .. n0 + 8 NT - 1 (NT = 8: 64 of them; NT = 4: a half; NT = 10: a value row with a
// column for its sum): B stored [k][n] (KN) or [n][k] (B^T stored row-major: rows are the output
// columns), in a split tile (bh, bl; bl only when BLo). Each pass (hi hi, lo hi, hi lo) runs over
// all n-tiles before the next: the mma that add to one accumulator are NT apart, not back to back.
template <int Ld, bool KN, bool BLo, int NT = 8, int KS = 4, class AF>
__device__ __forceinline__ void warp_mma(float (&acc)[NT][4], const AF& af, const split_op* bh,
                                         const split_op* bl, int n0 = 0) {
  static_assert(NT % 2 == 0, "n-tiles come in pairs");
  constexpr int JP = NT / 2;
  const auto load_b = [n0](std::uint32_t(&b)[JP][4], const split_op* s, int kk) {
#pragma unroll
    for (int jp = 0; jp < JP; ++jp) {
      if constexpr (KN)
        frag_b2_t(b[jp], s, Ld, 16 * kk, n0 + 16 * jp);
      else
        frag_b2(b[jp], s, Ld, n0 + 16 * jp, 16 * kk);
    }
  };
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    std::uint32_t ah[4], al[4], b[JP][4];
    af(kk, ah, al);
    load_b(b, bh, kk);
#pragma unroll
    for (int jp = 0; jp < JP; ++jp) mma_pairs(acc, ah, b[jp], jp);
    if constexpr (AF::has_lo)
#pragma unroll
      for (int jp = 0; jp < JP; ++jp) mma_pairs(acc, al, b[jp], jp);
    if constexpr (BLo) {
      load_b(b, bl, kk);
#pragma unroll
      for (int jp = 0; jp < JP; ++jp) mma_pairs(acc, ah, b[jp], jp);
    }
  }
}

// f(row, col, x0, x1) for each pair of adjacent elements (col even) a lane holds of a 16 x 8 NT
// accumulator tile whose first row is r0 and first column c0.
template <int NT, class F>
__device__ __forceinline__ void for_fragment_pairs(float (&acc)[NT][4], int r0, int c0, F&& f) {
  const int lane = threadIdx.x % 32, g = lane >> 2, c = c0 + 2 * (lane & 3);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    f(r0 + g, 8 * nt + c, acc[nt][0], acc[nt][1]);
    f(r0 + g + 8, 8 * nt + c, acc[nt][2], acc[nt][3]);
  }
}

// As for_fragment_pairs over a row-major array of leading dimension ld at base: f(row, at, x0,
// x1) with at = base + the pair's element offset (base a pointer, or 0 for offsets). The thread's
// first place is formed once and the others are compile-time offsets from it (once ld is), which
// fold into the instructions' immediates; an address formed from (row, col) costs a few
// instructions a pair.
template <int NT, class B, class F>
__device__ __forceinline__ void for_fragment_at(float (&acc)[NT][4], B base, int r0, int c0, int ld,
                                                F&& f) {
  const int lane = threadIdx.x % 32, g = lane >> 2;
  const B first = base + (r0 + g) * ld + c0 + 2 * (lane & 3);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    f(r0 + g, first + 8 * nt, acc[nt][0], acc[nt][1]);
    f(r0 + g + 8, first + 8 * ld + 8 * nt, acc[nt][2], acc[nt][3]);
  }
}

// As for_fragment_pairs, with each pair's place in the fragment as well, f(row, col, x0, x1, nt,
// half) (half 1: row r0 + g + 8): arrays indexed by it stay in registers, where an index worked
// out from (row, col) puts them in local memory.
template <int NT, class F>
__device__ __forceinline__ void for_fragment_pairs_at(float (&acc)[NT][4], int r0, int c0, F&& f) {
  const int lane = threadIdx.x % 32, g = lane >> 2, c = c0 + 2 * (lane & 3);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    f(r0 + g, 8 * nt + c, acc[nt][0], acc[nt][1], nt, 0);
    f(r0 + g + 8, 8 * nt + c, acc[nt][2], acc[nt][3], nt, 1);
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
