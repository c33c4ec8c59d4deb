#pragma once
// FlashAttention-2-style softmax-family kernel on tensor cores (mma.sync m16n8k16, sm_80+):
// a CTA owns Br = 16 * Warps query rows of one (sequence, query head), each warp 16 of them;
// it streams Bc-key tiles of K and V through double-buffered, swizzled shared memory with
// cp.async, computes S = Q K^T and O += P V with float accumulators, and keeps the online
// softmax in base 2. Inputs are __half or __nv_bfloat16; D and Dv are 64 or 128.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/detail/attention_params.cuh"
#include "attnmix/cuda/detail/mma.cuh"
#include "attnmix/cuda/detail/types.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <int D, int Dv, int Warps, int Bc>
struct mma_tile {
  static_assert(D % 64 == 0 && Dv % 64 == 0, "head dims must be multiples of 64 (the swizzle)");
  static constexpr int threads = 32 * Warps;
  static constexpr int br = 16 * Warps;
  static constexpr int bc = Bc;
  // Shared memory, in elements: Q, then two K buffers, then two V buffers.
  static constexpr int q_elems = br * D, k_elems = Bc * D, v_elems = Bc * Dv;
  static constexpr int smem_bytes = 2 * (q_elems + 2 * k_elems + 2 * v_elems);
};

// Element offset of 16-byte chunk `c` of row `r` in a row-major tile of Cols elements. Chunks
// are XOR-swizzled by the row so that ldmatrix reads of 8 consecutive rows hit distinct banks.
template <int Cols>
__device__ __forceinline__ int swizzle(int r, int c) {
  return r * Cols + ((c ^ (r & 7)) * 8);
}

// Rows [0, Rows) of a tile: rows >= valid are zero-filled; `safe` is any readable address.
template <int Rows, int Cols, int Threads, class T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, index_t row_stride, index_t valid,
                                          const T* safe) {
  constexpr int chunks = Cols / 8;
#pragma unroll
  for (int idx = threadIdx.x; idx < Rows * chunks; idx += Threads) {
    const int r = idx / chunks, c = idx % chunks;
    const bool ok = r < valid;
    cp_async_16(smem + swizzle<Cols>(r, c), ok ? gmem + r * row_stride + c * 8 : safe, ok);
  }
}

template <class T, int D, int Dv, int Warps, int Bc>
__global__ void __launch_bounds__(32 * Warps)
    attention_mma_kernel(const attention_kernel_params p) {
  using tile = mma_tile<D, Dv, Warps, Bc>;
  constexpr int Br = tile::br;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sq = reinterpret_cast<T*>(smem_raw);
  T* sk = sq + tile::q_elems;
  T* sv = sk + 2 * tile::k_elems;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, c2 = 2 * (lane % 4);
  const int hq = blockIdx.x % p.q_heads, seq = blockIdx.x / p.q_heads;
  index_t batch, start, length;
  p.sequence(seq, batch, start, length);
  // Causal: the heaviest (last) tiles are scheduled first.
  const index_t tiles = (length + Br - 1) / Br;
  const index_t tile_index = p.causal ? static_cast<index_t>(gridDim.y) - 1 - blockIdx.y : blockIdx.y;
  if (tile_index >= tiles) return;
  const index_t i0 = tile_index * Br;
  const index_t rows = length - i0 < Br ? length - i0 : Br;
  const int hkv = hq / p.group;

  const T* q = static_cast<const T*>(p.q) + batch * p.q_stride[0] + (start + i0) * p.q_stride[1] +
               hq * p.q_stride[2];
  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride[0] + start * p.k_stride[1] +
               hkv * p.k_stride[2];
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride[0] + start * p.v_stride[1] +
               hkv * p.v_stride[2];

  // Keys any row of this tile may see.
  index_t j_lo, j_hi, lo_last, hi_first;
  p.key_range(i0 + rows - 1, length, lo_last, j_hi);
  p.key_range(i0, length, j_lo, hi_first);
  const int key_tiles = static_cast<int>((j_hi - j_lo + Bc) / Bc);

  load_tile<Br, D, tile::threads>(sq, q, p.q_stride[1], rows, q);
  auto load_kv = [&](int t, int buf) {
    const index_t j0 = j_lo + static_cast<index_t>(t) * Bc;
    load_tile<Bc, D, tile::threads>(sk + buf * tile::k_elems, k + j0 * p.k_stride[1],
                                    p.k_stride[1], j_hi + 1 - j0, k);
    load_tile<Bc, Dv, tile::threads>(sv + buf * tile::v_elems, v + j0 * p.v_stride[1],
                                     p.v_stride[1], j_hi + 1 - j0, v);
  };
  load_kv(0, 0);
  cp_async_commit();

  // Gate bias relative to G at i0 (in double), so that the float values stay small.
  const double* G = p.gate_cumsum != nullptr
                        ? p.gate_cumsum + (batch * p.tokens + start) * p.q_heads + hq
                        : nullptr;
  const double g_ref = G != nullptr ? G[i0 * p.q_heads] : 0.0;
  const int r0 = warp * 16 + g;  // this thread's rows: r0 and r0 + 8
  float gate_row[2] = {0.f, 0.f};
  if (G != nullptr) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const index_t i = i0 + r0 + 8 * h < length ? i0 + r0 + 8 * h : length - 1;
      gate_row[h] = p.gate_coef_log2 * static_cast<float>(G[i * p.q_heads] - g_ref);
    }
  }

  float o[Dv / 8][4];
