#pragma once
// The causal linear-attention backward under the prefix key gate (kind::linear_causal with
// key_gate::shared or per_head), on CUDA cores: the CPU backward's walk (cpu/detail/
// linear_backward.hpp, causal_backward_task) with a CTA per (KV head, sequence).
//
// Row i's weights are a softmax over the keys j <= i (carried states count with their mass), so
// a state is kept as (S, z) relative to a running max m with mass ell. The forward walk leaves a
// checkpoint every K chunks (K ~ sqrt(chunks)); the reverse walk rebuilds a segment's states from
// its checkpoint, then goes down its chunks carrying dS, dz and kappa (the gradient of the
// log-mass). Per chunk, with wn the rows' normalised weights, cn the carried state's weight and
// beta, f, rho the mass ratios of causal_backward_task:
//   e = V dS^T + dz, dv = P dS (both times f), da = f (P . e + kappa),
//   per query head: A = (R P^T) o wn, num and den, g = do / den, delta, kappa_i;
//   dr = cn (S0 g + delta z0) + dscore P with dscore = (g V^T + delta) o wn;
//   dv += A^T g, dphik += dscore^T R, da += colsum(R P^T o dscore) + wn^T kappa;
//   dS' = rho dS + R^T (beta g), dz' = rho dz + R^T (beta delta), kappa' = rho kappa + beta .
//   kappa.
// Every sum has a fixed order (a thread owns each output), so the bits repeat. States, dS and dz
// live in the task's scratch (global memory); the chunk's tiles in shared memory.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/collective/linear_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

namespace lbg {
constexpr int C = linear_bwd_gated_chunk, threads = linear_bwd_gated_threads;

// exp(x - m), 0 for x = -inf (accurate expf: this is the reference-grade fallback).
__device__ __forceinline__ float sexp(float x, float m) {
  return x == -INFINITY ? 0.f : expf(x - m);
}

// A state of the walk in global memory: S [D][Dv], z [D], then m and ell.
struct state_ref {
  float* p;
  int D, Dv;
  __device__ float* S() const { return p; }
  __device__ float* z() const { return p + D * Dv; }
  __device__ float& m() const { return p[D * Dv + D]; }
  __device__ float& ell() const { return p[D * Dv + D + 1]; }
};

__device__ __forceinline__ void copy_state(const state_ref& dst, const state_ref& src, int n) {
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += threads) dst.p[i] = src.p[i];
  __syncthreads();
}

// The chunk's keys: valid flags, P = phi(k), V (pad rows 0), logits (-inf at pads).
template <class Dev, class Policy>
__device__ void load_keys(const linear_kernel_params& f, index_t batch, index_t t0, int rows, int h,
                          float* P, float* V, float* logit, float* ok) {
  const int D = f.head_dim, Dv = f.value_dim;
  if (threadIdx.x < C) {
    const int j = threadIdx.x;
    const bool in = j < rows && f.valid(batch, t0 + j);
    ok[j] = in ? 1.f : 0.f;
    logit[j] = in ? f.logit(batch, t0 + j, h) : -INFINITY;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < C * D; e += threads) {
    const int j = e / D, d = e % D;
    P[j * (D + 1) + d] =
        ok[j] != 0.f
            ? apply_feature_map<Policy::phi>(load_act<Dev>(f.k, f.k_stride, batch, t0 + j, h, d))
            : 0.f;
  }
  for (int e = threadIdx.x; e < C * Dv; e += threads) {
    const int j = e / Dv, c = e % Dv;
    V[j * (Dv + 1) + c] = ok[j] != 0.f ? load_act<Dev>(f.v, f.v_stride, batch, t0 + j, h, c) : 0.f;
  }
  __syncthreads();
}

