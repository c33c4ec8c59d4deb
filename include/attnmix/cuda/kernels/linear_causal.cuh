#pragma once
// CUDA kernels of causal linear attention (kind::linear_causal): the chunked form of spec
// gbla.md §4 on CUDA cores with float accumulation, the same maths as cpu/detail/linear.hpp's
// causal_chunked. Chunks of causal_chunk tokens: within a chunk the causal-masked scores
// R P^T (times the prefix-softmax weights exp(a_j - u_i) of the key gate, u_i the running max
// at row i) times V plus their row sums; across chunks the carried state S [D, Dv], z [D] and,
// for the key gate, the running max m and mass ell (S, z and ell scaled by exp(-m)).
//
// One CTA walks one segment of one (sequence, KV head) chunk by chunk, every query head of the
// group reading the chunk while it is staged. When there are fewer (sequence, KV head) pairs
// than the GPU has CTA slots, each sequence is cut into segments: linear_reduce_kernel gives the
// state of every segment but the last, linear_causal_prefix_kernel the state carried into each
// segment (an exclusive scan with a log-sum-exp merge, state_in first), and the segments then
// run in parallel.

#include <cmath>
#include <cstdint>

#include "attnmix/core/linear_policy.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/causal_scan.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// ---- segment prefixes ------------------------------------------------------------------
// CTA (KV head h, sequence n): prefix[s] = state_in merged with the reduce pass's states of
// segments 0 .. s-1, unnormalised, as [S: D*Dv][z: D][m][ell] (partial_floats per segment).
template <class Policy>
__global__ void __launch_bounds__(256)
    linear_causal_prefix_kernel(const linear_kernel_params p, const float* partial,
                                index_t segments, float* prefix) {
  constexpr bool gated = Policy::gate != key_gate::off;
  const int h = blockIdx.x, n = blockIdx.y, D = p.head_dim, Dv = p.value_dim;
  const index_t stride = partial_floats(D, Dv);
  const index_t pair = index_t(n) * p.kv_heads + h;
  const float* part = partial + pair * (segments - 1) * stride;
  float* pre = prefix + pair * segments * stride;
  float m0, ell0;
  state_in_mass<Policy>(p, n, h, m0, ell0);
  for (int idx = threadIdx.x; idx < D * Dv + D + 2; idx += blockDim.x) {
    float x = idx < D * Dv + D ? state_in_value(p, n, h, idx) : idx == D * Dv + D ? m0 : ell0;
    float m = m0;
    for (index_t s = 0;; ++s) {
      pre[s * stride + idx] = x;
      if (s + 1 == segments) break;
      const float* ps = part + s * stride;
      const float Mp = ps[D * Dv + D], lp = ps[D * Dv + D + 1];
      if (!gated) {
        if (idx < D * Dv + D) x += ps[idx];
      } else if (lp > 0.f) {  // a segment without valid tokens changes nothing
        const float M = fmaxf(m, Mp);
        if (idx == D * Dv + D)
          x = M;
        else
          x = x * shifted_exp(m, M) + ps[idx] * __expf(Mp - M);
        m = M;
      }
    }
  }
}

// ---- chunked scan ----------------------------------------------------------------------

