#pragma once
// One PaTH / PaTH-FoX decoding step on CUDA (spec/path_fox.md §3) from a cache that defers the
// transitions (kernels/shapes.hpp: path_decode_flush). For a slot holding L tokens, with
// F = path_decode_flushed(L):
//   keys [0, F)  are in the cache as they were at the last flush (or prefill): kappa_j = M s_j,
//                M the product of the transitions since, a float D x D matrix per slot and head;
//                a step scores them against M^T q and never rewrites them;
//   keys [F, L)  are in float in a ring of recent keys, moved through every transition as they
//                come (kappa <- kappa - beta (w . kappa) w).
// A step runs four kernels: the transition kernel updates M <- H_t M and forms M^T q; the step
// kernel scores every key (the new one appended to the ring) in blocks of `block_keys` keys
// (flash-decoding), the combine kernel merges the blocks' partial softmax states, and every
// path_decode_flush steps the flush kernel stores M s_j and the recent keys in the cache. A
// bfloat16 cache so rounds a key once a flush, not once a step, and a step reads each cached
// key once instead of reading and writing it.
//
// A key is handled by Dmax / 8 consecutive threads holding 8 elements each (one 16- or 32-byte
// vector); D and Dv are multiples of 8.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/split_decode.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

struct path_decode_params {
  // The step's inputs: row n, head h at base + n * stride0 + h * stride2 (one token per row).
  const void* q;
  const void* k;
  const void* v;
  const float* w;
  const float* beta;
  const float* g;  // nullptr: kind::path
  index_t q_s[2], k_s[2], v_s[2], w_s[2], beta_s[2], g_s[2];
  split_decode_parts parts;  // the blocks' partial states, the output and lse
  // The cache: keys [slots, capacity, H, D], values [.., H, Dv], gates [slots, capacity, HQ];
  // recent keys [slots, path_decode_recent, H, D] and transitions M [slots, H, D, D] (float).
  void* keys;
  void* values;
  double* gates;
  float* recent;
  float* transitions;
  index_t capacity;
  float* qm;  // [N, HQ, Dmax]: M^T q * scale * log2(e), the transition kernel's output
  const std::int32_t* rows;  // [N][2]: slot, tokens held before this step
  int q_heads, kv_heads, group, head_dim, value_dim;
  float scale_log2, gate_coef_log2;
  int block_keys;
};

// The transition kernel: M <- H_t M (column c by thread c; M starts as I after a flush or a
// prefill) and qm = M^T q for each query head of the group. Grid (H, N), Dmax threads.
template <class T, int Dmax>
__global__ void __launch_bounds__(128) path_decode_transition_kernel(const path_decode_params p) {
  __shared__ float sw[Dmax], sq[Dmax];
  const int h = blockIdx.x, n = blockIdx.y, c = threadIdx.x;
  const int D = p.head_dim, G = p.group, H = p.kv_heads, HQ = p.q_heads;
  const index_t slot = p.rows[2 * n], L = p.rows[2 * n + 1];
  float* M = p.transitions + (slot * H + h) * D * D;  // M[i][c] at i * D + c
  const float* w = p.w + n * p.w_s[0] + h * p.w_s[1];
  sw[c] = c < D ? w[c] : 0.f;
  const float beta = p.beta[n * p.beta_s[0] + h * p.beta_s[1]];
  const bool fresh = path_decode_fresh_transitions(L);
  __syncthreads();
  if (c < D) {  // (H M)[:, c] = M[:, c] - beta w (w . M[:, c]); each thread only its column
    float t = 0.f;
    if (fresh)
      t = sw[c];
    else
      for (int i = 0; i < D; ++i) t += sw[i] * M[i * D + c];
    t *= beta;
    for (int i = 0; i < D; ++i) {
      const float m = fresh ? (i == c ? 1.f : 0.f) : M[i * D + c];
      M[i * D + c] = m - t * sw[i];
    }
  }
  const T* q = static_cast<const T*>(p.q) + n * p.q_s[0] + (h * G) * p.q_s[1];
  for (int g = 0; g < G; ++g) {
    __syncthreads();
    sq[c] = c < D ? p.scale_log2 * to_float(q[g * p.q_s[1] + c]) : 0.f;
    __syncthreads();
    float s = 0.f;
    if (c < D)
      for (int i = 0; i < D; ++i) s += M[i * D + c] * sq[i];
    p.qm[(static_cast<index_t>(n) * HQ + h * G + g) * Dmax + c] = s;  // zero past D
  }
}

