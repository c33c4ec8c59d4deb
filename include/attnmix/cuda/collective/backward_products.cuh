#pragma once
// The products of the tensor-core softmax-family backward (kernels/attention_backward_mma.cuh),
// a struct an instruction set with the same named knobs and calls, so that one kernel body serves
// both:
//   stream          rows (dk/dv kernel) or keys (dq kernel) of a streamed tile
//   align           the alignment of shared memory the tile layout needs
//   load<R, C>      cp.async copy of R rows of a row-major [R][C] tile into the layout; rows at or
//                   past `valid` zero-filled (row 0 of gmem must be readable)
//   ready()         after this thread's copies are waited for, before the barrier that publishes
//                   them: makes them readable by the products
//   scores          s = A1 B1^T and dp = A2 B2^T: A the CTA's fixed [64][K] tiles, B streamed
//                   [N][K] tiles, both K-contiguous. s is ready on return, dp after
//                   wait_scores<Later> (Later: the products issued since, which may go on)
//   grad            acc += X B with X an accumulator taken as a 16-bit operand (kept in f) and
//                   B a streamed [K][N] tile (N contiguous), issued: the threads go on while it
//                   runs, until done(acc.., f..)
// (On mma.sync every product is finished when its call returns.)
// Accumulators are float [N / 8][4] in the mma.sync m16n8 layout of the warp's 16 rows (warp w
// of the CTA's 4: rows 16 w ..), which is also what a warpgroup's m64nN wgmma accumulator holds.
//
//   sm80_backward_products: mma.sync m16n8k16, operands read with ldmatrix from row-major tiles
//                           whose 16-byte chunks are XOR-swizzled by the row; 32-row streams.
//   sm90_backward_products: wgmma (sm_90a) on the 128-byte-swizzled atoms of arch/wgmma.cuh,
//                           a product a warpgroup instruction a k-step; 64-row streams.

#include <cstdint>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/arch/wgmma.cuh"
#include "attnmix/cuda/kernels/attention_backward_shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// Copies rows [0, Rows) of a row-major tile into swizzled shared memory with cp.async (as
// tile_loader, with the offsets computed on each call: fewer live registers); rows >= valid are
// zero-filled. gmem's row 0 must be readable.
template <int Rows, int Cols, int Threads, class T>
__device__ __forceinline__ void load_tile_v2(T* smem, const T* gmem, index_t stride,
                                             index_t valid) {
  constexpr int chunks = Cols / 8, per = Rows * chunks / Threads;
  static_assert(per * Threads == Rows * chunks, "tile chunks must divide evenly among threads");
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const int idx = threadIdx.x + k * Threads, r = idx / chunks, c = idx % chunks;
    const bool ok = r < valid;
    cp_async_16(smem + swizzle<Cols>(r, c), ok ? gmem + r * stride + c * 8 : gmem, ok);
  }
}

// 4- and 8-byte global -> shared copies (cp.async.ca); zero-filled when not `valid`. The rows'
// and keys' terms travel with their tiles, so that no thread waits on a load of its own.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(valid ? 8 : 0));
}

// The A fragment of a 16 x 16 chunk kc of a product whose A operand is the 16 x 8 accumulator
// tiles x[2 kc] and x[2 kc + 1] (the C layout of two n-tiles is the A layout of one k-chunk).
template <class T>
__device__ __forceinline__ void accumulators_as_a(std::uint32_t (&a)[4], const float (&x0)[4],
                                                  const float (&x1)[4]) {
  a[0] = pack2<T>(x0[0], x0[1]);
  a[1] = pack2<T>(x0[2], x0[3]);
  a[2] = pack2<T>(x1[0], x1[1]);
  a[3] = pack2<T>(x1[2], x1[3]);
}