// Stages rows [0, C) of a [rows, cols] block of keys or queries (row stride `row_stride`) into
// dst [cols][C] transposed, as mul * phi(x); rows with valid[j] == 0 (pads, or past the end)
// become zeros without being read.
template <class T, class Policy>
__device__ __forceinline__ void stage_features(float* dst, const T* src, index_t row_stride,
                                               int cols, const float* valid, float mul,
                                               bool vector) {
  constexpr int C = causal_chunk;
  if (vector) {
    constexpr int per = 16 / sizeof(T), max_loads = C * 128 / per / causal_threads;
    const int items = C * (cols / per);
    uint4 buf[max_loads];
#pragma unroll
    for (int c = 0; c < max_loads; ++c) {
      const int idx = threadIdx.x + c * causal_threads, j = idx % C;
      if (idx < items && valid[j] != 0.f)
        buf[c] = *reinterpret_cast<const uint4*>(src + j * row_stride + (idx / C) * per);
    }
#pragma unroll
    for (int c = 0; c < max_loads; ++c) {
      const int idx = threadIdx.x + c * causal_threads, j = idx % C;
      if (idx >= items) break;
      const bool ok = valid[j] != 0.f;
      const T* x = reinterpret_cast<const T*>(&buf[c]);
      float* out = dst + (idx / C) * per * C + j;
#pragma unroll
      for (int i = 0; i < per; ++i)
        out[i * C] = ok ? mul * apply_feature_map<Policy::phi>(to_float(x[i])) : 0.f;
    }
  } else {
    for (int idx = threadIdx.x; idx < C * cols; idx += causal_threads) {
      const int j = idx % C, d = idx / C;
      dst[d * C + j] = valid[j] != 0.f
                           ? mul * apply_feature_map<Policy::phi>(to_float(src[j * row_stride + d]))
                           : 0.f;
    }
  }
}

// Stages rows [0, C) of the values into dst [C][cols], zeros for rows with valid[j] == 0.
template <class T>
__device__ __forceinline__ void stage_values(float* dst, const T* src, index_t row_stride, int cols,
                                             const float* valid, bool vector) {
  constexpr int C = causal_chunk;
  if (vector) {
    constexpr int per = 16 / sizeof(T), max_loads = C * 128 / per / causal_threads;
    const int chunks = cols / per, items = C * chunks;
    uint4 buf[max_loads];
#pragma unroll
    for (int c = 0; c < max_loads; ++c) {
      const int idx = threadIdx.x + c * causal_threads, j = idx / chunks;
      if (idx < items && valid[j] != 0.f)
        buf[c] = *reinterpret_cast<const uint4*>(src + j * row_stride + (idx % chunks) * per);
    }
#pragma unroll
    for (int c = 0; c < max_loads; ++c) {
      const int idx = threadIdx.x + c * causal_threads, j = idx / chunks;
      if (idx >= items) break;
      const bool ok = valid[j] != 0.f;
      const T* x = reinterpret_cast<const T*>(&buf[c]);
      float* out = dst + j * cols + (idx % chunks) * per;
#pragma unroll
      for (int i = 0; i < per; ++i) out[i] = ok ? to_float(x[i]) : 0.f;
    }
  } else {
    for (int idx = threadIdx.x; idx < C * cols; idx += causal_threads) {
      const int j = idx / cols, e = idx % cols;
      dst[idx] = valid[j] != 0.f ? to_float(src[j * row_stride + e]) : 0.f;
    }
  }
}

