#pragma once
// The PaTH / PaTH-FoX backward on CUDA cores (spec/path_fox.md §4), the CPU's blocked algorithm
// (cpu/detail/path_backward.hpp) mapped onto CTAs, in float, with no atomics:
//
//   0. path_backward_gate_kernel (PaTH-FoX): the gate cumsum G in double and each token's last
//      hard reset, a warp per (sequence, query head), 32 tokens a step.
//   1. path_prepare_kernel (path_simt.cuh, the forward's): per chunk U, M, K~ in float.
//   2. path_backward_query_kernel: a CTA per (slice, KV head, sequence). A slice is a contiguous
//      range of query chunks of about equal work (the CPU's cut). For each query head of the
//      group and each query chunk of its slice, in order: the diagonal tile from the saved lse,
//      the forward's right-to-left walk (keeping each chunk's scan state and dZ K~ in the slice's
//      scratch), the left-to-right adjoint through the chunk products, and the query's own chunk
//      back to dq. What the keys, values and transitions receive goes to the slice's own float
//      sums (dK~, dv, dW, dU by token; dk and dM of the diagonal tiles, which only the owning
//      slice touches, once); dG to the slice's double sums. Every sum element is updated by one
//      thread per pass, in a fixed order: the same bits on every run.
//   3. path_backward_chunk_kernel: a CTA per (chunk, KV head, sequence) adds the slices' sums in
//      slice order and takes the chunk back through K~ = K - M^T W, P = I - W^T U and the UT
//      transform to dk, dv, dw and dbeta.
//   4. path_backward_dg_kernel (PaTH-FoX): dG summed over slices in order, then the reverse
//      cumsum to dg per sequence and query head (0 at hard resets).
// Extra memory: the slices' sums, O(slices * B * T * H * (5 D + Dv)) floats (slices <= 8, fewer
// when B * H fills the GPU); never T x T, never a copy of the queries per chunk.
//
// Matrix products are written as plain loops over shared memory and global (L2-resident) rows:
// correct first; the tensor-core version is future work. The C x C passes that take dot products
// of a query-side row (shared) with a key-side row (global) put consecutive threads on
// consecutive query rows, so that a warp reads one key row (a broadcast) and shared rows of
// stride D + 1 or C + 1 (no bank conflicts). Which thread computes an element never changes its
// value: every element is one fixed-order sum. Indices are 64-bit (index_t) wherever
// they address [B, T, H, .] data.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/attention_params.cuh"
#include "attnmix/cuda/kernels/path_backward_params.cuh"
#include "attnmix/cuda/kernels/path_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// ---- 0. the gate cumsum with hard resets ---------------------------------------------------
// Lane i's inclusive segmented sum over lanes 0 .. i (v, with `reset` starting a segment at its
// lane) and whether lanes 0 .. i hold a reset.
__device__ __forceinline__ double warp_segmented_sum(double v, bool& reset) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const double up = __shfl_up_sync(0xffffffffu, v, off);
    const bool up_reset = __shfl_up_sync(0xffffffffu, int(reset), off) != 0;
    if (lane >= off) {
      if (!reset) v += up;
      reset = reset || up_reset;
    }
  }
  return v;
}

