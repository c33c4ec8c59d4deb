#pragma once
// CUDA kernels of the linear-attention kinds, on CUDA cores with float accumulation.
//   bidirectional (bla, gbla): reduce (split over token blocks) -> combine -> read, spec gbla §3.2;
//   causal (linear_causal): the chunked scan of linear_causal.cuh.
// Every kernel reads what linear_kernel_params describes (collective/linear_params.cuh) and
// writes its rows through write_row (collective/linear_rows.cuh); Policy supplies the knobs.

#include <cmath>
#include <cstdint>

#include "attnmix/core/linear_policy.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/linear_params.cuh"
#include "attnmix/cuda/collective/linear_rows.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// ---- bidirectional: reduce ---------------------------------------------------------------
// Stages a 32-row tile of k (with the weight and the feature map) or v into shared memory as
// floats, 16 bytes per load, every load of a thread issued before the first use so that their
// latencies overlap. Needs rows 16-byte aligned and `cols` a multiple of 16 / sizeof(T).
template <class T, class Policy, bool Keys>
__device__ __forceinline__ void stage_vectors(float* dst, const T* src, index_t row_stride,
                                              index_t base, int rows, int cols,
                                              const float* weight) {
  constexpr int per = 16 / sizeof(T), max_loads = 4;  // 32 rows x 128 floats / 256 threads / 4
  const int chunks = cols / per;
  uint4 buf[max_loads];
#pragma unroll
  for (int c = 0; c < max_loads; ++c) {
    const int idx = threadIdx.x + c * 256, r = idx / chunks;
    if (idx < 32 * chunks && r < rows && weight[r] != 0.f)
      buf[c] =
          *reinterpret_cast<const uint4*>(src + (base + r) * row_stride + (idx % chunks) * per);
  }
#pragma unroll
  for (int c = 0; c < max_loads; ++c) {
    const int idx = threadIdx.x + c * 256, r = idx / chunks;
    if (idx >= 32 * chunks) break;
    const bool ok = r < rows && weight[r] != 0.f;
    const T* x = reinterpret_cast<const T*>(&buf[c]);
    float* out = dst + r * cols + (idx % chunks) * per;
#pragma unroll
    for (int i = 0; i < per; ++i) {
      float y = 0.f;
      if (ok) {
        y = to_float(x[i]);
        if (Keys) y = weight[r] * apply_feature_map<Policy::phi>(y);
      }
      out[i] = y;
    }
  }
}

