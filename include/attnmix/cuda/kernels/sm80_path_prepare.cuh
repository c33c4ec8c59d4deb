#pragma once
// The PaTH chunk preparation on tensor cores (spec/path_fox.md §1.5): half / bfloat16 keys (rows
// 16-byte aligned unless p.k_scalar), D in {64, 128}. For the tensor-core forward it writes what
// path_prepare_kernel<T, T, __half> would (U and M in half, K~ in T, same layout), and -W in half
// for the forward's transition; with Float, for the tensor-core backward, what
// path_prepare_kernel<T, float, float> would (U, M and K~ in float; no -W, no E). Computed per
// (chunk, KV head, sequence) as
//   G = W W^T, S = stril(W K^T)                        tensor cores
//   A = (I + stril(diag(beta) G))^-1                   the 16 x 16 diagonal blocks by substitution
//                                                      (CUDA cores, float), then merges (tensor
//                                                      cores, tf32 in three passes)
//   [U | M] = A diag(beta) [W | S], K~ = K - M^T W     tensor cores
//   E = -W^T U (D = 64, when asked)                     tensor cores, half operands
// A tensor-core operand that is not exact in T (W, S, A diag(beta), M) is split into two T
// numbers, x = hi + lo, and its products take three passes (hi hi + hi lo + lo hi): about 16
// significant bits in bfloat16 and more in half, far below the half rounding of the outputs even
// where the inverse amplifies errors (beta near 2). K is exact in T: two passes. The float results
// carry that accuracy, which the backward's two-part products round to anyway.

#include <cstdint>
#include <type_traits>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/tril_inverse.cuh"
#include "attnmix/cuda/kernels/path_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// x = hi + lo, each rounded to nearest in T.
template <class T>
__device__ __forceinline__ void split_hi_lo(float x, T& hi, T& lo) {
  hi = from_float<T>(x);
  lo = from_float<T>(x - to_float(hi));
}

// Two consecutive elements split into a pair of his and a pair of los (low element first), with
// packed conversions.
template <class T>
__device__ __forceinline__ void split_pair(float x0, float x1, std::uint32_t& hi,
                                           std::uint32_t& lo) {
  hi = pack2<T>(x0, x1);
  const float2 h = unpack2<T>(hi);
  lo = pack2<T>(x0 - h.x, x1 - h.y);
}

// ldmatrix.x4 of the 16 x 16 tile at (r0, c0) of a row-major T array, ld elements a row:
//   load_a:   the tile as an A operand (rows m, columns k);
//   load_a_t: an A operand stored transposed (rows k, columns m);
//   load_b:   B operands stored [n][k] (rows n), n-tiles {0, 1} in registers {0, 1} and {2, 3};
//   load_b_t: B operands stored [k][n] (rows k), same registers.
template <class T>
__device__ __forceinline__ const T* tile_rows_then_cols(const T* s, int ld, int r0, int c0,
                                                        int lane) {
  return s + (r0 + lane % 8 + (lane / 8) % 2 * 8) * ld + c0 + lane / 16 * 8;
}
template <class T>
__device__ __forceinline__ const T* tile_cols_then_rows(const T* s, int ld, int r0, int c0,
                                                        int lane) {
  return s + (r0 + lane % 8 + lane / 16 * 8) * ld + c0 + (lane / 8) % 2 * 8;
}
template <class T>
__device__ __forceinline__ void load_a(std::uint32_t (&f)[4], const T* s, int ld, int m0, int k0,
                                       int lane) {
  ldmatrix_x4(f, tile_rows_then_cols(s, ld, m0, k0, lane));
}
template <class T>
__device__ __forceinline__ void load_a_t(std::uint32_t (&f)[4], const T* s, int ld, int k0, int m0,
                                         int lane) {
  ldmatrix_x4_trans(f, tile_cols_then_rows(s, ld, k0, m0, lane));
}
template <class T>
__device__ __forceinline__ void load_b(std::uint32_t (&f)[4], const T* s, int ld, int n0, int k0,
                                       int lane) {
  ldmatrix_x4(f, tile_cols_then_rows(s, ld, n0, k0, lane));
}
template <class T>
__device__ __forceinline__ void load_b_t(std::uint32_t (&f)[4], const T* s, int ld, int k0, int n0,
                                         int lane) {
  ldmatrix_x4_trans(f, tile_rows_then_cols(s, ld, k0, n0, lane));
}