// A warp per (sequence, query head), 32 tokens a step: a segmented inclusive scan over the lanes
// (a hard reset starts a segment) plus the sum carried from the steps before, in double.
__global__ void __launch_bounds__(32 * path_gate_warps)
    path_backward_gate_kernel(const float* g, index_t g_s0, index_t g_s1, index_t g_s2,
                              const attention_kernel_params a, double* G, std::int32_t* reset) {
  const int lane = threadIdx.x % 32;
  const int hq = blockIdx.x * path_gate_warps + threadIdx.x / 32;
  if (hq >= a.q_heads) return;  // whole warps
  index_t batch, start, length;
  a.sequence(blockIdx.y, batch, start, length);
  double carry = 0;
  std::int32_t last = 0;
  for (index_t t0 = 0; t0 < length; t0 += 32) {
    const index_t t = t0 + lane;
    const double x =
        t < length ? static_cast<double>(g[batch * g_s0 + (start + t) * g_s1 + hq * g_s2]) : 0.0;
    bool hard = t < length && isinf(x) && x < 0;
    std::int32_t at_reset = hard ? static_cast<std::int32_t>(t) : -1;
#pragma unroll
    for (int off = 1; off < 32; off *= 2)
      at_reset = max(at_reset, __shfl_up_sync(0xffffffffu, at_reset, off));
    const double sum = warp_segmented_sum(hard ? 0.0 : x, hard);
    const double total = hard ? sum : carry + sum;
    const std::int32_t latest = max(last, at_reset);
    if (t < length) {
      const index_t at = (batch * a.tokens + start + t) * a.q_heads + hq;
      G[at] = total;
      reset[at] = latest;
    }
    carry = __shfl_sync(0xffffffffu, total, 31);
    last = __shfl_sync(0xffffffffu, latest, 31);
  }
}

// ---- 4. dg = reverse cumsum of dG ----------------------------------------------------------
// A warp per (sequence, query head), 32 tokens a step from the end, as the gate kernel.
__global__ void __launch_bounds__(32 * path_gate_warps)
    path_backward_dg_kernel(const float* g, index_t g_s0, index_t g_s1, index_t g_s2,
                            const attention_kernel_params a, const double* dgate,
                            index_t slice_gate, int slices, float* dg, index_t dg_s0, index_t dg_s1,
                            index_t dg_s2) {
  const int lane = threadIdx.x % 32;
  const int hq = blockIdx.x * path_gate_warps + threadIdx.x / 32;
  if (hq >= a.q_heads) return;  // whole warps
  index_t batch, start, length;
  a.sequence(blockIdx.y, batch, start, length);
  double carry = 0;
  for (index_t top = length - 1; top >= 0; top -= 32) {
    const index_t t = top - lane;  // lanes walk the tokens backwards
    bool hard = false;
    double d = 0;
    if (t >= 0) {
      const double x = static_cast<double>(g[batch * g_s0 + (start + t) * g_s1 + hq * g_s2]);
      hard = isinf(x) && x < 0;
      const index_t at = (batch * a.tokens + start + t) * a.q_heads + hq;
      if (!hard)
        for (int s = 0; s < slices; ++s) d += dgate[s * slice_gate + at];
    }
    const bool own = hard;
    const double sum = warp_segmented_sum(d, hard);
    const double total = hard ? sum : carry + sum;
    if (t >= 0) dg[batch * dg_s0 + (start + t) * dg_s1 + hq * dg_s2] = own ? 0.f : float(total);
    carry = __shfl_sync(0xffffffffu, total, 31);
  }
}

