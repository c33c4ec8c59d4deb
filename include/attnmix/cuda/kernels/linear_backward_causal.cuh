#pragma once
// CUDA-core kernels of the causal linear-attention backward (kind::linear_causal, no key gate),
// chunks of `chunk` tokens, in launch order (plan/linear_backward.hpp):
//   linear_bwd_chunk_sums_kernel    each chunk's own P^T V, sum P (state_sums)
//   linear_bwd_scan_kernel          in place: the state before each chunk (from state_in)
//   linear_bwd_causal_query_kernel  dq, g = do / den, delta, and each chunk's R^T g, R^T delta
//   linear_bwd_reverse_scan_kernel  in place: the gradient of the state after each chunk (from
//                                   dstate_out); the total is dstate_in
//   linear_bwd_causal_key_kernel    dk, dv
//   linear_bwd_norm_kernel          (a gated norm) do and dgate from the recomputed output
// Chunk c of sequence n is state slot slot_offsets[n] + c (a slot a chunk on CUDA cores; the
// tensor-core kernels of sm80_linear_backward_causal.cuh walk several). Under the prefix key gate
// (tensor cores only) the scans are linear_bwd_gated_scan_kernel and
// linear_bwd_gated_reverse_scan_kernel, and linear_bwd_gated_dlse_kernel ends the backward. Sums
// run in a fixed order.

#include "attnmix/cuda/collective/causal_scan.cuh"
#include "attnmix/cuda/collective/linear_params.cuh"
#include "attnmix/cuda/collective/linear_rows.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// CTA (chunk c, KV head h, sequence n).
template <class Dev, class Policy>
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_chunk_sums_kernel(const linear_backward_params bp, index_t chunk,
                                 const int* slot_offsets, float* state) {
  extern __shared__ __align__(16) float smem[];
  const int c = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  if (c >= slot_offsets[n + 1] - slot_offsets[n]) return;
  index_t batch, start, length;
  bp.f.sequence(n, batch, start, length);
  const index_t t0 = index_t(c) * chunk, t1 = min(length, t0 + chunk);
  const index_t SS = index_t(bp.f.head_dim) * bp.f.value_dim + bp.f.head_dim;
  float* out = state + (index_t(slot_offsets[n] + c) * bp.f.kv_heads + h) * SS;
  state_sums<Dev, Policy>(bp, n, batch, start, h, t0, t1, nullptr, smem, out);
}

// Thread (element idx of [S | z], KV head h, sequence n) of both scans below: walks the slots of
// one state element, `linear_bwd_scan_batch` loads in flight before their stores (one slot's
// elements sit across the CTAs of grid.x, so each step is coalesced and the walk's latency is
// shared by D * Dv / 128 CTAs a head instead of one). `acc` is the running sum on entry; slot c
// gets the sum before it, in chunk order (Forward) or from the end.
template <bool Forward>
__device__ __forceinline__ float scan_slots(float* base, index_t stride, int first, int count,
                                            float acc) {
  constexpr int U = linear_bwd_scan_batch;
  for (int i = 0; i < count; i += U) {
    float own[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = Forward ? first + i + u : first + count - 1 - i - u;
      own[u] = i + u < count ? base[index_t(c) * stride] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = Forward ? first + i + u : first + count - 1 - i - u;
      if (i + u < count) base[index_t(c) * stride] = acc;
      acc += own[u];
    }
  }
  return acc;
}

