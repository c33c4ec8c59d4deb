#pragma once
// What every linear-attention kernel reads (linear_kernel_params; the backward's
// linear_backward_params), and the block-level helpers the CUDA-core and tensor-core kernels
// share: reductions, the key gate's merges and weights, activation loads and stores, phi'.

#include <cmath>
#include <cstdint>

#include "attnmix/core/linear_policy.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/fast_math.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

struct linear_kernel_params {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const std::uint8_t* mask;  // [B, T] or nullptr
  const float* a;            // key-gate logits [B, T, Hg] or nullptr
  const void* gate;          // gated norm [B, T, HQ, Dv] or nullptr
  const float* gamma;        // [Dv] or [HQ * Dv], or nullptr (ones)
  index_t q_stride[3], k_stride[3], v_stride[3], out_stride[3], gate_stride[3];
  index_t mask_stride[2], a_stride[3], gamma_stride;
  const std::int32_t* cu_seqlens;  // device copy, or nullptr for a dense batch
  index_t tokens;
  int q_heads, kv_heads, group, gate_heads, head_dim, value_dim;
  float scale, eps, norm_eps;
  bool vector_loads;    // k and v rows 16-byte aligned with D, Dv multiples of 16 bytes
  bool q_vector_loads;  // the same for q
  // States [N, H, D, Dv], [N, H, D], [N, H] (any may be nullptr), strides in elements.
  const float* S_in;
  const float* z_in;
  const float* lse_in;
  float* S_out;
  float* z_out;
  float* lse_out;
  index_t S_in_stride[4], z_in_stride[3], lse_in_stride[2];
  index_t S_out_stride[4], z_out_stride[3], lse_out_stride[2];

