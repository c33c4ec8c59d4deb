#pragma once
// The softmax-family backward on tensor cores (mma.sync m16n8k16, sm_80 and later), half and
// bfloat16, D and Dv multiples of 32 up to 128: the CTAs, tiles, masks and sums of
// attention_backward_simt.cuh (whose delta and gate kernels it shares), with the five matrix
// products of a tile pair on tensor cores. The staged tiles hold the inputs' own 16-bit values
// as float, so packing them back is exact; P and dS, which are float, go in as two 16-bit
// parts (x = hi + lo: about 16 bits of each with bfloat16, 22 with half), so that rounding them
// adds next to nothing to the rounding of the outputs to T. 8 warps over 32 x 32
// tiles: the scores as 2 x 4 tiles of 16 x 8, a warp one each; the outputs (dk, dv: keys x
// dims; dq: rows x dims) as 16-row tiles mt = warp % 2 times 8-column tiles warp / 2 + 4 j.

#include <cstdint>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/collective/backward_tiles.cuh"
#include "attnmix/cuda/kernels/attention_backward_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// x, y as two packed 16-bit pairs hi + lo (lo: what rounding x, y to T left).
template <class T>
__device__ __forceinline__ void split_pair16(float x, float y, std::uint32_t& hi,
                                             std::uint32_t& lo) {
  hi = pack2<T>(x, y);
  const float2 h = unpack2<T>(hi);
  lo = pack2<T>(x - h.x, y - h.y);
}

// P and dS of the staged rows [i0, i0 + rows) and keys [j0, j0 + cols) into t.p and t.ds, as
// scores_to_ds does, with S = q k^T and dP = dout v^T on tensor cores.
template <class T, int B>
__device__ void scores_to_ds_mma(const attention_backward_params& p, const backward_tiles<B>& t,
                                 index_t length, index_t i0, int rows, index_t j0, int cols) {
  static_assert(B == 32 && attention_backward_threads == 256, "8 warps of 16 x 8 score tiles");
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, c2 = 2 * (lane % 4);
  const int r0 = 16 * (w / 4), n0 = 8 * (w % 4);  // the warp's rows and keys
  const int D = p.f.head_dim, Dv = p.f.value_dim;
  float s[4] = {0.f, 0.f, 0.f, 0.f}, dp[4] = {0.f, 0.f, 0.f, 0.f};
  const float* qa = t.q + (r0 + g) * t.qs + c2;  // A = q: rows r0 + g (+8), dims c2 (+8)
  const float* kb = t.k + (n0 + g) * t.qs + c2;  // B[d][n] = k[n][d]
  for (int kk = 0; kk < D; kk += 16) {
    const std::uint32_t a[4] = {
        pack2<T>(qa[kk], qa[kk + 1]), pack2<T>(qa[8 * t.qs + kk], qa[8 * t.qs + kk + 1]),
        pack2<T>(qa[kk + 8], qa[kk + 9]), pack2<T>(qa[8 * t.qs + kk + 8], qa[8 * t.qs + kk + 9])};
    const std::uint32_t b[2] = {pack2<T>(kb[kk], kb[kk + 1]), pack2<T>(kb[kk + 8], kb[kk + 9])};
    mma_16816<T>(s, a, b);
  }
  const float* da = t.dout + (r0 + g) * t.vs + c2;
  const float* vb = t.v + (n0 + g) * t.vs + c2;
  for (int kk = 0; kk < Dv; kk += 16) {
    const std::uint32_t a[4] = {
        pack2<T>(da[kk], da[kk + 1]), pack2<T>(da[8 * t.vs + kk], da[8 * t.vs + kk + 1]),
        pack2<T>(da[kk + 8], da[kk + 9]), pack2<T>(da[8 * t.vs + kk + 8], da[8 * t.vs + kk + 9])};
    const std::uint32_t b[2] = {pack2<T>(vb[kk], vb[kk + 1]), pack2<T>(vb[kk + 8], vb[kk + 9])};
    mma_16816<T>(dp, a, b);
  }
  const bool gated = p.gated();
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int r = r0 + g + (e >= 2 ? 8 : 0), c = n0 + c2 + (e & 1);
    float P = 0.f, ds = 0.f;
    if (r < rows && c < cols) {
      index_t lo, hi;
      const index_t j = j0 + c;
      p.f.key_range(i0 + r, length, lo, hi);
      if (j >= lo && j <= hi && j >= t.reset[r]) {
        const float z = gated ? s[e] * p.scale + static_cast<float>(t.gi[r] - t.gj[c])
                              : s[e] * p.scale - t.lse[r];
        P = expf(z);
        ds = P * (dp[e] - t.delta[r]);
      }
    }
    t.p[r * t.ps + c] = P;
    t.ds[r * t.ps + c] = ds;
  }
}