// Thread (idx, KV head h, sequence n): slot c <- state_in + sum of the slots before c.
__global__ void __launch_bounds__(linear_bwd_scan_threads)
    linear_bwd_scan_kernel(const linear_backward_params bp, const int* slot_offsets, float* state) {
  const linear_kernel_params& f = bp.f;
  const int idx = blockIdx.x * linear_bwd_scan_threads + threadIdx.x, h = blockIdx.y,
            n = blockIdx.z, D = f.head_dim, Dv = f.value_dim, SS = D * Dv + D;
  if (idx >= SS) return;
  float x = 0.f;
  if (idx < D * Dv) {
    if (f.S_in != nullptr)
      x = f.S_in[n * f.S_in_stride[0] + h * f.S_in_stride[1] + (idx / Dv) * f.S_in_stride[2] +
                 (idx % Dv) * f.S_in_stride[3]];
  } else if (f.z_in != nullptr) {
    x = f.z_in[n * f.z_in_stride[0] + h * f.z_in_stride[1] + (idx - D * Dv) * f.z_in_stride[2]];
  }
  const int first = slot_offsets[n];
  scan_slots<true>(state + (index_t(first) * f.kv_heads + h) * SS + idx, index_t(f.kv_heads) * SS,
                   0, slot_offsets[n + 1] - first, x);
}