// ---- 2. the query chunks -------------------------------------------------------------------
// Shared memory as plan/path_backward.hpp's path_backward_query_smem: ld = D + 1, lc = C + 1.
template <class T>
__global__ void __launch_bounds__(256) path_backward_query_kernel(const path_backward_params p) {
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

      // p and dZ of the key chunk starting at j0 (sequence position) with `cols` keys, scores
      // in s; diag: the causal mask of the diagonal tile. Adds p^T dO to dv and the gate sums.
      const auto backprop_softmax = [&](index_t j0, int cols, bool diag) {
        for_tile(C, C, [&](int j, int a) {
          float pv = 0.f, dzv = 0.f;
          if (a < n && j < cols && (!diag || j <= a) && (qr.R == nullptr || j0 + j >= reset_i[a])) {
            float z = s[a * lc + j];
            if (qr.G != nullptr)
              z += gi[a] - static_cast<float>(p.coef * (qr.G[(j0 + j) * HQ] - g_ref));
            pv = expf(z - lse[a]);
            float dp = 0.f;
            for (int e = 0; e < Dv; ++e)
              dp +=
                  to_float(qr.dO[(c0 + a) * qr.dos1 + e]) * to_float(cta.V[(j0 + j) * cta.vs1 + e]);
            dzv = pv * (dp - delta[a]);
          }
          s[a * lc + j] = pv;
          dz[a * lc + j] = dzv;
        });
        __syncthreads();
        for_tile(cols, Dv, [&](int j, int e) {
          float acc = 0.f;
          for (int a = 0; a < n; ++a)
            acc += s[a * lc + j] * to_float(qr.dO[(c0 + a) * qr.dos1 + e]);
          cta.dvs[(j0 + j) * Dv + e] += acc;
        });
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
      for_tile(C, C, [&](int b, int a) {
        float acc = 0.f;
        if (a < n && b <= a)
          for (int d = 0; d < D; ++d) acc += qs[a * ld + d] * cta.W[(c0 + b) * cta.ws1 + d];
        x[a * lc + b] = acc;
      });
      __syncthreads();
      for_tile(C, C, [&](int b, int a) {
        float acc = 0.f;
        if (a < n && b < n) {
          for (int d = 0; d < D; ++d)
            acc += qs[a * ld + d] * to_float(cta.K[(c0 + b) * cta.ks1 + d]);
          for (int c = 0; c < n; ++c) acc -= x[a * lc + c] * cta.MM[(c0 + c) * C + b];
        }
        s[a * lc + b] = acc;
      });
      __syncthreads();
      backprop_softmax(c0, n, true);
      // dk += dZ^T Qs; dM -= X^T dZ; dQs = dZ K; dX = -dZ M^T.
      for_tile(n, D, [&](int b, int d) {
        float acc = 0.f;
        for (int a = 0; a < n; ++a) acc += dz[a * lc + b] * qs[a * ld + d];
        cta.dkd[(c0 + b) * D + d] += acc;
      });
      for_tile(n, n, [&](int rr, int c) {
        float acc = 0.f;
        for (int a = 0; a < n; ++a) acc += x[a * lc + rr] * dz[a * lc + c];
        cta.dm[(c0 + rr) * C + c] -= acc;
      });
      for_tile(C, D, [&](int a, int d) {
        float acc = 0.f;
        if (a < n)
          for (int b = 0; b < n; ++b)
            acc += dz[a * lc + b] * to_float(cta.K[(c0 + b) * cta.ks1 + d]);
        dqs[a * ld + d] = acc;
      });
      for_tile(C, C, [&](int c, int a) {
        float acc = 0.f;
        if (a < n && c < n)
          for (int b = 0; b < n; ++b) acc += dz[a * lc + b] * cta.MM[(c0 + c) * C + b];
        dx[a * lc + c] = -acc;
      });
      __syncthreads();

      if (ci > 0) {
        // Step 2: the forward's walk, keeping each chunk's scan state r and e = dZ K~.
        for_tile(C, D, [&](int a, int d) {
          float acc = 0.f;
          if (a < n) {
            acc = qs[a * ld + d];
            for (int c = 0; c <= a; ++c) acc -= x[a * lc + c] * cta.UU[(c0 + c) * D + d];
          }
          r[a * ld + d] = acc;
        });
        __syncthreads();
        for (index_t cj = ci - 1; cj >= 0; --cj) {
          const index_t j0 = cj * C;  // earlier chunks are full
          for_tile(n, D, [&](int a, int d) { cta.states[(j0 + a) * D + d] = r[a * ld + d]; });
          for_tile(C, C, [&](int j, int a) {
            float acc = 0.f;
            if (a < n)
              for (int d = 0; d < D; ++d) acc += r[a * ld + d] * cta.KT[(j0 + j) * D + d];
            s[a * lc + j] = acc;
          });
          __syncthreads();
          backprop_softmax(j0, C, false);
          for_tile(C, D, [&](int j, int d) {
            float acc = 0.f;
            for (int a = 0; a < n; ++a) acc += dz[a * lc + j] * r[a * ld + d];
            cta.dkt[(j0 + j) * D + d] += acc;
          });
          for_tile(n, D, [&](int a, int d) {
            float acc = 0.f;
            for (int j = 0; j < C; ++j) acc += dz[a * lc + j] * cta.KT[(j0 + j) * D + d];
            cta.es[(j0 + a) * D + d] = acc;
          });
          if (cj == 0) break;  // chunk 0's product is never applied
          for_tile(C, C, [&](int c, int a) {
            float acc = 0.f;
            if (a < n)
              for (int d = 0; d < D; ++d) acc += r[a * ld + d] * cta.W[(j0 + c) * cta.ws1 + d];
            tmp[a * lc + c] = acc;
          });
          __syncthreads();
          for_tile(n, D, [&](int a, int d) {
            float acc = 0.f;
            for (int c = 0; c < C; ++c) acc += tmp[a * lc + c] * cta.UU[(j0 + c) * D + d];
            r[a * ld + d] -= acc;
          });
          __syncthreads();
        }
        __syncthreads();
        // Step 3: rbar^(cj) = e_cj + rbar^(cj-1) P_cj^T, with P = I - W^T U:
        // dU -= (r W^T)^T rbar, dW -= (rbar U^T)^T r.
        for_tile(C, D, [&](int a, int d) { rbar[a * ld + d] = a < n ? cta.es[a * D + d] : 0.f; });
        __syncthreads();
        for (index_t cj = 1; cj < ci; ++cj) {
          const index_t j0 = cj * C;
          const float* St = cta.states + j0 * D;
          for_tile(C, C, [&](int c, int a) {
            float y = 0.f, t = 0.f;
            if (a < n)
              for (int d = 0; d < D; ++d) {
                y += St[a * D + d] * cta.W[(j0 + c) * cta.ws1 + d];
                t += rbar[a * ld + d] * cta.UU[(j0 + c) * D + d];
              }
            s[a * lc + c] = y;
            tmp[a * lc + c] = t;
          });
          __syncthreads();
          for_tile(C, D, [&](int c, int d) {
            float du = 0.f, dw = 0.f;
            for (int a = 0; a < n; ++a) {
              du += s[a * lc + c] * rbar[a * ld + d];
              dw += tmp[a * lc + c] * St[a * D + d];
            }
            cta.dus[(j0 + c) * D + d] -= du;
            cta.dws[(j0 + c) * D + d] -= dw;
          });
          __syncthreads();
          for_tile(n, D, [&](int a, int d) {
            float acc = 0.f;
            for (int c = 0; c < C; ++c) acc += tmp[a * lc + c] * cta.W[(j0 + c) * cta.ws1 + d];
            rbar[a * ld + d] += cta.es[(j0 + a) * D + d] - acc;
          });
          __syncthreads();
        }
        // Q~ = Qs - tril(Qs W^T) U.
        for_tile(C, D, [&](int a, int d) { dqs[a * ld + d] += rbar[a * ld + d]; });
        for_tile(C, C, [&](int c, int a) {
          float acc = 0.f;
          if (a < n && c < n)
            for (int d = 0; d < D; ++d) acc += rbar[a * ld + d] * cta.UU[(c0 + c) * D + d];
          dx[a * lc + c] -= acc;
        });
        for_tile(n, D, [&](int c, int d) {
          float acc = 0.f;
          for (int a = 0; a < n; ++a) acc += x[a * lc + c] * rbar[a * ld + d];
          cta.dus[(c0 + c) * D + d] -= acc;
        });
        __syncthreads();
      }

      // Step 4: X = tril(Qs W^T).
      for_tile(C, C, [&](int a, int c) {
        if (c > a) dx[a * lc + c] = 0.f;
      });
      __syncthreads();
      for_tile(n, D, [&](int a, int d) {
        float acc = dqs[a * ld + d];
        for (int c = 0; c <= a; ++c) acc += dx[a * lc + c] * cta.W[(c0 + c) * cta.ws1 + d];
        static_cast<T*>(p.dq)[cta.batch * p.dq_stride[0] + (cta.start + c0 + a) * p.dq_stride[1] +
                              hq * p.dq_stride[2] + d] = from_float<T>(scale * acc);
      });
      for_tile(n, D, [&](int c, int d) {
        float acc = 0.f;
        for (int a = c; a < n; ++a) acc += dx[a * lc + c] * qs[a * ld + d];
        cta.dws[(c0 + c) * D + d] += acc;
      });
      __syncthreads();
    }
  }
}

