#pragma once
// The PaTH / PaTH-FoX backward on CUDA cores (spec/path_fox.md §4), the CPU's blocked algorithm
// (cpu/detail/path_backward.hpp) mapped onto CTAs, in float, with no atomics; the plan's kernels
// for float inputs and head dims the tensor-core ones (sm80_path_backward.cuh) do not take:
//
//   0. path_backward_gate_kernel (PaTH-FoX, path_backward_gate.cuh): the gate cumsum G in double
//      and each token's last hard reset.
//   1. path_prepare_kernel (path_simt.cuh, the forward's): per chunk U, M, K~ in float.
//   2. path_backward_query_tiled_kernel: a CTA per (slice, KV head, sequence). A slice is a
//      contiguous range of query chunks of about equal work (the CPU's cut). For each query head
//      of the group and each query chunk of its slice, in order: the diagonal tile from the saved
//      lse, the forward's right-to-left walk (keeping each chunk's scan state and dZ K~ in the
//      slice's scratch), the left-to-right adjoint through the chunk products, and the query's
//      own chunk back to dq. What the keys, values and transitions receive goes to the slice's
//      own float sums (dK~, dv, dW, dU by token; dk and dM of the diagonal tiles, which only the
//      owning slice touches, once); dG to the slice's double sums.
//   3. path_backward_chunk_tiled_kernel: a CTA per (chunk, KV head, sequence) adds the slices'
//      sums in slice order and takes the chunk back through K~ = K - M^T W, P = I - W^T U and the
//      UT transform to dk, dv, dw and dbeta.
//   4. path_backward_dg_kernel (PaTH-FoX, path_backward_gate.cuh): dG summed over slices in
//      order, then the reverse cumsum to dg per sequence and query head (0 at hard resets).
// Extra memory: the slices' sums, O(slices * B * T * H * (5 D + Dv)) floats (slices <= 8, fewer
// when B * H fills the GPU); never T x T, never a copy of the queries per chunk.
//
// Every C x C x D or C x D x C product runs through tile_product, where each thread computes a
// block of RM x RN elements of the output (rows tr + 16 i, columns tc + 16 j of the 16 x 16
// thread grid) from RM + RN operand loads per step of the reduction. Every sum element is one
// fixed-order sum (k = 0, 1, ... in order) updated by one thread a pass, so the bits do not
// depend on the run. Products whose CPU loop stops early (c <= a, b < n) run to a fixed depth
// over operands that are exactly 0 past the end (x, dx are stored triangular), which adds exact
// zeros. Operands past the sequence or the chunk are never read from global memory: accessors
// return 0 there. Row-indexed operands (the A side, rows spread over a warp) are read from shared
// memory: dO is staged in Tmp while the softmax runs (when Dv <= C; else read from global
// memory), and each scan state of the adjoint pass in R (free after the walk); the key-side
// operands (the B side, two addresses a warp instruction) come from global memory (L1).

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/kernels/path_backward_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

constexpr int path_tile_threads = 256;  // the 16 x 16 thread grid of tile_product

// out(r, c, acc) for each (r, c) of rows x cols, acc = init(r, c) + sum over k = 0 .. depth - 1
// (in that order) of a(r, k) * b(k, c). a is called only for r < rows, b only for c < cols.
// Element (r, c) is always computed by the same thread for the same rows, cols.
template <int RM, int RN, class I, class A, class B, class O>
__device__ __forceinline__ void tile_product_init(int rows, int cols, int depth, I&& init, A&& a,
                                                  B&& b, O&& out) {
  constexpr int TR = 16, TC = path_tile_threads / 16;
  const int tr = threadIdx.x % TR, tc = threadIdx.x / TR;
  for (int rb = 0; rb < rows; rb += TR * RM)
    for (int cb = 0; cb < cols; cb += TC * RN) {
      float acc[RM][RN];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) {
          const int r = rb + tr + TR * i, c = cb + tc + TC * j;
          acc[i][j] = r < rows && c < cols ? init(r, c) : 0.f;
        }
#pragma unroll 2
      for (int k = 0; k < depth; ++k) {
        float av[RM], bv[RN];
#pragma unroll
        for (int i = 0; i < RM; ++i) {
          const int r = rb + tr + TR * i;
          av[i] = r < rows ? a(r, k) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < RN; ++j) {
          const int c = cb + tc + TC * j;
          bv[j] = c < cols ? b(k, c) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < RM; ++i)
#pragma unroll
          for (int j = 0; j < RN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) {
          const int r = rb + tr + TR * i, c = cb + tc + TC * j;
          if (r < rows && c < cols) out(r, c, acc[i][j]);
        }
    }
}