// Grid (splits, H, N), 128 threads. Dynamic shared memory: floats sq [G][Dmax], sqm [G][Dmax],
// sz [G][block_keys], so [4][Dmax].
template <class T, class Store, int Dmax>
__global__ void __launch_bounds__(128) path_decode_kernel(const path_decode_params p) {
  constexpr int threads = 128, lanes = Dmax / 8, per_pass = threads / lanes;
  extern __shared__ float smem[];
  __shared__ float sw[Dmax];
  __shared__ double sgate[32];  // G_L of the group's query heads (group <= 32 when gated)
  __shared__ bool sreset[32];   // whether the new token's gate is -inf (a hard reset)
  const int G = p.group, D = p.head_dim, Dv = p.value_dim, HQ = p.q_heads, H = p.kv_heads;
  const int split = blockIdx.x, h = blockIdx.y, n = blockIdx.z, tid = threadIdx.x;
  float* sq = smem;                   // [G][Dmax], pre-multiplied by scale * log2(e)
  float* sqm = sq + G * Dmax;         // [G][Dmax], M^T q likewise (for keys before F)
  float* sz = sqm + G * Dmax;         // [G][block_keys]
  float* so = sz + G * p.block_keys;  // [4][Dmax] per-warp partial outputs
  const index_t slot = p.rows[2 * n], L = p.rows[2 * n + 1], F = path_decode_flushed(L);
  const index_t j_begin = static_cast<index_t>(split) * p.block_keys;
  const index_t j_end = j_begin + p.block_keys < L + 1 ? j_begin + p.block_keys : L + 1;
  if (j_begin >= j_end) {  // past the end of this row's cache
    split_decode_empty(p.parts, n, h * G, G, split);
    return;
  }

  const T* q = static_cast<const T*>(p.q) + n * p.q_s[0] + (h * G) * p.q_s[1];
  const float* qm = p.qm + (static_cast<index_t>(n) * HQ + h * G) * Dmax;
  for (int idx = tid; idx < G * Dmax; idx += threads) {
    const int g = idx / Dmax, d = idx % Dmax;
    sq[idx] = d < D ? p.scale_log2 * to_float(q[g * p.q_s[1] + d]) : 0.f;
    sqm[idx] = qm[idx];
  }
  const float* w = p.w + n * p.w_s[0] + h * p.w_s[1];
  for (int d = tid; d < Dmax; d += threads) sw[d] = d < D ? w[d] : 0.f;
  const bool gated = p.g != nullptr;
  if (gated && tid < G) {
    // A hard reset (as the CPU has it): every cached key of the head gets G = +inf (weight 0
    // from now on; each block marks its own run below) and the cumsum restarts at 0. Only then
    // is G_(L-1) written, and only when it is not is it read.
    const int hq = h * G + tid;
    const float x = p.g[n * p.g_s[0] + hq * p.g_s[1]];
    sreset[tid] = x == -INFINITY;
    const double prev =
        L > 0 && !sreset[tid] ? p.gates[(slot * p.capacity + L - 1) * HQ + hq] : 0.0;
    sgate[tid] = sreset[tid] ? 0.0 : prev + static_cast<double>(x);
  }
  __syncthreads();
  const float beta = p.beta[n * p.beta_s[0] + h * p.beta_s[1]];

  // Keys: those before F scored against M^T q; the recent ones moved through the transition,
  // written back to the ring and scored against q; the new one appended to the ring.
  const int kl = tid % lanes, d0 = kl * 8;
  const Store* keys = static_cast<const Store*>(p.keys) + (slot * p.capacity * H + h) * D;
  float* recent = p.recent + (slot * path_decode_recent * H + h) * D;
  const T* k_new = static_cast<const T*>(p.k) + n * p.k_s[0] + h * p.k_s[1];
  // Every lane runs every pass (the group sums shuffle across the warp); lanes past the end
  // of the run compute on zeros and store nothing. (Loading several passes' keys ahead into
  // registers measured slower on an H200: register pressure.)
  const bool line_lane = (d0 * sizeof(Store)) % 128 == 0;  // first lane of a 128-byte line
  for (index_t jb = j_begin; jb < j_end; jb += per_pass) {
    const index_t j = jb + tid / lanes;
    const bool live = j < j_end, owns = live && d0 < D, flushed = j < F;
    const Store* kp = keys + j * H * D + d0;
    float* rp = recent + (j % path_decode_recent) * H * D + d0;
    // The key two passes on is asked of L2 now: more bytes in flight without registers to hold
    // them (bf16 cache on an H200: 1.14 -> 1.07 ms; asking for the values too measured slower).
    const index_t ja = j + 2 * per_pass;
    if (line_lane && d0 < D && ja < F && ja < j_end) prefetch_l2(kp + (ja - j) * H * D);
    float x[8] = {};
    if (owns) {
      if (j == L)
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = to_float(k_new[d0 + e]);
      else if (flushed)
        load8(x, kp);
      else
        load8(x, rp);
    }
    // sw and sq are zero past D and x is zero off the run: no lane needs a select.
    const float4 wa = reinterpret_cast<const float4*>(sw + d0)[0],
                 wb = reinterpret_cast<const float4*>(sw + d0)[1];
    const float w8[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
    float c = 0.f;  // every lane takes part in the sum, even where the result is not used
#pragma unroll
    for (int e = 0; e < 8; ++e) c += w8[e] * x[e];
    c = beta * group_sum<lanes>(c);
    if (!flushed && j != L)  // the new key is appended as it is
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] -= c * w8[e];
    if (owns && !flushed) store8(rp, x);
    const float* qs = flushed ? sqm : sq;
    for (int g = 0; g < G; ++g) {
      const float s = split_decode_dot<lanes>(qs + g * Dmax, d0, x);
      if (kl == 0 && live) {
        float z = s;
        if (gated && j != L) {  // the new key's own gate term is 0
          double* Gj = p.gates + (slot * p.capacity + j) * HQ + h * G + g;
          if (sreset[g]) {
            *Gj = INFINITY;
            z = -INFINITY;
          } else {
            z += p.gate_coef_log2 * static_cast<float>(sgate[g] - *Gj);
          }
        }
        sz[g * p.block_keys + (j - j_begin)] = z;
      }
    }
  }
  if (L >= j_begin && L < j_end) {  // append the new token's value and gate cumsum
    Store* vdst = static_cast<Store*>(p.values) + ((slot * p.capacity + L) * H + h) * Dv;
    const T* v_new = static_cast<const T*>(p.v) + n * p.v_s[0] + h * p.v_s[1];
    for (int e = tid; e < Dv; e += threads) vdst[e] = from_float<Store>(to_float(v_new[e]));
    for (int g = tid; g < G; g += threads)
      p.gates[(slot * p.capacity + L) * HQ + h * G + g] = gated ? sgate[g] : 0.0;
  }
  __syncthreads();

  // Per query head: block max, probabilities, sum; then o = sum_j p_j v_j.
  const Store* vals =
      static_cast<const Store*>(p.values) + ((slot * p.capacity + j_begin) * H + h) * Dv;
  for (int g = 0; g < G; ++g)
    split_decode_values<Store, Dmax>(sz + g * p.block_keys, static_cast<int>(j_end - j_begin), vals,
                                     H * Dv, Dv, so, p.parts.ml_at(n, h * G + g, split),
                                     p.parts.o_at(n, h * G + g, split));
}

