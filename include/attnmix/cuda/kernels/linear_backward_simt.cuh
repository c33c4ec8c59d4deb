#pragma once
// CUDA-core kernels of the linear-attention backward (spec gbla.md §3.4), float accumulation.
// Bidirectional (bla, gbla), in launch order (plan/linear_backward.hpp):
//   linear_bwd_stats_kernel    key-gate softmax statistics (max, 1 / sum) per (sequence, gate head)
//   linear_bwd_reduce_kernel   partial S, z of a range of tokens
//   linear_bwd_combine_kernel  partials summed in part order (the state, then its gradient)
//   linear_bwd_query_kernel    pass A: dq, the gated norm's backward, partial dS, dz
//   linear_bwd_jac_kernel      <dS, S> + <dz, z> (the key gate's softmax Jacobian term)
//   linear_bwd_key_kernel      pass B: dk, dv, da
//   linear_bwd_fold_*          dgamma over parts and heads, a shared gate's da over heads
// The state sums and the gated norm's row backward they share with the causal kernels are in
// collective/linear_rows.cuh. Every reduction has a fixed order (a thread owns each output
// element, or a fixed tree), so the gradients are the same bits on every run. A kernel's CTA has
// linear_bwd_threads threads, one warp per row of a linear_bwd_tile-row tile.

#include <cmath>
#include <cstdint>

#include "attnmix/core/linear_policy.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/fast_math.cuh"
#include "attnmix/cuda/collective/linear_params.cuh"
#include "attnmix/cuda/collective/linear_rows.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

static_assert(linear_bwd_tile * 32 == linear_bwd_threads, "one warp a tile row");

// ---- gate statistics ----------------------------------------------------------------------

// CTA (gate head gh, sequence n): stats[n, gh] = (max, 1 / sum exp(a - max)) over the valid
// tokens, or from saved_lse (w = exp(a - lse)); (-inf, 0) for a sequence without mass.
template <class Policy>
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_stats_kernel(const linear_backward_params bp, float* stats) {
  __shared__ float scratch[8];
  const linear_kernel_params& f = bp.f;
  const int gh = blockIdx.x, n = blockIdx.y;
  float* out = stats + (index_t(n) * f.gate_heads + gh) * 2;
  if (bp.saved_S != nullptr && bp.saved_lse != nullptr) {
    if (threadIdx.x == 0) {
      const float lse = bp.saved_lse[n * bp.saved_lse_stride[0] + gh * bp.saved_lse_stride[1]];
      out[0] = lse;
      out[1] = lse == -INFINITY ? 0.f : 1.f;
    }
    return;
  }
  index_t batch, start, length;
  f.sequence(n, batch, start, length);
  const float M = block_logit_max(f, batch, start, gh, 0, length, scratch);
  float sum = 0.f;
  if (M != -INFINITY)
    for (index_t t = threadIdx.x; t < length; t += blockDim.x) {
      const float a = f.logit(batch, start + t, gh);
      if (a != -INFINITY) sum += expf(a - M);
    }
  sum = block_reduce<false>(sum, scratch);
  if (threadIdx.x == 0) {
    out[0] = M;
    out[1] = M == -INFINITY || !(sum > 0.f) ? 0.f : 1.f / sum;
  }
}

// CTA (part, KV head h, sequence n): the partial state of tokens [part * part_tokens, ...).
template <class Dev, class Policy>
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_reduce_kernel(const linear_backward_params bp, index_t part_tokens, index_t parts,
                             const float* stats, float* partial) {
  extern __shared__ __align__(16) float smem[];
  const int part = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const part_range range(bp.f, n, part, part_tokens);
  const index_t batch = range.batch, start = range.start, t0 = range.t0, t1 = range.t1;
  const index_t SS = index_t(bp.f.head_dim) * bp.f.value_dim + bp.f.head_dim;
  float* out = partial + ((index_t(n) * parts + part) * bp.f.kv_heads + h) * SS;
  state_sums<Dev, Policy>(bp, n, batch, start, h, t0, t1,
                          Policy::gate != key_gate::off ? stats : nullptr, smem, out);
}