// Carries st past the loaded chunk (causal_chunked's arithmetic): rescale to the new max, then
// S += sum_j u_j p_j v_j^T, z += sum_j u_j p_j, ell += sum_j u_j.
__device__ void advance(const state_ref& st, const float* P, const float* V, const float* logit,
                        int rows, float* red) {
  const int D = st.D, Dv = st.Dv;
  float m_last = st.m();
  for (int j = 0; j < rows; ++j) m_last = fmaxf(m_last, logit[j]);
  __syncthreads();  // every thread has read m
  if (m_last == -INFINITY) return;
  const float c = sexp(st.m(), m_last);
  float* u = red;  // [C]
  if (threadIdx.x < C) u[threadIdx.x] = threadIdx.x < rows ? sexp(logit[threadIdx.x], m_last) : 0.f;
  __syncthreads();
  for (int e = threadIdx.x; e < D * Dv; e += threads) {
    const int d = e / Dv, cc = e % Dv;
    float s = c * st.S()[e];
    for (int j = 0; j < rows; ++j) s += u[j] * P[j * (D + 1) + d] * V[j * (Dv + 1) + cc];
    st.S()[e] = s;
  }
  for (int d = threadIdx.x; d < D; d += threads) {
    float s = c * st.z()[d];
    for (int j = 0; j < rows; ++j) s += u[j] * P[j * (D + 1) + d];
    st.z()[d] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float ell = c * st.ell();
    for (int j = 0; j < rows; ++j) ell += u[j];
    st.ell() = ell, st.m() = m_last;
  }
  __syncthreads();
}
// out = mul * acc * phi'(x) of the chunk's rows (tokens t0 + i of head hh, 0 at pads; acc's rows
// D + 1 apart): dq (x = q, mul = scale) or dk (x = k, mul = 1).
template <class Dev, class Policy>
__device__ void store_phi_grad(const float* acc, float mul, const void* x, const index_t* xs,
                               void* out, const index_t* os, index_t batch, index_t t0, int rows,
                               int hh, int D, const float* ok) {
  for (int e = threadIdx.x; e < C * D; e += threads) {
    const int i = e / D, d = e % D;
    if (i >= rows) continue;
    float y = 0.f;
    if (ok[i] != 0.f) {
      const float v = load_act<Dev>(x, xs, batch, t0 + i, hh, d);
      y = mul * acc[i * (D + 1) + d] *
          phi_derivative<Policy::phi>(v, apply_feature_map<Policy::phi>(v));
    }
    store_act<Dev>(out, os, batch, t0 + i, hh, d, y);
  }
}
}  // namespace lbg