template <class A, class B, class O>
__device__ __forceinline__ void tile_product(int rows, int cols, int depth, A&& a, B&& b, O&& out) {
  tile_product_init<4, 4>(
      rows, cols, depth, [](int, int) { return 0.f; }, a, b, out);
}

template <class I, class A, class B, class O>
__device__ __forceinline__ void tile_product_from(int rows, int cols, int depth, I&& init, A&& a,
                                                  B&& b, O&& out) {
  tile_product_init<4, 4>(rows, cols, depth, init, a, b, out);
}

// Shared memory as plan/path_backward.hpp's path_backward_query_smem: ld = D + 1, lc = C + 1.
template <class T>
__global__ void __launch_bounds__(path_tile_threads, 1)
    path_backward_query_tiled_kernel(const path_backward_params p) {
  constexpr int C = path_chunk;
  constexpr int lc = C + 1;
  extern __shared__ float smem[];
  const path_kernel_params& kp = p.kp;
  const int D = kp.a.head_dim, Dv = kp.a.value_dim, ld = D + 1;
  const path_backward_float_tiles tiles(smem, D);
  float *qs = tiles.qs, *dqs = tiles.dqs, *r = tiles.r, *rbar = tiles.rbar, *x = tiles.x,
        *s = tiles.s;
  float *dz = tiles.dz, *dx = tiles.dx, *tmp = tiles.tmp, *lse = tiles.lse, *delta = tiles.delta,
        *gi = tiles.gi;
  int* reset_i = tiles.reset_i;

  const int h = blockIdx.y, group = kp.a.group;
  const path_backward_cta<T> cta(p);
  if (!cta.active) return;
  const float scale = p.scale;

  for (int hq = h * group; hq < (h + 1) * group; ++hq) {
    const path_backward_query_rows<T> qr(p, cta, hq);
    const index_t HQ = kp.a.q_heads;

    for (index_t ci = cta.lo; ci < cta.hi; ++ci) {
      const index_t c0 = ci * C;
      const int n = cta.length - c0 < C ? static_cast<int>(cta.length - c0) : C;
      const double g_ref = qr.G != nullptr ? qr.G[c0 * HQ] : 0.0;

      tiles.load_rows(p, cta, qr, hq, c0, n, g_ref);

      // Query rows past n read as 0 (qs is 0 there; global rows are never read).
      const auto dO_at = [&](int a, int e) {
        return a < n ? to_float(qr.dO[(c0 + a) * qr.dos1 + e]) : 0.f;
      };

      // p and dZ of the key chunk starting at j0 (sequence position) with `cols` keys, scores
      // in s; diag: the causal mask of the diagonal tile. Adds p^T dO to dv and the gate sums.
      // dO staged in tmp (free while the softmax runs) when its rows fit: the products then read
      // it from shared memory, 16 rows a warp instruction without bank conflicts.
      const bool stage_dO = Dv <= C;
      const auto dO_staged = [&](int a, int e) {
        return tmp[a * lc + e];
      };
      const auto backprop_softmax = [&](index_t j0, int cols, bool diag) {
        // dP = dO V^T into dz (each element: e = 0 .. Dv - 1 in order, as the fallback's loop).
        const auto v_at = [&](int e, int j) {
          return j < cols ? to_float(cta.V[(j0 + j) * cta.vs1 + e]) : 0.f;
        };
        const auto to_dz = [&](int a, int j, float acc) {
          dz[a * lc + j] = acc;
        };
        if (stage_dO) {
          for_tile(C, Dv, [&](int a, int e) { tmp[a * lc + e] = dO_at(a, e); });
          __syncthreads();
          tile_product(C, C, Dv, dO_staged, v_at, to_dz);
        } else {
          tile_product(C, C, Dv, dO_at, v_at, to_dz);
        }
        __syncthreads();
        for_tile(C, C, [&](int j, int a) {
          float pv = 0.f, dzv = 0.f;
          if (a < n && j < cols && (!diag || j <= a) && (qr.R == nullptr || j0 + j >= reset_i[a])) {
            float z = s[a * lc + j];
            if (qr.G != nullptr)
              z += gi[a] - static_cast<float>(p.coef * (qr.G[(j0 + j) * HQ] - g_ref));
            pv = expf(z - lse[a]);
            dzv = pv * (dz[a * lc + j] - delta[a]);
          }
          s[a * lc + j] = pv;
          dz[a * lc + j] = dzv;
        });
        __syncthreads();
        const auto p_at = [&](int j, int a) {
          return s[a * lc + j];
        };
        const auto to_dv = [&](int j, int e, float acc) {
          cta.dvs[(j0 + j) * Dv + e] += acc;
        };
        if (stage_dO)
          tile_product(cols, Dv, n, p_at, dO_staged, to_dv);
        else
          tile_product(cols, Dv, n, p_at, dO_at, to_dv);
        if (qr.dG != nullptr) {
          for (int a = threadIdx.x; a < n; a += blockDim.x) {
            float rs = 0.f;
            for (int j = 0; j < cols; ++j) rs += dz[a * lc + j];
            qr.dG[(c0 + a) * HQ] += p.coef * static_cast<double>(rs);
          }
          __syncthreads();  // the diagonal tile's columns are its rows
          for (int j = threadIdx.x; j < cols; j += blockDim.x) {
            float cs = 0.f;
            for (int a = 0; a < n; ++a) cs += dz[a * lc + j];
            qr.dG[(j0 + j) * HQ] -= p.coef * static_cast<double>(cs);
          }
        }
        __syncthreads();
      };

      // Step 1: the diagonal tile, z = tril(Qs K^T - tril(Qs W^T) M) (+ gate).
      tile_product(
          C, C, D, [&](int a, int d) { return qs[a * ld + d]; },
          [&](int d, int b) { return b < n ? cta.W[(c0 + b) * cta.ws1 + d] : 0.f; },
          [&](int a, int b, float acc) { x[a * lc + b] = a < n && b <= a ? acc : 0.f; });
      tile_product(
          C, C, D, [&](int a, int d) { return qs[a * ld + d]; },
          [&](int d, int b) { return b < n ? to_float(cta.K[(c0 + b) * cta.ks1 + d]) : 0.f; },
          [&](int a, int b, float acc) { s[a * lc + b] = acc; });
      __syncthreads();
      // s -= X M, continuing each element's sum (the same thread: same rows, cols).
      tile_product_from(
          C, C, n, [&](int a, int b) { return s[a * lc + b]; },
          [&](int a, int c) { return -x[a * lc + c]; },
          [&](int c, int b) { return b < n ? cta.MM[(c0 + c) * C + b] : 0.f; },
          [&](int a, int b, float acc) { s[a * lc + b] = a < n && b < n ? acc : 0.f; });
      __syncthreads();
      backprop_softmax(c0, n, true);
      // dk += dZ^T Qs; dM -= X^T dZ; dQs = dZ K; dX = -dZ M^T.
      tile_product(
          n, D, n, [&](int b, int a) { return dz[a * lc + b]; },
          [&](int a, int d) { return qs[a * ld + d]; },
          [&](int b, int d, float acc) { cta.dkd[(c0 + b) * D + d] += acc; });
      tile_product(
          n, n, n, [&](int rr, int a) { return x[a * lc + rr]; },
          [&](int a, int c) { return dz[a * lc + c]; },
          [&](int rr, int c, float acc) { cta.dm[(c0 + rr) * C + c] -= acc; });
      tile_product(
          C, D, n, [&](int a, int b) { return dz[a * lc + b]; },
          [&](int b, int d) { return to_float(cta.K[(c0 + b) * cta.ks1 + d]); },
          [&](int a, int d, float acc) { dqs[a * ld + d] = a < n ? acc : 0.f; });
      tile_product(
          C, C, n, [&](int a, int b) { return dz[a * lc + b]; },
          [&](int b, int c) { return c < n ? cta.MM[(c0 + c) * C + b] : 0.f; },
          [&](int a, int c, float acc) { dx[a * lc + c] = a < n && c < n ? -acc : 0.f; });
      __syncthreads();

      if (ci > 0) {
        // Step 2: the forward's walk, keeping each chunk's scan state r and e = dZ K~.
        // r = Qs - X U (X is 0 above its diagonal, so the full depth n adds exact zeros).
        tile_product_from(
            C, D, n, [&](int a, int d) { return qs[a * ld + d]; },
            [&](int a, int c) { return -x[a * lc + c]; },
            [&](int c, int d) { return cta.UU[(c0 + c) * D + d]; },
            [&](int a, int d, float acc) { r[a * ld + d] = a < n ? acc : 0.f; });
        __syncthreads();
        for (index_t cj = ci - 1; cj >= 0; --cj) {
          const index_t j0 = cj * C;  // earlier chunks are full
          for_tile(n, D, [&](int a, int d) { cta.states[(j0 + a) * D + d] = r[a * ld + d]; });
          tile_product(
              C, C, D, [&](int a, int d) { return r[a * ld + d]; },
              [&](int d, int j) { return cta.KT[(j0 + j) * D + d]; },
              [&](int a, int j, float acc) { s[a * lc + j] = a < n ? acc : 0.f; });
          __syncthreads();
          backprop_softmax(j0, C, false);
          tile_product(
              C, D, n, [&](int j, int a) { return dz[a * lc + j]; },
              [&](int a, int d) { return r[a * ld + d]; },
              [&](int j, int d, float acc) { cta.dkt[(j0 + j) * D + d] += acc; });
          tile_product(
              n, D, C, [&](int a, int j) { return dz[a * lc + j]; },
              [&](int j, int d) { return cta.KT[(j0 + j) * D + d]; },
              [&](int a, int d, float acc) { cta.es[(j0 + a) * D + d] = acc; });
          if (cj == 0) break;  // chunk 0's product is never applied
          tile_product(
              C, C, D, [&](int a, int d) { return r[a * ld + d]; },
              [&](int d, int c) { return cta.W[(j0 + c) * cta.ws1 + d]; },
              [&](int a, int c, float acc) { tmp[a * lc + c] = a < n ? acc : 0.f; });
          __syncthreads();
          tile_product(
              n, D, C, [&](int a, int c) { return tmp[a * lc + c]; },
              [&](int c, int d) { return cta.UU[(j0 + c) * D + d]; },
              [&](int a, int d, float acc) { r[a * ld + d] -= acc; });
          __syncthreads();
        }
        __syncthreads();
        // Step 3: rbar^(cj) = e_cj + rbar^(cj-1) P_cj^T, with P = I - W^T U:
        // dU -= (r W^T)^T rbar, dW -= (rbar U^T)^T r.
        for_tile(C, D, [&](int a, int d) { rbar[a * ld + d] = a < n ? cta.es[a * D + d] : 0.f; });
        __syncthreads();
        for (index_t cj = 1; cj < ci; ++cj) {
          const index_t j0 = cj * C;
          // This chunk's scan state, staged in r (free after the walk).
          const float* St = cta.states + j0 * D;
          for_tile(C, D, [&](int a, int d) { r[a * ld + d] = a < n ? St[a * D + d] : 0.f; });
          __syncthreads();
          tile_product(
              C, C, D, [&](int a, int d) { return r[a * ld + d]; },
              [&](int d, int c) { return cta.W[(j0 + c) * cta.ws1 + d]; },
              [&](int a, int c, float acc) { s[a * lc + c] = a < n ? acc : 0.f; });
          tile_product(
              C, C, D, [&](int a, int d) { return rbar[a * ld + d]; },
              [&](int d, int c) { return cta.UU[(j0 + c) * D + d]; },
              [&](int a, int c, float acc) { tmp[a * lc + c] = a < n ? acc : 0.f; });
          __syncthreads();
          tile_product(
              C, D, n, [&](int c, int a) { return s[a * lc + c]; },
              [&](int a, int d) { return rbar[a * ld + d]; },
              [&](int c, int d, float acc) { cta.dus[(j0 + c) * D + d] -= acc; });
          tile_product(
              C, D, n, [&](int c, int a) { return tmp[a * lc + c]; },
              [&](int a, int d) { return r[a * ld + d]; },
              [&](int c, int d, float acc) { cta.dws[(j0 + c) * D + d] -= acc; });
          __syncthreads();
          tile_product(
              n, D, C, [&](int a, int c) { return tmp[a * lc + c]; },
              [&](int c, int d) { return cta.W[(j0 + c) * cta.ws1 + d]; },
              [&](int a, int d, float acc) { rbar[a * ld + d] += cta.es[(j0 + a) * D + d] - acc; });
          __syncthreads();
        }
        // Q~ = Qs - tril(Qs W^T) U.
        for_tile(C, D, [&](int a, int d) { dqs[a * ld + d] += rbar[a * ld + d]; });
        tile_product(
            C, C, D, [&](int a, int d) { return rbar[a * ld + d]; },
            [&](int d, int c) { return c < n ? cta.UU[(c0 + c) * D + d] : 0.f; },
            [&](int a, int c, float acc) {
              if (a < n && c < n) dx[a * lc + c] -= acc;
            });
        tile_product(
            n, D, n, [&](int c, int a) { return x[a * lc + c]; },
            [&](int a, int d) { return rbar[a * ld + d]; },
            [&](int c, int d, float acc) { cta.dus[(c0 + c) * D + d] -= acc; });
        __syncthreads();
      }

      // Step 4: X = tril(Qs W^T).
      for_tile(C, C, [&](int a, int c) {
        if (c > a) dx[a * lc + c] = 0.f;
      });
      __syncthreads();
      // dQs + dX W (dX is 0 above its diagonal and past n).
      tile_product_from(
          n, D, n, [&](int a, int d) { return dqs[a * ld + d]; },
          [&](int a, int c) { return dx[a * lc + c]; },
          [&](int c, int d) { return cta.W[(c0 + c) * cta.ws1 + d]; },
          [&](int a, int d, float acc) {
            static_cast<T*>(p.dq)[cta.batch * p.dq_stride[0] +
                                  (cta.start + c0 + a) * p.dq_stride[1] + hq * p.dq_stride[2] + d] =
                from_float<T>(scale * acc);
          });
      // dW += dX^T Qs (dX[a][c] is 0 for a < c).
      tile_product(
          n, D, n, [&](int c, int a) { return dx[a * lc + c]; },
          [&](int a, int d) { return qs[a * ld + d]; },
          [&](int c, int d, float acc) { cta.dws[(c0 + c) * D + d] += acc; });
      __syncthreads();
    }
  }
}