// CTA (KV head h, sequence n, slice z): elements z * blockDim .. of dst[n, h] = sum over
// q < parts of src[n, q, h], in q order (the loads of several parts in flight at once).
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_combine_kernel(const float* src, index_t parts, int heads, index_t SS, float* dst) {
  const int h = blockIdx.x, n = blockIdx.y;
  const index_t idx = index_t(blockIdx.z) * blockDim.x + threadIdx.x;
  if (idx >= SS) return;
  const float* p = src + (index_t(n) * parts * heads + h) * SS + idx;
  const index_t step = index_t(heads) * SS;
  float s = 0.f;
  index_t q = 0;
  for (; q + 8 <= parts; q += 8) {
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = p[(q + i) * step];
#pragma unroll
    for (int i = 0; i < 8; ++i) s += x[i];
  }
  for (; q < parts; ++q) s += p[q * step];
  dst[(index_t(n) * heads + h) * SS + idx] = s;
}

// CTA (KV head h, sequence n, slice z): the forward's saved S, z (z = 0 when absent) into
// dst[n, h].
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_load_saved_kernel(const linear_backward_params bp, float* dst) {
  const int h = blockIdx.x, n = blockIdx.y;
  const int D = bp.f.head_dim, Dv = bp.f.value_dim;
  const index_t SS = index_t(D) * Dv + D;
  for (index_t idx = index_t(blockIdx.z) * blockDim.x + threadIdx.x; idx < SS;
       idx += index_t(gridDim.z) * blockDim.x) {
    float x = 0.f;
    if (idx < index_t(D) * Dv) {
      const index_t d = idx / Dv, c = idx % Dv;
      const index_t* s = bp.saved_S_stride;
      x = bp.saved_S[n * s[0] + h * s[1] + d * s[2] + c * s[3]];
    } else if (bp.saved_z != nullptr) {
      const index_t* s = bp.saved_z_stride;
      x = bp.saved_z[n * s[0] + h * s[1] + (idx - index_t(D) * Dv) * s[2]];
    }
    dst[(index_t(n) * bp.f.kv_heads + h) * SS + idx] = x;
  }
}

// ---- pass A: query rows -------------------------------------------------------------------

