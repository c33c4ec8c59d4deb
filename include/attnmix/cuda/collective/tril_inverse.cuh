#pragma once
// The chunk's UT transform inverse A = (I + L)^-1 of a unit lower-triangular 64 x 64 float matrix
// (spec/path_fox.md §1.5), in place in shared memory, and products with it on tensor cores (tf32
// in three passes, about 21 significant bits): the PaTH chunk preparation forms A (forward), the
// backward's chunk kernel applies A^T where it would solve with (I + L)^T. The diagonal 16 x 16
// blocks by substitution (CUDA cores, float), then merges 16 -> 32 -> 64 (tensor cores).

#include <cstdint>

#include "attnmix/cuda/arch/mma.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// acc += A B over one m16n8k8 step, tf32 in three passes (big big + big small + small big): A's
// 16 x 8 tile at a, B's 8 x 8 tile at b, both row-major float, ld elements a row.
template <int ld>
__device__ __forceinline__ void mma_tf32x3(float (&acc)[4], const float* a, const float* b,
                                           int lane) {
  const int g = lane / 4, t = lane % 4;
  std::uint32_t ab[4], as[4], bb[2], bs[2];
  split_tf32(a[g * ld + t], ab[0], as[0]);
  split_tf32(a[(g + 8) * ld + t], ab[1], as[1]);
  split_tf32(a[g * ld + t + 4], ab[2], as[2]);
  split_tf32(a[(g + 8) * ld + t + 4], ab[3], as[3]);
  split_tf32(b[t * ld + g], bb[0], bs[0]);
  split_tf32(b[(t + 4) * ld + g], bb[1], bs[1]);
  mma_1688_tf32(acc, as, bb);
  mma_1688_tf32(acc, ab, bs);
  mma_1688_tf32(acc, ab, bb);
}

// s times a 16 x 8 accumulator tile into a row-major float array.
template <int ld>
__device__ __forceinline__ void store_acc_tile(float* dst, const float (&acc)[4], float s,
                                               int lane) {
  const int g = lane / 4, c = 2 * (lane % 4);
  *reinterpret_cast<float2*>(dst + g * ld + c) = make_float2(s * acc[0], s * acc[1]);
  *reinterpret_cast<float2*>(dst + (g + 8) * ld + c) = make_float2(s * acc[2], s * acc[3]);
}

// One merge of the blocked inverse of a unit lower-triangular matrix, on the H x H blocks at
// (o, o) of a (row-major float, ld): [[A11, 0], [L21, A22]] -> A21 = -A22 (L21 A11).
// merge_left writes T = L21 A11 to t, merge_right then A21 = -A22 T in L21's place; the caller
// puts a barrier between them. A warp computes the 16 x 8 output tile (mt, nt); the k steps skip
// the blocks above the diagonals of A11 and A22, which may hold anything.
template <int H, int ld>
__device__ __forceinline__ void merge_left(float* a, float* t, int o, int mt, int nt, int lane) {
  float acc[4] = {};
#pragma unroll
  for (int kk = 0; kk < H / 8; ++kk)
    if (kk >= nt)
      mma_tf32x3<ld>(acc, a + (o + H + 16 * mt) * ld + o + 8 * kk,
                     a + (o + 8 * kk) * ld + o + 8 * nt, lane);
  store_acc_tile<ld>(t + 16 * mt * ld + 8 * nt, acc, 1.f, lane);
}
template <int H, int ld>
__device__ __forceinline__ void merge_right(float* a, const float* t, int o, int mt, int nt,
                                            int lane) {
  float acc[4] = {};
#pragma unroll
  for (int kk = 0; kk < H / 8; ++kk)
    if (8 * kk <= 16 * mt + 15)
      mma_tf32x3<ld>(acc, a + (o + H + 16 * mt) * ld + o + H + 8 * kk, t + 8 * kk * ld + 8 * nt,
                     lane);
  store_acc_tile<ld>(a + (o + H + 16 * mt) * ld + o + 8 * nt, acc, -1.f, lane);
}