// CTA (segment, KV head h, sequence n), causal_threads threads. `prefix`: the state carried into
// each segment (linear_causal_prefix_kernel), or nullptr for one segment starting at state_in.
template <class T, class Policy, int VC>
__global__ void __launch_bounds__(causal_threads)
    linear_causal_kernel(const linear_kernel_params p, index_t segment_tokens, const float* prefix,
                         index_t segments) {
  constexpr int C = causal_chunk, warps = causal_threads / 32;
  constexpr bool gated = Policy::gate != key_gate::off;
  static_assert(C == 64, "the gate's scan gives each lane of warp 0 two rows");
  extern __shared__ __align__(16) float smem[];
  const int D = p.head_dim, Dv = p.value_dim;
  float* sS = smem;          // [D][Dv]  carried state (then z, the same layout as prefix)
  float* sz = sS + D * Dv;   // [D]
  float* kT = sz + D;        // [D][C]   phi(k), transposed; 0 at pads
  float* rT = kT + D * C;    // [D][C]   scale * phi(q), transposed; 0 at pads
  float* sv = rT + D * C;    // [C][Dv]  v; 0 at pads
  float* num = sv + C * Dv;  // [C][Dv]  numerators of the chunk's rows
  float* aT = num + C * Dv;  // [C][C]   weighted, masked scores, transposed: aT[j][i]
  float* den = aT + C * C;   // [C]     denominators
  float* rowf = den + C;     // the chunk's per-row values (collective/causal_scan.cuh)
  const causal_chunk_rows rs{rowf,         rowf + C,     rowf + 2 * C, rowf + 3 * C,
                             rowf + 4 * C, rowf + 5 * C, rowf + 6 * C};
  const float *valid = rs.valid, *logit = rs.logit, *run_max = rs.run_max, *carry = rs.carry,
              *mass = rs.mass, *wk = rs.wk, *next = rs.next;

  const int seg = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int warp = threadIdx.x / 32;
  index_t batch, start, length;
  p.sequence(n, batch, start, length);
  const index_t t0 = seg * segment_tokens, t1 = min(t0 + segment_tokens, length);
  const bool last = seg + 1 == segments;
  if (t0 >= t1 && !last) return;

  float m, ell;
  if (prefix != nullptr) {
    const float* st =
        prefix + ((index_t(n) * p.kv_heads + h) * segments + seg) * partial_floats(D, Dv);
    for (int idx = threadIdx.x; idx < D * Dv + D; idx += causal_threads) smem[idx] = st[idx];
    m = st[D * Dv + D], ell = st[D * Dv + D + 1];
  } else {
    for (int idx = threadIdx.x; idx < D * Dv + D; idx += causal_threads)
      smem[idx] = state_in_value(p, n, h, idx);
    state_in_mass<Policy>(p, n, h, m, ell);
  }

  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride[0] + start * p.k_stride[1] +
               h * p.k_stride[2];
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride[0] + start * p.v_stride[1] +
               h * p.v_stride[2];
  for (index_t c0 = t0; c0 < t1; c0 += C) {
    const int rows = static_cast<int>(min(index_t(C), t1 - c0));
    __syncthreads();  // the previous chunk is done with every buffer
    causal_chunk_gates<gated>(p, batch, start + c0, rows, h, rs, m, ell);
    stage_features<T, Policy>(kT, k + c0 * p.k_stride[1], p.k_stride[1], D, valid, 1.f,
                              p.vector_loads);
    stage_values(sv, v + c0 * p.v_stride[1], p.v_stride[1], Dv, valid, p.vector_loads);

    for (int g = 0; g < p.group; ++g) {
      const int hq = h * p.group + g;
      const T* q = static_cast<const T*>(p.q) + batch * p.q_stride[0] +
                   (start + c0) * p.q_stride[1] + hq * p.q_stride[2];
      __syncthreads();  // the previous head's epilogue is done with rT, num and den
      stage_features<T, Policy>(rT, q, p.q_stride[1], D, valid, p.scale, p.q_vector_loads);
      __syncthreads();

      // Scores: thread (i0, j0) owns a 4x4 block of A = R P^T, masked to j <= i and weighted by
      // exp(a_j - u_i); stored transposed, one float4 column of rows per j.
      {
        const int i0 = (threadIdx.x % 16) * 4, j0 = (threadIdx.x / 16) * 4;
        float acc[4][4] = {};
        if (j0 <= i0) {
          for (int d = 0; d < D; ++d) {
            const float4 rv = *reinterpret_cast<const float4*>(rT + d * C + i0);
            const float4 kv = *reinterpret_cast<const float4*>(kT + d * C + j0);
            const float rr[4] = {rv.x, rv.y, rv.z, rv.w}, kk[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int j = 0; j < 4; ++j) acc[i][j] += rr[i] * kk[j];
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float col[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int ii = i0 + i, jj = j0 + j;
            const float w = jj > ii ? 0.f : gated ? shifted_exp(logit[jj], run_max[ii]) : 1.f;
            col[i] = acc[i][j] * w;
          }
          *reinterpret_cast<float4*>(aT + (j0 + j) * C + i0) =
              make_float4(col[0], col[1], col[2], col[3]);
        }
      }
      __syncthreads();

      // Numerators: thread (r0, c0) owns 4x4 blocks of carry * (R S) + A V, and for c0 = 0 the
      // denominators carry * (R z) + rowsum(A) + eps * ell.
      const int cb = Dv / 4;
      for (int id = threadIdx.x; id < (C / 4) * cb; id += causal_threads) {
        const int r0 = (id / cb) * 4, e0 = (id % cb) * 4;
        float acc[4][4] = {}, dn[4] = {};
        for (int d = 0; d < D; ++d) {
          const float4 rv = *reinterpret_cast<const float4*>(rT + d * C + r0);
          const float4 s = *reinterpret_cast<const float4*>(sS + d * Dv + e0);
          const float rr[4] = {rv.x, rv.y, rv.z, rv.w}, ss[4] = {s.x, s.y, s.z, s.w};
          const float zd = sz[d];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] += rr[i] * ss[j];
            dn[i] += rr[i] * zd;
          }
        }
        if (gated) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float c = carry[r0 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] *= c;
            dn[i] *= c;
          }
        }
        const int jmax = min(r0 + 4, rows);
        for (int j = 0; j < jmax; ++j) {
          const float4 av = *reinterpret_cast<const float4*>(aT + j * C + r0);
          const float4 vv = *reinterpret_cast<const float4*>(sv + j * Dv + e0);
          const float aa[4] = {av.x, av.y, av.z, av.w}, ve[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) acc[i][jj] += aa[i] * ve[jj];
            dn[i] += aa[i];
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          *reinterpret_cast<float4*>(num + (r0 + i) * Dv + e0) =
              make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
          if (e0 == 0) den[r0 + i] = dn[i] + (gated ? p.eps * mass[r0 + i] : p.eps);
        }
      }
      __syncthreads();

      // Epilogue, one warp per row.
      for (int row = warp; row < rows; row += warps) {
        causal_write_row<T, Policy, VC>(p, batch, start + c0 + row, hq, num + row * Dv, den[row],
                                        rs, row);
      }
    }

    // Carry the state past the chunk: S = S * exp(m - m_new) + sum_j exp(a_j - m_new) p_j v_j^T,
    // likewise z; thread (d0, e0) owns 4x4 blocks of S.
    const float m_new = gated ? next[0] : 0.f, ell_new = gated ? next[1] : 1.f;
    const float cs = gated ? rescale_factor(m, m_new) : 1.f;
    const int cbv = Dv / 4, jend = (rows + 3) / 4 * 4;
    for (int id = threadIdx.x; id < (D / 4) * cbv; id += causal_threads) {
      const int d0 = (id / cbv) * 4, e0 = (id % cbv) * 4;
      float acc[4][4], zacc[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 s = *reinterpret_cast<const float4*>(sS + (d0 + i) * Dv + e0);
        acc[i][0] = s.x * cs, acc[i][1] = s.y * cs, acc[i][2] = s.z * cs, acc[i][3] = s.w * cs;
        zacc[i] = e0 == 0 ? sz[d0 + i] * cs : 0.f;  // only the e0 = 0 thread owns z
      }
      for (int j = 0; j < jend; j += 4) {
        float kk[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 x = *reinterpret_cast<const float4*>(kT + (d0 + i) * C + j);
          kk[i][0] = x.x, kk[i][1] = x.y, kk[i][2] = x.z, kk[i][3] = x.w;
        }
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const float w = wk[j + jj];
          const float4 vv = *reinterpret_cast<const float4*>(sv + (j + jj) * Dv + e0);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float pk = kk[i][jj] * w;
            acc[i][0] += pk * vv.x, acc[i][1] += pk * vv.y;
            acc[i][2] += pk * vv.z, acc[i][3] += pk * vv.w;
            zacc[i] += pk;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        *reinterpret_cast<float4*>(sS + (d0 + i) * Dv + e0) =
            make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        if (e0 == 0) sz[d0 + i] = zacc[i];
      }
    }
    m = m_new, ell = ell_new;
  }

  if (!last) return;
  __syncthreads();
  const float inv = gated && ell > 0.f ? 1.f / ell : 1.f;
  for (int idx = threadIdx.x; idx < D * Dv + D; idx += causal_threads)
    store_state_out(p, n, h, idx, sS[idx] * inv);
  // ell = 0 only at m = -inf (no state, nothing seen), so -inf is what the sequence had.
  if (gated && threadIdx.x == 0) store_lse_out(p, n, h, m, ell);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