// acc[nt] += (ah + al) (bh + bl) over a 16 x 16 x 16 step, two n-tiles, without the lo lo term.
template <class T>
__device__ __forceinline__ void mma_split(float (&acc)[2][4], const std::uint32_t (&ah)[4],
                                          const std::uint32_t (&al)[4],
                                          const std::uint32_t (&bh)[4],
                                          const std::uint32_t (&bl)[4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const std::uint32_t h[2] = {bh[2 * nt], bh[2 * nt + 1]}, l[2] = {bl[2 * nt], bl[2 * nt + 1]};
    mma_16816<T>(acc[nt], al, h);
    mma_16816<T>(acc[nt], ah, l);
    mma_16816<T>(acc[nt], ah, h);
  }
}

// Shared memory of one CTA (bytes): W hi, lo [C][D+8]; S hi, lo [C][C+8], later M; and one
// region that holds K [C][D+8], then L and A in float [C][C+8], then A diag(beta) hi, lo
// [C][C+8], then U and M in half (D = 64) on their way out, then K again, rewritten as K~ and
// written out. Global results leave as 16-byte rows, never as 4-byte fragments. Rows padded by 8
// elements keep ldmatrix (16-byte rows at a 16-byte offset mod 128) and the float accesses free of
// bank conflicts. 54 KiB at D = 64: four CTAs per SM.
template <int D>
struct path_prepare_mma_layout {
  static constexpr int C = path_chunk, ldw = D + 8, ldc = C + 8, ldf = C + 8;
  static constexpr int w_bytes = 2 * C * ldw * 2, s_bytes = 2 * C * ldc * 2;
  static constexpr int q_bytes = C * ldf * 4;
  static_assert(q_bytes >= C * ldw * 2 && q_bytes >= 2 * C * ldc * 2, "region too small");
  static constexpr int smem_bytes = w_bytes + s_bytes + q_bytes;
  // U and M fit the region side by side after the products (D = 64): written out as rows.
  static constexpr bool staged = q_bytes >= C * (ldw + ldc) * 2;
};