// CTA (block p, KV head h, sequence n), 256 threads; each thread owns Blocks 4x4 tiles of S_p.
template <class T, class Policy, int Blocks>
__global__ void __launch_bounds__(256)
    linear_reduce_kernel(const linear_kernel_params p, index_t block_tokens, float* partial,
                         index_t partials) {
  constexpr int tile = 32;  // tokens staged in shared memory at a time
  constexpr bool gated = Policy::gate != key_gate::off;
  extern __shared__ __align__(16) float smem[];
  const int D = p.head_dim, Dv = p.value_dim;
  float* pk = smem;                // [tile][D]   masked, gated phi(k)
  float* sv = pk + tile * D;       // [tile][Dv]
  float* weight = sv + tile * Dv;  // [tile]
  __shared__ float scratch[8];

  const int blk = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  index_t batch, start, length;
  p.sequence(n, batch, start, length);
  const index_t t0 = blk * block_tokens, t1 = min(t0 + block_tokens, length);
  float* out = partial + ((index_t(n) * p.kv_heads + h) * partials + blk) * partial_floats(D, Dv);

  // Key gate: the block max first.
  const float M = gated ? block_logit_max(p, batch, start, h, t0, t1, scratch) : 0.f;

  const int bd = D / 4, bdv = Dv / 4;  // 4x4 tiles of S_p
  float acc[Blocks][16] = {};
  float zacc[Blocks][4] = {};
  float ell = 0.f;
  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride[0] + start * p.k_stride[1] +
               h * p.k_stride[2];
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride[0] + start * p.v_stride[1] +
               h * p.v_stride[2];
  // (row, column) of this thread's first staged element and the step between its elements
  // (256 apart), so that staging needs no division per element.
  const int k_row0 = threadIdx.x / D, k_col0 = threadIdx.x % D, k_row_step = 256 / D,
            k_col_step = 256 % D;
  const int v_row0 = threadIdx.x / Dv, v_col0 = threadIdx.x % Dv, v_row_step = 256 / Dv,
            v_col_step = 256 % Dv;
  for (index_t base = t0; base < t1; base += tile) {
    const int rows = static_cast<int>(min(index_t(tile), t1 - base));
    __syncthreads();
    if (threadIdx.x < tile) {
      float w = 0.f;
      if (threadIdx.x < rows) {
        const index_t t = base + threadIdx.x;
        if (gated)
          w = shifted_exp(p.logit(batch, start + t, h), M);
        else
          w = p.valid(batch, start + t) ? 1.f : 0.f;
      }
      weight[threadIdx.x] = w;
    }
    __syncthreads();
    // Pad tokens (weight 0) are skipped, not multiplied: their k and v may hold anything.
    if (p.vector_loads) {
      stage_vectors<T, Policy, true>(pk, k, p.k_stride[1], base, rows, D, weight);
      stage_vectors<T, Policy, false>(sv, v, p.v_stride[1], base, rows, Dv, weight);
    } else {
      for (int idx = threadIdx.x, r = k_row0, d = k_col0; idx < tile * D; idx += 256) {
        pk[idx] = r < rows && weight[r] != 0.f
                      ? weight[r] * apply_feature_map<Policy::phi>(
                                        to_float(k[(base + r) * p.k_stride[1] + d]))
                      : 0.f;
        r += k_row_step, d += k_col_step;
        if (d >= D) d -= D, ++r;
      }
      for (int idx = threadIdx.x, r = v_row0, e = v_col0; idx < tile * Dv; idx += 256) {
        sv[idx] = r < rows && weight[r] != 0.f ? to_float(v[(base + r) * p.v_stride[1] + e]) : 0.f;
        r += v_row_step, e += v_col_step;
        if (e >= Dv) e -= Dv, ++r;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int r = 0; r < rows; ++r) ell += weight[r];
#pragma unroll
    for (int b = 0; b < Blocks; ++b) {
      const int id = threadIdx.x + b * 256;
      if (id >= bd * bdv) break;
      const int d0 = (id / bdv) * 4, e0 = (id % bdv) * 4;
      for (int r = 0; r < rows; ++r) {
        const float4 kk = *reinterpret_cast<const float4*>(pk + r * D + d0);
        const float4 vv = *reinterpret_cast<const float4*>(sv + r * Dv + e0);
        const float kd[4] = {kk.x, kk.y, kk.z, kk.w}, ve[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[b][i * 4 + j] += kd[i] * ve[j];
          zacc[b][i] += kd[i];
        }
      }
    }
  }
#pragma unroll
  for (int b = 0; b < Blocks; ++b) {
    const int id = threadIdx.x + b * 256;
    if (id >= bd * bdv) break;
    const int d0 = (id / bdv) * 4, e0 = (id % bdv) * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) out[(d0 + i) * Dv + e0 + j] = acc[b][i * 4 + j];
      if (e0 == 0) out[D * Dv + d0 + i] = zacc[b][i];
    }
  }
  if (threadIdx.x == 0) {
    out[D * Dv + D] = gated ? M : 0.f;
    out[D * Dv + D + 1] = ell;
  }
}

// ---- bidirectional: combine ---------------------------------------------------------------
// CTA (KV head h, sequence n, slice of linear_combine_slice elements): merges the partial
// states with a log-sum-exp over the block maxima; writes the final, softmax-normalised S and z
// (`state`: [N, H, D*Dv + D]) and any state_out the caller asked for.
template <class Policy>
__global__ void __launch_bounds__(256)
    linear_combine_kernel(const linear_kernel_params p, const float* partial, index_t partials,
                          float* state) {
  constexpr bool gated = Policy::gate != key_gate::off;
  __shared__ float scratch[8];
  const int h = blockIdx.x, n = blockIdx.y, D = p.head_dim, Dv = p.value_dim;
  const index_t stride = partial_floats(D, Dv);
  const float* part = partial + (index_t(n) * p.kv_heads + h) * partials * stride;
  float M = 0.f, ell = 0.f;
  if (gated) partial_gate_merge(part + D * Dv + D, partials, stride, scratch, M, ell);
  const float inv = gated ? (ell > 0.f ? 1.f / ell : 0.f) : 1.f;
  float* out = state + (index_t(n) * p.kv_heads + h) * (index_t(D) * Dv + D);
  const int end = min(D * Dv + D, int(blockIdx.z + 1) * linear_combine_slice);
  for (int idx = blockIdx.z * linear_combine_slice + threadIdx.x; idx < end; idx += blockDim.x) {
    float sum = 0.f;
    for (index_t q = 0; q < partials; ++q) {
      const float* pq = part + q * stride;
      const float alpha =
          gated ? (pq[D * Dv + D + 1] > 0.f ? __expf(pq[D * Dv + D] - M) : 0.f) : 1.f;
      sum += alpha * pq[idx];
    }
    sum *= inv;
    out[idx] = sum;
    store_state_out(p, n, h, idx, sum);
  }
  if (gated && threadIdx.x == 0 && blockIdx.z == 0) store_lse_out(p, n, h, M, ell);
}