// CTA (chunk c, KV head h, sequence n): for every query head of h's group and every row i of
// the chunk, with S_c, z_c the state before the chunk and A_ij = r_i . p_j (j <= i):
//   num_i = S_c^T r_i + sum_j A_ij v_j, den_i = r_i . z_c + sum_j A_ij + eps,
//   g_i = do_i / den_i, delta_i = -(do_i . num_i) / den_i^2   (den = 1, delta = 0 unnormalised)
//   dq_i = scale phi'(q_i) (S_c g_i + delta_i z_c + sum_j (g_i . v_j + delta_i) p_j)
// 1 / den and delta go to inv_buf / delta_buf for the key pass (which takes g from do again); the
// chunk's sum R^T g, R^T delta over the group's heads to dstate's slot.
template <class Dev, class Policy>
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_causal_query_kernel(const linear_backward_params bp, index_t chunk,
                                   const int* slot_offsets, const float* state, float* dstate,
                                   float* inv_buf, float* delta_buf) {
  constexpr int TT = int(linear_bwd_tile), R = linear_bwd_state_regs;
  constexpr bool normalize = Policy::normalize;
  extern __shared__ __align__(16) float smem[];
  const linear_kernel_params& f = bp.f;
  const int D = f.head_dim, Dv = f.value_dim, SS = D * Dv + D, C = int(chunk);
  const int c = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  if (c >= slot_offsets[n + 1] - slot_offsets[n]) return;
  float* P = smem;           // [C][D]  phi(k), 0 at pads
  float* V = P + C * D;      // [C][Dv]
  float* Q = V + C * Dv;     // [TT][D]
  float* Rr = Q + TT * D;    // [TT][D] scale phi(q), 0 at pads
  float* G = Rr + TT * D;    // [TT][Dv] do, then g
  float* NUM = G + TT * Dv;  // [TT][Dv]
  float* A = NUM + TT * Dv;  // [TT][C]
  float* DS = A + TT * C;    // [TT][C]
  float* INV = DS + TT * C;  // [TT]
  float* DEL = INV + TT;     // [TT]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  index_t batch, start, length;
  f.sequence(n, batch, start, length);
  const index_t c0 = index_t(c) * C;
  const int rows_c = int(min(index_t(C), length - c0));
  const index_t slot = index_t(slot_offsets[n] + c) * f.kv_heads + h;
  const float* S = state + slot * SS;
  const float* z = S + D * Dv;

  for (int e = threadIdx.x; e < C * D; e += blockDim.x) {
    const int j = e / D, d = e % D;
    const bool ok = j < rows_c && f.valid(batch, start + c0 + j);
    P[e] = ok ? apply_feature_map<Policy::phi>(
                    load_act<Dev>(f.k, f.k_stride, batch, start + c0 + j, h, d))
              : 0.f;
  }
  for (int e = threadIdx.x; e < C * Dv; e += blockDim.x) {
    const int j = e / Dv, cc = e % Dv;
    const bool ok = j < rows_c && f.valid(batch, start + c0 + j);
    V[e] = ok ? load_act<Dev>(f.v, f.v_stride, batch, start + c0 + j, h, cc) : 0.f;
  }

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int hq = h * f.group; hq < (h + 1) * f.group; ++hq) {
    for (int i0 = 0; i0 < rows_c; i0 += TT) {
      const int rows = min(TT, rows_c - i0);
      const index_t tb = start + c0 + i0;  // absolute token of tile row 0
      __syncthreads();
      for (int e = threadIdx.x; e < TT * D; e += blockDim.x) {
        const int t = e / D, d = e % D;
        const bool ok = t < rows && f.valid(batch, tb + t);
        const float x = ok ? load_act<Dev>(f.q, f.q_stride, batch, tb + t, hq, d) : 0.f;
        Q[e] = x;
        Rr[e] = ok ? f.scale * apply_feature_map<Policy::phi>(x) : 0.f;
      }
      for (int e = threadIdx.x; e < TT * Dv; e += blockDim.x) {
        const int t = e / Dv, cc = e % Dv;
        const bool ok = t < rows && f.valid(batch, tb + t);
        G[e] = ok ? load_act<Dev>(bp.dout, bp.dout_stride, batch, tb + t, hq, cc) : 0.f;
      }
      __syncthreads();
      for (int e = threadIdx.x; e < TT * C; e += blockDim.x) {
        const int t = e / C, j = e % C;
        float s = 0.f;
        if (t < rows && j <= i0 + t)
          for (int d = 0; d < D; ++d) s += Rr[t * D + d] * P[j * D + d];
        A[e] = s;
      }
      __syncthreads();
      for (int e = threadIdx.x; e < TT * Dv; e += blockDim.x) {
        const int t = e / Dv, cc = e % Dv;
        float s = 0.f;
        for (int d = 0; d < D; ++d) s += Rr[t * D + d] * S[d * Dv + cc];
        for (int j = 0; j <= min(i0 + t, C - 1); ++j) s += A[t * C + j] * V[j * Dv + cc];
        NUM[e] = s;
      }
      {  // warp `warp` owns row `warp`
        float s = 0.f;
        if (normalize) {
          for (int d = lane; d < D; d += 32) s += Rr[warp * D + d] * z[d];
          for (int j = lane; j < C; j += 32) s += A[warp * C + j];
        }
        s = warp_sum(s);
        if (lane == 0) INV[warp] = normalize ? 1.f / (s + f.eps) : 1.f;
      }
      __syncthreads();
      {
        float s = 0.f;
        for (int cc = lane; cc < Dv; cc += 32) s += G[warp * Dv + cc] * NUM[warp * Dv + cc];
        s = warp_sum(s);
        const float inv = INV[warp];
        const float del = normalize ? -s * inv * inv : 0.f;
        for (int cc = lane; cc < Dv; cc += 32) G[warp * Dv + cc] *= inv;
        if (lane == 0) DEL[warp] = del;
      }
      __syncthreads();
      if (threadIdx.x < rows) {
        const index_t row = (batch * f.tokens + tb + threadIdx.x) * f.q_heads + hq;
        inv_buf[row] = INV[threadIdx.x], delta_buf[row] = DEL[threadIdx.x];
      }
      for (int e = threadIdx.x; e < TT * C; e += blockDim.x) {
        const int t = e / C, j = e % C;
        float s = 0.f;
        if (t < rows && j <= i0 + t && j < rows_c) {
          s = DEL[t];
          for (int cc = 0; cc < Dv; ++cc) s += G[t * Dv + cc] * V[j * Dv + cc];
        }
        DS[e] = s;
      }
      __syncthreads();
      for (int e = threadIdx.x; e < TT * D; e += blockDim.x) {
        const int t = e / D, d = e % D;
        if (t >= rows) continue;
        float y = 0.f;
        if (f.valid(batch, tb + t)) {
          float s = DEL[t] * z[d];
          for (int cc = 0; cc < Dv; ++cc) s += S[d * Dv + cc] * G[t * Dv + cc];
          for (int j = 0; j <= min(i0 + t, C - 1); ++j) s += DS[t * C + j] * P[j * D + d];
          const float x = Q[e];
          y = f.scale * s * phi_derivative<Policy::phi>(x, apply_feature_map<Policy::phi>(x));
        }
        store_act<Dev>(bp.dq, bp.dq_stride, batch, tb + t, hq, d, y);
      }
      add_state_products(acc, Rr, G, DEL, rows, D, Dv);
    }
  }
  float* out = dstate + slot * SS;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int idx = threadIdx.x + r * linear_bwd_threads;
    if (idx < SS) out[idx] = acc[r];
  }
}