// acc[16 x 8 N] += A B^T, A rows [r0, r0 + 16) of a row-major swizzled K-column tile in shared
// memory read a 16-column chunk at a time, and B an N x K row-major swizzled tile (B's rows are
// the product's columns).
template <class T, int K, int N>
__device__ __forceinline__ void mma_smem_a_bt(float (&acc)[N / 8][4], const T* a_tile, int r0,
                                              const T* b) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    std::uint32_t a[4];
    ldmatrix_x4(a, a_tile + swizzle<K>(r0 + lane % 16, kk * 2 + lane / 16));
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
      std::uint32_t f[4];
      ldmatrix_x4(f, b + swizzle<K>(n * 16 + lane % 8 + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
      const std::uint32_t b0[2] = {f[0], f[1]}, b1[2] = {f[2], f[3]};
      mma_16816<T>(acc[2 * n], a, b0);
      mma_16816<T>(acc[2 * n + 1], a, b1);
    }
  }
}

// acc[16 x N] (N / 8 tiles) += X B, X the 16 x K accumulators x[K / 8] (rounded to T) and B a
// K x N row-major swizzled tile in shared memory: the forward's O += P V.
template <class T, int K, int N>
__device__ __forceinline__ void mma_acc_b(float (&acc)[N / 8][4], const float (&x)[K / 8][4],
                                          const T* b) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kc = 0; kc < K / 16; ++kc) {
    std::uint32_t a[4];
    accumulators_as_a<T>(a, x[2 * kc], x[2 * kc + 1]);
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
      std::uint32_t f[4];
      ldmatrix_x4_trans(
          f, b + swizzle<N>(kc * 16 + lane % 8 + ((lane / 8) % 2) * 8, n * 2 + lane / 16));
      const std::uint32_t b0[2] = {f[0], f[1]}, b1[2] = {f[2], f[3]};
      mma_16816<T>(acc[2 * n], a, b0);
      mma_16816<T>(acc[2 * n + 1], a, b1);
    }
  }
}

// Stores a warp's 16 x D accumulators (times `factor`) as rows r0 + g, r0 + g + 8 of `out`
// (rows >= `rows` are not stored), a 4-byte pair a thread.
template <class T, int D>
__device__ __forceinline__ void store_rows_v2(T* out, index_t stride, int r0, int rows,
                                              const float (&acc)[D / 8][4], float factor) {
  const int lane = threadIdx.x % 32, g = lane / 4, c2 = 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + g + 8 * h;
    if (r >= rows) continue;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<std::uint32_t*>(out + r * stride + 8 * n + c2) =
          pack2<T>(acc[n][2 * h] * factor, acc[n][2 * h + 1] * factor);
  }
}

template <int N>
__device__ __forceinline__ void zero_fragments(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
}

struct sm80_backward_products {
  static constexpr int stream = attention_backward_v2_stream(false);
  static constexpr int align = 128;
  static constexpr int threads = attention_backward_v2_threads;
  __host__ __device__ static constexpr bool overlap(int) { return false; }

  template <int Rows, int Cols, class T>
  __device__ __forceinline__ static void load(T* smem, const T* gmem, index_t stride,
                                              index_t valid) {
    load_tile_v2<Rows, Cols, threads>(smem, gmem, stride, valid);
  }
  __device__ __forceinline__ static void ready() {}

  template <class T, int K, int N>
  __device__ __forceinline__ static void scores(float (&s)[N / 8][4], float (&dp)[N / 8][4],
                                                const T* a1, const T* b1, const T* a2,
                                                const T* b2) {
    const int r0 = 16 * (int(threadIdx.x) / 32);
    zero_fragments(s), zero_fragments(dp);
    mma_smem_a_bt<T, K, N>(s, a1, r0, b1);
    mma_smem_a_bt<T, K, N>(dp, a2, r0, b2);
  }
  template <int Later, int N>
  __device__ __forceinline__ static void wait_scores(float (&)[N][4]) {}
  template <class T, int K, int N>
  __device__ __forceinline__ static void grad(float (&acc)[N / 8][4], const float (&x)[K / 8][4],
                                              const T* b, std::uint32_t (&)[K / 16][4]) {
    mma_acc_b<T, K, N>(acc, x, b);
  }
  template <class T, int K, int N>
  __device__ __forceinline__ static void grads(float (&acc1)[N / 8][4], const float (&x1)[K / 8][4],
                                               const T* b1, float (&acc2)[N / 8][4],
                                               const float (&x2)[K / 8][4], const T* b2) {
    mma_acc_b<T, K, N>(acc1, x1, b1);
    mma_acc_b<T, K, N>(acc2, x2, b2);
  }
  template <int N, int F>
  __device__ __forceinline__ static void done(float (&)[N][4], std::uint32_t (&)[F][4]) {}
  template <int N, int F>
  __device__ __forceinline__ static void done(float (&)[N][4], float (&)[N][4],
                                              std::uint32_t (&)[F][4], std::uint32_t (&)[F][4]) {}
};

