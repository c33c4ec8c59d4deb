#pragma once
// The tiles of the softmax-family backward on CUDA cores, shared by its kernels
// (attention_backward_simt.cuh) and the older tensor-core ones (sm80_attention_backward.cuh):
// q, dout, k, v, P and dS staged in shared memory as float, their loads, and dS from the scores.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/attention_backward_params.cuh"
#include "attnmix/cuda/kernels/attention_backward_shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// The shared-memory layout of attention_backward_smem_bytes.
template <int B>
struct backward_tiles {
  double *gi, *gj;  // rows: coef G_i - lse_i; keys: coef G_j (gate only)
  float *q, *dout, *k, *v, *p, *ds, *lse, *delta;
  int* reset;
  int qs, vs;  // row strides of q and k (D + 1), of dout and v (Dv + 1)
  static constexpr int ps = B + 1;

  __device__ backward_tiles(unsigned char* smem, int D, int Dv) : qs(D + 1), vs(Dv + 1) {
    gi = reinterpret_cast<double*>(smem);
    gj = gi + B;
    q = reinterpret_cast<float*>(gj + B);
    dout = q + B * qs;
    k = dout + B * vs;
    v = k + B * qs;
    p = v + B * vs;
    ds = p + B * ps;
    lse = ds + B * ps;
    delta = lse + B;
    reset = reinterpret_cast<int*>(delta + B);
  }
};

// Rows [i0, i0 + rows) of query head hq into the tiles (q, dout, lse, delta, and with a gate gi
// and the resets); rows past `rows` are zero.
template <class T, int B>
__device__ void load_query_rows(const attention_backward_params& p, const backward_tiles<B>& t,
                                index_t batch, index_t start, index_t i0, int rows, int hq) {
  const int D = p.f.head_dim, Dv = p.f.value_dim;
  const T* q = static_cast<const T*>(p.f.q) + batch * p.f.q_stride[0] +
               (start + i0) * p.f.q_stride[1] + hq * p.f.q_stride[2];
  const T* dout = static_cast<const T*>(p.dout) + batch * p.dout_stride[0] +
                  (start + i0) * p.dout_stride[1] + hq * p.dout_stride[2];
  for (int e = threadIdx.x; e < B * D; e += attention_backward_threads) {
    const int r = e / D, c = e % D;
    t.q[r * t.qs + c] = r < rows ? to_float(q[r * p.f.q_stride[1] + c]) : 0.f;
  }
  for (int e = threadIdx.x; e < B * Dv; e += attention_backward_threads) {
    const int r = e / Dv, c = e % Dv;
    t.dout[r * t.vs + c] = r < rows ? to_float(dout[r * p.dout_stride[1] + c]) : 0.f;
  }
  if (threadIdx.x < B) {
    const int r = threadIdx.x;
    const bool in = r < rows;
    const float lse = in ? p.lse[batch * p.lse_stride[0] + (start + i0 + r) * p.lse_stride[1] +
                                 hq * p.lse_stride[2]]
                         : 0.f;
    t.lse[r] = lse;
    t.delta[r] = in ? p.delta[p.at(batch, start, i0 + r, hq)] : 0.f;
    if (p.gated()) {
      const index_t a = p.at(batch, start, in ? i0 + r : i0, hq);
      // coef G_i - lse_i in double, rounded once with the key's term: G drifts far from 0 over a
      // long sequence while the differences that matter stay small.
      t.gi[r] = p.gate_coef * p.G[a] - static_cast<double>(lse);
      t.reset[r] = p.reset[a];
    } else {
      t.gi[r] = 0.0;
      t.reset[r] = 0;
    }
  }
}