// dk and dv of a key tile, as attention_backward_dkdv_kernel; D, Dv multiples of 32, <= 32 *
// Chunks.
template <class T, int Chunks>
__global__ void __launch_bounds__(attention_backward_threads)
    sm80_attention_backward_dkdv_kernel(const attention_backward_params p) {
  constexpr int B = attention_backward_tile(Chunks);
  static_assert(B == 32, "32 x 32 tiles");
  extern __shared__ __align__(16) unsigned char backward_smem[];
  const int D = p.f.head_dim, Dv = p.f.value_dim, group = p.f.group;
  const backward_tiles<B> t(backward_smem, D, Dv);
  const int tid = threadIdx.x, lane = tid % 32, w = tid / 32, g = lane / 4, c2 = 2 * (lane % 4);
  const int mt = w % 2, h = blockIdx.y;
  index_t batch, start, length;
  p.f.sequence(blockIdx.z, batch, start, length);
  const index_t j0 = static_cast<index_t>(blockIdx.x) * B;
  if (j0 >= length) return;
  const int cols = length - j0 < B ? static_cast<int>(length - j0) : B;

  const index_t W = p.f.window;
  const index_t lo = backward_first_row(j0, W, p.f.causal);
  const index_t hi = backward_end_row(j0 + cols, W, length);

  load_keys<T>(p, t, batch, start, j0, cols, h);
  float dk[Chunks][4], dv[Chunks][4];  // column tiles w / 2 + 4 j of key tile mt
#pragma unroll
  for (int j = 0; j < Chunks; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = 0.f, dv[j][e] = 0.f;

  for (int gq = 0; gq < group; ++gq) {
    const int hq = h * group + gq;
    load_key_gates(p, t, batch, start, j0, cols, hq);
    float colsum = 0.f;  // of key tid (tid < B)
    for (index_t i0 = lo; i0 < hi; i0 += B) {
      const int rows = hi - i0 < B ? static_cast<int>(hi - i0) : B;
      load_query_rows<T>(p, t, batch, start, i0, rows, hq);
      __syncthreads();
      scores_to_ds_mma<T>(p, t, length, i0, rows, j0, cols);
      __syncthreads();
      // dv += P^T dout, dk += dS^T q over the tile's 32 rows (P, dS and the rows past `rows`
      // are 0). A[m = key][k = row] = P[row][key].
      const int km = 16 * mt + g;
#pragma unroll
      for (int kk = 0; kk < B; kk += 16) {
        const float* pr = t.p + (kk + c2) * t.ps + km;
        const float* dr = t.ds + (kk + c2) * t.ps + km;
        const int ps = t.ps;
        std::uint32_t ph[4], pl[4], sh[4], sl[4];
        split_pair16<T>(pr[0], pr[ps], ph[0], pl[0]);
        split_pair16<T>(pr[8], pr[ps + 8], ph[1], pl[1]);
        split_pair16<T>(pr[8 * ps], pr[9 * ps], ph[2], pl[2]);
        split_pair16<T>(pr[8 * ps + 8], pr[9 * ps + 8], ph[3], pl[3]);
        split_pair16<T>(dr[0], dr[ps], sh[0], sl[0]);
        split_pair16<T>(dr[8], dr[ps + 8], sh[1], sl[1]);
        split_pair16<T>(dr[8 * ps], dr[9 * ps], sh[2], sl[2]);
        split_pair16<T>(dr[8 * ps + 8], dr[9 * ps + 8], sh[3], sl[3]);
#pragma unroll
        for (int j = 0; j < Chunks; ++j) {
          const int n = 8 * (w / 2 + 4 * j);  // the column tile
          if (n < Dv) {
            const float* ob = t.dout + (kk + c2) * t.vs + n + g;  // B[k = row][n = col]
            const std::uint32_t b[2] = {pack2<T>(ob[0], ob[t.vs]),
                                        pack2<T>(ob[8 * t.vs], ob[9 * t.vs])};
            mma_16816<T>(dv[j], ph, b);
            mma_16816<T>(dv[j], pl, b);
          }
          if (n < D) {
            const float* qb = t.q + (kk + c2) * t.qs + n + g;
            const std::uint32_t b[2] = {pack2<T>(qb[0], qb[t.qs]),
                                        pack2<T>(qb[8 * t.qs], qb[9 * t.qs])};
            mma_16816<T>(dk[j], sh, b);
            mma_16816<T>(dk[j], sl, b);
          }
        }
      }
      if (tid < B)
        for (int r = 0; r < rows; ++r) colsum += t.ds[r * t.ps + tid];
      __syncthreads();  // before the next rows (and the next head's key gates) overwrite tiles
    }
    if (p.gated() && tid < cols) p.colsum[p.at(batch, start, j0 + tid, hq)] = colsum;
    __syncthreads();
  }

  T* dk_out = static_cast<T*>(p.dk) + batch * p.dk_stride[0] + (start + j0) * p.dk_stride[1] +
              h * p.dk_stride[2];
  T* dv_out = static_cast<T*>(p.dv) + batch * p.dv_stride[0] + (start + j0) * p.dv_stride[1] +
              h * p.dv_stride[2];
#pragma unroll
  for (int j = 0; j < Chunks; ++j) {
    const int n = 8 * (w / 2 + 4 * j) + c2;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = 16 * mt + g + (e >= 2 ? 8 : 0), col = n + (e & 1);
      if (key >= cols) continue;
      if (col < D) dk_out[key * p.dk_stride[1] + col] = from_float<T>(dk[j][e] * p.scale);
      if (col < Dv) dv_out[key * p.dv_stride[1] + col] = from_float<T>(dv[j][e]);
    }
  }
}