// The CTA is one warpgroup. Descriptors: a K-contiguous [R][K] tile's k-step kk is 16 columns,
// in atom kk / 4 (R rows of 128 bytes further) at byte 32 (kk % 4) of its rows, 8-row groups 1024
// bytes apart; an N-contiguous [K][N] tile's k-step kc is 16 rows (2048 bytes) further, its
// 64-column atoms K rows apart. Offsets are added in the descriptors' 16-byte units.
struct sm90_backward_products {
  static constexpr int stream = attention_backward_v2_stream(true);
  static constexpr int align = 1024;  // the 128-byte swizzle is a function of the address
  static constexpr int threads = attention_backward_v2_threads;
  // At D = 128 the dk/dv kernel overlaps products and threads (S's exponentials under dP^T, dS
  // under dV); at D = 64 it waits for both scores and issues both gradients together, within
  // the 168 registers of 3 CTAs a multiprocessor (the overlap needs 212: 2 CTAs, 4 % slower on
  // an H200; at D = 128, 6 % faster).
  __host__ __device__ static constexpr bool overlap(int D) { return D > 64; }
  static_assert(threads == 128, "a warpgroup");

  template <int Rows, int Cols, class T>
  __device__ __forceinline__ static void load(T* smem, const T* gmem, index_t stride,
                                              index_t valid) {
    load_tile<Rows, Cols>(smem, gmem, stride, valid, gmem, int(threadIdx.x));
  }
  // An accumulator [N][4] as the flat array of wgmma's operands (the same registers).
  template <int N>
  using flat_t = float[4 * N];
  template <int N>
  __device__ __forceinline__ static flat_t<N>& flat(float (&x)[N][4]) {
    return reinterpret_cast<flat_t<N>&>(x);
  }

  // The copies came through the generic proxy; wgmma reads through the async one.
  __device__ __forceinline__ static void ready() { fence_proxy_async(); }

