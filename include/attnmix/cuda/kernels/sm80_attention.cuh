#pragma once
// FlashAttention-2-style softmax-family kernel on tensor cores (mma.sync m16n8k16, sm_80+):
// a CTA owns Br = 16 * MTiles * Warps query rows of one (sequence, query head), each warp
// 16 * MTiles of them (more rows per warp reuse every K and V fragment read from shared memory);
// it streams Bc-key tiles of K and V through double-buffered, swizzled shared memory with
// cp.async, computes S = Q K^T and O += P V with float accumulators, and keeps the online
// softmax in base 2. Inputs are __half or __nv_bfloat16; D and Dv are 64 or 128.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/attention_tiles.cuh"
#include "attnmix/cuda/kernels/attention_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <int D, int Dv, int Warps, int MTiles, int Bc>
struct mma_tile {
  static_assert(D % 64 == 0 && Dv % 64 == 0, "head dims must be multiples of 64 (the swizzle)");
  static constexpr int threads = 32 * Warps;
  static constexpr int br = 16 * MTiles * Warps;
  static constexpr int bc = Bc;
  // Shared memory, in elements: Q, then two K buffers, then two V buffers.
  static constexpr int q_elems = br * D, k_elems = Bc * D, v_elems = Bc * Dv;
  static constexpr int smem_bytes = 2 * (q_elems + 2 * k_elems + 2 * v_elems);
};

template <class T, int D, int Dv, int Warps, int MTiles, int Bc>
__global__ void __launch_bounds__(32 * Warps)
    attention_mma_kernel(const attention_kernel_params p, const int row_tiles) {
  using tile = mma_tile<D, Dv, Warps, MTiles, Bc>;
  constexpr int Br = tile::br, MT = MTiles;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sq = reinterpret_cast<T*>(smem_raw);
  T* sk = sq + tile::q_elems;
  T* sv = sk + 2 * tile::k_elems;
  __shared__ float gate_col[Bc];  // the current key tile's gate terms

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, c2 = 2 * (lane % 4);
  // One CTA per item of attention_work (row tiles first, so that the CTAs that run together
  // share one head's K and V in L2).
  attention_work w{};
  if (!w.decode<Br, Bc>(p, static_cast<int>(blockIdx.x), row_tiles)) return;
  const index_t batch = w.batch, start = w.start, i0 = w.i0, rows = w.rows;
  const index_t j_lo = w.j_lo, j_hi = w.j_hi, lo_last = w.lo_last, hi_first = w.hi_first;
  const int hq = w.hq, key_tiles = w.key_tiles;

  const T* q = static_cast<const T*>(p.q) + batch * p.q_stride[0] + (start + i0) * p.q_stride[1] +
               hq * p.q_stride[2];
  const T* k = static_cast<const T*>(p.k) + w.kbatch * p.k_stride[0] + w.kstart * p.k_stride[1] +
               w.hkv * p.k_stride[2];
  const T* v = static_cast<const T*>(p.v) + w.kbatch * p.v_stride[0] + w.kstart * p.v_stride[1] +
               w.hkv * p.v_stride[2];

  {
    const tile_loader<Br, D, tile::threads> q_loader(p.q_stride[1]);
    q_loader.load(sq, q, rows, q);
  }
  const tile_loader<Bc, D, tile::threads> k_loader(p.k_stride[1]);
  const tile_loader<Bc, Dv, tile::threads> v_loader(p.v_stride[1]);
  auto load_kv = [&](int t, int buf) {
    const index_t j0 = j_lo + static_cast<index_t>(t) * Bc;
    k_loader.load(sk + buf * tile::k_elems, k + j0 * p.k_stride[1], j_hi + 1 - j0, k);
    v_loader.load(sv + buf * tile::v_elems, v + j0 * p.v_stride[1], j_hi + 1 - j0, v);
  };
  load_kv(0, 0);
  cp_async_commit();

  // This thread's rows: row(mt, h) = warp * 16 * MT + mt * 16 + g + 8 * h.
  auto row_of = [&](int mt, int h) {
    return warp * 16 * MT + mt * 16 + g + 8 * h;
  };

  // Gate bias relative to G at i0 (in double), so that the float values stay small.
  const double* G = w.G;
  const double g_ref = w.g_ref;
  float gate_row[MT][2] = {};
  if (G != nullptr) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        gate_row[mt][h] = w.gate(p, i0 + row_of(mt, h));
      }
  }

  float o[MT][Dv / 8][4] = {};
  float m[MT][2], l[MT][2] = {};
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY;
  std::uint32_t qf[MT][D / 16][4];

  for (int t = 0; t < key_tiles; ++t) {
    const int buf = t % 2;
    if (t + 1 < key_tiles) load_kv(t + 1, buf ^ 1);
    cp_async_commit();
    const index_t j0 = j_lo + static_cast<index_t>(t) * Bc;
    if (G != nullptr && threadIdx.x < Bc) {
      gate_col[threadIdx.x] = gate_term(p, G, g_ref, j0 + threadIdx.x, w.klength);
    }
    cp_async_wait<1>();
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          ldmatrix_x4(qf[mt][kk],
                      sq + swizzle<D>(warp * 16 * MT + mt * 16 + lane % 16, kk * 2 + lane / 16));
    }
    const T* skb = sk + buf * tile::k_elems;
    const T* svb = sv + buf * tile::v_elems;

    // S = Q K^T for this warp's rows and Bc keys; each K fragment serves all MT row tiles.
    float s[MT][Bc / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < Bc / 16; ++n) {
        std::uint32_t b[4];
        ldmatrix_x4(b,
                    skb + swizzle<D>(n * 16 + lane % 8 + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
        const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(s[mt][2 * n], qf[mt][kk], b0);
          mma_16816<T>(s[mt][2 * n + 1], qf[mt][kk], b1);
        }
      }
    }

    // Logits in base 2 and the gate bias; the mask only on tiles that cross an edge.
    const bool gated = G != nullptr;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < Bc / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[mt][n][e] = s[mt][n][e] * p.scale_log2 +
                        (gated ? gate_row[mt][e / 2] - gate_col[n * 8 + c2 + e % 2] : 0.f);
    if (j0 + Bc - 1 > hi_first || j0 < lo_last) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          index_t lo, hi;
          w.key_range(p, i0 + row_of(mt, h), lo, hi);
          // Visible columns of this tile for the row, relative to this thread's first column.
          const int first = static_cast<int>(max(min(lo - j0, index_t{Bc}), index_t{-1})) - c2;
          const int last = static_cast<int>(max(min(hi - j0, index_t{Bc}), index_t{-1})) - c2;