  __device__ void sequence(int n, index_t& batch, index_t& start, index_t& length) const {
    if (cu_seqlens == nullptr) {
      batch = n, start = 0, length = tokens;
    } else {
      batch = 0, start = cu_seqlens[n], length = cu_seqlens[n + 1] - start;
    }
  }
  __device__ bool valid(index_t batch, index_t t) const {
    return mask == nullptr || mask[batch * mask_stride[0] + t * mask_stride[1]] != 0;
  }
  // Key-gate logit of token t (absolute index in the batch row), -inf at pads.
  __device__ float logit(index_t batch, index_t t, int h) const {
    if (!valid(batch, t)) return -INFINITY;
    return a[batch * a_stride[0] + t * a_stride[1] + (gate_heads == 1 ? 0 : h) * a_stride[2]];
  }
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
// exp(x - m) with m = -inf (nothing seen) giving 0 rather than NaN (fast_exp: see arch/mma.cuh).
__device__ __forceinline__ float shifted_exp(float x, float m) {
  return x == -INFINITY ? 0.f : fast_exp(x - m);
}

// Block-wide reduction of 256 threads through `scratch` (>= 8 floats); every thread gets it.
template <bool Max>
__device__ float block_reduce(float x, float* scratch) {
  x = Max ? warp_max(x) : warp_sum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float y = lane < blockDim.x / 32 ? scratch[lane] : (Max ? -INFINITY : 0.f);
  return Max ? warp_max(y) : warp_sum(y);
}

// The log-sum-exp merge of a head's `partials` partial states, `stride` floats apart, from each
// one's block max and mass (tail[0], tail[1]): M = the largest max of a block with mass, ell =
// sum of mass * exp(max - M). The loads bypass L1: the states may come from other CTAs of the
// running kernel.
__device__ __forceinline__ void partial_gate_merge(const float* tail, index_t partials,
                                                   index_t stride, float* scratch, float& M,
                                                   float& ell) {
  float mx = -INFINITY;
  for (index_t q = threadIdx.x; q < partials; q += blockDim.x)
    if (__ldcg(tail + q * stride + 1) > 0.f) mx = fmaxf(mx, __ldcg(tail + q * stride));
  M = block_reduce<true>(mx, scratch);
  float sum = 0.f;
  for (index_t q = threadIdx.x; q < partials; q += blockDim.x) {
    const float l = __ldcg(tail + q * stride + 1);
    if (l > 0.f) sum += l * __expf(__ldcg(tail + q * stride) - M);
  }
  ell = block_reduce<false>(sum, scratch);
}

// Element idx of a merged state [S | z] (S row-major, then z) to the caller's state_out, and the
// merged gate statistics to its lse_out.
__device__ __forceinline__ void store_state_out(const linear_kernel_params& p, int n, int h,
                                                int idx, float x) {
  const int D = p.head_dim, Dv = p.value_dim;
  if (idx < D * Dv) {
    if (p.S_out != nullptr)
      p.S_out[n * p.S_out_stride[0] + h * p.S_out_stride[1] + (idx / Dv) * p.S_out_stride[2] +
              (idx % Dv) * p.S_out_stride[3]] = x;
  } else if (p.z_out != nullptr) {
    p.z_out[n * p.z_out_stride[0] + h * p.z_out_stride[1] + (idx - D * Dv) * p.z_out_stride[2]] = x;
  }
}
__device__ __forceinline__ void store_lse_out(const linear_kernel_params& p, int n, int h, float M,
                                              float ell) {
  if (p.lse_out != nullptr)
    p.lse_out[n * p.lse_out_stride[0] + h * p.lse_out_stride[1]] =
        ell > 0.f ? M + logf(ell) : -INFINITY;
}

// The largest key-gate logit of tokens [t0, t1) of head h, with all the block's threads.
__device__ __forceinline__ float block_logit_max(const linear_kernel_params& p, index_t batch,
                                                 index_t start, int h, index_t t0, index_t t1,
                                                 float* scratch) {
  float mx = -INFINITY;
  for (index_t t = t0 + threadIdx.x; t < t1; t += blockDim.x)
    mx = fmaxf(mx, p.logit(batch, start + t, h));
  return block_reduce<true>(mx, scratch);
}

// What a backward kernel reads and writes beyond the forward's inputs (in `f`). Strides in
// elements of (batch, token, head) for activations; the innermost stride is 1.
struct linear_backward_params {
  linear_kernel_params f;  // q, k, v, mask, a, gate, gamma, state_in, sizes, scale, eps
  index_t batch;           // B of the views
  const void* dout;
  index_t dout_stride[3];
  bool rows16 = false;      // dout (and the gate) rows 16-byte aligned: the tensor-core query
                            // pass copies them with cp.async
  bool dq_rows16 = false;   // dq rows 16-byte aligned: the query pass writes them in 16-byte pieces
  bool dkv_rows16 = false;  // dk and dv rows 16-byte aligned: the tensor-core key pass writes
                            // them in 16-byte pieces
  void* dq;
  void* dk;
  void* dv;
  void* dgate;
  index_t dq_stride[3], dk_stride[3], dv_stride[3], dgate_stride[3];
  float* da;  // [B, T, Hg]
  index_t da_stride[3];
  float* dgamma;
  index_t dgamma_stride;
  // Bidirectional: the forward's state (saved_S null: recompute).
  const float* saved_S;
  const float* saved_z;
  const float* saved_lse;
  index_t saved_S_stride[4], saved_z_stride[3], saved_lse_stride[2];
  // Causal: the gradient of the final state in, that of the initial state out (any may be null).
  const float* dS_out;
  const float* dz_out;
  float* dS_in;
  float* dz_in;
  index_t dS_out_stride[4], dz_out_stride[3], dS_in_stride[4], dz_in_stride[3];
  // Causal under the prefix key gate: the gradients of the final and initial states' lse.
  const float* dlse_out = nullptr;
  float* dlse_in = nullptr;
  index_t dlse_out_stride[2] = {}, dlse_in_stride[2] = {};
};

template <class Dev>
__device__ __forceinline__ float load_act(const void* base, const index_t* st, index_t b, index_t t,
                                          int h, int d) {
  return to_float(static_cast<const Dev*>(base)[b * st[0] + t * st[1] + h * st[2] + d]);
}
template <class Dev>
__device__ __forceinline__ void store_act(void* base, const index_t* st, index_t b, index_t t,
                                          int h, int d, float x) {
  static_cast<Dev*>(base)[b * st[0] + t * st[1] + h * st[2] + d] = from_float<Dev>(x);
}

// d phi / dx from x and phi(x) (the CPU backend's times_phi_derivative).
template <feature_map F>
__device__ __forceinline__ float phi_derivative(float x, float phi) {
  return phi_derivative_of<F, false>(x, phi);
}

// The normalised key-gate weight of a valid token from its sequence's (max, 1 / sum); 0 at
// pads and in sequences without mass. Without a gate (stats null) 1 for a real token.
__device__ __forceinline__ float gate_weight(const linear_kernel_params& f, const float* stats,
                                             int n, index_t batch, index_t t, int h) {
  if (!f.valid(batch, t)) return 0.f;
  if (stats == nullptr) return 1.f;
  const int gh = f.gate_heads == 1 ? 0 : h;
  const float M = stats[(index_t(n) * f.gate_heads + gh) * 2],
              inv = stats[(index_t(n) * f.gate_heads + gh) * 2 + 1];
  if (!(inv > 0.f)) return 0.f;
  return expf(f.logit(batch, t, h) - M) * inv;
}

// Part `part` of sequence n: its batch row, first token, and token range [t0, t1) (empty past
// the end), for the kernels whose grid is (part, KV head, sequence).
struct part_range {
  index_t batch, start, t0, t1;
  __device__ part_range(const linear_kernel_params& f, int n, int part, index_t part_tokens) {
    index_t length;
    f.sequence(n, batch, start, length);
    t0 = min(length, index_t(part) * part_tokens);
    t1 = min(length, t0 + part_tokens);
  }
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
