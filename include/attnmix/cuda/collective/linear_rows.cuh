#pragma once
// Row and state pieces of the linear-attention kernels on CUDA cores, shared by the
// bidirectional and causal kernels of both directions: the output row's epilogue (the gated
// RMSNorm) and its backward, and the state sums S = sum w phi(k) v^T, z = sum w phi(k) of a range
// of tokens.

#include <cmath>
#include <cstdint>

#include "attnmix/core/linear_policy.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/linear_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// ---- the per-row epilogue shared by both forms ---------------------------------------------
// o: this lane's values of one row (e = lane + 32 c); applies the gated RMSNorm of Policy and
// writes the row (zeros for a pad row when Policy::zero_pad_rows).
template <class T, class Policy, int VC>
__device__ void write_row(const linear_kernel_params& p, index_t batch, index_t t, int hq,
                          float (&o)[VC], bool valid) {
  const int lane = threadIdx.x % 32, Dv = p.value_dim;
  T* out =
      static_cast<T*>(p.out) + batch * p.out_stride[0] + t * p.out_stride[1] + hq * p.out_stride[2];
  if (!valid) {
    if (Policy::zero_pad_rows)
#pragma unroll
      for (int c = 0; c < VC; ++c)
        if (lane + 32 * c < Dv) out[lane + 32 * c] = from_float<T>(0.f);
    return;
  }
  if constexpr (Policy::norm == gated_norm::per_head) {
    const T* g = static_cast<const T*>(p.gate) + batch * p.gate_stride[0] + t * p.gate_stride[1] +
                 hq * p.gate_stride[2];
    float act[VC];
#pragma unroll
    for (int c = 0; c < VC; ++c) {
      const int e = lane + 32 * c;
      act[c] = e < Dv ? apply_gate_activation<Policy::activation>(to_float(g[e])) : 0.f;
      if (Policy::order == norm_gate_order::gate_then_norm) o[c] *= act[c];
    }
    float ss = 0.f;
#pragma unroll
    for (int c = 0; c < VC; ++c) ss += lane + 32 * c < Dv ? o[c] * o[c] : 0.f;
    const float rstd = rsqrtf(warp_sum(ss) / Dv + p.norm_eps);
#pragma unroll
    for (int c = 0; c < VC; ++c) {
      const int e = lane + 32 * c;
      o[c] *= rstd;
      if (Policy::order == norm_gate_order::norm_then_gate) o[c] *= act[c];
      if (p.gamma != nullptr && e < Dv)
        o[c] *= p.gamma[(Policy::weight == norm_weight::per_head ? hq * Dv : 0) + e];
    }
  }
#pragma unroll
  for (int c = 0; c < VC; ++c)
    if (lane + 32 * c < Dv) out[lane + 32 * c] = from_float<T>(o[c]);
}

// ---- state sums ---------------------------------------------------------------------------

// The sums S = sum_t w_t phi(k_t) v_t^T, z = sum_t w_t phi(k_t) over tokens [t0, t1) of
// sequence n, KV head h (w: the gate weight, 1 without `stats`; 0 at pads), written to
// out[0, D * Dv + D) (S row-major, then z). smem: linear_bwd_reduce_floats.
// The state element idx = threadIdx.x + r * linear_bwd_threads of [D x Dv | D] that acc[r]
// holds, plus the rows' products in row order: A[t, d] * B[t, c] for the S part, A[t, d] * z[t]
// (z == nullptr: A[t, d]) for the z part.
template <int R>
__device__ __forceinline__ void add_state_products(float (&acc)[R], const float* A, const float* B,
                                                   const float* z, int rows, int D, int Dv) {
  const int SS = D * Dv + D;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int idx = threadIdx.x + r * linear_bwd_threads;
    if (idx < D * Dv) {
      const int d = idx / Dv, c = idx % Dv;
      float s = acc[r];
      for (int t = 0; t < rows; ++t) s += A[t * D + d] * B[t * Dv + c];
      acc[r] = s;
    } else if (idx < SS) {
      const int d = idx - D * Dv;
      float s = acc[r];
      if (z != nullptr)
        for (int t = 0; t < rows; ++t) s += A[t * D + d] * z[t];
      else
        for (int t = 0; t < rows; ++t) s += A[t * D + d];
      acc[r] = s;
    }
  }
}