// CTA (part, KV head h, sequence n): for every query head of h's group and every row of the
// part: do through the gated norm, g = do / den, delta = -(do . o) / den, dq = scale (S g +
// delta z) phi'(q); and this part's sums dS = sum r g^T, dz = sum delta r (r = scale phi(q)),
// over the group's heads, into partial[n, part, h]; dgamma terms into dgamma_part[n, part, hq].
template <class Dev, class Policy>
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_query_kernel(const linear_backward_params bp, index_t part_tokens, index_t parts,
                            const float* state, float* partial, float* dgamma_part) {
  constexpr int TT = int(linear_bwd_tile), R = linear_bwd_state_regs;
  constexpr bool normed = Policy::norm != gated_norm::off;
  constexpr bool normalize = Policy::normalize;
  extern __shared__ __align__(16) float smem[];
  const linear_kernel_params& f = bp.f;
  const int D = f.head_dim, Dv = f.value_dim, SS = D * Dv + D;
  float* Q = smem;            // [TT][D] q
  float* Rr = Q + TT * D;     // [TT][D] r = scale phi(q), 0 at pads
  float* X = Rr + TT * D;     // [TT][D] S g
  float* G = X + TT * D;      // [TT][Dv] do, then g
  float* O = G + TT * Dv;     // [TT][Dv] o
  float* DG = O + TT * Dv;    // [TT][Dv] dgamma terms
  float* INV = DG + TT * Dv;  // [TT] 1 / den
  float* DEL = INV + TT;      // [TT] delta

  const int part = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const part_range range(f, n, part, part_tokens);
  const index_t batch = range.batch, start = range.start, t0 = range.t0, t1 = range.t1;
  const float* S = state + (index_t(n) * f.kv_heads + h) * SS;
  const float* z = S + D * Dv;
  const bool with_dgamma = normed && dgamma_part != nullptr;

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int hq = h * f.group; hq < (h + 1) * f.group; ++hq) {
    float dg_acc = 0.f;  // column threadIdx.x of dgamma
    for (index_t base = t0; base < t1; base += TT) {
      const int rows = int(min(index_t(TT), t1 - base));
      __syncthreads();
      for (int e = threadIdx.x; e < TT * D; e += blockDim.x) {
        const int t = e / D, d = e % D;
        const bool ok = t < rows && f.valid(batch, start + base + t);
        const float x = ok ? load_act<Dev>(f.q, f.q_stride, batch, start + base + t, hq, d) : 0.f;
        Q[e] = x;
        Rr[e] = ok ? f.scale * apply_feature_map<Policy::phi>(x) : 0.f;
      }
      for (int e = threadIdx.x; e < TT * Dv; e += blockDim.x) {
        const int t = e / Dv, c = e % Dv;
        const bool ok = t < rows && f.valid(batch, start + base + t);
        G[e] = ok ? load_act<Dev>(bp.dout, bp.dout_stride, batch, start + base + t, hq, c) : 0.f;
      }
      __syncthreads();
      {  // warp `warp` owns row `warp`: 1 / den
        float s = 0.f;
        if (normalize)
          for (int d = lane; d < D; d += 32) s += Rr[warp * D + d] * z[d];
        s = warp_sum(s);
        if (lane == 0) INV[warp] = normalize ? 1.f / (s + f.eps) : 1.f;
      }
      if constexpr (normed) {
        __syncthreads();
        for (int e = threadIdx.x; e < TT * Dv; e += blockDim.x) {
          const int t = e / Dv, c = e % Dv;
          float s = 0.f;
          for (int d = 0; d < D; ++d) s += Rr[t * D + d] * S[d * Dv + c];
          O[e] = s * INV[t];
        }
        __syncthreads();
        {
          const bool exists = warp < rows;
          const bool ok = exists && f.valid(batch, start + base + warp);
          norm_row_backward<Dev, Policy>(bp, batch, start + base + min(warp, rows - 1), hq, exists,
                                         ok, O + warp * Dv, G + warp * Dv,
                                         with_dgamma ? DG + warp * Dv : nullptr);
        }
        __syncthreads();
        if (with_dgamma && threadIdx.x < Dv)
          for (int t = 0; t < rows; ++t) dg_acc += DG[t * Dv + threadIdx.x];
      }
      __syncthreads();
      for (int e = threadIdx.x; e < TT * Dv; e += blockDim.x) G[e] *= INV[e / Dv];
      __syncthreads();
      for (int e = threadIdx.x; e < TT * D; e += blockDim.x) {
        const int t = e / D, d = e % D;
        float s = 0.f;
        for (int c = 0; c < Dv; ++c) s += S[d * Dv + c] * G[t * Dv + c];
        X[e] = s;
      }
      __syncthreads();
      {
        float s = 0.f;
        if (normalize)
          for (int d = lane; d < D; d += 32) s += Rr[warp * D + d] * X[warp * D + d];
        s = warp_sum(s);
        if (lane == 0) DEL[warp] = normalize ? -s * INV[warp] : 0.f;
      }
      __syncthreads();
      for (int e = threadIdx.x; e < TT * D; e += blockDim.x) {
        const int t = e / D, d = e % D;
        if (t >= rows) continue;
        const bool ok = f.valid(batch, start + base + t);
        float y = 0.f;
        if (ok) {
          const float x = Q[e];
          y = f.scale * (X[e] + DEL[t] * z[d]) *
              phi_derivative<Policy::phi>(x, apply_feature_map<Policy::phi>(x));
        }
        store_act<Dev>(bp.dq, bp.dq_stride, batch, start + base + t, hq, d, y);
      }
      add_state_products(acc, Rr, G, DEL, rows, D, Dv);
    }
    if (with_dgamma && threadIdx.x < Dv)
      dgamma_part[((index_t(n) * parts + part) * f.q_heads + hq) * Dv + threadIdx.x] = dg_acc;
  }
  float* out = partial + ((index_t(n) * parts + part) * f.kv_heads + h) * SS;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int idx = threadIdx.x + r * linear_bwd_threads;
    if (idx < SS) out[idx] = acc[r];
  }
}