// dq of a query tile, as attention_backward_dq_kernel; D, Dv multiples of 32, <= 32 * Chunks.
template <class T, int Chunks>
__global__ void __launch_bounds__(attention_backward_threads)
    sm80_attention_backward_dq_kernel(const attention_backward_params p) {
  constexpr int B = attention_backward_tile(Chunks);
  static_assert(B == 32, "32 x 32 tiles");
  extern __shared__ __align__(16) unsigned char backward_smem[];
  const int D = p.f.head_dim, Dv = p.f.value_dim;
  const backward_tiles<B> t(backward_smem, D, Dv);
  const int tid = threadIdx.x, lane = tid % 32, w = tid / 32, g = lane / 4, c2 = 2 * (lane % 4);
  const int mt = w % 2, hq = blockIdx.y, h = hq / p.f.group;
  index_t batch, start, length;
  p.f.sequence(blockIdx.z, batch, start, length);
  const index_t i0 = static_cast<index_t>(blockIdx.x) * B;
  if (i0 >= length) return;
  const int rows = length - i0 < B ? static_cast<int>(length - i0) : B;

  index_t j_lo, j_hi, unused;
  p.f.key_range(i0, length, j_lo, unused);
  p.f.key_range(i0 + rows - 1, length, unused, j_hi);
  if (p.gated()) {
    const index_t r = p.reset[p.at(batch, start, i0, hq)];
    j_lo = r > j_lo ? r : j_lo;
  }

  load_query_rows<T>(p, t, batch, start, i0, rows, hq);
  float dq[Chunks][4];  // column tiles w / 2 + 4 j of row tile mt
#pragma unroll
  for (int j = 0; j < Chunks; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[j][e] = 0.f;
  float rowsum = 0.f;  // of row tid (tid < B)

  for (index_t j0 = j_lo; j0 <= j_hi; j0 += B) {
    const int cols = j_hi + 1 - j0 < B ? static_cast<int>(j_hi + 1 - j0) : B;
    load_keys<T>(p, t, batch, start, j0, cols, h);
    load_key_gates(p, t, batch, start, j0, cols, hq);
    __syncthreads();
    scores_to_ds_mma<T>(p, t, length, i0, rows, j0, cols);
    __syncthreads();
    // dq += dS k over the tile's 32 keys (dS and the keys past `cols` are 0).
    // A[m = row][k = key] = dS[row][key], B[k = key][n = col] = k[key][col].
    const float* dr = t.ds + (16 * mt + g) * t.ps + c2;
#pragma unroll
    for (int kk = 0; kk < B; kk += 16) {
      const int ps = t.ps;
      std::uint32_t sh[4], sl[4];
      split_pair16<T>(dr[kk], dr[kk + 1], sh[0], sl[0]);
      split_pair16<T>(dr[8 * ps + kk], dr[8 * ps + kk + 1], sh[1], sl[1]);
      split_pair16<T>(dr[kk + 8], dr[kk + 9], sh[2], sl[2]);
      split_pair16<T>(dr[8 * ps + kk + 8], dr[8 * ps + kk + 9], sh[3], sl[3]);
#pragma unroll
      for (int j = 0; j < Chunks; ++j) {
        const int n = 8 * (w / 2 + 4 * j);
        if (n < D) {
          const float* kb = t.k + (kk + c2) * t.qs + n + g;
          const std::uint32_t b[2] = {pack2<T>(kb[0], kb[t.qs]),
                                      pack2<T>(kb[8 * t.qs], kb[9 * t.qs])};
          mma_16816<T>(dq[j], sh, b);
          mma_16816<T>(dq[j], sl, b);
        }
      }
    }
    if (tid < B)
      for (int c = 0; c < cols; ++c) rowsum += t.ds[tid * t.ps + c];
    __syncthreads();  // before the next keys overwrite the tiles
  }

  T* dq_out = static_cast<T*>(p.dq) + batch * p.dq_stride[0] + (start + i0) * p.dq_stride[1] +
              hq * p.dq_stride[2];
#pragma unroll
  for (int j = 0; j < Chunks; ++j) {
    const int n = 8 * (w / 2 + 4 * j) + c2;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 16 * mt + g + (e >= 2 ? 8 : 0), col = n + (e & 1);
      if (r < rows && col < D) dq_out[r * p.dq_stride[1] + col] = from_float<T>(dq[j][e] * p.scale);
    }
  }
  if (p.gated() && tid < rows) p.rowsum[p.at(batch, start, i0 + tid, hq)] = rowsum;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