template <class Dev, class Policy>
__device__ void state_sums(const linear_backward_params& bp, int n, index_t batch, index_t start,
                           int h, index_t t0, index_t t1, const float* stats, float* smem,
                           float* out) {
  constexpr int TT = int(linear_bwd_tile), R = linear_bwd_state_regs;
  const linear_kernel_params& f = bp.f;
  const int D = f.head_dim, Dv = f.value_dim, SS = D * Dv + D;
  float* P = smem;         // [TT][D]
  float* V = P + TT * D;   // [TT][Dv]
  float* W = V + TT * Dv;  // [TT]
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (index_t base = t0; base < t1; base += TT) {
    const int rows = int(min(index_t(TT), t1 - base));
    __syncthreads();
    if (threadIdx.x < TT) {
      const int t = threadIdx.x;
      W[t] = t < rows ? gate_weight(f, stats, n, batch, start + base + t, h) : 0.f;
    }
    __syncthreads();
    // Pad tokens are selected away, not multiplied: their k and v may hold anything.
    for (int e = threadIdx.x; e < TT * D; e += blockDim.x) {
      const int t = e / D, d = e % D;
      float y = 0.f;
      if (W[t] != 0.f)
        y = W[t] * apply_feature_map<Policy::phi>(
                       load_act<Dev>(f.k, f.k_stride, batch, start + base + t, h, d));
      P[e] = y;
    }
    for (int e = threadIdx.x; e < TT * Dv; e += blockDim.x) {
      const int t = e / Dv, c = e % Dv;
      V[e] = W[t] != 0.f ? load_act<Dev>(f.v, f.v_stride, batch, start + base + t, h, c) : 0.f;
    }
    __syncthreads();
    add_state_products(acc, P, V, nullptr, rows, D, Dv);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int idx = threadIdx.x + r * linear_bwd_threads;
    if (idx < SS) out[idx] = acc[r];
  }
}

// ---- the gated norm's backward ------------------------------------------------------------

// One warp, one (token, query head) row of the per-head gated RMSNorm: o (the norm's input) and
// dy (the gradient of its output) in shared memory; writes do into dy, dgate to its view, and
// each column's dgamma term into dgm (when gamma is given). Pad rows give zeros; a row that does
// not exist (past the end of a tile) writes nothing to the view.
template <class Dev, class Policy>
__device__ void norm_row_backward(const linear_backward_params& bp, index_t batch, index_t t,
                                  int hq, bool exists, bool valid, const float* o, float* dy,
                                  float* dgm) {
  const linear_kernel_params& f = bp.f;
  const int Dv = f.value_dim, lane = threadIdx.x % 32;
  constexpr int K = int(linear_bwd_max_dim / 32);
  constexpr bool gate_first = Policy::order == norm_gate_order::gate_then_norm;
  float ov[K], dyv[K], act[K], dact[K], gam[K], xg[K];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = lane + 32 * k;
    ov[k] = dyv[k] = act[k] = dact[k] = xg[k] = 0.f;
    gam[k] = 1.f;
    if (c < Dv && valid) {
      ov[k] = o[c];
      dyv[k] = dy[c];
      const float g = load_act<Dev>(f.gate, f.gate_stride, batch, t, hq, c);
      const float s = 1.f / (1.f + expf(-g));
      if constexpr (Policy::activation == gate_activation::silu) {
        act[k] = g * s;
        dact[k] = s + act[k] * (1.f - s);
      } else {
        act[k] = s;
        dact[k] = s * (1.f - s);
      }
      if (f.gamma != nullptr)
        gam[k] =
            f.gamma[(Policy::weight == norm_weight::per_head ? hq * Dv + c : c) * f.gamma_stride];
      xg[k] = gate_first ? ov[k] * act[k] : ov[k];
      ss += xg[k] * xg[k];
    }
  }
  const float rstd = 1.f / sqrtf(warp_sum(ss) / float(Dv) + f.norm_eps);
  float dn[K], dg[K], proj = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if constexpr (!gate_first) {
      dn[k] = dyv[k] * act[k];
      if (dgm != nullptr && lane + 32 * k < Dv)
        dgm[lane + 32 * k] = valid ? rstd * dn[k] * xg[k] : 0.f;
      dg[k] = rstd * dyv[k] * xg[k] * dact[k] * gam[k];
      dn[k] *= gam[k];
    } else {
      dn[k] = dyv[k];
      if (dgm != nullptr && lane + 32 * k < Dv)
        dgm[lane + 32 * k] = valid ? rstd * dn[k] * xg[k] : 0.f;
      dn[k] *= gam[k];
    }
    proj += dn[k] * xg[k];
  }
  proj = rstd * rstd * warp_sum(proj) / float(Dv);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = lane + 32 * k;
    if (c >= Dv) continue;
    float d_o;
    if constexpr (!gate_first) {
      d_o = rstd * (dn[k] - proj * xg[k]);
    } else {
      const float dx = rstd * (dn[k] - proj * xg[k]);
      dg[k] = dx * ov[k] * dact[k];
      d_o = dx * act[k];
    }
    dy[c] = valid ? d_o : 0.f;
    if (exists) store_act<Dev>(bp.dgate, bp.dgate_stride, batch, t, hq, c, valid ? dg[k] : 0.f);
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