#pragma unroll
  for (int n = 0; n < Dv / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  std::uint32_t qf[D / 16][4];

  for (int t = 0; t < key_tiles; ++t) {
    const int buf = t % 2;
    if (t + 1 < key_tiles) load_kv(t + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], sq + swizzle<D>(warp * 16 + lane % 16, kk * 2 + lane / 16));
    }
    const T* skb = sk + buf * tile::k_elems;
    const T* svb = sv + buf * tile::v_elems;

    // S = Q K^T for this warp's 16 rows and Bc keys.
    float s[Bc / 8][4];
#pragma unroll
    for (int n = 0; n < Bc / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < Bc / 16; ++n) {
        std::uint32_t b[4];
        ldmatrix_x4(b, skb + swizzle<D>(n * 16 + lane % 8 + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
        const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816<T>(s[2 * n], qf[kk], b0);
        mma_16816<T>(s[2 * n + 1], qf[kk], b1);
      }
    }

    // Logits in base 2, the gate bias and the mask.
    const index_t j0 = j_lo + static_cast<index_t>(t) * Bc;
    const bool masked = j0 + Bc - 1 > hi_first || j0 < lo_last;
#pragma unroll
    for (int n = 0; n < Bc / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2;
        const index_t j = j0 + n * 8 + c2 + (e % 2);
        float z = s[n][e] * p.scale_log2;
        if (G != nullptr) {
          const index_t jj = j < length ? j : length - 1;
          z += gate_row[h] - p.gate_coef_log2 * static_cast<float>(G[jj * p.q_heads] - g_ref);
        }
        if (masked) {
          index_t lo, hi;
          p.key_range(i0 + r0 + 8 * h, length, lo, hi);
          if (j < lo || j > hi) z = -INFINITY;
        }
        s[n][e] = z;
      }
    }

    // Online softmax: row maxima across the quad that shares a row.
    float scale_o[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m[h];
#pragma unroll
      for (int n = 0; n < Bc / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float shift = mx == -INFINITY ? 0.f : mx;  // no visible key yet: keep zeros
      scale_o[h] = exp2f(m[h] - shift);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < Bc / 8; ++n) {
        s[n][2 * h] = exp2f(s[n][2 * h] - shift);
        s[n][2 * h + 1] = exp2f(s[n][2 * h + 1] - shift);
        sum += s[n][2 * h] + s[n][2 * h + 1];
      }
      l[h] = l[h] * scale_o[h] + sum;  // per-thread partial; the quad is summed at the end
      m[h] = mx;
    }
#pragma unroll
    for (int n = 0; n < Dv / 8; ++n) {
      o[n][0] *= scale_o[0], o[n][1] *= scale_o[0];
      o[n][2] *= scale_o[1], o[n][3] *= scale_o[1];
    }

    // O += P V, P taken straight from the S accumulators (their layout is the A fragment's).
#pragma unroll
    for (int kc = 0; kc < Bc / 16; ++kc) {
      const std::uint32_t a[4] = {pack2<T>(s[2 * kc][0], s[2 * kc][1]),
                                  pack2<T>(s[2 * kc][2], s[2 * kc][3]),
                                  pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                                  pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int n = 0; n < Dv / 16; ++n) {
        std::uint32_t b[4];
        ldmatrix_x4_trans(b, svb + swizzle<Dv>(kc * 16 + lane % 8 + ((lane / 8) % 2) * 8, n * 2 + lane / 16));
        const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816<T>(o[2 * n], a, b0);
        mma_16816<T>(o[2 * n + 1], a, b1);
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this buffer
  }

  // Epilogue: full row sums, normalise, write.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  T* out = static_cast<T*>(p.out) + batch * p.out_stride[0] + (start + i0) * p.out_stride[1] +
           hq * p.out_stride[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (r >= rows) continue;
    const float inv = 1.f / l[h];
    T* orow = out + r * p.out_stride[1];
#pragma unroll
    for (int n = 0; n < Dv / 8; ++n) {
      const int col = n * 8 + c2;
      orow[col] = from_float<T>(o[n][2 * h] * inv);
      orow[col + 1] = from_float<T>(o[n][2 * h + 1] * inv);
    }
    if (p.lse != nullptr && lane % 4 == 0)
      p.lse[batch * p.lse_stride[0] + (start + i0 + r) * p.lse_stride[1] + hq * p.lse_stride[2]] =
          (m[h] + log2f(l[h])) * 0.6931471805599453f;
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