// One (chunk, KV head, sequence) = (blockIdx.x, .y, .z) per 256-thread CTA.
template <class T, int D, bool Float = false>
__global__ void __launch_bounds__(256, D == 64 ? 4 : 3)
    path_prepare_mma_kernel(const path_kernel_params p) {
  using layout = path_prepare_mma_layout<D>;
  using Out = std::conditional_t<Float, float, __half>;  // U and M
  constexpr bool staged = layout::staged && !Float;      // U and M leave through shared memory
  constexpr int C = path_chunk, threads = 256, ldw = layout::ldw, ldc = layout::ldc,
                ldf = layout::ldf;
  static_assert(D % 16 == 0 && D <= 128, "head dim");
  extern __shared__ __align__(16) unsigned char prepare_smem[];
  T* swh = reinterpret_cast<T*>(prepare_smem);
  T* swl = swh + C * ldw;
  T* ssh = swl + C * ldw;  // S, then M
  T* ssl = ssh + C * ldc;
  unsigned char* region = prepare_smem + layout::w_bytes + layout::s_bytes;
  T* sk = reinterpret_cast<T*>(region);
  float* sf = reinterpret_cast<float*>(region);  // L, then A
  T* sth = reinterpret_cast<T*>(region);         // A diag(beta)
  T* stl = sth + C * ldc;
  __shared__ __align__(16) float sbeta[C];

  const int tid = threadIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4,
            c2 = 2 * (lane % 4);
  const int h = blockIdx.y;
  index_t batch, start, length, c0;
  int n;
  if (!p.prepare_chunk(batch, start, length, c0, n)) return;
  const index_t t0 = start + c0;
  const index_t ks1 = p.a.k_stride[1];
  const T* k =
      static_cast<const T*>(p.a.k) + batch * p.a.k_stride[0] + t0 * ks1 + h * p.a.k_stride[2];
  const float* w = p.w + batch * p.w_stride[0] + t0 * p.w_stride[1] + h * p.w_stride[2];
  const index_t row0 = p.row(batch, h, t0);
  // Eight elements of K into shared memory (zeros unless ok): one 16-byte copy, or (p.k_scalar)
  // eight loads.
  const auto copy_k8 = [&](T* dst, const T* src, bool ok) {
    if (!p.k_scalar) {
      cp_async_16(dst, ok ? src : k, ok);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = ok ? src[e] : from_float<T>(0.f);
    }
  };

  // K (rows past n zero-filled), W split into hi + lo (and written out in half), beta. Each
  // thread keeps one 16-byte column and steps down the rows: one pointer each, constant offsets.
  {
    constexpr int chunks = D / 8, k_rows = threads / chunks;
    const int ka = threadIdx.x / chunks, kd = 8 * (threadIdx.x % chunks);
    const T* kp = k + ka * ks1 + kd;
#pragma unroll
    for (int i = 0; i < C / k_rows; ++i) {
      const bool in = ka + i * k_rows < n;
      copy_k8(sk + (ka + i * k_rows) * ldw + kd, kp + i * k_rows * ks1, in);
    }
    cp_async_commit();
    // beta and W are read before anything is stored (see below).
    const float beta = tid < n ? p.beta[batch * p.beta_stride[0] + (t0 + tid) * p.beta_stride[1] +
                                        h * p.beta_stride[2]]
                               : 0.f;
    __half* wh = static_cast<__half*>(p.wh) + row0 * D;
    const index_t ws1 = p.w_stride[1];
    if (reinterpret_cast<std::uintptr_t>(w) % 16 == 0 && ws1 % 4 == 0) {
      constexpr int quads = D / 4, w_rows = threads / quads, steps = C / w_rows;  // 16-byte reads
      const int wa = threadIdx.x / quads, wd = 4 * (threadIdx.x % quads);
      const float* wp = w + wa * ws1 + wd;
      // Every read is issued before the first store: the compiler may not move a read of w past
      // a store to wh (both global), and one round trip a step would serialise them.
      float4 xs[steps];
#pragma unroll
      for (int i = 0; i < steps; ++i)
        xs[i] = wa + i * w_rows < n ? *reinterpret_cast<const float4*>(wp + i * w_rows * ws1)
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
      T* const sh = swh + wa * ldw + wd;
      __half* const whp = wh + wa * D + wd;
#pragma unroll
      for (int i = 0; i < steps; ++i) {
        const float4 x = xs[i];
        std::uint32_t hi[2], lo[2];
        split_pair<T>(x.x, x.y, hi[0], lo[0]);
        split_pair<T>(x.z, x.w, hi[1], lo[1]);
        *reinterpret_cast<uint2*>(sh + i * w_rows * ldw) = make_uint2(hi[0], hi[1]);
        *reinterpret_cast<uint2*>(sh + (C + i * w_rows) * ldw) = make_uint2(lo[0], lo[1]);
        if (!Float && wa + i * w_rows < n)
          *reinterpret_cast<uint2*>(whp + i * w_rows * D) =
              make_uint2(pack2<__half>(-x.x, -x.y), pack2<__half>(-x.z, -x.w));
      }
    } else {
#pragma unroll
      for (int i = 0; i < C * D / threads; ++i) {
        const int idx = tid + i * threads, a = idx / D, d = idx % D;
        const float x = a < n ? w[a * ws1 + d] : 0.f;
        split_hi_lo(x, swh[a * ldw + d], swl[a * ldw + d]);
        if (!Float && a < n) wh[a * D + d] = __float2half_rn(-x);
      }
    }
    if (tid < C) sbeta[tid] = beta;
    cp_async_wait<0>();
  }
  __syncthreads();

  // G = W W^T and S = stril(W K^T) on the ten 16 x 16 blocks at or below the diagonal (block
  // row rb, column jb <= rb). Warps 0..5 take a block column jb and one or two block rows from
  // rb0: (jb, rb0) = (0, 0..1), (0, 2..3), (1, 1..2), (2, 2..3), (1, 3), (3, 3); the B fragments
  // (W and K of column jb) serve both rows, and a diagonal block takes W's B fragments from A's
  // registers. S goes straight to its place; G waits in registers until K, which shares L's
  // region, is no longer read.
  const int gjb = 0x312100 >> (4 * warp) & 15, grb0 = 0x332120 >> (4 * warp) & 15;
  const int gnb = warp < 4 ? 2 : warp < 6 ? 1 : 0;
  float gram[2][2][4] = {};
  if (gnb > 0) {
    float acc[2][2][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t ah[4], al[4], bh[4], bl[4], bk[4];
      load_a(ah, swh, ldw, 16 * grb0, 16 * kk, lane);
      load_a(al, swl, ldw, 16 * grb0, 16 * kk, lane);
      if (gjb == grb0) {  // the same tile: B's four 8 x 8 matrices are A's, two swapped
        bh[0] = ah[0], bh[1] = ah[2], bh[2] = ah[1], bh[3] = ah[3];
        bl[0] = al[0], bl[1] = al[2], bl[2] = al[1], bl[3] = al[3];
      } else {
        load_b(bh, swh, ldw, 16 * gjb, 16 * kk, lane);
        load_b(bl, swl, ldw, 16 * gjb, 16 * kk, lane);
      }
      load_b(bk, sk, ldw, 16 * gjb, 16 * kk, lane);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        if (s == 1) {
          if (gnb < 2) break;
          load_a(ah, swh, ldw, 16 * (grb0 + 1), 16 * kk, lane);
          load_a(al, swl, ldw, 16 * (grb0 + 1), 16 * kk, lane);
        }
        mma_split<T>(gram[s], ah, al, bh, bl);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const std::uint32_t kb[2] = {bk[2 * nt], bk[2 * nt + 1]};
          mma_16816<T>(acc[s][nt], al, kb);
          mma_16816<T>(acc[s][nt], ah, kb);
        }
      }
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if (s >= gnb) break;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int a = 16 * (grb0 + s) + g + 8 * hh, b = 16 * gjb + 8 * nt + c2;
          std::uint32_t hi, lo;
          split_pair<T>(a > b ? acc[s][nt][2 * hh] : 0.f, a > b + 1 ? acc[s][nt][2 * hh + 1] : 0.f,
                        hi, lo);
          *reinterpret_cast<std::uint32_t*>(ssh + a * ldc + b) = hi;
          *reinterpret_cast<std::uint32_t*>(ssl + a * ldc + b) = lo;
        }
    }
  }
  __syncthreads();  // K is no longer read
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    if (s >= gnb) break;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int a = 16 * (grb0 + s) + g + 8 * hh, b = 16 * gjb + 8 * nt + c2;
        const float beta = sbeta[a];
        *reinterpret_cast<float2*>(sf + a * ldf + b) =
            make_float2(beta * gram[s][nt][2 * hh], beta * gram[s][nt][2 * hh + 1]);
      }
  }
  // Nothing at or above the diagonal is cleared: the substitution reads the diagonal blocks below
  // their diagonals only, the merges skip the blocks above, whose top-right quarter is their
  // scratch, and the products read A diag(beta) and S only at or below the diagonal.
  __syncthreads();

  invert_unit_lower_64<ldf>(sf);  // A = (I + L)^-1 in place
  {  // A diag(beta) split into hi + lo, at or below the diagonal blocks (the substitution left
     // zeros above the diagonal inside them): a thread per 16-byte column, down the rows, reading
     // all it needs of the float A before anyone writes over it.
    constexpr int quads = C / 4, q_rows = threads / quads, steps = C / q_rows;
    static_assert(q_rows == 16, "step i is block row i");
    const int qa = threadIdx.x / quads, qc = 4 * (threadIdx.x % quads), qb = qc / 16;
    float4 quad[steps];
#pragma unroll
    for (int i = 0; i < steps; ++i)
      if (i >= qb) quad[i] = *reinterpret_cast<const float4*>(sf + (qa + i * q_rows) * ldf + qc);
    __syncthreads();
    const float4 b4 = *reinterpret_cast<const float4*>(sbeta + qc);
#pragma unroll
    for (int i = 0; i < steps; ++i) {
      if (i < qb) continue;
      const int row = qa + i * q_rows;
      std::uint32_t hi[2], lo[2];
      split_pair<T>(quad[i].x * b4.x, quad[i].y * b4.y, hi[0], lo[0]);
      split_pair<T>(quad[i].z * b4.z, quad[i].w * b4.w, hi[1], lo[1]);
      *reinterpret_cast<uint2*>(sth + row * ldc + qc) = make_uint2(hi[0], hi[1]);
      *reinterpret_cast<uint2*>(stl + row * ldc + qc) = make_uint2(lo[0], lo[1]);
    }
  }
  __syncthreads();

  // [U | M] = A diag(beta) [W | S]: a warp per 16 output columns, all 64 rows (the lower
  // triangle of A diag(beta): row block rb reads k blocks <= rb; S's column block j has zeros
  // in k blocks < j).
  auto tc_product = [&](float(&acc)[4][2][4], const T* bh_s, const T* bl_s, int ldb, int col,
                        int k_first) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (kk < k_first) continue;
      std::uint32_t bh[4], bl[4];
      load_b_t(bh, bh_s, ldb, 16 * kk, col, lane);
      load_b_t(bl, bl_s, ldb, 16 * kk, col, lane);
