#pragma once
// Pieces of the chunked causal linear-attention scan (spec gbla.md §4) that its CUDA-core kernel
// (kernels/linear_causal.cuh) and its tensor-core kernel (kernels/sm80_linear_causal.cuh) share:
// the state carried in, the key gate's running log-sum-exp over a chunk, and a row's output.

#include <cmath>

#include "attnmix/core/linear_policy.hpp"
#include "attnmix/cuda/collective/linear_params.cuh"
#include "attnmix/cuda/collective/linear_rows.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// Element idx of the state carried in from state_in: S (idx < D * Dv, row-major) then z; 0
// where no state is given.
__device__ __forceinline__ float state_in_value(const linear_kernel_params& p, int n, int h,
                                                int idx) {
  const int D = p.head_dim, Dv = p.value_dim;
  if (idx < D * Dv)
    return p.S_in == nullptr
               ? 0.f
               : p.S_in[n * p.S_in_stride[0] + h * p.S_in_stride[1] +
                        (idx / Dv) * p.S_in_stride[2] + (idx % Dv) * p.S_in_stride[3]];
  return p.S_in == nullptr || p.z_in == nullptr
             ? 0.f
             : p.z_in[n * p.z_in_stride[0] + h * p.z_in_stride[1] +
                      (idx - D * Dv) * p.z_in_stride[2]];
}

// Running max and mass of the state carried in: a stored state is normalised, i.e. mass 1 at
// m = lse; no state is mass 0 at m = -inf. Without the key gate m = 0 and ell = 1 throughout.
template <class Policy>
__device__ __forceinline__ void state_in_mass(const linear_kernel_params& p, int n, int h, float& m,
                                              float& ell) {
  if constexpr (Policy::gate == key_gate::off) {
    m = 0.f, ell = 1.f;
  } else {
    m = p.S_in != nullptr ? p.lse_in[n * p.lse_in_stride[0] + h * p.lse_in_stride[1]] : -INFINITY;
    ell = m == -INFINITY ? 0.f : 1.f;
  }
}

// Factor of a state at max m_old when the max becomes m_new; a state that stays empty
// (m_new = -inf) keeps its values.
__device__ __forceinline__ float rescale_factor(float m_old, float m_new) {
  return m_new == -INFINITY ? 1.f : shifted_exp(m_old, m_new);
}

// (max, mass) pairs of the key gate's log-sum-exp: (a, s) + (b, t) = (M, s e^{a-M} + t e^{b-M}).
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  s = M == -INFINITY ? 0.f : s * shifted_exp(m, M) + s2 * shifted_exp(m2, M);
  m = M;
}

// Per-row values of one chunk, causal_chunk floats each, in shared memory.
struct causal_chunk_rows {
  float* valid;    // 1 for a real token
  float* logit;    // gate logit, -inf at pads
  float* run_max;  // u_i: running max including the carried state
  float* carry;    // exp(m - u_i): the carried state's factor at row i
  float* mass;     // ell_i: the gate's softmax mass at row i
  float* wk;       // weight of key j in the carried state after the chunk (valid[j] ungated)
  float* next;     // [2]: m and ell after the chunk
};

// Fills `r` for the chunk of `rows` tokens at absolute index t0 of batch row `batch`, KV head h,
// behind a carried state of max m and mass ell. valid and logit are ready after its barrier;
// the rest (written by warp 0) after the caller's next one.
template <bool Gated>
__device__ __forceinline__ void causal_chunk_gates(const linear_kernel_params& p, index_t batch,
                                                   index_t t0, int rows, int h,
                                                   const causal_chunk_rows& r, float m, float ell) {
  static_assert(causal_chunk == 64, "the gate's scan gives each lane of warp 0 two rows");
  if (threadIdx.x < causal_chunk) {
    const int i = threadIdx.x;
    const bool ok = i < rows && p.valid(batch, t0 + i);
    r.valid[i] = ok ? 1.f : 0.f;
    if (Gated) r.logit[i] = ok ? p.logit(batch, t0 + i, h) : -INFINITY;
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  if constexpr (Gated) {
    // Inclusive log-sum-exp scan of the logits (rows lane and lane + 32), behind the carried
    // state: u_i, ell_i and the carry factor of every row.
    float lo_m = r.logit[lane], lo_s = lo_m == -INFINITY ? 0.f : 1.f;
    float hi_m = r.logit[lane + 32], hi_s = hi_m == -INFINITY ? 0.f : 1.f;
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const float a = __shfl_up_sync(0xffffffffu, lo_m, off),
                  b = __shfl_up_sync(0xffffffffu, lo_s, off),
                  c = __shfl_up_sync(0xffffffffu, hi_m, off),
                  d = __shfl_up_sync(0xffffffffu, hi_s, off);
      if (lane >= off) lse_merge(lo_m, lo_s, a, b), lse_merge(hi_m, hi_s, c, d);
    }
    lse_merge(hi_m, hi_s, __shfl_sync(0xffffffffu, lo_m, 31), __shfl_sync(0xffffffffu, lo_s, 31));
    lse_merge(lo_m, lo_s, m, ell);
    lse_merge(hi_m, hi_s, m, ell);
    const float m_new = __shfl_sync(0xffffffffu, hi_m, 31),
                ell_new = __shfl_sync(0xffffffffu, hi_s, 31);
    r.run_max[lane] = lo_m, r.run_max[lane + 32] = hi_m;
    r.mass[lane] = lo_s, r.mass[lane + 32] = hi_s;
    r.carry[lane] = shifted_exp(m, lo_m), r.carry[lane + 32] = shifted_exp(m, hi_m);
    r.wk[lane] = shifted_exp(r.logit[lane], m_new);
    r.wk[lane + 32] = shifted_exp(r.logit[lane + 32], m_new);
    if (lane == 0) r.next[0] = m_new, r.next[1] = ell_new;
  } else {
    r.wk[lane] = r.valid[lane], r.wk[lane + 32] = r.valid[lane + 32];
  }
}

// Writes row i of the chunk (token t) for query head hq, one warp: num[e] / den (the
// normaliser), or / mass (the key gate without it), then the gated norm; VC values a lane.
template <class T, class Policy, int VC>
__device__ __forceinline__ void causal_write_row(const linear_kernel_params& p, index_t batch,
                                                 index_t t, int hq, const float* num, float den,
                                                 const causal_chunk_rows& r, int i) {
  constexpr bool gated = Policy::gate != key_gate::off;
  const int lane = threadIdx.x % 32, Dv = p.value_dim;
  // Every key-gate logit so far -inf: the row sees no key and is 0, as on the CPU.
  float inv = 1.f;
  if (gated && r.mass[i] == 0.f)
    inv = 0.f;
  else if (Policy::normalize)
    inv = 1.f / den;
  else if (gated)
    inv = 1.f / r.mass[i];
  float o[VC];
#pragma unroll
  for (int c = 0; c < VC; ++c) o[c] = lane + 32 * c < Dv ? num[lane + 32 * c] * inv : 0.f;
  write_row<T, Policy>(p, batch, t, hq, o, r.valid[i] != 0.f);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