// CTA (KV head h, sequence n): jac[n, h] = <dS, S> + <dz, z>, in double over a fixed tree.
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_jac_kernel(const float* state, const float* dstate, int heads, index_t SS,
                          float* jac) {
  __shared__ double part[linear_bwd_threads];
  const index_t at = (index_t(blockIdx.y) * heads + blockIdx.x) * SS;
  double s = 0.0;
  for (index_t idx = threadIdx.x; idx < SS; idx += blockDim.x)
    s += double(state[at + idx]) * double(dstate[at + idx]);
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = linear_bwd_threads / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) jac[index_t(blockIdx.y) * heads + blockIdx.x] = float(part[0]);
}

// ---- pass B: keys -------------------------------------------------------------------------

// CTA (part, KV head h, sequence n): with e_j = dS v_j + dz: dv_j = w_j dS^T phi(k_j),
// dk_j = w_j e_j phi'(k_j), da_j = w_j (phi(k_j) . e_j - jac). A shared gate over several KV
// heads writes its per-head da into da_heads[h, b, t] (summed by linear_bwd_fold_da_kernel).
template <class Dev, class Policy>
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_key_kernel(const linear_backward_params bp, index_t part_tokens, const float* stats,
                          const float* dstate, const float* jac, float* da_heads) {
  constexpr int TT = int(linear_bwd_tile);
  constexpr bool gated = Policy::gate != key_gate::off;
  extern __shared__ __align__(16) float smem[];
  const linear_kernel_params& f = bp.f;
  const int D = f.head_dim, Dv = f.value_dim, SS = D * Dv + D;
  float* K = smem;         // [TT][D] k
  float* P = K + TT * D;   // [TT][D] phi(k), 0 at pads
  float* E = P + TT * D;   // [TT][D] e
  float* V = E + TT * D;   // [TT][Dv]
  float* W = V + TT * Dv;  // [TT] gate weight (1 without a gate), 0 at pads

  const int part = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const part_range range(f, n, part, part_tokens);
  const index_t batch = range.batch, start = range.start, t0 = range.t0, t1 = range.t1;
  const float* dS = dstate + (index_t(n) * f.kv_heads + h) * SS;
  const float* dz = dS + D * Dv;
  const float jh = gated ? jac[index_t(n) * f.kv_heads + h] : 0.f;

  for (index_t base = t0; base < t1; base += TT) {
    const int rows = int(min(index_t(TT), t1 - base));
    __syncthreads();
    if (threadIdx.x < TT) {
      const int t = threadIdx.x;
      W[t] =
          t < rows ? gate_weight(f, gated ? stats : nullptr, n, batch, start + base + t, h) : 0.f;
    }
    for (int e = threadIdx.x; e < TT * D; e += blockDim.x) {
      const int t = e / D, d = e % D;
      const bool ok = t < rows && f.valid(batch, start + base + t);
      const float x = ok ? load_act<Dev>(f.k, f.k_stride, batch, start + base + t, h, d) : 0.f;
      K[e] = x;
      P[e] = ok ? apply_feature_map<Policy::phi>(x) : 0.f;
    }
    for (int e = threadIdx.x; e < TT * Dv; e += blockDim.x) {
      const int t = e / Dv, c = e % Dv;
      const bool ok = t < rows && f.valid(batch, start + base + t);
      V[e] = ok ? load_act<Dev>(f.v, f.v_stride, batch, start + base + t, h, c) : 0.f;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < TT * D; e += blockDim.x) {
      const int t = e / D, d = e % D;
      float s = Policy::normalize ? dz[d] : 0.f;
      for (int c = 0; c < Dv; ++c) s += dS[d * Dv + c] * V[t * Dv + c];
      E[e] = s;
    }
    for (int e = threadIdx.x; e < TT * Dv; e += blockDim.x) {
      const int t = e / Dv, c = e % Dv;
      if (t >= rows) continue;
      const bool ok = f.valid(batch, start + base + t);
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += P[t * D + d] * dS[d * Dv + c];
      store_act<Dev>(bp.dv, bp.dv_stride, batch, start + base + t, h, c, ok ? W[t] * s : 0.f);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < TT * D; e += blockDim.x) {
      const int t = e / D, d = e % D;
      if (t >= rows) continue;
      const bool ok = f.valid(batch, start + base + t);
      const float y = ok ? W[t] * E[e] * phi_derivative<Policy::phi>(K[e], P[e]) : 0.f;
      store_act<Dev>(bp.dk, bp.dk_stride, batch, start + base + t, h, d, y);
    }
    if constexpr (gated) {
      float s = 0.f;
      for (int d = lane; d < D; d += 32) s += P[warp * D + d] * E[warp * D + d];
      s = warp_sum(s);
      if (lane == 0 && warp < rows) {
        const index_t ta = start + base + warp;
        const float da = f.valid(batch, ta) ? W[warp] * (s - jh) : 0.f;
        if (da_heads != nullptr)
          da_heads[(index_t(h) * bp.batch + batch) * f.tokens + ta] = da;
        else
          bp.da[batch * bp.da_stride[0] + ta * bp.da_stride[1] +
                (f.gate_heads == 1 ? 0 : h) * bp.da_stride[2]] = da;
      }
    }
  }
}