  // d = A B^T over K, A [64][K] and B [N][K] K-contiguous (not yet waited for).
  template <class T, int K, int N>
  __device__ __forceinline__ static void issue_a_bt(float (&d)[N / 2], const T* a, const T* b) {
    const std::uint64_t da = wgmma_desc(a, 16, 1024), db = wgmma_desc(b, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
      wgmma_ss<T, 0>(d, wgmma_desc_add(da, (kk / 4) * 64 * 8 + (kk % 4) * 2),
                     wgmma_desc_add(db, (kk / 4) * N * 8 + (kk % 4) * 2), kk > 0);
  }
  // d += X B over K, X as register fragments, B [K][N] N-contiguous (not yet waited for).
  template <class T, int K, int N>
  __device__ __forceinline__ static void issue_x_b(float (&d)[N / 2],
                                                   const std::uint32_t (&x)[K / 16][4],
                                                   const T* b) {
    const std::uint64_t db = wgmma_desc(b, K * 128, 1024);
#pragma unroll
    for (int kc = 0; kc < K / 16; ++kc) wgmma_rs<T, 1>(d, x[kc], wgmma_desc_add(db, kc * 128));
  }

  template <class T, int K, int N>
  __device__ __forceinline__ static void scores(float (&s)[N / 8][4], float (&dp)[N / 8][4],
                                                const T* a1, const T* b1, const T* a2,
                                                const T* b2) {
    auto& S = flat(s);
    auto& DP = flat(dp);
    wgmma_fence();
    issue_a_bt<T, K, N>(S, a1, b1);
    wgmma_commit();
    issue_a_bt<T, K, N>(DP, a2, b2);
    wgmma_commit();
    if constexpr (overlap(K)) {
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
      wgmma_fence_operand(DP);
    }
    wgmma_fence_operand(S);
  }
  template <int Later, int N>
  __device__ __forceinline__ static void wait_scores(float (&dp)[N][4]) {
    wgmma_wait<Later>();
    wgmma_fence_operand(flat(dp));
  }
  template <class T, int K, int N>
  __device__ __forceinline__ static void grad(float (&acc)[N / 8][4], float (&x)[K / 8][4],
                                              const T* b, std::uint32_t (&f)[K / 16][4]) {
    to_fragments<T, K / 2>(f, flat(x));
    wgmma_fence();
    issue_x_b<T, K, N>(flat(acc), f, b);
    wgmma_commit();
  }
  template <class T, int K, int N>
  __device__ __forceinline__ static void grads(float (&acc1)[N / 8][4], float (&x1)[K / 8][4],
                                               const T* b1, float (&acc2)[N / 8][4],
                                               float (&x2)[K / 8][4], const T* b2) {
    std::uint32_t f1[K / 16][4], f2[K / 16][4];
    to_fragments<T, K / 2>(f1, flat(x1));
    to_fragments<T, K / 2>(f2, flat(x2));
    wgmma_fence();
    issue_x_b<T, K, N>(flat(acc1), f1, b1);
    wgmma_commit();
    issue_x_b<T, K, N>(flat(acc2), f2, b2);
    wgmma_commit();
    done(acc1, acc2, f1, f2);
  }
  // A [64][N] accumulator (the warpgroup's 64 rows) as 16-bit into a tile of 128-byte atoms, for
  // use as a product's operand (N = 64: one atom).
  template <class T, int N>
  __device__ __forceinline__ static void store_tile(T* tile, const float (&x)[N / 8][4]) {
    static_assert(N == 64, "one atom wide");
    const int lane = threadIdx.x % 32, r0 = 16 * (int(threadIdx.x) / 32) + lane / 4;
    const int c2 = 2 * (lane % 4);
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<std::uint32_t*>(tile + sw128_layout<64>::offset(r0 + 8 * h, n) + c2) =
            pack2<T>(x[n][2 * h], x[n][2 * h + 1]);
  }
  // d = X B over K (waited for): X [64][K] read from xt, its transpose [K][64] as store_tile
  // wrote it (M contiguous), and B [K][N] N-contiguous.
  template <class T, int K, int N>
  __device__ __forceinline__ static void xt_b(float (&d)[N / 8][4], const T* xt, const T* b) {
    const std::uint64_t da = wgmma_desc(xt, K * 128, 1024), db = wgmma_desc(b, K * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < K / 16; ++kc)
      wgmma_ss<T, 1, 1>(flat(d), wgmma_desc_add(da, kc * 128), wgmma_desc_add(db, kc * 128),
                        kc > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(flat(d));
  }
  template <int N, int F>
  __device__ __forceinline__ static void done(float (&acc)[N][4], std::uint32_t (&f)[F][4]) {
    wgmma_wait<0>();
    wgmma_fence_operand(flat(acc));
    wgmma_fence_operand(f);
  }
  template <int N, int F>
  __device__ __forceinline__ static void done(float (&acc1)[N][4], float (&acc2)[N][4],
                                              std::uint32_t (&f1)[F][4],
                                              std::uint32_t (&f2)[F][4]) {
    wgmma_wait<0>();
    wgmma_fence_operand(flat(acc1));
    wgmma_fence_operand(flat(acc2));
    wgmma_fence_operand(f1);
    wgmma_fence_operand(f2);
  }
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