// The (sequence, head) pair's dS_out or dz_out element idx of [S | z] (0 where not given).
__device__ __forceinline__ float dstate_out_value(const linear_backward_params& bp, int n, int h,
                                                  int idx) {
  const int D = bp.f.head_dim, Dv = bp.f.value_dim;
  if (idx < D * Dv)
    return bp.dS_out == nullptr
               ? 0.f
               : bp.dS_out[n * bp.dS_out_stride[0] + h * bp.dS_out_stride[1] +
                           (idx / Dv) * bp.dS_out_stride[2] + (idx % Dv) * bp.dS_out_stride[3]];
  return bp.dz_out == nullptr ? 0.f
                              : bp.dz_out[n * bp.dz_out_stride[0] + h * bp.dz_out_stride[1] +
                                          (idx - D * Dv) * bp.dz_out_stride[2]];
}

// x to the (sequence, head) pair's dS_in or dz_in element idx of [S | z], where given.
__device__ __forceinline__ void store_dstate_in(const linear_backward_params& bp, int n, int h,
                                                int idx, float x) {
  const int D = bp.f.head_dim, Dv = bp.f.value_dim;
  if (idx < D * Dv) {
    if (bp.dS_in != nullptr)
      bp.dS_in[n * bp.dS_in_stride[0] + h * bp.dS_in_stride[1] + (idx / Dv) * bp.dS_in_stride[2] +
               (idx % Dv) * bp.dS_in_stride[3]] = x;
  } else if (bp.dz_in != nullptr) {
    bp.dz_in[n * bp.dz_in_stride[0] + h * bp.dz_in_stride[1] +
             (idx - D * Dv) * bp.dz_in_stride[2]] = x;
  }
}

// Thread (idx, KV head h, sequence n): slot c <- dstate_out + sum of the slots after c;
// dstate_in gets dstate_out + the sum of every slot.
__global__ void __launch_bounds__(linear_bwd_scan_threads)
    linear_bwd_reverse_scan_kernel(const linear_backward_params bp, const int* slot_offsets,
                                   float* dstate) {
  const linear_kernel_params& f = bp.f;
  const int idx = blockIdx.x * linear_bwd_scan_threads + threadIdx.x, h = blockIdx.y,
            n = blockIdx.z, D = f.head_dim, Dv = f.value_dim, SS = D * Dv + D;
  if (idx >= SS) return;
  const int first = slot_offsets[n];
  const float x = scan_slots<false>(dstate + (index_t(first) * f.kv_heads + h) * SS + idx,
                                    index_t(f.kv_heads) * SS, 0, slot_offsets[n + 1] - first,
                                    dstate_out_value(bp, n, h, idx));
  store_dstate_in(bp, n, h, idx, x);
}

// ---- the scans under the prefix key gate (the tensor-core walks of
// sm80_linear_backward_causal.cuh; slots of D Dv + D + 4 floats) ------------------------------