// ---- the chunks, back through the UT transform -----------------------------------------------
// Its two n x n x D passes (the Gram products of W with dK~, W and K, and Lbar) run through
// tile_product, the back substitution a thread a column. Shared memory as
// path_backward_chunk_tiled_smem (ld = D + 1, lc = C + 1): two CTAs a multiprocessor at D = 64,
// as Lbar takes dK~'s tile once dK~ is read, and dK = dk_diag + dK~ is summed again (the same
// sum, the same bits) in the last pass instead of kept.
template <class T>
__global__ void __launch_bounds__(path_tile_threads, 2)
    path_backward_chunk_tiled_kernel(const path_backward_params p) {
  constexpr int C = path_chunk;
  constexpr int lc = C + 1;
  extern __shared__ float smem[];
  const path_kernel_params& kp = p.kp;
  const int D = kp.a.head_dim, Dv = kp.a.value_dim, ld = D + 1;
  float* dKt = smem;                          // [C][ld], then Lbar [C][lc]
  float* dW = dKt + C * (ld > lc ? ld : lc);  // [C][ld]
  float* dU = dW + C * ld;                    // [C][ld], solved in place into Rbar_U
  float* dM = dU + C * ld;                    // [C][lc], solved in place into Rbar_M
  float* ww = dM + C * lc;                    // W W^T [C][lc]
  float* xk = ww + C * lc;                    // stril(W K^T) [C][lc]
  float* sb = xk + C * lc;                    // beta [C]
  float* lbar = dKt;                          // [C][lc], once dK~ is read

  const int h = blockIdx.y;
  index_t batch, start, length;
  kp.a.sequence(blockIdx.z, batch, start, length);
  const index_t c0 = static_cast<index_t>(blockIdx.x) * C;
  if (c0 >= length) return;
  const int n = length - c0 < C ? static_cast<int>(length - c0) : C;
  const index_t t0 = start + c0;
  const index_t row0 = kp.row(batch, h, t0);
  const float* UU = static_cast<const float*>(kp.u) + row0 * D;
  const float* MM = static_cast<const float*>(kp.m) + row0 * C;
  const float* W = kp.w + batch * kp.w_stride[0] + t0 * kp.w_stride[1] + h * kp.w_stride[2];
  const index_t ws1 = kp.w_stride[1];
  const T* K = static_cast<const T*>(kp.a.k) + batch * kp.a.k_stride[0] + t0 * kp.a.k_stride[1] +
               h * kp.a.k_stride[2];
  const index_t ks1 = kp.a.k_stride[1];
  // dK~ of row a, element d: the slices' sums in slice order.
  auto dkt_sum = [&](index_t at) {
    float kt = 0.f;
    for (int sl = 0; sl < p.slices; ++sl) kt += p.dkt[sl * p.slice_d + at];
    return kt;
  };

  // The slices' sums, in slice order.
  for_tile(n, D, [&](int a, int d) {
    const index_t at = (row0 + a) * D + d;
    float w = 0.f, u = 0.f;
    for (int sl = 0; sl < p.slices; ++sl) {
      w += p.dws[sl * p.slice_d + at];
      u += p.dus[sl * p.slice_d + at];
    }
    dKt[a * ld + d] = dkt_sum(at), dW[a * ld + d] = w, dU[a * ld + d] = u;
  });
  for_tile(n, Dv, [&](int a, int e) {
    const index_t at = (row0 + a) * Dv + e;
    float v = 0.f;
    for (int sl = 0; sl < p.slices; ++sl) v += p.dvs[sl * p.slice_dv + at];
    static_cast<T*>(
        p.dv)[batch * p.dv_stride[0] + (t0 + a) * p.dv_stride[1] + h * p.dv_stride[2] + e] =
        from_float<T>(v);
  });
  for (int a = threadIdx.x; a < n; a += blockDim.x)
    sb[a] =
        kp.beta[batch * kp.beta_stride[0] + (t0 + a) * kp.beta_stride[1] + h * kp.beta_stride[2]];
  __syncthreads();

  // K~ = K - M^T W: dM -= W dK~^T (strictly lower kept), dW -= M dK~. Gram products.
  // W dK~^T computed transposed (dK~ on the row side, from shared memory).
  tile_product(
      n, n, D, [&](int b, int d) { return dKt[b * ld + d]; },
      [&](int d, int a) { return W[a * ws1 + d]; },
      [&](int b, int a, float acc) {
        dM[a * lc + b] = a > b ? p.dm[(row0 + a) * C + b] - acc : 0.f;
      });
  tile_product(
      n, n, D, [&](int a, int d) { return W[a * ws1 + d]; },
      [&](int d, int b) { return W[b * ws1 + d]; },
      [&](int a, int b, float acc) { ww[a * lc + b] = acc; });
  tile_product(
      n, n, D, [&](int a, int d) { return W[a * ws1 + d]; },
      [&](int d, int b) { return to_float(K[b * ks1 + d]); },
      [&](int a, int b, float acc) { xk[a * lc + b] = a > b ? acc : 0.f; });
  for_tile(n, D, [&](int a, int d) {
    float acc = 0.f;
    for (int c = 0; c < a; ++c) acc += MM[a * C + c] * dKt[c * ld + d];
    dW[a * ld + d] -= acc;
  });
  __syncthreads();

  // [U, M] = (I + L)^-1 R with L = stril(diag(beta) W W^T): Rbar = (I + L)^-T [dU, dM], by back
  // substitution, a thread per column.
  for (int col = threadIdx.x; col < D + n; col += blockDim.x) {
    float* X = col < D ? dU + col : dM + (col - D);
    const int st = col < D ? ld : lc;
    for (int a = n - 2; a >= 0; --a) {
      float acc = 0.f;
      for (int b = a + 1; b < n; ++b) acc += sb[b] * ww[b * lc + a] * X[b * st];
      X[a * st] -= acc;
    }
  }
  __syncthreads();
  // Lbar = -stril(Rbar [U, M]^T) (the minus applied below).
  // (the second sum continues the first: element (a, b) is the same thread's in both)
  tile_product(
      n, n, D, [&](int a, int d) { return dU[a * ld + d]; },
      [&](int d, int b) { return UU[b * D + d]; },
      [&](int a, int b, float acc) { lbar[a * lc + b] = acc; });
  tile_product_from(
      n, n, n, [&](int a, int b) { return lbar[a * lc + b]; },
      [&](int a, int c) { return dM[a * lc + c]; }, [&](int c, int b) { return MM[b * C + c]; },
      [&](int a, int b, float acc) { lbar[a * lc + b] = a > b ? acc : 0.f; });
  __syncthreads();
  // R = diag(beta) [W, stril(W K^T)], L = stril(diag(beta) W W^T).
  for (int a = threadIdx.x; a < n; a += blockDim.x) {
    float acc = 0.f, am = 0.f, al = 0.f;
    for (int d = 0; d < D; ++d) acc += dU[a * ld + d] * W[a * ws1 + d];
    for (int b = 0; b < n; ++b) {
      am += dM[a * lc + b] * xk[a * lc + b];
      al += lbar[a * lc + b] * ww[a * lc + b];
    }
    p.dbeta[batch * p.dbeta_stride[0] + (t0 + a) * p.dbeta_stride[1] + h * p.dbeta_stride[2]] =
        acc + am - al;
  }
  __syncthreads();
  // W and K staged in the Gram tiles (read for the last time above) when their rows fit: the
  // last pass reads each n times.
  const bool staged = D <= C;
  if (staged)
    for_tile(n, D, [&](int b, int d) {
      ww[b * lc + d] = W[b * ws1 + d];
      xk[b * lc + d] = to_float(K[b * ks1 + d]);
    });
  for_tile(n, n, [&](int a, int b) {
    lbar[a * lc + b] *= -sb[a];                             // d (w_a . w_b), a > b
    dM[a * lc + b] = a > b ? dM[a * lc + b] * sb[a] : 0.f;  // d (w_a . k_b), a > b
  });
  __syncthreads();
  for_tile(n, D, [&](int a, int d) {
    const index_t at = (row0 + a) * D + d;
    float w = dW[a * ld + d] + sb[a] * dU[a * ld + d];
    float k = p.dk_diag[at] + dkt_sum(at);  // dK = dk_diag + dK~
    for (int b = 0; b < n; ++b) {
      const float wb = staged ? ww[b * lc + d] : W[b * ws1 + d];
      const float kb = staged ? xk[b * lc + d] : to_float(K[b * ks1 + d]);
      w += (lbar[a * lc + b] + lbar[b * lc + a]) * wb + dM[a * lc + b] * kb;
      k += dM[b * lc + a] * wb;
    }
    p.dw[batch * p.dw_stride[0] + (t0 + a) * p.dw_stride[1] + h * p.dw_stride[2] + d] = w;
    static_cast<T*>(
        p.dk)[batch * p.dk_stride[0] + (t0 + a) * p.dk_stride[1] + h * p.dk_stride[2] + d] =
        from_float<T>(k);
  });
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