// ---- folds --------------------------------------------------------------------------------

// CTA (256 tokens, sequence n): da[b, t, 0] = sum over KV heads h (in order) of da_heads[h, b, t].
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_fold_da_kernel(const linear_backward_params bp, const float* da_heads) {
  index_t batch, start, length;
  bp.f.sequence(blockIdx.y, batch, start, length);
  const index_t t = index_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= length) return;
  const index_t ta = start + t;
  float s = 0.f;
  for (int h = 0; h < bp.f.kv_heads; ++h)
    s += da_heads[(index_t(h) * bp.batch + batch) * bp.f.tokens + ta];
  bp.da[batch * bp.da_stride[0] + ta * bp.da_stride[1]] = s;
}

// Column sums of a [rows x cols] float matrix whose row r sits at m + r * stride * cols, in a
// fixed order: CTA (x, y) sums runs y, y + gridDim.y, .. of linear_fold_run rows, columns 32 x ..,
// into each run's first row, or, when `out` is given (one run), into out[c * out_stride] (zeros
// for no rows). Passes of it fold the partial dgamma terms (the launcher's fold_dgamma).
constexpr index_t linear_fold_run = 64;
__global__ void __launch_bounds__(linear_bwd_threads)
    linear_bwd_fold_columns_kernel(float* m, index_t rows, index_t cols, index_t stride, float* out,
                                   index_t out_stride) {
  constexpr int lanes = linear_bwd_threads / 32, per_lane = int(linear_fold_run) / lanes;
  __shared__ float part[lanes][32];
  const int cx = threadIdx.x % 32, ly = threadIdx.x / 32;
  const index_t c = index_t(blockIdx.x) * 32 + cx, pitch = stride * cols;
  const index_t runs = rows > 0 ? (rows + linear_fold_run - 1) / linear_fold_run : 1;
  for (index_t run = blockIdx.y; run < runs; run += gridDim.y) {
    const index_t r0 = run * linear_fold_run;
    float s = 0.f;
    if (c < cols) {
      float x[per_lane];
#pragma unroll
      for (int i = 0; i < per_lane; ++i) {
        const index_t r = r0 + i * lanes + ly;
        x[i] = r < rows ? m[r * pitch + c] : 0.f;
      }
#pragma unroll
      for (int i = 0; i < per_lane; ++i) s += x[i];
    }
    part[ly][cx] = s;
    __syncthreads();
    if (ly == 0 && c < cols) {
      float t = 0.f;
#pragma unroll
      for (int i = 0; i < lanes; ++i) t += part[i][cx];
      if (out != nullptr)
        out[c * out_stride] = t;
      else
        m[r0 * pitch + c] = t;
    }
    __syncthreads();
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