#pragma unroll
      for (int rb = kk; rb < 4; ++rb) {
        std::uint32_t ah[4], al[4];
        load_a(ah, sth, ldc, 16 * rb, 16 * kk, lane);
        load_a(al, stl, ldc, 16 * rb, 16 * kk, lane);
        mma_split<T>(acc[rb], ah, al, bh, bl);
      }
    }
  };
  // Rows < n of a 64 x 16 accumulator as Out pairs (straight to global memory).
  auto store_rows = [&](Out* dst, int ld, const float(&acc)[4][2][4]) {
#pragma unroll
    for (int rb = 0; rb < 4; ++rb)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int a = 16 * rb + g + 8 * hh;
        if (a >= n) continue;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float x0 = acc[rb][nt][2 * hh], x1 = acc[rb][nt][2 * hh + 1];
          if constexpr (Float)
            *reinterpret_cast<float2*>(dst + a * ld + 8 * nt + c2) = make_float2(x0, x1);
          else
            *reinterpret_cast<__half2*>(dst + a * ld + 8 * nt + c2) = __floats2half2_rn(x0, x1);
        }
      }
  };
  // A 64 x 16 accumulator as half pairs into a shared tile, all 64 rows.
  auto stage_rows = [&](__half* dst, int ld, const float(&acc)[4][2][4]) {
#pragma unroll
    for (int rb = 0; rb < 4; ++rb)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          *reinterpret_cast<__half2*>(dst + (16 * rb + g + 8 * hh) * ld + 8 * nt + c2) =
              __floats2half2_rn(acc[rb][nt][2 * hh], acc[rb][nt][2 * hh + 1]);
  };
  // Rows < n of a shared [C][cols] tile (ld elements a row) to global memory (cols a row) as
  // 16-byte rows: a thread keeps one 16-byte column and steps down the rows.
  auto copy_rows = [&](auto* dst, const auto* src, int ld, auto cols_tag) {
    constexpr int cols = decltype(cols_tag)::value, chunks = cols / 8, step = threads / chunks;
    static_assert(sizeof(*src) == 2 && C % step == 0, "copy shape");
    const int r0 = threadIdx.x / chunks, cc = 8 * (threadIdx.x % chunks);
    auto* const d0 = dst + r0 * cols + cc;
    const auto* const s0 = src + r0 * ld + cc;
#pragma unroll
    for (int i = 0; i < C / step; ++i)
      if (r0 + i * step < n)
        *reinterpret_cast<uint4*>(d0 + i * step * cols) =
            *reinterpret_cast<const uint4*>(s0 + i * step * ld);
  };
  // M, split, in S's place (after S's last read).
  auto split_m = [&](const float(&acc)[4][2][4], int mb) {
#pragma unroll
    for (int rb = 0; rb < 4; ++rb)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int a = 16 * rb + g + 8 * hh, b = 16 * mb + 8 * nt + c2;
          std::uint32_t hi, lo;
          split_pair<T>(acc[rb][nt][2 * hh], acc[rb][nt][2 * hh + 1], hi, lo);
          *reinterpret_cast<std::uint32_t*>(ssh + a * ldc + b) = hi;
          *reinterpret_cast<std::uint32_t*>(ssl + a * ldc + b) = lo;
        }
  };
  Out* const u_out = static_cast<Out*>(p.u) + row0 * D;
  Out* const m_out = static_cast<Out*>(p.m) + row0 * C;
  // E = -W^T U (D = C = 64, when asked) of the chunks a later chunk's queries pass: full ones,
  // not the last (computed with K~ below).
  const bool dense = staged && p.e != nullptr && c0 + C < length;

  __half* const su = reinterpret_cast<__half*>(region);  // U in half (D = 64), later E
  if constexpr (staged) {
    // D = 64: one 16-column block a warp, U (warps 0..3) or M (warps 4..7). After the products
    // A diag(beta)'s region holds U and M in half, and the CTA writes them out as 16-byte rows.
    static_assert(ldw == ldc, "U's and M's operands share a row length");
    const bool is_u = warp < D / 16;
    const int cb = is_u ? warp : warp - D / 16;
    float acc[4][2][4] = {};
    tc_product(acc, is_u ? swh : ssh, is_u ? swl : ssl, ldw, 16 * cb, is_u ? 0 : cb);
    __syncthreads();  // A diag(beta) and S are no longer read
    __half* sm = su + C * ldw;
    stage_rows((is_u ? su : sm) + 16 * cb, ldw, acc);
    if (!is_u) split_m(acc, cb);
    __syncthreads();
    copy_rows(u_out, su, ldw, std::integral_constant<int, D>{});
    copy_rows(m_out, sm, ldw, std::integral_constant<int, C>{});
  } else {
    for (int ub = warp; ub < D / 16; ub += 8) {
      float acc[4][2][4] = {};
      tc_product(acc, swh, swl, ldw, 16 * ub, 0);
      store_rows(u_out + 16 * ub, D, acc);
    }
    const int mb = (warp + 8 - D / 16) % 8;  // this warp's column block of M, if < 4
    float macc[4][2][4] = {};
    if (mb < 4) {
      tc_product(macc, ssh, ssl, ldc, 16 * mb, mb);
      store_rows(m_out + 16 * mb, C, macc);
    }
    __syncthreads();  // S is no longer read: M, split, takes its place
    if (mb < 4) split_m(macc, mb);
  }
  __syncthreads();  // M is split; the region is free once U and M have left it

  // K back into the region (rows past n are not written out), while the tensor cores work; at
  // D = 64 into its second half, the first takes E on its way out.
  T* skt = reinterpret_cast<T*>(region) + (staged ? C * ldw : 0);
  {
    constexpr int chunks = D / 8, step = threads / chunks;
    const int cc = tid % chunks, r0 = tid / chunks;
#pragma unroll
    for (int i = 0; i < C / step; ++i) {
      const int a = r0 + i * step;
      if (a < n) copy_k8(skt + a * ldw + 8 * cc, k + a * ks1 + 8 * cc, true);
    }
    cp_async_commit();
  }

  // K~ = K - M^T W: a warp per 16 columns of D and (at D = 64) two of the row blocks, paired so
  // the work evens out (row block rb of M^T reads k blocks >= rb: M is strictly lower), in its
  // slots 0 and 1. With E, warp w also takes E's 16 x 32 block at rows 16 (w % 4), columns
  // 32 (w / 4): its A operand, -W^T in half (T hi + lo, rounded), is this warp's W tile of each
  // k step with two registers swapped; its B operand is U in half (su). These are the operands
  // the forward's X = -r W^T and r + X U would take.
  {
    constexpr int units = D / 16, groups = 8 / units, slots = 4 / groups;
    const int du = warp % units, grp = warp / units;
    auto block_of = [&](int slot) {
      return groups == 1 ? slot : grp == 0 ? (slot == 0 ? 0 : 3) : (slot == 0 ? 1 : 2);
    };
    float acc[slots][2][4] = {};
    float eacc[4][4] = {};
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      std::uint32_t bh[4], bl[4];
      load_b_t(bh, swh, ldw, 16 * kk, 16 * du, lane);
      load_b_t(bl, swl, ldw, 16 * kk, 16 * du, lane);
      if (dense) {
        std::uint32_t a[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int j = i == 1 ? 2 : i == 2 ? 1 : i;  // the A layout of the same tile
          const float2 h = unpack2<T>(bh[j]), l = unpack2<T>(bl[j]);
          a[i] = pack2<__half>(-(h.x + l.x), -(h.y + l.y));
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          std::uint32_t b[4];
          load_b_t(b, su, ldw, 16 * kk, 32 * grp + 16 * j, lane);
          const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_16816<__half>(eacc[2 * j], a, b0);
          mma_16816<__half>(eacc[2 * j + 1], a, b1);
        }
      }
#pragma unroll
      for (int sl = 0; sl < slots; ++sl) {
        const int rb = block_of(sl);
        if (rb > kk) continue;
        std::uint32_t ah[4], al[4];
        load_a_t(ah, ssh, ldc, 16 * kk, 16 * rb, lane);
        load_a_t(al, ssl, ldc, 16 * kk, 16 * rb, lane);
        mma_split<T>(acc[sl], ah, al, bh, bl);
      }
    }
    cp_async_wait<0>();
    __syncthreads();        // K is in; U is no longer read
    if constexpr (Float) {  // K~ straight out, rows < n
      float* const kt_out = static_cast<float*>(p.kt) + row0 * D;
#pragma unroll
      for (int sl = 0; sl < slots; ++sl) {
        const int rb = block_of(sl);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int a = 16 * rb + g + 8 * hh;
          if (a >= n) continue;
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const int d = 16 * du + 8 * nt + c2;
            const float2 kb =
                unpack2<T>(*reinterpret_cast<const std::uint32_t*>(skt + a * ldw + d));
            *reinterpret_cast<float2*>(kt_out + a * D + d) =
                make_float2(kb.x - acc[sl][nt][2 * hh], kb.y - acc[sl][nt][2 * hh + 1]);
          }
        }
      }
    } else {
      // K~ in place of K (each thread rewrites the elements it read), E in place of U, then both
      // out as 16-byte rows.
#pragma unroll
      for (int sl = 0; sl < slots; ++sl) {
        const int rb = block_of(sl);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            T* at = skt + (16 * rb + g + 8 * hh) * ldw + 16 * du + 8 * nt + c2;
            const float2 kb = unpack2<T>(*reinterpret_cast<const std::uint32_t*>(at));
            *reinterpret_cast<std::uint32_t*>(at) =
                pack2<T>(kb.x - acc[sl][nt][2 * hh], kb.y - acc[sl][nt][2 * hh + 1]);
          }
      }
      if (dense) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            *reinterpret_cast<__half2*>(su + (16 * du + g + 8 * hh) * ldw + 32 * grp + 8 * nt +
                                        c2) =
                __floats2half2_rn(eacc[nt][2 * hh], eacc[nt][2 * hh + 1]);
      }
      __syncthreads();
      copy_rows(static_cast<T*>(p.kt) + row0 * D, skt, ldw, std::integral_constant<int, D>{});
      if (dense)
        copy_rows(static_cast<__half*>(p.e) + row0 * D, su, ldw, std::integral_constant<int, D>{});
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
