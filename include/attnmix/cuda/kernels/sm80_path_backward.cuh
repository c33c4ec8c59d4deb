#pragma once
// The query kernel of the PaTH / PaTH-FoX backward on tensor cores (mma.sync m16n8k16, float
// accumulation) for half and bfloat16 inputs at D = Dv = 64: the work, grid, scratch and sums of
// path_backward_query_tiled_kernel (path_backward_tiled.cuh), whose chunk kernel then runs
// unchanged. Per query chunk: the diagonal tile, the forward's right-to-left walk through the
// earlier chunks (keeping each chunk's scan state and e = dZ K~), the left-to-right adjoint
// through the chunk products, and the chunk's own transform back to dq.
//
// A CTA has 4 warps; warp w owns query rows 16 w .. 16 w + 15 and keeps their running query r,
// its adjoint rbar, the scores and dP in registers, so the products along a row (scores, dP, the
// transitions, e, dq) never leave the warp. The products that sum over the chunk's query rows
// (what keys and transitions receive: dv, dK~, dW, dU, and the diagonal tile's dk and dM) read
// both operands from shared memory; warp w then owns rows 16 w .. of the [64 x 64] result and
// adds it to the slice's float sums, one thread an element, in a fixed order (the same bits on
// every run). Operands are bfloat16 in two parts (collective/split_mma.cuh); inputs in bfloat16
// take one, half inputs two (11 bits do not fit one bfloat16).

#include <cstdint>
#include <type_traits>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/split_mma.cuh"
#include "attnmix/cuda/kernels/path_backward_simt.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

namespace path_bwd_mma {

using L = path_bwd_mma_layout;
constexpr int C = L::C, ld = L::ld;

// The CTA stages a [C][64] tile into (hi, lo): element (r, c) = at(r, c) for r < rows and
// c < cols, else 0; lo (when Lo) holds what hi's rounding left. Every load is issued before the
// first conversion, so that they are in flight together.
template <bool Lo, class F>
__device__ __forceinline__ void stage(split_op* hi, split_op* lo, F&& at, int rows, int cols) {
  constexpr int per_thread = C * 32 / L::threads;
  float x[per_thread][2];
#pragma unroll
  for (int k = 0; k < per_thread; ++k) {
    const int i = int(threadIdx.x) + k * L::threads, r = i >> 5, c = 2 * (i & 31);
    x[k][0] = r < rows && c < cols ? at(r, c) : 0.f;
    x[k][1] = r < rows && c + 1 < cols ? at(r, c + 1) : 0.f;
  }
#pragma unroll
  for (int k = 0; k < per_thread; ++k) {
    const int i = int(threadIdx.x) + k * L::threads, r = i >> 5, c = 2 * (i & 31);
    std::uint32_t h, l;
    if constexpr (Lo) {
      split2(x[k][0], x[k][1], h, l);
      *reinterpret_cast<std::uint32_t*>(lo + r * ld + c) = l;
    } else {
      h = pack2<split_op>(x[k][0], x[k][1]);
    }
    *reinterpret_cast<std::uint32_t*>(hi + r * ld + c) = h;
  }
}

// A warp's accumulator tile (rows r0 ..) into (hi, lo); rows from `rows` on as 0.
__device__ __forceinline__ void store_split(float (&acc)[8][4], split_op* hi, split_op* lo, int r0,
                                            int rows) {
  for_fragment_pairs(acc, r0, [&](int r, int c, float x0, float x1) {
    std::uint32_t h = 0u, l = 0u;
    if (r < rows) split2(x0, x1, h, l);
    *reinterpret_cast<std::uint32_t*>(hi + r * ld + c) = h;
    *reinterpret_cast<std::uint32_t*>(lo + r * ld + c) = l;
  });
}

// dst[r][c] += sign * acc for the rows r < rows of a warp's tile (dst rows of ldd floats). Every
// load is issued before the first store, so that they are in flight together.
__device__ __forceinline__ void add_rows(float (&acc)[8][4], float* dst, int ldd, int r0, int rows,
                                         float sign) {
  const int lane = threadIdx.x % 32, g = lane >> 2, c = 2 * (lane & 3);
  float2 old[8][2];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = r0 + g + 8 * hh;
      old[nt][hh] = r < rows ? *reinterpret_cast<const float2*>(dst + r * ldd + 8 * nt + c)
                             : make_float2(0.f, 0.f);
    }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = r0 + g + 8 * hh;
      if (r < rows)
        *reinterpret_cast<float2*>(dst + r * ldd + 8 * nt + c) = make_float2(
            old[nt][hh].x + sign * acc[nt][2 * hh], old[nt][hh].y + sign * acc[nt][2 * hh + 1]);
    }
}