// The flush, for the rows whose step flushes (path_decode_flushes(L)): keys [0, L - flush) of
// the cache become M s_j, keys [L - flush, L) the ring's (already through this step's
// transition), each rounded once to the cache's type; the next step's transition kernel starts
// M anew. Grid (splits, H, N) as the step kernel, 128 threads; dynamic shared memory
// (path_decode_flush_smem): floats M^T [D][D] and the keys of a pass [128 / Dmax][Dmax].
template <class Store, int Dmax>
__global__ void __launch_bounds__(128) path_decode_flush_kernel(const path_decode_params p) {
  constexpr int threads = 128, per_pass = threads / Dmax;
  extern __shared__ float smem[];
  const int D = p.head_dim, H = p.kv_heads;
  const int split = blockIdx.x, h = blockIdx.y, n = blockIdx.z, tid = threadIdx.x;
  const index_t slot = p.rows[2 * n], L = p.rows[2 * n + 1];
  if (!path_decode_flushes(L)) return;
  const index_t F = L - path_decode_flush;
  const index_t j_begin = static_cast<index_t>(split) * p.block_keys;
  const index_t j_end = j_begin + p.block_keys < L ? j_begin + p.block_keys : L;
  if (j_begin >= j_end) return;
  float* mt = smem;        // M^T: mt[d * D + i] = M[i][d]
  float* sk = mt + D * D;  // [per_pass][Dmax]
  if (j_begin < F) {
    const float* M = p.transitions + (slot * H + h) * D * D;
    for (int idx = tid; idx < D * D; idx += threads) mt[(idx % D) * D + idx / D] = M[idx];
  }
  Store* keys = static_cast<Store*>(p.keys) + (slot * p.capacity * H + h) * D;
  const float* recent = p.recent + (slot * path_decode_recent * H + h) * D;
  const int i = tid % Dmax, sub = tid / Dmax;
  for (index_t jb = j_begin; jb < j_end; jb += per_pass) {
    const index_t j = jb + sub;
    const bool live = j < j_end && i < D;
    __syncthreads();  // mt is written; the last pass's keys are used
    if (live && j < F) sk[sub * Dmax + i] = to_float(keys[j * H * D + i]);
    __syncthreads();
    if (live) {
      float y = 0.f;
      if (j < F)
        for (int d = 0; d < D; ++d) y += mt[d * D + i] * sk[sub * Dmax + d];
      else
        y = recent[(j % path_decode_recent) * H * D + i];
      keys[j * H * D + i] = from_float<Store>(y);
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