// Thread (element idx of [S | z], KV head h, sequence n): slot c <- the state before it relative
// to its running max, which goes to the slot's floats SS + 2 with the mass at SS + 3 (the slot's
// own max and mass, at SS and SS + 1, are read). Then for the gradient of the log-mass after the
// last slot: totals[4 (n H + h) ..] = (max, mass) of the final state, and part[(n H + h) grid.x +
// blockIdx.x] = this CTA's sum of dS_out S + dz_out z over its elements of that state.
template <class Policy>
__global__ void __launch_bounds__(linear_bwd_scan_threads)
    linear_bwd_gated_scan_kernel(const linear_backward_params bp, const int* slot_offsets,
                                 float* state, float* totals, float* part) {
  __shared__ float red[linear_bwd_scan_threads / 32];
  const linear_kernel_params& f = bp.f;
  const int idx = blockIdx.x * linear_bwd_scan_threads + threadIdx.x, h = blockIdx.y,
            n = blockIdx.z, SS = f.head_dim * f.value_dim + f.head_dim, SSg = SS + 4;
  const bool mine = idx < SS;
  float x = mine ? state_in_value(f, n, h, idx) : 0.f, m, ell;
  state_in_mass<Policy>(f, n, h, m, ell);
  const int first = slot_offsets[n], count = slot_offsets[n + 1] - first;
  float* base = state + (index_t(first) * f.kv_heads + h) * SSg;
  const index_t stride = index_t(f.kv_heads) * SSg;
  constexpr int U = linear_bwd_scan_batch;
  for (int i = 0; i < count; i += U) {
    float own[U], om[U], ol[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float* slot = base + (i + u) * stride;
      const bool in = i + u < count;
      own[u] = in && mine ? slot[idx] : 0.f;
      om[u] = in ? slot[SS] : -INFINITY, ol[u] = in ? slot[SS + 1] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i + u >= count) break;
      float* slot = base + (i + u) * stride;
      if (mine) slot[idx] = x;
      if (idx == SS) slot[SS + 2] = m;
      if (idx == SS + 1) slot[SS + 3] = ell;
      const float M = fmaxf(m, om[u]);
      x = x * rescale_factor(m, M) + own[u] * rescale_factor(om[u], M);
      lse_merge(m, ell, om[u], ol[u]);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    totals[4 * (index_t(n) * f.kv_heads + h)] = m;
    totals[4 * (index_t(n) * f.kv_heads + h) + 1] = ell;
  }
  const float t = block_reduce<false>(mine ? x * dstate_out_value(bp, n, h, idx) : 0.f, red);
  if (threadIdx.x == 0) part[(index_t(n) * f.kv_heads + h) * gridDim.x + blockIdx.x] = t;
}

// Thread (element idx of [dS | dz | kappa], KV head h, sequence n): slot c <- the gradient of the
// state after it (relative to that state's mass), from dstate_out and kappa = -(dS_out . S +
// dz_out . z) / ell + dlse_out of the final state; before a slot the gradient is the slot's own
// sum plus rho times the one after it, rho = the mass before the slot over the mass after it.
// The total is dstate_in; kappa before the first slot goes to totals[4 (n H + h) + 2] and the
// CTA's sum of S_in dS_in + z_in dz_in to part2 for linear_bwd_gated_dlse_kernel.
__global__ void __launch_bounds__(linear_bwd_scan_threads)
    linear_bwd_gated_reverse_scan_kernel(const linear_backward_params bp, const int* slot_offsets,
                                         const float* state, float* dstate, float* totals,
                                         const float* part, float* part2) {
  __shared__ float red[linear_bwd_scan_threads / 32];
  const linear_kernel_params& f = bp.f;
  const int idx = blockIdx.x * linear_bwd_scan_threads + threadIdx.x, h = blockIdx.y,
            n = blockIdx.z, D = f.head_dim, Dv = f.value_dim, SS = D * Dv + D, SSg = SS + 4;
  const bool mine = idx < SS, kap = idx == SS;
  const index_t pair = index_t(n) * f.kv_heads + h;
  float m1 = totals[4 * pair], ell1 = totals[4 * pair + 1];  // the mass after the slot
  float x = mine ? dstate_out_value(bp, n, h, idx) : 0.f;
  if (kap && ell1 > 0.f) {
    float sum = 0.f;
    for (unsigned b = 0; b < gridDim.x; ++b) sum += part[pair * gridDim.x + b];
    x = -sum / ell1;
    if (bp.dlse_out != nullptr)
      x += bp.dlse_out[n * bp.dlse_out_stride[0] + h * bp.dlse_out_stride[1]];
  }
  const int first = slot_offsets[n], count = slot_offsets[n + 1] - first;
  float* base = dstate + (index_t(first) * f.kv_heads + h) * SSg;
  const float* sbase = state + (index_t(first) * f.kv_heads + h) * SSg;
  const index_t stride = index_t(f.kv_heads) * SSg;
  constexpr int U = linear_bwd_scan_batch;
  for (int i = 0; i < count; i += U) {
    float own[U], m0[U], ell0[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = count - 1 - i - u;
      const bool in = c >= 0;
      own[u] = in && (mine || kap) ? base[c * stride + idx] : 0.f;
      m0[u] = in ? sbase[c * stride + SS + 2] : -INFINITY;
      ell0[u] = in ? sbase[c * stride + SS + 3] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = count - 1 - i - u;
      if (c < 0) break;
      if (mine || kap) base[c * stride + idx] = x;
      const float rho = ell1 > 0.f ? shifted_exp(m0[u], m1) * ell0[u] / ell1 : 0.f;
      x = own[u] + rho * x;
      m1 = m0[u], ell1 = ell0[u];
    }
  }
  if (mine) store_dstate_in(bp, n, h, idx, x);
  if (kap) totals[4 * pair + 2] = x;
  if (bp.dlse_in == nullptr) return;  // (uniform)
  const float t = block_reduce<false>(mine ? x * state_in_value(f, n, h, idx) : 0.f, red);
  if (threadIdx.x == 0) part2[pair * gridDim.x + blockIdx.x] = t;
}