// CTA (KV head h, sequence n): dq of every query head of h's group, dk, dv and da of the
// sequence's keys, and the gradient of the initial state. scratch: the task's states (K
// checkpoints, K + 1 segment states, the running state), dS and dz twice; linear_bwd_gated_floats
// gives its size. da_heads: a shared gate's per-head da (summed by linear_bwd_fold_da_kernel), or
// null (da written directly).
template <class Dev, class Policy>
__global__ void __launch_bounds__(lbg::threads)
    linear_bwd_causal_gated_kernel(const linear_backward_params bp, int K, index_t task_floats,
                                   float* scratch, float* da_heads) {
  using namespace lbg;
  constexpr bool normalize = Policy::normalize;
  const linear_kernel_params& f = bp.f;
  const int D = f.head_dim, Dv = f.value_dim, h = blockIdx.x, n = blockIdx.y;
  const int SS = D * Dv + D + 2;  // floats of a state
  index_t batch, start, length;
  f.sequence(n, batch, start, length);
  const index_t chunks = (length + C - 1) / C;
  const int segments = int((chunks + K - 1) / K);
  float* base = scratch + (index_t(n) * f.kv_heads + h) * task_floats;
  auto ckpt = [&](int s) {
    return state_ref{base + index_t(s) * SS, D, Dv};
  };
  auto seg = [&](int i) {
    return state_ref{base + index_t(K + 1 + i) * SS, D, Dv};
  };
  float* dS = base + index_t(2 * K + 3) * SS;  // [D][Dv] then dz [D], twice
  float* dS2 = dS + D * Dv + D;

  // Tiles' rows are one float longer than their width (ldk, ldv, ldc), so that a warp walking
  // down a column (a lane a row) reads 32 banks.
  const int ldk = D + 1, ldv = Dv + 1, ldc = C + 1;
  extern __shared__ __align__(16) float smem[];
  float* P = smem;            // [C][ldk] phi(k)
  float* V = P + C * ldk;     // [C][ldv]
  float* R = V + C * ldv;     // [C][ldk] scale phi(q)
  float* G = R + C * ldk;     // [C][ldv] do, then g
  float* X = G + C * ldv;     // [C][ldk] S0 g, then dr
  float* E = X + C * ldk;     // [C][ldk] dphik
  float* DV = E + C * ldk;    // [C][ldv] dv
  float* SC = DV + C * ldv;   // [C][ldc] R P^T
  float* WN = SC + C * ldc;   // [C][ldc] normalised weights
  float* DO = WN + C * ldc;   // [C][ldc] g V^T, then dscore
  float* vec = DO + C * ldc;  // [11][C] row vectors
  float *logit = vec, *ok = vec + C, *cn = vec + 2 * C, *beta = vec + 3 * C, *live = vec + 4 * C;
  float *fw = vec + 5 * C, *da = vec + 6 * C, *inv = vec + 7 * C, *delta = vec + 8 * C;
  float *kap = vec + 9 * C, *red = vec + 10 * C;
  __shared__ float scal[3];  // rho, kappa, kappa'

  // The initial state (as load_state: a stored state is normalised, ell = 1 at m = lse).
  const state_ref run = seg(K + 1);
  for (int e = threadIdx.x; e < D * Dv; e += threads)
    run.S()[e] = f.S_in != nullptr
                     ? f.S_in[n * f.S_in_stride[0] + h * f.S_in_stride[1] +
                              (e / Dv) * f.S_in_stride[2] + (e % Dv) * f.S_in_stride[3]]
                     : 0.f;
  for (int d = threadIdx.x; d < D; d += threads)
    run.z()[d] = f.S_in != nullptr && f.z_in != nullptr
                     ? f.z_in[n * f.z_in_stride[0] + h * f.z_in_stride[1] + d * f.z_in_stride[2]]
                     : 0.f;
  if (threadIdx.x == 0) {
    const float m0 = f.S_in != nullptr && f.lse_in != nullptr
                         ? f.lse_in[n * f.lse_in_stride[0] + h * f.lse_in_stride[1]]
                         : -INFINITY;
    run.m() = m0, run.ell() = m0 == -INFINITY ? 0.f : 1.f;
  }
  __syncthreads();

  // Forward walk: a checkpoint at the start of every K-th chunk.
  for (index_t c = 0; c < chunks; ++c) {
    if (c % K == 0) copy_state(ckpt(int(c / K)), run, SS);
    const index_t c0 = c * C;
    const int rows = int(min(index_t(C), length - c0));
    load_keys<Dev, Policy>(f, batch, start + c0, rows, h, P, V, logit, ok);
    advance(run, P, V, logit, rows, red);
  }

  // The final state's gradient (relative to its mass) and kappa.
  for (int e = threadIdx.x; e < D * Dv; e += threads)
    dS[e] = bp.dS_out != nullptr
                ? bp.dS_out[n * bp.dS_out_stride[0] + h * bp.dS_out_stride[1] +
                            (e / Dv) * bp.dS_out_stride[2] + (e % Dv) * bp.dS_out_stride[3]]
                : 0.f;
  for (int d = threadIdx.x; d < D; d += threads)
    dS[D * Dv + d] =
        bp.dz_out != nullptr
            ? bp.dz_out[n * bp.dz_out_stride[0] + h * bp.dz_out_stride[1] + d * bp.dz_out_stride[2]]
            : 0.f;
  __syncthreads();
  {
    float s = 0.f;
    for (int e = threadIdx.x; e < D * Dv + D; e += threads) s += dS[e] * run.p[e];
    s = block_reduce<false>(s, red);
    if (threadIdx.x == 0) {
      float kappa = 0.f;
      if (run.ell() > 0.f) {
        kappa = -s / run.ell();
        if (bp.dlse_out != nullptr)
          kappa += bp.dlse_out[n * bp.dlse_out_stride[0] + h * bp.dlse_out_stride[1]];
      }
      scal[1] = kappa;
    }
    __syncthreads();
  }

  for (int sg = segments - 1; sg >= 0; --sg) {
    const index_t c_first = index_t(sg) * K, c_last = min(chunks, c_first + K);
    copy_state(seg(0), ckpt(sg), SS);
    for (index_t c = c_first; c < c_last; ++c) {
      const int i = int(c - c_first);
      copy_state(seg(i + 1), seg(i), SS);
      const index_t c0 = c * C;
      load_keys<Dev, Policy>(f, batch, start + c0, int(min(index_t(C), length - c0)), h, P, V,
                             logit, ok);
      advance(seg(i + 1), P, V, logit, int(min(index_t(C), length - c0)), red);
    }
    for (index_t c = c_last - 1; c >= c_first; --c) {
      const state_ref s0 = seg(int(c - c_first)), s1 = seg(int(c - c_first + 1));
      const index_t c0 = c * C, t0 = start + c0;
      const int rows = int(min(index_t(C), length - c0));
      load_keys<Dev, Policy>(f, batch, t0, rows, h, P, V, logit, ok);
      const float m0 = s0.m(), ell0 = s0.ell(), m1 = s1.m(), ell1 = s1.ell();
      const float inv_end = ell1 > 0.f ? 1.f / ell1 : 0.f;

      // The rows' normalised weights (a thread a row, its keys in order).
      if (threadIdx.x < C) {
        const int i = threadIdx.x;
        float u = m0;
        for (int j = 0; j <= i && j < rows; ++j) u = fmaxf(u, logit[j]);
        const float carry = sexp(m0, u);
        float ell = carry * ell0;
        for (int j = 0; j < C; ++j) {
          const float w = j <= i && i < rows ? sexp(logit[j], u) : 0.f;
          WN[i * ldc + j] = w;
          ell += w;
        }
        const float iv = ell > 0.f ? 1.f / ell : 0.f;
        for (int j = 0; j < C; ++j) WN[i * ldc + j] *= iv;
        live[i] = ell > 0.f ? 1.f : 0.f;
        cn[i] = carry * iv;
        beta[i] = carry * iv * ell0;
        fw[i] = i < rows ? sexp(logit[i], m1) * inv_end : 0.f;
      }
      if (threadIdx.x == 0) scal[0] = sexp(m0, m1) * ell0 * inv_end;
      __syncthreads();
      const float rho = scal[0], kappa_acc = scal[1];
      float* dSn = dS2;  // the gradient of the state before the chunk

      // Through the state after the chunk: e = V dS^T + dz, dv = P dS, then the weights f.
      for (int e = threadIdx.x; e < C * D; e += threads) {
        const int d = e / C, j = e % C;  // a lane a row: dS's row is one broadcast read
        float s = dS[D * Dv + d];
        for (int cc = 0; cc < Dv; ++cc) s += V[j * ldv + cc] * dS[d * Dv + cc];
        E[j * ldk + d] = s;
      }
      for (int e = threadIdx.x; e < C * Dv; e += threads) {
        const int j = e / Dv, cc = e % Dv;
        float s = 0.f;
        for (int d = 0; d < D; ++d) s += P[j * ldk + d] * dS[d * Dv + cc];
        DV[j * ldv + cc] = fw[j] * s;
      }
      __syncthreads();
      if (threadIdx.x < C) {
        const int j = threadIdx.x;
        float s = 0.f;
        for (int d = 0; d < D; ++d) s += P[j * ldk + d] * E[j * ldk + d];
        da[j] = fw[j] * (s + kappa_acc);
      }
      __syncthreads();
      for (int e = threadIdx.x; e < C * D; e += threads) E[e / D * ldk + e % D] *= fw[e / D];
      for (int e = threadIdx.x; e < D * Dv + D; e += threads) dSn[e] = rho * dS[e];
      if (threadIdx.x == 0) scal[2] = rho * kappa_acc;
      __syncthreads();

      for (int hq = h * f.group; hq < (h + 1) * f.group; ++hq) {
        for (int e = threadIdx.x; e < C * D; e += threads) {
          const int i = e / D, d = e % D;
          R[i * ldk + d] = ok[i] != 0.f ? f.scale * apply_feature_map<Policy::phi>(load_act<Dev>(
                                                        f.q, f.q_stride, batch, t0 + i, hq, d))
                                        : 0.f;
        }
        for (int e = threadIdx.x; e < C * Dv; e += threads) {
          const int i = e / Dv, cc = e % Dv;
          G[i * ldv + cc] =
              ok[i] != 0.f ? load_act<Dev>(bp.dout, bp.dout_stride, batch, t0 + i, hq, cc) : 0.f;
        }
        __syncthreads();
        // scores = R P^T, g V^T (do for now), x = S0 do per row.
        for (int e = threadIdx.x; e < C * C; e += threads) {
          const int i = e / C, j = e % C;
          float s = 0.f, t = 0.f;
          for (int d = 0; d < D; ++d) s += R[i * ldk + d] * P[j * ldk + d];
          for (int cc = 0; cc < Dv; ++cc) t += G[i * ldv + cc] * V[j * ldv + cc];
          SC[i * ldc + j] = s, DO[i * ldc + j] = t;
        }
        for (int e = threadIdx.x; e < C * D; e += threads) {
          const int d = e / C, i = e % C;  // a lane a row: S0's row is one broadcast read
          float s = 0.f;
          for (int cc = 0; cc < Dv; ++cc) s += G[i * ldv + cc] * s0.S()[d * Dv + cc];
          X[i * ldk + d] = s;
        }
        __syncthreads();
        // Per row: do . num, den, g's scale, delta and kappa_i.
        if (threadIdx.x < C) {
          const int i = threadIdx.x;
          float rx = 0.f, rz = 0.f;
          for (int d = 0; d < D; ++d)
            rx += R[i * ldk + d] * X[i * ldk + d], rz += R[i * ldk + d] * s0.z()[d];
          float don = cn[i] * rx, asum = 0.f;
          for (int j = 0; j < C; ++j) {
            const float a = SC[i * ldc + j] * WN[i * ldc + j];
            don += a * DO[i * ldc + j];
            asum += a;
          }
          if (normalize) {
            const float iv = live[i] / (cn[i] * rz + asum + f.eps);
            inv[i] = iv;
            delta[i] = -don * iv * iv;
            kap[i] = f.eps * delta[i];
          } else {
            inv[i] = 1.f, delta[i] = 0.f, kap[i] = -don;
          }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < C * Dv; e += threads) G[e / Dv * ldv + e % Dv] *= inv[e / Dv];
        for (int e = threadIdx.x; e < C * C; e += threads) {
          const int i = e / C, x = i * ldc + e % C;
          DO[x] = (DO[x] * inv[i] + delta[i]) * WN[x];  // dscore
        }
        for (int e = threadIdx.x; e < C * D; e += threads) {
          const int i = e / D, d = e % D, x = i * ldk + d;
          X[x] = cn[i] * (X[x] * inv[i] + delta[i] * s0.z()[d]);
        }
        __syncthreads();
        // dr += dscore P; dphik += dscore^T R; dv += A^T g; da += colsum(SC o dscore) + wn^T kappa.
        for (int e = threadIdx.x; e < C * D; e += threads) {
          const int i = e / D, d = e % D;  // dr row i; dphik row i (as j)
          float s = 0.f, t = 0.f;
          for (int j = 0; j < C; ++j) {
            s += DO[i * ldc + j] * P[j * ldk + d];
            t += DO[j * ldc + i] * R[j * ldk + d];
          }
          X[i * ldk + d] += s, E[i * ldk + d] += t;
        }
        for (int e = threadIdx.x; e < C * Dv; e += threads) {
          const int j = e / Dv, cc = e % Dv;
          float s = 0.f;
          for (int i = 0; i < C; ++i) s += SC[i * ldc + j] * WN[i * ldc + j] * G[i * ldv + cc];
          DV[j * ldv + cc] += s;
        }
        if (threadIdx.x < C) {
          const int j = threadIdx.x;
          float s = 0.f;
          for (int i = 0; i < C; ++i)
            s += SC[i * ldc + j] * DO[i * ldc + j] + WN[i * ldc + j] * kap[i];
          da[j] += s;
        }
        if (threadIdx.x == 0) {
          float s = scal[2];
          for (int i = 0; i < C; ++i) s += beta[i] * kap[i];
          scal[2] = s;
        }
        __syncthreads();
        store_phi_grad<Dev, Policy>(X, f.scale, f.q, f.q_stride, bp.dq, bp.dq_stride, batch, t0,
                                    rows, hq, D, ok);
        // dS' += R^T (beta g), dz' += R^T (beta delta).
        for (int e = threadIdx.x; e < D * Dv; e += threads) {
          const int d = e / Dv, cc = e % Dv;
          float s = dSn[e];
          for (int i = 0; i < C; ++i) s += R[i * ldk + d] * beta[i] * G[i * ldv + cc];
          dSn[e] = s;
        }
        for (int d = threadIdx.x; d < D; d += threads) {
          float s = dSn[D * Dv + d];
          for (int i = 0; i < C; ++i) s += R[i * ldk + d] * beta[i] * delta[i];
          dSn[D * Dv + d] = s;
        }
        __syncthreads();  // R, G, X free for the next head
      }
      // dk = dphik phi'(k), dv, da (0 at pads).
      store_phi_grad<Dev, Policy>(E, 1.f, f.k, f.k_stride, bp.dk, bp.dk_stride, batch, t0, rows, h,
                                  D, ok);
      for (int e = threadIdx.x; e < C * Dv; e += threads) {
        const int j = e / Dv, cc = e % Dv;
        if (j < rows)
          store_act<Dev>(bp.dv, bp.dv_stride, batch, t0 + j, h, cc,
                         ok[j] != 0.f ? DV[j * ldv + cc] : 0.f);
      }
      if (threadIdx.x < rows) {
        const int j = threadIdx.x;
        const float y = ok[j] != 0.f ? da[j] : 0.f;
        if (da_heads != nullptr)
          da_heads[(index_t(h) * bp.batch + batch) * f.tokens + t0 + j] = y;
        else
          bp.da[batch * bp.da_stride[0] + (t0 + j) * bp.da_stride[1] +
                (f.gate_heads == 1 ? 0 : h) * bp.da_stride[2]] = y;
      }
      __syncthreads();
      float* t = dS;  // dS, dz before the chunk become the carried gradient
      dS = dS2, dS2 = t;
      if (threadIdx.x == 0) scal[1] = scal[2];
      __syncthreads();
    }
  }

  // The initial state's gradient; d lse_in = kappa + <S0, dS> + <z0, dz> (0 for an empty state).
  for (int e = threadIdx.x; e < D * Dv; e += threads)
    if (bp.dS_in != nullptr)
      bp.dS_in[n * bp.dS_in_stride[0] + h * bp.dS_in_stride[1] + (e / Dv) * bp.dS_in_stride[2] +
               (e % Dv) * bp.dS_in_stride[3]] = dS[e];
  for (int d = threadIdx.x; d < D; d += threads)
    if (bp.dz_in != nullptr)
      bp.dz_in[n * bp.dz_in_stride[0] + h * bp.dz_in_stride[1] + d * bp.dz_in_stride[2]] =
          dS[D * Dv + d];
  if (bp.dlse_in != nullptr) {
    const bool has = f.S_in != nullptr && f.lse_in != nullptr &&
                     f.lse_in[n * f.lse_in_stride[0] + h * f.lse_in_stride[1]] != -INFINITY;
    float s = 0.f;
    if (has) {
      for (int e = threadIdx.x; e < D * Dv; e += threads)
        s += dS[e] * f.S_in[n * f.S_in_stride[0] + h * f.S_in_stride[1] +
                            (e / Dv) * f.S_in_stride[2] + (e % Dv) * f.S_in_stride[3]];
      if (f.z_in != nullptr)
        for (int d = threadIdx.x; d < D; d += threads)
          s += dS[D * Dv + d] *
               f.z_in[n * f.z_in_stride[0] + h * f.z_in_stride[1] + d * f.z_in_stride[2]];
    }
    s = block_reduce<false>(s, red);
    if (threadIdx.x == 0)
      bp.dlse_in[n * bp.dlse_in_stride[0] + h * bp.dlse_in_stride[1]] = has ? scal[1] + s : 0.f;
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