// ---- bidirectional: read ------------------------------------------------------------------
// CTA (64-row query tile, query head hq, sequence n), 128 threads. S, z and the tile's
// transposed feature-mapped queries sit in shared memory; each thread owns Blocks 4x4 tiles of
// Num = Phi(Q) S, so that two 16-byte shared loads feed 16 FMAs. The rows then go through the
// per-row epilogue, one warp per row.
template <class T, class Policy, int VC, int Blocks>
__global__ void __launch_bounds__(128)
    linear_read_kernel(const linear_kernel_params p, const float* state) {
  constexpr int R = linear_read_rows;
  extern __shared__ __align__(16) float smem[];
  const int D = p.head_dim, Dv = p.value_dim;
  float* sS = smem;           // [D][Dv]
  float* sz = sS + D * Dv;    // [D]
  float* rT = sz + D;         // [D][R]   scale * phi(q), transposed
  float* num = rT + D * R;    // [R][Dv]
  float* den = num + R * Dv;  // [R]
  float* valid = den + R;     // [R]     1 for a real query row
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hq = blockIdx.y, n = blockIdx.z, h = hq / p.group;
  index_t batch, start, length;
  p.sequence(n, batch, start, length);
  const index_t i0 = index_t(blockIdx.x) * R;
  if (i0 >= length) return;
  const float* st = state + (index_t(n) * p.kv_heads + h) * (index_t(D) * Dv + D);
  for (int idx = threadIdx.x; idx < D * Dv + D; idx += blockDim.x) smem[idx] = st[idx];
  for (int row = threadIdx.x; row < R; row += blockDim.x)
    valid[row] = i0 + row < length && p.valid(batch, start + i0 + row) ? 1.f : 0.f;
  __syncthreads();
  const T* q = static_cast<const T*>(p.q) + batch * p.q_stride[0] + (start + i0) * p.q_stride[1] +
               hq * p.q_stride[2];
  for (int idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
    const int row = idx / D, d = idx % D;
    rT[d * R + row] =
        valid[row] != 0.f
            ? p.scale * apply_feature_map<Policy::phi>(to_float(q[row * p.q_stride[1] + d]))
            : 0.f;
  }
  __syncthreads();

  const int cb = Dv / 4;
#pragma unroll
  for (int b = 0; b < Blocks; ++b) {
    const int id = threadIdx.x + b * 128;
    if (id >= (R / 4) * cb) break;
    const int r0 = (id / cb) * 4, c0 = (id % cb) * 4;
    float acc[4][4] = {}, dn[4] = {};
    for (int d = 0; d < D; ++d) {
      const float4 rv = *reinterpret_cast<const float4*>(rT + d * R + r0);
      const float4 sv = *reinterpret_cast<const float4*>(sS + d * Dv + c0);
      const float rr[4] = {rv.x, rv.y, rv.z, rv.w}, ss[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += rr[i] * ss[j];
        if (c0 == 0) dn[i] += rr[i] * sz[d];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) num[(r0 + i) * Dv + c0 + j] = acc[i][j];
      if (c0 == 0) den[r0 + i] = dn[i];
    }
  }
  __syncthreads();

  for (int row = warp; row < R; row += 4) {
    if (i0 + row >= length) break;
    float o[VC];
    const float inv = Policy::normalize ? 1.f / (den[row] + p.eps) : 1.f;
#pragma unroll
    for (int c = 0; c < VC; ++c)
      o[c] = lane + 32 * c < Dv ? num[row * Dv + lane + 32 * c] * inv : 0.f;
    write_row<T, Policy>(p, batch, start + i0 + row, hq, o, valid[row] != 0.f);
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