// Thread 0 of CTA (KV head h, sequence n): d lse_in = kappa + <S_in, dS_in> + <z_in, dz_in>
// before the first token (0 for an empty state), from the reverse scan's `parts` sums.
__global__ void linear_bwd_gated_dlse_kernel(const linear_backward_params bp, const float* totals,
                                             const float* part2, int parts) {
  const linear_kernel_params& f = bp.f;
  const int h = blockIdx.x, n = blockIdx.y;
  if (threadIdx.x != 0) return;
  const index_t pair = index_t(n) * f.kv_heads + h;
  const bool has = f.S_in != nullptr && f.lse_in != nullptr &&
                   f.lse_in[n * f.lse_in_stride[0] + h * f.lse_in_stride[1]] != -INFINITY;
  float s = totals[4 * pair + 2];
  for (int b = 0; b < parts; ++b) s += part2[pair * parts + b];
  bp.dlse_in[n * bp.dlse_in_stride[0] + h * bp.dlse_in_stride[1]] = has ? s : 0.f;
}

// CTA (chunk c, KV head h, sequence n): with dS_c, dz_c the gradient of the state after the
// chunk, for every key j of the chunk:
//   e_j = dS_c v_j + dz_c + sum_{hq, i >= j} (g_i . v_j + delta_i) r_i,
//   dv_j = dS_c^T p_j + sum_{hq, i >= j} (r_i . p_j) g_i,   dk_j = e_j phi'(k_j).
template <class Dev, class Policy>
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_causal_key_kernel(const linear_backward_params bp, index_t chunk,
                                 const int* slot_offsets, const float* dstate, const float* inv_buf,
                                 const float* delta_buf) {
  constexpr int TT = int(linear_bwd_tile);
  extern __shared__ __align__(16) float smem[];
  const linear_kernel_params& f = bp.f;
  const int D = f.head_dim, Dv = f.value_dim, SS = D * Dv + D, C = int(chunk);
  const int c = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  if (c >= slot_offsets[n + 1] - slot_offsets[n]) return;
  float* P = smem;           // [C][D]
  float* V = P + C * D;      // [C][Dv]
  float* E = V + C * Dv;     // [C][D]
  float* DVv = E + C * D;    // [C][Dv]
  float* Rr = DVv + C * Dv;  // [TT][D]
  float* G = Rr + TT * D;    // [TT][Dv]
  float* A = G + TT * Dv;    // [TT][C]
  float* DS = A + TT * C;    // [TT][C]
  float* DEL = DS + TT * C;  // [TT]
  index_t batch, start, length;
  f.sequence(n, batch, start, length);
  const index_t c0 = index_t(c) * C;
  const int rows_c = int(min(index_t(C), length - c0));
  const float* dS = dstate + (index_t(slot_offsets[n] + c) * f.kv_heads + h) * SS;
  const float* dz = dS + D * Dv;

  for (int e = threadIdx.x; e < C * D; e += blockDim.x) {
    const int j = e / D, d = e % D;
    const bool ok = j < rows_c && f.valid(batch, start + c0 + j);
    P[e] = ok ? apply_feature_map<Policy::phi>(
                    load_act<Dev>(f.k, f.k_stride, batch, start + c0 + j, h, d))
              : 0.f;
  }
  for (int e = threadIdx.x; e < C * Dv; e += blockDim.x) {
    const int j = e / Dv, cc = e % Dv;
    const bool ok = j < rows_c && f.valid(batch, start + c0 + j);
    V[e] = ok ? load_act<Dev>(f.v, f.v_stride, batch, start + c0 + j, h, cc) : 0.f;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < C * D; e += blockDim.x) {
    const int j = e / D, d = e % D;
    float s = dz[d];
    for (int cc = 0; cc < Dv; ++cc) s += dS[d * Dv + cc] * V[j * Dv + cc];
    E[e] = s;
  }
  for (int e = threadIdx.x; e < C * Dv; e += blockDim.x) {
    const int j = e / Dv, cc = e % Dv;
    float s = 0.f;
    for (int d = 0; d < D; ++d) s += P[j * D + d] * dS[d * Dv + cc];
    DVv[e] = s;
  }
  for (int hq = h * f.group; hq < (h + 1) * f.group; ++hq) {
    for (int i0 = 0; i0 < rows_c; i0 += TT) {
      const int rows = min(TT, rows_c - i0);
      const index_t tb = start + c0 + i0;
      __syncthreads();
      for (int e = threadIdx.x; e < TT * D; e += blockDim.x) {
        const int t = e / D, d = e % D;
        const bool ok = t < rows && f.valid(batch, tb + t);
        Rr[e] = ok ? f.scale * apply_feature_map<Policy::phi>(
                                   load_act<Dev>(f.q, f.q_stride, batch, tb + t, hq, d))
                   : 0.f;
      }
      for (int e = threadIdx.x; e < TT * Dv; e += blockDim.x) {
        const int t = e / Dv, cc = e % Dv;
        const bool ok = t < rows && f.valid(batch, tb + t);  // g = do / den, as the query pass
        G[e] = ok ? load_act<Dev>(bp.dout, bp.dout_stride, batch, tb + t, hq, cc) *
                        inv_buf[(batch * f.tokens + tb + t) * f.q_heads + hq]
                  : 0.f;
      }
      if (threadIdx.x < TT)
        DEL[threadIdx.x] = int(threadIdx.x) < rows
                               ? delta_buf[(batch * f.tokens + tb + threadIdx.x) * f.q_heads + hq]
                               : 0.f;
      __syncthreads();
      for (int e = threadIdx.x; e < TT * C; e += blockDim.x) {
        const int t = e / C, j = e % C;
        float a = 0.f, ds = 0.f;
        if (t < rows && j <= i0 + t && j < rows_c) {
          for (int d = 0; d < D; ++d) a += Rr[t * D + d] * P[j * D + d];
          ds = DEL[t];
          for (int cc = 0; cc < Dv; ++cc) ds += G[t * Dv + cc] * V[j * Dv + cc];
        }
        A[e] = a;
        DS[e] = ds;
      }
      __syncthreads();
      for (int e = threadIdx.x; e < C * D; e += blockDim.x) {
        const int j = e / D, d = e % D;
        float s = E[e];
        for (int t = 0; t < TT; ++t) s += DS[t * C + j] * Rr[t * D + d];
        E[e] = s;
      }
      for (int e = threadIdx.x; e < C * Dv; e += blockDim.x) {
        const int j = e / Dv, cc = e % Dv;
        float s = DVv[e];
        for (int t = 0; t < TT; ++t) s += A[t * C + j] * G[t * Dv + cc];
        DVv[e] = s;
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < C * D; e += blockDim.x) {
    const int j = e / D, d = e % D;
    if (j >= rows_c) continue;
    const index_t ta = start + c0 + j;
    float y = 0.f;
    if (f.valid(batch, ta)) {
      const float x = load_act<Dev>(f.k, f.k_stride, batch, ta, h, d);
      y = E[e] * phi_derivative<Policy::phi>(x, P[e]);
    }
    store_act<Dev>(bp.dk, bp.dk_stride, batch, ta, h, d, y);
  }
  for (int e = threadIdx.x; e < C * Dv; e += blockDim.x) {
    const int j = e / Dv, cc = e % Dv;
    if (j >= rows_c) continue;
    const index_t ta = start + c0 + j;
    store_act<Dev>(bp.dv, bp.dv_stride, batch, ta, h, cc, f.valid(batch, ta) ? DVv[e] : 0.f);
  }
}

// CTA (tile of linear_bwd_tile tokens, sequence n): the gated norm's backward of every (token,
// query head) row of the tile from the recomputed core output o ([B, T, HQ, Dv] contiguous):
// dgate to its view, do to dO (same layout), the tile's dgamma sums to dgamma_part[n, tile, hq].
// Warp w takes heads w, w + 8, ..., each over the tile's tokens in order: no barrier, and a head's
// dgamma sums stay in registers (the same order as a column sum over the tile).
template <class Dev, class Policy>
__global__ void __launch_bounds__(linear_bwd_threads, 4)
    linear_bwd_norm_kernel(const linear_backward_params bp, const Dev* o, Dev* dO, index_t tiles,
                           float* dgamma_part) {
  constexpr int TT = int(linear_bwd_tile), W = linear_bwd_threads / 32;
  constexpr int K = int(linear_bwd_max_dim / 32);
  static_assert(W == TT, "the launcher's shared memory: three rows a warp");
  extern __shared__ __align__(16) float smem[];
  const linear_kernel_params& f = bp.f;
  const int Dv = f.value_dim, HQ = f.q_heads;
  const int tile = blockIdx.x, n = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* Ob = smem + 3 * warp * Dv;  // the warp's row: o, then do, then its dgamma terms
  float* DY = Ob + Dv;
  float* DG = DY + Dv;
  index_t batch, start, length;
  f.sequence(n, batch, start, length);
  const index_t base = index_t(tile) * TT;
  const int rows = int(max(index_t(0), min(index_t(TT), length - base)));
  const bool with_dgamma = dgamma_part != nullptr;
  for (int hq = warp; hq < HQ; hq += W) {
    float sum[K];
#pragma unroll
    for (int k = 0; k < K; ++k) sum[k] = 0.f;
    for (int t = 0; t < rows; ++t) {
      const index_t ta = start + base + t;
      const bool ok = f.valid(batch, ta);
      const index_t row = ((batch * f.tokens + ta) * HQ + hq) * Dv;
      for (int cc = lane; cc < Dv; cc += 32) {
        Ob[cc] = ok ? to_float(o[row + cc]) : 0.f;
        DY[cc] = ok ? load_act<Dev>(bp.dout, bp.dout_stride, batch, ta, hq, cc) : 0.f;
      }
      __syncwarp();
      norm_row_backward<Dev, Policy>(bp, batch, ta, hq, true, ok, Ob, DY,
                                     with_dgamma ? DG : nullptr);
      __syncwarp();
      for (int cc = lane; cc < Dv; cc += 32) dO[row + cc] = from_float<Dev>(DY[cc]);
      if (with_dgamma)
#pragma unroll
        for (int k = 0; k < K; ++k)
          if (lane + 32 * k < Dv) sum[k] += DG[lane + 32 * k];
      __syncwarp();  // the row's buffers are free
    }
    if (with_dgamma)
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (lane + 32 * k < Dv)
          dgamma_part[((index_t(n) * tiles + tile) * HQ + hq) * Dv + lane + 32 * k] = sum[k];
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