#pragma unroll
          for (int n = 0; n < Bc / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = n * 8 + e;
              if (col < first || col > last) s[mt][n][2 * h + e] = -INFINITY;
            }
        }
    }

    // Online softmax: row maxima across the quad that shares a row.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float rescale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m[mt][h];
#pragma unroll
        for (int n = 0; n < Bc / 8; ++n)
          mx = fmaxf(mx, fmaxf(s[mt][n][2 * h], s[mt][n][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float shift = mx == -INFINITY ? 0.f : mx;  // no visible key yet: keep zeros
        rescale[h] = fast_exp2(m[mt][h] - shift);
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < Bc / 8; ++n) {
          s[mt][n][2 * h] = fast_exp2(s[mt][n][2 * h] - shift);
          s[mt][n][2 * h + 1] = fast_exp2(s[mt][n][2 * h + 1] - shift);
          sum += s[mt][n][2 * h] + s[mt][n][2 * h + 1];
        }
        l[mt][h] =
            l[mt][h] * rescale[h] + sum;  // per-thread partial; the quad is summed at the end
        m[mt][h] = mx;
      }
#pragma unroll
      for (int n = 0; n < Dv / 8; ++n) {
        o[mt][n][0] *= rescale[0], o[mt][n][1] *= rescale[0];
        o[mt][n][2] *= rescale[1], o[mt][n][3] *= rescale[1];
      }
    }

    // O += P V, P taken straight from the S accumulators (their layout is the A fragment's).
#pragma unroll
    for (int kc = 0; kc < Bc / 16; ++kc) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<T>(s[mt][2 * kc][0], s[mt][2 * kc][1]);
        a[mt][1] = pack2<T>(s[mt][2 * kc][2], s[mt][2 * kc][3]);
        a[mt][2] = pack2<T>(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
        a[mt][3] = pack2<T>(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
      }
#pragma unroll
      for (int n = 0; n < Dv / 16; ++n) {
        std::uint32_t b[4];
        ldmatrix_x4_trans(
            b, svb + swizzle<Dv>(kc * 16 + lane % 8 + ((lane / 8) % 2) * 8, n * 2 + lane / 16));
        const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(o[mt][2 * n], a[mt], b0);
          mma_16816<T>(o[mt][2 * n + 1], a[mt], b1);
        }
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this buffer
  }

  T* out = static_cast<T*>(p.out) + batch * p.out_stride[0] + (start + i0) * p.out_stride[1] +
           hq * p.out_stride[2];
  float* lse = p.lse != nullptr ? p.lse + batch * p.lse_stride[0] + (start + i0) * p.lse_stride[1] +
                                      hq * p.lse_stride[2]
                                : nullptr;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    store_output_rows<T, Dv>(out, p.out_stride[1], lse, p.lse_stride[1], row_of(mt, 0), rows,
                             &o[mt][0][0], m[mt], l[mt]);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