// A warp's tile to / from float rows (rows r < rows; others read as 0).
__device__ __forceinline__ void save_rows(float (&acc)[8][4], float* dst, int ldd, int r0,
                                          int rows) {
  for_fragment_pairs(acc, r0, [&](int r, int c, float x0, float x1) {
    if (r < rows) *reinterpret_cast<float2*>(dst + r * ldd + c) = make_float2(x0, x1);
  });
}
__device__ __forceinline__ void load_rows(float (&acc)[8][4], const float* src, int ldd, int r0,
                                          int rows) {
  for_fragment_pairs(acc, r0, [&](int r, int c, float& x0, float& x1) {
    float2 v = make_float2(0.f, 0.f);
    if (r < rows) v = *reinterpret_cast<const float2*>(src + r * ldd + c);
    x0 = v.x, x1 = v.y;
  });
}

// Asks L2 for rows [0, rows) of `cols` elements (row stride `stride` elements) from base: the
// tiles of the next step, fetched while this one computes (a CTA streams far more than L2 holds).
template <class E>
__device__ __forceinline__ void prefetch_rows(const E* base, index_t stride, int rows, int cols) {
  const int bytes = cols * int(sizeof(E)), lines = (bytes + 127) / 128 + 1;
  for (int i = threadIdx.x; i < rows * lines; i += L::threads) {
    const int r = i / lines, l = i % lines;
    const int at = l * 128 < bytes ? l * 128 : bytes - 1;  // the row's last byte: its last line
    prefetch_l2(reinterpret_cast<const char*>(base + r * stride) + at);
  }
}

__device__ __forceinline__ void zero(float (&acc)[8][4]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

}  // namespace path_bwd_mma