// A = (I + L)^-1 in place, for a CTA of 256 threads: on entry a (row-major float, ld elements a
// row, ld >= 64) holds L below the diagonal; nothing at or above it is read (the substitution
// reads the diagonal blocks below their diagonals, the merges skip the blocks above them). On
// return, A at and below the diagonal, zeros above it inside the diagonal 16 x 16 blocks; the
// top-right 32 x 32 quarter held the merges' T. Starts and ends with the CTA in step (barriers).
template <int ld>
__device__ __forceinline__ void invert_unit_lower_64(float* a) {
  static_assert(ld >= 64, "64 columns a row");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // The diagonal 16 x 16 blocks, in float: a thread per column of a block (its 16 threads share a
  // warp), forward substitution in registers.
  if (tid < 4 * 16) {
    const int o = 16 * (tid / 16), j = tid % 16;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const float* lr = a + (o + r) * ld + o;
      float s = 0.f;
#pragma unroll
      for (int b = 0; b < r; ++b) s += lr[b] * x[b];
      x[r] = r < j ? 0.f : (r == j ? 1.f : -s);
    }
    __syncwarp();  // the block's other columns have read L
#pragma unroll
    for (int r = 0; r < 16; ++r) a[(o + r) * ld + o + j] = x[r];
  }
  __syncthreads();
  // Merges, two 16 -> 32 on warps 0..3, then 32 -> 64 on all eight. Their T goes to the top-right
  // 32 x 32 quarter, unused above the diagonal.
  if (warp < 4) {
    const int o = 32 * (warp / 2);
    merge_left<16, ld>(a, a + (o / 2) * ld + 32 + o / 2, o, 0, warp % 2, lane);
  }
  __syncthreads();
  if (warp < 4) {
    const int o = 32 * (warp / 2);
    merge_right<16, ld>(a, a + (o / 2) * ld + 32 + o / 2, o, 0, warp % 2, lane);
  }
  __syncthreads();
  merge_left<32, ld>(a, a + 32, 0, warp % 2, warp / 2, lane);
  __syncthreads();
  merge_right<32, ld>(a, a + 32, 0, warp % 2, warp / 2, lane);
  __syncthreads();
}

// acc = A^T B for rows 16 rb .. 16 rb + 15 (a warp's 16 x 64 result, eight n-tiles): A as
// invert_unit_lower_64 leaves it (row-major, lda; A^T is upper triangular, so these rows take
// k >= 16 rb, and the diagonal blocks' zeros above their diagonals stand for A^T's below), B
// [64][64] row-major float (ldb), tf32 in three passes. A's fragments are split once a k step.
template <int lda, int ldb>
__device__ __forceinline__ void mma_inverse_t(float (&acc)[8][4], const float* a, const float* b,
                                              int rb, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    if (kk < 2 * rb) continue;
    const float* at = a + 8 * kk * lda + 16 * rb;  // A^T's 16 x 8 tile: A stored [k][m]
    std::uint32_t ab[4], as[4];
    split_tf32(at[t * lda + g], ab[0], as[0]);
    split_tf32(at[t * lda + g + 8], ab[1], as[1]);
    split_tf32(at[(t + 4) * lda + g], ab[2], as[2]);
    split_tf32(at[(t + 4) * lda + g + 8], ab[3], as[3]);
    const float* bt = b + 8 * kk * ldb;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      std::uint32_t bb[2], bs[2];
      split_tf32(bt[t * ldb + 8 * nt + g], bb[0], bs[0]);
      split_tf32(bt[(t + 4) * ldb + 8 * nt + g], bb[1], bs[1]);
      mma_1688_tf32(acc[nt], as, bb);
      mma_1688_tf32(acc[nt], ab, bs);
      mma_1688_tf32(acc[nt], ab, bb);
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