// ---- 3. the chunks, back through the UT transform ------------------------------------------
// Shared memory as path_backward_chunk_smem: ld = D + 1, lc = C + 1.
template <class T>
__global__ void __launch_bounds__(256) path_backward_chunk_kernel(const path_backward_params p) {
  constexpr int C = path_chunk;
  constexpr int lc = C + 1;
  extern __shared__ float smem[];
  const path_kernel_params& kp = p.kp;
  const int D = kp.a.head_dim, Dv = kp.a.value_dim, ld = D + 1;
  float* dK = smem;           // [C][ld]
  float* dKt = dK + C * ld;   // [C][ld]
  float* dW = dKt + C * ld;   // [C][ld]
  float* dU = dW + C * ld;    // [C][ld], solved in place into Rbar_U
  float* dM = dU + C * ld;    // [C][lc], solved in place into Rbar_M
  float* ww = dM + C * lc;    // W W^T [C][lc]
  float* lbar = ww + C * lc;  // [C][lc]
  float* xk = lbar + C * lc;  // stril(W K^T) [C][lc]
  float* sb = xk + C * lc;    // beta [C]

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

  // The slices' sums, in slice order.
  for_tile(n, D, [&](int a, int d) {
    const index_t at = (row0 + a) * D + d;
    float kt = 0.f, w = 0.f, u = 0.f;
    for (int sl = 0; sl < p.slices; ++sl) {
      kt += p.dkt[sl * p.slice_d + at];
      w += p.dws[sl * p.slice_d + at];
      u += p.dus[sl * p.slice_d + at];
    }
    dK[a * ld + d] = p.dk_diag[at] + kt;  // dK += dK~
    dKt[a * ld + d] = kt, dW[a * ld + d] = w, dU[a * ld + d] = u;
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
  for_tile(n, n, [&](int a, int b) {
    float acc = 0.f, g = 0.f, xkv = 0.f;
    for (int d = 0; d < D; ++d) {
      const float wa = W[a * ws1 + d];
      acc += wa * dKt[b * ld + d];
      g += wa * W[b * ws1 + d];
      xkv += wa * to_float(K[b * ks1 + d]);
    }
    dM[a * lc + b] = a > b ? p.dm[(row0 + a) * C + b] - acc : 0.f;
    ww[a * lc + b] = g;
    xk[a * lc + b] = a > b ? xkv : 0.f;
  });
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
  for_tile(n, n, [&](int a, int b) {
    float acc = 0.f;
    if (a > b) {
      for (int d = 0; d < D; ++d) acc += dU[a * ld + d] * UU[b * D + d];
      for (int c = 0; c < n; ++c) acc += dM[a * lc + c] * MM[b * C + c];
    }
    lbar[a * lc + b] = acc;
  });
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
  for_tile(n, n, [&](int a, int b) {
    lbar[a * lc + b] *= -sb[a];                             // d (w_a . w_b), a > b
    dM[a * lc + b] = a > b ? dM[a * lc + b] * sb[a] : 0.f;  // d (w_a . k_b), a > b
  });
  __syncthreads();
  for_tile(n, D, [&](int a, int d) {
    float w = dW[a * ld + d] + sb[a] * dU[a * ld + d];
    float k = dK[a * ld + d];
    for (int b = 0; b < n; ++b) {
      const float wb = W[b * ws1 + d];
      w += (lbar[a * lc + b] + lbar[b * lc + a]) * wb + dM[a * lc + b] * to_float(K[b * ks1 + d]);
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