// Keys [j0, j0 + cols) of KV head h into the tiles (k, v, and with a gate gj of query head hq);
// keys past `cols` are zero.
template <class T, int B>
__device__ void load_keys(const attention_backward_params& p, const backward_tiles<B>& t,
                          index_t batch, index_t start, index_t j0, int cols, int h) {
  const int D = p.f.head_dim, Dv = p.f.value_dim;
  const T* k = static_cast<const T*>(p.f.k) + batch * p.f.k_stride[0] +
               (start + j0) * p.f.k_stride[1] + h * p.f.k_stride[2];
  const T* v = static_cast<const T*>(p.f.v) + batch * p.f.v_stride[0] +
               (start + j0) * p.f.v_stride[1] + h * p.f.v_stride[2];
  for (int e = threadIdx.x; e < B * D; e += attention_backward_threads) {
    const int r = e / D, c = e % D;
    t.k[r * t.qs + c] = r < cols ? to_float(k[r * p.f.k_stride[1] + c]) : 0.f;
  }
  for (int e = threadIdx.x; e < B * Dv; e += attention_backward_threads) {
    const int r = e / Dv, c = e % Dv;
    t.v[r * t.vs + c] = r < cols ? to_float(v[r * p.f.v_stride[1] + c]) : 0.f;
  }
}

template <int B>
__device__ void load_key_gates(const attention_backward_params& p, const backward_tiles<B>& t,
                               index_t batch, index_t start, index_t j0, int cols, int hq) {
  if (threadIdx.x < B)
    t.gj[threadIdx.x] = p.gated() && static_cast<int>(threadIdx.x) < cols
                            ? p.gate_coef * p.G[p.at(batch, start, j0 + threadIdx.x, hq)]
                            : 0.0;
}

// P and dS of the staged rows [i0, i0 + rows) and keys [j0, j0 + cols) (of `length` queries and
// `keys` keys: row i at key position i + keys - length) into t.p and t.ds; 0 outside the tile and
// where a key is masked (window, causal, a hard reset before the row). A thread takes key c = tid %
// B of rows tid / B + (256 / B) m, so that it reads each of its key's elements once for all its
// rows.
template <int B>
__device__ void scores_to_ds(const attention_backward_params& p, const backward_tiles<B>& t,
                             index_t length, index_t keys, index_t i0, int rows, index_t j0,
                             int cols) {
  constexpr int NT = attention_backward_threads, per = B * B / NT, step = NT / B;
  static_assert(per * NT == B * B && step * B == NT, "a whole tile of scores a pass");
  const int D = p.f.head_dim, Dv = p.f.value_dim;
  const bool gated = p.gated();
  const int c = threadIdx.x % B, r0 = threadIdx.x / B;
  bool seen[per];
  float s[per], dp[per];
#pragma unroll
  for (int m = 0; m < per; ++m) {
    const int r = r0 + step * m;
    seen[m] = false, s[m] = 0.f, dp[m] = 0.f;
    if (r < rows && c < cols) {
      index_t lo, hi;
      const index_t j = j0 + c;
      p.f.key_range(i0 + r, length, keys, lo, hi);
      seen[m] = j >= lo && j <= hi && j >= t.reset[r];
    }
  }
  const float* kc = t.k + c * t.qs;
  for (int d = 0; d < D; ++d) {
    const float x = kc[d];
#pragma unroll
    for (int m = 0; m < per; ++m) s[m] += t.q[(r0 + step * m) * t.qs + d] * x;
  }
  const float* vc = t.v + c * t.vs;
  for (int d = 0; d < Dv; ++d) {
    const float x = vc[d];
#pragma unroll
    for (int m = 0; m < per; ++m) dp[m] += t.dout[(r0 + step * m) * t.vs + d] * x;
  }
#pragma unroll
  for (int m = 0; m < per; ++m) {
    const int r = r0 + step * m;
    float P = 0.f, ds = 0.f;
    if (seen[m]) {
      const float z = gated ? s[m] * p.scale + static_cast<float>(t.gi[r] - t.gj[c])
                            : s[m] * p.scale - t.lse[r];
      P = expf(z);
      ds = P * (dp[m] - t.delta[r]);
    }
    t.p[r * t.ps + c] = P;
    t.ds[r * t.ps + c] = ds;
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