template <class T>
__global__ void __launch_bounds__(path_bwd_mma_layout::threads, 1)
    path_backward_query_mma_kernel(const path_backward_params p) {
  namespace pm = path_bwd_mma;
  using L = path_bwd_mma_layout;
  constexpr int C = L::C, D = C, Dv = C, ld = L::ld, lf = L::lf;
  constexpr bool in_lo = std::is_same_v<T, __half>;  // half inputs: two bfloat16 parts
  extern __shared__ __align__(16) unsigned char smem_raw[];
  split_op* tiles = reinterpret_cast<split_op*>(smem_raw);
  const auto hi = [&](int s) {
    return tiles + 2 * s * L::tile;
  };
  const auto lo = [&](int s) {
    return tiles + (2 * s + 1) * L::tile;
  };
  float* dzf = reinterpret_cast<float*>(tiles + 2 * L::slots * L::tile);  // [C][lf]
  float* lse_s = dzf + C * lf;
  float* delta_s = lse_s + C;
  float* gi_s = delta_s + C;
  int* reset_s = reinterpret_cast<int*>(gi_s + C);
  float* gj_s = reinterpret_cast<float*>(reset_s + C);

  const path_kernel_params& kp = p.kp;
  const int warp = threadIdx.x / 32, m0 = 16 * warp;
  const int slice = blockIdx.x, h = blockIdx.y;
  index_t batch, start, length;
  kp.a.sequence(blockIdx.z, batch, start, length);
  if (length <= 0) return;
  const index_t chunks = (length + C - 1) / C;
  index_t lo_chunk, hi_chunk;
  path_backward_slice(chunks, p.slices, slice, lo_chunk, hi_chunk);
  if (lo_chunk >= hi_chunk) return;

  const int group = kp.a.group;
  const index_t row0 = kp.row(batch, h, start);
  const float* KT = static_cast<const float*>(kp.kt) + row0 * D;
  const float* UU = static_cast<const float*>(kp.u) + row0 * D;
  const float* MM = static_cast<const float*>(kp.m) + row0 * C;
  const float* W = kp.w + batch * kp.w_stride[0] + start * kp.w_stride[1] + h * kp.w_stride[2];
  const index_t ws1 = kp.w_stride[1];
  const T* K = static_cast<const T*>(kp.a.k) + batch * kp.a.k_stride[0] + start * kp.a.k_stride[1] +
               h * kp.a.k_stride[2];
  const index_t ks1 = kp.a.k_stride[1];
  const T* V = static_cast<const T*>(kp.a.v) + batch * kp.a.v_stride[0] + start * kp.a.v_stride[1] +
               h * kp.a.v_stride[2];
  const index_t vs1 = kp.a.v_stride[1];
  float* dkt = p.dkt + slice * p.slice_d + row0 * D;
  float* dws = p.dws + slice * p.slice_d + row0 * D;
  float* dus = p.dus + slice * p.slice_d + row0 * D;
  float* states = p.states + slice * p.slice_d + row0 * D;
  float* es = p.e + slice * p.slice_d + row0 * D;
  float* dvs = p.dvs + slice * p.slice_dv + row0 * Dv;
  float* dkd = p.dk_diag + row0 * D;
  float* dm = p.dm + row0 * C;
  const float scale = p.scale;
  const index_t HQ = kp.a.q_heads;

  // Tiles of a chunk starting at token j0 with `rows` rows.
  const auto stage_w = [&](index_t j0, int rows) {
    pm::stage<true>(
        hi(L::w), lo(L::w), [&](int r, int c) { return W[(j0 + r) * ws1 + c]; }, rows, D);
  };
  const auto stage_u = [&](index_t j0, int rows) {
    pm::stage<true>(
        hi(L::u), lo(L::u), [&](int r, int c) { return UU[(j0 + r) * D + c]; }, rows, D);
  };
  const auto stage_v = [&](index_t j0, int rows) {
    pm::stage<in_lo>(
        hi(L::v), lo(L::v), [&](int r, int c) { return to_float(V[(j0 + r) * vs1 + c]); }, rows,
        Dv);
  };

  // What the walk's and the adjoint's step at chunk j0 read: asked of L2 a step ahead.
  const auto prefetch_walk = [&](index_t j0) {
    pm::prefetch_rows(KT + j0 * D, D, C, D);
    pm::prefetch_rows(V + j0 * vs1, vs1, C, Dv);
    pm::prefetch_rows(W + j0 * ws1, ws1, C, D);
    pm::prefetch_rows(UU + j0 * D, D, C, D);
    pm::prefetch_rows(dvs + j0 * Dv, Dv, C, Dv);
    pm::prefetch_rows(dkt + j0 * D, D, C, D);
  };
  const auto prefetch_adjoint = [&](index_t j0) {
    pm::prefetch_rows(W + j0 * ws1, ws1, C, D);
    pm::prefetch_rows(UU + j0 * D, D, C, D);
    pm::prefetch_rows(states + j0 * D, D, C, D);
    pm::prefetch_rows(es + j0 * D, D, C, D);
    pm::prefetch_rows(dus + j0 * D, D, C, D);
    pm::prefetch_rows(dws + j0 * D, D, C, D);
  };

  for (int hq = h * group; hq < (h + 1) * group; ++hq) {
    const T* Q = static_cast<const T*>(kp.a.q) + batch * kp.a.q_stride[0] +
                 start * kp.a.q_stride[1] + hq * kp.a.q_stride[2];
    const T* O = static_cast<const T*>(p.out) + batch * p.out_stride[0] + start * p.out_stride[1] +
                 hq * p.out_stride[2];
    const T* dO = static_cast<const T*>(p.dout) + batch * p.dout_stride[0] +
                  start * p.dout_stride[1] + hq * p.dout_stride[2];
    const index_t qs1 = kp.a.q_stride[1], os1 = p.out_stride[1], dos1 = p.dout_stride[1];
    const index_t gate_at = (batch * kp.a.tokens + start) * HQ + hq;  // token 0
    const double* G = p.G != nullptr ? p.G + gate_at : nullptr;
    const std::int32_t* R = p.reset != nullptr ? p.reset + gate_at : nullptr;
    double* dG = p.dgate != nullptr ? p.dgate + slice * p.slice_gate + gate_at : nullptr;

    for (index_t ci = lo_chunk; ci < hi_chunk; ++ci) {
      const index_t c0 = ci * C;
      const int n = length - c0 < C ? static_cast<int>(length - c0) : C;
      const double g_ref = G != nullptr ? G[c0 * HQ] : 0.0;

      // The keys' gate terms of the chunk starting at j0.
      const auto stage_gate = [&](index_t j0, int cols) {
        if (G == nullptr) return;
        for (int j = threadIdx.x; j < C; j += L::threads)
          gj_s[j] = j < cols ? static_cast<float>(p.coef * (G[(j0 + j) * HQ] - g_ref)) : 0.f;
      };
      // p and dZ of a tile in place of its scores s and dP; diag: the causal mask.
      const auto softmax_bwd = [&](float(&s)[8][4], float(&dp)[8][4], index_t j0, int cols,
                                   bool diag) {
        const int lane = threadIdx.x % 32, g = lane >> 2, c2 = 2 * (lane & 3);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int a = m0 + g + (e >= 2 ? 8 : 0), j = 8 * nt + c2 + (e & 1);
            float pv = 0.f, dzv = 0.f;
            if (a < n && j < cols && (!diag || j <= a) && j0 + j >= reset_s[a]) {
              float z = s[nt][e];
              if (G != nullptr) z += gi_s[a] - gj_s[j];
              pv = expf(z - lse_s[a]);
              dzv = pv * (dp[nt][e] - delta_s[a]);
            }
            s[nt][e] = pv;
            dp[nt][e] = dzv;
          }
      };
      // dG of the rows (+ their sums) and of the keys (- theirs), rows first: the diagonal
      // tile's keys are its rows.
      const auto gate_sums = [&](float(&dz)[8][4], index_t j0, int cols) {
        if (dG == nullptr) return;
        const int lane = threadIdx.x % 32, g = lane >> 2;
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          rs[0] += dz[nt][0] + dz[nt][1];
          rs[1] += dz[nt][2] + dz[nt][3];
        }
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
          rs[0] += __shfl_xor_sync(0xffffffffu, rs[0], o);
          rs[1] += __shfl_xor_sync(0xffffffffu, rs[1], o);
        }
        if ((lane & 3) == 0)
          for (int hh = 0; hh < 2; ++hh) {
            const int a = m0 + g + 8 * hh;
            if (a < n) dG[(c0 + a) * HQ] += p.coef * static_cast<double>(rs[hh]);
          }
        for_fragment_pairs(dz, m0, [&](int r, int c, float x0, float x1) {
          dzf[r * lf + c] = x0;
          dzf[r * lf + c + 1] = x1;
        });
        __syncthreads();
        for (int j = threadIdx.x; j < cols; j += L::threads) {
          float cs = 0.f;
          for (int a = 0; a < n; ++a) cs += dzf[a * lf + j];
          dG[(j0 + j) * HQ] -= p.coef * static_cast<double>(cs);
        }
      };

      __syncthreads();  // the chunk before is done with every tile
      for (int a = threadIdx.x; a < C; a += L::threads) {
        float dl = 0.f, l = 0.f, gg = 0.f;
        int rs = 0;
        if (a < n) {
          for (int e = 0; e < Dv; ++e)
            dl += to_float(dO[(c0 + a) * dos1 + e]) * to_float(O[(c0 + a) * os1 + e]);
          l = p.lse[batch * p.lse_stride[0] + (start + c0 + a) * p.lse_stride[1] +
                    hq * p.lse_stride[2]];
          if (G != nullptr) gg = static_cast<float>(p.coef * (G[(c0 + a) * HQ] - g_ref));
          if (R != nullptr) rs = R[(c0 + a) * HQ];
        }
        delta_s[a] = dl, lse_s[a] = l, gi_s[a] = gg, reset_s[a] = rs;
      }
      pm::stage<true>(
          hi(L::q), lo(L::q), [&](int r, int c) { return scale * to_float(Q[(c0 + r) * qs1 + c]); },
          n, D);
      pm::stage<in_lo>(
          hi(L::dout), lo(L::dout), [&](int r, int c) { return to_float(dO[(c0 + r) * dos1 + c]); },
          n, Dv);
      pm::stage<in_lo>(
          hi(L::k), lo(L::k), [&](int r, int c) { return to_float(K[(c0 + r) * ks1 + c]); }, n, D);
      stage_v(c0, n);
      stage_w(c0, n);
      stage_u(c0, n);
      pm::stage<true>(
          hi(L::m), lo(L::m), [&](int r, int c) { return MM[(c0 + r) * C + c]; }, n, n);
      stage_gate(c0, n);
      if (ci > 0) prefetch_walk(c0 - C);
      __syncthreads();

      const a_from_tile<ld, true> qa{hi(L::q), lo(L::q), m0};
      const a_from_tile<ld, in_lo> doa{hi(L::dout), lo(L::dout), m0};
      const auto tril_mask = [&](float(&x)[8][4]) {  // keep (a, c) for c <= a < n
        for_fragment_pairs(x, m0, [&](int a, int c, float& x0, float& x1) {
          if (!(a < n && c <= a)) x0 = 0.f;
          if (!(a < n && c + 1 <= a)) x1 = 0.f;
        });
      };

      // ---- 1. the diagonal tile: z = tril(Qs K^T - tril(Qs W^T) M) (+ gate) ----
      float dq[8][4];
      {
        float x[8][4], s[8][4], dp[8][4];
        pm::zero(x);
        warp_mma<ld, false, true>(x, qa, hi(L::w), lo(L::w));
        tril_mask(x);
        pm::store_split(x, hi(L::x), lo(L::x), m0, n);
        pm::zero(s);
        warp_mma<ld, false, in_lo>(s, qa, hi(L::k), lo(L::k));
        warp_mma<ld, true, true>(s, a_from_regs{x, -1.f}, hi(L::m), lo(L::m));
        pm::zero(dp);
        warp_mma<ld, false, in_lo>(dp, doa, hi(L::v), lo(L::v));
        softmax_bwd(s, dp, c0, n, true);
        pm::store_split(s, hi(L::e1), lo(L::e1), m0, n);
        pm::store_split(dp, hi(L::e2), lo(L::e2), m0, n);
        // dQs = dZ K; dX = -dZ M^T (tril); dQs += dX W.
        pm::zero(dq);
        warp_mma<ld, true, in_lo>(dq, a_from_regs{dp, 1.f}, hi(L::k), lo(L::k));
        pm::zero(x);
        warp_mma<ld, false, true>(x, a_from_regs{dp, -1.f}, hi(L::m), lo(L::m));
        tril_mask(x);
        warp_mma<ld, true, true>(dq, a_from_regs{x, 1.f}, hi(L::w), lo(L::w));
        __syncthreads();
        gate_sums(dp, c0, n);
        float acc[8][4];
        pm::zero(acc);  // dv += P^T dO
        warp_mma<ld, true, in_lo>(acc, a_from_tile_t<ld, true>{hi(L::e1), lo(L::e1), m0},
                                  hi(L::dout), lo(L::dout));
        pm::add_rows(acc, dvs + c0 * Dv, Dv, m0, n, 1.f);
        pm::zero(acc);  // dk += dZ^T Qs
        warp_mma<ld, true, true>(acc, a_from_tile_t<ld, true>{hi(L::e2), lo(L::e2), m0}, hi(L::q),
                                 lo(L::q));
        pm::add_rows(acc, dkd + c0 * D, D, m0, n, 1.f);
        pm::zero(acc);  // dM -= X^T dZ
        warp_mma<ld, true, true>(acc, a_from_tile_t<ld, true>{hi(L::x), lo(L::x), m0}, hi(L::e2),
                                 lo(L::e2));
        pm::add_rows(acc, dm + c0 * C, C, m0, n, -1.f);
        __syncthreads();  // P is read: its tile takes dX
        pm::store_split(x, hi(L::e1), lo(L::e1), m0, n);
        __syncthreads();
        pm::zero(acc);  // dW += dX^T Qs
        warp_mma<ld, true, true>(acc, a_from_tile_t<ld, true>{hi(L::e1), lo(L::e1), m0}, hi(L::q),
                                 lo(L::q));
        pm::add_rows(acc, dws + c0 * D, D, m0, n, 1.f);
      }
      // dQs waits in the scan states' rows of this chunk, which the walk never writes.
      pm::save_rows(dq, states + c0 * D, D, m0, n);

      if (ci > 0) {
        // ---- 2. the forward's walk, keeping each chunk's scan state r and e = dZ K~ ----
        float r[8][4];
        for_fragment_pairs(r, m0, [&](int a, int c, float& x0, float& x1) {
          x0 = a < n ? scale * to_float(Q[(c0 + a) * qs1 + c]) : 0.f;
          x1 = a < n ? scale * to_float(Q[(c0 + a) * qs1 + c + 1]) : 0.f;
        });
        warp_mma<ld, true, true>(r, a_from_tile<ld, true, true>{hi(L::x), lo(L::x), m0}, hi(L::u),
                                 lo(L::u));
        for (index_t cj = ci - 1; cj >= 0; --cj) {
          const index_t j0 = cj * C;  // earlier chunks are full
          __syncthreads();
          pm::stage<true>(
              hi(L::k), lo(L::k), [&](int rr, int c) { return KT[(j0 + rr) * D + c]; }, C, D);
          stage_v(j0, C);
          if (cj > 0) {
            stage_w(j0, C);
            stage_u(j0, C);
          }
          stage_gate(j0, C);
          if (cj > 0) prefetch_walk(j0 - C);
          pm::save_rows(r, states + j0 * D, D, m0, n);
          __syncthreads();
          float s[8][4], dp[8][4];
          pm::zero(s);
          warp_mma<ld, false, true>(s, a_from_regs{r, 1.f}, hi(L::k), lo(L::k));
          pm::zero(dp);
          warp_mma<ld, false, in_lo>(dp, doa, hi(L::v), lo(L::v));
          softmax_bwd(s, dp, j0, C, false);
          pm::store_split(s, hi(L::e1), lo(L::e1), m0, n);
          pm::store_split(dp, hi(L::e2), lo(L::e2), m0, n);
          pm::store_split(r, hi(L::e3), lo(L::e3), m0, n);
          {  // e = dZ K~ (row-local)
            float e[8][4];
            pm::zero(e);
            warp_mma<ld, true, true>(e, a_from_regs{dp, 1.f}, hi(L::k), lo(L::k));
            pm::save_rows(e, es + j0 * D, D, m0, n);
          }
          if (cj > 0) {  // r <- r P_cj = r - (r W^T) U
            float xx[8][4];
            pm::zero(xx);
            warp_mma<ld, false, true>(xx, a_from_regs{r, 1.f}, hi(L::w), lo(L::w));
            warp_mma<ld, true, true>(r, a_from_regs{xx, -1.f}, hi(L::u), lo(L::u));
          }
          __syncthreads();
          gate_sums(dp, j0, C);
          float acc[8][4];
          pm::zero(acc);  // dv += P^T dO
          warp_mma<ld, true, in_lo>(acc, a_from_tile_t<ld, true>{hi(L::e1), lo(L::e1), m0},
                                    hi(L::dout), lo(L::dout));
          pm::add_rows(acc, dvs + j0 * Dv, Dv, m0, C, 1.f);
          pm::zero(acc);  // dK~ += dZ^T r
          warp_mma<ld, true, true>(acc, a_from_tile_t<ld, true>{hi(L::e2), lo(L::e2), m0},
                                   hi(L::e3), lo(L::e3));
          pm::add_rows(acc, dkt + j0 * D, D, m0, C, 1.f);
        }

        // ---- 3. the adjoint: rbar_cj = e_cj + rbar_(cj-1) P_cj^T with P = I - W^T U;
        // dU -= (r W^T)^T rbar, dW -= (rbar U^T)^T r ----
        float rbar[8][4];
        pm::load_rows(rbar, es, D, m0, n);
        for (index_t cj = 1; cj < ci; ++cj) {
          const index_t j0 = cj * C;
          __syncthreads();
          stage_w(j0, C);
          stage_u(j0, C);
          if (cj + 1 < ci) prefetch_adjoint(j0 + C);
          pm::load_rows(r, states + j0 * D, D, m0, n);
          pm::store_split(r, hi(L::e3), lo(L::e3), m0, n);
          __syncthreads();
          float xs[8][4], y[8][4];
          pm::zero(xs);
          warp_mma<ld, false, true>(xs, a_from_regs{r, 1.f}, hi(L::w), lo(L::w));
          pm::zero(y);
          warp_mma<ld, false, true>(y, a_from_regs{rbar, 1.f}, hi(L::u), lo(L::u));
          pm::store_split(xs, hi(L::e1), lo(L::e1), m0, n);
          pm::store_split(rbar, hi(L::e2), lo(L::e2), m0, n);
          pm::store_split(y, hi(L::k), lo(L::k), m0, n);
          {
            float e[8][4];
            pm::load_rows(e, es + j0 * D, D, m0, n);
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
              for (int jj = 0; jj < 4; ++jj) rbar[i][jj] += e[i][jj];
          }
          warp_mma<ld, true, true>(rbar, a_from_regs{y, -1.f}, hi(L::w), lo(L::w));
          __syncthreads();
          float acc[8][4];
          pm::zero(acc);  // dU -= (r W^T)^T rbar
          warp_mma<ld, true, true>(acc, a_from_tile_t<ld, true>{hi(L::e1), lo(L::e1), m0},
                                   hi(L::e2), lo(L::e2));
          pm::add_rows(acc, dus + j0 * D, D, m0, C, -1.f);
          pm::zero(acc);  // dW -= (rbar U^T)^T r
          warp_mma<ld, true, true>(acc, a_from_tile_t<ld, true>{hi(L::k), lo(L::k), m0}, hi(L::e3),
                                   lo(L::e3));
          pm::add_rows(acc, dws + j0 * D, D, m0, C, -1.f);
        }

        // ---- the chunk's own transform, Q~ = Qs - tril(Qs W^T) U: dQs += rbar,
        // dX = -tril(rbar U^T), dU -= X^T rbar; then dQs += dX W and dW += dX^T Qs ----
        __syncthreads();
        stage_w(c0, n);
        stage_u(c0, n);
        pm::store_split(rbar, hi(L::e2), lo(L::e2), m0, n);
        __syncthreads();
        pm::load_rows(dq, states + c0 * D, D, m0, n);
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) dq[i][jj] += rbar[i][jj];
        float x[8][4];
        pm::zero(x);
        warp_mma<ld, false, true>(x, a_from_regs{rbar, -1.f}, hi(L::u), lo(L::u));
        tril_mask(x);
        warp_mma<ld, true, true>(dq, a_from_regs{x, 1.f}, hi(L::w), lo(L::w));
        pm::store_split(x, hi(L::e1), lo(L::e1), m0, n);
        __syncthreads();
        float acc[8][4];
        pm::zero(acc);  // dU -= X^T rbar
        warp_mma<ld, true, true>(acc, a_from_tile_t<ld, true>{hi(L::x), lo(L::x), m0}, hi(L::e2),
                                 lo(L::e2));
        pm::add_rows(acc, dus + c0 * D, D, m0, n, -1.f);
        pm::zero(acc);  // dW += dX^T Qs
        warp_mma<ld, true, true>(acc, a_from_tile_t<ld, true>{hi(L::e1), lo(L::e1), m0}, hi(L::q),
                                 lo(L::q));
        pm::add_rows(acc, dws + c0 * D, D, m0, n, 1.f);
      } else {
        pm::load_rows(dq, states + c0 * D, D, m0, n);
      }
      for_fragment_pairs(dq, m0, [&](int a, int c, float x0, float x1) {
        if (a >= n) return;
        T* at = static_cast<T*>(p.dq) + batch * p.dq_stride[0] + (start + c0 + a) * p.dq_stride[1] +
                hq * p.dq_stride[2] + c;
        at[0] = from_float<T>(scale * x0);
        at[1] = from_float<T>(scale * x1);
      });
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
